"""The Mirror's pure parts: the replicator Deployment, spec checks, and progress / stall.

Nothing here talks to Kubernetes: dicts in, dicts out (see test_mirror_resource.py for the
operator acting on them).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pydantic
import pytest
from test_desired import (
    ACCESS_KEY,
    LOCK_PASSWORD,
    SECRET_KEY,
    SESSION_TOKEN,
    arg_after,
    repository_body,
    walk,
)

from zarrlake.k8s import storage_connection
from zarrlake_operator import desired
from zarrlake_operator.models import API_VERSION, Mirror, MirrorRefStatus, MirrorSpec

T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.UTC)

MIRROR_SPEC: dict[str, Any] = {
    "repository": "climate",
    "destination": {
        "bucket": "zarrlake-climate-west",
        "prefix": "repos/climate",
        "region": "us-west-2",
        "endpointURL": "https://s3.us-west-2.example.com",
        "credentialsSecret": {"name": "west-s3", "sessionTokenKey": "TOKEN"},
    },
    "branches": ["main", "release/*"],
}


def mirror_body(spec: dict[str, Any] | None = None, name: str = "climate-west") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Mirror",
        "metadata": {"name": name, "namespace": "science", "uid": f"uid-{name}"},
        "spec": spec if spec is not None else MIRROR_SPEC,
    }


def deployment(
    spec: dict[str, Any] | None = None, repository: dict[str, Any] | None = None
) -> dict[str, Any]:
    body = mirror_body(spec)
    model = MirrorSpec.model_validate(body["spec"])
    url = storage_connection(model.destination, None, "test").storage_url
    return desired.replicator_deployment(body, model, repository or repository_body(), url)


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c["env"]}


# -- the Deployment --------------------------------------------------------------------------------


def test_one_replicator_at_a_time_owned_by_the_mirror() -> None:
    dep = deployment()
    assert dep["kind"] == "Deployment" and dep["apiVersion"] == "apps/v1"
    assert dep["metadata"]["name"] == "zl-climate-west-mirror"
    assert dep["metadata"]["namespace"] == "science"
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    (owner,) = dep["metadata"]["ownerReferences"]
    assert owner["kind"] == "Mirror" and owner["uid"] == "uid-climate-west" and owner["controller"]
    # The selector picks exactly the pod template's labels.
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[desired.MIRROR_LABEL] == "climate-west"
    assert pod_labels[desired.REPOSITORY_LABEL] == "climate"
    assert pod_labels["app.kubernetes.io/managed-by"] == desired.MANAGED_BY


def test_replicator_command_names_source_destination_and_options() -> None:
    cmd = container(deployment())["command"]
    assert cmd[:3] == ["zarrlake", "mirror", "run"]
    assert cmd[3] == "s3://zarrlake-climate/repos/climate?region=eu-west-1"  # the source's URL
    assert cmd[4] == (
        "s3://zarrlake-climate-west/repos/climate"
        "?endpoint_url=https%3A%2F%2Fs3.us-west-2.example.com&region=us-west-2"
    )
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--branch"] == ["main", "release/*"]
    assert "--tags" in cmd and "--no-tags" not in cmd
    assert "--copy" in cmd and "--external" not in cmd
    assert arg_after(cmd, "--interval") == "10"
    assert arg_after(cmd, "--metrics-port") == "9102"
    assert "--json" in cmd and "--once" not in cmd
    assert "--gc-every" not in cmd and "--lock" not in cmd  # the lock comes by environment


def test_replicator_command_follows_the_spec() -> None:
    spec = {
        **MIRROR_SPEC,
        "branches": ["*"],
        "tags": False,
        "mode": "external",
        "interval": "1m30s",
        "metricsPort": 9300,
        "gc": {"every": "12h", "grace": "8d"},
    }
    c = container(deployment(spec))
    cmd = c["command"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--branch"] == ["*"]
    assert "--no-tags" in cmd and "--tags" not in cmd
    assert "--external" in cmd and "--copy" not in cmd
    assert arg_after(cmd, "--interval") == "90"
    assert arg_after(cmd, "--metrics-port") == "9300"
    assert arg_after(cmd, "--gc-every") == "12h" and arg_after(cmd, "--gc-grace") == "8d"
    assert c["ports"] == [{"name": "metrics", "containerPort": 9300}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_interval_is_bounded_below() -> None:
    cmd = container(deployment({**MIRROR_SPEC, "interval": "0.2s"}))["command"]
    assert arg_after(cmd, "--interval") == "1"


def test_replicator_env_takes_both_sides_credentials_and_the_lock_by_reference() -> None:
    env = env_of(container(deployment()))
    # The source's keys as the AWS names (the repository example names climate-s3 + TOKEN).
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "climate-s3",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "climate-s3",
        "key": "TOKEN",
        "optional": True,
    }
    # The destination's under their own names.
    assert env["ZARRLAKE_DEST_AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "west-s3",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert env["ZARRLAKE_DEST_AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "west-s3",
        "key": "AWS_SECRET_ACCESS_KEY",
    }
    assert env["ZARRLAKE_DEST_AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "TOKEN"
    # The source repository's managed lock service: one promoter at a time.
    assert env["ZARRLAKE_LOCK"]["value"] == desired.lock_endpoint("climate", "science")
    assert env["ZARRLAKE_LOCK_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": desired.lock_service_names("climate"),
        "key": "password",
    }
    for var in env.values():
        assert ("value" in var) != ("valueFrom" in var), var


def test_replicator_without_secrets_or_lock() -> None:
    repo = repository_body(
        spec={"storage": {"bucket": "zarrlake-climate"}, "lockService": {"mode": "none"}},
        status={"url": "s3://zarrlake-climate", "conditions": []},
    )
    spec = {"repository": "climate", "destination": {"bucket": "zarrlake-west"}}
    c = container(deployment(spec, repo))
    assert c["env"] == []
    assert c["command"][3:5] == ["s3://zarrlake-climate", "s3://zarrlake-west"]


def test_replicator_external_lock_service() -> None:
    repo = repository_body(
        spec={
            "storage": {"bucket": "zarrlake-climate"},
            "lockService": {
                "mode": "external",
                "url": "redis://redis.example:6379/0",
                "passwordSecret": {"name": "redis-pw", "key": "pw"},
            },
        },
        status={"url": "s3://zarrlake-climate", "conditions": []},
    )
    env = env_of(container(deployment(MIRROR_SPEC, repo)))
    assert env["ZARRLAKE_LOCK"]["value"] == "redis://redis.example:6379/0"
    assert env["ZARRLAKE_LOCK_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-pw",
        "key": "pw",
    }


def test_replicator_carries_no_secret_values() -> None:
    text = json.dumps(deployment())
    for value in (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN, LOCK_PASSWORD):
        assert value not in text
    for node in walk(deployment()):
        if isinstance(node, dict) and node.get("name", "").endswith(("_KEY", "_TOKEN", "PASSWORD")):
            assert "valueFrom" in node, node


def test_replicator_pod_is_locked_down() -> None:
    dep = deployment()
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = container(dep)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["image"] == desired.JOB_IMAGE
    assert c["resources"] == desired.DEFAULT_REPLICATOR_RESOURCES


def test_replicator_image_identity_and_resources_overrides() -> None:
    spec = {
        **MIRROR_SPEC,
        "image": "registry.example/zarrlake:dev",
        "serviceAccountName": "mirror-irsa",
        "imagePullSecrets": ["regcred"],
        "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "4Gi"}},
    }
    dep = deployment(spec)
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mirror-irsa"
    assert "automountServiceAccountToken" not in pod
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    c = container(dep)
    assert c["image"] == "registry.example/zarrlake:dev"
    assert c["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "4Gi"}}


def test_replicator_needs_the_source_url() -> None:
    repo = repository_body(status={"conditions": []})
    with pytest.raises(ValueError, match="no URL"):
        deployment(MIRROR_SPEC, repo)


def test_replicator_names_fit_for_long_mirror_names() -> None:
    body = mirror_body(name="m" * 63)
    model = MirrorSpec.model_validate(body["spec"])
    dep = desired.replicator_deployment(body, model, repository_body(), "s3://b")
    assert len(dep["metadata"]["name"]) <= desired.DNS_NAME_MAX
    assert dep["metadata"]["name"] == desired.replicator_name("m" * 63)


# -- the spec --------------------------------------------------------------------------------------


def test_defaults() -> None:
    spec = Mirror.model_validate({"spec": {"repository": "r", "destination": {"bucket": "bkt"}}})
    s = spec.spec
    assert s.branches == ["*"] and s.tags is True and s.mode == "copy"
    assert s.interval == "10s" and s.stalled_after == "10m" and s.reclaim_policy == "Retain"
    assert s.destination.provision is False and s.gc is None


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"mode": "mirror"}, "spec.mode"),
        ({"interval": "soon"}, "spec.interval"),
        ({"stalledAfter": "5 minutes"}, "spec.stalledAfter"),
        ({"branches": []}, "spec.branches"),
        ({"branches": ["main", "bad name"]}, "spec.branches.1"),
        ({"reclaimPolicy": "Recycle"}, "spec.reclaimPolicy"),
        ({"destination": {"bucket": "Bad_Bucket"}}, "spec.destination.bucket"),
        ({"destination": {"prefix": "x"}}, "spec.destination.bucket"),
        ({"metricsPort": 80}, "spec.metricsPort"),
    ],
)
def test_bad_specs_are_refused_readably(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as e:
        Mirror.model_validate({"spec": {**MIRROR_SPEC, **spec}})
    assert field in str(e.value) or field.removeprefix("spec.") in str(e.value)


@pytest.mark.parametrize(
    ("spec", "reason", "words"),
    [
        ({"branches": ["release/[0-9"]}, "InvalidBranchGlob", "'release/[0-9'"),
        ({"interval": "0s"}, "InvalidDuration", "spec.interval"),
        ({"stalledAfter": "0"}, "InvalidDuration", "spec.stalledAfter"),
        ({"gc": {"every": "0m"}}, "InvalidDuration", "spec.gc.every"),
    ],
)
def test_spec_problems_the_schema_cannot_see(spec: dict[str, Any], reason: str, words: str) -> None:
    problem = desired.mirror_spec_problem(MirrorSpec.model_validate({**MIRROR_SPEC, **spec}))
    assert problem is not None
    assert problem.reason == reason and words in problem.message


def test_good_specs_have_no_problem() -> None:
    for spec in ({}, {"branches": ["*", "release/[0-9]*", "v?"], "gc": {}}):
        assert (
            desired.mirror_spec_problem(MirrorSpec.model_validate({**MIRROR_SPEC, **spec})) is None
        )


# -- progress and stall ----------------------------------------------------------------------------


def ref(mirrored: str | None, source: str = "S2", missing: int = 0, behind: int = 0) -> Any:
    return MirrorRefStatus(
        kind="branch",
        name="main",
        sourceHead=source,
        mirroredHead=mirrored,
        commitsBehind=behind,
        missingObjects=missing,
    )


STALL = dt.timedelta(minutes=10)


def iso(t: dt.datetime) -> str:
    return desired.now_iso(t)


def test_the_first_observation_starts_the_clock() -> None:
    h = desired.mirror_health(None, None, [ref("S1", missing=5, behind=1)], STALL, T0)
    assert h.last_progress_time == iso(T0) and not h.stalled
    assert h.behind == ["branch main"] and h.missing_objects == 5 and h.commits_behind == 1


def test_no_progress_for_longer_than_stalled_after_is_a_stall() -> None:
    before = [ref("S1", missing=5, behind=1)]
    later = T0 + STALL + dt.timedelta(seconds=1)
    h = desired.mirror_health(before, iso(T0), [ref("S1", missing=5, behind=1)], STALL, later)
    assert h.stalled and h.last_progress_time == iso(T0) and h.stalled_for == 601
    # Exactly at the limit it is not stalled yet.
    at = desired.mirror_health(before, iso(T0), before, STALL, T0 + STALL)
    assert not at.stalled
    # More missing (the source committed again) is no progress either.
    worse = desired.mirror_health(before, iso(T0), [ref("S1", "S3", 9, 2)], STALL, later)
    assert worse.stalled


@pytest.mark.parametrize(
    "now_refs",
    [
        [ref("S1", missing=4, behind=1)],  # fewer objects missing
        [ref("S2", "S3", missing=5, behind=1)],  # the mirrored head moved
        [ref("S2")],  # caught up
    ],
)
def test_progress_resets_the_clock(now_refs: list[MirrorRefStatus]) -> None:
    later = T0 + STALL * 2
    h = desired.mirror_health([ref("S1", missing=5, behind=1)], iso(T0), now_refs, STALL, later)
    assert h.last_progress_time == iso(later) and not h.stalled


def test_an_idle_mirror_keeps_its_progress_time() -> None:
    later = T0 + STALL * 3
    h = desired.mirror_health([ref("S2")], iso(T0), [ref("S2")], STALL, later)
    assert h.last_progress_time == iso(T0) and not h.stalled and h.behind == []


def test_falling_behind_after_a_quiet_spell_starts_the_clock() -> None:
    later = T0 + STALL * 3
    h = desired.mirror_health([ref("S2")], iso(T0), [ref("S2", "S3", 4, 1)], STALL, later)
    assert h.last_progress_time == iso(later) and not h.stalled
    # ... and it runs from there.
    again = desired.mirror_health(
        [ref("S2", "S3", 4, 1)], iso(later), [ref("S2", "S3", 4, 1)], STALL, later + STALL * 2
    )
    assert again.stalled and again.last_progress_time == iso(later)


def test_conditions_of_a_stalled_mirror_name_the_missing_count() -> None:
    later = T0 + STALL * 2
    before = [ref("S1", missing=7, behind=3)]
    h = desired.mirror_health(before, iso(T0), before, STALL, later)
    conds = desired.mirror_conditions([], h, "10m", generation=4, now=later)
    stalled = desired.condition(conds, "Stalled")
    progressing = desired.condition(conds, "Progressing")
    assert stalled is not None and progressing is not None
    assert (stalled.status, stalled.reason) == ("True", "NoProgress")
    assert "7 object(s) still missing" in stalled.message and "branch main" in stalled.message
    assert "1200s" in stalled.message and "stalledAfter 10m" in stalled.message
    assert (progressing.status, progressing.reason) == ("False", "Stalled")
    assert stalled.observed_generation == 4


def test_conditions_while_catching_up_and_when_up_to_date() -> None:
    h = desired.mirror_health(None, None, [ref("S1", missing=2, behind=1)], STALL, T0)
    conds = desired.mirror_conditions([], h, "10m", now=T0)
    assert desired.is_true(conds, "Progressing") and not desired.is_true(conds, "Stalled")
    p = desired.condition(conds, "Progressing")
    assert p is not None and p.reason == "CatchingUp" and "2 object(s)" in p.message
    done = desired.mirror_health([ref("S1")], iso(T0), [ref("S2")], STALL, T0)
    conds2 = desired.mirror_conditions(conds, done, "10m", now=T0 + STALL)
    for type_ in ("Progressing", "Stalled"):
        c = desired.condition(conds2, type_)
        assert c is not None and c.status == "False" and c.reason == "UpToDate"
    # Stalled stayed False: its transition time did not move.
    assert desired.condition(conds2, "Stalled") == desired.condition(conds, "Stalled").model_copy(
        update={"reason": "UpToDate", "message": "every mirrored ref shows its source's head"}
    )


def test_ref_status_from_the_engine_json() -> None:
    r = desired.mirror_ref_status(
        {
            "kind": "tag",
            "name": "v1",
            "source_head": "A",
            "mirrored_head": None,
            "commits_behind": 1,
            "seconds_behind": 12.7,
            "missing_objects": 3,
            "last_promotion": None,
            "error": None,
        }
    )
    assert r.dump() == {
        "kind": "tag",
        "name": "v1",
        "sourceHead": "A",
        "commitsBehind": 1,
        "secondsBehind": 12,
        "missingObjects": 3,
    }


def test_status_patch_writes_refs_without_nulls() -> None:
    from zarrlake_operator.models import MirrorStatus

    status = MirrorStatus(refs=[ref(None, missing=1, behind=1)], conditions=[])
    patch = status.patch()
    assert patch["refs"] == [
        {
            "kind": "branch",
            "name": "main",
            "sourceHead": "S2",
            "commitsBehind": 1,
            "secondsBehind": 0,
            "missingObjects": 1,
        }
    ]
    assert all(v is not None for r in patch["refs"] for v in r.values())
