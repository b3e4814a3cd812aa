"""Write a large 3-D array from many Spark executors as ONE zarrlake commit, then tag it.

On Kubernetes (the repository is a ``Repository`` resource; see README.md here)::

    spark-submit --master k8s://https://<api-server> --deploy-mode cluster \\
        --conf spark.kubernetes.container.image=<your zarrlake-spark image> \\
        --conf spark.kubernetes.authenticate.driver.serviceAccountName=zarrlake-spark \\
        local:///opt/zarrlake/examples/spark/pipeline_write.py --repository climate --tag v1

Locally, on a directory (created if missing)::

    python examples/spark/pipeline_write.py --url /tmp/climate --master 'local[2]' --tag v1

Every task computes one slab of time steps (a deterministic field, so the reader can check
it), writes its chunks straight to the repository's storage, and sends back only the chunk
references; the driver publishes them all in one commit. A task that fails fails the job and
nothing is committed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

import zarr
from climate import ARRAY, add_repository_options, field, open_repository, spark_session

from zarrlake.spark import open_array, write_partitions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_repository_options(p)
    p.add_argument("--branch", default="main")
    p.add_argument("--shape", default="365,721,1440", help="time,lat,lon (default 365,721,1440)")
    p.add_argument("--chunks", default="5,361,360", help="chunk shape (default 5,361,360)")
    p.add_argument("--tag", default=None, help="tag the new commit")
    args = p.parse_args(argv)
    nt, ny, nx = (int(v) for v in args.shape.split(","))
    ct, cy, cx = (int(v) for v in args.chunks.split(","))

    spark = spark_session("zarrlake-pipeline-write", args.master)
    repo = open_repository(args)

    def setup(store: Any) -> None:  # on the driver, before any task: the array's metadata
        zarr.create_array(
            store,
            name=ARRAY,
            shape=(nt, ny, nx),
            chunks=(ct, cy, cx),
            dtype="f4",
            fill_value=float("nan"),
            attributes={"units": "degC", "dims": ["time", "lat", "lon"]},
            overwrite=True,
        )

    def writer(store: Any, slabs: Iterator[int]) -> None:  # on the executors
        arr = open_array(store, ARRAY)
        for t0 in slabs:
            t1 = min(t0 + ct, nt)
            arr[t0:t1] = field(t0, t1, ny, nx)

    slabs = list(range(0, nt, ct))
    started = time.monotonic()
    rdd = spark.sparkContext.parallelize(slabs, len(slabs))
    commit = write_partitions(
        rdd,
        repo,
        args.branch,
        writer=writer,
        setup=setup,
        message=f"temperature {nt}x{ny}x{nx} from {len(slabs)} Spark tasks",
    )
    took = time.monotonic() - started
    size = nt * ny * nx * 4
    print(f"committed {commit}: {len(slabs)} tasks, {size / 2**20:.1f} MiB in {took:.1f} s")
    if args.tag:
        repo.create_tag(args.tag, commit)
        print(f"tagged {args.tag} -> {commit}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
