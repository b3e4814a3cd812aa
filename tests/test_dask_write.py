"""``zarrlake.dask.to_zarrlake``: xarray and dask data written from any dask scheduler (issue 14).

Real dask everywhere: the threaded and synchronous schedulers, the ``processes`` scheduler (a pool
of spawned worker processes) and a ``distributed`` ``LocalCluster`` of two worker processes. The
oracle is xarray itself: the same Dataset written with plain ``to_zarr`` (synchronously) into a
Zarr ``MemoryStore`` must read back identical to what ``to_zarrlake`` committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
import zarr.storage

import zarrlake
from zarrlake.dask import to_zarrlake

pytestmark = pytest.mark.filterwarnings(
    "ignore:Consolidated metadata is currently not part:UserWarning"
)

SCHEDULERS = ["threads", "sync", "processes", "distributed"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two worker processes, one thread each (the client is never made the global default)."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as c,
        Client(c, set_as_default=False) as client,
    ):
        yield client


@pytest.fixture
def scheduler(request: pytest.FixtureRequest) -> Iterator[str]:
    name = request.param
    if name == "distributed":
        client = request.getfixturevalue("cluster")
        with dask.config.set(scheduler=client):
            yield name
    else:
        with dask.config.set(scheduler=name):
            yield name


@pytest.fixture
def repo(tmp_path: Path) -> zarrlake.Repository:
    return zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))


def weather(days: int = 40, start: str = "2026-01-01", seed: int = 0) -> xr.Dataset:
    """A small Dataset with what real ones have: a time axis, NaNs, a numpy variable, an encoded
    variable, a dask-backed non-index coordinate."""
    rng = np.random.default_rng(seed)
    nx = 30
    temp = rng.normal(280, 5, (days, nx))
    temp[3, 4] = np.nan
    ds = xr.Dataset(
        {
            "temp": (("time", "x"), temp, {"units": "K"}),
            "count": (("time", "x"), rng.integers(0, 1000, (days, nx)).astype("f8")),
        },
        coords={
            "time": pd.date_range(start, periods=days, freq="D"),
            "x": np.arange(nx),
            "quality": (("time",), rng.random(days)),
        },
    ).chunk({"time": 10, "x": 15})
    ds["static"] = ("x", np.linspace(0, 1, nx))  # stays a numpy array
    ds.attrs["title"] = "test"
    return ds


ENCODING = {"count": {"dtype": "i2", "scale_factor": 0.5, "_FillValue": -1}}


def oracle(*writes: tuple[xr.Dataset, dict[str, Any]]) -> xr.Dataset:
    """What plain xarray, writing synchronously into a Zarr MemoryStore, reads back."""
    store = zarr.storage.MemoryStore()
    with dask.config.set(scheduler="sync"):
        for ds, kwargs in writes:
            ds.to_zarr(store, consolidated=False, **kwargs)
    return xr.open_zarr(store, consolidated=False).compute()


def committed(repo: zarrlake.Repository, **kwargs: Any) -> xr.Dataset:
    store = repo.readonly_session("main").store
    return xr.open_zarr(store, consolidated=False, **kwargs).compute()


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", SCHEDULERS, indirect=True)
def test_writes_what_xarray_writes_from_every_scheduler(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    ds = weather()
    session = repo.writable_session("main")
    to_zarrlake(ds, session, mode="w", encoding=ENCODING, consolidated=False)
    session.commit(f"weather from {scheduler}")
    got = committed(repo)
    xr.testing.assert_identical(got, oracle((ds, {"mode": "w", "encoding": ENCODING})))
    assert int(got["temp"].isnull().sum()) == 1  # the one NaN, not a lost block of fill values


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["threads", "distributed"], indirect=True)
def test_append_along_time_with_blocks_that_straddle_chunks(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    first, second = weather(25), weather(31, start="2026-01-26", seed=1)
    session = repo.writable_session("main")
    to_zarrlake(first, session, mode="w", consolidated=False)
    session.commit("first 25 days")

    # The stored last chunk is partial (days 20-24) and the new dask chunks (10 days) start in it:
    # xarray's own check refuses that, and with safe_chunks=False to_zarrlake realigns the blocks
    # so that no stored chunk is written by two workers.
    session = repo.writable_session("main")
    with pytest.raises(ValueError, match=r"align|chunk"):
        to_zarrlake(second, session, append_dim="time")
    session.discard()
    to_zarrlake(second, session, append_dim="time", safe_chunks=False)
    session.commit("31 more days")

    want = oracle((first, {"mode": "w"}), (second, {"append_dim": "time", "safe_chunks": False}))
    got = committed(repo)
    assert got.sizes["time"] == 56
    xr.testing.assert_identical(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["processes", "distributed"], indirect=True)
def test_region_writes_explicit_and_auto(repo: zarrlake.Repository, scheduler: str) -> None:
    ds = weather()
    template = xr.zeros_like(ds).chunk({"time": 10, "x": 15})
    session = repo.writable_session("main")
    to_zarrlake(template, session, mode="w", consolidated=False)
    session.commit("zeros")

    part = ds.isel(time=slice(10, 30)).drop_vars(["x", "static"])
    session = repo.writable_session("main")
    to_zarrlake(part.drop_vars("time"), session, region={"time": slice(10, 30)})
    session.commit("days 10-29 by explicit region")
    later = ds.isel(time=slice(30, 40)).drop_vars(["static"])
    session = repo.writable_session("main")
    to_zarrlake(later, session, region="auto")
    session.commit("days 30-39 found by their coordinates")

    want = oracle(
        (template, {"mode": "w"}),
        (part.drop_vars("time"), {"region": {"time": slice(10, 30)}}),
        (later, {"region": "auto"}),
    )
    got = committed(repo)
    xr.testing.assert_identical(got, want)
    assert float(got["temp"].isel(time=5).sum()) == 0.0  # outside both regions: untouched
    np.testing.assert_array_equal(got["temp"].isel(time=slice(10, 40)), ds["temp"][10:40])


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_mode_a_minus_leaves_existing_variables_without_the_append_dim(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    ds = weather(20)
    ds["rank"] = ("x", da.arange(30, chunks=15))
    session = repo.writable_session("main")
    to_zarrlake(ds, session, mode="w", consolidated=False)
    more = weather(10, start="2026-01-21", seed=2)
    more["rank"] = ("x", da.arange(100, 130, chunks=15))
    to_zarrlake(more, session, mode="a-", append_dim="time")
    session.commit("two calls, one commit")
    got = committed(repo)
    assert got.sizes["time"] == 30
    np.testing.assert_array_equal(got["rank"], np.arange(30))  # "a-": not overwritten
    np.testing.assert_array_equal(got["temp"][20:], more["temp"])


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_dataarray_reads_back_with_open_dataarray(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    unnamed = xr.DataArray(da.random.random((40, 30), chunks=(10, 15)), dims=("y", "x"))
    unnamed = unnamed.rename(None)  # (xarray names it after the dask array)
    named_like_coord = xr.DataArray(
        da.ones((40,), chunks=10), dims="y", coords={"y": np.arange(40)}, name="y2"
    )
    session = repo.writable_session("main")
    to_zarrlake(unnamed, session, group="a", mode="w")
    to_zarrlake(named_like_coord, session, group="b", mode="w")
    session.commit("two DataArrays")
    store = repo.readonly_session("main").store
    got = xr.open_dataarray(store, group="a", engine="zarr", consolidated=False).compute()
    assert got.name is None
    np.testing.assert_array_equal(got, unnamed.compute())
    got = xr.open_dataarray(store, group="b", engine="zarr", consolidated=False)
    assert got.name == "y2" and float(got.sum()) == 40


@pytest.mark.parametrize("scheduler", ["processes"], indirect=True)
def test_dask_arrays_create_region_append_and_irregular_chunks(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    values = np.arange(60 * 8, dtype="f8").reshape(60, 8)
    irregular = da.from_array(values, chunks=((7, 23, 30), (3, 5)))
    session = repo.writable_session("main")
    to_zarrlake(irregular, session, component="raw/grid", chunks=(10, 4), fill_value=-1.0)
    with pytest.raises(zarr.errors.ContainsArrayError):
        to_zarrlake(irregular, session, component="raw/grid")  # exists, and no overwrite
    session.commit("create")

    session = repo.writable_session("main")
    patch = da.full((20, 8), 7.0, chunks=(5, 8))
    to_zarrlake(patch, session, group="raw", component="grid", region=(slice(20, 40), slice(0, 8)))
    tail = da.from_array(np.full((15, 8), 9.0), chunks=(4, 8))
    to_zarrlake(tail, session, component="raw/grid", append_dim=0)
    session.commit("patch and append")

    arr = zarr.open_array(repo.readonly_session("main").store, path="raw/grid", mode="r")
    want = values.copy()
    want[20:40] = 7.0
    want = np.concatenate([want, np.full((15, 8), 9.0)])
    assert arr.shape == (75, 8) and arr.chunks == (10, 4)
    np.testing.assert_array_equal(arr[:], want)


def test_memory_storage_works_with_threads_and_is_refused_for_processes() -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    ds = weather(20)
    session = repo.writable_session("main")
    with (
        dask.config.set(scheduler="processes"),
        pytest.raises(zarrlake.ZarrlakeError, match="own copy"),
    ):
        to_zarrlake(ds, session, mode="w")
    assert not session.has_changes  # refused before anything was written
    with dask.config.set(scheduler="threads"):
        to_zarrlake(ds, session, mode="w", consolidated=False)
    session.commit("from threads")
    xr.testing.assert_identical(committed(repo), oracle((ds, {"mode": "w"})))


def _fail_on_third_block(block: np.ndarray[Any, Any], block_info: Any = None) -> Any:
    if block_info[0]["chunk-location"] == (2,):
        raise RuntimeError("sensor 3 broke")
    return block


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_a_failing_task_brings_nothing_of_the_call_into_the_session(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    with repo.transaction("main", message="create") as store:
        zarr.create_array(store, name="v", shape=(40,), chunks=(10,), dtype="f8")
    head = repo.lookup_branch("main")
    data = da.ones(40, chunks=10).map_blocks(_fail_on_third_block, dtype="f8")
    session = repo.writable_session("main")
    with pytest.raises(RuntimeError, match="sensor 3 broke"):
        to_zarrlake(data, session, component="v", region=(slice(0, 40),))
    assert not session.has_changes  # the three blocks that were written did not come back
    with pytest.raises(zarrlake.NothingToCommit):
        session.commit("nothing")
    assert repo.lookup_branch("main") == head


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_a_second_call_overwrites_the_first_without_a_conflict(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    ds = weather(20)
    session = repo.writable_session("main")
    to_zarrlake(ds, session, mode="w", consolidated=False)
    to_zarrlake(ds * 2, session, mode="a")  # forked after the first merge: it saw it
    session.commit("twice")
    got = committed(repo)
    np.testing.assert_array_equal(got["count"], ds["count"] * 2)


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_workers_write_to_s3(moto_s3: Any, scheduler: str) -> None:
    repo = zarrlake.Repository.create(moto_s3.storage())
    ds = weather()
    session = repo.writable_session("main")
    to_zarrlake(ds, session, mode="w", consolidated=False)
    session.commit("to S3 from worker processes")
    xr.testing.assert_identical(committed(repo), oracle((ds, {"mode": "w"})))


def test_bad_calls_get_clear_errors(repo: zarrlake.Repository) -> None:
    ds = weather(10)
    session = repo.writable_session("main")
    with pytest.raises(TypeError, match="compute"):
        to_zarrlake(ds, session, compute=False)
    with pytest.raises(TypeError, match="xarray Dataset or DataArray or a dask array"):
        to_zarrlake(np.zeros(3), session)
    with pytest.raises(TypeError, match="writable zarrlake Session"):
        to_zarrlake(ds, session.store)  # type: ignore[arg-type]
    with pytest.raises(zarrlake.ReadOnlyError):
        to_zarrlake(ds, repo.readonly_session("main"))
    with pytest.raises(TypeError, match="axis number"):
        to_zarrlake(da.ones(3, chunks=1), session, component="a", append_dim="time")
    to_zarrlake(ds, session, mode="w", consolidated=False)
    session.commit("ok")
    with pytest.raises(zarrlake.ReadOnlyError, match="committed"):
        to_zarrlake(ds, session)


# -- Session.merge: forks conflict only with work they did not see -------------------------------


def test_merge_conflicts_only_between_forks_that_did_not_see_each_other(
    repo: zarrlake.Repository,
) -> None:
    with repo.transaction("main", message="create") as store:
        zarr.create_array(store, name="a", shape=(4,), chunks=(2,), dtype="i4")
    session = repo.writable_session("main")

    def fork_writing(value: int) -> zarrlake.ForkedSession:
        fork = session.fork()
        zarr.open_array(fork.store, path="a", mode="r+")[:2] = value
        return fork

    early = fork_writing(1)
    concurrent = fork_writing(2)
    session.merge(early.changeset())
    with pytest.raises(zarrlake.ConflictError):  # made before that merge, wrote differently
        session.merge(concurrent.changeset())
    later = fork_writing(3)  # saw the merge of `early`: overwriting it is a write
    session.merge(later.changeset())
    with pytest.raises(zarrlake.ConflictError):  # two forks merged together still conflict
        session.merge(fork_writing(4).changeset(), fork_writing(5).changeset())
    session.commit("3 wins")
    arr = zarr.open_array(repo.readonly_session("main").store, path="a", mode="r")
    np.testing.assert_array_equal(arr[:2], [3, 3])


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_the_reported_case_fails_loudly_and_names_to_zarrlake(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    """Issue 14's report: ``ds.to_zarr(session.store)`` on a LocalCluster of worker processes
    committed fill values. It now fails before any write, and says what to use."""
    session = repo.writable_session("main")
    with pytest.raises(Exception) as raised:  # distributed wraps it: "Could not serialize ..."
        weather().to_zarr(session.store, mode="w", consolidated=False)
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    pickled = [e for e in chain if isinstance(e, zarrlake.WritableSessionPickled)]
    assert pickled, chain
    assert "zarrlake.dask.to_zarrlake" in str(pickled[0])
    written = set(session.status().changed_chunks)  # xarray wrote the numpy variables itself
    assert written == {"/static", "/time", "/x"}  # and no worker wrote a chunk of the dask ones


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_read_only_sessions_read_from_worker_processes(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    ds = weather()
    session = repo.writable_session("main")
    to_zarrlake(ds, session, mode="w", consolidated=False, zarr_format=2)
    session.commit("zarr v2 arrays")
    lazy = xr.open_zarr(repo.readonly_session("main").store, consolidated=False)
    assert lazy["temp"].chunks is not None  # dask-backed: the workers read the chunks
    total = lazy["temp"].sum().compute()  # the read-only store travels to the workers
    assert float(total) == pytest.approx(float(ds["temp"].sum()))
    xr.testing.assert_identical(lazy.compute(), oracle((ds, {"mode": "w", "zarr_format": 2})))


def test_merge_refuses_a_delete_and_a_write_that_did_not_see_each_other(
    repo: zarrlake.Repository,
) -> None:
    """One fork deletes a group, another writes into it: merged together (either order) that is
    a conflict, never the silent loss of the writes; forks from before a discard are refused."""
    with repo.transaction("main", message="create") as store:
        zarr.create_array(store, name="g/a", shape=(4,), chunks=(2,), dtype="i4")
    session = repo.writable_session("main")

    def writer() -> zarrlake.ForkedSession:
        fork = session.fork()
        zarr.open_array(fork.store, path="g/a", mode="r+")[:] = 7
        return fork

    def deleter() -> zarrlake.ForkedSession:
        fork = session.fork()
        asyncio.run(fork.store.delete_dir("g"))
        return fork

    for first, second in ((writer, deleter), (deleter, writer)):
        a, b = first(), second()
        with pytest.raises(zarrlake.ConflictError):
            session.merge(a.changeset(), b.changeset())
    stale = writer()
    session.discard()
    with pytest.raises(zarrlake.ZarrlakeError, match="before discard"):
        session.merge(stale.changeset())
    session.merge(writer().changeset())  # a fork made after the discard is fine
    session.commit("7s")
    got = zarr.open_array(repo.readonly_session("main").store, path="g/a", mode="r")[:]
    np.testing.assert_array_equal(got, [7, 7, 7, 7])


def _fail_late(block: np.ndarray[Any, Any], block_info: Any = None) -> Any:
    if block_info is not None and block_info[0]["chunk-location"][0] == 1:
        raise RuntimeError("the model crashed on day 11")
    return block


@pytest.mark.parametrize("scheduler", ["distributed"], indirect=True)
def test_a_failed_append_leaves_the_session_as_it_was_and_a_retry_appends_once(
    repo: zarrlake.Repository, scheduler: str
) -> None:
    first, more = weather(20), weather(20, start="2026-01-21", seed=3)
    session = repo.writable_session("main")
    to_zarrlake(first, session, mode="w", consolidated=False)
    session.commit("20 days")

    session = repo.writable_session("main")
    broken = more.copy()
    broken["temp"] = broken["temp"].copy(
        data=broken["temp"].data.map_blocks(_fail_late, dtype="f8")
    )
    with pytest.raises(RuntimeError, match="day 11"):
        to_zarrlake(broken, session, append_dim="time")
    assert not session.has_changes  # not even the resize or the new time coordinates
    to_zarrlake(more, session, append_dim="time")  # the retry
    session.commit("20 more days")
    got = committed(repo)
    assert got.sizes["time"] == 40
    xr.testing.assert_identical(got, oracle((first, {"mode": "w"}), (more, {"append_dim": "time"})))
