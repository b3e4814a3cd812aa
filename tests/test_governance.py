"""Branch protection and checks (issue 42): each rule and each shipped check, allowed and refused,
through the client and the CLI, on every storage; a refusal changes nothing; the rules are
repository state that other clients (and older ones) obey.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake import checks
from zarrlake.format import model
from zarrlake.rules import BranchRule


def _write(repo: zarrlake.Repository, branch: str, fn: Callable[[Any], None], msg: str) -> str:
    session = repo.writable_session(branch)
    fn(zarr.open_group(session.store, mode="a"))
    return session.commit(msg)


def _seed(repo: zarrlake.Repository) -> str:
    def make(g: Any) -> None:
        t = g.create_array("t", shape=(4, 4), chunks=(2, 2), dtype="f4")
        t.attrs.update(units="K", long_name="temperature")
        t[:] = 1.0

    return _write(repo, "main", make, "seed")


def _set(path: str, value: Any, where: tuple[Any, ...] = (0, 0)) -> Callable[[Any], None]:
    def fn(g: Any) -> None:
        g[path][where] = value

    return fn


def _values(repo: zarrlake.Repository, ref: str = "main") -> np.ndarray:
    return zarr.open_array(repo.readonly_session(ref).store, path="t")[:]


# -- rules as repository state -------------------------------------------------------------------


def test_rules_are_recorded_in_the_repository_and_seen_by_a_fresh_client(
    storage: zarrlake.Storage,
) -> None:
    repo = zarrlake.Repository.create(storage)
    assert repo.branch_protection() == {}
    rule = repo.protect_branch("main", required_checks=["no-nan"])
    assert rule == BranchRule(require_merge=True, required_checks=("no-nan",))
    repo.protect_branch("release", require_merge=False, allow_delete=True)
    fresh = zarrlake.Repository.open(storage)
    assert fresh.branch_protection() == {
        "main": BranchRule(True, False, False, ("no-nan",)),
        "release": BranchRule(False, True, False, ()),
    }
    assert model.GOVERNANCE in fresh.record.features
    # Replacing and removing rules; removing a rule a branch does not have is no error.
    repo.protect_branch("main", allow_reset=True)
    repo.unprotect_branch("release")
    repo.unprotect_branch("never-protected")
    assert zarrlake.Repository.open(storage).branch_protection() == {
        "main": BranchRule(True, False, True, ())
    }


def test_a_client_of_a_governed_repository_sees_rules_set_after_it_opened(
    storage: zarrlake.Storage,
) -> None:
    admin = zarrlake.Repository.create(storage)
    _seed(admin)
    admin.protect_branch("release")  # the repository has rules: its clients read them anew
    writer = zarrlake.Repository.open(storage)
    session = writer.writable_session("main")
    zarr.open_array(session.store, path="t")[0, 0] = 2.0
    admin.protect_branch("main")
    with pytest.raises(zarrlake.BranchProtected):
        session.commit("direct, after main was protected")
    admin.unprotect_branch("main")
    session.commit("direct, after main was unprotected")  # the session kept its changes
    assert _values(admin)[0, 0] == 2.0


def test_two_clients_changing_rules_at_once_both_land() -> None:
    storage = zarrlake.Storage.memory()
    zarrlake.Repository.create(storage)
    clients = [zarrlake.Repository.open(storage) for _ in range(6)]
    barrier = threading.Barrier(len(clients))
    errors: list[BaseException] = []

    def protect(i: int) -> None:
        barrier.wait()
        try:
            clients[i].protect_branch(f"b{i}")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=protect, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rules = zarrlake.Repository.open(storage).branch_protection()
    assert sorted(rules) == [f"b{i}" for i in range(len(clients))]
    assert clients[0]._governance.protection().generation == len(clients)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"required_checks": "no-nan"}, "list of check names"),
        ({"required_checks": ["Bad Name"]}, "not a check name"),
        ({"required_checks": ["no-nan", "no-nan"]}, "twice"),
        ({"required_checks": ["not-installed"]}, "no check named 'not-installed'"),
        ({"require_merge": "yes"}, "True or False"),
        ({"required_checks": ["array-rules"]}, "array-rules needs rules"),
        ({"check_options": {"no-nan": {}}}, "not required"),
        (
            {"required_checks": ["required-attributes"],
             "check_options": {"required-attributes": {"colour": 1}}},
            "refuses its options",
        ),
        (
            {"required_checks": ["no-nan"], "check_options": {"no-nan": {"timeout_s": -1}}},
            "timeout_s",
        ),
    ],
)  # fmt: skip
def test_bad_rules_are_refused_and_change_nothing(kwargs: dict[str, Any], says: str) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    repo.protect_branch("main", allow_delete=True)
    before = repo.branch_protection()
    with pytest.raises(zarrlake.InvalidArgument, match=says):
        repo.protect_branch("main", **kwargs)
    assert repo.branch_protection() == before


def test_a_bad_branch_name_is_refused() -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    with pytest.raises(zarrlake.InvalidName):
        repo.protect_branch("../main")
    assert repo.branch_protection() == {}


def test_a_zarrlake_that_does_not_know_the_rules_refuses_to_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = zarrlake.Storage.memory()
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    repo.protect_branch("main")
    # An older zarrlake: it knows every feature but this one.
    monkeypatch.setattr(model, "KNOWN_FEATURES", model.KNOWN_FEATURES - {model.GOVERNANCE})
    old = zarrlake.Repository.open(storage)
    with pytest.raises(zarrlake.UnsupportedFormat, match=r"governance \(zarrlake >= 0.4\)"):
        _write(old, "main", _set("t", 9.0), "an old client's direct commit")
    with pytest.raises(zarrlake.UnsupportedFormat):
        old.reset_branch("main", "main")
    assert old.readonly_session("main")  # it still reads
    assert _values(old)[0, 0] == 1.0


# -- the rules -----------------------------------------------------------------------------------


def test_require_merge_refuses_direct_commits_and_takes_merges(
    storage: zarrlake.Storage,
) -> None:
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    repo.protect_branch("main")
    head = repo.lookup_branch("main")
    with pytest.raises(zarrlake.BranchProtected) as refused:
        _write(repo, "main", _set("t", 5.0), "direct")
    assert (refused.value.branch, refused.value.rule) == ("main", "require_merge")
    assert "merges only" in str(refused.value)
    assert repo.lookup_branch("main") == head
    repo.create_branch("dev")
    _write(repo, "dev", _set("t", 5.0), "on dev")
    merged = repo.merge("dev", "main")
    assert repo.lookup_branch("main") == merged != head
    assert _values(repo)[0, 0] == 5.0
    # Other branches are not affected; and a rule without require_merge takes direct commits.
    _write(repo, "dev", _set("t", 6.0), "dev is free")
    repo.protect_branch("main", require_merge=False)
    _write(repo, "main", _set("t", 7.0), "direct, allowed")
    assert _values(repo)[0, 0] == 7.0


def test_reset_and_delete_need_their_rule(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    first = _seed(repo)
    repo.create_branch("release")
    _write(repo, "release", _set("t", 3.0), "on release")
    head = repo.lookup_branch("release")
    repo.protect_branch("release", require_merge=False)
    with pytest.raises(zarrlake.BranchProtected) as refused:
        repo.reset_branch("release", first)
    assert refused.value.rule == "allow_reset"
    with pytest.raises(zarrlake.BranchProtected) as refused:
        repo.delete_branch("release")
    assert refused.value.rule == "allow_delete"
    assert repo.lookup_branch("release") == head
    repo.protect_branch("release", require_merge=False, allow_reset=True, allow_delete=True)
    assert repo.reset_branch("release", first) == first
    repo.delete_branch("release")
    assert "release" not in repo.list_branches()


def test_compaction_of_a_protected_branch_is_no_direct_commit(
    chunk_objects: None,
) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())

    def make(g: Any) -> None:
        g.create_array("t", shape=(128, 128), chunks=(64, 64), dtype="f4").attrs["units"] = "K"

    _write(repo, "main", make, "seed")
    for i in range(4):
        _write(repo, "main", _set("t", np.arange(64 * 64).reshape(64, 64) + i, (
            slice(64 * (i // 2), 64 * (i // 2 + 1)), slice(64 * (i % 2), 64 * (i % 2 + 1))
        )), f"chunk {i}")  # fmt: skip
    expected = _values(repo)
    repo.protect_branch("main", required_checks=["required-attributes"])
    report = repo.compact(branch="main", pack_below_bytes=1 << 20)
    assert report.snapshot is not None and report.packed_chunks == 4
    assert repo.lookup_branch("main") == report.snapshot
    assert (_values(repo) == expected).all()


# -- checks --------------------------------------------------------------------------------------


def test_required_attributes(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    repo.protect_branch(
        "main",
        require_merge=False,
        required_checks=["required-attributes"],
        check_options={"required-attributes": {"attributes": ["units", "long_name"]}},
    )
    head = repo.lookup_branch("main")

    def bare(g: Any) -> None:
        g.create_array("p", shape=(2,), chunks=(2,), dtype="f4").attrs["units"] = "hPa"

    with pytest.raises(zarrlake.CheckFailed) as failed:
        _write(repo, "main", bare, "p without long_name")
    assert failed.value.check == "required-attributes"
    assert failed.value.problems == ("array /p has no long_name attribute",)
    assert repo.lookup_branch("main") == head

    def dressed(g: Any) -> None:
        g.create_array("p", shape=(2,), chunks=(2,), dtype="f4").attrs.update(
            units="hPa", long_name="pressure"
        )

    _write(repo, "main", dressed, "p with both")
    # Arrays a change does not touch are not its business; the check sees only what lands.
    _write(repo, "main", _set("t", 2.0), "a chunk of t")


def test_array_rules() -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    _seed(repo)
    repo.protect_branch(
        "main",
        require_merge=False,
        required_checks=["array-rules"],
        check_options={
            "array-rules": {"rules": {"*": {"dtype": ["float32", "float64"], "chunks": [2, 2]}}}
        },
    )

    def ints(g: Any) -> None:
        g.create_array("n", shape=(4, 4), chunks=(4, 4), dtype="i2")

    with pytest.raises(zarrlake.CheckFailed) as failed:
        _write(repo, "main", ints, "int16 in one chunk")
    assert failed.value.problems == (
        "array /n: dtype is int16, not float32 or float64",
        "array /n: chunks are [4, 4], not [2, 2]",
    )

    def good(g: Any) -> None:
        g.create_array("n", shape=(4, 4), chunks=(2, 2), dtype="f8")

    _write(repo, "main", good, "float64 in 2x2 chunks")
    assert "n" in zarr.open_group(repo.readonly_session().store, mode="r")


def test_no_nan_reads_only_the_new_chunks(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    _write(repo, "main", _set("t", np.nan, (3, 3)), "an old NaN, before the rule")
    repo.protect_branch("main", require_merge=False, required_checks=["no-nan"])
    _write(repo, "main", _set("t", 4.0, (0, 0)), "a chunk without NaN")  # the old NaN is not new
    head = repo.lookup_branch("main")
    with pytest.raises(zarrlake.CheckFailed) as failed:
        _write(repo, "main", _set("t", np.nan, (0, 1)), "a NaN")
    assert failed.value.problems == ("array /t chunk [0, 0] has 1 NaN value(s)",)
    assert repo.lookup_branch("main") == head
    assert _values(repo)[0, 1] == 1.0


def test_a_check_refuses_a_merge_and_main_stays_where_it_was() -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    _seed(repo)
    repo.protect_branch("main", required_checks=["no-nan"])
    repo.create_branch("dev")
    _write(repo, "dev", _set("t", np.nan), "NaN on dev")
    head = repo.lookup_branch("main")
    with pytest.raises(zarrlake.CheckFailed, match="no-nan"):
        repo.merge("dev", "main")
    assert repo.lookup_branch("main") == head
    _write(repo, "dev", _set("t", 8.0), "fixed on dev")
    repo.merge("dev", "main")
    assert _values(repo)[0, 0] == 8.0


@pytest.fixture
def extra_checks(monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[..., Any]]:
    """Checks of this test's own, installed as the shipped ones are."""
    added: dict[str, Callable[..., Any]] = {}
    monkeypatch.setattr(checks, "BUILTIN", {**checks.BUILTIN, **added})
    return checks.BUILTIN


def test_a_check_that_crashes_or_hangs_is_a_refusal(
    extra_checks: dict[str, Callable[..., Any]],
) -> None:
    release = threading.Event()

    def crashes(**_: Any) -> Callable[[Any], list[str]]:
        def check(change: Any) -> list[str]:
            raise RuntimeError("the validator fell over")

        return check

    def hangs(**_: Any) -> Callable[[Any], list[str]]:
        def check(change: Any) -> list[str]:
            release.wait(30)
            return []

        return check

    seen: list[Any] = []

    def looks(**_: Any) -> Callable[[Any], list[str]]:
        def check(change: Any) -> list[str]:
            seen.append(change)
            return []

        return check

    extra_checks.update({"crashes": crashes, "hangs": hangs, "looks": looks})
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    _seed(repo)
    head = repo.lookup_branch("main")
    repo.protect_branch("main", require_merge=False, required_checks=["crashes"])
    with pytest.raises(zarrlake.CheckFailed, match="crashed: RuntimeError: the validator fell"):
        _write(repo, "main", _set("t", 2.0), "refused")
    repo.protect_branch(
        "main",
        require_merge=False,
        required_checks=["looks", "hangs"],
        check_options={"hangs": {"timeout_s": 0.5}},
    )
    started = time.monotonic()
    with pytest.raises(zarrlake.CheckFailed, match=r"did not finish within 0.5 s"):
        _write(repo, "main", _set("t", 2.0), "refused")
    assert time.monotonic() - started < 10
    release.set()
    assert repo.lookup_branch("main") == head
    # What a check is given: the change about to land, readable before it is published.
    (change,) = seen
    assert (change.branch, change.kind, change.parent) == ("main", "commit", head)
    assert change.message == "refused"
    assert list(change.arrays) == ["/t"]
    assert change.arrays["/t"].chunks == ((0, 0),)
    assert change.open_array("/t")[0, 0] == 2.0
    assert head in repo.list_branches().values() and change.snapshot != head


# -- the CLI -------------------------------------------------------------------------------------


def test_cli_protects_lists_and_refuses(tmp_path: Any, cli: Callable[..., Any]) -> None:
    url = f"file://{tmp_path / 'repo'}"
    assert cli("init", url).code == 0
    r = cli(
        "branch", url, "protect", "main", "--check", "required-attributes",
        "--check-options", '{"required-attributes": {"attributes": ["units"]}}',
    )  # fmt: skip
    assert r.code == 0, r.err
    assert r.out.strip() == (
        "protected branch main: merges only; no delete; no reset; checks: required-attributes"
    )
    r = cli("branch", url, "protection", "--json")
    assert r.code == 0
    import json

    assert json.loads(r.out) == {
        "main": {
            "require_merge": True,
            "allow_delete": False,
            "allow_reset": False,
            "required_checks": ["required-attributes"],
            "check_options": {"required-attributes": {"attributes": ["units"]}},
        }
    }
    r = cli("branch", url, "reset", "main", "main")
    assert r.code != 0
    assert r.err.strip().splitlines() == [
        "zarrlake: error: branch 'main' is protected: it cannot be reset (allow_reset is off)"
    ]
    r = cli("branch", url, "protect", "main", "--check", "nope")
    assert r.code != 0 and len(r.err.strip().splitlines()) == 1 and "nope" in r.err
    r = cli("branch", url, "protect", "main", "--check-options", "[1")
    assert r.code != 0 and "not JSON" in r.err
    assert cli("branch", url, "unprotect", "main").out.strip() == "unprotected branch main"
    assert cli("branch", url, "protection").out.strip() == "no protected branches"


def test_a_rules_change_that_died_before_the_root_is_caught_up_by_the_next_writer_and_fsck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zarrlake.core import RepositoryCore

    storage = zarrlake.Storage.memory()
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    repo.protect_branch("release")  # the repository is governed: its writers read the marker
    # The admin dies between the marker's swap and the root's.
    monkeypatch.setattr(RepositoryCore, "_publish_marker", lambda self, what: None)
    repo.protect_branch("main")
    monkeypatch.undo()
    opened = zarrlake.Repository.open(storage)  # through the root: the older rules
    assert "main" not in opened.governance.protection(refresh=False).branches
    with pytest.raises(zarrlake.BranchProtected):  # but a writer reads the marker first
        _write(opened, "main", _set("t", 2.0), "direct")
    report = repo.fsck()
    assert report.ok
    assert [n.detail for n in report.notes] == [
        "the root carries the branch rules of generation 1, the marker 2"
    ]
    repaired = repo.fsck(repair=True)
    assert repaired.repaired == ("root",)
    assert list(repo.fsck().notes) == []
    fresh = zarrlake.Repository.open(storage)
    assert set(fresh.governance.protection(refresh=False).branches) == {"main", "release"}


def test_the_crd_takes_the_check_names_the_engine_takes() -> None:
    from zarrlake import resources, rules

    assert f"^{rules.CHECK_NAME.pattern}$" == resources.CHECK_NAME


def test_a_protected_branch_cannot_be_created_at_a_snapshot_of_ones_choosing() -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.memory())
    _seed(repo)
    repo.protect_branch("release", allow_delete=True)  # before the branch exists
    with pytest.raises(zarrlake.BranchProtected) as refused:
        repo.create_branch("release")
    assert refused.value.rule == "allow_reset"
    assert "release" not in repo.list_branches()
    # Nor can a delete-then-create stand in for a reset the rule refuses.
    repo.unprotect_branch("release")
    repo.create_branch("release")
    repo.protect_branch("release", allow_delete=True)
    repo.delete_branch("release")
    with pytest.raises(zarrlake.BranchProtected):
        repo.create_branch("release")
    repo.protect_branch("release", allow_reset=True)
    repo.create_branch("release")  # allowed with allow_reset


def test_a_rule_set_while_a_commit_is_under_way_binds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from zarrlake.governance import Governance

    storage = zarrlake.Storage.memory()
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    repo.protect_branch("other")  # governed: its clients read the marker
    writer = zarrlake.Repository.open(storage)
    admitted = Governance.admit

    def admit_then_protect(self: Governance, branch: str, **kw: Any) -> None:
        admitted(self, branch, **kw)
        repo.protect_branch("main", require_merge=False, required_checks=["no-nan"])

    monkeypatch.setattr(Governance, "admit", admit_then_protect)
    head = writer.lookup_branch("main")
    with pytest.raises(zarrlake.CheckFailed):
        _write(writer, "main", _set("t", np.nan), "NaN, admitted before the rule")
    assert writer.lookup_branch("main") == head


def test_upgrade_keeps_the_rules_and_the_guard(journal_only: None) -> None:
    storage = zarrlake.Storage.memory()
    repo = zarrlake.Repository.create(storage)
    _seed(repo)
    stale = zarrlake.Repository.open(storage)  # opened before the rules
    repo.protect_branch("main")
    report = stale.upgrade()
    assert report.published_root
    assert set(zarrlake.Repository.open(storage).branch_protection()) == {"main"}
    with pytest.raises(zarrlake.BranchProtected):  # the upgraded handle still asks
        _write(stale, "main", _set("t", 3.0), "direct")
    with pytest.raises(zarrlake.BranchProtected):
        _write(repo, "main", _set("t", 3.0), "direct")


def test_cli_merge_and_delete_refused_by_the_rules(tmp_path: Any, cli: Callable[..., Any]) -> None:
    url = f"file://{tmp_path / 'repo'}"
    repo = zarrlake.Repository.create(zarrlake.Storage.from_url(url))
    _seed(repo)
    repo.create_branch("dev")
    _write(repo, "dev", _set("t", np.nan), "NaN on dev")
    assert cli("branch", url, "protect", "main", "--check", "no-nan").code == 0
    assert cli("branch", url, "protect", "dev", "--allow-direct-commits").code == 0
    head = repo.lookup_branch("main")
    r = cli("merge", url, "dev", "main")
    assert r.code == 1 and r.out == ""
    assert r.err.strip().splitlines() == [
        "zarrlake: error: check 'no-nan' refused the change to branch 'main': "
        "array /t chunk [0, 0] has 1 NaN value(s)"
    ]
    r = cli("branch", url, "delete", "dev")
    assert r.code == 1
    assert "cannot be deleted (allow_delete is off)" in r.err and r.err.count("\n") == 1
    assert zarrlake.Repository.open(zarrlake.Storage.from_url(url)).lookup_branch("main") == head
    moves = cli("branch", url, "moves", "main", "--json")
    assert moves.code == 0 and json.loads(moves.out)[0]["snapshot"] == head


# -- checks in processes of their own (what the commit service runs) ------------------------------

_TEST_CHECKS = """
import os
import time


def hangs(**options):
    def check(change):
        with open(options["started"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
        return []

    return check


def exits(**options):
    def check(change):
        os._exit(3)

    return check


def reads(**options):
    def check(change):
        value = float(change.open_array("/t")[0, 0])
        return [f"t is {value} in process {os.getpid()}"] if value < 0 else []

    return check
"""


@pytest.fixture
def installed_checks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package of checks installed for this test as any other is (a distribution whose entry
    points are in the group ``zarrlake.checks``), on the path of this process and of the
    processes it spawns."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "zl_test_checks.py").write_text(_TEST_CHECKS)
    dist = site / "zl_test_checks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zl-test-checks\nVersion: 1.0\n")
    (site / "zl_slow_import.py").write_text(
        "import time\ntime.sleep(1.5)  # a heavy import\n\n\n"
        "def passes(**options):\n    return lambda change: []\n"
    )
    (dist / "entry_points.txt").write_text(
        "[zarrlake.checks]\n"
        "hangs = zl_test_checks:hangs\n"
        "exits = zl_test_checks:exits\n"
        "reads = zl_test_checks:reads\n"
        "slow-import = zl_slow_import:passes\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_isolated_checks_stop_a_hung_check_and_outlive_a_crashed_one(
    installed_checks: None, tmp_path: Any
) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    _seed(repo)
    head = repo.lookup_branch("main")
    isolated = repo.governance.isolate_checks()
    assert isolated is not None
    try:
        started = tmp_path / "started"
        repo.protect_branch(
            "main",
            require_merge=False,
            required_checks=["hangs"],
            check_options={"hangs": {"timeout_s": 2, "started": str(started)}},
        )
        with pytest.raises(zarrlake.CheckFailed, match=r"did not finish within 2 s"):
            _write(repo, "main", _set("t", 2.0), "refused: hangs")
        pid = int(started.read_text())
        assert pid != os.getpid()
        assert not _alive(pid)  # stopped at its timeout, not left behind
        repo.protect_branch("main", require_merge=False, required_checks=["exits"])
        with pytest.raises(
            zarrlake.CheckFailed, match=r"crashed: its process exited \(exit code 3\)"
        ):
            _write(repo, "main", _set("t", 2.0), "refused: exits")
        assert repo.lookup_branch("main") == head
        # The next check gets a new worker; it reads the change in its own process.
        repo.protect_branch("main", require_merge=False, required_checks=["reads", "no-nan"])
        with pytest.raises(zarrlake.CheckFailed, match=r"t is -1.0 in process (\d+)") as refused:
            _write(repo, "main", _set("t", -1.0), "refused: negative")
        worker = int(re.search(r"process (\d+)", str(refused.value)).group(1))  # type: ignore[union-attr]
        assert worker != os.getpid()
        with pytest.raises(zarrlake.CheckFailed, match="NaN"):
            _write(repo, "main", _set("t", float("nan")), "refused: nan")
        assert repo.lookup_branch("main") == head
        _write(repo, "main", _set("t", 5.0), "lands")
        assert repo.lookup_branch("main") != head
        assert isolated.pids() == [worker]  # one worker ran them all, and waits for the next
        # Loading a check (a slow import) is not its time; nor is any timeout too long.
        repo.protect_branch(
            "main",
            require_merge=False,
            required_checks=["slow-import", "reads"],
            check_options={"slow-import": {"timeout_s": 1}, "reads": {"timeout_s": 30 * 86400}},
        )
        _write(repo, "main", _set("t", 6.0), "lands again")
    finally:
        isolated.close()
    assert not _alive(worker)
