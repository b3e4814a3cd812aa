"""The published root: one object that holds what a fresh reader needs (DESIGN.md, "The
published root"; ``docs/design/refs-root.md``).

``root`` (a mirror's: ``mirror/root``) is the one object of a repository that is replaced, and
only by compare-and-set. It is never the truth: the branch journals and the tag records decide
every race, and ``root`` publishes what they decided, so that opening a repository, listing its
refs and the recent history of a branch are one read. It holds:

- the repository's marker record (format, features, content hash, config, id), so that opening
  needs no read of ``repo``;
- every branch's head: its journal sequence number, snapshot id and the head entry's stored
  bytes (which may carry the snapshot itself, so resolving a branch reads nothing else);
- the live tags (name -> snapshot id);
- the snapshots expiry took out of history (``log()`` stops at them), while they are few
  (:data:`EXPIRED_MAX`; more, and readers list ``expired/`` as before);
- the newest stretch of each recently moved branch's history past what its head snapshot
  carries (:data:`RECENT` commits with them), so that ``log(limit=100)`` reads nothing else;
- ``generation``: how many times it was published; a client never takes a root older than
  one it has seen.

Its size is bounded (:data:`CARRY_BUDGET`): snapshot bytes and recent history carried for
heads stop at the budget (those heads cost their reader one read of the snapshot object, or of
a history page). See the design note for
what is left: tables of many thousands of refs still live inline.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from zarrlake.errors import CorruptObject, UnsupportedFormat
from zarrlake.format.codec import ObjectType, decode, encode
from zarrlake.format.model import (
    MIRROR_PREFIX,
    PUBLISHED_ROOT,
    AncestorRecord,
    HistoryPage,
    JournalEntry,
    RepoRecord,
    Snapshot,
)

__all__ = [
    "CAS_PROBE_KEY",
    "MIRROR_ROOT_KEY",
    "PUBLISHED_ROOT",
    "ROOT_KEY",
    "BranchHead",
    "RootRecord",
]

ROOT_KEY = "root"
MIRROR_ROOT_KEY = MIRROR_PREFIX + ROOT_KEY
#: Reserved for the compare-and-set probe of a server (``Storage.check_compare_and_set``).
CAS_PROBE_KEY = "refs/probe-cas"

#: The format feature of a repository that publishes ``root`` (:data:`PUBLISHED_ROOT`, in
#: ``format.model``): its marker lists it, and a zarrlake that does not know it refuses to write
#: there, naming it. The name carries the first version that implements it, since the name is all
#: an older zarrlake can print.

#: The default branch (never deleted), which always carries its snapshot when it can, and its
#: newest history pages (``RootRecord.pages``): ``log()`` of its last LOG_RECORDS commits is the
#: root alone.
MAIN = "main"
LOG_RECORDS = 1000
#: Snapshot bytes carried inline, over all head entries, at most (the rest are carried without:
#: their readers read the snapshot object). Every publish rewrites the root, so this bounds
#: what a commit uploads beside its own objects.
CARRY_BUDGET = 256 * 1024
#: Heads that carry their snapshot (and recent history) at most: ``main`` and the most recently
#: moved others, which are the ones read. Every reader of the root decodes all of it (listing
#: refs, ``log()``, a session's head): a hundred old branches carrying theirs cost every one.
CARRY_HEADS = 16
#: Expired snapshot ids held inline at most; beyond, readers list the expiry records.
EXPIRED_MAX = 20_000
#: Commit records of a branch's history the root lets a reader have without another read: the
#: head's own, those its snapshot carries, and (``RootRecord.recent``) the rest. ``log(limit=100)``
#: reads nothing else: it looks at the parents of the 100th commit too (where history ends).
RECENT = 101


@dataclass(frozen=True, slots=True)
class BranchHead:
    """A branch's head as its journal decided it: entry ``seq``'s snapshot (None: deleted) and
    the entry's bytes (what a reader parses instead of reading the entry)."""

    seq: int
    snapshot: str | None
    entry: bytes


@dataclass(frozen=True, slots=True)
class RootRecord:
    repo: RepoRecord
    generation: int = 0
    branches: Mapping[str, BranchHead] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    #: Expired snapshot ids, or None when there are more than :data:`EXPIRED_MAX` (then read
    #: the records); ``expiry_records``: the keys of the expiry records they come from.
    expired: frozenset[str] | None = frozenset()
    expiry_records: frozenset[str] = frozenset()
    #: Branch -> a :class:`HistoryPage` (encoded, ``older`` empty) of the first-parent ancestors
    #: of its head past the records the head snapshot carries, up to :data:`RECENT` commits in
    #: all. An index like any history page: its records are copies of immutable snapshots'
    #: headers, so a stale or missing one costs reads, never a wrong answer.
    recent: Mapping[str, bytes] = field(default_factory=dict)
    #: History pages of ``main``'s head (digest -> the page's bytes, as stored at
    #: ``history/<digest>``): its newest, and the one before while the two hold fewer than
    #: :data:`LOG_RECORDS`. Readers check each against its digest before they use it.
    pages: Mapping[str, bytes] = field(default_factory=dict)

    # -- the updates writers publish (pure: a record in, a record out, or None: nothing new) ----

    def with_head(
        self,
        name: str,
        entry: JournalEntry,
        data: bytes,
        sealed: Callable[[str], bytes | None] | None = None,
    ) -> RootRecord | None:
        """This root with branch ``name`` at journal ``entry`` (stored as ``data``), if that is
        newer than what it holds: heads only ever move forward here, whatever order two
        publishers' swaps land in."""
        held = self.branches.get(name)
        if held is not None and held.seq >= entry.seq:
            return None
        # The most recently moved first: the order the root keeps (and carries snapshots in).
        branches = {name: BranchHead(entry.seq, entry.snapshot, data)}
        branches.update((n, h) for n, h in self.branches.items() if n != name)
        recent = dict(self.recent)
        page = self._recent_after(name, entry)
        if page is None:
            recent.pop(name, None)
        else:
            recent[name] = page
        pages = self.pages if name != MAIN else self._pages_of(entry, sealed)
        return replace(
            self,
            generation=self.generation + 1,
            branches=branches,
            recent=recent,
            pages=pages,
        )

    def _pages_of(
        self, entry: JournalEntry, sealed: Callable[[str], bytes | None] | None
    ) -> dict[str, bytes]:
        """The pages to carry with head ``entry`` of main: those its snapshot's index names
        first, from what this root carries already or, for a page just sealed, from its writer
        (``sealed``: digest -> bytes, or None), until they hold :data:`LOG_RECORDS` records."""
        index = _index_pages(entry.snapshot_data) if entry.snapshot_data is not None else ()
        pages: dict[str, bytes] = {}
        held = RECENT  # about what the head snapshot carries itself
        for digest in index[:2]:
            page = self.pages.get(digest) or (sealed(digest) if sealed is not None else None)
            if page is None:
                break
            pages[digest] = page
            held += _page_count(page)
            if held >= LOG_RECORDS:
                break
        return pages

    def _recent_after(self, name: str, entry: JournalEntry) -> bytes | None:
        """The recent history of branch ``name`` once its head is ``entry``: the first-parent
        line past the records the new head snapshot carries, taken from what this root already
        carries for the branch (its head's records and recent page), or, for a branch new here,
        for a branch whose head the new one is or descends from (a branch created from it)."""
        line = _lineage(entry.snapshot_data) if entry.snapshot_data is not None else None
        if not line or len(line) >= RECENT:
            return None
        pool: dict[str, AncestorRecord] = {}
        sources = [name] if name in self.branches else []
        if not sources:
            wanted = {line[0][0], *line[0][1].parents}
            sources = [n for n, h in self.branches.items() if h.snapshot in wanted][:1]
        for source in sources:
            pool.update(_head_lineage(self.branches[source].entry))
            page = self.recent.get(source)
            if page is not None:
                pool.update(_page_lineage(page))
        ids: list[str] = []
        records: list[AncestorRecord] = []
        parents = line[-1][1].parents
        while len(line) + len(ids) < RECENT and parents and parents[0] in pool:
            ids.append(parents[0])
            records.append(pool[parents[0]])
            parents = records[-1].parents
        if not ids:
            return None
        return HistoryPage(tuple(ids), tuple(records), ()).encode()

    def recent_history(self, name: str) -> HistoryPage | None:
        """The recent history the root carries for branch ``name`` (None: none, or none that
        parses: the reader reads history pages instead)."""
        page = self.recent.get(name)
        if page is None:
            return None
        try:
            return HistoryPage.decode(page, f"{ROOT_KEY} (recent history of {name!r})")
        except (CorruptObject, UnsupportedFormat):
            return None

    def with_tag(self, name: str, snapshot_id: str | None) -> RootRecord | None:
        """This root with tag ``name`` at ``snapshot_id`` (None: deleted), unless it already is."""
        if self.tags.get(name) == snapshot_id:
            return None
        tags = dict(self.tags)
        if snapshot_id is None:
            del tags[name]
        else:
            tags[name] = snapshot_id
        return replace(self, generation=self.generation + 1, tags=tags)

    def with_expired(self, records: Mapping[str, frozenset[str]]) -> RootRecord | None:
        """This root with the expiry ``records`` (key -> snapshot ids) folded in."""
        new = {k: v for k, v in records.items() if k not in self.expiry_records}
        if not new:
            return None
        expired = self.expired
        if expired is not None:
            expired = expired.union(*new.values())
            if len(expired) > EXPIRED_MAX:
                expired = None
        return replace(
            self,
            generation=self.generation + 1,
            expired=expired,
            expiry_records=self.expiry_records | new.keys(),
        )

    def with_journals(self, truth: RootRecord) -> RootRecord | None:
        """This root brought up to ``truth`` (what the journals, tag and expiry records say,
        read after this root): every head of ``truth`` newer than this root's, its tags exactly
        (they are created and deleted once each), its expiry records. A head this root holds
        newer than ``truth``'s stays: the journal moved on since ``truth`` was read."""
        moved: dict[str, BranchHead] = {}
        recent = dict(self.recent)
        for name, head in truth.branches.items():
            held = self.branches.get(name)
            if held is None or held.seq < head.seq:
                moved[name] = head
                recent.pop(name, None)
        branches = {**moved, **{n: h for n, h in self.branches.items() if n not in moved}}
        pages = {} if MAIN in moved else self.pages
        expired = self.expired
        if expired is not None and truth.expired is not None:
            expired = expired | truth.expired
            if len(expired) > EXPIRED_MAX:
                expired = None
        else:
            expired = None
        new = replace(
            self,
            branches=branches,
            tags=dict(truth.tags),
            expired=expired,
            expiry_records=self.expiry_records | truth.expiry_records,
            recent=recent,
            pages=pages,
        )
        if (new.branches, dict(new.tags), new.expired, new.expiry_records) == (
            dict(self.branches),
            dict(self.tags),
            self.expired,
            self.expiry_records,
        ):
            return None
        return replace(new, generation=self.generation + 1)

    def disagreements(self, truth: RootRecord) -> list[tuple[bool, str]]:
        """What this root says that ``truth`` (the journals and records, read before it) does
        not, each as (behind, detail). ``behind``: the root lacks what the journals decided
        later, a writer that has not published yet, or died before it did (never acknowledged:
        the next publish carries it); otherwise the root is wrong (a head or tag the journals
        do not have)."""
        out: list[tuple[bool, str]] = []
        for name in sorted(set(self.branches) | set(truth.branches)):
            held, head = self.branches.get(name), truth.branches.get(name)
            if head is None:
                out.append((False, f"branch {name!r} is in the root but has no journal"))
            elif held is None:
                out.append(
                    (True, f"branch {name!r} (journal entry {head.seq}) is not in the root yet")
                )
            elif held.seq < head.seq:
                out.append(
                    (
                        True,
                        f"branch {name!r}: the root names entry {held.seq} ({held.snapshot}), "
                        f"the journal's head is entry {head.seq} ({head.snapshot})",
                    )
                )
            elif held.seq == head.seq and held.snapshot != head.snapshot:
                out.append(
                    (
                        False,
                        f"branch {name!r}: the root's entry {held.seq} names {held.snapshot}, "
                        f"the journal's {head.snapshot}",
                    )
                )
        for name in sorted(set(self.tags) | set(truth.tags)):
            mine, theirs = self.tags.get(name), truth.tags.get(name)
            if mine == theirs:
                continue
            if mine is None:
                out.append((True, f"tag {name!r} ({theirs}) is not in the root yet"))
            else:
                # Deleted after the root was published (its tombstone decided), or wrong.
                out.append(
                    (
                        theirs is None,
                        f"tag {name!r}: the root says {mine}, its record "
                        f"{theirs or 'is gone or deleted'}",
                    )
                )
        if self.expired is not None and truth.expired is not None:
            missing = truth.expired - self.expired
            if missing:
                out.append((True, f"{len(missing)} expired snapshot(s) are not in the root yet"))
        return out

    def with_repo(self, repo: RepoRecord) -> RootRecord | None:
        if repo == self.repo:
            return None
        return replace(self, generation=self.generation + 1, repo=repo)

    # -- what readers take from it ----------------------------------------------------------------

    def heads(self) -> dict[str, str]:
        """Every live branch: name -> head snapshot id, sorted by name."""
        return {n: h.snapshot for n, h in sorted(self.branches.items()) if h.snapshot is not None}

    # -- the object -------------------------------------------------------------------------------

    def encode(self) -> bytes:
        budget = CARRY_BUDGET
        branches = []
        recent = []
        pages: list[list[Any]] = []
        # The most recently moved heads (the table's order) keep their snapshot bytes, then
        # their recent history, first: they are the ones being read.
        rank = 0
        for name, head in self.branches.items():
            data = head.entry
            # ``main`` always carries its snapshot (it is the one most read), whenever it moved.
            if name != MAIN:
                rank += 1
            if len(data) > budget or (rank >= CARRY_HEADS and name != MAIN):
                data = _without_snapshot(name, head)
            budget -= len(data)
            branches.append([name, head.seq, head.snapshot, data])
            page = self.recent.get(name)
            if page is not None and len(page) <= budget and data is head.entry:
                budget -= len(page)
                recent.append([name, page])
            if name == MAIN and data is head.entry:
                for digest, page in self.pages.items():
                    if len(page) > budget:
                        break
                    budget -= len(page)
                    pages.append([digest, page])
        body: dict[str, Any] = {
            "repo": self.repo.encode(),
            "generation": self.generation,
            "branches": branches,
            "tags": sorted(self.tags.items()),
            "expired": None if self.expired is None else sorted(self.expired),
            "expiry_records": sorted(self.expiry_records),
            # Its own key: a zarrlake 0.2.0 reads past it (and, publishing, leaves it out).
            "recent": sorted(recent),
            "pages": pages,
        }
        return encode(ObjectType.ROOT, body)

    @classmethod
    def decode(cls, data: bytes, key: str = ROOT_KEY) -> RootRecord:
        obj = decode(data, ObjectType.ROOT, key)
        repo = RepoRecord.decode(_typed(_need(obj, "repo", key), bytes, key, "repo"), key)
        generation = _typed(_need(obj, "generation", key), int, key, "generation")
        branches: dict[str, BranchHead] = {}
        for item in _typed(_need(obj, "branches", key), list, key, "branches"):
            if not (isinstance(item, list) and len(item) == 4):
                raise CorruptObject(key, f"bad branch head {item!r}")
            name, seq, snapshot, entry = item
            if not (
                isinstance(name, str)
                and isinstance(seq, int)
                and (snapshot is None or isinstance(snapshot, str))
                and isinstance(entry, bytes)
            ):
                raise CorruptObject(key, f"bad branch head for {name!r}")
            branches[name] = BranchHead(seq, snapshot, entry)
        tags: dict[str, str] = {}
        for item in _typed(_need(obj, "tags", key), list, key, "tags"):
            if not (
                isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)
            ):
                raise CorruptObject(key, f"bad tag {item!r}")
            tags[item[0]] = item[1]
        raw_expired = obj.get("expired")
        expired = None
        if raw_expired is not None:
            expired = frozenset(_strings(raw_expired, key, "expired"))
        records = frozenset(_strings(obj.get("expiry_records") or [], key, "expiry_records"))
        recent = _named_bytes(obj, "recent", key)
        pages = _named_bytes(obj, "pages", key)
        return cls(repo, generation, branches, tags, expired, records, recent, pages)


def _need(obj: Any, name: str, key: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise CorruptObject(key, f"missing {name!r}")
    return obj[name]


def _typed(value: Any, kind: type, key: str, name: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CorruptObject(key, f"{name} must be {kind.__name__}, not {type(value).__name__}")
    return value


def _named_bytes(obj: Any, name: str, key: str) -> dict[str, bytes]:
    """The optional field ``name``: a list of [name, bytes] pairs (absent: none)."""
    out: dict[str, bytes] = {}
    for item in _typed(obj.get(name) or [], list, key, name):
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], bytes)
        ):
            raise CorruptObject(key, f"bad {name} entry {item!r:.80}")
        out[item[0]] = item[1]
    return out


def _strings(value: Any, key: str, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise CorruptObject(key, f"{name} must be a list of strings")
    return value


def _without_snapshot(name: str, head: BranchHead) -> bytes:
    """The head entry's bytes without the snapshot it carries (over the root's budget)."""
    return _stripped(head.entry)


@functools.lru_cache(maxsize=16384)
def _stripped(entry: bytes) -> bytes:
    # Cached: the heads that stay over the budget are the same entries publish after publish.
    # The snapshot's digest stays in its place, for readers to check what they read instead.
    decoded = JournalEntry.decode(entry, "<root head>")
    digest = decoded.snapshot_sha256
    if digest is None and decoded.snapshot_data is not None:
        digest = hashlib.sha256(decoded.snapshot_data).hexdigest()
    return replace(decoded, snapshot_data=None, snapshot_sha256=digest).encode()


Lineage = tuple[tuple[str, AncestorRecord], ...]


@functools.lru_cache(maxsize=64)
def _snapshot(snapshot_data: bytes) -> Snapshot | None:
    """A head's snapshot (None if the bytes do not decode). Cached: a publish that loses its
    swap applies its update again, and the next commit on the branch reads the same head."""
    try:
        return Snapshot.decode(snapshot_data, "<root head>")
    except (CorruptObject, UnsupportedFormat):
        return None


@functools.lru_cache(maxsize=64)
def _lineage(snapshot_data: bytes) -> Lineage:
    """A snapshot's own commit record and those it carries of its ancestors, newest first
    (empty if the bytes do not decode)."""
    snap = _snapshot(snapshot_data)
    if snap is None:
        return ()
    own = AncestorRecord(snap.parents, snap.time, snap.author, snap.message, snap.metadata)
    return ((snap.id, own), *zip(snap.ancestry, snap.history, strict=False))


@functools.lru_cache(maxsize=64)
def _index_pages(snapshot_data: bytes) -> tuple[str, ...]:
    """The history pages a snapshot's index names, newest first (none if it does not decode)."""
    snap = _snapshot(snapshot_data)
    return () if snap is None or snap.index is None else snap.index.pages


@functools.lru_cache(maxsize=64)
def _head_lineage(entry: bytes) -> Lineage:
    try:
        data = JournalEntry.decode(entry, "<root head>").snapshot_data
    except (CorruptObject, UnsupportedFormat):
        return ()
    return () if data is None else _lineage(data)


@functools.lru_cache(maxsize=64)
def _page_count(page: bytes) -> int:
    # Cached: main's carried pages are the same bytes publish after publish (a commit on main
    # would otherwise decompress them each time).
    return HistoryPage.count(page)


@functools.lru_cache(maxsize=64)
def _page_lineage(page: bytes) -> Lineage:
    try:
        decoded = HistoryPage.decode(page, "<root recent history>")
    except (CorruptObject, UnsupportedFormat):
        return ()
    return tuple(zip(decoded.ids, decoded.records, strict=True))


def initial_root(repo: RepoRecord) -> RootRecord:
    return RootRecord(repo)
