"""What the commit service refuses is told (issue 42, "Kubernetes Events from the operator"):
each refusal — a protection rule, a failed check, a tag deletion without ``admin`` — goes to
the service's log and to a ``refused`` callback, which ``zarrlake service`` makes a Warning
Event about the ``Repository`` (:mod:`zarrlake.kevents`). Posting never changes a verdict.

The Events here go to the test kit's Kubernetes API, a real HTTP server in its own process; the
operator's end to end (the service pod posting about its Repository) is in
``tests/operator/test_commit_service_operator.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zarr

import zarrlake
from zarrlake.errors import InvalidArgument
from zarrlake.format.model import JournalEntry
from zarrlake.kevents import About, EventRecorder
from zarrlake.service import Caller, CommitService, Refusal
from zarrlake_testkit.kubeapi import KubeAPI


class _ThroughService:
    """A writer's journal that sends its appends to ``service`` in this process, as
    :class:`zarrlake.remote.ServiceClient` sends them over HTTP."""

    def __init__(self, service: CommitService, caller: Caller) -> None:
        self.service, self.caller = service, caller

    def append(self, name: str, entry: JournalEntry) -> bool:
        return self.service.append(self.caller, name, entry.encode())

    def create_tag(self, name: str, snapshot_id: str) -> None:
        self.service.create_tag(self.caller, name, snapshot_id)

    def delete_tag(self, name: str) -> None:
        self.service.delete_tag(self.caller, name)


def _writer(storage: zarrlake.Storage, service: CommitService, who: str) -> zarrlake.Repository:
    writer = zarrlake.Repository.open(storage)
    writer.core.journal.remote = writer.core.tags.remote = _ThroughService(
        service, Caller(who, "writer")
    )
    writer.core.commits.guard = None  # a client that skips its own rules: the service decides
    return writer


def _commit(repo: zarrlake.Repository, branch: str, name: str) -> str:
    session = repo.writable_session(branch)
    zarr.open_group(session.store, mode="a").create_array(name, shape=(2,), dtype="f4")
    return session.commit(f"add {name}")


def test_each_refusal_is_told_and_a_failing_teller_changes_nothing(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    admin = zarrlake.Repository.create(storage)
    _commit(admin, "main", "seed")
    admin.create_branch("dev")
    admin.create_tag("v1", "main")
    admin.protect_branch("main")  # merges only
    told: list[Refusal] = []
    service = CommitService(zarrlake.Repository.open(storage), refused=told.append)
    writer = _writer(storage, service, "wanda")

    _commit(writer, "dev", "a")  # allowed: nothing told
    assert told == []
    head = admin.lookup_branch("main")
    with pytest.raises(zarrlake.BranchProtected):
        _commit(writer, "main", "b")
    (refusal,) = told
    assert refusal.identity == "wanda" and refusal.error == "BranchProtected"
    assert refusal.action.startswith("commit to branch 'main' (snapshot ")
    assert "require_merge" in refusal.message
    assert str(refusal).startswith("wanda: commit to branch 'main' (snapshot ")
    with pytest.raises(zarrlake.ReadOnlyError):
        writer.delete_tag("v1")
    assert (told[-1].action, told[-1].error) == ("deletion of tag 'v1'", "ReadOnlyError")
    # An entry whose snapshot is not what it says (what a forger sends) is told too.
    dev = zarrlake.Repository.open(storage).core.journal.published_head("dev")
    assert dev is not None
    forged = dataclasses.replace(
        dev, seq=dev.seq + 1, previous=dev.snapshot, snapshot_data=b"not those bytes"
    )
    with pytest.raises(InvalidArgument, match="carries other bytes"):
        service.append(Caller("mallory", "writer"), "dev", forged.encode())
    assert (told[-1].identity, told[-1].error) == ("mallory", "InvalidArgument")
    assert told[-1].action == "move of branch 'dev'"

    # A teller that fails (the API down, say) is logged; the refusal stands, nothing moved.
    def broken(refusal: Refusal) -> None:
        raise OSError("connection refused")

    service = CommitService(zarrlake.Repository.open(storage), refused=broken)
    writer = _writer(storage, service, "wanda")
    with pytest.raises(zarrlake.BranchProtected):
        _commit(writer, "main", "c")
    assert zarrlake.Repository.open(storage).lookup_branch("main") == head
    assert list(zarrlake.Repository.open(storage).list_tags()) == ["v1"]


@pytest.fixture(scope="module")
def kubeapi() -> Iterator[KubeAPI]:
    with KubeAPI() as api:
        yield api


def _events(api: Any, namespace: str) -> list[dict[str, Any]]:
    import json

    from kubernetes import client

    got = client.CoreV1Api(api).list_namespaced_event(namespace, _preload_content=False)
    return list(json.loads(got.data)["items"])


def _wait(what: str, probe: Any, timeout: float = 20.0) -> Any:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        found = probe()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_refusals_become_events_and_repeats_are_counted(
    kubeapi: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zarrlake.k8s import api_client

    monkeypatch.setenv("KUBECONFIG", str(kubeapi.write_kubeconfig(tmp_path / "kubeconfig")))
    about = About.parse(
        '{"apiVersion": "zarrlake.io/v1alpha1", "kind": "Repository", "name": "lake",'
        ' "namespace": "default", "uid": "uid-lake"}'
    )
    recorder = EventRecorder(about, component="zarrlake-commit-service")
    said = "wanda: commit to branch 'main' (snapshot S1) refused: branch 'main' takes merges only"
    recorder.post("BranchProtected", said)
    recorder.post("BranchProtected", said)  # the same writer, retrying
    recorder.post("CheckFailed", "wanda: merge into branch 'main' refused: no units")
    recorder.close()
    assert (recorder.failed, recorder.dropped) == (0, 0)
    events = _events(api_client(), "default")
    by_reason = {e["reason"]: e for e in events if e["involvedObject"]["name"] == "lake"}
    assert set(by_reason) == {"BranchProtected", "CheckFailed"}
    protected = by_reason["BranchProtected"]
    assert protected["count"] == 2 and protected["message"] == said
    assert protected["type"] == "Warning"
    assert protected["involvedObject"] == about.involved()
    assert protected["reportingComponent"] == "zarrlake-commit-service"
    assert protected["metadata"]["name"].startswith("lake.")
    assert by_reason["CheckFailed"]["count"] == 1

    # The API gone: posting still returns at once, and the failure is counted, not raised.
    down = EventRecorder(about, component="zarrlake-commit-service")
    kubeapi.stop()
    try:
        began = time.monotonic()
        down.post("BranchProtected", said)
        assert time.monotonic() - began < 0.5
        _wait("the failure counted", lambda: down.failed == 1)
    finally:
        down.close()
        kubeapi.start()


def test_what_events_are_about_is_checked() -> None:
    for text, said in [
        ("not json", "not JSON"),
        ("[]", "an object"),
        ('{"kind": "Repository", "name": "r"}', "namespace is missing"),
        ('{"kind": "Repository", "name": 3, "namespace": "n"}', "name must be a string"),
        ('{"kind": "R", "name": "r", "namespace": "n", "colour": "red"}', "unknown keys"),
    ]:
        with pytest.raises(InvalidArgument, match=said):
            About.parse(text)


def test_the_service_command_refuses_a_bad_events_object(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"a-token-of-16-chars-or-more": {"identity": "a", "role": "admin"}}')
    monkeypatch.setenv("ZARRLAKE_EVENTS_FOR", '{"kind": "Repository"}')
    got = cli("service", str(tmp_path / "repo"), "--tokens-file", str(tokens), "--port", "0")
    assert got.code == 2
    assert "ZARRLAKE_EVENTS_FOR: name is missing" in got.err
