"""Intermediate checkpoint phases are written only once they last over a second
(docs/design.md#61-checkpoint, `context.UnwrittenPhases`).

A fast checkpoint's status is written twice (published, then Ready), with the Published Event
only; a slow prepare still shows Preparing (and its Event) once the delay passed; and a
successor operator that finds the set's Lease its own but no phase written continues the
checkpoint with the start and prepare deadline the first run had, taken from the Lease. The API
server is `FakeCluster`, below the real `Kube`; the participant is `Scripted`.
"""

from __future__ import annotations

import time
from typing import Any, cast

import anyio
from rollout_operator.cluster.leases import lease_name, micro_time
from rollout_operator.decide.policy import parse_time
from rollout_operator.flows.checkpoint import CheckpointFlow, FlowSettings
from rollout_operator.model import api
from rollout_protocol import HttpParticipantClient, PrepareReply, PrepareRequest
from testsupport.checkpointflow import (
    CKPT,
    NS,
    PREPARE_TIMEOUT,
    SET,
    checkpoint_status,
    mark_ready,
    set_cluster,
    whole_seconds,
)
from testsupport.fakecluster import FakeCluster
from testsupport.scripted import Scripted

from devcluster.waiting import wait_for


class Held(Scripted):
    """A participant whose prepare waits for the test (`release`) and journals its deadlines."""

    def __init__(self, *, held: bool) -> None:
        super().__init__()
        self.release = anyio.Event()
        if not held:
            self.release.set()
        self.deadlines: list[float] = []

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self.deadlines.append(request.deadline_ts)
        with anyio.fail_after(10):
            await self.release.wait()
        return await super().prepare(request)


def flow(
    cluster: FakeCluster, participant: Scripted, events: list[str], *, delay: float = 1.0
) -> CheckpointFlow:
    async def posted(ckpt: api.RolloutCheckpoint, reason: str, message: str) -> None:
        events.append(reason)

    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, participant)]

    return CheckpointFlow(
        cluster.kube(),
        settings=FlowSettings(phase_write_seconds=delay),
        participants_factory=participants,
        on_transition=posted,
    )


def phases_written(cluster: FakeCluster) -> list[str]:
    return [
        str((r.body or {})["status"].get("phase"))
        for r in cluster.requests
        if r.verb == "patch" and r.plural == api.ROLLOUT_CHECKPOINT_PLURAL and r.subresource
    ]


def ready_cluster() -> FakeCluster:
    cluster = set_cluster("Manual", [])
    mark_ready(cluster)
    return cluster


async def test_a_fast_checkpoint_writes_its_status_twice_and_posts_one_event() -> None:
    cluster = ready_cluster()
    events: list[str] = []
    ended = await flow(cluster, Held(held=False), events).run(NS, CKPT)
    assert ended is api.CheckpointPhase.READY
    assert phases_written(cluster) == ["Resuming", "Ready"]
    assert events == ["Published"]
    status = checkpoint_status(cluster)
    # The published write carries what the unwritten phases set.
    assert status["attempt"] == 3
    assert status["startedAt"]
    assert status["deadline"]
    prepared = next(c for c in status["conditions"] if c["type"] == "Prepared")
    assert prepared["status"] == "True"


async def test_a_phase_that_lasts_is_written_with_its_event() -> None:
    cluster = ready_cluster()
    participant = Held(held=True)
    events: list[str] = []
    ended: list[api.CheckpointPhase | None] = []

    async def run() -> None:
        ended.append(await flow(cluster, participant, events, delay=0.05).run(NS, CKPT))

    async with anyio.create_task_group() as group:
        group.start_soon(run)

        async def preparing_shown() -> bool:
            return checkpoint_status(cluster).get("phase") == "Preparing"

        await wait_for(preparing_shown, timeout=10, what="Preparing written while it lasts")
        assert checkpoint_status(cluster)["attempt"] == 3
        assert "Preparing" in events
        participant.release.set()
    assert ended == [api.CheckpointPhase.READY]
    written = phases_written(cluster)
    assert written[0] == "Preparing"
    assert written[-2:] == ["Resuming", "Ready"]


async def test_a_successor_continues_from_the_lease_when_no_phase_was_written() -> None:
    """An operator that died within the checkpoint's first second left only the Lease; the
    next one starts and times the prepare from when the Lease was taken, not from now."""
    cluster = ready_cluster()
    taken = time.time() - 100
    lease: dict[str, Any] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": lease_name(SET), "namespace": NS},
        "spec": {
            "holderIdentity": CKPT,
            "leaseDurationSeconds": 600,
            "acquireTime": micro_time(taken),
            "renewTime": micro_time(taken),
        },
    }
    cluster.put(lease)
    participant = Held(held=False)
    ended = await flow(cluster, participant, []).run(NS, CKPT)
    assert ended is api.CheckpointPhase.READY
    (deadline,) = participant.deadlines
    assert abs(deadline - (taken + PREPARE_TIMEOUT)) < 1
    status = checkpoint_status(cluster)
    assert parse_time(status["startedAt"]) == whole_seconds(taken)
    assert cluster.count("create", "leases") == 0, "the Lease was its own already"
