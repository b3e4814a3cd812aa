"""Repository resources on every storage provider, end to end with the real operator process.

Azure Blob Storage is Azurite (npm), Google Cloud Storage is fake-gcs-server (PyPI) with a
service-account key whose tokens come from a real OAuth token endpoint of the test kit (it
verifies the key's signature), and read-only HTTP is a static web server that demands the
Authorization header the Secret holds. Credentials reach the operator, ``from_kubernetes``
clients and the maintenance Jobs only through Secrets: the Jobs run as processes with just the
environment (and, for GCS, the mounted key file) their pod spec gives them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
import zarr
from k8s_env import ROOT, Env, condition, wait_for

import zarrlake
from zarrlake.errors import ReadOnlyError, ReadOnlyStorage
from zarrlake_operator import desired
from zarrlake_testkit import emulated
from zarrlake_testkit.emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    TokenServer,
    azurite_create_container,
    fake_gcs_create_bucket,
)
from zarrlake_testkit.static_http import StaticHTTPServer

API = "zarrlake.io/v1alpha1"


@pytest.fixture(scope="session")
def token_server() -> Iterator[TokenServer]:
    server = TokenServer()
    try:
        yield server
    finally:
        server.close()


def _repository(k8s: Env, name: str, storage: dict[str, Any], **spec: Any) -> None:
    k8s.create(
        {
            "apiVersion": API,
            "kind": "Repository",
            "metadata": {"name": name},
            "spec": {"storage": storage, "lockService": {"mode": "none"}, **spec},
        }
    )


def _commit(repo: zarrlake.Repository, value: float, message: str) -> None:
    with repo.transaction("main", message=message) as store:
        try:
            array = zarr.open_array(store, path="a")
        except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError):
            array = zarr.create_array(store, name="a", shape=(8,), chunks=(4,), dtype="f8")
        array[:] = value


def _azure_repository(azurite: Any, container: str, prefix: str) -> zarrlake.Repository:
    """The repository at ``prefix`` of an Azurite container, opened directly (not through
    Kubernetes) with the account key."""
    storage = zarrlake.Storage.azure(
        container,
        prefix,
        account_name=AZURITE_ACCOUNT,
        account_key=AZURITE_KEY,
        endpoint_url=azurite.endpoint,
        allow_http=True,
    )
    return zarrlake.Repository.open(storage)


def _run_gc(k8s: Env, policy: str) -> dict[str, Any]:
    """Run the policy's GC CronJob once (as ``kubectl create job --from=cronjob/...``) and
    return the policy's ``lastGC``."""
    obj = k8s.wait_condition("RetentionPolicy", policy)
    template = k8s.get("CronJob", obj["status"]["gcCronJob"])["spec"]["jobTemplate"]
    k8s.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{policy}-now", "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )
    obj = wait_for(
        "lastGC",
        lambda: (o := k8s.get("RetentionPolicy", policy))["status"].get("lastGC") and o,
        240,
    )
    last: dict[str, Any] = obj["status"]["lastGC"]
    return last


def _gc_policy(k8s: Env, name: str = "keep") -> None:
    k8s.custom(
        "RetentionPolicy",
        name,
        {
            "repository": "repo",
            "rules": {"default": {"last": 1}},
            "gc": {"schedule": "0 3 * * *", "grace": "0s", "force": True},
        },
    )


# -- Azure --


def test_azure_repository_end_to_end(k8s: Env, azurite: Any) -> None:
    container = f"zl-{k8s.namespace}"
    azurite_create_container(azurite.endpoint, container)
    k8s.secret("az-creds", {"AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY})
    storage = {
        "provider": "azure",
        "bucket": container,
        "prefix": "repos/repo",
        "accountName": AZURITE_ACCOUNT,
        "endpointURL": azurite.endpoint,
        "credentialsSecret": {"name": "az-creds"},
    }
    _repository(k8s, "repo", storage, reclaimPolicy="Delete")
    obj = k8s.wait_condition("Repository", "repo")
    url = obj["status"]["url"]
    assert url.startswith(f"az://{container}/repos/repo?account_name={AZURITE_ACCOUNT}")
    assert f"container {container!r} exists" in condition(obj, "BucketReady")["message"]

    # The same repository, through the public discovery API and directly.
    repo = k8s.open_repository()
    for v in (1.0, 2.0, 3.0):
        _commit(repo, v, f"fill {v}")
    direct = _azure_repository(azurite, container, "repos/repo")
    assert direct.id == obj["status"]["repositoryID"]

    k8s.custom("Branch", "dev", {"repository": "repo"})
    branch = k8s.wait_condition("Branch", "dev")
    assert branch["status"]["head"] == direct.lookup_branch("dev") == direct.lookup_branch("main")

    # A maintenance Job finds the account key in its environment, by Secret reference.
    _gc_policy(k8s)
    cron = k8s.get("CronJob", k8s.wait_condition("RetentionPolicy", "keep")["status"]["gcCronJob"])
    env = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = {"name": "az-creds", "key": "AZURE_STORAGE_ACCOUNT_KEY", "optional": True}
    assert {"name": "AZURE_STORAGE_ACCOUNT_KEY", "valueFrom": {"secretKeyRef": ref}} in env
    last = _run_gc(k8s, "keep")
    assert last["result"] == "Succeeded", (last, k8s.cluster.job_log[-1])
    assert last["snapshotsExpired"] == 3 and last["objectsDeleted"] > 0
    assert np.all(zarr.open_array(direct.readonly_session("main").store, path="a")[:] == 3.0)
    assert direct.fsck().ok

    # reclaimPolicy Delete removes the repository's objects from the container.
    for kind, name in (("RetentionPolicy", "keep"), ("Branch", "dev"), ("Repository", "repo")):
        k8s.delete(kind, name)
    wait_for("Repository deleted", lambda: k8s.get("Repository", "repo") is None)
    storage_left = zarrlake.Storage.azure(
        container,
        "repos/repo",
        account_name=AZURITE_ACCOUNT,
        account_key=AZURITE_KEY,
        endpoint_url=azurite.endpoint,
        allow_http=True,
    )
    assert storage_left.list_keys("") == []


def test_azure_credentials_and_container_problems_are_reported(k8s: Env, azurite: Any) -> None:
    base = {
        "provider": "azure",
        "accountName": AZURITE_ACCOUNT,
        "endpointURL": azurite.endpoint,
    }
    # No such container: the operator never creates one (provision is refused for azure).
    k8s.secret("az-creds", {"AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY})
    missing = {
        **base,
        "bucket": f"zl-none-{k8s.namespace}",
        "credentialsSecret": {"name": "az-creds"},
    }
    _repository(k8s, "missing", missing)
    obj = k8s.wait_condition("Repository", "missing", "BucketReady", "False")
    assert condition(obj, "Ready")["status"] == "False"
    bucket = condition(obj, "BucketReady")
    assert bucket["reason"] == "BucketNotFound", bucket
    assert f"container 'zl-none-{k8s.namespace}' does not exist" in bucket["message"]

    # A Secret with neither an account key nor a SAS token.
    container = f"zl-{k8s.namespace}"
    azurite_create_container(azurite.endpoint, container)
    k8s.secret("empty", {"unrelated": "x"})
    _repository(k8s, "nokey", {**base, "bucket": container, "credentialsSecret": {"name": "empty"}})
    obj = k8s.wait_condition("Repository", "nokey", "BucketReady", "False")
    bucket = condition(obj, "BucketReady")
    assert bucket["reason"] == "CredentialsNotFound"
    assert "neither 'AZURE_STORAGE_ACCOUNT_KEY'" in bucket["message"]

    # A wrong key is the Secret's, not the ambient one: refused by the service.
    wrong = AZURITE_KEY[:-8] + "AAAAAAA="
    k8s.secret("wrong", {"key": wrong})
    creds = {"name": "wrong", "accountKeyKey": "key"}
    _repository(
        k8s, "wrong", {**base, "bucket": container, "prefix": "w", "credentialsSecret": creds}
    )
    obj = k8s.wait_condition("Repository", "wrong", "BucketReady", "False")
    assert condition(obj, "BucketReady")["reason"] == "StorageUnreachable"
    assert "403" in condition(obj, "BucketReady")["message"]


# -- GCS --


def test_gcs_repository_end_to_end(k8s: Env, fake_gcs: Any, token_server: TokenServer) -> None:
    bucket = f"zl-{k8s.namespace}"
    fake_gcs_create_bucket(fake_gcs.endpoint, bucket)
    key = token_server.service_account_info(f"zl-{k8s.namespace}@zl-test.iam.gserviceaccount.com")
    k8s.secret("gcs-key", {"service-account.json": json.dumps(key)})
    storage = {
        "provider": "gcs",
        "bucket": bucket,
        "prefix": "repos/repo",
        "endpointURL": fake_gcs.endpoint,
        "credentialsSecret": {"name": "gcs-key"},
    }
    _repository(k8s, "repo", storage)
    obj = k8s.wait_condition("Repository", "repo")
    assert obj["status"]["url"].startswith(f"gs://{bucket}/repos/repo?endpoint_url=")
    # The operator exchanged the Secret's key for a token.
    issued_to_operator = token_server.issued.count(key["client_email"])
    assert issued_to_operator >= 1

    repo = k8s.open_repository()
    for v in (1.0, 2.0, 3.0):
        _commit(repo, v, f"fill {v}")

    _gc_policy(k8s)
    cron = k8s.get("CronJob", k8s.wait_condition("RetentionPolicy", "keep")["status"]["gcCronJob"])
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert {"name": "gcs-credentials", "secret": {"secretName": "gcs-key"}} in pod["volumes"]
    before = token_server.issued.count(key["client_email"])
    last = _run_gc(k8s, "keep")
    assert last["result"] == "Succeeded", (last, k8s.cluster.job_log[-1])
    assert last["snapshotsExpired"] == 3 and last["objectsDeleted"] > 0
    # The Job's own process read the mounted key file and got a token of its own.
    assert token_server.issued.count(key["client_email"]) > before
    assert np.all(zarr.open_array(repo.readonly_session("main").store, path="a")[:] == 3.0)


def test_gcs_key_that_is_not_json_is_reported(k8s: Env, fake_gcs: Any) -> None:
    bucket = f"zl-{k8s.namespace}"
    fake_gcs_create_bucket(fake_gcs.endpoint, bucket)
    k8s.secret("gcs-key", {"service-account.json": "not json"})
    storage = {
        "provider": "gcs",
        "bucket": bucket,
        "endpointURL": fake_gcs.endpoint,
        "credentialsSecret": {"name": "gcs-key"},
    }
    _repository(k8s, "repo", storage)
    obj = k8s.wait_condition("Repository", "repo", "BucketReady", "False")
    assert condition(obj, "BucketReady")["reason"] == "CredentialsNotFound"
    assert "is not a service-account key file (JSON)" in condition(obj, "BucketReady")["message"]


# -- HTTP (read-only) --


def test_http_repository_is_published_read_only(k8s: Env, tmp_path: Path) -> None:
    site = tmp_path / "site"
    local = zarrlake.Repository.create(zarrlake.Storage.local(site))
    _commit(local, 7.0, "publish")
    local.create_tag("v1", "main")
    token = "Bearer zl-" + k8s.namespace
    with StaticHTTPServer(site, authorization=token) as server:
        k8s.secret("http-auth", {"Authorization": token})
        storage = {
            "provider": "http",
            "url": server.url,
            "credentialsSecret": {"name": "http-auth"},
        }
        # A managed lock service asked for (the default), which read-only storage never gets.
        _repository(k8s, "repo", storage, lockService={"mode": "managed"})
        obj = k8s.wait_condition("Repository", "repo")
        status = obj["status"]
        assert status["url"] == server.url
        assert status["repositoryID"] == local.id
        assert condition(obj, "BucketReady")["reason"] == "ReadOnly"
        assert "read-only" in condition(obj, "LockServiceReady")["message"]

        repo = k8s.open_repository()
        assert np.all(zarr.open_array(repo.readonly_session("main").store, path="a")[:] == 7.0)
        assert repo.lookup_tag("v1") == local.lookup_tag("v1")
        with pytest.raises(ReadOnlyStorage):
            _commit(repo, 8.0, "not here")

        # Nothing that writes can act on it, and says so for good.
        k8s.custom("Branch", "dev", {"repository": "repo"})
        branch = k8s.wait_condition("Branch", "dev", status="False")
        assert condition(branch, "Ready")["reason"] == "ReadOnlyRepository"
        k8s.custom("RetentionPolicy", "p", {"repository": "repo", "gc": {"schedule": "@daily"}})
        policy = k8s.wait_condition("RetentionPolicy", "p", status="False")
        assert condition(policy, "Ready")["reason"] == "ReadOnlyRepository"
        assert k8s.get("Deployment", desired.lock_service_names("repo")) is None
        assert k8s.get("Service", desired.lock_service_names("repo")) is None

        # The Authorization header came from the Secret: without it the server refuses.
        k8s.secret("no-auth", {"Authorization": "Bearer wrong"})
        bad = {
            "provider": "http",
            "url": server.url + "/elsewhere",
            "credentialsSecret": {"name": "no-auth"},
        }
        _repository(k8s, "denied", bad)
        obj = k8s.wait_condition("Repository", "denied", "Initialized", "False")
        assert "401" in condition(obj, "Initialized")["message"]

        # An address with no repository behind it.
        empty = {
            "provider": "http",
            "url": server.url + "/nothing",
            "credentialsSecret": {"name": "http-auth"},
        }
        _repository(k8s, "empty", empty)
        obj = k8s.wait_condition("Repository", "empty", "Initialized", "False")
        assert condition(obj, "Initialized")["reason"] == "RepositoryMissing"
        assert "cannot create one there" in condition(obj, "Initialized")["message"]
    assert sorted(local.list_branches()) == ["main"]


# -- the objects the operator builds, per provider (pure functions) --

PROVIDER_STORAGE: dict[str, dict[str, Any]] = {
    "azure": {
        "provider": "azure",
        "bucket": "climate",
        "accountName": "zlaccount",
        "credentialsSecret": {"name": "az", "sasTokenKey": "sas"},
    },
    "gcs": {
        "provider": "gcs",
        "bucket": "climate",
        "credentialsSecret": {"name": "gcs", "serviceAccountJSONKey": "key.json"},
    },
}


# -- Mirrors to every provider --


def _mirror_to(k8s: Env, destination: dict[str, Any]) -> tuple[zarrlake.Repository, dict[str, Any]]:
    """An S3 Repository with two commits, and a Mirror of it to ``destination``; returns the
    source and the replicator Deployment."""
    k8s.ready_repository("repo", lock="none")
    source = k8s.open_repository("repo")
    _commit(source, 1.0, "one")
    _commit(source, 2.0, "two")
    k8s.custom("Mirror", "dr", {"repository": "repo", "destination": destination})
    dep = wait_for("the replicator", lambda: k8s.get("Deployment", "zl-dr-mirror"), 60)
    return source, dep


def _replicate(k8s: Env, dep: dict[str, Any], source: zarrlake.Repository) -> dict[str, Any]:
    """Passes of the replicator's own command until the mirror has the source's main head."""
    head = source.lookup_branch("main")
    for _ in range(5):
        status = emulated.run_replicator_pass(dep)
        mirrored = {r["name"]: r["mirrored_head"] for r in status["refs"] if r["kind"] == "branch"}
        if mirrored.get("main") == head:
            break
    assert mirrored.get("main") == head, status
    done = k8s.wait_condition("Mirror", "dr")
    assert condition(done, "Ready")["reason"] == "Mirroring", done["status"]
    return done


def test_mirror_of_an_s3_repository_to_azure(k8s: Env, azurite: Any) -> None:
    container = f"dr-{k8s.namespace}"
    azurite_create_container(azurite.endpoint, container)
    k8s.secret("dr-az", {"AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY})
    source, dep = _mirror_to(
        k8s,
        {
            "provider": "azure",
            "bucket": container,
            "prefix": "mirrors/repo",
            "accountName": AZURITE_ACCOUNT,
            "endpointURL": azurite.endpoint,
            "credentialsSecret": {"name": "dr-az"},
        },
    )
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    ref = env["ZARRLAKE_DEST_AZURE_STORAGE_ACCOUNT_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "dr-az", "key": "AZURE_STORAGE_ACCOUNT_KEY", "optional": True}
    assert "AZURE_STORAGE_ACCOUNT_KEY" not in env  # the unprefixed names are the source's
    assert c["command"][4].startswith(f"az://{container}/mirrors/repo?account_name=")
    assert AZURITE_KEY not in json.dumps(dep)

    done = _replicate(k8s, dep, source)
    assert done["status"]["destination"] == c["command"][4]
    mirror = _azure_repository(azurite, container, "mirrors/repo")
    assert mirror.lookup_branch("main") == source.lookup_branch("main")
    assert np.all(zarr.open_array(mirror.readonly_session("main").store, path="a")[:] == 2.0)
    with pytest.raises(ReadOnlyError, match="read-only mirror"):
        mirror.writable_session("main")


def test_mirror_of_an_s3_repository_to_gcs_with_a_mounted_key(
    k8s: Env, fake_gcs: Any, token_server: TokenServer
) -> None:
    bucket = f"dr-{k8s.namespace}"
    fake_gcs_create_bucket(fake_gcs.endpoint, bucket)
    key = token_server.service_account_info(f"dr-{k8s.namespace}@zl-test.iam.gserviceaccount.com")
    k8s.secret("dr-gcs", {"key.json": json.dumps(key)})
    source, dep = _mirror_to(
        k8s,
        {
            "provider": "gcs",
            "bucket": bucket,
            "endpointURL": fake_gcs.endpoint,
            "credentialsSecret": {"name": "dr-gcs", "serviceAccountJSONKey": "key.json"},
        },
    )
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"name": "gcs-destination-credentials", "secret": {"secretName": "dr-gcs"}} in (
        pod["volumes"]
    )
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ZARRLAKE_DEST_GOOGLE_APPLICATION_CREDENTIALS"] == (
        "/var/run/secrets/zarrlake/gcs-destination/key.json"
    )
    before = token_server.issued.count(key["client_email"])
    _replicate(k8s, dep, source)
    # The replicator's own process read the mounted key file and got a token with it.
    assert token_server.issued.count(key["client_email"]) > before
    mirror = zarrlake.Repository.open(
        zarrlake.Storage.gcs(
            bucket,
            endpoint_url=fake_gcs.endpoint,
            service_account_info=key,
            allow_http=True,
        )
    )
    assert mirror.lookup_branch("main") == source.lookup_branch("main")
    assert np.all(zarr.open_array(mirror.readonly_session("main").store, path="a")[:] == 2.0)


@pytest.mark.parametrize(
    ("destination", "message"),
    [
        ({"provider": "gcs", "bucket": "abc", "region": "eu"}, "spec.destination.region is for"),
        ({"provider": "azure", "bucket": "abc"}, "spec.destination.accountName is required"),
        ({"bucket": "abc", "accountName": "acct"}, "spec.destination.accountName is required"),
        ({"provider": "azure", "bucket": "abc", "accountName": "ac1", "provision": True}, "s3 on"),
        ({"provider": "http", "bucket": "abc"}, "spec.destination.provider"),
    ],
)  # fmt: skip
def test_destination_rules_per_provider(destination: dict[str, Any], message: str) -> None:
    import pydantic

    from zarrlake.resources import MirrorSpec, problems

    spec = {"repository": "repo", "destination": destination}
    with pytest.raises(pydantic.ValidationError) as e:
        MirrorSpec.model_validate(spec)
    assert message in problems(e.value, prefix="spec.")
    refused = _crd_errors({"spec": spec}, "mirrors")
    assert refused and any(message in error for error in refused), refused


def _provider_repository(provider: str) -> dict[str, Any]:
    from test_desired import repository_body

    url = {"azure": "az://climate/?account_name=zlaccount", "gcs": "gs://climate/"}[provider]
    return repository_body(
        spec={"storage": PROVIDER_STORAGE[provider], "lockService": {"mode": "none"}},
        status={"url": url, "conditions": [{"type": "Ready", "status": "True"}]},
    )


def _policy(spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from test_desired import POLICY_SPEC, policy_body

    from zarrlake.resources import RetentionPolicySpec

    body = policy_body({**POLICY_SPEC, **spec})
    return body, RetentionPolicySpec.model_validate(body["spec"])


def test_jobs_get_azure_credentials_by_reference() -> None:
    from zarrlake_operator import desired

    body, spec = _policy({})
    repo = _provider_repository("azure")
    for job in desired.retention_cron_jobs(body, spec, repo).values():
        pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        env = {v["name"]: v for v in pod["containers"][0]["env"]}
        assert env["AZURE_STORAGE_ACCOUNT_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "az",
            "key": "AZURE_STORAGE_ACCOUNT_KEY",
            "optional": True,
        }
        assert env["AZURE_STORAGE_SAS_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "sas"
        assert not any(name.startswith("AWS_") for name in env)
        assert [v["name"] for v in pod["volumes"]] == ["tmp"]  # no key file for azure


def test_gcs_key_file_is_mounted_for_every_kind_of_job() -> None:
    from zarrlake_operator import desired

    key_path = f"{desired.GCS_KEY_DIR}/key.json"
    repo = _provider_repository("gcs")

    # Local jobs and spark-submit drivers: a Secret volume, the variable naming its file.
    body, spec = _policy({})
    spark_body, spark_spec = _policy({"engine": "spark"})
    jobs = [
        *desired.retention_cron_jobs(body, spec, repo).values(),
        *desired.spark_submit_cron_jobs(spark_body, spark_spec, repo).values(),
    ]
    for job in jobs:
        pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert {"name": "gcs-credentials", "secret": {"secretName": "gcs"}} in pod["volumes"]
        assert {
            "name": "gcs-credentials",
            "mountPath": desired.GCS_KEY_DIR,
            "readOnly": True,
        } in c["volumeMounts"]
        assert {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": key_path} in c["env"]
    # spark-submit's executors: the same Secret at the same path, the same variable.
    command = jobs[-1]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    confs = {
        command[i + 1].partition("=")[0]: command[i + 1].partition("=")[2]
        for i, arg in enumerate(command)
        if arg == "--conf"
    }
    assert confs["spark.kubernetes.executor.secrets.gcs"] == desired.GCS_KEY_DIR
    assert confs["spark.executorEnv.GOOGLE_APPLICATION_CREDENTIALS"] == key_path

    # The Spark operator's applications: driver and executors name the Secret.
    for app in desired.scheduled_spark_applications(spark_body, spark_spec, repo).values():
        template = app["spec"]["template"]
        for role in ("driver", "executor"):
            assert template[role]["secrets"] == [
                {"name": "gcs", "path": desired.GCS_KEY_DIR, "secretType": "Generic"}
            ]
            assert {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": key_path} in template[role][
                "env"
            ]


def test_replicator_of_a_gcs_repository_mounts_the_key() -> None:
    from test_desired import policy_body

    from zarrlake.resources import MirrorSpec
    from zarrlake_operator import desired

    mirror = policy_body({"repository": "climate", "destination": {"bucket": "zl-dr"}}, "m")
    mirror["kind"] = "Mirror"
    spec = MirrorSpec.model_validate(mirror["spec"])
    dep = desired.replicator_deployment(mirror, spec, _provider_repository("gcs"), "s3://zl-dr")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"name": "gcs-credentials", "secret": {"secretName": "gcs"}} in pod["volumes"]
    assert c["command"][3] == "gs://climate/"
    env = {v["name"]: v for v in c["env"]}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == f"{desired.GCS_KEY_DIR}/key.json"


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ({"provider": "gcs"}, "spec.storage.bucket is required"),
        ({"provider": "azure", "bucket": "c"*3}, "spec.storage.accountName is required"),
        ({"bucket": "abc", "accountName": "acct"}, "for provider azure, and only for it"),
        ({"provider": "http"}, "provider http takes spec.storage.url only"),
        ({"provider": "http", "url": "https://h/r", "bucket": "abc"}, "takes spec.storage.url"),
        ({"provider": "http", "url": "https://h/r", "prefix": "p"}, "takes spec.storage.url only"),
        ({"provider": "http", "url": "https://h/r", "endpointURL": "https://h"}, "not endpointURL"),
        ({"bucket": "abc", "url": "https://h/r"}, "spec.storage.url is for provider http only"),
        ({"provider": "gcs", "bucket": "abc", "region": "eu"}, "region is for provider s3 only"),
        ({"provider": "gcs", "bucket": "abc", "provision": True}, "provision is supported for"),
        ({"provider": "http", "url": "https://user:pw@h/r"}, "spec.storage.url"),
        ({"provider": "ftp", "bucket": "abc"}, "spec.storage.provider"),
    ],
)  # fmt: skip
def test_storage_rules_per_provider(storage: dict[str, Any], message: str) -> None:
    import pydantic

    from zarrlake.resources import Repository, problems

    with pytest.raises(pydantic.ValidationError) as e:
        Repository.model_validate({"spec": {"storage": storage}})
    assert message in problems(e.value, prefix="spec.")
    # The API server refuses the same object, by the CRD's schema and CEL rules.
    refused = _crd_errors({"spec": {"storage": storage}})
    assert refused and any(message in error for error in refused), refused


def _crd_errors(obj: dict[str, Any], plural: str = "repositories") -> list[str]:
    """Why the API server would refuse ``obj`` as a Repository (or another kind, by its CRD's
    plural), pruned and defaulted first."""
    from zarrlake_testkit.crdschema import apply_schema, validate

    crd = yaml.safe_load((ROOT / "crds" / f"zarrlake.io_{plural}.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    full = {"apiVersion": "zarrlake.io/v1alpha1", "kind": crd["spec"]["names"]["kind"], **obj}
    full["metadata"] = {"name": "climate", "namespace": "default"}
    return [str(e) for e in validate(apply_schema(full, schema, root=True), None, schema)]


def test_http_repository_cannot_be_reclaimed_by_deletion() -> None:
    import pydantic

    from zarrlake.resources import Repository, problems

    http = {"provider": "http", "url": "https://h/r"}
    with pytest.raises(pydantic.ValidationError) as e:
        Repository.model_validate({"spec": {"storage": http, "reclaimPolicy": "Delete"}})
    assert "spec.reclaimPolicy Delete needs writable storage" in problems(e.value)
    ok = Repository.model_validate({"spec": {"storage": http}})
    assert ok.spec.storage.read_only and ok.spec.storage.bucket is None
    assert any(
        "spec.reclaimPolicy Delete needs writable storage" in e
        for e in _crd_errors({"spec": {"storage": http, "reclaimPolicy": "Delete"}})
    )
    assert _crd_errors({"spec": {"storage": http}}) == []
    assert _crd_errors({"spec": {"storage": {"bucket": "abc"}}}) == []


def test_connection_urls_read_back_as_the_same_storage() -> None:
    """The status URL (what jobs and the replicator open) names the same location the
    operator's own connection opens."""
    from zarrlake.k8s import storage_connection
    from zarrlake.resources import StorageSpec

    secrets = {"az": {"AZURE_STORAGE_ACCOUNT_KEY": "a2V5"}, "gcs": {"key.json": "{}"}}
    for provider, storage in PROVIDER_STORAGE.items():
        spec = StorageSpec.model_validate(
            {**storage, "prefix": "repos/x", "endpointURL": "http://127.0.0.1:1"}
        )
        conn = storage_connection(spec, secrets.get, "test")
        again = zarrlake.Storage.from_url(conn.storage_url)
        assert again.url == conn.storage().url, provider
