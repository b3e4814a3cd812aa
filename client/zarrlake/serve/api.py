"""``/api/v1/``: what the pages show, as JSON, for scripts and for pages' own scripts.

=====================================  ==========================================================
``GET /api/v1/refs``                   :func:`zarrlake.serve.model.overview`
``GET /api/v1/log/<ref>``              :func:`~zarrlake.serve.model.log_page`; ``?limit=`` (at
                                       most :attr:`Limits.max_log_limit`), ``?cursor=`` (the
                                       ``next`` of the page before)
``GET /api/v1/commit/<id>``            :func:`~zarrlake.serve.model.commit`
``GET /api/v1/diff/<base>...<head>``   :func:`~zarrlake.serve.model.compare`
``GET /api/v1/tree/<ref>[/<path>]``    :func:`~zarrlake.serve.model.tree`
=====================================  ==========================================================

A ref that ends the URL (log, commit, diff) is written as it is (``log/release/v1``); in
``tree``, where a node path follows, it is one segment, ``/`` written ``%2F``
(``tree/release%2Fv1/temperature``). Errors are ``{"error": "<one line>"}`` with a 4xx (a 5xx
for a storage failure), from :func:`zarrlake.serve.errors.http_error`. Answers are
``Cache-Control: no-cache``: most name a branch, which moves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from zarrlake.listing import json_default
from zarrlake.serve.errors import BadRequest, http_error, log_line
from zarrlake.serve.model import LOG_PAGE, commit, compare, compare_refs, log_page, overview, tree
from zarrlake.serve.params import query_number
from zarrlake.serve.security import PrefixRoute, ref_segments, whole_ref

if TYPE_CHECKING:
    from zarrlake.serve.context import ServeContext

__all__ = ["JsonApi", "json_response"]

PREFIX = "/api/v1/"

Handler = Callable[[Request], Awaitable[Any]]


class JsonApi:
    """The ``/api/v1/`` routes of one server."""

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx

    def routes(self) -> list[BaseRoute]:
        return [
            Route(PREFIX + "refs", self._endpoint(self._refs), methods=["GET"]),
            PrefixRoute(PREFIX + "log/", self._endpoint(self._log)),
            PrefixRoute(PREFIX + "commit/", self._endpoint(self._commit)),
            PrefixRoute(PREFIX + "diff/", self._endpoint(self._diff)),
            PrefixRoute(PREFIX + "tree/", self._endpoint(self._tree)),
        ]

    def _endpoint(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return json_response(await handler(request))
            except Exception as e:
                status, reason = http_error(e)
                if status >= 500:
                    log_line(e, f"{request.method} {request.url.path}")
                return json_response({"error": reason}, status)

        return endpoint

    async def _refs(self, request: Request) -> Any:
        return await self.ctx.run_page(overview, self.ctx.repo)

    async def _log(self, request: Request) -> Any:
        ref = self._whole_ref(request, "log/")
        limit = query_number(request.query_params, "limit", LOG_PAGE)
        limit = min(limit, self.ctx.limits.max_log_limit)
        cursor = request.query_params.get("cursor") or None
        return await self.ctx.run_page(
            log_page, self.ctx.repo, ref, cursor=cursor, limit=limit, walks=self.ctx.walks
        )

    async def _commit(self, request: Request) -> Any:
        ref = self._whole_ref(request, "commit/")
        return await self.ctx.run_page(commit, self.ctx.repo, ref)

    async def _diff(self, request: Request) -> Any:
        base, head = compare_refs(self._whole_ref(request, "diff/"), "diff/")
        return await self.ctx.run_page(compare, self.ctx.repo, base, head)

    async def _tree(self, request: Request) -> Any:
        limit = self.ctx.limits.max_key_length
        segments = ref_segments(request.scope, PREFIX + "tree/", max_length=limit)
        if not segments:
            raise BadRequest("give a ref: tree/<ref>[/<path>]")
        ref, node = segments[0], "/".join(segments[1:])
        return await self.ctx.run_page(tree, self.ctx.repo, ref, node)

    def _whole_ref(self, request: Request, route: str) -> str:
        limit = self.ctx.limits.max_key_length
        usage = f"a ref: {route}<ref>"
        return whole_ref(request.scope, PREFIX + route, max_length=limit, usage=usage)


def json_response(doc: Any, status: int = 200) -> Response:
    """``doc`` as a JSON response. User data (attributes, commit metadata) may hold what JSON
    cannot: NaN and infinities become the strings Zarr v3 writes for them, other values their
    ISO 8601, base64 or string forms."""
    try:
        text = json.dumps(doc, ensure_ascii=False, allow_nan=False, default=json_default)
    except ValueError:
        text = json.dumps(_finite(doc), ensure_ascii=False, default=json_default)
    headers = {"cache-control": "no-cache" if status < 400 else "no-store"}
    return Response(text, status, headers=headers, media_type="application/json")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
