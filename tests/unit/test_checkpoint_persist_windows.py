"""Every window between a checkpoint's cut and Ready (docs/design.md#61-checkpoint, "Between
the cut and Ready"): the whole flow (`CheckpointFlow`) over the unit tests' fake API server
(`FakeCluster`, below the real `Kube`) with participants of canned replies (`Scripted`, which
hold the cut in memory until a persist, as this SDK's servers do).

Each test fails on a flow that persists before it resumes (the journal of calls says resume
came first and the status was not Ready while the persist ran), or on one that restores or
counts a checkpoint that is not Ready:

- an operator that restarts mid-persist: its successor asks the persist again (never the cut,
  stale once resumed) and publishes, or fails the checkpoint when a participant lost its
  records, discarding what the others hold;
- a pod lost while the checkpoint persists: the checkpoint fails (ParticipantLost) and the
  recovery's choice is the last Ready checkpoint, never the persisting one;
- a second checkpoint asked while one persists waits Queued until the first is Ready, so a
  participant holds one checkpoint's records at a time;
- the deadline checkpoint's reserve measures the cut and the persist, not the pause alone;
- retention and the set's latest checkpoint count Ready checkpoints only;
- storage that refuses (full, read-only) or hangs: the episodes were resumed first, the
  checkpoint ends Failed with a reason at its deadline, and the held records are discarded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import anyio
from rollout_operator.decide.policy.deadline import save_reserve_seconds
from rollout_operator.decide.policy.retention import retention
from rollout_operator.decide.policy.views import checkpoint_views
from rollout_operator.decide.setstatus import newest_ready
from rollout_operator.flows.checkpoint import CheckpointFlow, FlowSettings
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL
from rollout_operator.model.reasons import Reason
from rollout_protocol import ErrorCode, HttpParticipantClient
from testsupport import builders
from testsupport.checkpointflow import (
    CKPT,
    NS,
    SET,
    checkpoint_status,
    condition,
    mark_ready,
    set_cluster,
)
from testsupport.fakecluster import FakeCluster
from testsupport.scripted import Scripted

from devcluster.waiting import wait_for


def ready_cluster() -> FakeCluster:
    cluster = set_cluster("Manual", [])
    mark_ready(cluster)
    return cluster


def flow(
    cluster: FakeCluster,
    participant: Scripted,
    *,
    settings: FlowSettings | None = None,
    clock: Callable[[], float] = time.time,
) -> CheckpointFlow:
    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, participant)]

    return CheckpointFlow(
        cluster.kube(), settings=settings, clock=clock, participants_factory=participants
    )


def journal(participant: Scripted) -> list[str]:
    return [op for op, _ in participant.calls if op != "status"]


def in_persisting(cluster: FakeCluster) -> None:
    """The checkpoint as an operator that died mid-persist left it (its Lease lapsed with it)."""

    def write(obj: dict[str, Any]) -> None:
        obj["status"] = {
            "phase": "Persisting",
            "attempt": 3,
            "episodes": 1,
            "startedAt": api.format_time(api.datetime.now(api.UTC)),
            "durations": {"prepareSeconds": 0.01, "commitSeconds": 0.01, "pauseSeconds": 0.03},
        }

    cluster.update(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT, write)


async def test_the_episodes_resume_before_the_persist_and_nothing_is_ready_until_durable() -> None:
    cluster = ready_cluster()
    seen: list[dict[str, Any]] = []

    async def persisting() -> None:
        seen.append(checkpoint_status(cluster))

    participant = Scripted(holds=True, persisting=persisting)
    assert await flow(cluster, participant).run(NS, CKPT) is api.CheckpointPhase.READY
    assert journal(participant) == ["prepare", "commit", "resume", "persist"]
    (during,) = seen
    assert during["phase"] == "Persisting"
    assert "Ready" not in {c["type"] for c in during.get("conditions", [])}
    assert checkpoint_status(cluster)["phase"] == "Ready"


async def test_a_successor_finishes_a_checkpoint_its_predecessor_left_persisting() -> None:
    cluster = ready_cluster()
    in_persisting(cluster)
    participant = Scripted(holds=True)
    assert await flow(cluster, participant).run(NS, CKPT) is api.CheckpointPhase.READY
    assert journal(participant) == ["persist"], "never cut again: the id is stale once resumed"
    status = checkpoint_status(cluster)
    assert [p["instance"] for p in status["participants"]] == ["model-0"]
    assert status["durations"]["pauseSeconds"] == 0.03, "the predecessor's pause is kept"
    assert condition(cluster, "Ready")["status"] == "True"


async def test_a_successor_fails_a_checkpoint_whose_records_were_lost_mid_persist() -> None:
    cluster = ready_cluster()
    in_persisting(cluster)
    participant = Scripted(holds=True, persist_fails=ErrorCode.UNKNOWN_CHECKPOINT)
    assert await flow(cluster, participant).run(NS, CKPT) is api.CheckpointPhase.FAILED
    assert condition(cluster, "Failed")["reason"] == Reason.PARTICIPANT_LOST
    assert "discard" in journal(participant), "what the others hold is released"
    assert checkpoint_status(cluster)["participants"] == []


async def test_a_pod_lost_while_persisting_fails_it_and_the_recovery_takes_the_last_ready() -> None:
    cluster = ready_cluster()
    older = builders.checkpoint_body(
        "math-older", set_name=SET, namespace=NS, generation=1, trigger="Manual", status={}
    )
    older["status"] = {
        "phase": "Ready",
        "completedAt": "2026-01-01T00:00:00.000000Z",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Published",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    cluster.put(older)
    chosen: list[str | None] = []

    async def pod_lost() -> None:
        # The recovery starts now: it restores what `newest_ready` names.
        listed = cluster.list_objects(ROLLOUT_CHECKPOINT_PLURAL, NS)
        newest = newest_ready(checkpoint_views(listed))
        chosen.append(None if newest is None else newest.name)
        cluster.update(ROLLOUT_SET_PLURAL, NS, SET, lambda s: s["status"].update({"attempt": 4}))
        with anyio.fail_after(10):
            await anyio.sleep_forever()  # a persist to a pod that is gone: never answered

    participant = Scripted(holds=True, persisting=pod_lost)
    settings = FlowSettings(set_watch_seconds=0.05)
    assert await flow(cluster, participant, settings=settings).run(NS, CKPT) is (
        api.CheckpointPhase.FAILED
    )
    assert chosen == ["math-older"], "never the persisting checkpoint"
    assert condition(cluster, "Failed")["reason"] == Reason.PARTICIPANT_LOST
    assert journal(participant)[:4] == ["prepare", "commit", "resume", "persist"]
    listed = cluster.list_objects(ROLLOUT_CHECKPOINT_PLURAL, NS)
    newest = newest_ready(checkpoint_views(listed))
    assert newest is not None
    assert newest.name == "math-older"


async def test_a_second_checkpoint_asked_while_one_persists_waits_queued_until_it_is_ready() -> (
    None
):
    cluster = ready_cluster()
    second = "math-second"
    cluster.put(
        builders.checkpoint_body(
            second, set_name=SET, namespace=NS, generation=1, trigger="Manual", status={}
        )
    )
    kube = cluster.kube()

    async def second_queued() -> bool:
        raw = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, second) or {}
        status = raw.get("status") or {}
        return status.get("phase") == "Queued" and any(
            CKPT in c.get("message", "") for c in status.get("conditions", [])
        )

    async def persisting() -> None:
        if participant.called("persist") == [CKPT]:
            await wait_for(second_queued, timeout=10, what="the second checkpoint Queued")

    participant = Scripted(holds=True, persisting=persisting)

    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, participant)]

    ended: dict[str, api.CheckpointPhase | None] = {}
    settings = FlowSettings(queue_poll_seconds=0.05)
    first_flow = CheckpointFlow(kube, settings=settings, participants_factory=participants)
    second_flow = CheckpointFlow(kube, settings=settings, participants_factory=participants)

    async def run(checkpoint_flow: CheckpointFlow, name: str) -> None:
        ended[name] = await checkpoint_flow.run(NS, name)

    async with anyio.create_task_group() as group:
        group.start_soon(run, first_flow, CKPT)

        async def first_persisting() -> bool:
            return checkpoint_status(cluster).get("phase") == "Persisting"

        await wait_for(first_persisting, timeout=10, what="the first checkpoint persisting")
        group.start_soon(run, second_flow, second)
    assert ended == {CKPT: api.CheckpointPhase.READY, second: api.CheckpointPhase.READY}
    order = [(op, cid) for op, cid in participant.calls if op in ("persist", "prepare")]
    assert order == [("prepare", CKPT), ("persist", CKPT), ("prepare", second), ("persist", second)]


async def test_the_deadline_reserve_measures_the_cut_and_the_persist() -> None:
    cluster = ready_cluster()
    now = [time.time()]
    persist_seconds = 40.0

    async def slow_storage() -> None:
        now[0] += persist_seconds  # the persist takes 40 s of the flow's clock

    participant = Scripted(holds=True, persisting=slow_storage)
    ended = await flow(cluster, participant, clock=lambda: now[0]).run(NS, CKPT)
    assert ended is api.CheckpointPhase.READY
    durations = checkpoint_status(cluster)["durations"]
    assert durations["pauseSeconds"] < persist_seconds
    assert durations["persistSeconds"] >= persist_seconds
    assert durations["totalSeconds"] >= persist_seconds + durations["pauseSeconds"] - 0.01
    # The set's recent durations are the Ready checkpoints' totals; the reserve covers them.
    (view,) = checkpoint_views(cluster.list_objects(ROLLOUT_CHECKPOINT_PLURAL, NS))
    assert view.total_seconds is not None
    assert save_reserve_seconds([view.total_seconds]) >= persist_seconds


async def test_storage_that_refuses_fails_the_checkpoint_after_the_episodes_ran_on() -> None:
    cluster = ready_cluster()
    participant = Scripted(holds=True, persist_fails=ErrorCode.STORAGE_FAILED)
    assert await flow(cluster, participant).run(NS, CKPT) is api.CheckpointPhase.FAILED
    assert journal(participant)[:4] == ["prepare", "commit", "resume", "persist"]
    assert "discard" in journal(participant), "the held records are released"
    failed = condition(cluster, "Failed")
    assert failed["reason"] == Reason.PERSIST_FAILED
    assert "storage_failed" in failed["message"]


async def test_storage_that_hangs_fails_the_checkpoint_at_its_deadline() -> None:
    cluster = ready_cluster()

    async def hung() -> None:
        with anyio.fail_after(30):
            await anyio.sleep_forever()

    participant = Scripted(holds=True, persisting=hung)
    settings = FlowSettings(persist_timeout_seconds=0.1)
    assert await flow(cluster, participant, settings=settings).run(NS, CKPT) is (
        api.CheckpointPhase.FAILED
    )
    assert journal(participant)[:4] == ["prepare", "commit", "resume", "persist"]
    assert "discard" in journal(participant)
    failed = condition(cluster, "Failed")
    assert failed["reason"] == Reason.PERSIST_FAILED
    assert "within 0.1s after the resume" in failed["message"]


def test_retention_neither_counts_nor_deletes_a_persisting_checkpoint() -> None:
    def checkpoint(name: str, phase: str, completed: str | None) -> dict[str, Any]:
        body = builders.checkpoint_body(
            name, set_name=SET, namespace=NS, generation=1, trigger="Manual", status={}
        )
        ready = phase == "Ready"
        body["status"] = {"phase": phase}
        if completed is not None:
            body["status"]["completedAt"] = completed
        if ready:
            body["status"]["conditions"] = [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Published",
                    "message": "",
                    "lastTransitionTime": completed,
                }
            ]
        return body

    views = checkpoint_views(
        [
            checkpoint("a", "Ready", "2026-01-01T00:00:00Z"),
            checkpoint("b", "Ready", "2026-01-01T00:01:00Z"),
            checkpoint("c", "Persisting", None),
        ]
    )
    assert retention(views, keep_latest=1, protected=[]) == ["a"]
    newest = newest_ready(views)
    assert newest is not None
    assert newest.name == "b", "the latest is the newest Ready one, not the persisting one"
