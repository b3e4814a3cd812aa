"""``zarrlake fsck`` and ``zarrlake lock status``: is the repository whole, and who holds its
branch locks."""

from __future__ import annotations

import argparse

from zarrlake.cli.args import Commands, UsageError, add_json, add_lock, add_url
from zarrlake.cli.connect import open_lock, open_repository
from zarrlake.cli.output import ProgressDisplay, print_json, print_table, say
from zarrlake.errors import ZarrlakeError
from zarrlake.fsck import SAMPLE as FSCK_SAMPLE

# -- fsck ----------------------------------------------------------------------------------------


def add_fsck(commands: Commands) -> None:
    p = commands.add("fsck", run_fsck, "check that every reachable object exists and parses")
    p.add_argument("--skip-chunks", action="store_true", help="do not check chunk objects")
    p.add_argument(
        "--verify-content",
        action="store_true",
        help="read every chunk and check its bytes against its name (reads all the data)",
    )
    p.add_argument(
        "--sample",
        type=_chunk_count,
        default=FSCK_SAMPLE,
        metavar="N",
        help=f"without --verify-content: read N chunks picked at random and check their bytes "
        f"(default {FSCK_SAMPLE}; 0: none)",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="publish the journals' heads and tags to a published root that is behind them",
    )
    p.add_argument(
        "--virtual",
        action="store_true",
        help="check every virtual chunk's source file: it exists and is the version its refs pin",
    )
    add_json(p)


def add_upgrade(commands: Commands) -> None:
    p = commands.add("upgrade", run_upgrade, "give the repository the published root (safe online)")
    add_json(p)


def run_upgrade(args: argparse.Namespace) -> None:
    report = open_repository(args).upgrade()
    if args.json:
        print_json(report.to_json())
    else:
        say(report.summary())


def _chunk_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of chunks, not {text!r}")
    return n


class FsckFailed(ZarrlakeError):
    """fsck printed its report; the command must still exit non-zero."""


def run_fsck(args: argparse.Namespace) -> None:
    """Print the report (problems one per line), then fail with :class:`FsckFailed` (exit
    status 1) if there is any problem."""
    repo = open_repository(args)
    with ProgressDisplay(args.virtual and not args.json) as advance:

        def progress(done: int, total: int) -> None:
            if advance is not None:
                advance("virtual sources checked", 1)

        report = repo.fsck(
            check_chunks=not args.skip_chunks,
            verify_content=args.verify_content,
            sample=args.sample,
            repair=args.repair,
            virtual=args.virtual,
            progress=progress,
        )
    if args.json:
        print_json(report.to_json())
    else:
        c = report.to_json()["checked"]
        virtual = f", {c['virtual_sources']} virtual sources" if args.virtual else ""
        say(
            f"checked {c['refs']} refs, {c['snapshots']} snapshots, {c['shards']} shards, "
            f"{c['chunks']} chunk objects, the content of {c['verified']} chunks{virtual}: "
            + ("ok" if report.ok else f"{len(report.problems)} problem(s)")
        )
        for problem in report.problems:
            say(f"  {problem}")
        for item in report.notes:
            say(f"  note: {item}")
        for key in report.repaired:
            say(f"repaired {key}: republished from the journals")
    if not report.ok:
        raise FsckFailed(f"fsck found {len(report.problems)} problem(s)")


# -- lock status ---------------------------------------------------------------------------------


def add_lock_status(commands: Commands) -> None:
    p = commands.add_group("lock", "inspect the branch lock service")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = actions.add_parser("status", help="show who holds this repository's branch locks")
    a.set_defaults(run=run_lock_status, json=False)
    add_url(a)
    add_lock(a)
    add_json(a)


def run_lock_status(args: argparse.Namespace) -> None:
    lock = open_lock(args.lock)  # else $ZARRLAKE_LOCK
    if lock is None:
        raise UsageError(
            "lock status needs --lock redis://... or $ZARRLAKE_LOCK (the lock service to ask)"
        )
    repo = open_repository(args)
    from zarrlake.locks import RedisLock  # importable: open_lock just built a lock with it

    if not isinstance(lock, RedisLock):
        raise UsageError("only a Redis lock service reports holders")
    holders = lock.status(repo.id)
    if args.json:
        print_json(
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
        say("no branch of this repository is locked")
        return
    print_table(
        ["BRANCH", "HOLDER", "TOKEN", "TTL", "WAITERS"],
        [
            [h.branch, h.holder, str(h.token), f"{h.ttl_ms / 1000:.1f}s", str(h.waiters)]
            for h in holders
        ],
    )
