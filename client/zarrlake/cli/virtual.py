"""``zarrlake virtual``: the virtual chunk containers of a repository, and importing kerchunk refs.

``containers`` (the default) lists where the repository's virtual refs may point; ``allow`` adds
a container (or replaces the one of that prefix), ``disallow`` takes one out (refs into it become
unreadable until it is put back; nothing is deleted). ``import`` writes the arrays of kerchunk
refs (a JSON file, or a Parquet reference directory) as virtual refs and commits them.
Credentials are never given here: readers give them at open (see :mod:`zarrlake.sources`).
"""

from __future__ import annotations

import argparse

from zarrlake.cli.args import MAIN, Commands, add_json
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import print_json, print_table, say
from zarrlake.config import VirtualContainer


def add_virtual(commands: Commands) -> None:
    p = commands.add(
        "virtual", run_virtual, "list or change virtual chunk containers; import kerchunk refs"
    )
    add_json(p)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    add_json(actions.add_parser("containers", help="list the virtual chunk containers (default)"))
    a = actions.add_parser(
        "allow", help="let virtual refs point under a URL prefix (s3, gs, az, http(s), file)"
    )
    a.add_argument("prefix", metavar="PREFIX", help="e.g. s3://bucket/archive/ (ends with /)")
    a.add_argument("--endpoint-url", default=None, help="an S3-compatible server, an emulator")
    a.add_argument("--region", default=None, help="the S3 region")
    a.add_argument("--account-name", default=None, help="the Azure storage account")
    a.add_argument(
        "--anonymous", action="store_true", help="read with unsigned requests (a public bucket)"
    )
    a = actions.add_parser("disallow", help="take a container out (its refs become unreadable)")
    a.add_argument("prefix", metavar="PREFIX")
    a = actions.add_parser("import", help="import kerchunk refs as virtual chunks, and commit")
    a.add_argument("refs", metavar="REFS", help="kerchunk refs: a JSON file or a Parquet dir")
    a.add_argument("--branch", default=MAIN, help="the branch to commit to (default: main)")
    a.add_argument("--group", default=None, help="the group to write the arrays under")
    a.add_argument("--message", "-m", default=None, help="the commit message")
    a.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not record each file's ETag or time (reads then cannot tell a changed file)",
    )
    add_json(a)


def run_virtual(args: argparse.Namespace) -> None:
    action = args.action or "containers"
    if action == "import":
        _run_import(args)
        return
    repo = open_repository(args)
    have = repo.config.virtual_containers
    if action == "allow":
        added = VirtualContainer(
            args.prefix,
            endpoint_url=args.endpoint_url,
            region=args.region,
            anonymous=args.anonymous,
            account_name=args.account_name,
        )
        was = next((c for c in have if c.url_prefix == added.url_prefix), None)
        if was == added:
            say(f"virtual container {added.url_prefix} was allowed already")
            return
        repo.allow_virtual_container(added)
        say(f"{'changed' if was else 'allowed'} virtual container {_describe(added)}")
        return
    if action == "disallow":
        if not any(c.url_prefix == args.prefix for c in have):
            say(f"virtual container {args.prefix} was not allowed")
            return
        repo.disallow_virtual_container(args.prefix)
        say(f"disallowed virtual container {args.prefix} (refs into it are now refused)")
        return
    if args.json:
        print_json([c.to_dict() for c in have])
    elif have:
        print_table(["PREFIX", "HOW"], [[c.url_prefix, _how(c)] for c in have])
    else:
        say("no virtual chunk containers")


def _how(container: VirtualContainer) -> str:
    fields = container.to_dict()
    fields.pop("url_prefix")
    return ", ".join(f"{k}={v}" if v is not True else k for k, v in fields.items()) or "-"


def _describe(container: VirtualContainer) -> str:
    how = _how(container)
    return container.url_prefix + ("" if how == "-" else f" ({how})")


def _run_import(args: argparse.Namespace) -> None:
    from zarrlake.virtual import import_kerchunk

    repo = open_repository(args)
    session = repo.writable_session(args.branch)
    report = import_kerchunk(args.refs, session, args.group, pin=args.pin)
    message = args.message or f"import kerchunk refs {args.refs}"
    snapshot = session.commit(message)
    if args.json:
        print_json({"snapshot": snapshot, **report.to_json()})
    else:
        say(
            f"committed {snapshot} to {args.branch}: {len(report.arrays)} arrays, "
            f"{report.virtual_refs} virtual refs into {report.sources} files, "
            f"{report.inline_chunks} inline chunks"
        )
