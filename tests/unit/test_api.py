"""The API models refuse what the CRD's CEL rules refuse, with the same messages."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_operator.model import api
from rollout_protocol import Role


def container(port_name: str = "control") -> dict[str, Any]:
    return {
        "name": "server",
        "image": "rollout:dev",
        "command": ["rollout-server"],
        "ports": [{"name": port_name, "containerPort": 8000}],
    }


def spec(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "participants": [
            {"role": "model", "replicas": 1, "template": {"spec": {"containers": [container()]}}},
            {
                "role": "environment",
                "replicas": 2,
                "template": {"spec": {"containers": [container()]}},
            },
        ],
        "storage": {"path": "/checkpoints", "volume": {"hostPath": {"path": "/checkpoints"}}},
    }
    body.update(overrides)
    return body


def refusal(model: type[api.BaseModel], body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return str(caught.value)


def test_minimal_spec_gets_the_documented_defaults() -> None:
    parsed = api.RolloutSetSpec.model_validate(spec())
    assert parsed.checkpoint_policy.on_trainer_checkpoint is True
    assert parsed.checkpoint_policy.keep_latest == 2
    assert parsed.checkpoint_policy.after_deadline is api.AfterDeadline.SUSPEND
    assert parsed.checkpoint_policy.prepare_timeout_seconds == 300
    assert parsed.recovery.target_level is api.TargetLevel.TURN
    assert parsed.recovery.restore_policy is api.RestorePolicy.RECREATE
    assert parsed.suspend is False
    assert parsed.participant(Role.ENVIRONMENT) is not None
    assert parsed.participant(Role.AGENT) is None


def test_pod_template_fields_we_do_not_model_pass_through() -> None:
    body = spec()
    body["participants"][0]["template"]["spec"]["nodeSelector"] = {"gpu": "yes"}
    parsed = api.RolloutSetSpec.model_validate(body)
    dumped = api.dump(parsed.participants[0].template)
    assert dumped["spec"]["nodeSelector"] == {"gpu": "yes"}
    assert dumped["spec"]["containers"][0]["image"] == "rollout:dev"
    assert dumped["spec"]["containers"][0]["ports"] == [{"name": "control", "containerPort": 8000}]


def test_unknown_role_is_refused() -> None:
    body = spec()
    body["participants"][0]["role"] = "critic"
    assert "environment" in refusal(api.RolloutSetSpec, body)


def test_zero_replicas_is_refused() -> None:
    body = spec()
    body["participants"][0]["replicas"] = 0
    assert "greater than or equal to 1" in refusal(api.RolloutSetSpec, body)


def test_duplicate_roles_are_refused_with_the_cel_message() -> None:
    body = spec()
    body["participants"][1]["role"] = "model"
    assert api.RULE_UNIQUE_ROLES.message in refusal(api.RolloutSetSpec, body)


def test_keep_latest_zero_is_refused() -> None:
    body = spec(checkpointPolicy={"keepLatest": 0})
    assert "greater than or equal to 1" in refusal(api.RolloutSetSpec, body)


def test_turn_level_that_would_never_save_is_refused() -> None:
    body = spec(checkpointPolicy={"onTrainerCheckpoint": False})
    message = refusal(api.RolloutSetSpec, body)
    assert "would never save" in message
    assert api.RULE_NEVER_SAVES.message in message


def test_both_restore_policies_are_accepted() -> None:
    for policy in ("InPlace", "Recreate"):
        parsed = api.RolloutSetSpec.model_validate(spec(recovery={"restorePolicy": policy}))
        assert parsed.recovery.restore_policy.value == policy
    assert "restorePolicy" in refusal(api.RolloutSetSpec, spec(recovery={"restorePolicy": "Keep"}))


@pytest.mark.parametrize(
    "overrides",
    [
        {"checkpointPolicy": {"onTrainerCheckpoint": False, "intervalSeconds": 300}},
        {"checkpointPolicy": {"onTrainerCheckpoint": False, "mustSaveBy": "2030-01-01T00:00:00Z"}},
        {"checkpointPolicy": {"onTrainerCheckpoint": True}},
        {
            "checkpointPolicy": {"onTrainerCheckpoint": False},
            "recovery": {"targetLevel": "sibling"},
        },
    ],
    ids=["interval", "deadline-only", "trainer-checkpoints", "sibling"],
)
def test_policies_that_save_something_are_accepted(overrides: dict[str, Any]) -> None:
    """The seed's table: each of these saves at some point (or needs no environment state)."""
    api.RolloutSetSpec.model_validate(spec(**overrides))


def test_interval_must_be_positive() -> None:
    body = spec(checkpointPolicy={"intervalSeconds": 0})
    assert "intervalSeconds" in refusal(api.RolloutSetSpec, body)


def test_template_without_a_control_port_is_refused() -> None:
    body = spec()
    body["participants"][0]["template"]["spec"]["containers"] = [container("http")]
    assert api.RULE_CONTROL_PORT.message in refusal(api.RolloutSetSpec, body)


def test_control_port_may_be_on_any_container() -> None:
    body = spec()
    sidecar = {"name": "sidecar", "image": "x"}
    body["participants"][0]["template"]["spec"]["containers"].insert(0, sidecar)
    api.RolloutSetSpec.model_validate(body)


@pytest.mark.parametrize("policy", ["Always", "OnFailure"])
def test_restart_policy_other_than_never_is_refused(policy: str) -> None:
    body = spec()
    body["participants"][0]["template"]["spec"]["restartPolicy"] = policy
    assert api.RULE_RESTART_NEVER.message in refusal(api.RolloutSetSpec, body)


@pytest.mark.parametrize("path", ["/a/../b", "/a/./b", "/a//b", "/..", "relative"])
def test_unclean_storage_paths_are_refused(path: str) -> None:
    body = spec(storage={"path": path, "volume": {"emptyDir": {}}})
    refusal(api.RolloutSetSpec, body)


def test_storage_needs_a_volume_source() -> None:
    body = spec(storage={"path": "/ckpt", "volume": {}})
    assert "volume" in refusal(api.RolloutSetSpec, body)


def test_unknown_spec_fields_are_refused() -> None:
    body = spec(checkpointPolicy={"keeplatest": 3})
    assert "keeplatest" in refusal(api.RolloutSetSpec, body)


def test_must_save_by_is_a_timestamp() -> None:
    body = spec(checkpointPolicy={"mustSaveBy": "tomorrow"})
    assert "mustSaveBy" in refusal(api.RolloutSetSpec, body)


def rollout_set(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": "u1"}, "spec": spec()}


@pytest.mark.parametrize("name", ["a" * 51, "9lives", "has_underscore", "Upper"])
def test_set_names_that_cannot_prefix_pods_and_services_are_refused(name: str) -> None:
    assert api.RULE_SET_NAME.message in refusal(api.RolloutSet, rollout_set(name))


def test_a_set_name_of_50_characters_is_accepted() -> None:
    parsed = api.RolloutSet.model_validate(rollout_set("a" * 50))
    assert parsed.status.attempt is None
    assert parsed.status.participants == []


def test_status_ignores_fields_it_does_not_know() -> None:
    """An older operator reading a newer status must not fail."""
    status = api.RolloutSetStatus.model_validate({"attempt": 2, "futureField": {"x": 1}})
    assert status.attempt == 2


def test_status_times_serialise_as_metav1_time() -> None:
    status = api.RolloutSetStatus.model_validate(
        {
            "recovery": {
                "phase": "StartingPods",
                "fromAttempt": 1,
                "targetAttempt": 2,
                "startedAt": "2026-11-29T12:00:00.123456+00:00",
            }
        }
    )
    wire = api.dump(status)
    assert wire["recovery"]["startedAt"] == "2026-11-29T12:00:00Z"
    assert wire["recovery"]["targetAttempt"] == 2


# --- RolloutCheckpoint ---------------------------------------------------------------------------


def test_checkpoint_spec_defaults_to_a_manual_checkpoint() -> None:
    parsed = api.RolloutCheckpointSpec.model_validate({"rolloutSet": "math-rl"})
    assert parsed.trigger is api.Trigger.MANUAL
    assert parsed.episodes is None


def test_trainer_checkpoint_trigger_needs_a_step() -> None:
    body = {"rolloutSet": "math-rl", "trigger": "TrainerCheckpoint"}
    assert api.RULE_TRAINER_STEP.message in refusal(api.RolloutCheckpointSpec, body)
    api.RolloutCheckpointSpec.model_validate({**body, "trainerStep": 120})


def test_unknown_trigger_is_refused() -> None:
    body = {"rolloutSet": "math-rl", "trigger": "Cron"}
    assert "Manual" in refusal(api.RolloutCheckpointSpec, body)


def test_episode_ids_follow_the_protocol_pattern() -> None:
    body = {"rolloutSet": "math-rl", "episodes": ["ok-1", "../etc"]}
    assert "episodes" in refusal(api.RolloutCheckpointSpec, body)


def test_checkpoint_names_longer_than_a_checkpoint_id_are_refused() -> None:
    body = {"metadata": {"name": "c" * 129}, "spec": {"rolloutSet": "math-rl"}}
    assert api.RULE_CHECKPOINT_NAME.message in refusal(api.RolloutCheckpoint, body)
    ok = copy.deepcopy(body)
    ok["metadata"]["name"] = "c" * 128
    api.RolloutCheckpoint.model_validate(ok)


def test_checkpoint_status_round_trips_in_wire_form() -> None:
    wire = {
        "phase": "Ready",
        "attempt": 3,
        "episodes": 812,
        "restarts": 4,
        "blockers": [],
        "participants": [
            {
                "instance": "model-0",
                "manifest": "math-rl/ckpt/model-0/manifest.json",
                "recordsSha256": "a" * 64,
                "recordCount": 10,
                "bytes": 2048,
            }
        ],
        "durations": {"prepareSeconds": 0.25, "pauseSeconds": 0.5},
    }
    parsed = api.RolloutCheckpointStatus.model_validate(wire)
    assert parsed.phase is api.CheckpointPhase.READY
    assert api.dump(parsed)["participants"] == wire["participants"]
    assert api.dump(parsed)["durations"] == {"prepareSeconds": 0.25, "pauseSeconds": 0.5}
