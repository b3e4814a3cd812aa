"""A transactional mirror between two local directories, in copy mode.

Run with ``python examples/mirror/mirror_local.py [DIR]`` (default ./demo-mirror, recreated on
each run). No servers are needed; with S3 the same code takes ``s3://`` URLs, and
``copy=False`` waits for bucket replication instead of copying.

The same from a shell::

    zarrlake mirror run DIR/source DIR/mirror --once
    zarrlake mirror status DIR/source DIR/mirror
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import zarr

import zarrlake
from zarrlake.mirror import Mirror, MirrorStatus


def show(status: MirrorStatus) -> None:
    for ref in status.refs:
        print(
            f"   {ref.kind} {ref.name}: source {ref.source_head}, mirror {ref.mirrored_head}, "
            f"{ref.commits_behind} commit(s) behind, {ref.missing_objects} object(s) missing"
        )


def main(path: str = "demo-mirror") -> None:
    where = Path(path)
    shutil.rmtree(where, ignore_errors=True)

    # 1. A source repository with a commit on main and a tag.
    source = zarrlake.Repository.create(zarrlake.Storage.local(where / "source"))
    with source.transaction("main", message="First readings") as store:
        temp = zarr.create_array(store, name="temp", shape=(100, 100), chunks=(25, 25), dtype="f4")
        temp[:] = np.random.default_rng(0).random((100, 100), dtype="f4")
    source.create_tag("v1", "main")
    print(f"== Source {where / 'source'}: main at {source.lookup_branch('main')}")

    # 2. Mirror it: the copier copies what main and v1 need, then promotes both refs.
    mirror = Mirror(source, zarrlake.Storage.local(where / "mirror"), copy=True)
    status = mirror.step()
    print(f"== One pass: promoted {', '.join(status.promoted)}; copied {status.copied_objects}")
    show(status)

    # 3. A new commit at the source: the mirror is one commit behind until the next pass.
    with source.transaction("main", message="Correct a block") as store:
        zarr.open_array(store, path="temp", mode="r+")[:25, :25] = 0.0
    print("== After a new commit at the source")
    show(mirror.status())
    mirror.step()
    print("== After the next pass")
    show(mirror.status())

    # 4. Read at the mirror: the same data as the source, for the same snapshot.
    replica = zarrlake.Repository.open(zarrlake.Storage.local(where / "mirror"))
    at_mirror = zarr.open_array(replica.readonly_session("main").store, path="temp", mode="r")
    at_source = zarr.open_array(source.readonly_session("main").store, path="temp", mode="r")
    assert np.array_equal(at_mirror[:], at_source[:])
    head = replica.lookup_branch("main")
    print(f"== Read at the mirror: main at {head}, same data as the source")

    # 5. The mirror is read-only: a write is refused, naming the source.
    try:
        replica.writable_session("main")
    except zarrlake.ReadOnlyError as e:
        print(f"== A write at the mirror is refused: {e}")
    else:
        raise AssertionError("a mirror accepted a write")


if __name__ == "__main__":
    main(*sys.argv[1:2])
