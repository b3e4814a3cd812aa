"""The repository's objects as values, and where each lives in the object store.

Everything here is pure: encoding and decoding between dataclasses and bytes. No I/O, no Zarr.
"""

from __future__ import annotations

import bisect
import datetime as dt
import hashlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias, TypeVar
from urllib.parse import quote, unquote

import msgpack

from zarrlake.errors import CorruptObject
from zarrlake.format.codec import (
    FORMAT_VERSION,
    ObjectType,
    array_header,
    decode,
    decode_body,
    encode,
    encode_body,
    encode_parts,
    gc_paused,
    map_header,
    pack_elements,
)
from zarrlake.format.ids import CONTENT_HASHES, LEGACY_CONTENT_HASH

_R = TypeVar("_R")

# -- object keys ---------------------------------------------------------------------------------

REPO_KEY = "repo"
#: A mirror's own objects live under this prefix, which a source repository never writes: its
#: marker (:data:`MIRROR_REPO_KEY`), its refs (``mirror/refs/``, written only by the promoter) and
#: its presence records (``mirror/present/``). Bucket replication copies a source's ``repo`` and
#: ``refs/`` into a mirror too; they are never read there.
MIRROR_PREFIX = "mirror/"
MIRROR_REPO_KEY = MIRROR_PREFIX + REPO_KEY
#: The object that checks an S3-compatible server's create-only writes before a client's first
#: write to the repository (``Storage.check_conditional_writes``): empty, written create-only
#: again by each such client. Beside the refs whose safety it checks; a mirror's promoter checks
#: its destination at ``mirror/`` + this key.
WRITE_PROBE_KEY = "refs/probe"
# Every key a repository writes is REPO_KEY or starts with one of these, and has the exact shape
# LAYOUT_KEY describes: deleting a repository removes exactly such keys, never other objects that
# share its bucket or prefix (not even a second repository nested under a layout prefix).
LAYOUT_PREFIXES = (
    "refs/",
    "snapshots/",
    "txlogs/",
    "manifests/",
    "chunks/",
    "packs/",
    "expired/",
    "history/",
    MIRROR_PREFIX,
)
_ID = "[0-9A-HJKMNP-TV-Z]{26}"
_HEX = "[0-9a-f]{64}"
_GUARD = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
LAYOUT_KEY = re.compile(
    rf"^(repo|root|mirror/root|(mirror/)?refs/probe-cas|chunks/[0-9a-f]{{2}}/{_HEX}|manifests/{_HEX}|packs/{_HEX}|history/{_HEX}"
    rf"|snapshots/{_ID}|txlogs/{_ID}|expired/{_ID}"
    r"|(mirror/)?refs/branch\.[^/]+/[0-9a-f]{16}|(mirror/)?refs/tag\.[^/]+|(mirror/)?refs/probe"
    rf"|refs/head\.[^/]+/[0-9a-f]{{16}}\.({_ID}|-)\.{_GUARD}|refs/tagid\.[^/]+\.{_ID}\.{_GUARD}"
    rf"|(mirror/)?refs/tagdel\.[^/]+|mirror/repo|mirror/present/{_ID}|mirror/lease/[0-9a-f]{{16}}"
    r"|refs/wait\.[^/]+/[0-9a-f]{16}\.[0-9a-f]{16}\.[0-9a-z]+)$"
)
SEQ_MAX = (1 << 64) - 1


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def pack_key(pack_id: str) -> str:
    return f"packs/{pack_id}"


def manifest_key(digest: str) -> str:
    return f"manifests/{digest}"


def history_page_key(digest: str) -> str:
    return f"history/{digest}"


def snapshot_key(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}"


def txlog_key(snapshot_id: str) -> str:
    return f"txlogs/{snapshot_id}"


def _ref_name(name: str) -> str:
    # '/' and '%' are the only characters that would break a key; everything else stays readable.
    return quote(name, safe=" !\"#$&'()*+,:;<=>?@[\\]^`{|}~-._")


def ref_name_from_key(part: str) -> str:
    return unquote(part)


def branch_prefix(name: str) -> str:
    return f"refs/branch.{_ref_name(name)}/"


def branch_entry_key(name: str, seq: int) -> str:
    """Journal entry ``seq`` of a branch; newer entries sort first (inverted, fixed-width hex)."""
    return branch_prefix(name) + f"{SEQ_MAX - seq:016x}"


def seq_from_entry_key(key: str) -> int:
    return SEQ_MAX - int(key.rsplit("/", 1)[1], 16)


def tag_key(name: str) -> str:
    return f"refs/tag.{_ref_name(name)}"


def expiry_key(run_id: str) -> str:
    return f"expired/{run_id}"


def wait_queue_prefix(name: str) -> str:
    """The advisory queue of optimistic writers waiting to commit to branch ``name``, oldest
    first (never read for safety: see ``zarrlake.commit.WaitQueue``)."""
    return f"refs/wait.{_ref_name(name)}/"


def tag_tombstone_key(name: str) -> str:
    return f"refs/tagdel.{_ref_name(name)}"


#: Where every ref lives: branch journals, tags and tag tombstones (and the write probe).
REFS_PREFIX = "refs/"
_REF_KEY = re.compile(r"^refs/(?:branch\.([^/]+)/([0-9a-f]{16})|(tag|tagdel)\.([^/]+))$")


def parse_ref_key(key: str) -> tuple[str, str, int | None] | None:
    """What a key under :data:`REFS_PREFIX` holds: ``("branch", name, seq)`` for a journal
    entry, ``("tag", name, None)`` for a tag, ``("tagdel", name, None)`` for a tag's tombstone;
    None for any other key (the write probe)."""
    m = _REF_KEY.match(key)
    if m is None:
        return None
    if m[1] is not None:
        return "branch", ref_name_from_key(m[1]), seq_from_entry_key(key)
    return m[3], ref_name_from_key(m[4]), None


# Markers: empty objects whose keys say what a ref's newest record holds, so that one listing of
# the refs answers "every branch head, every tag" without reading each record. A writer creates
# one only after its entry (or tag record) is known to be its own, so a marker never names what
# lost a race. ``guard`` is the repository id: a repository made anew at a location never trusts
# markers a deleted one left. Older clients never read these keys (parse_ref_key ignores them).
#   refs/head.<name>/<the entry's 16 hex digits>.<snapshot id, or "-" for a deletion>.<guard>
#   refs/tagid.<name>.<snapshot id>.<guard>
_MARKER_KEY = re.compile(
    rf"^refs/(?:head\.([^/]+)/([0-9a-f]{{16}})\.({_ID}|-)\.({_GUARD})"
    rf"|tagid\.([^/]+)\.({_ID})\.({_GUARD}))$"
)
#: Repository ids that can guard markers (those :func:`uuid.uuid4` makes, as ``str``).
GUARD_ID = re.compile(rf"^{_GUARD}$")


class Marker(NamedTuple):
    """A parsed marker key: ``kind`` is ``"head"`` (``seq`` set; ``snapshot`` None for a deleted
    branch) or ``"tag"`` (``seq`` None)."""

    kind: str
    name: str
    seq: int | None
    snapshot: str | None
    guard: str


def head_marker_prefix(name: str) -> str:
    return f"refs/head.{_ref_name(name)}/"


def head_marker_key(name: str, seq: int, snapshot: str | None, guard: str) -> str:
    """The marker of branch ``name``'s journal entry ``seq``, whose head is ``snapshot``."""
    return head_marker_prefix(name) + f"{SEQ_MAX - seq:016x}.{snapshot or '-'}.{guard}"


def tag_marker_key(name: str, snapshot: str, guard: str) -> str:
    """The marker of tag ``name``'s record, which points at ``snapshot``."""
    return f"refs/tagid.{_ref_name(name)}.{snapshot}.{guard}"


def parse_marker_key(key: str) -> Marker | None:
    """The marker a key under :data:`REFS_PREFIX` is, or None for any other key. Parsed from
    the right, so a tag named ``a.b`` is never taken for tag ``a``."""
    m = _MARKER_KEY.match(key)
    if m is None:
        return None
    if m[1] is not None:
        snapshot = None if m[3] == "-" else m[3]
        return Marker("head", ref_name_from_key(m[1]), SEQ_MAX - int(m[2], 16), snapshot, m[4])
    return Marker("tag", ref_name_from_key(m[5]), None, m[6], m[7])


# -- chunk references ----------------------------------------------------------------------------
# A chunk reference is a small tuple, because manifests hold millions of them:
#   (INLINE, data)                      the bytes themselves
#   (OBJECT, sha256 digest bytes, size) a content-addressed object chunks/<hh>/<hex>
#   (PACKED, pack id, offset, length, sha256 digest bytes)
#                                       a byte range of packs/<pack id>; the digest keeps the
#                                       chunk's identity, so packing is not a change of data
#   (VIRTUAL, url, offset, length, etag or None, last-modified µs or None)
#                                       a byte range of a file outside the repository (a NetCDF
#                                       or HDF5 file in someone's bucket): the etag and the time
#                                       pin the version of the file the ref was made from. In
#                                       a shard's encoding the url is an index into the shard's
#                                       table of urls (see :class:`ManifestShard`).
# ``offset`` and ``length`` are at the same places in PACKED and VIRTUAL refs (ref_size reads
# ``ref[3]`` of both).

INLINE, OBJECT, PACKED, VIRTUAL = 0, 1, 2, 3
ChunkRef: TypeAlias = tuple[Any, ...]


def virtual_ref(
    url: str, offset: int, length: int, etag: str | None, modified_us: int | None
) -> ChunkRef:
    """The chunk ref of ``length`` bytes at ``offset`` of the file at ``url``."""
    return (VIRTUAL, url, offset, length, etag, modified_us)


def is_virtual(ref: ChunkRef | None) -> bool:
    return ref is not None and ref[0] == VIRTUAL


def ref_identity(ref: ChunkRef | None) -> object:
    """What a ref means, not where it points: refs to the same bytes have equal identities."""
    if ref is None:
        return None
    if ref[0] == OBJECT:
        return ref[1]
    if ref[0] == PACKED and len(ref) > 4:
        return ref[4]
    return ref


def ref_size(ref: ChunkRef) -> int:
    if ref[0] == INLINE:
        return len(ref[1])
    if ref[0] == OBJECT:
        return int(ref[2])
    return int(ref[3])


def _ref_from_wire(item: Any) -> ChunkRef:
    return tuple(item)


# -- helpers ---------------------------------------------------------------------------------------


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICRO = dt.timedelta(microseconds=1)


def to_micros(when: dt.datetime) -> int:
    # Integer arithmetic: going through a float timestamp loses microseconds.
    if when.tzinfo is None:
        when = when.astimezone()  # naive means local time, as datetime.timestamp() has it
    return (when - _EPOCH) // _MICRO


#: Below this many microseconds after the epoch (2**33 s: the year 2242), ``us / 1e6`` is a float
#: within half a microsecond of the exact time, which ``fromtimestamp`` rounds away.
_FLOAT_EXACT_US = 2**33 * 10**6
_from_timestamp = dt.datetime.fromtimestamp


def from_micros(us: int) -> dt.datetime:
    # A page of history is a thousand of these: the float path builds one object, not two.
    if 0 <= us < _FLOAT_EXACT_US:
        return _from_timestamp(us / 1e6, dt.UTC)
    return _EPOCH + dt.timedelta(microseconds=us)


def _need(obj: Any, name: str, key: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise CorruptObject(key, f"missing field {name!r}")
    return obj[name]


# Decoders check the shape of what they read: a well-enveloped object with nonsense inside is
# corrupt, and must not surface later as a TypeError far from where it was read.


def _typed(value: Any, kind: type | tuple[type, ...], key: str, name: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CorruptObject(key, f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _opt(value: Any, kind: type, key: str, name: str) -> Any:
    return None if value is None else _typed(value, kind, key, name)


def _all_of(items: Sequence[Any], kind: type) -> bool:
    """Every item is exactly a ``kind`` (what msgpack decodes to): one pass in C over thousands
    of items, the set of their types."""
    return not set(map(type, items)).difference((kind,))


def _strs(value: Any, key: str, name: str) -> list[str]:
    _typed(value, list, key, name)
    if not _all_of(value, str):
        for item in value:
            _typed(item, str, key, name)  # names what is wrong
    strings: list[str] = value  # checked item by item above
    return strings


_DIGEST = re.compile(_HEX)


def _digest(value: Any, key: str, name: str) -> str:
    """A content digest (64 lowercase hex digits): what names objects, so never a path."""
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise CorruptObject(key, f"field {name!r} holds {value!r}, not a content digest")
    return value


def _digests(value: Any, key: str, name: str) -> list[str]:
    return [_digest(item, key, name) for item in _typed(value, list, key, name)]


def _time(value: Any, key: str, name: str) -> dt.datetime:
    try:
        return from_micros(_typed(value, int, key, name))
    except (OverflowError, ValueError):
        raise CorruptObject(key, f"field {name!r} is not a valid time ({value})") from None


# -- manifest shards -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """An entry of a snapshot's shard index: the key range a shard covers."""

    first: str
    last: str
    digest: str
    count: int


#: Entries per block of :class:`PackedEntries`.
PACK_BLOCK = 64


@dataclass(frozen=True, slots=True)
class PackedEntries:
    """A shard's entries packed into msgpack in blocks of consecutive entries, so that a shard
    that differs from this one in a few entries is encoded by re-packing only their blocks.

    Block ``b`` holds entries ``starts[b]`` up to ``starts[b + 1]`` (``starts[-1]``: how many in
    all); ``keys[b]`` and ``refs[b]`` are its keys' and refs' encodings (:func:`pack_elements`).
    Joined, the blocks are byte for byte what packing the whole lists writes.
    """

    starts: tuple[int, ...]
    keys: tuple[bytes, ...]
    refs: tuple[bytes, ...]

    @classmethod
    def of(cls, keys: list[str], refs: list[ChunkRef]) -> PackedEntries:
        """``keys``/``refs`` packed in blocks of :data:`PACK_BLOCK` entries."""
        starts = list(range(0, len(keys), PACK_BLOCK))
        return cls(
            (*starts, len(keys)),
            tuple(pack_elements(keys[s : s + PACK_BLOCK]) for s in starts),
            tuple(pack_elements(refs[s : s + PACK_BLOCK]) for s in starts),
        )

    def edited(
        self,
        starts: list[int],
        keys_changed: set[int],
        refs_changed: set[int],
        keys: list[str],
        refs: list[ChunkRef],
    ) -> PackedEntries:
        """The packing of ``keys``/``refs``: this one's entries after edits that moved the block
        bounds to ``starts`` and touched the keys of the blocks ``keys_changed`` (entries
        inserted or deleted there) and the refs of ``refs_changed``. Those are packed again, the
        other blocks reused; a block that grew past twice :data:`PACK_BLOCK` is cut again."""
        new_starts: list[int] = []
        kb: list[bytes] = []
        rb: list[bytes] = []
        for b in range(len(starts) - 1):
            s, e = starts[b], starts[b + 1]
            if s == e:
                continue  # every entry of the block deleted
            if b in keys_changed and e - s > 2 * PACK_BLOCK:
                for s2 in range(s, e, PACK_BLOCK):
                    e2 = min(e, s2 + PACK_BLOCK)
                    new_starts.append(s2)
                    kb.append(pack_elements(keys[s2:e2]))
                    rb.append(pack_elements(refs[s2:e2]))
                continue
            new_starts.append(s)
            kb.append(pack_elements(keys[s:e]) if b in keys_changed else self.keys[b])
            changed = b in refs_changed or b in keys_changed
            rb.append(pack_elements(refs[s:e]) if changed else self.refs[b])
        new_starts.append(starts[-1])
        return PackedEntries(tuple(new_starts), tuple(kb), tuple(rb))

    def body(self) -> bytes:
        """The msgpack of the shard's payload, ``{"k": keys, "r": refs}``."""
        n = array_header(self.starts[-1])
        return b"".join((b"\x82\xa1k", n, *self.keys, b"\xa1r", n, *self.refs))


@dataclass(slots=True)
class ManifestShard:
    """Sorted (chunk key, chunk ref) pairs for one contiguous key range.

    ``packed``: the entries' msgpack in blocks, kept with a shard this client built by changing
    a few entries of another, so that its next such change re-packs a block, not the whole
    shard. ``built_here``: this client encoded the shard (it was not read); a change to it is
    likely to be followed by another, so that change packs the result in blocks.
    """

    keys: list[str]
    refs: list[ChunkRef]
    packed: PackedEntries | None = field(default=None, compare=False, repr=False)
    built_here: bool = field(default=False, compare=False, repr=False)

    def encode(self) -> bytes:
        # A shard of virtual refs names each source file once, in a table ("u") its refs
        # index: a file's thousands of chunks do not repeat its URL, on disk or in memory.
        urls = _virtual_urls(self.refs)
        if urls:
            table = {u: i for i, u in enumerate(urls)}
            refs = [(VIRTUAL, table[r[1]], *r[2:]) if r[0] == VIRTUAL else r for r in self.refs]
            return encode(ObjectType.MANIFEST, {"k": self.keys, "r": refs, "u": urls})
        if self.packed is not None:
            if self.packed.starts[-1] != len(self.keys):
                raise AssertionError("a shard's packed entries do not match its entries")
            return encode_body(ObjectType.MANIFEST, self.packed.body())
        return encode(ObjectType.MANIFEST, {"k": self.keys, "r": self.refs})

    @classmethod
    def decode(cls, data: bytes, key: str = "<manifest>") -> ManifestShard:
        with gc_paused():
            return cls._decode(data, key)

    @classmethod
    def _decode(cls, data: bytes, key: str) -> ManifestShard:
        # Arrays as tuples: a ref is a tuple, and msgpack builds thousands of them in C instead
        # of lists that a loop here would turn into tuples (most of a 1-chunk commit's time in
        # a repository of a million chunks, whose shard is rarely cached).
        obj = decode(data, ObjectType.MANIFEST, key, use_list=False)
        keys, refs = _need(obj, "k", key), _need(obj, "r", key)
        # Shards hold thousands of entries: check their types in bulk, not field by field.
        if (
            not isinstance(keys, tuple)
            or not isinstance(refs, tuple)
            or not _all_of(keys, str)
            or not _all_of(refs, tuple)
        ):
            raise CorruptObject(key, "keys must be strings and refs arrays")
        if len(keys) != len(refs):
            raise CorruptObject(key, "keys and refs differ in length")
        urls = obj.get("u")
        if urls is not None:
            return cls(list(keys), _with_urls(refs, urls, key))
        return cls(list(keys), list(refs))

    def get(self, key: str) -> ChunkRef | None:
        """The ref stored for ``key``, or None (a binary search over the sorted keys)."""
        keys = self.keys
        j = bisect.bisect_left(keys, key)
        return self.refs[j] if j < len(keys) and keys[j] == key else None


def _virtual_urls(refs: list[ChunkRef]) -> list[str]:
    """The URLs virtual refs among ``refs`` name, each once, in order of first appearance (so
    that a shard's encoding, hence its digest, depends on its entries alone)."""
    if VIRTUAL not in {r[0] for r in refs}:
        return []
    return list(dict.fromkeys(r[1] for r in refs if r[0] == VIRTUAL))


def _with_urls(refs: Sequence[ChunkRef], urls: Any, key: str) -> list[ChunkRef]:
    """``refs`` as decoded, each virtual ref's URL index replaced by the URL (one shared
    ``str`` per file)."""
    if not isinstance(urls, tuple) or not _all_of(urls, str):
        raise CorruptObject(key, "the table of virtual chunk URLs must hold strings")
    out: list[ChunkRef] = []
    for r in refs:
        if r and r[0] == VIRTUAL:
            if len(r) != 6 or type(r[1]) is not int or not 0 <= r[1] < len(urls):
                raise CorruptObject(key, f"bad virtual chunk ref {r!r}")
            r = (VIRTUAL, urls[r[1]], *r[2:])
        out.append(r)
    return out


# -- snapshots -------------------------------------------------------------------------------------


class AncestorRecord(NamedTuple):
    """An ancestor's commit record, as a descendant snapshot carries it (id in ``ancestry``).

    A named tuple rather than a dataclass: a history page decodes a thousand of them for one
    ``log()``, and a tuple is built in one step."""

    parents: tuple[str, ...]
    time: dt.datetime
    author: str | None
    message: str
    metadata: dict[str, Any]


def _history(items: Any, ancestry: list[str], key: str) -> list[AncestorRecord]:
    if not isinstance(items, list) or len(items) > len(ancestry):
        raise CorruptObject(key, "history does not match ancestry")
    # A page holds up to ~1,000 records and log() decodes them all: the checks run inline on
    # exact types (what msgpack decodes to), the careful path below only names what is wrong.
    out: list[AncestorRecord] = []
    append, new, record = out.append, tuple.__new__, AncestorRecord
    for item in items:
        if type(item) is list and len(item) == 5:
            parents, us, author, message, metadata = item
            if (
                type(parents) is list
                and (
                    type(parents[0]) is str
                    if len(parents) == 1
                    else all(type(p) is str for p in parents)
                )
                and type(us) is int
                and (author is None or type(author) is str)
                and type(message) is str
                and type(metadata) is dict
            ):
                try:
                    when = from_micros(us)
                except OverflowError:
                    raise CorruptObject(key, f"history has an invalid time ({us})") from None
                append(new(record, (tuple(parents), when, author, message, metadata)))
                continue
        if not isinstance(item, list) or len(item) != 5:
            raise CorruptObject(key, f"bad history record {item!r}")
        parents, when, author, message, metadata = item
        out.append(
            AncestorRecord(
                tuple(_strs(parents, key, "history")),
                _time(when, key, "history"),
                _opt(author, str, key, "history"),
                _typed(message, str, key, "history"),
                _typed(metadata, dict, key, "history"),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class HistoryIndex:
    """Where a snapshot's older history is, so that ``log()`` need not walk snapshot by snapshot.

    ``unsealed``: how many of the snapshot's inline ``history`` records (its newest first-parent
    ancestors) are in no history page yet. ``pages``: digests of the newest sealed
    :class:`HistoryPage` objects of its history (at most ``WINDOW``), newest first; each page names
    the pages before it, so everything older is reachable too. A seal folds the newest page into
    the new one until they hold ``PAGE * FOLD`` records, so pages grow to 1,008 records and the
    history of 1,000 commits is one page, 64,000 commits one round of 16. It is an index, never
    the truth:
    a reader that misses a commit in it (a missing or corrupt page, history from before the index
    existed) reads the snapshots instead.
    """

    unsealed: int
    pages: tuple[str, ...]

    PAGE = 63  # records per page; a page is sealed from inline records, of which there are 64
    WINDOW = 16  # pages a snapshot names: one concurrent round lists 1,008 older commits
    FOLD = 16  # a seal folds the newest page in while the two hold at most PAGE * FOLD records


def _index(obj: dict[str, Any], history_len: int, key: str) -> HistoryIndex | None:
    if "hu" not in obj:
        return None
    unsealed = _typed(obj["hu"], int, key, "hu")
    pages = _strs(obj.get("hp") or [], key, "hp")
    if not 0 <= unsealed <= history_len or not all(_DIGEST.fullmatch(p) for p in pages):
        # An index that does not fit the records or names no object: not trusted, history is
        # walked (the snapshot itself stays readable).
        return None
    return HistoryIndex(unsealed, tuple(pages))


@dataclass(frozen=True, slots=True)
class HistoryPage:
    """Commit records of up to :attr:`HistoryIndex.PAGE` commits (a merge's page holds those of
    both lines), newest first, and the digests of the pages before them. Immutable and
    content-addressed (``history/<sha256>``); written in a commit's concurrent round."""

    ids: tuple[str, ...]
    records: tuple[AncestorRecord, ...]
    older: tuple[str, ...]

    def encode(self) -> bytes:
        return encode(
            ObjectType.HISTORY_PAGE,
            {
                "ids": list(self.ids),
                "records": [
                    [list(r.parents), to_micros(r.time), r.author, r.message, r.metadata]
                    for r in self.records
                ],
                "older": list(self.older),
            },
        )

    @classmethod
    def decode(cls, data: bytes, key: str = "<history page>") -> HistoryPage:
        with gc_paused():
            return cls._decode(data, key)

    @staticmethod
    def count(data: bytes) -> int:
        """How many records the encoded page ``data`` holds, read off its header without
        decoding them (0 if it is not a page that says)."""
        try:
            body = decode_body(data, ObjectType.HISTORY_PAGE)
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(body)
            if unpacker.read_map_header() and unpacker.unpack() == "ids":
                return int(unpacker.read_array_header())
        except Exception:  # garbage in, "says nothing" out
            pass
        return 0

    @staticmethod
    def decode_into(
        data: bytes, kind: type[_R], known: dict[str, _R], key: str = "<history page>"
    ) -> tuple[str, ...]:
        """Decode the page ``data`` straight into ``known`` (id -> a ``kind`` for each record not
        there already) and return the digests of its older pages.

        ``kind`` is a class whose instances take the attributes ``id``, ``parents``, ``message``,
        ``author``, ``time`` and ``metadata`` in their ``__dict__`` (a frozen dataclass of those
        fields), and, in the time's place, ``_us``, microseconds since the epoch, from which it
        makes the time when asked (:class:`zarrlake.types.CommitInfo`, within the range where
        that is exact): ``log()`` wants one of those per record and nothing else, so a record goes
        from msgpack's list to it in one step instead of through an :class:`AncestorRecord`
        (a third of a page's decoding time; ``tests/test_history_index.py`` holds the two paths
        to the same answer). Checks as :meth:`decode`; ``known`` is left as it was on error."""
        with gc_paused():
            obj = decode(data, ObjectType.HISTORY_PAGE, key)
            ids = _strs(_need(obj, "ids", key), key, "ids")
            items = _need(obj, "records", key)
            older = _digests(_need(obj, "older", key), key, "older")
            if not isinstance(items, list) or len(items) != len(ids):
                raise CorruptObject(key, "ids and records differ in length")
            found: dict[str, _R] = {}
            new, lo, hi = object.__new__, 0, _FLOAT_EXACT_US
            for sid, item in zip(ids, items, strict=True):
                if sid in known:
                    continue
                if type(item) is list and len(item) == 5:
                    parents, us, author, message, metadata = item
                    if (
                        type(parents) is list
                        and (
                            type(parents[0]) is str
                            if len(parents) == 1
                            else all(type(p) is str for p in parents)
                        )
                        and type(us) is int
                        and lo <= us < hi
                        and (author is None or type(author) is str)
                        and type(message) is str
                        and type(metadata) is dict
                    ):
                        info = new(kind)
                        d = info.__dict__
                        d["id"] = sid
                        d["parents"] = tuple(parents)
                        d["message"] = message
                        d["author"] = author
                        d["_us"] = us  # the time, made when first asked (CommitInfo)
                        d["metadata"] = metadata  # msgpack's own: no other holder
                        found[sid] = info
                        continue
                # The careful path: names what is wrong, or takes a time outside the fast range.
                (r,) = _history([item], [sid], key)
                info = new(kind)
                info.__dict__.update(
                    id=sid,
                    parents=r.parents,
                    message=r.message,
                    author=r.author,
                    time=r.time,
                    metadata=r.metadata,
                )
                found[sid] = info
            known.update(found)
            return tuple(older)

    @classmethod
    def _decode(cls, data: bytes, key: str) -> HistoryPage:
        obj = decode(data, ObjectType.HISTORY_PAGE, key)
        ids = _strs(_need(obj, "ids", key), key, "ids")
        records = _history(_need(obj, "records", key), ids, key)
        if len(records) != len(ids):
            raise CorruptObject(key, "ids and records differ in length")
        older = _digests(_need(obj, "older", key), key, "older")
        return cls(tuple(ids), tuple(records), tuple(older))


@dataclass(slots=True)
class Snapshot:
    """A commit: who, when, why, its parents, the Zarr metadata documents and the shard index."""

    id: str
    parents: tuple[str, ...]
    time: dt.datetime
    author: str | None
    message: str
    metadata: dict[str, Any]
    nodes: dict[str, bytes]  # Zarr metadata key ("a/b/zarr.json") -> document bytes
    shards: list[ShardInfo]
    # Up to ANCESTRY first-parent ancestors, newest first: lets log() fetch history in parallel.
    ancestry: list[str] = field(default_factory=list)
    # The commit records of the first len(history) of those ancestors (see AncestorRecord): log()
    # lists a page of history from one snapshot instead of fetching every commit in turn.
    history: list[AncestorRecord] = field(default_factory=list)
    # The history index (see HistoryIndex); None in snapshots written before it existed.
    index: HistoryIndex | None = None

    ANCESTRY = 64
    HISTORY_BYTES = 32 * 1024  # records are dropped from the end beyond this (long messages)

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "parents": list(self.parents),
            "time": to_micros(self.time),
            "author": self.author,
            "message": self.message,
            "metadata": self.metadata,
            "nodes": self.nodes,
            "shards": [[s.first, s.last, s.digest, s.count] for s in self.shards],
            "ancestry": self.ancestry,
            "history": [
                [list(h.parents), to_micros(h.time), h.author, h.message, h.metadata]
                for h in self.history
            ],
        }
        if self.index is not None:
            # New keys only: readers that predate the index ignore them.
            body["hu"] = self.index.unsealed
            body["hp"] = list(self.index.pages)
        return encode(ObjectType.SNAPSHOT, body)

    @classmethod
    def decode(cls, data: bytes, key: str = "<snapshot>") -> Snapshot:
        with gc_paused():
            return cls._decode(data, key)

    @classmethod
    def _decode(cls, data: bytes, key: str) -> Snapshot:
        obj = decode(data, ObjectType.SNAPSHOT, key)
        nodes = _typed(_need(obj, "nodes", key), dict, key, "nodes")
        for path, doc in nodes.items():
            _typed(path, str, key, "nodes")
            _typed(doc, bytes, key, "nodes")
        shards = []
        # A million chunks make an index of ~500 entries, read by every fresh client: the checks
        # run inline on exact types, the careful path below only names what is wrong.
        is_digest, info = _DIGEST.fullmatch, ShardInfo
        for s in _typed(_need(obj, "shards", key), list, key, "shards"):
            if type(s) is list and len(s) == 4:
                first, last, digest, count = s
                if (
                    type(first) is str
                    and type(last) is str
                    and type(digest) is str
                    and is_digest(digest)
                    and type(count) is int
                ):
                    shards.append(info(first, last, digest, count))
                    continue
            if not isinstance(s, list) or len(s) != 4:
                raise CorruptObject(key, f"bad shard index entry {s!r}")
            first, last = (_typed(x, str, key, "shards") for x in s[:2])
            digest = _digest(s[2], key, "shards")
            shards.append(ShardInfo(first, last, digest, _typed(s[3], int, key, "shards")))
        return cls(
            id=_typed(_need(obj, "id", key), str, key, "id"),
            parents=tuple(_strs(_need(obj, "parents", key), key, "parents")),
            time=_time(_need(obj, "time", key), key, "time"),
            author=_opt(obj.get("author"), str, key, "author"),
            message=_typed(obj.get("message", ""), str, key, "message"),
            metadata=_typed(obj.get("metadata") or {}, dict, key, "metadata"),
            nodes=nodes,
            shards=shards,
            ancestry=(ancestry := _strs(obj.get("ancestry") or [], key, "ancestry")),
            history=(history := _history(obj.get("history") or [], ancestry, key)),
            index=_index(obj, len(history), key),
        )

    @property
    def chunk_count(self) -> int:
        return sum(s.count for s in self.shards)


# -- transaction logs ----------------------------------------------------------------------------


@dataclass(slots=True)
class TxLog:
    """What one commit changed, relative to its first parent: the input of rebase and fast diff."""

    nodes: list[str]  # metadata keys set or deleted
    #: chunk keys set or deleted; any sequence (a large commit's are a view of its changes,
    #: encoded a block at a time rather than copied into a list)
    chunks: Sequence[str]
    deleted_prefixes: list[str]  # whole subtrees removed (arrays or groups deleted)
    resized: list[str]  # array paths whose shape or chunk grid changed
    # chunk keys whose bytes moved (compaction packed them) without changing: never a conflict
    relocated: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        payload = {
            "n": self.nodes,
            "c": self.chunks,
            "d": self.deleted_prefixes,
            "r": self.resized,
            "m": self.relocated,
        }
        if isinstance(self.chunks, list):
            return encode(ObjectType.TXLOG, payload)
        # The same bytes, packed a block of keys at a time: a map header, then each pair.
        parts = [map_header(len(payload))]
        for name, value in payload.items():
            parts.append(pack_elements([name]))
            if value is self.chunks:
                count = len(self.chunks)
                parts.append(array_header(count))
                keys = iter(self.chunks)
                while block := list(itertools.islice(keys, 8192)):
                    count -= len(block)
                    parts.append(pack_elements(block))
                if count:  # the header promised another number of keys: never write that
                    raise RuntimeError("the chunk keys changed while the txlog was encoded")
            else:
                parts.append(pack_elements([value]))
        return encode_parts(ObjectType.TXLOG, parts)

    @classmethod
    def decode(cls, data: bytes, key: str = "<txlog>") -> TxLog:
        obj = decode(data, ObjectType.TXLOG, key)
        return cls(
            _strs(_need(obj, "n", key), key, "n"),
            _strs(_need(obj, "c", key), key, "c"),
            _strs(_need(obj, "d", key), key, "d"),
            _strs(obj.get("r") or [], key, "r"),
            _strs(obj.get("m") or [], key, "m"),
        )


# -- refs ------------------------------------------------------------------------------------------


def _by(value: Any, key: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise CorruptObject(key, "by must map names to strings")
    return value


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One move of a branch. ``snapshot`` None marks the branch deleted.

    ``snapshot_data`` is the encoded snapshot object the entry points at, carried along (when it
    is small enough) so that reading a branch head costs one object read, not two. It is a copy:
    the snapshot object itself is always written too, and an entry without it is just as valid.

    ``token`` is the lock service's fencing token the entry was written under (None: written
    without the lock); ``fence``, the highest token of the entries before it, carried forward by
    every writer, so the head alone says what a new token must exceed (None in entries from
    before it was carried, and at the start of a journal).

    ``by``: who made the move, as a commit service recorded it (``identity`` its token names,
    ``role``, ``service`` and ``client`` versions); None where a client wrote the entry itself
    (its commit's ``author`` is then the only word, and a free one).

    ``snapshot_sha256``: of a snapshot too large to carry, the SHA-256 of its encoded bytes,
    which readers compare with what they read from ``snapshots/<id>`` (an object a writer
    with the immutable objects' credentials could overwrite where the provider cannot make it
    create-only). Written for every entry given ``snapshot_data`` too large to carry; None in
    entries that carry their snapshot, and in entries from before it was written.
    """

    seq: int
    snapshot: str | None
    previous: str | None
    time: dt.datetime
    writer: str
    token: int | None = None
    snapshot_data: bytes | None = field(default=None, compare=False, repr=False)
    fence: int | None = None
    by: dict[str, str] | None = field(default=None, compare=False)
    snapshot_sha256: str | None = field(default=None, compare=False)

    @property
    def highest_token(self) -> int | None:
        """The highest fencing token the journal holds up to this entry, as far as the entry
        says (its own token and the carried ``fence``)."""
        known = [t for t in (self.token, self.fence) if t is not None]
        return max(known) if known else None

    #: Snapshots larger than this (encoded) are not carried in the entry.
    CARRY_MAX_BYTES = 256 * 1024

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "seq": self.seq,
            "snapshot": self.snapshot,
            "previous": self.previous,
            "time": to_micros(self.time),
            "writer": self.writer,
            "token": self.token,
        }
        if self.fence is not None:
            body["fence"] = self.fence
        if self.snapshot_data is not None and len(self.snapshot_data) <= self.CARRY_MAX_BYTES:
            body["snap"] = self.snapshot_data
        elif self.snapshot_data is not None:
            body["snap256"] = hashlib.sha256(self.snapshot_data).hexdigest()
        elif self.snapshot_sha256 is not None:
            body["snap256"] = self.snapshot_sha256
        if self.by is not None:
            body["by"] = self.by
        return encode(ObjectType.BRANCH_ENTRY, body)

    @classmethod
    def decode(cls, data: bytes, key: str = "<journal entry>") -> JournalEntry:
        obj = decode(data, ObjectType.BRANCH_ENTRY, key)
        seq = _typed(_need(obj, "seq", key), int, key, "seq")
        if not 0 <= seq <= SEQ_MAX:
            raise CorruptObject(key, f"sequence number {seq} out of range")
        return cls(
            seq=seq,
            snapshot=_opt(obj.get("snapshot"), str, key, "snapshot"),
            previous=_opt(obj.get("previous"), str, key, "previous"),
            time=_time(_need(obj, "time", key), key, "time"),
            writer=_typed(_need(obj, "writer", key), str, key, "writer"),
            token=_opt(obj.get("token"), int, key, "token"),
            snapshot_data=_opt(obj.get("snap"), bytes, key, "snap"),
            fence=_opt(obj.get("fence"), int, key, "fence"),
            by=_by(obj.get("by"), key),
            snapshot_sha256=_sha256_hex(obj.get("snap256"), key),
        )


def _sha256_hex(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
        raise CorruptObject(key, "snap256 is not a SHA-256 digest")
    return value


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class TagRecord:
    snapshot: str
    time: dt.datetime

    def encode(self) -> bytes:
        return encode(ObjectType.TAG, {"snapshot": self.snapshot, "time": to_micros(self.time)})

    @classmethod
    def decode(cls, data: bytes, key: str = "<tag>") -> TagRecord:
        obj = decode(data, ObjectType.TAG, key)
        return cls(
            _typed(_need(obj, "snapshot", key), str, key, "snapshot"),
            _time(_need(obj, "time", key), key, "time"),
        )


@dataclass(frozen=True, slots=True)
class ExpiryRecord:
    """One expiry run: the snapshots it removed from history (GC deletes them later)."""

    time: dt.datetime
    snapshots: tuple[str, ...]

    def encode(self) -> bytes:
        return encode(
            ObjectType.EXPIRY, {"time": to_micros(self.time), "snapshots": list(self.snapshots)}
        )

    @classmethod
    def decode(cls, data: bytes, key: str = "<expiry>") -> ExpiryRecord:
        obj = decode(data, ObjectType.EXPIRY, key)
        snaps = _need(obj, "snapshots", key)
        if not isinstance(snaps, list) or not all(isinstance(x, str) for x in snaps):
            raise CorruptObject(key, "snapshots must be a list of ids")
        return cls(_time(_need(obj, "time", key), key, "time"), tuple(snaps))


def presence_key(record_id: str) -> str:
    return f"{MIRROR_PREFIX}present/{record_id}"


@dataclass(frozen=True, slots=True)
class PresenceRecord:
    """What a mirror's promoter found present at its destination in one pass (immutable, under
    ``mirror/present/``), so that a restarted promoter checks only objects it has not seen:
    ``keys`` of objects, ``shards``: digests of manifest shards whose every chunk and pack object
    is present too, ``snapshots``: ids of commits whose history (snapshot, txlog, ancestors) is
    present."""

    time: dt.datetime
    keys: tuple[str, ...]
    shards: tuple[str, ...] = ()
    snapshots: tuple[str, ...] = ()

    def encode(self) -> bytes:
        body = {
            "time": to_micros(self.time),
            "keys": list(self.keys),
            "shards": list(self.shards),
            "snapshots": list(self.snapshots),
        }
        return encode(ObjectType.MIRROR_PRESENCE, body)

    @classmethod
    def decode(cls, data: bytes, key: str = "<presence>") -> PresenceRecord:
        obj = decode(data, ObjectType.MIRROR_PRESENCE, key)
        return cls(
            _time(_need(obj, "time", key), key, "time"),
            tuple(_strs(_need(obj, "keys", key), key, "keys")),
            tuple(_digests(obj.get("shards") or [], key, "shards")),
            tuple(_strs(obj.get("snapshots") or [], key, "snapshots")),
        )


def lease_key(seq: int) -> str:
    return f"{MIRROR_PREFIX}lease/{seq:016x}"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One term of the lease of a mirror's promoter (``mirror/lease/<seq>``, written
    create-only): ``holder`` acts until ``expires``; it renews by writing term ``seq + 1``
    before then, and anyone may write that term once ``expires`` has passed."""

    seq: int
    holder: str
    expires: dt.datetime

    def encode(self) -> bytes:
        body = {"seq": self.seq, "holder": self.holder, "expires": to_micros(self.expires)}
        return encode(ObjectType.MIRROR_LEASE, body)

    @classmethod
    def decode(cls, data: bytes, key: str = "<lease>") -> LeaseRecord:
        obj = decode(data, ObjectType.MIRROR_LEASE, key)
        seq, holder = _need(obj, "seq", key), _need(obj, "holder", key)
        if not isinstance(seq, int) or seq < 0 or not isinstance(holder, str):
            raise CorruptObject(key, "a lease needs an integer seq and a holder")
        return cls(seq, holder, _time(_need(obj, "expires", key), key, "expires"))


#: Format features this version implements. A repository marker lists the features a client must
#: implement to write to it (``features``); one that lists a feature this version does not know
#: can still be read, but every write refuses with :class:`UnsupportedFormat`. A change that this
#: version would misread, not just miswrite, raises the marker's format version instead.
#:
#: ``content-hash``: chunk and pack objects are named by the hash the marker records
#: (``content_hash``), not always SHA-256.
#: :data:`PUBLISHED_ROOT`: every change of the refs is published to ``root`` by
#: compare-and-set after the journal decides it (:mod:`zarrlake.format.root`); readers read it.
PUBLISHED_ROOT = "published-root (zarrlake >= 0.2)"
#: :data:`VIRTUAL_CHUNKS`: the repository's config lists virtual chunk containers, so its
#: manifests may hold virtual refs (byte ranges of files outside it). A client that does not
#: know them would treat those chunks as missing and could rewrite or collect around them.
VIRTUAL_CHUNKS = "virtual-chunks (zarrlake >= 0.3)"
#: :data:`GOVERNANCE`: the marker records branch protection rules (``governance``). A client
#: that does not know them would commit past them: it must not write.
GOVERNANCE = "governance (zarrlake >= 0.4)"
KNOWN_FEATURES = frozenset({"content-hash", PUBLISHED_ROOT, VIRTUAL_CHUNKS, GOVERNANCE})


@dataclass(frozen=True, slots=True)
class RepoRecord:
    """The ``repo`` marker object: format version, identity and configuration.

    ``initialized``: the ``main`` branch was created before this marker was written, so wherever
    the marker is, ``main`` is too and opening needs no further check. Markers of repositories
    created the other way round (older versions) say False: opening one makes sure ``main``
    exists, completing a repository whose creator died before its first commit.

    ``content_hash``: the name of the hash that names the repository's chunk and pack objects
    (see :data:`zarrlake.format.ids.CONTENT_HASHES`); a marker without one means SHA-256.
    ``features``: format features a client must implement to write (see :data:`KNOWN_FEATURES`).
    ``mirror_of``: set in a mirror's marker (:data:`MIRROR_REPO_KEY`, never ``repo``): the URL
    of the source repository it mirrors; the id and content hash are the source's.

    A marker with either is written as format version 2, which clients from before these settings
    refuse to open (they would write SHA-256 chunks into the repository, and report its other
    chunks as corrupt); a SHA-256 marker without features stays version 1, readable by all.
    """

    id: str
    created: dt.datetime
    config: dict[str, Any]
    initialized: bool = False
    content_hash: str = LEGACY_CONTENT_HASH
    features: tuple[str, ...] = ()
    mirror_of: str | None = None
    #: Branch protection (:class:`zarrlake.rules.Protection`'s record form), with the feature
    #: :data:`GOVERNANCE`; None for a repository that never had rules.
    governance: dict[str, Any] | None = None

    @property
    def format_version(self) -> int:
        return 2 if self.content_hash != LEGACY_CONTENT_HASH or self.features else FORMAT_VERSION

    def write_blocker(self) -> str | None:
        """Why this version must not write to the repository (None if it may): a feature or a
        content hash it does not implement, which a newer version recorded."""
        unknown = [f for f in self.features if f not in KNOWN_FEATURES]
        if unknown:
            return f"it uses format feature(s) {', '.join(unknown)} this zarrlake does not know"
        if self.content_hash not in CONTENT_HASHES:
            return f"it names chunks with content hash {self.content_hash!r}, unknown here"
        return None

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "created": to_micros(self.created),
            "config": self.config,
        }
        if self.initialized:
            body["initialized"] = True
        version = self.format_version
        if version > FORMAT_VERSION:
            body["content_hash"] = self.content_hash
            body["features"] = list(self.features)
        if self.mirror_of is not None:
            body["mirror_of"] = self.mirror_of
        if self.governance is not None:
            body["governance"] = self.governance
        return encode(ObjectType.REPO, body, version)

    @classmethod
    def decode(cls, data: bytes, key: str = REPO_KEY) -> RepoRecord:
        obj = decode(data, ObjectType.REPO, key)
        return cls(
            _typed(_need(obj, "id", key), str, key, "id"),
            _time(_need(obj, "created", key), key, "created"),
            dict(_typed(obj.get("config") or {}, dict, key, "config")),
            _typed(obj.get("initialized", False), bool, key, "initialized"),
            _typed(obj.get("content_hash", LEGACY_CONTENT_HASH), str, key, "content_hash"),
            tuple(_strs(obj.get("features") or [], key, "features")),
            _opt(obj.get("mirror_of"), str, key, "mirror_of"),
            _opt(obj.get("governance"), dict, key, "governance"),
        )
