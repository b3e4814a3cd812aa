"""A benchmark worker: runs one system's operations, with that system's Python, on request.

    python bench/worker.py      # started by bench/run.py; speaks JSON lines on stdin/stdout

``bench/run.py`` starts one worker per system and benchmark, each with the interpreter that system
needs (zarrlake and raw Zarr: the project's; Icechunk 2.x: the peers' Python ≥ 3.12 environment),
sends ``{"op": name, "args": {...}}`` lines and reads one ``{"ok": ..., "result" | "error": ...}``
line back per request. The first request is ``init`` (which system; the S3 server's request log),
the last ``stop``, whose answer carries the worker's peak RSS — so the peak belongs to one
benchmark of one system. Progress goes to stderr; nothing but answers goes to stdout.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _versions(kind: str) -> dict[str, str]:
    """The interpreter's and the packages' versions this system runs with (its engine's only:
    the project's venv may hold an older Icechunk it does not use here)."""
    out = {"python": platform.python_version()}
    engine = {"zarrlake": ("zarrlake",), "icechunk": ("icechunk",)}.get(kind, ())
    for p in (*engine, "zarr", "numpy"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            pass
    return out


def main() -> int:
    # Answers go to the original stdout; anything a library prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from harness import peak_rss_mib
    from ops import Ops
    from systems import System

    ops: Ops | None = None
    for line in sys.stdin:
        request = json.loads(line)
        op, args = request["op"], request.get("args", {})
        try:
            result: Any
            if op == "init":
                ops = Ops(System(**args["system"]), args.get("moto_log"))
                result = {"versions": _versions(ops.system.kind), "pid": os.getpid()}
            elif op == "stop":
                answers.write(json.dumps({"ok": True, "result": {"peak_rss_mib": peak_rss_mib()}}))
                answers.write("\n")
                return 0
            else:
                if ops is None or op.startswith("_") or not hasattr(ops, op):
                    raise ValueError(f"unknown operation {op!r} (or no init yet)")
                result = getattr(ops, op)(**args)
            answers.write(json.dumps({"ok": True, "result": result}) + "\n")
        except Exception:
            answers.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
