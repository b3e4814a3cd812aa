"""``python -m zarrlake_operator run``: the operator process.

Peering: every replica joins the peering object ``zarrlake-operator`` with a random priority, so
exactly one replica (the highest) acts and the others wait, taking over within the peering
lifetime when it goes away. Kopf pauses *all* operators of equal priority, hence the random one.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zarrlake-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the operator")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    run.add_argument("--peering", default="zarrlake-operator", help="Kopf peering object name")
    run.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    run.add_argument("--priority", type=int, default=None, help="peering priority (default random)")
    run.add_argument("--liveness-port", type=int, default=8080, help="0 disables /healthz")
    run.add_argument("--metrics-port", type=int, default=None, help="0 disables /metrics")
    run.add_argument("--verbose", "-v", action="store_true")
    return parser


class RoutineAtDebug(logging.Filter):
    """Kopf's routine lines at their true weight: a timer tick that succeeded, or a handler that
    is invoked, is DEBUG (not one INFO line per object and tick); a handler that "failed
    temporarily" is waiting (for a Repository to become Ready, a Secret to appear), which is
    INFO, not ERROR — the condition and its events say what it waits for. Records below the
    level the operator logs at are dropped."""

    _ROUTINE = re.compile(r"^(Timer|Handler|Daemon) '[^']*' (succeeded|is invoked)\.?$")

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno == logging.INFO and self._ROUTINE.match(message):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        elif record.levelno == logging.ERROR and " failed temporarily: " in message:
            record.levelno, record.levelname = logging.INFO, "INFO"
        return record.levelno >= self.level


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = os.environ.get("ZARRLAKE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Even at DEBUG, libraries that log HTTP bodies or headers stay quiet: the kubernetes client
    # logs response bodies (Secrets included) and botocore logs signed request headers.
    for name in ("kubernetes", "botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(name).setLevel(logging.INFO)
    logging.getLogger("kopf.objects").addFilter(
        RoutineAtDebug(logging.getLogger().getEffectiveLevel())
    )
    if args.metrics_port is not None:
        os.environ["ZARRLAKE_METRICS_PORT"] = str(args.metrics_port)

    import kopf

    import zarrlake_operator.handlers  # noqa: F401  (registers the handlers)

    namespaces = args.namespace or [os.environ.get("POD_NAMESPACE") or "default"]
    clusterwide = args.all_namespaces
    kopf.run(
        clusterwide=clusterwide,
        namespaces=() if clusterwide else namespaces,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority if args.priority is not None else random.randint(1, 2**30),
        liveness_endpoint=(
            f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
