"""Which Python Spark's workers run for zarrlake.spark, from a script of an environment that is not
activated: a bare ``python3`` first on PATH, no ``PYSPARK_PYTHON``. Each test runs a script of its
own in a fresh process (a SparkContext fixes its settings as it starts), on local[2]."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake

pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("PySpark needs a Java runtime", allow_module_level=True)

pytestmark = pytest.mark.spark  # conftest: slow, and on the Spark tests' xdist worker

#: This venv's base interpreter: the same Python version, without zarrlake.
BARE = Path(sys.base_prefix) / "bin" / "python3"

# Run by this venv's python from a directory that is not the project's. The first Python job
# runs before any zarrlake call: its workers start with the context's default interpreter.
SCRIPT = """
import json, sys, time
import numpy as np, zarr, zarrlake
from pyspark.sql import SparkSession
from zarrlake.errors import ZarrlakeError
from zarrlake.spark import BlockWriter, read_array, write_partitions

spark = (SparkSession.builder.master("local[2]").appName("zarrlake-python")
         .config("spark.ui.enabled", "false").config("spark.driver.bindAddress", "127.0.0.1")
         .getOrCreate())
sc = spark.sparkContext
sc.setLogLevel("OFF")
out = {"before": sc.pythonExec}
out["ran_first"] = sc.parallelize([0], 1).map(lambda _: sys.version_info[:2]).collect() != []
repo = zarrlake.Repository.open(zarrlake.Storage.local(sys.argv[1]))
rdd = sc.parallelize([((4 * i,), np.full(4, i + 1.5)) for i in range(4)], 4)
jobs = lambda: len(sc.statusTracker().getJobIdsForGroup())
try:
    started, n0 = time.monotonic(), jobs()
    out["commit"] = write_partitions(rdd, repo, writer=BlockWriter("a"), message="from spark")
    out["jobs"] = [jobs() - n0]
    write_partitions(rdd, repo, writer=BlockWriter("b"), message="again")
    out["jobs"].append(jobs() - n0 - out["jobs"][0])
    out["read"] = sorted((r.dim_0, r.value) for r in read_array(spark, repo, "a").collect())
except ZarrlakeError as e:
    out["seconds"] = time.monotonic() - started
    out["error"] = [type(e).__name__, str(e)]
    try:
        read_array(spark, repo, "a")
    except ZarrlakeError as e:
        out["read_error"] = [type(e).__name__, str(e)]
out["after"] = sc.pythonExec
print(json.dumps(out))
spark.stop()
"""


def run_script(tmp_path: Path, repo: Path, **extra_env: str) -> dict[str, Any]:
    """SCRIPT, as a user runs it: this venv's python by path, its bin/ not on PATH, whose first
    ``python3`` is one without zarrlake, and no PYSPARK_* set (unless ``extra_env`` sets some)."""
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        if not (shims / name).exists():
            (shims / name).symlink_to(BARE)
    venv_bin = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_") and k != "VIRTUAL_ENV"
    }
    env.update(PATH=os.pathsep.join([str(shims), *path]), SPARK_LOCAL_IP="127.0.0.1", **extra_env)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(repo)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def make_repo(path: Path) -> zarrlake.Repository:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    session = repo.writable_session("main")
    for name in ("a", "b"):
        zarr.create_array(session.store, name=name, shape=(16,), chunks=(4,), dtype="f8")
    session.commit("create a and b")
    return repo


def test_the_python3_first_on_path_has_no_zarr() -> None:
    # The premise of the tests below, which put it first on PATH.
    assert subprocess.run([BARE, "-c", "import zarr"], capture_output=True).returncode != 0


def test_local_workers_run_the_drivers_python_when_nothing_names_one(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    out = run_script(tmp_path, tmp_path / "repo")

    assert "error" not in out, out
    # PySpark's choice, kept for the job that ran first, then this interpreter for zarrlake's.
    assert (out["before"], out["ran_first"], out["after"]) == ("python3", True, sys.executable)
    assert out["jobs"] == [2, 1]  # the check of the workers' Python, once per context
    expected = np.repeat(np.arange(4) + 1.5, 4)
    assert out["read"] == [[i, v] for i, v in enumerate(expected.tolist())]
    fresh = zarrlake.Repository.open(repo.storage)
    log = list(fresh.log("main"))
    assert [c.message for c in log[:3]] == ["again", "from spark", "create a and b"]
    assert log[1].id == out["commit"]
    got = zarr.open_array(fresh.readonly_session(out["commit"]).store, path="a", mode="r")[:]
    np.testing.assert_array_equal(got, expected)


def test_workers_python_without_zarrlake_fails_fast_with_one_line(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    head = repo.lookup_branch("main")
    out = run_script(tmp_path, tmp_path / "repo", PYSPARK_PYTHON=str(BARE))

    kind, message = out["error"]
    print(f"write_partitions failed after {out['seconds']:.1f} s: {message}")
    assert kind == "ExecutorPythonError", out
    assert "\n" not in message
    assert message.startswith(f"Spark's executors' Python '{BARE}' cannot import zarrlake ")
    assert "No module named" in message
    assert "set PYSPARK_PYTHON or spark.pyspark.python to a Python" in message
    assert out["seconds"] < 20  # the one-task check, not a writing job's failure
    assert out["read_error"] == ["ExecutorPythonError", message]
    assert zarrlake.Repository.open(repo.storage).lookup_branch("main") == head
