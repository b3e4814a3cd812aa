"""A static web server for tests: a directory served over HTTP/1.1 on a loopback port.

What a CDN or any static host offers a published repository: GET, HEAD and byte ranges
(``Range: bytes=a-b``, answered 206, or 416 past the end), nothing else — no listing, no writes.
Python's :mod:`http.server` underneath, in a thread of the test process, with a listen backlog
large enough for a client's concurrent requests (the default of 5 makes bursts wait on SYN
retransmits). ``ranges=False`` serves whole objects only, as servers that ignore ``Range`` do;
``listings=True`` shows a folder's index page (after redirecting ``dir`` to ``dir/``), as
``python -m http.server`` and nginx's autoindex do. ``authorization`` makes every request without
exactly that ``Authorization`` header a 401, as a private bucket's gateway would. ``etags=True``
sends a strong ``ETag`` of each file (its modification time and size, as nginx makes them) and
answers a request whose ``If-Match`` names another with 412, as nginx does; without, no ETags
(Python's own server sends none).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from zarrlake_testkit.loopback_http import LoopbackHTTPServer

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StaticHTTPServer._Server
    _etag: str | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def list_directory(self, path: str | os.PathLike[str]) -> Any:
        if self.server.listings:  # an index page, as python -m http.server or nginx show
            return super().list_directory(path)
        self.send_error(404, "no listings here")  # a CDN shows objects, never folders
        return None

    def _count(self) -> None:
        self._etag = None  # a connection's handler serves many requests: none carries over
        with self.server.lock:
            self.server.requests[self.command] += 1

    def _refused(self) -> bool:
        """401 unless the request carries the Authorization the server requires (if any)."""
        wanted = self.server.authorization
        if wanted is None or self.headers.get("Authorization") == wanted:
            return False
        self.send_error(401, "authorization required")
        return True

    def _etag_refused(self) -> bool:
        """With ETags on: remember this file's ETag for the answer's headers, and answer 412
        if the request's ``If-Match`` names another."""
        path = self.translate_path(self.path)
        if not (self.server.etags and os.path.isfile(path)):
            return False
        st = os.stat(path)
        self._etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted.strip() not in ("*", self._etag):
            self._etag = None
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        return False

    def end_headers(self) -> None:
        if getattr(self, "_etag", None):
            self.send_header("ETag", self._etag)
        super().end_headers()

    def do_HEAD(self) -> None:
        self._count()
        if not self._refused() and not self._etag_refused():
            super().do_HEAD()

    def do_PUT(self) -> None:
        self._count()
        self.send_error(405, "read-only")

    def do_GET(self) -> None:
        self._count()
        if self._refused() or self._etag_refused():
            return
        wanted = self.headers.get("Range")
        path = self.translate_path(self.path)
        match = _RANGE.match(wanted or "")
        if not (self.server.ranges and match and os.path.isfile(path)):
            super().do_GET()
            return
        data = Path(path).read_bytes()
        start = int(match.group(1))
        end = min(int(match.group(2)) + 1 if match.group(2) else len(data), len(data))
        if start >= len(data):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Last-Modified", self.date_time_string(int(os.stat(path).st_mtime)))
        self.end_headers()
        self.wfile.write(data[start:end])


class StaticHTTPServer:
    """Serve ``directory`` on ``http://127.0.0.1:<port>`` until :meth:`close` (or the ``with``
    block ends). :attr:`requests` counts requests by method."""

    class _Server(LoopbackHTTPServer):
        request_queue_size = 128
        ranges: bool
        listings: bool
        etags: bool
        authorization: str | None
        requests: Counter[str]
        lock: threading.Lock

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ranges: bool = True,
        listings: bool = False,
        authorization: str | None = None,
        etags: bool = False,
    ) -> None:
        handler = functools.partial(_Handler, directory=str(directory))
        self._server = self._Server(("127.0.0.1", 0), handler)
        self._server.ranges = ranges
        self._server.listings = listings
        self._server.authorization = authorization
        self._server.etags = etags
        self._server.requests = Counter()
        self._server.lock = threading.Lock()
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self) -> Counter[str]:
        return self._server.requests

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> StaticHTTPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
