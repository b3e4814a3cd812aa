"""Benchmark plumbing: the S3 API server, the clock, progress lines.

The S3 server is a ``moto_server`` on a free loopback port, started for one run and stopped by its
process id at the end. Every system that talks S3 talks to this one server, so S3 numbers compare
clients, not servers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from zarrlake_testkit.servers import start_moto, stop

T = TypeVar("T")

# moto accepts any credentials; set them so no client goes looking for real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
REGION = "us-east-1"
BUCKET = "zarrlake-bench"

# Icechunk warns on every local-filesystem repository that it is not safe for concurrent commits;
# the concurrent-writer benchmark measures exactly that, so keep the output to errors.
os.environ.setdefault("ICECHUNK_LOG", "error")

_T0 = time.perf_counter()


def progress(message: str) -> None:
    """One progress line on stderr, with the seconds since the run started."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


@dataclass
class S3Server:
    """A running ``moto_server`` with one bucket."""

    process: subprocess.Popen[bytes]
    endpoint: str
    bucket: str = BUCKET

    @classmethod
    def start(cls) -> S3Server:
        for k, v in CREDENTIALS.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
        proc, endpoint = start_moto()
        server = cls(proc, endpoint)
        server.client().create_bucket(Bucket=server.bucket)
        return server

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix`` (keeps the server's memory flat between runs)."""
        client = self.client()
        n = 0
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/"
        ):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
                n += len(keys)
        return n

    def stop(self) -> None:
        stop(self.process)
