"""The two gates every request passes: the token, and the reading of its path.

**Token.** When the server has one, every route but ``/healthz`` and ``/readyz`` (which reveal
nothing: no ref, no count) needs ``Authorization: Bearer <token>``, compared in constant time
(:func:`hmac.compare_digest`). A browser cannot send that header from a link, so a page URL may
carry ``?token=<token>`` once: the answer is a redirect to the same URL without it, setting a
cookie that later requests carry: ``HttpOnly``, and ``SameSite=Lax``, since a link followed from
a chat or a mail is a cross-site navigation, which a ``Strict`` cookie is not sent with (every
route is a read: there is no request to forge). The cookie holds a keyed digest of the token,
not the token: a cookie that leaks (a shared profile, a proxy's log) does not give the bearer
token away. Behind a token, answers that never change are ``Cache-Control: private``: a shared
cache would hand a ``public`` one to whoever asks, token or not. Zarr and API clients send the
header (``fsspec``: ``storage_options={"headers": {"Authorization": "Bearer ..."}}``).

**Paths.** URLs are read from the raw request path, one ``/``-separated segment at a time, each
percent-decoded on its own: a ``%2F`` inside a segment is then told apart from a ``/`` between
segments, so a branch named ``release/v1`` is written ``release%2Fv1`` where a ref is one
segment, while in a Zarr key, whose segments are never meant to hold a slash, an encoded one
is refused with ``..``, ``.``, empty segments, control characters and backslashes: what a path
traversal or a confused proxy would send.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, unquote, urlencode

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Match, NoMatchFound, request_response

from zarrlake.serve.errors import BadRequest

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from starlette.datastructures import URLPath
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = [
    "OPEN_PATHS",
    "PrefixRoute",
    "TokenGuard",
    "UrlPath",
    "path_below",
    "ref_segments",
    "split_path",
    "whole_ref",
]

#: Routes that answer without the token (Kubernetes probes).
OPEN_PATHS = frozenset({"/healthz", "/readyz"})

COOKIE = "zarrlake_token"


@dataclass(frozen=True)
class UrlPath:
    """A request path below a route's prefix, decoded: its ``segments`` and whether it ended
    with a ``/`` (a directory, for the Zarr routes)."""

    segments: tuple[str, ...]
    directory: bool


def split_path(raw: str, *, max_length: int, slash_in_first: bool = False) -> UrlPath:
    """The segments of ``raw`` (a raw, still percent-encoded path below a route's prefix).

    ``slash_in_first``: the first segment is a ref, which may hold an encoded ``/``. Raises
    :class:`BadRequest` for a path longer than ``max_length``, a segment that is empty (``//``,
    a leading ``/``), ``.`` or ``..``, one that holds an encoded ``/`` (``%2F``) where that is not
    allowed, a backslash, a control character (NUL included) or bytes that are not UTF-8.
    """
    if len(raw) > max_length:
        raise BadRequest(f"path too long ({len(raw)} characters; at most {max_length})")
    if raw in ("", "/"):
        return UrlPath((), True)
    directory = raw.endswith("/")
    parts = raw[:-1].split("/") if directory else raw.split("/")
    segments = []
    for i, part in enumerate(parts):
        try:
            segment = unquote(part, errors="strict")
        except UnicodeDecodeError:
            raise BadRequest("path is not UTF-8") from None
        if segment in ("", ".", ".."):
            raise BadRequest(f"bad path segment {segment!r} (empty, '.' or '..')")
        if "/" in segment and not (slash_in_first and i == 0):
            raise BadRequest("encoded '/' (%2F) in a path segment")
        if "\\" in segment or not segment.isprintable():
            raise BadRequest("backslash or control character in path")
        segments.append(segment)
    return UrlPath(tuple(segments), directory)


class PrefixRoute(BaseRoute):
    """A route for every ``GET`` and ``HEAD`` whose path starts with ``prefix``, whatever the rest
    holds: Starlette's ``{rest:path}`` patterns stop at a newline, so ``%0A`` would be a bare
    "Not Found" instead of the one-line 400 :func:`split_path` gives. Other methods: 405."""

    METHODS = frozenset({"GET", "HEAD"})

    def __init__(self, prefix: str, endpoint: Callable[[Request], Awaitable[Response]]) -> None:
        self.prefix = prefix
        self.app = request_response(endpoint)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return Match.NONE, {}
        return (Match.FULL if scope["method"] in self.METHODS else Match.PARTIAL), {}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in self.METHODS:
            headers = {"allow": "GET, HEAD"}
            response = PlainTextResponse("Method Not Allowed", 405, headers=headers)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def url_path_for(self, name: str, /, **path_params: object) -> URLPath:
        raise NoMatchFound(name, dict(path_params))


def path_below(scope: Scope, prefix: str) -> str:
    """The raw (still percent-encoded) path of request ``scope`` after ``prefix`` (a route's,
    like ``"/zarr/"``), without the query. Raises :class:`BadRequest` if it is not UTF-8."""
    raw_bytes = scope.get("raw_path") or quote(scope["path"]).encode()
    try:
        raw = raw_bytes.decode("utf-8").partition("?")[0]
    except UnicodeDecodeError:
        raise BadRequest("path is not UTF-8") from None
    root = scope.get("root_path", "")
    if root and raw.startswith(root):
        raw = raw[len(root) :]
    if not raw.startswith(prefix):
        raise BadRequest("unexpected path")
    return raw[len(prefix) :]


def ref_segments(scope: Scope, prefix: str, *, max_length: int) -> tuple[str, ...]:
    """The segments of the path of request ``scope`` below ``prefix``, the first a ref (which
    may hold an encoded ``/``): :func:`split_path` of :func:`path_below`, which raise."""
    rest = path_below(scope, prefix)
    return split_path(rest, max_length=max_length, slash_in_first=True).segments


def whole_ref(scope: Scope, prefix: str, *, max_length: int, usage: str) -> str:
    """The ref that makes up the rest of the path below ``prefix`` (a ``/`` in it plain or as
    ``%2F``). Raises :class:`BadRequest`: "give ``usage``" for an empty one, or as
    :func:`split_path` does."""
    segments = ref_segments(scope, prefix, max_length=max_length)
    if not segments:
        raise BadRequest(f"give {usage}")
    return "/".join(segments)


def _cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"zarrlake-serve-cookie", hashlib.sha256).hexdigest()


class TokenGuard:
    """ASGI middleware: answers 401 to any request without the token (see the module docs)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._token = token.encode() if token else None
        self._cookie = _cookie_value(token) if token else ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._token is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._bearer_ok(headers.get(b"authorization", b"")) or self._cookie_ok(
            headers.get(b"cookie", b"")
        ):
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == "token"]
        if given and hmac.compare_digest(given[-1].encode(), self._token):
            await self._set_cookie(scope, [(k, v) for k, v in query if k != "token"], send)
            return
        await _unauthorized(scope, send)

    def _bearer_ok(self, header: bytes) -> bool:
        scheme, _, credentials = header.partition(b" ")
        assert self._token is not None
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self._token)

    def _cookie_ok(self, header: bytes) -> bool:
        if not header:
            return False
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(header.decode("latin-1"))
        except Exception:  # a malformed cookie header is no credential, not an error
            return False
        morsel = jar.get(COOKIE)
        if morsel is None:
            return False
        # As bytes: compare_digest raises TypeError for a str with non-ASCII characters.
        return hmac.compare_digest(morsel.value.encode(), self._cookie.encode())

    async def _set_cookie(self, scope: Scope, query: list[tuple[str, str]], send: Send) -> None:
        raw = scope.get("raw_path") or quote(scope["path"]).encode()
        # One leading "/": "//host/x" or "/\\host/x" would send the browser to another host.
        location = "/" + raw.decode("latin-1").lstrip("/\\")
        if query:
            location += "?" + urlencode(query)
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{COOKIE}={self._cookie}; Path=/; HttpOnly; SameSite=Lax{secure}"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode("latin-1", "replace")),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


async def _unauthorized(scope: Scope, send: Send) -> None:
    body = b'{"error": "a token is needed (Authorization: Bearer <token>)"}\n'
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="zarrlake"'),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
