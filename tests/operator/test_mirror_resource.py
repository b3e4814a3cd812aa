"""The Mirror resource against the real operator process, the emulated API and two S3 servers.

The source repository lives on the session's moto server, the mirror on a second one (a second
"region"). Nothing in the emulated cluster runs the replicator Deployment, so where a test needs
the replicator it runs the equivalent Python: :class:`zarrlake.mirror.Mirror` built from exactly
the source, destination, options and environment (Secret references resolved as the kubelet
would) that the Deployment's container names, stepped until caught up. The `zarrlake mirror run`
CLI itself is tested with the CLI.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import boto3
import numpy as np
import pytest
import zarr
from k8s_env import CREDENTIALS, Env, condition, wait_for

import zarrlake
from cli_helpers import CHUNK, commit_random
from zarrlake_operator import kube
from zarrlake_testkit import emulated
from zarrlake_testkit.servers import start_moto, stop

WEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIAZLWESTKEY0000002", "AWS_SECRET_ACCESS_KEY": "w3st-s"}


@pytest.fixture(scope="module")
def west() -> Iterator[str]:
    """A second S3 API server: the mirror's region."""
    proc, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        stop(proc)


def apply_mirror(
    env: Env, west: str, name: str = "west", *, bucket: str | None = None, **spec: Any
) -> str:
    """A Mirror of Repository ``repo`` on the second server; returns its bucket."""
    if env.get("Secret", "west-creds") is None:
        env.secret("west-creds", WEST_CREDENTIALS)
    bucket = bucket or f"zl-{env.namespace}-{name}"
    destination = {
        "bucket": bucket,
        "prefix": "mirrors/repo",
        "endpointURL": west,
        "region": "us-west-2",
        "credentialsSecret": {"name": "west-creds"},
        "provision": True,
    }
    env.custom(
        "Mirror",
        name,
        {"repository": "repo", "destination": destination, "interval": "1s", **spec},
    )
    return bucket


def replicator(env: Env, name: str = "west") -> dict[str, Any]:
    return wait_for(
        f"the replicator Deployment of Mirror {name}",
        lambda: env.get("Deployment", f"zl-{name}-mirror"),
    )


class Replicator:
    """What the Deployment's container runs, in this process (see
    :func:`zarrlake_testkit.emulated.replicator`)."""

    def __init__(self, deployment: dict[str, Any], *, copy: bool | None = None) -> None:
        self.promoter = emulated.replicator(deployment, copy=copy)
        self.destination = self.promoter.destination

    def catch_up(self, passes: int = 20) -> Any:
        for _ in range(passes):
            status = self.promoter.step()
            if status.up_to_date:
                return status
        raise AssertionError(f"not caught up after {passes} passes: {status.to_json()}")


def refs_of(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in ((obj or {}).get("status") or {}).get("refs") or []}


def bucket_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-west-2",
        aws_access_key_id="x",
        aws_secret_access_key="y",
    )
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


# -- the replicator --------------------------------------------------------------------------------


def test_mirror_runs_one_replicator_and_its_status_catches_up(k8s: Env, west: str) -> None:
    k8s.ready_repository("repo")
    source = k8s.open_repository("repo")
    commit_random(source, 0)
    bucket = apply_mirror(k8s, west, branches=["main", "exp*"])

    dep = replicator(k8s)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    (owner,) = dep["metadata"]["ownerReferences"]
    mirror_obj = k8s.get("Mirror", "west") or {}
    assert owner["kind"] == "Mirror" and owner["uid"] == mirror_obj["metadata"]["uid"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    cmd = c["command"]
    repo_url = (k8s.get("Repository", "repo") or {})["status"]["url"]
    assert cmd[:5] == [
        "zarrlake",
        "mirror",
        "run",
        repo_url,
        f"s3://{bucket}/mirrors/repo?endpoint_url={west.replace(':', '%3A').replace('/', '%2F')}"
        "&region=us-west-2",
    ]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--branch"] == ["main", "exp*"]
    assert {"--tags", "--copy", "--json"} <= set(cmd)
    assert cmd[cmd.index("--interval") + 1] == "1"
    names = {e["name"]: e for e in c["env"]}
    assert names["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert names["ZARRLAKE_DEST_AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == (
        "west-creds"
    )
    # No credential value anywhere in the Deployment.
    text = json.dumps(dep)
    for value in [*CREDENTIALS.values(), *WEST_CREDENTIALS.values()]:
        assert value not in text

    # Before the replicator's first pass the destination is not a mirror yet.
    waiting = k8s.wait_condition("Mirror", "west", status="False")
    assert condition(waiting, "Ready")["reason"] == "WaitingForReplicator"
    assert "BucketCreated" in k8s.event_reasons()  # provision: true made the bucket

    # The container's own command, as a process, with the environment the pod would get.
    for _ in range(5):
        status = emulated.run_replicator_pass(dep)
        if all(r["source_head"] == r["mirrored_head"] for r in status["refs"]):
            break
    refs = {(r["kind"], r["name"]): r for r in status["refs"]}
    assert refs[("branch", "main")]["mirrored_head"] == source.lookup_branch("main"), status
    run = Replicator(dep)
    head = source.lookup_branch("main")
    done = k8s.wait_condition("Mirror", "west")
    assert condition(done, "Ready")["reason"] == "Mirroring"

    def caught_up() -> Any:
        obj = k8s.get("Mirror", "west")
        main = refs_of(obj).get("main") or {}
        return obj if main.get("mirroredHead") == head else None

    obj = wait_for("status.refs to show main mirrored", caught_up)
    main = refs_of(obj)["main"]
    assert main["sourceHead"] == head and main["commitsBehind"] == 0
    assert main["missingObjects"] == 0 and main["kind"] == "branch"
    assert obj["status"]["destination"].startswith(f"s3://{bucket}/mirrors/repo")
    assert obj["status"]["commitsBehind"] == 0
    assert obj["status"]["repositoryID"] == source.id
    k8s.wait_condition("Mirror", "west", "Progressing", "False")

    # The source moves on: the mirror is behind, and says so, until the replicator catches up.
    commit_random(source, 1)
    new_head = source.lookup_branch("main")
    behind = k8s.wait_condition("Mirror", "west", "Progressing", "True")
    assert condition(behind, "Progressing")["reason"] == "CatchingUp"
    lagging = refs_of(behind)["main"]
    assert lagging["sourceHead"] == new_head and lagging["mirroredHead"] == head
    assert lagging["commitsBehind"] == 1 and lagging["missingObjects"] > 0
    assert condition(behind, "Stalled")["status"] == "False"
    run.catch_up()
    wait_for(
        "main mirrored at the new head",
        lambda: refs_of(k8s.get("Mirror", "west"))["main"]["mirroredHead"] == new_head,
    )
    up = k8s.wait_condition("Mirror", "west", "Progressing", "False")
    assert condition(up, "Progressing")["reason"] == "UpToDate"
    # Observed every second (the status above moved with no spec change: only the timer does
    # that), yet an idle mirror's status is not rewritten: the object stays as it is.
    version = up["metadata"]["resourceVersion"]
    time.sleep(4)
    idle = k8s.get("Mirror", "west") or {}
    assert idle["metadata"]["resourceVersion"] == version, idle.get("status")

    # The data, read at the destination like any repository.
    mirror_repo = zarrlake.Repository.open(run.destination)
    arr = zarr.open_array(mirror_repo.readonly_session("main").store, path="a", mode="r")
    expected = np.random.default_rng(1).random(4 * CHUNK)
    np.testing.assert_array_equal(arr[:], expected)


def test_replicator_takes_the_managed_lock_service(k8s: Env, west: str) -> None:
    repo = k8s.ready_repository("repo", lock="managed")
    apply_mirror(k8s, west)
    (c,) = replicator(k8s)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["ZARRLAKE_LOCK"]["value"] == repo["status"]["lockEndpoint"]
    assert env["ZARRLAKE_LOCK_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": repo["status"]["lockSecret"],
        "key": "password",
    }


def test_replicator_drift_is_corrected(k8s: Env, west: str) -> None:
    k8s.ready_repository("repo")
    apply_mirror(k8s, west)
    replicator(k8s)
    k8s.patch("Deployment", "zl-west-mirror", {"spec": {"replicas": 3}})
    wait_for(
        "the replicator back at one replica",
        lambda: (k8s.get("Deployment", "zl-west-mirror") or {})["spec"]["replicas"] == 1,
    )


# -- stall ----------------------------------------------------------------------------------------


def test_a_mirror_where_nothing_promotes_goes_stalled_with_the_missing_count(
    k8s: Env, west: str
) -> None:
    k8s.ready_repository("repo")
    source = k8s.open_repository("repo")
    commit_random(source, 0)
    apply_mirror(k8s, west, mode="external", stalledAfter="3s")
    dep = replicator(k8s)
    assert "--external" in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    # One pass of an external-mode promoter makes the destination a mirror; no object ever
    # arrives (no bucket replication here), so nothing is promoted.
    stuck = Replicator(dep)
    first = stuck.promoter.step()
    missing = first.ref("main").missing_objects
    assert missing > 0 and first.ref("main").mirrored_head is None

    stalled = k8s.wait_condition("Mirror", "west", "Stalled", "True")
    message = condition(stalled, "Stalled")["message"]
    assert condition(stalled, "Stalled")["reason"] == "NoProgress"
    assert f"{missing} object(s) still missing at the destination" in message
    assert "stalledAfter 3s" in message and "branch main" in message
    assert condition(stalled, "Progressing")["status"] == "False"
    assert condition(stalled, "Ready")["status"] == "True"  # deployed, and a mirror
    assert stalled["status"]["missingObjects"] == missing

    # The objects arrive (here: the copier) and the mirror recovers.
    Replicator(dep, copy=True).catch_up()
    recovered = k8s.wait_condition("Mirror", "west", "Stalled", "False")
    assert condition(recovered, "Stalled")["reason"] == "UpToDate"


# -- bad specs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"mode": "mirror"}, 'spec.mode: Unsupported value: "mirror"'),
        ({"stalledAfter": "soon"}, 'spec.stalledAfter: Invalid value: "soon"'),
    ],
)
def test_specs_the_schema_refuses_never_reach_the_operator(
    k8s: Env, west: str, spec: dict[str, Any], words: str
) -> None:
    k8s.ready_repository("repo")
    with pytest.raises(kube.KubeError) as refused:
        apply_mirror(k8s, west, "bad", **spec)
    assert refused.value.status == 422
    assert 'Mirror.zarrlake.io "bad" is invalid' in str(refused.value)
    assert words in str(refused.value)
    assert k8s.get("Mirror", "bad") is None
    assert k8s.get("Deployment", "zl-bad-mirror") is None


@pytest.mark.parametrize(
    ("spec", "reason", "words"),
    [
        ({"repository": "nope"}, "RepositoryNotFound", "Repository 'nope' does not exist"),
        ({"branches": ["main", "rel[ease"]}, "InvalidBranchGlob", "'rel[ease'"),
        ({"interval": "0s"}, "InvalidDuration", "spec.interval"),
    ],
)
def test_bad_specs_get_a_precise_reason_and_no_replicator(
    k8s: Env, west: str, spec: dict[str, Any], reason: str, words: str
) -> None:
    k8s.ready_repository("repo")
    apply_mirror(k8s, west, "bad", **spec)
    obj = k8s.wait_condition("Mirror", "bad", status="False")
    ready = condition(obj, "Ready")
    assert ready["reason"] == reason, ready
    assert words in ready["message"], ready
    assert k8s.get("Deployment", "zl-bad-mirror") is None
    # Kopf records the outcome in annotations of its own (the spec it handled after a permanent
    # failure, the retry it scheduled after a temporary one): a write that may land after the
    # condition did on a loaded machine. Compare from there on.
    obj = wait_for(
        "the operator's record of the handler's outcome",
        lambda: (
            (o := k8s.get("Mirror", "bad"))
            and any(a.startswith("zarrlake.io/") for a in o["metadata"].get("annotations") or {})
            and o
        ),
    )
    # Looked at again every interval, but a reason that stays the same is not rewritten.
    time.sleep(2.5)
    again = k8s.get("Mirror", "bad") or {}
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]
    assert k8s.get("Deployment", "zl-bad-mirror") is None


def test_a_destination_equal_to_the_source_is_refused(k8s: Env, west: str) -> None:
    repo = k8s.ready_repository("repo")
    storage = repo["spec"]["storage"]
    k8s.custom(
        "Mirror",
        "self",
        {
            "repository": "repo",
            "destination": {
                "bucket": storage["bucket"],
                "prefix": storage["prefix"],
                "endpointURL": storage["endpointURL"],
                "credentialsSecret": {"name": "s3-creds"},
            },
        },
    )
    obj = k8s.wait_condition("Mirror", "self", status="False")
    ready = condition(obj, "Ready")
    assert ready["reason"] == "DestinationIsSource"
    assert "Repository 'repo'" in ready["message"]
    assert k8s.get("Deployment", "zl-self-mirror") is None


def test_a_destination_equal_to_a_source_that_is_not_ready_is_refused_at_once(
    k8s: Env, west: str
) -> None:
    """The Repository's own spec says it: waiting for it to be Ready (here it never is: its
    bucket is missing and not to be provisioned) would change nothing."""
    k8s.secret()
    bucket = k8s.repository("stuck", bucket=f"zl-{k8s.namespace}-absent", provision=False)
    k8s.custom(
        "Mirror",
        "onto-itself",
        {
            "repository": "stuck",
            "destination": {
                "bucket": bucket,
                "prefix": "repos/stuck",
                "endpointURL": k8s.s3_endpoint,
                "credentialsSecret": {"name": "s3-creds"},
            },
        },
    )
    obj = k8s.wait_condition("Mirror", "onto-itself", status="False")
    ready = condition(obj, "Ready")
    assert ready["reason"] == "DestinationIsSource", ready
    assert condition(k8s.get("Repository", "stuck"), "Ready").get("status") != "True"
    assert k8s.get("Deployment", "zl-onto-itself-mirror") is None


# -- deletion --------------------------------------------------------------------------------------


def mirrored(k8s: Env, west: str, name: str, reclaim: str) -> tuple[str, Replicator]:
    """A Repository with a commit and a caught-up Mirror of it; returns its bucket."""
    if k8s.get("Repository", "repo") is None:
        k8s.ready_repository("repo")
        commit_random(k8s.open_repository("repo"), 0)
    bucket = apply_mirror(k8s, west, name, reclaimPolicy=reclaim)
    run = Replicator(replicator(k8s, name))
    run.catch_up()
    k8s.wait_condition("Mirror", name)
    return bucket, run


def test_deleting_a_mirror_stops_the_replicator_and_retains_the_data(k8s: Env, west: str) -> None:
    bucket, run = mirrored(k8s, west, "keep", "Retain")
    before = bucket_keys(west, bucket, "mirrors/repo/")
    assert "mirrors/repo/mirror/repo" in before
    k8s.delete("Mirror", "keep")
    wait_for("the Mirror gone", lambda: k8s.get("Mirror", "keep") is None)
    wait_for("the replicator gone", lambda: k8s.get("Deployment", "zl-keep-mirror") is None)
    assert bucket_keys(west, bucket, "mirrors/repo/") == before
    # Still a readable mirror.
    assert zarrlake.Repository.open(run.destination).lookup_branch("main")


def test_deleting_a_mirror_with_reclaim_delete_removes_its_objects(k8s: Env, west: str) -> None:
    bucket, _ = mirrored(k8s, west, "drop", "Delete")
    s3 = boto3.client(
        "s3",
        endpoint_url=west,
        region_name="us-west-2",
        aws_access_key_id="x",
        aws_secret_access_key="y",
    )
    s3.put_object(Bucket=bucket, Key="mirrors/repo/not-zarrlake.txt", Body=b"keep me")
    assert len(bucket_keys(west, bucket, "mirrors/repo/")) > 2
    k8s.delete("Mirror", "drop")
    wait_for("the Mirror gone", lambda: k8s.get("Mirror", "drop") is None)
    assert k8s.get("Deployment", "zl-drop-mirror") is None
    # Only the mirror's own objects went; the source is untouched.
    assert bucket_keys(west, bucket, "mirrors/repo/") == ["mirrors/repo/not-zarrlake.txt"]
    assert k8s.open_repository("repo").lookup_branch("main")
