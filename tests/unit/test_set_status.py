"""The set's checkpoint fields, derived by its pass from its checkpoints (`setstatus`).

One writer: the set's pass writes `latestCheckpoint`, `latestCheckpointTime`,
`recentCheckpointSeconds` and `activeCheckpoint`; a shown `latestCheckpoint` other than the one
it last wrote was written by someone else and is repaired with an Event.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rollout_operator.decide.policy.views import checkpoint_views
from rollout_operator.decide.setstatus import RECENT_DURATIONS, REPAIRED, checkpoint_fields
from rollout_operator.model import api
from testsupport import builders

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def at(minute: int) -> str:
    return (T0 + timedelta(minutes=minute)).strftime("%Y-%m-%dT%H:%M:%SZ")


def checkpoint(
    name: str, phase: str, minute: int, *, total: float = 2.0, deleting: bool = False
) -> dict[str, Any]:
    completed = at(minute + 1) if phase in ("Ready", "Failed") else None
    return builders.checkpoint_body(
        name,
        set_name="math",
        created=at(minute),
        deleted=at(minute + 30) if deleting else None,
        status=builders.checkpoint_status(
            phase,
            at=at(minute),
            completed=completed,
            reason="X",
            durations={"totalSeconds": total},
        ),
    )


def rollout_set(**status: Any) -> api.RolloutSet:
    return builders.rollout_set(
        name="math", uid=None, roles={"model": None}, port=9000, status=status
    )


def test_a_running_checkpoint_is_shown_active_and_a_finished_one_becomes_the_latest() -> None:
    running = [checkpoint("c1", "Ready", 0, total=3.0), checkpoint("c2", "Committing", 5)]
    fields, repair = checkpoint_fields(rollout_set(), checkpoint_views(running), None)
    assert repair is None
    assert fields == {
        "activeCheckpoint": "c2",
        "latestCheckpoint": "c1",
        "recentCheckpointSeconds": [3.0],
        "latestCheckpointTime": at(1),
    }
    shown = rollout_set(**{k: v for k, v in fields.items() if k != "activeCheckpoint"})
    done = [checkpoint("c1", "Ready", 0, total=3.0), checkpoint("c2", "Ready", 5, total=4.0)]
    fields, repair = checkpoint_fields(shown, checkpoint_views(done), "c1")
    assert repair is None, "a checkpoint published: not a repair"
    assert fields == {
        "activeCheckpoint": None,
        "latestCheckpoint": "c2",
        "recentCheckpointSeconds": [3.0, 4.0],
        "latestCheckpointTime": at(6),
    }


def test_durations_outlive_retention_and_keep_the_newest() -> None:
    history = [float(n) for n in range(RECENT_DURATIONS)]
    shown = rollout_set(
        latestCheckpoint="c9", latestCheckpointTime=at(10), recentCheckpointSeconds=history
    )
    views = checkpoint_views(
        [checkpoint("c9", "Ready", 9), checkpoint("c10", "Ready", 20, total=99.0)]
    )
    fields, _ = checkpoint_fields(shown, views, "c9")
    assert fields["recentCheckpointSeconds"] == [*history[1:], 99.0]
    # counted once: the next pass adds nothing
    again = rollout_set(
        latestCheckpoint="c10",
        latestCheckpointTime=fields["latestCheckpointTime"],
        recentCheckpointSeconds=fields["recentCheckpointSeconds"],
    )
    fields, _ = checkpoint_fields(again, views, "c10")
    assert fields == {"activeCheckpoint": None}


def test_a_deleting_latest_checkpoint_is_left_for_the_previous_one() -> None:
    shown = rollout_set(latestCheckpoint="c2", latestCheckpointTime=at(6))
    views = checkpoint_views(
        [checkpoint("c1", "Ready", 0), checkpoint("c2", "Ready", 5, deleting=True)]
    )
    fields, repair = checkpoint_fields(shown, views, "c2")
    assert fields["latestCheckpoint"] == "c1"
    assert repair is None, "retention or a person deleted it: not a repair"


def test_a_value_written_by_someone_else_is_repaired_with_an_event() -> None:
    views = checkpoint_views([checkpoint("c1", "Ready", 0), checkpoint("c2", "Ready", 5)])
    for written in ("c1", "not-a-checkpoint", None):
        shown = rollout_set(latestCheckpoint=written, latestCheckpointTime=at(6))
        fields, repair = checkpoint_fields(shown, views, "c2")
        assert fields["latestCheckpoint"] == "c2"
        assert repair is not None
        assert repair.reason == REPAIRED
        assert repr(written) in repair.message


def test_a_checkpoint_being_published_is_left_alone() -> None:
    views = checkpoint_views([checkpoint("c1", "Ready", 0), checkpoint("c2", "Resuming", 5)])
    shown = rollout_set(latestCheckpoint="c2", latestCheckpointTime=at(1))
    fields, repair = checkpoint_fields(shown, views, "c1")
    assert "latestCheckpoint" not in fields
    assert repair is None


def test_a_completion_with_fractional_seconds_is_counted_once() -> None:
    """The flow writes completedAt with microseconds: the mark keeps them, so the next pass
    finds nothing new (a whole-second mark counted the same checkpoint on every pass)."""
    done = checkpoint("c1", "Ready", 0, total=3.0)
    done["status"]["completedAt"] = "2026-12-01T00:01:00.250000Z"
    fields, _ = checkpoint_fields(rollout_set(), checkpoint_views([done]), None)
    assert fields["recentCheckpointSeconds"] == [3.0]
    again = rollout_set(**{k: v for k, v in fields.items() if k != "activeCheckpoint"})
    fields, _ = checkpoint_fields(again, checkpoint_views([done]), "c1")
    assert fields == {"activeCheckpoint": None}
