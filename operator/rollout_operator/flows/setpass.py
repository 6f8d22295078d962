"""The set's reconcile pass.

The operations on the objects a RolloutSet owns (the token Secret, Services, observing, creating
and deleting an attempt's pods) are in `cluster.objects`, shared with the recovery and checkpoint
flows. Here:

- `SetPass`: the set's pass, the last stage of the set loop's pass (`flows/reconciler.py`,
  `stagedpass`; `reconcile_set` runs it alone). It also
  derives the set's checkpoint fields from its checkpoints (`setstatus`) and, once a checkpoint
  is Ready, writes the latest-checkpoint hints on the pods it covers (`mark_covered_pods`),
  where the set's `checkpointPolicy.podHints` asks for them.
- `repair_set_attempt`: the set pass's own repair (docs/design.md#610-status-written-by-hand):
  an `attempt` or `createdAttempt` that contradicts the running pods is written back from them.
  It runs before the recovery looks at the set (`flows/reconciler.py`): a recovery acting on an
  attempt no pod runs would take the running pods for lost.

While `status.recovery` is set the recovery flow owns pod creation and the Ready, Progressing
and Degraded conditions; the set pass then only refreshes `status.participants` (with the
pods of the recovery's target attempt). The status is written through
`cluster.statuswriter.SetStatusWriter` as the set pass, which owns the fields
docs/design.md#69-who-writes-the-sets-status lists for it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Final

from pydantic import ValidationError
from rollout_protocol import Role

from .. import metrics
from ..cluster.kube import ApiError, Kube
from ..cluster.objects import (
    OwnedObjects,
    PodsOutcome,
    SetBlocked,
    check_storage_secret,
    ensure_control_token,
    ensure_services,
    observe_pods,
    reconcile_pods,
)
from ..cluster.statuswriter import PassStatus, SetDelta
from ..decide.policy.views import checkpoint_views, parse_time
from ..decide.queue import queue_holds
from ..decide.resources import (
    reserved_volume_notes,
    set_selector,
)
from ..decide.setplan import AttemptPlan, PodView, plan_attempt, set_conditions
from ..decide.setstatus import (
    NOT_AN_INTERFACE,
    REPAIRED,
    Repair,
    checkpoint_fields,
    finished_attempt,
)
from ..decide.standby import plan_standbys, standby_views
from ..model.api import (
    ANNOTATION_LATEST_CHECKPOINT,
    ANNOTATION_LATEST_CHECKPOINT_TIME,
    LABEL_ATTEMPT,
    LABEL_STANDBY,
    MAX_REPLICAS,
    MAX_TEMPLATE_BYTES,
    RolloutSet,
    RolloutSetStatus,
    SetConditionType,
    StandbyStatus,
    namespace_or_default,
)
from ..model.conditions import ConditionUpdate, merge_conditions, utcnow
from ..model.owners import StatusOwner
from .stagedpass import run_stages
from .state import LatestWritten

logger = logging.getLogger(__name__)

STANDBY_GRACE_SECONDS: Final = 1
"""Grace period of a standby pod that goes (stale, finished, surplus): it holds no episode."""
RESERVED_VOLUME: Final = "ReservedVolumeReplaced"
"""Event reason: a template volume used the storage volume's reserved name."""

REFERENCE_SERVER: Final = "rollout-server"
REFERENCE_NEEDS: Final[Mapping[Role, tuple[Role, ...]]] = MappingProxyType(
    {
        Role.ENVIRONMENT: (Role.AGENT, Role.RESOURCES),
        Role.AGENT: (Role.MODEL, Role.RESOURCES),
    }
)
"""The roles each reference server (`rollout-server <role>`) calls: without them no episode
can run. A custom server (examples/custom-environment) may call fewer (only the model)."""


def _runs_reference(container: dict[str, Any], role: Role) -> bool:
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    return (
        len(argv) >= 2 and argv[0].rsplit("/", 1)[-1] == REFERENCE_SERVER and argv[1] == role.value
    )


def missing_peers(rset: RolloutSet) -> SetBlocked | None:
    """A reference server whose peers the set lacks (an environment without an agent would be
    Ready while no episode can run); None when every reference server has its peers."""
    roles = {p.role for p in rset.spec.participants}
    for participant in rset.spec.participants:
        needs = REFERENCE_NEEDS.get(participant.role, ())
        containers = participant.template.model_dump(by_alias=True)["spec"]["containers"]
        if not any(_runs_reference(c, participant.role) for c in containers):
            continue
        missing = [role.value for role in needs if role not in roles]
        if missing:
            return SetBlocked(
                "MissingParticipant",
                f"participant {participant.role.value} runs the reference server "
                f"({REFERENCE_SERVER} {participant.role.value}), which calls "
                f"{' and '.join(r.value for r in needs)}, but the set has no "
                f"{' and no '.join(missing)}: no episode could run; add the missing roles (a "
                "custom server that needs fewer peers is not checked)",
            )
    return None


def spec_over_limits(rset: RolloutSet, max_replicas_per_role: int) -> SetBlocked | None:
    """Why the operator refuses to create pods for this spec (None when it fits): more
    replicas of a role than this install allows, or a pod template larger than
    `MAX_TEMPLATE_BYTES` (no schema can bound the size of an open object)."""
    for participant in rset.spec.participants:
        role = participant.role.value
        if participant.replicas > max_replicas_per_role:
            return SetBlocked(
                "ReplicasOverLimit",
                f"participant {role} asks for {participant.replicas} replicas; this operator "
                f"allows at most {max_replicas_per_role} per role (--max-replicas-per-role, "
                "chart value operator.maxReplicasPerRole); no pod was created. Lower replicas "
                "or raise the limit at install",
            )
        size = len(participant.template.model_dump_json(by_alias=True, exclude_none=True))
        if size > MAX_TEMPLATE_BYTES:
            return SetBlocked(
                "TemplateTooLarge",
                f"the pod template of participant {role} is {size} bytes as JSON, at most "
                f"{MAX_TEMPLATE_BYTES}; no pod was created. Move large values into a "
                "ConfigMap or Secret and mount it",
            )
    return None


async def repair_set_attempt(kube: Kube, rset: RolloutSet) -> SetDelta | None:
    """Write back the attempt the set's live pods run when status says another one.

    Only while no recovery runs (a recovery moves pods between attempts on purpose). A set
    without live pods (new, suspended, every pod lost) shows no attempt; status stands. Pods of
    an attempt above the last one the set finished bringing up (`finished_attempt`) are not
    adopted: a recovery created them and never restored them, and the recovery's own repair
    (`recovery.repair_unfinished_recovery`) starts it again. Returns the repair as the set
    pass's delta over the pass's snapshot, its Event with it."""
    status = rset.status
    if status.recovery is not None:
        return None
    namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
    running = {pod.attempt for pod in await observe_pods(kube, namespace, name) if pod.live}
    if not running or max(running) > finished_attempt(rset):
        return None
    attempt = max(running)
    patch: dict[str, Any] = {}
    if (status.attempt or 1) != attempt:
        patch["attempt"] = attempt
    # An attempt above 1 was brought up by a finished recovery, which wrote createdAttempt.
    if attempt > 1 and (status.created_attempt or 0) < attempt:
        patch["createdAttempt"] = attempt
    if not patch:
        return None
    written = ", ".join(f"{key} {value}" for key, value in sorted(patch.items()))
    message = (
        f"status said attempt {status.attempt} (createdAttempt {status.created_attempt}), but "
        f"the set's running pods carry {LABEL_ATTEMPT}={attempt}: wrote back {written} from the "
        f"pods; {NOT_AN_INTERFACE}"
    )
    logger.warning("RolloutSet %s/%s: %s", namespace, name, message)
    return SetDelta(StatusOwner.SET_PASS, patch, events=((REPAIRED, message),), requeue=True)


@dataclass(frozen=True)
class ReconcileOutcome:
    recheck_at: datetime | None = None
    """Look again at this time even without events (a progress deadline)."""
    conflict: bool = False
    """The status write lost a race; reconcile again at once."""
    warnings: tuple[tuple[str, str], ...] = ()
    """(reason, message) of Warning Events to post once (the caller deduplicates)."""


def _blocked_status(
    obj: dict[str, Any], generation: int | None, reason: str, message: str
) -> dict[str, Any]:
    status = RolloutSetStatus.model_validate(obj.get("status") or {})
    conditions = merge_conditions(
        status.conditions,
        [
            ConditionUpdate.of(SetConditionType.READY.value, False, reason, message),
            ConditionUpdate.of(SetConditionType.PROGRESSING.value, False, reason, message),
            ConditionUpdate.of(SetConditionType.DEGRADED.value, True, reason, message),
        ],
        observed_generation=generation,
    )
    return {"observedGeneration": generation, "conditions": conditions}


async def _checkpoint_changes(
    kube: Kube, rset: RolloutSet, latest_written: LatestWritten
) -> tuple[dict[str, Any], Repair | None, list[dict[str, Any]]]:
    """The set's checkpoint fields (`setstatus`), the Repair to report, and the checkpoints."""
    namespace = namespace_or_default(rset.metadata.namespace)
    listed = await kube.list_checkpoints(namespace, rset.metadata.name)
    last = latest_written.last(namespace, rset.metadata.name)
    fields, repair = checkpoint_fields(rset, checkpoint_views(listed), last)
    return fields, repair, listed


async def mark_covered_pods(
    kube: Kube, rset: RolloutSet, latest: str | None, checkpoints: list[dict[str, Any]]
) -> None:
    """Annotate the pods the set's latest checkpoint covers (those that were running when it
    started) with its name and completion time, where they do not say so already: one patch
    per pod per checkpoint, after it is Ready, off its critical path. Only for a set whose
    `checkpointPolicy.podHints` asks for them (docs/operations.md, "Which pod to preempt"): each
    patch comes back as a pod event to every watcher. Best effort: a pod that is gone or a
    refused patch is logged."""
    if latest is None or not rset.spec.checkpoint_policy.pod_hints:
        return
    ckpt = next((c for c in checkpoints if c["metadata"]["name"] == latest), None)
    status = (ckpt or {}).get("status") or {}
    started, completed = parse_time(status.get("startedAt")), status.get("completedAt")
    if started is None or not isinstance(completed, str):
        return
    namespace = namespace_or_default(rset.metadata.namespace)
    hints = {ANNOTATION_LATEST_CHECKPOINT: latest, ANNOTATION_LATEST_CHECKPOINT_TIME: completed}
    for pod in await kube.list_pods(namespace, set_selector(rset.metadata.name)):
        meta = pod.get("metadata") or {}
        created = parse_time(meta.get("creationTimestamp"))
        if meta.get("deletionTimestamp") or created is None or created > started:
            continue
        if (meta.get("labels") or {}).get(LABEL_STANDBY) == "true":
            continue  # in no attempt: no checkpoint covers it
        annotations = meta.get("annotations") or {}
        if all(annotations.get(k) == v for k, v in hints.items()):
            continue
        try:
            await kube.patch_pod_metadata(namespace, meta["name"], annotations=hints)
        except ApiError as error:
            logger.warning(
                "set %s: could not annotate pod %s: %s",
                rset.metadata.name,
                meta["name"],
                error.message,
            )


async def keep_standbys(
    kube: Kube, rset: RolloutSet, attempt: int, plan: AttemptPlan | None
) -> StandbyStatus | None:
    """Start and drop standby pods as `plan_standbys` says (`plan`: the running attempt's, or
    None while it is not up); returns what the status shows. Creation errors are logged: the
    set runs without the standby and shows fewer ready."""
    namespace = namespace_or_default(rset.metadata.namespace)
    listed = await kube.list_pods(namespace, set_selector(rset.metadata.name))
    standbys = standby_views(listed, rset.metadata.name)
    if not standbys and not rset.spec.standby.wanted():
        return None
    decided = plan_standbys(rset, standbys, attempt, None if rset.spec.suspend else plan)
    for name in decided.delete:
        if await kube.delete_pod(namespace, name, grace_seconds=STANDBY_GRACE_SECONDS):
            logger.info("set %s: deleted standby pod %s", rset.metadata.name, name)
    for manifest in decided.create:
        pod = manifest["metadata"]["name"]
        try:
            if await kube.create_pod(namespace, manifest):
                metrics.standby_started(rset.metadata.name, namespace)
                logger.info("set %s: started standby pod %s", rset.metadata.name, pod)
        except ApiError as error:
            logger.warning(
                "set %s: standby pod %s not created: %s", rset.metadata.name, pod, error.message
            )
    return decided.status


async def reconcile_set(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    owned_objects: OwnedObjects,
    latest_written: LatestWritten,
    now: datetime | None = None,
    max_replicas_per_role: int = MAX_REPLICAS,
) -> ReconcileOutcome:
    """One reconcile pass of a RolloutSet alone (no repairs, no recovery: `SetPass` as the one
    stage of a pass, `stagedpass.run_stages`): token, Services, pods of the attempt, status."""
    stage = SetPass(
        kube,
        owned_objects=owned_objects,
        latest_written=latest_written,
        now=now,
        max_replicas_per_role=max_replicas_per_role,
    )
    ran = await run_stages(kube, namespace, name, [stage])
    return ReconcileOutcome(conflict=True) if ran.again else stage.outcome


@dataclass(frozen=True)
class _Written:
    """What the set pass does once its status is written: remember the latest checkpoint it
    wrote, hint the pods that checkpoint covers, report a repair."""

    rset: RolloutSet
    latest: str | None
    listed: list[dict[str, Any]]
    repair: Repair | None


class SetPass:
    """The set's pass, a stage of its loop's pass (`stagedpass`, after the repairs and the
    recovery's look: `flows/reconciler.py`): token, Services, pods of the attempt, and the
    status that shows them, as its delta over the pass's draft.

    `owned_objects` and `latest_written` are the process's memory of earlier passes
    (`OperatorState`, docs/design.md#611-the-operators-in-process-state): which sets' token and
    Services were ensured lately, and which `latestCheckpoint` each set's pass last wrote.
    `outcome` is the pass's outcome once it planned (its `conflict` is the caller's to set)."""

    def __init__(
        self,
        kube: Kube,
        *,
        owned_objects: OwnedObjects,
        latest_written: LatestWritten,
        now: datetime | None = None,
        max_replicas_per_role: int = MAX_REPLICAS,
    ) -> None:
        self._kube = kube
        self._owned_objects = owned_objects
        self._latest_written = latest_written
        self._now = now
        self._max_replicas_per_role = max_replicas_per_role
        self._written: _Written | None = None
        self.outcome = ReconcileOutcome()

    async def plan(self, draft: PassStatus) -> bool:
        """Add the set pass's delta (a blocked set's conditions, or everything it owns)."""
        kube = self._kube
        obj = draft.raw
        namespace = namespace_or_default(obj["metadata"].get("namespace"))
        name = obj["metadata"]["name"]
        try:
            rset = _validated(draft)
            await _ensure_startable(kube, rset, self._owned_objects, self._max_replicas_per_role)
        except SetBlocked as blocked:
            generation = obj["metadata"].get("generation")
            blocked_changes = _blocked_status(obj, generation, blocked.reason, blocked.message)
            draft.add(SetDelta(StatusOwner.SET_PASS, blocked_changes, delta_only=True))
            recheck = blocked.recheck_seconds
            now = self._now or utcnow()
            self.outcome = ReconcileOutcome(
                recheck_at=None if recheck is None else now + timedelta(seconds=recheck)
            )
            return False
        pods = await observe_pods(kube, namespace, name)
        recovery = rset.status.recovery
        if recovery is not None:
            # The recovery owns the attempt: the pass only shows its participants.
            plan = plan_attempt(rset, recovery.target_attempt, pods)
            changes: dict[str, Any] = {"participants": plan.participants}
            outcome = ReconcileOutcome()
        else:
            changes, outcome = await _attempt_changes(kube, obj, rset, pods, self._now or utcnow())
        fields, repair, listed = await _checkpoint_changes(kube, rset, self._latest_written)
        changes.update(fields)
        draft.add(SetDelta(StatusOwner.SET_PASS, changes, delta_only=True))
        latest = fields.get("latestCheckpoint", rset.status.latest_checkpoint)
        self._written = _Written(rset, latest, listed, repair)
        if repair is not None:
            outcome = dataclasses.replace(
                outcome, warnings=(*outcome.warnings, (repair.reason, repair.message))
            )
        self.outcome = outcome
        return True

    async def finish(self) -> None:
        """Once the status is written: the latest checkpoint remembered, the pods' hints."""
        if self._written is None:
            return
        rset, latest = self._written.rset, self._written.latest
        namespace = namespace_or_default(rset.metadata.namespace)
        self._latest_written.record(namespace, rset.metadata.name, latest)
        await mark_covered_pods(self._kube, rset, latest, self._written.listed)
        if self._written.repair is not None:
            logger.warning(
                "RolloutSet %s/%s: %s", namespace, rset.metadata.name, self._written.repair.message
            )


def _validated(draft: PassStatus) -> RolloutSet:
    """The pass's set as parsed once for every stage (`PassStatus.rset`), or SetBlocked
    `InvalidSpec` naming the first fields the model refuses."""
    try:
        return draft.rset
    except ValidationError as error:
        message = "spec is invalid (is the CRD older than the operator?): " + "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in error.errors()[:5]
        )
        raise SetBlocked("InvalidSpec", message) from error


def _pods_created(rset: RolloutSet) -> bool:
    """Every pod of the current attempt was created before (status.createdAttempt)."""
    created, attempt = rset.status.created_attempt, rset.status.attempt or 1
    return created is not None and created >= attempt


async def _ensure_startable(
    kube: Kube, rset: RolloutSet, owned_objects: OwnedObjects, max_replicas_per_role: int
) -> None:
    """Raise SetBlocked for a spec no attempt can start from; ensure the token Secret and the
    Services the pods need, unless this process did so lately."""
    if not _pods_created(rset) and rset.status.recovery is None:
        over = spec_over_limits(rset, max_replicas_per_role) or missing_peers(rset)
        if over is not None:
            raise over
        await check_storage_secret(kube, rset)
    if not owned_objects.fresh(rset):
        await ensure_control_token(kube, rset)
        await ensure_services(kube, rset)
        owned_objects.mark(rset)


async def _attempt_changes(
    kube: Kube, obj: dict[str, Any], rset: RolloutSet, pods: list[PodView], now: datetime
) -> tuple[dict[str, Any], ReconcileOutcome]:
    """Create the attempt's pods and standbys as due; the status that shows them, and the
    outcome of the pass."""
    generation = obj["metadata"].get("generation")
    status = rset.status
    attempt = status.attempt or 1
    pods_created = _pods_created(rset)
    # A Kueue-queued set that was never admitted creates no pods (`queue.queue_holds`).
    if pods_created or rset.spec.suspend or queue_holds(rset):
        outcome = PodsOutcome(plan_attempt(rset, attempt, pods))
    else:
        outcome = await reconcile_pods(kube, rset, attempt, pods)
    plan = outcome.plan
    health = set_conditions(
        rset, plan, pods_created=pods_created, create_errors=outcome.errors, now=now
    )
    conditions = merge_conditions(
        status.conditions, health.conditions, observed_generation=generation, now=now
    )
    changes: dict[str, Any] = {
        "observedGeneration": generation,
        "attempt": attempt,
        "participants": plan.participants,
        "conditions": conditions,
    }
    # The attempt is up once every pod was created and was Ready together: a pod that fails
    # before that is the set's Degraded (nothing ran, nothing to recover), never a loss. (With
    # "every pod created" alone, a peer that got its IP and failed a moment later raced the
    # creation of the pods that wait for its address, and a crashing first attempt was taken
    # for lost participants and recovered over and over.)
    if plan.all_ready and not pods_created and not plan.stale:
        changes["createdAttempt"] = attempt
    up = pods_created or "createdAttempt" in changes
    standby = await keep_standbys(kube, rset, attempt, plan if up else None)
    changes["standby"] = standby
    warnings = tuple((RESERVED_VOLUME, note) for note in reserved_volume_notes(rset))
    return changes, ReconcileOutcome(recheck_at=health.recheck_at, warnings=warnings)
