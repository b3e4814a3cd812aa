"""Per-read overhead of zarrlake against raw Zarr on the same data (issue 11's read path).

Writes N small chunks (1 KiB, uncompressed) once into a local zarrlake repository and into a raw
Zarr ``LocalStore`` directory, then times, on freshly opened stores:

- ``full``: reading the whole array in one Zarr call (N chunks through Zarr's async machinery);
- ``random``: single-chunk reads at random positions, one Zarr call each.

and prints microseconds per chunk for both and their difference (zarrlake's own overhead).
Run it under a profiler to see where that difference goes, e.g.::

    py-spy record --native -o read.svg -- python bench/profile_read.py --chunks 20000 --only zl
    python bench/profile_read.py --chunks 2000 --packed        # after compaction (packs)

``--only zl`` / ``--only zarr`` time one system (a profile of one). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

import zarrlake

CHUNK = 1024


def _create(store: Any, n: int) -> zarr.Array:
    return zarr.create_array(
        store,
        name="data",
        shape=(n * CHUNK,),
        chunks=(CHUNK,),
        dtype="uint8",
        compressors=None,
        fill_value=0,
    )


def _best(fn: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--reads", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["zl", "zarr"], default=None)
    ap.add_argument("--packed", action="store_true", help="compact zarrlake's chunks into packs")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    n = args.chunks
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zl-profile-"))
    data = np.random.default_rng(7).integers(0, 255, n * CHUNK, dtype=np.uint8)
    rng = random.Random(3)
    picks = [rng.randrange(n) for _ in range(args.reads)]

    openers: dict[str, Callable[[], zarr.Array]] = {}
    if args.only in (None, "zarr"):
        _create(LocalStore(work / "raw"), n)[:] = data
        openers["zarr"] = lambda: zarr.open_array(LocalStore(work / "raw"), path="data", mode="r")
    if args.only in (None, "zl"):
        repo = zarrlake.Repository.create(zarrlake.Storage.local(work / "zl"))
        with repo.transaction("main", message="write") as store:
            _create(store, n)[:] = data
        if args.packed:
            repo.compact(branch="main")

        def open_zl() -> zarr.Array:
            fresh = zarrlake.Repository.open(zarrlake.Storage.local(work / "zl"))
            return zarr.open_array(fresh.readonly_session("main").store, path="data", mode="r")

        openers["zl"] = open_zl

    results: dict[str, tuple[float, float]] = {}
    for name, open_array in openers.items():

        def full(open_array: Callable[[], zarr.Array] = open_array) -> None:
            assert np.array_equal(open_array()[:], data)

        arr = open_array()
        arr[0:CHUNK]  # the shard index is cached once per open, as in the benchmark's round

        def rand(arr: zarr.Array = arr) -> None:
            for i in picks:
                arr[i * CHUNK : (i + 1) * CHUNK]

        results[name] = (
            _best(full, args.rounds) / n * 1e6,
            _best(rand, args.rounds) / len(picks) * 1e6,
        )
    for name, (f, r) in results.items():
        print(f"{name:5} full read {f:8.1f} µs/chunk   random read {r:8.1f} µs/read")
    if len(results) == 2:
        (zf, zr), (lf, lr) = results["zarr"], results["zl"]
        print(f"overhead    full {lf - zf:+8.1f} µs/chunk   random {lr - zr:+8.1f} µs/read")
        print(f"zl÷zarr speed: full {zf / lf:.2f}   random {zr / lr:.2f}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
