"""The chart's Argo CD health checks (``charts/zarrlake-operator/argocd/health.yaml``), run in a
real Lua interpreter on hand-written statuses: the edge cases the operator passes through for a
moment (no status yet, a spec it has not seen) and the ones it rarely shows. The statuses the
real operator writes are judged in ``test_gitops.py``; here also what :func:`desired.set_ready`
writes, by both the Lua and the independent kstatus reading."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from gitops_checks import HEALTH, KINDS, argo_health, health_scripts, kstatus

from zarrlake_operator import desired


def _obj(
    kind: str,
    conditions: list[dict[str, Any]] | None,
    *,
    generation: int = 1,
    observed: int | None = 1,
    phase: str | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": "ns", "generation": generation},
        "spec": spec or {},
    }
    if conditions is not None:
        status: dict[str, Any] = {"conditions": conditions}
        if observed is not None:
            status["observedGeneration"] = observed
        if phase:
            status["phase"] = phase
        obj["status"] = status
    return obj


def _c(type_: str, status: str, reason: str = "R", message: str = "m", gen: int = 1) -> Any:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": gen,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def test_the_snippet_is_an_argocd_cm_patch_with_one_check_per_kind() -> None:
    doc = yaml.safe_load(HEALTH.read_text())
    assert (doc["kind"], doc["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
    assert sorted(health_scripts()) == sorted(KINDS)
    assert len(set(health_scripts().values())) == 1  # one script, shared by the five


@pytest.mark.parametrize("kind", KINDS)
def test_no_status_yet_is_progressing(kind: str) -> None:
    assert argo_health(_obj(kind, None))["status"] == "Progressing"
    assert argo_health(_obj(kind, []))["status"] == "Progressing"
    assert kstatus(_obj(kind, None))[0] == "InProgress"


@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_not_yet_observed_is_progressing_even_when_ready(kind: str) -> None:
    behind = _obj(kind, [_c("Ready", "True", gen=1)], generation=2, observed=1)
    health = argo_health(behind)
    assert health == {
        "status": "Progressing",
        "message": "the zarrlake operator has not yet acted on generation 2",
    }
    assert kstatus(behind)[0] == "InProgress"
    # The status' observedGeneration is current but the Ready condition's is not: still behind.
    stale = _obj(kind, [_c("Ready", "True", gen=1)], generation=2, observed=2)
    assert argo_health(stale)["status"] == "Progressing"
    no_observed = _obj(kind, [_c("Ready", "True")], observed=None)
    assert argo_health(no_observed)["status"] == "Progressing"


@pytest.mark.parametrize("kind", KINDS)
def test_ready_false_with_a_reason_is_degraded_with_the_reason_and_message(kind: str) -> None:
    obj = _obj(kind, [_c("Ready", "False", "CredentialsNotFound", "Secret 's3' not found")])
    assert argo_health(obj) == {
        "status": "Degraded",
        "message": "CredentialsNotFound: Secret 's3' not found",
    }
    assert kstatus(obj) == ("Failed", "Secret 's3' not found")


def test_reconciling_is_progressing_and_stalled_is_degraded() -> None:
    waiting = _obj(
        "Branch",
        [
            _c("Ready", "False", "RepositoryNotReady", "waits"),
            _c("Reconciling", "True", "RepositoryNotReady", "waits"),
        ],
    )
    assert argo_health(waiting) == {"status": "Progressing", "message": "RepositoryNotReady: waits"}
    assert kstatus(waiting)[0] == "InProgress"
    stalled = _obj(
        "Mirror",
        [_c("Ready", "True", "Mirroring", "ok"), _c("Stalled", "True", "NoProgress", "10m")],
    )
    assert kstatus(stalled) == ("Failed", "10m")  # Stalled wins over Ready
    assert argo_health(stalled) == {"status": "Degraded", "message": "NoProgress: 10m"}


def test_a_repository_ready_in_phase_degraded_is_degraded() -> None:
    lost = _obj(
        "Repository",
        [_c("Ready", "True", "LockServiceUnavailable", "lock lost")],
        phase="Degraded",
    )
    assert argo_health(lost) == {
        "status": "Degraded",
        "message": "LockServiceUnavailable: lock lost",
    }
    assert argo_health({**lost, "status": {**lost["status"], "phase": "Ready"}})["status"] == (
        "Healthy"
    )


def test_a_policy_with_gc_and_compaction_suspended_is_suspended() -> None:
    ready = [_c("Ready", "True", "Scheduled", "gc 0 3 * * * (gc suspended)")]
    suspended = _obj("RetentionPolicy", ready, spec={"gc": {"suspend": True}})
    assert argo_health(suspended)["status"] == "Suspended"
    running = _obj("RetentionPolicy", ready, spec={"gc": {"suspend": False}})
    assert argo_health(running)["status"] == "Healthy"
    half = _obj(
        "RetentionPolicy",
        ready,
        spec={"gc": {"suspend": True}, "compaction": {"suspend": False}},
    )
    assert argo_health(half)["status"] == "Healthy"


@pytest.mark.parametrize(
    ("ready", "reason", "flux", "argo"),
    [
        (True, "Ready", "Current", "Healthy"),
        (False, "RepositoryNotReady", "InProgress", "Progressing"),
        (False, "WaitingForReplicator", "InProgress", "Progressing"),
        (False, "InvalidSpec", "Failed", "Degraded"),
        (False, "Conflict", "Failed", "Degraded"),
        (False, "SomethingNew", "Failed", "Degraded"),  # an unknown reason is no wait
    ],
)
def test_what_set_ready_writes_reads_the_same_to_flux_and_argo(
    ready: bool, reason: str, flux: str, argo: str
) -> None:
    conditions = desired.set_ready([], ready, reason, "the message", generation=3)
    types = {c.type: c for c in conditions}
    assert set(types) == {"Ready", "Reconciling", "Stalled"}
    assert all(c.observed_generation == 3 and c.last_transition_time for c in conditions)
    obj = _obj("Tag", [c.dump() for c in conditions], generation=3, observed=3)
    assert kstatus(obj)[0] == flux
    assert argo_health(obj)["status"] == argo


def test_set_ready_moves_no_transition_time_when_nothing_changed() -> None:
    import datetime as dt

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    first = desired.set_ready([], False, "RepositoryNotReady", "m", generation=1, now=t0)
    again = desired.set_ready(
        first, False, "RepositoryNotReady", "m", generation=1, now=t0 + dt.timedelta(hours=1)
    )
    assert again == first  # an unchanged readiness rewrites nothing


@pytest.mark.parametrize(
    ("serve", "starting", "argo", "flux"),
    [
        (None, False, "Healthy", "Current"),  # no spec.serve: as before
        (("True", "Available"), False, "Healthy", "Current"),
        (("False", "Starting"), True, "Progressing", "InProgress"),
        (("False", "ScaledToZero"), False, "Healthy", "Current"),
        (("False", "Unavailable"), False, "Degraded", "Current"),
        (("False", "RolloutFailed"), False, "Degraded", "Current"),
        (("False", "SecretNotFound"), False, "Degraded", "Current"),
    ],
)
def test_a_repositorys_server_reads_as_its_rollout_and_never_unreadies_it(
    serve: tuple[str, str] | None, starting: bool, argo: str, flux: str
) -> None:
    """What the operator writes for a Repository with spec.serve (its phase from
    :func:`desired.repository_phase`, Reconciling while a rollout is on its way): a server
    starting is Progressing, one that is down Degraded for Argo CD (Ready stays True: Flux's
    kstatus, which reads only Ready, Reconciling and Stalled, says Current, as for a lost lock
    service), and no spec.serve changes nothing."""
    conditions = [
        desired.set_condition([], t, True, t, "ok")[0]
        for t in ("BucketReady", "LockServiceReady", "Initialized")
    ]
    if serve is not None:
        conditions = desired.set_condition(conditions, "ServeReady", serve[0], serve[1], "1 of 2")
    phase = desired.repository_phase(conditions)
    assert phase.ready
    conditions = desired.set_ready(
        conditions, phase.ready, phase.reason, phase.message, generation=1, reconciling=starting
    )
    obj = _obj("Repository", [c.dump() for c in conditions], phase=phase.phase)
    assert argo_health(obj)["status"] == argo
    assert kstatus(obj)[0] == flux
    if argo == "Degraded":
        assert argo_health(obj)["message"].startswith("ServeUnavailable: 1 of 2")
