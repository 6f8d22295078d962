"""A fault during a recovery is noticed at once (docs/operations.md#failure-modes, class 8).

The model pod is killed; its replacement becomes Ready and is frozen (SIGSTOP) before the
operator restores into it, so the restore call hangs; then the frozen replacement is killed
too. The recovery watches the pods of the attempt it restores into: it starts the next try as
soon as the replacement is lost (reason ReplacementPodLost), instead of after
`restoreTimeoutSeconds` (a call to a dead pod retries until its deadline).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    checkpoint_ready,
    condition,
    example_set,
    freeze,
    is_true,
    participants_by_role,
    pod_pids,
    thaw,
    wait_pod_ready,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.adversarial]  # fault timings

RESTORE_TIMEOUT_S = 150
"""A try that waited out its deadline would take this long; every wait below is far shorter."""


def fault_set(storage: Path) -> dict[str, Any]:
    rset = example_set(
        storage,
        spec={"recovery": {"restoreTimeoutSeconds": RESTORE_TIMEOUT_S, "maxRestarts": 3}},
    )
    for participant in rset["spec"]["participants"]:
        probe = participant["template"]["spec"]["containers"][0]["readinessProbe"]
        probe["failureThreshold"] = 600  # a frozen pod stays Ready: it is slow, not gone
        if participant["role"] == "environment":
            probe["initialDelaySeconds"] = 3  # no restore before the model is frozen
    return rset


async def test_a_replacement_lost_during_restoring_starts_the_next_try_at_once(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(fault_set(storage_dir)))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    await checkpoint_ready(cluster, resources, "base")

    model = participants_by_role(ready)["model"][0]
    assert await cluster.admin.kill_pod_async(namespace, model["pod"])
    replacement = "math-rl-model-0-a2"

    await wait_pod_ready(resources, replacement, 60)
    frozen = pod_pids(cluster, namespace, replacement)
    freeze(frozen)
    try:
        await resources.wait_set(
            "Restoring",
            lambda o: (o["status"].get("recovery") or {}).get("phase") == "Restoring",
            60,
        )
        assert await cluster.admin.kill_pod_async(namespace, replacement)
    finally:
        thaw(frozen)

    recovered = await resources.wait_set(
        "Ready under attempt 3",
        lambda o: o["status"].get("attempt") == 3 and is_true(o, "Ready"),
        RESTORE_TIMEOUT_S / 3,
    )
    assert recovered["status"]["lastRecovery"]["checkpoint"] == "base"
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    lost = [e for e in events["items"] if e["reason"] == "ReplacementPodLost"]
    assert lost, sorted({e["reason"] for e in events["items"]})
    assert replacement in lost[0]["message"]


async def test_a_replacement_lost_while_the_pods_start_is_replaced_at_once(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """The sibling of the Restoring case in the phase before it: a replacement pod killed
    while the new attempt's pods start (StartingPods; the environment's readiness probe waits
    3 s) ends the try at once; the next try restores the same checkpoint, long before
    `restoreTimeoutSeconds`."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(fault_set(storage_dir)))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    await checkpoint_ready(cluster, resources, "base")

    model = participants_by_role(ready)["model"][0]
    assert await cluster.admin.kill_pod_async(namespace, model["pod"])
    replacement = "math-rl-environment-0-a2"

    async def starting_and_running() -> bool:
        obj = await resources.rollout_set()
        if (obj["status"].get("recovery") or {}).get("phase") != "StartingPods":
            return False
        try:
            return bool(pod_pids(cluster, namespace, replacement))
        except AssertionError:  # not on the node yet, or no process yet
            return False

    await wait_for(starting_and_running, 60, f"{replacement} running during StartingPods")
    phase = ((await resources.rollout_set())["status"].get("recovery") or {}).get("phase")
    assert await cluster.admin.kill_pod_async(namespace, replacement)

    recovered = await resources.wait_set(
        "Ready under a later attempt",
        lambda o: (
            (o["status"].get("attempt") or 1) >= 2
            and o["status"].get("recovery") is None
            and is_true(o, "Ready")
        ),
        RESTORE_TIMEOUT_S / 3,
    )
    assert phase == "StartingPods", phase  # the kill landed in the phase under test
    last = recovered["status"]["lastRecovery"]
    assert last["checkpoint"] == "base", last
    assert "Traceback" not in operator.tail(400), operator.tail(60)


def crash_looping_set(storage: Path) -> dict[str, Any]:
    """One model server that turns Ready, then exits with code 3 four seconds after its first
    ready answer, every time (counted from Ready, not from the start, so a slow start on a busy
    machine does not turn the crash into a failure before Ready)."""
    server = [str(Path(sys.executable).parent / "rollout-server"), "model"]
    container = {
        "name": "model",
        "image": "unused.invalid/model",
        "command": ["python3", "-c", CRASH_AFTER_READY, *server],
        "args": ["--host", "$(POD_IP)", "--port", "8000"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
    }
    obj = example_set(storage, name="crashing")
    obj["spec"]["participants"] = [
        {"role": "model", "replicas": 1, "template": {"spec": {"containers": [container]}}}
    ]
    obj["spec"]["recovery"] = {"maxRestarts": 1, "windowSeconds": 600}
    return obj


CRASH_AFTER_READY = """
import os, subprocess, sys, time, urllib.request
server = subprocess.Popen(sys.argv[1:])
url = "http://" + os.environ["POD_IP"] + ":8000/healthz"
deadline = time.monotonic() + 120
while time.monotonic() < deadline and server.poll() is None:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            if reply.status == 200:
                break
    except OSError:
        time.sleep(0.1)  # poll interval while the server starts
time.sleep(4)  # the product under test: a server that dies seconds after it turned Ready
server.kill()
sys.exit(3)
"""


async def test_a_participant_that_keeps_crashing_stops_recovery_with_a_reason(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """maxRestarts 1: the first loss is recovered, the second too, the third stops recovery
    (Degraded, RecoveryLimitReached, naming the container and its exit code) instead of
    recovering without end; a new retry-recovery annotation value starts again."""
    obj = crash_looping_set(storage_dir)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))

    def held(o: dict[str, Any]) -> bool:
        degraded = condition(o, "Degraded") or {}
        return degraded.get("reason") == "RecoveryLimitReached"

    stopped = await resources.wait_set("RecoveryLimitReached", held, 120, name="crashing")
    message = (condition(stopped, "Degraded") or {})["message"]
    assert "model-0" in message
    assert "exited with code 3" in message
    assert "exceed recovery.maxRestarts (1)" in message
    assert not stopped["status"].get("recovery")
    attempt = stopped["status"]["attempt"]
    assert attempt == 3, "two recoveries ran (attempts 2 and 3), the third loss was held"
    ready = condition(stopped, "Ready") or {}
    assert ready.get("status") == "False"

    cluster.kubectl(
        "annotate",
        "rset",
        "crashing",
        "-n",
        namespace,
        "checkpoint.rollout.dev/retry-recovery=1",
        "--overwrite",
    )
    again = await resources.wait_set(
        "a recovery under a new attempt",
        lambda o: (o["status"].get("attempt") or 0) > attempt,
        60,
        name="crashing",
    )
    assert again["status"]["attempt"] > attempt
