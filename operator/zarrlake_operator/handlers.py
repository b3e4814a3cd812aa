"""Kopf handlers: thin. Each one hands the resource body to :mod:`zarrlake_operator.reconcile`.

Change handlers (create, update, resume) run a reconciliation and retry it with backoff until it
succeeds. A Branch, Tag or RetentionPolicy whose Repository is missing or not Ready waits for it:
its handler tries again the moment the watch shows that Repository Ready, or after the delay.

At rest, one timer per Repository, every ``ZARRLAKE_RESYNC_SECONDS``, resyncs the Repository and
then its dependents: it reads the repository's refs once (one listing), and reconciles only the
Branches and Tags whose status that does not confirm, and every RetentionPolicy (which costs no
storage request). So drift is noticed within one interval — a branch moved or deleted behind the
operator's back, a tag deleted, a bucket or repository gone, a lock Deployment or a CronJob
edited by hand — while a resting fleet costs one listing per repository and interval. Each
dependent also has a slow timer (``ZARRLAKE_DEPENDENT_RESYNC_SECONDS``, ten intervals by default)
that resyncs it only if no resync of its Repository covered it in the last two intervals (its
Repository is missing, say). Nothing but its delete handler acts on an object being deleted:
no resync, and no resync of a Repository's dependents while that Repository is going.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import kopf
from pydantic import ValidationError

from zarrlake_operator import desired, kube, metrics, reconcile
from zarrlake_operator.models import GROUP, VERSION, MirrorSpec

RESYNC_SECONDS = float(os.environ.get("ZARRLAKE_RESYNC_SECONDS", "60"))
DEPENDENT_RESYNC_SECONDS = float(
    os.environ.get("ZARRLAKE_DEPENDENT_RESYNC_SECONDS") or 10 * RESYNC_SECONDS
)
JOB_IMAGE = os.environ.get("ZARRLAKE_JOB_IMAGE", desired.JOB_IMAGE)
# engine: spark defaults (Helm values spark.image and spark.serviceAccountName).
SPARK = desired.SparkDefaults(
    os.environ.get("ZARRLAKE_SPARK_IMAGE") or desired.SPARK_IMAGE,
    os.environ.get("ZARRLAKE_SPARK_SERVICE_ACCOUNT") or None,
)
# spec.serve defaults (Helm values serve.image and serve.resources; the image: the job image).
SERVE = desired.ServeDefaults(
    os.environ.get("ZARRLAKE_SERVE_IMAGE") or JOB_IMAGE,
    json.loads(os.environ.get("ZARRLAKE_SERVE_RESOURCES") or "null")
    or desired.DEFAULT_SERVE_RESOURCES,
)
FINALIZER = f"{GROUP}/finalizer"

log = logging.getLogger("zarrlake_operator")


# Kopf's settings, for the executor its sync handlers run on (the async ones use it too).
_settings: list[kopf.OperatorSettings] = []


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    _settings[:] = [settings]
    settings.persistence.finalizer = FINALIZER
    # Progress and the last-handled spec live in annotations: our CRD status schemas are strict.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Events are ours to post (kopf.info/warn in reconcile), not a copy of every log line.
    settings.posting.loggers = False
    settings.execution.max_workers = int(os.environ.get("ZARRLAKE_OPERATOR_WORKERS", "8"))
    settings.networking.request_timeout = 60
    settings.watching.server_timeout = 300
    if metrics.count_request not in kube.observers:
        kube.observers.append(metrics.count_request)
    metrics.serve(int(os.environ.get("ZARRLAKE_METRICS_PORT", "9090")))


_object_locks: dict[str, threading.Lock] = {}
_object_locks_guard = threading.Lock()
# Uids of the objects whose delete handler has finished, oldest first (the newest
# :data:`FINISHED_KEPT`): a resync may still hold a body of one read before that (the watch's
# view lags, and a Repository's resync takes its dependents from it), and must not act on it.
_finished: OrderedDict[str, None] = OrderedDict()
FINISHED_KEPT = 4096


def serialized(body: Mapping[str, Any]) -> threading.Lock:
    """One lock per object: Kopf runs timers beside change handlers, and two reconciliations of
    one object at once would race on its status and on what they create."""
    uid = body["metadata"]["uid"]
    with _object_locks_guard:
        return _object_locks.setdefault(uid, threading.Lock())


def forget(body: kopf.Body) -> None:
    """The object's delete handler has finished: drop its lock, and remember that it is gone."""
    uid = body["metadata"]["uid"]
    with _object_locks_guard:
        _object_locks.pop(uid, None)
        _finished[uid] = None
        while len(_finished) > FINISHED_KEPT:
            _finished.popitem(last=False)


@contextmanager
def deleting(body: kopf.Body) -> Iterator[None]:
    """Hold the object's lock for its delete handler; when the handler has finished, remember
    the object gone (see :func:`being_deleted`) before a resync waiting for the lock takes it."""
    with serialized(body):
        yield
        forget(body)


def being_deleted(body: Mapping[str, Any]) -> bool:
    """Whether the object is being deleted (or is gone): nothing but its delete handler may act
    on it then. A resync that took a Branch's absent branch for drift would otherwise create it
    again, after (or while) its delete handler deleted it."""
    if desired.marked_for_deletion(body):
        return True
    with _object_locks_guard:
        return (body.get("metadata") or {}).get("uid") in _finished


def _seen(body: kopf.Body, event: kopf.RawEvent, kind: str) -> bool:
    """Keep the watch's view of an object; a deletion also takes its metrics' series along.
    Returns whether it was deleted."""
    deleted = event.get("type") == "DELETED"
    kube.remember(body, kind, deleted=deleted)
    if deleted:
        metrics.forget_object(kind, body["metadata"]["namespace"], body["metadata"]["name"])
    return deleted


def resync(kind: str, fn: Callable[..., object], body: Mapping[str, Any], **kwargs: Any) -> None:
    """A timer tick: ``fn(body, **kwargs)`` under the object's lock, counted in the metrics of
    ``kind``. The change handlers own retries, so a tick reports and moves on: a
    :class:`kopf.TemporaryError` is logged, a :class:`kopf.PermanentError` left to the condition
    the reconcile set, anything else raised. Nothing happens for an object being deleted, or
    whose delete handler has finished (:func:`being_deleted`)."""
    if being_deleted(body):  # before the lock too: a gone object's lock is not made again
        return
    try:
        with serialized(body):
            if being_deleted(body):  # again under the lock: its delete handler may have run
                return
            metrics.instrumented(kind)(fn)(body, **kwargs)
    except kopf.TemporaryError as e:
        log.info("resync of %s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], e)
    except kopf.PermanentError:
        pass  # the condition says what is wrong


T = TypeVar("T")


async def _in_thread(fn: Callable[[], T]) -> T:
    """Run blocking code as Kopf runs a sync handler: on its executor, in a copy of this context
    (where Kopf's event posting lives); a cancellation waits for the thread to finish."""
    loop = asyncio.get_running_loop()
    executor = _settings[0].execution.executor if _settings else None
    future = loop.run_in_executor(executor, contextvars.copy_context().run, fn)
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as e:
            cancelled = e
    if cancelled is not None:
        raise cancelled
    return future.result()


# -- waiting for a Repository --
# Handlers of dependents waiting for a Repository to turn Ready, by (namespace, name); the watch
# of Repositories wakes them (everything here runs on the event loop).
_waiting: dict[tuple[str, str], set[asyncio.Future[None]]] = {}


def _is_ready(body: Mapping[str, Any] | None) -> bool:
    conditions = ((body or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


async def _repository_ready(namespace: str, name: str, timeout: float) -> bool:
    """Whether the watch shows Repository ``name`` Ready now or within ``timeout`` seconds."""
    if _is_ready(kube.watched("Repository", namespace, name)):
        return True
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiters = _waiting.setdefault((namespace, name), set())
    waiters.add(waiter)
    try:
        await asyncio.wait_for(waiter, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        waiters.discard(waiter)
        if not waiters and _waiting.get((namespace, name)) is waiters:
            del _waiting[namespace, name]


async def _dependent_changed(
    kind: str, fn: Callable[..., object], body: kopf.Body, **kwargs: Any
) -> None:
    """A change of a Branch, Tag, RetentionPolicy or Mirror: reconcile it; if its Repository is
    missing or not Ready, wait for the watch to show it Ready (at most the retry delay) and try
    again then — at once, not a delay after it turned Ready."""

    def attempt() -> None:
        with serialized(body):
            metrics.instrumented(kind)(fn)(body, **kwargs)

    try:
        await _in_thread(attempt)
        return
    except reconcile.RepositoryNotReady as e:
        woken = await _repository_ready(body["metadata"]["namespace"], e.repository, e.delay or 0)
        metrics.REPOSITORY_WAITS.labels(kind, "woken" if woken else "timeout").inc()
        if not woken:
            # Waited as long as Kopf would have: its retry can come at once.
            raise kopf.TemporaryError(str(e), delay=0) from None
    await _in_thread(attempt)


# -- the resync of a Repository and its dependents --
# (namespace, Repository) -> time.monotonic() of its last resync that went on to its dependents.
_passed: dict[tuple[str, str], float] = {}


def _covered(body: Mapping[str, Any]) -> bool:
    """Whether a resync of the dependent's Repository checked it in the last two intervals."""
    repository = str((body.get("spec") or {}).get("repository"))
    passed = _passed.get((body["metadata"]["namespace"], repository))
    return passed is not None and time.monotonic() - passed < 2 * RESYNC_SECONDS


def _resync_dependents(repo_body: kopf.Body) -> None:
    """After a Repository's resync: reconcile those of its dependents whose status what it read
    does not confirm (see :func:`reconcile.dependents`). One failing does not stop the others."""
    for dependent in reconcile.dependents(repo_body):
        if being_deleted(dependent.body):
            continue
        outcome = "confirmed" if dependent.confirmed else "reconciled"
        metrics.DEPENDENTS_CHECKED.labels(dependent.kind, outcome).inc()
        if dependent.confirmed:
            continue
        fn, kwargs = RESYNCS[dependent.kind]
        try:
            resync(dependent.kind, fn, dependent.body, **kwargs)
        except Exception:
            meta = dependent.body["metadata"]
            log.exception("resync of %s %s/%s", dependent.kind, meta["namespace"], meta["name"])
    meta = repo_body["metadata"]
    _passed[meta["namespace"], meta["name"]] = time.monotonic()


# -- Repository --

REPOSITORIES = (GROUP, VERSION, "repositories")


@kopf.on.resume(*REPOSITORIES)
@kopf.on.create(*REPOSITORIES)
@kopf.on.update(*REPOSITORIES, field="spec")
@metrics.instrumented("Repository")
def repository_changed(body: kopf.Body, **_: Any) -> None:
    with serialized(body):
        reconcile.repository(body, serve=SERVE)


@kopf.timer(*REPOSITORIES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def repository_resync(body: kopf.Body, **_: Any) -> None:
    if being_deleted(body):
        # Kopf lets a tick that began before the mark run on beside the delete handler: its
        # dependents' reconciles would open a repository that is being reclaimed.
        return
    resync("Repository", reconcile.repository, body, resync=True, serve=SERVE)
    _resync_dependents(body)


@kopf.on.event(*REPOSITORIES)
async def repository_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    """Keep the watch's view of every Repository (the reconciles of what names one read it), and
    wake the dependents that wait for one to turn Ready."""
    deleted = _seen(body, event, "Repository")
    if not deleted and _is_ready(body):
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        for waiter in _waiting.get(key, ()):
            if not waiter.done():
                waiter.set_result(None)


@kopf.on.delete(*REPOSITORIES)
@metrics.instrumented("Repository")
def repository_deleted(body: kopf.Body, logger: kopf.Logger, retry: int = 0, **_: Any) -> None:
    with deleting(body):
        outcome = reconcile.delete_repository(body, retry=retry)
    _passed.pop((body["metadata"]["namespace"], body["metadata"]["name"]), None)
    logger.info(outcome)
    kopf.info(body, reason="Reclaimed", message=outcome)


# -- Branch --

BRANCHES = (GROUP, VERSION, "branches")


@kopf.on.resume(*BRANCHES)
@kopf.on.create(*BRANCHES)
@kopf.on.update(*BRANCHES, field="spec")
async def branch_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    await _dependent_changed("Branch", reconcile.branch, body, patch=patch)


@kopf.timer(*BRANCHES, interval=DEPENDENT_RESYNC_SECONDS, initial_delay=DEPENDENT_RESYNC_SECONDS)
def branch_resync(body: kopf.Body, **_: Any) -> None:
    if not _covered(body):
        resync("Branch", reconcile.branch, body, resync=True)


@kopf.on.event(*BRANCHES)
async def branch_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    _seen(body, event, "Branch")


@kopf.on.delete(*BRANCHES)
@metrics.instrumented("Branch")
def branch_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with deleting(body):
        logger.info(reconcile.delete_branch(body))


# -- Tag --

TAGS = (GROUP, VERSION, "tags")


@kopf.on.resume(*TAGS)
@kopf.on.create(*TAGS)
@kopf.on.update(*TAGS, field="spec")
async def tag_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    await _dependent_changed("Tag", reconcile.tag, body, patch=patch)


@kopf.timer(*TAGS, interval=DEPENDENT_RESYNC_SECONDS, initial_delay=DEPENDENT_RESYNC_SECONDS)
def tag_resync(body: kopf.Body, **_: Any) -> None:
    if not _covered(body):
        resync("Tag", reconcile.tag, body, resync=True)


@kopf.on.event(*TAGS)
async def tag_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    _seen(body, event, "Tag")


@kopf.on.delete(*TAGS)
@metrics.instrumented("Tag")
def tag_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with deleting(body):
        logger.info(reconcile.delete_tag(body))


# -- RetentionPolicy and its jobs --

POLICIES = (GROUP, VERSION, "retentionpolicies")


@kopf.on.resume(*POLICIES)
@kopf.on.create(*POLICIES)
@kopf.on.update(*POLICIES, field="spec")
async def policy_changed(body: kopf.Body, **_: Any) -> None:
    await _dependent_changed(
        "RetentionPolicy", reconcile.retention_policy, body, job_image=JOB_IMAGE, spark=SPARK
    )


@kopf.timer(*POLICIES, interval=DEPENDENT_RESYNC_SECONDS, initial_delay=DEPENDENT_RESYNC_SECONDS)
def policy_resync(body: kopf.Body, **_: Any) -> None:
    if not _covered(body):
        fn, kwargs = RESYNCS["RetentionPolicy"]
        resync("RetentionPolicy", fn, body, **kwargs)


@kopf.on.event(*POLICIES)
async def policy_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    _seen(body, event, "RetentionPolicy")


# The resync of each kind of dependent: its reconcile and the arguments that make it a resync.
RESYNCS: dict[str, tuple[Callable[..., object], dict[str, Any]]] = {
    "Branch": (reconcile.branch, {"resync": True}),
    "Tag": (reconcile.tag, {"resync": True}),
    "RetentionPolicy": (
        reconcile.retention_policy,
        {"job_image": JOB_IMAGE, "spark": SPARK, "resync": True},
    ),
}


@kopf.on.delete(*POLICIES, optional=True)  # optional: no finalizer; children go by owner
def policy_deleted(body: kopf.Body, **_: Any) -> None:
    with deleting(body):
        pass  # nothing to delete: a tick waiting for the lock finds the policy gone


@kopf.on.event("batch", "v1", "cronjobs", labels={desired.POLICY_LABEL: kopf.PRESENT})
async def cron_job_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    """The watch's view of the policies' CronJobs: a resync compares with it (no request)."""
    kube.remember(body, "CronJob", deleted=event.get("type") == "DELETED")


@kopf.on.event("batch", "v1", "jobs", labels={desired.POLICY_LABEL: kopf.PRESENT})
@metrics.instrumented("Job")
def job_event(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    outcome = reconcile.job_finished(body)
    if outcome:
        logger.info(outcome)


# The drivers of engine: spark runs under the Spark operator (a ScheduledSparkApplication's
# SparkApplications): their termination message is the run's report. Watching pods needs the
# chart's spark.rbac; without it (ZARRLAKE_SPARK_RBAC=false) nothing watches them, and such runs'
# reports do not reach the policy's status (the spark-submit CronJob path still reports).
@metrics.instrumented("SparkDriver")
def spark_driver_event(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    outcome = reconcile.driver_finished(body)
    if outcome:
        logger.info(outcome)


if os.environ.get("ZARRLAKE_SPARK_RBAC", "true").lower() != "false":
    kopf.on.event(
        "",
        "v1",
        "pods",
        labels={desired.POLICY_LABEL: kopf.PRESENT, desired.ROLE_LABEL: "driver"},
    )(spark_driver_event)


# -- Mirror --

MIRRORS = (GROUP, VERSION, "mirrors")
# Mirrors are observed at their own spec.interval: a short timer ticks, and a tick observes the
# mirror only when its interval has passed since the last observation.
MIRROR_TICK_SECONDS = max(desired.MIN_MIRROR_INTERVAL, min(RESYNC_SECONDS, 5.0))
_last_observed: dict[str, float] = {}


def _observed_now(body: kopf.Body) -> None:
    _last_observed[body["metadata"]["uid"]] = time.monotonic()


@kopf.on.resume(*MIRRORS)
@kopf.on.create(*MIRRORS)
@kopf.on.update(*MIRRORS, field="spec")
async def mirror_changed(body: kopf.Body, **_: Any) -> None:
    _observed_now(body)
    await _dependent_changed("Mirror", reconcile.mirror, body, job_image=JOB_IMAGE)


@kopf.timer(*MIRRORS, interval=MIRROR_TICK_SECONDS, initial_delay=MIRROR_TICK_SECONDS)
def mirror_resync(body: kopf.Body, spec: kopf.Spec, **_: Any) -> None:
    try:
        interval = desired.mirror_interval(MirrorSpec.model_validate(dict(spec)))
    except ValidationError:
        interval = RESYNC_SECONDS
    last = _last_observed.get(body["metadata"]["uid"])
    if being_deleted(body) or (last is not None and time.monotonic() - last < interval):
        return
    _observed_now(body)
    resync("Mirror", reconcile.mirror, body, job_image=JOB_IMAGE)


@kopf.on.delete(*MIRRORS)
@metrics.instrumented("Mirror")
def mirror_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with deleting(body):
        outcome = reconcile.delete_mirror(body)
    metrics.forget_object("Mirror", body["metadata"]["namespace"], body["metadata"]["name"])
    _last_observed.pop(body["metadata"]["uid"], None)
    logger.info(outcome)
    kopf.info(body, reason="Reclaimed", message=outcome)
