"""PySpark integration: many tasks write one commit; a version of an array read as a DataFrame.

Writing (cooperative mode, see DESIGN.md)::

    from zarrlake.spark import write_partitions, open_array

    def create(store):                       # runs once, on the driver, before any task
        zarr.create_array(store, name="grid/temp", shape=(8000, 360), chunks=(1000, 360),
                          dtype="f4")

    def writer(store, rows):                 # runs on the executors, once per partition
        temp = open_array(store, "grid/temp")  # = zarr.open_array(store, path=..., mode="r+")
        for row in rows:
            temp[row.start : row.stop] = compute(row)

    commit_id = write_partitions(df, repo, "main", writer=writer, setup=create,
                                 message="fill grid/temp")

:func:`write_partitions` opens a writable session on the branch, runs ``setup(store)`` on the
driver if given, forks the session and ships the picklable :class:`~zarrlake.ForkedSession` to the
executors with ``mapPartitions``. Every partition gets its own copy of the fork and calls
``writer(fork.store, partition_iterator)``; chunk bytes are uploaded from the executors straight to
the repository's storage, and only the small changesets (chunk references) travel back. The driver
merges them into the session and makes exactly one commit (rebasing onto commits that landed on the
branch meanwhile, like any commit). If a writer raises, or the job fails for any other reason,
:class:`SparkWriteError` is raised and nothing is committed.

Arrays and groups (their metadata) must exist before the tasks write chunks: create them in
``setup``, or commit them beforehand. Executors may not change metadata concurrently. Each chunk
should be written by at most one partition: align the partitions' blocks with the chunk grid.
Two partitions writing different bytes to the same chunk make the merge fail with
:class:`~zarrlake.ConflictError` (nothing is committed); partial writes to a shared chunk would
otherwise lose each other's data. :class:`BlockWriter` is a ready-made picklable writer for
partitions of ``(origin, block)`` pairs.

The storage must be reachable from every executor: S3 (credentials given explicitly to
``Storage.s3`` travel with the pickled storage; otherwise the executors' AWS environment is used)
or a directory on a file system that all executors share. ``Storage.memory()`` cannot be written
from Spark (each executor would write into its own copy).

Virtual chunks from many files at once (:func:`write_virtual_refs`): ``refs(item)`` runs on
the executors for each item (a file's URL, say), yields ``(array_path, chunk_coords,
VirtualRef)`` triples, and the driver commits them all once, as :func:`write_partitions` does::

    def refs(url):                           # on the executors: scan one file
        step = int(url.rsplit("-", 1)[1][:4])
        for key, (src, offset, length) in chunk_refs_of(url):
            yield "t2m", (step, *key), VirtualRef(src, offset, length)

    write_virtual_refs(sc.parallelize(urls, 64), repo, refs=refs, setup=create,
                       message="index 40 years of NetCDF")

Reading::

    df = read_array(spark, repo, "grid/temp", ref="main")                 # mode="element"
    df = read_array(spark, repo, "grid/temp", ref="v1", mode="chunk")

``ref`` (branch, tag or snapshot id) is resolved once, on the driver, so the DataFrame is pinned to
one snapshot even if the branch moves later. There is one Spark task per chunk, or per group of
consecutive chunks (``num_partitions``). Row order is unspecified. Two modes:

- ``mode="element"``: one row per array element, columns ``dim_0`` .. ``dim_{n-1}`` (``long``,
  the element's index) and ``value`` (bool -> boolean, int8/16/32/64 -> byte/short/int/long,
  uint8/16/32 -> the next wider signed type, uint64 -> decimal(20,0), float16/32 -> float,
  float64 -> double, strings -> string, fixed-width bytes -> binary). Unwritten chunks read as the
  fill value.
- ``mode="chunk"``: one row per chunk of the chunk grid, columns ``chunk`` (``array<int>``, the
  chunk coordinates), ``shape`` (``array<int>``, the chunk's shape, clipped at the array's edge),
  ``data`` (``binary``: the C-ordered, little-endian raw bytes) and ``dtype`` (``string``: the numpy
  dtype string, e.g. ``"<f8"``). Rebuild a block with
  ``np.frombuffer(row.data, np.dtype(row.dtype)).reshape(row.shape)``. Fixed-width dtypes only.

Executors' Python: both functions first run a one-task job that imports zarrlake on an executor
(once per SparkContext and interpreter) and raise :class:`ExecutorPythonError` if it cannot, in
seconds and before anything is written. On a local master where no ``PYSPARK_PYTHON`` or
``spark.pyspark.python`` names the workers' Python, they run the driver's interpreter, not the
bare ``python3`` PySpark would start (see
:func:`~zarrlake.maintenance.spark_jobs.workers_python`).

pyspark is imported lazily: this module imports without it.
"""

from __future__ import annotations

import contextlib
import decimal
import pickle
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zarrlake.changeset import Changeset
from zarrlake.errors import ExecutorPythonError, InvalidArgument, SparkWriteError, ZarrlakeError
from zarrlake.extras import require
from zarrlake.forks import dump_fork, load_fork, shared_instance
from zarrlake.maintenance.spark_jobs import workers_python
from zarrlake.repository import Repository
from zarrlake.sources import VirtualRef

if TYPE_CHECKING:
    import zarr
    from pyspark import RDD, SparkContext
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BlockWriter",
    "ExecutorPythonError",
    "SparkWriteError",
    "check_executors_python",
    "open_array",
    "read_array",
    "write_partitions",
    "write_virtual_refs",
]

_READ_THREADS = 8


def _require_pyspark(feature: str) -> None:
    require("pyspark", extra="spark", feature=feature)


Writer = Callable[[Any, Iterator[Any]], Any]

_MARK = "[zarrlake-spark]"
_MARK_RE = re.compile(re.escape(_MARK) + r" writer failed on partition (\d+): ([^\n]*)")
_PY_EXC_RE = re.compile(
    r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit)|zarrlake\.errors\.\w+): [^\n]*$", re.M
)


# -- helpers for writers -------------------------------------------------------------------------


def _norm_path(path: str) -> str:
    if not isinstance(path, str):
        raise InvalidArgument(f"array path must be a string, not {type(path).__name__}")
    return path.strip("/")


def open_array(store: Any, path: str, *, mode: str = "r+") -> zarr.Array[Any]:
    """Open the existing array at ``path`` (leading '/' optional) in a (forked) session's store.

    The same as ``zarr.open_array(store, path=path, mode="r+")``; a module-level function, so
    writers that call it pickle cleanly.
    """
    import zarr

    return zarr.open_array(store, path=_norm_path(path), mode=mode)


@dataclass
class BlockWriter:
    """A picklable writer: each partition item is ``(origin, block)`` for the array at ``path``.

    ``origin`` is either a sequence of start indices (the block goes to
    ``array[o0 : o0 + block.shape[0], o1 : ...]``) or a tuple of slices. ``block`` is anything
    ``numpy.asarray`` accepts. Items may also be Rows / mappings with fields ``origin`` and
    ``block``.
    """

    path: str

    def __call__(self, store: Any, items: Iterator[Any]) -> None:
        arr = open_array(store, self.path)
        for item in items:
            if isinstance(item, tuple) and len(item) == 2 and not hasattr(item, "asDict"):
                origin, block = item
            else:
                origin, block = item["origin"], item["block"]
            data = np.asarray(block, dtype=arr.dtype)
            if all(isinstance(o, slice) for o in origin):
                sel = tuple(origin)
            else:
                sel = tuple(
                    slice(int(o), int(o) + n) for o, n in zip(origin, data.shape, strict=True)
                )
            arr[sel] = data


# -- per-worker-process reuse (see zarrlake.forks) --------------------------------------------


def _reuse_repository(repo: Repository) -> Repository:
    if not repo.storage.shared_across_processes:  # each copy is its own store
        return repo
    key = b"repo:" + pickle.dumps(repo, protocol=pickle.HIGHEST_PROTOCOL)
    return shared_instance(key, lambda: repo)


# -- the executors' Python -------------------------------------------------------------------

# Per SparkContext, the interpreters (``pythonExec``) whose executors imported zarrlake.
_probed: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_probed_lock = threading.Lock()
# Why a worker did not start, in the JVM's words or PySpark's.
_WORKER_START_RE = re.compile(
    r'Cannot run program "[^"\n]*": [^\n]*|\[PYTHON_VERSION_MISMATCH\] [^\n]*'
)


def _probe_task() -> Callable[[Iterable[Any]], Iterator[dict[str, Any]]]:
    # A nested function: cloudpickle ships it by value, so it unpickles in a Python without
    # zarrlake (a module-level one would be imported, and fail, before it could say what is
    # missing). Import errors are returned, not raised: a failed task is retried on a cluster.
    def probe(_: Iterable[Any]) -> Iterator[dict[str, Any]]:
        import importlib
        import sys

        found: dict[str, Any] = {"python": sys.executable, "version": list(sys.version_info[:2])}
        try:
            importlib.import_module("zarr")
            # The package root, as the executor has it: it imports the core and its dependencies.
            found["zarrlake"] = importlib.import_module("zarrlake").__version__
        except Exception as e:
            found["error"] = f"{type(e).__name__}: {e}"
        yield found

    return probe


def _driver_zarrlake() -> str:
    # The package root is imported before any of its modules; importing it here would point
    # this layer at the layers above it.
    return str(sys.modules["zarrlake"].__version__)


def _python_error(python: str, spark_python: str, problem: str, reason: str) -> ExecutorPythonError:
    ran = repr(python or spark_python)
    if python and python != spark_python:
        ran += f" (started as {spark_python!r})"
    wanted = (
        f"Python {sys.version_info[0]}.{sys.version_info[1]} with zarrlake {_driver_zarrlake()}"
    )
    return ExecutorPythonError(
        f"Spark's executors' Python {ran} {problem}: set PYSPARK_PYTHON or spark.pyspark.python "
        f"to a {wanted} "
        "installed, or ship such an environment to the executors (spark.archives)",
        python=python or spark_python,
        reason=reason,
    )


def check_executors_python(sc: SparkContext) -> None:
    """Check that ``sc``'s executors run a Python that imports zarrlake, before a job needs it.

    Chooses their interpreter first (:func:`~zarrlake.maintenance.spark_jobs.workers_python`),
    then runs a one-task job that imports zarr and zarrlake there and reports the Python version
    and zarrlake version; it must match the driver's. Once per SparkContext and interpreter.
    Raises :class:`ExecutorPythonError`, naming the interpreter they ran, in seconds (an import
    error fails no task, so nothing is retried).
    """
    spark_python = workers_python(sc)
    with _probed_lock:
        if spark_python in _probed.get(sc, ()):
            return
    try:
        found = sc.parallelize([0], 1).mapPartitions(_probe_task()).collect()[0]
    except Exception as e:  # the worker did not start: no such interpreter, another Python
        started = _WORKER_START_RE.search(str(e))
        reason = started.group(0) if started else _spark_reason(str(e))
        raise _python_error("", spark_python, f"cannot run zarrlake ({reason})", reason) from None
    python = str(found["python"] or "")
    driver = list(sys.version_info[:2])
    if "error" in found:
        reason = found["error"]
        raise _python_error(python, spark_python, f"cannot import zarrlake ({reason})", reason)
    version = _driver_zarrlake()
    if found["version"] != driver or found["zarrlake"] != version:
        reason = (
            f"executors: Python {'.'.join(map(str, found['version']))}, zarrlake "
            f"{found['zarrlake']}; driver: Python {'.'.join(map(str, driver))}, zarrlake "
            f"{version}"
        )
        raise _python_error(python, spark_python, f"is not the driver's ({reason})", reason)
    with _probed_lock:
        _probed.setdefault(sc, set()).add(spark_python)


# -- writing ---------------------------------------------------------------------------------------


def _as_rdd(data: Any) -> RDD[Any]:
    from pyspark import RDD

    if isinstance(data, RDD):
        return data
    rdd = getattr(data, "rdd", None)  # a DataFrame: iterate its Rows
    if rdd is not None and isinstance(rdd, RDD):
        return rdd
    raise InvalidArgument(
        f"write_partitions expects a pyspark RDD or DataFrame, not {type(data).__name__}"
    )


def _check_writable_storage(repo: Repository) -> None:
    storage = repo.storage
    if not storage.shared_across_processes:
        raise InvalidArgument(
            f"write_partitions cannot write to {storage.url} (e.g. Storage.memory()): executors "
            "would write into their own copies of it; use a shared directory or an object store"
        )


def _partition_task(
    fork_bytes: bytes, writer: Writer, *, to_fork: bool = False
) -> Callable[[int, Iterable[Any]], Iterable[Changeset]]:
    """The task of each partition: ``writer(store, items)`` on a fresh copy of the fork (with
    ``to_fork``, ``writer(fork, items)``), then the fork's changes as the task's result."""

    def run(index: int, items: Iterable[Any]) -> Iterator[Changeset]:
        # A fresh copy of the fork for every task (and every task attempt): a retried or
        # speculative attempt never sees another attempt's writes, and Spark keeps the result of
        # exactly one attempt per partition.
        fork = load_fork(fork_bytes)
        try:
            result = writer(fork if to_fork else fork.store, iter(items))
            if isinstance(result, Iterator):
                for _ in result:  # a generator-function writer does its work only when iterated
                    pass
        except Exception as e:
            raise RuntimeError(
                f"{_MARK} writer failed on partition {index}: {type(e).__name__}: {e}"
            ) from e
        yield fork.changeset()

    return run


def _spark_reason(text: str) -> str:
    """The first Python exception in a (Java-wrapped) Spark traceback text, else its first line."""
    return next(
        (
            x.group(0).strip()
            for x in _PY_EXC_RE.finditer(text)
            if not x.group(1).startswith(("org.", "java.", "scala.", "py4j.", "pyspark.errors"))
        ),
        next((line.strip() for line in text.splitlines() if line.strip()), ""),
    )[:500]


def _job_error(exc: BaseException, what: str = "write_partitions") -> SparkWriteError:
    """The error of a failed job of ``what`` (the function that ran it)."""
    text = str(exc)
    m = _MARK_RE.search(text)
    if m:
        part, reason = int(m.group(1)), m.group(2).strip()
        return SparkWriteError(
            f"{what}: writer failed on partition {part}: {reason} (nothing was committed)",
            partition=part,
            reason=reason,
        )
    # Not the writer: name the first Python exception in the (Java-wrapped) traceback text.
    reason = _spark_reason(text) or type(exc).__name__
    return SparkWriteError(
        f"{what}: Spark job failed: {reason} (nothing was committed)", reason=reason
    )


def write_partitions(
    rdd_or_df: Any,
    repo: Repository,
    branch: str = "main",
    *,
    writer: Writer,
    message: str,
    author: str | None = None,
    metadata: dict[str, Any] | None = None,
    setup: Callable[[Any], Any] | None = None,
    allow_empty: bool = False,
) -> str:
    """Run ``writer(store, partition_iterator)`` on each partition; publish all as one commit.

    ``rdd_or_df`` is an RDD or a DataFrame (the writer then iterates Rows). ``setup(store)``, if
    given, runs on the driver's session before the fork (create arrays there). The writer's
    return value is ignored, except that a generator is exhausted. Returns the new commit id.

    Raises :class:`SparkWriteError` if a writer raises or the job fails,
    :class:`~zarrlake.ConflictError` if partitions wrote different data to the same chunk or the
    commit conflicts with concurrent commits, :class:`~zarrlake.NothingToCommit` if nothing
    was written (unless ``allow_empty``), and :class:`ExecutorPythonError`, before ``setup``
    runs, if the executors' Python cannot import zarrlake (:func:`check_executors_python`). In
    every error case nothing is committed. Without pyspark, raises
    :class:`~zarrlake.MissingDependency` (``zarrlake[spark]``).
    """
    _require_pyspark("zarrlake.spark.write_partitions")
    if not callable(writer):
        raise InvalidArgument("writer must be a callable writer(store, partition_iterator)")
    return _commit_partitions(
        rdd_or_df, repo, branch, writer, False, message, author, metadata, setup, allow_empty
    )


#: What :func:`write_virtual_refs` asks of each item: ``(array_path, chunk_coords, VirtualRef)``.
VirtualRefsOf = Callable[[Any], Iterable[tuple[str, tuple[int, ...], VirtualRef]]]
#: Refs a task sets at a time, per array (a task's staged refs stay compact past it).
_VIRTUAL_BATCH = 1 << 16


def write_virtual_refs(
    rdd_or_df: Any,
    repo: Repository,
    branch: str = "main",
    *,
    refs: VirtualRefsOf,
    message: str,
    author: str | None = None,
    metadata: dict[str, Any] | None = None,
    setup: Callable[[Any], Any] | None = None,
    allow_empty: bool = False,
) -> str:
    """Build virtual chunk refs on the executors and publish them all as one commit.

    ``refs(item)`` runs on the executors for each item of ``rdd_or_df`` (a file's URL, say:
    thousands of NetCDF files are scanned at once, each task its own) and yields
    ``(array_path, chunk_coords, VirtualRef)`` triples, as ``session.set_virtual_refs`` takes
    them. ``setup(store)`` runs on the driver's session first (create the arrays there). The
    refs are checked where they are set (a URL outside the repository's virtual containers
    fails the job: nothing is committed); the executors need the containers' credentials only
    if ``refs`` reads the files (the commit reads none). Returns the new commit id. Raises as
    :func:`write_partitions`.
    """
    _require_pyspark("zarrlake.spark.write_virtual_refs")
    if not callable(refs):
        raise InvalidArgument("refs must be a callable refs(item) -> (array_path, coords, ref)s")

    def write(fork: Any, items: Iterator[Any]) -> None:
        batches: dict[str, list[tuple[tuple[int, ...], VirtualRef]]] = {}
        for item in items:
            for array_path, coords, ref in refs(item):
                batch = batches.setdefault(array_path, [])
                batch.append((coords, ref))
                if len(batch) >= _VIRTUAL_BATCH:
                    fork.set_virtual_refs(array_path, batch)
                    batch.clear()
        for array_path, batch in batches.items():
            if batch:
                fork.set_virtual_refs(array_path, batch)

    return _commit_partitions(
        rdd_or_df, repo, branch, write, True, message, author, metadata, setup, allow_empty
    )


def _commit_partitions(
    rdd_or_df: Any,
    repo: Repository,
    branch: str,
    writer: Any,
    to_fork: bool,
    message: str,
    author: str | None,
    metadata: dict[str, Any] | None,
    setup: Callable[[Any], Any] | None,
    allow_empty: bool,
) -> str:
    if not isinstance(message, str):
        raise InvalidArgument("message must be a string")
    rdd = _as_rdd(rdd_or_df)
    _check_writable_storage(repo)
    check_executors_python(rdd.context)

    session = repo.writable_session(branch)
    if setup is not None:
        setup(session.store)
    fork = session.fork()
    fork_bytes = dump_fork(fork)
    try:
        changesets: list[Changeset] = rdd.mapPartitionsWithIndex(
            _partition_task(fork_bytes, writer, to_fork=to_fork)
        ).collect()
    except Exception as e:
        with contextlib.suppress(ZarrlakeError):
            session.discard()
        raise _job_error(e, "write_partitions" if not to_fork else "write_virtual_refs") from e
    session.merge(*changesets)
    return session.commit(message, author=author, metadata=metadata, allow_empty=allow_empty)


# -- reading ---------------------------------------------------------------------------------------


def _value_type(dtype: np.dtype[Any]) -> tuple[Any, Callable[[np.ndarray[Any, Any]], list[Any]]]:
    """The Spark type of the ``value`` column and a block -> list-of-Python-values converter."""
    from pyspark.sql import types as T

    def plain(a: np.ndarray[Any, Any]) -> list[Any]:
        return a.ravel().tolist()

    kind, size = dtype.kind, dtype.itemsize
    if kind == "b":
        return T.BooleanType(), plain
    if kind == "i":
        return {1: T.ByteType(), 2: T.ShortType(), 4: T.IntegerType(), 8: T.LongType()}[size], plain
    if kind == "u":
        if size == 8:
            return T.DecimalType(20, 0), lambda a: [decimal.Decimal(v) for v in a.ravel().tolist()]
        return {1: T.ShortType(), 2: T.IntegerType(), 4: T.LongType()}[size], plain
    if kind == "f":
        return (T.DoubleType() if size == 8 else T.FloatType()), plain
    if kind in "UT" or (kind == "O"):
        return T.StringType(), lambda a: [None if v is None else str(v) for v in a.ravel().tolist()]
    if kind == "S":
        return T.BinaryType(), plain
    raise InvalidArgument(
        f"dtype {dtype} is not supported by read_array(mode='element'); use mode='chunk'"
    )


def _chunk_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    if dtype.kind in "OTV" or dtype.hasobject or dtype.itemsize == 0:
        raise InvalidArgument(
            f"dtype {dtype} has no fixed-width raw form; read it with read_array(mode='element')"
        )
    return dtype.newbyteorder("<")


def _selection(
    coords: Sequence[int], chunks: Sequence[int], shape: Sequence[int]
) -> tuple[slice, ...]:
    return tuple(
        slice(c * n, min((c + 1) * n, s)) for c, n, s in zip(coords, chunks, shape, strict=True)
    )


def read_array(
    spark: SparkSession,
    repo: Repository,
    path: str,
    ref: str = "main",
    *,
    mode: str = "element",
    num_partitions: int | None = None,
) -> DataFrame:
    """The array at ``path`` as of ``ref``, as a DataFrame (see the module docstring for the modes).

    ``ref`` is resolved to a snapshot id now, on the driver, and the executors' Python is checked
    (:func:`check_executors_python`: :class:`ExecutorPythonError` if it cannot import zarrlake).
    ``num_partitions`` is the number of Spark tasks (each reads a group of consecutive chunks); by
    default one task per chunk, at most four per core. Without pyspark, raises
    :class:`~zarrlake.MissingDependency` (``zarrlake[spark]``).
    """
    _require_pyspark("zarrlake.spark.read_array")
    import zarr
    from pyspark.sql import types as T

    if mode not in ("element", "chunk"):
        raise InvalidArgument(f"mode must be 'element' or 'chunk', not {mode!r}")
    apath = _norm_path(path)
    snapshot_id = repo.resolve(ref)
    arr = zarr.open_array(repo.readonly_session(snapshot_id).store, path=apath, mode="r")
    shape = tuple(int(s) for s in arr.shape)
    chunks = tuple(int(c) for c in arr.chunks)
    dtype = np.dtype(arr.dtype)
    ndim = len(shape)
    counts = [-(-s // n) if n else 0 for s, n in zip(shape, chunks, strict=True)]
    grid = [tuple(c) for c in np.ndindex(*counts)]

    # Executors only read: ship the repository without its lock (which may hold connections).
    reader_repo = Repository(repo.storage, repo.record) if repo.lock is not None else repo
    sc = spark.sparkContext
    check_executors_python(sc)  # before the DataFrame fixes which Python its tasks run
    if num_partitions is None:
        num_partitions = min(len(grid), 4 * max(1, sc.defaultParallelism))
    num_partitions = max(1, min(int(num_partitions), max(1, len(grid))))

    if mode == "element":
        vtype, convert = _value_type(dtype)
        schema = T.StructType(
            [T.StructField(f"dim_{i}", T.LongType(), False) for i in range(ndim)]
            + [T.StructField("value", vtype, True)]
        )
    else:
        raw = _chunk_dtype(dtype)
        schema = T.StructType(
            [
                T.StructField("chunk", T.ArrayType(T.IntegerType(), False), False),
                T.StructField("shape", T.ArrayType(T.IntegerType(), False), False),
                T.StructField("data", T.BinaryType(), False),
                T.StructField("dtype", T.StringType(), False),
            ]
        )

    def read_chunks(coords: Iterable[tuple[int, ...]]) -> Iterator[tuple[Any, ...]]:
        from concurrent.futures import ThreadPoolExecutor

        import zarr

        coords = list(coords)
        if not coords:
            return
        session = _reuse_repository(reader_repo).readonly_session(snapshot_id)
        a = zarr.open_array(session.store, path=apath, mode="r")

        def fetch(c: tuple[int, ...]) -> tuple[tuple[int, ...], np.ndarray[Any, Any]]:
            return c, np.asarray(a[_selection(c, chunks, shape)])

        # Object stores are latency-bound: fetch a window of chunks concurrently, emit in order.
        with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(coords))) as pool:
            for start in range(0, len(coords), 2 * _READ_THREADS):
                for c, block in pool.map(fetch, coords[start : start + 2 * _READ_THREADS]):
                    if mode == "chunk":
                        data = np.asarray(block, dtype=raw, order="C")  # keeps 0-d arrays 0-d
                        yield (list(c), list(data.shape), data.tobytes(), raw.str)
                        continue
                    values = convert(block)
                    if ndim == 0:
                        yield (values[0],)
                        continue
                    index = np.indices(block.shape).reshape(ndim, -1)
                    cols = [(index[i] + c[i] * chunks[i]).tolist() for i in range(ndim)]
                    yield from zip(*cols, values, strict=True)

    rdd = sc.parallelize(grid, num_partitions).mapPartitions(read_chunks)
    return spark.createDataFrame(rdd, schema, verifySchema=False)
