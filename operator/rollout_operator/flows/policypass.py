"""The checkpoint policy, carried out against the API (the Kubernetes side of `policy`).

- `PolicyPass`: one look at a set, the second stage of the policy loop's pass (`stagedpass`:
  one read of the set, one status write shared with the queue pass; `run` is a pass of this
  stage alone). It reads the set's pods and RolloutCheckpoints, lets `policy.plan.plan` decide,
  and then acts in an order chosen so that a crash between any two steps leaves nothing a later
  pass could not finish: checkpoints are created first (deterministic names, so a repeat gets
  "exists"), then a settled deadline is recorded (an annotation on the set), then the set's
  status (conditions, `saveReserveSeconds`, `lastTrainerStep`) goes out in the pass's one patch
  with a resourceVersion precondition, and only then (`finish`) pods are deleted (a suspend's
  release) and old checkpoints removed.
- `start_eviction_checkpoint(pod)`: a participant pod got a deletion timestamp.
- `checkpoint_deleted` / `set_deleted`: what the finalizers do: remove records (the set's pass
  then repoints `latestCheckpoint`). A checkpoint's finalizer is the operator's own
  (`RECORDS_FINALIZER`, not Kopf's: docs/design.md#65-retention-and-records): the checkpoints
  the policy creates carry it from their creation, `keep_records_finalizer` adds it to the
  others (a person's, a trainer's), and `release_deleted_checkpoint` removes the records of
  a checkpoint being deleted and then the finalizer.

**Where records are removed.** Records live on the set's storage volume, which every
participant pod mounts. The finalizers remove them through `flows.records.RecordsRemover`:
here where this process sees the volume (`StorageLocator`), else through the set's participants
(the `remove` control call), else through a short-lived cleanup pod that mounts the volume, so
retention bounds the volume in every namespace and on every node, while a set runs, is
suspended, and after it is deleted. What cannot be removed is reported (Event
`RecordsNotRemoved` naming the folder to delete) and the object is deleted anyway: a finalizer
that can never finish would block namespace deletion, and records without a Ready checkpoint are
garbage by definition (docs/design.md#32-rolloutcheckpoint-the-commit-point), never restored. The
records of a Failed checkpoint that retention keeps are removed at once only where the operator sees
the volume (it must first prove that not every participant committed them), otherwise when the
object goes.

**What is removed.** Volumes are shared (other sets, other namespaces, other people's files), so
the operator removes only what it can prove its participants wrote for this very set: each set
writes below its own directory `<volume>/<namespace>/<set>/<uid>` (`resources.set_dir`; the uid
is the API server's), and below it only the protocol's own file names (manifests, records files,
their temporary files) are deleted, never through a symlink (`rollout_protocol.
remove_checkpoint_files`). Anything else found there is left in place and reported (Event
`RecordsNotRemoved` naming it); nothing is ever removed by a path built from user input alone.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import anyio
from pydantic import ValidationError

from ..cluster.kube import ApiError, Conflict, Kube
from ..cluster.statuswriter import PassStatus, SetDelta
from ..cluster.storage import StorageLocator
from ..decide.policy.eviction import TerminatingPod, eviction_decision
from ..decide.policy.plan import PolicyPlan, plan
from ..decide.policy.suspend import SuspendAction
from ..decide.policy.views import (
    ANNOTATION_DEADLINE_OUTCOME,
    Create,
    Note,
    SetView,
    checkpoint_views,
)
from ..decide.resources import owner_reference, set_selector
from ..model.api import (
    API_VERSION,
    CHECKPOINT_SET_FIELD,
    GROUP,
    LABEL_ATTEMPT,
    LABEL_SET,
    LABEL_STANDBY,
    RECORDS_FINALIZER,
    ROLLOUT_CHECKPOINT_KIND,
    RecoveryPhase,
    RolloutSet,
    namespace_or_default,
)
from ..model.conditions import ConditionUpdate, merge_conditions, same_but_generation
from ..model.owners import StatusOwner
from .checkpointrepairs import parse_creation, records_proven, repair_failed_checkpoint
from .records import RecordsRemover, RemovalPending, remove_here
from .stagedpass import parsed, run_stages
from .state import LoggedNotes

logger = logging.getLogger(__name__)

ANNOTATION_WHY: Final = f"{GROUP}/why"
"""On a RolloutCheckpoint the policy created: what caused it, for `kubectl describe`."""
RELEASE_GRACE_SECONDS: Final = 1
"""Grace period of the pods a suspend releases. Their state is in the suspend checkpoint (or
the deadline's), which the resume restores; work they did after it would be redone anyway, and
a queueing system that suspends a set wants its GPUs now (the recovery stops a lost attempt the
same way)."""

NoteSink = Callable[[RolloutSet, Note], Awaitable[None]]
Clock = Callable[[], datetime]


def _utcnow() -> datetime:
    return datetime.now(UTC)


# --- API calls ----------------------------------------------------------------------------------


def checkpoint_manifest(rset: RolloutSet, create: Create) -> dict[str, Any]:
    """A RolloutCheckpoint the policy creates: owned by the set (deleted with it), labelled with
    it (so `kubectl get rckpt -l checkpoint.rollout.dev/set=NAME` lists them)."""
    spec: dict[str, Any] = {"rolloutSet": rset.metadata.name, "trigger": create.trigger.value}
    if create.trainer_step is not None:
        spec["trainerStep"] = create.trainer_step
    metadata: dict[str, Any] = {
        "name": create.name,
        "labels": {LABEL_SET: rset.metadata.name},
        "annotations": {ANNOTATION_WHY: create.why},
        "ownerReferences": [owner_reference(rset)],
        # Its records go before it does; carried from the creation, so no patch adds it.
        "finalizers": [RECORDS_FINALIZER],
    }
    if rset.metadata.namespace:
        metadata["namespace"] = rset.metadata.namespace
    return {
        "apiVersion": API_VERSION,
        "kind": ROLLOUT_CHECKPOINT_KIND,
        "metadata": metadata,
        "spec": spec,
    }


async def create_checkpoint(kube: Kube, rset: RolloutSet, create: Create) -> bool:
    """Create it; False when it exists already (a repeat after a crash or a second event)."""
    namespace = namespace_or_default(rset.metadata.namespace)
    if not await kube.create_checkpoint(namespace, checkpoint_manifest(rset, create)):
        return False
    logger.info("set %s: created checkpoint %s (%s)", rset.metadata.name, create.name, create.why)
    return True


def _live(pod: Mapping[str, Any]) -> bool:
    """A running participant pod of the set (a standby pod is not one: it runs no episode)."""
    meta = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase")
    standby = (meta.get("labels") or {}).get(LABEL_STANDBY) == "true"
    return (
        meta.get("deletionTimestamp") is None
        and phase not in ("Failed", "Succeeded")
        and (not standby)
    )


# --- one pass -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassOutcome:
    wake_at: datetime | None = None
    """Look again at this time even without events (a deadline start, an interval tick)."""
    again: bool = False
    """A status write lost a race: look again at once."""
    plan: PolicyPlan | None = None


class PolicyPass:
    """One look at one set: decide with `policy.plan.plan`, then act (see the module docstring).

    `logged_notes` is the process's record of the notes it logged (`OperatorState`,
    docs/design.md#611-the-operators-in-process-state): each distinct note is logged once, while
    `on_note` sees it on every pass."""

    def __init__(
        self,
        kube: Kube,
        *,
        logged_notes: LoggedNotes,
        locator: StorageLocator | None = None,
        clock: Clock = _utcnow,
        on_note: NoteSink | None = None,
        wake_set: Callable[[str, str], None] | None = None,
    ) -> None:
        self._kube = kube
        self._logged_notes = logged_notes
        self._locator = locator or StorageLocator.from_env()
        self._clock = clock
        self._on_note = on_note
        self._wake_set = wake_set
        self._planned: _Planned | None = None

    async def _note(self, rset: RolloutSet, note: Note) -> None:
        # A pass repeats its notes until the cause goes (an invalid trainer-step annotation
        # stays until someone fixes it): log each distinct one once.
        namespace = namespace_or_default(rset.metadata.namespace)
        if self._logged_notes.first_time(namespace, rset.metadata.name, note.reason, note.message):
            log = logger.warning if note.warning else logger.info
            log("set %s: %s: %s", rset.metadata.name, note.reason, note.message)
        if self._on_note is not None:
            await self._on_note(rset, note)

    async def run(self, namespace: str, name: str) -> PassOutcome:
        """One pass of this stage alone: read, plan, write, finish."""
        outcome = await run_stages(self._kube, namespace, name, [self])
        decided = self.plan_made
        return PassOutcome(
            wake_at=None if decided is None or outcome.again else decided.wake_at,
            again=outcome.again,
            plan=decided,
        )

    @property
    def plan_made(self) -> PolicyPlan | None:
        """What `policy.plan.plan` decided in this pass."""
        return None if self._planned is None else self._planned.decided

    async def plan(self, draft: PassStatus) -> bool:
        """Decide; create the checkpoints and record a settled deadline (the draft rebased on
        the annotated set), and add the status's delta (conditions, reserve, trainer step)."""
        rset = parsed(draft)
        if rset is None:
            return False  # the set pass reports an invalid spec (InvalidSpec)
        namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
        pods = await self._kube.list_pods(namespace, set_selector(name))
        listed = await self._kube.list_checkpoints(namespace, name)
        # Before retention sees it: a Failed status on a checkpoint every participant
        # committed is repaired to Ready, never acted on
        # (docs/design.md#610-status-written-by-hand).
        if await self._repair_failed(rset, listed):
            listed = await self._kube.list_checkpoints(namespace, name)
        checkpoints = checkpoint_views(listed)
        live = sum(1 for p in pods if _live(p))
        view = SetView.from_set(rset, live_pods=live)
        decided = plan(view, checkpoints, self._clock())
        self._planned = _Planned(rset, decided, tuple(pods), tuple(listed))

        for create in decided.creates:
            await create_checkpoint(self._kube, rset, create)
        if decided.settle is not None:
            version = await self._kube.annotate_set(
                namespace, name, ANNOTATION_DEADLINE_OUTCOME, decided.settle.to_annotation()
            )
            # The status below was decided knowing this annotation: write it on top of it.
            draft.rebase(_annotated(draft.snapshot, decided.settle.to_annotation(), version))
        draft.add(SetDelta(StatusOwner.POLICY, _status_changes(draft.rset, decided)))
        return True

    async def finish(self) -> None:
        """Once the status is written: a suspend's pods released (or a resume's set woken),
        retention's deletions, a Failed checkpoint's records removed, the notes."""
        if self._planned is None:
            return
        rset, decided = self._planned.rset, self._planned.decided
        pods, listed = self._planned.pods, self._planned.listed
        namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
        if decided.suspend is SuspendAction.RELEASE:
            await self._release(rset, pods)
        elif decided.suspend is SuspendAction.RESUME and self._wake_set is not None:
            self._wake_set(namespace, name)
        for doomed in decided.delete:
            if await self._kube.delete_checkpoint(namespace, doomed):
                logger.info("set %s: retention deletes checkpoint %s", name, doomed)
        by_name = {(raw.get("metadata") or {}).get("name"): raw for raw in listed}
        for failed in decided.remove_records:
            await self._remove_records(rset, failed, by_name.get(failed))
        for note in decided.notes:
            await self._note(rset, note)

    async def _release(self, rset: RolloutSet, pods: Sequence[Mapping[str, Any]]) -> None:
        """Delete every participant pod of the set (the Suspended condition is already True,
        so their deletion is taken neither for an eviction nor for a loss)."""
        namespace = namespace_or_default(rset.metadata.namespace)
        deleted = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp") is None and await self._kube.delete_pod(
                namespace, meta["name"], grace_seconds=RELEASE_GRACE_SECONDS
            ):
                deleted.append(meta["name"])
        if deleted:
            logger.info("set %s suspended: deleted pods %s", rset.metadata.name, deleted)

    async def _repair_failed(self, rset: RolloutSet, listed: Sequence[dict[str, Any]]) -> bool:
        """Repair every Failed checkpoint that every participant committed; True if any was."""
        repaired = False
        for raw in listed:
            try:
                repair = await repair_failed_checkpoint(
                    self._kube, rset, raw, locator=self._locator
                )
            except ApiError as error:
                if error.status != 404:
                    raise
                continue  # deleted meanwhile
            if repair is not None:
                repaired = True
                await self._note(rset, Note(repair.reason, repair.message, warning=True))
        return repaired

    async def _remove_records(
        self, rset: RolloutSet, checkpoint: str, raw: Mapping[str, Any] | None = None
    ) -> None:
        namespace = namespace_or_default(rset.metadata.namespace)
        root = self._locator.root(namespace, rset.spec.storage)
        if root is None:
            return  # reported when the object is deleted (retention or by hand)
        proof = records_proven(root, rset, checkpoint, parse_creation(raw or {}))
        if proof is not None:
            # Failed, but every participant committed it: not garbage (a status written by
            # hand, or the verdict of a restore that failed for another reason than its records).
            await self._note(
                rset,
                Note(
                    "RecordsKept",
                    f"failed checkpoint {checkpoint}: records kept, {proof}; delete the "
                    "RolloutCheckpoint to remove them",
                ),
            )
            return
        removal = await remove_here(root, rset, [checkpoint])
        if removal.removed:
            logger.info("set %s: failed checkpoint: %s", rset.metadata.name, removal.outcome)
        if removal.not_removed is not None:
            await self._note(rset, Note("RecordsNotRemoved", removal.not_removed, True))


@dataclass(frozen=True)
class _Planned:
    """What a pass's plan left for its finish."""

    rset: RolloutSet
    decided: PolicyPlan
    pods: tuple[Mapping[str, Any], ...]
    listed: tuple[Mapping[str, Any], ...]


def _annotated(snapshot: Mapping[str, Any], outcome: str, version: str | None) -> dict[str, Any]:
    """The set as the settled deadline's annotation left it (`Kube.annotate_set` returns only
    its resourceVersion)."""
    meta = dict(snapshot.get("metadata") or {})
    meta["annotations"] = {**(meta.get("annotations") or {}), ANNOTATION_DEADLINE_OUTCOME: outcome}
    if version is not None:
        meta["resourceVersion"] = version
    return {**snapshot, "metadata": meta}


def _status_changes(rset: RolloutSet, decided: PolicyPlan) -> dict[str, Any]:
    """The policy's part of the set's status: its conditions (Suspended, DeadlineSaved),
    reserve and trainer step, only what changed (an unchanged status is never written, so
    passes do not wake each other through their own events).

    A resume only clears Suspended (reason `Resumed`) and wakes the set's loop, which starts
    the resume's recovery itself (`policy.suspend.resume_due`): the recovery is the one writer
    of `status.recovery` and of the conditions it drives."""
    status = rset.status
    changes: dict[str, Any] = {}
    if status.save_reserve_seconds != decided.reserve:
        changes["saveReserveSeconds"] = decided.reserve
    if decided.last_trainer_step is not None:
        changes["lastTrainerStep"] = decided.last_trainer_step
    updates = [
        ConditionUpdate.of(c.type, c.status, c.reason, c.message) for c in decided.conditions
    ]
    merged = merge_conditions(
        status.conditions, updates, observed_generation=rset.metadata.generation
    )
    if updates and not same_but_generation(merged, status.conditions):
        changes["conditions"] = merged
    return changes


# --- eviction -----------------------------------------------------------------------------------


async def start_eviction_checkpoint(
    kube: Kube, pod: Mapping[str, Any], *, clock: Clock = _utcnow
) -> str | None:
    """An Eviction checkpoint for a participant pod that is being deleted, when the set's
    policy asks for one; returns its name when this call created it."""
    meta = pod.get("metadata") or {}
    set_name = (meta.get("labels") or {}).get(LABEL_SET)
    terminating = TerminatingPod.from_pod(pod, LABEL_ATTEMPT)
    if not set_name or terminating is None or terminating.deletion <= clock():
        return None
    namespace = namespace_or_default(meta.get("namespace"))
    raw = await kube.get_set(namespace, set_name)
    if raw is None:
        return None
    try:
        rset = RolloutSet.model_validate(raw)
    except ValidationError:
        return None
    create = eviction_decision(SetView.from_set(rset, live_pods=1), terminating)
    if create is None:
        return None
    return create.name if await create_checkpoint(kube, rset, create) else None


# --- finalizers ---------------------------------------------------------------------------------


class CheckpointBusy(Exception):
    """The checkpoint cannot go yet (a recovery is restoring it); try again shortly."""


async def checkpoint_deleted(
    kube: Kube,
    ckpt: Mapping[str, Any],
    *,
    locator: StorageLocator | None = None,
    on_note: NoteSink | None = None,
) -> str:
    """The RolloutCheckpoint finalizer: remove its records. Returns what was done, for the log.

    Raises `CheckpointBusy` while a recovery restores it, and while its removal is under way
    (`RemovalPending`: a cleanup pod runs, or a participant still has it open). A set whose
    `latestCheckpoint` names it is repointed by the set's pass (a deleting checkpoint is never
    the latest, and no recovery restores it: `setstatus.newest_ready`)."""
    meta = ckpt.get("metadata") or {}
    name = str(meta.get("name"))
    namespace = namespace_or_default(meta.get("namespace"))
    set_name = (ckpt.get("spec") or {}).get("rolloutSet")
    raw = await kube.get_set(namespace, set_name) if isinstance(set_name, str) else None
    if raw is None:
        return f"set {set_name} is gone; its deletion removed the records"
    rset = RolloutSet.model_validate(raw)
    recovery = rset.status.recovery
    if (
        recovery is not None
        and recovery.checkpoint == name
        and recovery.phase
        in (RecoveryPhase.STARTING_PODS, RecoveryPhase.RESTORING, RecoveryPhase.STOPPING_ATTEMPT)
    ):
        raise CheckpointBusy(f"recovery of set {rset.metadata.name} restores {name}")
    return await _removed(kube, rset, [name], locator, on_note)


RELEASE_RETRY_SECONDS: Final = 5.0
"""How soon a records removal that could not finish (a recovery restores the checkpoint, a
cleanup pod runs, the API server did not answer) tries again."""
FLOW_LOOK_SECONDS: Final = 1.0
"""How often a records removal looks whether the deleted checkpoint's flow has ended (it also
looks on every event of the checkpoint's set)."""


def _finalizers(ckpt: Mapping[str, Any]) -> list[str]:
    return list((ckpt.get("metadata") or {}).get("finalizers") or [])


async def keep_records_finalizer(kube: Kube, ckpt: Mapping[str, Any]) -> bool:
    """Add `RECORDS_FINALIZER` to a checkpoint that is not being deleted and lacks it (one a
    person or trainer created, or one from before the operator had it); True when this call
    added it. A checkpoint that changed meanwhile (`Conflict`) is left to that change's event."""
    meta = ckpt.get("metadata") or {}
    finalizers = _finalizers(ckpt)
    if meta.get("deletionTimestamp") or RECORDS_FINALIZER in finalizers:
        return False
    try:
        added = await kube.set_checkpoint_finalizers(
            namespace_or_default(meta.get("namespace")),
            str(meta.get("name")),
            [*finalizers, RECORDS_FINALIZER],
            resource_version=str(meta.get("resourceVersion") or ""),
        )
    except Conflict:
        return False
    return added is not None


async def release_deleted_checkpoint(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    flow_runs: Callable[[], bool],
    locator: StorageLocator | None = None,
    on_note: NoteSink | None = None,
    retry_seconds: float = RELEASE_RETRY_SECONDS,
) -> str:
    """The records finalizer of a checkpoint being deleted: once its flow no longer runs here
    (`flow_runs`: a deleted checkpoint's flow aborts first, resuming every participant), remove
    its records (`checkpoint_deleted`), then the finalizer. Tries again after `retry_seconds`
    while that cannot be done yet; returns what was done once the finalizer (or the object) is
    gone."""
    fresh = False
    while True:
        raw = await kube.get_checkpoint(namespace, name, fresh=fresh)
        fresh = False
        if raw is None or RECORDS_FINALIZER not in _finalizers(raw):
            return "the records finalizer is gone already"
        set_name = (raw.get("spec") or {}).get(CHECKPOINT_SET_FIELD)
        if flow_runs():
            await kube.cache.wait_for_change(namespace, str(set_name), FLOW_LOOK_SECONDS)
            continue
        try:
            outcome = await checkpoint_deleted(kube, raw, locator=locator, on_note=on_note)
            left = [f for f in _finalizers(raw) if f != RECORDS_FINALIZER]
            version = str((raw.get("metadata") or {}).get("resourceVersion") or "")
            await kube.set_checkpoint_finalizers(namespace, name, left, resource_version=version)
            return outcome
        except Conflict:
            fresh = True  # changed meanwhile (another finalizer, a label): read it and go on
        except (CheckpointBusy, ApiError, OSError, TimeoutError) as error:
            logger.info(
                "checkpoint %s/%s: records not removed yet (%s); again in %.0fs",
                namespace,
                name,
                error,
                retry_seconds,
            )
            await anyio.sleep(retry_seconds)


async def set_deleted(
    kube: Kube,
    rset_raw: Mapping[str, Any],
    *,
    locator: StorageLocator | None = None,
    on_note: Callable[[RolloutSet, Note], Awaitable[None]] | None = None,
) -> str:
    """The RolloutSet finalizer: delete the set's checkpoints (each one's own finalizer removes
    its records while the set can still be read), and once they are gone sweep the set's folder
    (records of failed or unfinished checkpoints). Raises `CheckpointBusy` while any remain.

    Whatever stays on the volume (files the participants did not write, a volume nothing can
    reach, a removal that failed) is a `RecordsNotRemoved` Warning naming it, and the returned
    outcome says so: nothing is reported removed that is still there."""
    rset = RolloutSet.model_validate(rset_raw)
    namespace = namespace_or_default(rset.metadata.namespace)
    remaining = await kube.list_checkpoints(namespace, rset.metadata.name)
    for ckpt in remaining:
        if not (ckpt.get("metadata") or {}).get("deletionTimestamp"):
            await kube.delete_checkpoint(namespace, ckpt["metadata"]["name"])
    if remaining:
        raise CheckpointBusy(f"{len(remaining)} checkpoint(s) of the set are being deleted")
    return await _removed(kube, rset, None, locator, on_note)


async def _removed(
    kube: Kube,
    rset: RolloutSet,
    checkpoints: Sequence[str] | None,
    locator: StorageLocator | None,
    on_note: NoteSink | None,
) -> str:
    """Remove records through `RecordsRemover`; a Warning for whatever stays."""
    try:
        removal = await RecordsRemover(kube, locator).remove(rset, checkpoints)
    except RemovalPending as pending:
        raise CheckpointBusy(str(pending)) from pending
    if removal.not_removed is not None and on_note is not None:
        await on_note(rset, Note("RecordsNotRemoved", removal.not_removed, warning=True))
    return removal.outcome
