"""``zarrlake.listing`` as a library: the records ``zarrlake ls`` and ``zarrlake log --json`` are
made of (the CLI's own tests check their output)."""

from __future__ import annotations

import datetime as dt

import pytest
import zarr

import zarrlake
from zarrlake.listing import NodeListing, commit_to_json, list_nodes, tree_key


@pytest.fixture
def repo() -> zarrlake.Repository:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    session = repo.writable_session("main")
    root = zarr.open_group(session.store, mode="w", attributes={"title": "demo"})
    root.create_group("a").create_array("x", shape=(8, 8), chunks=(4, 4), dtype="f8")
    root.create_group("a-b")
    root.create_array("sharded", shape=(100,), chunks=(10,), shards=(50,), dtype="i4")
    session.commit("layout", author="ana", metadata={"run": 7})
    return repo


def test_list_nodes_in_tree_order(repo: zarrlake.Repository) -> None:
    nodes = list_nodes(repo, "main")
    assert [n.path for n in nodes] == ["/", "/a", "/a/x", "/a-b", "/sharded"]
    assert nodes[0] == NodeListing("/", "group", {"title": "demo"})
    x = nodes[2]
    assert (x.type, x.shape, x.dtype, x.chunks, x.shards) == (
        "array",
        [8, 8],
        "float64",
        [4, 4],
        None,
    )
    assert (nodes[4].chunks, nodes[4].shards) == ([10], [50])
    assert list(x.to_json()) == ["path", "type", "shape", "dtype", "chunks", "shards", "attributes"]
    assert list(nodes[1].to_json()) == ["path", "type", "attributes"]
    assert [n.path for n in list_nodes(repo, "main", "a")] == ["/a", "/a/x"]


def test_list_nodes_errors() -> None:
    empty = zarrlake.Repository.create(zarrlake.Storage.memory())
    assert list_nodes(empty, "main") == []
    with pytest.raises(zarrlake.ZarrlakeError, match="no group or array at '/nope'"):
        list_nodes(empty, "main", "/nope")
    with pytest.raises(zarrlake.RefNotFound):
        list_nodes(empty, "no-such-branch")


def test_tree_key() -> None:
    paths = ["/a-c", "/a/b", "/", "/a"]
    assert sorted(paths, key=tree_key) == ["/", "/a", "/a/b", "/a-c"]


def test_commit_to_json(repo: zarrlake.Repository) -> None:
    head = next(iter(repo.log("main")))
    doc = commit_to_json(head)
    assert list(doc) == ["id", "parents", "message", "author", "time", "metadata"]
    assert (doc["message"], doc["author"], doc["metadata"]) == ("layout", "ana", {"run": 7})
    assert isinstance(doc["parents"], list) and len(doc["parents"]) == 1
    time = dt.datetime.fromisoformat(doc["time"])
    assert time.utcoffset() == dt.timedelta(0) and time == head.time
    assert doc["time"].endswith("+00:00") and len(doc["time"].split(".")[1]) == len("123456+00:00")
