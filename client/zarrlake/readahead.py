"""Read-ahead inside packs: reads that walk through a pack in order share a few large requests.

Zarr reads an array's chunks a few at a time (``async.concurrency``, 10 by default), so a scan of
20,000 packed 1 KiB chunks reaches the store as ~2,000 small batches, and coalescing within a
batch alone still makes ~2,000 ranged requests. :class:`PackReadAhead` notices a stream: requests
of one pack that follow each other, each starting after the previous one's start and at most
:data:`SLACK` bytes after its end. The third request of a stream fetches a window ahead of the
reads instead: 256 KiB, doubling up to 4 MiB. Reads that fall inside a window, finished or in
flight, take their bytes from it instead of making a request. A random read rarely continues a
stream (it would have to land just after the previous request, twice in a row), so random reads
make one small request each.

Packs are immutable, so a window's bytes never go stale. Finished windows are kept in a
byte-bounded LRU; at most :data:`PENDING` windows wait to be fetched. Whoever needs a window
first makes its request (the job that planned it, or a read that joined it): a reader waits only
on a request that is already running, never on one queued behind it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

#: The first read-ahead window of a stream, and the largest (each window doubles the next).
WINDOW_MIN = 256 * 1024
WINDOW_MAX = 4 * 1024 * 1024
#: Finished windows kept per :class:`PackReadAhead`, in bytes.
CACHE_BYTES = 32 * 1024 * 1024
#: Windows planned and not yet finished that reads may join (the oldest is forgotten first: a
#: job that never ran leaves its window unfetched).
PENDING = 64
#: Requests of a stream before the one that reads ahead.
STREAK = 2
#: A request continues a stream if it starts after the previous one's start and at most this
#: many bytes after its end: a chunk straddling a window's end starts inside the window, and a
#: scan of one array skips the chunks of others that were written into the same pack.
SLACK = 32 * 1024
#: Packs whose streams are remembered (the oldest is forgotten first).
STREAMS = 1024


class Window:
    """Bytes ``[start, end)`` of one pack, fetched once for every read inside it. ``end`` is what
    was asked for; a pack that ends sooner gives fewer bytes (:meth:`covers` then says so)."""

    __slots__ = ("_claimed", "_error", "_fetch", "_owner", "data", "end", "key", "start")

    def __init__(
        self, owner: PackReadAhead, key: str, start: int, end: int, fetch: Callable[[], bytes]
    ) -> None:
        self._owner = owner
        self.key, self.start, self.end = key, start, end
        self.data: bytes | None = None
        self._fetch: Callable[[], bytes] | None = fetch
        self._error: Exception | None = None
        self._claimed = False

    @property
    def started(self) -> bool:
        """Whether someone is making (or has made) its request."""
        return self._claimed

    def covers(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` is inside: the bytes received, or, in flight, those asked."""
        if start < self.start:
            return False
        if self.data is not None:
            return end <= self.start + len(self.data)
        return end <= self.end and self._error is None

    def result(self) -> bytes:
        """The window's bytes: fetched here if no one has started, else waited for. Raises the
        fetch's error (to every reader of the window). A fetch interrupted by something other
        than an error (``KeyboardInterrupt``) leaves the window to the next reader."""
        cond = self._owner.changed
        while True:
            with cond:
                if self.data is not None:
                    return self.data
                if self._error is not None:
                    raise self._error
                fetch = None
                if not self._claimed:
                    self._claimed, fetch = True, self._fetch
                else:
                    cond.wait()
                    continue
            assert fetch is not None
            try:
                data = fetch()
            except Exception as e:
                with cond:
                    self._error = e
                    cond.notify_all()
                self._owner.finished(self)
                raise
            except BaseException:
                with cond:
                    self._claimed = False
                    cond.notify_all()
                raise
            with cond:
                self.data, self._fetch = data, None
                cond.notify_all()
            self._owner.finished(self)
            return data


class PackReadAhead:
    """The read-ahead windows of one object store's packs and the streams that start them."""

    def __init__(self, capacity: int = CACHE_BYTES) -> None:
        self.capacity = capacity
        #: Guards everything here and the windows' state; notified when a window changes.
        self.changed = threading.Condition()
        self._windows: dict[str, list[Window]] = {}
        self._finished: OrderedDict[Window, int] = OrderedDict()
        self._pending: OrderedDict[Window, None] = OrderedDict()
        self._bytes = 0
        # pack key -> (start and end of its last request, requests in a row, next window size)
        self._streams: OrderedDict[str, tuple[int, int, int, int]] = OrderedDict()

    def lookup(self, key: str, start: int, end: int, *, started: bool = False) -> Window | None:
        """A window holding (or fetching) bytes ``[start, end)`` of pack ``key``, or None.
        ``started``: only a window whose request is running or done (a single read joins no
        window it would have to fetch itself)."""
        with self.changed:
            for w in self._windows.get(key, ()):
                if w.covers(start, end) and (w.started or not started):
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
        with self.changed:
            last_start, last_end, streak, size = self._streams.pop(key, (-1, -1, 0, WINDOW_MIN))
            if last_end >= 0 and last_start < start <= last_end + SLACK:
                streak += 1
            else:
                streak, size = 0, WINDOW_MIN
            window = None
            if streak >= STREAK:
                stop = max(end, start + size)
                window = Window(self, key, start, stop, lambda: fetch(start, stop))
                self._windows.setdefault(key, []).append(window)
                self._pending[window] = None
                while len(self._pending) > PENDING:
                    self._drop(next(iter(self._pending)))
                end, size = stop, min(2 * size, WINDOW_MAX)
            self._streams[key] = (start, end, streak, size)
            while len(self._streams) > STREAMS:
                self._streams.popitem(last=False)
        return window

    def finished(self, window: Window) -> None:
        """Keep ``window`` (its request is done) for later reads, within the byte budget; drop
        it, and start its stream over, if its request failed."""
        with self.changed:
            self._pending.pop(window, None)
            if window.data is None:
                self._drop(window)
                self._streams.pop(window.key, None)
                return
            if window not in self._windows.get(window.key, ()):
                return  # forgotten while in flight: its readers have their bytes
            self._finished[window] = len(window.data)
            self._bytes += len(window.data)
            while self._bytes > self.capacity and self._finished:
                self._drop(next(iter(self._finished)))

    def _drop(self, window: Window) -> None:
        self._pending.pop(window, None)
        n = self._finished.pop(window, None)
        if n is not None:
            self._bytes -= n
        windows = self._windows.get(window.key)
        if windows is not None and window in windows:
            windows.remove(window)
            if not windows:
                del self._windows[window.key]
