"""The error hierarchy: one module, old import paths still work, ``Conflict.kind`` an Enum."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

import zarrlake
import zarrlake.spark
import zarrlake.storage
import zarrlake.storage.base
from zarrlake import errors
from zarrlake.errors import Conflict, ConflictError, ConflictKind

MOVED = [
    "StorageError",
    "ObjectNotFound",
    "PreconditionFailed",
    "TransientStorageError",
]


@pytest.mark.parametrize("name", MOVED)
def test_storage_errors_keep_their_old_import_paths(name: str) -> None:
    cls = getattr(errors, name)
    assert getattr(zarrlake.storage, name) is cls
    assert getattr(zarrlake.storage.base, name) is cls
    assert issubclass(cls, zarrlake.ZarrlakeError)


def test_spark_write_error_keeps_its_old_import_path() -> None:
    assert zarrlake.spark.SparkWriteError is errors.SparkWriteError
    e = errors.SparkWriteError("failed", partition=3, reason="ValueError: x")
    assert (e.partition, e.reason, str(e)) == (3, "ValueError: x", "failed")
    assert isinstance(e, zarrlake.ZarrlakeError)


def test_every_error_class_derives_from_zarrlake_error() -> None:
    classes = [
        v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)
    ]
    assert len(classes) > 15
    assert all(issubclass(c, errors.ZarrlakeError) for c in classes)


def test_storage_error_facts() -> None:
    missing = errors.ObjectNotFound("chunks/ab/cd")
    assert missing.key == "chunks/ab/cd" and str(missing) == "object not found: chunks/ab/cd"
    assert isinstance(missing, KeyError) and isinstance(missing, errors.StorageError)
    taken = errors.PreconditionFailed("refs/branch.main/ff")
    assert taken.key == "refs/branch.main/ff"
    assert str(taken) == "object already exists: refs/branch.main/ff"
    assert issubclass(errors.TransientStorageError, errors.StorageError)


# -- Conflict.kind ---------------------------------------------------------------------------------

# Every kind the engine reports today (grep ``Conflict(`` in client/), and the one the docs named.
KINDS = ["chunk", "node", "deleted-theirs", "deleted-ours", "resized", "branch-moved"]


def test_conflict_kinds_cover_what_the_engine_reports() -> None:
    assert {k.value for k in ConflictKind} == {*KINDS, "branch-reset"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_plain_string_kind_becomes_the_enum(kind: str) -> None:
    c = Conflict(kind, "a/b", (1, 2))
    assert type(c.kind) is ConflictKind
    assert c.kind is ConflictKind(kind)
    assert c.kind == kind  # existing comparisons with strings keep working
    assert c == Conflict(ConflictKind(kind), "a/b", (1, 2))
    assert hash(c) == hash(Conflict(ConflictKind(kind), "a/b", (1, 2)))
    assert Conflict(kind=kind, path="a/b", chunk=(1, 2)) == c  # keywords, as users write them


def test_conflict_reads_as_before() -> None:
    assert str(Conflict("chunk", "a/b", (1, 2))) == "chunk conflict at a/b[1,2]"
    assert str(Conflict(ConflictKind.NODE, "")) == "node conflict at /"
    assert f"{ConflictKind.DELETED_OURS}" == "deleted-ours"
    err = ConflictError([Conflict("resized", "x", (0,))])
    assert str(err) == "1 conflict(s): resized conflict at x[0]"


def test_conflict_kind_serializes_as_its_string() -> None:
    c = Conflict("deleted-theirs", "g/a", (3,))
    doc = json.dumps({"kind": c.kind, "path": c.path, "chunk": c.chunk})
    assert json.loads(doc) == {"kind": "deleted-theirs", "path": "g/a", "chunk": [3]}


def test_conflict_pickles_and_replaces() -> None:
    c = Conflict("chunk", "a", (0, 1))
    again = pickle.loads(pickle.dumps(c))
    assert again == c and again.kind is ConflictKind.CHUNK
    other = dataclasses.replace(c, kind=ConflictKind.NODE, chunk=None)
    assert other == Conflict(ConflictKind.NODE, "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kind = ConflictKind.NODE  # type: ignore[misc]


def test_unknown_conflict_kind_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown conflict kind 'nope'.*chunk"):
        Conflict("nope", "a")
