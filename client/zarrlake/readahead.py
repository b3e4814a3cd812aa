"""Read-ahead inside packs: reads that walk through a pack in order share a few large requests.

Zarr reads an array's chunks a few at a time (``async.concurrency``, 10 by default), so a scan of
20,000 packed 1 KiB chunks reaches the store as ~2,000 small batches, and coalescing within a
batch alone still makes ~2,000 ranged requests. :class:`PackReadAhead` notices when the requests
of a pack follow each other (each starts where the previous one ended) and, from the third such
request on, fetches a window ahead of the reads: 256 KiB, doubling up to 4 MiB. Reads that fall
inside a window, finished or still in flight, take their bytes from it instead of making a
request. Random reads never start a window, so they keep making one small request each.

Packs are immutable, so a window's bytes never go stale. Finished windows are kept in a
byte-bounded LRU. Whoever needs a window first makes its request (the job that planned it, or
a read that joined it): a read waits only on a request that is already running, never on one
queued behind it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

#: The first read-ahead window of a stream, and the largest (each sequential request doubles it).
WINDOW_MIN = 256 * 1024
WINDOW_MAX = 4 * 1024 * 1024
#: Finished windows kept per :class:`PackReadAhead`, in bytes.
CACHE_BYTES = 32 * 1024 * 1024
#: Requests of a pack in a row, each starting where the previous ended, before read-ahead starts.
STREAK = 2
#: A request follows the previous one if it starts after that one's start and at most this many
#: bytes after its end: a chunk that straddles a window's end starts inside it, and a scan of one
#: array skips the chunks of others written into the same pack.
SLACK = 32 * 1024
#: Packs whose streams are remembered (the oldest is forgotten first).
STREAMS = 1024


class Window:
    """Bytes ``[start, end)`` of one pack, fetched once for every read inside it. ``end`` is what
    was asked for; a pack that ends sooner gives fewer bytes (:meth:`covers` then says so)."""

    __slots__ = ("_claimed", "_done", "_error", "_fetch", "_owner", "data", "end", "key", "start")

    def __init__(
        self, owner: PackReadAhead, key: str, start: int, end: int, fetch: Callable[[], bytes]
    ) -> None:
        self._owner = owner
        self.key, self.start, self.end = key, start, end
        self.data: bytes | None = None
        self._fetch: Callable[[], bytes] | None = fetch
        self._error: BaseException | None = None
        self._claimed = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def covers(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` is inside: the bytes received, or, in flight, those asked."""
        if start < self.start:
            return False
        if self.data is not None:
            return end <= self.start + len(self.data)
        return end <= self.end and not self._done.is_set()

    def result(self) -> bytes:
        """The window's bytes: fetched here if no one has started, else waited for. Raises the
        fetch's error (to every reader of the window)."""
        fetch = None
        with _CLAIM:
            if not self._claimed:
                self._claimed, fetch, self._fetch = True, self._fetch, None
        if fetch is not None:
            try:
                self.data = fetch()
            except BaseException as e:
                self._error = e
                raise
            finally:
                self._done.set()
                self._owner.finished(self)
            return self.data
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self.data is not None
        return self.data


_CLAIM = threading.Lock()


class PackReadAhead:
    """The read-ahead windows of one object store's packs and the streams that start them."""

    def __init__(self, capacity: int = CACHE_BYTES) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._windows: dict[str, list[Window]] = {}
        self._finished: OrderedDict[Window, int] = OrderedDict()
        self._bytes = 0
        # pack key -> (start and end of its last request, requests in a row, next window size)
        self._streams: OrderedDict[str, tuple[int, int, int, int]] = OrderedDict()

    def lookup(self, key: str, start: int, end: int) -> Window | None:
        """A window holding (or fetching) bytes ``[start, end)`` of pack ``key``, or None."""
        with self._lock:
            for w in self._windows.get(key, ()):
                if w.covers(start, end):
                    if w in self._finished:
                        self._finished.move_to_end(w)
                    return w
        return None

    def plan(
        self, key: str, start: int, end: int, fetch: Callable[[int, int], bytes]
    ) -> Window | None:
        """Note a request for ``[start, end)`` of pack ``key``; if it continues a stream, a
        window from ``start`` reaching past ``end`` that later reads can join (``fetch(start,
        end)`` makes its request), else None: the caller fetches exactly what it asked for."""
        with self._lock:
            last_start, last_end, streak, size = self._streams.pop(key, (-1, -1, 0, WINDOW_MIN))
            if last_start < start <= last_end + SLACK and last_end >= 0:
                streak += 1
            else:
                streak, size = 0, WINDOW_MIN
            window = None
            if streak >= STREAK:
                stop = max(end, start + size)
                window = Window(self, key, start, stop, lambda: fetch(start, stop))
                self._windows.setdefault(key, []).append(window)
                end, size = stop, min(2 * size, WINDOW_MAX)
            self._streams[key] = (start, end, streak, size)
            while len(self._streams) > STREAMS:
                self._streams.popitem(last=False)
        return window

    def finished(self, window: Window) -> None:
        """Keep ``window`` (its request is done) for later reads, within the byte budget; drop
        it if its request failed."""
        with self._lock:
            if window.data is None:  # failed: drop it, and start its stream over
                self._drop(window)
                self._streams.pop(window.key, None)
                return
            self._finished[window] = len(window.data)
            self._bytes += len(window.data)
            while self._bytes > self.capacity and self._finished:
                old, n = self._finished.popitem(last=False)
                self._bytes -= n
                self._drop(old)

    def _drop(self, window: Window) -> None:
        windows = self._windows.get(window.key)
        if windows is not None and window in windows:
            windows.remove(window)
            if not windows:
                del self._windows[window.key]
