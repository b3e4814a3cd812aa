"""``zarrlake branch`` and ``zarrlake tag``: list refs, and create, delete or move them.

Listing is the default action. Every action that writes a ref takes the branch lock given with
``--lock`` (see :mod:`zarrlake.cli.connect`) and says what the ref was before.
"""

from __future__ import annotations

import argparse

from zarrlake.cli.args import MAIN, Commands, add_json, add_lock
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import print_json, print_table, say

# -- branch --------------------------------------------------------------------------------------


def add_branch(commands: Commands) -> None:
    p = commands.add("branch", run_branch, "list, create, delete or reset branches")
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


def run_branch(args: argparse.Namespace) -> None:
    action = args.action or "list"
    if action == "list":
        _print_refs(open_repository(args).list_branches(), "branch", args.json)
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
