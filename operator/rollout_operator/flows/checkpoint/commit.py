"""Phase Committing of the checkpoint flow: the cut (docs/design.md#61-checkpoint, step 4).

`commit` asks every participant at once to fix the records of what the prepare parked, with
its scope (`Coordinator.commit(..., persist_after_resume=True)`): a participant that can
persist after the resume keeps them as immutable bytes in memory and answers with the manifest
it will write; one that cannot (an older SDK, NeMo Gym's dialect) commits durably, as before.
Every episode waits while this runs, so nothing is written to the API server first: the
prepare entered Committing in memory (written only if it lasts over a second:
`context.UnwrittenPhases`), and the cut enters Resuming the same way, with the episodes it
holds (what the cut's replies say their records hold, which a `/run` that reached a participant
after its prepare replied adds to: docs/protocol.md, "Commit scope") and the prepare's and the
cut's durations. A run that continues a Committing checkpoint
(an operator restart) has no prepare outcome and parks again first; the participants replay
their replies. Nothing here is restorable: the checkpoint is Ready only once every record is
durable (`persist`).
"""

from __future__ import annotations

from rollout_protocol import CommitOutcome, ErrorCode, tracing

from ...model.api import CheckpointDurations, CheckpointPhase, RolloutCheckpoint
from ...model.reasons import Reason
from .context import (
    CheckpointFailed,
    CheckpointRun,
    describe,
    enter_phase,
    failure_reason,
    while_set_holds,
)
from .prepare import park
from .slot import joined


async def commit(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """The cut on every participant at once (`run.cut`), then Resuming entered."""
    prepared = run.prepared or await park(run, ckpt)
    coordinator = await joined(run, ckpt)
    run.scope = scope = prepared.scope(ckpt.spec.episodes)
    commit_started = run.now()
    commit_deadline = commit_started + run.settings.commit_timeout_seconds
    with tracing.span("commit"):
        outcome = await while_set_holds(
            run.context,
            ckpt,
            lambda: coordinator.commit(
                ckpt.metadata.name,
                commit_deadline,
                scope,
                excluded=prepared.excluded(),
                persist_after_resume=True,
            ),
        )
    run.commit_seconds = run.now() - commit_started
    run.cut = outcome
    if not outcome.ok:
        raise CheckpointFailed(*cut_failed(outcome))
    await enter_phase(
        run.context,
        ckpt,
        CheckpointPhase.RESUMING,
        defer=run.writes,
        episodes=outcome.episode_count(prepared),
        attempt=outcome.attempt or run.rset.status.attempt,
        durations=CheckpointDurations(
            prepare_seconds=round(run.prepare_seconds, 3),
            commit_seconds=round(run.commit_seconds, 3),
        ),
    )
    return ckpt


def cut_failed(outcome: CommitOutcome) -> tuple[str, str]:
    """The reason and message of a cut that failed; a participant that holds too many cut
    records still unpersisted (`persist_backlog`) says which, and how much."""
    codes = {failure.code for failure in outcome.failures}
    if ErrorCode.PERSIST_BACKLOG in codes:
        return (
            Reason.PERSIST_BACKLOG,
            "a participant still holds the records of earlier checkpoints that are not durable "
            f"yet and this cut would pass its bound: {describe(outcome.failures)}",
        )
    reason = failure_reason(outcome.failures) or Reason.COMMIT_FAILED
    return reason, f"commit failed: {describe(outcome.failures)}"
