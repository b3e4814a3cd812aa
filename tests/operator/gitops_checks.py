"""How GitOps tools judge a resource: Argo CD by the chart's Lua health checks, Flux by kstatus.

:func:`argo_health` runs the Lua of ``charts/zarrlake-operator/argocd/health.yaml`` as Argo CD
does (the resource as the global ``obj``; the script returns ``{status, message}``), in a real
Lua interpreter (PyPI ``lupa``). :func:`kstatus` is an independent reading of the kstatus rules
Flux's health checks apply to custom resources, written here from those rules (not from the
operator's code) so that a test can hold the operator's conditions to them:

* no status, or ``status.observedGeneration`` other than ``metadata.generation``: InProgress
  (the controller has not seen the latest spec);
* ``Reconciling=True``: InProgress; ``Stalled=True``: Failed;
* else ``Ready``: True is Current, False Failed (the latest generation was seen, nothing is in
  progress, and it is not ready), Unknown InProgress; no Ready at all: Current.

It also refuses what makes no sense under the conventions (``Reconciling`` and ``Stalled`` both
True; a False Ready without a reason or message), raising :class:`ConventionBroken`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import yaml
from k8s_env import ROOT

HEALTH = ROOT / "charts" / "zarrlake-operator" / "argocd" / "health.yaml"
KINDS = ("Repository", "Branch", "Tag", "RetentionPolicy", "Mirror")


class ConventionBroken(AssertionError):
    """A status no kstatus reading can make sense of."""


@functools.cache
def health_scripts() -> dict[str, str]:
    """The Lua health check of each kind, by kind, as Argo CD reads them from ``argocd-cm``."""
    data = yaml.safe_load(HEALTH.read_text())["data"]
    prefix = "resource.customizations.health.zarrlake.io_"
    return {key.removeprefix(prefix): script for key, script in data.items()}


@functools.cache
def _checks() -> dict[str, Any]:
    """Each kind's script compiled once, in one Lua runtime, as a function of the object."""
    import lupa

    runtime = lupa.LuaRuntime(unpack_returned_tuples=True)
    compiled = {
        kind: runtime.execute(f"return function(o)\nobj = o\n{script}\nend")
        for kind, script in health_scripts().items()
    }
    return {"runtime": runtime, **compiled}


def argo_health(obj: dict[str, Any]) -> dict[str, str]:
    """Argo CD's health of ``obj``: ``{"status": ..., "message": ...}``. The object reaches
    the script as Argo CD hands it over: nested Lua tables (lists 1-based, nulls absent)."""
    checks = _checks()
    plain = json.loads(json.dumps(obj))  # kube answers may hold mapping views: plain data
    result = checks[obj["kind"]](checks["runtime"].table_from(plain, recursive=True))
    return {"status": str(result["status"]), "message": str(result["message"] or "")}


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}


def kstatus(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) by the kstatus rules: ``InProgress``, ``Failed`` or ``Current``."""
    status = obj.get("status") or {}
    if not status:
        return "InProgress", "no status yet"
    generation = (obj.get("metadata") or {}).get("generation")
    if generation is not None and status.get("observedGeneration") != generation:
        return (
            "InProgress",
            f"observedGeneration {status.get('observedGeneration')} != {generation}",
        )
    conditions = _conditions(obj)
    reconciling = conditions.get("Reconciling", {}).get("status") == "True"
    stalled = conditions.get("Stalled", {}).get("status") == "True"
    ready = conditions.get("Ready")
    if reconciling and stalled:
        raise ConventionBroken(f"Reconciling and Stalled both True: {conditions}")
    said = ready is not None and bool(ready.get("reason")) and bool(ready.get("message"))
    if ready is not None and ready.get("status") == "False" and not said:
        raise ConventionBroken(f"Ready=False without a reason and message: {ready}")
    if reconciling:
        return "InProgress", conditions["Reconciling"].get("message", "")
    if stalled:
        return "Failed", conditions["Stalled"].get("message", "")
    if ready is None:
        return "Current", ""
    if ready.get("status") == "True":
        return "Current", ""
    if ready.get("status") == "False":
        return "Failed", ready.get("message", "")
    return "InProgress", ready.get("message", "")
