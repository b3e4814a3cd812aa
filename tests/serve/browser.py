"""Real headless Chromium for the page tests: Debian's ``/usr/bin/chromium`` driven by Playwright
(its Python package only; no browser is downloaded), with a fresh profile each time and nothing
that reaches the network on its own (no updates, sync, QUIC or first-run pages).

``make chromium-available`` installs the package where it may (as root); without it the browser
tests skip and say why (:func:`unavailable`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("ZARRLAKE_CHROMIUM", "/usr/bin/chromium")

#: What Chromium starts with: headless, no sandbox (tests may run as root in a container), and
#: none of the background traffic a desktop profile makes.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

#: A laptop's viewport.
VIEWPORT = {"width": 1366, "height": 860}


def unavailable() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (make chromium-available, or apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def chromium(
    pw: Any | None = None, viewport: dict[str, int] | None = None, **options: Any
) -> Iterator[Any]:
    """A Playwright ``BrowserContext`` of a fresh Chromium profile, closed (and its profile
    deleted) after. ``pw``: a running ``sync_playwright()`` to launch from (one process may run
    only one; by default this starts its own); ``options`` go to ``launch_persistent_context``
    (``java_script_enabled=False`` for a browser without scripts: the pages need none)."""
    with contextlib.ExitStack() as stack:
        if pw is None:
            from playwright.sync_api import sync_playwright

            pw = stack.enter_context(sync_playwright())
        profile = Path(tempfile.mkdtemp(prefix="zarrlake-chromium-"))
        stack.callback(shutil.rmtree, profile, ignore_errors=True)
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport=viewport or VIEWPORT,
            timeout=30_000,
            **options,
        )
        stack.callback(context.close)
        context.set_default_timeout(10_000)
        yield context
