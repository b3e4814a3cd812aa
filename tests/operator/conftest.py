"""The operator under test: a real process against the emulated Kubernetes API and moto's S3.

One API server, one operator process and one :class:`LocalCluster` serve the whole session;
every test works in a namespace of its own, so tests do not see each other's resources.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_env import ROOT, Env

from zarrlake_operator import kube
from zarrlake_testkit.emulated import LocalCluster, start_operator
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import stop


@dataclass
class Shared:
    api: KubeAPI
    kubeconfig: Path
    s3_endpoint: str
    cluster: LocalCluster
    operator_log: Path
    metrics_port: int


@pytest.fixture(scope="session")
def operator_cluster(tmp_path_factory: pytest.TempPathFactory, moto_s3: Any) -> Iterator[Shared]:
    work = tmp_path_factory.mktemp("k8s")
    api = KubeAPI().start()
    proc = cluster = None
    previous = os.environ.get("KUBECONFIG")
    try:
        kubeconfig = api.write_kubeconfig(work / "kubeconfig")
        kube.use_kubeconfig(str(kubeconfig))
        # Repository.from_kubernetes finds the cluster the way a user's process would.
        os.environ["KUBECONFIG"] = str(kubeconfig)
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            kube._call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                body=yaml.safe_load(path.read_text()),
            )
        log = work / "operator.log"
        # At DEBUG, so that the credentials test also covers the most verbose logging.
        proc, _, metrics_port = start_operator(
            kubeconfig, log_path=log, resync_seconds=1, extra_env={"ZARRLAKE_LOG_LEVEL": "DEBUG"}
        )
        cluster = LocalCluster(work, []).start(interval=0.2)
        yield Shared(api, kubeconfig, moto_s3.endpoint, cluster, log, metrics_port)
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        if cluster is not None:
            cluster.stop()
        stop(proc)
        api.stop()


@pytest.fixture
def k8s(operator_cluster: Shared) -> Iterator[Env]:
    env = Env(
        operator_cluster.api,
        operator_cluster.kubeconfig,
        operator_cluster.s3_endpoint,
        operator_cluster.cluster,
        operator_cluster.operator_log,
        operator_cluster.metrics_port,
    )
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": env.namespace}})
    env.cluster.namespaces.append(env.namespace)
    try:
        yield env
    finally:
        # The namespace goes with the test: otherwise the operator keeps resyncing every earlier
        # test's resources (each a round trip to S3), and the load grows with every test run.
        env.cluster.forget_namespace(env.namespace)
        kube.delete("Namespace", "", env.namespace)
