"""``zarrlake serve URL [--host] [--port] [--token-file F]``: runs the server until SIGTERM, prints
the URL it serves and nothing secret; bad input is the CLI's one-line error; without the
``serve`` extra, a one-line error naming it (and ``zarrlake.serve.app`` a MissingDependency).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import assert_one_line_error

Lake = Any  # the fixture's type (conftest.py)


def read_line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    """The first line ``proc`` writes on stdout, waiting at most ``timeout`` seconds."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("zarrlake serve printed nothing")
    return proc.stdout.readline()


def fetch(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_serve_prints_its_url_serves_and_stops_on_sigterm(
    s3_lake: Lake, s3_keys: tuple[str, str], tmp_path: Path
) -> None:
    token = "cli-token-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    url = s3_lake.repo.storage.url
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZARRLAKE_")}
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = s3_keys
    argv = ["serve", url, "--port", "0", "--token-file", str(token_file)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "zarrlake", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = read_line(proc)
        prefix = f"serving repository {s3_lake.repo.id} at http://127.0.0.1:"
        assert line.startswith(prefix) and line.endswith("/ (token required)\n"), line
        base = line.split(" at ")[1].split()[0].rstrip("/")
        assert fetch(base + "/healthz") == (200, b'{"status": "ok"}')
        assert fetch(base + "/readyz")[0] == 200
        assert fetch(base + "/zarr/v1/zarr.json")[0] == 401
        status, body = fetch(base + "/zarr/v1/zarr.json", token)
        assert status == 200 and json.loads(body)["attributes"] == s3_lake.attributes[""]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    printed = line + out + err
    for secret in (*s3_keys, token):
        assert secret not in printed


@pytest.fixture
def busy_port() -> Any:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def test_bad_input_is_a_one_line_error(
    cli: Any, lake: Lake, tmp_path: Path, busy_port: int
) -> None:
    path = lake.repo.storage.url
    cases: list[tuple[list[str], int, str]] = [
        (["--token-file", str(tmp_path / "missing")], 2, "no such file"),
        (["--token-file", str(tmp_path)], 2, "cannot read it"),
        (["--port", str(busy_port)], 2, f"127.0.0.1:{busy_port}: the port is in use"),
        (["--port", "70000"], 2, "port number"),
        (["--port", "http"], 2, "port number"),
        (["--host", "no.such.host.invalid"], 2, "--host"),
        (["--max-connections", "0"], 2, "number of connections"),
    ]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    cases += [
        (["--token-file", str(empty)], 2, "empty"),
        (["--token-file", str(spaced)], 2, "one word"),
    ]
    for extra, code, message in cases:
        found = assert_one_line_error(cli("serve", path, *extra), code)
        assert message in found, (extra, found)
    found = assert_one_line_error(cli("serve", str(tmp_path / "no-repo")), 1)
    assert "repository" in found.lower()


# Runs first in the child: the modules named in sys.argv[1] are "not installed".
WITHOUT = textwrap.dedent(
    """
    import sys

    class NotInstalled:
        def __init__(self, blocked):
            self.blocked = blocked

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NotInstalled(set(sys.argv.pop(1).split(","))))
    """
)


def run_without(blocked: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZARRLAKE_")}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT + code, blocked, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_without_the_serve_extra_the_error_names_it(lake: Lake) -> None:
    path = lake.repo.storage.url
    api = textwrap.dedent(
        """
        import zarrlake
        from zarrlake.serve import app
        repo = zarrlake.Repository.open(zarrlake.Storage.from_url(sys.argv[1]))
        try:
            app(repo)
        except zarrlake.MissingDependency as e:
            print(e.module, e.extra)
        """
    )
    got = run_without("starlette", api, path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["starlette", "serve"]

    cli = "from zarrlake.cli import main; raise SystemExit(main(sys.argv[1:]))"
    for blocked in ("uvicorn", "starlette"):
        got = run_without(blocked, cli, "serve", path, "--port", "0")
        assert got.returncode == 2, got.stderr
        assert got.stdout == ""
        assert got.stderr.count("\n") == 1
        assert got.stderr.startswith("zarrlake: error: ")
        assert f"needs {blocked}" in got.stderr
        assert got.stderr.rstrip().endswith("pip install 'zarrlake[serve]'")


def test_serve_is_listed_in_the_help(cli: Any) -> None:
    r = cli("serve", "--help")
    assert r.code == 0
    for option in ("--host", "--port", "--token-file"):
        assert option in r.out


def test_past_max_connections_a_request_is_answered_503(lake: Lake) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "zarrlake", "serve", lake.repo.storage.url, "--port", "0",
         "--max-connections", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = read_line(proc).split(" at ")[1].split()[0].rstrip("/")
        host, port = base.removeprefix("http://").split(":")
        held = socket.create_connection((host, int(port)), timeout=30)
        try:  # one connection, kept open after its answer (HTTP/1.1 keeps it alive)
            held.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.recv(4096).startswith(b"HTTP/1.1 200")
            assert fetch(base + "/healthz")[0] == 503  # a second one, at once
        finally:
            held.close()
        wait = 0
        while fetch(base + "/healthz")[0] != 200:  # the server notices the close
            wait += 1
            assert wait < 100
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
