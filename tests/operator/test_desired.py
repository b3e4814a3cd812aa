"""The operator's pure parts: ``desired`` (what should exist, from a spec and observed state),
``models`` (the custom resources) and ``crds`` (the CRDs generated from them).

Nothing here talks to Kubernetes: the functions under test take dicts and return dicts. Where a
maintenance Job's output matters, the real ``zarrlake`` CLI produces it from a real repository in a
local directory, running exactly the command and environment the generated CronJob carries.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest
import yaml
from pydantic import ValidationError

import zarrlake
from cli_helpers import commit_random
from zarrlake.cli import main as cli_main
from zarrlake.maintenance import RetentionRules
from zarrlake_operator import crds, desired
from zarrlake_operator.models import (
    API_VERSION,
    KINDS,
    Branch,
    Condition,
    JobRun,
    Mirror,
    Repository,
    RepositorySpec,
    RepositoryStatus,
    RetentionPolicy,
    RetentionPolicySpec,
    Tag,
)

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names
T0 = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)

# Values that live only in Secrets; none may show up in a generated object.
ACCESS_KEY = "AKIA-ACCESS-KEY-VALUE-1234"
SECRET_KEY = "s3cr3t-Access-Key/Value+XYZ"
SESSION_TOKEN = "session-token-value-987"
LOCK_PASSWORD = "lock-password-value-!@#"
SECRET_VALUES = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN, LOCK_PASSWORD)


# -- fixtures and helpers -------------------------------------------------------------------------


def repository_body(
    name: str = "climate",
    *,
    spec: dict[str, Any] | None = None,
    status: dict[str, Any] | None = None,
    namespace: str = "science",
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Repository",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "generation": 2,
            "creationTimestamp": "2024-05-01T10:00:00Z",
        },
        "spec": spec
        if spec is not None
        else {
            "storage": {
                "bucket": "zarrlake-climate",
                "prefix": "repos/climate",
                "region": "eu-west-1",
                "credentialsSecret": {"name": "climate-s3", "sessionTokenKey": "TOKEN"},
            },
            "lockService": {"mode": "managed"},
        },
        "status": status
        if status is not None
        else {
            "url": "s3://zarrlake-climate/repos/climate?region=eu-west-1",
            "lockEndpoint": desired.lock_endpoint(name, namespace),
            "lockSecret": desired.lock_service_names(name),
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}],
        },
    }


def policy_body(spec: dict[str, Any], name: str = "climate-retention") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "RetentionPolicy",
        "metadata": {"name": name, "namespace": "science", "uid": f"uid-{name}"},
        "spec": spec,
    }


def cron_jobs(
    policy_spec: dict[str, Any], repository: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    body = policy_body(policy_spec)
    spec = RetentionPolicySpec.model_validate(body["spec"])
    return desired.retention_cron_jobs(body, spec, repository or repository_body())


def container(cron_job: dict[str, Any]) -> dict[str, Any]:
    (c,) = cron_job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c["env"]}


def arg_after(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


POLICY_SPEC = {
    "repository": "climate",
    "rules": {"default": {"days": 30}, "branches": {"experiment*": {"last": 10}}},
    "gc": {"schedule": "0 3 * * *", "grace": "10d", "activeDeadlineSeconds": 1800},
    "compaction": {"schedule": "0 4 * * 0", "branch": "main", "activeDeadlineSeconds": 900},
    "successfulJobsHistoryLimit": 5,
    "failedJobsHistoryLimit": 2,
}


# -- set_condition -------------------------------------------------------------------------------


def test_set_condition_adds_a_new_condition() -> None:
    conds = desired.set_condition(
        [], "BucketReady", True, "Provisioned", "ok", generation=4, now=T0
    )
    assert all(isinstance(c, Condition) for c in conds)
    assert [c.dump() for c in conds] == [
        {
            "type": "BucketReady",
            "status": "True",
            "reason": "Provisioned",
            "message": "ok",
            "lastTransitionTime": "2024-05-01T12:00:00Z",
            "observedGeneration": 4,
        }
    ]


def test_set_condition_moves_the_transition_time_only_on_a_status_change() -> None:
    conds = desired.set_condition([], "Ready", False, "Pending", "wait", generation=1, now=T0)
    # Same status, new reason, message and generation: the transition time stays.
    same = desired.set_condition(conds, "Ready", False, "Waiting", "still", generation=2, now=T1)
    assert same[0].last_transition_time == "2024-05-01T12:00:00Z"
    assert (same[0].reason, same[0].message, same[0].observed_generation) == (
        "Waiting",
        "still",
        2,
    )
    # Status changes: it moves.
    flipped = desired.set_condition(same, "Ready", True, "Ready", "done", generation=2, now=T1)
    assert flipped[0].status == "True"
    assert flipped[0].last_transition_time == "2024-05-01T12:05:00Z"
    # A string status is taken as is ("Unknown" included).
    unknown = desired.set_condition(flipped, "Ready", "Unknown", "Lost", now=T1)
    assert unknown[0].status == "Unknown"


def test_set_condition_keeps_other_conditions_in_place() -> None:
    others = [
        Condition.model_validate(c)
        for c in (
            {"type": "BucketReady", "status": "True", "reason": "Provisioned", "extra": "ignored"},
            {"type": "Ready", "status": "False", "reason": "Pending", "lastTransitionTime": "x"},
            {"type": "Initialized", "status": "False", "reason": "Pending"},
        )
    ]
    before = [c.model_copy(deep=True) for c in others]
    out = desired.set_condition(others, "Ready", False, "Pending", now=T1)
    assert [c.type for c in out] == ["BucketReady", "Ready", "Initialized"]
    assert out[0] == others[0] and out[2] == others[2]
    assert out[1].last_transition_time == "x"
    assert "observedGeneration" not in out[1].dump()  # no generation given: none recorded
    # The input is not modified.
    assert others == before
    assert others[1].dump() == {
        "type": "Ready",
        "status": "False",
        "reason": "Pending",
        "message": "",
        "lastTransitionTime": "x",
    }


def test_a_status_is_written_as_a_merge_patch_of_what_was_set() -> None:
    """Set fields are written, None ones as null (which removes them); conditions go whole and
    without nulls (a null inside a list is a value the schema refuses)."""
    conds = desired.set_condition([], "Ready", True, "Ready", "ok", now=T0)
    status = RepositoryStatus(lockEndpoint=None, branches=3).model_copy(
        update={"conditions": conds, "phase": "Ready"}
    )
    assert status.patch() == {
        "lockEndpoint": None,
        "branches": 3,
        "phase": "Ready",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Ready",
                "message": "ok",
                "lastTransitionTime": "2024-05-01T12:00:00Z",
            }
        ],
    }
    assert RepositoryStatus().patch() == {}
    # A status read back from the API server round-trips through the model.
    assert RepositoryStatus.model_validate(status.patch()).condition("Ready") == conds[0]


# -- repository_phase ----------------------------------------------------------------------------


def cond(type_: str, status: str, reason: str = "", message: str = "") -> Condition:
    return Condition.model_validate(
        {"type": type_, "status": status, "reason": reason, "message": message}
    )


def test_repository_phase_ready_needs_all_three_conditions() -> None:
    all_true = [
        cond("BucketReady", "True", "Provisioned"),
        cond("LockServiceReady", "True", "Available"),
        cond("Initialized", "True", "Initialized"),
    ]
    phase, ready, reason, _ = desired.repository_phase(all_true)
    assert (phase, ready, reason) == ("Ready", True, "Ready")
    for i in range(3):
        partial = all_true[:i] + all_true[i + 1 :]
        assert desired.repository_phase(partial)[:2] == ("Provisioning", False)
        falsy = [*all_true[:i], cond(all_true[i].type, "False", "Pending"), *all_true[i + 1 :]]
        assert desired.repository_phase(falsy)[:2] == ("Provisioning", False)


def test_repository_phase_reports_the_first_missing_condition() -> None:
    conds = [
        cond("Initialized", "False", "NotInitialized", "repository not created yet"),
        cond("LockServiceReady", "False", "Starting", "waiting for the redis pod"),
        cond("BucketReady", "True", "Provisioned"),
    ]
    assert desired.repository_phase(conds) == (
        "Provisioning",
        False,
        "Starting",
        "waiting for the redis pod",
    )
    # No conditions at all: Pending, waiting for the bucket.
    assert desired.repository_phase([]) == (
        "Provisioning",
        False,
        "Pending",
        "waiting for BucketReady",
    )


def test_repository_phase_is_failed_when_a_reason_says_invalid() -> None:
    conds = [
        cond("BucketReady", "False", "Unreachable", "timeout"),
        cond("LockServiceReady", "True", "Available"),
        cond("Initialized", "False", "InvalidConfig", "shardMaxRefs too small"),
    ]
    phase, ready, reason, message = desired.repository_phase(conds)
    assert (phase, ready) == ("Failed", False)
    assert (reason, message) == ("Unreachable", "timeout")  # still the first missing one
    # An Invalid* reason on a condition that is True does not fail the repository.
    ok = [
        cond("BucketReady", "True", "InvalidButFine"),
        cond("LockServiceReady", "False", "Starting"),
    ]
    assert desired.repository_phase(ok)[0] == "Provisioning"


# -- drifted ---------------------------------------------------------------------------------------


def test_drifted_ignores_fields_only_the_server_sets() -> None:
    want = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "redis"}]}}}}
    have = {
        "metadata": {"uid": "u", "resourceVersion": "7"},
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 10,
            "template": {
                "spec": {
                    "containers": [{"name": "redis", "imagePullPolicy": "IfNotPresent"}],
                    "dnsPolicy": "ClusterFirst",
                }
            },
        },
        "status": {"availableReplicas": 1},
    }
    assert not desired.drifted(want, have)
    assert not desired.drifted({}, have)


def test_drifted_sees_changed_values_and_lists() -> None:
    base = {"spec": {"schedule": "0 3 * * *", "args": ["a", "b"], "nested": {"x": {"y": 1}}}}
    assert not desired.drifted(base, json.loads(json.dumps(base)))
    assert desired.drifted(base, {"spec": {**base["spec"], "schedule": "0 4 * * *"}})
    assert desired.drifted(base, {"spec": {**base["spec"], "nested": {"x": {"y": 2}}}})
    assert desired.drifted(base, {"spec": {**base["spec"], "args": ["a"]}})  # shorter
    assert desired.drifted(base, {"spec": {**base["spec"], "args": ["a", "b", "c"]}})  # longer
    assert desired.drifted(base, {"spec": {**base["spec"], "args": ["b", "a"]}})  # reordered
    assert desired.drifted(base, {"spec": {"args": ["a", "b"], "nested": {"x": {"y": 1}}}})
    assert desired.drifted(base, {"spec": "not a mapping"})
    assert desired.drifted(base, {})
    assert desired.drifted({"l": [1]}, {"l": {"0": 1}})


def test_drifted_compares_bools_and_numbers_with_their_string_forms() -> None:
    assert not desired.drifted({"suspend": True}, {"suspend": "true"})
    assert not desired.drifted({"suspend": False}, {"suspend": "False"})
    assert desired.drifted({"suspend": True}, {"suspend": "false"})
    assert desired.drifted({"suspend": True}, {"suspend": False})
    assert not desired.drifted({"cpu": 1}, {"cpu": "1"})  # int-or-string quantities
    assert desired.drifted({"cpu": 2}, {"cpu": "1"})
    assert desired.drifted({"a": "x"}, {"a": None})
    assert not desired.drifted({"a": None}, {})  # an unset optional field is no drift


# -- names ---------------------------------------------------------------------------------------


def test_child_name_short_owners_keep_their_name() -> None:
    assert desired.child_name("climate", "lock") == "zl-climate-lock"
    assert desired.lock_service_names("climate") == "zl-climate-lock"
    assert (
        desired.lock_endpoint("climate", "science") == "redis://zl-climate-lock.science.svc:6379/0"
    )


@pytest.mark.parametrize("limit", [desired.DNS_NAME_MAX, desired.CRONJOB_NAME_MAX])
@pytest.mark.parametrize("suffix", ["lock", "gc", "compact"])
def test_child_name_long_owners_are_shortened_stably_and_distinctly(
    limit: int, suffix: str
) -> None:
    owners = [
        "a" * 253,
        "a" * 252 + "b",
        "a" * 80,
        "a" * 81,
        "climate-" + "x" * 60,
        "climate-" + "x" * 59 + "y",
        "climate-" + "-" * 70 + "z",
        "r" * (limit - len(suffix) - 4),  # exactly at the limit
        "r" * (limit - len(suffix) - 3),  # one over
    ]
    names = [desired.child_name(o, suffix, limit) for o in owners]
    assert names == [desired.child_name(o, suffix, limit) for o in owners]  # stable
    assert len(set(names)) == len(names)  # distinct
    for owner, name in zip(owners, names, strict=True):
        assert len(name) <= limit, (owner, name)
        assert DNS_1035_LABEL.match(name), name
        assert name.startswith("zl-") and name.endswith("-" + suffix)
    assert names[-2] == "zl-" + owners[-2] + "-" + suffix


def test_child_names_are_dns_labels_for_dotted_owners() -> None:
    """A Repository may be named like a DNS subdomain (``climate.v2``), but a Service name must be
    a DNS-1035 label: no dots. Owners differing only in a dot must still get distinct names."""
    names = set()
    for owner in ["climate.v2", "climate-v2", "a.b.c", "a-b.c", "x." * 40 + "y"]:
        name = desired.lock_service_names(owner)
        assert DNS_1035_LABEL.match(name), name
        assert len(name) <= desired.DNS_NAME_MAX
        assert desired.lock_service_names(owner) == name
        names.add(name)
        service = desired.lock_service(repository_body(owner))
        assert DNS_1035_LABEL.match(service["metadata"]["name"])
    assert len(names) == 5


# -- claims and ref names ------------------------------------------------------------------------


def claim(name: str, created: str | None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if created is not None:
        meta["creationTimestamp"] = created
    if deleting:
        meta["deletionTimestamp"] = "2024-05-02T00:00:00Z"
    return {"metadata": meta, "spec": {"repository": "climate", "name": "dev"}}


def test_claim_winner_oldest_then_name() -> None:
    assert desired.claim_winner([]) is None
    claims = [
        claim("zeta", "2024-05-01T10:00:00Z"),
        claim("beta", "2024-05-01T10:00:01Z"),
        claim("alpha", "2024-05-01T10:00:01Z"),
    ]
    assert desired.claim_winner(claims) == "zeta"
    assert desired.claim_winner(claims[1:]) == "alpha"  # same age: the name decides
    assert desired.claim_winner(reversed(claims)) == "zeta"  # any iterable, any order


def test_claim_winner_skips_resources_being_deleted() -> None:
    claims = [
        claim("old", "2024-01-01T00:00:00Z", deleting=True),
        claim("new", "2024-06-01T00:00:00Z"),
    ]
    assert desired.claim_winner(claims) == "new"
    assert desired.claim_winner([claims[0]]) is None


def _reported(kind: str, **status: Any) -> dict[str, Any]:
    """A Ready Branch or Tag resource (generation 2, observed) whose status says ``status``."""
    return {
        "kind": kind,
        "metadata": {"name": "dev-res", "generation": 2},
        "spec": {"repository": "climate", "name": "dev"},
        "status": {
            "observedGeneration": 2,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}],
            **status,
        },
    }


def test_a_status_is_confirmed_only_by_the_ref_where_it_says_it_is() -> None:
    """What lets a Repository's resync skip a dependent's reconcile: Ready for its generation,
    the owner of its ref, the ref where the status says. Anything else is reconciled."""
    branch = _reported("Branch", branch="dev", head="S1")
    assert desired.ref_reported(branch, "S1", "dev-res")
    assert not desired.ref_reported(branch, "S2", "dev-res")  # moved
    assert not desired.ref_reported(branch, None, "dev-res")  # gone: recreate it
    assert not desired.ref_reported(branch, "S1", "other")  # another resource's claim won
    assert not desired.ref_reported(branch, "S1", None)
    changed = json.loads(json.dumps(branch))
    changed["metadata"]["generation"] = 3  # a spec change not reconciled yet
    assert not desired.ref_reported(changed, "S1", "dev-res")
    waiting = json.loads(json.dumps(branch))
    waiting["status"]["conditions"][0]["status"] = "False"
    assert not desired.ref_reported(waiting, "S1", "dev-res")
    renamed = _reported("Branch", branch="old-name", head="S1")  # spec.name changed since
    assert not desired.ref_reported(renamed, "S1", "dev-res")
    tag = _reported("Tag", tag="dev", snapshot="S1")
    assert desired.ref_reported(tag, "S1", "dev-res")
    assert not desired.ref_reported(tag, None, "dev-res")  # deleted behind the operator's back
    assert not desired.ref_reported({**tag, "status": {}}, "S1", "dev-res")


def test_ref_name_is_spec_name_or_the_resource_name() -> None:
    assert desired.ref_name({"metadata": {"name": "exp-1"}, "spec": {"name": "exp/1"}}) == "exp/1"
    assert desired.ref_name({"metadata": {"name": "exp-1"}, "spec": {"repository": "r"}}) == "exp-1"
    assert desired.ref_name({"metadata": {"name": "exp-1"}}) == "exp-1"
    assert desired.ref_name({"metadata": {"name": "exp-1"}, "spec": {"name": None}}) == "exp-1"


# -- the managed lock service ----------------------------------------------------------------------


def assert_owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> None:
    (ref,) = obj["metadata"]["ownerReferences"]
    assert ref == {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert obj["metadata"]["namespace"] == owner["metadata"]["namespace"]


def test_lock_objects_are_owned_by_the_repository() -> None:
    body = repository_body()
    spec = RepositorySpec.model_validate(body["spec"])
    objs = [
        desired.lock_secret(body, LOCK_PASSWORD),
        desired.lock_deployment(body, spec),
        desired.lock_service(body),
    ]
    for obj in objs:
        assert_owned_by(obj, body)
        assert obj["metadata"]["name"] == "zl-climate-lock"
        assert obj["metadata"]["labels"]["zarrlake.io/repository"] == "climate"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "zarrlake-operator"
    secret = objs[0]
    assert secret["kind"] == "Secret" and secret["stringData"] == {"password": LOCK_PASSWORD}


def _with_lock(**lock: Any) -> tuple[dict[str, Any], RepositorySpec]:
    body = repository_body()
    body["spec"]["lockService"] = {"mode": "managed", **lock}
    return body, RepositorySpec.model_validate(body["spec"])


def _validate_builtin(obj: dict[str, Any]) -> None:
    import kubernetes_validate

    for version in ("1.30.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(obj, version, strict=True)


def test_lock_disruption_budget_keeps_the_one_redis_from_voluntary_eviction() -> None:
    body, spec = _with_lock()
    pdb = desired.lock_disruption_budget(body)
    _validate_builtin(pdb)
    assert_owned_by(pdb, body)
    assert pdb["metadata"]["name"] == "zl-climate-lock"
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    pod = desired.lock_deployment(body, spec)["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod.items()


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_lock_network_policy_lets_in_only_the_repositorys_clients() -> None:
    body, spec = _with_lock()
    policy = desired.lock_network_policy(body, spec)
    _validate_builtin(policy)
    assert_owned_by(policy, body)
    dep = desired.lock_deployment(body, spec)
    redis_pod = dep["spec"]["template"]["metadata"]["labels"]
    assert _selects(policy["spec"]["podSelector"]["matchLabels"], redis_pod)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "egress" not in policy["spec"]  # Egress with no rule: Redis reaches nothing
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    # Pod selectors without a namespace selector: the Repository's namespace only.
    assert all(set(peer) == {"podSelector"} for peer in rule["from"])
    selectors = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]

    def admitted(labels: dict[str, str]) -> bool:
        return any(_selects(s, labels) for s in selectors)

    # The pods the operator runs for this repository (a GC job's pod, a replicator's) ...
    policy_body = {
        "apiVersion": API_VERSION,
        "kind": "RetentionPolicy",
        "metadata": {"name": "keep", "namespace": "science", "uid": "u"},
    }
    policy_spec = RetentionPolicySpec.model_validate(
        {"repository": "climate", "gc": {"schedule": "@daily"}}
    )
    jobs = desired.retention_cron_jobs(policy_body, policy_spec, body, desired.JOB_IMAGE)
    job_pod = jobs["gc"]["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    assert admitted(job_pod)
    # ... and a client labelled for it are let in; another repository's, or any pod, are not.
    assert admitted({"app": "writer", "zarrlake.io/repository": "climate"})
    assert not admitted({"app": "writer", "zarrlake.io/repository": "ocean"})
    assert not admitted({"app": "writer"})
    assert not admitted({**job_pod, "zarrlake.io/repository": "ocean"})

    # clientSelector chooses the clients instead; the operator's pods still get in.
    body, spec = _with_lock(clientSelector={"team": "climate"})
    rule = desired.lock_network_policy(body, spec)["spec"]["ingress"][0]
    selectors = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert admitted({"team": "climate"}) and admitted(job_pod)
    assert not admitted({"zarrlake.io/repository": "climate"})
    # {}: every pod of the namespace.
    body, spec = _with_lock(clientSelector={})
    rule = desired.lock_network_policy(body, spec)["spec"]["ingress"][0]
    assert rule["from"] == [{"podSelector": {"matchLabels": {}}}]


def test_lock_persistence_is_optional() -> None:
    body, spec = _with_lock()
    assert desired.lock_volume_claim(body, spec) is None
    volumes = desired.lock_deployment(body, spec)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "data", "emptyDir": {}} in volumes

    body, spec = _with_lock(persistence={"size": "2Gi", "storageClassName": "fast-ssd"})
    claim = desired.lock_volume_claim(body, spec)
    assert claim is not None
    _validate_builtin(claim)
    assert_owned_by(claim, body)
    assert claim["metadata"]["name"] == "zl-climate-lock"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "2Gi"}},
        "storageClassName": "fast-ssd",
    }
    dep = desired.lock_deployment(body, spec)
    pod = dep["spec"]["template"]["spec"]
    (data,) = [v for v in pod["volumes"] if v["name"] == "data"]
    assert data == {"name": "data", "persistentVolumeClaim": {"claimName": "zl-climate-lock"}}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/data"  # where redis-server keeps its append-only file
    assert "--dir /data" in pod["containers"][0]["args"][0]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # one pod mounts the claim at a time

    # Defaults: 1Gi of the cluster's default class.
    body, spec = _with_lock(persistence={})
    claim = desired.lock_volume_claim(body, spec)
    assert claim is not None and "storageClassName" not in claim["spec"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    for bad in ({"size": "lots"}, {"storageClassName": "Fast_SSD"}):
        with pytest.raises(ValidationError):
            _with_lock(persistence=bad)


def test_lock_deployment_is_locked_down_and_takes_the_password_by_reference() -> None:
    body = repository_body()
    spec = RepositorySpec.model_validate(body["spec"])
    secret = desired.lock_secret(body, LOCK_PASSWORD)
    dep = desired.lock_deployment(body, spec)
    assert LOCK_PASSWORD not in json.dumps(dep)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["image"] == "redis:7.2-alpine"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "readinessProbe" in c and "livenessProbe" in c
    assert not any("password" in " ".join(p.get("exec", {}).get("command", [])) for p in
                   (c["readinessProbe"], c["livenessProbe"]))  # fmt: skip
    # Every env var is a Secret reference to the password Secret; no literal values.
    assert c["env"]
    for e in c["env"]:
        assert "value" not in e
        assert e["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"],
            "key": "password",
        }
    # The password is configuration on stdin, never an argument (not even a $(VAR) expansion).
    script = " ".join(c["command"] + c["args"])
    assert "$(REDIS_PASSWORD)" not in script and "requirepass" in script
    # The data directory is writable although the root file system is not.
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "--dir /data" in script and "/data" in mounts
    # ... and so is its configuration's, a volume in memory.
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert "/run/redis" in mounts and volumes["conf"]["emptyDir"]["medium"] == "Memory"


def test_lock_container_command_really_sets_the_password(tmp_path: Path) -> None:
    """Run the container's own shell command with a real redis-server (port and paths local),
    with a password Redis' config syntax would choke on unquoted."""
    PASSWORD = 'p@ss "w0rd\\ $HOME'
    import redis

    from zarrlake_testkit.servers import redis_server_binary, spawn_on_free_port, stop

    body = repository_body()
    c = desired.lock_deployment(body, RepositorySpec.model_validate(body["spec"]))["spec"][
        "template"
    ]["spec"]["containers"][0]

    def command(port: int) -> list[str]:
        script = (
            c["args"][0]
            .replace("redis-server", redis_server_binary())
            .replace(f"--port {desired.REDIS_PORT}", f"--port {port} --bind 127.0.0.1 --save ''")
            .replace("--dir /data", f"--dir {tmp_path}")
            .replace("/run/redis", str(tmp_path))
        )
        return [*c["command"], script]

    proc, port = spawn_on_free_port(
        command, 60, env={"PATH": os.environ["PATH"], "REDIS_PASSWORD": PASSWORD}
    )
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()
        assert redis.Redis(port=port, password=PASSWORD).ping()
        # The shell is gone: redis-server is the process the container started (its PID 1
        # in a pod), so the kubelet's SIGTERM reaches it.
        comm = Path(f"/proc/{proc.pid}/comm").read_text().strip()
        assert comm.startswith("redis-server"), comm
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0  # only its user reads it
    finally:
        stop(proc)


def test_lock_selector_matches_the_pod_labels_and_the_service() -> None:
    body = repository_body()
    other = repository_body("climate2")
    dep = desired.lock_deployment(body, RepositorySpec.model_validate(body["spec"]))
    svc = desired.lock_service(body)
    selector = dep["spec"]["selector"]["matchLabels"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert svc["spec"]["selector"] == selector
    # Another repository's lock pods are not selected.
    other_dep = desired.lock_deployment(other, RepositorySpec.model_validate(other["spec"]))
    other_labels = other_dep["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= other_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == desired.REDIS_PORT
    container_ports = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in container_ports


def test_lock_deployment_resources_default_and_override() -> None:
    body = repository_body()
    spec = RepositorySpec.model_validate(body["spec"])
    c = desired.lock_deployment(body, spec)["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == desired.DEFAULT_REDIS_RESOURCES
    custom = {
        "storage": {"bucket": "zarrlake-climate"},
        "lockService": {
            "image": "redis:7.4",
            "resources": {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        },
    }
    spec = RepositorySpec.model_validate(custom)
    c = desired.lock_deployment(body, spec)["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert c["image"] == "redis:7.4"


def test_deployment_available() -> None:
    assert desired.deployment_available(None)[0] is False
    assert desired.deployment_available({"status": {"availableReplicas": 1}})[0] is True
    unavailable = {
        "status": {
            "conditions": [{"type": "Available", "status": "False", "message": "ImagePullBackOff"}]
        }
    }
    assert desired.deployment_available(unavailable) == (False, "ImagePullBackOff")
    assert desired.deployment_available({"status": {}})[0] is False


# -- maintenance CronJobs ------------------------------------------------------------------------


def test_retention_cron_jobs_shape() -> None:
    jobs = cron_jobs(POLICY_SPEC)
    assert set(jobs) == {"gc", "compact"}
    policy = policy_body(POLICY_SPEC)
    for kind, cj in jobs.items():
        assert cj["kind"] == "CronJob"
        assert_owned_by(cj, policy)
        assert len(cj["metadata"]["name"]) <= desired.CRONJOB_NAME_MAX
        spec = cj["spec"]
        assert spec["concurrencyPolicy"] == "Forbid"
        assert spec["successfulJobsHistoryLimit"] == 5
        assert spec["failedJobsHistoryLimit"] == 2
        expected_labels = {
            "zarrlake.io/retention-policy": "climate-retention",
            "zarrlake.io/job": kind,
            "zarrlake.io/repository": "climate",
        }
        template = spec["jobTemplate"]
        for labels in (
            cj["metadata"]["labels"],
            template["metadata"]["labels"],
            template["spec"]["template"]["metadata"]["labels"],
        ):
            assert expected_labels.items() <= labels.items()
        pod = template["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert pod["securityContext"]["runAsNonRoot"] is True
        c = container(cj)
        assert c["image"] == desired.JOB_IMAGE
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert c["terminationMessagePath"] == "/dev/termination-log"
        assert env_of(c)["ZARRLAKE_REPORT_FILE"] == {
            "name": "ZARRLAKE_REPORT_FILE",
            "value": "/dev/termination-log",
        }
        assert c["command"][:2] == ["zarrlake", kind]
        assert c["command"][2] == "s3://zarrlake-climate/repos/climate?region=eu-west-1"
        assert "--json" in c["command"]
    gc, compact = jobs["gc"], jobs["compact"]
    assert gc["spec"]["schedule"] == "0 3 * * *"
    assert gc["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] == 1800
    assert compact["spec"]["schedule"] == "0 4 * * 0"
    assert compact["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] == 900
    assert arg_after(container(compact)["command"], "--branch") == "main"
    assert gc["metadata"]["name"] != compact["metadata"]["name"]


def test_gc_command_carries_the_rules_and_grace() -> None:
    cmd = container(cron_jobs(POLICY_SPEC)["gc"])["command"]
    rules = json.loads(arg_after(cmd, "--rules"))
    assert rules == {"default": {"days": 30}, "branches": {"experiment*": {"last": 10}}}
    # The engine accepts exactly this document.
    parsed = RetentionRules.from_dict(rules)
    assert parsed.rule_for("experiment-7").last == 10 and parsed.rule_for("main").days == 30
    assert arg_after(cmd, "--grace") == "10d"
    assert "--force" not in cmd
    forced = {**POLICY_SPEC, "gc": {"schedule": "@daily", "grace": "1h", "force": True}}
    cmd = container(cron_jobs(forced)["gc"])["command"]
    assert "--force" in cmd and arg_after(cmd, "--grace") == "1h"


def test_compaction_cron_job_only_when_asked_for() -> None:
    spec = {k: v for k, v in POLICY_SPEC.items() if k != "compaction"}
    jobs = cron_jobs(spec)
    assert set(jobs) == {"gc"}
    # Defaults: gc nightly, 7d grace, 3 + 3 history.
    jobs = cron_jobs({"repository": "climate"})
    gc = jobs["gc"]
    assert set(jobs) == {"gc"}
    assert gc["spec"]["schedule"] == "0 3 * * *"
    assert gc["spec"]["successfulJobsHistoryLimit"] == 3
    assert gc["spec"]["failedJobsHistoryLimit"] == 3
    assert arg_after(container(gc)["command"], "--grace") == "7d"
    assert RetentionRules.from_dict(json.loads(arg_after(container(gc)["command"], "--rules")))


def test_cron_job_resources_image_and_suspend() -> None:
    spec = {
        **POLICY_SPEC,
        "image": "registry.example/zarrlake:dev",
        "gc": {
            "schedule": "0 3 * * *",
            "suspend": True,
            "resources": {"requests": {"cpu": "250m"}, "limits": {"memory": "2Gi"}},
        },
    }
    jobs = cron_jobs(spec)
    gc = jobs["gc"]
    assert gc["spec"]["suspend"] is True
    assert jobs["compact"]["spec"]["suspend"] is False
    assert container(gc)["image"] == "registry.example/zarrlake:dev"
    assert container(gc)["resources"] == {"requests": {"cpu": "250m"}, "limits": {"memory": "2Gi"}}
    # Without resources in the spec, the measured defaults: never a pod without requests.
    assert container(jobs["compact"])["resources"] == desired.DEFAULT_JOB_RESOURCES


def test_cron_jobs_carry_no_secret_values() -> None:
    """Credentials and the lock password reach the job only as Secret references."""
    repo = repository_body()
    # What the operator holds in memory at the time: the Secrets' values. They are not inputs of
    # retention_cron_jobs, but make sure nothing in the path can smuggle them in.
    lock_secret = desired.lock_secret(repo, LOCK_PASSWORD)
    assert LOCK_PASSWORD in json.dumps(lock_secret)
    jobs = cron_jobs(POLICY_SPEC, repo)
    for cj in jobs.values():
        text = json.dumps(cj)
        for value in SECRET_VALUES:
            assert value not in text
        assert "password" not in " ".join(container(cj)["command"]).lower()
        assert "@" not in container(cj)["command"][2]
        env = env_of(container(cj))
        secret_vars = {
            "AWS_ACCESS_KEY_ID": {"name": "climate-s3", "key": "AWS_ACCESS_KEY_ID"},
            "AWS_SECRET_ACCESS_KEY": {"name": "climate-s3", "key": "AWS_SECRET_ACCESS_KEY"},
            "AWS_SESSION_TOKEN": {"name": "climate-s3", "key": "TOKEN", "optional": True},
            "ZARRLAKE_LOCK_PASSWORD": {"name": "zl-climate-lock", "key": "password"},
        }
        for var, ref in secret_vars.items():
            assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": ref}}, var
        # Everything else is a plain, non-secret value.
        for name, e in env.items():
            if name not in secret_vars:
                assert set(e) == {"name", "value"}, e
        assert env["ZARRLAKE_LOCK"]["value"] == "redis://zl-climate-lock.science.svc:6379/0"
        assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
        # Any env var whose name suggests a credential is a reference.
        for name, e in env.items():
            if re.search(r"KEY|SECRET|TOKEN|PASSWORD", name) and name != "ZARRLAKE_REPORT_FILE":
                assert "value" not in e and "secretKeyRef" in e["valueFrom"], name


def test_cron_job_env_without_credentials_or_lock() -> None:
    repo = repository_body(
        spec={"storage": {"bucket": "zarrlake-climate"}, "lockService": {"mode": "none"}},
        status={"url": "s3://zarrlake-climate"},
    )
    env = env_of(container(cron_jobs(POLICY_SPEC, repo)["gc"]))
    assert set(env) == {"ZARRLAKE_REPORT_FILE"}
    # Managed mode whose lock service is not up yet: no lock env either.
    repo = repository_body(
        spec={"storage": {"bucket": "zarrlake-climate"}}, status={"url": "s3://zarrlake-climate"}
    )
    env = env_of(container(cron_jobs(POLICY_SPEC, repo)["gc"]))
    assert set(env) == {"ZARRLAKE_REPORT_FILE"}


def test_cron_job_env_external_lock() -> None:
    repo = repository_body(
        spec={
            "storage": {"bucket": "zarrlake-climate"},
            "lockService": {
                "mode": "external",
                "url": "rediss://redis.shared.svc:6380/3",
                "passwordSecret": {"name": "shared-redis", "key": "redis-password"},
            },
        },
        status={"url": "s3://zarrlake-climate"},
    )
    env = env_of(container(cron_jobs(POLICY_SPEC, repo)["gc"]))
    assert env["ZARRLAKE_LOCK"] == {
        "name": "ZARRLAKE_LOCK",
        "value": "rediss://redis.shared.svc:6380/3",
    }
    assert env["ZARRLAKE_LOCK_PASSWORD"] == {
        "name": "ZARRLAKE_LOCK_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "shared-redis", "key": "redis-password"}},
    }
    # External without a password: the URL only.
    repo["spec"]["lockService"].pop("passwordSecret")
    env = env_of(container(cron_jobs(POLICY_SPEC, repo)["gc"]))
    assert "ZARRLAKE_LOCK_PASSWORD" not in env and "ZARRLAKE_LOCK" in env


def test_cron_jobs_need_the_repository_url() -> None:
    repo = repository_body(status={"conditions": []})
    with pytest.raises(ValueError, match="climate"):
        cron_jobs(POLICY_SPEC, repo)
    repo.pop("status")
    with pytest.raises(ValueError, match="no URL"):
        cron_jobs(POLICY_SPEC, repo)


def test_cron_job_names_fit_for_long_policy_names() -> None:
    body = policy_body(POLICY_SPEC, name="p" * 200)
    spec = RetentionPolicySpec.model_validate(POLICY_SPEC)
    jobs = desired.retention_cron_jobs(body, spec, repository_body())
    names = {j["metadata"]["name"] for j in jobs.values()}
    assert len(names) == 2
    for name in names:
        assert len(name) <= desired.CRONJOB_NAME_MAX and DNS_LABEL.match(name)


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_values(obj: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for node in walk(obj):
        if isinstance(node, dict):
            for key in ("labels", "matchLabels", "selector"):
                labels = node.get(key)
                if isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values()):
                    yield from labels.items()


def test_label_values_are_valid_for_ordinary_names() -> None:
    body = repository_body("climate.v2")
    objs = [
        desired.lock_secret(body, "pw"),
        desired.lock_deployment(body, RepositorySpec.model_validate(body["spec"])),
        desired.lock_service(body),
        *cron_jobs(POLICY_SPEC, body).values(),
    ]
    for obj in objs:
        for key, value in label_values(obj):
            assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)


def test_label_values_are_valid_for_the_longest_allowed_names() -> None:
    """Names end up in label values (at most 63 characters); the CRDs cap Repository and
    RetentionPolicy names at 63, and everything the operator builds from them stays valid."""
    for kind in ("Repository", "RetentionPolicy"):
        rules = crds.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
            "x-kubernetes-validations"
        ]
        assert any("self.metadata.name.size() <= 63" in r["rule"] for r in rules), kind
    body = repository_body("r" * 63)
    objs = [
        desired.lock_deployment(body, RepositorySpec.model_validate(body["spec"])),
        desired.lock_service(body),
        *desired.retention_cron_jobs(
            policy_body({**POLICY_SPEC, "repository": "r" * 63}, name="p" * 63),
            RetentionPolicySpec.model_validate({**POLICY_SPEC, "repository": "r" * 63}),
            body,
        ).values(),
    ]
    for obj in objs:
        for key, value in label_values(obj):
            assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)


# -- job_run ---------------------------------------------------------------------------------------


def job_run_entry(job: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``desired.job_run`` as the status shows the entry (Kubernetes names, absent counts left
    out)."""
    run = desired.job_run(job, pods)
    assert run is None or isinstance(run, JobRun)
    return None if run is None else run.dump()


def job(
    name: str = "zl-climate-retention-gc-28600000",
    conditions: list[dict[str, Any]] | None = None,
    **status: Any,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "science"},
        "status": {"conditions": conditions or [], **status},
    }


def pod(
    name: str,
    created: str,
    message: str | None,
    exit_code: int = 0,
    container_name: str = "gc",
) -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Completed"}
    if message is not None:
        terminated["message"] = message
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "status": {
            "containerStatuses": [{"name": container_name, "state": {"terminated": terminated}}]
        },
    }


COMPLETE = {"type": "Complete", "status": "True", "lastTransitionTime": "2024-05-01T03:05:00Z"}
FAILED = {
    "type": "Failed",
    "status": "True",
    "reason": "BackoffLimitExceeded",
    "message": "Job has reached the specified backoff limit",
    "lastTransitionTime": "2024-05-01T03:07:00Z",
}
GC_REPORT = {
    "deleted_objects": 12,
    "deleted_bytes": 12288,
    "kept_objects": 30,
    "kept_bytes": 40000,
    "dry_run": False,
    "marked_snapshots": 2,
    "skipped_young": 0,
    "by_kind": {"chunk": {"deleted": 12}},
    "duration_s": 0.5,
    "expire": {"expired_snapshots": 4, "retained_snapshots": 2, "dry_run": False},
}


def test_job_run_is_none_while_the_job_runs() -> None:
    assert job_run_entry(job(active=1), []) is None
    not_yet = {"type": "Complete", "status": "False"}
    suspended = {"type": "Suspended", "status": "True"}
    assert job_run_entry(job(conditions=[not_yet, suspended]), []) is None


def test_job_run_maps_the_gc_report() -> None:
    message = json.dumps(GC_REPORT, separators=(",", ":"))
    run = job_run_entry(
        job(conditions=[COMPLETE], completionTime="2024-05-01T03:04:59Z"),
        [pod("p1", "2024-05-01T03:00:00Z", message)],
    )
    assert run == {
        "job": "zl-climate-retention-gc-28600000",
        "time": "2024-05-01T03:04:59Z",
        "result": "Succeeded",
        "snapshotsExpired": 4,
        "objectsDeleted": 12,
        "bytesFreed": 12288,
    }


def test_job_run_maps_the_compaction_report_and_uses_the_condition_time() -> None:
    report = {"branch": "main", "dry_run": False, "packed_chunks": 40, "packed_bytes": 4096}
    run = job_run_entry(
        job(conditions=[COMPLETE]), [pod("p1", "2024-05-01T03:00:00Z", json.dumps(report))]
    )
    assert run == {
        "job": "zl-climate-retention-gc-28600000",
        "time": "2024-05-01T03:05:00Z",
        "result": "Succeeded",
        "chunksPacked": 40,
    }


def test_job_run_duration_is_the_jobs_start_to_its_end() -> None:
    done = job(
        conditions=[COMPLETE],
        startTime="2024-05-01T03:00:00Z",
        completionTime="2024-05-01T03:04:59Z",
    )
    run = job_run_entry(done, [])
    assert run is not None and run["durationSeconds"] == 299
    # A failed Job has no completionTime: it ended when it was marked Failed.
    failed = job_run_entry(job(conditions=[FAILED], startTime="2024-05-01T03:00:00Z"), [])
    assert failed is not None and failed["durationSeconds"] == 420
    # Without a start (or with times out of order) the duration is not made up.
    assert "durationSeconds" not in (job_run_entry(job(conditions=[COMPLETE]), []) or {})
    backwards = job(conditions=[COMPLETE], startTime="2024-05-01T04:00:00Z")
    assert "durationSeconds" not in (job_run_entry(backwards, []) or {})


def test_seconds_between() -> None:
    assert desired.seconds_between("2024-05-01T03:00:00Z", "2024-05-01T03:00:07Z") == 7
    assert desired.seconds_between("2024-05-01T03:00:00Z", "2024-05-02T03:00:00Z") == 86400
    assert desired.seconds_between(None, "2024-05-01T03:00:07Z") is None
    assert desired.seconds_between("2024-05-01T03:00:00Z", "") is None
    assert desired.seconds_between("yesterday", "2024-05-01T03:00:07Z") is None
    assert desired.seconds_between("2024-05-01T03:00:08Z", "2024-05-01T03:00:07Z") is None


def test_job_run_failed_with_a_crash_log() -> None:
    log_tail = (
        "Traceback (most recent call last):\n  File ...\n"
        "zarrlake: error: cannot reach s3://zarrlake-climate: timeout\n"
    )
    run = job_run_entry(
        job(conditions=[FAILED]), [pod("p1", "2024-05-01T03:00:00Z", log_tail, exit_code=1)]
    )
    assert run is not None
    assert run["result"] == "Failed"
    assert run["message"] == "zarrlake: error: cannot reach s3://zarrlake-climate: timeout"
    assert run["time"] == "2024-05-01T03:07:00Z"
    assert not {"snapshotsExpired", "objectsDeleted", "bytesFreed"} & set(run)


def test_job_run_failed_without_any_message_uses_the_job_condition() -> None:
    run = job_run_entry(job(conditions=[FAILED]), [pod("p1", "2024-05-01T03:00:00Z", None)])
    assert run is not None and run["result"] == "Failed"
    assert run["message"] == "Job has reached the specified backoff limit"
    run = job_run_entry(job(conditions=[{"type": "Failed", "status": "True"}]), [])
    assert run is not None and run["message"] == "the job failed"


def test_job_run_long_messages_are_cut() -> None:
    run = job_run_entry(job(conditions=[FAILED]), [pod("p1", "t", "x" * 5000, exit_code=1)])
    assert run is not None and len(run["message"]) <= 500


def test_job_run_newest_pod_wins() -> None:
    older = pod("p1", "2024-05-01T03:00:00Z", json.dumps({**GC_REPORT, "deleted_objects": 1}))
    newer = pod("p2", "2024-05-01T03:02:00Z", json.dumps({**GC_REPORT, "deleted_objects": 7}))
    for pods in ([older, newer], [newer, older]):
        run = job_run_entry(job(conditions=[COMPLETE]), pods)
        assert run is not None and run["objectsDeleted"] == 7


def test_job_run_newest_pod_wins_over_an_older_report() -> None:
    """An older pod's report must not be mixed into a newer pod's failure."""
    older = pod("p1", "2024-05-01T03:00:00Z", json.dumps(GC_REPORT), exit_code=1)
    newer = pod("p2", "2024-05-01T03:02:00Z", "zarrlake: error: storage went away", exit_code=1)
    for pods in ([older, newer], [newer, older]):
        run = job_run_entry(job(conditions=[FAILED]), pods)
        assert run is not None
        assert run["result"] == "Failed"
        assert run["message"] == "zarrlake: error: storage went away"
        assert not {"snapshotsExpired", "objectsDeleted", "bytesFreed"} & set(run)


def test_job_run_json_that_is_not_a_report_is_a_message() -> None:
    """With FallbackToLogsOnError the message may be any log tail, valid JSON included."""
    for tail in ("42", '["a", "b"]', "null"):
        run = job_run_entry(job(conditions=[FAILED]), [pod("p1", "t", tail, exit_code=1)])
        assert run is not None and run["result"] == "Failed"
        assert run["message"] == tail


@pytest.fixture
def local_repo(tmp_path: Path) -> tuple[str, int]:
    """A repository in a directory with a few commits on main; returns (URL, snapshot count)."""
    path = tmp_path / "repo"
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    for i in range(4):
        commit_random(repo, i)
    return str(path), len(list(repo.log("main")))


def run_like_the_cron_job(
    cj: dict[str, Any], report_file: Path, monkeypatch: pytest.MonkeyPatch
) -> int:
    """Run the CronJob's command with its environment through the real CLI, in-process."""
    c = container(cj)
    for e in c["env"]:
        assert "value" in e, "test repositories have no Secret-referenced env"
        monkeypatch.setenv(e["name"], e["value"])
    assert c["command"][0] == "zarrlake"
    monkeypatch.setenv("ZARRLAKE_REPORT_FILE", str(report_file))  # for /dev/termination-log
    return cli_main(c["command"][1:])


def test_cron_job_commands_run_and_their_reports_map_to_job_runs(
    local_repo: tuple[str, int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The generated gc and compact commands are accepted by the real CLI; what the CLI writes to
    the termination log is what job_run reads."""
    url, snapshots = local_repo
    repo_body = repository_body(
        spec={"storage": {"bucket": "zarrlake-climate"}, "lockService": {"mode": "none"}},
        status={"url": url},
    )
    spec = {
        "repository": "climate",
        "rules": {"default": {"last": 1}},
        "gc": {"schedule": "@daily", "grace": "0s", "force": True},
        "compaction": {"schedule": "@weekly", "branch": "main"},
    }
    jobs = cron_jobs(spec, repo_body)

    report_file = tmp_path / "termination-log"
    assert run_like_the_cron_job(jobs["gc"], report_file, monkeypatch) == 0, capsys.readouterr()
    message = report_file.read_text()
    assert len(message) < 4096
    run = job_run_entry(job(conditions=[COMPLETE]), [pod("gc-1", "2024-05-01T03:00:00Z", message)])
    assert run is not None and run["result"] == "Succeeded"
    assert run["snapshotsExpired"] == snapshots - 1  # default last 1: only the head stays
    assert run["objectsDeleted"] > 0 and run["bytesFreed"] > 0
    assert "message" not in run

    report_file.unlink()
    assert run_like_the_cron_job(jobs["compact"], report_file, monkeypatch) == 0
    message = report_file.read_text()
    run = job_run_entry(
        job("compact-1", conditions=[COMPLETE]), [pod("c-1", "2024-05-01T04:00:00Z", message)]
    )
    assert run is not None and run["result"] == "Succeeded"
    assert run["chunksPacked"] == 4  # the head's four 1 KiB chunks
    capsys.readouterr()


# -- models --------------------------------------------------------------------------------------


def example_resources() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(p for p in EXAMPLES.glob("*.yaml") if p.name != "kustomization.yaml"):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


MODELS: dict[str, type[pydantic.BaseModel]] = {
    "Repository": Repository,
    "Branch": Branch,
    "Tag": Tag,
    "RetentionPolicy": RetentionPolicy,
    "Mirror": Mirror,
}


def test_examples_validate() -> None:
    seen = set()
    for doc in example_resources():
        if doc["apiVersion"] != API_VERSION:
            continue
        kind = doc["kind"]
        MODELS[kind].model_validate(doc)
        # ... and against the generated CRD schema, as the API server would check it.
        schema = crds.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        jsonschema.validate(doc, schema)
        seen.add(kind)
    assert seen == set(KINDS)


def test_examples_parse_into_what_they_say() -> None:
    by_kind = {d["kind"]: d for d in example_resources()}
    repo = Repository.model_validate(by_kind["Repository"])
    assert repo.spec.storage.bucket == "zarrlake-climate"
    assert repo.spec.storage.credentials_secret is not None
    assert repo.spec.storage.credentials_secret.access_key_id_key == "AWS_ACCESS_KEY_ID"
    assert repo.spec.lock_service.mode == "managed"
    assert repo.spec.config.shard_max_refs == 2048
    policy = RetentionPolicy.model_validate(by_kind["RetentionPolicy"])
    assert policy.spec.rules.to_engine() == {
        "default": {"days": 30},
        "branches": {"experiment*": {"last": 10}},
    }
    assert policy.spec.compaction is not None and policy.spec.compaction.branch == "main"
    assert Branch.model_validate(by_kind["Branch"]).spec.from_ == "main"
    # The Secret the Repository names holds the keys the Repository's defaults name.
    (secret,) = [
        d
        for d in example_resources()
        if d["kind"] == "Secret"
        and d["metadata"]["name"] == repo.spec.storage.credentials_secret.name
    ]
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def invalid(model: type[pydantic.BaseModel], spec: dict[str, Any]) -> str:
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate({"spec": spec})
    return str(e.value)


@pytest.mark.parametrize(
    ("storage", "field"),
    [
        ({"bucket": "Bad_Bucket"}, "spec.storage.bucket"),
        ({"bucket": "ab"}, "spec.storage.bucket"),
        ({"bucket": "-bucket"}, "spec.storage.bucket"),
        ({"bucket": "b" * 64}, "spec.storage.bucket"),
        ({"bucket": "ok-bucket", "prefix": "/repos"}, "spec.storage.prefix"),
        ({"bucket": "ok-bucket", "prefix": "repos/"}, "spec.storage.prefix"),
        ({"bucket": "ok-bucket", "endpointURL": "ftp://minio:9000"}, "spec.storage.endpointURL"),
        ({"bucket": "ok-bucket", "endpointURL": "minio:9000"}, "spec.storage.endpointURL"),
        ({"prefix": "x"}, "spec.storage.bucket"),
    ],
)
def test_bad_repository_storage_is_refused_readably(storage: dict[str, Any], field: str) -> None:
    message = invalid(Repository, {"storage": storage})
    assert field in message
    assert "1 validation error" in message


def test_bad_repository_specs_are_refused_readably() -> None:
    bucket = {"bucket": "ok-bucket"}
    msg = invalid(Repository, {"storage": bucket, "lockService": {"mode": "zookeeper"}})
    assert "spec.lockService.mode" in msg and "'managed', 'external' or 'none'" in msg
    msg = invalid(Repository, {"storage": bucket, "lockService": {"url": "redis://:pw@r:6379"}})
    assert "spec.lockService.url" in msg
    msg = invalid(Repository, {"storage": bucket, "reclaimPolicy": "Destroy"})
    assert "spec.reclaimPolicy" in msg
    msg = invalid(Repository, {"storage": bucket, "config": {"shardMaxRefs": 4}})
    assert "spec.config.shardMaxRefs" in msg
    # Good ones pass, unknown fields are ignored.
    for prefix in ("", "a", "repos/climate"):
        Repository.model_validate({"spec": {"storage": {**bucket, "prefix": prefix}}})
    ok = Repository.model_validate(
        {"spec": {"storage": {**bucket, "endpointURL": "https://minio:9000"}, "future": 1}}
    )
    assert ok.spec.storage.endpoint_url == "https://minio:9000"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"gc": {"schedule": "every night"}}, "spec.gc.schedule"),
        ({"gc": {"schedule": "0 3 * * * *"}}, "spec.gc.schedule"),
        ({"gc": {"schedule": "0 3 * * ;"}}, "spec.gc.schedule"),
        ({"gc": {"schedule": "@sometimes"}}, "spec.gc.schedule"),
        ({"compaction": {"schedule": "0 3 * *"}}, "spec.compaction.schedule"),
        ({"rules": {"default": {"last": -1}}}, "spec.rules.default.last"),
        ({"rules": {"branches": {"dev*": {"days": -2}}}}, "spec.rules.branches.dev*.days"),
        ({"gc": {"schedule": "@daily", "grace": "a week"}}, "spec.gc.grace"),
        ({"gc": {"schedule": "@daily", "activeDeadlineSeconds": 10}}, "spec.gc.activeDeadline"),
        ({"successfulJobsHistoryLimit": -1}, "spec.successfulJobsHistoryLimit"),
    ],
)
def test_bad_retention_specs_are_refused_readably(spec: dict[str, Any], field: str) -> None:
    message = invalid(RetentionPolicy, {"repository": "climate", **spec})
    assert field in message


def test_good_cron_schedules() -> None:
    for schedule in ("0 3 * * *", "*/15 * * * *", "0 4 * * SUN", "@daily", "0 0 1,15 * 1-5"):
        RetentionPolicy.model_validate(
            {"spec": {"repository": "climate", "gc": {"schedule": schedule}}}
        )


def test_bad_branch_and_tag_specs() -> None:
    assert "spec.repository" in invalid(Branch, {"repository": "Not_A_Name"})
    assert "spec.name" in invalid(Branch, {"repository": "climate", "name": "-bad"})
    assert "spec.from" in invalid(Branch, {"repository": "climate", "from": ""})
    assert "spec.ref" in invalid(Tag, {"repository": "climate"})


def test_dump_uses_the_kubernetes_names() -> None:
    repo = Repository.model_validate(
        {
            "spec": {
                "storage": {"bucket": "ok-bucket", "endpointURL": "http://minio:9000"},
                "lockService": {"mode": "external", "url": "redis://r:6379/0"},
            }
        }
    )
    out = repo.dump()
    assert out["spec"]["storage"]["endpointURL"] == "http://minio:9000"
    assert out["spec"]["lockService"]["mode"] == "external"
    assert out["spec"]["lockService"]["onUnavailable"] == "optimistic"
    assert out["spec"]["reclaimPolicy"] == "Retain"
    assert "region" not in out["spec"]["storage"]  # unset optional fields are left out
    assert "endpoint_url" not in json.dumps(out) and "lock_service" not in json.dumps(out)
    branch = Branch.model_validate({"spec": {"repository": "climate", "from": "dev"}})
    assert branch.dump()["spec"] == {"repository": "climate", "from": "dev"}
    # populate_by_name: the Python names are accepted too.
    assert Branch.model_validate({"spec": {"repository": "r", "from_": "x"}}).spec.from_ == "x"
    policy = RetentionPolicy.model_validate(
        {"spec": {"repository": "climate", "gc": {"schedule": "@daily", "force": True}}}
    )
    gc = policy.dump()["spec"]["gc"]
    assert gc["activeDeadlineSeconds"] == 21600 and gc["force"] is True


# -- CRDs -----------------------------------------------------------------------------------------


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        yield from schema_nodes(extra, f"{path}[*]")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")


def openapi(kind: str) -> dict[str, Any]:
    return crds.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_crd_schemas_are_structural(kind: str) -> None:
    schema = openapi(kind)
    forbidden = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "discriminator", "const"}
    count = 0
    for path, node in schema_nodes(schema):
        count += 1
        assert not forbidden & set(node), (path, forbidden & set(node))
        assert not ("properties" in node and "additionalProperties" in node), path
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        assert node.get("default", ...) is not None, path  # no null defaults
        if node.get("type") == "object" and path != ".metadata":  # metadata: the server's
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path
        if node.get("type") == "array":
            assert "items" in node, path
        if node.get("x-kubernetes-list-type") == "map":
            # Kubernetes: every list-map key must be required (or defaulted) in the items.
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), path
        for key in node.get("required", []):
            assert key in node.get("properties", {}), (path, key)
    assert count > 10
    assert schema["properties"]["spec"]["type"] == "object"
    assert "spec" in schema["required"]
    # The whole CRD is plain data (YAML-serializable the way `make crds` writes it).
    assert yaml.safe_load(crds.render(kind)) == crds.crd(kind)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_crd_names_status_and_columns(kind: str) -> None:
    crd = crds.crd(kind)
    names = crd["spec"]["names"]
    plural = KINDS[kind]["plural"]
    assert crd["metadata"]["name"] == f"{plural}.zarrlake.io"
    assert crd["spec"]["group"] == "zarrlake.io" and crd["spec"]["scope"] == "Namespaced"
    assert names["kind"] == kind and names["plural"] == plural
    assert names["singular"] == kind.lower()
    assert names["shortNames"] and all(s.startswith("zl") for s in names["shortNames"])
    assert names["categories"] == ["zarrlake"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Age"] == {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    }
    for c in columns.values():
        assert c["type"] in {"string", "integer", "number", "boolean", "date"}
        assert c["jsonPath"].startswith(".")


def test_crd_short_names_are_unique() -> None:
    short = [s for kind in KINDS for s in crds.crd(kind)["spec"]["names"]["shortNames"]]
    assert len(short) == len(set(short)) == len(KINDS)


def node_at(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    node = schema
    for name in path:
        node = node["properties"][name]
    return node


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("Repository", ("spec", "storage", "bucket")),
        ("Repository", ("spec", "storage", "prefix")),
        ("Tag", ("spec", "ref")),
        ("Tag", ("spec", "repository")),
        ("Tag", ("spec", "name")),
        ("Branch", ("spec", "from")),
        ("Branch", ("spec", "repository")),
        ("Branch", ("spec", "name")),
        ("RetentionPolicy", ("spec", "repository")),
    ],
)
def test_crd_immutable_fields(kind: str, path: tuple[str, ...]) -> None:
    rules = node_at(openapi(kind), *path)["x-kubernetes-validations"]
    assert [r["rule"] for r in rules] == ["self == oldSelf"]
    assert "immutable" in rules[0]["message"]


def test_crd_mutable_fields_have_no_transition_rule() -> None:
    schema = openapi("Repository")
    for path in (
        ("spec", "storage", "region"),
        ("spec", "lockService", "mode"),
        ("spec", "reclaimPolicy"),
    ):
        assert "x-kubernetes-validations" not in node_at(schema, *path), path
    assert "x-kubernetes-validations" not in node_at(openapi("RetentionPolicy"), "spec", "gc")


def test_crd_keeps_patterns_enums_defaults_and_quantities() -> None:
    repo = openapi("Repository")
    assert node_at(repo, "spec", "storage", "bucket")["pattern"].startswith("^[a-z0-9]")
    assert node_at(repo, "spec", "lockService", "mode")["enum"] == ["managed", "external", "none"]
    assert node_at(repo, "spec", "lockService", "mode")["default"] == "managed"
    assert node_at(repo, "spec", "reclaimPolicy")["default"] == "Retain"
    requests = node_at(repo, "spec", "lockService", "resources", "requests")
    assert requests["type"] == "object"
    assert requests["additionalProperties"] == {"x-kubernetes-int-or-string": True}
    conditions = node_at(repo, "status", "conditions")
    assert conditions["type"] == "array" and conditions["x-kubernetes-list-type"] == "map"
    assert node_at(repo, "status", "conditions")["items"]["properties"]["status"]["enum"] == [
        "True",
        "False",
        "Unknown",
    ]
    policy = openapi("RetentionPolicy")
    assert node_at(policy, "spec", "rules", "default", "last")["type"] == "integer"
    assert node_at(policy, "spec", "gc")["required"] == ["schedule"]
    assert "compaction" not in policy["properties"]["spec"].get("required", [])


@pytest.mark.parametrize(
    ("desired_value", "actual_value", "drift"),
    [
        ("0.5", "500m", False),
        (1073741824, "1Gi", False),
        ("1G", "1000M", False),
        ("1", 1, False),
        ("250m", "500m", True),
        ("1Gi", "1G", True),
        ("redis:7", "redis:8", True),
    ],
)
def test_drift_compares_quantities_by_value(desired_value: Any, actual_value: Any, drift: bool):
    """The API server rewrites quantities canonically; that is not drift (no patch loop)."""
    spec = {"resources": {"requests": {"cpu": desired_value}}}
    seen = {"resources": {"requests": {"cpu": actual_value}}, "extra": "server-side"}
    assert desired.drifted(spec, seen) is drift


@pytest.mark.parametrize(
    ("schedule", "problem"),
    [
        ("0 3 * * *", None),
        ("*/15 0-6,22-23 ? JAN-MAR mon-fri", None),
        ("@daily", None),
        ("61 25 * * *", "minute 61 is out of range 0-59"),
        ("0 24 * * *", "hour 24 is out of range 0-23"),
        ("0 0 0 * *", "day of month 0 is out of range 1-31"),
        ("0 0 * 13 *", "month 13 is out of range 1-12"),
        ("0 0 * * 8", "day of week 8 is out of range 0-7"),
        ("0 0 5-1 * *", "range '5-1' runs backwards"),
        ("*/0 * * * *", "step '0' must be a positive number"),
        ("? * * * *", "'?' is only for day of month or day of week"),
        ("0 0 L * *", "'L' is not a number"),
        ("0 3 * *", "5 fields"),
        ("@every 5m", "unknown cron macro"),
    ],
)
def test_cron_schedules_are_checked_as_kubernetes_checks_them(
    schedule: str, problem: str | None
) -> None:
    from zarrlake.resources import GCSchedule, cron_problem

    found = cron_problem(schedule)
    if problem is None:
        assert found is None
        GCSchedule(schedule=schedule)
    else:
        assert found is not None and problem in found
        with pytest.raises(ValidationError):  # (the CRD's pattern catches some first)
            GCSchedule(schedule=schedule)


def test_routine_kopf_lines_drop_to_debug_and_waits_to_info() -> None:
    import logging

    from zarrlake_operator.__main__ import RoutineAtDebug

    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)

    at_info = RoutineAtDebug(logging.INFO)
    tick = record(logging.INFO, "Timer 'branch_resync' succeeded.")
    assert not at_info.filter(tick) and tick.levelname == "DEBUG"
    wait = record(logging.ERROR, "Handler 'branch_changed' failed temporarily: Repository 'r' …")
    assert at_info.filter(wait) and wait.levelname == "INFO"
    real = record(logging.ERROR, "Handler 'branch_changed' failed with an exception. Will retry.")
    assert at_info.filter(real) and real.levelname == "ERROR"
    assert RoutineAtDebug(logging.DEBUG).filter(record(logging.INFO, "Timer 'x' succeeded."))


def test_a_dependent_missing_its_repository_for_too_long_is_stalled() -> None:
    from zarrlake_operator.desired import (
        MISSING_REPOSITORY_STALL,
        condition,
        set_ready,
        waited_too_long,
    )

    start = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
    missing = "Repository 'nope' does not exist in namespace 'default'"
    waiting = set_ready([], False, "RepositoryNotFound", missing, now=start)
    assert condition(waiting, "Reconciling").status == "True"  # the apply order, at first
    soon = start + MISSING_REPOSITORY_STALL / 2
    late = start + MISSING_REPOSITORY_STALL + dt.timedelta(seconds=1)
    assert not waited_too_long(waiting, "RepositoryNotFound", MISSING_REPOSITORY_STALL, soon)
    assert waited_too_long(waiting, "RepositoryNotFound", MISSING_REPOSITORY_STALL, late)
    # Another wait (a Repository that exists but is not ready) is not this one.
    assert not waited_too_long(waiting, "RepositoryNotReady", MISSING_REPOSITORY_STALL, late)
    stalled = set_ready(waiting, False, "RepositoryNotFound", missing, reconciling=False, now=late)
    assert condition(stalled, "Stalled").status == "True"
    assert condition(stalled, "Reconciling").status == "False"
    # It stays Stalled while the Repository stays missing (no flapping on the next retry)...
    assert waited_too_long(stalled, "RepositoryNotFound", MISSING_REPOSITORY_STALL, late)
    # ...and a Repository that appears ends it: Ready, nothing stalled.
    found = set_ready(stalled, True, "Ready", "branch at ...", now=late)
    assert not waited_too_long(found, "RepositoryNotFound", MISSING_REPOSITORY_STALL, late)
    assert condition(found, "Stalled").status == "False"
