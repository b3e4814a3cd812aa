"""The ASGI application: the Zarr routes, the JSON API, the pages and the probes, behind the
token guard.

Starlette, served by uvicorn: an ASGI server runs every request on one event loop, where the
session's Zarr store reads chunks asynchronously already (its reads of one turn of the loop are
batched and coalesced), and blocking repository work goes to the bounded pool of
:class:`~zarrlake.serve.context.ServeContext`. Starlette adds routing and responses and little
else; the pages render with Jinja2 on the same routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import zarrlake.serve.pages as pages
from zarrlake.repository import Repository
from zarrlake.serve.api import JsonApi, json_response
from zarrlake.serve.context import Limits, ServeContext
from zarrlake.serve.errors import http_error, log_line
from zarrlake.serve.security import TokenGuard
from zarrlake.serve.zarrhttp import ZarrStore

__all__ = ["build_app"]


def build_app(
    repo: Repository, *, token: str | None = None, limits: Limits | None = None
) -> Starlette:
    """The read-only ASGI application over ``repo`` (see :func:`zarrlake.serve.app`); its
    ``state.ctx`` is the :class:`ServeContext` its routes share."""
    ctx = ServeContext(repo, token=token, limits=limits)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            ctx.close()

    async def healthz(request: Request) -> Response:
        """Liveness: the process answers. No I/O, nothing about the repository."""
        return json_response({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """Readiness: the refs can be read (one read of the storage). Says nothing of them."""
        try:
            await ctx.run(repo.refs)
        except Exception as e:
            status, reason = http_error(e)
            log_line(e, "GET /readyz")
            return json_response({"error": reason}, 503 if status >= 500 else status)
        return json_response({"status": "ready"})

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *ZarrStore(ctx).routes(),
        *JsonApi(ctx).routes(),
        *pages.routes(ctx),
    ]
    asgi = Starlette(
        routes=routes,
        middleware=[Middleware(TokenGuard, token=ctx.token)],
        lifespan=lifespan,
    )
    asgi.state.ctx = ctx
    return asgi
