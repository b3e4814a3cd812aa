"""The operator's watch-fed cache (``zarrlake_operator.kube``): what the reconciles of a resting
fleet read instead of asking the API server. No server here: bodies go in as a watch delivers
them, and the lookups must answer from them alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from zarrlake_operator import kube


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    ns = f"cache-{request.node.name}"[:63]
    yield ns
    for kind in ("Branch", "Tag", "Repository"):
        for body in kube.cached_list(kind, ns):
            kube.remember(body, kind, deleted=True)


def body(name: str, ns: str, version: int, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "resourceVersion": str(version)},
        "spec": spec,
    }


def names(bodies: list[dict[str, Any]]) -> list[str]:
    return sorted(b["metadata"]["name"] for b in bodies)


def test_dependents_are_found_by_repository_and_follow_spec_changes(namespace: str) -> None:
    kube.remember(body("a", namespace, 1, repository="r1"), "Branch")
    kube.remember(body("b", namespace, 2, repository="r1"), "Branch")
    kube.remember(body("c", namespace, 3, repository="r2"), "Branch")
    kube.remember(body("t", namespace, 4, repository="r1"), "Tag")
    assert names(kube.cached_dependents("Branch", namespace, "r1")) == ["a", "b"]
    assert names(kube.cached_dependents("Tag", namespace, "r1")) == ["t"]
    assert names(kube.cached_list("Branch", namespace)) == ["a", "b", "c"]
    assert kube.cached_dependents("Branch", "elsewhere", "r1") == []

    kube.remember(body("b", namespace, 5, repository="r2"), "Branch")  # now names r2
    assert names(kube.cached_dependents("Branch", namespace, "r1")) == ["a"]
    assert names(kube.cached_dependents("Branch", namespace, "r2")) == ["b", "c"]
    kube.remember(body("b", namespace, 4, repository="r1"), "Branch")  # an older event: ignored
    assert names(kube.cached_dependents("Branch", namespace, "r2")) == ["b", "c"]

    kube.remember(body("a", namespace, 6, repository="r1"), "Branch", deleted=True)
    assert kube.cached_dependents("Branch", namespace, "r1") == []
    assert names(kube.cached_list("Branch", namespace)) == ["b", "c"]
    assert kube.watched("Branch", namespace, "a") is None
    # A read that raced the deletion cannot bring it back (the tombstone's version is newer).
    kube.remember(body("a", namespace, 1, repository="r1"), "Branch")
    assert kube.watched("Branch", namespace, "a") is None
    assert kube.watched("Branch", namespace, "c") == body("c", namespace, 3, repository="r2")
