"""Writing a million virtual chunk refs in one commit: time and peak RSS, zarrlake vs Icechunk.

    python bench/virtual_refs.py [--refs 1000000] [--files 1000] [--peers-python PYTHON]

One array of ``refs`` 1-byte chunks (a square chunk grid), each chunk a virtual ref into one of
``files`` local files (``file://``, unpinned: no request per file), set in one session and
committed once. Each system runs in a process of its own (peak RSS is the process's
``ru_maxrss``): zarrlake in this Python, Icechunk in the peers' (Icechunk 2.x needs Python >=
3.12; ``bench/peers-venv.sh`` builds it). Icechunk is run both ways it offers: one
``VirtualChunkSpec`` per ref (``set_virtual_refs``, the form zarrlake's ``set_virtual_refs`` has)
and flat arrays (``set_virtual_refs_arr``), and so is zarrlake (``set_virtual_refs`` and
``set_virtual_refs_arrays``). Every run reads back a sample of chunks and checks
them against the files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, resource, sys, time
import numpy as np, zarr
system, work, n_side, n_files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
src = os.path.join(work, "src")
prefix = "file://" + src + "/"
n = n_side * n_side
urls = [f"{prefix}f{i % n_files}.bin" for i in range(n_files)]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if system.startswith("zarrlake"):
    import zarrlake
    repo = zarrlake.Repository.create(
        zarrlake.Storage.local(os.path.join(work, system)),
        config={"virtual_containers": [{"url_prefix": prefix}]},
    )
    s = repo.writable_session()
    zarr.create_array(s.store, name="x", shape=(n_side, n_side), chunks=(1, 1), dtype="u1",
                      compressors=None, fill_value=0)
    t1 = time.perf_counter()
    if system == "zarrlake-arr":
        idx = np.arange(n)
        coords = np.stack([idx // n_side, idx % n_side], axis=1)
        locations = [urls[i % n_files] for i in range(n)]
        s.set_virtual_refs_arrays("x", coords, locations, idx % 8, np.ones(n, dtype=np.int64))
    else:
        VR = zarrlake.VirtualRef
        s.set_virtual_refs("x", (((i // n_side, i % n_side), VR(urls[i % n_files], i % 8, 1))
                                 for i in range(n)))
    t2 = time.perf_counter()
    s.commit("refs")
    t3 = time.perf_counter()
    store = repo.readonly_session().store
else:
    import icechunk
    config = icechunk.RepositoryConfig.default()
    config.set_virtual_chunk_container(
        icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(src)))
    repo = icechunk.Repository.create(
        icechunk.local_filesystem_storage(os.path.join(work, system)), config,
        authorize_virtual_chunk_access={prefix: None})
    s = repo.writable_session("main")
    zarr.create_array(s.store, name="x", shape=(n_side, n_side), chunks=(1, 1), dtype="u1",
                      compressors=None, fill_value=0)
    t1 = time.perf_counter()
    if system == "icechunk-arr":
        locations = [urls[i % n_files] for i in range(n)]
        offsets = (np.arange(n, dtype=np.uint64) % 8)
        lengths = np.ones(n, dtype=np.uint64)
        s.store.set_virtual_refs_arr("x", (n_side, n_side), locations, offsets, lengths)
    else:
        VS = icechunk.VirtualChunkSpec
        s.store.set_virtual_refs("x", [VS([i // n_side, i % n_side], urls[i % n_files], i % 8, 1)
                                       for i in range(n)])
    t2 = time.perf_counter()
    s.commit("refs")
    t3 = time.perf_counter()
    store = repo.readonly_session("main").store
arr = zarr.open_array(store, path="x", mode="r")
rng = np.random.default_rng(0)
for i in rng.integers(0, n, 50).tolist():
    assert arr[i // n_side, i % n_side] == i % 8, i
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"system": system, "set_s": t2 - t1, "commit_s": t3 - t2, "total_s": t3 - t0,
                  "peak_mib": peak / 1024, "start_mib": base / 1024}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--refs", type=int, default=1_000_000)
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    args = p.parse_args()
    side = round(args.refs**0.5)
    work = tempfile.mkdtemp(prefix="zl-vrefs-")
    try:
        src = Path(work, "src")
        src.mkdir()
        for i in range(args.files):
            (src / f"f{i}.bin").write_bytes(bytes(range(8)))
        rows = []
        runs = [("zarrlake", sys.executable), ("zarrlake-arr", sys.executable)]
        if Path(args.peers_python).exists():
            runs += [("icechunk", args.peers_python), ("icechunk-arr", args.peers_python)]
        else:
            print(
                f"no {args.peers_python}: Icechunk not run (bench/peers-venv.sh)", file=sys.stderr
            )
        for system, python in runs:
            out = subprocess.run(
                [python, "-c", WORKER, system, work, str(side), str(args.files)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT / "client")},
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{side * side:,} virtual refs into {args.files:,} files, one commit (local)\n")
        print("| system | set refs (s) | commit (s) | total (s) | peak RSS (MiB) |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['system']} | {r['set_s']:.2f} | {r['commit_s']:.2f} | {r['total_s']:.2f} "
                f"| {r['peak_mib']:.0f} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
