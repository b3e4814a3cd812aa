"""A lease at the destination, so that one promoter of a mirror acts at a time without any lock
service: only the object store, whose create-only writes already decide every promotion.

The lease is a chain of terms, ``mirror/lease/<seq>`` (:class:`LeaseRecord`), each written
create-only: of two promoters writing the same term, exactly one succeeds. The holder renews by
writing the next term before its own expires; anyone may write the next term once the newest has
expired (by its own clock, plus :attr:`DestinationLease.SKEW` for clocks that disagree). Older
terms are deleted as the chain grows. A holder that finds its renewal taken (it was paused past
its term) has lost the lease and stops acting; safety never rests on the lease, since a promotion
is a create-only journal write that never moves a ref back.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator

from zarrlake.errors import LockTimeout
from zarrlake.format.model import MIRROR_PREFIX, LeaseRecord, lease_key
from zarrlake.refs import new_writer_id
from zarrlake.storage.base import ObjectNotFound, PreconditionFailed, Storage, StorageError

log = logging.getLogger("zarrlake.mirror")

LEASE_PREFIX = MIRROR_PREFIX + "lease/"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class DestinationLease:
    """The lease of a mirror's promoter at ``storage`` (the mirror's destination).

    ``ttl``: how long a term lasts (renewed every third of it); ``wait_s``: how long
    :meth:`hold` waits for the lease before :class:`LockTimeout`. The lock-service interface
    (``hold(repo_id, name)``) so that :meth:`Mirror.run` takes either; there is one lease per
    destination, whatever the name."""

    #: How far two promoters' clocks may disagree: an expired term is taken over only this late.
    SKEW = dt.timedelta(seconds=2)

    def __init__(self, storage: Storage, *, ttl: float = 30.0, wait_s: float = 120.0) -> None:
        if ttl <= 0 or wait_s < 0:
            raise ValueError("ttl must be positive and wait_s non-negative")
        self.storage = storage
        self.ttl = float(ttl)
        self.wait_s = float(wait_s)
        self.holder = new_writer_id()
        #: Set when a renewal found the next term written by someone else.
        self.lost = threading.Event()

    def __repr__(self) -> str:
        return f"DestinationLease({self.storage.url!r}, ttl={self.ttl:g})"

    # -- the chain of terms ------------------------------------------------------------------------

    def newest(self) -> LeaseRecord | None:
        """The newest term (None: nobody ever held the lease)."""
        while True:
            keys = sorted(self.storage.list_keys(LEASE_PREFIX))
            if not keys:
                return None
            try:
                return LeaseRecord.decode(self.storage.get(keys[-1]), keys[-1])
            except ObjectNotFound:
                # Deleted as we listed: a newer term exists. Never fall back to an older one,
                # whose successor may be gone too: writing that again would fork the chain.
                continue

    def _write(self, seq: int, holder: str, expires: dt.datetime) -> bool:
        """Write term ``seq``; False if someone else wrote it first."""
        try:
            self.storage.put(
                lease_key(seq), LeaseRecord(seq, holder, expires).encode(), create_only=True
            )
        except PreconditionFailed:
            return False
        with contextlib.suppress(StorageError):  # older terms: only clutter
            older = [k for k in self.storage.list_keys(LEASE_PREFIX) if k < lease_key(seq)]
            self.storage.delete_many(older)
        return True

    def _try_acquire(self) -> tuple[LeaseRecord | None, float]:
        """One attempt: the term we now hold, or None and how long to wait before trying again."""
        newest = self.newest()
        now = _now()
        if newest is not None and newest.holder not in ("", self.holder):
            left = (newest.expires + self.SKEW - now).total_seconds()
            if left > 0:
                return None, left
        seq = 0 if newest is None else newest.seq + 1
        term = LeaseRecord(seq, self.holder, now + dt.timedelta(seconds=self.ttl))
        if self._write(term.seq, term.holder, term.expires):
            return term, 0.0
        return None, 0.0  # another promoter wrote that term: look again

    # -- holding -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, repo_id: str = "", name: str = "") -> Iterator[int]:
        """Hold the lease for the block, renewing it in the background; yields the term's
        number. Raises :class:`LockTimeout` if another promoter keeps it for ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        while True:
            term, wait = self._try_acquire()
            if term is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockTimeout(
                    f"another promoter holds the mirror lease at {self.storage.url} "
                    f"(waited {self.wait_s:g}s)"
                )
            time.sleep(max(0.01, min(wait, remaining, 1.0)))
        self.lost.clear()
        stop = threading.Event()
        current = [term]
        renewer = threading.Thread(
            target=self._renew, args=(current, stop), name="zarrlake-mirror-lease", daemon=True
        )
        renewer.start()
        try:
            yield term.seq
        finally:
            stop.set()
            renewer.join(timeout=10)
            if not self.lost.is_set():  # hand it over at once: a term that has already expired
                with contextlib.suppress(StorageError):
                    self._write(current[0].seq + 1, "", _now())

    def _renew(self, current: list[LeaseRecord], stop: threading.Event) -> None:
        while not stop.wait(self.ttl / 3):
            term = current[0]
            expires = _now() + dt.timedelta(seconds=self.ttl)
            try:
                if self._write(term.seq + 1, self.holder, expires):
                    current[0] = LeaseRecord(term.seq + 1, self.holder, expires)
                    continue
            except StorageError as e:  # the destination is down: the term may lapse
                log.warning("mirror: could not renew the lease: %s", e)
                continue
            log.warning("mirror: lost the lease at %s to another promoter", self.storage.url)
            self.lost.set()
            return
