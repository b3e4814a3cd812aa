"""What the ``zarrlake`` CLI and ``zarrlake.k8s`` do for Kubernetes: maintenance jobs configured by
environment (``ZARRLAKE_LOCK``, ``ZARRLAKE_LOCK_PASSWORD``, ``ZARRLAKE_REPORT_FILE``), inline
``--rules``, ``gc --rules`` (expire, then collect), and resolving a ``Repository`` resource with
its Secrets into storage and lock objects.

Real backends only: repositories in local directories, a real ``redis-server`` started with
``requirepass``, S3 on a real ``moto_server``. Secrets are plain dicts (``SecretReader``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis
import zarr

import zarrlake
from cli_helpers import CHUNK, Result, assert_one_line_error, commit_random
from zarrlake.k8s import Connection, connection_from_resource, with_password
from zarrlake_testkit.servers import start_redis, stop

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")

# Characters that must be quoted in a URL's userinfo, and a space.
PASSWORD = "p@ss:w/rd %#?&=+x"
ENV_VARS = ("ZARRLAKE_LOCK", "ZARRLAKE_LOCK_PASSWORD", "ZARRLAKE_REPORT_FILE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A directory repository with four commits of fresh chunks on main (five snapshots)."""
    path = tmp_path / "repo"
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    for i in range(4):
        commit_random(repo, i)
    return str(path)


def open_repo(url: str) -> zarrlake.Repository:
    return zarrlake.Repository.open(zarrlake.Storage.from_url(url))


def files(url: str) -> set[str]:
    root = Path(url)
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def lists_in(doc: Any) -> list[Any]:
    if isinstance(doc, list):
        return [doc]
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in lists_in(v)]
    return []


def read_report(path: Path) -> dict[str, Any]:
    text = path.read_text()
    assert len(text.encode()) < 4096
    assert "\n" not in text
    doc = json.loads(text)
    assert text == json.dumps(doc, separators=(",", ":"))  # compact
    assert lists_in(doc) == []  # counts only
    return doc


# -- gc --rules, inline rules, the report file ---------------------------------------------------


def test_gc_with_inline_rules_expires_then_collects(url: str, cli: Callable[..., Result]) -> None:
    repo = open_repo(url)
    history = [c.id for c in repo.log("main")]
    assert len(history) == 5
    r = cli("gc", url, "--rules", '{"default":{"last":1}}', "--grace", "0s", "--force", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["expire"]["expired_snapshots"] == 4
    assert sorted(doc["expire"]["expired"]) == sorted(history[1:])
    assert doc["expire"]["dry_run"] is False
    # The three overwritten commits' chunks (4 each) and the expired snapshots' objects are gone.
    assert doc["deleted_objects"] >= 12 and doc["deleted_bytes"] > 12 * 1024
    assert {"kept_objects", "kept_bytes", "by_kind", "marked_snapshots"} <= set(doc)
    # History now starts at the head, whose data still reads back.
    repo = open_repo(url)
    assert [c.id for c in repo.log("main")] == history[:1]
    arr = zarr.open_array(repo.readonly_session("main").store, path="a", mode="r")
    np.testing.assert_array_equal(arr[:], np.random.default_rng(3).random(4 * CHUNK))
    assert zarrlake.Repository.open(zarrlake.Storage.local(url)).fsck().ok


def test_gc_without_rules_does_not_expire(url: str, cli: Callable[..., Result]) -> None:
    r = cli("gc", url, "--grace", "0s", "--force", "--json")
    assert r.code == 0, r.err
    assert "expire" not in r.json()
    assert len(list(open_repo(url).log("main"))) == 5


def test_gc_rules_from_a_file_and_human_output(
    url: str, tmp_path: Path, cli: Callable[..., Result]
) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text('{"default": {"last": 2}}')
    r = cli("gc", url, "--rules", str(rules), "--grace", "0s", "--force")
    assert r.code == 0, r.err
    assert r.out.splitlines()[0].startswith("expired 3 snapshot(s)")
    assert "deleted" in r.out
    assert len(list(open_repo(url).log("main"))) == 2


def test_gc_dry_run_with_rules_changes_nothing(url: str, cli: Callable[..., Result]) -> None:
    before = files(url)
    r = cli(
        "gc", url, "--rules", '{"default":{"last":1}}', "--grace", "0s", "--force", "--dry-run",
        "--json",
    )  # fmt: skip
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["expire"]["expired_snapshots"] == 4 and doc["expire"]["dry_run"] is True
    assert doc["dry_run"] is True
    assert files(url) == before
    assert len(list(open_repo(url).log("main"))) == 5


@pytest.mark.parametrize(
    "rules",
    ['{"default":', "{not json}", '{"default": {"last": 1},}'],
)
@pytest.mark.parametrize("command", ["gc", "expire"])
def test_inline_rules_that_are_not_json_fail_in_one_line(
    url: str, cli: Callable[..., Result], rules: str, command: str
) -> None:
    before = files(url)
    extra = ["--grace", "0s", "--force"] if command == "gc" else []
    message = assert_one_line_error(cli(command, url, "--rules", rules, *extra), 2)
    assert "inline --rules is not valid JSON" in message
    assert files(url) == before


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        ('{"default":{"last":0}}', "last must be a whole number >= 1"),
        ('{"default":{"keep":1}}', "unknown field"),
        ('{"default":{"days":-1}}', "days must be a number >= 0"),
        ('{"branches":["main"]}', "branches"),
    ],
)
def test_inline_rules_that_make_no_sense_fail_in_one_line(
    url: str, cli: Callable[..., Result], rules: str, expected: str
) -> None:
    before = files(url)
    message = assert_one_line_error(cli("gc", url, "--rules", rules, "--grace", "0s", "--force"), 2)
    assert expected in message
    assert files(url) == before


def test_report_file_for_gc(
    url: str, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "termination-log"
    monkeypatch.setenv("ZARRLAKE_REPORT_FILE", str(report))
    r = cli("gc", url, "--rules", '{"default":{"last":1}}', "--grace", "0s", "--force", "--json")
    assert r.code == 0, r.err
    doc = read_report(report)
    full = r.json()
    assert doc["deleted_objects"] == full["deleted_objects"] > 0
    assert doc["deleted_bytes"] == full["deleted_bytes"] > 0
    assert doc["expire"]["expired_snapshots"] == 4
    assert "expired" not in doc["expire"]  # the id list stays out of the termination message
    assert doc["by_kind"] == full["by_kind"]


def test_report_file_is_written_without_json_too(
    url: str, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "termination-log"
    monkeypatch.setenv("ZARRLAKE_REPORT_FILE", str(report))
    r = cli("gc", url, "--grace", "0s", "--force")
    assert r.code == 0, r.err
    assert "expire" not in read_report(report)
    r = cli("expire", url, "--rules", '{"default":{"last":2}}')
    assert r.code == 0, r.err
    assert read_report(report)["expired_snapshots"] == 3


def test_report_file_for_expire_stays_small_for_long_histories(
    tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "repo"
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    for i in range(200):
        session = repo.writable_session("main")
        zarr.open_group(session.store, mode="a").attrs["i"] = i
        session.commit(f"c{i}")
    report = tmp_path / "termination-log"
    monkeypatch.setenv("ZARRLAKE_REPORT_FILE", str(report))
    r = cli("expire", str(path), "--rules", '{"default":{"last":1}}', "--json")
    assert r.code == 0, r.err
    assert len(r.json()["expired"]) == 200
    assert len(r.out) > 4096  # stdout has every id; the report file cannot
    doc = read_report(report)
    assert doc["expired_snapshots"] == 200
    assert doc["retained_snapshots"] == 1


def test_report_file_for_compact(
    url: str, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "termination-log"
    monkeypatch.setenv("ZARRLAKE_REPORT_FILE", str(report))
    r = cli("compact", url, "--json")
    assert r.code == 0, r.err
    doc = read_report(report)
    assert doc["packed_chunks"] == r.json()["packed_chunks"] == 4
    assert doc["branch"] == "main"
    assert doc["snapshot"] == open_repo(url).lookup_branch("main")


def test_unwritable_report_file_warns_on_stderr_and_keeps_stdout_json(
    url: str, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZARRLAKE_REPORT_FILE", str(tmp_path / "no" / "such" / "dir" / "log"))
    for argv in (
        ("gc", url, "--grace", "0s", "--force", "--json"),
        ("compact", url, "--json"),
    ):
        r = cli(*argv)
        assert r.code == 0, r.err
        r.json()  # stdout is still exactly one JSON document
        assert "cannot write report" in r.err


# -- the lock from the environment, with a password ---------------------------------------------


@dataclass
class PasswordRedis:
    port: int
    password: str
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, decode_responses=True)

    def tokens(self, repo_id: str) -> int:
        """How many fencing tokens this repository's locks have handed out."""
        return int(self.client().get(f"zarrlake:{{{repo_id}}}:fence") or 0)


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[PasswordRedis]:
    try:
        proc, url = start_redis(tmp_path, None, "--requirepass", PASSWORD)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        server = PasswordRedis(urlsplit(url).port or 0, PASSWORD, proc)
        assert server.client().ping()
        yield server
    finally:
        stop(proc)


def lock_env(monkeypatch: pytest.MonkeyPatch, url: str, password: str | None) -> None:
    monkeypatch.setenv("ZARRLAKE_LOCK", url)
    if password is not None:
        monkeypatch.setenv("ZARRLAKE_LOCK_PASSWORD", password)


def assert_no_password(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text
        assert "p%40ss" not in text  # nor its quoted form
        assert "p@ss" not in text


def test_lock_from_env_with_password_is_used_by_ref_moving_commands(
    url: str,
    password_redis: PasswordRedis,
    cli: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo_id = open_repo(url).id
    first = [c.id for c in open_repo(url).log("main")][-1]
    lock_env(monkeypatch, password_redis.url, PASSWORD)
    with caplog.at_level(logging.WARNING):
        r = cli("branch", url, "create", "dev")
        assert r.code == 0, r.err
        assert password_redis.tokens(repo_id) == 0  # creating a branch takes no lock
        r = cli("branch", url, "reset", "dev", first)
        assert r.code == 0, r.err
        assert password_redis.tokens(repo_id) == 1
        r = cli("branch", url, "delete", "dev")
        assert r.code == 0, r.err
        assert password_redis.tokens(repo_id) == 2
        r = cli("gc", url, "--rules", '{"default":{"last":1}}', "--grace", "0s", "--force")
        assert r.code == 0, r.err
        assert password_redis.tokens(repo_id) >= 3  # expire locks every branch it rewrites
        assert_no_password(r.out, r.err)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    # Read-only commands ignore the lock.
    r = cli("branch", url, "list", "--json")
    assert r.code == 0 and list(r.json()) == ["main"]


def test_lock_password_in_the_url_works_without_the_env_password(
    url: str, password_redis: PasswordRedis, cli: Callable[..., Result]
) -> None:
    repo_id = open_repo(url).id
    head = open_repo(url).lookup_branch("main")
    lock_url = with_password(password_redis.url, PASSWORD)
    assert cli("branch", url, "create", "dev").code == 0
    r = cli("branch", url, "reset", "dev", head, "--lock", lock_url)
    assert r.code == 0, r.err
    assert password_redis.tokens(repo_id) == 1
    assert_no_password(r.out, r.err)


def test_lock_option_wins_over_the_env(
    url: str,
    password_redis: PasswordRedis,
    cli: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo_id = open_repo(url).id
    head = open_repo(url).lookup_branch("main")
    # The env points at nothing; --lock at the real service (password still from the env).
    lock_env(monkeypatch, "redis://127.0.0.1:1/0", PASSWORD)
    assert cli("branch", url, "create", "dev").code == 0
    r = cli("branch", url, "reset", "dev", head, "--lock", password_redis.url)
    assert r.code == 0, r.err
    assert password_redis.tokens(repo_id) == 1


def run_zarrlake(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_VARS} | env
    return subprocess.run(
        [sys.executable, "-m", "zarrlake", *argv],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("password", ["wrong-password", None])
def test_wrong_or_missing_lock_password_falls_back_to_optimistic(
    url: str, password_redis: PasswordRedis, password: str | None
) -> None:
    """The CLI's RedisLock uses the default ``on_unavailable="optimistic"``; an authentication
    failure is a ``redis.ConnectionError``, so the command proceeds without the lock (always
    safe, see zarrlake.locks) and says so on stderr, without any password."""
    repo = open_repo(url)
    head = repo.lookup_branch("main")
    repo.create_branch("dev")
    env = {"ZARRLAKE_LOCK": password_redis.url}
    if password is not None:
        env["ZARRLAKE_LOCK_PASSWORD"] = password
    p = run_zarrlake("branch", url, "reset", "dev", head, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("reset branch dev to ")
    assert "committing optimistically" in p.stderr
    if password:
        assert "invalid username-password" in p.stderr
    assert_no_password(p.stdout, p.stderr)
    if password:
        assert password not in p.stderr
    assert password_redis.tokens(repo.id) == 0  # the lock was never taken


def test_lock_service_that_must_be_available_fails_without_leaking_the_password(
    url: str, password_redis: PasswordRedis
) -> None:
    """``onUnavailable: fail`` (through zarrlake.k8s): a wrong password is LockUnavailable, and
    neither the message nor the lock's repr holds the password."""
    conn = connection(
        lock_url=password_redis.url, lock_password="wrong-" + PASSWORD, on_unavailable="fail"
    )
    lock = conn.lock()
    repo = zarrlake.Repository.open(zarrlake.Storage.local(url), lock=lock)
    repo.create_branch("dev")  # creating takes no lock
    with pytest.raises(zarrlake.LockUnavailable) as e:
        repo.reset_branch("dev", repo.lookup_branch("main"))
    assert "invalid username-password" in str(e.value)
    assert_no_password(str(e.value), repr(lock))
    assert "wrong-" not in str(e.value)
    # The right password through the same path takes the lock.
    good = connection(lock_url=password_redis.url, lock_password=PASSWORD, on_unavailable="fail")
    repo = zarrlake.Repository.open(zarrlake.Storage.local(url), lock=good.lock())
    repo.reset_branch("dev", repo.lookup_branch("main"))
    assert password_redis.tokens(repo.id) == 1
    with good.lock().hold(repo.id, "main") as token:
        assert isinstance(token, int) and token == 2
    assert_no_password(repr(good.lock()))


def test_lock_url_override_keeps_the_secret_password(password_redis: PasswordRedis) -> None:
    """``lock(lock_url)`` swaps the address (a port-forward) and keeps the password."""
    conn = connection(lock_url="redis://zl-climate-lock.science.svc:6379/0", lock_password=PASSWORD)
    lock = conn.lock(password_redis.url)
    with lock.hold("repo-id", "main") as token:
        assert token == 1
    assert conn.lock().on_unavailable == "optimistic"


def test_bad_lock_url_error_redacts_the_password(url: str, cli: Callable[..., Result]) -> None:
    head = open_repo(url).lookup_branch("main")
    open_repo(url).create_branch("dev")
    quoted = urlsplit(with_password("redis://host:6379/0", PASSWORD)).password
    for lock in (f"http://user:{quoted}@host:6379/0", "ftp://:p%40ss@host/0"):
        message = assert_one_line_error(cli("branch", url, "reset", "dev", head, "--lock", lock), 2)
        assert "bad --lock URL" in message and "***" in message
        assert_no_password(message)
    message = assert_one_line_error(cli("--lock", "http://u:TOPSECRET@h/0", "branch", url,
                                        "delete", "dev"), 2)  # fmt: skip
    assert "TOPSECRET" not in message and "http://u:***@h/0" in message


def test_redact() -> None:
    from zarrlake.cli.connect import redact_password as _redact

    assert _redact("redis://h:6379/0") == "redis://h:6379/0"
    assert _redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert _redact("rediss://user:pw@h:6380/1") == "rediss://user:***@h:6380/1"
    assert _redact(with_password("redis://h/0", PASSWORD)) == "redis://:***@h/0"


# -- zarrlake.k8s ----------------------------------------------------------------------------------


def connection(**fields: Any) -> Connection:
    base: dict[str, Any] = {
        "bucket": "b",
        "prefix": "",
        "endpoint_url": None,
        "region": None,
        "access_key_id": None,
        "secret_access_key": None,
        "session_token": None,
        "lock_url": None,
        "lock_password": None,
    }
    return Connection(**(base | fields))


S3_SECRET = {
    "AWS_ACCESS_KEY_ID": "AKIA-THE-ACCESS-KEY",
    "AWS_SECRET_ACCESS_KEY": "the/secret+access=key",
    "TOKEN": "the-session-token",
}
LOCK_SECRET = {"password": PASSWORD}


def secrets(**by_name: dict[str, str]) -> Callable[[str], dict[str, str] | None]:
    return by_name.get


READY = {"type": "Ready", "status": "True", "reason": "Ready", "message": "ready"}


def resource(
    spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": "climate", "namespace": "science"},
        "spec": spec
        or {
            "storage": {
                "bucket": "zarrlake-climate",
                "prefix": "repos/climate",
                "region": "eu-west-1",
                "endpointURL": "http://minio.storage.svc:9000",
                "credentialsSecret": {"name": "climate-s3"},
            },
            "lockService": {"mode": "managed"},
        },
        "status": status
        if status is not None
        else {
            "conditions": [READY],
            "lockEndpoint": "redis://zl-climate-lock.science.svc:6379/0",
            "lockSecret": "zl-climate-lock",
        },
    }


def secret_values() -> list[str]:
    return [*S3_SECRET.values(), PASSWORD]


def test_connection_from_a_ready_managed_repository() -> None:
    conn = connection_from_resource(
        resource(), secrets(**{"climate-s3": S3_SECRET, "zl-climate-lock": LOCK_SECRET})
    )
    assert conn.bucket == "zarrlake-climate" and conn.prefix == "repos/climate"
    assert conn.region == "eu-west-1" and conn.endpoint_url == "http://minio.storage.svc:9000"
    assert conn.access_key_id == "AKIA-THE-ACCESS-KEY"
    assert conn.secret_access_key == "the/secret+access=key"
    assert conn.session_token is None
    assert conn.lock_url == "redis://zl-climate-lock.science.svc:6379/0"
    assert conn.lock_password == PASSWORD
    assert conn.on_unavailable == "optimistic"
    # The loggable URL has no credentials but everything needed to find the data.
    storage_url = conn.storage_url
    for value in secret_values():
        assert value not in storage_url
    assert "@" not in storage_url
    parts = urlsplit(storage_url)
    assert (parts.scheme, parts.netloc, parts.path) == ("s3", "zarrlake-climate", "/repos/climate")
    assert "region=eu-west-1" in parts.query and "endpoint_url=" in parts.query
    # The storage object gets the credentials; its URL still does not show them.
    storage = conn.storage()
    assert storage.url.startswith("s3://zarrlake-climate/repos/climate")
    for value in secret_values():
        assert value not in storage.url and value not in repr(storage)
    lock = conn.lock()
    assert lock is not None and lock.on_unavailable == "optimistic"
    for value in secret_values():
        assert value not in repr(lock)


def test_connection_storage_url_shapes() -> None:
    assert connection(bucket="b").storage_url == "s3://b"
    assert connection(bucket="b", prefix="p/q").storage_url == "s3://b/p/q"
    assert connection(bucket="b", region="us-east-1").storage_url == "s3://b?region=us-east-1"
    url = connection(bucket="b", endpoint_url="http://m:9000/x?y=1").storage_url
    parsed = zarrlake.Storage.from_url(url)
    assert parsed.url.startswith("s3://b")
    assert "endpoint_url=http%3A%2F%2Fm%3A9000%2Fx%3Fy%3D1" in url


def test_connection_session_token_is_optional() -> None:
    spec = resource()["spec"]
    spec["storage"]["credentialsSecret"]["sessionTokenKey"] = "TOKEN"
    read = secrets(**{"climate-s3": S3_SECRET, "zl-climate-lock": LOCK_SECRET})
    assert connection_from_resource(resource(spec), read).session_token == "the-session-token"
    no_token = {k: v for k, v in S3_SECRET.items() if k != "TOKEN"}
    read = secrets(**{"climate-s3": no_token, "zl-climate-lock": LOCK_SECRET})
    assert connection_from_resource(resource(spec), read).session_token is None


def test_connection_custom_secret_keys() -> None:
    spec = resource()["spec"]
    spec["storage"]["credentialsSecret"] = {
        "name": "minio",
        "accessKeyIDKey": "user",
        "secretAccessKeyKey": "pass",
    }
    read = secrets(minio={"user": "u", "pass": "p"}, **{"zl-climate-lock": LOCK_SECRET})
    conn = connection_from_resource(resource(spec), read)
    assert (conn.access_key_id, conn.secret_access_key) == ("u", "p")


def test_connection_without_credentials_uses_the_ambient_identity() -> None:
    spec = {"storage": {"bucket": "zarrlake-climate"}, "lockService": {"mode": "none"}}
    conn = connection_from_resource(resource(spec, {"conditions": [READY]}), secrets())
    assert conn.access_key_id is conn.secret_access_key is None
    assert conn.lock_url is None and conn.lock() is None
    assert conn.prefix == "" and conn.storage_url == "s3://zarrlake-climate"


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ({}, "no status yet"),
        ({"conditions": []}, "no status yet"),
        (
            {"conditions": [{"type": "Ready", "status": "False", "message": "bucket missing"}]},
            "bucket missing",
        ),
        ({"conditions": [{"type": "BucketReady", "status": "True"}]}, "no status yet"),
    ],
)
def test_connection_refuses_a_repository_that_is_not_ready(
    status: dict[str, Any], why: str
) -> None:
    read = secrets(**{"climate-s3": S3_SECRET, "zl-climate-lock": LOCK_SECRET})
    with pytest.raises(zarrlake.KubernetesError) as e:
        connection_from_resource(resource(status=status), read)
    assert "'climate' is not ready" in str(e.value) and why in str(e.value)
    assert isinstance(e.value, zarrlake.ZarrlakeError)


def test_connection_not_ready_is_fine_for_the_operator() -> None:
    read = secrets(**{"climate-s3": S3_SECRET})
    conn = connection_from_resource(resource(status={}), read, require_ready=False)
    assert conn.lock_url is None and conn.lock_password is None
    assert conn.access_key_id == "AKIA-THE-ACCESS-KEY"


def test_connection_ready_managed_without_endpoint_is_an_error() -> None:
    status = {"conditions": [READY]}
    with pytest.raises(zarrlake.KubernetesError, match="no lock endpoint"):
        connection_from_resource(resource(status=status), secrets(**{"climate-s3": S3_SECRET}))


def test_connection_without_a_bucket_is_an_error() -> None:
    with pytest.raises(zarrlake.KubernetesError, match=r"spec\.storage\.bucket"):
        connection_from_resource(resource({"storage": {}}), secrets())


@pytest.mark.parametrize(
    ("storage", "field"),
    [
        ({"bucket": "zarrlake-climate", "prefix": "/repos/climate/"}, "spec.storage.prefix"),
        ({"bucket": "Not_A_Bucket"}, "spec.storage.bucket"),
        ({"bucket": "zarrlake-climate", "credentialsSecret": {}}, "spec.storage.credentialsSecret"),
    ],
)
def test_connection_reads_the_resource_through_its_crd_model(
    storage: dict[str, Any], field: str
) -> None:
    """What the API server would refuse (the CRD comes from the same model) is a typed error
    naming the field, not a guess at what was meant."""
    spec = {"storage": storage, "lockService": {"mode": "none"}}
    with pytest.raises(zarrlake.KubernetesError, match="does not match its CRD") as e:
        connection_from_resource(resource(spec, {"conditions": [READY]}), secrets())
    assert field in str(e.value) and "'climate'" in str(e.value)
    assert "Not_A_Bucket" not in str(e.value)  # where and what, not the value


def test_missing_secrets_and_keys_are_named_not_shown() -> None:
    # The credentials Secret is missing.
    with pytest.raises(zarrlake.KubernetesError) as e:
        connection_from_resource(resource(), secrets(**{"zl-climate-lock": LOCK_SECRET}))
    assert "'climate-s3'" in str(e.value) and "not found" in str(e.value)
    # The lock Secret is missing.
    with pytest.raises(zarrlake.KubernetesError) as e:
        connection_from_resource(resource(), secrets(**{"climate-s3": S3_SECRET}))
    assert "'zl-climate-lock'" in str(e.value)
    for value in secret_values():
        assert value not in str(e.value)
    # A key is missing: Secret and key named, the other values not shown.
    partial = {"AWS_ACCESS_KEY_ID": S3_SECRET["AWS_ACCESS_KEY_ID"]}
    with pytest.raises(zarrlake.KubernetesError) as e:
        connection_from_resource(
            resource(), secrets(**{"climate-s3": partial, "zl-climate-lock": LOCK_SECRET})
        )
    assert "'climate-s3'" in str(e.value) and "'AWS_SECRET_ACCESS_KEY'" in str(e.value)
    for value in secret_values():
        assert value not in str(e.value)
    # The lock Secret without its key.
    with pytest.raises(zarrlake.KubernetesError) as e:
        connection_from_resource(
            resource(), secrets(**{"climate-s3": S3_SECRET, "zl-climate-lock": {"pw": "x"}})
        )
    assert "'zl-climate-lock'" in str(e.value) and "'password'" in str(e.value)


def test_connection_external_lock() -> None:
    spec = {
        "storage": {"bucket": "zarrlake-climate"},
        "lockService": {
            "mode": "external",
            "url": "rediss://redis.shared.svc:6380/2",
            "passwordSecret": {"name": "shared-redis", "key": "redis-password"},
            "onUnavailable": "fail",
        },
    }
    # External mode needs no lock endpoint in the status.
    status = {"conditions": [READY]}
    read = secrets(**{"shared-redis": {"redis-password": PASSWORD}})
    conn = connection_from_resource(resource(spec, status), read)
    assert conn.lock_url == "rediss://redis.shared.svc:6380/2"
    assert conn.lock_password == PASSWORD
    assert conn.on_unavailable == "fail"
    lock = conn.lock()
    assert lock.on_unavailable == "fail"
    assert urlsplit(lock.url).password is not None
    assert_no_password(repr(lock))
    with pytest.raises(zarrlake.KubernetesError, match="'shared-redis'"):
        connection_from_resource(resource(spec, status), secrets())
    # Without a password Secret: no password.
    del spec["lockService"]["passwordSecret"]
    conn = connection_from_resource(resource(spec, status), secrets())
    assert conn.lock_password is None and conn.lock().url == "rediss://redis.shared.svc:6380/2"


def test_with_password_quotes_and_replaces() -> None:
    url = with_password("redis://h.svc:6379/0", PASSWORD)
    parts = urlsplit(url)
    assert parts.hostname == "h.svc" and parts.port == 6379 and parts.path == "/0"
    assert parts.username == ""
    assert parts.password != PASSWORD and "@" not in parts.password  # quoted ...
    from urllib.parse import unquote

    assert unquote(parts.password) == PASSWORD  # ... and redis-py unquotes it
    assert redis.connection.parse_url(url)["password"] == PASSWORD
    # An existing userinfo is replaced, not nested.
    again = with_password("redis://:old@h.svc:6379/0", "new")
    assert again == "redis://:new@h.svc:6379/0"
    assert with_password("rediss://h:6380/1", "x y") == "rediss://:x%20y@h:6380/1"
    assert with_password("redis://h:6379/0", None) == "redis://h:6379/0"
    assert with_password("redis://h:6379/0", "") == "redis://h:6379/0"


def test_connection_opens_a_real_repository_on_s3(moto_s3: Any, cli: Callable[..., Result]) -> None:
    """The resolved credentials and location reach S3; storage_url opens the same repository."""
    prefix = f"k8s-{dt.datetime.now(dt.UTC):%H%M%S%f}"
    spec = {
        "storage": {
            "bucket": moto_s3.bucket,
            "prefix": prefix,
            "region": "us-east-1",
            "endpointURL": moto_s3.endpoint,
            "credentialsSecret": {"name": "s3"},
        },
        "lockService": {"mode": "none"},
    }
    read = secrets(s3={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    conn = connection_from_resource(resource(spec, {"conditions": [READY]}), read)
    repo = zarrlake.Repository.create(conn.storage(), lock=conn.lock())
    commit_random(repo, 0)
    r = cli("log", conn.storage_url, "--json")  # the ambient (test) credentials
    assert r.code == 0, r.err
    assert [e["message"] for e in r.json()] == ["commit 0", "Repository initialized"]
    again = zarrlake.Repository.open(connection_from_resource(
        resource(spec, {"conditions": [READY]}), read
    ).storage())  # fmt: skip
    assert again.id == repo.id


def test_from_kubernetes_with_no_api_server_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}  # nobody listens
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    with pytest.raises(zarrlake.KubernetesError, match="unreachable"):
        zarrlake.Repository.from_kubernetes("climate", "default")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(zarrlake.KubernetesError, match="kubeconfig"):
        zarrlake.Repository.from_kubernetes("climate", "default")
