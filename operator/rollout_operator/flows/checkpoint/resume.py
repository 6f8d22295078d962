"""Phase Resuming of the checkpoint flow: the participants go on right after the cut
(docs/design.md#61-checkpoint, step 5).

The resume reopens admission, and is skipped when the set lost the checkpoint's attempt
meanwhile (its recovery retires those pods; the persist then fails the checkpoint). A
participant the resume misses resumes itself when its lease lapses. The step counts the pause
(prepare, cut and resume) and writes Persisting (at once: outside the pause it costs the
episodes nothing, and a successor must find it, since a resumed id cannot be cut again). A
checkpoint that an earlier operator published before its resume (Ready True in phase Resuming)
has its records durable already: it goes to Ready.
"""

from __future__ import annotations

from datetime import UTC, datetime

from rollout_protocol import tracing

from ...model.api import CheckpointDurations, CheckpointPhase, RolloutCheckpoint
from .context import (
    CheckpointRun,
    describe,
    enter_phase,
    logger,
    published,
    riding_out_outages,
    set_lost,
)
from .slot import joined, release_slot


async def resume(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """Resume every participant, count the pause, and enter Persisting."""
    coordinator = await joined(run, ckpt)
    resume_started = run.now()
    if set_lost(run.rset, ckpt.status.attempt) is None:
        with tracing.span("resume"):
            resumed = await coordinator.resume(
                ckpt.metadata.name, run.now() + run.settings.resume_timeout_seconds
            )
        if resumed.failures:
            logger.warning(
                "checkpoint %s: resume failed on %s (their lease resumes them)",
                ckpt.metadata.name,
                describe(resumed.failures),
            )
    durations = ckpt.status.durations or CheckpointDurations()
    pause = (durations.prepare_seconds or 0) + (durations.commit_seconds or 0)
    pause += run.now() - resume_started
    durations = durations.model_copy(update={"pause_seconds": round(pause, 3)})
    if published(ckpt):
        durations.total_seconds = round(run.now() - run.started, 3)
        await riding_out_outages(run, ckpt, "the slot", lambda: release_slot(run.context, ckpt))
        await riding_out_outages(
            run,
            ckpt,
            "phase Ready",
            lambda: enter_phase(
                run.context,
                ckpt,
                CheckpointPhase.READY,
                durations=durations,
                completed_at=datetime.now(UTC),
            ),
        )
        return ckpt
    # Written at once: the episodes run again, so the request costs them nothing, and a
    # successor that finds Persisting asks the persist again (the cut can no longer be: the
    # id is stale once resumed).
    await riding_out_outages(
        run,
        ckpt,
        "phase Persisting",
        lambda: enter_phase(run.context, ckpt, CheckpointPhase.PERSISTING, durations=durations),
    )
    return ckpt
