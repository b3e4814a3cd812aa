"""The storage kinds every backend-parametrized test runs on (imported by conftest and tests;
a module of its own because ``conftest`` is not importable by name once subfolders have one)."""

from __future__ import annotations

from pathlib import Path

import pytest

import zarrlake

#: The S3 API servers the S3 backend is tested against: moto (permissive, fast, what most S3
#: tests use) and SeaweedFS (a real server that only keeps the promises S3 makes: see the listing
#: contract in ``zarrlake.storage.base``).
S3_SERVERS = ["moto", "seaweedfs"]

#: What the engine's tests run on: one kind per backend ("s3" is moto).
STORAGE_KINDS = ["memory", "local", "s3"]
#: Cloud backends on emulators: the storage contract runs on them (tests/test_cloud_storage.py),
#: not every backend-parametrized test (each emulator costs a server).
CLOUD_KINDS = ["azure", "gcs"]

#: What the storage protocol's own tests and the concurrency tests run on: every backend, and the
#: S3 backend on every server of :data:`S3_SERVERS`.
EVERY_STORAGE_KIND = [*STORAGE_KINDS, "s3-seaweedfs"]


def make_storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> zarrlake.Storage:
    if kind == "memory":
        return zarrlake.Storage.memory()
    if kind == "local":
        return zarrlake.Storage.local(tmp_path / "repo")
    if kind == "s3":
        return request.getfixturevalue("moto_s3").storage()
    if kind == "s3-seaweedfs":
        return request.getfixturevalue("seaweedfs_s3").storage()
    if kind == "azure":
        return request.getfixturevalue("azurite").storage()
    if kind == "gcs":
        return request.getfixturevalue("fake_gcs").storage()
    raise ValueError(kind)
