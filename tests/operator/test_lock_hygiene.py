"""The managed Redis' PodDisruptionBudget, NetworkPolicy and optional PersistentVolumeClaim, on
the emulated API with the real operator process: made, owned by the Repository, following its
spec, and removed with it (or with its managed lock service)."""

from __future__ import annotations

from typing import Any

from k8s_env import Env, wait_for

from zarrlake.resources import RepositorySpec
from zarrlake_operator import desired

NAME = "zl-repo-lock"
PARTS = ("Deployment", "Service", "Secret", "PodDisruptionBudget", "NetworkPolicy")


def owner_uid(obj: dict[str, Any]) -> str:
    (ref,) = obj["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["controller"]) == ("Repository", "repo", True)
    return str(ref["uid"])


def data_volume(k8s: Env) -> dict[str, Any]:
    dep = k8s.get("Deployment", NAME) or {}
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    (data,) = [v for v in volumes if v["name"] == "data"]
    return dict(data)


def test_managed_redis_gets_a_disruption_budget_a_network_policy_and_optional_storage(
    k8s: Env,
) -> None:
    repo = k8s.ready_repository(lock="managed")
    uid = repo["metadata"]["uid"]
    spec = RepositorySpec.model_validate(repo["spec"])
    for kind in PARTS:
        child = k8s.get(kind, NAME)
        assert child is not None, kind
        assert owner_uid(child) == uid, kind
    pdb = k8s.get("PodDisruptionBudget", NAME) or {}
    assert pdb["spec"] == desired.lock_disruption_budget(repo)["spec"]
    policy = k8s.get("NetworkPolicy", NAME) or {}
    assert policy["spec"] == desired.lock_network_policy(repo, spec)["spec"]
    # Without persistence: no claim, a temporary volume (as before).
    assert k8s.get("PersistentVolumeClaim", NAME) is None
    assert data_volume(k8s) == {"name": "data", "emptyDir": {}}

    # Persistence asked for: a claim, owned, and Redis' data on it.
    persistence = {"size": "2Gi", "storageClassName": "standard"}
    k8s.patch("Repository", "repo", {"spec": {"lockService": {"persistence": persistence}}})
    claim = wait_for("the claim", lambda: k8s.get("PersistentVolumeClaim", NAME))
    assert owner_uid(claim) == uid
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["spec"]["storageClassName"] == "standard"
    wait_for(
        "Redis on the claim",
        lambda: data_volume(k8s).get("persistentVolumeClaim") == {"claimName": NAME},
    )
    # Clients chosen by label: the policy follows the spec.
    selector = {"team": "climate"}
    k8s.patch("Repository", "repo", {"spec": {"lockService": {"clientSelector": selector}}})
    wait_for(
        "the policy's clients",
        lambda: (
            (k8s.get("NetworkPolicy", NAME) or {})["spec"]["ingress"][0]["from"][0]
            == {"podSelector": {"matchLabels": selector}}
        ),
    )

    # Persistence dropped: back on a temporary volume, and the claim goes.
    k8s.patch("Repository", "repo", {"spec": {"lockService": {"persistence": None}}})
    wait_for("the claim removed", lambda: k8s.get("PersistentVolumeClaim", NAME) is None)
    assert data_volume(k8s) == {"name": "data", "emptyDir": {}}

    # No managed lock service any more: every part of it goes.
    k8s.patch("Repository", "repo", {"spec": {"lockService": {"mode": "none"}}})
    wait_for(
        "the lock service's parts removed",
        lambda: all(k8s.get(kind, NAME) is None for kind in PARTS),
    )


def test_the_redis_parts_go_with_their_repository(k8s: Env) -> None:
    k8s.secret()
    k8s.repository(lockService={"mode": "managed", "persistence": {}})
    k8s.wait_condition("Repository", "repo")
    parts = (*PARTS, "PersistentVolumeClaim")
    wait_for("every part made", lambda: all(k8s.get(kind, NAME) for kind in parts))
    claim = k8s.get("PersistentVolumeClaim", NAME) or {}
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in claim["spec"]  # the cluster's default class

    k8s.delete("Repository", "repo")
    wait_for("the Repository gone", lambda: k8s.get("Repository", "repo") is None)
    wait_for(
        "its parts collected with it",
        lambda: all(k8s.get(kind, NAME) is None for kind in parts),
    )
