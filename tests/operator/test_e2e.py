"""`make e2e` as a test: the whole operator scenario must keep passing (see e2e/run.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from k8s_env import ROOT


@pytest.mark.spark
def test_e2e_scenario_passes() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "e2e" / "run.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=1000)  # pytest-timeout for this test: 1200 s
    except subprocess.TimeoutExpired:
        # SIGTERM first: run.py then stops its servers, operator and Spark by pid. A SIGKILL
        # would leave them running (and loading the machine) for the rest of the suite.
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise AssertionError(f"e2e did not finish in 1000 s:\n{(stdout + stderr)[-6000:]}")
    output = stdout + stderr
    assert proc.returncode == 0, output[-6000:]
    assert "==> e2e passed" in stdout
    # What the scenario saw, not only that it finished.
    assert "repository.zarrlake.io/climate   True    Ready" in stdout
    assert "Succeeded" in stdout
    assert "read main at the mirror" in stdout  # the Mirror caught up and serves the data
