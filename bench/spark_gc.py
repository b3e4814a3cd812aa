"""GC at scale (issue 13): the local engine and Spark (``local[2]``) on the same repositories.

    python bench/spark_gc.py                  # 250,000 and 1,000,000 chunk objects
    python bench/spark_gc.py --quick          # 25,000 and 100,000
    python bench/spark_gc.py --markdown bench/results/spark_gc.md

Each size is a local repository built like ``bench/maintenance.py`` builds its own: ``commits``
commits, each rewriting the whole ``data`` array of 1,000 1 KiB chunks with new values (1,000
new chunk objects a commit).
Expiry keeps the last 10 commits, so nearly every chunk object is garbage. The repository is then
copied (``cp -a``, modification times kept), and each engine collects one copy with a grace of
zero (forced), in a fresh process: wall time, and the peak resident memory of the process that
ran it (for Spark: the Python driver, and separately its JVM, which in ``local[2]`` also hosts
the executors). The two copies must end with the same objects.

The sizes differ by 4x: the local engine's memory grows with the chunk marks it holds; the Spark
driver's must not (it only plans from snapshots and shards; marks and listings stay in Spark).
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zarrlake

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maintenance import Sizes, build, peak_rss_mib

PER_COMMIT = 1000
_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def _children_peak_mib(name: str) -> float:
    """Peak resident memory of this process's children called ``name`` (the Spark JVM)."""
    me = str(os.getpid())
    peak = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("PPid", "").strip() == me and fields.get("Name", "").strip() == name:
            peak = max(peak, int(fields.get("VmHWM", "0 kB").split()[0]) / 1024)
    return peak


def _run(root: str, engine: str, out: Any) -> None:
    from zarrlake.maintenance.gc import gc
    from zarrlake.maintenance.spark_jobs import gc_spark

    repo = zarrlake.Repository.open(zarrlake.Storage.local(root))
    zero = dt.timedelta(0)
    jvm = 0.0
    if engine == "spark":
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.shuffle.partitions", "16")
            .getOrCreate()
        )
        t0 = time.perf_counter()
        report = gc_spark(repo.core, spark, grace=zero, force=True)
        seconds = time.perf_counter() - t0
        jvm = _children_peak_mib("java")
        spark.stop()
    else:
        t0 = time.perf_counter()
        report = gc(repo.core, grace=zero, force=True)
        seconds = time.perf_counter() - t0
    out.put(
        {
            "seconds": seconds,
            "driver_rss_mib": peak_rss_mib(),
            "jvm_rss_mib": jvm,
            "deleted": report.deleted_objects,
            "kept": report.kept_objects,
        }
    )


def run(root: Path, engine: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run, args=(str(root), engine, out))
    proc.start()
    result = out.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{engine} gc failed (exit {proc.exitcode})")
    return dict(result)


def objects(root: Path) -> set[str]:
    storage = zarrlake.Storage.local(root)
    return {o.key for o in storage.list("")}


def measure(objects_n: int, workdir: Path, keep: int = 10) -> dict[str, Any]:
    commits = objects_n // PER_COMMIT
    sizes = Sizes(
        objects=objects_n,
        commits=commits,
        array_chunks=PER_COMMIT,  # every commit rewrites the whole array: old chunks become garbage
        small_chunks=100,
        keep=keep,
    )
    built = workdir / f"built-{objects_n}"
    progress(f"building {objects_n:,} chunk objects in {commits:,} commits")
    build(str(built), sizes)
    repo = zarrlake.Repository.open(zarrlake.Storage.local(built))
    expired = repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=sizes.keep)))
    chunk_objects = sum(1 for _ in repo.storage.list("chunks/"))
    progress(f"  {chunk_objects:,} chunk objects, {len(expired.expired):,} snapshots expired")
    row: dict[str, Any] = {"objects": chunk_objects, "snapshots": commits + 1}
    for engine in ("local", "spark"):
        copy = workdir / f"{engine}-{objects_n}"
        subprocess.run(["cp", "-a", str(built), str(copy)], check=True)
        progress(f"  gc, {engine} engine")
        row[engine] = run(copy, engine)
        progress(f"    {row[engine]}")
    row["same_objects"] = objects(workdir / f"local-{objects_n}") == objects(
        workdir / f"spark-{objects_n}"
    )
    for path in workdir.iterdir():
        shutil.rmtree(path)
    return row


def render(rows: list[dict[str, Any]], meta: str) -> str:
    lines = [
        f"GC at scale, local engine vs Spark local[2], {meta}",
        "",
        "| chunk objects | snapshots | engine | time | objects/s | driver peak RSS | JVM peak RSS "
        "| deleted | same objects left |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        for engine in ("local", "spark"):
            r = row[engine]
            jvm = f"{r['jvm_rss_mib']:.0f} MiB" if engine == "spark" else "—"
            lines.append(
                f"| {row['objects']:,} | {row['snapshots']:,} | {engine} | {r['seconds']:.1f} s "
                f"| {row['objects'] / r['seconds']:,.0f} | {r['driver_rss_mib']:.0f} MiB | {jvm} "
                f"| {r['deleted']:,} | {'yes' if row['same_objects'] else 'NO'} |"
            )
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        growth = b["objects"] / a["objects"]
        lines += ["", f"Driver peak RSS when the repository grows {growth:.1f}x:", ""]
        for engine in ("local", "spark"):
            lines.append(
                f"- {engine}: {a[engine]['driver_rss_mib']:.0f} → "
                f"{b[engine]['driver_rss_mib']:.0f} MiB "
                f"({b[engine]['driver_rss_mib'] / a[engine]['driver_rss_mib']:.2f}x)"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help="chunk objects per run, comma-separated")
    p.add_argument(
        "--keep",
        type=int,
        default=10,
        help="commits expiry keeps (default 10: nearly all garbage; 1000000: all live, the marks "
        "grow with the repository)",
    )
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([25_000, 100_000] if args.quick else [250_000, 1_000_000])
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="zarrlake-spark-gc-") as tmp:
        for n in sizes:
            rows.append(measure(n, Path(tmp), args.keep))
    meta = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = render(
        rows, f"{meta}, expiry keeps {args.keep} commits" + (" (quick)" if args.quick else "")
    )
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    return 0 if all(r["same_objects"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
