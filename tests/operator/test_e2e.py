"""`make e2e` as a test: the whole operator scenario must keep passing (see e2e/run.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from k8s_env import ROOT


@pytest.mark.spark
def test_e2e_scenario_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "e2e" / "run.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "==> e2e passed" in done.stdout
    # What the scenario saw, not only that it finished.
    assert "repository.zarrlake.io/climate   True    Ready" in done.stdout
    assert "Succeeded" in done.stdout
