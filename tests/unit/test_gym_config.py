"""A Gym server instance picked out of Gym's YAML (`rollout_gym.gym_config`, docs/gym.md,
"Servers from Gym's YAML"), and the sessions of nemo-gym 0.7's `single_agent_turn` named by the
capture key (`rollout_gym.turn_steps`).

Pure functions on the merged config as `gym_config.load` returns it (the files' reading needs
nemo-gym's omegaconf, which the project's venv does not have; the protocol tests host servers
from the released YAML files themselves, tests/protocol/test_gym_environment_servers.py).
"""

from __future__ import annotations

import pytest
from rollout_gym.gym_config import GymConfigError, peer_config, server_spec
from rollout_gym.turn_steps import capture_key, session_ids, task_parts

WEATHER = {
    # environments/example_single_tool_call/config.yaml, its config_paths followed, as merged
    "example_single_tool_call": {
        "resources_servers": {"example_single_tool_call": {"entrypoint": "app.py"}}
    },
    "example_single_tool_call_simple_agent": {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "resources_server": {
                    "type": "resources_servers",
                    "name": "example_single_tool_call",
                },
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
                "datasets": [{"name": "example", "type": "example"}],
            }
        }
    },
    "example_single_tool_call_environment_server": {
        "environment_servers": {
            "legacy_agent": {
                "entrypoint": "app.py",
                "agent_server": {
                    "type": "responses_api_agents",
                    "name": "example_single_tool_call_simple_agent",
                },
            }
        }
    },
}


def test_an_instance_is_its_yaml_block_and_names_its_module() -> None:
    spec = server_spec(WEATHER, "example_single_tool_call_environment_server")
    assert spec.server_type == "environment_servers"
    assert spec.implementation == "legacy_agent"
    assert spec.module == "environment_servers.legacy_agent.app"
    assert spec.references() == {"example_single_tool_call_simple_agent": "responses_api_agents"}


def test_each_named_server_is_reached_at_its_roles_peer() -> None:
    """Gym's global config for the agent: the resources server and the model it names, at the
    pod's resources and model peers (three levels, as Gym's `ServerClient` reads them)."""
    spec = server_spec(WEATHER, "example_single_tool_call_simple_agent")
    peers = {"resources": "http://10.0.0.7:8000", "model": "http://10.0.0.9:8001"}
    assert peer_config(spec, peers) == {
        "example_single_tool_call": {
            "resources_servers": {"rollout_peer": {"host": "10.0.0.7", "port": 8000}}
        },
        "policy_model": {
            "responses_api_models": {"rollout_peer": {"host": "10.0.0.9", "port": 8001}}
        },
    }


def test_a_named_server_without_a_peer_is_refused_with_the_role_to_add() -> None:
    spec = server_spec(WEATHER, "example_single_tool_call_environment_server")
    with pytest.raises(GymConfigError) as refused:
        peer_config(spec, {"model": "http://10.0.0.9:8001"})
    message = str(refused.value)
    assert "example_single_tool_call_simple_agent (responses_api_agents)" in message, message
    assert "ROLLOUT_PEER_AGENT_URL" in message, message


def test_an_unknown_instance_is_refused_naming_the_ones_there() -> None:
    with pytest.raises(GymConfigError) as refused:
        server_spec(WEATHER, "weather")
    assert "no server instance 'weather'" in str(refused.value)
    assert "example_single_tool_call_environment_server" in str(refused.value)


def test_sessions_are_named_by_the_capture_key_of_their_attempt() -> None:
    """nemo-gym 0.7's capture key (the rollout id at attempt 0, `-a<N>` after): a restarted
    episode can name, and close, the sessions its earlier attempts opened."""
    assert capture_key("r1", 0) == "r1"
    assert capture_key("r1", 2) == "r1-a2"
    assert session_ids("r1", 0) == {"resources": "r1.resources", "agent": "r1.agent"}
    assert session_ids("r1", 1) == {"resources": "r1-a1.resources", "agent": "r1-a1.agent"}


def test_a_row_becomes_the_protocols_task() -> None:
    """A flat row: the request and the rest as `task_data` (as 0.7's
    `SingleAgentTurnTaskInput` takes one); a materialized row keeps its own task id."""
    flat = {"responses_create_params": {"input": "hi"}, "expected": 3}
    assert task_parts(flat, "weather", "r1") == {
        "task_id": {"taskset": "weather", "task_id": "r1"},
        "params": {"input": "hi"},
        "task_data": {"expected": 3},
    }
    materialized = {
        "task_id": {"taskset": "env:train", "task_id": "t7"},
        "task_input": {"responses_create_params": {"input": "hi"}, "task_data": {"x": 1}},
    }
    assert task_parts(materialized, "weather", "r1") == {
        "task_id": {"taskset": "env:train", "task_id": "t7"},
        "params": {"input": "hi"},
        "task_data": {"x": 1},
    }
