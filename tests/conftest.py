"""Shared fixtures: real backends only.

- ``moto_s3``: a real S3 API over HTTP (``moto_server``) on a free loopback port, started once per
  test session and stopped by process id.
- ``storage``: a fresh, empty storage of each kind (memory, local directory, S3 prefix).
- ``repo``: a fresh repository on each kind of storage.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import zarrlake
from backends import STORAGE_KINDS, make_storage
from cli_helpers import Result
from zarrlake.cli import main as cli_main
from zarrlake_testkit.servers import start_moto, start_redis, stop

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


# -- markers and parallel groups ----------------------------------------------------------------

# Tests whose cost is a process of their own (a server they start and stop, a subprocess CLI run,
# a long hypothesis search): marked ``slow`` by name so `make test-fast` leaves them out.
SLOW_MODULES = {"test_e2e", "test_peering", "test_operator", "test_chart", "test_stateful"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by where it lives; keep the tests sharing a heavy process on one worker.

    Under pytest-xdist (``--dist loadgroup``) every worker starts its own session fixtures, so the
    Spark tests (one JVM) and the operator tests (one API server + one operator process) each go
    to a single worker instead of starting those processes on every worker.
    """
    for item in items:
        path = Path(str(item.fspath))
        module = path.stem
        if "operator" in path.parts:
            item.add_marker(pytest.mark.operator)
        if module == "test_e2e":
            item.add_marker(pytest.mark.e2e)
        if module in SLOW_MODULES or item.get_closest_marker("spark"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("spark") or module == "test_e2e":
            item.add_marker(pytest.mark.xdist_group("spark"))
        elif "k8s" in getattr(item, "fixturenames", ()) or "operator_cluster" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.xdist_group("operator"))


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
        stop(proc)


@pytest.fixture(params=STORAGE_KINDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> zarrlake.Storage:
    return make_storage(request.param, tmp_path, request)


@pytest.fixture
def repo(storage: zarrlake.Storage) -> zarrlake.Repository:
    return zarrlake.Repository.create(storage)


# -- Redis ---------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A real redis-server on a loopback port, started and stopped by process id.

    The first start picks a free port (another on a lost race); restarts keep it, as a restarted
    server keeps its address.
    """

    workdir: Path
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc, url = start_redis(self.workdir, self.port or None)
        self.port = int(url.rsplit(":", 1)[1].split("/", 1)[0])

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server a test may stop and restart."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run ``zarrlake ARGS...`` in-process and capture what it printed."""

    def run(*argv: str) -> Result:
        capsys.readouterr()
        code = cli_main(list(argv))
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run
