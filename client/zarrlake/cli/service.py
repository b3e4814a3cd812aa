"""``zarrlake service``: run a repository's commit service (:mod:`zarrlake.service`), the one
writer of its refs, until SIGTERM or SIGINT.

Start it with credentials that write the whole repository; give writers credentials that write
only immutable objects, a token from ``--tokens-file`` and ``ZARRLAKE_COMMIT_SERVICE`` pointing
here. Each change is logged (stderr) with the identity whose token asked for it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zarrlake.cli.args import Commands, UsageError
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import say
from zarrlake.cli.serve import listen, run_asgi
from zarrlake.errors import CheckFailed, InvalidArgument
from zarrlake.extras import require

if TYPE_CHECKING:
    from zarrlake.checkjobs import CheckJob
    from zarrlake.service import Refusal, Refused

DEFAULT_PORT = 8701


def add_service(commands: Commands) -> None:
    p = commands.add("service", run_service, "run the commit service: the one writer of the refs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port ({DEFAULT_PORT}; 0: any)")
    p.add_argument(
        "--tokens-file",
        required=True,
        metavar="F",
        help='JSON: {"<token>": {"identity": "alice", "role": "writer" | "admin"}}',
    )
    p.add_argument(
        "--check-jobs",
        metavar="F",
        default=None,
        help="JSON: {check name: batch/v1 Job template}: checks run as Kubernetes Jobs "
        "(default: $ZARRLAKE_CHECK_JOBS, as the operator sets it)",
    )
    p.add_argument(
        "--events-for",
        metavar="JSON",
        default=None,
        help='post a Kubernetes Event for each refused change about {"kind", "name", '
        '"namespace"[, "apiVersion", "uid"]} (default: $ZARRLAKE_EVENTS_FOR, as the operator '
        "sets it to the Repository)",
    )


def add_check(commands: Commands) -> None:
    p = commands.add(
        "check", run_check, "run an installed check on a commit (what a check Job runs)"
    )
    p.add_argument(
        "name", nargs="?", default=None, help="the check (default: $ZARRLAKE_CHECK_NAME)"
    )
    p.add_argument(
        "--snapshot", default=None, help="the commit to check ($ZARRLAKE_CHECK_SNAPSHOT)"
    )
    p.add_argument(
        "--parent", default=None, help="what it lands on (default: $ZARRLAKE_CHECK_PARENT)"
    )
    p.add_argument("--branch", default=None, help="the branch ($ZARRLAKE_CHECK_BRANCH)")
    p.add_argument("--kind", choices=("commit", "merge"), default=None)
    p.add_argument("--options", metavar="JSON", default=None, help="the check's options")


def run_service(args: argparse.Namespace) -> None:
    from zarrlake.service import app, load_tokens

    try:
        tokens = load_tokens(args.tokens_file)
    except InvalidArgument as e:
        raise UsageError(f"--tokens-file: {e}") from None
    uvicorn = require("uvicorn", extra="serve", feature="zarrlake service")
    jobs = _check_jobs(args.check_jobs)
    repo = open_repository(args)
    if jobs:
        from zarrlake.checkjobs import JobChecks

        require("kubernetes", extra="kubernetes", feature="checks run as Jobs")
        repo.governance.run_as_jobs(JobChecks(jobs))
    refused = _refusal_events(args.events_for)
    asgi = app(repo, tokens, refused=refused)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="zarrlake: %(message)s")
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    say(f"commit service for repository {repo.id} at http://{host}:{port}/")
    sys.stdout.flush()
    run_asgi(uvicorn, asgi, sock)


def _refusal_events(given: str | None) -> Refused | None:
    """Refusals as Warning Events about the object ``given`` (or ``$ZARRLAKE_EVENTS_FOR``)
    names, or None when neither names one."""
    from zarrlake.kevents import ENV_ABOUT, About, EventRecorder

    text = given if given is not None else os.environ.get(ENV_ABOUT, "")
    if not text.strip():
        return None
    try:
        about = About.parse(text)
    except InvalidArgument as e:
        raise UsageError(f"{'--events-for' if given is not None else ENV_ABOUT}: {e}") from None
    require("kubernetes", extra="kubernetes", feature="Events of refused changes")
    recorder = EventRecorder(about, component="zarrlake-commit-service")

    def post(refusal: Refusal) -> None:
        reason = {"ReadOnlyError": "NotAllowed", "InvalidArgument": "Rejected"}.get(
            refusal.error, refusal.error
        )
        recorder.post(reason, str(refusal))

    return post


def _check_jobs(path: str | None) -> dict[str, CheckJob]:
    from zarrlake.checkjobs import ENV_JOBS, parse_jobs

    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise UsageError(f"--check-jobs: cannot read {path}: {e.strerror or e}") from None
    else:
        text = os.environ.get(ENV_JOBS, "")
        if not text.strip():
            return {}
    try:
        return parse_jobs(text)
    except InvalidArgument as e:
        raise UsageError(f"{'--check-jobs' if path is not None else ENV_JOBS}: {e}") from None


def run_check(args: argparse.Namespace) -> None:
    """Print the check's problems, one per line (also to ``$ZARRLAKE_REPORT_FILE``: a Job's
    termination message), and exit 1 if there are any; 0 and nothing printed if it passes."""
    from zarrlake.checkjobs import Asked
    from zarrlake.checkjobs import run_check as check

    asked = Asked.from_env(
        name=args.name,
        snapshot=args.snapshot,
        parent=args.parent,
        branch=args.branch,
        kind=args.kind,
        options=args.options,
    )
    repo = open_repository(args)
    try:
        problems = check(repo, asked)
    except InvalidArgument as e:
        problems = [f"cannot run here: {e}"]
    if not problems:
        return
    for problem in problems:
        say(problem)
    report = os.environ.get("ZARRLAKE_REPORT_FILE")
    if report:
        with contextlib.suppress(OSError):
            Path(report).write_text("\n".join(problems) + "\n")
    raise CheckFailed(asked.name, asked.branch or asked.snapshot, problems)
