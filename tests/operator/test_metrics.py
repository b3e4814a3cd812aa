"""The operator's state metrics, read from its /metrics endpoint after real reconciles: the real
operator process on the emulated API, moto's S3, maintenance Jobs run as real CLI processes.

Every value is compared with the fact it reports, as the API server or the repository has it
(a condition, a commit time, a Job's start and end); every series of an object goes with it.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import zarr
from k8s_env import Env, condition, wait_for
from prometheus_client.parser import text_string_to_metric_families

from zarrlake_operator import desired, metrics


def scrape(k8s: Env) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample the operator exports: name -> {sorted label pairs: value}."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(f"http://127.0.0.1:{k8s.metrics_port}/metrics", timeout=30) as rsp:
        text = rsp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def value(k8s: Env, metric: str, /, **labels: str) -> float | None:
    """One series' value, or None when the operator does not export it."""
    return scrape(k8s).get(metric, {}).get(tuple(sorted(labels.items())))


def wait_value(k8s: Env, metric: str, expected: float, /, **labels: str) -> None:
    wait_for(
        f"{metric}{labels} == {expected}",
        lambda: value(k8s, metric, **labels) == expected or None,
    )


def wait_gone(k8s: Env, metric: str, /, **labels: str) -> None:
    wait_for(f"{metric}{labels} removed", lambda: value(k8s, metric, **labels) is None)


def commit(repo: Any, branch: str, fill: float, message: str) -> str:
    session = repo.writable_session(branch)
    arr = zarr.open_array(
        session.store, path="a", mode="a", shape=(4, 4), chunks=(2, 2), dtype="float32"
    )
    arr[:] = fill
    return str(session.commit(message, author="tests"))


READY = "zarrlake_operator_resource_ready"


def test_readiness_gauges_follow_each_resource_and_go_with_it(k8s: Env) -> None:
    ns = k8s.namespace
    k8s.ready_repository()
    k8s.custom("Branch", "dev", {"repository": "repo"})
    k8s.custom("Tag", "v1", {"repository": "repo", "ref": "main"})
    k8s.custom("RetentionPolicy", "gc", {"repository": "repo", "gc": {"schedule": "@daily"}})
    # Waits for its spec.from forever (FromNotFound): never Ready.
    k8s.custom("Branch", "stuck", {"repository": "repo", "from": "no-such-ref"})
    for kind, name in (("Branch", "dev"), ("Tag", "v1"), ("RetentionPolicy", "gc")):
        k8s.wait_condition(kind, name)
    k8s.wait_condition("Branch", "stuck", status="False")

    for kind, name in (
        ("Repository", "repo"),
        ("Branch", "dev"),
        ("Tag", "v1"),
        ("RetentionPolicy", "gc"),
    ):
        wait_value(k8s, READY, 1, kind=kind, namespace=ns, name=name)
    wait_value(k8s, READY, 0, kind="Branch", namespace=ns, name="stuck")
    # Still so after several resyncs (every second here), whether a Branch's own reconcile or
    # its Repository's confirmation of its status set it.
    time.sleep(3)
    assert value(k8s, READY, kind="Branch", namespace=ns, name="dev") == 1
    assert value(k8s, READY, kind="Branch", namespace=ns, name="stuck") == 0

    # Deleted objects take their series along (the policy has no finalizer: the watch's
    # deletion event does it; the others go through their finalizers).
    for kind, name in (("Branch", "dev"), ("Tag", "v1"), ("RetentionPolicy", "gc")):
        k8s.delete(kind, name)
        wait_gone(k8s, READY, kind=kind, namespace=ns, name=name)
    assert value(k8s, READY, kind="Branch", namespace=ns, name="stuck") == 0

    # A Repository that stops being Ready says so: its clients must now have a lock service
    # (onUnavailable: fail) that nothing answers at.
    lock = {"mode": "external", "url": "redis://127.0.0.1:1/0", "onUnavailable": "fail"}
    k8s.patch("Repository", "repo", {"spec": {"lockService": lock}})
    k8s.wait_condition("Repository", "repo", status="False")
    wait_value(k8s, READY, 0, kind="Repository", namespace=ns, name="repo")
    assert value(k8s, "zarrlake_operator_lock_service_ready", namespace=ns, name="repo") == 0


LOCK = "zarrlake_operator_lock_service_ready"


def test_lock_service_health_follows_the_condition(k8s: Env, tmp_path: Any) -> None:
    from zarrlake_testkit.servers import start_redis, stop

    ns = k8s.namespace
    proc, url = start_redis(tmp_path, None)
    try:
        k8s.secret()
        k8s.repository(lockService={"mode": "external", "url": url})
        obj = k8s.wait_condition("Repository", "repo", "LockServiceReady")
        assert condition(obj, "LockServiceReady")["reason"] == "Reachable"
        wait_value(k8s, LOCK, 1, namespace=ns, name="repo")
    finally:
        stop(proc)
    # Redis gone: the next resync cannot reach it (the Repository itself stays Ready: the lock
    # is optional by default), and the gauge says so.
    obj = k8s.wait_condition("Repository", "repo", "LockServiceReady", "False")
    assert condition(obj, "Ready")["status"] == "True"
    wait_value(k8s, LOCK, 0, namespace=ns, name="repo")
    assert value(k8s, READY, kind="Repository", namespace=ns, name="repo") == 1

    k8s.delete("Repository", "repo")
    wait_gone(k8s, LOCK, namespace=ns, name="repo")
    wait_gone(k8s, READY, kind="Repository", namespace=ns, name="repo")


HEAD_TIME = "zarrlake_operator_branch_head_timestamp_seconds"
HEAD_AGE = "zarrlake_operator_branch_head_age_seconds"


def test_branch_head_time_and_age(k8s: Env) -> None:
    ns = k8s.namespace
    k8s.ready_repository()
    repo = k8s.open_repository()
    k8s.custom("Branch", "dev", {"repository": "repo"})
    k8s.wait_condition("Branch", "dev")
    head = commit(repo, "dev", 1.0, "on dev")
    obj = wait_for(
        "status.head follows",
        lambda: (o := k8s.get("Branch", "dev"))["status"]["head"] == head and o,
    )
    committed = metrics.parse_time(obj["status"]["lastCommitTime"])
    assert committed is not None
    # The commit's own time, to the second the status keeps.
    (info,) = list(repo.log(head, limit=1))
    assert committed == int(info.time.timestamp())
    labels = {"namespace": ns, "name": "dev", "repository": "repo"}
    wait_value(k8s, HEAD_TIME, committed, **labels)

    before = time.time()
    age = value(k8s, HEAD_AGE, **labels)
    after = time.time()
    assert age is not None
    assert before - committed <= age <= after - committed
    time.sleep(1.5)
    older = value(k8s, HEAD_AGE, **labels)
    assert older is not None and older >= age + 1  # computed when scraped: it grows

    k8s.delete("Branch", "dev")
    wait_gone(k8s, HEAD_TIME, **labels)
    assert value(k8s, HEAD_AGE, **labels) is None


RESULT = "zarrlake_operator_maintenance_last_result"
DURATION = "zarrlake_operator_maintenance_last_duration_seconds"
FINISHED = "zarrlake_operator_maintenance_last_run_timestamp_seconds"
SUCCEEDED = "zarrlake_operator_maintenance_last_success_timestamp_seconds"


def _run(k8s: Env, cron_job: str, job: str, *, broken: bool = False) -> dict[str, Any]:
    """Run a Job from the CronJob's template (``kubectl create job --from``); returns the Job
    once it finished. ``broken``: pointed at a bucket that does not exist, so it fails."""
    template = k8s.get("CronJob", cron_job)["spec"]["jobTemplate"]
    if broken:
        container = template["spec"]["template"]["spec"]["containers"][0]
        container["command"][2] = "s3://no-such-bucket-zl/x?endpoint_url=" + k8s.s3_endpoint
    k8s.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": job, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )

    def finished() -> dict[str, Any] | None:
        found = k8s.get("Job", job)
        conditions = ((found or {}).get("status") or {}).get("conditions") or []
        return found if any(c.get("status") == "True" for c in conditions) else None

    return wait_for(f"Job {job} finished", finished, 240)  # `zarrlake gc` as a new process


def test_maintenance_result_duration_and_time_per_policy(k8s: Env) -> None:
    ns = k8s.namespace
    k8s.ready_repository()
    k8s.custom(
        "RetentionPolicy",
        "p",
        {"repository": "repo", "gc": {"schedule": "@daily", "grace": "0s", "force": True}},
    )
    obj = k8s.wait_condition("RetentionPolicy", "p")
    cron_job = obj["status"]["gcCronJob"]
    labels = {"namespace": ns, "name": "p", "task": "gc"}
    assert value(k8s, RESULT, **labels) is None  # never ran: nothing to say

    job = _run(k8s, cron_job, "gc-ok")
    status = job["status"]
    wait_value(k8s, RESULT, 1, **labels)
    ended = metrics.parse_time(status["completionTime"])
    took = desired.seconds_between(status["startTime"], status["completionTime"])
    assert ended is not None and took is not None
    last = k8s.get("RetentionPolicy", "p")["status"]["lastGC"]
    assert (last["job"], last["result"], last["durationSeconds"]) == ("gc-ok", "Succeeded", took)
    assert value(k8s, DURATION, **labels) == took
    assert value(k8s, FINISHED, **labels) == ended
    assert value(k8s, SUCCEEDED, **labels) == ended

    # A failed run: the result turns 0, the last success stays where it was.
    time.sleep(1)  # a later second than the run before (times are kept to the second)
    job = _run(k8s, cron_job, "gc-broken", broken=True)
    (failed,) = [c for c in job["status"]["conditions"] if c["type"] == "Failed"]
    wait_value(k8s, RESULT, 0, **labels)
    assert value(k8s, FINISHED, **labels) == metrics.parse_time(failed["lastTransitionTime"])
    assert value(k8s, DURATION, **labels) == desired.seconds_between(
        job["status"]["startTime"], failed["lastTransitionTime"]
    )
    assert value(k8s, SUCCEEDED, **labels) == ended
    assert value(k8s, RESULT, namespace=ns, name="p", task="compaction") is None

    k8s.delete("RetentionPolicy", "p")
    for metric in (RESULT, DURATION, FINISHED, SUCCEEDED):
        wait_gone(k8s, metric, **labels)
