"""The operator's checkpoint slots (`--max-concurrent-checkpoints`), through the checkpoint flow.

A checkpoint that finds every slot taken waits in phase Queued, saying why, and prepares only
once a slot is free, with its whole prepare timeout from then; it gives its slot back however
it ends. An Eviction checkpoint (the pod's grace period runs) never waits for a slot.

The API server (`testsupport.fakecluster`, below the real `Kube`), the set and the participant
are those of test_checkpoint_eviction (`testsupport.checkpointflow`).
"""

from __future__ import annotations

import time
from typing import cast

import anyio
import pytest
from rollout_operator.flows.checkpoint import CheckpointFlow
from rollout_operator.model import api
from rollout_protocol import HttpParticipantClient
from testsupport.checkpointflow import (
    CKPT,
    NS,
    PREPARE_TIMEOUT,
    NotParking,
    checkpoint_status,
    condition,
    evicted_pod,
    kept_to_its_own,
    mark_ready,
    set_cluster,
    whole_seconds,
)
from testsupport.fakecluster import FakeCluster

from devcluster.waiting import wait_for


def ready_set(trigger: str) -> FakeCluster:
    cluster = set_cluster(trigger, [])
    mark_ready(cluster)
    return cluster


def flow_over(
    cluster: FakeCluster, participant: NotParking, slots: anyio.Semaphore
) -> CheckpointFlow:
    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, participant)]

    return CheckpointFlow(cluster.kube(), participants_factory=participants, slots=slots)


async def test_a_checkpoint_waits_queued_for_a_slot_and_its_prepare_timeout_starts_then() -> None:
    cluster = ready_set("Manual")
    participant = NotParking()
    slots = anyio.Semaphore(1, max_value=1)
    await slots.acquire()  # another set's checkpoint holds the only slot
    phases: list[api.CheckpointPhase | None] = []

    async def run() -> None:
        phases.append(await flow_over(cluster, participant, slots).run(NS, CKPT))

    async with anyio.create_task_group() as group:
        group.start_soon(run)

        async def queued() -> bool:
            return bool(checkpoint_status(cluster).get("phase") == "Queued")

        await wait_for(queued, timeout=10, what="the checkpoint to queue for a slot")
        ready = condition(cluster, "Ready")
        assert ready["reason"] == "Queued"
        assert "one of the operator's 1 checkpoint slots" in ready["message"]
        assert "--max-concurrent-checkpoints" in ready["message"]
        assert participant.prepare_deadlines == [], "no prepare without a slot"
        released_at = time.time()
        slots.release()
    assert phases == [api.CheckpointPhase.FAILED]  # NotParking: the prepare timed out
    (deadline,) = participant.prepare_deadlines
    assert deadline >= released_at + PREPARE_TIMEOUT
    assert slots.value == 1, "the slot was given back"
    kept_to_its_own(cluster)


async def test_an_eviction_checkpoint_never_waits_for_a_slot() -> None:
    cluster = set_cluster("Eviction", [evicted_pod(whole_seconds(time.time() + 30))])
    participant = NotParking()
    slots = anyio.Semaphore(1, max_value=1)
    await slots.acquire()
    with anyio.fail_after(30):
        phase = await flow_over(cluster, participant, slots).run(NS, CKPT)
    assert phase is api.CheckpointPhase.FAILED
    assert len(participant.prepare_deadlines) == 1, "it prepared while every slot was taken"
    assert slots.value == 0, "it took no slot, so it gave none back"
    kept_to_its_own(cluster)


@pytest.mark.parametrize("trigger", ["Manual", "Interval"])
async def test_a_free_slot_is_taken_without_queueing(trigger: str) -> None:
    cluster = ready_set(trigger)
    participant = NotParking()
    slots = anyio.Semaphore(2, max_value=2)
    with anyio.fail_after(30):
        await flow_over(cluster, participant, slots).run(NS, CKPT)
    assert len(participant.prepare_deadlines) == 1
    assert all(c["reason"] != "Queued" for c in checkpoint_status(cluster)["conditions"])
    assert slots.value == 2
    kept_to_its_own(cluster)
