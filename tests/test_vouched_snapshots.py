"""Snapshots too large for a journal entry to carry (issue 42, "snapshots larger than a journal
entry carries"): the entry vouches for them by digest instead, and readers compare what they
read from ``snapshots/<id>`` with it.

A writer given the immutable objects' credentials can overwrite ``snapshots/<id>`` where the
provider cannot make it create-only. A branch head's small snapshot travels in its entry (and
the root), so an overwrite changes nothing a reader sees; a large one did not, and the commit
service refused such commits. Now a read of an overwritten one is an error, never other data,
and the service publishes them.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import os
from pathlib import Path

import pytest
import zarr

import zarrlake
from zarrlake.format.model import JournalEntry, Snapshot, snapshot_key
from zarrlake.service import Caller, CommitService


def _big_commit(repo: zarrlake.Repository, branch: str = "main") -> str:
    """A commit whose snapshot is larger than an entry carries (incompressible attributes)."""
    session = repo.writable_session(branch)
    group = zarr.open_group(session.store, mode="a")
    array = group.create_array("t", shape=(4,), chunks=(2,), dtype="f4", overwrite=True)
    array.attrs["blob"] = base64.b64encode(os.urandom(300_000)).decode()
    array[:] = 1.0
    return session.commit("a large snapshot")


def _overwrite(storage: zarrlake.Storage, snapshot_id: str) -> None:
    """What a writer with the immutable objects' credentials can do: the same id, other bytes."""
    key = snapshot_key(snapshot_id)
    snap = Snapshot.decode(storage.get(key), key)
    storage.put(key, dataclasses.replace(snap, message="not what was committed").encode())


def _head_entry(storage: zarrlake.Storage, branch: str) -> JournalEntry:
    repo = zarrlake.Repository.open(storage)
    entry = repo.core.journal.published_head(branch)
    assert entry is not None
    return entry


def test_an_entry_vouches_for_a_snapshot_too_large_to_carry() -> None:
    data = b"\x00" * (JournalEntry.CARRY_MAX_BYTES + 1)
    when = dt.datetime(2026, 12, 4, tzinfo=dt.UTC)
    entry = JournalEntry(3, "S" * 26, None, when, "w", snapshot_data=data)
    decoded = JournalEntry.decode(entry.encode())
    assert decoded.snapshot_data is None
    assert decoded.snapshot_sha256 == hashlib.sha256(data).hexdigest()
    # Carried, no digest: the bytes are there.
    small = dataclasses.replace(entry, snapshot_data=b"abc")
    assert JournalEntry.decode(small.encode()).snapshot_sha256 is None
    # The digest survives an entry re-encoded without its bytes (the root's stripped heads).
    again = JournalEntry.decode(dataclasses.replace(decoded, snapshot_data=None).encode())
    assert again.snapshot_sha256 == decoded.snapshot_sha256


def test_a_large_snapshot_overwritten_after_its_commit_is_an_error_for_readers(
    tmp_path: Path,
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    head = _big_commit(repo)
    stored = storage.get(snapshot_key(head))
    assert len(stored) > JournalEntry.CARRY_MAX_BYTES
    entry = _head_entry(storage, "main")
    assert entry.snapshot_data is None
    assert entry.snapshot_sha256 == hashlib.sha256(stored).hexdigest()
    # Read as committed by a new client.
    fresh = zarrlake.Repository.open(storage)
    assert zarr.open_array(fresh.readonly_session("main").store, path="t")[:].tolist() == [1] * 4

    _overwrite(storage, head)
    fresh = zarrlake.Repository.open(storage)
    with pytest.raises(zarrlake.CorruptObject, match="overwritten after it was published"):
        zarr.open_array(fresh.readonly_session("main").store, path="t")[:]
    assert fresh.lookup_branch("main") == head  # the ref itself is untouched


def test_the_commit_service_publishes_a_large_snapshot_and_vouches_for_it(
    tmp_path: Path,
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    zarrlake.Repository.create(storage)
    service = CommitService(zarrlake.Repository.open(storage))

    class ThroughService:
        def append(self, name: str, entry: JournalEntry) -> bool:
            return service.append(Caller("wanda", "writer"), name, entry.encode())

    writer = zarrlake.Repository.open(storage)
    writer.core.journal.remote = ThroughService()  # type: ignore[assignment]
    head = _big_commit(writer)  # refused before: "the commit service cannot vouch for it yet"
    entry = _head_entry(storage, "main")
    assert entry.by is not None and entry.by["identity"] == "wanda"
    assert entry.snapshot_sha256 == hashlib.sha256(storage.get(snapshot_key(head))).hexdigest()

    _overwrite(storage, head)
    fresh = zarrlake.Repository.open(storage)
    with pytest.raises(zarrlake.CorruptObject, match="overwritten after it was published"):
        zarr.open_array(fresh.readonly_session("main").store, path="t")[:]

    # An entry that vouches for other bytes than those stored is refused outright.
    forged = dataclasses.replace(
        JournalEntry.decode(storage.get(writer.core.journal.entry_key("main", entry.seq))),
        seq=entry.seq + 1,
        previous=head,
        snapshot_sha256="0" * 64,
    )
    with pytest.raises(zarrlake.InvalidArgument, match="vouches for other bytes"):
        service.append(Caller("wanda", "writer"), "main", forged.encode())
