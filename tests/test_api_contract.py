"""The public API's names and keyword names, as the API contract documents them.

Keyword names are part of the contract: a caller writes ``Mirror(source_repo=repo, …)`` or
``to_zarrlake(ds_or_dask_array=ds, session=s)``, and a renamed parameter breaks them as surely as
a renamed function. This pins, for every documented signature, the leading parameters' names in
order and which documented ones are keyword-only; more parameters after them are welcome.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

import zarrlake
from zarrlake.dask import to_zarrlake
from zarrlake.mirror import Mirror
from zarrlake.spark import read_array, write_partitions

#: Documented as importable from the top level.
TOP_LEVEL = [
    "Storage", "Repository", "RepositoryConfig", "Session", "ForkedSession", "Changeset",
    "CommitInfo", "Diff", "Conflict", "UseOurs", "UseTheirs", "RedisLock", "LocalLock",
    "RetentionRules", "Keep", "ExpireReport", "GCReport", "CompactReport",
    "Mirror", "MirrorStatus", "to_zarrlake", "write_partitions", "read_array",
    "ZarrlakeError", "RepositoryExists", "RepositoryNotFound", "RefNotFound", "BranchExists",
    "TagExists", "ConflictError", "MergeConflictError", "SessionExpired", "ReadOnlyError",
    "LockTimeout", "CorruptObject", "UnsupportedFormat",
]  # fmt: skip

P, K = "positional-or-keyword", "keyword-only"

#: (callable, [(parameter, kind), …]) — the documented parameters, in order; ``K``: documented
#: as a keyword argument.
SIGNATURES: list[tuple[str, Callable[..., Any], list[tuple[str, str]]]] = [
    ("Storage.local", zarrlake.Storage.local, [("path", P)]),
    ("Storage.from_url", zarrlake.Storage.from_url, [("url", P)]),
    ("Storage.s3", zarrlake.Storage.s3, [
        ("bucket", P), ("prefix", P), ("endpoint_url", K), ("region", K),
        ("access_key_id", K), ("secret_access_key", K), ("session_token", K),
        ("allow_http", K),
    ]),
    ("Repository.create", zarrlake.Repository.create,
     [("storage", P), ("config", K), ("lock", K)]),
    ("Repository.open", zarrlake.Repository.open, [("storage", P), ("lock", K)]),
    ("Repository.open_or_create", zarrlake.Repository.open_or_create,
     [("storage", P), ("config", K), ("lock", K)]),
    ("Repository.exists", zarrlake.Repository.exists, [("storage", P)]),
    ("Repository.from_kubernetes", zarrlake.Repository.from_kubernetes,
     [("name", P), ("namespace", P)]),
    ("lookup_branch", zarrlake.Repository.lookup_branch, [("self", P), ("name", P)]),
    ("create_branch", zarrlake.Repository.create_branch,
     [("self", P), ("name", P), ("from_ref", P)]),
    ("reset_branch", zarrlake.Repository.reset_branch,
     [("self", P), ("name", P), ("to_ref", P), ("expected", K)]),
    ("delete_branch", zarrlake.Repository.delete_branch, [("self", P), ("name", P)]),
    ("lookup_tag", zarrlake.Repository.lookup_tag, [("self", P), ("name", P)]),
    ("create_tag", zarrlake.Repository.create_tag, [("self", P), ("name", P), ("ref", P)]),
    ("delete_tag", zarrlake.Repository.delete_tag, [("self", P), ("name", P)]),
    ("resolve", zarrlake.Repository.resolve, [("self", P), ("ref", P)]),
    ("log", zarrlake.Repository.log, [("self", P), ("ref", P), ("limit", K)]),
    ("diff", zarrlake.Repository.diff, [("self", P), ("from_ref", P), ("to_ref", P)]),
    ("merge", zarrlake.Repository.merge, [
        ("self", P), ("source", P), ("into", P), ("message", K), ("strategy", K), ("author", K),
    ]),
    ("readonly_session", zarrlake.Repository.readonly_session,
     [("self", P), ("ref", P), ("as_of", K)]),
    ("writable_session", zarrlake.Repository.writable_session,
     [("self", P), ("branch", P), ("ttl", K)]),
    ("transaction", zarrlake.Repository.transaction,
     [("self", P), ("branch", P), ("message", K), ("author", K)]),
    ("expire", zarrlake.Repository.expire, [("self", P), ("rules", P), ("dry_run", K)]),
    ("gc", zarrlake.Repository.gc,
     [("self", P), ("grace", K), ("dry_run", K), ("engine", K), ("spark", K)]),
    ("compact", zarrlake.Repository.compact,
     [("self", P), ("branch", K), ("pack_below_bytes", K), ("dry_run", K)]),
    ("Session.commit", zarrlake.Session.commit, [
        ("self", P), ("message", P), ("author", K), ("metadata", K), ("rebase", K),
        ("solver", K), ("allow_empty", K),
    ]),
    ("RedisLock", zarrlake.RedisLock,
     [("url", P), ("lease_s", K), ("wait_s", K), ("on_unavailable", K)]),
    ("LocalLock", zarrlake.LocalLock, [("path", P)]),
    ("Keep", zarrlake.Keep, [("last", P), ("days", P)]),
    ("RetentionRules", zarrlake.RetentionRules, [("default", P), ("branches", P)]),
    ("Mirror", Mirror, [
        ("source_repo", P), ("destination", P), ("branches", K), ("tags", K), ("copy", K),
    ]),
    ("Mirror.run", Mirror.run, [("self", P), ("interval", P)]),
    ("to_zarrlake", to_zarrlake,
     [("ds_or_dask_array", P), ("session", P), ("group", P), ("to_zarr_kwargs", "var-keyword")]),
    ("write_partitions", write_partitions, [
        ("rdd_or_df", P), ("repo", P), ("branch", K), ("writer", K), ("message", K),
    ]),
    ("read_array", read_array, [("spark", P), ("repo", P), ("path", P), ("ref", K)]),
]  # fmt: skip

_KINDS = {
    inspect.Parameter.POSITIONAL_OR_KEYWORD: P,
    inspect.Parameter.KEYWORD_ONLY: K,
    inspect.Parameter.VAR_KEYWORD: "var-keyword",
    inspect.Parameter.VAR_POSITIONAL: "var-positional",
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
}


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_documented_names_import_from_the_top_level(name: str) -> None:
    assert getattr(zarrlake, name) is not None


def test_documented_submodules_are_reachable_after_a_plain_import() -> None:
    code = (
        "import zarrlake; zarrlake.mirror.MirrorStatus; zarrlake.dask.to_zarrlake; "
        "zarrlake.spark.read_array; from zarrlake import Mirror, to_zarrlake"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    assert not hasattr(zarrlake, "NoSuchThing")


@pytest.mark.parametrize(
    ("label", "fn", "params"), SIGNATURES, ids=[label for label, _, _ in SIGNATURES]
)
def test_documented_signatures_keep_their_keyword_names(
    label: str, fn: Callable[..., Any], params: list[tuple[str, str]]
) -> None:
    target = fn.__init__ if isinstance(fn, type) else fn  # type: ignore[misc]
    found = [
        (p.name, _KINDS[p.kind])
        for p in inspect.signature(target).parameters.values()
        if not (isinstance(fn, type) and p.name == "self")
    ]
    documented = dict(params)
    # The documented parameters, in order. One documented as a keyword (``ref="main"``) may
    # also be passed by position; one documented by position must take both.
    assert [name for name, _ in found if name in documented] == list(documented), label
    for name, kind in found:
        if name in documented:
            allowed = (P, K) if documented[name] == K else (documented[name],)
            assert kind in allowed, f"{label}: {name} is {kind}"
    positional = [name for name, kind in found if kind == P]
    assert positional[: sum(kind == P for _, kind in params)] == [
        name for name, kind in params if kind == P
    ], label
