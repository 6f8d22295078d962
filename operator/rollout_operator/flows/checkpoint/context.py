"""What every step of the checkpoint flow shares: its reasons and settings, the context a run
carries from step to step, and the writes of the checkpoint's status.

A `CheckpointRun` is one run of the flow over one checkpoint (docs/design.md#61-checkpoint):
the operator's parts it uses (`CheckpointContext`), the set and the coordinator it took the
slot for, and what its steps learned in memory (the prepare and commit outcomes are not
persisted: a restarted operator replays them, and the participants answer from their cache).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
from rollout_protocol import (
    SEQUENTIAL_STAGES,
    CommitOutcome,
    Coordinator,
    ErrorCode,
    Failure,
    HttpParticipantClient,
    PrepareOutcome,
    PrepareStages,
    tracing,
)

from ...cluster.checkpointstatus import CheckpointStatusWriter, status_body
from ...cluster.kube import ApiError, Conflict, Kube
from ...cluster.leases import CheckpointLeases
from ...model.api import (
    CHECKPOINT_FINISHED,
    CHECKPOINT_RUNNING,
    CheckpointConditionType,
    CheckpointPhase,
    ConditionStatus,
    RolloutCheckpoint,
    RolloutCheckpointStatus,
    RolloutSet,
    namespace_or_default,
)
from ...model.checkpointowners import CheckpointOwner
from ...model.conditions import MAX_FAILURE_CHARS, find_condition, set_condition, truncate
from ...model.reasons import Reason
from ..state import CoordinatedPods
from ..watching import NoLongerHolds, while_holding

# One logger for the whole flow, named as the flow (its lines read the same from every step).
logger = logging.getLogger(__package__)

TERMINAL: Final = CHECKPOINT_FINISHED
IN_FLIGHT: Final = CHECKPOINT_RUNNING
"""Phases entered while holding the set's slot; a restarted operator continues them."""
_T = TypeVar("_T")


class CheckpointFailed(Exception):
    """Ends the flow: the checkpoint becomes Failed with this reason and message."""

    def __init__(self, reason: str, message: str, *, blockers: PrepareOutcome | None = None):
        message = truncate(message)  # status, Event, log and trace carry it: bounded
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.blockers = blockers


DEFER_SECONDS: Final = 1.0
"""How long an intermediate phase (Preparing, Committing) stays in memory only before it is
written (docs/design.md#61-checkpoint, "Phases written late")."""


@dataclass(frozen=True)
class FlowSettings:
    commit_timeout_seconds: float = 120.0
    persist_timeout_seconds: float = 120.0
    """How long the participants may take to make the cut's records durable after the resume;
    a persist still writing then fails the checkpoint."""
    resume_timeout_seconds: float = 30.0
    abort_timeout_seconds: float = 10.0
    """An abort resumes what it can reach by then; a participant it missed resumes itself when
    its lease lapses, so waiting longer for a dead pod only delays the Failed condition."""
    queue_poll_seconds: float = 1.0
    set_appear_seconds: float = 10.0
    """How long a checkpoint waits for a RolloutSet that does not exist (yet) before it fails
    with SetNotFound."""
    set_watch_seconds: float = 1.0
    """The longest a prepare or commit goes without looking at the set (it looks at every event
    of the set too), to fail the checkpoint as soon as its participants are lost (a recovery
    started) instead of at the step's deadline."""
    lease_margin_seconds: int = 60
    """Added to the longest a checkpoint's steps may take to make the Lease's duration."""
    phase_write_seconds: float = DEFER_SECONDS
    """How long an intermediate phase may stay unwritten (`UnwrittenPhases`)."""
    handover_write_seconds: float = 5.0
    """How long an operator that stops after a checkpoint's cut may take to write phase
    Resuming for its successor (docs/design.md#68-the-operators-own-life). The write starts
    when the flow is let go (`HANDOVER_SECONDS`, 4 s after the stop) and so ends before Kopf
    stops waiting for the checkpoint's daemon (its `cancellation_backoff` and
    `cancellation_timeout`, 10 s after the stop: `handlers/rolloutcheckpoint.py`)."""


OnTransition = Callable[[RolloutCheckpoint, str, str], Awaitable[None]]
"""Posts the Event of a transition (the checkpoint, its reason, its message)."""


@dataclass
class _Unwritten:
    """A checkpoint whose status changed in memory since its last write."""

    sleeping: anyio.CancelScope
    done: anyio.Event
    events: list[tuple[str, str]]
    superseded: bool = False


@dataclass
class UnwrittenPhases:
    """The intermediate phases entered in memory and not written yet, per checkpoint.

    `defer` (from `enter_phase(..., defer=True)`) starts a writer that waits `seconds` and then
    writes the checkpoint's status as it is in memory by then, with the Events of the deferred
    transitions; any other write of the checkpoint's status first settles it (`settle`): a
    writer still waiting is cancelled and its Events dropped (the later write carries every
    field it would have written), one already writing is waited for, so the two never land out
    of order. What a successor operator needs of an unwritten phase is in the set's Lease
    (`cluster/leases.py`: the holder and when it took the slot) and in the participants, which
    replay prepare and commit (docs/design.md#61-checkpoint)."""

    seconds: float = DEFER_SECONDS
    _pending: dict[str, _Unwritten] = field(default_factory=dict)

    def defer(
        self,
        context: CheckpointContext,
        ckpt: RolloutCheckpoint,
        group: anyio.abc.TaskGroup,
        event: tuple[str, str] | None,
    ) -> None:
        key = _key_of(ckpt)
        pending = self._pending.get(key)
        if pending is None:
            pending = _Unwritten(anyio.CancelScope(), anyio.Event(), [])
            self._pending[key] = pending
            group.start_soon(self._write_late, context, ckpt, pending)
        if event is not None:
            pending.events.append(event)

    async def settle(self, ckpt: RolloutCheckpoint) -> None:
        """Before any other write of `ckpt`'s status: no deferred write lands after it."""
        pending = self._pending.pop(_key_of(ckpt), None)
        if pending is None:
            return
        pending.superseded = True
        pending.sleeping.cancel()
        with anyio.CancelScope(shield=True):
            await pending.done.wait()

    async def _write_late(
        self, context: CheckpointContext, ckpt: RolloutCheckpoint, pending: _Unwritten
    ) -> None:
        try:
            with pending.sleeping:
                await anyio.sleep(self.seconds)
            while not pending.superseded:
                try:
                    # Shielded: a write once sent lands before any later one (`settle`).
                    with anyio.CancelScope(shield=True):
                        await _patch_status(context, ckpt, ckpt.status)
                except (ApiError, Conflict, OSError, TimeoutError) as error:
                    logger.warning(
                        "checkpoint %s: phase %s not written yet (%s); again in %.0fs",
                        ckpt.metadata.name,
                        ckpt.status.phase,
                        error,
                        self.seconds,
                    )
                    with pending.sleeping:
                        await anyio.sleep(self.seconds)
                    continue
                if self._pending.get(_key_of(ckpt)) is pending:
                    del self._pending[_key_of(ckpt)]
                if context.on_transition is not None:
                    for reason, message in pending.events:
                        await context.on_transition(ckpt, reason, message)
                return
        finally:
            pending.done.set()


def _key_of(ckpt: RolloutCheckpoint) -> str:
    return ckpt.metadata.uid or f"{ckpt.metadata.namespace}/{ckpt.metadata.name}"


@dataclass(frozen=True)
class CheckpointContext:
    """The operator's parts a checkpoint flow uses, the same for every checkpoint it runs."""

    kube: Kube
    settings: FlowSettings
    clock: Callable[[], float]
    leases: CheckpointLeases
    on_transition: OnTransition | None = None
    unwritten: UnwrittenPhases = field(default_factory=UnwrittenPhases)
    coordinated: CoordinatedPods | None = None
    """The pods known to coordinate their workers (`OperatorState`); None: ask every time."""
    participants_factory: Callable[[RolloutSet, str], list[HttpParticipantClient]] | None = None
    """The coordinator's clients of a set (None: `http_participants`)."""
    slots: anyio.Semaphore | None = None
    """The operator's checkpoints that may run at once (None: no limit)."""

    @property
    def writer(self) -> CheckpointStatusWriter:
        """The one writer of the checkpoint's status, as its flow."""
        return CheckpointStatusWriter(self.kube, CheckpointOwner.FLOW)


@dataclass
class CheckpointRun:
    """One run of the flow over one checkpoint, from the slot to its terminal phase.

    `in_flight`: the run found the checkpoint in a running phase, or holding the set's Lease as
    this process took it; it goes on with the slot it holds (`slot.joined`) instead of taking
    one. `continued`: besides, the Lease was taken before this run began (an operator restart, a
    status write that failed); its prepare deadline and start time come from status then, or
    from the Lease. The set, the coordinator and when the slot was taken are known once the run
    holds the slot (`slot.attach`); the rest is what the steps learned, in the order they learn
    it (not persisted: a restarted operator replays prepare and commit, whose replies the
    participants cache)."""

    context: CheckpointContext
    began: float
    in_flight: bool = False
    writes: anyio.abc.TaskGroup | None = None
    """Where the run's deferred phase writes run (`UnwrittenPhases`); None: written at once."""
    attached: RolloutSet | None = None
    """The set the run holds the slot of (None: not yet)."""
    coordinator: Coordinator | None = None
    participants: list[HttpParticipantClient] = field(default_factory=list)
    holds_operator_slot: bool = False
    started: float = 0.0
    continued: bool = False
    slot_taken: float = 0.0
    """When the checkpoint took the set's Lease (its `acquireTime`): the prepare deadline and
    `startedAt` count from here, so a successor that finds no phase written computes the same."""
    deadline_ts: float | None = None
    """The prepare deadline this run computed (None: status holds it, from an earlier run)."""
    bound: str = ""
    """Why the prepare deadline is earlier than `prepareTimeoutSeconds` (an eviction), if so."""
    stages: PrepareStages = SEQUENTIAL_STAGES
    """The prepare's stages, from the waits the participants declared (`prepare.check_participants`;
    a run that continues one prepares one role per stage: the participants replay their replies)."""
    prepared: PrepareOutcome | None = None
    prepare_seconds: float = 0.0
    scope: list[str] | None = None
    """The commit scope (None: every parked episode but the restarts)."""
    cut: CommitOutcome | None = None
    """The cut's outcome: which participants hold records in memory, and the manifests they
    promised (a run that continues a Persisting checkpoint has none: every participant is asked)."""
    commit_seconds: float = 0.0

    @property
    def rset(self) -> RolloutSet:
        assert self.attached is not None, "a step after the slot knows its set"
        return self.attached

    @property
    def kube(self) -> Kube:
        return self.context.kube

    @property
    def settings(self) -> FlowSettings:
        return self.context.settings

    def now(self) -> float:
        return self.context.clock()


def published(ckpt: RolloutCheckpoint) -> bool:
    """Whether the checkpoint was published (Ready True): never taken back. The flow publishes
    with its terminal Ready write; an earlier operator published before the resume."""
    ready = find_condition(ckpt.status.conditions, CheckpointConditionType.READY.value)
    return ready is not None and ready.status is ConditionStatus.TRUE


def set_lost(rset: RolloutSet, attempt: int | None) -> str | None:
    """Why the set no longer runs the checkpoint's attempt (None while it does)."""
    status = rset.status
    if status.recovery is not None:
        return (
            f"set {rset.metadata.name} lost a participant of attempt {status.recovery.from_attempt}"
            f" ({status.recovery.message or status.recovery.reason}); its recovery to attempt "
            f"{status.recovery.target_attempt} restores the previous Ready checkpoint"
        )
    if attempt is not None and status.attempt is not None and status.attempt != attempt:
        return f"set {rset.metadata.name} moved from attempt {attempt} to {status.attempt}"
    return None


def failure_reason(failures: list[Failure]) -> str:
    codes = {failure.code for failure in failures}
    if codes & {ErrorCode.STALE_CHECKPOINT, ErrorCode.UNKNOWN_CHECKPOINT}:
        return Reason.LEASE_LAPSED
    if ErrorCode.UNRESPONSIVE in codes and ErrorCode.UNREACHABLE not in codes:
        # It took the connection but did not answer in time: hung or overloaded, not gone.
        return Reason.PARTICIPANT_UNRESPONSIVE
    if ErrorCode.INTERNAL in codes or not codes <= {
        ErrorCode.STORAGE_FAILED,
        ErrorCode.PERSIST_BACKLOG,
        ErrorCode.WRONG_PHASE,
        ErrorCode.CONFLICTING_CHECKPOINT,
        ErrorCode.DEADLINE_PASSED,
    }:
        return Reason.PARTICIPANT_LOST
    return ""


def describe(failures: list[Failure], limit: int = 5) -> str:
    """The first `limit` failures for a message, each cut to `MAX_FAILURE_CHARS`: a detail is
    what a participant said, of any size (docs/operations.md, "Failure modes")."""
    shown = "; ".join(truncate(str(f), MAX_FAILURE_CHARS) for f in failures[:limit])
    more = len(failures) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


# --- the checkpoint's status ---------------------------------------------------------------------


async def write_status(
    context: CheckpointContext, ckpt: RolloutCheckpoint, status: RolloutCheckpointStatus
) -> None:
    """Persist the whole status (a merge patch of its wire form) before the next step; a
    deferred write of an earlier phase is settled first (`UnwrittenPhases.settle`)."""
    await context.unwritten.settle(ckpt)
    await _patch_status(context, ckpt, status)
    ckpt.status = status


async def _patch_status(
    context: CheckpointContext, ckpt: RolloutCheckpoint, status: RolloutCheckpointStatus
) -> None:
    body = status_body(status)
    with tracing.span("write status", attributes={"rollout.phase": str(status.phase)}):
        await context.writer.write_retrying(ckpt, lambda stored: body)


async def riding_out_outages(
    run: CheckpointRun, ckpt: RolloutCheckpoint, what: str, call: Callable[[], Awaitable[_T]]
) -> _T:
    """`call()` (a write to the API server), tried again every `DEFER_SECONDS` while the API
    server is unreachable or answers an error, for up to the persist timeout. After the resume
    the pause cannot be taken again (the participants' checkpoint id is spent, their cut is
    held), so a write there rides out an API outage instead of ending the run
    (docs/operations.md#failure-modes)."""
    until = run.now() + run.settings.persist_timeout_seconds
    while True:
        try:
            return await call()
        except (ApiError, OSError, TimeoutError) as error:
            if run.now() + DEFER_SECONDS > until:
                raise
            logger.warning(
                "checkpoint %s: %s not written yet (%s); again in %.0fs",
                ckpt.metadata.name,
                what,
                error,
                DEFER_SECONDS,
            )
            await anyio.sleep(DEFER_SECONDS)


async def enter_phase(
    context: CheckpointContext,
    ckpt: RolloutCheckpoint,
    phase: CheckpointPhase,
    *,
    condition: tuple[CheckpointConditionType, bool, str, str] | None = None,
    defer: anyio.abc.TaskGroup | None = None,
    **fields: Any,
) -> None:
    """Write `phase` (with `fields` and `condition`), then post the condition's Event.

    With `defer` (an intermediate phase: the run's task group), the phase is entered in memory
    only and written by `UnwrittenPhases` if no other write came within `DEFER_SECONDS`; its
    Event is posted with that write, or not at all."""
    status = ckpt.status.model_copy(update={"phase": phase, **fields})
    status.observed_generation = ckpt.metadata.generation
    if condition is not None:
        type_, value, reason, message = condition
        status.conditions = set_condition(
            status.conditions,
            type_.value,
            value,
            reason,
            message,
            observed_generation=ckpt.metadata.generation,
        )
    if defer is not None:
        ckpt.status = status
        event = None if condition is None else (condition[2], condition[3])
        context.unwritten.defer(context, ckpt, defer, event)
        return
    await write_status(context, ckpt, status)
    if context.on_transition is not None and condition is not None:
        await context.on_transition(ckpt, condition[2], condition[3])


async def write_failed(
    context: CheckpointContext, ckpt: RolloutCheckpoint, failed: CheckpointFailed
) -> None:
    """The terminal Failed phase: Ready False and Failed True with the reason, the blockers."""
    logger.warning(
        "checkpoint %s failed: %s: %s", ckpt.metadata.name, failed.reason, failed.message
    )
    tracing.failed(failed.reason, failed.message)
    status = ckpt.status.model_copy(
        update={"phase": CheckpointPhase.FAILED, "completed_at": datetime.now(UTC)}
    )
    if failed.blockers is not None:
        status.blockers = [str(e) for e in failed.blockers.blockers]
        status.blocker_count = failed.blockers.blocker_count
    generation = ckpt.metadata.generation
    status.conditions = set_condition(
        status.conditions,
        "Ready",
        False,
        failed.reason,
        failed.message,
        observed_generation=generation,
    )
    status.conditions = set_condition(
        status.conditions,
        "Failed",
        True,
        failed.reason,
        failed.message,
        observed_generation=generation,
    )
    await write_status(context, ckpt, status)
    if context.on_transition is not None:
        await context.on_transition(ckpt, failed.reason, failed.message)


# --- the protocol steps' guard -------------------------------------------------------------------


async def while_set_holds(
    context: CheckpointContext, ckpt: RolloutCheckpoint, step: Callable[[], Awaitable[_T]]
) -> _T:
    """Run a protocol step, cancelled as soon as the set loses the checkpoint's attempt.

    A participant pod lost during prepare or commit would otherwise keep the step waiting
    for a dead pod until the step's deadline; the set's recovery (running concurrently in
    the set's loop) says at once that this attempt is gone (ParticipantLost:
    docs/design.md#66-one-checkpoint-at-a-time). The set is looked at on each of its events
    (from the watch: no request).
    """
    namespace = namespace_or_default(ckpt.metadata.namespace)
    kube = context.kube

    async def lost() -> str | None:
        try:
            raw = await kube.get_set(namespace, ckpt.spec.rollout_set)
        except (ApiError, OSError, TimeoutError) as error:
            logger.debug("reading set %s failed: %s", ckpt.spec.rollout_set, error)
            return None
        if raw is None:
            return "the RolloutSet was deleted"
        return set_lost(RolloutSet.model_validate(raw), ckpt.status.attempt)

    async def next_look() -> None:
        await kube.cache.wait_for_change(
            namespace, ckpt.spec.rollout_set, context.settings.set_watch_seconds
        )

    try:
        return await while_holding(step, lost, next_look)
    except NoLongerHolds as broken:
        raise CheckpointFailed(Reason.PARTICIPANT_LOST, str(broken)) from None


async def abort(
    context: CheckpointContext,
    coordinator: Coordinator,
    ckpt: RolloutCheckpoint,
    *,
    cut: CommitOutcome | None = None,
) -> None:
    """Resume every participant at once (one hung participant does not hold the others); when
    a cut may be held (`cut`, or a Resuming or Persisting checkpoint whose cut this run did not
    see), every participant that holds it releases the bytes and removes what its persist
    wrote (`Coordinator.discard`), so nothing half-written stays."""
    name = ckpt.metadata.name
    with anyio.CancelScope(shield=True), tracing.span("abort"):
        outcome = await coordinator.abort(
            name, context.clock() + context.settings.abort_timeout_seconds
        )
        discarded = None
        if cut is not None or ckpt.status.phase in CUT_HELD:
            discarded = await coordinator.discard(
                name, context.clock() + context.settings.abort_timeout_seconds, cut=cut
            )
    if outcome.failures:
        logger.warning(
            "abort of %s: resume failed on %s (their lease resumes them)",
            name,
            describe(outcome.failures),
        )
    if discarded is not None and discarded.failures:
        logger.warning(
            "abort of %s: discard failed on %s (their lease drops the held records)",
            name,
            describe(discarded.failures),
        )


CUT_HELD: Final = frozenset({CheckpointPhase.RESUMING, CheckpointPhase.PERSISTING})
"""Phases in which participants may hold a cut's records."""


def http_participants(rset: RolloutSet, token: str) -> list[HttpParticipantClient]:
    """The coordinator's view of the set: one HTTP client per participant pod of the attempt."""
    return [
        HttpParticipantClient(p.role, p.address, index=p.index, token=token)
        for p in rset.status.participants
        if p.address
    ]
