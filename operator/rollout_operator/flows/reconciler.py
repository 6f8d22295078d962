"""What the operator's daemons run: one wake of each per-set loop, and one checkpoint's run.

The Kopf daemons (`handlers/rolloutset.py` `reconcile_loop`, `handlers/policy.py`
`policy_loop`, `handlers/rolloutcheckpoint.py` `run_checkpoint`) only wire Kopf to these
functions; the order of the passes, and what a stop does to a checkpoint under way, are decided
here, where the flows they compose live (docs/design.md#60-layers, "Loops, not event handlers"):

- `set_pass`: the owners' repairs of a status written by hand (`SET_REPAIRS`: the recovery's
  `repair_unfinished_recovery` and `repair_false_recovery`, the set pass's
  `repair_set_attempt`), then the recovery (`recovery.recover_if_needed`), then the set's pass
  (`setpass.SetPass`), as the stages of one read and one write (`stagedpass`), in one task;
- `policy_pass`: the queue pass (`queuepass.QueuePass`), then the checkpoint policy's pass
  (`policypass.PolicyPass`), as the stages of one read and one write (`stagedpass`);
- `checkpoint_run`: a RolloutCheckpoint's flow (`checkpoint.CheckpointFlow`), and its stop:
  aborted when the checkpoint is deleted, handed over when the operator exits.

This module may import the five flows (it is not one of them: the import-linter contract keeps
only those independent of each other). The process's memory comes in as the `OperatorState`
(`flows/state.py`); Events are posted through the callables the handlers pass, so this module
needs no Kopf.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio

from ..cluster.kube import Kube
from ..cluster.leases import CheckpointLeases
from ..cluster.statuswriter import PassStatus, SetDelta
from ..cluster.storage import StorageLocator
from ..decide.policy.views import Note
from ..model.api import CheckpointPhase, RolloutCheckpoint, RolloutSet
from .checkpoint import CheckpointFlow
from .passloop import Next
from .policypass import PolicyPass
from .queuepass import QueuePass
from .recovery import (
    RecoveryLook,
    RecoveryWaits,
    recover_if_needed,
    repair_false_recovery,
    repair_unfinished_recovery,
)
from .setpass import SetPass, repair_set_attempt
from .stagedpass import PassStage, parsed, run_stages
from .state import OperatorState

logger = logging.getLogger(__name__)

WarningSink = Callable[[RolloutSet, str, str], None]
"""Posts a Warning Event (reason, message) on the set."""
TransitionSink = Callable[[RolloutSet, str, str, bool], Awaitable[None]]
"""Told of each recovery transition (reason, message, warning)."""
NoteSink = Callable[[RolloutSet, Note], Awaitable[None]]
"""Told of each policy or queue note, on every pass."""

SetRepair = Callable[[Kube, RolloutSet], Awaitable[SetDelta | None]]
"""A repair of the set's status (docs/design.md#610-status-written-by-hand): from the pass's
snapshot (as the repairs before it left it), the owner's delta that writes back what it
repairs, with its Event; None when there is nothing to repair."""

SET_REPAIRS: tuple[SetRepair, ...] = (
    repair_unfinished_recovery,
    repair_set_attempt,
    repair_false_recovery,
)
"""The repairs each set pass runs first, in this order, before anything acts on the status: a
recovery or a pass acting on an attempt no pod runs would start a second attempt beside the
first, and a recovery nobody lost a participant for would stop every running pod. The first two
look at pods of an attempt the status does not name (disjoint cases: above or within the last
attempt the set finished bringing up); the third at a recorded recovery."""


async def plan_repairs(kube: Kube, draft: PassStatus) -> None:
    """Add the repairs' deltas to the pass's status, in `SET_REPAIRS` order (each sees the
    set as the ones before it left it)."""
    for repair in SET_REPAIRS:
        delta = await repair(kube, draft.rset)
        if delta is not None:
            draft.add(delta)


class RepairsThenRecovery:
    """The first stage of the set's pass (`stagedpass`): the repairs' deltas (`SET_REPAIRS`),
    then, when none changed anything, one look by the recovery (`recovery.recover_if_needed`),
    which adds its step's changes to the pass's draft. A recovery that ran (started, or ran one
    phase) ends the pass's planning: the pass writes what it added, and the loop passes again at
    once (or, while its step waits, at the time it asks for) and goes on from it. Its `finish`
    posts the recovery's transitions, after the pass's write (and sends an ended recovery's
    trace root)."""

    def __init__(self, kube: Kube, *, on_transition: TransitionSink, waits: RecoveryWaits) -> None:
        self._kube = kube
        self._on_transition = on_transition
        self._waits = waits
        self._draft: PassStatus | None = None
        self.look = RecoveryLook(ran=False)

    async def plan(self, draft: PassStatus) -> bool:
        rset = parsed(draft)
        if rset is None:
            return True  # the set pass reports the invalid spec
        await plan_repairs(self._kube, draft)
        if draft.changed:
            return True
        self._draft = draft
        self.look = await recover_if_needed(self._kube, draft, waits=self._waits)
        return not self.look.ran

    async def finish(self) -> None:
        if self._draft is None:
            return
        written = self._draft.rset
        for reason, message, warn in self.look.transitions:
            await self._on_transition(written, reason, message, warn)
        for then in self.look.after_write:
            then()


async def set_pass(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    state: OperatorState,
    max_replicas_per_role: int,
    recovery_waits: RecoveryWaits,
    warned: set[tuple[str, str]],
    post_warning: WarningSink,
    on_transition: TransitionSink,
) -> Next:
    """One pass of the set's reconcile loop over one read of the set (`stagedpass.run_stages`):
    the repairs' deltas, then (when no repair changed anything) a look by the recovery, then
    the set pass (`setpass.SetPass`); one write sends every delta at once; the Events after
    the write.

    A repair ends its pass with the set pass (the next pass, at once, lets the recovery see the
    repaired status); a recovery that ran a step ends its pass too (its phase written by the
    pass, the next pass goes on from it: at once, or when its waiting step asked). `warned`
    holds the (reason, message) of the Warning Events the calling loop posted already: the set
    pass's warnings are posted once per loop, a repair's every time it repairs."""
    first = RepairsThenRecovery(kube, on_transition=on_transition, waits=recovery_waits)
    set_stage = SetPass(
        kube,
        owned_objects=state.owned_objects,
        latest_written=state.latest_written,
        max_replicas_per_role=max_replicas_per_role,
    )
    ran = await run_stages(kube, namespace, name, [first, set_stage])
    draft = ran.draft
    if draft is None:
        return Next()
    if first.look.ran:
        return Next(again=ran.again or draft.requeue, at=first.look.retry_at)
    outcome = set_stage.outcome
    shown = parsed(draft)
    if shown is not None and not ran.again:
        for reason, message in draft.events:
            post_warning(shown, reason, message)
        for reason, message in outcome.warnings:
            if (reason, message) not in warned:
                warned.add((reason, message))
                post_warning(shown, reason, message)
    times = [t for t in (outcome.recheck_at, first.look.retry_at) if t is not None]
    return Next(again=ran.again or draft.requeue, at=min(times) if times else None)


async def policy_pass(
    kube: Kube, namespace: str, name: str, *, state: OperatorState, on_note: NoteSink
) -> Next:
    """One pass of the set's policy loop over one read of the set and with one status write
    (`stagedpass.run_stages`): a Kueue-queued set's queue pass first (its admission or
    eviction becomes `spec.suspend`, which the policy pass acts on in the same pass; a set
    without the queue label is untouched), then the checkpoint policy's pass. Both wake the
    set's reconcile loop when it must create pods."""
    wake_set = state.set_loops.wake
    policy = PolicyPass(
        kube,
        logged_notes=state.logged_notes,
        on_note=on_note,
        wake_set=wake_set,
        locator=StorageLocator.from_env(),
    )
    stages: list[PassStage] = [QueuePass(kube, on_note=on_note, wake_set=wake_set), policy]
    outcome = await run_stages(kube, namespace, name, stages)
    decided = policy.plan_made
    wake_at = None if decided is None or outcome.again else decided.wake_at
    return Next(again=outcome.again, at=wake_at)


class CheckpointStop(Protocol):
    """What a checkpoint's run needs of its daemon's stop (Kopf's `stopped` kwarg): a wait for
    it, and why it came."""

    def wait(self) -> Awaitable[object]: ...

    @property
    def deleted(self) -> bool:
        """The checkpoint is being deleted: its flow is aborted at once."""
        ...

    @property
    def operator_exiting(self) -> bool:
        """The operator stops: its flow is handed over after `handover_seconds`."""
        ...


CheckpointTransitionSink = Callable[[RolloutCheckpoint, str, str], Awaitable[None]]
"""Posts the Event of a checkpoint's transition (the checkpoint, its reason, its message)."""


async def checkpoint_run(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    state: OperatorState,
    stop: CheckpointStop,
    handover_seconds: float,
    slots: anyio.Semaphore | None,
    leases: CheckpointLeases | None,
    on_transition: CheckpointTransitionSink,
) -> CheckpointPhase | None:
    """Run one RolloutCheckpoint's flow (`checkpoint.CheckpointFlow`) until it ends or its
    daemon is stopped; the one place that decides what a stop does to a flow under way:

    - the checkpoint deleted: the flow is cancelled at once and aborts (every participant
      resumed, the set's slot released, Failed with reason Aborted);
    - the operator exiting: the flow gets `handover_seconds` to finish, then is cancelled
      without an abort, its phase left for the next operator (one let go after its cut writes
      Resuming first: docs/design.md#68-the-operators-own-life);
    - any other stop (another operator took over through peering): the flow runs on until it
      ends, as before the stop.

    Returns the phase the flow ended in; None when it was aborted or handed over (or the
    checkpoint is gone). The flow's errors are raised as they are, for the daemon's retry."""
    flow = CheckpointFlow(
        kube,
        on_transition=on_transition,
        slots=slots,
        leases=leases,
        coordinated=state.coordinated_pods,
    )
    phases: list[CheckpointPhase | None] = []
    failures: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def cancel_when_stopped() -> None:
            await stop.wait()
            if stop.deleted:
                group.cancel_scope.cancel()
            elif stop.operator_exiting:
                await anyio.sleep(handover_seconds)  # the flow's own end cancels this first
                logger.info(
                    "checkpoint %s: the operator stops; left in its phase for the next one", name
                )
                group.cancel_scope.cancel()

        async def work() -> None:
            try:
                with state.checkpoints.flow_running(namespace, name):
                    phases.append(
                        await flow.run(namespace, name, abort_when_cancelled=lambda: stop.deleted)
                    )
            except Exception as error:  # raised below, outside the task group's wrapping
                failures.append(error)
            finally:
                group.cancel_scope.cancel()

        group.start_soon(cancel_when_stopped)
        group.start_soon(work)
    if failures:
        raise failures[0]
    if stop.deleted or not phases:
        return None  # aborted, or handed over (cancelled before the flow ended)
    return phases[0]


__all__ = [
    "SET_REPAIRS",
    "CheckpointStop",
    "CheckpointTransitionSink",
    "NoteSink",
    "RepairsThenRecovery",
    "SetRepair",
    "TransitionSink",
    "WarningSink",
    "checkpoint_run",
    "policy_pass",
    "set_pass",
]
