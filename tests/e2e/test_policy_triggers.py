"""Each checkpoint trigger on a real API server with the operator as a process: the interval
timer, the trainer-step annotation (on, and off), and a RolloutCheckpoint created directly."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from policy_support import (
    checkpoints_of,
    counter_set,
    create_checkpoint,
    manual_checkpoint,
    patch_set,
    wait_event,
    wait_ready,
    when,
)
from rollout_operator.model import api
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    is_true,
    kubectl_apply,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

SET = "counters"


async def test_interval_checkpoints_follow_each_other_and_never_overlap(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    interval = 2
    kubectl_apply(
        cluster,
        namespace,
        # keepLatest above what the test looks at: retention must not delete under its reads.
        counter_set(
            SET, storage_dir, tmp_path, policy={"intervalSeconds": interval, "keepLatest": 10}
        ),
    )

    async def three_ready() -> list[dict[str, Any]] | None:
        ready = [
            c
            for c in await checkpoints_of(resources, SET)
            if (c.get("status") or {}).get("phase") == "Ready"
        ]
        return ready if len(ready) >= 3 else None

    ready = await wait_for(three_ready, 90, "three interval checkpoints Ready", interval=0.2)
    for ckpt in ready:
        assert ckpt["spec"]["trigger"] == "Interval"
        assert ckpt["metadata"]["ownerReferences"][0]["name"] == SET
        manifest = ckpt["status"]["participants"][0]["manifest"]
        assert (storage_dir / manifest).is_file()
    for before, after in itertools.pairwise(ready):
        ended = when(before["status"]["completedAt"])
        started = when(after["metadata"]["creationTimestamp"])
        # Timestamps are whole seconds: the next one starts `interval` after the previous ended.
        assert (started - ended).total_seconds() >= interval - 1, (before, after)


async def test_trainer_step_annotation_creates_one_trainer_checkpoint_per_step(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    kubectl_apply(cluster, namespace, counter_set(SET, storage_dir, tmp_path))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 60, name=SET)
    for step in ("7", "7", "8"):
        await patch_set(
            resources, SET, {"metadata": {"annotations": {api.ANNOTATION_TRAINER_STEP: step}}}
        )
        ckpt = await wait_ready(resources, f"{SET}-step-{step}")
        assert ckpt["spec"] == {
            "rolloutSet": SET,
            "trigger": "TrainerCheckpoint",
            "trainerStep": int(step),
        }
    names = [c["metadata"]["name"] for c in await checkpoints_of(resources, SET)]
    assert names == [f"{SET}-step-7", f"{SET}-step-8"]
    rset = await resources.rollout_set(SET)
    assert rset["status"]["lastTrainerStep"] == 8


async def test_trainer_steps_off_make_no_checkpoint_and_a_direct_checkpoint_always_runs(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    policy = {"onTrainerCheckpoint": False, "intervalSeconds": 3600}
    kubectl_apply(cluster, namespace, counter_set(SET, storage_dir, tmp_path, policy=policy))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 60, name=SET)
    await patch_set(
        resources, SET, {"metadata": {"annotations": {api.ANNOTATION_TRAINER_STEP: "3"}}}
    )
    ignored = await wait_event(resources, SET, "TrainerStepIgnored")
    assert "onTrainerCheckpoint is false" in ignored["message"]
    await create_checkpoint(resources, manual_checkpoint("by-hand", SET))
    ckpt = await wait_ready(resources, "by-hand")
    assert ckpt["spec"]["trigger"] == "Manual"
    names = [c["metadata"]["name"] for c in await checkpoints_of(resources, SET)]
    assert names == ["by-hand"]
    assert "lastTrainerStep" not in (await resources.rollout_set(SET))["status"]
