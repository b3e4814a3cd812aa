"""``zarrlake serve``: any version of a repository over HTTP, read-only — as a plain Zarr v3 store
(``/zarr/<ref>/<key>``), as JSON (``/api/v1/``) and as web pages (``/``).

>>> from zarrlake.serve import app
>>> asgi = app(repo, token=None)  # doctest: +SKIP
>>> uvicorn.run(asgi, host="127.0.0.1", port=8700)  # doctest: +SKIP

Needs the ``serve`` extra (``pip install 'zarrlake[serve]'``: Starlette, uvicorn, Jinja2).
Modules: :mod:`~zarrlake.serve.zarrhttp` (the Zarr store), :mod:`~zarrlake.serve.api` (JSON),
:mod:`~zarrlake.serve.pages` (web pages), :mod:`~zarrlake.serve.model` (what API and pages
show), :mod:`~zarrlake.serve.context` (what routes share), :mod:`~zarrlake.serve.security`
(token, paths), :mod:`~zarrlake.serve.params` (numbers in a query),
:mod:`~zarrlake.serve.errors` (exceptions to statuses),
:mod:`~zarrlake.serve.server` (the application).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zarrlake.extras import require
from zarrlake.serve.context import Limits, ServeContext

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from zarrlake.repository import Repository

__all__ = ["Limits", "ServeContext", "app"]


def app(repo: Repository, *, token: str | None = None, limits: Limits | None = None) -> Starlette:
    """A read-only ASGI application serving ``repo``.

    ``token``: when given, every route but ``/healthz`` and ``/readyz`` needs
    ``Authorization: Bearer <token>`` (see :mod:`zarrlake.serve.security`). ``limits``: see
    :class:`Limits`. Raises :class:`~zarrlake.MissingDependency` without the ``serve`` extra.
    """
    require("starlette", extra="serve", feature="zarrlake.serve")
    from zarrlake.serve.server import build_app

    return build_app(repo, token=token, limits=limits)
