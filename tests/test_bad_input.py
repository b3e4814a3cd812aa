"""Bad input a new user plausibly gives: a typed error (a ``ZarrlakeError``) or a one-line CLI
error, and the repository as it was.

Each case here was found by trying the README as a new user: before its fix it raised an error
from inside the library (``AttributeError``, ``TypeError``), said something misleading, or went
on with a setting silently dropped.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zarr

import zarrlake
from cli_helpers import Result, assert_one_line_error
from zarrlake.mirror import Mirror


def small_repo(path: Path) -> zarrlake.Repository:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    with repo.transaction("main", message="one") as store:
        zarr.create_array(store, name="a", shape=(4,), chunks=(2,), dtype="i4")[:] = 1
    return repo


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if ".tmp" not in p.parts)


# -- storage locations -----------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["", "   "])
def test_an_empty_url_never_means_the_current_directory(
    url: str, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # an unset $REPO in a script: nothing may land here
    with pytest.raises(zarrlake.StorageError, match="empty"):
        zarrlake.Storage.from_url(url)
    with pytest.raises(zarrlake.StorageError, match="empty"):
        zarrlake.Storage.local(url)
    assert "empty" in assert_one_line_error(cli("init", url), 2)
    assert list(tmp_path.iterdir()) == []
    assert zarrlake.Storage.local(".").url == tmp_path.as_uri()  # the way to say it


def test_a_folder_where_the_repository_marker_goes_is_named(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    (tmp_path / "d" / "repo").mkdir(parents=True)
    with pytest.raises(zarrlake.StorageError, match="is a directory") as e:
        zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "d"))
    assert not isinstance(e.value, zarrlake.RepositoryExists)  # it said so before
    err = assert_one_line_error(cli("init", str(tmp_path / "d")), 1)
    assert "is a directory" in err and "already exists" not in err
    assert not zarrlake.Repository.exists(zarrlake.Storage.local(tmp_path / "d"))


def test_a_file_where_the_repository_folder_goes(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a folder")
    with pytest.raises(zarrlake.StorageError, match="Not a directory"):
        zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "f"))
    assert (tmp_path / "f").read_text() == "not a folder"


@pytest.mark.parametrize(
    "endpoint", ["not a url", "ftp://host", "http://", "http://exa mple:9000", "http://h:99999"]
)
def test_an_s3_endpoint_that_is_not_a_url(endpoint: str) -> None:
    with pytest.raises(zarrlake.StorageError, match="endpoint_url"):
        zarrlake.Storage.s3("bucket", "p", endpoint_url=endpoint, allow_http=True)


@pytest.mark.xdist_group("moto")
def test_a_missing_bucket_is_named_not_a_missing_object(
    moto_s3: Any, cli: Callable[..., Result]
) -> None:
    storage = zarrlake.Storage.s3(
        "no-such-bucket", "x", endpoint_url=moto_s3.endpoint, region="us-east-1", allow_http=True
    )
    with pytest.raises(zarrlake.StorageError, match="bucket 'no-such-bucket' does not exist") as e:
        zarrlake.Repository.create(storage)
    assert not isinstance(e.value, zarrlake.ObjectNotFound)
    with pytest.raises(zarrlake.StorageError, match="does not exist"):
        storage.put("k", b"x", create_only=True)
    url = f"s3://no-such-bucket/x?endpoint_url={moto_s3.endpoint}&region=us-east-1"
    assert "bucket 'no-such-bucket' does not exist" in assert_one_line_error(cli("init", url), 1)


# -- settings and arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"pack_chunk_below_bytes": 0}, "unknown repository setting"),  # a typo
        ({"inline_threshold_bytes": "x"}, "must be an integer"),
        ({"shard_max_refs": True}, "must be an integer"),
        ({"session_ttl": "30d"}, "session_ttl"),
        ({"pack_chunks_below_bytes": -5}, "between 0 and 16 MiB"),
    ],
)
def test_a_bad_setting_is_refused_before_anything_is_written(
    config: dict[str, Any], says: str, tmp_path: Path
) -> None:
    with pytest.raises(zarrlake.InvalidConfig, match=says) as e:
        zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"), config=config)
    assert isinstance(e.value, ValueError) and isinstance(e.value, zarrlake.ZarrlakeError)
    assert not (tmp_path / "r").exists()


def test_open_or_create_refuses_a_misspelt_setting_even_where_a_repository_is(
    tmp_path: Path,
) -> None:
    repo = small_repo(tmp_path / "r")
    with pytest.raises(zarrlake.InvalidConfig, match="unknown repository setting"):
        zarrlake.Repository.open_or_create(repo.storage, config={"pack_chunk_below_bytes": 0})


def test_settings_in_seconds_and_known_names_still_work(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(
        zarrlake.Storage.local(tmp_path / "r"), config={"session_ttl": 3600, "shard_max_refs": 64}
    )
    assert repo.config.session_ttl == dt.timedelta(hours=1)
    assert zarrlake.Repository.open(repo.storage).config.shard_max_refs == 64


def test_as_of_takes_a_datetime_or_an_iso_string(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    now = dt.datetime.now(dt.UTC)
    assert repo.readonly_session("main", as_of=now.isoformat()).base == repo.lookup_branch("main")
    for bad in ("yesterday", 5, dt.date.today()):
        with pytest.raises(zarrlake.InvalidArgument, match="as_of"):
            repo.readonly_session("main", as_of=bad)  # type: ignore[arg-type]


def test_gc_grace_takes_a_timedelta_or_a_duration(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    assert repo.gc(grace="7d", dry_run=True).dry_run
    with pytest.raises(zarrlake.InvalidDuration):
        repo.gc(grace="a week", dry_run=True)
    with pytest.raises(zarrlake.InvalidArgument, match="grace"):
        repo.gc(grace=7, dry_run=True)  # type: ignore[arg-type]
    with pytest.raises(zarrlake.GraceTooShort):
        repo.gc(grace="1h", dry_run=True)  # the rule still holds for a string


def test_a_lock_that_is_not_one(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    with pytest.raises(zarrlake.InvalidArgument, match="lock must be"):
        zarrlake.Repository.open(repo.storage, lock=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda repo: repo.merge("main", "main", strategy="bogus"),
        lambda repo: repo.writable_session("main", ttl=dt.timedelta(days=8)),
        lambda repo: repo.writable_session("main").merge("junk"),
        lambda repo: zarrlake.RedisLock("redis://127.0.0.1:1/0", on_unavailable="maybe"),
        lambda repo: zarrlake.Repository.open(repo.storage, lock="http://x"),
        lambda repo: repo.writable_session("main", ttl=3600),
        lambda repo: Mirror(repo, zarrlake.Storage.memory()).gc(grace=7),
    ],
    ids=[
        "merge-strategy",
        "ttl",
        "merge-not-a-changeset",
        "on-unavailable",
        "lock-url",
        "ttl-seconds",
        "mirror-gc-grace",
    ],
)
def test_wrong_arguments_are_zarrlake_errors_and_still_value_or_type_errors(
    call: Callable[[zarrlake.Repository], Any], tmp_path: Path
) -> None:
    repo = small_repo(tmp_path / "r")
    before = files(tmp_path / "r")
    with pytest.raises(zarrlake.InvalidArgument):
        call(repo)
    assert files(tmp_path / "r") == before


def test_a_solver_that_is_not_one(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    session = repo.writable_session("main")
    zarr.open_array(session.store, path="a")[:] = 2
    with pytest.raises(zarrlake.InvalidArgument, match="solver"):
        session.commit("x", solver="ours")  # type: ignore[arg-type]


def test_committing_twice_says_the_session_was_committed(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    session = repo.writable_session("main")
    zarr.open_array(session.store, path="a")[:] = 2
    first = session.commit("one")
    with pytest.raises(zarrlake.ReadOnlyError, match=f"was committed \\(as {first}\\)"):
        session.commit("two")
    with pytest.raises(zarrlake.ReadOnlyError, match="was committed"):
        zarr.open_array(session.store, path="a")[:] = 3
    assert [c.message for c in repo.log()][:1] == ["one"]


# -- mirrors ---------------------------------------------------------------------------------------


def test_mirror_branch_globs_are_checked(tmp_path: Path, cli: Callable[..., Result]) -> None:
    repo = small_repo(tmp_path / "src")
    dest = zarrlake.Storage.local(tmp_path / "dst")
    with pytest.raises(zarrlake.InvalidArgument, match="no ']' closes"):
        Mirror(repo, dest, branches=["main", "[bad"])
    with pytest.raises(zarrlake.InvalidArgument, match="non-empty string"):
        Mirror(repo, dest, branches=[""])
    assert not (tmp_path / "dst").exists()
    err = cli("mirror", "run", str(tmp_path / "src"), str(tmp_path / "dst"), "--once", "--branch",
              "[bad")  # fmt: skip
    assert "no ']' closes" in assert_one_line_error(err, 2)
    # One glob given as a string is that glob, not its characters.
    assert Mirror(repo, dest, branches="main").branches == ("main",)


@pytest.mark.parametrize(
    ("glob", "fine"),
    [("wip]", True), ("[]w]ip]", True), ("[!]]a", True), ("exp[0-9]*", True), ("x][", False),
     ("exp[", False), ("[!", False), ("a[]", False)],
)  # fmt: skip
def test_a_glob_is_read_as_fnmatch_reads_it(glob: str, fine: bool) -> None:
    from zarrlake.refs import branch_glob_problem

    assert (branch_glob_problem(glob) is None) == fine


# -- the command line ------------------------------------------------------------------------------


def test_compact_takes_sizes_as_people_write_them(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    from zarrlake.cli import build_parser

    small_repo(tmp_path / "r")
    parse = build_parser().parse_args
    assert parse(["compact", "u", "--pack-below", "1MiB"]).pack_below == 1 << 20
    assert parse(["compact", "u", "--pack-below", "262144"]).pack_below == 262144
    r = cli("compact", str(tmp_path / "r"), "--pack-below", "1MiB", "--dry-run", "--json")
    assert r.code == 0, r.err
    assert "whole number" in assert_one_line_error(
        cli("compact", str(tmp_path / "r"), "--pack-below", "0.9"), 2
    )
    assert "bad size" in assert_one_line_error(
        cli("compact", str(tmp_path / "r"), "--pack-below", "lots"), 2
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.xdist_group("redis")
def test_lock_status_takes_the_lock_from_the_environment(
    redis_server: Any, tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    small_repo(tmp_path / "r")
    monkeypatch.setenv("ZARRLAKE_LOCK", redis_server.url)
    r = cli("lock", "status", str(tmp_path / "r"))
    assert r.code == 0, r.err
    assert "no branch of this repository is locked" in r.out
    monkeypatch.delenv("ZARRLAKE_LOCK")
    assert "ZARRLAKE_LOCK" in assert_one_line_error(cli("lock", "status", str(tmp_path / "r")), 2)


def test_lock_status_of_an_unreachable_service_is_not_an_internal_error(
    tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZARRLAKE_LOCK", raising=False)
    small_repo(tmp_path / "r")
    url = f"redis://127.0.0.1:{_free_port()}/0"
    err = assert_one_line_error(cli("lock", "status", str(tmp_path / "r"), "--lock", url), 1)
    assert "internal error" not in err and "cannot ask lock service" in err


# -- corrupt objects -------------------------------------------------------------------------------


def test_bytes_that_are_not_an_object_are_corrupt(
    tmp_path: Path, cli: Callable[..., Result], journal_only: None
) -> None:
    # Journal-only: listing tags reads their records (a published root answers from itself;
    # fsck still reads every record: tests/test_published_root.py).
    repo = small_repo(tmp_path / "r")
    head = repo.lookup_branch("main")
    repo.create_tag("v1", head)
    repo.create_tag("v2", head)
    (tmp_path / "r" / "refs" / "tag.v1").write_bytes(b"garbage")
    (tmp_path / "r" / "snapshots" / head).write_bytes(b"garbage")
    fresh = zarrlake.Repository.open(repo.storage)
    with pytest.raises(zarrlake.CorruptObject) as e:
        fresh.readonly_session(head)
    assert isinstance(e.value, zarrlake.UnsupportedFormat)  # as it always was, too
    assert e.value.key == f"snapshots/{head}"
    problems = {(p.kind, p.key): p.detail for p in fresh.fsck().problems}
    # The bad tag by its own key, and the good one still checked (its snapshot is the bad one).
    assert ("corrupt", "refs/tag.v1") in problems
    assert problems[("corrupt", f"snapshots/{head}")].startswith("not a zarrlake object")
    err = assert_one_line_error(cli("tag", str(tmp_path / "r"), "list"), 1)
    assert err.startswith("corrupt object refs/tag.v1")


def test_a_spark_master_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    small_repo(tmp_path / "r")
    before = files(tmp_path / "r")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    argv = ["gc", str(tmp_path / "r"), "--engine", "spark", "--spark-master", "bogus://x"]
    done = subprocess.run(
        [sys.executable, "-m", "zarrlake", *argv], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]  # (the JVM prints its own lines before)
    assert last.startswith("zarrlake: error: --engine spark: cannot start Spark on 'bogus://x'")
    assert "internal error" not in done.stderr
    assert files(tmp_path / "r") == before


def test_a_ref_named_like_a_snapshot_id_is_refused(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    head = repo.lookup_branch("main")
    with pytest.raises(zarrlake.InvalidName, match="snapshot id"):
        repo.create_branch(head, head)  # meant: create_branch(name, from_ref=head)
    with pytest.raises(zarrlake.InvalidName, match="snapshot id"):
        repo.create_tag(head, "main")
    assert set(repo.list_branches()) == {"main"} and repo.list_tags() == {}
    # A name merely close to that form is fine.
    assert repo.create_branch(head.lower()) == head


def test_durations_past_any_date_are_refused(cli: Callable[..., Result], tmp_path: Path) -> None:
    from zarrlake.durations import parse_duration

    with pytest.raises(zarrlake.InvalidDuration, match="longer than"):
        parse_duration("99999999999999999999d")  # was an OverflowError from timedelta
    assert parse_duration("3650d") == dt.timedelta(days=3650)
    small_repo(tmp_path / "r")
    err = assert_one_line_error(cli("gc", str(tmp_path / "r"), "--grace", "9999999999w"), 2)
    assert "longer than" in err


def test_retention_globs_are_checked_as_mirror_globs_are() -> None:
    with pytest.raises(zarrlake.InvalidRetentionRules, match="no ']' closes"):
        zarrlake.RetentionRules.from_dict({"branches": {"exp[": {"last": 3}}})
    with pytest.raises(zarrlake.InvalidRetentionRules, match="non-empty string"):
        zarrlake.RetentionRules(branches={"": zarrlake.Keep(last=1)})
    rules = zarrlake.RetentionRules.from_dict({"branches": {"exp[0-9]*": {"last": 3}}})
    assert rules.rule_for("exp1") == zarrlake.Keep(last=3)


ERRORS_WITH_FACTS = [
    zarrlake.CorruptObject("snapshots/x", "truncated"),
    zarrlake.errors.NotZarrlakeObject("refs/tag.v1", "not a zarrlake object"),
    zarrlake.RefNotFound("dev", "branch", "a hint"),
    zarrlake.NotMirrored("01ABC", "s3://src"),
    zarrlake.ConflictError([zarrlake.Conflict("chunk", "/a", (1,))]),
    zarrlake.MergeConflictError([zarrlake.Conflict("node", "/a")], "a message"),
    zarrlake.ConditionalWritesUnsupported("s3://b/p", "refs/probe", "both writes landed"),
    zarrlake.UnknownContentHash("md5", ["blake3", "sha256"]),
    zarrlake.SparkWriteError("failed", partition=3, reason="task"),
]


@pytest.mark.parametrize("error", ERRORS_WITH_FACTS, ids=lambda e: type(e).__name__)
def test_errors_cross_processes_whole(error: Exception) -> None:
    """A worker's error reaches the caller by pickle (process pools, dask, Spark): it must come
    back as itself, facts included, not as a pool that broke on unpickling it."""
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_an_older_repository_with_whole_floats_in_its_settings_opens(
    tmp_path: Path, journal_only: None
) -> None:
    """Earlier versions stored settings as given, 1e5 included: such a repository must open.
    (Earlier versions: no published root, so the marker is what opening reads.)"""
    from zarrlake.format.model import REPO_KEY, RepoRecord

    repo = small_repo(tmp_path / "r")
    record = repo.record
    config = {**record.config, "pack_chunks_below_bytes": 1e5, "shard_max_refs": 2048.0}
    old = RepoRecord(record.id, record.created, config, initialized=True,
                     content_hash=record.content_hash, features=record.features)  # fmt: skip
    (tmp_path / "r" / REPO_KEY).write_bytes(old.encode())
    reopened = zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / "r"))
    assert reopened.config.pack_chunks_below_bytes == 100_000
    assert next(c.message for c in reopened.log()) == "one"
    # A stored value no version could have written is a corrupt record, not the caller's error.
    bad = RepoRecord(record.id, record.created, {**config, "shard_max_refs": "many"},
                     initialized=True, content_hash=record.content_hash,
                     features=record.features)  # fmt: skip
    (tmp_path / "r" / REPO_KEY).write_bytes(bad.encode())
    with pytest.raises(zarrlake.CorruptObject, match="its settings"):
        zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / "r"))
