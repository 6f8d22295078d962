"""RolloutSets of fleet participants, for the fleet tests and `bench/fleet.py`.

A fleet set has the four roles, each pod annotated `devcluster.rollout.dev/fleet: participant`,
so the devcluster node agent serves it in process (the real control plane over a participant
with no episodes; see `devcluster.agent.fleet` and docs/devcluster.md). The container's command
is never run; it names what the pod stands for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from devcluster.agent.fleet import FLEET_ANNOTATION, PARTICIPANT

ROLES: Final = ("environment", "model", "agent", "resources")
CONTROL_PORT: Final = 8000


def fleet_template(role: str, *, grace_seconds: int = 2) -> dict[str, Any]:
    """A pod template served in process by the node agent."""
    return {
        "metadata": {"annotations": {FLEET_ANNOTATION: PARTICIPANT}},
        "spec": {
            "terminationGracePeriodSeconds": grace_seconds,
            "containers": [
                {
                    "name": role,
                    "image": "none",
                    "command": ["fleet-participant", role],
                    "ports": [{"name": "control", "containerPort": CONTROL_PORT}],
                }
            ],
        },
    }


def fleet_set(
    name: str,
    storage_dir: Path,
    *,
    replicas: int = 1,
    interval_seconds: int | None = None,
    prepare_timeout_seconds: int = 30,
    max_restarts: int = 100,
) -> dict[str, Any]:
    """A RolloutSet of `replicas` fleet participants per role, its records under `storage_dir`."""
    policy: dict[str, Any] = {
        "onTrainerCheckpoint": True,
        "keepLatest": 2,
        "prepareTimeoutSeconds": prepare_timeout_seconds,
    }
    if interval_seconds is not None:
        policy["intervalSeconds"] = interval_seconds
    return {
        "apiVersion": "checkpoint.rollout.dev/v1alpha1",
        "kind": "RolloutSet",
        "metadata": {"name": name},
        "spec": {
            "storage": {
                "path": str(storage_dir),
                "volume": {"hostPath": {"path": str(storage_dir), "type": "DirectoryOrCreate"}},
            },
            "checkpointPolicy": policy,
            "recovery": {
                "targetLevel": "turn",
                "restorePolicy": "Recreate",
                "maxRestarts": max_restarts,
                "restoreTimeoutSeconds": 120,
            },
            "participants": [
                {"role": role, "replicas": replicas, "template": fleet_template(role)}
                for role in ROLES
            ],
        },
    }


def fleet_checkpoint(name: str, set_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "checkpoint.rollout.dev/v1alpha1",
        "kind": "RolloutCheckpoint",
        "metadata": {"name": name},
        "spec": {"rolloutSet": set_name, "trigger": "Manual"},
    }
