"""The operator's handler plumbing, in this process: what a timer tick does with a body the
watch gave it, once the object's delete handler has run (a Repository's resync takes its
dependents from the watch's view, which lags behind the delete)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from zarrlake_operator import handlers


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
    assert handlers.going(branch)
    handlers.resync("Branch", reconcile, branch, resync=True)  # the same body, read before
    assert len(reconcile.calls) == 1


def test_a_tick_leaves_an_object_marked_for_deletion_to_its_delete_handler() -> None:
    reconcile, marked = Reconciles(), body(deletionTimestamp="2026-11-29T05:00:00Z")
    handlers.resync("Branch", reconcile, marked, resync=True)
    assert reconcile.calls == [] and handlers.going(marked)


def test_a_tick_waiting_for_the_delete_handler_does_nothing_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reconcile, branch = Reconciles(), body()
    remember = handlers.forget

    def slow_forget(b: Any) -> None:  # a tick that got the lock now would act on the object
        time.sleep(0.2)
        remember(b)

    monkeypatch.setattr(handlers, "forget", slow_forget)

    def tick() -> None:
        handlers.resync("Branch", reconcile, branch, resync=True)

    with handlers.deleting(branch):
        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.2)  # the tick waits for the object's lock meanwhile
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
    assert not handlers.going(branch)
    handlers.resync("Branch", reconcile, branch, resync=True)
    assert len(reconcile.calls) == 1


def test_what_it_remembers_is_bounded() -> None:
    first = body()
    with handlers.deleting(first):
        pass
    for _ in range(handlers.FINISHED_KEPT):
        with handlers.deleting(body()):
            pass
    assert not handlers.going(first)  # the oldest went; a resync of it finds its ref anyway
