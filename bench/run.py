"""zarrlake against raw Zarr and Icechunk, in one run on one machine.

    python bench/run.py [--quick] [--only bulk,small,...] [--json out.json] [--markdown out.md]

Starts its own S3 API server (``moto_server`` on a free loopback port) and stops it at the end;
local data goes to a temporary directory that is removed afterwards. See bench/README.md for what
each benchmark measures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import uuid
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import S3Server, progress
from systems import make_systems
from tables import build_rows, build_targets, render_markdown, render_text
from workloads import BENCHMARKS, Sizes


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--systems", default="", help="comma-separated subset, e.g. zarrlake-s3,icechunk-s3"
    )
    p.add_argument("--no-s3", action="store_true", help="skip the S3 backends")
    p.add_argument("--json", type=Path, help="write raw results here")
    p.add_argument("--markdown", type=Path, help="write the Markdown table here")
    p.add_argument(
        "--readme",
        type=Path,
        help="also put the Markdown table between the <!-- bench-table --> markers of this file",
    )
    p.add_argument("--workdir", type=Path, help="where local repositories go (default: a temp dir)")
    args = p.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    unknown = set(args.only) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    args.systems = [x for x in args.systems.split(",") if x]
    return args


def _meta(args: argparse.Namespace, sizes: Sizes) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "mode": "quick" if args.quick else "full",
        "versions": {p: version(p) for p in ("zarrlake", "zarr", "icechunk", "numpy", "moto")},
        "sizes": asdict(sizes),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    names = args.only or list(BENCHMARKS)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="zarrlake-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    s3 = None if args.no_s3 else S3Server.start()
    results: dict[str, Any] = {}
    try:
        if s3:
            progress(f"moto_server pid {s3.process.pid} at {s3.endpoint}")
        systems = make_systems(str(workdir), run_id, s3)
        if args.systems:
            systems = [s for s in systems if s.name in args.systems]
        for name in names:
            progress(f"== {name}")
            results[name] = BENCHMARKS[name](systems, sizes, s3)
    finally:
        if s3:
            s3.stop()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    meta = _meta(args, sizes)
    rows = build_rows(results, sizes)
    # Targets whose systems were not run (--systems, --no-s3) are left out rather than shown n/a.
    targets = [t for t in build_targets(results, sizes) if t.measured is not None]
    print(render_text(rows, targets))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "meta": meta,
            "results": results,
            "targets": [
                {
                    "name": t.name,
                    "measured": t.measured,
                    "op": t.op,
                    "limit": t.limit,
                    "result": t.result,
                }
                for t in targets
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    markdown = render_markdown(rows, targets, meta)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)
    if args.readme:
        _update_readme(args.readme, markdown)
    return 0


_BEGIN, _END = "<!-- bench-table -->", "<!-- /bench-table -->"


def _update_readme(path: Path, markdown: str) -> None:
    """Replace what lies between the README's bench-table markers (and nothing else)."""
    text = path.read_text()
    start, end = text.find(_BEGIN), text.find(_END)
    if start < 0 or end < start:
        progress(f"{path} has no {_BEGIN} ... {_END} markers; left unchanged")
        return
    path.write_text(text[: start + len(_BEGIN)] + "\n" + markdown.strip() + "\n" + text[end:])


if __name__ == "__main__":
    sys.exit(main())
