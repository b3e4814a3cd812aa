"""``zarrlake service``: run a repository's commit service (:mod:`zarrlake.service`), the one
writer of its refs, until SIGTERM or SIGINT.

Start it with credentials that write the whole repository; give writers credentials that write
only immutable objects, a token from ``--tokens-file`` and ``ZARRLAKE_COMMIT_SERVICE`` pointing
here. Each change is logged (stderr) with the identity whose token asked for it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from zarrlake.cli.args import Commands, UsageError
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import say
from zarrlake.cli.serve import listen, run_asgi
from zarrlake.errors import InvalidArgument
from zarrlake.extras import require

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


def run_service(args: argparse.Namespace) -> None:
    from zarrlake.service import app, load_tokens

    try:
        tokens = load_tokens(args.tokens_file)
    except InvalidArgument as e:
        raise UsageError(f"--tokens-file: {e}") from None
    uvicorn = require("uvicorn", extra="serve", feature="zarrlake service")
    repo = open_repository(args)
    asgi = app(repo, tokens)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="zarrlake: %(message)s")
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    say(f"commit service for repository {repo.id} at http://{host}:{port}/")
    sys.stdout.flush()
    run_asgi(uvicorn, asgi, sock)
