"""One reconciliation per kind: observe, ask :mod:`desired` what should be, apply, report status.

Every function here is idempotent and safe to run at any time (create, update, resume, the
periodic resync, or twice in a row). Transient trouble raises ``kopf.TemporaryError`` (Kopf retries
with backoff); a spec we cannot act on raises ``kopf.PermanentError`` after writing a condition
that says what to fix. Credentials are read from Secrets and handed to the storage and lock
objects; they never reach a log line, an event or a status field.
"""

from __future__ import annotations

import os
import secrets as pysecrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import kopf
from pydantic import BaseModel, ValidationError

from zarrlake import (
    BranchExists,
    BranchRule,
    CommitInfo,
    InvalidArgument,
    InvalidName,
    KubernetesError,
    RefNotFound,
    Repository,
    RepositoryExists,
    RepositoryNotFound,
    Storage,
    StorageError,
    TagExists,
    ZarrlakeError,
    checks,
)
from zarrlake.config import VirtualContainer
from zarrlake.durations import parse_duration
from zarrlake.k8s import Connection, connection_from_resource, storage_connection
from zarrlake.mirror import Mirror as Promoter
from zarrlake.refs import Refs, validate_name
from zarrlake.resources import (
    API_VERSION,
    BranchSpec,
    BranchStatus,
    CommitServiceStatus,
    Condition,
    JobRun,
    MirrorSpec,
    MirrorStatus,
    RepositorySpec,
    RepositoryStatus,
    ResourceStatus,
    RetentionPolicySpec,
    RetentionPolicyStatus,
    ServeSpec,
    ServeStatus,
    TagSpec,
    TagStatus,
    problems,
)
from zarrlake_operator import buckets, credentials, desired, kube, metrics

MAIN = "main"


# -- shared --

SpecT = TypeVar("SpecT", bound=BaseModel)
StatusT = TypeVar("StatusT", bound=ResourceStatus)
STATUS_MODELS: dict[str, type[ResourceStatus]] = {
    "Repository": RepositoryStatus,
    "Branch": BranchStatus,
    "Tag": TagStatus,
    "RetentionPolicy": RetentionPolicyStatus,
    "Mirror": MirrorStatus,
}


def _meta(body: Mapping[str, Any]) -> tuple[str, str, int | None]:
    m = body["metadata"]
    return m["namespace"], m["name"], m.get("generation")


def observed(model: type[StatusT], body: Mapping[str, Any]) -> StatusT:
    """The status as last written; one that does not parse counts as empty (it is rewritten)."""
    try:
        return model.model_validate(body.get("status") or {})
    except ValidationError:
        return model()


def _write_status(body: Mapping[str, Any], status: ResourceStatus) -> None:
    """Patch the status, unless it already says all of that (an idle resync writes nothing)."""
    ns, name, _ = _meta(body)
    patch = status.patch()
    if not _already(body.get("status") or {}, patch):
        kube.patch_status(body["kind"], ns, name, patch)
    _gauge_ready(body, status)


def _gauge_ready(body: Mapping[str, Any], status: ResourceStatus) -> None:
    """The readiness gauge of ``body``, from the status its reconcile computed."""
    ns, name, _ = _meta(body)
    ready = status.condition("Ready")
    metrics.set_ready(body["kind"], ns, name, ready is not None and ready.status == "True")


def _already(current: Any, patch: Any) -> bool:
    """Whether merge-patching ``current`` with ``patch`` would change nothing."""
    if isinstance(patch, Mapping):
        if not isinstance(current, Mapping):
            return False
        return all(
            current.get(k) is None if v is None else k in current and _already(current[k], v)
            for k, v in patch.items()
        )
    return bool(current == patch)


def parse_spec(model: type[SpecT], body: Mapping[str, Any]) -> SpecT:
    """The spec as a model, or a readable ``kopf.PermanentError`` after writing the condition
    (:func:`refuse`) when it is one the operator cannot act on (:func:`desired.spec_problem`:
    the schema's errors and what only the operator can check)."""
    problem = desired.spec_problem(body)
    if problem is not None:
        raise refuse(body, problem.message, problem.reason)
    try:
        return model.model_validate(body.get("spec") or {})
    except ValidationError as e:  # spec_problem parsed it: only if the two models disagree
        raise refuse(body, problems(e, prefix="spec.")) from None


def refuse(
    body: Mapping[str, Any], message: str, reason: str = "InvalidSpec"
) -> kopf.PermanentError:
    """Report a spec the operator cannot act on (Ready=False, phase Failed) and post a Warning
    event about it — once per new problem, not on every resync. Returns the error to raise."""
    previous = observed(STATUS_MODELS[body["kind"]], body)
    before = previous.condition("Ready")
    said = before is not None and (before.status, before.reason, before.message) == (
        "False",
        reason,
        message,
    )
    if not said or previous.observed_generation != _meta(body)[2]:
        _report(body, ready=False, reason=reason, message=message, phase="Failed")
    if not said:
        _event(body, reason, message, warning=True)
    return kopf.PermanentError(f"invalid spec: {message}")


def _report(
    body: Mapping[str, Any],
    *,
    ready: bool,
    reason: str,
    message: str,
    phase: str | None = None,
    also: Sequence[Condition] = (),
    fields: ResourceStatus | None = None,
    reconciling: bool | None = None,
) -> ResourceStatus:
    """Write Ready (after the conditions in ``also``), phase, observedGeneration and the fields
    set in ``fields`` (a status of the body's kind) to the status; returns what was written.
    ``reconciling``: as :func:`desired.set_ready` takes it (None: from the reason)."""
    _, _, gen = _meta(body)
    model = STATUS_MODELS[body["kind"]]
    before = observed(model, body)
    conds = before.conditions
    for c in also:
        conds = desired.set_condition(conds, c.type, c.status, c.reason, c.message, generation=gen)
    conds = desired.set_ready(
        conds, ready, reason, message, generation=gen, reconciling=reconciling
    )
    status = (fields or model()).model_copy(
        update={
            "conditions": conds,
            "phase": phase or ("Ready" if ready else "Pending"),
            "observed_generation": gen,
        }
    )
    _write_status(body, status)
    if not ready and reason in FAILURES:
        _warn_if_new(body, before.condition("Ready"), status.condition("Ready"))
    return status


#: Ready=False reasons that are failures for someone to act on, each a Warning event when it
#: appears (the others are waits: for a Repository, a bucket, a lock service, a schedule). A
#: spec the operator refuses outright is one too (``InvalidSpec``, :func:`refuse`), as are the
#: bucket's failures of a Repository (its BucketReady condition) and a lost lock service.
FAILURES = frozenset(
    {
        "Conflict",  # another resource owns the location, branch or tag
        "Refused",  # a Branch resource for 'main'
        "InvalidName",
        "FromNotFound",
        "RefNotFound",
        "TagNameUsed",
        "TagDeleted",
        "ReadOnlyRepository",
        "DestinationIsSource",
        "CredentialsNotFound",
        "BucketNotFound",
        "StorageUnreachable",
        "ProvisionFailed",
    }
)


def _event(body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
    """An Event about ``body`` (any resource: it is referred to by kind, name and uid)."""
    meta = body["metadata"]
    about = kopf.Body(
        kopf.RawBody(
            apiVersion=body.get("apiVersion", ""),
            kind=body["kind"],
            metadata={"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
        )
    )
    (kopf.warn if warning else kopf.info)(about, reason=reason, message=message)


def _connection(
    body: Mapping[str, Any], *, require_ready: bool, resync: bool = False
) -> Connection:
    ns = body["metadata"]["namespace"]
    # The operator reads no chunks: the virtual containers' Secrets are its pods' (checked,
    # not read, by _virtual_containers).
    return connection_from_resource(
        body, kube.secrets(ns, kept=resync), require_ready=require_ready, with_virtual=False
    )


class RepositoryNotReady(kopf.TemporaryError):
    """A Branch, Tag or RetentionPolicy waits for its Repository (missing, or not Ready):
    retried after ``delay``, or as soon as the Repository turns Ready (see the handlers)."""

    def __init__(self, message: str, repository: str, delay: float) -> None:
        super().__init__(message, delay=delay)
        self.repository = repository


def _ready_repository(
    body: Mapping[str, Any], repository: str
) -> tuple[dict[str, Any], Repository]:
    """The Repository resource a Branch/Tag/RetentionPolicy names, opened; retries until Ready.

    The operator opens it without the lock service: branch and tag changes are single
    create-only journal writes, safe without a lock, and the operator need not reach Redis.
    """
    ns = body["metadata"]["namespace"]
    repo_body = kube.cached("Repository", ns, repository)
    if repo_body is None:
        _report_waiting(
            body,
            reason="RepositoryNotFound",
            message=f"Repository {repository!r} does not exist in namespace {ns!r}",
        )
        raise RepositoryNotReady(f"Repository {repository!r} not found", repository, 15)
    if desired.marked_for_deletion(repo_body):
        # Its reclaimPolicy decides what becomes of the data: nothing is written into it now.
        message = f"Repository {repository!r} is being deleted"
        _report_waiting(body, reason="RepositoryDeleting", message=message)
        raise RepositoryNotReady(message, repository, 15)
    if _read_only(repo_body):
        # The provider is immutable: this does not change by waiting.
        message = (
            f"Repository {repository!r} is on read-only storage (provider http): a "
            f"{body['kind']} cannot act on it"
        )
        _report(body, ready=False, reason="ReadOnlyRepository", message=message, phase="Failed")
        raise kopf.PermanentError(message)
    try:
        # Through the Secret cache even on a change: a dependent's change is not one of its
        # Repository's credentials, and those are re-read within SECRET_TTL_S by every reconcile
        # (the Repository's own changes read them afresh).
        conn = _connection(repo_body, require_ready=True, resync=True)
        expected = ((repo_body.get("status") or {}).get("repositoryID")) or None
        opened = _open(conn, expected)
    except (KubernetesError, ZarrlakeError, StorageError) as e:
        _report_waiting(body, reason="RepositoryNotReady", message=str(e))
        message = f"Repository {repository!r} not ready: {e}"
        raise RepositoryNotReady(message, repository, 10) from None
    _waited.discard(body["metadata"].get("uid"))
    return repo_body, opened


# Dependents (by uid) whose first wait for their Repository went unreported (see below).
_waited: set[str | None] = set()
_WAITED_MAX = 100_000


def _report_waiting(body: Mapping[str, Any], *, reason: str, message: str) -> None:
    """Say that a dependent waits for its Repository — except on its first wait: a Branch, Tag
    or policy is usually created together with its Repository, and waits a second for it (the
    handler wakes on the Repository's watch event). Saying so would cost a status write and the
    watch event it causes for most objects of a burst (at 1,400 objects, a quarter of the
    dependents), for a status nobody reads before Ready replaces it. A wait that lasts past the
    handler's retry delay is reported on the retry."""
    uid = body["metadata"].get("uid")
    if uid not in _waited and not (body.get("status") or {}).get("conditions"):
        if len(_waited) >= _WAITED_MAX:
            # Uids of dependents deleted while they waited are never discarded: forgetting them
            # all costs at most one unneeded status write each.
            _waited.clear()
        _waited.add(uid)
        return
    conditions = observed(STATUS_MODELS[body["kind"]], body).conditions
    if reason == "RepositoryNotFound" and desired.waited_too_long(
        conditions, reason, desired.MISSING_REPOSITORY_STALL
    ):
        # Past any apply order: a Repository this long missing is a mistake to fix (a misspelt
        # spec.repository), Stalled, so that GitOps tools call it failed, not in progress.
        minutes = int(desired.MISSING_REPOSITORY_STALL.total_seconds() // 60)
        message = f"{message} (for over {minutes} minutes: is spec.repository right?)"
        _report(body, ready=False, reason=reason, message=message, reconciling=False)
        return
    _report(body, ready=False, reason=reason, message=message)


def _read_only(repo_body: Mapping[str, Any]) -> bool:
    """Whether a Repository resource's storage takes no writes (provider http)."""
    storage = (repo_body.get("spec") or {}).get("storage") or {}
    return bool(storage.get("provider") == "http")


# Storage clients and opened repositories, by location and credentials: building an S3 client
# costs ~0.2 s of CPU, which every resync would repeat (at 1,400 objects that was most of a
# core). A kept Repository object remembers the branch heads and tag records it has read, so a
# resync reads only what moved; a Repository resource's own reconcile still re-reads the
# repository record each time (through the kept client), so a repository replaced at its
# location is noticed. One entry per repository the operator manages: the bound only caps a
# fleet far beyond one operator (an evicted entry costs its next resync a client and its refs).
_KEPT_MAX = int(os.environ.get("ZARRLAKE_KEPT_REPOSITORIES", "4096"))
_storages: OrderedDict[tuple[str | None, ...], Storage] = OrderedDict()
_opened: OrderedDict[tuple[str | None, ...], Repository] = OrderedDict()
_kept_lock = threading.Lock()


def _key(conn: Connection) -> tuple[str | None, ...]:
    return (conn.storage_url, *conn.credentials)


def _keep(table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    with _kept_lock:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _KEPT_MAX:
            table.popitem(last=False)


def _storage(conn: Connection) -> Storage:
    """The storage at ``conn``, one client per location and credentials."""
    key = _key(conn)
    with _kept_lock:
        storage = _storages.get(key)
    if storage is None:
        storage = conn.storage()
        _keep(_storages, key, storage)
    return storage


def _kept(conn: Connection, repo: Repository) -> Repository:
    """The repository object kept for ``conn`` when it is ``repo``'s repository (what it has
    read, branch heads and tag records, saves requests), else ``repo``, kept from now on."""
    key = _key(conn)
    with _kept_lock:
        kept = _opened.get(key)
    if kept is not None and kept.id == repo.id:
        return kept
    _keep(_opened, key, repo)
    return repo


def _open(conn: Connection, expected_id: str | None) -> Repository:
    """The repository at ``conn``, reused while it is the one the resource reported."""
    key = _key(conn)
    with _kept_lock:
        repo = _opened.get(key)
    if repo is not None and (expected_id is None or repo.id == expected_id):
        return repo
    repo = Repository.open(_storage(conn))
    _keep(_opened, key, repo)
    return repo


def _claim(
    body: Mapping[str, Any],
    kind: str,
    repository: str,
    *,
    deleting: bool = False,
    resync: bool = False,
) -> str | None:
    """The name of the resource that owns this branch/tag when it is not ``body`` (a conflict).

    A change, creation or deletion asks the API server (for the resources of ``repository``
    only); a resync (nothing changed) looks at the watch's view, which the change handlers of any
    newcomer have already decided against."""
    ns = body["metadata"]["namespace"]
    mine = desired.ref_name(body)
    found = (
        kube.cached_dependents(kind, ns, repository)
        if resync
        else kube.list_(kind, ns, field=("spec.repository", repository))
    )
    claims = [
        other
        for other in found
        if (other.get("spec") or {}).get("repository") == repository
        and desired.ref_name(other) == mine
    ]
    winner = desired.claim_winner(claims, include_deleting=deleting)
    if resync and winner not in (None, body["metadata"]["name"]):
        return _claim(body, kind, repository, deleting=deleting)  # confirm with the server
    return None if winner in (None, body["metadata"]["name"]) else winner


def conflict(owner: str) -> Condition:
    """The Conflict condition of a resource that another (older) one overrules."""
    return Condition(type="Conflict", status="True", reason="Conflict", message=owner)


NO_CONFLICT = Condition(type="Conflict", status="False", reason="NoConflict")


def _report_claimed(body: Mapping[str, Any], kind: str, ref: str, winner: str) -> ResourceStatus:
    return _report(
        body,
        ready=False,
        reason="Conflict",
        message=f"{kind.lower()} {ref!r} is already managed by the older {kind} {winner!r}",
        phase="Conflict",
        also=[conflict(f"claimed by {kind} {winner!r}")],
    )


# -- Repository --


def repository(
    body: Mapping[str, Any],
    *,
    resync: bool = False,
    serve: desired.ServeDefaults = desired.SERVE_DEFAULTS,
) -> ResourceStatus:
    """Bucket, lock service, repository and (``spec.serve``) its HTTP server for one Repository
    resource; returns the new status. ``serve``: the operator's defaults for the server.

    What it saw of the repository's refs is kept for :func:`dependents`."""
    ns, name, gen = _meta(body)
    # Kept only if this reconcile reads them again (then: what moved since, for the Events).
    refs_before = _seen_refs.pop((ns, name), None)
    spec = parse_spec(RepositorySpec, body)
    config = desired.engine_config(spec)  # parse_spec refused a config the engine refuses
    previous = observed(RepositoryStatus, body)
    conds = previous.conditions
    owner = _location_owner(body, resync=resync)
    if owner is not None:
        # Two resources for one location would each run a lock service (so writers would not
        # be serialized) and each could delete the other's data: only the older one acts.
        return _report(
            body,
            ready=False,
            reason="Conflict",
            message=f"the Repository {owner!r} (older) already manages this bucket and prefix",
            phase="Conflict",
            also=[conflict(f"location owned by {owner!r}")],
        )

    def cond(type_: str, ok: bool, reason: str, message: str) -> None:
        nonlocal conds
        conds = desired.set_condition(conds, type_, ok, reason, message, generation=gen)

    status = RepositoryStatus()
    retry: kopf.TemporaryError | None = None

    # Storage: credentials, then the bucket.
    conn: Connection | None = None
    try:
        conn = _connection(body, require_ready=False, resync=resync)
    except KubernetesError as e:
        cond("BucketReady", False, "CredentialsNotFound", str(e))
        retry = kopf.TemporaryError(str(e), delay=20)

    def check_bucket(conn: Connection) -> bool:
        """Whether the bucket is (now) there; sets BucketReady either way."""
        nonlocal retry
        if conn.read_only:
            cond("BucketReady", True, "ReadOnly", f"read-only storage at {conn.storage_url}")
            return True
        try:
            state = buckets.ensure_bucket(conn, provision=spec.storage.provision)
        except buckets.BucketMissing as e:
            cond("BucketReady", False, "BucketNotFound", str(e))
            retry = kopf.TemporaryError(str(e), delay=30)
            return False
        except buckets.BucketProvisionFailed as e:
            cond("BucketReady", False, "ProvisionFailed", str(e))
            retry = kopf.TemporaryError(str(e), delay=60)
            return False
        except buckets.BucketUnreachable as e:
            cond("BucketReady", False, "StorageUnreachable", str(e))
            retry = kopf.TemporaryError(str(e), delay=15)
            return False
        detail = "created by the operator" if state.created else "exists"
        what = "container" if conn.provider == "azure" else "bucket"
        cond("BucketReady", True, "BucketReady", f"{what} {conn.bucket!r} {detail}")
        if state.created:
            _event(body, "BucketCreated", f"created {what} {conn.bucket!r}")
        return True

    # A resync of a repository found in its bucket last time reads the repository first: found,
    # the bucket is there too (a request fewer per resync); else the bucket is checked then,
    # to say which of the two went.
    bucket_checked = not (
        resync and previous.repository_id and desired.is_true(conds, "BucketReady")
    )
    if conn is not None and bucket_checked:
        check_bucket(conn)

    # The lock service.
    lock = _lock_service(body, spec, resync=resync)
    # A service that was up and went down is "Lost" until it is back (one Warning event when it
    # goes, one Normal event when it returns; none while a new one starts).
    # The same service, that is: a lock endpoint changed by the spec is a new one, not a loss.
    was = desired.condition(conds, "LockServiceReady")
    same = lock.fields is None or previous.lock_endpoint == lock.fields.lock_endpoint
    lost = same and was is not None and (was.status == "True" or was.reason == "Lost")
    if not lock.ready and lost and lock.reason in desired.LOCK_OUTAGES:
        if was is not None and was.status == "True":
            _event(body, "LockServiceUnavailable", lock.message, warning=True)
        lock = replace(lock, reason="Lost")
    elif lock.ready and same and was is not None and was.reason == "Lost":
        _event(body, "LockServiceRecovered", lock.message)
    cond("LockServiceReady", lock.ready, lock.reason, lock.message)
    metrics.set_lock_service_ready(ns, name, lock.ready)
    if lock.fields is not None:
        status = lock.fields
    if not lock.ready and retry is None and lock.reason != "InvalidSpec":
        retry = kopf.TemporaryError(lock.message, delay=5)

    # The repository itself.
    if conn is not None and desired.is_true(conds, "BucketReady"):
        known = previous.repository_id
        try:
            # Once a repository is recorded, the resource means that one: the operator never
            # adopts another repository found at the location, nor creates a new, empty one where
            # it vanished (either would hide a loss, and reclaimPolicy: Delete would then act on
            # a repository this resource never managed).
            if known is None and not conn.read_only:
                repo = Repository.open_or_create(_storage(conn), config=config)
            else:
                # Read-only storage publishes a repository; it cannot have one created.
                repo = Repository.open(_storage(conn))
            if known is not None and repo.id != known:
                cond(
                    "Initialized",
                    False,
                    "RepositoryReplaced",
                    f"{conn.storage_url} holds repository {repo.id}, not {known} (the one this "
                    "resource manages); it is not adopted, and not deleted with the resource",
                )
            else:
                counts: dict[str, int] = {}
                if not conn.read_only:  # HTTP cannot list: a published repository's refs are
                    # opened by name. The root the open just read holds them all (one request
                    # per resync); a journal-only repository lists them.
                    refs = repo.core.last_refs() or _kept(conn, repo).refs()
                    _seen_refs[ns, name] = SeenRefs(repo.id, refs)
                    if refs_before is not None and refs_before.repository_id == repo.id:
                        # main has no Branch resource (it cannot): its moves are told here.
                        _head_moved(
                            body,
                            repo,
                            MAIN,
                            refs_before.refs.branches.get(MAIN),
                            refs.branches.get(MAIN),
                        )
                    counts = {"branches": len(refs.branches), "tags": len(refs.tags)}
                status = status.model_copy(
                    update={"repository_id": repo.id, "url": conn.storage_url, **counts}
                )
                message = f"repository {repo.id} at {conn.storage_url}"
                cond("Initialized", True, "Initialized", message)
                if known is None:
                    _event(body, "Initialized", message)
                if spec.protection is not None and not conn.read_only:
                    ok, reason, detail, count = _protection(body, repo, spec)
                    cond("ProtectionReady", ok, reason, detail)
                    status = status.model_copy(update={"protected_branches": count})
                if spec.virtual_containers is not None and not conn.read_only:
                    ok, reason, detail = _virtual_containers(
                        body, repo, spec, config.virtual_containers, kube.secrets(ns, kept=resync)
                    )
                    cond("VirtualContainersReady", ok, reason, detail)
                status = status.model_copy(
                    update={"virtual_containers": len(repo.config.virtual_containers)}
                )
        except RepositoryNotFound:
            if bucket_checked or check_bucket(conn):
                missing = (
                    f"repository {known} is gone from {conn.storage_url}; the operator does not "
                    "create an empty one in its place"
                    if known is not None
                    else f"no repository is published at {conn.storage_url} (read-only "
                    "storage: the operator cannot create one there)"
                )
                cond("Initialized", False, "RepositoryMissing", missing)
                retry = retry or kopf.TemporaryError("repository missing", delay=30)
        except (ZarrlakeError, StorageError) as e:
            if bucket_checked or check_bucket(conn):
                cond("Initialized", False, "StorageError", str(e))
                retry = retry or kopf.TemporaryError(str(e), delay=15)
    elif not desired.condition(conds, "Initialized"):
        cond("Initialized", False, "WaitingForBucket", "waiting for the bucket")

    if spec.protection is None:
        conds = [c for c in conds if c.type != "ProtectionReady"]
    if spec.virtual_containers is None:
        conds = [c for c in conds if c.type != "VirtualContainersReady"]

    # The commit service, once there is a repository for it.
    committing = _commit_service(body, spec, status.url, defaults=serve, resync=resync)
    if committing is None:
        conds = [c for c in conds if c.type != "CommitServiceReady"]
        status = status.model_copy(update={"commit_service": None})
    else:
        state = committing.state
        cond("CommitServiceReady", state.ready, state.reason, state.message)
        status = status.model_copy(update={"commit_service": committing.fields})
        if state.starting and retry is None:
            retry = kopf.TemporaryError(state.message, delay=5)

    # The HTTP server, once there is a repository to serve.
    served = _serve(body, spec, status.url, defaults=serve, resync=resync)
    if served is None:
        conds = [c for c in conds if c.type != "ServeReady"]
        status = status.model_copy(update={"serve": None})
    else:
        cond("ServeReady", served.state.ready, served.state.reason, served.state.message)
        if served.fields is not None:
            status = status.model_copy(update={"serve": served.fields})
        if served.state.starting and retry is None:
            retry = kopf.TemporaryError(served.state.message, delay=5)

    cond("Conflict", False, "NoConflict", "")
    phase = desired.repository_phase(
        conds, lock_required=spec.lock_service.on_unavailable == "fail"
    )
    # A lock service that has never been up is starting, a server is rolling out: the operator
    # (and the cluster) is still at work.
    starting = (lock.reason == "Unavailable" and not lost) or (
        served is not None and served.state.starting
    )
    conds = desired.set_ready(
        conds,
        phase.ready,
        phase.reason,
        phase.message,
        generation=gen,
        reconciling=(not phase.ready and phase.reason in desired.WAITING_REASONS) or starting,
    )
    status = status.model_copy(
        update={"phase": phase.phase, "conditions": conds, "observed_generation": gen}
    )
    _write_status(body, status)
    _warn_if_new(body, previous.condition("BucketReady"), status.condition("BucketReady"))
    if retry is not None:
        raise retry
    return status


def _protection(
    body: Mapping[str, Any], repo: Repository, spec: RepositorySpec
) -> tuple[bool, str, str, int]:
    """Make the repository's branch rules exactly spec.protection: (ok, reason, message, how
    many branches are protected now). Rules the repository refuses (a check this operator's
    image does not install and the commit service does not run as a Job, options it refuses)
    are a condition, not a retry: the spec has to change."""
    wanted = spec.protection or []
    service = spec.commit_service
    as_jobs = {c.name for c in service.checks} if service.enabled else set()
    repo.governance.run_as_jobs(checks.RunElsewhere(as_jobs))
    have = repo.branch_protection()
    rules: dict[str, BranchRule] = {}
    try:
        for item in wanted:
            rules[item.branch] = BranchRule(
                item.require_merge,
                item.allow_delete,
                item.allow_reset,
                tuple(item.required_checks),
                item.check_options,
            )
        for rule in rules.values():  # every rule valid before any is changed
            for check in rule.required_checks:
                if check not in as_jobs:
                    checks.build(check, rule.options(check))
        changed = []
        for branch, rule in rules.items():
            if have.get(branch) != rule:
                repo.protect_branch(
                    branch,
                    require_merge=rule.require_merge,
                    allow_delete=rule.allow_delete,
                    allow_reset=rule.allow_reset,
                    required_checks=rule.required_checks,
                    check_options=rule.check_options,
                )
                changed.append(f"protected {branch!r}: {rule.describe()}")
        for branch in sorted(set(have) - set(rules)):
            repo.unprotect_branch(branch)
            changed.append(f"unprotected {branch!r}")
    except (InvalidArgument, InvalidName) as e:
        return False, "InvalidProtection", str(e), len(repo.branch_protection())
    for what in changed:
        _event(body, "BranchProtectionChanged", what)
    names = ", ".join(sorted(rules)) or "none"
    return True, "Applied", f"protected branches: {names}", len(rules)


def _virtual_containers(
    body: Mapping[str, Any],
    repo: Repository,
    spec: RepositorySpec,
    wanted: Sequence[VirtualContainer],
    read_secret: Callable[[str], Mapping[str, str] | None],
) -> tuple[bool, str, str]:
    """Make the repository's virtual chunk containers exactly ``wanted``
    (spec.virtualContainers, parsed by the engine with the spec): (ok, reason, message). One
    Event per change, naming the prefixes added, changed and removed. A credentials Secret
    that is missing is the condition's reason (the pods that mount it would not start)."""
    missing = sorted(
        {
            c.credentials_secret_ref.name
            for c in spec.virtual_containers or ()
            if c.credentials_secret_ref is not None
            and read_secret(c.credentials_secret_ref.name) is None
        }
    )
    have = {c.url_prefix: c for c in repo.config.virtual_containers}
    want = {c.url_prefix: c for c in wanted}
    if have != want:
        try:
            repo.set_virtual_containers(list(wanted))
        except ZarrlakeError as e:  # a storage without compare-and-set, a newer format
            return False, "NotApplied", str(e)
        changes = [
            *(f"allowed {p}" for p in want if p not in have),
            *(f"changed {p}" for p in want if p in have and have[p] != want[p]),
            *(f"disallowed {p}" for p in have if p not in want),
        ]
        _event(body, "VirtualContainersChanged", "virtual chunk containers: " + "; ".join(changes))
    names = ", ".join(sorted(want)) or "none"
    if missing:
        return (
            False,
            "SecretMissing",
            f"virtual chunk containers: {names}; credentials Secret(s) not found: "
            + ", ".join(missing),
        )
    return True, "Applied", f"virtual chunk containers: {names}"


def _warn_if_new(body: Mapping[str, Any], before: Condition | None, now: Condition | None) -> None:
    """A Warning event when a condition turns False for a reason it did not have before (the
    bucket's: missing credentials, no bucket, refused or unreachable storage, a failed
    provisioning): once per new problem, not on every retry."""
    if now is None or now.status != "False":
        return
    if before is not None and (before.status, before.reason) == ("False", now.reason):
        return
    _event(body, now.reason, now.message, warning=True)


@dataclass(frozen=True)
class SeenRefs:
    """What the last reconcile of a Repository resource read of its repository's refs."""

    repository_id: str
    refs: Refs


# (namespace, Repository) -> its refs as its last reconcile read them (dropped when it could not).
_seen_refs: dict[tuple[str, str], SeenRefs] = {}


@dataclass(frozen=True)
class Dependent:
    """A Branch, Tag or RetentionPolicy of a Repository resource, as a resync of that
    Repository finds it: ``confirmed`` when what the resync read of the refs is what its status
    already says (no reconcile needed)."""

    kind: str
    body: dict[str, Any]
    confirmed: bool


def dependents(repo_body: Mapping[str, Any]) -> list[Dependent]:
    """The Branches, Tags and RetentionPolicies of a Repository resource (from the watch's
    view), each checked against what its resync just read of the refs.

    A Branch or Tag is confirmed when its status already says that: Ready for its generation,
    the owner of its ref among the claims, the ref where it was seen; anything else (the ref
    moved or went, a claim or the spec changed, not Ready, refs not read) needs its reconcile.
    A RetentionPolicy is never confirmed: its reconcile needs no storage request. So a resting
    repository costs one listing of its refs however many resources name it."""
    ns, name, _ = _meta(repo_body)
    seen = _seen_refs.get((ns, name))
    known_id = observed(RepositoryStatus, repo_body).repository_id
    if seen is not None and seen.repository_id != known_id:
        seen = None  # read from another repository than the one the status names: trust nothing
    found: list[Dependent] = []
    for kind in ("Branch", "Tag"):
        # A listed item may not say its kind; the reconciles of these bodies need it.
        bodies = [{**b, "kind": kind} for b in kube.cached_dependents(kind, ns, name)]
        claims: dict[str, list[dict[str, Any]]] = {}
        for body in bodies:
            claims.setdefault(desired.ref_name(body), []).append(body)
        for body in bodies:
            ref = desired.ref_name(body)
            if seen is None:
                target = None
            else:
                target = (seen.refs.branches if kind == "Branch" else seen.refs.tags).get(ref)
            ok = desired.ref_reported(body, target, desired.claim_winner(claims[ref]))
            if ok:  # its status stands: Ready, at the head it names
                _gauge_confirmed(body)
            found.append(Dependent(kind, body, ok))
    for body in kube.cached_dependents("RetentionPolicy", ns, name):
        found.append(Dependent("RetentionPolicy", {**body, "kind": "RetentionPolicy"}, False))
    return found


def _gauge_confirmed(body: Mapping[str, Any]) -> None:
    """The gauges of a Branch or Tag whose status a Repository's resync confirmed (its own
    reconcile is skipped): what that status says."""
    ns, name, _ = _meta(body)
    metrics.set_ready(body["kind"], ns, name, True)
    if body["kind"] == "Branch":
        _gauge_branch_head(body, observed(BranchStatus, body))


def _gauge_branch_head(body: Mapping[str, Any], status: BranchStatus) -> None:
    committed = metrics.parse_time(status.last_commit_time)
    repository = str((body.get("spec") or {}).get("repository") or "")
    if committed is not None:
        ns, name, _ = _meta(body)
        metrics.set_branch_head(ns, name, repository, committed)


def _location(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """(provider, endpoint, account, bucket or URL, prefix) of a Repository resource; None for
    a spec that does not parse (the API server refuses those, so it claims nothing)."""
    try:
        storage = RepositorySpec.model_validate(body.get("spec") or {}).storage
    except ValidationError:
        return None
    return (
        storage.provider,
        (storage.endpoint_url or "").rstrip("/"),
        storage.account_name or "",
        storage.bucket or (storage.url or "").rstrip("/"),
        storage.prefix,
    )


def _bucket(body: Mapping[str, Any]) -> str:
    storage = (body.get("spec") or {}).get("storage") or {}
    return str(storage.get("bucket") or "")


def _location_owner(body: Mapping[str, Any], *, resync: bool = False) -> str | None:
    """The older Repository resource in this namespace with the same location, if any (on a
    resync, from the watch's view)."""
    ns, name, _ = _meta(body)
    here = _location(body)
    if here is None:
        return None
    # Only the Repositories of the same bucket can share the location (asked of the server by
    # that field, or picked from the watch's view before any spec is parsed).
    bucket = _bucket(body)
    if resync:
        found = [o for o in kube.cached_list("Repository", ns) if _bucket(o) == bucket]
    elif bucket:
        found = kube.list_("Repository", ns, field=("spec.storage.bucket", bucket))
    else:  # provider http names a URL, not a bucket: no field narrows these down
        found = kube.list_("Repository", ns)
    same = [o for o in found if _location(o) == here]
    winner = desired.claim_winner(same)
    if resync and winner not in (None, name):
        return _location_owner(body)  # the watch's view says conflict: make sure it is one
    return None if winner in (None, name) else winner


@dataclass(frozen=True)
class LockServiceState:
    """The LockServiceReady condition's facts, and the status fields that describe the service
    (None: leave them as they are)."""

    ready: bool
    reason: str
    message: str
    fields: RepositoryStatus | None = None


def _lock_service(
    body: Mapping[str, Any], spec: RepositorySpec, *, resync: bool = False
) -> LockServiceState:
    """Make the repository's lock service what the spec asks for, and say how it is."""
    ns, name, gen = _meta(body)
    mode = "none" if spec.storage.read_only else spec.lock_service.mode
    managed_before = observed(RepositoryStatus, body).lock_endpoint == desired.lock_endpoint(
        name, ns
    )
    # A change looks for a managed service the status may not name (a reconcile that made one
    # and stopped before its status); a spec never changed (generation 1) never asked for one.
    if mode != "managed" and (managed_before or (not resync and gen != 1)):
        _remove_managed_lock(ns, name)
    if mode == "none":
        why = (
            "read-only storage takes no commits (no lock service)"
            if spec.storage.read_only
            else "optimistic commits (no lock service)"
        )
        return LockServiceState(
            True, "NotRequired", why, RepositoryStatus(lockEndpoint=None, lockSecret=None)
        )
    if mode == "external":
        lock = spec.lock_service
        if not lock.url:
            return LockServiceState(
                False, "InvalidSpec", "lockService.url is required in external mode"
            )
        try:
            conn = _connection(body, require_ready=False)
            client = conn.lock()
            if client is not None:
                client.client.ping()
        except KubernetesError as e:
            return LockServiceState(
                False, "CredentialsNotFound", str(e), RepositoryStatus(lockEndpoint=lock.url)
            )
        except Exception as e:
            return LockServiceState(
                False,
                "Unreachable",
                f"cannot reach {lock.url}: {type(e).__name__}",
                RepositoryStatus(lockEndpoint=lock.url),
            )
        return LockServiceState(
            True,
            "Reachable",
            f"external lock service at {lock.url}",
            RepositoryStatus(
                lockEndpoint=lock.url,
                lockSecret=lock.password_secret.name if lock.password_secret else None,
            ),
        )
    # managed
    password = pysecrets.token_urlsafe(32)
    secret, action = kube.apply(desired.lock_secret(body, password), create_only=True)
    _, svc_action = kube.apply(desired.lock_service(body))
    actions = [("Secret", action), ("Service", svc_action)]
    # The claim, disruption budget and network policy are made (or corrected) on a change of the
    # Repository (its creation, a spec change, the operator's start) or with a new Deployment: a
    # resync at rest asks nothing more of the API server than it did.
    claim = desired.lock_volume_claim(body, spec)
    if claim is not None and not resync:
        actions.append(("PersistentVolumeClaim", kube.apply(claim, create_only=True)[1]))
    digest = desired.password_hash(secret)
    deployment, dep_action = kube.apply(desired.lock_deployment(body, spec, digest))
    actions.append(("Deployment", dep_action))
    if not resync or dep_action != "unchanged":
        for obj in (desired.lock_disruption_budget(body), desired.lock_network_policy(body, spec)):
            actions.append((obj["kind"], kube.apply(obj)[1]))
        if claim is None and not resync and gen != 1:
            # Persistence turned off (a spec never changed never had it): the data goes, now
            # that the Deployment no longer mounts it.
            _remove_managed(ns, desired.lock_service_names(name), ("PersistentVolumeClaim",))
    for what, act in actions:
        if act != "unchanged":
            _event(body, f"LockService{act.capitalize()}", f"{act} lock service {what}")
    ok, message = desired.deployment_available(deployment)
    return LockServiceState(
        ok,
        "Available" if ok else "Unavailable",
        message,
        RepositoryStatus(
            lockEndpoint=desired.lock_endpoint(name, ns),
            lockSecret=secret["metadata"]["name"],
        ),
    )


# What a managed lock service is made of, in the order it is taken down.
LOCK_KINDS = (
    "Deployment",
    "Service",
    "Secret",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "PersistentVolumeClaim",
)


def _remove_managed_lock(namespace: str, repository: str) -> None:
    _remove_managed(namespace, desired.lock_service_names(repository), LOCK_KINDS)


def _remove_managed(namespace: str, obj: str, kinds: Sequence[str]) -> list[str]:
    """Delete the objects of these kinds named ``obj`` that the operator made (a managed lock
    service's parts, a server's); returns the kinds deleted."""
    gone = []
    for kind in kinds:
        existing = kube.get(kind, namespace, obj)
        labels = (existing or {}).get("metadata", {}).get("labels") or {}
        ours = existing and labels.get("app.kubernetes.io/managed-by") == desired.MANAGED_BY
        if ours and kube.delete(kind, namespace, obj):
            gone.append(kind)
    return gone


@dataclass(frozen=True)
class Served:
    """The ServeReady condition's facts, and the status fields that describe the server (None:
    leave them as they are)."""

    state: desired.ServeState
    fields: ServeStatus | None = None


SERVE_KINDS = ("Deployment", "Service")


def _serve(
    body: Mapping[str, Any],
    spec: RepositorySpec,
    url: str | None,
    *,
    defaults: desired.ServeDefaults,
    resync: bool,
) -> Served | None:
    """Make the repository's HTTP server what ``spec.serve`` asks for, and say how it is; None
    when it asks for none (then a server made before goes). ``url``: the repository's storage
    URL, None until it is known to be there (the server waits for it).

    The Deployment is applied on every reconcile, resyncs too (its status is the server's
    readiness); the Service on a change of the Repository or with a new Deployment."""
    ns, name, _ = _meta(body)
    serve = spec.serve
    if not serve.enabled:
        had = observed(RepositoryStatus, body).serve is not None
        _remove_server(body, desired.serve_names(name), had, "Serve", "server", resync=resync)
        return None
    if url is None:
        message = "waiting for the repository: the server starts once it is initialized"
        return Served(desired.ServeState(False, "WaitingForRepository", message))
    deployment = _apply_server(
        body,
        desired.serve_deployment(body, spec, url, defaults),
        lambda: desired.serve_service(body, spec),
        "Serve",
        "server",
        resync=resync,
    )
    state = desired.serve_rollout(deployment, serve.replicas)
    missing = _serve_secret_missing(ns, serve, resync=resync)
    if missing is not None:
        state = desired.ServeState(False, "SecretNotFound", missing, state.ready_replicas)
    fields = ServeStatus(
        url=desired.serve_url(name, ns, serve.port), readyReplicas=state.ready_replicas
    )
    return Served(state, fields)


def _remove_server(
    body: Mapping[str, Any], names: str, had: bool, event: str, what: str, *, resync: bool
) -> None:
    """Take down a server the spec no longer asks for (``had``: the status names one)."""
    ns, _, gen = _meta(body)
    # A change looks for a server the status may not name (a reconcile that made one and
    # stopped before its status); a spec never changed (generation 1) never asked for one.
    if had or (not resync and gen != 1):
        for kind in _remove_managed(ns, names, SERVE_KINDS):
            _event(body, f"{event}Deleted", f"deleted {what} {kind}")


def _apply_server(
    body: Mapping[str, Any],
    deployment: dict[str, Any],
    service: Callable[[], dict[str, Any]],
    event: str,
    what: str,
    *,
    resync: bool,
) -> dict[str, Any] | None:
    """Apply a server's Deployment (every reconcile: its status is the server's readiness) and
    its Service (on a change of the Repository, or with a new Deployment); the Deployment as
    the API server has it."""
    applied, action = kube.apply(deployment)
    actions = [("Deployment", action)]
    if not resync or action != "unchanged":
        actions.append(("Service", kube.apply(service())[1]))
    for kind, act in actions:
        if act != "unchanged":
            _event(body, f"{event}{act.capitalize()}", f"{act} {what} {kind}")
    return applied


@dataclass(frozen=True)
class Committing:
    """The CommitServiceReady condition's facts, and the status fields of the service."""

    state: desired.ServeState
    fields: CommitServiceStatus | None = None


def _commit_service(
    body: Mapping[str, Any],
    spec: RepositorySpec,
    url: str | None,
    *,
    defaults: desired.ServeDefaults,
    resync: bool,
) -> Committing | None:
    """Make the commit service what ``spec.commitService`` asks for, and say how it is; None
    when it asks for none (then one made before goes), as :func:`_serve` does for the server."""
    ns, name, _ = _meta(body)
    service = spec.commit_service
    names = desired.commit_service_names(name)
    if not service.enabled:
        had = observed(RepositoryStatus, body).commit_service is not None
        _remove_server(body, names, had, "CommitService", "commit service", resync=resync)
        if not resync:
            _remove_check_rbac(body, names)
            _remove_role_credentials(body)
        return None
    if url is None:
        message = "waiting for the repository: the commit service starts once it is initialized"
        return Committing(desired.ServeState(False, "WaitingForRepository", message))
    # Before its pod: the ServiceAccount it runs as, and its right to run checks as Jobs.
    rbac = desired.commit_service_rbac(body, spec)
    for obj in rbac:
        _, action = kube.apply(obj)
        if action != "unchanged":
            kind = obj["kind"]
            _event(body, f"CommitService{action.capitalize()}", f"{action} commit service {kind}")
    if not resync:
        if not rbac:
            _remove_check_rbac(body, names)
        elif not any(obj["kind"] == "ServiceAccount" for obj in rbac):
            # It runs as one the spec names now: the one the operator made goes.
            _remove_check_rbac(body, names, kinds=("ServiceAccount",))
    deployment = _apply_server(
        body,
        desired.commit_service_deployment(body, spec, url, defaults),
        lambda: desired.commit_service_service(body, spec),
        "CommitService",
        "commit service",
        resync=resync,
    )
    state = desired.serve_rollout(deployment, 1)
    tokens = service.tokens_secret_ref
    if tokens is not None:
        try:
            found = kube.secrets(ns, kept=resync)(tokens.name)
        except KubernetesError as e:
            found, missing = None, str(e)
        else:
            missing = f"Secret {tokens.name!r} not found (spec.commitService.tokensSecretRef)"
        if found is not None and tokens.key not in found:
            missing = f"Secret {tokens.name!r} has no key {tokens.key!r}"
            found = None
        if found is None:
            state = desired.ServeState(False, "SecretNotFound", missing, state.ready_replicas)
    if service.provision_credentials:
        said = _role_credentials(body, spec, resync=resync)
    else:
        said = _writer_credentials(spec)
        if not resync:
            _remove_role_credentials(body)
    fields = CommitServiceStatus(
        url=desired.commit_service_url(name, ns, service.port),
        readyReplicas=state.ready_replicas,
        writerCredentials=said,
    )
    return Committing(state, fields)


CHECK_RBAC_KINDS = ("RoleBinding", "Role", "ServiceAccount")


def _remove_check_rbac(
    body: Mapping[str, Any], names: str, kinds: tuple[str, ...] = CHECK_RBAC_KINDS
) -> None:
    """Take away what let the commit service use the API (checks as Jobs, Events), once it
    needs none (or none runs): the operator's own objects only (by label), by name."""
    ns = body["metadata"]["namespace"]
    for kind in _remove_managed(ns, names, kinds):
        _event(body, "CommitServiceDeleted", f"deleted commit service {kind}")


def _role_user(body: Mapping[str, Any], role: str) -> str:
    meta = body["metadata"]
    return credentials.user_name(meta["namespace"], meta["name"], meta["uid"], role)


def _role_credentials(body: Mapping[str, Any], spec: RepositorySpec, *, resync: bool) -> str:
    """``provisionCredentials``: an IAM user and key per role, the key in its Secret (made
    again only when the Secret is missing or names a key the user lost); returns what
    ``status.commitService.writerCredentials`` says. A resync whose Secrets are there asks
    the IAM API nothing."""
    ns, name, _ = _meta(body)
    if spec.storage.provider != "s3":
        return (
            f"not provisioned: provisionCredentials needs an IAM API (s3); on "
            f"{spec.storage.provider}, give writers {_how(spec)}"
        )
    read = kube.secrets(ns, kept=resync)
    try:
        held = {
            role: read(desired.role_credentials_secret_name(name, role))
            for role in credentials.ROLES
        }
        if not (resync and all(held.values())):
            conn = _connection(body, require_ready=False)
            iam = credentials.iam_client(conn, spec.commit_service.iam_endpoint_url)
            for role in credentials.ROLES:
                _provision_role(body, iam, conn, role, held[role], aws=_on_aws(spec, conn))
    except (credentials.ProvisionFailed, KubernetesError) as e:
        if not resync:
            _event(body, "CredentialsFailed", str(e), warning=True)
        return f"not provisioned: {e}"
    writer = desired.role_credentials_secret_name(name, "writer")
    reader = desired.role_credentials_secret_name(name, "reader")
    kinds = ", ".join(f"{k}/" for k in credentials.IMMUTABLE_KINDS)
    if _on_aws(spec, None):
        how = f"writes only {kinds}, create-only (If-None-Match)"
    else:
        how = (
            f"writes only {kinds}, not create-only (this provider takes no such condition: an "
            "overwritten snapshot is caught by its entry, a chunk by its hash); lists the whole "
            "bucket"
        )
    return (
        f"provisioned: writers use Secret {writer} (IAM user {_role_user(body, 'writer')}: "
        f"reads the repository, {how}), readers Secret {reader} (reads only)"
    )


def _on_aws(spec: RepositorySpec, conn: Connection | None) -> bool:
    """Whether the Repository's storage and IAM are AWS's (their policies take its condition
    keys)."""
    endpoint = spec.storage.endpoint_url if conn is None else conn.endpoint_url
    iam = spec.commit_service.iam_endpoint_url
    return credentials.is_aws(endpoint) and credentials.is_aws(iam)


def _provision_role(
    body: Mapping[str, Any],
    iam: Any,
    conn: Connection,
    role: str,
    held: Mapping[str, str] | None,
    *,
    aws: bool,
) -> None:
    ns, name, _ = _meta(body)
    user = _role_user(body, role)
    document = credentials.policy(role, conn.bucket, conn.prefix, aws=aws)
    keep = (held or {}).get("AWS_ACCESS_KEY_ID")
    keys = credentials.ensure_user(iam, user, document, keep)
    if keys is None:
        return
    secret_name = desired.role_credentials_secret_name(name, role)
    if held is not None:
        kube.delete("Secret", ns, secret_name)  # it names a key the user no longer has
    kube.create(
        desired.role_credentials_secret(
            body, role, keys.access_key_id, keys.secret_access_key, user
        )
    )
    _event(body, "CredentialsProvisioned", f"{role} key of IAM user {user} in Secret {secret_name}")


#: How many times the deletion of a Repository waits for its IAM users to be removed (an IAM
#: API that is down) before it lets the resource go, saying which users are left.
DELETE_IAM_RETRIES = 5


def _remove_role_credentials(
    body: Mapping[str, Any], *, deleting: bool = False, retry: int = 0
) -> None:
    """Take away the IAM users and Secrets provisionCredentials made, once it is off (or the
    commit service is, or the Repository goes: ``deleting``). Users are removed by their names
    (which the resource determines), whether or not their Secrets are still there. A failure is
    a Warning Event naming the users left; deleting, an IAM API that fails is waited for
    (:data:`DELETE_IAM_RETRIES` times) before the resource is let go."""
    ns, name, _ = _meta(body)
    secrets_held = [
        role
        for role in credentials.ROLES
        if _ours(kube.get("Secret", ns, desired.role_credentials_secret_name(name, role)))
    ]
    said = observed(RepositoryStatus, body).commit_service or CommitServiceStatus()
    made = (said.writer_credentials or "").startswith("provisioned")
    if not (secrets_held or made or deleting):
        return
    users = [_role_user(body, role) for role in credentials.ROLES]
    try:
        spec = RepositorySpec.model_validate(body.get("spec") or {})
        if spec.storage.provider == "s3":  # none are made elsewhere
            conn = connection_from_resource(
                body, kube.secrets(ns), require_ready=False, with_lock=False
            )
            iam = credentials.iam_client(conn, spec.commit_service.iam_endpoint_url)
            for user in users:
                if credentials.remove_user(iam, user):
                    _event(body, "CredentialsDeleted", f"deleted IAM user {user}")
    except credentials.ProvisionFailed as e:
        if deleting and retry < DELETE_IAM_RETRIES:
            raise kopf.TemporaryError(f"could not remove IAM users: {e}", delay=20) from None
        _event(body, "CredentialsFailed", _left(users, e), warning=True)
        return
    except (KubernetesError, ValidationError) as e:
        _event(body, "CredentialsFailed", _left(users, e), warning=True)
        return
    for role in secrets_held:
        kube.delete("Secret", ns, desired.role_credentials_secret_name(name, role))


def _left(users: Sequence[str], e: BaseException) -> str:
    return f"could not remove IAM users {', '.join(users)} ({e}): delete them by hand"


def _ours(obj: Mapping[str, Any] | None) -> bool:
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return labels.get("app.kubernetes.io/managed-by") == desired.MANAGED_BY


def _writer_credentials(spec: RepositorySpec) -> str:
    """What ``status.commitService.writerCredentials`` says when the operator made no
    credentials per role: the rules hold against a client that skips them only where writers
    are given credentials that cannot write refs."""
    provider = spec.storage.provider
    why = {
        "s3": "spec.commitService.provisionCredentials is off",
        "gcs": "it manages no Google Cloud service accounts (their IAM API is not a bucket's)",
        "azure": "a SAS cannot be limited to a prefix of a container without a hierarchical "
        "namespace, and it manages no Entra identities",
    }.get(provider, f"{provider} has no credentials that write")
    return (
        f"not provisioned: the operator makes none on {provider} ({why}); give writers "
        f"{_how(spec)}. Until then a client holding the repository's own credentials can move "
        "refs past the service (docs/design/governance.md)"
    )


def _how(spec: RepositorySpec) -> str:
    """What writers' credentials must allow, on the Repository's provider."""
    return {
        "s3": "an IAM policy (or, on SeaweedFS, an identity) allowing writes only under the "
        "immutable prefixes (chunks/, packs/, manifests/, snapshots/, txlogs/, history/), "
        "with s3:if-none-match",
        "gcs": "a service account with create-only rights on objects under those prefixes "
        "(an IAM condition on resource.name)",
        "azure": "a SAS limited to create on blobs under those prefixes (a hierarchical "
        "namespace's directory SAS), or an identity with an ABAC condition on the blob path",
    }.get(spec.storage.provider, "credentials that cannot write refs/ or root")


def _serve_secret_missing(ns: str, serve: ServeSpec, *, resync: bool) -> str | None:
    """Which Secret the server's pods mount or read that is not there (they cannot start
    without it, and Kubernetes would only say so in pod events), or None."""
    read = kube.secrets(ns, kept=resync)
    token, creds = serve.token_secret_ref, serve.credentials_secret_ref
    try:
        if token is not None:
            found = read(token.name)
            if found is None:
                return f"Secret {token.name!r} not found (spec.serve.tokenSecretRef)"
            if token.key not in found:
                return f"Secret {token.name!r} has no key {token.key!r} (spec.serve.tokenSecretRef)"
        if creds is not None and read(creds.name) is None:
            return f"Secret {creds.name!r} not found (spec.serve.credentialsSecretRef)"
    except KubernetesError as e:
        return str(e)
    return None


def delete_repository(body: Mapping[str, Any], *, retry: int = 0) -> str:
    """Honour the reclaim policy; returns what was done. Owned objects go by owner references.

    When the data cannot be deleted for good (the credentials Secret is gone, or the location
    holds another repository), the data is retained, a Warning event says so, and the resource
    is released: a finalizer that can never complete would only block the namespace.
    """
    try:
        spec = RepositorySpec.model_validate(body.get("spec") or {})
    except ValidationError as e:  # the API server would not have stored it: keep the data
        return f"Retain: the spec does not parse ({problems(e, prefix='spec.')}); data retained"
    if spec.commit_service.provision_credentials and spec.storage.provider == "s3":
        # Whatever becomes of the data, keys to it must not outlive the resource.
        _remove_role_credentials(body, deleting=True, retry=retry)
    if spec.reclaim_policy != "Delete":
        return "Retain: the repository's data stays in the bucket"
    status = observed(RepositoryStatus, body)
    conflicted = status.condition("Conflict")
    if conflicted is not None and conflicted.status == "True":
        return "Delete skipped: another Repository resource owns this location; data retained"
    ns = body["metadata"]["namespace"]
    try:
        # Deleting needs storage credentials only: not the lock service, which may be gone.
        conn = connection_from_resource(
            body, kube.secrets(ns), require_ready=False, with_lock=False
        )
    except KubernetesError as e:
        message = f"reclaimPolicy Delete could not run, data retained: {e}"
        _event(body, "ReclaimFailed", message, warning=True)
        raise kopf.PermanentError(message) from None
    n = _delete_data(body, conn, status.repository_id)
    return f"Delete: removed {n} object(s) of repository {status.repository_id}"


def _delete_data(
    body: Mapping[str, Any], conn: Connection, repository_id: str | None, *, mirror: bool = False
) -> int:
    """``reclaimPolicy: Delete``: remove the repository's (or mirror's) objects at ``conn``;
    refused for good (a Warning event, data retained) when the location holds another one."""
    try:
        return buckets.delete_repository_objects(conn, repository_id, mirror=mirror)
    except buckets.NotOurRepository as e:
        message = f"reclaimPolicy Delete refused, data retained: {e}"
        _event(body, "ReclaimFailed", message, warning=True)
        raise kopf.PermanentError(message) from None
    except buckets.BucketUnreachable as e:
        raise kopf.TemporaryError(str(e), delay=15) from None


# -- Branch --


def branch(
    body: Mapping[str, Any],
    *,
    resync: bool = False,
    patch: MutableMapping[str, Any] | None = None,
) -> ResourceStatus:
    """The branch of one Branch resource; returns the new status. ``patch``: where to put a
    change of the resource's own metadata (the one Kopf applies after a handler), else it is
    patched here."""
    spec = parse_spec(BranchSpec, body)
    name = desired.ref_name(body)
    previous = observed(BranchStatus, body)
    if name == MAIN:
        return _report(
            body,
            ready=False,
            reason="Refused",
            message="'main' is created with the repository and cannot be deleted, so it cannot "
            "be managed by a Branch resource; the branch is left untouched",
            phase="Refused",
            fields=BranchStatus(branch=name),
        )
    repo_body, repo = _ready_repository(body, spec.repository)
    _follow(body, repo_body, patch)
    winner = _claim(body, "Branch", spec.repository, resync=resync)
    if winner:
        return _report_claimed(body, "Branch", name, winner)
    recreated = None
    try:
        if previous.head is None and previous.branch is None:
            # Never reported: most likely a new branch, so it is created without a lookup
            # first (one that exists already is adopted).
            head, recreated = _create_branch(body, repo, name, spec, previous)
        else:
            head = repo.lookup_branch(name)
    except RefNotFound:
        head, recreated = _create_branch(body, repo, name, spec, previous)
    except InvalidName as e:
        _report(body, ready=False, reason="InvalidName", message=str(e), phase="Failed")
        raise kopf.PermanentError(str(e)) from None
    info = next(iter(repo.log(head, limit=1)), None)
    if recreated is None and previous.branch == name:
        _head_moved(body, repo, name, previous.head, head, info)
    fields = BranchStatus(
        branch=name,
        head=head,
        lastCommitTime=info.time.strftime("%Y-%m-%dT%H:%M:%SZ") if info else None,
        lastCommitMessage=(info.message or "")[:200] if info else None,
        lastCommitAuthor=info.author if info else None,
    )
    if recreated is not None:
        fields = fields.model_copy(update={"recreated": recreated})
    _gauge_branch_head(body, fields)
    return _report(
        body,
        ready=True,
        reason="Ready",
        message=f"branch {name!r} at {head}",
        phase="Ready",
        also=[NO_CONFLICT],
        fields=fields,
    )


def _create_branch(
    body: Mapping[str, Any],
    repo: Repository,
    name: str,
    spec: BranchSpec,
    status: BranchStatus,
) -> tuple[str, int | None]:
    """Create the branch: from ``spec.from`` the first time, or at its last known head when it
    vanished behind the operator's back (so no commit is lost to the recreation).

    Returns the head and, for a recreation, how often the branch has been recreated now.
    """
    last_head = status.head if status.branch == name else None
    start = last_head or spec.from_
    try:
        try:
            head = repo.create_branch(name, start)
        except RefNotFound:
            if last_head is None:
                raise
            head = repo.create_branch(name, spec.from_)  # the old head was collected
    except BranchExists:
        return repo.lookup_branch(name), None  # created concurrently: adopt
    except RefNotFound:
        try:  # spec.from only matters to a new branch: one that exists is adopted
            return repo.lookup_branch(name), None
        except RefNotFound:
            pass
        message = f"spec.from {spec.from_!r} is not a branch, tag or snapshot of the repository"
        _report(body, ready=False, reason="FromNotFound", message=message)
        raise kopf.TemporaryError(message, delay=30) from None
    except InvalidName as e:
        _report(body, ready=False, reason="InvalidName", message=str(e), phase="Failed")
        raise kopf.PermanentError(str(e)) from None
    if last_head:
        _event(
            body,
            "BranchRecreated",
            f"branch {name!r} had been deleted outside Kubernetes; recreated at {head}",
            warning=True,
        )
        return head, (status.recreated or 0) + 1
    _event(body, "BranchCreated", f"created branch {name!r} from {spec.from_!r} at {head}")
    return head, None


def _head_moved(
    body: Mapping[str, Any],
    repo: Repository,
    name: str,
    before: str | None,
    after: str | None,
    info: CommitInfo | None = None,
) -> None:
    """Tell of branch ``name`` moving from ``before`` to ``after`` (as two reads of it
    found it) with a ``HeadMoved`` Event on ``body``, naming the new head's commit: what a
    commit, merge or reset of the branch looks like from Kubernetes. Between the two reads
    several commits may have landed: the Event names the newest. (Best effort, as Events
    are: the webhook notifier is the channel that delivers every one.)"""
    if before is None or after is None or before == after:
        return
    if info is None or info.id != after:
        try:
            info = next(iter(repo.log(after, limit=1)), None)
        except ZarrlakeError:
            info = None
    what = "its commit could not be read"
    if info is not None:
        kind = "merge" if len(info.parents) > 1 else "commit"
        by = f" by {info.author}" if info.author else ""
        what = f"{kind}{by}: {(info.message or '')[:200]!r}"
        if before not in info.parents:
            what += " (the old head is not its parent: several commits, or a reset)"
    _event(body, "HeadMoved", f"branch {name!r} at {after} (was {before}), {what}")


def _follow(
    body: Mapping[str, Any],
    repo_body: Mapping[str, Any],
    patch: MutableMapping[str, Any] | None = None,
) -> None:
    """Make a Branch/Tag resource a dependent of its Repository resource, so that it goes when
    the Repository goes (the refs in the data follow the Repository's reclaimPolicy): in
    ``patch`` when there is one (Kopf applies it with its own, one request instead of two)."""
    ns, name, _ = _meta(body)
    refs = list((body.get("metadata") or {}).get("ownerReferences") or [])
    uid = repo_body["metadata"]["uid"]
    if any(r.get("uid") == uid for r in refs):
        return
    refs.append(
        {
            "apiVersion": repo_body.get("apiVersion") or API_VERSION,
            "kind": "Repository",
            "name": repo_body["metadata"]["name"],
            "uid": uid,
        }
    )
    if patch is not None:
        patch.setdefault("metadata", {})["ownerReferences"] = refs
        return
    kube.merge_patch(body["kind"], ns, name, {"metadata": {"ownerReferences": refs}})


def _owned_ref_repository(body: Mapping[str, Any], kind: str) -> tuple[Repository | None, str]:
    """For deleting a Branch/Tag resource: the repository to delete the ref from, or None and
    why the ref stays (the Repository is gone or going — its reclaimPolicy decides what happens
    to the data, not the deletion of its dependents —, or another resource owns the ref)."""
    name = desired.ref_name(body)
    repository = (body.get("spec") or {}).get("repository")
    ns = body["metadata"]["namespace"]
    found = kube.get("Repository", ns, repository) if repository else None
    if found is None or not repository:
        return None, "the Repository is gone; nothing to delete"
    if desired.marked_for_deletion(found):
        return None, "the Repository is being deleted; its reclaimPolicy decides for its refs"
    if _read_only(found):
        return None, "the Repository is read-only; nothing to delete"
    if _claim(body, kind, repository, deleting=True):
        return None, f"another {kind} resource manages {name!r}; left in place"
    return _ready_repository(body, repository)[1], ""


def delete_branch(body: Mapping[str, Any]) -> str:
    name = desired.ref_name(body)
    if name == MAIN:
        return "main is never deleted"
    try:
        validate_name(name)
    except InvalidName:
        return f"{name!r} is not a valid branch name: no such branch was made"
    repo, why = _owned_ref_repository(body, "Branch")
    if repo is None:
        return why
    try:
        repo.delete_branch(name)
    except RefNotFound:
        return f"branch {name!r} was already gone"
    except RepositoryNotFound:
        return "the repository was deleted meanwhile (its reclaimPolicy); nothing to delete"
    return f"deleted branch {name!r}"


# -- Tag --


def tag(
    body: Mapping[str, Any],
    *,
    resync: bool = False,
    patch: MutableMapping[str, Any] | None = None,
) -> ResourceStatus:
    """The tag of one Tag resource; returns the new status (``patch`` as for :func:`branch`)."""
    spec = parse_spec(TagSpec, body)
    name = desired.ref_name(body)
    previous = observed(TagStatus, body)
    repo_body, repo = _ready_repository(body, spec.repository)
    _follow(body, repo_body, patch)
    winner = _claim(body, "Tag", spec.repository, resync=resync)
    if winner:
        return _report_claimed(body, "Tag", name, winner)
    recorded = previous.snapshot
    if recorded:
        try:
            current: str | None = repo.lookup_tag(name)
        except RefNotFound:
            current = None
        if current != recorded:
            return _report(
                body,
                ready=False,
                reason="TagDeleted",
                message=f"tag {name!r} was deleted outside Kubernetes; tag names are never "
                "reused, so it cannot be recreated",
                phase="Failed",
            )
        snapshot = recorded
    else:
        snapshot = _create_tag(body, repo, name, spec)
    return _report(
        body,
        ready=True,
        reason="Ready",
        message=f"tag {name!r} -> {snapshot}",
        phase="Ready",
        also=[NO_CONFLICT],
        fields=TagStatus(tag=name, snapshot=snapshot),
    )


def _create_tag(body: Mapping[str, Any], repo: Repository, name: str, spec: TagSpec) -> str:
    """Tag ``spec.ref`` (never reported yet, so most likely new: no lookup first), or adopt the
    tag of that name that exists (made before the resource, or concurrently); returns its
    snapshot. A deleted tag's name is refused for good (never reused)."""
    try:
        snapshot = repo.resolve(spec.ref)
        repo.create_tag(name, snapshot)
    except (RefNotFound, TagExists) as e:
        try:
            return repo.lookup_tag(name)
        except RefNotFound:
            pass
        if isinstance(e, TagExists):
            _report(body, ready=False, reason="TagNameUsed", message=str(e), phase="Failed")
            raise kopf.PermanentError(str(e)) from None
        message = f"spec.ref {spec.ref!r} is not a branch, tag or snapshot of the repository"
        _report(body, ready=False, reason="RefNotFound", message=message)
        raise kopf.TemporaryError(message, delay=30) from None
    except InvalidName as e:
        _report(body, ready=False, reason="InvalidName", message=str(e), phase="Failed")
        raise kopf.PermanentError(str(e)) from None
    _event(body, "TagCreated", f"tag {name!r} -> {snapshot} (from {spec.ref!r})")
    return snapshot


def delete_tag(body: Mapping[str, Any]) -> str:
    name = desired.ref_name(body)
    if not observed(TagStatus, body).snapshot:
        return "the tag was never created"
    repo, why = _owned_ref_repository(body, "Tag")
    if repo is None:
        return why
    try:
        repo.delete_tag(name)
    except RefNotFound:
        return f"tag {name!r} was already gone"
    except RepositoryNotFound:
        return "the repository was deleted meanwhile (its reclaimPolicy); nothing to delete"
    return f"deleted tag {name!r}"


# -- RetentionPolicy --


def retention_policy(
    body: Mapping[str, Any],
    job_image: str,
    spark: desired.SparkDefaults = desired.SPARK_DEFAULTS,
    *,
    resync: bool = False,
) -> ResourceStatus:
    """CronJobs or Spark applications for a RetentionPolicy; returns the new status. A ``resync``
    (a timer tick, nothing changed) removes only what the status says the policy made."""
    ns = body["metadata"]["namespace"]
    spec = parse_spec(RetentionPolicySpec, body)  # rules and grace checked there
    _gauge_runs(ns, body["metadata"]["name"], observed(RetentionPolicyStatus, body))
    found = kube.cached("Repository", ns, spec.repository)
    if found is None:
        _suspend_cron_jobs(body, "Repository not found")
    elif desired.marked_for_deletion(found):
        _suspend_cron_jobs(body, "Repository being deleted")
    repo_body, _ = _ready_repository(body, spec.repository)
    engine = retention_engine(spec)
    cron_jobs: dict[str, dict[str, Any]] = {}
    spark_apps: dict[str, dict[str, Any]] = {}
    if engine == "local":
        cron_jobs = desired.retention_cron_jobs(body, spec, repo_body, job_image)
    elif engine == "spark-submit":
        cron_jobs = desired.spark_submit_cron_jobs(body, spec, repo_body, spark)
    else:
        spark_apps = desired.scheduled_spark_applications(body, spec, repo_body, spark)
    managed_account = engine != "local" and desired.spark_service_account(body, spec, spark)[1]
    rbac = desired.spark_rbac(body, spec) if managed_account else []
    for obj in [*rbac, *cron_jobs.values(), *spark_apps.values()]:
        _, action = kube.apply(obj, watched=resync and obj["kind"] == "CronJob")
        if action != "unchanged":
            kind, obj_name = obj["kind"], obj["metadata"]["name"]
            _event(body, f"{kind}{action.capitalize()}", f"{action} {kind} {obj_name}")
    _remove_stale(body, cron_jobs, spark_apps, rbac, sweep=not resync)
    schedules = f"gc {spec.gc.schedule}" + (
        f", compaction {spec.compaction.schedule}" if spec.compaction else ""
    )
    runs = {
        "local": "",
        "spark-submit": " as spark-submit jobs",
        "spark-operator": " as Spark applications",
    }[engine]
    return _report(
        body,
        ready=True,
        reason="Scheduled",
        message=schedules + runs + (" (gc suspended)" if spec.gc.suspend else ""),
        phase="Ready",
        fields=RetentionPolicyStatus(
            engine=engine,
            gcCronJob=cron_jobs["gc"]["metadata"]["name"] if cron_jobs else None,
            compactionCronJob=(
                cron_jobs["compact"]["metadata"]["name"] if "compact" in cron_jobs else None
            ),
            gcSparkApplication=spark_apps["gc"]["metadata"]["name"] if spark_apps else None,
            compactionSparkApplication=(
                spark_apps["compact"]["metadata"]["name"] if "compact" in spark_apps else None
            ),
        ),
    )


def retention_engine(spec: RetentionPolicySpec) -> str:
    """``local``, or for ``engine: spark`` ``spark-operator`` when the cluster serves the Spark
    operator's ScheduledSparkApplications (asked on every reconciliation: installing or removing
    the Spark operator moves the jobs over at the next resync), else ``spark-submit``."""
    if spec.engine == "local":
        return "local"
    try:
        installed = kube.served(desired.SPARK_API_VERSION, "scheduledsparkapplications")
    except kube.KubeError as e:
        raise kopf.TemporaryError(f"cannot discover the Spark operator: {e}", delay=10) from None
    return "spark-operator" if installed else "spark-submit"


def _remove_stale(
    policy: Mapping[str, Any],
    cron_jobs: Mapping[str, Any],
    spark_apps: Mapping[str, Any],
    rbac: Sequence[Mapping[str, Any]],
    *,
    sweep: bool = True,
) -> None:
    """Delete what the policy made before and no longer asks for (another engine, compaction
    dropped, the driver's ServiceAccount now given): by name, so nothing else is touched.

    With ``sweep``, every name the policy could have used, of what may exist: its CronJobs as
    the watch shows them; its ScheduledSparkApplications (listed by its label) and the
    driver's ServiceAccount, Role and RoleBinding unless the policy never ran on Spark (local
    now, never otherwise in its status, its spec never changed). Without, only those its
    status names (a resync, when the status was written by the reconcile that made them)."""
    ns, name, gen = _meta(policy)
    wanted = {
        (o["kind"], o["metadata"]["name"])
        for o in [*cron_jobs.values(), *spark_apps.values(), *rbac]
    }
    candidates = [
        ("CronJob", desired.child_name(name, suffix, desired.CRONJOB_NAME_MAX))
        for suffix in ("gc", "compact", "gc-spark", "compact-spark")
    ]
    candidates += [
        ("ScheduledSparkApplication", desired.child_name(name, kind, desired.SPARK_NAME_MAX))
        for kind in ("gc", "compact")
    ]
    spark_names = desired.spark_names(name)
    candidates += [(k, spark_names) for k in ("RoleBinding", "Role", "ServiceAccount")]
    status = observed(RetentionPolicyStatus, policy)
    if sweep:
        present = {c for c in candidates if c[0] == "CronJob" and kube.watched(c[0], ns, c[1])}
        engine = (policy.get("spec") or {}).get("engine") or "local"
        # Spark objects only where the policy runs on Spark, ran on it (its status says so), or
        # may have (its spec changed since it was made, and a status can miss a last run).
        if engine != "local" or status.engine not in (None, "local") or gen != 1:
            present |= {
                ("ScheduledSparkApplication", o["metadata"]["name"]) for o in _spark_apps(policy)
            }
            present |= {(k, spark_names) for k in ("RoleBinding", "Role", "ServiceAccount")}
        candidates = [c for c in candidates if c in present]
    else:
        named = {
            ("CronJob", status.gc_cron_job),
            ("CronJob", status.compaction_cron_job),
            ("ScheduledSparkApplication", status.gc_spark_application),
            ("ScheduledSparkApplication", status.compaction_spark_application),
        }
        if status.engine not in (None, "local"):
            named |= {(k, spark_names) for k in ("RoleBinding", "Role", "ServiceAccount")}
        candidates = [c for c in candidates if c in named]
    for kind, obj_name in candidates:
        if (kind, obj_name) in wanted:
            continue
        try:
            gone = kube.delete(kind, ns, obj_name)
        except kube.KubeError as e:
            if e.status == 403 and kind == "ScheduledSparkApplication":
                continue  # no Spark operator rights: nothing of ours can be there
            raise
        if gone:
            _event(policy, f"{kind}Deleted", f"deleted {kind} {obj_name}")


def _spark_apps(policy: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The policy's ScheduledSparkApplications, by its label (none where the Spark operator is
    not installed, or not ours to list)."""
    ns, name, _ = _meta(policy)
    try:
        return kube.list_("ScheduledSparkApplication", ns, f"{desired.POLICY_LABEL}={name}")
    except kube.KubeError as e:
        if e.status in (403, 404):
            return []
        raise


def _suspend_cron_jobs(policy: Mapping[str, Any], why: str) -> None:
    """The Repository is gone or going (``why``): its jobs could only fail, or would work on
    data its reclaimPolicy is deciding about, so they pause until it is back."""
    ns, name, _ = _meta(policy)
    kinds = ["CronJob"]
    if kube.served(desired.SPARK_API_VERSION, "scheduledsparkapplications"):
        kinds.append("ScheduledSparkApplication")
    for kind in kinds:
        for cron in kube.list_(kind, ns, f"{desired.POLICY_LABEL}={name}"):
            if not (cron.get("spec") or {}).get("suspend"):
                kube.merge_patch(kind, ns, cron["metadata"]["name"], {"spec": {"suspend": True}})
                _event(
                    policy,
                    f"{kind}Suspended",
                    f"suspended {kind} {cron['metadata']['name']}: {why}",
                    warning=True,
                )


def job_finished(job: Mapping[str, Any]) -> str | None:
    """Record a finished maintenance Job in its RetentionPolicy's status; returns what it did."""
    meta = job["metadata"]
    job_labels = meta.get("labels") or {}
    policy_name = job_labels.get(desired.POLICY_LABEL)
    kind = job_labels.get(desired.JOB_KIND_LABEL)
    if not policy_name or kind not in ("gc", "compact"):
        return None
    ns = meta["namespace"]
    pods = kube.list_("Pod", ns, f"job-name={meta['name']}")
    run = desired.job_run(job, pods)
    if run is None:
        return None
    return _record_run(ns, policy_name, kind, run)


def driver_finished(pod: Mapping[str, Any]) -> str | None:
    """Record a finished Spark driver (of a ScheduledSparkApplication's run) in its
    RetentionPolicy's status, as :func:`job_finished` does for a Job."""
    meta = pod["metadata"]
    pod_labels = meta.get("labels") or {}
    policy_name = pod_labels.get(desired.POLICY_LABEL)
    kind = pod_labels.get(desired.JOB_KIND_LABEL)
    if not policy_name or kind not in ("gc", "compact"):
        return None
    if pod_labels.get(desired.ROLE_LABEL) != "driver":
        return None
    run = desired.driver_run(pod)
    if run is None:
        return None
    return _record_run(meta["namespace"], policy_name, kind, run)


def _gauge_runs(ns: str, policy_name: str, status: RetentionPolicyStatus) -> None:
    """The maintenance gauges of a policy, from the last runs its status records."""
    for task, run in (("gc", status.last_gc), ("compaction", status.last_compaction)):
        if run is not None and run.result is not None:
            metrics.set_maintenance_run(
                ns,
                policy_name,
                task,
                succeeded=run.result == "Succeeded",
                finished=metrics.parse_time(run.time),
                duration=run.duration_seconds,
            )


def _record_run(ns: str, policy_name: str, kind: str, run: JobRun) -> str | None:
    policy = kube.get("RetentionPolicy", ns, policy_name)
    if policy is None:
        return None
    status = observed(RetentionPolicyStatus, policy)
    previous = status.last_gc if kind == "gc" else status.last_compaction
    if previous is not None:
        if previous.job == run.job and previous.result == run.result:
            _gauge_runs(ns, policy_name, status)
            return None  # already recorded
        if previous.time and run.time and previous.time > run.time:
            _gauge_runs(ns, policy_name, status)
            return None  # an older job finishing late does not replace a newer result
    # The whole entry is written (counts this run lacks as null): it describes one run.
    update = (
        RetentionPolicyStatus(lastGC=run)
        if kind == "gc"
        else RetentionPolicyStatus(lastCompaction=run)
    )
    kube.patch_status("RetentionPolicy", ns, policy_name, update.patch())
    _gauge_runs(ns, policy_name, update)
    what = "GC" if kind == "gc" else "Compaction"
    counts = run.dump()
    summary = ", ".join(
        f"{k}={counts[k]}"
        for k in ("snapshotsExpired", "objectsDeleted", "bytesFreed", "chunksPacked")
        if k in counts
    )
    _event(
        policy,
        f"{what}{run.result}",
        f"job {run.job}: {summary or run.message or ''}",
        warning=run.result != "Succeeded",
    )
    field = "lastGC" if kind == "gc" else "lastCompaction"
    return f"{field} <- {run.job} {run.result}"


# -- Mirror --


def _report_mirror(
    body: Mapping[str, Any], *, reason: str, message: str, phase: str | None = None
) -> None:
    """Ready=False for a Mirror, written only when it says something new: a Mirror is looked at
    every few seconds, and a spec that stays wrong need not be rewritten each time."""
    _, _, gen = _meta(body)
    previous = observed(MirrorStatus, body)
    ready = previous.condition("Ready")
    if (
        ready is not None
        and (ready.status, ready.reason, ready.message) == ("False", reason, message)
        and previous.observed_generation == gen
        and previous.phase == (phase or "Pending")
    ):
        _gauge_ready(body, previous)
        return
    _report(body, ready=False, reason=reason, message=message, phase=phase)


def mirror(body: Mapping[str, Any], job_image: str) -> ResourceStatus:
    """The replicator Deployment of one Mirror, and the status of the mirror it maintains.

    The status comes from a read-only pass over both sides (``zarrlake.mirror.Mirror.status``
    with ``create=False``): the operator never writes to the destination, so it can never race
    the replicator's promotions. It is written only when it changed.
    """
    ns, name, _ = _meta(body)
    spec = parse_spec(MirrorSpec, body)  # globs and durations checked there
    repo_body = kube.cached("Repository", ns, spec.repository)
    if repo_body is None:
        message = f"Repository {spec.repository!r} does not exist in namespace {ns!r}"
        _report_mirror(body, reason="RepositoryNotFound", message=message)
        raise RepositoryNotReady(message, spec.repository, delay=15)
    if _read_only(repo_body):
        message = (
            f"Repository {spec.repository!r} is on read-only storage (provider http), which "
            "cannot list its branches: it cannot be mirrored"
        )
        _report_mirror(body, reason="ReadOnlyRepository", message=message, phase="Failed")
        raise kopf.PermanentError(message)
    dest_spec = spec.destination

    def refuse_own_location(source: Connection) -> None:
        same = (
            source.provider == dest_spec.provider
            and (source.endpoint_url or "").rstrip("/")
            == (dest_spec.endpoint_url or "").rstrip("/")
            and (source.account_name or "") == (dest_spec.account_name or "")
            and (source.bucket, source.prefix) == (dest_spec.bucket, dest_spec.prefix)
        )
        if same:
            message = (
                f"spec.destination is Repository {spec.repository!r}'s own location "
                f"({source.storage_url}): a mirror needs another bucket or prefix"
            )
            _report_mirror(body, reason="DestinationIsSource", message=message, phase="Failed")
            raise kopf.PermanentError(message)

    # From the Repository's spec, at once: waiting for it to be Ready changes nothing here.
    try:
        refuse_own_location(_connection(repo_body, require_ready=False))
    except KubernetesError:
        pass  # its Secret is not there yet: asked again below, once it is Ready
    try:
        source = _connection(repo_body, require_ready=True)
    except KubernetesError as e:
        _report_mirror(body, reason="RepositoryNotReady", message=str(e))
        # Woken by the watch as soon as the Repository turns Ready, as a Branch is: a retry
        # only after its delay would land long after, at a moment nothing else changes.
        raise RepositoryNotReady(str(e), spec.repository, delay=10) from None
    refuse_own_location(source)
    try:
        dest = storage_connection(dest_spec, kube.secrets(ns), f"Mirror {name!r}")
    except KubernetesError as e:
        _report_mirror(body, reason="CredentialsNotFound", message=str(e))
        raise kopf.TemporaryError(str(e), delay=20) from None
    try:
        state = buckets.ensure_bucket(
            dest, provision=dest_spec.provision, spec_field="spec.destination"
        )
    except buckets.BucketMissing as e:
        _report_mirror(body, reason="BucketNotFound", message=str(e))
        raise kopf.TemporaryError(str(e), delay=30) from None
    except buckets.BucketProvisionFailed as e:
        _report_mirror(body, reason="ProvisionFailed", message=str(e))
        raise kopf.TemporaryError(str(e), delay=60) from None
    except buckets.BucketUnreachable as e:
        _report_mirror(body, reason="StorageUnreachable", message=str(e))
        raise kopf.TemporaryError(str(e), delay=15) from None
    if state.created:
        _event(body, "BucketCreated", f"created bucket {dest.bucket!r}")

    deployment = desired.replicator_deployment(body, spec, repo_body, dest.storage_url, job_image)
    _, action = kube.apply(deployment)
    replicator = deployment["metadata"]["name"]
    if action != "unchanged":
        _event(body, f"Replicator{action.capitalize()}", f"{action} Deployment {replicator}")
    return _mirror_status(body, spec, source, dest, replicator)


def _mirror_status(
    body: Mapping[str, Any],
    spec: MirrorSpec,
    source: Connection,
    dest: Connection,
    replicator: str,
) -> MirrorStatus:
    _, _, gen = _meta(body)
    previous = observed(MirrorStatus, body)
    fields = MirrorStatus(destination=dest.storage_url, replicator=replicator)
    conds = previous.conditions
    try:
        source_repo = Repository.open(source.storage())
        promoter = Promoter(
            source_repo,
            dest.storage(),
            branches=spec.branches,
            tags=spec.tags,
            copy=spec.mode == "copy",
            create=False,
        )
        seen = promoter.status().to_json()
    except RepositoryNotFound:
        ready = (
            False,
            "WaitingForReplicator",
            f"{dest.storage_url} is not a mirror yet: the replicator's first pass makes it one",
        )
    except RepositoryExists as e:
        ready = (False, "DestinationInUse", str(e))
    except (ZarrlakeError, StorageError) as e:
        ready = (False, "StorageError", f"{type(e).__name__}: {e}")
    else:
        refs = [desired.mirror_ref_status(r) for r in seen["refs"]]
        health = desired.mirror_health(
            previous.refs,
            previous.last_progress_time,
            refs,
            parse_duration(spec.stalled_after),
        )
        fields = fields.model_copy(
            update={
                "repository_id": source_repo.id,
                "refs": refs,
                "commits_behind": health.commits_behind,
                "missing_objects": health.missing_objects,
                "last_progress_time": health.last_progress_time,
            }
        )
        conds = desired.mirror_conditions(conds, health, spec.stalled_after, generation=gen)
        state = (
            "all up to date"
            if not health.behind
            else f"{len(health.behind)} behind, {health.missing_objects} object(s) missing"
        )
        errors = [f"{r.kind} {r.name}: {r.error}" for r in refs if r.error]
        ready = (
            True,
            "Mirroring",
            f"replicator {replicator}; {len(refs)} ref(s), {state}"
            + (f"; errors: {'; '.join(errors)[:300]}" if errors else ""),
        )
    # Stalled is the mirror's own while Ready (no progress for stalledAfter).
    conds = desired.set_ready(conds, *ready, generation=gen, keep_stalled=True)
    status = fields.model_copy(
        update={
            "conditions": conds,
            "phase": "Ready" if ready[0] else "Pending",
            "observed_generation": gen,
        }
    )
    # Only a change is written (the last refs stay while the destination cannot be read).
    new, old = status.patch(), previous.patch()
    if any(old.get(k) != v for k, v in new.items()):
        _write_status(body, status)
    else:
        _gauge_ready(body, status)
    return status


def delete_mirror(body: Mapping[str, Any]) -> str:
    """Stop the replicator (before any data goes), then honour the reclaim policy."""
    ns, name, _ = _meta(body)
    stopped = kube.delete("Deployment", ns, desired.replicator_name(name))
    what = "replicator stopped; " if stopped else ""
    try:
        spec = MirrorSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        return f"{what}Retain: the spec does not parse ({problems(e, prefix='spec.')})"
    if spec.reclaim_policy != "Delete":
        return f"{what}Retain: the mirror's data stays at the destination"
    status = observed(MirrorStatus, body)
    try:
        conn = storage_connection(spec.destination, kube.secrets(ns), f"Mirror {name!r}")
    except KubernetesError as e:
        message = f"reclaimPolicy Delete could not run, data retained: {e}"
        _event(body, "ReclaimFailed", message, warning=True)
        raise kopf.PermanentError(message) from None
    n = _delete_data(body, conn, status.repository_id, mirror=True)
    return f"{what}Delete: removed {n} object(s) of the mirror at {conn.storage_url}"
