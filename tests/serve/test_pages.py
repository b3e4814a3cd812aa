"""The web pages of ``zarrlake serve`` (Starlette's TestClient, no browser): each page answers 200
with what the repository says (branches, commits, diffs, trees, array metadata, a preview whose
labels are the data's range), bad input answers 4xx with one line in the page layout (never a
traceback), everything is escaped, the token guards the pages, and previews keep to their slots
and off the event loop. ``test_browser.py`` walks the same pages in Chromium.
"""

from __future__ import annotations

import html
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import markupsafe
import numpy as np
import pytest
import zarr
from starlette.testclient import TestClient
from test_preview import decode_png

import zarrlake
from conftest import populate
from zarrlake.serve import Limits, app, pages
from zarrlake.serve.preview import FILL_RGB, NAN_RGB

SCRIPT = "<script>alert('x')</script>"
X = " \N{MULTIPLICATION SIGN} "  # how the pages write shapes


@dataclass
class Story:
    """A repository with some history: ``populate`` (tag ``v1``), then ``warm`` on main (one
    chunk of temperature rewritten, a 3-D ``cube`` and a string array added; tag ``v2``), then
    ``feature`` on branch ``feature/x``."""

    repo: zarrlake.Repository
    ids: dict[str, str]
    cube: np.ndarray
    temperature: np.ndarray


def build_story(path: Path) -> Story:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    lake = populate(repo)
    session = repo.writable_session("main")
    root = zarr.open_group(session.store, mode="r+")
    temperature = lake.arrays["temperature"].copy()
    temperature[0:2, 0:4] += 1
    root["temperature"][0:2, 0:4] = temperature[0:2, 0:4]
    lat = np.linspace(-60, 60, 30)[:, None]
    lon = np.linspace(0, 350, 40)[None, :]
    cube = np.stack(
        [
            250 + 40 * np.cos(np.radians(lat)) + 5 * np.sin(np.radians(2 * lon + 30 * t))
            for t in range(5)
        ]
    ).astype("f4")
    cube[0, 5:9, 10:20] = np.nan
    arr = root.create_array(
        "cube",
        shape=cube.shape,
        chunks=(1, 16, 16),
        dtype="f4",
        fill_value=np.nan,
        dimension_names=("time", "lat", "lon"),
        attributes={"units": "K", "note": SCRIPT},
    )
    arr[...] = cube
    root.create_array("labels", shape=(3,), chunks=(3,), dtype="str")[...] = ["a", "b", "c"]
    warm = session.commit(f"warm the tropics {SCRIPT}\n\nand add a cube", author="ana")
    repo.create_tag("v2", warm)
    repo.create_branch("feature/x", warm)
    session = repo.writable_session("feature/x")
    zarr.open_array(session.store, path="group/sparse", mode="r+")[0] = 5.0
    feature = session.commit("fill the sparse start", author="bo")
    ids = {"populate": lake.snapshot, "warm": warm, "feature": feature}
    return Story(repo, ids, cube, temperature)


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Story:
    return build_story(tmp_path_factory.mktemp("story"))


@pytest.fixture(scope="module")
def client(story: Story) -> Iterator[TestClient]:
    with TestClient(app(story.repo)) as c:
        yield c


def page(client: TestClient, url: str, status: int = 200) -> str:
    r = client.get(url, follow_redirects=False)
    assert r.status_code == status, (url, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    assert "Traceback" not in r.text
    return r.text


def reason(text: str) -> str:
    found = re.search(r'data-testid="reason">([^<]*)<', text)
    assert found, "an error page shows its reason"
    return html.unescape(found.group(1))


def hrefs(text: str) -> list[str]:
    return [html.unescape(h) for h in re.findall(r'href="([^"]*)"', text)]


# -- each page -----------------------------------------------------------------------------------


def test_overview_lists_branches_with_heads_and_tags(client: TestClient, story: Story) -> None:
    text = page(client, "/")
    assert story.repo.id in text
    warm, feature = story.ids["warm"], story.ids["feature"]
    main_row = re.search(r'<tr data-branch="main">(.*?)</tr>', text, re.S)
    feature_row = re.search(r'<tr data-branch="feature/x">(.*?)</tr>', text, re.S)
    assert main_row and feature_row
    assert f'href="/commit/{warm}"' in main_row.group(1) and warm[:12] in main_row.group(1)
    assert f"/commit/{feature}" in feature_row.group(1) and "fill the sparse start" in text
    assert "/tree/feature%2Fx" in feature_row.group(1), "a ref before a path: one segment"
    assert "/log/feature/x" in feature_row.group(1), "a ref that ends the URL keeps its /"
    assert "ana" in main_row.group(1) and "just now" in main_row.group(1)
    for tag, sid in (("v1", story.ids["populate"]), ("v2", warm)):
        row = re.search(rf'<tr data-tag="{tag}">(.*?)</tr>', text, re.S)
        assert row and f"/commit/{sid}" in row.group(1)
    assert 'data-testid="branch-count">2<' in text and 'data-testid="tag-count">2<' in text


def test_log_pages_through_the_history_with_the_cursor(client: TestClient, story: Story) -> None:
    full = list(story.repo.log("main"))
    text = page(client, "/log/main")
    shown = re.findall(r'<tr data-commit="([0-9A-Z]+)">', text)
    assert shown == [c.id for c in full]
    assert "warm the tropics" in text and "populate" in text and "tester" in text
    # One a page: follow "Older" to the end.
    seen, url = [], "/log/main?n=1"
    while url:
        text = page(client, url)
        seen += re.findall(r'<tr data-commit="([0-9A-Z]+)">', text)
        older = re.search(r'href="([^"]*)" rel="next"', text)
        url = html.unescape(older.group(1)) if older else ""
        assert len(seen) <= len(full)
    assert seen == [c.id for c in full]
    assert page(client, "/log/feature/x").count("<tr data-commit=") == len(full) + 1
    assert page(client, "/log/feature%2Fx").count("<tr data-commit=") == len(full) + 1


def test_commit_page_shows_its_diff_against_its_parent(client: TestClient, story: Story) -> None:
    warm = story.ids["warm"]
    text = page(client, f"/commit/{warm}")
    assert f'data-testid="commit-id">{warm}<' in text
    assert f"/commit/{story.ids['populate']}" in text, "links its parent"
    rows = dict(re.findall(r'<tr data-path="([^"]+)">(.*?)</tr>', text, re.S))
    assert set(rows) == {"/temperature", "/cube", "/labels"}
    assert "changed" in rows["/temperature"] and ">1<" in rows["/temperature"]
    assert "added" in rows["/cube"]
    diff = story.repo.diff(story.ids["populate"], warm)
    assert len(diff.changed_chunks["/cube"]) == 5 * 2 * 3
    assert ">30<" in rows["/cube"], "every chunk of the new cube"
    assert f'href="/array/{warm}/cube"' in rows["/cube"], "commit -> the array at that commit"
    # The same by a short id.
    assert f'data-testid="commit-id">{warm}<' in page(client, f"/commit/{warm[:14]}")


def test_the_first_commit_says_there_is_nothing_to_compare(
    client: TestClient, story: Story
) -> None:
    first = list(story.repo.log("main"))[-1]
    text = page(client, f"/commit/{first.id}")
    if first.parents:  # pragma: no cover - the repository's first commit has none
        pytest.fail("expected a root commit")
    assert "nothing to compare" in text and 'data-testid="diff"' not in text


def test_compare_page_and_form(client: TestClient, story: Story) -> None:
    text = page(client, "/compare/v1...feature/x")
    paths = re.findall(r'<tr data-path="([^"]+)">', text)
    assert paths == ["/cube", "/group/sparse", "/labels", "/temperature"]
    assert 'value="v1"' in text and 'value="feature/x"' in text, "the form keeps what was asked"
    r = client.get("/compare?base=v1&head=feature/x", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/compare/v1...feature/x"
    assert "Name two versions" in page(client, "/compare")
    same = page(client, "/compare/v2...main")
    assert "No differences." in same and "the same snapshot" in same


def test_tree_browses_groups_by_branch_tag_and_snapshot(client: TestClient, story: Story) -> None:
    text = page(client, "/tree/main")
    names = re.findall(r'<tr data-name="([^"]+)">', text)
    assert names == ["counts", "cube", "flags", "group", "labels", "temperature"]
    assert 'href="/array/main/cube"' in text and 'href="/tree/main/group"' in text
    group = page(client, "/tree/v1/group")
    assert re.findall(r'<tr data-name="([^"]+)">', group) == ["big", "sparse", "sub"]
    assert "ünïcødé" in group and "a group" in group, "attributes shown"
    assert "cube" not in page(client, f"/tree/{story.ids['populate']}"), "v1 had no cube"
    feature = page(client, "/tree/feature%2Fx/group")
    assert 'href="/array/feature%2Fx/group/sparse"' in feature
    # The ref switcher leads to the same group in every other ref.
    assert 'href="/tree/v2/group"' in feature and 'href="/tree/main/group"' in feature
    r = client.get("/tree/main/cube", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/array/main/cube"
    r = client.get("/tree", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/tree/main"


def test_array_page_shows_metadata_and_a_preview_with_its_range(
    client: TestClient, story: Story
) -> None:
    text = page(client, "/array/main/cube?i0=0")
    assert f'data-testid="shape">5{X}30{X}40<' in text and f"time{X}lat{X}lon" in text
    assert 'data-testid="dtype">float32<' in text and f'data-testid="chunks">1{X}16{X}16<' in text
    assert 'data-testid="codecs">bytes \N{RIGHTWARDS ARROW} zstd<' in text
    assert "&lt;script&gt;alert(" in text and SCRIPT not in text
    vmin = float(re.search(r'data-testid="vmin">([^<]+)<', text).group(1))
    vmax = float(re.search(r'data-testid="vmax">([^<]+)<', text).group(1))
    assert vmin == pytest.approx(float(np.nanmin(story.cube[0])), rel=1e-5)
    assert vmax == pytest.approx(float(np.nanmax(story.cube[0])), rel=1e-5)
    assert "NaN (40 pixels)" in text, "the legend counts the NaN pixels"
    src = html.unescape(re.search(r'<img src="(/preview/[^"]+)"', text).group(1))
    warm = story.ids["warm"]
    assert src.startswith(f"/preview/{warm}/cube.png?"), "the image names the snapshot shown"
    r = client.get(src)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert "immutable" in r.headers["cache-control"]
    png = decode_png(r.content)
    assert (png.height, png.width) == (30, 40)
    assert tuple(png.rgb[6, 12]) == NAN_RGB
    # Another time step via the selector's parameters; stepping links move one index.
    later = page(client, "/array/main/cube?y=1&x=2&i0=3&fill=mark")
    assert 'value="3"' in later and "time = 3" in later
    # The steppers: one index back and forward, the rest of the selection kept.
    assert 'href="/array/main/cube?x=2&amp;y=1&amp;i0=2&amp;fill=mark"' in later
    assert 'href="/array/main/cube?x=2&amp;y=1&amp;i0=4&amp;fill=mark"' in later
    last = page(client, "/array/main/cube?i0=4")
    assert "i0=5" not in last and 'class="disabled"' in last


def test_the_image_map_zooms_in_and_links_zoom_out(client: TestClient, story: Story) -> None:
    text = page(client, "/array/main/cube?i0=1")
    areas = [html.unescape(h) for h in re.findall(r'<area shape="rect" [^>]*href="([^"]+)"', text)]
    assert len(areas) == 16 and 'usemap="#zoom"' in text
    assert 'data-testid="zoom-out"' not in text, "nothing to zoom out of"
    # The top-left cell: half the rows and columns, around its centre, kept in the array.
    top_left = areas[0]
    assert "w1=0%3A15" in top_left and "w2=0%3A20" in top_left and "i0=1" in top_left
    zoomed = page(client, top_left)
    assert "lat 0\N{EN DASH}14, lon 0\N{EN DASH}19 of 30" in zoomed
    part = story.cube[1, 0:15, 0:20]
    vmax = float(re.search(r'data-testid="vmax">([^<]+)<', zoomed).group(1))
    assert vmax == pytest.approx(float(part.max()), rel=1e-5)
    src = html.unescape(re.search(r'<img src="(/preview/[^"]+)"', zoomed).group(1))
    png = decode_png(client.get(src).content)
    assert (png.height, png.width) == (15, 20)
    # The selector keeps the window; zoom out and the whole slice go back.
    assert 'name="w1" value="0:15"' in zoomed and 'name="w2" value="0:20"' in zoomed
    out = html.unescape(re.search(r'href="([^"]+)" data-testid="zoom-out"', zoomed).group(1))
    whole = html.unescape(re.search(r'href="([^"]+)" data-testid="whole"', zoomed).group(1))
    assert "w1" not in out and "w2" not in out and "w1" not in whole
    assert 'data-testid="zoom-out"' not in page(client, whole)
    # Steppers keep the window too.
    assert "i0=2&amp;w1=0%3A15&amp;w2=0%3A20" in zoomed


def test_a_1d_array_is_a_line_and_a_sentinel_fill_is_marked(client: TestClient) -> None:
    text = page(client, "/array/v1/group/sparse")
    assert "drawn as 960 columns" in text and 'data-testid="colorbar"' not in text
    assert "fill value -1.0" in text, "a chosen fill value is marked by default"
    src = html.unescape(re.search(r'<img src="(/preview/[^"]+)"', text).group(1))
    png = decode_png(client.get(src).content)
    assert (png.rgb[:, 10] == FILL_RGB).all(), "element 0 is the fill value"
    as_data = page(client, "/array/v1/group/sparse?fill=data")
    assert "fill value -1.0 (" not in as_data


def test_arrays_without_a_preview_say_why(client: TestClient) -> None:
    text = page(client, "/array/main/labels")
    assert "no preview for data type" in text and 'data-testid="preview-image"' not in text
    r = client.get("/preview/main/labels.png")
    assert r.status_code == 422 and "no preview for data type" in reason(r.text)


def test_static_files_and_security_headers(client: TestClient) -> None:
    r = client.get("/")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert " style=" not in r.text and "<script" not in r.text, "no inline style, no script"
    css = re.search(r'href="(/static/zarrlake\.css\?v=[0-9a-f]+)"', r.text)
    assert css and client.get(css.group(1)).status_code == 200
    bar = client.get("/static/colorbar.png")
    assert bar.status_code == 200 and decode_png(bar.content).width > 1
    assert client.head("/").status_code == 200


def test_the_stylesheets_nan_and_fill_colours_are_the_previews() -> None:
    css = (Path(pages.__file__).parent / "static" / "zarrlake.css").read_text()
    assert f"--nan: rgb{NAN_RGB};".replace(" ", "") in css.replace(" ", "")
    assert f"--fill: rgb{FILL_RGB};".replace(" ", "") in css.replace(" ", "")


def test_every_link_on_every_page_answers(client: TestClient, story: Story) -> None:
    """A crawl from the overview, two links deep: nothing a page links to is broken."""
    seen: set[str] = set()
    frontier = ["/"]
    for _ in range(3):
        following = []
        for url in frontier:
            r = client.get(url)
            assert r.status_code == 200, (url, r.text[:300])
            if not r.headers["content-type"].startswith("text/html"):
                continue
            for link in hrefs(r.text):
                if link.startswith("/") and link not in seen and not link.startswith("/api/"):
                    seen.add(link)
                    following.append(link)
        frontier = following
    assert any(u.startswith("/array/") for u in seen) and any(
        u.startswith("/commit/") for u in seen
    )


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "status", "says"),
    [
        ("/array/main/cube?i0=5", 400, "i0=5 is out of range for dimension 0 ('time') of size 5"),
        ("/array/main/cube?y=abc", 400, "y must be an integer, not 'abc'"),
        ("/array/main/cube?y=7", 400, "the array has dimensions 0 to 2 only"),
        ("/array/main/cube?y=2&x=2", 400, "y and x are both dimension 2 ('lon')"),
        ("/array/main/cube?fill=yes", 400, "fill must be 'mark' or 'data'"),
        ("/preview/main/cube.png?i0=-3", 400, "i0=-3 is out of range"),
        ("/preview/main/group.png", 404, "a group has no preview"),
        ("/preview/main/cube", 404, "ends in .png"),
        ("/preview/main/nothing.png", 404, "no group or array at '/nothing'"),
        ("/array/main/nothing", 404, "no group or array at '/nothing' in 'main'"),
        ("/array/nope/cube", 404, "not found: 'nope'"),
        ("/tree/nope", 404, "not found: 'nope'"),
        ("/log/nope", 404, "not found: 'nope'"),
        ("/commit/0000000000000000000000000Z", 404, "not found"),
        ("/log/main?cursor=bogus", 400, "bad cursor"),
        ("/log/main?n=x", 400, "n must be a whole number"),
        # Digits str.isdigit() takes and int() refuses: a 400, not a 500.
        ("/log/main?n=%C2%B9", 400, "n must be a whole number"),
        ("/array/main/cube?x=%C2%B9", 400, "x must be an integer"),
        ("/array/main/cube?i0=--1", 400, "i0 must be an integer, not '--1'"),
        ("/preview/main/cube.png?w2=%C2%B2:9", 400, "w2 must be an integer"),
        ("/log/main?cursor=0123456789ABCDEFGHJKMNPQRS.%C2%B2", 400, "bad cursor"),
        ("/compare/v1", 400, "/compare/<base>...<head>"),
        ("/compare/v1...nope", 404, "not found: 'nope'"),
        ("/tree/main/%2E%2E/secret", 400, "bad path segment '..'"),
        ("/tree/main/group%2Fsub", 400, "encoded '/'"),
        ("/array/", 400, "give a ref and an array"),
        ("/preview/main", 400, "give a ref and an array"),
        ("/tree/main/%00", 400, "control character"),
        ("/array/main/cube%0A", 400, "control character"),
        ("/log/main%0A", 400, "control character"),
    ],
)
def test_bad_input_is_a_4xx_page_with_one_line(
    client: TestClient, url: str, status: int, says: str
) -> None:
    r = client.get(url, follow_redirects=False)
    assert r.status_code == status, (url, r.text[:300])
    assert r.headers["content-type"].startswith("text/html")
    why = reason(r.text)
    assert says in why and "\n" not in why and "Traceback" not in r.text
    assert '<header class="top">' in r.text, "in the page layout"


def test_a_huge_preview_is_refused_413_and_the_page_still_answers(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path))
    with repo.transaction("main", message="one big chunk") as store:
        zarr.create_array(store, name="big", shape=(300, 300), chunks=(300, 300), dtype="f4")
    limits = Limits(max_preview_source_elements=10_000)
    with TestClient(app(repo, limits=limits)) as c:
        r = c.get("/preview/main/big.png")
        assert r.status_code == 413 and "90,000 elements" in reason(r.text)
        text = page(c, "/array/main/big")
        assert 'data-testid="preview-error"' in text and "90,000 elements" in text
        assert f'data-testid="shape">300{X}300<' in text


def test_a_repository_whose_root_is_an_array(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path))
    with repo.transaction("main", message="a root array") as store:
        zarr.create_array(store, shape=(3, 4), chunks=(3, 4), dtype="u1")[...] = 7
    with TestClient(app(repo)) as c:
        r = c.get("/tree/main", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/array/main"
        text = page(c, "/array/main")
        src = html.unescape(re.search(r'<img src="(/preview/[^"]+)"', text).group(1))
        assert src.startswith("/preview/") and "/.png?" in src
        png = decode_png(c.get(src).content)
        assert (png.height, png.width) == (3, 4)


def test_pages_escape_what_the_repository_holds(client: TestClient, story: Story) -> None:
    for url in ("/", "/log/main", f"/commit/{story.ids['warm']}", "/array/main/cube"):
        text = page(client, url)
        assert SCRIPT not in text and "<script" not in text, url
    assert str(markupsafe.escape(f"warm the tropics {SCRIPT}")) in page(client, "/log/main")
    # A ref the client sends comes back escaped too.
    r = client.get("/log/" + quote("<b>x</b>", safe=""))
    assert r.status_code in (400, 404) and "<b>x</b>" not in r.text


# -- the token -----------------------------------------------------------------------------------


def test_the_token_guards_every_page(story: Story) -> None:
    with TestClient(app(story.repo, token="s3cret-token")) as c:
        for url in ("/", "/log/main", "/tree/main", "/array/main/cube",
                    "/preview/main/cube.png", "/static/zarrlake.css"):  # fmt: skip
            r = c.get(url, follow_redirects=False)
            assert r.status_code == 401, url
            assert "s3cret" not in r.text
        r = c.get("/tree/main", headers={"Authorization": "Bearer s3cret-token"})
        assert r.status_code == 200 and "cube" in r.text
        r = c.get("/tree/main?token=wrong", follow_redirects=False)
        assert r.status_code == 401
        # A link carrying the token once sets the cookie the browser sends after.
        r = c.get("/tree/main?token=s3cret-token", follow_redirects=False)
        assert r.status_code == 303 and "s3cret" not in r.headers["location"]
        assert c.get("/array/main/cube").status_code == 200
        assert "s3cret-token" not in c.get("/").text
        # The image of a snapshot never changes, but is the client's alone to keep.
        r = c.get(f"/preview/{story.ids['warm']}/cube.png")
        assert r.status_code == 200 and r.headers["cache-control"].startswith("private,")


# -- previews: slots, threads, cache -------------------------------------------------------------


def test_previews_keep_to_their_slots_and_off_the_event_loop(
    story: Story, monkeypatch: pytest.MonkeyPatch
) -> None:
    active, peak, threads = 0, 0, set()
    lock = threading.Lock()
    real = pages.render

    def slow_render(*args: Any, **kw: Any) -> Any:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
            threads.add(threading.current_thread().name)
        try:
            time.sleep(0.15)
            return real(*args, **kw)
        finally:
            with lock:
                active -= 1

    monkeypatch.setattr(pages, "render", slow_render)

    async def burst(asgi: Any, n: int) -> list[int]:
        transport = httpx.ASGITransport(app=asgi)
        statuses: list[int] = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:

            async def one(i: int) -> None:
                r = await http.get(
                    f"/preview/main/cube.png?i0={i % 5}&fill={'mark' if i < 5 else 'data'}"
                )
                statuses.append(r.status_code)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        return statuses

    for slots in (1, 2):
        active = peak = 0
        asgi = app(story.repo, limits=Limits(preview_slots=slots))
        started = time.monotonic()
        assert anyio.run(burst, asgi, 6) == [200] * 6
        assert peak == slots, f"{peak} renders at once with {slots} slots"
        assert time.monotonic() - started >= 6 / slots * 0.15 * 0.9
        asgi.state.ctx.close()
    assert threads and all(name.startswith("zarrlake-serve") for name in threads)


def test_the_image_after_its_page_is_served_from_the_cache(
    story: Story, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = pages.render
    monkeypatch.setattr(pages, "render", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with TestClient(app(story.repo)) as c:
        text = page(c, "/array/main/cube?i0=2")
        src = html.unescape(re.search(r'<img src="(/preview/[^"]+)"', text).group(1))
        assert c.get(src).status_code == 200 and c.get(src).status_code == 200
    assert len(calls) == 1


def test_the_preview_cache_keeps_to_its_bytes() -> None:
    from zarrlake.serve.preview import Preview, ReadPlan, Selection

    plan = ReadPlan(1, 1, (1, 1), (1, 1), (1, 1), 1)
    cache = pages.PreviewCache(max_bytes=250)
    for i in range(5):
        cache.put(
            ("s", f"/a{i}", Selection(0, 1, (0, 0))),
            Preview(b"x" * 100, 1, 1, 0, 1, 0, 0, plan, "image"),
        )
    kept = [i for i in range(5) if cache.get(("s", f"/a{i}", Selection(0, 1, (0, 0))))]
    assert kept == [3, 4]
