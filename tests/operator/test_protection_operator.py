"""``spec.protection`` end to end (issue 42): the real operator process against the emulated
Kubernetes API and moto's S3 keeps a repository's branch rules to what the Repository resource
declares, says so in status and events, and reports rules the engine refuses."""

from __future__ import annotations

import pytest
import zarr
from k8s_env import Env, condition, wait_for

import zarrlake


def _protected(k8s: Env, count: int) -> dict:
    def check() -> dict | None:
        obj = k8s.get("Repository", "repo") or {}
        ok = condition(obj, "ProtectionReady").get("status") == "True"
        return obj if ok and (obj.get("status") or {}).get("protectedBranches") == count else None

    return wait_for(f"{count} protected branch(es)", check)


def test_spec_protection_is_applied_kept_and_lifted(k8s: Env) -> None:
    rule = {
        "branch": "main",
        "requiredChecks": ["required-attributes"],
        "checkOptions": {"required-attributes": {"attributes": ["units"]}},
    }
    k8s.ready_repository(protection=[rule, {"branch": "release", "requireMerge": False}])
    obj = _protected(k8s, 2)
    assert condition(obj, "ProtectionReady")["message"] == "protected branches: main, release"
    repo = k8s.open_repository()
    rules = repo.branch_protection()
    assert rules["main"] == zarrlake.BranchRule(
        True, False, False, ("required-attributes",),
        {"required-attributes": {"attributes": ["units"]}},
    )  # fmt: skip
    assert rules["release"] == zarrlake.BranchRule(False, False, False, ())
    session = repo.writable_session("main")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")
    with pytest.raises(zarrlake.BranchProtected):
        session.commit("direct to main")
    assert "BranchProtectionChanged" in k8s.event_reasons()

    # Rules changed behind the operator's back are put back at the next resync...
    repo.unprotect_branch("release")
    wait_for(
        "release protected again",
        lambda: "release" in repo.branch_protection() or None,
    )
    # ... and a rule taken out of the spec is lifted.
    k8s.patch("Repository", "repo", {"spec": {"protection": [rule]}})
    _protected(k8s, 1)
    assert set(repo.branch_protection()) == {"main"}


def test_rules_the_engine_refuses_are_a_condition(k8s: Env) -> None:
    k8s.ready_repository(protection=[{"branch": "main", "requiredChecks": ["not-installed"]}])
    obj = k8s.wait_condition("Repository", "repo", "ProtectionReady", "False")
    found = condition(obj, "ProtectionReady")
    assert found["reason"] == "InvalidProtection"
    assert "no check named 'not-installed'" in found["message"]
    assert k8s.open_repository().branch_protection() == {}
