"""engine: spark: the objects the operator builds for a RetentionPolicy (pure functions)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from test_desired import (
    POLICY_SPEC,
    SECRET_VALUES,
    arg_after,
    container,
    env_of,
    policy_body,
    repository_body,
)

from zarrlake.resources import RetentionPolicySpec, problems
from zarrlake_operator import desired

SPARK_POLICY = {
    **POLICY_SPEC,
    "engine": "spark",
    "spark": {
        "image": "registry.example/zarrlake-spark:2",
        "executorInstances": 8,
        "executorCores": 2,
        "executorMemory": "6g",
        "driverCores": 2,
        "driverMemory": "3g",
        "sparkConf": {"spark.sql.shuffle.partitions": "64"},
    },
}


def parse(spec: dict[str, Any]) -> RetentionPolicySpec:
    return RetentionPolicySpec.model_validate(spec)


def confs(command: list[str]) -> dict[str, str]:
    out = {}
    for i, arg in enumerate(command):
        if arg == "--conf":
            key, _, value = command[i + 1].partition("=")
            out[key] = value
    return out


def test_engine_defaults_to_local_and_spark_sizes_have_defaults() -> None:
    spec = parse({"repository": "climate"})
    assert spec.engine == "local"
    spark = parse({"repository": "climate", "engine": "spark"}).spark
    assert (spark.executor_instances, spark.executor_memory, spark.driver_memory) == (2, "2g", "1g")


@pytest.mark.parametrize(
    ("spark", "where", "needle"),
    [
        ({"executorInstances": 0}, "spec.spark.executorInstances", "greater than or equal"),
        ({"executorMemory": "lots"}, "spec.spark.executorMemory", "pattern"),
        ({"driverMemory": "1 GB"}, "spec.spark.driverMemory", "pattern"),
        ({"serviceAccountName": "Not_Valid"}, "spec.spark.serviceAccountName", "pattern"),
        ({"sparkConf": {"shuffle": "4"}}, "spec.spark.sparkConf", "start with 'spark.'"),
        ({"sparkConf": {"spark.master": "local"}}, "spec.spark.sparkConf", "set by the operator"),
        (
            {"sparkConf": {"spark.kubernetes.authenticate.driver.oauthToken": "x"}},
            "spec.spark.sparkConf",
            "set by the operator",
        ),
        (
            {"sparkConf": {"spark.hadoop.fs.s3a.secret.key": "x"}},
            "spec.spark.sparkConf",
            "credential",
        ),
    ],
)
def test_bad_spark_settings_are_refused_with_a_reason(
    spark: dict[str, Any], where: str, needle: str
) -> None:
    with pytest.raises(ValidationError) as e:
        parse({"repository": "climate", "engine": "spark", "spark": spark})
    message = problems(e.value, prefix="spec.")
    assert message.startswith(where) and needle in message, message
    with pytest.raises(ValidationError):
        parse({"repository": "climate", "engine": "yarn"})


def test_maintenance_arguments_add_the_spark_engine() -> None:
    spec = parse(SPARK_POLICY)
    local = desired.maintenance_arguments(spec, "s3://b/p")
    spark = desired.maintenance_arguments(spec, "s3://b/p", engine="spark")
    for kind in ("gc", "compact"):
        assert spark[kind] == [*local[kind], "--engine", "spark"]
    assert spark["gc"][:2] == ["gc", "s3://b/p"] and arg_after(spark["gc"], "--grace") == "10d"
    # The local CronJobs' commands are exactly `zarrlake` + the local arguments.
    jobs = desired.retention_cron_jobs(
        policy_body(POLICY_SPEC), parse(POLICY_SPEC), repository_body()
    )
    url = repository_body()["status"]["url"]
    assert container(jobs["gc"])["command"] == [
        "zarrlake",
        *desired.maintenance_arguments(parse(POLICY_SPEC), url)["gc"],
    ]


def spark_submit_jobs(spec: dict[str, Any], **defaults: Any) -> dict[str, dict[str, Any]]:
    return desired.spark_submit_cron_jobs(
        policy_body(spec), parse(spec), repository_body(), desired.SparkDefaults(**defaults)
    )


def test_spark_submit_cron_job_runs_the_driver_in_the_job_pod() -> None:
    jobs = spark_submit_jobs(SPARK_POLICY)
    assert set(jobs) == {"gc", "compact"}
    gc = jobs["gc"]
    assert gc["metadata"]["name"] == "zl-climate-retention-gc-spark"
    assert gc["metadata"]["labels"][desired.POLICY_LABEL] == "climate-retention"
    assert gc["metadata"]["labels"][desired.JOB_KIND_LABEL] == "gc"
    assert gc["metadata"]["ownerReferences"][0]["uid"] == "uid-climate-retention"
    assert gc["spec"]["schedule"] == "0 3 * * *" and gc["spec"]["concurrencyPolicy"] == "Forbid"
    pod = gc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    # The driver creates executors through the API: a token, the driver's ServiceAccount.
    assert pod["serviceAccountName"] == "zl-climate-retention-spark"
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsUser"] == desired.SPARK_USER
    c = container(gc)
    assert c["image"] == "registry.example/zarrlake-spark:2"
    cmd = c["command"]
    assert cmd[0] == desired.SPARK_SUBMIT
    assert arg_after(cmd, "--master") == (
        "k8s://https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"
    )
    assert arg_after(cmd, "--deploy-mode") == "client"
    conf = confs(cmd)
    assert conf["spark.kubernetes.container.image"] == "registry.example/zarrlake-spark:2"
    assert conf["spark.kubernetes.authenticate.driver.serviceAccountName"] == (
        "zl-climate-retention-spark"
    )
    assert conf["spark.kubernetes.namespace"] == "science"
    assert (conf["spark.executor.instances"], conf["spark.executor.cores"]) == ("8", "2")
    assert (conf["spark.executor.memory"], conf["spark.driver.memory"]) == ("6g", "3g")
    assert conf["spark.driver.cores"] == "2"
    assert conf["spark.sql.shuffle.partitions"] == "64"
    # Executors reach the driver at the pod's IP; the pod's fields come from the downward API.
    assert conf["spark.driver.host"] == "$(POD_IP)"
    assert conf["spark.kubernetes.driver.pod.name"] == "$(POD_NAME)"
    env = env_of(c)
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The report goes where the local jobs put theirs: the Job pod's termination log.
    assert env["ZARRLAKE_REPORT_FILE"]["value"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The zarrlake part: the entry file, then exactly the local arguments + --engine spark.
    url = repository_body()["status"]["url"]
    assert (
        desired.zarrlake_arguments(cmd)
        == desired.maintenance_arguments(parse(SPARK_POLICY), url, engine="spark")["gc"]
    )
    assert cmd[cmd.index(desired.SPARK_ENTRY) - 1].startswith("spark.")  # after the options
    compact = desired.zarrlake_arguments(container(jobs["compact"])["command"])
    assert compact[:2] == ["compact", url] and compact[-2:] == ["--engine", "spark"]


def test_spark_submit_credentials_travel_by_reference_only() -> None:
    repo = repository_body()
    assert desired.lock_secret(repo, SECRET_VALUES[-1])  # the value exists, in its Secret only
    for cj in spark_submit_jobs(SPARK_POLICY).values():
        text = json.dumps(cj)
        for value in SECRET_VALUES:
            assert value not in text
        c = container(cj)
        env = env_of(c)
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
            "name": "climate-s3",
            "key": "AWS_ACCESS_KEY_ID",
        }
        assert env["ZARRLAKE_LOCK_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
            "zl-climate-lock"
        )
        conf = confs(c["command"])
        # Executors: the same Secrets, named (secret:key), never their values.
        assert conf["spark.kubernetes.executor.secretKeyRef.AWS_SECRET_ACCESS_KEY"] == (
            "climate-s3:AWS_SECRET_ACCESS_KEY"
        )
        assert conf["spark.kubernetes.executor.secretKeyRef.ZARRLAKE_LOCK_PASSWORD"] == (
            "zl-climate-lock:password"
        )
        assert conf["spark.executorEnv.AWS_DEFAULT_REGION"] == "eu-west-1"
        assert "spark.executorEnv.ZARRLAKE_REPORT_FILE" not in conf


def test_driver_service_account_given_or_made_with_its_role() -> None:
    body, spec = policy_body(SPARK_POLICY), parse(SPARK_POLICY)
    defaults = desired.SparkDefaults()
    assert desired.spark_service_account(body, spec, defaults) == (
        "zl-climate-retention-spark",
        True,
    )
    chart = desired.SparkDefaults(service_account_name="spark-jobs")
    assert desired.spark_service_account(body, spec, chart) == ("spark-jobs", False)
    own = parse({**SPARK_POLICY, "spark": {"serviceAccountName": "mine"}})
    assert desired.spark_service_account(body, own, chart) == ("mine", False)
    pod = spark_submit_jobs({**SPARK_POLICY, "spark": {"serviceAccountName": "mine"}})["gc"]
    assert pod["spec"]["jobTemplate"]["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    assert (
        confs(container(pod)["command"])["spark.kubernetes.authenticate.driver.serviceAccountName"]
        == "mine"
    )
    # Without an image in the policy, the operator's default.
    default_image = spark_submit_jobs({**SPARK_POLICY, "spark": {}}, image="reg/spark:9")["gc"]
    assert container(default_image)["image"] == "reg/spark:9"

    sa, role, binding = desired.spark_rbac(body, spec)
    assert [o["kind"] for o in (sa, role, binding)] == ["ServiceAccount", "Role", "RoleBinding"]
    for obj in (sa, role, binding):
        assert obj["metadata"]["name"] == "zl-climate-retention-spark"
        assert obj["metadata"]["namespace"] == "science"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-climate-retention"
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""]
    assert {"pods", "services", "configmaps"} <= set(rule["resources"])
    assert {"create", "delete", "get", "list", "watch"} <= set(rule["verbs"])
    assert not any("*" in v for v in rule["verbs"] + rule["resources"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "zl-climate-retention-spark",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "zl-climate-retention-spark", "namespace": "science"}
    ]


def test_scheduled_spark_application() -> None:
    body, spec = policy_body(SPARK_POLICY), parse(SPARK_POLICY)
    apps = desired.scheduled_spark_applications(body, spec, repository_body())
    assert set(apps) == {"gc", "compact"}
    gc = apps["gc"]
    assert gc["apiVersion"] == "sparkoperator.k8s.io/v1beta2"
    assert gc["kind"] == "ScheduledSparkApplication"
    assert gc["metadata"]["name"] == "zl-climate-retention-gc"
    assert len(gc["metadata"]["name"]) <= desired.SPARK_NAME_MAX
    assert gc["metadata"]["ownerReferences"][0]["uid"] == "uid-climate-retention"
    assert gc["spec"]["schedule"] == "0 3 * * *"
    assert gc["spec"]["concurrencyPolicy"] == "Forbid"
    t = gc["spec"]["template"]
    assert (t["type"], t["mode"]) == ("Python", "cluster")
    assert t["image"] == "registry.example/zarrlake-spark:2"
    assert t["mainApplicationFile"] == f"local://{desired.SPARK_ENTRY}"
    url = repository_body()["status"]["url"]
    assert t["arguments"] == desired.maintenance_arguments(spec, url, engine="spark")["gc"]
    assert t["driver"]["serviceAccount"] == "zl-climate-retention-spark"
    assert (t["driver"]["cores"], t["driver"]["memory"]) == (2, "3g")
    ex = t["executor"]
    assert (ex["instances"], ex["cores"], ex["memory"]) == (8, 2, "6g")
    assert t["sparkConf"] == {"spark.sql.shuffle.partitions": "64"}
    # The driver pod carries the policy's job labels: its report finds its way to the status.
    assert t["driver"]["labels"][desired.POLICY_LABEL] == "climate-retention"
    assert t["driver"]["labels"][desired.JOB_KIND_LABEL] == "gc"
    driver_env = env_of(t["driver"])
    assert driver_env["ZARRLAKE_REPORT_FILE"]["value"] == "/dev/termination-log"
    assert "ZARRLAKE_REPORT_FILE" not in env_of(ex)
    for where in (t["driver"], ex):
        assert env_of(where)["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
            "climate-s3"
        )
    text = json.dumps(apps)
    for value in SECRET_VALUES:
        assert value not in text
    # Suspending and dropping compaction.
    no_compaction = {
        **SPARK_POLICY,
        "compaction": None,
        "gc": {"schedule": "@daily", "suspend": True},
    }
    only = desired.scheduled_spark_applications(
        policy_body(no_compaction), parse(no_compaction), repository_body()
    )
    assert set(only) == {"gc"} and only["gc"]["spec"]["suspend"] is True


def driver_pod(phase: str, message: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "zl-p-gc-1700000000-driver",
            "labels": {"sparkoperator.k8s.io/app-name": "zl-p-gc-1700000000"},
        },
        "status": {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "spark-kubernetes-driver",
                    "state": {
                        "terminated": {
                            "message": message,
                            "startedAt": "2024-05-02T03:01:00Z",
                            "finishedAt": "2024-05-02T03:04:05Z",
                        }
                    },
                }
            ],
        },
    }


def test_driver_run_reads_the_report_of_a_finished_driver() -> None:
    from zarrlake.jobreport import JobReport

    counts = {"expired_snapshots": 3, "deleted_objects": 12, "deleted_bytes": 4096}
    run = desired.driver_run(driver_pod("Succeeded", JobReport(counts).to_message()))
    assert run is not None
    assert (run.job, run.result, run.time) == (
        "zl-p-gc-1700000000",
        "Succeeded",
        "2024-05-02T03:04:05Z",
    )
    assert (run.snapshots_expired, run.objects_deleted, run.bytes_freed) == (3, 12, 4096)
    assert run.duration_seconds == 185  # the driver container's start to its end
    failed = desired.driver_run(driver_pod("Failed", "Traceback...\nStorageError: no bucket"))
    assert failed is not None and failed.result == "Failed"
    assert failed.message == "StorageError: no bucket" and failed.objects_deleted is None
    assert desired.driver_run(driver_pod("Running", "")) is None
