"""The operator's handler plumbing, in this process: what a timer tick does with a body the
watch gave it, once the object's delete handler has run (a Repository's resync takes its
dependents from the watch's view, which lags behind the delete), and with a Repository that is
being deleted."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from zarrlake_operator import handlers, reconcile

MARKED = "2026-11-29T05:00:00Z"


def body(**meta: Any) -> dict[str, Any]:
    return {"metadata": {"uid": str(uuid.uuid4()), "namespace": "ns", "name": "b", **meta}}


class Reconciles:
    """A reconcile that records its calls (what a tick must not do is call it)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, body: dict[str, Any], **kwargs: Any) -> None:
        self.calls.append(kwargs)


def test_a_tick_acts_until_the_delete_handler_has_finished() -> None:
    reconcile, branch = Reconciles(), body()
    handlers.resync("Branch", reconcile, branch, resync=True)
    assert reconcile.calls == [{"resync": True}]
    with handlers.deleting(branch):
        pass  # the delete handler's work
    assert handlers.being_deleted(branch)
    handlers.resync("Branch", reconcile, branch, resync=True)  # the same body, read before
    assert len(reconcile.calls) == 1


def test_a_tick_leaves_an_object_marked_for_deletion_to_its_delete_handler() -> None:
    reconcile, marked = Reconciles(), body(deletionTimestamp=MARKED)
    handlers.resync("Branch", reconcile, marked, resync=True)
    assert reconcile.calls == [] and handlers.being_deleted(marked)


class _Announcing:
    """An object's lock that says when the ticking thread is about to wait for it."""

    def __init__(self, lock: threading.Lock, waiting: threading.Event) -> None:
        self.lock, self.waiting = lock, waiting

    def __enter__(self) -> None:
        if threading.current_thread().name == "tick":
            self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *_: object) -> None:
        self.lock.release()


def test_a_tick_waiting_for_the_delete_handler_does_nothing_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reconcile, branch = Reconciles(), body()
    waiting = threading.Event()
    lock_of, remember = handlers.serialized, handlers.forget

    def slow_forget(b: Any) -> None:  # a tick that got the lock now would act on the object
        time.sleep(0.2)
        remember(b)

    monkeypatch.setattr(handlers, "serialized", lambda b: _Announcing(lock_of(b), waiting))
    monkeypatch.setattr(handlers, "forget", slow_forget)
    ticker = threading.Thread(
        target=lambda: handlers.resync("Branch", reconcile, branch, resync=True), name="tick"
    )
    with handlers.deleting(branch):
        ticker.start()
        # Past its first look (the object not gone yet), the tick now waits for the lock.
        assert waiting.wait(timeout=30)
        assert reconcile.calls == []
    ticker.join(timeout=30)
    assert not ticker.is_alive()
    assert reconcile.calls == []  # it took the lock after the delete, and saw it


def test_a_failed_delete_handler_leaves_the_object_to_its_retry() -> None:
    reconcile, branch = Reconciles(), body()
    try:
        with handlers.deleting(branch):
            raise RuntimeError("S3 unreachable")  # Kopf retries the delete handler
    except RuntimeError:
        pass
    assert not handlers.being_deleted(branch)
    handlers.resync("Branch", reconcile, branch, resync=True)
    assert len(reconcile.calls) == 1


def test_what_it_remembers_is_bounded() -> None:
    first = body()
    with handlers.deleting(first):
        pass
    for _ in range(handlers.FINISHED_KEPT):
        with handlers.deleting(body()):
            pass
    # The oldest is forgotten: by then the watch's view has long dropped the object, and no
    # resync of its Repository finds it among the dependents.
    assert not handlers.being_deleted(first)


@pytest.fixture
def repository_resync(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A Repository's resync over one Branch whose status its refs do not confirm (its branch
    is absent): the reconciles it would call, recorded."""
    branch = {**body(), "kind": "Branch"}
    calls: dict[str, Any] = {"Repository": Reconciles(), "Branch": Reconciles(), "body": branch}
    monkeypatch.setattr(reconcile, "repository", calls["Repository"])
    monkeypatch.setattr(
        reconcile, "dependents", lambda repo: [reconcile.Dependent("Branch", branch, False)]
    )
    monkeypatch.setitem(handlers.RESYNCS, "Branch", (calls["Branch"], {"resync": True}))
    return calls


def test_a_repository_resync_leaves_a_deleted_dependent_alone(
    repository_resync: dict[str, Any],
) -> None:
    """The path of the e2e failure: the dependent's body was read before its delete."""
    repo = body()
    handlers.repository_resync(repo)
    assert len(repository_resync["Branch"].calls) == 1
    with handlers.deleting(repository_resync["body"]):
        pass  # the Branch's delete handler deleted the branch
    handlers.repository_resync(repo)
    assert len(repository_resync["Repository"].calls) == 2
    assert len(repository_resync["Branch"].calls) == 1


def test_a_repository_being_deleted_resyncs_neither_itself_nor_its_dependents(
    repository_resync: dict[str, Any],
) -> None:
    handlers.repository_resync(body(deletionTimestamp=MARKED))
    assert repository_resync["Repository"].calls == []
    assert repository_resync["Branch"].calls == []
