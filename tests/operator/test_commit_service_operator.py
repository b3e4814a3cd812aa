"""``spec.commitService`` end to end (issue 42): the real operator process against the emulated
Kubernetes API and moto's S3. The emulated kubelet runs the service pod's command,
``zarrlake service ...``, as a real process with the pod's environment and its tokens Secret
mounted; a writer opened with ``from_kubernetes`` sends its ref changes there, and the rules the
Repository declares are the service's."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import zarr
from botocore.exceptions import ClientError
from k8s_env import Env, condition, wait_for

import zarrlake
from zarrlake.format.model import snapshot_key
from zarrlake_operator import kube
from zarrlake_testkit.servers import start_seaweedfs

WRITER = "writer-token-for-operator-tests"


def test_spec_commit_service_runs_the_service_writers_use_it_and_off_removes_it(
    k8s: Env,
) -> None:
    tokens = {WRITER: {"identity": "job-7", "role": "writer"}}
    k8s.secret("service-tokens", {"tokens.json": json.dumps(tokens)})
    spec = {"enabled": True, "tokensSecretRef": {"name": "service-tokens", "key": "tokens.json"}}
    k8s.ready_repository(commitService=spec, protection=[{"branch": "main"}])

    def up() -> dict | None:
        obj = k8s.get("Repository", "repo") or {}
        found = (obj.get("status") or {}).get("commitService") or {}
        ok = condition(obj, "CommitServiceReady").get("status") == "True"
        return obj if ok and found.get("readyReplicas") == 1 else None

    try:
        obj = wait_for("the commit service ready", up)
    except AssertionError:
        got = k8s.get("Repository", "repo") or {}
        raise AssertionError(json.dumps(got.get("status"), indent=1) + k8s.log_tail()) from None
    url = obj["status"]["commitService"]["url"]
    assert url == f"http://zl-repo-commit.{k8s.namespace}.svc:8701"
    # What the operator does not do yet, said where the platform team looks.
    said = obj["status"]["commitService"]["writerCredentials"]
    assert said.startswith("not provisioned: the operator makes none on s3 (spec.commitService."
                           "provisionCredentials is off)")  # fmt: skip
    assert "; give writers an IAM" in said
    writer = zarrlake.Repository.from_kubernetes(
        "repo", k8s.namespace, commit_service=k8s.cluster.resolve(url), commit_token=WRITER
    )
    assert writer.commit_service is not None
    assert writer.commit_service.whoami()["identity"] == "job-7"
    writer.create_branch("dev")
    session = writer.writable_session("dev")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")[:] = 3
    session.commit("through the service")
    with pytest.raises(zarrlake.BranchProtected):  # main takes merges only
        direct = writer.writable_session("main")
        zarr.open_group(direct.store, mode="w").create_array("u", shape=(2,), dtype="f4")
        direct.commit("direct")
    # A client that skips its own rules is refused by the service, and the refusal is told
    # where the platform team looks: a Warning Event about the Repository, posted by the
    # service (its own ServiceAccount may post Events, nothing else).
    writer.core.commits.guard = None
    with pytest.raises(zarrlake.BranchProtected):
        direct = writer.writable_session("main")
        zarr.open_group(direct.store, mode="w").create_array("u", shape=(2,), dtype="f4")
        direct.commit("direct, skipping the rules")
    assert k8s.get("Role", "zl-repo-commit")["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}
    ]

    def refusal_event() -> dict | None:
        for e in k8s.events():
            if e.get("reason") == "BranchProtected" and e["involvedObject"]["name"] == "repo":
                return e
        return None

    event = wait_for("the refusal's Event", refusal_event)
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Repository"
    assert event["message"].startswith("job-7: commit to branch 'main' (snapshot ")
    assert "require_merge" in event["message"]
    assert event["reportingComponent"] == "zarrlake-commit-service"
    writer.merge("dev", "main")
    moves = k8s.open_repository().branch_moves("main", limit=1)
    assert moves[0]["by"]["identity"] == "job-7"

    k8s.patch("Repository", "repo", {"spec": {"commitService": {"enabled": False}}})
    wait_for(
        "the commit service gone",
        lambda: (
            (
                k8s.get("Deployment", "zl-repo-commit") is None
                and not ((k8s.get("Repository", "repo") or {}).get("status") or {}).get(
                    "commitService"
                )
            )
            or None
        ),
    )
    assert "CommitServiceDeleted" in k8s.event_reasons()


def test_a_commit_service_without_its_tokens_secret_is_reported(k8s: Env) -> None:
    spec = {"enabled": True, "tokensSecretRef": {"name": "no-such", "key": "tokens.json"}}
    k8s.ready_repository(commitService=spec)
    obj = k8s.wait_condition("Repository", "repo", "CommitServiceReady", "False")
    assert condition(obj, "CommitServiceReady")["reason"] in ("SecretNotFound", "Starting")
    wait_for(
        "SecretNotFound",
        lambda: (
            condition(k8s.get("Repository", "repo"), "CommitServiceReady").get("reason")
            == "SecretNotFound"
            or None
        ),
    )
    # Taken down here, not by the namespace's deletion after the test: a later test of the
    # shared operator would count that DELETE as its own.
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"enabled": False}}})
    wait_for("the commit service gone", lambda: k8s.get("Deployment", "zl-repo-commit") is None)


def test_checks_run_as_jobs_refuse_pass_and_time_out(k8s: Env) -> None:
    """``spec.commitService.checks``: the service creates a Job per check a rule requires, the
    emulated kubelet runs its container (``zarrlake check URL``, the default, or a command of
    its own), and the Job's verdict is the merge's."""
    from zarrlake_operator import kube

    tokens = {WRITER: {"identity": "job-7", "role": "writer"}}
    k8s.secret("service-tokens", {"tokens.json": json.dumps(tokens)})
    checks = [
        {"name": "required-attributes", "image": "zarrlake:test", "timeoutSeconds": 120},
        {
            "name": "slow",
            "image": "zarrlake:test",
            "command": ["python", "-c", "import time; time.sleep(60)"],
            "timeoutSeconds": 2,
        },
    ]
    spec = {
        "enabled": True,
        "tokensSecretRef": {"name": "service-tokens", "key": "tokens.json"},
        "checks": checks,
    }
    protection = [
        {"branch": "main", "requiredChecks": ["required-attributes"]},
        {"branch": "release", "requiredChecks": ["slow"], "allowReset": True},
    ]
    k8s.ready_repository(commitService=spec, protection=protection)

    def up() -> dict | None:
        obj = k8s.get("Repository", "repo") or {}
        found = (obj.get("status") or {}).get("commitService") or {}
        ok = condition(obj, "CommitServiceReady").get("status") == "True"
        return obj if ok and found.get("readyReplicas") == 1 else None

    try:
        obj = wait_for("the commit service ready", up)
    except AssertionError:
        got = k8s.get("Repository", "repo") or {}
        raise AssertionError(json.dumps(got.get("status"), indent=1) + k8s.log_tail()) from None
    # The service runs as a ServiceAccount of the operator's, allowed Jobs and their pods only.
    pod = k8s.get("Deployment", "zl-repo-commit")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "zl-repo-commit"
    assert k8s.get("ServiceAccount", "zl-repo-commit") is not None
    role = k8s.get("Role", "zl-repo-commit")
    assert role["rules"] == [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ]
    binding = k8s.get("RoleBinding", "zl-repo-commit")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "zl-repo-commit", "namespace": k8s.namespace}
    ]

    url = k8s.cluster.resolve(obj["status"]["commitService"]["url"])
    writer = zarrlake.Repository.from_kubernetes(
        "repo", k8s.namespace, commit_service=url, commit_token=WRITER
    )
    writer.create_branch("dev")
    writer.create_branch("release")
    session = writer.writable_session("dev")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")[:] = 3
    session.commit("t without units")
    head = writer.lookup_branch("main")

    def check_jobs(name: str) -> list[dict]:
        return kube.list_("Job", k8s.namespace, f"zarrlake.io/check={name}")

    with pytest.raises(zarrlake.CheckFailed) as refused:
        writer.merge("dev", "main")
    assert refused.value.check == "required-attributes"
    assert refused.value.problems == ("array /t has no units attribute",)
    assert k8s.open_repository().lookup_branch("main") == head
    # The Job that refused is kept (a day), for its logs; it ran the check in its image.
    (kept,) = check_jobs("required-attributes")
    assert kept["metadata"]["name"].startswith("zl-repo-check-required-attributes-")
    assert kept["spec"]["ttlSecondsAfterFinished"] == 86_400
    env = {
        v["name"]: v.get("value") for v in kept["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["ZARRLAKE_CHECK_BRANCH"] == "main" and env["ZARRLAKE_CHECK_KIND"] == "merge"
    assert env["ZARRLAKE_CHECK_PARENT"] == head
    # The merge the service made: the Job is handed the digests of both snapshots as the
    # service holds them, and compares what it reads from storage with them.
    stored = k8s.open_repository().storage
    for var, snapshot in (("SNAPSHOT", env["ZARRLAKE_CHECK_SNAPSHOT"]), ("PARENT", head)):
        digest = hashlib.sha256(stored.get(snapshot_key(snapshot))).hexdigest()
        assert env[f"ZARRLAKE_CHECK_{var}_SHA256"] == digest, var
    kube.delete("Job", k8s.namespace, kept["metadata"]["name"])
    # The refusal as a Warning Event about the Repository, naming who was refused what.
    event = wait_for(
        "the refusal's Event",
        lambda: next((e for e in k8s.events() if e.get("reason") == "CheckFailed"), None),
    )
    assert event["involvedObject"]["name"] == "repo" and event["type"] == "Warning"
    assert event["message"].startswith("job-7: merge of 'dev' into 'main' refused: ")
    assert "array /t has no units attribute" in event["message"]

    session = writer.writable_session("dev")
    zarr.open_array(session.store, path="t", mode="a").attrs["units"] = "K"
    session.commit("units")
    merged = writer.merge("dev", "main")
    assert k8s.open_repository().lookup_branch("main") == merged
    assert check_jobs("required-attributes") == []  # the one that passed is gone

    # A check that runs past its deadline: the Job controller ends it, and the change with it.
    with pytest.raises(zarrlake.CheckFailed) as late:
        writer.merge("dev", "release")
    assert late.value.check == "slow"
    (said,) = late.value.problems
    assert said.startswith("Job zl-repo-check-slow-") and said.endswith("did not finish within 2 s")
    assert k8s.open_repository().lookup_branch("release") == head
    for job in check_jobs("slow"):
        kube.delete("Job", k8s.namespace, job["metadata"]["name"])

    # Without checks as Jobs and Events the service needs no API: its ServiceAccount and
    # Role go.
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"checks": None, "events": False}}})
    wait_for("the service's Role gone", lambda: k8s.get("Role", "zl-repo-commit") is None or None)
    assert k8s.get("RoleBinding", "zl-repo-commit") is None
    assert k8s.get("ServiceAccount", "zl-repo-commit") is None
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"enabled": False}}})
    wait_for("the commit service gone", lambda: k8s.get("Deployment", "zl-repo-commit") is None)


@pytest.fixture(scope="module")
def seaweed_iam(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """SeaweedFS with its IAM API writable: the provider the operator makes users on."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs-iam"), iam_writable=True)
    try:
        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing",
                     ).create_bucket(Bucket="governed-lake")  # fmt: skip
        yield server
    finally:
        server.stop()


def test_provisioned_credentials_hold_writers_to_the_immutable_objects(
    k8s: Env, seaweed_iam: Any
) -> None:
    """``provisionCredentials`` on SeaweedFS: the operator makes a writer and a reader, their
    keys in Secrets; the writer commits and merges through the service but cannot move a ref
    itself; the reader reads; a lost Secret gets a new key (the old one stops working); off,
    the users and Secrets go."""
    endpoint = seaweed_iam.endpoint
    k8s.secret("sw-admin", {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    tokens = {WRITER: {"identity": "wanda", "role": "writer"}}
    k8s.secret("service-tokens", {"tokens.json": json.dumps(tokens)})
    service = {
        "enabled": True,
        "tokensSecretRef": {"name": "service-tokens", "key": "tokens.json"},
        "provisionCredentials": True,
    }
    k8s.create({
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": "repo"},
        "spec": {
            "storage": {"bucket": "governed-lake", "prefix": f"repos/{k8s.namespace}",
                        "endpointURL": endpoint, "region": "us-east-1",
                        "credentialsSecret": {"name": "sw-admin"}},
            "lockService": {"mode": "none"},
            "commitService": service,
            "protection": [{"branch": "main"}],
        },
    })  # fmt: skip
    k8s.wait_condition("Repository", "repo")

    def provisioned() -> dict | None:
        obj = k8s.get("Repository", "repo") or {}
        found = (obj.get("status") or {}).get("commitService") or {}
        ready = condition(obj, "CommitServiceReady").get("status") == "True"
        said = found.get("writerCredentials") or ""
        return obj if ready and said.startswith("provisioned:") else None

    try:
        obj = wait_for("credentials provisioned", provisioned)
    except AssertionError:
        got = k8s.get("Repository", "repo") or {}
        raise AssertionError(json.dumps(got.get("status"), indent=1) + k8s.log_tail()) from None
    said = obj["status"]["commitService"]["writerCredentials"]
    assert "writers use Secret zl-repo-writer-credentials" in said
    url = k8s.cluster.resolve(obj["status"]["commitService"]["url"])

    def keys(role: str) -> tuple[str, str]:
        found = kube.secrets(k8s.namespace)(f"zl-repo-{role}-credentials")
        assert found is not None, role
        return found["AWS_ACCESS_KEY_ID"], found["AWS_SECRET_ACCESS_KEY"]

    def storage(role: str) -> zarrlake.Storage:
        key, secret = keys(role)
        return zarrlake.Storage.s3("governed-lake", f"repos/{k8s.namespace}",
                                   endpoint_url=endpoint, region="us-east-1",
                                   access_key_id=key, secret_access_key=secret,
                                   allow_http=True)  # fmt: skip

    def dead(key: tuple[str, str]) -> bool:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=key[0], aws_secret_access_key=key[1])  # fmt: skip
        try:
            client.head_bucket(Bucket="governed-lake")
        except ClientError:
            return True
        return False

    writer = zarrlake.Repository.open(storage("writer"), commit_service=url, commit_token=WRITER)
    writer.create_branch("dev")
    session = writer.writable_session("dev")
    zarr.open_group(session.store, mode="w").create_array("t", shape=(2,), dtype="f4")[:] = 5
    session.commit("through the service, with provisioned keys")
    merged = writer.merge("dev", "main")
    admin_view = k8s.open_repository()
    assert admin_view.lookup_branch("main") == merged
    # The same keys without the service, skipping every rule: the storage refuses the ref.
    rogue = zarrlake.Repository.open(storage("writer"))
    rogue.core.commits.guard = None
    with pytest.raises(zarrlake.StorageError, match="access denied"):
        session = rogue.writable_session("main")  # (its write probe, under refs/, is refused)
        zarr.open_array(session.store, path="t", mode="a")[:] = -1
        session.commit("past the service")
    # Nor can it write the journal entry or the root by hand.
    head = admin_view.core.journal.published_head("main")
    assert head is not None
    forged = dataclasses.replace(head, seq=head.seq + 1, previous=head.snapshot)
    for key in (admin_view.core.journal.entry_key("main", head.seq + 1), "root"):
        with pytest.raises(zarrlake.StorageError, match="access denied"):
            storage("writer").put(key, forged.encode())
    assert k8s.open_repository().lookup_branch("main") == merged
    # The reader reads, and writes nothing.
    reader = zarrlake.Repository.open(storage("reader"))
    assert zarr.open_array(reader.readonly_session("main").store, path="t")[:].tolist() == [5, 5]
    with pytest.raises(zarrlake.StorageError, match="access denied"):
        session = reader.writable_session("dev")
        zarr.open_array(session.store, path="t", mode="a")[:] = 0
        session.commit("a reader's")

    # A lost Secret: a new key for the same user on the next change; the old key is dead.
    old_key = keys("writer")
    k8s.delete("Secret", "zl-repo-writer-credentials")
    k8s.patch("Repository", "repo", {"metadata": {"annotations": {"touch": "1"}}})
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"events": False}}})
    wait_for(
        "a new writer key",
        lambda: (
            (found := kube.secrets(k8s.namespace)("zl-repo-writer-credentials"))
            and found["AWS_ACCESS_KEY_ID"] != old_key[0]
        ),
    )
    assert dead(old_key)
    assert zarrlake.Repository.open(storage("writer")).lookup_branch("main") == merged

    # Off: the users and their Secrets go.
    live = keys("reader")
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"provisionCredentials": False}}})
    wait_for(
        "the credentials Secrets gone",
        lambda: all(
            k8s.get("Secret", f"zl-repo-{r}-credentials") is None for r in ("writer", "reader")
        ),
    )
    assert dead(live)
    assert {"CredentialsProvisioned", "CredentialsDeleted"} <= k8s.event_reasons()

    # On again; the commit service off takes them too.
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"provisionCredentials": True}}})
    wait_for("credentials provisioned again", provisioned)
    live = keys("writer")
    k8s.patch("Repository", "repo", {"spec": {"commitService": {"enabled": False}}})
    wait_for("the commit service gone", lambda: k8s.get("Deployment", "zl-repo-commit") is None)
    wait_for("its users gone with it", lambda: dead(live))
    # On once more, then the Repository deleted: its users go with it (its data stays).
    again = {"enabled": True, "provisionCredentials": True}
    k8s.patch("Repository", "repo", {"spec": {"commitService": again}})
    wait_for("credentials provisioned once more", provisioned)
    live = keys("writer")
    k8s.delete("Repository", "repo")
    wait_for("the Repository gone", lambda: k8s.get("Repository", "repo") is None)
    assert dead(live)
