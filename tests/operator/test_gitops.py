"""GitOps: a tree of manifests applied, re-applied, and judged the way Argo CD and Flux judge it.

One API server of this module's own (with an audit log: each client brings its own token, so
the operator's requests are told apart from kubectl's), the real operator process, moto's S3 and
real ``kubectl``. A 50-object tree (Secrets with ``stringData``, Repositories, Branches, Tags,
RetentionPolicies, Mirrors) is applied once; every test here reads what the operator made of it.

The API server plays one that does not evaluate the CRDs' CEL rules (Kubernetes before 1.25
ignored ``x-kubernetes-validations``): specs those rules would refuse reach the operator, which
must answer each with a reason (:func:`test_a_spec_the_schema_lets_through_gets_a_reason`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from gitops_checks import argo_health, kstatus
from k8s_env import CREDENTIALS, ROOT, wait_for

from zarrlake_operator import kube
from zarrlake_testkit.emulated import (
    LocalCluster,
    kubectl_binary,
    run_replicator_pass,
    start_operator,
)
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import stop

# One worker runs them all (the module's fixture is its own API server and operator).
pytestmark = [
    pytest.mark.operator,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.xdist_group("gitops"),
]

NS = "gitops"
KINDS = ("Repository", "Branch", "Tag", "RetentionPolicy", "Mirror")
WRITES = ("POST", "PUT", "PATCH", "DELETE")
RESYNC_S = 1.0
# alpha runs a managed lock service, delta an HTTP server (spec.serve, two replicas).
REPOSITORIES = ("alpha", "beta", "gamma", "delta")
SERVED = ("delta",)
BRANCHES_PER_REPOSITORY = 6
TAGS_PER_REPOSITORY = 3
MIRRORED = ("beta", "gamma")
REAPPLIES = 10


def without_cel(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD as an API server before Kubernetes 1.25 keeps it: no ``x-kubernetes-validations``
    anywhere in its schemas (such a server drops what it does not know)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    out: dict[str, Any] = strip(crd)
    return out


def tree(s3: str) -> list[dict[str, Any]]:
    """The GitOps tree: per Repository a credentials Secret (``stringData``, as people write
    them), six Branches, three Tags and a RetentionPolicy; two of them mirrored, one served.
    50 objects."""
    docs: list[dict[str, Any]] = []
    api = "zarrlake.io/v1alpha1"

    def resource(kind: str, name: str, spec: dict[str, Any]) -> None:
        docs.append({"apiVersion": api, "kind": kind, "metadata": {"name": name}, "spec": spec})

    for repo in REPOSITORIES:
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{repo}-s3"},
                "type": "Opaque",
                "stringData": dict(CREDENTIALS),
            }
        )
        storage = {
            "bucket": f"zl-gitops-{repo}",
            "prefix": f"repos/{repo}",
            "endpointURL": s3,
            "region": "us-east-1",
            "provision": True,
            "credentialsSecret": {"name": f"{repo}-s3"},
        }
        lock = {"mode": "managed" if repo == "alpha" else "none"}
        spec = {"storage": storage, "lockService": lock}
        if repo in SERVED:
            spec["serve"] = {"enabled": True, "replicas": 2}
        resource("Repository", repo, spec)
        for i in range(BRANCHES_PER_REPOSITORY):
            resource("Branch", f"{repo}-dev-{i}", {"repository": repo, "name": f"dev-{i}"})
        for i in range(TAGS_PER_REPOSITORY):
            resource("Tag", f"{repo}-v{i}", {"repository": repo, "name": f"v{i}", "ref": "main"})
        resource(
            "RetentionPolicy",
            f"{repo}-retention",
            {
                "repository": repo,
                "rules": {"default": {"days": 30}},
                "gc": {"schedule": "0 3 * * *", "grace": "7d"},
            },
        )
    for repo in MIRRORED:
        destination = {
            "bucket": f"zl-gitops-{repo}-mirror",
            "prefix": f"mirrors/{repo}",
            "endpointURL": s3,
            "region": "us-east-1",
            "provision": True,
            "credentialsSecret": {"name": f"{repo}-s3"},
        }
        resource(
            "Mirror",
            f"{repo}-mirror",
            {"repository": repo, "destination": destination, "interval": "1s"},
        )
    return docs


@dataclass
class GitOps:
    api: KubeAPI
    work: Path
    manifest: Path
    objects: list[dict[str, Any]]
    operator_log: Path
    cluster: LocalCluster

    def kubectl(self, *args: str) -> str:
        """Real kubectl as the GitOps tool (it sends its token over HTTPS only: in the audit
        log of this plain-HTTP server its requests have no user)."""
        cmd = [
            kubectl_binary(),
            "--kubeconfig",
            str(self.work / "gitops.kubeconfig"),
            "--cache-dir",
            str(self.work / "kubectl-cache"),
            *args,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def operator_writes(self, since: float, until: float | None = None) -> list[dict[str, Any]]:
        """The writes (POST, PUT, PATCH, DELETE) the operator sent in the window, any path."""
        return [
            r
            for r in self.api.audit()
            if r["user"] == "operator"
            and r["verb"] in WRITES
            and r["time"] >= since
            and (until is None or r["time"] <= until)
        ]

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.operator_log.read_text(errors="replace").splitlines()[-lines:])


def _items(kind: str, namespace: str = NS) -> list[dict[str, Any]]:
    return [{**o, "kind": kind} for o in kube.list_(kind, namespace)]


def _ready(obj: dict[str, Any], *also: str) -> bool:
    true = {
        c.get("type")
        for c in (obj.get("status") or {}).get("conditions") or []
        if c.get("status") == "True"
    }
    return {"Ready", *also} <= true


@pytest.fixture(scope="module")
def gitops(tmp_path_factory: pytest.TempPathFactory, moto_s3: Any) -> Iterator[GitOps]:
    work = tmp_path_factory.mktemp("gitops")
    api = KubeAPI(audit_log=work / "audit.jsonl").start()
    proc = cluster = None
    try:
        kube.use_kubeconfig(str(api.write_kubeconfig(work / "test.kubeconfig", token="test")))
        api.write_kubeconfig(work / "gitops.kubeconfig", token="gitops")
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            kube._call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                body=without_cel(yaml.safe_load(path.read_text())),
            )
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        log = work / "operator.log"
        proc, _, _ = start_operator(
            api.write_kubeconfig(work / "operator.kubeconfig", token="operator"),
            log_path=log,
            resync_seconds=RESYNC_S,
        )
        cluster = LocalCluster(work, [NS]).start(interval=0.2)
        objects = tree(moto_s3.endpoint)
        manifest = work / "tree.yaml"
        manifest.write_text(yaml.safe_dump_all(objects, sort_keys=False))
        env = GitOps(api, work, manifest, objects, log, cluster)
        env.kubectl("apply", "-n", NS, "-f", str(manifest))
        yield env
    finally:
        if cluster is not None:
            cluster.stop()
        stop(proc)
        api.stop()
        # The kube client is process-wide: give it back to the shared operator tests' cluster.
        if os.environ.get("KUBECONFIG"):
            kube.use_kubeconfig(os.environ["KUBECONFIG"])


def _all_ready(env: GitOps) -> list[dict[str, Any]]:
    """Every resource of the tree Ready (the managed lock service and the server up too), the
    Mirrors made mirrors by their replicators' passes; returns them all."""
    for name in (f"{r}-mirror" for r in MIRRORED):
        deployment = wait_for(
            f"replicator of {name}", lambda n=name: kube.get("Deployment", NS, f"zl-{n}-mirror")
        )
        run_replicator_pass(deployment)

    def check() -> list[dict[str, Any]] | None:
        found = [o for kind in KINDS for o in _items(kind)]
        expected = sum(1 for o in env.objects if o["kind"] in KINDS)
        if len(found) != expected or not all(_ready(o) for o in found):
            return None
        repos = [o for o in found if o["kind"] == "Repository"]
        if not all(_ready(o, "LockServiceReady") for o in repos):
            return None
        served = [o for o in repos if o["metadata"]["name"] in SERVED]
        if not all(_ready(o, "ServeReady") for o in served):
            return None
        counted = all(
            (o["status"].get("branches"), o["status"].get("tags"))
            == (BRANCHES_PER_REPOSITORY + 1, TAGS_PER_REPOSITORY)
            for o in repos
        )
        # At rest means the Mirrors up to date too: one still behind its source would, in
        # time, rightly turn Stalled (a write that is no re-apply's). A pass more catches up.
        behind = [
            o["metadata"]["name"]
            for o in found
            if o["kind"] == "Mirror" and (o["status"].get("commitsBehind") or 0) > 0
        ]
        for name in behind:
            run_replicator_pass(kube.get("Deployment", NS, f"zl-{name}-mirror"))
        return found if counted and not behind else None

    try:
        found: list[dict[str, Any]] = wait_for("the whole tree Ready", check, timeout=180)
    except AssertionError:
        states = {
            f"{o['kind']}/{o['metadata']['name']}": (o.get("status") or {}).get("conditions")
            for kind in KINDS
            for o in _items(kind)
            if not _ready(o)
        }
        raise AssertionError(
            f"not Ready: {json.dumps(states, indent=1)}\n{env.log_tail()}"
        ) from None
    return found


def _versions() -> dict[str, str]:
    """The resourceVersion of every object of the tree, by kind/name."""
    return {
        f"{kind}/{o['metadata']['name']}": o["metadata"]["resourceVersion"]
        for kind in (*KINDS, "Secret")
        for o in _items(kind)
    }


def _quiet(env: GitOps, quiet_s: float, timeout: float = 90) -> float:
    """Wait until the operator has made no write for ``quiet_s``; returns when that began.
    A resting tree costs no write (a resync that finds nothing new writes nothing)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = time.time()
        if not env.operator_writes(now - quiet_s):
            return now - quiet_s
        time.sleep(0.5)
    writes = env.operator_writes(time.time() - quiet_s)
    raise AssertionError(f"the operator keeps writing at rest: {json.dumps(writes[-20:])}")


def test_a_no_op_reapply_of_the_tree_makes_the_operator_write_nothing(gitops: GitOps) -> None:
    """Re-applying the same 50 manifests ten times, as a GitOps tool does on every sync (client-
    side and server-side apply, alternately), makes the operator send no write at all: no status
    patch, no annotation, no event. The re-applies themselves do reach the API server (kubectl
    reports the stringData Secrets ``configured``)."""
    assert len(gitops.objects) == 50
    _all_ready(gitops)
    _quiet(gitops, quiet_s=4 * RESYNC_S)
    versions = _versions()
    started = time.time()
    configured = []
    for i in range(REAPPLIES):
        mode = ["--server-side", "--force-conflicts"] if i % 2 else []
        out = gitops.kubectl("apply", "-n", NS, *mode, "-f", str(gitops.manifest))
        configured.append(out)
    time.sleep(5 * RESYNC_S)  # resyncs and watch events of the re-applies have been handled
    writes = gitops.operator_writes(started)
    # kubectl sends no bearer token over plain HTTP: its requests are the unnamed ones.
    sent = [
        r
        for r in gitops.api.audit()
        if r["user"] == "" and r["verb"] in WRITES and r["time"] >= started
    ]
    print(f"operator writes during {REAPPLIES} re-applies: {len(writes)}; kubectl's: {len(sent)}")
    assert sent, "the re-applies sent nothing: this test would measure nothing"
    moved = {k: (v, _versions().get(k)) for k, v in versions.items() if _versions().get(k) != v}
    print(f"resourceVersions moved: {moved}")
    assert "secret/alpha-s3 configured" in configured[0], configured[0]
    assert writes == [], json.dumps(writes, indent=1)


def test_every_resource_of_the_tree_is_healthy_for_argo_cd_and_current_for_flux(
    gitops: GitOps,
) -> None:
    for obj in _all_ready(gitops):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert kstatus(obj) == ("Current", ""), (where, obj["status"])
        health = argo_health(obj)
        assert health["status"] == "Healthy", (where, health, obj["status"])
        assert health["message"], where


def _repository_spec(env: GitOps) -> dict[str, Any]:
    """A copy of the spec of the tree's first Repository."""
    first = next(o for o in env.objects if o["kind"] == "Repository")
    spec: dict[str, Any] = json.loads(json.dumps(first["spec"]))
    return spec


def _first_status(env: GitOps, kind: str, name: str) -> dict[str, Any]:
    """The resource as it is when the operator has first said something about it."""
    return wait_for(  # type: ignore[no-any-return]
        f"{kind}/{name} has a status",
        lambda: (o := kube.get(kind, NS, name)) and (o.get("status") or {}).get("conditions") and o,
    )


def test_states_on_the_way_and_failures_read_as_progressing_and_failed(gitops: GitOps) -> None:
    """What the operator writes while a resource is on its way (a Branch waiting for its
    Repository) reads as Progressing / InProgress; a resource it cannot act on (a Branch for
    main, a policy whose grace is too short, a Repository whose bucket is missing, a Mirror onto
    its own source) as Degraded / Failed, each with the condition's message."""
    _all_ready(gitops)
    create = [
        ("Branch", "waits", {"repository": "epsilon", "name": "waits"}),
        ("Branch", "main-branch", {"repository": "beta", "name": "main"}),
        (
            "RetentionPolicy",
            "too-short",
            {
                "repository": "beta",
                "rules": {"default": {"days": 1}},
                "gc": {"schedule": "0 3 * * *", "grace": "1d"},
            },
        ),
        (
            "Mirror",
            "onto-itself",
            {
                "repository": "gamma",
                "destination": {
                    "bucket": "zl-gitops-gamma",
                    "prefix": "repos/gamma",
                    "endpointURL": _repository_spec(gitops)["storage"]["endpointURL"],
                    "region": "us-east-1",
                    "credentialsSecret": {"name": "gamma-s3"},
                },
            },
        ),
    ]
    for kind, name, spec in create:
        kube.create(
            {
                "apiVersion": "zarrlake.io/v1alpha1",
                "kind": kind,
                "metadata": {"name": name, "namespace": NS},
                "spec": spec,
            }
        )
    expected = {
        "waits": ("InProgress", "Progressing", "RepositoryNotFound"),
        "main-branch": ("Failed", "Degraded", "Refused"),
        "too-short": ("Failed", "Degraded", "InvalidSpec"),
        "onto-itself": ("Failed", "Degraded", "DestinationIsSource"),
    }
    for kind, name, _ in create:
        # The waiting Branch's first wait goes unreported (a second later its Repository is
        # usually there); its retry, 15 s on, reports it.
        obj = _first_status(gitops, kind, name)
        flux, argo, reason = expected[name]
        ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == reason, (name, obj["status"])
        assert kstatus(obj)[0] == flux, (name, kstatus(obj), obj["status"])
        health = argo_health(obj)
        assert health["status"] == argo, (name, health, obj["status"])
        assert ready["message"] in health["message"], (name, health)
    for kind, name, _ in create:
        kube.delete(kind, NS, name)


def test_a_spec_the_schema_lets_through_gets_a_reason(gitops: GitOps) -> None:
    """A Repository whose lock service is external but names no URL (the CEL rule this API
    server, like any before Kubernetes 1.25, does not evaluate): Ready=False with InvalidSpec
    within one reconcile, Stalled, one Warning event, and nothing made for it."""
    spec = _repository_spec(gitops)
    spec["storage"]["bucket"] = "zl-gitops-no-lock-url"
    spec["lockService"] = {"mode": "external"}
    kube.create(
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "Repository",
            "metadata": {"name": "no-lock-url", "namespace": NS},
            "spec": spec,
        }
    )
    obj = _first_status(gitops, "Repository", "no-lock-url")
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "False", obj["status"]
    assert conditions["Ready"]["reason"] == "InvalidSpec", obj["status"]
    assert "spec.lockService.url" in conditions["Ready"]["message"], obj["status"]
    assert conditions["Stalled"]["status"] == "True", obj["status"]
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert kstatus(obj)[0] == "Failed"
    assert argo_health(obj)["status"] == "Degraded"

    def warnings() -> list[dict[str, Any]]:
        events = kube._call("GET", f"/api/v1/namespaces/{NS}/events").get("items", [])
        return [
            e
            for e in events
            if e["involvedObject"]["name"] == "no-lock-url" and e.get("type") == "Warning"
        ]

    wait_for("the Warning event", warnings)
    time.sleep(4 * RESYNC_S)  # resyncs do not repeat it
    (event,) = warnings()
    assert event["reason"] == "InvalidSpec" and event.get("count", 1) == 1, event
    kube.delete("Repository", NS, "no-lock-url")
