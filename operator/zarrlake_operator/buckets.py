"""Buckets: check and provision them (locked down) through boto3 (S3; GCS buckets and Azure
containers are checked, never created), and delete a repository's objects through its
:class:`zarrlake.Storage`.

The storage engine itself never creates buckets; only the operator does, and only when a
Repository says ``provision: true``. Repository data is the engine's: it is listed and deleted
through the same storage the engine reads it with.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

from zarrlake.k8s import Connection


class BucketMissing(Exception):
    """The bucket does not exist and the Repository does not ask for it to be provisioned."""


class BucketUnreachable(Exception):
    """S3 could not be reached or refused us (transient or credentials): retried with backoff."""


class BucketProvisionFailed(BucketUnreachable):
    """The operator created the bucket but could not lock it down (public access block, default
    encryption, lifecycle); the bucket was removed again, so the next attempt starts over rather
    than find it existing and leave it as it is."""


@dataclass(frozen=True)
class BucketState:
    existed: bool
    created: bool


def s3_client(conn: Connection) -> Any:
    """A boto3 S3 client for ``conn``: one per endpoint, region and credentials (building one
    costs ~0.2 s of CPU; every Repository resync checks its bucket). boto3 clients are
    thread-safe. Built under a lock: when a fleet of Repositories is created, every worker
    thread asks at once, and without it each would build (and parse botocore's service model
    for) a client of its own, ~10% of the operator's CPU to Ready at 1,400 objects."""
    with _client_lock:
        return _client(
            conn.endpoint_url,
            conn.region or "us-east-1",
            conn.access_key_id,
            conn.secret_access_key,
            conn.session_token,
        )


_client_lock = threading.Lock()


@functools.lru_cache(maxsize=256)
def _client(
    endpoint_url: str | None,
    region: str,
    access_key_id: str | None,
    secret_access_key: str | None,
    session_token: str | None,
) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        aws_session_token=session_token,
        config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5),
    )


def _code(e: Exception) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


def ensure_bucket(
    conn: Connection, *, provision: bool, spec_field: str = "spec.storage"
) -> BucketState:
    """Make sure the bucket exists; create and lock it down when ``provision`` is set.
    ``spec_field``: where the resource's spec holds ``provision`` (for messages).

    A bucket the operator creates gets public access blocked, default encryption (SSE-S3), and a
    lifecycle rule that aborts multipart uploads left incomplete for a day; an existing bucket's
    settings are left as its owner made them.
    Raises :class:`BucketMissing` or :class:`BucketUnreachable`.
    """
    if conn.provider != "s3":
        return _check_container(conn, provision=provision)
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = s3_client(conn)
    try:
        try:
            s3.head_bucket(Bucket=conn.bucket)
            existed = True
        except ClientError as e:
            if _code(e) not in ("404", "NoSuchBucket", "NotFound"):
                raise
            existed = False
        if not existed and not provision:
            raise BucketMissing(
                f"bucket {conn.bucket!r} does not exist (set {spec_field}.provision: true "
                "to have the operator create it)"
            )
        created = False
        if not existed:
            kwargs: dict[str, Any] = {"Bucket": conn.bucket}
            if conn.region and conn.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": conn.region}
            try:
                s3.create_bucket(**kwargs)
                created = True
            except ClientError as e:
                if _code(e) not in ("BucketAlreadyOwnedByYou",):
                    raise
        if created:
            # Only a bucket we made: an existing one's lifecycle and encryption are its owner's.
            # Which is why a failed lock-down must not leave the bucket behind: the next attempt
            # would find it existing and never lock it down.
            _lock_down_or_remove(s3, conn.bucket, spec_field)
        return BucketState(existed=existed, created=created)
    except ClientError as e:
        raise BucketUnreachable(
            f"S3 refused {_code(e) or 'the request'} on {conn.bucket!r}: "
            f"{e.response.get('Error', {}).get('Message', '')}"
        ) from None
    except BotoCoreError as e:
        raise BucketUnreachable(f"S3 unreachable for bucket {conn.bucket!r}: {e}") from None


def _lock_down_or_remove(s3: Any, bucket: str, spec_field: str) -> None:
    """Lock down the bucket just created; if S3 refuses any step, delete the (empty) bucket and
    raise :class:`BucketProvisionFailed` naming the step."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        _lock_down(s3, bucket)
        return
    except ClientError as e:
        step = e.operation_name
        why = f"S3 refused {step} ({_code(e)}: {e.response.get('Error', {}).get('Message', '')})"
        hint = (
            "; this S3 server does not implement it: create the bucket yourself and set "
            f"{spec_field}.provision: false"
            if _code(e) in ("NotImplemented", "501")
            else ""
        )
    except BotoCoreError as e:
        why, hint = f"S3 unreachable while locking it down: {e}", ""
    try:
        s3.delete_bucket(Bucket=bucket)
        outcome = "removed it again"
    except (ClientError, BotoCoreError) as e:
        outcome = (
            f"could not remove it again ({_code(e) or e}): it exists WITHOUT the lock-down, "
            "and the operator will not apply it to a bucket it finds existing"
        )
    raise BucketProvisionFailed(
        f"created bucket {bucket!r} but could not lock it down: {why}; {outcome}{hint}"
    )


def _lock_down(s3: Any, bucket: str) -> None:
    s3.put_public_access_block(
        Bucket=bucket,
        PublicAccessBlockConfiguration={
            "BlockPublicAcls": True,
            "IgnorePublicAcls": True,
            "BlockPublicPolicy": True,
            "RestrictPublicBuckets": True,
        },
    )
    s3.put_bucket_encryption(
        Bucket=bucket,
        ServerSideEncryptionConfiguration={
            "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
        },
    )
    s3.put_bucket_lifecycle_configuration(
        Bucket=bucket,
        LifecycleConfiguration={
            "Rules": [
                {
                    "ID": "zarrlake-abort-incomplete-multipart-uploads",
                    "Status": "Enabled",
                    "Filter": {"Prefix": ""},
                    "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
                }
            ]
        },
    )


def _check_container(conn: Connection, *, provision: bool) -> BucketState:
    """A GCS bucket or an Azure container: listed (one key) through the engine's own storage,
    which proves it exists and the credentials may read it. Never created (the spec refuses
    ``provision`` for these providers); read-only HTTP storage has nothing to check."""
    from zarrlake import StorageError
    from zarrlake.errors import ObjectNotFound

    if conn.read_only:
        return BucketState(existed=True, created=False)
    what = "container" if conn.provider == "azure" else "bucket"
    try:
        conn.storage().list_keys("", limit=1)
    except ObjectNotFound:
        raise BucketMissing(f"{what} {conn.bucket!r} does not exist (create it first)") from None
    except StorageError as e:
        raise BucketUnreachable(f"cannot list {what} {conn.bucket!r}: {e}") from None
    return BucketState(existed=True, created=False)


class NotOurRepository(Exception):
    """The location holds a different repository (or none): nothing is deleted."""


def bucket_exists(conn: Connection) -> bool:
    """Whether the bucket exists. Raises :class:`BucketUnreachable`."""
    if conn.provider != "s3":
        try:
            _check_container(conn, provision=False)
        except BucketMissing:
            return False
        return True
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client(conn).head_bucket(Bucket=conn.bucket)
        return True
    except ClientError as e:
        if _code(e) in ("404", "NoSuchBucket", "NotFound"):
            return False
        raise BucketUnreachable(
            f"S3 refused {_code(e) or 'the request'} on {conn.bucket!r}"
        ) from None
    except BotoCoreError as e:
        raise BucketUnreachable(f"S3 unreachable for bucket {conn.bucket!r}: {e}") from None


DELETE_BATCH = 1000  # keys per delete request (the S3 limit), so memory stays flat


def delete_repository_objects(
    conn: Connection, repository_id: str | None, *, mirror: bool = False
) -> int:
    """Delete the repository's objects (``reclaimPolicy: Delete``) through its
    :class:`zarrlake.Storage`; returns how many.

    Only keys of zarrlake's exact layout under the prefix are deleted, so other data sharing the
    bucket or prefix survives, even a second repository nested under a layout prefix. The
    ``repo`` marker is checked first (it must carry ``repository_id``, the id the resource
    reported: a resource never deletes a repository it did not see) and deleted first, after
    the published ``root`` that opening reads before it, so nobody opens the repository
    half-deleted. A bucket that is gone holds nothing to delete.
    ``mirror``: the location is a mirror of repository ``repository_id``: its own marker
    (``mirror/repo``) is checked and deleted first, and a source marker that bucket replication
    brought beside it must name the same repository.
    Raises :class:`BucketUnreachable` or :class:`NotOurRepository`.
    """
    from zarrlake import StorageError
    from zarrlake.errors import ObjectNotFound
    from zarrlake.format.model import (
        LAYOUT_KEY,
        LAYOUT_PREFIXES,
        MIRROR_REPO_KEY,
        REPO_KEY,
        RepoRecord,
    )
    from zarrlake.format.root import ROOT_KEY

    if not bucket_exists(conn):
        return 0
    deleted = 0
    try:
        storage = conn.storage()
        found: dict[str, bytes] = {}
        for key in (MIRROR_REPO_KEY, REPO_KEY) if mirror else (REPO_KEY,):
            try:
                found[key] = storage.get(key)
            except ObjectNotFound:
                pass
        if not found and repository_id is None:
            return 0  # no repository was ever recorded here, and none is here: nothing is ours
        for key, marker in found.items():
            found_id = RepoRecord.decode(marker, key).id
            if found_id != repository_id:
                raise NotOurRepository(
                    f"{storage.url} holds repository {found_id}, not "
                    + (repository_id or "one this resource recorded")
                )
        if found:
            # The published root before the markers: opening reads it first, and a root alone
            # would open as the repository.
            deleted += storage.delete_many([ROOT_KEY])
            deleted += storage.delete_many(list(found))
        for prefix in LAYOUT_PREFIXES:
            batch: list[str] = []
            for info in storage.list(prefix):
                if LAYOUT_KEY.match(info.key):
                    batch.append(info.key)
                if len(batch) >= DELETE_BATCH:
                    deleted += storage.delete_many(batch)
                    batch = []
            if batch:
                deleted += storage.delete_many(batch)
    except StorageError as e:
        raise BucketUnreachable(f"cannot delete {conn.storage_url}: {e}") from None
    return deleted
