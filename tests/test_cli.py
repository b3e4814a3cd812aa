"""The ``zarrlake`` command line (API.md, CLI section): every command, its ``--json`` shapes, and
its one-line errors. Most tests call ``main()`` in-process; a few run the real executables."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from cli_helpers import Result, assert_one_line_error

ZARRLAKE_SCRIPT = Path(sys.executable).with_name("zarrlake")


def open_repo(url: str) -> zarrlake.Repository:
    return zarrlake.Repository.open(zarrlake.Storage.from_url(url))


def write(
    url: str,
    branch: str,
    message: str,
    fn: Callable[[Any], None],
    *,
    author: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> str:
    """Commit whatever ``fn(store)`` writes to ``branch`` through the Python API."""
    session = open_repo(url).writable_session(branch)
    fn(session.store)
    return session.commit(message, author=author, metadata=metadata)


def create_temp(store: Any) -> None:
    root = zarr.open_group(store, mode="w", attributes={"title": "demo"})
    group = root.create_group("climate").create_group("daily")
    temp = group.create_array(
        "temp", shape=(8, 8), chunks=(4, 4), dtype="f8", attributes={"units": "K"}
    )
    temp[:] = 1.0


def set_block(value: float, block: tuple[slice, slice] = (slice(0, 4), slice(0, 4))) -> Any:
    def fn(store: Any) -> None:
        zarr.open_array(store, path="climate/daily/temp", mode="r+")[block] = value

    return fn


def read_temp(url: str, ref: str) -> np.ndarray:
    store = open_repo(url).readonly_session(ref).store
    return zarr.open_array(store, path="climate/daily/temp", mode="r")[:]


def state(url: str) -> tuple[Any, ...]:
    """Everything a failed command must leave as it was: refs, history and (for a directory
    repository) the set of stored objects."""
    repo = open_repo(url)
    history = {b: [c.id for c in repo.log(b)] for b in repo.list_branches()}
    path = Path(url)
    files = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and ".tmp" not in p.parts
    )
    return repo.list_branches(), repo.list_tags(), history, files


@pytest.fixture
def url(tmp_path: Path, cli: Callable[..., Result]) -> str:
    """A fresh repository in a directory, created by ``zarrlake init``."""
    path = str(tmp_path / "repo")
    r = cli("init", path)
    assert r.code == 0, r.err
    return path


@pytest.fixture
def story(url: str) -> dict[str, str]:
    """main: temp written; dev: branched from it, one block changed."""
    main_head = write(url, "main", "add temperature", create_temp, author="ana")
    open_repo(url).create_branch("dev")
    dev_head = write(url, "dev", "warm the first block", set_block(2.0), author="bo")
    return {"url": url, "main": main_head, "dev": dev_head}


# -- init ----------------------------------------------------------------------------------------


def test_init_prints_the_repository_id(tmp_path: Path, cli: Callable[..., Result]) -> None:
    path = tmp_path / "r"
    r = cli("init", path.as_uri())  # file:// form
    assert r.code == 0 and r.err == ""
    repo_id = r.out.strip()
    assert r.out == repo_id + "\n"
    repo = zarrlake.Repository.open(zarrlake.Storage.local(path))
    assert repo.id == repo_id
    assert list(repo.list_branches()) == ["main"]


def test_init_twice_fails_and_changes_nothing(url: str, cli: Callable[..., Result]) -> None:
    before = state(url)
    msg = assert_one_line_error(cli("init", url), 1)
    assert "already exists" in msg
    assert state(url) == before


def test_init_memory_url(cli: Callable[..., Result]) -> None:
    r = cli("init", "memory://")
    assert r.code == 0 and len(r.out.strip()) == 36  # a uuid
    # memory:// lives only as long as the process: a second command sees no repository.
    assert "no zarrlake repository" in assert_one_line_error(cli("log", "memory://"), 1)


# -- log -----------------------------------------------------------------------------------------


def test_log_json(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    write(url, "main", "second\nwith a body", set_block(5.0), metadata={"run": 7, "tags": ["a"]})
    r = cli("log", url, "--json")
    assert r.code == 0 and r.err == ""
    entries = r.json()
    expected = list(open_repo(url).log("main"))
    assert [e["id"] for e in entries] == [c.id for c in expected]
    assert len(entries) == 3
    for entry, info in zip(entries, expected, strict=True):
        assert list(entry) == ["id", "parents", "message", "author", "time", "metadata"]
        assert entry["parents"] == list(info.parents)
        assert entry["message"] == info.message
        assert entry["author"] == info.author
        when = dt.datetime.fromisoformat(entry["time"])
        assert when.utcoffset() == dt.timedelta(0)
        assert when == info.time
    assert entries[0]["message"] == "second\nwith a body"
    assert entries[0]["metadata"] == {"run": 7, "tags": ["a"]}
    assert entries[1]["author"] == "ana"
    assert entries[2]["message"] == "Repository initialized" and entries[2]["parents"] == []


def test_log_ref_and_limit(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    r = cli("log", url, "--ref", "dev", "-n", "2", "--json")
    assert [e["id"] for e in r.json()] == [story["dev"], story["main"]]
    assert cli("log", url, "-n", "0", "--json").json() == []
    # A snapshot id is a ref too.
    r = cli("log", url, "--ref", story["main"], "--json")
    assert r.json()[0]["id"] == story["main"]


def test_log_human(story: dict[str, str], cli: Callable[..., Result]) -> None:
    r = cli("log", story["url"], "--ref", "dev")
    assert r.code == 0 and r.err == ""
    lines = r.out.splitlines()
    assert lines[0].split() == ["SNAPSHOT", "TIME", "AUTHOR", "MESSAGE"]
    body = [ln for ln in lines[1:] if ln.strip() and not set(ln.strip()) <= set("─-")]
    assert [ln.split()[0] for ln in body[:2]] == [story["dev"], story["main"]]
    assert "warm the first block" in body[0] and "bo" in body[0]
    assert "Repository initialized" in body[-1]
    assert all(ln == ln.rstrip() for ln in lines)


# -- branch --------------------------------------------------------------------------------------


def test_branch_list(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    expected = {"dev": story["dev"], "main": story["main"]}
    assert cli("branch", url, "list", "--json").json() == expected
    assert cli("branch", url, "--json").json() == expected  # list is the default
    assert cli("branch", url, "--json", "list").json() == expected
    r = cli("branch", url)
    assert r.code == 0
    rows = {ln.split()[0]: ln.split()[1] for ln in r.out.splitlines()[1:] if ln.strip()}
    assert rows == expected


def test_branch_create_delete_reset(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    r = cli("branch", url, "create", "feature/x")
    assert r.code == 0 and story["main"] in r.out
    r = cli("branch", url, "create", "from-dev", "--from", "dev")
    assert r.code == 0
    r = cli("branch", url, "create", "from-id", "--from", story["main"])
    assert r.code == 0
    repo = open_repo(url)
    assert repo.lookup_branch("feature/x") == story["main"]
    assert repo.lookup_branch("from-dev") == story["dev"]
    assert repo.lookup_branch("from-id") == story["main"]

    r = cli("branch", url, "reset", "feature/x", "dev")
    assert r.code == 0 and story["dev"] in r.out
    assert repo.lookup_branch("feature/x") == story["dev"]
    r = cli("branch", url, "reset", "feature/x", "main", "--expected", story["dev"])
    assert r.code == 0
    assert repo.lookup_branch("feature/x") == story["main"]

    r = cli("branch", url, "delete", "feature/x")
    assert r.code == 0 and "deleted branch feature/x" in r.out
    assert "feature/x" not in repo.list_branches()


def test_branch_reset_expected_mismatch(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    before = state(url)
    msg = assert_one_line_error(cli("branch", url, "reset", "dev", "main", "--expected", "main"), 1)
    assert "dev" in msg
    assert state(url) == before


def test_branch_create_existing(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    before = state(url)
    assert "already exists" in assert_one_line_error(cli("branch", url, "create", "dev"), 1)
    assert state(url) == before


# -- tag -----------------------------------------------------------------------------------------


def test_tags(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    r = cli("tag", url)
    assert r.code == 0 and r.out.strip() == "no tags"
    assert cli("tag", url, "list", "--json").json() == {}
    assert cli("tag", url, "create", "v1", "main").code == 0
    assert cli("tag", url, "create", "v2", story["dev"]).code == 0
    expected = {"v1": story["main"], "v2": story["dev"]}
    assert cli("tag", url, "list", "--json").json() == expected
    assert cli("tag", url, "--json").json() == expected
    human = cli("tag", url).out
    assert "TAG" in human and story["main"] in human and "v2" in human
    # Tags are refs for every other command.
    assert cli("log", url, "--ref", "v2", "--json").json()[0]["id"] == story["dev"]

    r = cli("tag", url, "delete", "v1")
    assert r.code == 0 and "deleted tag v1" in r.out
    assert cli("tag", url, "--json").json() == {"v2": story["dev"]}
    before = state(url)
    msg = assert_one_line_error(cli("tag", url, "create", "v1", "main"), 1)
    assert "v1" in msg  # deleted tag names are never reused
    assert assert_one_line_error(cli("tag", url, "create", "v2", "main"), 1).endswith(
        "already exists"
    )
    assert_one_line_error(cli("tag", url, "delete", "nope"), 1)
    assert state(url) == before


# -- diff ----------------------------------------------------------------------------------------


def test_diff_json(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    r = cli("diff", url, "main", "dev", "--json")
    assert r.code == 0
    assert r.json() == {
        "added_nodes": [],
        "removed_nodes": [],
        "changed_nodes": [],
        "changed_chunks": {"/climate/daily/temp": [[0, 0]]},
    }
    first = open_repo(url).log("main").__next__().parents[0]  # the initial, empty snapshot
    r = cli("diff", url, first, "dev", "--json")
    doc = r.json()
    assert doc == open_repo(url).diff(first, "dev").to_json()
    assert doc["added_nodes"] == ["/", "/climate", "/climate/daily", "/climate/daily/temp"]
    assert sorted(doc["changed_chunks"]["/climate/daily/temp"]) == [[0, 0], [0, 1], [1, 0], [1, 1]]
    empty = cli("diff", url, "main", "main", "--json").json()
    assert empty == {
        "added_nodes": [],
        "removed_nodes": [],
        "changed_nodes": [],
        "changed_chunks": {},
    }


def test_diff_human(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    write(url, "dev", "retitle", lambda s: zarr.open_group(s, mode="r+").attrs.update(title="x"))
    r = cli("diff", url, "main", "dev")
    assert r.code == 0
    rows = [ln.split() for ln in r.out.splitlines()[1:] if ln.strip()]
    assert rows == [
        ["changed", "/"],
        ["data", "/climate/daily/temp", "1", "chunk:", "[0,0]"],
    ]
    assert cli("diff", url, "dev", "dev").out == "no changes\n"


# -- merge ---------------------------------------------------------------------------------------


def test_merge(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    write(url, "main", "cool the last block", set_block(0.0, (slice(4, 8), slice(4, 8))))
    r = cli("merge", url, "dev", "main", "--json", "--message", "bring dev", "--author", "cy")
    assert r.code == 0 and r.err == ""
    doc = r.json()
    assert list(doc) == ["snapshot"]
    repo = open_repo(url)
    assert doc["snapshot"] == repo.lookup_branch("main")
    head = next(repo.log("main"))
    assert head.message == "bring dev" and head.author == "cy"
    assert head.parents[1] == story["dev"]
    data = read_temp(url, "main")
    assert (data[:4, :4] == 2.0).all() and (data[4:, 4:] == 0.0).all() and data[0, 7] == 1.0

    r = cli("merge", url, "dev", "main")
    assert r.code == 0 and "already contains" in r.out
    assert open_repo(url).lookup_branch("main") == doc["snapshot"]
    r = cli("log", url)
    assert "(merge)" in r.out.splitlines()[1]


def test_merge_human(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    r = cli("merge", url, "dev", "main")
    assert r.code == 0
    assert r.out == f"merged dev into main: {open_repo(url).lookup_branch('main')}\n"


def test_merge_conflict(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    write(url, "main", "main writes the same block", set_block(9.0))
    before = state(url)
    for extra in ([], ["--json"]):
        msg = assert_one_line_error(cli("merge", url, "dev", "main", *extra), 1)
        assert "conflict" in msg and "/climate/daily/temp[0,0]" in msg
        assert "'dev'" in msg and "'main'" in msg
    assert state(url) == before

    assert cli("merge", url, "dev", "main", "--strategy", "dest-wins").code == 0
    assert read_temp(url, "main")[0, 0] == 9.0
    open_repo(url).reset_branch("main", before[0]["main"])
    assert cli("merge", url, "dev", "main", "--strategy", "source-wins").code == 0
    assert read_temp(url, "main")[0, 0] == 2.0


def test_merge_bad_strategy(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    before = state(url)
    msg = assert_one_line_error(cli("merge", url, "dev", "main", "--strategy", "ours"), 2)
    assert "--strategy" in msg and "source-wins" in msg
    assert state(url) == before


def test_merge_into_a_tag_or_unknown_branch(
    story: dict[str, str], cli: Callable[..., Result]
) -> None:
    url = story["url"]
    open_repo(url).create_tag("v1", "main")
    before = state(url)
    assert "branch not found" in assert_one_line_error(cli("merge", url, "dev", "v1"), 1)
    assert "not found" in assert_one_line_error(cli("merge", url, "nope", "main"), 1)
    assert state(url) == before


# -- ls ------------------------------------------------------------------------------------------


def build_tree(store: Any) -> None:
    create_temp(store)
    root = zarr.open_group(store, mode="r+")
    root.create_array("sharded", shape=(100,), chunks=(10,), shards=(50,), dtype="i4")
    root.create_group("a-b")  # sorts between 'a' and 'a/...' by characters, not by tree
    a = root.create_group("a")
    a.create_array("z", shape=(3,), dtype=str)
    old = zarr.open_group(store, path="legacy", mode="w", zarr_format=2, attributes={"v": 2})
    old.create_array("x", shape=(6, 2), chunks=(3, 2), dtype="<i2")


def test_ls_json(url: str, cli: Callable[..., Result]) -> None:
    write(url, "main", "tree", build_tree)
    r = cli("ls", url, "--json")
    assert r.code == 0 and r.err == ""
    nodes = r.json()
    assert [n["path"] for n in nodes] == [
        "/",
        "/a",
        "/a/z",
        "/a-b",
        "/climate",
        "/climate/daily",
        "/climate/daily/temp",
        "/legacy",
        "/legacy/x",
        "/sharded",
    ]
    by_path = {n["path"]: n for n in nodes}
    assert by_path["/"] == {"path": "/", "type": "group", "attributes": {"title": "demo"}}
    assert by_path["/climate/daily/temp"] == {
        "path": "/climate/daily/temp",
        "type": "array",
        "shape": [8, 8],
        "dtype": "float64",
        "chunks": [4, 4],
        "shards": None,
        "attributes": {"units": "K"},
    }
    assert by_path["/sharded"]["chunks"] == [10] and by_path["/sharded"]["shards"] == [50]
    assert by_path["/a/z"]["dtype"] == "string"
    assert by_path["/legacy"] == {"path": "/legacy", "type": "group", "attributes": {"v": 2}}
    assert by_path["/legacy/x"]["shape"] == [6, 2] and by_path["/legacy/x"]["chunks"] == [3, 2]
    assert by_path["/legacy/x"]["dtype"] == "<i2"
    for n in nodes:
        keys = ["path", "type", "shape", "dtype", "chunks", "shards", "attributes"]
        assert list(n) == (keys if n["type"] == "array" else ["path", "type", "attributes"])


def test_ls_path_and_ref(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    write(url, "dev", "more", lambda s: zarr.open_group(s, path="climate/monthly", mode="w"))
    paths = [n["path"] for n in cli("ls", url, "climate", "--json").json()]
    assert paths == ["/climate", "/climate/daily", "/climate/daily/temp"]
    for argv in (
        ["ls", url, "--ref", "dev", "/climate", "--json"],  # options before PATH (API.md's order)
        ["ls", url, "/climate/", "--ref", "dev", "--json"],
    ):
        paths = [n["path"] for n in cli(*argv).json()]
        assert paths == ["/climate", "/climate/daily", "/climate/daily/temp", "/climate/monthly"]
    nodes = cli("ls", url, "climate/daily/temp", "--json").json()
    assert [n["path"] for n in nodes] == ["/climate/daily/temp"]
    # An older version by snapshot id: the repository was empty.
    first = open_repo(url).log("main").__next__().parents[0]
    assert cli("ls", url, "--ref", first, "--json").json() == []
    assert cli("ls", url, "--ref", first).out == "no groups or arrays\n"


def test_ls_human(url: str, cli: Callable[..., Result]) -> None:
    write(url, "main", "tree", build_tree)
    r = cli("ls", url)
    assert r.code == 0
    lines = r.out.splitlines()
    assert lines[0].split() == ["PATH", "TYPE", "SHAPE", "DTYPE", "CHUNKS", "SHARDS"]
    rows = {ln.split()[0]: ln for ln in lines[1:] if ln.strip()}
    assert rows["/climate/daily/temp"].split() == [
        "/climate/daily/temp",
        "array",
        "(8,",
        "8)",
        "float64",
        "(4,",
        "4)",
    ]
    assert rows["/sharded"].split()[-2:] == ["(10,)", "(50,)"]
    assert rows["/climate"].split() == ["/climate", "group"]


def test_ls_implicit_group(url: str, cli: Callable[..., Result]) -> None:
    def fn(store: Any) -> None:
        create_temp(store)
        store.delete_sync("climate/zarr.json")  # /climate now exists only as a directory

    write(url, "main", "implicit", fn)
    paths = [n["path"] for n in cli("ls", url, "--json").json()]
    assert paths == ["/", "/climate/daily", "/climate/daily/temp"]
    paths = [n["path"] for n in cli("ls", url, "climate", "--json").json()]
    assert paths == ["/climate/daily", "/climate/daily/temp"]


def test_ls_missing_path_and_corrupt_metadata(url: str, cli: Callable[..., Result]) -> None:
    write(url, "main", "tree", create_temp)
    assert "'/nope'" in assert_one_line_error(cli("ls", url, "nope"), 1)
    assert "ref not found" in assert_one_line_error(cli("ls", url, "--ref", "nope"), 1)

    def corrupt(store: Any) -> None:
        from zarr.core.buffer import default_buffer_prototype

        store.set_sync("bad/zarr.json", default_buffer_prototype().buffer.from_bytes(b"{oops"))

    write(url, "main", "corrupt", corrupt)
    msg = assert_one_line_error(cli("ls", url), 1)
    assert "bad/zarr.json" in msg


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["log", "{url}"],
        ["branch", "{url}"],
        ["branch", "{url}", "create", "x"],
        ["tag", "{url}", "create", "v", "main"],
        ["diff", "{url}", "main", "main"],
        ["merge", "{url}", "a", "main"],
        ["ls", "{url}"],
    ],
)
def test_no_repository(tmp_path: Path, cli: Callable[..., Result], argv: list[str]) -> None:
    missing = tmp_path / "nothing-here"
    r = cli(*[a.format(url=missing) for a in argv])
    assert "no zarrlake repository" in assert_one_line_error(r, 1)
    assert not missing.exists()  # looking did not create anything


@pytest.mark.parametrize("url", ["nosuch://bucket/x", "s3://", "gs://", "az://", "ftp://host/p"])
def test_bad_url(cli: Callable[..., Result], url: str) -> None:
    msg = assert_one_line_error(cli("log", url), 2)
    assert url.split(":")[0] in msg or "bucket" in msg or "container" in msg


@pytest.mark.parametrize(
    "argv",
    [
        ["branch", "{url}", "create", "bad name"],
        ["branch", "{url}", "create", "a..b"],
        ["branch", "{url}", "create", "x/"],
        ["branch", "{url}", "delete", "bad name"],
        ["branch", "{url}", "reset", "a..b", "main"],
        ["tag", "{url}", "create", "v 1", "main"],
        ["tag", "{url}", "delete", "bad\tname"],
        ["merge", "{url}", "dev", "bad name"],
    ],
)
def test_invalid_names(story: dict[str, str], cli: Callable[..., Result], argv: list[str]) -> None:
    url = story["url"]
    before = state(url)
    msg = assert_one_line_error(cli(*[a.format(url=url) for a in argv]), 2)
    assert "invalid" in msg and "name" in msg
    assert state(url) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["log", "{url}", "--ref", "nope"],
        ["diff", "{url}", "main", "nope"],
        ["diff", "{url}", "01ARZ3NDEKTSV4RRFFQ69G5FAV", "main"],  # well-formed, absent snapshot
        ["branch", "{url}", "create", "x", "--from", "nope"],
        ["branch", "{url}", "reset", "dev", "nope"],
        ["branch", "{url}", "delete", "nope"],
        ["tag", "{url}", "create", "v1", "nope"],
        ["merge", "{url}", "nope", "main"],
        ["ls", "{url}", "--ref", "nope"],
    ],
)
def test_unknown_ref(story: dict[str, str], cli: Callable[..., Result], argv: list[str]) -> None:
    url = story["url"]
    before = state(url)
    msg = assert_one_line_error(cli(*[a.format(url=url) for a in argv]), 1)
    assert "not found" in msg
    assert state(url) == before


def test_delete_main(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    before = state(url)
    assert "main" in assert_one_line_error(cli("branch", url, "delete", "main"), 1)
    assert state(url) == before


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate", "{url}"],
        ["log"],
        ["log", "{url}", "-n", "-1"],
        ["log", "{url}", "-n", "many"],
        ["log", "{url}", "--bogus"],
        ["log", "{url}", "extra"],
        ["branch", "{url}", "rename", "a", "b"],
        ["branch", "{url}", "create"],
        ["branch", "{url}", "reset", "dev"],
        ["tag", "{url}", "create", "v1"],
        ["diff", "{url}", "main"],
        ["merge", "{url}", "dev"],
        ["ls", "{url}", "a", "b"],
        ["init"],
    ],
)
def test_usage_errors(story: dict[str, str], cli: Callable[..., Result], argv: list[str]) -> None:
    url = story["url"]
    before = state(url)
    assert_one_line_error(cli(*[a.format(url=url) for a in argv]), 2)
    assert state(url) == before


def test_help_and_version(cli: Callable[..., Result]) -> None:
    r = cli("--help")
    assert r.code == 0 and "merge" in r.out and "ls" in r.out
    r = cli("merge", "--help")
    assert r.code == 0 and "--strategy" in r.out and "--lock" in r.out
    r = cli("--version")
    assert r.code == 0 and r.out.strip() == f"zarrlake {zarrlake.__version__}"


def test_corrupt_repository_marker(url: str, cli: Callable[..., Result]) -> None:
    # The published root holds the marker's record: a damaged root alone is read past (the
    # marker and the journals say it all), a damaged marker too, both is a one-line error.
    (Path(url) / "root").write_bytes(b"definitely not a zarrlake object")
    assert cli("log", url).code == 0
    (Path(url) / "repo").write_bytes(b"definitely not a zarrlake object")
    assert_one_line_error(cli("log", url), 1)


# -- locks ---------------------------------------------------------------------------------------


def test_lock_directory(story: dict[str, str], tmp_path: Path, cli: Callable[..., Result]) -> None:
    url = story["url"]
    locks = tmp_path / "locks"
    repo_id = open_repo(url).id
    assert cli("merge", url, "dev", "main", "--lock", str(locks)).code == 0
    assert (locks / repo_id / "main.lock").exists()  # the merge commit took main's lock
    assert cli("--lock", locks.as_uri(), "branch", url, "reset", "dev", "main").code == 0
    assert (locks / repo_id / "dev.lock").exists()
    assert open_repo(url).lookup_branch("dev") == open_repo(url).lookup_branch("main")
    # Commands that move no ref accept a global --lock and do not use it.
    assert cli("--lock", "bogus://x", "log", url, "-n", "1").code == 0


def test_bad_lock_url(story: dict[str, str], cli: Callable[..., Result]) -> None:
    url = story["url"]
    before = state(url)
    for argv in (
        ["merge", url, "dev", "main", "--lock", "bogus://x"],
        ["--lock", "bogus://x", "tag", url, "create", "v1", "main"],
        ["branch", url, "delete", "dev", "--lock", "bogus://x"],
    ):
        assert "bogus://x" in assert_one_line_error(cli(*argv), 2)
    assert state(url) == before


# -- real processes ------------------------------------------------------------------------------


def run_process(*argv: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m zarrlake ARGS...``, optionally after ``prelude`` ran in the same interpreter."""
    code = f"{prelude}\nimport runpy, sys\nsys.argv = ['zarrlake', *sys.argv[1:]]\n"
    code += "runpy.run_module('zarrlake', run_name='__main__')"
    cmd = (
        [sys.executable, "-m", "zarrlake", *argv]
        if not prelude
        else [sys.executable, "-c", code, *argv]
    )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_python_m_zarrlake(tmp_path: Path) -> None:
    path = str(tmp_path / "r")
    p = run_process("init", path)
    assert p.returncode == 0 and p.stderr == ""
    repo_id = p.stdout.strip()
    assert open_repo(path).id == repo_id
    write(path, "main", "add temperature", create_temp)
    p = run_process("branch", path, "create", "dev")
    assert p.returncode == 0
    p = run_process("ls", path, "--json")
    assert "/climate/daily/temp" in [n["path"] for n in json.loads(p.stdout)]
    p = run_process("branch", path, "delete", "main")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == "zarrlake: error: the main branch cannot be deleted\n"


def test_python_m_zarrlake_cli() -> None:
    """The package runs as ``python -m zarrlake.cli`` too, as the module did."""
    p = subprocess.run(
        [sys.executable, "-m", "zarrlake.cli", "--version"], capture_output=True, text=True
    )
    assert (p.returncode, p.stdout, p.stderr) == (0, f"zarrlake {zarrlake.__version__}\n", "")


def test_console_script(tmp_path: Path) -> None:
    assert ZARRLAKE_SCRIPT.exists(), "pip install -e . creates the zarrlake script"
    path = str(tmp_path / "r")
    p = subprocess.run([ZARRLAKE_SCRIPT, "init", path], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and open_repo(path).id == p.stdout.strip()
    p = subprocess.run(
        [ZARRLAKE_SCRIPT, "merge", path, "main", "main", "--strategy", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("zarrlake: error: ")
    p = subprocess.run(
        [ZARRLAKE_SCRIPT, "log", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert p.returncode == 1
    assert (
        p.stderr
        == f"zarrlake: error: no zarrlake repository at {(tmp_path / 'missing').as_uri()}\n"
    )


def test_closed_stdout_is_not_a_traceback(story: dict[str, str]) -> None:
    p = subprocess.Popen(
        [ZARRLAKE_SCRIPT, "log", story["url"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # like `zarrlake log URL | head -0`: the reader is gone before any output
    err = p.stderr.read()
    assert p.wait(120) == 1
    assert "Traceback" not in err and "Exception" not in err


def test_plain_text_without_rich(story: dict[str, str]) -> None:
    no_rich = "import sys; sys.modules['rich'] = None"
    p = run_process("branch", story["url"], prelude=no_rich)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "BRANCH  SNAPSHOT",
        f"dev     {story['dev']}",
        f"main    {story['main']}",
    ]
    p = run_process("log", story["url"], "-n", "0", prelude=no_rich)
    assert p.stdout == "SNAPSHOT  TIME  AUTHOR  MESSAGE\n"
    p = run_process("ls", story["url"], "climate", prelude=no_rich)
    assert p.stdout.splitlines() == [
        "PATH                 TYPE   SHAPE   DTYPE    CHUNKS",
        "/climate             group",
        "/climate/daily       group",
        "/climate/daily/temp  array  (8, 8)  float64  (4, 4)",
    ]


def test_locks_missing_from_the_build(story: dict[str, str]) -> None:
    url = story["url"]
    before = state(url)
    p = run_process(
        "merge",
        url,
        "dev",
        "main",
        "--lock",
        "redis://127.0.0.1:1",
        prelude="import sys; sys.modules['zarrlake.locks'] = None",
    )
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == "zarrlake: error: locks are not available in this build\n"
    assert state(url) == before


# -- the whole story, and S3 -----------------------------------------------------------------------


def test_full_story(tmp_path: Path, cli: Callable[..., Result]) -> None:
    url = str(tmp_path / "lake")
    repo_id = cli("init", url).out.strip()
    write(url, "main", "add temperature", create_temp, author="ana")
    assert cli("branch", url, "create", "dev").code == 0
    write(url, "dev", "warm", set_block(2.0), author="bo")
    write(url, "main", "cool", set_block(0.5, (slice(4, 8), slice(0, 4))), author="ana")

    diff = cli("diff", url, "main", "dev", "--json").json()
    assert diff["changed_chunks"] == {"/climate/daily/temp": [[0, 0], [1, 0]]}

    merged = cli("merge", url, "dev", "main", "--json").json()["snapshot"]
    assert cli("tag", url, "create", "release-1", "main").code == 0
    assert cli("tag", url, "--json").json() == {"release-1": merged}
    assert cli("branch", url, "delete", "dev").code == 0
    assert cli("branch", url, "--json").json() == {"main": merged}

    log = cli("log", url, "--ref", "release-1", "--json").json()
    assert log[0]["id"] == merged and len(log[0]["parents"]) == 2
    assert [e["message"] for e in log] == [
        "Merge dev into main",
        "cool",
        "warm",
        "add temperature",
        "Repository initialized",
    ]
    assert log[0]["metadata"]["merge"]["source"] == "dev"
    data = read_temp(url, "release-1")
    assert data[0, 0] == 2.0 and data[4, 0] == 0.5 and data[7, 7] == 1.0
    assert cli("diff", url, "release-1", "main", "--json").json()["changed_chunks"] == {}
    assert open_repo(url).id == repo_id


@pytest.mark.s3
def test_s3(moto_s3: Any, cli: Callable[..., Result]) -> None:
    url = moto_s3.url()
    repo_id = cli("init", url).out.strip()
    assert open_repo(url).id == repo_id
    write(url, "main", "add temperature", create_temp)
    assert cli("branch", url, "create", "dev").code == 0
    write(url, "dev", "warm", set_block(3.0))
    assert cli("merge", url, "dev", "main", "--json").code == 0
    assert read_temp(url, "main")[0, 0] == 3.0
    nodes = cli("ls", url, "--ref", "main", "climate", "--json").json()
    assert [n["path"] for n in nodes] == ["/climate", "/climate/daily", "/climate/daily/temp"]
    assert [e["message"] for e in cli("log", url, "-n", "2", "--json").json()] == [
        "Merge dev into main",
        "warm",
    ]
    missing = moto_s3.url("never-created")
    assert "no zarrlake repository" in assert_one_line_error(cli("log", missing), 1)
    before = open_repo(url).list_branches()
    assert_one_line_error(cli("branch", url, "delete", "main"), 1)
    assert open_repo(url).list_branches() == before
