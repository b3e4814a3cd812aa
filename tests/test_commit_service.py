"""The commit service (issue 42): rules that hold against a client that ignores them.

On SeaweedFS with real identities: the service runs as its own process with credentials that
write the whole repository; a writer's credentials write only the immutable objects
(``chunks/``, ``packs/``, ``manifests/``, ``snapshots/``, ``txlogs/``, ``history/``). A writer
commits through the service; a patched client that skips every rule (writes the journal and the
root itself, deletes a tag's record) is refused by the storage, and nothing committed is lost;
the service refuses what the rules refuse even when a client builds the entry by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.format.model import JournalEntry
from zarrlake.refs import new_writer_id
from zarrlake_testkit.servers import start_seaweedfs

BUCKET = "governed"
IMMUTABLE = ("chunks", "packs", "manifests", "snapshots", "txlogs", "history")
WRITER_TOKEN = "writer-token-" + "w" * 16
ADMIN_TOKEN = "admin-token-" + "a" * 16


@dataclass
class Lake:
    endpoint: str
    prefix: str
    url: str
    service_url: str

    def storage(self, who: str) -> zarrlake.Storage:
        key = {"admin": ("admin", "admin-secret"), "writer": ("writer", "writer-secret")}[who]
        return zarrlake.Storage.s3(
            BUCKET,
            self.prefix,
            endpoint_url=self.endpoint,
            region="us-east-1",
            access_key_id=key[0],
            secret_access_key=key[1],
            allow_http=True,
        )


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    prefix = "lake"
    writer = {
        "name": "writer",
        "credentials": [{"accessKey": "writer", "secretKey": "writer-secret"}],
        "actions": ["Read", "List", *(f"Write:{BUCKET}/{prefix}/{p}/*" for p in IMMUTABLE)],
    }
    admin = {
        "name": "admin",
        "credentials": [{"accessKey": "admin", "secretKey": "admin-secret"}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweed-gov"), identities=[writer, admin])
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            region_name="us-east-1",
            aws_access_key_id="admin",
            aws_secret_access_key="admin-secret",
        ).create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def lake(seaweed: Any, tmp_path: Path) -> Iterator[Lake]:
    # The writer's identity writes lake/<kind>/*: each test empties the lake and makes its own.
    prefix = "lake"
    url = f"s3://{BUCKET}/{prefix}?endpoint_url={seaweed.endpoint}&region=us-east-1"
    admin = zarrlake.Storage.s3(
        BUCKET,
        prefix,
        endpoint_url=seaweed.endpoint,
        region="us-east-1",
        access_key_id="admin",
        secret_access_key="admin-secret",
        allow_http=True,
    )
    admin.delete_many([o.key for o in admin.list("")])  # a lake of this test's own
    repo = zarrlake.Repository.create(admin)
    session = repo.writable_session("main")
    t = zarr.open_group(session.store, mode="w").create_array(
        "t", shape=(4, 4), chunks=(2, 2), dtype="f4"
    )
    t.attrs["units"] = "K"
    t[:] = 1.0
    session.commit("seed")
    repo.create_tag("v1", "main")
    repo.protect_branch("main", required_checks=["no-nan"])
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                WRITER_TOKEN: {"identity": "wanda", "role": "writer"},
                ADMIN_TOKEN: {"identity": "ada", "role": "admin"},
            }
        )
    )
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "admin", "AWS_SECRET_ACCESS_KEY": "admin-secret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "zarrlake", "service", url, "--tokens-file", str(tokens),
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "commit service for repository" in line, proc.stderr.read() if proc.stderr else ""
        yield Lake(seaweed.endpoint, prefix, url, line.strip().rsplit(" ", 1)[1].rstrip("/"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _writer(lake: Lake, **kw: Any) -> zarrlake.Repository:
    return zarrlake.Repository.open(
        lake.storage("writer"), commit_service=lake.service_url, commit_token=WRITER_TOKEN, **kw
    )


def _set(repo: zarrlake.Repository, branch: str, value: float, where: Any = (0, 0)) -> str:
    session = repo.writable_session(branch)
    zarr.open_array(session.store, path="t")[where] = value
    return session.commit(f"t{where} = {value}")


def _t(repo: zarrlake.Repository, ref: str = "main") -> np.ndarray:
    return zarr.open_array(repo.readonly_session(ref).store, path="t")[:]


def test_a_writer_commits_branches_and_merges_through_the_service(lake: Lake) -> None:
    writer = _writer(lake)
    assert writer.commit_service is not None
    assert writer.commit_service.whoami()["identity"] == "wanda"
    writer.create_branch("dev")
    first = _set(writer, "dev", 5.0)
    assert writer.lookup_branch("dev") == first
    with pytest.raises(zarrlake.BranchProtected):
        _set(writer, "main", 6.0)  # merges only, said by the service
    merged = writer.merge("dev", "main")
    admin = zarrlake.Repository.open(lake.storage("admin"))
    assert admin.lookup_branch("main") == merged
    assert _t(admin)[0, 0] == 5.0
    assert [c.message for c in admin.log("main", limit=2)][1] == "t(0, 0) = 5.0"
    # The checks run in the service, on the snapshot as stored.
    _set(writer, "dev", float("nan"), (1, 1))
    with pytest.raises(zarrlake.CheckFailed, match="NaN"):
        writer.merge("dev", "main")
    assert admin.lookup_branch("main") == merged
    # Who moved it, as the service's tokens say, not as the commits' authors claim.
    moves = admin.branch_moves("main", limit=1) + admin.branch_moves("dev", limit=1)
    for move in moves:
        assert move["by"]["identity"] == "wanda" and move["by"]["role"] == "writer"
        assert move["by"]["service"] == f"zarrlake-service/{zarrlake.__version__}"
        assert move["by"]["client"].startswith("zarrlake")
    writer.create_tag("v2", merged)
    assert admin.list_tags() == {"v1": admin.lookup_tag("v1"), "v2": merged}
    with pytest.raises(zarrlake.ReadOnlyError, match="admin"):
        writer.delete_tag("v2")


def test_a_client_that_skips_every_rule_cannot_move_a_ref(lake: Lake) -> None:
    admin = zarrlake.Repository.open(lake.storage("admin"))
    head, tag = admin.lookup_branch("main"), admin.lookup_tag("v1")
    before = _t(admin)
    # A patched client: the writer's credentials, no service, every rule switched off.
    rogue = zarrlake.Repository.open(lake.storage("writer"))
    rogue.core.commits.guard = None
    rogue.storage.trust_conditional_writes()
    session = rogue.writable_session("main")
    zarr.open_array(session.store, path="t")[:] = np.nan
    with pytest.raises(zarrlake.StorageError, match=r"refs/branch\.main") as denied:
        session.commit("straight onto main")  # its objects are written; its entry is not
    assert "AccessDenied" in str(denied.value) or "403" in str(denied.value)
    with pytest.raises(zarrlake.StorageError):
        rogue.reset_branch("main", list(admin.log("main"))[-1].id)
    with pytest.raises(zarrlake.StorageError):
        rogue.delete_tag("v1")
    with pytest.raises(zarrlake.StorageError):
        rogue.storage.put("root", b"anything")
    with pytest.raises(zarrlake.StorageError):
        rogue.storage.delete_many([k.key for k in rogue.storage.list("refs/")])
    fresh = zarrlake.Repository.open(lake.storage("admin"))
    assert (fresh.lookup_branch("main"), fresh.lookup_tag("v1")) == (head, tag)
    assert np.array_equal(_t(fresh), before)
    assert fresh.fsck().ok


def test_the_service_refuses_what_the_rules_refuse_in_an_entry_built_by_hand(lake: Lake) -> None:
    writer = _writer(lake)
    admin = zarrlake.Repository.open(lake.storage("admin"))
    head_entry = admin.core.journal.current("main")
    service = writer.commit_service
    assert service is not None
    # A reset of main to its first commit, dressed as anything: the service reads what it is.
    oldest = list(admin.log("main"))[-1].id
    forged = JournalEntry(head_entry.seq + 1, oldest, head_entry.snapshot, head_entry.time,
                          new_writer_id())  # fmt: skip
    with pytest.raises(zarrlake.BranchProtected) as refused:
        service.append("main", forged)
    assert refused.value.rule == "allow_reset"
    # An entry naming a snapshot that is not stored, or carrying other bytes than it.
    with pytest.raises(zarrlake.InvalidArgument, match="not stored"):
        service.append("main", replace(forged, snapshot="0" * 26))
    with pytest.raises(zarrlake.InvalidArgument, match="other bytes"):
        service.append("main", replace(forged, snapshot_data=b"not the snapshot"))
    # A deletion of main and a stale entry.
    with pytest.raises(zarrlake.BranchProtected):
        service.append("main", replace(forged, snapshot=None))
    with pytest.raises(zarrlake.InvalidArgument, match="says the head was"):
        service.append("main", replace(forged, previous=oldest))
    assert zarrlake.Repository.open(lake.storage("admin")).lookup_branch("main") == (
        head_entry.snapshot
    )


def test_a_bad_token_is_refused(lake: Lake) -> None:
    repo = zarrlake.Repository.open(
        lake.storage("writer"), commit_service=lake.service_url, commit_token="x" * 20
    )
    with pytest.raises(zarrlake.ReadOnlyError, match="no valid token"):
        repo.create_branch("dev")
    assert "dev" not in zarrlake.Repository.open(lake.storage("admin")).list_branches()


def test_a_service_started_before_the_first_rule_applies_it(tmp_path: Path) -> None:
    from zarrlake.service import Caller, CommitService

    storage = zarrlake.Storage.local(tmp_path / "repo")
    admin = zarrlake.Repository.create(storage)
    service = CommitService(zarrlake.Repository.open(storage))  # no rules yet
    admin.protect_branch("main")
    # A writer's entry for a direct commit, built as a client builds it.
    writer = zarrlake.Repository.open(storage)
    sent: list[tuple[str, JournalEntry]] = []

    class Capture:
        def append(self, name: str, entry: JournalEntry) -> bool:
            sent.append((name, entry))
            return service.append(Caller("w", "writer"), name, entry.encode())

        def create_tag(self, name: str, snapshot_id: str) -> None:
            raise AssertionError

        def delete_tag(self, name: str) -> None:
            raise AssertionError

    writer.core.journal.remote = Capture()
    writer.core.commits.guard = None  # a client that skips its own rules
    session = writer.writable_session("main")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")
    head = admin.lookup_branch("main")
    with pytest.raises(zarrlake.BranchProtected):
        session.commit("direct, after the rule")
    assert sent and zarrlake.Repository.open(storage).lookup_branch("main") == head


def test_the_service_publishes_the_bytes_it_checked(tmp_path: Path) -> None:
    from zarrlake.format.model import snapshot_key
    from zarrlake.service import Caller, CommitService

    storage = zarrlake.Storage.local(tmp_path / "repo")
    admin = zarrlake.Repository.create(storage)
    service = CommitService(zarrlake.Repository.open(storage))
    writer = zarrlake.Repository.open(storage)
    published: list[JournalEntry] = []

    class Uncarried:
        def append(self, name: str, entry: JournalEntry) -> bool:
            bare = replace(entry, snapshot_data=None)  # a writer that carries nothing
            published.append(bare)
            return service.append(Caller("w", "writer"), name, bare.encode())

        def create_tag(self, name: str, snapshot_id: str) -> None: ...

        def delete_tag(self, name: str) -> None: ...

    writer.core.journal.remote = Uncarried()
    session = writer.writable_session("main")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")[:] = 5
    sid = session.commit("good")
    good = storage.get(snapshot_key(sid))
    # The writer overwrites the snapshot object afterwards (a provider without create-only
    # policies): readers of the head read the entry's copy, the one the service checked.
    storage.put(snapshot_key(sid), b"garbage")
    entry = zarrlake.Repository.open(storage).core.journal.current("main")
    assert entry.snapshot == sid and entry.snapshot_data == good
    assert zarr.open_array(admin.readonly_session("main").store, path="t")[0] == 5
    with pytest.raises(zarrlake.InvalidArgument, match="not a snapshot id"):
        service.append(Caller("w", "writer"), "main", replace(entry, snapshot="../repo").encode())
