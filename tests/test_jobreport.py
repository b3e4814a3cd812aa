"""The job report protocol (``zarrlake.jobreport``): what a maintenance Job writes to its
termination log and the operator reads back. Reports come from real runs on a real repository;
the message must keep the shape that operators released before the module parse with
``json.loads``."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

import pytest

import zarrlake
from cli_helpers import commit_random
from zarrlake.jobreport import MAX_MESSAGE_BYTES, JobReport, job_document

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")


@pytest.fixture
def repo() -> zarrlake.Repository:
    """Five commits on main, each rewriting array ``a``: expiry and GC have work to do."""
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    for i in range(4):
        commit_random(repo, i)
    return repo


def counts_only(doc: Any) -> Any:
    """The message as the CLI wrote it before JobReport existed: the JSON document, lists out."""
    if isinstance(doc, dict):
        return {k: counts_only(v) for k, v in doc.items() if not isinstance(v, list)}
    return doc


def legacy_operator_fields(text: str) -> dict[str, Any] | None:
    """What operators released before JobReport read from a termination message."""
    report = json.loads(text)
    if not isinstance(report, dict):
        return None
    expire = report.get("expire") or {}
    fields = {
        "snapshotsExpired": expire.get("expired_snapshots"),
        "objectsDeleted": report.get("deleted_objects"),
        "bytesFreed": report.get("deleted_bytes"),
        "chunksPacked": report.get("packed_chunks"),
    }
    return {k: v for k, v in fields.items() if v is not None}


def test_gc_after_expire_round_trips(repo: zarrlake.Repository) -> None:
    expired = repo.expire({"default": {"last": 1}})
    gc = repo.gc(grace=dt.timedelta(0), force=True)
    report = JobReport.from_reports(gc, expired)
    assert report.snapshots_expired == len(expired.expired) == 4  # init + 3 of 4 commits
    assert report.objects_deleted == gc.deleted_objects > 0
    assert report.bytes_freed == gc.deleted_bytes > 0
    assert report.chunks_packed is None

    message = report.to_message()
    assert JobReport.parse(message) == report
    # Today's exact shape: the --json document, compact, without the list of expired ids.
    doc = job_document(gc, expired)
    assert doc["expire"]["expired"] == list(expired.expired)
    assert message == json.dumps(counts_only(doc), separators=(",", ":"))
    assert legacy_operator_fields(message) == {
        "snapshotsExpired": 4,
        "objectsDeleted": gc.deleted_objects,
        "bytesFreed": gc.deleted_bytes,
    }


def test_gc_alone_expire_alone_and_compact(repo: zarrlake.Repository) -> None:
    gc = JobReport.from_reports(repo.gc(grace=dt.timedelta(0), force=True))
    assert gc.snapshots_expired is None and gc.objects_deleted == 0
    assert "expire" not in json.loads(gc.to_message())

    expire = JobReport.from_reports(repo.expire({"default": {"last": 2}}))
    assert expire.snapshots_expired == 3 and expire.objects_deleted is None
    assert json.loads(expire.to_message())["expired_snapshots"] == 3  # not nested: no GC ran

    compact = repo.compact()
    report = JobReport.from_reports(compact)
    assert report.chunks_packed == compact.packed_chunks == 4
    assert (report.snapshots_expired, report.objects_deleted, report.bytes_freed) == (None,) * 3
    assert json.loads(report.to_message())["snapshot"] == repo.lookup_branch("main")
    for r in (gc, expire, report):
        assert JobReport.parse(r.to_message()) == r
        assert r.to_message() == json.dumps(counts_only(r.counts), separators=(",", ":"))


def test_messages_of_older_clients_parse() -> None:
    """The operator's test fixtures: what the CLI wrote before JobReport existed."""
    gc = (
        '{"deleted_objects":12,"deleted_bytes":12288,"kept_objects":30,"kept_bytes":40000,'
        '"dry_run":false,"marked_snapshots":2,"skipped_young":0,"by_kind":{"chunk":'
        '{"deleted":12}},"duration_s":0.5,"expire":{"expired_snapshots":4,'
        '"retained_snapshots":2,"dry_run":false}}'
    )
    report = JobReport.parse(gc)
    assert report is not None
    assert (report.snapshots_expired, report.objects_deleted, report.bytes_freed) == (4, 12, 12288)
    assert report.to_message() == gc
    compact = JobReport.parse('{"branch": "main", "packed_chunks": 40, "packed_bytes": 4096}\n')
    assert compact is not None and compact.chunks_packed == 40 and compact.objects_deleted is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Traceback (most recent call last):\n  File ...\nzarrlake: error: cannot reach s3://b\n",
        "zarrlake: error: storage went away",
        "42",
        "null",
        '["a", "b"]',
        '{"deleted_objects": ',  # a log tail cut mid-document
        '{"deleted_objects": "many"}',
        '{"deleted_objects": -1}',
        '{"packed_chunks": true}',
        '{"expire": {"expired_snapshots": 1.5}}',
        "[" * 100_000,
    ],
)
def test_text_that_is_not_a_report_parses_to_none(text: str) -> None:
    assert JobReport.parse(text) is None


@dataclass
class BigExpireReport:
    """An expiry of a huge history over many branches, as ``to_json`` documents it."""

    expired: list[str] = field(default_factory=lambda: [f"{i:020d}" for i in range(20_000)])
    branches: int = 2_000

    def to_json(self) -> dict[str, Any]:
        return {
            "expired_snapshots": len(self.expired),
            "expired": self.expired,
            "retained_snapshots": self.branches,
            "retained_by_branch": {f"feature/branch-{i:05d}": 1 for i in range(self.branches)},
            "dry_run": False,
            "duration_s": 12.5,
        }


def test_message_fits_a_termination_message_with_many_expired_snapshots(
    repo: zarrlake.Repository,
) -> None:
    few_branches = JobReport.from_reports(BigExpireReport(branches=3))
    message = few_branches.to_message()
    assert len(message.encode()) < MAX_MESSAGE_BYTES  # 20,000 ids are not in it
    assert json.loads(message)["retained_by_branch"] == {
        f"feature/branch-{i:05d}": 1 for i in range(3)
    }

    # Thousands of per-branch counts do not fit: they go, the counts the operator shows stay.
    gc = repo.gc(grace=dt.timedelta(0), force=True)
    for report in (
        JobReport.from_reports(BigExpireReport()),
        JobReport.from_reports(gc, BigExpireReport()),
    ):
        message = report.to_message()
        assert len(message.encode()) < MAX_MESSAGE_BYTES
        parsed = JobReport.parse(message)
        assert parsed is not None
        assert parsed.snapshots_expired == report.snapshots_expired == 20_000
        assert (parsed.objects_deleted, parsed.bytes_freed) == (
            report.objects_deleted,
            report.bytes_freed,
        )
        assert "retained_by_branch" not in message
    assert legacy_operator_fields(JobReport.from_reports(gc, BigExpireReport()).to_message()) == {
        "snapshotsExpired": 20_000,
        "objectsDeleted": gc.deleted_objects,
        "bytesFreed": gc.deleted_bytes,
    }


def test_a_report_is_a_value() -> None:
    report = JobReport({"packed_chunks": 3, "branch": "main"})
    assert report == JobReport.parse('{"packed_chunks":3,"branch":"main"}')
    assert hash(report) == hash(JobReport({"packed_chunks": 3, "branch": "main"}))
    as_any: Any = report  # what the type checker forbids, done anyway, must fail at run time
    with pytest.raises(FrozenInstanceError):
        as_any.chunks_packed = 4
    with pytest.raises(ValueError):
        JobReport({"deleted_bytes": "12 KiB"})
