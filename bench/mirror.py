"""Mirroring benchmark (issue 12): copy throughput, promotion delay, and lag under load.

    python bench/mirror.py                 # the full profile
    python bench/mirror.py --quick         # smaller sizes, shorter load
    python bench/mirror.py --json bench/results/mirror.json --markdown bench/results/mirror.md

Two ``moto_server`` processes on loopback are the two regions (source and destination S3);
the local rows use a directory as the source.

- **copy**: a repository of ``objects`` chunk objects of ``size`` bytes is mirrored by one
  ``Mirror(copy=True).step()``: objects/s and MB/s, S3 → S3 and local → S3. The reference is a
  plain parallel copy of the same objects (every key, ``get`` then ``put`` on 16 threads, the
  copier's concurrency) with the same storage clients: ``copier ÷ plain`` is what validating and
  promoting cost on top of moving the bytes.
- **promotion delay**: in external mode, everything but one chunk object has arrived; then the
  last one lands, and the next pass promotes. The time of that pass is the delay from the last
  object's arrival to promotion (plus, with ``run(interval)``, the wait for the next pass: at
  most the interval). Measured with a warm promoter and with one just restarted (presence read
  back from the destination).
- **lag under load**: the source commits every second (8 chunks of 64 KiB changed each time)
  while a replicator copies each new object 5 s after it appeared at the source, in any order,
  and the promoter steps every second. For every promoted head: the time from its commit to
  its promotion. Lag must stay near the replication delay and not grow with the number of
  commits: the table shows it over the first and the second half of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zarr

import zarrlake as zl
from zarrlake.mirror import Mirror
from zarrlake_testkit.servers import start_moto, stop

CHUNK = 16 * 1024  # int32 elements per chunk: 64 KiB


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def s3_region() -> Iterator[Any]:
    """A moto_server with one bucket; yields a factory of storages under fresh prefixes."""
    import boto3

    proc, endpoint = start_moto()
    try:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bench")

        def storage(prefix: str | None = None) -> zl.Storage:
            return zl.Storage.s3(
                "bench",
                prefix or uuid.uuid4().hex[:12],
                endpoint_url=endpoint,
                region="us-east-1",
                access_key_id="testing",
                secret_access_key="testing",
                allow_http=True,
            )

        yield storage
    finally:
        stop(proc)


def build(storage: zl.Storage, objects: int) -> zl.Repository:
    """A repository with ``objects`` chunk objects of 64 KiB (incompressible)."""
    repo = zl.Repository.create(storage)
    rng = np.random.default_rng(0)
    with repo.transaction("main", message="bulk") as store:
        arr = zarr.create_array(
            store, name="a", shape=(objects * CHUNK,), chunks=(CHUNK,), dtype="i4"
        )
        for start in range(0, objects, 64):
            n = min(64, objects - start)
            arr[start * CHUNK : (start + n) * CHUNK] = rng.integers(0, 2**31, n * CHUNK, "i4")
    return repo


def plain_copy(src: zl.Storage, dst: zl.Storage) -> tuple[float, int, int]:
    """Copy every object, 16 at a time: (seconds, objects, bytes)."""
    keys = src.list_keys("")
    started = time.perf_counter()

    def one(key: str) -> int:
        data = src.get(key)
        dst.put(key, data)
        return len(data)

    with ThreadPoolExecutor(16) as pool:
        sizes = list(pool.map(one, keys))
    return time.perf_counter() - started, len(keys), sum(sizes)


def bench_copy(source: zl.Repository, dest_factory: Any, label: str) -> dict[str, Any]:
    progress(f"copy {label}: mirror")
    dest = dest_factory()
    started = time.perf_counter()
    status = Mirror(source, dest).step()
    took = time.perf_counter() - started
    assert status.up_to_date, status
    progress(f"copy {label}: plain parallel copy")
    plain_s, plain_n, plain_b = plain_copy(source.storage, dest_factory())
    return {
        "case": label,
        "objects": status.copied_objects,
        "mib": status.copied_bytes / 2**20,
        "seconds": took,
        "objects_per_s": status.copied_objects / took,
        "mib_per_s": status.copied_bytes / 2**20 / took,
        "plain_seconds": plain_s,
        "plain_objects": plain_n,
        "plain_mib_per_s": plain_b / 2**20 / plain_s,
        "ratio": (status.copied_bytes / took) / (plain_b / plain_s),
    }


def bench_delay(source: zl.Repository, dest: zl.Storage, rounds: int) -> dict[str, Any]:
    """Promotion delay after the last object lands, warm and restarted promoter."""
    warm: list[float] = []
    restarted: list[float] = []
    m = Mirror(source, dest, copy=False)
    for i in range(rounds):
        with source.transaction("main", message=f"delay {i}") as store:
            arr = zarr.open_array(store, path="a", mode="r+")
            arr[: 8 * CHUNK] = np.random.default_rng(100 + i).integers(0, 2**31, 8 * CHUNK, "i4")
        keys = [k for k in source.storage.list_keys("") if not dest.exists(k)]
        last = next(k for k in keys if k.startswith("chunks/"))
        for key in keys:
            if key != last:
                dest.put(key, source.storage.get(key))
        promoter = m if i % 2 == 0 else Mirror(source, dest, copy=False)
        assert promoter.step().ref("main").missing_objects == 1
        if i % 2 == 1:
            promoter = Mirror(source, dest, copy=False)  # restarted after it saw it missing
        dest.put(last, source.storage.get(last))
        started = time.perf_counter()
        status = promoter.step()
        took = time.perf_counter() - started
        assert status.ref("main").up_to_date, status
        (warm if i % 2 == 0 else restarted).append(took)
    return {
        "warm_ms": statistics.median(warm) * 1e3,
        "restarted_ms": statistics.median(restarted) * 1e3,
        "rounds": rounds,
    }


def bench_lag(
    source: zl.Repository, dest: zl.Storage, seconds: float, delay: float
) -> dict[str, Any]:
    """Commit every second; replicate each object ``delay`` s after it appears; promote every
    second. The lag of every promoted head, commit to promotion."""
    stop_event = threading.Event()
    commit_times: dict[str, float] = {}
    promoted: list[tuple[float, str]] = []
    copied = 0

    def committer() -> None:
        i = 0
        while not stop_event.is_set():
            with source.transaction("main", message=f"load {i}") as store:
                arr = zarr.open_array(store, path="a", mode="r+")
                at = (i * 8) % 64 * CHUNK
                arr[at : at + 8 * CHUNK] = np.random.default_rng(1000 + i).integers(
                    0, 2**31, 8 * CHUNK, "i4"
                )
            commit_times[source.lookup_branch("main")] = time.monotonic()
            i += 1
            stop_event.wait(1.0)

    def replicator() -> None:
        nonlocal copied
        seen: dict[str, float] = {}
        done: set[str] = set()
        rng = random.Random(7)
        while not stop_event.is_set() or len(done) < len(seen):
            now = time.monotonic()
            for key in source.storage.list_keys(""):
                seen.setdefault(key, now)
            due = [k for k, t in seen.items() if k not in done and now - t >= delay]
            rng.shuffle(due)  # any order: metadata before data as often as not
            for key in due:
                dest.put(key, source.storage.get(key))
                done.add(key)
            copied = len(done)
            if stop_event.is_set() and not due:
                break
            time.sleep(0.25)

    def promoter() -> None:
        m = Mirror(source, dest, copy=False)
        last = None
        while not stop_event.is_set():
            head = m.step().ref("main").mirrored_head
            if head != last and head is not None:
                promoted.append((time.monotonic(), head))
                last = head
            stop_event.wait(1.0)

    threads = [threading.Thread(target=f) for f in (committer, replicator, promoter)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop_event.set()
    for t in threads:
        t.join()
    lags = [(at - commit_times[h], at) for at, h in promoted if h in commit_times]
    half = (min(a for _, a in lags) + max(a for _, a in lags)) / 2 if lags else 0
    first = [lag for lag, at in lags if at <= half]
    second = [lag for lag, at in lags if at > half]
    return {
        "seconds": seconds,
        "replication_delay_s": delay,
        "commits": len(commit_times),
        "promotions": len(promoted),
        "objects_replicated": copied,
        "lag_median_s": statistics.median(lag for lag, _ in lags) if lags else None,
        "lag_max_s": max(lag for lag, _ in lags) if lags else None,
        "lag_first_half_median_s": statistics.median(first) if first else None,
        "lag_second_half_median_s": statistics.median(second) if second else None,
    }


def markdown(result: dict[str, Any]) -> str:
    out = [
        f"Mirroring benchmark, {result['time']} ({'quick' if result['quick'] else 'full'})",
        "",
        "| copy | objects | MiB | time | objects/s | MiB/s | plain copy MiB/s | copier ÷ plain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in result["copy"]:
        out.append(
            f"| {c['case']} | {c['objects']} | {c['mib']:.1f} | {c['seconds']:.2f} s "
            f"| {c['objects_per_s']:.0f} | {c['mib_per_s']:.1f} | {c['plain_mib_per_s']:.1f} "
            f"| {c['ratio']:.2f} |"
        )
    d = result["delay"]
    out += [
        "",
        "| promotion delay after the last object lands (S3 → S3, external mode) | median |",
        "| --- | ---: |",
        f"| warm promoter | {d['warm_ms']:.1f} ms |",
        f"| promoter just restarted | {d['restarted_ms']:.1f} ms |",
        "",
    ]
    lag = result["lag"]
    out += [
        f"| lag under load: a commit a second for {lag['seconds']:.0f} s, replication delayed "
        f"{lag['replication_delay_s']:.0f} s | |",
        "| --- | ---: |",
        f"| commits / promotions | {lag['commits']} / {lag['promotions']} |",
        f"| lag, commit → promotion: median / max | {lag['lag_median_s']:.2f} s / "
        f"{lag['lag_max_s']:.2f} s |",
        f"| median lag, first half / second half of the run | "
        f"{lag['lag_first_half_median_s']:.2f} s / {lag['lag_second_half_median_s']:.2f} s |",
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--objects", type=int)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    objects = args.objects or (200 if args.quick else 1000)
    result: dict[str, Any] = {
        "time": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
    }
    with s3_region() as region_a, s3_region() as region_b, tempfile.TemporaryDirectory() as tmp:
        progress(f"building a repository of {objects} chunk objects on S3 and locally")
        s3_source = build(region_a(), objects)
        local_source = build(zl.Storage.local(Path(tmp) / "src"), objects)
        result["copy"] = [
            bench_copy(s3_source, region_b, "S3 → S3"),
            bench_copy(local_source, region_b, "local → S3"),
        ]
        progress("promotion delay")
        result["delay"] = bench_delay(build(region_a(), 64), region_b(), 6 if args.quick else 12)
        progress("lag under load")
        result["lag"] = bench_lag(
            build(region_a(), 64), region_b(), 15.0 if args.quick else 40.0, 5.0
        )
    text = markdown(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
