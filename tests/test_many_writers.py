"""Many independent writers on one branch (issue 45): every commit lands, and none waits for ever.

Writers are real processes (this file run as a program: ``python test_many_writers.py
<payload>``), on a real local directory and a real moto S3, with and without a real Redis lock.
Each writes its own chunks, one commit each, all starting together. Checked afterwards by a fresh
client: every value in its place, every acknowledged commit in a linear log — and a fairness
property that is about order, not time (so a loaded machine cannot fail it): how many commits that
*started later* landed *before* a given commit ("overtaken by"). A writer that keeps winning
because it knows the head, while older losers fall behind, shows up as commits overtaken by many
younger ones; with precedence by age (optimistic) or the lock's queue, a commit is overtaken by
few.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import zarrlake
from zarrlake.commit import LAPSED_US, Waiter, WaitQueue
from zarrlake.config import fair_commits_default

ARRAY = "a"
HERE = Path(__file__).resolve()


def chunk_key(index: int) -> str:
    return f"{ARRAY}/c/{index}"


def chunk_value(index: int) -> bytes:
    """Above the inline threshold: every chunk is a real object."""
    return f"value of chunk {index};".encode() * 40


def array_doc(size: int) -> bytes:
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [size],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes"}],
        "attributes": {},
    }
    return json.dumps(doc).encode()


# -- the writer program ----------------------------------------------------------------------------


def writer(task: dict[str, Any]) -> None:
    """Commit ``task["commits"]`` chunks one by one; print one JSON record per commit."""
    lock = zarrlake.RedisLock(task["redis"], wait_s=300) if task["redis"] else None
    repo = zarrlake.Repository.open(task["storage"], lock=lock)
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(task["commits"]):
        index = task["writer"] * task["commits"] + i
        before = repo.stats["append_retries"]
        session = repo.writable_session("main")
        session.write(chunk_key(index), chunk_value(index))
        # A commit's age is the commit's: it starts when commit() is called, as the engine's
        # queue counts it. Upload of the chunk before it is the writer's own time (on a loaded
        # machine a write that started first may end last, and its commit is then younger).
        start = time.monotonic()
        snapshot = session.commit(f"chunk {index}")
        record = {
            "index": index,
            "snapshot": snapshot,
            "start": start,
            "retries": repo.stats["append_retries"] - before,
        }
        print(json.dumps(record), flush=True)


def run_writers(
    storage: zarrlake.Storage, writers: int, commits: int, redis: str | None
) -> list[dict[str, Any]]:
    """Start ``writers`` processes, release them together, and collect their records."""
    procs = []
    for w in range(writers):
        task = {"storage": storage, "writer": w, "commits": commits, "redis": redis}
        payload = base64.b64encode(pickle.dumps(task)).decode()
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE), payload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        )
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        records = []
        for p in procs:
            assert p.stdout is not None
            records += [json.loads(line) for line in p.stdout]
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return records


def overtaken(records: list[dict[str, Any]], landed_order: list[str]) -> dict[int, int]:
    """For each commit (by chunk index): how many commits that started after it landed before
    it, by their order in the log."""
    position = {snap: i for i, snap in enumerate(landed_order)}
    out = {}
    for r in records:
        out[r["index"]] = sum(
            1
            for other in records
            if other["start"] > r["start"] and position[other["snapshot"]] < position[r["snapshot"]]
        )
    return out


# -- the tests -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fair_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The age queue is on by default ($ZARRLAKE_FAIR_COMMITS=0 turns it off): on, explicitly,
    for these tests and for the writer processes they start (which inherit the environment)."""
    monkeypatch.setenv("ZARRLAKE_FAIR_COMMITS", "1")


def test_with_the_switch_off_a_writer_that_lost_a_race_never_queues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZARRLAKE_FAIR_COMMITS", "0")
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(8))
    s.commit("array")
    other = zarrlake.Repository.open(storage)
    late = repo.writable_session("main")
    late.write(chunk_key(0), chunk_value(0))
    w = other.writable_session("main")
    w.write(chunk_key(1), chunk_value(1))
    w.commit("winner")
    late.commit("late")  # lost one race, rebased, landed: and looked at no queue
    assert repo.stats["append_retries"] == 1 and repo.stats["deferrals"] == 0
    assert not list(storage.list_keys("refs/wait."))
    monkeypatch.setenv("ZARRLAKE_FAIR_COMMITS", "maybe")
    with pytest.raises(zarrlake.ZarrlakeError, match="ZARRLAKE_FAIR_COMMITS"):
        zarrlake.Repository.open(storage).writable_session("main").commit("x", allow_empty=True)


WRITERS = 8
COMMITS = 4


def _storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> zarrlake.Storage:
    if kind == "local":
        return zarrlake.Storage.local(tmp_path / "repo")
    server = request.getfixturevalue("moto_s3")
    storage: zarrlake.Storage = server.storage()
    return storage


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["optimistic", "lock"])
@pytest.mark.parametrize("kind", ["local", "moto"])
def test_many_writers_every_commit_lands_and_none_is_overtaken_much(
    kind: str, mode: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    storage = _storage(kind, tmp_path, request)
    redis = request.getfixturevalue("redis_server").url if mode == "lock" else None
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(WRITERS * COMMITS))
    s.commit("create the array")

    records = run_writers(storage, WRITERS, COMMITS, redis)

    fresh = zarrlake.Repository.open(storage)
    history = list(fresh.log("main"))
    assert len(records) == WRITERS * COMMITS
    assert len(history) == WRITERS * COMMITS + 2  # + the first commit and the array's
    assert all(len(c.parents) <= 1 for c in history), "history is linear"
    in_log = {c.id for c in history}
    assert {r["snapshot"] for r in records} <= in_log, "every acknowledged commit is in the log"
    session = fresh.readonly_session("main")
    for index in range(WRITERS * COMMITS):
        assert session.read(chunk_key(index)) == chunk_value(index)
    # Fairness, as an order: with the old engine a writer that had just committed won again
    # and again (streaks of all its commits) while older losers were overtaken by 10-30 younger
    # commits; with precedence by age or a FIFO lock, a commit is overtaken by at most a
    # writer-count's worth of younger ones.
    oldest_first = [c.id for c in reversed(history)]
    worst = max(overtaken(records, oldest_first).values())
    assert worst <= WRITERS, f"a commit was overtaken by {worst} younger commits"
    if mode == "lock":
        assert sum(r["retries"] for r in records) == 0, "under the lock the first append lands"


def _record_keys(storage: zarrlake.Storage, calls: list[tuple[str, str]]) -> None:
    """Record every get, put and delete ``storage`` sees, as (operation, key)."""
    get, put, delete_many = storage.get, storage.put, storage.delete_many

    def recording_get(key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        calls.append(("get", key))
        return get(key, byte_range)

    def recording_put(key: str, data: Any, *, create_only: bool = False) -> None:
        calls.append(("put", key))
        put(key, data, create_only=create_only)

    def recording_delete(keys: Any) -> int:
        keys = list(keys)
        calls.extend(("delete", k) for k in keys)
        return delete_many(keys)

    storage.get = recording_get  # type: ignore[method-assign]
    storage.put = recording_put  # type: ignore[method-assign]
    storage.delete_many = recording_delete  # type: ignore[method-assign]


def test_a_writer_queues_only_after_a_lost_race_and_leaves_when_it_lands(tmp_path: Path) -> None:
    """A lone writer reads and writes nothing of the queue; one that lost a race joins it before
    its next append and leaves it once its commit landed."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(8))
    s.commit("array")
    calls: list[tuple[str, str]] = []
    watched = zarrlake.Storage.local(tmp_path / "repo")
    _record_keys(watched, calls)
    loser = zarrlake.Repository.open(watched)
    for i in range(3):  # alone: no claim is looked at
        t = loser.writable_session("main")
        t.write(chunk_key(i), chunk_value(i))
        t.commit(f"alone {i}")
    assert not [c for c in calls if "refs/wait." in c[1]], "a lone writer never queues"

    late = loser.writable_session("main")
    late.write(chunk_key(3), chunk_value(3))
    w = repo.writable_session("main")  # another client commits meanwhile
    w.write(chunk_key(4), chunk_value(4))
    w.commit("winner")
    late.commit("late")  # its known head is stale: the first append is lost
    assert loser.stats["append_retries"] == 1
    waits = [c for c in calls if "refs/wait." in c[1]]
    joined = [k for op, k in waits if op == "put"]
    assert len(joined) == 1 and joined[0].startswith("refs/wait.main/")
    assert waits[-1] == ("delete", joined[0]), "a landed commit leaves the queue"
    assert WaitQueue(storage).waiters("main") == []
    head = zarrlake.Repository.open(storage).readonly_session("main")
    assert [head.read(chunk_key(i)) for i in range(5)] == [chunk_value(i) for i in range(5)]


def test_rebase_far_behind_reads_few_snapshots(tmp_path: Path) -> None:
    """A session 150 commits behind (more than one snapshot's ancestry list) rebases by hopping
    along ancestry lists, not by reading a snapshot per commit in between."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(200))
    s.commit("array")
    late = zarrlake.Repository.open(storage).writable_session("main")
    late.write(chunk_key(199), chunk_value(199))
    for i in range(150):
        s = repo.writable_session("main")
        s.write(chunk_key(i), chunk_value(i))
        s.commit(f"chunk {i}")
    reads: list[str] = []
    inner_get = storage.get

    def counting_get(key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        reads.append(key)
        return inner_get(key, byte_range)

    storage.get = counting_get  # type: ignore[method-assign]
    try:
        late.commit("late")
    finally:
        del storage.get
    snapshots = [k for k in reads if k.startswith("snapshots/")]
    assert len(snapshots) <= 6, f"{len(snapshots)} snapshot reads for a 150-commit rebase"
    head = zarrlake.Repository.open(storage).readonly_session("main")
    assert head.read(chunk_key(199)) == chunk_value(199)
    assert head.read(chunk_key(149)) == chunk_value(149)


waiters_st = st.builds(
    Waiter,
    st.integers(0, 2**64 - 1),
    st.text("0123456789abcdef", min_size=1, max_size=32),
    st.integers(0, 2**64 - 1),
)


@given(st.lists(waiters_st, max_size=8))
def test_queue_keys_sort_oldest_first_and_parse_back(waiters: list[Waiter]) -> None:
    names = [w.name() for w in waiters]
    assert [Waiter.parse(n) for n in names] == waiters
    # A listing's key order is the queue's order (oldest first; ties by writer id, the same
    # width here), so every writer agrees who is first.
    same_width = {len(w.writer) for w in waiters}
    if len(same_width) <= 1:
        assert sorted(waiters) == [Waiter.parse(n) for n in sorted(names)]


@given(st.text(max_size=64))
def test_foreign_queue_keys_never_raise(name: str) -> None:
    """Any key below the queue parses to a waiter or to None (ignored), never an error: the
    queue is a hint and must not fail a commit."""
    waiter = Waiter.parse(name)
    assert waiter is None or isinstance(waiter, Waiter)


def test_a_waiter_past_its_lease_holds_nobody_up(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    queue = WaitQueue(storage)
    dead, live = Waiter(1, "aa", 1_000), Waiter(2, "bb", 10**18)
    queue.join("main", dead)
    queue.join("main", live)
    assert queue.waiters("main") == [dead, live]
    assert queue.first("main", now=2_000) == live
    queue.leave("main", live)
    assert queue.first("main", now=2_000) is None


def test_places_of_writers_long_dead_are_taken_away_by_a_waiter(tmp_path: Path) -> None:
    """A killed writer's place stays in the queue; a contended writer that lists the queue
    deletes it once the server shows it unchanged ten minutes longer than the newest place, and
    leaves alone a place that only the writers' clocks call old (a clock that runs behind)."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(8))
    s.commit("array")
    queue = WaitQueue(storage)
    now = int(time.time() * 1e6)
    long_dead = Waiter(1, "dead", now - 700_000_000)
    slow_clock = Waiter(2, "skewed", now - 10 * LAPSED_US)  # lapsed by its clock: object fresh
    queue.join("main", long_dead)
    queue.join("main", slow_clock)
    old = time.time() - LAPSED_US / 1e6 - 120
    os.utime(tmp_path / "repo" / "refs" / "wait.main" / long_dead.name(), (old, old))
    waiters, dead = queue.look("main")
    assert waiters == [long_dead, slow_clock] and dead == [long_dead]
    other = zarrlake.Repository.open(storage)
    late = repo.writable_session("main")
    late.write(chunk_key(0), chunk_value(0))
    w = other.writable_session("main")
    w.write(chunk_key(1), chunk_value(1))
    w.commit("winner")
    late.commit("late")  # lost the race: contended, so it queues, and looks at the queue
    assert repo.stats["append_retries"] == 1
    assert queue.waiters("main") == [slow_clock]


def test_the_age_queue_is_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZARRLAKE_FAIR_COMMITS")
    assert fair_commits_default()
    monkeypatch.setenv("ZARRLAKE_FAIR_COMMITS", "off")
    assert not fair_commits_default()


if __name__ == "__main__":
    writer(pickle.loads(base64.b64decode(sys.argv[1])))
