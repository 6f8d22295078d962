"""Intermediate checkpoint phases are written only once they last over a second
(docs/design.md#61-checkpoint, `context.UnwrittenPhases`).

A fast checkpoint's status is written twice (Persisting once the episodes resumed, then Ready),
with the Published Event only; a slow prepare still shows Preparing (and its Event) once the
delay passed; and a successor operator that finds the set's Lease its own but no phase written
continues the checkpoint with the start and prepare deadline the first run had, taken from the
Lease. A checkpoint whose publish write was refused (an API server restarting) after every
participant persisted is continued by the next run from Persisting (the participants replay
their durable reply), never cut again nor taken for a published one whose status was reset. The
API server is `FakeCluster`, below the real `Kube`; the participant is `Scripted`, committing
real records where a test needs them on storage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from rollout_operator.cluster.leases import lease_name, micro_time
from rollout_operator.cluster.rest import ApiError
from rollout_operator.decide.policy.views import parse_time
from rollout_operator.decide.resources import set_dir
from rollout_operator.flows.checkpoint import CheckpointFlow, FlowSettings
from rollout_operator.model import api
from rollout_protocol import (
    CommitReply,
    CommitRequest,
    HttpParticipantClient,
    PersistRequest,
    PrepareReply,
    PrepareRequest,
    checkpoint_base,
)
from rollout_protocol import _storage as storage
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
    cluster: FakeCluster,
    participant: Scripted,
    events: list[str],
    *,
    delay: float = 1.0,
    persist_timeout: float = 120.0,
) -> CheckpointFlow:
    async def posted(ckpt: api.RolloutCheckpoint, reason: str, message: str) -> None:
        events.append(reason)

    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, participant)]

    return CheckpointFlow(
        cluster.kube(),
        settings=FlowSettings(phase_write_seconds=delay, persist_timeout_seconds=persist_timeout),
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
    assert phases_written(cluster) == ["Persisting", "Ready"]
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
    assert written[-2:] == ["Persisting", "Ready"]


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


class Persisting(Scripted):
    """A participant that cuts in memory and, on persist, writes real records, fsynced, under
    the set's volume at `root` (asked again, it answers the manifest it wrote); `on_persist`
    runs after each write."""

    def __init__(self, root: Path, set_folder: str, on_persist: Callable[[], None]) -> None:
        super().__init__(parked=(), holds=True)
        self.root = root
        self.set_folder = set_folder
        self.on_persist = on_persist

    async def commit(self, request: CommitRequest) -> CommitReply:
        # The cut promises the manifest the persist will write (the coordinator checks it).
        reply = await super().commit(request)
        manifest = storage.write_records(
            self.root / "promised" / request.checkpoint_id,
            role=self.role,
            instance=self.instance,
            checkpoint_id=request.checkpoint_id,
            attempt=self.attempt,
        )
        return reply.model_copy(update={"manifest": manifest})

    async def persist(self, request: PersistRequest) -> CommitReply:
        reply = await super().persist(request)
        folder = checkpoint_base(self.root, self.set_folder, request.checkpoint_id)
        if not (folder / self.instance).is_dir():
            manifest = storage.write_records(
                folder / self.instance,
                role=self.role,
                instance=self.instance,
                checkpoint_id=request.checkpoint_id,
                attempt=self.attempt,
            )
            self.written = reply.model_copy(update={"manifest": manifest})
        self.on_persist()
        return self.written


@pytest.mark.parametrize("next_run", ["same operator", "successor operator"])
async def test_a_publish_refused_after_the_persist_is_continued_not_repaired(
    tmp_path: Path, next_run: str
) -> None:
    """The API server refuses the publish write for longer than the run rides out an outage
    (the persist timeout): every participant persisted, so all manifests are on storage, but
    nothing was published. The next run (this operator's, or a successor's with nothing in
    memory) continues it from Persisting: the persist asked again and published with its
    durations; never cut again (the id is stale once resumed), never repaired as a published
    checkpoint whose status was reset."""
    cluster = ready_cluster()

    def on_the_volume(obj: dict[str, Any]) -> None:
        obj["spec"]["storage"] = {"path": "/ckpt", "volume": {"hostPath": {"path": str(tmp_path)}}}

    cluster.update(api.ROLLOUT_SET_PLURAL, NS, SET, on_the_volume)
    raw_set = cluster.get(api.ROLLOUT_SET_PLURAL, NS, SET)
    assert raw_set is not None

    def refuse_the_publish() -> None:
        if len(participant.called("persist")) == 1:
            cluster.refuse(
                "patch",
                api.ROLLOUT_CHECKPOINT_PLURAL,
                status=503,
                message="restarting",
                name=CKPT,
                times=100,
            )

    participant = Persisting(
        tmp_path, set_dir(api.RolloutSet.model_validate(raw_set)), refuse_the_publish
    )
    events: list[str] = []
    first = flow(cluster, participant, events, persist_timeout=1.5)
    with pytest.raises(ApiError):
        await first.run(NS, CKPT)
    cluster.heal()
    assert [op for op, _ in participant.calls] == [
        "status",
        "prepare",
        "commit",
        "resume",
        "persist",
    ]
    assert checkpoint_status(cluster)["phase"] == "Persisting", "the publish was not written"
    assert (checkpoint_base(tmp_path, participant.set_folder, CKPT) / "model-0").is_dir()

    again = first if next_run == "same operator" else flow(cluster, participant, events)
    ended = await again.run(NS, CKPT)

    assert ended is api.CheckpointPhase.READY
    assert events == ["Published"], "continued and published, not repaired"
    assert participant.called("commit") == [CKPT], "never cut again"
    assert participant.called("persist") == [CKPT, CKPT]
    status = checkpoint_status(cluster)
    assert status["durations"]["pauseSeconds"] > 0
    assert status["durations"]["persistSeconds"] >= 0
    assert status["durations"]["totalSeconds"] >= status["durations"]["pauseSeconds"]
    assert [p["instance"] for p in status["participants"]] == ["model-0"]
    holder = (cluster.get("leases", NS, lease_name(SET)) or {}).get("spec", {})
    assert holder.get("holderIdentity") is None, "the slot was released"
