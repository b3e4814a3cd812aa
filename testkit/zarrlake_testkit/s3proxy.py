"""An S3 server that ignores conditional writes, made of a real one: a loopback HTTP proxy that
forwards every request to an S3 API server (moto) without its ``If-None-Match`` and ``If-Match``
headers.

Some S3-compatible servers ignore those headers; a create-only write there silently replaces
the object, and two commits racing for one journal entry would both "win". The engine must find
that out before it writes (``Storage.check_conditional_writes``): the tests point a storage at
this proxy to see it refuse. Real HTTP end to end; the storage code and botocore run unmodified.

The proxy changes what the client signed, so the server behind it must not check signatures
(moto does not; SeaweedFS does). With ``drop=()`` it changes nothing and only counts: every
request it forwards is recorded (:meth:`HeaderStrippingProxy.requests`), so a test can count
what another process (the operator) asks of S3.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from zarrlake_testkit.loopback_http import LoopbackHTTPServer

__all__ = ["HeaderStrippingProxy"]

#: Headers that describe one connection, not the message: never forwarded as they came.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class HeaderStrippingProxy:
    """Forward HTTP requests from ``endpoint`` (127.0.0.1, a free port) to ``upstream``, dropping
    the request headers named in ``drop`` (case-insensitive). :attr:`stripped` counts the
    requests that lost one. A context manager: the server thread stops on exit.
    """

    def __init__(self, upstream: str, drop: Iterable[str] = ("If-None-Match", "If-Match")) -> None:
        target = urlsplit(upstream)
        if target.scheme != "http" or not target.hostname:
            raise ValueError(f"an http:// upstream is needed, not {upstream!r}")
        self.upstream = (target.hostname, target.port or 80)
        self.drop = {h.lower() for h in drop}
        self.stripped = 0
        #: The most requests the proxy had in flight at once (received, not yet answered).
        self.most_in_flight = 0
        self._in_flight = 0
        self._forwarded: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = LoopbackHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-header-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The proxy's URL, to use as an S3 ``endpoint_url``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> HeaderStrippingProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def count_stripped(self) -> None:
        """One more request lost a header (called by the request handlers)."""
        with self._lock:
            self.stripped += 1

    def record(self, method: str, path: str) -> None:
        """One more request forwarded (called by the request handlers)."""
        with self._lock:
            self._forwarded.append((method, path))

    def started(self) -> None:
        """One more request in flight (called by the request handlers)."""
        with self._lock:
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)

    def finished(self) -> None:
        """One request fewer in flight (called by the request handlers)."""
        with self._lock:
            self._in_flight -= 1

    def requests(self, *, clear: bool = False) -> list[tuple[str, str]]:
        """(method, path with query) of every request forwarded (since the last ``clear``)."""
        with self._lock:
            out = list(self._forwarded)
            if clear:
                self._forwarded.clear()
        return out


def _handler_for(proxy: HeaderStrippingProxy) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
        upstream: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the tests' output is for the tests

        def _forward(self) -> None:
            proxy.started()
            self.answered = False
            try:
                self._forward_one()
            finally:
                if not self.answered:
                    proxy.finished()

        def _answer(self) -> None:
            """Count the request answered before its answer leaves: the client may send its
            next request the moment the answer arrives, and must not find this one still
            counted in flight (a thread descheduled between the write and the count)."""
            if not self.answered:
                self.answered = True
                proxy.finished()

        def _forward_one(self) -> None:
            body = self._read_body()
            proxy.record(self.command, self.path)
            headers = [(n, v) for n, v in self.headers.items() if n.lower() not in proxy.drop]
            if len(headers) < len(self.headers):
                proxy.count_stripped()
            try:
                response, data = self._exchange(headers, body)
            except (http.client.RemoteDisconnected, ConnectionError):
                # The kept-alive upstream connection was closed meanwhile: once more, afresh.
                if self.upstream is not None:
                    self.upstream.close()
                self.upstream = None
                response, data = self._exchange(headers, body)
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    self.send_header(name, value)
            # A HEAD answer carries the length of the body it leaves out.
            length = response.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self._answer()
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _exchange(
            self, headers: list[tuple[str, str]], body: bytes
        ) -> tuple[http.client.HTTPResponse, bytes]:
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            conn = self.upstream
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            return response, response.read()

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts: list[bytes] = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def finish(self) -> None:
            super().finish()
            if self.upstream is not None:
                self.upstream.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Forward
