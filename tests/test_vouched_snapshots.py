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
import pickle
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


def fresh_session(storage: zarrlake.Storage, branch: str) -> object:
    return zarrlake.Repository.open(storage).readonly_session(branch).store


def _read(session: zarrlake.Session) -> list[float]:
    return zarr.open_array(session.store, path="t")[:].tolist()


def _forged_by(storage: zarrlake.Storage, victim: str, donor: str) -> None:
    """``snapshots/<victim>`` rewritten with ``donor``'s content under the victim's id."""
    given = Snapshot.decode(storage.get(snapshot_key(donor)))
    own = Snapshot.decode(storage.get(snapshot_key(victim)))
    forged = dataclasses.replace(given, id=victim, parents=own.parents)
    storage.put(snapshot_key(victim), forged.encode())


def _two_commits(tmp_path: Path, big: bool) -> tuple[zarrlake.Storage, str, str]:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    session = repo.writable_session("main")
    array = zarr.open_group(session.store, mode="w").create_array(
        "t", shape=(4,), chunks=(2,), dtype="f4"
    )
    if big:
        array.attrs["blob"] = base64.b64encode(os.urandom(300_000)).decode()
    array[:] = 1.0
    head = session.commit("ones")
    repo.create_branch("other", head)
    session = repo.writable_session("other")
    zarr.open_array(session.store, path="t", mode="a")[:] = 2.0
    donor = session.commit("twos")
    repo.create_tag("v1", head)
    return storage, head, donor


@pytest.mark.parametrize("big", [True, False], ids=["vouched", "carried"])
def test_a_forged_copy_read_first_by_tag_does_not_reach_the_branch(
    tmp_path: Path, big: bool
) -> None:
    """A tag is read from ``snapshots/<id>`` unchecked; the branch at the same snapshot is
    not: its entry's copy (or digest) wins over the copy the tag's read left in the cache."""
    storage, head, donor = _two_commits(tmp_path, big)
    _forged_by(storage, head, donor)
    fresh = zarrlake.Repository.open(storage)
    assert _read(fresh.readonly_session("v1")) == [2.0] * 4  # tags carry no digest (yet)
    if big:
        with pytest.raises(zarrlake.CorruptObject, match="overwritten after it was published"):
            _read(fresh.readonly_session("main"))
    else:
        assert _read(fresh.readonly_session("main")) == [1.0] * 4


def test_a_pickled_session_checks_as_its_client_does(tmp_path: Path) -> None:
    """A dask worker's copy of a session reads the snapshot again: the vouch travels along."""
    storage, head, donor = _two_commits(tmp_path, big=True)
    session = zarrlake.Repository.open(storage).readonly_session("main")
    assert _read(session) == [1.0] * 4
    _forged_by(storage, head, donor)
    worker = pickle.loads(pickle.dumps(session))
    with pytest.raises(zarrlake.CorruptObject, match="overwritten after it was published"):
        _read(worker)


def test_a_new_branch_carries_the_bytes_as_stored_not_a_re_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot written by another encoder (here: another zstd level) re-encodes to other
    bytes: a branch made at it must vouch for the stored ones, or its readers would be told
    it was overwritten."""
    from zarrlake.format import codec

    monkeypatch.setattr(codec, "ZSTD_LEVEL", 3)
    monkeypatch.setattr(codec._local, "zstd", None, raising=False)
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    head = _big_commit(repo)
    monkeypatch.setattr(codec, "ZSTD_LEVEL", 1)
    monkeypatch.setattr(codec._local, "zstd", None, raising=False)
    repo = zarrlake.Repository.open(storage)
    assert repo.core.objects.snapshot(head).encode() != storage.get(snapshot_key(head))
    repo.create_branch("dev", head)
    repo.create_branch("other")
    repo.reset_branch("other", head)
    assert zarr.open_array(fresh_session(storage, "other"), path="t")[:].tolist() == [1] * 4
    fresh = zarrlake.Repository.open(storage)
    assert zarr.open_array(fresh.readonly_session("dev").store, path="t")[:].tolist() == [1] * 4
