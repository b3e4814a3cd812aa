"""The programs the lock tests run in child processes: ``python lock_workers.py <payload>``.

The payload is a base64-encoded pickle of ``{"mode": ..., **arguments}``. Every program reports
what it did as JSON records on stdout, one per line, flushed before it goes on, so a record
survives the process being SIGKILLed right after. This module imports neither pytest nor the
tests, so a worker starts quickly.
"""

from __future__ import annotations

import base64
import datetime as dt
import fcntl
import hashlib
import json
import os
import pickle
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import zarrlake

ARRAY = "a"
CRASH_BRANCHES = ("main", "dev")


# -- data the writers write ------------------------------------------------------------------------


def chunk_key(index: int) -> str:
    return f"{ARRAY}/c/{index}"


def chunk_value(tag: str, index: int) -> bytes:
    """Deterministic bytes, above the inline threshold so every chunk is a real object."""
    return hashlib.sha256(f"{tag}:{index}".encode()).digest() * 24  # 768 bytes


def array_doc(size: int = 1 << 30) -> bytes:
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


def group_doc(attributes: dict[str, Any]) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}).encode()


# -- the worker programs ---------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _ready_then_wait_for_go() -> None:
    _emit("ready")
    assert sys.stdin.readline().strip() == "go"


def _w_exclusion(a: dict[str, Any]) -> None:
    import redis

    counter = redis.Redis.from_url(a["counter_url"])
    fd = os.open(a["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(line: str) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.write(fd, line.encode())
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    _ready_then_wait_for_go()
    for _ in range(a["rounds"]):
        with a["lock"].hold(a["repo_id"], "main") as token:
            inside = counter.incr(a["counter"])
            record(f"enter {os.getpid()} {token} {inside}\n")
            time.sleep(a["hold_s"])
            record(f"exit {os.getpid()} {token}\n")
            counter.decr(a["counter"])


def _w_hold(a: dict[str, Any]) -> None:
    lease = a["lock"].acquire(a["repo_id"], "main")
    _emit("held", token=lease.token, holder=lease.value.rpartition(":")[0])
    sys.stdin.readline()  # until told to release (or killed)
    if a.get("expect_lost"):  # we were paused: give the renewal thread its chance to notice
        deadline = time.monotonic() + 10
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.02)
    lease.release()
    _emit("released", lost=lease.lost)


def _w_commits(a: dict[str, Any]) -> None:
    repo = zarrlake.Repository.open(a["storage"], lock=a["lock"])
    _ready_then_wait_for_go()
    stop = a.get("stop_file")
    for i in range(a["commits"]):
        if stop and os.path.exists(stop):
            break
        index = a["writer"] * 1000 + i
        s = repo.writable_session("main")
        s.write(chunk_key(index), chunk_value(a["tag"], index))
        sid = s.commit(f"writer {a['writer']} commit {i}")
        _emit("commit", sid=sid, index=index)
        if a.get("pause_s"):
            time.sleep(a["pause_s"])
    _emit("stats", **repo.stats)


def _w_conflict(a: dict[str, Any]) -> None:
    repo = zarrlake.Repository.open(a["storage"], lock=a["lock"])
    s = repo.writable_session("main")  # every contender starts from the same head
    s.write(chunk_key(a["index"]), chunk_value(a["tag"], a["index"]))
    _ready_then_wait_for_go()
    try:
        sid = s.commit(f"writer {a['writer']}")
    except zarrlake.ConflictError as e:
        _emit("conflict", conflicts=[[c.kind, c.path, list(c.chunk or ())] for c in e.conflicts])
    else:
        _emit("won", sid=sid, writer=a["writer"])


def _w_paused(a: dict[str, Any]) -> None:
    """Commit (or reset with compare-and-set) under the lock, stopping right before the journal
    write: a profiling hook (the code runs unmodified) reports the prepared entry and waits for a
    line on stdin, while the test SIGSTOPs this process past its lease."""
    from zarrlake.refs import BranchJournal

    repo = zarrlake.Repository.open(a["storage"], lock=a["lock"])
    append = BranchJournal.append.__code__

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is append:
            sys.setprofile(None)
            entry = frame.f_locals["entry"]
            _emit("at-append", seq=entry.seq, previous=entry.previous, token=entry.token)
            sys.stdin.readline()

    if a["operation"] == "commit":
        s = repo.writable_session("main")
        s.write(chunk_key(a["index"]), chunk_value(a["tag"], a["index"]))
        sys.setprofile(hook)
        sid = s.commit("A, paused past its lease")
        _emit("committed", sid=sid)
    else:
        expected = repo.lookup_branch("main")
        sys.setprofile(hook)
        try:
            repo.reset_branch("main", a["reset_to"], expected=expected)
        except zarrlake.ConflictError as e:
            _emit("conflict", error=type(e).__name__)
        else:
            _emit("reset")


def _w_crash(a: dict[str, Any]) -> None:
    """Commit forever (until SIGKILLed): three chunks and this writer's group node per commit, to
    a random branch. ``begin`` is printed before the commit starts, ``done`` after it returns."""
    rng = random.Random(a["seed"])
    writer = a["writer"]
    repo = zarrlake.Repository.open(a["storage"], lock=a["lock"])
    _ready_then_wait_for_go()
    i = 0
    while True:
        branch = rng.choice(CRASH_BRANCHES)
        indexes = [writer * 1_000_000 + i * 3 + j for j in range(3)]
        _emit("begin", branch=branch, i=i, indexes=indexes, writer=writer)
        s = repo.writable_session(branch)
        for x in indexes:
            s.write(chunk_key(x), chunk_value("crash", x))
        s.write(f"g{writer}/zarr.json", group_doc({"last": i, "at": dt.datetime.now().isoformat()}))
        sid = s.commit(f"writer {writer} commit {i}")
        _emit("done", branch=branch, i=i, sid=sid)
        i += 1


_PROGRAMS: dict[str, Callable[[dict[str, Any]], None]] = {
    "exclusion": _w_exclusion,
    "hold": _w_hold,
    "commits": _w_commits,
    "conflict": _w_conflict,
    "paused": _w_paused,
    "crash": _w_crash,
}


def main() -> None:
    args = pickle.loads(base64.b64decode(sys.argv[1]))
    _PROGRAMS[args.pop("mode")](args)


if __name__ == "__main__":
    main()
