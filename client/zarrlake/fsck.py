"""Consistency check: is everything reachable from the refs present and well-formed?

Walks every branch journal and tag, every snapshot reachable from them, and checks that each
snapshot, txlog, manifest shard (digest included), history page (digest included) and chunk object
or pack range exists and parses. A missing or corrupt history page loses nothing (``log()`` reads
the snapshots instead) but is reported, as any damaged object is. It reads a random sample of the
chunks (``sample``, :data:`SAMPLE` by default: each chunk read whole, pack ranges alone) and checks
their bytes against their digests; with ``verify_content``, it reads every chunk object and pack and
checks every chunk in them, with the content hash the repository's marker records.
Problems are reported precisely (which object, what is wrong), never raised one at a time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zarrlake.core import RepositoryCore, rebuild_root
from zarrlake.errors import (
    CorruptChunk,
    CorruptObject,
    ObjectNotFound,
    RefNotFound,
    UnsupportedFormat,
    VirtualChunkError,
    VirtualContainerNotAllowed,
    VirtualSourceChanged,
)
from zarrlake.format.ids import CONTENT_HASHES
from zarrlake.format.model import (
    INLINE,
    OBJECT,
    PACKED,
    REPO_KEY,
    VIRTUAL,
    ChunkRef,
    RepoRecord,
    chunk_key,
    history_page_key,
    pack_key,
    snapshot_key,
    txlog_key,
)
from zarrlake.format.root import RootRecord
from zarrlake.history import index_pages
from zarrlake.objects import ObjectStore
from zarrlake.refs import marker_disagreements
from zarrlake.rules import Protection
from zarrlake.sources import SourceRange, VirtualSources


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one object."""

    # missing | corrupt | unsupported | dangling-ref | virtual-missing | virtual-changed |
    # virtual-not-allowed (the key of a virtual-* problem is the source's URL); notes: unpublished
    kind: str
    key: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.key}: {self.detail}"


@dataclass(frozen=True)
class FsckReport:
    """Every problem found, and how many refs, snapshots, shards and chunk objects were checked;
    ``verified``: how many chunks' bytes were read and checked against their digests."""

    problems: list[Problem] = field(default_factory=list)
    refs: int = 0
    snapshots: int = 0
    shards: int = 0
    chunks: int = 0
    verified: int = 0
    #: Objects ``repair`` rewrote (the published root, brought up to the journals).
    repaired: tuple[str, ...] = ()
    #: With ``virtual``: how many virtual chunk sources (files outside the repository, each
    #: version a ref pins counted once) were checked.
    virtual_sources: int = 0
    #: What is not wrong but worth knowing: a published root behind its journals
    #: (``unpublished``: a writer between its two writes, or one that died there; the next
    #: publish on the branch, or ``repair``, carries it). ``ok`` does not count them.
    notes: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line for people."""
        checked = (
            f"{self.refs} ref(s), {self.snapshots} snapshot(s), {self.shards} shard(s), "
            f"{self.chunks} chunk object(s), the content of {self.verified} chunk(s)"
            + (f", {self.virtual_sources} virtual source(s)" if self.virtual_sources else "")
        )
        if self.ok:
            return f"ok: checked {checked}"
        return f"{len(self.problems)} problem(s) in {checked}"

    def to_json(self) -> dict[str, Any]:
        """The report form of ``zarrlake fsck --json``."""
        return {
            "ok": self.ok,
            "checked": {
                "refs": self.refs,
                "snapshots": self.snapshots,
                "shards": self.shards,
                "chunks": self.chunks,
                "verified": self.verified,
                "virtual_sources": self.virtual_sources,
            },
            "problems": [{"kind": p.kind, "key": p.key, "detail": p.detail} for p in self.problems],
            "repaired": list(self.repaired),
            "notes": [{"kind": p.kind, "key": p.key, "detail": p.detail} for p in self.notes],
        }


#: How many chunks a plain fsck reads and checks against their digests, chosen at random
#: among all the chunk objects and packed chunks it finds (a different sample each run).
SAMPLE = 100


def fsck(
    core: RepositoryCore,
    *,
    check_chunks: bool = True,
    verify_content: bool = False,
    sample: int = SAMPLE,
    repair: bool = False,
    virtual: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> FsckReport:
    """Check the repository (see the module docstring); ``check_chunks=False`` skips chunks,
    ``verify_content=True`` reads every chunk and checks its bytes against its name, ``sample``
    is how many chunks are read and checked without it (0: none). ``repair``: publish the
    journals' heads, tags and expiry records to a published root that is missing, damaged or
    behind them (the problems are still reported; ``repaired`` names what was rewritten).
    ``virtual``: check the source of every virtual chunk ref (:func:`check_virtual_sources`),
    calling ``progress(done, total)`` as sources are checked.

    Never raises for what it finds: every problem is in the report (storage errors propagate).
    """
    problems: list[Problem] = []
    refs = snapshots = shards = chunks = 0
    storage = core.storage
    # A fresh object store: the repository's caches may still hold objects that are gone.
    objects = ObjectStore(storage, core.record.content_hash)
    # Every chunk ref in an object the content check reads: chunk objects and pack ranges.
    content_refs: dict[str, set[ChunkRef]] = {}
    # Without it, a uniform sample of them (reservoir sampling: one pass, ``sample`` refs kept).
    sampled: list[tuple[str, ChunkRef]] = []
    offered = verified = 0
    rng = random.Random()

    def problem(kind: str, key: str, detail: str | Exception) -> None:
        if isinstance(detail, CorruptObject) and detail.key == key:
            detail = detail.reason  # its message names the key too: once is enough
        problems.append(Problem(kind, key, str(detail)))

    # Roots: every branch head and live tag, and older journal entries (as_of reads them)
    # unless expiry took their snapshot out of history. Parents stop at expired snapshots too.
    expired = core.expiry.expired(refresh=True)
    roots: list[str] = []
    for name in core.journal.names():
        for i, key in enumerate(core.journal.entry_keys(name)):
            refs += 1
            try:
                entry = core.journal.read_entry(key)
            except (CorruptObject, UnsupportedFormat) as e:
                problem("corrupt", key, e)
                continue
            if entry.snapshot is not None and (i == 0 or entry.snapshot not in expired):
                roots.append(entry.snapshot)
    # Each bad record named by its key; the good ones checked all the same.
    tags = core.tags.all(reread=True, on_corrupt=lambda key, e: problem("corrupt", key, e))
    refs += len(tags)
    roots.extend(tags.values())
    # Markers (what a listing of the refs believes) that disagree with what they name.
    for key, detail in marker_disagreements(core.journal, core.tags):
        problem("corrupt", key, detail)

    # A mirror holds the data (shards, chunks) of the snapshots its refs have pointed at, and
    # only the history (snapshot objects, txlogs, pages) of the commits it skipped.
    data_roots = set(roots) if core.is_mirror else None
    seen: set[str] = set()
    page_roots: list[str] = []
    shard_seen: set[str] = set()
    chunk_refs: dict[str, int] = {}  # object key -> minimum size the refs need
    # (url, etag, modified µs) -> how far into the source the refs reach, and how many there are
    virtual_refs: dict[tuple[str, str | None, int | None], list[int]] = {}
    stack = list(dict.fromkeys(roots))
    while stack:
        sid = stack.pop()
        if sid in seen:
            continue
        seen.add(sid)
        try:
            snap = objects.snapshot(sid)
        except RefNotFound:
            problem(
                "missing", snapshot_key(sid), "snapshot referenced by a ref or a child is absent"
            )
            continue
        except (CorruptObject, UnsupportedFormat) as e:
            problem("corrupt", snapshot_key(sid), e)
            continue
        snapshots += 1
        if snap.index is not None:
            page_roots.extend(snap.index.pages)
        try:
            objects.txlog(sid)
        except RefNotFound:
            problem("missing", txlog_key(sid), "transaction log is absent")
        except (CorruptObject, UnsupportedFormat) as e:
            problem("corrupt", txlog_key(sid), e)
        for info in snap.shards if data_roots is None or sid in data_roots else ():
            if info.digest in shard_seen:
                continue
            shard_seen.add(info.digest)
            shards += 1
            try:
                shard = objects.shard(info)
            except (CorruptObject, UnsupportedFormat) as e:
                problem("corrupt", e.key if isinstance(e, CorruptObject) else info.digest, e)
                continue
            if len(shard.keys) != info.count or (
                shard.keys and (shard.keys[0], shard.keys[-1]) != (info.first, info.last)
            ):
                problem(
                    "corrupt", f"manifests/{info.digest}", "shard does not match its index entry"
                )
            for ref in shard.refs:
                if ref[0] == OBJECT:
                    key = chunk_key(ref[1].hex())
                    chunk_refs[key] = max(chunk_refs.get(key, 0), int(ref[2]))
                elif ref[0] == PACKED:
                    key = pack_key(ref[1])
                    chunk_refs[key] = max(chunk_refs.get(key, 0), int(ref[2]) + int(ref[3]))
                elif ref[0] == INLINE:
                    continue
                elif ref[0] == VIRTUAL:
                    if virtual:
                        reach = virtual_refs.setdefault((ref[1], ref[4], ref[5]), [0, 0])
                        reach[0] = max(reach[0], int(ref[2]) + int(ref[3]))
                        reach[1] += 1
                    continue
                else:
                    problem(
                        "corrupt", f"manifests/{info.digest}", f"unknown chunk ref kind {ref[0]!r}"
                    )
                    continue
                if verify_content:
                    content_refs.setdefault(key, set()).add(ref)
                elif sample > 0 and (ref[0] == OBJECT or len(ref) > 4):
                    offered += 1
                    if len(sampled) < sample:
                        sampled.append((key, ref))
                    elif (j := rng.randrange(offered)) < sample:
                        sampled[j] = (key, ref)
        stack.extend(p for p in snap.parents if p not in seen and p not in expired)

    for digest, _, error in index_pages(objects, page_roots, seen):
        if isinstance(error, RefNotFound):
            problem("missing", history_page_key(digest), "history page is absent")
        elif error is not None:
            problem("corrupt", history_page_key(digest), error)

    if check_chunks and chunk_refs:
        present: dict[str, int] = {}
        for prefix in ("chunks/", "packs/"):
            for obj in storage.list(prefix):
                if obj.key in chunk_refs:
                    present[obj.key] = obj.size
        for key, need in sorted(chunk_refs.items()):
            chunks += 1
            size = present.get(key)
            if size is None:
                problem("missing", key, "chunk object referenced by a manifest is absent")
            elif size < need:
                problem("corrupt", key, f"object has {size} bytes, references need {need}")
        if verify_content:
            verify = [k for k in sorted(content_refs) if present.get(k, -1) >= chunk_refs[k]]
            verified = _verify_content(objects, verify, content_refs, problem)
        else:
            verify_refs = [(k, r) for k, r in sampled if present.get(k, -1) >= chunk_refs[k]]
            verified = _verify_sample(objects, verify_refs, problem)
    repaired: tuple[str, ...] = ()
    notes: list[Problem] = []
    if core.journal.published is not None:
        repaired = _check_root(core, problem, notes.append, repair)
    checked = 0
    if virtual:
        checked = check_virtual_sources(core.objects.sources, virtual_refs, problem, progress)
    return FsckReport(
        problems,
        refs,
        snapshots,
        shards,
        chunks,
        verified,
        repaired,
        notes=notes,
        virtual_sources=checked,
    )


def check_virtual_sources(
    sources: VirtualSources,
    refs: dict[tuple[str, str | None, int | None], list[int]],
    problem: Callable[[str, str, str], None],
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Check each source version the virtual ``refs`` pin ((url, etag, modified µs) -> [how far
    into the file they reach, how many refs]) with one conditional read of the last byte they
    need: the file exists, is the version they were made from (ETag or time), and is long
    enough. Reported as ``virtual-missing``, ``virtual-changed``, ``virtual-not-allowed``
    problems keyed by URL. Bounded parallelism: the I/O pool of each source's storage (32
    requests at once on S3). The number of sources checked."""
    items = sorted(refs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2] or 0))
    done = 0

    def check(item: tuple[tuple[str, str | None, int | None], list[int]]) -> Exception | None:
        (url, etag, modified), (reach, _) = item
        try:
            sources.read_range(SourceRange(url, max(0, reach - 1), reach, etag, modified))
        except VirtualChunkError as e:
            return e
        return None

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=32) as pool:
        for (key, (_, count)), error in zip(items, pool.map(check, items), strict=True):
            done += 1
            if progress is not None:
                progress(done, len(items))
            if error is None:
                continue
            assert isinstance(error, VirtualChunkError)
            kind = (
                "virtual-not-allowed"
                if isinstance(error, VirtualContainerNotAllowed)
                else "virtual-changed"
                if isinstance(error, VirtualSourceChanged)
                else "virtual-missing"
            )
            problem(kind, key[0], f"{error.reason} ({count} chunk ref(s))")
    return len(items)


def _check_root(
    core: RepositoryCore, problem: Any, note: Callable[[Problem], None], repair: bool
) -> tuple[str, ...]:
    """Compare the published root with the journals, tag and expiry records (read before it:
    a head the root names ahead of them is a commit in between, not a problem; one behind is
    a commit whose writer has not swapped the root yet, or died before it did); with
    ``repair``, publish what they say. The keys repaired."""
    published = core.journal.published
    assert published is not None
    key = published.key
    truth = rebuild_root(core.journal, core.tags, core.expiry, core.record)
    stored: RootRecord | None = None
    try:
        stored = RootRecord.decode(core.storage.get(key), key)
    except ObjectNotFound:
        problem("missing", key, "the published root is absent: readers read the journals")
    except (CorruptObject, UnsupportedFormat) as e:
        problem("corrupt", key, e)
    rules = _check_root_rules(core, stored, note, repair)
    if stored is not None:
        found = stored.disagreements(truth)
        for behind, detail in found:
            if behind:
                note(Problem("unpublished", key, detail))
            else:
                problem("corrupt", key, detail)
        if not found:
            return rules
    if not repair:
        return ()
    core.republish()
    return (key,)


def _check_root_rules(
    core: RepositoryCore, stored: RootRecord | None, note: Callable[[Problem], None], repair: bool
) -> tuple[str, ...]:
    """The root's copy of the marker's branch rules, if older than the marker's (a rules change
    whose writer died between the marker swap and the root's): a note, and with ``repair``
    the marker carried into the root."""
    published = core.journal.published
    if stored is None or published is None or core.is_mirror:
        return ()
    try:
        marker = RepoRecord.decode(core.storage.get(REPO_KEY), REPO_KEY)
    except (ObjectNotFound, CorruptObject, UnsupportedFormat):
        return ()  # the marker's own problems are the open's to report
    newest = Protection.from_record(marker.governance).generation
    held = Protection.from_record(stored.repo.governance).generation
    if held >= newest:
        return ()
    note(
        Problem(
            "unpublished",
            published.key,
            f"the root carries the branch rules of generation {held}, the marker {newest}",
        )
    )
    if not repair:
        return ()

    def carry(root: RootRecord) -> RootRecord | None:
        if Protection.from_record(root.repo.governance).generation >= newest:
            return None
        return root.with_repo(marker)

    published.publish(carry)
    return (published.key,)


def _verify_sample(objects: ObjectStore, refs: list[tuple[str, ChunkRef]], problem: Any) -> int:
    """Read the chunk of each of ``refs`` (object key, ref) alone and check it against its
    digest; the number checked."""
    if not refs or objects.content_hash not in CONTENT_HASHES:
        return 0  # an unknown hash: the full check reports it; a sample says nothing

    def check(item: tuple[str, ChunkRef]) -> CorruptChunk | None:
        try:
            objects.read_chunk(item[1])
        except CorruptChunk as e:
            return e
        return None

    for (key, _), error in zip(refs, objects.storage.map(check, refs), strict=True):
        if error is not None:
            problem("corrupt", key, error)
    return len(refs)


def _verify_content(
    objects: ObjectStore,
    keys: list[str],
    refs: dict[str, set[ChunkRef]],
    problem: Any,
) -> int:
    """Read each object in ``keys`` and check the bytes of every chunk ``refs`` has in it against
    the chunk's name: a chunk object's name is its digest; a packed chunk's ref keeps its digest.
    The number of chunks checked."""
    name = objects.content_hash
    if name not in CONTENT_HASHES:
        problem(
            "unsupported",
            REPO_KEY,
            f"content hash {name!r} is unknown to this zarrlake: chunk contents not verified",
        )
        return 0

    def check(key: str) -> list[str]:
        data = objects.storage.get(key)
        bad = []
        for ref in sorted(refs[key], key=repr):
            if ref[0] == OBJECT:
                if objects.hash_data(data) != ref[1].hex():
                    bad.append(f"content does not match its name ({name})")
            elif len(ref) > 4:
                start, length = int(ref[2]), int(ref[3])
                part = memoryview(data)[start : start + length]
                if objects.hash_data(part) != ref[4].hex():
                    end = start + length
                    bad.append(f"bytes {start}..{end} do not match chunk {ref[4].hex()} ({name})")
        return bad

    for key, bad in zip(keys, objects.storage.map(check, keys), strict=True):
        for detail in bad:
            problem("corrupt", key, detail)
    return sum(len(refs[key]) for key in keys)
