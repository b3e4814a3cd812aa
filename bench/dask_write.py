"""Dask write benchmark (issue 14): a ~512 MiB xarray Dataset written from a LocalCluster of two
worker processes — zarrlake's ``to_zarrlake`` vs Icechunk's ``to_icechunk`` vs plain
``Dataset.to_zarr`` into a directory (raw Zarr, no versioning), same machine, same run.

    python bench/dask_write.py --peers-python .venv-peers/bin/python      # the full profile
    python bench/dask_write.py --quick ...                                  # 128 MiB
    python bench/dask_write.py ... --markdown bench/results/dask_write.md

Each system runs in its own process (Icechunk 2.x in the peers' Python >= 3.12 environment, see
``bench/peers-venv.sh``), starts its own ``LocalCluster(n_workers=2, threads_per_worker=1)``,
warms it up, then for each repetition writes the Dataset into a fresh repository on the local file
system and commits. The time runs from the call of the writer to the end of the commit. The data
(float32 from a seeded generator) are computed on the workers as part of the write, identically
for every system; a checksum of three slices read back must agree between the systems.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FULL = {"shape": (256, 512, 1024), "chunks": (8, 256, 512)}  # 512 MiB in 128 chunks of 4 MiB
QUICK = {"shape": (64, 512, 1024), "chunks": (8, 256, 512)}  # 128 MiB


def dataset(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Any:
    import dask.array as da
    import numpy as np
    import xarray as xr

    rng = da.random.default_rng(42)
    temp = rng.random(shape, chunks=chunks, dtype="f4")
    nt, ny, nx = shape
    return xr.Dataset(
        {"temp": (("time", "y", "x"), temp)},
        coords={"time": np.arange(nt), "y": np.arange(ny), "x": np.arange(nx)},
    )


def checksum(ds: Any) -> list[float]:
    t = ds["temp"]
    return [
        round(float(t.isel(time=0).sum()), 2),
        round(float(t.isel(time=-1).sum()), 2),
        round(float(t.isel(x=7).sum()), 2),
    ]


def write_once(system: str, root: Path, ds: Any) -> tuple[float, list[float]]:
    import xarray as xr

    if system == "zarrlake":
        import zarrlake as zl
        from zarrlake.dask import to_zarrlake

        repo = zl.Repository.create(zl.Storage.local(root))
        start = time.perf_counter()
        session = repo.writable_session("main")
        to_zarrlake(ds, session, mode="w", consolidated=False)
        session.commit("bench")
        elapsed = time.perf_counter() - start
        back = xr.open_zarr(repo.readonly_session("main").store, consolidated=False)
    elif system == "icechunk":
        import icechunk
        from icechunk.xarray import to_icechunk

        repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(root)))
        start = time.perf_counter()
        session = repo.writable_session("main")
        to_icechunk(ds, session, mode="w")
        session.commit("bench")
        elapsed = time.perf_counter() - start
        back = xr.open_zarr(repo.readonly_session(branch="main").store, consolidated=False)
    elif system == "zarr":
        start = time.perf_counter()
        ds.to_zarr(str(root), mode="w", consolidated=False)
        elapsed = time.perf_counter() - start
        back = xr.open_zarr(str(root), consolidated=False)
    else:
        raise ValueError(system)
    return elapsed, checksum(back)


def run_system(system: str, profile: dict[str, Any], repeat: int) -> dict[str, Any]:
    """In the system's own process: a LocalCluster, a warm-up, ``repeat`` timed writes."""
    import dask
    from distributed import Client, LocalCluster

    ds = dataset(tuple(profile["shape"]), tuple(profile["chunks"]))
    nbytes = int(ds["temp"].nbytes)
    times, sums = [], None
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster),
        tempfile.TemporaryDirectory(prefix=f"bench-dask-{system}-") as tmp,
    ):
        dask.compute(dataset((8, 64, 64), (4, 64, 64))["temp"].sum())  # warm the workers
        write_once(system, Path(tmp) / "warm", dataset((16, 256, 512), (8, 256, 512)))
        for i in range(repeat):
            elapsed, sums = write_once(system, Path(tmp) / f"r{i}", ds)
            times.append(elapsed)
            print(f"  {system}: {elapsed:.2f} s", file=sys.stderr, flush=True)
    return {"system": system, "seconds": times, "bytes": nbytes, "checksum": sums}


def versions(python: str) -> str:
    code = (
        "import importlib.metadata as m, sys\n"
        "out = [sys.version.split()[0]]\n"
        "for p in ('zarrlake', 'icechunk', 'zarr', 'xarray', 'dask', 'distributed'):\n"
        "    try: out.append(p + ' ' + m.version(p))\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(', '.join(out))\n"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peers-python", default=None, help="Python with icechunk>=2 (Python>=3.12)")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    profile = QUICK if args.quick else FULL
    if args.child:
        print(json.dumps(run_system(args.child, profile, args.repeat)))
        return

    runs = [("zarrlake", sys.executable), ("zarr", sys.executable)]
    if args.peers_python:
        runs.append(("icechunk", args.peers_python))
    else:
        print("no --peers-python: Icechunk left out", file=sys.stderr)
    results = {}
    for system, python in runs:
        print(f"{system} ({python})", file=sys.stderr, flush=True)
        argv = [python, __file__, "--child", system, "--repeat", str(args.repeat)]
        if args.quick:
            argv.append("--quick")
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-3000:])
            raise SystemExit(f"{system} failed")
        results[system] = json.loads(done.stdout.strip().splitlines()[-1])
        results[system]["versions"] = versions(python)

    sums = {s: r["checksum"] for s, r in results.items()}
    if len({json.dumps(v) for v in sums.values()}) != 1:
        raise SystemExit(f"the systems read back different data: {sums}")

    mib = next(iter(results.values()))["bytes"] / 2**20
    median = {s: statistics.median(r["seconds"]) for s, r in results.items()}
    lines = [
        f"Dask write: {mib:.0f} MiB Dataset (float32, {profile['shape']}, chunks "
        f"{profile['chunks']}), LocalCluster of 2 worker processes x 1 thread, local file "
        f"system; median of {args.repeat}, write + commit.",
        "",
        "| system | median s | MiB/s | zarrlake ÷ system (throughput) | runs (s) |",
        "|---|---|---|---|---|",
    ]
    for s, r in results.items():
        ratio = median[s] / median["zarrlake"]
        lines.append(
            f"| {s} | {median[s]:.2f} | {mib / median[s]:.0f} | {ratio:.2f}x | "
            + ", ".join(f"{t:.2f}" for t in r["seconds"])
            + " |"
        )
    lines += ["", "Versions: " + "; ".join(f"{s}: {r['versions']}" for s, r in results.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
