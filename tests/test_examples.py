"""The examples run as a reader would run them: as scripts, in a process of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import zarrlake

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_mirror_local(tmp_path: Path) -> None:
    where = tmp_path / "demo"
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "mirror" / "mirror_local.py"), str(where)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "promoted branch main, tag v1" in p.stdout
    assert "1 commit(s) behind" in p.stdout  # status between the new commit and the next pass
    assert "same data as the source" in p.stdout
    assert "is a read-only mirror of" in p.stdout
    source = zarrlake.Repository.open(zarrlake.Storage.local(where / "source"))
    mirror = zarrlake.Repository.open(zarrlake.Storage.local(where / "mirror"))
    assert mirror.list_branches() == source.list_branches()
    assert mirror.list_tags() == source.list_tags()
