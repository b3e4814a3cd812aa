"""Garbage collection and compaction as Spark jobs: the local engines' rules, at any size.

**Compaction** (:func:`compact_spark`) is the local compaction with its work done by executor
tasks. The driver reads only the branch head's shard index (which grows with shards, not chunks)
and cuts the manifest into slices by position (:func:`~zarrlake.maintenance.compact.plan_runs`),
cut where the new, evenly filled shards will begin. A first job tallies what each slice uses of
each pack (:func:`~zarrlake.maintenance.compact.pack_usage`): a pack's chunks may fall into several
slices, so the driver decides which packs are small over the whole manifest
(:func:`~zarrlake.maintenance.compact.small_packs`) and broadcasts the answer. Each task then
reads its slice's shards, packs their small chunk objects and their chunks of those small packs,
cuts the slice into its new shards and writes them
(:func:`~zarrlake.maintenance.compact.compact_run`); the shards are those a re-cut of the whole
manifest in one process would make. Back come the new shard index entries and the moved chunks'
new refs (key and byte range: they are the commit's changes and its transaction log), and one
commit publishes them with the manifest the tasks wrote — or, if a user commit landed meanwhile,
rebases the moves like the local compaction does.

**Garbage collection** (:func:`gc_spark`): the phases are the local engine's
(:mod:`zarrlake.maintenance.gc`), spread over executors:

1. **Plan** (driver): retained snapshots, their history pages and the manifest shards whose
   references are live (:func:`~zarrlake.maintenance.gc.plan_mark`). This grows with snapshots
   and shards, never with chunks.
2. **Mark** (executors): each task reads a slice of those shards and emits the chunk objects and
   packs they reference; Spark deduplicates them. The marks stay a distributed dataset: nothing
   that grows with the number of chunks is collected on the driver.
3. **Sweep** (executors), one kind at a time in the local engine's order (roots first, so a run
   that dies mid-sweep never leaves a snapshot whose data is gone while the snapshot stays): the
   kind's prefixes are listed in parallel partitions (``chunks/00/`` … ``chunks/ff/`` are 256),
   joined with the marks, and every task deletes its unmarked objects older than the grace
   period in batches, each re-checked just before its delete and under the GC lease against
   deduplicating commits (:func:`~zarrlake.maintenance.gc.sweep`), exactly as locally.

Only small per-task tallies come back to the driver, summed into the same :class:`GCReport`.

Executors must reach the repository's storage (S3, or a directory every executor shares) and,
if the repository uses one, its lock service; both travel with the pickled storage and lock.
pyspark is imported lazily.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from zarrlake.commit import BranchLock
from zarrlake.core import RepositoryCore
from zarrlake.errors import ExecutorPythonError, ZarrlakeError
from zarrlake.extras import require
from zarrlake.format.model import OBJECT, RepoRecord, ShardInfo
from zarrlake.maintenance.compact import (
    DEFAULT_PACK_BELOW,
    PACK_TARGET_BYTES,
    CompactReport,
    PackUsage,
    RunResult,
    ShardRun,
    compact,
    compact_run,
    pack_usage,
)
from zarrlake.maintenance.gc import (
    KINDS,
    SWEEP_BATCH,
    GCReport,
    Tally,
    object_id,
    plan_mark,
    report,
    shard_marks,
    sweep,
)
from zarrlake.storage.base import ObjectInfo, Storage

__all__ = ["compact_spark", "gc_spark", "spark_session", "workers_python"]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

# (storage, record, lock), pickled: what every task rebuilds its repository core from.
_Shipped = bytes

_cores: dict[bytes, RepositoryCore] = {}
_cores_lock = threading.Lock()


def _core(shipped: _Shipped) -> RepositoryCore:
    """This executor process's core for the shipped repository (built once per process)."""
    with _cores_lock:
        core = _cores.get(shipped)
        if core is None:
            storage, record, lock = pickle.loads(shipped)
            core = _cores[shipped] = RepositoryCore.build(storage, record, lock)
            while len(_cores) > 8:
                _cores.pop(next(iter(_cores)))
        return core


def spark_session(app: str, master: str | None = None) -> Any:
    """The SparkSession a maintenance job runs on: the active one, or the one ``spark-submit``
    configured, or one on ``master``. Its Python workers run what :func:`workers_python`
    chooses: on a ``local`` master (named, or Spark's default where nothing names one), this
    Python unless ``PYSPARK_PYTHON`` names another. Raises :class:`~zarrlake.MissingDependency`
    (an :class:`ImportError` saying what to install) without pyspark."""
    require("pyspark", extra="spark", feature="the spark engine")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app)
    if master:
        builder = builder.master(master)
    session = builder.getOrCreate()
    workers_python(session.sparkContext)
    return session


# The masters whose executors are processes of this machine (``local-cluster`` starts executor
# JVMs here too): a Python path of the driver's is valid for them.
_LOCAL_MASTER = re.compile(r"local(\[[^\]]*\])?|local-cluster\[[^\]]*\]")
# What a SparkContext's workers run when PYSPARK_PYTHON was unset as it started.
_PYSPARK_DEFAULT_PYTHON = "python3"


def workers_python(sc: Any) -> str:
    """The Python that ``sc``'s Python workers run for the jobs submitted from now on (Spark's
    ``pythonExec``), chosen first where Spark's settings name one and PySpark left it at its
    default: ``spark.pyspark.python``, else ``PYSPARK_PYTHON``, else, on a local master
    (``local``, ``local[N]``, ``local[*]``, ``local-cluster[...]``), this interpreter.

    PySpark reads ``PYSPARK_PYTHON`` only as a context starts and honours
    ``spark.pyspark.python`` only where ``spark-submit`` started the driver; otherwise its workers
    run a bare ``python3``, on a local master whichever comes first on PATH, seldom one with
    zarrlake. Each job's functions carry the interpreter to run them with and Spark starts
    workers per interpreter, lazily, so the change holds for a context that already ran Python
    jobs; workers already running, and RDDs or DataFrames already built, keep theirs. Setting
    ``PYSPARK_PYTHON`` itself in a running driver would change nothing, and is not left behind
    for the processes it starts later, which may submit elsewhere."""
    named = sc.getConf().get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
    if sc.pythonExec == _PYSPARK_DEFAULT_PYTHON:
        if named:
            sc.pythonExec = named
        elif _LOCAL_MASTER.fullmatch(sc.master or ""):
            sc.pythonExec = sys.executable
    return str(sc.pythonExec)


def spark_defaults_to_local(environ: Mapping[str, str], pyspark_home: str) -> bool:
    """Whether a Spark context started by a process with the environment ``environ``, and no
    master named in code, certainly takes spark-submit's default master, ``local[*]``: nothing
    that could name another is there. That is: no ``spark-submit`` started the process (it
    decided the master), no Spark Connect, no ``MASTER``, no mention of a master or of a
    properties file in ``PYSPARK_SUBMIT_ARGS``, and no ``spark-defaults.conf`` or
    ``spark-env.sh`` where spark-submit looks (``SPARK_CONF_DIR``, ``SPARK_HOME/conf``, or
    ``pyspark_home/conf`` for an installed pyspark). When in doubt the answer is no: the
    cluster's own settings then decide the workers' Python, as they would without zarrlake."""
    if any(environ.get(k) for k in ("PYSPARK_GATEWAY_PORT", "SPARK_REMOTE", "MASTER")):
        return False
    submit_args = environ.get("PYSPARK_SUBMIT_ARGS", "")
    if "master" in submit_args or "properties-file" in submit_args:
        return False
    homes = [environ.get("SPARK_HOME") or pyspark_home]
    conf_dirs = [environ.get("SPARK_CONF_DIR") or "", *(os.path.join(h, "conf") for h in homes)]
    return not any(
        os.path.exists(os.path.join(d, name))
        for d in conf_dirs
        if d
        for name in ("spark-defaults.conf", "spark-env.sh")
    )


Job = TypeVar("Job", bound=Callable[..., Any])


def _explained(job: Job) -> Job:
    """``job(core, spark, ...)``, its workers' Python chosen by :func:`workers_python`, whose
    failure because they cannot import zarrlake (an executor image or a ``PYSPARK_PYTHON``
    without it) is an :class:`ExecutorPythonError` that says so, not a worker traceback. Such a
    job fails before it commits anything."""

    @functools.wraps(job)
    def run(core: RepositoryCore, spark: Any, *args: Any, **kwargs: Any) -> Any:
        python = workers_python(spark.sparkContext)
        try:
            return job(core, spark, *args, **kwargs)
        except ZarrlakeError:
            raise
        except Exception as e:
            # The worker's traceback comes back inside the message; the module it missed may be
            # zarrlake or a part of it (executors with another version of zarrlake).
            missing = re.search(r"No module named '(zarrlake[\w.]*)'", str(e))
            if missing is None:
                raise
            raise ExecutorPythonError(
                f"Spark's Python workers cannot import {missing.group(1)} (they run {python!r} "
                "unless the cluster says otherwise): install this zarrlake where the executors "
                "run, or point PYSPARK_PYTHON (spark.pyspark.python) at a Python that has it",
                python=python,
                reason=missing.group(0),
            ) from None

    return run  # type: ignore[return-value]


def _ship(storage: Storage, record: RepoRecord, lock: BranchLock | None) -> _Shipped:
    if not storage.shared_across_processes:
        raise ValueError(
            f"{storage.url} cannot be collected by Spark: executors would each see their own "
            "copy (use S3 or a directory every executor shares)"
        )
    return pickle.dumps((storage, record, lock), protocol=pickle.HIGHEST_PROTOCOL)


def _mark_task(shipped: _Shipped, infos: Iterable[ShardInfo]) -> Iterator[tuple[str, str]]:
    """A mark task: ``(kind, id)`` of every chunk object and pack its shards reference."""
    core = _core(shipped)
    for info in infos:
        for what, ref in shard_marks(core, info):
            if what == OBJECT:
                assert isinstance(ref, bytes)
                yield "chunks", ref.hex()
            else:
                assert isinstance(ref, str)
                yield "packs", ref


def _list_task(shipped: _Shipped, prefixes: Iterable[str]) -> Iterator[tuple[str, str, int, int]]:
    """A listing task: ``(id, key, size, modified µs since the epoch)`` of every object under
    its prefixes. A chunk's id is its normalized hex digest; a name that is not hex (nothing
    zarrlake writes) gets an empty id and is kept, as the local engine keeps it."""
    core = _core(shipped)
    for prefix in prefixes:
        chunks = prefix.startswith("chunks/")
        for obj in core.storage.list(prefix):
            oid = object_id(obj.key)
            if chunks:
                try:
                    oid = bytes.fromhex(oid).hex()
                except ValueError:
                    oid = ""
            micros = (obj.modified - _EPOCH) // dt.timedelta(microseconds=1)
            yield oid, obj.key, obj.size, micros


def _sweep_task(
    shipped: _Shipped, cutoff: dt.datetime, dry_run: bool, rows: Iterable[Any]
) -> Iterator[tuple[int, int, int, int, int]]:
    """A sweep task over ``(id, key, size, modified, live)`` rows: keep the live and the young,
    delete the rest in batches; yields one ``(deleted, deleted_bytes, kept, kept_bytes,
    skipped_young)`` tally."""
    core = _core(shipped)
    tally = Tally()
    young = 0
    batch: list[ObjectInfo] = []
    for oid, key, size, micros, live in rows:
        modified = _EPOCH + dt.timedelta(microseconds=micros)
        is_live = bool(live) or oid == ""
        if is_live or modified > cutoff:
            young += not is_live
            tally.kept += 1
            tally.kept_bytes += size
            continue
        batch.append(ObjectInfo(key, size, modified))
        if len(batch) >= SWEEP_BATCH:
            sweep(core, batch, tally, cutoff, dry_run, None)
            batch = []
    if batch:
        sweep(core, batch, tally, cutoff, dry_run, None)
    yield tally.deleted, tally.deleted_bytes, tally.kept, tally.kept_bytes, young


def _prefixes(storage: Storage, kind: str) -> list[str]:
    """The prefixes one sweep job lists in parallel: the fan-out directories of chunk objects
    (``chunks/<2 hex>/``), one prefix for the other kinds."""
    if kind != "chunks":
        return [kind + "/"]
    return [f"chunks/{d}/" for d in storage.list_dirs("chunks/")]


@_explained
def gc_spark(
    core: RepositoryCore,
    spark: Any,
    *,
    grace: dt.timedelta = dt.timedelta(days=7),
    dry_run: bool = False,
    force: bool = False,
    now: dt.datetime | None = None,
    partitions: int | None = None,
) -> GCReport:
    """Collect garbage of ``core``'s repository with the SparkSession ``spark``; the same
    :class:`GCReport` (and the same deletions) as :func:`zarrlake.maintenance.gc.gc`.

    ``partitions``: tasks per mark job (default: twice the default parallelism). Raises
    :class:`GraceTooShort` like the local engine, and :class:`ValueError` for storage that
    executors cannot share (memory)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    started = time.monotonic()
    shipped = _ship(core.storage, core.record, core.lock)
    plan = plan_mark(core, grace=grace, force=force, now=now)
    sc = spark.sparkContext
    width = partitions or max(2, 2 * sc.defaultParallelism)

    ids = StructType([StructField("kind", StringType()), StructField("id", StringType())])
    shards = plan.shards
    marked = spark.createDataFrame(
        sc.parallelize(shards, max(1, min(width, len(shards)))).mapPartitions(
            lambda infos: _mark_task(shipped, infos)
        ),
        ids,
    )
    known = (
        [("snapshots", s) for s in plan.snapshots]
        + [("txlogs", s) for s in plan.snapshots]
        + [("history", p) for p in plan.pages]
        + [("manifests", info.digest) for info in shards]
    )
    live = (
        marked.unionByName(spark.createDataFrame(known, ids))
        .distinct()
        .withColumn("live", F.lit(True))
        .persist()
    )
    listed = StructType(
        [
            StructField("id", StringType()),
            StructField("key", StringType()),
            StructField("size", LongType()),
            StructField("modified", LongType()),
        ]
    )
    tallies: dict[str, Tally] = {}
    skipped_young = 0
    cutoff = plan.cutoff
    try:
        for kind in KINDS:  # one job per kind, roots first
            prefixes = _prefixes(core.storage, kind)
            tally = tallies[kind] = Tally()
            if not prefixes:
                continue
            listing = spark.createDataFrame(
                sc.parallelize(prefixes, len(prefixes)).mapPartitions(
                    lambda ps: _list_task(shipped, ps)
                ),
                listed,
            )
            judged = listing.join(
                live.where(F.col("kind") == kind).select("id", "live"), on="id", how="left"
            ).select("id", "key", "size", "modified", "live")
            for d, db, k, kb, y in judged.rdd.mapPartitions(
                lambda rows: _sweep_task(shipped, cutoff, dry_run, rows)
            ).collect():
                tally.deleted += d
                tally.deleted_bytes += db
                tally.kept += k
                tally.kept_bytes += kb
                skipped_young += y
    finally:
        live.unpersist()
    return report(tallies, dry_run, len(plan.snapshots), skipped_young, time.monotonic() - started)


def _usage_task(
    shipped: _Shipped, runs: Iterable[ShardRun], pack_below: int
) -> Iterator[PackUsage]:
    core = _core(shipped)
    for run in runs:
        yield pack_usage(core, run, pack_below)


def _run_task(
    shipped: _Shipped,
    runs: Iterable[ShardRun],
    pack_below: int,
    target: int,
    dry_run: bool,
    merge: Any,  # a broadcast frozenset of pack ids, or None
) -> Iterator[RunResult]:
    core = _core(shipped)
    packs = None if merge is None else merge.value
    for run in runs:
        yield compact_run(core, run, pack_below, target, dry_run, packs)


@_explained
def compact_spark(
    core: RepositoryCore,
    spark: Any,
    *,
    branch: str = "main",
    pack_below_bytes: int | None = None,
    keep_journal: dt.timedelta = dt.timedelta(days=7),
    dry_run: bool = False,
    now: dt.datetime | None = None,
    pack_target_bytes: int = PACK_TARGET_BYTES,
    runs: int | None = None,
) -> CompactReport:
    """Compact ``branch`` of ``core``'s repository (see :func:`zarrlake.maintenance.compact.
    compact`) with its manifest cut into ``runs`` slices (default: twice the executors' cores),
    each packed and re-cut by a Spark task; the same report, one commit."""
    shipped = _ship(core.storage, core.record, core.lock)
    sc = spark.sparkContext
    pack_below = DEFAULT_PACK_BELOW if pack_below_bytes is None else pack_below_bytes

    def tally(planned: list[ShardRun]) -> list[PackUsage]:
        rdd = sc.parallelize(planned, len(planned))
        return list(rdd.mapPartitions(lambda rs: _usage_task(shipped, rs, pack_below)).collect())

    def runner(planned: list[ShardRun], dry: bool, merge: frozenset[str] | None) -> list[RunResult]:
        if not planned:
            return []
        # The packs to merge go to every task once (there may be many thousands of them).
        shared = None if merge is None else sc.broadcast(merge)
        try:
            rdd = sc.parallelize(planned, len(planned))
            return list(
                rdd.mapPartitions(
                    lambda rs: _run_task(shipped, rs, pack_below, pack_target_bytes, dry, shared)
                ).collect()
            )
        finally:
            if shared is not None:
                shared.destroy()

    return compact(
        core,
        branch=branch,
        pack_below_bytes=pack_below,
        keep_journal=keep_journal,
        dry_run=dry_run,
        now=now,
        pack_target_bytes=pack_target_bytes,
        runner=runner,
        tally=tally,
        runs=runs if runs is not None else max(1, 2 * int(sc.defaultParallelism)),
    )
