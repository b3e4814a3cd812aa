"""Transactional mirroring against adversarial replication (external mode).

Bucket replication copies every object of the source (its branch journal and repository marker
included) in any order: a snapshot or manifest often lands long before the chunks it names. Here a
replicator thread does that on purpose, in random order, metadata before data, with delays,
duplicates and objects withheld for a while, while a writer commits continually, a promoter
steps, and readers open the destination again and again and read every chunk of each mirrored
head. Every read is compared with the source's data for the same snapshot id.

The second test drives the same parts through hypothesis-chosen schedules (commits, branch and
tag operations, partial replication in any order, withholding, promotion, promoter restarts) and
checks the mirror's invariants after every step.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import zarrlake as zl
from mirror_helpers import read_all, replicate, write, write_chunks
from zarrlake.mirror import Mirror, MirrorStatus
from zarrlake.storage.base import ObjectNotFound

DATA_PREFIXES = ("chunks/", "packs/")


def _is_data(key: str) -> bool:
    return key.startswith(DATA_PREFIXES)


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


class SourceData:
    """The source's data per snapshot id, read from the source once (snapshots are immutable)."""

    def __init__(self, source: zl.Repository) -> None:
        self.source = source
        self._cache: dict[str, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()

    def __call__(self, sid: str) -> dict[str, np.ndarray]:
        with self._lock:
            found = self._cache.get(sid)
        if found is None:
            found = read_all(self.source, sid)
            with self._lock:
                self._cache[sid] = found
        return found


def first_parent_chain(source: zl.Repository, head: str) -> list[str]:
    """``head``'s first-parent history at the source, oldest first."""
    parents = {c.id: c.parents for c in source.log(head)}
    chain, sid = [], head
    while True:
        chain.append(sid)
        if not parents.get(sid):
            break
        sid = parents[sid][0]
    return chain[::-1]


# -- the adversarial replicator ------------------------------------------------------------------


class Replicator(threading.Thread):
    """Bucket replication as badly as it is allowed to behave.

    It lists the source over and over; every key it finds gets an arrival time: a random delay,
    data objects (chunks, packs) later than metadata, and some keys (``withhold``) much later.
    Each round copies the keys that are due in random order, metadata first, and copies again a
    few keys it copied before (duplicate deliveries). :meth:`release` makes everything due.
    """

    def __init__(
        self,
        source: zl.Storage,
        dest: zl.Storage,
        seed: int,
        *,
        delay: float = 0.15,
        data_delay: float = 0.15,
        withhold: float = 0.02,
        withhold_s: float = 1.0,
        duplicates: int = 3,
    ) -> None:
        super().__init__(name="replicator", daemon=True)
        self.source, self.dest = source, dest
        self.rng = random.Random(seed)
        self.delay, self.data_delay = delay, data_delay
        self.withhold, self.withhold_s = withhold, withhold_s
        self.duplicates = duplicates
        self.due: dict[str, float] = {}
        self.copied: set[str] = set()
        self.stats = {"copied": 0, "duplicates": 0, "withheld": 0, "rounds": 0}
        self.stop = threading.Event()
        self.released = threading.Event()
        self.errors: list[BaseException] = []

    def release(self) -> None:
        self.released.set()

    def caught_up(self) -> bool:
        """Every key the source holds now has been copied."""
        return set(self.source.list_keys("")) <= self.copied

    def _copy(self, key: str) -> bool:
        try:
            data = self.source.get(key)
        except ObjectNotFound:
            return False
        self.dest.put(key, data)
        return True

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self._round()
                self.stop.wait(0.005)
        except BaseException as e:  # reported by the test
            self.errors.append(e)

    def _round(self) -> None:
        now = time.monotonic()
        for key in self.source.list_keys(""):
            if key not in self.due:
                wait = self.rng.uniform(0, self.delay)
                if _is_data(key):
                    wait += self.rng.uniform(0, self.data_delay)
                if self.rng.random() < self.withhold:
                    wait += self.withhold_s
                    self.stats["withheld"] += 1
                self.due[key] = now + wait
        released = self.released.is_set()
        ready = [k for k, t in self.due.items() if k not in self.copied and (released or t <= now)]
        self.rng.shuffle(ready)
        ready.sort(key=_is_data)  # stable: random order within metadata, then within data
        again = self.rng.sample(sorted(self.copied), min(len(self.copied), self.duplicates))
        for key in ready:
            if self._copy(key):
                self.copied.add(key)
                self.stats["copied"] += 1
            if self.rng.random() < 0.05:
                time.sleep(0.002)
        for key in again:
            self._copy(key)
            self.stats["duplicates"] += 1
        self.stats["rounds"] += 1


# -- the threaded scenario ----------------------------------------------------------------------


@dataclass
class Observed:
    """What one reader saw: (branch, head) per successful read, in order; and failures."""

    heads: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    reads: int = 0


def _reader(
    dest: zl.Storage,
    branches: tuple[str, ...],
    expected: SourceData,
    stop: threading.Event,
    out: Observed,
) -> None:
    while not stop.is_set():
        mirror = zl.Repository.open(dest)
        for branch in branches:
            try:
                session = mirror.readonly_session(branch)
            except zl.RefNotFound as e:
                out.failures.append(f"{branch}: mirrored branch not found: {e!r}")
                continue
            sid = session.base
            try:
                group = zarr.open_group(session.store, mode="r")
                got = {name: np.asarray(arr[:]) for name, arr in sorted(group.arrays())}
            except Exception as e:
                out.failures.append(f"{branch} at {sid}: read failed: {e!r}")
                continue
            out.reads += 1
            out.heads.append((branch, sid))
            if not _same(got, expected(sid)):
                out.failures.append(f"{branch} at {sid}: data differs from the source's")


def test_adversarial_replication_never_shows_an_incomplete_head_and_lag_stays_bounded(
    tmp_path: Path,
):
    rng = random.Random(20240611)
    n_chunks = 64
    source = zl.Repository.create(zl.Storage.local(tmp_path / "source"))
    dest = zl.Storage.local(tmp_path / "dest")
    write(source, "main", 0, "first", n=n_chunks)
    source.create_branch("dev", "main")
    write_chunks(source, "dev", 1, [0, 1], "dev starts")
    branches = ("main", "dev")

    # The mirror starts in sync (so lag is measured from a mirrored head on).
    mirror = Mirror(source, dest, copy=False)
    replicate(source.storage, dest)
    assert mirror.step().up_to_date

    replicator = Replicator(source.storage, dest, seed=rng.randrange(2**32))
    expected = SourceData(source)
    stop_readers, stop_writer, stop_promoter = (threading.Event() for _ in range(3))
    errors: list[BaseException] = []
    commits: list[tuple[float, str, str]] = []  # (time, branch, head)
    statuses: list[tuple[float, MirrorStatus]] = []
    observed = [Observed(), Observed()]

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    def writer() -> None:
        i = 2
        while not stop_writer.is_set():
            branch = "main" if i % 3 else "dev"
            if i % 15 == 0:  # a large commit: every chunk rewritten
                head = write(source, branch, i, f"large {i}", n=n_chunks)
            else:
                k = rng.randint(1, 3)
                head = write_chunks(source, branch, i, rng.sample(range(n_chunks), k), f"small {i}")
            commits.append((time.monotonic(), branch, head))
            i += 1

    def promoter() -> None:
        m = mirror
        passes = 0
        while not stop_promoter.is_set():
            statuses.append((time.monotonic(), m.step()))
            passes += 1
            if passes % 40 == 0:  # a restarted promoter: everything in memory is gone
                m = Mirror(source, dest, copy=False)
            time.sleep(0.01)

    threads = [
        threading.Thread(target=guarded(writer), name="writer"),
        threading.Thread(target=guarded(promoter), name="promoter"),
        *(
            threading.Thread(
                target=guarded(lambda o=o: _reader(dest, branches, expected, stop_readers, o)),
                name="reader",
            )
            for o in observed
        ),
    ]
    replicator.start()
    for t in threads:
        t.start()
    started = time.monotonic()
    run_for = 8.0
    try:
        # At least run_for seconds, and on a loaded machine until the writer has made the
        # commits the checks below count on (readers and passes run all the while).
        time.sleep(run_for)
        while len(commits) < 60 and time.monotonic() < started + 60 and not errors:
            time.sleep(0.1)
        run_for = time.monotonic() - started
    finally:
        stop_writer.set()
        threads[0].join()
        ended = time.monotonic()
        # Replication delivers the rest; the promoter catches up; readers keep reading.
        replicator.release()
        deadline = time.monotonic() + 30
        while not replicator.caught_up() and time.monotonic() < deadline and replicator.is_alive():
            time.sleep(0.05)
        final = {b: source.lookup_branch(b) for b in branches}
        while time.monotonic() < deadline and not errors:
            if statuses and statuses[-1][0] > time.monotonic() - 0.5:
                shown = zl.Repository.open(dest).list_branches()
                if all(shown.get(b) == final[b] for b in branches):
                    break
            time.sleep(0.05)
        time.sleep(0.2)  # readers see the final heads too
        stop_promoter.set()
        stop_readers.set()
        replicator.stop.set()
        for t in threads:
            t.join()
        replicator.join()

    assert not errors, errors
    assert not replicator.errors, replicator.errors

    # 1. Zero reads of an incomplete head: every read succeeded and equalled the source's data.
    failures = [f for o in observed for f in o.failures]
    assert not failures, failures[:10]
    reads = sum(o.reads for o in observed)

    # The scenario was adversarial: replication held objects back and delivered some twice, the
    # promoter met heads whose objects had not all arrived, the source committed a lot.
    n_commits = len(commits)
    assert n_commits >= 40, n_commits
    assert replicator.stats["withheld"] > 0 and replicator.stats["duplicates"] > 0
    assert any(r.missing_objects > 0 for _, s in statuses for r in s.refs)

    # 2. Each branch only ever moved forward along the source's first-parent history.
    mirror_repo = zl.Repository.open(dest)
    for branch in branches:
        chain = first_parent_chain(source, final[branch])
        position = {sid: i for i, sid in enumerate(chain)}
        for o in observed:
            seen = [position.get(sid, -1) for b, sid in o.heads if b == branch]
            assert -1 not in seen, f"{branch}: a head off the source's first-parent history"
            assert seen == sorted(seen), f"{branch} moved backwards for a reader"
        journal = [e.snapshot for e in mirror_repo.core.journal.history(branch)][::-1]
        assert all(sid in position for sid in journal)
        assert [position[s] for s in journal] == sorted({position[s] for s in journal})
        assert journal[-1] == final[branch]
        distinct = {sid for o in observed for b, sid in o.heads if b == branch}
        assert len(distinct) >= 3, f"{branch}: readers saw only {len(distinct)} heads"
    assert reads >= 20, reads

    # 3. Lag stays bounded: it does not grow with the number of source commits. Passes while
    # the writer ran, first half against second half. The growth checks take both branches
    # together (commits behind summed, seconds behind the larger) in each pass: a mirror
    # falling steadily behind is ~3x as far behind in the second half on every branch, while
    # one branch alone is noise (dev gets a third of the commits, a large one every 15: its
    # mean swings from 2 to 7 commits between identical runs).
    during = [(t, s) for t, s in statuses if started <= t <= ended]
    middle = started + (ended - started) / 2
    first = [s for t, s in during if t < middle]
    second = [s for t, s in during if t >= middle]
    assert len(first) >= 5 and len(second) >= 5, (len(first), len(second))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def behind(s: MirrorStatus) -> tuple[int, float]:
        refs = [s.ref(b) for b in branches]
        return sum(r.commits_behind for r in refs), max(r.seconds_behind for r in refs)

    c1, s1 = (mean(x) for x in zip(*map(behind, first), strict=True))
    c2, s2 = (mean(x) for x in zip(*map(behind, second), strict=True))
    detail = f"commits behind {c1:.1f} -> {c2:.1f}, seconds {s1:.2f} -> {s2:.2f}"
    assert c2 <= 2 * c1 + 3, detail
    assert s2 <= 2 * s1 + 0.5, detail
    for branch in branches:
        # Bounded by the replication delay (at most ~1.3 s here) plus a few passes, not by the
        # length of the run: a mirror that stalled would be ~run_for seconds behind.
        worst = max(s.ref(branch).seconds_behind for _, s in during)
        assert worst < 0.6 * run_for, f"{branch}: worst {worst:.2f} s; {detail}"

    assert mirror_repo.fsck().ok
    for branch in branches:
        assert _same(read_all(mirror_repo, branch), read_all(source, branch))


# -- hypothesis-chosen schedules -------------------------------------------------------------------

SCHEDULE_CHUNKS = 16
BRANCHES = ("main", "dev", "feature")
TAGS = ("v1", "v2", "v3")


class MirrorSchedule(RuleBasedStateMachine):
    """The source, bucket replication and the promoter, interleaved as hypothesis chooses.

    Replication copies any subset of the source's objects in any order (again, sometimes), can
    hold some back until released, and never has to deliver a commit's objects together. After
    every step: every ref the destination shows has complete data equal to the source's for that
    snapshot, and points where the source's ref pointed at the journal entry it names; refs move
    forward only; tags never change once shown. Whenever every source object has arrived, one
    promotion makes the mirror exactly the source.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="zl-mirror-schedule-"))
        self.source = zl.Repository.create(zl.Storage.local(self.dir / "source"))
        write(self.source, "main", 0, "first", n=SCHEDULE_CHUNKS)
        self.dest = zl.Storage.local(self.dir / "dest")
        self.mirror = Mirror(self.source, self.dest, copy=False)
        self.replicated: set[str] = set()
        self.withheld: set[str] = set()
        self.tag_targets: dict[str, str] = {}  # every tag the source ever had: its snapshot
        self.shown: dict[str, tuple[int | None, str | None]] = {}  # branch -> (token, head)
        self.shown_tags: dict[str, str] = {}
        self.expected = SourceData(self.source)
        self.seed = 1
        self.steps = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the source -----------------------------------------------------------------------------

    def _live(self) -> list[str]:
        return sorted(self.source.list_branches())

    @rule(
        which=st.integers(0, 5),
        chunks=st.sets(st.integers(0, SCHEDULE_CHUNKS - 1), min_size=1),
        and_step=st.booleans(),
    )
    def commit(self, which: int, chunks: set[int], and_step: bool) -> None:
        live = self._live()
        self.seed += 1
        write_chunks(self.source, live[which % len(live)], self.seed, chunks, f"c{self.seed}")
        if and_step:
            self.step()

    @rule(name=st.sampled_from(BRANCHES[1:]), which=st.integers(0, 5))
    def create_branch(self, name: str, which: int) -> None:
        live = self._live()
        if name not in live:
            self.source.create_branch(name, live[which % len(live)])

    @rule(name=st.sampled_from(BRANCHES[1:]))
    def delete_branch(self, name: str) -> None:
        if name in self._live():
            self.source.delete_branch(name)

    @rule(name=st.sampled_from(TAGS), which=st.integers(0, 5))
    def create_tag(self, name: str, which: int) -> None:
        if name not in self.tag_targets:  # a tag name is never reused
            live = self._live()
            self.tag_targets[name] = self.source.create_tag(name, live[which % len(live)])

    @rule(name=st.sampled_from(TAGS))
    def delete_tag(self, name: str) -> None:
        if name in self.source.list_tags():
            self.source.delete_tag(name)

    # -- replication ----------------------------------------------------------------------------

    def _pending(self) -> list[str]:
        return sorted(set(self.source.storage.list_keys("")) - self.replicated - self.withheld)

    def _deliver(self, keys: list[str]) -> None:
        for key in keys:
            try:
                data = self.source.storage.get(key)
            except ObjectNotFound:
                # Deleted at the source since it was listed (an old head's marker): nothing
                # to deliver. A mirror never reads the source's refs, copied or not.
                continue
            self.dest.put(key, data)
            self.replicated.add(key)

    @rule(
        rnd=st.randoms(use_true_random=False),
        fraction=st.floats(0, 1),
        again=st.booleans(),
        and_step=st.booleans(),
    )
    def replicate_some(
        self, rnd: random.Random, fraction: float, again: bool, and_step: bool
    ) -> None:
        pending = self._pending()
        keys = rnd.sample(pending, round(len(pending) * fraction))
        if again and self.replicated:  # duplicate deliveries of objects already there
            keys += rnd.sample(sorted(self.replicated), min(3, len(self.replicated)))
        self._deliver(keys)
        if and_step:
            self.step()

    @rule(rnd=st.randoms(use_true_random=False), data_first=st.booleans(), and_step=st.booleans())
    def replicate_all(self, rnd: random.Random, data_first: bool, and_step: bool) -> None:
        keys = self._pending()
        rnd.shuffle(keys)
        keys.sort(key=lambda k: _is_data(k) != data_first)
        self._deliver(keys)
        if and_step:
            self.step()

    @rule(rnd=st.randoms(use_true_random=False), fraction=st.floats(0, 1))
    def withhold(self, rnd: random.Random, fraction: float) -> None:
        pending = self._pending()
        self.withheld.update(rnd.sample(pending, round(len(pending) * fraction)))

    @rule()
    def release(self) -> None:
        self.withheld.clear()

    # -- the promoter ---------------------------------------------------------------------------

    @rule()
    def step(self) -> None:
        self.steps += 1
        everything_here = set(self.source.storage.list_keys("")) <= self.replicated
        status = self.mirror.step()
        assert all(r.error is None for r in status.refs), status
        for what in status.promoted:
            event(f"promoted {what.split()[0]}{' (deleted)' if 'deleted' in what else ''}")
        if any(r.mirrored_head not in (None, r.source_head) for r in status.refs):
            event("a ref shows an earlier head than the source's")
        if everything_here:
            self._assert_in_sync(status)

    @rule()
    def restart(self) -> None:
        self.mirror = Mirror(self.source, self.dest, copy=False)

    @rule()
    def sync(self) -> None:
        self.withheld.clear()
        self.replicate_all(random.Random(0), data_first=False, and_step=False)
        self._assert_in_sync(self.mirror.step())

    def _assert_in_sync(self, status: MirrorStatus) -> None:
        mirror = zl.Repository.open(self.dest)
        assert mirror.list_branches() == self.source.list_branches()
        assert mirror.list_tags() == self.source.list_tags()
        assert status.up_to_date, status
        assert all(r.missing_objects == 0 and r.commits_behind == 0 for r in status.refs)

    # -- what the destination shows, after every step -------------------------------------------

    @invariant()
    def mirror_shows_only_complete_source_heads_moving_forward(self) -> None:
        mirror = zl.Repository.open(self.dest)
        assert mirror.record.mirror_of == self.source.storage.url
        journal, source_journal = mirror.core.journal, self.source.core.journal
        assert set(journal.names()) <= set(BRANCHES)
        for name in journal.names():
            entry = journal.head(name)
            assert entry is not None
            token, sid = entry.token, entry.snapshot
            if sid is not None:
                # Complete, and the source's data for that snapshot.
                assert _same(read_all(mirror, name), self.expected(sid)), (name, sid)
            # Where the source's branch pointed at the journal entry the mirror names.
            if token is not None:
                shown = source_journal.read_entry(source_journal.entry_key(name, token))
                assert shown.snapshot == sid, (name, token, sid, shown.snapshot)
            else:
                assert sid is None  # only a delete of a branch whose journal is gone names none
            before_token, before_sid = self.shown.get(name, (None, None))
            if before_token is not None:
                assert token is not None and token >= before_token, (name, before_token, token)
                between = [
                    source_journal.read_entry(source_journal.entry_key(name, seq)).snapshot
                    for seq in range(before_token + 1, token + 1)
                ]
                if before_sid is not None and sid is not None and None not in between:
                    # No delete in between: forward along the source's first-parent history.
                    assert before_sid in first_parent_chain(self.source, sid), (name, sid)
            self.shown[name] = (token, sid)
        for name, sid in mirror.list_tags().items():
            assert sid == self.tag_targets[name]
            assert self.shown_tags.setdefault(name, sid) == sid
            assert _same(read_all(mirror, name), self.expected(sid)), (name, sid)


def test_hypothesis_schedules_keep_the_mirror_complete_and_forward_only() -> None:
    run_state_machine_as_test(
        MirrorSchedule,
        settings=settings(max_examples=25, stateful_step_count=30, deadline=None),
    )
