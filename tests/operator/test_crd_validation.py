"""What a real API server refuses, the emulated one refuses too, and says why the same way.

The zarrlake CRDs (``crds/*.yaml``, generated from ``zarrlake.resources``) are applied to the
emulated API server (``zarrlake_testkit.kubeapi``) and custom objects are written to it over HTTP
and with kubectl: the OpenAPI schema (types, required, enum, patterns, bounds) and the CEL rules
(``x-kubernetes-validations``, transition rules included) refuse what kube-apiserver 1.32 would,
with a 422 ``Invalid`` Status worded as it words it. The second half checks the validator itself
(``zarrlake_testkit.crdschema``) on schemas beyond ours: nullable, int-or-string, formats,
``messageExpression``, ``fieldPath``, ``reason``, list-map correlation and ratcheting.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import textwrap
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_env import ROOT

from zarrlake_testkit.crdschema import (
    RULES_NOT_CHECKED,
    FieldError,
    aggregate,
    apply_schema,
    validate,
)
from zarrlake_testkit.emulated import kubectl_binary
from zarrlake_testkit.kubeapi import KubeAPI

API = "/apis/zarrlake.io/v1alpha1/namespaces/default"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
BUCKET_PATTERN = "^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
NOT_CHECKED = f'<nil>: Invalid value: "null": {RULES_NOT_CHECKED}'


class Answer:
    """One HTTP answer: status, JSON body and the ``Warning`` header's messages."""

    def __init__(self, status: int, body: Any, warnings: list[str]) -> None:
        self.status, self.body, self.warnings = status, body, warnings

    @property
    def causes(self) -> dict[str, str]:
        """``field -> message`` of a refusal's causes."""
        return {c["field"]: c["message"] for c in self.body["details"]["causes"]}


class Api:
    def __init__(self, url: str) -> None:
        self.url = url
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        **params: str,
    ) -> Answer:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path + query, data=data, method=method)
        request.add_header("Content-Type", content_type)
        try:
            with self.opener.open(request, timeout=60) as rsp:
                status, raw, headers = rsp.status, rsp.read(), rsp.headers
        except urllib.error.HTTPError as e:
            status, raw, headers = e.code, e.read(), e.headers
        warnings = [
            json.loads(text)
            for value in headers.get_all("Warning") or []
            for text in re.findall(r'299 - ("(?:[^"\\]|\\.)*")', value)
        ]
        return Answer(status, json.loads(raw or b"null"), warnings)

    def create(self, kind: str, name: str, spec: Any, **params: str) -> Answer:
        body = {"apiVersion": "zarrlake.io/v1alpha1", "kind": kind, "metadata": {"name": name}}
        if spec is not None:
            body["spec"] = spec
        return self.call("POST", f"{API}/{PLURALS[kind]}", body, **params)

    def merge(self, kind: str, name: str, patch: Any, sub: str = "") -> Answer:
        path = f"{API}/{PLURALS[kind]}/{name}" + (f"/{sub}" if sub else "")
        return self.call("PATCH", path, patch, "application/merge-patch+json")

    def get(self, kind: str, name: str) -> Answer:
        return self.call("GET", f"{API}/{PLURALS[kind]}/{name}")


PLURALS = {
    "Repository": "repositories",
    "Branch": "branches",
    "Tag": "tags",
    "RetentionPolicy": "retentionpolicies",
    "Mirror": "mirrors",
}


def refused(answer: Answer, kind: str, name: str) -> dict[str, str]:
    """The causes of a 422 Invalid refusal, after checking its shape against kube-apiserver's."""
    assert answer.status == 422, (answer.status, answer.body)
    body = answer.body
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == 422
    assert body["reason"] == "Invalid"
    assert body["details"]["kind"] == kind and body["details"]["name"] == name
    assert body["details"]["group"] == "zarrlake.io"
    assert body["message"].startswith(f'{kind}.zarrlake.io "{name}" is invalid: ')
    for cause in body["details"]["causes"]:  # each cause is in the message, with its field
        assert f"{cause['field']}: {cause['message']}" in body["message"]
    return answer.causes


@pytest.fixture(scope="module")
def kubeapi() -> Iterator[KubeAPI]:
    with KubeAPI() as server:
        api = Api(server.url)
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            answer = api.call("POST", CRDS, yaml.safe_load(path.read_text()))
            assert answer.status == 201, answer.body
        yield server


@pytest.fixture
def api(kubeapi: KubeAPI) -> Iterator[Api]:
    client = Api(kubeapi.url)
    yield client
    for plural in PLURALS.values():
        client.call("DELETE", f"{API}/{plural}")


def repository(bucket: str = "zl-valid", **storage: Any) -> dict[str, Any]:
    return {"storage": {"bucket": bucket, **storage}}


# -- accepted ----------------------------------------------------------------------------------


def test_valid_objects_are_accepted_and_defaulted(api: Api) -> None:
    created = api.create("Repository", "ok", repository(prefix="a/b", region="eu-west-1"))
    assert created.status == 201, created.body
    spec = created.body["spec"]
    assert spec["storage"]["provision"] is False and spec["reclaimPolicy"] == "Retain"
    assert created.warnings == []
    for kind, spec in (
        ("Branch", {"repository": "ok", "name": "dev/x-1"}),
        ("Tag", {"repository": "ok", "ref": "main"}),
        ("RetentionPolicy", {"repository": "ok", "gc": {"schedule": "*/5 * * * *"}}),
        ("Mirror", {"repository": "ok", "destination": {"bucket": "zl-copy"}}),
    ):
        assert api.create(kind, "ok", spec).status == 201, kind


def test_every_example_resource_is_accepted(api: Api) -> None:
    seen = set()
    for path in sorted((ROOT / "examples" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("apiVersion") != "zarrlake.io/v1alpha1":
                continue
            answer = api.call("POST", f"{API}/{PLURALS[doc['kind']]}", doc)
            assert answer.status == 201, (path.name, answer.body)
            assert answer.warnings == [], path.name  # no field the schema does not know
            seen.add(doc["kind"])
    assert seen == set(PLURALS)


# -- refused by the OpenAPI schema -------------------------------------------------------------


def test_a_bad_pattern_is_refused_with_the_servers_words(api: Api) -> None:
    answer = api.create("Repository", "bad", repository("Not_A_Bucket!"))
    causes = refused(answer, "Repository", "bad")
    assert causes == {
        "spec.storage.bucket": (
            f'Invalid value: "Not_A_Bucket!": spec.storage.bucket in body should match '
            f"'{BUCKET_PATTERN}'"
        )
    }
    assert [c["reason"] for c in answer.body["details"]["causes"]] == ["FieldValueInvalid"]
    assert answer.body["message"] == (
        'Repository.zarrlake.io "bad" is invalid: spec.storage.bucket: Invalid value: '
        f"\"Not_A_Bucket!\": spec.storage.bucket in body should match '{BUCKET_PATTERN}'"
    )
    assert api.get("Repository", "bad").status == 404  # nothing was stored


def test_missing_required_fields_are_refused(api: Api) -> None:
    causes = refused(api.create("Repository", "nostorage", {}), "Repository", "nostorage")
    assert causes == {"spec.storage": "Required value", "<nil>": NOT_CHECKED[7:]}
    causes = refused(api.create("Repository", "nospec", None), "Repository", "nospec")
    assert causes["spec"] == "Required value"
    causes = refused(api.create("Tag", "noref", {"repository": "r"}), "Tag", "noref")
    assert causes["spec.ref"] == "Required value"


def test_wrong_types_are_refused(api: Api) -> None:
    answer = api.create("Repository", "types", repository(provision="yes"))
    causes = refused(answer, "Repository", "types")
    assert causes["spec.storage.provision"] == (
        'Invalid value: "string": spec.storage.provision in body must be of type boolean: "string"'
    )
    assert answer.body["details"]["causes"][0]["reason"] == "FieldValueTypeInvalid"
    # A wrong type keeps the CEL rules from running, and the server says so.
    assert causes["<nil>"] == NOT_CHECKED[7:]
    quantity = {**repository(), "lockService": {"resources": {"requests": {"cpu": True}}}}
    causes = refused(api.create("Repository", "quantity", quantity), "Repository", "quantity")
    assert causes["spec.lockService.resources.requests.cpu"] == (
        'Invalid value: "boolean": spec.lockService.resources.requests.cpu in body must be of '
        'type integer,string: "boolean"'
    )
    ints = {**repository(), "lockService": {"resources": {"requests": {"cpu": 2, "memory": "1Gi"}}}}
    assert api.create("Repository", "ints", ints).status == 201  # int-or-string takes both


def test_values_outside_an_enum_are_refused(api: Api) -> None:
    spec = {**repository(), "lockService": {"mode": "sometimes"}, "reclaimPolicy": "Keep"}
    causes = refused(api.create("Repository", "enum", spec), "Repository", "enum")
    assert causes["spec.lockService.mode"] == (
        'Unsupported value: "sometimes": supported values: "managed", "external", "none"'
    )
    assert causes["spec.reclaimPolicy"] == (
        'Unsupported value: "Keep": supported values: "Retain", "Delete"'
    )


def test_bounds_lengths_and_item_counts_are_refused(api: Api) -> None:
    policy = {"repository": "r", "gc": {"schedule": "@daily", "activeDeadlineSeconds": 5}}
    causes = refused(api.create("RetentionPolicy", "p", policy), "RetentionPolicy", "p")
    assert causes == {
        "spec.gc.activeDeadlineSeconds": (
            "Invalid value: 5: spec.gc.activeDeadlineSeconds in body should be greater than or "
            "equal to 60"
        )
    }
    mirror = {
        "repository": "r",
        "destination": {"bucket": "zl-x"},
        "branches": [],
        "metricsPort": 1,
    }
    causes = refused(api.create("Mirror", "m", mirror), "Mirror", "m")
    assert causes == {
        "spec.branches": "Invalid value: 0: spec.branches in body should have at least 1 items",
        "spec.metricsPort": (
            "Invalid value: 1: spec.metricsPort in body should be greater than or equal to 1024"
        ),
    }
    glob = {"repository": "r", "destination": {"bucket": "zl-x"}, "branches": ["main", "a b"]}
    causes = refused(api.create("Mirror", "glob", glob), "Mirror", "glob")
    assert list(causes) == ["spec.branches[1]"]  # list items are named by index
    assert causes["spec.branches[1]"].startswith('Invalid value: "a b": spec.branches[1] in body')
    long = repository(prefix="p" * 513)
    causes = refused(api.create("Repository", "long", long), "Repository", "long")
    assert causes["spec.storage.prefix"] == "Too long: may not be longer than 512"


def test_a_bad_retention_schedule_is_refused_by_its_pattern(api: Api) -> None:
    """A schedule that is not five fields or a macro never reaches the operator; one with five
    fields out of range does (the operator's InvalidSpec, tested in test_operator)."""
    policy = {"repository": "r", "gc": {"schedule": "every tuesday"}}
    causes = refused(api.create("RetentionPolicy", "cron", policy), "RetentionPolicy", "cron")
    assert list(causes) == ["spec.gc.schedule"]
    assert causes["spec.gc.schedule"].startswith('Invalid value: "every tuesday": ')
    ok = {"repository": "r", "gc": {"schedule": "61 25 * * *"}}
    assert api.create("RetentionPolicy", "range", ok).status == 201


def test_names_must_be_dns_subdomains(api: Api) -> None:
    causes = refused(api.create("Branch", "Dev_1", {"repository": "r"}), "Branch", "Dev_1")
    assert causes["metadata.name"].startswith(
        'Invalid value: "Dev_1": a lowercase RFC 1123 subdomain must consist of lower case'
    )


# -- refused by CEL rules ----------------------------------------------------------------------


def test_a_cel_rule_on_the_whole_object_limits_the_name(api: Api) -> None:
    name = "r" * 64
    causes = refused(api.create("Repository", name, repository()), "Repository", name)
    assert causes == {
        "<nil>": 'Invalid value: "object": Repository names are at most 63 characters (label '
        "value limit)"
    }
    assert api.create("Repository", "r" * 63, repository()).status == 201


def test_external_lock_service_needs_a_url(api: Api) -> None:
    spec = {**repository(), "lockService": {"mode": "external"}}
    causes = refused(api.create("Repository", "ext", spec), "Repository", "ext")
    assert causes == {
        "spec.lockService": 'Invalid value: "object": lockService.url is required in external mode'
    }
    spec["lockService"]["url"] = "redis://redis.example:6379/0"
    assert api.create("Repository", "ext", spec).status == 201


def test_spec_serve_is_defaulted_bounded_and_checked_against_the_storage(api: Api) -> None:
    """spec.serve, a field added after 0.1.0: optional, defaulted when given, its bounds and
    required keys refused by the schema, and serving an http repository that needs an
    Authorization header (which the server cannot send) refused by a CEL rule."""
    assert "serve" not in api.create("Repository", "plain", repository()).body["spec"]
    created = api.create("Repository", "served", {**repository(), "serve": {"enabled": True}})
    assert created.status == 201, created.body
    assert created.body["spec"]["serve"] == {"enabled": True, "replicas": 1, "port": 8700}
    bad = {"enabled": True, "replicas": -1, "port": 80, "tokenSecretRef": {"name": "t"}}
    causes = refused(
        api.create("Repository", "bad", {**repository(), "serve": bad}), "Repository", "bad"
    )
    assert causes == {
        "spec.serve.replicas": (
            "Invalid value: -1: spec.serve.replicas in body should be greater than or equal to 0"
        ),
        "spec.serve.port": (
            "Invalid value: 80: spec.serve.port in body should be greater than or equal to 1024"
        ),
        "spec.serve.tokenSecretRef.key": "Required value",
        "<nil>": NOT_CHECKED[7:],
    }
    http = {"provider": "http", "url": "https://data.example.org/climate"}
    needs_header = {**http, "credentialsSecret": {"name": "cdn"}}
    spec = {"storage": needs_header, "serve": {"enabled": True}}
    causes = refused(api.create("Repository", "cdn", spec), "Repository", "cdn")
    assert causes == {
        "spec": 'Invalid value: "object": spec.serve cannot send an Authorization header to '
        "provider http: serve a published repository that needs no credentials"
    }
    spec = {"storage": http, "serve": {"enabled": True, "credentialsSecretRef": {"name": "cdn"}}}
    assert list(refused(api.create("Repository", "cdn", spec), "Repository", "cdn")) == ["spec"]
    for spec in (
        {"storage": http, "serve": {"enabled": True}},  # published, no header: served
        {"storage": needs_header, "serve": {"enabled": False}},  # not served
    ):
        assert api.create("Repository", "cdn", spec).status == 201, spec
        api.call("DELETE", f"{API}/repositories/cdn")


def test_immutable_fields_refuse_every_kind_of_change(api: Api) -> None:
    assert api.create("Repository", "fixed", repository(prefix="a")).status == 201
    immutable = 'Invalid value: "string": storage.bucket is immutable'
    path = f"{API}/repositories/fixed"
    # merge patch, JSON patch, apply patch and a whole replacement (PUT)
    answer = api.merge("Repository", "fixed", {"spec": {"storage": {"bucket": "zl-other"}}})
    assert refused(answer, "Repository", "fixed") == {"spec.storage.bucket": immutable}
    ops = [{"op": "replace", "path": "/spec/storage/bucket", "value": "zl-other"}]
    answer = api.call("PATCH", path, ops, "application/json-patch+json")
    assert refused(answer, "Repository", "fixed") == {"spec.storage.bucket": immutable}
    applied = {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": "fixed"},
        "spec": repository("zl-other", prefix="a"),
    }
    answer = api.call("PATCH", path, applied, "application/apply-patch+yaml", fieldManager="t")
    assert refused(answer, "Repository", "fixed") == {"spec.storage.bucket": immutable}
    current = api.get("Repository", "fixed").body
    replaced = copy.deepcopy(current)
    replaced["spec"]["storage"]["prefix"] = "b"
    answer = api.call("PUT", path, replaced)
    assert refused(answer, "Repository", "fixed") == {
        "spec.storage.prefix": 'Invalid value: "string": storage.prefix is immutable'
    }
    # A mutable field changes; the immutable ones stay as they were.
    answer = api.merge("Repository", "fixed", {"spec": {"storage": {"region": "eu-west-1"}}})
    assert answer.status == 200 and answer.body["spec"]["storage"]["bucket"] == "zl-valid"
    assert answer.body["metadata"]["generation"] == 2


def test_transition_rules_apply_to_updates_only(api: Api) -> None:
    # On create there is no oldSelf: the rules that compare with it are not evaluated.
    assert api.create("Branch", "b", {"repository": "r", "name": "dev"}).status == 201
    answer = api.merge("Branch", "b", {"spec": {"name": None}})  # removing it is a change too
    assert refused(answer, "Branch", "b") == {
        "spec": 'Invalid value: "object": name is immutable (it cannot be added or removed either)'
    }
    assert api.create("Branch", "c", {"repository": "r"}).status == 201
    answer = api.merge("Branch", "c", {"spec": {"name": "c"}})
    assert refused(answer, "Branch", "c")["spec"].endswith("(it cannot be added or removed either)")
    answer = api.merge("Branch", "c", {"spec": {"from": "dev"}})
    assert refused(answer, "Branch", "c") == {
        "spec.from": 'Invalid value: "string": from is immutable'
    }


def test_the_status_subresource_is_validated_too(api: Api) -> None:
    assert api.create("Branch", "s", {"repository": "r"}).status == 201
    ready = {"type": "Ready", "status": "True", "reason": "Ready"}
    answer = api.merge("Branch", "s", {"status": {"conditions": [ready, ready]}}, "status")
    assert refused(answer, "Branch", "s") == {
        "status.conditions[1]": 'Duplicate value: map[string]interface {}{"type":"Ready"}'
    }
    maybe = {**ready, "status": "Maybe"}
    answer = api.merge(
        "Branch", "s", {"status": {"conditions": [maybe], "recreated": "x"}}, "status"
    )
    causes = refused(answer, "Branch", "s")
    assert causes["status.conditions[0].status"] == (
        'Unsupported value: "Maybe": supported values: "True", "False", "Unknown"'
    )
    assert causes["status.recreated"].startswith('Invalid value: "string": status.recreated in')
    answer = api.merge("Branch", "s", {"status": {"conditions": [ready], "head": "H"}}, "status")
    assert answer.status == 200 and answer.body["status"]["head"] == "H"


def test_a_dry_run_is_validated_like_a_write(api: Api) -> None:
    answer = api.create("Repository", "dry", repository("BAD"), dryRun="All")
    assert list(refused(answer, "Repository", "dry")) == ["spec.storage.bucket"]


# -- unknown fields (fieldValidation) ------------------------------------------------------------


def test_unknown_fields_are_pruned_with_a_warning_or_refused_when_strict(api: Api) -> None:
    spec = {"storage": {"bucket": "zl-valid", "bukcet": "typo"}, "extra": 1}
    answer = api.create("Repository", "typo", spec)  # the server's default: Warn
    assert answer.status == 201
    assert sorted(answer.warnings) == [
        'unknown field "spec.extra"',
        'unknown field "spec.storage.bukcet"',
    ]
    assert "bukcet" not in answer.body["spec"]["storage"] and "extra" not in answer.body["spec"]
    answer = api.create("Repository", "strict", spec, fieldValidation="Strict")
    assert answer.status == 400 and answer.body["reason"] == "BadRequest"
    assert answer.body["message"] == (
        'Repository in version "v1alpha1" cannot be handled as a Repository: strict decoding '
        'error: unknown field "spec.storage.bukcet", unknown field "spec.extra"'
    )
    answer = api.create("Repository", "ignore", spec, fieldValidation="Ignore")
    assert answer.status == 201 and answer.warnings == []


# -- kubectl ---------------------------------------------------------------------------------------


def kubectl(kubeconfig: Path, *args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KUBECACHEDIR": str(kubeconfig.parent)}
    return subprocess.run(
        [kubectl_binary(), *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kubectl_apply_of_an_invalid_object_fails_with_the_reason(
    kubeapi: KubeAPI, tmp_path: Path
) -> None:
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    manifest = textwrap.dedent(
        """\
        apiVersion: zarrlake.io/v1alpha1
        kind: Repository
        metadata: {name: kc-bad, namespace: default}
        spec:
          storage: {bucket: Not_A_Bucket!}
          lockService: {mode: sometimes}
        """
    )
    result = kubectl(kubeconfig, "apply", "-f", "-", stdin=manifest)
    assert result.returncode != 0
    assert 'The Repository "kc-bad" is invalid:' in result.stderr
    assert (
        f'spec.storage.bucket: Invalid value: "Not_A_Bucket!": spec.storage.bucket in body '
        f"should match '{BUCKET_PATTERN}'" in result.stderr
    )
    assert 'spec.lockService.mode: Unsupported value: "sometimes"' in result.stderr
    # kubectl validates strictly by default: a misspelt field is an error, not a silent drop.
    typo = manifest.replace("Not_A_Bucket!", "zl-kc").replace("sometimes", "none")
    typo = typo.replace("{bucket: zl-kc}", "{bucket: zl-kc, bukcet: x}")
    result = kubectl(kubeconfig, "apply", "-f", "-", stdin=typo)
    assert result.returncode != 0
    assert 'strict decoding error: unknown field "spec.storage.bukcet"' in result.stderr
    result = kubectl(kubeconfig, "apply", "-f", "-", stdin=typo.replace(", bukcet: x", ""))
    assert result.returncode == 0, result.stderr
    assert "repository.zarrlake.io/kc-bad created" in result.stdout
    # ... and a change to an immutable field is refused with the rule's message.
    moved = typo.replace(", bukcet: x", "").replace("zl-kc", "zl-kc-moved")
    result = kubectl(kubeconfig, "apply", "-f", "-", stdin=moved)
    assert result.returncode != 0
    assert 'spec.storage.bucket: Invalid value: "string": storage.bucket is immutable' in (
        result.stderr
    )


# -- CRDs whose rules do not compile ---------------------------------------------------------------


def test_a_crd_whose_rule_does_not_compile_is_refused(api: Api) -> None:
    crd = yaml.safe_load((ROOT / "crds" / "zarrlake.io_tags.yaml").read_text())
    crd["metadata"]["name"] = "widgets.zarrlake.io"
    crd["spec"]["names"] = {"plural": "widgets", "kind": "Widget"}
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{"rule": "self.ref ==", "message": "m"}]
    answer = api.call("POST", CRDS, crd)
    assert answer.status == 422 and answer.body["reason"] == "Invalid"
    field = (
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule"
    )
    assert list(answer.causes) == [field]
    assert "compilation failed" in answer.causes[field]


# -- the validator on its own ----------------------------------------------------------------------


def check(schema: dict[str, Any], value: Any, old: Any = None) -> list[str]:
    """Errors for ``{"spec": value}`` under ``{"spec": schema}`` (pruned and defaulted first)."""
    root = {"type": "object", "properties": {"spec": schema}}
    obj = apply_schema({"metadata": {"name": "x"}, "spec": value}, root, root=True)
    before = None if old is None else {"metadata": {"name": "x"}, "spec": old}
    return [str(e) for e in validate(obj, before, root)]


def test_nullable_int_or_string_and_preserved_fields() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "string", "nullable": True},
            "q": {"x-kubernetes-int-or-string": True},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "list": {"type": "array", "items": {"type": "string"}},
        },
    }
    assert check(schema, {"n": None, "q": 3, "free": {"a": [1, {"b": None}]}}) == []
    required = {**schema, "required": ["n"]}
    assert check(required, {"n": None}) == []  # present, as null: kept where nullable
    assert check(required, {}) == ["spec.n: Required value", NOT_CHECKED]
    assert check(schema, {"q": "50%", "list": ["a"]}) == []
    assert check(schema, {"list": [None]}) == [
        'spec.list[0]: Invalid value: "null": spec.list[0] in body must be of type string: "null"',
        NOT_CHECKED,
    ]
    assert check(schema, {"q": 1.5})[0] == (
        'spec.q: Invalid value: "number": spec.q in body must be of type integer,string: "number"'
    )


def test_formats_kubernetes_checks() -> None:
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "id": {"type": "string", "format": "uuid"},
            "size": {"type": "integer", "format": "int64"},  # a format no server checks
        },
    }
    ok = {"when": "2025-01-02T03:04:05Z", "id": "6f1c2d2e-4b2a-4f9e-9d7a-0c1b2a3d4e5f", "size": 1}
    assert check(schema, ok) == []
    assert check(schema, {"when": "yesterday"}) == [
        'spec.when: Invalid value: "yesterday": spec.when in body must be of type date-time: '
        '"yesterday"',
        NOT_CHECKED,
    ]


def test_message_expression_field_path_and_reason() -> None:
    schema = {
        "type": "object",
        "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
        "x-kubernetes-validations": [
            {
                "rule": "self.min <= self.max",
                "messageExpression": "'min %d is above max %d'.format([self.min, self.max])",
                "fieldPath": ".min",
            },
            {"rule": "has(self.max)", "reason": "FieldValueRequired", "fieldPath": ".max"},
            {"rule": "self.min >= 0", "reason": "FieldValueForbidden", "message": "negative"},
        ],
    }
    assert check(schema, {"min": 1, "max": 2}) == []
    assert check(schema, {"min": 3, "max": 2}) == [
        'spec.min: Invalid value: "object": min 3 is above max 2'
    ]
    assert check(schema, {"min": -1}) == [
        'spec: Invalid value: "object": no such key: max evaluating rule: self.min <= self.max',
        "spec.max: Required value: failed rule: has(self.max)",
        "spec: Forbidden: negative",
    ]


def test_numbers_reach_cel_typed_by_the_schema() -> None:
    schema = {
        "type": "object",
        "properties": {"days": {"type": "number"}, "count": {"type": "integer"}},
        "x-kubernetes-validations": [
            {"rule": "self.days / 2.0 > 1.0 && self.count / 2 == 1", "message": "arith"}
        ],
    }
    assert check(schema, {"days": 3, "count": 3.0}) == []  # 3 is a double, 3.0 an int here


def test_transition_rules_correlate_list_map_items_by_key() -> None:
    item = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "size": {
                "type": "integer",
                "x-kubernetes-validations": [
                    {"rule": "self >= oldSelf", "message": "size cannot shrink"}
                ],
            },
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "disks": {
                "type": "array",
                "items": item,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            "tags": {"type": "array", "items": item},  # atomic: items never correlate
        },
    }
    old = {
        "disks": [{"name": "a", "size": 5}, {"name": "b", "size": 5}],
        "tags": [{"name": "a", "size": 5}],
    }
    grown = {
        "disks": [{"name": "b", "size": 5}, {"name": "a", "size": 9}],
        "tags": [{"name": "a", "size": 1}],
    }
    assert check(schema, grown, old) == []
    shrunk = {"disks": [{"name": "b", "size": 4}, {"name": "c", "size": 1}]}
    assert check(schema, shrunk, old) == [
        'spec.disks[0].size: Invalid value: "integer": size cannot shrink'
    ]


def test_unchanged_invalid_values_are_ratcheted_on_update() -> None:
    """A value that became invalid when the schema got stricter does not block other changes
    (CRDValidationRatcheting); changing it, or a new object with it, is refused."""
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[a-z]+$"},
            "note": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}},
        },
    }
    old = {"code": "OLD", "note": "x", "tags": ["long"]}
    assert check(schema, {"code": "OLD", "note": "y", "tags": ["long"]}, old) == []
    assert check(schema, {"code": "NEW", "note": "x", "tags": ["long"]}, old)[0].startswith(
        'spec.code: Invalid value: "NEW"'
    )
    assert check(schema, {"code": "ok", "tags": ["long", "ok"]}, old) == [
        "spec.tags[0]: Too long: may not be longer than 2",
        NOT_CHECKED,
    ]
    assert check(schema, old)[0].startswith('spec.code: Invalid value: "OLD"')


def test_field_errors_print_as_go_prints_them() -> None:
    errors = [
        FieldError("FieldValueInvalid", "spec.a", 1.0, "d"),
        FieldError("FieldValueTooMany", "spec.b", 4, "must have at most 3 items"),
        FieldError("FieldValueRequired", "spec.c"),
    ]
    assert [str(e) for e in errors] == [
        "spec.a: Invalid value: 1: d",
        "spec.b: Too many: 4: must have at most 3 items",
        "spec.c: Required value",
    ]
    assert aggregate(errors[:1]) == "spec.a: Invalid value: 1: d"
    assert aggregate(errors[1:] + errors[1:]).startswith("[spec.b: Too many")


def test_virtual_containers_are_checked_by_the_schema_and_cel(api: Api) -> None:
    """spec.virtualContainers: the prefix's form by pattern, the fields only some schemes take
    by CEL rules (the same rules the operator's model checks in Python), keyed by urlPrefix."""
    from zarrlake.resources import VirtualContainerSpec

    good = [
        {
            "urlPrefix": "s3://era5/nc/",
            "region": "eu-west-1",
            "credentialsSecretRef": {"name": "k"},
        },
        {"urlPrefix": "gs://public/", "anonymous": True},
        {"urlPrefix": "az://c/x/", "accountName": "acct", "endpointURL": "http://127.0.0.1:1"},
        {"urlPrefix": "https://cdn.example.org/grib/"},
        {"urlPrefix": "file:///archive/"},
    ]
    created = api.create("Repository", "virt", {**repository(), "virtualContainers": good})
    assert created.status == 201, created.body
    for item in good:
        VirtualContainerSpec.model_validate(item)
    bad = [
        ({"urlPrefix": "s3://era5/nc"}, "should match"),  # no trailing slash
        ({"urlPrefix": "ftp://h/x/"}, "should match"),
        ({"urlPrefix": "https://h/x/?sig=1/"}, "should match"),
        ({"urlPrefix": "s3://b/a/../"}, "no '.' or '..' segments"),
        ({"urlPrefix": "gs://b/", "region": "eu"}, "region is for s3:// containers only"),
        ({"urlPrefix": "s3://b/", "accountName": "acct"}, "accountName is for az://"),
        ({"urlPrefix": "https://h/", "anonymous": True}, "anonymous is for"),
        ({"urlPrefix": "file:///a/", "endpointURL": "http://e"}, "endpointURL is for"),
        (
            {"urlPrefix": "file:///a/", "credentialsSecretRef": {"name": "k"}},
            "take no credentials",
        ),
        (
            {"urlPrefix": "gs://b/", "anonymous": True, "credentialsSecretRef": {"name": "k"}},
            "take no credentials",
        ),
    ]
    for item, message in bad:
        answer = api.create("Repository", "bad", {**repository(), "virtualContainers": [item]})
        causes = refused(answer, "Repository", "bad")
        assert any(message in m for m in causes.values()), (item, causes)
        if message != "should match":  # the pattern is pydantic's too, worded its own way
            with pytest.raises(ValueError, match=re.escape(message)):
                VirtualContainerSpec.model_validate(item)
    twice = [{"urlPrefix": "s3://b/"}, {"urlPrefix": "s3://b/"}]
    answer = api.create("Repository", "bad", {**repository(), "virtualContainers": twice})
    assert "Duplicate value" in json.dumps(refused(answer, "Repository", "bad"))
