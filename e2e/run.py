#!/usr/bin/env python3
"""The operator scenario, end to end, on this machine: ``make e2e``.

No cluster and no Docker: a Kubernetes API emulator (KMock-based,
:mod:`zarrlake_testkit.kubeapi`) serves the API over HTTP, moto_server serves S3, and
:class:`zarrlake_testkit.emulated.LocalCluster` plays the controllers the emulator lacks (a real
redis-server for the lock Deployment, Jobs run as local processes). Everything else is the real
thing: kubectl, the operator process, PySpark ``local[2]``, and the zarrlake client through
``Repository.from_kubernetes``.

Steps:
 1. the upgrade: install the previous release's CRDs (``tests/operator/previous_release``, as its
    chart's ``crds/`` folder did) and apply ``examples/kubernetes`` with ``kubectl apply -k`` (a
    kustomize overlay points the repository at moto and makes retention aggressive enough to
    free data); then upgrade the CRDs to what this chart renders (as ``helm upgrade`` applies
    them), check that every stored object is still there, the same, and start this operator;
 2. wait for the Repository to become Ready (bucket provisioned, Redis up, repository created),
    and judge it as Argo CD (the chart's Lua health checks) and Flux (kstatus) do: Healthy and
    Current; a Repository whose spec cannot be acted on: Degraded and Failed, with one Warning;
 3. write and commit an array from a PySpark job through ``Repository.from_kubernetes``;
 4. create a Branch and a Tag with ``kubectl apply`` and wait for their statuses (and health);
    re-apply the whole tree ten times (client-side and server-side apply, as Argo CD and Flux
    do) and check that the operator sent no write meanwhile (the API server's audit log tells
    its requests from kubectl's);
 5. apply ``examples/kubernetes/mirror.yaml`` (destination: a second S3 server), play its
    replicator Deployment, and watch the Mirror's status catch up; read the data at the mirror;
 6. run the GC CronJob now (a Job from its template, with kubectl) and check the policy's status;
 7. delete the Branch and Tag with kubectl and check they are gone from the repository.

The cluster-side steps are in ``e2e/kind.sh`` for a real cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The GitOps judges (Argo CD's Lua health checks in a real Lua, kstatus) the operator tests use.
sys.path.insert(0, str(ROOT / "tests" / "operator"))
NS = "default"
REPO = "climate"
POLICY = "climate-retention"
MIRROR = "climate-west"
REPLICATOR = f"zl-{MIRROR}-mirror"


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


class Scenario:
    def __init__(self, workdir: Path, kubeconfig: Path) -> None:
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        from zarrlake_testkit.emulated import kubectl_binary

        self.kubectl_bin = kubectl_binary()

    def kubectl(self, *args: str, check: bool = True, show: bool = True) -> str:
        # A discovery cache of our own: kubectl keys it by host:port, and ports get reused.
        cache = str(self.workdir / "kubectl-cache")
        cmd = [self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), "--cache-dir", cache, *args]
        if show:
            print("$ kubectl " + " ".join(args), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if show and done.stdout.strip():
            print(done.stdout.rstrip())
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", kind, name, "-o", "json", show=False))

    def wait(self, what: str, check: Any, timeout: float = 240) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except RuntimeError as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what} (last: {last!r})")

    def ready(self, kind: str, name: str, *also: str) -> dict[str, Any] | None:
        """The object if its Ready condition (and each condition in ``also``) is True."""
        obj = self.get(kind, name)
        true = {
            c.get("type")
            for c in (obj.get("status") or {}).get("conditions") or []
            if c.get("status") == "True"
        }
        return obj if {"Ready", *also} <= true else None


#: The release whose CRDs the upgrade starts from (its chart's crds/, kept in the tests).
PREVIOUS = "0.2.0"

#: A spec the schema accepts and the operator cannot act on: sessions of 30 days (the engine's
#: limit is 7, which GC's grace relies on; the schema only sees a duration).
BROKEN_REPOSITORY = f"""apiVersion: zarrlake.io/v1alpha1
kind: Repository
metadata:
  name: broken
  namespace: {NS}
spec:
  storage:
    provider: s3
    bucket: zarrlake-broken
  lockService:
    mode: none
  config:
    sessionTTL: 30d
"""


def _judged(obj: dict[str, Any]) -> tuple[dict[str, str], tuple[str, str]] | None:
    """(Argo CD's health, kstatus's reading) of ``obj``, once its status says anything."""
    from gitops_checks import argo_health, kstatus

    if not (obj.get("status") or {}).get("conditions"):
        return None
    return argo_health(obj), kstatus(obj)


def healthy(k: Scenario, kind: str, name: str) -> None:
    """``kind/name`` as Argo CD and Flux see it now: Healthy and Current, or fail."""
    judged = _judged(k.get(kind, name))
    print(f"{kind}/{name}: Argo CD {judged and judged[0]}, Flux {judged and judged[1]}")
    assert judged is not None and judged[0]["status"] == "Healthy", judged
    assert judged[1][0] == "Current", judged


def overlay(workdir: Path, s3_endpoint: str) -> Path:
    """A kustomize overlay of examples/kubernetes for this run (what a GitOps repo would hold)."""
    out = workdir / "overlay"
    out.mkdir()
    for name in ("credentials.yaml", "repository.yaml", "retention.yaml"):
        shutil.copy(ROOT / "examples" / "kubernetes" / name, out / name)
    # Aggressive on purpose: keep one snapshot per branch, no grace, so the GC run frees data.
    # JSON patches (not merges): the example's rules must be replaced, not combined.
    (out / "kustomization.yaml").write_text(
        f"""resources: [credentials.yaml, repository.yaml, retention.yaml]
namespace: {NS}
patches:
  - target: {{kind: Repository, name: {REPO}}}
    patch: |-
      - op: add
        path: /spec/storage/endpointURL
        value: {s3_endpoint}
  - target: {{kind: RetentionPolicy, name: {POLICY}}}
    patch: |-
      - op: replace
        path: /spec/rules
        value: {{default: {{last: 1}}, branches: {{}}}}
      - op: add
        path: /spec/gc/grace
        value: 0s
      - op: add
        path: /spec/gc/force
        value: true
"""
    )
    return out


def chart_crds(workdir: Path) -> Path:
    """The CustomResourceDefinitions of ``helm template`` (Helm's own engine), as one file."""
    import helm_python as helm
    import yaml

    with helm.Chart.load(ROOT / "charts" / "zarrlake-operator") as chart:
        manifests = chart.render(None, name="zarrlake-operator", namespace="zarrlake-system")
    crds = [
        doc
        for path, text in manifests.items()
        if path.endswith(".yaml")  # not NOTES.txt
        for doc in yaml.safe_load_all(text)
        if doc and doc.get("kind") == "CustomResourceDefinition"
    ]
    assert len(crds) == 5, [c["metadata"]["name"] for c in crds]
    out = workdir / "crds.yaml"
    out.write_text(yaml.safe_dump_all(crds))
    return out


def mirror_manifest(workdir: Path, s3_endpoint: str) -> Path:
    """examples/kubernetes/mirror.yaml pointed at this run's second S3 server, passing often."""
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "mirror.yaml").read_text()))
    for doc in docs:
        if doc["kind"] == "Mirror":
            doc["spec"]["destination"]["endpointURL"] = s3_endpoint
            doc["spec"]["interval"] = "1s"
    out = workdir / "mirror.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    return out


def spark_write(repo: Any, lock_note: str) -> str:
    """Write a 64x64 float array from 4 partitions of a local[2] Spark job; one commit."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers import zarrlake too
    from pyspark.sql import SparkSession

    from zarrlake.spark import BlockWriter, write_partitions

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("zarrlake-e2e")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    try:
        import numpy as np
        import zarr

        def setup(store: Any) -> None:
            zarr.create_array(
                store,
                name="temperature",
                shape=(64, 64),
                chunks=(16, 16),
                dtype="float32",
                fill_value=0,
            )

        def rows(i: int) -> tuple[tuple[int, int], Any]:
            block = np.full((16, 64), float(i), dtype="float32")
            return ((i * 16, 0), block)

        data = spark.sparkContext.parallelize(range(4), 4).map(rows)
        writer = BlockWriter("temperature")
        commit = write_partitions(
            data,
            repo,
            "main",
            writer=writer,
            setup=setup,
            message=f"temperature from Spark ({lock_note})",
            author="e2e",
        )
        return commit
    finally:
        spark.stop()


WRITES = ("POST", "PUT", "PATCH", "DELETE")


def quiet_reapplies(k: Scenario, api: Any, tree: Path, times: int = 10) -> list[dict[str, Any]]:
    """Wait until the operator has rested (no write for three resyncs), re-apply the overlay,
    the Branch and the Tag ``times`` times, alternately client-side and server-side, and return
    the writes the operator sent meanwhile (and for three resyncs after)."""

    def operator_writes(since: float) -> list[dict[str, Any]]:
        return [
            r
            for r in api.audit()
            if r["user"] == "operator" and r["verb"] in WRITES and r["time"] >= since
        ]

    k.wait("the operator at rest", lambda: not operator_writes(time.time() - 6), timeout=120)
    started = time.time()
    examples = ROOT / "examples" / "kubernetes"
    for i in range(times):
        mode = ["--server-side", "--force-conflicts"] if i % 2 else []
        k.kubectl("apply", *mode, "-k", str(tree), show=i == 0)
        for name in ("branch.yaml", "tag.yaml"):
            k.kubectl("apply", *mode, "-n", NS, "-f", str(examples / name), show=i == 0)
    time.sleep(6)
    return operator_writes(started)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    # SIGTERM (a test's deadline) unwinds like an error, so `finally` stops every process by pid.
    signal.signal(signal.SIGTERM, _terminated)

    from zarrlake_operator import kube
    from zarrlake_testkit.emulated import LocalCluster, start_operator
    from zarrlake_testkit.kubeapi import KubeAPI
    from zarrlake_testkit.servers import start_moto, stop

    workdir = Path(tempfile.mkdtemp(prefix="zarrlake-e2e-"))
    procs: list[Any] = []
    api = cluster = None
    ok = False
    try:
        say("starting moto_server (S3) and the Kubernetes API emulator")
        moto, s3 = start_moto()
        procs.append(moto)
        api = KubeAPI(audit_log=workdir / "audit.jsonl").start()
        kubeconfig = api.write_kubeconfig(workdir / "kubeconfig")
        os.environ["KUBECONFIG"] = str(kubeconfig)
        kube.use_kubeconfig(str(kubeconfig))
        k = Scenario(workdir, kubeconfig)
        print(f"S3 at {s3}, Kubernetes API at {api.url}, kubeconfig {kubeconfig}")

        say(f"helm install of the previous release ({PREVIOUS}): its CRDs, then the tree")
        k.kubectl(
            "create",
            "-f",
            str(ROOT / "tests" / "operator" / "previous_release" / PREVIOUS / "crds"),
        )
        tree = overlay(workdir, s3)
        k.kubectl("apply", "-k", str(tree))
        stored = {
            (o["kind"], o["metadata"]["name"]): o
            for o in json.loads(k.kubectl("get", "zarrlake", "-o", "json", show=False))["items"]
        }
        assert {kind for kind, _ in stored} == {"Repository", "RetentionPolicy"}, sorted(stored)

        say("helm upgrade: the CRDs as this chart renders them, over the live ones")
        k.kubectl("apply", "-f", str(chart_crds(workdir)))
        k.kubectl("get", "crds")
        for crd in json.loads(k.kubectl("get", "crds", "-o", "json", show=False))["items"]:
            assert crd["status"]["storedVersions"] == ["v1alpha1"], crd["metadata"]["name"]
        for (kind, name), old in stored.items():
            now = k.get(kind, name)
            for key in ("uid", "creationTimestamp", "generation"):
                assert now["metadata"][key] == old["metadata"][key], (kind, name, key)
            assert now["spec"] == old["spec"], (kind, name)
        print(f"{len(stored)} objects stored by {PREVIOUS}'s CRDs: unchanged by the upgrade")

        say("starting this release's operator and the local cluster (lock Deployments, Jobs)")
        # Its own token: the audit log tells the operator's requests from everyone else's.
        operator_kubeconfig = api.write_kubeconfig(workdir / "operator.kubeconfig", "operator")
        operator, _liveness, metrics_port = start_operator(
            operator_kubeconfig, log_path=workdir / "operator.log", resync_seconds=2
        )
        procs.append(operator)
        cluster = LocalCluster(workdir, [NS]).start()

        say("kubectl apply -k again, as GitOps syncs after an upgrade")
        k.kubectl("apply", "-k", str(tree))
        # Ready as soon as bucket and repository are; its Redis may still be starting (Degraded).
        repo_obj = k.wait(
            "Repository Ready, Redis up", lambda: k.ready("repository", REPO, "LockServiceReady")
        )
        k.kubectl("get", "zarrlake")
        k.kubectl("get", "repository", REPO, "-o", "wide")
        status = repo_obj["status"]
        assert status["url"].startswith("s3://zarrlake-climate/repos/climate"), status
        assert status["lockEndpoint"].startswith("redis://zl-climate-lock.default.svc"), status
        k.wait("CronJobs", lambda: k.kubectl("get", "cronjobs", "-o", "name", show=False).split())
        k.kubectl("get", "cronjobs")
        healthy(k, "repository", REPO)

        say("a Repository the operator cannot act on: Degraded for Argo CD, Failed for Flux")
        broken = workdir / "broken.yaml"
        broken.write_text(BROKEN_REPOSITORY)
        k.kubectl("apply", "-n", NS, "-f", str(broken))
        judged = k.wait("its status", lambda: _judged(k.get("repository", "broken")))
        print(f"Argo CD: {judged[0]}; Flux (kstatus): {judged[1]}")
        assert judged[0]["status"] == "Degraded" and judged[1][0] == "Failed", judged
        warnings = k.wait(
            "its Warning event",
            lambda: [
                e
                for e in json.loads(k.kubectl("get", "events", "-o", "json", show=False))["items"]
                if e["involvedObject"]["name"] == "broken" and e["type"] == "Warning"
            ],
        )
        assert len(warnings) == 1, warnings
        print(f"event: {warnings[0]['reason']}: {warnings[0]['message']}")
        k.kubectl("delete", "-n", NS, "-f", str(broken))

        say("a PySpark local[2] job writes through Repository.from_kubernetes")
        import zarrlake

        lock_url = cluster.resolve(status["lockEndpoint"])
        repo = zarrlake.Repository.from_kubernetes(REPO, NS, lock_url=lock_url)
        print(f"opened {repo.id} with lock {type(repo.lock).__name__}")
        first = spark_write(repo, "first")
        # A second, overwriting commit makes the first one's chunks garbage once it expires.
        session = repo.writable_session("main")
        import zarr

        arr = zarr.open_array(session.store, path="temperature", mode="r+")
        arr[:] = 42.0
        second = session.commit("overwrite with 42", author="e2e")
        print(f"commits: {first} (Spark), {second} (overwrite)")

        say("kubectl apply a Branch and a Tag")
        k.kubectl("apply", "-n", NS, "-f", str(ROOT / "examples" / "kubernetes" / "branch.yaml"))
        k.kubectl("apply", "-n", NS, "-f", str(ROOT / "examples" / "kubernetes" / "tag.yaml"))
        branch = k.wait("Branch Ready", lambda: k.ready("branch", "experiment-1"))
        tag = k.wait("Tag Ready", lambda: k.ready("tag", "v1"))
        k.kubectl("get", "branches,tags", "-o", "wide")
        assert branch["status"]["head"] == second, branch["status"]
        assert tag["status"]["snapshot"] == second, tag["status"]
        healthy(k, "branch", "experiment-1")
        healthy(k, "tag", "v1")
        healthy(k, "retentionpolicy", POLICY)
        assert repo.list_branches()["experiment-1"] == second
        assert repo.list_tags()["v1"] == second
        k.wait(
            "Repository counts",
            lambda: (s := k.get("repository", REPO)["status"])["branches"] == 2 and s["tags"] == 1,
        )

        say("re-apply the unchanged tree ten times: the operator writes nothing")
        writes = quiet_reapplies(k, api, tree)
        print(f"operator writes during 10 re-applies: {len(writes)}")
        assert not writes, json.dumps(writes, indent=1)

        say("kubectl apply a Mirror (examples/kubernetes/mirror.yaml) on a second S3 server")
        west_proc, west = start_moto()
        procs.append(west_proc)
        mirror_file = mirror_manifest(workdir, west)
        k.kubectl("apply", "-n", NS, "-f", str(mirror_file))
        deployment = k.wait("the replicator Deployment", lambda: k.get("deployment", REPLICATOR))
        k.kubectl("get", "deployment", REPLICATOR, "-o", "wide")
        waiting = k.wait("the Mirror waiting for its replicator", lambda: k.get("mirror", MIRROR))
        print("Mirror status:", json.dumps(waiting.get("status", {}).get("conditions")))
        # No kubelet runs the Deployment's pod here: its container's command runs as a process,
        # with the environment the pod would get (zarrlake_testkit.emulated), a pass at a time.
        from zarrlake_testkit.emulated import replicator, run_replicator_pass

        for _ in range(10):
            status = run_replicator_pass(deployment)
            if all(r["source_head"] == r["mirrored_head"] for r in status["refs"]):
                break
        promoter = replicator(deployment)
        mirrored = k.wait(
            "the Mirror's status caught up",
            lambda: (
                (m := k.ready("mirror", MIRROR))
                and {r["name"]: r for r in m["status"].get("refs") or []}.get("main", {}).get(
                    "mirroredHead"
                )
                == second
                and m
            ),
        )
        k.kubectl("get", "mirror", MIRROR, "-o", "wide")
        healthy(k, "mirror", MIRROR)
        refs = {(r["kind"], r["name"]): r for r in mirrored["status"]["refs"]}
        assert refs[("tag", "v1")]["mirroredHead"] == second, refs
        assert ("branch", "experiment-1") not in refs, refs  # not in spec.branches
        mirror_repo = zarrlake.Repository.open(promoter.destination)
        value = zarr.open_array(mirror_repo.readonly_session("main").store, path="temperature")
        assert float(value[63, 63]) == 42.0
        print(f"read main at the mirror ({mirror_repo.lookup_branch('main')}): 42.0")

        say("run the GC CronJob now (a Job from its jobTemplate)")
        policy = k.get("retentionpolicy", POLICY)
        cron = policy["status"]["gcCronJob"]
        # What `kubectl create job gc-now --from=cronjob/...` does, sent as JSON: that kubectl
        # command speaks protobuf, which the emulator decodes for a few kinds only.
        template = json.loads(k.kubectl("get", "cronjob", cron, "-o", "json", show=False))
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": "gc-now",
                "labels": template["spec"]["jobTemplate"]["metadata"]["labels"],
                "annotations": {"cronjob.kubernetes.io/instantiate": "manual"},
            },
            "spec": template["spec"]["jobTemplate"]["spec"],
        }
        (workdir / "gc-now.json").write_text(json.dumps(job))
        k.kubectl("create", "-f", str(workdir / "gc-now.json"))
        policy = k.wait(
            "the GC run in the policy's status",
            lambda: (p := k.get("retentionpolicy", POLICY))["status"].get("lastGC") and p,
            timeout=300,
        )
        last = policy["status"]["lastGC"]
        print("lastGC:", json.dumps(last))
        for entry in cluster.job_log:
            print(f"job {entry['job']} exited {entry['exit']}: {entry['logs'].strip()[:400]}")
        assert last["result"] == "Succeeded", last
        assert last["snapshotsExpired"] >= 1 and last["objectsDeleted"] >= 1, last
        assert last["bytesFreed"] > 0, last
        k.kubectl("get", "retentionpolicies")
        fsck = repo.fsck()
        print("fsck after GC:", fsck.summary() if hasattr(fsck, "summary") else fsck)
        assert (
            float(zarr.open_array(repo.readonly_session("v1").store, path="temperature")[0, 0])
            == 42.0
        )

        say("kubectl delete the Branch and the Tag")
        k.kubectl("delete", "branch", "experiment-1")
        k.kubectl("delete", "tag", "v1")
        k.wait("branch gone", lambda: "experiment-1" not in repo.list_branches())
        k.wait("tag gone", lambda: "v1" not in repo.list_tags())
        columns = "TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message"
        k.kubectl("get", "events", "-o", f"custom-columns={columns}", check=False)

        say("operator metrics")
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        wanted = ("zarrlake_operator_reconciles_total", "zarrlake_operator_reconcile_duration")
        for line in text.splitlines():
            if line.startswith(wanted) and ("_sum" in line or "_count" in line or "total" in line):
                print(line)
        ok = True
        say("e2e passed")
        return 0
    finally:
        if cluster is not None:
            cluster.stop()
        for proc in reversed(procs):
            stop(proc)
        if api is not None:
            api.stop()
        if not ok:
            log = workdir / "operator.log"
            if log.exists():
                print("\n--- operator log (tail) ---")
                print("\n".join(log.read_text().splitlines()[-60:]))
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work directory kept: {workdir}")


if __name__ == "__main__":
    sys.exit(main())
