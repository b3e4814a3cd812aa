"""A repository published on a static web server: read-only HTTP(S) storage.

A real HTTP server (zarrlake_testkit.static_http: python's http.server on a loopback port, with
byte ranges and without listings, as a CDN) serves a directory that a local repository was
written to. Everything reading needs works over it; writes are refused with a typed error; what
needs a listing says so.
"""

from __future__ import annotations

import datetime as dt
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import zarrlake
from cli_helpers import Result, assert_one_line_error
from test_xarray import encoding, make_dataset
from zarrlake.errors import ListingUnsupported, ReadOnlyError, ReadOnlyStorage, ZarrlakeError
from zarrlake.format.model import JournalEntry, branch_entry_key
from zarrlake.refs import BranchJournal
from zarrlake.storage import ObjectNotFound, Storage, StorageError, TransientStorageError
from zarrlake.storage.http import HTTPStorage
from zarrlake_testkit.servers import free_port
from zarrlake_testkit.static_http import StaticHTTPServer


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, StaticHTTPServer]]:
    root = tmp_path / "site"
    root.mkdir()
    with StaticHTTPServer(root) as server:
        yield root, server


@pytest.fixture
def published(
    served: tuple[Path, StaticHTTPServer],
) -> tuple[zarrlake.Repository, zarrlake.Repository, StaticHTTPServer]:
    """(the repository as written locally, the same opened over HTTP, the server)."""
    root, server = served
    local = zarrlake.Repository.create(Storage.local(root))
    with local.transaction("main", message="create t", author="me") as store:
        zarr.create_array(store, name="g/t", shape=(6, 64), chunks=(3, 64), dtype="f8")[:] = 1.0
    for i in range(2, 5):
        with local.transaction("main", message=f"write {i}") as store:
            zarr.open_array(store, path="g/t")[:3] = float(i)
    local.create_tag("v1", "main")
    local.create_branch("feature/x%y", "main")  # '/' and '%' are quoted in keys and URLs
    with local.transaction("feature/x%y", message="on the branch") as store:
        zarr.open_array(store, path="g/t")[3:] = -1.0
    return local, zarrlake.Repository.open(Storage.from_url(server.url)), server


# -- the storage -------------------------------------------------------------------------------


def test_reads_byte_ranges_and_heads(served: tuple[Path, StaticHTTPServer]) -> None:
    root, server = served
    data = bytes(range(256)) * 4
    writer = Storage.local(root)
    writer.put("obj", data)
    writer.put("refs/branch.a%2Fb/fffffffffffffffe", b"quoted")
    writer.put("empty", b"")
    for ranges in (True, False):  # a server that ignores Range sends it all: sliced here
        with StaticHTTPServer(root, ranges=ranges) as srv:
            s = Storage.http(srv.url)
            assert s.get("obj") == data
            for start, end in [(0, 10), (10, 20), (1020, 2000), (1024, 1030), (2000, 3000), (5, 5)]:
                assert s.get("obj", (start, end)) == data[start:end], (ranges, start, end)
            assert s.get("refs/branch.a%2Fb/fffffffffffffffe") == b"quoted"
            assert s.get("empty") == b"" and s.get("empty", (0, 10)) == b""
            info = s.head("obj")
            assert info is not None and (info.key, info.size) == ("obj", 1024)
            assert abs(info.modified - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=10)
            assert s.exists("obj") and not s.exists("nope")
    assert server.requests["GET"] == 0  # the fixture's server saw none of it


def test_missing_objects_and_folders_are_not_found(served: tuple[Path, StaticHTTPServer]) -> None:
    root, _ = served
    Storage.local(root).put("dir/sub/obj", b"x")
    # With index pages on, the server redirects "dir" to "dir/" and shows a page: not an object.
    for listings in (False, True):
        with StaticHTTPServer(root, listings=listings) as srv:
            s = Storage.http(srv.url)
            for key in ["no/such/key", "dir", "dir/sub"]:
                with pytest.raises(ObjectNotFound) as info:
                    s.get(key)
                assert info.value.key == key and isinstance(info.value, StorageError)
                with pytest.raises(ObjectNotFound):
                    s.get(key, (0, 10))
                assert s.head(key) is None and not s.exists(key)


def test_writes_and_listings_are_refused_with_typed_errors(
    served: tuple[Path, StaticHTTPServer],
) -> None:
    _, server = served
    s = Storage.http(server.url)
    for write in (
        lambda: s.put("k", b"v"),
        lambda: s.put("k", b"v", create_only=True),
        lambda: s.delete_many(["k"]),
        lambda: s.delete_stale(["k"], dt.datetime.now(dt.UTC)),
    ):
        with pytest.raises(ReadOnlyStorage, match="read-only") as info:
            write()
        assert isinstance(info.value, ReadOnlyError) and isinstance(info.value, StorageError)
    for listing in (lambda: list(s.list()), lambda: s.list_keys("refs/"), lambda: s.list_dirs("")):
        with pytest.raises(ListingUnsupported, match="cannot be listed"):
            listing()
    assert server.requests["PUT"] == 0  # refused before any request


def test_capabilities_url_and_pickling(served: tuple[Path, StaticHTTPServer]) -> None:
    root, server = served
    Storage.local(root).put("a/b", b"1")
    s = Storage.from_url(server.url + "/")
    assert isinstance(s, HTTPStorage) and s.url == server.url
    assert Storage.from_url(s.url).url == s.url
    assert Storage.from_url(server.url.replace("http://", "HTTPS://")).url.startswith("https://")
    assert (s.supports_writes, s.supports_conditional_writes, s.supports_listing) == (
        False,
        False,
        False,
    )
    assert s.supports_byte_ranges and s.durable and s.shared_across_processes
    copy = pickle.loads(pickle.dumps(s))
    assert copy.get("a/b") == b"1" and copy.url == s.url
    # A repository below a path of the site, and headers sent with every request.
    sub = Storage.http(server.url + "/a", headers={"Authorization": "Bearer t"})
    assert sub.get("b") == b"1"
    for bad in ["ftp://host/x", "http:///nohost", "https://h/p?q=1"]:
        with pytest.raises(StorageError):
            Storage.http(bad)


def test_unreachable_server_is_transient_and_fails_fast() -> None:
    s = Storage.http(f"http://127.0.0.1:{free_port()}/repo", timeout=2)
    start = dt.datetime.now()
    with pytest.raises(TransientStorageError, match=r"127\.0\.0\.1"):
        s.get("repo")
    assert dt.datetime.now() - start < dt.timedelta(seconds=8)


# -- a published repository --------------------------------------------------------------------


def test_open_read_log_tags_and_time_travel(
    published: tuple[zarrlake.Repository, zarrlake.Repository, StaticHTTPServer],
) -> None:
    local, remote, _ = published
    assert remote.id == local.id
    for ref in ["main", "v1", "feature/x%y", local.lookup_branch("main")]:
        assert remote.resolve(ref) == local.resolve(ref)
    assert remote.lookup_tag("v1") == local.lookup_tag("v1")
    assert remote.lookup_branch("feature/x%y") == local.lookup_branch("feature/x%y")
    t = zarr.open_array(remote.readonly_session("main").store, path="g/t", mode="r")
    np.testing.assert_array_equal(t[:], np.array([[4.0] * 64] * 3 + [[1.0] * 64] * 3))
    t = zarr.open_array(remote.readonly_session("feature/x%y").store, path="g/t", mode="r")
    assert t[5, 0] == -1.0
    assert [c.message for c in remote.log("main")] == [c.message for c in local.log("main")]
    assert [c.id for c in remote.log("v1", limit=2)] == [c.id for c in local.log("v1", limit=2)]
    assert remote.diff("main", "feature/x%y").changed_chunks == {"/g/t": {(1, 0)}}
    # as_of walks the journal back from the head (no listing)
    commits = list(local.log("main"))
    for c in commits[:-1]:
        when = c.time + dt.timedelta(milliseconds=1)
        expected = local.readonly_session("main", as_of=when).base
        assert remote.readonly_session("main", as_of=when).base == expected
    now = dt.datetime.now(dt.UTC)
    assert remote.readonly_session("main", as_of=now).base == commits[0].id


def test_xarray_reads_a_published_dataset(served: tuple[Path, StaticHTTPServer]) -> None:
    root, server = served
    local = zarrlake.Repository.create(Storage.local(root))
    ds = make_dataset()
    session = local.writable_session()
    ds.to_zarr(session.store, zarr_format=3, consolidated=False, mode="w", encoding=encoding(ds))
    session.commit("dataset")
    remote = zarrlake.Repository.open(Storage.http(server.url))
    with xr.open_zarr(remote.readonly_session("main").store, consolidated=False) as back:
        xr.testing.assert_identical(back.load(), ds)
    assert server.requests["GET"] > 0


def test_every_write_is_refused_before_it_starts(
    published: tuple[zarrlake.Repository, zarrlake.Repository, StaticHTTPServer],
) -> None:
    local, remote, server = published
    before = server.requests.copy()
    for write in (
        lambda: remote.writable_session("main"),
        lambda: remote.transaction("main", message="m").__enter__(),
        lambda: remote.create_branch("b2"),
        lambda: remote.reset_branch("main", "v1"),
        lambda: remote.delete_branch("feature/x%y"),
        lambda: remote.create_tag("v2", "main"),
        lambda: remote.delete_tag("v1"),
        lambda: remote.merge("feature/x%y", "main"),
        lambda: remote.gc(),
        lambda: remote.compact(),
        lambda: zarrlake.Repository.create(remote.storage),
        lambda: zarrlake.Repository.open_or_create(Storage.http(server.url + "/elsewhere")),
    ):
        with pytest.raises(ReadOnlyError, match="read-only"):
            write()
    assert server.requests["PUT"] == 0
    assert set(server.requests) <= set(before) | {"GET", "HEAD"}
    session = remote.readonly_session("main")
    with pytest.raises(ReadOnlyError):
        zarr.open_array(session.store, path="g/t")[0, 0] = 5.0
    assert local.resolve("main") == remote.resolve("main")


def test_a_published_root_lists_the_refs_without_a_listing(
    published: tuple[zarrlake.Repository, zarrlake.Repository, StaticHTTPServer],
) -> None:
    local, remote, _ = published
    # Every head and tag is in the root, which a plain web server serves like any object.
    assert remote.list_branches() == local.list_branches()
    assert remote.list_tags() == local.list_tags() == {"v1": local.lookup_branch("main")}
    assert [c.id for c in remote.log("feature/x%y")] == [c.id for c in local.log("feature/x%y")]
    with pytest.raises(zarrlake.RefNotFound):
        remote.lookup_branch("nope")
    with pytest.raises(zarrlake.RefNotFound):
        remote.lookup_tag("nope")


def test_what_needs_a_listing_says_so(
    served: tuple[Path, StaticHTTPServer], journal_only: None
) -> None:
    root, server = served
    # A repository without a published root (made before it, or by a server without
    # compare-and-set): its refs are found by listing, which plain HTTP cannot.
    local = zarrlake.Repository.create(Storage.local(root / "journal"))
    local.create_tag("v1", "main")
    remote = zarrlake.Repository.open(Storage.from_url(server.url + "/journal"))
    assert remote.lookup_tag("v1") == local.lookup_branch("main")
    with pytest.raises(ListingUnsupported, match="cannot be listed"):
        remote.list_branches()
    with pytest.raises(ListingUnsupported):
        remote.list_tags()
    with pytest.raises(zarrlake.RefNotFound, match="cannot list") as info:
        remote.lookup_branch("nope")
    assert "compaction pruned" in info.value.hint
    with pytest.raises(zarrlake.RefNotFound, match="cannot list"):
        remote.resolve("nope")
    with pytest.raises(zarrlake.RefNotFound):
        remote.lookup_tag("nope")
    with pytest.raises(zarrlake.RepositoryNotFound):
        zarrlake.Repository.open(Storage.http(remote.storage.url + "/nothing-here"))


def test_a_missing_object_is_a_clear_error(
    published: tuple[zarrlake.Repository, zarrlake.Repository, StaticHTTPServer],
    served: tuple[Path, StaticHTTPServer],
) -> None:
    local, _, server = published
    root, _ = served
    # An incomplete copy (a chunk never uploaded): the read names the object that is missing.
    with local.transaction("main", message="noise") as store:  # chunks too random to inline
        zarr.open_array(store, path="g/t")[:] = np.random.default_rng(0).random((6, 64))
    chunks = sorted((root / "chunks").rglob("*")) + sorted((root / "packs").rglob("*"))
    victim = next(p for p in chunks if p.is_file())
    victim.unlink()
    fresh = zarrlake.Repository.open(Storage.http(server.url))
    t = zarr.open_array(fresh.readonly_session("main").store, path="g/t", mode="r")
    with pytest.raises(ZarrlakeError) as info:
        t[:]
    assert victim.name in str(info.value)


@pytest.mark.parametrize("head", [0, 1, 2, 15, 16, 17, 31, 33, 1000, 4097])
def test_branch_head_is_found_by_probing_in_few_requests(
    served: tuple[Path, StaticHTTPServer], head: int
) -> None:
    root, server = served
    local = Storage.local(root)
    now = dt.datetime.now(dt.UTC)
    for seq in range(head + 1):
        entry = JournalEntry(seq, f"S{seq}", None, now, "w")
        local.put(branch_entry_key("b", seq), entry.encode())
    journal = BranchJournal(Storage.http(server.url))
    found = journal.head("b")
    assert found is not None and (found.seq, found.snapshot) == (head, f"S{head}")
    probes = server.requests["HEAD"]
    assert probes <= 2 * 16 + 16 * max(1, head.bit_length() // 4 + 1), probes
    # the history walk back from the head, newest first
    if head <= 40:
        assert [e.seq for e in journal.history("b")] == list(range(head, -1, -1))
    # A journal whose first entries compaction pruned is not found without a listing.
    local.delete_many([branch_entry_key("b", 0)])
    assert BranchJournal(Storage.http(server.url)).head("b") is None


def test_cli_reads_over_http(
    published: tuple[zarrlake.Repository, zarrlake.Repository, StaticHTTPServer],
    cli: Callable[..., Result],
) -> None:
    local, _, server = published
    r = cli("log", server.url, "-n", "1", "--json")
    assert r.code == 0, r.err
    assert r.json()[0]["id"] == local.resolve("main")
    msg = assert_one_line_error(cli("tag", server.url, "create", "v9", "main"), 1)
    assert "read-only" in msg


def test_a_copy_of_the_repository_directory_is_a_publication(tmp_path: Path) -> None:
    """Publishing is copying the objects: a copied directory serves like the original."""
    repo = zarrlake.Repository.create(Storage.local(tmp_path / "orig"))
    with repo.transaction("main", message="m") as store:
        zarr.create_array(store, name="a", shape=(4,), chunks=(2,), dtype="i4")[:] = 7
    shutil.copytree(tmp_path / "orig", tmp_path / "copy", ignore=shutil.ignore_patterns(".tmp"))
    with StaticHTTPServer(tmp_path / "copy") as srv:
        remote = zarrlake.Repository.open(Storage.http(srv.url))
        a = zarr.open_array(remote.readonly_session().store, path="a", mode="r")
        assert list(a[:]) == [7] * 4
