"""What verified reads cost: the same reads with ``verify_reads`` on and off, same run.

    python bench/verify_cost.py [--quick] [--no-s3] [--markdown out.md] [--json out.json]

Every whole chunk a zarrlake read takes from a chunk object or a pack is hashed with the
repository's content hash (BLAKE3 by default) and compared with the digest in its ref
(``Repository.open(storage, verify_reads=...)``). This runs, on a local directory and on S3
(``moto_server`` on a loopback port, started and stopped here):

- **bulk**: a fresh client reads a ``bulk_mib`` MiB array of 1 MiB chunk objects whole;
- **small**: a fresh client reads an array of 1 KiB chunks whole (they are packed: coalesced
  ranges of packs, each chunk checked on its own);
- **random**: single-chunk reads of that array, one Zarr call each (after a first read has
  cached the manifest), and the first open + read of a fresh client.

Each measurement alternates on and off, round after round, and the best round of each counts
(as ``bench/run.py`` does), so load from elsewhere hurts both alike. Every read is checked
against what was written, outside the clock. Where the time goes on: the hash itself, measured
alone on the same bytes (``hash`` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zarrlake
from harness import REGION, S3Server, progress
from zarrlake.format.ids import content_hasher


@dataclass(frozen=True)
class Sizes:
    bulk_mib: int = 256
    small_chunks: int = 20_000
    random_reads: int = 1000
    rounds: int = 5

    @classmethod
    def quick(cls) -> Sizes:
        return cls(bulk_mib=32, small_chunks=2_000, random_reads=200, rounds=3)


def _storage(backend: str, root: Path, s3: S3Server | None, label: str) -> zarrlake.Storage:
    if backend == "local":
        return zarrlake.Storage.local(root / label)
    assert s3 is not None
    return zarrlake.Storage.s3(
        s3.bucket,
        f"verify-{uuid.uuid4().hex[:8]}/{label}",
        endpoint_url=s3.endpoint,
        region=REGION,
        allow_http=True,
    )


def _write(storage: zarrlake.Storage, data: np.ndarray, chunk: int) -> None:
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    a = zarr.create_array(
        s.store, name="a", shape=data.shape, chunks=(chunk,), dtype=data.dtype, compressors=None
    )
    a[:] = data
    s.commit("data")


def _array(storage: zarrlake.Storage, verify: bool) -> zarr.Array:
    repo = zarrlake.Repository.open(storage, verify_reads=verify)
    return zarr.open_array(repo.readonly_session().store, path="a", mode="r")


def _best(rounds: int, measure: Callable[[bool], float], label: str) -> dict[str, float]:
    """The best of ``rounds`` of ``measure(verify)`` for on and off, alternating."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for verify in (r % 2 == 0, r % 2 != 0):  # who goes first alternates too
            times[verify].append(measure(verify))
        progress(
            f"{label} round {r + 1}/{rounds}: on {times[True][-1]:.4f} off {times[False][-1]:.4f}"
        )
    return {"on": min(times[True]), "off": min(times[False])}


def _whole_read(storage: zarrlake.Storage, expected: np.ndarray) -> Callable[[bool], float]:
    """A measurement: a fresh client reads the whole array (timed), checked outside the clock."""

    def measure(verify: bool) -> float:
        a = _array(storage, verify)
        t0 = time.perf_counter()
        got = a[:]
        t = time.perf_counter() - t0
        assert np.array_equal(got, expected)
        return t

    return measure


def run_backend(backend: str, root: Path, s3: S3Server | None, sizes: Sizes) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {}

    bulk = rng.integers(0, 255, sizes.bulk_mib << 20, dtype="u1")
    where = _storage(backend, root, s3, "bulk")
    _write(where, bulk, 1 << 20)

    out["bulk read"] = _best(sizes.rounds, _whole_read(where, bulk), f"{backend} bulk")
    hasher = content_hasher("blake3")
    chunks = [bulk[i : i + (1 << 20)].tobytes() for i in range(0, bulk.size, 1 << 20)]
    t0 = time.perf_counter()
    for c in chunks:
        hasher(c)
    out["bulk read"]["hash_alone"] = time.perf_counter() - t0
    chunks.clear()

    small = rng.integers(0, 255, sizes.small_chunks * 1024, dtype="u1")
    where_small = _storage(backend, root, s3, "small")
    _write(where_small, small, 1024)

    out["small read"] = _best(sizes.rounds, _whole_read(where_small, small), f"{backend} small")

    picks = rng.integers(0, sizes.small_chunks, sizes.random_reads).tolist()

    def random_reads(verify: bool) -> float:
        a = _array(where_small, verify)
        a[0:1024]  # the manifest, cached: what is timed is one chunk read each
        t0 = time.perf_counter()
        got = [a[i * 1024 : (i + 1) * 1024] for i in picks]
        t = (time.perf_counter() - t0) / len(picks)
        for i, g in zip(picks, got, strict=True):
            assert np.array_equal(g, small[i * 1024 : (i + 1) * 1024])
        return t

    out["random read (per read)"] = _best(sizes.rounds, random_reads, f"{backend} random")

    def open_first(verify: bool) -> float:
        t0 = time.perf_counter()
        got = _array(where_small, verify)[5 * 1024 : 6 * 1024]
        t = time.perf_counter() - t0
        assert np.array_equal(got, small[5 * 1024 : 6 * 1024])
        return t

    out["open + read 1 chunk"] = _best(sizes.rounds * 2, open_first, f"{backend} open")
    return out


def render(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Measured {meta['when']} on {meta['machine']}; best of {meta['rounds']} rounds each, "
        "on and off alternating; BLAKE3.",
        "",
        "| backend | read | verify off | verify on | cost | hash alone |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for backend, rows in results.items():
        for name, m in rows.items():
            scale, unit = (1e3, "ms") if m["off"] < 0.1 else (1.0, "s")
            cost = (m["on"] / m["off"] - 1) * 100
            alone = f"{m['hash_alone'] * scale:.3f} {unit}" if "hash_alone" in m else ""
            lines.append(
                f"| {backend} | {name} | {m['off'] * scale:.3f} {unit} | "
                f"{m['on'] * scale:.3f} {unit} | {cost:+.1f}% | {alone} |"
            )
    lines.append("")
    lines.append(
        "cost = on / off - 1 (noise is a few percent either way); hash alone: BLAKE3 over the "
        "same 1 MiB chunks in one thread, no I/O."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    root = Path(tempfile.mkdtemp(prefix="zarrlake-verify-"))
    s3 = None if args.no_s3 else S3Server.start(log=str(root / "moto.log"))
    results: dict[str, dict[str, Any]] = {}
    try:
        for backend in ("local", *(() if s3 is None else ("s3",))):
            results[backend] = run_backend(backend, root, s3, sizes)
    finally:
        if s3 is not None:
            s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores",
        "rounds": sizes.rounds,
        "sizes": sizes.__dict__,
    }
    text = render(results, meta)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
