"""The examples run as a reader would run them: as scripts, in a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.spark
@pytest.mark.slow
def test_spark_pipeline_writes_one_commit_and_reads_the_tag_back(tmp_path: Path) -> None:
    """The two commands of examples/spark/README.md, on local[2]."""
    repo_dir = tmp_path / "climate"
    env = dict(
        os.environ,
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    common = ["--url", str(repo_dir), "--master", "local[2]"]
    write = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "spark" / "pipeline_write.py"),
            *common,
            "--shape",
            "20,37,72",
            "--chunks",
            "5,19,36",
            "--tag",
            "v1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert write.returncode == 0, write.stderr[-3000:]
    assert "4 tasks" in write.stdout
    repo = zarrlake.Repository.open(zarrlake.Storage.local(repo_dir))
    log = list(repo.log("main"))
    assert len(log) == 2 and "from 4 Spark tasks" in log[0].message  # one commit for all tasks
    assert repo.list_tags() == {"v1": log[0].id}

    read = subprocess.run(
        [sys.executable, str(EXAMPLES / "spark" / "pipeline_read.py"), *common, "--ref", "v1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert read.returncode == 0, read.stderr[-3000:]
    assert "16 chunks read by Spark, 16 as written" in read.stdout
