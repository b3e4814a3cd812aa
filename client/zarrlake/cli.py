"""The ``zarrlake`` command line: inspect and move refs of a repository from a shell or a CronJob.

Usage (``URL`` as in :meth:`zarrlake.Storage.from_url`: ``file:///p``, a plain path, ``memory://``,
``s3://bucket/prefix?endpoint_url=...&region=...``)::

    zarrlake init URL
    zarrlake log URL [--ref main] [-n N] [--json]
    zarrlake branch URL [list [--json] | create NAME [--from REF] | delete NAME
                         | reset NAME REF [--expected SNAPSHOT]]
    zarrlake tag URL [list [--json] | create NAME REF | delete NAME]
    zarrlake diff URL FROM TO [--json]
    zarrlake merge URL SOURCE INTO [--strategy source-wins|dest-wins] [--message M]
                                   [--author A] [--json]
    zarrlake ls URL [--ref main] [PATH] [--json]

Commands that move refs (``branch create|delete|reset``, ``tag create|delete``, ``merge``) take
``--lock URL`` (also accepted before the command name, where it applies to those commands only):
the branch lock is built with ``zarrlake.locks.lock_from_url``. Without ``--lock`` they run
optimistically, which is always safe; the lock only spares writers from retry storms.

Exit status: 0 on success; 1 when the operation failed (no repository, unknown ref, merge
conflict, storage failure, ...); 2 for bad input (unknown option, invalid branch or tag name,
unsupported URL scheme, bad ``--strategy``, locks unavailable). Every failure prints exactly one
line, ``zarrlake: error: <message>``, to stderr, and nothing to stdout. Set ``ZARRLAKE_DEBUG=1``
to get the traceback of an unexpected (internal) error instead.

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

Human output uses rich tables when ``rich`` is installed and aligned plain text otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import importlib
import io
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from zarrlake.errors import CorruptObject, InvalidName, MergeConflictError, ZarrlakeError
from zarrlake.maintenance import GraceTooShort, InvalidRetentionRules
from zarrlake.repository import Repository
from zarrlake.storage.base import Storage, StorageError
from zarrlake.types import CommitInfo, Diff, node_path

PROG = "zarrlake"
MAIN = "main"
STRATEGIES = ("source-wins", "dest-wins")


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors become one-line :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


# -- output ----------------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    # Commit metadata is user data; keep the document valid whatever it holds.
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False, default=_json_default) + "\n")


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
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


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _iso_utc(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat(timespec="microseconds")


def _short_time(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _shape(dims: Sequence[int] | None) -> str:
    return "" if dims is None else str(tuple(dims))


# -- opening things ------------------------------------------------------------------------------


def _storage(url: str) -> Storage:
    try:
        return Storage.from_url(url)
    except StorageError as e:
        raise UsageError(str(e)) from None


def _lock(url: str | None) -> Any:
    """The branch lock named by ``--lock`` (or ``$ZARRLAKE_LOCK``); the locks module is imported
    only when asked for. A Redis password comes from ``$ZARRLAKE_LOCK_PASSWORD`` when the URL has
    none, so that it never has to appear in a command line (Kubernetes jobs pass it that way)."""
    url = url or os.environ.get("ZARRLAKE_LOCK") or None
    if url is None:
        return None
    password = os.environ.get("ZARRLAKE_LOCK_PASSWORD")
    if password and url.startswith(("redis://", "rediss://")) and "@" not in url:
        from zarrlake.k8s import with_password

        url = with_password(url, password)
    try:
        locks = importlib.import_module("zarrlake.locks")
    except ImportError as e:
        detail = "" if e.name == "zarrlake.locks" else f" (cannot import {e.name or e})"
        raise UsageError(f"locks are not available in this build{detail}") from None
    lock_from_url: Callable[[str], Any] | None = getattr(locks, "lock_from_url", None)
    if lock_from_url is None:
        raise UsageError("locks are not available in this build")
    try:
        return lock_from_url(url)
    except ValueError as e:
        safe = _redact(url)  # the message may quote the URL too
        raise UsageError(f"bad --lock URL {safe!r}: {str(e).replace(url, safe)}") from None


def _redact(url: str) -> str:
    """A URL with any password replaced by ``***`` (for error messages)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _open(args: argparse.Namespace, *, locked: bool = False) -> Repository:
    storage = _storage(args.url)
    lock = _lock(args.lock) if locked else None
    return Repository.open(storage, lock=lock)


# -- init, log -------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> None:
    repo = Repository.create(_storage(args.url))
    _say(repo.id)


def commit_json(info: CommitInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "parents": list(info.parents),
        "message": info.message,
        "author": info.author,
        "time": _iso_utc(info.time),
        "metadata": info.metadata,
    }


def cmd_log(args: argparse.Namespace) -> None:
    repo = _open(args)
    history = repo.log(args.ref, limit=args.n)
    commits = list(history)
    if args.json:
        _print_json([commit_json(c) for c in commits])
        return
    rows = [
        [
            c.id,
            _short_time(c.time),
            c.author or "-",
            (c.message.splitlines() or [""])[0] + (" (merge)" if len(c.parents) > 1 else ""),
        ]
        for c in commits
    ]
    _print_table(["SNAPSHOT", "TIME", "AUTHOR", "MESSAGE"], rows)
    for child, _ in history.truncated:
        _say(f"(history before {child} was expired)")


# -- branches and tags ---------------------------------------------------------------------------


def _print_refs(refs: dict[str, str], kind: str, as_json: bool) -> None:
    if as_json:
        _print_json(refs)
    elif refs:
        _print_table([kind.upper(), "SNAPSHOT"], [[n, s] for n, s in refs.items()])
    else:
        _say(f"no {kind}s")


def cmd_branch(args: argparse.Namespace) -> None:
    action = args.action or "list"
    if action == "list":
        _print_refs(_open(args).list_branches(), "branch", args.json)
        return
    repo = _open(args, locked=True)
    if action == "create":
        head = repo.create_branch(args.name, args.from_ref)
        _say(f"created branch {args.name} at {head}")
    elif action == "delete":
        old = repo.lookup_branch(args.name)
        repo.delete_branch(args.name)
        _say(f"deleted branch {args.name} (was {old})")
    elif action == "reset":
        old = repo.lookup_branch(args.name)
        head = repo.reset_branch(args.name, args.ref, expected=args.expected)
        _say(f"reset branch {args.name} to {head} (was {old})")


def cmd_tag(args: argparse.Namespace) -> None:
    action = args.action or "list"
    if action == "list":
        _print_refs(_open(args).list_tags(), "tag", args.json)
        return
    repo = _open(args, locked=True)
    if action == "create":
        target = repo.create_tag(args.name, args.ref)
        _say(f"created tag {args.name} at {target}")
    elif action == "delete":
        old = repo.lookup_tag(args.name)
        repo.delete_tag(args.name)
        _say(f"deleted tag {args.name} (was {old})")


# -- diff, merge ---------------------------------------------------------------------------------


def _chunk_summary(coords: Iterable[tuple[Any, ...]], shown: int = 4) -> str:
    # Coordinates are ints, except in keys that do not follow Zarr's layout; never compare the two.
    ordered = sorted(
        coords, key=lambda c: [(0, x, "") if isinstance(x, int) else (1, 0, str(x)) for x in c]
    )
    text = " ".join("[" + ",".join(map(str, c)) + "]" for c in ordered[:shown])
    more = " ..." if len(ordered) > shown else ""
    noun = "chunk" if len(ordered) == 1 else "chunks"
    return f"{len(ordered)} {noun}: {text}{more}"


def diff_rows(diff: Diff) -> list[list[str]]:
    """One row per node: what happened to it and which of its chunks changed."""
    paths = set(diff.added_nodes) | set(diff.removed_nodes) | set(diff.changed_nodes)
    paths |= set(diff.changed_chunks)
    rows = []
    for path in sorted(paths, key=_tree_key):
        if path in diff.added_nodes:
            change = "added"
        elif path in diff.removed_nodes:
            change = "removed"
        elif path in diff.changed_nodes:
            change = "changed"
        else:
            change = "data"
        chunks = diff.changed_chunks.get(path)
        rows.append([change, path, _chunk_summary(chunks) if chunks else ""])
    return rows


def cmd_diff(args: argparse.Namespace) -> None:
    diff = _open(args).diff(args.from_ref, args.to_ref)
    if args.json:
        _print_json(diff.to_json())
    elif not diff:
        _say("no changes")
    else:
        _print_table(["CHANGE", "PATH", "CHUNKS"], diff_rows(diff))


def cmd_merge(args: argparse.Namespace) -> None:
    repo = _open(args, locked=True)
    before = repo.lookup_branch(args.into)
    try:
        head = repo.merge(
            args.source, args.into, message=args.message, strategy=args.strategy, author=args.author
        )
    except MergeConflictError as e:
        hint = "; --strategy source-wins or dest-wins settles them" if e.conflicts else ""
        raise MergeConflictError(
            e.conflicts, f"cannot merge {args.source!r} into {args.into!r}: {e}{hint}"
        ) from None
    if args.json:
        _print_json({"snapshot": head})
    elif head == before:
        _say(f"{args.into} already contains {args.source} (at {head})")
    else:
        _say(f"merged {args.source} into {args.into}: {head}")


# -- ls ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeListing:
    """A group or array as ``ls`` shows it, read from its Zarr metadata document."""

    path: str
    type: str
    attributes: dict[str, Any]
    shape: list[int] | None = None
    dtype: Any = None
    chunks: list[int] | None = None
    shards: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.type == "array":
            doc |= {"shape": self.shape, "dtype": self.dtype, "chunks": self.chunks}
            doc["shards"] = self.shards
        doc["attributes"] = self.attributes
        return doc


def _tree_key(path: str) -> tuple[str, ...]:
    # Sort by path segments so a node's children follow it directly ('/a', '/a/b', '/a-c').
    return tuple(path.strip("/").split("/")) if path != "/" else ()


def _v3_listing(path: str, key: str, doc: dict[str, Any]) -> NodeListing:
    attrs = doc.get("attributes") or {}
    kind = doc.get("node_type")
    if kind == "group":
        return NodeListing(path, "group", attrs)
    if kind != "array":
        raise CorruptObject(key, f"unknown node_type {kind!r}")
    grid = doc.get("chunk_grid") or {}
    chunks = (
        (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid, dict) else None
    )
    shards = None
    for codec in doc.get("codecs") or []:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            shards, chunks = chunks, (codec.get("configuration") or {}).get("chunk_shape")
            break
    return NodeListing(
        path,
        "array",
        attrs,
        shape=list(doc.get("shape") or []),
        dtype=doc.get("data_type"),
        chunks=None if chunks is None else list(chunks),
        shards=None if shards is None else list(shards),
    )


async def _read_doc(store: Any, key: str) -> dict[str, Any] | None:
    from zarr.core.buffer import default_buffer_prototype

    buf = await store.get(key, prototype=default_buffer_prototype())
    if buf is None:
        return None
    try:
        doc = json.loads(buf.to_bytes())
    except (ValueError, UnicodeDecodeError):
        raise CorruptObject(key, "not a JSON document") from None
    if not isinstance(doc, dict):
        raise CorruptObject(key, "not a JSON object")
    return doc


async def _node_at(store: Any, path: str) -> NodeListing | None:
    """The node whose metadata lives at ``path`` (Zarr v3, or v2), or None."""
    prefix = path.strip("/")
    keys = [
        f"{prefix}/{n}" if prefix else n for n in ("zarr.json", ".zarray", ".zgroup", ".zattrs")
    ]
    v3, zarray, zgroup, zattrs = await asyncio.gather(*(_read_doc(store, k) for k in keys))
    if v3 is not None:
        return _v3_listing(path, keys[0], v3)
    attrs = zattrs or {}
    if zarray is not None:
        return NodeListing(
            path,
            "array",
            attrs,
            shape=list(zarray.get("shape") or []),
            dtype=zarray.get("dtype"),
            chunks=list(zarray.get("chunks") or []),
        )
    if zgroup is not None:
        return NodeListing(path, "group", attrs)
    return None


async def _walk(store: Any, path: str, found: list[NodeListing]) -> None:
    node = await _node_at(store, path)
    if node is not None:
        found.append(node)
        if node.type == "array":
            return  # below an array there are only chunks
    prefix = path.strip("/")
    names = [n async for n in store.list_dir(prefix)]
    meta = {"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"}
    children = [node_path(f"{prefix}/{n}") for n in names if n not in meta]
    # Directories without metadata (implicit groups) are walked too: nodes may live below them.
    await asyncio.gather(*(_walk(store, child, found) for child in children))


def list_nodes(repo: Repository, ref: str, path: str = "/") -> list[NodeListing]:
    """Groups and arrays at and below ``path`` in ``ref``, in tree order.

    Raises :class:`ZarrlakeError` when nothing exists at a ``path`` other than the root (an
    empty repository lists nothing), :class:`RefNotFound` for an unknown ref.
    """
    path = node_path(path)
    store = repo.readonly_session(ref).store
    found: list[NodeListing] = []
    asyncio.run(_walk(store, path, found))
    if not found and path != "/":
        raise ZarrlakeError(f"no group or array at {path!r} in {ref!r}")
    return sorted(found, key=lambda n: _tree_key(n.path))


def _dtype_text(dtype: Any) -> str:
    if dtype is None or isinstance(dtype, str):
        return dtype or ""
    return json.dumps(dtype, separators=(",", ":"))


def cmd_ls(args: argparse.Namespace) -> None:
    nodes = list_nodes(_open(args), args.ref, args.path)
    if args.json:
        _print_json([n.to_json() for n in nodes])
        return
    if not nodes:
        _say("no groups or arrays")
        return
    headers = ["PATH", "TYPE", "SHAPE", "DTYPE", "CHUNKS"]
    sharded = any(n.shards for n in nodes)
    if sharded:
        headers.append("SHARDS")
    rows = []
    for n in nodes:
        row = [n.path, n.type, _shape(n.shape), _dtype_text(n.dtype), _shape(n.chunks)]
        if sharded:
            row.append(_shape(n.shards))
        rows.append(row)
    _print_table(headers, rows)


# -- maintenance: expire, gc, compact -----------------------------------------------------------

def parse_duration(text: str) -> dt.timedelta:
    """A duration flag; a bad one is a usage error (one line, exit 2)."""
    from zarrlake.durations import parse_duration as parse
    from zarrlake.errors import InvalidDuration

    try:
        return parse(text)
    except InvalidDuration as e:
        raise UsageError(str(e)) from None


class _Progress:
    """A rich progress display on stderr while a phase runs (silent without a terminal or rich)."""

    def __init__(self, enabled: bool) -> None:
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

                self._progress = Progress(
                    SpinnerColumn(),
                    TextColumn("{task.description}"),
                    TextColumn("{task.completed} objects"),
                    TimeElapsedColumn(),
                    transient=True,
                    console=_rich_console(sys.stderr),
                )
            except ImportError:
                self._progress = None

    def __enter__(self) -> Callable[[str, int], None] | None:
        if self._progress is None:
            return None
        self._progress.__enter__()
        return self.advance

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def advance(self, phase: str, n: int) -> None:
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._progress.add_task(phase, total=None)
        self._progress.advance(task, n)


def _rich_console(stream: Any) -> Any:
    from rich.console import Console

    return Console(file=stream)


def _report(args: argparse.Namespace, report: Any) -> None:
    _write_report_file(report.to_json())
    if args.json:
        _print_json(report.to_json())
    else:
        _say(report.summary())


def _write_report_file(doc: Any) -> None:
    """Also write the JSON report where ``$ZARRLAKE_REPORT_FILE`` says: Kubernetes jobs point it at
    ``/dev/termination-log``, which is how the operator learns each run's result."""
    path = os.environ.get("ZARRLAKE_REPORT_FILE")
    if not path:
        return

    def counts_only(d: Any) -> Any:  # lists (e.g. every expired snapshot id) can be long
        if isinstance(d, dict):
            return {k: counts_only(v) for k, v in d.items() if not isinstance(v, list)}
        return d

    # The kubelet keeps at most 4 KiB of a termination message; counts fit.
    text = json.dumps(counts_only(doc), separators=(",", ":"), default=_json_default)
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:  # stderr: stdout may be a --json document
        sys.stderr.write(f"{PROG}: warning: cannot write report to {path}: {e.strerror}\n")


def _rules(text: str) -> Any:
    """``--rules``: a JSON/YAML file, or the rules inline as a JSON object."""
    from zarrlake.maintenance import InvalidRetentionRules, RetentionRules

    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise InvalidRetentionRules(f"inline --rules is not valid JSON: {e}") from None
        return RetentionRules.from_dict(doc)
    return RetentionRules.from_file(text)


def cmd_expire(args: argparse.Namespace) -> None:
    rules = _rules(args.rules)  # InvalidRetentionRules: one line, exit 2
    repo = _open(args, locked=True)
    _report(args, repo.expire(rules, dry_run=args.dry_run))


def cmd_gc(args: argparse.Namespace) -> None:
    grace = parse_duration(args.grace)
    rules = _rules(args.rules) if args.rules else None
    repo = _open(args, locked=True)
    expired = repo.expire(rules, dry_run=args.dry_run) if rules is not None else None
    with _Progress(not args.json) as progress:
        report = repo.gc(grace=grace, dry_run=args.dry_run, force=args.force, progress=progress)
    doc = report.to_json()
    if expired is not None:
        doc = {**doc, "expire": expired.to_json()}
    _write_report_file(doc)
    if args.json:
        _print_json(doc)
        return
    if expired is not None:
        _say(expired.summary())
    _say(report.summary())
    rows = [
        [kind, str(c.deleted), _bytes(c.deleted_bytes), str(c.kept), _bytes(c.kept_bytes)]
        for kind, c in report.by_kind.items()
    ]
    _print_table(["KIND", "DELETED", "BYTES", "KEPT", "BYTES"], rows)


def _bytes(n: int) -> str:
    from zarrlake.maintenance.gc import _human

    return _human(n)


def cmd_compact(args: argparse.Namespace) -> None:
    keep = parse_duration(args.keep_journal)
    repo = _open(args, locked=True)
    with _Progress(not args.json) as progress:
        report = repo.compact(
            branch=args.branch,
            pack_below_bytes=args.pack_below,
            keep_journal=keep,
            dry_run=args.dry_run,
            progress=progress,
        )
    _report(args, report)


# -- fsck, lock status ---------------------------------------------------------------------------


def cmd_fsck(args: argparse.Namespace) -> None:
    report = _open(args).fsck(check_chunks=not args.skip_chunks)
    if args.json:
        _print_json(report.to_json())
    else:
        c = report.to_json()["checked"]
        _say(
            f"checked {c['refs']} refs, {c['snapshots']} snapshots, {c['shards']} shards, "
            f"{c['chunks']} chunk objects: "
            + ("ok" if report.ok else f"{len(report.problems)} problem(s)")
        )
        for problem in report.problems:
            _say(f"  {problem}")
    if not report.ok:
        raise _FsckFailed(f"fsck found {len(report.problems)} problem(s)")


class _FsckFailed(ZarrlakeError):
    """fsck printed its report; the command must still exit non-zero."""


def cmd_lock_status(args: argparse.Namespace) -> None:
    if not args.lock:
        raise UsageError("lock status needs --lock redis://... (the lock service to ask)")
    lock = _lock(args.lock)
    repo = _open(args)
    status = getattr(lock, "status", None)
    if status is None:
        raise UsageError("only a Redis lock service reports holders")
    holders = status(repo.id)
    if args.json:
        _print_json(
            [
                {
                    "branch": h.branch,
                    "holder": h.holder,
                    "token": h.token,
                    "ttl_ms": h.ttl_ms,
                    "waiters": h.waiters,
                }
                for h in holders
            ]
        )
        return
    if not holders:
        _say("no branch of this repository is locked")
        return
    _print_table(
        ["BRANCH", "HOLDER", "TOKEN", "TTL", "WAITERS"],
        [
            [h.branch, h.holder, str(h.token), f"{h.ttl_ms / 1000:.1f}s", str(h.waiters)]
            for h in holders
        ],
    )


# -- the parser ----------------------------------------------------------------------------------


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {n}")
    return n


def _add_json(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: an inner parser's copy of an option must not overwrite a value given outside it.
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print JSON (stable format, see the module docs)",
    )


def _add_lock(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lock",
        metavar="URL",
        default=argparse.SUPPRESS,
        help="branch lock service (e.g. redis://host:6379/0)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``zarrlake`` command (errors raise :class:`UsageError`)."""
    parser = _Parser(
        prog=PROG, description="Versioned, transactional Zarr repositories on object storage."
    )
    from zarrlake import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "--lock", metavar="URL", default=None, help="branch lock for commands that move refs"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, run: Callable[[argparse.Namespace], None], help: str
    ) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help, description=help)
        p.set_defaults(run=run, json=False)
        p.add_argument("url", metavar="URL", help="repository storage URL or directory")
        return p

    command("init", cmd_init, "create a repository with an empty main branch")

    p = command("log", cmd_log, "list commits reachable from a ref, newest first")
    p.add_argument("--ref", default=MAIN, help="branch, tag or snapshot id (default: main)")
    p.add_argument("-n", type=_count, default=None, metavar="N", help="show at most N commits")
    _add_json(p)

    p = command("branch", cmd_branch, "list, create, delete or reset branches")
    _add_json(p)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    _add_json(actions.add_parser("list", help="list branches (the default)"))
    a = actions.add_parser("create", help="create a branch")
    a.add_argument("name", metavar="NAME")
    a.add_argument(
        "--from",
        dest="from_ref",
        default=MAIN,
        metavar="REF",
        help="branch, tag or snapshot id to start from (default: main)",
    )
    _add_lock(a)
    a = actions.add_parser("delete", help="delete a branch (not main)")
    a.add_argument("name", metavar="NAME")
    _add_lock(a)
    a = actions.add_parser("reset", help="point a branch at another ref")
    a.add_argument("name", metavar="NAME")
    a.add_argument("ref", metavar="REF")
    a.add_argument(
        "--expected",
        metavar="SNAPSHOT",
        default=None,
        help="only if the branch head is still this snapshot",
    )
    _add_lock(a)

    p = command("tag", cmd_tag, "list, create or delete tags")
    _add_json(p)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    _add_json(actions.add_parser("list", help="list tags (the default)"))
    a = actions.add_parser("create", help="tag a ref")
    a.add_argument("name", metavar="NAME")
    a.add_argument("ref", metavar="REF")
    _add_lock(a)
    a = actions.add_parser("delete", help="delete a tag (its name is never reused)")
    a.add_argument("name", metavar="NAME")
    _add_lock(a)

    p = command("diff", cmd_diff, "show what changed between two refs")
    p.add_argument("from_ref", metavar="FROM")
    p.add_argument("to_ref", metavar="TO")
    _add_json(p)

    p = command("merge", cmd_merge, "three-way merge of a ref into a branch")
    p.add_argument("source", metavar="SOURCE", help="branch, tag or snapshot id to merge")
    p.add_argument("into", metavar="INTO", help="branch that receives the merge commit")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=None,
        help="settle every conflict for one side (default: fail on conflicts)",
    )
    p.add_argument("--message", "-m", default=None, help="commit message")
    p.add_argument("--author", default=None, help="commit author")
    _add_json(p)
    _add_lock(p)

    p = command("ls", cmd_ls, "list the groups and arrays at PATH")
    p.add_argument("path", metavar="PATH", nargs="?", default=None, help="node path (default: /)")
    p.add_argument("--ref", default=MAIN, help="branch, tag or snapshot id (default: main)")
    _add_json(p)

    p = command("expire", cmd_expire, "take snapshots outside the retention rules out of history")
    p.add_argument(
        "--rules", required=True, metavar="RULES", help="retention rules: JSON/YAML file or JSON"
    )
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    _add_json(p)
    _add_lock(p)

    p = command("gc", cmd_gc, "delete objects no retained snapshot needs")
    p.add_argument(
        "--rules", default=None, metavar="RULES", help="expire by these rules first (file or JSON)"
    )
    p.add_argument("--grace", default="7d", help="only delete objects older than this (default 7d)")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--force", action="store_true", help="allow a grace shorter than the session lifetime"
    )
    _add_json(p)
    _add_lock(p)

    p = command("compact", cmd_compact, "pack small chunks, merge shards, prune the journal")
    p.add_argument("--branch", default=MAIN, help="branch to compact (default: main)")
    p.add_argument(
        "--pack-below",
        type=_count,
        default=None,
        metavar="BYTES",
        help="pack chunk objects smaller than this (default 256 KiB)",
    )
    p.add_argument(
        "--keep-journal",
        default="7d",
        metavar="DURATION",
        help="keep branch-journal entries (as_of) this far back (default 7d)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    _add_json(p)
    _add_lock(p)

    p = command("fsck", cmd_fsck, "check that every reachable object exists and parses")
    p.add_argument("--skip-chunks", action="store_true", help="do not check chunk objects")
    _add_json(p)

    p = commands.add_parser("lock", help="inspect the branch lock service")
    lock_actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = lock_actions.add_parser("status", help="show who holds this repository's branch locks")
    a.set_defaults(run=cmd_lock_status, json=False)
    a.add_argument("url", metavar="URL", help="repository storage URL or directory")
    _add_lock(a)
    _add_json(a)
    return parser


# -- entry point ---------------------------------------------------------------------------------


def _fail(message: str, status: int) -> int:
    sys.stderr.write(f"{PROG}: error: {_one_line(message) or 'unknown error'}\n")
    return status


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zarrlake`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit
    status. Never raises for bad input or failed operations: they are reported in one line."""
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except UsageError as e:
        return _fail(str(e), 2)
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    try:
        args.run(args)
        sys.stdout.flush()
    except (UsageError, InvalidName, InvalidRetentionRules, GraceTooShort) as e:
        return _fail(str(e), 2)
    except BrokenPipeError:
        # The reader went away (`zarrlake log URL | head`): stop quietly, as Python's docs advise.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (ZarrlakeError, OSError) as e:
        return _fail(str(e) or type(e).__name__, 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as e:
        if os.environ.get("ZARRLAKE_DEBUG"):
            traceback.print_exc()
            return 1
        return _fail(f"internal error: {type(e).__name__}: {e}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
