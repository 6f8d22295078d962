"""When to start the next recovery of a set whose participants keep getting lost.

A participant that becomes Ready and crashes seconds later would otherwise start recovery after
recovery without end, each counting its tries from zero. Recoveries are counted in a sliding
window (`recovery.windowSeconds`) against `recovery.maxRestarts`, spaced out exponentially, and
past the bound recovery stops (`RecoveryLimitReached`) until the spec changes or the user sets
the `checkpoint.rollout.dev/retry-recovery` annotation to a new value.

Pure: the recovery flow (`flows/recovery/`) reads the set and acts on the decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

FIRST_SPACING_SECONDS: Final = 5.0
MAX_SPACING_SECONDS: Final = 300.0


@dataclass(frozen=True)
class ChurnDecision:
    """Start now, wait until `not_before`, or stop (`stop` says why, for the condition)."""

    recent: int
    """Recoveries started inside the window."""
    not_before: datetime | None = None
    stop: str | None = None

    @property
    def start_now(self) -> bool:
        return self.not_before is None and self.stop is None


def spacing(recent: int) -> timedelta:
    """The gap after the previous recovery before the next one may start."""
    if recent <= 0:
        return timedelta(0)
    return timedelta(seconds=min(MAX_SPACING_SECONDS, FIRST_SPACING_SECONDS * 2 ** (recent - 1)))


def decide(
    starts: Sequence[datetime], now: datetime, *, max_restarts: int, window_seconds: int
) -> ChurnDecision:
    """What to do about a loss, given when the earlier recoveries started."""
    recent = sorted(t for t in starts if now - t < timedelta(seconds=window_seconds))
    if len(recent) > max_restarts:
        return ChurnDecision(
            recent=len(recent),
            stop=(
                f"{len(recent)} recoveries in the last {window_seconds}s exceed "
                f"recovery.maxRestarts ({max_restarts})"
            ),
        )
    if recent:
        not_before = recent[-1] + spacing(len(recent))
        if now < not_before:
            return ChurnDecision(recent=len(recent), not_before=not_before)
    return ChurnDecision(recent=len(recent))


def kept_starts(
    starts: Sequence[datetime], now: datetime, *, window_seconds: int, bound: int
) -> list[datetime]:
    """The start times worth keeping after one more recovery starts at `now`."""
    recent = [t for t in starts if now - t < timedelta(seconds=window_seconds)]
    return [*sorted(recent), now][-bound:]
