"""Leader election on a ``coordination.k8s.io/v1`` Lease, as Kubernetes' own controllers elect.

Every replica of the operator runs an :class:`Elector` on one Lease. The Lease names its holder
(``spec.holderIdentity``), how long a renewal counts (``leaseDurationSeconds``), when the holder
took it (``acquireTime``) and last renewed it (``renewTime``), and how often it changed hands
(``leaseTransitions``). Every write is a PUT carrying the ``resourceVersion`` that was read, so of
two replicas writing at once the API server accepts one and answers 409 Conflict to the other,
which reads again.

* A **standby** reads the Lease once, then **watches** it (one request on the Leases of its
  namespace, ``fieldSelector=metadata.name=<name>``, from the resourceVersion it read; the server
  ends it after ``watch_timeout`` and the standby opens the next one from the last
  resourceVersion it saw, with bookmarks keeping that fresh). Each change the watch delivers (a
  renewal) restarts the standby's clock, as a changed record it read would: it takes the Lease
  only when nobody holds it (released, deleted), or when the record has not changed for
  ``duration`` seconds *of its own clock*, counted from when it first saw that record: no
  comparison of the clocks of two machines is involved. Taking it is the same read and
  resourceVersion'd PUT (or create) as ever; that read also tells whether the watch fell behind.
  A watch that ends with 410 Gone makes the standby read the Lease again; when watching fails
  repeatedly (three watches in a row that failed, or ended at once, without showing a change:
  no RBAC ``watch`` verb, a proxy that cuts streams; or a watch that fell behind a read) it
  reads every ``retry_period`` instead, as it did before watches, and tries watching again a
  minute later. A standby writes nothing, ever.
* The **leader** renews every ``renew_interval`` (one PUT, from the body it last wrote; a 409
  makes it read again), and after a failed renewal retries every ``retry_period``. A watchdog,
  independent of the HTTP calls, ends leadership when no renewal has succeeded for
  ``renew_deadline`` seconds — counted from the moment the last successful renewal was *sent*,
  so the leader stops at least ``duration - renew_deadline`` seconds before any standby can
  consider the Lease expired, whatever the renew interval. A leader that reads another holder in
  the Lease (it was taken) stops at once. Stopping is the caller's ``lost`` callback; the
  operator exits.
* On a clean shutdown the leader, after it stopped acting, **releases** the Lease: no holder and
  ``leaseDurationSeconds: 1``; a standby sees that on its watch and takes it at once instead of
  waiting for the duration.

Failover after the leader dies without a word is at most ``duration`` plus the time of a request
or two: the watch shows each renewal as it happens, and the standby acts at the very moment the
last one it saw expires; ``duration - renew_interval / 2`` on average.

Request budget at rest, with the defaults (duration 10 s, renew deadline 7 s, renew interval
4 s, retry period 2 s, watch timeout 300 s):

========== ============================================= ==============
replica    requests                                      per minute
========== ============================================= ==============
leader     one PUT per renew interval                    15
standby    one watch per watch timeout (+1 GET at start) 0.2
========== ============================================= ==============

(Before watches: the leader renewed every retry period and each standby read every retry period:
30 + 30 per standby.) The renew interval trades requests for tolerance of a slow or unreachable
API server: a renewal that fails is retried every retry period until the renew deadline, so with
the defaults a leader survives an outage of about ``renew_deadline - renew_interval`` = 3 s (5 s
when it renewed every 2 s). Safety does not depend on it.
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


#: The leader's default renew interval, in seconds (when the renew deadline allows it).
RENEW_INTERVAL = 4.0


@dataclass(frozen=True)
class LeaseSettings:
    """Where the Lease is and how it is held; the durations are in seconds."""

    name: str
    namespace: str
    identity: str
    duration: float = 10.0
    renew_deadline: float = 7.0
    retry_period: float = 2.0
    #: Between the leader's successful renewals (a failed one is retried every retry period).
    #: None: :data:`RENEW_INTERVAL` when a retry still fits before the renew deadline, else half
    #: the deadline — so that timings chosen before the interval existed (a short renew deadline)
    #: still work.
    renew_interval: float | None = None
    #: How long a standby's watch of the Lease lasts before the server ends it (and the standby
    #: opens the next one).
    watch_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not self.name or not self.namespace or not self.identity:
            raise ValueError("a Lease needs a name, a namespace and a holder identity")
        if not self.duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0, got "
                f"{self.duration} s, {self.renew_deadline} s and {self.retry_period} s"
            )
        if not self.renew_deadline > self.interval > 0:
            raise ValueError(
                "leader election needs renew deadline > renew interval > 0, got "
                f"{self.renew_deadline} s and {self.interval} s"
            )
        if self.watch_timeout < 1:
            raise ValueError(f"a watch of the Lease lasts at least 1 s, not {self.watch_timeout}")

    @property
    def interval(self) -> float:
        """Seconds between the leader's successful renewals (see :attr:`renew_interval`)."""
        if self.renew_interval is not None:
            return self.renew_interval
        if RENEW_INTERVAL + self.retry_period < self.renew_deadline:
            return RENEW_INTERVAL
        return self.renew_deadline / 2

    def warnings(self) -> list[str]:
        """What is legal but fragile about these timings, for the operator to log at start."""
        if self.interval + self.retry_period >= self.renew_deadline:
            return [
                f"renew interval {self.interval:g} s + retry period {self.retry_period:g} s "
                f">= renew deadline {self.renew_deadline:g} s: one failed renewal ends "
                "leadership (the retry comes after the deadline); lower the interval"
            ]
        return []

    @property
    def path(self) -> str:
        return LEASES.format(ns=self.namespace)


class Elector:
    """One replica's side of the election on one Lease (see the module's docstring).

    :meth:`acquire` blocks while standing by; :meth:`hold` keeps the Lease in the background
    and calls ``lost`` when leadership ends; :meth:`release` hands it over.
    """

    def __init__(
        self,
        settings: LeaseSettings,
        call: Callable[..., Any] = kube.request,
        watch: Callable[..., kube.WatchStream] = kube.watch,
    ) -> None:
        self.settings = settings
        #: How requests are made: ``call(verb, path, body=..., timeout=...)`` (``kube.request``).
        self._call = call
        #: How a standby watches: ``watch(path, query, timeout_seconds=...)`` (``kube.watch``).
        self._watch = watch
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
                if e.status == 404:
                    return self._deleted()
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
            if self.leading:
                return self._deleted()
            return self._create(timeout)
        if not isinstance(current, dict):
            raise kube.KubeError(f"GET {url}: the API server sent {type(current).__name__}")
        spec = self._saw(current, seen)
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

    def _deleted(self) -> bool:
        """The leader found its Lease deleted (by hand): a standby may create it anew at once,
        so leadership is over now, not at the renew deadline. Returns False."""
        self.leading = False
        self._observed, self._lease = None, None
        return False

    def _saw(self, lease: dict[str, Any], at: float) -> dict[str, Any]:
        """Note the Lease as read or watched at ``at`` (monotonic; ``_lock`` held): a record that
        differs from the one last seen restarts this replica's clock. Returns its spec."""
        self._lease = lease
        spec = dict(lease.get("spec") or {})
        if spec != self._observed:
            self._observed, self._observed_at = spec, at
        return spec

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
        """Stand by until this replica holds the Lease (True) or ``stop`` is set (False): read
        it, watch it, and read it again (and take it) when the record it saw last expires or the
        watch shows it released or deleted. See the module's docstring."""
        s = self.settings
        wake = threading.Event()  # set by the watch when it ends or shows the Lease free
        watch: _LeaseWatch | None = None
        since = ""  # the resourceVersion the next watch starts from
        failures = 0  # watches in a row that failed, or ended at once, without showing a change
        poll_until = 0.0  # reading every retry period instead of watching until then
        not_before = 0.0  # no new watch before then (after one that failed)
        logged = False
        why = "start"
        try:
            while not stop.is_set():
                clock = self._observed_at
                attempted = time.monotonic()
                if self.try_acquire_or_renew():
                    return True
                if not logged and self.holder:
                    log.info(
                        "Standing by: Lease %s/%s is held by %s",
                        s.namespace,
                        s.name,
                        self.holder,
                    )
                    logged = True
                if (
                    why == "expired"
                    and watch is not None
                    and self.holder
                    and self._observed_at != clock
                ):
                    # The read found a renewal that the watch had not shown before the record
                    # it did show expired: it fell behind. A new one starts from this read.
                    log.info(
                        "The watch of Lease %s/%s fell behind: watching anew", s.namespace, s.name
                    )
                    watch.close()
                    watch = None
                    failures += 1
                lease = self._lease
                if watch is None and lease is not None:
                    since = str((lease.get("metadata") or {}).get("resourceVersion") or "")
                # Stand by until there is a reason to read (and maybe take) the Lease again.
                while not stop.is_set():
                    wake.clear()
                    now = time.monotonic()
                    if watch is not None and watch.free:  # released or deleted: take it now
                        watch.free = False
                        why = "free"
                        break
                    if not self.holder or not since:
                        # Free, yet the attempt did not get it (another replica was quicker), or
                        # nothing read yet: read again a retry period after that attempt.
                        stop.wait(max(0.0, attempted + s.retry_period - now))
                        why = "retry"
                        break
                    expiry = max(self.expires_at(), attempted + s.retry_period)
                    if now >= expiry:
                        why = "expired"
                        break
                    if now < poll_until:
                        if watch is not None:
                            watch.close()
                            watch = None
                        stop.wait(min(s.retry_period, expiry - now))
                        why = "poll"
                        break
                    if watch is not None and watch.ended.is_set():
                        done, watch = watch, None
                        since = done.last_rv or since
                        if done.delivered:
                            failures = 0
                        if done.error is not None or (
                            not done.delivered and now - done.opened < min(30, s.watch_timeout / 2)
                        ):
                            failures += 1
                            not_before = now + s.retry_period
                            log.debug(
                                "The watch of Lease %s/%s ended: %s",
                                s.namespace,
                                s.name,
                                done.error,
                            )
                        if failures >= 3:
                            log.warning(
                                "Lease %s/%s: watching failed %d times in a row (%s); reading it "
                                "every %g s for a minute instead",
                                s.namespace,
                                s.name,
                                failures,
                                done.error or "the watches ended at once",
                                s.retry_period,
                            )
                            failures = 0
                            poll_until = now + POLL_INSTEAD_S
                            continue
                        if done.error is not None and done.error.status == 410:
                            why = "gone"  # too old a resourceVersion: read the Lease again
                            break
                    if watch is None and now >= not_before:
                        watch = _LeaseWatch(self, since, wake)
                    until = expiry if watch is not None else min(expiry, not_before)
                    while not stop.is_set() and not wake.is_set() and time.monotonic() < until:
                        wake.wait(min(0.1, max(0.0, until - time.monotonic())))
            return False
        finally:
            if watch is not None:
                watch.close()

    def hold(self, stop: threading.Event, lost: Callable[[str], None]) -> list[threading.Thread]:
        """Keep the Lease until ``stop`` is set: renew every renew interval (after a failure,
        every retry period), and call ``lost`` (once, from a background thread) the moment
        leadership ends. Returns the two threads."""
        s = self.settings
        ended = threading.Event()

        def end(why: str) -> None:
            if not ended.is_set() and not stop.is_set():
                ended.set()
                lost(why)

        def renew() -> None:
            wait = s.interval
            while not stop.wait(wait) and not ended.is_set():
                remaining = self.renewed_at + s.renew_deadline - time.monotonic()
                if remaining <= 0:
                    return
                if self.try_acquire_or_renew(timeout=max(0.05, remaining)):
                    wait = s.interval
                    continue
                if self.holder != s.identity:
                    end(f"the Lease was taken by {self.holder or 'someone who cleared it'}")
                    return
                wait = s.retry_period  # failed: try again sooner, until the deadline

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


#: How long a standby reads the Lease every retry period, after watching it failed repeatedly,
#: before it tries watching again.
POLL_INSTEAD_S = 60.0


class _LeaseWatch:
    """One watch request on a standby's Lease, read on a thread of its own: each change it
    delivers is noted as a read would be (:meth:`Elector._saw`); a release or a deletion, and
    the end of the watch, wake the standby."""

    def __init__(self, elector: Elector, since: str, wake: threading.Event) -> None:
        self.elector = elector
        #: The newest resourceVersion delivered (an event's or a bookmark's): the next watch's.
        self.last_rv = since
        self.delivered = 0  # changes delivered
        self.opened = time.monotonic()
        self.free = False  # it showed the Lease released (no holder) or deleted
        self.ended = threading.Event()
        self.error: kube.KubeError | None = None
        self._wake = wake
        self._guard = threading.Lock()
        self._stream: kube.WatchStream | None = None
        self._closing = False
        self._since = since
        threading.Thread(target=self._run, name="lease-watch", daemon=True).start()

    def _run(self) -> None:
        s = self.elector.settings
        try:
            stream = self.elector._watch(
                s.path,
                {
                    "fieldSelector": f"metadata.name={s.name}",
                    "resourceVersion": self._since,
                    "allowWatchBookmarks": "true",
                },
                timeout_seconds=s.watch_timeout,
            )
            with self._guard:
                self._stream = stream
                closing = self._closing
            if closing:
                stream.close()
                return
            for event in stream:
                if self._closing:
                    return
                self._on(event)
        except kube.KubeError as e:
            if not self._closing:
                self.error = e
        except Exception as e:  # a standby must never die of a malformed event
            if not self._closing:
                self.error = kube.KubeError(f"the watch of the Lease failed: {e!r}")
        finally:
            self.ended.set()
            self._wake.set()

    def _on(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        lease: dict[str, Any] = event["object"]
        meta = lease.get("metadata") or {}
        version = str(meta.get("resourceVersion") or "")
        if kind == "BOOKMARK":  # nothing changed; the resourceVersion moved on
            self.last_rv = version or self.last_rv
            return
        if meta.get("name") != self.elector.settings.name:
            return
        self.last_rv = version or self.last_rv
        self.delivered += 1
        elector = self.elector
        if kind == "DELETED":
            free = True
        else:
            with elector._lock:
                if elector.leading:
                    return
                spec = elector._saw(lease, time.monotonic())
            free = not spec.get("holderIdentity")
        if free:
            self.free = True
            self._wake.set()

    def close(self) -> None:
        """End the watch (from any thread)."""
        with self._guard:
            self._closing = True
            stream = self._stream
        if stream is not None:
            stream.close()
