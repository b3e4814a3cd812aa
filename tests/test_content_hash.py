"""The content hash as a recorded per-repository setting (issue 11).

New repositories name chunk and pack objects by BLAKE3 digests and record so in their marker; a
marker without the setting (every repository made before it existed) means SHA-256, for reads and
for new writes alike. Every writer (sessions, pickled sessions and forks, compaction) and every
content check (fsck) uses the recorded hash. Digests are computed here with the hash libraries
themselves, never with zarrlake's code.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import pickle
from pathlib import Path
from typing import Any

import blake3
import msgpack
import numpy as np
import pytest
import zarr
import zstandard

import zarrlake
from zarrlake.cli import main as cli_main
from zarrlake.format import manifest
from zarrlake.format.codec import MAGIC, ObjectType
from zarrlake.format.model import OBJECT, REPO_KEY, RepoRecord, chunk_key, to_micros
from zarrlake.format.root import ROOT_KEY, RootRecord

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")

DIGEST = {
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    "blake3": lambda data: blake3.blake3(data).hexdigest(),
}
CHUNK = 4096  # bytes per chunk: above the inline threshold, so every chunk is an object


def write_blocks(session: zarrlake.Session, values: list[int], name: str = "a") -> None:
    arr = zarr.create_array(
        session.store,
        name=name,
        shape=(len(values) * CHUNK,),
        chunks=(CHUNK,),
        dtype="u1",
        compressors=None,
        fill_value=0,
        overwrite=True,
    )
    arr[:] = np.repeat(np.array(values, dtype="u1"), CHUNK)


def block(value: int) -> bytes:
    return bytes([value]) * CHUNK


def chunk_digests(repo: zarrlake.Repository, ref: str = "main") -> dict[str, str]:
    """Chunk key -> the hex digest its ref names, for every chunk object of ``ref``."""
    objects = repo.core.objects
    snap = objects.snapshot(repo.resolve(ref))
    return {
        key: r[1].hex()
        for key, r in manifest.iter_all(snap.shards, objects.shard)
        if r[0] == OBJECT
    }


def old_marker(storage: zarrlake.Storage) -> None:
    """Make ``storage`` a repository exactly as zarrlake made them before the setting existed: a
    ``main`` branch, then a version-1 marker with id, creation time, config and ``initialized``."""
    repo = zarrlake.Repository.create(storage, content_hash="sha256")
    record = repo.record
    body = {
        "id": record.id,
        "created": to_micros(record.created),
        "config": record.config,
        "initialized": True,
    }
    old = MAGIC + bytes([1, ObjectType.REPO])
    old += zstandard.ZstdCompressor(level=3).compress(msgpack.packb(body, use_bin_type=True))
    storage.put(REPO_KEY, old)


def test_new_repository_records_blake3_and_names_chunks_by_it(
    storage: zarrlake.Storage,
) -> None:
    repo = zarrlake.Repository.create(storage)
    assert repo.record.content_hash == "blake3"
    marker = storage.get(REPO_KEY)
    assert marker[4] == 2  # older clients refuse the marker rather than write SHA-256 chunks
    assert zarrlake.Repository.open(storage).record.content_hash == "blake3"

    s = repo.writable_session()
    write_blocks(s, [1, 2, 3])
    s.commit("three chunks")
    digests = chunk_digests(repo)
    assert len(digests) == 3
    for key, digest in digests.items():
        data = storage.get(chunk_key(digest))
        assert digest == DIGEST["blake3"](data) != DIGEST["sha256"](data), key
    assert {o.key for o in storage.list("chunks/")} == {chunk_key(d) for d in digests.values()}
    report = repo.fsck(verify_content=True)
    assert report.ok and report.chunks == 3, report.problems


def test_old_marker_keeps_sha256_for_reads_and_new_writes(storage: zarrlake.Storage) -> None:
    old_marker(storage)
    repo = zarrlake.Repository.open(storage)
    assert (repo.record.content_hash, repo.record.features) == ("sha256", ())
    s = repo.writable_session()
    write_blocks(s, [4, 5])
    first = s.commit("written under an old marker")

    fresh = zarrlake.Repository.open(storage)
    s = fresh.writable_session()
    write_blocks(s, [4, 5, 6])  # 4, 5: the same bytes again
    s.commit("more")
    for key, digest in chunk_digests(fresh).items():
        assert digest == DIGEST["sha256"](storage.get(chunk_key(digest))), key
    assert len(list(storage.list("chunks/"))) == 3  # deduplicated against the first commit
    got = zarr.open_array(fresh.readonly_session(first).store, path="a", mode="r")[:]
    np.testing.assert_array_equal(got, np.repeat(np.array([4, 5], dtype="u1"), CHUNK))
    # The marker is untouched: still version 1, readable by the clients that made it.
    assert storage.get(REPO_KEY)[4] == 1
    report = fresh.fsck(verify_content=True)
    assert report.ok, report.problems


@pytest.mark.parametrize("content_hash", sorted(DIGEST))
def test_dedup_within_a_repository(storage: zarrlake.Storage, content_hash: str) -> None:
    repo = zarrlake.Repository.create(storage, content_hash=content_hash)
    s = repo.writable_session()
    write_blocks(s, [7, 7, 8])
    s.commit("one")
    s = repo.writable_session()
    write_blocks(s, [8, 7], name="b")
    assert len(s._layers[0].dedup_chunks) == 2  # both chunks were already stored
    s.commit("two")
    keys = {o.key for o in storage.list("chunks/")}
    assert keys == {chunk_key(DIGEST[content_hash](block(v))) for v in (7, 8)}


@pytest.mark.parametrize("content_hash", sorted(DIGEST))
def test_fsck_verifies_content_with_the_recorded_hash(tmp_path: Path, content_hash: str) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage, content_hash=content_hash)
    s = repo.writable_session()
    write_blocks(s, [1, 2])
    s.commit("two chunks")
    # Under the other hash, every chunk would be reported; under the recorded one, none.
    assert repo.fsck(verify_content=True).ok

    digest = DIGEST[content_hash](block(2))
    storage.put(chunk_key(digest), block(9))  # same size, other bytes
    assert repo.fsck(sample=0).ok  # presence and size alone cannot tell
    report = zarrlake.Repository.open(storage).fsck(verify_content=True)
    assert [(p.kind, p.key) for p in report.problems] == [("corrupt", chunk_key(digest))]
    assert content_hash in report.problems[0].detail
    # A plain fsck reads a sample of the chunks: here, with two chunks, both.
    sampled = repo.fsck()
    assert [(p.kind, p.key) for p in sampled.problems] == [("corrupt", chunk_key(digest))]
    assert sampled.verified == 2
    url = storage.url
    assert cli_main(["fsck", url, "--sample", "0"]) == 0
    assert cli_main(["fsck", url]) == 1
    assert cli_main(["fsck", url, "--verify-content"]) == 1


def test_forked_and_pickled_sessions_honour_the_setting(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    old_marker(storage)  # SHA-256, the non-default: a copy that forgot it would write BLAKE3
    repo = pickle.loads(pickle.dumps(zarrlake.Repository.open(storage)))
    assert repo.record.content_hash == "sha256"
    s = repo.writable_session()  # a writable session never pickles (its forks do)
    with pytest.raises(zarrlake.WritableSessionPickled):
        pickle.dumps(s)
    write_blocks(s, [0, 0])
    forks = [pickle.loads(pickle.dumps(s.fork())) for _ in range(2)]
    for i, fork in enumerate(forks):
        assert fork.objects.content_hash == "sha256"
        zarr.open_array(fork.store, path="a", mode="r+")[i * CHUNK : (i + 1) * CHUNK] = 10 + i
    s.merge(*(pickle.loads(pickle.dumps(f.changeset())) for f in forks))
    s.commit("forked writes")
    digests = chunk_digests(repo)
    assert sorted(digests.values()) == sorted(DIGEST["sha256"](block(10 + i)) for i in range(2))

    view = pickle.loads(pickle.dumps(repo.readonly_session()))
    assert view.objects.content_hash == "sha256"
    got = zarr.open_array(view.store, path="a", mode="r")[:]
    np.testing.assert_array_equal(got, np.repeat(np.array([10, 11], dtype="u1"), CHUNK))


def test_spark_forks_share_stores_per_hash(tmp_path: Path) -> None:
    # Executors turn a fork's ObjectStore into their process's shared one: the shared store must
    # hash as the fork's repository does, never as a store shared with another repository.
    from zarrlake.forks import dump_fork, load_fork

    old_marker(zarrlake.Storage.local(tmp_path / "sha"))
    for path, name in (("sha", "sha256"), ("b3", "blake3")):
        repo = zarrlake.Repository.open_or_create(zarrlake.Storage.local(tmp_path / path))
        s = repo.writable_session()
        write_blocks(s, [0])
        fork = load_fork(dump_fork(s.fork()))
        assert fork.objects.content_hash == name
        zarr.open_array(fork.store, path="a", mode="r+")[:] = 3
        s.merge(fork.changeset())
        s.commit("from a fork")
        assert list(chunk_digests(repo).values()) == [DIGEST[name](block(3))]


def test_unknown_content_hash_is_refused(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    with pytest.raises(zarrlake.UnknownContentHash, match=r"'md5'.*blake3, sha256") as info:
        zarrlake.Repository.create(storage, content_hash="md5")
    assert isinstance(info.value, ValueError) and info.value.name == "md5"
    assert not zarrlake.Repository.exists(storage)
    assert list(storage.list("")) == []  # nothing written
    # open_or_create refuses it too, whether or not the repository exists yet.
    with pytest.raises(zarrlake.UnknownContentHash):
        zarrlake.Repository.open_or_create(storage, content_hash="md5")
    assert list(storage.list("")) == []
    zarrlake.Repository.create(storage, content_hash="sha256")
    with pytest.raises(zarrlake.UnknownContentHash):
        zarrlake.Repository.open_or_create(storage, content_hash="md5")
    assert zarrlake.Repository.open_or_create(storage).record.content_hash == "sha256"


def test_cli_init_chooses_the_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = (tmp_path / "repo").as_uri()
    assert cli_main(["init", url, "--content-hash", "md5"]) == 2
    assert cli_main(["init", url, "--content-hash", "sha256"]) == 0
    repo = zarrlake.Repository.open(zarrlake.Storage.from_url(url))
    assert repo.record.content_hash == "sha256"
    other = (tmp_path / "other").as_uri()
    assert cli_main(["init", other]) == 0
    assert zarrlake.Repository.open(zarrlake.Storage.from_url(other)).record.content_hash == (
        "blake3"
    )
    capsys.readouterr()


@pytest.mark.parametrize(
    "change",
    [{"features": ("content-hash", "from-the-future")}, {"content_hash": "a-future-hash"}],
)
def test_a_newer_marker_reads_but_refuses_every_write(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    write_blocks(s, [1, 2])
    head = s.commit("before the upgrade")
    repo.create_tag("t", head)
    record = repo.record
    newer = RepoRecord(
        record.id,
        record.created,
        record.config,
        True,
        change.get("content_hash", record.content_hash),
        change.get("features", record.features),
    )
    storage.put(REPO_KEY, newer.encode())  # what a newer zarrlake would have written
    # ... and into the published root, which carries the marker's record.
    root = RootRecord.decode(storage.get(ROOT_KEY))
    changed = root.with_repo(newer)
    assert changed is not None
    storage.put(ROOT_KEY, changed.encode())
    before = sorted(o.key for o in storage.list(""))

    old = zarrlake.Repository.open(storage)  # reads keep working
    got = zarr.open_array(old.readonly_session().store, path="a", mode="r")[:]
    np.testing.assert_array_equal(got, np.repeat(np.array([1, 2], dtype="u1"), CHUNK))
    assert next(c.id for c in old.log()) == head
    writes = [
        old.writable_session,
        lambda: old.create_branch("b"),
        lambda: old.reset_branch("main", head),
        lambda: old.create_tag("t2", head),
        lambda: old.delete_tag("t"),
        lambda: old.merge("t", "main"),
        lambda: old.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1))),
        lambda: old.gc(grace=dt.timedelta(0), force=True),
        lambda: old.compact(),
    ]
    for write in writes:
        with pytest.raises(zarrlake.UnsupportedFormat, match="upgrade zarrlake"):
            write()
    assert sorted(o.key for o in storage.list("")) == before  # nothing written, nothing deleted
    report = old.fsck(verify_content=True)  # an unknown hash is not corruption
    assert all(p.kind == "unsupported" for p in report.problems), report.problems
    assert bool(report.problems) == ("content_hash" in change)
