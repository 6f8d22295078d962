"""Repairs of a RolloutCheckpoint's status written by hand, from what storage proves
(docs/design.md#610-status-written-by-hand).

`kubectl patch --subresource=status` (or any client with `patch` on the status subresource) can
write anything the schema allows. The operator never takes such a write as an instruction: where
a checkpoint's status contradicts the records on storage, storage wins, the status is repaired,
and an Event (reason `StatusRepaired`) says what was written back and why.

- `repair_published_checkpoint`: a RolloutCheckpoint whose phase was reset (unset, Pending or
  Queued) but whose manifests are on storage, one for every participant instance of its set,
  all for this checkpoint and written after the object was created, was published: it is Ready
  again with those manifests, never prepared again (the participants would refuse the stale id,
  the checkpoint would end Failed and retention would remove the records of a restorable
  checkpoint). When the operator cannot see the volume, the set's `latestCheckpoint` naming it
  is the proof instead. The checkpoint flow runs it before it starts a checkpoint; one that
  holds its set's Lease is running (its phases unwritten yet) and is not repaired.
- `repair_failed_checkpoint`: a RolloutCheckpoint whose status says Failed although every
  participant's manifest and records of it are on storage and verify (`completed_on_storage`:
  digest and count, as a restore checks them) was completed: it is Ready again, and
  `records_proven` keeps the retention pass from removing those records in any case. The
  operator's own verdict after a restore that refused the records (reason `RecordsInvalid` or
  `RecordsUnreachable`, `RestoreVerdict`) is not overturned, but records that verify are still
  never removed while the object exists. The policy pass runs it with its retention.

They live here, beside neither flow, because both the checkpoint flow and the policy pass use
them and the flows may not import each other. The set's status has its repairs in its owners:
`setpass.repair_set_attempt` (the set pass), `recovery.repair_false_recovery` and
`recovery.repair_unfinished_recovery` (the recovery); `decide/setstatus.py` derives the set's
`latestCheckpoint` from the checkpoints on every pass (`latest_repair`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError
from rollout_protocol import (
    Manifest,
    RecordsInvalid,
    StorageError,
    checkpoint_base,
    read_manifest,
    read_records,
)

from ..cluster.checkpointstatus import CheckpointStatusWriter, status_body
from ..cluster.kube import Kube
from ..cluster.leases import CheckpointLeases
from ..cluster.storage import StorageLocator
from ..decide.resources import set_dir
from ..decide.setstatus import NOT_AN_INTERFACE, REPAIRED, RESET_PHASES, Repair
from ..model.api import (
    CheckpointConditionType,
    CheckpointParticipant,
    CheckpointPhase,
    ConditionStatus,
    RestoreVerdict,
    RolloutCheckpoint,
    RolloutCheckpointStatus,
    RolloutSet,
    namespace_or_default,
)
from ..model.checkpointowners import CheckpointOwner
from ..model.conditions import set_condition

logger = logging.getLogger(__name__)

VERDICTS_AFTER_RESTORE: Final = frozenset(verdict.value for verdict in RestoreVerdict)
"""The Failed reasons the recovery writes when participants refused a checkpoint's records at
restore or found none: the operator's own verdicts, never repaired. (Records that are
unreachable at one restore and visible to the operator are still not Ready again: the
participants that restore may not see them, and a recovery would try the checkpoint again.)"""


def parse_creation(raw: Mapping[str, Any]) -> datetime | None:
    """An object's creationTimestamp (None when absent): records older than it are not its."""
    return _creation(raw)


def _creation(raw: Mapping[str, Any]) -> datetime | None:
    stamp = (raw.get("metadata") or {}).get("creationTimestamp")
    if not isinstance(stamp, str):
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def published_manifests(
    root: Path, rset: RolloutSet, checkpoint: str, created: datetime | None
) -> dict[str, tuple[Path, Manifest]] | None:
    """Every participant instance's manifest of `checkpoint` on the volume at `root`, or None
    unless all are there, for this checkpoint, of one attempt, and (when `created` is known)
    written after the object was created (records a same-named earlier object left behind
    prove nothing about this one)."""
    try:
        base = checkpoint_base(root, set_dir(rset), checkpoint)
    except ValueError:  # an unsafe path (UnsafePath) or a set without uid
        return None
    found: dict[str, tuple[Path, Manifest]] = {}
    for participant in rset.spec.participants:
        for index in range(participant.replicas):
            instance = f"{participant.role.value}-{index}"
            folder = base / instance
            path = folder / "manifest.json"
            try:
                if folder.is_symlink() or path.is_symlink() or not path.is_file():
                    return None
                manifest = read_manifest(folder)
                written = datetime.fromtimestamp(os.lstat(path).st_mtime, UTC)
            except (RecordsInvalid, OSError):
                return None
            if manifest.checkpoint_id != checkpoint or manifest.instance != instance:
                return None
            if created is not None and written < created:
                return None
            found[instance] = (path, manifest)
    if len({manifest.attempt for _, manifest in found.values()}) != 1:
        return None
    return found


def completed_on_storage(
    root: Path, rset: RolloutSet, checkpoint: str, created: datetime | None
) -> dict[str, tuple[Path, Manifest]] | None:
    """`published_manifests`, and every participant's records verify against its manifest
    (name, digest, count and record form, read bounded by the manifest's size): the proof that
    every participant committed this checkpoint, so it is restorable. None otherwise."""
    manifests = published_manifests(root, rset, checkpoint, created)
    if manifests is None:
        return None
    for path, _ in manifests.values():
        try:
            read_records(path.parent, expect_checkpoint_id=checkpoint)
        except (RecordsInvalid, StorageError, OSError):
            return None
    return manifests


def records_proven(
    root: Path, rset: RolloutSet, checkpoint: str, created: datetime | None
) -> str | None:
    """Why the records of `checkpoint` must stay whatever its status says (None: no proof)."""
    manifests = completed_on_storage(root, rset, checkpoint, created)
    if manifests is None:
        return None
    return f"its {len(manifests)} participant manifests and records on storage verify"


def _ready_again(
    ckpt: RolloutCheckpoint,
    manifests: dict[str, tuple[Path, Manifest]] | None,
    root: Path | None,
    message: str,
) -> RolloutCheckpointStatus:
    """The Ready status of a checkpoint proven published, with the manifests' participants."""
    status = ckpt.status.model_copy()
    if manifests is not None and root is not None:
        status.participants = [
            CheckpointParticipant(
                instance=instance,
                manifest=str(path.relative_to(root)),
                records_sha256=manifest.records_sha256,
                record_count=manifest.record_count,
                bytes=manifest.bytes,
            )
            for instance, (path, manifest) in sorted(manifests.items())
        ]
        status.attempt = next(iter(manifests.values()))[1].attempt
        newest = max(os.lstat(path).st_mtime for path, _ in manifests.values())
        status.completed_at = status.completed_at or datetime.fromtimestamp(newest, UTC)
    status.phase = CheckpointPhase.READY
    status.observed_generation = ckpt.metadata.generation
    for type_, value in (
        (CheckpointConditionType.COMMITTED, True),
        (CheckpointConditionType.READY, True),
        (CheckpointConditionType.FAILED, False),
    ):
        status.conditions = set_condition(
            status.conditions,
            type_.value,
            value,
            REPAIRED,
            message,
            observed_generation=ckpt.metadata.generation,
        )
    return status


def failed_reason(ckpt: RolloutCheckpoint) -> str | None:
    """The reason of a checkpoint's Failed=True condition, or None when it has none."""
    for condition in ckpt.status.conditions:
        if (
            condition.type == CheckpointConditionType.FAILED.value
            and condition.status is ConditionStatus.TRUE
        ):
            return condition.reason
    return None


async def repair_failed_checkpoint(
    kube: Kube, rset: RolloutSet, raw_ckpt: dict[str, Any], *, locator: StorageLocator
) -> Repair | None:
    """Write Ready back on a checkpoint whose status says Failed but whose every participant
    committed it (`completed_on_storage`); None when there is no such proof, the operator cannot
    see the volume, or the failure is the operator's verdict after a restore."""
    try:
        ckpt = RolloutCheckpoint.model_validate(raw_ckpt)
    except ValidationError:
        return None
    if ckpt.metadata.deletion_timestamp is not None:
        return None
    failed = ckpt.status.phase is CheckpointPhase.FAILED or failed_reason(ckpt) is not None
    if not failed or failed_reason(ckpt) in VERDICTS_AFTER_RESTORE:
        return None
    namespace = namespace_or_default(ckpt.metadata.namespace)
    root = locator.root(namespace, rset.spec.storage)
    if root is None:
        return None
    name = ckpt.metadata.name
    manifests = completed_on_storage(root, rset, name, _creation(raw_ckpt))
    if manifests is None:
        return None
    message = (
        f"status said Failed ({failed_reason(ckpt) or 'phase Failed'}) but every participant "
        f"committed the checkpoint: its {len(manifests)} participant manifests and records on "
        f"storage verify; repaired to Ready, its records kept; {NOT_AN_INTERFACE}"
    )
    body = status_body(_ready_again(ckpt, manifests, root, message))

    def still_failed(stored: RolloutCheckpoint) -> Mapping[str, Any] | None:
        # Written only over a status that still says Failed (the proof is storage's).
        failed = stored.status.phase is CheckpointPhase.FAILED or failed_reason(stored)
        return body if failed else None

    if (
        await CheckpointStatusWriter(kube, CheckpointOwner.REPAIR).write_retrying(
            ckpt, still_failed
        )
        is None
    ):
        return None
    logger.warning("RolloutCheckpoint %s/%s: %s", namespace, name, message)
    return Repair(REPAIRED, f"checkpoint {name}: {message}")


async def repair_published_checkpoint(
    kube: Kube,
    leases: CheckpointLeases,
    ckpt: RolloutCheckpoint,
    *,
    locator: StorageLocator | None = None,
) -> tuple[RolloutCheckpointStatus, Repair] | None:
    """The Ready status of a checkpoint that was published but whose status was reset, or None
    (then the checkpoint has not run, or runs still, and runs).

    A checkpoint that holds its set's Lease is running with its phases unwritten (they are
    written only once they last over a second): its manifests prove that every participant
    committed, not that it was published (the publish write may have failed in an API outage,
    with the participants still paused). It is continued, never repaired; the Lease is read
    only when the manifests are all there."""
    if ckpt.status.phase not in RESET_PHASES:
        return None
    namespace = namespace_or_default(ckpt.metadata.namespace)
    name = ckpt.metadata.name
    raw_set = await kube.get_set(namespace, ckpt.spec.rollout_set)
    raw_ckpt = await kube.get_checkpoint(namespace, name)
    if raw_set is None or raw_ckpt is None:
        return None
    try:
        rset = RolloutSet.model_validate(raw_set)
    except ValidationError:
        return None
    if locator is None:
        locator = StorageLocator.from_env()
    root = locator.root(namespace, rset.spec.storage)
    manifests: dict[str, tuple[Path, Manifest]] | None = None
    completed_at = ckpt.status.completed_at
    if root is not None:
        manifests = published_manifests(root, rset, name, _creation(raw_ckpt))
        if manifests is None:
            return None
        proof = f"its {len(manifests)} participant manifests are on storage"
    elif rset.status.latest_checkpoint == name:
        proof = f"set {rset.metadata.name} names it as its latest Ready checkpoint"
        completed_at = completed_at or rset.status.latest_checkpoint_time
    else:
        return None
    if await leases.holder(namespace, rset.metadata.name) == name:
        return None
    message = (
        f"status was reset (phase {ckpt.status.phase or 'unset'}) but the checkpoint was "
        f"published: {proof}; repaired to Ready, not run again; {NOT_AN_INTERFACE}"
    )
    status = _ready_again(ckpt, manifests, root, message)
    status.completed_at = status.completed_at or completed_at
    logger.warning("RolloutCheckpoint %s/%s: %s", namespace, name, message)
    return status, Repair(REPAIRED, message)
