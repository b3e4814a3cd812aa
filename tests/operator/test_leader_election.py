"""Operator replicas electing their leader on a Lease: exactly one acts; the others take over.

Real operator processes, with the election's default timings, against an API server of this
test's own that keeps an audit log: each replica has a kubeconfig with its own token, so the log
tells every request of each replica apart.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_env import CREDENTIALS, ROOT, wait_for

from zarrlake_operator import kube
from zarrlake_operator.__main__ import build_parser
from zarrlake_operator.leader import LeaseSettings
from zarrlake_testkit.emulated import start_operator
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import stop

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
LEASE = f"{LEASES}/zarrlake-operator"
_DEFAULTS = build_parser().parse_args(["run"])
DURATION, RETRY = _DEFAULTS.lease_duration, _DEFAULTS.lease_retry_period
# The default interval, with the default deadline (the CLI's None: "let the settings decide").
RENEW = LeaseSettings("x", "ns", "me", renew_deadline=_DEFAULTS.lease_renew_deadline).interval
#: What a standby may ask: read the Lease, and watch it (on the Leases, by its name).
STANDBY_ASKS = {("GET", LEASE, False), ("GET", LEASES, True)}
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
#: Handler lines are DEBUG: the log checks below read them.
DEBUG = {"ZARRLAKE_LOG_LEVEL": "DEBUG"}


def _repository(name: str, endpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "storage": {
                "bucket": f"zl-lease-{name}",
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


def _lease() -> dict[str, Any]:
    return kube._call("GET", LEASE) or {}


def _holder() -> str:
    return str((_lease().get("spec") or {}).get("holderIdentity") or "")


def test_one_replica_acts_and_another_takes_over(tmp_path: Path, moto_s3: Any) -> None:
    api = KubeAPI(audit_log=tmp_path / "audit.jsonl").start()
    replicas: dict[str, Any] = {}
    metrics_ports: dict[str, int] = {}
    health_ports: dict[str, int] = {}
    logs: dict[str, Path] = {}
    measured: dict[str, float] = {}

    def start(who: str) -> None:
        kubeconfig = api.write_kubeconfig(tmp_path / f"{who}.kubeconfig", token=who)
        logs[who] = tmp_path / f"{who}.log"
        replicas[who], health_ports[who], metrics_ports[who] = start_operator(
            kubeconfig,
            log_path=logs[who],
            leader_election=True,
            extra_env={**DEBUG, "POD_NAME": f"operator-{who}"},
        )

    def requests(who: str) -> list[dict[str, Any]]:
        return [r for r in api.audit() if r["user"] == who]

    def fetch(url: str) -> str:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url) as rsp:
            return str(rsp.read().decode())

    def metric(who: str, name: str) -> float:
        text = fetch(f"http://127.0.0.1:{metrics_ports[who]}/metrics")
        values = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(name)]
        return sum(float(v) for _, v in values)

    def acted(who: str) -> list[dict[str, Any]]:
        """What a replica asked beyond the Lease: Kopf's watches, reads, writes."""
        return [r for r in requests(who) if not r["path"].startswith(LEASES)]

    def asked(who: str) -> set[tuple[str, str, bool]]:
        return {(r["verb"], r["path"], r["watch"]) for r in requests(who)}

    def watching(who: str) -> bool:
        return any(r["watch"] and r["path"] == LEASES for r in requests(who))

    try:
        kube.use_kubeconfig(str(api.write_kubeconfig(tmp_path / "admin.kubeconfig", "admin")))
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            kube._call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                body=yaml.safe_load(path.read_text()),
            )
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "creds", "namespace": "default"},
                "stringData": CREDENTIALS,
            }
        )

        # a leads; b stands by.
        start("a")
        wait_for("a to take the Lease", lambda: _holder().startswith("operator-a_"))
        start("b")
        wait_for("b to watch the Lease", lambda: watching("b"))
        kube.create(_repository("first", moto_s3.endpoint))
        wait_for("first Ready", lambda: _ready("first"))
        wait_for("a's handler", lambda: "repository_changed" in logs["a"].read_text())
        time.sleep(2 * RETRY)  # give a wrongly active standby the time to show itself
        writes = [r for r in acted("a") if r["verb"] in ("POST", "PUT", "PATCH", "DELETE")]
        assert any("/repositories/first" in r["path"] for r in writes), writes
        # The standby asked for nothing but the Lease, and never wrote it.
        assert asked("b") == STANDBY_ASKS
        assert "repository_changed" not in logs["b"].read_text()

        # 20 s at rest: the leader renews every renew interval (PUTs only); the standby, whose
        # watch shows those renewals, asks nothing at all (it read the Lease once and opened
        # one watch, which lasts 5 minutes; polling, it would have read it 10 times more).
        rest = time.time()
        time.sleep(20)
        at_rest = [r for r in api.audit() if r["time"] >= rest and r["time"] < rest + 20]
        renewals = [r for r in at_rest if r["user"] == "a" and r["path"].startswith(LEASES)]
        assert {r["verb"] for r in renewals} == {"PUT"}, renewals
        assert 20 / RENEW - 2 <= len(renewals) <= 20 / RENEW + 1, renewals
        # (A read more, and a watch anew, only if a loaded machine delayed a renewal on the
        # watch for a whole duration: the read at expiry finds it instead.)
        standing_by = [r for r in at_rest if r["user"] == "b"]
        assert len(standing_by) <= 2, standing_by
        assert len([r for r in standing_by if not r["watch"]]) <= 1, standing_by
        reads = [r for r in requests("b") if not r["watch"]]
        assert 1 <= len(reads) <= 2, reads
        # Their metrics say who leads; the standby's Lease read and watch count as API requests.
        assert (
            metric("a", "zarrlake_operator_leader"),
            metric("b", "zarrlake_operator_leader"),
        ) == (
            1,
            0,
        )
        lease_reads = 'zarrlake_operator_api_requests_total{resource="leases",verb="GET"}'
        assert metric("b", lease_reads) >= 1
        lease_watches = 'zarrlake_operator_api_requests_total{resource="leases",verb="WATCH"}'
        assert metric("b", lease_watches) >= 1
        spec = _lease()["spec"]
        assert spec["holderIdentity"].startswith("operator-a_")
        assert spec["leaseDurationSeconds"] == DURATION and spec["leaseTransitions"] == 0
        assert MICRO_TIME.match(spec["acquireTime"]) and MICRO_TIME.match(spec["renewTime"])
        assert spec["renewTime"] > spec["acquireTime"]  # renewed meanwhile

        # SIGKILL the leader: b takes the Lease once it expires (at most a duration after the
        # leader's last renewal, found by the read at expiry), then acts: a Repository created at
        # once turns Ready. Starting Kopf and reconciling on a loaded machine take a while.
        killed = time.monotonic()
        replicas["a"].kill()
        replicas["a"].wait()
        kube.create(_repository("second", moto_s3.endpoint))
        wait_for("b to take the Lease", lambda: _holder().startswith("operator-b_"), 60)
        measured["sigkill: Lease taken"] = time.monotonic() - killed
        wait_for("second Ready", lambda: _ready("second"), 60)
        measured["sigkill: acting (second Ready)"] = time.monotonic() - killed
        assert measured["sigkill: Lease taken"] <= DURATION + RETRY + 3, measured
        assert measured["sigkill: acting (second Ready)"] <= DURATION + RETRY + 15, measured
        assert any("/repositories/second" in r["path"] for r in acted("b"))
        # Its /healthz is Kopf's now, on the port the standby answered on (the probes' port).
        assert fetch(f"http://127.0.0.1:{health_ports['b']}/healthz") != '{"standby": true}'
        assert _lease()["spec"]["leaseTransitions"] == 1

        # SIGTERM the leader: it stops Kopf, then releases the Lease, and c takes it at once.
        start("c")
        wait_for("c to watch the Lease", lambda: watching("c"))
        assert acted("c") == []
        signalled = time.monotonic()
        replicas["b"].send_signal(signal.SIGTERM)
        assert replicas["b"].wait(120) == 0
        exited = time.monotonic()
        last = requests("b")[-1]
        assert (last["verb"], last["path"]) == ("PUT", LEASE)  # the release, after all else
        kube.create(_repository("third", moto_s3.endpoint))
        wait_for("c to take the Lease", lambda: _holder().startswith("operator-c_"), 60)
        taken = time.monotonic()
        wait_for("third Ready", lambda: _ready("third"), 60)
        measured["sigterm: old leader exited"] = exited - signalled
        measured["sigterm: Lease taken after the exit"] = taken - exited
        measured["sigterm: acting (third Ready)"] = time.monotonic() - signalled
        # Without the release c would wait out the duration after b's last renewal (>= 6 s
        # after the exit); released, it takes it as soon as its watch shows that.
        assert measured["sigterm: Lease taken after the exit"] <= RETRY + 3, measured
        assert _lease()["spec"]["leaseTransitions"] == 2

        # A leader whose Lease is taken stops acting at once: the process kills itself.
        current = _lease()
        stolen = {**current, "spec": {**current["spec"], "holderIdentity": "intruder"}}
        kube._call("PUT", LEASE, body=stolen)
        assert replicas["c"].wait(RENEW + 10) == -signal.SIGKILL  # it ended itself at once
        assert "Leadership lost (the Lease was taken by intruder)" in logs["c"].read_text()

        # A standby (the intruder's Lease is not expired) stops on SIGTERM at once, cleanly.
        start("d")
        assert fetch(f"http://127.0.0.1:{health_ports['d']}/healthz") == '{"standby": true}'
        wait_for("d to read the Lease", lambda: requests("d"))
        signalled = time.monotonic()
        replicas["d"].send_signal(signal.SIGTERM)
        assert replicas["d"].wait(30) == 0
        assert time.monotonic() - signalled < RETRY + 2
        assert asked("d") <= STANDBY_ASKS and ("GET", LEASE, False) in asked("d")
        assert _holder() == "intruder"
        print("\nfailover measurements (s):", {k: round(v, 1) for k, v in measured.items()})
    finally:
        for proc in replicas.values():
            stop(proc)
        api.stop()
        # The kube client is process-wide: give it back to the shared operator tests' cluster.
        if os.environ.get("KUBECONFIG"):
            kube.use_kubeconfig(os.environ["KUBECONFIG"])


def test_lease_timings_that_cannot_work_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from zarrlake_operator.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["run", "--lease-duration", "5", "--lease-renew-deadline", "7"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "lease duration > renew deadline" in err and "Traceback" not in err
