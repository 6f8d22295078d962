"""NeMo Gym 0.7's typed episode on the adapter's `/run` (docs/gym.md, "The typed episode").

nemo-gym 0.7 (`nemo_gym/episode_types.py`, `single_agent_turn_types.py`) runs an episode as
`POST /run {episode_id: {rollout_id, attempt}, task: {task_id: {taskset, task_id}, task_input}}`
and answers exactly one of `result` (the resources server's verify response) or `failure`
(`EpisodeFailure{failure_reason, terminal, stage, failure_kind}`), beside the same identities.
The models here are written from 0.7.0's, field for field (`extra="forbid"` where Gym's are);
the adapter's `/run` takes this shape and the request of 0.4 (`{rollout_id, attempt, task}`)
on one route, so one `RunRoute` keeps both: a rollout is live at most once here, whichever
shape began it.

A failure is one of our error codes: `terminal` is false exactly for the codes after which the
set's next attempt plays the rollout again (`RESTORE_CODES`), so a Gym collection that resumes
(re-sending each non-terminal failure as its next attempt) re-sends only what a recovery can
continue, and never a refusal no restore changes (a peer's 404, a task the model refuses).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from rollout_protocol import (
    RESTORE_CODES,
    Boundary,
    Episode,
    ErrorCode,
    ProtocolError,
    RunRoute,
    gym_rollout_id,
)

P = TypeVar("P")

FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]
"""Where an episode failed (nemo-gym 0.7's `failure_kinds.FailureStage`)."""

MAX_FAILURE_REASON: Final = 2000
"""Gym's bound on `EpisodeFailure.failure_reason`."""

STAGES: Final[Mapping[str, FailureStage]] = {
    "seed": "seed",
    "model": "agent",
    "tool": "agent",
    "verify": "verification",
}
"""Gym's stage of each of the adapter's steps (`rollout_gym.environment`)."""

KINDS: Final[Mapping[ErrorCode, str]] = {
    ErrorCode.ADMISSION_CLOSED: "shutdown",
    ErrorCode.ATTEMPT_RETIRED: "cancelled",
    ErrorCode.UNREACHABLE: "transport_unreachable",
    ErrorCode.UNRESPONSIVE: "transport_timeout",
}
"""Our codes that have a name in Gym's failure vocabulary (`nemo_gym.failure_kinds`); every
other code is said as `rollout_gym:<code>` (Gym's form for a server's own kind)."""

BEFORE_BEGIN: Final = frozenset({ErrorCode.ADMISSION_CLOSED, ErrorCode.ATTEMPT_MISMATCH})
"""Refusals made before an episode begins here: Gym's `admission` stage."""


class EpisodeIdentity(BaseModel):
    """Gym's `EpisodeId`: one physical attempt of a logical rollout. The attempt is the set's
    (docs/gym.md, "One attempt field")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1)
    attempt: int = Field(default=0, ge=0)

    @field_validator("rollout_id")
    @classmethod
    def _gym_id(cls, rollout_id: str) -> str:
        return gym_rollout_id(rollout_id)  # Gym's pattern, and no `-a<N>` ending

    @property
    def capture_key(self) -> str:
        """Gym's attempt-qualified key: the rollout id at attempt 0, `<id>-a<N>` after."""
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"


class TaskId(BaseModel):
    """Gym's `TaskId`: one task of a run-qualified taskset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


class TaskInput(BaseModel):
    """Gym's `SingleAgentTurnTaskInput`: the model's request and the fields verify reads, in
    `task_data`; flat fields beside `responses_create_params` are merged into it, as Gym does."""

    model_config = ConfigDict(extra="forbid")

    responses_create_params: dict[str, Any]
    task_data: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value
        fields = dict(value)
        params = fields.pop("responses_create_params", None)
        task_data = fields.pop("task_data", {})
        if not isinstance(task_data, Mapping):
            return value  # the field's own validation names it
        for key in fields.keys() & task_data.keys():
            if fields[key] != task_data[key]:
                raise ValueError(f"Conflicting task field {key!r} inside and outside task_data")
        return {"responses_create_params": params, "task_data": {**task_data, **fields}}

    def row(self) -> dict[str, Any]:
        """The flat dataset row the adapter's loop plays (what 0.4 sends as the task), and what
        Gym's own environment server sends to verify (`task_data` and the request)."""
        return {**self.task_data, "responses_create_params": self.responses_create_params}


class MaterializedTask(BaseModel):
    """Gym's `MaterializedTask`: a task's durable identity and its input."""

    model_config = ConfigDict(extra="forbid")

    task_id: TaskId
    task_input: TaskInput


class EpisodeRequest(BaseModel):
    """`POST /run` as nemo-gym 0.7 sends it (`BaseEpisodeRequest`)."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeIdentity
    task: MaterializedTask


class EpisodeFailure(BaseModel):
    """Gym's `EpisodeFailure`; `failure_kind` and `stage` are left out when unknown, as Gym
    serializes them."""

    model_config = ConfigDict(extra="forbid")

    failure_reason: str = Field(max_length=MAX_FAILURE_REASON)
    terminal: bool
    failure_kind: str | None = None
    stage: FailureStage | None = None

    @model_serializer(mode="wrap")
    def _without_unknowns(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        result: dict[str, Any] = handler(self)
        for key in ("failure_kind", "stage"):
            if result.get(key) is None:
                result.pop(key, None)
        return result


class EpisodeResponse(BaseModel):
    """`/run`'s typed answer (`BaseEpisodeResponse`): exactly one of `result` or `failure`."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeIdentity
    task_id: TaskId
    result: dict[str, Any] | None = None
    failure: EpisodeFailure | None = None

    @model_validator(mode="after")
    def _one_outcome(self) -> EpisodeResponse:
        if (self.result is None) == (self.failure is None):
            raise ValueError("exactly one of result or failure is required")
        return self


def is_materialized(task: Mapping[str, Any]) -> bool:
    """Whether a task has Gym's materialized envelope (`is_materialized_task_row`): then it is
    validated as one, never played as a flat row."""
    return isinstance(task.get("task_id"), Mapping) and "task_input" in task


@dataclass(frozen=True)
class Shaped:
    """A `/run` as `RunRoute` reads it (`RunBody`): either shape, its task digested in one form
    (a materialized task's canonical fields), so both shapes of one task are one task."""

    rollout_id: str
    attempt: int
    task: dict[str, Any]
    row: dict[str, Any]
    """The flat row the loop plays."""


def legacy(rollout_id: str, attempt: int, task: dict[str, Any]) -> Shaped:
    """A 0.4-shaped `/run`: its task is a flat row, or a materialized one (what `rollout-collect
    --gym` reads from a 0.7 taskset), unwrapped; a malformed envelope is 422 `invalid_request`.
    Of a materialized row only `task_id` and `task_input` are read, as Gym's collector reads
    them (its rows also carry its own `_ng_*` fields)."""
    if not is_materialized(task):
        return Shaped(rollout_id, attempt, task, task)
    envelope = {"task_id": task["task_id"], "task_input": task["task_input"]}
    try:
        materialized = MaterializedTask.model_validate(envelope)
    except ValueError as error:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"task: not a materialized Gym task: {error}"
        ) from None
    return Shaped(rollout_id, attempt, materialized.model_dump(), materialized.task_input.row())


def typed(request: EpisodeRequest) -> Shaped:
    """A 0.7-shaped `/run`: the same episode as the 0.4 shape of its id and task."""
    episode = request.episode_id
    row = request.task.task_input.row()
    return Shaped(episode.rollout_id, episode.attempt, request.task.model_dump(), row)


class StagedError(ProtocolError):
    """An episode's error with the Gym stage of the step it failed in."""

    def __init__(self, error: ProtocolError, stage: FailureStage | None) -> None:
        super().__init__(error.code, error.detail)
        self.stage = stage


def failure_of(error: ProtocolError) -> EpisodeFailure:
    """Our error as Gym's failure (docs/gym.md, "Errors and failures")."""
    if isinstance(error, StagedError):
        stage = error.stage
    else:
        stage = "admission" if error.code in BEFORE_BEGIN else None
    reason = str(error)
    if error.code in (ErrorCode.ATTEMPT_MISMATCH, ErrorCode.ATTEMPT_RETIRED):
        reason += ' (the attempt is the set\'s: docs/gym.md, "One attempt field")'
    if len(reason) > MAX_FAILURE_REASON:
        reason = reason[: MAX_FAILURE_REASON - 3] + "..."
    return EpisodeFailure(
        failure_reason=reason,
        terminal=error.code not in RESTORE_CODES,
        failure_kind=KINDS.get(error.code, f"rollout_gym:{error.code.value}"),
        stage=stage,
    )


async def answer(
    runs: RunRoute[P],
    request: EpisodeRequest,
    play: Callable[[Episode], Awaitable[P]],
    *,
    first: Callable[[dict[str, Any]], Boundary],
    result: Callable[[P], dict[str, Any]],
) -> EpisodeResponse:
    """A typed `/run`: the episode played by `runs` as any `/run`, its reply (`result` of what
    `play` returned) or its error (a failure) in Gym's envelope."""

    async def staged(episode: Episode) -> P:
        try:
            return await play(episode)
        except StagedError:
            raise
        except ProtocolError as error:
            raise StagedError(error, STAGES.get(episode.boundary.step)) from error

    shaped = typed(request)
    identity = {"episode_id": request.episode_id, "task_id": request.task.task_id}
    try:
        played = await runs.run(shaped, staged, first=first(shaped.row))
    except ProtocolError as error:
        return EpisodeResponse(**identity, failure=failure_of(error))
    return EpisodeResponse(**identity, result=result(played))
