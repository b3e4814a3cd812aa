"""What the backends that run on obstore (Rust ``object_store``) share: turning its errors into
zarrlake's storage errors, and knowing whether its I/O runtime may be used in this process.

obstore's runtime does not survive ``fork``: its pooled connections are the parent's sockets and
its worker threads are gone, so a forked child's requests would hang. :func:`runtime_pid` says
which process started it; a backend refuses (Azure) or takes another path (S3) in any other.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from zarrlake.storage.base import (
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from obstore import PutMode

T = TypeVar("T")

_STATUS = re.compile(r"status code: (\d{3})")
_SERVICE_ERROR = re.compile(r"<Code>([^<]*)</Code>\s*<Message>([^<\n]*)")
#: The process whose obstore runtime is live (it started when that process first built a store).
_runtime: list[int] = []


def runtime_pid() -> int | None:
    """The process that started obstore's runtime, if one did."""
    return _runtime[0] if _runtime else None


def runtime_started() -> None:
    """Record that this process uses obstore's runtime (call when building a store)."""
    _runtime[:] = [os.getpid()]


def swap_mode(version: str | None) -> PutMode:
    """obstore's put mode for a compare-and-set from ``version`` (an ETag): ``If-Match`` on it,
    or create-only (``If-None-Match: *``) for None."""
    if version is None:
        return "create"
    return {"e_tag": version}


def version_of(e_tag: str | None, what: str, key: str) -> str:
    """The version a compare-and-set compares: the ETag a response carried. A server that sends
    none offers nothing to compare, which is an error, not an empty version."""
    if not e_tag:
        raise StorageError(f"{what} {key}: the server's answer carries no ETag to compare")
    return e_tag


def status_of(message: str) -> int | None:
    """The HTTP status an obstore error reports on its first line, if any."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    found = _STATUS.search(first)
    return int(found.group(1)) if found else None


def transient(message: str) -> bool:
    """Whether an obstore error that survived its own retries is still worth retrying later:
    a 5xx or 429 answer, or no answer at all (a connection refused, reset or timed out)."""
    code = status_of(message)
    if code is not None:
        return code >= 500 or code in (408, 429)
    first = message.strip().splitlines()[0].lower() if message.strip() else ""
    signs = ("sending request", "connect", "timed out", "timeout", "body error", "incomplete")
    return any(sign in first for sign in signs)


def first_line(e: BaseException) -> str:
    """The first line of an error, and the service's own error code and message when the
    response body carries them (they come after the first line, in XML)."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    first = text.splitlines()[0]
    found = _SERVICE_ERROR.search(text)
    return f"{first} {found.group(1)}: {found.group(2).strip()}" if found else first


def call(what: str, key: str, fn: Callable[[], T], *, past_end: T | None = None) -> T:
    """Run an obstore call, turning its errors into zarrlake's storage errors. A 409 (S3's
    answer to a conditional write racing another on the same key) is a precondition failure.
    For a ranged read, ``past_end`` is the answer to a range that starts at or past the object's
    end (the server's 416), as every backend answers such a read: nothing."""
    try:
        return fn()
    except Exception as e:
        if past_end is not None and _past_the_end(e):
            return past_end
        _raise_translated(what, key, e)
        raise


async def call_async(
    what: str, key: str, fn: Callable[[], Awaitable[T]], *, past_end: T | None = None
) -> T:
    """:func:`call` for obstore's coroutines (``get_range_async``, ``put_async`` and the like)."""
    try:
        return await fn()
    except Exception as e:
        if past_end is not None and _past_the_end(e):
            return past_end
        _raise_translated(what, key, e)
        raise


def _past_the_end(e: Exception) -> bool:
    """Whether ``e`` is obstore's error for a range that starts at or past the object's end."""
    from obstore.exceptions import BaseError

    return isinstance(e, BaseError) and status_of(str(e)) == 416


def _raise_translated(what: str, key: str, e: Exception) -> None:
    """Raise the storage error that the obstore error ``e`` means; return for any other."""
    from obstore.exceptions import (
        AlreadyExistsError,
        BaseError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )

    if isinstance(e, FileNotFoundError):
        raise ObjectNotFound(key) from None
    if isinstance(e, AlreadyExistsError | PreconditionError):
        raise PreconditionFailed(key) from None
    if isinstance(e, PermissionDeniedError | UnauthenticatedError):
        raise StorageError(f"{what} {key}: access denied: {first_line(e)}") from None
    if isinstance(e, BaseError):
        if status_of(str(e)) in (409, 412):
            raise PreconditionFailed(key) from None
        if transient(str(e)):
            raise TransientStorageError(f"{what} {key}: {first_line(e)}") from e
        raise StorageError(f"{what} {key}: {first_line(e)}") from e
