"""What the ``zarrlake`` command writes: JSON documents and tables on stdout, one-line errors and
a progress display on stderr.

Tables are rich tables when ``rich`` is installed and aligned plain text otherwise; piped, they
are as wide as their content, without colour or trailing spaces, so scripts can read them.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from zarrlake.cli.args import PROG

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def say(line: str) -> None:
    sys.stdout.write(line + "\n")


def print_json(doc: Any) -> None:
    """``doc`` as one indented JSON document on stdout, whatever user data it holds."""
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    # Commit metadata is user data; keep the document valid whatever it holds.
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on stdout: rich when installed, aligned plain text otherwise."""
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
        for line in [headers, *rows]:
            sys.stdout.write(
                "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            )
            sys.stdout.write("\n")
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for h in headers:
        table.add_column(h, overflow="fold")
    for r in rows:
        table.add_row(*(Text(c) for c in r))  # Text: user strings are never parsed as markup
    if sys.stdout.isatty():
        Console(file=sys.stdout, highlight=False).print(table)
        return
    # Piped: full width instead of wrapping at 80 columns, no colour, no trailing padding.
    buf = io.StringIO()
    Console(file=buf, width=100_000, highlight=False, color_system=None).print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))


# -- values in tables ----------------------------------------------------------------------------


def short_time(t: dt.datetime) -> str:
    """``2024-05-01 12:00:00Z``: a commit time to the second, in UTC."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def shape_text(dims: Sequence[int] | None) -> str:
    """``(8, 8)``; empty for no shape."""
    return "" if dims is None else str(tuple(dims))


# -- stderr --------------------------------------------------------------------------------------


def fail(message: str, status: int) -> int:
    """Report a failure as the one line ``zarrlake: error: MESSAGE`` and return ``status``."""
    sys.stderr.write(f"{PROG}: error: {' '.join(message.split()) or 'unknown error'}\n")
    return status


def warn(message: str) -> None:
    """A warning on stderr: the command still succeeds (and stdout stays a clean document)."""
    sys.stderr.write(f"{PROG}: warning: {message}\n")


class ProgressDisplay:
    """A rich progress display on stderr while a long command runs, one line per phase; silent
    without a terminal or without rich.

    ``with ProgressDisplay(enabled) as progress:`` gives the callback that maintenance operations
    take (``progress(phase, objects_done)``), or None when nothing is displayed.
    """

    def __init__(self, enabled: bool) -> None:
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            except ImportError:
                return
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TextColumn("{task.completed} objects"),
                TimeElapsedColumn(),
                transient=True,
                console=Console(file=sys.stderr),
            )

    def __enter__(self) -> Callable[[str, int], None] | None:
        if self._progress is None:
            return None
        self._progress.__enter__()
        return self.advance

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, phase: str, n: int) -> None:
        if self._progress is None:
            return
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._progress.add_task(phase, total=None)
        self._progress.advance(task, n)
