"""A check run as a program of its own (issue 42, "checks as Jobs"): ``zarrlake check URL
[NAME]``, what a check Job's container runs, on a local repository; the templates the service
reads; and that a client committing through a commit service leaves the checks to it.

The Jobs themselves, created by a commit service the operator runs, are in
``tests/operator/test_commit_service_operator.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zarr

import zarrlake
from zarrlake.checkjobs import Asked, parse_jobs, run_check
from zarrlake.format.model import snapshot_key


def _commit(repo: zarrlake.Repository, branch: str, units: str | None) -> str:
    session = repo.writable_session(branch)
    a = zarr.open_group(session.store, mode="a").create_array(
        "p", shape=(2,), chunks=(2,), dtype="f4", overwrite=True
    )
    if units is not None:
        a.attrs["units"] = units
    a[:] = 1.0
    return session.commit(f"p with units {units}")


@pytest.fixture
def repo(tmp_path: Path) -> zarrlake.Repository:
    repo = zarrlake.Repository.create(zarrlake.Storage.from_url(str(tmp_path / "repo")))
    session = repo.writable_session("main")
    zarr.open_group(session.store, mode="w")
    session.commit("root group")
    repo.create_branch("dev")
    return repo


def _env(repo: zarrlake.Repository, snapshot: str, **more: str) -> dict[str, str]:
    data = repo.storage.get(snapshot_key(snapshot))
    return {
        "ZARRLAKE_CHECK_NAME": "required-attributes",
        "ZARRLAKE_CHECK_OPTIONS": json.dumps({"attributes": ["units"]}),
        "ZARRLAKE_CHECK_BRANCH": "main",
        "ZARRLAKE_CHECK_KIND": "merge",
        "ZARRLAKE_CHECK_PARENT": repo.lookup_branch("main"),
        "ZARRLAKE_CHECK_SNAPSHOT": snapshot,
        "ZARRLAKE_CHECK_SNAPSHOT_SHA256": hashlib.sha256(data).hexdigest(),
        **more,
    }


def test_the_check_program_passes_refuses_and_says_why(
    repo: zarrlake.Repository,
    tmp_path: Path,
    cli: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bare = _commit(repo, "dev", None)
    report = tmp_path / "termination-log"
    for key, value in _env(repo, bare, ZARRLAKE_REPORT_FILE=str(report)).items():
        monkeypatch.setenv(key, value)
    url = str(tmp_path / "repo")
    refused = cli("check", url)
    assert refused.code == 1
    assert refused.out == "array /p has no units attribute\n"
    assert "check 'required-attributes' refused the change to branch 'main'" in refused.err
    # What the service reads as the verdict: the termination message, one problem per line.
    assert report.read_text() == "array /p has no units attribute\n"

    dressed = _commit(repo, "dev", "hPa")
    report.unlink()
    for key, value in _env(repo, dressed).items():
        monkeypatch.setenv(key, value)
    passed = cli("check", url)
    assert (passed.code, passed.out, passed.err) == (0, "", "")
    assert not report.exists()
    # The command line wins over the environment: the bare commit, named on it, is refused.
    again = cli("check", url, "--snapshot", bare)
    assert again.code == 1 and "holds other bytes" in again.out  # its digest is the other's
    monkeypatch.delenv("ZARRLAKE_CHECK_SNAPSHOT_SHA256")
    again = cli("check", url, "--snapshot", bare, "--options", '{"attributes": ["long_name"]}')
    assert again.code == 1
    assert again.out == "array /p has no long_name attribute\n"


def test_a_snapshot_overwritten_after_the_service_read_it_is_refused(
    repo: zarrlake.Repository,
) -> None:
    bare = _commit(repo, "dev", None)
    dressed = _commit(repo, "dev", "K")
    env = _env(repo, dressed)
    asked = Asked.from_env(env)
    assert run_check(repo, asked) == []
    # A writer with credentials for the immutable objects overwrites snapshots/<id> once the
    # service has hashed it (here with the bare commit's bytes): the check does not vouch for
    # bytes the service will not publish.
    repo.storage.put(snapshot_key(dressed), repo.storage.get(snapshot_key(bare)))
    fresh = zarrlake.Repository.open(repo.storage)
    (problem,) = run_check(fresh, asked)
    assert problem.startswith(f"snapshot {dressed} holds other bytes than the commit service")


def test_what_the_check_program_cannot_do_is_said(
    repo: zarrlake.Repository, tmp_path: Path, cli: Callable[..., Any]
) -> None:
    bare = _commit(repo, "dev", None)
    url = str(tmp_path / "repo")
    parent = repo.lookup_branch("main")
    # A check not installed in the image: refused (never passed), saying so.
    got = cli("check", url, "no-such-check", "--snapshot", bare, "--parent", parent)
    assert got.code == 1
    assert got.out.startswith("cannot run here: no check named 'no-such-check' is installed")
    # Nothing to check: a usage error, one line.
    got = cli("check", url, "required-attributes", "--parent", parent)
    assert got.code == 2
    assert got.err == (
        "zarrlake: error: no snapshot to check: give --snapshot or set ZARRLAKE_CHECK_SNAPSHOT\n"
    )
    got = cli("check", url, "required-attributes", "--snapshot", bare, "--parent", parent,
              "--options", "[1]")  # fmt: skip
    assert (got.code, got.err) == (2, "zarrlake: error: check options: expected a JSON object\n")
    # A snapshot that is not there.
    repo.storage.delete_many([snapshot_key(bare)])
    got = cli("check", url, "required-attributes", "--snapshot", bare, "--parent", parent)
    assert (got.code, got.out) == (1, f"snapshot {bare} is not stored\n")


def _template(deadline: Any = 60, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"generateName": "zl-repo-check-units-", **meta},
        "spec": {
            "activeDeadlineSeconds": deadline,
            "template": {"spec": {"containers": [{"name": "check", "image": "x"}]}},
        },
    }


def test_check_job_templates_are_checked() -> None:
    jobs = parse_jobs(json.dumps({"units": _template()}))
    assert jobs["units"].deadline == 60.0
    for text, says in [
        ("{", "not JSON"),
        ("[]", "expected an object"),
        (json.dumps({"Bad Name": _template()}), "is not a check name"),
        (json.dumps({"units": _template(deadline=0)}), "activeDeadlineSeconds"),
        (json.dumps({"units": {"kind": "Pod"}}), "is not a Job"),
    ]:
        with pytest.raises(zarrlake.InvalidArgument, match=says):
            parse_jobs(text)


def test_the_service_refuses_bad_check_jobs_in_one_line(
    repo: zarrlake.Repository,
    tmp_path: Path,
    cli: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"t" * 32: {"identity": "a", "role": "writer"}}))
    url = str(tmp_path / "repo")
    got = cli("service", url, "--tokens-file", str(tokens), "--check-jobs", str(tmp_path / "no"))
    assert got.code == 2 and got.err.startswith("zarrlake: error: --check-jobs: cannot read")
    monkeypatch.setenv("ZARRLAKE_CHECK_JOBS", "{")
    got = cli("service", url, "--tokens-file", str(tokens))
    assert got.code == 2
    assert got.err.startswith("zarrlake: error: ZARRLAKE_CHECK_JOBS: check jobs are not JSON")
