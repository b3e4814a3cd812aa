"""``spec.serve`` on a Repository, the pure part: what :mod:`zarrlake_operator.desired` makes of
it (the server's Deployment and Service, how a rollout reads, the phase it gives the
Repository) and what the spec checks refuse. Dicts in, dicts out; the built-in objects are
checked against the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict)."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest

from zarrlake_operator import desired
from zarrlake_operator.models import API_VERSION, Condition, RepositorySpec, RetentionPolicySpec

URL = "s3://zarrlake-climate/repos/climate?region=eu-west-1"
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names
TOKEN_VALUE = "the-bearer-token-value"  # lives in a Secret only


def body(serve: dict[str, Any] | None = None, **storage: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "storage": {
            "bucket": "zarrlake-climate",
            "prefix": "repos/climate",
            "region": "eu-west-1",
            "credentialsSecret": {"name": "climate-s3"},
            **storage,
        },
        "lockService": {"mode": "managed"},
    }
    if serve is not None:
        spec["serve"] = serve
    return {
        "apiVersion": API_VERSION,
        "kind": "Repository",
        "metadata": {"name": "climate", "namespace": "science", "uid": "uid-climate"},
        "spec": spec,
    }


def made(
    serve: dict[str, Any], defaults: desired.ServeDefaults = desired.SERVE_DEFAULTS, **storage: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Deployment, Service) for a spec.serve."""
    b = body({"enabled": True, **serve}, **storage)
    spec = RepositorySpec.model_validate(b["spec"])
    return desired.serve_deployment(b, spec, URL, defaults), desired.serve_service(b, spec)


def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod(deployment)["containers"]
    return c


def stored(obj: Any) -> Any:
    """The object as the API server keeps it: no nulls (a null is "not set")."""
    if isinstance(obj, dict):
        return {k: stored(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [stored(v) for v in obj]
    return obj


def validate_builtin(obj: dict[str, Any]) -> None:
    for version in ("1.30.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(stored(obj), version, strict=True)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- the spec ------------------------------------------------------------------------------------


def test_serve_is_off_and_defaulted_when_the_spec_says_nothing() -> None:
    spec = RepositorySpec.model_validate(body()["spec"])
    serve = spec.serve
    assert (serve.enabled, serve.replicas, serve.port) == (False, 1, 8700)
    assert serve.token_secret_ref is None and serve.credentials_secret_ref is None
    assert desired.spec_problem(body()) is None
    assert desired.spec_problem(body({"enabled": True})) is None


@pytest.mark.parametrize(
    ("serve", "expected"),
    [
        ({"tokenSecretRef": {"name": "tok"}}, "spec.serve.tokenSecretRef.key: Field required"),
        ({"tokenSecretRef": {"name": "tok", "key": ""}}, "spec.serve.tokenSecretRef.key: String"),
        (
            {"tokenSecretRef": {"name": "tok", "key": "a token"}},
            "spec.serve.tokenSecretRef.key: not a possible key of a Secret",
        ),
        (
            {"credentialsSecretRef": {"name": "ro", "accessKeyIDKey": "key/id"}},
            "spec.serve.credentialsSecretRef.accessKeyIDKey: not a possible key of a Secret",
        ),
        ({"port": 80}, "spec.serve.port: Input should be greater than or equal to 1024"),
        ({"port": 70000}, "spec.serve.port: Input should be less than or equal to 65535"),
        ({"replicas": -1}, "spec.serve.replicas: Input should be greater than or equal to 0"),
        ({"serviceAccountName": "Not_An_Account"}, "spec.serve.serviceAccountName: String"),
    ],
)
def test_a_bad_serve_spec_is_an_invalid_spec_that_names_the_field(
    serve: dict[str, Any], expected: str
) -> None:
    problem = desired.spec_problem(body({"enabled": True, **serve}))
    assert problem is not None
    assert problem.reason == "InvalidSpec"
    assert problem.message.startswith(expected), problem.message


def test_serving_http_storage_that_needs_credentials_is_refused() -> None:
    """``zarrlake serve URL`` opens an http(s) repository without headers: one behind an
    Authorization header cannot be served, and saying so beats a server failing /readyz."""
    http = {"provider": "http", "url": "https://data.example.org/climate"}
    published = body({"enabled": True})
    published["spec"]["storage"] = dict(http)
    published["spec"]["lockService"] = {"mode": "none"}
    assert desired.spec_problem(published) is None
    for storage, serve in (
        ({**http, "credentialsSecret": {"name": "cdn"}}, {"enabled": True}),
        (http, {"enabled": True, "credentialsSecretRef": {"name": "cdn"}}),
    ):
        spec = copy.deepcopy(published)
        spec["spec"]["storage"], spec["spec"]["serve"] = storage, serve
        problem = desired.spec_problem(spec)
        assert problem is not None and problem.reason == "InvalidSpec"
        assert "spec.serve cannot send an Authorization header" in problem.message
        spec["spec"]["serve"]["enabled"] = False  # not served: nothing to refuse
        assert desired.spec_problem(spec) is None


# -- the Deployment ------------------------------------------------------------------------------


def test_the_deployment_runs_zarrlake_serve_locked_down_and_owned() -> None:
    deployment, service = made({})
    validate_builtin(deployment)
    meta = deployment["metadata"]
    assert (meta["name"], meta["namespace"]) == ("zl-climate-serve", "science")
    assert meta["ownerReferences"] == [
        {
            "apiVersion": API_VERSION,
            "kind": "Repository",
            "name": "climate",
            "uid": "uid-climate",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "zarrlake-operator"
    assert meta["labels"]["app.kubernetes.io/component"] == "serve"
    assert meta["labels"]["zarrlake.io/repository"] == "climate"
    assert deployment["spec"]["replicas"] == 1
    c = container(deployment)
    assert c["command"] == ["zarrlake"]
    assert c["args"] == ["serve", URL, "--host", "0.0.0.0", "--port", "8700"]
    assert c["image"] == desired.JOB_IMAGE
    assert c["ports"] == [{"name": "http", "containerPort": 8700, "protocol": "TCP"}]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    p = pod(deployment)
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["runAsUser"] == 10001
    assert p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert p["automountServiceAccountToken"] is False  # no API token: it talks to storage only
    # The read-only root has a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in p["volumes"]
    # One selector for the Deployment, its pods and the Service; none of the lock service's.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels) and selects(service["spec"]["selector"], pod_labels)
    b = body()
    lock_pod = desired.lock_deployment(b, RepositorySpec.model_validate(b["spec"]))
    assert not selects(selector, lock_pod["spec"]["template"]["metadata"]["labels"])


def test_the_probes_ask_the_server_itself() -> None:
    c = container(made({"port": 9000})[0])
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    ready, alive = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    # Readiness reads the refs (a pod that cannot reach the storage leaves the Service);
    # liveness does no I/O (a slow bucket restarts nothing).
    assert ready["path"] == "/readyz" and alive["path"] == "/healthz"
    assert port_names[ready["port"]] == port_names[alive["port"]] == 9000
    assert c["args"][-2:] == ["--port", "9000"]


def test_the_token_is_mounted_from_its_secret_and_named_by_its_path() -> None:
    deployment, _ = made({"tokenSecretRef": {"name": "climate-token", "key": "bearer"}})
    validate_builtin(deployment)
    c, p = container(deployment), pod(deployment)
    assert c["args"][-2:] == ["--token-file", "/var/run/zarrlake-serve/token"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/var/run/zarrlake-serve"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in p["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "climate-token"
    assert volume["secret"]["items"] == [{"key": "bearer", "path": "token"}]
    # Readable by the pod's group only (the server's user is in it: fsGroup), no one else.
    assert volume["secret"]["defaultMode"] == 0o440
    assert p["securityContext"]["fsGroup"] == p["securityContext"]["runAsGroup"] == 10001
    # The token itself is nowhere in the object, and reaches no variable.
    assert TOKEN_VALUE not in repr(deployment)
    assert not [e for e in c["env"] or [] if "TOKEN" in e["name"] and "AWS" not in e["name"]]
    # Without a token: no flag, no volume.
    c = container(made({})[0])
    assert "--token-file" not in c["args"]
    assert [m["name"] for m in c["volumeMounts"]] == ["tmp"]


def env_of(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(deployment)["env"] or []}


def test_storage_credentials_come_by_reference_read_only_ones_when_given() -> None:
    env = env_of(made({})[0])
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "climate-s3", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "climate-s3"
    assert env["AWS_DEFAULT_REGION"] == {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"}
    # No lock: the server never writes.
    assert not {"ZARRLAKE_LOCK", "ZARRLAKE_LOCK_PASSWORD"} & set(env)
    readonly = {"name": "climate-ro", "accessKeyIDKey": "id", "secretAccessKeyKey": "secret"}
    env = env_of(made({"credentialsSecretRef": readonly})[0])
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "climate-ro", "key": "id"}
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "climate-ro", "key": "secret"}
    }
    assert all(e.get("value") != "climate-s3" for e in env.values())
    assert "climate-s3" not in repr(made({"credentialsSecretRef": readonly})[0])


def test_gcs_and_azure_credentials_reach_the_server_as_for_the_jobs() -> None:
    gcs, _ = made(
        {"credentialsSecretRef": {"name": "climate-gcs-ro"}},
        provider="gcs",
        region=None,
    )
    validate_builtin(gcs)
    key = "/var/run/secrets/zarrlake/gcs/service-account.json"
    assert env_of(gcs)["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == key
    (volume,) = [v for v in pod(gcs)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "climate-gcs-ro"
    azure, _ = made({}, provider="azure", region=None, accountName="zarrlakeclimate")
    env = env_of(azure)
    assert env["AZURE_STORAGE_SAS_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "climate-s3"
    # A published http repository without credentials: no variable at all (null, not []:
    # the API server keeps no empty list, and a merge patch's null removes an old one).
    b = body({"enabled": True})
    b["spec"]["storage"] = {"provider": "http", "url": "https://data.example.org/climate"}
    spec = RepositorySpec.model_validate(b["spec"])
    deployment = desired.serve_deployment(b, spec, "https://data.example.org/climate")
    assert container(deployment)["env"] is None
    validate_builtin(deployment)


def test_resources_and_image_default_to_the_operators_and_the_spec_overrides_them() -> None:
    deployment, _ = made({})
    assert container(deployment)["resources"] == desired.DEFAULT_SERVE_RESOURCES
    chart = desired.ServeDefaults("registry.example/zarrlake:9", {"limits": {"memory": "3Gi"}})
    c = container(made({}, chart)[0])
    assert (c["image"], c["resources"]) == (
        "registry.example/zarrlake:9",
        {"limits": {"memory": "3Gi"}},
    )
    own = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    c = container(made({"resources": own, "image": "mine:1"}, chart)[0])
    assert (c["image"], c["resources"]) == ("mine:1", own)


def test_replicas_spread_over_nodes_and_zones_by_preference() -> None:
    deployment, _ = made({"replicas": 3})
    assert deployment["spec"]["replicas"] == 3
    p = pod(deployment)
    own = deployment["spec"]["selector"]["matchLabels"]
    (term,) = p["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": own}
    (spread,) = p["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a preference, never a refusal
    assert spread["labelSelector"] == {"matchLabels": own}


def test_identity_is_given_whole_so_that_dropping_a_service_account_takes_it_away() -> None:
    irsa, _ = made({"serviceAccountName": "climate-reader", "imagePullSecrets": ["registry"]})
    p = pod(irsa)
    assert p["serviceAccountName"] == "climate-reader"
    assert p["automountServiceAccountToken"] is None  # the account's token is mounted
    assert p["imagePullSecrets"] == [{"name": "registry"}]
    plain, _ = made({})
    assert pod(plain)["serviceAccountName"] is None and pod(plain)["imagePullSecrets"] is None
    # The operator corrects drift with merge patches: the server made from the first spec
    # counts as drifted from the second, and the patch's nulls remove the account.
    assert desired.drifted(plain, stored(irsa))
    assert not desired.drifted(plain, stored(plain))
    assert not desired.drifted(irsa, stored(irsa))


def test_what_the_api_server_stores_is_no_drift() -> None:
    """An unchanged spec never reads as drift against what the API server keeps of it (no
    nulls, quantities in canonical form): a resting server costs no write."""
    deployment, service = made(
        {
            "tokenSecretRef": {"name": "t", "key": "k"},
            "resources": {"requests": {"cpu": "0.5", "memory": 1073741824}},
        }
    )
    kept = stored(deployment)
    kept["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] = {
        "cpu": "500m",
        "memory": "1Gi",
    }
    kept["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"  # a server default
    assert not desired.drifted(deployment, kept)
    assert not desired.drifted(service, {**stored(service), "status": {"loadBalancer": {}}})


def test_the_servers_pods_are_not_let_into_the_lock_service() -> None:
    """The server never writes, so nothing of it reaches Redis: its pods carry no label the
    lock service's NetworkPolicy lets in (the maintenance jobs' pods do)."""
    b = body()
    spec = RepositorySpec.model_validate(b["spec"])
    rule = desired.lock_network_policy(b, spec)["spec"]["ingress"][0]
    selectors = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    server_pod = made({})[0]["spec"]["template"]["metadata"]["labels"]
    assert not any(selects(s, server_pod) for s in selectors)
    policy = {"apiVersion": API_VERSION, "kind": "RetentionPolicy"}
    policy["metadata"] = {"name": "keep", "namespace": "science", "uid": "u"}
    policy_spec = RetentionPolicySpec.model_validate({"repository": "climate"})
    ready = {**b, "status": {"url": URL}}
    job = desired.retention_cron_jobs(policy, policy_spec, ready)["gc"]
    job_pod = job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    assert any(selects(s, job_pod) for s in selectors)  # the check above can fail


# -- the Service and the URL -----------------------------------------------------------------------


def test_the_service_is_a_cluster_ip_on_the_servers_port_and_the_url_names_it() -> None:
    _, service = made({"port": 9000})
    validate_builtin(service)
    assert DNS_1035_LABEL.match(service["metadata"]["name"])
    assert service["metadata"]["name"] == "zl-climate-serve"
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-climate"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}
    ]
    url = desired.serve_url("climate", "science", 9000)
    assert url == "http://zl-climate-serve.science.svc:9000"
    # A dotted or long Repository name still gives a Service name (a DNS label).
    for name in ("climate.v2", "c" * 63):
        assert DNS_1035_LABEL.match(desired.serve_names(name)), name
        assert len(desired.serve_names(name)) <= 63


# -- how a rollout reads -------------------------------------------------------------------------


def deployment_status(
    *,
    replicas: int = 2,
    ready: int = 2,
    updated: int | None = None,
    observed: int = 3,
    progressing: tuple[str, str] = ("True", "NewReplicaSetAvailable"),
) -> dict[str, Any]:
    return {
        "metadata": {"name": "zl-climate-serve", "generation": 3},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": ready,
            "conditions": [
                {
                    "type": "Progressing",
                    "status": progressing[0],
                    "reason": progressing[1],
                    "message": 'ReplicaSet "zl-climate-serve-7c9" has timed out progressing.',
                }
            ],
        },
    }


@pytest.mark.parametrize(
    ("deployment", "replicas", "expected"),
    [
        (deployment_status(), 2, (True, "Available", 2, False)),
        # Made a moment ago: no status yet.
        (None, 2, (False, "Starting", 0, True)),
        ({"metadata": {"generation": 1}, "status": {}}, 2, (False, "Starting", 0, True)),
        # A new template: the controller has not seen it, or the old pods are still the ready ones.
        (deployment_status(observed=2), 2, (False, "Starting", 2, True)),
        (
            deployment_status(updated=1, progressing=("True", "ReplicaSetUpdated")),
            2,
            (False, "Starting", 2, True),
        ),
        (
            deployment_status(ready=1, progressing=("True", "ReplicaSetUpdated")),
            2,
            (False, "Starting", 1, True),
        ),
        # Rolled out, then pods failed their readiness probe.
        (deployment_status(ready=1), 2, (False, "Unavailable", 1, False)),
        # Past the progress deadline (an image that does not pull, a pod that crashes).
        (
            deployment_status(ready=0, progressing=("False", "ProgressDeadlineExceeded")),
            2,
            (False, "RolloutFailed", 0, False),
        ),
        # Scaled to zero: asked for, so no wait and no fault.
        (deployment_status(replicas=0, ready=0), 0, (False, "ScaledToZero", 0, False)),
    ],
)
def test_serve_rollout_reads_the_deployment_as_kubectl_rollout_status(
    deployment: dict[str, Any] | None, replicas: int, expected: tuple[Any, ...]
) -> None:
    state = desired.serve_rollout(deployment, replicas)
    assert (state.ready, state.reason, state.ready_replicas, state.starting) == expected
    assert state.message
    if state.reason == "RolloutFailed":
        assert "timed out progressing" in state.message  # the controller's own words


# -- the Repository's phase ----------------------------------------------------------------------


def cond(type_: str, status: str, reason: str, message: str = "m") -> Condition:
    return Condition.model_validate(
        {"type": type_, "status": status, "reason": reason, "message": message}
    )


READY = [
    cond("BucketReady", "True", "BucketReady"),
    cond("LockServiceReady", "True", "Available"),
    cond("Initialized", "True", "Initialized"),
]


@pytest.mark.parametrize(
    ("serve", "phase", "reason"),
    [
        (None, "Ready", "Ready"),  # not asked for: nothing changes
        (cond("ServeReady", "True", "Available"), "Ready", "Ready"),
        (cond("ServeReady", "False", "Starting"), "Ready", "Ready"),  # Reconciling says it
        (cond("ServeReady", "False", "ScaledToZero"), "Ready", "Ready"),
        (cond("ServeReady", "False", "WaitingForRepository"), "Ready", "Ready"),
        (
            cond("ServeReady", "False", "Unavailable", "1 of 2 ready"),
            "Degraded",
            "ServeUnavailable",
        ),
        (cond("ServeReady", "False", "RolloutFailed"), "Degraded", "ServeUnavailable"),
        (cond("ServeReady", "False", "SecretNotFound"), "Degraded", "ServeUnavailable"),
    ],
)
def test_a_server_that_is_down_degrades_a_ready_repository_and_never_unreadies_it(
    serve: Condition | None, phase: str, reason: str
) -> None:
    conditions = [*READY, serve] if serve is not None else READY
    found = desired.repository_phase(conditions)
    assert (found.phase, found.ready, found.reason) == (phase, True, reason)
    if reason == "ServeUnavailable":
        assert serve is not None and found.message.startswith(serve.message)
        assert found.message.endswith("the repository itself is ready")
    # A repository that is not ready yet says why it is not: its own condition, not the server.
    waiting = desired.repository_phase([*READY[:2], *([serve] if serve else [])])
    assert (waiting.ready, waiting.reason) == (False, "Pending")


def test_the_virtual_containers_secrets_are_mounted_whole_and_named_by_prefix() -> None:
    """Each virtual chunk container's credentials Secret reaches the server as files (kubelet
    rotates them), and ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS says whose is which: no value of a
    Secret in the Deployment."""
    import json

    b = body({"enabled": True})
    b["spec"]["virtualContainers"] = [
        {"urlPrefix": "s3://era5/nc/", "credentialsSecretRef": {"name": "era5-keys"}},
        {"urlPrefix": "gs://public-data/", "anonymous": True},
        {"urlPrefix": "https://cdn.example.org/grib/", "credentialsSecretRef": {"name": "cdn"}},
    ]
    spec = RepositorySpec.model_validate(b["spec"])
    deployment = desired.serve_deployment(b, spec, URL)
    c, p = container(deployment), pod(deployment)
    env = {e["name"]: e for e in c["env"]}
    dirs = json.loads(env["ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS"]["value"])
    assert dirs == {
        "s3://era5/nc/": f"{desired.VIRTUAL_CREDENTIALS_DIR}/0",
        "https://cdn.example.org/grib/": f"{desired.VIRTUAL_CREDENTIALS_DIR}/2",
    }
    volumes = {v["name"]: v for v in p["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path, secret in zip(dirs.values(), ("era5-keys", "cdn"), strict=True):
        mount = mounts[path]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {"secretName": secret, "defaultMode": 0o440}
    validate_builtin(deployment)
    # Without containers that name Secrets: nothing of it.
    plain = desired.serve_deployment(body({"enabled": True}), RepositorySpec.model_validate(
        body({"enabled": True})["spec"]), URL)  # fmt: skip
    assert "ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS" not in json.dumps(plain)


# -- spec.commitService.checks: checks run as Jobs -------------------------------------------------


def commit_body(checks: list[dict[str, Any]], **service: Any) -> dict[str, Any]:
    b = body()
    b["spec"]["commitService"] = {
        "enabled": True,
        "tokensSecretRef": {"name": "tokens", "key": "tokens.json"},
        "checks": checks,
        **service,
    }
    return b


def test_checks_as_jobs_are_valid_jobs_with_credentials_by_reference_only() -> None:
    from zarrlake.checkjobs import parse_jobs

    long = "a-check-whose-name-is-as-long-as-a-check-name-may-be-0123456789a"
    assert len(long) == 64
    checks = [
        {"name": "cf-units", "image": "registry.example/checks:1"},
        {"name": long, "image": "c:2", "command": ["python", "-m", "mine"], "timeoutSeconds": 9},
    ]
    b = commit_body(checks)
    spec = RepositorySpec.model_validate(b["spec"])
    templates = desired.check_job_templates(b, spec, URL)
    assert set(templates) == {"cf-units", long}
    for job in templates.values():
        made = copy.deepcopy(job)
        made["metadata"]["name"] = job["metadata"]["generateName"] + "0" * 8  # as the service
        assert len(made["metadata"]["name"]) <= 63
        assert DNS_1035_LABEL.match(made["metadata"]["name"]), made["metadata"]["name"]
        validate_builtin(made)
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-climate"
        # The repository's credentials reach the check by Secret reference, never by value.
        creds = [v for v in c["env"] if v["name"] in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
        assert len(creds) == 2 and all("value" not in v and "valueFrom" in v for v in creds)
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert {"name": "ZARRLAKE_REPORT_FILE", "value": "/dev/termination-log"} in c["env"]
        # No API token unless the check names a ServiceAccount.
        assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        assert job["spec"]["backoffLimit"] == 0
    default = templates["cf-units"]["spec"]["template"]["spec"]["containers"][0]
    assert default["command"] == ["zarrlake", "check", URL]
    assert templates[long]["spec"]["activeDeadlineSeconds"] == 9
    # Check names may hold what a Job's name may not (underscores, dots): a stable hash then.
    odd = commit_body([{"name": n, "image": "c:1"} for n in ("cf_units", "cf.units", "x_")])
    odd_spec = RepositorySpec.model_validate(odd["spec"])
    prefixes = [
        t["metadata"]["generateName"]
        for t in desired.check_job_templates(odd, odd_spec, URL).values()
    ]
    assert len(set(prefixes)) == 3
    for prefix in prefixes:
        assert DNS_1035_LABEL.match(prefix + "0" * 8), prefix
    # No blockOwnerDeletion: it needs rights on repositories/finalizers the service lacks.
    (owner,) = templates["cf-units"]["metadata"]["ownerReferences"]
    assert owner["blockOwnerDeletion"] is False
    assert templates["cf-units"]["spec"]["activeDeadlineSeconds"] == 600
    # What the service reads back is what the operator wrote.
    deployment = desired.commit_service_deployment(b, spec, URL)
    env = {v["name"]: v.get("value") for v in container(deployment)["env"]}
    assert set(parse_jobs(env["ZARRLAKE_CHECK_JOBS"])) == {"cf-units", long}
    assert pod(deployment)["serviceAccountName"] == "zl-climate-commit"


def test_the_commit_service_gets_api_rights_only_for_checks_as_jobs_and_events() -> None:
    from zarrlake.kevents import About

    b = commit_body([], events=False)
    spec = RepositorySpec.model_validate(b["spec"])
    assert desired.commit_service_rbac(b, spec) == []
    deployment = desired.commit_service_deployment(b, spec, URL)
    assert pod(deployment)["automountServiceAccountToken"] is False
    names = {v["name"] for v in container(deployment)["env"]}
    assert not names & {"ZARRLAKE_CHECK_JOBS", "ZARRLAKE_EVENTS_FOR"}

    # Events of refusals (on unless turned off): a Role to post them about the Repository.
    b = commit_body([])
    spec = RepositorySpec.model_validate(b["spec"])
    account, role, binding = desired.commit_service_rbac(b, spec)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}
    ]
    deployment = desired.commit_service_deployment(b, spec, URL)
    assert pod(deployment)["serviceAccountName"] == "zl-climate-commit"
    env = {v["name"]: v.get("value") for v in container(deployment)["env"]}
    about = About.parse(env["ZARRLAKE_EVENTS_FOR"])
    assert about.involved() == {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "name": "climate",
        "namespace": "science",
        "uid": "uid-climate",
    }
    assert "ZARRLAKE_CHECK_JOBS" not in env

    b = commit_body([{"name": "cf-units", "image": "c:1"}])
    spec = RepositorySpec.model_validate(b["spec"])
    account, role, binding = desired.commit_service_rbac(b, spec)
    assert [r["resources"] for r in role["rules"]] == [["jobs"], ["pods"], ["events"]]
    for obj in (account, role, binding):
        validate_builtin(obj)
    assert (account["kind"], account["metadata"]["name"]) == ("ServiceAccount", "zl-climate-commit")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "zl-climate-commit", "namespace": "science"}
    ]
    # Given a ServiceAccount, the operator binds the Role to it and makes none.
    b = commit_body([{"name": "cf-units", "image": "c:1"}], serviceAccountName="lake-service")
    spec = RepositorySpec.model_validate(b["spec"])
    role, binding = desired.commit_service_rbac(b, spec)
    assert binding["subjects"][0]["name"] == "lake-service"
    assert pod(desired.commit_service_deployment(b, spec, URL))["serviceAccountName"] == (
        "lake-service"
    )
