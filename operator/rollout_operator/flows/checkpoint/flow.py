"""The RolloutCheckpoint flow's driver (docs/design.md#61-checkpoint): the slot, the phase
table, and how a run ends.

The protocol itself is `rollout_protocol.Coordinator`; the flow adds what only an operator has:
the phase persisted in `status.phase`, so a restarted operator continues where the last one
stopped (the intermediate phases, Preparing to Persisting, only once they last over a second:
before that a successor continues from the set's Lease, which names the checkpoint and when it
started, and from the participants, which replay prepare and the cut; `context.UnwrittenPhases`);
one checkpoint per set at a time (the set's Lease, `leases.CheckpointLeases`, held until the
records are durable); and publication as one status patch (`Ready=True` with every
participant's durable manifest). The flow writes only its
own checkpoint's status: the set's pass derives `latestCheckpoint`, the recent durations and the
pods' latest-checkpoint annotations from the checkpoints once this one is Ready
(docs/design.md#69-who-writes-the-sets-status).

`CheckpointFlow.run` runs `PHASES` with the runner the recovery shares (`flows/phases.py`); the
next step is the persisted phase alone (`phase_of`), and each step writes the phase that
follows it: Pending and Queued `begin` (the slots, `slot.py`; Queued while they are busy, then
Preparing), Preparing `prepare` (Committing), Committing `commit` (the cut: Resuming),
Resuming `resume` (Persisting), Persisting `persist` (the publish: Ready, after the slot's
release), Ready and Failed `finished`. A failed step ends in `end_failed`: before publish it
aborts (every participant resumed, a held cut discarded) and writes Failed.

What the flow reads (its checkpoint, the set, the set's pods) comes from the watches
(`cache.ClusterCache`), and a step waits on the set's events, not on polls: the critical path
costs the Lease's take and release, the status writes and their Events.

Why continuing is safe: prepare, commit and restore replies are cached per checkpoint id by the
participants and replayed on retry, so repeating the step an operator died in returns what it
would have returned. If the participants' lease lapsed meanwhile they resumed by themselves,
the id is stale there, and the checkpoint ends Failed with a reason. After the resume the cut
cannot be asked again (the id is stale), so an operator that stops after the cut writes
Resuming (entered in memory only) before it lets the checkpoint go (`_hand_over_resuming`),
and its successor resumes and persists instead of preparing again. The persist can be asked
again: a participant answers its durable reply again, or says it lost the records, and the
checkpoint fails. It is never Ready unless every participant's records are durable (records
fsynced, manifest written last).
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

from ...cluster.kube import ApiError, Conflict, Kube
from ...cluster.leases import CheckpointLeases
from ...model.api import CheckpointPhase, RolloutCheckpoint, RolloutSet, namespace_or_default
from ...model.reasons import Reason
from ..checkpointrepairs import repair_published_checkpoint
from ..phases import FailureHandler, PhaseTable, run_phases
from ..state import CoordinatedPods
from .commit import commit
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
    logger,
    published,
    write_failed,
    write_status,
)
from .persist import persist
from .prepare import begin, prepare
from .resume import resume
from .slot import release_slot


def phase_of(run: CheckpointRun, ckpt: RolloutCheckpoint) -> CheckpointPhase:
    """The step to run next: the checkpoint's phase as persisted (or, for Preparing and
    Committing, entered to be written late: `context.UnwrittenPhases`); none yet is Pending."""
    return ckpt.status.phase or CheckpointPhase.PENDING


async def finished(run: CheckpointRun, ckpt: RolloutCheckpoint) -> None:
    """Ready and Failed: nothing is left to run."""
    return None


async def end_failed(
    run: CheckpointRun, ckpt: RolloutCheckpoint, error: Exception
) -> RolloutCheckpoint:
    """How a failed step (`CheckpointFailed`) ends the run: before publish, abort (every
    participant resumed, a held cut discarded) and write Failed; a published checkpoint stays
    Ready (records complete and published: never taken back). The set's slot is released
    either way."""
    assert isinstance(error, CheckpointFailed)
    context = run.context
    if published(ckpt):
        await release_slot(context, ckpt)
        logger.warning("checkpoint %s: %s", ckpt.metadata.name, error.message)
        await enter_phase(context, ckpt, CheckpointPhase.READY, completed_at=datetime.now(UTC))
        return ckpt
    if run.coordinator is not None:
        await abort(context, run.coordinator, ckpt, cut=run.cut)
    await release_slot(context, ckpt)
    await write_failed(context, ckpt, error)
    return ckpt


PHASES: Final = PhaseTable[CheckpointPhase, CheckpointRun, RolloutCheckpoint](
    steps=MappingProxyType(
        {
            CheckpointPhase.PENDING: begin,
            CheckpointPhase.QUEUED: begin,
            CheckpointPhase.PREPARING: prepare,
            CheckpointPhase.COMMITTING: commit,
            CheckpointPhase.RESUMING: resume,
            CheckpointPhase.PERSISTING: persist,
            CheckpointPhase.READY: finished,
            CheckpointPhase.FAILED: finished,
        }
    ),
    phase_of=phase_of,
    on_failure=FailureHandler(CheckpointFailed, end_failed),
)
"""The checkpoint's phases and the step of each; each step writes the phase that follows it
(Pending and Queued: Queued while the slots are busy, then Preparing; Preparing: Committing;
Committing, the cut: Resuming; Resuming: Persisting; Persisting: Ready, the publish), and a
failed step ends in Failed (`end_failed`)."""


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
            participants_factory=participants_factory,
            slots=slots,
        )

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
        namespace = namespace_or_default(ckpt.metadata.namespace)
        # Running: in a running phase, or (its phases unwritten yet) holding the set's Lease as
        # this process took it, when an earlier run of this process stopped on an error.
        in_flight = ckpt.status.phase in IN_FLIGHT or (
            context.leases.held_since(namespace, ckpt.spec.rollout_set, ckpt) is not None
        )
        # A status reset by a user must never run a published checkpoint again (class 2).
        repaired = None
        if not in_flight:
            repaired = await repair_published_checkpoint(context.kube, context.leases, ckpt)
        if repaired is not None:
            status, repair = repaired
            await write_status(context, ckpt, status)
            if context.on_transition is not None:
                await context.on_transition(ckpt, repair.reason, repair.message)
            return ckpt.status.phase
        run = CheckpointRun(context, began=context.clock(), in_flight=in_flight, writes=writes)
        try:
            await run_phases(PHASES, run, ckpt)
        except anyio.get_cancelled_exc_class():
            if abort_when_cancelled():
                # Deleted: participants must not stay paused until their leases lapse, and the
                # set's slot must be free for the next checkpoint. Bounded, so a hung
                # participant never holds the deletion.
                if run.coordinator is not None and not published(ckpt):
                    await self._abort_deleted(run, run.coordinator, ckpt)
            elif ckpt.status.phase is CheckpointPhase.RESUMING:
                await self._hand_over_resuming(ckpt)
            raise
        finally:
            if run.holds_operator_slot:
                assert context.slots is not None
                context.slots.release()
            for participant in run.participants:
                await participant.aclose()
        return ckpt.status.phase

    async def _hand_over_resuming(self, ckpt: RolloutCheckpoint) -> None:
        """The operator stops (its flow let go without an abort) after the cut, in phase
        Resuming, which was entered in memory only (written late, `context.UnwrittenPhases`):
        the resume may already have reached the participants, and their checkpoint id is
        spent then, so a successor that found the phase before it (Committing, or none) and
        prepared again would be refused the id as stale and fail a checkpoint whose cut every
        participant holds. Resuming is written now, shielded and bounded, and the successor
        resumes (a resume of a spent id is answered) and persists the held cut
        (docs/design.md#68-the-operators-own-life)."""
        context = self._context
        name = ckpt.metadata.name
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(context.settings.handover_write_seconds) as bounded,
        ):
            try:
                await write_status(context, ckpt, ckpt.status)
            except (ApiError, Conflict, OSError, TimeoutError) as error:
                logger.warning(
                    "checkpoint %s: the operator stops after the cut and could not write phase "
                    "Resuming for the next one (%s)",
                    name,
                    error,
                )
                return
        if bounded.cancelled_caught:
            logger.warning(
                "checkpoint %s: the operator stops after the cut and could not write phase "
                "Resuming for the next one within %gs",
                name,
                context.settings.handover_write_seconds,
            )
            return
        logger.info("checkpoint %s: the operator stops after the cut; phase Resuming written", name)

    async def _abort_deleted(
        self, run: CheckpointRun, coordinator: Coordinator, ckpt: RolloutCheckpoint
    ) -> None:
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
            await abort(context, coordinator, ckpt, cut=run.cut)
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
