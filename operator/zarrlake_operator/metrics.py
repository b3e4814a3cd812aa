"""Prometheus metrics: reconciles, errors and durations per kind.

A private registry, not the process-global one, so tests can read exact values and a second
operator in one process (tests again) does not collide.
"""

from __future__ import annotations

import functools
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
