"""The RolloutCheckpoint flow's driver (docs/design.md#61-checkpoint): the slot, the phase
table, and how a run ends.

The protocol itself is `rollout_protocol.Coordinator`; the flow adds what only an operator has:
the phase persisted in `status.phase`, so a restarted operator continues where the last one
stopped (the intermediate phases, Preparing and Committing, only once they last over a second:
before that a successor continues from the set's Lease, which names the checkpoint and when it
started, and from the participants, which replay prepare and commit; `context.UnwrittenPhases`);
one checkpoint per set at a time (the set's Lease, `leases.CheckpointLeases`); and publication
as one status patch (`Ready=True` with every participant's manifest). The flow writes only its
own checkpoint's status: the set's pass derives `latestCheckpoint`, the recent durations and the
pods' latest-checkpoint annotations from the checkpoints once this one is Ready
(docs/design.md#69-who-writes-the-sets-status).

`CheckpointFlow.run` takes the slots (`slot.py`), builds the coordinator and runs `PHASES` with
the runner the recovery shares (`flows/phases.py`): Pending `begin`, Preparing `prepare`,
Committing `commit`, Publishing `publish`, Resuming `resume`. Then it releases the slot and
writes Ready; a failure before publish aborts (every participant resumed) and writes Failed.

What the flow reads (its checkpoint, the set, the set's pods) comes from the watches
(`cache.ClusterCache`), and a step waits on the set's events, not on polls: the critical path
costs the Lease's take and release, the status writes and their Events.

Why continuing is safe: prepare, commit and restore replies are cached per checkpoint id by the
participants and replayed on retry, so repeating the step an operator died in returns what it
would have returned. If the participants' lease lapsed meanwhile they resumed by themselves,
the id is stale there, and the checkpoint ends Failed with a reason; it is never Ready unless
every commit (records fsynced, manifest written last) succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Final

import anyio
import anyio.abc
from rollout_protocol import Coordinator, HttpParticipantClient, tracing

from ...cluster.kube import Kube
from ...cluster.leases import CheckpointLeases
from ...cluster.objects import read_control_token
from ...model.api import CheckpointPhase, RolloutCheckpoint, RolloutSet, namespace_or_default
from ...model.reasons import Reason
from ..checkpointrepairs import repair_published_checkpoint
from ..phases import PhaseTable, run_phases
from ..state import CoordinatedPods
from .commit import commit, publish
from .context import (
    IN_FLIGHT,
    TERMINAL,
    CheckpointContext,
    CheckpointFailed,
    CheckpointRun,
    FlowSettings,
    OnTransition,
    UnwrittenPhases,
    abort,
    enter_phase,
    http_participants,
    logger,
    write_failed,
    write_status,
)
from .prepare import begin, prepare
from .resume import resume
from .slot import held_slot, release_slot, take_operator_slot, take_slot


def phase_of(run: CheckpointRun, ckpt: RolloutCheckpoint) -> CheckpointPhase | None:
    """The step to run next: the persisted phase, read with what this run did in memory.

    Committing and Publishing are persisted, but their steps need this run's prepare and commit
    outcomes: a run that continues in them (an operator restart) prepares again first, and the
    participants replay their replies. Resuming is the published checkpoint's only step left.
    """
    phase = ckpt.status.phase
    if phase in TERMINAL:
        return None
    if phase is CheckpointPhase.RESUMING:
        return None if run.resumed else CheckpointPhase.RESUMING
    if run.committed is not None:
        return CheckpointPhase.PUBLISHING
    if run.prepared is not None:
        return CheckpointPhase.COMMITTING
    if run.deadline_ts is None and not (run.continued and ckpt.status.deadline is not None):
        return CheckpointPhase.PENDING
    return CheckpointPhase.PREPARING


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


PHASES: Final = PhaseTable[CheckpointPhase, CheckpointRun, RolloutCheckpoint](
    steps=MappingProxyType(
        {
            CheckpointPhase.PENDING: begin,
            CheckpointPhase.PREPARING: prepare,
            CheckpointPhase.COMMITTING: commit,
            CheckpointPhase.PUBLISHING: publish,
            CheckpointPhase.RESUMING: resume,
        }
    ),
    phase_of=phase_of,
)
"""The checkpoint's phases and the step of each (Queued waits for the slot, before the table)."""


class CheckpointFlow:
    """Runs one RolloutCheckpoint to Ready or Failed; safe to start again after a crash."""

    def __init__(
        self,
        kube: Kube,
        *,
        settings: FlowSettings | None = None,
        clock: Callable[[], float] = time.time,
        on_transition: OnTransition | None = None,
        participants_factory: Callable[[RolloutSet, str], list[HttpParticipantClient]]
        | None = None,
        slots: anyio.Semaphore | None = None,
        leases: CheckpointLeases | None = None,
        coordinated: CoordinatedPods | None = None,
    ) -> None:
        """`slots`: the operator's checkpoints that may run at once, shared by every flow
        (`--max-concurrent-checkpoints`); None: no limit. `leases`: the per-set slots, shared
        by the process's flows (they remember the Leases they wrote). `coordinated`: the pods
        known to coordinate their workers (`OperatorState.coordinated_pods`); None: ask each
        checkpoint's participants."""
        settings = settings or FlowSettings()
        self._context = CheckpointContext(
            kube=kube,
            settings=settings,
            clock=clock,
            leases=leases or CheckpointLeases(kube, clock=clock),
            on_transition=on_transition,
            unwritten=UnwrittenPhases(seconds=settings.phase_write_seconds),
            coordinated=coordinated,
        )
        self._participants_factory = participants_factory or http_participants
        self._slots = slots

    async def _read(self, namespace: str, name: str) -> RolloutCheckpoint | None:
        obj = await self._context.kube.get_checkpoint(namespace, name)
        return None if obj is None else RolloutCheckpoint.model_validate(obj)

    async def run(
        self,
        namespace: str,
        name: str,
        *,
        abort_when_cancelled: Callable[[], bool] = lambda: True,
    ) -> CheckpointPhase | None:
        """Run the checkpoint to Ready or Failed, continuing from its persisted phase.

        The terminal phase is always the last write: the Kopf daemon running this flow is
        cancelled as soon as it sees a terminal phase, so the slot release must already be done
        by then.
        """
        ckpt = await self._read(namespace, name)
        if ckpt is None:
            return None
        if ckpt.status.phase in TERMINAL:
            return ckpt.status.phase
        # One trace per checkpoint: its id derives from the checkpoint's uid, so an operator
        # that continues this checkpoint after a restart adds its part to the same trace.
        with tracing.root_span(
            f"checkpoint {namespace}/{name}",
            key=f"checkpoint/{ckpt.metadata.uid or namespace + '/' + name}",
            attributes={
                "rollout.checkpoint": name,
                "rollout.namespace": namespace,
                "rollout.set": ckpt.spec.rollout_set,
                "rollout.trigger": ckpt.spec.trigger.value,
                "rollout.continued_from": (ckpt.status.phase or CheckpointPhase.PENDING).value,
            },
        ) as root:
            phase = await self._run(ckpt, abort_when_cancelled)
            if phase is not None:
                root.set_attribute("rollout.phase", phase.value)
            return phase

    async def _run(
        self, ckpt: RolloutCheckpoint, abort_when_cancelled: Callable[[], bool]
    ) -> CheckpointPhase | None:
        """`_drive` with a task group for the run's deferred phase writes
        (`context.UnwrittenPhases`), which ends with the run; its errors raised as they are."""
        phases: list[CheckpointPhase | None] = []
        errors: list[Exception] = []
        async with anyio.create_task_group() as writes:
            try:
                phases.append(await self._drive(ckpt, abort_when_cancelled, writes))
            except Exception as error:  # raised below, outside the task group's wrapping
                errors.append(error)
            finally:
                writes.cancel_scope.cancel()
        if errors:
            raise errors[0]
        return phases[0]

    async def _drive(
        self,
        ckpt: RolloutCheckpoint,
        abort_when_cancelled: Callable[[], bool],
        writes: anyio.abc.TaskGroup,
    ) -> CheckpointPhase | None:
        context = self._context
        kube = context.kube
        namespace = namespace_or_default(ckpt.metadata.namespace)
        # Running: in a running phase, or (its phases unwritten yet) holding the set's Lease as
        # this process took it, when an earlier run of this process stopped on an error.
        in_flight = ckpt.status.phase in IN_FLIGHT or (
            context.leases.held_since(namespace, ckpt.spec.rollout_set, ckpt) is not None
        )
        # A status reset by a user must never run a published checkpoint again (class 2).
        repaired = None
        if not in_flight:
            repaired = await repair_published_checkpoint(kube, context.leases, ckpt)
        if repaired is not None:
            status, repair = repaired
            await write_status(context, ckpt, status)
            if context.on_transition is not None:
                await context.on_transition(ckpt, repair.reason, repair.message)
            return ckpt.status.phase
        began = started = context.clock()
        if in_flight and ckpt.status.started_at is not None:
            started = min(started, ckpt.status.started_at.timestamp())
        coordinator: Coordinator | None = None
        participants: list[HttpParticipantClient] = []
        published = False
        holds_operator_slot = False
        try:
            with tracing.span("slot"):
                holds_operator_slot = await take_operator_slot(
                    context, self._slots, ckpt, in_flight
                )
                rset = await (held_slot(context, ckpt) if in_flight else take_slot(context, ckpt))
            # The prepare starts when the checkpoint took the Lease: for a run that continues
            # one whose phase was never written (an operator restart within its first second),
            # that is the earlier run's start, and its prepare deadline is the same.
            held_since = context.leases.held_since(namespace, ckpt.spec.rollout_set, ckpt)
            slot_taken = slot_taken_at(held_since, ckpt, in_flight, context.clock())
            started = min(started, slot_taken)
            # A Lease taken before this run began (a millisecond's margin for the Lease's
            # microsecond times) is an earlier run's: one that stopped before any phase was
            # written (an operator restart, a status write refused in an API outage).
            taken_earlier = held_since is not None and held_since < began - 0.001
            participants = await self._participants(namespace, rset)
            coordinator = Coordinator(participants)
            run = CheckpointRun(
                context,
                rset,
                coordinator,
                started=started,
                slot_taken=slot_taken,
                continued=ckpt.status.phase in IN_FLIGHT or taken_earlier,
                writes=writes,
            )
            await run_phases(PHASES, run, ckpt)
            published = True
            await release_slot(context, ckpt)
            await enter_phase(context, ckpt, CheckpointPhase.READY, completed_at=datetime.now(UTC))
        except anyio.get_cancelled_exc_class():
            # Deleted: participants must not stay paused until their leases lapse, and the
            # set's slot must be free for the next checkpoint. Bounded, so a hung participant
            # never holds the deletion.
            if coordinator is not None and not published and abort_when_cancelled():
                await self._abort_deleted(coordinator, ckpt)
            raise
        except CheckpointFailed as failed:
            published = published or ckpt.status.phase is CheckpointPhase.RESUMING
            await self._end_failed(coordinator, ckpt, failed, published=published)
        finally:
            if holds_operator_slot:
                assert self._slots is not None
                self._slots.release()
            for participant in participants:
                await participant.aclose()
        return ckpt.status.phase

    async def _participants(self, namespace: str, rset: RolloutSet) -> list[HttpParticipantClient]:
        """The coordinator's clients: one per participant of the set, with its token."""
        token = await read_control_token(self._context.kube, namespace, rset.metadata.name)
        if token is None:
            raise CheckpointFailed(
                Reason.SET_NOT_READY,
                f"the control-token Secret of set {rset.metadata.name} is missing",
            )
        participants = self._participants_factory(rset, token)
        if not participants:
            raise CheckpointFailed(
                Reason.SET_NOT_READY, f"set {rset.metadata.name} shows no participant address"
            )
        return participants

    async def _abort_deleted(self, coordinator: Coordinator, ckpt: RolloutCheckpoint) -> None:
        """A checkpoint deleted before it was published: every participant resumed, the slot
        freed and Failed written, bounded, shielded from the cancellation. (An operator that
        stops hands the checkpoint over instead: cancelled without aborting, see
        handlers/rolloutcheckpoint.py.)"""
        context = self._context
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(context.settings.abort_timeout_seconds + 5.0),
        ):
            logger.warning("checkpoint %s cancelled: aborting it", ckpt.metadata.name)
            await abort(context, coordinator, ckpt)
            await release_slot(context, ckpt)
            # Its id is stale on every participant now: it can never be published.
            await write_failed(
                context,
                ckpt,
                CheckpointFailed(
                    Reason.ABORTED,
                    "aborted before it was published (the checkpoint was deleted); "
                    "every participant was resumed",
                ),
            )

    async def _end_failed(
        self,
        coordinator: Coordinator | None,
        ckpt: RolloutCheckpoint,
        failed: CheckpointFailed,
        *,
        published: bool,
    ) -> None:
        """How a failed step ends the run: before publish, abort and write Failed; after it,
        Ready stays (records complete and published: never taken back)."""
        context = self._context
        if coordinator is not None and not published:
            await abort(context, coordinator, ckpt)
        await release_slot(context, ckpt)
        if published:
            logger.warning("checkpoint %s: %s", ckpt.metadata.name, failed.message)
            await enter_phase(context, ckpt, CheckpointPhase.READY, completed_at=datetime.now(UTC))
        else:
            await write_failed(context, ckpt, failed)
