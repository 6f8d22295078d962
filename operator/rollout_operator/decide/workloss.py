"""Work-loss accounting of one recovery: what the restored checkpoint kept, and what the lost
attempt had done after it that the episodes now do again (`status.lastRecovery`; docs/operations.md,
"Work lost in a recovery").

Nothing here is estimated by the operator; the participants count their own work and the
recovery only adds it up:

- every participant's restore reply says what the installed records hold (`RestoreReply.kept`:
  `model_tokens` of cut and held generations, `steps` completed): the work *kept*;
- a participant that outlived the loss retires the lost attempt (InPlace keeps it; Recreate
  retires it before deleting it) and says what that attempt did after the last checkpoint it
  committed or restored, for episodes still unfinished (`RetireReply.lost`): the work *done
  again* once the episodes continue from that checkpoint.

A lost pod cannot be asked. Its instance, and every other one without a report that counts
from the checkpoint the recovery restored, is listed as uncounted, so the totals read as
lower bounds exactly when the list is not empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ..model.api import LostWorkReport, Work

MODEL_TOKENS: Final = "model_tokens"
"""The protocol's counter of generated tokens (the reference model server reports it)."""
STEPS: Final = "steps"
"""The protocol's counter of completed episode steps (environment and agent servers)."""


def work_of(counts: Mapping[str, int]) -> Work:
    """The counters this operator knows, from one participant's reply (others are ignored)."""
    return Work(model_tokens=int(counts.get(MODEL_TOKENS, 0)), steps=int(counts.get(STEPS, 0)))


def total_work(counts: Iterable[Mapping[str, int]]) -> Work:
    """The sum over several participants' replies."""
    parts = [work_of(c) for c in counts]
    return Work(model_tokens=sum(p.model_tokens for p in parts), steps=sum(p.steps for p in parts))


def lost_reports(lost: Mapping[str, tuple[str | None, Mapping[str, int]]]) -> list[LostWorkReport]:
    """Status entries from a retire's reports: instance -> (the checkpoint it counts from,
    its counts), in instance order."""
    return [
        LostWorkReport(instance=instance, since=since, **work_of(counts).model_dump())
        for instance, (since, counts) in sorted(lost.items())
    ]


@dataclass(frozen=True)
class WorkLoss:
    """One recovery's work kept and done again, and whose work nobody could count."""

    model_tokens_kept: int
    model_tokens_generated_again: int
    steps_kept: int
    steps_redone: int
    uncounted: list[str]


def work_loss(
    *,
    checkpoint: str | None,
    instances: Sequence[str],
    reports: Sequence[LostWorkReport],
    kept: Work | None,
) -> WorkLoss:
    """Add up one recovery.

    `checkpoint`: the one restored (None: nothing was, episodes start over, and only reports
    that count from no checkpoint at all apply). `instances`: every participant instance of
    the lost attempt. `reports`: the retire reports of those that outlived the loss. A report
    counting from another checkpoint (its participant committed a newer one that never became
    Ready, or the restore fell back to an older one) says nothing about this restore.
    """
    counted = {r.instance: r for r in reports if r.since == checkpoint}
    return WorkLoss(
        model_tokens_kept=0 if kept is None else kept.model_tokens,
        model_tokens_generated_again=sum(r.model_tokens for r in counted.values()),
        steps_kept=0 if kept is None else kept.steps,
        steps_redone=sum(r.steps for r in counted.values()),
        uncounted=sorted(i for i in set(instances) if i not in counted),
    )
