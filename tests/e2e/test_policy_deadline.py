"""`mustSaveBy` on a real API server: the deadline checkpoint starts `saveReserveSeconds` early
and is Ready before the deadline, also after checkpoints got slower; a deadline wait that a
running checkpoint overtook saves nothing; `afterDeadline: Suspend` releases the pods and a later
deadline resumes the set from the deadline's checkpoint.

Every time compared is the resources' own (mustSaveBy as stored, creationTimestamp,
completedAt), never the test's clock; all are whole seconds, hence the one-second slack where a
start time is checked.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from policy_support import (
    WAIT,
    checkpoints_of,
    counter_set,
    create_checkpoint,
    in_seconds,
    manual_checkpoint,
    patch_set,
    wait_condition,
    wait_ready,
    when,
)
from rollout_operator.decide.policy.deadline import save_reserve_seconds
from rollout_operator.decide.policy.views import ANNOTATION_DEADLINE_OUTCOME
from rollout_protocol import read_records
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    is_true,
    kubectl_apply,
)

from devcluster.cluster import Cluster

SET = "walltime"


async def settled(resources: Resources, must_save_by: str) -> dict[str, Any]:
    """The deadline outcome the operator recorded for this mustSaveBy."""

    def recorded(obj: dict[str, Any]) -> bool:
        raw = (obj["metadata"].get("annotations") or {}).get(ANNOTATION_DEADLINE_OUTCOME)
        return raw is not None and json.loads(raw)["mustSaveBy"] == must_save_by

    obj = await resources.wait_set(f"deadline {must_save_by} settled", recorded, WAIT, name=SET)
    outcome: dict[str, Any] = json.loads(
        obj["metadata"]["annotations"][ANNOTATION_DEADLINE_OUTCOME]
    )
    return outcome


async def measured_reserve(resources: Resources, checkpoints: list[str]) -> int:
    """Take these manual checkpoints; return the reserve the operator derives from them."""
    for name in checkpoints:
        await create_checkpoint(resources, manual_checkpoint(name, SET))
        await wait_ready(resources, name)

    def measured(obj: dict[str, Any]) -> bool:
        status = obj.get("status") or {}
        durations = status.get("recentCheckpointSeconds") or []
        # Written by the policy pass that saw the last duration: until then it lags behind.
        return len(durations) >= len(checkpoints) and status.get(
            "saveReserveSeconds"
        ) == save_reserve_seconds(durations)

    obj = await resources.wait_set("saveReserveSeconds measured", measured, WAIT, name=SET)
    durations = obj["status"]["recentCheckpointSeconds"]
    reserve: int = obj["status"]["saveReserveSeconds"]
    assert reserve >= max(durations[-len(checkpoints) :]), obj["status"]
    return reserve


async def check_in_time(resources: Resources, must_save_by: str, reserve: int) -> dict[str, Any]:
    """The deadline's own checkpoint: started about `reserve` early, Ready before mustSaveBy."""
    outcome = await settled(resources, must_save_by)
    assert outcome["outcome"] == "Saved", outcome
    ckpt = await resources.checkpoint(outcome["checkpoint"])
    assert ckpt["spec"]["trigger"] == "Deadline"
    deadline = when(must_save_by)
    assert when(ckpt["status"]["completedAt"]) <= deadline, ckpt["status"]
    started = when(ckpt["metadata"]["creationTimestamp"])
    assert started >= deadline - timedelta(seconds=reserve + 1), (started, deadline, reserve)
    condition = await wait_condition(resources, SET, "DeadlineSaved", status="True")
    assert condition["reason"] == "Saved"
    assert outcome["checkpoint"] in condition["message"]
    return ckpt


async def test_deadline_checkpoint_lands_in_time_also_after_checkpoints_got_slower(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    policy = {"afterDeadline": "Continue"}
    kubectl_apply(cluster, namespace, counter_set(SET, storage_dir, tmp_path, policy=policy))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), WAIT, name=SET)
    fast = await measured_reserve(resources, ["fast-1", "fast-2"])

    must_save_by = in_seconds(fast + 6)
    await patch_set(resources, SET, {"spec": {"checkpointPolicy": {"mustSaveBy": must_save_by}}})
    waiting = await wait_condition(resources, SET, "DeadlineSaved", reason="Waiting")
    assert f"saveReserveSeconds {fast}" in waiting["message"]
    await check_in_time(resources, must_save_by, fast)

    (tmp_path / "park-delay").write_text("3")  # every prepare now takes three seconds
    slow = await measured_reserve(resources, ["slow-1", "slow-2"])
    assert slow > fast
    must_save_by = in_seconds(slow + 6)
    await patch_set(resources, SET, {"spec": {"checkpointPolicy": {"mustSaveBy": must_save_by}}})
    ckpt = await check_in_time(resources, must_save_by, slow)
    assert ckpt["status"]["durations"]["prepareSeconds"] >= 3


async def test_a_deadline_wait_overtaken_by_a_running_checkpoint_saves_nothing(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    policy = {"afterDeadline": "Continue"}
    kubectl_apply(cluster, namespace, counter_set(SET, storage_dir, tmp_path, policy=policy))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), WAIT, name=SET)
    reserve = await measured_reserve(resources, ["warm-1", "warm-2"])

    (tmp_path / "gate").touch()  # the next checkpoint parks until the gate opens
    await create_checkpoint(resources, manual_checkpoint("trainer-save", SET))
    await resources.wait_checkpoint(
        "trainer-save",
        "Preparing",
        lambda o: (o.get("status") or {}).get("phase") == "Preparing",
        WAIT,
    )
    must_save_by = in_seconds(reserve + 5)
    await patch_set(resources, SET, {"spec": {"checkpointPolicy": {"mustSaveBy": must_save_by}}})
    # The deadline's start time comes while trainer-save runs: the wait is overtaken.
    saving = await wait_condition(resources, SET, "DeadlineSaved", reason="Saving")
    assert "trainer-save" in saving["message"]
    (tmp_path / "gate").unlink()

    outcome = await settled(resources, must_save_by)
    assert outcome["outcome"] == "Saved"
    assert outcome["checkpoint"] == "trainer-save"
    ckpt = await resources.checkpoint("trainer-save")
    assert when(ckpt["status"]["completedAt"]) <= when(must_save_by)
    triggers = [c["spec"]["trigger"] for c in await checkpoints_of(resources, SET)]
    assert "Deadline" not in triggers, triggers


async def test_after_deadline_suspend_releases_pods_and_a_later_deadline_resumes(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    must_save_by = in_seconds(30)
    policy = {"mustSaveBy": must_save_by, "afterDeadline": "Suspend"}
    kubectl_apply(cluster, namespace, counter_set(SET, storage_dir, tmp_path, policy=policy))
    # No durations measured yet: the default reserve starts the deadline checkpoint at once; it
    # queues until the set is Ready.
    outcome = await settled(resources, must_save_by)
    assert outcome["outcome"] == "Saved", outcome
    saved = outcome["checkpoint"]
    suspended = await wait_condition(resources, SET, "Suspended", status="True")
    assert suspended["reason"] == "DeadlineReached"
    assert saved in suspended["message"]

    def released(obj: dict[str, Any]) -> bool:
        ready = [c for c in obj["status"]["conditions"] if c["type"] == "Ready"]
        return ready[0]["reason"] == "Suspended" and not is_true(obj, "Degraded")

    rset = await resources.wait_set("released (Ready=False Suspended)", released, WAIT, name=SET)
    assert rset["status"]["attempt"] == 1
    assert "recovery" not in rset["status"]
    pods = await resources.core.list_namespaced_pod(namespace)
    assert [p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None] == []

    ckpt = await resources.checkpoint(saved)
    folder = storage_dir / ckpt["status"]["participants"][0]["manifest"]
    _, records = read_records(folder.parent, expect_checkpoint_id=saved)
    recorded = {r.rollout_id: r.data["step"] for r in records}

    later = in_seconds(3600)
    await patch_set(resources, SET, {"spec": {"checkpointPolicy": {"mustSaveBy": later}}})
    resumed = await resources.wait_set(
        "resumed under attempt 2",
        lambda o: o["status"].get("attempt") == 2 and is_true(o, "Ready"),
        WAIT,
        name=SET,
    )
    assert not is_true(resumed, "Suspended")
    assert resumed["status"]["restarts"] == 0  # a resume is not a restart: nothing was lost
    address = resumed["status"]["participants"][0]["address"]
    async with httpx.AsyncClient() as http:
        state = (await http.get(address + "/state", timeout=10)).json()
    assert state["attempt"] == 2
    assert state["restored_from"] == recorded
