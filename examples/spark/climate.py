"""What the two pipeline examples share: the array, the synthetic field, and how they find the
repository and their SparkSession. Shipped to the executors with ``SparkContext.addPyFile``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

import zarrlake

ARRAY = "climate/temperature"


def field(t0: int, t1: int, ny: int, nx: int) -> np.ndarray:
    """Time steps ``t0 .. t1-1`` of the synthetic temperature field (°C), shape (t, y, x)."""
    t = np.arange(t0, t1, dtype="f4")[:, None, None]
    y = np.linspace(-90, 90, ny, dtype="f4")[None, :, None]
    x = np.linspace(0, 360, nx, endpoint=False, dtype="f4")[None, None, :]
    seasonal = 10 * np.sin(2 * np.pi * t / 365)
    return (30 * np.cos(np.deg2rad(y)) - 10 + seasonal + np.cos(np.deg2rad(x)) * 2).astype("f4")


def open_repository(args: argparse.Namespace) -> zarrlake.Repository:
    """The repository: a Kubernetes ``Repository`` resource, or a storage URL."""
    if args.repository:
        return zarrlake.Repository.from_kubernetes(args.repository, args.namespace)
    return zarrlake.Repository.open_or_create(zarrlake.Storage.from_url(args.url))


def spark_session(app: str, master: str | None) -> Any:
    """The job's SparkSession (``spark-submit``'s, or ``master``), with this module shipped to
    the executors."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app)
    if master:
        builder = builder.master(master).config("spark.ui.enabled", "false")
    spark = builder.getOrCreate()
    spark.sparkContext.addPyFile(__file__)
    return spark


def add_repository_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--repository", help="name of a zarrlake.io Repository resource")
    where.add_argument("--url", help="a storage URL or a directory instead")
    p.add_argument("--namespace", default=None, help="the Repository's namespace")
    p.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
