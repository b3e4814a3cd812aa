"""Arguments every ``zarrlake`` command shares: the parser whose mistakes are one-line usage
errors, the way a command module adds its command, and the ``--json``/``--lock`` options."""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Callable
from typing import NoReturn

from zarrlake.durations import parse_duration
from zarrlake.errors import InvalidDuration
from zarrlake.units import parse_bytes

PROG = "zarrlake"
MAIN = "main"

Run = Callable[[argparse.Namespace], None]
"""What a command does with its parsed arguments (``args.run``)."""


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors become one-line :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


class Commands:
    """The subcommands of ``zarrlake``; each command module adds its own."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(self, name: str, run: Run, help: str) -> argparse.ArgumentParser:
        """A command on one repository: ``zarrlake NAME URL ...``, which calls ``run(args)``."""
        p = self._commands.add_parser(name, help=help, description=help)
        p.set_defaults(run=run, json=False)
        add_url(p)
        return p

    def add_group(self, name: str, help: str) -> argparse.ArgumentParser:
        """A command whose actions are subcommands of their own (``zarrlake lock status``)."""
        return self._commands.add_parser(name, help=help)


def add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="repository storage URL or directory")


def add_json(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: an inner parser's copy of an option must not overwrite a value given outside it.
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print JSON (stable format, see the module docs)",
    )


def add_lock(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lock",
        metavar="URL",
        default=argparse.SUPPRESS,
        help="branch lock service (e.g. redis://host:6379/0)",
    )


def count(text: str) -> int:
    """An argument that is a number >= 0 (``-n``, ``--pack-below``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {n}")
    return n


def size(text: str) -> int:
    """An argument that is a byte count: ``262144``, ``256KiB``, ``1MiB``, ``10MB``
    (``--pack-below``)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def duration(text: str, flag: str | None = None) -> dt.timedelta:
    """A duration flag (``7d``, ``12h``, ``90s``, plain seconds; see
    :func:`zarrlake.durations.parse_duration`); a bad one is a :class:`UsageError` (one line,
    exit 2) that names ``flag`` when given."""
    try:
        return parse_duration(text)
    except InvalidDuration as e:
        raise UsageError(f"{flag}: {e}" if flag else str(e)) from None
