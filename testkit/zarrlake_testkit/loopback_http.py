"""The HTTP server the test kit's servers and the tests' scripted servers run on loopback."""

from __future__ import annotations

import http.server
import sys
from typing import Any


class LoopbackHTTPServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server whose request threads never keep a test process alive, and that
    takes a client hanging up mid-response (a test that had what it needed, or closed a watch
    stream) as the end of that request, not as an error to print. Any other error in a handler
    is printed, as the standard library does."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)
