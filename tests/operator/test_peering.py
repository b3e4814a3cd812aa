"""Two operator replicas with Kopf peering: exactly one acts; the other takes over when it goes.

Its own API server (not the shared one), so the replicas see only this test's resources.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml
from k8s_env import CREDENTIALS, ROOT, wait_for

from zarrlake_operator import kube
from zarrlake_testkit.emulated import start_operator
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import stop

PEERING = "zarrlake-operator"
#: Handler successes are DEBUG lines: the checks below read them.
DEBUG = {"ZARRLAKE_LOG_LEVEL": "DEBUG"}


def _repository(name: str, endpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "storage": {
                "bucket": f"zl-peering-{name}",
                "endpointURL": endpoint,
                "credentialsSecret": {"name": "creds"},
                "provision": True,
            },
            "lockService": {"mode": "none"},
        },
    }


def _ready(name: str) -> bool:
    obj = kube.get("Repository", "default", name) or {}
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_only_the_highest_priority_replica_acts(tmp_path: Path, moto_s3: Any) -> None:
    api = KubeAPI().start()
    low = high = None
    try:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        kube.use_kubeconfig(str(kubeconfig))
        # The chart's CRDs: ours and Kopf's peering kinds, then the peering object it creates.
        for path in sorted((ROOT / "charts" / "zarrlake-operator" / "crds").glob("*.yaml")):
            kube._call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                body=yaml.safe_load(path.read_text()),
            )
        kube._call(
            "POST",
            "/apis/kopf.dev/v1/clusterkopfpeerings",
            body={
                "apiVersion": "kopf.dev/v1",
                "kind": "ClusterKopfPeering",
                "metadata": {"name": PEERING},
            },
        )
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "creds", "namespace": "default"},
                "stringData": CREDENTIALS,
            }
        )
        low_log, high_log = tmp_path / "low.log", tmp_path / "high.log"
        high, _, _ = start_operator(
            kubeconfig, log_path=high_log, peering=PEERING, priority=200, extra_env=DEBUG
        )
        low, _, _ = start_operator(
            kubeconfig, log_path=low_log, peering=PEERING, priority=100, extra_env=DEBUG
        )
        # Kopf starts every peer paused; only the highest priority resumes.
        wait_for("the high replica to resume", lambda: "Resuming" in high_log.read_text())
        kube.create(_repository("first", moto_s3.endpoint))
        wait_for("first Ready", lambda: _ready("first"))
        # Kopf logs the handler's success after the status patch: wait for the line itself.
        wait_for("the high replica's handler", lambda: "repository_changed" in high_log.read_text())
        time.sleep(1)  # give a wrongly active replica the chance to show itself (a negative check)
        assert "repository_changed" not in low_log.read_text()
        assert "Resuming" not in low_log.read_text()

        # The active replica leaves (SIGTERM: Kopf withdraws from the peering); the other resumes.
        # Up to 120 s to exit cleanly: a SIGKILL would leave its peering record to expire (60 s).
        stop(high, timeout=120)
        wait_for("the low replica to resume", lambda: "Resuming" in low_log.read_text(), 240)
        kube.create(_repository("second", moto_s3.endpoint))
        wait_for("second Ready", lambda: _ready("second"))
        assert "repository_changed" in low_log.read_text()

        # A replica that dies without a word (SIGKILL): the standby takes over within 15 s.
        standby_log = tmp_path / "standby.log"
        standby, _, _ = start_operator(
            kubeconfig, log_path=standby_log, peering=PEERING, priority=50, extra_env=DEBUG
        )
        time.sleep(3)  # the standby has seen the active one's record
        assert "Resuming" not in standby_log.read_text()
        killed = time.monotonic()
        low.kill()
        low.wait()
        wait_for("the standby to resume", lambda: "Resuming" in standby_log.read_text(), 60)
        failover = time.monotonic() - killed
        assert failover <= 15, f"failover took {failover:.1f} s"
        kube.create(_repository("third", moto_s3.endpoint))
        wait_for("third Ready", lambda: _ready("third"))
        stop(standby)
    finally:
        stop(low)
        stop(high)
        api.stop()
        # The kube client is process-wide: give it back to the shared operator tests' cluster.
        if os.environ.get("KUBECONFIG"):
            kube.use_kubeconfig(os.environ["KUBECONFIG"])
