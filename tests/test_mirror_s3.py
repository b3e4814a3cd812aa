"""Transactional mirroring between two regions: two S3 API servers (moto, over HTTP on loopback),
and a local directory to S3.

Besides mirroring and reading at the destination: what a promotion costs at the destination (it
asks about new objects only), a promoter process killed with SIGKILL mid-copy and mid-promotion
(restarted, it resumes and loses nothing), and a destination that rejects writes for a while.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import zarrlake as zl
from mirror_helpers import read_all, replicate, write, write_chunks
from zarrlake.mirror import Mirror
from zarrlake.storage.base import Buffer, StorageError, TransientStorageError
from zarrlake_testkit.counting import CountingStorage, Counts
from zarrlake_testkit.servers import start_moto, stop

# Chunks as objects of their own: what these tests count (see conftest).
pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("chunk_objects")]

BUCKET = "zarrlake-mirror"


@dataclass
class Region:
    """One moto server: an S3 region of its own."""

    name: str
    endpoint: str
    proc: subprocess.Popen[bytes]

    def storage(self, prefix: str | None = None) -> zl.Storage:
        return zl.Storage.s3(
            BUCKET,
            prefix or f"m-{uuid.uuid4().hex[:12]}",
            endpoint_url=self.endpoint,
            region=self.name,
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
        )

    def keys(self, storage: zl.Storage) -> set[str]:
        return set(storage.list_keys(""))


@pytest.fixture(scope="module")
def regions() -> Iterator[tuple[Region, Region]]:
    """Two moto servers on loopback ports, one bucket each; stopped by process id."""
    import boto3

    started: list[Region] = []
    try:
        for name in ("us-east-1", "eu-west-1"):
            proc, endpoint = start_moto()
            started.append(Region(name, endpoint, proc))
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name=name,
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            ).create_bucket(
                Bucket=BUCKET,
                **(
                    {}
                    if name == "us-east-1"
                    else {"CreateBucketConfiguration": {"LocationConstraint": name}}
                ),
            )
        yield started[0], started[1]
    finally:
        for region in started:
            stop(region.proc)


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _objects(storage: zl.Storage) -> set[str]:
    """A source's immutable objects (what a mirror must hold): all but its refs, its marker
    and its published root (a mirror publishes its own, under ``mirror/``)."""
    return {
        k for k in storage.list_keys("") if not k.startswith("refs/") and k not in ("repo", "root")
    }


# -- mirroring across regions ---------------------------------------------------------------------


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "external"])
def test_s3_to_s3_across_two_servers(regions: tuple[Region, Region], copy: bool):
    east, west = regions
    source = zl.Repository.create(east.storage())
    dest = west.storage()
    first = write(source, "main", 1, "one", n=32)
    source.create_tag("v1", "main")
    source.create_branch("dev", "main")
    write_chunks(source, "dev", 2, [0, 5, 31], "on dev")
    second = write_chunks(source, "main", 3, range(8), "two")

    m = Mirror(source, dest, copy=copy)
    if not copy:
        assert m.step().ref("main").mirrored_head is None  # nothing has arrived
        replicate(source.storage, dest)  # bucket replication, journal and marker included
    status = m.step()

    assert status.up_to_date, status
    assert (status.copied_objects > 32) == copy
    # The objects are at the second server, the mirror's own objects only there.
    assert _objects(source.storage) <= west.keys(dest)
    assert not any(k.startswith("mirror/") for k in east.keys(source.storage))
    mirror = zl.Repository.open(dest)
    assert mirror.record.mirror_of == source.storage.url
    assert mirror.list_branches() == source.list_branches()
    assert mirror.list_tags() == {"v1": first}
    for ref in ("main", "dev", "v1", second):
        assert _same(read_all(mirror, ref), read_all(source, ref))
    assert [c.id for c in mirror.log("dev")] == [c.id for c in source.log("dev")]
    assert mirror.fsck().ok
    with pytest.raises(zl.ReadOnlyError, match="read-only mirror"):
        mirror.create_branch("x", "main")


def test_local_directory_to_s3(regions: tuple[Region, Region], tmp_path: Path):
    _, west = regions
    source = zl.Repository.create(zl.Storage.local(tmp_path / "source"))
    dest = west.storage()
    m = Mirror(source, dest)
    shown = [write(source, "main", 1, "one", n=32)]
    assert m.step().up_to_date
    shown.append(write_chunks(source, "main", 2, [3, 4], "two"))
    status = m.step()
    assert status.up_to_date and status.promoted == ("branch main",)
    assert status.copied_objects == 2 + 3  # two chunks, a snapshot, its txlog, a manifest shard

    mirror = zl.Repository.open(dest)
    assert mirror.lookup_branch("main") == shown[-1]
    for sid in shown:  # every head the mirror showed stays readable by id
        assert _same(read_all(mirror, sid), read_all(source, sid))
    assert mirror.fsck().ok


# -- presence: a promotion asks about new objects only --------------------------------------------


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "external"])
def test_a_promotion_costs_o_k_requests_not_o_repository(
    regions: tuple[Region, Region], tmp_path: Path, copy: bool
):
    east, west = regions
    source = zl.Repository.create(east.storage())
    counts = Counts(record_keys=True)
    dest = CountingStorage(west.storage(), counts)
    # A repository of many objects: 2 x 192 chunk objects and their metadata.
    write(source, "main", 1, "one", n=192)
    write(source, "main", 2, "two", n=192)
    m = Mirror(source, dest, copy=copy)
    if not copy:
        replicate(source.storage, dest)
    assert m.step().up_to_date
    in_repository = len(_objects(source.storage))
    assert in_repository > 2 * 192

    seed = 3
    for k in (1, 4, 16):
        seed += 1
        old = _objects(source.storage)
        write_chunks(source, "main", seed, range(0, 12 * k, 12), f"{k} chunks")
        new = _objects(source.storage) - old
        # k chunks, the snapshot, its txlog, the rewritten manifest shards (one per chunk here
        # at most), maybe a history page.
        assert k + 2 < len(new) <= 2 * k + 3, sorted(new)
        if not copy:
            fresh = new | set(source.storage.list_keys("refs/"))  # and the journal
            replicate(source.storage, dest, keep=fresh.__contains__)
        counts.reset()
        status = m.step()
        assert status.up_to_date, status
        ops = counts.by_op()
        checks = ops.get("head", 0)
        puts = ops.get("put", 0) + ops.get("put_create_only", 0)
        detail = f"k={k}, {len(new)} new objects of {in_repository}: {ops}"
        assert status.checked_objects == len(new), detail
        if copy:
            # Copied without asking first: one put each, then the journal entry and one
            # presence record.
            assert checks == 0, detail
            assert status.copied_objects == len(new)
            assert puts == len(new) + 2, detail
        else:
            assert checks == len(new), detail
            assert puts == 2, detail  # the journal entry and one presence record
        assert counts.total <= 2 * len(new) + 12, detail
    assert _same(read_all(zl.Repository.open(dest), "main"), read_all(source, "main"))


# -- a promoter killed with SIGKILL ---------------------------------------------------------------

# A promoter process: one pass of Mirror(SOURCE, DEST) with copy=True. Its destination storage
# is the real one behind a forwarding wrapper that prints "now" (and, at a promotion point,
# holds that write back so the parent can kill the process right there) when the pass reaches
# the point the test kills it at:
#   mid-copy          100 chunk objects have landed (further chunk writes are held back);
#   before-ref-write  every object copied, the branch's journal entry not yet written;
#   after-ref-write   the journal entry written, the pass's last presence record not yet.
PROMOTER = r"""
import sys, threading, time
import zarrlake as zl
from zarrlake.mirror import Mirror
from zarrlake_testkit.counting import CountingStorage

source_url, dest_url, point = sys.argv[1:4]
lock = threading.Lock()
state = {"chunks": 0, "promoted": False}

def now(say):
    if say:
        print("now", flush=True)
    time.sleep(120)

class Announcing(CountingStorage):
    def put(self, key, data, *, create_only=False):
        if point == "before-ref-write" and key.startswith("mirror/refs/branch."):
            now(True)
        if point == "after-ref-write" and key.startswith("mirror/present/") and state["promoted"]:
            now(True)
        super().put(key, data, create_only=create_only)
        if key.startswith("mirror/refs/branch."):
            state["promoted"] = True
        if point == "mid-copy" and key.startswith("chunks/"):
            with lock:
                state["chunks"] += 1
                n = state["chunks"]
            if n > 100:
                now(n == 101)
            super().put(key, data, create_only=create_only)
            return

source = zl.Repository.open(zl.Storage.from_url(source_url))
Mirror(source, Announcing(zl.Storage.from_url(dest_url))).step()
print("done", flush=True)
"""


def _run_until_killed(source_url: str, dest_url: str, point: str) -> None:
    """Start a promoter process, SIGKILL it (by its pid) when it says it reached ``point``."""
    # The venv holds zarrlake and the test kit; not this process's sys.path, which other tests
    # may have extended with folders of their own (one held an "operator.py").
    env = dict(os.environ)
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [sys.executable, "-c", PROMOTER, source_url, dest_url, point],
        stdout=subprocess.PIPE,
        stderr=errors,
        env=env,
    )
    timer = threading.Timer(120, proc.kill)  # a safety net: never leave it running
    timer.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if line != "now":
            proc.wait(30)
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-3000:]
            raise AssertionError(f"the promoter ended before {point}: {line!r}\n{tail}")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        timer.cancel()
        errors.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("point", ["mid-copy", "before-ref-write", "after-ref-write"])
def test_a_promoter_killed_mid_pass_resumes_and_loses_nothing(
    regions: tuple[Region, Region], point: str
):
    east, west = regions
    source = zl.Repository.create(east.storage())
    dest = west.storage()
    before = write(source, "main", 1, "small", n=8)
    assert Mirror(source, dest).step().up_to_date
    large = write(source, "main", 2, "large", n=300, path="b")
    needed = _objects(source.storage) - west.keys(dest)
    assert len(needed) > 300

    _run_until_killed(source.storage.url, dest.url, point)

    # What a reader sees after the kill: a whole commit, the old or the new one, never a part.
    landed = needed & west.keys(dest)
    mirror = zl.Repository.open(dest)
    shown = mirror.lookup_branch("main")
    assert shown == (large if point == "after-ref-write" else before)
    assert _same(read_all(mirror, "main"), read_all(source, shown))
    if point == "mid-copy":
        assert 100 <= len(landed) < len(needed) - 100
    else:
        assert landed == needed

    # Restarted: it resumes (what was saved as present is not copied again) and loses nothing.
    status = Mirror(source, dest).step()
    assert status.up_to_date, status
    # Unsaved at the kill: fewer than SAVE_EVERY copied objects, and the copies in flight.
    assert status.copied_objects <= len(needed) - len(landed) + Mirror.SAVE_EVERY + dest.concurrency
    assert status.promoted == (() if point == "after-ref-write" else ("branch main",))
    assert needed <= west.keys(dest)
    mirror = zl.Repository.open(dest)
    assert mirror.lookup_branch("main") == large
    assert _same(read_all(mirror, "main"), read_all(source, "main"))
    assert [e.snapshot for e in mirror.core.journal.history("main")] == [large, before]
    assert mirror.fsck().ok


# -- a destination that rejects writes for a while ------------------------------------------------


class RejectingWrites(CountingStorage):
    """The destination, refusing every write while :attr:`rejecting` is set (an outage, a
    revoked permission, throttling); reads keep working."""

    def __init__(self, inner: zl.Storage, error: type[StorageError]) -> None:
        super().__init__(inner)
        self.error = error
        self.rejecting = threading.Event()

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        if self.rejecting.is_set():
            code = "SlowDown" if self.error is TransientStorageError else "AccessDenied"
            raise self.error(f"S3 {code} on {key}")
        super().put(key, data, create_only=create_only)


@pytest.mark.parametrize(
    ("copy", "error"),
    [
        (True, StorageError),
        (True, TransientStorageError),
        (False, StorageError),
    ],
    ids=["copy-denied", "copy-throttled", "external-denied"],
)
def test_a_destination_rejecting_writes_reports_the_error_then_recovers(
    regions: tuple[Region, Region], copy: bool, error: type[StorageError]
):
    east, west = regions
    source = zl.Repository.create(east.storage())
    dest = RejectingWrites(west.storage(), error)
    before = write(source, "main", 1, "one", n=16)
    m = Mirror(source, dest, copy=copy)
    if not copy:
        replicate(source.storage, dest)
    assert m.step().up_to_date
    after = write_chunks(source, "main", 2, range(16), "two")
    if not copy:
        replicate(source.storage, dest.inner)  # replication writes; the promoter may not

    dest.rejecting.set()
    for _ in range(2):  # pass after pass while the outage lasts
        ref = m.step().ref("main")
        assert ref.error is not None and ref.kind == "branch", ref
        assert (ref.source_head, ref.mirrored_head) == (after, before)
        assert ref.commits_behind == 1 and not ref.up_to_date
        mirror = zl.Repository.open(dest.inner)
        assert mirror.lookup_branch("main") == before
        assert _same(read_all(mirror, "main"), read_all(source, before))
        assert mirror.fsck().ok

    dest.rejecting.clear()
    status = m.step()
    assert status.up_to_date and status.promoted == ("branch main",), status
    assert status.ref("main").error is None
    mirror = zl.Repository.open(dest.inner)
    assert mirror.lookup_branch("main") == after
    assert _same(read_all(mirror, "main"), read_all(source, "main"))
    assert mirror.fsck().ok
