#!/usr/bin/env python
"""Many writers, one branch: N processes x K one-chunk commits each to ``main`` (issue 45).

Every writer process opens a session, writes its own chunk of one array through Zarr, and commits,
K times in a row; all N start at the same moment (each reports ready after its imports and
connections, then waits for one start signal, so process start-up never counts). Systems, in one
run against the same servers:

- ``zarrlake`` optimistic, racing (no lock, no age queue: ``ZARRLAKE_FAIR_COMMITS=0``; rebase
  and retry on a lost journal append),
- ``zarrlake+fair`` optimistic with the age queue (the default: writers of a contended branch
  append oldest first),
- ``zarrlake+lock`` with :class:`zarrlake.RedisLock` on a ``redis-server`` the run starts,
- ``icechunk`` 2.x in the peers' Python (``--peers-python``, default ``.venv-peers``), retrying a
  commit that lost the race with ``session.rebase(ConflictDetector())``, its documented way for
  writers of disjoint chunks (each rebase counted as a retry).

Reported per (backend, N, system): values landed (a fresh client reads the whole array back),
commits in ``main``'s log, retries (zarrlake: lost journal appends; Icechunk: rebases), wall time
(first start to last commit), p50/p95/p99/max commit latency (open a session, write, commit), the
longest run of consecutive commits by one writer in the log (a writer that keeps winning starves
the others), and the targets: p99 <= 5x p50 at N = 32 and wall <= 0.5x Icechunk's.

    python bench/many_writers.py                       # N = 8, 32, 100 x 5, local and moto
    python bench/many_writers.py --writers 32 --commits 5 --backends s3
    python bench/many_writers.py --systems zarrlake,zarrlake+lock --markdown out.md
    python bench/many_writers.py --backends local,s3,seaweedfs
    python bench/many_writers.py --baseline /tmp/old --systems zarrlake@baseline,zarrlake,icechunk

``--baseline DIR`` names a folder holding another version's ``zarrlake`` package (a copy of an
older ``client/zarrlake``): the writers of ``zarrlake@baseline`` and ``zarrlake+lock@baseline``
import it, so before and after run against the same servers in one run.

The run starts its own ``moto_server`` (and SeaweedFS when asked) and ``redis-server`` on free
loopback ports and stops them by process id at the end; local repositories live in a temporary
directory removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEERS = ROOT / ".venv-peers" / "bin" / "python"
ARRAY = "a"
CHUNK = 1024  # uint8 elements per chunk: above both engines' inline thresholds, so an object each
TARGET_TAIL = 5.0  # p99 <= 5x p50
TARGET_WALL = 0.5  # wall <= 0.5x Icechunk's
SYSTEMS = ("zarrlake", "zarrlake+fair", "zarrlake+lock", "icechunk")


# -- the writer process (run with the system's own interpreter) ------------------------------------


def chunk_value(tag: str, index: int) -> int:
    """The byte every element of chunk ``index`` holds in run ``tag`` (never the fill value)."""
    return 1 + (index * 7 + int(tag, 16)) % 250


def _zarrlake_writer(task: dict[str, Any]) -> tuple[Any, Any]:
    import zarr

    import zarrlake

    storage = zarrlake.Storage.from_url(task["url"])
    lock = zarrlake.RedisLock(task["redis"], wait_s=900) if task.get("redis") else None
    repo = zarrlake.Repository.open(storage, lock=lock)
    if lock is not None:
        lock.client.ping()

    def commit_one(index: int, value: int) -> tuple[str, int]:
        before = repo.stats["append_retries"]
        session = repo.writable_session("main")
        arr = zarr.open_array(session.store, path=ARRAY, mode="r+")
        arr[index * CHUNK : (index + 1) * CHUNK] = value
        snap = session.commit(f"writer {task['writer']} chunk {index}")
        return snap, repo.stats["append_retries"] - before

    return repo, commit_one


def _icechunk_writer(task: dict[str, Any]) -> tuple[Any, Any]:
    import icechunk
    import zarr

    repo = icechunk.Repository.open(_icechunk_storage(task))

    def commit_one(index: int, value: int) -> tuple[str, int]:
        session = repo.writable_session("main")
        arr = zarr.open_array(session.store, path=ARRAY, mode="r+")
        arr[index * CHUNK : (index + 1) * CHUNK] = value
        retries = 0
        while True:
            try:
                return session.commit(f"writer {task['writer']} chunk {index}"), retries
            except icechunk.ConflictError:
                session.rebase(icechunk.ConflictDetector())
                retries += 1

    return repo, commit_one


def _icechunk_storage(task: dict[str, Any]) -> Any:
    import icechunk

    if task["backend"] == "local":
        return icechunk.local_filesystem_storage(task["path"])
    return icechunk.s3_storage(
        bucket=task["bucket"],
        prefix=task["prefix"],
        region="us-east-1",
        endpoint_url=task["endpoint"],
        allow_http=True,
        force_path_style=True,
        from_env=True,
    )


def writer_main(payload: str) -> int:
    """One writer: set up, print ``ready``, wait for a line on stdin, commit K times, print one
    JSON record per commit and a last ``done`` record."""
    task = json.loads(payload)
    try:
        setup = _icechunk_writer if task["kind"] == "icechunk" else _zarrlake_writer
        _repo, commit_one = setup(task)
        print("ready", flush=True)
        sys.stdin.readline()
        for i in range(task["commits"]):
            index = task["writer"] * task["commits"] + i
            t0 = time.monotonic()
            snap, retries = commit_one(index, chunk_value(task["tag"], index))
            t1 = time.monotonic()
            record = {"index": index, "snapshot": snap, "retries": retries, "start": t0, "end": t1}
            print(json.dumps(record), flush=True)
        print(json.dumps({"done": True}), flush=True)
    except Exception:
        print(json.dumps({"error": traceback.format_exc()}), flush=True)
        return 1
    return 0


# -- the driver ------------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    writers: int
    system: str
    commits: int
    landed: int
    expected: int
    in_log: int
    retries: int
    max_retries: int
    wall_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float
    longest_streak: int
    problems: list[str]
    # Each writer's first commit (the burst of all N at once, every process's first use of its
    # connections and caches) apart from the rest: the median of those, and p99/p50 of the rest.
    first_p50_s: float = float("nan")
    later_tail: float = float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def _in_system_python(task: dict[str, Any], flag: str, size: int) -> str:
    """Run this file with ``flag`` in the system's own interpreter; its last line of output."""
    out = subprocess.run(
        [task["python"], __file__, flag, json.dumps(task), "--size", str(size)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def create_repo(task: dict[str, Any], size: int) -> None:
    """The repository with ``main`` holding an empty uint8 array of ``size`` chunks."""
    import zarr

    if task["kind"] == "icechunk":
        import icechunk

        repo = icechunk.Repository.create(_icechunk_storage(task))
        session = repo.writable_session("main")
        zarr.create_array(
            session.store,
            name=ARRAY,
            shape=(size * CHUNK,),
            chunks=(CHUNK,),
            dtype="u1",
            fill_value=0,
        )
        session.commit("create the array")
        return
    import zarrlake

    zrepo = zarrlake.Repository.create(zarrlake.Storage.from_url(task["url"]))
    with zrepo.transaction("main", message="create the array") as store:
        zarr.create_array(
            store, name=ARRAY, shape=(size * CHUNK,), chunks=(CHUNK,), dtype="u1", fill_value=0
        )


def check_repo(task: dict[str, Any], size: int) -> dict[str, Any]:
    """What a fresh client finds: values in place, the commits of ``main``'s log (messages,
    newest first)."""
    import numpy as np
    import zarr

    if task["kind"] == "icechunk":
        import icechunk

        repo = icechunk.Repository.open(_icechunk_storage(task))
        store: Any = repo.readonly_session("main").store
        messages = [s.message for s in repo.ancestry(branch="main")]
    else:
        import zarrlake

        zrepo = zarrlake.Repository.open(zarrlake.Storage.from_url(task["url"]))
        store = zrepo.readonly_session("main").store
        messages = [c.message for c in zrepo.log("main")]
    data = np.asarray(zarr.open_array(store, path=ARRAY, mode="r")[:])
    landed = 0
    for index in range(size):
        want = chunk_value(task["tag"], index)
        if bool(np.all(data[index * CHUNK : (index + 1) * CHUNK] == want)):
            landed += 1
    return {"landed": landed, "messages": messages}


def longest_streak(messages: list[str]) -> int:
    """The longest run of consecutive commits in the log made by one writer."""
    best = run = 0
    last = None
    for m in messages:
        who = m.split(" chunk ")[0] if m.startswith("writer ") else None
        run = run + 1 if who is not None and who == last else (1 if who else 0)
        last = who
        best = max(best, run)
    return best


def run_one(
    backend: str,
    n: int,
    k: int,
    system: str,
    where: dict[str, Any],
    peers: str,
    baseline: str | None = None,
) -> Row:
    kind = "icechunk" if system == "icechunk" else "zarrlake"
    env = dict(os.environ)
    env["ZARRLAKE_FAIR_COMMITS"] = "1" if system.startswith("zarrlake+fair") else "0"
    if system.endswith("@baseline") and baseline:
        # Another checkout's zarrlake (``--baseline``) in the writers: before/after in one run.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline, env.get("PYTHONPATH")]))
    tag = uuid.uuid4().hex[:8]
    task: dict[str, Any] = {
        "kind": kind,
        "backend": backend,
        "tag": tag,
        "commits": k,
        "python": peers if kind == "icechunk" else sys.executable,
        "redis": where["redis"] if system.startswith("zarrlake+lock") else None,
    }
    if backend == "local":
        task["path"] = str(Path(where["tmp"]) / f"{system}-{tag}")
        task["url"] = task["path"]
    else:
        # A bucket per configuration: moto answers a listing by scanning the whole bucket, so
        # in a shared one every listing (a branch head, the optimistic writers' queue) would
        # pay for the keys of the configurations before it.
        bucket = where["server"].bucket_for(f"{system.replace('+', '-').replace('@', '-')}-{tag}")
        task.update(bucket=bucket, prefix=f"mw-{tag}", endpoint=where["endpoint"])
        task["url"] = (
            f"s3://{bucket}/{task['prefix']}?endpoint_url={where['endpoint']}"
            "&region=us-east-1&allow_http=true"
        )
    size = n * k
    _in_system_python(task, "--setup-task", size)
    procs = []
    for w in range(n):
        payload = json.dumps({**task, "writer": w})
        procs.append(
            subprocess.Popen(
                [task["python"], __file__, "--writer-task", payload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(ROOT),
                env=env,
            )
        )
    problems: list[str] = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            problems.append(f"writer not ready: {line[-300:]}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    records: list[dict[str, Any]] = []
    for p in procs:
        assert p.stdout is not None
        for line in p.stdout:
            rec = json.loads(line)
            if "error" in rec:
                problems.append(rec["error"].strip().splitlines()[-1])
            elif "index" in rec:
                records.append(rec)
        p.wait()
    found = json.loads(_in_system_python(task, "--check-task", size))
    messages: list[str] = found["messages"]
    latencies = [r["end"] - r["start"] for r in records]
    first = [r["end"] - r["start"] for r in records if r["index"] % k == 0]
    later = [r["end"] - r["start"] for r in records if r["index"] % k != 0]
    wall = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    expected_log = size + 2  # + the repository's first commit + the array's creation
    if len(messages) != expected_log:
        problems.append(f"log has {len(messages)} commits, expected {expected_log}")
    if found["landed"] != size:
        problems.append(f"{size - found['landed']} value(s) missing")
    wanted = {f"writer {r['index'] // k} chunk {r['index']}" for r in records}
    missing_msgs = wanted - set(messages)
    if missing_msgs:
        problems.append(f"{len(missing_msgs)} acknowledged commit(s) not in the log")
    return Row(
        backend=backend,
        writers=n,
        system=system,
        commits=len(records),
        landed=found["landed"],
        expected=size,
        in_log=len(messages),
        retries=sum(r["retries"] for r in records),
        max_retries=max((r["retries"] for r in records), default=0),
        wall_s=wall,
        p50_s=percentile(latencies, 50),
        p95_s=percentile(latencies, 95),
        p99_s=percentile(latencies, 99),
        max_s=max(latencies, default=float("nan")),
        longest_streak=longest_streak(messages),
        problems=problems,
        first_p50_s=percentile(first, 50),
        later_tail=percentile(later, 99) / percentile(later, 50) if later else float("nan"),
    )


HEADERS = [
    "backend",
    "N",
    "system",
    "landed",
    "in log",
    "retries",
    "max retries/commit",
    "wall s",
    "p50 s",
    "p95 s",
    "p99 s",
    "max s",
    "p99/p50",
    "first commits' p50 s",
    "p99/p50 after the first",
    "longest streak",
]


def cells(r: Row) -> list[str]:
    return [
        r.backend,
        str(r.writers),
        r.system,
        f"{r.landed}/{r.expected}",
        str(r.in_log),
        str(r.retries),
        str(r.max_retries),
        f"{r.wall_s:.1f}",
        f"{r.p50_s:.2f}",
        f"{r.p95_s:.2f}",
        f"{r.p99_s:.2f}",
        f"{r.max_s:.2f}",
        f"{r.p99_s / r.p50_s:.1f}" if r.p50_s else "-",
        f"{r.first_p50_s:.2f}",
        f"{r.later_tail:.1f}",
        str(r.longest_streak),
    ]


def verdicts(rows: list[Row]) -> list[str]:
    out = []
    by = {(r.backend, r.writers, r.system): r for r in rows}
    for r in rows:
        if r.system == "icechunk" or r.system.endswith("@baseline"):
            continue  # the targets are this checkout's
        if r.writers == 32:
            ok = r.p99_s <= TARGET_TAIL * r.p50_s
            out.append(
                f"{'PASS' if ok else 'MISS'}  {r.backend} N=32 {r.system}: p99 {r.p99_s:.2f}s = "
                f"{r.p99_s / r.p50_s:.1f}x p50 (target <= {TARGET_TAIL:g}x)"
            )
        ice = by.get((r.backend, r.writers, "icechunk"))
        if ice is not None and ice.wall_s:
            ratio = r.wall_s / ice.wall_s
            out.append(
                f"{'PASS' if ratio <= TARGET_WALL else 'MISS'}  {r.backend} N={r.writers} "
                f"{r.system}: wall {r.wall_s:.1f}s = {ratio:.2f}x Icechunk's {ice.wall_s:.1f}s "
                f"(target <= {TARGET_WALL:g}x)"
            )
            if 0 < ice.landed < ice.expected and r.landed:
                # Icechunk's wall there is of fewer commits than it acknowledged: also say
                # what each commit that did land cost, side by side (the verdict stays above).
                per = (r.wall_s / r.landed) / (ice.wall_s / ice.landed)
                out.append(
                    f"NOTE  {r.backend} N={r.writers} {r.system}: per landed commit "
                    f"{per:.2f}x Icechunk's (it landed {ice.landed} of {ice.expected})"
                )
    ours = [r for r in rows if r.system != "icechunk"]
    lost = [r for r in ours if r.problems]
    out.append(f"{'PASS' if not lost else 'MISS'}  zarrlake lost nothing in {len(ours)} runs")
    for r in lost:
        out.append(f"      {r.backend}/{r.writers}/{r.system}: " + "; ".join(r.problems))
    for r in rows:
        if r.system == "icechunk" and r.problems:
            # Icechunk's local file system storage is documented as unsafe for concurrent
            # commits: its wall time there is of fewer commits than were acknowledged.
            out.append(f"NOTE  icechunk {r.backend} N={r.writers}: " + "; ".join(r.problems))
    return out


def markdown(rows: list[Row], notes: list[str], meta: str) -> str:
    lines = [
        meta,
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
    ]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    lines += ["", *(f"- {n.strip()}" for n in notes), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--writer-task", help=argparse.SUPPRESS)
    ap.add_argument("--setup-task", help=argparse.SUPPRESS)
    ap.add_argument("--check-task", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--writers", default="8,32,100", help="writer counts (default 8,32,100)")
    ap.add_argument("--commits", type=int, default=5, help="commits per writer (default 5)")
    ap.add_argument("--backends", default="local,s3", help="local,s3,seaweedfs (default local,s3)")
    ap.add_argument(
        "--systems", default=",".join(SYSTEMS), help="zarrlake,zarrlake+fair,zarrlake+lock,icechunk"
    )
    ap.add_argument(
        "--peers-python", default=os.environ.get("BENCH_PEERS_PYTHON", str(DEFAULT_PEERS))
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="a folder holding another zarrlake package, imported by the writers of systems "
        "zarrlake@baseline and zarrlake+lock@baseline (before/after in one run)",
    )
    ap.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = ap.parse_args(argv)
    if args.writer_task:
        return writer_main(args.writer_task)
    if args.setup_task:
        create_repo(json.loads(args.setup_task), args.size)
        return 0
    if args.check_task:
        print(json.dumps(check_repo(json.loads(args.check_task), args.size)))
        return 0

    from harness import CREDENTIALS, S3Server
    from zarrlake_testkit.servers import start_redis, stop

    for key, value in CREDENTIALS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("ICECHUNK_LOG", "error")
    counts = [int(x) for x in args.writers.split(",") if x]
    backends = [b for b in args.backends.split(",") if b]
    systems = [s for s in args.systems.split(",") if s]
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="zarrlake-many-writers-"))
    servers: list[Any] = []
    rows: list[Row] = []
    try:
        redis_proc, redis_url = start_redis(tmp)
        servers.append(lambda: stop(redis_proc))
        for backend in backends:
            where: dict[str, Any] = {"tmp": str(tmp), "redis": redis_url}
            server = None
            if backend == "s3":
                server = S3Server.start(str(tmp / "moto.log"))
            elif backend == "seaweedfs":
                server = S3Server.start_seaweedfs(str(tmp / "weed"))
            if server is not None:
                servers.append(server.stop)
                where.update(endpoint=server.endpoint, server=server)
            kind = "local" if backend == "local" else "s3"
            for n in counts:
                for system in systems:
                    row = run_one(
                        kind, n, args.commits, system, where, args.peers_python, args.baseline
                    )
                    row.backend = backend
                    rows.append(row)
                    print(
                        "  "
                        + "  ".join(f"{h}={c}" for h, c in zip(HEADERS, cells(row), strict=True)),
                        flush=True,
                    )
            if server is not None:
                server.stop()
                servers.remove(server.stop)
    finally:
        for stopper in reversed(servers):
            stopper()
        shutil.rmtree(tmp, ignore_errors=True)
    notes = verdicts(rows)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print("\n".join(notes))
    meta = (
        f"{os.cpu_count()} CPUs ({load}); {args.commits} one-chunk commits per writer "
        f"({CHUNK}-byte chunks through Zarr); latency = open a session, write, commit; "
        "retries: zarrlake's lost journal appends, Icechunk's rebases."
    )
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, notes, meta))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if not any(n.startswith("MISS") for n in notes) else 1


if __name__ == "__main__":
    sys.exit(main())
