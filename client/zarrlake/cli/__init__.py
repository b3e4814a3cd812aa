"""The ``zarrlake`` command line: inspect and move refs of a repository, and maintain it, from a
shell or a CronJob.

Usage (``URL`` as in :meth:`zarrlake.Storage.from_url`: ``file:///p``, a plain path, ``memory://``,
``s3://bucket/prefix?endpoint_url=...&region=...``)::

    zarrlake init URL [--content-hash blake3|sha256] [--force]
    zarrlake log URL [--ref main] [-n N] [--json]
    zarrlake branch URL [list [--json] | create NAME [--from REF] | delete NAME
                         | reset NAME REF [--expected SNAPSHOT] | protection [--json]
                         | protect NAME [--allow-direct-commits] [--allow-delete]
                           [--allow-reset] [--check C ...] [--check-options JSON]
                         | unprotect NAME]
    zarrlake tag URL [list [--json] | create NAME REF | delete NAME]
    zarrlake diff URL FROM TO [--json]
    zarrlake merge URL SOURCE INTO [--strategy source-wins|dest-wins] [--message M]
                                   [--author A] [--json]
    zarrlake ls URL [--ref main] [PATH] [--json]
    zarrlake expire URL --rules RULES [--dry-run] [--json]
    zarrlake gc URL [--rules RULES] [--grace 7d] [--dry-run] [--force] [--json]
                    [--engine local|spark] [--spark-master URL]
    zarrlake compact URL [--branch main] [--pack-below BYTES] [--keep-journal 7d] [--dry-run]
                         [--materialize] [--json] [--engine local|spark] [--spark-master URL]
    zarrlake fsck URL [--skip-chunks] [--verify-content] [--sample N] [--repair] [--virtual]
                      [--json]
    zarrlake upgrade URL [--json]
    zarrlake virtual URL [containers [--json] | allow PREFIX [--endpoint-url U] [--region R]
                          [--account-name A] [--anonymous] | disallow PREFIX
                          | import REFS [--branch main] [--group G] [-m M] [--no-pin] [--json]]
    zarrlake lock status URL --lock URL [--json]
    zarrlake mirror run SOURCE DEST [--branch GLOB ...] [--tags|--no-tags] [--copy|--external]
                        [--interval 10] [--once] [--json] [--metrics-port P] [--metrics-addr A]
                        [--gc-every DURATION] [--gc-grace 7d] [--lock URL]
    zarrlake mirror status SOURCE DEST [--branch GLOB ...] [--tags|--no-tags] [--json]
    zarrlake serve URL [--host 127.0.0.1] [--port 8700] [--token-file F] [--max-connections N]
    zarrlake service URL --tokens-file F [--host 127.0.0.1] [--port 8701] [--check-jobs F]
    zarrlake check URL [NAME] [--snapshot ID] [--parent ID] [--branch B] [--kind commit|merge]
                       [--options JSON]
    zarrlake notify URL --webhook URL [--secret-file F] [--event KIND ...] [--branch GLOB ...]
                        [--name N] [--state URL] [--interval 5s] [--once] [--json]

``init`` refuses a location that already holds objects but no repository (a directory of your
files, say); ``--force`` creates the repository there anyway.

Commands that move refs (``branch create|delete|reset``, ``tag create|delete``, ``merge``,
``expire``, ``gc``, ``compact``, ``mirror run``) take ``--lock URL`` (also accepted before the
command name, where it applies to those commands only): the branch lock is built with
``zarrlake.locks.lock_from_url``. Without ``--lock`` they run optimistically, which is always
safe; the lock only spares writers from retry storms (``mirror run``: of several promoters of one
mirror, only the one holding the lock acts; the others stand by).

Environment: ``ZARRLAKE_LOCK`` (a ``--lock`` URL), ``ZARRLAKE_LOCK_PASSWORD`` (the Redis
password, kept out of command lines), ``ZARRLAKE_REPORT_FILE`` (where ``expire``, ``gc`` and
``compact`` also write their :class:`~zarrlake.jobreport.JobReport`), ``ZARRLAKE_DEBUG``.

Exit status: 0 on success; 1 when the operation failed (no repository, unknown ref, merge
conflict, storage failure, fsck found problems, ...); 2 for bad input (unknown option, invalid
branch or tag name, unsupported URL scheme, bad ``--strategy``, bad duration or retention rules,
locks unavailable, ``--metrics-port`` without ``zarrlake[mirror]``, a storage or lock whose extra
is not installed: the message names the ``pip install`` that brings it). ``mirror run --once`` and
``mirror status`` print their status and then exit 1 if any ref reported an error; ``mirror run``
without ``--once`` runs until SIGTERM or SIGINT, finishes the pass under way and exits 0. Every
failure prints exactly one line, ``zarrlake: error: <message>``, to
stderr, and nothing to stdout. Set ``ZARRLAKE_DEBUG=1`` to get the traceback of an unexpected
(internal) error instead.

``--json`` output (stable; one JSON document on stdout; key order as listed):

- ``log``: ``[{"id": str, "parents": [str], "message": str, "author": str | null,
  "time": str, "metadata": {...}}, ...]``, newest first; ``time`` is ISO 8601 in UTC with
  microseconds (``2024-05-01T12:00:00.123456+00:00``).
- ``branch list``: ``{name: snapshot id}``; ``tag list``: ``{name: snapshot id}``; sorted by name.
- ``diff``: :meth:`zarrlake.Diff.to_json` — ``{"added_nodes": [path], "removed_nodes": [path],
  "changed_nodes": [path], "changed_chunks": {array path: [[coord, ...], ...]}}``.
- ``merge``: ``{"snapshot": id}``, the head of ``INTO`` after the merge.
- ``ls``: ``[{"path": str, "type": "group" | "array", "shape": [int], "dtype": str | object,
  "chunks": [int] | null, "shards": [int] | null, "attributes": {...}}, ...]`` in tree order;
  ``shape``, ``dtype``, ``chunks`` and ``shards`` are present for arrays only. Paths start with
  ``/`` (the root group is ``/``). ``chunks`` is the chunk shape (the inner chunk shape of a
  sharded array, whose shard shape is ``shards``).
- ``expire``, ``gc``, ``compact``, ``fsck``: the report's ``to_json()``; ``gc --rules`` nests the
  expiry's under ``"expire"``.
- ``mirror run``: JSON lines, one compact document per pass (flushed as it ends), each
  :meth:`zarrlake.mirror.MirrorStatus.to_json` — ``{"source": url, "destination": url,
  "time": str, "up_to_date": bool, "checked_objects": int, "copied_objects": int,
  "copied_bytes": int, "promoted": [str], "refs": [{"kind": "branch" | "tag", "name": str,
  "source_head": id | null, "mirrored_head": id | null, "commits_behind": int,
  "seconds_behind": float, "missing_objects": int, "last_promotion": str | null,
  "error": str | null}, ...]}``; ``promoted`` entries read ``"branch main"``, ``"tag v1"``,
  ``"branch dev (deleted)"``. ``mirror status``: one (indented) document of the same shape, with
  nothing copied or promoted.

Human output is aligned plain text (a header row, columns aligned, no trailing spaces), the same
bytes whatever is installed and wherever stdout goes; only progress on a terminal's stderr is rich.

One module per command group: :mod:`~zarrlake.cli.history` (init, log, diff, merge),
:mod:`~zarrlake.cli.refs` (branch, tag), :mod:`~zarrlake.cli.browse` (ls),
:mod:`~zarrlake.cli.maintenance` (expire, gc, compact), :mod:`~zarrlake.cli.health` (fsck,
upgrade, lock status), :mod:`~zarrlake.cli.mirror` (mirror run, mirror status),
:mod:`~zarrlake.cli.virtual` (virtual); they share :mod:`~zarrlake.cli.args`,
:mod:`~zarrlake.cli.connect` and :mod:`~zarrlake.cli.output`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from zarrlake.cli import (
    browse,
    health,
    history,
    maintenance,
    mirror,
    notify,
    refs,
    serve,
    service,
    virtual,
)
from zarrlake.cli.args import PROG, Commands, Parser, UsageError
from zarrlake.cli.output import fail
from zarrlake.errors import InvalidArgument, InvalidName, MissingDependency, ZarrlakeError
from zarrlake.maintenance import GraceTooShort, InvalidRetentionRules

__all__ = ["UsageError", "build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zarrlake`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit
    status. Never raises for bad input or failed operations: they are reported in one line."""
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except UsageError as e:
        return fail(str(e), 2)
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    try:
        args.run(args)
        sys.stdout.flush()
    except (
        UsageError,
        InvalidName,
        InvalidArgument,
        InvalidRetentionRules,
        GraceTooShort,
        MissingDependency,  # the installation is the input to fix: as --metrics-port without it
    ) as e:
        return fail(str(e), 2)
    except BrokenPipeError:
        # The reader went away (`zarrlake log URL | head`): stop quietly, as Python's docs advise.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (ZarrlakeError, OSError) as e:
        return fail(str(e) or type(e).__name__, 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as e:
        if os.environ.get("ZARRLAKE_DEBUG"):
            traceback.print_exc()
            return 1
        return fail(f"internal error: {type(e).__name__}: {e}", 1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``zarrlake`` command (errors raise :class:`UsageError`)."""
    from zarrlake import __version__

    parser = Parser(
        prog=PROG, description="Versioned, transactional Zarr repositories on object storage."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "--lock", metavar="URL", default=None, help="branch lock for commands that move refs"
    )
    commands = Commands(parser)
    history.add_init(commands)
    history.add_log(commands)
    refs.add_branch(commands)
    refs.add_tag(commands)
    history.add_diff(commands)
    history.add_merge(commands)
    browse.add_ls(commands)
    maintenance.add_expire(commands)
    maintenance.add_gc(commands)
    maintenance.add_compact(commands)
    health.add_fsck(commands)
    health.add_upgrade(commands)
    health.add_lock_status(commands)
    mirror.add_mirror(commands)
    serve.add_serve(commands)
    notify.add_notify(commands)
    service.add_service(commands)
    service.add_check(commands)
    virtual.add_virtual(commands)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args, extra = parser.parse_known_args(argv)
    # argparse fills an optional positional before it sees later options, so the PATH of
    # `ls URL --ref REF PATH` comes back unparsed; it is the one extra word ls can take.
    if args.command == "ls" and args.path is None and len(extra) == 1 and extra[0][:1] != "-":
        args.path = extra.pop()
    if extra:
        raise UsageError(f"{PROG} {args.command}: unrecognized arguments: {' '.join(extra)}")
    if args.command == "ls" and args.path is None:
        args.path = "/"
    return args
