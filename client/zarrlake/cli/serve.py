"""``zarrlake serve``: the repository over HTTP (:mod:`zarrlake.serve`), run by uvicorn until
SIGTERM or SIGINT.

The socket is bound here, before uvicorn starts, so that a port in use is the command's one-line
error (uvicorn would log it and exit), and so that ``--port 0`` can print the port it got. The
token is read from a file (``--token-file``, a Kubernetes Secret mounted as one), never from the
command line, where ``ps`` shows it; neither it nor the storage URL (which may carry an endpoint
worth keeping to oneself) is printed. uvicorn's access log is off: a browser's first request
may carry the token in its query (``?token=``). SIGTERM or SIGINT: uvicorn finishes the requests
under way, and the command exits 0.
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from zarrlake.cli.args import Commands, UsageError
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import say
from zarrlake.extras import require

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8700
#: Connections served at once; past them a request is answered 503 at once, so that a flood
#: of clients cannot make the server hold more sockets and tasks than it can serve.
DEFAULT_MAX_CONNECTIONS = 1024


def add_serve(commands: Commands) -> None:
    p = commands.add(
        "serve", run_serve, "serve every version over HTTP: plain Zarr, a JSON API, web pages"
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on ({DEFAULT_HOST})")
    p.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port ({DEFAULT_PORT}; 0: any free one)"
    )
    p.add_argument(
        "--token-file",
        metavar="F",
        default=None,
        help="file holding the token every request must carry (Authorization: Bearer ...)",
    )
    p.add_argument(
        "--max-connections",
        type=_positive,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"connections served at once; past them, 503 ({DEFAULT_MAX_CONNECTIONS})",
    )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of connections >= 1, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return int(text)


def read_token(path: str | None) -> str | None:
    """The token in file ``path`` (surrounding whitespace dropped), or None without a path.
    Raises :class:`UsageError` for a file that cannot be read or holds no token."""
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise UsageError(f"--token-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--token-file {path}: cannot read it ({type(e).__name__})") from None
    if not token:
        raise UsageError(f"--token-file {path}: the file is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise UsageError(f"--token-file {path}: a token is one word of printable characters")
    return token


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``; :class:`UsageError` if it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        raise UsageError(f"--host {host}: not an address this machine has") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"cannot listen on {host}:{port}: the port is in use") from None
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


def run_serve(args: argparse.Namespace) -> None:
    token = read_token(args.token_file)
    uvicorn = require("uvicorn", extra="serve", feature="zarrlake serve")
    from zarrlake.serve import app

    repo = open_repository(args)
    asgi = app(repo, token=token)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    guarded = " (token required)" if token else ""
    say(f"serving repository {repo.id} at http://{shown}:{port}/{guarded}")
    sys.stdout.flush()  # before uvicorn blocks: whoever started us waits for this line
    run_asgi(uvicorn, asgi, sock, max_connections=args.max_connections)


def run_asgi(
    uvicorn: Any, asgi: Any, sock: socket.socket, *, max_connections: int | None = None
) -> None:
    """Serve ``asgi`` on ``sock`` with uvicorn until SIGTERM or SIGINT (then a clean exit);
    past ``max_connections`` connections at once, a request is answered 503."""
    config = uvicorn.Config(
        asgi,
        log_level="warning",
        access_log=False,
        lifespan="on",
        server_header=False,
        # uvicorn counts the connection asking among those open: N + 1 lets N be served.
        limit_concurrency=None if max_connections is None else max_connections + 1,
    )
    # uvicorn stops gracefully on SIGTERM or SIGINT, then raises the signal again for the
    # handler it found; this one makes that a clean exit (0), as `mirror run` does.
    stopped = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in stopped.items():
            signal.signal(sig, handler)


def _stopped(signum: int, frame: object) -> None:
    """The signal uvicorn raises again once it has shut down: already acted on."""
