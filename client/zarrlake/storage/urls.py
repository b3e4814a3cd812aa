"""Turning storage URLs into backends."""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlparse

from zarrlake.storage.base import Storage, StorageError

_TRUE = {"1", "true", "yes", "on"}


def storage_from_url(url: str) -> Storage:
    """``file:///p`` or a plain path, ``memory://``, ``s3://bucket/prefix?endpoint_url=...&region=...``.

    Raises :class:`StorageError` for schemes it does not know.
    """
    from zarrlake.storage.local import LocalStorage
    from zarrlake.storage.memory import MemoryStorage

    if "://" not in url:
        return LocalStorage(url)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        return LocalStorage(unquote(parsed.netloc + parsed.path))
    if scheme == "memory":
        return MemoryStorage()
    if scheme in ("s3", "s3a"):
        from zarrlake.storage.s3 import S3Storage

        if not parsed.netloc:
            raise StorageError(f"s3 URL needs a bucket: {url!r}")
        q = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        endpoint = q.get("endpoint_url") or q.get("endpoint")
        allow_http = q.get("allow_http", "").lower() in _TRUE or bool(
            endpoint and endpoint.startswith("http://")
        )
        return S3Storage(
            parsed.netloc,
            unquote(parsed.path.lstrip("/")),
            endpoint_url=endpoint,
            region=q.get("region"),
            allow_http=allow_http,
        )
    raise StorageError(f"unsupported storage URL scheme {scheme!r} in {url!r}")
