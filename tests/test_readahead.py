"""Read-ahead inside packs (``zarrlake.readahead``): the streams that start windows, windows shared
by the reads inside them, and what a scan of packed chunks costs on a real S3 server.

The planner's tests below drive :class:`PackReadAhead` with a fetch function over real bytes;
everything after them reads through real S3 servers (moto and SeaweedFS)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.core.buffer import default_buffer_prototype

import zarrlake
from zarrlake.errors import CorruptObject, StorageError
from zarrlake.format.ids import LEGACY_CONTENT_HASH
from zarrlake.format.model import PACKED, pack_key
from zarrlake.objects import ObjectStore
from zarrlake.readahead import (
    PENDING,
    SLACK,
    STREAK,
    WINDOW_MAX,
    WINDOW_MIN,
    PackReadAhead,
)
from zarrlake_testkit.counting import CountingStorage, Counts

PACK = bytes(np.random.default_rng(3).integers(0, 256, 12 << 20, dtype=np.uint8))


class Fetches:
    """The fetch function a window is given: bytes of :data:`PACK`, each request recorded."""

    def __init__(self, data: bytes = PACK) -> None:
        self.data = data
        self.asked: list[tuple[int, int]] = []
        self.fail: BaseException | None = None  # raised by the next fetches
        self.gate: threading.Event | None = None

    def __call__(self, start: int, end: int) -> bytes:
        self.asked.append((start, end))
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return self.data[start:end]


def _stream(ahead: PackReadAhead, fetch: Fetches, key: str, reads: int, step: int) -> list[Any]:
    """``reads`` requests of ``step`` bytes one after another from 0; the windows planned."""
    return [ahead.plan(key, i * step, (i + 1) * step, fetch) for i in range(reads)]


# -- the planner -----------------------------------------------------------------------------------


def test_requests_in_a_row_start_a_window_after_the_streak() -> None:
    ahead, fetch = PackReadAhead(), Fetches()
    planned = _stream(ahead, fetch, "p", STREAK + 1, 1024)
    assert planned[:STREAK] == [None] * STREAK
    window = planned[STREAK]
    assert window is not None
    assert (window.start, window.end) == (STREAK * 1024, STREAK * 1024 + WINDOW_MIN)
    # Reads inside it, before and after it arrives, join it: one request in all.
    assert ahead.lookup("p", window.start + 10, window.start + 5000) is window
    assert window.result() == PACK[window.start : window.end]
    assert ahead.lookup("p", window.end - 100, window.end) is window
    assert ahead.lookup("p", window.end - 100, window.end + 1) is None
    assert ahead.lookup("other", window.start, window.start + 1) is None
    assert fetch.asked == [(window.start, window.end)]


def test_windows_double_up_to_the_largest_and_follow_the_stream() -> None:
    ahead, fetch = PackReadAhead(capacity=64 << 20), Fetches()
    _stream(ahead, fetch, "p", STREAK, 1024)
    at, sizes = STREAK * 1024, []
    for _ in range(8):
        window = ahead.plan("p", at, at + 1024, fetch)
        assert window is not None and window.start == at
        window.result()
        sizes.append(window.end - window.start)
        at = window.end
    assert sizes == [min(WINDOW_MIN << i, WINDOW_MAX) for i in range(8)]
    assert sizes[-1] == WINDOW_MAX


def test_random_requests_never_read_ahead() -> None:
    ahead, fetch = PackReadAhead(), Fetches()
    rng = np.random.default_rng(1)
    starts = [int(s) * (SLACK + 4096) for s in rng.permutation(2000)[:300]]
    planned = [ahead.plan("p", s, s + 1024, fetch) for s in starts]
    assert all(w is None for w in planned)
    # A stream broken by a jump starts over: the streak counts again from the jump.
    _stream(ahead, fetch, "q", STREAK, 1024)
    assert ahead.plan("q", 10 << 20, (10 << 20) + 1024, fetch) is None


def test_a_window_is_fetched_once_by_whoever_needs_it_first() -> None:
    ahead, fetch = PackReadAhead(), Fetches()
    window = _stream(ahead, fetch, "p", STREAK + 1, 1024)[-1]
    fetch.gate = threading.Event()
    got: list[bytes] = []
    readers = [threading.Thread(target=lambda: got.append(window.result())) for _ in range(4)]
    for t in readers:
        t.start()
    fetch.gate.set()
    for t in readers:
        t.join(10)
    assert got == [PACK[window.start : window.end]] * 4
    assert len(fetch.asked) == 1


def test_a_failed_window_raises_to_every_reader_and_is_forgotten() -> None:
    ahead, fetch = PackReadAhead(), Fetches()
    fetch.fail = StorageError("the server went away")
    window = _stream(ahead, fetch, "p", STREAK + 1, 1024)[-1]
    with pytest.raises(StorageError):
        window.result()
    with pytest.raises(StorageError):
        window.result()  # a reader that joined it gets the same error, not a hang
    assert ahead.lookup("p", window.start, window.start + 1) is None
    fetch.fail = None  # the stream starts over: the streak again, then a window that works
    at = window.start
    planned = [
        ahead.plan("p", at + i * 1024, at + (i + 1) * 1024, fetch) for i in range(STREAK + 1)
    ]
    assert planned[:STREAK] == [None] * STREAK
    again = planned[STREAK]
    assert again is not None and again.result() == PACK[again.start : again.end]


def test_an_interrupted_fetch_leaves_the_window_to_the_next_reader() -> None:
    ahead, fetch = PackReadAhead(), Fetches()
    window = _stream(ahead, fetch, "p", STREAK + 1, 1024)[-1]
    fetch.fail = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        window.result()
    fetch.fail = None
    assert ahead.lookup("p", window.start, window.start + 1) is window
    assert window.result() == PACK[window.start : window.end]
    assert len(fetch.asked) == 2


def test_windows_no_one_fetches_are_forgotten_beyond_a_bound() -> None:
    ahead, fetch = PackReadAhead(), Fetches()
    windows = [_stream(ahead, fetch, f"p{i}", STREAK + 1, 1024)[-1] for i in range(PENDING + 5)]
    assert all(w is not None for w in windows)
    found = [ahead.lookup(f"p{i}", w.start, w.start + 1) for i, w in enumerate(windows)]
    assert found[:5] == [None] * 5 and found[5:] == windows[5:]
    assert fetch.asked == []


def test_a_pack_ending_inside_a_window_covers_only_what_it_has() -> None:
    short = PACK[: (STREAK * 1024) + 5000]
    ahead, fetch = PackReadAhead(), Fetches(short)
    window = _stream(ahead, fetch, "p", STREAK + 1, 1024)[-1]
    assert window.result() == short[window.start :]
    assert ahead.lookup("p", window.start, len(short)) is window
    assert ahead.lookup("p", len(short) - 10, len(short) + 1) is None  # past the pack's end


def test_finished_windows_are_kept_within_the_byte_budget() -> None:
    ahead = PackReadAhead(capacity=3 * WINDOW_MIN)
    fetch = Fetches()
    windows = []
    for key in ("a", "b", "c", "d"):
        window = _stream(ahead, fetch, key, STREAK + 1, 1024)[-1]
        window.result()
        windows.append(window)
    assert ahead.lookup("a", windows[0].start, windows[0].start + 1) is None  # the oldest went
    for key, window in zip("bcd", windows[1:], strict=True):
        assert ahead.lookup(key, window.start, window.start + 1) is window


# -- on real S3 servers ----------------------------------------------------------------------------


class RangeLog(CountingStorage):
    """Counts requests, and records the span of each ranged GET."""

    def __init__(self, inner: zarrlake.Storage) -> None:
        super().__init__(inner, Counts())
        self.spans: list[int] = []
        self.ranges: list[tuple[str, int, int]] = []
        self.fail_spans_over: int | None = None

    def _record(self, key: str, byte_range: tuple[int, int] | None) -> None:
        if byte_range is not None:
            self.spans.append(byte_range[1] - byte_range[0])
            self.ranges.append((key, *byte_range))
            if self.fail_spans_over is not None and self.spans[-1] > self.fail_spans_over:
                self.counts.add("get_range", key)
                raise StorageError(f"{key}: injected failure of a {self.spans[-1]}-byte range")

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        self._record(key, byte_range)
        return super().get(key, byte_range)

    async def get_async(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        self._record(key, byte_range)
        return await super().get_async(key, byte_range)


def _packed_array(storage: zarrlake.Storage, chunks: int) -> np.ndarray:
    values = np.random.default_rng(7).integers(0, 256, chunks * 1024, dtype=np.uint8)
    repo = zarrlake.Repository.create(storage)
    with repo.transaction("main", message="packed") as store:
        arr = zarr.create_array(store, name="data", shape=values.shape, chunks=(1024,),
                                dtype="uint8", compressors=None, fill_value=0)  # fmt: skip
        arr[:] = values
    return values


@pytest.fixture
def s3_storage(s3_server: Any) -> zarrlake.Storage:
    storage: zarrlake.Storage = s3_server.storage()
    return storage


def test_a_scan_of_packed_chunks_reads_each_pack_in_a_few_requests(
    s3_storage: zarrlake.Storage,
) -> None:
    """4,000 chunks of 1 KiB, in 1 MiB packs: Zarr reads 10 at a time, and without read-ahead
    the scan took ~420 ranged GETs (~10 chunks each); with it, a handful per pack."""
    values = _packed_array(s3_storage, 4000)
    log = RangeLog(s3_storage)
    session = zarrlake.Repository.open(log).readonly_session("main")
    log.counts.reset()
    log.ranges.clear()
    np.testing.assert_array_equal(zarr.open_array(session.store, path="data")[:], values)
    ranged = log.counts.by_op().get("get_range", 0)
    # ~20 (2 exact requests and 3 windows a pack); a first read that reaches the store late
    # (its shard resolved on another thread) can start a stream over: a loose bound, a quarter
    # of the ~400 requests a scan makes without read-ahead.
    assert 0 < ranged < 4000 // 10 // 4, log.counts.by_op()
    windows = [(k, a, b) for k, a, b in log.ranges if b - a >= WINDOW_MIN]
    assert windows  # windows were read, not chunks
    # Read again on the same session. Which reads Zarr hands over together depends on timing,
    # so the count is not fixed; what is: the windows the session kept (32 MiB holds them all)
    # serve every chunk inside them, so each request starts at a chunk outside every window.
    sizes = {k: len(s3_storage.get(k)) for k in s3_storage.list_keys("packs/")}

    def kept(key: str, at: int) -> bool:
        return any(k == key and a <= at < min(b, sizes[k]) for k, a, b in windows)

    outside = sum(
        1 for k, n in sizes.items() for at in range(0, n, 1024) if not kept(k, at)
    )  # the chunks of the first requests of each pack, and any tail past the last window
    log.counts.reset()
    log.ranges.clear()
    np.testing.assert_array_equal(zarr.open_array(session.store, path="data")[:], values)
    assert log.ranges, "the first requests of each pack are made again"
    assert not [r for r in log.ranges if kept(r[0], r[1])], log.ranges
    assert len(log.ranges) <= outside < 4000 // 10, (len(log.ranges), outside)


def test_random_reads_of_packed_chunks_fetch_only_their_chunk(s3_storage: zarrlake.Storage) -> None:
    values = _packed_array(s3_storage, 2000)
    log = RangeLog(s3_storage)
    arr = zarr.open_array(zarrlake.Repository.open(log).readonly_session("main").store, path="data")
    # Random picks, none of them landing just after the one before (that would look like a
    # stream: see SLACK). Every read fetches exactly its chunk.
    picks: list[int] = []
    for i in np.random.default_rng(2).permutation(2000):
        if not picks or not 0 <= int(i) - picks[-1] <= SLACK // 1024 + 1:
            picks.append(int(i))
    picks = picks[:60]
    log.spans.clear()
    for i in picks:
        np.testing.assert_array_equal(
            arr[i * 1024 : (i + 1) * 1024], values[i * 1024 : (i + 1) * 1024]
        )
    assert log.spans == [1024] * len(picks)


def test_single_reads_past_a_truncated_pack_or_of_a_missing_one_are_corrupt(
    s3_storage: zarrlake.Storage,
) -> None:
    """One chunk at a time (each its own ranged request, awaited on Zarr's loop): a chunk the
    pack no longer holds whole, or whose pack is gone, is CorruptObject, never short bytes."""
    values = _packed_array(s3_storage, 1500)
    big, *rest = sorted(s3_storage.list_keys("packs/"), key=lambda k: -len(s3_storage.get(k)))
    whole = s3_storage.get(big)
    s3_storage.put(big, whole[: len(whole) - 10_000])
    for key in rest:
        s3_storage.delete_many([key])
    arr = zarr.open_array(zarrlake.Repository.open(s3_storage).readonly_session("main").store,
                          path="data")  # fmt: skip
    raw, good, bad = values.tobytes(), 0, 0
    # Every chunk once, each 101 after the one before: never a stream, so no read-ahead.
    for i in (k * 101 % 1500 for k in range(1500)):
        try:
            got = arr[i * 1024 : (i + 1) * 1024].tobytes()
        except CorruptObject:
            bad += 1
        else:
            assert got == raw[i * 1024 : (i + 1) * 1024], i
            good += 1
    held = (len(whole) - 10_000) // 1024  # the chunks the truncated pack still holds whole
    assert good == held and bad == 1500 - held, (good, bad, held)


def _packed_ref(pack: bytes, pack_id: str, offset: int, length: int) -> tuple:
    """A packed chunk's ref as a session writes it: its digest is that of its bytes (SHA-256,
    the hash of these tests' object stores), so that verified reads take it."""
    return (
        PACKED,
        pack_id,
        offset,
        length,
        hashlib.sha256(pack[offset : offset + length]).digest(),
    )


def test_a_failed_read_ahead_sends_its_reads_to_their_own_requests(
    s3_storage: zarrlake.Storage,
) -> None:
    pack = PACK[: 1 << 20]
    pack_id = "cd" * 32
    s3_storage.put(pack_key(pack_id), pack)
    log = RangeLog(s3_storage)
    log.fail_spans_over = 64 * 1024  # every window's request fails; chunk-sized ones do not
    objects = ObjectStore(log, LEGACY_CONTENT_HASH)
    for i in range(12):  # one read at a time, each following the one before
        ref = _packed_ref(pack, pack_id, i * 1024, 1024)
        assert objects.read_chunks([(ref, None)]) == [pack[i * 1024 : (i + 1) * 1024]]
    # Every third request was a window, which failed; its read then made its own request, and
    # the stream started over.
    window = STREAK * 1024 + WINDOW_MIN - STREAK * 1024
    assert log.spans == ([1024] * STREAK + [window, 1024]) * 4


def test_a_scan_whose_windows_all_fail_still_reads_everything(s3_storage: zarrlake.Storage) -> None:
    values = _packed_array(s3_storage, 3000)
    log = RangeLog(s3_storage)
    log.fail_spans_over = 64 * 1024
    session = zarrlake.Repository.open(log).readonly_session("main")
    np.testing.assert_array_equal(zarr.open_array(session.store, path="data")[:], values)
    assert max(log.spans) > 64 * 1024  # windows were tried, and failed


def test_a_window_no_job_fetched_does_not_make_a_single_read_fetch_it(
    s3_storage: zarrlake.Storage,
) -> None:
    """A planned window whose job never ran (its batch failed first, or was cancelled): a
    single read inside it still fetches just its chunk."""
    pack = PACK[: 1 << 20]
    pack_id = "ef" * 32
    s3_storage.put(pack_key(pack_id), pack)
    log = RangeLog(s3_storage)
    objects = ObjectStore(log, LEGACY_CONTENT_HASH)
    refs = [_packed_ref(pack, pack_id, i * 1024, 1024) for i in range(STREAK + 1)]
    for ref in refs[:STREAK]:
        objects.read_chunks([(ref, None)])
    jobs = objects.plan_reads([(refs[STREAK], None)])  # plans a window; never run
    assert len(jobs) == 1
    log.spans.clear()
    inside = _packed_ref(pack, pack_id, 100 * 1024, 1024)
    assert objects.read_chunk(inside) == pack[100 * 1024 : 101 * 1024]
    assert log.spans == [1024]
    # A batch does join it (its job is likely about to run), and whoever comes first fetches it.
    assert objects.read_chunks([(inside, None)]) == [pack[100 * 1024 : 101 * 1024]]
    assert log.spans == [1024, WINDOW_MIN]
    assert jobs[0].fetch() == [pack[STREAK * 1024 : (STREAK + 1) * 1024]]
    assert log.spans == [1024, WINDOW_MIN]  # the planner's job found it fetched


def test_a_scan_over_a_truncated_pack_fails_only_the_chunks_past_its_end(
    s3_storage: zarrlake.Storage,
) -> None:
    """Zarr's way of reading (10 at a time, the next as soon as one is done) through the store:
    the reads of chunks the pack still holds get their bytes, read ahead or not; those past its
    end get CorruptObject, each its own."""
    values = _packed_array(s3_storage, 1500)
    [key, *_] = sorted(s3_storage.list_keys("packs/"), key=lambda k: -len(s3_storage.get(k)))
    whole = s3_storage.get(key)
    s3_storage.put(key, whole[: len(whole) - 10_000])
    session = zarrlake.Repository.open(s3_storage).readonly_session("main")
    store = session.store
    proto = default_buffer_prototype()
    zarr.core.sync.sync(store.get("data/zarr.json", proto))

    async def scan() -> list[object]:
        slots = asyncio.Semaphore(10)

        async def one(i: int) -> object:
            async with slots:
                return await store.get(f"data/c/{i}", proto)

        return await asyncio.gather(*(one(i) for i in range(1500)), return_exceptions=True)

    got = zarr.core.sync.sync(scan())
    bad = [i for i, g in enumerate(got) if isinstance(g, BaseException)]
    assert 9 <= len(bad) <= 11, bad  # the chunks in the 10,000 bytes cut off
    assert all(isinstance(got[i], CorruptObject) for i in bad)
    raw = values.tobytes()
    for i, g in enumerate(got):
        if i not in bad:
            assert g.to_bytes() == raw[i * 1024 : (i + 1) * 1024]  # type: ignore[union-attr]


def test_a_window_over_a_pack_shorter_than_its_refs_fails_only_the_refs_past_its_end(
    s3_storage: zarrlake.Storage,
) -> None:
    pack = PACK[: 64 * 1024]
    pack_id = "ab" * 32
    s3_storage.put(pack_key(pack_id), pack)
    objects = ObjectStore(s3_storage, LEGACY_CONTENT_HASH)

    def ref(offset: int, length: int = 1024) -> tuple:
        return _packed_ref(pack, pack_id, offset, length)

    for i in range(STREAK):  # a stream: the next batch reads ahead
        assert objects.read_chunks([(ref(i * 1024), None)]) == [pack[i * 1024 : (i + 1) * 1024]]
    at = STREAK * 1024
    beyond = ref(len(pack) - 100, 1024)  # runs 924 bytes past the pack's end
    with pytest.raises(CorruptObject, match="pack ends before"):
        objects.read_chunks([(ref(at), None), (beyond, None)])
    # The window holds what the pack has: reads inside it are served, the bad ref still fails.
    assert objects.read_chunks([(ref(at + 1024), None)]) == [pack[at + 1024 : at + 2048]]
    with pytest.raises(CorruptObject, match="pack ends before"):
        objects.read_chunk(beyond)
    assert objects.read_chunk(beyond, (0, 100)) == pack[-100:]


def test_local_storage_reads_no_windows(tmp_path: Path) -> None:
    """Local reads of small chunks cost less than a window would: read-ahead stays off there."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    values = _packed_array(storage, 500)
    log = RangeLog(storage)
    arr = zarr.open_array(zarrlake.Repository.open(log).readonly_session("main").store, path="data")
    np.testing.assert_array_equal(arr[:], values)
    assert log.spans and max(log.spans) <= 64 * 1024
