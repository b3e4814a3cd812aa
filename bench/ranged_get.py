"""What a 1 KiB read costs on an S3 API server: a whole 1 KiB object against a 1 KiB range of a
larger object (a pack), by object size.

    python bench/ranged_get.py [--server moto|seaweedfs] [--reads 300]

Sessions put small chunks into packs (~1 MiB), so a random chunk read became a ranged GET. This
tells whether the server's cost of such a GET grows with the object (moto_server reads the whole
object to slice it; a real server should not), which is what the random-read row on S3 measures
as much as the client. boto3 on one connection, medians of ``--reads`` reads at random offsets.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import S3Server

SIZES = [1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["moto", "seaweedfs"], default="moto")
    parser.add_argument("--reads", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        if args.server == "moto":
            server = S3Server.start(str(Path(work) / "moto.log"))
        else:
            server = S3Server.start_seaweedfs(work)
        try:
            client = server.client()
            rng = random.Random(1)
            for size in SIZES:
                client.put_object(Bucket=server.bucket, Key=f"obj-{size}", Body=rng.randbytes(size))
            times: dict[int, list[float]] = {size: [] for size in SIZES}
            for _ in range(args.reads):  # the sizes take turns: drift hits them alike
                for size in SIZES:
                    start = rng.randrange(0, size - 1023)
                    ranged = {} if size == 1024 else {"Range": f"bytes={start}-{start + 1023}"}
                    t = time.perf_counter()
                    got = client.get_object(Bucket=server.bucket, Key=f"obj-{size}", **ranged)
                    body = got["Body"].read()
                    times[size].append(time.perf_counter() - t)
                    assert len(body) == 1024
            print(f"| object size | 1 KiB GET, median ms ({server.name}) | p90 ms |")
            print("| ---: | ---: | ---: |")
            for size, ts in times.items():
                label = "1 KiB (whole object)" if size == 1024 else f"{size // 1024:,} KiB (range)"
                p90 = statistics.quantiles(ts, n=10)[-1]
                print(f"| {label} | {statistics.median(ts) * 1000:.2f} | {p90 * 1000:.2f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
