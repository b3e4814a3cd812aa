"""The version-control model, checked against a small independent in-memory model.

A Hypothesis state machine drives a real repository (memory storage; a shorter run on a local
directory) through commits, branches, tags, resets, three-way merges and concurrent sessions, while
a plain-Python model predicts every outcome from DESIGN.md's rules alone:

- a snapshot's content is a dict ``key -> bytes``; a commit applies a session's writes/deletes;
- a session whose branch moved is rebased: it conflicts on every chunk key the other side touched
  (the keys recorded in the txlogs of the commits in between, or — when its base is not on the
  head's first-parent chain because the branch was reset — the keys that differ), on every node
  document the other side set to something else, and on writes inside an array the other side
  removed;
  ``UseOurs``/``UseTheirs`` settle chunk conflicts;
- a merge is three-way against the newest common ancestor: a key changed on one side takes that
  change, identical changes are fine, different changes conflict unless a strategy settles them.

Keys are raw ``arr/c/<i>`` chunk keys, chunk keys of one array ``z`` described by a real Zarr v3
metadata document (``z/zarr.json``, whose attributes the machine also changes), with values both
below and above the inline threshold so both inline refs and chunk objects are exercised, and a
small shard bound so manifests split into several shards.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
import zarr
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import zarrlake
from zarrlake import Repository, RepositoryConfig, UseOurs, UseTheirs

Content = dict[str, bytes]
# ("put", key, bytes) | ("del", key, None) | ("rmdir", prefix, None)
Op = tuple[str, str, bytes | None]
ConflictT = tuple[str, str, tuple[int, ...] | None]

INLINE = 16
META_KEY = "z/zarr.json"
CHUNK_KEYS = [f"arr/c/{i}" for i in range(6)] + [f"z/c/{i}" for i in range(4)]
POOL = [b"", b"s", b"x" * INLINE, b"y" * (INLINE + 1), bytes(range(40)), b"L" * 300]


def meta_doc(n: int, size: int = 8) -> bytes:
    """A Zarr v3 array document for ``z``: uint8, shape ``(size,)``, chunks of 2, attribute n."""
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [size],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes"}],
        "attributes": {"n": n},
    }
    return json.dumps(doc, sort_keys=True).encode()


def shape_of(doc: bytes | None) -> object:
    return None if doc is None else json.loads(doc)["shape"]


VALUES = st.one_of(st.sampled_from(POOL), st.binary(max_size=2 * INLINE))
PUT = st.tuples(st.just("put"), st.sampled_from(CHUNK_KEYS), VALUES)
DEL = st.tuples(st.just("del"), st.sampled_from(CHUNK_KEYS), st.none())
# Attribute changes (n) mostly; a different shape is a resize.
META = st.tuples(
    st.just("put"),
    st.just(META_KEY),
    st.builds(meta_doc, st.integers(0, 2), st.sampled_from([8, 8, 8, 12])),
)
RMDIR = st.tuples(st.just("rmdir"), st.sampled_from(["z", "arr"]), st.none())
OPS = st.lists(st.one_of(PUT, PUT, PUT, DEL, META, RMDIR), min_size=1, max_size=5)
SOLVERS = st.sampled_from([None, "ours", "theirs"])
STRATEGIES = st.sampled_from([None, None, "source-wins", "dest-wins"])


def is_meta(key: str) -> bool:
    return key.endswith("zarr.json")


def node_of(meta_key: str) -> str:
    return "/" + meta_key.rpartition("/")[0]


def path_of(key: str) -> str:
    """The node a key belongs to: '/z' for 'z/zarr.json' and 'z/c/1'."""
    return node_of(key) if is_meta(key) else "/" + key.partition("/c/")[0]


def under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


def conflict_of(kind: str, key: str) -> ConflictT:
    if is_meta(key):
        return (kind, node_of(key), None)
    array, _, index = key.partition("/c/")
    return (kind, "/" + array, (int(index),))


def as_tuples(conflicts: list[zarrlake.Conflict]) -> list[ConflictT]:
    return sorted(
        ((c.kind, c.path, None if c.chunk is None else tuple(c.chunk)) for c in conflicts),
        key=repr,
    )


def solver_of(name: str | None) -> UseOurs | UseTheirs | None:
    return {None: None, "ours": UseOurs(), "theirs": UseTheirs()}[name]


def resized(before: Content, after: dict[str, bytes | None]) -> set[str]:
    """Arrays whose shape differs between two versions in which both describe them."""
    return {
        node_of(k)
        for k, doc in after.items()
        if is_meta(k) and doc is not None and k in before and shape_of(before[k]) != shape_of(doc)
    }


@dataclass(frozen=True)
class Touched:
    """What a commit touched, in the terms a rebase checks against (a txlog's content)."""

    keys: frozenset[str] = frozenset()
    prefixes: frozenset[str] = frozenset()
    resized: frozenset[str] = frozenset()

    def __or__(self, other: Touched) -> Touched:
        return Touched(
            self.keys | other.keys, self.prefixes | other.prefixes, self.resized | other.resized
        )


@dataclass
class Pending:
    """An open writable session and what the model expects of it: per-key changes (None deletes)
    and whole subtrees removed; a write after a subtree's removal wins over it."""

    session: zarrlake.Session
    branch: str
    base: str
    changes: dict[str, bytes | None] = field(default_factory=dict)
    prefixes: set[str] = field(default_factory=set)

    def has_changes(self) -> bool:
        return bool(self.changes or self.prefixes)


def apply(content: Content, prefixes: set[str], changes: dict[str, bytes | None]) -> Content:
    out = {k: v for k, v in content.items() if not any(under(k, p) for p in prefixes)}
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


class VersionControlMachine(RuleBasedStateMachine):
    storage_kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self._tmp: str | None = None
        if self.storage_kind == "local":
            self._tmp = tempfile.mkdtemp(prefix="zarrlake-stateful-")
            storage = zarrlake.Storage.local(self._tmp)
        else:
            storage = zarrlake.Storage.memory()
        config = RepositoryConfig(inline_threshold_bytes=INLINE, shard_max_refs=4)
        self.repo = Repository.create(storage, config=config)
        root = self.repo.lookup_branch("main")
        # The model.
        self.snaps: dict[str, Content] = {root: {}}
        self.parents: dict[str, tuple[str, ...]] = {root: ()}
        self.touched: dict[str, Touched] = {root: Touched()}
        self.order: dict[str, int] = {root: 0}
        self.branches: dict[str, str] = {"main": root}
        self.tags: dict[str, str] = {}
        self.pending: list[Pending] = []
        self.n_branches = 0
        self.n_tags = 0
        # Start with the array's metadata committed on main; Zarr itself reads it.
        s = self.repo.writable_session("main")
        s.write(META_KEY, meta_doc(0))
        arr = zarr.open_array(s.store, path="z", mode="r")
        assert arr.shape == (8,) and arr.attrs["n"] == 0
        sid = s.commit("create z")
        self._record(sid, {META_KEY: meta_doc(0)}, (root,), Touched(frozenset({META_KEY})))
        self.branches["main"] = sid

    def teardown(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- the model -----------------------------------------------------------------------------

    def _record(self, sid: str, content: Content, parents: tuple[str, ...], t: Touched) -> None:
        assert sid not in self.snaps, "a commit must create a new snapshot id"
        self.snaps[sid] = content
        self.parents[sid] = parents
        self.touched[sid] = t
        self.order[sid] = len(self.order)

    def _ancestors(self, sid: str) -> set[str]:
        seen = {sid}
        todo = [sid]
        while todo:
            for p in self.parents[todo.pop()]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def _merge_base(self, a: str, b: str) -> str:
        common = self._ancestors(a) & self._ancestors(b)
        return max(common, key=self.order.__getitem__)

    def _theirs(self, base: str, head: str) -> Touched:
        """What happened on the branch between a session's base and the head it commits onto."""
        t = Touched()
        cur = head
        while cur != base and self.parents[cur]:
            t |= self.touched[cur]
            cur = self.parents[cur][0]
        if cur == base:
            return t
        # The base is not on the head's first-parent chain (the branch was reset): what differs
        # between the two is what "they" changed; arrays that vanished count as removed subtrees.
        b, h = self.snaps[base], self.snaps[head]
        differ = {k for k in b.keys() | h.keys() if b.get(k) != h.get(k)}
        gone = {node_of(k).lstrip("/") for k in b if is_meta(k) and k not in h}
        return Touched(frozenset(differ), frozenset(gone), frozenset(resized(b, h)))

    def _rebase(
        self, p: Pending, head: str, solver: str | None
    ) -> tuple[list[ConflictT], dict[str, bytes | None]]:
        """Conflicts of re-applying the session's work (made on its base) on ``head``; if none,
        the per-key changes that remain (a UseTheirs solver drops ours where both wrote)."""
        kept = dict(p.changes)
        if head == p.base:
            return [], kept
        theirs = self._theirs(p.base, head)
        head_content = self.snaps[head]
        conflicts = []
        for key, value in sorted(p.changes.items()):
            in_removed = any(under(key, r) for r in theirs.prefixes)
            if is_meta(key):
                if key in theirs.keys:
                    if head_content.get(key) != value:
                        conflicts.append(conflict_of("node", key))
                elif in_removed:
                    conflicts.append(conflict_of("deleted-theirs", key))
            elif key in theirs.keys:
                if solver == "theirs":
                    del kept[key]
                elif solver is None:
                    conflicts.append(conflict_of("chunk", key))
            elif in_removed:
                conflicts.append(conflict_of("deleted-theirs", key))
            elif path_of(key) in theirs.resized:
                conflicts.append(conflict_of("resized", key))
        for prefix in sorted(p.prefixes):
            if any(under(k, prefix) for k in theirs.keys):
                conflicts.append(("deleted-ours", "/" + prefix, None))
        ours_resized = resized(self.snaps[p.base], p.changes)
        for key in sorted(theirs.keys):
            if not is_meta(key) and path_of(key) in ours_resized:
                conflicts.append(conflict_of("resized", key))
        return sorted(conflicts, key=repr), kept

    def _session_view(self, p: Pending) -> Content:
        return apply(self.snaps[p.base], p.prefixes, p.changes)

    # -- helpers driving the engine ---------------------------------------------------------------

    def _draw_ref(self, data: st.DataObject) -> str:
        return data.draw(
            st.sampled_from(sorted(self.branches) + sorted(self.tags) + sorted(self.snaps)),
            label="ref",
        )

    def _draw_branch(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.branches)), label="branch")

    def _resolve(self, ref: str) -> str:
        return self.branches.get(ref) or self.tags.get(ref) or ref

    def _apply_ops(self, p: Pending, ops: list[Op]) -> None:
        for kind, key, value in ops:
            if kind == "rmdir":
                p.session.delete_prefix(key)
                p.changes = {k: v for k, v in p.changes.items() if not under(k, key)}
                p.prefixes.add(key)
            elif kind == "del":
                existed = key in self._session_view(p)
                p.session.delete(key)
                if existed:
                    p.changes[key] = None
            else:
                assert value is not None
                p.session.write(key, value)
                p.changes[key] = value
        assert p.session.has_changes == p.has_changes()
        self._check_content(p.session, self._session_view(p))  # read-your-writes

    def _commit(self, p: Pending, solver: str | None) -> None:
        head = self.branches[p.branch]
        if not p.has_changes():
            try:
                p.session.commit("nothing")
            except zarrlake.NothingToCommit:
                return
            raise AssertionError("an empty commit went through")
        conflicts, kept = self._rebase(p, head, solver)
        event(f"commit: {'rebase' if head != p.base else 'fast'}, {len(conflicts)} conflicts")
        for c in {c[0] for c in conflicts}:
            event(f"commit: conflict {c}")
        if p.prefixes:
            event("commit: removes a subtree")
        try:
            sid = p.session.commit("work", solver=solver_of(solver))
        except zarrlake.ConflictError as e:
            assert conflicts, f"unexpected conflicts {e.conflicts}"
            assert as_tuples(e.conflicts) == conflicts
            assert not isinstance(e, zarrlake.MergeConflictError)
            assert self.repo.lookup_branch(p.branch) == head
            p.session.discard()
            return
        assert not conflicts, f"expected conflicts {conflicts}, commit {sid} went through"
        assert p.session.read_only
        parent = self.snaps[head]
        removed_nodes = {k for k in parent if is_meta(k) and any(under(k, q) for q in p.prefixes)}
        touched = Touched(
            frozenset(kept) | frozenset(removed_nodes),
            frozenset(p.prefixes),
            frozenset(resized(parent, kept)),
        )
        self._record(sid, apply(parent, p.prefixes, kept), (head,), touched)
        self.branches[p.branch] = sid

    def _check_content(self, session: zarrlake.Session, expected: Content) -> None:
        keys = list(session.list_prefix(""))
        assert keys == sorted(expected), (keys, sorted(expected))
        for key in keys:
            assert session.read(key) == expected[key], key
        for key in set(CHUNK_KEYS) - expected.keys():
            assert session.read(key) is None

    # -- rules ---------------------------------------------------------------------------------

    @rule(data=st.data(), ops=OPS)
    def commit_changes(self, data: st.DataObject, ops: list[Op]) -> None:
        branch = self._draw_branch(data)
        p = Pending(self.repo.writable_session(branch), branch, self.branches[branch])
        assert p.session.base == p.base
        self._apply_ops(p, ops)
        self._commit(p, None)

    @precondition(lambda self: len(self.pending) < 3)
    @rule(data=st.data())
    def open_session(self, data: st.DataObject) -> None:
        branch = self._draw_branch(data)
        session = self.repo.writable_session(branch)
        assert session.base == self.branches[branch] and session.branch == branch
        self.pending.append(Pending(session, branch, self.branches[branch]))

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), ops=OPS)
    def write_in_open_session(self, data: st.DataObject, ops: list[Op]) -> None:
        p = data.draw(st.sampled_from(self.pending), label="session")
        self._apply_ops(p, ops)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), solver=SOLVERS)
    def commit_open_session(self, data: st.DataObject, solver: str | None) -> None:
        p = data.draw(st.sampled_from(self.pending), label="session")
        self.pending.remove(p)
        self._commit(p, solver)

    @rule(data=st.data(), ops1=OPS, ops2=OPS, solver=SOLVERS)
    def concurrent_sessions(
        self, data: st.DataObject, ops1: list[Op], ops2: list[Op], solver: str | None
    ) -> None:
        """Two sessions on one branch, both write, both commit: the second one rebases."""
        branch = self._draw_branch(data)
        first = Pending(self.repo.writable_session(branch), branch, self.branches[branch])
        second = Pending(self.repo.writable_session(branch), branch, self.branches[branch])
        self._apply_ops(first, ops1)
        self._apply_ops(second, ops2)
        # Neither sees the other's uncommitted work.
        self._check_content(first.session, self._session_view(first))
        self._commit(first, None)
        self._check_content(second.session, self._session_view(second))
        self._commit(second, solver)

    @precondition(lambda self: len(self.branches) < 6)
    @rule(data=st.data())
    def create_branch(self, data: st.DataObject) -> None:
        ref = self._draw_ref(data)
        self.n_branches += 1
        name = f"b{self.n_branches}"
        assert self.repo.create_branch(name, ref) == self._resolve(ref)
        self.branches[name] = self._resolve(ref)
        try:
            self.repo.create_branch(name, "main")
        except zarrlake.BranchExists:
            pass
        else:
            raise AssertionError("a branch was created twice")

    @precondition(lambda self: len(self.tags) < 5)
    @rule(data=st.data())
    def create_tag(self, data: st.DataObject) -> None:
        ref = self._draw_ref(data)
        self.n_tags += 1
        name = f"t{self.n_tags}"
        assert self.repo.create_tag(name, ref) == self._resolve(ref)
        self.tags[name] = self._resolve(ref)

    @rule(data=st.data())
    def reset_branch(self, data: st.DataObject) -> None:
        branch = self._draw_branch(data)
        ref = self._draw_ref(data)
        target = self._resolve(ref)
        stale = "0" * 26 if self.branches[branch] != "0" * 26 else "1" * 26
        try:
            self.repo.reset_branch(branch, ref, expected=stale)
        except zarrlake.ConflictError:
            pass
        else:
            raise AssertionError("reset_branch ignored its expected head")
        assert self.repo.reset_branch(branch, ref, expected=self.branches[branch]) == target
        self.branches[branch] = target

    @rule(data=st.data(), strategy=STRATEGIES)
    def merge(self, data: st.DataObject, strategy: str | None) -> None:
        # Mostly branch heads (snapshot ids are often ancestors, which makes a merge a no-op).
        refs = sorted(self.branches) + sorted(self.tags) + sorted(self.snaps)
        source = data.draw(
            st.one_of(st.sampled_from(sorted(self.branches)), st.sampled_from(refs)), label="source"
        )
        others = sorted(b for b in self.branches if b != source) or ["main"]
        self._merge(source, data.draw(st.sampled_from(others), label="into"), strategy)

    @precondition(lambda self: len(self.branches) >= 2)
    @rule(data=st.data(), ops1=OPS, ops2=OPS, strategy=STRATEGIES)
    def diverge_and_merge(
        self, data: st.DataObject, ops1: list[Op], ops2: list[Op], strategy: str | None
    ) -> None:
        """Commit on two branches, then merge one into the other: a true three-way merge."""
        source, into = data.draw(
            st.lists(st.sampled_from(sorted(self.branches)), min_size=2, max_size=2, unique=True),
            label="branches",
        )
        for branch, ops in ((source, ops1), (into, ops2)):
            p = Pending(self.repo.writable_session(branch), branch, self.branches[branch])
            self._apply_ops(p, ops)
            self._commit(p, None)
        self._merge(source, into, strategy)

    def _merge(self, source: str, into: str, strategy: str | None) -> None:
        src, dest = self._resolve(source), self.branches[into]
        base = self._merge_base(src, dest)
        kind = "no-op" if base == src else "fast-forward" if base == dest else "three-way"
        event(f"merge: {kind}")
        if base == src:
            assert self.repo.merge(source, into, strategy=strategy) == dest
            assert self.repo.lookup_branch(into) == dest
            return
        b, s, d = self.snaps[base], self.snaps[src], self.snaps[dest]
        # Arrays one side removed or resized since the merge base.
        src_removed = {node_of(k) for k in b if is_meta(k) and k not in s}
        dst_removed = {node_of(k) for k in b if is_meta(k) and k not in d}
        src_resized, dst_resized = resized(b, dict(s)), resized(b, dict(d))
        plan: dict[str, bytes | None] = {}
        contested: list[ConflictT] = []
        for key in sorted(b.keys() | s.keys() | d.keys()):
            sv, dv, bv = s.get(key), d.get(key), b.get(key)
            path = path_of(key)
            if sv != bv:  # the source changed it
                if sv == dv:
                    continue  # both made the same change
                if dv != bv:
                    contested.append(conflict_of("node" if is_meta(key) else "chunk", key))
                elif sv is not None and path in dst_removed:
                    contested.append(conflict_of("deleted-theirs", key))
                elif not is_meta(key) and path in dst_resized:
                    contested.append(conflict_of("resized", key))
                else:
                    plan[key] = sv
                    continue
                if strategy == "source-wins":
                    plan[key] = sv
            elif dv != bv:  # only the destination changed it
                if dv is not None and path in src_removed:
                    contested.append(conflict_of("deleted-ours", key))
                    if strategy == "source-wins":
                        plan[key] = None
                elif not is_meta(key) and path in src_resized:
                    contested.append(conflict_of("resized", key))
        event(f"merge: {strategy}, {len(contested)} contested")
        for c in {c[0] for c in contested}:
            event(f"merge: contested {c}")
        if contested and strategy is None:
            try:
                self.repo.merge(source, into, strategy=strategy)
            except zarrlake.MergeConflictError as e:
                assert as_tuples(e.conflicts) == sorted(contested, key=repr)
                assert self.repo.lookup_branch(into) == dest
                return
            raise AssertionError(f"merge should have conflicted on {contested}")
        sid = self.repo.merge(source, into, strategy=strategy, message="merge")
        touched = Touched(frozenset(plan), resized=frozenset(resized(d, plan)))
        self._record(sid, apply(d, set(), plan), (dest, src), touched)
        self.branches[into] = sid
        info = next(self.repo.log(into))
        assert info.id == sid and info.parents == (dest, src)

    @rule(data=st.data())
    def diff(self, data: st.DataObject) -> None:
        a_ref, b_ref = self._draw_ref(data), self._draw_ref(data)
        a, b = self.snaps[self._resolve(a_ref)], self.snaps[self._resolve(b_ref)]
        d = self.repo.diff(a_ref, b_ref)
        chunks: dict[str, set[tuple[int, ...]]] = {}
        for key in a.keys() | b.keys():
            if not is_meta(key) and a.get(key) != b.get(key):
                _, path, coords = conflict_of("", key)
                assert coords is not None
                chunks.setdefault(path, set()).add(coords)
        assert {k: set(v) for k, v in d.changed_chunks.items()} == chunks
        nodes_a = {node_of(k) for k in a if is_meta(k)}
        nodes_b = {node_of(k) for k in b if is_meta(k)}
        assert set(d.added_nodes) == nodes_b - nodes_a
        assert set(d.removed_nodes) == nodes_a - nodes_b
        changed = {node_of(k) for k in a if is_meta(k) and k in b and a[k] != b[k]}
        assert set(d.changed_nodes) == changed
        assert bool(d) == (a != b)

    @rule(data=st.data())
    def time_travel(self, data: st.DataObject) -> None:
        """Any snapshot ever made reads back as it was, with its history."""
        sid = data.draw(st.sampled_from(sorted(self.snaps)), label="snapshot")
        session = self.repo.readonly_session(sid)
        assert session.base == sid and session.read_only
        self._check_content(session, self.snaps[sid])
        self._check_log(sid)

    # -- invariants ----------------------------------------------------------------------------

    def _check_log(self, ref: str) -> None:
        log = list(self.repo.log(ref))
        assert log[0].id == self._resolve(ref)
        assert {c.id for c in log} == self._ancestors(self._resolve(ref))
        for c in log:
            assert c.parents == self.parents[c.id], c
        times = [c.time for c in log]
        assert times == sorted(times, reverse=True)

    @invariant()
    def refs_match(self) -> None:
        assert self.repo.list_branches() == self.branches
        assert self.repo.list_tags() == self.tags

    @invariant()
    def every_ref_reads_its_content(self) -> None:
        for ref in sorted(self.branches) + sorted(self.tags):
            session = self.repo.readonly_session(ref)
            assert session.base == self._resolve(ref)
            self._check_content(session, self.snaps[self._resolve(ref)])

    @invariant()
    def branch_histories(self) -> None:
        for branch in self.branches:
            self._check_log(branch)


class LocalVersionControlMachine(VersionControlMachine):
    storage_kind = "local"


_SETTINGS = {
    "deadline": None,
    "stateful_step_count": 30,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

# Passing runs take seconds; a failing one may shrink for up to Hypothesis's 5-minute limit, so the
# per-test timeout leaves room for the minimal example to be reported.
TestVersionControlMemory = pytest.mark.timeout(900)(VersionControlMachine.TestCase)
TestVersionControlMemory.settings = settings(max_examples=100, **_SETTINGS)  # type: ignore[arg-type]

TestVersionControlLocal = pytest.mark.timeout(900)(LocalVersionControlMachine.TestCase)
TestVersionControlLocal.settings = settings(max_examples=8, **_SETTINGS)  # type: ignore[arg-type]


def test_rebase_onto_a_reset_that_removed_the_array() -> None:
    """The machine's rarest rebase path, pinned: the branch is reset to a version without array
    ``z`` while a session writes into ``z``; the commit must report a deleted-theirs conflict (and a
    node conflict for a metadata write), not resurrect chunks of a removed array."""
    repo = Repository.create(zarrlake.Storage.memory())
    root = repo.lookup_branch("main")
    s = repo.writable_session()
    s.write(META_KEY, meta_doc(0))
    s.commit("create z")

    chunk_writer = repo.writable_session()
    chunk_writer.write("z/c/1", b"\x01\x02")
    chunk_writer.write("arr/c/0", b"fine")
    meta_writer = repo.writable_session()
    meta_writer.write(META_KEY, meta_doc(1))
    repo.reset_branch("main", root)

    with pytest.raises(zarrlake.ConflictError) as info:
        chunk_writer.commit("write into z", solver=UseOurs())
    assert as_tuples(info.value.conflicts) == [("deleted-theirs", "/z", (1,))]
    with pytest.raises(zarrlake.ConflictError) as info:
        meta_writer.commit("change z")
    assert as_tuples(info.value.conflicts) == [("node", "/z", None)]
    assert repo.lookup_branch("main") == root
    assert list(repo.readonly_session().list_prefix("")) == []
