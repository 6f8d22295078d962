"""The deadline policy (`checkpointPolicy.mustSaveBy`, docs/policy.md): the deadline checkpoint,
started `saveReserveSeconds` early, and the save reserve built on measured durations
(docs/design.md#63-deadline)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from ...model.api import SetConditionType, Trigger, format_time
from ...model.reasons import Reason
from .views import CheckpointView, ConditionChange, Create, DeadlineRecord, SetView, name_stamp

DEFAULT_RESERVE_SECONDS: Final = 60
"""The reserve before any checkpoint of the set has been measured: generous, because a deadline
checkpoint that starts too early costs a minute of unsaved work, one that starts too late costs
every unfinished turn."""
RESERVE_MARGIN_SECONDS: Final = 2.0
"""Added to every estimate: the operator's own latency (watch event, daemon start, the status
writes of the flow) that no measured duration contains when the next checkpoint starts."""
RESERVE_FACTOR: Final = 1.25
"""The estimate is scaled up by this much: checkpoint cost grows with the work in flight."""
RESERVE_MAD_K: Final = 3.0
"""How many (MAD-estimated) standard deviations above the median the estimate reaches."""
RESERVE_RECENT: Final = 3
"""The longest of this many newest durations is always covered, so a slowdown raises the reserve
with the first slow checkpoint instead of after the median moves."""
MAD_TO_SIGMA: Final = 1.4826
"""Scales the median absolute deviation to a standard deviation for normal data."""


def deadline_checkpoint_name(set_name: str, must_save_by: datetime) -> str:
    return f"{set_name}-deadline-{name_stamp(must_save_by)}"


# --- the save reserve (docs/design.md#63-deadline) ------------------------------------------------


def save_reserve_seconds(
    durations: Sequence[float],
    *,
    default: int = DEFAULT_RESERVE_SECONDS,
    margin: float = RESERVE_MARGIN_SECONDS,
    factor: float = RESERVE_FACTOR,
) -> int:
    """How long before `mustSaveBy` the deadline checkpoint starts.

    Robust against one odd duration in either direction: the median plus `RESERVE_MAD_K` times
    the MAD-estimated spread (so a single fast checkpoint does not shrink it, and an outlier does
    not dominate it), but never less than the longest of the newest `RESERVE_RECENT` (so a
    slowdown counts at once), scaled by `factor` plus `margin`, rounded up to whole seconds.
    """
    usable = [d for d in durations if math.isfinite(d) and d >= 0]
    if not usable:
        return default
    median = statistics.median(usable)
    mad = statistics.median(abs(d - median) for d in usable)
    spread = median + RESERVE_MAD_K * MAD_TO_SIGMA * mad
    recent = max(usable[-RESERVE_RECENT:])
    return math.ceil(max(spread, recent) * factor + margin)


def deadline_start(must_save_by: datetime, reserve_seconds: int) -> datetime:
    """When the deadline checkpoint starts: `mustSaveBy - saveReserveSeconds`."""
    return must_save_by - timedelta(seconds=reserve_seconds)


@dataclass(frozen=True)
class DeadlineDecision:
    condition: ConditionChange | None = None
    create: Create | None = None
    wake_at: datetime | None = None
    settle: DeadlineRecord | None = None
    """Record this outcome (the deadline is then decided for good)."""


def _deadline_condition(status: bool, reason: str, message: str) -> ConditionChange:
    return ConditionChange(SetConditionType.DEADLINE_SAVED.value, status, reason, message)


def _settled(
    must: datetime, outcome: str, checkpoint: str | None, status: bool, message: str
) -> DeadlineDecision:
    record = DeadlineRecord(must, outcome, checkpoint, saved=status, message=message)
    return DeadlineDecision(condition=record.condition(), settle=record)


def deadline_decision(
    view: SetView, checkpoints: Sequence[CheckpointView], reserve: int, now: datetime
) -> DeadlineDecision:
    """The `mustSaveBy` checkpoint: started `reserve` seconds early, never twice.

    From the start time S on, a checkpoint of any trigger that is running, or became Ready at
    or after S, covers the deadline: its state is as fresh as one the deadline could still get
    finished in time, so a deadline wait that another checkpoint overtook saves nothing. Only
    when nothing covers it does the deadline create its own checkpoint (late, if the operator
    got to it late: a late save beats none, and `Missed` says so).
    """
    must = view.policy.must_save_by
    if must is None:
        if view.has_deadline_condition:
            return DeadlineDecision(
                condition=_deadline_condition(False, Reason.NO_DEADLINE, "mustSaveBy is unset")
            )
        return DeadlineDecision()
    if view.deadline_settled:
        assert view.deadline_record is not None
        return DeadlineDecision(condition=view.deadline_record.condition())
    when = format_time(must)
    start = deadline_start(must, reserve)
    own = deadline_checkpoint_name(view.name, must)
    if not view.restorable:
        if now < start:
            return DeadlineDecision(
                condition=_deadline_condition(
                    False,
                    Reason.WAITING,
                    f"mustSaveBy {when}: recovery.targetLevel sibling restores no checkpoint, "
                    "so none is taken; afterDeadline applies then",
                ),
                wake_at=start,
            )
        return _settled(
            must,
            Reason.NOTHING_TO_SAVE,
            None,
            False,
            f"mustSaveBy {when}: no checkpoint with recovery.targetLevel sibling (unfinished "
            "episodes restart after a resume)",
        )
    mine = next((c for c in checkpoints if c.name == own and not c.deleting), None)
    if now < start and mine is None:
        return DeadlineDecision(
            condition=_deadline_condition(
                False,
                Reason.WAITING,
                f"the deadline checkpoint starts at {format_time(start)}: mustSaveBy {when} "
                f"minus saveReserveSeconds {reserve}",
            ),
            wake_at=start,
        )
    if mine is not None and not mine.failed:
        # Once the deadline started its own checkpoint, that one is the outcome: the start time
        # moves with the reserve (its own duration changes it), and an earlier checkpoint must
        # not become "covering" after the fact.
        covering = [mine]
    else:
        covering = [
            c
            for c in checkpoints
            if not c.failed
            and not c.deleting
            and (not c.finished or (c.completed is not None and c.completed >= start))
        ]
    ready = sorted(
        (c for c in covering if c.ready),
        key=lambda c: (c.completed or c.created, c.name),
    )
    if ready:
        first = ready[0]
        done = first.completed or now
        margin = (must - done).total_seconds()
        if margin >= 0:
            return _settled(
                must,
                Reason.SAVED,
                first.name,
                True,
                f"checkpoint {first.name} ({first.trigger.value}) was Ready at "
                f"{format_time(done)}, {margin:.0f}s before mustSaveBy {when} "
                f"(saveReserveSeconds {reserve})",
            )
        return _settled(
            must,
            Reason.MISSED,
            first.name,
            False,
            f"checkpoint {first.name} ({first.trigger.value}) was Ready at {format_time(done)}, "
            f"{-margin:.0f}s after mustSaveBy {when}; saveReserveSeconds ({reserve}) has grown "
            "with its duration. If checkpoints often take longer, set mustSaveBy with more slack",
        )
    running = [c for c in covering if not c.finished]
    if running:
        current = min(running, key=lambda c: (c.created, c.name))
        return DeadlineDecision(
            condition=_deadline_condition(
                False,
                Reason.SAVING,
                f"checkpoint {current.name} ({current.trigger.value}) must be Ready by "
                f"mustSaveBy {when}",
            )
        )
    if mine is not None and mine.failed:
        return _settled(
            must,
            Reason.CHECKPOINT_FAILED,
            None,
            False,
            f"the deadline checkpoint {own} failed ({mine.failure or 'no reason given'}); "
            f"nothing was saved for mustSaveBy {when}. Fix the cause shown on {own}",
        )
    if view.suspended or view.deleting:
        # A set that is still starting is not this case: its deadline checkpoint waits in the
        # checkpoint queue until the set is Ready (bounded by the flow's own deadline).
        return _settled(
            must,
            Reason.NOTHING_TO_SAVE,
            None,
            False,
            f"mustSaveBy {when}: the set is suspended (no participant pods run), so there is "
            "nothing a deadline checkpoint could capture",
        )
    late = "" if now < must else f" ({(now - must).total_seconds():.0f}s late)"
    return DeadlineDecision(
        condition=_deadline_condition(
            False,
            Reason.SAVING,
            f"checkpoint {own} must be Ready by mustSaveBy {when}{late}",
        ),
        create=Create(
            own,
            Trigger.DEADLINE,
            f"mustSaveBy {when} minus saveReserveSeconds {reserve}{late}",
        ),
    )
