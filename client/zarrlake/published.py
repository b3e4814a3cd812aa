"""The published root of one repository (or one mirror): read it, publish to it.

The journals and tag records decide; this object only publishes what they decided (see
:mod:`zarrlake.format.root`). Every update is a pure function of the current root (a head that
only moves forward, a tag added or removed), applied by compare-and-set: a writer that loses
the swap rereads the root and applies its update again, which then finds its change already
there or applies it on top of the other's. A swap whose response was lost is the same case: the
reread finds the change in, and the update says there is nothing more to do.

A client never goes back: of the roots it has read or written, it keeps the newest
(``generation``), so no reader of one client is shown a head older than one it was shown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from typing import Any

from zarrlake.errors import (
    CorruptObject,
    ObjectNotFound,
    PreconditionFailed,
    RepositoryNotFound,
    RootUnpublished,
    StorageError,
    UnsupportedFormat,
)
from zarrlake.format.model import MIRROR_REPO_KEY, REPO_KEY, RepoRecord
from zarrlake.format.root import MIRROR_ROOT_KEY, ROOT_KEY, RootRecord
from zarrlake.storage.base import Storage, Versioned

log = logging.getLogger(__name__)

#: Swaps lost in a row before a publisher gives up (each loser backs off a little, at random).
MAX_SWAPS = 64

#: Every root object of this process, for :func:`_after_fork`.
_FORKED: weakref.WeakSet[PublishedRoot] = weakref.WeakSet()


def _after_fork() -> None:
    for root in list(_FORKED):
        root._at_fork()


os.register_at_fork(after_in_child=_after_fork)

#: How long a publish waits for this client's reads started ahead of it (see :meth:`read_ahead`).
AHEAD_WAIT_S = 60.0
#: How long a publish waits for a read of the root started for it (see :meth:`refresh_ahead`).
REFRESH_WAIT_S = 5.0

Update = Callable[[RootRecord], RootRecord | None]


class PublishedRoot:
    """``root`` (or ``mirror/root``) at ``storage``, of the repository whose marker is
    ``record``. ``rebuild``: the root as the journals and tag records say it is now (set by
    whoever holds them: :class:`zarrlake.core.RepositoryCore`), what a publish starts from
    where there is no root (a repository being created) or only a corrupt one."""

    def __init__(
        self,
        storage: Storage,
        record: RepoRecord,
        key: str = ROOT_KEY,
        rebuild: Callable[[], RootRecord] | None = None,
    ) -> None:
        self.storage = storage
        self.record = record
        self.key = key
        self.rebuild = rebuild
        self._guard = threading.Lock()
        self._pins = threading.local()
        # Whether the last :meth:`_fresh` found a root that parses (else a publish writes one).
        self._usable = True
        # The newest root this client has read or written, and its version (None: none yet).
        self._seen: tuple[RootRecord, str] | None = None
        # Reads started ahead (:meth:`read_ahead`) and not finished yet (this process's).
        self._ahead: set[Future[RootRecord | None]] = set()
        # A read for this client's next publish (:meth:`refresh_ahead`), and in which process.
        self._refreshing: tuple[int, threading.Event] | None = None
        _FORKED.add(self)

    def __getstate__(self) -> dict[str, object]:
        # Not the rebuild: it holds the journals that hold this object. A copy without it
        # refuses to publish where there is no root, rather than publish one without them.
        return {"storage": self.storage, "record": self.record, "key": self.key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state["record"], state["key"])  # type: ignore[misc]

    # -- reading ----------------------------------------------------------------------------------

    def adopt(self, found: Versioned) -> RootRecord:
        """Take ``found`` (this root's bytes and version, read by someone else: the open). Not
        an answer to later reads: each reads the root as it is then (a ref another client
        moves just after this one opened is seen), so it only saves a publisher's first read."""
        return self._keep(RootRecord.decode(found.data, self.key), found.version)

    def _keep(self, record: RootRecord, version: str) -> RootRecord:
        with self._guard:
            if self._seen is None or record.generation >= self._seen[0].generation:
                self._seen = (record, version)
            return self._seen[0]

    def cached(self) -> RootRecord | None:
        """The newest root this client has seen, without a request (None: none yet)."""
        seen = self._seen
        return None if seen is None else seen[0]

    def read_ahead(self) -> Callable[[], RootRecord | None]:
        """Start a :meth:`read` now, to overlap what the caller does next; returns the function
        that gives its answer (or raises its error). Until it is answered, this client's own
        publishes wait for it: a read started before a change of this client's never shows it
        (a read-only session taken before this client commits does not see that commit)."""
        future = self.storage.submit(self.read)
        pid = os.getpid()
        with self._guard:
            self._ahead.add(future)
        # Outside the guard: a future already done runs its callback here, at once.
        future.add_done_callback(self._landed)

        def answer() -> RootRecord | None:
            if os.getpid() != pid:
                # A process forked while the read was out: the thread that ran it is not here.
                return self.read()
            return future.result()

        return answer

    def refresh_ahead(self) -> None:
        """Read the root again now, on a thread of its own, for this client's next publish
        (which waits for it, at most :data:`REFRESH_WAIT_S`): for a caller that knows the root
        it has seen is stale (the journal is ahead of it), so that the swap does not first lose
        to a version this client never saw and read the root only then. Not a read a publish
        must wait for to keep its promises (as :meth:`read_ahead`'s are): a failed or slow one
        only costs the swap that loses. Not on the storage's I/O pool, where it could queue
        behind uploads while its caller holds a branch lock."""
        pid = os.getpid()
        with self._guard:
            out = self._refreshing
            if out is not None and out[0] == pid and not out[1].is_set():
                return  # one is out already
            done = threading.Event()
            self._refreshing = (pid, done)

        def run() -> None:
            try:
                self.read()
            except Exception as e:  # the swap reads again if it loses: nothing depends on it
                log.debug("%s: reading ahead of a publish failed: %s", self.key, e)
            finally:
                done.set()

        threading.Thread(target=run, name="zarrlake-root-refresh", daemon=True).start()

    def _landed(self, future: Future[RootRecord | None]) -> None:
        with self._guard:
            self._ahead.discard(future)

    def _at_fork(self) -> None:
        """In a forked child: the parent's reads ahead are not this process's to wait for."""
        self._guard = threading.Lock()
        self._ahead = set()
        self._refreshing = None

    @contextlib.contextmanager
    def pinned(self) -> Iterator[RootRecord | None]:
        """Within it, on this thread, every :meth:`read` answers with the one root read as it
        begins: one operation (``log()``: its ref, then the expired snapshots), one read and one
        view of the refs."""
        root = self.read()
        previous = getattr(self._pins, "root", None)
        self._pins.root = root
        try:
            yield root
        finally:
            self._pins.root = previous

    def read(self) -> RootRecord | None:
        """The root as it is now (one read), or as this client last saw it if that is newer;
        None if there is none, or none that parses (a repository whose root was lost or
        damaged: its readers read the journals, as without a root, and its next publish writes
        it again from them). Inside :meth:`pinned`, the root it read."""
        pinned: RootRecord | None = getattr(self._pins, "root", None)
        if pinned is not None:
            return pinned
        try:
            found = self._get()
        except ObjectNotFound:
            return self.cached()
        try:
            return self.adopt(found)
        except (CorruptObject, UnsupportedFormat) as e:
            log.warning("%s cannot be read (%s): reading the journals instead", self.key, e)
            return self.cached()

    def _get(self) -> Versioned:
        if self.storage.supports_compare_and_set:
            return self.storage.get_versioned(self.key)
        # A read-only copy (plain HTTP) has no versions to swap with, but its root reads.
        return Versioned(self.storage.get(self.key), "")

    # -- publishing -------------------------------------------------------------------------------

    def publish(self, update: Update) -> RootRecord:
        """Apply ``update`` to the root by compare-and-set until it holds (see the module
        docstring); the root as published. The first try starts from the newest root this
        client has seen (one request: the swap), a lost one from a fresh read.

        Raises :class:`RootUnpublished` if the storage keeps failing (the change itself is
        decided and safe: whoever publishes next carries it) or the swaps keep losing."""
        with self._guard:
            ahead = list(self._ahead)
        # Their answers, not their errors, matter here. (Bounded: one waiting in an I/O pool
        # thread could otherwise wait for a read queued behind it.)
        if ahead and futures.wait(ahead, timeout=AHEAD_WAIT_S).not_done:
            log.warning("%s: publishing before a read started ahead of it came back", self.key)
        refreshing = self._refreshing
        if refreshing is not None and refreshing[0] == os.getpid():
            refreshing[1].wait(REFRESH_WAIT_S)
        seen = self._seen
        for attempt in range(MAX_SWAPS):
            if seen is None:
                try:
                    current, version = self._fresh()
                except StorageError as e:
                    raise RootUnpublished(f"{self.key} could not be read: {e}") from e
            else:
                current, version = seen
            new = update(current)
            if new is None and seen is None and not self._usable:
                new = current  # nothing to add, but no root stored, or none that parses: write
            if new is None:
                if version is not None:
                    self._keep(current, version)
                return current
            try:
                written = self.storage.put_if_version(self.key, new.encode(), version)
            except PreconditionFailed:
                seen = None  # another publisher swapped first (or our lost swap landed)
                time.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(attempt, 6))))
                continue
            except StorageError as e:
                raise RootUnpublished(f"{self.key} could not be written: {e}") from e
            return self._keep(new, written)
        raise RootUnpublished(f"{self.key}: {MAX_SWAPS} swaps in a row lost to other publishers")

    def _fresh(self) -> tuple[RootRecord, str | None]:
        """The root as stored now and its version; where there is none, or none that parses,
        the journals' root (:attr:`rebuild`) and the version to swap it in with."""
        version: str | None = None
        self._usable = False
        try:
            got = self.storage.get_versioned(self.key)
            version = got.version
            record = RootRecord.decode(got.data, self.key)
            self._usable = True
            return record, version
        except ObjectNotFound:
            # Gone with the repository's marker: the repository was deleted (a reclaim removes
            # the root, then the marker, then the rest). A root written now from the journals
            # would be left behind in the emptied location, naming a repository that is not.
            marker = MIRROR_REPO_KEY if self.key == MIRROR_ROOT_KEY else REPO_KEY
            if not self.storage.exists(marker):
                raise RepositoryNotFound(
                    f"{self.storage.url}: the repository was deleted (no {marker!r}); "
                    f"{self.key} is not published into it"
                ) from None
        except (CorruptObject, UnsupportedFormat) as e:
            if isinstance(e, UnsupportedFormat) and not isinstance(e, CorruptObject):
                raise  # a newer zarrlake's root: not ours to overwrite
            log.warning("%s is damaged (%s): publishing it anew from the journals", self.key, e)
        if self.rebuild is None:
            raise RootUnpublished(
                f"{self.key} is missing or damaged, and this copy of the repository cannot "
                "rebuild it: open the repository again, or run `zarrlake fsck --repair`"
            )
        return self.rebuild(), version


def read_root(storage: Storage, key: str = ROOT_KEY) -> Versioned | None:
    """The stored root at ``key`` and its version, or None if there is none (one read). On a
    storage without compare-and-set (plain HTTP) the version is empty: it reads, never swaps."""
    try:
        if storage.supports_compare_and_set:
            return storage.get_versioned(key)
        return Versioned(storage.get(key), "")
    except ObjectNotFound:
        return None
