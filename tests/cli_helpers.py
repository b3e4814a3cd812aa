"""Running the ``zarrlake`` command in-process, for the CLI tests (the ``cli`` fixture is in
conftest.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

import zarrlake

CHUNK = 128  # float64 elements: 1 KiB chunks, above the inline threshold


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def assert_one_line_error(r: Result, code: int) -> str:
    """The contract for failures: status ``code``, nothing on stdout, exactly one stderr line."""
    assert r.code == code, (r.code, r.err)
    assert r.out == ""
    assert r.err.endswith("\n") and r.err.count("\n") == 1, r.err
    assert r.err.startswith("zarrlake: error: ")
    assert "Traceback" not in r.err
    return r.err[len("zarrlake: error: ") :].rstrip("\n")


def commit_random(repo: zarrlake.Repository, i: int) -> str:
    """Commit ``i`` on main: array ``a`` (4 chunks) created at 0, then rewritten with new
    random data, so each commit leaves garbage behind once older snapshots expire."""
    session = repo.writable_session("main")
    if i == 0:
        arr = zarr.create_array(
            session.store, name="a", shape=(4 * CHUNK,), chunks=(CHUNK,), dtype="f8"
        )
    else:
        arr = zarr.open_array(session.store, path="a", mode="r+")
    arr[:] = np.random.default_rng(i).random(4 * CHUNK)
    return session.commit(f"commit {i}")
