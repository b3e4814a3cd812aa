"""Transactional mirroring: the promoter, the copier and the read-only destination.

Local directories as source and destination here (S3 → S3 across two servers, adversarial
replication and faults are in their own modules). Every assertion about what a mirror shows is
checked against the source's data for the same snapshot.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

import zarrlake as zl
from mirror_helpers import chunk_keys, data, read, replicate, write
from zarrlake.format.model import MIRROR_REPO_KEY, REPO_KEY, LeaseRecord, RepoRecord, lease_key
from zarrlake.locks import LocalLock
from zarrlake.mirror import Mirror
from zarrlake.mirror.lease import DestinationLease
from zarrlake_testkit.counting import CountingStorage, Counts

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")


@pytest.fixture
def source(tmp_path: Path) -> zl.Repository:
    return zl.Repository.create(zl.Storage.local(tmp_path / "source"))


@pytest.fixture
def dest(tmp_path: Path) -> zl.Storage:
    return zl.Storage.local(tmp_path / "dest")


def test_copy_mode_mirrors_branches_tags_and_history(source: zl.Repository, dest: zl.Storage):
    first = write(source, "main", 0, "one")
    source.create_tag("v1", "main")
    source.create_branch("dev", "main")
    write(source, "dev", 100, "on dev")

    status = Mirror(source, dest).step()

    assert status.up_to_date
    assert status.copied_objects > 64
    mirror = zl.Repository.open(dest)
    assert mirror.record.mirror_of == source.storage.url
    assert mirror.id == source.id
    assert mirror.list_branches() == source.list_branches()
    assert mirror.list_tags() == {"v1": first}
    for ref in ("main", "dev", "v1"):
        np.testing.assert_array_equal(read(mirror, ref), read(source, ref))
    assert [c.id for c in mirror.log("dev")] == [c.id for c in source.log("dev")]
    assert mirror.fsck().ok


def test_every_write_to_a_mirror_is_refused_naming_the_source(
    source: zl.Repository, dest: zl.Storage
):
    write(source, "main", 0, "one")
    source.create_tag("v1", "main")
    source.create_branch("dev", "main")
    Mirror(source, dest).step()
    mirror = zl.Repository.open(dest)
    attempts = {
        "writable_session": lambda: mirror.writable_session("main"),
        "transaction": lambda: mirror.transaction("main", message="m").__enter__(),
        "create_branch": lambda: mirror.create_branch("x", "main"),
        "reset_branch": lambda: mirror.reset_branch("main", "v1"),
        "delete_branch": lambda: mirror.delete_branch("dev"),
        "create_tag": lambda: mirror.create_tag("v2", "main"),
        "delete_tag": lambda: mirror.delete_tag("v1"),
        "merge": lambda: mirror.merge("main", "main"),
        "expire": lambda: mirror.expire(zl.RetentionRules(default=zl.Keep(last=1))),
        "gc": lambda: mirror.gc(),
        "compact": lambda: mirror.compact(),
    }
    for what, attempt in attempts.items():
        with pytest.raises(zl.ReadOnlyError, match=r"read-only mirror of .*source") as caught:
            attempt()
        assert source.storage.url in str(caught.value), what
    # Nothing moved: the mirror still shows exactly the source.
    assert mirror.list_branches() == source.list_branches()
    assert mirror.list_tags() == source.list_tags()
    assert zarr.open_array(mirror.readonly_session("main").store, path="a", mode="r").read_only


def test_a_pass_promotes_only_the_newest_head_and_history_stays_whole(
    source: zl.Repository, dest: zl.Storage
):
    m = Mirror(source, dest)
    write(source, "main", 0, "c0")
    m.step()
    heads = [write(source, "main", i, f"c{i}") for i in range(1, 6)]

    before = m.status().ref("main")
    assert (before.source_head, before.commits_behind) == (heads[-1], 5)
    status = m.step()

    assert status.promoted == ("branch main",)
    mirror = zl.Repository.open(dest)
    assert mirror.lookup_branch("main") == heads[-1]
    # One promotion: the destination's journal moved once, from c0's head to c5's.
    entries = mirror.core.journal.history("main")
    assert [e.snapshot for e in entries[:2]] == [heads[-1], list(source.log("main"))[5].id]
    # log() on the mirror walks every commit, intermediate ones included.
    assert [c.message for c in mirror.log("main")] == [c.message for c in source.log("main")]
    np.testing.assert_array_equal(read(mirror, "main"), read(source, "main"))


def test_only_the_branches_asked_for_are_mirrored(source: zl.Repository, dest: zl.Storage):
    write(source, "main", 0, "one")
    for name in ("release/1", "release/2", "scratch"):
        source.create_branch(name, "main")
    status = Mirror(source, dest, branches=["release/*"], tags=False).step()
    assert {r.name for r in status.refs} == {"release/1", "release/2"}
    assert set(zl.Repository.open(dest).list_branches()) == {"release/1", "release/2"}


def test_deleted_branches_and_tags_go_from_the_mirror(source: zl.Repository, dest: zl.Storage):
    write(source, "main", 0, "one")
    source.create_branch("dev", "main")
    source.create_tag("v1", "main")
    m = Mirror(source, dest)
    m.step()
    source.delete_branch("dev")
    source.delete_tag("v1")

    status = m.step()

    assert set(status.promoted) == {"branch dev (deleted)", "tag v1 (deleted)"}
    mirror = zl.Repository.open(dest)
    assert set(mirror.list_branches()) == {"main"}
    assert mirror.list_tags() == {}
    with pytest.raises(zl.RefNotFound):
        mirror.lookup_tag("v1")
    assert m.step().promoted == ()  # nothing left to do: deletes are not repeated


def test_external_mode_waits_for_every_object_and_never_reads_replicated_refs(
    source: zl.Repository, dest: zl.Storage
):
    write(source, "main", 0, "one")
    m = Mirror(source, dest, copy=False)
    assert m.step().ref("main").missing_objects > 64  # nothing has arrived yet

    # Replication brings everything but one chunk object: the source's journal and marker too.
    chunk = next(k for k in source.storage.list_keys("chunks/"))
    withheld = replicate(source.storage, dest, keep=lambda k: k != chunk)
    assert withheld == [chunk]
    assert RepoRecord.decode(dest.get(REPO_KEY)).mirror_of is None  # the source's marker
    status = m.step()
    assert status.ref("main").missing_objects == 1
    assert status.ref("main").mirrored_head is None
    mirror = zl.Repository.open(dest)
    assert mirror.record.mirror_of is not None
    assert mirror.list_branches() == {}  # the replicated journal is not the mirror's
    with pytest.raises(zl.RefNotFound):
        mirror.readonly_session("main")

    dest.put(chunk, source.storage.get(chunk))
    status = m.step()
    assert status.up_to_date and status.checked_objects == 1 and status.copied_objects == 0
    np.testing.assert_array_equal(read(zl.Repository.open(dest), "main"), read(source, "main"))


@pytest.mark.parametrize("copy", [False, True], ids=["external", "copy"])
def test_a_restarted_mirror_checks_only_objects_it_has_not_seen(
    source: zl.Repository, tmp_path: Path, copy: bool
):
    counts = Counts()
    dest = CountingStorage(zl.Storage.local(tmp_path / "dest"), counts)
    write(source, "main", 0, "one", n=200)
    if not copy:
        replicate(source.storage, dest)
    Mirror(source, dest, copy=copy).step()

    # A new promoter (a restart) reads the presence records, then checks nothing old.
    m = Mirror(source, dest, copy=copy)
    counts.reset()
    assert m.step().checked_objects == 0
    assert counts.by_op().get("head", 0) == 0

    # A commit that changes 3 chunks: a pass considers those 3, the new snapshot, its txlog and
    # the new manifest shard, not the 200 chunks already there. The copier copies them without
    # asking first; in external mode each is asked about once.
    with source.transaction("main", message="three chunks") as store:
        zarr.open_array(store, path="a", mode="r+")[:3072] = np.arange(3072, dtype="i4") * 7919
    if not copy:
        replicate(source.storage, dest)
    counts.reset()
    status = m.step()
    assert status.up_to_date
    assert status.checked_objects == 3 + 3
    if copy:
        assert (status.copied_objects, counts.by_op().get("head", 0)) == (6, 0)
    else:
        assert (status.copied_objects, counts.by_op().get("head", 0)) == (0, 6)


def test_a_destination_holding_another_repository_is_refused(source: zl.Repository, tmp_path: Path):
    other = zl.Repository.create(zl.Storage.local(tmp_path / "other"))
    with pytest.raises(zl.RepositoryExists, match="holds repository"):
        Mirror(source, other.storage)
    assert not other.storage.exists(MIRROR_REPO_KEY)

    dest = zl.Storage.local(tmp_path / "dest")
    Mirror(other, dest).step()
    with pytest.raises(zl.RepositoryExists, match="mirrors repository"):
        Mirror(source, dest)


def test_a_crashed_copy_resumes_and_loses_nothing(source: zl.Repository, dest: zl.Storage):
    write(source, "main", 0, "one", n=100)

    class Crash(Exception):
        pass

    def crash_after_80(done: int, total: int) -> None:
        if done >= 80:
            raise Crash

    with pytest.raises(Crash):
        Mirror(source, dest, progress=crash_after_80).step()
    mirror = zl.Repository.open(dest)
    assert mirror.list_branches() == {}  # nothing promoted mid-copy

    status = Mirror(source, dest).step()
    assert status.up_to_date
    # The crashed pass saved what it had copied every 64 objects: that is not copied again.
    assert status.copied_objects <= 105 - Mirror.SAVE_EVERY
    np.testing.assert_array_equal(read(zl.Repository.open(dest), "main"), read(source, "main"))


def test_status_reports_lag_in_commits_and_seconds(source: zl.Repository, dest: zl.Storage):
    write(source, "main", 0, "one")
    m = Mirror(source, dest, copy=False)
    status = m.step().ref("main")
    assert status.commits_behind == 2  # "one" and the initial commit
    assert status.seconds_behind >= 0
    assert status.last_promotion is None
    replicate(source.storage, dest)
    done = m.step().ref("main")
    assert (done.commits_behind, done.seconds_behind, done.missing_objects) == (0, 0.0, 0)
    assert done.last_promotion is not None
    assert dt.datetime.now(dt.UTC) - done.last_promotion < dt.timedelta(minutes=1)
    assert m.status().to_json()["refs"][0]["mirrored_head"] == source.lookup_branch("main")
    # A promoter that never promoted (restarted, or only reading) knows it from the journal.
    fresh = Mirror(source, dest, copy=False, create=False).status().ref("main")
    assert fresh.last_promotion == zl.Repository.open(dest).core.journal.head("main").time
    assert abs(fresh.last_promotion - done.last_promotion) < dt.timedelta(seconds=5)


def test_mirror_gc_deletes_what_no_mirror_ref_reaches_and_keeps_the_rest(
    source: zl.Repository, dest: zl.Storage
):
    write(source, "main", 1, "old data")
    m = Mirror(source, dest)
    m.step()
    old_chunks = chunk_keys(dest)
    write(source, "main", 2, "new data")  # every chunk rewritten
    m.step()
    new_chunks = chunk_keys(dest) - old_chunks
    assert len(new_chunks) == 64

    # The source takes the old commits out of history and collects them.
    source.expire(zl.RetentionRules(default=zl.Keep(last=1)))
    source.gc(grace=dt.timedelta(0), force=True)
    assert not chunk_keys(source.storage) & old_chunks
    m.step()  # brings the expiry records: history at the mirror ends where the source's does

    mirror = zl.Repository.open(dest)
    with pytest.raises(zl.ReadOnlyError, match=r"Mirror\.gc"):
        mirror.gc(grace=dt.timedelta(0), force=True)
    dry = m.gc(grace=dt.timedelta(0), force=True, dry_run=True)
    assert dry.by_kind["chunks"].deleted == 64 and chunk_keys(dest) >= old_chunks
    report = m.gc(grace=dt.timedelta(0), force=True)

    assert report.by_kind["chunks"].deleted == 64
    assert chunk_keys(dest) == new_chunks
    np.testing.assert_array_equal(read(mirror, "main"), data(2))
    assert mirror.fsck().ok
    # The promoter forgot what it knew: data the source writes again (same content, same
    # names) is checked and copied again, not trusted from before the GC.
    write(source, "main", 1, "old data again")
    assert m.step().copied_objects >= 64
    np.testing.assert_array_equal(read(mirror, "main"), data(1))
    assert mirror.fsck().ok


def test_mirror_gc_never_deletes_what_a_mirror_ref_still_shows(
    source: zl.Repository, dest: zl.Storage
):
    first = write(source, "main", 1, "shown")
    m = Mirror(source, dest, copy=False)
    replicate(source.storage, dest)
    m.step()
    shown = chunk_keys(dest)
    # The source moves on and collects the data the mirror still shows; replication delivers
    # all of the new commit but its chunks, so the mirror stays at the first.
    write(source, "main", 2, "not yet")
    source.expire(zl.RetentionRules(default=zl.Keep(last=1)))
    source.gc(grace=dt.timedelta(0), force=True)
    assert not chunk_keys(source.storage) & shown
    replicate(source.storage, dest, keep=lambda k: not k.startswith("chunks/"))
    assert m.step().ref("main").mirrored_head == first

    m.gc(grace=dt.timedelta(0), force=True)

    mirror = zl.Repository.open(dest)
    assert chunk_keys(dest) == shown
    assert mirror.lookup_branch("main") == first
    np.testing.assert_array_equal(read(mirror, "main"), data(1))
    assert mirror.fsck().ok


def test_a_skipped_commit_is_history_but_not_data_at_the_mirror(
    source: zl.Repository, dest: zl.Storage
):
    m = Mirror(source, dest)
    write(source, "main", 1, "one")
    m.step()
    skipped = write(source, "main", 2, "skipped")
    write(source, "main", 3, "three")
    m.step()
    mirror = zl.Repository.open(dest)
    assert skipped in [c.id for c in mirror.log("main")]
    with pytest.raises(zl.NotMirrored, match="not mirrored") as caught:
        mirror.readonly_session(skipped)
    assert isinstance(caught.value, zl.RefNotFound)
    assert source.storage.url in str(caught.value)
    with pytest.raises(zl.NotMirrored):  # a diff needs the data too, not a CorruptObject
        mirror.diff(skipped, "main")
    # Every head the mirror showed stays readable by id, and diffs between them work.
    shown = [e.snapshot for e in mirror.core.journal.history("main") if e.snapshot]
    assert len(shown) == 2
    for sid in shown:
        np.testing.assert_array_equal(read(mirror, sid), read(source, sid))
    assert mirror.diff(shown[1], shown[0]).to_json() == source.diff(shown[1], shown[0]).to_json()
    assert mirror.fsck().ok


def test_when_the_newest_head_is_never_complete_an_earlier_complete_one_is_promoted(
    source: zl.Repository, dest: zl.Storage
):
    # Replication runs behind a source that commits faster: every pass sees a head whose
    # objects have not all arrived. The newest head an earlier pass saw that is complete by now
    # is promoted, so the mirror trails by the replication delay instead of stalling.
    m = Mirror(source, dest, copy=False)
    first = write(source, "main", 1, "one")
    at_first = set(source.storage.list_keys(""))
    assert m.step().ref("main").mirrored_head is None  # nothing arrived
    second = write(source, "main", 2, "two")
    at_second = set(source.storage.list_keys(""))
    replicate(source.storage, dest, keep=lambda k: k in at_first)

    status = m.step().ref("main")  # sees "two", incomplete; "one", seen before, is complete
    assert (status.source_head, status.mirrored_head) == (second, first)
    assert status.missing_objects > 0 and status.commits_behind == 1

    third = write(source, "main", 3, "three")
    replicate(source.storage, dest, keep=lambda k: k in at_second)
    assert m.step().ref("main").mirrored_head == second
    replicate(source.storage, dest)
    assert m.step().ref("main").mirrored_head == third
    mirror = zl.Repository.open(dest)
    assert [e.snapshot for e in mirror.core.journal.history("main")] == [third, second, first]
    for sid in (first, second, third):
        np.testing.assert_array_equal(read(mirror, sid), read(source, sid))


def test_metrics_follow_every_pass_and_are_served_over_http(
    source: zl.Repository, dest: zl.Storage
):
    import socket
    import urllib.request

    from zarrlake.mirror.metrics import MirrorMetrics

    metrics = MirrorMetrics(source.id)
    write(source, "main", 1, "one")
    source.create_branch("dev", "main")
    m = Mirror(source, dest, copy=False)
    metrics.update(m.step())

    def value(name: str, ref: str | None = None) -> float | None:
        labels = {"repository": source.id} | ({"ref": ref} if ref else {})
        return metrics.registry.get_sample_value(name, labels)

    assert value("zarrlake_mirror_commits_behind", "branch/main") == 2
    assert value("zarrlake_mirror_missing_objects", "branch/main") > 64
    assert value("zarrlake_mirror_last_promotion_timestamp_seconds", "branch/main") == 0
    replicate(source.storage, dest)
    source.delete_branch("dev")
    status = m.step()
    metrics.update(status)
    assert value("zarrlake_mirror_lag_seconds", "branch/main") == 0
    assert value("zarrlake_mirror_missing_objects", "branch/main") == 0
    assert value("zarrlake_mirror_last_promotion_timestamp_seconds", "branch/main") > 0
    assert value("zarrlake_mirror_promotions_total") == len(status.promoted) == 1
    assert value("zarrlake_mirror_passes_total") == 2
    # "dev" was never shown at the mirror, and is gone at the source: it drops out.
    assert value("zarrlake_mirror_commits_behind", "branch/dev") is None

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.serve(port, addr="127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'zarrlake_mirror_lag_seconds{{ref="branch/main",repository="{source.id}"}} 0.0' in text


def test_a_mirror_of_itself_is_refused(source: zl.Repository):
    with pytest.raises(zl.RepositoryExists, match="source itself"):
        Mirror(source, source.storage)


def test_without_create_nothing_is_written_until_the_destination_is_a_mirror(
    source: zl.Repository, dest: zl.Storage
):
    write(source, "main", 0, "one")
    with pytest.raises(zl.RepositoryNotFound, match="not \\(yet\\) a mirror"):
        Mirror(source, dest, create=False)
    assert list(dest.list("")) == []

    Mirror(source, dest).step()
    head = write(source, "main", 1, "two")
    status = Mirror(source, dest, create=False).status()
    assert (status.ref("main").source_head, status.ref("main").commits_behind) == (head, 1)
    assert zl.Repository.open(dest).lookup_branch("main") != head  # status() promotes nothing


@pytest.mark.parametrize("kind", ["lock-service", "destination-lease"])
def test_of_two_promoters_one_acts_and_the_other_stands_by(
    source: zl.Repository, dest: zl.Storage, tmp_path: Path, kind: str
):
    import threading

    write(source, "main", 0, "one")
    lock = LocalLock(tmp_path / "locks", wait_s=0.2) if kind == "lock-service" else None
    first, second = Mirror(source, dest, lock=lock), Mirror(source, dest, lock=lock)
    passes: dict[str, int] = {"first": 0, "second": 0}
    stop_first, stop_second = threading.Event(), threading.Event()

    def count(who: str):
        def on_status(_status):
            passes[who] += 1

        return on_status

    a = threading.Thread(
        target=first.run, args=(0.02,), kwargs={"stop": stop_first, "on_status": count("first")}
    )
    a.start()
    while passes["first"] == 0:
        threading.Event().wait(0.01)
    b = threading.Thread(
        target=second.run, args=(0.02,), kwargs={"stop": stop_second, "on_status": count("second")}
    )
    b.start()
    threading.Event().wait(0.5)
    assert passes["second"] == 0  # standing by while the first holds the lock
    stop_first.set()
    a.join()
    # Written once the first has stopped: only the standby can promote it (written before, the
    # first could promote it on its way out, and the loop below would end before the standby's
    # first pass).
    head = write(source, "main", 1, "two")
    deadline = dt.datetime.now() + dt.timedelta(seconds=10)
    while zl.Repository.open(dest).lookup_branch("main") != head:
        assert dt.datetime.now() < deadline, "the standby never took over"
        threading.Event().wait(0.05)
    stop_second.set()
    b.join()
    assert passes["second"] > 0


def _terms(dest: zl.Storage) -> list[LeaseRecord]:
    return [LeaseRecord.decode(dest.get(k), k) for k in sorted(dest.list_keys("mirror/lease/"))]


def test_a_lease_left_by_a_dead_promoter_is_taken_over_when_it_expires(
    source: zl.Repository, dest: zl.Storage
):
    """A promoter that died holding the lease (no hand-over) delays the next one by at most
    what was left of its term (plus the clock-skew margin), never forever."""
    import threading

    write(source, "main", 0, "one")
    m = Mirror(source, dest)
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    dest.put(lease_key(7), LeaseRecord(7, "dead-promoter", expires).encode(), create_only=True)
    stop = threading.Event()
    promoted: list[float] = []
    started = time.monotonic()

    def on_status(status):
        if status.ref("main").up_to_date:
            promoted.append(time.monotonic() - started)
            stop.set()

    runner = threading.Thread(
        target=m.run, args=(0.05,), kwargs={"stop": stop, "on_status": on_status}
    )
    runner.start()
    runner.join(30)
    assert not runner.is_alive() and promoted
    skew = DestinationLease.SKEW.total_seconds()
    assert 0.5 + skew < promoted[0] < 1 + skew + 5  # it waited for the term, then took it
    terms = _terms(dest)
    assert terms[-1].seq > 8 and terms[-1].holder == ""  # taken (term 8), then handed over
    assert len(terms) <= 2  # older terms are deleted as the chain grows


def _steal(dest: zl.Storage) -> LeaseRecord:
    """Write the next term of the lease for "other", for an hour. The holder renews it meanwhile
    (writing the next term, deleting older ones): try again on the term after until ours lands."""
    while True:
        newest = DestinationLease(dest).newest()
        assert newest is not None
        stolen = LeaseRecord(
            newest.seq + 1, "other", dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        )
        try:
            dest.put(lease_key(stolen.seq), stolen.encode(), create_only=True)
            return stolen
        except zl.PreconditionFailed:
            continue  # a renewal took that term first


def _wait_for_log(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"never logged {text!r}"
        time.sleep(0.01)


def test_a_promoter_whose_lease_was_taken_stops_acting(
    source: zl.Repository, dest: zl.Storage, caplog: pytest.LogCaptureFixture
):
    import logging
    import threading

    caplog.set_level(logging.INFO, logger="zarrlake.mirror")
    write(source, "main", 0, "one")
    m = Mirror(source, dest)
    m.LEASE_TTL = 0.3
    stop = threading.Event()
    passes: list[str | None] = []
    runner = threading.Thread(
        target=m.run,
        args=(0.02,),
        kwargs={"stop": stop, "on_status": lambda st: passes.append(st.ref("main").mirrored_head)},
    )
    runner.start()
    try:
        while not passes:
            time.sleep(0.01)
        _steal(dest)
        # A renewal (every 0.1 s) finds its term taken; the promoter leaves its loop of passes,
        # and its next attempt to take the lease is refused (the stolen term lasts an hour).
        _wait_for_log(caplog, "lost the lease")
        _wait_for_log(caplog, "standing by")
        count = len(passes)
        head = write(source, "main", 1, "two")
        time.sleep(0.5)  # time for a pass it must not make
        assert len(passes) == count  # no pass since: standing by
        assert zl.Repository.open(dest).lookup_branch("main") != head
    finally:
        stop.set()
        runner.join(10)
    assert not runner.is_alive()

    lease = DestinationLease(dest, ttl=0.3, wait_s=1)
    dest.delete_many(dest.list_keys("mirror/lease/"))
    with lease.hold():
        # Someone else writes the next term (as if this holder had been paused past its term).
        _steal(dest)
        assert lease.lost.wait(30), "the renewal never noticed"
    assert _terms(dest)[-1].holder == "other"  # and it handed nothing over on leaving
    other = DestinationLease(dest, wait_s=0.2)
    with (
        pytest.raises(zl.LockTimeout, match="another promoter holds the mirror lease"),
        other.hold(),
    ):
        pass


def test_a_term_deleted_while_it_is_read_never_restarts_the_lease_chain(dest: zl.Storage):
    """The holder renews (writes term n+1, deletes term n) between a standby's listing and its
    read of term n: the standby must see term n+1, not fall back to an older term whose
    successor is gone (writing that successor again would give two holders)."""
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    for seq in (2, 3):
        dest.put(lease_key(seq), LeaseRecord(seq, "holder", later).encode(), create_only=True)

    class RenewedMeanwhile(CountingStorage):
        def get(self, key, byte_range=None):
            if key == lease_key(3) and not dest.exists(lease_key(4)):
                dest.put(lease_key(4), LeaseRecord(4, "holder", later).encode(), create_only=True)
                dest.delete_many([lease_key(2), lease_key(3)])
            return super().get(key, byte_range)

    standby = DestinationLease(RenewedMeanwhile(dest), wait_s=0.1)
    assert standby.newest() == LeaseRecord(4, "holder", standby.newest().expires)
    with pytest.raises(zl.LockTimeout), standby.hold():
        pass
    assert sorted(dest.list_keys("mirror/lease/")) == [lease_key(4)]
