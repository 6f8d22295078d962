"""The one place tests build RolloutSets and RolloutCheckpoints from: a manifest as `kubectl apply`
takes it (`set_body`, `checkpoint_body`) or the operator's model of it (`rollout_set`,
`rollout_checkpoint`), with a set's participants' pod templates (`participant`, `container`) and
a checkpoint's status as its flow leaves it (`checkpoint_status`, `condition`).

Each test says only what it is about (its roles and replicas, a status, a policy); everything
else is the same small valid set everywhere: one control port per container, storage on an
`emptyDir` at `/ckpt`. The end-to-end sets that run real servers start from `examples/` instead
(`harness/objects.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_operator.model import api

CONTROL_PORT = 8000
"""The control port of every container the builders make, unless a test names another."""


def container(
    name: str = "c", *, port: int = CONTROL_PORT, image: str | None = None
) -> dict[str, Any]:
    """A container with its control port named `control` (how the operator finds it)."""
    built: dict[str, Any] = {"name": name, "ports": [{"name": "control", "containerPort": port}]}
    if image is not None:
        built["image"] = image
    return built


def participant(
    role: str,
    replicas: int | None = 1,
    *,
    port: int = CONTROL_PORT,
    container_name: str = "c",
    image: str | None = None,
) -> dict[str, Any]:
    """One `spec.participants` entry (`replicas=None` leaves the API's default of one)."""
    entry: dict[str, Any] = {
        "role": role,
        "template": {"spec": {"containers": [container(container_name, port=port, image=image)]}},
    }
    if replicas is not None:
        entry["replicas"] = replicas
    return entry


def set_body(
    *,
    name: str = "rl",
    namespace: str = "ns",
    roles: Mapping[str, int | None] | None = None,
    participants: list[dict[str, Any]] | None = None,
    storage: str | Path = "/ckpt",
    volume: Mapping[str, Any] | None = None,
    bucket: Mapping[str, Any] | None = None,
    uid: str | None = "u",
    generation: int | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    status: Mapping[str, Any] | None = None,
    port: int = CONTROL_PORT,
    **spec: Any,
) -> dict[str, Any]:
    """A RolloutSet manifest: `roles` maps each role to its replicas (default one model), or
    `participants` gives the entries whole; `spec` adds or replaces top-level spec fields by
    their API names (`progressDeadlineSeconds=60`, `standby={...}`); `bucket` makes the storage
    an S3-API bucket (`spec.storage.s3`) instead of the volume."""
    if participants is None:
        participants = [
            participant(role, replicas, port=port)
            for role, replicas in (roles or {"model": 1}).items()
        ]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        metadata["uid"] = uid
    if generation is not None:
        metadata["generation"] = generation
    if labels is not None:
        metadata["labels"] = dict(labels)
    if annotations is not None:
        metadata["annotations"] = dict(annotations)
    body: dict[str, Any] = {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": metadata,
        "spec": {
            "participants": participants,
            "storage": {
                "path": str(storage),
                "volume": dict(volume) if volume is not None else {"emptyDir": {}},
            }
            if bucket is None
            else {"s3": dict(bucket)},
            **spec,
        },
    }
    if status is not None:
        body["status"] = dict(status)
    return body


def rollout_set(**fields: Any) -> api.RolloutSet:
    """`set_body(**fields)` as the operator's model (validated as the API server's schema
    would)."""
    return api.RolloutSet.model_validate(set_body(**fields))


def condition(
    type_: str, status: bool, reason: str, at: str, message: str | None = None
) -> dict[str, Any]:
    """One `metav1.Condition` as the API server stores it (`at`: its lastTransitionTime)."""
    built: dict[str, Any] = {
        "type": type_,
        "status": "True" if status else "False",
        "reason": reason,
        "lastTransitionTime": at,
    }
    if message is not None:
        built["message"] = message
    return built


def checkpoint_status(
    phase: str,
    *,
    at: str,
    completed: str | None = None,
    type_: str = "Ready",
    holds: bool | None = None,
    reason: str = "Published",
    **fields: Any,
) -> dict[str, Any]:
    """A checkpoint's `status` in `phase` with one condition `type_` that changed `at` (true when
    `holds`; by default a Ready condition holds from phase Resuming on, any other one holds),
    `completedAt` when given, and `fields` by their API names (`attempt=2`)."""
    if holds is None:
        holds = phase in ("Ready", "Resuming") if type_ == "Ready" else True
    status: dict[str, Any] = {"phase": phase}
    if completed is not None:
        status["completedAt"] = completed
    status["conditions"] = [condition(type_, holds, reason, at)]
    status.update(fields)
    return status


def checkpoint_body(
    name: str = "ck",
    *,
    set_name: str = "rl",
    namespace: str | None = "ns",
    trigger: str | None = "Manual",
    created: str | None = None,
    deleted: str | None = None,
    generation: int | None = None,
    labels: Mapping[str, str] | None = None,
    finalizers: Sequence[str] | None = None,
    status: Mapping[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A RolloutCheckpoint manifest of the set `set_name`; `spec` adds spec fields by their API
    names (`trainerStep=1`). `created` and `deleted` are the creation and deletion timestamps
    of an object as the API server stores it; a None leaves its field out (`namespace=None`
    for a manifest `kubectl create -n` places, `trigger=None` for the API's default)."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    if generation is not None:
        metadata["generation"] = generation
    if created is not None:
        metadata["creationTimestamp"] = created
    if deleted is not None:
        metadata["deletionTimestamp"] = deleted
    if labels is not None:
        metadata["labels"] = dict(labels)
    if finalizers is not None:
        metadata["finalizers"] = list(finalizers)
    body: dict[str, Any] = {
        "apiVersion": api.API_VERSION,
        "kind": api.ROLLOUT_CHECKPOINT_KIND,
        "metadata": metadata,
        "spec": {"rolloutSet": set_name, **({"trigger": trigger} if trigger else {}), **spec},
    }
    if status is not None:
        body["status"] = dict(status)
    return body


def rollout_checkpoint(**fields: Any) -> api.RolloutCheckpoint:
    """`checkpoint_body(**fields)` as the operator's model."""
    return api.RolloutCheckpoint.model_validate(checkpoint_body(**fields))
