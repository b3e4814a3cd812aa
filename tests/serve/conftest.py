"""Fixtures of the ``zarrlake serve`` tests: populated repositories and real servers.

- :func:`populate` writes a known hierarchy (several dtypes, multi-chunk arrays with partial edge
  chunks and unwritten chunks, nested groups, attributes) and tags it ``v1``; the arrays it
  returns are what every reader must get back, exactly.
- :class:`LiveServer`: uvicorn serving :func:`zarrlake.serve.app` on 127.0.0.1 and an
  ephemeral port, in a thread of the test process, stopped (and joined) at teardown. The
  readers under test (fsspec's HTTP file system, ``http.client``, subprocesses) talk to it
  over real sockets.
- ``lake`` / ``served``: one populated local repository and its server for a test module;
  ``s3_lake``: the same on moto S3 with credentials nothing else uses (``s3_keys``), so that a
  test can look for them in every response; ``fresh_lake``: a populated repository of one test,
  which it may commit to; ``serve_repo``: :func:`serving`, to start a server of one's own.

Tests take these as fixtures (``conftest`` is not importable by name: tests/ has one too).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
import zarr

import zarrlake
from zarrlake.serve import Limits, app

#: Credentials of the S3 repository: moto takes any; no other test uses these, so finding them
#: anywhere in a response means the server leaked them.
S3_ACCESS_KEY = "AKIASERVELEAKCHECK01"
S3_SECRET_KEY = "serve/Secret+Key/thatMustNeverLeak0123456"


@dataclass
class Lake:
    """A populated repository: the arrays written (path -> values), attributes, and refs."""

    repo: zarrlake.Repository
    arrays: dict[str, np.ndarray]
    attributes: dict[str, dict[str, Any]]
    snapshot: str  # what tag v1 and main point at after populate()
    fill: dict[str, Any] = field(default_factory=dict)


def populate(repo: zarrlake.Repository) -> Lake:
    """Write the test hierarchy on ``main``, commit, tag the commit ``v1``."""
    rng = np.random.default_rng(40)
    arrays: dict[str, np.ndarray] = {
        "temperature": rng.normal(280, 10, size=(6, 8)).astype("float32"),
        "counts": np.arange(10, dtype="int16") * -3,
        "flags": np.array([True, False, True, True, False]),
        "group/sub/deep": rng.integers(0, 2**63, size=(3, 5), dtype="uint64"),
        "group/big": rng.random((40, 40)),
    }
    chunks = {
        "temperature": (4, 4),
        "counts": (3,),
        "flags": (5,),
        "group/sub/deep": (2, 2),
        "group/big": (8, 8),
    }
    attributes = {
        "": {"title": "serve tests", "nested": {"list": [1, 2, 3]}},
        "group": {"kind": "a group", "unicode": "ünïcødé"},
        "group/sub": {},
        "temperature": {"units": "K", "_FillValue_note": "none"},
    }
    session = repo.writable_session("main")
    root = zarr.open_group(session.store, mode="w", attributes=attributes[""])
    root.create_group("group", attributes=attributes["group"]).create_group("sub")
    for path, values in arrays.items():
        arr = root.create_array(
            path,
            shape=values.shape,
            chunks=chunks[path],
            dtype=values.dtype,
            attributes=attributes.get(path, {}),
        )
        arr[...] = values
    # An array with chunks never written: readers get the fill value (the server's 404s).
    sparse = root.create_array("group/sparse", shape=(6,), chunks=(2,), dtype="f8", fill_value=-1)
    sparse[2:4] = [7.0, 8.0]
    arrays["group/sparse"] = np.array([-1, -1, 7, 8, -1, -1], dtype="f8")
    sid = session.commit("populate", author="tester", metadata={"ticket": 40})
    repo.create_tag("v1", sid)
    return Lake(repo, arrays, attributes, sid)


class LiveServer:
    """uvicorn serving ``zarrlake.serve.app(repo, ...)`` on a loopback port, in a thread."""

    def __init__(
        self,
        repo: zarrlake.Repository,
        *,
        token: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.asgi = app(repo, token=token, limits=limits)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.asgi, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)
        self._sock.close()
        assert not self._thread.is_alive(), "the test server did not stop"

    def request(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One request with the raw ``path`` sent as it is (no client normalizes it): status,
        headers (lower-case names), body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            conn.endheaders()
            resp = conn.getresponse()
            body = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
        finally:
            conn.close()

    def get(self, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
        return self.request("GET", path, {k.replace("_", "-"): v for k, v in headers.items()})


@contextlib.contextmanager
def serving(repo: zarrlake.Repository, **kw: Any) -> Iterator[LiveServer]:
    """``with serving(repo) as server:`` a :class:`LiveServer` of ``repo``, stopped after."""
    server = LiveServer(repo, **kw).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Lake:
    """The populated local repository of a test module (tests must not write to it)."""
    path: Path = tmp_path_factory.mktemp("lake")
    return populate(zarrlake.Repository.create(zarrlake.Storage.local(path)))


@pytest.fixture(scope="module")
def served(lake: Lake) -> Iterator[LiveServer]:
    """The server of ``lake``, for a test module."""
    with serving(lake.repo) as server:
        yield server


@pytest.fixture(scope="module")
def s3_lake(moto_s3: Any) -> Lake:
    """The populated repository on moto S3, opened with :data:`S3_ACCESS_KEY`."""
    storage = zarrlake.Storage.s3(
        moto_s3.bucket,
        f"serve-{uuid.uuid4().hex[:12]}",
        endpoint_url=moto_s3.endpoint,
        region="us-east-1",
        access_key_id=S3_ACCESS_KEY,
        secret_access_key=S3_SECRET_KEY,
        allow_http=True,
    )
    return populate(zarrlake.Repository.create(storage))


@pytest.fixture(scope="session")
def serve_repo() -> Any:
    """:func:`serving`, for tests that start a server of their own
    (``with serve_repo(repo, token=...) as server:``)."""
    return serving


@pytest.fixture(scope="session")
def s3_keys() -> tuple[str, str]:
    """(access key id, secret key) of ``s3_lake``: look for them in what the server says."""
    return S3_ACCESS_KEY, S3_SECRET_KEY


@pytest.fixture
def fresh_lake(tmp_path: Path) -> Lake:
    """A populated local repository of one test, which it may commit to."""
    return populate(zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo")))
