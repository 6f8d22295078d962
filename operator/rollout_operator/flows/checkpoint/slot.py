"""Phases Pending and Queued of the checkpoint flow: the slots a checkpoint waits for.

Two slots (docs/design.md#66-one-checkpoint-at-a-time): one of the operator's
`--max-concurrent-checkpoints` (an in-process semaphore; Eviction and Deadline checkpoints never
wait for it) and the set's Lease, taken only while the set is Ready (or, for an Eviction, while
its participants still answer). A checkpoint that waits says why in phase Queued. A restarted
operator that finds its checkpoint running holds the Lease already (`held_slot`, through
`joined`). Once the slot is held, `attach` gives the run its set, its coordinator and when the
slot was taken.
"""

from __future__ import annotations

from typing import Final

import anyio
from rollout_protocol import Coordinator, HttpParticipantClient, tracing

from ...cluster.objects import read_control_token
from ...model.api import (
    CheckpointConditionType,
    CheckpointPhase,
    ConditionStatus,
    RolloutCheckpoint,
    RolloutSet,
    SetConditionType,
    Trigger,
    namespace_or_default,
)
from ...model.conditions import find_condition
from ...model.reasons import Reason
from .context import (
    IN_FLIGHT,
    CheckpointContext,
    CheckpointFailed,
    CheckpointRun,
    enter_phase,
    http_participants,
    published,
    set_lost,
)

UNQUEUED_TRIGGERS: Final = frozenset({Trigger.EVICTION, Trigger.DEADLINE})
"""Checkpoints with a hard deadline of their own: never queued behind the operator's limit."""


async def take_slots(run: CheckpointRun, ckpt: RolloutCheckpoint) -> Coordinator:
    """The slots of a run that holds none yet (one of the operator's, then the set's Lease),
    then its set and coordinator (`attach`); a run in flight goes on with its own (`joined`)."""
    if not run.in_flight:
        context = run.context
        with tracing.span("slot"):
            run.holds_operator_slot = await take_operator_slot(context, ckpt)
            rset = await take_slot(context, ckpt)
        await attach(run, ckpt, rset)
    return await joined(run, ckpt)


async def joined(run: CheckpointRun, ckpt: RolloutCheckpoint) -> Coordinator:
    """The run's coordinator; a run that continues a running checkpoint (an operator restart)
    attaches to the slot it holds first (`held_slot`)."""
    if run.coordinator is None:
        await attach(run, ckpt, await held_slot(run.context, ckpt))
    assert run.coordinator is not None
    return run.coordinator


async def attach(run: CheckpointRun, ckpt: RolloutCheckpoint, rset: RolloutSet) -> None:
    """The run holds the set's slot: when it took it, when the checkpoint started, whether an
    earlier run took it, and the coordinator over the set's participants."""
    context = run.context
    namespace = namespace_or_default(ckpt.metadata.namespace)
    # The prepare starts when the checkpoint took the Lease: for a run that continues one whose
    # phase was never written (an operator restart within its first second), that is the
    # earlier run's start, and its prepare deadline is the same.
    held_since = context.leases.held_since(namespace, ckpt.spec.rollout_set, ckpt)
    run.slot_taken = slot_taken_at(held_since, ckpt, run.in_flight, context.clock())
    started = run.began
    if run.in_flight and ckpt.status.started_at is not None:
        started = min(started, ckpt.status.started_at.timestamp())
    run.started = min(started, run.slot_taken)
    # A Lease taken before this run began (a millisecond's margin for the Lease's microsecond
    # times) is an earlier run's: one that stopped before any phase was written (an operator
    # restart, a status write refused in an API outage).
    taken_earlier = held_since is not None and held_since < run.began - 0.001
    run.continued = ckpt.status.phase in IN_FLIGHT or taken_earlier
    run.participants = await participants_of(context, namespace, rset)
    run.coordinator = Coordinator(run.participants)
    run.attached = rset


def slot_taken_at(
    held_since: float | None, ckpt: RolloutCheckpoint, in_flight: bool, now: float
) -> float:
    """When the checkpoint took the set's Lease, which starts its prepare and pause: the
    Lease's `acquireTime` as this process knows it; for a run continued from a written phase
    without it, `startedAt` (whole seconds); else now (this run takes the Lease)."""
    if held_since is not None:
        return held_since
    if in_flight and ckpt.status.started_at is not None:
        return ckpt.status.started_at.timestamp()
    return now


async def participants_of(
    context: CheckpointContext, namespace: str, rset: RolloutSet
) -> list[HttpParticipantClient]:
    """The coordinator's clients: one per participant of the set, with its token."""
    token = await read_control_token(context.kube, namespace, rset.metadata.name)
    if token is None:
        raise CheckpointFailed(
            Reason.SET_NOT_READY,
            f"the control-token Secret of set {rset.metadata.name} is missing",
        )
    participants = (context.participants_factory or http_participants)(rset, token)
    if not participants:
        raise CheckpointFailed(
            Reason.SET_NOT_READY, f"set {rset.metadata.name} shows no participant address"
        )
    return participants


async def take_operator_slot(context: CheckpointContext, ckpt: RolloutCheckpoint) -> bool:
    """Wait, Queued, for one of the operator's checkpoint slots; True once one is held.

    Not for a checkpoint already running (an operator restart found it prepared: its
    participants are paused now) nor for one with a hard deadline (an evicted pod's grace
    period, a must-save-by time): those run at once, beside the limit."""
    slots = context.slots
    if slots is None or ckpt.spec.trigger in UNQUEUED_TRIGGERS:
        return False
    try:
        slots.acquire_nowait()
        return True
    except anyio.WouldBlock:
        pass
    limit = slots.max_value
    await enter_phase(
        context,
        ckpt,
        CheckpointPhase.QUEUED,
        condition=(
            CheckpointConditionType.READY,
            False,
            Reason.QUEUED,
            f"waiting for one of the operator's {limit} checkpoint slots "
            "(--max-concurrent-checkpoints, chart value operator.maxConcurrentCheckpoints): "
            "every one is running a checkpoint of some set",
        ),
    )
    await slots.acquire()
    return True


async def take_slot(context: CheckpointContext, ckpt: RolloutCheckpoint) -> RolloutSet:
    """Wait until the set is Ready and this checkpoint holds the set's Lease.

    The Lease survives an operator restart; a holder that is gone or finished is taken
    over (`leases`). Waiting is bounded by the set's prepare and restore timeouts; it wakes
    on the set's events (a recovery ending, a checkpoint finishing)."""
    kube, settings, clock = context.kube, context.settings, context.clock
    namespace = namespace_or_default(ckpt.metadata.namespace)
    me = ckpt.metadata.name
    deadline: float | None = None
    queued_reason = ""
    # `kubectl apply -f examples/` creates the checkpoint a moment before its set (files
    # apply in name order): a set that is missing is waited for, briefly.
    absent_until = clock() + settings.set_appear_seconds
    while True:
        raw = await kube.get_set(namespace, ckpt.spec.rollout_set)
        if raw is None:
            if clock() < absent_until:
                await anyio.sleep(settings.queue_poll_seconds)
                continue
            raise CheckpointFailed(
                Reason.SET_NOT_FOUND,
                f"RolloutSet {ckpt.spec.rollout_set!r} does not exist in namespace "
                f"{namespace!r}; create it first or fix spec.rolloutSet",
            )
        rset = RolloutSet.model_validate(raw)
        if deadline is None:
            timeout = rset.spec.checkpoint_policy.prepare_timeout_seconds
            deadline = clock() + timeout + rset.spec.recovery.restore_timeout_seconds
        wait_reason = why_wait(rset, ckpt.spec.trigger)
        if wait_reason is None:
            holder = await context.leases.take(rset, me, lease_seconds(context, rset))
            if holder is None:
                return rset
            wait_reason = f"checkpoint {holder} of set {rset.metadata.name} is running"
        if wait_reason != queued_reason:
            queued_reason = wait_reason
            await enter_phase(
                context,
                ckpt,
                CheckpointPhase.QUEUED,
                condition=(CheckpointConditionType.READY, False, Reason.QUEUED, wait_reason),
            )
        if clock() > deadline:
            raise CheckpointFailed(
                Reason.SET_NOT_READY,
                f"gave up waiting to start: {wait_reason}",
            )
        await kube.cache.wait_for_change(
            namespace, ckpt.spec.rollout_set, settings.queue_poll_seconds
        )


async def held_slot(context: CheckpointContext, ckpt: RolloutCheckpoint) -> RolloutSet:
    """After an operator restart in a running phase: the slot is still ours (nobody takes
    over a checkpoint that is not finished), so only check that the set and the attempt the
    checkpoint captures are still there."""
    raw = await context.kube.get_set(
        namespace_or_default(ckpt.metadata.namespace), ckpt.spec.rollout_set
    )
    if raw is None:
        raise CheckpointFailed(
            Reason.SET_NOT_FOUND,
            f"RolloutSet {ckpt.spec.rollout_set!r} was deleted while the checkpoint ran",
        )
    rset = RolloutSet.model_validate(raw)
    lost = set_lost(rset, ckpt.status.attempt)
    if lost is not None and not published(ckpt):
        raise CheckpointFailed(Reason.PARTICIPANT_LOST, lost)
    return rset


async def release_slot(context: CheckpointContext, ckpt: RolloutCheckpoint) -> None:
    await context.leases.release(
        namespace_or_default(ckpt.metadata.namespace), ckpt.spec.rollout_set, ckpt.metadata.name
    )


def lease_seconds(context: CheckpointContext, rset: RolloutSet) -> int:
    """The Lease's duration: the longest this checkpoint's steps may take, and a margin."""
    settings = context.settings
    return int(
        rset.spec.checkpoint_policy.prepare_timeout_seconds
        + settings.commit_timeout_seconds
        + settings.persist_timeout_seconds
        + settings.resume_timeout_seconds
        + settings.lease_margin_seconds
    )


def why_wait(rset: RolloutSet, trigger: Trigger = Trigger.MANUAL) -> str | None:
    """None when the checkpoint may start now; else why it waits (for the Queued message).

    An Eviction checkpoint runs while its pod terminates: that pod is unready (the set is
    not Ready) but its control plane answers until the grace period ends, and the recovery
    holds off until this checkpoint finished (`cluster.objects.eviction_holds`)."""
    status = rset.status
    if status.recovery is not None:
        return f"set {rset.metadata.name} is Recovering"
    suspended = find_condition(status.conditions, SetConditionType.SUSPENDED.value)
    if suspended is not None and suspended.status is ConditionStatus.TRUE:
        return f"set {rset.metadata.name} is Suspended"
    if trigger is Trigger.EVICTION:
        if not status.participants or not all(p.address for p in status.participants):
            return f"participants of set {rset.metadata.name} have no address"
        return None
    ready = find_condition(status.conditions, SetConditionType.READY.value)
    if ready is None or ready.status is not ConditionStatus.TRUE:
        return f"set {rset.metadata.name} is not Ready"
    if not status.participants or not all(p.ready and p.address for p in status.participants):
        return f"participants of set {rset.metadata.name} are not all Ready"
    return None
