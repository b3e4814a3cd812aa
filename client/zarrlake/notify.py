"""Webhooks: post-commit, post-merge and post-tag notifications, delivered at least once.

A client cannot promise delivery (it may die the moment its commit lands), so notifications are
not sent by the committing client: a :class:`Notifier` follows the repository's refs and
delivers what changed since the last event it delivered, in order, recording its progress in a
small state object after each delivery. Killed at any moment, it starts again where it
stopped: an event may then be delivered twice, never lost, and both deliveries carry the same
idempotency key (``Zarrlake-Delivery``), so a receiver applies each once.

Events (``event`` in the JSON body): ``commit`` and ``merge`` (a commit with two parents) for
each commit that lands on a watched branch (its first-parent line), ``tag`` for each new tag,
``branch-created``, ``branch-deleted``, and ``branch-reset`` (the head moved to a commit that
does not descend from the last one delivered). A notifier delivers what happens after its first
run, not the history before.

Each request is a ``POST`` of a JSON body with headers ``Zarrlake-Event``, ``Zarrlake-Delivery``
(the idempotency key: the same for every attempt of one event), ``Zarrlake-Attempt`` and, with
a secret, ``Zarrlake-Signature: sha256=<hex HMAC-SHA256 of the body>``. A 2xx answer is
delivery; anything else (an error status, a refused connection, a timeout) is retried with
jittered exponential back-off up to ``max_backoff_s`` between attempts, the same body each time.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import hmac
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from zarrlake.errors import InvalidArgument, ObjectNotFound, PreconditionFailed, ZarrlakeError
from zarrlake.repository import Repository
from zarrlake.storage.base import Storage
from zarrlake.types import CommitInfo

log = logging.getLogger(__name__)

EVENTS = frozenset({"commit", "merge", "tag", "branch-created", "branch-deleted", "branch-reset"})
#: How far back a notifier looks for the last head it delivered on a branch's first-parent line
#: before it calls the move a reset.
MAX_WALK = 10_000
STATE_PREFIX = "hooks/"


@dataclass(frozen=True)
class Webhook:
    """Where and what to deliver. ``name`` keys the delivery state (default: from the URL), so
    two hooks to one URL need two names. ``branches``: globs of the branches watched."""

    url: str
    secret: bytes | None = field(default=None, repr=False)
    events: frozenset[str] = EVENTS
    branches: tuple[str, ...] = ("*",)
    name: str = ""
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"a webhook URL starts with http:// or https://, not {self.url!r}"
            )
        unknown = set(self.events) - EVENTS
        if unknown or not self.events:
            raise InvalidArgument(
                f"unknown webhook event(s) {', '.join(sorted(unknown)) or '(none given)'} "
                f"(known: {', '.join(sorted(EVENTS))})"
            )
        object.__setattr__(self, "events", frozenset(self.events))
        object.__setattr__(self, "branches", tuple(self.branches))
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode())
        if not self.name:
            digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
            object.__setattr__(self, "name", f"hook-{digest}")
        if not all(c.isalnum() or c in "-_." for c in self.name):
            raise InvalidArgument(
                f"a webhook name is letters, digits, '-', '_', '.': {self.name!r}"
            )

    def watches(self, branch: str) -> bool:
        return any(fnmatch.fnmatchcase(branch, g) for g in self.branches)


@dataclass(frozen=True)
class Event:
    """One notification: ``kind`` (see the module docstring), its JSON ``body`` and ``key``,
    the idempotency key; ``advance`` is what the state records once it is delivered."""

    kind: str
    key: str
    body: dict[str, Any]
    ref: tuple[str, str]  # ("branch" | "tag", name)
    target: str | None  # the snapshot the ref is at after it (None: deleted)

    def payload(self) -> bytes:
        return json.dumps(self.body, sort_keys=True, separators=(",", ":")).encode()


def sign(secret: bytes, body: bytes) -> str:
    """The ``Zarrlake-Signature`` header of ``body``: ``sha256=`` and the hex HMAC-SHA256."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(secret: bytes, body: bytes, header: str) -> bool:
    """Whether ``header`` is the signature of ``body`` under ``secret`` (constant time)."""
    return hmac.compare_digest(sign(secret, body), header)


@dataclass
class DeliveryReport:
    """What one :meth:`Notifier.run_once` did: events delivered, attempts that failed, events
    still waiting (it stopped at ``give_up_after_s``)."""

    delivered: int = 0
    failed_attempts: int = 0
    pending: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "delivered": self.delivered,
            "failed_attempts": self.failed_attempts,
            "pending": self.pending,
            "kinds": dict(sorted(self.kinds.items())),
        }


class Notifier:
    """Delivers ``hook``'s events for ``repo``; see the module docstring. The state is kept in
    ``state`` (default: the repository's own storage, under ``hooks/<name>``), replaced by
    compare-and-set so that two notifiers of one hook never take it backwards."""

    def __init__(
        self,
        repo: Repository,
        hook: Webhook,
        *,
        state: Storage | None = None,
        max_backoff_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.repo = repo
        self.hook = hook
        self.state_storage = state if state is not None else repo.storage
        if not self.state_storage.supports_compare_and_set:
            raise InvalidArgument(
                f"{self.state_storage.url} cannot keep a notifier's progress (no compare-and-set)"
            )
        self.state_key = f"{STATE_PREFIX}{hook.name}"
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep

    # -- state -------------------------------------------------------------------------------------

    def _read_state(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            got = self.state_storage.get_versioned(self.state_key)
        except ObjectNotFound:
            return None, None
        try:
            doc = json.loads(got.data)
        except ValueError:
            raise ZarrlakeError(f"the notifier state {self.state_key} is damaged") from None
        if not isinstance(doc, dict) or doc.get("repository") != self.repo.id:
            raise ZarrlakeError(
                f"the notifier state {self.state_key} is another repository's: give the hook "
                "another name"
            )
        return doc, got.version

    def _write_state(self, doc: dict[str, Any], version: str | None) -> str:
        data = json.dumps(doc, sort_keys=True).encode()
        return self.state_storage.put_if_version(self.state_key, data, version)

    def _now_state(self) -> dict[str, Any]:
        refs = self.repo.refs()
        return {
            "repository": self.repo.id,
            "branches": {n: s for n, s in refs.branches.items() if self.hook.watches(n)},
            "tags": sorted(refs.tags),
        }

    # -- events ------------------------------------------------------------------------------------

    def pending(self) -> tuple[list[Event], dict[str, Any], str | None]:
        """The events not yet delivered, oldest first, with the state they start from (made,
        at the refs as they are now, on the first run: nothing is pending then)."""
        doc, version = self._read_state()
        if doc is None:
            doc = self._now_state()
            try:
                version = self._write_state(doc, None)
            except PreconditionFailed:  # another notifier of this hook started at once
                doc, version = self._read_state()
                assert doc is not None
            return [], doc, version
        return list(self._events(doc)), doc, version

    def _events(self, doc: dict[str, Any]) -> Iterator[Event]:
        refs = self.repo.refs()
        # Only what this hook watches: a glob narrowed since is no deletion, nor widened a birth
        # of branches that are old (those are first seen where they are).
        delivered = {n: s for n, s in doc.get("branches", {}).items() if self.hook.watches(n)}
        watched = {n: s for n, s in refs.branches.items() if self.hook.watches(n)}
        for name in sorted(watched.keys() | delivered.keys()):
            yield from self._branch_events(name, delivered.get(name), watched.get(name))
        known = set(doc.get("tags", []))
        for name, sid in refs.tags.items():
            if name not in known:
                yield self._event("tag", ("tag", name), sid, {"tag": name, "snapshot": sid})

    def _branch_events(self, name: str, last: str | None, head: str | None) -> Iterator[Event]:
        if last == head:
            return
        ref = ("branch", name)
        journal = self.repo.core.journal
        if head is None:
            # Keyed by the deletion's place in the journal: each deletion its own event.
            gone = journal.head(name)
            seq = "" if gone is None else str(gone.seq)
            yield self._event(
                "branch-deleted", ref, None, {"branch": name, "previous": last}, salt=seq
            )
            return
        if last is None:
            # Born since the last look: where it was created, then what landed on it since.
            entries = journal.history(name)
            born = next((e for e in entries if e.previous is None and e.snapshot), None)
            start = head if born is None else born.snapshot
            assert start is not None
            seq = "" if born is None else str(born.seq)
            body = {"branch": name, "snapshot": start}
            yield self._event("branch-created", ref, start, body, salt=seq)
            last = start
            if last == head:
                return
        line = self._first_parent_line(head, last)
        if line is None:
            moved = journal.head(name)
            seq = "" if moved is None else str(moved.seq)
            body = {"branch": name, "snapshot": head, "previous": last}
            yield self._event("branch-reset", ref, head, body, salt=seq)
            return
        for info in line:
            kind = "merge" if len(info.parents) > 1 else "commit"
            yield self._event(kind, ref, info.id, {"branch": name, **_commit_body(info)})

    def _first_parent_line(self, head: str, last: str) -> list[CommitInfo] | None:
        """The commits from just after ``last`` to ``head`` along first parents, oldest first
        (None: ``last`` is not on that line within :data:`MAX_WALK` commits)."""
        infos: dict[str, CommitInfo] = {}
        for info in self.repo.log(head, limit=MAX_WALK):
            infos[info.id] = info
            if info.id == last:
                break
        line: list[CommitInfo] = []
        sid = head
        while sid != last:
            step = infos.get(sid)
            if step is None or not step.parents:
                return None
            line.append(step)
            sid = step.parents[0]
        line.reverse()
        return line

    def _event(
        self,
        kind: str,
        ref: tuple[str, str],
        target: str | None,
        body: dict[str, Any],
        salt: str = "",
    ) -> Event:
        seed = f"{self.repo.id}\0{self.hook.name}\0{kind}\0{ref[0]}\0{ref[1]}\0{target}\0{salt}"
        key = hashlib.sha256(seed.encode()).hexdigest()[:32]
        full = {"event": kind, "id": key, "repository": self.repo.id, **body}
        return Event(kind, key, full, ref, target)

    # -- delivery ----------------------------------------------------------------------------------

    def run_once(self, *, give_up_after_s: float | None = None) -> DeliveryReport:
        """Deliver every pending event, in order, each retried until it is delivered (or until
        ``give_up_after_s`` have passed: the rest stay pending for the next run)."""
        report = DeliveryReport()
        events, doc, version = self.pending()
        deadline = None if give_up_after_s is None else time.monotonic() + give_up_after_s
        for i, event in enumerate(events):
            if event.kind in self.hook.events:
                if not self._deliver(event, report, deadline):
                    report.pending = len(events) - i
                    return report
                report.delivered += 1
                report.kinds[event.kind] = report.kinds.get(event.kind, 0) + 1
            doc = _advanced(doc, event)
            try:
                version = self._write_state(doc, version)
            except PreconditionFailed:
                # Another notifier of this hook moved the state: start again from its.
                log.info("webhook %s: another notifier delivered meanwhile", self.hook.name)
                return report
        return report

    def _deliver(self, event: Event, report: DeliveryReport, deadline: float | None) -> bool:
        body = event.payload()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "zarrlake-webhook",
            "Zarrlake-Event": event.kind,
            "Zarrlake-Delivery": event.key,
        }
        if self.hook.secret is not None:
            headers["Zarrlake-Signature"] = sign(self.hook.secret, body)
        attempt = 0
        while True:
            attempt += 1
            headers["Zarrlake-Attempt"] = str(attempt)
            request = urllib.request.Request(self.hook.url, body, headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.hook.timeout_s) as answer:
                    if 200 <= answer.status < 300:
                        return True
                    reason = f"HTTP {answer.status}"
            except urllib.error.HTTPError as e:
                reason = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                reason = str(getattr(e, "reason", e))
            report.failed_attempts += 1
            wait = random.uniform(0, min(self.max_backoff_s, 0.25 * 2 ** min(attempt, 16)))
            if deadline is not None and time.monotonic() + wait > deadline:
                log.warning("webhook %s: %s not delivered (%s)", self.hook.name, event.key, reason)
                return False
            log.info("webhook %s: attempt %d failed (%s)", self.hook.name, attempt, reason)
            self._sleep(wait)

    def run(self, *, interval_s: float = 5.0, stop: threading.Event | None = None) -> None:
        """Deliver, then look again every ``interval_s``, until ``stop`` is set."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                self.run_once(give_up_after_s=max(interval_s * 10, 60.0))
            except ZarrlakeError as e:  # storage away: try again at the next look
                log.warning("webhook %s: %s", self.hook.name, e)
            stop.wait(interval_s)


def _commit_body(info: CommitInfo) -> dict[str, Any]:
    return {
        "snapshot": info.id,
        "parents": list(info.parents),
        "message": info.message,
        "author": info.author,
        "time": info.time.astimezone(dt.UTC).isoformat(),
        "metadata": info.metadata,
    }


def _advanced(doc: dict[str, Any], event: Event) -> dict[str, Any]:
    """The state once ``event`` is delivered (or skipped: a kind the hook does not want)."""
    kind, name = event.ref
    out = dict(doc)
    if kind == "tag":
        out["tags"] = sorted({*doc.get("tags", []), name})
        return out
    branches = dict(doc.get("branches", {}))
    if event.target is None:
        branches.pop(name, None)
    else:
        branches[name] = event.target
    out["branches"] = branches
    return out


def events_of(kinds: Iterable[str]) -> frozenset[str]:
    """``--event`` values as a set (``all`` for every kind)."""
    chosen = set(kinds)
    return EVENTS if not chosen or "all" in chosen else frozenset(chosen)
