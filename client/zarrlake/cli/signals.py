"""Long-running commands (``mirror run``, ``notify``): work in a worker thread, stopped by
SIGTERM or SIGINT.

The main thread only waits for signals: a signal handler that set the stop event itself could
interrupt the work's own wait on that event while it holds the event's lock, and never return.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType


def run_until_signalled(work: Callable[[threading.Event], None], name: str) -> None:
    """Run ``work(stop)`` in a worker thread until it returns; SIGTERM and SIGINT set ``stop``
    (from the main thread, never inside the handler). The worker's exception is re-raised."""
    stop = threading.Event()
    signalled: list[int] = []
    failure: list[BaseException] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        signalled.append(signum)  # no locks here: see the module docstring

    def target() -> None:
        try:
            work(stop)
        except BaseException as e:
            failure.append(e)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    worker = threading.Thread(target=target, name=name, daemon=True)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            if signalled and not stop.is_set():
                stop.set()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    if failure:
        raise failure[0]
