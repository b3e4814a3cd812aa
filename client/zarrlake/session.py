"""Sessions: a base snapshot plus uncommitted changes, read and written through a Zarr store.

A :class:`Session` is a transaction on one branch (or a read-only view of a version). Chunk bytes
are uploaded as they are written: large chunks as content-addressed objects (identical concurrent
writes are harmless), small ones into packs of a few MiB (:mod:`zarrlake.packs`), of which the
last is written when the session commits or forks. A commit writes that pack, shards, a txlog, a
snapshot and one journal entry. :meth:`Session.fork` hands
a picklable writer to another process; its :class:`Changeset` comes back through
:meth:`Session.merge`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import operator
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from zarrlake.changeset import Changeset
from zarrlake.commit import SolverPolicy
from zarrlake.config import RepositoryConfig
from zarrlake.conflicts import Solver
from zarrlake.errors import (
    Conflict,
    ConflictError,
    InvalidArgument,
    NothingToCommit,
    ReadOnlyError,
    SessionExpired,
    WritableSessionPickled,
    ZarrlakeError,
)
from zarrlake.format import manifest
from zarrlake.format.changes import ChunkChanges
from zarrlake.format.manifest import prefix_matches
from zarrlake.format.model import ChunkRef, Snapshot, ref_identity
from zarrlake.history import diff_nodes
from zarrlake.nodes import array_paths, is_meta_key, meta_key_node, split_chunk_key
from zarrlake.objects import ObjectStore
from zarrlake.packs import PackWriter
from zarrlake.sources import VirtualRef
from zarrlake.types import Diff

_ABSENT: Any = object()

if TYPE_CHECKING:
    from zarrlake.core import RepositoryCore
    from zarrlake.store import ZarrlakeStore

__all__ = ["ForkedSession", "NothingToCommit", "Session", "Workspace", "diff_nodes"]


class Workspace:
    """The read/write machinery shared by sessions and forks: layers of changes over a snapshot.

    ``_layers`` are read top first; writes go to ``_layers[0]``.
    """

    _objects: ObjectStore
    _config: RepositoryConfig
    _base_id: str
    _layers: list[Changeset]
    _read_only: bool
    _expires_at: dt.datetime | None
    _session_id: str
    #: The snapshot a session's commit made (then it is read-only); None for a fork.
    _committed: str | None = None
    _branch: str | None
    #: A commit of these changes is running (set and read under ``_mutex``).
    _committing: bool = False
    #: Small chunks written into packs not yet uploaded, or whose upload is not yet confirmed.
    _packs: PackWriter | None = None
    #: A read-only session of a branch whose base is provisional (see :meth:`_settled`): the
    #: function that gives the branch's head as it is now; None once the base is settled.
    _settle: Callable[[], str] | None = None

    def _init_workspace(self) -> None:
        self._mutex = threading.Lock()
        self._settling = threading.Lock()
        self._store: ZarrlakeStore | None = None
        self._packs: PackWriter | None = None

    # -- properties ---------------------------------------------------------------------------

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def base(self) -> str:
        """Id of the snapshot this session started from."""
        self._settled()
        return self._base_id

    @property
    def branch(self) -> str | None:
        return self._branch

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def expires_at(self) -> dt.datetime | None:
        return self._expires_at

    @property
    def objects(self) -> ObjectStore:
        """The asset store this session reads and uploads chunks through."""
        return self._objects

    @property
    def store(self) -> ZarrlakeStore:
        """A ``zarr.abc.store.Store`` over this session."""
        if self._store is None:
            from zarrlake.store import ZarrlakeStore

            self._store = ZarrlakeStore(self, read_only=self._read_only)
        return self._store

    def _snapshot(self) -> Snapshot:
        self._settled()
        return self._objects.snapshot(self._base_id)

    def _settled(self, key: str | None = None) -> None:
        """Settle a provisional base: wait for the head read that started with the session
        (:meth:`zarrlake.history.CommitGraph.locate_ahead`) and take the head it found, if that
        is not the provisional one. Meanwhile, the manifest shard that ``key`` (about to be
        read) needs under the provisional base is read too: where the head did not move, or
        moved without changing that shard (shards are content-addressed), the read it waited
        for was its only round trip. Raises what the head read raised (:class:`RefNotFound`
        for a branch deleted meanwhile), then and at every later read."""
        if self._settle is None:
            return
        if key is not None:
            self._read_ahead_for(key)  # before the lock: concurrent reads read theirs at once
        with self._settling:
            settle = self._settle
            if settle is None:
                return
            head = settle()
            if head != self._base_id:
                self._objects.snapshot(head)  # fail now if it cannot be read; cached for reads
                self._base_id = head
                self._layers = [Changeset(self._session_id, head)]
            self._settle = None

    def _read_ahead_for(self, key: str) -> None:
        """Read the shard ``key`` needs in the provisional base (a metadata key: its node's
        shard, if all its chunks are in one), unless it is cached. Errors are the later
        read's to raise, against the settled base."""
        snap = self._objects.cached_snapshot(self._base_id)
        if snap is None:
            return
        if is_meta_key(key):
            shards = manifest.shards_in_subtree(snap.shards, key.rpartition("/")[0])
            info = shards[0] if len(shards) == 1 else None
        else:
            info = manifest.shard_of(snap.shards, key)
        if info is None or self._objects.cached_shard(info) is not None:
            return
        try:
            self._objects.shard(info)
        except ZarrlakeError:
            pass

    def _read_only_reason(self) -> str:
        if self._committed is not None:
            return (
                f"this session was committed (as {self._committed}) and is read-only now; "
                "open a new writable_session to go on"
            )
        return "this session is read-only (open a writable_session on a branch to write)"

    def _check_writable(self) -> None:
        if self._read_only:
            raise ReadOnlyError(self._read_only_reason())
        if self._expires_at is not None and dt.datetime.now(dt.UTC) >= self._expires_at:
            raise SessionExpired(
                f"session {self._session_id} expired at {self._expires_at.isoformat()}; "
                "start a new session"
            )

    # -- reads ---------------------------------------------------------------------------------

    def _layer_value(self, key: str, meta: bool) -> tuple[bool, bytes | ChunkRef | None]:
        """(decided, value) from the uncommitted layers: value None means deleted."""
        for layer in self._layers:
            if meta and key in layer.nodes:
                return True, layer.nodes[key]
            if not meta and (ref := layer.chunks.get(key, _ABSENT)) is not _ABSENT:
                return True, ref
            if layer.deleted_prefixes and layer.deleted_by_prefix(key):
                return True, None
        return False, None

    def resolve(self, key: str) -> bytes | ChunkRef | None:
        """The metadata document bytes, or the chunk ref, stored under ``key`` — or None."""
        meta = is_meta_key(key)
        decided, value = self._layer_value(key, meta)
        if decided:
            return value
        self._settled(key)
        snap = self._snapshot()
        if meta:
            return snap.nodes.get(key)
        return manifest.lookup(snap.shards, key, self._objects.shard)

    def resolve_cached(self, key: str) -> tuple[bool, bytes | ChunkRef | None]:
        """(found, value): :meth:`resolve`'s answer if it needs no I/O (the snapshot and the
        key's manifest shard are cached), else (False, None). The store's read path asks this
        on the event loop before handing anything to a thread."""
        meta = is_meta_key(key)
        decided, value = self._layer_value(key, meta)
        if decided:
            return True, value
        if self._settle is not None:
            return False, None  # the base is provisional: :meth:`resolve` settles it
        snap = self._objects.cached_snapshot(self._base_id)
        if snap is None:
            return False, None
        if meta:
            return True, snap.nodes.get(key)
        info = manifest.shard_of(snap.shards, key)
        if info is None:
            return True, None
        shard = self._objects.cached_shard(info)
        if shard is None:
            return False, None
        return True, shard.get(key)

    def read(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes | None:
        value = self.resolve(key)
        if value is None:
            return None
        if isinstance(value, bytes):
            return value if byte_range is None else value[byte_range[0] : byte_range[1]]
        return self._objects.read_chunk(value, byte_range)

    def exists(self, key: str) -> bool:
        return self.resolve(key) is not None

    def _visible(self, key: str) -> bool:
        decided, value = self._layer_value(key, is_meta_key(key))
        return value is not None if decided else True

    def list_prefix(self, prefix: str) -> Iterator[str]:
        """Every key starting with ``prefix``, in sorted order."""
        snap = self._snapshot()
        keys: set[str] = {k for k in snap.nodes if k.startswith(prefix)}
        keys.update(k for k, _ in manifest.iter_prefix(snap.shards, prefix, self._objects.shard))
        if any(not layer.is_empty() for layer in self._layers):
            keys = {k for k in keys if self._visible(k)}
            for layer in self._layers:
                for d in (layer.nodes, layer.chunks):
                    keys.update(k for k, v in d.items() if v is not None and k.startswith(prefix))
            keys = {k for k in keys if self._visible(k)}
        return iter(sorted(keys))

    def list_dir(self, prefix: str) -> list[str]:
        """Names directly below ``prefix`` (files and directories)."""
        p = prefix.strip("/")
        p = p + "/" if p else ""
        deletions = any(
            layer.deleted_prefixes
            or any(
                v is None and k.startswith(p)
                for d in (layer.nodes, layer.chunks)
                for k, v in d.items()
            )
            for layer in self._layers
        )
        if deletions:
            names = {k[len(p) :].split("/", 1)[0] for k in self.list_prefix(p)}
            return sorted(names)
        snap = self._snapshot()
        names = set(manifest.child_names(snap.shards, p, self._objects.shard))
        names.update(k[len(p) :].split("/", 1)[0] for k in snap.nodes if k.startswith(p))
        for layer in self._layers:
            for d in (layer.nodes, layer.chunks):
                names.update(k[len(p) :].split("/", 1)[0] for k in d if k.startswith(p))
        return sorted(names)

    # -- writes ---------------------------------------------------------------------------------

    def _top(self) -> Changeset:
        """The changes writes go to; call with ``_mutex`` held. Raises :class:`ReadOnlyError`
        while a commit of them runs: the commit reads them as they are, and a write landing now
        would be in neither the new snapshot nor the session (read-only once committed)."""
        if self._committing:
            raise ReadOnlyError(
                "this session is committing: a write made now would not be in the commit "
                "(finish every write before commit())"
            )
        return self._layers[0]

    def write(self, key: str, data: bytes | memoryview) -> None:
        self._check_writable()
        if is_meta_key(key):
            with self._mutex:
                self._top().nodes[key] = bytes(data)
            return
        if self._packs_chunk(len(data)):
            ref, backlog = self._pack_writer().add(data)
            if backlog is not None:
                backlog.result()
            self._record(key, ref, False)
            return
        ref, dedup = self._objects.write_chunk(data, self._config.inline_threshold_bytes)
        self._record(key, ref, dedup)

    async def write_chunk_async(self, key: str, data: bytes | memoryview) -> None:
        """:meth:`write` of a chunk that is uploaded as an object (not
        :meth:`writes_in_memory`), awaited on the caller's event loop."""
        self._check_writable()
        if self.writes_in_memory(key, len(data)):
            raise InvalidArgument(f"{key!r} is not written as an object: use write()")
        if self._packs_chunk(len(data)):
            # Appended to a pack in memory (a hash and a copy: microseconds); the pack uploads
            # on the I/O pool once full, and this waits only when too many are uploading.
            ref, backlog = self._pack_writer().add(data)
            if backlog is not None:
                await asyncio.wrap_future(backlog)
            self._record(key, ref, False)
            return
        ref, dedup = await self._objects.write_chunk_async(data)
        self._record(key, ref, dedup)

    def _packs_chunk(self, size: int) -> bool:
        """Whether a chunk of ``size`` bytes goes into a pack: above the inline threshold (those
        live in the manifest) and below the pack threshold."""
        config = self._config
        return config.inline_threshold_bytes < size < config.pack_chunks_below_bytes

    def _pack_writer(self) -> PackWriter:
        with self._mutex:
            if self._packs is None:
                self._packs = PackWriter(self._objects)
            return self._packs

    def flush(self) -> None:
        """Upload the small chunks this session holds in packs in memory, and wait for them.
        A commit or a fork does it; anything else that hands this session's refs to another
        process must too. Raises the storage's error if a pack cannot be written."""
        packs = self._packs
        if packs is not None:
            packs.flush()

    def _record(self, key: str, ref: ChunkRef, dedup: bool) -> None:
        with self._mutex:
            top = self._top()
            top.chunks[key] = ref
            if dedup:
                top.dedup_chunks.add(ref[1])

    def set_virtual_refs(
        self,
        array_path: str,
        refs: Mapping[tuple[int, ...], VirtualRef] | Iterable[tuple[tuple[int, ...], VirtualRef]],
    ) -> int:
        """Make chunks of the array at ``array_path`` virtual: each a byte range of a file
        outside the repository (:class:`VirtualRef`), read from there whenever it is read.
        ``refs`` maps chunk coordinates (a tuple of ints, one per dimension) to refs, as a
        mapping or an iterable of pairs. Replaces whatever those chunks held; a later write of
        real data replaces a virtual chunk like any other. Returns how many refs were set.

        Raises :class:`VirtualContainerNotAllowed` for a URL in none of the repository's
        ``virtual_containers`` (nothing is set then), :class:`InvalidArgument` for a path that
        is no array, coordinates outside its chunk grid, or a ref that is not a
        :class:`VirtualRef` (or that pins a ``file://`` source by ETag, which files lack)."""
        self._check_writable()
        path = array_path.strip("/") if isinstance(array_path, str) else array_path
        if not isinstance(path, str):
            raise InvalidArgument(f"array_path must be a str, not {array_path!r}")
        key_of = self._chunk_key_function(path)
        items = refs.items() if isinstance(refs, Mapping) else refs
        allowed: set[str] = set()
        sources = self._objects.sources
        # Staged apart (nothing is set if one ref is refused), and compactly: a million refs
        # held as Python tuples would be ~300 MB, in columns ~70 MB.
        batch = ChunkChanges()
        for coords, vref in items:
            if type(vref) is not VirtualRef:
                raise InvalidArgument(
                    f"chunk {coords!r}: expected a zarrlake.VirtualRef, not {vref!r}"
                )
            url = vref.url
            if url not in allowed:
                sources.container_of(url)
                allowed.add(url)
            if vref.etag is not None and url.startswith("file://"):
                raise InvalidArgument(
                    f"{url}: a file has no ETag to check; pin it by last_modified"
                )
            batch[key_of(coords)] = vref.chunk_ref()
        count = len(batch)
        with self._mutex:
            self._top().chunks.absorb(batch)
        return count

    def set_virtual_refs_arrays(
        self,
        array_path: str,
        coords: Any,
        urls: str | Sequence[str],
        offsets: Any,
        lengths: Any,
        *,
        etags: str | Sequence[str | None] | None = None,
        last_modified: dt.datetime | Sequence[dt.datetime | None] | None = None,
    ) -> int:
        """:meth:`set_virtual_refs` for refs given as flat arrays, for millions of them:
        ``coords`` an (N, ndim) array of chunk coordinates (or N ints for a 1-d array),
        ``offsets`` and ``lengths`` N ints each, ``urls`` one URL for every ref or N of them;
        ``etags`` and ``last_modified``, which pin the sources, None, one value for every ref,
        or N values (None among them: that ref unpinned). Checked as a whole before anything
        is set (the errors of :meth:`set_virtual_refs`, naming the first bad ref; and a length
        of 2**32 or more, which only :meth:`set_virtual_refs` takes); the refs are staged in
        columns, never as a Python object each. A chunk given twice takes its last ref.
        Returns how many chunks were set (0 for N = 0)."""
        import numpy as np

        self._check_writable()
        path = array_path.strip("/") if isinstance(array_path, str) else array_path
        if not isinstance(path, str):
            raise InvalidArgument(f"array_path must be a str, not {array_path!r}")
        if "\x00" in path:
            raise InvalidArgument(f"array_path {array_path!r} holds a NUL character")
        key_of = self._chunk_key_function(path)
        counts = key_of.counts  # type: ignore[attr-defined]
        ndim = len(counts)
        grid = np.asarray(coords)
        if grid.ndim >= 1 and grid.shape[0] == 0:
            return 0  # nothing to set (``[]`` is not even an int array to numpy)
        if ndim == 1 and grid.ndim == 1:
            grid = grid.reshape(-1, 1)
        if grid.dtype.kind not in "iu" or grid.ndim != 2 or grid.shape[1] != ndim:
            raise InvalidArgument(
                f"coords must be an (N, {ndim}) array of ints for array {path!r}, not "
                f"{grid.dtype} of shape {grid.shape}"
            )
        n = len(grid)
        off = _int_column(offsets, n, "offsets")
        size = _int_column(lengths, n, "lengths")
        outside = ((grid < 0) | (grid >= np.asarray(counts, dtype=np.int64))).any(axis=1)
        if outside.any():
            key_of(tuple(int(c) for c in grid[int(np.argmax(outside))]))  # raises, naming it
        if (size >= 1 << 32).any():
            i = int(np.argmax(size >= 1 << 32))
            raise InvalidArgument(f"ref {i}: length {int(size[i])} is not below 2**32")
        url_of, url_list = _codes(urls, n, "urls", str)
        etag_of, etag_list = _codes(etags, n, "etags", str)
        when_of, when_list = _codes(last_modified, n, "last_modified", dt.datetime)
        # The distinct sources (URL, ETag, time), each checked as a VirtualRef, and allowed.
        if len(etag_list) == 1 and len(when_list) == 1:
            distinct, source_of = [(u, 0, 0) for u in range(len(url_list))], url_of
        else:
            combos = np.stack([url_of, etag_of, when_of], axis=1)
            found, inverse = np.unique(combos, axis=0, return_inverse=True)
            distinct, source_of = found.tolist(), inverse.ravel()
        sources: list[tuple[str, str | None, int | None]] = []
        allowed: set[str] = set()
        for j, (u, e, w) in enumerate(distinct):
            url, etag = url_list[u], etag_list[e]
            try:
                vref = VirtualRef(
                    str(url) if isinstance(url, str) else url,
                    0,
                    0,
                    etag=str(etag) if isinstance(etag, str) else etag,
                    last_modified=when_list[w],
                )
            except InvalidArgument as err:
                raise InvalidArgument(f"ref {int(np.argmax(source_of == j))}: {err}") from None
            if vref.url not in allowed:
                self._objects.sources.container_of(vref.url)
                allowed.add(vref.url)
            if vref.etag is not None and vref.url.startswith("file://"):
                raise InvalidArgument(
                    f"{vref.url}: a file has no ETag to check; pin it by last_modified"
                )
            _, url, _, _, etag, modified = vref.chunk_ref()
            sources.append((url, etag, modified))
        keys = key_of.keys(grid)  # type: ignore[attr-defined]
        batch = ChunkChanges.of_virtual(keys, sources, source_of, off, size)
        count = len(batch)
        with self._mutex:
            self._top().chunks.absorb(batch)
        return count

    def _chunk_key_function(self, path: str) -> Callable[[Any], str]:
        """What turns chunk coordinates of the array at ``path`` into its chunk keys (as its
        ``chunk_key_encoding`` says), checking them against its chunk grid."""
        meta_key = f"{path}/zarr.json" if path else "zarr.json"
        doc = self.resolve(meta_key)
        try:
            meta = json.loads(doc) if isinstance(doc, bytes) else None
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or meta.get("node_type") != "array":
            raise InvalidArgument(f"no Zarr v3 array at {path or '/'!r} in this session")
        shape = [int(n) for n in meta["shape"]]
        grid = meta.get("chunk_grid") or {}
        if grid.get("name") != "regular":
            raise InvalidArgument(f"array {path!r}: virtual refs need a regular chunk grid")
        chunks = [int(n) for n in grid["configuration"]["chunk_shape"]]
        counts = [-(-n // c) if c else 0 for n, c in zip(shape, chunks, strict=True)]
        encoding = meta.get("chunk_key_encoding") or {}
        sep = (encoding.get("configuration") or {}).get("separator")
        if encoding.get("name") == "v2":
            sep, lead = sep or ".", ""
        else:
            sep, lead = sep or "/", "c"
        base = f"{path}/" if path else ""
        ndim = len(shape)

        def key_of(coords: Any) -> str:
            if type(coords) is tuple and len(coords) == ndim:  # the common case, quickly
                try:
                    pairs = zip(coords, counts, strict=True)
                    in_grid = all([0 <= c < n and type(c) is int for c, n in pairs])
                except TypeError:
                    in_grid = False
                if in_grid:
                    if lead:
                        return base + sep.join((lead, *map(str, coords)))
                    return base + (sep.join(map(str, coords)) if coords else "0")
            if type(coords) is not tuple or not all(type(c) is int for c in coords):
                try:  # numpy integers, lists: the same coordinates
                    coords = tuple(operator.index(c) for c in coords)
                except TypeError:
                    pass
            if (
                type(coords) is not tuple
                or len(coords) != ndim
                or not all(
                    type(c) is int and 0 <= c < n for c, n in zip(coords, counts, strict=True)
                )
            ):
                raise InvalidArgument(
                    f"chunk {coords!r} is not in the chunk grid of array {path!r} "
                    f"({'x'.join(map(str, counts)) or 'one chunk'}: a tuple of {ndim} int(s))"
                )
            if lead:
                return base + sep.join((lead, *map(str, coords)))
            return base + (sep.join(map(str, coords)) if coords else "0")

        def keys(grid: Any) -> list[str]:
            """The keys of the rows of ``grid``, an (N, ndim) array already checked."""
            if ndim == 0:
                return [key_of(())] * len(grid)
            columns = [map(str, grid[:, d].tolist()) for d in range(ndim)]
            start = base + (lead + sep if lead else "")
            return [start + sep.join(row) for row in zip(*columns, strict=True)]

        key_of.counts = counts  # type: ignore[attr-defined]
        key_of.keys = keys  # type: ignore[attr-defined]
        return key_of

    def writes_in_memory(self, key: str, size: int) -> bool:
        """Whether writing ``size`` bytes to ``key`` stays in this session's memory (a metadata
        document or an inline chunk) rather than uploading an object."""
        return is_meta_key(key) or size <= self._config.inline_threshold_bytes

    def delete(self, key: str) -> None:
        self._check_writable()
        if not self.exists(key):
            return
        with self._mutex:
            layer = self._top()
            (layer.nodes if is_meta_key(key) else layer.chunks)[key] = None

    def delete_prefix(self, prefix: str) -> None:
        """Remove a whole subtree ('' removes everything)."""
        self._check_writable()
        with self._mutex:
            self._top().delete_prefix(prefix)

    # -- status ---------------------------------------------------------------------------------

    @property
    def has_changes(self) -> bool:
        return not self._layers[0].is_empty()

    def status(self) -> Diff:
        """The uncommitted changes, as a :class:`Diff` against the base snapshot."""
        snap = self._snapshot()
        cs = self._layers[0]
        new_nodes = dict(snap.nodes)
        for k in list(new_nodes):
            if cs.deleted_by_prefix(k):
                del new_nodes[k]
        for k, v in cs.nodes.items():
            if v is None:
                new_nodes.pop(k, None)
            else:
                new_nodes[k] = v
        arrays = array_paths(snap.nodes) | array_paths(new_nodes)
        chunks: dict[str, set[tuple[Any, ...]]] = {}
        changed_keys = set(cs.chunks)
        for p in cs.deleted_prefixes:
            changed_keys.update(
                k for k, _ in manifest.iter_subtree(snap.shards, p, self._objects.shard)
            )
        for key in changed_keys:
            old = manifest.lookup(snap.shards, key, self._objects.shard)
            _, new = self._layer_value(key, False)  # (a chunk key: a ref or None)
            if ref_identity(old) != ref_identity(
                cast(ChunkRef | None, new)
            ):  # same bytes: no change
                path, coords = split_chunk_key(key, arrays)
                chunks.setdefault(path, set()).add(coords)
        return diff_nodes(snap.nodes, new_nodes, chunks)

    async def status_async(self) -> Diff:
        """Async twin of :meth:`status`: runs it on a worker thread."""
        return await asyncio.to_thread(self.status)


@dataclass(frozen=True)
class Savepoint:
    """A session's uncommitted changes at one moment (see :meth:`Session.savepoint`)."""

    session_id: str
    changes: Changeset
    merged: dict[str, tuple[Any, int]]
    deletes: list[tuple[str, int]]


class Session(Workspace):
    """A transaction on a branch, or a read-only view of a version. See :mod:`zarrlake.session`."""

    def __init__(
        self,
        core: RepositoryCore,
        base: str,
        *,
        branch: str | None,
        read_only: bool,
        ttl: dt.timedelta | None = None,
        settle: Callable[[], str] | None = None,
    ) -> None:
        """``settle``: for a read-only session of ``branch``, ``base`` is provisional (the head
        this client saw last) and ``settle`` gives the head as it is now (see :meth:`_settled`)."""
        self._core = core
        self._objects = core.objects
        self._config = core.config
        self._base_id = base
        self._branch = branch
        self._read_only = read_only
        self._session_id = uuid.uuid4().hex
        self._expires_at = (
            None if read_only else dt.datetime.now(dt.UTC) + (ttl or self._config.session_ttl)
        )
        self._layers = [Changeset(self._session_id, base)]
        #: What merges brought, by key: (value, number of the merge) — see :meth:`merge`.
        self._merged: dict[str, tuple[Any, int]] = {}
        #: Subtrees merges deleted (``delete_dir`` in a fork): (prefix, number of the merge).
        self._merged_deletes: list[tuple[str, int]] = []
        self._merges = 0
        self._discarded_at = 0
        self._committed: str | None = None
        self._init_workspace()
        # Fail now, not on first read, if the base snapshot is missing or corrupt.
        self._objects.snapshot(base)
        if settle is not None:
            assert read_only and branch is not None
            self._settle = settle

    def __repr__(self) -> str:
        mode = "read-only" if self._read_only else "writable"
        return f"<Session {mode} branch={self._branch!r} base={self._base_id}>"

    def __getstate__(self) -> dict[str, Any]:
        if not self._read_only:
            # A copy in another process (a dask or multiprocessing worker) would write into
            # changes of its own that never come back: this session's commit would succeed
            # without them. Refuse, and say what works.
            raise WritableSessionPickled(
                f"a writable session (branch {self._branch!r}) cannot be pickled: writes made "
                "through the copy (e.g. by dask worker processes) would never reach this "
                "session's commit. For xarray or dask data use zarrlake.dask.to_zarrlake("
                "ds_or_dask_array, session, ...), which writes from any scheduler; "
                "otherwise give each process a fork: fork = session.fork() pickles, and "
                "session.merge(fork.changeset()) brings its writes back before the commit"
            )
        self._settled()
        state = dict(self.__dict__)
        state.pop("_mutex", None)
        state.pop("_settling", None)
        state["_store"] = None
        state["_packs"] = None  # read-only: a commit flushed them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mutex = threading.Lock()
        self._settling = threading.Lock()

    def commit(
        self,
        message: str,
        *,
        author: str | None = None,
        metadata: dict[str, Any] | None = None,
        rebase: bool = True,
        solver: Solver = None,
        allow_empty: bool = False,
    ) -> str:
        """Publish the changes as a new snapshot on the branch and return its id.

        If the branch moved since the base, the changes are rebased onto the new head
        (``rebase=True``); overlapping changes raise :class:`ConflictError` listing each conflict,
        unless ``solver`` (:class:`UseOurs` / :class:`UseTheirs`) settles chunk conflicts.
        Afterwards the session is read-only. Raises :class:`SessionExpired`, :class:`ReadOnlyError`,
        :class:`NothingToCommit`.
        """
        self._check_writable()
        if not isinstance(message, str):
            raise InvalidArgument("commit message must be a string")
        if not self.has_changes and not allow_empty:
            raise NothingToCommit("no changes to commit (pass allow_empty=True to commit anyway)")
        assert self._branch is not None
        # The commit works on the changes as they are, not on a copy (millions of refs cost
        # hundreds of MB to copy): until it ends, writes are refused (a second commit() too)
        # rather than landing where neither the commit nor the session would keep them. If it
        # fails, the session keeps its changes as they were.
        with self._mutex:
            changeset = self._top()
            self._committing = True
        try:
            # The last pack travels while the commit builds and writes its snapshot; every pack
            # the changes name is written before the journal entry that publishes them.
            packs = self._packs
            if packs is not None:
                packs.send()
            new_id = self._core.commits.commit(
                self._branch,
                changeset,
                message=message,
                author=author,
                metadata=metadata or {},
                rebase=rebase,
                policy=SolverPolicy(solver),
                ready=self.flush,
            )
            with self._mutex:
                self._committed = new_id
                self._base_id = new_id
                self._layers = [Changeset(self._session_id, new_id)]
                self._read_only = True
        finally:
            with self._mutex:
                self._committing = False
        if self._store is not None:
            self._store.make_read_only(self._read_only_reason())
        return new_id

    async def commit_async(
        self,
        message: str,
        *,
        author: str | None = None,
        metadata: dict[str, Any] | None = None,
        rebase: bool = True,
        solver: Solver = None,
        allow_empty: bool = False,
    ) -> str:
        """Async twin of :meth:`commit`: runs it on a worker thread."""
        return await asyncio.to_thread(
            self.commit,
            message,
            author=author,
            metadata=metadata,
            rebase=rebase,
            solver=solver,
            allow_empty=allow_empty,
        )

    def discard(self) -> None:
        """Drop every uncommitted change (uploaded chunks become garbage for GC)."""
        self._check_writable()
        with self._mutex:
            self._top()  # not while a commit of these changes runs
            self._layers = [Changeset(self._session_id, self._base_id)]
            self._merged.clear()
            self._merged_deletes.clear()
            # Forks made before now saw the dropped changes (and may have built on them).
            self._merges += 1
            self._discarded_at = self._merges

    def savepoint(self) -> Savepoint:
        """The uncommitted changes as they are now, to go back to with :meth:`rollback` (a copy
        of them: it costs what they weigh)."""
        self._check_writable()
        with self._mutex:
            return Savepoint(
                self._session_id,
                self._top().copy(),
                dict(self._merged),
                list(self._merged_deletes),
            )

    def rollback(self, point: Savepoint) -> None:
        """Go back to the changes of ``point`` (a :meth:`savepoint` of this session): what was
        written or merged since is dropped, and forks made since are refused by :meth:`merge`."""
        self._check_writable()
        if not isinstance(point, Savepoint) or point.session_id != self._session_id:
            raise ZarrlakeError("not a savepoint of this session")
        with self._mutex:
            self._top()  # not while a commit of these changes runs
            self._layers = [point.changes.copy()]
            self._merged = dict(point.merged)
            self._merged_deletes = list(point.deletes)
            self._merges += 1
            self._discarded_at = self._merges

    async def discard_async(self) -> None:
        """Async twin of :meth:`discard`: runs it on a worker thread."""
        await asyncio.to_thread(self.discard)

    def fork(self) -> ForkedSession:
        """A picklable writer for another process, seeing this session's changes so far."""
        self._check_writable()
        with self._mutex:
            inherited = self._layers[0].copy()
            forked_at = self._merges
        # The fork, in another process, reads these changes from storage. After the copy: a
        # chunk is in a pack before its ref is recorded, so every ref copied is flushed here.
        self.flush()
        return ForkedSession(
            objects=self._objects,
            config=self._config,
            base=self._base_id,
            branch=self._branch,
            session_id=self._session_id,
            expires_at=self._expires_at,
            inherited=inherited,
            forked_at=forked_at,
        )

    def merge(self, *changesets: Changeset) -> None:
        """Fold forked work back into this session (then :meth:`commit`).

        Raises :class:`ConflictError` if two forks wrote different bytes to the same key, and
        :class:`ZarrlakeError` for a changeset that does not belong to this session (or comes from
        a fork made before :meth:`discard`). Forks conflict when neither saw the other's work
        (changesets merged together, or a fork made before an earlier merge) and they wrote a key
        differently, or one deleted a subtree (``delete_dir``) the other wrote into. A fork made
        after a merge saw its changes, and may overwrite them.
        """
        self._check_writable()
        for cs in changesets:
            if not isinstance(cs, Changeset):
                raise InvalidArgument(f"expected a Changeset, got {type(cs).__name__}")
            if cs.session_id != self._session_id or cs.base != self._base_id:
                raise ZarrlakeError("changeset comes from a fork of a different session")
        conflicts = []
        with self._mutex:
            top = self._top()
            snap_nodes = self._snapshot().nodes
            arrays = array_paths(snap_nodes) | array_paths(
                {k: v for k, v in top.nodes.items() if v is not None}
            )
            # Check each changeset against earlier merges and the changesets before it in this
            # call (forks merged together must not overwrite each other silently either).
            seen = dict(self._merged)
            gone = list(self._merged_deletes)
            number = self._merges
            for cs in changesets:
                if cs.forked_at < self._discarded_at:
                    raise ZarrlakeError(
                        "changeset comes from a fork made before discard(): it may rest on the "
                        "changes that were dropped; fork again"
                    )
                # A subtree this fork deleted, where another (unseen) merge wrote.
                for prefix in cs.deleted_prefixes:
                    hit = next(
                        (
                            k
                            for k, (v, n) in seen.items()
                            if v is not None and n >= cs.forked_at and prefix_matches(k, prefix)
                        ),
                        None,
                    )
                    if hit is not None:
                        conflicts.append(Conflict("node", "/" + prefix.strip("/")))
                for d in (cs.chunks, cs.nodes):
                    for k, v in d.items():
                        earlier = seen.get(k)
                        unseen_delete = any(
                            n >= cs.forked_at and prefix_matches(k, p) for p, n in gone
                        )
                        if unseen_delete:  # written where another fork, unseen, deleted
                            conflicts.append(Conflict("node", "/" + k.rsplit("/", 1)[0]))
                        elif (
                            earlier is not None
                            and earlier[1] >= cs.forked_at
                            and earlier[0] != v
                            # A chunk's bytes, not where they lie: two forks writing the same
                            # bytes put them in packs of their own.
                            and (
                                d is cs.nodes
                                or ref_identity(earlier[0])
                                != ref_identity(cast(ChunkRef | None, v))
                            )
                        ):
                            if is_meta_key(k):
                                conflicts.append(Conflict("node", meta_key_node(k)))
                            else:
                                path, coords = split_chunk_key(k, arrays)
                                conflicts.append(Conflict("chunk", path, coords))
                        seen[k] = (v, number)
                gone += [(p, number) for p in cs.deleted_prefixes]
            if conflicts:
                more = f" (+{len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
                raise ConflictError(
                    conflicts,
                    f"forks wrote different data: {conflicts[0]}{more}. Forks that each write "
                    "part of one chunk overwrite each other's part: give each chunk to one "
                    "fork (e.g. partition rows by chunk index)",
                )
            self._merged = seen
            self._merged_deletes = gone
            self._merges += 1
            for cs in changesets:
                top.fold(cs)

    async def merge_async(self, *changesets: Changeset) -> None:
        """Async twin of :meth:`merge`: runs it on a worker thread."""
        await asyncio.to_thread(self.merge, *changesets)


class ForkedSession(Workspace):
    """A session's writer in another process (a Spark task): picklable, commits nothing itself."""

    def __init__(
        self,
        *,
        objects: ObjectStore,
        config: RepositoryConfig,
        base: str,
        branch: str | None,
        session_id: str,
        expires_at: dt.datetime | None,
        inherited: Changeset,
        forked_at: int = 0,
    ) -> None:
        self._objects = objects
        self._config = config
        self._base_id = base
        self._branch = branch
        self._session_id = session_id
        self._expires_at = expires_at
        self._read_only = False
        self._layers = [Changeset(session_id, base), inherited]
        self._forked_at = forked_at
        self._init_workspace()

    def changeset(self) -> Changeset:
        """This fork's own changes, to hand back to :meth:`Session.merge` (its small chunks'
        packs written first)."""
        with self._mutex:
            changes = self._layers[0].copy()
        self.flush()  # after the copy, so that it covers every ref copied
        changes.forked_at = self._forked_at
        return changes

    def __getstate__(self) -> dict[str, Any]:
        with self._mutex:
            state = dict(self.__dict__)
            state["_layers"] = [layer.copy() for layer in self._layers]
        # A copy elsewhere could not read chunks held in this process's memory: every pack the
        # copied changes name is written (flushed after the copy, so none is missed).
        self.flush()
        state.pop("_mutex", None)
        state.pop("_settling", None)
        state["_store"] = None
        state["_packs"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mutex = threading.Lock()
        self._settling = threading.Lock()

    def __repr__(self) -> str:
        return f"<ForkedSession of {self._session_id} base={self._base_id}>"


def _int_column(values: Any, n: int, name: str) -> Any:
    """``values`` as N int64s >= 0, or :class:`InvalidArgument` naming ``name``."""
    import numpy as np

    column = np.asarray(values)
    if column.dtype.kind not in "iu" or column.shape != (n,):
        raise InvalidArgument(
            f"{name} must be {n} ints (one per ref), not {column.dtype} of shape {column.shape}"
        )
    if column.dtype.kind == "u" and column.dtype.itemsize == 8 and (column >= 1 << 63).any():
        raise InvalidArgument(f"{name} must be below 2**63")
    column = column.astype(np.int64, copy=False)
    if (column < 0).any():
        i = int(np.argmax(column < 0))
        raise InvalidArgument(f"ref {i}: {name} {int(column[i])} is negative")
    return column


def _codes(values: Any, n: int, name: str, kind: type) -> tuple[Any, list[Any]]:
    """(a code per ref, the distinct values the codes index) of ``values``: None or one value
    for every ref, or a sequence of N values (None among them where ``kind`` allows)."""
    import numpy as np

    if values is None or isinstance(values, kind):
        return np.zeros(n, np.int64), [values]
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise InvalidArgument(f"{name} must be one {kind.__name__} or a sequence of {n}")
    seen: dict[Any, int] = {}
    codes = np.fromiter((seen.setdefault(v, len(seen)) for v in values), dtype=np.int64, count=-1)
    if len(codes) != n:
        raise InvalidArgument(f"{name} must have {n} values (one per ref), not {len(codes)}")
    return codes, list(seen)
