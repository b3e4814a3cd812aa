"""``zarrlake mirror run`` and ``zarrlake mirror status``: keep a read-only mirror of a
repository, and see how far behind it is.

``run`` drives :class:`zarrlake.mirror.Mirror`: one pass with ``--once`` (a CronJob), else a pass
every ``--interval`` until SIGTERM or SIGINT, which let the pass under way finish. The passes run
in a worker thread while the main thread only waits for signals: a signal handler that set the
stop event itself could interrupt the pass's own wait on that event while it holds the event's
lock, and never return. ``status`` reads both sides and writes nothing anywhere.

The destination's credentials may differ from the source's: the provider's own variables with
``ZARRLAKE_DEST_`` in front (``$ZARRLAKE_DEST_AWS_ACCESS_KEY_ID``/``..._SECRET_ACCESS_KEY``/
``..._SESSION_TOKEN`` for s3://, ``$ZARRLAKE_DEST_AZURE_STORAGE_ACCOUNT_KEY`` or ``..._SAS_TOKEN``
for az://, ``$ZARRLAKE_DEST_GOOGLE_APPLICATION_CREDENTIALS`` for gs://; what the operator's
replicator gets from the Mirror's credentials Secret) are used for DEST when set; else both sides
use the provider's standard chain.

With ``--lock`` (or ``$ZARRLAKE_LOCK``) only the promoter holding the lock named after the
destination acts; the others stand by, asking again at least every second so that a signal
stops them promptly too. Safety never rests on the lock (see :class:`~zarrlake.mirror.Mirror`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

from zarrlake.cli.args import PROG, Commands, UsageError, add_json, add_lock, duration
from zarrlake.cli.connect import open_lock, open_storage
from zarrlake.cli.output import print_json, print_table, say, short_time
from zarrlake.cli.signals import run_until_signalled
from zarrlake.config import MAX_SESSION_TTL
from zarrlake.errors import GraceTooShort, LockTimeout, ZarrlakeError
from zarrlake.mirror import Mirror, MirrorStatus, RefStatus
from zarrlake.repository import Repository
from zarrlake.storage import Storage
from zarrlake.units import format_bytes

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from zarrlake.locks import LocalLock, RedisLock
    from zarrlake.mirror.metrics import MirrorMetrics

#: Characters of a snapshot id shown in tables: its 10 time characters and 2 random ones.
SHORT_ID = 12
#: The longest a standing-by promoter waits for the lock before looking at its stop event.
STANDBY_WAIT_S = 1.0

log = logging.getLogger("zarrlake.mirror")


class MirrorRefsFailed(ZarrlakeError):
    """The pass printed its status, but some refs could not be mirrored: exit status 1."""


def add_mirror(commands: Commands) -> None:
    p = commands.add_group("mirror", "keep a read-only mirror of a repository")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    a = actions.add_parser(
        "run",
        help="copy and promote the source's refs at the destination",
        description="Mirror SOURCE at DEST: a pass every --interval until SIGTERM/SIGINT, "
        "or one pass with --once.",
    )
    a.set_defaults(run=run_mirror, json=False)
    _add_refs(a)
    mode = a.add_mutually_exclusive_group()
    mode.add_argument(
        "--copy",
        dest="copy",
        action="store_true",
        default=True,
        help="copy missing objects from the source (the default)",
    )
    mode.add_argument(
        "--external",
        dest="copy",
        action="store_false",
        help="objects arrive by bucket replication: only wait for them and promote",
    )
    a.add_argument(
        "--interval",
        default="10",
        metavar="S",
        help="seconds (or a duration: 30s, 5m) between passes (default 10)",
    )
    a.add_argument("--once", action="store_true", help="one pass, then exit (1 if a ref failed)")
    a.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on this port (needs the zarrlake[mirror] extra)",
    )
    a.add_argument(
        "--metrics-addr",
        default="0.0.0.0",
        metavar="A",
        help="address to serve metrics on (default 0.0.0.0)",
    )
    a.add_argument(
        "--gc-every",
        default=None,
        metavar="DURATION",
        help="also garbage-collect the mirror this often (e.g. 1d)",
    )
    a.add_argument(
        "--gc-grace",
        default="7d",
        metavar="DURATION",
        help="GC deletes only unreachable objects older than this (default 7d)",
    )
    add_json(a)
    add_lock(a)

    a = actions.add_parser(
        "status",
        help="show how far the mirror is behind (writes nothing)",
        description="Where every mirrored ref of DEST stands against SOURCE; writes nothing.",
    )
    a.set_defaults(run=run_status, json=False)
    _add_refs(a)
    add_json(a)


def _add_refs(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="storage URL or directory of the repository")
    p.add_argument("dest", metavar="DEST", help="storage URL or directory of the mirror")
    p.add_argument(
        "--branch",
        dest="branches",
        action="append",
        default=None,
        metavar="GLOB",
        help="branch name or glob to mirror (repeatable; default: every branch)",
    )
    p.add_argument(
        "--tags",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mirror the tags too (default: yes)",
    )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {port}")
    return port


#: Environment variables naming the destination's own S3 credentials.
DEST_CREDENTIALS = (
    "ZARRLAKE_DEST_AWS_ACCESS_KEY_ID",
    "ZARRLAKE_DEST_AWS_SECRET_ACCESS_KEY",
    "ZARRLAKE_DEST_AWS_SESSION_TOKEN",
)
#: ... its Azure credentials (an account key or a SAS token) ...
DEST_AZURE_CREDENTIALS = (
    "ZARRLAKE_DEST_AZURE_STORAGE_ACCOUNT_KEY",
    "ZARRLAKE_DEST_AZURE_STORAGE_SAS_TOKEN",
)
#: ... and the path of its GCS service-account key file.
DEST_GCS_CREDENTIALS = "ZARRLAKE_DEST_GOOGLE_APPLICATION_CREDENTIALS"


def destination_storage(url: str) -> Storage:
    """The storage DEST names, with the destination's own credentials when they are set:
    ``$ZARRLAKE_DEST_AWS_*`` for s3://, ``$ZARRLAKE_DEST_AZURE_STORAGE_ACCOUNT_KEY`` or
    ``..._SAS_TOKEN`` for az://, ``$ZARRLAKE_DEST_GOOGLE_APPLICATION_CREDENTIALS`` for gs://
    (the provider's own variable names, prefixed: the unprefixed ones are the source's)."""
    storage = open_storage(url)
    parts = urlsplit(storage.url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    prefix = unquote(parts.path.lstrip("/"))
    key_id, secret, token = (os.environ.get(name) or None for name in DEST_CREDENTIALS)
    account_key, sas_token = (os.environ.get(name) or None for name in DEST_AZURE_CREDENTIALS)
    key_file = os.environ.get(DEST_GCS_CREDENTIALS) or None
    given = {
        "s3": key_id is not None or secret is not None,
        "az": account_key is not None or sas_token is not None,
        "gs": key_file is not None,
    }
    for scheme, found in given.items():
        if found and parts.scheme != scheme:
            raise UsageError(
                f"$ZARRLAKE_DEST_* credentials for a {scheme}:// destination are set, but DEST "
                f"is {storage.url}"
            )
    if not given.get(parts.scheme):
        return storage
    allow_http = query.get("allow_http") == "true"
    if parts.scheme == "az":
        return Storage.azure(
            parts.netloc,
            prefix,
            account_name=query.get("account_name"),
            endpoint_url=query.get("endpoint_url"),
            account_key=account_key,
            sas_token=sas_token,
            allow_http=allow_http,
        )
    if parts.scheme == "gs":
        return Storage.gcs(
            parts.netloc,
            prefix,
            endpoint_url=query.get("endpoint_url"),
            service_account_file=key_file,
            allow_http=allow_http,
        )
    if key_id is None or secret is None:
        raise UsageError(
            "$ZARRLAKE_DEST_AWS_ACCESS_KEY_ID and $ZARRLAKE_DEST_AWS_SECRET_ACCESS_KEY go "
            f"together, for an s3:// destination (DEST is {storage.url})"
        )
    return Storage.s3(
        parts.netloc,
        prefix,
        endpoint_url=query.get("endpoint_url"),
        region=query.get("region"),
        access_key_id=key_id,
        secret_access_key=secret,
        session_token=token,
        allow_http=allow_http,
    )


# -- run -----------------------------------------------------------------------------------------


def run_mirror(args: argparse.Namespace) -> None:
    """One pass (``--once``) or passes until a signal; see the module docstring."""
    interval = duration(args.interval, "--interval").total_seconds()
    if interval <= 0:
        raise UsageError(f"--interval must be more than 0 seconds, got {args.interval!r}")
    gc_every = None if args.gc_every is None else duration(args.gc_every, "--gc-every")
    grace = duration(args.gc_grace, "--gc-grace")
    if gc_every is not None and gc_every.total_seconds() <= 0:
        raise UsageError(f"--gc-every must be more than 0 seconds, got {args.gc_every!r}")
    if grace < MAX_SESSION_TTL:
        # Objects wait unpromoted at the mirror (replication, a long copy) as uploads wait for
        # their commit at a source: the same floor, checked before any pass runs.
        raise GraceTooShort(
            f"--gc-grace {args.gc_grace} is shorter than the longest session lifetime "
            f"({MAX_SESSION_TTL})"
        )
    if args.once and (gc_every is not None or args.metrics_port is not None):
        raise UsageError("--gc-every and --metrics-port need a continuous run, not --once")
    source_storage, dest_storage = open_storage(args.source), destination_storage(args.dest)
    wait = None if args.once else {"wait_s": min(interval, STANDBY_WAIT_S)}
    lock = open_lock(args.lock or None, **(wait or {}))
    metrics_type = _metrics_type() if args.metrics_port is not None else None
    progress = CopyProgressLine(enabled=not args.json)
    source = Repository.open(source_storage)
    mirror = Mirror(
        source,
        dest_storage,
        branches=args.branches,
        tags=args.tags,
        copy=args.copy,
        progress=progress,
        lock=lock,
    )
    metrics = None if metrics_type is None else metrics_type(source.id)

    def report(status: MirrorStatus) -> None:
        progress.finish()
        if metrics is not None:
            metrics.update(status)
        if args.json:
            sys.stdout.write(json.dumps(status.to_json(), ensure_ascii=False) + "\n")
        else:
            _print_status(status)
        sys.stdout.flush()

    if args.once:
        with _quiet_log(), _held(lock, mirror):
            status = mirror.step()
        report(status)
        _fail_on_errors(status)
        return

    if metrics is not None:
        try:
            metrics.serve(args.metrics_port, args.metrics_addr)
        except OSError as e:
            raise ZarrlakeError(
                f"cannot serve metrics on {args.metrics_addr}:{args.metrics_port}: "
                f"{e.strerror or e}"
            ) from None
    gc_every_s = None if gc_every is None else gc_every.total_seconds()
    with _warnings_to_stderr():
        run_until_signalled(
            lambda stop: mirror.run(
                interval, stop=stop, on_status=report, gc_every=gc_every_s, gc_grace=grace
            ),
            "zarrlake-mirror",
        )


def _metrics_type() -> type[MirrorMetrics]:
    """:class:`~zarrlake.mirror.metrics.MirrorMetrics`, checked before anything is opened: a
    usage error when prometheus-client is not installed."""
    try:
        import prometheus_client  # noqa: F401

        from zarrlake.mirror.metrics import MirrorMetrics
    except ImportError:
        raise UsageError(
            "--metrics-port needs prometheus-client: pip install 'zarrlake[mirror]'"
        ) from None
    return MirrorMetrics


@contextmanager
def _held(lock: RedisLock | LocalLock | None, mirror: Mirror) -> Iterator[None]:
    """``--once`` with a lock: the pass runs holding the promoters' lock, as :meth:`Mirror.run`
    does; a lock another promoter keeps is a failure (exit 1)."""
    if lock is None:
        yield
        return
    try:
        with lock.hold(mirror.source.id, mirror.lock_name):
            yield
    except LockTimeout as e:
        raise LockTimeout(
            f"another promoter of {mirror.destination.url} holds the lock: {e}"
        ) from None


def _fail_on_errors(status: MirrorStatus) -> None:
    failed = [r for r in status.refs if r.error]
    if failed:
        first = failed[0]
        raise MirrorRefsFailed(
            f"{len(failed)} ref(s) not mirrored; {first.kind} {first.name}: {first.error}"
        )


# -- status --------------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> None:
    """Print where every mirrored ref stands; exit 1 if DEST is not a mirror of SOURCE yet or a
    ref could not be checked."""
    source_storage, dest_storage = open_storage(args.source), destination_storage(args.dest)
    source = Repository.open(source_storage)
    with _quiet_log():
        mirror = Mirror(source, dest_storage, branches=args.branches, tags=args.tags, create=False)
        status = mirror.status()
    if args.json:
        print_json(status.to_json())
    else:
        _print_status(status)
    _fail_on_errors(status)


# -- output --------------------------------------------------------------------------------------


def _print_status(status: MirrorStatus) -> None:
    say(_summary(status))
    if status.refs:
        print_table(
            ["KIND", "REF", "SOURCE", "MIRRORED", "BEHIND", "LAG", "MISSING", "ERROR"],
            [_row(r) for r in status.refs],
        )


def _summary(status: MirrorStatus) -> str:
    behind = sum(1 for r in status.refs if not r.up_to_date)
    state = "up to date" if status.up_to_date else f"{behind} of {len(status.refs)} ref(s) behind"
    parts = [f"{short_time(status.time)}  {status.source} -> {status.destination}: {state}"]
    if status.promoted:
        parts.append("promoted " + ", ".join(status.promoted))
    if status.copied_objects:
        parts.append(
            f"copied {status.copied_objects} objects ({format_bytes(status.copied_bytes)})"
        )
    return "; ".join(parts)


def _row(r: RefStatus) -> list[str]:
    return [
        r.kind,
        r.name,
        _short(r.source_head),
        _short(r.mirrored_head),
        str(r.commits_behind),
        f"{r.seconds_behind:.1f}s",
        str(r.missing_objects),
        r.error or "",
    ]


def _short(snapshot: str | None) -> str:
    return "-" if snapshot is None else snapshot[:SHORT_ID]


class CopyProgressLine:
    """The copier's progress as one rich line on stderr while a pass copies; nothing without a
    terminal or without rich. A callable for ``Mirror(progress=...)`` (called from the copier's
    threads, one call per object landed); :meth:`finish` clears the line after each pass."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled and sys.stderr.isatty()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._lock = threading.Lock()

    def __call__(self, copied: int, to_copy: int) -> None:
        if not self._enabled:
            return
        with self._lock:
            if self._progress is None and not self._start():
                return
            assert self._progress is not None and self._task is not None
            if copied == 1:  # the first object of a new batch: its size joins the total
                task = self._progress.tasks[0]
                self._progress.update(self._task, total=(task.total or 0) + to_copy)
            self._progress.advance(self._task, 1)

    def _start(self) -> bool:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            self._enabled = False
            return False
        self._progress = Progress(
            TextColumn("copying objects"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
            console=Console(file=sys.stderr),
        )
        self._progress.start()
        self._task = self._progress.add_task("copy", total=0)
        return True

    def finish(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = self._task = None


# -- logging -------------------------------------------------------------------------------------


@contextmanager
def _log_only_to(handler: logging.Handler) -> Iterator[None]:
    """While the block runs, what the mirror logs goes to ``handler`` alone."""
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def _quiet_log() -> contextlib.AbstractContextManager[None]:
    """One pass: what the mirror logs is in the status it returns; stderr keeps its one line."""
    return _log_only_to(logging.NullHandler())


def _warnings_to_stderr() -> contextlib.AbstractContextManager[None]:
    """A continuous run: a pass that failed as a whole is only logged, so warnings go to stderr
    as ``zarrlake: warning: ...`` lines (stdout stays the passes' documents)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"{PROG}: warning: %(message)s"))
    return _log_only_to(handler)
