"""The operator process end to end: Kubernetes API over HTTP (emulated), S3 over HTTP (moto),
real redis-server for managed lock services, maintenance jobs run as real CLI processes."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

import boto3
import numpy as np
import pytest
import zarr
from k8s_env import CREDENTIALS, Env, condition, wait_for

from zarrlake_operator import desired, kube

API = "zarrlake.io/v1alpha1"


def s3(env: Env) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=env.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def keys(env: Env, bucket: str, prefix: str) -> list[str]:
    out = s3(env).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in out.get("Contents", [])]


def commit(repo: Any, branch: str, value: float, message: str) -> str:
    session = repo.writable_session(branch)
    arr = zarr.open_array(
        session.store, path="a", mode="a", shape=(8, 8), chunks=(4, 4), dtype="float32"
    )
    arr[:] = value
    return session.commit(message, author="tests")


# -- Repository --


def test_repository_provisions_bucket_lock_service_and_repository(k8s: Env) -> None:
    k8s.secret()
    bucket = k8s.repository(lock="managed")
    k8s.wait_condition("Repository", "repo")  # Ready at once; Degraded while Redis starts
    obj = k8s.wait_condition("Repository", "repo", "LockServiceReady")
    status = obj["status"]
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    for type_ in ("BucketReady", "LockServiceReady", "Initialized"):
        assert condition(obj, type_)["status"] == "True", type_
    query = urllib.parse.urlencode({"endpoint_url": k8s.s3_endpoint, "region": "us-east-1"})
    assert status["url"] == f"s3://{bucket}/repos/repo?{query}"
    assert status["lockEndpoint"] == f"redis://zl-repo-lock.{k8s.namespace}.svc:6379/0"
    assert status["branches"] == 1 and status["tags"] == 0

    # The bucket is locked down as the spec promises.
    client = s3(k8s)
    block = client.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert all(block.values())
    enc = client.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]
    assert enc["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    rules = client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert rules[0]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1

    # The managed lock service: Secret, Service and Deployment, owned by the Repository.
    uid = obj["metadata"]["uid"]
    for kind in ("Secret", "Service", "Deployment"):
        child = k8s.get(kind, "zl-repo-lock")
        assert child is not None, kind
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid
    password = k8s.get("Secret", "zl-repo-lock")
    assert password is not None

    # The repository opens through the public discovery API, with the lock service.
    repo = k8s.open_repository()
    assert repo.id == status["repositoryID"]
    assert type(repo.lock).__name__ == "RedisLock"
    head = commit(repo, "main", 1.0, "first")
    assert repo.lookup_branch("main") == head


def test_missing_bucket_without_provision_waits_then_recovers(k8s: Env) -> None:
    k8s.secret()
    bucket = k8s.repository(provision=False)
    obj = k8s.wait_condition("Repository", "repo", "BucketReady", "False")
    assert condition(obj, "BucketReady")["reason"] == "BucketNotFound"
    assert "spec.storage.provision: true" in condition(obj, "BucketReady")["message"]
    assert obj["status"]["phase"] == "Provisioning"
    # A failure reason is a Warning event too: once, not once per retry.
    wait_for("the Warning event", lambda: "BucketNotFound" in k8s.event_reasons())
    s3(k8s).create_bucket(Bucket=bucket)
    k8s.wait_condition("Repository", "repo")
    warnings = [e for e in k8s.events() if e.get("reason") == "BucketNotFound"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning", warnings
    assert (warnings[0].get("count") or 1) == 1, warnings


def test_a_bucket_the_server_cannot_lock_down_is_not_left_behind(
    k8s: Env, seaweedfs_s3: Any
) -> None:
    """SeaweedFS has no PutPublicAccessBlock (501 NotImplemented). The operator created the
    bucket, could not lock it down, and must neither go on with a bucket missing the lock-down
    nor leave it for the next attempt to find "existing" (whose settings are its owner's): the
    bucket is removed again, the condition names the refused step, and a Warning event says so.
    Made by hand and given with ``provision: false``, the same bucket is used as it is."""
    keys = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # the fixture's
    k8s.secret("s3-creds", keys)
    bucket = f"zl-{k8s.namespace}-noblock"
    storage = {
        "bucket": bucket,
        "prefix": "repos/repo",
        "endpointURL": seaweedfs_s3.endpoint,
        "region": "us-east-1",
        "credentialsSecret": {"name": "s3-creds"},
        "provision": True,
    }
    spec = {"storage": storage, "lockService": {"mode": "none"}}
    k8s.create(
        {"apiVersion": API, "kind": "Repository", "metadata": {"name": "repo"}, "spec": spec}
    )
    obj = k8s.wait_condition("Repository", "repo", "BucketReady", "False")
    bucket_ready = condition(obj, "BucketReady")
    assert bucket_ready["reason"] == "ProvisionFailed", bucket_ready
    assert "PutPublicAccessBlock" in bucket_ready["message"]
    assert "removed it again" in bucket_ready["message"]
    assert "provision: false" in bucket_ready["message"]
    assert condition(obj, "Ready")["status"] == "False"
    wait_for("the Warning event", lambda: "ProvisionFailed" in k8s.event_reasons())
    client = boto3.client(
        "s3",
        endpoint_url=seaweedfs_s3.endpoint,
        region_name="us-east-1",
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
    )
    names = {b["Name"] for b in client.list_buckets()["Buckets"]}
    assert bucket not in names

    client.create_bucket(Bucket=bucket)
    k8s.patch("Repository", "repo", {"spec": {"storage": {"provision": False}}})
    obj = k8s.wait_condition("Repository", "repo")
    assert condition(obj, "BucketReady")["message"].endswith("exists")


def test_missing_credentials_secret_is_reported_then_picked_up(k8s: Env) -> None:
    k8s.repository(secret="late-secret")
    obj = k8s.wait_condition("Repository", "repo", "BucketReady", "False")
    assert condition(obj, "BucketReady")["reason"] == "CredentialsNotFound"
    assert "late-secret" in condition(obj, "BucketReady")["message"]
    k8s.secret("late-secret")
    k8s.wait_condition("Repository", "repo")


def test_invalid_spec_is_refused_by_the_api_server(k8s: Env) -> None:
    """What the CRD's schema refuses never reaches the operator: the API server answers 422 and
    names every bad field (on a real cluster as on the emulated API)."""
    k8s.secret()
    with pytest.raises(kube.KubeError) as refused:
        k8s.custom(
            "Repository",
            "bad",
            {"storage": {"bucket": "Not_A_Bucket!"}, "lockService": {"mode": "sometimes"}},
        )
    assert refused.value.status == 422
    message = str(refused.value)
    assert 'Repository.zarrlake.io "bad" is invalid' in message
    assert 'spec.storage.bucket: Invalid value: "Not_A_Bucket!"' in message
    assert 'spec.lockService.mode: Unsupported value: "sometimes"' in message
    assert k8s.get("Repository", "bad") is None


def test_invalid_spec_gets_a_readable_condition(k8s: Env) -> None:
    """What the schema cannot express, the operator refuses with a condition a person can act
    on: a session lifetime the pattern accepts but the engine does not (at most 7 days)."""
    k8s.secret()
    k8s.repository("bad", config={"sessionTTL": "30d"})
    obj = wait_for(
        "InvalidSpec",
        lambda: (
            (o := k8s.get("Repository", "bad"))
            and condition(o, "Ready").get("reason") == "InvalidSpec"
            and o
        ),
    )
    message = condition(obj, "Ready")["message"]
    assert message == "spec.config: session_ttl must be positive and at most 7 days"
    assert obj["status"]["phase"] == "Failed"
    assert condition(obj, "Ready")["status"] == "False"
    wait_for("the InvalidSpec Warning event", lambda: "InvalidSpec" in k8s.event_reasons())


def test_a_spec_the_schema_lets_through_but_no_client_takes_is_invalid_spec(k8s: Env) -> None:
    """An endpoint URL with no host, or a duration past any date: the CRD's patterns pass them,
    the S3 client and ``timedelta`` do not. Each is an InvalidSpec that names the field, never
    a traceback on every retry with no status."""
    k8s.ready_repository()
    storage = {"bucket": "zl-badep", "endpointURL": "http://", "region": "us-east-1"}
    k8s.custom("Repository", "badep", {"storage": storage})
    k8s.custom(
        "RetentionPolicy",
        "huge",
        {"repository": "repo", "gc": {"schedule": "@daily", "grace": "99999999999999999999d"}},
    )

    def reason(kind: str, name: str) -> Any:
        obj = k8s.get(kind, name)
        return obj and condition(obj, "Ready").get("reason") == "InvalidSpec" and obj

    bad = wait_for("the Repository's InvalidSpec", lambda: reason("Repository", "badep"))
    assert "spec.storage.endpointURL" in condition(bad, "Ready")["message"]
    huge = wait_for("the policy's InvalidSpec", lambda: reason("RetentionPolicy", "huge"))
    assert "longer than" in condition(huge, "Ready")["message"]


def test_a_branch_with_a_name_the_engine_refuses_can_be_deleted(k8s: Env) -> None:
    """``feat/`` passes the CRD's pattern but not the engine's naming rules: the Branch says
    InvalidName, and deleting it must not wait for ever on a branch that was never made."""
    k8s.ready_repository()
    k8s.custom("Branch", "bad-name", {"repository": "repo", "name": "feat/"})
    obj = k8s.wait_condition("Branch", "bad-name", "Ready", "False")
    assert condition(obj, "Ready")["reason"] == "InvalidName"
    k8s.delete("Branch", "bad-name")
    wait_for("the Branch resource gone", lambda: k8s.get("Branch", "bad-name") is None)
    assert set(k8s.open_repository().list_branches()) == {"main"}


def test_lock_service_drift_is_corrected_and_mode_change_removes_it(k8s: Env) -> None:
    k8s.ready_repository(lock="managed")
    dep = k8s.get("Deployment", "zl-repo-lock")
    assert dep is not None
    container = dep["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "redis:hand-edited"
    k8s.patch("Deployment", "zl-repo-lock", {"spec": dep["spec"]})
    wait_for(
        "the Deployment's image restored",
        lambda: (
            (d := k8s.get("Deployment", "zl-repo-lock"))
            and d["spec"]["template"]["spec"]["containers"][0]["image"] == "redis:7.2-alpine"
        ),
    )
    k8s.patch("Repository", "repo", {"spec": {"lockService": {"mode": "none"}}})
    # The operator deletes them one after the other: wait for each.
    wait_for(
        "lock objects removed",
        lambda: all(k8s.get(kind, "zl-repo-lock") is None for kind in ("Deployment", "Service")),
    )
    obj = wait_for(
        "LockServiceReady NotRequired",
        lambda: (
            (o := k8s.get("Repository", "repo"))
            and condition(o, "LockServiceReady").get("reason") == "NotRequired"
            and o
        ),
    )
    assert condition(obj, "Ready")["status"] == "True"
    assert obj["status"].get("lockEndpoint") is None


@pytest.mark.parametrize("policy", ["Retain", "Delete"])
def test_deletion_honours_the_reclaim_policy(k8s: Env, policy: str) -> None:
    k8s.secret()
    bucket = k8s.repository(lock="managed", reclaim=policy)
    k8s.wait_condition("Repository", "repo")
    commit(k8s.open_repository(), "main", 2.0, "data")
    # Another repository's objects in the same bucket, and foreign objects under this
    # repository's own prefix, must survive either way.
    s3(k8s).put_object(Bucket=bucket, Key="repos/other/keep.txt", Body=b"x")
    s3(k8s).put_object(Bucket=bucket, Key="repos/repo/README.txt", Body=b"x")
    assert keys(k8s, bucket, "repos/repo/")
    k8s.delete("Repository", "repo")
    wait_for("the Repository is gone", lambda: k8s.get("Repository", "repo") is None)
    wait_for("owned lock objects collected", lambda: k8s.get("Deployment", "zl-repo-lock") is None)
    remaining = keys(k8s, bucket, "repos/repo/")
    if policy == "Retain":
        assert len(remaining) > 5 and "repos/repo/repo" in remaining
    else:
        assert remaining == ["repos/repo/README.txt"]
    assert keys(k8s, bucket, "repos/other/") == ["repos/other/keep.txt"]


# -- Branch --


def test_branch_lifecycle_status_drift_and_deletion(k8s: Env) -> None:
    k8s.ready_repository()
    repo = k8s.open_repository()
    base = commit(repo, "main", 1.0, "base")
    k8s.custom("Branch", "dev", {"repository": "repo", "from": "main"})
    obj = k8s.wait_condition("Branch", "dev")
    assert obj["status"]["head"] == base and obj["status"]["branch"] == "dev"
    assert obj["status"]["lastCommitMessage"] == "base"
    assert repo.lookup_branch("dev") == base

    # Status follows commits made outside Kubernetes.
    head = commit(repo, "dev", 2.0, "on dev")
    wait_for("status.head follows", lambda: k8s.get("Branch", "dev")["status"]["head"] == head)

    # Deleted behind the operator's back: recreated at its last head, and reported.
    repo.delete_branch("dev")
    wait_for("branch recreated", lambda: repo.list_branches().get("dev") == head)
    obj = wait_for(
        "recreated count", lambda: (o := k8s.get("Branch", "dev"))["status"].get("recreated") and o
    )
    assert obj["status"]["recreated"] == 1
    # Kopf posts events in the background, after the status patch: wait for them.
    wait_for(
        "BranchRecreated and BranchCreated events",
        lambda: k8s.event_reasons() >= {"BranchRecreated", "BranchCreated"},
    )

    k8s.delete("Branch", "dev")
    wait_for("branch deleted", lambda: "dev" not in repo.list_branches())
    wait_for("resource gone", lambda: k8s.get("Branch", "dev") is None)


def test_a_branch_that_moves_is_told_by_a_head_moved_event(k8s: Env) -> None:
    """A commit made outside Kubernetes shows as a HeadMoved Event: on the Branch resource for
    its branch, on the Repository for main (which no Branch resource may manage)."""
    k8s.ready_repository()
    repo = k8s.open_repository()
    base = commit(repo, "main", 1.0, "base")
    k8s.custom("Branch", "dev", {"repository": "repo", "from": "main"})
    k8s.wait_condition("Branch", "dev")

    def told(kind: str, name: str, head: str) -> list[str]:
        return [
            e["message"]
            for e in k8s.events()
            if e.get("reason") == "HeadMoved"
            and (e.get("involvedObject") or {}).get("kind") == kind
            and (e.get("involvedObject") or {}).get("name") == name
            and head in e["message"]
        ]

    head = commit(repo, "dev", 2.0, "on dev")
    (message,) = wait_for("the Branch's HeadMoved event", lambda: told("Branch", "dev", head))
    assert message.startswith(f"branch 'dev' at {head} (was {base}), commit")
    assert message.endswith("'on dev'")
    moved = commit(repo, "main", 3.0, "on main")
    (message,) = wait_for(
        "the Repository's HeadMoved event", lambda: told("Repository", "repo", moved)
    )
    assert message.startswith(f"branch 'main' at {moved} (was {base}), commit")
    # Once per move: resyncs that find the heads where they were tell nothing more.
    time.sleep(3)
    assert len(told("Branch", "dev", head)) == 1 and len(told("Repository", "repo", moved)) == 1


def test_a_branch_being_deleted_is_not_recreated_by_a_resync(k8s: Env) -> None:
    """Between the operator's delete of a branch and the end of its Branch resource (another
    finalizer still holds it here, as a slower controller's would), the branch is absent and
    the resource still listed: its Repository's resyncs (every second here) must not take that
    for a branch deleted behind the operator's back and recreate it."""
    k8s.ready_repository()
    repo = k8s.open_repository()
    commit(repo, "main", 1.0, "base")
    k8s.create(
        {
            "apiVersion": API,
            "kind": "Branch",
            "metadata": {"name": "held", "finalizers": ["tests.zarrlake.io/hold"]},
            "spec": {"repository": "repo", "from": "main"},
        }
    )
    k8s.wait_condition("Branch", "held")
    assert "held" in repo.list_branches()
    k8s.delete("Branch", "held")
    wait_for("branch deleted", lambda: "held" not in repo.list_branches())

    def repository_resyncs() -> float:
        return _series(k8s, "zarrlake_operator_reconciles_total").get(("Repository", "ok"), 0)

    # Each Repository resync then checks its dependents, this Branch among them.
    seen = repository_resyncs()
    wait_for("three Repository resyncs", lambda: repository_resyncs() >= seen + 3)
    obj = k8s.get("Branch", "held")
    assert obj is not None and obj["metadata"].get("deletionTimestamp"), obj
    assert "held" not in repo.list_branches()
    assert "BranchRecreated" not in k8s.event_reasons()

    k8s.patch("Branch", "held", {"metadata": {"finalizers": None}})
    wait_for("resource gone", lambda: k8s.get("Branch", "held") is None)
    assert "held" not in repo.list_branches()


def test_nothing_is_written_into_a_repository_being_deleted(k8s: Env) -> None:
    """A Branch made while its Repository is being deleted (another finalizer still holds it
    after the operator's delete handler ran) waits, and says why, and its RetentionPolicy's jobs
    are suspended: the Repository's reclaimPolicy decides what becomes of the data, and nothing
    new goes into it."""
    k8s.secret()
    k8s.create(
        {
            "apiVersion": API,
            "kind": "Repository",
            "metadata": {"name": "repo", "finalizers": ["tests.zarrlake.io/hold"]},
            "spec": {
                "storage": {
                    "bucket": f"zl-{k8s.namespace}-repo",
                    "prefix": "repos/repo",
                    "endpointURL": k8s.s3_endpoint,
                    "region": "us-east-1",
                    "provision": True,
                    "credentialsSecret": {"name": "s3-creds"},
                },
                "lockService": {"mode": "none"},
                "reclaimPolicy": "Retain",
            },
        }
    )
    k8s.wait_condition("Repository", "repo")
    repo = k8s.open_repository()
    k8s.custom("RetentionPolicy", "p", {"repository": "repo", "gc": {"schedule": "@daily"}})
    cron = k8s.wait_condition("RetentionPolicy", "p")["status"]["gcCronJob"]
    assert not k8s.get("CronJob", cron)["spec"].get("suspend")
    k8s.delete("Repository", "repo")
    wait_for(
        "the operator's delete handler done",
        lambda: (
            (o := k8s.get("Repository", "repo"))
            and o["metadata"].get("finalizers") == ["tests.zarrlake.io/hold"]
        ),
    )
    k8s.custom("Branch", "late", {"repository": "repo"})
    obj = k8s.wait_condition("Branch", "late", "Ready", "False")
    assert condition(obj, "Ready")["reason"] == "RepositoryDeleting", obj["status"]
    assert "late" not in repo.list_branches()
    # Its policy's GC would work on data the reclaimPolicy is deciding about: suspended now.
    wait_for("CronJob suspended", lambda: k8s.get("CronJob", cron)["spec"].get("suspend"))
    obj = k8s.wait_condition("RetentionPolicy", "p", "Ready", "False")
    assert condition(obj, "Ready")["reason"] == "RepositoryDeleting", obj["status"]
    k8s.patch("Repository", "repo", {"metadata": {"finalizers": None}})
    wait_for("Repository gone", lambda: k8s.get("Repository", "repo") is None)
    assert list(repo.list_branches()) == ["main"]  # Retain: the data stays, as it was


def test_two_branch_resources_for_one_branch_the_older_wins(k8s: Env) -> None:
    k8s.ready_repository()
    k8s.custom("Branch", "first", {"repository": "repo", "name": "shared"})
    k8s.wait_condition("Branch", "first")
    k8s.custom("Branch", "second", {"repository": "repo", "name": "shared"})
    obj = k8s.wait_condition("Branch", "second", "Conflict", "True")
    assert "first" in condition(obj, "Ready")["message"]
    assert obj["status"]["phase"] == "Conflict"
    repo = k8s.open_repository()
    # Deleting the loser leaves the branch alone.
    k8s.delete("Branch", "second")
    wait_for("loser gone", lambda: k8s.get("Branch", "second") is None)
    assert "shared" in repo.list_branches()


def test_when_the_owner_of_a_branch_goes_the_next_claimant_takes_it_over(k8s: Env) -> None:
    """The loser of a claim is Conflict, not Ready: each resync of its Repository reconciles
    it, so once the owner is gone (and with it the branch) it takes the branch over. (Names in
    creation order: a claim made in the same second goes to the first name.)"""
    k8s.ready_repository()
    k8s.custom("Branch", "one", {"repository": "repo", "name": "shared"})
    k8s.wait_condition("Branch", "one")
    k8s.custom("Branch", "two", {"repository": "repo", "name": "shared"})
    k8s.wait_condition("Branch", "two", "Conflict", "True")
    k8s.delete("Branch", "one")
    wait_for("one gone", lambda: k8s.get("Branch", "one") is None)
    obj = k8s.wait_condition("Branch", "two")
    assert condition(obj, "Conflict")["status"] == "False"
    assert "shared" in k8s.open_repository().list_branches()


def test_main_and_bad_from_are_refused_with_conditions(k8s: Env) -> None:
    k8s.ready_repository()
    k8s.custom("Branch", "main", {"repository": "repo"})
    obj = wait_for(
        "main refused",
        lambda: (
            (o := k8s.get("Branch", "main"))
            and condition(o, "Ready").get("reason") == "Refused"
            and o
        ),
    )
    assert "cannot be deleted" in condition(obj, "Ready")["message"]
    k8s.delete("Branch", "main")
    wait_for("resource gone", lambda: k8s.get("Branch", "main") is None)
    repo = k8s.open_repository()
    assert "main" in repo.list_branches()

    k8s.custom("Branch", "orphan", {"repository": "repo", "from": "no-such-ref"})
    obj = wait_for(
        "FromNotFound",
        lambda: (
            (o := k8s.get("Branch", "orphan"))
            and condition(o, "Ready").get("reason") == "FromNotFound"
            and o
        ),
    )
    assert "no-such-ref" in condition(obj, "Ready")["message"]
    # Each failure is one Warning event about its resource (the retries of FromNotFound add
    # none); waiting for a Repository is not a failure and posts none.
    wait_for("the Warning events", lambda: {"Refused", "FromNotFound"} <= k8s.event_reasons())

    k8s.custom("Branch", "lost", {"repository": "nope"})
    wait_for(
        "RepositoryNotFound",
        lambda: condition(k8s.get("Branch", "lost"), "Ready").get("reason") == "RepositoryNotFound",
    )
    time.sleep(2)  # a resync or two of "orphan" (its retries come every 30 s; resyncs every 2)
    events = [e for e in k8s.events() if e["type"] == "Warning"]
    warnings = [(e["reason"], e["involvedObject"]["name"]) for e in events]
    assert sorted(warnings) == [("FromNotFound", "orphan"), ("Refused", "main")], warnings


# -- Tag --


def test_tag_resolves_once_and_deletes(k8s: Env) -> None:
    k8s.ready_repository()
    repo = k8s.open_repository()
    first = commit(repo, "main", 1.0, "one")
    k8s.custom("Tag", "v1", {"repository": "repo", "ref": "main"})
    obj = k8s.wait_condition("Tag", "v1")
    assert obj["status"]["snapshot"] == first
    assert repo.lookup_tag("v1") == first
    # main moves on; the tag does not.
    commit(repo, "main", 2.0, "two")
    k8s.wait_condition("Repository", "repo")
    wait_for("repository counts", lambda: k8s.get("Repository", "repo")["status"]["tags"] == 1)
    assert k8s.get("Tag", "v1")["status"]["snapshot"] == first
    assert repo.lookup_tag("v1") == first

    k8s.custom("Tag", "v1-again", {"repository": "repo", "name": "v1", "ref": "main"})
    k8s.wait_condition("Tag", "v1-again", "Conflict", "True")

    k8s.delete("Tag", "v1")
    wait_for("tag deleted", lambda: "v1" not in repo.list_tags())


# -- RetentionPolicy and jobs --


def test_retention_policy_cron_jobs_and_a_gc_run(k8s: Env) -> None:
    k8s.ready_repository(lock="managed")
    repo = k8s.open_repository()
    for v in (1.0, 2.0, 3.0):
        commit(repo, "main", v, f"fill {v}")
    k8s.custom(
        "RetentionPolicy",
        "keep",
        {
            "repository": "repo",
            "rules": {"default": {"last": 1}},
            "gc": {"schedule": "0 3 * * *", "grace": "0s", "force": True},
            "compaction": {"schedule": "@weekly"},
        },
    )
    obj = k8s.wait_condition("RetentionPolicy", "keep")
    gc_name, compact_name = obj["status"]["gcCronJob"], obj["status"]["compactionCronJob"]
    cron = k8s.get("CronJob", gc_name)
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert cron["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert k8s.get("CronJob", compact_name)["spec"]["schedule"] == "@weekly"

    # Spec changes reach the CronJobs; dropping compaction removes its CronJob.
    k8s.patch(
        "RetentionPolicy", "keep", {"spec": {"gc": {"schedule": "30 2 * * *"}, "compaction": None}}
    )
    wait_for(
        "schedule updated", lambda: k8s.get("CronJob", gc_name)["spec"]["schedule"] == "30 2 * * *"
    )
    wait_for("compaction CronJob removed", lambda: k8s.get("CronJob", compact_name) is None)

    # Run the GC job (what `kubectl create job --from=cronjob/...` does).
    template = k8s.get("CronJob", gc_name)["spec"]["jobTemplate"]
    k8s.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "gc-manual", "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )
    obj = wait_for(
        "lastGC",
        lambda: (o := k8s.get("RetentionPolicy", "keep"))["status"].get("lastGC") and o,
        240,  # the Job runs `zarrlake gc` as a new process
    )
    last = obj["status"]["lastGC"]
    assert last["result"] == "Succeeded", (last, k8s.cluster.job_log[-1])
    assert last["job"] == "gc-manual"
    assert last["snapshotsExpired"] == 3  # the initial commit and two fills
    assert last["objectsDeleted"] > 0 and last["bytesFreed"] > 0
    assert np.all(zarr.open_array(repo.readonly_session("main").store, path="a")[:] == 3.0)
    assert repo.fsck().ok
    wait_for("GCSucceeded event", lambda: "GCSucceeded" in k8s.event_reasons())


def test_failed_job_is_reported(k8s: Env) -> None:
    k8s.ready_repository()
    k8s.custom("RetentionPolicy", "p", {"repository": "repo", "gc": {"schedule": "@daily"}})
    obj = k8s.wait_condition("RetentionPolicy", "p")
    template = k8s.get("CronJob", obj["status"]["gcCronJob"])["spec"]["jobTemplate"]
    # The storage goes away under the job: it must fail and say why.
    container = template["spec"]["template"]["spec"]["containers"][0]
    container["command"][2] = "s3://no-such-bucket-zl/x?endpoint_url=" + k8s.s3_endpoint
    k8s.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "gc-broken", "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )
    obj = wait_for(
        "lastGC", lambda: (o := k8s.get("RetentionPolicy", "p"))["status"].get("lastGC") and o, 240
    )
    last = obj["status"]["lastGC"]
    assert last["result"] == "Failed"
    assert "zarrlake" in last["message"] or "no-such-bucket" in last["message"]


def test_bad_retention_specs_are_refused(k8s: Env) -> None:
    k8s.ready_repository()
    k8s.custom(
        "RetentionPolicy",
        "short",
        {"repository": "repo", "gc": {"schedule": "@daily", "grace": "1d"}},
    )
    # A schedule that is not five fields or a macro: the CRD's pattern refuses it (422).
    with pytest.raises(kube.KubeError) as refused:
        k8s.custom(
            "RetentionPolicy",
            "cron",
            {"repository": "repo", "gc": {"schedule": "every tuesday"}},
        )
    assert refused.value.status == 422
    assert 'spec.gc.schedule: Invalid value: "every tuesday"' in str(refused.value)
    assert k8s.get("RetentionPolicy", "cron") is None
    # Five fields out of range, and a grace below 7 days: only the operator can tell.
    k8s.custom(
        "RetentionPolicy",
        "out-of-range",
        {
            "repository": "repo",
            "gc": {"schedule": "61 25 * * *"},  # a real API server refuses such a CronJob
            "compaction": {"schedule": "0 0 5-1 * *"},
        },
    )
    for name, needle in (
        ("short", "below 7d"),
        ("out-of-range", "minute 61 is out of range 0-59"),
        ("out-of-range", "day of month range '5-1' runs backwards"),
    ):
        obj = wait_for(
            f"{name} refused",
            lambda n=name: (
                (o := k8s.get("RetentionPolicy", n))
                and condition(o, "Ready").get("reason") == "InvalidSpec"
                and o
            ),
        )
        assert needle in condition(obj, "Ready")["message"]
        assert obj["status"]["phase"] == "Failed"
        assert not kube.list_("CronJob", k8s.namespace, f"{desired.POLICY_LABEL}={name}")
    # Each refusal is a Warning event too — once, not once per resync.
    time.sleep(5)  # a few resyncs (every 2 s here)
    refusals = [e for e in k8s.events() if e.get("reason") == "InvalidSpec"]
    assert sorted(e["involvedObject"]["name"] for e in refusals) == ["out-of-range", "short"]
    assert all(e["type"] == "Warning" for e in refusals)


# -- cross-cutting --


def test_credentials_never_leave_their_secrets(k8s: Env) -> None:
    k8s.ready_repository(lock="managed")
    k8s.custom("RetentionPolicy", "p", {"repository": "repo", "gc": {"schedule": "@daily"}})
    k8s.wait_condition("RetentionPolicy", "p")
    lock_password = kube.secrets(k8s.namespace)("zl-repo-lock")["password"]
    secrets = [*CREDENTIALS.values(), lock_password]
    visible = []
    for kind in ("Repository", "RetentionPolicy", "CronJob", "Deployment", "Service"):
        visible += kube.list_(kind, k8s.namespace)
    visible += k8s.events()
    log = k8s.operator_log.read_text(errors="replace")
    assert " DEBUG " in log  # the operator logs at its most verbose in these tests
    text = json.dumps(visible) + log
    for value in secrets:
        for form in (value, base64.b64encode(value.encode()).decode()):
            assert form not in text


def test_metrics_count_reconciles_per_kind(k8s: Env) -> None:
    k8s.ready_repository()
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    series = 'zarrlake_operator_reconciles_total{kind="Repository",outcome="ok"}'

    def scrape() -> str:
        with direct.open(f"http://127.0.0.1:{k8s.metrics_port}/metrics", timeout=30) as rsp:
            return str(rsp.read().decode())

    def counted() -> str | None:
        # The counter goes up when the reconcile returns, just after its status patch.
        body = scrape()
        ok = [line for line in body.splitlines() if line.startswith(series)]
        return body if ok and float(ok[0].split()[-1]) >= 1 else None

    body = wait_for("a Repository reconcile counted", counted)
    assert "zarrlake_operator_reconcile_duration_seconds_bucket" in body


def _api_requests(k8s: Env) -> dict[tuple[str, str], float]:
    """The operator's count of its API requests, by (verb, resource), and of its reconciles
    (under ``("reconciles", "")``)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(f"http://127.0.0.1:{k8s.metrics_port}/metrics", timeout=30) as rsp:
        text = rsp.read().decode()
    out: dict[tuple[str, str], float] = {("reconciles", ""): 0.0}
    for line in text.splitlines():
        if line.startswith("zarrlake_operator_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            verb = labels.split('verb="')[1].split('"')[0]
            resource = labels.split('resource="')[1].split('"')[0]
            out[verb, resource] = float(value)
        elif line.startswith("zarrlake_operator_reconciles_total{"):
            out["reconciles", ""] += float(line.rsplit(" ", 1)[1])
    return out


def _writes(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict:
    return {
        k: n - before.get(k, 0)
        for k, n in after.items()
        if k[0] in ("POST", "PUT", "PATCH", "DELETE") and n != before.get(k, 0)
    }


def _settled(k8s: Env, *, quiet: float, timeout: float) -> None:
    """Wait until the operator has written nothing for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        before = _api_requests(k8s)
        time.sleep(quiet)
        writes = _writes(before, _api_requests(k8s))
        if not writes:
            return
        assert time.monotonic() < deadline, f"the operator kept writing: {writes}"


def test_an_idle_fleet_writes_nothing(k8s: Env) -> None:
    """Once everything is Ready and nothing changes, resyncs only read: no status patch, no
    DELETE of CronJobs that do not exist, no apply — whatever the number of objects."""
    k8s.ready_repository()
    for name in ("b1", "b2", "b3"):
        k8s.custom("Branch", name, {"repository": "repo"})
    k8s.custom("Tag", "t1", {"repository": "repo", "ref": "main"})
    k8s.custom(
        "RetentionPolicy",
        "with-compaction",
        {
            "repository": "repo",
            "gc": {"schedule": "0 3 * * *"},
            "compaction": {"schedule": "0 4 * * *"},
        },
    )
    k8s.custom("RetentionPolicy", "gc-only", {"repository": "repo", "gc": {"schedule": "@daily"}})
    for kind, name in (
        ("Branch", "b1"),
        ("Branch", "b2"),
        ("Branch", "b3"),
        ("Tag", "t1"),
        ("RetentionPolicy", "with-compaction"),
        ("RetentionPolicy", "gc-only"),
    ):
        k8s.wait_condition(kind, name)
    # The operator's counts are of every namespace: earlier tests' namespaces must be gone, or
    # their teardown (the delete handlers taking a lock service or a server down, under load
    # still at it) counts in this window.
    wait_for(
        "the namespaces of earlier tests to be gone",
        lambda: (
            not [
                ns["metadata"]["name"]
                for ns in kube.list_("Namespace", "")
                if ns["metadata"]["name"] != k8s.namespace
                and ns["metadata"].get("deletionTimestamp")
            ]
        ),
        timeout=120,
    )
    # Let the change handlers and the first resyncs finish what they write (under load they may
    # still be at it when every object reads Ready): settled is 3 s in a row without a write.
    _settled(k8s, quiet=3.0, timeout=60.0)
    checked0 = _series(k8s, "zarrlake_operator_dependents_checked_total")
    before = _api_requests(k8s)
    time.sleep(8)  # several resyncs of every object (every second here)
    after = _api_requests(k8s)
    checked = _series(k8s, "zarrlake_operator_dependents_checked_total")
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    reconciles = delta.pop(("reconciles", ""), 0)
    assert reconciles >= 3, delta  # the Repository and its policies resynced in the window ...
    # ... and its Branches and Tag checked by those resyncs (confirmed: nothing to reconcile) ...
    confirmed = {k[0]: v - checked0.get(k, 0) for k, v in checked.items() if k[1] == "confirmed"}
    assert confirmed.get("Branch", 0) >= 3 and confirmed.get("Tag", 0) >= 1, checked
    # ... and asked the API server nothing: the Repository, Branch, Tag and policy bodies and the
    # CronJobs come from the watches, and a credentials Secret read within the last 2 minutes is
    # reused. A Secret re-read every 2 minutes is all a resting fleet costs.
    assert not _writes(before, after), delta
    assert sum(delta.values()) <= 2, delta


def _series(k8s: Env, name: str) -> dict[tuple[str, ...], float]:
    """One metric of the operator, by its label values (in the order the labels come)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(f"http://127.0.0.1:{k8s.metrics_port}/metrics", timeout=30) as rsp:
        text = rsp.read().decode()
    out: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[tuple(v.split('"')[1] for v in labels[len(name) + 1 : -1].split(","))] = float(
                value
            )
    return out


def test_a_resting_repository_costs_one_read_of_its_root_per_resync(k8s: Env) -> None:
    """At rest, a resync of a Repository and of everything that names it asks S3 for the
    repository's published root (which holds its record, every head and every tag) and the
    marker a mirror would have, however many Branches and Tags there are: no listing, and no
    branch head or tag record is read. (S3 requests counted by a proxy between the operator
    and the S3 server.)"""
    from zarrlake_testkit.s3proxy import HeaderStrippingProxy

    with HeaderStrippingProxy(k8s.s3_endpoint, drop=()) as proxy:
        k8s.secret()
        bucket = f"zl-{k8s.namespace}-counted"
        storage = {
            "bucket": bucket,
            "prefix": "repos/repo",
            "endpointURL": proxy.endpoint,
            "region": "us-east-1",
            "provision": True,
            "credentialsSecret": {"name": "s3-creds"},
        }
        k8s.custom("Repository", "repo", {"storage": storage, "lockService": {"mode": "none"}})
        k8s.wait_condition("Repository", "repo")
        for name in ("b1", "b2", "b3"):
            k8s.custom("Branch", name, {"repository": "repo"})
        k8s.custom("Tag", "t1", {"repository": "repo", "ref": "main"})
        for kind, name in (("Branch", "b1"), ("Branch", "b2"), ("Branch", "b3"), ("Tag", "t1")):
            k8s.wait_condition(kind, name)
        time.sleep(4)  # resyncs (every second here) settle what the change handlers wrote
        checked0 = _series(k8s, "zarrlake_operator_dependents_checked_total")
        proxy.requests(clear=True)
        time.sleep(6)
        requests = proxy.requests(clear=True)
        checked = _series(k8s, "zarrlake_operator_dependents_checked_total")
        delta = {k: v - checked0.get(k, 0) for k, v in checked.items()}

        mine = [(m, p) for m, p in requests if p.split("?")[0].startswith(f"/{bucket}")]
        opens = [p for m, p in mine if m == "GET" and p.split("?")[0].endswith("/mirror/repo")]
        roots = [p for m, p in mine if m == "GET" and p.split("?")[0].endswith("/repo/root")]
        resyncs = len(opens)
        assert resyncs >= 2, requests  # several resyncs in the window ...
        # ... each one read of the root (with the mirror marker), no listing, and no read of
        # a journal entry or tag record.
        assert len(roots) <= resyncs + 2, roots
        assert not [p for m, p in mine if m == "GET" and "list-type=2" in p], mine
        assert not [p for _, p in mine if "/refs/" in p.split("?")[0]], mine
        # What else a resync asks: the bucket (HEAD).
        assert len(mine) <= 3 * resyncs + 4, mine
        # Every Branch and Tag was checked by those resyncs, and confirmed.
        assert delta.get(("Branch", "confirmed"), 0) >= 3 * (resyncs - 1), delta
        assert delta.get(("Tag", "confirmed"), 0) >= resyncs - 1, delta
        assert not delta.get(("Branch", "reconciled")) and not delta.get(("Tag", "reconciled"))

        # A commit outside Kubernetes (through the proxy too: its requests are not counted).
        repo = k8s.open_repository()
        head = commit(repo, "b2", 1.0, "moved")
        proxy.requests(clear=True)
        wait_for("status.head follows", lambda: k8s.get("Branch", "b2")["status"]["head"] == head)
        time.sleep(3)
        entries = [p for m, p in proxy.requests() if m == "GET" and "/refs/branch.b2/" in p]
        # Read by the resync that saw the head move and by the Branch's reconcile then (the
        # head and the key after it), and never again while it rests.
        assert len(entries) <= 3, entries


def test_dependents_created_before_their_repository_go_on_when_it_turns_ready(
    k8s: Env,
) -> None:
    """Branches, Tags and RetentionPolicies whose Repository does not exist yet wait for it, and
    their handlers are woken by the watch when it turns Ready (not retried a delay later)."""
    k8s.secret()
    dependents = [("Branch", f"early-{i}") for i in range(3)]
    for _, name in dependents:
        k8s.custom("Branch", name, {"repository": "repo"})
    dependents += [("Tag", "early-tag"), ("RetentionPolicy", "early-policy")]
    k8s.custom("Tag", "early-tag", {"repository": "repo", "ref": "main"})
    k8s.custom(
        "RetentionPolicy", "early-policy", {"repository": "repo", "gc": {"schedule": "@daily"}}
    )
    for kind, name in dependents:
        obj = k8s.wait_condition(kind, name, "Ready", "False")
        assert condition(obj, "Ready")["reason"] == "RepositoryNotFound"
    before = _series(k8s, "zarrlake_operator_repository_waits_total")
    k8s.repository()
    for kind, name in dependents:
        k8s.wait_condition(kind, name)
    after = _series(k8s, "zarrlake_operator_repository_waits_total")
    woken = sum(v - before.get(k, 0) for k, v in after.items() if k[1] == "woken")
    # Each was waiting when the Repository turned Ready, but for the instant between two waits
    # (when its next attempt finds the Repository Ready itself): at least one was woken.
    assert woken >= 1, (before, after)


def test_lists_by_a_field_the_server_cannot_select_on_are_filtered_here(k8s: Env) -> None:
    """The operator asks the API server for one Repository's dependents (a field selector on
    spec.repository, which the CRDs declare selectable); where a server refuses a field (400),
    it lists everything and filters, and keeps doing so without asking again."""
    k8s.secret()
    k8s.custom("Branch", "x", {"repository": "one", "name": "shared"})
    k8s.custom("Branch", "y", {"repository": "two", "name": "shared"})
    k8s.custom("Branch", "z", {"repository": "two", "name": "other"})
    asked: list[tuple[str, str]] = []
    # Only this thread's requests: the operator reconciling in its own threads meanwhile (other
    # tests' objects, lock-service checks) is not what these lists asked.
    me = threading.get_ident()

    def observe(verb: str, resource: str) -> None:
        if threading.get_ident() == me:
            asked.append((verb, resource))

    kube.observers.append(observe)
    try:
        by_repo = kube.list_("Branch", k8s.namespace, field=("spec.repository", "two"))
        assert sorted(o["metadata"]["name"] for o in by_repo) == ["y", "z"]
        assert asked == [("GET", "branches")]
        # spec.name is not selectable: the emulated API answers 400, as kube-apiserver does.
        for _ in range(2):
            asked.clear()
            by_name = kube.list_("Branch", k8s.namespace, field=("spec.name", "shared"))
            assert sorted(o["metadata"]["name"] for o in by_name) == ["x", "y"]
        assert asked == [("GET", "branches")]  # the refusal is remembered: one list now
    finally:
        kube.observers.pop()


def test_external_lock_service_is_checked_with_its_password(k8s: Env, tmp_path: Any) -> None:
    from zarrlake_testkit.servers import start_redis, stop

    proc, url = start_redis(tmp_path, None, "--requirepass", "ext-pa$$word")
    try:
        k8s.secret()
        k8s.secret("redis-auth", {"password": "ext-pa$$word"})
        k8s.repository(
            lockService={
                "mode": "external",
                "url": url,
                "passwordSecret": {"name": "redis-auth", "key": "password"},
                "onUnavailable": "fail",
            }
        )
        obj = k8s.wait_condition("Repository", "repo")
        assert condition(obj, "LockServiceReady")["reason"] == "Reachable"
        assert obj["status"]["lockEndpoint"] == url
        repo = k8s.open_repository()
        commit(repo, "main", 5.0, "through the external lock")
        assert k8s.get("Deployment", "zl-repo-lock") is None  # nothing managed

        # A wrong password is reported, not ignored.
        k8s.patch("Secret", "redis-auth", {"stringData": {"password": "wrong"}})
        k8s.patch("Repository", "repo", {"spec": {"lockService": {"url": url + "?x=1"}}})
        obj = k8s.wait_condition("Repository", "repo", "LockServiceReady", "False")
        down = condition(obj, "LockServiceReady")
        # A new endpoint that does not answer (not the loss of the one that did)
        assert down["reason"] == "Unreachable" and "cannot reach" in down["message"]
        # onUnavailable: fail — its clients refuse to commit without it, so it is not Ready
        assert condition(obj, "Ready")["status"] == "False"
        assert "wrong" not in json.dumps(obj)
    finally:
        stop(proc)


def test_a_lock_service_outage_degrades_the_repository_and_blocks_nobody(k8s: Env) -> None:
    """Redis is an optimization: while its pod is down the Repository stays Ready (phase
    Degraded, LockServiceReady=False, one Warning event), new clients connect and commit
    optimistically, Branches get made. When a new, empty Redis is back, the first locked commit
    re-seeds the fencing counter above the journal's tokens."""
    k8s.ready_repository(lock="managed")
    repo = k8s.open_repository()
    commit(repo, "main", 1.0, "with the lock")
    token_before = repo.core.journal.current("main").token
    assert token_before is not None

    with k8s.cluster.outage(k8s.namespace, "zl-repo-lock"):
        obj = k8s.wait_condition("Repository", "repo", "LockServiceReady", "False")
        ready = condition(obj, "Ready")
        assert ready["status"] == "True" and ready["reason"] == "LockServiceUnavailable"
        assert obj["status"]["phase"] == "Degraded"
        assert condition(obj, "LockServiceReady")["reason"] == "Lost"
        wait_for("the Warning event", lambda: "LockServiceUnavailable" in k8s.event_reasons())
        warning = next(e for e in k8s.events() if e.get("reason") == "LockServiceUnavailable")
        assert warning["type"] == "Warning"

        fresh = k8s.open_repository()  # a new client is not refused
        commit(fresh, "main", 2.0, "optimistic, while Redis is down")
        assert fresh.core.journal.current("main").token is None
        k8s.custom("Branch", "during-outage", {"repository": "repo"})
        k8s.wait_condition("Branch", "during-outage")

    obj = k8s.wait_condition("Repository", "repo", "LockServiceReady", "True")
    assert obj["status"]["phase"] == "Ready"
    wait_for("the recovery event", lambda: "LockServiceRecovered" in k8s.event_reasons())
    assert sum(e.get("reason") == "LockServiceUnavailable" for e in k8s.events()) == 1

    again = k8s.open_repository()
    commit(again, "main", 3.0, "locked again, by a new Redis")
    token_after = again.core.journal.current("main").token
    assert token_after is not None and token_after > token_before
    assert [c.message for c in again.log()][:3] == [
        "locked again, by a new Redis",
        "optimistic, while Redis is down",
        "with the lock",
    ]


def test_tag_spec_changes_do_not_move_the_tag(k8s: Env) -> None:
    k8s.ready_repository()
    repo = k8s.open_repository()
    first = commit(repo, "main", 1.0, "one")
    k8s.custom("Branch", "other", {"repository": "repo"})
    k8s.wait_condition("Branch", "other")
    second = commit(repo, "other", 2.0, "two")
    k8s.custom("Tag", "t", {"repository": "repo", "ref": "main"})
    tagged = k8s.wait_condition("Tag", "t")
    assert tagged["status"]["snapshot"] == first
    # The CRD's CEL transition rule refuses the change, on a real API server as on the emulated
    # one; the resource and the tag stay as they were.
    with pytest.raises(kube.KubeError) as refused:
        k8s.patch("Tag", "t", {"spec": {"ref": "other"}})
    assert refused.value.status == 422
    assert 'spec.ref: Invalid value: "string": ref is immutable' in str(refused.value)
    after = k8s.get("Tag", "t") or {}
    assert after["spec"]["ref"] == "main"
    assert after["metadata"]["generation"] == tagged["metadata"]["generation"]
    assert after["status"]["snapshot"] == first
    assert repo.lookup_tag("t") == first != second


def test_a_deleted_lock_secret_gets_a_new_password_and_redis_follows(k8s: Env) -> None:
    k8s.ready_repository(lock="managed")
    old = kube.secrets(k8s.namespace)("zl-repo-lock")["password"]
    template = k8s.get("Deployment", "zl-repo-lock")["spec"]["template"]
    k8s.delete("Secret", "zl-repo-lock")

    def new_password() -> str | None:
        secret = kube.get("Secret", k8s.namespace, "zl-repo-lock")
        value = kube.secrets(k8s.namespace)("zl-repo-lock") if secret else None
        return value["password"] if value and value["password"] != old else None

    wait_for("a new password", new_password)
    # The pod template changed with it (a rollout), so Redis runs with the new password...
    wait_for(
        "the Deployment's template follows the Secret",
        lambda: k8s.get("Deployment", "zl-repo-lock")["spec"]["template"] != template,
    )

    # ...and clients that read the Secret now can use the lock.
    def authenticates() -> bool:
        try:
            # Lock fallback would hide a wrong password from a commit: ask Redis directly.
            return bool(k8s.open_repository().lock.client.ping())
        except Exception:
            return False

    wait_for("Redis accepts the new password", authenticates)
    commit(k8s.open_repository(), "main", 7.0, "after the password changed")


def test_two_repositories_on_one_location_the_older_acts(k8s: Env) -> None:
    k8s.secret()
    bucket = k8s.repository("first", reclaim="Delete")
    first = k8s.wait_condition("Repository", "first")
    k8s.create(
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "Repository",
            "metadata": {"name": "second"},
            "spec": {**first["spec"], "reclaimPolicy": "Delete"},
        }
    )
    obj = k8s.wait_condition("Repository", "second", "Conflict", "True")
    assert "'first'" in condition(obj, "Ready")["message"]
    assert obj["status"]["phase"] == "Conflict"
    # Deleting the loser must not delete the winner's data.
    k8s.delete("Repository", "second")
    wait_for("second gone", lambda: k8s.get("Repository", "second") is None)
    assert "repos/first/repo" in keys(k8s, bucket, "repos/first/")
    k8s.wait_condition("Repository", "first")


def test_delete_refuses_a_location_that_holds_another_repository(k8s: Env) -> None:
    import zarrlake

    k8s.secret()
    bucket = k8s.repository(reclaim="Delete")
    k8s.wait_condition("Repository", "repo")
    # Someone replaces the repository at that location with another one behind our back.
    for key in keys(k8s, bucket, "repos/repo/"):
        s3(k8s).delete_object(Bucket=bucket, Key=key)
    storage = zarrlake.Storage.s3(
        bucket,
        "repos/repo",
        endpoint_url=k8s.s3_endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        allow_http=True,
    )
    other = zarrlake.Repository.create(storage)
    # The resource keeps meaning its own repository: the newcomer is reported, not adopted. (A
    # resync between the deletes and the create reports RepositoryMissing first: wait past it.)
    obj = wait_for(
        "Initialized=False for RepositoryReplaced",
        lambda: (
            o
            if condition(o := k8s.get("Repository", "repo"), "Initialized").get("reason")
            == "RepositoryReplaced"
            else None
        ),
    )
    assert condition(obj, "Initialized")["status"] == "False"
    assert other.id in condition(obj, "Initialized")["message"]
    assert obj["status"]["repositoryID"] != other.id
    k8s.delete("Repository", "repo")
    wait_for("the resource is released", lambda: k8s.get("Repository", "repo") is None)
    assert zarrlake.Repository.open(storage).id == other.id  # untouched
    warnings = wait_for(
        "a ReclaimFailed event",
        lambda: [e for e in k8s.events() if e.get("reason") == "ReclaimFailed"],
    )
    assert other.id in warnings[0]["message"]


def test_a_repository_deleted_behind_the_operators_back_is_not_recreated_empty(k8s: Env) -> None:
    import zarrlake

    k8s.secret()
    bucket = k8s.repository()
    recorded = k8s.wait_condition("Repository", "repo")["status"]["repositoryID"]
    for key in keys(k8s, bucket, "repos/repo/"):
        s3(k8s).delete_object(Bucket=bucket, Key=key)
    obj = k8s.wait_condition("Repository", "repo", "Initialized", "False")
    assert condition(obj, "Initialized")["reason"] == "RepositoryMissing"
    assert recorded in condition(obj, "Initialized")["message"]
    assert condition(obj, "Ready")["status"] == "False"
    assert keys(k8s, bucket, "repos/repo/") == []  # nothing created in its place
    with pytest.raises(zarrlake.KubernetesError, match="is gone from"):
        k8s.open_repository()  # clients are told why, instead of finding an empty repository


def test_a_bucket_deleted_behind_the_operators_back_is_reported(k8s: Env) -> None:
    """A resync reads the repository first and checks the bucket only when that fails: a bucket
    deleted under a Ready repository is still reported as the bucket missing."""
    k8s.secret()
    bucket = f"zl-{k8s.namespace}-gone"
    s3(k8s).create_bucket(Bucket=bucket)
    k8s.repository(bucket=bucket, provision=False)
    k8s.wait_condition("Repository", "repo")
    time.sleep(2)  # a resync or two of the Ready repository
    for key in keys(k8s, bucket, ""):
        s3(k8s).delete_object(Bucket=bucket, Key=key)
    s3(k8s).delete_bucket(Bucket=bucket)
    obj = k8s.wait_condition("Repository", "repo", "BucketReady", "False")
    assert condition(obj, "BucketReady")["reason"] == "BucketNotFound"
    assert condition(obj, "Ready")["status"] == "False"
    s3(k8s).create_bucket(Bucket=bucket)  # back, but empty: the repository is missing
    obj = k8s.wait_condition("Repository", "repo", "Initialized", "False")
    assert condition(obj, "Initialized")["reason"] == "RepositoryMissing"
    assert condition(obj, "BucketReady")["status"] == "True"


def test_branches_and_tags_go_with_their_repository_and_retain_keeps_the_refs(k8s: Env) -> None:
    """Branch and Tag resources are dependents of their Repository resource: deleting it takes
    them along (nothing left behind saying RepositoryNotFound); with reclaimPolicy Retain the
    branch and tag stay in the data, as the policy says."""
    k8s.ready_repository()
    repo = k8s.open_repository()
    commit(repo, "main", 1.0, "one")
    k8s.custom("Branch", "dev", {"repository": "repo"})
    k8s.custom("Tag", "v1", {"repository": "repo", "ref": "main"})
    uid = k8s.get("Repository", "repo")["metadata"]["uid"]
    for kind, name in (("Branch", "dev"), ("Tag", "v1")):
        k8s.wait_condition(kind, name)
        wait_for(
            f"{kind} owned",
            lambda k=kind, n=name: (
                (o := k8s.get(k, n))
                and any(r["uid"] == uid for r in o["metadata"].get("ownerReferences") or [])
                and o
            ),
        )
    k8s.delete("Repository", "repo")
    wait_for(
        "Branch and Tag resources gone",
        lambda: k8s.get("Branch", "dev") is None and k8s.get("Tag", "v1") is None,
    )
    assert "dev" in repo.list_branches() and "v1" in repo.list_tags()  # Retain: the data stays


def test_delete_works_without_the_lock_secret_and_dependents_pause(k8s: Env) -> None:
    k8s.secret()
    bucket = k8s.repository(lock="managed", reclaim="Delete")
    k8s.wait_condition("Repository", "repo")
    k8s.custom("RetentionPolicy", "p", {"repository": "repo", "gc": {"schedule": "@daily"}})
    cron = k8s.wait_condition("RetentionPolicy", "p")["status"]["gcCronJob"]
    # As in a namespace deletion: the lock Secret can vanish before the Repository is handled.
    k8s.delete("Secret", "zl-repo-lock")
    k8s.delete("Repository", "repo")
    wait_for("the Repository is gone", lambda: k8s.get("Repository", "repo") is None)
    assert keys(k8s, bucket, "repos/repo/") == []
    # Its RetentionPolicy's jobs could only fail now: they are suspended, and it says why.
    wait_for("CronJob suspended", lambda: k8s.get("CronJob", cron)["spec"]["suspend"] is True)
    obj = k8s.wait_condition("RetentionPolicy", "p", "Ready", "False")
    assert condition(obj, "Ready")["reason"] == "RepositoryNotFound"


def test_cron_job_drift_is_corrected_and_policy_deletion_removes_them(k8s: Env) -> None:
    k8s.ready_repository()
    k8s.custom("RetentionPolicy", "p", {"repository": "repo", "gc": {"schedule": "@daily"}})
    cron = k8s.wait_condition("RetentionPolicy", "p")["status"]["gcCronJob"]
    k8s.patch("CronJob", cron, {"spec": {"schedule": "* * * * *", "concurrencyPolicy": "Allow"}})
    wait_for(
        "the CronJob restored",
        lambda: (
            (c := k8s.get("CronJob", cron))["spec"]["schedule"] == "@daily"
            and c["spec"]["concurrencyPolicy"] == "Forbid"
        ),
    )
    k8s.delete("RetentionPolicy", "p")
    wait_for("CronJob collected with its owner", lambda: k8s.get("CronJob", cron) is None)


def test_a_tag_deleted_outside_kubernetes_is_reported(k8s: Env) -> None:
    k8s.ready_repository()
    repo = k8s.open_repository()
    commit(repo, "main", 1.0, "one")
    k8s.custom("Tag", "v1", {"repository": "repo", "ref": "main"})
    k8s.wait_condition("Tag", "v1")
    repo.delete_tag("v1")
    obj = k8s.wait_condition("Tag", "v1", "Ready", "False")
    assert condition(obj, "Ready")["reason"] == "TagDeleted"
    assert "never reused" in condition(obj, "Ready")["message"]


def test_from_kubernetes_logs_no_secret_even_at_debug(
    k8s: Env, caplog: pytest.LogCaptureFixture
) -> None:
    import zarrlake

    k8s.ready_repository(lock="managed")
    with caplog.at_level(logging.DEBUG):
        repo = k8s.open_repository()
    assert repo.lock is not None
    password = kube.secrets(k8s.namespace)("zl-repo-lock")["password"]
    # The secret key and the password never; the access key *id* does appear in botocore's own
    # DEBUG lines (the signed Authorization header), as with any boto3 client.
    assert "kubernetes.client.rest" in caplog.text  # the client did log at DEBUG
    for value in (CREDENTIALS["AWS_SECRET_ACCESS_KEY"], password):
        for form in (value, base64.b64encode(value.encode()).decode()):
            assert form not in caplog.text
    with pytest.raises(zarrlake.KubernetesError, match="not found"):
        zarrlake.Repository.from_kubernetes("no-such-repository", k8s.namespace)


# -- RetentionPolicy with engine: spark --


@pytest.mark.spark
def test_spark_engine_objects_follow_the_cluster_and_their_reports_reach_the_status(
    k8s: Env,
) -> None:
    """engine: spark without the Spark operator: a spark-submit CronJob and the driver's RBAC;
    its Job runs (spark-submit, master local[2] here) and the report lands in lastGC. With the
    Spark operator's CRDs: a ScheduledSparkApplication instead, whose driver's report lands
    there too. Back to local: every Spark object goes."""
    from zarrlake_testkit.emulated import (
        install_spark_operator_crds,
        remove_spark_operator_crds,
        run_spark_application,
    )

    # Chunks as objects (the engine setting, through the resource): compaction packs them.
    k8s.ready_repository(config={"packChunksBelowBytes": 0})
    repo = k8s.open_repository()
    assert repo.config.pack_chunks_below_bytes == 0
    for v in (1.0, 2.0, 3.0):
        commit(repo, "main", v, f"fill {v}")
    spec = {
        "repository": "repo",
        "rules": {"default": {"last": 1}},
        "gc": {"schedule": "0 3 * * *", "grace": "0s", "force": True},
        "compaction": {"schedule": "0 4 * * *", "branch": "main"},
        "engine": "spark",
        "spark": {"executorInstances": 3, "image": "registry.example/zarrlake-spark:1"},
    }
    k8s.custom("RetentionPolicy", "sp", spec)
    obj = k8s.wait_condition("RetentionPolicy", "sp")
    assert obj["status"]["engine"] == "spark-submit"
    cron = k8s.get("CronJob", obj["status"]["gcCronJob"])
    assert cron is not None and obj["status"]["gcCronJob"] == "zl-sp-gc-spark"
    assert k8s.get("CronJob", "zl-sp-gc") is None
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "zl-sp-spark"
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert k8s.get(kind, "zl-sp-spark") is not None, kind
    command = pod["containers"][0]["command"]
    assert command[0] == desired.SPARK_SUBMIT and "--engine" in command
    assert f"spark.kubernetes.container.image={spec['spark']['image']}" in command

    # Its Job, as the CronJob would start it: the emulated kubelet runs the container's command.
    template = cron["spec"]["jobTemplate"]
    k8s.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "gc-spark-manual", "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )
    obj = wait_for(
        "lastGC from the spark-submit Job",
        lambda: (o := k8s.get("RetentionPolicy", "sp"))["status"].get("lastGC") and o,
        600,  # spark-submit starts a JVM
    )
    last = obj["status"]["lastGC"]
    ran = next(j for j in k8s.cluster.job_log if j["job"] == "gc-spark-manual")
    assert last["result"] == "Succeeded", (last, ran["logs"][-3000:])
    assert "local[2]" in ran["command"] and "spark" in ran["command"]
    assert last["job"] == "gc-spark-manual"
    assert last["snapshotsExpired"] == 3
    assert last["objectsDeleted"] > 0 and last["bytesFreed"] > 0
    assert np.all(zarr.open_array(repo.readonly_session("main").store, path="a")[:] == 3.0)
    assert repo.fsck().ok

    # The compaction's spark-submit Job: its tasks pack and re-cut, its report reaches the status.
    session = repo.writable_session("main")
    noise = np.random.default_rng(7).random((256, 64), dtype="float32")
    zarr.create_array(session.store, name="noise", shape=noise.shape, chunks=(16, 64), dtype="f4")[
        :
    ] = noise  # 16 chunk objects of 4 KiB: small enough to pack
    session.commit("16 small chunks")
    obj = k8s.get("RetentionPolicy", "sp")
    compaction = k8s.get("CronJob", obj["status"]["compactionCronJob"])
    assert compaction is not None
    command = compaction["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert "compact" in command and command[command.index("--engine") + 1] == "spark"
    k8s.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": "compact-spark-manual",
                "labels": compaction["spec"]["jobTemplate"]["metadata"]["labels"],
            },
            "spec": compaction["spec"]["jobTemplate"]["spec"],
        }
    )
    obj = wait_for(
        "lastCompaction from the spark-submit Job",
        lambda: (o := k8s.get("RetentionPolicy", "sp"))["status"].get("lastCompaction") and o,
        600,
    )
    last = obj["status"]["lastCompaction"]
    ran = next(j for j in k8s.cluster.job_log if j["job"] == "compact-spark-manual")
    assert last["result"] == "Succeeded", (last, ran["logs"][-3000:])
    assert last["chunksPacked"] == 16
    assert next(iter(repo.log(limit=1))).message.startswith("Compaction")
    np.testing.assert_array_equal(
        zarr.open_array(repo.readonly_session("main").store, path="noise")[:], noise
    )
    assert np.all(zarr.open_array(repo.readonly_session("main").store, path="a")[:] == 3.0)
    assert repo.fsck().ok

    install_spark_operator_crds()
    try:
        obj = wait_for(
            "the ScheduledSparkApplication",
            lambda: (
                (o := k8s.get("RetentionPolicy", "sp"))["status"].get("engine") == "spark-operator"
                and o
            ),
        )
        name = obj["status"]["gcSparkApplication"]
        assert "gcCronJob" not in obj["status"]
        app = kube.get("ScheduledSparkApplication", k8s.namespace, name)
        assert app is not None
        assert app["spec"]["template"]["executor"]["instances"] == 3
        assert app["spec"]["template"]["driver"]["serviceAccount"] == "zl-sp-spark"
        wait_for(
            "the spark-submit CronJob removed", lambda: k8s.get("CronJob", "zl-sp-gc-spark") is None
        )

        # One run of it: the driver's report reaches the status through the driver pod.
        commit(repo, "main", 4.0, "fill 4")
        driver = run_spark_application(app, k8s.cluster.workdir)
        assert driver["status"]["phase"] == "Succeeded", driver["logs"][-3000:]
        run_name = driver["metadata"]["labels"]["sparkoperator.k8s.io/app-name"]
        obj = wait_for(
            "lastGC from the driver",
            lambda: (
                (o := k8s.get("RetentionPolicy", "sp"))["status"]["lastGC"]["job"] == run_name and o
            ),
        )
        last = obj["status"]["lastGC"]
        # fill 3, the 16 small chunks and the compaction expire; fill 4 stays
        assert last["result"] == "Succeeded" and last["snapshotsExpired"] == 3
        assert last["objectsDeleted"] > 0
        assert np.all(zarr.open_array(repo.readonly_session("main").store, path="a")[:] == 4.0)

        # Back to local: the Spark objects go, the local CronJob comes.
        k8s.patch("RetentionPolicy", "sp", {"spec": {"engine": "local"}})
        obj = wait_for(
            "engine local",
            lambda: (
                (o := k8s.get("RetentionPolicy", "sp"))["status"].get("engine") == "local" and o
            ),
        )
        assert (
            obj["status"]["gcCronJob"] == "zl-sp-gc" and "gcSparkApplication" not in obj["status"]
        )
        wait_for(
            "Spark objects removed",
            lambda: (
                kube.get("ScheduledSparkApplication", k8s.namespace, name) is None
                and all(
                    k8s.get(k, "zl-sp-spark") is None
                    for k in ("ServiceAccount", "Role", "RoleBinding")
                )
            ),
        )
        assert k8s.get("CronJob", "zl-sp-gc") is not None

        # And deleting a spark policy removes its objects (they are owned by it).
        k8s.patch("RetentionPolicy", "sp", {"spec": {"engine": "spark"}})
        wait_for("spark again", lambda: kube.get("ScheduledSparkApplication", k8s.namespace, name))
        k8s.delete("RetentionPolicy", "sp")
        wait_for(
            "collected with the policy",
            lambda: (
                kube.get("ScheduledSparkApplication", k8s.namespace, name) is None
                and k8s.get("ServiceAccount", "zl-sp-spark") is None
            ),
        )
    finally:
        remove_spark_operator_crds()
