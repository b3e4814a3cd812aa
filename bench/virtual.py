"""Reading a NetCDF4 file through zarrlake's virtual chunks vs reading the file itself.

    python bench/virtual.py [--quick] [--no-s3] [--rounds N]

One NetCDF4/HDF5 file (xarray + h5netcdf: float32, zlib + shuffle, chunked) is imported as
virtual refs (kerchunk's ``SingleHdf5ToZarr``, then ``zarrlake.virtual.import_kerchunk``, pinned
by mtime or ETag), on a local directory and on S3 (``moto_server`` on a loopback port, started
and stopped here). Then, each from a fresh open, the whole variable is read:

- **zarrlake**: ``xarray.open_zarr(repo.readonly_session(...).store, chunks=None)`` — the
  manifest, then the chunks straight from the file (conditional ranged reads, adjacent ranges
  coalesced); ``chunks=None`` so that neither side goes through dask;
- **xarray**: ``xarray.open_dataset(file, engine="h5netcdf")`` — HDF5's own B-tree walk;
- **h5py**: ``h5py.File(file)["t2m"][:]``.

On S3 the file is read by h5py/h5netcdf through a Python file object whose reads are ranged GETs
of the same zarrlake S3 storage (buffered in 1 MiB blocks), so both sides use one HTTP client.
The best of ``--rounds`` counts; every result is checked equal to the data written.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zarrlake
from harness import REGION, S3Server, progress
from zarrlake.virtual import import_kerchunk

warnings.simplefilter("ignore")


class RangedFile(io.RawIOBase):
    """A read-only file over ranged GETs of one object of a zarrlake storage."""

    def __init__(self, storage: zarrlake.Storage, key: str) -> None:
        info = storage.head(key)
        assert info is not None
        self.storage, self.key, self.size, self.pos = storage, key, info.size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        end = min(self.size, self.pos + len(buffer))
        if end <= self.pos:
            return 0
        data = self.storage.get(self.key, (self.pos, end))
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def best(fn: Callable[[], np.ndarray], expected: np.ndarray, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t)
        np.testing.assert_array_equal(got, expected)
    return min(times)


def make_file(path: Path, shape: tuple[int, int, int]) -> np.ndarray:
    rng = np.random.default_rng(0)
    data = rng.normal(280, 5, shape).astype("f4").round(2)
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), data)})
    chunks = (max(1, shape[0] // 12), shape[1] // 2, shape[2] // 4)
    ds.to_netcdf(
        path,
        engine="h5netcdf",
        encoding={"t2m": {"zlib": True, "shuffle": True, "complevel": 3, "chunksizes": chunks}},
    )
    return data


def refs_of(path: Path, url: str) -> dict[str, Any]:
    from kerchunk.hdf import SingleHdf5ToZarr

    with open(path, "rb") as f:
        refs: dict[str, Any] = SingleHdf5ToZarr(f, url).translate()
    return refs


def run_local(work: Path, path: Path, data: np.ndarray, rounds: int) -> dict[str, float]:
    config = {"virtual_containers": [{"url_prefix": path.parent.as_uri() + "/"}]}
    storage = zarrlake.Storage.local(work / "repo")
    repo = zarrlake.Repository.create(storage, config=config)
    s = repo.writable_session()
    import_kerchunk(refs_of(path, path.as_uri()), s)
    s.commit("import")

    def via_zarrlake() -> np.ndarray:
        fresh = zarrlake.Repository.open(storage)
        ds = xr.open_zarr(fresh.readonly_session().store, consolidated=False, chunks=None)
        return np.asarray(ds.t2m.values)

    def via_xarray() -> np.ndarray:
        with xr.open_dataset(path, engine="h5netcdf") as ds:
            return np.asarray(ds.t2m.values)

    def via_h5py() -> np.ndarray:
        import h5py

        with h5py.File(path) as f:
            return np.asarray(f["t2m"][:])

    return {
        "zarrlake (virtual)": best(via_zarrlake, data, rounds),
        "xarray + h5netcdf": best(via_xarray, data, rounds),
        "h5py": best(via_h5py, data, rounds),
    }


def run_s3(path: Path, data: np.ndarray, rounds: int) -> dict[str, float]:
    server = S3Server.start(log=os.devnull)
    try:
        client = server.client()
        client.upload_file(str(path), server.bucket, "archive/a.nc")
        container = f"s3://{server.bucket}/archive/"
        config = {
            "virtual_containers": [
                {"url_prefix": container, "endpoint_url": server.endpoint, "region": REGION}
            ]
        }
        storage = zarrlake.Storage.s3(
            server.bucket, "repo", endpoint_url=server.endpoint, region=REGION, allow_http=True
        )
        repo = zarrlake.Repository.create(storage, config=config)
        s = repo.writable_session()
        import_kerchunk(refs_of(path, container + "a.nc"), s)
        s.commit("import")
        source = zarrlake.Storage.s3(
            server.bucket, "archive", endpoint_url=server.endpoint, region=REGION, allow_http=True
        )

        def via_zarrlake() -> np.ndarray:
            fresh = zarrlake.Repository.open(storage)
            ds = xr.open_zarr(fresh.readonly_session().store, consolidated=False, chunks=None)
            return np.asarray(ds.t2m.values)

        def opened() -> io.BufferedReader:
            return io.BufferedReader(RangedFile(source, "a.nc"), buffer_size=1 << 20)

        def via_xarray() -> np.ndarray:
            with xr.open_dataset(opened(), engine="h5netcdf") as ds:
                return np.asarray(ds.t2m.values)

        def via_h5py() -> np.ndarray:
            import h5py

            with h5py.File(opened()) as f:
                return np.asarray(f["t2m"][:])

        return {
            "zarrlake (virtual)": best(via_zarrlake, data, rounds),
            "xarray + h5netcdf": best(via_xarray, data, rounds),
            "h5py": best(via_h5py, data, rounds),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 16 MiB file instead of 128 MiB")
    parser.add_argument("--no-s3", action="store_true", help="only the local directory")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shape = (48, 180, 480) if args.quick else (192, 360, 480)
    work = Path(tempfile.mkdtemp(prefix="zarrlake-virtual-"))
    try:
        (work / "archive").mkdir()
        path = work / "archive" / "a.nc"
        progress(f"writing a NetCDF4 file of {shape} float32")
        data = make_file(path, shape)
        mib = data.nbytes / 2**20
        results = {"local": run_local(work, path, data, args.rounds)}
        progress("local done")
        if not args.no_s3:
            results["S3 (moto)"] = run_s3(path, data, args.rounds)
            progress("S3 done")
        size = path.stat().st_size / 2**20
        print(f"\nreading {mib:.0f} MiB (file {size:.0f} MiB), best of {args.rounds}\n")
        head = ("storage", "reader", "seconds", "MiB/s", "vs xarray")
        print("| {:<10} | {:<20} | {:>8} | {:>8} | {:>9} |".format(*head))
        print(f"|{'-' * 12}|{'-' * 22}|{'-' * 10}|{'-' * 10}|{'-' * 11}|")
        for where, row in results.items():
            base = row["xarray + h5netcdf"]
            for reader, seconds in row.items():
                print(
                    f"| {where:<10} | {reader:<20} | {seconds:8.3f} | {mib / seconds:8.1f} "
                    f"| {base / seconds:8.2f}x |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
