"""Run a test command several times in a row while CPU burners keep the machine's other cores busy.

    python -m zarrlake_testkit.stress --runs 3 -- python -m pytest -q ...

This is how the suite proves it does not depend on timing: a test that waits on wall-clock
guesses fails when its process gets half a core. Burners are child processes stopped by pid
whatever happens (failure, Ctrl-C, SIGTERM). Prints one line per run and a table at the end;
exits non-zero if any run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

BURN = "import itertools\nfor _ in itertools.count():\n    pass\n"
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|error).*?)\s*=*$")


@dataclass(frozen=True)
class Run:
    number: int
    exit_code: int
    seconds: float
    summary: str


@contextmanager
def burners(count: int) -> Iterator[list[int]]:
    """``count`` busy-looping processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a CI runner giving up) unwinds like Ctrl-C, so the burners are still stopped."""
    raise KeyboardInterrupt


def run_once(number: int, command: Sequence[str]) -> Run:
    start = time.monotonic()
    # A session of its own, so an interrupted run is stopped with every server it started.
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    summary = ""
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            match = SUMMARY.match(line.strip())
            if match:
                summary = match.group(1)
        code = proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    return Run(number, code, time.monotonic() - start, summary or f"exit {code}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zarrlake_testkit.stress", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--burners", type=int, default=None, help="busy processes (default: cores - 1, at least 1)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the test command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the test command after --")
    count = args.burners if args.burners is not None else max(1, (os.cpu_count() or 2) - 1)

    signal.signal(signal.SIGTERM, _interrupt)
    runs: list[Run] = []
    with burners(count) as pids:
        print(f"stress: {args.runs} run(s) with {count} CPU burner(s) (pids {pids})", flush=True)
        for n in range(1, args.runs + 1):
            run = run_once(n, command)
            runs.append(run)
            print(f"stress: run {n}: {run.summary} in {run.seconds:.0f} s", flush=True)
    print("\n| run | result | wall time |\n|---|---|---|")
    for r in runs:
        print(f"| {r.number} | {r.summary} | {r.seconds:.0f} s |")
    failed = [r for r in runs if r.exit_code != 0]
    print(f"\nstress: {len(runs) - len(failed)} of {len(runs)} runs passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
