"""``python -m zarrlake_operator run``: the operator process.

High availability: every replica runs leader election on the Lease ``zarrlake-operator`` in its
own namespace (:mod:`zarrlake_operator.leader`). The one holding it runs Kopf and acts; the
others only watch the Lease, and take over within the lease duration when the leader stops
renewing it, at once when it releases it (SIGTERM). A leader that cannot renew within
the renew deadline ends itself at once (SIGKILL), before any standby may take over, so two
replicas never act together. ``--standalone``: no election (one replica only).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
import threading
from typing import Any

log = logging.getLogger("zarrlake_operator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zarrlake-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the operator")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    run.add_argument(
        "--standalone", action="store_true", help="no leader election (one replica only)"
    )
    env = os.environ.get
    election = run.add_argument_group("leader election (a coordination.k8s.io/v1 Lease)")
    election.add_argument(
        "--lease-name",
        default=env("ZARRLAKE_LEASE_NAME", "zarrlake-operator"),
        help="the Lease (default %(default)s; ZARRLAKE_LEASE_NAME)",
    )
    election.add_argument(
        "--lease-namespace",
        default=env("ZARRLAKE_LEASE_NAMESPACE") or env("POD_NAMESPACE") or "default",
        help="its namespace (default: the pod's, POD_NAMESPACE; ZARRLAKE_LEASE_NAMESPACE)",
    )
    election.add_argument(
        "--lease-duration",
        type=float,
        default=float(env("ZARRLAKE_LEASE_DURATION", "10")),
        help="seconds a standby waits, after the last renewal it saw, before it takes the Lease "
        "(default %(default)g; ZARRLAKE_LEASE_DURATION)",
    )
    election.add_argument(
        "--lease-renew-deadline",
        type=float,
        default=float(env("ZARRLAKE_LEASE_RENEW_DEADLINE", "7")),
        help="seconds the leader may fail to renew before it exits; less than the duration "
        "(default %(default)g; ZARRLAKE_LEASE_RENEW_DEADLINE)",
    )
    election.add_argument(
        "--lease-renew-interval",
        type=float,
        default=float(interval) if (interval := env("ZARRLAKE_LEASE_RENEW_INTERVAL")) else None,
        help="seconds between the leader's renewals; less than the renew deadline (default 4 if a "
        "retry period still fits before the deadline, else half the renew deadline; "
        "ZARRLAKE_LEASE_RENEW_INTERVAL)",
    )
    election.add_argument(
        "--lease-retry-period",
        type=float,
        default=float(env("ZARRLAKE_LEASE_RETRY_PERIOD", "2")),
        help="seconds between the leader's attempts after a failed renewal, and between a "
        "standby's reads when it cannot watch (default %(default)g; ZARRLAKE_LEASE_RETRY_PERIOD)",
    )
    election.add_argument(
        "--lease-identity",
        default=env("ZARRLAKE_LEASE_IDENTITY") or None,
        help="holder identity (default: POD_NAME or the host name, and a random suffix)",
    )
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.standalone:
        try:
            lease_settings(args)  # timings that cannot work: a usage error now, not a traceback
        except ValueError as e:
            parser.error(str(e))
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
    kopf_args: dict[str, Any] = {
        "clusterwide": args.all_namespaces,
        "namespaces": () if args.all_namespaces else namespaces,
        "standalone": True,  # never Kopf's peering: the Lease decides who acts
        "liveness_endpoint": (
            f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
        ),
    }
    if args.standalone:
        kopf.run(**kopf_args)
        return 0
    return lead_then_run(args, kopf_args)


def lease_settings(args: argparse.Namespace) -> Any:
    """The leader election's :class:`~zarrlake_operator.leader.LeaseSettings` from the command
    line. Raises ``ValueError`` for timings that cannot work."""
    from zarrlake_operator import leader

    return leader.LeaseSettings(
        name=args.lease_name,
        namespace=args.lease_namespace,
        identity=args.lease_identity or leader.identity(os.environ.get("POD_NAME")),
        duration=args.lease_duration,
        renew_deadline=args.lease_renew_deadline,
        retry_period=args.lease_retry_period,
        renew_interval=args.lease_renew_interval,
    )


def lead_then_run(args: argparse.Namespace, kopf_args: dict[str, Any]) -> int:
    """Stand by until this replica holds the Lease, then run Kopf while holding it; release it
    once Kopf has stopped. A standby makes no request but reading and watching the Lease."""
    from zarrlake_operator import kube, leader, metrics

    settings = lease_settings(args)
    for warning in settings.warnings():
        log.warning("Leader election: %s", warning)
    elector = leader.Elector(settings)
    stop = threading.Event()

    def terminate(signum: int, _frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, terminate)
    # A standby is alive and ready too (a rollout waits for every pod's readiness) and shows
    # its metrics (zarrlake_operator_leader 0); Kopf serves /healthz once this replica leads.
    metrics.serve(int(os.environ.get("ZARRLAKE_METRICS_PORT", "9090")))
    if metrics.count_request not in kube.observers:  # the Lease reads count as API requests too
        kube.observers.append(metrics.count_request)
    health = _standby_health(args.liveness_port)
    log.info(
        "Leader election on Lease %s/%s as %s", settings.namespace, settings.name, settings.identity
    )
    try:
        if not elector.acquire(stop):
            log.info("Stopped while standing by")
            return 0
    finally:
        if health is not None:
            health.shutdown()
            health.server_close()

    def lost(why: str) -> None:
        # Never two leaders acting: no clean-up, no waiting for handlers — the process ends now,
        # as a crash would end it (SIGKILL, exit status 137), and the kubelet restarts it.
        log.critical("Leadership lost (%s): exiting", why)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    metrics.LEADER.set(1)
    holding = threading.Event()
    threads = elector.hold(holding, lost)
    try:
        failed = _run_kopf_until(stop, kopf_args)
    finally:
        holding.set()  # Kopf has stopped acting: stop renewing, then hand the Lease over
        for thread in threads:
            thread.join(timeout=settings.retry_period + 1)
        metrics.LEADER.set(0)
        elector.release()
    return 1 if failed else 0


def _run_kopf_until(stop: threading.Event, kopf_args: dict[str, Any]) -> bool:
    """Run Kopf until ``stop`` is set (SIGTERM/SIGINT) or it ends by itself; True if it failed.

    Kopf runs on a thread of its own with an asyncio stop flag, and the signals stay this main
    thread's: in the main thread Kopf would take SIGTERM itself, and then wait 5 s for the task
    that waits for its stop flag before it returns — 5 s more for a standby to wait."""
    import kopf

    # Kopf warns that it ignores OS signals off the main thread: here that is the design.
    logging.getLogger("kopf._core.reactor.running").addFilter(
        lambda record: "OS signals are ignored" not in record.getMessage()
    )
    loop = asyncio.new_event_loop()
    flag = asyncio.Event()
    failure: list[BaseException] = []

    def operate() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(kopf.operator(stop_flag=flag, **kopf_args))
        except asyncio.CancelledError:
            pass
        except BaseException as e:
            failure.append(e)
            log.exception("The operator stopped on an error")
        finally:
            loop.close()

    thread = threading.Thread(target=operate, name="kopf")
    thread.start()
    while thread.is_alive():
        if stop.wait(0.5):
            try:
                loop.call_soon_threadsafe(flag.set)
            except RuntimeError:  # the loop closed meanwhile: Kopf has stopped anyway
                pass
            break
    thread.join()
    return bool(failure)


def _standby_health(port: int) -> Any:
    """``/healthz`` while standing by (200, "standby"); None when the port is 0."""
    if not port:
        return None
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == "/healthz"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"standby": true}' if ok else b"{}")

        def log_message(self, format: str, *args: Any) -> None:  # probes are not news
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="standby-health", daemon=True).start()
    return server


if __name__ == "__main__":
    sys.exit(main())
