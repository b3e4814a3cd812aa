"""Leader election on a ``coordination.k8s.io/v1`` Lease, as Kubernetes' own controllers elect.

Every replica of the operator runs an :class:`Elector` on one Lease. The Lease names its holder
(``spec.holderIdentity``), how long a renewal counts (``leaseDurationSeconds``), when the holder
took it (``acquireTime``) and last renewed it (``renewTime``), and how often it changed hands
(``leaseTransitions``). Every write is a PUT carrying the ``resourceVersion`` that was read, so of
two replicas writing at once the API server accepts one and answers 409 Conflict to the other,
which reads again.

* A **standby** reads the Lease every ``retry_period``. It takes the Lease only when nobody holds
  it, or when the record has not changed for ``duration`` seconds *of its own clock*, counted from
  when it first saw that record: no comparison of the clocks of two machines is involved. When it
  has seen no change it sleeps until the moment the record would expire, not a whole period more.
  A standby writes nothing else, ever: it only reads that one Lease.
* The **leader** renews every ``retry_period`` (one PUT, from the body it last wrote; a 409 makes
  it read again). A watchdog, independent of the HTTP calls, ends leadership when no renewal has
  succeeded for ``renew_deadline`` seconds — counted from the moment the last successful renewal
  was *sent*, so the leader stops at least ``duration - renew_deadline`` seconds before any
  standby can consider the Lease expired. A leader that reads another holder in the Lease (it
  was taken) stops at once. Stopping is the caller's ``lost`` callback; the operator exits.
* On a clean shutdown the leader, after it stopped acting, **releases** the Lease: no holder and
  ``leaseDurationSeconds: 1``, so a standby takes it at its next read instead of waiting for the
  duration.

Failover after the leader dies without a word is at most ``duration + retry_period`` plus the
time of a request or two: the standby saw the last renewal up to one period late, and reads again
at the very moment that record expires. About ``duration`` on average.
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zarrlake_operator import kube

log = logging.getLogger("zarrlake_operator.leader")

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def micro_time(at: float | None = None) -> str:
    """A Kubernetes ``MicroTime``: RFC 3339 in UTC with microseconds (``...T12:00:00.000000Z``)."""
    moment = datetime.datetime.fromtimestamp(time.time() if at is None else at, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def identity(pod_name: str | None) -> str:
    """This replica's holder identity: its pod name and a random suffix, so that a pod restarted
    under the same name (a StatefulSet, a container restart) is a new holder, never the old one
    renewing."""
    import socket

    return f"{pod_name or socket.gethostname()}_{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class LeaseSettings:
    """Where the Lease is and how it is held; the durations are in seconds."""

    name: str
    namespace: str
    identity: str
    duration: float = 10.0
    renew_deadline: float = 7.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.name or not self.namespace or not self.identity:
            raise ValueError("a Lease needs a name, a namespace and a holder identity")
        if not self.duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0, got "
                f"{self.duration} s, {self.renew_deadline} s and {self.retry_period} s"
            )

    @property
    def path(self) -> str:
        return LEASES.format(ns=self.namespace)


class Elector:
    """One replica's side of the election on one Lease (see the module's docstring).

    :meth:`acquire` blocks while standing by; :meth:`hold` keeps the Lease in the background
    and calls ``lost`` when leadership ends; :meth:`release` hands it over.
    """

    def __init__(self, settings: LeaseSettings, call: Callable[..., Any] = kube.request) -> None:
        self.settings = settings
        #: How requests are made: ``call(verb, path, body=..., timeout=...)`` (``kube.request``).
        self._call = call
        self._lock = threading.Lock()
        #: The Lease as last read or written (its resourceVersion is the next PUT's precondition).
        self._lease: dict[str, Any] | None = None
        #: The spec of the record last seen, and when (monotonic) it was first seen like that.
        self._observed: dict[str, Any] | None = None
        self._observed_at = 0.0
        #: Monotonic time at which the last successful write of ours was sent.
        self.renewed_at = 0.0
        self.leading = False
        self._complained = 0.0

    # -- one attempt ---------------------------------------------------------------------------

    @property
    def holder(self) -> str:
        """The holder in the record last seen ("" when none, or nothing seen yet)."""
        return str((self._observed or {}).get("holderIdentity") or "")

    def expires_at(self) -> float:
        """Monotonic time at which the record last seen expires, by this replica's clock."""
        spec = self._observed or {}
        if not spec.get("holderIdentity"):
            return 0.0
        duration = float(spec.get("leaseDurationSeconds") or self.settings.duration)
        return self._observed_at + duration

    def try_acquire_or_renew(self, timeout: float | None = None) -> bool:
        """One attempt to take the Lease or renew it; True when this replica holds it now.

        Never raises for API trouble: an unreachable server, a 409 or a 5xx is a False (the
        caller tries again after a period, or the watchdog ends leadership). A request may take
        up to ``timeout`` (default: the renew deadline, as a slow API server is no reason to
        give up sooner)."""
        limit = timeout if timeout is not None else self.settings.renew_deadline
        try:
            with self._lock:
                return self._attempt(limit)
        except kube.KubeError as e:
            now = time.monotonic()
            if now - self._complained > 30:  # an outage is one line per 30 s, not per attempt
                self._complained = now
                log.warning("Lease %s/%s: %s", self.settings.namespace, self.settings.name, e)
            return False

    def _attempt(self, timeout: float) -> bool:
        s = self.settings
        url = f"{s.path}/{s.name}"
        if self.leading and self._lease is not None:
            # The leader renews from the body it last wrote: one PUT, no GET. A 409 means the
            # record moved under it (taken, or released by hand): read it and decide below.
            sent = time.monotonic()
            body = self._with_spec(self._lease, self._renewed(self._lease["spec"]))
            try:
                written = self._call("PUT", url, body=body, timeout=timeout)
            except kube.KubeError as e:
                if e.status != 409:
                    raise
            else:
                return self._won(written, sent)
        try:
            current = self._call("GET", url, timeout=timeout)
        except kube.KubeError as e:
            if e.status != 404:
                raise
            current = None
        seen = time.monotonic()
        if current is None:
            return self._create(timeout)
        if not isinstance(current, dict):
            raise kube.KubeError(f"GET {url}: the API server sent {type(current).__name__}")
        self._lease = current
        spec = dict(current.get("spec") or {})
        if spec != self._observed:
            self._observed, self._observed_at = spec, seen
        holder = spec.get("holderIdentity") or ""
        if holder != s.identity:
            if self.leading:  # taken, or cleared by someone else: leadership is over
                self.leading = False
                return False
            if holder and seen < self.expires_at():
                return False  # held, and renewed within the duration: stand by
        sent = time.monotonic()
        new_spec = self._renewed(spec) if holder == s.identity else self._taken(spec)
        try:
            written = self._call(
                "PUT", url, body=self._with_spec(current, new_spec), timeout=timeout
            )
        except kube.KubeError as e:
            if e.status == 409:  # another replica wrote first: it may have taken the Lease
                return False
            raise
        if holder != s.identity:
            log.info(
                "Lease %s/%s acquired as %s (from %s)",
                s.namespace,
                s.name,
                s.identity,
                holder or "nobody",
            )
        return self._won(written, sent)

    def _create(self, timeout: float) -> bool:
        s = self.settings
        sent = time.monotonic()
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": s.name, "namespace": s.namespace},
            "spec": {**self._taken({}), "leaseTransitions": 0},
        }
        try:
            written = self._call("POST", s.path, body=body, timeout=timeout)
        except kube.KubeError as e:
            if e.status == 409:  # created by another replica meanwhile
                return False
            raise
        log.info("Lease %s/%s created and acquired as %s", s.namespace, s.name, s.identity)
        return self._won(written, sent)

    def _won(self, written: Any, sent: float) -> bool:
        if not isinstance(written, dict):
            raise kube.KubeError(f"a Lease write answered {type(written).__name__}")
        self._lease = written
        self._observed = dict(written.get("spec") or {})
        self._observed_at = time.monotonic()
        self.renewed_at = sent
        self.leading = True
        return True

    def _renewed(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            **spec,
            "holderIdentity": self.settings.identity,
            "leaseDurationSeconds": _seconds(self.settings.duration),
            "renewTime": micro_time(),
        }

    def _taken(self, spec: dict[str, Any]) -> dict[str, Any]:
        now = micro_time()
        return {
            **spec,
            "holderIdentity": self.settings.identity,
            "leaseDurationSeconds": _seconds(self.settings.duration),
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + 1,
        }

    @staticmethod
    def _with_spec(lease: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(lease)
        body["spec"] = spec
        return body

    # -- standing by, holding, handing over ----------------------------------------------------

    def acquire(self, stop: threading.Event) -> bool:
        """Stand by until this replica holds the Lease (True) or ``stop`` is set (False)."""
        logged = False
        while not stop.is_set():
            if self.try_acquire_or_renew():
                return True
            if not logged and self.holder:
                log.info(
                    "Standing by: Lease %s/%s is held by %s",
                    self.settings.namespace,
                    self.settings.name,
                    self.holder,
                )
                logged = True
            wait = self.settings.retry_period
            expiry = self.expires_at()
            if expiry:  # aim at the moment the record expires rather than a period after it
                wait = min(wait, max(0.01, expiry - time.monotonic()))
            stop.wait(wait)
        return False

    def hold(self, stop: threading.Event, lost: Callable[[str], None]) -> list[threading.Thread]:
        """Keep the Lease until ``stop`` is set: renew every retry period, and call ``lost`` (once,
        from a background thread) the moment leadership ends. Returns the two threads."""
        s = self.settings
        ended = threading.Event()

        def end(why: str) -> None:
            if not ended.is_set() and not stop.is_set():
                ended.set()
                lost(why)

        def renew() -> None:
            while not stop.wait(s.retry_period) and not ended.is_set():
                remaining = self.renewed_at + s.renew_deadline - time.monotonic()
                if remaining <= 0:
                    return
                if self.try_acquire_or_renew(timeout=max(0.05, remaining)):
                    continue
                if self.holder != s.identity:
                    end(f"the Lease was taken by {self.holder or 'someone who cleared it'}")
                    return

        def watchdog() -> None:
            while not stop.is_set() and not ended.is_set():
                remaining = self.renewed_at + s.renew_deadline - time.monotonic()
                if remaining <= 0:
                    end(f"the Lease could not be renewed for {s.renew_deadline:g} s")
                    return
                stop.wait(remaining)

        threads = [
            threading.Thread(target=renew, name="lease-renew", daemon=True),
            threading.Thread(target=watchdog, name="lease-watchdog", daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads

    def release(self, timeout: float = 5.0) -> bool:
        """Give the Lease up (no holder, a 1 s duration) if this replica holds it; True if it
        did. Call it only once this replica has stopped acting."""
        s = self.settings
        with self._lock:
            if not self.leading or self._lease is None:
                return False
            self.leading = False
            lease = self._lease
            for _ in range(2):
                spec = dict(lease.get("spec") or {})
                if spec.get("holderIdentity") != s.identity:
                    return False
                spec.pop("holderIdentity", None)
                spec.update(leaseDurationSeconds=1, renewTime=micro_time())
                try:
                    self._call(
                        "PUT",
                        f"{s.path}/{s.name}",
                        body=self._with_spec(lease, spec),
                        timeout=timeout,
                    )
                except kube.KubeError as e:
                    if e.status != 409:
                        log.warning("Lease %s/%s not released: %s", s.namespace, s.name, e)
                        return False
                    try:
                        lease = self._call("GET", f"{s.path}/{s.name}", timeout=timeout)
                    except kube.KubeError:
                        return False
                    continue
                log.info("Lease %s/%s released", s.namespace, s.name)
                return True
            return False


def _seconds(value: float) -> int:
    """``leaseDurationSeconds`` is an integer: round up, never shorten the promise."""
    whole = int(value)
    return whole if whole == value else whole + 1
