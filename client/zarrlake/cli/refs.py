"""``zarrlake branch`` and ``zarrlake tag``: list refs, and create, delete or move them.

Listing is the default action. Every action that writes a ref takes the branch lock given with
``--lock`` (see :mod:`zarrlake.cli.connect`) and says what the ref was before.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zarrlake.cli.args import MAIN, Commands, add_json, add_lock, count
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import print_json, print_table, say, short_time

# -- branch --------------------------------------------------------------------------------------


def add_branch(commands: Commands) -> None:
    p = commands.add("branch", run_branch, "list, create, delete, reset or protect branches")
    add_json(p)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    add_json(actions.add_parser("list", help="list branches (the default)"))
    a = actions.add_parser("create", help="create a branch")
    a.add_argument("name", metavar="NAME")
    a.add_argument(
        "--from",
        dest="from_ref",
        default=MAIN,
        metavar="REF",
        help="branch, tag or snapshot id to start from (default: main)",
    )
    add_lock(a)
    a = actions.add_parser("delete", help="delete a branch (not main)")
    a.add_argument("name", metavar="NAME")
    add_lock(a)
    a = actions.add_parser("reset", help="point a branch at another ref")
    a.add_argument("name", metavar="NAME")
    a.add_argument("ref", metavar="REF")
    a.add_argument(
        "--expected",
        metavar="SNAPSHOT",
        default=None,
        help="only if the branch head is still this snapshot",
    )
    add_lock(a)
    add_json(actions.add_parser("protection", help="list protected branches and their rules"))
    a = actions.add_parser(
        "protect", help="protect a branch: merges only, no delete or reset, required checks"
    )
    a.add_argument("name", metavar="NAME")
    a.add_argument(
        "--allow-direct-commits",
        action="store_true",
        help="take direct commits too (default: merges only)",
    )
    a.add_argument("--allow-delete", action="store_true", help="let the branch be deleted")
    a.add_argument("--allow-reset", action="store_true", help="let the branch be reset")
    a.add_argument(
        "--check",
        dest="checks",
        action="append",
        default=[],
        metavar="CHECK",
        help="a check every commit or merge must pass (repeatable): required-attributes, "
        "array-rules, no-nan or an installed zarrlake.checks entry point",
    )
    a.add_argument(
        "--check-options",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='options by check, e.g. \'{"required-attributes": {"attributes": ["units"]}}\'',
    )
    a = actions.add_parser("unprotect", help="remove a branch's protection")
    a.add_argument("name", metavar="NAME")
    a = actions.add_parser("moves", help="a branch's moves: when, to what, by whom")
    a.add_argument("name", metavar="NAME")
    a.add_argument("-n", dest="limit", type=count, default=None, metavar="N", help="at most N")
    add_json(a)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of options by check name")
    return value


def run_branch(args: argparse.Namespace) -> None:
    action = args.action or "list"
    if action == "list":
        _print_refs(open_repository(args).list_branches(), "branch", args.json)
        return
    if action in ("protection", "protect", "unprotect"):
        _run_protection(args, action)
        return
    if action == "moves":
        _run_moves(args)
        return
    repo = open_repository(args, locked=True)
    if action == "create":
        head = repo.create_branch(args.name, args.from_ref)
        say(f"created branch {args.name} at {head}")
    elif action == "delete":
        old = repo.lookup_branch(args.name)
        repo.delete_branch(args.name)
        say(f"deleted branch {args.name} (was {old})")
    elif action == "reset":
        old = repo.lookup_branch(args.name)
        head = repo.reset_branch(args.name, args.ref, expected=args.expected)
        say(f"reset branch {args.name} to {head} (was {old})")


def _run_moves(args: argparse.Namespace) -> None:
    moves = open_repository(args).branch_moves(args.name, limit=args.limit)
    if args.json:
        print_json(moves)
        return
    rows = []
    for m in moves:
        by = m["by"]
        who = "-" if by is None else f"{by.get('identity')} ({by.get('role')})"
        rows.append([str(m["seq"]), short_time(m["time"]), m["snapshot"] or "(deleted)", who])
    print_table(["SEQ", "TIME", "SNAPSHOT", "BY"], rows)


def _run_protection(args: argparse.Namespace, action: str) -> None:
    repo = open_repository(args)
    if action == "protect":
        rule = repo.protect_branch(
            args.name,
            require_merge=not args.allow_direct_commits,
            allow_delete=args.allow_delete,
            allow_reset=args.allow_reset,
            required_checks=args.checks,
            check_options=args.check_options,
        )
        say(f"protected branch {args.name}: {rule.describe()}")
        return
    if action == "unprotect":
        had = args.name in repo.branch_protection()
        repo.unprotect_branch(args.name)
        say(f"unprotected branch {args.name}" if had else f"branch {args.name} was not protected")
        return
    rules = repo.branch_protection()
    if args.json:
        print_json({name: rule.to_json() for name, rule in rules.items()})
    elif rules:
        print_table(["BRANCH", "RULE"], [[n, r.describe()] for n, r in rules.items()])
    else:
        say("no protected branches")


# -- tag -----------------------------------------------------------------------------------------


def add_tag(commands: Commands) -> None:
    p = commands.add("tag", run_tag, "list, create or delete tags")
    add_json(p)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    add_json(actions.add_parser("list", help="list tags (the default)"))
    a = actions.add_parser("create", help="tag a ref")
    a.add_argument("name", metavar="NAME")
    a.add_argument("ref", metavar="REF")
    add_lock(a)
    a = actions.add_parser("delete", help="delete a tag (its name is never reused)")
    a.add_argument("name", metavar="NAME")
    add_lock(a)


def run_tag(args: argparse.Namespace) -> None:
    action = args.action or "list"
    if action == "list":
        _print_refs(open_repository(args).list_tags(), "tag", args.json)
        return
    repo = open_repository(args, locked=True)
    if action == "create":
        target = repo.create_tag(args.name, args.ref)
        say(f"created tag {args.name} at {target}")
    elif action == "delete":
        old = repo.lookup_tag(args.name)
        repo.delete_tag(args.name)
        say(f"deleted tag {args.name} (was {old})")


def _print_refs(refs: dict[str, str], kind: str, as_json: bool) -> None:
    if as_json:
        print_json(refs)
    elif refs:
        print_table([kind.upper(), "SNAPSHOT"], [[n, s] for n, s in refs.items()])
    else:
        say(f"no {kind}s")
