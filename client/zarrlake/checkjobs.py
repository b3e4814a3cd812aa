"""Checks run as Kubernetes Jobs: a container image that a commit service starts for each change
a branch's rule requires the check on (``docs/design/governance.md``, "Checks as Jobs").

The operator renders one Job per check a Repository declares (``spec.checks``: the image, its
command, the repository's credentials by Secret reference, whom it runs as, its deadline) and
hands the templates to the service (:data:`ENV_JOBS`, read by ``zarrlake service``). For each
change, :class:`JobChecks` fills in what the change is (the ``ZARRLAKE_CHECK_*`` variables
below), creates the Job, waits for it and reads its verdict:

- the container exits 0: the change passes;
- it exits otherwise: the change is refused, and the problems are its termination message, one
  per line (with ``terminationMessagePolicy: FallbackToLogsOnError``, the tail of its log);
- the Job does not finish by its deadline (``activeDeadlineSeconds``, and a grace for the API
  to say so): it is deleted, and the change refused;
- the Job cannot be created or read (no API, no RBAC): the change is refused, saying why.

A Job that passed is deleted at once; one that refused is kept for a day
(``ttlSecondsAfterFinished``), so that ``kubectl logs job/...`` shows why.

What the container is told, as environment variables: ``ZARRLAKE_CHECK_NAME`` (the check, as
the rule names it), ``ZARRLAKE_CHECK_OPTIONS`` (the rule's options for it, JSON),
``ZARRLAKE_CHECK_BRANCH``, ``ZARRLAKE_CHECK_KIND`` (``commit`` or ``merge``),
``ZARRLAKE_CHECK_PARENT`` and ``ZARRLAKE_CHECK_SNAPSHOT`` (the snapshot ids: the head the change
lands on, and the change's own snapshot, written but not published), and
``ZARRLAKE_CHECK_SNAPSHOT_SHA256`` (the digest of the snapshot's bytes as the service read and
will publish them: a writer that overwrites ``snapshots/<id>`` meanwhile is caught).
``zarrlake check URL [NAME]`` (:func:`run_check`) is such a program for any check installed in
the image as an entry point; an image may run anything else that reads the same variables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zarrlake.checks import Change, build, problems_of
from zarrlake.errors import (
    CorruptObject,
    InvalidArgument,
    KubernetesError,
    ObjectNotFound,
    UnsupportedFormat,
)
from zarrlake.format.model import Snapshot, snapshot_key
from zarrlake.governance import written_between
from zarrlake.k8s import api_client, api_error_reason, current_namespace
from zarrlake.rules import CHECK_NAME
from zarrlake.session import Session

if TYPE_CHECKING:
    from zarrlake.repository import Repository

log = logging.getLogger(__name__)

#: The environment variable ``zarrlake service`` reads the Job templates from (JSON:
#: ``{"<check>": <batch/v1 Job>}``), as the operator sets it.
ENV_JOBS = "ZARRLAKE_CHECK_JOBS"
#: How long after a Job's deadline the service still waits for the API to say it ended.
GRACE_S = 30.0
#: How long a Job that refused a change is kept, for its logs.
KEEP_FAILED_S = 86_400
#: Lines of a termination message taken as problems.
MAX_LINES = 100

_LABEL_VALUE = re.compile(r"[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?")

ENV = (
    "ZARRLAKE_CHECK_NAME",
    "ZARRLAKE_CHECK_OPTIONS",
    "ZARRLAKE_CHECK_BRANCH",
    "ZARRLAKE_CHECK_KIND",
    "ZARRLAKE_CHECK_PARENT",
    "ZARRLAKE_CHECK_SNAPSHOT",
    "ZARRLAKE_CHECK_SNAPSHOT_SHA256",
    "ZARRLAKE_CHECK_PARENT_SHA256",
)
#: The timeouts of each API call (connect, read), so that a half-open connection cannot hold
#: a check past its deadline.
API_TIMEOUT = (5.0, 30.0)
#: Transient answers (or none) tolerated in a row while a Job is followed.
READ_RETRIES = 5


@dataclass(frozen=True)
class CheckJob:
    """One check that runs as a Job: ``template`` is the Job as the operator renders it (its
    ``metadata.generateName`` the prefix of each run's name), ``deadline`` its
    ``activeDeadlineSeconds``."""

    name: str
    template: Mapping[str, Any]

    @property
    def deadline(self) -> float:
        return float(self.template["spec"]["activeDeadlineSeconds"])


def parse_jobs(text: str) -> dict[str, CheckJob]:
    """The templates of :data:`ENV_JOBS`, checked. Raises :class:`InvalidArgument`."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"check jobs are not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("check jobs: expected an object of check name -> Job")
    out = {}
    for name, job in doc.items():
        if not isinstance(name, str) or not CHECK_NAME.fullmatch(name):
            raise InvalidArgument(f"check jobs: {name!r} is not a check name")
        if not _valid_template(job):
            raise InvalidArgument(
                f"check jobs: {name!r} is not a Job with metadata.generateName, one container "
                "(env a list) and a whole spec.activeDeadlineSeconds"
            )
        out[name] = CheckJob(name, job)
    return out


def _valid_template(job: Any) -> bool:
    """A Job the service can fill in: generateName, one container (its env a list of named
    variables), a positive whole activeDeadlineSeconds, labels and annotations of strings."""
    if not isinstance(job, dict) or job.get("kind") != "Job":
        return False
    meta, spec = job.get("metadata"), job.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return False
    if not isinstance(meta.get("generateName"), str) or not meta["generateName"]:
        return False
    for key in ("labels", "annotations"):
        given = meta.get(key) or {}
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            return False
    deadline = spec.get("activeDeadlineSeconds")
    if isinstance(deadline, bool) or not isinstance(deadline, int) or deadline <= 0:
        return False
    template = spec.get("template")
    pod = template.get("spec") if isinstance(template, dict) else None
    containers = pod.get("containers") if isinstance(pod, dict) else None
    if not isinstance(containers, list) or len(containers) != 1:
        return False
    (container,) = containers
    if not isinstance(container, dict):
        return False
    env = container.get("env") or []
    return isinstance(env, list) and all(isinstance(v, dict) and "name" in v for v in env)


class _Run:
    """One Job's run, which the callers asking for the same verdict wait for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.problems: list[str] = []


class JobChecks:
    """The checks of ``jobs`` run as Kubernetes Jobs (a :class:`~zarrlake.checks.JobRunner`),
    through the API the service's pod is given (its ServiceAccount; else ``$KUBECONFIG``)."""

    def __init__(
        self,
        jobs: Mapping[str, CheckJob],
        *,
        namespace: str | None = None,
        poll: float = 0.5,
        api: Any = None,
    ) -> None:
        self.jobs = dict(jobs)
        self._namespace = namespace
        self._poll = poll
        self._api = api
        # One Job per (check, change) at a time: a writer whose request timed out and came
        # again waits for the verdict of the run already going, not a Job of its own.
        self._lock = threading.Lock()
        self._running: dict[tuple[str, ...], _Run] = {}

    def runs(self, name: str) -> bool:
        return name in self.jobs

    def _client(self) -> tuple[Any, Any, str]:
        from kubernetes import client

        if self._api is None:
            self._api = api_client()
        namespace = self._namespace or current_namespace()
        return client.BatchV1Api(self._api), client.CoreV1Api(self._api), namespace

    def run_job(self, name: str, options: Mapping[str, Any], change: Change) -> list[str]:
        job = self.jobs[name]
        if not change.snapshot_sha256 or not change.parent_sha256:
            # The Job reads both snapshots from storage, which a writer may overwrite: without
            # the bytes' digests it could check other data than what would be published.
            return ["could not run as a Job: no digest of the snapshots to hand it"]
        key = (
            name,
            json.dumps(dict(options), sort_keys=True),
            change.branch,
            change.kind,
            change.parent,
            change.snapshot,
            change.snapshot_sha256,
            change.parent_sha256,
        )
        with self._lock:
            run = self._running.get(key)
            mine = run is None
            if run is None:
                run = self._running[key] = _Run()
        if not mine:
            run.done.wait()
            return list(run.problems)
        try:
            run.problems = self._run(job, options, change)
        except KubernetesError as e:
            run.problems = [f"could not run as a Job: {e}"]
        except Exception as e:  # a verdict for the waiters too, never a pass
            run.problems = [f"could not run as a Job: {type(e).__name__}: {e}"]
        finally:
            with self._lock:
                del self._running[key]
            run.done.set()
        return list(run.problems)

    def _run(self, job: CheckJob, options: Mapping[str, Any], change: Change) -> list[str]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        batch, core, namespace = self._client()
        body = _job_for(job, options, change)
        name = body["metadata"]["name"]
        namespace = body["metadata"].get("namespace") or namespace
        api_errors = (ApiException, HTTPError, OSError, ValueError)
        try:
            batch.create_namespaced_job(namespace, body, _request_timeout=API_TIMEOUT)
        except api_errors as e:
            said = api_error_reason(e)
            raise KubernetesError(f"cannot create Job {namespace}/{name}: {said}") from None
        log.info("check %s of %s runs as Job %s/%s", job.name, change.snapshot, namespace, name)
        until = time.monotonic() + job.deadline + GRACE_S
        wait = min(self._poll, 0.2)
        failures = 0
        while True:
            try:
                found = batch.read_namespaced_job(
                    name, namespace, _preload_content=False, _request_timeout=API_TIMEOUT
                )
                status = json.loads(found.data).get("status") or {}
                failures = 0
            except api_errors as e:
                failures += 1
                if failures > READ_RETRIES or getattr(e, "status", None) == 404:
                    # No verdict will be read: the Job must not run on, for nobody.
                    _delete(batch, name, namespace)
                    said = api_error_reason(e)
                    raise KubernetesError(f"cannot read Job {namespace}/{name}: {said}") from None
                status = {}
            ended = _ended(status)
            if ended is not None:
                break
            if time.monotonic() >= until:
                _delete(batch, name, namespace)
                return [
                    f"Job {name} did not finish within {job.deadline:g} s (it was deleted)",
                ]
            time.sleep(wait)
            wait = min(wait * 2, self._poll)
        passed, reason = ended
        if passed:
            _delete(batch, name, namespace)
            return []
        if reason == "DeadlineExceeded":
            return [f"Job {name} did not finish within {job.deadline:g} s"]
        message = _termination_message(core, name, namespace)
        lines = [line for line in message.splitlines() if line.strip()][:MAX_LINES]
        return lines or [f"Job {name} failed ({reason or 'no reason given'}) and said nothing"]


def _job_for(job: CheckJob, options: Mapping[str, Any], change: Change) -> dict[str, Any]:
    """The template of ``job`` made the Job for one change: a name of its own, the change in
    its container's environment, kept a day if it refuses, never retried."""
    body: dict[str, Any] = json.loads(json.dumps(job.template))
    meta = body["metadata"]
    meta["name"] = f"{meta.pop('generateName')}{uuid.uuid4().hex[:8]}"
    if _LABEL_VALUE.fullmatch(job.name):  # check names may end in '-' or '.'; labels may not
        meta.setdefault("labels", {})["zarrlake.io/check"] = job.name
    meta.setdefault("annotations", {}).update(
        {
            "zarrlake.io/check": job.name,
            "zarrlake.io/snapshot": change.snapshot,
            "zarrlake.io/branch": change.branch,
        }
    )
    spec = body["spec"]
    spec["backoffLimit"] = 0  # a refusal is a verdict, not a failure to retry
    spec["ttlSecondsAfterFinished"] = KEEP_FAILED_S
    pod = spec["template"]["spec"]
    pod["restartPolicy"] = "Never"
    (container,) = pod["containers"]
    given = {
        "ZARRLAKE_CHECK_NAME": job.name,
        "ZARRLAKE_CHECK_OPTIONS": json.dumps(dict(options), sort_keys=True),
        "ZARRLAKE_CHECK_BRANCH": change.branch,
        "ZARRLAKE_CHECK_KIND": change.kind,
        "ZARRLAKE_CHECK_PARENT": change.parent,
        "ZARRLAKE_CHECK_SNAPSHOT": change.snapshot,
        "ZARRLAKE_CHECK_SNAPSHOT_SHA256": change.snapshot_sha256 or "",
        "ZARRLAKE_CHECK_PARENT_SHA256": change.parent_sha256 or "",
    }
    env = [v for v in container.get("env") or [] if v.get("name") not in given]
    container["env"] = env + [{"name": k, "value": v} for k, v in given.items()]
    return body


def _ended(status: Mapping[str, Any]) -> tuple[bool, str | None] | None:
    """(passed, reason) once the Job's Complete or Failed condition is true, else None."""
    for c in status.get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return True, None
        if c.get("type") == "Failed":
            return False, c.get("reason")
    return None


def _termination_message(core: Any, job: str, namespace: str) -> str:
    """What the Job's pod said as it ended (its termination message), or ''."""
    try:
        pods = core.list_namespaced_pod(
            namespace,
            label_selector=f"job-name={job}",
            _preload_content=False,
            _request_timeout=API_TIMEOUT,
        )
        items = json.loads(pods.data).get("items") or []
    except Exception as e:  # the verdict stands; only its words are missing
        log.warning("cannot read the pods of Job %s/%s: %s", namespace, job, api_error_reason(e))
        return ""
    for pod in items:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            ended = (status.get("state") or {}).get("terminated") or {}
            if ended.get("message"):
                return str(ended["message"])
            if ended:
                return f"exit code {ended.get('exitCode')}"
    return ""


def _delete(batch: Any, name: str, namespace: str) -> None:
    try:
        batch.delete_namespaced_job(
            name, namespace, propagation_policy="Background", _request_timeout=API_TIMEOUT
        )
    except Exception as e:  # it ends by its deadline or its time to live anyway
        log.warning("cannot delete Job %s/%s: %s", namespace, name, api_error_reason(e))


# -- inside the Job ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """What a check program is asked to check (the ``ZARRLAKE_CHECK_*`` variables, or the
    command line's)."""

    name: str
    options: dict[str, Any]
    branch: str
    kind: str
    parent: str
    snapshot: str
    snapshot_sha256: str | None = None
    parent_sha256: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **given: Any) -> Asked:
        """From the environment, with ``given`` (not None) taking precedence. Raises
        :class:`InvalidArgument` for what is missing or malformed."""

        def value(key: str, var: str) -> str | None:
            got = given.get(key)
            return got if got is not None else (env.get(var) or None)

        options_text = value("options", "ZARRLAKE_CHECK_OPTIONS") or "{}"
        try:
            options = json.loads(options_text)
        except ValueError as e:
            raise InvalidArgument(f"check options are not JSON: {e}") from None
        if not isinstance(options, dict):
            raise InvalidArgument("check options: expected a JSON object")
        fields = {
            "name": value("name", "ZARRLAKE_CHECK_NAME"),
            "branch": value("branch", "ZARRLAKE_CHECK_BRANCH") or "",
            "kind": value("kind", "ZARRLAKE_CHECK_KIND") or "commit",
            "parent": value("parent", "ZARRLAKE_CHECK_PARENT"),
            "snapshot": value("snapshot", "ZARRLAKE_CHECK_SNAPSHOT"),
        }
        for key in ("name", "parent", "snapshot"):
            if not fields[key]:
                var = f"ZARRLAKE_CHECK_{key.upper()}"
                raise InvalidArgument(f"no {key} to check: give --{key} or set {var}")
        sha = value("snapshot_sha256", "ZARRLAKE_CHECK_SNAPSHOT_SHA256")
        parent_sha = value("parent_sha256", "ZARRLAKE_CHECK_PARENT_SHA256")
        return cls(
            options=options,
            snapshot_sha256=sha,
            parent_sha256=parent_sha,
            **fields,  # type: ignore[arg-type]
        )


def run_check(
    repo: Repository, asked: Asked, open_store: Callable[[str], Any] | None = None
) -> list[str]:
    """The problems the installed check ``asked.name`` finds in the change ``asked`` names
    (its snapshot read as stored, and refused if its bytes are not those the service read).
    Raises :class:`InvalidArgument` for a check not installed here or options it refuses."""
    check, _ = build(asked.name, asked.options)
    objects = repo.core.objects
    for snapshot_id, digest in (
        (asked.snapshot, asked.snapshot_sha256),
        (asked.parent, asked.parent_sha256),
    ):
        try:
            data = repo.core.storage.get(snapshot_key(snapshot_id))
        except ObjectNotFound:
            return [f"snapshot {snapshot_id} is not stored"]
        if digest and hashlib.sha256(data).hexdigest() != digest:
            return [
                f"snapshot {snapshot_id} holds other bytes than the commit service read: it "
                "was overwritten after it was written"
            ]
        try:
            # What the check reads is what was hashed (the snapshot, and the parent it is
            # compared with: a forged parent would hide the change).
            objects.adopt_snapshot(snapshot_id, data)
        except (CorruptObject, UnsupportedFormat) as e:
            return [f"snapshot {snapshot_id} cannot be read: {e}"]
    built: Snapshot = objects.snapshot(asked.snapshot)
    parent = objects.snapshot(asked.parent)
    change = Change(
        asked.branch,
        asked.kind,
        parent,
        built,
        lambda: written_between(objects, parent, built),
        open_store or functools.partial(_store, repo),
    )
    return problems_of(check, change)


def _store(repo: Repository, snapshot_id: str) -> Any:
    """A read-only Zarr store of snapshot ``snapshot_id``, published or not."""
    return Session(repo.core, snapshot_id, branch=None, read_only=True).store
