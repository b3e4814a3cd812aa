"""zarrlake in two minutes: commit, branch, diff, merge, tag and time travel on a local directory.

Run with ``make demo`` (or ``python examples/quickstart.py [DIR]``). No servers are needed: the
repository lives in ./demo-repo, recreated on each run.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

import zarrlake


def say(title: str, detail: str = "") -> None:
    print(f"\n== {title}")
    if detail:
        print("   " + detail.replace("\n", "\n   "))


def main(path: str = "demo-repo") -> None:
    where = Path(path)
    shutil.rmtree(where, ignore_errors=True)
    repo = zarrlake.Repository.create(zarrlake.Storage.local(where))
    say("Created a repository", f"{where.resolve()}  (id {repo.id})")

    # 1. Write an xarray dataset and commit it on main.
    times = pd.date_range("2026-01-01", periods=30, freq="D")
    ds = xr.Dataset(
        {
            "temperature": (
                ("time", "lat", "lon"),
                15 + 8 * np.random.default_rng(0).standard_normal((30, 20, 40)).astype("f4"),
            ),
        },
        coords={"time": times, "lat": np.linspace(-45, 45, 20), "lon": np.linspace(0, 351, 40)},
        attrs={"title": "zarrlake demo"},
    )
    session = repo.writable_session("main")
    ds.to_zarr(
        session.store,
        zarr_format=3,
        consolidated=False,
        encoding={"temperature": {"chunks": (10, 10, 20)}},
    )
    first = session.commit("Add January temperatures", author="demo@zarrlake")
    say("Committed the dataset on main", f"snapshot {first}")

    # 2. Branch, and correct a region on the branch only.
    repo.create_branch("bias-fix", from_ref="main")
    with repo.transaction("bias-fix", message="Remove +0.5 K bias in week 1") as store:
        fixed = xr.open_zarr(store, consolidated=False)
        week1 = fixed.temperature.isel(time=slice(0, 10)) - 0.5
        week1.to_dataset().drop_vars(["lat", "lon", "time"]).to_zarr(
            store, region={"time": slice(0, 10)}, consolidated=False
        )
    say("Branch bias-fix changed week 1", str(repo.diff("main", "bias-fix").summary()))

    # 3. Meanwhile main gains new metadata: a concurrent, non-overlapping change.
    with repo.transaction("main", message="Describe the source") as store:
        import zarr

        zarr.open_group(store)["temperature"].attrs["source"] = "synthetic"

    # 4. Merge the branch back: three-way, chunk by chunk.
    merged = repo.merge("bias-fix", "main", message="Merge bias-fix")
    say("Merged bias-fix into main", f"merge commit {merged}")

    # 5. Tag the release and look at history.
    repo.create_tag("v1", "main")
    say(
        "History of main",
        "\n".join(f"{c.id[:10]}  {c.time:%H:%M:%S}  {c.message}" for c in repo.log("main")),
    )

    # 6. Time travel: the first commit is still there, unchanged.
    old = xr.open_zarr(repo.readonly_session(first).store, consolidated=False)
    new = xr.open_zarr(repo.readonly_session("v1").store, consolidated=False)
    delta = float((old.temperature - new.temperature).isel(time=0).mean())
    say(
        "Time travel",
        f"day 1 mean at {first[:10]}: {float(old.temperature.isel(time=0).mean()):.3f} K\n"
        f"day 1 mean at v1:         {float(new.temperature.isel(time=0).mean()):.3f} K"
        f"  (difference {delta:+.3f} K)\n"
        f"attribute 'source' at v1: {new.temperature.attrs.get('source')!r}",
    )

    # 7. Safety: a conflicting concurrent write is refused, not lost.
    a = repo.writable_session("main")
    b = repo.writable_session("main")
    import zarr

    zarr.open_array(a.store, path="temperature")[0, 0, 0] = 1.0
    zarr.open_array(b.store, path="temperature")[0, 0, 0] = 2.0
    a.commit("writer A")
    try:
        b.commit("writer B")
    except zarrlake.ConflictError as e:
        say("Concurrent writers", f"A committed; B was refused: {e}")
    print("\nBranches:", repo.list_branches())
    print("Tags:    ", repo.list_tags())


if __name__ == "__main__":
    main(*sys.argv[1:])
