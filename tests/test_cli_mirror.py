"""``zarrlake mirror run`` and ``zarrlake mirror status`` as real processes on local directories:
what the mirror shows afterwards, the ``--json`` passes, stopping on SIGTERM, the metrics
endpoint, two promoters sharing one lock, and the one-line errors of bad input.

Every wait is on an event (a JSON pass on stdout, a metrics line, a process exit) with a
generous deadline, never on a sleep.
"""

from __future__ import annotations

import json
import os
import pty
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake as zl
from cli_helpers import Result, assert_one_line_error
from zarrlake_testkit.servers import free_port

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")

DEADLINE = 60.0  # seconds: generous, a pass on a loaded machine still takes well under one

STATUS_KEYS = [
    "source",
    "destination",
    "time",
    "up_to_date",
    "checked_objects",
    "copied_objects",
    "copied_bytes",
    "promoted",
    "refs",
]
REF_KEYS = [
    "kind",
    "name",
    "source_head",
    "mirrored_head",
    "commits_behind",
    "seconds_behind",
    "missing_objects",
    "last_promotion",
    "error",
]


def commit(path: Path, value: int, message: str) -> str:
    """Commit array ``a`` (8 chunks of 4 KiB, each an object) with data drawn from ``value``."""
    repo = zl.Repository.open(zl.Storage.local(path))
    with repo.transaction("main", message=message) as store:
        try:
            arr = zarr.open_array(store, path="a", mode="r+")
        except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError):
            arr = zarr.create_array(store, name="a", shape=(8 * 1024,), chunks=(1024,), dtype="i4")
        arr[:] = np.random.default_rng(value).integers(0, 2**31, 8 * 1024, dtype="i4")
    return repo.lookup_branch("main")


def read(path: Path, ref: str) -> np.ndarray:
    repo = zl.Repository.open(zl.Storage.local(path))
    return np.asarray(zarr.open_array(repo.readonly_session(ref).store, path="a", mode="r")[:])


def files(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def zarrlake(*argv: str | Path, stderr_tty: bool = False) -> Result:
    """``python -m zarrlake ARGS...`` to completion."""
    cmd = [sys.executable, "-m", "zarrlake", *map(str, argv)]
    if not stderr_tty:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return Result(p.returncode, p.stdout, p.stderr)
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=follower, text=True)
        os.close(follower)
        err = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            err += chunk
        out = proc.communicate(timeout=120)[0]
    finally:
        os.close(leader)
    return Result(proc.returncode, out, err.decode(errors="replace"))


class Promoter:
    """A ``zarrlake mirror run --json`` process; its passes arrive on a queue as they print."""

    def __init__(self, *argv: str | Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zarrlake", "mirror", "run", *map(str, argv), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.passes: queue.Queue[dict[str, Any]] = queue.Queue()
        self.count = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.passes.put(json.loads(line))  # each line one whole document: JSON lines

    def wait_for(self, want: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first pass (from now on) for which ``want`` holds."""
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                doc = self.passes.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such pass within {DEADLINE}s") from None
            self.count += 1
            if want(doc):
                return doc

    def stop(self) -> tuple[int, str]:
        """SIGTERM; the exit status and stderr."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        return self.proc.wait(DEADLINE), err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_until_asking_for_the_lock(p: Promoter, locks: Path) -> None:
    """Until ``p`` has a lock file under ``locks`` open: it is up and asking for the lock (a
    standby keeps one open while it waits, and reopens it at once after each short wait)."""
    deadline = time.monotonic() + DEADLINE
    fds = Path(f"/proc/{p.proc.pid}/fd")
    while time.monotonic() < deadline:
        assert p.proc.poll() is None, "the promoter exited"
        for fd in list(fds.iterdir()) if fds.exists() else []:
            try:
                if os.readlink(fd).startswith(str(locks)):
                    return
            except OSError:
                pass  # closed meanwhile
        time.sleep(0.01)
    raise AssertionError(f"{p.proc.pid} never opened a lock under {locks}")


def main_ref(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["refs"] if (r["kind"], r["name"]) == ("branch", "main"))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A repository with one commit on main and tag v1 on it."""
    path = tmp_path / "source"
    zl.Repository.create(zl.Storage.local(path))
    commit(path, 0, "first")
    zl.Repository.open(zl.Storage.local(path)).create_tag("v1", "main")
    return path


@pytest.fixture
def zl_cli(cli: Callable[..., Result]) -> Callable[..., Result]:
    """``zarrlake ARGS...`` in-process (the ``cli`` fixture), taking paths as well as strings."""
    return lambda *argv: cli(*map(str, argv))


@pytest.fixture
def promoters() -> Any:
    started: list[Promoter] = []

    def start(*argv: str | Path) -> Promoter:
        started.append(Promoter(*argv))
        return started[-1]

    yield start
    for p in started:
        p.kill()


# -- one pass ------------------------------------------------------------------------------------


def test_once_copies_promotes_and_the_mirror_reads_the_same(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "mirror"
    r = zarrlake("mirror", "run", source, dest, "--once")
    assert (r.code, r.err) == (0, ""), r.err  # stderr not a terminal: no progress line
    head = zl.Repository.open(zl.Storage.local(source)).lookup_branch("main")
    lines = r.out.splitlines()
    assert "up to date" in lines[0] and "promoted branch main, tag v1" in lines[0]
    assert "copied" in lines[0]
    assert lines[1].split() == [
        "KIND",
        "REF",
        "SOURCE",
        "MIRRORED",
        "BEHIND",
        "LAG",
        "MISSING",
        "ERROR",
    ]
    rows = [line.split() for line in lines[2:]]
    assert rows == [
        ["branch", "main", head[:12], head[:12], "0", "0.0s", "0"],
        ["tag", "v1", head[:12], head[:12], "0", "0.0s", "0"],
    ]

    mirror = zl.Repository.open(zl.Storage.local(dest))
    assert mirror.list_branches() == {"main": head}
    assert mirror.list_tags() == {"v1": head}
    np.testing.assert_array_equal(read(dest, "main"), read(source, "main"))
    np.testing.assert_array_equal(read(dest, "v1"), read(source, "main"))
    with pytest.raises(zl.ReadOnlyError, match="source"):
        mirror.writable_session("main")


def test_once_json_is_one_line_per_pass(
    source: Path, tmp_path: Path, zl_cli: Callable[..., Result]
) -> None:
    dest = tmp_path / "mirror"
    r = zl_cli("mirror", "run", source, dest, "--once", "--json", "--no-tags")
    assert (r.code, r.err) == (0, "")
    assert r.out.count("\n") == 1
    doc = json.loads(r.out)
    assert list(doc) == STATUS_KEYS
    assert doc["source"] == source.as_uri() and doc["destination"] == dest.as_uri()
    assert doc["up_to_date"] is True and doc["promoted"] == ["branch main"]
    assert doc["copied_objects"] >= 8 and doc["copied_bytes"] >= 8 * 4096
    assert len(doc["refs"]) == 1  # --no-tags
    ref = doc["refs"][0]
    assert list(ref) == REF_KEYS
    head = zl.Repository.open(zl.Storage.local(source)).lookup_branch("main")
    assert ref["source_head"] == ref["mirrored_head"] == head
    assert ref["last_promotion"] is not None and ref["error"] is None
    assert zl.Repository.open(zl.Storage.local(dest)).list_tags() == {}

    again = json.loads(zl_cli("mirror", "run", source, dest, "--once", "--json").out)
    assert again["promoted"] == ["tag v1"] and again["copied_objects"] == 0


def test_progress_line_only_on_a_terminal(source: Path, tmp_path: Path) -> None:
    r = zarrlake("mirror", "run", source, tmp_path / "mirror", "--once", stderr_tty=True)
    assert r.code == 0, r.err
    assert "copying objects" in r.err
    assert "promoted branch main" in r.out


def test_branch_globs(source: Path, tmp_path: Path, zl_cli: Callable[..., Result]) -> None:
    repo = zl.Repository.open(zl.Storage.local(source))
    repo.create_branch("release/1", "main")
    repo.create_branch("dev", "main")
    dest = tmp_path / "mirror"
    r = zl_cli("mirror", "run", source, dest, "--once", "--json", "--branch", "release/*")
    assert r.code == 0, r.err
    assert [(x["kind"], x["name"]) for x in json.loads(r.out)["refs"]] == [
        ("branch", "release/1"),
        ("tag", "v1"),
    ]
    assert list(zl.Repository.open(zl.Storage.local(dest)).list_branches()) == ["release/1"]


def test_external_mode_waits_for_the_objects(
    source: Path, tmp_path: Path, zl_cli: Callable[..., Result]
) -> None:
    dest = tmp_path / "mirror"
    doc = json.loads(zl_cli("mirror", "run", source, dest, "--once", "--external", "--json").out)
    assert doc["copied_objects"] == 0 and doc["promoted"] == []
    assert main_ref(doc)["mirrored_head"] is None and main_ref(doc)["missing_objects"] > 0
    assert zl.Repository.open(zl.Storage.local(dest)).list_branches() == {}


# -- status --------------------------------------------------------------------------------------


def test_status_before_and_after(
    source: Path, tmp_path: Path, zl_cli: Callable[..., Result]
) -> None:
    dest = tmp_path / "mirror"
    msg = assert_one_line_error(zl_cli("mirror", "status", source, dest), 1)
    assert "not (yet) a mirror" in msg
    assert not dest.exists()  # looking wrote nothing

    first = zl.Repository.open(zl.Storage.local(source)).lookup_branch("main")
    assert zl_cli("mirror", "run", source, dest, "--once").code == 0
    second = commit(source, 1, "second")
    before = files(dest)

    r = zl_cli("mirror", "status", source, dest, "--json")
    assert (r.code, r.err) == (0, "")
    doc = json.loads(r.out)  # one document (indented, as every other command's)
    assert list(doc) == STATUS_KEYS and doc["up_to_date"] is False
    assert doc["promoted"] == [] and doc["copied_objects"] == 0
    ref = main_ref(doc)
    assert (ref["source_head"], ref["mirrored_head"]) == (second, first)
    assert ref["commits_behind"] == 1 and ref["missing_objects"] > 0
    assert ref["seconds_behind"] >= 0
    human = zl_cli("mirror", "status", source, dest)
    assert human.code == 0 and "1 of 2 ref(s) behind" in human.out.splitlines()[0]
    assert ["branch", "main", second[:12], first[:12], "1"] == human.out.splitlines()[2].split()[:5]
    assert files(dest) == before  # status never writes to the destination

    assert zl_cli("mirror", "run", source, dest, "--once").code == 0
    doc = json.loads(zl_cli("mirror", "status", source, dest, "--json").out)
    assert doc["up_to_date"] is True
    assert main_ref(doc)["mirrored_head"] == second and main_ref(doc)["commits_behind"] == 0
    np.testing.assert_array_equal(read(dest, "main"), read(source, "main"))


def test_deleted_ref_propagates(
    source: Path, tmp_path: Path, zl_cli: Callable[..., Result]
) -> None:
    dest = tmp_path / "mirror"
    repo = zl.Repository.open(zl.Storage.local(source))
    repo.create_branch("dev", "main")
    assert zl_cli("mirror", "run", source, dest, "--once").code == 0
    repo.delete_branch("dev")
    repo.delete_tag("v1")
    doc = json.loads(zl_cli("mirror", "run", source, dest, "--once", "--json").out)
    assert sorted(doc["promoted"]) == ["branch dev (deleted)", "tag v1 (deleted)"]
    mirror = zl.Repository.open(zl.Storage.local(dest))
    assert list(mirror.list_branches()) == ["main"] and mirror.list_tags() == {}


# -- bad input -----------------------------------------------------------------------------------


def test_destination_holding_another_repository(
    source: Path, tmp_path: Path, zl_cli: Callable[..., Result]
) -> None:
    other = tmp_path / "other"
    zl.Repository.create(zl.Storage.local(other))
    before = files(other)
    for action in ("run", "status"):
        argv = ["mirror", action, source, other] + (["--once"] if action == "run" else [])
        msg = assert_one_line_error(zl_cli(*argv), 1)
        assert "holds repository" in msg
    assert files(other) == before
    msg = assert_one_line_error(zl_cli("mirror", "run", source, source, "--once"), 1)
    assert "source itself" in msg


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"ZARRLAKE_DEST_AZURE_STORAGE_ACCOUNT_KEY": "a2V5"}, "for a az:// destination"),
        ({"ZARRLAKE_DEST_GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}, "for a gs:// destination"),
        ({"ZARRLAKE_DEST_AWS_ACCESS_KEY_ID": "AKIA"}, "for a s3:// destination"),
    ],
)
def test_destination_credentials_for_another_provider(
    source: Path,
    tmp_path: Path,
    zl_cli: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    says: str,
) -> None:
    # Credentials meant for one provider never silently go unused on another: the operator
    # sets them from the Mirror's destination, so a mismatch is a wrong DEST.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dest = tmp_path / "mirror"
    msg = assert_one_line_error(zl_cli("mirror", "run", source, dest, "--once"), 2)
    assert says in msg and str(dest) in msg
    assert not dest.exists()


def test_unknown_source(tmp_path: Path, zl_cli: Callable[..., Result]) -> None:
    missing, dest = tmp_path / "nothing-here", tmp_path / "mirror"
    for argv in (["run", missing, dest, "--once"], ["status", missing, dest]):
        msg = assert_one_line_error(zl_cli("mirror", *argv), 1)
        assert "no zarrlake repository" in msg
    assert not missing.exists() and not dest.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "ftp://host/p", "{dest}", "--once"], "ftp"),
        (["run", "{source}", "nosuch://bucket/x", "--once"], "nosuch"),
        (["status", "{source}", "ftp://host/p"], "ftp"),
        (["run", "{source}"], "required"),
        (["status"], "required"),
        (["frobnicate", "{source}", "{dest}"], "invalid choice"),
        (["run", "{source}", "{dest}", "--copy", "--external"], "not allowed"),
        (["run", "{source}", "{dest}", "--interval", "0"], "--interval"),
        (["run", "{source}", "{dest}", "--interval", "soon"], "--interval"),
        (["run", "{source}", "{dest}", "--gc-grace", "1h"], "session lifetime"),
        (["run", "{source}", "{dest}", "--gc-every", "x"], "--gc-every"),
        (["run", "{source}", "{dest}", "--once", "--metrics-port", "9000"], "continuous"),
        (["run", "{source}", "{dest}", "--once", "--gc-every", "1d"], "continuous"),
        (["run", "{source}", "{dest}", "--metrics-port", "70000"], "port"),
        (["run", "{source}", "{dest}", "--once", "--lock", "bogus://x"], "bogus://x"),
        (["status", "{source}", "{dest}", "--once"], "unrecognized"),
    ],
)
def test_bad_input(
    source: Path, tmp_path: Path, cli: Callable[..., Result], argv: list[str], says: str
) -> None:
    dest = tmp_path / "mirror"
    r = cli("mirror", *[a.format(source=source, dest=dest) for a in argv])
    assert says in assert_one_line_error(r, 2)
    assert not dest.exists()


def test_metrics_without_prometheus_client(source: Path, tmp_path: Path) -> None:
    code = (
        "import sys, runpy; sys.modules['prometheus_client'] = None; "
        "sys.argv = ['zarrlake', *sys.argv[1:]]; runpy.run_module('zarrlake', run_name='__main__')"
    )
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "mirror",
            "run",
            source,
            tmp_path / "m",
            "--metrics-port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    msg = assert_one_line_error(Result(p.returncode, p.stdout, p.stderr), 2)
    assert "zarrlake[mirror]" in msg
    assert not (tmp_path / "m").exists()


# -- running until stopped -------------------------------------------------------------------------


def test_run_promotes_new_commits_and_stops_on_sigterm(
    source: Path, tmp_path: Path, promoters: Callable[..., Promoter]
) -> None:
    dest = tmp_path / "mirror"
    p = promoters(source, dest, "--interval", "0.2")
    first = p.wait_for(lambda d: d["up_to_date"])
    assert list(first) == STATUS_KEYS
    head = commit(source, 1, "second")
    p.wait_for(lambda d: main_ref(d)["mirrored_head"] == head)
    code, err = p.stop()
    assert (code, err) == (0, "")
    assert zl.Repository.open(zl.Storage.local(dest)).lookup_branch("main") == head
    np.testing.assert_array_equal(read(dest, "main"), read(source, "main"))


def test_metrics_endpoint_serves_the_lag(
    source: Path, tmp_path: Path, promoters: Callable[..., Promoter]
) -> None:
    port = free_port()
    p = promoters(
        source,
        tmp_path / "mirror",
        "--interval",
        "0.2",
        "--metrics-port",
        str(port),
        "--metrics-addr",
        "127.0.0.1",
    )
    p.wait_for(lambda d: d["up_to_date"])  # metrics are served before the first pass
    repo_id = zl.Repository.open(zl.Storage.local(source)).id
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        body = response.read().decode()
    lag = f'zarrlake_mirror_lag_seconds{{ref="branch/main",repository="{repo_id}"}} 0.0'
    assert lag in body.splitlines()
    assert f'zarrlake_mirror_passes_total{{repository="{repo_id}"}}' in body
    assert p.stop() == (0, "")


def test_two_promoters_one_lock_only_one_acts(
    source: Path, tmp_path: Path, promoters: Callable[..., Promoter]
) -> None:
    dest, locks = tmp_path / "mirror", tmp_path / "locks"
    argv = (source, dest, "--interval", "0.2", "--lock", locks)
    a = promoters(*argv)
    a.wait_for(lambda d: d["up_to_date"])  # a holds the lock (it has printed a pass)
    b = promoters(*argv)
    wait_until_asking_for_the_lock(b, locks)
    head = commit(source, 1, "second")
    a.wait_for(lambda d: main_ref(d)["mirrored_head"] == head)
    a.wait_for(lambda _: True)
    assert b.passes.empty() and b.proc.poll() is None  # b stands by, printing nothing

    assert a.stop() == (0, "")  # the active one goes: the standby takes over
    b.wait_for(lambda d: main_ref(d)["mirrored_head"] == head)
    newer = commit(source, 2, "third")
    b.wait_for(lambda d: main_ref(d)["mirrored_head"] == newer)
    assert b.stop() == (0, "")

    journal = zl.Repository.open(zl.Storage.local(dest)).core.journal.history("main")[::-1]
    assert [e.snapshot for e in journal][-2:] == [head, newer]
    writers = [e.writer for e in journal]
    assert len(set(writers)) == 2  # one writer while a held the lock, one after
    assert writers == sorted(writers, key=writers.index)  # in two runs, never interleaved
    np.testing.assert_array_equal(read(dest, "main"), read(source, "main"))


def test_a_standby_stops_on_sigterm_too(
    source: Path, tmp_path: Path, promoters: Callable[..., Promoter]
) -> None:
    locks = tmp_path / "locks"
    argv = (source, tmp_path / "mirror", "--interval", "5", "--lock", locks)
    a = promoters(*argv)
    a.wait_for(lambda d: d["up_to_date"])
    b = promoters(*argv)
    wait_until_asking_for_the_lock(b, locks)
    started = time.monotonic()
    code, err = b.stop()
    assert (code, err) == (0, "")
    assert time.monotonic() - started < 30  # not after the lock's whole default wait (120 s)
    assert b.count == 0 and b.passes.empty()
    assert a.stop() == (0, "")
