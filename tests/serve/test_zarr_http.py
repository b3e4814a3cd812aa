"""``/zarr/<ref>/<key>``: any version as a plain Zarr v3 store over HTTP, read by Zarr's own
reading paths (``FsspecStore`` over fsspec's HTTP file system, xarray in a process without
zarrlake or credentials) and by raw HTTP requests for what the protocol promises: ranges, HEAD,
ETags and 304s, immutable tag and snapshot URLs, branches resolved per request, the ``@now``
redirect, bad input answered 4xx in one line, no writes, no credentials in any answer.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.storage import FsspecStore

import zarrlake
from zarrlake.serve import Limits
from zarrlake.serve.context import IMMUTABLE, PRIVATE_IMMUTABLE
from zarrlake.serve.zarrhttp import consolidated_group_document

# The fixtures' types (conftest.py): a populated repository, a running server.
Lake = LiveServer = Any


@pytest.fixture(scope="module")
def s3_served(s3_lake: Lake, serve_repo: Any) -> Iterator[LiveServer]:
    with serve_repo(s3_lake.repo) as server:
        yield server


def open_http(url: str, **kw: Any) -> zarr.Group:
    return zarr.open_group(FsspecStore.from_url(url, read_only=True), mode="r", **kw)


def assert_lake(group: zarr.Group, lake: Lake) -> None:
    """Every array of ``lake`` read through ``group``: exactly the values and dtypes written,
    and every attribute."""
    for path, expected in lake.arrays.items():
        got = group[path][...]
        assert got.dtype == expected.dtype, path
        np.testing.assert_array_equal(got, expected, err_msg=path)
    for path, attrs in lake.attributes.items():
        node = group if path == "" else group[path]
        assert dict(node.attrs) == attrs, path


# -- Zarr's own readers --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
def test_fsspec_store_reads_exactly_what_was_written(
    where: str, request: pytest.FixtureRequest
) -> None:
    lake: Lake = request.getfixturevalue("lake" if where == "local" else "s3_lake")
    server: LiveServer = request.getfixturevalue("served" if where == "local" else "s3_served")
    for ref in ("v1", "main", lake.snapshot, lake.snapshot[:12]):
        group = open_http(f"{server.url}/zarr/{ref}")
        assert_lake(group, lake)
    # The hierarchy comes from the root's consolidated metadata: every node, nothing listed.
    members = {name: type(node).__name__ for name, node in group.members(max_depth=None)}
    assert members == {
        "counts": "Array",
        "flags": "Array",
        "temperature": "Array",
        "group": "Group",
        "group/big": "Array",
        "group/sparse": "Array",
        "group/sub": "Group",
        "group/sub/deep": "Array",
    }


def test_readers_that_list_get_a_listing_fsspec_reads(lake: Lake, served: LiveServer) -> None:
    group = open_http(f"{served.url}/zarr/v1", use_consolidated=False)
    assert group.metadata.consolidated_metadata is None  # really not used
    assert sorted(n for n, _ in group.members()) == ["counts", "flags", "group", "temperature"]
    assert sorted(n for n, _ in group["group"].members()) == ["big", "sparse", "sub"]
    assert_lake(group, lake)


def test_a_nested_group_opens_on_its_own_with_its_consolidated_metadata(
    lake: Lake, served: LiveServer
) -> None:
    sub = open_http(f"{served.url}/zarr/v1/group", use_consolidated=True)
    assert sorted(n for n, _ in sub.members(max_depth=None)) == [
        "big",
        "sparse",
        "sub",
        "sub/deep",
    ]
    np.testing.assert_array_equal(sub["sub/deep"][...], lake.arrays["group/sub/deep"])
    assert dict(sub.attrs) == lake.attributes["group"]


def test_consolidated_metadata_is_what_zarr_would_write(lake: Lake, served: LiveServer) -> None:
    """The synthesized root document against zarr-python's own consolidation of a copy."""
    from zarr.core.group import GroupMetadata

    ours = GroupMetadata.from_dict(json.loads(served.get("/zarr/v1/zarr.json")[2]))
    from zarr.core.buffer import default_buffer_prototype

    buffer = default_buffer_prototype().buffer
    nodes = lake.repo.core.objects.snapshot(lake.snapshot).nodes
    copy = zarr.storage.MemoryStore({key: buffer.from_bytes(doc) for key, doc in nodes.items()})
    with pytest.warns(UserWarning, match="Consolidated metadata"):
        theirs = zarr.consolidate_metadata(copy).metadata
    assert ours.consolidated_metadata is not None and theirs.consolidated_metadata is not None
    assert ours.consolidated_metadata.flattened_metadata == (
        theirs.consolidated_metadata.flattened_metadata
    )
    assert ours.attributes == theirs.attributes


def test_an_implicit_group_is_left_out_of_consolidated_metadata() -> None:
    group = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'
    array = json.dumps(
        {"zarr_format": 3, "node_type": "array", "shape": [1], "data_type": "int8"}
    ).encode()
    nodes = {"zarr.json": group, "a/zarr.json": array, "x/y/zarr.json": array}
    doc = json.loads(consolidated_group_document(nodes, "zarr.json") or b"")
    assert sorted(doc["consolidated_metadata"]["metadata"]) == ["a"]
    assert consolidated_group_document(nodes, "a/zarr.json") is None


XARRAY_CHILD = textwrap.dedent(
    """
    import json, sys, warnings

    class NoZarrlake:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "zarrlake":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoZarrlake())
    try:
        import zarrlake
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("zarrlake is importable")
    import xarray as xr

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "falling back to non-consolidated" warning
        ds = xr.open_zarr(sys.argv[1])
    out = {
        "attrs": ds.attrs,
        "vars": {
            name: {"dims": list(v.dims), "dtype": str(v.dtype), "values": v.values.tolist(),
                   "attrs": v.attrs}
            for name, v in ds.variables.items()
        },
        "aws": sorted(k for k in __import__("os").environ if k.startswith("AWS_")),
    }
    print(json.dumps(out, default=str))
    """
)


def test_xarray_reads_a_tag_in_a_process_without_zarrlake_or_credentials(
    moto_s3: Any, serve_repo: Any, s3_keys: tuple[str, str]
) -> None:
    import pandas as pd
    import xarray as xr

    storage = zarrlake.Storage.s3(
        moto_s3.bucket,
        "serve-xarray",
        endpoint_url=moto_s3.endpoint,
        region="us-east-1",
        access_key_id=s3_keys[0],
        secret_access_key=s3_keys[1],
        allow_http=True,
    )
    repo = zarrlake.Repository.create(storage)
    rng = np.random.default_rng(7)
    ds = xr.Dataset(
        {
            "temperature": (
                ("time", "lat", "lon"),
                rng.normal(280, 5, (4, 3, 5)).astype("float32"),
                {"units": "K"},
            ),
            "station": (("lat",), np.array([3, -1, 2], dtype="int32")),
        },
        coords={
            "time": pd.date_range("2026-01-01", periods=4),
            "lat": [10.0, 20.0, 30.0],
            "lon": np.arange(5),
        },
        attrs={"title": "issue 40"},
    )
    session = repo.writable_session("main")
    ds.to_zarr(
        session.store,
        zarr_format=3,
        consolidated=False,
        encoding={"temperature": {"chunks": (2, 2, 2)}},
    )
    repo.create_tag("v2026.1", session.commit("dataset"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ZARRLAKE_"))}
    env["HOME"] = "/nonexistent"  # no ~/.aws either
    with serve_repo(repo) as server:
        child = subprocess.run(
            [sys.executable, "-c", XARRAY_CHILD, f"{server.url}/zarr/v2026.1"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd="/",
        )
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    assert got["aws"] == []
    assert got["attrs"] == {"title": "issue 40"}
    assert got["vars"]["temperature"]["dims"] == ["time", "lat", "lon"]
    assert got["vars"]["temperature"]["dtype"] == "float32"
    assert got["vars"]["temperature"]["attrs"] == {"units": "K"}
    np.testing.assert_array_equal(
        np.array(got["vars"]["temperature"]["values"], dtype="float32"), ds.temperature.values
    )
    assert got["vars"]["station"]["values"] == [3, -1, 2]
    assert got["vars"]["lat"]["values"] == [10.0, 20.0, 30.0]
    assert got["vars"]["time"]["dtype"] == "datetime64[ns]"
    times = ds.time.values.astype("datetime64[ns]").astype("int64")
    assert got["vars"]["time"]["values"] == times.tolist()


# -- the protocol --------------------------------------------------------------------------------


def chunk_key(lake: Lake) -> tuple[str, bytes]:
    """A chunk key of ``lake`` at v1 and its stored bytes (as the session's store gives them)."""
    key = "group/big/c/0/0"
    data = lake.repo.readonly_session("v1").store.get_sync(key)
    assert data is not None
    return key, data.to_bytes()


def test_keys_are_the_stores_bytes_and_absent_keys_404(lake: Lake, served: LiveServer) -> None:
    key, data = chunk_key(lake)
    status, headers, body = served.get(f"/zarr/v1/{key}")
    assert (status, body) == (200, data)
    assert headers["content-type"] == "application/octet-stream"
    assert headers["content-length"] == str(len(data))
    array_doc = lake.repo.readonly_session("v1").store.get_sync("group/big/zarr.json")
    assert array_doc is not None
    status, headers, body = served.get("/zarr/v1/group/big/zarr.json")
    assert (status, body) == (200, array_doc.to_bytes())  # array documents as stored
    assert headers["content-type"] == "application/json"
    status, _, body = served.get("/zarr/v1/group/sparse/c/0")  # never written: fill value
    assert status == 404 and body.count(b"\n") == 1


def test_ranges_and_head(lake: Lake, served: LiveServer) -> None:
    key, data = chunk_key(lake)
    n = len(data)
    url = f"/zarr/v1/{key}"
    for spec, (start, end) in {
        "bytes=2-9": (2, 10),
        f"bytes=5-{n + 100}": (5, n),
        "bytes=7-": (7, n),
        "bytes=-4": (n - 4, n),
        f"bytes=-{n + 5}": (0, n),
    }.items():
        status, headers, body = served.get(url, range=spec)
        assert status == 206, spec
        assert body == data[start:end], spec
        assert headers["content-range"] == f"bytes {start}-{end - 1}/{n}", spec
        assert headers["content-length"] == str(end - start)
    status, headers, _ = served.get(url, range=f"bytes={n}-")
    assert status == 416 and headers["content-range"] == f"bytes */{n}"
    assert served.get(url, range="bytes=-0")[0] == 416
    for bad in ("bytes=9-2", "bytes=x-1", "bytes=-", "bytes 0-1"):
        status, _, body = served.get(url, range=bad)
        assert status == 400, bad
        assert b"Range" in body and body.count(b"\n") == 1
    # Several ranges: answered whole, as HTTP allows.
    assert served.get(url, range="bytes=0-1,4-5")[:3:2] == (200, data)
    # A range of the (synthesized) root document is a range of what GET gives.
    whole = served.get("/zarr/v1/zarr.json")[2]
    assert served.get("/zarr/v1/zarr.json", range="bytes=-10")[2] == whole[-10:]

    status, headers, body = served.request("HEAD", url)
    assert (status, body) == (200, b"")
    assert headers["content-length"] == str(n)
    assert headers["accept-ranges"] == "bytes"
    status, headers, body = served.request("HEAD", url, {"range": "bytes=1-3"})
    assert (status, headers["content-length"], body) == (206, "3", b"")
    assert served.request("HEAD", "/zarr/v1/no/such/key")[0] == 404


def test_range_edge_cases(lake: Lake, served: LiveServer) -> None:
    key, data = chunk_key(lake)
    n, url = len(data), f"/zarr/v1/{key}"
    huge = "9" * 5000  # int() refuses a string of 4,300 digits or more
    for spec, (start, end) in {
        "bytes=0-0": (0, 1),
        f"bytes={n - 1}-{n - 1}": (n - 1, n),
        "Bytes=1-2": (1, 3),  # range units are case-insensitive
        f"bytes=0-{huge}": (0, n),
        f"bytes=-{huge}": (0, n),
    }.items():
        status, headers, body = served.get(url, range=spec)
        assert (status, body) == (206, data[start:end]), spec[:40]
        assert headers["content-range"] == f"bytes {start}-{end - 1}/{n}"
    status, headers, _ = served.get(url, range=f"bytes={huge}-")
    assert status == 416 and headers["content-range"] == f"bytes */{n}"
    # A unit the server does not know: the Range header is ignored (RFC 9110, 14.2).
    assert served.get(url, range="items=0-1")[:3:2] == (200, data)


def test_if_none_match_is_a_304_only_for_a_key_that_exists(lake: Lake, served: LiveServer) -> None:
    key, _ = chunk_key(lake)
    assert served.get(f"/zarr/v1/{key}", if_none_match="*")[0] == 304
    for ref in ("v1", "main"):
        status, _, body = served.get(f"/zarr/{ref}/no/such/key", if_none_match="*")
        assert status == 404 and b"no key" in body
        assert served.get(f"/zarr/{ref}/group", if_none_match="*")[0] == 307  # a directory


def test_behind_a_token_immutable_answers_are_private(lake: Lake, serve_repo: Any) -> None:
    """A shared cache may hand a ``public`` answer to a request without the token."""
    key, _ = chunk_key(lake)
    bearer = {"authorization": "Bearer s3cr3t"}
    with serve_repo(lake.repo, token="s3cr3t") as server:
        for path in (f"/zarr/v1/{key}", "/zarr/v1/zarr.json", f"/zarr/{lake.snapshot}/"):
            status, headers, _ = server.request("GET", path, bearer)
            assert (status, headers["cache-control"]) == (200, PRIVATE_IMMUTABLE), path
        assert server.request("GET", f"/zarr/main/{key}", bearer)[1]["cache-control"] == "no-cache"


def test_tag_and_snapshot_urls_are_immutable_with_strong_etags(
    lake: Lake, served: LiveServer
) -> None:
    key, _ = chunk_key(lake)
    etags = set()
    for ref in ("v1", lake.snapshot, lake.snapshot[:12].lower()):
        status, headers, _ = served.get(f"/zarr/{ref}/{key}")
        assert status == 200
        assert headers["cache-control"] == IMMUTABLE
        etag = headers["etag"]
        assert etag.startswith('"') and etag.endswith('"') and lake.snapshot in etag
        etags.add(etag)
        status, headers, body = served.get(f"/zarr/{ref}/{key}", if_none_match=etag)
        assert (status, body) == (304, b"")
        assert headers["etag"] == etag and headers["cache-control"] == IMMUTABLE
        assert served.get(f"/zarr/{ref}/{key}", if_none_match=f"W/{etag}, *x")[0] == 304
        assert served.get(f"/zarr/{ref}/{key}", if_none_match='"other"')[0] == 200
    assert len(etags) == 1  # one snapshot, one key: one entity
    # Another key of the same snapshot is another entity.
    assert served.get("/zarr/v1/zarr.json")[1]["etag"] not in etags


def test_a_branch_resolves_per_request_and_a_snapshot_url_never_changes(
    fresh_lake: Lake, serve_repo: Any
) -> None:
    lake = fresh_lake
    with serve_repo(lake.repo) as server:
        old = open_http(f"{server.url}/zarr/main")["counts"][...]
        status, headers, _ = server.get("/zarr/main/counts/c/0")
        assert status == 200 and headers["cache-control"] == "no-cache"
        branch_etag = headers["etag"]
        assert lake.snapshot in branch_etag
        assert server.get("/zarr/main/counts/c/0", if_none_match=branch_etag)[0] == 304

        session = lake.repo.writable_session("main")
        zarr.open_array(session.store, path="counts", mode="r+")[:] = 99
        new_sid = session.commit("overwrite counts")

        np.testing.assert_array_equal(open_http(f"{server.url}/zarr/main")["counts"][...], 99)
        before = open_http(f"{server.url}/zarr/{lake.snapshot}")["counts"][...]
        np.testing.assert_array_equal(before, old)
        np.testing.assert_array_equal(open_http(f"{server.url}/zarr/v1")["counts"][...], old)
        # The old validator no longer matches: the branch moved.
        status, headers, _ = server.get("/zarr/main/counts/c/0", if_none_match=branch_etag)
        assert status == 200 and new_sid in headers["etag"]


def test_a_tags_resolution_is_cached_until_its_ttl(fresh_lake: Lake, serve_repo: Any) -> None:
    """Tag names are never reused, so a tag's snapshot is cached; a deleted tag stops resolving
    once its resolution is older than ``Limits.immutable_ttl_s``."""
    repo = fresh_lake.repo
    with (
        serve_repo(repo) as cached,
        serve_repo(repo, limits=Limits(immutable_ttl_s=0.0)) as uncached,
    ):
        assert cached.get("/zarr/v1/zarr.json")[0] == 200
        assert uncached.get("/zarr/v1/zarr.json")[0] == 200
        repo.delete_tag("v1")
        assert cached.get("/zarr/v1/zarr.json")[0] == 200  # within the TTL
        assert uncached.get("/zarr/v1/zarr.json")[0] == 404


def test_now_redirects_to_the_snapshot_the_branch_names(lake: Lake, served: LiveServer) -> None:
    status, headers, _ = served.get("/zarr/main@now/group/big/c/0/0")
    assert status == 307
    assert headers["location"] == f"/zarr/{lake.snapshot}/group/big/c/0/0"
    assert headers["cache-control"] == "no-store"
    # Followed by a reader, the whole hierarchy comes from that one snapshot.
    assert_lake(open_http(f"{served.url}/zarr/main@now"), lake)
    assert served.get("/zarr/nope@now/zarr.json")[0] == 404


def test_directories_redirect_and_list(lake: Lake, served: LiveServer) -> None:
    assert served.get("/zarr/v1")[:2][0] == 307
    assert served.get("/zarr/v1")[1]["location"] == "/zarr/v1/"
    status, headers, _ = served.get("/zarr/v1/group")
    assert (status, headers["location"]) == (307, "/zarr/v1/group/")
    status, headers, body = served.get("/zarr/v1/group/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    for name in ("big", "sparse", "sub", "zarr.json"):
        assert f'<a href="{name}">'.encode() in body
    assert served.get("/zarr/v1/nothing/here/")[0] == 404


def test_a_key_over_the_response_limit_is_413_and_its_ranges_are_served(
    lake: Lake, serve_repo: Any
) -> None:
    key, data = chunk_key(lake)
    limit = len(data) // 2
    with serve_repo(lake.repo, limits=Limits(max_response_bytes=limit)) as server:
        status, _, body = server.get(f"/zarr/v1/{key}")
        assert status == 413 and b"byte ranges" in body and body.count(b"\n") == 1
        status, _, body = server.get(f"/zarr/v1/{key}", range=f"bytes=0-{limit - 1}")
        assert (status, body) == (206, data[:limit])
        assert server.get(f"/zarr/v1/{key}", range=f"bytes=0-{limit}")[0] == 413


# -- bad input ------------------------------------------------------------------------------------

BAD_PATHS = [
    ("/zarr/v1/../v1/zarr.json", 400, "'..'"),
    ("/zarr/v1/group/%2E%2E/zarr.json", 400, "'..'"),
    ("/zarr/v1/./zarr.json", 400, "'.'"),
    ("/zarr/v1/group%2Fbig/zarr.json", 400, "%2F"),
    ("/zarr/v1/group%2fbig/zarr.json", 400, "%2F"),
    ("/zarr/v1//etc/passwd", 400, "empty"),
    ("/zarr//zarr.json", 400, "empty"),
    ("/zarr/v1/zarr.json%00", 400, "control"),
    ("/zarr/v1/a%0Ab", 400, "control"),
    ("/zarr/v1/a%5Cb", 400, "backslash"),
    ("/zarr/v1/%FF", 400, "UTF-8"),
    ("/zarr/v1/" + "a/" * 600 + "zarr.json", 400, "too long"),
    ("/zarr/nope/zarr.json", 404, "'nope'"),
    ("/zarr/0123456789ABCDEFGHJKMNPQRS/zarr.json", 404, "not found"),
    ("/zarr/v1/no/such/key", 404, "no key"),
    ("/zarr/bad%20name/zarr.json", 404, "not found"),
    ("/zarr/", 404, "give a ref"),
]


@pytest.mark.parametrize(("path", "status", "reason"), BAD_PATHS)
def test_bad_input_is_a_4xx_in_one_line(
    served: LiveServer, path: str, status: int, reason: str
) -> None:
    got, headers, body = served.get(path)
    assert got == status, body
    text = body.decode()
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert reason in text
    assert "Traceback" not in text and "File " not in text
    assert headers["cache-control"] == "no-store"


def test_an_ambiguous_short_id_is_a_400_naming_candidates(tmp_path: Any, serve_repo: Any) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    ids = []
    for i in range(40):  # ids start with their millisecond: close commits share a prefix
        session = repo.writable_session("main")
        zarr.open_group(session.store, mode="a").attrs["i"] = i
        ids.append(session.commit(f"c{i}"))
    prefix = next(
        ids[i][:n]
        for n in range(10, 4, -1)
        for i in range(len(ids))
        if sum(x.startswith(ids[i][:n]) for x in ids) > 1
    )
    with serve_repo(repo) as server:
        status, _, body = server.get(f"/zarr/{prefix}/zarr.json")
    assert status == 400 and b"ambiguous" in body and body.count(b"\n") == 1


@pytest.mark.parametrize("method", ["PUT", "POST", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/zarr/main/zarr.json", "/zarr/main/new/key", "/api/v1/refs"])
def test_no_route_writes(lake: Lake, served: LiveServer, method: str, path: str) -> None:
    before = lake.repo.list_branches(), lake.repo.list_tags()
    status, headers, _ = served.request(method, path, {"content-length": "0"})
    assert status == 405
    assert "PUT" not in headers.get("allow", "") and "GET" in headers.get("allow", "")
    assert (lake.repo.list_branches(), lake.repo.list_tags()) == before


# -- credentials ----------------------------------------------------------------------------------


def test_credentials_never_appear_in_any_response_or_log(
    s3_lake: Lake,
    s3_served: LiveServer,
    serve_repo: Any,
    s3_keys: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets = [s3_keys[0].encode(), s3_keys[1].encode(), s3_keys[1][:12].encode()]
    paths = [
        "/",
        "/healthz",
        "/readyz",
        "/zarr/v1/zarr.json",
        "/zarr/v1/",
        "/zarr/v1/group/",
        "/zarr/v1/group/big/c/0/0",
        "/zarr/main@now/zarr.json",
        "/zarr/nope/zarr.json",
        "/zarr/v1/../x",
        "/api/v1/refs",
        "/api/v1/log/main",
        f"/api/v1/commit/{s3_lake.snapshot}",
        "/api/v1/diff/v1...main",
        "/api/v1/tree/v1/group",
        "/api/v1/tree/nope",
    ]
    answers = [s3_served.get(p) for p in paths]
    # A storage that fails: the same repository through a dead endpoint, same credentials.
    s3 = s3_lake.repo.storage
    dead = zarrlake.Storage.s3(
        s3.bucket,
        s3.prefix,
        endpoint_url="http://127.0.0.1:9",
        region="us-east-1",
        access_key_id=s3_keys[0],
        secret_access_key=s3_keys[1],
        allow_http=True,
    )
    broken = zarrlake.Repository(dead, s3_lake.repo.record)
    with serve_repo(broken) as server:
        failed = [server.get(p) for p in ("/readyz", "/api/v1/refs", "/zarr/main/zarr.json")]
    assert all(status >= 500 for status, _, _ in failed), [a[:3:2] for a in failed]
    for status, headers, body in answers + failed:
        blob = body + json.dumps(headers).encode()
        assert not any(s in blob for s in secrets), (status, body[:200])
        assert b"Traceback" not in body
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert not any(s.decode() in logged for s in secrets)
