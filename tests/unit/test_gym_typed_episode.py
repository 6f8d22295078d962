"""The typed episode's models and mappings (`rollout_gym.episode`, docs/gym.md, "The typed
episode"), without servers: nemo-gym 0.7.0's field rules, our error codes onto `terminal`, a
peer's error status onto our codes, and a materialized task unwrapped into the row the loop
plays. The same models against 0.7.0's own code and servers: tests/protocol/test_gym_typed_run.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_gym._peers import GymReply
from rollout_gym.environment import Played, RunResult, refused
from rollout_gym.episode import (
    EpisodeFailure,
    EpisodeIdentity,
    EpisodeResponse,
    StagedError,
    TaskInput,
    failure_of,
    legacy,
)
from rollout_protocol import RESTORE_CODES, ErrorCode, ProtocolError

PARAMS = {"input": [{"role": "user", "content": "2 + 3?"}]}
TASK_ID = {"taskset": "counter", "task_id": "t0"}


@pytest.mark.parametrize("code", list(ErrorCode))
def test_terminal_is_exactly_what_no_next_attempt_changes(code: ErrorCode) -> None:
    failure = failure_of(ProtocolError(code, "said"))
    assert failure.terminal is (code not in RESTORE_CODES)
    assert failure.failure_kind is not None
    assert failure.failure_reason.startswith(f"{code.value}: said")


def test_the_codes_with_a_name_in_gyms_vocabulary_use_it() -> None:
    kinds = {
        code: failure_of(ProtocolError(code, "x")).failure_kind
        for code in (ErrorCode.UNREACHABLE, ErrorCode.ADMISSION_CLOSED, ErrorCode.NOT_FOUND)
    }
    assert kinds == {
        ErrorCode.UNREACHABLE: "transport_unreachable",
        ErrorCode.ADMISSION_CLOSED: "shutdown",
        ErrorCode.NOT_FOUND: "rollout_gym:not_found",
    }


def test_a_failure_says_its_stage_when_known_and_leaves_it_out_otherwise() -> None:
    mismatch = failure_of(ProtocolError(ErrorCode.ATTEMPT_MISMATCH, "runs attempt 1, not 0"))
    assert mismatch.stage == "admission"
    assert "One attempt field" in mismatch.failure_reason
    staged = failure_of(StagedError(ProtocolError(ErrorCode.UNSUPPORTED, "404"), "seed"))
    assert (staged.stage, staged.terminal) == ("seed", True)
    retired = failure_of(ProtocolError(ErrorCode.ATTEMPT_RETIRED, "retired"))
    assert retired.model_dump(mode="json") == {
        "failure_reason": retired.failure_reason,
        "terminal": False,
        "failure_kind": "cancelled",
    }, "an unknown stage is left out, as Gym serializes it"


def test_a_long_reason_is_cut_to_gyms_bound() -> None:
    failure = failure_of(ProtocolError(ErrorCode.INTERNAL, "x" * 5000))
    assert len(failure.failure_reason) == 2000
    with pytest.raises(ValidationError):
        EpisodeFailure(failure_reason="x" * 2001, terminal=True)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (404, ErrorCode.UNSUPPORTED),
        (405, ErrorCode.UNSUPPORTED),
        (422, ErrorCode.INVALID_REQUEST),
        (400, ErrorCode.INVALID_REQUEST),
        (408, ErrorCode.INTERNAL),
        (409, ErrorCode.INTERNAL),  # this project's servers: a call of another attempt
        (425, ErrorCode.INTERNAL),
        (429, ErrorCode.INTERNAL),
        (500, ErrorCode.INTERNAL),
        (503, ErrorCode.INTERNAL),
    ],
)
def test_a_peers_error_status_is_final_unless_it_may_change(status: int, code: ErrorCode) -> None:
    error = refused("seed_session", GymReply(status, "nope", {}))
    assert error.code is code
    assert f"seed_session answered {status}: nope" in error.detail


@pytest.mark.parametrize("rollout_id", ["astropy:12907", "r-a3", "-r", ""])
def test_a_rollout_id_gym_refuses_is_refused(rollout_id: str) -> None:
    with pytest.raises(ValidationError):
        EpisodeIdentity(rollout_id=rollout_id, attempt=0)


def test_the_capture_key_is_gyms() -> None:
    assert EpisodeIdentity(rollout_id="r-a0").capture_key == "r-a0"
    assert EpisodeIdentity(rollout_id="r", attempt=2).capture_key == "r-a2"


def test_exactly_one_of_result_or_failure() -> None:
    ids: dict[str, Any] = {"episode_id": {"rollout_id": "r"}, "task_id": TASK_ID}
    failure = EpisodeFailure(failure_reason="x", terminal=True)
    with pytest.raises(ValidationError):
        EpisodeResponse.model_validate(ids)
    with pytest.raises(ValidationError):
        EpisodeResponse.model_validate({**ids, "result": {"reward": 1.0}, "failure": failure})


def test_task_input_flat_or_canonical_is_one_row() -> None:
    canonical = TaskInput.model_validate(
        {"responses_create_params": PARAMS, "task_data": {"expected": 5}}
    )
    flat = TaskInput.model_validate({"responses_create_params": PARAMS, "expected": 5})
    assert canonical == flat
    assert flat.row() == {"responses_create_params": PARAMS, "expected": 5}
    with pytest.raises(ValidationError, match="Conflicting task field 'expected'"):
        TaskInput.model_validate(
            {"responses_create_params": PARAMS, "expected": 5, "task_data": {"expected": 6}}
        )


def test_a_materialized_task_in_the_04_shape_is_unwrapped() -> None:
    flat = {"responses_create_params": PARAMS, "expected": 5}
    assert legacy("r", 0, flat).row == flat
    row = {"task_id": TASK_ID, "task_input": flat, "_ng_task_index": 3, "_ng_rollout_index": 0}
    shaped = legacy("r", 0, row)
    assert shaped.row == flat
    canonical = {"responses_create_params": PARAMS, "task_data": {"expected": 5}}
    assert shaped.task == {"task_id": TASK_ID, "task_input": canonical}
    with pytest.raises(ProtocolError) as refused_row:
        legacy("r", 0, {"task_id": {"taskset": "counter"}, "task_input": flat})
    assert refused_row.value.code is ErrorCode.INVALID_REQUEST


def test_a_finished_episodes_verify_answer_is_kept_compressed() -> None:
    """`RunRoute` keeps 10,000 finished replies: the verify answer (the episode's whole request
    and response) is kept as compressed JSON, and read back whole for a repeated typed call."""
    outputs = [
        {"type": "message", "content": [{"text": f"step {i}: " + "x" * 200}]} for i in range(50)
    ]
    verification = {
        "reward": 1.0,
        "response": {"output": outputs},
        "responses_create_params": PARAMS,
    }
    result = RunResult(
        rollout_id="r", attempt=0, reward=1.0, steps=50, tool_calls=49, answer="done"
    )
    played = Played.of(result, verification)
    assert played.verification() == verification
    assert len(played.verified) * 10 < len(json.dumps(verification))
