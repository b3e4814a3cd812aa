"""What every route of the server shares: the repository, the token, the limits, a bounded pool
for blocking repository work, and the resolution of refs to snapshots.

The event loop must never wait on storage: a route hands blocking repository calls (resolving a
branch, walking history, a diff) to :meth:`ServeContext.run`, whose pool is bounded so that a
burst of requests queues instead of starting a thread each. Chunk reads need no such hand-off:
:attr:`zarrlake.Session.store` is a Zarr store whose reads are async already. The JSON API and
the pages, whose work may take seconds (a diff, a long history), go through
:meth:`ServeContext.run_page`, which takes at most :attr:`Limits.page_workers` of the pool: a
burst of them leaves threads for the Zarr routes' short steps and for ``/readyz``, whose
failing would take the server out of its Service.

A branch is resolved again at every request (it moves); a tag or snapshot id names one snapshot
forever — tag names are never reused, even after deletion — so those resolutions are cached.
Read-only sessions are cached by snapshot id, so that a snapshot's manifest shards, once read,
serve every later request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from zarrlake.errors import RefNotFound
from zarrlake.repository import Repository
from zarrlake.serve.model import Walks
from zarrlake.session import Session

__all__ = ["IMMUTABLE", "PRIVATE_IMMUTABLE", "Limits", "ServeContext"]

T = TypeVar("T")

#: ``Cache-Control`` of an answer that never changes (a tag's or a snapshot's): kept a year by
#: anyone; behind a token, by the client alone, as a shared cache would hand a ``public``
#: answer to whoever asks it, token or not.
IMMUTABLE = "public, max-age=31536000, immutable"
PRIVATE_IMMUTABLE = "private, max-age=31536000, immutable"


@dataclass(frozen=True)
class Limits:
    """How much one server does at once and answers at most.

    ``workers``: threads for blocking repository work (resolving branches, history, diffs);
    ``page_workers``: of those, how many the JSON API and the pages take at most (previews
    apart: ``preview_slots``);
    ``sessions``: read-only sessions kept (one per snapshot asked for recently);
    ``max_response_bytes``: the largest body the Zarr routes send (a larger key is a 413: a
    chunk that large is a mistake to fetch whole over HTTP; its ranges are still served);
    ``max_log_limit``: commits per log page at most; ``max_key_length``: the longest Zarr key
    or node path accepted; ``immutable_ttl_s``: how long a tag's resolution is trusted (a
    deleted tag stops resolving after at most this long); ``preview_slots``,
    ``max_preview_pixels``, ``max_preview_source_elements``: the web pages' previews (concurrent
    renders, pixels of an image, elements read for one).
    """

    workers: int = 16
    page_workers: int = 8
    sessions: int = 64
    max_response_bytes: int = 256 * 1024 * 1024
    max_log_limit: int = 500
    max_key_length: int = 1024
    immutable_ttl_s: float = 60.0
    preview_slots: int = 2
    max_preview_pixels: int = 1024 * 1024
    max_preview_source_elements: int = 64 * 1024 * 1024


class ServeContext:
    """The state one server's routes share (see the module docs). Thread-safe."""

    def __init__(
        self, repo: Repository, *, token: str | None = None, limits: Limits | None = None
    ) -> None:
        self.repo = repo
        self.token = token or None
        self.limits = limits or Limits()
        #: ``Cache-Control`` of this server's answers that never change.
        self.immutable = PRIVATE_IMMUTABLE if self.token else IMMUTABLE
        self.preview_slots = asyncio.Semaphore(self.limits.preview_slots)
        self._page_slots = asyncio.Semaphore(self.limits.page_workers)
        self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="zarrlake-serve")
        self._mutex = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        # ref -> (snapshot id, when resolved): tags and snapshot ids only.
        self._immutable: OrderedDict[str, tuple[str, float]] = OrderedDict()
        #: Log walks that the next page of a log goes on with (:class:`~.model.Walks`).
        self.walks = Walks(max(1, self.limits.sessions // 2))

    async def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` on the bounded worker pool, awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, partial(fn, *args, **kw))

    async def run_page(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """:meth:`run` for the JSON API and the pages: at most :attr:`Limits.page_workers` at
        once (see the module docs)."""
        async with self._page_slots:
            return await self.run(fn, *args, **kw)

    def close(self) -> None:
        """Stop the worker pool (the server's shutdown)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def resolve(self, ref: str) -> tuple[str, bool]:
        """(snapshot id, immutable) of a branch, tag or snapshot id (a short id too).

        ``immutable`` is False for a branch, resolved afresh at each call; True for a tag or a
        snapshot id, whose snapshot never changes. Blocking (it may read the ref). Raises
        :class:`~zarrlake.RefNotFound`, :class:`~zarrlake.AmbiguousRef` (a short id several
        snapshots start with), :class:`~zarrlake.InvalidName`.
        """
        if not isinstance(ref, str) or not ref:
            raise RefNotFound(str(ref))
        cached = self.cached_resolution(ref)
        if cached is not None:
            return cached, True
        sid, is_branch = self.repo.core.graph.locate(ref)
        if not is_branch:
            with self._mutex:
                self._immutable[ref] = (sid, time.monotonic())
                while len(self._immutable) > 4 * self.limits.sessions:
                    self._immutable.popitem(last=False)
        return sid, not is_branch

    def cached_resolution(self, ref: str) -> str | None:
        """The snapshot of tag or snapshot id ``ref`` if it was resolved recently, else None: the
        Zarr routes ask this on the event loop before handing a resolution to the pool."""
        with self._mutex:
            hit = self._immutable.get(ref)
            if hit is None:
                return None
            sid, when = hit
            # A snapshot id is its own proof; a tag's resolution is trusted for a while.
            if sid != ref and time.monotonic() - when > self.limits.immutable_ttl_s:
                del self._immutable[ref]
                return None
            self._immutable.move_to_end(ref)
            return sid

    def session(self, snapshot_id: str) -> Session:
        """The read-only session of ``snapshot_id`` (a whole id, as :meth:`resolve` returns),
        shared by every request for it. Blocking on first use of a snapshot (it reads it).
        Raises :class:`~zarrlake.RefNotFound`."""
        with self._mutex:
            found = self._sessions.get(snapshot_id)
            if found is not None:
                self._sessions.move_to_end(snapshot_id)
                return found
        session = self.repo.readonly_session(snapshot_id)
        with self._mutex:
            found = self._sessions.setdefault(snapshot_id, session)
            self._sessions.move_to_end(snapshot_id)
            while len(self._sessions) > self.limits.sessions:
                self._sessions.popitem(last=False)
        return found

    def cached_session(self, snapshot_id: str) -> Session | None:
        """The session of ``snapshot_id`` if one is cached (no I/O), else None."""
        with self._mutex:
            return self._sessions.get(snapshot_id)
