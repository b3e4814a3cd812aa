"""Every spec gets an answer: whatever the CRD schema lets through, the operator either can act
on it or says why not (Ready=False with a reason and a message), and never fails without one.

Specs are generated from the CRDs' own OpenAPI schemas (``crds/*.yaml``) and kept when the
schema accepts them as kube-apiserver would (:mod:`zarrlake_testkit.crdschema`: pruned,
defaulted, validated) — without the CEL rules, as a server before Kubernetes 1.25 accepted them,
which is the most the operator can be handed. Each goes through the pure layer that decides
(:func:`zarrlake_operator.desired.spec_problem`, then :func:`desired.set_ready`); a spec with no
problem must build what the operator makes of it. No cluster: fast.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import yaml
from gitops_checks import argo_health, kstatus
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from k8s_env import ROOT

from zarrlake.k8s import storage_connection
from zarrlake.resources import MirrorSpec, RepositorySpec, RetentionPolicySpec
from zarrlake_operator import desired
from zarrlake_testkit.crdschema import apply_schema, schema_errors

KINDS = {
    "Repository": "repositories",
    "Branch": "branches",
    "Tag": "tags",
    "RetentionPolicy": "retentionpolicies",
    "Mirror": "mirrors",
}
NAME = r"[a-z][a-z0-9-]{0,20}[a-z0-9]"


class EveryKey(dict[str, str]):
    """A Secret that holds whatever key a spec names (the spec is what is tested, not the
    Secret): a valid key name finds a value, one that every provider's check of its keys takes
    (base64 for an Azure account key, JSON for a GCS service-account key file)."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and bool(desired.SECRET_KEY.match(key))

    def __getitem__(self, key: str) -> str:
        return "1234" if key in self else super().__getitem__(key)


def _secret(name: str) -> dict[str, str]:
    return EveryKey()


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "crds" / f"zarrlake.io_{KINDS[kind]}.yaml").read_text())
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def values(schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values shaped like ``schema``: its types, enums, patterns and bounds mostly kept (the
    schema check decides), optional fields present or not."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("x-kubernetes-int-or-string"):
        return st.one_of(st.integers(0, 4096), st.from_regex(r"\A[0-9]{1,4}(m|Mi|Gi|k)?\Z"))
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            text = st.from_regex(schema["pattern"], fullmatch=True)
        else:
            text = st.one_of(st.from_regex(r"\A[a-z0-9./_-]{1,12}\Z"), st.text(max_size=8))
        limit = schema.get("maxLength")
        return text if limit is None else text.filter(lambda t: len(t) <= limit)
    if kind == "integer":
        return st.integers(schema.get("minimum", -5), schema.get("maximum", 10**6))
    if kind == "number":
        return st.floats(schema.get("minimum", 0), schema.get("maximum", 10**6))
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        items = schema.get("items") or {"type": "string"}
        return st.lists(values(items, depth + 1), min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if not props:
            extra = schema.get("additionalProperties")
            inner = values(extra, depth + 1) if isinstance(extra, dict) else st.just("x")
            return st.dictionaries(st.from_regex(r"\A[a-z][a-z.]{0,10}\Z"), inner, max_size=2)
        required = set(schema.get("required") or ())
        optional = {k: v for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(
            {k: values(props[k], depth + 1) for k in sorted(required)},
            optional={k: values(v, depth + 1) for k, v in sorted(optional.items())},
        )
    return st.none()


@st.composite
def accepted(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """A body of ``kind`` as the API server (its schema, not its CEL rules) would store it."""
    schema = crd_schema(kind)
    spec = draw(values(schema["properties"]["spec"]))
    name = draw(st.from_regex(rf"\A{NAME}\Z"))
    body = {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": spec,
    }
    stored = apply_schema(body, schema, root=True)
    assume(not schema_errors(stored, schema))
    return stored  # type: ignore[no-any-return]


def _built(body: dict[str, Any]) -> None:
    """What the operator makes of a spec it accepted: each must build (raise nothing)."""
    kind, spec = body["kind"], body["spec"]
    if kind == "Repository":
        model = RepositorySpec.model_validate(spec)
        desired.engine_config(model)
        conn = storage_connection(model.storage, _secret, "Repository 'r'")
        assert conn.storage_url
        desired.storage_env(model.storage)
        if model.lock_service.mode == "managed" and not model.storage.read_only:
            desired.lock_deployment(body, model, "digest")
            desired.lock_network_policy(body, model)
            desired.lock_volume_claim(body, model)
    elif kind in ("Branch", "Tag"):
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", desired.ref_name(body))
    elif kind == "RetentionPolicy":
        model_rp = RetentionPolicySpec.model_validate(spec)
        assert desired.maintenance_arguments(model_rp, "s3://bucket/prefix")["gc"]
    elif kind == "Mirror":
        model_m = MirrorSpec.model_validate(spec)
        assert desired.replicator_command(model_m, "s3://a/b", "s3://c/d")
        storage_connection(model_m.destination, _secret, "Mirror 'm'")


def _answers(body: dict[str, Any]) -> None:
    problem = desired.spec_problem(body)
    if problem is None:
        _built(body)
        return
    assert problem.reason and problem.message, problem
    conditions = desired.set_ready([], False, problem.reason, problem.message, generation=1)
    status = {
        "observedGeneration": 1,
        "phase": "Failed",
        "conditions": [c.dump() for c in conditions],
    }
    answered = {**body, "status": status}
    assert kstatus(answered)[0] == "Failed", answered
    health = argo_health(answered)
    assert health["status"] == "Degraded" and problem.message in health["message"], health


PROPERTY = settings(max_examples=60, suppress_health_check=[HealthCheck.filter_too_much])


@pytest.mark.slow  # a hypothesis search: ~5-15 s a kind
@pytest.mark.parametrize("kind", list(KINDS))
@PROPERTY
@given(data=st.data())
def test_every_spec_the_schema_accepts_is_acted_on_or_answered(kind: str, data: Any) -> None:
    _answers(data.draw(accepted(kind)))


def test_an_external_lock_service_without_a_url_is_answered() -> None:
    """The known case: the CEL rule refuses it, a server that does not evaluate CEL stores it."""
    body = {
        "kind": "Repository",
        "metadata": {"name": "r", "namespace": "ns", "generation": 1},
        "spec": {"storage": {"bucket": "abc"}, "lockService": {"mode": "external"}},
    }
    schema = crd_schema("Repository")
    assert not schema_errors(apply_schema(body, schema, root=True), schema)
    problem = desired.spec_problem(body)
    assert problem is not None and problem.reason == "InvalidSpec"
    assert "spec.lockService.url" in problem.message
    _answers(body)
