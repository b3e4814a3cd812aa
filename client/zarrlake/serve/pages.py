"""The web pages of ``zarrlake serve``: server-rendered HTML (Jinja2, autoescaped), one stylesheet,
no script: every page works with JavaScript off, and every link is a plain URL to share.

===========================================  ==================================================
``/``                                        branches (head, last message, age), tags, a
                                             compare form
``/log/<ref>[?cursor=…]``                    the history of a ref, 50 commits a page
``/commit/<id>``                             one commit and its diff against its first parent
``/compare`` (``?base=&head=``)              the compare form (a filled one redirects to…)
``/compare/<base>...<head>``                 what differs between two versions
``/tree/<ref>[/<path>]``                     a group: its children and attributes
``/array/<ref>/<path>[?y=&x=&i<d>=&w<d>=``   an array: metadata, a preview, its selector
``&fill=]``                                  (:class:`~zarrlake.serve.preview.Selection`)
``/preview/<ref>/<path>.png[?…]``            the preview image (:mod:`zarrlake.serve.preview`)
``/static/…``                                the stylesheet and the colour bar
===========================================  ==================================================

Refs are written as in the JSON API: one that ends the URL (log, commit, compare) as it is, a
``/`` in it plain; one followed by a node path (tree, array, preview) as one segment, its ``/``
written ``%2F``. A page of a branch links to the snapshot it showed (the "permalink"), and the
array page's image names the snapshot, not the branch, so the picture is of the version the page
describes and can be cached forever.

The preview is an image map: a click zooms in two times around the spot clicked (a window
``w<d>=start:stop`` on each image dimension), so that an array too large to read whole at once
is looked at region by region, each read whole once it fits the bound; "zoom out" and "whole
slice" go back.

Every error is a page in the same layout with the status and the one line of
:func:`zarrlake.serve.errors.http_error`. The array page renders its preview before it answers
(the colour bar's labels are the preview's minimum and maximum) and keeps the result in a small
cache, so the image request that follows is served from memory; renders take a slot of
:attr:`ServeContext.preview_slots` and run on the worker pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import jinja2
import numpy as np
import zarr
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

import zarrlake.serve.model as model
from zarrlake import __version__
from zarrlake.serve.errors import BadRequest, NotFound, http_error, log_line
from zarrlake.serve.params import query_number
from zarrlake.serve.preview import (
    COLORMAP,
    LEVELS,
    MIN_WINDOW,
    Preview,
    PreviewTooLarge,
    PreviewUnsupported,
    Selection,
    colorbar_png,
    encode_png,
    marks_fill_by_default,
    previewable,
    render,
)
from zarrlake.serve.security import PrefixRoute, ref_segments, whole_ref

if TYPE_CHECKING:
    from zarrlake.refs import Refs
    from zarrlake.serve.context import ServeContext

__all__ = ["PreviewCache", "routes"]

#: How the pages write a shape ("4 x 90 x 180", with the multiplication sign) and an absent value.
TIMES = " \N{MULTIPLICATION SIGN} "
DASH = "\N{EN DASH}"

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
STYLESHEET = "zarrlake.css"

#: Headers of every page: no script, styles and images from this server only, no framing.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}

#: The image map of a preview: a grid of this many cells a side, each zooming in around it.
ZOOM_CELLS = 4

#: Previews kept, at most this many PNG bytes together.
PREVIEW_CACHE_BYTES = 64 * 1024 * 1024

Handler = Callable[[Request], Awaitable[Response]]


def routes(ctx: ServeContext) -> list[BaseRoute]:
    """The pages' routes over ``ctx`` (mounted at the server's root)."""
    return Pages(ctx).routes()


class PreviewCache:
    """Rendered previews by (snapshot id, node path, selection), least recently used dropped
    first, at most ``max_bytes`` of PNG together. Used on the event loop only."""

    def __init__(self, max_bytes: int = PREVIEW_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str, Selection], Preview] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[str, str, Selection]) -> Preview | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: tuple[str, str, Selection], preview: Preview) -> None:
        if len(preview.png) > self.max_bytes or key in self._items:
            return
        self._items[key] = preview
        self._bytes += len(preview.png)
        while self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= len(dropped.png)


# -- links ---------------------------------------------------------------------------------------


def _segments(path: str) -> list[str]:
    return [quote(s, safe="") for s in path.strip("/").split("/") if s]


@dataclass(frozen=True)
class Links:
    """URLs of the pages below ``root`` (the ASGI ``root_path``), every segment quoted."""

    root: str

    def url(self, *segments: str, **query: str) -> str:
        path = "/".join(quote(s, safe="") for s in segments)
        return f"{self.root}/{path}" + (f"?{urlencode(query)}" if query else "")

    def _at(self, route: str, ref: str, path: str, query: Mapping[str, str] | None) -> str:
        parts = [route, quote(ref, safe=""), *_segments(path)]
        return f"{self.root}/" + "/".join(parts) + (f"?{urlencode(query)}" if query else "")

    def tree(self, ref: str, path: str = "/") -> str:
        return self._at("tree", ref, path, None)

    def array(self, ref: str, path: str, query: Mapping[str, str] | None = None) -> str:
        return self._at("array", ref, path, query)

    def preview(self, ref: str, path: str, query: Mapping[str, str] | None = None) -> str:
        parts = _segments(path) or [""]  # the root array: /preview/<ref>/.png
        return self._at("preview", ref, "/".join([*parts[:-1], parts[-1] + ".png"]), query)

    def node(self, ref: str, path: str, kind: str) -> str:
        return self.array(ref, path) if kind == "array" else self.tree(ref, path)

    def log(self, ref: str, cursor: str | None = None) -> str:
        # A ref that ends the URL keeps its '/' (as the JSON API writes it).
        return f"{self.root}/log/{quote(ref, safe='/')}" + (
            f"?{urlencode({'cursor': cursor})}" if cursor else ""
        )

    def commit(self, snapshot_id: str) -> str:
        return f"{self.root}/commit/{quote(snapshot_id, safe='')}"

    def compare(self, base: str, head: str) -> str:
        return f"{self.root}/compare/{quote(base, safe='/')}...{quote(head, safe='/')}"


# -- formatting ----------------------------------------------------------------------------------


def _parse_time(iso: str) -> dt.datetime:
    t = dt.datetime.fromisoformat(iso)
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def ago(iso: str, now: dt.datetime | None = None) -> str:
    """``iso`` as "3 hours ago" (or "in 2 minutes", for a clock ahead of ours)."""
    seconds = ((now or dt.datetime.now(dt.UTC)) - _parse_time(iso)).total_seconds()
    future, seconds = seconds < 0, abs(seconds)
    for unit, size in (("year", 365 * 86400), ("month", 30 * 86400), ("day", 86400),
                       ("hour", 3600), ("minute", 60)):  # fmt: skip
        if seconds >= size:
            n = int(seconds // size)
            text = f"{n} {unit}{'' if n == 1 else 's'}"
            return f"in {text}" if future else f"{text} ago"
    return "just now"


def absolute(iso: str) -> str:
    return _parse_time(iso).astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def value_text(value: float | None) -> str:
    """A preview's minimum or maximum for a label: integers whole, others to 6 digits."""
    if value is None:
        return DASH
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"


def shape_text(shape: list[int] | tuple[int, ...]) -> str:
    return TIMES.join(f"{n:,}" for n in shape) if shape else "()  scalar"


def size_text(n_bytes: int) -> str:
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n_bytes} B"  # pragma: no cover


def to_json(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False, allow_nan=True, default=str)


def fill_text(value: Any) -> str:
    """A fill value as the metadata has it: JSON, but the special floats ("NaN") unquoted."""
    if value in ("NaN", "Infinity", "-Infinity"):
        return str(value)
    return to_json(value)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def first_line(message: str | None) -> str:
    return (message or "").strip().splitlines()[0] if (message or "").strip() else ""


def rest_lines(message: str | None) -> str:
    lines = (message or "").strip().splitlines()
    return "\n".join(lines[1:]).strip()


def codec_names(codecs: Any) -> list[str]:
    """``["bytes", "zstd"]``; a sharding codec as ``sharding_indexed(bytes → zstd)``."""
    names = []
    for codec in codecs if isinstance(codecs, list) else []:
        if not isinstance(codec, dict):
            continue
        name = str(codec.get("name", "?"))
        inner = (codec.get("configuration") or {}).get("codecs")
        if name == "sharding_indexed" and isinstance(inner, list):
            name += "(" + " → ".join(codec_names(inner)) + ")"
        names.append(name)
    return names


# -- the pages -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RefSwitch:
    """The header's ref menu: the ref shown (``current``, of ``kind`` branch, tag or snapshot)
    and where each other ref leads (``link(name)``)."""

    current: str
    kind: str
    branches: list[tuple[str, str]]
    tags: list[tuple[str, str]]
    link: Callable[[str], str]

    @property
    def current_label(self) -> str:
        return self.current[: model.SHORT_ID] if self.kind == "snapshot" else self.current


class Pages:
    """The page routes of one server."""

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx
        self.previews = PreviewCache()
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(TEMPLATES),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.globals.update(
            ago=ago,
            absolute=absolute,
            value_text=value_text,
            shape_text=shape_text,
            to_json=to_json,
            fill_text=fill_text,
            first_line=first_line,
            rest_lines=rest_lines,
            quote=lambda s: quote(s, safe=""),
        )
        css = (STATIC / STYLESHEET).read_bytes()
        self._css_version = hashlib.sha256(css).hexdigest()[:12]
        self._colorbar = colorbar_png()
        # /favicon.ico, which browsers ask for on their own (an image shown alone, say): the
        # colormap's diagonal, as PNG (which every browser takes at that name).
        diagonal = np.add.outer(np.arange(32), np.arange(32)) * (LEVELS - 1) // 62
        self._favicon = encode_png(diagonal.astype(np.uint8), COLORMAP)
        self._version = __version__

    def routes(self) -> list[BaseRoute]:
        page = self._endpoint
        return [
            Route("/", page(self.overview), methods=["GET"]),
            # Prefix routes: whatever follows (a newline too) reaches the handler, whose
            # split_path() answers what it cannot read.
            PrefixRoute("/log/", page(self.log)),
            PrefixRoute("/commit/", page(self.commit)),
            Route("/compare", page(self.compare_form), methods=["GET"]),
            PrefixRoute("/compare/", page(self.compare)),
            Route("/tree", page(self.tree), methods=["GET"]),
            PrefixRoute("/tree/", page(self.tree)),
            PrefixRoute("/array/", page(self.array)),
            PrefixRoute("/preview/", page(self.preview)),
            Route("/static/colorbar.png", self.colorbar, methods=["GET"]),
            Route("/favicon.ico", self.favicon, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
        ]

    # -- plumbing --------------------------------------------------------------------------------

    def _endpoint(self, handler: Handler) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:
                status, reason = http_error(e)
                if status >= 500:
                    log_line(e, f"{request.method} {request.url.path}")
                try:
                    return self._page(
                        request,
                        "error.html",
                        http_status=status,
                        title=f"{status}",
                        status=status,
                        reason=reason,
                    )
                except Exception as page_error:  # the layout itself failed: one plain line
                    log_line(page_error, f"{request.method} {request.url.path} (error page)")
                    return PlainTextResponse(reason + "\n", status_code=status)

        return endpoint

    def _links(self, request: Request) -> Links:
        return Links(request.scope.get("root_path", "").rstrip("/"))

    def _page(
        self, request: Request, template: str, *, http_status: int = 200, **values: Any
    ) -> Response:
        links = self._links(request)
        crumbs = values.get("crumbs") or []
        values["crumbs"] = [("repository", links.url()), *crumbs] if crumbs else []
        values.setdefault("switch", None)
        values.setdefault("section", None)
        values.setdefault("nav_ref", "main")
        html = self.env.get_template(template).render(
            repo_id=self.ctx.repo.id,
            version=self._version,
            static_url=links.url("static", STYLESHEET) + f"?v={self._css_version}",
            url=links.url,
            tree_url=links.tree,
            array_url=links.array,
            node_url=links.node,
            log_url=links.log,
            commit_url=links.commit,
            compare_url=links.compare,
            zarr_base=str(request.base_url) + "zarr/",
            **values,
        )
        return HTMLResponse(html, status_code=http_status, headers=PAGE_HEADERS)

    def _segments(self, request: Request, route: str) -> tuple[str, ...]:
        return ref_segments(request.scope, route, max_length=self.ctx.limits.max_key_length)

    def _whole_ref(self, request: Request, route: str, what: str) -> str:
        limit, usage = self.ctx.limits.max_key_length, f"{what}: {route}<{what}>"
        return whole_ref(request.scope, route, max_length=limit, usage=usage)

    async def _refs(self) -> Refs:
        return await self.ctx.run_page(self.ctx.repo.refs)

    @staticmethod
    def _default_branch(refs: Refs) -> str:
        if "main" in refs.branches or not refs.branches:
            return "main"
        return next(iter(refs.branches))

    def _switch(self, refs: Refs, current: str, link: Callable[[str], str]) -> RefSwitch:
        kind = (
            "branch" if current in refs.branches else "tag" if current in refs.tags else "snapshot"
        )
        return RefSwitch(current, kind, list(refs.branches.items()), list(refs.tags.items()), link)

    # -- overview, history, commits ----------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        data = await self.ctx.run_page(model.overview, self.ctx.repo)
        names = [b["name"] for b in data["branches"]] + [t["name"] for t in data["tags"]]
        branches = [b["name"] for b in data["branches"]]
        default = "main" if "main" in branches else (branches[0] if branches else None)
        tags = data["tags"]
        return self._page(
            request,
            "overview.html",
            title="Repository",
            section="overview",
            data=data,
            default_branch=default,
            nav_ref=default or "main",
            ref_names=names,
            form_base=tags[-1]["name"] if tags else "",
            form_head=default or "",
        )

    async def log(self, request: Request) -> Response:
        ref = self._whole_ref(request, "/log/", "ref")
        cursor = request.query_params.get("cursor") or None
        limit = query_number(request.query_params, "n", model.LOG_PAGE)
        limit = min(limit, self.ctx.limits.max_log_limit)
        data, refs = await asyncio.gather(
            self.ctx.run_page(
                model.log_page,
                self.ctx.repo,
                ref,
                cursor=cursor,
                limit=limit,
                walks=self.ctx.walks,
            ),
            self._refs(),
        )
        links = self._links(request)
        switch = self._switch(refs, ref, links.log)
        return self._page(
            request,
            "log.html",
            title=f"History of {ref}",
            section="log",
            nav_ref=ref,
            data=data,
            cursor=cursor,
            switch=switch,
            crumbs=[("history", None), (switch.current_label, None)],
        )

    async def commit(self, request: Request) -> Response:
        ref = self._whole_ref(request, "/commit/", "id")
        data = await self.ctx.run_page(model.commit, self.ctx.repo, ref)
        parents = data["parents"]
        parent = next(
            (p for p in data["parent_commits"] if parents and p["id"] == parents[0]), None
        )
        diff = None
        if parent is not None:
            diff = await self.ctx.run_page(model.compare, self.ctx.repo, parent["id"], data["id"])
        refs = await self._refs()
        return self._page(
            request,
            "commit.html",
            title=f"{first_line(data['message']) or data['short']} · {data['short']}",
            section="log",
            nav_ref=self._default_branch(refs),
            data=data,
            parent=parent,
            diff=diff,
            crumbs=[("commit", None), (data["short"], None)],
        )

    # -- comparing -----------------------------------------------------------------------------

    async def compare_form(self, request: Request) -> Response:
        base = (request.query_params.get("base") or "").strip()
        head = (request.query_params.get("head") or "").strip()
        if base and head:
            return RedirectResponse(self._links(request).compare(base, head), status_code=303)
        return await self._compare_page(request, base, head, None)

    async def compare(self, request: Request) -> Response:
        spec = self._whole_ref(request, "/compare/", "base>...<head")
        base, head = model.compare_refs(spec, "/compare/")
        diff = await self.ctx.run_page(model.compare, self.ctx.repo, base, head)
        return await self._compare_page(request, base, head, diff)

    async def _compare_page(
        self, request: Request, base: str, head: str, diff: dict[str, Any] | None
    ) -> Response:
        refs = await self._refs()
        return self._page(
            request,
            "compare.html",
            title=f"Compare {base}...{head}" if diff else "Compare",
            section="compare",
            nav_ref=self._default_branch(refs),
            diff=diff,
            base=base,
            head=head,
            form_base=base,
            form_head=head,
            ref_names=[*refs.branches, *refs.tags],
            crumbs=[("compare", None), (f"{base}...{head}", None)] if diff else [],
        )

    # -- the tree ------------------------------------------------------------------------------

    def _crumbs(
        self, links: Links, switch: RefSwitch, path: str, last_kind: str
    ) -> list[tuple[str, str | None]]:
        ref = switch.current
        crumbs: list[tuple[str, str | None]] = [(switch.current_label, links.tree(ref, "/"))]
        parts = [p for p in path.strip("/").split("/") if p]
        for i, part in enumerate(parts):
            sub = "/" + "/".join(parts[: i + 1])
            kind = last_kind if i == len(parts) - 1 else "group"
            crumbs.append((part, links.node(ref, sub, kind)))
        return crumbs

    async def tree(self, request: Request) -> Response:
        links = self._links(request)
        segments = (
            () if request.url.path.rstrip("/") == "/tree" else self._segments(request, "/tree/")
        )
        if not segments:
            refs = await self._refs()
            return RedirectResponse(links.tree(self._default_branch(refs)), status_code=303)
        ref, path = segments[0], "/" + "/".join(segments[1:])
        data, refs = await asyncio.gather(
            self.ctx.run_page(model.tree, self.ctx.repo, ref, path), self._refs()
        )
        if data["kind"] == "array":
            return RedirectResponse(links.array(ref, data["path"]), status_code=303)
        switch = self._switch(refs, ref, lambda r: links.tree(r, data["path"]))
        return self._page(
            request,
            "tree.html",
            title=f"{data['path']} · {ref}",
            section="tree",
            nav_ref=ref,
            ref=ref,
            immutable=ref == data["snapshot"],
            data=data,
            switch=switch,
            crumbs=self._crumbs(links, switch, data["path"], "group"),
        )

    # -- arrays and previews --------------------------------------------------------------------

    async def _node(self, request: Request, route: str) -> tuple[str, str, dict[str, Any]]:
        """(ref, node path, :func:`model.tree` of it) of an array or preview URL; the root
        array of a repository is ``/array/<ref>`` and ``/preview/<ref>/.png``."""
        segments = self._segments(request, route)
        if not segments or (route == "/preview/" and len(segments) < 2):
            raise BadRequest(f"give a ref and an array: {route}<ref>/<path>")
        ref, path = segments[0], "/" + "/".join(segments[1:])
        if route == "/preview/":
            if not path.endswith(".png"):
                raise NotFound("a preview's URL ends in .png")
            path = path[: -len(".png")].rstrip("/") or "/"
        data = await self.ctx.run_page(model.tree, self.ctx.repo, ref, path)
        return ref, path, data

    @staticmethod
    def _selection(data: dict[str, Any], params: Mapping[str, str]) -> Selection:
        names = data.get("dimension_names")
        return Selection.parse(
            tuple(data["shape"]),
            params,
            names=list(names) if isinstance(names, list) else None,
            mark_fill_default=marks_fill_by_default(data["fill_value"], data["attributes"]),
        )

    async def _render(self, snapshot_id: str, path: str, selection: Selection) -> Preview:
        key = (snapshot_id, path, selection)
        found = self.previews.get(key)
        if found is not None:
            return found
        async with self.ctx.preview_slots:
            found = self.previews.get(key)  # rendered while this request waited for a slot
            if found is None:
                found = await self.ctx.run(self._render_blocking, snapshot_id, path, selection)
                self.previews.put(key, found)
        return found

    def _render_blocking(self, snapshot_id: str, path: str, selection: Selection) -> Preview:
        session = self.ctx.session(snapshot_id)
        array = zarr.open_array(session.store, path=path.strip("/"), mode="r")
        limits = self.ctx.limits
        return render(
            array,
            selection,
            max_pixels=limits.max_preview_pixels,
            max_source=limits.max_preview_source_elements,
            text={"Title": f"{path} at {snapshot_id}", "Software": "zarrlake serve"},
        )

    async def array(self, request: Request) -> Response:
        links = self._links(request)
        ref, path, data = await self._node(request, "/array/")
        if data["kind"] != "array":
            return RedirectResponse(links.tree(ref, data["path"]), status_code=303)
        snapshot, path = data["snapshot"], data["path"]
        shape = [int(n) for n in data["shape"]]
        note = previewable(data["dtype"], shape)
        selection = None if note else self._selection(data, request.query_params)
        values: dict[str, Any] = {}
        if selection is not None:
            try:
                shown = await self._render(snapshot, path, selection)
            except (PreviewTooLarge, PreviewUnsupported) as e:
                values["preview_error"] = http_error(e)[1]
            else:
                values.update(self._preview_values(links, ref, data, selection, shown))
                values["preview_error"] = None
            values.update(self._selector_values(links, ref, data, selection))
        refs = await self._refs()
        query = selection.query() if selection else None
        switch = self._switch(refs, ref, lambda r: links.array(r, path, query))
        # A NaN fill (or none) is drawn as NaN: there is nothing to choose.
        fill_choice = data["fill_value"] not in ("NaN", None)
        names = data.get("dimension_names")
        element_count = math.prod(shape)
        try:
            itemsize = np.dtype(data["dtype"]).itemsize
        except TypeError:
            itemsize = 0
        grid = data["shards"] or data["chunks"]
        chunk_count = (
            math.prod(-(-n // c) for n, c in zip(shape, grid, strict=True))
            if grid and len(grid) == len(shape) and all(c > 0 for c in grid)
            else None
        )
        return self._page(
            request,
            "array.html",
            title=f"{path} · {ref}",
            section="tree",
            nav_ref=ref,
            ref=ref,
            immutable=ref == snapshot,
            data=data,
            dimension_names=names,
            codec_names=codec_names(data["codecs"]),
            element_count=element_count,
            size_text=size_text(element_count * itemsize) if itemsize else DASH,
            chunk_count=chunk_count,
            preview_note=note,
            sel=selection,
            sel_query=selection.query() if selection else {},
            switch=switch,
            fill_choice=fill_choice,
            crumbs=self._crumbs(links, switch, path, "array"),
            **values,
        )

    def _selector_values(
        self, links: Links, ref: str, data: dict[str, Any], selection: Selection
    ) -> dict[str, Any]:
        """The selector's dimensions, each with links one index back and forward."""
        names = data.get("dimension_names") or []
        dims = []
        for d, size in enumerate(data["shape"]):
            name = names[d] if d < len(names) and names[d] else None
            label = f"{name} ({size:,})" if name else f"dim {d} ({size:,})"

            def step(delta: int, d: int = d, size: int = size) -> str | None:
                i = selection.index[d] + delta
                if not 0 <= i < size:
                    return None
                index = tuple(i if k == d else v for k, v in enumerate(selection.index))
                moved = dataclasses.replace(selection, index=index)
                return links.array(ref, data["path"], moved.query())

            dims.append(
                {
                    "i": d,
                    "name": name,
                    "size": size,
                    "label": label,
                    "prev": step(-1),
                    "next": step(1),
                }
            )
        return {"dims": dims}

    def _preview_values(
        self, links: Links, ref: str, data: dict[str, Any], selection: Selection, shown: Preview
    ) -> dict[str, Any]:
        """What the figure shows around the image: axes, caption, display size, zoom links."""
        names = data.get("dimension_names") or []
        shape = tuple(int(n) for n in data["shape"])

        def name(d: int) -> str:
            return str(names[d]) if d < len(names) and names[d] else f"dim {d}"

        def span_text(d: int) -> str:
            start, stop = selection.span(d, shape[d])
            return f"{name(d)} {start:,}{DASH}{stop - 1:,}"

        plan = shown.plan
        fixed = [
            f"{name(d)} = {i:,}"
            for d, i in enumerate(selection.index)
            if d not in (selection.x, selection.y)
        ]
        image_dims = [d for d in (selection.y, selection.x) if d is not None]
        slice_text = TIMES.join(f"{n:,}" for n in plan.source_shape)
        if selection.windows:
            whole = TIMES.join(f"{shape[d]:,}" for d in image_dims)
            slice_text += f" ({', '.join(span_text(d) for d in image_dims)} of {whole})"
        slice_text += f" at {', '.join(fixed)}" if fixed else ""
        how = []
        if plan.sampled:
            how.append(
                f"every {ordinal(plan.step)} element read (a larger slice than a preview reads)"
            )
        width, height = shown.width, shown.height
        pixelated = False
        x_start, x_stop = selection.span(selection.x, shape[selection.x])
        x_axis = (f"{x_start:,}", f"{name(selection.x)} →", f"{x_stop - 1:,}")
        if shown.kind == "line":
            n = plan.read_shape[0]
            if n > width:
                how.append(f"each column the range of {n / width:.3g} elements")
            y_axis: tuple[str, str, str] = ("", "", "")
            unit = "columns"
        else:
            assert selection.y is not None
            if plan.block > 1:
                how.append(f"each pixel the mean of {plan.block}{TIMES}{plan.block} elements")
            # Small images are enlarged by a whole factor (sharp pixels), large ones fit the page.
            longest = max(width, height)
            if longest < 640:
                scale = max(1, 720 // longest)
                width, height, pixelated = width * scale, height * scale, scale > 1
            if width > 1024:
                width, height = 1024, max(1, round(height * 1024 / width))
            if height < 24:
                height, pixelated = 24, True
            y_start, y_stop = selection.span(selection.y, shape[selection.y])
            y_axis = (f"{y_start:,}", f"{name(selection.y)} ↓", f"{y_stop - 1:,}")
            unit = "pixels"
        out = TIMES.join(f"{n:,}" for n in (shown.height, shown.width))
        out = f"{shown.width:,} columns" if shown.kind == "line" else out
        caption = f"Slice {slice_text}, drawn as {out}" + (f"; {'; '.join(how)}" if how else "")
        if data["dtype"] == "bool":
            labels = ["false" if v == 0 else "true" for v in (shown.vmin, shown.vmax)]
        else:
            labels = [value_text(shown.vmin), value_text(shown.vmax)]
        if shown.kind == "line":
            y_axis = (labels[1], "", labels[0])
        return {
            "preview": shown,
            "vmin_text": labels[0],
            "vmax_text": labels[1],
            "preview_url": links.preview(data["snapshot"], data["path"], selection.query()),
            "colorbar_url": links.url("static", "colorbar.png"),
            "display_width": width,
            "display_height": height,
            "pixelated": pixelated,
            "x_axis": x_axis,
            "y_axis": y_axis,
            "unit": unit,
            "slice_text": slice_text,
            "caption": caption,
            **self._zoom_values(links, ref, data, shape, selection, width, height),
        }

    def _zoom_values(
        self,
        links: Links,
        ref: str,
        data: dict[str, Any],
        shape: tuple[int, ...],
        selection: Selection,
        width: int,
        height: int,
    ) -> dict[str, Any]:
        """The image map that zooms in two times around the part of the image clicked (a grid
        of :data:`ZOOM_CELLS`, no script), and the links that zoom out and show it whole."""
        dims = [d for d in (selection.y, selection.x) if d is not None]
        spans = {d: selection.span(d, shape[d]) for d in dims}
        path = data["path"]
        rows = ZOOM_CELLS if selection.y is not None else 1
        areas = []
        if any(stop - start > MIN_WINDOW for start, stop in spans.values()):
            for i in range(rows):
                for j in range(ZOOM_CELLS):
                    centre = {}
                    for d, k, cells in ((selection.y, i, rows), (selection.x, j, ZOOM_CELLS)):
                        if d is not None:
                            start, stop = spans[d]
                            centre[d] = start + (k + 0.5) * (stop - start) / cells
                    zoomed = selection.zoomed(shape, centre, 2.0)
                    box = (
                        j * width // ZOOM_CELLS,
                        i * height // rows,
                        (j + 1) * width // ZOOM_CELLS,
                        (i + 1) * height // rows,
                    )
                    around = (
                        ", ".join(f"{a:,}{DASH}{b - 1:,}" for _, a, b in zoomed.windows)
                        or "the whole slice"
                    )
                    areas.append(
                        {
                            "coords": ",".join(str(c) for c in box),
                            "href": links.array(ref, path, zoomed.query()),
                            "alt": f"zoom in on {around}",
                        }
                    )
        zoomed_out = whole = None
        if selection.windows:
            centre = {d: (a + b) / 2 for d, (a, b) in spans.items()}
            zoomed_out = links.array(ref, path, selection.zoomed(shape, centre, 0.5).query())
            whole_slice = selection.with_windows(shape, {d: (0, shape[d]) for d in dims})
            whole = links.array(ref, path, whole_slice.query())
        return {"zoom_areas": areas, "zoom_out_url": zoomed_out, "whole_url": whole}

    async def preview(self, request: Request) -> Response:
        ref, _, data = await self._node(request, "/preview/")
        if data["kind"] != "array":
            raise NotFound(f"no array at {data['path']!r}: a group has no preview")
        note = previewable(data["dtype"], [int(n) for n in data["shape"]])
        if note:
            raise PreviewUnsupported(note)
        selection = self._selection(data, request.query_params)
        shown = await self._render(data["snapshot"], data["path"], selection)
        immutable = ref == data["snapshot"]
        return Response(
            shown.png,
            media_type="image/png",
            headers={
                "Cache-Control": self.ctx.immutable if immutable else "no-cache",
                "X-Content-Type-Options": "nosniff",
            },
        )

    async def colorbar(self, request: Request) -> Response:
        return Response(
            self._colorbar,
            media_type="image/png",
            headers={"Cache-Control": "public, max-age=86400"},
        )

    async def favicon(self, request: Request) -> Response:
        return Response(
            self._favicon,
            media_type="image/png",
            headers={"Cache-Control": "public, max-age=86400"},
        )
