"""The commit path through the commit service (``zarrlake service``) against the direct path.

Two measures, on a local directory (or S3: ``--backend s3`` for moto_server, ``--backend
seaweedfs`` for SeaweedFS, each started by the run on a loopback port), same run:

1. one writer, 1-chunk commits in a row into an array of 1,000 chunks: latency p50/p95;
2. ``--writers`` processes (default 16) committing ``--commits`` 1-chunk commits each to one
   branch (each its own chunk, rebasing on conflict): wall time, commits/s, p50/p99 latency, and
   every value checked in place afterwards.

The service runs as its own process (``python -m zarrlake service``) on a loopback port; the
writers of the service path open the repository with ``commit_service=``. Usage:

    python bench/commit_service.py [--backend local|s3|seaweedfs] [--writers 16] [--commits 10]
                                   [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TOKEN = "bench-token-" + "b" * 20


def _open(url: str, service: str | None) -> Any:
    import zarrlake

    storage = zarrlake.Storage.from_url(url)
    if service is None:
        return zarrlake.Repository.open(storage)
    return zarrlake.Repository.open(storage, commit_service=service, commit_token=TOKEN)


def writer_main(task: dict[str, Any]) -> None:
    """A writer process: ``commits`` commits of chunk ``index`` + k, printing the latencies."""
    import zarr

    repo = _open(task["url"], task["service"])
    lat = []
    for k in range(task["commits"]):
        started = time.perf_counter()
        session = repo.writable_session(task["branch"])
        slot = task["index"] * task["commits"] + k
        zarr.open_array(session.store, path="a")[slot * 10] = slot + 1
        session.commit(f"w{task['index']} c{k}")
        lat.append(time.perf_counter() - started)
    print(json.dumps(lat))


def create(url: str, chunks: int) -> None:
    import zarr

    import zarrlake

    repo = zarrlake.Repository.create(zarrlake.Storage.from_url(url))
    session = repo.writable_session("main")
    arr = zarr.create_array(session.store, name="a", shape=(chunks * 10,), chunks=(10,), dtype="i4")
    arr[:] = np.zeros(chunks * 10, dtype="i4")
    session.commit("1,000 chunks")


def start_service(url: str, work: Path) -> tuple[subprocess.Popen[str], str]:
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: {"identity": "bench", "role": "writer"}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zarrlake", "service", url, "--tokens-file", str(tokens),
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.strip().rsplit(" ", 1)[1].rstrip("/")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def sequential(url: str, service: str | None, n: int) -> dict[str, float]:
    import zarr

    repo = _open(url, service)
    repo.create_branch(f"seq-{service is not None}")
    branch = f"seq-{service is not None}"
    lat = []
    for i in range(n):
        started = time.perf_counter()
        session = repo.writable_session(branch)
        zarr.open_array(session.store, path="a")[(i % 1000) * 10] = i + 7
        session.commit(f"c{i}")
        lat.append(time.perf_counter() - started)
    return {"p50_ms": pct(lat, 50) * 1e3, "p95_ms": pct(lat, 95) * 1e3}


def concurrent(url: str, service: str | None, writers: int, commits: int) -> dict[str, Any]:
    import zarr

    repo = _open(url, service)
    branch = f"many-{service is not None}"
    repo.create_branch(branch)
    procs = []
    started = time.perf_counter()
    for i in range(writers):
        task = {"url": url, "service": service, "branch": branch, "index": i, "commits": commits}
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--writer-task", json.dumps(task)],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    lat: list[float] = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        assert p.returncode == 0, f"a writer failed ({p.returncode})"
        lat.extend(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - started
    values = zarr.open_array(repo.readonly_session(branch).store, path="a")[:]
    landed = sum(int(values[s * 10] == s + 1) for s in range(writers * commits))
    return {
        "wall_s": wall,
        "commits_per_s": writers * commits / wall,
        "p50_s": pct(lat, 50),
        "p99_s": pct(lat, 99),
        "landed": f"{landed}/{writers * commits}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--writer-task", help=argparse.SUPPRESS)
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--commits", type=int, default=10)
    ap.add_argument("--sequential", type=int, default=100, help="commits in a row (100)")
    ap.add_argument("--markdown", metavar="FILE")
    ap.add_argument("--backend", choices=("local", "s3", "seaweedfs"), default="local")
    args = ap.parse_args(argv)
    if args.writer_task:
        writer_main(json.loads(args.writer_task))
        return 0
    work = Path(tempfile.mkdtemp(prefix="zl-service-bench-"))
    server = None
    if args.backend == "local":
        url, where = f"file://{work / 'repo'}", "local directory"
    else:
        from harness import CREDENTIALS, S3Server

        for key, value in CREDENTIALS.items():  # for this process, the service and writers
            os.environ.setdefault(key, value)
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        if args.backend == "s3":
            server, where = S3Server.start(str(work / "moto.log")), "moto_server S3"
        else:
            server, where = S3Server.start_seaweedfs(str(work / "weed")), "SeaweedFS S3"
        bucket = server.bucket_for("service-bench")
        url = f"s3://{bucket}/lake?endpoint_url={server.endpoint}&region=us-east-1&allow_http=true"
    try:
        return _run(args, url, where, work)
    finally:
        if server is not None:
            server.stop()


def _run(args: argparse.Namespace, url: str, where: str, work: Path) -> int:
    create(url, 1000)
    proc, service = start_service(url, work)
    try:
        rows = []
        for name, svc in (("direct", None), ("through the service", service)):
            seq = sequential(url, svc, args.sequential)
            many = concurrent(url, svc, args.writers, args.commits)
            rows.append((name, seq, many))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [
        f"1-chunk commits into 1,000 chunks, {where}; {args.sequential} in a row, then "
        f"{args.writers} writer processes x {args.commits} commits to one branch.",
        "",
        f"| path | 1 writer p50 | p95 | {args.writers} writers wall | commits/s | p50 | p99 "
        "| landed |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, seq, many in rows:
        lines.append(
            f"| {name} | {seq['p50_ms']:.1f} ms | {seq['p95_ms']:.1f} ms | {many['wall_s']:.1f} s "
            f"| {many['commits_per_s']:.1f} | {many['p50_s']:.2f} s | {many['p99_s']:.2f} s "
            f"| {many['landed']} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
