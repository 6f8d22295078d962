"""The interval policy (`checkpointPolicy.intervalSeconds`, docs/policy.md): an Interval checkpoint
`intervalSeconds` after the last checkpoint ended."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ...model.api import Trigger, format_time
from .views import CheckpointView, Create, SetView, name_stamp


def interval_checkpoint_name(set_name: str, due: datetime) -> str:
    return f"{set_name}-interval-{name_stamp(due)}"


@dataclass(frozen=True)
class TimedDecision:
    create: Create | None = None
    wake_at: datetime | None = None


def _unfinished(checkpoints: Iterable[CheckpointView]) -> list[CheckpointView]:
    return [c for c in checkpoints if not c.finished and not c.deleting]


def interval_decision(
    view: SetView, checkpoints: Sequence[CheckpointView], now: datetime
) -> TimedDecision:
    """An Interval checkpoint `intervalSeconds` after the last checkpoint of any trigger ended
    (or after the attempt became Ready, whichever is later).

    Counting from the end of the previous checkpoint means a tick can never fall inside a
    running checkpoint (no two at once, nothing queued behind a slow one), and a trainer or
    manual checkpoint resets the timer instead of being followed by a redundant one.
    """
    interval = view.policy.interval_seconds
    if interval is None or not view.runs or _unfinished(checkpoints):
        return TimedDecision()
    ends = [c.completed or c.created for c in checkpoints]
    assert view.ready_since is not None  # view.runs
    base = max([view.ready_since, *ends])
    due = base + timedelta(seconds=interval)
    if now < due:
        return TimedDecision(wake_at=due)
    return TimedDecision(
        create=Create(
            interval_checkpoint_name(view.name, due),
            Trigger.INTERVAL,
            f"intervalSeconds {interval} since {format_time(base)}",
        )
    )
