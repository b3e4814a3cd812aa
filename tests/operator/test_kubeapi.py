"""The test Kubernetes API server (``zarrlake_testkit.kubeapi``) over real HTTP on 127.0.0.1.

One server process for the module; every test uses its own object names (or namespace). The
server is exercised with plain HTTP, with the ``kubernetes`` client, with kubectl and with a
small Kopf operator, the way the operator's tests and the e2e scenario will use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zarrlake_testkit.emulated import kubectl_binary
from zarrlake_testkit.kubeapi import (
    REQUEST_LOG_LIMIT,
    KubeAPI,
    KubeEmulator,
    jsonpath,
    parse_label_selector,
)

GROUP = "kubeapi.zarrlake.test"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


class Http:
    """JSON over HTTP to the server; returns (status, body) instead of raising on 4xx/5xx."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
        **params: str,
    ) -> tuple[int, Any]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path + query, data=data, method=method)
        request.add_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with self.opener.open(request, timeout=60) as rsp:
                return rsp.status, json.loads(rsp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def ok(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        status, answer = self.call(method, path, body, **kwargs)
        assert 200 <= status < 300, (status, answer)
        return answer

    @contextlib.contextmanager
    def watch(self, path: str, **params: str) -> Iterator[Callable[[int], list[dict[str, Any]]]]:
        """A watch stream; yields ``take(n)`` that reads the next n events (60 s each at most)."""
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        query = urllib.parse.urlencode({"watch": "true", **params})
        conn.request("GET", f"{path}?{query}")
        rsp = conn.getresponse()
        assert rsp.status == 200

        def take(n: int) -> list[dict[str, Any]]:
            events = []
            for _ in range(n):
                line = rsp.readline()
                assert line, "the watch stream ended"
                events.append(json.loads(line))
            return events

        try:
            yield take
        finally:
            conn.close()


def rsp_ends(take: Callable[[int], list[dict[str, Any]]]) -> bool:
    """Whether the watch stream ends (rather than yielding an event) within the read timeout."""
    try:
        take(1)
    except AssertionError as e:
        return "ended" in str(e)
    return False


def cm(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def crd(plural: str, kind: str, *, scope: str = "Namespaced", status: bool = True) -> dict:
    version: dict[str, Any] = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        },
        "additionalPrinterColumns": [
            {
                "name": "Ready",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
            },
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
            {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
        ],
    }
    if status:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "plural": plural,
                "singular": kind.lower(),
                "kind": kind,
                "shortNames": [kind.lower()[:3]],
                "categories": ["zltest"],
            },
            "versions": [version],
        },
    }


CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def wait_until(check: Callable[[], Any], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def kubeapi() -> Iterator[KubeAPI]:
    with KubeAPI() as api:
        yield api


@pytest.fixture
def api(kubeapi: KubeAPI) -> Http:
    return Http(kubeapi.url)


@pytest.fixture
def kubeconfig(kubeapi: KubeAPI, tmp_path: Path) -> Path:
    return kubeapi.write_kubeconfig(tmp_path / "kubeconfig")


# --------------------------------------------------------------------------------------------
# CRUD, selectors, watches
# --------------------------------------------------------------------------------------------


def test_server_process_lifecycle() -> None:
    api = KubeAPI().start()
    try:
        assert api.pid is not None
        version = Http(api.url).ok("GET", "/version")
        assert version["major"] == "1"
        names = [
            n["metadata"]["name"] for n in Http(api.url).ok("GET", "/api/v1/namespaces")["items"]
        ]
        assert {"default", "kube-system"} <= set(names)
    finally:
        api.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{api.url}/version", timeout=1)


def test_create_get_conflict_and_not_found(api: Http) -> None:
    status, created = api.call("POST", "/api/v1/namespaces/default/configmaps", cm("crud-a", a="1"))
    assert status == 201
    meta = created["metadata"]
    assert meta["namespace"] == "default" and meta["generation"] == 1
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0

    fetched = api.ok("GET", "/api/v1/namespaces/default/configmaps/crud-a")
    assert fetched == created

    status, dup = api.call("POST", "/api/v1/namespaces/default/configmaps", cm("crud-a"))
    assert status == 409
    assert dup["kind"] == "Status" and dup["reason"] == "AlreadyExists" and dup["code"] == 409

    status, missing = api.call("GET", "/api/v1/namespaces/default/configmaps/nope")
    assert status == 404
    assert missing["kind"] == "Status" and missing["reason"] == "NotFound"
    assert missing["details"] == {"kind": "configmaps", "name": "nope"}

    status, _ = api.call("POST", "/api/v1/namespaces/no-such-ns/configmaps", cm("x"))
    assert status == 404

    status, generated = api.call(
        "POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"generateName": "gen-"}}
    )
    assert status == 201 and generated["metadata"]["name"].startswith("gen-")

    # The resourceVersion is one cluster-wide counter.
    status, other = api.call(
        "POST", "/api/v1/namespaces/default/secrets", {"metadata": {"name": "crud-s"}}
    )
    assert int(other["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])


def test_list_and_selectors(api: Http) -> None:
    api.ok("POST", "/api/v1/namespaces", {"metadata": {"name": "sel"}})
    for name, labels in [
        ("s1", {"app": "a", "tier": "x"}),
        ("s2", {"app": "b", "tier": "y"}),
        ("s3", {"app": "a"}),
    ]:
        api.ok("POST", "/api/v1/namespaces/sel/configmaps", cm(name, labels))
    api.ok("POST", "/api/v1/namespaces/default/configmaps", cm("s4", {"app": "a"}))

    listing = api.ok("GET", "/api/v1/namespaces/sel/configmaps")
    assert listing["kind"] == "ConfigMapList" and listing["apiVersion"] == "v1"
    assert int(listing["metadata"]["resourceVersion"]) >= 4

    def names(path: str = "/api/v1/namespaces/sel/configmaps", **params: str) -> list[str]:
        return [i["metadata"]["name"] for i in api.ok("GET", path, **params)["items"]]

    assert names() == ["s1", "s2", "s3"]
    assert names(labelSelector="app=a") == ["s1", "s3"]
    assert names(labelSelector="app==a,tier=x") == ["s1"]
    assert names(labelSelector="app!=a") == ["s2"]
    assert names(labelSelector="tier") == ["s1", "s2"]
    assert names(labelSelector="!tier") == ["s3"]
    assert names(labelSelector="tier in (x, z)") == ["s1"]
    assert names(labelSelector="tier notin (x)") == ["s2", "s3"]
    assert names(fieldSelector="metadata.name=s2") == ["s2"]
    assert names(fieldSelector="metadata.name!=s2") == ["s1", "s3"]
    # Cluster-wide (all namespaces) with a field selector on the namespace.
    everywhere = names("/api/v1/configmaps", labelSelector="app=a")
    assert set(everywhere) >= {"s1", "s3", "s4"}
    assert names(
        "/api/v1/configmaps", labelSelector="app=a", fieldSelector="metadata.namespace=default"
    ) == ["s4"]
    status, bad = api.call("GET", "/api/v1/configmaps", labelSelector="a in (b")
    assert status == 400 and bad["reason"] == "BadRequest"


def test_custom_resources_select_only_on_their_selectable_fields(api: Http) -> None:
    """As kube-apiserver: a custom resource's list or watch selects on metadata.name,
    metadata.namespace and the CRD's selectableFields; any other field is 400 (the operator's
    fallback relies on that answer)."""
    group = "select.zarrlake.test"  # a group of its own: another test starts without GROUP
    definition = crd("widgets", "Widget")
    definition["metadata"]["name"] = f"widgets.{group}"
    definition["spec"]["group"] = group
    definition["spec"]["versions"][0]["selectableFields"] = [{"jsonPath": ".spec.owner"}]
    api.ok("POST", CRDS, definition)
    path = f"/apis/{group}/v1/namespaces/default/widgets"
    for name, owner in (("w1", "a"), ("w2", "b"), ("w3", "a")):
        body = {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": name}}
        api.ok("POST", path, {**body, "spec": {"owner": owner, "size": 1}})

    def names(**params: str) -> list[str]:
        return [i["metadata"]["name"] for i in api.ok("GET", path, **params)["items"]]

    assert names(fieldSelector="spec.owner=a") == ["w1", "w3"]
    assert names(fieldSelector="spec.owner!=a,metadata.name=w2") == ["w2"]
    for params in ({"fieldSelector": "spec.size=1"}, {"fieldSelector": "status.x=1"}):
        status, bad = api.call("GET", path, **params)
        assert status == 400 and bad["reason"] == "BadRequest", bad
        assert "field label not supported" in bad["message"]
        status, _ = api.call("GET", path, watch="true", timeoutSeconds="1", **params)
        assert status == 400


def test_watch_replays_from_resource_version(api: Http) -> None:
    path = "/api/v1/namespaces/default/configmaps"
    first = api.ok("POST", path, cm("w-old", {"w": "1"}))
    rv0 = api.ok("GET", path, labelSelector="w")["metadata"]["resourceVersion"]
    created = api.ok("POST", path, cm("w-new", {"w": "1"}))
    modified = api.ok(
        "PATCH", f"{path}/w-new", {"data": {"k": "v"}}, content_type="application/merge-patch+json"
    )
    api.ok("DELETE", f"{path}/w-old")

    # Only what happened after rv0, in order, with the objects' resource versions.
    with api.watch(path, resourceVersion=rv0, labelSelector="w") as take:
        events = take(3)
        assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
        assert (
            events[0]["object"]["metadata"]["resourceVersion"]
            == created["metadata"]["resourceVersion"]
        )
        assert (
            events[1]["object"]["metadata"]["resourceVersion"]
            == modified["metadata"]["resourceVersion"]
        )
        assert events[2]["object"]["metadata"]["name"] == "w-old"
        rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert rvs == sorted(rvs) and rvs[0] > int(rv0)
        # ... and then live.
        api.ok("POST", path, cm("w-live", {"w": "1"}))
        (live,) = take(1)
        assert live["type"] == "ADDED" and live["object"]["metadata"]["name"] == "w-live"

    # Without a resourceVersion: the current objects as ADDED first.
    with api.watch(path, labelSelector="w") as take:
        names = {e["object"]["metadata"]["name"] for e in take(2)}
        assert names == {"w-new", "w-live"}
    assert first["metadata"]["name"] == "w-old"


def test_watch_selector_transitions_and_timeout(api: Http) -> None:
    path = "/api/v1/namespaces/default/configmaps"
    rv = api.ok("GET", path)["metadata"]["resourceVersion"]
    with api.watch(path, resourceVersion=rv, labelSelector="phase=on") as take:
        api.ok("POST", path, cm("t-1", {"phase": "off"}))  # not seen
        merge = {"content_type": "application/merge-patch+json"}
        api.ok("PATCH", f"{path}/t-1", {"metadata": {"labels": {"phase": "on"}}}, **merge)
        api.ok("PATCH", f"{path}/t-1", {"data": {"a": "b"}}, **merge)
        api.ok("PATCH", f"{path}/t-1", {"metadata": {"labels": {"phase": "off"}}}, **merge)
        assert [e["type"] for e in take(3)] == ["ADDED", "MODIFIED", "DELETED"]

    started = time.monotonic()
    now = api.ok("GET", path)["metadata"]["resourceVersion"]
    with api.watch(path, resourceVersion=now, timeoutSeconds="1") as take:
        assert rsp_ends(take)
    assert time.monotonic() - started < 10  # it ended at the server-side timeout (1 s)


def test_watch_bookmarks_before_the_timeout(api: Http) -> None:
    """allowWatchBookmarks: kube-apiserver sends a BOOKMARK with its current resourceVersion
    shortly (2 s) before the watch's timeoutSeconds, so the client resumes from a fresh one
    even when nothing it watches changed; without it, none."""
    path = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    api.ok("POST", path, {"metadata": {"name": "bm-watched"}, "spec": {"holderIdentity": "a"}})
    rv = api.ok("GET", path)["metadata"]["resourceVersion"]
    selector = "metadata.name=bm-watched"
    with api.watch(
        path,
        resourceVersion=rv,
        fieldSelector=selector,
        timeoutSeconds="5",
        allowWatchBookmarks="true",
    ) as take:
        # Something else changes meanwhile: not shown, but the bookmark's version is past it.
        other = api.ok("POST", path, {"metadata": {"name": "bm-other"}})
        (bookmark,) = take(1)
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["object"]["kind"] == "Lease"
        assert set(bookmark["object"]["metadata"]) == {"resourceVersion"}
        bookmarked = int(bookmark["object"]["metadata"]["resourceVersion"])
        assert bookmarked >= int(other["metadata"]["resourceVersion"])
        assert rsp_ends(take)
    with api.watch(path, resourceVersion=rv, fieldSelector=selector, timeoutSeconds="3") as take:
        assert rsp_ends(take)  # no bookmark unless asked for


def test_watch_too_old_resource_version_is_gone() -> None:
    class SmallHistory(KubeEmulator):
        history_limit = 3

    async def scenario() -> list[dict[str, Any]]:
        import aiohttp
        import kmock

        emulator = SmallHistory()
        async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as session:
            base = str(server.url).rstrip("/")
            for i in range(6):
                body = {"metadata": {"name": f"h{i}"}}
                async with session.post(
                    f"{base}/api/v1/namespaces/default/configmaps", json=body
                ) as r:
                    assert r.status == 201
            url = f"{base}/api/v1/namespaces/default/configmaps?watch=true&resourceVersion=4"
            async with session.get(url) as r:
                return [json.loads(line) async for line in r.content]

    (event,) = asyncio.run(scenario())
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"


def test_request_log_is_bounded() -> None:
    async def scenario() -> int:
        import aiohttp
        import kmock

        emulator = KubeEmulator()
        async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as session:
            for _ in range(REQUEST_LOG_LIMIT * 3):
                async with session.get(f"{str(server.url).rstrip('/')}/api/v1/namespaces") as r:
                    assert r.status == 200
        return len(emulator)  # KMock's request history, through its own view API

    assert asyncio.run(scenario()) <= REQUEST_LOG_LIMIT * 2


# --------------------------------------------------------------------------------------------
# Writes: patches, conflicts, generations, status, finalizers, garbage collection
# --------------------------------------------------------------------------------------------


def test_patches_and_conflicts(api: Http) -> None:
    path = "/api/v1/namespaces/default/configmaps"
    obj = api.ok("POST", path, cm("p-1", a="1", b="2"))
    rv = obj["metadata"]["resourceVersion"]

    merged = api.ok(
        "PATCH",
        f"{path}/p-1",
        {"data": {"a": None, "c": "3"}},
        content_type="application/merge-patch+json",
    )
    assert merged["data"] == {"b": "2", "c": "3"}
    assert int(merged["metadata"]["resourceVersion"]) > int(rv)

    # A no-op patch changes nothing, not even the resource version.
    same = api.ok(
        "PATCH", f"{path}/p-1", {"data": {"b": "2"}}, content_type="application/merge-patch+json"
    )
    assert same["metadata"]["resourceVersion"] == merged["metadata"]["resourceVersion"]

    ops = [
        {
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": merged["metadata"]["resourceVersion"],
        },
        {"op": "add", "path": "/data/d", "value": "4"},
    ]
    patched = api.ok("PATCH", f"{path}/p-1", ops, content_type="application/json-patch+json")
    assert patched["data"]["d"] == "4"

    # The same test op again: the resource version moved on -> 422 (what Kopf expects).
    status, failed = api.call(
        "PATCH", f"{path}/p-1", ops, content_type="application/json-patch+json"
    )
    assert status == 422 and failed["kind"] == "Status" and failed["reason"] == "Invalid"

    # A stale resourceVersion in a merge patch or a PUT -> 409 Conflict.
    stale = {"metadata": {"resourceVersion": rv}, "data": {"e": "5"}}
    status, conflict = api.call(
        "PATCH", f"{path}/p-1", stale, content_type="application/merge-patch+json"
    )
    assert status == 409 and conflict["reason"] == "Conflict"
    status, conflict = api.call(
        "PUT", f"{path}/p-1", {**cm("p-1"), "metadata": {"name": "p-1", "resourceVersion": rv}}
    )
    assert status == 409 and conflict["reason"] == "Conflict"

    current = api.ok("GET", f"{path}/p-1")
    replaced = api.ok("PUT", f"{path}/p-1", {**current, "data": {"only": "this"}})
    assert replaced["data"] == {"only": "this"}
    assert replaced["metadata"]["uid"] == obj["metadata"]["uid"]

    status, _ = api.call(
        "PATCH", f"{path}/nope", {"data": {}}, content_type="application/merge-patch+json"
    )
    assert status == 404
    status, _ = api.call("PATCH", f"{path}/p-1", {"data": {}}, content_type="text/plain")
    assert status == 415


def test_strategic_merge_patch_merges_containers_by_name(api: Http) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "smp", "labels": {"app": "smp"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "smp"}},
            "template": {
                "metadata": {"labels": {"app": "smp"}},
                "spec": {
                    "containers": [
                        {"name": "main", "image": "a:1", "env": [{"name": "X", "value": "1"}]},
                        {"name": "side", "image": "b:1"},
                    ]
                },
            },
        },
    }
    path = "/apis/apps/v1/namespaces/default/deployments"
    created = api.ok("POST", path, deployment)
    assert created["metadata"]["generation"] == 1
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "a:2"}]}}}}
    patched = api.ok(
        "PATCH", f"{path}/smp", patch, content_type="application/strategic-merge-patch+json"
    )
    containers = patched["spec"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [("main", "a:2"), ("side", "b:1")]
    assert containers[0]["env"] == [{"name": "X", "value": "1"}]
    assert patched["metadata"]["generation"] == 2
    deleted = {
        "spec": {"template": {"spec": {"containers": [{"name": "side", "$patch": "delete"}]}}}
    }
    patched = api.ok(
        "PATCH", f"{path}/smp", deleted, content_type="application/strategic-merge-patch+json"
    )
    assert [c["name"] for c in patched["spec"]["template"]["spec"]["containers"]] == ["main"]
    # The scale subresource (kubectl scale) sets spec.replicas.
    scale = api.ok(
        "PATCH",
        f"{path}/smp/scale",
        {"spec": {"replicas": 3}},
        content_type="application/merge-patch+json",
    )
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert api.ok("GET", f"{path}/smp")["spec"]["replicas"] == 3


def test_crd_registration_status_subresource_and_generation(api: Http) -> None:
    status, _ = api.call("GET", f"/apis/{GROUP}/v1")
    assert status == 404
    definition = api.ok("POST", CRDS, crd("gadgets", "Gadget"))
    conditions = {c["type"]: c["status"] for c in definition["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}

    groups = api.ok("GET", "/apis")["groups"]
    v1 = {"groupVersion": f"{GROUP}/v1", "version": "v1"}
    assert {"name": GROUP, "versions": [v1], "preferredVersion": v1} in groups
    resources = {r["name"]: r for r in api.ok("GET", f"/apis/{GROUP}/v1")["resources"]}
    assert resources["gadgets"]["kind"] == "Gadget" and resources["gadgets"]["namespaced"] is True
    assert resources["gadgets"]["shortNames"] == ["gad"] and resources["gadgets"]["categories"] == [
        "zltest"
    ]
    assert "watch" in resources["gadgets"]["verbs"]
    assert resources["gadgets/status"]["verbs"] == ["get", "patch", "update"]
    assert api.ok("GET", f"/apis/{GROUP}")["preferredVersion"]["version"] == "v1"

    path = f"/apis/{GROUP}/v1/namespaces/default/gadgets"
    body = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Gadget",
        "metadata": {"name": "g1"},
        "spec": {"size": 1},
        "status": {"phase": "ignored on create"},
    }
    created = api.ok("POST", path, body)
    assert created["metadata"]["generation"] == 1 and "status" not in created

    merge = "application/merge-patch+json"
    st = api.ok(
        "PATCH",
        f"{path}/g1/status",
        {"status": {"phase": "Ready"}, "spec": {"size": 99}},
        content_type=merge,
    )
    assert st["status"] == {"phase": "Ready"} and st["spec"] == {"size": 1}  # status only
    assert st["metadata"]["generation"] == 1
    assert api.ok("GET", f"{path}/g1/status")["status"]["phase"] == "Ready"

    main = api.ok(
        "PATCH",
        f"{path}/g1",
        {"spec": {"size": 2}, "status": {"phase": "Hacked"}},
        content_type=merge,
    )
    assert main["spec"]["size"] == 2 and main["status"] == {"phase": "Ready"}  # no status via main
    assert main["metadata"]["generation"] == 2
    labelled = api.ok(
        "PATCH", f"{path}/g1", {"metadata": {"labels": {"x": "y"}}}, content_type=merge
    )
    assert labelled["metadata"]["generation"] == 2  # metadata does not count
    put = api.ok("PUT", f"{path}/g1/status", {**labelled, "status": {"phase": "Done"}})
    assert put["status"] == {"phase": "Done"} and put["metadata"]["generation"] == 2

    # Without the status subresource, /status is 404 and status writes go through the main resource.
    api.ok("POST", CRDS, crd("gizmos", "Gizmo", scope="Cluster", status=False))
    gizmo = api.ok(
        "POST", f"/apis/{GROUP}/v1/gizmos", {"metadata": {"name": "z"}, "status": {"s": 1}}
    )
    assert gizmo["status"] == {"s": 1} and "namespace" not in gizmo["metadata"]
    status, _ = api.call("GET", f"/apis/{GROUP}/v1/gizmos/z/status")
    assert status == 404

    # Deleting the CRD unregisters the resource and takes its objects along.
    api.ok("DELETE", f"{CRDS}/gadgets.{GROUP}")
    status, _ = api.call("GET", path)
    assert status == 404
    names = [r["name"] for r in api.ok("GET", f"/apis/{GROUP}/v1")["resources"]]
    assert names == ["gizmos"]
    api.ok("DELETE", f"{CRDS}/gizmos.{GROUP}")
    assert all(g["name"] != GROUP for g in api.ok("GET", "/apis")["groups"])
    # A wrongly named CRD is invalid.
    bad = crd("things", "Thing")
    bad["metadata"]["name"] = "wrong.example.com"
    status, invalid = api.call("POST", CRDS, bad)
    assert status == 422 and invalid["reason"] == "Invalid"


def test_crd_schema_defaults_and_pruning(api: Http) -> None:
    definition = crd("sprockets", "Sprocket")
    definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "size": {"type": "integer", "default": 1},
                    "mode": {"type": "string", "default": "managed"},
                    "storage": {
                        "type": "object",
                        "default": {},
                        "properties": {"prefix": {"type": "string", "default": ""}},
                    },
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            },
            "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
        },
    }
    api.ok("POST", CRDS, definition)
    path = f"/apis/{GROUP}/v1/namespaces/default/sprockets"
    spec = {"size": 3, "mode": None, "bogus": 1, "labels": {"a": "b"}, "free": {"any": {"x": 1}}}
    created = api.ok("POST", path, {"metadata": {"name": "s1"}, "spec": spec})
    assert created["spec"] == {
        "size": 3,
        "mode": "managed",  # null for a non-nullable field: dropped, then defaulted
        "storage": {"prefix": ""},  # a defaulted object gets its own defaults
        "labels": {"a": "b"},
        "free": {"any": {"x": 1}},
    }
    status = {"status": {"phase": "Ready", "kopf": {"progress": {}}}}
    patched = api.ok(
        "PATCH", f"{path}/s1/status", status, content_type="application/merge-patch+json"
    )
    assert patched["status"] == {"phase": "Ready"}  # unknown status fields are pruned too
    api.ok("DELETE", f"{CRDS}/sprockets.{GROUP}")


def test_finalizers_block_deletion_until_removed(api: Http) -> None:
    path = "/api/v1/namespaces/default/configmaps"
    obj = api.ok("POST", path, {"metadata": {"name": "fin", "finalizers": ["test/hold"]}})
    rv = obj["metadata"]["resourceVersion"]
    with api.watch(path, resourceVersion=rv, fieldSelector="metadata.name=fin") as take:
        deleting = api.ok("DELETE", f"{path}/fin")
        assert deleting["metadata"]["deletionTimestamp"]
        # Marked for deletion: a new generation (kube-apiserver's rule; controllers act otherwise).
        assert deleting["metadata"]["generation"] == obj["metadata"]["generation"] + 1
        (event,) = take(1)
        assert event["type"] == "MODIFIED" and event["object"]["metadata"]["deletionTimestamp"]
        assert api.ok("GET", f"{path}/fin")["metadata"]["finalizers"] == ["test/hold"]
        again = api.ok("DELETE", f"{path}/fin")  # idempotent while being deleted
        assert again["metadata"]["resourceVersion"] == deleting["metadata"]["resourceVersion"]
        status, invalid = api.call(
            "PATCH",
            f"{path}/fin",
            {"metadata": {"finalizers": ["test/hold", "test/new"]}},
            content_type="application/merge-patch+json",
        )
        assert status == 422 and invalid["reason"] == "Invalid"

        ops = [{"op": "remove", "path": "/metadata/finalizers"}]
        api.ok("PATCH", f"{path}/fin", ops, content_type="application/json-patch+json")
        (event,) = take(1)
        assert event["type"] == "DELETED" and event["object"]["metadata"]["name"] == "fin"
    status, _ = api.call("GET", f"{path}/fin")
    assert status == 404


def test_owner_references_are_garbage_collected(api: Http) -> None:
    api.ok("POST", "/api/v1/namespaces", {"metadata": {"name": "gc"}})
    owner = api.ok("POST", "/api/v1/namespaces/gc/configmaps", cm("owner"))
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    secret = {
        "metadata": {"name": "dep-secret", "ownerReferences": [ref]},
        "stringData": {"k": "v"},
    }
    assert api.ok("POST", "/api/v1/namespaces/gc/secrets", secret)["data"] == {"k": "dg=="}
    cron = {
        "metadata": {"name": "dep-cron", "ownerReferences": [ref]},
        "spec": {"schedule": "@daily"},
    }
    api.ok("POST", "/apis/batch/v1/namespaces/gc/cronjobs", cron)
    held = {"metadata": {"name": "dep-held", "ownerReferences": [ref], "finalizers": ["x/y"]}}
    api.ok("POST", "/api/v1/namespaces/gc/services", held)
    elsewhere = {"metadata": {"name": "gc-other-ns", "ownerReferences": [ref]}}
    api.ok("POST", "/api/v1/namespaces/default/secrets", elsewhere)
    orphan_owner = api.ok("POST", "/api/v1/namespaces/gc/configmaps", cm("orphan-owner"))
    oref = {**ref, "name": "orphan-owner", "uid": orphan_owner["metadata"]["uid"]}
    orphan = {"metadata": {"name": "orphan", "ownerReferences": [oref]}}
    api.ok("POST", "/api/v1/namespaces/gc/secrets", orphan)

    api.ok("DELETE", "/api/v1/namespaces/gc/configmaps/owner", {"propagationPolicy": "Background"})
    assert api.call("GET", "/api/v1/namespaces/gc/secrets/dep-secret")[0] == 404
    assert api.call("GET", "/apis/batch/v1/namespaces/gc/cronjobs/dep-cron")[0] == 404
    held_now = api.ok("GET", "/api/v1/namespaces/gc/services/dep-held")
    assert held_now["metadata"]["deletionTimestamp"]  # deleted, but its finalizer holds it
    assert api.call("GET", "/api/v1/namespaces/default/secrets/gc-other-ns")[0] == 200

    api.ok("DELETE", "/api/v1/namespaces/gc/configmaps/orphan-owner", propagationPolicy="Orphan")
    orphan = api.ok("GET", "/api/v1/namespaces/gc/secrets/orphan")
    assert "ownerReferences" not in orphan["metadata"]

    # A dependent written after its owner went (a controller racing the owner's deletion) is
    # collected like a real cluster's garbage collector collects dangling owner references.
    late = {
        "metadata": {"name": "late-dep", "ownerReferences": [ref]},
        "spec": {"schedule": "@daily"},
    }
    api.ok("POST", "/apis/batch/v1/namespaces/gc/cronjobs", late)
    assert api.call("GET", "/apis/batch/v1/namespaces/gc/cronjobs/late-dep")[0] == 404

    # Namespace deletion: terminating until its last finalizer-held object goes.
    terminating = api.ok("DELETE", "/api/v1/namespaces/gc")
    assert terminating["status"]["phase"] == "Terminating"
    assert api.call("POST", "/api/v1/namespaces/gc/configmaps", cm("late"))[0] == 403
    assert api.call("GET", "/api/v1/namespaces/gc/secrets/orphan")[0] == 404
    api.ok(
        "PATCH",
        "/api/v1/namespaces/gc/services/dep-held",
        {"metadata": {"finalizers": None}},
        content_type="application/merge-patch+json",
    )
    assert api.call("GET", "/api/v1/namespaces/gc")[0] == 404


def test_server_side_table(api: Http) -> None:
    api.ok("POST", CRDS, crd("screens", "Screen"))
    path = f"/apis/{GROUP}/v1/namespaces/default/screens"
    api.ok("POST", path, {"metadata": {"name": "t1"}, "spec": {"size": 5}})
    conditions = [{"type": "Other", "status": "False"}, {"type": "Ready", "status": "True"}]
    status = {"phase": "Ready", "url": "s3://b/p", "conditions": conditions}
    api.ok(
        "PATCH",
        f"{path}/t1/status",
        {"status": status},
        content_type="application/merge-patch+json",
    )
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    table = api.ok("GET", path, headers={"Accept": accept})
    assert table["kind"] == "Table" and table["apiVersion"] == "meta.k8s.io/v1"
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == ["Name", "Ready", "Phase", "Size", "URL", "Age"]
    assert [c["priority"] for c in table["columnDefinitions"]] == [0, 0, 0, 0, 1, 0]
    (row,) = table["rows"]
    assert row["cells"][:5] == ["t1", "True", "Ready", 5, "s3://b/p"]
    assert row["object"]["kind"] == "PartialObjectMetadata"
    single = api.ok("GET", f"{path}/t1", headers={"Accept": accept})
    assert single["rows"][0]["cells"][0] == "t1"
    builtin = api.ok("GET", "/api/v1/namespaces", headers={"Accept": accept})
    assert [c["name"] for c in builtin["columnDefinitions"]] == ["Name", "Status", "Age"]
    api.ok("DELETE", f"{CRDS}/screens.{GROUP}")


def test_jsonpath_and_selector_parsing() -> None:
    conditions = [{"type": "A", "status": "x"}, {"type": "Ready", "status": "True"}]
    obj = {"status": {"conditions": conditions}, "spec": {"items": [1, 2], "m": {"k.x": 3}}}
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath(obj, "{.spec.items[1]}") == [2]
    assert jsonpath(obj, ".spec.items[*]") == [1, 2]
    assert jsonpath(obj, ".spec.m['k.x']") == [3]
    assert jsonpath(obj, ".spec.missing.deeper") == []
    reqs = parse_label_selector("a=b, c in (d,e), !f, g!=h, i")
    assert [r.op for r in reqs] == ["eq", "in", "notexists", "ne", "exists"]


# --------------------------------------------------------------------------------------------
# Real clients: the kubernetes library, kubectl, Kopf
# --------------------------------------------------------------------------------------------


def test_kubernetes_client(kubeconfig: Path) -> None:
    from kubernetes import client, config, watch

    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    core = client.CoreV1Api(api_client)
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name="kc-secret", labels={"via": "kc"}),
        string_data={"password": "p"},
    )
    created = core.create_namespaced_secret("default", secret)
    assert created.data == {"password": "cA=="} and created.type == "Opaque"
    listed = core.list_namespaced_secret("default", label_selector="via=kc").items
    assert [s.metadata.name for s in listed] == ["kc-secret"]
    core.patch_namespaced_secret("kc-secret", "default", {"metadata": {"labels": {"more": "yes"}}})
    events = []
    stream = watch.Watch().stream(
        core.list_namespaced_secret, "default", label_selector="more=yes", timeout_seconds=1
    )
    for event in stream:
        events.append((event["type"], event["object"].metadata.name))
    assert events == [("ADDED", "kc-secret")]
    core.delete_namespaced_secret("kc-secret", "default")
    with pytest.raises(client.ApiException) as info:
        core.read_namespaced_secret("kc-secret", "default")
    assert info.value.status == 404


def kubectl(kubeconfig: Path, *args: str, check: bool = True, stdin: str | None = None) -> str:
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "KUBECACHEDIR": str(kubeconfig.parent / "kcache"),
    }
    result = subprocess.run(
        [kubectl_binary(), *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if check:
        assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout + result.stderr


def test_kubectl(kubeconfig: Path, tmp_path: Path) -> None:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "crd.yaml").write_text(json.dumps(crd("doodads", "Doodad")))
    (manifests / "config.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: kc-config}\ndata: {a: b}\n"
    )
    out = kubectl(kubeconfig, "apply", "-f", str(manifests))  # default: --validate=strict
    assert f"customresourcedefinition.apiextensions.k8s.io/doodads.{GROUP} created" in out
    assert "configmap/kc-config created" in out
    kubectl(
        kubeconfig, "wait", "--for=condition=Established", f"crd/doodads.{GROUP}", "--timeout=60s"
    )

    widgets = tmp_path / "doodads"
    widgets.mkdir()
    (widgets / "d1.yaml").write_text(
        textwrap.dedent(
            f"""\
            apiVersion: {GROUP}/v1
            kind: Doodad
            metadata: {{name: d1, labels: {{app: kc}}}}
            spec: {{size: 3}}
            """
        )
    )
    assert f"doodad.{GROUP}/d1 created" in kubectl(kubeconfig, "apply", "-f", str(widgets))
    ready = [{"type": "Ready", "status": "True"}]
    status = json.dumps({"status": {"phase": "Ready", "url": "s3://x", "conditions": ready}})
    kubectl(
        kubeconfig, "patch", "doodad", "d1", "--subresource=status", "--type=merge", "-p", status
    )

    table = kubectl(kubeconfig, "get", "doodads").splitlines()
    assert table[0].split() == ["NAME", "READY", "PHASE", "SIZE", "AGE"]
    assert table[1].split()[:4] == ["d1", "True", "Ready", "3"]
    wide = kubectl(kubeconfig, "get", "doo", "-o", "wide").splitlines()  # by short name
    assert wide[0].split() == ["NAME", "READY", "PHASE", "SIZE", "URL", "AGE"]
    assert "d1" in kubectl(kubeconfig, "get", "zltest")  # by category

    kubectl(kubeconfig, "patch", "doodad", "d1", "--type=merge", "-p", '{"spec": {"size": 4}}')
    replace = json.dumps([{"op": "replace", "path": "/spec/size", "value": 5}])
    kubectl(kubeconfig, "patch", "doodad", "d1", "--type=json", "-p", replace)
    test = json.dumps([{"op": "test", "path": "/spec/size", "value": 0}])
    failed = kubectl(kubeconfig, "patch", "doodad", "d1", "--type=json", "-p", test, check=False)
    assert "testing value /spec/size failed" in failed
    obj = json.loads(kubectl(kubeconfig, "get", "doodad", "d1", "-o", "json"))
    assert obj["spec"]["size"] == 5 and obj["metadata"]["generation"] == 3
    assert "phase: Ready" in kubectl(kubeconfig, "get", "doodad", "d1", "-o", "yaml")
    kubectl(
        kubeconfig, "wait", "--for=jsonpath={.status.phase}=Ready", "doodad/d1", "--timeout=60s"
    )
    described = kubectl(kubeconfig, "describe", "doodad", "d1")
    assert "Name:         d1" in described and "Size:  5" in described

    # Re-applying a changed manifest patches it (a JSON merge patch for custom resources).
    (widgets / "d1.yaml").write_text(
        (widgets / "d1.yaml").read_text().replace("size: 3", "size: 7")
    )
    assert f"doodad.{GROUP}/d1 configured" in kubectl(kubeconfig, "apply", "-f", str(widgets))
    assert kubectl(kubeconfig, "get", "doodad", "d1", "-o", "jsonpath={.spec.size}") == "7"

    # Typed kubectl commands (protobuf bodies) for namespaces, secrets and config maps.
    kubectl(kubeconfig, "create", "namespace", "kc-ns")
    kubectl(
        kubeconfig, "-n", "kc-ns", "create", "secret", "generic", "creds", "--from-literal=key=v"
    )
    assert (
        kubectl(kubeconfig, "-n", "kc-ns", "get", "secret", "creds", "-o", "jsonpath={.data.key}")
        == "dg=="
    )
    kubectl(kubeconfig, "label", "configmap", "kc-config", "tier=x")
    assert "kc-config" in kubectl(kubeconfig, "get", "configmaps", "-l", "tier in (x,y)")

    assert f'doodad.{GROUP} "d1" deleted' in kubectl(
        kubeconfig, "delete", "doodad", "d1", "--timeout=60s"
    )
    assert "No resources found" in kubectl(kubeconfig, "get", "doodads")
    kubectl(kubeconfig, "delete", "namespace", "kc-ns", "--timeout=60s")
    kubectl(kubeconfig, "delete", "-f", str(manifests), "--timeout=60s")
    assert "doodads" not in kubectl(kubeconfig, "api-resources")


KOPF_OPERATOR = """
import pathlib

import kopf

MARKERS = pathlib.Path({markers!r})


@kopf.on.login()
def login(**kwargs):
    # Reads KUBECONFIG on every call (the kubernetes client reads it once, at import time).
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.watching.server_timeout = 10
    settings.watching.connect_timeout = 5
    settings.persistence.finalizer = "kubeapi.zarrlake.test/finalizer"


@kopf.on.create({group!r}, "v1", "robots")
def created(spec, patch, body, **_):
    kopf.info(body, reason="Created", message="seen by the test operator")
    patch.status["phase"] = "Handled"
    return {{"size": spec.get("size")}}


@kopf.on.delete({group!r}, "v1", "robots")
def deleted(name, **_):
    (MARKERS / f"deleted-{{name}}").write_text("yes")
"""


def test_kopf_operator(api: Http, kubeconfig: Path, tmp_path: Path) -> None:
    from kopf.testing import KopfRunner

    api.ok("POST", CRDS, crd("robots", "Robot"))
    # Not "operator.py": Kopf puts the file's folder first on sys.path of this process, where a
    # module of that name would shadow the standard library's for every later import.
    operator = tmp_path / "robots_operator.py"
    operator.write_text(KOPF_OPERATOR.format(markers=str(tmp_path), group=GROUP))
    path = f"/apis/{GROUP}/v1/namespaces/default/robots"

    saved = os.environ.get("KUBECONFIG")
    saved_path = list(sys.path)
    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        with KopfRunner(
            ["run", "--standalone", "-n", "default", "--verbose", str(operator)], timeout=120
        ) as runner:
            api.ok("POST", path, {"metadata": {"name": "r1"}, "spec": {"size": 2}})

            def handled() -> dict[str, Any] | None:
                obj = api.ok("GET", f"{path}/r1")
                return obj if obj.get("status", {}).get("phase") == "Handled" else None

            obj = wait_until(handled)
            assert obj["status"]["created"] == {"size": 2}  # the handler's result
            assert obj["metadata"]["finalizers"] == ["kubeapi.zarrlake.test/finalizer"]
            assert obj["metadata"]["generation"] == 1  # status and metadata writes only

            def posted() -> list[dict[str, Any]]:  # Kopf posts events in the background
                events = api.ok(
                    "GET",
                    "/api/v1/namespaces/default/events",
                    fieldSelector="involvedObject.name=r1",
                )["items"]
                return [e for e in events if e["reason"] == "Created"]

            (event,) = wait_until(posted)
            assert event["metadata"]["name"].startswith("kopf-event-")  # generateName
            assert event["involvedObject"]["uid"] == obj["metadata"]["uid"]

            api.ok("DELETE", f"{path}/r1")
            wait_until(lambda: api.call("GET", f"{path}/r1")[0] == 404)
            assert (tmp_path / "deleted-r1").read_text() == "yes"
    finally:
        sys.path[:] = saved_path
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
        api.call("DELETE", f"{CRDS}/robots.{GROUP}")

    assert runner.exception is None, runner.exception
    assert runner.exit_code == 0, runner.output
    assert "Handler 'created' succeeded" in runner.output
    assert "Handler 'deleted' succeeded" in runner.output
