"""The RolloutCheckpoint flow (docs/design.md#61-checkpoint): prepare, commit, publish, resume.

The protocol itself is `rollout_protocol.Coordinator`; this module adds what only an
operator has: the phase persisted in `status.phase` before every step, so a restarted operator
continues where the last one stopped; one checkpoint per set at a time (the set's Lease,
`leases.CheckpointLeases`); and publication as one status patch (`Ready=True` with every
participant's manifest). The flow writes only its own checkpoint's status: the set's pass
derives `latestCheckpoint`, the recent durations and the pods' latest-checkpoint annotations
from the checkpoints once this one is Ready (docs/design.md#69-who-writes-the-sets-status).

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

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

import anyio
from rollout_protocol import (
    CommitOutcome,
    Coordinator,
    ErrorCode,
    Failure,
    HttpParticipantClient,
    PrepareOutcome,
    tracing,
)

from ..cluster.kube import ApiError, Kube
from ..cluster.leases import CheckpointLeases
from ..cluster.objects import read_control_token
from ..decide.policy import PrepareDeadline, TerminatingPod, eviction_prepare_deadline
from ..decide.resources import set_selector
from ..decide.workers import unmanaged_workers
from ..model.api import (
    CHECKPOINT_FINISHED,
    CHECKPOINT_RUNNING,
    LABEL_ATTEMPT,
    CheckpointConditionType,
    CheckpointDurations,
    CheckpointParticipant,
    CheckpointPhase,
    ConditionStatus,
    RolloutCheckpoint,
    RolloutCheckpointStatus,
    RolloutSet,
    SetConditionType,
    Trigger,
    dump,
    format_time,
)
from ..model.conditions import MAX_FAILURE_CHARS, find_condition, set_condition, truncate
from .repairs import repair_published_checkpoint
from .watching import NoLongerHolds, while_holding

logger = logging.getLogger(__name__)


TERMINAL: Final = CHECKPOINT_FINISHED
IN_FLIGHT: Final = CHECKPOINT_RUNNING
"""Phases entered while holding the set's slot; a restarted operator continues them."""
_T = TypeVar("_T")


class Reason:
    """Condition reasons of a RolloutCheckpoint (CamelCase, stable)."""

    QUEUED: Final = "Queued"
    PREPARING: Final = "Preparing"
    PREPARED: Final = "AllParked"
    NOT_PARKED: Final = "PrepareTimeout"
    COMMITTED: Final = "RecordsWritten"
    PUBLISHED: Final = "Published"
    SET_NOT_FOUND: Final = "SetNotFound"
    SET_NOT_READY: Final = "SetNotReady"
    PARTICIPANT_LOST: Final = "ParticipantLost"
    PARTICIPANT_UNRESPONSIVE: Final = "ParticipantUnresponsive"
    ABORTED: Final = "Aborted"
    PREPARE_FAILED: Final = "PrepareFailed"
    COMMIT_FAILED: Final = "CommitFailed"
    LEASE_LAPSED: Final = "LeaseLapsed"
    INVALID: Final = "InvalidCheckpoint"
    GRACE_PERIOD_TOO_SHORT: Final = "GracePeriodTooShort"
    UNMANAGED_WORKERS: Final = "UnmanagedWorkers"


class CheckpointFailed(Exception):
    """Ends the flow: the checkpoint becomes Failed with this reason and message."""

    def __init__(self, reason: str, message: str, *, blockers: PrepareOutcome | None = None):
        message = truncate(message)  # status, Event, log and trace carry it: bounded
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.blockers = blockers


@dataclass(frozen=True)
class FlowSettings:
    commit_timeout_seconds: float = 120.0
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


_UNQUEUED_TRIGGERS: Final = frozenset({Trigger.EVICTION, Trigger.DEADLINE})
"""Checkpoints with a hard deadline of their own: never queued behind the operator's limit."""


def _now_ts(clock: Callable[[], float]) -> datetime:
    return datetime.fromtimestamp(clock(), UTC).replace(microsecond=0)


def _set_lost(rset: RolloutSet, attempt: int | None) -> str | None:
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


def _failure_reason(failures: list[Failure]) -> str:
    codes = {failure.code for failure in failures}
    if codes & {ErrorCode.STALE_CHECKPOINT, ErrorCode.UNKNOWN_CHECKPOINT}:
        return Reason.LEASE_LAPSED
    if ErrorCode.UNRESPONSIVE in codes and ErrorCode.UNREACHABLE not in codes:
        # It took the connection but did not answer in time: hung or overloaded, not gone.
        return Reason.PARTICIPANT_UNRESPONSIVE
    if ErrorCode.INTERNAL in codes or not codes <= {
        ErrorCode.STORAGE_FAILED,
        ErrorCode.WRONG_PHASE,
        ErrorCode.CONFLICTING_CHECKPOINT,
        ErrorCode.DEADLINE_PASSED,
    }:
        return Reason.PARTICIPANT_LOST
    return ""


def _describe(failures: list[Failure], limit: int = 5) -> str:
    """The first `limit` failures for a message, each cut to `MAX_FAILURE_CHARS`: a detail is
    what a participant said, of any size (docs/operations.md, "Failure modes")."""
    shown = "; ".join(truncate(str(f), MAX_FAILURE_CHARS) for f in failures[:limit])
    more = len(failures) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


class CheckpointFlow:
    """Runs one RolloutCheckpoint to Ready or Failed; safe to start again after a crash."""

    def __init__(
        self,
        kube: Kube,
        *,
        settings: FlowSettings | None = None,
        clock: Callable[[], float] = time.time,
        on_transition: Callable[[RolloutCheckpoint, str, str], Awaitable[None]] | None = None,
        participants_factory: Callable[[RolloutSet, str], list[HttpParticipantClient]]
        | None = None,
        slots: anyio.Semaphore | None = None,
        leases: CheckpointLeases | None = None,
    ) -> None:
        """`slots`: the operator's checkpoints that may run at once, shared by every flow
        (`--max-concurrent-checkpoints`); None: no limit. `leases`: the per-set slots, shared
        by the process's flows (they remember the Leases they wrote)."""
        self._kube = kube
        self._settings = settings or FlowSettings()
        self._clock = clock
        self._on_transition = on_transition
        self._participants_factory = participants_factory or _http_participants
        self._slots = slots
        self._leases = leases or CheckpointLeases(kube, clock=clock)

    # --- persistence --------------------------------------------------------------------------

    async def _read(self, namespace: str, name: str) -> RolloutCheckpoint | None:
        obj = await self._kube.get_checkpoint(namespace, name)
        return None if obj is None else RolloutCheckpoint.model_validate(obj)

    async def _write(self, ckpt: RolloutCheckpoint, status: RolloutCheckpointStatus) -> None:
        """Persist the whole status (a merge patch of its wire form) before the next step."""
        body = {"status": dump(status)}
        # Lists in a merge patch replace; fields that became unset must be sent as null.
        for key in ("blockers", "participants"):
            body["status"].setdefault(key, [])
        namespace = ckpt.metadata.namespace or "default"
        with tracing.span("write status", attributes={"rollout.phase": str(status.phase)}):
            await self._kube.patch_checkpoint_status(namespace, ckpt.metadata.name, body["status"])
        ckpt.status = status

    async def _phase(
        self,
        ckpt: RolloutCheckpoint,
        phase: CheckpointPhase,
        *,
        condition: tuple[CheckpointConditionType, bool, str, str] | None = None,
        **fields: Any,
    ) -> None:
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
        await self._write(ckpt, status)
        if self._on_transition is not None and condition is not None:
            await self._on_transition(ckpt, condition[2], condition[3])

    async def _fail(self, ckpt: RolloutCheckpoint, failed: CheckpointFailed) -> None:
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
        await self._write(ckpt, status)
        if self._on_transition is not None:
            await self._on_transition(ckpt, failed.reason, failed.message)

    # --- the per-set slot ----------------------------------------------------------------------

    async def _take_slot(self, ckpt: RolloutCheckpoint) -> RolloutSet:
        """Wait until the set is Ready and this checkpoint holds the set's Lease.

        The Lease survives an operator restart; a holder that is gone or finished is taken
        over (`leases`). Waiting is bounded by the set's prepare and restore timeouts; it wakes
        on the set's events (a recovery ending, a checkpoint finishing)."""
        namespace = ckpt.metadata.namespace or "default"
        me = ckpt.metadata.name
        deadline: float | None = None
        queued_reason = ""
        # `kubectl apply -f examples/` creates the checkpoint a moment before its set (files
        # apply in name order): a set that is missing is waited for, briefly.
        absent_until = self._clock() + self._settings.set_appear_seconds
        while True:
            raw = await self._kube.get_set(namespace, ckpt.spec.rollout_set)
            if raw is None:
                if self._clock() < absent_until:
                    await anyio.sleep(self._settings.queue_poll_seconds)
                    continue
                raise CheckpointFailed(
                    Reason.SET_NOT_FOUND,
                    f"RolloutSet {ckpt.spec.rollout_set!r} does not exist in namespace "
                    f"{namespace!r}; create it first or fix spec.rolloutSet",
                )
            rset = RolloutSet.model_validate(raw)
            if deadline is None:
                timeout = rset.spec.checkpoint_policy.prepare_timeout_seconds
                deadline = self._clock() + timeout + rset.spec.recovery.restore_timeout_seconds
            wait_reason = self._why_wait(rset, ckpt.spec.trigger)
            if wait_reason is None:
                holder = await self._leases.take(rset, me, self._lease_seconds(rset))
                if holder is None:
                    return rset
                wait_reason = f"checkpoint {holder} of set {rset.metadata.name} is running"
            if wait_reason != queued_reason:
                queued_reason = wait_reason
                await self._phase(
                    ckpt,
                    CheckpointPhase.QUEUED,
                    condition=(CheckpointConditionType.READY, False, Reason.QUEUED, wait_reason),
                )
            if self._clock() > deadline:
                raise CheckpointFailed(
                    Reason.SET_NOT_READY,
                    f"gave up waiting to start: {wait_reason}",
                )
            await self._kube.cache.wait_for_change(
                namespace, ckpt.spec.rollout_set, self._settings.queue_poll_seconds
            )

    def _lease_seconds(self, rset: RolloutSet) -> int:
        """The Lease's duration: the longest this checkpoint's steps may take, and a margin."""
        settings = self._settings
        return int(
            rset.spec.checkpoint_policy.prepare_timeout_seconds
            + settings.commit_timeout_seconds
            + settings.resume_timeout_seconds
            + settings.lease_margin_seconds
        )

    def _why_wait(self, rset: RolloutSet, trigger: Trigger = Trigger.MANUAL) -> str | None:
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

    async def _release_slot(self, ckpt: RolloutCheckpoint) -> None:
        namespace = ckpt.metadata.namespace or "default"
        await self._leases.release(namespace, ckpt.spec.rollout_set, ckpt.metadata.name)

    # --- the flow -------------------------------------------------------------------------------

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
        namespace = ckpt.metadata.namespace or "default"
        name = ckpt.metadata.name
        in_flight = ckpt.status.phase in IN_FLIGHT
        # A status reset by a user must never run a published checkpoint again (class 2).
        if not in_flight and (repaired := await repair_published_checkpoint(self._kube, ckpt)):
            status, repair = repaired
            await self._write(ckpt, status)
            if self._on_transition is not None:
                await self._on_transition(ckpt, repair.reason, repair.message)
            return ckpt.status.phase
        started = self._clock()
        if in_flight and ckpt.status.started_at is not None:
            started = min(started, ckpt.status.started_at.timestamp())
        coordinator: Coordinator | None = None
        participants: list[HttpParticipantClient] = []
        published = False
        holds_operator_slot = False
        try:
            with tracing.span("slot"):
                holds_operator_slot = await self._take_operator_slot(ckpt, in_flight)
                rset = await (self._held_slot(ckpt) if in_flight else self._take_slot(ckpt))
            token = await read_control_token(self._kube, namespace, rset.metadata.name)
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
            coordinator = Coordinator(participants)
            await self._drive(ckpt, rset, coordinator, started)
            published = True
            await self._release_slot(ckpt)
            await self._phase(ckpt, CheckpointPhase.READY, completed_at=datetime.now(UTC))
        except anyio.get_cancelled_exc_class():
            # Deleted: participants must not stay paused until their leases lapse, and the
            # set's slot must be free for the next checkpoint. Bounded, so a hung participant
            # never holds the deletion. (An operator that stops hands the checkpoint over
            # instead: cancelled without aborting, see handlers/rolloutcheckpoint.py.)
            if coordinator is not None and not published and abort_when_cancelled():
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(self._settings.abort_timeout_seconds + 5.0),
                ):
                    logger.warning("checkpoint %s cancelled: aborting it", name)
                    await self._abort(coordinator, ckpt)
                    await self._release_slot(ckpt)
                    # Its id is stale on every participant now: it can never be published.
                    await self._fail(
                        ckpt,
                        CheckpointFailed(
                            Reason.ABORTED,
                            "aborted before it was published (the checkpoint was deleted); "
                            "every participant was resumed",
                        ),
                    )
            raise
        except CheckpointFailed as failed:
            published = published or ckpt.status.phase is CheckpointPhase.RESUMING
            if coordinator is not None and not published:
                await self._abort(coordinator, ckpt)
            await self._release_slot(ckpt)
            if published:
                # Ready already (records complete and published): never taken back.
                logger.warning("checkpoint %s: %s", name, failed.message)
                await self._phase(ckpt, CheckpointPhase.READY, completed_at=datetime.now(UTC))
            else:
                await self._fail(ckpt, failed)
        finally:
            if holds_operator_slot:
                assert self._slots is not None
                self._slots.release()
            for participant in participants:
                await participant.aclose()
        return ckpt.status.phase

    async def _take_operator_slot(self, ckpt: RolloutCheckpoint, in_flight: bool) -> bool:
        """Wait, Queued, for one of the operator's checkpoint slots; True once one is held.

        Not for a checkpoint already running (an operator restart found it prepared: its
        participants are paused now) nor for one with a hard deadline (an evicted pod's grace
        period, a must-save-by time): those run at once, beside the limit."""
        slots = self._slots
        if slots is None or in_flight or ckpt.spec.trigger in _UNQUEUED_TRIGGERS:
            return False
        try:
            slots.acquire_nowait()
            return True
        except anyio.WouldBlock:
            pass
        limit = slots.max_value
        await self._phase(
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

    async def _held_slot(self, ckpt: RolloutCheckpoint) -> RolloutSet:
        """After an operator restart in a running phase: the slot is still ours (nobody takes
        over a checkpoint that is not finished), so only check that the set and the attempt the
        checkpoint captures are still there."""
        namespace = ckpt.metadata.namespace or "default"
        raw = await self._kube.get_set(namespace, ckpt.spec.rollout_set)
        if raw is None:
            raise CheckpointFailed(
                Reason.SET_NOT_FOUND,
                f"RolloutSet {ckpt.spec.rollout_set!r} was deleted while the checkpoint ran",
            )
        rset = RolloutSet.model_validate(raw)
        lost = _set_lost(rset, ckpt.status.attempt)
        if lost is not None and ckpt.status.phase is not CheckpointPhase.RESUMING:
            raise CheckpointFailed(Reason.PARTICIPANT_LOST, lost)
        return rset

    async def _prepare_deadline(self, ckpt: RolloutCheckpoint, rset: RolloutSet) -> PrepareDeadline:
        """`prepareTimeoutSeconds` from now; for an Eviction checkpoint no later than the
        evicted pods' grace period allows (`policy.eviction_prepare_deadline`). The pods are
        read now, not when the checkpoint was created: it may have queued, and a drain may
        have evicted more pods since."""
        now = datetime.fromtimestamp(self._clock(), UTC)
        timeout = rset.spec.checkpoint_policy.prepare_timeout_seconds
        terminating: list[TerminatingPod] = []
        if ckpt.spec.trigger is Trigger.EVICTION:
            namespace = ckpt.metadata.namespace or "default"
            pods = await self._kube.list_pods(namespace, set_selector(rset.metadata.name))
            terminating = [
                t for t in (TerminatingPod.from_pod(p, LABEL_ATTEMPT) for p in pods) if t
            ]
        return eviction_prepare_deadline(now, timeout, terminating, rset.status.attempt)

    async def _refuse_unmanaged_workers(self, rset: RolloutSet, coordinator: Coordinator) -> None:
        """Fail before anything is paused when a pod runs workers nobody coordinates. A
        participant that does not answer its status is left to the prepare (it fails there)."""
        outcome = await coordinator.status(self._clock() + self._settings.abort_timeout_seconds)
        pods = {f"{p.role.value}-{p.index}": p.pod for p in rset.status.participants}
        refused = unmanaged_workers(outcome.statuses, pods)
        if refused is not None:
            raise CheckpointFailed(Reason.UNMANAGED_WORKERS, refused)

    async def _abort(self, coordinator: Coordinator, ckpt: RolloutCheckpoint) -> None:
        """Resume every participant at once (one hung participant does not hold the others)."""
        with anyio.CancelScope(shield=True), tracing.span("abort"):
            outcome = await coordinator.abort(
                ckpt.metadata.name, self._clock() + self._settings.abort_timeout_seconds
            )
        if outcome.failures:
            logger.warning(
                "abort of %s: resume failed on %s (their lease resumes them)",
                ckpt.metadata.name,
                _describe(outcome.failures),
            )

    async def _while_set_holds(
        self, ckpt: RolloutCheckpoint, step: Callable[[], Awaitable[_T]]
    ) -> _T:
        """Run a protocol step, cancelled as soon as the set loses the checkpoint's attempt.

        A participant pod lost during prepare or commit would otherwise keep the step waiting
        for a dead pod until the step's deadline; the set's recovery (running concurrently in
        the set's loop) says at once that this attempt is gone (ParticipantLost:
        docs/design.md#66-one-checkpoint-at-a-time). The set is looked at on each of its events
        (from the watch: no request).
        """
        namespace = ckpt.metadata.namespace or "default"

        async def lost() -> str | None:
            try:
                raw = await self._kube.get_set(namespace, ckpt.spec.rollout_set)
            except (ApiError, OSError, TimeoutError) as error:
                logger.debug("reading set %s failed: %s", ckpt.spec.rollout_set, error)
                return None
            if raw is None:
                return "the RolloutSet was deleted"
            return _set_lost(RolloutSet.model_validate(raw), ckpt.status.attempt)

        async def next_look() -> None:
            await self._kube.cache.wait_for_change(
                namespace, ckpt.spec.rollout_set, self._settings.set_watch_seconds
            )

        try:
            return await while_holding(step, lost, next_look)
        except NoLongerHolds as broken:
            raise CheckpointFailed(Reason.PARTICIPANT_LOST, str(broken)) from None

    async def _drive(
        self, ckpt: RolloutCheckpoint, rset: RolloutSet, coordinator: Coordinator, started: float
    ) -> None:
        """The steps, each entered with its phase persisted first; ends with the participants
        resumed and the checkpoint published (phase Resuming)."""
        checkpoint_id = ckpt.metadata.name
        phase = ckpt.status.phase
        settings = self._settings

        # Resuming: published already (Ready=True); only the resume is left.
        if phase is not CheckpointPhase.RESUMING:
            # Prepare (also on a restart in Committing/Publishing: the replies are replayed).
            bound = ""
            if ckpt.status.deadline is not None and phase in IN_FLIGHT:
                deadline_ts = ckpt.status.deadline.timestamp()
            else:
                deadline = await self._prepare_deadline(ckpt, rset)
                deadline_ts = deadline.at.timestamp()
                bound = deadline.why
                if bound and deadline_ts <= self._clock():
                    raise CheckpointFailed(
                        Reason.GRACE_PERIOD_TOO_SHORT,
                        f"no time left to prepare: {bound}. Give participant pods a "
                        "terminationGracePeriodSeconds that covers a checkpoint (the set's "
                        "recentCheckpointSeconds); the recovery restores the latest Ready "
                        "checkpoint instead",
                    )
                await self._refuse_unmanaged_workers(rset, coordinator)
                await self._phase(
                    ckpt,
                    CheckpointPhase.PREPARING,
                    condition=(
                        CheckpointConditionType.PREPARED,
                        False,
                        Reason.PREPARING,
                        f"parking episodes of attempt {rset.status.attempt} at boundaries "
                        f"until {format_time(deadline.at)}" + (f" ({bound})" if bound else ""),
                    ),
                    attempt=rset.status.attempt,
                    started_at=_now_ts(self._clock),
                    deadline=deadline.at.replace(microsecond=0),
                )
            prepare_started = self._clock()
            if phase in IN_FLIGHT and ckpt.status.started_at is not None:
                # An operator restart (or an API outage) mid-checkpoint: admission closed when
                # the first prepare began, so the pause counts from there, not from this run.
                prepare_started = min(prepare_started, ckpt.status.started_at.timestamp())
            # A deadline that passed while the operator was down: a prepare that completed then
            # is replayed at once; one that did not gets one more second, then times out.
            prepare_deadline = max(deadline_ts, self._clock() + 1)
            with tracing.span("prepare"):
                prepare = await self._while_set_holds(
                    ckpt,
                    lambda: coordinator.prepare(
                        checkpoint_id, prepare_deadline, scope=ckpt.spec.episodes
                    ),
                )
            prepare_seconds = self._clock() - prepare_started
            if prepare.failures:
                reason = _failure_reason(prepare.failures) or Reason.PREPARE_FAILED
                raise CheckpointFailed(reason, f"prepare failed: {_describe(prepare.failures)}")
            if not prepare.ready:
                raise CheckpointFailed(
                    Reason.NOT_PARKED,
                    f"{prepare.blocker_count} episode(s) were not parked at the prepare deadline "
                    f"(stage {prepare.stopped_at}); first: "
                    + ", ".join(str(e) for e in prepare.blockers[:5])
                    + (
                        f". The deadline was the eviction's: {bound}; a longer "
                        "terminationGracePeriodSeconds gives episodes time to park"
                        if bound
                        else ""
                    ),
                    blockers=prepare,
                )
            scope = prepare.scope(ckpt.spec.episodes)
            commit_started = self._clock()
            commit_deadline = self._clock() + settings.commit_timeout_seconds
            committing = self._phase(
                ckpt,
                CheckpointPhase.COMMITTING,
                condition=(
                    CheckpointConditionType.PREPARED,
                    True,
                    Reason.PREPARED,
                    f"{prepare.episode_count} episode(s) parked, {len(prepare.restarts)} restart",
                ),
                restarts=len(prepare.restarts),
            )
            with tracing.span("commit"):
                commit = await alongside(
                    committing,
                    self._while_set_holds(
                        ckpt,
                        lambda: coordinator.commit(
                            checkpoint_id, commit_deadline, scope, excluded=prepare.excluded()
                        ),
                    ),
                )
            commit_seconds = self._clock() - commit_started
            if not commit.ok:
                reason = _failure_reason(commit.failures) or Reason.COMMIT_FAILED
                raise CheckpointFailed(reason, f"commit failed: {_describe(commit.failures)}")
            episodes = prepare.committed_count(scope)
            with tracing.span("publish"):
                await self._publish(
                    ckpt, rset, episodes, commit, prepare_seconds, commit_seconds, started
                )

        resume_started = self._clock()
        if _set_lost(rset, ckpt.status.attempt) is None:
            with tracing.span("resume"):
                resumed = await coordinator.resume(
                    checkpoint_id, self._clock() + settings.resume_timeout_seconds
                )
            if resumed.failures:
                logger.warning(
                    "checkpoint %s is Ready but resume failed on %s (their lease resumes them)",
                    checkpoint_id,
                    _describe(resumed.failures),
                )
        durations = ckpt.status.durations or CheckpointDurations()
        total = self._clock() - started
        pause = (durations.prepare_seconds or 0) + (durations.commit_seconds or 0)
        pause += self._clock() - resume_started
        ckpt.status = ckpt.status.model_copy(
            update={
                "durations": durations.model_copy(
                    update={"pause_seconds": round(pause, 3), "total_seconds": round(total, 3)}
                )
            }
        )

    async def _publish(
        self,
        ckpt: RolloutCheckpoint,
        rset: RolloutSet,
        episodes: int,
        commit: CommitOutcome,
        prepare_seconds: float,
        commit_seconds: float,
        started: float,
    ) -> None:
        """One status patch makes the checkpoint restorable; then the set points at it."""
        participants = [
            CheckpointParticipant(
                instance=instance,
                manifest=commit.manifest_paths[instance],
                records_sha256=manifest.records_sha256,
                record_count=manifest.record_count,
                bytes=manifest.bytes,
                rollout_ids=commit.listed.get(instance),
            )
            for instance, manifest in sorted(commit.manifests.items())
        ]
        message = (
            f"{episodes} episode(s) committed by {len(participants)} participant(s), "
            f"{commit.bytes} bytes"
        )
        status = ckpt.status.model_copy(
            update={
                "phase": CheckpointPhase.RESUMING,
                "episodes": episodes,
                "participants": participants,
                "attempt": commit.attempt or rset.status.attempt,
                "durations": CheckpointDurations(
                    prepare_seconds=round(prepare_seconds, 3),
                    commit_seconds=round(commit_seconds, 3),
                    total_seconds=round(self._clock() - started, 3),
                ),
            }
        )
        generation = ckpt.metadata.generation
        for type_, reason in (
            (CheckpointConditionType.COMMITTED, Reason.COMMITTED),
            (CheckpointConditionType.READY, Reason.PUBLISHED),
        ):
            status.conditions = set_condition(
                status.conditions,
                type_.value,
                True,
                reason,
                message,
                observed_generation=generation,
            )
        await self._write(ckpt, status)
        if self._on_transition is not None:
            await self._on_transition(ckpt, Reason.PUBLISHED, message)


async def alongside(write: Awaitable[None], step: Awaitable[_T]) -> _T:
    """Run a protocol step while a status write that may land in any order with it goes on.

    Used for the Committing phase: every episode waits while the participants commit, and an
    API round trip before the commit would only lengthen that. Nothing depends on the order:
    an operator restart before the write lands finds phase Preparing and replays prepare and
    commit, whose replies the participants cache. The step's error wins (the write is then
    cancelled); a failed write is raised once the step is done.
    """
    write_failed: list[BaseException] = []
    step_failed: list[BaseException] = []
    results: list[_T] = []

    async def persist() -> None:
        try:
            await write
        except Exception as error:
            write_failed.append(error)

    async with anyio.create_task_group() as group:
        group.start_soon(persist)
        try:
            results.append(await step)
        except Exception as error:
            step_failed.append(error)
            group.cancel_scope.cancel()
    if step_failed:
        raise step_failed[0]
    if write_failed:
        raise write_failed[0]
    return results[0]


def _http_participants(rset: RolloutSet, token: str) -> list[HttpParticipantClient]:
    """The coordinator's view of the set: one HTTP client per participant pod of the attempt."""
    return [
        HttpParticipantClient(p.role, p.address, index=p.index, token=token)
        for p in rset.status.participants
        if p.address
    ]
