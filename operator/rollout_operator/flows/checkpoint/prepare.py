"""Phases Pending (and Queued) and Preparing of the checkpoint flow: the prepare deadline, then
every participant parks its episodes at a boundary (docs/design.md#61-checkpoint, steps 2-3).

`begin` takes the slots (`slot.take_slots`, Queued written while they are busy), then fixes
the deadline (an Eviction's
is no later than the evicted pods' grace allows), refuses a set whose pods run unmanaged workers
before anything pauses and learns the prepare's stages from the waits the participants declared
(docs/design.md#44-order), and enters Preparing with the attempt, start time and deadline, written
only if the phase lasts over a second (`context.UnwrittenPhases`). Both count from when the
checkpoint took the set's Lease (`run.slot_taken`), so a successor that finds the Lease its own but
no phase written computes the same ones. `prepare` asks the participants to park, stage by
stage (`park`), and enters Committing; a restarted operator finds Preparing (or Committing,
whose step parks again: the participants replay their replies) and asks again against the
deadline in status.
"""

from __future__ import annotations

from datetime import UTC, datetime

from rollout_protocol import Coordinator, PrepareOutcome, prepare_stages, tracing

from ...decide.policy.eviction import PrepareDeadline, TerminatingPod, eviction_prepare_deadline
from ...decide.resources import set_selector
from ...decide.workers import unmanaged_workers
from ...model.api import (
    LABEL_ATTEMPT,
    CheckpointConditionType,
    CheckpointPhase,
    RolloutCheckpoint,
    Trigger,
    format_time,
    namespace_or_default,
)
from ...model.reasons import Reason
from .context import (
    CheckpointFailed,
    CheckpointRun,
    describe,
    enter_phase,
    failure_reason,
    while_set_holds,
)
from .slot import joined, take_slots


async def begin(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """Take the slots (Queued written while waiting), fix the prepare deadline, refuse
    unmanaged workers and learn the prepare's stages, and write Preparing."""
    coordinator = await take_slots(run, ckpt)
    rset = run.rset
    deadline = await prepare_deadline(run, ckpt)
    run.deadline_ts = deadline.at.timestamp()
    run.bound = bound = deadline.why
    if bound and run.deadline_ts <= run.now():
        raise CheckpointFailed(
            Reason.GRACE_PERIOD_TOO_SHORT,
            f"no time left to prepare: {bound}. Give participant pods a "
            "terminationGracePeriodSeconds that covers a checkpoint (the set's "
            "recentCheckpointSeconds); the recovery restores the latest Ready "
            "checkpoint instead",
        )
    await check_participants(run, coordinator)
    await enter_phase(
        run.context,
        ckpt,
        CheckpointPhase.PREPARING,
        defer=run.writes,
        condition=(
            CheckpointConditionType.PREPARED,
            False,
            Reason.PREPARING,
            f"parking episodes of attempt {rset.status.attempt} at boundaries "
            f"until {format_time(deadline.at)}" + (f" ({bound})" if bound else ""),
        ),
        attempt=rset.status.attempt,
        started_at=datetime.fromtimestamp(run.slot_taken, UTC).replace(microsecond=0),
        deadline=deadline.at.replace(microsecond=0),
    )
    return ckpt


async def prepare(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """Park every participant's episodes by the deadline, then enter Committing (written
    late, if at all: `context.UnwrittenPhases`)."""
    prepared = await park(run, ckpt)
    await enter_phase(
        run.context,
        ckpt,
        CheckpointPhase.COMMITTING,
        defer=run.writes,
        condition=(
            CheckpointConditionType.PREPARED,
            True,
            Reason.PREPARED,
            f"{prepared.episode_count} episode(s) parked, {len(prepared.restarts)} restart",
        ),
        restarts=len(prepared.restarts),
    )
    return ckpt


async def park(run: CheckpointRun, ckpt: RolloutCheckpoint) -> PrepareOutcome:
    """The prepare itself: what parked is `run.prepared`; a run that continues one (an
    operator restart in Preparing or Committing) asks again against the deadline in status,
    and the participants replay their replies."""
    coordinator = await joined(run, ckpt)
    if run.deadline_ts is not None:
        deadline_ts = run.deadline_ts
    elif ckpt.status.deadline is not None:
        deadline_ts = ckpt.status.deadline.timestamp()
    else:
        # A running phase without a deadline (a status written by hand): the one it would get.
        deadline_ts = (await prepare_deadline(run, ckpt)).at.timestamp()
    prepare_started = run.now()
    if run.continued:
        # An operator restart (or an API outage) mid-checkpoint: admission closed when
        # the first prepare began, so the pause counts from there (when the checkpoint took
        # the Lease, `run.slot_taken`), not from this run.
        prepare_started = min(prepare_started, run.slot_taken)
    # A deadline that passed while the operator was down: a prepare that completed then
    # is replayed at once; one that did not gets one more second, then times out.
    until = max(deadline_ts, run.now() + 1)
    with tracing.span("prepare"):
        outcome = await while_set_holds(
            run.context,
            ckpt,
            lambda: coordinator.prepare(
                ckpt.metadata.name, until, scope=ckpt.spec.episodes, stages=run.stages
            ),
        )
    run.prepare_seconds = run.now() - prepare_started
    if outcome.failures:
        reason = failure_reason(outcome.failures) or Reason.PREPARE_FAILED
        raise CheckpointFailed(reason, f"prepare failed: {describe(outcome.failures)}")
    if not outcome.ready:
        bound = run.bound
        raise CheckpointFailed(
            Reason.NOT_PARKED,
            f"{outcome.blocker_count} episode(s) were not parked at the prepare deadline "
            f"(stage {outcome.stopped_at}); first: "
            + ", ".join(str(e) for e in outcome.blockers[:5])
            + (
                f". The deadline was the eviction's: {bound}; a longer "
                "terminationGracePeriodSeconds gives episodes time to park"
                if bound
                else ""
            ),
            blockers=outcome,
        )
    run.prepared = outcome
    return outcome


async def prepare_deadline(run: CheckpointRun, ckpt: RolloutCheckpoint) -> PrepareDeadline:
    """`prepareTimeoutSeconds` from the start (when the checkpoint took the set's Lease); for
    an Eviction checkpoint no later than the evicted pods' grace period allows
    (`policy.eviction.eviction_prepare_deadline`). The pods are read now, not when the checkpoint
    was created: it may have queued, and a drain may have evicted more pods since."""
    rset = run.rset
    now = datetime.fromtimestamp(run.slot_taken, UTC)
    timeout = rset.spec.checkpoint_policy.prepare_timeout_seconds
    terminating: list[TerminatingPod] = []
    if ckpt.spec.trigger is Trigger.EVICTION:
        pods = await run.kube.list_pods(
            namespace_or_default(ckpt.metadata.namespace), set_selector(rset.metadata.name)
        )
        terminating = [t for t in (TerminatingPod.from_pod(p, LABEL_ATTEMPT) for p in pods) if t]
    return eviction_prepare_deadline(now, timeout, terminating, rset.status.attempt)


async def check_participants(run: CheckpointRun, coordinator: Coordinator) -> None:
    """Before anything is paused: fail when a pod runs workers nobody coordinates, and set the
    prepare's stages from the roles each participant said it waits on (`run.stages`,
    docs/design.md#44-order). A participant that does not answer its status is left to the
    prepare (it fails there) and counts as declaring nothing.

    Asked once per pod: the pods that answered are remembered with what they declared
    (`CoordinatedPods`), and a checkpoint whose participants are all known asks none of them
    (16 calls fewer per checkpoint of a 16-pod set)."""
    participants = run.rset.status.participants
    namespace = namespace_or_default(run.rset.metadata.namespace)
    coordinated = run.context.coordinated
    pods = [(p.pod, p.address or "") for p in participants]
    if coordinated is None or not coordinated.known(namespace, pods):
        outcome = await coordinator.status(run.now() + run.settings.abort_timeout_seconds)
        by_instance = {f"{p.role.value}-{p.index}": p.pod for p in participants}
        refused = unmanaged_workers(outcome.statuses, by_instance)
        if refused is not None:
            raise CheckpointFailed(Reason.UNMANAGED_WORKERS, refused)
        if coordinated is None:
            run.stages = coordinator.stages(outcome.statuses)
            return
        answered = {status.instance: status.waits_on for status in outcome.statuses}
        coordinated.remember(
            namespace,
            [
                (p.pod, p.address or "", answered[f"{p.role.value}-{p.index}"])
                for p in participants
                if f"{p.role.value}-{p.index}" in answered
            ],
        )
    run.stages = prepare_stages(
        (p.role, coordinated.waits_on(namespace, p.pod, p.address or "")) for p in participants
    )
