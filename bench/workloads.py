"""The benchmarks. Each takes the systems and the sizes and returns ``{system name: metrics}``.

This is the orchestrating side: the loops over rounds and systems. What is timed runs in one
worker process per system (``ops.py``, through ``pool.Workers``), so every system runs with its own
Python (Icechunk 2.x needs ≥ 3.12) while all share this run's machine and S3 server. Each metric
comes with the storage requests it made (``*_requests``; ``None`` where not counted) and each
system with the peak RSS of its worker for this benchmark (``peak_rss_mib``).

Rules every benchmark follows, so that ratios mean something:

- Same data, same Zarr array layout (no compression, so a "1 MiB chunk" is 1 MiB on storage) and
  Zarr's default settings for every system.
- A write is timed to the end of its commit (a write is not done until it is published).
- A read is timed on a repository opened afresh (no client cache carried over from the write),
  and its result is checked against what was written — outside the clock.
- Repeated measurements interleave the systems (one round of every system, then the next round),
  and the best round counts, so a burst of load from elsewhere on the machine hurts one round of
  every system rather than every round of one.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import S3Server, progress
from pool import Workers
from systems import System


@dataclass(frozen=True)
class Sizes:
    bulk_mib: int = 256
    bulk_chunk_bytes: int = 1 << 20
    bulk_rounds: int = 5
    small_chunks: int = 20_000
    small_chunk_bytes: int = 1024
    small_rounds: int = 1
    random_reads: int = 1000
    random_rounds: int = 3
    commit_sizes: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    commit_reps: int = 7
    log_commits: int = 1000
    log_rounds: int = 5
    log_refs: int = 100  # branches, and as many tags, listed by a fresh client
    writers: int = 4
    concurrent_trials: int = 5

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            bulk_mib=32,
            bulk_rounds=2,
            small_chunks=2_000,
            small_rounds=2,
            random_reads=200,
            commit_sizes=(1_000, 10_000, 100_000),
            commit_reps=5,
            log_commits=20,
            log_rounds=3,
            log_refs=20,
            concurrent_trials=3,
        )


Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Context:
    """What every benchmark needs besides the systems and sizes."""

    s3: S3Server | None
    peers_python: str | None

    def workers(self, systems: list[System]) -> Workers:
        return Workers(systems, self.peers_python, self.s3.log if self.s3 else None)


def _finish(out: Results, pool: Workers) -> Results:
    """Attach each worker's peak RSS and versions to its system's metrics."""
    for name, rss in pool.peak_rss.items():
        if name in out:
            out[name]["peak_rss_mib"] = rss["self"]
            out[name]["peak_rss_children_mib"] = rss["children"]
            out[name]["versions"] = pool.versions[name]
    return out


BULK_SEED, SMALL_SEED = 1, 2

# Repositories a benchmark leaves for a later one: the random-read benchmark reads the arrays the
# small-chunk benchmark wrote instead of writing 20,000 chunks per system again.
_KEPT: dict[str, str] = {}


def _write_read(
    systems: list[System],
    ctx: Context,
    name: str,
    seed: int,
    nbytes: int,
    chunk: int,
    rounds: int,
    keep_last: bool = False,
) -> Results:
    keys = ("write_s", "read_s", "write_requests", "read_requests")
    runs: dict[str, dict[str, list[Any]]] = {s.name: {k: [] for k in keys} for s in systems}
    with ctx.workers(systems) as pool:
        for r in range(rounds):
            for system in systems:
                label = f"{name}-{r}"
                keep = keep_last and r == rounds - 1
                m = pool[system.name].call(
                    "write_read", label=label, seed=seed, nbytes=nbytes, chunk=chunk, keep=keep
                )
                if keep:
                    _KEPT[f"{name}/{system.name}"] = label
                for k in keys:
                    runs[system.name][k].append(m[k])
                progress(
                    f"{name} round {r + 1}/{rounds} {system.name}: write {m['write_s']:.2f}s "
                    f"read {m['read_s']:.2f}s; requests {m['write_requests']} / "
                    f"{m['read_requests']}"
                )
    out: Results = {
        n: {
            "write_s": min(v["write_s"]),
            "read_s": min(v["read_s"]),
            "write_s_median": statistics.median(v["write_s"]),
            "read_s_median": statistics.median(v["read_s"]),
            # Requests of the last round (the same work every round).
            "write_requests": v["write_requests"][-1],
            "read_requests": v["read_requests"][-1],
            "rounds": v,
        }
        for n, v in runs.items()
    }
    return _finish(out, pool)


def bench_bulk(systems: list[System], sizes: Sizes, ctx: Context) -> Results:
    """Bulk write and read: ``bulk_mib`` MiB in 1 MiB chunks."""
    out = _write_read(
        systems,
        ctx,
        "bulk",
        BULK_SEED,
        sizes.bulk_mib << 20,
        sizes.bulk_chunk_bytes,
        sizes.bulk_rounds,
    )
    for m in out.values():
        m["write_mib_s"] = sizes.bulk_mib / m["write_s"]
        m["read_mib_s"] = sizes.bulk_mib / m["read_s"]
    return out


def bench_small(systems: list[System], sizes: Sizes, ctx: Context) -> Results:
    """Many small chunks (above every inline threshold, so each is its own object)."""
    n, c = sizes.small_chunks, sizes.small_chunk_bytes
    out = _write_read(
        systems, ctx, "small", SMALL_SEED, n * c, c, sizes.small_rounds, keep_last=True
    )
    for m in out.values():
        m["write_chunks_s"] = n / m["write_s"]
        m["read_chunks_s"] = n / m["read_s"]
    return out


def bench_random(systems: list[System], sizes: Sizes, ctx: Context) -> Results:
    """Random single-chunk reads, one Zarr call each, from the small-chunk array.

    Each round opens the repository afresh — opening it and reading a first chunk is timed and
    counted on its own ("open + first read") — then reads ``random_reads`` chunks at positions
    drawn for that round (the same for every system); the best round counts.
    """
    n, c = sizes.small_chunks, sizes.small_chunk_bytes
    data = {"seed": SMALL_SEED, "nbytes": n * c, "chunk": c}
    rng = random.Random(3)
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    with ctx.workers(systems) as pool:
        labels = {
            s.name: pool[s.name].call(
                "random_prepare", label=_KEPT.pop(f"small/{s.name}", None), **data
            )["label"]
            for s in systems
        }
        for r in range(sizes.random_rounds):
            picks = rng.choices(range(n), k=sizes.random_reads)
            for system in systems:
                m = pool[system.name].call(
                    "random_round", label=labels[system.name], picks=picks, **data
                )
                rounds[system.name].append(m)
                progress(
                    f"random reads round {r + 1}/{sizes.random_rounds} {system.name}: "
                    f"{m['read_ms']:.2f} ms/read, {m['read_requests']} requests/read; open + "
                    f"first read {m['open_first_ms']:.1f} ms, {m['open_first_requests']} requests"
                )
        for system in systems:
            pool[system.name].call("destroy", label=labels[system.name])
    out: Results = {}
    for name, ms in rounds.items():
        out[name] = {
            "read_ms": min(m["read_ms"] for m in ms),
            "rounds_ms": [m["read_ms"] for m in ms],
            "reads": sizes.random_reads,
            "read_requests": ms[-1]["read_requests"],
            "open_first_ms": min(m["open_first_ms"] for m in ms),
            "open_first_requests": ms[-1]["open_first_requests"],
        }
    return _finish(out, pool)


def bench_commit(systems: list[System], sizes: Sizes, ctx: Context) -> Results:
    """One-chunk commit in repositories of 1,000 / 10,000 / 100,000 / 1,000,000 chunks.

    Each repository is built once, in one session and one commit, through Zarr (one-element int64
    chunks, small enough to be stored inline by both engines, written 100,000 chunks per Zarr
    call): the cheapest honest way to a million chunks for every system. Then, ``commit_reps``
    rounds over every system and size: open a writable session, write one chunk at a random
    position, commit — timed as a whole, and the commit call alone. A warm-up round is not
    counted; the median of the rest is reported.
    """
    versioned = [s for s in systems if s.versioned]
    builds: dict[tuple[str, int], dict[str, Any]] = {}
    rng = random.Random(4)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with ctx.workers(versioned) as pool:
        for system in versioned:
            for n in sizes.commit_sizes:
                b = pool[system.name].call("commit_build", n=n)
                builds[system.name, n] = b
                runs[system.name, n] = []
                progress(f"commit: built {system.name} @{n:,} chunks in {b['build_s']:.1f}s")
        for rep in range(sizes.commit_reps + 1):
            for system in versioned:
                for n in sizes.commit_sizes:
                    m = pool[system.name].call("commit_one", n=n, pos=rng.randrange(n), rep=rep)
                    if rep:
                        runs[system.name, n].append(m)
        for system in versioned:
            for n in sizes.commit_sizes:
                pool[system.name].call("commit_check", n=n)
    out: Results = {}
    for system in versioned:
        metrics: dict[str, Any] = {}
        for n in sizes.commit_sizes:
            ms = runs[system.name, n]
            txn_ms = [m["txn_s"] * 1000 for m in ms]
            metrics[str(n)] = {
                "txn_ms": statistics.median(txn_ms),
                "commit_ms": statistics.median(m["commit_s"] * 1000 for m in ms),
                "requests": ms[-1]["requests"],
                "build_s": builds[system.name, n]["build_s"],
                "build_requests": builds[system.name, n]["build_requests"],
                "txn_ms_all": txn_ms,
            }
            progress(
                f"commit {system.name} @{n:,} chunks: {metrics[str(n)]['txn_ms']:.1f} ms "
                f"(commit() {metrics[str(n)]['commit_ms']:.1f} ms), "
                f"{metrics[str(n)]['requests']} requests"
            )
        lo, hi = str(min(sizes.commit_sizes)), str(max(sizes.commit_sizes))
        metrics["growth"] = metrics[hi]["txn_ms"] / metrics[lo]["txn_ms"]
        metrics["commit_growth"] = metrics[hi]["commit_ms"] / metrics[lo]["commit_ms"]
        out[system.name] = metrics
    return _finish(out, pool)


def bench_log(systems: list[System], sizes: Sizes, ctx: Context) -> Results:
    """Sequential commits, then ``log()``, a listing of the branches and tags, and checkout of an
    old commit, on a fresh client.

    Commit ``k`` writes chunk ``k - 1`` (1 KiB, a chunk object) with the value ``k``; the checkout
    reads the whole array as of commit ``k_old`` and checks that exactly chunks ``< k_old`` are set.
    ``log()`` and the checkout are measured in interleaved rounds, each on a freshly opened
    repository; the best round counts.
    """
    n, c = sizes.log_commits, 128
    old = max(1, n // 10)
    versioned = [s for s in systems if s.versioned]
    label = "log"
    ids: dict[str, list[str]] = {}
    out: Results = {}
    with ctx.workers(versioned) as pool:
        for system in versioned:
            b = pool[system.name].call("log_build", label=label, n=n, c=c, refs=sizes.log_refs)
            ids[system.name] = b.pop("ids")
            out[system.name] = {**b, "rounds": [], "checkout_commit": old}
            progress(
                f"log {system.name}: {n} commits, median {b['commit_ms']:.1f} ms, "
                f"{b['commit_requests']} requests"
            )
        for r in range(sizes.log_rounds):
            for system in versioned:
                m = pool[system.name].call(
                    "log_round",
                    label=label,
                    n=n,
                    c=c,
                    old=old,
                    ids=ids[system.name],
                    refs=sizes.log_refs,
                )
                out[system.name]["rounds"].append(m)
                progress(
                    f"log round {r + 1}/{sizes.log_rounds} {system.name}: log() of "
                    f"{m['log_entries']} in {m['log_ms']:.1f} ms ({m['log_requests']} requests); "
                    f"branches and tags in {m['refs_ms']:.1f} ms ({m['refs_requests']} requests); "
                    f"checkout of commit {old} in {m['checkout_ms']:.1f} ms "
                    f"({m['checkout_requests']} requests)"
                )
        for system in versioned:
            pool[system.name].call("destroy", label=label)
    for m in out.values():
        rounds = m["rounds"]
        m["log_ms"] = min(x["log_ms"] for x in rounds)
        m["checkout_ms"] = min(x["checkout_ms"] for x in rounds)
        m["refs_ms"] = min(x["refs_ms"] for x in rounds)
        for k in ("log_requests", "checkout_requests", "log_entries", "refs_requests"):
            m[k] = rounds[-1][k]
    return _finish(out, pool)


def bench_concurrent(systems: list[System], sizes: Sizes, ctx: Context) -> Results:
    """``writers`` processes commit distinct chunks of one array to ``main`` at once.

    The writers are spawned by the system's worker (so they run its Python). Afterwards a fresh
    client reads ``main`` and counts the writes that landed. A commit that reported success but
    whose chunk is missing is a lost update.
    """
    out: Results = {}
    for system in [s for s in systems if s.versioned]:
        with ctx.workers([system]) as pool:
            out[system.name] = pool[system.name].call(
                "concurrent", writers=sizes.writers, trials=sizes.concurrent_trials
            )
        _finish(out, pool)
    return out


BENCHMARKS: dict[str, Callable[[list[System], Sizes, Context], Results]] = {
    "bulk": bench_bulk,
    "small": bench_small,
    "random": bench_random,
    "commit": bench_commit,
    "log": bench_log,
    "concurrent": bench_concurrent,
}
