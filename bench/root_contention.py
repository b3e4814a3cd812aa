#!/usr/bin/env python
"""Root contention: writers on different branches of one repository, with and without ``root``.

With the published root (``DESIGN.md``, "The published root"), every commit appends to its own
branch's journal and then swaps the repository's one ``root`` object by compare-and-set, so
commits on *different* branches, which never contend on their journals, contend on ``root``.
This measures what that costs.

For each backend (local directory, S3 on moto, S3 on SeaweedFS) x root (on, off: a repository
made with ``published_root=False``, the journal-only protocol): ``--writers`` processes (default
8), each making ``--commits`` one-chunk commits (default 50; ``--quick`` 10) to its own branch
(``w0``, ``w1``, ...; all created from ``main`` first), every chunk its own, so nothing
conflicts. The writers are ``spawn`` processes, started once and reused across configurations
(process start-up never counts); each opens the repository, then waits at a barrier, so all
begin at once. Reported per configuration:

- commits landed: a fresh client's ``log(branch)`` must hold every commit its writer got, in
  order, on top of the branch's start (and every chunk reads back); ``lost`` counts the rest;
- wall time from the barrier to the last commit, and commits per second;
- p50/p95/p99/max latency of ``session.commit`` (the timer is around that call only);
- swap retries: ``put_if_version`` calls (counted by testkit's ``CountingStorage`` around each
  writer's storage) minus commits, i.e. lost compare-and-sets of ``root``; and journal-append
  retries and rebases (``Repository.stats``; 0 expected, the branches are separate);
- "head never went back" (root on): after each of its commits a writer opens a fresh client and
  reads ``lookup_branch(own branch)`` and ``root``'s ``generation``; the head must be the commit
  it just made and the generations must not decrease. Root off, the head check runs too (so the
  two modes do the same work between commits), without the generation.

    python bench/root_contention.py                     # 8 writers x 50 commits, 3 backends
    python bench/root_contention.py --quick             # 8 writers x 10 commits
    python bench/root_contention.py --backends local,moto --writers 4 --commits 20
    python bench/root_contention.py --quick --markdown out.md --json out.json

The run starts its own ``moto_server`` and SeaweedFS (only for the backends asked for) on free
loopback ports and stops them by process id at the end. Exit status 1 if a commit was lost, a
head went back, or a configuration had another problem.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from contention import (
    ARRAY,
    CHUNK_BYTES,
    WriterPool,
    array_doc,
    chunk_bytes,
    chunk_key,
    percentile,
)
from harness import REGION, S3Server, progress

BACKENDS = ("local", "moto", "seaweedfs")


# -- the writers ----------------------------------------------------------------------------------


@dataclass
class Task:
    config: str
    storage: Any  # zarrlake.Storage (picklable)
    root: bool  # whether the repository publishes ``root``
    writer: int
    commits: int


@dataclass
class WriterResult:
    config: str
    writer: int
    snapshots: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # seconds, of session.commit
    heads: list[str] = field(default_factory=list)  # a fresh client's lookup_branch, per commit
    generations: list[int] = field(default_factory=list)  # root's generation, per commit
    put_if_version: int = 0
    get_versioned: int = 0
    rebases: int = 0
    append_retries: int = 0
    first_start: float = 0.0  # time.monotonic() (CLOCK_MONOTONIC: one clock for all processes)
    last_end: float = 0.0
    error: str | None = None


def branch(writer: int) -> str:
    return f"w{writer}"


def writer_loop(tasks: Any, results: Any, barrier: Any) -> None:
    """One writer process: run tasks until ``None`` arrives. Every task of a round meets the
    others at ``barrier`` (also after a failed set-up, so that no writer waits forever)."""
    import zarrlake
    from zarrlake.format.root import ROOT_KEY, RootRecord
    from zarrlake_testkit.counting import CountingStorage

    while True:
        task: Task | None = tasks.get()
        if task is None:
            return
        out = WriterResult(task.config, task.writer)
        name = branch(task.writer)
        repo = None
        counted = None
        try:
            counted = CountingStorage(task.storage)
            repo = zarrlake.Repository.open(counted)
            counted.counts.reset()  # count the commits, not the open
        except Exception:
            out.error = traceback.format_exc()
        try:
            barrier.wait(timeout=300)
        except Exception:
            out.error = out.error or traceback.format_exc()
        if out.error is None and repo is not None and counted is not None:
            try:
                out.first_start = time.monotonic()
                for i in range(task.commits):
                    index = task.writer * task.commits + i
                    session = repo.writable_session(name)
                    session.write(chunk_key(index), chunk_bytes(task.config, index))
                    t0 = time.monotonic()
                    snapshot = session.commit(f"writer {task.writer} chunk {index}")
                    out.latencies.append(time.monotonic() - t0)
                    out.snapshots.append(snapshot)
                    # What a fresh reader sees now (the storage unwrapped: not counted).
                    out.heads.append(zarrlake.Repository.open(task.storage).lookup_branch(name))
                    if task.root:
                        raw = task.storage.get(ROOT_KEY)
                        out.generations.append(RootRecord.decode(raw).generation)
                out.last_end = time.monotonic()
                ops = counted.counts.by_op()
                out.put_if_version = ops.get("put_if_version", 0)
                out.get_versioned = ops.get("get_versioned", 0)
                out.rebases = repo.stats.get("rebases", 0)
                out.append_retries = repo.stats.get("append_retries", 0)
            except Exception:
                out.error = traceback.format_exc()
        results.put(out)


# -- one configuration ----------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    root: bool
    writers: int
    commits: int  # landed: in the branch's log, in order
    expected: int
    lost: int
    seconds: float
    commits_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    put_if_version: int
    swap_retries: int | None  # put_if_version - commits (root on), None (root off)
    get_versioned: int
    append_retries: int
    rebases: int
    head_checks: int
    head_wrong: int  # a fresh client's head was not the commit just made
    generation_backwards: int  # root on: a generation lower than the one before
    problems: list[str]
    latencies_ms: list[float] = field(default_factory=list)


def verify(
    storage: Any, config: str, root: bool, start: str, results: list[WriterResult], commits: int
) -> tuple[int, list[str]]:
    """(commits landed, problems) as a fresh client sees each writer's branch."""
    import zarrlake
    from zarrlake.format.model import PUBLISHED_ROOT
    from zarrlake.format.root import ROOT_KEY, RootRecord

    repo = zarrlake.Repository.open(storage)
    problems: list[str] = []
    landed = 0
    for r in results:
        name = branch(r.writer)
        history = [c.id for c in repo.log(name)]
        mine = set(r.snapshots)
        # The writer's commits, newest first, directly on top of the branch's start.
        ours = [s for s in history if s in mine]
        in_order = ours == r.snapshots[::-1]
        landed += len(ours) if in_order else 0
        if not in_order:
            problems.append(f"{name}: its commits are not all in its log, in order")
        elif history[: len(ours)] != ours or history[len(ours) : len(ours) + 1] != [start]:
            problems.append(f"{name}: its log has commits other than its writer's on its start")
        session = repo.readonly_session(name)
        bad = 0
        for i in range(len(r.snapshots)):
            index = r.writer * commits + i
            if session.read(chunk_key(index)) != chunk_bytes(config, index):
                bad += 1
        if bad:
            problems.append(f"{name}: {bad} chunk(s) missing or wrong")
    has_feature = PUBLISHED_ROOT in repo.record.features
    if has_feature != root:
        problems.append(f"repository {'lacks' if root else 'has'} the published-root feature")
    if root:
        heads = RootRecord.decode(storage.get(ROOT_KEY)).heads()
        for r in results:
            if r.snapshots and heads.get(branch(r.writer)) != r.snapshots[-1]:
                problems.append(f"root's head of {branch(r.writer)} is not its last commit")
    elif storage.exists(ROOT_KEY):
        problems.append("a journal-only repository has a root object")
    return landed, problems


def run_config(
    pool: WriterPool, storage: Any, backend: str, root: bool, commits: int, keep_latencies: bool
) -> Row:
    import zarrlake

    writers = pool.size
    config = f"{backend}-{'root' if root else 'journal'}-{uuid.uuid4().hex[:6]}"
    repo = zarrlake.Repository.create(storage, published_root=root)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(writers * commits))
    start = s.commit("create the array")
    for w in range(writers):
        repo.create_branch(branch(w), "main")
    tasks = [Task(config, storage, root, w, commits) for w in range(writers)]
    results = pool.run(tasks)
    errors = [r.error for r in results if r.error]
    landed, problems = verify(storage, config, root, start, results, commits)
    problems += [f"writer error: {e.strip().splitlines()[-1]}" for e in errors]
    latencies = [x for r in results for x in r.latencies]
    ok = [r for r in results if not r.error]
    seconds = (max(r.last_end for r in ok) - min(r.first_start for r in ok)) if ok else float("nan")
    done = sum(len(r.snapshots) for r in results)
    head_wrong = sum(h != s for r in results for h, s in zip(r.heads, r.snapshots, strict=True))
    backwards = sum(
        b < a for r in results for a, b in zip(r.generations, r.generations[1:], strict=False)
    )
    if head_wrong:
        problems.append(f"{head_wrong} fresh lookup(s) of a branch did not name the commit made")
    if backwards:
        problems.append(f"root's generation went down {backwards} time(s)")
    put_if_version = sum(r.put_if_version for r in results)
    swap_retries = put_if_version - done if root else None
    if not root and put_if_version:
        problems.append(f"{put_if_version} compare-and-set write(s) without a root")
    expected = writers * commits
    return Row(
        backend=backend,
        root=root,
        writers=writers,
        commits=landed,
        expected=expected,
        lost=expected - landed,
        seconds=seconds,
        commits_per_s=done / seconds if seconds else float("nan"),
        p50_ms=percentile(latencies, 50) * 1000,
        p95_ms=percentile(latencies, 95) * 1000,
        p99_ms=percentile(latencies, 99) * 1000,
        max_ms=max(latencies, default=float("nan")) * 1000,
        put_if_version=put_if_version,
        swap_retries=swap_retries,
        get_versioned=sum(r.get_versioned for r in results),
        append_retries=sum(r.append_retries for r in results),
        rebases=sum(r.rebases for r in results),
        head_checks=sum(len(r.heads) for r in results),
        head_wrong=head_wrong,
        generation_backwards=backwards,
        problems=problems,
        latencies_ms=[x * 1000 for x in latencies] if keep_latencies else [],
    )


# -- report ---------------------------------------------------------------------------------------


HEADERS = [
    "backend",
    "root",
    "landed",
    "lost",
    "wall s",
    "commits/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "max ms",
    "swap retries",
    "head never back",
]


def cells(r: Row) -> list[str]:
    if r.root:
        monotone = "yes" if not (r.head_wrong or r.generation_backwards) else "NO"
        monotone += f" ({r.head_checks} checks)"
    else:
        monotone = "— (head ok)" if not r.head_wrong else "— (head WRONG)"
    retries = "—" if r.swap_retries is None else f"{r.swap_retries} ({r.put_if_version} CAS)"
    return [
        r.backend,
        "on" if r.root else "off",
        f"{r.commits}/{r.expected}",
        str(r.lost),
        f"{r.seconds:.2f}",
        f"{r.commits_per_s:.1f}",
        f"{r.p50_ms:.0f}",
        f"{r.p95_ms:.0f}",
        f"{r.p99_ms:.0f}",
        f"{r.max_ms:.0f}",
        retries,
        monotone,
    ]


def notes(rows: list[Row]) -> list[str]:
    out = []
    by = {(r.backend, r.root): r for r in rows}
    for backend in dict.fromkeys(r.backend for r in rows):
        on, off = by.get((backend, True)), by.get((backend, False))
        if on is None or off is None:
            continue
        out.append(
            f"{backend}: root on / off: throughput {on.commits_per_s / off.commits_per_s:.2f}x, "
            f"p50 {on.p50_ms / off.p50_ms:.2f}x, p95 {on.p95_ms / off.p95_ms:.2f}x, "
            f"p99 {on.p99_ms / off.p99_ms:.2f}x; swap retries {on.swap_retries} in "
            f"{on.commits} commits"
        )
    for r in rows:
        if r.append_retries or r.rebases:
            out.append(
                f"{r.backend}/root {'on' if r.root else 'off'}: {r.append_retries} journal-append "
                f"retries, {r.rebases} rebases (separate branches: 0 expected)"
            )
    lost = sum(r.lost for r in rows)
    bad = [r for r in rows if r.problems]
    mark = "PASS" if lost == 0 and not bad else "FAIL"
    out.append(f"{mark}  lost commits: {lost}; configurations with problems: {len(bad)}")
    for r in bad:
        out.append(f"      {r.backend}/root {'on' if r.root else 'off'}: " + "; ".join(r.problems))
    return out


def text_table(rows: list[Row]) -> str:
    table = [HEADERS] + [cells(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADERS))]
    lines = [
        "  ".join(
            c.rjust(w) if 1 < i < len(HEADERS) - 1 else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(rows: list[Row], lines: list[str], meta: str) -> str:
    out = [
        "# Root contention benchmark",
        "",
        meta,
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(HEADERS))) + "|",
    ]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    out += ["", *(f"- {n.strip()}" for n in lines), ""]
    return "\n".join(out)


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 commits per writer")
    ap.add_argument("--writers", type=int, default=8, help="writer processes (default 8)")
    ap.add_argument("--commits", type=int, default=None, help="commits per writer (default 50)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="local,moto,seaweedfs")
    ap.add_argument("--modes", default="on,off", help="root on,off (default both)")
    ap.add_argument("--markdown", default=None, metavar="PATH", help="write the table as Markdown")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    ap.add_argument(
        "--no-latencies", action="store_true", help="leave every commit's latency out of --json"
    )
    args = ap.parse_args(argv)

    import zarrlake

    commits = args.commits or (10 if args.quick else 50)
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backend(s) {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    modes = [m == "on" for m in args.modes.split(",") if m]
    load_before = os.getloadavg()[0]

    tmp = Path(tempfile.mkdtemp(prefix="zarrlake-root-contention-"))
    servers: dict[str, S3Server] = {}
    pool: WriterPool | None = None
    rows: list[Row] = []
    try:
        if "moto" in backends:
            servers["moto"] = S3Server.start(log=str(tmp / "moto-requests.log"))
        if "seaweedfs" in backends:
            servers["seaweedfs"] = S3Server.start_seaweedfs(str(tmp / "seaweedfs"))
        for name, server in servers.items():
            pid = server.process.pid if server.process else "?"
            progress(f"{name}: {server.name} pid {pid} at {server.endpoint}")
        pool = WriterPool(args.writers, writer_loop, barrier=True)
        progress(
            f"{args.writers} writer processes, {os.cpu_count()} CPUs, {commits} commits per "
            f"writer, backends {','.join(backends)}, root {args.modes}"
        )
        for backend in backends:
            for root in modes:
                prefix = f"rc-{uuid.uuid4().hex[:8]}"
                if backend == "local":
                    storage = zarrlake.Storage.local(tmp / prefix)
                else:
                    server = servers[backend]
                    storage = zarrlake.Storage.s3(
                        server.bucket,
                        prefix,
                        endpoint_url=server.endpoint,
                        region=REGION,
                        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        allow_http=True,
                    )
                row = run_config(pool, storage, backend, root, commits, not args.no_latencies)
                rows.append(row)
                pairs = zip(HEADERS, cells(row), strict=True)
                progress("  " + "  ".join(f"{h}={c}" for h, c in pairs))
    finally:
        if pool is not None:
            pool.close()
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    lines = notes(rows)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(text_table(rows))
    print()
    print("\n".join(lines))
    print(f"({load})")
    meta = (
        f"{os.cpu_count()} CPUs ({load}); {args.writers} writer processes, each {commits} "
        f"one-chunk ({CHUNK_BYTES} B) commits to its own branch of one repository; latency = "
        "`session.commit` only; wall = the barrier to the last commit (between its commits each "
        "writer also opens a fresh client to check its head, root on or off); swap retries = "
        "`put_if_version` calls - commits (lost compare-and-sets of `root`)."
    )
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(rows, lines, meta))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    failed = any(r.lost or r.problems for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
