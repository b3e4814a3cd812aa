"""``ChunkChanges``, the compact mapping of a session's chunk changes, against a plain dict.

A Hypothesis state machine drives a few ChunkChanges (the first one, its copies, its pickled round
trips) next to a dict each, with :data:`ChunkChanges.FREEZE_AT` set very small so that freezing
into runs, the binary-counter merges, removals inside runs and keys shadowed across runs happen at
almost every step. Keys come from a small alphabet (collisions are frequent), are prefixes of each
other, hold non-ASCII characters (sort order must be Python's ``str`` order) and sometimes NUL
(never frozen, but must behave the same). Values are every kind of ref: compact objects, object
refs that are not compact (20-byte digest, size 2**63, ...), inline, packed, and None (a deleted
chunk, which is a value, unlike an absent key).

Walks (``len``, iteration, the sorted walks a commit takes) merge the runs as they go and leave
them as they are; pickling settles them into one, so the invariants run the checks on a ``copy()``
and keep the original's runs as the rules left them; a rule (``observe``) runs them on the
original too. Merges and walks work in blocks, and large arrays live in memory mappings of their
own: the machine makes both tiny, so block edges and mapped arrays (deletions flip their
liveness in place) are met at every size.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from zarrlake.format import changes as changes_module
from zarrlake.format.changes import ChunkChanges, count_refs, sorted_changes
from zarrlake.format.model import INLINE, OBJECT, PACKED, VIRTUAL

Ref = tuple[Any, ...] | None

# -- keys ----------------------------------------------------------------------------------------

FIXED_KEYS = [
    "a",
    "a/b",
    "a/b/c",
    "a/b/c/d",
    "a/",
    "ab",
    "a0",
    "b",
    "é",
    "é/b",
    "e\u0301",
    "\u00ff",
    "\u0100",
    "\uffff",
    "\U0001d11e",
    "\U0001d11e/a",
    "\x7f",
    "\u0080",
    "data/c/1",
    "data/c/12",
    "data/c/123456",
    "data/c/1234567",
    "x" * 39,
    "x" * 40,
    "x" * 39 + "é",
    # Never frozen: NUL anywhere, trailing (which numpy's fixed-width bytes would drop) too.
    "\x00",
    "\x00\x00",
    "a\x00",
    "a\x00b",
    "a/b\x00",
    "data/c/1\x00",
]
PREFIXES = ["", "a", "a/b", "data/c/", "é", "\U0001d11e", "x" * 37]
ALPHABET = "a/0é\u0080\U0001d11e"

keys = st.one_of(
    st.sampled_from(FIXED_KEYS),
    st.builds(
        str.__add__, st.sampled_from(PREFIXES), st.text(alphabet=ALPHABET, max_size=3)
    ).filter(lambda k: 1 <= len(k) <= 40),
    st.builds(
        lambda p, s: (p + "\x00" + s)[:40],
        st.sampled_from(PREFIXES[:4]),
        st.text(alphabet=ALPHABET, max_size=1),
    ),
)

# -- values --------------------------------------------------------------------------------------

digests = st.one_of(
    st.binary(min_size=32, max_size=32),
    st.sampled_from([bytes(32), b"\xff" * 32, bytes(range(32))]),
)
sizes = st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 1, 2**31, 2**63 - 1]))
compact_refs = st.tuples(st.just(OBJECT), digests, sizes)
# OBJECT-like refs that do not fit a run's columns: kept as Python objects, returned as given.
odd_object_refs = st.one_of(
    st.tuples(st.just(OBJECT), st.binary(min_size=20, max_size=20), sizes),
    st.tuples(st.just(OBJECT), st.binary(min_size=0, max_size=33).filter(lambda b: len(b) != 32)),
    st.tuples(st.just(OBJECT), digests, st.sampled_from([2**63, 2**64, -1, -(2**63)])),
    st.tuples(st.just(OBJECT), digests, sizes, st.just("extra")),
)
inline_refs = st.tuples(st.just(INLINE), st.binary(max_size=40))
packed_refs = st.one_of(
    st.tuples(st.just(PACKED), st.text(max_size=8), st.integers(0, 2**40), st.integers(0, 2**40)),
    st.tuples(
        st.just(PACKED),
        st.text(max_size=8),
        st.integers(0, 2**40),
        st.integers(0, 2**40),
        st.binary(min_size=32, max_size=32),
    ),
)
# What a session's pack writer and compaction make (a 64-hex-digit pack id; those ending in zero
# bytes too): held in a run's columns, returned equal. Near misses stay Python objects.
pack_ids = st.one_of(
    st.binary(min_size=32, max_size=32).map(bytes.hex),
    st.sampled_from(["0" * 64, "f" * 64, "ab" * 31 + "00", "00" + "cd" * 31]),
)
offsets = st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1]))
compact_packed_refs = st.tuples(st.just(PACKED), pack_ids, offsets, offsets, digests)
odd_packed_refs = st.one_of(
    st.tuples(st.just(PACKED), pack_ids.map(str.upper), offsets, offsets, digests),
    st.tuples(st.just(PACKED), pack_ids.map(lambda p: p[1:]), offsets, offsets, digests),
    st.tuples(st.just(PACKED), pack_ids, st.just(2**63), offsets, digests),
    st.tuples(st.just(PACKED), pack_ids, offsets, st.just(-1), digests),
    st.tuples(st.just(PACKED), pack_ids, offsets, offsets, st.binary(max_size=31)),
    st.tuples(st.just(PACKED), pack_ids, offsets, offsets, digests, st.just("extra")),
)
# Virtual refs: a few files (so that runs share sources), pinned by ETag, time, both or neither.
urls = st.sampled_from(["s3://b/a.nc", "file:///x/b.nc", "https://h/\u00e9.nc", "s3://b/a.nc\x00"])
etags = st.one_of(st.none(), st.sampled_from(['"abc"', "1700000000", ""]))
modifieds = st.one_of(st.none(), st.sampled_from([0, -1, 1_700_000_000_000_000, 2**63 - 1]))
lengths = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 2**32 - 1]))
compact_virtual_refs = st.tuples(st.just(VIRTUAL), urls, offsets, lengths, etags, modifieds)
odd_virtual_refs = st.one_of(
    st.tuples(st.just(VIRTUAL), urls, offsets, st.just(2**32), etags, modifieds),
    st.tuples(st.just(VIRTUAL), urls, st.just(-1), lengths, etags, modifieds),
    st.tuples(st.just(VIRTUAL), urls, offsets, lengths, st.just(7), modifieds),
    st.tuples(st.just(VIRTUAL), urls, offsets, lengths, etags),
)
values: st.SearchStrategy[Ref] = st.one_of(
    compact_virtual_refs,
    compact_virtual_refs,
    odd_virtual_refs,
    st.none(),
    compact_refs,
    compact_refs,
    odd_object_refs,
    inline_refs,
    packed_refs,
    compact_packed_refs,
    compact_packed_refs,
    odd_packed_refs,
)
items = st.lists(st.tuples(keys, values), max_size=12)

# -- helpers -------------------------------------------------------------------------------------

MISSING = object()


def same(got: object, expected: object) -> bool:
    """Equal, and of the same types down to the tuple's fields (no numpy scalar leaks out)."""
    if got != expected or type(got) is not type(expected):
        return False
    if isinstance(got, tuple):
        assert isinstance(expected, tuple)
        return all(type(a) is type(b) for a, b in zip(got, expected, strict=True))
    return True


def check_lookups(cc: ChunkChanges, model: dict[str, Ref], probes: list[str]) -> None:
    """What does not walk the mapping (nor settle its runs): ``in``, ``[]``, ``get``, ``bool``."""
    assert bool(cc) == bool(model)
    for key in probes:
        assert (key in cc) == (key in model), key
        expected = model.get(key, MISSING)
        got = cc.get(key, MISSING)
        assert same(got, expected), (key, got, expected)
        if expected is MISSING:
            with pytest.raises(KeyError):
                cc[key]
            assert cc.get(key) is None
        else:
            assert same(cc[key], expected)
    not_a_str: object = 3
    assert not_a_str not in cc  # absent, no error


def check_walks(cc: ChunkChanges, model: dict[str, Ref]) -> None:
    """Everything that walks the mapping."""
    assert len(cc) == len(model)
    listed = list(cc.items())
    assert len(listed) == len(model)  # no key twice
    assert dict(listed) == model
    for key, value in listed:
        assert same(value, model[key])
    assert Counter(cc.values()) == Counter(model.values())
    assert sorted(cc) == sorted(model)
    assert len(list(cc.keys())) == len(model)
    walked = list(cc.sorted_items())
    assert walked == sorted(model.items())
    assert [k for k, _ in walked] == sorted(model)  # Python's str order, by code point
    assert list(sorted_changes(cc)) == list(sorted_changes(model)) == walked
    keys = cc.sorted_keys()  # what a txlog encodes: a view merged as it is read
    assert list(changes_module.sorted_keys(model)) == sorted(model)  # a plain mapping too
    assert len(keys) == len(model) and list(keys) == sorted(model)
    if model:
        assert keys[0] == min(model) and keys[-1] == max(model)
        assert list(keys[1:3]) == sorted(model)[1:3]
    assert cc.count_refs() == count_refs(model) == sum(v is not None for v in model.values())
    assert cc == model
    assert model == cc
    assert dict(cc) == model
    assert repr(cc).startswith("ChunkChanges(")


@dataclass
class Pair:
    cc: ChunkChanges
    model: dict[str, Ref]


class ChunkChangesMachine(RuleBasedStateMachine):
    MAX_PAIRS = 4

    def __init__(self) -> None:
        super().__init__()
        self.saved_freeze_at = ChunkChanges.FREEZE_AT
        self.saved_block = changes_module._BLOCK
        self.saved_own_mapping = changes_module._OWN_MAPPING
        self.pairs: list[Pair] = []
        self.seen: set[str] = set(FIXED_KEYS[:6])

    def teardown(self) -> None:
        ChunkChanges.FREEZE_AT = self.saved_freeze_at
        changes_module._BLOCK = self.saved_block
        changes_module._OWN_MAPPING = self.saved_own_mapping

    def pair(self, i: int) -> Pair:
        return self.pairs[i % len(self.pairs)]

    def add(self, pair: Pair, slot: int) -> None:
        if len(self.pairs) < self.MAX_PAIRS:
            self.pairs.append(pair)
        else:
            self.pairs[slot % len(self.pairs)] = pair

    def saw(self, *new: str) -> None:
        self.seen.update(new)

    @initialize(
        freeze_at=st.sampled_from([1, 2, 3, 4, 8]),
        block=st.sampled_from([1, 2, 5]),
        own_mapping=st.sampled_from([1, 1 << 18]),
        start=items,
    )
    def start(
        self, freeze_at: int, block: int, own_mapping: int, start: list[tuple[str, Ref]]
    ) -> None:
        ChunkChanges.FREEZE_AT = freeze_at
        # Merges and walks work a block at a time: blocks of a few entries cross their edges.
        changes_module._BLOCK = block
        # 1: every merged array in a mapping of its own.
        changes_module._OWN_MAPPING = own_mapping
        initial = dict(start)
        self.saw(*initial)
        self.pairs.append(Pair(ChunkChanges(initial), dict(initial)))

    # -- rules: the mapping --------------------------------------------------------------------

    @rule(i=st.integers(0, 3), key=keys, value=values)
    def set(self, i: int, key: str, value: Ref) -> None:
        p = self.pair(i)
        p.cc[key] = value
        p.model[key] = value
        self.saw(key)

    @rule(i=st.integers(0, 3), changes=items)
    def set_many(self, i: int, changes: list[tuple[str, Ref]]) -> None:
        p = self.pair(i)
        for key, value in changes:
            p.cc[key] = value
            p.model[key] = value
            self.saw(key)

    @rule(i=st.integers(0, 3), key=keys)
    def delete(self, i: int, key: str) -> None:
        p = self.pair(i)
        self.saw(key)
        if key in p.model:
            del p.model[key]
            del p.cc[key]
        else:
            with pytest.raises(KeyError):
                del p.cc[key]

    @rule(i=st.integers(0, 3), pick=st.integers(0, 2**16))
    def delete_present(self, i: int, pick: int) -> None:
        """Deletes hit keys that are present far more often than a random key would."""
        p = self.pair(i)
        if p.model:
            key = sorted(p.model)[pick % len(p.model)]
            del p.model[key]
            del p.cc[key]

    @rule(i=st.integers(0, 3), key=keys, default=st.sampled_from([None, MISSING, "dflt"]))
    def pop(self, i: int, key: str, default: object) -> None:
        p = self.pair(i)
        self.saw(key)
        if default is MISSING:
            if key in p.model:
                assert same(p.cc.pop(key), p.model.pop(key))
            else:
                with pytest.raises(KeyError):
                    p.cc.pop(key)
        else:
            assert same(p.cc.pop(key, default), p.model.pop(key, default))

    @rule(i=st.integers(0, 3), key=keys, value=values)
    def setdefault(self, i: int, key: str, value: Ref) -> None:
        p = self.pair(i)
        self.saw(key)
        assert same(p.cc.setdefault(key, value), p.model.setdefault(key, value))

    @rule(i=st.integers(0, 3))
    def popitem(self, i: int) -> None:
        p = self.pair(i)
        if not p.model:
            with pytest.raises(KeyError):
                p.cc.popitem()
            return
        key, value = p.cc.popitem()
        assert same(value, p.model.pop(key))

    @rule(i=st.integers(0, 3), changes=items)
    def update_from_dict(self, i: int, changes: list[tuple[str, Ref]]) -> None:
        p = self.pair(i)
        other = dict(changes)
        p.cc.update(other)
        p.model.update(other)
        self.saw(*other)

    @rule(i=st.integers(0, 3), changes=items)
    def update_from_pairs(self, i: int, changes: list[tuple[str, Ref]]) -> None:
        p = self.pair(i)
        p.cc.update(changes)
        p.model.update(changes)
        self.saw(*(k for k, _ in changes))

    @rule(i=st.integers(0, 3), j=st.integers(0, 3))
    def update_from_other(self, i: int, j: int) -> None:
        p, q = self.pair(i), self.pair(j)  # possibly the same one
        before = dict(q.model)
        p.cc.update(q.cc)
        p.model.update(before)
        if p is not q:
            assert q.model == before

    @rule(i=st.integers(0, 3), changes=items)
    def update_from_new(self, i: int, changes: list[tuple[str, Ref]]) -> None:
        """From a ChunkChanges built here (runs of its own, keys that overlap)."""
        p = self.pair(i)
        other = ChunkChanges()
        for key, value in changes:
            other[key] = value
        p.cc.update(other)
        p.model.update(dict(changes))
        self.saw(*(k for k, _ in changes))

    @rule(i=st.integers(0, 3), changes=items)
    def absorb_new(self, i: int, changes: list[tuple[str, Ref]]) -> None:
        """Staged apart, then taken over whole (how set_virtual_refs lands a batch): as update
        from it, and the staged one left empty."""
        p = self.pair(i)
        other = ChunkChanges()
        for key, value in changes:
            other[key] = value
        p.cc.absorb(other)
        p.model.update(dict(changes))
        assert not other and len(other) == 0
        self.saw(*(k for k, _ in changes))

    @precondition(lambda self: sum(len(p.model) for p in self.pairs) > 30)
    @rule(i=st.integers(0, 3))
    def clear(self, i: int) -> None:
        p = self.pair(i)
        p.cc.clear()
        p.model.clear()

    # -- rules: copies, pickles, new mappings ----------------------------------------------------

    @rule(i=st.integers(0, 3), slot=st.integers(0, 3))
    def copy(self, i: int, slot: int) -> None:
        p = self.pair(i)
        copied = p.cc.copy()
        assert type(copied) is ChunkChanges
        # The copy and the original evolve independently: the invariants check every pair.
        self.add(Pair(copied, dict(p.model)), slot)

    @rule(
        i=st.integers(0, 3),
        slot=st.integers(0, 3),
        protocol=st.integers(2, pickle.HIGHEST_PROTOCOL),
        keep=st.booleans(),
    )
    def pickle_round_trip(self, i: int, slot: int, protocol: int, keep: bool) -> None:
        p = self.pair(i)
        loaded = pickle.loads(pickle.dumps(p.cc, protocol=protocol))
        assert type(loaded) is ChunkChanges
        if keep:  # both live on, independently
            self.add(Pair(loaded, dict(p.model)), slot)
        else:
            p.cc = loaded

    @rule(slot=st.integers(0, 3), start=items)
    def construct(self, slot: int, start: list[tuple[str, Ref]]) -> None:
        initial = dict(start)
        self.saw(*initial)
        self.add(Pair(ChunkChanges(initial), initial.copy()), slot)

    @rule(i=st.integers(0, 3))
    def observe(self, i: int) -> None:
        """The walks on the original itself (they settle its runs)."""
        p = self.pair(i)
        check_walks(p.cc, p.model)

    # -- invariants ----------------------------------------------------------------------------

    def probes(self) -> Iterator[str]:
        # Every key a rule named (present, absent, removed from a run), and each one longer by a
        # character (a truncated match must not find it); shorter ones are mostly named already.
        for key in self.seen:
            yield key
            yield key + "0"

    @invariant()
    def lookups_match(self) -> None:
        probes = sorted(set(self.probes()))
        for p in self.pairs:
            check_lookups(p.cc, p.model, probes)

    @invariant()
    def walks_match(self) -> None:
        for p in self.pairs:
            check_walks(p.cc.copy(), p.model)


TestChunkChangesMachine = ChunkChangesMachine.TestCase
TestChunkChangesMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


# -- plain tests ---------------------------------------------------------------------------------


def obj(n: int, size: int = 1) -> tuple[int, bytes, int]:
    return (OBJECT, n.to_bytes(32, "big"), size)


@pytest.fixture
def small_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 2)


@pytest.mark.usefixtures("small_runs")
def test_a_longer_key_is_not_found_by_a_truncated_match() -> None:
    cc = ChunkChanges()
    cc["data/c/123456"] = obj(1)
    cc["data/c/1"] = obj(2)  # frozen with the one above: a run of width 13
    for absent in ["data/c/1234567", "data/c/12345", "data/c/123456/0", "data/c/12"]:
        assert absent not in cc
        assert cc.get(absent, "absent") == "absent"
        with pytest.raises(KeyError):
            cc[absent]
        with pytest.raises(KeyError):
            del cc[absent]
        assert cc.pop(absent, None) is None
    assert cc["data/c/123456"] == obj(1)
    assert cc == {"data/c/123456": obj(1), "data/c/1": obj(2)}


def mirrored() -> tuple[ChunkChanges, dict[str, Ref], Callable[[str, Ref], None]]:
    """A ChunkChanges, its dict model, and a ``put`` that writes to both."""
    cc = ChunkChanges()
    model: dict[str, Ref] = {}

    def put(key: str, value: Ref) -> None:
        cc[key] = value
        model[key] = value

    return cc, model, put


@pytest.mark.usefixtures("small_runs")
def test_keys_of_different_lengths_across_runs_merge() -> None:
    cc, model, put = mirrored()
    # Runs of short keys, then of long ones that extend them, then short again on top.
    put("a", obj(1))
    put("b", None)
    put("a/b/c/d/e/f", obj(2))
    put("a/b", (INLINE, b"x"))
    put("a" * 30, obj(3, 2**63 - 1))
    put("é" * 10, (PACKED, "p", 0, 5))
    put("a", obj(4))  # shadows the first run's "a"
    put("a/b/c/d/e/f", None)  # and the second run's
    assert dict(cc.items()) == model
    del cc["a/b"]
    del model["a/b"]
    assert "a/b" not in cc
    assert "a/b/c/d/e/f" in cc and cc["a/b/c/d/e/f"] is None
    assert list(cc.sorted_items()) == sorted(model.items())
    assert len(cc) == len(model)
    assert cc == model
    put("a/b", obj(5))
    put("a/b/c", obj(6))
    assert list(cc.sorted_items()) == sorted(model.items())
    assert pickle.loads(pickle.dumps(cc)) == model


@pytest.mark.usefixtures("small_runs")
def test_a_key_in_two_runs_is_removed_from_both() -> None:
    cc, model, put = mirrored()
    for i in range(8):
        put(f"k{i}", obj(i))
    put("k0", obj(100))
    put("z", obj(101))
    put("k0", obj(200))
    put("y", None)  # now "k0" sits in an old run (100) and in a newer one (200)
    assert cc["k0"] == obj(200)
    del cc["k0"]
    del model["k0"]
    assert "k0" not in cc
    assert cc.get("k0", "absent") == "absent"
    with pytest.raises(KeyError):
        del cc["k0"]
    assert cc == model
    put("k0", obj(300))
    put("k9", (INLINE, b""))
    assert cc["k0"] == obj(300)
    assert list(cc.sorted_items()) == sorted(model.items())
    del cc["k0"]
    del model["k0"]
    assert pickle.loads(pickle.dumps(cc)) == model == cc


def test_a_pickle_of_compact_refs_is_small() -> None:
    n = 100_000
    rng = random.Random(7)
    changes = {
        f"x/c/{i // 400}/{i % 400}": (OBJECT, rng.randbytes(32), rng.randrange(1 << 40))
        for i in range(n)
    }
    cc = ChunkChanges(changes)
    size = len(pickle.dumps(cc))
    assert size < 60 * n, size / n
    # A dict pickles compactly too (no object headers travel): ~60 bytes a ref for these keys.
    assert size < len(pickle.dumps(changes))
    assert pickle.loads(pickle.dumps(cc)) == changes


def test_packed_refs_into_few_packs_cost_what_object_refs_do() -> None:
    """A pack's id is held once a run, so a session's million chunks in packs are no heavier
    than as objects (memory bench: the session and its commit under 200 MB)."""
    n = 100_000
    rng = random.Random(8)
    packs = [rng.randbytes(32).hex() for _ in range(n // 1000)]
    packed = {
        f"x/c/{i}": (PACKED, packs[i // 1000], (i % 1000) * 1024, 1024, rng.randbytes(32))
        for i in range(n)
    }
    objects = {f"x/c/{i}": (OBJECT, rng.randbytes(32), 1024) for i in range(n)}
    sizes = [len(pickle.dumps(ChunkChanges(refs))) for refs in (packed, objects)]
    assert sizes[0] < sizes[1] + 20 * n, sizes
    assert pickle.loads(pickle.dumps(ChunkChanges(packed))) == packed


def test_runs_pickled_before_the_pack_table_read_the_same() -> None:
    rng = random.Random(9)
    refs = {
        f"k{i:03}": (PACKED, rng.choice("ab") * 64, i * 10, 10, rng.randbytes(32))
        for i in range(300)
    }
    refs["k999"] = (OBJECT, rng.randbytes(32), 5)
    refs["k998"] = (PACKED, "c" * 64, 0, 1 << 33, rng.randbytes(32))  # too long for the columns
    run = changes_module._Run.of(list(refs.items()))
    old = np.zeros(len(run.places) + 1, changes_module._OLD_PLACE)
    old["pack"][:-1] = run.packs[run.places["pack"]]
    old["offset"][:-1], old["length"][:-1] = run.places["offset"], run.places["length"]
    old[-1] = (np.frombuffer(bytes.fromhex("c" * 64), np.uint8), 0, 1 << 33)
    big = int(np.flatnonzero(run.kinds == changes_module._OTHER)[0])  # then, in columns
    run.kinds[big], run.sizes[big] = changes_module._PACKED, len(old) - 1
    run.digests[big] = np.frombuffer(refs["k998"][4], np.uint8)
    run.others, run.places = [], old
    del run.packs  # as an earlier zarrlake pickled it
    restored = changes_module._restore({}, [run])
    assert dict(restored.items()) == refs


def test_sorted_items_of_many_changes_is_sorted_dict() -> None:
    rng = random.Random(11)
    kinds = [
        None,
        (INLINE, b"abc"),
        (PACKED, "pack", 10, 20, bytes(32)),
        (OBJECT, b"d" * 20, 5),
    ]
    model: dict[str, Ref] = {}
    cc = ChunkChanges()
    for _ in range(200_000):
        key = f"{rng.choice('abé𝄞')}/c/{rng.randrange(300)}/{rng.randrange(1000)}"
        if rng.random() < 0.8:
            value: Ref = (OBJECT, rng.randbytes(32), rng.randrange(1 << 30))
        else:
            value = rng.choice(kinds)
        cc[key] = value
        model[key] = value
        if rng.random() < 0.02:
            victim = f"a/c/{rng.randrange(300)}/{rng.randrange(1000)}"
            assert cc.pop(victim, MISSING) == model.pop(victim, MISSING)
    assert list(cc.sorted_items()) == sorted(model.items())
    assert len(cc) == len(model)


def test_keys_with_lone_surrogates_freeze_and_sort_as_str_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 2)
    changes, model = ChunkChanges(), {}
    keys = ["a\ud800", "a", "a\udfff/x", "b", "\ud800", "a\ud7ff", "a\ue000"]
    for i, key in enumerate(keys * 2):
        changes[key] = model[key] = (INLINE, bytes([i]))
    assert list(changes.sorted_items()) == sorted(model.items())
    del changes["a\ud800"], model["a\ud800"]
    assert "a\ud800" not in changes and dict(changes.items()) == model


def test_a_reader_always_finds_what_was_written_while_writes_freeze_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session's reads take no lock: while a writer's freeze or merge reorganizes the changes,
    a key written before must be found — in the dict, or in the runs published before the dict
    that no longer holds it."""
    import threading

    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 64)
    changes = ChunkChanges()
    written = 0
    misses: list[str] = []
    done = threading.Event()

    def read() -> None:
        rng = random.Random(7)
        while not done.is_set():
            if written:
                key = f"k/{rng.randrange(written):07d}"
                if changes.get(key, "absent") == "absent":
                    misses.append(key)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40_000):
            changes[f"k/{i:07d}"] = (INLINE, b"x")
            written = i + 1
    finally:
        done.set()
        reader.join()
    assert misses == []
    assert len(changes) == 40_000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_and_its_parent_never_share_deletions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Merged runs live in memory mappings of their own; a fork (multiprocessing's default on
    Linux, dask's process pools) must copy them like the rest of memory. A shared mapping would
    carry a ``del`` in one process into the other: an uncommitted write silently gone."""
    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 4)
    monkeypatch.setattr(changes_module, "_OWN_MAPPING", 1)
    cc = ChunkChanges({f"a/c/{i}": (OBJECT, bytes([i]) * 32, i) for i in range(64)})
    assert len(cc._runs) >= 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: delete, then say what it sees
        try:
            del cc["a/c/5"]
            os.write(write, b"%d" % len(cc))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        child_len = int(r.read())
    os.waitpid(pid, 0)
    assert child_len == 63
    assert "a/c/5" in cc and len(cc) == 64  # the parent keeps its write
    # And the other way round: the parent's delete after a fork is not the child's.
    go_r, go_w = os.pipe()
    answer_r, answer_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(go_r, 1)  # wait for the parent's delete
            os.write(answer_w, b"1" if "a/c/6" in cc else b"0")
        finally:
            os._exit(0)
    del cc["a/c/6"]
    os.write(go_w, b"x")
    answer = os.read(answer_r, 1)
    os.waitpid(pid, 0)
    for fd in (go_r, go_w, answer_r, answer_w):
        os.close(fd)
    assert answer == b"1"


def test_copy_copy_is_a_copy_not_a_view(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChunkChanges, "FREEZE_AT", 2)
    cc = ChunkChanges({f"k{i}": (OBJECT, bytes(32), i) for i in range(9)})
    for dup in (copy.copy(cc), copy.deepcopy(cc), cc.copy()):
        del dup["k1"]
        assert "k1" in cc and len(cc) == 9 and len(dup) == 8
