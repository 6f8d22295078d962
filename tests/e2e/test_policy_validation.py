"""The API server refuses each invalid checkpoint policy with a message that says why, and the
pydantic models refuse the same objects (what `kubectl apply` shows a user)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from rollout_operator.model import api
from testsupport import builders

from devcluster.cluster import Cluster
from harness.objects import apply_crds


def policy_set(policy: dict[str, Any], recovery: dict[str, Any] | None = None) -> dict[str, Any]:
    container = {
        "name": "server",
        "image": "unused.invalid/rollout",
        "command": ["sleep", "600"],
        "ports": [{"name": "control", "containerPort": 8000}],
    }
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.ROLLOUT_SET_KIND,
        "metadata": {"name": "refused"},
        "spec": {
            "participants": [{"role": "model", "template": {"spec": {"containers": [container]}}}],
            "storage": {"path": "/tmp/ckpt", "volume": {"hostPath": {"path": "/tmp/ckpt"}}},
            "checkpointPolicy": policy,
            "recovery": recovery or {},
        },
    }


def trainer_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    return builders.checkpoint_body(
        "refused", set_name="math-rl", namespace=None, **{"trigger": None, **spec}
    )


REFUSED: dict[str, tuple[dict[str, Any], type[BaseModel], list[str]]] = {
    "turn level that would never save": (
        policy_set({"onTrainerCheckpoint": False}),
        api.RolloutSet,
        [api.RULE_NEVER_SAVES.message],
    ),
    "interval at sibling level": (
        policy_set({"intervalSeconds": 60}, {"targetLevel": "sibling"}),
        api.RolloutSet,
        [api.RULE_SIBLING_INTERVAL.message],
    ),
    "interval of zero": (
        policy_set({"intervalSeconds": 0}),
        api.RolloutSet,
        ["intervalSeconds in body should be greater than or equal to 1"],
    ),
    "keepLatest of zero": (
        policy_set({"keepLatest": 0}),
        api.RolloutSet,
        ["keepLatest in body should be greater than or equal to 1"],
    ),
    "prepare timeout of zero": (
        policy_set({"prepareTimeoutSeconds": 0}),
        api.RolloutSet,
        ["prepareTimeoutSeconds in body should be greater than or equal to 1"],
    ),
    "unknown afterDeadline": (
        policy_set({"afterDeadline": "Stop"}),
        api.RolloutSet,
        ['Unsupported value: "Stop"', '"Suspend", "Continue"'],
    ),
    "mustSaveBy not a time": (
        policy_set({"mustSaveBy": "tomorrow"}),
        api.RolloutSet,
        ["mustSaveBy", "date-time"],
    ),
    "trainer checkpoint without its step": (
        trainer_checkpoint({"trigger": "TrainerCheckpoint"}),
        api.RolloutCheckpoint,
        [api.RULE_TRAINER_STEP.message],
    ),
    "unknown trigger": (
        trainer_checkpoint({"trigger": "Timer"}),
        api.RolloutCheckpoint,
        ['Unsupported value: "Timer"', '"Interval"', '"Eviction"'],
    ),
}


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Cluster:
    apply_crds(cluster)
    return cluster


def test_the_api_server_refuses_each_invalid_policy_saying_why(
    crds: Cluster, namespace: str
) -> None:
    problems: list[str] = []
    for case, (obj, model, expected) in REFUSED.items():
        result = crds.kubectl(
            "create", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False
        )
        if result.returncode == 0:
            problems.append(f"{case}: accepted by the API server")
            continue
        missing = [text for text in expected if text not in result.stderr]
        if missing:
            problems.append(f"{case}: {missing} not in {result.stderr!r}")
        with pytest.raises(ValidationError):
            model.model_validate(obj)
    assert not problems, "\n".join(problems)
