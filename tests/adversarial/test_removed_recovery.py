"""Failure-mode class 2 (docs/operations.md#failure-modes) in the middle of a recovery:
`status.recovery` removed by hand (`kubectl patch --subresource=status`) while the recovery runs.

The pods of the new attempt exist then, but their episodes were never restored from the
checkpoint. The set pass's repair that writes back the attempt the running pods carry
(`setpass.repair_set_attempt`) must not adopt them (a set Ready with every restored episode
lost); the recovery's repair (`recovery.repair_unfinished_recovery`) starts the recovery again
from StoppingAttempt under a fresh attempt. A set that finished its recovery (`createdAttempt`,
`lastRecovery.attempt`) still has an attempt written by hand repaired from its pods.

The repairs run as each set pass runs them (`reconciler.plan_repairs`, in order) and the `Kube`
client runs for real; the API server below them is the unit
tests' `testsupport.fakecluster.FakeCluster` (status writes keep the resourceVersion
precondition) holding the set and its pods. The same fault on a
real API server, with the operator killed in Restoring, is in test_recovery_phase_faults.py.
"""

from __future__ import annotations

from typing import Any

from rollout_operator.cluster.statuswriter import PassStatus, SetStatusWriter
from rollout_operator.decide.setstatus import REPAIRED, Repair
from rollout_operator.flows.reconciler import plan_repairs
from rollout_operator.flows.recovery import RECOVERY_RESTARTED
from rollout_operator.flows.setpass import repair_set_attempt
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_SET_PLURAL
from rollout_operator.model.owners import StatusOwner
from testsupport.fakecluster import FakeCluster

NS = "team"
SET = "math"
ROLES = ("environment", "agent", "model", "resources")


def set_with_pods(obj: dict[str, Any], pod_attempt: int) -> FakeCluster:
    """An API server holding the set and its pods of `pod_attempt`, all Running and Ready."""
    cluster = FakeCluster()
    cluster.put(obj)
    for role in ROLES:
        cluster.put(running_pod(role, pod_attempt))
    return cluster


def set_status(cluster: FakeCluster) -> dict[str, Any]:
    """The set's status as stored in the API server."""
    obj = cluster.get(ROLLOUT_SET_PLURAL, NS, SET)
    assert obj is not None, "the set is gone"
    status: dict[str, Any] = obj["status"]
    return status


def stored_set(cluster: FakeCluster) -> api.RolloutSet:
    obj = cluster.get(ROLLOUT_SET_PLURAL, NS, SET)
    assert obj is not None, "the set is gone"
    return api.RolloutSet.model_validate(obj)


async def run_repairs(cluster: FakeCluster) -> Repair | None:
    """The set pass's repairs in their order over one read of the set, written as the pass
    writes them; the one repair that wrote (at most one may)."""
    obj = cluster.get(ROLLOUT_SET_PLURAL, NS, SET)
    assert obj is not None, "the set is gone"
    draft = PassStatus(obj)
    await plan_repairs(cluster.kube(), draft)
    await SetStatusWriter(cluster.kube(), StatusOwner.SET_PASS).write_pass(draft)
    repaired = [Repair(reason, message) for reason, message in draft.events]
    assert len(repaired) <= 1, repaired
    return repaired[0] if repaired else None


def running_pod(role: str, attempt: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{SET}-{role}-0-a{attempt}",
            "namespace": NS,
            "labels": {
                api.LABEL_SET: SET,
                api.LABEL_ROLE: role,
                api.LABEL_INDEX: "0",
                api.LABEL_ATTEMPT: str(attempt),
            },
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def rollout_set(status: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "c", "ports": [{"name": "control", "containerPort": 9000}]}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": SET, "namespace": NS, "uid": "u", "generation": 1},
        "spec": {
            "participants": [
                {"role": role, "template": {"spec": {"containers": [container]}}} for role in ROLES
            ],
            "storage": {"path": "/ckpt", "volume": {"emptyDir": {}}},
        },
        "status": status,
    }


LAST_RECOVERY = {
    "completedAt": "2026-11-29T12:00:00Z",
    "reason": "PodDeleted",
    "attempt": 2,
    "restorePolicy": "Recreate",
    "kept": 0,
    "replaced": 4,
    "durationSeconds": 20.0,
}


async def test_pods_of_an_unfinished_recovery_are_not_adopted_when_its_record_is_removed() -> None:
    """Attempt 1 lost a pod; the recovery created the pods of attempt 2 and was restoring into
    them when `status.recovery` was removed. Old code wrote `attempt: 2, createdAttempt: 2`
    from those pods: the set went Ready without a restore."""
    cluster = set_with_pods(rollout_set({"attempt": 1, "createdAttempt": 1}), pod_attempt=2)
    # The set pass's own repair leaves these pods to the recovery: it writes nothing.
    assert await repair_set_attempt(cluster.kube(), stored_set(cluster)) is None
    assert "recovery" not in set_status(cluster)
    repaired = await run_repairs(cluster)

    status = set_status(cluster)
    assert status["attempt"] == 1, status
    assert status["createdAttempt"] == 1, status
    recovery = status.get("recovery")
    assert recovery is not None, status
    assert recovery["phase"] == "StoppingAttempt"
    assert recovery["targetAttempt"] == 3  # a fresh attempt: no pod name of attempt 2 reused
    assert recovery["fromAttempt"] == 1
    assert recovery["restorePolicy"] == "Recreate"
    assert recovery["reason"] == RECOVERY_RESTARTED
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Recovering"]["status"] == "True"
    assert conditions["Recovering"]["reason"] == RECOVERY_RESTARTED
    assert repaired is not None
    assert repaired.reason == REPAIRED
    assert "never restored" in repaired.message
    assert "attempt 3" in repaired.message


async def test_a_finished_recoverys_attempt_written_back_by_hand_is_still_repaired() -> None:
    """The recovery to attempt 2 finished (lastRecovery says so); `attempt` and `createdAttempt`
    were then written back to 1 by hand: the pods are adopted, no recovery starts."""
    status = {"attempt": 1, "createdAttempt": 1, "lastRecovery": LAST_RECOVERY}
    cluster = set_with_pods(rollout_set(status), pod_attempt=2)
    repaired = await run_repairs(cluster)

    written = set_status(cluster)
    assert written["attempt"] == 2, written
    assert written["createdAttempt"] == 2, written
    assert "recovery" not in written
    assert repaired is not None
    assert repaired.reason == REPAIRED


async def test_an_attempt_written_above_the_running_pods_is_written_back() -> None:
    """The sibling the repair was built for: pods run attempt 2 (brought up completely), status
    says 3; written back to 2, no recovery."""
    cluster = set_with_pods(rollout_set({"attempt": 3, "createdAttempt": 2}), pod_attempt=2)
    repaired = await run_repairs(cluster)

    written = set_status(cluster)
    assert written["attempt"] == 2, written
    assert "recovery" not in written
    assert repaired is not None
