"""The operations a benchmark times, for one system, inside that system's worker process.

``bench/worker.py`` calls these by name with JSON arguments; each returns a JSON-able dict. The
loops over rounds and systems (and so the interleaving) stay in ``workloads.py``, in the
orchestrating process. Every timed operation is also metered: the storage requests it made
(:class:`Meter`) — checks of what was read happen afterwards, outside the clock and the count.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import zarr

from harness import RequestLog, progress
from systems import S3, ZARRLAKE, System, zarrlake_counts

T = TypeVar("T")
ARRAY = "data"


class Meter:
    """Wall time and storage requests of one call.

    On S3 the requests are the HTTP requests the shared moto_server logged (every S3 system
    counted the same way); for zarrlake on a local directory, the calls its storage wrapper saw.
    Raw Zarr and Icechunk on local directories are not counted (``None``).
    """

    def __init__(self, system: System, moto_log: str | None) -> None:
        self.log = RequestLog(moto_log) if system.backend == S3 and moto_log else None
        self.counts = zarrlake_counts() if system.kind == ZARRLAKE else None

    def _mark(self) -> Any:
        if self.log is not None:
            return self.log.mark()
        if self.counts is not None:
            return self.counts.total
        return None

    def _since(self, mark: Any) -> int | None:
        if self.log is not None:
            return sum(self.log.since(mark).values())
        if self.counts is not None:
            return int(self.counts.total - mark)
        return None

    def __call__(self, fn: Callable[..., T], *args: Any) -> tuple[float, T, int | None]:
        """(seconds, result, requests) of ``fn(*args)``."""
        mark = self._mark()
        t0 = time.perf_counter()
        result = fn(*args)
        seconds = time.perf_counter() - t0
        return seconds, result, self._since(mark)


class Ops:
    """The operations of one system; repositories a later call needs are kept in ``self``."""

    def __init__(self, system: System, moto_log: str | None) -> None:
        self.system = system
        self.meter = Meter(system, moto_log)
        self.moto_log = moto_log
        self._data: dict[tuple[int, int], np.ndarray] = {}
        self._repos: dict[str, Any] = {}
        self._s3: Any = None

    def _s3_server(self) -> Any:
        """An S3Server handle for deleting prefixes (no process of its own)."""
        if self._s3 is None and self.system.endpoint:
            from harness import S3Server

            self._s3 = S3Server(None, self.system.endpoint, self.moto_log or "")
        return self._s3

    def data(self, seed: int, nbytes: int) -> np.ndarray:
        key = (seed, nbytes)
        if key not in self._data:
            self._data = {key: np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)}
        return self._data[key]

    def destroy(self, label: str) -> dict[str, Any]:
        self._repos.pop(label, None)
        self.system.destroy(label, self._s3_server())
        return {}

    # -- bulk and small: write, then read on a fresh client ---------------------------------------

    def write_read(self, label: str, seed: int, nbytes: int, chunk: int, keep: bool) -> dict:
        system, data = self.system, self.data(seed, nbytes)
        w, _, w_req = self._write_all(label, data, chunk)
        rd, got, r_req = self.meter(_read_version, system, system.open(label))
        if not np.array_equal(got, data):
            raise AssertionError(f"{system.name}: read back different data")
        if not keep:
            self.destroy(label)
        return {"write_s": w, "read_s": rd, "write_requests": w_req, "read_requests": r_req}

    def _write_all(
        self, label: str, data: np.ndarray, chunk: int
    ) -> tuple[float, None, int | None]:
        """Create a repository, write ``data`` in one array, commit (timed from the session)."""
        system = self.system
        repo = system.create(label)

        def work() -> None:
            txn = system.begin(repo)
            _create_array(txn.store, data.size, chunk, str(data.dtype))[:] = data
            txn.commit("bulk write")

        return self.meter(work)

    # -- random single-chunk reads -----------------------------------------------------------------

    def random_prepare(self, label: str | None, seed: int, nbytes: int, chunk: int) -> dict:
        """The label of a repository holding the small-chunk array (written here if ``None``)."""
        if label is None:
            label = "random"
            self._write_all(label, self.data(seed, nbytes), chunk)
        return {"label": label}

    def random_round(
        self, label: str, seed: int, nbytes: int, chunk: int, picks: list[int]
    ) -> dict:
        """Open the repository afresh and read one chunk (timed and counted as "open + first
        read"); then read ``picks``, one Zarr call each."""
        system, data, c = self.system, self.data(seed, nbytes), chunk

        def open_and_read_first() -> tuple[zarr.Array, np.ndarray]:
            arr = _open_array(system.read_store(system.open(label)))
            return arr, arr[picks[0] * c : (picks[0] + 1) * c]

        t_open, (arr, first), open_req = self.meter(open_and_read_first)
        seconds, got, req = self.meter(_read_chunks, arr, picks, c)
        for i, g in zip([picks[0], *picks], [first, *got], strict=True):
            if not np.array_equal(g, data[i * c : (i + 1) * c]):
                raise AssertionError(f"{system.name}: random read of chunk {i} is wrong")
        return {
            "read_ms": seconds * 1000 / len(picks),
            "read_requests": None if req is None else req / len(picks),
            "open_first_ms": t_open * 1000,
            "open_first_requests": open_req,
        }

    # -- one-chunk commits into repositories of N chunks -------------------------------------------

    def commit_build(self, n: int) -> dict:
        label = f"commit-{n}"
        repo = self.system.create(label)
        seconds, _, req = self.meter(_build_int_array, self.system, repo, n)
        self._repos[label] = repo
        return {"build_s": seconds, "build_requests": req}

    def commit_one(self, n: int, pos: int, rep: int) -> dict:
        """Open a session, write one chunk, commit: the whole, and the commit call alone."""
        repo = self._repos[f"commit-{n}"]
        t_txn, t_commit, req = self.meter(_one_chunk_commit, self.system, repo, pos, rep)
        return {"txn_s": t_txn, "commit_s": t_commit, "requests": req}

    def commit_check(self, n: int) -> dict:
        label = f"commit-{n}"
        check = _open_array(self.system.read_store(self.system.open(label)))
        if check.shape != (n,):
            raise AssertionError(f"{self.system.name}: commit repository has the wrong shape")
        self.destroy(label)
        return {}

    # -- history: sequential commits, log(), checkout ----------------------------------------------

    def log_build(self, label: str, n: int, c: int, refs: int) -> dict:
        """Create the array, then ``n`` commits; commit ``k`` writes chunk ``k - 1`` with ``k``;
        then ``refs`` branches and as many tags at commits spread over the history."""
        system = self.system
        repo = system.create(label)
        txn = system.begin(repo)
        _create_array(txn.store, n * c, c, "int64")
        txn.commit("create array")
        ids, per_commit, requests = [], [], []

        def one(k: int) -> str:
            txn = system.begin(repo)
            zarr.open_array(txn.store, path=ARRAY)[(k - 1) * c : k * c] = k
            return txn.commit(f"commit {k}") or ""

        for k in range(1, n + 1):
            seconds, snap, req = self.meter(one, k)
            ids.append(snap)
            per_commit.append(seconds)
            requests.append(req)
        branches, tags = _ref_names(refs)
        system.make_refs(
            repo,
            {b: ids[i % n] for i, b in enumerate(branches)},
            {t: ids[(7 * i) % n] for i, t in enumerate(tags)},
        )
        return {
            "ids": ids,
            "commit_ms": statistics.median(per_commit) * 1000,
            "commits_total_s": sum(per_commit),
            "commit_requests": None if None in requests else statistics.median(requests),
        }

    def log_round(self, label: str, n: int, c: int, old: int, ids: list[str], refs: int) -> dict:
        """``log()`` on a fresh client, the branches and tags on another, then a checkout of
        commit ``old`` on a third."""
        system = self.system
        repo = system.open(label)
        t_log, entries, log_req = self.meter(system.log, repo)
        if entries[:n] != ids[::-1]:
            raise AssertionError(f"{system.name}: log() does not list the commits in order")
        t_refs, listed, refs_req = self.meter(system.refs, system.open(label))
        branches, tags = _ref_names(refs)
        if listed != (sorted([*branches, "main"]), tags):
            raise AssertionError(f"{system.name}: the branches and tags listed are not all there")
        expected = np.zeros(n * c, dtype=np.int64)
        for k in range(1, old + 1):
            expected[(k - 1) * c : k * c] = k
        t_checkout, got, co_req = self.meter(
            _read_version, system, system.open(label), ids[old - 1]
        )
        if not np.array_equal(got, expected):
            raise AssertionError(f"{system.name}: checkout of commit {old} reads wrong data")
        return {
            "log_ms": t_log * 1000,
            "log_requests": log_req,
            "log_entries": len(entries),
            "checkout_ms": t_checkout * 1000,
            "checkout_requests": co_req,
            "refs_ms": t_refs * 1000,
            "refs_requests": refs_req,
        }

    # -- concurrent writers ------------------------------------------------------------------------

    def concurrent(self, writers: int, trials: int) -> dict:
        return _concurrent(self.system, self._s3_server(), writers, trials)


def _ref_names(count: int) -> tuple[list[str], list[str]]:
    """The names of the history benchmark's branches and tags, sorted."""
    return [f"branch-{i:04d}" for i in range(count)], [f"tag-{i:04d}" for i in range(count)]


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


def _read_version(system: System, repo: Any, snapshot: str | None = None) -> np.ndarray:
    return _open_array(system.read_store(repo, snapshot))[:]


def _read_chunks(arr: zarr.Array, picks: list[int], c: int) -> list[np.ndarray]:
    return [arr[i * c : (i + 1) * c] for i in picks]


def _one_chunk_commit(system: System, repo: Any, pos: int, rep: int) -> float:
    """Open a session, write one chunk, commit. Returns the seconds spent in the commit call."""
    txn = system.begin(repo)
    zarr.open_array(txn.store, path=ARRAY)[pos] = -rep - 1
    t0 = time.perf_counter()
    txn.commit(f"one chunk at {pos}")
    return time.perf_counter() - t0


BUILD_BATCH = 10_000  # chunk writes in flight at once


def _build_int_array(system: System, repo: Any, n: int) -> None:
    """An array of ``n`` one-element chunks (chunk ``i`` holds ``i + 1``), one session, one
    commit. The array is created through Zarr; its chunks go straight to the system's Zarr store
    as the encoded bytes Zarr would write (little-endian int64, no compression), many writes in
    flight: Zarr's array API costs ~0.3 ms a chunk for every system, which would make building a
    million-chunk repository the whole benchmark."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    txn = system.begin(repo)
    _create_array(txn.store, n, 1, "int64")
    buffer = default_buffer_prototype().buffer

    async def batch(lo: int, hi: int) -> None:
        values = np.arange(lo + 1, hi + 1, dtype="<i8")
        await asyncio.gather(
            *(
                txn.store.set(f"{ARRAY}/c/{i}", buffer.from_bytes(v.tobytes()))
                for i, v in zip(range(lo, hi), values, strict=True)
            )
        )

    for lo in range(0, n, BUILD_BATCH):
        sync(batch(lo, min(n, lo + BUILD_BATCH)))
    txn.commit(f"{n} chunks")


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


def _concurrent(system: System, s3: Any, nw: int, trials: int) -> dict:
    """``nw`` processes (spawned, with this worker's interpreter) commit distinct chunks of one
    array to ``main`` at once; afterwards a fresh client counts the writes that landed. A commit
    that reported success but whose chunk is missing is a lost update."""
    ctx = mp.get_context("spawn")
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

    def landed(k: int) -> bool:
        return bool(np.all(got[k * _CHUNK : (k + 1) * _CHUNK] == k + 1))

    landed_by_trial = [sum(landed(t * nw + w) for w in range(nw)) for t in range(trials)]
    ok_reports = {(t, w) for t, w, ok, _, _ in reports if ok}
    lost = sum(1 for t, w in ok_reports if not landed(t * nw + w))
    errors = sorted({e for _, _, ok, e, _ in reports if not ok})
    entries = len(system.log(system.open(label)))
    system.destroy(label, s3)
    progress(
        f"concurrent {system.name}: {sum(landed_by_trial)}/{nw * trials} landed "
        f"(per trial {landed_by_trial}; {lost} lost updates; errors: {errors or 'none'})"
    )
    return {
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
