"""When a set that keeps losing participants may start its next recovery."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from rollout_operator.decide.churn import decide, kept_starts, spacing

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_the_first_recovery_starts_at_once() -> None:
    assert decide([], T0, max_restarts=1, window_seconds=600).start_now


def test_recoveries_are_spaced_out_exponentially() -> None:
    assert [spacing(n).total_seconds() for n in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]
    waiting = decide([at(0)], at(3), max_restarts=5, window_seconds=600)
    assert waiting.not_before == at(5)
    assert decide([at(0)], at(5), max_restarts=5, window_seconds=600).start_now
    two = decide([at(0), at(5)], at(12), max_restarts=5, window_seconds=600)
    assert two.not_before == at(15)


def test_past_max_restarts_in_the_window_recovery_stops() -> None:
    """maxRestarts 1: the first loss and one more are recovered; the third stops (17 recoveries
    in 75 s were seen before this bound)."""
    starts = [at(0), at(10)]
    stopped = decide(starts, at(30), max_restarts=1, window_seconds=600)
    assert stopped.stop == "2 recoveries in the last 600s exceed recovery.maxRestarts (1)"
    assert not stopped.start_now


def test_recoveries_older_than_the_window_do_not_count() -> None:
    starts = [at(0), at(10)]
    assert decide(starts, at(700), max_restarts=1, window_seconds=600).start_now
    assert kept_starts(starts, at(700), window_seconds=600, bound=64) == [at(700)]
    assert kept_starts([at(i) for i in range(100)], at(100), window_seconds=600, bound=64) == [
        at(i) for i in range(37, 101)
    ]
