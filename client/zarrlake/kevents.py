"""Kubernetes Events about one object, posted by a process that is not the operator.

The commit service posts one for each change it refuses, about its ``Repository``: ``kubectl
describe repository`` and ``kubectl get events`` then show who was refused what, and why,
beside the operator's own Events. Posting never decides anything and never waits: events go
to a bounded queue that one thread drains, and a full queue, an API that is down or a right
the pod lacks loses Events (each counted and logged once per kind of failure), never a verdict.

A refusal repeated within :data:`REPEAT_WINDOW_S` (a writer that retries) adds to the first
Event's ``count`` instead of making another, as Kubernetes' own recorders do.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from zarrlake.errors import InvalidArgument, KubernetesError
from zarrlake.k8s import api_client, api_error_reason

log = logging.getLogger(__name__)

ENV_ABOUT = "ZARRLAKE_EVENTS_FOR"
REPEAT_WINDOW_S = 600.0
MAX_PENDING = 256
MESSAGE_MAX = 1000  # the API takes up to 1 kB
MAX_REMEMBERED = 1000


@dataclass(frozen=True)
class About:
    """The object Events are about (an Event's ``involvedObject``)."""

    kind: str
    name: str
    namespace: str
    api_version: str = ""
    uid: str = ""

    @classmethod
    def parse(cls, text: str) -> About:
        """From JSON ``{"kind", "name", "namespace"[, "apiVersion", "uid"]}``, as the operator
        puts it in ``$ZARRLAKE_EVENTS_FOR``."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("an object with kind, name and namespace")
        got: dict[str, str] = {}
        for key in ("kind", "name", "namespace", "apiVersion", "uid"):
            value = doc.get(key, "")
            if not isinstance(value, str):
                raise InvalidArgument(f"{key} must be a string")
            got[key] = value
        for key in ("kind", "name", "namespace"):
            if not got[key]:
                raise InvalidArgument(f"{key} is missing")
        unknown = set(doc) - set(got)
        if unknown:
            raise InvalidArgument(f"unknown keys {sorted(unknown)}")
        return cls(got["kind"], got["name"], got["namespace"], got["apiVersion"], got["uid"])

    def involved(self) -> dict[str, str]:
        out = {"kind": self.kind, "name": self.name, "namespace": self.namespace}
        if self.api_version:
            out["apiVersion"] = self.api_version
        if self.uid:
            out["uid"] = self.uid
        return out


@dataclass
class _Posted:
    name: str
    count: int
    first: float


def _stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Posts core/v1 Events about ``about`` as ``component`` (see the module docstring)."""

    def __init__(
        self,
        about: About,
        *,
        component: str,
        api: Any = None,
        max_pending: int = MAX_PENDING,
        repeat_window: float = REPEAT_WINDOW_S,
    ) -> None:
        self.about = about
        self.component = component
        self.instance = os.environ.get("HOSTNAME") or socket.gethostname()
        self.dropped = 0
        self.failed = 0
        self._api = api
        self._window = repeat_window
        self._queue: queue.Queue[tuple[str, str, str, float] | None] = queue.Queue(max_pending)
        self._posted: dict[tuple[str, str, str], _Posted] = {}
        self._said: set[str] = set()
        self._thread = threading.Thread(target=self._drain, name="zarrlake-events", daemon=True)
        self._thread.start()

    def post(self, reason: str, message: str, *, warning: bool = True) -> None:
        """Queue an Event; returns at once."""
        kind = "Warning" if warning else "Normal"
        try:
            self._queue.put_nowait((reason, message[:MESSAGE_MAX], kind, time.time()))
        except queue.Full:
            self.dropped += 1
            self._say_once("full", "Events dropped: more pending than %d", self._queue.maxsize)

    def close(self, timeout: float = 5.0) -> None:
        """Post what is queued (waiting up to ``timeout`` s), then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _say_once(self, what: str, fmt: str, *args: Any) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning(fmt, *args)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._send(*item)
            except KubernetesError as e:
                self.failed += 1
                self._say_once(
                    type(e).__name__,
                    "cannot post Events about %s %s/%s: %s",
                    self.about.kind,
                    self.about.namespace,
                    self.about.name,
                    e,
                )
            except Exception as e:  # never let one Event stop the ones after it
                self.failed += 1
                self._say_once(type(e).__name__, "cannot post an Event: %s", api_error_reason(e))

    def _core(self) -> Any:
        from kubernetes import client

        if self._api is None:
            self._api = api_client()
        return client.CoreV1Api(self._api)

    def _send(self, reason: str, message: str, kind: str, when: float) -> None:
        from kubernetes.client.exceptions import ApiException

        core = self._core()
        ns = self.about.namespace
        key = (reason, message, kind)
        seen = self._posted.get(key)
        if seen is not None and when - seen.first < self._window:
            patch = {"count": seen.count + 1, "lastTimestamp": _stamp(when)}
            try:
                core.patch_namespaced_event(seen.name, ns, patch, _preload_content=False)
                seen.count += 1
                return
            except ApiException as e:
                if e.status != 404:  # gone (Events expire): post it again
                    raise KubernetesError(api_error_reason(e)) from None
        name = f"{self.about.name}.{secrets.token_hex(8)}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": ns},
            "involvedObject": self.about.involved(),
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": _stamp(when),
            "lastTimestamp": _stamp(when),
            "count": 1,
        }
        try:
            core.create_namespaced_event(ns, body, _preload_content=False)
        except ApiException as e:
            raise KubernetesError(api_error_reason(e)) from None
        self._posted[key] = _Posted(name, 1, when)
        # Forget what can no longer be repeated into, so a service that runs for months
        # keeps only recent refusals (and at most MAX_REMEMBERED of them).
        for old in [k for k, p in self._posted.items() if when - p.first >= self._window]:
            del self._posted[old]
        while len(self._posted) > MAX_REMEMBERED:
            del self._posted[next(iter(self._posted))]
