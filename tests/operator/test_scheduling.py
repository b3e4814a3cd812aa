"""Where the pods go: the operator's replicas and the managed Redis lock services are kept apart
by default (a preferred pod anti-affinity on the node, a zone spread that only scores), and both
defaults give way to what the chart's values or the Repository's spec say.

The chart is rendered by Helm's own engine (``helm-python-sdk``); the Redis Deployment is the
operator's own desired object (``desired.lock_deployment``). Every object is validated against
the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from zarrlake.resources import RepositorySpec
from zarrlake_operator import desired

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "zarrlake-operator"
RELEASE = "zl"
SELECTOR = {"app.kubernetes.io/name": "zarrlake-operator", "app.kubernetes.io/instance": RELEASE}
LOCK_SERVICES = {
    "app.kubernetes.io/component": "lock-service",
    "app.kubernetes.io/managed-by": "zarrlake-operator",
}
NODE_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ops"]}]}
            ]
        }
    }
}
HOST_SPREAD = [
    {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"team": "data"}},
    }
]


def validate(obj: dict[str, Any]) -> None:
    for version in ("1.30.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(obj, version, strict=True)


# -- the operator's Deployment (chart) -------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def operator_pod(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, Any]:
    text = chart.render(values, name=RELEASE, namespace="zarrlake-system")[
        "zarrlake-operator/templates/deployment.yaml"
    ]
    deployment = yaml.safe_load(text)
    validate(deployment)
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    # Whatever the scheduling, it selects the release's own operator pods and nothing else.
    assert deployment["spec"]["selector"]["matchLabels"] == SELECTOR
    return pod


def test_operator_replicas_prefer_other_nodes_and_zones_by_default(chart: helm.Chart) -> None:
    pod = operator_pod(chart, {"replicaCount": 2})
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term == {
        "weight": 100,
        "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": SELECTOR},
        },
    }
    # Preferences only: nothing the scheduler must satisfy, so one node still runs them all.
    assert set(pod["affinity"]) == {"podAntiAffinity"}
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]
    )
    assert pod["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": SELECTOR},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]


def test_operator_scheduling_values_replace_the_defaults(chart: helm.Chart) -> None:
    pod = operator_pod(chart, {"affinity": NODE_AFFINITY, "topologySpreadConstraints": HOST_SPREAD})
    assert pod["affinity"] == NODE_AFFINITY  # instead of the default, not merged into it
    assert pod["topologySpreadConstraints"] == HOST_SPREAD
    # Each default switched off on its own.
    pod = operator_pod(chart, {"spread": {"nodes": False}})
    assert "affinity" not in pod and pod["topologySpreadConstraints"][0]["topologyKey"] == (
        "topology.kubernetes.io/zone"
    )
    pod = operator_pod(chart, {"spread": {"zones": False}})
    assert "topologySpreadConstraints" not in pod and "podAntiAffinity" in pod["affinity"]
    pod = operator_pod(chart, {"spread": {"nodes": False, "zones": False}})
    assert "affinity" not in pod and "topologySpreadConstraints" not in pod


def test_operator_scheduling_values_are_checked(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmValuesError, match="spread"):
        chart.render({"spread": {"hosts": True}}, name=RELEASE, namespace="zarrlake-system")
    with pytest.raises(helm.HelmValuesError, match="whenUnsatisfiable"):
        chart.render(
            {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "x"}]},
            name=RELEASE,
            namespace="zarrlake-system",
        )


def test_disruption_budget_and_network_policy_stay_beside_the_spread(chart: helm.Chart) -> None:
    manifests = chart.render(
        {"replicaCount": 2, "networkPolicy": {"enabled": True}},
        name=RELEASE,
        namespace="zarrlake-system",
    )
    kinds = {
        doc["kind"]: doc
        for path, text in manifests.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    }
    assert kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == SELECTOR
    assert kinds["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"] == SELECTOR


# -- the managed Redis (the operator's desired Deployment) -----------------------------------------


def lock_deployment(**lock: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": "climate", "namespace": "science", "uid": "u-1"},
        "spec": {"storage": {"bucket": "zl-climate"}, "lockService": {"mode": "managed", **lock}},
    }
    deployment = desired.lock_deployment(body, RepositorySpec.model_validate(body["spec"]))
    validate(deployment)
    return deployment


def lock_pod(**lock: Any) -> dict[str, Any]:
    pod: dict[str, Any] = lock_deployment(**lock)["spec"]["template"]["spec"]
    return pod


def test_lock_services_prefer_other_nodes_and_zones_by_default() -> None:
    pod = lock_pod()
    anti = pod["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {
            "weight": 100,
            "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": LOCK_SERVICES},
            },
        }
    ]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"] is None  # never a refusal
    assert pod["affinity"]["nodeAffinity"] is None and pod["affinity"]["podAffinity"] is None
    assert pod["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": LOCK_SERVICES},
        }
    ]
    # The selector takes in every managed Redis of the namespace, this one's included.
    labels = lock_deployment()["spec"]["template"]["metadata"]["labels"]
    assert LOCK_SERVICES.items() <= labels.items()


def test_lock_service_scheduling_follows_the_repository_spec() -> None:
    pod = lock_pod(affinity=NODE_AFFINITY, topologySpreadConstraints=HOST_SPREAD)
    # Given whole: the default anti-affinity is named null, so a merge patch removes it.
    assert (
        pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        == (NODE_AFFINITY["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"])
    )
    assert pod["affinity"]["podAntiAffinity"] is None and pod["affinity"]["podAffinity"] is None
    assert pod["topologySpreadConstraints"] == HOST_SPREAD
    # {} and [] turn the defaults off: null, which a merge patch turns into "no such field".
    pod = lock_pod(affinity={}, topologySpreadConstraints=[])
    assert pod["affinity"] is None and pod["topologySpreadConstraints"] is None


def test_a_changed_lock_scheduling_is_drift_and_the_patch_replaces_it() -> None:
    """What the operator's merge patch does to a Redis Deployment made with the defaults, when
    the spec then asks for another affinity: RFC 7386 applied here by hand, as the API server
    applies it, then compared the way the operator compares."""

    def merge(target: Any, patch: Any) -> Any:
        if not isinstance(patch, dict):
            return patch
        out = dict(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value)
        return out

    def stored(obj: Any) -> Any:  # the API server keeps no nulls
        if isinstance(obj, dict):
            return {k: stored(v) for k, v in obj.items() if v is not None}
        if isinstance(obj, list):
            return [stored(v) for v in obj]
        return obj

    live = stored(lock_pod())
    wanted = lock_pod(affinity=NODE_AFFINITY, topologySpreadConstraints=[])
    assert desired.drifted(wanted, live)
    patched = merge(live, wanted)
    assert patched["affinity"] == NODE_AFFINITY and "topologySpreadConstraints" not in patched
    assert not desired.drifted(wanted, patched)  # and then it is at rest
    assert not desired.drifted(lock_pod(), stored(lock_pod()))
