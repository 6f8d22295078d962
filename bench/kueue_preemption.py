"""Kueue preemption of a RolloutSet against a plain `batch/v1` Job preempted the same way.

On a devcluster with the real Kueue controller (`devcluster.kueue`, `examples/kueue/queues.yaml`:
one GPU of quota, priorities `rollout-low` and `rollout-high`), each workload runs at low priority
on the GPU doing counted steps (one step per 50 ms per episode), then a high-priority Job that
needs the GPU is created; once that Job's pod runs it is let finish, and Kueue readmits the low
one. Measured, one run each:

- **preemption to GPU free**: from the preemptor's creation until its pod is Running (for the
  set this includes the suspend checkpoint and the release of its pods);
- **readmission to resumed**: from the preemptor's pod finishing until the low workload runs
  again (the set Ready under attempt 2, its counters restored; the Job's new pod Running);
- **steps redone**: the steps done before the preemption that have to be done again. The set's
  participant is `tests/e2e/policy_participant.py` (the real control plane over counters): what
  the suspend checkpoint restores is compared with where the counters stood. The Job is a shell
  loop counting the same steps into a file: a Job preempted by Kueue starts again from zero.

    python bench/kueue_preemption.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx
import yaml

from devcluster import kueue
from devcluster.cluster import Cluster
from devcluster.waiting import wait_for_sync
from harness.objects import apply_crds, create_namespace, kubectl_apply
from harness.operatorprocess import OperatorProcess

REPO: Final = Path(__file__).resolve().parents[1]
PARTICIPANT: Final = REPO / "tests" / "e2e" / "policy_participant.py"
QUEUES: Final = REPO / "examples" / "kueue" / "queues.yaml"
NAMESPACE: Final = "bench-kueue"
LOCAL_QUEUE: Final = "team-gpus"
EPISODES: Final = 3
RUN_BEFORE_S: Final = 5.0
"""How long the low workload runs before the preemptor comes (steps it would lose)."""
WAIT: Final = 120.0
T = TypeVar("T")


def wait(predicate: Callable[[], T | None], what: str) -> T:
    return wait_for_sync(predicate, WAIT, what, interval=0.1)


def get(cluster: Cluster, *args: str) -> dict[str, Any]:
    shown = cluster.kubectl("get", *args, "-n", NAMESPACE, "-o", "json", check=False)
    if shown.returncode != 0:
        return {}
    loaded: dict[str, Any] = json.loads(shown.stdout)
    return loaded


def labels(priority: str) -> dict[str, str]:
    return {"kueue.x-k8s.io/queue-name": LOCAL_QUEUE, "kueue.x-k8s.io/priority-class": priority}


def job(name: str, priority: str, script: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels(priority)},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "work",
                            "image": "unused.invalid/work",
                            "command": ["/bin/sh", "-c", script],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                }
            },
        },
    }


def counter_set(storage: Path, control: Path) -> dict[str, Any]:
    container = {
        "name": "counter",
        "image": "unused.invalid/counter",
        "command": [
            sys.executable,
            str(PARTICIPANT),
            "--control-dir",
            str(control),
            "--episodes",
            str(EPISODES),
        ],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    return {
        "apiVersion": "checkpoint.rollout.dev/v1alpha1",
        "kind": "RolloutSet",
        "metadata": {"name": "counters", "labels": labels("rollout-low")},
        "spec": {
            "participants": [
                {"role": "environment", "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {
                "path": str(storage),
                "volume": {"hostPath": {"path": str(storage), "type": "DirectoryOrCreate"}},
            },
        },
    }


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}


def pod_phase(cluster: Cluster, selector: str, phase: str) -> dict[str, Any] | None:
    pods = get(cluster, "pods", "-l", selector).get("items") or []
    return next((p for p in pods if p["status"].get("phase") == phase), None)


def preempt(cluster: Cluster, done: Path) -> tuple[float, float, float]:
    """Create the preemptor; returns (created, its pod Running, its pod finished) times."""
    script = f"while [ ! -e {done} ]; do sleep 0.05; done"
    created = time.monotonic()
    kubectl_apply(cluster, NAMESPACE, job("preemptor", "rollout-high", script))
    wait(lambda: pod_phase(cluster, "job-name=preemptor", "Running"), "the preemptor Running")
    running = time.monotonic()
    done.touch()
    wait(lambda: pod_phase(cluster, "job-name=preemptor", "Succeeded"), "the preemptor done")
    finished = time.monotonic()
    cluster.kubectl("delete", "job", "preemptor", "-n", NAMESPACE, "--wait=true")
    return created, running, finished


def total_steps(address: str) -> tuple[int, int]:
    state = httpx.get(f"{address}/state", timeout=5).json()
    return sum(state["steps"].values()), sum(state["restored_from"].values())


def measure_set(cluster: Cluster, root: Path) -> dict[str, float]:
    storage, control = root / "set-storage", root / "set-control"
    control.mkdir()
    kubectl_apply(cluster, NAMESPACE, counter_set(storage, control))

    def ready(attempt: int) -> dict[str, Any] | None:
        obj = get(cluster, "rset", "counters")
        ok = condition(obj, "Ready").get("status") == "True"
        return obj if ok and (obj.get("status") or {}).get("attempt") == attempt else None

    first = wait(lambda: ready(1), "the set Ready")
    address = first["status"]["participants"][0]["address"]
    time.sleep(RUN_BEFORE_S)  # the work the preemption may lose: a duration, not a wait
    before, _ = total_steps(address)
    created, running, finished = preempt(cluster, root / "set-done")
    resumed_obj = wait(lambda: ready(2), "the set Ready under attempt 2")
    resumed = time.monotonic()
    steps_now, restored = total_steps(resumed_obj["status"]["participants"][0]["address"])
    cluster.kubectl("delete", "rset", "counters", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    return {
        "gpu_free_s": running - created,
        "resumed_s": resumed - finished,
        "done_before": float(before),
        "redone": float(max(0, before - restored)),
        "restored": float(restored),
        "after": float(steps_now),
    }


def measure_job(cluster: Cluster, root: Path) -> dict[str, float]:
    counter = root / "job-steps"
    # EPISODES counters advanced every 50 ms, as the set's participant does; a restart begins at 0.
    script = (
        f"n=0; while true; do n=$((n+{EPISODES})); echo $n > {counter}.tmp; "
        f"mv {counter}.tmp {counter}; sleep 0.05; done"
    )
    kubectl_apply(cluster, NAMESPACE, job("plain", "rollout-low", script))
    wait(lambda: pod_phase(cluster, "job-name=plain", "Running"), "the plain Job Running")
    time.sleep(RUN_BEFORE_S)  # the work the preemption may lose: a duration, not a wait
    created, running, finished = preempt(cluster, root / "job-done")
    before = int(counter.read_text())

    def restarted() -> dict[str, Any] | None:
        return pod_phase(cluster, "job-name=plain", "Running")

    wait(restarted, "the plain Job running again")
    resumed = time.monotonic()
    cluster.kubectl("delete", "job", "plain", "-n", NAMESPACE, "--wait=true")
    return {
        "gpu_free_s": running - created,
        "resumed_s": resumed - finished,
        "done_before": float(before),
        "redone": float(before),
        "restored": 0.0,
        "after": 0.0,
    }


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="bench-kueue-"))
    started = time.monotonic()
    cluster = Cluster.start(root / "cluster")
    running_kueue: kueue.Kueue | None = None
    operator: OperatorProcess | None = None
    try:
        apply_crds(cluster)
        running_kueue = kueue.start(cluster)
        create_namespace(cluster, NAMESPACE)
        objects = [d for d in yaml.safe_load_all(QUEUES.read_text()) if d]
        for obj in objects:
            kubectl_apply(cluster, NAMESPACE, obj)
        operator = OperatorProcess(cluster.kubeconfig, [NAMESPACE], root / "operator.log")
        operator.start()
        operator.wait_live()
        rset = measure_set(cluster, root)
        plain = measure_job(cluster, root)
    finally:
        if operator is not None:
            operator.stop()
        if running_kueue is not None:
            running_kueue.stop()
        cluster.stop()
    print("Kueue preemption (one GPU of quota; a high-priority Job preempts a low-priority one)")
    print()
    print(f"| {'':<40} | {'RolloutSet':>12} | {'batch/v1 Job':>12} |")
    print(f"|{'-' * 42}|{'-' * 14}|{'-' * 14}|")
    rows = [
        ("preemption to GPU free (s)", "gpu_free_s", "{:.1f}"),
        ("readmission to resumed (s)", "resumed_s", "{:.1f}"),
        ("steps done before the preemption", "done_before", "{:.0f}"),
        ("steps redone after readmission", "redone", "{:.0f}"),
    ]
    for label, key, fmt in rows:
        print(f"| {label:<40} | {fmt.format(rset[key]):>12} | {fmt.format(plain[key]):>12} |")
    print()
    print(
        f"The set's suspend checkpoint restored {rset['restored']:.0f} steps "
        f"({EPISODES} episodes); the Job restarts from 0."
    )
    print(f"(bench took {time.monotonic() - started:.0f}s; logs in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
