"""``zarrlake serve`` against zarrlake's own reads of the same storage (issue 40).

    python bench/serve.py            # full sizes
    python bench/serve.py --quick    # smaller sizes, about a minute
    python bench/serve.py --no-s3    # the local directory only

For each backend (a local directory; S3 on a ``moto_server`` this run starts and stops), one
repository holds an array of 1 MiB chunks and one of 16 KiB chunks (these go into packs, so
each read is a ranged GET). ``zarrlake serve`` runs as its own process (the CLI, on a free port),
as it would in production: it does not share this process's interpreter lock.

- **chunk bytes, 16 in flight**: every chunk of the array fetched once, 16 at a time — direct:
  ``await session.store.get(key)``; served: ``GET /zarr/<tag>/<key>`` over aiohttp. The rows
  to hold to **served ÷ direct ≥ 0.8** (speed: the direct time ÷ the served time).
- **array read with zarr**: ``zarr.open_array(store)[...]``, decoding included — direct: the
  session's store; served: zarr-python's ``FsspecStore`` over HTTP.
- **50 concurrent readers**: 50 tasks each reading random chunks back to back (1 MiB and 16 KiB
  chunks): requests/s, MB/s, and the p50 and p99 of one read's latency, direct and served.

Times are the best of ``--rounds`` after a warm-up pass (both sides read through the same
caches: the server's store is a session store too). The machine's cores are shared by the
reader, the server and, on S3, moto: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp
import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import FsspecStore

import zarrlake
from harness import S3Server, progress

MiB = 1024 * 1024
TARGET = 0.8


@dataclass(frozen=True)
class Sizes:
    big_chunks: int  # 1 MiB chunks in the bulk array
    small_chunks: int  # 16 KiB chunks in the small array
    reads_big: int  # reads of the 50 readers, 1 MiB chunks (all of them together)
    reads_small: int
    rounds: int


FULL = Sizes(big_chunks=64, small_chunks=2000, reads_big=1500, reads_small=10000, rounds=3)
QUICK = Sizes(big_chunks=24, small_chunks=500, reads_big=400, reads_small=2000, rounds=2)


# -- the repository and the server -------------------------------------------------------------


def populate(storage: zarrlake.Storage, sizes: Sizes) -> zarrlake.Repository:
    """Arrays ``big`` (1 MiB float64 chunks, random: incompressible) and ``small`` (16 KiB)."""
    repo = zarrlake.Repository.create(storage)
    rng = np.random.default_rng(40)
    session = repo.writable_session("main")
    root = zarr.open_group(session.store, mode="w")
    per_big = MiB // 8
    big = root.create_array(
        "big", shape=(sizes.big_chunks * per_big,), chunks=(per_big,), dtype="f8", compressors=None
    )
    big[:] = rng.random(big.shape[0])
    per_small = 16 * 1024 // 8
    small = root.create_array(
        "small",
        shape=(sizes.small_chunks * per_small,),
        chunks=(per_small,),
        dtype="f8",
        compressors=None,
    )
    small[:] = rng.random(small.shape[0])
    repo.create_tag("bench", session.commit("bench data"))
    return repo


@contextmanager
def serving(url: str, env: dict[str, str]) -> Iterator[str]:
    """``zarrlake serve URL --port 0`` as a child process; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zarrlake", "serve", url, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if " at http://" not in line:
            raise RuntimeError(f"zarrlake serve did not start: {line!r}")
        yield line.split(" at ")[1].split()[0].rstrip("/")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


# -- what is timed ------------------------------------------------------------------------------


def keys(array: str, n: int) -> list[str]:
    return [f"{array}/c/{i}" for i in range(n)]


async def gather_bounded(fns: list[Callable[[], Awaitable[Any]]], limit: int) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(fn: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await fn()

    await asyncio.gather(*(one(fn) for fn in fns))


def best(rounds: int, run: Callable[[], float]) -> float:
    run()  # warm-up
    return min(run() for _ in range(rounds))


def direct_fetch(store: Any, names: list[str], limit: int) -> float:
    async def go() -> float:
        proto = default_buffer_prototype()

        async def get(key: str) -> None:
            assert await store.get(key, proto) is not None

        t = time.perf_counter()
        await gather_bounded([lambda k=k: get(k) for k in names], limit)
        return time.perf_counter() - t

    return asyncio.run(go())


def served_fetch(base: str, names: list[str], limit: int) -> float:
    async def go() -> float:
        connector = aiohttp.TCPConnector(limit=limit)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def get(key: str) -> None:
                async with http.get(f"{base}/{key}") as r:
                    assert r.status == 200, r.status
                    await r.read()

            t = time.perf_counter()
            await gather_bounded([lambda k=k: get(k) for k in names], limit)
            return time.perf_counter() - t

    return asyncio.run(go())


def zarr_read(store: Any, path: str) -> float:
    array = zarr.open_array(store, path=path, mode="r")
    t = time.perf_counter()
    array[...]
    return time.perf_counter() - t


@dataclass
class Load:
    seconds: float
    latencies: list[float]
    nbytes: int

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def mbps(self) -> float:
        return self.nbytes / self.seconds / 1e6

    def pct(self, q: float) -> float:
        return statistics.quantiles(self.latencies, n=100)[int(q) - 1] * 1000


def readers(fetch: Callable[[str], Awaitable[int]], names: list[str], total: int) -> Load:
    """50 readers, ``total`` random reads of ``names`` between them, each timed."""
    rng = random.Random(40)
    plan = [rng.choice(names) for _ in range(total)]
    latencies: list[float] = []
    nbytes = 0

    async def reader(mine: list[str]) -> None:
        nonlocal nbytes
        for key in mine:
            t = time.perf_counter()
            n = await fetch(key)  # (not `nbytes += await ...`: that reads nbytes before waiting)
            latencies.append(time.perf_counter() - t)
            nbytes += n

    async def go() -> float:
        t = time.perf_counter()
        await asyncio.gather(*(reader(plan[i::50]) for i in range(50)))
        return time.perf_counter() - t

    seconds = asyncio.run(go())
    return Load(seconds, latencies, nbytes)


def direct_readers(repo: zarrlake.Repository, names: list[str], total: int) -> Load:
    store = repo.readonly_session("bench").store
    proto = default_buffer_prototype()

    async def fetch(key: str) -> int:
        buf = await store.get(key, proto)
        assert buf is not None
        return len(buf)

    readers(fetch, names, min(total, 200))  # warm-up
    return readers(fetch, names, total)


def served_readers(base: str, names: list[str], total: int) -> Load:
    state: dict[str, aiohttp.ClientSession] = {}

    async def fetch(key: str) -> int:
        http = state.get("http")
        if http is None:
            http = state["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=50))
        async with http.get(f"{base}/{key}") as r:
            assert r.status == 200, r.status
            return len(await r.read())

    def run(n: int) -> Load:
        try:
            return readers(fetch, names, n)
        finally:
            http = state.pop("http", None)
            if http is not None:
                asyncio.run(http.close())

    run(min(total, 200))
    return run(total)


# -- one backend --------------------------------------------------------------------------------


def bench_backend(
    label: str, storage: zarrlake.Storage, url: str, env: dict[str, str], sizes: Sizes
) -> list[list[str]]:
    progress(f"{label}: writing {sizes.big_chunks} x 1 MiB and {sizes.small_chunks} x 16 KiB")
    repo = populate(storage, sizes)
    store = repo.readonly_session("bench").store
    rows: list[list[str]] = []
    with serving(url, env) as server:
        base = f"{server}/zarr/bench"
        for array, n, what in (
            ("big", sizes.big_chunks, "1 MiB"),
            ("small", sizes.small_chunks, "16 KiB"),
        ):
            names = keys(array, n)
            progress(f"{label}: chunk bytes, {n} x {what}")
            direct = best(sizes.rounds, partial(direct_fetch, store, names, 16))
            served = best(sizes.rounds, partial(served_fetch, base, names, 16))
            rows.append(_ratio_row(f"{label}: {n} x {what} chunk bytes, 16 in flight", direct,
                                   served, target=True))  # fmt: skip
        for array, n, what in (
            ("big", sizes.big_chunks, "1 MiB"),
            ("small", sizes.small_chunks, "16 KiB"),
        ):
            progress(f"{label}: zarr array read, {what} chunks")
            http_store = FsspecStore.from_url(base, read_only=True)
            direct = best(sizes.rounds, partial(zarr_read, store, array))
            served = best(sizes.rounds, partial(zarr_read, http_store, array))
            rows.append(_ratio_row(f"{label}: zarr read of {n} x {what} (decoded)", direct,
                                   served, target=False))  # fmt: skip
        for array, n, total, what in (
            ("big", sizes.big_chunks, sizes.reads_big, "1 MiB"),
            ("small", sizes.small_chunks, sizes.reads_small, "16 KiB"),
        ):
            names = keys(array, n)
            progress(f"{label}: 50 readers, {total} random {what} reads")
            d = direct_readers(repo, names, total)
            s = served_readers(base, names, total)
            rows.append(
                [
                    f"{label}: 50 readers, {total} random {what} reads",
                    f"{d.rps:,.0f} req/s, {d.mbps:,.0f} MB/s",
                    f"{s.rps:,.0f} req/s, {s.mbps:,.0f} MB/s",
                    f"{s.rps / d.rps:.2f}",
                    f"p50 {d.pct(50):.1f} / p99 {d.pct(99):.1f} ms",
                    f"p50 {s.pct(50):.1f} / p99 {s.pct(99):.1f} ms",
                    "",
                ]
            )
    return rows


def _ratio_row(label: str, direct: float, served: float, *, target: bool) -> list[str]:
    ratio = direct / served
    verdict = ("ok" if ratio >= TARGET else "MISS") if target else ""
    return [label, f"{direct:.3f} s", f"{served:.3f} s", f"{ratio:.2f}", "", "", verdict]


def print_table(rows: list[list[str]]) -> None:
    headers = [
        "benchmark",
        "direct",
        "served",
        "served÷direct",
        "direct latency",
        "served latency",
        f"≥ {TARGET}",
    ]
    print("| " + " | ".join(headers) + " |")
    print("| --- | " + " | ".join("---:" for _ in headers[1:]) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print(
        "served÷direct: speed through `zarrlake serve` ÷ speed of zarrlake's own reads of the same "
        "storage (direct time ÷ served time; for the readers, requests/s ÷ requests/s)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--no-s3", action="store_true", help="the local directory only")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZARRLAKE_")}
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as work:
        local = Path(work) / "local"
        rows += bench_backend("local", zarrlake.Storage.local(local), str(local), env, sizes)
        if not args.no_s3:
            server = S3Server.start(str(Path(work) / "moto.log"))
            try:
                storage = zarrlake.Storage.s3(
                    server.bucket,
                    "serve-bench",
                    endpoint_url=server.endpoint,
                    region="us-east-1",
                    allow_http=True,
                )
                env = {**env, **{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}}
                rows += bench_backend("s3", storage, storage.url, env, sizes)
            finally:
                server.stop()
    print_table(rows)


if __name__ == "__main__":
    main()
