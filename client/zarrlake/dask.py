"""Writing xarray and dask data into a session from any dask scheduler: :func:`to_zarrlake`.

``ds.to_zarr(session.store)`` works with dask's threaded scheduler only: the threads share the
session. Worker processes (dask's ``processes`` scheduler, a ``distributed`` cluster) would each
write into a copy of it, which is why a writable session refuses to be pickled
(:class:`~zarrlake.WritableSessionPickled`). :func:`to_zarrlake` writes from any scheduler::

    from zarrlake.dask import to_zarrlake

    session = repo.writable_session("main")
    to_zarrlake(ds, session, mode="w")                 # an xarray Dataset or DataArray
    to_zarrlake(ds2, session, append_dim="time")       # appends, region writes: as to_zarr
    to_zarrlake(darr, session, component="raw/temp")   # or a dask array
    session.commit("one commit for all of it")

It works in two steps:

1. **Metadata, here.** xarray's own ``to_zarr(session.store, compute=False, **kwargs)`` (or, for a
   dask array, ``zarr.create_array``) creates or resizes the arrays in the session and writes every
   variable that is not a dask array. So modes, encodings, ``append_dim`` and ``region`` mean
   exactly what they mean to xarray, and xarray's checks (e.g. ``safe_chunks``) run as usual.
2. **Chunks, on the workers.** The session is forked (:meth:`Session.fork`) and every dask block
   becomes one task that loads its own copy of the fork, writes the block at its place in the
   target array (through xarray's region writes, so values are encoded exactly as the arrays in
   the session declare), and returns the fork's changeset: chunk references only, since the chunk
   bytes go from the worker straight to the repository's storage. The changesets are merged into
   the session (:meth:`Session.merge`), and one ``session.commit()`` publishes everything.

Two blocks must never write parts of the same stored chunk (each would bring back a different
version of it): where the dask chunks do not line up with the array's chunks (or shards), the data
are rechunked so that they do. That also makes ``safe_chunks=False`` safe here. If blocks still
collide (e.g. two calls into one session wrote the same chunk differently), the merge raises
:class:`~zarrlake.ConflictError` and nothing is merged.

If anything fails (xarray's checks, a task, the merge), its exception propagates and the session
is as it was before the call (:meth:`Session.savepoint` / :meth:`Session.rollback`): a retry
starts afresh, and a commit never publishes half of a call. The repository is unchanged until you
commit.

The storage must be reachable from every worker (a directory they share, or an object store).
``Storage.memory()`` can only be written with an in-process scheduler (threads, synchronous):
:func:`to_zarrlake` refuses other schedulers for it before writing anything.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from zarrlake.changeset import Changeset
from zarrlake.errors import InvalidArgument, ReadOnlyError, ZarrlakeError
from zarrlake.extras import require
from zarrlake.forks import dump_fork, load_fork
from zarrlake.session import ForkedSession, Session

if TYPE_CHECKING:
    import dask.array
    import numpy as np
    import xarray as xr
    import zarr

__all__ = ["to_zarrlake"]

# Arguments of to_zarr that to_zarrlake decides itself.
_REFUSED = ("store", "compute", "chunkmanager_store_kwargs", "storage_options")


def to_zarrlake(
    ds_or_dask_array: Any, session: Session, group: str | None = None, **to_zarr_kwargs: Any
) -> None:
    """Write ``ds_or_dask_array`` (an xarray Dataset or DataArray, or a dask array) into
    ``session``, from whichever dask scheduler is active (threads, processes, distributed), then
    ``commit``.

    For xarray objects, ``to_zarr_kwargs`` are those of ``Dataset.to_zarr`` (``mode``,
    ``append_dim``, ``region``, ``encoding``, ``zarr_format``, ``consolidated``, ``safe_chunks``,
    ``write_empty_chunks``, ...), except ``compute``, ``store``, ``storage_options`` and
    ``chunkmanager_store_kwargs``. For a dask array they are those of ``dask.array.to_zarr``:
    ``component`` (the array's path below ``group``), ``region`` (a tuple of slices into an
    existing array), ``overwrite``, and ``append_dim`` (an axis of an existing array to grow),
    the rest going to ``zarr.create_array`` (``chunks``, ``compressors``, ``fill_value``, ...).

    Raises :class:`ReadOnlyError` for a read-only or committed session, :class:`ZarrlakeError` for
    ``Storage.memory()`` under a scheduler with worker processes, and whatever xarray, Zarr or a
    task raises (nothing of this call is merged then), and :class:`~zarrlake.MissingDependency`
    without dask (``zarrlake[dask]``). See :mod:`zarrlake.dask`.
    """
    require("dask", extra="dask", feature="zarrlake.dask.to_zarrlake")
    if not isinstance(session, Session):
        raise InvalidArgument(
            f"to_zarrlake writes into a writable zarrlake Session, not {type(session).__name__}"
        )
    if session.read_only:
        raise ReadOnlyError(
            "to_zarrlake needs a writable session (repo.writable_session(branch)); this one is "
            "read-only or already committed"
        )
    refused = sorted(k for k in to_zarr_kwargs if k in _REFUSED)
    if refused:
        raise InvalidArgument(
            f"to_zarrlake does not take {', '.join(refused)}: it writes the session"
        )
    group = _norm_group(group)
    _check_scheduler(session)

    # All or nothing: on any failure the session is as it was before the call (a retry of an
    # append must not grow the arrays twice, nor a commit publish half of it).
    before = session.savepoint()
    try:
        targets = _prepare(ds_or_dask_array, session, group, to_zarr_kwargs)
        if targets:
            changesets = _write_blocks(session, targets)
            session.merge(*[cs for cs in changesets if not cs.is_empty()])
    except BaseException:
        session.rollback(before)
        raise


# -- step 1: metadata, in this process -------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """One dask array to write: where (``path``) and at which offset in the stored array."""

    path: str
    source: dask.array.Array
    offset: tuple[int, ...]
    #: Set for an xarray variable: blocks are written through xarray (encoding, dims).
    variable: str | None = None
    dims: tuple[str, ...] = ()
    group: str | None = None
    write_empty_chunks: bool | None = None


def _norm_group(group: str | None) -> str | None:
    if group is None:
        return None
    if not isinstance(group, str):
        raise InvalidArgument(f"group must be a string, not {type(group).__name__}")
    return group.strip("/") or None


def _join(*parts: str | None) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _prepare(
    obj: Any, session: Session, group: str | None, kwargs: dict[str, Any]
) -> list[_Target]:
    try:
        import xarray as xr
    except ImportError:  # pragma: no cover - xarray is a dependency
        xr = None  # type: ignore[assignment]
    if xr is not None and isinstance(obj, xr.DataArray):
        return _prepare_dataset(_as_dataset(obj), session, group, kwargs)
    if xr is not None and isinstance(obj, xr.Dataset):
        return _prepare_dataset(obj, session, group, kwargs)
    import dask.array

    if isinstance(obj, dask.array.Array):
        return _prepare_dask_array(obj, session, group, kwargs)
    raise InvalidArgument(
        "to_zarrlake writes an xarray Dataset or DataArray or a dask array, "
        f"not {type(obj).__module__}.{type(obj).__name__}"
    )


def _as_dataset(array: xr.DataArray) -> xr.Dataset:
    """The Dataset ``DataArray.to_zarr`` writes (so ``xarray.open_dataarray`` reads it back)."""
    from xarray.backends.api import DATAARRAY_NAME, DATAARRAY_VARIABLE

    if array.name is None:
        return array.to_dataset(name=DATAARRAY_VARIABLE)
    if array.name in array.coords or array.name in array.dims:
        ds = array.to_dataset(name=DATAARRAY_VARIABLE)
        ds.attrs[DATAARRAY_NAME] = array.name
        return ds
    return array.to_dataset()


def _existing_arrays(session: Session, group: str | None) -> set[str]:
    import zarr

    try:
        found = zarr.open_group(session.store, path=group or "", mode="r")
    except (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError, ValueError):
        return set()
    return set(found.array_keys())


def _prepare_dataset(
    ds: xr.Dataset, session: Session, group: str | None, kwargs: dict[str, Any]
) -> list[_Target]:
    import zarr

    mode = kwargs.get("mode")
    append_dim = kwargs.get("append_dim")
    region = kwargs.get("region")
    existed = _existing_arrays(session, group) if mode == "a-" else set()

    # xarray creates or resizes the arrays and writes every variable that is not a dask array;
    # the write of the dask arrays it returns is never computed (the blocks are written below).
    ds.to_zarr(session.store, group=group, compute=False, **kwargs)

    starts = _region_starts(ds, session, group, region) if region is not None else {}
    targets = []
    for name, var in ds.variables.items():
        if var.chunks is None:
            continue  # written by xarray already
        kept_as_is = append_dim is not None and append_dim not in var.dims and str(name) in existed
        if mode == "a-" and kept_as_is:  # mode "a-" leaves these alone, as xarray does
            continue
        path = _join(group, str(name))
        stored = zarr.open_array(session.store, path=path, mode="r")
        offset = []
        for axis, dim in enumerate(var.dims):
            if dim == append_dim:
                offset.append(stored.shape[axis] - var.shape[axis])
            else:
                offset.append(starts.get(dim, 0))
        targets.append(
            _Target(
                path=path,
                source=var.data,
                offset=tuple(offset),
                variable=str(name),
                dims=tuple(str(d) for d in var.dims),
                group=group,
                write_empty_chunks=kwargs.get("write_empty_chunks"),
            )
        )
    return targets


def _region_starts(
    ds: xr.Dataset, session: Session, group: str | None, region: Any
) -> dict[Hashable, int]:
    """Where ``region`` puts each dimension's first element (xarray validated it already)."""
    if region == "auto":
        region = dict.fromkeys(ds.dims, "auto")
    if not isinstance(region, Mapping):
        raise InvalidArgument(
            f"region must be a mapping of dimension to slice, or 'auto': {region!r}"
        )
    starts: dict[Hashable, int] = {}
    existing = None
    for dim, where in region.items():
        if isinstance(where, slice):
            starts[dim] = _slice_start(where, ds.sizes[dim], dim)
        elif where == "auto" and dim not in ds.indexes:
            starts[dim] = 0  # no coordinate to find it by: the whole dimension, as xarray does
        elif where == "auto":
            if existing is None:
                import xarray as xr

                existing = xr.open_zarr(session.store, group=group, consolidated=False)
            found = existing.indexes[dim].get_indexer(ds.indexes[dim][:1])
            starts[dim] = int(found[0])
        else:
            raise InvalidArgument(f"region[{dim!r}] must be a slice or 'auto', not {where!r}")
    return starts


def _slice_start(where: slice, size: int, dim: Hashable) -> int:
    if where.step not in (None, 1):
        raise InvalidArgument(f"region[{dim!r}] must be a contiguous slice (step 1): {where!r}")
    start = where.start or 0
    if start < 0:
        raise InvalidArgument(f"region[{dim!r}] must not count from the end: {where!r}")
    return int(start)


def _prepare_dask_array(
    arr: dask.array.Array, session: Session, group: str | None, kwargs: dict[str, Any]
) -> list[_Target]:
    import zarr

    kwargs = dict(kwargs)
    component = kwargs.pop("component", None)
    region = kwargs.pop("region", None)
    overwrite = bool(kwargs.pop("overwrite", False))
    append_dim = kwargs.pop("append_dim", None)
    if component is not None and not isinstance(component, str):
        raise InvalidArgument(f"component must be a string path, not {type(component).__name__}")
    path = _join(group, component)
    if region is not None and append_dim is not None:
        raise InvalidArgument("give region or append_dim, not both")
    axis = _axis(append_dim, arr.ndim) if append_dim is not None else 0

    if region is not None or append_dim is not None:
        if kwargs or overwrite:
            raise InvalidArgument(
                "region and append_dim write into an existing array: "
                f"unexpected {', '.join(sorted(kwargs)) or 'overwrite'}"
            )
        stored = zarr.open_array(session.store, path=path, mode="r+")
        if stored.ndim != arr.ndim:
            raise InvalidArgument(
                f"array {path!r} has {stored.ndim} dimensions, the data {arr.ndim}"
            )
        if region is not None:
            offset = _dask_region_offset(region, arr.shape, stored.shape, path)
        else:
            if any(
                s != a
                for i, (s, a) in enumerate(zip(stored.shape, arr.shape, strict=True))
                if i != axis
            ):
                raise InvalidArgument(
                    f"cannot append data of shape {arr.shape} to {path!r} of shape "
                    f"{stored.shape} along axis {axis}"
                )
            grown = list(stored.shape)
            offset = tuple(grown[i] if i == axis else 0 for i in range(arr.ndim))
            grown[axis] += arr.shape[axis]
            stored.resize(tuple(grown))
    else:
        if any(n != n for n in arr.shape):  # NaN: unknown
            raise InvalidArgument(
                "the dask array has unknown chunk sizes: call compute_chunk_sizes()"
            )
        chunks = kwargs.pop("chunks", None) or tuple(max(c) if c else 1 for c in arr.chunks)
        zarr.create_array(
            session.store,
            name=path,
            shape=arr.shape,
            dtype=arr.dtype,
            chunks=chunks,
            overwrite=overwrite,
            **kwargs,
        )
        offset = (0,) * arr.ndim
    return [_Target(path=path, source=arr, offset=offset)]


def _axis(append_dim: Any, ndim: int) -> int:
    if isinstance(append_dim, bool) or not isinstance(append_dim, int):
        raise InvalidArgument(f"append_dim of a dask array is an axis number, not {append_dim!r}")
    if not -ndim <= append_dim < ndim:
        raise InvalidArgument(f"append_dim {append_dim} is not an axis of a {ndim}-d array")
    return append_dim % ndim


def _dask_region_offset(
    region: Any, shape: tuple[int, ...], stored: tuple[int, ...], path: str
) -> tuple[int, ...]:
    if not isinstance(region, tuple) or len(region) != len(shape):
        raise InvalidArgument(f"region must be a tuple of {len(shape)} slices, not {region!r}")
    offset = []
    for axis, where in enumerate(region):
        if not isinstance(where, slice):
            raise InvalidArgument(f"region[{axis}] must be a slice, not {where!r}")
        start = _slice_start(where, shape[axis], axis)
        stop = where.stop if where.stop is not None else stored[axis]
        if stop - start != shape[axis] or stop > stored[axis]:
            raise InvalidArgument(
                f"region {region!r} of {path!r} (shape {stored}) does not fit data of shape {shape}"
            )
        offset.append(start)
    return tuple(offset)


# -- step 2: the blocks, on the workers -----------------------------------------------------------


def _check_scheduler(session: Session) -> None:
    if session.objects.storage.shared_across_processes:
        return
    import dask.base
    import dask.local
    import dask.threaded

    scheduler = dask.base.get_scheduler()  # type: ignore[no-untyped-call]
    if scheduler not in (None, dask.threaded.get, dask.local.get_sync):
        raise ZarrlakeError(
            f"{session.objects.storage.url} (e.g. Storage.memory()) cannot be written from dask "
            "worker processes: each would write into its own copy. Use the threaded scheduler, "
            "or a storage every worker shares (a directory, an object store)"
        )


class _ForkSource:
    """What every task makes its own fork from: the fork as bytes, or (for a storage that is not
    shared across processes, under an in-process scheduler) the session itself."""

    def __init__(self, session: Session) -> None:
        self._url = session.objects.storage.url
        if session.objects.storage.shared_across_processes:
            self._bytes: bytes | None = dump_fork(session.fork())
            self._session: Session | None = None
        else:
            self._bytes = None
            self._session = session

    def load(self) -> ForkedSession:
        if self._bytes is not None:
            return load_fork(self._bytes)
        assert self._session is not None
        return self._session.fork()

    def __reduce__(self) -> Any:
        if self._bytes is None:
            raise ZarrlakeError(
                f"{self._url} (e.g. Storage.memory()) cannot be written from dask worker "
                "processes; use the threaded scheduler or a shared storage"
            )
        return (_fork_source_from_bytes, (self._bytes, self._url))


def _fork_source_from_bytes(data: bytes, url: str) -> _ForkSource:
    forks = _ForkSource.__new__(_ForkSource)
    forks._bytes, forks._session, forks._url = data, None, url
    return forks


def _write_blocks(session: Session, targets: Sequence[_Target]) -> list[Changeset]:
    import dask.array as da
    import numpy as np
    import zarr
    from dask.base import compute
    from dask.delayed import delayed

    # One task per block: the block's computation and its write fuse into one task, so a block is
    # written where it was computed and never travels between workers. The fork travels once.
    forks = delayed(_ForkSource(session), name=f"zarrlake-fork-{uuid.uuid4().hex}")
    written = []
    for target in targets:
        stored = zarr.open_array(session.store, path=target.path, mode="r")
        source = _aligned(target.source, target.offset, tuple(stored.shards or stored.chunks))
        spec = _BlockSpec(
            target.path,
            target.variable,
            target.dims,
            target.group,
            target.write_empty_chunks,
            target.offset,
        )
        written.append(
            da.map_blocks(  # type: ignore[no-untyped-call]
                _write_block,
                source,
                forks,
                spec=spec,
                dtype=object,
                chunks=tuple((1,) * len(c) for c in source.chunks),
                meta=np.empty((0,) * source.ndim, dtype=object),
            )
        )
    results = compute(*written)  # type: ignore[no-untyped-call]
    return [changes for blocks in results for changes in blocks.ravel()]


def _aligned(
    source: dask.array.Array, offset: tuple[int, ...], grid: tuple[int, ...]
) -> dask.array.Array:
    """``source`` rechunked, where needed, so that no stored chunk spans two blocks."""
    chunks = []
    changed = False
    for axis_chunks, off, cell in zip(source.chunks, offset, grid, strict=True):
        inner = list(accumulate(axis_chunks))[:-1]
        if all((off + b) % cell == 0 for b in inner):
            chunks.append(axis_chunks)
            continue
        changed = True
        step = max(cell, round(max(axis_chunks) / cell) * cell)  # whole cells, near the original
        pieces = []
        pos, end = off, off + sum(axis_chunks)
        while pos < end:
            nxt = min(end, (pos // step + 1) * step)
            pieces.append(nxt - pos)
            pos = nxt
        chunks.append(tuple(pieces))
    return source.rechunk(tuple(chunks)) if changed else source  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class _BlockSpec:
    path: str
    variable: str | None
    dims: tuple[str, ...]
    group: str | None
    write_empty_chunks: bool | None
    offset: tuple[int, ...]


def _write_block(
    block: np.ndarray[Any, Any], forks: _ForkSource, *, spec: _BlockSpec, block_info: Any = None
) -> np.ndarray[Any, Any]:
    """One task: write ``block`` through a fresh fork at its place in the stored array; return
    the fork's changes (in a one-element array: the result of a ``map_blocks`` block)."""
    import numpy as np

    region = tuple(
        slice(off + start, off + stop)
        for off, (start, stop) in zip(spec.offset, block_info[0]["array-location"], strict=True)
    )
    fork = forks.load()
    if spec.variable is not None:
        import xarray as xr

        part = xr.Dataset({spec.variable: xr.Variable(spec.dims, block)})
        part.to_zarr(
            fork.store,
            group=spec.group,
            mode="r+",
            region=dict(zip(spec.dims, region, strict=True)),
            consolidated=False,
            safe_chunks=False,  # alignment is ensured by _aligned
            write_empty_chunks=spec.write_empty_chunks,
        )
    else:
        import zarr

        target: zarr.Array[Any] = zarr.open_array(fork.store, path=spec.path, mode="r+")
        target[region] = block
    result = np.empty((1,) * block.ndim, dtype=object)
    result[(0,) * block.ndim] = fork.changeset()
    return result
