"""What a preview image of ``zarrlake serve`` costs: a 4096 x 4096 float32 slice of a chunked array
in a local repository, rendered to a PNG of at most ``max_preview_pixels`` (1024 x 1024: means of
4 x 4 blocks).

    python bench/serve_preview.py [--size 4096] [--chunk 512] [--rounds 5] [--markdown out.md]
                                  [--json out.json]

Each round opens the repository afresh and builds a new server (``zarrlake.serve.app``), then
asks it, in process over ASGI (no sockets: the render is what is measured), for:

- **cold**: the preview of a version the server has not seen (ref resolution, snapshot and
  manifest reads, the chunk reads and decoding, the reduction, the PNG);
- **warm**: another preview of the same slice (fill value shown as data: not in the preview
  cache), the session and its manifests cached;
- **cached**: the first preview again (served from the preview cache, as the image request
  that follows an array page is);
- **page**: the array page itself, with a preview it renders anew (rows and columns swapped:
  not in the cache either).

The best and the median of the rounds are printed. The chunk files are in the OS page cache
after the first round (a bench must not drop the caches of a shared machine), so "cold" means a
cold server, not a cold disk. Then the render alone, phase by phase (the best of the rounds):
opening the array, reading the slice (Zarr: chunk reads and zstd), the block means, colouring
and the PNG encoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import zarr

import zarrlake
from zarrlake.serve import Limits, app, preview


def build(path: Path, size: int, chunk: int) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    y, x = np.mgrid[0:size, 0:size].astype("f4") / size
    rng = np.random.default_rng(40)
    field = np.sin(6 * x) * np.cos(4 * y) + 0.1 * rng.standard_normal((size, size), dtype="f4")
    with repo.transaction("main", message=f"a {size} x {size} float32 field") as store:
        a = zarr.create_array(
            store, name="field", shape=(size, size), chunks=(chunk, chunk), dtype="f4"
        )
        a[...] = field


async def one_round(path: Path) -> dict[str, float]:
    repo = zarrlake.Repository.open(zarrlake.Storage.local(path))
    asgi = app(repo, limits=Limits())
    out: dict[str, float] = {}
    try:
        transport = httpx.ASGITransport(app=asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            for name, url in [
                ("cold", "/preview/main/field.png?fill=mark"),
                ("warm", "/preview/main/field.png?fill=data"),
                ("cached", "/preview/main/field.png?fill=mark"),
                ("page", "/array/main/field?y=1&x=0"),
            ]:
                started = time.perf_counter()
                r = await client.get(url)
                out[name] = time.perf_counter() - started
                if r.status_code != 200:
                    raise SystemExit(f"{url}: {r.status_code} {r.text[:200]}")
                if name == "cold":
                    png = r.content
                    width = int.from_bytes(png[16:20], "big")
                    height = int.from_bytes(png[20:24], "big")
                    out["width"], out["height"], out["png_bytes"] = width, height, len(png)
    finally:
        asgi.state.ctx.close()
    return out


def phases(path: Path, limits: Limits) -> dict[str, float]:
    """The render's phases, timed one by one (what :func:`preview.render` does in order)."""
    repo = zarrlake.Repository.open(zarrlake.Storage.local(path))
    session = repo.readonly_session("main")
    out: dict[str, float] = {}
    t = time.perf_counter()
    array = zarr.open_array(session.store, path="field", mode="r")
    out["open array"] = time.perf_counter() - t
    selection = preview.Selection.default(tuple(array.shape))
    plan = preview.plan_read(
        tuple(array.shape),
        tuple(array.chunks),
        selection,
        max_pixels=limits.max_preview_pixels,
        max_source=limits.max_preview_source_elements,
    )
    t = time.perf_counter()
    values = np.asarray(array[:: plan.step, :: plan.step])
    out["read slice"] = time.perf_counter() - t
    t = time.perf_counter()
    reduced = preview._reduce(values, array.fill_value, selection.mark_fill, plan.block)
    out["block means"] = time.perf_counter() - t
    t = time.perf_counter()
    indices = preview._image(reduced)
    out["colour"] = time.perf_counter() - t
    t = time.perf_counter()
    preview.encode_png(indices, preview.PALETTE, level=1)
    out["PNG encode"] = time.perf_counter() - t
    return out


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.2f} ms"


def table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r) for r in [header, *rows])


def report(size: int, chunk: int, rounds: list[dict[str, float]], phase: dict[str, float],
           markdown: bool) -> str:  # fmt: skip
    first = rounds[0]
    lines = [
        f"Preview of a {size:,} x {size:,} float32 slice ({chunk} x {chunk} chunks, zstd), "
        f"local repository: PNG {int(first['width'])} x {int(first['height'])}, "
        f"{first['png_bytes'] / 1024:,.0f} KiB; {len(rounds)} rounds",
        "",
    ]
    rows = []
    for name in ("cold", "warm", "cached", "page"):
        times = [r[name] for r in rounds]
        rows.append([name, ms(min(times)), ms(statistics.median(times))])
    lines.append(table(["request", "best", "median"], rows, markdown))
    lines += ["", "render phases (best of rounds):", ""]
    total = sum(phase.values())
    rows = [[k, ms(v), f"{v / total:.0%}"] for k, v in phase.items()]
    rows.append(["total", ms(total), "100%"])
    lines.append(table(["phase", "time", "share"], rows, markdown))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zarrlake-bench-preview-"))
    try:
        path = root / "repo"
        started = time.perf_counter()
        build(path, args.size, args.chunk)
        print(f"wrote {args.size} x {args.size} float32 in {time.perf_counter() - started:.1f} s")
        rounds = [asyncio.run(one_round(path)) for _ in range(args.rounds)]
        every = [phases(path, Limits()) for _ in range(args.rounds)]
        phase = {k: min(p[k] for p in every) for k in every[0]}
        print(report(args.size, args.chunk, rounds, phase, markdown=False))
        if args.markdown:
            args.markdown.write_text(report(args.size, args.chunk, rounds, phase, True) + "\n")
        if args.json:
            doc: dict[str, Any] = {"size": args.size, "chunk": args.chunk, "rounds": rounds,
                                   "phases": phase}  # fmt: skip
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
