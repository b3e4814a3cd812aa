"""``zarrlake ls``: the groups and arrays of a ref, as :mod:`zarrlake.listing` reads them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zarrlake.cli.args import MAIN, Commands, add_json
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import print_json, print_table, say, shape_text
from zarrlake.listing import list_nodes


def add_ls(commands: Commands) -> None:
    p = commands.add("ls", run_ls, "list the groups and arrays at PATH")
    # main() fills in PATH when it follows an option (`ls URL --ref REF PATH`), and "/" when absent.
    p.add_argument("path", metavar="PATH", nargs="?", default=None, help="node path (default: /)")
    p.add_argument("--ref", default=MAIN, help="branch, tag or snapshot id (default: main)")
    add_json(p)


def run_ls(args: argparse.Namespace) -> None:
    nodes = list_nodes(open_repository(args), args.ref, args.path)
    if args.json:
        print_json([n.to_json() for n in nodes])
        return
    if not nodes:
        say("no groups or arrays")
        return
    headers = ["PATH", "TYPE", "SHAPE", "DTYPE", "CHUNKS"]
    sharded = any(n.shards for n in nodes)
    if sharded:
        headers.append("SHARDS")
    rows = []
    for n in nodes:
        row = [n.path, n.type, shape_text(n.shape), _dtype_text(n.dtype), shape_text(n.chunks)]
        if sharded:
            row.append(shape_text(n.shards))
        rows.append(row)
    print_table(headers, rows)


def _dtype_text(dtype: Any) -> str:
    # A v3 extension data type is a JSON object; show it as compact JSON.
    if dtype is None or isinstance(dtype, str):
        return dtype or ""
    return json.dumps(dtype, separators=(",", ":"))
