"""A RolloutSet under the real Kueue (devcluster: the pinned `sigs.k8s.io/kueue` controller, its
CRDs and webhooks; `devcluster/kueue.py`). Nothing on Kueue's side is simulated: Kueue admits,
preempts, deactivates and readmits; the operator is RolloutSet's external-framework integration.

- A low-priority set running episodes through the trainer client is preempted by a plain
  `batch/v1` Job of higher priority that needs the same GPU: the suspend checkpoint is Ready
  before the set's pods go, the Job's pod then runs on the GPU, and once it finishes Kueue
  readmits the set, which resumes under attempt 2 and finishes every episode exactly once.
- A set without the queue label runs as before (no Workload, `spec.suspend` untouched).
- A set whose suspend checkpoint fails (its participant never parks) still releases its pods and
  its quota when Kueue deactivates its Workload, and its `Preempted` condition says the
  checkpoint failed.

The queue objects are `examples/kueue/queues.yaml`, the ones docs/policy.md shows.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from policy_support import WAIT, counter_set, wait_condition, when
from rollout_operator.decide import queue
from rollout_operator.model import api
from rollout_operator.model.reasons import Reason
from test_policy_servers import (
    SET,
    check_continued,
    episodes_running,
    servers_set,
    wait_attempt_2,
)
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    condition,
    is_true,
    kubectl_apply,
    participants_by_role,
)

from devcluster import kueue as devkueue
from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

QUEUES = Path(__file__).resolve().parents[2] / "examples" / "kueue" / "queues.yaml"
LOCAL_QUEUE = "team-gpus"
LOW, HIGH = "rollout-low", "rollout-high"


def queue_objects() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(QUEUES.read_text()) if doc]


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[devkueue.Kueue]:
    """Kueue's controller on the session's cluster, with the cluster-scoped queue objects; the
    controller and its webhooks go when the module ends (the CRDs stay, unused)."""
    running = devkueue.start(cluster)
    shared = [o for o in queue_objects() if o["kind"] != "LocalQueue"]
    try:
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"kind": "List", "apiVersion": "v1", "items": shared}),
        )
        yield running
    finally:
        for obj in reversed(shared):
            cluster.kubectl(
                "delete",
                f"{obj['kind'].lower()}.kueue.x-k8s.io",
                obj["metadata"]["name"],
                "--timeout=30s",
                check=False,
            )
        running.stop()


CLUSTER_QUEUE = "rollout-gpus"


@pytest.fixture(autouse=True)
async def quota_free(kueue: devkueue.Kueue, cluster: Cluster) -> None:
    """The module's tests share one ClusterQueue with one GPU of quota: each starts once the
    Workloads of the tests before it have given their quota back (their sets are deleted at
    teardown; the garbage collector then deletes the Workloads they own). A Workload queued while
    the quota is still held can stay pending after the quota frees, until the next event in its
    ClusterQueue: Kueue's behaviour, described in docs/policy.md, "Kueue"."""

    async def free() -> bool:
        found = json.loads(
            cluster.kubectl(
                "get", "workloads.kueue.x-k8s.io", "--all-namespaces", "-o", "json"
            ).stdout
        )["items"]
        return not [w for w in found if (w.get("status") or {}).get("admission")]

    async def held() -> str:
        return cluster.kubectl(
            "get", "workloads.kueue.x-k8s.io", "--all-namespaces", "-o", "wide", check=False
        ).stdout

    try:
        await wait_for(free, WAIT, f"ClusterQueue {CLUSTER_QUEUE} without admitted workloads")
    except Exception as timed_out:
        raise AssertionError(f"{timed_out}; workloads:\n{await held()}") from timed_out


def local_queue(cluster: Cluster, namespace: str) -> None:
    (lq,) = [o for o in queue_objects() if o["kind"] == "LocalQueue"]
    kubectl_apply(cluster, namespace, lq)


def queued(body: dict[str, Any], priority: str) -> dict[str, Any]:
    body["metadata"].setdefault("labels", {}).update(
        {queue.LABEL_QUEUE: LOCAL_QUEUE, queue.LABEL_PRIORITY_CLASS: priority}
    )
    return body


def preemptor_job(done: Path) -> dict[str, Any]:
    """A plain Job that needs the GPU and runs until the test creates `done`."""
    script = f"while [ ! -e {done} ]; do sleep 0.1; done"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "preemptor",
            "labels": {queue.LABEL_QUEUE: LOCAL_QUEUE, queue.LABEL_PRIORITY_CLASS: HIGH},
        },
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "train",
                            "image": "unused.invalid/train",
                            "command": ["/bin/sh", "-c", script],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                }
            },
        },
    }


def workload_of(cluster: Cluster, namespace: str, set_name: str) -> dict[str, Any] | None:
    found = cluster.kubectl(
        "get",
        "workloads.kueue.x-k8s.io",
        "-n",
        namespace,
        "-l",
        f"{api.LABEL_SET}={set_name}",
        "-o",
        "json",
    )
    items: list[dict[str, Any]] = json.loads(found.stdout)["items"]
    return items[0] if items else None


def kueue_condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}


async def job_pod_running(cluster: Cluster, namespace: str) -> dict[str, Any]:
    async def running() -> dict[str, Any] | None:
        pods = json.loads(
            cluster.kubectl(
                "get", "pods", "-n", namespace, "-l", "job-name=preemptor", "-o", "json"
            ).stdout
        )["items"]
        return next((p for p in pods if p["status"].get("phase") == "Running"), None)

    return await wait_for(running, WAIT, "the preemptor's pod Running on the GPU", interval=0.2)


async def test_preemption_saves_the_episodes_yields_the_gpu_and_resumes(
    cluster: Cluster,
    kueue: devkueue.Kueue,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    shared_dir: Path,
) -> None:
    local_queue(cluster, namespace)
    kubectl_apply(cluster, namespace, queued(servers_set(storage_dir), LOW))
    admitted = await wait_condition(resources, SET, "QuotaPending", reason="Admitted")
    assert "rollout-gpus" in admitted["message"]
    done = shared_dir / "done"
    async with episodes_running(cluster, namespace, resources) as running:
        ready = await resources.rollout_set(SET)
        model_pod = participants_by_role(ready)["model"][0]["pod"]
        pod = await resources.core.read_namespaced_pod(model_pod, namespace)
        # The admitted flavor's node labels are on the pods the operator created.
        assert pod.spec.node_selector == {"nvidia.com/gpu.present": "true"}

        kubectl_apply(cluster, namespace, preemptor_job(done))
        preempted = await wait_condition(resources, SET, "Preempted", status="True")
        assert preempted["reason"] == "Preempted"
        assert "Preempted to accommodate a workload" in preempted["message"]
        ckpt = await resources.wait_checkpoint(
            f"{SET}-suspend-a1",
            "Ready",
            lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"),
            WAIT,
        )
        assert is_true(ckpt, "Ready"), ckpt["status"]
        job_pod = await job_pod_running(cluster, namespace)
        # The GPU passed only after the checkpoint: the Job's pod exists only once Kueue had the
        # quota back, which the operator handed back only after the set's pods were gone.
        assert when(ckpt["status"]["completedAt"]) <= when(job_pod["metadata"]["creationTimestamp"])
        released = workload_of(cluster, namespace, SET)
        assert released is not None
        assert kueue_condition(released, "QuotaReserved")["status"] == "False"
        yielded = await resources.rollout_set(SET)
        assert "holds the state" in condition(yielded, "Preempted")["message"]  # type: ignore[index]

        done.touch()  # the preemptor finishes; Kueue readmits the set
        resumed = await wait_attempt_2(resources)
        await check_continued(running, resources, storage_dir, ckpt)

    assert condition(resumed, "Preempted")["reason"] == Reason.READMITTED  # type: ignore[index]
    assert condition(resumed, "Recovering")["reason"] == "Restored"  # type: ignore[index]
    assert resumed["status"]["restarts"] == 0
    assert resumed["status"]["latestCheckpoint"] == ckpt["metadata"]["name"]
    print(f"work lost on preemption (lastRecovery): {resumed['status'].get('lastRecovery')}")
    readmitted = workload_of(cluster, namespace, SET)
    assert readmitted is not None
    assert kueue_condition(readmitted, "Admitted")["status"] == "True"
    cluster.kubectl("delete", "job", "preemptor", "-n", namespace, "--wait=false")


async def test_a_set_without_the_queue_label_runs_as_before(
    cluster: Cluster,
    kueue: devkueue.Kueue,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    kubectl_apply(cluster, namespace, counter_set("plain", storage_dir, tmp_path))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), WAIT, name="plain")
    assert workload_of(cluster, namespace, "plain") is None
    assert ready["spec"].get("suspend") is False
    assert condition(ready, "QuotaPending") is None
    assert queue.ANNOTATION_PLACEMENT not in (ready["metadata"].get("annotations") or {})


async def test_a_failed_suspend_checkpoint_still_releases_the_quota_and_says_so(
    cluster: Cluster,
    kueue: devkueue.Kueue,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    local_queue(cluster, namespace)
    body = counter_set("stuck", storage_dir, tmp_path, policy={"prepareTimeoutSeconds": 2})
    container = body["spec"]["participants"][0]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    kubectl_apply(cluster, namespace, queued(body, LOW))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), WAIT, name="stuck")
    (tmp_path / "gate").touch()  # the participant never parks: the suspend checkpoint fails

    found = workload_of(cluster, namespace, "stuck")
    assert found is not None
    name = found["metadata"]["name"]
    # Kueue's own way to stop a workload: deactivate it (Kueue then evicts it).
    cluster.kubectl(
        "patch",
        "workloads.kueue.x-k8s.io",
        name,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"active":false}}',
    )

    def released(obj: dict[str, Any]) -> bool:
        found = condition(obj, "Preempted")
        return found is not None and "quota handed back to Kueue" in found.get("message", "")

    stopped = await resources.wait_set("quota handed back", released, WAIT, name="stuck")
    message = condition(stopped, "Preempted")["message"]  # type: ignore[index]
    assert "stuck-suspend-a1 failed" in message, message
    ckpt = await resources.checkpoint("stuck-suspend-a1")
    assert ckpt["status"]["phase"] == "Failed"
    pods = await resources.core.list_namespaced_pod(namespace)
    assert not [p for p in pods.items if p.status.phase not in ("Succeeded", "Failed")]
    workload = workload_of(cluster, namespace, "stuck")
    assert workload is not None
    assert kueue_condition(workload, "QuotaReserved")["status"] == "False"
    assert not (workload.get("status") or {}).get("admission")
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)[
        "items"
    ]
    assert any(e["reason"] == "QuotaReleased" and e["type"] == "Warning" for e in events), [
        e["reason"] for e in events
    ]
    print(f"Preempted: {message}", file=sys.stderr)
