"""A check run as a program of its own (issue 42, "checks as Jobs"): ``zarrlake check URL
[NAME]``, what a check Job's container runs, on a local repository; the templates the service
reads; and that a client committing through a commit service leaves the checks to it.

The Jobs themselves, created by a commit service the operator runs, are in
``tests/operator/test_commit_service_operator.py``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zarr

import zarrlake
from zarrlake.checkjobs import Asked, JobChecks, parse_jobs, run_check
from zarrlake.checks import Change
from zarrlake.format.model import snapshot_key
from zarrlake_testkit.kubeapi import KubeAPI


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
        "ZARRLAKE_CHECK_PARENT_SHA256": hashlib.sha256(
            repo.storage.get(snapshot_key(repo.lookup_branch("main")))
        ).hexdigest(),
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


def test_a_parent_overwritten_after_the_service_read_it_is_refused(
    repo: zarrlake.Repository,
) -> None:
    """The parent is what a change is measured against: a writer that rewrites the head's
    ``snapshots/<id>`` (readers use the copy its journal entry carries) as the change itself
    would leave no change for a check to see. The Job compares the parent's bytes too."""
    dressed = _commit(repo, "dev", "K")
    asked = Asked.from_env(_env(repo, dressed))
    assert run_check(repo, asked) == []
    head = repo.lookup_branch("main")
    repo.storage.put(snapshot_key(head), repo.storage.get(snapshot_key(dressed)))
    (problem,) = run_check(zarrlake.Repository.open(repo.storage), asked)
    assert problem.startswith(f"snapshot {head} holds other bytes than the commit service")


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
    env_not_a_list = _template()
    env_not_a_list["spec"]["template"]["spec"]["containers"][0]["env"] = {"A": "1"}
    with pytest.raises(zarrlake.InvalidArgument, match=r"env a list"):
        parse_jobs(json.dumps({"units": env_not_a_list}))
    for text, says in [
        ("{", "not JSON"),
        ("[]", "expected an object"),
        (json.dumps({"Bad Name": _template()}), "is not a check name"),
        (json.dumps({"units": _template(deadline=0)}), "activeDeadlineSeconds"),
        (json.dumps({"units": _template(deadline=True)}), "activeDeadlineSeconds"),
        (json.dumps({"units": _template(labels={"a": 1})}), "is not a Job"),
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


# -- the service's side of a Job, against a real API server (no kubelet: nothing runs them) ----


@pytest.fixture(scope="module")
def kubeapi() -> Iterator[KubeAPI]:
    with KubeAPI() as api:
        yield api


def _jobs_api(kubeapi: KubeAPI, tmp_path: Path) -> tuple[JobChecks, Any]:
    from kubernetes import client, config

    configuration = client.Configuration()
    path = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    api = client.ApiClient(configuration)
    checks = JobChecks(parse_jobs(json.dumps({"units": _template()})), namespace="default",
                       poll=0.05, api=api)  # fmt: skip
    return checks, client.BatchV1Api(api)


def _change(repo: zarrlake.Repository, **digests: str | None) -> Change:
    dressed = _commit(repo, "dev", "K")
    objects = repo.core.objects
    parent = objects.snapshot(repo.lookup_branch("main"))
    built = objects.snapshot(dressed)
    given = {"digest": "a" * 64, "parent_digest": "b" * 64, **digests}
    return Change("main", "merge", parent, built, list, lambda s: None, **given)


def _names(batch: Any) -> list[str]:
    found = batch.list_namespaced_job("default", _preload_content=False)
    return [j["metadata"]["name"] for j in json.loads(found.data)["items"]]


def _wait(what: str, probe: Callable[[], Any], timeout: float = 20.0) -> Any:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if found := probe():
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_job_per_change_however_often_it_is_asked(
    repo: zarrlake.Repository, kubeapi: KubeAPI, tmp_path: Path
) -> None:
    """A writer whose request timed out asks again while the first check still runs: it waits
    for that Job's verdict, and no second Job is made."""
    checks, batch = _jobs_api(kubeapi, tmp_path)
    change = _change(repo)
    verdicts: list[list[str]] = []
    first = threading.Thread(target=lambda: verdicts.append(checks.run_job("units", {}, change)))
    first.start()
    (name,) = _wait("the Job", lambda: _names(batch))
    again = threading.Thread(target=lambda: verdicts.append(checks.run_job("units", {}, change)))
    again.start()
    time.sleep(0.5)
    assert _names(batch) == [name] and verdicts == []
    done = {"conditions": [{"type": "Complete", "status": "True"}]}
    batch.patch_namespaced_job_status(name, "default", {"status": done})
    first.join(20)
    again.join(20)
    assert verdicts == [[], []]
    _wait("the passed Job deleted", lambda: _names(batch) == [])


def test_a_job_that_cannot_be_followed_is_a_refusal_and_is_deleted(
    repo: zarrlake.Repository, kubeapi: KubeAPI, tmp_path: Path
) -> None:
    checks, batch = _jobs_api(kubeapi, tmp_path)
    # Without the digests of both snapshots the service makes no Job at all.
    (said,) = checks.run_job("units", {}, _change(repo, parent_digest=None))
    assert said == "could not run as a Job: no digest of the snapshots to hand it"
    assert _names(batch) == []
    # A Job deleted under the service (by hand, by a namespace's quota controller): refused.
    verdicts: list[list[str]] = []
    change = _change(repo)
    run = threading.Thread(target=lambda: verdicts.append(checks.run_job("units", {}, change)))
    run.start()
    (name,) = _wait("the Job", lambda: _names(batch))
    batch.delete_namespaced_job(name, "default")
    run.join(20)
    ((problem,),) = verdicts
    assert problem.startswith(f"could not run as a Job: cannot read Job default/{name}: 404")


def test_a_client_that_commits_through_the_service_leaves_the_checks_to_it(
    repo: zarrlake.Repository, kubeapi: KubeAPI, tmp_path: Path
) -> None:
    """The rule requires a check only the service can run (a Job): the writer's client, which
    has no such check installed, sends its commit on, and the service's Job decides."""
    from zarrlake.service import Caller, CommitService

    checks, batch = _jobs_api(kubeapi, tmp_path)
    service_repo = zarrlake.Repository.open(repo.storage)
    service_repo.governance.run_as_jobs(checks)
    service_repo.protect_branch("main", require_merge=False, required_checks=["units"])
    service = CommitService(service_repo)

    class ThroughService:
        def append(self, name: str, entry: Any) -> bool:
            return service.append(Caller("wanda", "writer"), name, entry.encode())

    writer = zarrlake.Repository.open(repo.storage)
    writer.core.journal.remote = ThroughService()  # type: ignore[assignment]
    verdicts: list[str] = []
    run = threading.Thread(target=lambda: verdicts.append(_commit(writer, "main", "K")))
    run.start()
    (name,) = _wait("the service's Job", lambda: _names(batch))
    done = {"conditions": [{"type": "Complete", "status": "True"}]}
    batch.patch_namespaced_job_status(name, "default", {"status": done})
    run.join(20)
    (published,) = verdicts
    assert zarrlake.Repository.open(repo.storage).lookup_branch("main") == published
    # Without the service, the same client cannot run that check: refused, never passed.
    alone = zarrlake.Repository.open(repo.storage)
    with pytest.raises(zarrlake.CheckFailed, match="cannot run here: no check named 'units'"):
        _commit(alone, "main", "K")
