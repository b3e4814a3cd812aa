"""What operator tests use to talk to the emulated cluster (fixtures are in conftest.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zarrlake_operator import kube
from zarrlake_testkit.emulated import LocalCluster
from zarrlake_testkit.kubeapi import KubeAPI

ROOT = Path(__file__).resolve().parents[2]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIAZLTESTKEY0000001", "AWS_SECRET_ACCESS_KEY": "s3cr3t-zl-t"}


# Generous: a wait returns as soon as its condition holds, and on a loaded machine the operator's
# 1 s resync, a Job's process or a Redis start can take tens of seconds.
WAIT_S = 120.0


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something truthy; fail with its last value.

    An exception from ``check`` counts as "not yet" (a status not written yet raises KeyError or
    TypeError); the last one is reported, with its traceback, if the deadline passes.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            last, error = check(), None
        except Exception as e:
            last, error = None, e
        if last:
            return last
        time.sleep(0.2)
    if error is not None:
        raise AssertionError(f"timed out waiting for {what}; last error: {error!r}") from error
    raise AssertionError(f"timed out waiting for {what}; last: {json.dumps(last, default=str)}")


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


@dataclass
class Env:
    """One test's namespace in the shared emulated cluster."""

    api: KubeAPI
    kubeconfig: Path
    s3_endpoint: str
    cluster: LocalCluster
    operator_log: Path
    metrics_port: int
    namespace: str = field(default_factory=lambda: f"t-{uuid.uuid4().hex[:8]}")

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = json.loads(json.dumps(obj))
        obj.setdefault("metadata", {})["namespace"] = self.namespace
        return kube.create(obj)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return kube.get(kind, self.namespace, name)

    def patch(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return kube.merge_patch(kind, self.namespace, name, patch)

    def delete(self, kind: str, name: str) -> None:
        kube.delete(kind, self.namespace, name)

    def secret(self, name: str = "s3-creds", data: dict[str, str] | None = None) -> None:
        self.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name},
                "type": "Opaque",
                "stringData": data or CREDENTIALS,
            }
        )

    def repository(
        self,
        name: str = "repo",
        *,
        bucket: str | None = None,
        lock: str = "none",
        provision: bool = True,
        reclaim: str = "Retain",
        secret: str | None = "s3-creds",
        **spec: Any,
    ) -> str:
        """Create a Repository resource; returns its bucket."""
        bucket = bucket or f"zl-{self.namespace}-{name}"
        storage: dict[str, Any] = {
            "bucket": bucket,
            "prefix": f"repos/{name}",
            "endpointURL": self.s3_endpoint,
            "region": "us-east-1",
            "provision": provision,
        }
        if secret:
            storage["credentialsSecret"] = {"name": secret}
        self.create(
            {
                "apiVersion": "zarrlake.io/v1alpha1",
                "kind": "Repository",
                "metadata": {"name": name},
                "spec": {
                    "storage": storage,
                    "lockService": {"mode": lock},
                    "reclaimPolicy": reclaim,
                    **spec,
                },
            }
        )
        return bucket

    def ready_repository(self, name: str = "repo", **kwargs: Any) -> dict[str, Any]:
        """The credentials Secret and a Repository, waited for until Ready and its lock service
        (if any) is up — a Repository is Ready without it (Degraded); returns it."""
        if self.get("Secret", "s3-creds") is None:
            self.secret()
        self.repository(name, **kwargs)
        self.wait_condition("Repository", name)
        return self.wait_condition("Repository", name, "LockServiceReady")

    def custom(self, kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.create(
            {
                "apiVersion": "zarrlake.io/v1alpha1",
                "kind": kind,
                "metadata": {"name": name},
                "spec": spec,
            }
        )

    def wait_condition(
        self,
        kind: str,
        name: str,
        type_: str = "Ready",
        status: str = "True",
        timeout: float = WAIT_S,
    ) -> dict[str, Any]:
        def check() -> Any:
            obj = self.get(kind, name)
            return obj if condition(obj, type_).get("status") == status else None

        try:
            return wait_for(f"{kind}/{name} {type_}={status}", check, timeout)
        except AssertionError:
            obj = self.get(kind, name)
            raise AssertionError(
                f"{kind}/{name} never reached {type_}={status}: "
                f"{json.dumps((obj or {}).get('status'), indent=1)}\n"
                f"operator log tail:\n{self.log_tail()}"
            ) from None

    def open_repository(self, name: str = "repo") -> Any:
        """The repository behind a Ready resource, through the public discovery API."""
        import zarrlake

        obj = self.get("Repository", name) or {}
        endpoint = (obj.get("status") or {}).get("lockEndpoint")
        lock_url = self.cluster.resolve(endpoint) if endpoint else None
        return zarrlake.Repository.from_kubernetes(name, self.namespace, lock_url=lock_url)

    def events(self) -> list[dict[str, Any]]:
        return kube._call("GET", f"/api/v1/namespaces/{self.namespace}/events").get("items", [])

    def event_reasons(self) -> set[str]:
        return {e.get("reason") or "" for e in self.events()}

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.operator_log.read_text(errors="replace").splitlines()[-lines:])
