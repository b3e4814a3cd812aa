"""zarrlake.spark on a real local[2] SparkSession, against a local directory and S3 (moto)."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake

pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("PySpark needs a Java runtime", allow_module_level=True)

from zarrlake.spark import (
    BlockWriter,
    SparkWriteError,
    open_array,
    read_array,
    write_partitions,
    write_virtual_refs,
)

pytestmark = [
    pytest.mark.spark,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

ROWS, COLS = 64, 30  # an 8 x 3 grid of (8, 10) chunks
CHUNKS = (8, 10)
NBLOCKS = ROWS // CHUNKS[0]


@pytest.fixture(scope="module", autouse=True)
def _writers_by_value() -> Iterator[None]:
    """The writers below live in this test module, which executors cannot import: ship them by
    value."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def spark_repo(request: pytest.FixtureRequest, tmp_path: Path) -> zarrlake.Repository:
    if request.param == "local":
        storage = zarrlake.Storage.local(tmp_path / "repo")
    else:
        storage = request.getfixturevalue("moto_s3").storage()
    return zarrlake.Repository.create(storage)


def expected_grid() -> np.ndarray:
    return (np.arange(ROWS * COLS, dtype="f8").reshape(ROWS, COLS) * 0.5) - 17.0


def create_grid(store: Any, name: str = "g/temp") -> None:
    zarr.create_array(store, name=name, shape=(ROWS, COLS), chunks=CHUNKS, dtype="f8", fill_value=0)


def commit_grid(repo: zarrlake.Repository, name: str = "g/temp") -> str:
    s = repo.writable_session("main")
    create_grid(s.store, name)
    return s.commit(f"create {name}")


def write_row_blocks(store: Any, blocks: Iterator[int]) -> None:
    """One chunk-aligned block of rows per item."""
    arr = open_array(store, "/g/temp")
    full = expected_grid()
    for b in blocks:
        rows = slice(b * CHUNKS[0], (b + 1) * CHUNKS[0])
        arr[rows, :] = full[rows, :]


def write_or_fail(store: Any, blocks: Iterator[int]) -> None:
    arr = zarr.open_array(store, path="g/temp", mode="r+")
    for b in blocks:
        if b == 5:
            raise ValueError(f"boom on block {b}")
        arr[b * CHUNKS[0] : (b + 1) * CHUNKS[0], :] = b


def write_same_chunk(store: Any, blocks: Iterator[int]) -> None:
    arr = open_array(store, "g/temp")
    for b in blocks:
        arr[0 : CHUNKS[0], 0 : CHUNKS[1]] = b  # every partition: a different value, same chunk


def write_and_commit_elsewhere(
    repo: zarrlake.Repository, store: Any, blocks: Iterator[int]
) -> None:
    """Block 0's task also makes an ordinary commit to another array while the job runs."""
    mine = list(blocks)
    if 0 in mine:
        other = repo.writable_session("main")
        zarr.open_array(other.store, path="other", mode="r+")[:] = np.arange(6)
        other.commit("concurrent plain commit", author="someone-else")
    write_row_blocks(store, iter(mine))


def head_and_log(repo: zarrlake.Repository) -> tuple[str, list[str]]:
    return repo.lookup_branch("main"), [c.id for c in repo.log("main")]


def read_grid(
    repo: zarrlake.Repository, ref: str = "main", name: str = "g/temp"
) -> np.ndarray[Any, Any]:
    fresh = zarrlake.Repository.open(repo.storage)  # no caches shared with the writer
    return np.asarray(zarr.open_array(fresh.readonly_session(ref).store, path=name, mode="r")[:])


# -- write_partitions ------------------------------------------------------------------------------


def test_partitions_write_one_commit(spark: Any, spark_repo: zarrlake.Repository) -> None:
    repo = spark_repo
    head0, log0 = head_and_log(repo)
    rdd = spark.sparkContext.parallelize(range(NBLOCKS), NBLOCKS)
    assert rdd.getNumPartitions() == NBLOCKS >= 8

    commit_id = write_partitions(
        rdd,
        repo,
        "main",
        writer=write_row_blocks,
        setup=create_grid,
        message="fill g/temp",
        author="spark-job",
        metadata={"job": "t1"},
    )

    head, log = head_and_log(repo)
    assert head == commit_id
    assert log == [commit_id, *log0]  # exactly one new commit, on top of the old head
    info = next(repo.log("main"))
    assert info.parents == (head0,)
    assert (info.message, info.author, info.metadata) == ("fill g/temp", "spark-job", {"job": "t1"})
    np.testing.assert_array_equal(read_grid(repo), expected_grid())
    diff = repo.diff(head0, commit_id)
    assert diff.added_nodes >= {"/g", "/g/temp"}
    assert diff.changed_chunks["/g/temp"] == {(i, j) for i in range(NBLOCKS) for j in range(3)}

    # and back through Spark, pinned to the commit: 3 tasks of 8 chunks each
    df = read_array(spark, repo, "g/temp", ref=commit_id, num_partitions=3)
    assert df.rdd.getNumPartitions() == 3
    assert df.schema["value"].dataType.simpleString() == "double"
    got = np.full((ROWS, COLS), np.nan)
    for r in df.collect():
        got[r.dim_0, r.dim_1] = r.value
    np.testing.assert_array_equal(got, expected_grid())


def create_raw_grid(store: Any) -> None:
    """The grid uncompressed: every (8, 10) float chunk is 640 bytes, a chunk object."""
    zarr.create_array(
        store,
        name="g/temp",
        shape=(ROWS, COLS),
        chunks=CHUNKS,
        dtype="f8",
        fill_value=0,
        compressors=None,
    )


@pytest.mark.usefixtures("chunk_objects")  # chunks named by the hash: objects, not packs
@pytest.mark.parametrize("content_hash", ["blake3", "sha256"])
def test_partitions_name_chunks_by_the_repository_hash(
    spark: Any, tmp_path: Path, content_hash: str
) -> None:
    # Executors hash what they write: with the repository's recorded hash, not a default.
    import hashlib

    import blake3

    from zarrlake.format import manifest
    from zarrlake.format.model import OBJECT, chunk_key

    digest = {"blake3": blake3.blake3, "sha256": hashlib.sha256}[content_hash]
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage, content_hash=content_hash)
    rdd = spark.sparkContext.parallelize(range(NBLOCKS), 4)
    write_partitions(
        rdd, repo, writer=write_row_blocks, setup=create_raw_grid, message="hashed by executors"
    )
    np.testing.assert_array_equal(read_grid(repo), expected_grid())
    objects = repo.core.objects
    snap = objects.snapshot(repo.lookup_branch("main"))
    refs = [r for _, r in manifest.iter_all(snap.shards, objects.shard) if r[0] == OBJECT]
    assert len(refs) == NBLOCKS * 3
    for ref in refs:
        assert digest(storage.get(chunk_key(ref[1].hex()))).digest() == ref[1]
    report = repo.fsck(verify_content=True)
    assert report.ok, report.problems


def test_dataframe_input(spark: Any, spark_repo: zarrlake.Repository) -> None:
    repo = spark_repo
    commit_grid(repo)
    head0, log0 = head_and_log(repo)
    # Rows computed by Spark SQL alone (no Python stage upstream): one chunk-aligned block each.
    r, c = CHUNKS[0], COLS
    df = spark.range(NBLOCKS, numPartitions=4).selectExpr(
        f"array(id * {r}, 0) AS origin",
        f"transform(sequence(0, {r - 1}), i -> transform(sequence(0, {c - 1}), "
        f"j -> CAST((id * {r} + i) * {c} + j AS DOUBLE) * 0.5 - 17.0)) AS block",
    )
    assert df.rdd.getNumPartitions() == 4

    commit_id = write_partitions(
        df, repo, writer=BlockWriter("/g/temp"), message="from a DataFrame"
    )

    assert head_and_log(repo) == (commit_id, [commit_id, *log0])
    np.testing.assert_array_equal(read_grid(repo), expected_grid())
    assert repo.diff(head0, commit_id).changed_chunks["/g/temp"] == {
        (i, j) for i in range(NBLOCKS) for j in range(3)
    }


def test_concurrent_commit_during_job_is_rebased(
    spark: Any, spark_repo: zarrlake.Repository
) -> None:
    repo = spark_repo
    s = repo.writable_session("main")
    create_grid(s.store)
    zarr.create_array(s.store, name="other", shape=(6,), chunks=(3,), dtype="i8", fill_value=-1)
    head0 = s.commit("create arrays")
    rdd = spark.sparkContext.parallelize(range(NBLOCKS), NBLOCKS)

    commit_id = write_partitions(
        rdd,
        repo,
        "main",
        writer=functools.partial(write_and_commit_elsewhere, repo),
        message="job commit",
    )

    log = list(repo.log("main", limit=3))
    assert [c.message for c in log] == ["job commit", "concurrent plain commit", "create arrays"]
    assert log[0].id == commit_id == repo.lookup_branch("main")
    assert log[0].parents == (log[1].id,)  # the job's session started at head0, then rebased
    assert log[1].parents == (head0,)
    np.testing.assert_array_equal(read_grid(repo), expected_grid())
    np.testing.assert_array_equal(read_grid(repo, name="other"), np.arange(6))


def test_memory_storage_is_refused(spark: Any) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    head0 = repo.lookup_branch("main")
    with pytest.raises(ValueError, match="memory"):
        write_partitions(
            spark.sparkContext.parallelize([0]), repo, writer=write_row_blocks, message="x"
        )
    assert repo.lookup_branch("main") == head0


def test_tasks_in_one_process_share_one_object_store(tmp_path: Path) -> None:
    # A fork travels to the executors as bytes; every task in a worker process unpickles its own
    # copy, and all of them share one ObjectStore (client, connections, caches) per storage.
    from zarrlake.forks import dump_fork, load_fork

    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    session = repo.writable_session("main")
    create_grid(session.store)
    data = dump_fork(session.fork())
    a, b = load_fork(data), load_fork(data)
    assert a.objects is b.objects
    # ... but not their changesets: a task never sees another task's (or attempt's) writes.
    open_array(a.store, "g/temp")[0:8, 0:10] = 1.0
    assert not a.changeset().is_empty()
    assert b.changeset().is_empty()


def test_memory_forks_are_never_shared() -> None:
    from zarrlake.forks import dump_fork, load_fork

    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    data = dump_fork(repo.writable_session("main").fork())
    a, b = load_fork(data), load_fork(data)
    assert a.objects is not b.objects  # each copy of a memory storage is its own store


def test_read_array_with_a_locked_repository(spark: Any, tmp_path: Path) -> None:
    from zarrlake.locks import LocalLock

    # Executors only read: the lock stays on the driver.
    lock = LocalLock(tmp_path / "locks")
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"), lock=lock)
    s = repo.writable_session("main")
    zarr.create_array(s.store, name="v", shape=(6,), chunks=(4,), dtype="i8", fill_value=0)[:] = (
        np.arange(6)
    )
    s.commit("v")
    rows = read_array(spark, repo, "v").collect()
    assert sorted((r.dim_0, r.value) for r in rows) == [(i, i) for i in range(6)]
    assert repo.lock is lock


# -- read_array ----------------------------------------------------------------------------------


def test_read_array_modes_round_trip(spark: Any, spark_repo: zarrlake.Repository) -> None:
    repo = spark_repo
    shape, chunks = (13, 7), (5, 3)  # edge chunks are partial
    data = (np.arange(13 * 7, dtype="i4").reshape(shape) * 3) - 50
    s = repo.writable_session("main")
    arr = zarr.create_array(
        s.store, name="g/ints", shape=shape, chunks=chunks, dtype="i4", fill_value=-1
    )
    arr[:10, :] = data[:10, :]  # rows 10..12 stay unwritten: the fill value
    s.commit("ints v1")
    repo.create_tag("v1", "main")
    v1 = np.where(np.arange(13)[:, None] < 10, data, -1)
    s = repo.writable_session("main")
    zarr.open_array(s.store, path="g/ints", mode="r+")[:] = data + 1000
    s.commit("ints v2")

    # element mode, pinned to the tag while the branch has moved on
    df = read_array(spark, repo, "g/ints", ref="v1")
    assert df.columns == ["dim_0", "dim_1", "value"]
    assert [f.dataType.simpleString() for f in df.schema.fields] == ["bigint", "bigint", "int"]
    rows = df.collect()
    assert len(rows) == data.size
    out = np.full(shape, 12345, dtype="i4")
    for r in rows:
        out[r.dim_0, r.dim_1] = r.value
    np.testing.assert_array_equal(out, v1)
    assert len({(r.dim_0, r.dim_1) for r in rows}) == data.size

    # chunk mode, leading '/', the branch head
    df = read_array(spark, repo, "/g/ints", mode="chunk")
    assert df.columns == ["chunk", "shape", "data", "dtype"]
    assert [f.dataType.simpleString() for f in df.schema.fields] == [
        "array<int>",
        "array<int>",
        "binary",
        "string",
    ]
    rows = df.collect()
    assert sorted(tuple(r.chunk) for r in rows) == [(i, j) for i in range(3) for j in range(3)]
    out = np.full(shape, 12345, dtype="i4")
    for r in rows:
        assert r.dtype == "<i4"
        block = np.frombuffer(r.data, np.dtype(r.dtype)).reshape(r.shape)
        i, j = r.chunk
        assert list(block.shape) == [min(5, 13 - 5 * i), min(3, 7 - 3 * j)]
        out[5 * i : 5 * i + block.shape[0], 3 * j : 3 * j + block.shape[1]] = block
    np.testing.assert_array_equal(out, data + 1000)


def test_read_array_dtypes_and_shapes(spark: Any, tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    values = {
        "flags": np.array([True, False, True]),
        "big": np.array([0, 2**64 - 1, 5], dtype="u8"),
        "f4": np.array([1.5, np.nan, -2.0], dtype="f4"),
        "be": np.array([1, -2, 3], dtype=">i4"),
        "scalar": np.array(3.25),
        "when": np.array(["2020-01-01", "2021-06-01"], dtype="M8[s]"),
    }
    s = repo.writable_session("main")
    for name, v in values.items():
        a = zarr.create_array(s.store, name=name, shape=v.shape, dtype=v.dtype, chunks=v.shape)
        a[...] = v
    s.commit("dtypes")

    def element(name: str) -> tuple[str, list[Any]]:
        df = read_array(spark, repo, name)
        rows = sorted(df.collect(), key=lambda r: r.dim_0)
        return df.schema["value"].dataType.simpleString(), [r.value for r in rows]

    assert element("flags") == ("boolean", [True, False, True])
    assert element("big") == ("decimal(20,0)", [0, 2**64 - 1, 5])
    f4_type, f4 = element("f4")
    assert f4_type == "float"
    np.testing.assert_array_equal(np.array(f4, dtype="f4"), values["f4"])
    assert element("be") == ("int", [1, -2, 3])
    scalar = read_array(spark, repo, "scalar").collect()
    assert [r.asDict() for r in scalar] == [{"value": 3.25}]
    with pytest.raises(TypeError, match="mode='chunk'"):
        read_array(spark, repo, "when")

    for name in ("be", "when", "scalar"):
        (row,) = read_array(spark, repo, name, mode="chunk").collect()
        assert row.dtype == values[name].dtype.newbyteorder("<").str
        got = np.frombuffer(row.data, np.dtype(row.dtype)).reshape(row.shape)
        np.testing.assert_array_equal(got, values[name])
        assert row.chunk == [0] * values[name].ndim


# -- failures (last: a failed Spark task costs its Python worker, the next job starts new ones)


def test_partitions_writing_one_chunk_differently_conflict(spark: Any, tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    commit_grid(repo)
    head0, log0 = head_and_log(repo)
    rdd = spark.sparkContext.parallelize(range(4), 4)

    with pytest.raises(zarrlake.ConflictError) as ei:
        write_partitions(rdd, repo, "main", writer=write_same_chunk, message="never lands")
    assert zarrlake.Conflict("chunk", "/g/temp", (0, 0)) in ei.value.conflicts
    assert head_and_log(repo) == (head0, log0)


def test_writer_error_commits_nothing(spark: Any, spark_repo: zarrlake.Repository) -> None:
    repo = spark_repo
    commit_grid(repo)
    head0, log0 = head_and_log(repo)
    rdd = spark.sparkContext.parallelize(range(NBLOCKS), NBLOCKS)

    with pytest.raises(SparkWriteError, match=r"partition 5: ValueError: boom on block 5") as ei:
        write_partitions(rdd, repo, "main", writer=write_or_fail, message="never lands")
    assert isinstance(ei.value, zarrlake.ZarrlakeError)
    assert ei.value.partition == 5
    assert "nothing was committed" in str(ei.value)
    assert head_and_log(repo) == (head0, log0)
    np.testing.assert_array_equal(read_grid(repo), np.zeros((ROWS, COLS)))


# -- write_virtual_refs ----------------------------------------------------------------------------


def refs_of_file(url: str) -> Iterator[tuple[str, tuple[int, ...], zarrlake.VirtualRef]]:
    """On the executors: one file, one row of chunks (its name says which), pinned by mtime."""
    import datetime as dt

    path = url[len("file://") :]
    step = int(path.rsplit("-", 1)[1].split(".")[0])
    mtime = dt.datetime.fromtimestamp(os.stat(path).st_mtime, dt.UTC)
    for j in range(4):
        yield "v", (step, j), zarrlake.VirtualRef(url, 8 * j, 8, last_modified=mtime)


def test_virtual_refs_built_on_the_executors_land_as_one_commit(spark: Any, tmp_path: Path) -> None:
    files = tmp_path / "archive"
    files.mkdir()
    steps = 24
    expected = np.arange(steps * 32, dtype="u1").reshape(steps, 32)
    urls = []
    for i in range(steps):
        (files / f"step-{i}.bin").write_bytes(expected[i].tobytes())
        urls.append((files / f"step-{i}.bin").as_uri())
    config = {"virtual_containers": [{"url_prefix": files.as_uri() + "/"}]}
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"), config=config)
    _, log0 = head_and_log(repo)

    def create(store: Any) -> None:
        zarr.create_array(store, name="v", shape=(steps, 32), chunks=(1, 8), dtype="u1",
                          compressors=None, fill_value=0)  # fmt: skip

    rdd = spark.sparkContext.parallelize(urls, 6)
    commit_id = write_virtual_refs(
        rdd, repo, refs=refs_of_file, setup=create, message="index the archive"
    )
    head, log = head_and_log(repo)
    assert head == commit_id and log == [commit_id, *log0]
    np.testing.assert_array_equal(read_grid(repo, name="v"), expected)
    ref = repo.readonly_session().resolve("v/c/3/2")
    assert isinstance(ref, tuple) and ref[1] == urls[3] and ref[5] is not None  # pinned

    # A ref outside the containers fails the job on its executor: nothing is committed.
    def outside(url: str) -> Iterator[tuple[str, tuple[int, ...], zarrlake.VirtualRef]]:
        yield "v", (0, 0), zarrlake.VirtualRef("file:///etc/passwd", 0, 8)

    with pytest.raises(SparkWriteError, match="VirtualContainerNotAllowed"):
        write_virtual_refs(rdd, repo, refs=outside, message="no")
    assert head_and_log(repo) == (commit_id, log)
    with pytest.raises(zarrlake.InvalidArgument, match="refs must be a callable"):
        write_virtual_refs(rdd, repo, refs=None, message="no")  # type: ignore[arg-type]
