"""What the ``zarrlake`` command writes: JSON documents and tables on stdout, one-line errors and
a progress display on stderr.

Tables are aligned plain text, whatever is installed and wherever stdout goes: a header row, then
one row per line, columns two spaces apart and aligned by display width, no trailing spaces. The
same bytes on a terminal and in a pipe, with or without ``rich``, so that ``grep``, ``awk`` and
scripts read them as people do. Only the progress display on stderr is rich (on a terminal).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import unicodedata
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from zarrlake.cli.args import PROG
from zarrlake.listing import json_default

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def say(line: str) -> None:
    sys.stdout.write(line + "\n")


def print_json(doc: Any) -> None:
    """``doc`` as one indented JSON document on stdout, whatever user data it holds."""
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False, default=json_default) + "\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on stdout: the header row, then one line per row, each column padded to its widest
    cell (in terminal columns) and the last one not padded at all.

    Control characters in a cell (user data: an author, a path) are shown escaped (``\\n``,
    ``\\x1b``), so that a row stays one line and a terminal never acts on them.
    """
    lines = [[_cell_text(c) for c in line] for line in [headers, *rows]]
    widths = [max(_display_width(line[i]) for line in lines) for i in range(len(headers))]
    for line in lines:
        cells = [c + " " * (w - _display_width(c)) for c, w in zip(line, widths, strict=True)]
        sys.stdout.write("  ".join(cells).rstrip() + "\n")


def _display_width(text: str) -> int:
    """How many terminal columns ``text`` takes: East Asian wide and full-width characters two,
    combining marks and other zero-width characters none, the rest one."""
    return sum(_char_width(ch) for ch in text)


def _char_width(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def _cell_text(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) == "Cc" else ch
        for ch in text
    )


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
