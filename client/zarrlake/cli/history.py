"""``zarrlake init``, ``log``, ``diff`` and ``merge``: a repository's history, from its first
commit to the merge of one branch into another."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from zarrlake.cli.args import MAIN, Commands, add_json, add_lock, count
from zarrlake.cli.connect import open_repository, open_storage
from zarrlake.cli.output import print_json, print_table, say, short_time
from zarrlake.errors import MergeConflictError, StorageError, ZarrlakeError
from zarrlake.format.ids import CONTENT_HASHES, DEFAULT_CONTENT_HASH
from zarrlake.format.model import LAYOUT_KEY
from zarrlake.listing import commit_to_json, tree_key
from zarrlake.repository import Repository
from zarrlake.storage import Storage
from zarrlake.types import Diff

STRATEGIES = ("source-wins", "dest-wins")

# -- init ----------------------------------------------------------------------------------------


def add_init(commands: Commands) -> None:
    p = commands.add("init", run_init, "create a repository with an empty main branch")
    p.add_argument(
        "--content-hash",
        choices=sorted(CONTENT_HASHES),
        default=DEFAULT_CONTENT_HASH,
        help=(
            f"the hash that names chunk objects (default: {DEFAULT_CONTENT_HASH}); sha256 keeps "
            "the repository writable by zarrlake versions before this setting"
        ),
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="create the repository even where other objects (files) already are",
    )


def run_init(args: argparse.Namespace) -> None:
    storage = open_storage(args.url)
    if not args.force:
        _refuse_foreign_objects(storage)
    repo = Repository.create(storage, content_hash=args.content_hash)
    say(repo.id)


#: How many keys ``init`` looks at for objects that are not a repository's: one listing
#: request's worth (a page of S3's ``ListObjectsV2``).
FOREIGN_CHECK_KEYS = 1000


def _refuse_foreign_objects(storage: Storage) -> None:
    """Raise :class:`ZarrlakeError` when ``storage`` holds objects that are not a repository's
    (or cannot be listed to tell): a repository created there would mix its objects into
    someone's files (``zarrlake init ~``). One list request.

    Objects of zarrlake's own layout are no reason to refuse: they are a repository (which
    ``Repository.create`` refuses itself) or what a create that died before its marker left
    (which the next create adopts). A storage that cannot list (read-only HTTP) or answers no
    listing (a missing bucket) is left to ``Repository.create``, whose error says why better.
    """
    if not storage.supports_listing:
        return
    try:
        keys = storage.list_keys(limit=FOREIGN_CHECK_KEYS)
    except StorageError:
        return
    except OSError as e:  # a folder inside that cannot be read: something is there
        raise ZarrlakeError(
            f"cannot tell whether {storage.url} is empty: {e.strerror or e} "
            "(--force creates a repository there anyway)"
        ) from None
    foreign = next((k for k in keys if not LAYOUT_KEY.match(k)), None)
    if foreign is not None and not Repository.exists(storage):
        raise ZarrlakeError(
            f"{storage.url} is not empty (it holds {foreign}) and is not a zarrlake repository: "
            "--force creates one there anyway"
        )


# -- log -----------------------------------------------------------------------------------------


def add_log(commands: Commands) -> None:
    p = commands.add("log", run_log, "list commits reachable from a ref, newest first")
    p.add_argument("--ref", default=MAIN, help="branch, tag or snapshot id (default: main)")
    p.add_argument("-n", type=count, default=None, metavar="N", help="show at most N commits")
    add_json(p)


def run_log(args: argparse.Namespace) -> None:
    repo = open_repository(args)
    history = repo.log(args.ref, limit=args.n)
    commits = list(history)
    if args.json:
        print_json([commit_to_json(c) for c in commits])
        return
    rows = [
        [
            c.id,
            short_time(c.time),
            c.author or "-",
            (c.message.splitlines() or [""])[0] + (" (merge)" if len(c.parents) > 1 else ""),
        ]
        for c in commits
    ]
    print_table(["SNAPSHOT", "TIME", "AUTHOR", "MESSAGE"], rows)
    for child, _ in history.truncated:
        say(f"(history before {child} was expired)")


# -- diff ----------------------------------------------------------------------------------------


def add_diff(commands: Commands) -> None:
    p = commands.add("diff", run_diff, "show what changed between two refs")
    p.add_argument("from_ref", metavar="FROM")
    p.add_argument("to_ref", metavar="TO")
    add_json(p)


def run_diff(args: argparse.Namespace) -> None:
    diff = open_repository(args).diff(args.from_ref, args.to_ref)
    if args.json:
        print_json(diff.to_json())
    elif not diff:
        say("no changes")
    else:
        print_table(["CHANGE", "PATH", "CHUNKS"], diff_rows(diff))


def diff_rows(diff: Diff) -> list[list[str]]:
    """One row per node, in tree order: what happened to it and which of its chunks changed."""
    paths = set(diff.added_nodes) | set(diff.removed_nodes) | set(diff.changed_nodes)
    paths |= set(diff.changed_chunks)
    rows = []
    for path in sorted(paths, key=tree_key):
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


def _chunk_summary(coords: Iterable[tuple[Any, ...]], shown: int = 4) -> str:
    # Coordinates are ints, except in keys that do not follow Zarr's layout; never compare the two.
    ordered = sorted(
        coords, key=lambda c: [(0, x, "") if isinstance(x, int) else (1, 0, str(x)) for x in c]
    )
    text = " ".join("[" + ",".join(map(str, c)) + "]" for c in ordered[:shown])
    more = " ..." if len(ordered) > shown else ""
    noun = "chunk" if len(ordered) == 1 else "chunks"
    return f"{len(ordered)} {noun}: {text}{more}"


# -- merge ---------------------------------------------------------------------------------------


def add_merge(commands: Commands) -> None:
    p = commands.add("merge", run_merge, "three-way merge of a ref into a branch")
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
    add_json(p)
    add_lock(p)


def run_merge(args: argparse.Namespace) -> None:
    repo = open_repository(args, locked=True)
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
        print_json({"snapshot": head})
    elif head == before:
        say(f"{args.into} already contains {args.source} (at {head})")
    else:
        say(f"merged {args.source} into {args.into}: {head}")
