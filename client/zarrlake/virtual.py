"""Importing references to existing files as virtual Zarr arrays: kerchunk refs, VirtualiZarr.

An archive of NetCDF4/HDF5 files becomes a versioned Zarr dataset without a copy: each chunk is
a byte range of a file (a :class:`~zarrlake.VirtualRef`), and each array's Zarr v3 metadata is
written from the file's own (kerchunk describes arrays as Zarr v2: ``.zarray`` and ``.zattrs``,
translated here to ``zarr.json``, the numcodecs filters and compressor as zarr's ``numcodecs.*``
codecs and ``_ARRAY_DIMENSIONS`` as dimension names). The chunk keys keep kerchunk's form
(``v2`` chunk key encoding), so a ref's key is the key kerchunk gave it.

Refs are pinned to the files' versions as they are now (``pin=True``): the ETag of an S3 object,
the modification time of a local file, one request per file. A file rewritten afterwards then
fails its reads with :class:`VirtualSourceChanged` rather than returning another version's bytes.
"""

from __future__ import annotations

import base64
import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zarrlake.errors import InvalidArgument, MissingDependency
from zarrlake.extras import require
from zarrlake.session import Workspace
from zarrlake.sources import SourceInfo, VirtualRef

__all__ = ["ImportReport", "import_kerchunk", "write_virtual_dataset"]

_TEMPLATE = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass
class ImportReport:
    """What an import wrote: ``arrays`` and ``groups`` (paths), ``virtual_refs`` (chunks that
    point into files), ``inline_chunks`` (chunks the refs held themselves, written as data),
    ``sources`` (distinct files referenced)."""

    arrays: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    virtual_refs: int = 0
    inline_chunks: int = 0
    sources: int = 0

    def to_json(self) -> dict[str, Any]:
        """``{"arrays": [path], "groups": [path], "virtual_refs": int, "inline_chunks": int,
        "sources": int}``."""
        return {
            "arrays": list(self.arrays),
            "groups": list(self.groups),
            "virtual_refs": self.virtual_refs,
            "inline_chunks": self.inline_chunks,
            "sources": self.sources,
        }


def _load_refs(refs: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(refs, Mapping):
        return dict(refs)
    if isinstance(refs, str | os.PathLike):
        path = os.fspath(refs)
        if os.path.isdir(path):
            return _load_parquet(path)
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as e:
            raise InvalidArgument(f"{path}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise InvalidArgument(f"{path} is not JSON kerchunk refs ({e})") from None
        if not isinstance(loaded, dict):
            raise InvalidArgument(f"{path} holds no kerchunk refs (a JSON object)")
        return loaded
    raise InvalidArgument(
        f"refs must be a dict or the path of a JSON file or Parquet refs directory, not {refs!r}"
    )


_RECORD = re.compile(r"refs\.(\d+)\.parq$")


_COLUMNS = ("path", "offset", "size", "raw")


def _parquet_record(file: str) -> dict[str, list[Any]]:
    """The columns of one record file, read with pyarrow if it is installed, else with
    fastparquet (what kerchunk writes them with; the ``virtual`` extra brings it)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    try:
        if pq is not None:
            table = pq.read_table(file, columns=list(_COLUMNS))
            return {c: table.column(c).to_pylist() for c in _COLUMNS}
        try:
            import fastparquet
        except ImportError:
            raise MissingDependency(
                "pyarrow or fastparquet", "virtual", "reading kerchunk Parquet refs"
            ) from None
        frame = fastparquet.ParquetFile(file).to_pandas(columns=list(_COLUMNS))
        return {c: frame[c].tolist() for c in _COLUMNS}
    except MissingDependency:
        raise
    except Exception as e:  # each reader raises its own kinds for a file that is not one
        raise InvalidArgument(f"{file}: not a kerchunk refs record ({e})") from None


def _load_parquet(path: str) -> dict[str, Any]:
    """Kerchunk's Parquet references (``kerchunk.df.refs_to_dataframe``, fsspec's
    ``LazyReferenceMapper``) as the JSON form: ``.zmetadata`` holds the metadata and the
    ``record_size``; each array's chunk refs are rows of ``<array>/refs.<n>.parq`` (columns
    ``path``, ``offset``, ``size``, ``raw``), row ``i`` of record ``n`` the chunk whose index in
    the C-order flattened chunk grid is ``n * record_size + i``. A row with neither path nor raw
    is a chunk that does not exist; a path with size 0 is the whole file."""
    try:
        with open(os.path.join(path, ".zmetadata"), encoding="utf-8") as f:
            zmeta = json.load(f)
    except OSError:
        raise InvalidArgument(
            f"{path} is a directory without .zmetadata: not kerchunk Parquet refs"
        ) from None
    except ValueError as e:
        raise InvalidArgument(f"{path}/.zmetadata is not JSON ({e})") from None
    metadata = zmeta.get("metadata") if isinstance(zmeta, dict) else None
    record_size = zmeta.get("record_size") if isinstance(zmeta, dict) else None
    if not isinstance(metadata, dict) or not isinstance(record_size, int) or record_size < 1:
        raise InvalidArgument(f"{path}/.zmetadata: needs 'metadata' and a 'record_size' >= 1")
    entries: dict[str, Any] = dict(metadata)
    for key, value in metadata.items():
        parent, _, name = str(key).rpartition("/")
        if name != ".zarray":
            continue
        zarray = _json(value, key)
        shape, chunks = zarray.get("shape"), zarray.get("chunks")
        if not isinstance(shape, list) or not isinstance(chunks, list) or len(shape) != len(chunks):
            raise InvalidArgument(f"{path}: {key} needs a shape and chunks of one length")
        grid = tuple(-(-int(n) // max(int(c), 1)) for n, c in zip(shape, chunks, strict=True))
        total = int(np.prod(grid)) if grid else 1
        sep = zarray.get("dimension_separator") or "."
        folder = os.path.join(path, parent) if parent else path
        records = {}
        if os.path.isdir(folder):
            for file in os.listdir(folder):
                m = _RECORD.match(file)
                if m:
                    records[int(m[1])] = os.path.join(folder, file)
        for n, file in sorted(records.items()):
            columns = _parquet_record(file)
            start = n * record_size
            stop = min(start + len(columns["path"]), total)
            if stop <= start:
                continue
            paths, offsets = columns["path"], columns["offset"]
            sizes, raws = columns["size"], columns["raw"]
            coords = np.unravel_index(np.arange(start, stop), grid) if grid else ()
            for i in range(stop - start):
                name = sep.join(str(int(c[i])) for c in coords) if grid else "0"
                key_i = f"{parent}/{name}" if parent else name
                url, raw = paths[i], raws[i]
                if isinstance(url, str):
                    size = int(sizes[i])
                    entries[key_i] = [url] if size == 0 else [url, int(offsets[i]), size]
                elif isinstance(raw, bytes | str):
                    entries[key_i] = raw
    return {"version": 1, "refs": entries}


def _url(raw: str, templates: Mapping[str, str]) -> str:
    """A kerchunk URL as a container URL: templates filled in, a bare absolute path as file://."""
    url = _TEMPLATE.sub(lambda m: str(templates.get(m[1], m[0])), raw)
    if url.startswith("/"):
        return "file://" + url
    return url


def _json(value: Any, key: str) -> dict[str, Any]:
    doc = json.loads(value) if isinstance(value, str | bytes) else value
    if not isinstance(doc, dict):
        raise InvalidArgument(f"kerchunk key {key!r} holds no JSON object")
    return doc


def _join(group: str, path: str) -> str:
    return "/".join(p for p in (group, path) if p)


def v3_array_metadata(zarray: Mapping[str, Any], zattrs: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` of a Zarr v2 array described by ``.zarray`` and ``.zattrs``.

    Codecs: a Fortran order becomes a ``transpose``; the v2 filters and compressor, zarr's
    ``numcodecs.*`` codecs (array-to-array ones before ``bytes``, bytes-to-bytes ones after,
    then the compressor); ``_ARRAY_DIMENSIONS`` becomes ``dimension_names``. Raises
    :class:`InvalidArgument` for a codec zarr has no v3 form of, or filters in an order v3
    cannot express (an array filter after a bytes filter)."""
    from zarr.abc.codec import ArrayArrayCodec, BytesBytesCodec
    from zarr.codecs import BytesCodec, TransposeCodec
    from zarr.core.chunk_key_encodings import V2ChunkKeyEncoding
    from zarr.core.dtype.common import HasEndianness
    from zarr.core.metadata.v2 import ArrayV2Metadata
    from zarr.core.metadata.v3 import ArrayV3Metadata
    from zarr.registry import get_codec_class

    attrs = dict(zattrs)
    dims = attrs.pop("_ARRAY_DIMENSIONS", None)
    v2 = ArrayV2Metadata.from_dict({**zarray, "attributes": attrs})

    def numcodec(config: Mapping[str, Any]) -> Any:
        name = f"numcodecs.{config['id']}"
        try:
            cls = get_codec_class(name)
        except KeyError:
            raise InvalidArgument(f"no Zarr v3 codec for the v2 codec {config['id']!r}") from None
        conf = {k: v for k, v in config.items() if k != "id"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "numcodecs codecs are not in the v3 spec"
            return cls.from_dict({"name": name, "configuration": conf})

    arrays: list[Any] = []
    after: list[Any] = []
    if v2.order == "F":
        arrays.append(TransposeCodec(order=list(range(len(v2.shape) - 1, -1, -1))))
    for config in zarray.get("filters") or []:
        codec = numcodec(config)
        if isinstance(codec, ArrayArrayCodec):
            if after:
                raise InvalidArgument(f"filter {config['id']!r} follows a bytes filter")
            arrays.append(codec)
        elif isinstance(codec, BytesBytesCodec):
            after.append(codec)
        else:
            raise InvalidArgument(f"filter {config['id']!r} is neither array nor bytes codec")
    if zarray.get("compressor") is not None:
        compressor = numcodec(zarray["compressor"])
        if not isinstance(compressor, BytesBytesCodec):
            raise InvalidArgument(f"compressor {zarray['compressor']['id']!r} is no bytes codec")
        after.append(compressor)
    endian = v2.dtype.endianness if isinstance(v2.dtype, HasEndianness) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v3 = ArrayV3Metadata(
            shape=v2.shape,
            data_type=v2.dtype,
            chunk_grid=v2.chunk_grid,
            chunk_key_encoding=V2ChunkKeyEncoding(separator=v2.dimension_separator),
            # v3 requires one; v2's None (no fill value) reads as the type's zero, as zarr does
            fill_value=v2.dtype.default_scalar() if v2.fill_value is None else v2.fill_value,
            codecs=[*arrays, BytesCodec(endian=endian), *after],
            attributes=attrs,
            dimension_names=None if dims is None else tuple(dims),
            storage_transformers=None,
        )
        doc = v3.to_dict()
    return json.dumps(doc, allow_nan=True, default=_json_default).encode()


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    raise TypeError(f"{value!r} is not JSON")


def import_kerchunk(
    refs: Mapping[str, Any] | str | os.PathLike[str],
    session: Workspace,
    group: str | None = None,
    *,
    pin: bool = True,
) -> ImportReport:
    """Write the arrays kerchunk ``refs`` describe into ``session``, under ``group`` (None:
    the root), their chunks as virtual refs into the files (inline chunks as data).

    ``refs``: kerchunk references (version 0 or 1, with ``templates``), as a dict, the path of
    a JSON file, or the directory of kerchunk's Parquet references (``.zmetadata`` and
    ``<array>/refs.<n>.parq`` records, as ``kerchunk.df.refs_to_dataframe`` writes them; read
    with pandas, which needs pyarrow or fastparquet). ``pin``: record each file's ETag (S3,
    Azure, HTTP), generation (GCS) or modification time (local files) as they are now, so that
    reading a chunk of a file changed since raises :class:`VirtualSourceChanged` (one request
    per file). Nothing is committed: call
    ``session.commit`` after.

    Raises :class:`VirtualContainerNotAllowed` for a file outside the repository's
    ``virtual_containers`` (before anything is written), :class:`VirtualSourceMissing` for a
    file that does not exist (when pinning), :class:`InvalidArgument` for refs that are not
    kerchunk's or hold a codec Zarr v3 cannot express.
    """
    data = _load_refs(refs)
    entries = data.get("refs", data) if "version" in data else data
    if not isinstance(entries, dict):
        raise InvalidArgument("kerchunk refs: 'refs' must be an object")
    if data.get("gen"):
        raise InvalidArgument("kerchunk refs with 'gen' entries are not supported yet")
    templates = data.get("templates") or {}
    base = (group or "").strip("/")
    report = ImportReport()

    arrays: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    attrs: dict[str, dict[str, Any]] = {}
    chunks: dict[str, list[tuple[str, Any]]] = {}
    for key, value in entries.items():
        parent, _, name = key.rpartition("/")
        if name == ".zarray":
            arrays[parent] = _json(value, key)
        elif name == ".zgroup":
            groups[parent] = _json(value, key)
        elif name == ".zattrs":
            attrs[parent] = _json(value, key)
        elif name in (".zmetadata",) or name.startswith("."):
            continue
        else:
            chunks.setdefault(parent, []).append((name, value))
    for parent in chunks:
        if parent not in arrays:
            raise InvalidArgument(f"kerchunk refs hold chunks of {parent!r}, which has no .zarray")

    # Every file, checked against the allow-list (and pinned) before anything is written.
    sources = session.objects.sources
    urls: dict[str, None] = {}
    for items in chunks.values():
        for _, value in items:
            if isinstance(value, list) and value:
                urls[_url(value[0], templates)] = None
    for url in urls:
        sources.container_of(url)
    stats: dict[str, SourceInfo] = {}
    if pin or any(isinstance(v, list) and len(v) == 1 for i in chunks.values() for _, v in i):
        found = session.objects.storage.map(sources.stat, list(urls))
        stats = dict(zip(urls, found, strict=True))
    report.sources = len(urls)
    if pin:
        for url, stat in stats.items():
            # A server that sends neither an ETag nor a Last-Modified (HTTP) leaves nothing to
            # pin: pinned to the epoch, every read would say the file changed.
            if stat.etag is None and stat.modified.timestamp() == 0:
                raise InvalidArgument(
                    f"{url}: the server gives no ETag and no Last-Modified, so a ref cannot be "
                    "pinned to this version of the file; import with pin=False (reads then "
                    "cannot tell a changed file)"
                )

    if base and not session.exists(f"{base}/zarr.json"):
        _write_group(session, base, {})
        report.groups.append(base)
    for path in sorted(set(groups) | ({""} if "" in attrs and "" not in arrays else set())):
        if path in arrays:
            continue
        _write_group(session, _join(base, path), attrs.get(path, {}))
        report.groups.append(_join(base, path))
    for path, zarray in sorted(arrays.items()):
        full = _join(base, path)
        session.write(f"{full}/zarr.json", v3_array_metadata(zarray, attrs.get(path, {})))
        report.arrays.append(full)
        sep = zarray.get("dimension_separator") or "."
        ndim = len(zarray["shape"])
        # The refs in columns (set_virtual_refs_arrays: no Python object per ref).
        grid: list[tuple[int, ...]] = []
        columns: tuple[list[Any], ...] = ([], [], [], [], [])  # url, offset, length, etag, when
        for name, value in chunks.get(path, []):
            if isinstance(value, list):
                url = _url(value[0], templates)
                info = stats.get(url)
                if len(value) == 1:  # the whole file
                    assert info is not None
                    offset, length = 0, info.size
                else:
                    offset, length = int(value[1]), int(value[2])
                grid.append(tuple(int(c) for c in name.split(sep)) if ndim else ())
                # An ETag pins a version exactly; a time (a file's) where there is none.
                etag = info.etag if pin and info is not None else None
                when = info.modified if pin and info is not None and etag is None else None
                for column, item in zip(columns, (url, offset, length, etag, when), strict=True):
                    column.append(item)
            else:
                session.write(f"{full}/{name}", _inline(value, f"{path}/{name}"))
                report.inline_chunks += 1
        if not grid:
            continue
        urls_, offsets, lengths, etags, whens = columns
        columnar = ndim > 0 and all(len(c) == ndim for c in grid)
        columnar = columnar and all(
            0 <= o < 1 << 63 and 0 <= n < 1 << 32 for o, n in zip(offsets, lengths, strict=True)
        )
        if not columnar:
            # A 0-d array, a chunk name of the wrong rank, a range of 4 GiB or more: a
            # VirtualRef each (which says what is wrong, or holds what columns cannot).
            refs_of = zip(grid, urls_, offsets, lengths, etags, whens, strict=True)
            report.virtual_refs += session.set_virtual_refs(
                full,
                [(c, VirtualRef(u, o, n, etag=e, last_modified=w)) for c, u, o, n, e, w in refs_of],
            )
            continue
        report.virtual_refs += session.set_virtual_refs_arrays(
            full,
            np.array(grid, dtype=np.int64).reshape(len(grid), ndim),
            urls_,
            np.array(offsets, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
            etags=etags,
            last_modified=whens,
        )
    return report


def _inline(value: Any, key: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"kerchunk key {key!r}: a ref is a list or inline data")
    if value.startswith("base64:"):
        return base64.b64decode(value[len("base64:") :])
    return value.encode()


def _write_group(session: Workspace, path: str, attributes: Mapping[str, Any]) -> None:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
    session.write(f"{path}/zarr.json" if path else "zarr.json", json.dumps(doc).encode())


def write_virtual_dataset(
    vds: Any, session: Workspace, group: str | None = None, *, pin: bool = True
) -> ImportReport:
    """Write a VirtualiZarr dataset (``virtualizarr.open_virtual_dataset``'s, an
    ``xarray.Dataset`` of ``ManifestArray`` variables) into ``session`` under ``group``, as
    :func:`import_kerchunk` writes kerchunk refs (through VirtualiZarr's own kerchunk form of
    the dataset, which carries its CF encoding). Raises :class:`MissingDependency` without
    ``virtualizarr`` (``pip install 'zarrlake[virtual]'``), else as :func:`import_kerchunk`."""
    require("virtualizarr", extra="virtual", feature="zarrlake.virtual.write_virtual_dataset")
    # The accessor was ``virtualize`` before VirtualiZarr 2.1 named it ``vz``.
    accessor = getattr(vds, "vz", None) or vds.virtualize
    refs = accessor.to_kerchunk(format="dict")
    return import_kerchunk(refs, session, group, pin=pin)
