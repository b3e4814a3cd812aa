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
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
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
