"""The client of a commit service (``zarrlake service``, :mod:`zarrlake.service`).

In a repository run with a commit service, writers hold credentials that write only immutable
objects (chunks, packs, manifests, snapshots, txlogs, history pages); the service alone writes
``refs/`` and ``root``, after checking the repository's rules. A :class:`ServiceClient` is the
:class:`~zarrlake.refs.RefPublisher` a writer's journal and tags send their changes to: a commit
is prepared exactly as without a service (its objects written first), and its journal entry is
handed to the service instead of written. Merges of a branch that takes merges only run in the
service (:meth:`merge`), which reads both sides itself.

The wire: JSON over HTTP with ``Authorization: Bearer <token>``. A refusal comes back as the
error the service raised (:class:`BranchProtected`, :class:`CheckFailed`, :class:`TagExists`,
:class:`RefNotFound`, :class:`MergeConflictError`, ...). A request that gets no answer is
retried: appends are idempotent (the service recognises an entry of the same writer id), and a
merge or tag repeated after a lost answer finds its own result.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import time
import urllib.error
import urllib.request
from typing import Any

from zarrlake.errors import (
    BranchExists,
    BranchProtected,
    CheckFailed,
    Conflict,
    ConflictError,
    InvalidArgument,
    MergeConflictError,
    ReadOnlyError,
    RefNotFound,
    TagExists,
    ZarrlakeError,
)
from zarrlake.format.model import JournalEntry

log = logging.getLogger(__name__)

#: Answers worth another try: the service or a proxy in front of it is starting or overloaded.
RETRY_STATUS = frozenset({502, 503, 504})
ATTEMPTS = 4


def _client_name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"zarrlake/{version('zarrlake')}"
    except PackageNotFoundError:  # a source checkout
        return "zarrlake"


CLIENT = _client_name()


class ServiceUnavailable(ZarrlakeError):
    """The commit service did not answer (after retries). Nothing it did not confirm is taken
    as done; a commit whose entry it may have written is found by the next commit's read."""


class ServiceClient:
    """Sends ref changes to the commit service at ``url`` with ``token``."""

    #: How long one request may wait for the service's answer: longer than a check run as a
    #: Job may take by default (600 s, and the 30 s the service waits past it), so that a
    #: writer does not give up on a commit that is still being checked. (A request sent
    #: again while its check runs waits for the same check: the service runs it once.)
    TIMEOUT_S = 660.0

    def __init__(self, url: str, token: str | None, *, timeout_s: float = TIMEOUT_S) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"a commit service URL starts with http(s)://, not {url!r}")
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"ServiceClient({self.url!r})"  # never the token

    # -- the RefPublisher protocol -----------------------------------------------------------------

    def append(self, name: str, entry: JournalEntry) -> bool:
        body = {"branch": name, "entry": base64.b64encode(entry.encode()).decode()}
        answer = self._call("POST", "/v1/append", body)
        return bool(answer["published"])

    def create_tag(self, name: str, snapshot_id: str) -> None:
        # A TagExists answer to a retry (the first try's answer lost) may be this very tag.
        self._call("POST", "/v1/tags", {"name": name, "snapshot": snapshot_id}, mine=TagExists)

    def delete_tag(self, name: str) -> None:
        self._call("POST", "/v1/tags/delete", {"name": name})

    # -- more --------------------------------------------------------------------------------------

    def merge(
        self,
        source: str,
        into: str,
        *,
        message: str | None,
        author: str | None,
        strategy: str | None,
    ) -> str:
        body = {
            "source": source,
            "into": into,
            "message": message,
            "author": author,
            "strategy": strategy,
        }
        return str(self._call("POST", "/v1/merge", body)["snapshot"])

    def whoami(self) -> dict[str, Any]:
        """The identity and role the service knows this client's token by."""
        return self._call("GET", "/v1/whoami", None)

    # -- the wire ----------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        mine: type[ZarrlakeError] | None = None,
    ) -> dict[str, Any]:
        """The service's answer; ``mine``: an error that, answering a retry, says the first
        try (whose answer was lost) did the work."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "User-Agent": CLIENT}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        last = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(random.uniform(0, 0.2 * 2**attempt))
            request = urllib.request.Request(self.url + path, data, headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    got: dict[str, Any] = json.loads(answer.read())
                    return got
            except urllib.error.HTTPError as e:
                if e.code in RETRY_STATUS:
                    last = f"HTTP {e.code}"
                    continue
                error = _error_from(e)
                if attempt and mine is not None and isinstance(error, mine):
                    return {}
                raise error from None
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                last = str(getattr(e, "reason", e))
                continue
        raise ServiceUnavailable(f"the commit service at {self.url} did not answer: {last}")


def _error_from(e: urllib.error.HTTPError) -> ZarrlakeError:
    """The error the service raised, from its answer (one of ours by name, else a plain one)."""
    try:
        doc = json.loads(e.read())
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    kind, message = doc.get("error"), str(doc.get("message") or f"HTTP {e.code}")
    if kind == "BranchProtected":
        return BranchProtected(str(doc.get("branch")), str(doc.get("rule")), message)
    if kind == "CheckFailed":
        problems = [str(p) for p in doc.get("problems") or []]
        return CheckFailed(str(doc.get("check")), str(doc.get("branch")), problems)
    if kind in ("MergeConflictError", "ConflictError"):
        conflicts = [
            Conflict(c.get("kind", "conflict"), c.get("path", ""), c.get("chunk"))
            for c in doc.get("conflicts") or []
            if isinstance(c, dict)
        ]
        cls = MergeConflictError if kind == "MergeConflictError" else ConflictError
        return cls(conflicts, message)
    if kind == "RefNotFound":
        return RefNotFound(str(doc.get("ref")), str(doc.get("kind") or "ref"))
    simple: dict[str, type[ZarrlakeError]] = {
        "TagExists": TagExists,
        "BranchExists": BranchExists,
        "InvalidArgument": InvalidArgument,
        "InvalidName": InvalidArgument,
        "ReadOnlyError": ReadOnlyError,
    }
    if e.code in (401, 403) and kind not in simple:
        return ReadOnlyError(f"the commit service refused: {message}")
    return simple.get(str(kind), ZarrlakeError)(message)
