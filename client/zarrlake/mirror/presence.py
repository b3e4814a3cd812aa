"""What a mirror's destination is known to hold: immutable objects, so presence is cached.

Every object a repository writes is immutable (branch-journal entries aside, which a mirror never
copies), so an object found at the destination once stays there until the mirror's own GC takes
it. The promoter therefore asks the destination only about objects it has not seen. What it
learns in a pass is kept in memory and written as one :class:`PresenceRecord` under
``mirror/present/``; a promoter that starts (again) reads those records first, so a restart does
not check the whole repository again. Records are merged into one when they pile up.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from zarrlake.errors import CorruptObject, UnsupportedFormat
from zarrlake.format.ids import new_snapshot_id
from zarrlake.format.model import MIRROR_PREFIX, PresenceRecord, presence_key
from zarrlake.storage.base import ObjectNotFound, Storage

PRESENCE_PREFIX = MIRROR_PREFIX + "present/"


class Presence:
    """The destination's known objects, complete shards and complete snapshots.

    ``keys``: objects found at the destination. ``shards``: digests of manifest shards whose
    object and every chunk and pack object they reference are present. ``snapshots``: ids of
    commits whose history is present: their snapshot object and txlog, and those of all their
    ancestors (down to where the source's history ends).
    """

    #: Merge the records into one when there are more than this many.
    MERGE_ABOVE = 32

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.keys: set[str] = set()
        self.shards: set[str] = set()
        self.snapshots: set[str] = set()
        # Learned since the last save (lists: the copier adds one key at a time).
        self._new: tuple[list[str], list[str], list[str]] = ([], [], [])
        self._record_keys: list[str] = []

    def load(self) -> None:
        """Read every presence record at the destination (a restarted promoter's memory).

        An unreadable record is skipped: presence is a cache, and what it misses is checked again.
        """
        self._record_keys = self.storage.list_keys(PRESENCE_PREFIX)

        def read(key: str) -> PresenceRecord | None:
            try:
                return PresenceRecord.decode(self.storage.get(key), key)
            except (ObjectNotFound, CorruptObject, UnsupportedFormat):
                return None

        for record in self.storage.map(read, self._record_keys):
            if record is not None:
                self._take(record)
        if len(self._record_keys) > self.MERGE_ABOVE:
            self._merge()

    def _take(self, record: PresenceRecord) -> None:
        self.keys.update(record.keys)
        self.shards.update(record.shards)
        self.snapshots.update(record.snapshots)

    def add(
        self,
        keys: Iterable[str] = (),
        shards: Iterable[str] = (),
        snapshots: Iterable[str] = (),
    ) -> None:
        """Learn objects (and complete shards and snapshots); :meth:`save` persists them."""
        for new, known, items in zip(
            self._new,
            (self.keys, self.shards, self.snapshots),
            (keys, shards, snapshots),
            strict=True,
        ):
            for item in items:
                if item not in known:
                    known.add(item)
                    new.append(item)

    @property
    def unsaved(self) -> int:
        """How many objects were learned since the last :meth:`save`."""
        return len(self._new[0])

    def save(self) -> None:
        """Write what was learned since the last save as one record (nothing if nothing was)."""
        keys, shards, snapshots = self._new
        if not (keys or shards or snapshots):
            return
        record = PresenceRecord(
            dt.datetime.now(dt.UTC), tuple(keys), tuple(shards), tuple(snapshots)
        )
        key = presence_key(new_snapshot_id())
        self.storage.put(key, record.encode())
        self._record_keys.append(key)
        self._new = ([], [], [])
        if len(self._record_keys) > self.MERGE_ABOVE:
            self._merge()

    def _merge(self) -> None:
        """Replace the records by one holding everything known (written first, then the old
        ones deleted: a reader in between sees both, which is the same knowledge)."""
        merged = PresenceRecord(
            dt.datetime.now(dt.UTC),
            tuple(sorted(self.keys)),
            tuple(sorted(self.shards)),
            tuple(sorted(self.snapshots)),
        )
        key = presence_key(new_snapshot_id())
        self.storage.put(key, merged.encode())
        self.storage.delete_many(self._record_keys)
        self._record_keys = [key]

    def forget(self) -> None:
        """Drop everything known, in memory and at the destination (the mirror's GC deleted
        objects, so what was present may be gone)."""
        self.storage.delete_many(self.storage.list_keys(PRESENCE_PREFIX))
        self.keys.clear()
        self.shards.clear()
        self.snapshots.clear()
        self._record_keys = []
        self._new = ([], [], [])
