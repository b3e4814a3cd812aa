"""A writable session never travels to another process by pickling (issue 14, part 1).

The data-loss bug: a copy of a writable session in a worker process takes the writes, the
original commits without them. Pickling a writable session or its store now raises
:class:`zarrlake.WritableSessionPickled` (before anything is written); forks pickle, and their
changes come back through :meth:`Session.merge`. Real worker processes (``spawn``) here.
"""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake

N, CHUNK = 4, 256


def _write_block(args: tuple[Any, int]) -> Any:
    """In a worker process: write block ``i`` through ``target`` (a store, or a fork whose
    changeset goes back)."""
    target, i = args
    store = target.store if isinstance(target, zarrlake.ForkedSession) else target
    arr = zarr.open_array(store, path="a", mode="r+")
    arr[i * CHUNK : (i + 1) * CHUNK] = np.full(CHUNK, i + 1, dtype="f8")
    return target.changeset() if isinstance(target, zarrlake.ForkedSession) else None


@pytest.fixture
def repo(tmp_path: Path) -> zarrlake.Repository:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    with repo.transaction("main", message="create") as store:
        zarr.create_array(store, name="a", shape=(N * CHUNK,), chunks=(CHUNK,), dtype="f8")
    return repo


def test_handing_a_writable_store_to_worker_processes_fails_before_any_write(
    repo: zarrlake.Repository,
) -> None:
    head = repo.lookup_branch("main")
    session = repo.writable_session("main")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool, pytest.raises(zarrlake.WritableSessionPickled, match="fork"):
        pool.map(_write_block, [(session.store, i) for i in range(N)])
    assert not session.has_changes
    with pytest.raises(zarrlake.NothingToCommit):
        session.commit("nothing was written")
    assert repo.lookup_branch("main") == head  # nothing published that lacks the writes


def test_forks_in_worker_processes_bring_their_writes_back(repo: zarrlake.Repository) -> None:
    session = repo.writable_session("main")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        changesets = pool.map(_write_block, [(session.fork(), i) for i in range(N)])
    session.merge(*changesets)
    sid = session.commit("written by worker processes")
    got = zarr.open_array(repo.readonly_session(sid).store, path="a", mode="r")[:]
    np.testing.assert_array_equal(got, np.repeat(np.arange(1, N + 1, dtype="f8"), CHUNK))


def test_read_only_sessions_still_travel(repo: zarrlake.Repository) -> None:
    view = pickle.loads(pickle.dumps(repo.readonly_session("main")))
    assert zarr.open_array(view.store, path="a", mode="r").shape == (N * CHUNK,)


def test_the_reported_dask_processes_case_now_fails_loudly(tmp_path: Path) -> None:
    """Issue 14's report: an xarray Dataset of dask arrays written with ``to_zarr`` under the
    ``processes`` scheduler committed all-NaN arrays. Now the write fails and nothing that lacks
    the data is committed; the threaded scheduler still writes everything."""
    dask = pytest.importorskip("dask")
    da = pytest.importorskip("dask.array")
    xr = pytest.importorskip("xarray")
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    head = repo.lookup_branch("main")
    values = np.random.default_rng(0).random((80, 80))
    ds = xr.Dataset({"t": (("x", "y"), da.from_array(values, chunks=(20, 20)))})

    s = repo.writable_session("main")
    with (
        dask.config.set(scheduler="processes", num_workers=2),
        pytest.raises(zarrlake.WritableSessionPickled),
    ):
        ds.to_zarr(s.store, mode="w", consolidated=False)
    s.discard()
    assert repo.lookup_branch("main") == head

    s = repo.writable_session("main")
    with dask.config.set(scheduler="threads"):
        ds.to_zarr(s.store, mode="w", consolidated=False)
    sid = s.commit("threads")
    got = xr.open_zarr(repo.readonly_session(sid).store, consolidated=False).t.values
    np.testing.assert_array_equal(got, values)
