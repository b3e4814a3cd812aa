"""Retention, expiry, garbage collection and compaction (DESIGN.md, "Retention, expiry, garbage
collection, compaction"; API.md, "Maintenance").

- A Hypothesis test drives random histories (commits, branches, tags, resets, merges, with expiry,
  GC and journal-pruning compaction interleaved) against an independent model: expiry takes out
  exactly what the retention rules say; after expiry + GC with grace 0 every snapshot still in
  history reads back byte-identical, every other one is gone, exactly the chunk objects and packs
  those snapshots refer to are left, ``log()`` ends cleanly where history was expired, and fsck
  (checked here to find what is missing) is clean.
- GC spares a running session: its uploads, the old objects it deduplicated against (the rewrite
  refreshes them), and its base; a commit whose deduplicated chunk was collected anyway fails
  with ``RetryableError`` and publishes nothing; with a lock service, the commit waits for the
  sweep to let go.
- A GC process (spawned) races committing sessions that write bytes identical to garbage it is
  sweeping, with and without a Redis lock on both sides: nothing committed is lost. GC's clock is
  the module function's ``now=``, set between the garbage and the sessions: what DESIGN.md's grace
  period (longer than any session) guarantees. With grace 0 on the real clock GC may, by design,
  take the uploads of a session that began before it and commits after its mark.
- Compaction changes no data (``diff`` is empty), packs small chunks into byte ranges of pack
  objects, cuts the object count, lets a racing user commit win, merges undersized shards, and
  prunes the branch journal within ``keep_journal``.
- Dry runs change nothing; bad input to the API and the CLI fails in one line and changes nothing.

Real backends only: memory, a local directory, S3 on a real ``moto_server``, a real redis-server.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fnmatch
import hashlib
import heapq
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import hypothesis.strategies as st
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, event, given, settings
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

import zarrlake
from zarrlake.cli import main as cli_main
from zarrlake.format import manifest
from zarrlake.format.model import OBJECT, PACKED, branch_prefix, pack_key, snapshot_key
from zarrlake.format.root import ROOT_KEY, RootRecord
from zarrlake.maintenance.compact import PackUsage, Relocation, small_packs
from zarrlake.maintenance.compact import compact as compact_at
from zarrlake.maintenance.expire import expire as expire_at
from zarrlake.maintenance.gc import ChunkMarks
from zarrlake.maintenance.gc import gc as gc_at
from zarrlake.refs import PRUNE_FLOOR

# Chunks as objects of their own: what these tests count and collect (see conftest).
pytestmark = pytest.mark.usefixtures("chunk_objects")

# The digests chunk objects must be named by, per content hash: computed here with the hash
# libraries themselves, not with zarrlake's code.
DIGEST = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake3": lambda data: blake3.blake3(data).digest(),
}

ARRAY = "a"
CHUNK = 128  # float64 elements per chunk: 1 KiB uncompressed, above the 512-byte inline threshold
ZERO = dt.timedelta(0)
WEEK = dt.timedelta(days=7)


# -- helpers ------------------------------------------------------------------------------------


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def later() -> dt.datetime:
    """A clock just past the journal's prune floor: compaction may prune what is here now."""
    return now() + PRUNE_FLOOR + dt.timedelta(seconds=1)


def block(index: int, value: float) -> np.ndarray:
    """Chunk ``index``'s content for ``value``: the same pair always gives the same bytes (so
    writes deduplicate), value 0 is the fill value (Zarr deletes the chunk)."""
    return (np.arange(CHUNK, dtype="f8") + 1000.0 * index) * value


def create_array(session: zarrlake.Session, n_chunks: int, path: str = ARRAY) -> zarr.Array:
    return zarr.create_array(
        session.store,
        name=path,
        shape=(n_chunks * CHUNK,),
        chunks=(CHUNK,),
        dtype="f8",
        compressors=None,
        fill_value=0.0,
    )


def write_blocks(session: zarrlake.Session, values: dict[int, float], path: str = ARRAY) -> None:
    arr = zarr.open_array(session.store, path=path, mode="r+")
    for index, value in values.items():
        arr[index * CHUNK : (index + 1) * CHUNK] = block(index, value)


def read_array(repo: zarrlake.Repository, ref: str, path: str = ARRAY) -> np.ndarray:
    return zarr.open_array(repo.readonly_session(ref).store, path=path, mode="r")[:]


def objects(storage: zarrlake.Storage, prefix: str = "") -> dict[str, tuple[int, dt.datetime]]:
    """Every object under ``prefix``: key -> (size, modification time). Equal fingerprints before
    and after an operation mean it wrote, rewrote and deleted nothing."""
    return {o.key: (o.size, o.modified) for o in storage.list(prefix)}


def keys(storage: zarrlake.Storage, prefix: str) -> set[str]:
    return set(storage.list_keys(prefix))


def head_refs(repo: zarrlake.Repository, ref: str = "main") -> dict[str, tuple[Any, ...]]:
    snap = repo.core.objects.snapshot(repo.resolve(ref))
    return dict(manifest.iter_all(snap.shards, repo.core.objects.shard))


def store_get(session: zarrlake.Session, key: str, byte_range: Any = None) -> bytes:
    buf = sync(session.store.get(key, default_buffer_prototype(), byte_range))
    assert buf is not None, key
    return buf.to_bytes()


def backdate_all(storage: zarrlake.Storage, when: dt.datetime) -> None:
    for key in storage.list_keys(""):
        storage.set_modified(key, when)  # type: ignore[attr-defined]


def clock_margin(storage: zarrlake.Storage) -> None:
    """Where a test separates "older than the cutoff" from "younger" by the real clock, leave a
    margin on each side: S3 reports modification times in whole seconds, and file systems stamp
    them from a coarse clock that can lag the one Python reads by a few milliseconds."""
    if storage.url.startswith("s3://"):
        time.sleep(1.1)
    elif storage.url.startswith("file:"):
        time.sleep(0.03)


local_and_s3 = pytest.mark.parametrize("storage", ["local", "s3"], indirect=True)
memory_and_local = pytest.mark.parametrize("storage", ["memory", "local"], indirect=True)


# -- retention rules ---------------------------------------------------------------------------


RULES_DOC = {
    "default": {"last": 3},
    "branches": {"main": {"last": 10, "days": 30}, "dev-*": {"days": 7}, "d*": {"last": 1}},
}


def test_rules_load_from_json_and_yaml(tmp_path: Path) -> None:
    expected = zarrlake.RetentionRules(
        default=zarrlake.Keep(last=3),
        branches={
            "main": zarrlake.Keep(last=10, days=30),
            "dev-*": zarrlake.Keep(days=7),
            "d*": zarrlake.Keep(last=1),
        },
    )
    (tmp_path / "r.json").write_text(json.dumps(RULES_DOC))
    (tmp_path / "r.yaml").write_text(
        "default: {last: 3}\nbranches:\n  main: {last: 10, days: 30}\n"
        "  dev-*:\n    days: 7\n  d*: {last: 1}\n"
    )
    (tmp_path / "r.yml").write_text((tmp_path / "r.yaml").read_text())
    for name in ("r.json", "r.yaml", "r.yml"):
        rules = zarrlake.RetentionRules.from_file(tmp_path / name)
        assert rules == expected, name
    assert zarrlake.RetentionRules.from_dict(expected.to_dict()) == expected
    # Exact name first, then the first matching glob in the order given, then the default.
    assert expected.rule_for("main") == zarrlake.Keep(last=10, days=30)
    assert expected.rule_for("dev-1") == zarrlake.Keep(days=7)  # also matches d*, listed later
    assert expected.rule_for("docs") == zarrlake.Keep(last=1)
    assert expected.rule_for("feature") == zarrlake.Keep(last=3)
    assert zarrlake.RetentionRules.from_dict({}) == zarrlake.RetentionRules()
    assert zarrlake.RetentionRules().rule_for("x").keeps_everything


def test_keep_semantics() -> None:
    rule = zarrlake.Keep(last=2, days=1)
    assert rule.keeps(0, dt.timedelta(days=100))
    assert rule.keeps(1, dt.timedelta(days=100))
    assert not rule.keeps(2, dt.timedelta(days=1, seconds=1))
    assert rule.keeps(50, dt.timedelta(hours=23))
    assert not zarrlake.Keep(last=1).keeps(1, ZERO)
    assert zarrlake.Keep().keeps(10**6, dt.timedelta(days=10**4))


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ([1, 2], "must be a mapping"),
        ({"defaults": {}}, "unknown field(s) ['defaults']"),
        ({"default": {"last": 0}}, "default: last must be a whole number >= 1"),
        ({"default": {"last": 2.5}}, "default: last must be a whole number >= 1"),
        ({"default": {"last": True}}, "default: last must be a whole number >= 1"),
        ({"default": {"days": -1}}, "default: days must be a number >= 0"),
        ({"default": {"days": "7d"}}, "default: days must be a number >= 0"),
        ({"default": {"keep": 1}}, "default: unknown field(s) ['keep']"),
        ({"default": 5}, "default: expected a mapping"),
        ({"branches": ["main"]}, "branches: expected a mapping"),
        ({"branches": {"dev-*": {"last": -3}}}, "branches.dev-*: last must be"),
        ({"branches": {"main": "all"}}, "branches.main: expected a mapping"),
    ],
)
def test_rules_validation_errors_say_where(doc: Any, fragment: str) -> None:
    with pytest.raises(zarrlake.InvalidRetentionRules) as e:
        zarrlake.RetentionRules.from_dict(doc)
    assert fragment in str(e.value)
    assert isinstance(e.value, zarrlake.ZarrlakeError) and isinstance(e.value, ValueError)


def test_rules_file_errors(tmp_path: Path) -> None:
    with pytest.raises(zarrlake.InvalidRetentionRules, match="cannot read rules file"):
        zarrlake.RetentionRules.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(zarrlake.InvalidRetentionRules, match=r"bad\.json: not valid"):
        zarrlake.RetentionRules.from_file(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("default: [unclosed")
    with pytest.raises(zarrlake.InvalidRetentionRules, match=r"bad\.yaml: not valid"):
        zarrlake.RetentionRules.from_file(tmp_path / "bad.yaml")
    (tmp_path / "wrong.yaml").write_text("branches:\n  main: {last: 0}\n")
    with pytest.raises(zarrlake.InvalidRetentionRules, match=r"branches\.main: last must be"):
        zarrlake.RetentionRules.from_file(tmp_path / "wrong.yaml")
    with pytest.raises(zarrlake.InvalidRetentionRules):
        zarrlake.Keep(last=-1)
    with pytest.raises(zarrlake.InvalidRetentionRules):
        zarrlake.RetentionRules(default=3)  # type: ignore[arg-type]
    with pytest.raises(zarrlake.InvalidRetentionRules):
        zarrlake.RetentionRules(branches={"": zarrlake.Keep()})


# -- the history model of the property test -------------------------------------------------------


@dataclass
class Model:
    """What the test did, independently of the repository: each snapshot's parents, time and
    content (read back when it was made), branch heads and journals, tags, and what expiry took
    out. It predicts expiry from the retention rules and what GC must keep from the roots."""

    parents: dict[str, tuple[str, ...]] = field(default_factory=dict)
    times: dict[str, dt.datetime] = field(default_factory=dict)
    content: dict[str, bytes] = field(default_factory=dict)
    heads: dict[str, str] = field(default_factory=dict)
    journal: dict[str, list[str | None]] = field(default_factory=dict)  # newest first
    tags: dict[str, str] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)
    branch_count: int = 0
    tag_count: int = 0

    def add(self, repo: zarrlake.Repository, sid: str, parents: tuple[str, ...]) -> None:
        info = next(iter(repo.log(sid, limit=1)))
        assert info.id == sid and info.parents == parents
        self.parents[sid] = parents
        self.times[sid] = info.time
        self.content[sid] = content_of(repo, sid)

    def move(self, branch: str, sid: str | None) -> None:
        """A journal append: commit, merge, reset, creation (or deletion, ``sid`` None)."""
        self.journal.setdefault(branch, []).insert(0, sid)
        if sid is None:
            del self.heads[branch]
        else:
            self.heads[branch] = sid

    def reachable(self) -> set[str]:
        """What is still in history: reached from branch heads, tags and journal entries (as_of)
        through parents, never through an expired snapshot. GC must keep exactly these."""
        roots = set(self.heads.values()) | set(self.tags.values())
        for entries in self.journal.values():
            roots.update(sid for sid in entries if sid is not None)
        stack = [r for r in roots if r not in self.expired]
        seen: set[str] = set()
        while stack:
            sid = stack.pop()
            if sid not in seen:
                seen.add(sid)
                stack.extend(p for p in self.parents[sid] if p not in self.expired)
        return seen

    def live(self) -> list[str]:
        return sorted(self.reachable())

    def history(self, head: str) -> list[str]:
        """``log(head)`` as DESIGN.md defines it: newest first, stopping at expired snapshots."""
        heap = [(-self.times[head].timestamp(), head)]
        seen = {head}
        out = []
        while heap:
            _, sid = heapq.heappop(heap)
            out.append(sid)
            for p in self.parents[sid]:
                if p not in seen and p not in self.expired:
                    seen.add(p)
                    heapq.heappush(heap, (-self.times[p].timestamp(), p))
        return out

    def predict_expiry(self, rules: dict[str, Any]) -> set[str]:
        """Snapshots an expiry run with ``rules`` (the JSON shape) should take out."""
        retained = set(self.heads.values()) | set(self.tags.values())
        for name, head in self.heads.items():
            rule = rules["branches"].get(name)
            if rule is None:
                globs = rules["branches"].items()
                matches = [r for pattern, r in globs if fnmatch.fnmatchcase(name, pattern)]
                rule = matches[0] if matches else rules["default"]
            last, days = rule.get("last"), rule.get("days")
            for position, sid in enumerate(self.history(head)):
                young = days is not None and now() - self.times[sid] <= dt.timedelta(days=days)
                everything = last is None and days is None
                if everything or (last is not None and position < last) or young:
                    retained.add(sid)
        return self.reachable() - retained


def content_of(repo: zarrlake.Repository, sid: str) -> bytes:
    """The array's bytes in snapshot ``sid``; empty for the initial snapshot (no array yet)."""
    if not repo.core.objects.snapshot(sid).parents:
        return b""
    return read_array(repo, sid).tobytes()


def value_of(content: bytes, index: int) -> np.ndarray:
    return np.frombuffer(content, dtype="f8")[index * CHUNK : (index + 1) * CHUNK]


N_CHUNKS = 8
VALUES = [0.0, 1.0, 2.0, 3.0, -1.0]  # 0.0 is the fill value: writing it deletes the chunk
KEEP_RULES = st.fixed_dictionaries(
    {
        "default": st.sampled_from([{"last": 1}, {"last": 2}, {"last": 4}, {}, {"days": 30}]),
        "branches": st.sampled_from(
            [
                {},
                {"main": {"last": 3}},
                {"b*": {"last": 1}},
                {"b1": {"days": 30}, "b*": {"last": 2}},
            ]
        ),
    }
)
OPS = [
    "commit",
    "commit",
    "commit",
    "commit",
    "branch",
    "branch",
    "tag",
    "reset",
    "merge",
    "merge",
    "delete_branch",
    "delete_tag",
    "expire",
    "gc",
    "compact",
]


def run_history(repo: zarrlake.Repository, data: st.DataObject, max_ops: int) -> Model:
    """Drive ``repo`` through random operations, recording everything in a :class:`Model`."""
    model = Model()
    init = repo.lookup_branch("main")
    model.add(repo, init, ())
    model.move("main", init)
    s = repo.writable_session()
    create_array(s, N_CHUNKS)
    sid = s.commit("create array")
    model.add(repo, sid, (init,))
    model.move("main", sid)

    for _ in range(data.draw(st.integers(max_ops // 2, max_ops), label="ops")):
        op = data.draw(st.sampled_from(OPS), label="op")
        event(f"op {op}")
        branches = sorted(model.heads)
        if op == "commit":
            branch = data.draw(st.sampled_from(branches), label="branch")
            writes = data.draw(
                st.dictionaries(
                    st.integers(0, N_CHUNKS - 1), st.sampled_from(VALUES), min_size=1, max_size=4
                ),
                label="writes",
            )
            base = model.heads[branch]
            s = repo.writable_session(branch)
            write_blocks(s, writes)
            sid = s.commit(f"write {writes}", allow_empty=True)
            model.add(repo, sid, (base,))
            expected = np.frombuffer(model.content[base], dtype="f8").copy()
            for index, value in writes.items():
                expected[index * CHUNK : (index + 1) * CHUNK] = block(index, value)
            assert model.content[sid] == expected.tobytes()
            model.move(branch, sid)
        elif op == "branch" and len(branches) < 4:
            source = data.draw(st.sampled_from(branches), label="from")
            model.branch_count += 1
            name = f"b{model.branch_count}"
            assert repo.create_branch(name, from_ref=source) == model.heads[source]
            model.move(name, model.heads[source])
        elif op == "tag":
            target = data.draw(st.sampled_from(model.live()), label="tag target")
            model.tag_count += 1
            repo.create_tag(f"t{model.tag_count}", target)
            model.tags[f"t{model.tag_count}"] = target
        elif op == "reset":
            branch = data.draw(st.sampled_from(branches), label="branch")
            targets = [sid for sid in model.live() if model.parents[sid]]  # not the empty init
            target = data.draw(st.sampled_from(targets), label="reset target")
            repo.reset_branch(branch, target)
            model.move(branch, target)
        elif op == "merge" and len(branches) > 1:
            source = data.draw(st.sampled_from(branches), label="source")
            into = data.draw(st.sampled_from([b for b in branches if b != source]), label="into")
            before = model.heads[into]
            sid = repo.merge(source, into, strategy="source-wins")
            if sid != before:
                model.add(repo, sid, (before, model.heads[source]))
                model.move(into, sid)
        elif op == "delete_branch" and len(branches) > 1:
            branch = data.draw(st.sampled_from([b for b in branches if b != "main"]), label="del")
            repo.delete_branch(branch)
            model.move(branch, None)
        elif op == "delete_tag" and model.tags:
            tag = data.draw(st.sampled_from(sorted(model.tags)), label="del tag")
            repo.delete_tag(tag)
            del model.tags[tag]
        elif op == "expire":
            rules = data.draw(KEEP_RULES, label="rules")
            expect_expired(repo, model, rules)
        elif op == "gc":
            repo.gc(grace=ZERO, force=True)
        elif op == "compact":
            # Packs the branch's chunks and prunes its journal to the newest two entries: from
            # then on GC can reach older snapshots only through parents and tags.
            branch = data.draw(st.sampled_from(branches), label="branch")
            head = model.heads[branch]
            # Compaction's clock past the prune floor (8 days), as if it ran much later.
            report = compact_at(repo.core, branch=branch, keep_journal=ZERO, now=later())
            if report.snapshot is not None:
                model.add(repo, report.snapshot, (head,))
                assert model.content[report.snapshot] == model.content[head]
                assert not repo.diff(head, report.snapshot)
                model.move(branch, report.snapshot)
            assert report.journal_entries_pruned == max(0, len(model.journal[branch]) - 2)
            del model.journal[branch][2:]
    return model


def expect_expired(repo: zarrlake.Repository, model: Model, rules: dict[str, Any]) -> None:
    predicted = model.predict_expiry(rules)
    report = repo.expire(zarrlake.RetentionRules.from_dict(rules))
    assert set(report.expired) == predicted
    assert len(report.expired) == len(set(report.expired))
    assert report.retained == len(model.reachable()) - len(predicted)
    model.expired |= predicted


def referenced(repo: zarrlake.Repository, sids: list[str]) -> tuple[set[str], set[str], set[bytes]]:
    """Chunk object digests, pack ids, and chunk digests (either kind) the snapshots' manifests
    refer to."""
    objects_, packs, digests = set(), set(), set()
    for sid in sids:
        snap = repo.core.objects.snapshot(sid)
        for _, ref in manifest.iter_all(snap.shards, repo.core.objects.shard):
            if ref[0] == OBJECT:
                objects_.add(ref[1].hex())
                digests.add(ref[1])
            elif ref[0] == PACKED:
                packs.add(ref[1])
                digests.add(ref[4])
    return objects_, packs, digests


def check_after_maintenance(repo: zarrlake.Repository, model: Model) -> None:
    """After expiry + GC with grace 0: what is still in history is intact, everything else is
    gone, no garbage is left behind, history ends cleanly, fsck is clean."""
    storage = repo.storage
    assert repo.list_branches() == model.heads
    assert repo.list_tags() == model.tags
    live = model.live()
    for sid in live:
        assert content_of(repo, sid) == model.content[sid], sid
    for sid in set(model.parents) - set(live):  # expired, or left unreachable by pruning
        assert not storage.exists(snapshot_key(sid)), f"snapshot {sid} survived GC"
        with pytest.raises(zarrlake.RefNotFound):
            repo.readonly_session(sid)
    # Exactly the chunk objects and packs live snapshots refer to are left (GC swept the rest),
    # and they hold every chunk the model says those snapshots have.
    objects_, packs, digests = referenced(repo, live)
    assert {k.rsplit("/", 1)[1] for k in keys(storage, "chunks/")} == objects_
    assert {k.rsplit("/", 1)[1] for k in keys(storage, "packs/")} == packs
    for sid in live:
        for index in range(N_CHUNKS):
            chunk = value_of(model.content[sid], index)
            if chunk.any():
                assert DIGEST[repo.record.content_hash](chunk.tobytes()) in digests
    for name, head in model.heads.items():
        history = repo.log(name)
        ids = [c.id for c in history]
        assert ids == model.history(head)
        for child, parent in history.truncated:
            assert child in ids and parent in model.expired
        ends = {p for sid in ids for p in model.parents[sid] if p in model.expired}
        assert {p for _, p in history.truncated} == ends
    report = repo.fsck()
    assert report.ok, report.problems


HYPOTHESIS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@settings(max_examples=60, **HYPOTHESIS)
@given(data=st.data(), rules=KEEP_RULES)
def test_random_histories_survive_expiry_and_gc_memory(
    data: st.DataObject, rules: dict[str, Any]
) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    model = run_history(repo, data, max_ops=24)
    expect_expired(repo, model, rules)
    event(f"snapshots: {len(model.parents) // 5 * 5}+")
    event(f"expired or unreachable: {(len(model.parents) - len(model.live())) // 5 * 5}+")
    repo.gc(grace=ZERO, force=True)
    check_after_maintenance(repo, model)
    # A second round changes nothing: the retained history is stable under the same rules.
    assert repo.expire(zarrlake.RetentionRules.from_dict(rules)).expired == []
    assert repo.gc(grace=ZERO, force=True).deleted_objects == 0


@settings(max_examples=6, **HYPOTHESIS)
@given(data=st.data(), rules=KEEP_RULES)
def test_random_histories_survive_expiry_and_gc_local(
    data: st.DataObject, rules: dict[str, Any]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = zarrlake.Repository.create(zarrlake.Storage.local(Path(tmp) / "repo"))
        model = run_history(repo, data, max_ops=16)
        expect_expired(repo, model, rules)
        repo.gc(grace=ZERO, force=True)
        check_after_maintenance(repo, model)
        # Reopened from disk (no caches), the same holds.
        check_after_maintenance(zarrlake.Repository.open(repo.storage), model)


@memory_and_local
def test_gc_marks_through_merge_parents_tags_and_packs(storage: zarrlake.Storage) -> None:
    """Once compaction has pruned the journals, some snapshots are reachable only as a merge's
    second parent or through a tag: GC keeps them. A pack nothing refers to any more goes."""
    repo = zarrlake.Repository.create(storage)
    ids = linear_history(repo, 1)  # create, c1 (value 1 everywhere)
    c1 = ids[1]
    repo.create_branch("b")
    s = repo.writable_session("b")
    write_blocks(s, {0: 2.0})
    s.commit("b1")
    s = repo.writable_session("b")
    write_blocks(s, {1: 3.0})
    b2 = s.commit("b2")
    m = repo.merge("b", "main")
    repo.reset_branch("b", c1)
    b_packed = compact_at(repo.core, branch="b", keep_journal=ZERO, now=later())  # packs c1
    assert b_packed.snapshot is not None and b_packed.journal_entries_pruned > 0
    (b_pack,) = keys(storage, "packs/")

    s = repo.writable_session()
    write_blocks(s, {2: 4.0})
    x1 = s.commit("x1, only a tag will reach it")
    repo.create_tag("t", x1)
    repo.reset_branch("main", m)
    main_packed = compact_at(repo.core, branch="main", keep_journal=ZERO, now=later())
    assert main_packed.snapshot is not None and main_packed.journal_entries_pruned > 0
    repo.delete_branch("b")
    reads = {sid: read_array(repo, sid) for sid in (b2, m, x1, c1, main_packed.snapshot)}

    expiry = repo.expire(zarrlake.RetentionRules())  # keeps every commit of live branches
    assert expiry.expired == [b_packed.snapshot]  # deleted branch b's compaction commit
    repo.gc(grace=ZERO, force=True)
    assert not storage.exists(snapshot_key(b_packed.snapshot))
    assert not storage.exists(b_pack)  # its only snapshot is gone
    assert len(keys(storage, "packs/")) == 1
    for sid, content in reads.items():
        assert np.array_equal(read_array(repo, sid), content), sid
    assert np.array_equal(reads[m][: CHUNK * 2], np.concatenate([block(0, 2), block(1, 3)]))
    assert [c.id for c in repo.log()][:2] == [main_packed.snapshot, m]
    assert b2 in {c.id for c in repo.log()}  # through the merge's second parent
    report = repo.fsck()
    assert report.ok, report.problems


# -- expiry ---------------------------------------------------------------------------------------


def linear_history(repo: zarrlake.Repository, n: int, n_chunks: int = 4) -> list[str]:
    """``n`` commits on main after the array's creation; commit i writes value i+1 everywhere."""
    s = repo.writable_session()
    create_array(s, n_chunks)
    ids = [s.commit("create")]
    for i in range(n):
        s = repo.writable_session()
        write_blocks(s, {j: float(i + 1) for j in range(n_chunks)})
        ids.append(s.commit(f"commit {i}"))
    return ids


@local_and_s3
def test_expire_log_ends_cleanly_and_gc_frees(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    init = list(repo.log())[-1].id
    ids = linear_history(repo, 5)
    repo.create_tag("v1", ids[1])
    repo.create_branch("dev", from_ref=ids[2])
    repo.core.journal.settle()  # its head marker, written off the caller's path on S3
    before = objects(storage)

    dry = repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=2)), dry_run=True)
    assert dry.dry_run and objects(storage) == before  # changes nothing
    assert [c.id for c in repo.log()] == [*reversed(ids), init]

    report = repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=2)))
    # main keeps its last 2; dev its head (ids[2]) and the one before; tag v1 keeps ids[1].
    assert report.expired == dry.expired
    assert set(report.expired) == {ids[0], init, ids[3]}
    assert report.retained_by_branch == {"main": 2, "dev": 2}
    history = repo.log()
    assert [c.id for c in history] == [ids[5], ids[4]]
    assert history.truncated == [(ids[4], ids[3])]
    dev_history = repo.log("dev")
    assert [c.id for c in dev_history] == [ids[2], ids[1]]
    assert dev_history.truncated == [(ids[1], ids[0])]
    assert [c.id for c in repo.log("v1")] == [ids[1]]

    gc_dry = repo.gc(grace=ZERO, force=True, dry_run=True)
    # Expiry wrote its record, and published the expired snapshots in the root (its one
    # mutable object); the dry run of GC changed nothing.
    published = RootRecord.decode(storage.get(ROOT_KEY)).expired
    assert published is not None and set(report.expired) <= published
    after = {k: v for k, v in objects(storage).items() if k != ROOT_KEY}
    assert after == {k: v for k, v in before.items() if k != ROOT_KEY} | objects(
        storage, "expired/"
    )
    gc_report = repo.gc(grace=ZERO, force=True)
    assert (gc_report.deleted_objects, gc_report.deleted_bytes) == (
        gc_dry.deleted_objects,
        gc_dry.deleted_bytes,
    )
    # Three snapshots and their txlogs, and ids[3]'s chunk objects (value 4, no one else's).
    assert gc_report.by_kind["snapshots"].deleted == 3
    assert gc_report.by_kind["txlogs"].deleted == 3
    assert gc_report.by_kind["chunks"].deleted == 4
    assert gc_report.deleted_objects == sum(c.deleted for c in gc_report.by_kind.values())
    assert gc_report.kept_objects == len(storage.list_keys("")) - len(
        keys(storage, "refs/") | keys(storage, "expired/") | {"repo", ROOT_KEY}
    )
    # History still ends cleanly once the objects are gone, and old versions still read.
    history = repo.log()
    assert [c.id for c in history] == [ids[5], ids[4]]
    assert history.truncated == [(ids[4], ids[3])]
    for i in (1, 2, 4, 5):
        assert np.array_equal(
            read_array(repo, ids[i]), np.concatenate([block(j, i) for j in range(4)])
        )
    with pytest.raises(zarrlake.RefNotFound):
        repo.readonly_session(ids[3])
    report = repo.fsck()
    assert report.ok, report.problems
    assert repo.gc(grace=ZERO, force=True).deleted_objects == 0


@memory_and_local
def test_expire_by_age_uses_commit_times(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    init = list(repo.log())[-1].id
    ids = linear_history(repo, 4)
    later = now() + dt.timedelta(days=10)
    rules = zarrlake.RetentionRules(default=zarrlake.Keep(days=30))
    assert expire_at(repo.core, rules, now=later, dry_run=True).expired == []  # all 10 days old
    rules = zarrlake.RetentionRules(default=zarrlake.Keep(last=2, days=7))
    report = expire_at(repo.core, rules, now=later)
    # Older than 7 days at `later`: only the last 2 are kept (and the head is always kept).
    assert set(report.expired) == {init, ids[0], ids[1], ids[2]}
    assert [c.id for c in repo.log()] == [ids[4], ids[3]]
    # Without `last`, only the head is left at `later` (heads are always kept).
    rules = zarrlake.RetentionRules(default=zarrlake.Keep(days=7))
    assert expire_at(repo.core, rules, now=later).expired == [ids[3]]
    assert [c.id for c in repo.log()] == [ids[4]]


@memory_and_local
def test_expire_keeps_heads_and_tags_and_rejects_bad_rules(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    init = list(repo.log())[-1].id
    ids = linear_history(repo, 3)
    repo.create_tag("keep", ids[0])
    repo.create_branch("old", from_ref=ids[1])
    with pytest.raises(TypeError):
        repo.expire("last=1")
    with pytest.raises(zarrlake.InvalidRetentionRules):
        repo.expire({"default": {"last": 0}})
    report = repo.expire({"default": {"last": 1}})  # the dict form is accepted too
    assert set(report.expired) == {ids[2], init}
    assert repo.list_tags() == {"keep": ids[0]}
    assert repo.lookup_branch("old") == ids[1]
    repo.gc(grace=ZERO, force=True)
    assert not read_array(repo, ids[0]).any()  # the array's creation: all fill value
    for i in (1, 3):
        assert np.array_equal(
            read_array(repo, ids[i]), np.concatenate([block(j, i) for j in range(4)])
        )
    assert repo.fsck().ok


# -- GC: grace period, live sessions, dedup races -------------------------------------------------


def test_gc_refuses_short_grace(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    linear_history(repo, 2)
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    before = objects(storage)
    for grace in (ZERO, dt.timedelta(days=6, hours=23, minutes=59)):
        with pytest.raises(zarrlake.GraceTooShort) as e:
            repo.gc(grace=grace)
        assert "force" in str(e.value)
        assert isinstance(e.value, ValueError) and isinstance(e.value, zarrlake.ZarrlakeError)
        with pytest.raises(zarrlake.GraceTooShort):
            gc_at(repo.core, grace=grace, dry_run=True)
    assert objects(storage) == before
    # Seven days is enough; everything here is younger, so nothing goes.
    assert repo.gc().deleted_objects == 0
    assert repo.gc(grace=WEEK, dry_run=True).deleted_objects == 0
    assert objects(storage) == before
    assert repo.gc(grace=ZERO, force=True).deleted_objects > 0


@memory_and_local
def test_gc_spares_a_running_session_public_api(storage: zarrlake.Storage) -> None:
    """With the default 7-day grace and the real clock: old garbage goes, but an old object that a
    running session deduplicated against was refreshed by that write and stays."""
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    create_array(s, 6)
    s.commit("create")
    orphan = repo.writable_session()
    write_blocks(orphan, {i: 9.0 for i in range(6)})  # uploaded, never committed
    orphan.discard()
    backdate_all(storage, now() - dt.timedelta(days=30))
    garbage = keys(storage, "chunks/")
    assert len(garbage) == 6

    session = repo.writable_session()
    write_blocks(session, {0: 9.0, 1: 9.0, 2: 5.0})  # two dedup hits on garbage, one new chunk
    report = repo.gc()
    assert report.by_kind["chunks"].deleted == 4
    assert report.skipped_young == 3
    assert len(keys(storage, "chunks/")) == 3
    sid = session.commit("uses refreshed garbage")
    expected = np.concatenate([block(0, 9), block(1, 9), block(2, 5), np.zeros(3 * CHUNK)])
    assert np.array_equal(read_array(repo, sid), expected)
    assert repo.fsck().ok


@pytest.mark.parametrize("content_hash", sorted(DIGEST))
def test_gc_spares_a_running_session(storage: zarrlake.Storage, content_hash: str) -> None:
    """GC's clock a week after ``cutoff`` (the module function's ``now=``), grace 7 days:
    everything older than ``cutoff`` that retained history does not need goes. A session that
    started from the head at the cutoff keeps its uploads, the expired objects it deduplicated
    against, and its base (expired by then), and commits, rebasing over a later commit."""
    repo = zarrlake.Repository.create(storage, content_hash=content_hash)
    s = repo.writable_session()
    create_array(s, 6)
    s.commit("create")
    s = repo.writable_session()
    write_blocks(s, {i: 1.0 for i in range(6)})
    c1 = s.commit("c1 (will expire)")
    s = repo.writable_session()
    write_blocks(s, {i: 2.0 for i in range(6)})
    c2 = s.commit("c2")
    orphan = repo.writable_session()
    write_blocks(orphan, {0: 7.0, 1: 7.0})
    orphan.discard()
    clock_margin(storage)
    cutoff = now()
    clock_margin(storage)

    session = repo.writable_session()  # base c2, the head at the cutoff
    assert session.base == c2
    write_blocks(session, {0: 1.0, 1: 1.0, 2: 8.0})  # 0, 1: c1's bytes (dedup); 2: new
    assert len(session._layers[0].dedup_chunks) == 2
    other = repo.writable_session()
    write_blocks(other, {5: 3.0})
    c3 = other.commit("c3, after the cutoff")
    expiry = repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    assert c1 in expiry.expired and c2 in expiry.expired

    report = gc_at(repo.core, grace=WEEK, now=cutoff + WEEK)
    gone = {snapshot_key(c1)} | {
        f"chunks/{d[:2]}/{d}"
        for d in (DIGEST[content_hash](block(i, 1.0).tobytes()).hex() for i in range(2, 6))
    }
    gone |= {
        f"chunks/{d[:2]}/{d}"
        for d in (DIGEST[content_hash](block(i, 7.0).tobytes()).hex() for i in range(2))
    }
    assert not any(storage.exists(k) for k in gone)
    assert report.deleted_objects >= len(gone) and report.skipped_young >= 3
    assert storage.exists(snapshot_key(c2))  # the head at the cutoff: a session may stand on it

    sid = session.commit("after GC")  # rebases over c3, whose txlog and base are still there
    expected = np.concatenate(
        [block(0, 1), block(1, 1), block(2, 8), block(3, 2), block(4, 2), block(5, 3)]
    )
    assert np.array_equal(read_array(repo, sid), expected)
    assert np.array_equal(read_array(repo, c3)[5 * CHUNK :], block(5, 3))
    fsck = repo.fsck()
    assert fsck.ok, fsck.problems


def test_commit_fails_retryably_when_gc_took_its_dedup_chunk(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    create_array(s, 4)
    s.commit("create")
    orphan = repo.writable_session()
    write_blocks(orphan, {0: 6.0, 1: 6.0})
    orphan.discard()

    session = repo.writable_session()
    write_blocks(session, {0: 6.0, 1: 6.0})  # both deduplicate against the orphans
    assert len(session._layers[0].dedup_chunks) == 2
    head, history = repo.lookup_branch("main"), [c.id for c in repo.log()]
    time.sleep(0.01)
    assert repo.gc(grace=ZERO, force=True).by_kind["chunks"].deleted == 2
    with pytest.raises(zarrlake.RetryableError, match="garbage-collected"):
        session.commit("would reference collected chunks")
    assert repo.lookup_branch("main") == head  # nothing published
    assert [c.id for c in repo.log()] == history
    assert repo.fsck().ok

    retry = repo.writable_session()
    write_blocks(retry, {0: 6.0, 1: 6.0})
    sid = retry.commit("retried")
    assert np.array_equal(
        read_array(repo, sid)[: 2 * CHUNK], np.concatenate([block(0, 6), block(1, 6)])
    )
    assert repo.fsck().ok


def test_gc_lock_holds_back_a_deduplicating_commit(tmp_path: Path, redis_server: Any) -> None:
    """With a lock service, a commit's check of its deduplicated chunks and its journal write wait
    while GC holds the sweep's lock; what GC deleted meanwhile makes the commit fail retryably."""
    import threading

    from zarrlake.format.model import chunk_key
    from zarrlake.maintenance.gc import GC_LOCK_BRANCH

    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage, lock=redis_server.url)
    s = repo.writable_session()
    create_array(s, 2)
    s.commit("create")
    orphan = repo.writable_session()
    write_blocks(orphan, {0: 6.0})
    orphan.discard()
    session = repo.writable_session()
    write_blocks(session, {0: 6.0})
    (digest,) = session._layers[0].dedup_chunks
    head = repo.lookup_branch("main")

    outcome: list[BaseException | str] = []

    def commit() -> None:
        try:
            outcome.append(session.commit("deduplicated"))
        except BaseException as e:
            outcome.append(e)

    gc_side = zarrlake.RedisLock(redis_server.url)
    with gc_side.hold(repo.id, GC_LOCK_BRANCH):
        writer = threading.Thread(target=commit)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive() and not outcome  # waiting for the sweep to let go
        assert repo.lookup_branch("main") == head
        storage.delete_many([chunk_key(digest.hex())])  # what the sweep does under the lock
    writer.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], zarrlake.RetryableError), outcome
    assert repo.lookup_branch("main") == head
    assert repo.fsck().ok

    # Nothing deduplicated, nothing to wait for: a fresh write commits straight away.
    session = repo.writable_session()
    write_blocks(session, {1: 6.0})
    sid = session.commit("fresh")
    assert np.array_equal(read_array(repo, sid)[CHUNK:], block(1, 6))


# -- GC racing commits in another process ---------------------------------------------------------


RACE = {  # garbage chunks per round, rounds, sessions per round (at least)
    "local": (768, 4, 6),
    "s3": (64, 2, 4),
}
RACE_WRITES = 32  # chunks each session writes, all identical to garbage of its round


def gc_worker(
    url: str,
    lock_url: str | None,
    cutoff: Any,
    started: Any,
    stop: Any,
    runs: Any,
    errors: Any,
) -> None:
    """GC in a loop (grace 0, forced) with its clock at the cutoff the test publishes: everything
    written before it is old, everything the racing sessions write is young. The sessions' dedup
    rewrites race the sweep of the old garbage they deduplicate against."""
    try:
        os.nice(5)  # a GC slower than the writers widens the windows the race is about
        repo = zarrlake.Repository.open(zarrlake.Storage.from_url(url), lock=lock_url)
        while not stop.is_set():
            at = cutoff.value
            started.value = at
            gc_at(repo.core, grace=ZERO, force=True, now=dt.datetime.fromtimestamp(at, dt.UTC))
            with runs.get_lock():
                runs.value += 1
    except BaseException as e:
        errors.put(f"{type(e).__name__}: {e}")
        raise


def race_gc(repo: zarrlake.Repository, url: str, lock_url: str | None, kind: str) -> None:
    n, rounds, min_sessions = RACE[kind]
    ctx = multiprocessing.get_context("spawn")
    cutoff, started = ctx.Value("d", 1.0), ctx.Value("d", 0.0)  # 1970: nothing is old yet
    stop, runs, errors = ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    s = repo.writable_session()
    create_array(s, n)
    s.commit("create")
    content = np.zeros(n * CHUNK)
    worker = ctx.Process(
        target=gc_worker, args=(url, lock_url, cutoff, started, stop, runs, errors)
    )
    worker.start()
    deadline = time.monotonic() + 300  # a spawned, niced process on a loaded machine
    while runs.value == 0 and worker.is_alive():
        assert time.monotonic() < deadline, "the GC worker ran no GC in 300 s"
        time.sleep(0.01)  # the worker has started and runs GC
    rng = np.random.default_rng(7)
    committed: dict[str, np.ndarray] = {}
    stats = {"sessions": 0, "dedup": 0, "retryable": 0}
    try:
        for round_ in range(rounds):
            # Garbage: a snapshot on a throwaway branch, expired. Its chunks are what GC is about
            # to sweep and what the sessions below write again.
            value = float(round_ + 2)
            repo.create_branch("scratch")
            g = repo.writable_session("scratch")
            write_blocks(g, {i: value for i in range(n)})
            g.commit("garbage")
            repo.delete_branch("scratch")
            repo.expire(zarrlake.RetentionRules())
            clock_margin(repo.storage)
            at = cutoff.value = time.time()  # GC sweeps this round's garbage from its next run on
            clock_margin(repo.storage)
            deadline = time.monotonic() + 300
            while started.value != at and worker.is_alive():
                assert time.monotonic() < deadline, "no GC run began in 300 s"
                time.sleep(0.01)
            # A GC run that sweeps this round's garbage has begun: write it again, and commit,
            # at least until that run is over.
            first, sessions = runs.value, 0
            while (runs.value < first + 2 or sessions < min_sessions) and sessions < 40:
                sessions += 1
                start = int(rng.integers(0, n - RACE_WRITES))
                writes = {i: value for i in range(start, start + RACE_WRITES)}
                head = repo.lookup_branch("main")
                s = repo.writable_session()
                write_blocks(s, writes)
                stats["dedup"] += len(s._layers[0].dedup_chunks)
                try:
                    sid = s.commit("dedup against garbage")
                except zarrlake.RetryableError:
                    stats["retryable"] += 1
                    assert repo.lookup_branch("main") == head  # nothing was published
                    continue
                for i, v in writes.items():
                    content[i * CHUNK : (i + 1) * CHUNK] = block(i, v)
                committed[sid] = content.copy()
            stats["sessions"] += sessions
    finally:
        stop.set()
        worker.join(60)
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert errors.empty(), errors.get()
    assert worker.exitcode == 0
    assert stats["dedup"] > 0, stats  # the sessions did write bytes GC considered garbage
    # Every commit reads back completely, on a fresh client, after one more (final) GC.
    final = zarrlake.Repository.open(zarrlake.Storage.from_url(url))
    gc_at(final.core, grace=ZERO, force=True, now=dt.datetime.fromtimestamp(cutoff.value, dt.UTC))
    lost = []
    for sid, expected in committed.items():
        try:
            ok = np.array_equal(read_array(final, sid), expected)
        except zarrlake.CorruptObject as e:
            ok, sid = False, f"{sid}: {e}"
        if not ok:
            lost.append(sid)
    assert not lost, f"{len(lost)} of {len(committed)} commits lost data: {lost[:3]}"
    report = final.fsck()
    assert report.ok, report.problems[:5]
    print(f"race {kind} lock={bool(lock_url)}: {runs.value} GC runs, {len(committed)} commits")
    print(f"  {stats}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("locked", [False, True], ids=["optimistic", "redis-lock"])
def test_commit_racing_gc_loses_nothing_local(
    tmp_path: Path, locked: bool, request: pytest.FixtureRequest
) -> None:
    lock_url = request.getfixturevalue("redis_server").url if locked else None
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage, lock=lock_url)
    race_gc(repo, storage.url, lock_url, "local")


@pytest.mark.s3
@pytest.mark.timeout(900)
@pytest.mark.parametrize("locked", [False, True], ids=["optimistic", "redis-lock"])
def test_commit_racing_gc_loses_nothing_s3(
    moto_s3: Any, locked: bool, request: pytest.FixtureRequest
) -> None:
    lock_url = request.getfixturevalue("redis_server").url if locked else None
    url = moto_s3.url()
    repo = zarrlake.Repository.create(zarrlake.Storage.from_url(url), lock=lock_url)
    race_gc(repo, url, lock_url, "s3")


# -- compaction -----------------------------------------------------------------------------------


@dataclass
class Packed:
    repo: zarrlake.Repository
    history: list[str]
    reads: dict[str, dict[str, bytes]]
    chunk_bytes: dict[str, bytes]  # chunk key -> bytes at the head before compaction


SMALL, BIG, TINY = "small", "big", "tiny"


def n_small(storage: zarrlake.Storage) -> int:
    return 48 if storage.url.startswith("s3://") else 96  # moto is slow


def compaction_repo(storage: zarrlake.Storage, content_hash: str = "blake3") -> Packed:
    """Three arrays: many 1 KiB chunks (packed), a few 8 KiB ones (above the pack threshold used
    here) and inline ones; a few commits of history."""
    repo = zarrlake.Repository.create(storage, content_hash=content_hash)
    n = n_small(storage)
    s = repo.writable_session()
    create_array(s, n, SMALL)
    zarr.create_array(
        s.store,
        name=BIG,
        shape=(4 * 1024,),
        chunks=(1024,),
        dtype="f8",
        compressors=None,
        fill_value=0.0,
    )[:] = np.arange(4 * 1024) + 0.5
    zarr.create_array(
        s.store, name=TINY, shape=(64,), chunks=(8,), dtype="f8", compressors=None, fill_value=0.0
    )[:] = np.arange(64) + 0.25
    write_blocks(s, {i: 1.0 for i in range(n)}, SMALL)
    history = [s.commit("create")]
    s = repo.writable_session()
    write_blocks(s, {i: 2.0 for i in range(0, n, 7)}, SMALL)
    history.append(s.commit("update some"))
    s = repo.writable_session()
    write_blocks(s, {i: 0.0 for i in range(3, n, 11)}, SMALL)  # deletes
    zarr.open_array(s.store, path=BIG, mode="r+")[:1024] = -1.0
    history.append(s.commit("delete some, change a big chunk"))
    reads = {sid: all_reads(repo, sid) for sid in history}
    head = repo.readonly_session(history[-1])
    chunk_bytes = {k: store_get(head, k) for k in head_refs(repo) if not k.startswith(TINY)}
    return Packed(repo, history, reads, chunk_bytes)


def all_reads(repo: zarrlake.Repository, ref: str) -> dict[str, bytes]:
    return {p: read_array(repo, ref, p).tobytes() for p in (SMALL, BIG, TINY)}


@local_and_s3
@pytest.mark.parametrize("content_hash", sorted(DIGEST))
def test_compaction_changes_no_data_and_packs_small_chunks(
    storage: zarrlake.Storage, content_hash: str
) -> None:
    p = compaction_repo(storage, content_hash)
    repo = p.repo
    before_head = repo.lookup_branch("main")
    before = objects(storage)
    dry = repo.compact(pack_below_bytes=4096, dry_run=True)
    assert objects(storage) == before and repo.lookup_branch("main") == before_head
    n_small = sum(1 for k in p.chunk_bytes if k.startswith(SMALL))
    assert dry.packed_chunks == n_small and dry.snapshot is None

    report = repo.compact(pack_below_bytes=4096)
    after_head = repo.lookup_branch("main")
    assert report.snapshot == after_head != before_head
    assert (report.packed_chunks, report.packed_bytes) == (n_small, n_small * CHUNK * 8)
    assert report.packs_written == 1 == len(keys(storage, "packs/"))
    assert not repo.diff(before_head, after_head)  # compaction changes no data
    info = next(iter(repo.log(limit=1)))
    assert (
        info.parents == (before_head,) and info.metadata["compaction"]["packed_chunks"] == n_small
    )
    for sid in [*p.history, after_head]:
        assert all_reads(repo, sid) == p.reads[sid if sid != after_head else before_head], sid

    # The head's refs: small chunks are byte ranges of the pack; big ones stay chunk objects.
    refs = head_refs(repo)
    head = repo.readonly_session()
    for key, ref in refs.items():
        if key.startswith(SMALL):
            assert ref[0] == PACKED and len(ref) == 5, (key, ref)
            _, pack_id, offset, length, digest = ref
            ranged = storage.get(pack_key(pack_id), (offset, offset + length))
            assert store_get(head, key) == ranged == p.chunk_bytes[key]
            assert DIGEST[content_hash](ranged) == digest
            assert DIGEST[content_hash](storage.get(pack_key(pack_id))).hex() == pack_id
            part = store_get(head, key, RangeByteRequest(16, 48))
            assert part == storage.get(pack_key(pack_id), (offset + 16, offset + 48))
            assert part == p.chunk_bytes[key][16:48]
        elif key.startswith(BIG):
            assert ref[0] == OBJECT
    assert sum(1 for k in refs if k.startswith(SMALL)) == n_small
    # Compacting again has nothing to pack.
    again = repo.compact(pack_below_bytes=4096)
    assert again.packed_chunks == 0 and again.snapshot is None
    assert repo.lookup_branch("main") == after_head

    # Once the pre-compaction history expires, GC leaves a pack instead of ~100 chunk objects.
    data_before = len(keys(storage, "chunks/")) + len(keys(storage, "packs/"))
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    repo.gc(grace=ZERO, force=True)
    chunk_objects = keys(storage, "chunks/")
    assert len(chunk_objects) == sum(1 for k in refs if k.startswith(BIG))
    data_after = len(chunk_objects) + len(keys(storage, "packs/"))
    assert data_after * 10 <= data_before, (data_before, data_after)
    assert all_reads(repo, "main") == p.reads[before_head]
    fsck = repo.fsck(verify_content=True)
    assert fsck.ok, fsck.problems


@local_and_s3
def test_compaction_racing_user_commit_keeps_user_data(storage: zarrlake.Storage) -> None:
    p = compaction_repo(storage)
    repo = p.repo
    user: dict[str, str] = {}

    def user_commits(phase: str, n: int) -> None:
        # Called after the pack is written, before compaction commits: a user commit lands
        # first, rewriting some chunks compaction just packed and deleting another.
        if phase == "pack" and not user:
            s = repo.writable_session()
            write_blocks(s, {0: 5.0, 1: 5.0, 2: 0.0}, SMALL)
            user["sid"] = s.commit("user commit during compaction")
            user["reads"] = all_reads(repo, user["sid"])  # type: ignore[assignment]

    report = repo.compact(pack_below_bytes=4096, progress=user_commits)
    assert user, "compaction never reported packing"
    head = repo.lookup_branch("main")
    assert report.snapshot == head
    info = next(iter(repo.log(limit=1)))
    assert info.parents == (user["sid"],)
    assert not repo.diff(user["sid"], head)
    assert all_reads(repo, head) == user["reads"]  # the user's data wins
    small = read_array(repo, head, SMALL)
    assert np.array_equal(small[: 2 * CHUNK], np.concatenate([block(0, 5), block(1, 5)]))
    assert not small[2 * CHUNK : 3 * CHUNK].any()
    refs = head_refs(repo)
    assert refs[f"{SMALL}/c/0"][0] == OBJECT and refs[f"{SMALL}/c/1"][0] == OBJECT
    assert f"{SMALL}/c/2" not in refs
    assert all(
        ref[0] == PACKED
        for k, ref in refs.items()
        if k.startswith(SMALL) and k not in (f"{SMALL}/c/0", f"{SMALL}/c/1")
    )
    assert repo.fsck().ok


@memory_and_local
def test_compaction_racing_resize_drops_relocations(storage: zarrlake.Storage) -> None:
    p = compaction_repo(storage)
    repo = p.repo
    half = n_small(storage) // 2
    user: dict[str, str] = {}

    def resize(phase: str, n: int) -> None:
        if phase == "pack" and not user:
            s = repo.writable_session()
            zarr.open_array(s.store, path=SMALL, mode="r+").resize((half * CHUNK,))
            user["sid"] = s.commit("shrink the small array")

    repo.compact(pack_below_bytes=4096, progress=resize)
    head = repo.lookup_branch("main")
    assert not repo.diff(user["sid"], head)
    assert all_reads(repo, head) == all_reads(repo, user["sid"])
    assert (
        read_array(repo, head, SMALL).tobytes() == p.reads[p.history[-1]][SMALL][: half * CHUNK * 8]
    )
    assert repo.fsck().ok


@memory_and_local
def test_compaction_merges_undersized_shards(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage, config=zarrlake.RepositoryConfig(shard_max_refs=8))
    s = repo.writable_session()
    create_array(s, 64)
    write_blocks(s, {i: 1.0 for i in range(64)})
    s.commit("create")
    s = repo.writable_session()
    write_blocks(s, {i: 0.0 for i in range(64) if i % 8 >= 3})  # leave 3 of every 8
    before = s.commit("thin out")
    content = read_array(repo, before)
    n_before = len(repo.core.objects.snapshot(before).shards)
    report = repo.compact(pack_below_bytes=0)  # no packing: only the shard merge
    assert report.packed_chunks == 0 and report.shards_before == n_before
    after = repo.lookup_branch("main")
    shards = repo.core.objects.snapshot(after).shards
    assert report.shards_after == len(shards) < n_before
    assert sum(s.count for s in shards) == 24 and all(s.count <= 8 for s in shards)
    assert not repo.diff(before, after)
    assert np.array_equal(read_array(repo, after), content)
    assert repo.fsck().ok


def packs_from_sessions(
    storage: zarrlake.Storage, sessions: list[list[int]], pack_below: int = 256 * 1024
) -> zarrlake.Repository:
    """2,048 chunks of 1 KiB in shards of 256 refs; each session writes the chunks it lists, in
    that order (so a session's 1 MiB packs hold them in that order; its last one is smaller).
    ``pack_below=0``: sessions write chunk objects."""
    config = zarrlake.RepositoryConfig(shard_max_refs=256, pack_chunks_below_bytes=pack_below)
    repo = zarrlake.Repository.create(storage, config=config)
    s = repo.writable_session()
    create_array(s, 2048)
    s.commit("create")
    for i, chunks in enumerate(sessions):
        s = repo.writable_session()
        write_blocks(s, {j: float(i + 1) for j in chunks})
        s.commit(f"session {i}")
    return repo


def pack_sizes(repo: zarrlake.Repository) -> list[int]:
    return sorted(len(repo.storage.get(k)) for k in repo.storage.list_keys("packs/"))


#: One session writes the even chunks, then the odd ones: two full packs (1 MiB each, so not
#: under the 1 MiB of a small pack), each with chunks in every shard. Four sessions each write a
#: 256-chunk range: four small packs, whose chunks fall into several shards (keys sort as text:
#: "a/c/1", "a/c/10", ...).
SCATTERED_FULL = [list(range(0, 2048, 2)) + list(range(1, 2048, 2))]
SMALL_QUARTERS = [list(range(k * 512, k * 512 + 256)) for k in range(4)]


@pytest.mark.parametrize("runs", [1, 4])
def test_compaction_leaves_full_packs_alone_however_many_runs_see_a_part(
    tmp_path: Path, runs: int
) -> None:
    """Which packs are small is decided over the whole manifest: a run that sees a quarter of a
    1 MiB pack does not take it for a small one (it did: four runs copied both packs)."""
    repo = packs_from_sessions(zarrlake.Storage.local(tmp_path / "r"), SCATTERED_FULL)
    assert pack_sizes(repo) == [1 << 20, 1 << 20]
    before = objects(repo.storage, "packs/"), objects(repo.storage, "manifests/")
    report = compact_at(repo.core, branch="main", runs=runs)
    assert (report.packed_chunks, report.packs_written, report.snapshot) == (0, 0, None)
    assert (objects(repo.storage, "packs/"), objects(repo.storage, "manifests/")) == before


def test_compaction_merges_small_packs_only_where_its_runs_make_fewer(tmp_path: Path) -> None:
    """Four small packs: one run merges them into one pack. Four runs would each write a pack of
    the chunks they see, four small packs again: they leave them, and so does every compaction
    after (a compaction that found work once finds none the next time)."""
    built = packs_from_sessions(zarrlake.Storage.local(tmp_path / "built"), SMALL_QUARTERS)
    content = read_array(built, "main")
    assert pack_sizes(built) == [256 * 1024] * 4
    for runs, merged in ((4, False), (1, True)):
        shutil.copytree(tmp_path / "built", tmp_path / f"runs{runs}")
        repo = zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / f"runs{runs}"))
        report = compact_at(repo.core, branch="main", runs=runs)
        assert report.packed_chunks == (1024 if merged else 0), (runs, report)
        # (The four stay until GC takes them.)
        assert pack_sizes(repo) == sorted([1 << 20] * merged + [256 * 1024] * 4)
        for again in (1, 4) if merged else (4,):  # (one run would merge these four)
            assert compact_at(repo.core, branch="main", runs=again).packed_chunks == 0
        assert np.array_equal(read_array(repo, "main"), content)
        assert repo.fsck(verify_content=True).ok
    # Small chunk objects in four runs become a pack in each (under 1 MiB): a compaction after
    # that leaves those packs as they are.
    repo = packs_from_sessions(
        zarrlake.Storage.local(tmp_path / "objects"), [list(range(0, 2048, 2))], pack_below=0
    )
    first = compact_at(repo.core, branch="main", runs=4)
    assert (first.packed_chunks, first.packs_written) == (1024, 4)
    assert compact_at(repo.core, branch="main", runs=4).packed_chunks == 0
    # New chunk objects in three of the runs: each of those runs folds them into its small pack
    # (three packs, not three packs more); after that, again nothing to do.
    s = repo.writable_session()
    write_blocks(s, {j: 5.0 for j in (1, 601, 1201, 1801)})
    s.commit("four chunk objects")
    content = read_array(repo, "main")
    second = compact_at(repo.core, branch="main", runs=4)
    assert second.packed_chunks > 4
    assert len({ref[1] for ref in head_refs(repo).values() if ref[0] == PACKED}) == 4
    assert compact_at(repo.core, branch="main", runs=4).packed_chunks == 0
    assert compact_at(repo.core, branch="main", runs=1).packed_chunks == 1028  # one run: one pack
    assert np.array_equal(read_array(repo, "main"), content)
    assert repo.fsck(verify_content=True).ok


def test_small_packs_are_decided_over_every_run() -> None:
    """:func:`small_packs` from what each run uses (bytes per pack, small chunk objects)."""
    kib, target = 1024, 64 << 20

    def runs(*parts: tuple[dict[str, int], int]) -> list[PackUsage]:
        return [
            PackUsage({p: n * kib for p, n in live.items()}, set(), obj * kib)
            for live, obj in parts
        ]

    # A 1 MiB pack split over two runs is not small.
    assert small_packs(runs(({"a": 512}, 0), ({"a": 512}, 0)), target) == frozenset()
    # Two small packs in one run: merged into one.
    assert small_packs(runs(({"a": 100, "b": 100}, 0)), target) == {"a", "b"}
    # One small pack in each of four runs: four runs would write four packs again.
    quarters = runs(*(({p: 256}, 0) for p in "abcd"))
    assert small_packs(quarters, target) == frozenset()
    # A small pack and the chunk objects of its run: one pack instead of two.
    assert small_packs(runs(({"a": 100}, 8)), target) == {"a"}
    # ... but not chunk objects of another run (two packs either way).
    assert small_packs(runs(({"a": 100}, 0), ({}, 8)), target) == frozenset()
    # A pack some ref names without a digest (an older format) is left alone.
    old = runs(({"a": 100, "b": 100}, 0))
    old[0].undigested.add("b")
    assert small_packs(old, target) == frozenset()
    # Under half the target, when that is below 1 MiB.
    assert small_packs(runs(({"a": 300, "b": 300}, 0)), 512 * kib) == frozenset()
    assert small_packs(runs(({"a": 200, "b": 200}, 0)), 512 * kib) == {"a", "b"}


@memory_and_local
def test_fsck_checks_what_gc_must_keep(storage: zarrlake.Storage) -> None:
    """fsck, which the tests above rely on, finds missing or short packs, chunk objects and
    txlogs; a snapshot taken out by expiry and collected is the end of history, not a problem."""
    p = compaction_repo(storage)
    repo = p.repo
    repo.compact(pack_below_bytes=4096)
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=2)))
    repo.gc(grace=ZERO, force=True)
    assert repo.fsck().ok
    (pack,) = keys(storage, "packs/")
    data = storage.get(pack)
    storage.put(pack, data[:-1])
    assert [(x.kind, x.key) for x in repo.fsck().problems] == [("corrupt", pack)]
    storage.delete_many([pack])
    assert [(x.kind, x.key) for x in repo.fsck().problems] == [("missing", pack)]
    storage.put(pack, data)
    big = sorted(k for k, ref in head_refs(repo).items() if ref[0] == OBJECT)[0]
    chunk = f"chunks/{head_refs(repo)[big][1].hex()[:2]}/{head_refs(repo)[big][1].hex()}"
    storage.delete_many([chunk])
    head = repo.lookup_branch("main")
    storage.delete_many([f"txlogs/{head}"])
    found = {(x.kind, x.key) for x in repo.fsck().problems}
    assert found == {("missing", chunk), ("missing", f"txlogs/{head}")}
    assert not repo.fsck(check_chunks=False).ok


@memory_and_local
def test_compaction_prunes_journal_within_keep_journal(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    ids = linear_history(repo, 2)  # create, c1, c2
    time.sleep(0.01)
    middle = now()
    time.sleep(0.01)
    s = repo.writable_session()
    write_blocks(s, {0: 9.0})
    s.commit("c3")
    times = {c.id: c.time for c in repo.log()}
    log_before = [c.id for c in repo.log()]
    n_entries = len(storage.list_keys(branch_prefix("main")))
    assert n_entries == 5  # init, create, c1, c2, c3

    reads = {sid: read_array(repo, sid) for sid in log_before[:-1]}  # init has no array
    assert repo.readonly_session(as_of=times[ids[1]]).base == ids[0]

    # Entries younger than the prune floor (8 days) stay, whatever keep_journal says: a client
    # that knows a recent head relies on the entries after it.
    assert repo.compact(keep_journal=ZERO).journal_entries_pruned == 0
    assert len(storage.list_keys(branch_prefix("main"))) == n_entries + 1  # + compaction's own

    # A clock one prune floor after ``middle``: the window is [middle, now].
    before = objects(storage)
    clock = middle + PRUNE_FLOOR
    dry = compact_at(repo.core, keep_journal=ZERO, now=clock, dry_run=True)
    assert objects(storage) == before
    report = compact_at(repo.core, keep_journal=ZERO, now=clock)
    # Pruned: the entries of init, create and c1; kept: c2 (the head when the window began),
    # c3 and the first compaction's commit (this one had nothing left to pack).
    assert report.journal_entries_pruned == dry.journal_entries_pruned == 3
    assert report.snapshot is None
    assert len(storage.list_keys(branch_prefix("main"))) == n_entries + 1 - 3
    # as_of within the window still resolves, through the entry that was the head at its start.
    assert repo.readonly_session(as_of=middle).base == ids[2]
    assert repo.readonly_session(as_of=now()).base == repo.lookup_branch("main")
    with pytest.raises(zarrlake.RefNotFound):  # before the window: no longer answerable
        repo.readonly_session(as_of=times[ids[1]])
    # Pruning the journal does not touch history or data.
    assert [c.id for c in repo.log()][1:] == log_before
    # keep_journal=0 a prune floor from now: the newest entry and the one before it.
    compact_at(repo.core, keep_journal=ZERO, now=later())
    assert len(storage.list_keys(branch_prefix("main"))) == 2
    assert repo.readonly_session(as_of=now()).base == repo.lookup_branch("main")
    repo.gc(grace=ZERO, force=True)
    for sid, content in reads.items():
        assert np.array_equal(read_array(repo, sid), content)
    assert repo.fsck().ok


@memory_and_local
def test_compaction_rejects_bad_input(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    linear_history(repo, 1)
    before = objects(storage)
    with pytest.raises(zarrlake.RefNotFound):
        repo.compact(branch="nope")
    with pytest.raises(zarrlake.InvalidName):
        repo.compact(branch="bad name!")
    assert objects(storage) == before


# -- CLI ------------------------------------------------------------------------------------------


@dataclass
class Cli:
    capsys: pytest.CaptureFixture[str]

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = cli_main(list(argv))
        out, err = self.capsys.readouterr()
        return code, out, err

    def fails(self, *argv: str, code: int) -> str:
        got, out, err = self(*argv)
        assert got == code, (got, out, err)
        assert out == ""
        assert err.startswith("zarrlake: error: ") and err.count("\n") == 1, err
        assert "Traceback" not in err
        return err


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


@pytest.fixture
def cli_repo(tmp_path: Path) -> tuple[zarrlake.Repository, str]:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    linear_history(repo, 4)
    return repo, storage.url


def test_cli_expire(cli: Cli, cli_repo: tuple[zarrlake.Repository, str], tmp_path: Path) -> None:
    repo, url = cli_repo
    storage = repo.storage
    (tmp_path / "rules.yaml").write_text("default:\n  last: 2\n")
    (tmp_path / "rules.json").write_text(json.dumps({"default": {"last": 2}}))
    before = objects(storage)
    for bad, fragment in (
        ({"default": {"last": 0}}, "default: last must be a whole number >= 1"),
        ({"branch": {}}, "unknown field(s) ['branch']"),
        ({"branches": {"dev": {"days": -2}}}, "branches.dev: days must be a number >= 0"),
        ([1], "must be a mapping"),
    ):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        assert fragment in cli.fails("expire", url, "--rules", str(tmp_path / "bad.json"), code=2)
    (tmp_path / "broken.yaml").write_text("default: {last: [")
    assert "broken.yaml" in cli.fails(
        "expire", url, "--rules", str(tmp_path / "broken.yaml"), code=2
    )
    assert "cannot read" in cli.fails("expire", url, "--rules", str(tmp_path / "nope.json"), code=2)
    cli.fails("expire", url, code=2)  # --rules is required
    assert objects(storage) == before

    code, out, _ = cli(
        "expire", url, "--rules", str(tmp_path / "rules.yaml"), "--dry-run", "--json"
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["expired_snapshots"] == 4 == len(doc["expired"])
    assert objects(storage) == before
    code, out, _ = cli("expire", url, "--rules", str(tmp_path / "rules.json"), "--json")
    assert code == 0 and json.loads(out)["expired"] == doc["expired"]
    code, out, _ = cli("expire", url, "--rules", str(tmp_path / "rules.json"))
    assert code == 0 and out.startswith("expired 0 snapshot(s)")
    code, out, _ = cli("log", url, "--json")
    assert code == 0 and len(json.loads(out)) == 2
    code, out, _ = cli("log", url)
    assert code == 0 and "was expired" in out


def test_cli_gc(cli: Cli, cli_repo: tuple[zarrlake.Repository, str]) -> None:
    repo, url = cli_repo
    storage = repo.storage
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    before = objects(storage)
    for bad in ("7x", "d7", "", "-1d", "1d-2h", "seven"):
        assert "bad duration" in cli.fails("gc", url, f"--grace={bad}", "--force", code=2)
    assert "force" in cli.fails("gc", url, "--grace", "1d", code=2)
    assert "force" in cli.fails("gc", url, "--grace", "6d23h", "--dry-run", code=2)
    cli.fails("gc", url, "--bogus", code=2)
    assert "no zarrlake repository" in cli.fails("gc", url + "-elsewhere", "--json", code=1)
    assert objects(storage) == before

    code, out, _ = cli("gc", url, "--json")  # default 7d: everything is young
    assert code == 0 and json.loads(out)["deleted_objects"] == 0
    code, out, _ = cli("gc", url, "--grace", "0s", "--force", "--dry-run", "--json")
    assert code == 0
    dry = json.loads(out)
    assert dry["dry_run"] is True and dry["deleted_objects"] > 0
    assert set(dry["by_kind"]) == {"snapshots", "txlogs", "history", "manifests", "chunks", "packs"}
    assert objects(storage) == before
    code, out, _ = cli("gc", url, "--grace", "0", "--force", "--json")
    assert code == 0
    real = json.loads(out)
    assert (real["deleted_objects"], real["deleted_bytes"]) == (
        dry["deleted_objects"],
        dry["deleted_bytes"],
    )
    assert len(storage.list_keys("")) == len(before) - real["deleted_objects"]
    code, out, _ = cli("gc", url, "--grace", "1d12h", "--force")
    assert code == 0 and out.startswith("deleted 0 object(s)") and "KIND" in out
    code, out, _ = cli("fsck", url)
    assert code == 0 and out.rstrip().endswith("ok")


def test_cli_compact(cli: Cli, cli_repo: tuple[zarrlake.Repository, str]) -> None:
    repo, url = cli_repo
    storage = repo.storage
    head = repo.lookup_branch("main")
    before = objects(storage)
    assert "nope" in cli.fails("compact", url, "--branch", "nope", code=1)
    cli.fails("compact", url, "--branch", "bad name!", code=2)
    assert "bad duration" in cli.fails("compact", url, "--keep-journal", "soon", code=2)
    cli.fails("compact", url, "--pack-below", "-5", code=2)
    assert objects(storage) == before

    code, out, _ = cli("compact", url, "--branch", "main", "--dry-run", "--json")
    assert code == 0
    dry = json.loads(out)
    assert dry["dry_run"] is True and dry["packed_chunks"] == 4 and dry["snapshot"] is None
    assert objects(storage) == before
    code, out, _ = cli("compact", url, "--branch", "main", "--json", "--keep-journal", "7d")
    assert code == 0
    doc = json.loads(out)
    assert doc["packed_chunks"] == 4 and doc["snapshot"] == repo.lookup_branch("main") != head
    assert not repo.diff(head, doc["snapshot"])
    code, out, _ = cli("compact", url)
    assert code == 0 and out.startswith("packed 0 chunk(s)")


def test_reports_are_frozen_values_with_a_json_form(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    create_array(s, 4)
    write_blocks(s, {i: float(i) for i in range(4)})
    s.commit("data")
    reports = [
        repo.expire(zarrlake.RetentionRules(), dry_run=True),
        repo.gc(dry_run=True),
        repo.compact(dry_run=True),
        repo.fsck(),
    ]
    for report in reports:
        first = dataclasses.fields(report)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(report, first, getattr(report, first))
        doc = report.to_json()
        assert json.loads(json.dumps(doc)) == doc
        assert report.summary()
    gc_report = reports[1]
    assert set(gc_report.to_json()["by_kind"]) == {
        "snapshots",
        "txlogs",
        "history",
        "manifests",
        "chunks",
        "packs",
    }
    assert gc_report.deleted_objects == sum(c.deleted for c in gc_report.by_kind.values())


def test_relocation_gives_way_to_what_the_other_side_touched() -> None:
    """Compaction's rebase policy never conflicts: it drops the chunks a concurrent commit wrote,
    deleted, or whose array it resized, and keeps relocating the rest."""
    from zarrlake.changeset import Changeset
    from zarrlake.conflicts import ChangeSummary
    from zarrlake.format.model import Snapshot

    empty = Snapshot("", (), now(), None, "", {}, {}, [])
    ref = (PACKED, "p", 0, 1, b"d")
    ours = Changeset(
        "s",
        "base",
        chunks={"a/c/0": ref, "a/c/1": ref, "gone/c/0": ref, "b/c/0": ref, "z/c/0": ref},
    )
    theirs = ChangeSummary(chunks={"a/c/0"}, deleted_prefixes={"gone"}, resized={"/b"})
    conflicts, drop = Relocation().settle(ours, empty, empty, theirs, {"/a", "/b", "/gone", "/z"})
    assert conflicts == []
    assert drop == {"a/c/0", "gone/c/0", "b/c/0"}
    assert Relocation().relocates


# -- chunk marks ---------------------------------------------------------------------------------


def _digests(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(n)]
    # Digests ending (or starting) in NUL bytes: fixed-width byte strings must keep them apart.
    return [*out, b"\0" * 32, b"\1" + b"\0" * 31, b"\0" * 31 + b"\1", b"\1" * 31 + b"\0"]


@pytest.mark.parametrize("n", [0, 5, 70_000, 150_000])
def test_chunk_marks_are_exact_below_the_limit(n: int) -> None:
    marked = _digests(n, 1)
    others = _digests(2_000, 2)[:-4]
    marks = ChunkMarks(len(marked), exact_limit=200_000)
    for d in marked + marked[: n // 3]:  # duplicates, as shards of several snapshots have
        marks.add(d)
    marks.add(b"short")  # not a SHA-256 digest: still exact
    assert marks.exact
    assert all(marks.contains_many(marked))
    assert not any(marks.contains_many(others))
    assert marks.contains_many([b"short", b"shor", b"", marked[0]]) == [True, False, False, True]
    assert b"\0" * 32 in marks and b"\0" * 31 not in marks
    marks.add(others[0])  # adding after lookups works
    assert others[0] in marks and others[1] not in marks


def test_chunk_marks_turn_into_a_bloom_filter_past_the_limit() -> None:
    marked = _digests(5_000, 3)
    marks = ChunkMarks(len(marked), exact_limit=1_000)
    for d in marked:
        marks.add(d)
    marks.add(b"short")
    assert not marks.exact
    assert all(marks.contains_many([*marked, b"short"]))  # never a false negative
    others = _digests(5_000, 4)[:-4]
    assert sum(marks.contains_many(others)) < 50  # 1e-4 false positives, with room to spare


def test_fsck_reads_every_tag_record_again_whatever_was_listed_before(tmp_path: Path) -> None:
    """A repository handle does not read a tag record again while the listing shows it with the
    same size and modification time (records are create-only); fsck reads them all, so a record
    that rotted in place is reported, not taken from what the handle read before."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    head = repo.lookup_branch("main")
    repo.create_tag("v1", "main")
    assert repo.list_tags() == {"v1": head}
    path = tmp_path / "repo" / "refs" / "tag.v1"
    before, data = path.stat(), path.read_bytes()
    path.write_bytes(bytes(len(data)))  # the same size, every byte gone
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert repo.list_tags() == {"v1": head}  # as listed before: not read again
    assert ("corrupt", "refs/tag.v1") in [(x.kind, x.key) for x in repo.fsck().problems]
