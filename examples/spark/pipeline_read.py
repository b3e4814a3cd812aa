"""Read a tagged version of the array back with Spark and check every chunk of it.

On Kubernetes::

    spark-submit --master k8s://https://<api-server> --deploy-mode cluster ... \\
        local:///opt/zarrlake/examples/spark/pipeline_read.py --repository climate --ref v1

Locally::

    python examples/spark/pipeline_read.py --url /tmp/climate --master 'local[2]' --ref v1

The ref is resolved once, on the driver, so the job reads one snapshot however the branch moves
meanwhile. Each row of the DataFrame is a chunk; the executors compare it with the field the
writer computed and Spark sums the values for the global mean. Exit status 1 if any chunk
differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr
from climate import ARRAY, add_repository_options, field, open_repository, spark_session

from zarrlake.spark import read_array


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_repository_options(p)
    p.add_argument("--ref", default="v1", help="tag, branch or snapshot id (default v1)")
    args = p.parse_args(argv)

    spark = spark_session("zarrlake-pipeline-read", args.master)
    repo = open_repository(args)
    snapshot = repo.resolve(args.ref)
    arr = zarr.open_array(repo.readonly_session(snapshot).store, path=ARRAY, mode="r")
    (_, ny, nx), (ct, cy, cx) = arr.shape, arr.chunks
    df = read_array(spark, repo, ARRAY, ref=snapshot, mode="chunk")

    def check(rows: Iterator[Any]) -> Iterator[tuple[int, int, float, int]]:
        for row in rows:  # on the executors
            block = np.frombuffer(row.data, np.dtype(row.dtype)).reshape(row.shape)
            t0, y0, x0 = row.chunk[0] * ct, row.chunk[1] * cy, row.chunk[2] * cx
            want = field(t0, t0 + block.shape[0], ny, nx)[
                :, y0 : y0 + block.shape[1], x0 : x0 + block.shape[2]
            ]
            yield 1, int(np.array_equal(block, want)), float(block.sum(dtype="f8")), block.size

    chunks, good, total, count = df.rdd.mapPartitions(check).reduce(
        lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])
    )
    print(
        f"{args.ref} = {snapshot}: {chunks} chunks read by Spark, {good} as written; "
        f"mean {total / count:.3f} degC over {count} values"
    )
    spark.stop()
    return 0 if chunks == good > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
