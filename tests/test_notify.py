"""Webhooks (issue 42): events delivered to a real local HTTP receiver that fails, is slow and
comes back — every event delivered, each idempotency key applied once, signatures that verify —
and a notifier killed with SIGKILL mid-run that loses nothing when started again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import zarr

import zarrlake
from zarrlake.notify import Notifier, Webhook, verify

SECRET = b"s3cret-for-tests"


class Receiver:
    """A webhook receiver on a loopback port. ``script`` says what each request gets, in order
    (``"fail"``: HTTP 500, ``"slow"``: an answer after ``slow_s``, ``"ok"``), then ``"ok"``."""

    def __init__(self, script: list[str] | None = None, slow_s: float = 1.0) -> None:
        self.script = list(script or [])
        self.slow_s = slow_s
        self.requests: list[dict[str, Any]] = []
        self.applied: dict[str, dict[str, Any]] = {}  # idempotency key -> body, applied once
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    step = receiver.script.pop(0) if receiver.script else "ok"
                    receiver.requests.append(
                        {
                            "key": self.headers["Zarrlake-Delivery"],
                            "event": self.headers["Zarrlake-Event"],
                            "attempt": int(self.headers["Zarrlake-Attempt"]),
                            "signature": self.headers.get("Zarrlake-Signature"),
                            "body": body,
                            "step": step,
                        }
                    )
                if step == "fail":
                    self.send_response(500)
                    self.end_headers()
                    return
                if step == "slow":
                    time.sleep(receiver.slow_s)
                with receiver.lock:
                    receiver.applied.setdefault(self.headers["Zarrlake-Delivery"], json.loads(body))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def events(self) -> list[tuple[str, Any]]:
        """(event, what it names) of each applied event, in the order first applied."""
        return [(b["event"], b.get("snapshot", b.get("tag"))) for b in self.applied.values()]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _commit(repo: zarrlake.Repository, branch: str, value: float, msg: str) -> str:
    session = repo.writable_session(branch)
    root = zarr.open_group(session.store, mode="a")
    if "t" not in root:
        root.create_array("t", shape=(4,), chunks=(2,), dtype="f4")
    root["t"][0] = value
    return session.commit(msg)


def test_events_in_order_signed_with_their_payloads(
    storage: zarrlake.Storage, receiver: Receiver
) -> None:
    repo = zarrlake.Repository.create(storage)
    before = _commit(repo, "main", 1.0, "before the hook")
    notifier = Notifier(repo, Webhook(receiver.url, secret=SECRET), max_backoff_s=0.05)
    first = notifier.run_once()
    assert first.delivered == 0 and receiver.requests == []  # the history before is not news
    c1 = _commit(repo, "main", 2.0, "one")
    c2 = _commit(repo, "main", 3.0, "two")
    repo.create_branch("dev")
    d1 = _commit(repo, "dev", 4.0, "on dev")
    merged = repo.merge("dev", "main")
    repo.create_tag("v1", merged)
    repo.reset_branch("dev", before)
    report = notifier.run_once()
    assert receiver.events() == [
        ("branch-created", c2),  # dev, where it was created (main's head then),
        ("branch-reset", before),  # then reset behind its own commit: d1 never shows alone
        ("commit", c1),
        ("commit", c2),
        ("merge", merged),
        ("tag", merged),
    ]
    assert report.delivered == 6 and report.failed_attempts == 0
    for r in receiver.requests:
        assert verify(SECRET, r["body"], r["signature"])
        assert r["attempt"] == 1
    bodies = list(receiver.applied.values())
    assert bodies[2]["message"] == "one" and bodies[2]["parents"] == [before]
    assert bodies[2]["branch"] == "main" and bodies[2]["repository"] == repo.id
    assert bodies[4]["parents"] == [c2, d1]
    # Nothing new: nothing delivered. A deletion and a reset are events too.
    assert notifier.run_once().delivered == 0
    repo.reset_branch("dev", c1)
    repo.delete_branch("dev")
    assert notifier.run_once().kinds == {"branch-deleted": 1}
    repo.create_branch("x", c2)
    assert notifier.run_once().kinds == {"branch-created": 1}
    repo.reset_branch("x", before)  # backwards: not a descendant of what was delivered
    assert notifier.run_once().kinds == {"branch-reset": 1}
    repo.reset_branch("x", c2)  # forwards again: the commits along the way
    assert notifier.run_once().kinds == {"commit": 2}
    assert len(receiver.applied) == len(receiver.requests) == 11


def test_a_receiver_that_fails_is_slow_and_comes_back_gets_every_event_once() -> None:
    receiver = Receiver(["fail", "fail", "fail", "slow", "ok", "fail", "slow"], slow_s=1.5)
    try:
        repo = zarrlake.Repository.create(zarrlake.Storage.memory())
        hook = Webhook(receiver.url, secret=SECRET, timeout_s=0.5)
        notifier = Notifier(repo, hook, max_backoff_s=0.05)
        notifier.run_once()
        made = [_commit(repo, "main", float(i), f"c{i}") for i in range(6)]
        report = notifier.run_once()
        assert report.delivered == 6 and report.pending == 0
        # Four 500s, two timeouts (the slow answers came after the client gave up).
        assert report.failed_attempts == 6
        assert [s for _, s in receiver.events()] == made
        # A slow answer still reached the receiver: its retry carried the same key, applied once.
        keys = [r["key"] for r in receiver.requests]
        assert len(keys) == 12 and len(set(keys)) == 6
        for key in set(keys):
            tries = [r for r in receiver.requests if r["key"] == key]
            assert [r["attempt"] for r in tries] == list(range(1, len(tries) + 1))
            assert len({r["body"] for r in tries}) == 1  # the same body every time
    finally:
        receiver.close()


def test_give_up_after_leaves_the_rest_pending_for_the_next_run() -> None:
    receiver = Receiver(["fail"] * 1000)
    try:
        repo = zarrlake.Repository.create(zarrlake.Storage.memory())
        notifier = Notifier(repo, Webhook(receiver.url), max_backoff_s=0.02)
        notifier.run_once()
        made = [_commit(repo, "main", float(i), f"c{i}") for i in range(3)]
        report = notifier.run_once(give_up_after_s=0.3)
        assert (report.delivered, report.pending) == (0, 3) and report.failed_attempts > 1
        receiver.script.clear()  # it comes back
        assert notifier.run_once().delivered == 3
        assert [s for _, s in receiver.events()] == made
    finally:
        receiver.close()


def test_a_notifier_killed_mid_run_loses_nothing(tmp_path: Path) -> None:
    receiver = Receiver(["slow"] * 1000, slow_s=0.15)
    try:
        url = f"file://{tmp_path / 'repo'}"
        repo = zarrlake.Repository.create(zarrlake.Storage.from_url(url))
        cmd = [sys.executable, "-m", "zarrlake", "notify", url, "--webhook", receiver.url]
        subprocess.run([*cmd, "--once"], check=True, capture_output=True, timeout=60)
        made = [_commit(repo, "main", float(i), f"c{i}") for i in range(30)]
        proc = subprocess.Popen([*cmd, "--interval", "0.1"], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while len(receiver.applied) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(2 * receiver.slow_s)  # what was in flight reaches the receiver
        got_before, asked_before = len(receiver.applied), len(receiver.requests)
        assert 8 <= got_before < 30
        receiver.script.clear()
        done = subprocess.run([*cmd, "--once", "--json"], capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert [s for _, s in receiver.events()] == made  # every commit, in order, applied once
        redelivered = len(receiver.requests) - len(receiver.applied)
        assert 0 <= redelivered <= 2  # at most the one in flight when it was killed (+ retry)
        assert json.loads(done.stdout)["delivered"] == len(receiver.requests) - asked_before
    finally:
        receiver.close()


def test_two_hooks_keep_their_own_progress_and_a_branch_filter(receiver: Receiver) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    other = Receiver()
    try:
        everything = Notifier(repo, Webhook(receiver.url, name="all"))
        dev_only = Notifier(repo, Webhook(other.url, name="dev", branches=("dev*",)))
        for n in (everything, dev_only):
            n.run_once()
        m = _commit(repo, "main", 1.0, "main work")
        assert dev_only.run_once().delivered == 0
        repo.create_branch("dev")
        c = _commit(repo, "dev", 2.0, "dev work")
        assert dev_only.run_once().delivered == 2  # created (at m), then c
        d = _commit(repo, "dev", 3.0, "more dev work")
        assert dev_only.run_once().delivered == 1
        assert other.events() == [("branch-created", m), ("commit", c), ("commit", d)]
        assert everything.run_once().kinds == {"branch-created": 1, "commit": 3}
        # A hook narrowed to fewer branches is told of no deletion of those it no longer sees.
        narrowed = Notifier(repo, Webhook(receiver.url, name="all", branches=("main",)))
        assert narrowed.run_once().delivered == 0
        # The same branch created twice at one snapshot: two events, two keys.
        repo.delete_branch("dev")
        assert everything.run_once().kinds == {"branch-deleted": 1}
        repo.create_branch("dev2", m)
        assert everything.run_once().kinds == {"branch-created": 1}
        repo.delete_branch("dev2")
        assert everything.run_once().kinds == {"branch-deleted": 1}
        repo.create_branch("dev2", m)
        assert everything.run_once().kinds == {"branch-created": 1}
        created = [r for r in receiver.requests if r["event"] == "branch-created"]
        assert len({r["key"] for r in created}) == len(created) == 3
        deleted = [r for r in receiver.requests if r["event"] == "branch-deleted"]
        assert len({r["key"] for r in deleted}) == len(deleted) == 2
    finally:
        other.close()


def test_bad_input(tmp_path: Path, cli: Callable[..., Any]) -> None:
    with pytest.raises(zarrlake.InvalidArgument, match="http"):
        Webhook("ftp://example.com/")
    with pytest.raises(zarrlake.InvalidArgument, match="unknown webhook event"):
        Webhook("http://127.0.0.1:1/", events=frozenset({"push"}))
    url = f"file://{tmp_path / 'repo'}"
    assert cli("init", url).code == 0
    r = cli("notify", url, "--webhook", "http://127.0.0.1:1/", "--secret-file", "/nope", "--once")
    assert r.code == 2 and r.err.count("\n") == 1 and "--secret-file" in r.err
    r = cli("notify", url, "--webhook", "gopher://x/", "--once")
    assert r.code == 2 and r.err.count("\n") == 1
    r = cli("notify", url, "--webhook", "http://127.0.0.1:1/", "--interval", "soon")
    assert r.code == 2 and "--interval" in r.err
