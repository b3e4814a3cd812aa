"""A watch stream's failures, as an API server can produce them mid-stream.

The emulated API ends watches cleanly; a real API server (or the network in between) can also send
an ``ERROR`` event after some events (410 Gone: the resourceVersion fell out of its window), a line
that is not JSON, or cut the connection mid-event, or go silent without closing it. Each must end
the operator's iteration with a :class:`KubeError` that says which (the Lease's standby re-reads
the Lease on 410 and backs off on the others), never a hang or a crash of the watching thread.

The server here is a real HTTP server on loopback that answers the watch request with a scripted
chunked body: the operator's own client (``kube.watch``, the Kubernetes client over urllib3)
reads it as it would an API server's.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from zarrlake_operator import kube
from zarrlake_testkit.kubeapi import write_kubeconfig
from zarrlake_testkit.loopback_http import LoopbackHTTPServer

PATH = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


def event(kind: str, name: str = "op", rv: str = "7") -> bytes:
    obj = {"kind": "Lease", "metadata": {"name": name, "resourceVersion": rv}}
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


GONE = (
    json.dumps(
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "status": "Failure",
                "reason": "Expired",
                "message": "too old resource version: 5 (90)",
                "code": 410,
            },
        }
    ).encode()
    + b"\n"
)


class Script:
    """What the server does with the next watch: ``("send", bytes)`` writes one HTTP chunk,
    ``("wait", seconds)``, ``("reset",)`` cuts the connection (TCP reset, no last chunk),
    ``("hang",)`` sends nothing more until the test ends; after the last step the body ends
    properly (the server's ``timeoutSeconds``)."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, ...]] = []
        self.release = threading.Event()
        self.queries: list[str] = []


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            script.queries.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for step in script.steps:
                if step[0] == "send":
                    data = step[1]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                elif step[0] == "wait":
                    time.sleep(step[1])
                elif step[0] == "reset":
                    # SO_LINGER 0: close sends a reset, as a dropped connection does.
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.wfile.close()  # the file objects hold the socket open too
                    self.rfile.close()
                    self.connection.close()
                    # http.server flushes the response file once this method returns: give it
                    # one with nowhere to go, and no next request to read.
                    self.wfile = io.BytesIO()
                    self.close_connection = True
                    return
                elif step[0] == "hang":
                    script.release.wait(30)
                    return
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Script]:
    script = Script()
    httpd = LoopbackHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        kube.use_kubeconfig(str(write_kubeconfig(url, tmp_path / "kubeconfig")))
        yield script
    finally:
        script.release.set()
        httpd.shutdown()
        httpd.server_close()
        # The kube client is process-wide: give it back to the shared operator tests' cluster.
        if os.environ.get("KUBECONFIG"):
            kube.use_kubeconfig(os.environ["KUBECONFIG"])


def watch(read_timeout: float | None = None) -> kube.WatchStream:
    return kube.watch(
        PATH,
        {"fieldSelector": "metadata.name=op", "resourceVersion": "5"},
        timeout_seconds=60,
        read_timeout=read_timeout,
    )


def test_events_split_across_chunks_and_a_clean_end(server: Script) -> None:
    first, second = event("ADDED", rv="6"), event("MODIFIED", rv="7")
    server.steps = [
        ("send", first[:10]),
        ("send", first[10:] + second[:3]),
        ("send", second[3:]),
        ("send", b"\n\n"),  # blank lines (keep-alives) are not events
    ]
    got = list(watch())
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in got] == [
        ("ADDED", "6"),
        ("MODIFIED", "7"),
    ]
    assert "watch=true" in server.queries[0] and "resourceVersion=5" in server.queries[0]


def test_a_410_inside_the_stream_is_a_kube_error_with_its_code(server: Script) -> None:
    server.steps = [("send", event("MODIFIED")), ("send", GONE)]
    stream = watch()
    seen = []
    with pytest.raises(kube.KubeError, match="410 too old resource version") as e:
        for ev in stream:
            seen.append(ev["type"])
    assert e.value.status == 410
    assert seen == ["MODIFIED"]  # what came before the error is delivered
    assert stream.closed


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"<html>502 Bad Gateway</html>\n", "not JSON"),
        (b'{"type": "ADDED", "object": "a string"}\n', "malformed watch event"),
        (b"[1, 2]\n", "malformed watch event"),
    ],
)
def test_a_line_that_is_not_an_event_ends_the_watch_with_a_kube_error(
    server: Script, line: bytes, says: str
) -> None:
    server.steps = [("send", event("ADDED")), ("send", line), ("send", event("MODIFIED"))]
    seen = []
    with pytest.raises(kube.KubeError, match=says) as e:
        for ev in watch():
            seen.append(ev["type"])
    assert seen == ["ADDED"]
    assert e.value.status == 0


def test_a_connection_cut_mid_event_is_a_broken_watch(server: Script) -> None:
    half = event("MODIFIED")
    server.steps = [("send", event("ADDED")), ("send", half[:15]), ("wait", 0.1), ("reset",)]
    seen = []
    started = time.monotonic()
    with pytest.raises(kube.KubeError, match="the watch broke") as e:
        for ev in watch(read_timeout=30):
            seen.append(ev["type"])
    assert seen == ["ADDED"]  # the half event is not delivered
    assert e.value.status == 0
    assert time.monotonic() - started < 10  # noticed at the reset, not at the read timeout


def test_a_silent_connection_ends_at_the_read_timeout(server: Script) -> None:
    """An API server that stops sending without closing (a dead peer behind a proxy): the read
    gives up after ``read_timeout``, it does not wait for the server's ``timeoutSeconds``."""
    server.steps = [("send", event("ADDED")), ("hang",)]
    started = time.monotonic()
    seen = []
    with pytest.raises(kube.KubeError, match="the watch broke") as e:
        for ev in watch(read_timeout=1.0):
            seen.append(ev["type"])
    took = time.monotonic() - started
    assert seen == ["ADDED"] and e.value.status == 0
    assert 0.9 <= took < 10, took


def test_close_from_another_thread_ends_a_waiting_read_quietly(server: Script) -> None:
    server.steps = [("send", event("ADDED")), ("hang",)]
    stream = watch()
    seen: list[str] = []
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            for ev in stream:
                seen.append(ev["type"])
            outcome.append(None)
        except BaseException as e:  # the test reports whatever it was
            outcome.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["ADDED"]
    stream.close()
    reader.join(10)
    assert not reader.is_alive(), "close() did not end the waiting read"
    assert outcome == [None]  # closing is not an error
