r"""Pod-loss recovery (docs/design.md#62-recovery): fresh pods under attempt + 1, restore, resume.

`detect_loss` says whether the set's current attempt lost a participant (a pod that failed,
was deleted, or sits on a node that is NotReady). `RecoveryFlow.run` then drives
`status.recovery` through its phases, persisting each before acting, so an operator restart
continues the recovery instead of starting a second one:

    StoppingAttempt -> StartingPods -> Restoring -> Resuming -> (done: attempt = target)
                                    \-> BackingOff -> StoppingAttempt (target + 1) ...

Restore is all or nothing (the coordinator retires the target attempt everywhere when any
participant fails), so a failed try cannot reuse its pods: the next try runs under a newer
attempt, after a backoff, at most `recovery.maxRestarts` times.

`restorePolicy: Recreate` replaces every pod in StoppingAttempt. `InPlace` (see `inplace.py`)
replaces only the lost ones there: the kept pods retire the lost attempt and are relabelled to
the target attempt, and the restore re-wires kept callers whose callee was replaced. When that
cannot be done safely (nothing survived, the spec changed, a kept pod refuses to retire) the try
falls back to Recreate, with reason `InPlaceFallback` on the Recovering condition and an Event;
a failed InPlace try is followed by Recreate tries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

import anyio
from pydantic import ValidationError
from rollout_protocol import (
    Coordinator,
    ErrorCode,
    HttpParticipantClient,
    RetireOutcome,
    Role,
    tracing,
)

from ..cluster.kube import ApiError, Conflict, Kube
from ..cluster.objects import (
    delete_attempt_pods,
    eviction_holds,
    observe_pods,
    read_control_token,
    reconcile_pods,
)
from ..cluster.statuswriter import SetGone, SetStatusWriter
from ..decide.churn import ChurnDecision, decide, kept_starts
from ..decide.inplace import adopted_instances, instance_name, plan_in_place, rewiring
from ..decide.policy import RESUMED_REASON, checkpoint_views, resume_due
from ..decide.resources import control_port, participant_url, set_selector
from ..decide.setplan import Instance, PodView, attempt_instances
from ..decide.setplan import Reason as SetReason
from ..decide.setstatus import NOT_AN_INTERFACE, REPAIRED, Repair, newest_ready
from ..decide.standby import adoptions, standby_views
from ..decide.workloss import lost_reports, total_work, work_loss
from ..model.api import (
    ANNOTATION_ADOPTED,
    ANNOTATION_RETRY_RECOVERY,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_STANDBY,
    MAX_RECOVERY_STARTS,
    CheckpointConditionType,
    CheckpointPhase,
    LastRecovery,
    LostWorkReport,
    RecoveryHold,
    RecoveryPhase,
    RecoveryStatus,
    RestorePolicy,
    RolloutCheckpoint,
    RolloutSet,
    SetConditionType,
    TargetLevel,
    dump,
    format_time,
)
from ..model.conditions import (
    ConditionUpdate,
    is_true,
    merge_conditions,
    set_condition,
    truncate,
    utcnow,
)
from ..model.owners import StatusOwner
from ..model.settings import DEFAULT_RESTORE_FLOOR_SECONDS, DEFAULT_RETIRE_SECONDS
from .watching import NoLongerHolds, while_holding

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

POLL_SECONDS: Final = 0.5
MAX_BACKOFF_SECONDS: Final = 60.0
STOP_GRACE_SECONDS: Final = 1
"""Grace period for the pods of a lost attempt. Their episodes continue from the checkpoint
under the next attempt, so nothing of theirs is worth draining for; their GPUs are needed by
the replacement pods, and a survivor that kept working could report episodes the restore also
continues. (The servers turn unready on SIGTERM and keep serving until SIGKILL, so a long grace
would keep them busy for all of it.)"""


class Reason:
    """Reasons on the set's Recovering condition (CamelCase, stable)."""

    POD_FAILED: Final = "PodFailed"
    POD_DELETED: Final = "PodDeleted"
    NODE_LOST: Final = "NodeLost"
    RECOVERED: Final = "Recovered"
    RESTORED: Final = "Restored"
    NO_CHECKPOINT: Final = "NoCheckpoint"
    SIBLING_RESTART: Final = "SiblingRestart"
    RESTORE_FAILED: Final = "RestoreFailed"
    PODS_NOT_READY: Final = "ReplacementPodsNotReady"
    RESTARTS_EXHAUSTED: Final = "MaxRestartsExceeded"
    IN_PLACE_FALLBACK: Final = "InPlaceFallback"
    REPLACEMENT_LOST: Final = "ReplacementPodLost"
    RECOVERY_LIMIT: Final = SetReason.RECOVERY_LIMIT
    CHECKPOINT_INVALID: Final = "CheckpointInvalid"
    """The restored checkpoint's records failed verification: the next try restores an older
    Ready checkpoint, or starts fresh."""


CHECKPOINT_RECORDS_INVALID: Final = "RecordsInvalid"
"""Reason on a RolloutCheckpoint whose records failed verification at restore (Ready=False)."""


@dataclass(frozen=True)
class RecoveryWaits:
    """The recovery's fixed waits, set by the operator's options (`model/settings.py`): how
    long the pods an InPlace recovery keeps may take to retire the lost attempt, and the least
    time a restore or resume call gets when the try's own deadline is nearer."""

    retire_seconds: float = DEFAULT_RETIRE_SECONDS
    restore_floor_seconds: float = DEFAULT_RESTORE_FLOOR_SECONDS


COUNT_RETIRE_SECONDS: Final = 5.0
"""How long a Recreate recovery waits for the pods it is about to delete to retire the lost
attempt, only so that they report the work it loses (`lastRecovery`); one that does not
answer by then is deleted anyway and its work is listed as uncounted."""

FINISHED_ROLES: Final = (Role.ENVIRONMENT, Role.AGENT)
"""Roles that can tell which rollouts finished, best first (see `Coordinator.retire`)."""


def finished_from(lost_roles: set[Role]) -> list[Role]:
    """The roles a retire may learn the finished rollouts from: those that lost no pod."""
    return [role for role in FINISHED_ROLES if role not in lost_roles]


def reported_losses(retired: RetireOutcome) -> list[LostWorkReport]:
    """The work each participant's retire said the lost attempt did after its checkpoint."""
    return lost_reports({i: (w.since, w.counts) for i, w in retired.lost.items()})


def counts_as_restart(recovery: RecoveryStatus) -> bool:
    """Whether a finished recovery adds one to `status.restarts`.

    `restarts` counts what went wrong (a participant failed, was deleted, its node was lost),
    so people and alerts can read it as the set's instability. A resume after suspend runs as
    a recovery too (fresh pods restore the latest checkpoint under attempt + 1), but nothing
    was lost: it advances the attempt and says `Resumed`/`Restored` in the conditions, and
    leaves `restarts` alone (a queueing system may suspend and resume a set many times)."""
    return recovery.reason != RESUMED_REASON


@dataclass(frozen=True)
class Loss:
    reason: str
    message: str


def detect_loss(
    rset: RolloutSet,
    pods: list[PodView],
    nodes_of: dict[str, str],
    lost_nodes: set[str],
    held: frozenset[str] = frozenset(),
) -> Loss | None:
    """Whether the current attempt lost a participant. Only an attempt that came up counts
    (`createdAttempt`: its pods were all created and Ready together; a pod that fails while the
    attempt starts is the reconciler's Degraded).

    `held`: terminating pods that are not lost yet (their eviction checkpoint runs inside
    their grace period, see `cluster.objects.eviction_holds`). A Suspended set has released its
    pods on purpose; resuming it is the policy's recovery, not a loss."""
    status = rset.status
    attempt = status.attempt
    if attempt is None or status.created_attempt is None or status.created_attempt < attempt:
        return None
    if rset.spec.suspend or status.recovery is not None:
        return None
    if is_true(status.conditions, SetConditionType.SUSPENDED.value):
        return None
    losses = find_losses(rset, attempt, pods, nodes_of, lost_nodes, held)
    return next(iter(losses.values()), None)


def find_losses(
    rset: RolloutSet,
    attempt: int,
    pods: list[PodView],
    nodes_of: dict[str, str],
    lost_nodes: set[str],
    held: frozenset[str] = frozenset(),
) -> dict[Instance, Loss]:
    """Every participant instance of `attempt` that was lost, with why (in role order)."""
    existing = {(p.role, p.index): p for p in pods if p.attempt == attempt}
    losses: dict[Instance, Loss] = {}
    for role, index in attempt_instances(rset, attempt, pods):
        pod = existing.get((role, index))
        label = f"{role.value}-{index} of attempt {attempt}"
        if pod is None:
            losses[(role, index)] = Loss(
                Reason.POD_DELETED, f"participant {label}: its pod is gone"
            )
        elif pod.finished:
            losses[(role, index)] = Loss(
                Reason.POD_FAILED, f"participant {label} ({pod.name}): {pod.problem}"
            )
        elif pod.terminating and pod.name not in held:
            losses[(role, index)] = Loss(
                Reason.POD_DELETED, f"participant {label} ({pod.name}) is being deleted"
            )
        elif (node := nodes_of.get(pod.name)) is not None and node in lost_nodes:
            losses[(role, index)] = Loss(
                Reason.NODE_LOST, f"participant {label} ({pod.name}) ran on node {node}, NotReady"
            )
    return losses


async def observe(kube: Kube, rset: RolloutSet) -> tuple[list[PodView], dict[str, str], set[str]]:
    """The set's pods, the node of each, and which of those nodes are not Ready."""
    namespace = rset.metadata.namespace or "default"
    raw = await kube.list_pods(namespace, set_selector(rset.metadata.name))
    views = [v for v in (PodView.from_pod(p) for p in raw) if v is not None]
    nodes_of = {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in raw
        if (p.get("spec") or {}).get("nodeName")
    }
    lost: set[str] = set()
    for node_name in set(nodes_of.values()):
        node = await kube.get_node(node_name)
        if node is None:
            lost.add(node_name)
            continue
        ready = next(
            (c for c in (node.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"),
            None,
        )
        if ready is None or ready.get("status") != "True":
            lost.add(node_name)
    return views, nodes_of, lost


class RecoveryFailed(Exception):
    """Ends a recovery with this reason and message; the message (which may quote what a
    participant said) is cut to `MAX_MESSAGE_CHARS`, as it goes into the set's status."""

    def __init__(self, reason: str, message: str) -> None:
        message = truncate(message)
        super().__init__(message)
        self.reason = reason
        self.message = message


class InPlaceRefused(Exception):
    """An InPlace recovery cannot keep its survivors safely; the try falls back to Recreate."""


def phase_seconds_until(recovery: RecoveryStatus, now: datetime) -> dict[str, float]:
    """Seconds spent per phase, counting the current phase up to `now`."""
    spent = dict(recovery.phase_seconds)
    began = recovery.phase_started_at or recovery.started_at
    current = recovery.phase.value
    spent[current] = round(spent.get(current, 0.0) + max(0.0, (now - began).total_seconds()), 3)
    return spent


class RecoveryFlow:
    """Drives one set's `status.recovery` to completion (or to Degraded after maxRestarts)."""

    def __init__(
        self,
        kube: Kube,
        *,
        clock: Callable[[], float] = time.time,
        on_transition: Callable[[RolloutSet, str, str, bool], Awaitable[None]] | None = None,
        waits: RecoveryWaits = RecoveryWaits(),
    ) -> None:
        self._kube = kube
        self._writer = SetStatusWriter(kube, StatusOwner.RECOVERY)
        self._clock = clock
        self._on_transition = on_transition
        self._waits = waits

    # --- persistence --------------------------------------------------------------------------

    async def _read(self, namespace: str, name: str) -> RolloutSet | None:
        raw = await self._kube.get_set(namespace, name)
        return None if raw is None else RolloutSet.model_validate(raw)

    async def _patch(
        self,
        rset: RolloutSet,
        changes: dict[str, Any],
        conditions: list[ConditionUpdate] | None = None,
    ) -> RolloutSet:
        """Write `changes` and the merged `conditions` as the recovery (`SetStatusWriter`,
        which re-reads and writes again after a conflict, the conditions merged anew)."""

        def build(current: RolloutSet) -> dict[str, Any]:
            if not conditions:
                return changes
            merged = merge_conditions(
                current.status.conditions,
                conditions,
                observed_generation=current.metadata.generation,
            )
            return {**changes, "conditions": merged}

        try:
            return await self._writer.write_retrying(rset, build)
        except SetGone:
            raise RecoveryFailed("SetDeleted", "the RolloutSet was deleted") from None
        except Conflict:
            raise RecoveryFailed(
                "StatusConflict", "could not write the set's status (conflicts)"
            ) from None

    async def _set_phase(self, rset: RolloutSet, phase: RecoveryPhase, **fields: Any) -> RolloutSet:
        recovery = rset.status.recovery
        assert recovery is not None
        now = utcnow()
        spent = phase_seconds_until(recovery, now)
        updated = recovery.model_copy(
            update={"phase": phase, "phase_seconds": spent, "phase_started_at": now, **fields}
        )
        message = f"attempt {updated.from_attempt} -> {updated.target_attempt}: {phase.value}" + (
            f" (checkpoint {updated.checkpoint})" if updated.checkpoint else ""
        )
        rset = await self._patch(
            rset,
            {"recovery": updated},
            [ConditionUpdate.of(SetConditionType.RECOVERING.value, True, phase.value, message)],
        )
        logger.info("set %s recovery: %s", rset.metadata.name, message)
        return rset

    # --- start --------------------------------------------------------------------------------

    async def start(self, rset: RolloutSet, loss: Loss) -> RolloutSet:
        """Record the loss: from now on the recovery owns the set's pods and conditions.

        A resume after suspend (`Loss` with reason `Resumed`, see `policy.resume_due`) starts
        the same way, but no pod is left to keep (Recreate) and it is not counted against
        `maxRestarts` (a queueing system may suspend and resume a set many times)."""
        attempt = rset.status.attempt or 1
        resume = loss.reason == RESUMED_REASON
        policy = RestorePolicy.RECREATE if resume else rset.spec.recovery.restore_policy
        now = utcnow()
        recovery = RecoveryStatus(
            phase=RecoveryPhase.STOPPING_ATTEMPT,
            from_attempt=attempt,
            target_attempt=attempt + 1,
            started_at=now,
            phase_started_at=now,
            reason=loss.reason,
            message=loss.message,
            restore_policy=policy,
        )
        replacing = (
            "replacing the lost participants (InPlace)"
            if policy is RestorePolicy.IN_PLACE
            else "replacing every participant"
        )
        message = (
            loss.message if resume else f"{loss.message}; {replacing} under attempt {attempt + 1}"
        )
        changes: dict[str, Any] = {"recovery": recovery}
        if not resume:
            starts = kept_starts(
                rset.status.recovery_starts,
                now,
                window_seconds=rset.spec.recovery.window_seconds,
                bound=MAX_RECOVERY_STARTS,
            )
            changes["recoveryStarts"] = [format_time(t) for t in starts]
        rset = await self._patch(
            rset,
            changes,
            [
                ConditionUpdate.of(SetConditionType.RECOVERING.value, True, loss.reason, message),
                ConditionUpdate.of(SetConditionType.READY.value, False, loss.reason, message),
                ConditionUpdate.of(SetConditionType.PROGRESSING.value, True, loss.reason, message),
            ],
        )
        if self._on_transition is not None:
            await self._on_transition(rset, loss.reason, message, not resume)
        return rset

    async def churn(self, rset: RolloutSet, loss: Loss) -> tuple[ChurnDecision, RolloutSet]:
        """Whether this loss may start a recovery now (see `churn.decide`). Past the bound the
        set is held: Degraded=True, RecoveryLimitReached, naming the loss (role, container,
        exit code), until the spec or the retry-recovery annotation changes."""
        token = rset.metadata.annotations.get(ANNOTATION_RETRY_RECOVERY)
        hold = rset.status.recovery_hold
        if hold is not None:
            if hold.generation == rset.metadata.generation and hold.retry_token == token:
                return ChurnDecision(recent=0, stop=hold.message), rset
            logger.info(
                "set %s: retrying recovery (spec or retry-recovery changed)", rset.metadata.name
            )
            rset = await self._patch(rset, {"recoveryHold": None, "recoveryStarts": []})
        recovery = rset.spec.recovery
        decision = decide(
            rset.status.recovery_starts,
            utcnow(),
            max_restarts=recovery.max_restarts,
            window_seconds=recovery.window_seconds,
        )
        if decision.stop is None:
            return decision, rset
        message = (
            f"recovery stopped: {loss.message}; {decision.stop}. Fix the cause, then change the "
            f"spec or run `kubectl annotate rset {rset.metadata.name} "
            f"{ANNOTATION_RETRY_RECOVERY}=<new value> --overwrite` to retry"
        )
        hold = RecoveryHold(
            since=utcnow(), message=message, generation=rset.metadata.generation, retry_token=token
        )
        rset = await self._patch(
            rset,
            {"recoveryHold": hold},
            [
                ConditionUpdate.of(
                    SetConditionType.DEGRADED.value, True, Reason.RECOVERY_LIMIT, message
                ),
                ConditionUpdate.of(
                    SetConditionType.READY.value, False, Reason.RECOVERY_LIMIT, message
                ),
            ],
        )
        logger.warning("set %s: %s", rset.metadata.name, message)
        if self._on_transition is not None:
            await self._on_transition(rset, Reason.RECOVERY_LIMIT, message, True)
        return decision, rset

    # --- the flow -------------------------------------------------------------------------------

    async def run(self, namespace: str, name: str) -> None:
        rset = await self._read(namespace, name)
        if rset is None or rset.status.recovery is None:
            return
        recovery = rset.status.recovery
        # One trace per recovery: its id derives from the set's uid and the recovery's start,
        # so an operator that continues the recovery after a restart adds to the same trace.
        with tracing.root_span(
            f"recovery {namespace}/{name}",
            key=f"recovery/{rset.metadata.uid or namespace + '/' + name}/"
            f"{format_time(recovery.started_at)}",
            attributes={
                "rollout.set": name,
                "rollout.namespace": namespace,
                "rollout.from_attempt": recovery.from_attempt,
                "rollout.reason": recovery.reason or "",
                "rollout.continued_from": recovery.phase.value,
            },
        ) as root:
            rset = await self._run(rset)
            if rset is not None:
                root.set_attribute("rollout.attempt", rset.status.attempt or 0)

    async def _run(self, rset: RolloutSet | None) -> RolloutSet | None:
        """Each phase in a span of the recovery's trace, until no recovery is left."""
        while rset is not None and rset.status.recovery is not None:
            recovery = rset.status.recovery
            if recovery.tries > rset.spec.recovery.max_restarts:
                return rset  # exhausted: Degraded until a person acts (see `_try_failed`)
            with tracing.span(
                recovery.phase.value, attributes={"rollout.target_attempt": recovery.target_attempt}
            ):
                try:
                    match recovery.phase:
                        case RecoveryPhase.STOPPING_ATTEMPT:
                            rset = await self._stop_attempt(rset)
                        case RecoveryPhase.STARTING_PODS:
                            rset = await self._start_pods(rset)
                        case RecoveryPhase.RESTORING:
                            rset = await self._restore(rset)
                        case RecoveryPhase.RESUMING:
                            rset = await self._resume(rset)
                        case RecoveryPhase.BACKING_OFF:
                            rset = await self._back_off(rset)
                except RecoveryFailed as failed:
                    tracing.failed(failed.reason, failed.message)
                    rset = await self._try_failed(rset, failed)
        return rset

    async def _stop_attempt(self, rset: RolloutSet) -> RolloutSet:
        recovery = rset.status.recovery
        assert recovery is not None
        if recovery.restore_policy is RestorePolicy.IN_PLACE:
            try:
                return await self._keep_survivors(rset)
            except InPlaceRefused as refused:
                rset = await self._fall_back(rset, str(refused))
                recovery = rset.status.recovery
                assert recovery is not None
        fields: dict[str, Any] = {}
        if recovery.tries == 0 and recovery.fallback is None and not recovery.lost_work:
            fields["lost_work"] = await self._count_before_deleting(rset)
        # Every pod older than the target attempt goes: a survivor of the lost attempt would
        # keep running episodes that the restore also continues (they would complete twice).
        # Pods already labelled with the target attempt go too: an InPlace try kept them
        # (relabelled), and it failed or fell back. No pod of the target attempt was created
        # yet: that happens in the next phase.
        for attempt in range(recovery.from_attempt, recovery.target_attempt + 1):
            await delete_attempt_pods(self._kube, rset, attempt, grace_seconds=STOP_GRACE_SECONDS)
        replaced = [instance_name(i) for i in attempt_instances(rset, recovery.from_attempt, [])]
        # `nextTryAt` marks when this try began: its restoreTimeoutSeconds count from here.
        return await self._set_phase(
            rset,
            RecoveryPhase.STARTING_PODS,
            next_try_at=utcnow(),
            kept=[],
            replaced=replaced,
            **fields,
        )

    async def _count_before_deleting(self, rset: RolloutSet) -> list[LostWorkReport]:
        """Recreate: the pods that outlived the loss retire the lost attempt before they are
        deleted, and say what it did after its checkpoint (work the restore has done again).
        Best effort within `COUNT_RETIRE_SECONDS`: a pod that does not answer is deleted all
        the same, its work uncounted."""
        recovery = rset.status.recovery
        assert recovery is not None
        source = recovery.from_attempt
        pods, nodes_of, lost_nodes = await observe(self._kube, rset)
        losses = find_losses(rset, source, pods, nodes_of, lost_nodes)
        survivors = [
            p
            for p in pods
            if p.attempt == source
            and (p.role, p.index) not in losses
            and p.ip is not None
            and not p.finished
            and not p.terminating
        ]
        if not survivors:
            return []
        token = await read_control_token(
            self._kube, rset.metadata.namespace or "default", rset.metadata.name
        )
        if token is None:
            return []
        reachable = [p for p in survivors if rset.spec.participant(p.role) is not None]
        try:
            retired = await self._retire_source(
                rset,
                reachable,
                token,
                seconds=COUNT_RETIRE_SECONDS,
                operation_id=f"recreate-a{source}-a{recovery.target_attempt}",
                lost_roles={role for role, _ in losses},
            )
        except (OSError, TimeoutError) as error:
            logger.info("set %s: survivors did not report lost work: %s", rset.metadata.name, error)
            return []
        if retired.failures:
            logger.info(
                "set %s: work of %s uncounted: %s",
                rset.metadata.name,
                ", ".join(f.instance for f in retired.failures),
                "; ".join(str(f) for f in retired.failures[:3]),
            )
        return reported_losses(retired)

    async def _keep_survivors(self, rset: RolloutSet) -> RolloutSet:
        """InPlace: the kept pods retire the lost attempt and join the target; the lost go."""
        recovery = rset.status.recovery
        assert recovery is not None
        source, target = recovery.from_attempt, recovery.target_attempt
        pods, nodes_of, lost_nodes = await observe(self._kube, rset)
        lost = find_losses(rset, source, pods, nodes_of, lost_nodes)
        plan = plan_in_place(rset, source, target, pods, set(lost))
        if plan.refused is not None:
            raise InPlaceRefused(plan.refused)
        namespace = rset.metadata.namespace or "default"
        token = await read_control_token(self._kube, namespace, rset.metadata.name)
        if token is None:
            raise InPlaceRefused("the set's control-token Secret is missing")
        for pod in plan.kept:
            if pod.ip is None or rset.spec.participant(pod.role) is None:
                raise InPlaceRefused(f"kept pod {pod.name} has no address")
        retired = await self._retire_source(
            rset,
            plan.kept,
            token,
            seconds=self._waits.retire_seconds,
            operation_id=f"in-place-a{source}-a{target}",
            lost_roles={role for role, _ in plan.replaced},
        )
        if retired.failures:
            raise InPlaceRefused(
                f"kept pod(s) could not retire attempt {source}: "
                + "; ".join(str(f) for f in retired.failures[:3])
            )
        for pod in plan.kept:
            if pod.attempt == target:
                continue
            relabelled = await self._kube.patch_pod_metadata(
                namespace, pod.name, labels={LABEL_ATTEMPT: str(target)}
            )
            if not relabelled:
                raise InPlaceRefused(f"kept pod {pod.name} is gone")
        # Only the lost pods are still labelled with the old attempt now.
        await delete_attempt_pods(self._kube, rset, source, grace_seconds=STOP_GRACE_SECONDS)
        kept = [p.name for p in plan.kept]
        replaced = [instance_name(i) for i in plan.replaced]
        logger.info(
            "set %s InPlace: keeping %s, replacing %s under attempt %d",
            rset.metadata.name,
            ", ".join(kept),
            ", ".join(replaced),
            target,
        )
        return await self._set_phase(
            rset,
            RecoveryPhase.STARTING_PODS,
            next_try_at=utcnow(),
            kept=kept,
            replaced=replaced,
            lost_work=reported_losses(retired),
        )

    async def _retire_source(
        self,
        rset: RolloutSet,
        pods: Sequence[PodView],
        token: str,
        *,
        seconds: float,
        operation_id: str,
        lost_roles: set[Role],
    ) -> RetireOutcome:
        """The `pods` (each with an address and a participant spec) retire the recovery's source
        attempt within `seconds`, and say what it did after its checkpoint (both policies: the
        survivors Recreate deletes, the pods InPlace keeps)."""
        recovery = rset.status.recovery
        assert recovery is not None
        clients: list[HttpParticipantClient] = []
        for pod in pods:
            spec = rset.spec.participant(pod.role)
            assert pod.ip is not None
            assert spec is not None
            url = participant_url(pod.ip, control_port(spec.template))
            clients.append(HttpParticipantClient(pod.role, url, index=pod.index, token=token))
        try:
            return await Coordinator(clients).retire(
                recovery.from_attempt,
                None,
                self._clock() + seconds,
                operation_id=operation_id,
                finished_from=finished_from(lost_roles),
            )
        finally:
            for client in clients:
                await client.aclose()

    async def _fall_back(self, rset: RolloutSet, why: str) -> RolloutSet:
        """Recreate from here on, saying why on the Recovering condition and in an Event."""
        recovery = rset.status.recovery
        assert recovery is not None
        message = f"InPlace recovery not possible, replacing every participant instead: {why}"
        logger.warning("set %s: %s", rset.metadata.name, message)
        updated = recovery.model_copy(
            update={"restore_policy": RestorePolicy.RECREATE, "fallback": why}
        )
        rset = await self._patch(
            rset,
            {"recovery": updated},
            [
                ConditionUpdate.of(
                    SetConditionType.RECOVERING.value, True, Reason.IN_PLACE_FALLBACK, message
                )
            ],
        )
        if self._on_transition is not None:
            await self._on_transition(rset, Reason.IN_PLACE_FALLBACK, message, True)
        return rset

    def _try_deadline(self, rset: RolloutSet) -> float:
        recovery = rset.status.recovery
        assert recovery is not None
        begun = (recovery.next_try_at or recovery.started_at).timestamp()
        return max(begun, 0.0) + rset.spec.recovery.restore_timeout_seconds

    async def _adopt_standbys(self, rset: RolloutSet) -> RolloutSet:
        """Take Ready standby pods for the target attempt's missing instances
        (docs/design.md#62-recovery).

        An adopted standby is relabelled into the target attempt under the lost instance's
        index (and marked with `ANNOTATION_ADOPTED`), so the attempt's plan counts it and
        creates fresh pods only for what no standby covers; the restore then gives it the
        instance's identity and peers. Only when a checkpoint will be restored (the restore is
        what re-identifies it). Idempotent: after an operator restart the annotation says which
        pods were adopted, and `recovery.adopted` is written from it."""
        recovery = rset.status.recovery
        assert recovery is not None
        target = recovery.target_attempt
        if not rset.spec.standby.wanted() and not recovery.adopted:
            return rset
        if await self._restorable_checkpoint(rset) is None:
            return rset
        namespace = rset.metadata.namespace or "default"
        raw = await self._kube.list_pods(namespace, set_selector(rset.metadata.name))
        views, nodes_of, lost_nodes = await observe(self._kube, rset)
        present = {(p.role, p.index) for p in views if p.attempt == target}
        missing = [i for i in attempt_instances(rset, target, views) if i not in present]
        # A standby on a node that is not Ready still shows Ready until the node controller
        # marks its pods: never adopt it (its restore would hang, the try fail).
        standbys = [
            s
            for s in standby_views(raw, rset.metadata.name)
            if nodes_of.get(s.name) not in lost_nodes
        ]
        picks = adoptions(rset, missing, standbys)
        for instance, standby in picks.items():
            index = instance[1]
            relabelled = await self._kube.patch_pod_metadata(
                namespace,
                standby.name,
                labels={LABEL_ATTEMPT: str(target), LABEL_INDEX: str(index), LABEL_STANDBY: None},
                annotations={ANNOTATION_ADOPTED: f"{instance_name(instance)}@{target}"},
            )
            if relabelled:
                logger.info(
                    "set %s: standby pod %s adopted as %s under attempt %d",
                    rset.metadata.name,
                    standby.name,
                    instance_name(instance),
                    target,
                )
        raw = await self._kube.list_pods(namespace, set_selector(rset.metadata.name))
        # Adopted by this recovery (the annotation names the attempt): a pod adopted by an
        # earlier one and kept since is an ordinary participant now.
        adopted = sorted(
            f"{instance}={meta['name']}"
            for meta in (p.get("metadata") or {} for p in raw)
            for instance, _, when in [
                str((meta.get("annotations") or {}).get(ANNOTATION_ADOPTED, "")).partition("@")
            ]
            if instance
            and when == str(target)
            and (meta.get("labels") or {}).get(LABEL_ATTEMPT) == str(target)
        )
        if adopted == recovery.adopted:
            return rset
        return await self._patch(
            rset, {"recovery": recovery.model_copy(update={"adopted": adopted})}
        )

    async def _start_pods(self, rset: RolloutSet) -> RolloutSet:
        rset = await self._adopt_standbys(rset)
        recovery = rset.status.recovery
        assert recovery is not None
        target = recovery.target_attempt
        deadline = self._try_deadline(rset)
        while True:
            pods = await observe_pods(
                self._kube, rset.metadata.namespace or "default", rset.metadata.name
            )
            outcome = await reconcile_pods(self._kube, rset, target, pods)
            plan = outcome.plan
            failed = [p for p in plan.existing.values() if p.finished]
            if failed:
                raise RecoveryFailed(
                    Reason.PODS_NOT_READY,
                    f"replacement pod {failed[0].name} ended: {failed[0].problem}",
                )
            if outcome.errors:
                raise RecoveryFailed(Reason.PODS_NOT_READY, "; ".join(outcome.errors[:3]))
            if plan.all_ready:
                break
            stranded = await self._on_lost_nodes(rset, list(plan.existing.values()))
            if stranded:
                raise RecoveryFailed(Reason.PODS_NOT_READY, stranded)
            if self._clock() > deadline:
                waiting = [p.pod for p in plan.participants if not p.ready]
                raise RecoveryFailed(
                    Reason.PODS_NOT_READY,
                    f"pods of attempt {target} not Ready within restoreTimeoutSeconds "
                    f"({rset.spec.recovery.restore_timeout_seconds}): {', '.join(waiting[:5])}",
                )
            # The pods' events end the wait (the cache's view of them costs no request).
            await self._kube.cache.wait_for_change(
                rset.metadata.namespace or "default", rset.metadata.name, POLL_SECONDS
            )
            fresh = await self._read(rset.metadata.namespace or "default", rset.metadata.name)
            if fresh is None:
                raise RecoveryFailed("SetDeleted", "the RolloutSet was deleted")
            if fresh.status.recovery is None:
                # Removed by hand: the next pass starts it again (restart_unfinished_recovery).
                raise RecoveryFailed("RecoveryRemoved", "status.recovery was removed")
            rset = fresh
        rset = await self._patch(rset, {"participants": plan.participants})
        checkpoint = await self._restorable_checkpoint(rset)
        return await self._set_phase(rset, RecoveryPhase.RESTORING, checkpoint=checkpoint)

    async def _on_lost_nodes(self, rset: RolloutSet, pods: list[PodView]) -> str | None:
        """Why a replacement pod can never become Ready: the scheduler placed it on a node that
        is NotReady (it may do so in the seconds before the node lifecycle controller taints a
        lost node). Failing the try at once lets the next attempt's pods land elsewhere,
        instead of waiting out restoreTimeoutSeconds."""
        waiting = {p.name for p in pods if not p.ready}
        if not waiting:
            return None
        _, nodes_of, lost_nodes = await observe(self._kube, rset)
        for name in sorted(waiting):
            node = nodes_of.get(name)
            if node is not None and node in lost_nodes:
                return f"replacement pod {name} was placed on node {node}, which is NotReady"
        return None

    async def _restorable_checkpoint(self, rset: RolloutSet) -> str | None:
        """The newest Ready (published) checkpoint of this set; None when there is none.

        Read from the checkpoints, not from `status.latestCheckpoint`: status is user-writable,
        and a name written there (an older checkpoint, another set's, none at all) must not
        decide what is restored (docs/design.md#610-status-written-by-hand). The two agree unless
        status was written."""
        if rset.spec.recovery.target_level is TargetLevel.SIBLING:
            return None
        namespace = rset.metadata.namespace or "default"
        listed = await self._kube.list_checkpoints(namespace, rset.metadata.name)
        newest = newest_ready(checkpoint_views(listed))
        name = newest.name if newest is not None else None
        if name != rset.status.latest_checkpoint:
            logger.warning(
                "set %s: status.latestCheckpoint says %r, its newest Ready checkpoint is %r: "
                "restoring %r",
                rset.metadata.name,
                rset.status.latest_checkpoint,
                name,
                name,
            )
        return name

    async def _still_restorable(self, rset: RolloutSet) -> RolloutSet:
        """Check `recovery.checkpoint` against the cluster before restoring it: a Ready
        checkpoint of this set. Anything else (written by hand: another set's checkpoint, a
        Failed or missing one) is replaced by the newest Ready one (or a fresh start), with an
        Event, before a restore could fail on it and mark it invalid."""
        recovery = rset.status.recovery
        assert recovery is not None
        if recovery.checkpoint is None:
            return rset
        ckpt = await self._read_checkpoint(rset, recovery.checkpoint)
        if ckpt is not None and is_true(ckpt.status.conditions, "Ready"):
            return rset
        pick = await self._restorable_checkpoint(rset)
        why = "does not exist" if ckpt is None else "is not Ready"
        message = (
            f"status.recovery.checkpoint said {recovery.checkpoint!r}, but no checkpoint of set "
            f"{rset.metadata.name} by that name {why}: restoring "
            + (f"{pick} instead" if pick else "nothing (no Ready checkpoint: a fresh start)")
            + f"; {NOT_AN_INTERFACE}"
        )
        logger.warning("set %s: %s", rset.metadata.name, message)
        rset = await self._set_phase(rset, RecoveryPhase.RESTORING, checkpoint=pick)
        if self._on_transition is not None:
            await self._on_transition(rset, REPAIRED, message, True)
        return rset

    async def _coordinator(
        self, rset: RolloutSet
    ) -> tuple[Coordinator, list[HttpParticipantClient]]:
        namespace = rset.metadata.namespace or "default"
        token = await read_control_token(self._kube, namespace, rset.metadata.name)
        if token is None:
            raise RecoveryFailed("TokenMissing", "the set's control-token Secret is missing")
        participants = [
            HttpParticipantClient(p.role, p.address, index=p.index, token=token)
            for p in rset.status.participants
            if p.address
        ]
        if len(participants) != len(rset.status.participants):
            raise RecoveryFailed(Reason.PODS_NOT_READY, "a replacement pod has no address")
        return Coordinator(participants), participants

    async def _restore(self, rset: RolloutSet) -> RolloutSet:
        rset = await self._still_restorable(rset)
        recovery = rset.status.recovery
        assert recovery is not None
        if recovery.checkpoint is None:
            return await self._set_phase(rset, RecoveryPhase.RESUMING)
        checkpoint = recovery.checkpoint
        # the rollouts a participant's commit listed: a NeMo Gym participant restores only those
        # it is told (docs/protocol.md, "The NeMo Gym dialect")
        ckpt = await self._read_checkpoint(rset, checkpoint)
        listed = {
            entry.instance: entry.rollout_ids
            for entry in (ckpt.status.participants if ckpt is not None else [])
            if entry.rollout_ids is not None
        }
        coordinator, clients = await self._coordinator(rset)
        adopted = adopted_instances(recovery.adopted)
        peers = rewiring(rset, rset.status.participants, set(recovery.kept), adopted.values())
        try:
            deadline = max(
                self._try_deadline(rset), self._clock() + self._waits.restore_floor_seconds
            )
            outcome = await self._while_pods_hold(
                rset,
                lambda: coordinator.restore(
                    checkpoint,
                    recovery.target_attempt,
                    deadline,
                    peers=peers,
                    adopted=list(adopted),
                    listed=listed,
                ),
            )
        finally:
            for client in clients:
                await client.aclose()
        if not outcome.ok:
            invalid = [f for f in outcome.failures if f.code is ErrorCode.RECORDS_INVALID]
            if invalid:
                detail = "; ".join(str(f) for f in invalid[:3])
                await self._invalidate(rset, recovery.checkpoint, detail)
                raise RecoveryFailed(
                    Reason.CHECKPOINT_INVALID,
                    f"the records of checkpoint {recovery.checkpoint} failed verification "
                    f"({detail}); it is marked Ready=False and the next try restores the "
                    "newest older Ready checkpoint, or starts fresh",
                )
            raise RecoveryFailed(
                Reason.RESTORE_FAILED,
                f"restore of {recovery.checkpoint} under attempt {recovery.target_attempt} "
                "failed (retired everywhere): " + "; ".join(str(f) for f in outcome.failures[:3]),
            )
        logger.info(
            "set %s: restored %d episode(s) of %s under attempt %d",
            rset.metadata.name,
            len(outcome.episodes),
            recovery.checkpoint,
            recovery.target_attempt,
        )
        return await self._set_phase(
            rset,
            RecoveryPhase.RESUMING,
            episodes_restored=len(outcome.episodes),
            kept_work=total_work(outcome.kept.values()),
        )

    async def _resume(self, rset: RolloutSet) -> RolloutSet | None:
        recovery = rset.status.recovery
        assert recovery is not None
        if recovery.checkpoint is not None:
            coordinator, clients = await self._coordinator(rset)
            checkpoint = recovery.checkpoint
            try:
                resumed = await self._while_pods_hold(
                    rset,
                    lambda: coordinator.resume(
                        checkpoint, self._clock() + self._waits.restore_floor_seconds
                    ),
                )
            finally:
                for client in clients:
                    await client.aclose()
            if resumed.failures:
                raise RecoveryFailed(
                    Reason.RESTORE_FAILED,
                    "resume after restore failed: "
                    + "; ".join(str(f) for f in resumed.failures[:3]),
                )
            reason = Reason.RESTORED
            how = f"restored checkpoint {recovery.checkpoint}"
        elif rset.spec.recovery.target_level is TargetLevel.SIBLING:
            reason, how = Reason.SIBLING_RESTART, "targetLevel sibling: episodes restart"
        else:
            reason, how = Reason.NO_CHECKPOINT, "no Ready checkpoint: episodes restart from scratch"
        now = utcnow()
        took = (now - recovery.started_at).total_seconds()
        kept = f"; kept {len(recovery.kept)} pod(s)" if recovery.kept else ""
        message = (
            f"recovered from {recovery.reason or 'a lost participant'} in {took:.0f}s: "
            f"attempt {recovery.target_attempt} runs; {how}{kept}"
        )
        last = await self._last_recovery(rset, recovery, now)
        rset = await self._patch(
            rset,
            {
                "recovery": None,
                "lastRecovery": last,
                "attempt": recovery.target_attempt,
                "createdAttempt": recovery.target_attempt,
                "restarts": rset.status.restarts + (1 if counts_as_restart(recovery) else 0),
            },
            [
                ConditionUpdate.of(SetConditionType.RECOVERING.value, False, reason, message),
                ConditionUpdate.of(SetConditionType.READY.value, True, reason, message),
                ConditionUpdate.of(SetConditionType.DEGRADED.value, False, reason, message),
            ],
        )
        if self._on_transition is not None:
            await self._on_transition(rset, reason, message, False)
        return rset

    async def _while_pods_hold(self, rset: RolloutSet, step: Callable[[], Awaitable[_T]]) -> _T:
        """Run a restore or resume step, cancelled as soon as a pod of the target attempt is
        lost: the next try starts at once instead of after the step's deadline (a call to a
        dead pod retries until then)."""
        recovery = rset.status.recovery
        assert recovery is not None
        target = recovery.target_attempt

        async def lost() -> str | None:
            try:
                pods, nodes_of, lost_nodes = await observe(self._kube, rset)
            except (ApiError, OSError, TimeoutError) as error:
                logger.debug("observing the pods of %s failed: %s", rset.metadata.name, error)
                return None
            losses = find_losses(rset, target, pods, nodes_of, lost_nodes)
            return next((loss.message for loss in losses.values()), None)

        async def next_look() -> None:
            await self._kube.cache.wait_for_change(
                rset.metadata.namespace or "default", rset.metadata.name, POLL_SECONDS
            )

        try:
            return await while_holding(step, lost, next_look)
        except NoLongerHolds as broken:
            raise RecoveryFailed(
                Reason.REPLACEMENT_LOST, f"{broken}; the next try starts now"
            ) from None

    async def _invalidate(self, rset: RolloutSet, name: str, detail: str) -> None:
        """Verification failures are permanent: the checkpoint is no longer restorable.

        Its Ready condition turns False (reason RecordsInvalid, phase Failed), so no later
        recovery tries it again, retention treats its records as garbage, and the set's pass
        moves `latestCheckpoint` to the newest other Ready checkpoint."""
        namespace = rset.metadata.namespace or "default"
        ckpt = await self._read_checkpoint(rset, name)
        if ckpt is not None:
            message = truncate(f"restore verification failed, not restorable: {detail}", 1000)
            conditions = ckpt.status.conditions
            for type_, status in (
                (CheckpointConditionType.READY, False),
                (CheckpointConditionType.FAILED, True),
            ):
                conditions = set_condition(
                    conditions,
                    type_.value,
                    status,
                    CHECKPOINT_RECORDS_INVALID,
                    message,
                    observed_generation=ckpt.metadata.generation,
                )
            await self._kube.patch_checkpoint_status(
                namespace,
                name,
                {
                    "phase": CheckpointPhase.FAILED.value,
                    "conditions": [dump(c) for c in conditions],
                },
            )
        logger.warning(
            "set %s: checkpoint %s is not restorable: %s", rset.metadata.name, name, detail
        )

    async def _last_recovery(
        self, rset: RolloutSet, recovery: RecoveryStatus, now: datetime
    ) -> LastRecovery:
        """What this recovery kept and lost, for status, the printer columns and metrics."""
        spent = phase_seconds_until(recovery, now)
        age: float | None = None
        restarted = 0
        if recovery.checkpoint is not None:
            ckpt = await self._read_checkpoint(rset, recovery.checkpoint)
            if ckpt is not None:
                restarted = ckpt.status.restarts or 0
                completed = ckpt.status.completed_at
                if completed is not None:
                    age = max(0.0, (recovery.started_at - completed).total_seconds())
        loss = work_loss(
            checkpoint=recovery.checkpoint,
            instances=[
                instance_name(i) for i in attempt_instances(rset, recovery.from_attempt, [])
            ],
            reports=recovery.lost_work,
            kept=recovery.kept_work,
        )
        return LastRecovery(
            completed_at=now,
            reason=recovery.reason or "Unknown",
            attempt=recovery.target_attempt,
            restore_policy=recovery.restore_policy,
            kept=len(recovery.kept),
            replaced=len(recovery.replaced),
            adopted=recovery.adopted,
            checkpoint=recovery.checkpoint,
            checkpoint_age_seconds=None if age is None else round(age, 3),
            episodes_restored=recovery.episodes_restored or 0,
            episodes_restarted=restarted,
            duration_seconds=round(max(0.0, (now - recovery.started_at).total_seconds()), 3),
            phase_seconds=spent,
            model_tokens_kept=loss.model_tokens_kept,
            model_tokens_generated_again=loss.model_tokens_generated_again,
            steps_kept=loss.steps_kept,
            steps_redone=loss.steps_redone,
            work_uncounted=loss.uncounted,
        )

    async def _read_checkpoint(self, rset: RolloutSet, name: str) -> RolloutCheckpoint | None:
        """The RolloutCheckpoint `name` of this set; None when there is none, or when the name
        is another set's (a name read from status may have been written by hand: the flow
        never restores, nor marks invalid, a checkpoint of another set)."""
        raw = await self._kube.get_checkpoint(rset.metadata.namespace or "default", name)
        if raw is None:
            return None
        ckpt = RolloutCheckpoint.model_validate(raw)
        return ckpt if ckpt.spec.rollout_set == rset.metadata.name else None

    async def _try_failed(
        self, rset: RolloutSet | None, failed: RecoveryFailed
    ) -> RolloutSet | None:
        if rset is None:
            return None
        namespace = rset.metadata.namespace or "default"
        fresh = await self._read(namespace, rset.metadata.name)
        if fresh is None or fresh.status.recovery is None:
            return fresh
        rset = fresh
        recovery = rset.status.recovery
        assert recovery is not None
        # A checkpoint whose records failed verification is not the pods' fault: the next try
        # restores another checkpoint, and every invalid one is tried at most once.
        counted = failed.reason != Reason.CHECKPOINT_INVALID
        tries = recovery.tries + (1 if counted else 0)
        logger.warning(
            "set %s recovery try %d failed: %s: %s",
            rset.metadata.name,
            tries,
            failed.reason,
            failed.message,
        )
        if tries > rset.spec.recovery.max_restarts:
            message = (
                f"gave up after {tries} tries (recovery.maxRestarts "
                f"{rset.spec.recovery.max_restarts}); last: {failed.message}. Fix the cause and "
                "delete the failed pods, or raise maxRestarts"
            )
            rset = await self._patch(
                rset,
                {"recovery": recovery.model_copy(update={"tries": tries})},
                [
                    ConditionUpdate.of(
                        SetConditionType.DEGRADED.value, True, Reason.RESTARTS_EXHAUSTED, message
                    ),
                    ConditionUpdate.of(
                        SetConditionType.RECOVERING.value, False, Reason.RESTARTS_EXHAUSTED, message
                    ),
                ],
            )
            await self._failed_try_event(rset, failed)
            return None
        delay = min(MAX_BACKOFF_SECONDS, 2.0 ** min(tries, 10)) if counted else 1.0
        next_try = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=delay)
        rset = await self._set_phase(
            rset,
            RecoveryPhase.BACKING_OFF,
            tries=tries,
            next_try_at=next_try,
            message=f"{failed.reason}: {failed.message}",
        )
        await self._failed_try_event(rset, failed)
        return rset

    async def _failed_try_event(self, rset: RolloutSet, failed: RecoveryFailed) -> None:
        """The failed try's Event, posted once the status that records it was written
        (docs/design.md#69-who-writes-the-sets-status)."""
        if self._on_transition is not None:
            await self._on_transition(rset, failed.reason, failed.message, True)

    async def _back_off(self, rset: RolloutSet) -> RolloutSet:
        recovery = rset.status.recovery
        assert recovery is not None
        if recovery.next_try_at is not None:
            wait = recovery.next_try_at.timestamp() - self._clock()
            if wait > 0:
                await anyio.sleep(wait)
        # The failed try's attempt was retired everywhere (kept pods included); the next try
        # needs fresh pods, all of them. A failed InPlace try (a kept pod lost or refusing
        # during the restore) falls back like a refused plan does: reason InPlaceFallback on
        # the Recovering condition and an Event, so the user learns why the kept pods went.
        if recovery.restore_policy is RestorePolicy.IN_PLACE:
            rset = await self._fall_back(
                rset, f"the InPlace try failed: {recovery.message or 'see events'}"
            )
            recovery = rset.status.recovery
            assert recovery is not None
        return await self._set_phase(
            rset, RecoveryPhase.STOPPING_ATTEMPT, target_attempt=recovery.target_attempt + 1
        )


async def repair_false_recovery(kube: Kube, namespace: str, name: str) -> Repair | None:
    """Remove a `status.recovery` that no lost participant explains
    (docs/design.md#610-status-written-by-hand).

    A recovery stops every pod of the running attempt and restores the latest checkpoint into
    fresh ones: taking one written by hand (`kubectl patch --subresource=status`) for real
    would disrupt every episode for nothing. A recovery the operator started begins in
    StoppingAttempt from the set's current attempt because a participant of it was lost, and
    that loss stays visible until the recovery acts: the pod is gone, finished, terminating or
    on a NotReady node. One that has not tried yet, shows no such loss and no pod of a later
    attempt is removed, with an Event; anything else is left to the recovery flow."""
    raw = await kube.get_set(namespace, name)
    if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
        return None
    try:
        rset = RolloutSet.model_validate(raw)
    except ValidationError:
        return None
    status = rset.status
    recovery = status.recovery
    if (
        recovery is None
        or recovery.phase is not RecoveryPhase.STOPPING_ATTEMPT
        or recovery.tries
        or recovery.reason == RESUMED_REASON
        or rset.spec.suspend
        or is_true(status.conditions, SetConditionType.SUSPENDED.value)
    ):
        return None
    attempt = status.attempt or 1
    if recovery.from_attempt != attempt or (status.created_attempt or 0) < attempt:
        return None
    pods, nodes_of, lost_nodes = await observe(kube, rset)
    if any(pod.attempt > attempt for pod in pods):
        return None  # the recovery acted already
    if find_losses(rset, attempt, pods, nodes_of, lost_nodes):
        return None
    message = (
        f"status.recovery said attempt {recovery.from_attempt} lost a participant "
        f"({recovery.reason or 'no reason'}), but every participant pod of attempt {attempt} "
        f"runs: removed it, no pod was stopped; {NOT_AN_INTERFACE}"
    )
    body: dict[str, Any] = {"recovery": None}
    if is_true(status.conditions, SetConditionType.RECOVERING.value):
        body["conditions"] = merge_conditions(
            status.conditions,
            [ConditionUpdate.of(SetConditionType.RECOVERING.value, False, REPAIRED, message)],
            observed_generation=rset.metadata.generation,
        )
    try:
        await SetStatusWriter(kube, StatusOwner.RECOVERY).write(rset, body)
    except Conflict:
        return None  # written meanwhile; the next pass looks again
    logger.warning("RolloutSet %s/%s: %s", namespace, name, message)
    return Repair(REPAIRED, message)


async def start_resume(kube: Kube, flow: RecoveryFlow, rset: RolloutSet, live_pods: int) -> bool:
    """Start the recovery of a resume when one is due (`policy.resume_due`: the policy cleared
    Suspended and none of the set's pods runs); whether it started."""
    if not resume_due(rset, live_pods):
        return False
    # Read again before a new attempt's pods are created: a suspend written meanwhile wins.
    namespace, name = rset.metadata.namespace or "default", rset.metadata.name
    raw = await kube.get_set(namespace, name, fresh=True)
    if raw is None:
        return False
    rset = RolloutSet.model_validate(raw)
    if not resume_due(rset, live_pods):
        return False
    attempt = rset.status.attempt or 1
    message = (
        f"resumed after suspend: attempt {attempt + 1} restores the latest Ready checkpoint "
        "into fresh pods"
    )
    logger.info("set %s: %s", name, message)
    await flow.start(rset, Loss(RESUMED_REASON, message))
    return True


@dataclass(frozen=True)
class RecoveryLook:
    """What one look at a set did: ran a recovery, or asks to look again at `retry_at`."""

    ran: bool
    retry_at: datetime | None = None


async def recover_if_needed(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    on_transition: Callable[[RolloutSet, str, str, bool], Awaitable[None]] | None = None,
    waits: RecoveryWaits = RecoveryWaits(),
) -> RecoveryLook:
    """One look at the set: continue a recovery, or start one when a participant was lost
    (unless the set lost participants too often: see `churn`).

    Says whether a recovery ran, and when to look again when one has to wait its turn.
    """
    raw = await kube.get_set(namespace, name)
    if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
        return RecoveryLook(ran=False)
    rset = RolloutSet.model_validate(raw)
    flow = RecoveryFlow(kube, on_transition=on_transition, waits=waits)
    if rset.status.recovery is None:
        pods, nodes_of, lost_nodes = await observe(kube, rset)
        live = sum(1 for p in pods if not (p.terminating or p.finished))
        if await start_resume(kube, flow, rset, live):
            await flow.run(namespace, name)
            return RecoveryLook(ran=True)
        terminating = any(p.terminating for p in pods)
        held = await eviction_holds(kube, rset) if terminating else frozenset()
        loss = detect_loss(rset, pods, nodes_of, lost_nodes, held)
        if loss is None:
            return RecoveryLook(ran=False)
        # Read the set again after the pods: whoever deletes pods on purpose marks the set
        # first (a suspend writes Suspended=True, then deletes), so a deletion seen above is
        # always explained by this read, never taken for a loss from a stale one (so it
        # must not come from the pass snapshot, which may hold the read from before the pods).
        raw = await kube.get_set(namespace, name, fresh=True)
        if raw is None:
            return RecoveryLook(ran=False)
        rset = RolloutSet.model_validate(raw)
        if rset.status.recovery is None:
            loss = detect_loss(rset, pods, nodes_of, lost_nodes, held)
            if loss is None:
                return RecoveryLook(ran=False)
            decision, rset = await flow.churn(rset, loss)
            if decision.stop is not None:
                return RecoveryLook(ran=False)
            if decision.not_before is not None:
                return RecoveryLook(ran=False, retry_at=decision.not_before)
            logger.warning("set %s lost a participant: %s", name, loss.message)
            await flow.start(rset, loss)
    await flow.run(namespace, name)
    return RecoveryLook(ran=True)
