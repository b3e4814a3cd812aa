"""Read-ahead inside packs (``zarrlake.readahead``): the streams that start windows, windows shared
by the reads inside them, and what a scan of packed chunks costs on a real S3 server.

The planner's tests below drive :class:`PackReadAhead` with a fetch function over real bytes;
everything after them reads through real S3 servers (moto and SeaweedFS)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.errors import CorruptObject, StorageError
from zarrlake.format.ids import LEGACY_CONTENT_HASH
from zarrlake.format.model import PACKED, pack_key
from zarrlake.objects import ObjectStore
from zarrlake.readahead import SLACK, STREAK, WINDOW_MAX, WINDOW_MIN, PackReadAhead
from zarrlake_testkit.counting import CountingStorage, Counts

PACK = bytes(np.random.default_rng(3).integers(0, 256, 12 << 20, dtype=np.uint8))


class Fetches:
    """The fetch function a window is given: bytes of :data:`PACK`, each request recorded."""

    def __init__(self, data: bytes = PACK) -> None:
        self.data = data
        self.asked: list[tuple[int, int]] = []
        self.fail: BaseException | None = None
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
        self.fail_spans_over: int | None = None

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        if byte_range is not None:
            self.spans.append(byte_range[1] - byte_range[0])
            if self.fail_spans_over is not None and self.spans[-1] > self.fail_spans_over:
                self.counts.add("get_range", key)
                raise StorageError(f"{key}: injected failure of a {self.spans[-1]}-byte range")
        return super().get(key, byte_range)


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
    log.spans.clear()
    np.testing.assert_array_equal(zarr.open_array(session.store, path="data")[:], values)
    ranged = log.counts.by_op().get("get_range", 0)
    assert 0 < ranged <= 40, log.counts.by_op()
    assert max(log.spans) > WINDOW_MIN // 2  # windows were read, not chunks
    # Read again on the same session: the windows it kept serve most of it.
    log.counts.reset()
    np.testing.assert_array_equal(zarr.open_array(session.store, path="data")[:], values)
    assert log.counts.by_op().get("get_range", 0) <= ranged


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


def test_a_failed_read_ahead_falls_back_to_each_read(s3_storage: zarrlake.Storage) -> None:
    values = _packed_array(s3_storage, 3000)
    log = RangeLog(s3_storage)
    log.fail_spans_over = 64 * 1024  # every window's request fails; chunk-sized ones do not
    session = zarrlake.Repository.open(log).readonly_session("main")
    np.testing.assert_array_equal(zarr.open_array(session.store, path="data")[:], values)
    assert max(log.spans) > 64 * 1024  # windows were tried, and failed


def test_a_window_over_a_pack_shorter_than_its_refs_fails_only_the_refs_past_its_end(
    s3_storage: zarrlake.Storage,
) -> None:
    pack = PACK[: 64 * 1024]
    pack_id = "ab" * 32
    s3_storage.put(pack_key(pack_id), pack)
    objects = ObjectStore(s3_storage, LEGACY_CONTENT_HASH)

    def ref(offset: int, length: int = 1024) -> tuple:
        return (PACKED, pack_id, offset, length, b"")

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
