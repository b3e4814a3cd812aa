"""S3 access modes against the real moto server: anonymous (unsigned) reads of a public bucket,
and path-style vs virtual-host addressing.

moto refuses an unsigned GET or HEAD of an existing object unless the bucket's policy (or the
object's ACL) lets everyone read it, so a refusal before the policy and success after it shows
that the requests really go unsigned. moto derives the action of a HEAD as ``s3:HeadObject``
(AWS checks ``s3:GetObject``): the policy below grants both.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import zarr

import zarrlake
from zarrlake.storage import ObjectNotFound, PreconditionFailed, Storage, StorageError
from zarrlake.storage.s3 import S3Storage

PUBLIC_READ = ["s3:GetObject", "s3:HeadObject", "s3:ListBucket"]


def public_policy(bucket: str) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": "*",
                    "Action": PUBLIC_READ,
                    "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
                }
            ],
        }
    )


#: The moto_s3 fixture's server (tests/conftest.py; not imported: under xdist another
#: conftest module may hold that name).
MotoS3 = Any


@pytest.fixture
def bucket(moto_s3: MotoS3) -> str:
    name = f"public-{uuid.uuid4().hex[:10]}"
    client(moto_s3).create_bucket(Bucket=name)
    return name


def client(moto_s3: MotoS3) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=moto_s3.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def signed(moto_s3: MotoS3, bucket: str, **kw: Any) -> Storage:
    return Storage.s3(
        bucket,
        "repo",
        endpoint_url=moto_s3.endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        allow_http=True,
        **kw,
    )


def test_anonymous_reads_of_a_public_bucket(moto_s3: MotoS3, bucket: str) -> None:
    repo = zarrlake.Repository.create(signed(moto_s3, bucket))
    with repo.transaction("main", message="public data") as store:
        zarr.create_array(store, name="a", shape=(8,), chunks=(4,), dtype="f8")[:] = 2.5
    repo.create_tag("v1", "main")
    url = f"s3://{bucket}/repo?endpoint_url={moto_s3.endpoint}&region=us-east-1&anonymous=true"
    anon = Storage.from_url(url)
    assert isinstance(anon, S3Storage) and anon.anonymous
    assert Storage.from_url(anon.url).url == anon.url and "anonymous=true" in anon.url

    # Private until the policy says otherwise: an unsigned read is refused, and says why.
    with pytest.raises(StorageError, match="anonymous request") as info:
        anon.get("repo")
    assert not isinstance(info.value, ObjectNotFound)

    client(moto_s3).put_bucket_policy(Bucket=bucket, Policy=public_policy(bucket))
    public = zarrlake.Repository.open(anon)
    assert public.id == repo.id
    assert public.list_branches() == repo.list_branches()
    assert public.list_tags() == {"v1": repo.lookup_tag("v1")}
    assert [c.message for c in public.log()] == [c.message for c in repo.log()]
    a = zarr.open_array(public.readonly_session("v1").store, path="a", mode="r")
    assert list(a[:]) == [2.5] * 8
    assert anon.head("repo") is not None and anon.get("repo", (0, 4)) == b"ZLAK"
    with pytest.raises(ObjectNotFound):
        anon.get("no/such/key")
    # Writing is the bucket's call; this one lets nobody overwrite its objects anonymously.
    with pytest.raises(StorageError, match="anonymous request"):
        anon.put("repo", b"defaced")
    assert zarrlake.Repository.open(signed(moto_s3, bucket)).id == repo.id


def test_anonymous_takes_no_credentials() -> None:
    with pytest.raises(StorageError, match="no credentials"):
        Storage.s3("b", anonymous=True, access_key_id="k", secret_access_key="s")


def test_anonymous_storage_pickles_unsigned(moto_s3: MotoS3, bucket: str) -> None:
    import pickle

    signed(moto_s3, bucket).put("k", b"v")
    client(moto_s3).put_bucket_policy(Bucket=bucket, Policy=public_policy(bucket))
    anon = Storage.s3(
        bucket, "repo", endpoint_url=moto_s3.endpoint, allow_http=True, anonymous=True
    )
    copy = pickle.loads(pickle.dumps(anon))
    assert copy.get("k") == b"v" and copy.list_keys() == ["k"]


# -- addressing styles -----------------------------------------------------------------------------


@pytest.fixture
def subdomains_resolve(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Name resolution for ``<bucket>.localhost`` (the machine resolves no subdomains): the
    requests still go over real sockets to the real server, with the bucket in the Host header."""
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".localhost"):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    yield


def test_virtual_host_addressing(moto_s3: MotoS3, bucket: str, subdomains_resolve: None) -> None:
    port = moto_s3.endpoint.rsplit(":", 1)[1]
    virtual = Storage.s3(
        bucket,
        "repo",
        endpoint_url=f"http://localhost:{port}",
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        allow_http=True,
        addressing_style="virtual",
    )
    assert isinstance(virtual, S3Storage)
    assert virtual._object_url("k") == f"http://{bucket}.localhost:{port}/repo/k"
    assert "addressing_style=virtual" in virtual.url
    assert Storage.from_url(virtual.url).url == virtual.url
    virtual.put("k", b"v", create_only=True)
    with pytest.raises(PreconditionFailed):
        virtual.put("k", b"w", create_only=True)
    assert virtual.get("k") == b"v" and virtual.get("k", (0, 1)) == b"v"
    assert virtual.list_keys() == ["k"]  # listing goes through botocore, virtual too
    path_style = signed(moto_s3, bucket, addressing_style="path")
    assert path_style.get("k") == b"v"  # the same object, addressed by path
    repo = zarrlake.Repository.create(
        Storage.s3(
            bucket,
            "repo2",
            endpoint_url=f"http://localhost:{port}",
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
            addressing_style="virtual",
        )
    )
    with repo.transaction("main", message="virtual") as store:
        zarr.create_array(store, name="a", shape=(2,), chunks=(2,), dtype="i1")[:] = 1
    url = f"s3://{bucket}/repo2?endpoint_url={moto_s3.endpoint}&addressing_style=path"
    by_path = zarrlake.Repository.open(Storage.from_url(url))
    assert by_path.id == repo.id
    assert list(zarr.open_array(by_path.readonly_session().store, path="a", mode="r")[:]) == [1, 1]
    virtual.delete_many(["k"])
    assert path_style.head("k") is None


def test_addressing_style_urls_for_aws_and_custom_endpoints() -> None:
    def object_url(storage: Storage) -> str:
        assert isinstance(storage, S3Storage)
        return storage._object_url("k")

    aws = {"region": "eu-west-1"}
    assert object_url(Storage.s3("b", "p", **aws)) == "https://b.s3.eu-west-1.amazonaws.com/p/k"
    assert (
        object_url(Storage.s3("b", "p", addressing_style="path", **aws))
        == "https://s3.eu-west-1.amazonaws.com/b/p/k"
    )
    assert object_url(Storage.s3("d.b", "p", **aws)) == "https://s3.eu-west-1.amazonaws.com/d.b/p/k"
    assert (
        object_url(Storage.s3("d.b", "p", addressing_style="virtual", **aws))
        == "https://d.b.s3.eu-west-1.amazonaws.com/p/k"
    )
    ep = {"endpoint_url": "https://minio.example:9000"}
    assert object_url(Storage.s3("b", "p", **ep)) == "https://minio.example:9000/b/p/k"
    assert (
        object_url(Storage.s3("b", "p", addressing_style="virtual", **ep))
        == "https://b.minio.example:9000/p/k"
    )
    parsed = Storage.from_url("s3://b/p?addressing_style=virtual&endpoint_url=https://e")
    assert isinstance(parsed, S3Storage) and parsed.addressing_style == "virtual"
    with pytest.raises(StorageError, match="addressing_style"):
        Storage.s3("b", addressing_style="dns")
    with pytest.raises(StorageError, match="addressing_style"):
        Storage.from_url("s3://b/p?addressing_style=sideways")


# -- the obstore hot path and fork -----------------------------------------------------------------


def _in_forked_child(storage: Storage) -> Any:
    """Put, get and head through ``storage`` in a child forked from this process (after this
    process used it): what the child got, or the text of what it raised."""
    import multiprocessing

    def child(queue: Any) -> None:
        try:
            storage.put("from-child", b"child bytes", create_only=True)
            info = storage.head("from-child")
            queue.put((storage.get("from-child"), info.size if info else None))
        except Exception as e:  # reported to the parent, which fails the test with it
            queue.put(repr(e))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    try:
        return queue.get(timeout=60)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_object_io_after_fork_takes_the_other_path(moto_s3: MotoS3, bucket: str) -> None:
    """Object reads and writes go through obstore, whose runtime does not survive fork: a child
    forked after the parent used it must still read and write (through urllib3), not hang or
    fail; the parent's client keeps working afterwards."""
    from zarrlake.storage import objstore

    storage = signed(moto_s3, bucket)
    storage.put("k", b"v", create_only=True)
    assert storage.get("k") == b"v"
    assert objstore.runtime_pid() == os.getpid()  # the hot path ran on obstore here
    with pytest.raises(PreconditionFailed):
        storage.put("k", b"again", create_only=True)  # If-None-Match kept on this path too
    assert _in_forked_child(storage) == (b"child bytes", len(b"child bytes"))
    assert storage.get("from-child") == b"child bytes"
    info = storage.head("k")
    assert info is not None and info.size == 1
    assert storage.head("absent") is None
    with pytest.raises(ObjectNotFound):
        storage.get("absent")


def test_the_urllib3_engine_can_be_chosen(
    moto_s3: MotoS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZARRLAKE_S3_ENGINE", "urllib3")
    storage = signed(moto_s3, bucket)
    storage.put("k", b"v", create_only=True)
    with pytest.raises(PreconditionFailed):
        storage.put("k", b"w", create_only=True)
    assert storage.get("k") == b"v" and storage.head("k") is not None


def test_a_used_storage_pickles_without_the_credentials_the_chain_resolved(
    moto_s3: MotoS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials travel in a pickle only if they were given explicitly: not those the AWS
    chain resolved, which obstore's store holds once the storage has been used."""
    import pickle

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "chain-secret-value")
    ambient = Storage.s3(bucket, "repo", endpoint_url=moto_s3.endpoint, allow_http=True)
    ambient.put("k", b"v")
    assert ambient.get("k") == b"v"
    data = pickle.dumps(ambient)
    assert b"chain-secret-value" not in data
    copy = pickle.loads(data)
    assert copy.get("k") == b"v"  # the copy resolves its own credentials
