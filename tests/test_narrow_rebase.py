"""A rebase over many commits asks the manifests before it reads every txlog (issue 45).

A writer that waited for a lock, or lost a few races, is often dozens of commits behind when it
gets to publish. Reading a txlog per commit in between only to learn that none of them touched its
chunk was most of the lock holder's time on S3. The two manifests answer that question for the
chunks a commit writes; where they cannot say "untouched", the txlogs decide, as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zarrlake
from lock_workers import array_doc
from zarrlake.commit import NARROW_MIN_COMMITS
from zarrlake_testkit.counting import CountingStorage, Counts

ARRAY = "a"


def with_attributes(doc: bytes, **attrs: object) -> bytes:
    parsed = json.loads(doc)
    parsed["attributes"] = attrs
    return json.dumps(parsed).encode()


def key(i: int) -> str:
    return f"{ARRAY}/c/{i}"


def value(i: int, round_: int = 0) -> bytes:
    # Above the inline threshold: each chunk is a ref to stored bytes, as in real writes.
    return f"chunk {i} round {round_};".encode() * 40


class Reads:
    """Counts the txlogs a storage is asked for."""

    def __init__(self, storage: zarrlake.Storage) -> None:
        self.keys: list[str] = []
        self._storage = storage
        self._inner = storage.get

        def get(k: str, byte_range: tuple[int, int] | None = None) -> bytes:
            self.keys.append(k)
            return self._inner(k, byte_range)

        storage.get = get  # type: ignore[method-assign]

    @property
    def txlogs(self) -> int:
        return sum(1 for k in self.keys if k.startswith("txlogs/"))

    def close(self) -> None:
        del self._storage.get


def _repo(path: Path, size: int = 64) -> tuple[zarrlake.Storage, zarrlake.Repository]:
    storage = zarrlake.Storage.local(path)
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(size))
    for i in range(0, size, 2):  # every other chunk exists at the base
        s.write(key(i), value(i))
    s.commit("array")
    return storage, repo


def _others_commit(repo: zarrlake.Repository, chunks: list[int], round_: int = 1) -> None:
    for i in chunks:
        s = repo.writable_session("main")
        s.write(key(i), value(i, round_))
        s.commit(f"other {i}")


def test_far_behind_with_nothing_in_common_reads_no_txlog(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late = zarrlake.Repository.open(storage)
    session = late.writable_session("main")
    session.write(key(1), value(1, 9))  # a new chunk
    session.write(key(2), value(2, 9))  # over one that exists at the base
    _others_commit(repo, list(range(10, 30)))
    reads = Reads(storage)
    try:
        session.commit("late")
    finally:
        reads.close()
    assert reads.txlogs == 0, f"{reads.txlogs} txlogs read for a rebase over 20 commits"
    assert late.stats["narrow_rebases"] == 1 and late.stats["rebases"] == 1
    head = zarrlake.Repository.open(storage).readonly_session("main")
    assert head.read(key(1)) == value(1, 9) and head.read(key(2)) == value(2, 9)
    assert all(head.read(key(i)) == value(i, 1) for i in range(10, 30))
    assert [c.message for c in zarrlake.Repository.open(storage).log(limit=2)] == [
        "late",
        "other 29",
    ]


def test_a_chunk_both_wrote_still_conflicts(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late = zarrlake.Repository.open(storage).writable_session("main")
    late.write(key(2), value(2, 9))
    _others_commit(repo, [10, 11, 2, 12, 13, 14])
    head_before = repo.lookup_branch("main")
    with pytest.raises(zarrlake.ConflictError) as err:
        late.commit("late")
    assert any(c.path.lstrip("/") == ARRAY for c in err.value.conflicts)
    assert repo.lookup_branch("main") == head_before  # nothing published


def test_a_chunk_both_created_still_conflicts(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late = zarrlake.Repository.open(storage).writable_session("main")
    late.write(key(5), value(5, 9))  # absent at the base; someone else creates it too
    _others_commit(repo, [10, 11, 12, 5, 13])
    with pytest.raises(zarrlake.ConflictError):
        late.commit("late")


def test_a_solver_that_keeps_their_side_reads_the_txlogs(tmp_path: Path) -> None:
    """With UseTheirs a chunk they wrote and wrote back keeps their bytes: the txlogs say they
    wrote it, the manifests could not (so the narrow rebase is not asked)."""
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.write(key(2), value(2, 9))
    _others_commit(repo, [2], round_=5)
    _others_commit(repo, [10, 11, 12])
    _others_commit(repo, [2], round_=0)  # back to the base's bytes
    late.commit("late", solver=zarrlake.UseTheirs())
    assert late_repo.stats["narrow_rebases"] == 0
    head = zarrlake.Repository.open(storage).readonly_session("main")
    assert head.read(key(2)) == value(2, 0)


def test_a_compaction_in_between_moves_bytes_and_is_no_conflict(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.write(key(4), value(4, 9))  # exists at the base: compaction moves its bytes
    _others_commit(repo, [10, 11, 12])
    compacted = repo.compact(pack_below_bytes=1 << 20)
    assert compacted.packed_chunks >= 32  # the base's chunks, key 4's among them, moved
    _others_commit(repo, [13, 14])
    reads = Reads(storage)
    try:
        late.commit("late")
    finally:
        reads.close()
    # The manifests show the chunk's bytes moved, not changed: no txlog was needed.
    assert late_repo.stats["narrow_rebases"] == 1 and reads.txlogs == 0
    head = zarrlake.Repository.open(storage).readonly_session("main")
    assert head.read(key(4)) == value(4, 9)
    assert head.read(key(0)) == value(0) and head.read(key(12)) == value(12, 1)


def test_a_metadata_change_in_between_is_judged_by_the_txlogs(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.write(key(1), value(1, 9))
    _others_commit(repo, [10, 11])
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", with_attributes(array_doc(64), units="K"))
    s.commit("attributes")
    _others_commit(repo, [12, 13])
    reads = Reads(storage)
    try:
        late.commit("late")
    finally:
        reads.close()
    assert reads.txlogs >= NARROW_MIN_COMMITS and late_repo.stats["narrow_rebases"] == 0
    assert zarrlake.Repository.open(storage).readonly_session("main").read(key(1)) == value(1, 9)


def test_a_resize_of_ours_is_judged_by_the_txlogs(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.write(f"{ARRAY}/zarr.json", array_doc(8))  # shrinks the array others write into
    _others_commit(repo, [10, 11, 12, 13, 14])
    with pytest.raises(zarrlake.ConflictError) as err:
        late.commit("shrink")
    assert any(c.kind == "resized" for c in err.value.conflicts)
    assert late_repo.stats["narrow_rebases"] == 0


def test_a_deleted_subtree_of_ours_is_judged_by_the_txlogs(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.delete_prefix(ARRAY)
    _others_commit(repo, [10, 11, 12, 13, 14])
    with pytest.raises(zarrlake.ConflictError):
        late.commit("delete")
    assert late_repo.stats["narrow_rebases"] == 0


def test_a_short_rebase_reads_the_txlogs(tmp_path: Path) -> None:
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.write(key(1), value(1, 9))
    _others_commit(repo, list(range(10, 10 + NARROW_MIN_COMMITS - 1)))
    late.commit("late")
    assert late_repo.stats["narrow_rebases"] == 0 and late_repo.stats["rebases"] == 1


def test_the_switch_off_reads_the_txlogs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZARRLAKE_NARROW_REBASE", "0")
    storage, repo = _repo(tmp_path / "r")
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    late.write(key(1), value(1, 9))
    _others_commit(repo, list(range(10, 20)))
    reads = Reads(storage)
    try:
        late.commit("late")
    finally:
        reads.close()
    assert reads.txlogs == 10 and late_repo.stats["narrow_rebases"] == 0
    monkeypatch.setenv("ZARRLAKE_NARROW_REBASE", "perhaps")
    with pytest.raises(zarrlake.ZarrlakeError, match="ZARRLAKE_NARROW_REBASE"):
        zarrlake.Repository.open(storage)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    theirs=st.lists(st.integers(0, 15), min_size=NARROW_MIN_COMMITS, max_size=12),
    ours=st.sets(st.integers(0, 15), min_size=1, max_size=4),
)
def test_the_verdict_is_the_txlogs_verdict(
    tmp_path_factory: pytest.TempPathFactory, theirs: list[int], ours: set[int]
) -> None:
    """Whatever others wrote in between (each write new bytes), the late commit conflicts
    exactly when it and they wrote a chunk in common, and otherwise lands with every value."""
    storage, repo = _repo(tmp_path_factory.mktemp("r"), size=16)
    late_repo = zarrlake.Repository.open(storage)
    late = late_repo.writable_session("main")
    for i in ours:
        late.write(key(i), value(i, 99))
    for n, i in enumerate(theirs):
        s = repo.writable_session("main")
        s.write(key(i), value(i, n + 1))
        s.commit(f"other {n}")
    if ours & set(theirs):
        with pytest.raises(zarrlake.ConflictError) as err:
            late.commit("late")
        conflicted = {c.chunk[0] for c in err.value.conflicts if c.kind == "chunk" and c.chunk}
        assert conflicted == ours & set(theirs)
        return
    late.commit("late")
    head = zarrlake.Repository.open(storage).readonly_session("main")
    for i in ours:
        assert head.read(key(i)) == value(i, 99)
    last = {i: n + 1 for n, i in enumerate(theirs)}
    for i, n in last.items():
        assert head.read(key(i)) == value(i, n)


# -- the lock's head hint ------------------------------------------------------------------------


def test_the_lock_holder_reads_the_head_its_predecessor_names(
    moto_s3: Any, redis_server: Any, tmp_path: Path
) -> None:
    """Holding the lock, a writer far behind reads the entry the last holder appended (and finds
    the next absent) in one round: no listing, no reading on entry by entry. A wrong hint costs
    the listing and nothing else."""
    import redis

    counts = Counts(record_keys=True)
    prefix = f"hint-{tmp_path.name}"

    def storage() -> CountingStorage:
        return CountingStorage(moto_s3.storage(prefix), counts)

    lock = zarrlake.RedisLock(redis_server.url)
    repo = zarrlake.Repository.create(storage(), lock=lock)
    s = repo.writable_session("main")
    s.write(f"{ARRAY}/zarr.json", array_doc(64))
    s.commit("array")
    late_repo = zarrlake.Repository.open(storage(), lock=lock)
    late = late_repo.writable_session("main")
    late.write(key(1), value(1, 9))
    _others_commit(repo, list(range(10, 20)))
    counts.reset()
    late.commit("late")
    ops = [op for op, k in counts.calls() if "/refs/branch.main/" in f"/{k}"]
    assert "list" not in ops, counts.calls()
    # The root it had seen was ten commits old: read again beside the commit's writes, so the
    # swap lands at its first try.
    swaps = [op for op, k in counts.calls() if k.endswith("root") and op.startswith("put")]
    assert len(swaps) == 1, counts.calls()
    assert late_repo.stats["narrow_rebases"] == 1

    # A hint that lies, too far ahead or behind: the journal decides, the commit lands.
    client = redis.Redis.from_url(redis_server.url)
    hint = lock._head_key(repo.core.id, "main")
    for n, wrong in enumerate((10_000, 3)):
        client.set(hint, wrong)
        late = late_repo.writable_session("main")
        late.write(key(2 + n), value(2 + n, 9))
        _others_commit(repo, [30 + 10 * n + i for i in range(4)])
        late.commit(f"late {wrong}")
        assert int(client.get(hint) or 0) == repo.core.journal.current("main").seq
    fresh = zarrlake.Repository.open(moto_s3.storage(prefix))
    head = fresh.readonly_session("main")
    assert [head.read(key(i)) for i in (1, 2, 3)] == [value(i, 9) for i in (1, 2, 3)]
    messages = [c.message for c in fresh.log()]
    assert messages[:5] == ["late 3", "other 43", "other 42", "other 41", "other 40"]
    assert {"late", "late 10000"} <= set(messages) and len(messages) == 1 + 1 + 10 + 1 + 8 + 2
