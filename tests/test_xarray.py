"""xarray on a zarrlake session store: round trips, appends, region writes, and time travel."""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from zarrlake import Repository

NT, NY, NX = 4, 40, 30
CHUNKS = {"temperature": (2, 16, 10), "precip": (4, 20, 15), "elevation": (40, 30)}


def make_dataset(start: str = "2024-01-01", nt: int = NT, seed: int = 0) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    time = pd.date_range(start, periods=nt, freq="D")
    y = np.linspace(-20.0, 19.0, NY)
    x = np.linspace(100.0, 129.0, NX)
    return xr.Dataset(
        {
            "temperature": (
                ("time", "y", "x"),
                rng.normal(15.0, 5.0, (nt, NY, NX)),
                {"units": "degC", "long_name": "air temperature"},
            ),
            "precip": (
                ("time", "y", "x"),
                rng.gamma(1.5, 2.0, (nt, NY, NX)).astype("float32"),
                {"units": "mm/day"},
            ),
            "elevation": (
                ("y", "x"),
                rng.integers(0, 3000, (NY, NX)).astype("int32"),
                {"units": "m"},
            ),
        },
        coords={"time": time, "y": ("y", y, {"units": "degrees_north"}), "x": ("x", x)},
        attrs={"title": "zarrlake xarray test", "version": 1},
    )


def encoding(ds: xr.Dataset) -> dict[str, dict[str, tuple[int, ...]]]:
    return {name: {"chunks": CHUNKS[name]} for name in ds.data_vars if name in CHUNKS}


def read(repo: Repository, ref: str) -> xr.Dataset:
    with xr.open_zarr(repo.readonly_session(ref).store, consolidated=False, chunks=None) as ds:
        return ds.load()


def test_round_trip(repo: Repository) -> None:
    ds = make_dataset()
    session = repo.writable_session()
    ds.to_zarr(session.store, zarr_format=3, consolidated=False, mode="w", encoding=encoding(ds))
    snap = session.commit("write dataset")

    back = read(repo, "main")
    xr.testing.assert_identical(back, ds)
    assert back.temperature.encoding["chunks"] == CHUNKS["temperature"]
    assert back.precip.dtype == np.float32 and back.elevation.dtype == np.int32
    xr.testing.assert_identical(read(repo, snap), ds)
    # Chunks above the inline threshold are objects; the chunk keys the diff reports are the
    # chunk grid xarray laid out.
    d = repo.diff(next(repo.log()).parents[0], snap)
    assert d.changed_chunks["/temperature"] == {
        (t, j, i) for t in range(2) for j in range(3) for i in range(3)
    }
    assert d.changed_chunks["/elevation"] == {(0, 0)}
    assert {"/", "/temperature", "/precip", "/elevation", "/time", "/x", "/y"} <= d.added_nodes


def test_append_region_and_time_travel(repo: Repository) -> None:
    ds = make_dataset()
    s = repo.writable_session()
    ds.to_zarr(s.store, zarr_format=3, consolidated=False, mode="w", encoding=encoding(ds))
    v1 = s.commit("initial")
    repo.create_tag("v1", "main")
    repo.create_branch("dev", "v1")

    # Append two more days along time on the branch.
    more = make_dataset("2024-01-05", nt=2, seed=1)
    s = repo.writable_session("dev")
    more.drop_vars("elevation").to_zarr(s.store, consolidated=False, append_dim="time")
    v2 = s.commit("append two days")
    appended = xr.concat([ds, more.drop_vars("elevation")], dim="time", data_vars="minimal")
    appended["elevation"] = ds.elevation

    # Then overwrite a region of one variable and add a variable (mode="a").
    patch = xr.full_like(appended.temperature.isel(time=slice(1, 5), y=slice(10, 30)), -99.0)
    s = repo.writable_session("dev")
    patch.drop_vars(["time", "y", "x"]).to_dataset().to_zarr(
        s.store, consolidated=False, region={"time": slice(1, 5), "y": slice(10, 30)}
    )
    # (xarray's mode="a" replaces the group's attributes with the written dataset's.)
    wind = xr.Dataset(
        {"wind": (("y", "x"), np.full((NY, NX), 3.5), {"units": "m/s"})}, attrs=ds.attrs
    )
    wind.to_zarr(s.store, consolidated=False, mode="a")
    status = s.status()
    assert status.added_nodes == {"/wind"}
    assert set(status.changed_chunks) == {"/temperature", "/wind"}
    v3 = s.commit("patch a region, add wind")

    expected = appended.copy(deep=True)
    expected["temperature"][1:5, 10:30, :] = -99.0
    expected["wind"] = wind.wind

    # Every version reads back as it was written: by branch, tag and snapshot id.
    xr.testing.assert_identical(read(repo, "main"), ds)
    xr.testing.assert_identical(read(repo, "v1"), ds)
    xr.testing.assert_identical(read(repo, v1), ds)
    xr.testing.assert_identical(read(repo, v2), appended)
    assert read(repo, v2).sizes["time"] == NT + 2
    xr.testing.assert_identical(read(repo, "dev"), expected)
    xr.testing.assert_identical(read(repo, v3), expected)
    assert [c.id for c in repo.log("dev")][:3] == [v3, v2, v1]

    # Only the region's chunks changed in the region commit: time 1..4 -> chunks 0..2,
    # y 10..29 -> chunks 0..1 (of 16), every x chunk.
    d = repo.diff(v2, v3)
    assert d.changed_chunks["/temperature"] == {
        (t, j, i) for t in range(3) for j in range(2) for i in range(3)
    }
    assert d.added_nodes == {"/wind"}
    assert "/precip" not in d.changed_chunks

    # Merging the branch brings main to the branch's content; the tag stays put.
    repo.merge("dev", "main")
    xr.testing.assert_identical(read(repo, "main"), expected)
    xr.testing.assert_identical(read(repo, "v1"), ds)
