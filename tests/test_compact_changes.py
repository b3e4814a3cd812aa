"""A session whose changes are frozen into compact runs behaves exactly as one that keeps them in a
dict: the same reads, status, conflicts and merges, and commits that write the very same objects.

Each scenario runs twice on fresh repositories — once with :class:`ChunkChanges` freezing every
3 writes (runs, merges of runs, deletes across runs, all the time), once with a threshold no
scenario reaches — and everything observable is compared, down to the manifest shards' digests.
(The class itself is tested against a dict model in ``test_chunk_changes.py``.)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.format.changes import ChunkChanges

Scenario = Callable[[zarrlake.Repository], dict[str, Any]]


def _observe(repo: zarrlake.Repository, *, ids: bool = False) -> dict[str, Any]:
    """What a reader sees of ``main``: every array's values, and the head's manifest."""
    session = repo.readonly_session("main")
    group = zarr.open_group(session.store, mode="r")
    arrays = {name: a[...].tolist() for name, a in sorted(group.arrays())}
    core = repo.core  # the manifest's shards: the same cut, byte for byte
    snap = core.objects.snapshot(session.base)
    shards = [(s.first, s.last, s.digest, s.count) for s in snap.shards]
    return {"arrays": arrays, "shards": shards, **({"head": session.base} if ids else {})}


def _array(session: zarrlake.Session, name: str = "a", n: int = 40) -> zarr.Array:
    return zarr.create_array(
        session.store,
        name=name,
        shape=(n,),
        chunks=(1,),
        dtype="i8",
        fill_value=-1,
        compressors=None,
    )


def _writes_overwrites_deletes(repo: zarrlake.Repository) -> dict[str, Any]:
    s = repo.writable_session()
    a = _array(s)
    a[:] = np.arange(40)
    a[5:15] = 99  # overwrites, frozen or not
    b = _array(s, "b", 12)
    b[:] = 7
    s.delete_prefix("b")  # a subtree written, then removed wholesale
    c = _array(s, "c", 9)
    c[:] = 3
    for key in ("a/c/0", "a/c/1", "a/c/30"):
        s.delete(key)  # chunks deleted: the fill value shows
    status = s.status()
    seen = zarr.open_array(s.store, path="a")[...].tolist()  # read-your-writes
    s.commit("first")
    # A second commit into the manifest the first made: the changes fall in existing shards.
    s = repo.writable_session()
    a = zarr.open_array(s.store, path="a")
    a[0:40:3] = 5
    s.delete("a/c/2")
    s.delete_prefix("c")
    second = s.status()
    s.commit("second")
    return {
        "read_before_commit": seen,
        "status": repr(status),
        "status_second": repr(second),
        **_observe(repo),
    }


def _rebase_and_conflicts(repo: zarrlake.Repository) -> dict[str, Any]:
    s = repo.writable_session()
    _array(s)[:] = 0
    s.commit("base")
    mine, theirs = repo.writable_session(), repo.writable_session()
    zarr.open_array(theirs.store, path="a")[0:20] = 1
    zarr.open_array(mine.store, path="a")[10:30] = 2  # 10..19 conflict
    theirs.commit("theirs")
    with pytest.raises(zarrlake.ConflictError) as info:
        mine.commit("mine")
    conflicts = sorted(str(c) for c in info.value.conflicts)
    assert mine.has_changes
    mine.commit("mine", solver=zarrlake.UseOurs())
    return {"conflicts": conflicts, **_observe(repo)}


def _forks_and_merges(repo: zarrlake.Repository) -> dict[str, Any]:
    s = repo.writable_session()
    _array(s)[:] = 0
    s.commit("base")
    s = repo.writable_session()
    zarr.open_array(s.store, path="a")[0:8] = 4
    forks = [pickle.loads(pickle.dumps(s.fork())) for _ in range(3)]
    for k, fork in enumerate(forks):
        zarr.open_array(fork.store, path="a")[10 + 10 * k : 16 + 10 * k] = 10 + k
    changesets = [pickle.loads(pickle.dumps(f.changeset())) for f in forks]  # as from a worker
    s.merge(*changesets)
    clash = repo.writable_session()
    fork = clash.fork()
    other = clash.fork()
    zarr.open_array(fork.store, path="a")[0:6] = 1
    zarr.open_array(other.store, path="a")[3:9] = 2
    with pytest.raises(zarrlake.ConflictError) as info:
        clash.merge(fork.changeset(), other.changeset())
    s.commit("forks")
    return {"clash": sorted(str(c) for c in info.value.conflicts), **_observe(repo)}


def _merge_of_branches(repo: zarrlake.Repository) -> dict[str, Any]:
    s = repo.writable_session()
    _array(s)[:] = 0
    s.commit("base")
    repo.create_branch("dev")
    d = repo.writable_session("dev")
    zarr.open_array(d.store, path="a")[20:40] = 8
    d.delete("a/c/39")
    d.commit("dev")
    m = repo.writable_session()
    zarr.open_array(m.store, path="a")[0:10] = 6
    m.commit("main")
    repo.merge("dev", "main")
    return _observe(repo)


SCENARIOS: dict[str, Scenario] = {
    "writes-overwrites-deletes": _writes_overwrites_deletes,
    "rebase-and-conflicts": _rebase_and_conflicts,
    "forks-and-merges": _forks_and_merges,
    "merge-of-branches": _merge_of_branches,
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_frozen_changes_behave_as_a_dict_of_them(
    scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Objects (no packs: their ids are random); many small shards.
    config = {"inline_threshold_bytes": 0, "pack_chunks_below_bytes": 0, "shard_max_refs": 8}
    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 1 << 30)
    plain = scenario(
        zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "d"), config=config)
    )
    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 3)
    frozen = scenario(
        zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "f"), config=config)
    )
    assert frozen == plain
    assert plain["arrays"]  # the scenario ran to its end and read something back
