"""The test kit's loopback HTTP server: a client hanging up is quiet, a handler's bug is not."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest

from zarrlake_testkit.loopback_http import LoopbackHTTPServer


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/hangup":
            raise BrokenPipeError("the client went away")
        raise ValueError("a bug in the handler")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_client_hanging_up_is_not_printed_and_a_handler_bug_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = LoopbackHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for path in ("/hangup", "/bug"):
            url = f"http://127.0.0.1:{server.server_address[1]}{path}"
            with pytest.raises((urllib.error.URLError, ConnectionError)):
                urllib.request.urlopen(url, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    err = capsys.readouterr().err
    assert "ValueError: a bug in the handler" in err
    assert "BrokenPipeError" not in err and err.count("Exception occurred") == 1
