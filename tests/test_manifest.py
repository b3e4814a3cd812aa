"""Pure tests of manifest shards (``zarrlake.format.manifest``) against a plain-dict model.

Shards live in a dict ``digest -> encoded bytes``; the loader decodes them and counts what it reads,
so the tests can check both the answers and that the O(change) promises hold: untouched shards are
reused by digest and never read, diffs never read shards the two sides share.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import pairwise

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zarrlake.format import manifest as manifest_module
from zarrlake.format import model as model_module
from zarrlake.format.codec import ObjectType, encode
from zarrlake.format.ids import content_hash
from zarrlake.format.manifest import (
    ManifestUpdate,
    apply_changes,
    child_names,
    diff_entries,
    first_at_or_after,
    iter_all,
    iter_prefix,
    iter_subtree,
    lookup,
)
from zarrlake.format.model import (
    INLINE,
    OBJECT,
    ChunkRef,
    ManifestShard,
    PackedEntries,
    ShardInfo,
)

Model = dict[str, ChunkRef]


class ShardStore:
    """Encoded shards by digest, and a loader that counts which shards it was asked for."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.loads: Counter[str] = Counter()

    def add(self, update: ManifestUpdate) -> None:
        for digest, data in update.new_shards.items():
            assert content_hash(data) == digest
            self.blobs[digest] = data

    def load(self, info: ShardInfo) -> ManifestShard:
        self.loads[info.digest] += 1
        return ManifestShard.decode(self.blobs[info.digest], info.digest)

    def reset(self) -> None:
        self.loads.clear()


def subtree(key: str, prefix: str) -> bool:
    """The model's notion of 'inside the subtree prefix' ('' or '/' is everything)."""
    p = prefix.strip("/")
    return not p or key == p or key.startswith(p + "/")


def model_apply(
    model: Model, changes: Mapping[str, ChunkRef | None], deleted: Iterable[str]
) -> Model:
    deleted = list(deleted)
    out = {k: v for k, v in model.items() if not any(subtree(k, p) for p in deleted)}
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def check_manifest(index: list[ShardInfo], store: ShardStore, model: Model, max_refs: int) -> None:
    """The index describes exactly the model, in well-formed, bounded, sorted shards."""
    min_refs = max(1, max_refs // 4)
    entries: list[tuple[str, ChunkRef]] = []
    for info in index:
        assert info.digest in store.blobs, "index refers to a shard that was never written"
        shard = ManifestShard.decode(store.blobs[info.digest])
        assert shard.keys, "empty shard"
        assert shard.keys == sorted(set(shard.keys)), "shard keys not sorted/unique"
        assert (info.first, info.last, info.count) == (
            shard.keys[0],
            shard.keys[-1],
            len(shard.keys),
        )
        assert info.count <= max_refs
        if len(index) > 1:
            # "absorbing a neighbour into one that shrank below a quarter of it"
            assert info.count >= min_refs, f"tiny shard of {info.count} (bound {max_refs})"
        entries.extend(zip(shard.keys, shard.refs, strict=True))
    for a, b in pairwise(index):
        assert a.last < b.first, "shards overlap or are out of order"
    assert entries == sorted(model.items())
    assert list(iter_all(index, store.load)) == sorted(model.items())


def check_update(
    old: list[ShardInfo],
    update: ManifestUpdate,
    store: ShardStore,
    spilled: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Only shards the new index needs are written, and every new shard in the index is written
    (in the update, or already handed to a sink: ``spilled``)."""
    new_digests = {s.digest for s in update.index}
    assert set(update.new_shards) <= new_digests
    assert spilled <= new_digests, "a shard handed to the sink is not in the new index"
    assert not spilled & set(update.new_shards), "a shard would be written twice"
    assert new_digests - {s.digest for s in old} <= set(update.new_shards) | spilled
    # The shards as values are exactly what was encoded (a writer caches them for its next commit).
    assert update.built.keys() == update.new_shards.keys()
    for digest, shard in update.built.items():
        assert shard == ManifestShard.decode(update.new_shards[digest])


# -- strategies ------------------------------------------------------------------------------------

# Few, overlapping segments, so that keys collide, nest, and equal each other's prefixes; '-' sorts
# just before '/', which puts keys like "a-b" between "a" and "a/...".
SEGMENTS = ["a", "a-b", "b", "1"]
keys_st = st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4).map("/".join)
prefixes_st = st.one_of(
    st.just(""), st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3).map("/".join)
)
counter = iter(range(10**9))


def fresh_ref() -> ChunkRef:
    n = next(counter)
    return (INLINE, n.to_bytes(8, "big")) if n % 2 else (OBJECT, n.to_bytes(32, "big"), n)


def draw_commit(data: st.DataObject, model: Model) -> tuple[dict[str, ChunkRef | None], list[str]]:
    """Sets and deletes of random keys (often existing ones), sometimes deleted subtrees."""
    existing = sorted(model)
    known = st.sampled_from(existing) if existing else keys_st
    deleted: list[str] = []
    if data.draw(st.integers(0, 2)) == 0:
        # a subtree root that is often also a key itself (the awkward case for skipping reads)
        deleted = data.draw(
            st.lists(st.one_of(prefixes_st.filter(bool), known), min_size=1, max_size=2)
        )
    if data.draw(st.integers(0, 60)) == 0:
        deleted.append("")  # deleting the root removes everything
    changes: dict[str, ChunkRef | None] = {}
    for _ in range(data.draw(st.integers(0, 4 if deleted else 40))):
        key = data.draw(st.one_of(keys_st, known))
        changes[key] = None if data.draw(st.integers(0, 3)) == 0 else fresh_ref()
    return changes, deleted


HYP = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(params=["splice", "merge"])
def change_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a shard takes its changes: spliced into its sorted lists (few changes), or
    merged through a dict and a sort (many)."""
    if request.param == "merge":
        monkeypatch.setattr(manifest_module, "SPLICE_MAX", 0)
    return str(request.param)


@settings(
    max_examples=60,
    deadline=None,
    # change_path sets a constant for the whole test, the same for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(4, 16), st.integers(1, 8), st.data())
def test_apply_changes_matches_model(
    change_path: str, max_refs: int, steps: int, data: st.DataObject
) -> None:
    store = ShardStore()
    index: list[ShardInfo] = []
    model: Model = {}
    states: list[tuple[list[ShardInfo], Model]] = [(index, model)]
    for _ in range(steps):
        changes, deleted = draw_commit(data, model)
        spilled: set[str] = set()
        sink_batch = data.draw(st.sampled_from([0, 1, 2]))  # 0: no sink

        def sink(
            shards: dict[str, bytes], sink_batch: int = sink_batch, spilled: set[str] = spilled
        ) -> None:
            assert len(shards) == sink_batch
            for digest, blob in shards.items():
                assert content_hash(blob) == digest and digest not in spilled
                store.blobs[digest] = blob
                spilled.add(digest)

        update = apply_changes(
            index,
            changes,
            deleted,
            store.load,
            max_refs,
            sink=sink if sink_batch else None,
            sink_batch=sink_batch,
        )
        check_update(index, update, store, spilled)
        store.add(update)
        model = model_apply(model, changes, deleted)
        index = update.index
        check_manifest(index, store, model, max_refs)
        states.append((index, model))

    # Queries agree with the model on the final manifest ...
    keys = sorted(model)
    probes = [*keys, *data.draw(st.lists(keys_st, max_size=10)), "", "a/", "zzz", "0/1/"]
    for probe in probes:
        assert lookup(index, probe, store.load) == model.get(probe)
        expect_next = next((k for k in keys if k >= probe), None)
        assert first_at_or_after(index, probe, store.load) == expect_next
    for prefix in [*data.draw(st.lists(prefixes_st, max_size=6)), "", "a", "a/", "a-", "1"]:
        assert list(iter_prefix(index, prefix, store.load)) == [
            (k, model[k]) for k in keys if k.startswith(prefix)
        ]
        assert list(iter_subtree(index, prefix, store.load)) == [
            (k, model[k]) for k in keys if subtree(k, prefix)
        ]
        folder = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        expected_children = {
            k[len(folder) :].partition("/")[0] for k in keys if k.startswith(folder)
        }
        got = child_names(index, folder, store.load)
        assert len(got) == len(set(got)), "duplicate child names"
        assert set(got) == expected_children

    # ... and diffs between any two versions equal the model's, without reading shared shards.
    i, j = data.draw(st.integers(0, len(states) - 1)), data.draw(st.integers(0, len(states) - 1))
    (ia, ma), (ib, mb) = states[i], states[j]
    store.reset()
    got_diff = list(diff_entries(ia, ib, store.load))
    expect_diff = [
        (k, ma.get(k), mb.get(k)) for k in sorted(ma.keys() | mb.keys()) if ma.get(k) != mb.get(k)
    ]
    assert got_diff == expect_diff
    common = {s.digest for s in ia} & {s.digest for s in ib}
    assert not common & set(store.loads), "diff read a shard both sides share"
    assert all(n == 1 for n in store.loads.values()), "diff read a shard twice"


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(4, 40), st.integers(1, 10), st.sampled_from([1, 2, 3, 64]), st.data())
def test_shards_a_writer_keeps_encode_as_packing_them_whole_would(
    monkeypatch: pytest.MonkeyPatch, max_refs: int, steps: int, block: int, data: st.DataObject
) -> None:
    # A writer keeps the shards it built (as the client's cache does) and changes them again:
    # those are encoded from blocks re-packed where the changes fall. Every encoding must be
    # byte for byte the plain one (the digest names the bytes), whatever the edits did to the
    # blocks: replaced, inserted, deleted entries, blocks emptied or grown past twice the size.
    monkeypatch.setattr(model_module, "PACK_BLOCK", block)
    store = ShardStore()
    kept: dict[str, ManifestShard] = {}

    def load(info: ShardInfo) -> ManifestShard:
        return kept[info.digest] if info.digest in kept else store.load(info)

    index: list[ShardInfo] = []
    model: Model = {}
    for _ in range(steps):
        changes, deleted = draw_commit(data, model)
        if data.draw(st.booleans()):
            deleted = []  # mostly changes that splice into one shard, the packed path
        update = apply_changes(index, changes, deleted, load, max_refs)
        check_update(index, update, store)
        for digest, shard in update.built.items():
            plain = encode(ObjectType.MANIFEST, {"k": shard.keys, "r": shard.refs})
            assert update.new_shards[digest] == plain
        store.add(update)
        kept.update(update.built)
        model = model_apply(model, changes, deleted)
        index = update.index
        check_manifest(index, store, model, max_refs)


def test_packed_entries_join_into_the_whole_packing() -> None:
    keys = [f"data/c/{i}" for i in range(300)]
    refs: list[ChunkRef] = [fresh_ref() for _ in keys]
    packed = PackedEntries.of(keys, refs)
    assert packed.body() == msgpack.packb({"k": keys, "r": refs}, use_bin_type=True)
    shard = ManifestShard(keys, refs, packed)
    assert shard.encode() == ManifestShard(keys, refs).encode()
    assert shard == ManifestShard.decode(shard.encode())
    # A shard whose packing disagrees with its entries is never written.
    with pytest.raises(AssertionError):
        ManifestShard(keys[:-1], refs[:-1], packed).encode()


def test_a_shard_changed_again_and_again_repacks_only_its_changed_block() -> None:
    store = ShardStore()
    keys = [f"a/c/{i:04d}" for i in range(200)]
    first = apply_changes([], {k: fresh_ref() for k in keys}, [], store.load, 1000)
    store.add(first)
    kept = dict(first.built)
    index = first.index
    for step in range(4):
        update = apply_changes(index, {keys[17]: fresh_ref()}, [], lambda i: kept[i.digest], 1000)
        (shard,) = update.built.values()
        assert shard.built_here
        # The first change packs the shard in blocks; later ones reuse all but one block.
        assert shard.packed is not None
        if step:
            before = kept[index[0].digest].packed
            assert before is not None
            same = [a is b for a, b in zip(before.refs, shard.packed.refs, strict=True)]
            assert same.count(False) == 1 and before.keys == shard.packed.keys
        store.add(update)
        kept.update(update.built)
        index = update.index
    # A shard read from storage (not built here) is packed whole, as it always was.
    decoded = ManifestShard.decode(store.blobs[index[0].digest])
    assert decoded.packed is None and not decoded.built_here
    update = apply_changes(index, {keys[3]: fresh_ref()}, [], lambda i: decoded, 1000)
    assert next(iter(update.built.values())).packed is None


@HYP
@given(st.integers(4, 16), st.sets(keys_st, max_size=60), st.sets(keys_st, max_size=5))
def test_deleting_any_subtree_matches_model(
    max_refs: int, keys: set[str], rewritten: set[str]
) -> None:
    # Every key and every parent path of one, as a deleted subtree of the same manifest, with
    # and without a few writes in the same commit.
    store = ShardStore()
    model = {k: fresh_ref() for k in keys}
    base = apply_changes([], model, [], store.load, max_refs)
    store.add(base)
    roots = {k.rsplit("/", i)[0] for k in keys for i in range(3)} | {"", "a-"}
    writes: dict[str, ChunkRef | None] = {k: fresh_ref() for k in rewritten}
    for root in sorted(roots):
        for changes in ({}, writes):
            update = apply_changes(base.index, changes, [root], store.load, max_refs)
            check_update(base.index, update, store)
            store.add(update)
            check_manifest(update.index, store, model_apply(model, changes, [root]), max_refs)


@HYP
@given(st.integers(4, 16), st.integers(0, 400))
def test_building_from_scratch_respects_bounds(max_refs: int, n: int) -> None:
    store = ShardStore()
    model = {f"arr/c/{i:05d}": fresh_ref() for i in range(n)}
    update = apply_changes([], model, [], store.load, max_refs)
    assert not store.loads, "a new manifest reads nothing"
    store.add(update)
    check_manifest(update.index, store, model, max_refs)


@pytest.mark.parametrize(("max_refs", "n"), [(16, 241), (8, 57), (4, 13), (2048, 2048 * 3 + 1)])
def test_balanced_split_never_leaves_a_tiny_tail(max_refs: int, n: int) -> None:
    # n = k * max_refs + 1 keys: cutting into max_refs-sized pieces would leave one key over.
    store = ShardStore()
    model = {f"k{i:07d}": (INLINE, b"x") for i in range(n)}
    update = apply_changes([], model, [], store.load, max_refs)
    store.add(update)
    check_manifest(update.index, store, model, max_refs)


def test_max_refs_below_four_is_refused() -> None:
    with pytest.raises(ValueError):
        apply_changes([], {"a": (INLINE, b"x")}, [], ShardStore().load, 3)


def test_empty_manifest() -> None:
    store = ShardStore()
    update = apply_changes([], {"a": None}, ["x"], store.load, 8)
    assert update.index == [] and update.new_shards == {}
    assert lookup([], "a", store.load) is None
    assert first_at_or_after([], "", store.load) is None
    assert list(iter_prefix([], "", store.load)) == []
    assert list(iter_subtree([], "", store.load)) == []
    assert child_names([], "", store.load) == []
    assert list(diff_entries([], [], store.load)) == []


# -- O(change) -------------------------------------------------------------------------------------


def big_manifest(n: int = 10_000, max_refs: int = 100) -> tuple[list[ShardInfo], ShardStore, Model]:
    store = ShardStore()
    model: Model = {f"arr{i // 100:03d}/c/{i % 100:03d}": fresh_ref() for i in range(n)}
    update = apply_changes([], model, [], store.load, max_refs)
    store.add(update)
    store.reset()
    return update.index, store, model


@pytest.mark.parametrize(
    "change",
    ["overwrite", "insert", "delete", "insert-before-all", "append-after-all"],
)
def test_one_key_change_rewrites_at_most_two_shards(change: str) -> None:
    max_refs = 100
    index, store, model = big_manifest(max_refs=max_refs)
    keys = sorted(model)
    key = keys[len(keys) // 2 + 17]
    options: dict[str, dict[str, ChunkRef | None]] = {
        "overwrite": {key: fresh_ref()},
        "insert": {key + "0": fresh_ref()},
        "delete": {key: None},
        "insert-before-all": {"a": fresh_ref()},
        "append-after-all": {"zzz/c/0": fresh_ref()},
    }
    changes = options[change]
    update = apply_changes(index, changes, [], store.load, max_refs)
    assert len(update.new_shards) <= 2
    assert sum(store.loads.values()) <= 2, "read more shards than the change touches"
    reused = {s.digest for s in index} & {s.digest for s in update.index}
    assert len(reused) >= len(update.index) - 2
    store.add(update)
    check_manifest(update.index, store, model_apply(model, changes, []), max_refs)

    store.reset()
    diff = list(diff_entries(index, update.index, store.load))
    assert [k for k, _, _ in diff] == sorted(changes)
    assert sum(store.loads.values()) <= 4


def test_many_small_commits_keep_shards_bounded_and_reuse_the_rest() -> None:
    max_refs = 64
    index, store, model = big_manifest(n=5_000, max_refs=max_refs)
    rng = random.Random(7)
    keys = sorted(model)
    for _ in range(300):
        changes: dict[str, ChunkRef | None] = {}
        for _ in range(rng.randint(1, 5)):
            key = rng.choice(keys)
            changes[key if rng.random() < 0.6 else key + "x"] = (
                None if rng.random() < 0.5 else fresh_ref()
            )
        store.reset()
        update = apply_changes(index, changes, [], store.load, max_refs)
        assert len(update.new_shards) <= 2 * len(changes) + 1
        assert sum(store.loads.values()) <= 3 * len(changes) + 1
        store.add(update)
        model = model_apply(model, changes, [])
        index = update.index
    check_manifest(index, store, model, max_refs)


def test_deleting_a_subtree_does_not_read_shards_wholly_inside_it() -> None:
    max_refs = 25  # arrays of 100 keys span several shards
    index, store, model = big_manifest(max_refs=max_refs)
    update = apply_changes(index, {}, ["arr050"], store.load, max_refs)
    assert sum(store.loads.values()) <= 2, "read shards wholly inside the deleted subtree"
    store.add(update)
    check_manifest(update.index, store, model_apply(model, {}, ["arr050"]), max_refs)
    assert lookup(update.index, "arr050/c/000", store.load) is None
    assert lookup(update.index, "arr051/c/000", store.load) == model["arr051/c/000"]


def test_deleted_prefix_spares_keys_that_only_share_a_string_prefix() -> None:
    # "a-b" sorts between "a" and "a/x", so a shard running from "a" to "a/x" is not wholly
    # inside the subtree "a" even though its first and last keys are.
    store = ShardStore()
    max_refs = 4
    model = {k: fresh_ref() for k in ["0", "1", "a", "a-b", "a/x", "b/0", "b/1", "c"]}
    update = apply_changes([], model, [], store.load, max_refs)
    store.add(update)
    for prefix in ["a", "a/", "b", "0"]:
        up = apply_changes(update.index, {}, [prefix], store.load, max_refs)
        store.add(up)
        check_manifest(up.index, store, model_apply(model, {}, [prefix]), max_refs)
    # The shard layout that exposes it, built explicitly: one shard holding a, a-b and a/x.
    index = []
    for keys in (["0", "1"], ["a", "a-b", "a/x"], ["b/0", "b/1", "c"]):
        piece = apply_changes([], {k: model[k] for k in keys}, [], store.load, max_refs)
        store.add(piece)
        index.extend(piece.index)
    up = apply_changes(index, {}, ["a"], store.load, max_refs)
    store.add(up)
    check_manifest(up.index, store, model_apply(model, {}, ["a"]), max_refs)


def test_writes_after_a_deleted_prefix_survive() -> None:
    index, store, model = big_manifest(n=1_000, max_refs=50)
    changes: dict[str, ChunkRef | None] = {"arr003/c/007": fresh_ref(), "arr003/zarr": fresh_ref()}
    update = apply_changes(index, changes, ["arr003"], store.load, 50)
    store.add(update)
    expected = model_apply(model, changes, ["arr003"])
    assert [k for k in expected if k.startswith("arr003")] == ["arr003/c/007", "arr003/zarr"]
    check_manifest(update.index, store, expected, 50)


def test_child_names_skips_subtrees() -> None:
    index, store, _ = big_manifest(max_refs=100)
    names = child_names(index, "", store.load)
    assert sorted(names) == [f"arr{i:03d}" for i in range(100)]
    assert sorted(child_names(index, "arr042/", store.load)) == ["c"]
    store.reset()
    assert sorted(child_names(index, "arr042/c/", store.load)) == [f"{i:03d}" for i in range(100)]
    assert child_names(index, "nothing/", store.load) == []


def test_diff_of_identical_manifests_reads_nothing() -> None:
    index, store, _ = big_manifest()
    assert list(diff_entries(index, index, store.load)) == []
    assert not store.loads
    assert list(diff_entries(index, list(index), store.load)) == []
    assert not store.loads


def test_lookup_outside_every_shard_reads_nothing() -> None:
    index, store, model = big_manifest()
    # before the first key, after the last, and in the gaps between one shard's last key and
    # the next shard's first
    gaps = [a.last + "0" for a in index[:-1]]
    assert all(a.last < g < b.first for a, b, g in zip(index, index[1:], gaps, strict=False))
    for key in ["", "a", "arr", "arr000", "zzz", "arr099/c/0999", *gaps]:
        assert lookup(index, key, store.load) is None
    assert not store.loads
    key = sorted(model)[1234]
    assert lookup(index, key, store.load) == model[key]
    assert sum(store.loads.values()) == 1


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 12), min_size=1, max_size=12),
    max_refs=st.integers(1, 10),
    runs=st.integers(1, 6),
    recut=st.booleans(),
)
def test_runs_cut_in_slices_what_one_rebuild_cuts(
    counts: list[int], max_refs: int, runs: int, recut: bool
) -> None:
    """Compaction's runs (a Spark task each) read slices of a manifest that begin and end inside
    old shards; cutting each slice with its sizes gives, shard for shard, the manifest a re-cut
    in one process gives (or, without re-cut, the same shard boundaries as before)."""
    from zarrlake.maintenance.compact import plan_runs

    store: dict[str, ManifestShard] = {}
    index: list[ShardInfo] = []
    n = 0
    for count in counts:
        keys = [f"a/c/{i:05d}" for i in range(n, n + count)]
        n += count
        shard = ManifestShard(keys, [(OBJECT, bytes([i % 256]) * 32, 100) for i in range(count)])
        data = shard.encode()
        info = ShardInfo(keys[0], keys[-1], content_hash(data), count)
        store[info.digest] = shard
        index.append(info)

    total = sum(counts)
    sizes = manifest_module.balanced_sizes(total, max_refs) if recut else counts
    planned = plan_runs(index, sizes, runs)
    assert 1 <= len(planned) <= runs and [s for r in planned for s in r.sizes] == sizes
    cut_index: list[ShardInfo] = []
    for run in planned:
        keys, refs = [], []
        for info in run.shards:
            keys += store[info.digest].keys
            refs += store[info.digest].refs
        size = sum(run.sizes)
        part, _ = manifest_module.cut(
            keys[run.skip : run.skip + size], refs[run.skip : run.skip + size], run.sizes
        )
        cut_index += part
    if recut:
        whole = manifest_module.rebuild(index, lambda i: store[i.digest], max_refs)
        assert [s.digest for s in cut_index] == [s.digest for s in whole.index]
    else:
        assert cut_index == index
