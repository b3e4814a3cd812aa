"""What a request that cannot be answered gets: one status and one line, from one table.

Every route (the Zarr store, the JSON API, the pages) turns an exception into a response through
:func:`http_error`, so that the same mistake reads the same everywhere and nothing a client sends
can produce a traceback or a 500. Messages are built from the facts the error carries (the ref,
the key), never from a storage error's text, which may quote an endpoint or a request signature:
a storage failure is "storage unavailable", and the details go to the server's log only through
:func:`log_line`, which names the error's type and nothing a credential could hide in.
"""

from __future__ import annotations

import logging

from zarrlake.errors import (
    AmbiguousRef,
    CorruptObject,
    InvalidArgument,
    InvalidName,
    NotMirrored,
    ObjectNotFound,
    RefNotFound,
    StorageError,
    TransientStorageError,
    UnsupportedFormat,
    ZarrlakeError,
)

__all__ = ["BadRequest", "HTTPError", "NotFound", "http_error", "log_line"]

log = logging.getLogger("zarrlake.serve")

#: The longest reason a response carries: user input quoted in it (a ref, a path) is cut there.
MAX_REASON = 300


class HTTPError(ZarrlakeError):
    """A request the server answers with ``status`` and the one-line ``reason``."""

    status = 400

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        if status is not None:
            self.status = status
        #: Headers the response carries besides (``Content-Range`` of a 416, say).
        self.headers: dict[str, str] = {}


class BadRequest(HTTPError):
    """Input that can never name anything: a path with ``..``, a bad range, a bad cursor (400)."""

    status = 400


class NotFound(HTTPError):
    """A well-formed request for something this version does not hold: a key, a node (404)."""

    status = 404


def http_error(error: BaseException) -> tuple[int, str]:
    """(HTTP status, one-line reason) for ``error``, raised while answering a request.

    Errors of the request (bad input, unknown refs) are 4xx and say what was wrong; failures of
    the storage are 502/503 and say only that; anything else is a 500 whose reason names no
    detail (the server logs its type, see :func:`log_line`).
    """
    status, reason = _classify(error)
    return status, one_line(reason)


def _classify(error: BaseException) -> tuple[int, str]:
    if isinstance(error, HTTPError):
        return error.status, str(error)
    if isinstance(error, AmbiguousRef):
        # A 404 would tell a client to give up; the fix is a longer id.
        return 400, str(error)
    if isinstance(error, NotMirrored):
        return 404, f"snapshot {error.ref!r} is not mirrored here"
    if isinstance(error, RefNotFound):
        # The hint of an unlistable storage names no secret, but is about the server, not the
        # request: the client learns only that the ref is unknown.
        return 404, f"{error.kind} not found: {error.ref!r}"
    if isinstance(error, InvalidName | InvalidArgument):
        return 400, str(error)
    if isinstance(error, TransientStorageError):
        return 503, "storage unavailable, try again"
    if isinstance(error, ObjectNotFound):
        # An object the version names is gone (expired and collected meanwhile, say).
        return 404, "not found in storage (expired?)"
    if isinstance(error, StorageError):
        return 502, "storage error"
    if isinstance(error, CorruptObject | UnsupportedFormat):
        return 500, "the repository holds an object this server cannot read"
    return 500, "internal error"


def one_line(text: str) -> str:
    """``text`` on one line, control characters dropped, at most :data:`MAX_REASON` long."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    if len(flat) > MAX_REASON:
        flat = flat[: MAX_REASON - 3] + "..."
    return flat or "error"


def log_line(error: BaseException, where: str) -> None:
    """Log an unexpected error of the request ``where`` (method and path): the error's type only.

    The text of a storage client's exception may quote an endpoint URL with a key in it or a
    signed request; the type is enough to start looking, and ``ZARRLAKE_DEBUG`` servers run
    under a debugger for more.
    """
    log.error("%s failed: %s", one_line(where), type(error).__qualname__)
