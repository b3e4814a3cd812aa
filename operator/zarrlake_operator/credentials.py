"""Credentials per role, made through the storage provider's IAM API (issue 42, "the operator
provisions the credentials or bucket policies per role where the provider allows it").

With a commit service, the rules hold against a client that skips them only where writers
cannot write refs: the service alone holds credentials that do. For ``spec.commitService.
provisionCredentials`` the operator makes, with the Repository's own credentials (which must
be allowed to manage IAM users), one IAM user per role and repository:

- ``writer``: reads the whole repository, writes only the immutable objects (``chunks/``,
  ``packs/``, ``manifests/``, ``snapshots/``, ``txlogs/``, ``history/``); never ``refs/``,
  ``root`` or ``repo``, never a delete. On AWS the writes must be create-only
  (``s3:if-none-match``), so a writer cannot overwrite an object either.
- ``reader``: reads the repository, writes nothing.

Each gets an access key, kept in a Secret of the Repository's namespace with the keys a
credentials Secret has (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``). The user's policy is
put again on every change of the Repository (a policy edited by hand is put back); a key is
made only when the Secret holding it is missing or names a key the user no longer has, and
then the user's other keys are deleted. Users, policies and keys go when the Repository stops
asking for them or is deleted.

On SeaweedFS the IAM API is the S3 gateway's own (``-s3.iam.readOnly=false``), and these
policies become its identities' actions (``Write:bucket/prefix/chunks/*``, ...): tested there.
On AWS the IAM endpoint is the global one unless ``iamEndpointUrl`` says otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from zarrlake.k8s import Connection

#: What a writer may write: the objects that are never rewritten, only created (and GC'd by the
#: maintenance role).
IMMUTABLE_KINDS = ("chunks", "packs", "manifests", "snapshots", "txlogs", "history")
ROLES = ("writer", "reader")
POLICY_NAME = "zarrlake"
#: IAM user names: at most 64 of letters, digits and ``+=,.@_-``.
USER_NAME_MAX = 64


class ProvisionFailed(Exception):
    """The IAM API refused or could not be reached; the message says which call and why."""


@dataclass(frozen=True)
class Keys:
    access_key_id: str
    secret_access_key: str


def user_name(namespace: str, repository: str, uid: str, role: str) -> str:
    """The IAM user of ``role`` for one Repository: readable, and unique per resource (its uid),
    so that a Repository of the same name in another namespace or cluster sharing the account
    never takes over another's user."""
    tag = hashlib.sha256(f"{namespace}/{repository}/{uid}".encode()).hexdigest()[:10]
    head = re.sub(r"[^A-Za-z0-9+=,.@_-]", "-", f"zl-{namespace}-{repository}")
    room = USER_NAME_MAX - len(tag) - len(role) - 2
    return f"{head[:room]}-{tag}-{role}"


def policy(role: str, bucket: str, prefix: str, *, aws: bool) -> dict[str, Any]:
    """The IAM policy of ``role`` for the repository at ``bucket``/``prefix``. ``aws``: with the
    condition keys only AWS knows (create-only writes, listing limited to the prefix)."""
    root = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    objects = f"arn:aws:s3:::{bucket}/{root}*"
    listing: dict[str, Any] = {
        "Effect": "Allow",
        "Action": ["s3:ListBucket"],
        "Resource": [f"arn:aws:s3:::{bucket}"],
    }
    if aws and root:
        listing["Condition"] = {"StringLike": {"s3:prefix": [f"{root}*"]}}
    statements: list[dict[str, Any]] = [
        {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [objects]},
        listing,
    ]
    if role == "writer":
        write: dict[str, Any] = {
            "Effect": "Allow",
            "Action": ["s3:PutObject", "s3:AbortMultipartUpload"],
            "Resource": [f"arn:aws:s3:::{bucket}/{root}{kind}/*" for kind in IMMUTABLE_KINDS],
        }
        if aws:
            # Create-only: a PUT without If-None-Match (an overwrite) is not allowed.
            write["Condition"] = {"Null": {"s3:if-none-match": "false"}}
        statements.append(write)
    elif role != "reader":
        raise ValueError(f"unknown role {role!r}")
    return {"Version": "2012-10-17", "Statement": statements}


def is_aws(endpoint_url: str | None) -> bool:
    """Whether an S3 or IAM endpoint is AWS's own (none given, or a host of amazonaws.com):
    where the policies' condition keys are understood."""
    if not endpoint_url:
        return True
    host = (urlsplit(endpoint_url).hostname or "").lower()
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn")) or host in (
        "amazonaws.com",
        "amazonaws.com.cn",
    )


def iam_client(conn: Connection, endpoint_url: str | None) -> Any:
    """An IAM client with the Repository's own credentials: at ``endpoint_url``, else at the
    storage's endpoint (an S3-compatible server serves IAM there), else AWS's."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "iam",
        endpoint_url=endpoint_url or conn.endpoint_url,
        region_name=conn.region or "us-east-1",
        aws_access_key_id=conn.access_key_id,
        aws_secret_access_key=conn.secret_access_key,
        aws_session_token=conn.session_token,
        config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5),
    )


def ensure_user(iam: Any, user: str, document: dict[str, Any], keep: str | None) -> Keys | None:
    """Make IAM user ``user`` with policy ``document``; returns a new access key, or None when
    the user still has key ``keep`` (the one its Secret holds). A new key replaces the user's
    others. Raises :class:`ProvisionFailed`."""
    with _calls(f"IAM user {user}"):
        try:
            iam.create_user(UserName=user)
        except Exception as e:
            if _code(e) != "EntityAlreadyExists":
                raise
        iam.put_user_policy(
            UserName=user, PolicyName=POLICY_NAME, PolicyDocument=json.dumps(document)
        )
        held = [k["AccessKeyId"] for k in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]]
        if keep is not None and keep in held:
            return None
        # The others first: AWS allows two keys a user, and a key made before a crash (never
        # put in a Secret) must not leave room for none.
        for old in held:
            iam.delete_access_key(UserName=user, AccessKeyId=old)
        made = iam.create_access_key(UserName=user)["AccessKey"]
        return Keys(made["AccessKeyId"], made["SecretAccessKey"])


def remove_user(iam: Any, user: str) -> bool:
    """Delete IAM user ``user`` with its keys and policies; False if there was none. Raises
    :class:`ProvisionFailed`."""
    with _calls(f"IAM user {user}"):
        try:
            for key in iam.list_access_keys(UserName=user)["AccessKeyMetadata"]:
                iam.delete_access_key(UserName=user, AccessKeyId=key["AccessKeyId"])
            for name in iam.list_user_policies(UserName=user).get("PolicyNames", []):
                iam.delete_user_policy(UserName=user, PolicyName=name)
            iam.delete_user(UserName=user)
        except Exception as e:
            if _code(e) == "NoSuchEntity":  # (some servers list no keys of a user not there)
                return False
            raise
        return True


@contextlib.contextmanager
def _calls(what: str) -> Iterator[None]:
    """IAM errors (refusals, an unreachable endpoint) as :class:`ProvisionFailed`."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        said = e.response.get("Error", {})
        code, message = said.get("Code") or "the request", said.get("Message") or ""
        raise ProvisionFailed(
            f"{what}: IAM refused {code}" + (f": {message}" if message else "")
        ) from None
    except BotoCoreError as e:
        raise ProvisionFailed(f"{what}: IAM unreachable: {e}") from None


def _code(e: BaseException) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
