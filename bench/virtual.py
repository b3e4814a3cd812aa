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
- **h5py**: ``h5py.File(file)["t2m"][:]``;
- **Icechunk**: the same refs in an Icechunk 2.x repository on the same storage, read the way
  zarrlake is (in the peers' Python, ``bench/peers-venv.sh``; skipped without it).

"zarrlake vs it" is the other reader's time ÷ zarrlake's: above 1, zarrlake is faster.

On S3 the file is read by h5py/h5netcdf through a Python file object whose reads are ranged GETs
of the same zarrlake S3 storage (buffered in 1 MiB blocks), so both sides use one HTTP client.
The best of ``--rounds`` counts; every result is checked equal to the data written.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
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
from harness import CREDENTIALS, REGION, S3Server, progress
from zarrlake.format.model import VIRTUAL
from zarrlake.virtual import import_kerchunk

ROOT = Path(__file__).resolve().parent.parent

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


#: Icechunk (in the peers' Python: it needs >= 3.12) reading the same refs: the array's
#: ``zarr.json`` as zarrlake's import wrote it, and each chunk's (url, offset, length), set with
#: ``set_virtual_refs`` into a fresh Icechunk repository on the same storage; then, each round
#: from a fresh open, ``xarray.open_zarr(store, chunks=None)`` as zarrlake's reader does.
PEERS_READER = r"""
import json, sys, time
import numpy as np, xarray as xr, zarr, icechunk
spec = json.load(open(sys.argv[1]))
expected = np.load(sys.argv[2])
s3 = spec.get("s3")
prefix = spec["prefix"]
config = icechunk.RepositoryConfig.default()
if s3:
    store = icechunk.s3_store(region=s3["region"], endpoint_url=s3["endpoint"], allow_http=True,
                              s3_compatible=True, force_path_style=True)
    creds = icechunk.containers_credentials({prefix: icechunk.s3_credentials(
        access_key_id=s3["key"], secret_access_key=s3["secret"])})
    def storage():
        return icechunk.s3_storage(bucket=s3["bucket"], prefix="icechunk", region=s3["region"],
                                   endpoint_url=s3["endpoint"], allow_http=True,
                                   access_key_id=s3["key"], secret_access_key=s3["secret"],
                                   force_path_style=True)
else:
    store = icechunk.local_filesystem_store(spec["source_dir"])
    creds = {prefix: None}
    def storage():
        return icechunk.local_filesystem_storage(spec["repo_dir"])
config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(prefix, store))
repo = icechunk.Repository.create(storage(), config, authorize_virtual_chunk_access=creds)
session = repo.writable_session("main")
Buffer = zarr.core.buffer.cpu.Buffer
for key, doc in spec["metadata"].items():
    meta = json.loads(doc)
    if meta.get("node_type") == "array":  # Icechunk takes only the default chunk key encoding
        meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
    zarr.core.sync.sync(session.store.set(key, Buffer.from_bytes(json.dumps(meta).encode())))
for path, refs in spec["refs"].items():
    chunks = [icechunk.VirtualChunkSpec(c, url, off, n) for c, url, off, n in refs]
    assert session.store.set_virtual_refs(path, chunks, validate_containers=True) is None
session.commit("refs")
times = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    fresh = icechunk.Repository.open(storage(), config, authorize_virtual_chunk_access=creds)
    ds = xr.open_zarr(fresh.readonly_session("main").store, consolidated=False, chunks=None)
    got = np.asarray(ds.t2m.values)
    times.append(time.perf_counter() - t)
    np.testing.assert_array_equal(got, expected)
print(min(times))
"""


def icechunk_read(
    repo: zarrlake.Repository, spec: dict[str, Any], data: np.ndarray, rounds: int, work: Path
) -> float | None:
    """Icechunk's best time reading the refs ``repo`` holds, or None without the peers' venv."""
    peers = ROOT / ".venv-peers" / "bin" / "python"
    if not peers.exists():
        progress("no .venv-peers (bench/peers-venv.sh): Icechunk not run")
        return None
    session = repo.readonly_session()
    metadata, refs = {}, {}
    for key in session.list_prefix(""):
        value = session.resolve(key)
        if key.endswith("zarr.json"):
            assert isinstance(value, bytes)
            metadata[key] = value.decode()
        elif isinstance(value, tuple) and value[0] == VIRTUAL:
            array, _, name = key.rpartition("/")
            coords = [int(c) for c in name.split(".")]
            refs.setdefault(array, []).append([coords, value[1], value[2], value[3]])
    spec = {**spec, "metadata": metadata, "refs": refs}
    spec_file, data_file = work / "icechunk-spec.json", work / "expected.npy"
    spec_file.write_text(json.dumps(spec))
    np.save(data_file, data)
    done = subprocess.run(
        [str(peers), "-c", PEERS_READER, str(spec_file), str(data_file), str(rounds)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"Icechunk's reader failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


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

    row = {
        "zarrlake (virtual)": best(via_zarrlake, data, rounds),
        "xarray + h5netcdf": best(via_xarray, data, rounds),
        "h5py": best(via_h5py, data, rounds),
    }
    spec = {"prefix": path.parent.as_uri() + "/", "source_dir": str(path.parent),
            "repo_dir": str(work / "icechunk")}  # fmt: skip
    peer = icechunk_read(repo, spec, data, rounds, work)
    if peer is not None:
        row["Icechunk (virtual)"] = peer
    return row


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

        row = {
            "zarrlake (virtual)": best(via_zarrlake, data, rounds),
            "xarray + h5netcdf": best(via_xarray, data, rounds),
            "h5py": best(via_h5py, data, rounds),
        }
        s3 = {"bucket": server.bucket, "endpoint": server.endpoint, "region": REGION,
              "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
              "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}  # fmt: skip
        peer = icechunk_read(repo, {"prefix": container, "s3": s3}, data, rounds, path.parent)
        if peer is not None:
            row["Icechunk (virtual)"] = peer
        return row
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
        head = ("storage", "reader", "seconds", "MiB/s", "vs xarray", "zarrlake vs it")
        print("| {:<10} | {:<20} | {:>8} | {:>8} | {:>9} | {:>14} |".format(*head))
        print(f"|{'-' * 12}|{'-' * 22}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 16}|")
        for where, row in results.items():
            base = row["xarray + h5netcdf"]
            ours = row["zarrlake (virtual)"]
            for reader, seconds in row.items():
                print(
                    f"| {where:<10} | {reader:<20} | {seconds:8.3f} | {mib / seconds:8.1f} "
                    f"| {base / seconds:8.2f}x | {seconds / ours:13.2f}x |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
