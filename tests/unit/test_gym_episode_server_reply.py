"""An environment server's `/run` reply fields that `rollout-collect` reports
(`rollout_gym.episode_server`, docs/gym.md, "Checkpointed at their protocol steps"): `steps`
counts the agent's tool calls, `answer` is the text of its last message. The client reading the
whole reply, under the operator: tests/e2e/test_gym07_environments.py."""

from __future__ import annotations

from typing import Any

from rollout_gym.episode_server import answer, tool_calls

AGENT_REPLY: dict[str, Any] = {
    "reward": 1.0,
    "response": {
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "let me look"}]},
            {"type": "function_call", "name": "get_weather", "arguments": '{"city": "sf"}'},
            {"type": "function_call_output", "output": '{"weather_description": "cold"}'},
            {
                "type": "message",
                "content": [
                    {"type": "output_text", "text": "It is "},
                    {"type": "refusal", "refusal": "x"},
                    {"type": "output_text", "text": "cold."},
                ],
            },
        ]
    },
}


def test_steps_count_the_agents_tool_calls_and_answer_is_its_last_message() -> None:
    assert tool_calls(AGENT_REPLY) == 1
    assert answer(AGENT_REPLY) == "It is cold."


def test_a_reply_without_a_response_has_no_steps_and_no_answer() -> None:
    for result in ({}, {"response": None}, {"response": {"output": "text"}}, {"reward": 0.0}):
        assert tool_calls(result) == 0
        assert answer(result) is None
