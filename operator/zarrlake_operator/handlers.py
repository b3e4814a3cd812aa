"""Kopf handlers: thin. Each one hands the resource body to :mod:`zarrlake_operator.reconcile`.

Change handlers (create, update, resume) run a reconciliation and retry it with backoff until it
succeeds; a timer runs it again every ``ZARRLAKE_RESYNC_SECONDS`` to report branch heads and
correct drift (a lock Deployment edited by hand, a branch deleted behind the operator's back).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf
from pydantic import ValidationError

from zarrlake_operator import desired, kube, metrics, reconcile
from zarrlake_operator.models import GROUP, VERSION, MirrorSpec

RESYNC_SECONDS = float(os.environ.get("ZARRLAKE_RESYNC_SECONDS", "60"))
JOB_IMAGE = os.environ.get("ZARRLAKE_JOB_IMAGE", desired.JOB_IMAGE)
# engine: spark defaults (Helm values spark.image and spark.serviceAccountName).
SPARK = desired.SparkDefaults(
    os.environ.get("ZARRLAKE_SPARK_IMAGE") or desired.SPARK_IMAGE,
    os.environ.get("ZARRLAKE_SPARK_SERVICE_ACCOUNT") or None,
)
FINALIZER = f"{GROUP}/finalizer"

log = logging.getLogger("zarrlake_operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # A replica that dies without leaving the peering (SIGKILL, a lost node) is taken over when
    # its record expires: Kopf refreshes it every lifetime minus 5-10 s, a standby waits out a
    # whole lifetime. 12 s keeps failover under 15 s for a few PATCHes a minute.
    settings.peering.lifetime = int(os.environ.get("ZARRLAKE_PEERING_LIFETIME", "12"))
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


def serialized(body: kopf.Body) -> threading.Lock:
    """One lock per object: Kopf runs timers beside change handlers, and two reconciliations of
    one object at once would race on its status and on what they create."""
    uid = body["metadata"]["uid"]
    with _object_locks_guard:
        return _object_locks.setdefault(uid, threading.Lock())


def forget(body: kopf.Body) -> None:
    with _object_locks_guard:
        _object_locks.pop(body["metadata"]["uid"], None)


def _resync(kind: str, fn: Callable[..., object], body: kopf.Body, **kwargs: Any) -> None:
    """A timer tick: the change handlers own retries, so a tick reports, counts and moves on."""
    try:
        with serialized(body):
            metrics.instrumented(kind)(fn)(body, **kwargs)
    except kopf.TemporaryError as e:
        log.info("resync of %s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], e)
    except kopf.PermanentError:
        pass  # the condition says what is wrong


# -- Repository --

REPOSITORIES = (GROUP, VERSION, "repositories")


@kopf.on.resume(*REPOSITORIES)
@kopf.on.create(*REPOSITORIES)
@kopf.on.update(*REPOSITORIES, field="spec")
@metrics.instrumented("Repository")
def repository_changed(body: kopf.Body, **_: Any) -> None:
    with serialized(body):
        reconcile.repository(body)


@kopf.timer(*REPOSITORIES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def repository_resync(body: kopf.Body, **_: Any) -> None:
    _resync("Repository", reconcile.repository, body, resync=True)


@kopf.on.event(*REPOSITORIES)
def repository_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    """Keep the watch's view of every Repository: the reconciles of what names one read it."""
    kube.remember(body, "Repository", deleted=event.get("type") == "DELETED")


@kopf.on.delete(*REPOSITORIES)
@metrics.instrumented("Repository")
def repository_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with serialized(body):
        outcome = reconcile.delete_repository(body)
    forget(body)
    logger.info(outcome)
    kopf.info(body, reason="Reclaimed", message=outcome)


# -- Branch --

BRANCHES = (GROUP, VERSION, "branches")


@kopf.on.resume(*BRANCHES)
@kopf.on.create(*BRANCHES)
@kopf.on.update(*BRANCHES, field="spec")
@metrics.instrumented("Branch")
def branch_changed(body: kopf.Body, **_: Any) -> None:
    with serialized(body):
        reconcile.branch(body)


@kopf.timer(*BRANCHES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def branch_resync(body: kopf.Body, **_: Any) -> None:
    _resync("Branch", reconcile.branch, body, resync=True)


@kopf.on.event(*BRANCHES)
def branch_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    kube.remember(body, "Branch", deleted=event.get("type") == "DELETED")


@kopf.on.delete(*BRANCHES)
@metrics.instrumented("Branch")
def branch_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with serialized(body):
        logger.info(reconcile.delete_branch(body))
    forget(body)


# -- Tag --

TAGS = (GROUP, VERSION, "tags")


@kopf.on.resume(*TAGS)
@kopf.on.create(*TAGS)
@kopf.on.update(*TAGS, field="spec")
@metrics.instrumented("Tag")
def tag_changed(body: kopf.Body, **_: Any) -> None:
    with serialized(body):
        reconcile.tag(body)


@kopf.timer(*TAGS, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def tag_resync(body: kopf.Body, **_: Any) -> None:
    _resync("Tag", reconcile.tag, body, resync=True)


@kopf.on.event(*TAGS)
def tag_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
    kube.remember(body, "Tag", deleted=event.get("type") == "DELETED")


@kopf.on.delete(*TAGS)
@metrics.instrumented("Tag")
def tag_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with serialized(body):
        logger.info(reconcile.delete_tag(body))
    forget(body)


# -- RetentionPolicy and its jobs --

POLICIES = (GROUP, VERSION, "retentionpolicies")


@kopf.on.resume(*POLICIES)
@kopf.on.create(*POLICIES)
@kopf.on.update(*POLICIES, field="spec")
@metrics.instrumented("RetentionPolicy")
def policy_changed(body: kopf.Body, **_: Any) -> None:
    with serialized(body):
        reconcile.retention_policy(body, JOB_IMAGE, SPARK)


@kopf.timer(*POLICIES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def policy_resync(body: kopf.Body, **_: Any) -> None:
    _resync(
        "RetentionPolicy",
        reconcile.retention_policy,
        body,
        job_image=JOB_IMAGE,
        spark=SPARK,
        resync=True,
    )


@kopf.on.delete(*POLICIES, optional=True)  # optional: no finalizer; children go by owner
def policy_deleted(body: kopf.Body, **_: Any) -> None:
    forget(body)


@kopf.on.event("batch", "v1", "cronjobs", labels={desired.POLICY_LABEL: kopf.PRESENT})
def cron_job_seen(body: kopf.Body, event: kopf.RawEvent, **_: Any) -> None:
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
@metrics.instrumented("Mirror")
def mirror_changed(body: kopf.Body, **_: Any) -> None:
    with serialized(body):
        _observed_now(body)
        reconcile.mirror(body, JOB_IMAGE)


@kopf.timer(*MIRRORS, interval=MIRROR_TICK_SECONDS, initial_delay=MIRROR_TICK_SECONDS)
def mirror_resync(body: kopf.Body, spec: kopf.Spec, **_: Any) -> None:
    try:
        interval = desired.mirror_interval(MirrorSpec.model_validate(dict(spec)))
    except ValidationError:
        interval = RESYNC_SECONDS
    last = _last_observed.get(body["metadata"]["uid"])
    if last is not None and time.monotonic() - last < interval:
        return
    _observed_now(body)
    _resync("Mirror", reconcile.mirror, body, job_image=JOB_IMAGE)


@kopf.on.delete(*MIRRORS)
@metrics.instrumented("Mirror")
def mirror_deleted(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    with serialized(body):
        outcome = reconcile.delete_mirror(body)
    forget(body)
    _last_observed.pop(body["metadata"]["uid"], None)
    logger.info(outcome)
    kopf.info(body, reason="Reclaimed", message=outcome)
