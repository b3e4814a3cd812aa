"""The history index: log() read through history pages answers exactly what a walk of the
snapshots answers — over random histories with branches, merges and expiry, and when pages are
missing or corrupt (fsck reports those) — and GC keeps the pages retained history needs.

Pages are made tiny here (3 records, windows of 2) so that a few dozen commits exercise sealing,
windows, pages naming older pages, and merges.
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Iterator

import hypothesis.strategies as st
import pytest
import zarr
from hypothesis import HealthCheck, given, settings

import zarrlake
from zarrlake.format.model import HistoryIndex, history_page_key, to_micros
from zarrlake.objects import ObjectStore


@pytest.fixture(autouse=True)
def small_pages(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(HistoryIndex, "PAGE", 3)
    monkeypatch.setattr(HistoryIndex, "WINDOW", 2)
    monkeypatch.setattr(HistoryIndex, "FOLD", 3)
    yield


def walked(repo: zarrlake.Repository, head: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The log of ``head`` by reading every snapshot, ignoring every index: the reference."""
    objects = ObjectStore(repo.core.storage, repo.core.record.content_hash)
    expired = repo.core.expiry.expired(refresh=True)
    first = objects.snapshot(head)
    heap, seen, out, truncated = [(-to_micros(first.time), head)], {head}, [], []
    while heap:
        _, sid = heapq.heappop(heap)
        out.append(sid)
        for p in objects.snapshot(sid).parents:
            if p in seen:
                continue
            seen.add(p)
            if p in expired:
                truncated.append((sid, p))
                continue
            heapq.heappush(heap, (-to_micros(objects.snapshot(p).time), p))
    return out, truncated


def indexed(repo: zarrlake.Repository, ref: str) -> tuple[list[str], list[tuple[str, str]]]:
    fresh = zarrlake.Repository.open(repo.core.storage)  # nothing cached
    history = fresh.log(ref)
    return [c.id for c in history], history.truncated


def commit(repo: zarrlake.Repository, branch: str, i: int) -> str:
    session = repo.writable_session(branch)
    zarr.open_array(session.store, path="a")[i % 8] = i + 1
    return session.commit(f"{branch} {i}", metadata={"i": i})


def new_repo() -> zarrlake.Repository:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    session = repo.writable_session("main")
    zarr.create_array(session.store, name="a", shape=(8,), chunks=(1,), dtype="i8", fill_value=0)
    session.commit("create")
    return repo


ops = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), st.sampled_from(["main", "b1", "b2"])),
        st.tuples(st.just("merge"), st.sampled_from(["b1", "b2"])),
        st.tuples(st.just("branch"), st.sampled_from(["b1", "b2"])),
        st.tuples(st.just("expire"), st.integers(1, 12)),
    ),
    min_size=5,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_indexed_log_equals_the_walk_of_snapshots(script: list[tuple[str, object]]) -> None:
    repo = new_repo()
    branches = {"main"}
    for i, (op, arg) in enumerate(script):
        if op == "commit" and arg in branches:
            commit(repo, str(arg), i)
        elif op == "branch" and arg not in branches:
            repo.create_branch(str(arg), "main")
            branches.add(str(arg))
        elif op == "merge" and arg in branches:
            try:
                repo.merge(str(arg), "main", strategy="source-wins")
            except zarrlake.ZarrlakeError:
                pass
        elif op == "expire":
            repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=int(str(arg)))))
    for branch in sorted(branches):
        head = repo.lookup_branch(branch)
        assert indexed(repo, branch) == walked(repo, head)
        for limit in (1, 5):
            assert [c.id for c in repo.log(branch, limit=limit)] == walked(repo, head)[0][:limit]


def test_a_missing_or_corrupt_page_gives_the_same_log_and_fsck_reports_it() -> None:
    repo = new_repo()
    for i in range(20):
        commit(repo, "main", i)
    repo.create_branch("side", "main")
    for i in range(5):
        commit(repo, "side", 100 + i)
        commit(repo, "main", 200 + i)
    repo.merge("side", "main", strategy="source-wins")
    commit(repo, "main", 300)
    head = repo.lookup_branch("main")
    expected = walked(repo, head)
    assert indexed(repo, "main") == expected
    assert repo.fsck().ok
    storage = repo.core.storage
    assert len(list(storage.list_keys("history/"))) >= 4
    index = repo.core.objects.snapshot(head).index
    assert index is not None and len(index.pages) >= 2
    # Two pages the head names (so fsck must reach them): one gone, one garbage.
    gone, bad = (f"history/{d}" for d in index.pages[:2])
    storage.delete_many([gone])
    storage.put(bad, b"not a page")
    repo = zarrlake.Repository.open(storage)  # no page left in a cache
    assert indexed(repo, "main") == expected
    problems = {(p.kind, p.key) for p in repo.fsck().problems}
    assert ("missing", gone) in problems
    assert ("corrupt", bad) in problems
    assert all(key.startswith("history/") for _, key in problems)


def test_gc_keeps_the_pages_retained_history_names_and_sweeps_expired_ones() -> None:
    repo = new_repo()
    for i in range(30):
        commit(repo, "main", i)
    head = repo.lookup_branch("main")
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=8)))
    expected = walked(repo, head)
    assert expected[1]  # truncated
    before = set(repo.core.storage.list_keys("history/"))
    report = repo.gc(grace=dt.timedelta(0), force=True)
    after = set(repo.core.storage.list_keys("history/"))
    assert report.by_kind["history"].deleted == len(before - after) > 0
    snap = repo.core.objects.snapshot(head)
    assert snap.index is not None
    assert {history_page_key(d) for d in snap.index.pages} <= after
    assert indexed(repo, "main") == expected
    assert repo.fsck().ok


def test_losing_every_page_of_early_history_still_reads_and_later_pages_build_on_it() -> None:
    repo = new_repo()
    for i in range(10):
        commit(repo, "main", i)
    storage = repo.core.storage
    storage.delete_many(storage.list_keys("history/"))
    for i in range(10, 20):
        commit(repo, "main", i)
    head = repo.lookup_branch("main")
    assert indexed(repo, "main") == walked(repo, head)


def test_seals_fold_the_newest_page_in_up_to_fold_pages_of_records() -> None:
    # PAGE 3, FOLD 3 (the fixture): a seal every 3 commits folds the newest page in while the
    # two hold at most 9 records, so a long line of commits is named by pages of 7 to 9 records
    # (not 3): a log reads a third of the pages.
    repo = new_repo()
    for i in range(40):
        commit(repo, "main", i)
    head = repo.lookup_branch("main")
    objects = ObjectStore(repo.core.storage, repo.core.record.content_hash)
    index = objects.snapshot(head).index
    assert index is not None
    sizes, todo = [], list(index.pages)
    while todo:
        page = objects.history_page(todo.pop(0))
        sizes.append(len(page.ids))
        todo = todo or list(page.older)  # the window ends: follow the oldest page's link
    assert all(s <= HistoryIndex.PAGE * HistoryIndex.FOLD for s in sizes), sizes
    assert sum(s > HistoryIndex.PAGE for s in sizes) >= 3, sizes
    assert sum(sizes) >= 40 - HistoryIndex.PAGE  # every commit but the open ones is in a page
    assert indexed(repo, "main") == walked(repo, head)


def test_a_seal_whose_newest_page_is_unreadable_seals_its_records_alone() -> None:
    repo = new_repo()
    for i in range(7):
        commit(repo, "main", i)
    storage = repo.core.storage
    index = repo.core.objects.snapshot(repo.lookup_branch("main")).index
    assert index is not None and index.pages
    storage.put(history_page_key(index.pages[0]), b"garbage")
    fresh = zarrlake.Repository.open(storage)  # no page in a cache
    for i in range(7, 14):
        commit(fresh, "main", i)
    head = fresh.lookup_branch("main")
    assert indexed(fresh, "main") == walked(fresh, head)
    problems = {(p.kind, p.key) for p in fresh.fsck().problems}
    assert problems == {("corrupt", history_page_key(index.pages[0]))}


def test_an_index_naming_no_object_is_not_trusted_and_never_becomes_a_path() -> None:
    # Digests are object names: one that is not 64 hex digits (a path, say) must never reach the
    # storage. In a snapshot the index is dropped (the snapshot reads, log() walks); a page that
    # names one is corrupt (log() falls back to the snapshots).
    import dataclasses

    from zarrlake.errors import CorruptObject
    from zarrlake.format.model import HistoryPage, Snapshot

    repo = new_repo()
    for i in range(8):
        commit(repo, "main", i)
    head = repo.lookup_branch("main")
    snap = repo.core.objects.snapshot(head)
    assert snap.index is not None
    bad = dataclasses.replace(snap, index=HistoryIndex(0, ("../../refs/branch.main",)))
    assert Snapshot.decode(bad.encode()).index is None
    page = HistoryPage((), (), ("../x",)).encode()
    with pytest.raises(CorruptObject, match="not a content digest"):
        HistoryPage.decode(page)
    # Stored under its own digest, it is still refused as corrupt (which log() falls back from).
    from zarrlake.format.ids import content_hash

    digest = content_hash(page)
    repo.core.storage.put(history_page_key(digest), page)
    with pytest.raises(CorruptObject, match="not a content digest"):
        repo.core.objects.history_page(digest)


def test_records_read_from_pages_are_whole_commit_infos_like_the_snapshots_own() -> None:
    # log() builds its records from history pages in one step each (not through the dataclass's
    # __init__): every field must equal what the snapshot itself says, and the objects must
    # behave as any CommitInfo (frozen, equal, picklable), with metadata of their own.
    import dataclasses
    import pickle

    from zarrlake.history import commit_info

    repo = new_repo()
    for i in range(12):
        commit(repo, "main", i)
    fresh = zarrlake.Repository.open(repo.core.storage)
    logged = list(fresh.log("main"))
    objects = ObjectStore(repo.core.storage, repo.core.record.content_hash)
    assert logged == [commit_info(objects.snapshot(c.id)) for c in logged]
    for info in logged:
        assert type(info) is zarrlake.CommitInfo
        assert pickle.loads(pickle.dumps(info)) == info
        assert repr(info) == repr(dataclasses.replace(info))
        assert info.time.tzinfo is dt.UTC
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.message = "changed"  # type: ignore[misc]
    assert logged[0].metadata == {"i": 11}
    # The records stay cached with their pages: changing what log() returned changes nothing.
    for info in logged:
        info.metadata["x"] = 1
    again = list(fresh.log("main"))
    assert [c.metadata for c in again] == [
        commit_info(objects.snapshot(c.id)).metadata for c in again
    ]
    assert all("x" not in c.metadata for c in again)


_ids = st.text("0123456789ABCDEFGHJKMNPQRSTVWXYZ", min_size=26, max_size=26)
_records = st.lists(
    st.tuples(
        _ids,
        st.lists(_ids, max_size=3),
        # Times on both sides of the fast path's bound (the year 2242) and before the epoch.
        st.integers(min_value=-(2**55), max_value=2**57) | st.integers(-(2**33), 2**34),
        st.none() | st.text(max_size=8),
        st.text(max_size=8),
        st.dictionaries(
            st.text(max_size=4), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=4), max_size=2
        ),
    ),
    max_size=12,
    unique_by=lambda r: r[0],
)


@given(_records, st.sets(_ids, max_size=3))
@settings(max_examples=200, deadline=None)
def test_decoding_a_page_into_records_equals_decoding_it_and_adding_its_records(
    records: list[tuple[str, list[str], int, str | None, str, dict[str, object]]],
    known_ids: set[str],
) -> None:
    # log() decodes pages straight into CommitInfos (HistoryPage.decode_into); the page's own
    # decoder and the walk's _add must give exactly the same records, times included.
    from zarrlake.format.model import AncestorRecord, HistoryPage, from_micros
    from zarrlake.history import CommitInfo, CommitRecords

    page = HistoryPage(
        ids=tuple(r[0] for r in records),
        records=tuple(
            AncestorRecord(tuple(p), from_micros(us), author, message, meta)
            for _, p, us, author, message, meta in records
        ),
        older=("a" * 64,),
    )
    data = page.encode()
    sentinel = CommitInfo("x", (), "kept", None, from_micros(0), {})
    into: dict[str, CommitInfo] = {k: sentinel for k in known_ids}
    older = HistoryPage.decode_into(data, CommitInfo, into)
    assert older == ("a" * 64,)
    walk = CommitRecords.__new__(CommitRecords)
    walk.known = {k: sentinel for k in known_ids}
    decoded = HistoryPage.decode(data)
    walk._add(decoded.ids, decoded.records)
    assert into == walk.known
    assert all(type(v) is CommitInfo for v in into.values())
    assert [into[i].time for i in page.ids if i not in known_ids] == [
        r.time for i, r in zip(page.ids, page.records, strict=True) if i not in known_ids
    ]


def test_a_commit_whose_time_is_made_when_asked_is_any_other_commit() -> None:
    # decode_into leaves each record's time as microseconds until it is asked for: the commit
    # must compare, print, pickle, copy and convert as one made with its time.
    import dataclasses
    import pickle

    from zarrlake.format.model import AncestorRecord, HistoryPage, from_micros
    from zarrlake.history import CommitInfo

    times = [1_764_000_000_123_456, 0, 2**33 * 10**6 + 7]  # fast range, epoch, beyond 2242
    ids = tuple(c * 26 for c in "ABC")
    records = tuple(AncestorRecord((), from_micros(us), "ann", "m", {"k": 1}) for us in times)
    known: dict[str, CommitInfo] = {}
    HistoryPage.decode_into(HistoryPage(ids, records, ()).encode(), CommitInfo, known)
    for sid, record in zip(ids, records, strict=True):
        made = CommitInfo(sid, (), "m", "ann", record.time, {"k": 1})
        lazy = known[sid]
        assert pickle.loads(pickle.dumps(lazy)) == made  # its time not asked for yet
        assert dataclasses.asdict(lazy) == dataclasses.asdict(made)
        assert lazy == made and repr(lazy) == repr(made)
        assert dataclasses.replace(lazy, message="n").time == record.time
        assert lazy.time is lazy.time  # made once
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        known[ids[0]].nope  # noqa: B018 - the lookup is the test


def test_a_corrupt_page_decoded_into_records_leaves_them_as_they_were() -> None:
    from zarrlake.format.model import AncestorRecord, HistoryPage, from_micros
    from zarrlake.history import CommitInfo

    good = AncestorRecord((), from_micros(1), None, "m", {})
    data = HistoryPage(ids=("A" * 26, "B" * 26), records=(good, good), older=()).encode()
    bad = data.replace(b"\xa1m", b"\x01\x02")  # the message "m" becomes two ints
    known: dict[str, CommitInfo] = {}
    with pytest.raises(zarrlake.CorruptObject):
        HistoryPage.decode_into(bad, CommitInfo, known)
    assert known == {}
