"""The repository's objects as values, and where each lives in the object store.

Everything here is pure: encoding and decoding between dataclasses and bytes. No I/O, no Zarr.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from zarrlake.errors import CorruptObject
from zarrlake.format.codec import ObjectType, decode, encode

# -- object keys ---------------------------------------------------------------------------------

REPO_KEY = "repo"
SEQ_MAX = (1 << 64) - 1


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def pack_key(pack_id: str) -> str:
    return f"packs/{pack_id}"


def manifest_key(digest: str) -> str:
    return f"manifests/{digest}"


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


def tag_tombstone_key(name: str) -> str:
    return f"refs/tagdel.{_ref_name(name)}"


# -- chunk references ----------------------------------------------------------------------------
# A chunk reference is a small tuple, because manifests hold millions of them:
#   (INLINE, data)                      the bytes themselves
#   (OBJECT, sha256 digest bytes, size) a content-addressed object chunks/<hh>/<hex>
#   (PACKED, pack id, offset, length)   a byte range of packs/<pack id>

INLINE, OBJECT, PACKED = 0, 1, 2
ChunkRef = tuple


def ref_size(ref: ChunkRef) -> int:
    if ref[0] == INLINE:
        return len(ref[1])
    if ref[0] == OBJECT:
        return int(ref[2])
    return int(ref[3])


def _ref_from_wire(item: Any) -> ChunkRef:
    return tuple(item)


# -- helpers ---------------------------------------------------------------------------------------


def to_micros(when: dt.datetime) -> int:
    return int(when.timestamp() * 1_000_000)


def from_micros(us: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(us / 1_000_000, dt.UTC)


def _need(obj: Any, name: str, key: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise CorruptObject(key, f"missing field {name!r}")
    return obj[name]


# -- manifest shards -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """An entry of a snapshot's shard index: the key range a shard covers."""

    first: str
    last: str
    digest: str
    count: int


@dataclass(slots=True)
class ManifestShard:
    """Sorted (chunk key, chunk ref) pairs for one contiguous key range."""

    keys: list[str]
    refs: list[ChunkRef]

    def encode(self) -> bytes:
        return encode(ObjectType.MANIFEST, {"k": self.keys, "r": self.refs})

    @classmethod
    def decode(cls, data: bytes, key: str = "<manifest>") -> ManifestShard:
        obj = decode(data, ObjectType.MANIFEST, key)
        keys, refs = _need(obj, "k", key), _need(obj, "r", key)
        if not isinstance(keys, list) or not isinstance(refs, list) or len(keys) != len(refs):
            raise CorruptObject(key, "keys and refs differ in length")
        return cls(keys, [tuple(r) for r in refs])


# -- snapshots -------------------------------------------------------------------------------------


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

    ANCESTRY = 64

    def encode(self) -> bytes:
        return encode(
            ObjectType.SNAPSHOT,
            {
                "id": self.id,
                "parents": list(self.parents),
                "time": to_micros(self.time),
                "author": self.author,
                "message": self.message,
                "metadata": self.metadata,
                "nodes": self.nodes,
                "shards": [[s.first, s.last, s.digest, s.count] for s in self.shards],
                "ancestry": self.ancestry,
            },
        )

    @classmethod
    def decode(cls, data: bytes, key: str = "<snapshot>") -> Snapshot:
        obj = decode(data, ObjectType.SNAPSHOT, key)
        try:
            return cls(
                id=_need(obj, "id", key),
                parents=tuple(_need(obj, "parents", key)),
                time=from_micros(_need(obj, "time", key)),
                author=obj.get("author"),
                message=obj.get("message", ""),
                metadata=obj.get("metadata") or {},
                nodes=dict(_need(obj, "nodes", key)),
                shards=[ShardInfo(*s) for s in _need(obj, "shards", key)],
                ancestry=list(obj.get("ancestry") or []),
            )
        except (TypeError, ValueError) as e:
            raise CorruptObject(key, str(e)) from None

    @property
    def chunk_count(self) -> int:
        return sum(s.count for s in self.shards)


# -- transaction logs ----------------------------------------------------------------------------


@dataclass(slots=True)
class TxLog:
    """What one commit changed, relative to its first parent: the input of rebase and fast diff."""

    nodes: list[str]  # metadata keys set or deleted
    chunks: list[str]  # chunk keys set or deleted
    deleted_prefixes: list[str]  # whole subtrees removed (arrays or groups deleted)
    resized: list[str]  # array paths whose shape or chunk grid changed

    def encode(self) -> bytes:
        return encode(
            ObjectType.TXLOG,
            {"n": self.nodes, "c": self.chunks, "d": self.deleted_prefixes, "r": self.resized},
        )

    @classmethod
    def decode(cls, data: bytes, key: str = "<txlog>") -> TxLog:
        obj = decode(data, ObjectType.TXLOG, key)
        return cls(
            list(_need(obj, "n", key)),
            list(_need(obj, "c", key)),
            list(_need(obj, "d", key)),
            list(obj.get("r") or []),
        )


# -- refs -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One move of a branch. ``snapshot`` None marks the branch deleted."""

    seq: int
    snapshot: str | None
    previous: str | None
    time: dt.datetime
    writer: str
    token: int | None = None

    def encode(self) -> bytes:
        return encode(
            ObjectType.BRANCH_ENTRY,
            {
                "seq": self.seq,
                "snapshot": self.snapshot,
                "previous": self.previous,
                "time": to_micros(self.time),
                "writer": self.writer,
                "token": self.token,
            },
        )

    @classmethod
    def decode(cls, data: bytes, key: str = "<journal entry>") -> JournalEntry:
        obj = decode(data, ObjectType.BRANCH_ENTRY, key)
        return cls(
            seq=int(_need(obj, "seq", key)),
            snapshot=obj.get("snapshot"),
            previous=obj.get("previous"),
            time=from_micros(_need(obj, "time", key)),
            writer=str(_need(obj, "writer", key)),
            token=obj.get("token"),
        )


@dataclass(frozen=True, slots=True)
class TagRecord:
    snapshot: str
    time: dt.datetime

    def encode(self) -> bytes:
        return encode(ObjectType.TAG, {"snapshot": self.snapshot, "time": to_micros(self.time)})

    @classmethod
    def decode(cls, data: bytes, key: str = "<tag>") -> TagRecord:
        obj = decode(data, ObjectType.TAG, key)
        return cls(_need(obj, "snapshot", key), from_micros(_need(obj, "time", key)))


@dataclass(frozen=True, slots=True)
class RepoRecord:
    """The ``repo`` marker object: format version, identity and configuration."""

    id: str
    created: dt.datetime
    config: dict[str, Any]

    def encode(self) -> bytes:
        return encode(
            ObjectType.REPO, {"id": self.id, "created": to_micros(self.created), "config": self.config}
        )

    @classmethod
    def decode(cls, data: bytes, key: str = REPO_KEY) -> RepoRecord:
        obj = decode(data, ObjectType.REPO, key)
        return cls(
            str(_need(obj, "id", key)),
            from_micros(_need(obj, "created", key)),
            dict(obj.get("config") or {}),
        )
