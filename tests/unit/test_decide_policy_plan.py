"""All the policies for one look at a set (`decide/policy/plan.py`, pure): where their decisions
meet.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from rollout_operator.decide.policy.plan import plan
from rollout_operator.model import api
from rollout_operator.model.api import Trigger
from testsupport.policyviews import at, ckpt, view


def test_a_trainer_checkpoint_resets_the_interval_instead_of_running_beside_it() -> None:
    rset = view(policy={"intervalSeconds": 10}, annotations={api.ANNOTATION_TRAINER_STEP: "3"})
    decided = plan(rset, [ckpt("a", 0, completed=1, ready=True)], at(500))
    assert [c.trigger for c in decided.creates] == [Trigger.TRAINER_CHECKPOINT]
    assert decided.last_trainer_step == 3


def test_a_pass_reports_the_reserve_retention_and_failed_records() -> None:
    rset = view(policy={"keepLatest": 1}, status={"recentCheckpointSeconds": [4.0, 4.0]})
    checkpoints = [
        ckpt("a", 0, completed=1, ready=True),
        ckpt("b", 5, completed=6, ready=True),
        ckpt("c", 7, completed=8, failed=True),
    ]
    decided = plan(rset, checkpoints, at(10))
    assert decided.reserve == 7
    assert decided.delete == ["a"]
    assert decided.remove_records == ["c"]
