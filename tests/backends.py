"""The storage kinds every backend-parametrized test runs on (imported by conftest and tests;
a module of its own because ``conftest`` is not importable by name once subfolders have one)."""

from __future__ import annotations

from pathlib import Path

import pytest

import zarrlake

STORAGE_KINDS = ["memory", "local", "s3"]


def make_storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> zarrlake.Storage:
    if kind == "memory":
        return zarrlake.Storage.memory()
    if kind == "local":
        return zarrlake.Storage.local(tmp_path / "repo")
    if kind == "s3":
        return request.getfixturevalue("moto_s3").storage()
    raise ValueError(kind)
