"""GC as a Spark job (real local[2] Spark): it deletes exactly what the local engine deletes.

Each scenario is built once and copied (modification times preserved), then the local engine
collects one copy and Spark the other, with the same clock; what remains must be the same set of
objects, and the reports must agree. Writers during a Spark GC and a driver killed mid-sweep are
covered too.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zarrlake
from test_maintenance import (
    SCATTERED_FULL,
    SMALL_QUARTERS,
    WEEK,
    ZERO,
    block,
    clock_margin,
    compact_at,
    create_array,
    keys,
    later,
    now,
    pack_sizes,
    packs_from_sessions,
    read_array,
    write_blocks,
)
from zarrlake.format.model import PACKED
from zarrlake.maintenance.gc import gc as gc_at
from zarrlake.maintenance.spark_jobs import compact_spark, gc_spark, spark_defaults_to_local

# Chunks as objects of their own: what these tests collect (see conftest).
pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("chunk_objects")]

N = 12  # chunks of the array


def build(storage: zarrlake.Storage) -> tuple[zarrlake.Repository, dt.datetime, dict[str, Any]]:
    """A repository with branches, a tag, expired snapshots, packs, a deleted branch, an
    abandoned session's uploads (all older than the returned cutoff) and a running session's
    uploads (younger). Returns the repository, the cutoff and what every retained ref reads."""
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    create_array(s, N)
    s.commit("create")
    for i in range(1, 5):
        s = repo.writable_session()
        write_blocks(s, {j: float(i * 10 + j % 3) for j in range(N)})
        s.commit(f"c{i}")
    repo.create_tag("v1", "main")
    repo.create_branch("dev")
    s = repo.writable_session("dev")
    write_blocks(s, {0: 99.0, 1: 98.0})
    s.commit("on dev")
    repo.create_branch("tmp")
    s = repo.writable_session("tmp")
    write_blocks(s, {2: 77.0})
    s.commit("only tmp had this")
    repo.delete_branch("tmp")
    s = repo.writable_session()
    write_blocks(s, {j: float(50 + j) for j in range(N)})
    s.commit("c5")
    packed = compact_at(
        repo.core, branch="main", pack_below_bytes=4096, keep_journal=ZERO, now=later()
    )
    assert packed.snapshot is not None
    abandoned = repo.writable_session()
    write_blocks(abandoned, {3: 1234.0, 4: 4321.0})
    abandoned.discard()
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    clock_margin(storage)
    cutoff = now()
    clock_margin(storage)
    running = repo.writable_session("dev")
    write_blocks(running, {5: 5555.0})  # uploaded after the cutoff: young, kept
    reads = {ref: read_array(repo, ref) for ref in ("main", "dev", "v1")}
    return repo, cutoff, reads


def _copy(src: Path, dst: Path) -> zarrlake.Repository:
    shutil.copytree(src, dst, copy_function=shutil.copy2)  # modification times preserved
    return zarrlake.Repository.open(zarrlake.Storage.local(dst))


def test_spark_and_local_gc_delete_the_same_objects(spark: Any, tmp_path: Path) -> None:
    _, cutoff, reads = build(zarrlake.Storage.local(tmp_path / "built"))
    local = _copy(tmp_path / "built", tmp_path / "local")
    distributed = _copy(tmp_path / "built", tmp_path / "spark")
    before = keys(local.storage, "")

    dry = gc_spark(distributed.core, spark, grace=WEEK, now=cutoff + WEEK, dry_run=True)
    assert keys(distributed.storage, "") == before  # a dry run deletes nothing
    mine = gc_at(local.core, grace=WEEK, now=cutoff + WEEK)
    theirs = gc_spark(distributed.core, spark, grace=WEEK, now=cutoff + WEEK, partitions=3)

    assert keys(distributed.storage, "") == keys(local.storage, "")
    deleted = before - keys(local.storage, "")
    kinds = {k.split("/", 1)[0] for k in deleted}
    assert {"chunks", "snapshots", "txlogs", "manifests"} <= kinds, kinds
    for report in (theirs, dry):
        assert report.by_kind == mine.by_kind
        assert (report.deleted_objects, report.kept_objects) == (
            mine.deleted_objects,
            mine.kept_objects,
        )
        assert report.skipped_young == mine.skipped_young > 0
        assert report.marked_snapshots == mine.marked_snapshots
    assert dry.dry_run and not theirs.dry_run
    for ref, content in reads.items():
        np.testing.assert_array_equal(read_array(distributed, ref), content)
    assert distributed.fsck().ok
    # A second run finds nothing left to delete, with either engine.
    assert gc_spark(distributed.core, spark, grace=WEEK, now=cutoff + WEEK).deleted_objects == 0
    assert gc_at(distributed.core, grace=WEEK, now=cutoff + WEEK).deleted_objects == 0


@pytest.mark.slow
@pytest.mark.s3
def test_spark_gc_on_s3_deletes_what_the_local_engine_would(spark: Any, moto_s3: Any) -> None:
    repo, cutoff, reads = build(moto_s3.storage())
    would = gc_at(repo.core, grace=WEEK, now=cutoff + WEEK, dry_run=True)
    assert would.deleted_objects > 0

    # Through the public call, with the real clock: everything is younger than a week.
    public = repo.gc(engine="spark", spark=spark, dry_run=True)
    assert public.deleted_objects == 0 and public.kept_objects > 0
    assert public.by_kind == gc_at(repo.core, grace=WEEK, dry_run=True).by_kind
    done = gc_spark(repo.core, spark, grace=WEEK, now=cutoff + WEEK)
    assert done.by_kind == would.by_kind and not done.dry_run
    again = gc_at(repo.core, grace=WEEK, now=cutoff + WEEK, dry_run=True)
    assert again.deleted_objects == 0
    for ref, content in reads.items():
        np.testing.assert_array_equal(read_array(repo, ref), content)
    assert repo.fsck().ok


def test_the_public_call_refuses_what_the_local_engine_refuses(spark: Any, tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    with pytest.raises(zarrlake.GraceTooShort):
        repo.gc(engine="spark", spark=spark, grace=ZERO)
    with pytest.raises(ValueError, match="unknown gc engine"):
        repo.gc(engine="hadoop")
    memory = zarrlake.Repository.create(zarrlake.Storage.memory())
    with pytest.raises(ValueError, match="executors"):
        memory.gc(engine="spark", spark=spark, grace=WEEK)


def test_a_writer_committing_during_a_spark_gc_loses_nothing(spark: Any, tmp_path: Path) -> None:
    """The writer rewrites values that expired commits held, so its commits deduplicate against
    exactly the objects the sweep is deleting."""
    repo, cutoff, _ = build(zarrlake.Storage.local(tmp_path / "r"))
    committed: dict[str, np.ndarray] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            values = {j: float(((i % 4) + 1) * 10 + j % 3) for j in range(N)}  # c1..c4's bytes
            try:
                s = repo.writable_session("dev")
                write_blocks(s, values)
                sid = s.commit(f"w{i}")
            except zarrlake.ConflictError:
                continue
            except BaseException as e:
                if "retry" in str(e).lower():
                    continue
                errors.append(e)
                return
            committed[sid] = np.concatenate([block(j, v) for j, v in values.items()])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.2)
        report = gc_spark(repo.core, spark, grace=WEEK, now=cutoff + WEEK)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert report.by_kind["chunks"].deleted > 0
    assert committed
    for sid, content in committed.items():
        got = read_array(repo, sid)
        np.testing.assert_array_equal(got[: len(content)], content)
    fsck = repo.fsck()
    assert fsck.ok, fsck.problems


@pytest.mark.slow
@pytest.mark.s3
def test_a_spark_gc_killed_mid_sweep_leaves_a_sound_repository(
    spark: Any, moto_s3: Any, tmp_path: Path
) -> None:
    """kill -9 of the driver (its JVM and Python workers with it) while chunk objects are being
    deleted: fsck accepts what is left, every ref reads as before, and a second run finishes."""
    storage = moto_s3.storage()
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    create_array(s, 8)
    write_blocks(s, {j: float(j + 1) for j in range(8)})
    s.commit("kept")
    reads = {"main": read_array(repo, "main")}
    abandoned = repo.writable_session()
    create_array(abandoned, 1500, path="big")
    write_blocks(abandoned, {j: 3.0 for j in range(1500)}, path="big")
    abandoned.discard()  # 1,500 chunk objects nothing refers to
    garbage = len(keys(storage, "chunks/"))
    assert garbage >= 1500
    when = now() + dt.timedelta(days=30)  # everything unreferenced is past the grace period
    shipped = tmp_path / "storage.pickle"
    shipped.write_bytes(pickle.dumps(storage))
    script = textwrap.dedent(
        f"""
        import datetime as dt, os, pickle
        from pyspark.sql import SparkSession
        import zarrlake
        from zarrlake.maintenance.spark_jobs import gc_spark
        spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
        storage = pickle.loads(open({str(shipped)!r}, "rb").read())
        repo = zarrlake.Repository.open(storage)
        gc_spark(repo.core, spark, grace=dt.timedelta(days=7),
                 now=dt.datetime.fromisoformat({when.isoformat()!r}))
        print("finished", flush=True)
        """
    )
    env = dict(
        os.environ,
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(keys(storage, "chunks/")) > garbage - 50:
            assert proc.poll() is None, "the Spark GC ended before it could be killed"
            assert time.monotonic() < deadline, "the Spark GC never started sweeping chunks"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its JVM and its Python workers
        out, _ = proc.communicate()
    left = len(keys(storage, "chunks/"))
    assert "finished" not in out and 8 < left < garbage - 50, (left, garbage)
    reopened = zarrlake.Repository.open(storage)
    fsck = reopened.fsck()
    assert fsck.ok, fsck.problems
    np.testing.assert_array_equal(read_array(reopened, "main"), reads["main"])

    second = gc_spark(reopened.core, spark, grace=WEEK, now=when)
    assert second.by_kind["chunks"].deleted == left - 8
    assert len(keys(storage, "chunks/")) == 8
    assert gc_at(reopened.core, grace=WEEK, now=when, dry_run=True).deleted_objects == 0
    np.testing.assert_array_equal(read_array(reopened, "main"), reads["main"])
    assert reopened.fsck().ok


def test_the_cli_runs_gc_on_spark(spark: Any, tmp_path: Path, cli: Any) -> None:
    """``zarrlake gc --engine spark`` (the active session here; spark-submit's on a cluster)
    reports what the local engine reports for the same repository and clock."""
    _, _, reads = build(zarrlake.Storage.local(tmp_path / "built"))
    local = _copy(tmp_path / "built", tmp_path / "local")
    distributed = _copy(tmp_path / "built", tmp_path / "spark")
    time.sleep(1.2)  # every object is now older than the 1 s grace, for both runs
    mine = gc_at(local.core, grace=dt.timedelta(seconds=1), force=True)

    r = cli(
        "gc", str(tmp_path / "spark"), "--engine", "spark", "--grace", "1s", "--force", "--json"
    )
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["deleted_objects"] == mine.deleted_objects > 0
    assert doc["by_kind"]["chunks"]["deleted"] == mine.by_kind["chunks"].deleted
    assert keys(distributed.storage, "") == keys(local.storage, "")
    for ref, content in reads.items():
        np.testing.assert_array_equal(read_array(distributed, ref), content)

    r = cli("gc", str(tmp_path / "spark"), "--spark-master", "local[1]")
    assert r.code == 2 and r.err.count("\n") == 1 and "--engine spark" in r.err


def test_spark_compaction_writes_the_packs_the_local_one_writes(
    spark: Any, tmp_path: Path, cli: Any
) -> None:
    """Packs are content-addressed: the same groups make the same pack objects, whichever
    engine wrote them; one commit each, and every ref reads as before."""
    built = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "built"))
    s = built.writable_session()
    create_array(s, 40)
    s.commit("create")
    for i in range(1, 4):
        s = built.writable_session()
        write_blocks(s, {j: float(i * 100 + j) for j in range(0, 40, i)})
        s.commit(f"c{i}")
    reads = read_array(built, "main")
    local = _copy(tmp_path / "built", tmp_path / "local")
    distributed = _copy(tmp_path / "built", tmp_path / "spark")

    mine = compact_at(local.core, branch="main", pack_below_bytes=4096, pack_target_bytes=8 * 1024)
    theirs = compact_spark(
        distributed.core, spark, branch="main", pack_below_bytes=4096, pack_target_bytes=8 * 1024
    )
    assert theirs.packs_written == mine.packs_written > 1  # several packs: several tasks
    assert (theirs.packed_chunks, theirs.shards_after) == (mine.packed_chunks, mine.shards_after)
    assert keys(distributed.storage, "packs/") == keys(local.storage, "packs/")
    assert [c.message for c in distributed.log()] == [c.message for c in local.log()]
    np.testing.assert_array_equal(read_array(distributed, "main"), reads)
    assert {ref[0] for ref in _refs(distributed)} == {PACKED}  # every chunk now in a pack
    assert distributed.fsck().ok

    # From the command line, at the default target: the 8 KiB packs are small packs, merged
    # into one (as the tail packs sessions leave are); after that nothing small is left.
    r = cli("compact", str(tmp_path / "spark"), "--engine", "spark", "--json")
    assert r.code == 0, r.err
    assert (json.loads(r.out)["packed_chunks"], json.loads(r.out)["packs_written"]) == (40, 1)
    np.testing.assert_array_equal(read_array(distributed, "main"), reads)
    r = cli("compact", str(tmp_path / "spark"), "--engine", "spark", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["packed_chunks"] == 0


def test_spark_compaction_cuts_the_manifest_in_parallel_tasks_as_one_process_would(
    spark: Any, tmp_path: Path
) -> None:
    """Many runs, whose slices begin and end inside old shards: the tasks write the shards a
    re-cut in one process writes (same boundaries, same counts), every small chunk is packed,
    and one commit publishes them."""
    config = zarrlake.RepositoryConfig(shard_max_refs=8)
    built = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "built"), config=config)
    s = built.writable_session()
    create_array(s, 120)
    write_blocks(s, {j: float(j) for j in range(120)})
    s.commit("120 chunks")
    s = built.writable_session()
    write_blocks(s, {j: 0.0 for j in range(120) if j % 8 >= 3})  # 3 of every 8 stay: thin shards
    s.commit("thin out")
    reads = read_array(built, "main")
    shards_before = built.core.objects.snapshot(built.resolve("main")).shards
    assert len(shards_before) > 10 and sum(x.count < 4 for x in shards_before) > 1

    local = _copy(tmp_path / "built", tmp_path / "local")
    distributed = _copy(tmp_path / "built", tmp_path / "spark")
    mine = compact_at(local.core, branch="main", pack_below_bytes=4096)
    theirs = compact_spark(distributed.core, spark, branch="main", pack_below_bytes=4096, runs=4)

    def layout(repo: zarrlake.Repository) -> list[tuple[str, str, int]]:
        shards = repo.core.objects.snapshot(repo.resolve("main")).shards
        return [(x.first, x.last, x.count) for x in shards]

    assert layout(distributed) == layout(local)  # the very cut of the one-process re-cut
    assert max(c for _, _, c in layout(local)) <= 8 and len(layout(local)) < len(shards_before)
    assert (theirs.packed_chunks, theirs.shards_after) == (mine.packed_chunks, mine.shards_after)
    assert theirs.packed_chunks == sum(x.count for x in shards_before)
    assert theirs.packs_written == 3  # 6 new shards in runs of 2: one pack per task
    messages = [c.message for c in distributed.log()]
    assert messages[0].startswith("Compaction") and messages[1:3] == ["thin out", "120 chunks"]
    np.testing.assert_array_equal(read_array(distributed, "main"), reads)
    assert {ref[0] for ref in _refs(distributed)} == {PACKED}
    assert distributed.fsck(verify_content=True).ok

    dry = compact_spark(distributed.core, spark, branch="main", dry_run=True, runs=4)
    assert dry.packed_chunks == 0 and dry.snapshot is None  # nothing left to do


def test_spark_compaction_decides_which_packs_are_small_over_the_whole_manifest(
    spark: Any, tmp_path: Path
) -> None:
    """The tasks first tally what they use of each pack; the driver decides which packs to merge
    and hands every task the same answer: the packs and commit of a local compaction in as many
    runs, whatever part of a pack each task sees."""
    eighths = [list(range(k * 256, k * 256 + 128)) for k in range(8)]  # 8 packs of 128 KiB
    for name, sessions, runs, packed in (
        ("full", SCATTERED_FULL, 4, 0),  # two 1 MiB packs, a part in every task: not small
        ("quarters", SMALL_QUARTERS, 4, 0),  # four tasks would write four small packs again
        ("eighths", eighths, 2, 1024),  # two tasks write two packs (1 MiB in all), not eight
    ):
        packs_from_sessions(zarrlake.Storage.local(tmp_path / name), sessions)
        local = _copy(tmp_path / name, tmp_path / f"{name}-local")
        distributed = _copy(tmp_path / name, tmp_path / f"{name}-spark")
        content = read_array(local, "main")
        mine = compact_at(local.core, branch="main", runs=runs)
        theirs = compact_spark(distributed.core, spark, branch="main", runs=runs)
        assert theirs.packed_chunks == mine.packed_chunks == packed, (name, theirs)
        assert theirs.packs_written == mine.packs_written
        assert keys(distributed.storage, "packs/") == keys(local.storage, "packs/")
        np.testing.assert_array_equal(read_array(distributed, "main"), content)
        again = compact_spark(distributed.core, spark, branch="main", runs=runs)
        assert again.packed_chunks == 0, (name, again)
    made = [n for n in pack_sizes(distributed) if n != 128 * 1024]  # (GC takes the eight)
    assert len(made) == 2 and sum(made) == 1 << 20, made
    assert distributed.fsck(verify_content=True).ok


def test_the_cli_runs_local_spark_workers_on_its_own_python(tmp_path: Path) -> None:
    """``zarrlake compact --engine spark --spark-master local[1]`` from an installation whose
    environment is not activated: the ``python3`` first on PATH has no zarrlake, and Spark's
    local workers must not be started with it (they failed with ModuleNotFoundError)."""
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("PySpark needs a Java runtime")
    packs_from_sessions(zarrlake.Storage.local(tmp_path / "repo"), SMALL_QUARTERS)
    bare = Path(sys.base_prefix) / "bin" / "python3"  # this venv's base: no zarrlake in it
    assert subprocess.run([bare, "-c", "import zarrlake"], capture_output=True).returncode != 0
    shims = tmp_path / "bin"
    shims.mkdir()
    for name in ("python", "python3"):
        (shims / name).symlink_to(bare)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        PATH=f"{shims}{os.pathsep}{env.get('PATH', '')}",
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_SUBMIT_ARGS="--conf spark.ui.enabled=false pyspark-shell",
    )
    argv = ["compact", str(tmp_path / "repo"), "--engine", "spark", "--spark-master", "local[1]"]
    done = subprocess.run(
        [sys.executable, "-m", "zarrlake", *argv, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["packed_chunks"] == 1024  # the four small packs merged

    # Workers told to run a Python without zarrlake (as an executor image without it would):
    # a one-line error that says so, and the repository as it was.
    before = {o.key for o in zarrlake.Storage.local(tmp_path / "repo").list("")}
    env["PYSPARK_PYTHON"] = str(bare)
    failed = subprocess.run(
        [sys.executable, "-m", "zarrlake", "gc", str(tmp_path / "repo"), "--engine", "spark",
         "--spark-master", "local[1]", "--grace", "0s", "--force"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("zarrlake: error: Spark's Python workers cannot import zarrlake "), last
    assert str(bare) in last
    assert {o.key for o in zarrlake.Storage.local(tmp_path / "repo").list("")} == before

    # ``repo.gc(engine="spark")`` from a script that names no master and no Python: Spark takes
    # its default master, local[*], whose workers must run this Python too.
    del env["PYSPARK_PYTHON"]
    script = (
        "import datetime as dt, json, sys, numpy as np, zarr, zarrlake\n"
        "repo = zarrlake.Repository.open(zarrlake.Storage.local(sys.argv[1]))\n"
        "s = repo.writable_session('main')\n"  # two 512 KiB chunk objects, never committed
        "zarr.create_array(s.store, name='junk', shape=(2 << 16,), chunks=(1 << 16,),\n"
        "                  dtype='u8', compressors=None)[:] = np.arange(1, 1 + (2 << 16))\n"
        "report = repo.gc(engine='spark', grace=dt.timedelta(0), force=True)\n"
        "import os\n"
        "print(json.dumps({'deleted': report.deleted_objects,\n"
        "                  'left': os.environ.get('PYSPARK_PYTHON')}))\n"
    )
    collected = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "repo")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stderr[-2000:]
    answer = json.loads(collected.stdout.strip().splitlines()[-1])
    assert answer == {"deleted": 2, "left": None}  # (not left for processes it starts later)
    assert zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / "repo")).fsck().ok


@pytest.mark.parametrize(
    ("environ", "files", "local"),
    [
        ({}, {}, True),  # nothing names a master: spark-submit's default, local[*]
        ({"PYSPARK_SUBMIT_ARGS": "--conf spark.ui.enabled=false pyspark-shell"}, {}, True),
        # Whatever could name a master leaves the workers' Python to Spark's settings, even a
        # local one (the safe side: pointing a cluster's executors at this machine's
        # interpreter would break them).
        ({"PYSPARK_SUBMIT_ARGS": "--master k8s://https://api:6443 pyspark-shell"}, {}, False),
        ({"PYSPARK_SUBMIT_ARGS": "-c spark.master=spark://h:7077 pyspark-shell"}, {}, False),
        ({"PYSPARK_SUBMIT_ARGS": "--conf=spark.master=yarn pyspark-shell"}, {}, False),
        ({"PYSPARK_SUBMIT_ARGS": "--properties-file /etc/spark.conf pyspark-shell"}, {}, False),
        ({"PYSPARK_SUBMIT_ARGS": "--master local[2] pyspark-shell"}, {}, False),
        ({"MASTER": "spark://head:7077"}, {}, False),
        ({"PYSPARK_GATEWAY_PORT": "40000"}, {}, False),  # spark-submit started this process
        ({"SPARK_REMOTE": "sc://connect:15002"}, {}, False),  # Spark Connect
        ({}, {"conf/spark-defaults.conf": "spark.master spark://head:7077\n"}, False),
        ({}, {"conf/spark-env.sh": "export MASTER=spark://head:7077\n"}, False),
        ({}, {"conf/log4j2.properties": ""}, True),  # a conf folder with no master in it
        ({"SPARK_CONF_DIR": "{tmp}/etc"}, {"etc/spark-defaults.conf": ""}, False),
    ],
)
@pytest.mark.parametrize("home", ["SPARK_HOME", "pyspark"])
def test_which_spark_settings_leave_the_default_local_master(
    tmp_path: Path, environ: dict[str, str], files: dict[str, str], local: bool, home: str
) -> None:
    # Where no master is named in code and nothing names one, the default master is local and
    # its workers must run this Python (a bare ``python3`` on PATH has no zarrlake).
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    environ = {k: v.format(tmp=tmp_path) for k, v in environ.items()}
    if home == "SPARK_HOME":  # spark-submit's conf folder: $SPARK_HOME/conf
        environ["SPARK_HOME"] = str(tmp_path)
        assert spark_defaults_to_local(environ, str(tmp_path / "unused")) is local
    else:  # an installed pyspark's own folder, where SPARK_HOME is not set
        assert spark_defaults_to_local(environ, str(tmp_path)) is local


def _refs(repo: zarrlake.Repository) -> list[Any]:
    from zarrlake.format import manifest

    snap = repo.core.objects.snapshot(repo.resolve("main"))
    return [ref for _, ref in manifest.iter_all(snap.shards, repo.core.objects.shard)]
