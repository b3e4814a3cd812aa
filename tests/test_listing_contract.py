"""The engine leans on no more than the storage listing contract (``zarrlake.storage.base``).

Every operation that lists (branches, tags, journals, history, expiry, garbage collection,
compaction, fsck, mirroring) runs here on storages that keep the contract and nothing more: the
test kit's :class:`ContractOnlyStorage` (listings interleaved at random wherever the contract
allows, emptied folders named for ever) and SeaweedFS (listings folder by folder, emptied folders
kept), and must answer exactly as on any other backend.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pytest
import zarr

import zarrlake
from backends import make_storage
from zarrlake.mirror import Mirror
from zarrlake_testkit.contract import ContractOnlyStorage

KINDS = ["contract-only", "s3-seaweedfs"]


@pytest.fixture(params=KINDS)
def loose(request: pytest.FixtureRequest, tmp_path: Path) -> zarrlake.Storage:
    """A fresh storage that keeps the listing contract and no more."""
    if request.param == "contract-only":
        return ContractOnlyStorage(seed=len(request.node.name))
    return make_storage(request.param, tmp_path, request)


def write(repo: zarrlake.Repository, branch: str, value: float, message: str) -> str:
    session = repo.writable_session(branch)
    store = session.store
    try:
        arr = zarr.open_array(store, path="a", mode="r+")
    except (FileNotFoundError, KeyError, zarr.errors.ArrayNotFoundError):
        arr = zarr.create_array(store, name="a", shape=(8,), chunks=(2,), dtype="f8")
    arr[:] = value
    return session.commit(message)


def read(repo: zarrlake.Repository, ref: str) -> float:
    data = zarr.open_array(repo.readonly_session(ref).store, path="a", mode="r")[:]
    assert np.all(data == data[0])
    return float(data[0])


def client(storage: zarrlake.Storage) -> zarrlake.Repository:
    """A new client of the repository: it knows no branch head, so it lists to find each."""
    return zarrlake.Repository.open(storage)


def test_refs_history_and_maintenance(loose: zarrlake.Storage) -> None:
    first = write(zarrlake.Repository.create(loose), "main", 1.0, "one")
    for i in range(2, 5):  # a journal and a history longer than one listing run
        write(client(loose), "main", float(i), f"commit {i}")
    client(loose).create_branch("dev", "main")
    dev = write(client(loose), "dev", 9.0, "on dev")
    # Names whose keys sort differently by key and by folder: "dev-x" < "dev/..." < "dev0".
    for name in ["dev-x", "dev0", "d", "feature/x", "feature-y"]:
        client(loose).create_branch(name, first)
    client(loose).create_tag("v1", first)
    client(loose).create_tag("v1-rc", dev)
    client(loose).create_tag("v", dev)
    client(loose).delete_tag("v1-rc")

    repo = client(loose)
    heads = repo.list_branches()
    assert set(heads) == {"main", "dev", "dev-x", "dev0", "d", "feature/x", "feature-y"}
    assert list(heads) == sorted(heads)
    assert heads["dev"] == dev and heads["feature/x"] == first
    assert repo.list_tags() == {"v": dev, "v1": first}
    assert [c.message for c in repo.log("main")][:4] == [
        "commit 4",
        "commit 3",
        "commit 2",
        "one",
    ]
    journal = repo.core.journal
    assert [e.seq for e in journal.history("main")] == list(range(len(journal.history("main"))))[
        ::-1
    ]  # newest first
    assert repo.readonly_session("main", as_of=dt.datetime.now(dt.UTC)).base == heads["main"]

    client(loose).merge("dev", "main")
    assert read(client(loose), "main") == 9.0
    client(loose).delete_branch("dev-x")
    client(loose).delete_branch("feature/x")
    assert set(client(loose).list_branches()) == {"main", "dev", "dev0", "d", "feature-y"}

    rules = zarrlake.RetentionRules.from_dict({"default": {"last": 1}})
    assert client(loose).expire(rules).expired  # older commits of main left history
    client(loose).compact()
    assert client(loose).gc(grace=dt.timedelta(0), force=True).deleted_objects > 0
    fsck = client(loose).fsck()
    assert fsck.ok, [str(p) for p in fsck.problems]
    repo = client(loose)
    assert read(repo, "main") == 9.0 and read(repo, "v1") == 1.0 and read(repo, "d") == 1.0
    assert [c.message for c in repo.log("main")] == ["Merge dev into main", "on dev"]  # expired


def test_a_repository_created_anew_in_its_place_shows_only_its_own_refs(
    loose: zarrlake.Storage,
) -> None:
    # The old repository's folders may still be listed (SeaweedFS keeps them): its branches
    # must not come back with them.
    old = zarrlake.Repository.create(loose)
    write(old, "main", 1.0, "old")
    for name in ["dev", "feature/x"]:
        old.create_branch(name)
    old.core.journal.settle()  # head markers, written off the committer's path on S3
    loose.delete_many(loose.list_keys())
    assert loose.list_keys() == []

    head = write(zarrlake.Repository.create(loose), "main", 2.0, "new")
    new = client(loose)
    if isinstance(loose, ContractOnlyStorage):  # the case at hand: ghosts of the old branches
        assert {"dev", "feature/x"} <= set(new.core.journal.names())
    assert new.list_branches() == {"main": head}
    assert new.list_tags() == {}
    assert not new.core.journal.is_branch("dev")
    with pytest.raises(zarrlake.RefNotFound):
        new.lookup_branch("feature/x")
    new.create_branch("dev")  # the name is free again
    assert set(client(loose).list_branches()) == {"main", "dev"}
    assert client(loose).fsck().ok


def test_a_mirror_between_two_such_storages(loose: zarrlake.Storage, tmp_path: Path) -> None:
    source = zarrlake.Repository.create(loose)
    write(source, "main", 1.0, "one")
    source.create_branch("dev-x")
    source.create_tag("v1", "main")
    destination = (
        ContractOnlyStorage(seed=7)
        if isinstance(loose, ContractOnlyStorage)
        else zarrlake.Storage.s3(
            loose.bucket,  # type: ignore[attr-defined]
            loose.prefix.rstrip("/") + "-mirror",  # type: ignore[attr-defined]
            endpoint_url=loose.endpoint_url,  # type: ignore[attr-defined]
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
        )
    )
    assert Mirror(client(loose), destination).step().up_to_date
    write(client(loose), "main", 2.0, "two")
    client(loose).delete_branch("dev-x")
    assert Mirror(client(loose), destination).step().up_to_date  # a restarted promoter
    copy = client(destination)
    assert copy.list_branches() == client(loose).list_branches()
    assert copy.list_tags() == client(loose).list_tags()
    assert read(copy, "main") == 2.0
