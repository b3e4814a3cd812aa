"""``/api/v1/``: refs, paginated log, one commit, a diff of two refs, the tree of a ref — each
checked against what the repository itself says (``list_branches``, ``log``, ``diff``, the Zarr
metadata written), over a real server; errors are JSON, one line, 4xx; the token guards every
route but the probes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.serve import Limits

# The fixtures' types (conftest.py): a populated repository, a running server.
Lake = LiveServer = Any


def get_json(server: LiveServer, path: str, **headers: str) -> tuple[int, Any]:
    status, got_headers, body = server.get(path, **headers)
    assert got_headers["content-type"].startswith("application/json"), (path, body)
    return status, json.loads(body)


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Lake:
    """A repository with 9 commits on main, a branch ``release/v1`` with one more, tags."""
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path_factory.mktemp("h")))
    ids = []
    for i in range(9):
        session = repo.writable_session("main")
        if i == 0:
            root = zarr.open_group(session.store, mode="w", attributes={"n": 0})
            root.create_array("a", shape=(8,), chunks=(2,), dtype="i4", fill_value=0)
            root.create_group("g").create_array("b", shape=(4, 4), chunks=(2, 2), dtype="f4")
        else:
            root = zarr.open_group(session.store, mode="r+")
            root["a"][i % 8] = i  # one chunk per commit
            root.attrs["n"] = i
        ids.append(session.commit(f"commit {i}\n\nbody of {i}", author=f"author{i % 2}"))
    repo.create_tag("first", ids[0])
    repo.create_branch("release/v1", ids[4])
    session = repo.writable_session("release/v1")
    root = zarr.open_group(session.store, mode="r+")
    root["g/b"][0:2, 0:4] = 1.5  # two chunks
    root.create_array("g/new", shape=(3,), chunks=(3,), dtype="u1")
    del root["a"]
    release = session.commit("release work", metadata={"pr": 7})
    repo.create_tag("v1.0", release)

    class History:
        pass

    h: Any = History()
    h.repo, h.ids, h.release = repo, ids, release
    return h


@pytest.fixture(scope="module")
def api(history: Lake, serve_repo: Any) -> Iterator[LiveServer]:
    with serve_repo(history.repo, limits=Limits(max_log_limit=4)) as server:
        yield server


def test_refs_name_every_branch_and_tag_with_their_heads(history: Lake, api: LiveServer) -> None:
    status, doc = get_json(api, "/api/v1/refs")
    assert status == 200
    repo = history.repo
    assert doc["id"] == repo.id
    assert {b["name"]: b["head"] for b in doc["branches"]} == repo.list_branches()
    assert {t["name"]: t["snapshot"] for t in doc["tags"]} == repo.list_tags()
    main = next(b for b in doc["branches"] if b["name"] == "main")
    head = next(iter(repo.log("main", limit=1)))
    assert main["short"] == head.id[:12]
    assert main["message"] == "commit 8"  # the first line
    assert main["author"] == "author0"
    assert main["time"] == head.time.isoformat(timespec="microseconds")
    tag = next(t for t in doc["tags"] if t["name"] == "first")
    assert tag["snapshot"] == history.ids[0] and tag["time"].endswith("+00:00")


def test_log_pages_follow_one_history_while_the_branch_moves(
    tmp_path: Any, serve_repo: Any
) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    for i in range(7):
        session = repo.writable_session("main")
        zarr.open_group(session.store, mode="a").attrs["i"] = i
        session.commit(f"c{i}")
    expected = [c.id for c in repo.log("main")]  # 7 commits and the initial one
    with serve_repo(repo) as server:
        status, page = get_json(server, "/api/v1/log/main?limit=3")
        assert status == 200 and page["ref"] == "main" and page["head"] == expected[0]
        seen = [c["id"] for c in page["commits"]]
        # The branch moves between pages: the pages go on through the history they started.
        session = repo.writable_session("main")
        zarr.open_group(session.store, mode="a").attrs["i"] = "moved"
        moved = session.commit("moved")
        while page["next"]:
            status, page = get_json(server, f"/api/v1/log/main?limit=3&cursor={page['next']}")
            assert status == 200
            seen.extend(c["id"] for c in page["commits"])
        assert seen == expected
        # A new first page sees the new head.
        assert get_json(server, "/api/v1/log/main?limit=1")[1]["commits"][0]["id"] == moved


def test_a_next_page_goes_on_with_the_walk_the_page_before_stopped(tmp_path: Any) -> None:
    from zarrlake.serve.model import WALK_AHEAD_PAGES, Walks, log_page

    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    for i in range(60):  # a merge among them: the walk's order is not one line's
        branch = "side" if i == 30 else "main"
        if i == 30:
            repo.create_branch("side", "main")
        session = repo.writable_session(branch)
        zarr.open_group(session.store, mode="a").attrs["i"] = i
        session.commit(f"c{i}")
        if i == 30:
            repo.merge("side", "main")
    expected = [c.id for c in repo.log("main")]
    walks, walked = Walks(4), []
    log = repo.log

    def counted(ref: str = "main", *, limit: int | None = None) -> Any:
        walked.append(limit)
        return log(ref, limit=limit)

    repo.log = counted  # type: ignore[method-assign]  # the real log(), its walks counted
    seen, cursor = [], None
    while True:
        page = log_page(repo, "main", cursor=cursor, limit=4, walks=walks)
        seen.extend(c["id"] for c in page["commits"])
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == expected  # the same commits, in the same order, once each
    pages = -(-len(expected) // 4)
    # A walk from the head serves WALK_AHEAD_PAGES + 1 pages: so many walks, not one a page.
    assert len(walked) == -(-pages // (WALK_AHEAD_PAGES + 1)) < pages
    # A cursor whose walk is gone (another server, an old link) walks again: the same page.
    second = log_page(repo, "main", limit=4)["next"]
    again = log_page(repo, "main", cursor=second, limit=4)
    assert [c["id"] for c in again["commits"]] == expected[4:8]


def test_a_walk_kept_across_an_expiry_is_not_used(tmp_path: Any) -> None:
    from zarrlake.serve.model import Walks, log_page

    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    for i in range(40):
        session = repo.writable_session("main")
        zarr.open_group(session.store, mode="a").attrs["i"] = i
        session.commit(f"c{i}")
    walks = Walks(4)
    first = log_page(repo, "main", limit=10, walks=walks)
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=15)))
    repo.gc(grace="0s", force=True)
    # As a page walked afresh says: what expiry took out is not shown, history ends there.
    kept = log_page(repo, "main", cursor=first["next"], limit=10, walks=walks)
    fresh = log_page(repo, "main", cursor=first["next"], limit=10)
    assert kept == fresh and len(kept["commits"]) == 5 and kept["next"] is None


def test_log_commits_are_the_repositorys(history: Lake, api: LiveServer) -> None:
    status, page = get_json(api, "/api/v1/log/main")
    assert status == 200
    assert len(page["commits"]) == 4  # this server's max_log_limit caps the default 50
    for got, info in zip(page["commits"], history.repo.log("main", limit=4), strict=True):
        assert got == {
            "id": info.id,
            "short": info.id[:12],
            "parents": list(info.parents),
            "message": info.message,
            "author": info.author,
            "time": info.time.isoformat(timespec="microseconds"),
            "metadata": info.metadata,
        }
    assert get_json(api, "/api/v1/log/main?limit=100000")[1]["next"] is not None
    # A branch whose name holds a '/', written plainly or encoded.
    for ref in ("release/v1", "release%2Fv1"):
        status, page = get_json(api, f"/api/v1/log/{ref}?limit=2")
        assert status == 200 and page["commits"][0]["id"] == history.release


def test_one_commit_with_its_parents(history: Lake, api: LiveServer) -> None:
    sid = history.ids[3]
    for ref in (sid, sid[:12], sid.lower()):
        status, doc = get_json(api, f"/api/v1/commit/{ref}")
        assert status == 200
        assert doc["id"] == sid and doc["message"] == "commit 3\n\nbody of 3"
        assert doc["parents"] == [history.ids[2]]
        assert doc["parent_commits"] == [
            {
                "id": history.ids[2],
                "short": history.ids[2][:12],
                "message": "commit 2",
                "time": doc["parent_commits"][0]["time"],
            }
        ]
    status, doc = get_json(api, "/api/v1/commit/v1.0")
    assert doc["id"] == history.release and doc["metadata"] == {"pr": 7}


def test_diff_counts_nodes_and_chunks_as_repository_diff_does(
    history: Lake, api: LiveServer
) -> None:
    status, doc = get_json(api, "/api/v1/diff/first...v1.0")
    assert status == 200
    diff = history.repo.diff("first", "v1.0")
    assert doc["base"] == history.ids[0] and doc["head"] == history.release
    by_path = {n["path"]: n for n in doc["nodes"]}
    assert by_path["/g/new"] == {
        "path": "/g/new",
        "kind": "array",
        "change": "added",
        "chunks_changed": 0,
        "metadata_changed": False,
    }
    assert by_path["/a"]["change"] == "removed" and by_path["/a"]["kind"] == "array"
    assert by_path["/g/b"]["change"] == "changed"
    assert by_path["/g/b"]["chunks_changed"] == len(diff.changed_chunks["/g/b"]) == 2
    assert by_path["/g/b"]["metadata_changed"] is False
    assert set(by_path) == set(diff.added_nodes | diff.removed_nodes | diff.changed_nodes) | set(
        diff.changed_chunks
    )
    assert doc["totals"]["added"] == len(diff.added_nodes)
    assert doc["totals"]["removed"] == len(diff.removed_nodes)
    assert doc["totals"]["chunks_changed"] == sum(len(c) for c in diff.changed_chunks.values())

    # Along main: root attributes (metadata) and one chunk of /a changed per commit.
    _, doc = get_json(api, f"/api/v1/diff/{history.ids[1]}...{history.ids[2]}")
    by_path = {n["path"]: n for n in doc["nodes"]}
    assert by_path["/"] == {
        "path": "/",
        "kind": "group",
        "change": "changed",
        "chunks_changed": 0,
        "metadata_changed": True,
    }
    assert by_path["/a"]["chunks_changed"] == 1 and not by_path["/a"]["metadata_changed"]
    # Nothing between a ref and itself.
    assert get_json(api, "/api/v1/diff/main...main")[1]["nodes"] == []


def test_tree_shows_groups_arrays_and_their_metadata(history: Lake, api: LiveServer) -> None:
    status, root = get_json(api, "/api/v1/tree/main")
    assert status == 200
    assert root["path"] == "/" and root["kind"] == "group" and root["attributes"] == {"n": 8}
    assert root["snapshot"] == history.repo.lookup_branch("main")
    assert [(c["name"], c["kind"]) for c in root["children"]] == [("a", "array"), ("g", "group")]
    a = root["children"][0]
    assert (a["path"], a["shape"], a["dtype"], a["chunks"]) == ("/a", [8], "int32", [2])

    status, b = get_json(api, "/api/v1/tree/main/g/b")
    assert status == 200 and b["kind"] == "array" and b["children"] == []
    expected = json.loads(
        history.repo.readonly_session("main").store.get_sync("g/b/zarr.json").to_bytes()
    )
    assert b["shape"] == expected["shape"] == [4, 4]
    assert b["dtype"] == "float32" and b["chunks"] == [2, 2] and b["shards"] is None
    assert b["codecs"] == expected["codecs"]
    assert b["fill_value"] == expected["fill_value"]
    assert b["dimension_names"] == expected.get("dimension_names")

    # A ref holding '/' is one segment, its '/' encoded, when a path follows.
    status, g = get_json(api, "/api/v1/tree/release%2Fv1/g")
    assert status == 200
    assert [c["name"] for c in g["children"]] == ["b", "new"]
    assert get_json(api, "/api/v1/tree/main/g/nothing")[0] == 404


def test_tree_of_a_sharded_array_names_chunks_and_shards(tmp_path: Any, serve_repo: Any) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    session = repo.writable_session("main")
    arr = zarr.create_array(
        session.store, name="s", shape=(8, 8), chunks=(2, 2), shards=(4, 4), dtype="u2"
    )
    arr[:] = np.arange(64, dtype="u2").reshape(8, 8)
    session.commit("sharded")
    with serve_repo(repo) as server:
        _, doc = get_json(server, "/api/v1/tree/main/s")
    assert (doc["chunks"], doc["shards"]) == ([2, 2], [4, 4])


BAD_REQUESTS = [
    ("/api/v1/log/nope", 404, "not found"),
    ("/api/v1/log/main?limit=abc", 400, "limit"),
    ("/api/v1/log/main?limit=0", 400, "limit"),
    ("/api/v1/log/main?cursor=garbage", 400, "cursor"),
    ("/api/v1/log/main?cursor=0123456789ABCDEFGHJKMNPQRS.x", 400, "cursor"),
    ("/api/v1/log/main?cursor=0123456789ABCDEFGHJKMNPQRS.3", 404, "not found"),
    # Digits str.isdigit() takes and int() refuses (superscripts): a 400, not a 500.
    ("/api/v1/log/main?limit=%C2%B9", 400, "limit must be a whole number"),
    ("/api/v1/log/main?limit=" + "9" * 5000, 400, "limit must be a whole number"),
    ("/api/v1/log/main?cursor=0123456789ABCDEFGHJKMNPQRS.%C2%B2", 400, "cursor"),
    ("/api/v1/commit/nope", 404, "not found"),
    ("/api/v1/commit/", 400, "give a ref"),
    ("/api/v1/diff/main", 400, "<base>...<head>"),
    ("/api/v1/diff/main...", 400, "<base>...<head>"),
    ("/api/v1/diff/main...nope", 404, "'nope'"),
    ("/api/v1/tree/nope", 404, "'nope'"),
    ("/api/v1/tree/main/../etc", 400, "'..'"),
    ("/api/v1/tree/main/g%2Fb", 400, "%2F"),
    ("/api/v1/tree/main/a%0Ab", 400, "control"),
    ("/api/v1/log/" + "x" * 2000, 400, "too long"),
    ("/api/v1/nothing", 404, None),
]


@pytest.mark.parametrize(("path", "status", "reason"), BAD_REQUESTS)
def test_errors_are_one_json_line_with_a_4xx(
    api: LiveServer, path: str, status: int, reason: str | None
) -> None:
    got, headers, body = api.get(path)
    assert got == status, body
    assert b"Traceback" not in body
    if reason is None:  # a route that does not exist: the router's plain 404
        return
    assert headers["content-type"].startswith("application/json")
    doc = json.loads(body)
    assert list(doc) == ["error"] and "\n" not in doc["error"]
    assert reason in doc["error"]


def test_the_token_guards_every_route_but_the_probes(history: Lake, serve_repo: Any) -> None:
    token = "s3cr3t-token"
    with serve_repo(history.repo, token=token) as server:
        guarded = ["/", "/api/v1/refs", "/api/v1/log/main", "/zarr/main/zarr.json"]
        for path in guarded:
            for headers in (
                {},
                {"authorization": "Bearer wrong"},
                {"authorization": f"Basic {token}"},
                {"authorization": f"Bearer {token}x"},
                {"cookie": "zarrlake_token=" + token},  # the cookie is a digest, not the token
            ):
                status, got_headers, body = server.request("GET", path, headers)
                assert status == 401, (path, headers)
                assert got_headers["www-authenticate"].startswith("Bearer")
                assert token.encode() not in body
        bearer = {"authorization": f"Bearer {token}"}
        for path in guarded[1:]:
            assert server.request("GET", path, bearer)[0] == 200, path
        for probe in ("/healthz", "/readyz"):
            status, _, body = server.get(probe)
            assert status == 200
            assert history.repo.id.encode() not in body and b"main" not in body
        # A browser: ?token= once, then the cookie the redirect sets.
        status, headers, _ = server.get(f"/api/v1/log/main?limit=1&token={token}")
        assert status == 303
        assert headers["location"] == "/api/v1/log/main?limit=1"
        cookie = headers["set-cookie"].split(";")[0]
        assert token not in cookie and "HttpOnly" in headers["set-cookie"]
        assert server.request("GET", "/api/v1/log/main", {"cookie": cookie})[0] == 200
        assert server.get(f"/api/v1/refs?token={token}x")[0] == 401


def test_what_a_client_sends_for_the_token_is_never_a_500_or_an_open_redirect(
    history: Lake, serve_repo: Any
) -> None:
    token = "s3cr3t-token"
    with serve_repo(history.repo, token=token) as server:
        # A cookie with non-ASCII characters (compare_digest raises TypeError for such a str).
        for cookie in ('zarrlake_token="\\351"', 'zarrlake_token="\xe9"'):
            status, _, body = server.request("GET", "/api/v1/refs", {"cookie": cookie})
            assert status == 401, (cookie, body)
        # The redirect that sets the cookie stays on this server.
        for path in ("//evil.example/x", "/\\evil.example/x", "///evil.example"):
            status, headers, _ = server.get(f"{path}?token={token}")
            assert status == 303
            location = headers["location"]
            assert location.startswith("/") and location[1:2] not in ("/", "\\"), location
        # SameSite=Lax: a link followed from a chat or a mail still carries the cookie.
        status, headers, _ = server.get(f"/?token={token}")
        assert "SameSite=Lax" in headers["set-cookie"]


def test_a_burst_of_slow_api_requests_leaves_workers_for_zarr_reads_and_readyz(
    history: Lake, serve_repo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Diffs that take long fill at most ``page_workers`` of the pool: a Zarr reader and the
    readiness probe (whose failing would take the server out of its Service) still answer."""
    release, entered = threading.Event(), threading.Semaphore(0)
    real = history.repo.diff

    def slow_diff(*args: Any, **kw: Any) -> Any:
        entered.release()
        release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(history.repo, "diff", slow_diff)
    with serve_repo(history.repo, limits=Limits(workers=4, page_workers=2)) as server:
        diffs = [
            threading.Thread(target=server.get, args=("/api/v1/diff/first...main",))
            for _ in range(6)
        ]
        answered: dict[str, int] = {}

        def probe(path: str) -> None:
            answered[path] = server.get(path)[0]

        probes = [threading.Thread(target=probe, args=(p,)) for p in ("/readyz", "/zarr/main/")]
        try:
            for t in diffs:
                t.start()
            assert entered.acquire(timeout=10) and entered.acquire(timeout=10)
            time.sleep(0.3)  # the other diffs take what workers they may
            for t in probes:
                t.start()
            for t in probes:
                t.join(10)
            assert answered == {"/readyz": 200, "/zarr/main/": 200}
        finally:
            release.set()
            for t in diffs:
                t.join(30)
