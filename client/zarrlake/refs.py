"""Branches and tags on storage.

A branch is a journal of create-only entries in a folder of its own, named by 16 hex digits so
that the newest sorts first: by the storage listing contract (keys of one length in one folder
are listed in ascending order), a listing of one key finds the head. Nothing else here depends on
a listing's order. Two writers racing for the same sequence number: the backend lets exactly one
create it. A writer whose create-only response was lost reads the entry back and recognizes its
own writer id, so a lost response never turns into a false conflict.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as dt
import itertools
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from zarrlake.config import MAX_SESSION_TTL
from zarrlake.errors import (
    CorruptObject,
    InvalidName,
    RefNotFound,
    TagExists,
    UnsupportedFormat,
    ZarrlakeError,
)
from zarrlake.format.model import (
    GUARD_ID,
    REFS_PREFIX,
    JournalEntry,
    Marker,
    TagRecord,
    branch_entry_key,
    branch_prefix,
    head_marker_key,
    head_marker_prefix,
    parse_marker_key,
    parse_ref_key,
    ref_name_from_key,
    seq_from_entry_key,
    tag_key,
    tag_marker_key,
    tag_tombstone_key,
)
from zarrlake.format.root import RootRecord
from zarrlake.published import PublishedRoot
from zarrlake.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
)

log = logging.getLogger("zarrlake")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: Journal entries younger than this are never pruned. A client that knows a branch's head entry
#: ``N`` (a session's base, its own last commit) relies on it: entry ``N + 1`` was written after it
#: learned ``N``, so while that knowledge is younger than this floor, "``N + 1`` is absent" means
#: "``N`` is still the head", and a create-only write of ``N + 1`` cannot land behind a newer head
#: whose predecessors were pruned. Sessions live at most :data:`MAX_SESSION_TTL`; a day of margin
#: absorbs clock skew between the writers that time entries and the compaction that prunes them.
PRUNE_FLOOR = MAX_SESSION_TTL + dt.timedelta(days=1)

#: How long a client trusts a head it learned before it lists the journal again. Well inside
#: :data:`PRUNE_FLOOR`; within it, checking that the head has not moved is one read of the next
#: entry's key (absent: unmoved), where finding the newest entry needs a listing and a read.
KNOWN_HEAD_TTL_S = 3600.0

#: Entries past a known head's successor to read one by one before listing instead (a branch
#: that moved a lot).
_PROBES = 2
#: :meth:`BranchJournal.heads` finds every branch's head in one listing of all the journals when
#: they hold at most this many entries together: four S3 listing pages, four round trips in a
#: row, where reading a branch at a time costs three rounds (the folders, then a listing and a
#: read per branch) and two requests per branch. The 8-day prune floor keeps every entry of that
#: long, so a repository committing every few minutes is past one page (a fresh client, 1,001
#: entries in main's journal and 100 branches: 948 ms a branch at a time on moto, 217 ms in two
#: pages; locally 17.0 and 5.0 ms). Longer journals are read a branch at a time, after the
#: five pages that showed them longer.
HEADS_FROM_ONE_LISTING = 4000
#: The prefix of every branch journal's entries (``refs/branch.<name>/<seq>``).
BRANCH_KEYS = REFS_PREFIX + "branch."
#: The prefix of every branch's head markers (``refs/head.<name>/…``).
HEAD_MARKER_KEYS = REFS_PREFIX + "head."
#: The prefix of every tag's marker (``refs/tagid.<name>.…``).
TAG_MARKER_KEYS = REFS_PREFIX + "tagid."
#: A head marker is written at most this long after its entry (a write that waited longer is
#: dropped: the reader reads that head) ...
MARKER_WRITE_WINDOW_S = 5.0
#: ... and a reader trusts one listed at most this long after its entry. Together they keep a
#: marker that a client queued for a repository deleted and made anew meanwhile (whose entry of
#: the same number is another) from being trusted by that client, unless all of that happened
#: within seconds.
MARKER_LISTED_WINDOW = dt.timedelta(seconds=30)
#: Markers of earlier heads are deleted this many at a time (one request), off the committer's
#: path: a reader never trusts one (its entry is not the newest); they only fill listings.
STALE_MARKERS_BATCH = 32
#: The prefix of every tag record (``refs/tag.<name>``) and tombstone (``refs/tagdel.<name>``).
TAG_KEYS = REFS_PREFIX + "tag"

#: Markers found in a listing of the refs, by ref: ("head" or "tag", name) -> the markers and
#: their listed objects (see :func:`listed_markers`).
Markers = dict[tuple[str, str], list[tuple[Marker, ObjectInfo]]]

#: Keys read in one concurrent round when a storage without listings (plain HTTP) finds a head
#: by probing, or walks a journal back from its head.
_PROBE_ROUND = 16

#: Why a branch may exist although probing found no journal (see :meth:`BranchJournal.head`).
UNLISTED_HINT = (
    "this storage cannot list, so a branch is found by reading its journal from the first entry, "
    "and there is none: the branch does not exist, or compaction pruned its oldest entries; "
    "read a tag or snapshot id, or the repository this copy was published from"
)


def validate_name(name: object, kind: str = "branch") -> str:
    """Reject names that are empty, contain whitespace or control characters, contain '..',
    start with '-', end with '/', or exceed 255 bytes."""
    if not isinstance(name, str):
        raise InvalidName(f"{kind} name must be a string, not {type(name).__name__}")
    problem = None
    if not name:
        problem = "is empty"
    elif _CONTROL.search(name):
        problem = "contains a control character"
    elif any(c.isspace() for c in name):
        problem = "contains whitespace"
    elif ".." in name:
        problem = "contains '..'"
    elif name.startswith("-"):
        problem = "starts with '-'"
    elif name.startswith("/") or name.endswith("/") or "//" in name:
        problem = "has an empty path segment"
    elif len(name.encode("utf-8")) > 255:
        problem = "is longer than 255 bytes"
    if problem:
        raise InvalidName(f"invalid {kind} name {name!r}: {problem}")
    return name


def branch_glob_problem(glob: object) -> str | None:
    """Why ``glob`` cannot select branches as meant (None when it can): not a string, empty,
    or with a set left open (``exp[`` would only match itself, literally)."""
    if not isinstance(glob, str) or not glob:
        return f"a branch name or glob is a non-empty string, not {glob!r}"
    # fnmatch's reading: ``[`` opens a set that a later ``]`` closes (a ``]`` first in the set,
    # or after ``!``, is a member); a ``]`` outside a set is itself. An unclosed ``[`` would be
    # taken literally, which is never what the writer of ``exp[`` meant.
    i, n = 0, len(glob)
    while i < n:
        if glob[i] == "[":
            j = i + 1
            if j < n and glob[j] == "!":
                j += 1
            if j < n and glob[j] == "]":
                j += 1
            j = glob.find("]", j)
            if j < 0:
                return f"{glob!r} has a '[' that no ']' closes (a set is written [...])"
            i = j
        i += 1
    return None


def new_writer_id() -> str:
    return uuid.uuid4().hex


class RefPublisher(Protocol):
    """Where a client that may not write refs itself sends its ref changes: a commit service
    (:mod:`zarrlake.remote`), which holds the only credentials that write ``refs/`` and
    ``root``, checks the repository's rules and writes them. Each raises what the service
    refused with (:class:`BranchProtected`, :class:`CheckFailed`, ...)."""

    def append(self, name: str, entry: JournalEntry) -> bool:
        """As :meth:`BranchJournal.append`: True once ``entry`` is the branch's newest entry
        (and published), False when another writer took its sequence number."""
        ...

    def create_tag(self, name: str, snapshot_id: str) -> None: ...

    def delete_tag(self, name: str) -> None: ...


class BranchJournal:
    """Every branch's journal of create-only entries (see the module docstring).

    The only mutable state of a repository; everything else is immutable objects.
    """

    def __init__(
        self,
        storage: Storage,
        adopt: Callable[[str, bytes], None] | None = None,
        *,
        root: str = "",
        guard: str | None = None,
        published: PublishedRoot | None = None,
        pages: Callable[[str], bytes | None] | None = None,
        vouch: Callable[[str, str], None] | None = None,
    ) -> None:
        self.storage = storage
        # Where a head entry's digest of a snapshot too large to carry goes (the object
        # store's), so that a read of that snapshot is checked against it.
        self._vouch = vouch
        # History pages this client sealed, by digest (the object store's): what the published
        # root carries of ``main``'s history comes from them.
        self._pages = pages
        # Prepended to every key: "" for a repository, ``mirror/`` for a mirror's own refs.
        self.root = root
        # Where every head the journal decides is published, in a repository that has the
        # published root (readers then read it, not the journal); None: journal only.
        self.published = published
        # The repository id that this journal's head markers carry, and the only one it trusts
        # in markers it lists; None: it writes none and trusts none (see :meth:`heads_listed`).
        self.guard = marker_guard(guard)
        # Branch -> (process id, its latest marker write), for :meth:`settle`.
        self._marking: dict[str, tuple[int, Future[None]]] = {}
        # Markers of earlier heads this journal replaced, to delete in a batch. (Without a
        # lock: two commits at once may drop one from the batch; compaction deletes it.)
        self._stale: list[str] = []
        # Where a head entry's carried snapshot goes (the object store's cache), so whoever reads
        # the head next finds its snapshot without another request.
        self._adopt = adopt
        # Branch -> (the head entry this client last saw, time.monotonic() when it was the head,
        # the entry's stored bytes if this client has them: read or written by it).
        self._known: dict[str, tuple[JournalEntry, float, bytes | None]] = {}
        # Head entries read by :func:`read_refs`, by key, with the size and time the listing gave
        # them: a later listing that shows the same object needs no read of it.
        self._listed: dict[str, tuple[int, dt.datetime, JournalEntry]] = {}
        #: Where appends go instead of this storage (a commit service), or None: written here.
        self.remote: RefPublisher | None = None
        #: Who an entry written here without a ``by`` of its own is by (a commit service
        #: merging for a caller says whom), or None.
        self.stamp: Callable[[], dict[str, str] | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # What a client learned (and when, on its own monotonic clock) stays with that client.
        return {
            "storage": self.storage,
            "adopt": self._adopt,
            "root": self.root,
            "guard": self.guard,
            "published": self.published,
            "pages": self._pages,
            "vouch": self._vouch,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["storage"],
            state["adopt"],
            root=state["root"],
            guard=state.get("guard"),
            published=state.get("published"),
            pages=state.get("pages"),
            vouch=state.get("vouch"),
        )

    def entry_key(self, name: str, seq: int) -> str:
        """The storage key of journal entry ``seq`` of branch ``name``."""
        return self.root + branch_entry_key(name, seq)

    def known(self, name: str) -> JournalEntry | None:
        """The head entry of ``name`` as this client last saw it (read, or written by its own
        commit), if that was within :data:`KNOWN_HEAD_TTL_S`; else None. It may have moved since,
        or be gone with a repository deleted and created anew at this location: see
        :meth:`confirms` and :data:`PRUNE_FLOOR` for what makes it safe to use."""
        seen = self._known.get(name)
        if seen is None or time.monotonic() - seen[1] > KNOWN_HEAD_TTL_S:
            return None
        return seen[0]

    def forget(self, name: str) -> None:
        """Drop what this client knows of ``name``'s head (the next read lists the journal)."""
        self._known.pop(name, None)

    def _learn(self, name: str, entry: JournalEntry, at: float, data: bytes | None) -> None:
        """Remember ``entry`` as the head of ``name`` (``data``: its stored bytes, if known)."""
        self._known[name] = (entry, at, data)
        if self._adopt is not None and entry.snapshot and entry.snapshot_data is not None:
            self._adopt(entry.snapshot, entry.snapshot_data)
        elif self._vouch is not None and entry.snapshot and entry.snapshot_sha256 is not None:
            self._vouch(entry.snapshot, entry.snapshot_sha256)

    def confirms(self, name: str, data: bytes | None, entry: JournalEntry) -> bool:
        """Whether ``data``, read from the key of ``entry``, is ``entry`` itself: the same
        sequence number, snapshot and writer id. False for an absent or unreadable object, or
        another writer's entry (a repository deleted and created anew under this client)."""
        if data is None:
            return False
        seen = self._known.get(name)
        if seen is not None and seen[0] is entry and seen[2] is not None and data == seen[2]:
            # Byte for byte the object this client read (and parsed) or wrote at this key: the
            # same entry, without decoding it again.
            return True
        try:
            found = self._parse(self.entry_key(name, entry.seq), data)
        except ZarrlakeError:
            return False
        return (found.snapshot, found.writer) == (entry.snapshot, entry.writer)

    def _get_optional(self, key: str) -> bytes | None:
        try:
            return self.storage.get(key)
        except ObjectNotFound:
            return None

    def head(self, name: str) -> JournalEntry | None:
        """The newest entry of the branch's journal (None if the branch never existed).

        With a recently known head ``N``, one round of reads (concurrent where reads are not
        cheaper in place: :meth:`Storage.map_reads`) reads the keys of ``N`` (still the entry
        this client saw) and ``N + 1`` (absent: ``N`` is the head; present: on a remote store
        the listing names the newest, read unless it is ``N + 1``; else the next keys are read),
        instead of a listing and a read; otherwise, or if ``N`` is not what it was, the
        listing — or, on a storage that cannot list, probing (:meth:`_probe_head_key`).
        """
        asked = time.monotonic()
        known = self.known(name)
        if known is not None:
            keys = [self.entry_key(name, known.seq + i) for i in (0, 1)]
            mine, following = self.storage.map_reads(self._get_optional, keys)
            if self.confirms(name, mine, known):
                entry, data, probes = known, mine, 0
                if (
                    following is not None
                    and self.storage.supports_listing
                    and not self.storage.inline_read_bytes
                ):
                    # The branch moved on: one listing names the newest entry however far it
                    # went (a writer that waited for a lock is often many commits behind),
                    # where reading on entry by entry costs a round trip per commit. (Not
                    # where a read is a local file's: there reading on costs less than a
                    # listing sorting the whole journal.)
                    data, following = following, None
                    entry = self._parse(self.entry_key(name, known.seq + 1), data)
                    keys = self.storage.list_keys(self.root + branch_prefix(name), limit=1)
                    newest = keys[0] if keys else None
                    # (Keys count down: a smaller key is a newer entry.)
                    if newest is not None and newest < self.entry_key(name, entry.seq):
                        data = self.storage.get(newest)
                        entry = self._parse(newest, data)
                    elif newest != self.entry_key(name, entry.seq):
                        # A listing behind what a read has shown: read on, entry by entry.
                        following = self._get_optional(self.entry_key(name, entry.seq + 1))
                while following is not None and probes < _PROBES:
                    entry = self._parse(self.entry_key(name, entry.seq + 1), following)
                    data = following
                    following = self._get_optional(self.entry_key(name, entry.seq + 1))
                    probes += 1
                if following is None:
                    self._learn(name, entry, asked, data)
                    return entry
            self.forget(name)
        # The listing contract's one ordering promise: the smallest key, i.e. the newest entry.
        if self.storage.supports_listing:
            keys = self.storage.list_keys(self.root + branch_prefix(name), limit=1)
            newest = keys[0] if keys else None
        else:
            newest = self._probe_head_key(name)
        if newest is None:
            return None
        data = self.storage.get(newest)
        entry = self._parse(newest, data)
        self._learn(name, entry, asked, data)
        return entry

    def head_at(self, name: str, seq: int) -> JournalEntry | None:
        """Entry ``seq`` of ``name``'s journal if it is the head (it exists, the next does
        not: one round of two reads), else None (the caller finds the head as usual). For a
        head someone said it is (a lock service's hint), never trusted untested."""
        asked = time.monotonic()
        keys = [self.entry_key(name, seq + i) for i in (0, 1)]
        data, following = self.storage.map_reads(self._get_optional, keys)
        if data is None or following is not None:
            return None
        entry = self._parse(keys[0], data)
        self._learn(name, entry, asked, data)
        return entry

    def published_head(self, name: str) -> JournalEntry | None:
        """The branch's head as a reader sees it: from the published root (one read, which also
        finds every other head), where the repository has one; else :meth:`head`. What the
        root says may trail the journal by a commit whose writer died between its append and
        its swap (never acknowledged; the next commit on the branch builds on it)."""
        return self._head_in(name, None if self.published is None else self.published.read())

    def cached_published_head(self, name: str) -> JournalEntry | None:
        """The live head of ``name`` in the newest published root this client has seen, without
        a request; None if there is no such root, or it has no live branch ``name``."""
        root = None if self.published is None else self.published.cached()
        if root is None or name not in root.branches:
            return None
        entry = self._head_in(name, root)
        return entry if entry is not None and entry.snapshot is not None else None

    def published_current_ahead(self, name: str) -> Callable[[], JournalEntry]:
        """:meth:`published_current`, started now (the root read on the I/O pool, see
        :meth:`PublishedRoot.read_ahead`): the function that gives its answer. Only for a
        repository with a published root."""
        published = self.published
        assert published is not None
        answer = published.read_ahead()

        def current() -> JournalEntry:
            try:
                root = answer()
            except (StorageError, CorruptObject, UnsupportedFormat):
                # The read ahead failed (a storage error): read again now, so that one bad
                # moment does not make every later read of the session fail with it.
                root = published.read()
            return self._live(name, self._head_in(name, root))

        return current

    def _head_in(self, name: str, root: RootRecord | None) -> JournalEntry | None:
        """The head of ``name`` as ``root`` says (as :meth:`head` says where it is None)."""
        if root is None:
            return self.head(name)
        held = root.branches.get(name)
        if held is None:
            return None
        key = self.entry_key(name, held.seq)
        entry = self._parse(key, held.entry)
        known = self.known(name)
        if known is None or known.seq <= entry.seq:
            self._learn(name, entry, time.monotonic(), None)
        return entry

    def _probe_head_key(self, name: str) -> str | None:
        """The key of the newest journal entry, found without a listing (plain HTTP).

        Entries are numbered from 0 with no gaps (each is written after its predecessor exists),
        so "entry ``n`` exists" holds exactly up to the head: a concurrent round of existence
        checks at doubling distances brackets the head, then rounds at evenly spaced points
        narrow the bracket — O(log n) keys in a few rounds, for a journal of n entries. Entry 0
        absent means no journal, or one compaction pruned (it keeps only recent entries); that
        case reads as "no branch", and :data:`UNLISTED_HINT` explains it to users.
        """

        def exists(seq: int) -> bool:
            return self.storage.exists(self.entry_key(name, seq))

        if not exists(0):
            return None
        low, high = 0, None  # entry ``low`` exists; ``high``, once known, does not
        while high is None:
            seqs = [low + (1 << i) for i in range(_PROBE_ROUND)]
            found = self.storage.map(exists, seqs)
            if all(found):
                low = seqs[-1]
                continue
            first_absent = found.index(False)
            low, high = (seqs[first_absent - 1] if first_absent else low), seqs[first_absent]
        while high - low > 1:
            step = (high - low) / (_PROBE_ROUND + 1)
            seqs = sorted({low + max(1, int(step * m)) for m in range(1, _PROBE_ROUND + 1)})
            seqs = [q for q in seqs if low < q < high]
            found = self.storage.map(exists, seqs)
            for seq, present in zip(seqs, found, strict=True):
                if present:
                    low = seq
                else:
                    high = seq
                    break
        return self.entry_key(name, low)

    def entry_keys(self, name: str) -> list[str]:
        """Storage keys of the branch's retained journal entries, newest first."""
        if not self.storage.supports_listing:
            return [self.entry_key(name, e.seq) for e in self._walk_back(name)]
        # Sorted here: the listing contract orders this folder too, but a whole journal costs
        # nothing to sort, and history then rests on the listing's order in no way.
        return sorted(self.storage.list_keys(self.root + branch_prefix(name)))

    def _walk_back(self, name: str) -> list[JournalEntry]:
        """Without a listing: the head and the entries before it, newest first, read back
        (a concurrent round at a time) until the first absent one."""
        head = self.head(name)
        entries = [] if head is None else [head]
        while entries and entries[-1].seq > 0:
            below = entries[-1].seq
            keys = [
                self.entry_key(name, q)
                for q in range(below - 1, max(below - 1 - _PROBE_ROUND, -1), -1)
            ]
            for key, data in zip(keys, self.storage.map(self._get_optional, keys), strict=True):
                if data is None:
                    return entries
                entries.append(self._parse(key, data))
        return entries

    def missing(self, name: str, kind: str = "branch") -> RefNotFound:
        """The error for a branch (or ref) not found here, explained where the storage cannot
        list (see :meth:`_probe_head_key`)."""
        return RefNotFound(name, kind, "" if self.storage.supports_listing else UNLISTED_HINT)

    def read_entry(self, key: str) -> JournalEntry:
        """The journal entry stored under ``key`` (one of :meth:`entry_keys`).

        Raises :class:`ObjectNotFound` if it is gone, :class:`CorruptObject` or
        :class:`UnsupportedFormat` if it does not parse or its sequence number disagrees with its
        key.
        """
        return self._parse(key, self.storage.get(key))

    @staticmethod
    def _parse(key: str, data: bytes) -> JournalEntry:
        entry = JournalEntry.decode(data, key)
        if entry.seq != seq_from_entry_key(key):
            raise CorruptObject(key, f"entry claims sequence {entry.seq}")
        return entry

    def last_token(self, name: str, entry: JournalEntry, depth: int = 16) -> int | None:
        """The highest fencing token the journal holds up to ``entry``: what a write under a
        lock must exceed. The entry says it (its token and the ``fence`` every writer carries
        forward); an entry from before fences were carried gives its own token or, without one
        (an optimistic commit), that of the newest of the ``depth`` entries before it that has
        one (read in one concurrent round)."""
        if entry.fence is not None or entry.token is not None:
            return entry.highest_token
        seqs = [seq for seq in range(entry.seq - 1, entry.seq - 1 - depth, -1) if seq >= 0]
        keys = [self.entry_key(name, seq) for seq in seqs]
        for key, data in zip(keys, self.storage.map(self._get_optional, keys), strict=True):
            if data is None:
                continue  # pruned
            try:
                token = self._parse(key, data).token
            except ZarrlakeError:
                continue
            if token is not None:
                return token
        return None

    def current(self, name: str) -> JournalEntry:
        """The head entry of a live branch. Raises :class:`RefNotFound`."""
        return self._live(name, self.head(name))

    def _live(self, name: str, entry: JournalEntry | None) -> JournalEntry:
        if entry is None:
            raise self.missing(name)
        if entry.snapshot is None:
            raise RefNotFound(name, "branch")
        return entry

    def published_current(self, name: str) -> JournalEntry:
        """:meth:`current` as a reader sees it (:meth:`published_head`). Raises
        :class:`RefNotFound`."""
        return self._live(name, self.published_head(name))

    def history(self, name: str) -> list[JournalEntry]:
        """Every retained entry, newest first (without a listing: back from the head to the
        first entry missing)."""
        if not self.storage.supports_listing:
            return self._walk_back(name)
        return self.storage.map(self.read_entry, self.entry_keys(name))

    def is_branch(self, name: str) -> bool:
        """Whether ``name`` is a valid branch name with a live (not deleted) head."""
        try:
            validate_name(name)
        except InvalidName:
            return False
        head = self.head(name)
        return head is not None and head.snapshot is not None

    def heads(self) -> dict[str, str]:
        """Every live branch: name -> head snapshot id, sorted by name.

        With a listing, one round of two listings, every journal's entries and every head
        marker (tags, however many, are listed by neither), then one concurrent round reading
        the heads that have no marker and that this journal has not read as they are now listed
        (:meth:`heads_listed`): two requests when every head has its marker or none moved since
        this journal last looked, 2 + N for N branches at most. Journals of more than
        :data:`HEADS_FROM_ONE_LISTING` entries together are read a branch at a time: a listing
        of the branch folders, then each one's head (:meth:`head`), as without a listing.
        (Markers past that many are not listed: their heads are read.)"""
        root = None if self.published is None else self.published.read()
        if root is not None:
            return root.heads()
        if self.storage.supports_listing:
            asked = time.monotonic()
            prefixes = [BRANCH_KEYS] + ([HEAD_MARKER_KEYS] if self.guard is not None else [])

            def listing(prefix: str) -> list[ObjectInfo]:
                found = self.storage.list(self.root + prefix)
                return list(itertools.islice(found, HEADS_FROM_ONE_LISTING + 1))

            listed = self.storage.map_reads(listing, prefixes)
            if len(listed[0]) <= HEADS_FROM_ONE_LISTING:
                markers = listed_markers(self.root, listed[1]) if len(listed) > 1 else {}
                return self.heads_listed(newest_entries(self.root, listed[0]), asked, markers)
        return self.heads_branch_by_branch()

    def heads_branch_by_branch(self) -> dict[str, str]:
        """:meth:`heads`, a branch at a time: a listing of the branch folders, then each one's
        head (:meth:`head`). Follows a local repository's branch folders wherever they link."""
        names = self.names()
        entries: list[JournalEntry | None] = self.storage.map(self.head, names)
        return {
            n: e.snapshot for n, e in sorted(zip(names, entries, strict=True)) if e and e.snapshot
        }

    def heads_listed(
        self, newest: dict[str, ObjectInfo], asked: float, markers: Markers | None = None
    ) -> dict[str, str]:
        """Every live branch, from the newest entry of each journal as a listing of them all
        found it (asked at ``asked``, a ``time.monotonic()``), and the ``markers`` the same
        listing found: see :func:`read_refs`.

        An entry the listing shows with the size and modification time it had when this journal
        read it is not read again: entries are written create-only, never rewritten. Nor is an
        entry the listing shows with its marker (:func:`trusted_marker`): the marker's key says
        the head. An entry gone by the time it is read (compaction pruned it: the branch moved
        on since the listing) sends that branch to :meth:`head`. A head this journal knows to be
        newer than the listed one (it committed meanwhile) stays the one it knows."""
        cache = self._listed  # one view of it: calls running at once each replace it whole
        marked: dict[str, str | None] = {}
        for name, info in newest.items():
            if cache.get(info.key, (None, None))[:2] == (info.size, info.modified):
                continue  # read before: the entry itself, which this journal then knows
            found = trusted_marker(
                (markers or {}).get(("head", name), []),
                seq_from_entry_key(info.key),
                info,
                self.guard,
            )
            if found is not None:
                marked[name] = found[0].snapshot
        to_read = [
            info
            for name, info in newest.items()
            if name not in marked
            and cache.get(info.key, (None, None))[:2] != (info.size, info.modified)
        ]

        def read(info: ObjectInfo) -> JournalEntry | None:
            try:
                return self.read_entry(info.key)
            except ObjectNotFound:
                return None

        read_now: list[JournalEntry | None] = self.storage.map(read, to_read)
        listed = {i.key: cache[i.key] for i in newest.values() if i.key in cache}
        gone: list[str] = []
        for info, entry in zip(to_read, read_now, strict=True):
            if entry is not None:
                listed[info.key] = (info.size, info.modified, entry)
        self._listed = listed
        heads: dict[str, str] = {}
        for name, info in sorted(newest.items()):
            if name in marked:
                known = self.known(name)
                snapshot = marked[name]
                if known is not None and known.seq > seq_from_entry_key(info.key):
                    snapshot = known.snapshot
                if snapshot is not None:
                    heads[name] = snapshot
                continue
            if info.key not in listed:
                gone.append(name)
                continue
            head = listed[info.key][2]
            known = self.known(name)
            if known is None or known.seq <= head.seq:
                self._learn(name, head, asked, None)
            if head.snapshot is not None:
                heads[name] = head.snapshot
        for name, entry in zip(gone, self.storage.map(self.head, gone), strict=True):
            if entry is not None and entry.snapshot is not None:
                heads[name] = entry.snapshot
        return dict(sorted(heads.items()))

    def prune(self, name: str, seqs: Iterable[int]) -> None:
        """Delete the entries ``seqs`` of the branch (compaction; never the head's)."""
        self.storage.delete_many(self.entry_key(name, seq) for seq in seqs)

    def prune_markers(self, name: str, head_seq: int) -> int:
        """Delete the branch's markers of entries older than ``head_seq`` (compaction: only a
        head's marker is ever trusted, and each one is a key in every listing of the refs).
        Returns how many were deleted."""
        prefix = self.root + head_marker_prefix(name)
        stale = []
        for key in self.storage.list_keys(prefix):
            marker = parse_marker_key(key[len(self.root) :])
            if marker is not None and marker.seq is not None and marker.seq < head_seq:
                stale.append(key)
        return self.storage.delete_many(stale) if stale else 0

    def settle(self) -> None:
        """Delete the markers of earlier heads this journal still holds back, and wait for its
        marker writes in flight (they never raise)."""
        stale, self._stale = self._stale, []
        if stale:
            self._submit_marker("", None, stale)
        for pid, future in list(self._marking.values()):
            if pid == os.getpid():
                future.result()

    def _mark(self, name: str, entry: JournalEntry, previous: JournalEntry | None) -> None:
        """Write the marker of ``entry``, this writer's own new head of ``name``. Where writes
        go over a network, off the committer's path: on the process's one marker thread, in the
        order of the appends, never behind the I/O pool's uploads (:meth:`settle` waits). On
        local files and memory, here: a file to create costs about as much CPU in either thread
        (measured: 1-chunk commits in a row took +0.7 ms either way). The marker of the
        ``previous`` head joins a batch to delete (:data:`STALE_MARKERS_BATCH`), so a commit
        costs one request more, not two."""
        if self.guard is None:
            return
        key = self.root + head_marker_key(name, entry.seq, entry.snapshot, self.guard)
        if previous is not None and previous.seq < entry.seq:
            self._stale.append(
                self.root + head_marker_key(name, previous.seq, previous.snapshot, self.guard)
            )
            _HOLDING_STALE_MARKERS.add(self)
        stale: list[str] = []
        if len(self._stale) >= STALE_MARKERS_BATCH:
            stale, self._stale = self._stale, []
        self._submit_marker(name, key, stale, time.monotonic())

    def _submit_marker(
        self, name: str, key: str | None, stale: list[str], since: float | None = None
    ) -> None:
        if self.storage.inline_write_bytes:
            write_marker(self.storage, key, stale, since)
            return
        try:
            future = _marker_thread().submit(write_marker, self.storage, key, stale, since)
        except RuntimeError:  # the interpreter is shutting down: readers read the entry
            return
        self._marking[name] = (os.getpid(), future)

    def append(self, name: str, entry: JournalEntry, *, publish: bool = True) -> bool:
        """Create-only write of ``entry``. True if it is now the branch's newest entry, then
        published to the root where there is one (unless ``publish`` is off: a repository
        being created, whose root is written after its marker).

        False means another writer took that sequence number (the caller re-reads and retries).
        """
        key = self.entry_key(name, entry.seq)
        asked = time.monotonic()
        seen = self._known.get(name)
        if self.remote is not None:
            # The service writes the entry and publishes it; this client only learns its head.
            if not self.remote.append(name, entry):
                self._known.pop(name, None)
                return False
            self._learn(name, entry, asked, None)
            return True
        if self.stamp is not None and entry.by is None:
            by = self.stamp()
            if by is not None:
                entry = dataclasses.replace(entry, by=by)
        encoded = entry.encode()
        data: bytes | None = encoded
        try:
            self.storage.put(key, encoded, create_only=True)
        except PreconditionFailed:
            try:
                existing = self.read_entry(key)
            except ObjectNotFound:
                existing = None
            # Our own write whose response was lost still counts as ours.
            if existing is None or (existing.writer, existing.snapshot) != (
                entry.writer,
                entry.snapshot,
            ):
                self._known.pop(name, None)
                return False
            data = None  # stored by an earlier try of ours: its bytes may differ (its time)
        self._learn(name, entry, asked, data)
        self._mark(name, entry, None if seen is None else seen[0])
        if self.published is not None and publish:
            # Decided: now published, before the caller is told (a reader of the root then
            # sees it). Our bytes, if the stored ones are an earlier try's: the same entry.
            self.published.publish(lambda r: r.with_head(name, entry, encoded, self._pages))
        return True

    def ready_to_publish(self, name: str, head: JournalEntry) -> None:
        """About to append after ``head``: if the root this client saw trails the journal there
        (others' commits were published since it was read), read it again now, alongside the
        commit's own writes, so that the swap after the append lands at its first try instead
        of losing to a version this client never saw and reading the root only then."""
        published = self.published
        if published is None or self.remote is not None or self.storage.inline_read_bytes:
            return  # (a local read costs less than the hand-off to a thread)
        root = published.cached()
        held = None if root is None else root.branches.get(name)
        if held is not None and held.seq >= head.seq:
            return
        published.refresh_ahead()

    def names(self) -> list[str]:
        """Names of every branch that has a journal (deleted branches included), in no order.

        Also perhaps names whose journal is gone entirely: a server may keep listing a folder
        whose objects were all deleted (the listing contract allows it). Their :meth:`head` is
        None, which every caller already takes as "no such branch"."""
        return [
            ref_name_from_key(d[len("branch.") :])
            for d in self.storage.list_dirs(self.root + "refs/")
            if d.startswith("branch.")
        ]


class Tags:
    """Create-only tags; a deleted tag leaves a tombstone and its name is never reused."""

    def __init__(
        self,
        storage: Storage,
        *,
        root: str = "",
        guard: str | None = None,
        published: PublishedRoot | None = None,
    ) -> None:
        self.storage = storage
        self.root = root  # prepended to every key, as BranchJournal.root
        self.published = published  # as BranchJournal.published
        self.guard = marker_guard(guard)  # as BranchJournal.guard, for tag markers
        # Tag records read by :func:`read_refs` (key -> size, time, snapshot), as the journal's.
        self._listed: dict[str, tuple[int, dt.datetime, str]] = {}
        #: As :attr:`BranchJournal.remote`.
        self.remote: RefPublisher | None = None

    def get(self, name: str) -> str:
        """The tagged snapshot id. Raises :class:`RefNotFound` (also for a deleted tag).

        The record and its tombstone are read in one concurrent round; in a repository with a
        published root, the root alone is read."""
        root = None if self.published is None else self.published.read()
        if root is not None:
            if name not in root.tags:
                raise RefNotFound(name, "tag")
            return root.tags[name]

        def read(i: int) -> bytes | None:
            if i == 0:
                try:
                    return self.storage.get(self.root + tag_key(name))
                except ObjectNotFound:
                    return None
            return b"" if self.storage.exists(self.root + tag_tombstone_key(name)) else None

        data, tombstone = self.storage.map(read, (0, 1))
        if data is None or tombstone is not None:
            raise RefNotFound(name, "tag")
        return TagRecord.decode(data, self.root + tag_key(name)).snapshot

    def create(self, name: str, snapshot_id: str) -> None:
        if self.remote is not None:
            self.remote.create_tag(name, snapshot_id)
            return
        if self.storage.exists(self.root + tag_tombstone_key(name)):
            raise TagExists(f"tag {name!r} was deleted; tag names are never reused")
        record = TagRecord(snapshot_id, dt.datetime.now(dt.UTC))
        key = self.root + tag_key(name)
        try:
            self.storage.put(key, record.encode(), create_only=True)
        except PreconditionFailed:
            # A retried write whose first response was lost finds its own record: not a clash.
            try:
                mine = TagRecord.decode(self.storage.get(key), key) == record
            except ObjectNotFound:
                mine = False
            if not mine:
                raise TagExists(f"tag {name!r} already exists") from None
        if self.published is not None:
            self.published.publish(lambda r: r.with_tag(name, snapshot_id))
        if self.guard is not None:
            # Only now, the record known to be this writer's: a marker never names a loser's.
            write_marker(self.storage, self.root + tag_marker_key(name, snapshot_id, self.guard))

    def delete(self, name: str) -> None:
        if self.remote is not None:
            self.remote.delete_tag(name)
            return
        snapshot = self.get(name)  # RefNotFound if absent or already deleted
        try:
            self.storage.put(
                self.root + tag_tombstone_key(name),
                TagRecord("", dt.datetime.now(dt.UTC)).encode(),
                create_only=True,
            )
        except PreconditionFailed:
            raise RefNotFound(name, "tag") from None
        if self.published is not None:
            self.published.publish(lambda r: r.with_tag(name, None))
        if self.guard is not None:
            # A deleted tag's marker is never trusted (the tombstone rules): out of the listings.
            stale = [self.root + tag_marker_key(name, snapshot, self.guard)]
            write_marker(self.storage, None, stale)

    def listed(
        self,
        records: dict[str, ObjectInfo],
        *,
        reread: bool = False,
        markers: Markers | None = None,
        on_corrupt: Callable[[str, ZarrlakeError], None] | None = None,
    ) -> dict[str, str]:
        """Name -> snapshot id of the live tags whose records a listing found (tombstoned ones
        left out by the caller), sorted by name: see :func:`read_refs`. A record seen before with
        the same size and modification time is not read again (records are create-only), nor one
        the same listing shows with its marker among ``markers`` (:func:`trusted_marker`),
        unless ``reread`` (fsck: a record may rot without changing either). A record that
        does not parse raises its :class:`CorruptObject`; with ``on_corrupt``, it is handed
        to it with its key instead, and its tag left out."""
        # One view of the cache: calls running at once each replace it whole.
        cache = {} if reread else self._listed
        marked: dict[str, str] = {}
        if not reread:
            for name, info in records.items():
                found = trusted_marker(
                    (markers or {}).get(("tag", name), []), None, info, self.guard
                )
                if found is not None and found[0].snapshot is not None:
                    marked[name] = found[0].snapshot
        to_read = [
            info
            for name, info in records.items()
            if name not in marked
            and cache.get(info.key, (None, None))[:2] != (info.size, info.modified)
        ]

        def read(info: ObjectInfo) -> str | None:
            try:
                return TagRecord.decode(self.storage.get(info.key), info.key).snapshot
            except (CorruptObject, UnsupportedFormat) as e:
                if on_corrupt is None:
                    raise
                on_corrupt(info.key, e)
                return None

        snapshots = self.storage.map(read, to_read)
        listed = {i.key: cache[i.key] for i in records.values() if i.key in cache}
        for info, snapshot in zip(to_read, snapshots, strict=True):
            if snapshot is not None:
                listed[info.key] = (info.size, info.modified, snapshot)
        self._listed = listed
        return {
            name: marked[name] if name in marked else listed[records[name].key][2]
            for name in sorted(records)
            if name in marked or records[name].key in listed
        }

    def all(
        self,
        *,
        reread: bool = False,
        records_only: bool = False,
        on_corrupt: Callable[[str, ZarrlakeError], None] | None = None,
    ) -> dict[str, str]:
        """Every live tag: name -> snapshot id, sorted by name. One listing finds the records,
        the tombstones and the markers (``refs/tag.``, ``refs/tagdel.`` and ``refs/tagid.``
        share the prefix ``refs/tag``), then one concurrent round reads the live records that
        have no marker and were not read before as listed (:meth:`listed`; with ``reread``,
        every live record): one request when every tag has its marker or none changed, 1 + N
        for N tags at most. With ``records_only``, markers are not trusted: every answer is a
        record this object read (GC, expiry and mirrors rest on records, never on markers).
        ``on_corrupt``: as for :meth:`listed`. Without ``reread`` or ``records_only``, a
        repository's published root answers, in one read."""
        if not (reread or records_only) and self.published is not None:
            root = self.published.read()
            if root is not None:
                return dict(sorted(root.tags.items()))
        listed = list(self.storage.list(self.root + TAG_KEYS))
        records = live_tag_records(self.root, listed)
        markers = None if records_only else listed_markers(self.root, listed)
        return self.listed(records, reread=reread, markers=markers, on_corrupt=on_corrupt)


@dataclass(frozen=True)
class Refs:
    """Every live branch's head and every live tag of a repository, at one moment."""

    branches: dict[str, str]  # name -> head snapshot id, sorted by name
    tags: dict[str, str]  # name -> snapshot id, sorted by name


def read_refs(journal: BranchJournal, tags: Tags) -> Refs:
    """Every live branch and tag from one listing of the refs, reading only the head entries
    and tag records that the listing shows without their markers (:func:`trusted_marker`) and
    that this journal and these tags have not read as the listing shows them.

    For a process that polls many repositories (the operator): a repository whose refs fit in
    one listing page (1,000 keys on S3) costs one request when every ref has its marker or
    nothing moved, where :meth:`BranchJournal.heads` and :meth:`Tags.all` cost a listing each.
    The listing holds every retained journal entry, so long journals (compaction prunes them)
    cost more pages. A storage that cannot list answers through those two.
    """
    if journal.storage is not tags.storage or journal.root != tags.root:
        raise ValueError("read_refs needs the journal and the tags of one repository")
    storage = journal.storage
    root = None if journal.published is None else journal.published.read()
    if root is not None:
        return Refs(root.heads(), dict(sorted(root.tags.items())))
    if not storage.supports_listing:
        return Refs(journal.heads(), dict(sorted(tags.all().items())))
    asked = time.monotonic()
    listed = list(storage.list(journal.root + REFS_PREFIX))
    newest = newest_entries(journal.root, listed)
    markers = listed_markers(journal.root, listed)
    return Refs(
        journal.heads_listed(newest, asked, markers),
        tags.listed(live_tag_records(tags.root, listed), markers=markers),
    )


def live_tag_records(root: str, listed: Iterable[ObjectInfo]) -> dict[str, ObjectInfo]:
    """Name -> record of each tag among ``listed`` objects (keys with ``root``) that has no
    tombstone among them. Other keys (journal entries, the write probe) are left out."""
    records: dict[str, ObjectInfo] = {}
    deleted: set[str] = set()
    tags = root + TAG_KEYS
    for info in listed:
        if not info.key.startswith(tags):
            continue  # journal entries and head markers, most of a listing of the refs
        parsed = parse_ref_key(info.key[len(root) :])
        if parsed is None or parsed[0] == "branch":
            continue
        if parsed[0] == "tag":
            records[parsed[1]] = info
        else:
            deleted.add(parsed[1])
    return {name: info for name, info in records.items() if name not in deleted}


def newest_entries(root: str, listed: Iterable[ObjectInfo]) -> dict[str, ObjectInfo]:
    """The newest entry of each branch journal among ``listed`` objects (keys with ``root``):
    entry names are fixed-width in one folder, so the smallest key is the newest. Other keys
    (tags, the write probe) are left out."""
    newest: dict[str, ObjectInfo] = {}
    entries = root + BRANCH_KEYS
    folder, last = "", None  # the journal of the entry before, and its newest entry so far
    for info in listed:
        key = info.key
        if not key.startswith(entries):
            continue
        if last is not None and key >= last.key and key.startswith(folder):
            continue  # an older entry of the same journal (a listing shows them in a row)
        parsed = parse_ref_key(key[len(root) :])
        if parsed is None or parsed[0] != "branch":
            continue
        seen = newest.get(parsed[1])
        if seen is None or key < seen.key:
            newest[parsed[1]] = seen = info
        folder, last = key[: key.rindex("/") + 1], seen
    return newest


def marker_guard(repository_id: str | None) -> str | None:
    """The guard markers carry for this repository id, or None if it cannot guard them (an id
    of another shape, from a repository made before markers: its clients read every record)."""
    if repository_id is None or GUARD_ID.match(repository_id) is None:
        return None
    return repository_id


#: The marker thread of this process (its id, the executor), made on first use.
_MARKER_THREAD: tuple[int, ThreadPoolExecutor] | None = None
_MARKER_THREAD_LOCK = threading.Lock()


def _marker_thread() -> ThreadPoolExecutor:
    global _MARKER_THREAD
    with _MARKER_THREAD_LOCK:
        if _MARKER_THREAD is None or _MARKER_THREAD[0] != os.getpid():
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarrlake-markers")
            _MARKER_THREAD = (os.getpid(), pool)
        return _MARKER_THREAD[1]


#: Journals that may hold markers of earlier heads to delete: the rest of a batch is deleted
#: when the interpreter exits (after the marker thread has written what was queued), so a
#: short-lived writer (one CLI commit) leaves no marker behind for compaction.
_HOLDING_STALE_MARKERS: weakref.WeakSet[BranchJournal] = weakref.WeakSet()


def _delete_held_stale_markers() -> None:
    for journal in list(_HOLDING_STALE_MARKERS):
        stale, journal._stale = journal._stale, []
        if stale:
            write_marker(journal.storage, None, stale)


atexit.register(_delete_held_stale_markers)


def _after_fork_in_child() -> None:
    global _MARKER_THREAD, _MARKER_THREAD_LOCK
    _MARKER_THREAD = None  # the parent's thread is not in the child
    _MARKER_THREAD_LOCK = threading.Lock()  # it may have been held by a thread of the parent


os.register_at_fork(after_in_child=_after_fork_in_child)


def write_marker(
    storage: Storage,
    key: str | None,
    stale: Sequence[str] = (),
    since: float | None = None,
) -> None:
    """Write the empty marker ``key``, then delete the markers ``stale``. With ``since`` (the
    ``time.monotonic()`` of its entry's append), the marker is not written once
    :data:`MARKER_WRITE_WINDOW_S` have passed since. Never raises: a marker only saves readers a
    read, so one that cannot be written (an outage, a key too long for a file name) leaves them
    reading the entry, and one that cannot be deleted stays untrusted (its entry is not the
    newest) until compaction deletes it."""
    if since is not None and time.monotonic() - since > MARKER_WRITE_WINDOW_S:
        key = None
    try:
        if key is not None:
            storage.put(key, b"")
        if stale:
            storage.delete_many(stale)
    except Exception as e:  # any failure: readers fall back to reading (see above)
        log.debug("markers %s / %s not written or deleted: %s", key, list(stale), e)


def marker_disagreements(journal: BranchJournal, tags: Tags) -> list[tuple[str, str]]:
    """Markers a listing trusts that disagree with the head entry or tag record they name:
    (the marker's key, what is wrong), from one listing of the refs and a read of every such
    entry and record (fsck). A wrong marker (a forged one, or copied into place without its
    record) makes listings wrong until it is deleted; the records stay the truth."""
    storage = journal.storage
    if journal.guard is None or not storage.supports_listing:
        return []
    listed = list(storage.list(journal.root + REFS_PREFIX))
    markers = listed_markers(journal.root, listed)
    # (the marker, its listed object, the listed record it names)
    claims: list[tuple[Marker, ObjectInfo, ObjectInfo]] = []
    for name, info in newest_entries(journal.root, listed).items():
        marks = markers.get(("head", name), [])
        found = trusted_marker(marks, seq_from_entry_key(info.key), info, journal.guard)
        if found is not None:
            claims.append((*found, info))
    for name, info in live_tag_records(tags.root, listed).items():
        found = trusted_marker(markers.get(("tag", name), []), None, info, tags.guard)
        if found is not None:
            claims.append((*found, info))

    def actual(claim: tuple[Marker, ObjectInfo, ObjectInfo]) -> tuple[bool, str | None]:
        marker, _, info = claim
        try:
            if marker.kind == "head":
                return True, journal.read_entry(info.key).snapshot
            return True, TagRecord.decode(storage.get(info.key), info.key).snapshot
        except (ObjectNotFound, ZarrlakeError):
            return False, None  # gone meanwhile, or unreadable: fsck reports the record itself

    wrong = []
    for (marker, listed_as, info), (read, snapshot) in zip(
        claims, storage.map(actual, claims), strict=True
    ):
        if read and snapshot != marker.snapshot:
            wrong.append(
                (
                    listed_as.key,
                    f"names snapshot {marker.snapshot or '(a deletion)'}, but {info.key} holds "
                    f"{snapshot or '(a deletion)'}",
                )
            )
    return wrong


def listed_markers(root: str, listed: Iterable[ObjectInfo]) -> Markers:
    """The markers among ``listed`` objects (keys with ``root``), by ref."""
    markers: Markers = {}
    kinds = (root + HEAD_MARKER_KEYS, root + TAG_MARKER_KEYS)
    for info in listed:
        if not info.key.startswith(kinds):
            continue  # journal entries, tag records: most of a listing of the refs
        marker = parse_marker_key(info.key[len(root) :])
        if marker is not None:
            markers.setdefault((marker.kind, marker.name), []).append((marker, info))
    return markers


def trusted_marker(
    markers: list[tuple[Marker, ObjectInfo]],
    seq: int | None,
    record: ObjectInfo,
    guard: str | None,
) -> tuple[Marker, ObjectInfo] | None:
    """The marker, with its listed object, that says what ``record`` (a branch's newest entry
    ``seq``, or a tag's record: ``seq`` None) holds, among a ref's ``markers`` listed with it;
    None if a reader must read the record.

    Trusted only if exactly one marker names that entry, carries ``guard`` (this repository's
    id: never a deleted repository's, whose entry of the same number held something else) and
    was listed as written no earlier than the record (a marker is written after its record;
    one older than its record is not about it) and at most :data:`MARKER_LISTED_WINDOW` later.
    Two markers of one entry (one copied over the other) are read through."""
    if guard is None:
        return None
    latest = record.modified + MARKER_LISTED_WINDOW
    found = [
        (marker, info)
        for marker, info in markers
        if marker.seq == seq
        and marker.guard == guard
        and record.modified <= info.modified <= latest
    ]
    return found[0] if len(found) == 1 else None
