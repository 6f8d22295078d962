"""How the demo and the benchmark count work done twice across a recovery."""

from __future__ import annotations

from typing import Any

import httpx
from rollout_protocol import Record
from rollout_servers.client import EpisodeResult

from harness.measures import StatsTracker, generation_prefixes, measure_redone, started_under


def steps(attempt: int, **completed: int) -> dict[str, Any]:
    return {str(attempt): {name: {"completed": n, "started": n} for name, n in completed.items()}}


def tracker(pods: dict[str, tuple[str, dict[str, Any]]]) -> StatsTracker:
    tracked = StatsTracker(httpx.AsyncClient(), token="not-read-by-these-tests")
    for pod, (role, reply) in pods.items():
        tracked.addresses[pod] = (role, f"http://{pod}")
        tracked.last[pod] = reply
    return tracked


def result(rollout_id: str, attempt: int, continued_from: int | None) -> EpisodeResult:
    return EpisodeResult(
        rollout_id=rollout_id,
        attempt=attempt,
        answer=1,
        reward=1.0,
        steps=3,
        continued=continued_from is not None,
        continued_from=continued_from,
    )


def test_only_repeated_step_names_and_unkept_tokens_count() -> None:
    # "cont" continued from a checkpoint at model@1 (cut after 4 tokens): under attempt 1 it
    # finished model@1 (10 tokens) and tool@1 after the checkpoint, then died; attempt 2 redid
    # them. "fresh" had never started when the pod died. "done" finished under attempt 1.
    env_a1 = {
        "rollouts": {
            "cont": steps(1, run=1, seed=1),
            "done": steps(1, run=1, seed=1, invoke_agent=1, verify=1),
        }
    }
    env_a2 = {"rollouts": {"cont": steps(2, invoke_agent=1, verify=1), "fresh": steps(2, seed=1)}}
    agent_a1 = {
        "rollouts": {"cont": steps(1, **{"model@0": 1, "tool@0": 1, "model@1": 1, "tool@1": 1})}
    }
    agent_a2 = {"rollouts": {"cont": steps(2, **{"model@1": 1, "tool@1": 1, "model@2": 1})}}
    model_a1 = {"tokens": {"1": {"by_request": {"cont/0": 12, "cont/1": 10}}}}
    model_a2 = {"tokens": {"2": {"by_request": {"cont/1": 6, "cont/2": 9, "fresh/0": 11}}}}
    tracked = tracker(
        {
            "env-a1": ("environment", env_a1),
            "env-a2": ("environment", env_a2),
            "agent-a1": ("agent", agent_a1),
            "agent-a2": ("agent", agent_a2),
            "model-a1": ("model", model_a1),
            "model-a2": ("model", model_a2),
        }
    )
    results = [result("cont", 2, 1), result("fresh", 2, None), result("done", 1, None)]
    assert started_under(tracked, 1) == {"cont", "done"}
    redone = measure_redone(tracked, results, 1, {"cont/1": 4})
    assert redone.rerun == 1
    assert redone.steps == 2  # model@1 and tool@1; nothing before the checkpoint
    assert redone.by_step == {"model": 1, "tool": 1}
    assert redone.tokens == 10 - 4  # cont/0 was not generated again; fresh never ran before


def test_a_model_call_answered_from_the_checkpoints_record_is_not_redone() -> None:
    # The response of model@1 was held by the checkpoint; after the loss the agent asked
    # again and the model answered from its record without generating a token.
    agent_a1 = {"rollouts": {"held": steps(1, **{"model@0": 1, "tool@0": 1, "model@1": 1})}}
    agent_a2 = {"rollouts": {"held": steps(2, **{"model@1": 1})}}
    env_a1 = {"rollouts": {"held": steps(1, run=1, seed=1)}}
    tracked = tracker(
        {
            "env-a1": ("environment", env_a1),
            "agent-a1": ("agent", agent_a1),
            "agent-a2": ("agent", agent_a2),
            "model-a1": ("model", {"tokens": {"1": {"by_request": {"held/1": 8}}}}),
            "model-a2": ("model", {"tokens": {}}),
        }
    )
    redone = measure_redone(tracked, [result("held", 2, 1)], 1, {"held/1": 8})
    assert (redone.steps, redone.tokens) == (0, 0)


def test_generation_prefixes_keep_cuts_and_delivered_responses() -> None:
    records = {
        "model-0": [
            Record(
                kind="generation",
                rollout_id="a",
                attempt=1,
                key="2",
                data={"step": "generate", "state": {"text": "x y", "tokens": 2}},
            ),
            Record(
                kind="delivered",
                rollout_id="b",
                attempt=1,
                key="0",
                data={"digest": "d", "text": "t", "finish_reason": "stop", "tokens": 7},
            ),
        ],
        "agent-0": [
            Record(kind="session", rollout_id="a", attempt=1, data={"state": {"tokens": 99}})
        ],
    }
    assert generation_prefixes(records) == {"a/2": 2, "b/0": 7}
