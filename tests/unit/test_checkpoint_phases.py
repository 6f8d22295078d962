"""The checkpoint flow's phase table, one step at a time (docs/design.md#61-checkpoint).

Each step is a function of a `CheckpointRun` and the checkpoint; these tests run one step over
the unit tests' fake API server (`testsupport.fakecluster`, below the real `Kube`) with a
participant of canned replies (`testsupport.scripted`), and check what the step wrote and which
calls it made. The whole flow over the same pieces is test_checkpoint_eviction and
test_checkpoint_slots.
"""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from rollout_operator.cluster.leases import CheckpointLeases
from rollout_operator.decide.policy.views import parse_time
from rollout_operator.flows.checkpoint import PHASES, CheckpointFailed, FlowSettings
from rollout_operator.flows.checkpoint.commit import commit
from rollout_operator.flows.checkpoint.context import CheckpointContext, CheckpointRun
from rollout_operator.flows.checkpoint.flow import phase_of
from rollout_operator.flows.checkpoint.persist import persist
from rollout_operator.flows.checkpoint.prepare import begin, prepare
from rollout_operator.flows.checkpoint.resume import resume
from rollout_operator.flows.phases import run_phases
from rollout_operator.flows.state import CoordinatedPods
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_SET_PLURAL, CheckpointPhase
from rollout_operator.model.reasons import Reason
from rollout_protocol import ErrorCode, HttpParticipantClient, Role
from testsupport.checkpointflow import (
    CKPT,
    NS,
    SET,
    checkpoint_status,
    condition,
    evicted_pod,
    mark_ready,
    set_cluster,
    whole_seconds,
)
from testsupport.fakecluster import FakeCluster
from testsupport.scripted import RECORDS_SHA256, Scripted


async def a_run(
    cluster: FakeCluster,
    participant: Scripted,
    *,
    in_flight: bool = False,
    coordinated: CoordinatedPods | None = None,
    others: tuple[Scripted, ...] = (),
) -> tuple[CheckpointRun, api.RolloutCheckpoint]:
    """A run of the flow over `CKPT` as the driver makes one: `in_flight` when it finds the
    checkpoint running (an operator restart); its participants are `participant` and
    `others` (those the set's status lists too: `with_participants`)."""
    kube = cluster.kube()
    context = CheckpointContext(
        kube=kube,
        settings=FlowSettings(),
        clock=time.time,
        leases=CheckpointLeases(kube),
        coordinated=coordinated,
        participants_factory=lambda rset, token: [
            cast(HttpParticipantClient, p) for p in (participant, *others)
        ],
    )
    ckpt = api.RolloutCheckpoint.model_validate(await kube.get_checkpoint(NS, CKPT))
    return CheckpointRun(context, began=time.time(), in_flight=in_flight), ckpt


def ready_cluster(trigger: str = "Manual") -> FakeCluster:
    cluster = set_cluster(trigger, [])
    mark_ready(cluster)
    return cluster


def in_phase(cluster: FakeCluster, phase: str, **status: object) -> None:
    """The checkpoint as an earlier run left it (an operator restart finds it so)."""

    def write(obj: dict[str, object]) -> None:
        obj["status"] = {"phase": phase, "attempt": 3, **status}

    cluster.update(api.ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT, write)


# --- the table --------------------------------------------------------------------------------


async def test_the_next_step_is_the_persisted_phase_and_every_phase_has_one() -> None:
    run, ckpt = await a_run(ready_cluster(), Scripted())
    assert phase_of(run, ckpt) is CheckpointPhase.PENDING, "no phase yet"
    for phase in CheckpointPhase:
        ckpt.status.phase = phase
        assert phase_of(run, ckpt) is phase, "only the persisted phase decides"
    assert set(PHASES.steps) == set(CheckpointPhase), "every phase has its step"
    assert {p.value for p in CheckpointPhase} == {
        "Pending",
        "Queued",
        "Preparing",
        "Committing",
        "Resuming",
        "Persisting",
        "Ready",
        "Failed",
    }, "Publishing is not a phase: the publish is one write (docs/design.md#61-checkpoint)"


async def test_the_table_runs_a_checkpoint_from_pending_to_ready() -> None:
    cluster = ready_cluster()
    participant = Scripted(holds=True)
    run, ckpt = await a_run(cluster, participant)
    assert await run_phases(PHASES, run, ckpt) is None
    assert ckpt.status.phase is CheckpointPhase.READY
    assert [op for op, _ in participant.calls] == [
        "status",
        "prepare",
        "commit",
        "resume",
        "persist",
    ]
    assert checkpoint_status(cluster)["phase"] == "Ready"
    assert condition(cluster, "Ready")["status"] == "True"


async def test_a_failed_step_ends_in_failed_through_the_table() -> None:
    cluster = ready_cluster()
    participant = Scripted(commit_fails=ErrorCode.STORAGE_FAILED)
    run, ckpt = await a_run(cluster, participant)
    assert await run_phases(PHASES, run, ckpt) is None
    assert checkpoint_status(cluster)["phase"] == "Failed"
    assert condition(cluster, "Failed")["reason"] == Reason.COMMIT_FAILED
    assert participant.called("resume") == [CKPT], "the abort resumed the participant"


async def test_a_restart_in_committing_parks_again_then_commits() -> None:
    """The prepare's outcome is not persisted: the Committing step of a run that continues one
    asks the participants again (they replay their reply) against the deadline in status."""
    cluster = ready_cluster()
    in_phase(cluster, "Committing", deadline=api.format_time(whole_seconds(time.time() + 60)))
    participant = Scripted()
    run, ckpt = await a_run(cluster, participant, in_flight=True)
    await commit(run, ckpt)
    assert [op for op, _ in participant.calls] == ["prepare", "commit"]
    assert checkpoint_status(cluster)["phase"] == "Resuming"
    assert "Ready" not in {c["type"] for c in checkpoint_status(cluster)["conditions"]}


# --- Pending: begin ---------------------------------------------------------------------------


async def test_begin_writes_preparing_with_the_attempt_start_and_deadline() -> None:
    cluster = ready_cluster()
    participant = Scripted()
    run, ckpt = await a_run(cluster, participant)
    await begin(run, ckpt)
    status = checkpoint_status(cluster)
    assert status["phase"] == "Preparing"
    assert status["attempt"] == 3
    assert run.deadline_ts is not None
    # prepareTimeoutSeconds from when the checkpoint took the set's Lease
    assert run.deadline_ts == pytest.approx(run.slot_taken + 300, abs=1e-3)
    assert parse_time(status["startedAt"]) == whole_seconds(run.slot_taken)
    assert parse_time(status["deadline"]) == whole_seconds(run.deadline_ts)
    assert condition(cluster, "Prepared")["reason"] == Reason.PREPARING
    assert participant.called("status") == [""], "unmanaged workers are refused first"
    assert not participant.called("prepare"), "begin parks nothing"


async def test_pods_that_said_they_coordinate_their_workers_are_not_asked_again() -> None:
    """A pod's servers cannot change for its life: the second checkpoint of the same pods
    asks none of them (docs/design.md#47-workers)."""
    cluster = ready_cluster()
    coordinated = CoordinatedPods()
    first = Scripted()
    run, ckpt = await a_run(cluster, first, coordinated=coordinated)
    await begin(run, ckpt)
    assert first.called("status") == [""]
    second = Scripted()
    run, ckpt = await a_run(cluster, second, coordinated=coordinated)
    await begin(run, ckpt)
    assert second.called("status") == [], "known: not asked again"

    def moved(obj: dict[str, Any]) -> None:
        obj["status"]["participants"][0]["address"] = "http://10.0.0.9:8000"

    cluster.update(api.ROLLOUT_SET_PLURAL, NS, SET, moved)  # another pod under that name
    third = Scripted()
    run, ckpt = await a_run(cluster, third, coordinated=coordinated)
    await begin(run, ckpt)
    assert third.called("status") == [""]


def with_participants(cluster: FakeCluster, *roles: Role) -> None:
    """The set's status lists a Ready participant of each of `roles` besides its model."""

    def add(obj: dict[str, Any]) -> None:
        obj["status"]["participants"] += [
            {
                "role": role.value,
                "index": 0,
                "pod": f"math-{role.value}-0-a3",
                "ready": True,
                "address": f"http://10.0.1.{n}:8000",
            }
            for n, role in enumerate(roles)
        ]

    cluster.update(api.ROLLOUT_SET_PLURAL, NS, SET, add)


async def test_begin_learns_the_prepare_stages_from_the_waits_the_pods_declared() -> None:
    """Roles nobody waits on are parked in one stage; what a pod declared is remembered with
    it, so a later checkpoint of the same pods has the same stages without asking; a pod that
    declared nothing keeps one role per stage (docs/design.md#44-order)."""
    cluster = ready_cluster()
    with_participants(cluster, Role.ENVIRONMENT)
    coordinated = CoordinatedPods()
    env, model = Scripted(Role.ENVIRONMENT, waits_on=()), Scripted(waits_on=())
    run, ckpt = await a_run(cluster, model, coordinated=coordinated, others=(env,))
    await begin(run, ckpt)
    assert run.stages == ((Role.ENVIRONMENT, Role.MODEL),)
    env, model = Scripted(Role.ENVIRONMENT, waits_on=()), Scripted(waits_on=())
    run, ckpt = await a_run(cluster, model, coordinated=coordinated, others=(env,))
    await begin(run, ckpt)
    assert env.called("status") == model.called("status") == [], "known: not asked again"
    assert run.stages == ((Role.ENVIRONMENT, Role.MODEL),), "remembered with the pods"
    await prepare(run, ckpt)
    assert env.called("prepare") == model.called("prepare") == [CKPT]

    env = Scripted(Role.ENVIRONMENT)  # an older SDK: says nothing
    run, ckpt = await a_run(cluster, Scripted(waits_on=()), others=(env,))
    await begin(run, ckpt)
    assert run.stages == ((Role.ENVIRONMENT,), (Role.MODEL,))


async def test_begin_refuses_an_eviction_with_no_grace_left() -> None:
    cluster = set_cluster("Eviction", [evicted_pod(whole_seconds(time.time() + 1), grace=1)])
    participant = Scripted()
    run, ckpt = await a_run(cluster, participant)
    with pytest.raises(CheckpointFailed) as failed:
        await begin(run, ckpt)
    assert failed.value.reason == Reason.GRACE_PERIOD_TOO_SHORT
    assert participant.calls == [], "nothing was asked of a participant"
    assert "phase" not in checkpoint_status(cluster), "nothing was written"


# --- Preparing --------------------------------------------------------------------------------


async def test_prepare_keeps_what_parked_and_writes_committing() -> None:
    """(Written at once here: a run without a task group for late writes; written late is
    test_checkpoint_unwritten_phases.)"""
    cluster = ready_cluster()
    participant = Scripted(parked=("r1", "r2"))
    run, ckpt = await a_run(cluster, participant)
    await begin(run, ckpt)
    await prepare(run, ckpt)
    assert run.prepared is not None
    assert run.prepared.episode_count == 2
    assert participant.called("prepare") == [CKPT]
    assert checkpoint_status(cluster)["phase"] == "Committing"
    assert condition(cluster, "Prepared")["status"] == "True"
    assert phase_of(run, ckpt) is CheckpointPhase.COMMITTING


async def test_a_continued_prepare_uses_the_deadline_and_start_in_status() -> None:
    cluster = ready_cluster()
    started = whole_seconds(time.time() - 30)
    deadline = whole_seconds(time.time() + 60)
    in_phase(
        cluster,
        "Preparing",
        startedAt=api.format_time(started),
        deadline=api.format_time(deadline),
    )
    participant = Scripted()
    run, ckpt = await a_run(cluster, participant, in_flight=True)
    assert phase_of(run, ckpt) is CheckpointPhase.PREPARING, "no second begin"
    await prepare(run, ckpt)
    assert run.prepare_seconds >= 30, "the pause counts from the first prepare"
    assert participant.called("status") == [], "begin did not run again"


async def test_a_prepare_with_a_blocker_fails_not_parked_with_the_blockers() -> None:
    cluster = ready_cluster()
    run, ckpt = await a_run(cluster, Scripted(blockers=("stuck",)))
    await begin(run, ckpt)
    with pytest.raises(CheckpointFailed) as failed:
        await prepare(run, ckpt)
    assert failed.value.reason == Reason.NOT_PARKED
    assert failed.value.blockers is not None
    assert [str(e) for e in failed.value.blockers.blockers] == ["stuck@3"]
    assert run.prepared is None


# --- Committing: commit and publish ----------------------------------------------------------


async def test_a_failed_commit_ends_the_flow_with_its_reason() -> None:
    cluster = ready_cluster()
    run, ckpt = await a_run(cluster, Scripted(commit_fails=ErrorCode.STORAGE_FAILED))
    await begin(run, ckpt)
    await prepare(run, ckpt)
    with pytest.raises(CheckpointFailed) as failed:
        await commit(run, ckpt)
    assert failed.value.reason == Reason.COMMIT_FAILED
    assert run.cut is not None
    assert not run.cut.ok


async def test_the_cut_enters_resuming_and_publishes_nothing() -> None:
    cluster = ready_cluster()
    participant = Scripted(parked=("r1", "r2"), holds=True)
    run, ckpt = await a_run(cluster, participant)
    for step in (begin, prepare):
        await step(run, ckpt)
    await commit(run, ckpt)
    assert participant.called("commit") == [CKPT]
    assert run.cut is not None
    assert run.cut.held == ["model-0"], "the records are held in memory, not durable"
    status = checkpoint_status(cluster)
    assert status["phase"] == "Resuming"
    assert status["episodes"] == 2
    assert status["durations"]["commitSeconds"] >= 0
    assert status["participants"] == [], "nothing is published before the persist"
    assert "Ready" not in {c["type"] for c in status["conditions"]}
    assert participant.called("resume") == participant.called("persist") == []


async def test_the_episodes_are_what_the_cut_says_its_records_hold() -> None:
    """A `/run` that reached the environment after its prepare replied is written by the cut:
    the checkpoint counts the cut's episodes, not the prepare's (docs/protocol.md, "Commit
    scope"); a participant that does not say (an older SDK) is counted from the prepare."""
    cluster = ready_cluster()
    environment = Scripted(Role.ENVIRONMENT, parked=("r1", "r2"), holds=True, committed=3)
    model = Scripted(parked=("r1",), holds=True, committed=1)
    run, ckpt = await a_run(cluster, environment, others=(model,))
    for step in (begin, prepare, commit):
        await step(run, ckpt)
    assert run.prepared is not None
    assert run.prepared.episode_count == 2
    assert checkpoint_status(cluster)["episodes"] == 3
    await resume(run, ckpt)
    await persist(run, ckpt)
    status = checkpoint_status(cluster)
    assert (status["phase"], status["episodes"]) == ("Ready", 3)

    older = ready_cluster()
    silent = Scripted(parked=("r1",), holds=True)
    run, ckpt = await a_run(older, environment, others=(silent,))
    for step in (begin, prepare, commit):
        await step(run, ckpt)
    assert checkpoint_status(older)["episodes"] == 2, "from the prepare: model-0 said nothing"


# --- Resuming and Persisting ------------------------------------------------------------------


async def test_resume_resumes_the_participants_counts_the_pause_and_writes_persisting() -> None:
    cluster = ready_cluster()
    in_phase(cluster, "Resuming", durations={"prepareSeconds": 1.5, "commitSeconds": 0.5})
    participant = Scripted(holds=True)
    run, ckpt = await a_run(cluster, participant, in_flight=True)
    assert phase_of(run, ckpt) is CheckpointPhase.RESUMING
    await resume(run, ckpt)
    assert participant.called("resume") == [CKPT]
    assert participant.called("persist") == []
    durations = ckpt.status.durations
    assert durations is not None
    assert durations.pause_seconds is not None
    assert durations.pause_seconds >= 2.0
    assert checkpoint_status(cluster)["phase"] == "Persisting"


async def test_resume_leaves_the_pods_of_a_lost_attempt_to_the_recovery() -> None:
    cluster = ready_cluster()
    participant = Scripted(holds=True)
    run, ckpt = await a_run(cluster, participant)
    for step in (begin, prepare, commit):
        await step(run, ckpt)
    cluster.update(ROLLOUT_SET_PLURAL, NS, SET, lambda s: s["status"].update({"attempt": 4}))
    run.rset.status.attempt = 4  # as the set's watch shows it
    await resume(run, ckpt)
    assert participant.called("resume") == []
    assert checkpoint_status(cluster)["phase"] == "Persisting", "the persist fails it"
    # A successor that finds it so fails it at once: its records are not durable.
    successor, ckpt = await a_run(cluster, participant, in_flight=True)
    with pytest.raises(CheckpointFailed) as failed:
        await persist(successor, ckpt)
    assert failed.value.reason == Reason.PARTICIPANT_LOST
    assert participant.called("persist") == []


async def test_persist_publishes_ready_in_one_write() -> None:
    cluster = ready_cluster()
    participant = Scripted(parked=("r1", "r2"), holds=True)
    run, ckpt = await a_run(cluster, participant)
    for step in (begin, prepare, commit, resume):
        await step(run, ckpt)
    written = len(cluster.requests)
    await persist(run, ckpt)
    assert participant.called("persist") == [CKPT]
    writes = [r for r in cluster.requests[written:] if r.verb != "get" and r.plural != "leases"]
    assert len(writes) == 1, writes
    status = checkpoint_status(cluster)
    assert status["phase"] == "Ready"
    assert status["episodes"] == 2
    (published,) = status["participants"]
    assert published["instance"] == "model-0"
    assert published["recordsSha256"] == RECORDS_SHA256
    assert condition(cluster, "Committed")["status"] == "True"
    assert condition(cluster, "Ready")["reason"] == Reason.PUBLISHED
    durations = status["durations"]
    assert {"prepareSeconds", "commitSeconds", "pauseSeconds", "persistSeconds"} <= set(durations)
