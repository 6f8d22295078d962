"""The retention policy (`decide/policy/retention.py`, pure): which finished checkpoints go, and
where the set's latest checkpoint moves when one goes.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from rollout_operator.decide.policy.retention import retention
from rollout_operator.model import api
from testsupport.policyviews import at, ckpt, latest_after_delete


def test_retention_orders_checkpoints_completed_within_one_second() -> None:
    # Three checkpoints Ready in the same second: completedAt keeps microseconds (MicroTime),
    # so the oldest one goes, whatever order the API lists them in.
    completions = {"c3": 20.5, "c2": 20.1, "c4": 20.9}
    checkpoints = [ckpt(n, 10, completed=t, ready=True) for n, t in completions.items()]
    assert retention(checkpoints, 2, []) == ["c2"]
    status = api.RolloutCheckpointStatus(completed_at=at(20.5))
    wire = api.dump(status)["completedAt"]
    assert wire.endswith(".500000Z")
    assert api.RolloutCheckpointStatus.model_validate({"completedAt": wire}).completed_at == at(
        20.5
    )


def test_retention_keeps_the_newest_ready_and_failed_and_never_the_protected() -> None:
    checkpoints = [
        ckpt("r1", 0, completed=1, ready=True),
        ckpt("r2", 10, completed=11, ready=True),
        ckpt("r3", 20, completed=21, ready=True),
        ckpt("r4", 30, completed=31, ready=True),
        ckpt("f1", 5, completed=6, failed=True),
        ckpt("f2", 15, completed=16, failed=True),
        ckpt("f3", 25, completed=26, failed=True),
        ckpt("running", 40),
    ]
    assert sorted(retention(checkpoints, 2, [None])) == ["f1", "r1", "r2"]
    assert sorted(retention(checkpoints, 2, ["r1", None])) == ["f1", "r2"]
    assert retention(checkpoints, 10, []) == []


def test_latest_moves_to_the_newest_other_ready_checkpoint() -> None:
    checkpoints = [
        ckpt("old", 0, completed=1, ready=True),
        ckpt("new", 10, completed=11, ready=True),
        ckpt("bad", 20, completed=21, failed=True),
    ]
    newest = latest_after_delete(checkpoints, "new")
    assert newest is not None
    assert newest.name == "old"
    assert latest_after_delete(checkpoints[:1], "old") is None
