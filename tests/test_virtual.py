"""Virtual chunks: NetCDF4/HDF5 files versioned in place, through kerchunk refs (issue 41).

Real files (xarray + h5netcdf, zlib and shuffle, chunked, CF-encoded time), real kerchunk refs
(``SingleHdf5ToZarr``), a local directory and moto S3; reads through zarr and xarray compared with
reading the files themselves.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

import zarrlake
from zarrlake.format.model import VIRTUAL, ManifestShard, virtual_ref
from zarrlake.sources import VirtualSources
from zarrlake.virtual import import_kerchunk

h5py = pytest.importorskip("h5py")
pytest.importorskip("h5netcdf")
kerchunk_hdf = pytest.importorskip("kerchunk.hdf")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")

ZERO = dt.timedelta(0)


def make_dataset(seed: int = 0, days: int = 12) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    time = np.array("2026-01-01", dtype="datetime64[ns]") + np.arange(days) * np.timedelta64(1, "D")
    return xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), rng.normal(280, 5, (days, 16, 24)).astype("f4")),
            "mask": (("lat", "lon"), rng.integers(0, 2, (16, 24)).astype("i2")),
        },
        coords={"time": time, "lat": np.linspace(-60, 60, 16), "lon": np.linspace(0, 345, 24)},
        attrs={"title": "test reanalysis"},
    )


def write_netcdf(path: Path, ds: xr.Dataset) -> Path:
    encoding = {
        "t2m": {"zlib": True, "shuffle": True, "chunksizes": (4, 8, 8), "complevel": 3},
        "mask": {"zlib": True, "chunksizes": (8, 12)},
        "time": {"units": "days since 2000-01-01", "dtype": "i4"},
    }
    ds.t2m.attrs["units"] = "K"
    ds.to_netcdf(path, engine="h5netcdf", encoding=encoding)
    return path


def kerchunk_refs(path: Path, url: str) -> dict[str, Any]:
    """kerchunk's refs of the local file ``path``, naming it ``url``."""
    with open(path, "rb") as f:
        refs: dict[str, Any] = kerchunk_hdf.SingleHdf5ToZarr(
            f, url, inline_threshold=64
        ).translate()
    return refs


def local_repo(tmp_path: Path, data: Path, **kw: Any) -> zarrlake.Repository:
    config = {"virtual_containers": [{"url_prefix": data.as_uri() + "/"}]}
    return zarrlake.Repository.create(
        zarrlake.Storage.local(tmp_path / "repo"), config=config, **kw
    )


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "archive"
    d.mkdir()
    return d


def imported(repo: zarrlake.Repository, path: Path, url: str, message: str = "import") -> str:
    session = repo.writable_session()
    report = import_kerchunk(kerchunk_refs(path, url), session)
    assert report.virtual_refs > 0 and report.sources == 1
    return session.commit(message)


def open_repo_dataset(repo: zarrlake.Repository, ref: str = "main") -> xr.Dataset:
    return xr.open_zarr(repo.readonly_session(ref).store, consolidated=False)


def test_a_local_netcdf_reads_back_identical_to_the_file(tmp_path: Path, data_dir: Path) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        got = open_repo_dataset(repo).load()
        xr.testing.assert_identical(got, expected.load())
    # The raw bytes decode to what h5py reads, and the chunk refs are virtual, pinned by mtime.
    with h5py.File(path) as f:
        np.testing.assert_array_equal(
            zarr.open_array(repo.readonly_session().store, path="t2m")[:], f["t2m"][:]
        )
    ref = repo.readonly_session().resolve("t2m/0.0.0")
    assert ref is not None and ref[0] == VIRTUAL and ref[1] == path.as_uri()
    assert ref[4] is None and ref[5] is not None  # a file: no ETag, its mtime


def test_the_format_feature_stops_an_older_client_from_writing(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = local_repo(tmp_path, data_dir)
    assert zarrlake.format.model.VIRTUAL_CHUNKS in repo.record.features
    plain = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "plain"))
    assert zarrlake.format.model.VIRTUAL_CHUNKS not in plain.record.features
    # A client from before the feature knows only these:
    import zarrlake.format.model as model

    monkeypatch.setattr(model, "KNOWN_FEATURES", frozenset({"content-hash", model.PUBLISHED_ROOT}))
    old = zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / "repo"))
    with pytest.raises(zarrlake.UnsupportedFormat, match=r"virtual-chunks \(zarrlake >= 0\.3\)"):
        old.writable_session()
    old.readonly_session()  # reading stays allowed
    zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / "plain")).writable_session()


def test_a_changed_source_raises_never_returns_other_bytes(tmp_path: Path, data_dir: Path) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    arr = zarr.open_array(repo.readonly_session().store, path="t2m")
    before = arr[:]
    write_netcdf(path, make_dataset(seed=1))  # rewritten in place: other values, same layout
    future = dt.datetime.now().timestamp() + 5
    os.utime(path, (future, future))
    with pytest.raises(zarrlake.VirtualSourceChanged) as info:
        zarr.open_array(repo.readonly_session().store, path="t2m")[:]
    assert info.value.url == path.as_uri()
    assert info.value.array == "t2m" and info.value.chunk is not None
    assert info.value.chunk.startswith("t2m/")
    assert path.as_uri() in str(info.value)
    assert before.shape == (12, 16, 24)


def test_a_deleted_source_is_missing(tmp_path: Path, data_dir: Path) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    path.unlink()
    with pytest.raises(zarrlake.VirtualSourceMissing, match="does not exist"):
        zarr.open_array(repo.readonly_session().store, path="t2m")[:]
    # A whole-chunk read through the store names the chunk too.
    store = repo.readonly_session().store
    with pytest.raises(zarrlake.VirtualSourceMissing) as info:
        store.get_sync("t2m/0.0.0")
    assert info.value.chunk == "t2m/0.0.0" and info.value.array == "t2m"


def test_urls_outside_the_containers_are_refused_at_write_and_at_read(
    tmp_path: Path, data_dir: Path
) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    session = repo.writable_session()
    outside = [
        "file:///etc/passwd",
        data_dir.as_uri() + "/../../etc/passwd",
        data_dir.as_uri() + "/%2e%2e/x.nc",
        data_dir.as_uri() + "x/a.nc",  # a sibling whose name starts alike
        "s3://bucket/a.nc",
        "https://example.org/a.nc",
    ]
    for url in outside:
        with pytest.raises(zarrlake.VirtualContainerNotAllowed):
            session.set_virtual_refs("t2m", {(0, 0, 0): zarrlake.VirtualRef(url, 0, 10)})
    with pytest.raises(zarrlake.VirtualContainerNotAllowed):
        import_kerchunk(kerchunk_refs(path, "file:///elsewhere/a.nc"), session)
    assert not session.has_changes  # nothing was written by the refused import
    # A repository whose refs point outside its containers (edited by hand: here, the same
    # storage read with a config that lists none) refuses to read them.
    record = dataclasses.replace(repo.record, config={}, features=())
    edited = zarrlake.Repository(repo.storage, record)
    with pytest.raises(zarrlake.VirtualContainerNotAllowed):
        zarr.open_array(edited.readonly_session().store, path="t2m")[:]


def test_set_virtual_refs_checks_its_arguments(tmp_path: Path, data_dir: Path) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    s = repo.writable_session()
    url = path.as_uri()
    with pytest.raises(zarrlake.InvalidArgument, match="not in the chunk grid"):
        s.set_virtual_refs("t2m", {(3, 0, 0): zarrlake.VirtualRef(url, 0, 10)})
    with pytest.raises(zarrlake.InvalidArgument, match="not in the chunk grid"):
        s.set_virtual_refs("t2m", {(0, 0): zarrlake.VirtualRef(url, 0, 10)})
    with pytest.raises(zarrlake.InvalidArgument, match="no Zarr v3 array"):
        s.set_virtual_refs("nope", {(0,): zarrlake.VirtualRef(url, 0, 10)})
    with pytest.raises(zarrlake.InvalidArgument, match="no ETag"):
        s.set_virtual_refs("t2m", {(0, 0, 0): zarrlake.VirtualRef(url, 0, 10, etag='"x"')})
    with pytest.raises(zarrlake.InvalidArgument):
        zarrlake.VirtualRef(url, -1, 10)
    with pytest.raises(zarrlake.InvalidArgument):
        s.set_virtual_refs("t2m", {(0, 0, 0): (url, 0, 10)})  # type: ignore[arg-type]
    # Pairs work as well as a mapping, numpy coordinates as well as ints.
    n = s.set_virtual_refs("t2m", [((np.int64(0), 0, 0), zarrlake.VirtualRef(url, 0, 10))])
    assert n == 1
    with pytest.raises(zarrlake.InvalidConfig):
        zarrlake.RepositoryConfig.from_dict(
            {"virtual_containers": [{"url_prefix": "s3://b/no-slash"}]}
        )
    with pytest.raises(zarrlake.InvalidConfig):
        zarrlake.RepositoryConfig.from_dict({"virtual_containers": [{"url_prefix": "ftp://h/x/"}]})
    with pytest.raises(
        zarrlake.InvalidArgument, match="none of the repository's virtual containers"
    ):
        zarrlake.Repository.open(
            repo.storage, virtual_credentials={"s3://other/": {"access_key_id": "k"}}
        )


def test_versions_log_diff_and_time_travel(tmp_path: Path, data_dir: Path) -> None:
    a = write_netcdf(data_dir / "a.nc", make_dataset(seed=0))
    b = write_netcdf(data_dir / "b.nc", make_dataset(seed=2))
    repo = local_repo(tmp_path, data_dir)
    first = imported(repo, a, a.as_uri(), "2026 from a.nc")
    second = imported(repo, b, b.as_uri(), "2026 from b.nc")
    assert [c.message for c in repo.log(limit=2)] == ["2026 from b.nc", "2026 from a.nc"]
    diff = repo.diff(first, second)
    assert (0, 0, 0) in diff.changed_chunks["t2m"]
    with xr.open_dataset(a, engine="h5netcdf") as old, xr.open_dataset(b, engine="h5netcdf") as new:
        xr.testing.assert_identical(open_repo_dataset(repo, first).load(), old.load())
        xr.testing.assert_identical(open_repo_dataset(repo, second).load(), new.load())
    # Two branches that each add virtual data merge.
    repo.create_branch("extra", from_ref=second)
    s = repo.writable_session("extra")
    import_kerchunk(kerchunk_refs(a, a.as_uri()), s, group="copy_a")
    s.commit("a copy under copy_a")
    repo.merge("extra", "main")
    merged = xr.open_zarr(repo.readonly_session().store, group="copy_a", consolidated=False)
    with xr.open_dataset(a, engine="h5netcdf") as old:
        xr.testing.assert_identical(merged.load(), old.load())


def test_virtual_and_native_chunks_mix_in_one_array(tmp_path: Path, data_dir: Path) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    s = repo.writable_session()
    arr = zarr.open_array(s.store, path="t2m")
    expected = arr[:]
    arr[0:4, 0:8, 0:8] = 1.5  # exactly chunk (0, 0, 0)
    expected[0:4, 0:8, 0:8] = 1.5
    s.commit("fix one chunk")
    r = repo.readonly_session()
    kinds = {k: r.resolve(f"t2m/{k}")[0] for k in ("0.0.0", "0.0.1", "2.1.2")}  # type: ignore[index]
    assert kinds["0.0.0"] != VIRTUAL and kinds["0.0.1"] == VIRTUAL == kinds["2.1.2"]
    np.testing.assert_array_equal(zarr.open_array(r.store, path="t2m")[:], expected)
    # GC with no grace keeps the file and everything still reads.
    repo.gc(grace=ZERO, force=True)
    assert path.exists()
    np.testing.assert_array_equal(
        zarr.open_array(repo.readonly_session().store, path="t2m")[:], expected
    )
    assert repo.fsck().ok


def test_fsck_virtual_checks_every_source(tmp_path: Path, data_dir: Path, cli: Any) -> None:
    paths = [write_netcdf(data_dir / f"{n}.nc", make_dataset(seed=i)) for i, n in enumerate("abc")]
    repo = local_repo(tmp_path, data_dir)
    s = repo.writable_session()
    for p in paths:
        import_kerchunk(kerchunk_refs(p, p.as_uri()), s, group=p.stem)
    s.commit("three files")
    report = repo.fsck(virtual=True)
    assert report.ok and report.virtual_sources == 3
    assert repo.fsck().virtual_sources == 0  # without the flag, sources are not read
    paths[0].unlink()
    future = dt.datetime.now().timestamp() + 5
    os.utime(paths[1], (future, future))
    seen: list[tuple[int, int]] = []
    report = repo.fsck(virtual=True, progress=lambda done, total: seen.append((done, total)))
    found = {(p.kind, p.key) for p in report.problems}
    assert found == {
        ("virtual-missing", paths[0].as_uri()),
        ("virtual-changed", paths[1].as_uri()),
    }
    assert seen[-1] == (3, 3)
    url = repo.storage.url
    result = cli("fsck", url, "--virtual", "--json")
    assert result.code == 1
    doc = json.loads(result.out)
    assert doc["checked"]["virtual_sources"] == 3
    assert sorted(p["kind"] for p in doc["problems"]) == ["virtual-changed", "virtual-missing"]


def test_refs_survive_pickling_of_sessions_and_forks(tmp_path: Path, data_dir: Path) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    reader = pickle.loads(pickle.dumps(repo.readonly_session()))
    with h5py.File(path) as f:
        np.testing.assert_array_equal(zarr.open_array(reader.store, path="t2m")[:], f["t2m"][:])
    session = repo.writable_session()
    # As Spark and dask ship forks: a worker's store of the repository is shared by its tasks,
    # and must know the repository's containers (and the reader's credentials) all the same.
    from zarrlake.forks import dump_fork, load_fork

    fork = load_fork(dump_fork(session.fork()))
    assert fork.objects.sources.containers == repo.config.virtual_containers
    np.testing.assert_array_equal(
        zarr.open_array(fork.store, path="t2m")[:], zarr.open_array(reader.store, path="t2m")[:]
    )
    import_kerchunk(kerchunk_refs(path, path.as_uri()), fork, group="forked")
    session.merge(pickle.loads(pickle.dumps(fork.changeset())))
    session.commit("from a fork")
    got = xr.open_zarr(repo.readonly_session().store, group="forked", consolidated=False)
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(got.load(), expected.load())


def test_shards_name_each_source_once() -> None:
    url = "s3://bucket/archive/era5/2026-01.nc"
    keys = [f"t/{i}.0" for i in range(1000)]
    refs = [virtual_ref(url, i * 100, 100, '"etag"', None) for i in range(1000)]
    refs[7] = (1, b"\0" * 32, 5)  # an object ref among them
    data = ManifestShard(keys, refs).encode()
    back = ManifestShard.decode(data)
    assert back.refs == refs and back.keys == keys
    assert len({id(r[1]) for r in back.refs if r[0] == VIRTUAL}) == 1  # one shared str
    assert data.count(url.encode()) <= 1  # named once (zstd may even fold it away)


def test_adjacent_virtual_ranges_are_read_in_one_request(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(bytes(range(256)) * 4)
    url = (src / "f.bin").as_uri()
    from zarrlake.config import VirtualContainer
    from zarrlake.objects import ObjectStore

    objects = ObjectStore(
        zarrlake.Storage.memory(),
        "blake3",
        sources=VirtualSources([VirtualContainer(src.as_uri() + "/")]),
    )
    reads = [(virtual_ref(url, i * 64, 64, None, None), None) for i in range(8)]
    reads.append((virtual_ref(url, 900, 10, None, None), (2, 6)))
    jobs = objects.plan_reads(reads)
    assert len(jobs) == 1
    assert objects.read_chunks(reads) == [
        (bytes(range(256)) * 4)[i * 64 : i * 64 + 64] for i in range(8)
    ] + [(bytes(range(256)) * 4)[902:906]]


def test_write_virtual_dataset_from_virtualizarr(tmp_path: Path, data_dir: Path) -> None:
    vz = pytest.importorskip("virtualizarr")
    from obspec_utils.registry import ObjectStoreRegistry
    from obstore.store import LocalStore
    from virtualizarr.parsers import HDFParser

    from zarrlake.virtual import write_virtual_dataset

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    registry = ObjectStoreRegistry({"file://": LocalStore()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vds = vz.open_virtual_dataset(
            path.as_uri(), registry=registry, parser=HDFParser(), loadable_variables=[]
        )
    repo = local_repo(tmp_path, data_dir)
    s = repo.writable_session()
    report = write_virtual_dataset(vds, s)
    assert report.virtual_refs > 0
    s.commit("via virtualizarr")
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(open_repo_dataset(repo).load(), expected.load())


#: The credentials tests/conftest.py gives moto (not imported: tests/serve has a conftest too).
S3_KEY = S3_SECRET = "testing"


# -- on S3 (moto) ---------------------------------------------------------------------------------


@pytest.fixture
def s3_source(moto_s3: Any, tmp_path: Path) -> Iterator[tuple[Any, Any, str]]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=moto_s3.endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
    )
    prefix = f"archive-{os.urandom(4).hex()}/"
    yield client, moto_s3, prefix


def s3_repo(server: Any, prefix: str, tmp_path: Path) -> zarrlake.Repository:

    container = f"s3://{server.bucket}/{prefix}"
    config = {
        "virtual_containers": [
            {"url_prefix": container, "endpoint_url": server.endpoint, "region": "us-east-1"}
        ]
    }
    creds = {container: {"access_key_id": S3_KEY, "secret_access_key": S3_SECRET}}
    return zarrlake.Repository.create(server.storage(), config=config, virtual_credentials=creds)


def test_a_netcdf_on_s3_reads_back_identical_and_is_pinned_by_etag(
    s3_source: Any, tmp_path: Path
) -> None:
    client, server, prefix = s3_source
    path = write_netcdf(tmp_path / "a.nc", make_dataset())
    client.upload_file(str(path), server.bucket, prefix + "a.nc")
    url = f"s3://{server.bucket}/{prefix}a.nc"
    repo = s3_repo(server, prefix, tmp_path)
    imported(repo, path, url)
    ref = repo.readonly_session().resolve("t2m/0.0.0")
    assert ref is not None and ref[4]  # pinned by ETag
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(open_repo_dataset(repo).load(), expected.load())
        # The credentials travel with a pickled read-only session (a dask worker's).
        reader = pickle.loads(pickle.dumps(repo.readonly_session()))
        got = xr.open_zarr(reader.store, consolidated=False).load()
        xr.testing.assert_identical(got, expected.load())
    # Rewritten: the ETag differs.
    other = write_netcdf(tmp_path / "b.nc", make_dataset(seed=5))
    client.upload_file(str(other), server.bucket, prefix + "a.nc")
    with pytest.raises(zarrlake.VirtualSourceChanged, match="ETag"):
        zarr.open_array(repo.readonly_session().store, path="t2m")[:]
    assert {p.kind for p in repo.fsck(virtual=True).problems} == {"virtual-changed"}
    client.delete_object(Bucket=server.bucket, Key=prefix + "a.nc")
    with pytest.raises(zarrlake.VirtualSourceMissing):
        zarr.open_array(repo.readonly_session().store, path="t2m")[:]
    assert {p.kind for p in repo.fsck(virtual=True).problems} == {"virtual-missing"}


def test_compaction_leaves_virtual_refs_and_a_mirror_copies_only_refs(
    tmp_path: Path, data_dir: Path
) -> None:
    from zarrlake.mirror import Mirror

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported(repo, path, path.as_uri())
    s = repo.writable_session()
    zarr.open_array(s.store, path="mask")[0:8, 0:12] = 7  # a native chunk beside virtual ones
    s.commit("one native chunk")
    before = {k: repo.readonly_session().resolve(k) for k in ("t2m/0.0.0", "t2m/2.1.2")}
    repo.compact(branch="main")
    after = {k: repo.readonly_session().resolve(k) for k in before}
    assert after == before  # virtual refs untouched by packing
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        want = expected.load()
        want["mask"][0:8, 0:12] = 7
        xr.testing.assert_identical(open_repo_dataset(repo).load(), want)
        dest = zarrlake.Storage.local(tmp_path / "mirror")
        Mirror(repo, destination=dest, copy=True).step()
        mirrored = zarrlake.Repository.open(dest)
        xr.testing.assert_identical(open_repo_dataset(mirrored).load(), want)
    # The mirror holds refs, not the file: no object there is as large as the file's data.
    sizes = [o.size for o in dest.list("")]
    assert max(sizes) < path.stat().st_size // 4


def test_write_virtual_dataset_without_virtualizarr_names_the_extra(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from zarrlake.virtual import write_virtual_dataset

    monkeypatch.setitem(sys.modules, "virtualizarr", None)  # as if it were not installed
    repo = local_repo(tmp_path, data_dir)
    with pytest.raises(zarrlake.MissingDependency, match=r"zarrlake\[virtual\]"):
        write_virtual_dataset(xr.Dataset(), repo.writable_session())


# -- on Azure (Azurite), GCS (fake-gcs-server) and plain HTTP -------------------------------------


def cloud_repo(
    emulator: Any, container: str, *, credentials: dict[str, Any] | None = None, **fields: Any
) -> zarrlake.Repository:
    config = {"virtual_containers": [{"url_prefix": container, **fields}]}
    return zarrlake.Repository.create(
        emulator.storage(), config=config, virtual_credentials=credentials
    )


def check_read_rewrite_delete(
    repo: zarrlake.Repository,
    path: Path,
    url: str,
    upload: Any,
    delete: Any,
    tmp_path: Path,
    changed: str = "",
) -> None:
    """The shared story: identical to the file, then rewritten (changed), then gone (missing)."""
    imported(repo, path, url)
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(open_repo_dataset(repo).load(), expected.load())
        reader = pickle.loads(pickle.dumps(repo.readonly_session()))
        xr.testing.assert_identical(
            xr.open_zarr(reader.store, consolidated=False).load(), expected.load()
        )
    upload(write_netcdf(tmp_path / "other.nc", make_dataset(seed=9)))
    with pytest.raises(zarrlake.VirtualSourceChanged, match=changed) as info:
        zarr.open_array(repo.readonly_session().store, path="t2m")[:]
    assert info.value.url == url
    assert {p.kind for p in repo.fsck(virtual=True).problems} == {"virtual-changed"}
    delete()
    with pytest.raises(zarrlake.VirtualSourceMissing):
        zarr.open_array(repo.readonly_session().store, path="t2m")[:]
    assert {p.kind for p in repo.fsck(virtual=True).problems} == {"virtual-missing"}


def test_a_netcdf_on_azure_reads_back_identical_and_is_pinned_by_etag(
    azurite: Any, tmp_path: Path
) -> None:
    from zarrlake_testkit.emulators import AZURITE_ACCOUNT, AZURITE_KEY

    prefix = f"archive-{os.urandom(4).hex()}"
    source = azurite.storage(prefix)
    path = write_netcdf(tmp_path / "a.nc", make_dataset())
    source.put("a.nc", path.read_bytes())
    container = f"az://{azurite.bucket}/{prefix}/"
    creds = {container: {"account_key": AZURITE_KEY}}
    repo = cloud_repo(
        azurite,
        container,
        credentials=creds,
        endpoint_url=azurite.endpoint,
        account_name=AZURITE_ACCOUNT,
    )
    url = container + "a.nc"
    check_read_rewrite_delete(
        repo,
        path,
        url,
        lambda other: source.put("a.nc", other.read_bytes()),
        lambda: source.delete_many(["a.nc"]),
        tmp_path,
        changed="ETag",
    )
    ref = repo.readonly_session().resolve("t2m/0.0.0")
    assert ref is not None and ref[4]  # pinned by ETag


def test_a_netcdf_on_gcs_reads_back_identical_and_is_pinned_by_generation(
    fake_gcs: Any, tmp_path: Path
) -> None:
    prefix = f"archive-{os.urandom(4).hex()}"
    source = fake_gcs.storage(prefix)
    path = write_netcdf(tmp_path / "a.nc", make_dataset())
    source.put("a.nc", path.read_bytes())
    container = f"gs://{fake_gcs.bucket}/{prefix}/"
    repo = cloud_repo(fake_gcs, container, endpoint_url=fake_gcs.endpoint, anonymous=True)
    url = container + "a.nc"
    ref_generation = source.head("a.nc")
    assert ref_generation is not None and ref_generation.etag
    check_read_rewrite_delete(
        repo,
        path,
        url,
        lambda other: source.put("a.nc", other.read_bytes()),
        lambda: source.delete_many(["a.nc"]),
        tmp_path,
    )
    ref = repo.readonly_session().resolve("t2m/0.0.0")
    assert ref is not None and ref[4] == ref_generation.etag


@pytest.mark.parametrize("etags", [True, False], ids=["etag", "last-modified"])
def test_a_netcdf_over_http_reads_back_identical_and_is_pinned(
    tmp_path: Path, data_dir: Path, etags: bool
) -> None:
    from zarrlake_testkit.static_http import StaticHTTPServer

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    token = "Bearer " + os.urandom(8).hex()
    with StaticHTTPServer(data_dir, etags=etags, authorization=token) as server:
        container = server.url + "/"
        url = container + "a.nc"
        config = {"virtual_containers": [{"url_prefix": container}]}
        creds = {container: {"authorization": token}}
        repo = zarrlake.Repository.create(
            zarrlake.Storage.local(tmp_path / "repo"), config=config, virtual_credentials=creds
        )

        def rewrite(other: Path) -> None:
            other.replace(path)
            later = dt.datetime.now().timestamp() + 5  # HTTP dates count seconds
            os.utime(path, (later, later))

        check_read_rewrite_delete(
            repo, path, url, rewrite, path.unlink, tmp_path, changed="ETag" if etags else "modified"
        )
        ref = repo.readonly_session().resolve("t2m/0.0.0")
        assert ref is not None and (ref[4] is not None) == etags
        # Without the credential, the server's 401 is an error, never data.
        bare = zarrlake.Repository.open(repo.storage)
        with pytest.raises(zarrlake.ZarrlakeError):
            bare.readonly_session().store.get_sync("t2m/0.0.0")


def test_credentials_from_the_environment(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zarrlake_testkit.static_http import StaticHTTPServer

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    token = "Bearer " + os.urandom(8).hex()
    with StaticHTTPServer(data_dir, etags=True, authorization=token) as server:
        container = server.url + "/"
        config = {"virtual_containers": [{"url_prefix": container}]}
        creds = {container: {"authorization": token}, "s3://another-repos-bucket/": {"x": "1"}}
        secret = tmp_path / "secret.json"
        secret.write_text(json.dumps(creds))
        monkeypatch.setenv("ZARRLAKE_VIRTUAL_CREDENTIALS_FILE", str(secret))
        repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"), config=config)
        imported(repo, path, container + "a.nc")
        with xr.open_dataset(path, engine="h5netcdf") as expected:
            reopened = zarrlake.Repository.open(repo.storage)
            xr.testing.assert_identical(open_repo_dataset(reopened).load(), expected.load())
        # Given at open, they win over the environment's, prefix by prefix.
        wrong = {container: {"authorization": "Bearer wrong"}}
        overridden = zarrlake.Repository.open(repo.storage, virtual_credentials=wrong)
        with pytest.raises(zarrlake.ZarrlakeError):
            overridden.readonly_session().store.get_sync("t2m/0.0.0")
        # The JSON variable comes first; a bad one is an error naming it, not its values.
        monkeypatch.setenv("ZARRLAKE_VIRTUAL_CREDENTIALS", "{not json")
        with pytest.raises(zarrlake.InvalidArgument, match=r"\$ZARRLAKE_VIRTUAL_CREDENTIALS is"):
            zarrlake.Repository.open(repo.storage).readonly_session()
        monkeypatch.setenv(
            "ZARRLAKE_VIRTUAL_CREDENTIALS", json.dumps({container: {"account_key": "s3cr3t-v"}})
        )
        with pytest.raises(zarrlake.InvalidArgument, match="unknown field") as info:
            zarrlake.Repository.open(repo.storage).readonly_session()
        assert "s3cr3t-v" not in str(info.value)


def test_containers_of_every_scheme_are_checked_and_stored_for_older_clients(
    tmp_path: Path,
) -> None:
    from zarrlake.config import RepositoryConfig

    containers = [
        {"url_prefix": "s3://b/data/", "region": "eu-west-1"},
        {"url_prefix": "file:///archive/"},
        {"url_prefix": "gs://era5/", "anonymous": True},
        {"url_prefix": "az://c/x/", "account_name": "acct"},
        {"url_prefix": "https://data.example.org/nc/"},
    ]
    repo = zarrlake.Repository.create(
        zarrlake.Storage.local(tmp_path / "repo"), config={"virtual_containers": containers}
    )
    stored = repo.record.config
    # What zarrlake 0.3/0.4 read: s3 and file containers, in the four fields they knew.
    assert [c["url_prefix"] for c in stored["virtual_containers"]] == [
        "s3://b/data/",
        "file:///archive/",
    ]
    assert all(set(c) == {"url_prefix", "endpoint_url", "region", "anonymous"}
               for c in stored["virtual_containers"])  # fmt: skip
    assert [c["url_prefix"] for c in stored["virtual_containers_ext"]] == [
        "gs://era5/",
        "az://c/x/",
        "https://data.example.org/nc/",
    ]
    reopened = zarrlake.Repository.open(repo.storage)
    assert sorted(c.url_prefix for c in reopened.config.virtual_containers) == sorted(
        c["url_prefix"] for c in containers
    )
    # An older client's view: the extension is a setting it does not know, and is left out.
    old = RepositoryConfig.from_dict({"virtual_containers": stored["virtual_containers"]})
    assert [c.url_prefix for c in old.virtual_containers] == ["s3://b/data/", "file:///archive/"]
    bad = [
        ({"url_prefix": "gs:///x/"}, "needs a bucket"),
        ({"url_prefix": "az://c/x/", "region": "eu"}, "region is for s3:// containers only"),
        ({"url_prefix": "https://h/x/", "anonymous": True}, "anonymous is for"),
        ({"url_prefix": "https://h/x/?sig=1/"}, "no query"),
        ({"url_prefix": "gs://b/", "endpoint_url": "ftp://e"}, "endpoint_url must be"),
        ({"url_prefix": "ftp://h/x/"}, "ftp"),
    ]
    for container, message in bad:
        with pytest.raises(zarrlake.InvalidConfig, match=message):
            zarrlake.Repository.create(
                zarrlake.Storage.memory(), config={"virtual_containers": [container]}
            )
    # Credentials are checked against the container's scheme.
    with pytest.raises(zarrlake.InvalidArgument, match="takes no credentials"):
        zarrlake.Repository.open(
            repo.storage, virtual_credentials={"file:///archive/": {"token": "t"}}
        ).readonly_session()
    with pytest.raises(zarrlake.InvalidArgument, match="unknown field"):
        zarrlake.Repository.open(
            repo.storage, virtual_credentials={"gs://era5/": {"account_key": "k"}}
        ).readonly_session()


def test_containers_change_after_creation_from_the_api_and_the_cli(
    tmp_path: Path, data_dir: Path, cli: Any
) -> None:
    import threading

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    url = str(tmp_path / "repo")
    refs_file = tmp_path / "refs.json"
    refs_file.write_text(json.dumps(kerchunk_refs(path, path.as_uri())))
    with pytest.raises(zarrlake.VirtualContainerNotAllowed):
        import_kerchunk(refs_file, repo.writable_session())
    assert cli("virtual", url).out.strip() == "no virtual chunk containers"
    opened_before = zarrlake.Repository.open(storage)
    prefix = data_dir.as_uri() + "/"
    r = cli("virtual", url, "allow", prefix)
    assert r.code == 0 and r.out.strip() == f"allowed virtual container {prefix}"
    assert cli("virtual", url, "allow", prefix).out.strip().endswith("was allowed already")
    r = cli("virtual", url, "import", str(refs_file), "-m", "the archive", "--json")
    assert r.code == 0, r.err
    imported_report = json.loads(r.out)
    assert imported_report["virtual_refs"] > 0 and imported_report["sources"] == 1
    reopened = zarrlake.Repository.open(storage)
    assert zarrlake.format.model.VIRTUAL_CHUNKS in reopened.record.features
    assert next(iter(reopened.log())).message == "the archive"
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(open_repo_dataset(reopened).load(), expected.load())
    # A client open since before the change still has the old allow-list: it refuses the refs
    # (never reads them unchecked) until it opens the repository again.
    with pytest.raises(zarrlake.VirtualContainerNotAllowed):
        zarr.open_array(opened_before.readonly_session().store, path="t2m")[:]
    # Two admins adding containers at once: both land.
    handles = [zarrlake.Repository.open(storage) for _ in range(2)]
    extra = ["s3://bucket-a/x/", "gs://bucket-b/y/"]
    threads = [
        threading.Thread(target=h.allow_virtual_container, args=({"url_prefix": p},))
        for h, p in zip(handles, extra, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    listed = json.loads(cli("virtual", url, "--json").out)
    assert sorted(c["url_prefix"] for c in listed) == sorted([prefix, *extra])
    # Taken out: refused at read, nothing deleted; put back: readable again.
    assert cli("virtual", url, "disallow", prefix).code == 0
    with pytest.raises(zarrlake.VirtualContainerNotAllowed):
        zarr.open_array(zarrlake.Repository.open(storage).readonly_session().store, path="t2m")[:]
    assert cli("virtual", url, "disallow", prefix).out.strip().endswith("was not allowed")
    repo.allow_virtual_container({"url_prefix": prefix})
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(open_repo_dataset(repo).load(), expected.load())
    report = repo.fsck()
    assert report.ok and list(report.notes) == []
    # Bad input: one line, exit 2, nothing changed.
    before = zarrlake.Repository.open(storage).config.virtual_containers
    r = cli("virtual", url, "allow", "ftp://host/x/")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    r = cli("virtual", url, "allow", "gs://b/", "--region", "eu")
    assert r.code == 2 and "region is for s3:// containers only" in r.err
    with pytest.raises(zarrlake.InvalidConfig, match="twice"):
        repo.set_virtual_containers([{"url_prefix": prefix}, {"url_prefix": prefix}])
    with pytest.raises(zarrlake.InvalidConfig):
        repo.set_virtual_containers(prefix)  # type: ignore[arg-type]
    assert zarrlake.Repository.open(storage).config.virtual_containers == before
    # Exactly these: the rest go.
    assert repo.set_virtual_containers([{"url_prefix": prefix}]) == (
        zarrlake.VirtualContainer(prefix),
    )
    assert zarrlake.Repository.open(storage).config.virtual_containers == (
        zarrlake.VirtualContainer(prefix),
    )


def test_containers_of_a_mirror_are_its_sources(tmp_path: Path, data_dir: Path) -> None:
    from zarrlake.mirror import Mirror

    repo = local_repo(tmp_path, data_dir)
    dest = zarrlake.Storage.local(tmp_path / "mirror")
    Mirror(repo, destination=dest).step()
    with pytest.raises(zarrlake.ReadOnlyError, match="source"):
        zarrlake.Repository.open(dest).allow_virtual_container({"url_prefix": "s3://b/"})


def test_credentials_from_mounted_secret_directories(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the operator gives its pods: each container's Secret mounted as a directory of one
    file per key (a newline at the end, as kubectl may write it; other keys beside)."""
    from zarrlake_testkit.static_http import StaticHTTPServer

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    token = "Bearer " + os.urandom(8).hex()
    with StaticHTTPServer(data_dir, etags=True, authorization=token) as server:
        container = server.url + "/"
        secret = tmp_path / "secret"
        secret.mkdir()
        (secret / "authorization").write_text(token + "\n")
        (secret / "unrelated").write_text("left alone")
        monkeypatch.setenv(
            "ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS",
            json.dumps({container: str(secret), "s3://other/": str(tmp_path)}),
        )
        repo = zarrlake.Repository.create(
            zarrlake.Storage.local(tmp_path / "repo"),
            config={"virtual_containers": [{"url_prefix": container}]},
        )
        assert repo.core.objects.sources.credentials == {container: {"authorization": token}}
        imported(repo, path, container + "a.nc")
        with xr.open_dataset(path, engine="h5netcdf") as expected:
            xr.testing.assert_identical(open_repo_dataset(repo).load(), expected.load())
        monkeypatch.setenv(
            "ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS", json.dumps({container: str(tmp_path / "nope")})
        )
        with pytest.raises(zarrlake.InvalidArgument, match="is not a directory"):
            zarrlake.Repository.open(repo.storage)


def test_kerchunk_parquet_refs_import_as_the_json_ones_do(
    tmp_path: Path, data_dir: Path, cli: Any
) -> None:
    pytest.importorskip("fastparquet")
    from kerchunk.df import refs_to_dataframe

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    refs = kerchunk_refs(path, path.as_uri())
    parquet = tmp_path / "refs.parq"
    # A small record size: several records per array, the last one padded with empty rows.
    refs_to_dataframe(refs, str(parquet), record_size=5)
    assert len(list((parquet / "t2m").glob("refs.*.parq"))) > 1
    from_json = local_repo(tmp_path / "json", data_dir)
    imported(from_json, path, path.as_uri())
    repo = local_repo(tmp_path, data_dir)
    session = repo.writable_session()
    report = import_kerchunk(parquet, session)
    session.commit("from parquet")
    json_session = from_json.readonly_session()
    expected_refs = {k: json_session.resolve(k) for k in json_session.list_prefix("t2m")}
    got = repo.readonly_session()
    assert {k: got.resolve(k) for k in got.list_prefix("t2m")} == expected_refs
    assert report.virtual_refs > 0 and report.sources == 1
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        xr.testing.assert_identical(open_repo_dataset(repo).load(), expected.load())
    # The CLI takes the directory too; bad input is one line, exit 2.
    cli_repo = local_repo(tmp_path / "cli", data_dir)
    r = cli("virtual", str(tmp_path / "cli" / "repo"), "import", str(parquet))
    assert r.code == 0, r.err
    assert "virtual refs into 1 files" in r.out
    with xr.open_dataset(path, engine="h5netcdf") as expected:
        reopened = zarrlake.Repository.open(cli_repo.storage)
        xr.testing.assert_identical(open_repo_dataset(reopened).load(), expected.load())
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{")
    for bad, message in [
        (tmp_path / "empty", "without .zmetadata"),
        (tmp_path / "bad.json", "is not JSON"),
        (tmp_path / "nowhere.json", "cannot read it"),
    ]:
        r = cli("virtual", str(tmp_path / "cli" / "repo"), "import", str(bad))
        assert r.code == 2 and message in r.err and len(r.err.strip().splitlines()) == 1


def test_compact_materialize_copies_the_virtual_chunks_in(
    tmp_path: Path, data_dir: Path, cli: Any
) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    imported_at = imported(repo, path, path.as_uri())
    with xr.open_dataset(path, engine="h5netcdf") as f:
        expected = f.load()
    dry = repo.compact(materialize=True, dry_run=True)
    assert dry.materialized_chunks > 0 and dry.materialized_snapshot is None
    assert repo.lookup_branch("main") == imported_at  # a dry run commits nothing
    url = str(tmp_path / "repo")
    r = cli("compact", url, "--materialize", "--json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert report["materialized_chunks"] == dry.materialized_chunks
    assert report["materialized_bytes"] == dry.materialized_bytes > 0
    session = repo.readonly_session()
    kinds = {session.resolve(k)[0] for k in session.list_prefix("t2m/") if "zarr.json" not in k}  # type: ignore[index]
    assert VIRTUAL not in kinds
    # The data is the repository's own now: the archive can go, the branch still reads.
    os.rename(data_dir, tmp_path / "moved")
    xr.testing.assert_identical(open_repo_dataset(zarrlake.Repository.open(repo.storage)).load(),
                                expected)  # fmt: skip
    # Older snapshots still name the sources.
    with pytest.raises(zarrlake.VirtualSourceMissing):
        zarr.open_array(repo.readonly_session(imported_at).store, path="t2m")[:]
    os.rename(tmp_path / "moved", data_dir)
    assert cli("compact", url, "--materialize").out.startswith("packed")  # nothing left to copy


def test_compact_materialize_refuses_a_changed_source_and_commits_nothing(
    tmp_path: Path, data_dir: Path
) -> None:
    path = write_netcdf(data_dir / "a.nc", make_dataset())
    repo = local_repo(tmp_path, data_dir)
    head = imported(repo, path, path.as_uri())
    write_netcdf(path, make_dataset(seed=3))
    later = dt.datetime.now().timestamp() + 5
    os.utime(path, (later, later))
    with pytest.raises(zarrlake.VirtualSourceChanged):
        repo.compact(materialize=True)
    assert repo.lookup_branch("main") == head


def test_a_source_that_cannot_be_pinned_is_refused_unless_pin_is_off(
    tmp_path: Path, data_dir: Path
) -> None:
    """An HTTP server that sends neither ETag nor Last-Modified: nothing says which version a
    ref was made from, so a pinned import is refused (it would read as changed for ever)."""
    import functools
    import http.server
    import threading

    class NoDates(http.server.SimpleHTTPRequestHandler):
        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() not in ("last-modified", "etag"):
                super().send_header(keyword, value)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    path = write_netcdf(data_dir / "a.nc", make_dataset())
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(NoDates, directory=str(data_dir))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        container = f"http://127.0.0.1:{server.server_address[1]}/"
        config = {"virtual_containers": [{"url_prefix": container}]}
        repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"), config=config)
        session = repo.writable_session()
        with pytest.raises(zarrlake.InvalidArgument, match="no ETag and no Last-Modified"):
            import_kerchunk(kerchunk_refs(path, container + "a.nc"), session)
        assert not session.has_changes
        report = import_kerchunk(kerchunk_refs(path, container + "a.nc"), session, pin=False)
        assert report.virtual_refs > 0
    finally:
        server.shutdown()
        server.server_close()


# -- refs as flat arrays (set_virtual_refs_arrays) -------------------------------------------------


def _byte_files(data: Path, n: int) -> list[str]:
    """``n`` files of the bytes 0..7, as file:// URLs."""
    urls = []
    for i in range(n):
        path = data / f"f{i}.bin"
        path.write_bytes(bytes(range(8)))
        urls.append(path.as_uri())
    return urls


def _byte_array(session: zarrlake.Session, name: str, shape: tuple[int, ...]) -> None:
    zarr.create_array(
        session.store, name=name, shape=shape, chunks=(1,) * len(shape), dtype="u1",
        compressors=None, fill_value=0,
    )  # fmt: skip


def test_flat_arrays_set_what_virtual_ref_objects_set(tmp_path: Path, data_dir: Path) -> None:
    urls = _byte_files(data_dir, 3)
    repo = local_repo(tmp_path, data_dir)
    setup = repo.writable_session()
    _byte_array(setup, "x", (6, 5))
    _byte_array(setup, "v", (7,))
    setup.commit("arrays")
    n = 30
    idx = np.arange(n)
    coords = np.stack([idx // 5, idx % 5], axis=1)
    offsets, lengths = idx % 8, np.ones(n, dtype=np.uint32)
    locations = [urls[i % 3] for i in range(n)]
    mtime = dt.datetime.fromtimestamp(os.stat(data_dir / "f1.bin").st_mtime, dt.UTC)
    pins = [mtime if i % 3 == 1 else None for i in range(n)]  # f1 pinned, the others not

    flat = repo.writable_session()
    assert flat.set_virtual_refs_arrays("x", coords, locations, offsets, lengths,
                                        last_modified=pins) == n  # fmt: skip
    # A 1-d array takes N ints; one URL serves every ref; a chunk given twice keeps its last.
    assert flat.set_virtual_refs_arrays("v", [0, 1, 1], urls[2], [5, 6, 7], [1, 1, 1]) == 2
    objects = repo.writable_session()
    objects.set_virtual_refs(
        "x",
        {
            (i // 5, i % 5): zarrlake.VirtualRef(locations[i], i % 8, 1, last_modified=pins[i])
            for i in range(n)
        },
    )
    objects.set_virtual_refs("v", {(0,): zarrlake.VirtualRef(urls[2], 5, 1),
                                   (1,): zarrlake.VirtualRef(urls[2], 7, 1)})  # fmt: skip
    keys = [f"x/c/{i // 5}/{i % 5}" for i in range(n)] + ["v/c/0", "v/c/1"]
    assert [flat.resolve(k) for k in keys] == [objects.resolve(k) for k in keys]
    flat.commit("flat refs")
    session = repo.readonly_session()
    np.testing.assert_array_equal(
        zarr.open_array(session.store, path="x")[:], (idx % 8).reshape(6, 5)
    )
    np.testing.assert_array_equal(
        zarr.open_array(session.store, path="v")[:], [5, 7, 0, 0, 0, 0, 0]
    )
    # Pinned as asked: the pinned file rewritten is an error, never other bytes.
    os.utime(data_dir / "f1.bin", (1, 1))
    with pytest.raises(zarrlake.VirtualSourceChanged, match=r"f1\.bin"):
        zarr.open_array(repo.readonly_session().store, path="x")[0, 1]
    assert zarr.open_array(repo.readonly_session().store, path="x")[0, 0] == 0  # unpinned


def test_flat_arrays_are_checked_whole_and_set_nothing_when_refused(
    tmp_path: Path, data_dir: Path
) -> None:
    urls = _byte_files(data_dir, 2)
    repo = local_repo(tmp_path, data_dir)
    s = repo.writable_session()
    _byte_array(s, "x", (4, 4))
    s.commit("array")
    s = repo.writable_session()
    ok = np.array([[0, 0], [1, 1]])

    def refused(match: str, error: type[Exception] = zarrlake.InvalidArgument, **kw: Any) -> None:
        args = {"coords": ok, "urls": urls[0], "offsets": [0, 1], "lengths": [1, 1], **kw}
        with pytest.raises(error, match=match):
            s.set_virtual_refs_arrays("x", **args)
        assert not s.has_changes

    refused(r"chunk \(4, 0\) is not in the chunk grid", coords=np.array([[0, 0], [4, 0]]))
    refused(r"chunk \(0, -1\) is not in the chunk grid", coords=np.array([[0, -1], [0, 0]]))
    refused(r"an \(N, 2\) array of ints", coords=np.array([0, 1]))
    refused(r"an \(N, 2\) array of ints", coords=np.array([[0.0, 0.0], [1.0, 1.0]]))
    refused(r"ref 1: offsets -3 is negative", offsets=[0, -3])
    refused(r"lengths must be 2 ints", lengths=[1])
    refused(r"ref 0: length 4294967296 is not below 2\*\*32", lengths=[1 << 32, 1])
    refused(r"urls must have 2 values", urls=[urls[0]])
    refused(r"none of the repository's virtual containers", zarrlake.VirtualContainerNotAllowed,
            urls=[urls[0], "s3://elsewhere/f.bin"])  # fmt: skip
    refused(r"no ETag", etags='"abc"')
    refused(r"ref 1: .*url must be a URL", urls=[urls[0], "no-scheme"])
    refused(r"last_modified must be a datetime", last_modified=["yesterday", None])
    with pytest.raises(zarrlake.InvalidArgument, match="no Zarr v3 array"):
        s.set_virtual_refs_arrays("nope", ok, urls[0], [0, 1], [1, 1])
    # Unsigned and numpy integer columns are ints too.
    assert s.set_virtual_refs_arrays("x", ok.astype(np.uint16), urls, np.array([2, 3], np.uint64),
                                     np.array([1, 1], np.int8)) == 2  # fmt: skip
    s.commit("two")
    got = zarr.open_array(repo.readonly_session().store, path="x")[:]
    assert got[0, 0] == 2 and got[1, 1] == 3 and got.sum() == 5


def test_kerchunk_refs_the_columns_cannot_hold_still_import_or_are_refused_as_before(
    tmp_path: Path, data_dir: Path
) -> None:
    urls = _byte_files(data_dir, 1)
    repo = local_repo(tmp_path, data_dir)
    zarray = {
        "zarr_format": 2, "shape": [2, 2], "chunks": [1, 1], "dtype": "|u1", "order": "C",
        "compressor": None, "filters": None, "fill_value": 0,
    }  # fmt: skip
    base = {".zgroup": json.dumps({"zarr_format": 2}), "x/.zarray": json.dumps(zarray)}
    # A range of 4 GiB or more (no column holds it): imported as a VirtualRef.
    s = repo.writable_session()
    refs = {**base, "x/0.0": [urls[0], 0, 1], "x/1.1": [urls[0], 0, 1 << 32]}
    assert import_kerchunk({"version": 1, "refs": refs}, s, pin=False).virtual_refs == 2
    assert s.resolve("x/1.1")[3] == 1 << 32  # type: ignore[index]
    first = s
    # A chunk name of the wrong rank: the grid's error, naming it; nothing set.
    s = repo.writable_session()
    refs = {**base, "x/0.0": [urls[0], 0, 1], "x/0.0.1": [urls[0], 0, 1]}
    with pytest.raises(zarrlake.InvalidArgument, match=r"chunk \(0, 0, 1\) is not in the chunk"):
        import_kerchunk({"version": 1, "refs": refs}, s, pin=False)
    # No refs at all, and an ETag on a second ref of a file: as set_virtual_refs says.
    assert first.set_virtual_refs_arrays("x", [], [], [], []) == 0
    s = first
    with pytest.raises(zarrlake.InvalidArgument, match="no ETag"):
        plain, tagged = (
            zarrlake.VirtualRef(urls[0], 0, 1),
            zarrlake.VirtualRef(urls[0], 1, 1, etag="e"),
        )
        s.set_virtual_refs("x", [((0, 0), plain), ((0, 1), tagged)])


@pytest.mark.parametrize("batch", [None, (5, 1 << 20), (4096, 3)])
def test_compact_materialize_reads_neighbouring_ranges_of_a_file_in_one_request(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, batch: Any
) -> None:
    if batch is not None:  # what one batch holds at most (chunks, bytes): several batches
        monkeypatch.setattr(zarrlake.repository, "MATERIALIZE_BATCH", batch)
    (data_dir / "f.bin").write_bytes(bytes(range(64)))
    url = (data_dir / "f.bin").as_uri()
    repo = local_repo(tmp_path, data_dir)
    s = repo.writable_session()
    _byte_array(s, "x", (8, 8))
    idx = np.arange(64)[::-1].copy()  # set in reverse: the plan sorts them
    s.set_virtual_refs_arrays(
        "x", np.stack([idx // 8, idx % 8], axis=1), url, idx, np.ones(64, int)
    )
    s.commit("virtual")
    sources = repo.core.objects.sources
    asked: list[Any] = []
    read_range = sources.read_range

    def counted(whole: Any) -> bytes:
        asked.append(whole)
        return read_range(whole)

    sources.read_range = counted  # type: ignore[method-assign]  # the real read, counted
    report = repo.compact(materialize=True)
    assert report.materialized_chunks == 64
    if batch is None:
        assert len(asked) == 1 and (asked[0].start, asked[0].end) == (0, 64)  # one, whole
    else:  # a request per batch, each a run of neighbours
        per = min(batch[0], batch[1])
        assert [(a.start, a.end) for a in asked] == [
            (i, min(i + per, 64)) for i in range(0, 64, per)
        ]
    (data_dir / "f.bin").unlink()  # the bytes are the repository's own now
    got = zarr.open_array(zarrlake.Repository.open(repo.storage).readonly_session().store, path="x")
    np.testing.assert_array_equal(got[:], np.arange(64).reshape(8, 8))
