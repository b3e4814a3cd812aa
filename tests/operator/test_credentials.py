"""Credentials per role through the provider's IAM API (issue 42): the operator's
:mod:`zarrlake_operator.credentials` against SeaweedFS, whose S3 gateway serves IAM and enforces
the policies it is given. A writer's key writes the immutable objects only; a reader's writes
nothing; keys are kept, replaced and removed as the Secrets holding them say.

The operator's use of it (Secrets, status, cleanup) is in
``tests/operator/test_commit_service_operator.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import zarr
from botocore.exceptions import ClientError

import zarrlake
from zarrlake.k8s import Connection
from zarrlake_operator import credentials
from zarrlake_testkit.servers import start_seaweedfs

BUCKET, PREFIX = "lake", "repos/climate"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), iam_writable=True)
    try:
        _s3(server.endpoint, "testing", "testing").create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


def _s3(endpoint: str, key: str, secret: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )


def _conn(endpoint: str) -> Connection:
    return Connection(
        bucket=BUCKET,
        prefix=PREFIX,
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        session_token=None,
        lock_url=None,
        lock_password=None,
    )


def _can_put(s3: Any, key: str) -> bool:
    try:
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"x")
        return True
    except ClientError as e:
        assert e.response["Error"]["Code"] == "AccessDenied", e.response
        return False


def _can_delete(s3: Any, key: str) -> bool:
    try:
        s3.delete_object(Bucket=BUCKET, Key=key)
        return True
    except ClientError as e:
        assert e.response["Error"]["Code"] == "AccessDenied", e.response
        return False


def _works(endpoint: str, keys: credentials.Keys) -> bool:
    try:
        _s3(endpoint, keys.access_key_id, keys.secret_access_key).head_bucket(Bucket=BUCKET)
        return True
    except ClientError:
        return False


def test_user_names_are_iam_names_and_one_per_resource() -> None:
    a = credentials.user_name("science", "climate", "uid-1", "writer")
    assert a.startswith("zl-science-climate-") and a.endswith("-writer")
    assert a != credentials.user_name("science", "climate", "uid-2", "writer")
    long = credentials.user_name("n" * 63, "r" * 63, "uid", "reader")
    assert len(long) <= credentials.USER_NAME_MAX and long.endswith("-reader")


def test_policies_say_what_each_role_may_do() -> None:
    writer = credentials.policy("writer", BUCKET, PREFIX, aws=True)
    (read, listing, write) = writer["Statement"]
    assert read["Resource"] == [f"arn:aws:s3:::{BUCKET}/{PREFIX}/*"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": [f"{PREFIX}/*"]}}
    assert f"arn:aws:s3:::{BUCKET}/{PREFIX}/chunks/*" in write["Resource"]
    assert not any("refs" in r or r.endswith("/root") for r in write["Resource"])
    assert write["Condition"] == {"Null": {"s3:if-none-match": "false"}}  # create-only on AWS
    reader = credentials.policy("reader", BUCKET, PREFIX, aws=False)
    assert [s["Action"] for s in reader["Statement"]] == [["s3:GetObject"], ["s3:ListBucket"]]
    with pytest.raises(ValueError):
        credentials.policy("admin", BUCKET, PREFIX, aws=False)


def test_a_writer_writes_only_immutable_objects_and_a_reader_nothing(
    seaweed: Any, tmp_path: Path
) -> None:
    admin = zarrlake.Storage.s3(BUCKET, PREFIX, endpoint_url=seaweed.endpoint, region="us-east-1",
                                access_key_id="testing", secret_access_key="testing",
                                allow_http=True)  # fmt: skip
    repo = zarrlake.Repository.create(admin)
    session = repo.writable_session("main")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")[:] = 7
    head = session.commit("seed")
    iam = credentials.iam_client(_conn(seaweed.endpoint), None)
    made = {}
    for role in credentials.ROLES:
        user = credentials.user_name("science", "climate", "uid-1", role)
        document = credentials.policy(role, BUCKET, PREFIX, aws=False)
        keys = credentials.ensure_user(iam, user, document, None)
        assert keys is not None
        made[role] = keys
    writer = _s3(seaweed.endpoint, made["writer"].access_key_id, made["writer"].secret_access_key)
    reader = _s3(seaweed.endpoint, made["reader"].access_key_id, made["reader"].secret_access_key)
    for kind in credentials.IMMUTABLE_KINDS:
        assert _can_put(writer, f"{PREFIX}/{kind}/probe"), kind
    for key in (f"{PREFIX}/root", f"{PREFIX}/repo", f"{PREFIX}/refs/branch.main/x", "elsewhere/x"):
        assert not _can_put(writer, key), key
    assert not _can_delete(writer, f"{PREFIX}/chunks/probe")
    assert not _can_put(reader, f"{PREFIX}/chunks/probe2")
    # Both read the repository, as zarrlake opens it.
    for role, keys in made.items():
        storage = zarrlake.Storage.s3(BUCKET, PREFIX, endpoint_url=seaweed.endpoint,
                                      region="us-east-1", access_key_id=keys.access_key_id,
                                      secret_access_key=keys.secret_access_key,
                                      allow_http=True)  # fmt: skip
        opened = zarrlake.Repository.open(storage)
        assert opened.lookup_branch("main") == head, role
        got = zarr.open_array(opened.readonly_session("main").store, path="t")[:]
        assert got.tolist() == [7, 7], role
    assert zarrlake.Repository.open(admin).lookup_branch("main") == head

    # The Secret still names the user's key: nothing new. It names another: a new key, and
    # the old one stops working.
    user = credentials.user_name("science", "climate", "uid-1", "writer")
    document = credentials.policy("writer", BUCKET, PREFIX, aws=False)
    assert credentials.ensure_user(iam, user, document, made["writer"].access_key_id) is None
    again = credentials.ensure_user(iam, user, document, "AKIA-NOT-THIS-USERS")
    assert again is not None and again.access_key_id != made["writer"].access_key_id
    assert _works(seaweed.endpoint, again)
    assert not _works(seaweed.endpoint, made["writer"])

    # Removed: the keys stop working; removing again finds nothing.
    for role in credentials.ROLES:
        assert credentials.remove_user(iam, credentials.user_name("science", "climate", "uid-1",
                                                                  role))  # fmt: skip
    assert not _works(seaweed.endpoint, again)
    assert not _works(seaweed.endpoint, made["reader"])
    assert not credentials.remove_user(iam, user)


def test_iam_that_refuses_is_a_clear_error(seaweed: Any) -> None:
    conn = _conn(seaweed.endpoint)
    bad = credentials.iam_client(
        Connection(**{**conn.__dict__, "secret_access_key": "wrong"}), None
    )
    with pytest.raises(credentials.ProvisionFailed, match=r"^IAM user zl-x: IAM refused "):
        credentials.ensure_user(bad, "zl-x", credentials.policy("reader", BUCKET, "", aws=False),
                                None)  # fmt: skip
    gone = credentials.iam_client(conn, "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(credentials.ProvisionFailed, match="IAM unreachable"):
        credentials.remove_user(gone, "zl-x")


def test_aws_is_told_by_its_endpoints() -> None:
    assert credentials.is_aws(None)
    assert credentials.is_aws("https://s3.eu-west-1.amazonaws.com")
    assert credentials.is_aws("https://iam.amazonaws.com")
    assert not credentials.is_aws("http://127.0.0.1:8333")
    assert not credentials.is_aws("https://minio.example.com")
    assert not credentials.is_aws("https://amazonaws.com.evil.example")
