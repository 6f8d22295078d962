"""Phase Resuming of the checkpoint flow: the participants go on (docs/design.md#61-checkpoint,
step 6).

The checkpoint is Ready already (published); the resume only reopens admission, and is skipped
when the set lost the checkpoint's attempt meanwhile (its recovery retires those pods). A
participant the resume misses resumes itself when its lease lapses. The step releases the slot
and writes the terminal Ready with the pause and total durations.
"""

from __future__ import annotations

from datetime import UTC, datetime

from rollout_protocol import tracing

from ...model.api import CheckpointDurations, CheckpointPhase, RolloutCheckpoint
from .context import CheckpointRun, describe, enter_phase, logger, set_lost
from .slot import joined, release_slot


async def resume(run: CheckpointRun, ckpt: RolloutCheckpoint) -> RolloutCheckpoint:
    """Resume every participant, release the set's slot, and write Ready with the pause and
    total durations."""
    coordinator = await joined(run, ckpt)
    resume_started = run.now()
    if set_lost(run.rset, ckpt.status.attempt) is None:
        with tracing.span("resume"):
            resumed = await coordinator.resume(
                ckpt.metadata.name, run.now() + run.settings.resume_timeout_seconds
            )
        if resumed.failures:
            logger.warning(
                "checkpoint %s is Ready but resume failed on %s (their lease resumes them)",
                ckpt.metadata.name,
                describe(resumed.failures),
            )
    durations = ckpt.status.durations or CheckpointDurations()
    total = run.now() - run.started
    pause = (durations.prepare_seconds or 0) + (durations.commit_seconds or 0)
    pause += run.now() - resume_started
    durations = durations.model_copy(
        update={"pause_seconds": round(pause, 3), "total_seconds": round(total, 3)}
    )
    await release_slot(run.context, ckpt)
    await enter_phase(
        run.context,
        ckpt,
        CheckpointPhase.READY,
        durations=durations,
        completed_at=datetime.now(UTC),
    )
    return ckpt
