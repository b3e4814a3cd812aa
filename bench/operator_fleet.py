"""Operator fleet benchmark (issue 15): objects → time to Ready, then the cost of doing nothing.

    python bench/operator_fleet.py                       # 350 and 1,400 objects
    python bench/operator_fleet.py --sizes 350,1400,5000 --markdown bench/results/operator_fleet.md

The real operator process (standalone, log level INFO, resync every 60 s as deployed) against the
emulated Kubernetes API of the test kit and one moto_server; all in one namespace. Each
repository brings 7 objects: a Repository (``lockService: none``, bucket provisioned), 4 Branches,
1 Tag and 1 RetentionPolicy. Measured:

- **time to Ready**: from the first create until every object reports Ready=True: the newest
  ``lastTransitionTime`` of their Ready conditions (whole seconds, so rounded up by one second),
  found by listing them every second, or every ``objects / 1000`` seconds beyond 1,000 objects
  (the listings cost the API server and this process CPU that the operator shares);
- **at rest**, over ``--idle`` seconds after ``--settle`` more (covering a resync of everything):
  the operator's CPU (utime + stime from /proc, as a share of one core), its S3 requests per
  minute (moto_server's request log; SeaweedFS keeps none), its API requests per
  minute (``zarrlake_operator_api_requests_total``: every request of the reconciliations; Kopf's
  watch streams are long-lived and not counted) and its resident memory (VmRSS);
- **machine load**: the 1-minute load average before the run and at the end of the rest period
  (the machine's other work disturbs both figures);
- **CPU to Ready** of the operator, the S3 server and the emulated API's process, from /proc:
  the run is CPU-bound on a small machine, and this says who used it.

``--s3-server seaweedfs`` runs the buckets on SeaweedFS instead of moto_server: moto is a Python
process that spends ~3 ms of CPU on each request on the cores the operator needs, where a cluster's
object store runs elsewhere. SeaweedFS has no PutPublicAccessBlock, so the operator cannot
provision buckets there (``ProvisionFailed``): the buckets are made before the clock starts and
the Repositories say ``provision: false``; each gets one object (``bench/warm``, a key no
repository uses) so that SeaweedFS allocates its volume before the clock starts too.
``--profile DIR`` records the operator with py-spy (samples of the thread holding the GIL) from
the first create until every object is Ready (``DIR/operator-<size>.txt``, collapsed stacks).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from harness import RequestLog
from zarrlake_operator import kube
from zarrlake_testkit.emulated import start_operator
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import start_moto, start_seaweedfs, stop

ROOT = Path(__file__).resolve().parents[1]
NS = "default"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
PER_REPOSITORY = 7


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def custom(kind: str, name: str, spec: dict[str, Any]) -> None:
    kube.create(
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": kind,
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }
    )


def ready(kind: str) -> list[str]:
    """The Ready conditions' lastTransitionTime of the objects of ``kind`` that are Ready."""
    times = []
    for obj in kube.list_(kind, NS):
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready" and cond.get("status") == "True":
                times.append(cond["lastTransitionTime"])
    return times


def epoch(timestamp: str) -> float:
    return dt.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def api_requests(metrics_port: int) -> dict[str, float]:
    """The operator's API request counts by ``verb resource``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as rsp:
        text = rsp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("zarrlake_operator_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            verb = labels.split('verb="')[1].split('"')[0]
            resource = labels.split('resource="')[1].split('"')[0]
            out[f"{verb} {resource}"] = float(value)
    return out


def run(
    size: int,
    idle: float,
    settle: float,
    work: Path,
    s3_server: str = "moto",
    profile: Path | None = None,
) -> dict[str, float]:
    repos = max(1, size // PER_REPOSITORY)
    s3_log = ""
    if s3_server == "seaweedfs":
        weed = start_seaweedfs(work / "seaweedfs")
        s3_proc, endpoint = weed.proc, weed.endpoint
        stop_s3 = weed.stop
    else:
        s3_log = str(work / "moto.log")
        s3_proc, endpoint = start_moto(log=s3_log)
        stop_s3 = lambda: stop(s3_proc)  # noqa: E731
    # moto logs every request; SeaweedFS none (no S3 figure then).
    requests_s3 = None if s3_server == "seaweedfs" else RequestLog(s3_log)
    api = KubeAPI().start()
    operator = None
    spy = None
    try:
        kubeconfig = api.write_kubeconfig(work / "kubeconfig")
        kube.use_kubeconfig(str(kubeconfig))
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
                "metadata": {"name": "creds", "namespace": NS},
                "stringData": CREDENTIALS,
            }
        )
        operator, _, metrics_port = start_operator(
            kubeconfig,
            log_path=work / "operator.log",
            resync_seconds=60,
            extra_env={"ZARRLAKE_LOG_LEVEL": "INFO"},
        )
        if s3_server == "seaweedfs":
            import boto3

            s3 = boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            )
            for r in range(repos):
                # SeaweedFS gives each bucket its own volume at the bucket's first write (~0.2 s,
                # one bucket at a time in its master): written once here, that happens before
                # the clock, as S3 has no such cost to measure.
                s3.create_bucket(Bucket=f"fleet-{r:04d}")
                # (Not empty: an empty object needs no volume.)
                s3.put_object(Bucket=f"fleet-{r:04d}", Key="bench/warm", Body=b"w")
        load_before = os.getloadavg()[0]
        api_pid = api.pid
        assert api_pid is not None
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--pid",
                 str(operator.pid), "--format", "raw", "--rate", "20", "--gil", "--nonblocking",
                 "--output", str(profile / f"operator-{size}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        cpu_before = {
            "operator": cpu_seconds(operator.pid),
            "s3": cpu_seconds(s3_proc.pid),
            "api": cpu_seconds(api_pid),
        }
        started, started_at = time.monotonic(), time.time()
        for r in range(repos):
            repo = f"r{r:04d}"
            custom(
                "Repository",
                repo,
                {
                    "storage": {
                        "bucket": f"fleet-{r:04d}",
                        "endpointURL": endpoint,
                        "region": "us-east-1",
                        "credentialsSecret": {"name": "creds"},
                        "provision": s3_server != "seaweedfs",
                    },
                    "lockService": {"mode": "none"},
                },
            )
            for b in range(4):
                custom("Branch", f"{repo}-b{b}", {"repository": repo, "name": f"b{b}"})
            custom("Tag", f"{repo}-t", {"repository": repo, "name": "v1", "ref": "main"})
            custom(
                "RetentionPolicy", f"{repo}-p", {"repository": repo, "gc": {"schedule": "@daily"}}
            )
        total = repos * PER_REPOSITORY
        created = time.monotonic() - started
        progress(f"{total} objects created in {created:.1f} s")
        while True:
            times = [
                t for k in ("Repository", "Branch", "Tag", "RetentionPolicy") for t in ready(k)
            ]
            if len(times) >= total:
                break
            if time.monotonic() - started > 1800:
                raise SystemExit(f"only {len(times)} of {total} Ready after 30 min")
            time.sleep(max(1.0, total / 1000))
        to_ready = epoch(max(times)) + 1 - started_at
        progress(
            "Ready by then: "
            + ", ".join(
                f"{q}% at {epoch(sorted(times)[len(times) * q // 100 - 1]) + 1 - started_at:.0f} s"
                for q in (25, 50, 75, 90, 100)
            )
        )
        cpu_ready = {
            "operator": cpu_seconds(operator.pid),
            "s3": cpu_seconds(s3_proc.pid),
            "api": cpu_seconds(api_pid),
        }
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60)
            spy = None
        progress(
            "CPU to Ready: "
            + ", ".join(f"{k} {cpu_ready[k] - cpu_before[k]:.1f} s" for k in cpu_ready)
        )
        progress(f"{total} objects Ready in {to_ready:.1f} s; settling for {settle:.0f} s")
        time.sleep(settle)  # retries of handlers that waited for their Repository, first resyncs
        progress(f"at rest for {idle:.0f} s")
        s3_mark = requests_s3.mark() if requests_s3 is not None else 0
        cpu0, req0, t0 = cpu_seconds(operator.pid), api_requests(metrics_port), time.monotonic()
        time.sleep(idle)
        cpu1, req1, t1 = cpu_seconds(operator.pid), api_requests(metrics_port), time.monotonic()
        s3_per_min = (
            60 * sum(requests_s3.since(s3_mark).values()) / (t1 - t0)
            if requests_s3 is not None
            else float("nan")
        )
        progress(f"at rest, S3 requests/min: {s3_per_min:.0f}")
        per_min = {k: 60 * (v - req0.get(k, 0)) / (t1 - t0) for k, v in req1.items()}
        progress(
            "at rest, requests/min: "
            + ", ".join(
                f"{k} {v:.0f}" for k, v in sorted(per_min.items(), key=lambda kv: -kv[1]) if v
            )
        )
        return {
            "objects": total,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "to_ready_s": to_ready,
            "per_object_ms": 1000 * to_ready / total,
            "idle_cpu": (cpu1 - cpu0) / (t1 - t0),
            "idle_requests_per_min": sum(per_min.values()),
            "idle_s3_per_min": s3_per_min,
            "rss_mib": rss_mib(operator.pid),
            "created_s": created,
            **{f"cpu_to_ready_{k}_s": cpu_ready[k] - cpu_before[k] for k in cpu_ready},
        }
    finally:
        if spy is not None:
            spy.kill()
        stop(operator)
        api.stop()
        stop_s3()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="350,1400")
    ap.add_argument("--idle", type=float, default=75.0, help="seconds at rest (> one resync)")
    ap.add_argument("--settle", type=float, default=90.0, help="seconds after Ready, not measured")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--s3-server", choices=["moto", "seaweedfs"], default="moto")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy the operator into here")
    args = ap.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            progress(f"{size} objects")
            rows.append(run(size, args.idle, args.settle, Path(tmp), args.s3_server, args.profile))
    lines = [
        "| objects | time to Ready | per object | idle CPU (share of a core) "
        "| idle API requests/min | idle S3 requests/min | operator RSS | load before / after "
        "| CPU to Ready: operator / S3 / API |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['objects']:,.0f} | {r['to_ready_s']:.1f} s | {r['per_object_ms']:.0f} ms "
            f"| {100 * r['idle_cpu']:.1f}% | {r['idle_requests_per_min']:.0f} "
            f"| {r['idle_s3_per_min']:.0f} "
            f"| {r['rss_mib']:.0f} MiB | {r['load_before']:.2f} / {r['load_after']:.2f} "
            f"| {r['cpu_to_ready_operator_s']:.1f} / {r['cpu_to_ready_s3_s']:.1f} "
            f"/ {r['cpu_to_ready_api_s']:.1f} s |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
