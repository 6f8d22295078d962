"""The trainer-step policy (`checkpointPolicy.onTrainerCheckpoint`, docs/policy.md): a
TrainerCheckpoint for a trainer step newly reported in the set's annotation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from ...model.api import ANNOTATION_TRAINER_STEP, TargetLevel, Trigger
from ...model.reasons import Reason
from .views import Create, Note, SetView

_STEP_PATTERN: Final = re.compile(r"^[0-9]{1,18}$")


def trainer_checkpoint_name(set_name: str, step: int) -> str:
    return f"{set_name}-step-{step}"


@dataclass(frozen=True)
class TrainerStepDecision:
    create: Create | None = None
    record_step: int | None = None
    """The step to store as `status.lastTrainerStep` (set together with the create)."""
    note: Note | None = None


def parse_trainer_step(value: str | None) -> int | None:
    if value is None or not _STEP_PATTERN.match(value.strip()):
        return None
    return int(value.strip())


def trainer_step_decision(view: SetView) -> TrainerStepDecision:
    """A TrainerCheckpoint for a newly reported trainer step, when the policy asks for one.

    A step at or below `status.lastTrainerStep` is done already (a re-applied manifest, an
    operator restart). With `targetLevel: sibling` the trainer's own checkpoint holds what a
    recovery needs, so nothing follows it (seed 000).
    """
    raw = view.trainer_step_annotation
    if raw is None:
        return TrainerStepDecision()
    step = parse_trainer_step(raw)
    if step is None:
        return TrainerStepDecision(
            note=Note(
                Reason.INVALID_TRAINER_STEP,
                f"annotation {ANNOTATION_TRAINER_STEP}={raw!r} is not a trainer step (a whole "
                'number such as "120"); no checkpoint was created. Write the step the trainer '
                "checkpoint was saved at.",
                warning=True,
            )
        )
    if view.last_trainer_step is not None and step <= view.last_trainer_step:
        return TrainerStepDecision()
    if view.target_level is TargetLevel.SIBLING:
        return TrainerStepDecision(
            note=Note(
                Reason.TRAINER_STEP_IGNORED,
                f"trainer step {step}: no checkpoint with recovery.targetLevel sibling (the "
                "trainer checkpoint already holds what a recovery needs)",
            )
        )
    if not view.policy.on_trainer_checkpoint:
        return TrainerStepDecision(
            note=Note(
                Reason.TRAINER_STEP_IGNORED,
                f"trainer step {step}: no checkpoint, checkpointPolicy.onTrainerCheckpoint is "
                "false",
            )
        )
    return TrainerStepDecision(
        create=Create(
            trainer_checkpoint_name(view.name, step),
            Trigger.TRAINER_CHECKPOINT,
            f"the trainer reported a trainer checkpoint at step {step}",
            trainer_step=step,
        ),
        record_step=step,
    )
