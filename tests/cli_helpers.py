"""Running the ``zarrlake`` command in-process, for the CLI tests (the ``cli`` fixture is in
conftest.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


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
