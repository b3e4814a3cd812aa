"""From command-line words to the things a command works on: the storage a URL names, the branch
lock ``--lock`` names, and the repository in that storage.

Commands that move refs take ``--lock URL`` (or ``$ZARRLAKE_LOCK``); the others never touch the
lock service, so a bad or unreachable one cannot fail them. A Redis password comes from
``$ZARRLAKE_LOCK_PASSWORD`` when the URL has none, so that it never has to appear in a command
line (Kubernetes jobs pass it that way), and error messages show lock URLs with the password
replaced by ``***``.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from zarrlake.cli.args import UsageError
from zarrlake.repository import Repository
from zarrlake.storage import Storage, StorageError

if TYPE_CHECKING:
    from zarrlake.locks import LocalLock, RedisLock


def open_repository(args: argparse.Namespace, *, locked: bool = False) -> Repository:
    """The repository at ``args.url``; with ``locked``, using the branch lock of ``args.lock``.

    Raises :class:`UsageError` for a URL no storage understands or a bad lock URL,
    :class:`~zarrlake.RepositoryNotFound` when there is no repository there.
    """
    storage = open_storage(args.url)
    lock = open_lock(args.lock) if locked else None
    return Repository.open(storage, lock=lock)


def open_storage(url: str) -> Storage:
    """The storage ``url`` names (as :meth:`zarrlake.Storage.from_url`); :class:`UsageError`
    when it names none."""
    try:
        return Storage.from_url(url)
    except StorageError as e:
        raise UsageError(str(e)) from None


def open_lock(url: str | None, **options: Any) -> RedisLock | LocalLock | None:
    """The branch lock service at ``url`` (else ``$ZARRLAKE_LOCK``), or None when neither is set;
    ``options`` go to the lock (``wait_s=...``).

    The locks module is imported only here, so that a build without it (or without the Redis
    client) runs every command that takes no lock. Raises :class:`UsageError` when locks are
    not available or the URL is bad; the message never shows a password.
    """
    url = url or os.environ.get("ZARRLAKE_LOCK") or None
    if url is None:
        return None
    password = os.environ.get("ZARRLAKE_LOCK_PASSWORD")
    if password and url.startswith(("redis://", "rediss://")) and "@" not in url:
        from zarrlake.k8s import with_password

        url = with_password(url, password)
    try:
        from zarrlake.locks import lock_from_url
    except ImportError as e:
        detail = "" if e.name == "zarrlake.locks" else f" (cannot import {e.name or e})"
        raise UsageError(f"locks are not available in this build{detail}") from None
    try:
        return lock_from_url(url, **options)
    except ValueError as e:
        safe = redact_password(url)  # the message may quote the URL too
        raise UsageError(f"bad --lock URL {safe!r}: {str(e).replace(url, safe)}") from None


def redact_password(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
