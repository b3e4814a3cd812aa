"""``zarrlake notify``: deliver a repository's commit, merge, tag and branch events to a webhook
(:mod:`zarrlake.notify`), at least once, with HMAC signatures and idempotency keys.

``--once`` delivers what is pending and exits (1 if some could not be delivered in
``--give-up-after``); without it, it looks again every ``--interval`` until SIGTERM or SIGINT.
The secret is read from a file (``--secret-file``, a Kubernetes Secret mounted as one), never
from the command line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from zarrlake.cli.args import Commands, UsageError, add_json, duration
from zarrlake.cli.connect import open_repository, open_storage
from zarrlake.cli.output import print_json, say
from zarrlake.cli.signals import run_until_signalled
from zarrlake.errors import ZarrlakeError
from zarrlake.notify import EVENTS, Notifier, Webhook, events_of


def add_notify(commands: Commands) -> None:
    p = commands.add(
        "notify", run_notify, "deliver commit, merge, tag and branch events to a webhook"
    )
    p.add_argument("--webhook", required=True, metavar="URL", help="http(s) URL to POST to")
    p.add_argument(
        "--secret-file", metavar="F", default=None, help="file holding the HMAC-SHA256 secret"
    )
    p.add_argument(
        "--event",
        dest="events",
        action="append",
        default=[],
        choices=sorted(EVENTS | {"all"}),
        metavar="KIND",
        help=f"an event kind to deliver (repeatable; default all: {', '.join(sorted(EVENTS))})",
    )
    p.add_argument(
        "--branch",
        dest="branches",
        action="append",
        default=[],
        metavar="GLOB",
        help="branches to watch (repeatable; default all)",
    )
    p.add_argument("--name", default="", help="the hook's name, which keys its progress")
    p.add_argument(
        "--state",
        metavar="URL",
        default=None,
        help="storage for the progress (default: the repository's own, under hooks/)",
    )
    p.add_argument("--interval", default="5s", help="how often to look for new events (5s)")
    p.add_argument(
        "--give-up-after",
        default="5m",
        help="with --once: stop retrying an event after this long (5m)",
    )
    p.add_argument("--once", action="store_true", help="deliver what is pending, then exit")
    add_json(p)


def _secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise UsageError(f"--secret-file: cannot read {path}: {e.strerror or e}") from None
    if not secret:
        raise UsageError(f"--secret-file: {path} is empty")
    return secret


def run_notify(args: argparse.Namespace) -> None:
    interval = duration(args.interval, "--interval").total_seconds()
    give_up = duration(args.give_up_after, "--give-up-after").total_seconds()
    hook = Webhook(
        args.webhook,
        secret=_secret(args.secret_file),
        events=events_of(args.events),
        branches=tuple(args.branches) or ("*",),
        name=args.name,
    )
    repo = open_repository(args)
    state = open_storage(args.state) if args.state else None
    notifier = Notifier(repo, hook, state=state)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="zarrlake: %(message)s")
    if args.once:
        report = notifier.run_once(give_up_after_s=give_up)
        if args.json:
            print_json(report.to_json())
        else:
            say(
                f"delivered {report.delivered} event(s) to {hook.name}"
                + (f", {report.pending} still pending" if report.pending else "")
            )
        if report.pending:
            raise ZarrlakeError(f"{report.pending} event(s) could not be delivered yet")
        return

    def work(stop: threading.Event) -> None:
        notifier.run(interval_s=interval, stop=stop)

    run_until_signalled(work, "zarrlake-notify")
