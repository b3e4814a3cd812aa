"""The pages in a real browser: headless Chromium (Debian's) over a real uvicorn server on a
loopback port. Follows links the way a person does — overview, a branch's head commit, its diff,
an array, its preview — and checks what the DOM shows against the repository: commits, counts,
names, an image that loaded. Also: the selector form and its steppers, the ref switcher, the
pages with JavaScript off, and an error page. Screenshots go to ``tests/serve/artifacts/``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser import chromium, unavailable
from test_pages import Story, build_story

from conftest import LiveServer, serving

pytestmark = [
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
    # One browser for the module: keep its tests on one xdist worker.
    pytest.mark.xdist_group("browser"),
]

ARTIFACTS = Path(__file__).parent / "artifacts"


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Story:
    return build_story(tmp_path_factory.mktemp("browser-story"))


@pytest.fixture(scope="module")
def server(story: Story) -> Iterator[LiveServer]:
    with serving(story.repo) as s:
        yield s


@pytest.fixture(scope="module")
def pw() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as running:
        yield running


@pytest.fixture(scope="module")
def browser(pw: Any) -> Iterator[Any]:
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium(pw) as context:
        yield context


@pytest.fixture
def tab(browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on(
        "response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None
    )
    page.on("pageerror", lambda e: problems.append(str(e)))
    yield page
    page.close()
    # A CSP violation, a missing stylesheet or image shows up here.
    assert not problems, problems


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def texts(page: Any, selector: str) -> list[str]:
    return [t.strip() for t in page.locator(selector).all_inner_texts()]


def image_loaded(page: Any, selector: str) -> tuple[int, int]:
    """(naturalWidth, naturalHeight) of an <img> once it has loaded (0, 0 if it failed)."""
    handle = page.locator(selector)
    handle.wait_for()
    return tuple(
        handle.evaluate(
            """img => img.complete ? [img.naturalWidth, img.naturalHeight]
                : new Promise(ok => { img.onload = () => ok([img.naturalWidth, img.naturalHeight]);
                                      img.onerror = () => ok([0, 0]); })"""
        )
    )


def test_overview_to_commit_to_diff_to_array_to_preview(
    tab: Any, server: LiveServer, story: Story
) -> None:
    page = tab
    page.goto(server.url + "/")
    assert page.title().startswith("Repository")
    assert texts(page, "[data-testid=branches] tbody tr[data-branch] td:first-child") == [
        "feature/x",
        "main",
    ]
    assert texts(page, "[data-testid=tags] tbody tr[data-tag] td:first-child") == ["v1", "v2"]
    warm = story.ids["warm"]
    main_head = page.locator("tr[data-branch=main] a.id")
    assert main_head.inner_text() == warm[:12] and main_head.get_attribute("title") == warm
    assert page.locator("[data-testid=branch-count]").inner_text() == "2"
    shot(page, "overview")

    main_head.click()
    page.wait_for_url(f"**/commit/{warm}")
    assert page.locator("[data-testid=commit-id]").inner_text() == warm
    assert "warm the tropics <script>" in page.locator("[data-testid=commit-message]").inner_text()
    assert page.locator("script").count() == 0, "the message's <script> is text, not a script"
    paths = texts(page, "[data-testid=diff] tbody tr td:first-child")
    assert paths == ["/cube", "/labels", "/temperature"]
    stats = texts(page, "[data-testid=diff-stats] .stat b")
    diff = story.repo.diff(story.ids["populate"], warm)
    assert stats == [
        str(len(diff.added_nodes)),
        str(len(diff.removed_nodes)),
        "1",
        str(sum(len(c) for c in diff.changed_chunks.values())),
    ]
    cube_row = page.locator("tr[data-path='/cube']")
    assert "added" in cube_row.inner_text() and "30" in cube_row.inner_text()
    shot(page, "commit")

    cube_row.locator("a.node").click()
    page.wait_for_url(f"**/array/{warm}/cube")
    assert (
        page.locator("[data-testid=shape]").inner_text()
        == "5 \N{MULTIPLICATION SIGN} 30 \N{MULTIPLICATION SIGN} 40"
    )
    assert page.locator("[data-testid=dtype]").inner_text() == "float32"
    width, height = image_loaded(page, "[data-testid=preview-image]")
    assert (width, height) == (40, 30), "the 30 x 40 slice, one pixel an element"
    shown_width = page.locator("[data-testid=preview-image]").evaluate("img => img.width")
    assert shown_width >= 400, "a small slice is enlarged on the page"
    assert image_loaded(page, "[data-testid=colorbar] img")[0] > 0
    vmin = float(page.locator("[data-testid=vmin]").inner_text())
    assert vmin == pytest.approx(float(np.nanmin(story.cube[0])), rel=1e-5)
    assert "NaN (40 pixels)" in page.locator("[data-testid=legend]").inner_text()
    shot(page, "array")

    page.locator("[data-testid=caption] a").click()  # the PNG itself
    assert page.url.startswith(f"{server.url}/preview/{warm}/cube.png?")
    assert page.evaluate("document.contentType") == "image/png"


def test_the_selector_form_and_steppers_change_the_slice(
    tab: Any, server: LiveServer, story: Story
) -> None:
    page = tab
    page.goto(server.url + "/array/main/cube")
    page.fill("input[name=i0]", "3")
    page.click("[data-testid=selector] button[type=submit]")
    page.wait_for_url("**/array/main/cube?*i0=3*")
    assert image_loaded(page, "[data-testid=preview-image]")[0] == 40
    vmax = float(page.locator("[data-testid=vmax]").inner_text())
    assert vmax == pytest.approx(float(np.nanmax(story.cube[3])), rel=1e-5)
    page.click("a[aria-label='next index of time (5)']")
    page.wait_for_url("**i0=4**")
    assert page.locator("input[name=i0]").input_value() == "4"
    assert "disabled" in (
        page.locator("a[aria-label='next index of time (5)']").get_attribute("class") or ""
    )
    # Rows = time, columns = lon: a 5 x 40 picture, at lat 0 and then at lat 7.
    page.select_option("select[name=y]", "0")
    page.click("[data-testid=selector] button[type=submit]")
    page.wait_for_url("**y=0**")
    assert image_loaded(page, "[data-testid=preview-image]") == (40, 5)
    page.fill("input[name=i1]", "7")
    page.click("[data-testid=selector] button[type=submit]")
    page.wait_for_url("**i1=7**")
    assert image_loaded(page, "[data-testid=preview-image]") == (40, 5)
    assert "lat = 7" in page.locator("[data-testid=caption]").inner_text()
    shot(page, "array-time-by-lon")


def test_clicking_the_image_zooms_in(tab: Any, server: LiveServer, story: Story) -> None:
    page = tab
    page.goto(server.url + "/array/main/cube?i0=2")
    image_loaded(page, "[data-testid=preview-image]")
    image = page.locator("[data-testid=preview-image]")
    box = image.bounding_box()
    # Bottom right: rows 15-29, columns 20-39 of the 30 x 40 slice.
    image.click(position={"x": box["width"] * 0.9, "y": box["height"] * 0.9})
    page.wait_for_url("**w1=15%3A30**")
    assert "w2=20%3A40" in page.url
    assert image_loaded(page, "[data-testid=preview-image]") == (20, 15)
    vmin = float(page.locator("[data-testid=vmin]").inner_text())
    assert vmin == pytest.approx(float(story.cube[2, 15:, 20:].min()), rel=1e-5)
    shot(page, "array-zoomed")
    page.click("[data-testid=whole]")
    page.wait_for_url("**/array/main/cube?*")
    assert "w1" not in page.url
    assert image_loaded(page, "[data-testid=preview-image]") == (40, 30)


def test_a_1d_array_and_the_ref_switcher(tab: Any, server: LiveServer) -> None:
    page = tab
    page.goto(server.url + "/array/v1/group/sparse")
    width, height = image_loaded(page, "[data-testid=preview-image]")
    assert width == 960 and height > 100
    assert "fill value -1.0" in page.locator("[data-testid=legend]").inner_text()
    shot(page, "array-1d")
    page.click("[data-testid=refswitch] summary")
    page.click("[data-testid=refswitch] .menu a:has-text('feature/x')")
    page.wait_for_url("**/array/feature%2Fx/group/sparse*")
    assert page.locator("[data-testid=refswitch] summary").inner_text().split() == [
        "branch",
        "feature/x",
    ]
    page.goto(server.url + "/tree/feature%2Fx/group")
    assert texts(page, "[data-testid=children] tbody tr td:first-child") == ["big", "sparse", "sub"]
    shot(page, "tree")


def test_history_pages_and_compare_form(tab: Any, server: LiveServer, story: Story) -> None:
    page = tab
    log = [c.id for c in story.repo.log("feature/x")]
    page.goto(server.url + "/log/feature/x?n=2")
    seen = [r.get_attribute("data-commit") for r in page.locator("tr[data-commit]").all()]
    while page.locator("[data-testid=older]").count():
        page.click("[data-testid=older]")
        seen += [r.get_attribute("data-commit") for r in page.locator("tr[data-commit]").all()]
    assert seen == log
    page.goto(server.url + "/log/main")
    shot(page, "log")
    page.goto(server.url + "/compare")
    page.fill("input[name=base]", "v1")
    page.fill("input[name=head]", "feature/x")
    page.click("[data-testid=compare-form] button")
    page.wait_for_url("**/compare/v1...feature/x")
    assert texts(page, "[data-testid=diff] tbody tr td:first-child") == [
        "/cube",
        "/group/sparse",
        "/labels",
        "/temperature",
    ]
    shot(page, "compare")


def test_bad_input_shows_one_line_in_the_layout(browser: Any, server: LiveServer) -> None:
    page = browser.new_page()  # not `tab`: the console reports the 400 this test asks for
    response = page.goto(server.url + "/array/main/cube?i0=99")
    assert response.status == 400
    assert page.locator("[data-testid=reason]").inner_text() == (
        "i0=99 is out of range for dimension 0 ('time') of size 5"
    )
    assert page.locator("header.top .brand").is_visible()
    shot(page, "error")
    page.close()


def test_the_pages_work_without_javascript(pw: Any, server: LiveServer) -> None:
    with chromium(pw, java_script_enabled=False) as context:
        page = context.new_page()
        page.goto(server.url + "/")
        page.click("tr[data-branch=main] a:has-text('browse')")
        page.wait_for_url("**/tree/main")
        page.click("a.node.array:has-text('cube')")
        page.wait_for_url("**/array/main/cube")
        page.fill("input[name=i0]", "2")
        page.click("[data-testid=selector] button[type=submit]")
        page.wait_for_url("**i0=2**")
        natural = page.locator("[data-testid=preview-image]").evaluate("img => img.naturalWidth")
        assert natural == 40
        page.click("[data-testid=refswitch] summary")  # <details>: opens without a script
        assert page.locator("[data-testid=refswitch] .menu").is_visible()
