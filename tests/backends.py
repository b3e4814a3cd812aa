"""The storage kinds every backend-parametrized test runs on (imported by conftest and tests;
a module of its own because ``conftest`` is not importable by name once subfolders have one)."""

from __future__ import annotations

from pathlib import Path

import pytest

import zarrlake

STORAGE_KINDS = ["memory", "local", "s3"]
#: Cloud backends on emulators: the storage contract runs on them (tests/test_cloud_storage.py),
#: not every backend-parametrized test (each emulator costs a server).
CLOUD_KINDS = ["azure", "gcs"]


def make_storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> zarrlake.Storage:
    if kind == "memory":
        return zarrlake.Storage.memory()
    if kind == "local":
        return zarrlake.Storage.local(tmp_path / "repo")
    if kind == "s3":
        return request.getfixturevalue("moto_s3").storage()
    if kind == "azure":
        return request.getfixturevalue("azurite").storage()
    if kind == "gcs":
        return request.getfixturevalue("fake_gcs").storage()
    raise ValueError(kind)
