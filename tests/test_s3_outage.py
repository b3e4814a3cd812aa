"""A real S3 server killed (SIGKILL) and started again under a session that writes packs and a
reader that reads ahead in them: every error is typed, nothing is published half-written, and
once the server is back the same session commits and every byte reads back.

SeaweedFS keeps its data on disk, so it comes back with what it held; moto keeps everything in
memory and cannot be used for this. Each test runs its own server, which it kills."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.errors import StorageError
from zarrlake_testkit.servers import SeaweedFS, start_seaweedfs

KEY = "testing"
BUCKET = "outage"
CHUNK = 1024


class Server:
    """One SeaweedFS of a test's own, that the test can kill and start again."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.weed: SeaweedFS = start_seaweedfs(workdir, access_key=KEY, secret_key=KEY)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.weed.endpoint,
            region_name="us-east-1",
            aws_access_key_id=KEY,
            aws_secret_access_key=KEY,
        ).create_bucket(Bucket=BUCKET)

    def storage(self) -> zarrlake.Storage:
        return zarrlake.Storage.s3(
            BUCKET,
            "repo",
            endpoint_url=self.weed.endpoint,
            region="us-east-1",
            access_key_id=KEY,
            secret_access_key=KEY,
            allow_http=True,
        )

    def kill(self) -> None:
        """SIGKILL, to the whole process group: no chance to finish anything."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.weed.proc.pid, signal.SIGKILL)
        self.weed.proc.wait(10)
        self.weed.stop()  # (removes the sockets it left)

    def start_again(self) -> None:
        """Start it again on its ports and data; return once it serves an object it held (its
        gateway reports healthy a moment before its volumes answer: 500s, meanwhile)."""
        self.weed = start_seaweedfs(
            self.workdir, access_key=KEY, secret_key=KEY, ports=self.weed.ports
        )
        storage, deadline = self.storage(), time.monotonic() + 30
        while True:
            try:
                storage.get("repo")
                return
            except StorageError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "weed")
    try:
        yield s
    finally:
        s.weed.stop()


def _values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * CHUNK, dtype=np.uint8)


def test_a_session_writing_packs_survives_the_server_killed_and_restarted(server: Server) -> None:
    repo = zarrlake.Repository.create(server.storage())
    with repo.transaction("main", message="first") as store:
        zarr.create_array(store, name="data", shape=(6000 * CHUNK,), chunks=(CHUNK,),
                          dtype="uint8", compressors=None, fill_value=0)  # fmt: skip
    head = repo.lookup_branch("main")
    session = repo.writable_session("main")
    arr = zarr.open_array(session.store, path="data")
    first = _values(3000, 1)
    arr[: first.size] = first  # three packs: two uploaded or uploading, one open in memory
    server.kill()
    second = _values(3000, 2)
    try:
        arr[first.size :] = second  # may fail when a full pack cannot be uploaded
        wrote_second = True
    except StorageError:
        wrote_second = False
    with pytest.raises(StorageError):  # the last packs cannot be written: nothing published
        session.commit("during the outage")
    assert session.read_only is False  # the session keeps its changes

    server.start_again()
    assert zarrlake.Repository.open(server.storage()).lookup_branch("main") == head
    if not wrote_second:
        arr[first.size :] = second
    snapshot = session.commit("after the outage")

    fresh = zarrlake.Repository.open(server.storage())
    assert fresh.lookup_branch("main") == snapshot
    got = zarr.open_array(fresh.readonly_session("main").store, path="data")[:]
    np.testing.assert_array_equal(got, np.concatenate([first, second]))
    report = fresh.fsck(verify_content=True)
    assert report.ok, report.summary()


def test_a_reader_gets_a_typed_error_in_an_outage_and_reads_after_it(server: Server) -> None:
    repo = zarrlake.Repository.create(server.storage())
    values = _values(3000, 3)
    with repo.transaction("main", message="packed") as store:
        zarr.create_array(store, name="data", shape=values.shape, chunks=(CHUNK,),
                          dtype="uint8", compressors=None, fill_value=0)[:] = values  # fmt: skip
    reader = zarrlake.Repository.open(server.storage()).readonly_session("main")
    arr = zarr.open_array(reader.store, path="data")
    np.testing.assert_array_equal(arr[: 500 * CHUNK], values[: 500 * CHUNK])  # windows kept
    server.kill()
    with pytest.raises(StorageError):
        arr[:]  # past what the windows hold: the server is gone
    server.start_again()
    np.testing.assert_array_equal(arr[:], values)
