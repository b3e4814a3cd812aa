"""Compare-and-set on a whole object (``Storage.get_versioned`` / ``put_if_version``), the
storage half of the published ``root`` (DESIGN.md, "The published root"), on every backend:
memory, a local directory, S3 on moto and on SeaweedFS, Azure on Azurite, GCS on
fake-gcs-server, and plain HTTP, which has none.

What the servers do, as these tests found: moto, SeaweedFS, Azurite and fake-gcs-server all
keep it. moto and SeaweedFS refuse a stale ``If-Match`` with 412 (an ``If-Match`` on an absent
key: moto answers 404 ``NoSuchKey``, SeaweedFS 412; both are a ``PreconditionFailed``), and
their ETag is the MD5 of the bytes. fake-gcs-server honours ``ifGenerationMatch`` on the
multipart uploads the backend sends and names the generation of every download
(``x-goog-generation``). A server that ignores ``If-Match`` is moto behind
``zarrlake_testkit.s3proxy``, which drops the conditional headers: the check finds it out.

The racing tests count: every writer increments a counter object by read-then-swap until it has
made its share of swaps, and the values the successful swaps wrote must be exactly 1..total.
A swap that is not atomic lets two writers both "succeed" from one value, which shows as a value
written twice and a counter short of the total: ``test_the_race_finds_a_swap_without_its_lock``
runs the same race on a local storage whose swap takes no lock, and sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends import CLOUD_KINDS, EVERY_STORAGE_KIND, make_storage
from test_conditional_writes import through
from zarrlake.errors import ReadOnlyStorage
from zarrlake.storage import (
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    TransientStorageError,
    Versioned,
)
from zarrlake.storage.azure import AzureStorage
from zarrlake.storage.gcs import GCSStorage
from zarrlake.storage.http import HTTPStorage
from zarrlake.storage.local import LocalStorage
from zarrlake.storage.memory import MemoryStorage
from zarrlake.storage.s3 import S3Storage
from zarrlake_testkit.contract import ContractOnlyStorage
from zarrlake_testkit.counting import CountingStorage, Counts
from zarrlake_testkit.s3proxy import HeaderStrippingProxy

FORK = mp.get_context("fork")
PROBE = "refs/probe-cas"
WARNING = "does not keep compare-and-set writes"


@pytest.fixture(params=[*EVERY_STORAGE_KIND, "s3-urllib3", *CLOUD_KINDS])
def storage(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Storage:
    """A fresh, empty storage of every kind: S3 on both servers (and on moto through the
    urllib3 path, which anonymous storages and forked processes take), the cloud emulators."""
    if request.param == "s3-urllib3":
        monkeypatch.setenv("ZARRLAKE_S3_ENGINE", "urllib3")
        return make_storage("s3", tmp_path, request)
    return make_storage(request.param, tmp_path, request)


# -- the contract ----------------------------------------------------------------------------------


def test_none_creates_only_if_absent(storage: Storage) -> None:
    version = storage.put_if_version("root", b"one", None)
    assert storage.get_versioned("root") == Versioned(b"one", version)
    with pytest.raises(PreconditionFailed) as info:
        storage.put_if_version("root", b"two", None)
    assert info.value.key == "root"
    assert not isinstance(info.value, TransientStorageError)
    assert storage.get_versioned("root") == Versioned(b"one", version)
    # A create-only put loses to it too, and the other way round: one kind of create.
    with pytest.raises(PreconditionFailed):
        storage.put("root", b"three", create_only=True)
    storage.put("made", b"by put", create_only=True)
    with pytest.raises(PreconditionFailed):
        storage.put_if_version("made", b"by swap", None)
    assert storage.get("made") == b"by put"


def test_a_swap_from_the_current_version_replaces_the_object(storage: Storage) -> None:
    first = storage.put_if_version("a/root", b"one", None)
    second = storage.put_if_version("a/root", b"two" * 1000, first)
    assert second != first
    assert storage.get_versioned("a/root") == Versioned(b"two" * 1000, second)
    assert storage.get("a/root") == b"two" * 1000
    info = storage.head("a/root")
    assert info is not None and info.size == 3000
    assert storage.list_keys() == ["a/root"]
    third = storage.put_if_version("a/root", b"", second)  # empty bytes are bytes too
    assert storage.get_versioned("a/root") == Versioned(b"", third)
    assert asyncio.run(storage.get_versioned_async("a/root")) == Versioned(b"", third)


def test_a_stale_version_is_refused_and_changes_nothing(storage: Storage) -> None:
    first = storage.put_if_version("root", b"one", None)
    second = storage.put_if_version("root", b"two", first)
    with pytest.raises(PreconditionFailed) as info:
        storage.put_if_version("root", b"three", first)
    assert info.value.key == "root"
    assert storage.get_versioned("root") == Versioned(b"two", second)
    # A plain put changes the version: a swap from the one before it is refused.
    storage.put("root", b"written by put")
    with pytest.raises(PreconditionFailed):
        storage.put_if_version("root", b"four", second)
    assert storage.get("root") == b"written by put"
    assert storage.get_versioned("root").version not in (first, second)


def test_a_version_of_an_absent_object_is_refused(storage: Storage) -> None:
    with pytest.raises(ObjectNotFound) as info:
        storage.get_versioned("root")
    assert info.value.key == "root"
    version = storage.put_if_version("root", b"one", None)
    with pytest.raises(PreconditionFailed):
        storage.put_if_version("other", b"x", version)  # a version of another key
    assert storage.head("other") is None
    storage.delete_many(["root"])
    with pytest.raises(PreconditionFailed):
        storage.put_if_version("root", b"two", version)  # deleted since
    with pytest.raises(ObjectNotFound):
        storage.get_versioned("root")
    again = storage.put_if_version("root", b"three", None)
    assert storage.get_versioned("root") == Versioned(b"three", again)


def test_every_swap_returns_the_version_it_made(storage: Storage) -> None:
    version = storage.put_if_version("root", b"0", None)
    seen = [version]
    for i in range(1, 6):
        version = storage.put_if_version("root", f"{i}".encode() * i, version)
        assert storage.get_versioned("root") == Versioned(f"{i}".encode() * i, version)
        seen.append(version)
    assert len(set(seen)) == len(seen)  # new bytes, new version, on every backend


def test_a_pickled_copy_swaps_from_the_versions_of_the_original(storage: Storage) -> None:
    version = storage.put_if_version("root", b"one", None)
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.get_versioned("root") == Versioned(b"one", version)
    newer = copy.put_if_version("root", b"two", version)
    if storage.shared_across_processes:  # the same objects: the original's version is stale
        assert storage.get_versioned("root") == Versioned(b"two", newer)
        with pytest.raises(PreconditionFailed):
            storage.put_if_version("root", b"three", version)
    else:  # a memory store's copy is a snapshot, its versions go on from the original's
        assert storage.get_versioned("root") == Versioned(b"one", version)


# -- racing writers ------------------------------------------------------------------------------


def increment(storage: Storage, key: str, swaps: int, budget: int) -> list[tuple[int, str]]:
    """Read-then-swap ``key`` (a decimal counter) until ``swaps`` swaps succeeded, retrying
    refused ones: (value written, version returned) of each success. At most ``budget``
    attempts: a writer that never gets through fails the test instead of hanging it."""
    won: list[tuple[int, str]] = []
    for _ in range(budget):
        if len(won) == swaps:
            return won
        got = storage.get_versioned(key)
        value = int(got.data) + 1
        try:
            won.append((value, storage.put_if_version(key, str(value).encode(), got.version)))
        except PreconditionFailed:
            continue
    raise AssertionError(f"{len(won)} of {swaps} swaps in {budget} attempts")


def lost_updates(storage: Storage, key: str, won: list[tuple[int, str]]) -> list[str]:
    """What the successful swaps ``won`` (of every writer) and the counter's end say was lost."""
    problems: list[str] = []
    values = sorted(value for value, _ in won)
    if values != list(range(1, len(won) + 1)):
        twice = sorted({v for v in values if values.count(v) > 1})
        problems.append(f"{len(won)} swaps succeeded but wrote {len(set(values))} values")
        problems.append(f"values written twice (lost updates): {twice[:10]}")
    final = storage.get_versioned(key)
    if int(final.data) != len(won):
        problems.append(f"the counter is {int(final.data)} after {len(won)} successful swaps")
    last = max(won)
    if final.version != last[1]:
        problems.append(f"last swap returned {last[1]!r}, the counter reads {final.version!r}")
    return problems


def test_racing_swaps_threads(storage: Storage, request: pytest.FixtureRequest) -> None:
    writers, swaps = 6, 10
    if request.node.callspec.params["storage"] in ("s3-seaweedfs", "azure"):
        writers, swaps = 4, 6  # slower servers: fewer rounds, the same contention
    storage.put_if_version("counter", b"0", None)
    barrier = threading.Barrier(writers)
    results: dict[int, list[tuple[int, str]]] = {}
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            barrier.wait(60)
            results[w] = increment(storage, "counter", swaps, budget=swaps * writers * 50)
        except BaseException as e:  # anything else is a failure of the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert sorted(results) == list(range(writers))
    won = [w for ws in results.values() for w in ws]
    assert len(won) == writers * swaps
    assert lost_updates(storage, "counter", won) == []


class UnlockedLocal(LocalStorage):
    """A local storage whose swap compares and renames without its lock: not atomic."""

    @contextlib.contextmanager
    def _swap_lock(self, key: str) -> Iterator[None]:
        yield


def _race_worker(
    kind: type[LocalStorage],
    root: str,
    swaps: int,
    barrier: Any,
    out: mp.Queue[tuple[list[tuple[int, str]], str | None]],
) -> None:
    try:
        barrier.wait(60)
        out.put((increment(kind(root), "counter", swaps, budget=swaps * 200), None))
    except BaseException as e:
        out.put(([], repr(e)))


def race_processes(kind: type[LocalStorage], root: Path, writers: int, swaps: int) -> list[str]:
    """The racing increments from ``writers`` processes on one directory; lost_updates."""
    kind(root).put_if_version("counter", b"0", None)
    barrier = FORK.Barrier(writers)
    out: mp.Queue[tuple[list[tuple[int, str]], str | None]] = FORK.Queue()
    procs = [
        FORK.Process(target=_race_worker, args=(kind, str(root), swaps, barrier, out))
        for _ in range(writers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert [error for _, error in results if error] == []
    won = [w for ws, _ in results for w in ws]
    assert len(won) == writers * swaps
    return lost_updates(LocalStorage(root), "counter", won)


def test_racing_swaps_processes_local(tmp_path: Path) -> None:
    assert race_processes(LocalStorage, tmp_path / "repo", writers=4, swaps=60) == []
    store = LocalStorage(tmp_path / "repo")
    assert store.list_keys() == ["counter"]  # neither lock files nor temporary files listed


def test_the_race_finds_a_swap_without_its_lock(tmp_path: Path) -> None:
    # The same race, on a swap that compares and renames unlocked: processes on two cores
    # interleave between the compare and the rename, and updates are lost (about half of them
    # when this was written); the race above would fail on such a backend.
    problems = race_processes(UnlockedLocal, tmp_path / "repo", writers=4, swaps=100)
    assert any("lost updates" in p for p in problems), problems


# -- the check -----------------------------------------------------------------------------------


def test_the_check_passes_where_compare_and_set_is_kept(storage: Storage) -> None:
    counts = Counts(record_keys=True)
    client = CountingStorage(storage, counts)
    assert client.check_compare_and_set(PROBE) is True
    if not storage.compare_and_set_by_server:  # the backend's own: no request at all
        assert counts.total == 0 and storage.list_keys() == []
        return
    # The first check creates the probe object: a read that finds nothing, a create, a swap,
    # a stale swap (refused) and a read of the swap's bytes and version.
    assert counts.by_op() == {"get_versioned": 2, "put_if_version": 3}
    assert {key for _, key in counts.calls()} == {PROBE}
    assert storage.list_keys() == [PROBE]
    assert storage.get(PROBE).startswith(b"compare-and-set check ")
    counts.reset()
    assert client.check_compare_and_set(PROBE) is True  # answered from memory
    assert counts.total == 0
    copy = pickle.loads(pickle.dumps(client))  # a pickled copy keeps the answer
    assert copy.check_compare_and_set(PROBE) is True
    assert copy.counts.total == 0 and counts.total == 0
    other = CountingStorage(pickle.loads(pickle.dumps(storage)), counts)  # never asked
    assert other.check_compare_and_set(PROBE) is True
    assert counts.by_op() == {"get_versioned": 2, "put_if_version": 2}
    assert storage.list_keys() == [PROBE]


def test_clients_checking_at_once_all_pass(moto_s3: Any) -> None:
    # Every worker of a job checks at its first write, on the one probe key: their writes
    # disturb each other's checks, which must still say yes (and never raise).
    prefix = moto_s3.storage().prefix
    clients = [moto_s3.storage(prefix) for _ in range(8)]
    barrier = threading.Barrier(len(clients))
    answers: list[bool | BaseException] = []

    def check(client: Storage) -> None:
        barrier.wait(60)
        try:
            answers.append(client.check_compare_and_set(PROBE))
        except BaseException as e:
            answers.append(e)

    threads = [threading.Thread(target=check, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [True] * len(clients)


def test_the_check_finds_a_server_that_ignores_if_match(
    moto_s3: Any, caplog: pytest.LogCaptureFixture
) -> None:
    direct = moto_s3.storage()
    with HeaderStrippingProxy(moto_s3.endpoint) as proxy:
        careless = through(proxy, direct)
        # What such a server does: a swap from a stale version lands (a lost update).
        first = careless.put_if_version("root", b"one", None)
        careless.put_if_version("root", b"two", first)
        careless.put_if_version("root", b"three", first)
        assert direct.get("root") == b"three"
        with pytest.raises(PreconditionFailed):  # moto itself refuses it
            direct.put_if_version("root", b"four", first)

        with caplog.at_level(logging.WARNING, logger="zarrlake.storage"):
            assert careless.check_compare_and_set(PROBE) is False
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        message = warnings[0].getMessage()
        assert message.startswith(f"{careless.url} {WARNING} (")
        assert message.endswith("): the repository keeps the journal-only protocol")
        assert f"a write of {PROBE} at a version it no longer had succeeded" in message
        assert "\n" not in message and "testing" not in message

        caplog.clear()
        asked = len(proxy.requests())
        assert careless.check_compare_and_set(PROBE) is False  # answered from memory
        copy = pickle.loads(pickle.dumps(careless))  # a pickled copy keeps the answer
        assert copy.check_compare_and_set(PROBE) is False
        assert len(proxy.requests()) == asked
        assert not caplog.records  # said once
    assert moto_s3.storage(direct.prefix).check_compare_and_set(PROBE) is True


class RefusesEverySwap(MemoryStorage):
    """A server that answers every swap with 412, even from the current version."""

    compare_and_set_by_server = True

    def put_if_version(self, key: str, data: Any, version: str | None) -> str:
        if version is not None:
            raise PreconditionFailed(key)
        return super().put_if_version(key, data, version)


def test_a_server_refusing_every_swap_is_found_out(caplog: pytest.LogCaptureFixture) -> None:
    # It would lose nothing, but no commit could ever publish: said at once, not by a hang.
    with caplog.at_level(logging.WARNING, logger="zarrlake.storage"):
        assert RefusesEverySwap().check_compare_and_set(PROBE) is False
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"{WARNING} (a write of {PROBE} at its current version was refused)" in warning


def test_a_backend_without_it_says_no_and_refuses_before_any_request() -> None:
    # A closed port: a request would be a TransientStorageError, not a ReadOnlyStorage.
    published = Storage.http("http://127.0.0.1:9/repo")
    assert isinstance(published, HTTPStorage)
    assert published.supports_compare_and_set is False
    assert published.check_compare_and_set(PROBE) is False
    with pytest.raises(ReadOnlyStorage, match="read-only"):
        published.get_versioned("root")
    with pytest.raises(ReadOnlyStorage, match="read-only"):
        published.put_if_version("root", b"x", None)


CAPABILITIES = {
    # kind: (supports_compare_and_set, compare_and_set_by_server)
    MemoryStorage: (True, False),
    LocalStorage: (True, False),
    S3Storage: (True, True),
    AzureStorage: (True, True),
    GCSStorage: (True, True),
    HTTPStorage: (False, False),
}


def test_capabilities_are_declared_on_the_class(storage: Storage) -> None:
    for kind, (supported, by_server) in CAPABILITIES.items():
        assert (kind.supports_compare_and_set, kind.compare_and_set_by_server) == (
            supported,
            by_server,
        ), kind
    assert storage.supports_compare_and_set
    assert "supports_compare_and_set" not in vars(storage)  # the class's, not the instance's
    counted = CountingStorage(storage)  # a wrapper declares what it wraps
    assert counted.supports_compare_and_set == storage.supports_compare_and_set
    assert counted.compare_and_set_by_server == storage.compare_and_set_by_server


# -- local files: the lock files -----------------------------------------------------------------


def test_local_lock_files_are_no_objects(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "repo")
    keys = ["root", "mirror/root", "refs/probe-cas"]
    for key in keys:
        version = store.put_if_version(key, b"one", None)
        store.put_if_version(key, b"two", version)
    locks = list((tmp_path / "repo" / ".tmp" / "locks").iterdir())
    assert len(locks) == len(keys)  # one per key swapped: they exist, and are not listed
    assert store.list_keys() == sorted(keys)
    assert sorted(store.list_dirs("")) == ["mirror", "refs"]
    assert store.list_keys("r") == ["refs/probe-cas", "root"]
    assert store.delete_many(keys) == len(keys)
    assert store.list_keys() == [] and store.list_dirs("") == []
    with pytest.raises(ObjectNotFound):
        store.get_versioned("root")
    # A lock file left from before does not stand in the way of creating the key anew.
    made = store.put_if_version("root", b"again", None)
    assert store.get_versioned("root") == Versioned(b"again", made)


def test_local_a_rewrite_of_the_same_bytes_is_a_new_version(tmp_path: Path) -> None:
    # The version is more than the bytes' digest: two writers that read one version cannot
    # both swap, even when the first wrote back what it read.
    store = LocalStorage(tmp_path)
    first = store.put_if_version("root", b"same", None)
    second = store.put_if_version("root", b"same", first)
    assert second != first
    with pytest.raises(PreconditionFailed):
        store.put_if_version("root", b"other", first)
    assert store.get_versioned("root") == Versioned(b"same", second)


def test_contract_storage_names_the_folders_of_swapped_objects() -> None:
    store = ContractOnlyStorage()
    store.put_if_version("mirror/root", b"x", None)
    assert store.list_dirs("") == ["mirror"]
    assert store.check_compare_and_set(PROBE) is True  # through the servers' path
    assert sorted(store.list_keys()) == ["mirror/root", PROBE]
