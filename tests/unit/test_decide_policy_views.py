"""What the policies read (`decide/policy/views.py`): a RolloutCheckpoint read into its view.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from rollout_operator.decide.policy.views import CheckpointView
from testsupport.policyviews import at, stamp


def test_a_checkpoint_object_is_read_with_its_outcome() -> None:
    raw = {
        "metadata": {"name": "c1", "creationTimestamp": stamp(5)},
        "spec": {"rolloutSet": "math", "trigger": "Eviction"},
        "status": {
            "phase": "Failed",
            "completedAt": stamp(9),
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "ParticipantLost",
                    "message": "pod gone",
                    "lastTransitionTime": stamp(9),
                }
            ],
        },
    }
    got = CheckpointView.from_object(raw)
    assert got.failed
    assert not got.ready
    assert got.finished
    assert got.created == at(5)
    assert got.completed == at(9)
    assert got.failure == "ParticipantLost: pod gone"
