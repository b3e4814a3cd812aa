"""Leader election on a Lease (zarrlake_operator.leader) against the emulated API server.

Each test has an API server of its own (one test stops it). The electors are in this process and
talk through the operator's own client; a recording wrapper around that client tells what each
elector asked.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zarrlake_operator import kube
from zarrlake_operator.leader import Elector, LeaseSettings, micro_time
from zarrlake_testkit.kubeapi import KubeAPI

NAMESPACE = "default"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
# Short, so the tests are quick; the ratios are the operator's defaults (10 s, 7 s, 2 s, 4 s).
DURATION, DEADLINE, RETRY, RENEW = 3.0, 2.1, 0.6, 1.2


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeAPI]:
    server = KubeAPI(audit_log=tmp_path / "audit.jsonl").start()
    try:
        kube.use_kubeconfig(str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        yield server
    finally:
        server.stop()
        # The kube client is process-wide: give it back to the shared operator tests' cluster.
        if os.environ.get("KUBECONFIG"):
            kube.use_kubeconfig(os.environ["KUBECONFIG"])


class Recorder:
    """The operator's real client, noting each request's verb and answer (status or "ok")."""

    def __init__(self, before: Callable[[str], None] | None = None) -> None:
        self.requests: list[tuple[str, str]] = []
        self.before = before

    def __call__(self, verb: str, path: str, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before(verb)
        try:
            answer = kube._call(verb, path, **kwargs)
        except kube.KubeError as e:
            self.requests.append((verb, str(e.status)))
            raise
        self.requests.append((verb, "ok"))
        return answer

    def writes(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[0] != "GET"]

    def count(self, verb: str) -> int:
        return sum(1 for r in self.requests if r[0] == verb)


class WatchRecorder:
    """The operator's real watch, noting each watch request's query (or what fails it first:
    ``fail`` is called before each request and may raise)."""

    def __init__(self, fail: Callable[[int], None] | None = None) -> None:
        self.queries: list[dict[str, str]] = []
        self.fail = fail

    def __call__(self, path: str, query: dict[str, str], **kwargs: Any) -> kube.WatchStream:
        self.queries.append(dict(query))
        if self.fail is not None:
            self.fail(len(self.queries))
        return kube.watch(path, query, **kwargs)


class Standby:
    """An elector standing by (``acquire``) on a thread of its own."""

    def __init__(self, elector: Elector) -> None:
        self.elector = elector
        self.stop = threading.Event()
        self.acquired_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.elector.acquire(self.stop):
            self.acquired_at = time.monotonic()

    def wait_acquired(self, timeout: float) -> float:
        self.thread.join(timeout)
        assert self.acquired_at is not None, "the standby did not take the Lease"
        return self.acquired_at

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def wait_until(what: str, condition: Callable[[], Any], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def settings(name: str, who: str, **kwargs: float) -> LeaseSettings:
    times = {
        "duration": DURATION,
        "renew_deadline": DEADLINE,
        "retry_period": RETRY,
        "renew_interval": RENEW,
        **kwargs,
    }
    return LeaseSettings(name=name, namespace=NAMESPACE, identity=who, **times)


def lease(name: str) -> dict[str, Any]:
    found = kube._call("GET", f"{LEASES}/{name}")
    assert isinstance(found, dict)
    return found


def race(electors: list[Elector]) -> list[bool]:
    """Every elector's one attempt, started together."""
    start = threading.Barrier(len(electors))
    results: list[bool | None] = [None] * len(electors)

    def attempt(i: int) -> None:
        start.wait()
        results[i] = electors[i].try_acquire_or_renew(timeout=10)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(electors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None for r in results)
    return [bool(r) for r in results]


def test_the_emulated_api_refuses_a_stale_lease_put_with_409(api: KubeAPI) -> None:
    body = {"metadata": {"name": "stale"}, "spec": {"holderIdentity": "a"}}
    created = kube._call("POST", LEASES, body=body)
    first = created["metadata"]["resourceVersion"]
    renewed = kube._call(
        "PUT", f"{LEASES}/stale", body={**created, "spec": {"holderIdentity": "a", "x": 1}}
    )
    assert renewed["metadata"]["resourceVersion"] != first
    with pytest.raises(kube.KubeError) as refused:
        kube._call("PUT", f"{LEASES}/stale", body={**created, "spec": {"holderIdentity": "b"}})
    assert refused.value.status == 409
    with pytest.raises(kube.KubeError) as exists:
        kube._call("POST", LEASES, body=body)
    assert exists.value.status == 409
    assert lease("stale")["spec"]["holderIdentity"] == "a"


def test_racing_electors_get_exactly_one_leader(api: KubeAPI) -> None:
    for round_ in range(4):
        name = f"race-{round_}"
        # No Lease yet: every elector creates it at once; the API server keeps one.
        electors = [Elector(settings(name, f"replica-{i}")) for i in range(3)]
        won = race(electors)
        assert won.count(True) == 1, won
        leader = electors[won.index(True)]
        spec = lease(name)["spec"]
        assert spec["holderIdentity"] == leader.settings.identity
        assert spec["leaseDurationSeconds"] == 3 and spec["leaseTransitions"] == 0
        assert MICRO_TIME.match(spec["acquireTime"]) and MICRO_TIME.match(spec["renewTime"])
        # The others stand by while it renews; it keeps it.
        for _ in range(2):
            assert leader.try_acquire_or_renew()
            assert [e.try_acquire_or_renew() for e in electors if e is not leader] == [False] * 2
        assert lease(name)["spec"]["holderIdentity"] == leader.settings.identity


def test_two_electors_writing_the_same_version_one_gets_409(api: KubeAPI) -> None:
    name = "put-race"
    first = Elector(settings(name, "first"))
    assert first.try_acquire_or_renew()
    assert first.release()  # free: both may take it, from the same resourceVersion
    # Each waits at the PUT until both have read the Lease: the two writes carry one version.
    both_read = threading.Barrier(2)

    def hold_puts(verb: str) -> None:
        if verb == "PUT":
            both_read.wait(10)

    recorders = [Recorder(hold_puts), Recorder(hold_puts)]
    electors = [Elector(settings(name, f"racer-{i}"), r) for i, r in enumerate(recorders)]
    won = race(electors)
    assert won.count(True) == 1, won
    outcomes = sorted(r.writes()[0] for r in recorders)
    assert outcomes == [("PUT", "409"), ("PUT", "ok")]
    spec = lease(name)["spec"]
    assert spec["holderIdentity"] == electors[won.index(True)].settings.identity
    assert spec["leaseTransitions"] == 1  # first took it from nobody once before: 0 -> 1


def test_a_standby_writes_nothing_and_takes_over_only_after_the_duration(api: KubeAPI) -> None:
    name = "standby"
    leader = Elector(settings(name, "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    lost: list[str] = []
    threads = leader.hold(holding, lost.append)
    recorder = Recorder()
    standby = Elector(settings(name, "standby"), recorder)
    # Three lease durations of standing by while the leader renews: never the Lease, and not
    # one write — only reads of the Lease.
    deadline = time.monotonic() + 3 * DURATION
    while time.monotonic() < deadline:
        assert not standby.try_acquire_or_renew()
        time.sleep(RETRY)
    assert recorder.requests and recorder.writes() == []
    assert standby.holder == "leader" and lost == []
    renewals = lease(name)["spec"]
    assert renewals["renewTime"] > renewals["acquireTime"]

    # The leader stops renewing without a word (as if SIGKILLed): the standby takes over once
    # the record it saw last has not changed for the duration, by its own clock.
    holding.set()
    for t in threads:
        t.join(5)
    stopped = time.monotonic()
    stop = threading.Event()
    assert standby.acquire(stop)
    waited = time.monotonic() - stopped
    assert DURATION - RETRY - 0.5 <= waited <= DURATION + 2 * RETRY + 1.5, waited
    spec = lease(name)["spec"]
    assert spec["holderIdentity"] == "standby" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"]


@pytest.mark.parametrize("outage", ["stopped", "frozen"])
def test_a_leader_that_cannot_reach_the_api_stops_before_the_lease_expires(
    api: KubeAPI, outage: str
) -> None:
    """Stopped: every request is refused at once. Frozen (SIGSTOP): requests hang, so only a
    watchdog independent of them can stop the leader in time."""
    leader = Elector(settings("unreachable", "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    lost: list[tuple[float, str]] = []
    leader.hold(holding, lambda why: lost.append((time.monotonic(), why)))
    time.sleep(2 * RETRY)  # a renewal or two went through
    assert api.proc is not None
    if outage == "stopped":
        api.stop()
    else:
        api.proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + DURATION + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost, "the leader kept acting without its Lease"
        at, why = lost[0]
        last_renewal = leader.renewed_at
        assert "could not be renewed" in why
        # It kept trying up to the renew deadline, and stopped before a standby that saw the
        # last renewal the moment it was sent could take the Lease.
        assert last_renewal + DEADLINE - 0.05 <= at < last_renewal + DURATION, at - last_renewal
        assert at - last_renewal <= DEADLINE + 0.5
        time.sleep(RETRY)
        assert len(lost) == 1  # once
    finally:
        holding.set()
        if outage == "frozen" and api.proc is not None:
            api.proc.send_signal(signal.SIGCONT)


def test_a_leader_whose_lease_is_deleted_stops_at_once(api: KubeAPI) -> None:
    """A Lease deleted by hand may be created anew by a standby at once (its watch shows the
    deletion): the leader's next renewal, answered 404, ends leadership then — not at the renew
    deadline, which would leave two leaders acting until it."""
    leader = Elector(settings("deleted", "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    lost: list[tuple[float, str]] = []
    leader.hold(holding, lambda why: lost.append((time.monotonic(), why)))
    try:
        kube._call("DELETE", f"{LEASES}/deleted")
        deleted = time.monotonic()
        deadline = deleted + DEADLINE + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost, "the leader kept acting without a Lease"
        at, why = lost[0]
        assert why == "the Lease was taken by someone who cleared it", why
        assert at - deleted <= RENEW + 1.0, at - deleted  # at its next renewal
        assert not leader.leading
        with pytest.raises(kube.KubeError):  # and it did not create the Lease again
            kube._call("GET", f"{LEASES}/deleted")
    finally:
        holding.set()


def test_a_leader_whose_lease_is_taken_stops_at_once(api: KubeAPI) -> None:
    leader = Elector(settings("stolen", "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    lost: list[tuple[float, str]] = []
    leader.hold(holding, lambda why: lost.append((time.monotonic(), why)))
    try:
        current = lease("stolen")
        spec = {**current["spec"], "holderIdentity": "thief", "renewTime": micro_time()}
        kube._call("PUT", f"{LEASES}/stolen", body={**current, "spec": spec})
        taken = time.monotonic()
        deadline = taken + DEADLINE + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost, "the leader kept acting on a Lease another holder has"
        at, why = lost[0]
        assert why == "the Lease was taken by thief"
        assert at - taken <= RENEW + 1.0, at - taken  # at its next renewal, not the deadline
        assert lease("stolen")["spec"]["holderIdentity"] == "thief"  # it did not fight back
    finally:
        holding.set()


def test_release_hands_the_lease_over_at_once(api: KubeAPI) -> None:
    leader = Elector(settings("release", "leader"))
    assert leader.try_acquire_or_renew()
    standby = Elector(settings("release", "standby"))
    assert not standby.try_acquire_or_renew()
    assert leader.release()
    spec = lease("release")["spec"]
    assert "holderIdentity" not in spec and spec["leaseDurationSeconds"] == 1
    assert not leader.release()  # not the holder any more: nothing to give up
    # The standby's very next attempt takes it: no waiting for the duration.
    assert standby.try_acquire_or_renew()
    spec = lease("release")["spec"]
    assert spec["holderIdentity"] == "standby" and spec["leaseTransitions"] == 1
    assert spec["leaseDurationSeconds"] == 3


def test_settings_are_checked() -> None:
    for bad in (
        {"duration": 5.0, "renew_deadline": 5.0},
        {"renew_deadline": 0.5, "retry_period": 0.5},
        {"retry_period": 0.0, "renew_deadline": 0.1},
    ):
        with pytest.raises(ValueError, match="lease duration > renew deadline > retry period"):
            settings("x", "y", **bad)
    for interval in (DEADLINE, DEADLINE + 1, 0.0):
        with pytest.raises(ValueError, match="renew deadline > renew interval > 0"):
            settings("x", "y", renew_interval=interval)
    with pytest.raises(ValueError, match="holder identity"):
        settings("x", "")


def test_the_default_renew_interval_follows_the_renew_deadline() -> None:
    """4 s when the deadline allows it, else half the deadline: timings that worked before the
    interval existed still work; an interval that leaves no room for a retry is warned about."""
    default = LeaseSettings("x", "ns", "me")
    assert (default.renew_deadline, default.interval, default.warnings()) == (7.0, 4.0, [])
    short = LeaseSettings("x", "ns", "me", duration=5.0, renew_deadline=3.0, retry_period=1.0)
    assert short.interval == 1.5 and short.warnings() == []
    tight = LeaseSettings("x", "ns", "me", renew_deadline=7.0, retry_period=2.0, renew_interval=5.0)
    assert tight.interval == 5.0
    [warning] = tight.warnings()
    assert "one failed renewal ends leadership" in warning
    assert MICRO_TIME.match(micro_time(0.5)) and micro_time(0.5).endswith(".500000Z")


def test_a_standby_watches_instead_of_reading_and_takes_over_after_the_duration(
    api: KubeAPI,
) -> None:
    name = "watched"
    leader = Elector(settings(name, "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    lost: list[str] = []
    threads = leader.hold(holding, lost.append)
    reads, watches = Recorder(), WatchRecorder()
    standby = Standby(Elector(settings(name, "standby"), reads, watches))
    try:
        # Three lease durations of a healthy leader: the standby read the Lease once and opened
        # one watch (polling would have read it 15 times); it wrote nothing and took nothing.
        wait_until("the standby's watch", lambda: watches.queries)
        time.sleep(3 * DURATION)
        assert standby.acquired_at is None and lost == []
        assert reads.writes() == []
        # One read; a second only if the machine was so loaded that no renewal came through
        # the watch for a whole duration (the read at expiry then finds the renewal instead).
        assert 1 <= reads.count("GET") <= 2, reads.requests
        assert 1 <= len(watches.queries) <= 2, watches.queries
        query = watches.queries[0]
        assert query["fieldSelector"] == f"metadata.name={name}"
        assert query["allowWatchBookmarks"] == "true" and query["resourceVersion"]
        assert standby.elector.holder == "leader"
        # The watch showed every renewal: the standby's clock runs from the last one.
        assert time.monotonic() - standby.elector._observed_at < DURATION

        # The leader stops renewing without a word (as if SIGKILLed): the standby takes over
        # once the last renewal it saw has not changed for the duration, by its own clock.
        holding.set()
        for t in threads:
            t.join(5)
        stopped = time.monotonic()
        before = reads.count("GET")
        waited = standby.wait_acquired(DURATION + 30) - stopped
        assert DURATION - RENEW - 0.5 <= waited <= DURATION + 3, waited
        assert reads.count("GET") == before + 1  # the read at expiry, then the PUT
        assert reads.writes() == [("PUT", "ok")]
        spec = lease(name)["spec"]
        assert spec["holderIdentity"] == "standby" and spec["leaseTransitions"] == 1
    finally:
        holding.set()
        standby.close()


def test_a_watch_the_server_ends_is_opened_again_and_a_release_is_taken_at_once(
    api: KubeAPI,
) -> None:
    name = "rewatched"
    leader = Elector(settings(name, "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    lost: list[str] = []
    threads = leader.hold(holding, lost.append)
    reads, watches = Recorder(), WatchRecorder()
    # The server ends each watch after 2 s (a bookmark comes with it): the standby opens the
    # next one from the last resourceVersion it saw, without reading the Lease again. Its
    # retry period is long: were it to find the release by reading, it would be that late.
    slow = {"duration": 20.0, "renew_deadline": 10.0, "retry_period": 8.0, "renew_interval": 4.0}
    standby = Standby(Elector(settings(name, "standby", watch_timeout=2, **slow), reads, watches))
    try:
        wait_until("the standby's fourth watch", lambda: len(watches.queries) >= 4, 60)
        assert standby.acquired_at is None and lost == []
        assert reads.writes() == [] and 1 <= reads.count("GET") <= 2, reads.requests
        versions = [int(q["resourceVersion"]) for q in watches.queries]
        assert versions == sorted(versions) and versions[-1] > versions[0], versions

        # The leader hands over (a clean shutdown): the watch shows the release, and the
        # standby takes the Lease at once, not a duration later.
        holding.set()
        for t in threads:
            t.join(5)
        before = reads.count("GET")
        assert leader.release()
        released = time.monotonic()
        waited = standby.wait_acquired(30) - released
        assert waited < slow["retry_period"] / 2, waited
        assert reads.count("GET") == before + 1 and reads.writes() == [("PUT", "ok")]
        spec = lease(name)["spec"]
        assert spec["holderIdentity"] == "standby" and spec["leaseTransitions"] == 1
    finally:
        holding.set()
        standby.close()


def test_a_standby_reads_the_lease_again_after_410_gone(api: KubeAPI) -> None:
    name = "gone"
    leader = Elector(settings(name, "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    leader.hold(holding, lambda why: None)

    def gone_once(n: int) -> None:
        if n == 1:  # as an API server answers a resourceVersion it no longer has
            raise kube.KubeError("WATCH: 410 too old resource version", 410)

    reads, watches = Recorder(), WatchRecorder(gone_once)
    standby = Standby(Elector(settings(name, "standby"), reads, watches))
    try:
        wait_until("a second watch", lambda: len(watches.queries) >= 2)
        time.sleep(DURATION)
        assert standby.acquired_at is None
        # Read at the start, and again for a fresh resourceVersion after the 410; then watched.
        assert 2 <= reads.count("GET") <= 3 and reads.writes() == [], reads.requests
        assert len(watches.queries) == 2, watches.queries
        # The second starts from what that read found (nothing older than the first's).
        assert int(watches.queries[1]["resourceVersion"]) >= int(
            watches.queries[0]["resourceVersion"]
        )
    finally:
        holding.set()
        standby.close()


def test_a_standby_that_cannot_watch_reads_every_retry_period_instead(
    api: KubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    name = "unwatchable"
    leader = Elector(settings(name, "leader"))
    assert leader.try_acquire_or_renew()
    holding = threading.Event()
    threads = leader.hold(holding, lambda why: None)

    def forbidden(n: int) -> None:  # a Role without the watch verb
        raise kube.KubeError('WATCH: 403 leases is forbidden: cannot "watch"', 403)

    reads, watches = Recorder(), WatchRecorder(forbidden)
    standby = Standby(Elector(settings(name, "standby"), reads, watches))
    try:
        # Three watches fail (one per retry period), then it reads every retry period.
        wait_until("three watches", lambda: len(watches.queries) >= 3)
        wait_until("reads every retry period", lambda: reads.count("GET") >= 4, 30)
        assert standby.acquired_at is None and reads.writes() == []
        assert len(watches.queries) == 3  # not again within the minute
        assert "watching failed 3 times in a row" in caplog.text
        # ... and still takes over when the leader stops renewing.
        holding.set()
        for t in threads:
            t.join(5)
        stopped = time.monotonic()
        waited = standby.wait_acquired(DURATION + 30) - stopped
        assert waited <= DURATION + RETRY + 3, waited
        assert lease(name)["spec"]["holderIdentity"] == "standby"
    finally:
        holding.set()
        standby.close()
