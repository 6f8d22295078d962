"""The interval policy (`decide/policy/interval.py`, pure): when an Interval checkpoint is due, and
the rule that refuses one at sibling level.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rollout_operator.decide.policy.interval import interval_decision
from rollout_operator.model import api, crdgen
from rollout_operator.model.api import Trigger
from testsupport.policyviews import at, ckpt, recovery_status, rollout_set, view


def test_interval_counts_from_the_end_of_the_last_checkpoint() -> None:
    rset = view(policy={"intervalSeconds": 60})
    last = [ckpt("a", 100, completed=130, ready=True)]
    waiting = interval_decision(rset, last, at(150))
    assert waiting.create is None
    assert waiting.wake_at == at(190)
    due = interval_decision(rset, last, at(190))
    assert due.create is not None
    assert due.create.trigger is Trigger.INTERVAL
    assert due.create.name == "math-interval-20261129-120310"


def test_interval_counts_from_when_the_attempt_became_ready() -> None:
    rset = view(policy={"intervalSeconds": 60}, ready_since=500)
    assert interval_decision(rset, [ckpt("a", 0, completed=5, ready=True)], at(520)).wake_at == at(
        560
    )


def test_no_interval_tick_while_a_checkpoint_runs_or_the_set_does_not_run() -> None:
    running = [ckpt("a", 0, completed=5, ready=True), ckpt("b", 100)]
    assert interval_decision(view(policy={"intervalSeconds": 10}), running, at(500)) == (
        interval_decision(view(policy={"intervalSeconds": 10}), running, at(501))
    )
    assert interval_decision(view(policy={"intervalSeconds": 10}), running, at(500)).create is None
    for stopped in (
        view(policy={"intervalSeconds": 10}, ready_since=None),
        view(policy={"intervalSeconds": 10}, suspend=True),
        view(policy={"intervalSeconds": 10}, status={"recovery": recovery_status()}),
    ):
        decision = interval_decision(stopped, [], at(500))
        assert decision.create is None
        assert decision.wake_at is None


def test_interval_at_sibling_level_is_refused_with_the_reason() -> None:
    body = rollout_set().spec.model_dump(by_alias=True, mode="json")
    body["recovery"] = {"targetLevel": "sibling"}
    body["checkpointPolicy"] = {"intervalSeconds": 60}
    with pytest.raises(ValidationError) as caught:
        api.RolloutSetSpec.model_validate(body)
    assert api.RULE_SIBLING_INTERVAL.message in str(caught.value)
    assert api.RULE_SIBLING_INTERVAL.cel in str(crdgen.crd(crdgen.ROLLOUT_SET))
