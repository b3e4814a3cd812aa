"""What leader election costs at rest (issue 15): API requests per minute of each replica.

    python bench/lease_idle.py                    # two replicas, 60 s measured
    python bench/lease_idle.py --replicas 3 --seconds 120

Real operator processes electing their leader on the Lease (default timings, resync every 60 s as
deployed) against the emulated Kubernetes API of the test kit, which keeps an audit log: every
replica has a token of its own, so the log tells each replica's requests apart — the Lease's
(GET, PUT, WATCH) and everything else (the leader's Kopf watches and reconciles). No custom
objects exist: what is measured is the election's cost and the operator's idle floor. A watch
counts once, when it is opened (a real API server's audit log has one entry per request too).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from zarrlake_operator import kube
from zarrlake_testkit.emulated import start_operator
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import stop

ROOT = Path(__file__).resolve().parents[1]
LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


def holder() -> str:
    try:
        lease = kube._call("GET", f"{LEASES}/zarrlake-operator") or {}
    except kube.KubeError:
        return ""
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def wait(what: str, condition: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def measure(replicas: int, seconds: float, settle: float, work: Path) -> dict[str, Any]:
    api = KubeAPI(audit_log=work / "audit.jsonl").start()
    procs: dict[str, Any] = {}
    try:
        kube.use_kubeconfig(str(api.write_kubeconfig(work / "admin.kubeconfig", "admin")))
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            kube._call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                body=yaml.safe_load(path.read_text()),
            )
        for i in range(replicas):
            who = f"r{i}"
            kubeconfig = api.write_kubeconfig(work / f"{who}.kubeconfig", token=who)
            procs[who], _, _ = start_operator(
                kubeconfig,
                log_path=work / f"{who}.log",
                leader_election=True,
                resync_seconds=60,
                extra_env={"POD_NAME": who},
            )
            if i == 0:
                wait("the first replica to lead", lambda: holder().startswith("r0_"))
        time.sleep(settle)
        start = time.time()
        time.sleep(seconds)
        end = time.time()
        counts: dict[str, collections.Counter[str]] = {w: collections.Counter() for w in procs}
        others: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for r in api.audit():
            if r["user"] in counts and start <= r["time"] < end:
                lease = r["path"].startswith(LEASES)
                verb = "WATCH" if r.get("watch") else r["verb"]
                counts[r["user"]][f"lease {verb}" if lease else "other"] += 1
                if not lease:
                    others[r["user"], verb, r["path"]] += 1
        leader = holder().split("_")[0]
        return {"leader": leader, "seconds": end - start, "counts": counts, "others": others}
    finally:
        for proc in procs.values():
            stop(proc)
        api.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured (at rest)")
    ap.add_argument("--settle", type=float, default=15.0, help="after the last replica started")
    ap.add_argument("--show-other", action="store_true", help="list the other requests too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.replicas, args.seconds, args.settle, Path(tmp))
    per_min = 60.0 / result["seconds"]
    print(
        f"{result['seconds']:.0f} s at rest, requests per minute (audit log of the emulated API):"
    )
    print(
        "| replica | Lease GET | Lease PUT | Lease WATCH | Lease, all | other (Kopf, reconciles) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for who, counter in sorted(result["counts"].items()):
        role = "leader" if who == result["leader"] else "standby"
        lease = {v: counter[f"lease {v}"] * per_min for v in ("GET", "PUT", "WATCH", "POST")}
        print(
            f"| {who} ({role}) | {lease['GET']:.1f} | {lease['PUT']:.1f} | {lease['WATCH']:.1f} "
            f"| {sum(lease.values()):.1f} | {counter['other'] * per_min:.1f} |"
        )
    if args.show_other:
        for (who, verb, path), n in sorted(result["others"].items()):
            print(f"{who} {verb} {path}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
