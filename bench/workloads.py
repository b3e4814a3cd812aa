"""The benchmarks. Each takes the systems and the sizes and returns ``{system name: metrics}``.

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

import multiprocessing as mp
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from harness import S3Server, progress, timed
from systems import System

ARRAY = "data"


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
    commit_sizes: tuple[int, ...] = (1_000, 10_000, 100_000)
    commit_reps: int = 7
    log_commits: int = 100
    log_rounds: int = 5
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
            commit_sizes=(1_000, 10_000),
            commit_reps=5,
            log_commits=20,
            log_rounds=3,
            concurrent_trials=3,
        )


Results = dict[str, dict[str, Any]]


def _create_array(store: Any, n: int, chunk: int, dtype: str = "uint8") -> zarr.Array:
    return zarr.create_array(
        store,
        name=ARRAY,
        shape=(n,),
        chunks=(chunk,),
        dtype=dtype,
        compressors=None,
        fill_value=0,
        overwrite=True,
    )


def _open_array(store: Any) -> zarr.Array:
    return zarr.open_array(store, path=ARRAY, mode="r")


def _write_all(system: System, label: str, data: np.ndarray, chunk: int) -> float:
    """Create a repository, write ``data`` in one array, commit. Returns seconds."""
    repo = system.create(label)

    def work() -> None:
        txn = system.begin(repo)
        _create_array(txn.store, data.size, chunk, str(data.dtype))[:] = data
        txn.commit("bulk write")

    seconds, _ = timed(work)
    return seconds


def _read_version(system: System, repo: Any, snapshot: str | None = None) -> np.ndarray:
    return _open_array(system.read_store(repo, snapshot))[:]


def _read_all(system: System, label: str, expected: np.ndarray) -> float:
    seconds, got = timed(_read_version, system, system.open(label))
    if not np.array_equal(got, expected):
        raise AssertionError(f"{system.name}: read back different data")
    return seconds


def _small_data(sizes: Sizes) -> np.ndarray:
    n, c = sizes.small_chunks, sizes.small_chunk_bytes
    return np.random.default_rng(2).integers(0, 256, n * c, dtype=np.uint8)


# Repositories a benchmark leaves for a later one: the random-read benchmark reads the arrays the
# small-chunk benchmark wrote instead of writing 20,000 chunks per system again.
_KEPT: dict[str, str] = {}


def _write_read(
    systems: list[System],
    s3: S3Server | None,
    name: str,
    data: np.ndarray,
    chunk: int,
    rounds: int,
    keep_last: bool = False,
) -> Results:
    runs: dict[str, dict[str, list[float]]] = {
        s.name: {"write_s": [], "read_s": []} for s in systems
    }
    for r in range(rounds):
        for system in systems:
            label = f"{name}-{r}"
            w = _write_all(system, label, data, chunk)
            rd = _read_all(system, label, data)
            if keep_last and r == rounds - 1:
                _KEPT[f"{name}/{system.name}"] = label
            else:
                system.destroy(label, s3)
            runs[system.name]["write_s"].append(w)
            runs[system.name]["read_s"].append(rd)
            progress(f"{name} round {r + 1}/{rounds} {system.name}: write {w:.2f}s read {rd:.2f}s")
    return {
        n: {
            "write_s": min(v["write_s"]),
            "read_s": min(v["read_s"]),
            "write_s_median": statistics.median(v["write_s"]),
            "read_s_median": statistics.median(v["read_s"]),
            "rounds": v,
        }
        for n, v in runs.items()
    }


def bench_bulk(systems: list[System], sizes: Sizes, s3: S3Server | None) -> Results:
    """Bulk write and read: ``bulk_mib`` MiB in 1 MiB chunks."""
    data = np.random.default_rng(1).integers(0, 256, sizes.bulk_mib << 20, dtype=np.uint8)
    out = _write_read(systems, s3, "bulk", data, sizes.bulk_chunk_bytes, sizes.bulk_rounds)
    for m in out.values():
        m["write_mib_s"] = sizes.bulk_mib / m["write_s"]
        m["read_mib_s"] = sizes.bulk_mib / m["read_s"]
    return out


def bench_small(systems: list[System], sizes: Sizes, s3: S3Server | None) -> Results:
    """Many small chunks (above every inline threshold, so each is its own object)."""
    n, c = sizes.small_chunks, sizes.small_chunk_bytes
    out = _write_read(
        systems, s3, "small", _small_data(sizes), c, sizes.small_rounds, keep_last=True
    )
    for m in out.values():
        m["write_chunks_s"] = n / m["write_s"]
        m["read_chunks_s"] = n / m["read_s"]
    return out


def bench_random(systems: list[System], sizes: Sizes, s3: S3Server | None) -> Results:
    """Random single-chunk reads, one Zarr call each, from the small-chunk array.

    Each round opens the repository afresh and reads ``random_reads`` chunks at positions drawn
    for that round (the same for every system); the best round counts.
    """
    n, c = sizes.small_chunks, sizes.small_chunk_bytes
    data = _small_data(sizes)
    labels = {}
    for system in systems:
        label = _KEPT.pop(f"small/{system.name}", None)
        if label is None:
            label = "random"
            _write_all(system, label, data, c)
        labels[system.name] = label
    rng = random.Random(3)
    per_read: dict[str, list[float]] = {s.name: [] for s in systems}
    for r in range(sizes.random_rounds):
        picks = rng.choices(range(n), k=sizes.random_reads)
        for system in systems:
            arr = _open_array(system.read_store(system.open(labels[system.name])))
            seconds, got = timed(_read_chunks, arr, picks, c)
            for i, g in zip(picks, got, strict=True):
                if not np.array_equal(g, data[i * c : (i + 1) * c]):
                    raise AssertionError(f"{system.name}: random read of chunk {i} is wrong")
            per_read[system.name].append(seconds * 1000 / len(picks))
            progress(
                f"random reads round {r + 1}/{sizes.random_rounds} {system.name}: "
                f"{per_read[system.name][-1]:.2f} ms/read"
            )
    for system in systems:
        system.destroy(labels[system.name], s3)
    return {
        name: {"read_ms": min(v), "rounds_ms": v, "reads": sizes.random_reads}
        for name, v in per_read.items()
    }


def _read_chunks(arr: zarr.Array, picks: list[int], c: int) -> list[np.ndarray]:
    return [arr[i * c : (i + 1) * c] for i in picks]


def bench_commit(systems: list[System], sizes: Sizes, s3: S3Server | None) -> Results:
    """One-chunk commit in repositories of 1,000 / 10,000 / 100,000 chunks.

    Each repository is built once, in one session (tiny chunks, small enough to be stored inline by
    both engines). Then, ``commit_reps`` rounds over every system and size: open a writable
    session, write one chunk at a random position, commit — timed as a whole, and the commit call
    alone. A warm-up round is not counted; the median of the rest is reported.
    """
    versioned = [s for s in systems if s.versioned]
    repos: dict[tuple[str, int], Any] = {}
    builds: dict[tuple[str, int], float] = {}
    for system in versioned:
        for n in sizes.commit_sizes:
            repo = system.create(f"commit-{n}")
            builds[system.name, n], _ = timed(_build_int_array, system, repo, n)
            repos[system.name, n] = repo
            progress(f"commit: built {system.name} @{n:,} chunks in {builds[system.name, n]:.1f}s")
    rng = random.Random(4)
    txn_ms: dict[tuple[str, int], list[float]] = {k: [] for k in repos}
    commit_ms: dict[tuple[str, int], list[float]] = {k: [] for k in repos}
    for rep in range(sizes.commit_reps + 1):
        for system in versioned:
            for n in sizes.commit_sizes:
                key = (system.name, n)
                t_txn, t_commit = timed(
                    _one_chunk_commit, system, repos[key], rng.randrange(n), rep
                )
                if rep:
                    txn_ms[key].append(t_txn * 1000)
                    commit_ms[key].append(t_commit * 1000)
    out: Results = {}
    for system in versioned:
        metrics: dict[str, Any] = {}
        for n in sizes.commit_sizes:
            key = (system.name, n)
            label = f"commit-{n}"
            check = _open_array(system.read_store(system.open(label)))
            if check.shape != (n,):
                raise AssertionError(f"{system.name}: commit repository has the wrong shape")
            system.destroy(label, s3)
            metrics[str(n)] = {
                "txn_ms": statistics.median(txn_ms[key]),
                "commit_ms": statistics.median(commit_ms[key]),
                "build_s": builds[key],
                "txn_ms_all": txn_ms[key],
            }
            progress(
                f"commit {system.name} @{n:,} chunks: {metrics[str(n)]['txn_ms']:.1f} ms "
                f"(commit() {metrics[str(n)]['commit_ms']:.1f} ms)"
            )
        lo, hi = str(min(sizes.commit_sizes)), str(max(sizes.commit_sizes))
        metrics["growth"] = metrics[hi]["txn_ms"] / metrics[lo]["txn_ms"]
        metrics["commit_growth"] = metrics[hi]["commit_ms"] / metrics[lo]["commit_ms"]
        out[system.name] = metrics
    return out


def _one_chunk_commit(system: System, repo: Any, pos: int, rep: int) -> float:
    """Open a session, write one chunk, commit. Returns the seconds spent in the commit call."""
    txn = system.begin(repo)
    zarr.open_array(txn.store, path=ARRAY)[pos] = -rep - 1
    t, _ = timed(txn.commit, f"one chunk at {pos}")
    return t


def _build_int_array(system: System, repo: Any, n: int) -> None:
    txn = system.begin(repo)
    _create_array(txn.store, n, 1, "int64")[:] = np.arange(1, n + 1, dtype=np.int64)
    txn.commit(f"{n} chunks")


def bench_log(systems: list[System], sizes: Sizes, s3: S3Server | None) -> Results:
    """Sequential commits, then ``log()`` and checkout of an old commit, on a fresh client.

    Commit ``k`` writes chunk ``k - 1`` (1 KiB, a chunk object) with the value ``k``; the checkout
    reads the whole array as of commit ``k_old`` and checks that exactly chunks ``< k_old`` are set.
    ``log()`` and the checkout are measured in interleaved rounds, each on a freshly opened
    repository; the best round counts.
    """
    n, c = sizes.log_commits, 128
    old = max(1, n // 10)
    expected = np.zeros(n * c, dtype=np.int64)
    for k in range(1, old + 1):
        expected[(k - 1) * c : k * c] = k
    versioned = [s for s in systems if s.versioned]
    label = "log"
    ids: dict[str, list[str]] = {}
    out: Results = {}
    for system in versioned:
        repo = system.create(label)
        txn = system.begin(repo)
        _create_array(txn.store, n * c, c, "int64")
        txn.commit("create array")
        ids[system.name] = []
        per_commit = []
        for k in range(1, n + 1):
            t0 = time.perf_counter()
            txn = system.begin(repo)
            zarr.open_array(txn.store, path=ARRAY)[(k - 1) * c : k * c] = k
            ids[system.name].append(txn.commit(f"commit {k}") or "")
            per_commit.append(time.perf_counter() - t0)
        out[system.name] = {
            "commit_ms": statistics.median(per_commit) * 1000,
            "commits_total_s": sum(per_commit),
            "log_rounds_ms": [],
            "checkout_rounds_ms": [],
            "checkout_commit": old,
        }
        progress(f"log {system.name}: {n} commits, median {out[system.name]['commit_ms']:.1f} ms")
    for r in range(sizes.log_rounds):
        for system in versioned:
            m = out[system.name]
            t_log, entries = timed(system.log, system.open(label))
            if entries[:n] != ids[system.name][::-1]:
                raise AssertionError(f"{system.name}: log() does not list the commits in order")
            snap = ids[system.name][old - 1]
            t_checkout, got = timed(_read_version, system, system.open(label), snap)
            if not np.array_equal(got, expected):
                raise AssertionError(f"{system.name}: checkout of commit {old} reads wrong data")
            m["log_rounds_ms"].append(t_log * 1000)
            m["checkout_rounds_ms"].append(t_checkout * 1000)
            m["log_entries"] = len(entries)
            progress(
                f"log round {r + 1}/{sizes.log_rounds} {system.name}: log() of {len(entries)} "
                f"in {t_log * 1000:.1f} ms; checkout of commit {old} in {t_checkout * 1000:.1f} ms"
            )
    for system in versioned:
        m = out[system.name]
        m["log_ms"] = min(m["log_rounds_ms"])
        m["checkout_ms"] = min(m["checkout_rounds_ms"])
        system.destroy(label, s3)
    return out


# -- concurrent writers ------------------------------------------------------------------------

_CHUNK = 128  # int64 elements per chunk in the concurrent-writer array


def _writer(system: System, label: str, w: int, trials: int, barrier: Any, results: Any) -> None:
    """One writer process: per trial, write chunk ``trial * writers + w``, wait for the others,
    then commit (rebasing on whatever landed meanwhile) and report."""
    writers = barrier.parties
    repo = system.open(label)
    for t in range(trials):
        ok, err, elapsed = False, "", 0.0
        try:
            barrier.wait(120)  # everyone starts the trial from the same head
            txn = system.begin(repo)
            k = t * writers + w
            zarr.open_array(txn.store, path=ARRAY)[k * _CHUNK : (k + 1) * _CHUNK] = k + 1
            barrier.wait(120)  # everyone has written; now race to commit
            t0 = time.perf_counter()
            txn.commit(f"trial {t} writer {w}", concurrent=True)
            elapsed = time.perf_counter() - t0
            ok = True
        except threading.BrokenBarrierError:
            err = "barrier broken (another writer died)"
        except Exception as e:
            err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        results.put((t, w, ok, err, elapsed))


def bench_concurrent(systems: list[System], sizes: Sizes, s3: S3Server | None) -> Results:
    """``writers`` processes (spawned) commit distinct chunks of one array to ``main`` at once.

    Afterwards a fresh client reads ``main`` and counts the writes that landed. A commit that
    reported success but whose chunk is missing is a lost update.
    """
    ctx = mp.get_context("spawn")
    nw, trials = sizes.writers, sizes.concurrent_trials
    out: Results = {}
    for system in [s for s in systems if s.versioned]:
        label = "concurrent"
        repo = system.create(label)
        txn = system.begin(repo)
        _create_array(txn.store, trials * nw * _CHUNK, _CHUNK, "int64")
        txn.commit("create array")
        barrier = ctx.Barrier(nw)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_writer, args=(system, label, w, trials, barrier, results))
            for w in range(nw)
        ]
        for p in procs:
            p.start()
        reports = []
        deadline = time.monotonic() + 120 + 60 * trials
        while len(reports) < nw * trials and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=5))
            except Exception:
                if not any(p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)

        got = _open_array(system.read_store(system.open(label)))[:]
        landed_by_trial = []
        for t in range(trials):
            n = 0
            for w in range(nw):
                k = t * nw + w
                if np.all(got[k * _CHUNK : (k + 1) * _CHUNK] == k + 1):
                    n += 1
            landed_by_trial.append(n)
        ok_reports = {(t, w) for t, w, ok, _, _ in reports if ok}
        lost = sum(
            1
            for t, w in ok_reports
            if not np.all(got[(t * nw + w) * _CHUNK : (t * nw + w + 1) * _CHUNK] == t * nw + w + 1)
        )
        errors = sorted({e for _, _, ok, e, _ in reports if not ok})
        entries = len(system.log(system.open(label)))
        system.destroy(label, s3)
        out[system.name] = {
            "landed": sum(landed_by_trial),
            "total": nw * trials,
            "landed_by_trial": landed_by_trial,
            "trials_all_landed": sum(1 for n in landed_by_trial if n == nw),
            "trials": trials,
            "commit_errors": sum(1 for r in reports if not r[2]),
            "lost_updates": lost,
            "errors": errors,
            "log_entries": entries,
            "max_commit_s": max((r[4] for r in reports), default=0.0),
        }
        progress(
            f"concurrent {system.name}: {sum(landed_by_trial)}/{nw * trials} landed "
            f"(per trial {landed_by_trial}; {lost} lost updates; errors: {errors or 'none'})"
        )
    return out


BENCHMARKS = {
    "bulk": bench_bulk,
    "small": bench_small,
    "random": bench_random,
    "commit": bench_commit,
    "log": bench_log,
    "concurrent": bench_concurrent,
}
