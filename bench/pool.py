"""The orchestrating side of the workers: one process per system per benchmark.

:class:`Workers` starts ``bench/worker.py`` for every system of a benchmark, each with the Python
that system needs (:func:`interpreter_for`), and stops them when the benchmark is done, keeping
their versions and peak RSS. Workers are started together and used one at a time: while one system
is measured, the others wait on their stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from systems import ICECHUNK, System

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKER = BENCH / "worker.py"


class WorkerError(RuntimeError):
    pass


def interpreter_for(system: System, peers_python: str | None) -> str:
    """zarrlake and raw Zarr run on this interpreter (the project's, same Zarr and NumPy);
    Icechunk on the peers' (Python ≥ 3.12 for Icechunk 2.x)."""
    if system.kind == ICECHUNK:
        if not peers_python:
            raise WorkerError(
                "no Python for the peers: run `make bench` (it builds .venv-peers), or pass "
                "--peers-python /path/to/python with icechunk>=2 installed"
            )
        return peers_python
    return sys.executable


def _env() -> dict[str, str]:
    """This process's environment, with the project's sources and the test kit importable
    (the peers' environment does not install them; they are pure Python)."""
    env = dict(os.environ)
    paths = [str(ROOT / "testkit")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class Worker:
    def __init__(self, system: System, python: str) -> None:
        self.system = system
        self.python = python
        self.proc = subprocess.Popen(
            [python, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=_env(),
            cwd=ROOT,
        )

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"{self.system.name} worker ({self.python}) exited with {code}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise WorkerError(f"{self.system.name} worker failed:\n{answer['error']}")
        return answer["result"]

    def call(self, op: str, **args: Any) -> Any:
        self.send(op, **args)
        return self.receive()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Workers:
    """``with Workers(systems, peers_python, moto_log) as w: w[name].call(...)``.

    On exit, :attr:`peak_rss` holds each worker's peak RSS (MiB: ``self`` and its largest child)
    and :attr:`versions` what each ran with.
    """

    def __init__(self, systems: list[System], peers_python: str | None, moto_log: str | None):
        self.systems = systems
        self.peers_python = peers_python
        self.moto_log = moto_log
        self.workers: dict[str, Worker] = {}
        self.peak_rss: dict[str, dict[str, float]] = {}
        self.versions: dict[str, dict[str, str]] = {}

    def __enter__(self) -> Workers:
        try:
            for s in self.systems:
                self.workers[s.name] = Worker(s, interpreter_for(s, self.peers_python))
            for w in self.workers.values():  # all start in parallel, then answer in turn
                w.send("init", system=asdict(w.system), moto_log=self.moto_log)
            for name, w in self.workers.items():
                self.versions[name] = w.receive()["versions"]
        except BaseException:
            self._kill_all()
            raise
        return self

    def __getitem__(self, name: str) -> Worker:
        return self.workers[name]

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                for name, w in self.workers.items():
                    self.peak_rss[name] = w.call("stop")["peak_rss_mib"]
                    w.proc.wait(60)
        finally:
            self._kill_all()

    def _kill_all(self) -> None:
        for w in self.workers.values():
            w.kill()
