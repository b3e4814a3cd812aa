"""Manifest shards: the chunk index of a snapshot, split into bounded, content-addressed pieces.

A snapshot's manifest is the sorted sequence of (chunk key, chunk ref) pairs, cut into shards of at
most ``max_refs`` entries. The snapshot keeps only the shard index (first key, last key, digest,
count). A commit rewrites the shards its changes fall into — splitting a shard that grew past the
bound, absorbing a neighbour into one that shrank below a quarter of it — and reuses every other
shard by digest. So committing one chunk costs the same in a repository of a thousand chunks as in
one of ten million, and diffing two snapshots skips every shard they share.

These are pure functions over values; the caller passes ``load(ShardInfo) -> ManifestShard``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from zarrlake.format.changes import count_refs, sorted_changes
from zarrlake.format.ids import content_hash
from zarrlake.format.model import ChunkRef, ManifestShard, PackedEntries, ShardInfo, ref_identity

Loader = Callable[[ShardInfo], ManifestShard]

#: A character above every character Zarr keys use: ``prefix + _TOP`` bounds a prefix's key range.
_TOP = "\U0010ffff"


def prefix_matches(key: str, prefix: str) -> bool:
    """Whether ``key`` lies inside the subtree ``prefix`` ('' is everything)."""
    if not prefix:
        return True
    p = prefix.rstrip("/")
    return key == p or key.startswith(p + "/")


def _subtree_bounds(prefix: str) -> tuple[str, str]:
    p = prefix.rstrip("/")
    return (p, p + "/" + _TOP) if p else ("", _TOP)


def _first(info: ShardInfo) -> str:
    return info.first


def _shard_for(firsts: list[str], key: str) -> int:
    return max(0, bisect.bisect_right(firsts, key) - 1)


def shard_of(index: list[ShardInfo], key: str) -> ShardInfo | None:
    """The shard whose key range holds ``key``, or None (no shard can hold it)."""
    if not index:
        return None
    info = index[max(0, bisect.bisect_right(index, key, key=_first) - 1)]
    if key < info.first or key > info.last:
        return None
    return info


def lookup(index: list[ShardInfo], key: str, load: Loader) -> ChunkRef | None:
    """The ref stored for ``key``, or None."""
    info = shard_of(index, key)
    return None if info is None else load(info).get(key)


def shards_in_subtree(index: list[ShardInfo], prefix: str) -> list[ShardInfo]:
    lo, hi = _subtree_bounds(prefix)
    return [s for s in index if s.last >= lo and s.first <= hi]


def iter_subtree(
    index: list[ShardInfo], prefix: str, load: Loader
) -> Iterator[tuple[str, ChunkRef]]:
    """Every (key, ref) inside the subtree ``prefix``, in key order."""
    for info in shards_in_subtree(index, prefix):
        shard = load(info)
        for k, r in zip(shard.keys, shard.refs, strict=True):
            if prefix_matches(k, prefix):
                yield k, r


def iter_prefix(
    index: list[ShardInfo], prefix: str, load: Loader
) -> Iterator[tuple[str, ChunkRef]]:
    """Every (key, ref) whose key starts with the plain string ``prefix``, in key order."""
    hi = prefix + _TOP
    for info in index:
        if info.last < prefix or info.first > hi:
            continue
        shard = load(info)
        j = bisect.bisect_left(shard.keys, prefix)
        for k, r in zip(shard.keys[j:], shard.refs[j:], strict=True):
            if not k.startswith(prefix):
                break
            yield k, r


def first_at_or_after(index: list[ShardInfo], cursor: str, load: Loader) -> str | None:
    """The smallest key >= ``cursor``, or None."""
    if not index:
        return None
    i = max(0, bisect.bisect_right(index, cursor, key=_first) - 1)
    for info in index[i:]:
        if info.last < cursor:
            continue
        shard = load(info)
        j = bisect.bisect_left(shard.keys, cursor)
        if j < len(shard.keys):
            return shard.keys[j]
    return None


def child_names(index: list[ShardInfo], prefix: str, load: Loader) -> list[str]:
    """Distinct next path segments of keys under ``prefix`` (ending in '/' or empty), skipping
    over each child's subtree instead of reading every key in it."""
    names: dict[str, None] = {}
    cursor = prefix
    while True:
        key = first_at_or_after(index, cursor, load)
        if key is None or not key.startswith(prefix):
            return list(names)
        name, sep, _ = key[len(prefix) :].partition("/")
        names[name] = None
        cursor = prefix + name + "/" + _TOP if sep else key + "\0"


def iter_all(index: list[ShardInfo], load: Loader) -> Iterator[tuple[str, ChunkRef]]:
    for info in index:
        shard = load(info)
        yield from zip(shard.keys, shard.refs, strict=True)


@dataclass(slots=True)
class ManifestUpdate:
    """The result of applying changes: the new index and the shards that must be written.

    ``built`` holds the same new shards as values (digest -> shard), so that a writer can keep
    them at hand for its next commit without decoding what it just encoded.
    """

    index: list[ShardInfo]
    new_shards: dict[str, bytes]  # digest -> encoded shard
    built: dict[str, ManifestShard] = field(default_factory=dict)


#: Where a large change hands the shards it has cut (digest -> encoded), to be written before the
#: commit goes on, instead of holding them all until the end.
Sink = Callable[[dict[str, bytes]], None]


class _Built:
    """Shards cut so far: digest -> (shard, encoded). With a sink, every ``batch`` shards but
    the newest go to it and are forgotten: only the newest can still be merged with what follows
    (an undersized tail joins the shard before it)."""

    def __init__(self, sink: Sink | None = None, batch: int = 32) -> None:
        self.shards: dict[str, tuple[ManifestShard, bytes]] = {}
        self.sink = sink
        self.batch = batch

    def add(self, info: ShardInfo, shard: ManifestShard, data: bytes) -> None:
        self.shards[info.digest] = (shard, data)
        if self.sink is not None and len(self.shards) > self.batch:
            newest = info.digest
            self.sink({d: v[1] for d, v in self.shards.items() if d != newest})
            self.shards = {newest: self.shards[newest]}

    def update(self, index: list[ShardInfo], exclude: set[str] | None = None) -> ManifestUpdate:
        """The update to ``index`` with those built shards it names (and ``exclude`` does not)."""
        wanted = {s.digest for s in index} - (exclude or set())
        kept = {d: v for d, v in self.shards.items() if d in wanted}
        return ManifestUpdate(
            index, {d: v[1] for d, v in kept.items()}, {d: v[0] for d, v in kept.items()}
        )


def _build(
    keys: list[str], refs: list[ChunkRef], packed: PackedEntries | None = None
) -> tuple[ShardInfo, bytes, ManifestShard]:
    shard = ManifestShard(keys, refs, packed, built_here=True)
    data = shard.encode()
    return ShardInfo(keys[0], keys[-1], content_hash(data), len(keys)), data, shard


#: Up to this many changes in one shard are spliced into copies of its sorted lists; more are
#: merged through a dict and a sort.
SPLICE_MAX = 64


def _block_of(starts: list[int], j: int) -> int:
    """The block of :class:`PackedEntries` bounds ``starts`` that entry ``j`` falls in (or, at
    the end, is appended to)."""
    return min(bisect.bisect_right(starts, j), len(starts) - 1) - 1


def _changed(
    shard: ManifestShard, changes: list[tuple[str, ChunkRef | None]]
) -> tuple[list[str], list[ChunkRef], PackedEntries | None]:
    """The shard's sorted (keys, refs) with ``changes`` (sorted by key) applied, and their
    packing in blocks where the next change is likely to reuse it: re-packing the blocks the
    changes touch, if ``shard`` is packed; else packing them all, if this client built
    ``shard`` (a shard written to again and again); else None (the shard is packed whole)."""
    if len(changes) > SPLICE_MAX:
        merged = dict(zip(shard.keys, shard.refs, strict=True))
        for k, v in changes:
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        ks = sorted(merged)
        return ks, [merged[k] for k in ks], None
    ks, rs = list(shard.keys), list(shard.refs)
    old = shard.packed if shard.packed is not None and len(shard.packed.starts) > 1 else None
    starts = list(old.starts) if old is not None else []
    keys_changed: set[int] = set()
    refs_changed: set[int] = set()
    for k, v in changes:
        j = bisect.bisect_left(ks, k)
        present = j < len(ks) and ks[j] == k
        if v is None:
            if present:
                del ks[j]
                del rs[j]
                if old is not None:
                    b = _block_of(starts, j)
                    keys_changed.add(b)
                    for i in range(b + 1, len(starts)):
                        starts[i] -= 1
        elif present:
            rs[j] = v
            if old is not None:
                refs_changed.add(_block_of(starts, j))
        else:
            ks.insert(j, k)
            rs.insert(j, v)
            if old is not None:
                b = _block_of(starts, j)
                keys_changed.add(b)
                for i in range(b + 1, len(starts)):
                    starts[i] += 1
    if old is not None:
        return ks, rs, old.edited(starts, keys_changed, refs_changed, ks, rs)
    if shard.built_here or shard.packed is not None:
        return ks, rs, PackedEntries.of(ks, rs)
    return ks, rs, None


def _emit(
    keys: list[str],
    refs: list[ChunkRef],
    max_refs: int,
    out: list[ShardInfo],
    new: _Built,
    packed: PackedEntries | None = None,
) -> None:
    """Cut ``keys``/``refs`` into shards, appended to ``out`` and ``new``; ``packed``, their
    packing (:class:`PackedEntries`), is used if they make one shard."""
    if not keys:
        return
    # Balanced pieces (sizes differ by at most one): cutting max_refs-sized pieces could leave a
    # tiny last one, and with more than one piece each holds more than max_refs / 2.
    sizes = balanced_sizes(len(keys), max_refs)
    if len(sizes) == 1:
        # One shard of them all: it takes the lists themselves (callers hand over lists they
        # no longer change) rather than copies.
        info, data, shard = _build(keys, refs, packed)
        out.append(info)
        new.add(info, shard, data)
        return
    start = 0
    for size in sizes:
        end = start + size
        info, data, shard = _build(keys[start:end], refs[start:end])
        out.append(info)
        new.add(info, shard, data)
        start = end


def _emit_walk(
    items: Iterator[tuple[str, ChunkRef]],
    total: int,
    max_refs: int,
    out: list[ShardInfo],
    new: _Built,
) -> None:
    """:func:`_emit` of the ``total`` sorted (key, ref) pairs ``items`` yields, cut as they come:
    the same shards, without holding them all."""
    for size in balanced_sizes(total, max_refs):
        piece = list(itertools.islice(items, size))
        if len(piece) != size:
            raise RuntimeError("the changes changed while a commit was cutting them")
        keys = [k for k, _ in piece]
        refs = [r for _, r in piece]
        del piece
        info, data, shard = _build(keys, refs)
        out.append(info)
        new.add(info, shard, data)
    if next(items, None) is not None:
        raise RuntimeError("the changes changed while a commit was cutting them")


class _Lookahead:
    """Sorted (key, value) pairs, taken in consecutive key ranges."""

    def __init__(self, items: Iterable[tuple[str, ChunkRef | None]]) -> None:
        self._items = iter(items)
        self._next = next(self._items, None)

    def take_below(self, bound: str | None) -> list[tuple[str, ChunkRef | None]]:
        """The pairs before ``bound`` (all that are left, for None) not taken yet."""
        taken = []
        while self._next is not None and (bound is None or self._next[0] < bound):
            taken.append(self._next)
            self._next = next(self._items, None)
        return taken


def apply_changes(
    index: list[ShardInfo],
    changes: Mapping[str, ChunkRef | None],
    deleted_prefixes: Iterable[str],
    load: Loader,
    max_refs: int,
    *,
    sink: Sink | None = None,
    sink_batch: int = 32,
) -> ManifestUpdate:
    """Apply chunk sets (ref) and deletes (None), after removing whole subtrees.

    ``deleted_prefixes`` act first: a key both under a deleted prefix and in ``changes`` ends up
    with its value from ``changes`` (the changeset records writes made after the delete).
    Only shards touched by the changes are loaded and rewritten. With ``sink``, new shards are
    handed to it in batches of ``sink_batch`` as they are cut (they are in the new index and not
    in the update's ``new_shards``), so a change of millions of refs never holds all its encoded
    shards at once.
    """
    if max_refs < 4:
        raise ValueError("max_refs must be at least 4")
    min_refs = max(1, max_refs // 4)
    deleted = [p.rstrip("/") for p in deleted_prefixes]
    firsts = [s.first for s in index]
    new = _Built(sink, sink_batch)
    # The changes are walked once, in key order, next to the shards they fall in: nothing of the
    # change's size is built (a first commit may carry millions of refs).
    if not index:
        live = ((k, v) for k, v in sorted_changes(changes) if v is not None)
        first: list[ShardInfo] = []
        _emit_walk(live, count_refs(changes), max_refs, first, new)
        return new.update(first)

    # The shards the changes fall in; a deleted subtree drops the others it covers unread.
    touched: set[int] = set()
    if deleted:
        touched = {_shard_for(firsts, key) for key in changes}
    dropped: set[int] = set()
    for p in deleted:
        lo, hi = _subtree_bounds(p)
        for i, s in enumerate(index):
            if s.last >= lo and s.first <= hi:
                # Only keys below "p/" form a contiguous range: "p" itself and "p/..." do not
                # ("p-x" sorts between them), so a shard starting at "p" must be read.
                inside = not p or (s.first.startswith(p + "/") and s.last.startswith(p + "/"))
                if inside and i not in touched:
                    dropped.add(i)  # wholly inside the deleted subtree: no need to read it
                else:
                    touched.add(i)

    walk = _Lookahead(sorted_changes(changes))
    out: list[ShardInfo] = []
    pend_keys: list[str] = []
    pend_refs: list[ChunkRef] = []
    # The packing of the pending entries, while they are those of one changed shard.
    pend_packed: PackedEntries | None = None
    for i, info in enumerate(index):
        mine = walk.take_below(firsts[i + 1] if i + 1 < len(index) else None)
        if i in dropped:
            assert not mine, "a shard with changes is never dropped unread"
            continue
        if not mine and i not in touched and not pend_keys:
            out.append(info)
            continue
        shard = load(info)
        if mine or i in touched:
            if deleted:
                kept = [
                    j
                    for j, k in enumerate(shard.keys)
                    if not any(prefix_matches(k, p) for p in deleted)
                ]
                shard = ManifestShard([shard.keys[j] for j in kept], [shard.refs[j] for j in kept])
            ks, rs, packed = _changed(shard, mine)
            if pend_keys:
                pend_packed = None
                pend_keys.extend(ks)
                pend_refs.extend(rs)
            else:  # the lists _changed made are ours: no copy
                pend_keys, pend_refs, pend_packed = ks, rs, packed
        else:
            pend_packed = None
            pend_keys.extend(shard.keys)
            pend_refs.extend(shard.refs)
        if len(pend_keys) >= min_refs:
            _emit(pend_keys, pend_refs, max_refs, out, new, pend_packed)
            pend_keys, pend_refs, pend_packed = [], [], None
    if pend_keys:
        if out:
            # An undersized tail joins the shard before it (and _emit splits them evenly if
            # together they exceed the bound).
            prev = out.pop()
            # Forgotten now, or a sink could be handed a shard the new index no longer names.
            built = new.shards.pop(prev.digest, None)
            shard = load(prev) if built is None else built[0]
            pend_keys = shard.keys + pend_keys
            pend_refs = shard.refs + pend_refs
            pend_packed = None
        _emit(pend_keys, pend_refs, max_refs, out, new, pend_packed)
    return new.update(out)


def diff_entries(
    a: list[ShardInfo], b: list[ShardInfo], load: Loader
) -> Iterator[tuple[str, ChunkRef | None, ChunkRef | None]]:
    """Keys whose refs differ between two manifests: (key, ref in a, ref in b).

    Shards present in both (same digest) hold the same keys with the same refs and — because every
    key lives in exactly one shard of a manifest — no key of theirs can differ, so they are skipped
    without being read: the cost is proportional to the difference.
    """
    common = {s.digest for s in a} & {s.digest for s in b}
    left: dict[str, ChunkRef] = {}
    for info in a:
        if info.digest not in common:
            shard = load(info)
            left.update(zip(shard.keys, shard.refs, strict=True))
    right: dict[str, ChunkRef] = {}
    for info in b:
        if info.digest not in common:
            shard = load(info)
            right.update(zip(shard.keys, shard.refs, strict=True))
    for key in sorted(left.keys() | right.keys()):
        ra, rb = left.get(key), right.get(key)
        if ra != rb and ref_identity(ra) != ref_identity(rb):
            yield key, ra, rb


def balanced_sizes(total: int, max_refs: int) -> list[int]:
    """The sizes of the shards a re-cut of ``total`` refs makes: as few as hold ``max_refs`` each,
    differing by at most one (what :func:`rebuild` cuts)."""
    if total <= 0:
        return []
    pieces = -(-total // max_refs)
    size, extra = divmod(total, pieces)
    return [size + (p < extra) for p in range(pieces)]


def cut(
    keys: list[str], refs: list[ChunkRef], sizes: Iterable[int]
) -> tuple[list[ShardInfo], dict[str, bytes]]:
    """Cut sorted ``keys``/``refs`` into consecutive shards of ``sizes``: their index entries and
    their encodings (digest -> bytes). A slice of a larger manifest cut this way, with sizes from
    :func:`balanced_sizes` of the whole, gives the very shards the whole would."""
    out: list[ShardInfo] = []
    encoded: dict[str, bytes] = {}
    start = 0
    for size in sizes:
        info, data, _ = _build(keys[start : start + size], refs[start : start + size])
        out.append(info)
        encoded[info.digest] = data
        start += size
    if start != len(keys):
        raise ValueError(f"sizes add up to {start}, not to the {len(keys)} refs given")
    return out, encoded


def rebuild(index: list[ShardInfo], load: Loader, max_refs: int) -> ManifestUpdate:
    """Re-cut a whole manifest into evenly filled shards (compaction's shard merge)."""
    keys: list[str] = []
    refs: list[ChunkRef] = []
    for info in index:
        shard = load(info)
        keys.extend(shard.keys)
        refs.extend(shard.refs)
    out: list[ShardInfo] = []
    new = _Built()
    _emit(keys, refs, max_refs, out, new)
    return new.update(out, exclude={s.digest for s in index})
