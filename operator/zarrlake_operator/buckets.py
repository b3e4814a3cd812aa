"""Buckets through boto3: check, provision (locked down), and empty a repository's prefix.

The storage engine itself never creates buckets; only the operator does, and only when a
Repository says ``provision: true``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zarrlake.k8s import Connection


class BucketMissing(Exception):
    """The bucket does not exist and the Repository does not ask for it to be provisioned."""


class BucketUnreachable(Exception):
    """S3 could not be reached or refused us (transient or credentials): retried with backoff."""


@dataclass(frozen=True)
class BucketState:
    existed: bool
    created: bool


def s3_client(conn: Connection) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=conn.endpoint_url,
        region_name=conn.region or "us-east-1",
        aws_access_key_id=conn.access_key_id,
        aws_secret_access_key=conn.secret_access_key,
        aws_session_token=conn.session_token,
        config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5),
    )


def _code(e: Exception) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


def ensure_bucket(conn: Connection, *, provision: bool) -> BucketState:
    """Make sure the bucket exists; create and lock it down when ``provision`` is set.

    Provisioning is idempotent: public access blocked, default encryption (SSE-S3), and a
    lifecycle rule that aborts multipart uploads left incomplete for a day.
    Raises :class:`BucketMissing` or :class:`BucketUnreachable`.
    """
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
                f"bucket {conn.bucket!r} does not exist (set spec.storage.provision: true "
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
        if provision:
            _lock_down(s3, conn.bucket)
        return BucketState(existed=existed, created=created)
    except ClientError as e:
        raise BucketUnreachable(
            f"S3 refused {_code(e) or 'the request'} on {conn.bucket!r}: "
            f"{e.response.get('Error', {}).get('Message', '')}"
        ) from None
    except BotoCoreError as e:
        raise BucketUnreachable(f"S3 unreachable for bucket {conn.bucket!r}: {e}") from None


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


def delete_repository_objects(conn: Connection) -> int:
    """Delete the repository's objects (``reclaimPolicy: Delete``); returns how many.

    Only the keys zarrlake's layout uses under the prefix are deleted, so other data sharing the
    bucket (or even the prefix) survives. The ``repo`` marker goes first: from then on the
    repository no longer opens, so nobody reads it half-deleted.
    Raises :class:`BucketUnreachable`.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from zarrlake.format.model import LAYOUT_PREFIXES, REPO_KEY

    s3 = s3_client(conn)
    base = conn.prefix.strip("/") + "/" if conn.prefix.strip("/") else ""
    deleted = 0
    try:
        try:
            s3.head_object(Bucket=conn.bucket, Key=base + REPO_KEY)
            s3.delete_object(Bucket=conn.bucket, Key=base + REPO_KEY)
            deleted += 1
        except ClientError as e:
            if _code(e) == "NoSuchBucket":
                return 0
            if _code(e) not in ("404", "NoSuchKey", "NotFound"):
                raise
        paginator = s3.get_paginator("list_objects_v2")
        for prefix in LAYOUT_PREFIXES:
            for page in paginator.paginate(Bucket=conn.bucket, Prefix=base + prefix):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    s3.delete_objects(Bucket=conn.bucket, Delete={"Objects": keys, "Quiet": True})
                    deleted += len(keys)
    except ClientError as e:
        raise BucketUnreachable(f"cannot delete s3://{conn.bucket}/{base}: {_code(e)}") from None
    except BotoCoreError as e:
        raise BucketUnreachable(f"S3 unreachable for bucket {conn.bucket!r}: {e}") from None
    return deleted
