"""Which engine should drive the S3 backend: boto3/botocore (today: signed urllib3 requests on the
hot path, boto3 for listings and batch deletes) or obstore (Rust ``object_store``)?

    python bench/s3_engines.py             # 2000 small objects, 64 of 1 MiB, 3 rounds each
    python bench/s3_engines.py --quick

Against one ``moto_server`` on loopback, the same objects, the same concurrency (32 requests in
flight): bulk ``put`` then bulk ``get`` of many small objects (chunk-sized: 4 KiB) and of fewer
large ones (1 MiB), then one listing of everything. Rows:

- ``zarrlake S3Storage``: the backend as it is, through ``Storage.map`` (a thread pool).
- ``obstore, threads``: obstore's blocking calls on the same kind of thread pool (what a drop-in
  engine swap inside ``Storage.put``/``get`` would be).
- ``obstore, async``: obstore's ``*_async`` calls gathered on one event loop (what it does best;
  the engine's I/O is thread-based, so this is an upper bound, not a drop-in).

Both wall time and the client's own CPU time (``time.process_time``) are shown: moto is a Python
server and may be the bottleneck for wall time, while CPU per request is the client's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))

import zarrlake
from zarrlake_testkit.servers import start_moto, start_seaweedfs, stop

CONCURRENCY = 32


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def zarrlake_engine(endpoint: str, bucket: str, prefix: str) -> dict[str, Callable[..., Any]]:
    s = zarrlake.Storage.s3(
        bucket, prefix, endpoint_url=endpoint, region="us-east-1", access_key_id="k",
        secret_access_key="s", allow_http=True,
    )  # fmt: skip
    return {
        "put": lambda items: s.map(lambda kv: s.put(kv[0], kv[1]), items),
        "get": lambda keys: s.map(s.get, keys),
        "list": lambda: s.list_keys(),
    }


def obstore_store(endpoint: str, bucket: str, prefix: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        bucket, prefix=prefix, endpoint=endpoint, region="us-east-1", access_key_id="k",
        secret_access_key="s", virtual_hosted_style_request=False,
        client_options={"allow_http": True, "pool_max_idle_per_host": str(CONCURRENCY)},
    )  # fmt: skip


def obstore_threads(endpoint: str, bucket: str, prefix: str) -> dict[str, Callable[..., Any]]:
    import obstore

    store = obstore_store(endpoint, bucket, prefix)
    pool = ThreadPoolExecutor(CONCURRENCY)
    return {
        "put": lambda items: list(
            pool.map(lambda kv: obstore.put(store, kv[0], kv[1], use_multipart=False), items)
        ),
        "get": lambda keys: list(pool.map(lambda k: bytes(obstore.get(store, k).bytes()), keys)),
        "list": lambda: [
            m["path"] for batch in obstore.list(store, chunk_size=1000) for m in batch
        ],
    }


def obstore_async(endpoint: str, bucket: str, prefix: str) -> dict[str, Callable[..., Any]]:
    import obstore

    store = obstore_store(endpoint, bucket, prefix)

    async def bounded(calls: list[Callable[[], Any]]) -> list[Any]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(call: Callable[[], Any]) -> Any:
            async with gate:
                return await call()

        return await asyncio.gather(*(one(c) for c in calls))

    async def get(k: str) -> bytes:
        return bytes(await (await obstore.get_async(store, k)).bytes_async())

    return {
        "put": lambda items: asyncio.run(
            bounded(
                [
                    lambda kv=kv: obstore.put_async(store, kv[0], kv[1], use_multipart=False)
                    for kv in items
                ]
            )
        ),
        "get": lambda keys: asyncio.run(bounded([lambda k=k: get(k) for k in keys])),
        "list": lambda: [
            m["path"] for batch in obstore.list(store, chunk_size=1000) for m in batch
        ],
    }


ENGINES = {
    "zarrlake S3Storage (botocore)": zarrlake_engine,
    "obstore, threads": obstore_threads,
    "obstore, async": obstore_async,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--server",
        choices=("moto", "seaweedfs"),
        default="moto",
        help="moto_server (Python: its CPU bounds every engine) or SeaweedFS (compiled)",
    )
    args = parser.parse_args()
    small_n, big_n = (400, 16) if args.quick else (2000, 64)
    rounds = 1 if args.quick else args.rounds
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "k")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "s")
    if args.server == "seaweedfs":
        workdir = tempfile.mkdtemp(prefix="s3-engines-")
        weed = start_seaweedfs(workdir, access_key="k", secret_key="s")  # as the engines sign
        endpoint, stop_server = weed.endpoint, weed.stop
    else:
        proc, endpoint = start_moto()
        stop_server = lambda: stop(proc)  # noqa: E731
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="k",
            aws_secret_access_key="s",
        ).create_bucket(Bucket="bench")
        workloads = {
            f"{small_n} x 4 KiB": [(f"s/{i:06d}", os.urandom(4096)) for i in range(small_n)],
            f"{big_n} x 1 MiB": [(f"b/{i:04d}", os.urandom(1 << 20)) for i in range(big_n)],
        }
        rows = []
        for name, make in ENGINES.items():
            results: dict[str, list[tuple[float, float]]] = {}
            for r in range(rounds):
                ops = make(endpoint, "bench", f"{uuid.uuid4().hex[:8]}-{r}")
                for wname, items in workloads.items():
                    keys = [k for k, _ in items]
                    put, get = ops["put"], ops["get"]
                    results.setdefault(f"put {wname}", []).append(
                        timed(lambda put=put, items=items: put(items))
                    )
                    results.setdefault(f"get {wname}", []).append(
                        timed(lambda get=get, keys=keys: get(keys))
                    )
                results.setdefault("list all", []).append(timed(ops["list"]))
            for op, samples in results.items():
                n = small_n if "4 KiB" in op else big_n if "1 MiB" in op else 1
                wall = statistics.median(w for w, _ in samples)
                cpu = statistics.median(c for _, c in samples)
                rows.append((name, op, wall, n / wall if n > 1 else 0.0, cpu * 1e3 / n))
        print(
            f"| engine | operation | wall s (median of {rounds}) | objects/s "
            "| client CPU ms/object |"
        )
        print("| --- | --- | ---: | ---: | ---: |")
        for name, op, wall, rate, cpu_per in rows:
            print(f"| {name} | {op} | {wall:.3f} | {rate:,.0f} | {cpu_per:.3f} |")
    finally:
        stop_server()


if __name__ == "__main__":
    main()
