"""``spec.virtualContainers`` end to end (issue 41): the real operator process against the
emulated Kubernetes API and moto's S3 keeps a repository's virtual chunk containers to what the
Repository resource declares, and a client that opens it from Kubernetes reads the sources with
the credentials of the Secret each container names (never stored in the repository)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr
from k8s_env import CREDENTIALS, Env, condition, wait_for

import zarrlake


def _applied(k8s: Env, message: str) -> dict:
    def check() -> dict | None:
        obj = k8s.get("Repository", "repo") or {}
        found = condition(obj, "VirtualContainersReady")
        return obj if found.get("status") == "True" and found.get("message") == message else None

    return wait_for(message, check)


def test_spec_virtual_containers_are_applied_kept_and_read_with_their_secret(k8s: Env) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=k8s.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    bucket = f"archive-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="data/raw.bin", Body=bytes(range(16)))
    prefix = f"s3://{bucket}/data/"
    k8s.secret(
        "archive-creds",
        {
            "access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"] + "\n",
            "unrelated": "left alone",
        },
    )
    container = {
        "urlPrefix": prefix,
        "endpointURL": k8s.s3_endpoint,
        "region": "us-east-1",
        "credentialsSecretRef": {"name": "archive-creds"},
    }
    k8s.ready_repository(virtualContainers=[container])
    obj = _applied(k8s, f"virtual chunk containers: {prefix}")
    assert obj["status"]["virtualContainers"] == 1
    repo = k8s.open_repository()
    assert repo.config.virtual_containers == (
        zarrlake.VirtualContainer(prefix, endpoint_url=k8s.s3_endpoint, region="us-east-1"),
    )
    # The credentials came from the Secret, not from the repository.
    assert "secret_access_key" not in json.dumps(repo.record.config)
    session = repo.writable_session()
    zarr.create_array(
        session.store, name="x", shape=(16,), chunks=(8,), dtype="u1", compressors=None
    )
    url = prefix + "raw.bin"
    session.set_virtual_refs(
        "x", {(0,): zarrlake.VirtualRef(url, 0, 8), (1,): zarrlake.VirtualRef(url, 8, 8)}
    )
    session.commit("virtual")
    got = zarr.open_array(k8s.open_repository().readonly_session().store, path="x")[:]
    np.testing.assert_array_equal(got, np.arange(16, dtype="u1"))
    # Without the Secret's credentials (a plain open, no AWS variables for that bucket's
    # server), the source is not read with anyone else's.
    bare = zarrlake.Repository.open(repo.storage)
    assert bare.core.objects.sources.credentials == {}

    # A container taken out behind the operator's back is put back at the next resync.
    repo.set_virtual_containers([])
    wait_for(
        "the container put back",
        lambda: zarrlake.Repository.open(repo.storage).config.virtual_containers or None,
    )
    assert "VirtualContainersChanged" in k8s.event_reasons()
    # Taken out of the spec: refs into it are refused, nothing is deleted.
    k8s.patch("Repository", "repo", {"spec": {"virtualContainers": []}})
    obj = _applied(k8s, "virtual chunk containers: none")
    assert obj["status"]["virtualContainers"] == 0
    with pytest.raises(zarrlake.VirtualContainerNotAllowed):
        zarr.open_array(k8s.open_repository().readonly_session().store, path="x")[:]
    client.head_object(Bucket=bucket, Key="data/raw.bin")


def test_a_missing_credentials_secret_is_named(k8s: Env) -> None:
    container = {
        "urlPrefix": "s3://elsewhere/data/",
        "credentialsSecretRef": {"name": "not-there"},
    }
    k8s.ready_repository(virtualContainers=[container])
    obj = k8s.wait_condition("Repository", "repo", "VirtualContainersReady", "False")
    found = condition(obj, "VirtualContainersReady")
    assert found["reason"] == "SecretMissing" and found["message"].endswith("not found: not-there")
    # The containers are applied all the same: only the readers' credentials are missing.
    assert obj["status"]["virtualContainers"] == 1
    with pytest.raises(zarrlake.KubernetesError, match=r"'not-there'.*not found"):
        k8s.open_repository()
    k8s.secret("not-there", {"access_key_id": "a", "secret_access_key": "b"})
    _applied(k8s, "virtual chunk containers: s3://elsewhere/data/")
    creds = k8s.open_repository().core.objects.sources.credentials
    assert creds == {"s3://elsewhere/data/": {"access_key_id": "a", "secret_access_key": "b"}}
