"""The Gym adapter's `tool` step on arguments a model wrote (`rollout_gym.environment`,
docs/gym.md): as Gym's `simple_agent`, arguments that are not JSON are fed back to the model as
the call's output and no call is made, and so are arguments nested past the JSON parser's
depth, which must end neither the step nor the episode with a `RecursionError`.

No Gym server: the step returns before it would call one, which the test checks by pointing
the adapter at a resources address nothing listens on.
"""

from __future__ import annotations

import json

import pytest
from rollout_gym._peers import make_client
from rollout_gym.environment import GymEpisodes, GymSettings
from rollout_protocol import Boundary, EpisodeRuntime


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("arguments", ["{not json", DEEP], ids=["not-json", "nested-100000-deep"])
async def test_arguments_the_parser_cannot_read_are_fed_back_without_a_call(
    arguments: str,
) -> None:
    settings = GymSettings(model_url="http://127.0.0.1:9", resources_url="http://127.0.0.1:9")
    runtime = EpisodeRuntime()
    async with make_client(settings.step_timeout_s) as http:
        episodes = GymEpisodes(settings, runtime, http)
        call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": arguments}
        state = {
            "task": {},
            "turn": 1,
            "tools": 0,
            "outputs": [],
            "pending": [call],
            "session": {"cookies": {}, "calls": [], "instance": None},
        }
        episode = runtime.begin("r1", 0, Boundary("tool", state))
        after = await episodes.tool(episode)
    assert after.step == "model"
    assert after.state["session"]["calls"] == [], "no call was made"
    fed_back = after.state["outputs"][-1]
    assert fed_back["type"] == "function_call_output"
    assert fed_back["call_id"] == "c1"
    assert json.loads(fed_back["output"])["error"].startswith("Invalid tool call arguments:")
