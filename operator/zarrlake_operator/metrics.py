"""Prometheus metrics: reconciles, errors and durations per kind, and the state of what the
operator manages (readiness, maintenance runs, lock services, branch heads).

A private registry, not the process-global one, so tests can read exact values and a second
operator in one process (tests again) does not collide.

The state gauges are set where a reconcile (or a watch event) already holds the fact: none of
them costs a request to the API server or to storage. They follow the objects: an object's
series go when it is deleted.
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "zarrlake_operator_reconciles_total",
    "Reconciliations by kind and outcome (ok, retry, invalid, error).",
    ["kind", "outcome"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "zarrlake_operator_errors_total",
    "Failed reconciliations by kind and error type.",
    ["kind", "error"],
    registry=REGISTRY,
)
DURATION = Histogram(
    "zarrlake_operator_reconcile_duration_seconds",
    "Time spent in one reconciliation, by kind.",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)

API_REQUESTS = Counter(
    "zarrlake_operator_api_requests_total",
    "Kubernetes API requests of the reconciliations and of leader election (not Kopf's own), "
    "by verb and resource.",
    ["verb", "resource"],
    registry=REGISTRY,
)


LEADER = Gauge(
    "zarrlake_operator_leader",
    "1 while this replica holds the leader-election Lease and acts, 0 while it stands by.",
    registry=REGISTRY,
)


DEPENDENTS_CHECKED = Counter(
    "zarrlake_operator_dependents_checked_total",
    "Branches, Tags and RetentionPolicies a Repository's resync checked, by kind and outcome "
    "(confirmed: its status already said what the resync read; reconciled).",
    ["kind", "outcome"],
    registry=REGISTRY,
)


REPOSITORY_WAITS = Counter(
    "zarrlake_operator_repository_waits_total",
    "Changes of Branches, Tags and RetentionPolicies that waited for their Repository to turn "
    "Ready, by kind and outcome (woken: it did, and they went on at once; timeout: retried).",
    ["kind", "outcome"],
    registry=REGISTRY,
)


READY = Gauge(
    "zarrlake_operator_resource_ready",
    "1 when a resource's Ready condition is True, 0 otherwise, by kind, namespace and name "
    "(as its last reconcile or the watch saw it).",
    ["kind", "namespace", "name"],
    registry=REGISTRY,
)

LOCK_SERVICE_READY = Gauge(
    "zarrlake_operator_lock_service_ready",
    "1 when a Repository's LockServiceReady condition is True (its lock service answers, or "
    "it needs none), 0 otherwise.",
    ["namespace", "name"],
    registry=REGISTRY,
)

BRANCH_HEAD_TIMESTAMP = Gauge(
    "zarrlake_operator_branch_head_timestamp_seconds",
    "Unix time of the head commit of a Branch resource's branch.",
    ["namespace", "name", "repository"],
    registry=REGISTRY,
)
BRANCH_HEAD_AGE = Gauge(
    "zarrlake_operator_branch_head_age_seconds",
    "Seconds since the head commit of a Branch resource's branch (computed when scraped).",
    ["namespace", "name", "repository"],
    registry=REGISTRY,
)

# Maintenance runs per RetentionPolicy; ``task`` is gc or compaction (not ``job``: Prometheus
# gives every scraped series a ``job`` label of its own).
MAINTENANCE_RESULT = Gauge(
    "zarrlake_operator_maintenance_last_result",
    "1 when the last GC or compaction run of a RetentionPolicy succeeded, 0 when it failed.",
    ["namespace", "name", "task"],
    registry=REGISTRY,
)
MAINTENANCE_DURATION = Gauge(
    "zarrlake_operator_maintenance_last_duration_seconds",
    "How long the last GC or compaction run of a RetentionPolicy took (its Job's or Spark "
    "driver's start to its end).",
    ["namespace", "name", "task"],
    registry=REGISTRY,
)
MAINTENANCE_FINISHED = Gauge(
    "zarrlake_operator_maintenance_last_run_timestamp_seconds",
    "Unix time at which the last GC or compaction run of a RetentionPolicy ended.",
    ["namespace", "name", "task"],
    registry=REGISTRY,
)
MAINTENANCE_SUCCEEDED = Gauge(
    "zarrlake_operator_maintenance_last_success_timestamp_seconds",
    "Unix time at which the last successful GC or compaction run of a RetentionPolicy that "
    "this operator process knows of ended (its status keeps only the last run: after a restart "
    "that followed a failure, unknown until the next success).",
    ["namespace", "name", "task"],
    registry=REGISTRY,
)

_state_lock = threading.Lock()
# What the state gauges hold per object, to remove exactly its series when it goes.
_branch_repository: dict[tuple[str, str], str] = {}
_maintenance_tasks: dict[tuple[str, str], set[str]] = {}


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


def set_ready(kind: str, namespace: str, name: str, ready: bool) -> None:
    READY.labels(kind, namespace, name).set(1 if ready else 0)


def set_lock_service_ready(namespace: str, name: str, ready: bool) -> None:
    LOCK_SERVICE_READY.labels(namespace, name).set(1 if ready else 0)


def parse_time(text: str | None) -> float | None:
    """Unix time of an RFC 3339 time as Kubernetes writes them (``2025-01-02T03:04:05Z``)."""
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def set_branch_head(namespace: str, name: str, repository: str, committed: float) -> None:
    """The head commit time of a Branch resource's branch; its age is computed when scraped."""
    with _state_lock:
        before = _branch_repository.get((namespace, name))
        if before is not None and before != repository:
            _remove(BRANCH_HEAD_TIMESTAMP, namespace, name, before)
            _remove(BRANCH_HEAD_AGE, namespace, name, before)
        _branch_repository[namespace, name] = repository
        BRANCH_HEAD_TIMESTAMP.labels(namespace, name, repository).set(committed)
        BRANCH_HEAD_AGE.labels(namespace, name, repository).set_function(
            lambda: max(0.0, time.time() - committed)
        )


def set_maintenance_run(
    namespace: str,
    name: str,
    task: str,
    *,
    succeeded: bool,
    finished: float | None,
    duration: float | None,
) -> None:
    """The last GC (``task`` gc) or compaction run of a RetentionPolicy, as its status records
    it; a value the run does not say (an older operator's entry has no duration) is left out."""
    with _state_lock:
        _maintenance_tasks.setdefault((namespace, name), set()).add(task)
        MAINTENANCE_RESULT.labels(namespace, name, task).set(1 if succeeded else 0)
        for gauge, value in ((MAINTENANCE_FINISHED, finished), (MAINTENANCE_DURATION, duration)):
            if value is None:
                _remove(gauge, namespace, name, task)
            else:
                gauge.labels(namespace, name, task).set(value)
        if succeeded and finished is not None:
            MAINTENANCE_SUCCEEDED.labels(namespace, name, task).set(finished)


def forget_object(kind: str, namespace: str, name: str) -> None:
    """Remove every series of a deleted object."""
    _remove(READY, kind, namespace, name)
    with _state_lock:
        if kind == "Repository":
            _remove(LOCK_SERVICE_READY, namespace, name)
        elif kind == "Branch":
            repository = _branch_repository.pop((namespace, name), None)
            if repository is not None:
                _remove(BRANCH_HEAD_TIMESTAMP, namespace, name, repository)
                _remove(BRANCH_HEAD_AGE, namespace, name, repository)
        elif kind == "RetentionPolicy":
            for task in _maintenance_tasks.pop((namespace, name), set()):
                for gauge in (
                    MAINTENANCE_RESULT,
                    MAINTENANCE_DURATION,
                    MAINTENANCE_FINISHED,
                    MAINTENANCE_SUCCEEDED,
                ):
                    _remove(gauge, namespace, name, task)


def count_request(verb: str, resource: str) -> None:
    API_REQUESTS.labels(verb, resource).inc()


P = ParamSpec("P")
R = TypeVar("R")


def instrumented(kind: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Count and time every call of a handler for ``kind``."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            import kopf

            start = time.perf_counter()
            outcome = "ok"
            try:
                return fn(*args, **kwargs)
            except kopf.TemporaryError as e:
                outcome = "retry"
                ERRORS.labels(kind, type(e).__name__).inc()
                raise
            except kopf.PermanentError as e:
                outcome = "invalid"
                ERRORS.labels(kind, type(e).__name__).inc()
                raise
            except Exception as e:
                outcome = "error"
                ERRORS.labels(kind, type(e).__name__).inc()
                raise
            finally:
                RECONCILES.labels(kind, outcome).inc()
                DURATION.labels(kind).observe(time.perf_counter() - start)

        return run

    return wrap


_serving: set[int] = set()


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Expose ``/metrics`` on ``port`` (0: do not serve); once per port, however often called
    (a standby serves its metrics before Kopf's startup handler asks again)."""
    if port and port not in _serving:
        start_http_server(port, addr=address, registry=REGISTRY)
        _serving.add(port)
