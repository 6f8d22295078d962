"""The trainer-step policy (`decide/policy/trainerstep.py`, pure): a TrainerCheckpoint per newly
reported step.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from rollout_operator.decide.policy.trainerstep import trainer_step_decision
from rollout_operator.model import api
from rollout_operator.model.api import Trigger
from rollout_operator.model.reasons import Reason
from testsupport.policyviews import view


def test_a_new_trainer_step_creates_a_trainer_checkpoint_once() -> None:
    decision = trainer_step_decision(view(annotations={api.ANNOTATION_TRAINER_STEP: "120"}))
    assert decision.create is not None
    assert decision.create.name == "math-step-120"
    assert decision.create.trigger is Trigger.TRAINER_CHECKPOINT
    assert decision.create.trainer_step == 120
    assert decision.record_step == 120
    again = view(annotations={api.ANNOTATION_TRAINER_STEP: "120"}, status={"lastTrainerStep": 120})
    assert trainer_step_decision(again).create is None


def test_trainer_steps_make_no_checkpoint_when_off_or_at_sibling_level() -> None:
    annotations = {api.ANNOTATION_TRAINER_STEP: "7"}
    off = view(annotations=annotations, policy={"onTrainerCheckpoint": False, "intervalSeconds": 9})
    sibling = view(annotations=annotations, recovery={"targetLevel": "sibling"})
    for decision in (trainer_step_decision(off), trainer_step_decision(sibling)):
        assert decision.create is None
        assert decision.note is not None
        assert decision.note.reason == Reason.TRAINER_STEP_IGNORED
    assert "onTrainerCheckpoint is false" in str(trainer_step_decision(off).note)
    assert "sibling" in str(trainer_step_decision(sibling).note)


def test_an_invalid_trainer_step_is_reported_not_guessed() -> None:
    decision = trainer_step_decision(view(annotations={api.ANNOTATION_TRAINER_STEP: "step-7"}))
    assert decision.create is None
    assert decision.note is not None
    assert decision.note.warning
    assert decision.note.reason == Reason.INVALID_TRAINER_STEP
    assert "whole number" in decision.note.message
