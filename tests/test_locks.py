"""The lock service and concurrent commits, with real processes, real signals and real servers.

Every scenario runs writer processes (the programs in ``lock_workers.py``) against a real
``redis-server`` and real storage (a local directory, or S3 served by ``moto_server``).
Processes are killed with SIGKILL and paused with SIGSTOP/SIGCONT for real.

What is measured, directly:

- mutual exclusion: holders log ``enter``/``exit`` records to one file (under ``flock``) and bump
  a Redis counter inside the critical section; the log must strictly alternate, the counter never
  exceed 1, and fencing tokens strictly increase in acquisition order;
- no lost commit: every snapshot id a writer reports is in the branch's history, the history is
  linear, the journal is an unbroken chain, and every chunk reads back with the bytes written;
- crash consistency: writers SIGKILLed at random moments leave a repository that opens, passes
  fsck, and whose branch heads hold every confirmed commit and no part of a torn one.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import zarrlake
import zarrlake.locks
from backends import make_storage
from lock_workers import ARRAY, CRASH_BRANCHES, array_doc, chunk_key, chunk_value
from zarrlake.format.model import JournalEntry
from zarrlake_testkit.servers import (
    free_port,
    redis_command,
    spawn_on_free_port,
    stop,
    wait_for_port,
)

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")

WORKERS = Path(__file__).resolve().with_name("lock_workers.py")
ZARRLAKE_HOME = Path(zarrlake.__file__).resolve().parent.parent  # workers import the same code


def new_repo(storage: zarrlake.Storage, **kw: Any) -> zarrlake.Repository:
    """A repository whose ``main`` holds one big 1-D array ``a`` (chunk shape 1)."""
    repo = zarrlake.Repository.create(storage, **kw)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc())
    s.commit("create the array")
    return repo


# -- child processes -------------------------------------------------------------------------------


class Worker:
    """A child process running one of the programs in ``lock_workers.py``.

    It prints JSON records, one per line; reader threads collect them (and stderr) so pipes never
    fill up. ``send`` writes a line to its stdin.
    """

    def __init__(self, mode: str, **args: Any) -> None:
        self.args = args
        payload = base64.b64encode(pickle.dumps({"mode": mode, **args})).decode()
        env = dict(os.environ)
        path = [str(ZARRLAKE_HOME), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS), payload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.proc.pid
        self.records: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = {"event": "garbage", "line": line}
            with self._cond:
                self.records.append(rec)
                self._cond.notify_all()
        with self._cond:
            self.records.append({"event": "eof"})
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def events(self, name: str) -> list[dict[str, Any]]:
        with self._cond:
            return [r for r in self.records if r.get("event") == name]

    def wait_for(self, name: str, count: int = 1, timeout: float = 120) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [r for r in self.records if r.get("event") == name]
                if len(found) >= count:
                    return found
                if any(r.get("event") == "eof" for r in self.records):
                    raise AssertionError(f"exited before {count} {name!r}: {self.diagnose()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {count} {name!r} in {timeout}s: {self.diagnose()}")
                self._cond.wait(left)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def finish(self, timeout: float = 120) -> int:
        """Wait for exit (and for its output to be read); the exit status."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"no exit within {timeout}s: {self.diagnose()}") from None
        for t in self._threads:
            t.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()
        for t in self._threads:
            t.join(10)

    def diagnose(self) -> str:
        tail = "".join(self.stderr[-30:])
        return f"pid {self.pid}, records {self.records[-5:]}, stderr:\n{tail}"


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    """Start workers; whatever is still running at the end is killed (by pid)."""
    started: list[Worker] = []

    def start(mode: str, **args: Any) -> Worker:
        w = Worker(mode, **args)
        started.append(w)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            os.kill(w.pid, signal.SIGCONT)
            w.kill()


def finish_all(ws: list[Worker], timeout: float = 180) -> None:
    for w in ws:
        assert w.finish(timeout) == 0, w.diagnose()


def go(ws: list[Worker]) -> None:
    """Wait until every worker is ready, then release them together."""
    for w in ws:
        w.wait_for("ready")
    for w in ws:
        w.send("go")


# -- checks ----------------------------------------------------------------------------------------


def journal(repo: zarrlake.Repository, branch: str = "main") -> list[JournalEntry]:
    """The branch's journal, oldest first."""
    return sorted(repo.core.journal.history(branch), key=lambda e: e.seq)


def check_journal_chain(repo: zarrlake.Repository, branch: str = "main") -> list[JournalEntry]:
    """Every move of the branch starts from the head it replaced, and every commit's snapshot was
    built on that head: the branch never moved backwards and no commit was dropped."""
    entries = journal(repo, branch)
    assert [e.seq for e in entries] == list(range(len(entries)))
    for prev, cur in itertools.pairwise(entries):
        assert cur.previous == prev.snapshot, f"seq {cur.seq} does not continue from seq {prev.seq}"
        if cur.snapshot is not None:
            parents = repo.core.objects.snapshot(cur.snapshot).parents
            assert parents[:1] == (prev.snapshot,), f"seq {cur.seq}: snapshot not built on the head"
    return entries


def check_linear(repo: zarrlake.Repository, ref: str = "main") -> list[zarrlake.CommitInfo]:
    history = list(repo.log(ref))
    assert all(len(c.parents) <= 1 for c in history), "history is not linear"
    for newer, older in itertools.pairwise(history):
        assert newer.parents == (older.id,), "history is not one chain"
    return history


def check_commits(
    repo: zarrlake.Repository,
    ws: list[Worker],
    tag: str,
    base_commits: int = 2,
) -> list[zarrlake.CommitInfo]:
    """Every commit every worker reported is on ``main`` exactly once, with its chunk."""
    history = check_linear(repo)
    check_journal_chain(repo)
    reported = [r for w in ws for r in w.events("commit")]
    assert len(history) == base_commits + len(reported)
    assert {c.id for c in history} >= {r["sid"] for r in reported}
    session = repo.readonly_session("main")
    for r in reported:
        assert session.read(chunk_key(r["index"])) == chunk_value(tag, r["index"])
    listed = list(session.list_prefix(f"{ARRAY}/c/"))
    assert sorted(listed) == sorted(chunk_key(r["index"]) for r in reported)
    return history


def storage_for(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> zarrlake.Storage:
    """A storage of ``kind`` (see ``backends.EVERY_STORAGE_KIND``) the writer processes share."""
    return make_storage(kind, tmp_path, request)


# -- mutual exclusion and fencing ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_mutual_exclusion_and_fencing_8_processes(
    kind: str, redis_server: Any, tmp_path: Path, workers: Callable[..., Worker]
) -> None:
    import redis

    lock: Any = (
        zarrlake.RedisLock(redis_server.url, lease_s=10, wait_s=60)
        if kind == "redis"
        else zarrlake.LocalLock(tmp_path / "locks", wait_s=60)
    )
    repo_id = f"excl-{os.urandom(4).hex()}"
    log = tmp_path / "log"
    counter = f"test:{repo_id}:inside"
    procs, rounds = 8, 8
    ws = [
        workers(
            "exclusion",
            lock=lock,
            repo_id=repo_id,
            rounds=rounds,
            log=str(log),
            counter_url=redis_server.url,
            counter=counter,
            hold_s=0.002,
        )
        for _ in range(procs)
    ]
    go(ws)
    finish_all(ws)
    records = [line.split() for line in log.read_text().splitlines()]
    assert len(records) == 2 * procs * rounds
    tokens = []
    for enter, exit_ in zip(records[::2], records[1::2], strict=True):
        assert enter[0] == "enter" and exit_[0] == "exit", "two holders inside at once"
        assert enter[1:3] == exit_[1:3], "another holder exited inside our critical section"
        assert enter[3] == "1", "the Redis counter saw two holders inside"
        tokens.append(int(enter[2]))
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    assert {r[1] for r in records} == {str(w.pid) for w in ws}
    assert int(redis.Redis.from_url(redis_server.url).get(counter) or b"0") == 0


def test_lock_timeout_and_leaving_the_queue(redis_server: Any, tmp_path: Path) -> None:
    repo = new_repo(zarrlake.Storage.local(tmp_path / "repo"))
    holder = zarrlake.RedisLock(redis_server.url, lease_s=5)
    lease = holder.acquire(repo.id, "main")
    assert lease is not None
    waiter = zarrlake.RedisLock(redis_server.url, wait_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(zarrlake.LockTimeout), waiter.hold(repo.id, "main"):
        pass
    assert 0.5 <= time.monotonic() - t0 < 0.5 + 5  # waited its wait_s, not much more
    # A commit through a repository behaves the same, and changes nothing.
    locked = zarrlake.Repository.open(repo.storage, lock=waiter)
    head = locked.lookup_branch("main")
    s = locked.writable_session("main")
    s.write(chunk_key(1), chunk_value("t", 1))
    with pytest.raises(zarrlake.LockTimeout):
        s.commit("blocked")
    assert locked.lookup_branch("main") == head and len(journal(repo)) == 2
    # The waiters that gave up left the queue: once released, the lock is free at once.
    lease.release()
    # wait_s is 0.5: a queue left behind by the waiters would make this a LockTimeout.
    s.commit("now")
    assert lease.token < journal(repo)[-1].token


def test_local_lock_timeout(tmp_path: Path) -> None:
    # flock(2) locks belong to an open file, so two LocalLocks exclude each other in one process.
    lock = zarrlake.LocalLock(tmp_path / "locks", wait_s=0.3)
    with lock.hold("repo", "main") as token:
        t0 = time.monotonic()
        with pytest.raises(zarrlake.LockTimeout), lock.hold("repo", "main"):
            pass
        assert 0.3 <= time.monotonic() - t0 < 0.3 + 5
        with lock.hold("repo", "dev") as other, lock.hold("other-repo", "main") as third:
            assert other == token + 1 and third == 1  # tokens count per repository
    with lock.hold("repo", "main") as again:
        assert again == token + 2


def test_lease_is_renewed_through_a_long_critical_section(redis_server: Any) -> None:
    # Renewal runs every lease_s/3: a 3 s lease survives a 2 s stall of this process (a loaded
    # machine), while the loop still spans two and a half leases.
    lease_s = 3.0
    lock = zarrlake.RedisLock(redis_server.url, lease_s=lease_s)
    other = zarrlake.RedisLock(redis_server.url, wait_s=0.2)
    repo_id = f"renew-{os.urandom(4).hex()}"
    lease = lock.acquire(repo_id, "main")
    assert lease is not None
    try:
        deadline = time.monotonic() + 2.5 * lease_s
        while time.monotonic() < deadline:
            with pytest.raises(zarrlake.LockTimeout):
                other.acquire(repo_id, "main")
            [held] = lock.status(repo_id)
            assert held.token == lease.token and 0 < held.ttl_ms <= lease_s * 1000
        assert not lease.lost
    finally:
        lease.release()
    assert lock.status(repo_id) == []
    again = other.acquire(repo_id, "main")
    assert again is not None and again.token > lease.token
    again.release()


def test_keys_are_namespaced_by_repository(redis_server: Any, tmp_path: Path) -> None:
    import redis

    one = new_repo(zarrlake.Storage.local(tmp_path / "one"))
    two = new_repo(zarrlake.Storage.local(tmp_path / "two"))
    lock = zarrlake.RedisLock(redis_server.url, wait_s=0.3)
    held = lock.acquire(one.id, "main")
    assert held is not None
    try:
        # Another repository on the same Redis, and another branch, are not blocked.
        for repo_id, branch in ((two.id, "main"), (one.id, "dev")):
            other = lock.acquire(repo_id, branch)
            assert other is not None
            other.release()
        with pytest.raises(zarrlake.LockTimeout):
            lock.acquire(one.id, "main")
        # Fencing tokens count per repository.
        r2 = zarrlake.Repository.open(two.storage, lock=lock)
        s = r2.writable_session("main")
        s.write(chunk_key(0), chunk_value("ns", 0))
        s.commit("in two")
        assert journal(r2)[-1].token == 2  # the second acquisition for repository two
        assert [h.branch for h in lock.status(one.id)] == ["main"]
        assert lock.status(two.id) == []
        # Every key the lock service keeps lives under some repository's {id}.
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = list(client.scan_iter(match="zarrlake:*"))
        assert all(re.match(r"zarrlake:\{[^{}]+\}:", k) for k in keys), keys
        assert any(k.startswith(f"zarrlake:{{{one.id}}}:lock:") for k in keys)
        assert any(k.startswith(f"zarrlake:{{{two.id}}}:") for k in keys)
    finally:
        held.release()


# -- dead and paused holders -----------------------------------------------------------------------


def test_lease_expires_after_holder_is_sigkilled(
    redis_server: Any,
    tmp_path: Path,
    workers: Callable[..., Worker],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from zarrlake.cli import main

    repo = new_repo(zarrlake.Storage.local(tmp_path / "repo"))
    lease_s = 3.0  # renewed each second: the holder keeps it through a 2 s stall under load
    a = workers("hold", lock=zarrlake.RedisLock(redis_server.url, lease_s=lease_s), repo_id=repo.id)
    [held] = a.wait_for("held")
    assert f":{a.pid}:" in held["holder"]

    # `zarrlake lock status` names the holder while it holds.
    capsys.readouterr()
    status_cmd = ["lock", "status", str(tmp_path / "repo"), "--lock", redis_server.url]
    assert main([*status_cmd, "--json"]) == 0
    [status] = json.loads(capsys.readouterr().out)
    assert status["branch"] == "main" and status["holder"] == held["holder"]
    assert status["token"] == held["token"] and 0 < status["ttl_ms"] <= lease_s * 1000
    assert main(status_cmd) == 0
    out = capsys.readouterr().out
    assert held["holder"] in out and "main" in out

    # Alive, it renews: nobody else gets in, well past one lease.
    blocked = zarrlake.RedisLock(redis_server.url, wait_s=lease_s * 1.5)
    with pytest.raises(zarrlake.LockTimeout):
        blocked.acquire(repo.id, "main")

    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    a.finish()
    waiter_lock = zarrlake.RedisLock(redis_server.url, wait_s=120)
    waiter = zarrlake.Repository.open(repo.storage, lock=waiter_lock)
    s = waiter.writable_session("main")
    s.write(chunk_key(7), chunk_value("k", 7))
    sid = s.commit("after the holder died")
    # The dead holder's lease ran out (one lease after its last renewal), not the waiter's
    # patience (120 s); the margin covers the commit itself on a loaded machine.
    waited = time.monotonic() - killed
    assert waited < 2 * lease_s + 10, f"waited {waited:.2f}s for a {lease_s}s lease"
    assert journal(repo)[-1].token > held["token"] and repo.lookup_branch("main") == sid
    assert main(status_cmd) == 0
    assert "no branch of this repository is locked" in capsys.readouterr().out


def test_stale_holder_cannot_release_or_renew(
    redis_server: Any, workers: Callable[..., Worker]
) -> None:
    import redis

    repo_id = f"stale-{os.urandom(4).hex()}"
    a = workers(
        "hold",
        lock=zarrlake.RedisLock(redis_server.url, lease_s=0.6),
        repo_id=repo_id,
        expect_lost=True,
    )
    [held] = a.wait_for("held")
    a.signal(signal.SIGSTOP)
    try:
        b_lock = zarrlake.RedisLock(redis_server.url, wait_s=5)
        b = b_lock.acquire(repo_id, "main")  # granted once A's lease runs out
        assert b is not None and b.token > held["token"]
    finally:
        a.signal(signal.SIGCONT)
    a.send("release")  # once its renewal thread has tried to renew (or after 10 s)
    [released] = a.wait_for("released")
    assert a.finish() == 0
    assert released["lost"] is True  # renewal noticed the lease was gone...
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert client.get(b.key) == b.value  # ...and A's release did not delete B's lock
    [status] = b_lock.status(repo_id)
    assert status.token == b.token and status.holder != held["holder"]
    b.release()
    assert b_lock.status(repo_id) == []


@pytest.mark.parametrize("operation", ["commit", "reset"])
def test_paused_holder_cannot_clobber_the_branch(
    operation: str, redis_server: Any, tmp_path: Path, workers: Callable[..., Worker]
) -> None:
    """A holder SIGSTOPped past its lease, right before its journal write, resumes after another
    writer committed: it must lose the create-only race, rebase (or, for a compare-and-set reset,
    fail), and never move the branch backwards or drop the other commit."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = new_repo(storage)
    first = repo.lookup_branch("main")
    s = repo.writable_session("main")
    s.write(chunk_key(0), chunk_value("p", 0))
    base = s.commit("base")
    lease_s = 3.0  # A keeps its lease through a 2 s stall under load, until it is SIGSTOPped
    a = workers(
        "paused",
        storage=storage,
        lock=zarrlake.RedisLock(redis_server.url, lease_s=lease_s, wait_s=10),
        operation=operation,
        reset_to=first,
        index=1,
        tag="p",
    )
    [at] = a.wait_for("at-append")  # A holds the lock and has read the head
    assert at["previous"] == base and at["token"] is not None
    [holder] = zarrlake.RedisLock(redis_server.url).status(repo.id)
    assert f":{a.pid}:" in holder.holder and holder.token == at["token"]
    a.signal(signal.SIGSTOP)
    try:
        b_lock = zarrlake.RedisLock(redis_server.url, lease_s=10, wait_s=120)
        b_repo = zarrlake.Repository.open(storage, lock=b_lock)
        sb = b_repo.writable_session("main")
        sb.write(chunk_key(2), chunk_value("p", 2))
        t0 = time.monotonic()
        b_sid = sb.commit("B, after A's lease ran out")
        assert time.monotonic() - t0 < 2 * lease_s + 10  # A's lease ran out; B did not wait 120 s
        a.send("go")
    finally:
        a.signal(signal.SIGCONT)
    assert a.finish() == 0, a.diagnose()
    entries = check_journal_chain(repo)
    b_entry = next(e for e in entries if e.snapshot == b_sid)
    assert b_entry.seq == at["seq"], "B took the sequence number A had prepared"
    assert b_entry.token > at["token"]
    session = repo.readonly_session("main")
    assert session.read(chunk_key(2)) == chunk_value("p", 2)
    if operation == "commit":
        [done] = a.events("committed")
        history = check_linear(repo)
        assert [c.id for c in history[:3]] == [done["sid"], b_sid, base]
        assert session.read(chunk_key(1)) == chunk_value("p", 1)
        assert entries[-1].snapshot == done["sid"] and entries[-1].previous == b_sid
    else:
        [conflict] = a.events("conflict")
        assert conflict["error"] == "ConflictError"
        assert repo.lookup_branch("main") == b_sid and entries[-1].snapshot == b_sid
    assert repo.fsck().ok


# -- Redis going away ------------------------------------------------------------------------------


def test_redis_stopped_optimistic_and_fail(own_redis: Any, tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = new_repo(storage)
    optimistic = zarrlake.Repository.open(
        storage, lock=zarrlake.RedisLock(own_redis.url, on_unavailable="optimistic")
    )
    failing = zarrlake.Repository.open(
        storage, lock=zarrlake.RedisLock(own_redis.url, on_unavailable="fail")
    )
    s = optimistic.writable_session("main")
    s.write(chunk_key(1), chunk_value("u", 1))
    assert journal(repo)[-1].token is None
    s.commit("with the lock")
    assert journal(repo)[-1].token is not None

    own_redis.stop()
    s = optimistic.writable_session("main")
    s.write(chunk_key(2), chunk_value("u", 2))
    t0 = time.monotonic()
    sid = s.commit("Redis is down: optimistic")
    assert time.monotonic() - t0 < 15  # fell back at once: no wait_s (120 s) for a dead server
    assert repo.lookup_branch("main") == sid and journal(repo)[-1].token is None

    before = journal(repo)
    snapshots = sorted(k for k in storage.list_keys("snapshots/"))
    s = failing.writable_session("main")
    s.write(chunk_key(3), chunk_value("u", 3))
    with pytest.raises(zarrlake.LockUnavailable):
        s.commit("Redis is down: fail")
    with pytest.raises(zarrlake.LockUnavailable):
        failing.reset_branch("main", before[0].snapshot)  # type: ignore[arg-type]
    failing.create_branch("dev")
    with pytest.raises(zarrlake.LockUnavailable):
        failing.delete_branch("dev")
    assert journal(repo) == before
    assert sorted(storage.list_keys("snapshots/")) == snapshots
    assert "dev" in repo.list_branches()
    assert repo.readonly_session("main").read(chunk_key(3)) is None

    own_redis.start()
    s.commit("Redis is back")  # the same session commits once the lock service is back
    assert journal(repo)[-1].token is not None
    assert repo.readonly_session("main").read(chunk_key(3)) == chunk_value("u", 3)


def test_redis_restarted_mid_run_loses_no_commit(
    own_redis: Any, tmp_path: Path, workers: Callable[..., Worker]
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = new_repo(storage)
    lock = zarrlake.RedisLock(own_redis.url, lease_s=2, wait_s=60, on_unavailable="optimistic")
    stop = tmp_path / "stop"
    ws = [
        workers(
            "commits",
            storage=storage,
            lock=lock,
            writer=i,
            commits=900,
            tag="r",
            pause_s=0.01,
            stop_file=str(stop),
        )
        for i in range(3)
    ]
    go(ws)
    for w in ws:
        w.wait_for("commit", 3)
    own_redis.stop()
    down = sum(len(w.events("commit")) for w in ws)
    # Wait for a commit to land while Redis is down (the event, not a guess at how long it takes).
    deadline = time.monotonic() + 120
    while (up := sum(len(w.events("commit")) for w in ws)) <= down:
        assert time.monotonic() < deadline, "no commit landed in 120 s while Redis was down"
        time.sleep(0.05)
    own_redis.start()
    for w in ws:  # every writer goes on committing, with the lock again
        w.wait_for("commit", len(w.events("commit")) + 3)
    stop.touch()
    finish_all(ws)
    assert up > down, "no commit landed while Redis was down"
    check_commits(repo, ws, "r")
    entries = journal(repo)
    assert any(e.token is None for e in entries), "nobody committed optimistically"
    assert entries[-1].token is not None, "writers did not go back to the lock"


# -- many writers, one branch ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("local", "redis"),
        ("local", "local-lock"),
        ("local", "none"),
        ("s3", "redis"),
        ("s3", "none"),
        # SeaweedFS: a real server's atomic If-None-Match decides every race; no lock.
        ("s3-seaweedfs", "none"),
    ],
)
def test_many_processes_commit_disjoint_chunks(
    kind: str,
    mode: str,
    redis_server: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    workers: Callable[..., Worker],
) -> None:
    storage = storage_for(kind, tmp_path, request)
    repo = new_repo(storage)
    lock: Any = {
        "redis": zarrlake.RedisLock(redis_server.url, wait_s=60),
        "local-lock": zarrlake.LocalLock(tmp_path / "locks", wait_s=60),
        "none": None,
    }[mode]
    procs, commits = (6, 5) if kind == "local" else (4, 4)
    ws = [
        workers("commits", storage=storage, lock=lock, writer=i, commits=commits, tag="d")
        for i in range(procs)
    ]
    go(ws)
    finish_all(ws)
    assert all(len(w.events("commit")) == commits for w in ws)
    check_commits(repo, ws, "d")
    stats = [w.events("stats")[0] for w in ws]
    tokens = [e.token for e in journal(repo)[2:]]
    if lock is None:
        assert tokens == [None] * procs * commits
    else:
        # With the lock, every commit held it: fencing tokens rise with the journal, and no
        # writer ever lost a journal append (they queue rather than race).
        assert all(t is not None for t in tokens)
        assert all(a < b for a, b in itertools.pairwise(tokens)), tokens  # type: ignore[operator]
        assert sum(s["append_retries"] for s in stats) == 0
    assert repo.fsck().ok


@pytest.mark.parametrize("mode", ["redis", "none"])
def test_conflicting_writes_exactly_one_wins_per_chunk(
    mode: str, redis_server: Any, tmp_path: Path, workers: Callable[..., Worker]
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = new_repo(storage)
    lock = zarrlake.RedisLock(redis_server.url, wait_s=60) if mode == "redis" else None
    contested, per_chunk = (0, 1), 3
    ws = [
        workers("conflict", storage=storage, lock=lock, writer=w, index=c, tag=f"w{w}")
        for c in contested
        for w in range(c * per_chunk, (c + 1) * per_chunk)
    ]
    go(ws)
    finish_all(ws)
    session = repo.readonly_session("main")
    for c in contested:
        mine = ws[c * per_chunk : (c + 1) * per_chunk]
        won = [w for w in mine if w.events("won")]
        lost = [w for w in mine if w.events("conflict")]
        assert len(won) == 1 and len(lost) == per_chunk - 1, [w.records for w in mine]
        for w in lost:
            [rec] = w.events("conflict")
            assert rec["conflicts"] == [["chunk", f"/{ARRAY}", [c]]]
        winner = won[0].events("won")[0]
        assert session.read(chunk_key(c)) == chunk_value(f"w{winner['writer']}", c)
    history = check_linear(repo)
    assert len(history) == 2 + len(contested)
    check_journal_chain(repo)


# -- crash consistency -----------------------------------------------------------------------------


def check_crashed_repository(storage: zarrlake.Storage, ws: list[Worker]) -> None:
    """The repository opens, fsck is clean, every branch head is whole, and holds exactly the
    commits the writers confirmed plus, for each writer, possibly the one it was in the middle of
    — entirely or not at all."""
    repo = zarrlake.Repository.open(storage)
    report = repo.fsck()
    assert report.ok, [str(p) for p in report.problems]
    branches = repo.list_branches()
    assert set(branches) == set(CRASH_BRANCHES)
    for branch in CRASH_BRANCHES:
        check_journal_chain(repo, branch)
        history_ids = {c.id for c in check_linear(repo, branch)}
        session = repo.readonly_session(branch)
        # Every chunk the head references reads back, with the bytes its writer wrote.
        present = set(session.list_prefix(f"{ARRAY}/c/"))
        for key, data in zip(present, storage.map(session.read, present), strict=True):
            assert data == chunk_value("crash", int(key.rsplit("/", 1)[1])), key
        for w in ws:
            begun = {r["i"]: r for r in w.events("begin") if r["branch"] == branch}
            done = {r["i"]: r for r in w.events("done") if r["branch"] == branch}
            assert set(done) <= set(begun)
            in_flight = set(begun) - set(done)
            assert len(in_flight) <= 1  # a writer has at most one commit under way
            landed = []
            for i, rec in begun.items():
                keys = {chunk_key(x) for x in rec["indexes"]}
                if keys <= present:
                    landed.append(i)
                else:
                    assert not keys & present, f"torn commit {i} of writer {w.pid} on {branch}"
                    assert i not in done, f"confirmed commit {i} of writer {w.pid} is missing"
            assert {r["sid"] for r in done.values()} <= history_ids
            # The writer's group node is from the same commit as its newest chunks.
            doc = session.read(f"g{w.args['writer']}/zarr.json")
            if landed:
                assert doc is not None and json.loads(doc)["attributes"]["last"] == max(landed)
            else:
                assert doc is None
        # Nothing on the branch that no writer began.
        begun_keys = {
            chunk_key(x)
            for w in ws
            for r in w.events("begin")
            if r["branch"] == branch
            for x in r["indexes"]
        }
        assert present <= begun_keys


def run_crash_trials(
    storage_factory: Callable[[int], zarrlake.Storage],
    trials: int,
    parallel: int,
    lock_factory: Callable[[int], Any],
    max_delay: float,
    workers: Callable[..., Worker],
) -> None:
    rng = random.Random(0x5EED)
    killed_mid_commit = 0
    for first in range(0, trials, parallel):
        batch = []
        for t in range(first, min(trials, first + parallel)):
            storage = storage_factory(t)
            repo = new_repo(storage)
            repo.create_branch("dev")
            lock = lock_factory(t)
            ws = [
                workers("crash", storage=storage, lock=lock, writer=w, seed=rng.random())
                for w in range(2)
            ]
            batch.append((storage, ws))
        for _, ws in batch:
            for w in ws:
                w.wait_for("ready")
                w.send("go")
        # Each writer dies at a random moment after its first confirmed commit.
        killers = [
            threading.Thread(target=kill_later, args=(w, rng.uniform(0, max_delay)))
            for _, ws in batch
            for w in ws
        ]
        for k in killers:
            k.start()
        for k in killers:
            k.join()
        for storage, ws in batch:
            for w in ws:
                w.finish()
                assert w.proc.returncode == -signal.SIGKILL, w.diagnose()
                killed_mid_commit += len(w.events("begin")) > len(w.events("done"))
            check_crashed_repository(storage, ws)
    # The trials did what they are for: most writers died in the middle of a commit.
    assert killed_mid_commit >= trials


def kill_later(w: Worker, delay: float) -> None:
    try:
        w.wait_for("done", timeout=120)
    finally:
        time.sleep(delay)
        w.signal(signal.SIGKILL)


def test_crash_consistency_local(
    redis_server: Any, tmp_path: Path, workers: Callable[..., Worker]
) -> None:
    def lock_for(t: int) -> Any:
        return (
            None,
            zarrlake.RedisLock(redis_server.url, lease_s=1, wait_s=30),
            zarrlake.LocalLock(tmp_path / "locks", wait_s=30),
        )[t % 3]

    run_crash_trials(
        lambda t: zarrlake.Storage.local(tmp_path / f"repo{t}"),
        trials=15,
        parallel=5,
        lock_factory=lock_for,
        max_delay=0.6,
        workers=workers,
    )


def test_crash_consistency_s3(
    moto_s3: Any, redis_server: Any, workers: Callable[..., Worker]
) -> None:
    def lock_for(t: int) -> Any:
        return (None, zarrlake.RedisLock(redis_server.url, lease_s=1, wait_s=30))[t % 2]

    run_crash_trials(
        lambda t: moto_s3.storage(),
        trials=6,
        parallel=6,
        lock_factory=lock_for,
        max_delay=0.8,
        workers=workers,
    )


# -- URLs, TLS and passwords -----------------------------------------------------------------------


@pytest.fixture
def secured_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A redis-server that wants a password, on a plain port and, if openssl can make a
    certificate, on a TLS port."""
    password = "s3cr3t-" + os.urandom(4).hex()
    ca = None
    try:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(tmp_path / "key.pem"),
                "-out",
                str(tmp_path / "cert.pem"),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        ca = tmp_path / "cert.pem"
    except (OSError, subprocess.SubprocessError):
        pass
    tls_ports: list[int] = []

    def command(port: int) -> list[str]:
        cmd = redis_command(port, tmp_path, "--requirepass", password)
        if ca is not None:
            tls_ports.append(free_port())  # a fresh one on each try, as the plain port
            cmd += [
                "--tls-port",
                str(tls_ports[-1]),
                "--tls-cert-file",
                str(ca),
                "--tls-key-file",
                str(tmp_path / "key.pem"),
                "--tls-ca-cert-file",
                str(ca),
                "--tls-auth-clients",
                "no",
            ]
        return cmd

    proc, port = spawn_on_free_port(
        command, 60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        tls_port = tls_ports[-1] if ca is not None else None
        if tls_port is not None:
            wait_for_port(tls_port, 60, proc)
        yield {"port": port, "tls_port": tls_port, "password": password, "ca": ca}
    finally:
        stop(proc)


def test_password_and_tls_urls(secured_redis: dict[str, Any], tmp_path: Path) -> None:
    import redis

    pw, port = secured_redis["password"], secured_redis["port"]
    repo = new_repo(zarrlake.Storage.local(tmp_path / "repo"))
    urls = [f"redis://:{pw}@127.0.0.1:{port}/0", f"redis://default:{pw}@127.0.0.1:{port}/0"]
    if secured_redis["tls_port"]:
        urls.append(
            f"rediss://:{pw}@127.0.0.1:{secured_redis['tls_port']}/0?ssl_ca_certs={secured_redis['ca']}"
        )
    for url in urls:
        lock = zarrlake.locks.lock_from_url(url, on_unavailable="fail", wait_s=5)
        assert isinstance(lock, zarrlake.RedisLock)
        assert pw not in repr(lock)
        lease = lock.acquire(repo.id, "main")
        assert lease is not None
        [held] = lock.status(repo.id)
        assert held.token == lease.token
        lease.release()
        locked = zarrlake.Repository.open(repo.storage, lock=lock)
        s = locked.writable_session("main")
        s.write(chunk_key(len(url)), chunk_value("tls", len(url)))
        s.commit(f"via {url.split(':')[0]}")
        assert journal(repo)[-1].token is not None
    if secured_redis["tls_port"]:
        tls = zarrlake.RedisLock(urls[-1])
        assert issubclass(tls.client.connection_pool.connection_class, redis.SSLConnection)
    # Wrong or missing password: the lock service is unusable.
    for url in (f"redis://:wrong@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        with pytest.raises(zarrlake.LockUnavailable) as info:
            zarrlake.RedisLock(url, on_unavailable="fail").acquire(repo.id, "main")
        assert pw not in str(info.value)
    with pytest.raises(ValueError):
        zarrlake.RedisLock("http://127.0.0.1:1/0")


# -- CLI -------------------------------------------------------------------------------------------


def test_cli_fsck_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zarrlake.cli import main

    path = tmp_path / "repo"
    storage = zarrlake.Storage.local(path)
    repo = new_repo(storage)
    s = repo.writable_session("main")
    s.write(chunk_key(0), chunk_value("f", 0))
    s.commit("one chunk")
    capsys.readouterr()
    assert main(["fsck", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    [chunk] = storage.list_keys("chunks/")
    os.unlink(path / chunk)
    assert main(["fsck", str(path)]) == 1
    captured = capsys.readouterr()
    assert "missing" in captured.out and chunk in captured.out
    assert main(["fsck", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["problems"][0]["key"] == chunk
    assert main(["fsck", str(path), "--skip-chunks"]) == 0
    assert main(["fsck", str(tmp_path / "nothing-here")]) == 1
    assert main(["lock", "status", str(path)]) == 2  # no --lock: bad input
    assert main(["lock", "status", str(path), "--lock", str(tmp_path / "locks")]) == 2


def test_fencing_tokens_stay_monotonic_after_redis_loses_its_counter(
    own_redis: Any, tmp_path: Path
) -> None:
    """Redis without persistence forgets the fence counter on restart; the journal remembers the
    tokens it recorded. The first commit after the loss finds its token stale, raises the
    counter past the journal's and takes the lock again: no journal entry ever carries a token
    that is not above its predecessor's."""
    import redis as redis_py

    lock = zarrlake.RedisLock(own_redis.url, lease_s=5, wait_s=10)
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"), lock=lock)

    def commit(i: int) -> int:
        session = repo.writable_session()
        session.write(f"arr/c/{i}", bytes([i]) * 8)
        session.commit(f"commit {i}")
        token = repo.core.journal.current("main").token
        assert token is not None, "a commit under a lock records its fencing token"
        return token

    before = [commit(i) for i in range(3)]
    assert before == sorted(before) and len(set(before)) == 3
    redis_py.Redis.from_url(own_redis.url).flushall()  # the counter is gone
    after = [commit(i) for i in range(3, 6)]
    assert after[0] > before[-1]  # not one the forgetful server handed out again
    assert after == sorted(after) and len(set(after)) == 3


def test_fencing_tokens_stay_above_the_journal_across_optimistic_commits(
    own_redis: Any, tmp_path: Path
) -> None:
    """While Redis was down, writers committed optimistically (entries without a token); the
    first locked commit after a new, empty Redis still exceeds the last token recorded before."""
    import redis as redis_py

    storage = zarrlake.Storage.local(tmp_path / "repo")
    locked = zarrlake.Repository.create(
        storage, lock=zarrlake.RedisLock(own_redis.url, lease_s=5, wait_s=10)
    )
    unlocked = zarrlake.Repository.open(storage)
    for i in range(3):
        session = locked.writable_session()
        session.write(f"arr/c/{i}", bytes([i]) * 8)
        session.commit(f"locked {i}")
    before = locked.core.journal.current("main").token
    assert before is not None and before >= 3
    redis_py.Redis.from_url(own_redis.url).flushall()
    for i in range(3, 5):
        session = unlocked.writable_session()
        session.write(f"arr/c/{i}", bytes([i]) * 8)
        session.commit(f"optimistic {i}")
    assert unlocked.core.journal.current("main").token is None
    session = locked.writable_session()
    session.write("arr/c/9", b"9" * 8)
    session.commit("locked again")
    after = locked.core.journal.current("main").token
    assert after is not None and after > before


def test_fencing_tokens_stay_above_the_journal_after_many_unlocked_moves(
    own_redis: Any, tmp_path: Path
) -> None:
    """Every entry carries the highest token before it (``fence``), so however many entries
    were written without the lock since the last token (here 20 optimistic commits and resets,
    more than a look back would read), a new, empty Redis's first token is raised above it, and
    branch resets and deletions under the lock keep the tokens monotonic too."""
    import redis as redis_py

    storage = zarrlake.Storage.local(tmp_path / "repo")
    locked = zarrlake.Repository.create(
        storage, lock=zarrlake.RedisLock(own_redis.url, lease_s=5, wait_s=10)
    )
    unlocked = zarrlake.Repository.open(storage)
    for i in range(5):
        session = locked.writable_session()
        session.write(f"arr/c/{i}", bytes([i]) * 8)
        session.commit(f"locked {i}")
    journal = locked.core.journal
    before = journal.current("main").token
    assert before is not None and before >= 5
    first = journal.current("main").snapshot
    for i in range(10):
        session = unlocked.writable_session()
        session.write(f"arr/c/{i}", bytes([100 + i]) * 8)
        head = session.commit(f"optimistic {i}")
        unlocked.reset_branch("main", first)
        unlocked.reset_branch("main", head)
    head = journal.current("main")
    assert head.token is None and head.fence == before  # carried through 30 unlocked moves
    redis_py.Redis.from_url(own_redis.url).flushall()  # the counter is gone
    locked.reset_branch("main", first)
    after_reset = journal.current("main").token
    assert after_reset is not None and after_reset > before
    # A branch carries its own journal's tokens: "dev" starts fresh, moves under the lock, and
    # its deletion after another loss of the counter still exceeds them.
    locked.create_branch("dev", "main")
    locked.reset_branch("dev", first)
    dev_token = journal.current("dev").token
    assert dev_token is not None
    redis_py.Redis.from_url(own_redis.url).flushall()
    locked.delete_branch("dev")
    deleted = journal.head("dev")
    assert deleted is not None and deleted.snapshot is None
    assert deleted.token is not None and deleted.token > dev_token
    assert deleted.fence == dev_token


def test_local_lock_floor(tmp_path: Path) -> None:
    lock = zarrlake.LocalLock(tmp_path / "locks")
    with lock.hold("repo", "main") as first:
        pass
    lock.raise_floor("repo", 100)
    with lock.hold("repo", "main") as token:
        assert token > 100 > first
