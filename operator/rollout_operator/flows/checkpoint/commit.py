"""Phase Committing of the checkpoint flow: the participants write their records, then one
status patch makes the checkpoint restorable (docs/design.md#61-checkpoint, steps 4-5).

`commit` commits at once with the scope the prepare parked (every episode waits while the
participants commit; the prepare entered Committing in memory, written only if it lasts over a
second: `context.UnwrittenPhases`). A run that continues a Committing checkpoint (an operator
restart) has no prepare outcome and parks again first; the participants replay their replies.
It ends with `publish`, the commit point:
`Committed` and `Ready` True with every participant's manifest, counts and durations, and the
phase Resuming, in one write. Nothing before it is restorable; nothing after it takes Ready
back."""

from __future__ import annotations

from rollout_protocol import tracing

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
    while_set_holds,
    write_status,
)
from .prepare import park
from .slot import joined


async def commit(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """Commit what the prepare parked to every participant at once, then publish: the
    checkpoint Resuming and Ready in one write (`publish`). A run that continues a Committing
    checkpoint (an operator restart) parks again first; the participants replay the prepare."""
    prepared = run.prepared or await park(run, ckpt)
    coordinator = await joined(run, ckpt)
    run.scope = scope = prepared.scope(ckpt.spec.episodes)
    commit_started = run.now()
    commit_deadline = run.now() + run.settings.commit_timeout_seconds
    with tracing.span("commit"):
        outcome = await while_set_holds(
            run.context,
            ckpt,
            lambda: coordinator.commit(
                ckpt.metadata.name, commit_deadline, scope, excluded=prepared.excluded()
            ),
        )
    run.commit_seconds = run.now() - commit_started
    if not outcome.ok:
        reason = failure_reason(outcome.failures) or Reason.COMMIT_FAILED
        raise CheckpointFailed(reason, f"commit failed: {describe(outcome.failures)}")
    run.committed = outcome
    return await publish(run, ckpt)


async def publish(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """One status patch makes the checkpoint restorable; then the set points at it."""
    prepared, committed = run.prepared, run.committed
    assert prepared is not None, "a publish follows this run's prepare"
    assert committed is not None, "a publish follows this run's commit"
    episodes = prepared.committed_count(run.scope)
    with tracing.span("publish"):
        participants = [
            CheckpointParticipant(
                instance=instance,
                manifest=committed.manifest_paths[instance],
                records_sha256=manifest.records_sha256,
                record_count=manifest.record_count,
                bytes=manifest.bytes,
                rollout_ids=committed.listed.get(instance),
            )
            for instance, manifest in sorted(committed.manifests.items())
        ]
        message = (
            f"{episodes} episode(s) committed by {len(participants)} participant(s), "
            f"{committed.bytes} bytes"
        )
        status = ckpt.status.model_copy(
            update={
                "phase": CheckpointPhase.RESUMING,
                "episodes": episodes,
                "participants": participants,
                "attempt": committed.attempt or run.rset.status.attempt,
                "durations": CheckpointDurations(
                    prepare_seconds=round(run.prepare_seconds, 3),
                    commit_seconds=round(run.commit_seconds, 3),
                    total_seconds=round(run.now() - run.started, 3),
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
        await write_status(run.context, ckpt, status)
        if run.context.on_transition is not None:
            await run.context.on_transition(ckpt, Reason.PUBLISHED, message)
    return ckpt
