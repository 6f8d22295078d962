"""Phase Persisting of the checkpoint flow: the records made durable after the resume, then
the publish (docs/design.md#61-checkpoint, steps 6-7).

`persist` asks every participant that holds the cut's records to write and fsync them and its
manifest (`Coordinator.persist`; one that committed durably at the cut is not asked), while the
episodes run on. It is bounded by `persistTimeoutSeconds` of the operator's settings and
cancelled at once when the set loses the checkpoint's attempt; a participant that crashed,
storage that is full or read-only, or one still writing at the deadline fails the checkpoint
with the participant's reason (the failure discards the held records: `flow.end_failed`).
An operator that restarts in Persisting asks again: the participants replay their durable
reply, or say the records are gone (`unknown_checkpoint`), and the checkpoint fails.

`publish` is the commit point: the set's slot released, then one status write: phase Ready,
`Committed` and `Ready` True with every participant's durable manifest, the counts and the
durations (`persistSeconds` beside `pauseSeconds`). Nothing before it is restorable; nothing
after it takes Ready back.
"""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
from rollout_protocol import CommitOutcome, ErrorCode, Failure, tracing

from ...model.api import (
    CheckpointConditionType,
    CheckpointDurations,
    CheckpointParticipant,
    CheckpointPhase,
    RolloutCheckpoint,
)
from ...model.conditions import set_condition
from ...model.reasons import Reason
from .context import (
    CheckpointFailed,
    CheckpointRun,
    describe,
    failure_reason,
    riding_out_outages,
    while_set_holds,
    write_status,
)
from .slot import joined, release_slot


async def persist(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """Every held record durable (`Coordinator.persist`), then `publish`."""
    coordinator = await joined(run, ckpt)
    started = run.now()
    deadline = started + run.settings.persist_timeout_seconds
    cut = run.cut
    # The participants answer by the deadline (still writing: `storage_failed`); one that does
    # not answer at all is not waited for longer than a second past it.
    with tracing.span("persist"), anyio.move_on_after(deadline - started + 1.0) as bounded:
        outcome = await while_set_holds(
            run.context,
            ckpt,
            lambda: coordinator.persist(ckpt.metadata.name, deadline, cut=cut),
        )
    if bounded.cancelled_caught:
        raise CheckpointFailed(
            Reason.PERSIST_FAILED,
            "the participants did not make the records durable within "
            f"{run.settings.persist_timeout_seconds:g}s after the resume (storage slow or "
            "hung); the episodes ran on, the held records are released",
        )
    if not outcome.ok:
        reason = persist_reason(outcome.failures)
        raise CheckpointFailed(
            reason,
            "persist failed after the episodes resumed (they ran on; the held records are "
            f"released): {describe(outcome.failures)}",
        )
    return await publish(run, ckpt, outcome, run.now() - started)


def persist_reason(failures: list[Failure]) -> str:
    """A failed persist's reason: a participant that lost the held records with its process
    (`unknown_checkpoint`) or that is gone is lost; one whose storage refused or was still
    writing at the deadline, or whose written manifest is not the one its cut promised
    (`internal`, the coordinator's check), failed to persist."""
    codes = {failure.code for failure in failures}
    if ErrorCode.UNKNOWN_CHECKPOINT in codes:
        return Reason.PARTICIPANT_LOST
    if codes <= {ErrorCode.INTERNAL, ErrorCode.STORAGE_FAILED}:
        return Reason.PERSIST_FAILED
    return failure_reason(failures) or Reason.PERSIST_FAILED


async def publish(
    run: CheckpointRun, ckpt: RolloutCheckpoint, durable: CommitOutcome, persist_seconds: float
) -> RolloutCheckpoint:
    """Release the set's slot, then one status write makes the checkpoint Ready."""
    with tracing.span("publish"):
        participants = [
            CheckpointParticipant(
                instance=instance,
                manifest=durable.manifest_paths[instance],
                records_sha256=manifest.records_sha256,
                record_count=manifest.record_count,
                bytes=manifest.bytes,
                rollout_ids=durable.listed.get(instance),
            )
            for instance, manifest in sorted(durable.manifests.items())
        ]
        episodes = ckpt.status.episodes or 0
        message = (
            f"{episodes} episode(s) committed by {len(participants)} participant(s), "
            f"{durable.bytes} bytes, durable {persist_seconds:.3f}s after the resume"
        )
        durations = ckpt.status.durations or CheckpointDurations()
        status = ckpt.status.model_copy(
            update={
                "phase": CheckpointPhase.READY,
                "participants": participants,
                "attempt": ckpt.status.attempt or durable.attempt or run.rset.status.attempt,
                "completed_at": datetime.now(UTC),
                "durations": durations.model_copy(
                    update={
                        "persist_seconds": round(persist_seconds, 3),
                        "total_seconds": round(run.now() - run.started, 3),
                    }
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
        # The terminal phase is the last write (handlers/rolloutcheckpoint.py): the slot first.
        await riding_out_outages(run, ckpt, "the slot", lambda: release_slot(run.context, ckpt))
        await riding_out_outages(
            run, ckpt, "phase Ready", lambda: write_status(run.context, ckpt, status)
        )
        if run.context.on_transition is not None:
            await run.context.on_transition(ckpt, Reason.PUBLISHED, message)
    return ckpt
