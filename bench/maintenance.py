"""Maintenance benchmark: expiry + garbage collection and compaction on a large repository, and
small-chunk reads before and after packing, against raw Zarr and Icechunk.

    python bench/maintenance.py                 # 100,000 chunk objects, 1,000 commits (+ S3)
    python bench/maintenance.py --quick         # 10,000 chunk objects, 100 commits
    python bench/maintenance.py --no-s3 --markdown bench/results/maintenance.md

What is built: a local repository whose ``data`` array receives ``commits`` commits, each writing
``objects / commits`` new 1 KiB chunks (unique bytes, so every write is a new chunk object) into a
sliding window, plus a ``small`` array of 1 KiB chunks written once (the read benchmark). The S3
repository (its own ``moto_server``, started and stopped by process id) is a tenth of that size:
moto keeps objects in a Python dict and is far slower than S3 itself.

What is measured:

- expiry (keep the last ``keep`` commits), then GC with grace 0 (forced): wall time, the peak
  resident memory of the process that ran it (each maintenance step runs in a fresh spawned
  process; ``baseline`` is such a process that only opened the repository), objects and bytes
  freed and kept;
- compaction of ``main``: wall time, chunks packed, packs written; the data objects (chunk objects
  + packs) of the repository once the pre-compaction history is expired and collected;
- reading the whole ``small`` array on a freshly opened repository, best of 3: zarrlake before and
  after packing, raw Zarr on a ``LocalStore`` (one file per chunk), and Icechunk 1.x (no packing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

import zarrlake
from zarrlake_testkit.servers import start_moto, stop

CHUNK = 128  # float64 elements: 1 KiB chunks, above zarrlake's 512-byte inline threshold
ZERO = dt.timedelta(0)
os.environ.setdefault("ICECHUNK_LOG", "error")


@dataclass(frozen=True)
class Sizes:
    objects: int  # chunk objects the commits write
    commits: int
    array_chunks: int  # chunks in the `data` array: the window slides over it
    small_chunks: int  # chunks in the `small` array (reads)
    keep: int  # commits expiry keeps

    def scaled(self, factor: int) -> Sizes:
        return Sizes(
            self.objects // factor,
            self.commits // factor,
            max(self.array_chunks // factor, 1),
            max(self.small_chunks // factor, 100),
            max(self.keep // factor, 1),
        )


FULL = Sizes(objects=100_000, commits=1_000, array_chunks=20_000, small_chunks=10_000, keep=100)
QUICK = Sizes(objects=10_000, commits=100, array_chunks=2_000, small_chunks=2_000, keep=10)


_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- an S3 API server of our own -----------------------------------------------------------------


@dataclass
class Moto:
    proc: subprocess.Popen[bytes]
    endpoint: str
    bucket: str = "zarrlake-maintenance-bench"

    @classmethod
    def start(cls) -> Moto:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        proc, endpoint = start_moto()
        server = cls(proc, endpoint)
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1").create_bucket(
            Bucket=server.bucket
        )
        return server

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"

    def stop(self) -> None:
        stop(self.proc)


# -- building the repository ---------------------------------------------------------------------


def small_data(n_chunks: int) -> np.ndarray:
    return np.random.default_rng(1).random(n_chunks * CHUNK)


def create_array(store: Any, name: str, n_chunks: int) -> zarr.Array:
    return zarr.create_array(
        store,
        name=name,
        shape=(n_chunks * CHUNK,),
        chunks=(CHUNK,),
        dtype="f8",
        compressors=None,
        fill_value=0.0,
    )


def build(url: str, sizes: Sizes) -> dict[str, float]:
    """The repository the maintenance steps work on; returns build statistics."""
    repo = zarrlake.Repository.create(zarrlake.Storage.from_url(url))
    t0 = time.perf_counter()
    s = repo.writable_session()
    create_array(s.store, "data", sizes.array_chunks)
    create_array(s.store, "small", sizes.small_chunks)[:] = small_data(sizes.small_chunks)
    s.commit("create")
    window = sizes.objects // sizes.commits
    for i in range(sizes.commits):
        start = (i * window) % sizes.array_chunks
        values = np.arange(window * CHUNK, dtype="f8") + float(i) * 1e7 + 1.0
        s = repo.writable_session()
        arr = zarr.open_array(s.store, path="data", mode="r+")
        if start + window <= sizes.array_chunks:
            arr[start * CHUNK : (start + window) * CHUNK] = values
        else:  # the window wraps around the end of the array
            head = sizes.array_chunks - start
            arr[start * CHUNK :] = values[: head * CHUNK]
            arr[: (window - head) * CHUNK] = values[head * CHUNK :]
        s.commit(f"commit {i}")
        if (i + 1) % max(1, sizes.commits // 10) == 0:
            progress(f"  {i + 1}/{sizes.commits} commits")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "commits_per_s": sizes.commits / seconds}


def inventory(url: str) -> dict[str, tuple[int, int]]:
    """Objects and bytes per kind."""
    storage = zarrlake.Storage.from_url(url)
    out: dict[str, tuple[int, int]] = {}
    for kind in ("chunks", "packs", "manifests", "snapshots", "txlogs", "refs"):
        n = size = 0
        for info in storage.list(kind + "/"):
            n += 1
            size += info.size
        out[kind] = (n, size)
    return out


# -- maintenance steps, each in a fresh process --------------------------------------------------


def _step(url: str, op: str, args: dict[str, Any], out: Any) -> None:
    from zarrlake.maintenance.gc import gc

    repo = zarrlake.Repository.open(zarrlake.Storage.from_url(url))
    t0 = time.perf_counter()
    if op == "baseline":
        report: dict[str, Any] = {"branches": len(repo.list_branches())}
    elif op == "expire":
        rules = zarrlake.RetentionRules(default=zarrlake.Keep(last=args["keep"]))
        r = repo.expire(rules)
        report = {"expired": len(r.expired), "retained": r.retained}
    elif op == "gc":
        traced = args.get("traced", False)
        if traced:
            tracemalloc.start()
        report = gc(repo.core, grace=ZERO, force=True, dry_run=args.get("dry_run", False)).to_json()
        if traced:
            report["python_heap_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
    elif op == "compact":
        report = repo.compact(keep_journal=ZERO).to_json()
    else:
        raise ValueError(op)
    seconds = time.perf_counter() - t0
    out.put({"seconds": seconds, "peak_rss_mib": peak_rss_mib(), "report": report})


def peak_rss_mib() -> float:
    """This process's peak resident memory. Linux's ``ru_maxrss`` survives ``execve``, so a
    process spawned by a big parent would report the parent's size: read ``VmHWM`` instead."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step(url: str, op: str, **args: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_step, args=(url, op, args, out))
    proc.start()
    result = out.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{op} failed (exit {proc.exitcode})")
    return result


# -- reads ---------------------------------------------------------------------------------------


def best_of(rounds: int, fn: Callable[[], np.ndarray], expected: np.ndarray) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = fn()
        best = min(best, time.perf_counter() - t0)
        if not np.array_equal(got, expected):
            raise AssertionError("read back different data")
    return best


def read_zarrlake(url: str) -> np.ndarray:
    repo = zarrlake.Repository.open(zarrlake.Storage.from_url(url))  # fresh: no caches
    return zarr.open_array(repo.readonly_session().store, path="small", mode="r")[:]


def raw_zarr_local(workdir: Path, data: np.ndarray, rounds: int) -> float:
    path = workdir / "raw-zarr"
    store = zarr.storage.LocalStore(str(path))
    create_array(store, "small", len(data) // CHUNK)[:] = data
    return best_of(
        rounds,
        lambda: zarr.open_array(zarr.storage.LocalStore(str(path)), path="small", mode="r")[:],
        data,
    )


def icechunk_read(storage_factory: Callable[[], Any], data: np.ndarray, rounds: int) -> float:
    import icechunk

    repo = icechunk.Repository.create(storage_factory())
    session = repo.writable_session("main")
    create_array(session.store, "small", len(data) // CHUNK)[:] = data
    session.commit("small")

    def read() -> np.ndarray:
        fresh = icechunk.Repository.open(storage_factory())
        return zarr.open_array(fresh.readonly_session("main").store, path="small", mode="r")[:]

    return best_of(rounds, read, data)


# -- one backend, start to finish -----------------------------------------------------------------


@dataclass
class Result:
    backend: str
    sizes: Sizes
    build: dict[str, float] = field(default_factory=dict)
    before: dict[str, tuple[int, int]] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    expire: dict[str, Any] = field(default_factory=dict)
    gc_dry: dict[str, Any] = field(default_factory=dict)
    gc_traced: dict[str, Any] = field(default_factory=dict)
    gc: dict[str, Any] = field(default_factory=dict)
    compact: dict[str, Any] = field(default_factory=dict)
    gc_after_compact: dict[str, Any] = field(default_factory=dict)
    after_gc: dict[str, tuple[int, int]] = field(default_factory=dict)
    after_compact: dict[str, tuple[int, int]] = field(default_factory=dict)
    reads: dict[str, float] = field(default_factory=dict)  # system -> seconds


def run_backend(backend: str, url: str, sizes: Sizes, workdir: Path, moto: Moto | None) -> Result:
    res = Result(backend, sizes)
    progress(f"{backend}: building {sizes.objects:,} chunk objects in {sizes.commits:,} commits")
    res.build = build(url, sizes)
    res.before = inventory(url)
    data = small_data(sizes.small_chunks)
    rounds = 3

    progress(f"{backend}: reading the small array (before packing)")
    res.reads["zarrlake, chunk objects"] = best_of(rounds, lambda: read_zarrlake(url), data)

    res.baseline = step(url, "baseline")
    progress(f"{backend}: expire (keep the last {sizes.keep})")
    res.expire = step(url, "expire", keep=sizes.keep)
    progress(f"{backend}: gc --dry-run (and once more under tracemalloc)")
    res.gc_dry = step(url, "gc", dry_run=True)
    res.gc_traced = step(url, "gc", dry_run=True, traced=True)
    progress(f"{backend}: gc")
    res.gc = step(url, "gc")
    res.after_gc = inventory(url)
    progress(f"{backend}: compact")
    res.compact = step(url, "compact")
    step(url, "expire", keep=1)  # the pre-compaction history goes, so its chunk objects can
    res.gc_after_compact = step(url, "gc")
    res.after_compact = inventory(url)
    repo = zarrlake.Repository.open(zarrlake.Storage.from_url(url))
    fsck = repo.fsck()
    if not fsck.ok:
        raise AssertionError(f"fsck after maintenance: {fsck.problems[:3]}")

    progress(f"{backend}: reading the small array (after packing)")
    res.reads["zarrlake, packed"] = best_of(rounds, lambda: read_zarrlake(url), data)
    if backend == "local":
        progress("local: raw Zarr and Icechunk reading the same array")
        res.reads["raw Zarr (LocalStore)"] = raw_zarr_local(workdir, data, rounds)
        try:
            import icechunk

            path = workdir / "icechunk"
            res.reads["Icechunk 1.x"] = icechunk_read(
                lambda: icechunk.local_filesystem_storage(str(path)), data, rounds
            )
        except ImportError:
            pass
    elif moto is not None:
        try:
            import icechunk

            def s3() -> Any:
                return icechunk.s3_storage(
                    bucket=moto.bucket,
                    prefix="icechunk",
                    endpoint_url=moto.endpoint,
                    region="us-east-1",
                    allow_http=True,
                    force_path_style=True,
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                )

            progress("s3: Icechunk reading the same array")
            res.reads["Icechunk 1.x"] = icechunk_read(s3, data, rounds)
        except ImportError:
            pass
    return res


# -- output --------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def tables(results: list[Result]) -> list[tuple[str, list[str], list[list[str]]]]:
    gc_rows, compact_rows, read_rows = [], [], []
    for r in results:
        chunks_before = r.before["chunks"][0]
        gc = r.gc["report"]
        gc_rows.append(
            [
                r.backend,
                f"{chunks_before:,}",
                f"{r.sizes.commits:,}",
                f"{r.expire['report']['expired']:,}",
                f"{r.expire['seconds']:.2f} s",
                f"{r.gc_dry['seconds']:.2f} s",
                f"{r.gc['seconds']:.2f} s",
                f"{r.gc['peak_rss_mib']:.0f} MiB (baseline {r.baseline['peak_rss_mib']:.0f})",
                f"{r.gc_traced['report']['python_heap_peak_mib']:.1f} MiB",
                f"{gc['deleted_objects']:,}",
                _mib(gc["deleted_bytes"]),
                f"{gc['kept_objects']:,}",
            ]
        )
        c = r.compact["report"]
        data_before = r.after_gc["chunks"][0] + r.after_gc["packs"][0]
        data_after = r.after_compact["chunks"][0] + r.after_compact["packs"][0]
        compact_rows.append(
            [
                r.backend,
                f"{c['packed_chunks']:,} ({_mib(c['packed_bytes'])})",
                f"{c['packs_written']}",
                f"{c['shards_before']} → {c['shards_after']}",
                f"{r.compact['seconds']:.2f} s",
                f"{r.compact['peak_rss_mib']:.0f} MiB",
                f"{data_before:,} → {data_after:,}",
                f"{r.gc_after_compact['seconds']:.2f} s",
            ]
        )
        n = r.sizes.small_chunks
        base = r.reads.get("zarrlake, chunk objects")
        for system, seconds in r.reads.items():
            read_rows.append(
                [
                    r.backend,
                    system,
                    f"{n:,}",
                    f"{seconds:.3f} s",
                    f"{n * CHUNK * 8 / seconds / 2**20:,.1f} MiB/s",
                    f"{n / seconds:,.0f}",
                    f"{seconds / base:.2f}x" if base else "",
                ]
            )
    return [
        (
            "Expiry + GC (grace 0)",
            [
                "backend",
                "chunk objects",
                "commits",
                "expired",
                "expire",
                "gc dry run",
                "gc",
                "gc peak RSS",
                "gc heap peak",
                "objects freed",
                "bytes freed",
                "objects kept",
            ],
            gc_rows,
        ),
        (
            "Compaction of main (then expiry of the older history + GC)",
            [
                "backend",
                "chunks packed",
                "packs",
                "shards",
                "compact",
                "compact peak RSS",
                "data objects",
                "gc after",
            ],
            compact_rows,
        ),
        (
            "Reading the whole small-chunk array (1 KiB chunks, fresh client, best of 3)",
            ["backend", "system", "chunks", "time", "throughput", "chunks/s", "vs unpacked"],
            read_rows,
        ),
    ]


def render_text(results: list[Result]) -> str:
    out = []
    for title, headers, rows in tables(results):
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        out.append(title)
        for line in [headers, ["-" * w for w in widths], *rows]:
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        out.append("")
    return "\n".join(out)


def render_markdown(results: list[Result], meta: str) -> str:
    out = ["# zarrlake maintenance benchmark", "", meta, ""]
    for title, headers, rows in tables(results):
        out += [f"## {title}", "", "| " + " | ".join(headers) + " |"]
        out.append("|" + "|".join("---" for _ in headers) + "|")
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10,000 objects, 100 commits")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) repository")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    parser.add_argument("--json", metavar="FILE", help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    workdir = Path(tempfile.mkdtemp(prefix="zarrlake-maint-bench-"))
    moto = None
    results: list[Result] = []
    started = time.perf_counter()
    try:
        results.append(
            run_backend("local", zarrlake.Storage.local(workdir / "repo").url, sizes, workdir, moto)
        )
        if not args.no_s3:
            moto = Moto.start()
            results.append(run_backend("s3", moto.url("repo"), sizes.scaled(10), workdir, moto))
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    text = render_text(results)
    print(text)
    meta = (
        f"{'quick' if args.quick else 'full'} run, {time.perf_counter() - started:.0f} s, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"zarr {zarr.__version__}, Python {sys.version.split()[0]}"
    )
    print(meta)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_markdown(results, meta))
    if args.json:
        Path(args.json).write_text(
            json.dumps([vars(r) | {"sizes": vars(r.sizes)} for r in results], indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
