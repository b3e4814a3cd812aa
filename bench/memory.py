"""Memory benchmark: peak RSS of a commit that publishes a million chunk refs, and of garbage
collection over a million chunk objects (issue 11: ≤ 200 MB and ≤ 300 MB).

    python bench/memory.py                        # 1,000,000 refs + 100,000 garbage chunks
    python bench/memory.py --quick                # 100,000 refs + 10,000 garbage chunks
    python bench/memory.py --refs 300000 --trace  # where the memory goes (tracemalloc, by line)
    python bench/memory.py --json bench/results/memory.json --workdir /tmp/mem
    python bench/memory.py --packs                # the chunks written into packs (the default
                                                  # for small chunks) instead of objects

What is built (local file system, a temporary directory removed afterwards): a repository whose
inline threshold is 0 and packing at write time is off, so every chunk — 8 bytes, one int64 — is a
content-addressed chunk object and its ref the full (object, digest, size) kind (``--packs``: the
chunks go into packs as they are written, and the refs are packed ones). One session creates a
one-dimensional array of ``refs`` one-element chunks through Zarr, writes every chunk through the
session's store (the encoded bytes Zarr would write; going through Zarr's array API costs the same
for every engine and is not what is measured), and commits. Then a second session writes
``garbage`` chunks with other values and is discarded: its chunk objects (or packs) are garbage.

What is measured, each step in a fresh spawned process:

- ``commit``: the session's writes and its commit. Peak RSS of the whole step, and of the commit
  alone (Linux's peak is reset just before ``commit()`` through ``/proc/self/clear_refs``; what the
  session holds before the commit is in both);
- ``gc``: garbage collection with grace 0 (forced) over every object of the repository: wall time,
  peak RSS, objects deleted and kept;
- ``baseline``: a process that only imports zarrlake and opens the repository.

With ``--trace``, each step also runs tracemalloc and prints the lines that held the most memory
at the step's peak-prone point (end of the commit's writes; GC's first sweep batch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARRAY = "data"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _status(field: str) -> float:
    """A ``/proc/self/status`` field in MiB (VmHWM: peak RSS; VmRSS: current)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _top(snapshot: tracemalloc.Snapshot, n: int = 12) -> list[str]:
    stats = snapshot.statistics("lineno")[:n]
    return [f"{s.size / 2**20:8.1f} MiB {s.count:>9,} blocks  {s.traceback}" for s in stats]


def _write_chunks(session: Any, start: int, stop: int, sign: int, threads: int = 4) -> None:
    """Chunks ``start..stop`` with values ``sign * (i + 1)``, through the session's store."""

    def batch(lo: int) -> None:
        hi = min(stop, lo + 10_000)
        values = (np.arange(lo, hi, dtype="<i8") + 1) * sign
        for i, v in zip(range(lo, hi), values, strict=True):
            session.write(f"{ARRAY}/c/{i}", v.tobytes())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(batch, range(start, stop, 10_000)))


def _step(root: str, op: str, args: dict[str, Any], out: Any) -> None:
    import zarr

    import zarrlake

    trace = args.get("trace", False)
    report: dict[str, Any] = {}
    storage = zarrlake.Storage.local(root)
    if op == "commit":
        n, garbage = args["refs"], args["garbage"]
        # Objects unless asked for packs: then the chunks go into packs as they are written
        # (the default for chunks this small), and the session holds packed refs.
        packs = {} if args["packs"] else {"pack_chunks_below_bytes": 0}
        repo = zarrlake.Repository.create(storage, config={"inline_threshold_bytes": 0, **packs})
        report["start_rss_mib"] = _status("VmRSS")
        if trace:
            tracemalloc.start()
        s = repo.writable_session()
        zarr.create_array(
            s.store, name=ARRAY, shape=(n,), chunks=(1,), dtype="<i8", compressors=None
        )
        t0 = time.perf_counter()
        _write_chunks(s, 0, n, 1)
        report["write_s"] = time.perf_counter() - t0
        report["before_commit_rss_mib"] = _status("VmRSS")
        if trace:
            report["trace_before_commit"] = _top(tracemalloc.take_snapshot())
        _reset_peak()
        t0 = time.perf_counter()
        s.commit(f"{n} chunks")
        report["commit_s"] = time.perf_counter() - t0
        report["commit_peak_rss_mib"] = _status("VmHWM")
        if trace:
            report["traced_commit_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        del s
        g = repo.writable_session()
        _write_chunks(g, 0, garbage, -1)
        g.flush()  # (packs: written, then dropped with the session)
        g.discard()
    elif op == "gc":
        repo = zarrlake.Repository.open(storage)
        report["start_rss_mib"] = _status("VmRSS")
        if trace:
            tracemalloc.start()
        traced: list[list[str]] = []

        def on_progress(phase: str, _count: int) -> None:
            if trace and phase == "sweep" and not traced:
                traced.append(_top(tracemalloc.take_snapshot()))

        t0 = time.perf_counter()
        r = repo.gc(grace=dt.timedelta(0), force=True, progress=on_progress)
        report["gc_s"] = time.perf_counter() - t0
        report["gc"] = r.to_json()
        if trace:
            report["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
            report["trace_first_sweep"] = traced[0] if traced else []
            tracemalloc.stop()
    elif op == "check":
        repo = zarrlake.Repository.open(storage)
        arr = zarr.open_array(repo.readonly_session().store, path=ARRAY, mode="r")
        n = args["refs"]
        picks = np.random.default_rng(5).integers(0, n, 200)
        for i in picks:
            if int(arr[int(i)]) != int(i) + 1:
                raise AssertionError(f"chunk {i} reads {arr[int(i)]}, not {i + 1}")
        report["checked"] = len(picks)
    elif op == "baseline":
        zarrlake.Repository.open(storage)
    else:
        raise ValueError(op)
    report["peak_rss_mib"] = _status("VmHWM")
    out.put(report)


def step(root: str, op: str, **args: Any) -> dict[str, Any]:
    """Run ``op`` in a fresh spawned process (its own peak RSS) and return its report."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_step, args=(root, op, args, out))
    proc.start()
    result: dict[str, Any] = out.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{op} failed (exit {proc.exitcode})")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100,000 refs")
    p.add_argument("--refs", type=int, help="chunk refs the commit publishes (default 1,000,000)")
    p.add_argument("--garbage", type=int, help="garbage chunk objects (default refs / 10)")
    p.add_argument("--trace", action="store_true", help="tracemalloc: where memory goes, by line")
    p.add_argument(
        "--packs", action="store_true", help="chunks written into packs (refs into packs)"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workdir", type=Path, help="keep the repository here (default: a temp dir)")
    args = p.parse_args(argv)
    refs = args.refs or (100_000 if args.quick else 1_000_000)
    garbage = args.garbage if args.garbage is not None else refs // 10
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="zarrlake-memory-")) if own else args.workdir
    root = str(workdir / "repo")
    results: dict[str, Any] = {"refs": refs, "garbage": garbage}
    try:
        progress(f"commit of {refs:,} chunk refs (and {garbage:,} garbage chunks)")
        results["commit"] = step(
            root, "commit", refs=refs, garbage=garbage, trace=args.trace, packs=args.packs
        )
        progress(json.dumps({k: v for k, v in results["commit"].items() if "trace" not in k}))
        results["baseline"] = step(root, "baseline")
        progress(f"gc over {refs + garbage:,} chunk objects")
        results["gc"] = step(root, "gc", trace=args.trace)
        progress(json.dumps({k: v for k, v in results["gc"].items() if "trace" not in k}))
        results["check"] = step(root, "check", refs=refs)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    c, g = results["commit"], results["gc"]
    kind = "packs" if args.packs else "chunks"
    deleted = g["gc"]["by_kind"][kind]["deleted"]
    kept = g["gc"]["by_kind"][kind]["kept"]
    gc_line = (
        f"GC over {refs + garbage:,} chunks in packs ({deleted:,} packs deleted, {kept:,} kept)"
        if args.packs
        else f"GC over {refs + garbage:,} chunk objects ({deleted:,} deleted, {kept:,} kept)"
    )
    print(
        "\n".join(
            [
                "| measurement | value |",
                "| --- | ---: |",
                f"| baseline process (open repository), peak RSS | "
                f"{results['baseline']['peak_rss_mib']:.0f} MiB |",
                f"| write {refs:,} chunks in one session | {c['write_s']:.1f} s |",
                f"| RSS before commit (session holds {refs:,} refs) | "
                f"{c['before_commit_rss_mib']:.0f} MiB |",
                f"| commit of {refs:,} refs | {c['commit_s']:.2f} s |",
                f"| commit of {refs:,} refs, peak RSS | {c['commit_peak_rss_mib']:.0f} MiB |",
                f"| writes + commit, peak RSS | {c['peak_rss_mib']:.0f} MiB |",
                f"| {gc_line} | {g['gc_s']:.1f} s |",
                f"| GC, peak RSS | {g['peak_rss_mib']:.0f} MiB |",
            ]
        )
    )
    for name in ("commit", "gc"):
        for key, lines in results[name].items():
            if key.startswith("trace_"):
                print(f"\n{name} {key}:\n" + "\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
