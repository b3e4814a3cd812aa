"""``spec.serve`` end to end: the real operator process against the emulated Kubernetes API and
moto's S3. The emulated cluster's kubelet (``zarrlake_testkit.emulated.LocalCluster``) runs each
server pod's container command, ``zarrlake serve ...``, as a real process with the pod's
environment and Secret volumes, and probes ``/readyz`` for real: what the operator reports is
what the server it configured does."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import zarr
from gitops_checks import argo_health, kstatus
from k8s_env import Env, condition, wait_for

from zarrlake_operator import kube

TOKEN = "t0ken-for-the-serve-tests"
API = "zarrlake.io/v1alpha1"


def http(url: str, token: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, straight to the address (no proxy)."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(request, timeout=30) as rsp:
            return rsp.status, rsp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def serving(k8s: Env, ready: int, name: str = "repo") -> dict[str, Any]:
    """The Repository once it reports ``ready`` server pods ready (ServeReady True)."""

    def check() -> dict[str, Any] | None:
        obj = k8s.get("Repository", name)
        serve = ((obj or {}).get("status") or {}).get("serve") or {}
        ok = condition(obj, "ServeReady").get("status") == "True"
        return obj if ok and serve.get("readyReplicas") == ready else None

    try:
        found: dict[str, Any] = wait_for(f"{ready} server pod(s) ready", check)
    except AssertionError:
        obj = k8s.get("Repository", name) or {}
        raise AssertionError(
            f"{json.dumps(obj.get('status'), indent=1)}\n{k8s.log_tail()}"
        ) from None
    return found


def commit(repo: Any, value: float) -> str:
    session = repo.writable_session("main")
    arr = zarr.open_array(
        session.store, path="a", mode="a", shape=(8, 8), chunks=(4, 4), dtype="float32"
    )
    arr[:] = value
    return str(session.commit("for the server", author="tests"))


def test_spec_serve_runs_the_server_reports_its_url_and_off_removes_it(k8s: Env) -> None:
    k8s.secret()
    k8s.secret("serve-token", {"token": TOKEN})
    serve = {
        "enabled": True,
        "replicas": 2,
        "tokenSecretRef": {"name": "serve-token", "key": "token"},
    }
    k8s.ready_repository(serve=serve)
    commit(k8s.open_repository(), 7.0)

    obj = serving(k8s, 2)
    ns = k8s.namespace
    assert obj["status"]["serve"]["url"] == f"http://zl-repo-serve.{ns}.svc:8700"
    assert obj["status"]["phase"] == "Ready"
    assert condition(obj, "Ready")["status"] == "True"
    assert condition(obj, "Reconciling")["status"] == "False"
    assert condition(obj, "ServeReady")["reason"] == "Available"
    assert kstatus(obj) == ("Current", "")
    assert argo_health(obj)["status"] == "Healthy"
    # The server's objects are the Repository's: they go with it.
    uid = obj["metadata"]["uid"]
    deployment, service = (
        k8s.get("Deployment", "zl-repo-serve"),
        k8s.get("Service", "zl-repo-serve"),
    )
    assert deployment is not None and service is not None
    for child in (deployment, service):
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        "serve",
        obj["status"]["url"],
        "--host",
        "0.0.0.0",
        "--port",
        "8700",
        "--token-file",
        "/var/run/zarrlake-serve/token",
    ]
    assert service["spec"]["ports"][0]["port"] == 8700
    assert TOKEN not in json.dumps(deployment)  # by file from its Secret, never by value

    # What it serves, as a reader in the cluster reaches it (the Service's address): the probes
    # without a token, everything else only with it, and the repository's data as plain Zarr.
    base = k8s.cluster.resolve(obj["status"]["serve"]["url"])
    assert http(f"{base}/healthz")[0] == 200
    assert http(f"{base}/readyz")[0] == 200
    assert http(f"{base}/zarr/main/a/zarr.json")[0] == 401
    status, meta = http(f"{base}/zarr/main/a/zarr.json", TOKEN)
    assert status == 200 and json.loads(meta)["shape"] == [8, 8]
    store = zarr.storage.FsspecStore.from_url(
        f"{base}/zarr/main",
        read_only=True,
        storage_options={"headers": {"Authorization": f"Bearer {TOKEN}"}},
    )
    assert np.array_equal(zarr.open_array(store, path="a", mode="r")[:], np.full((8, 8), 7.0))

    # Fewer replicas: the Deployment follows, and so does the status.
    k8s.patch("Repository", "repo", {"spec": {"serve": {"replicas": 1}}})
    serving(k8s, 1)
    assert k8s.get("Deployment", "zl-repo-serve")["spec"]["replicas"] == 1

    # A hand edit of the Deployment is drift: corrected.
    k8s.patch(
        "Deployment",
        "zl-repo-serve",
        {"spec": {"template": {"spec": {"containers": [{**container, "image": "hand:edited"}]}}}},
    )
    wait_for(
        "the server's image restored",
        lambda: (
            k8s.get("Deployment", "zl-repo-serve")["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
            == container["image"]
        ),
    )

    # Off: the Deployment and the Service go, and so do status.serve and ServeReady.
    k8s.patch("Repository", "repo", {"spec": {"serve": {"enabled": False}}})
    obj = wait_for(
        "the server removed",
        lambda: (
            k8s.get("Deployment", "zl-repo-serve") is None
            and k8s.get("Service", "zl-repo-serve") is None
            and (o := k8s.get("Repository", "repo"))
            and "serve" not in o["status"]
            and not condition(o, "ServeReady")
            and o
        ),
    )
    assert condition(obj, "Ready")["status"] == "True" and obj["status"]["phase"] == "Ready"
    wait_for("the ServeDeleted events", lambda: "ServeDeleted" in k8s.event_reasons())

    # On again, then spec.serve removed altogether: gone again.
    k8s.patch("Repository", "repo", {"spec": {"serve": {"enabled": True}}})
    serving(k8s, 1)
    k8s.patch("Repository", "repo", {"spec": {"serve": None}})
    wait_for(
        "the server removed with spec.serve",
        lambda: (
            k8s.get("Deployment", "zl-repo-serve") is None
            and "serve" not in (k8s.get("Repository", "repo") or {}).get("status", {"serve": 1})
        ),
    )


def test_a_served_repository_at_rest_costs_no_write(k8s: Env) -> None:
    """Once the server is up and the change handler is done (its retry while the server
    started), the Repository's resyncs (every second here) read the server's Deployment and
    write nothing: no status patch, no apply."""
    k8s.ready_repository(serve={"enabled": True})
    serving(k8s, 1)

    def versions() -> dict[str, str]:
        objects = (
            ("Repository", "repo"),
            ("Deployment", "zl-repo-serve"),
            ("Service", "zl-repo-serve"),
        )
        return {kind: k8s.get(kind, name)["metadata"]["resourceVersion"] for kind, name in objects}

    wait_for(
        "the change handler done",
        lambda: (
            "zarrlake.io/repository_changed"
            not in (k8s.get("Repository", "repo")["metadata"].get("annotations") or {})
        ),
    )
    before = versions()
    time.sleep(5)
    assert versions() == before


def test_a_missing_token_secret_degrades_the_repository_until_it_is_there(k8s: Env) -> None:
    """The server's pods cannot start without the token's Secret (Kubernetes says so only in
    pod events): the Repository stays Ready, in phase Degraded, with a ServeReady that names
    the Secret; Argo CD shows it Degraded. The Secret made, the server starts."""
    token = {"name": "late-token", "key": "token"}
    k8s.ready_repository(serve={"enabled": True, "tokenSecretRef": token})
    obj = wait_for(
        "ServeReady SecretNotFound",
        lambda: (
            (o := k8s.get("Repository", "repo"))
            and condition(o, "ServeReady").get("reason") == "SecretNotFound"
            and o["status"].get("phase") == "Degraded"
            and o
        ),
    )
    assert condition(obj, "Ready")["status"] == "True"
    assert condition(obj, "Ready")["reason"] == "ServeUnavailable"
    assert "'late-token'" in condition(obj, "ServeReady")["message"]
    health = argo_health(obj)
    assert health["status"] == "Degraded" and "'late-token'" in health["message"]
    assert k8s.get("Deployment", "zl-repo-serve") is not None  # made: it starts once it can
    assert obj["status"]["serve"]["readyReplicas"] == 0
    k8s.secret("late-token", {"token": TOKEN})
    obj = serving(k8s, 1)
    assert obj["status"]["phase"] == "Ready"
    assert argo_health(obj)["status"] == "Healthy"


def test_a_serve_spec_the_operator_cannot_act_on_is_reported(k8s: Env) -> None:
    """A token key the schema lets through but no Secret can hold: InvalidSpec naming the
    field, a Warning event, and no server made. Fixed, the server comes."""
    k8s.secret()
    k8s.repository(serve={"enabled": True, "tokenSecretRef": {"name": "tok", "key": "a token"}})
    obj = wait_for(
        "InvalidSpec",
        lambda: (
            (o := k8s.get("Repository", "repo"))
            and condition(o, "Ready").get("reason") == "InvalidSpec"
            and o
        ),
    )
    message = condition(obj, "Ready")["message"]
    assert message.startswith("spec.serve.tokenSecretRef.key: not a possible key of a Secret")
    assert obj["status"]["phase"] == "Failed"
    assert argo_health(obj)["status"] == "Degraded"
    wait_for("the InvalidSpec Warning event", lambda: "InvalidSpec" in k8s.event_reasons())
    assert k8s.get("Deployment", "zl-repo-serve") is None
    k8s.secret("tok", {"token": TOKEN})
    k8s.patch("Repository", "repo", {"spec": {"serve": {"tokenSecretRef": {"key": "token"}}}})
    serving(k8s, 1)


def test_what_the_schema_refuses_of_spec_serve_never_reaches_the_operator(k8s: Env) -> None:
    bucket = {"bucket": f"zl-{k8s.namespace}-bad", "endpointURL": k8s.s3_endpoint}
    with pytest.raises(kube.KubeError) as refused:
        k8s.custom(
            "Repository",
            "bad",
            {"storage": bucket, "serve": {"enabled": True, "port": 80, "tokenSecretRef": {}}},
        )
    assert refused.value.status == 422
    message = str(refused.value)
    assert "spec.serve.port: Invalid value: 80" in message
    assert "spec.serve.tokenSecretRef.name: Required value" in message
    assert "spec.serve.tokenSecretRef.key: Required value" in message
    assert k8s.get("Repository", "bad") is None
