"""Helpers for the checkpoint-policy end-to-end tests (tests/e2e/test_policy_*.py).

`counter_set` is a RolloutSet of one environment participant running `policy_participant.py`
(the real control plane over counters, with a park delay and a gate the test controls through
files). The policy is what these tests are about, and a participant whose checkpoint cost the
test sets is what lets them show a deadline landing in time as checkpoints get slower; the
reference servers are used where episodes matter (eviction, suspend).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as k8s
from rollout_operator.model import api
from testsupport import builders
from testsupport.operator_fixtures import Resources, condition

from devcluster.waiting import wait_for

PARTICIPANT = Path(__file__).resolve().parent / "policy_participant.py"
WAIT = 60.0
"""Budget of one wait; generous for a loaded two-core machine, never reached when all is well."""


def counter_set(
    name: str,
    storage: Path,
    control: Path,
    *,
    policy: Mapping[str, Any] | None = None,
    recovery: Mapping[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    storage_path = str(storage)
    container = {
        "name": "counter",
        "image": "rollout-checkpoint-operator:dev",
        "command": [sys.executable, str(PARTICIPANT), "--control-dir", str(control)],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.ROLLOUT_SET_KIND,
        "metadata": {"name": name},
        "spec": {
            "participants": [
                {"role": "environment", "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {
                "path": storage_path,
                "volume": {"hostPath": {"path": storage_path, "type": "DirectoryOrCreate"}},
            },
            "checkpointPolicy": dict(policy or {}),
            "recovery": dict(recovery or {}),
            **spec,
        },
    }


def manual_checkpoint(name: str, set_name: str) -> dict[str, Any]:
    return builders.checkpoint_body(name, set_name=set_name, namespace=None, trigger=None)


def rfc3339(when: datetime) -> str:
    return api.format_time(when)


def in_seconds(seconds: float) -> str:
    """A mustSaveBy this far ahead (whole seconds, as the API stores it)."""
    return rfc3339(datetime.now(UTC) + timedelta(seconds=seconds))


def when(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def checkpoints_of(resources: Resources, set_name: str) -> list[dict[str, Any]]:
    listed = await resources.custom.list_namespaced_custom_object(
        api.GROUP, api.VERSION, resources.namespace, api.ROLLOUT_CHECKPOINT_PLURAL
    )
    return sorted(
        (c for c in listed["items"] if c["spec"]["rolloutSet"] == set_name),
        key=lambda c: (c["metadata"]["creationTimestamp"], c["metadata"]["name"]),
    )


def is_ready_checkpoint(obj: Mapping[str, Any]) -> bool:
    status = obj.get("status") or {}
    return status.get("phase") == "Ready"


async def wait_ready(resources: Resources, name: str, limit_s: float = WAIT) -> dict[str, Any]:
    def ended(obj: dict[str, Any]) -> bool:
        phase = (obj.get("status") or {}).get("phase")
        assert phase != "Failed", f"checkpoint {name} failed: {obj.get('status')}"
        return phase == "Ready"

    return await resources.wait_checkpoint(name, "Ready", ended, limit_s)


async def create_checkpoint(resources: Resources, body: dict[str, Any]) -> None:
    await resources.custom.create_namespaced_custom_object(
        api.GROUP, api.VERSION, resources.namespace, api.ROLLOUT_CHECKPOINT_PLURAL, body
    )


async def patch_set(resources: Resources, name: str, body: dict[str, Any]) -> None:
    await resources.custom.patch_namespaced_custom_object(
        api.GROUP,
        api.VERSION,
        resources.namespace,
        api.ROLLOUT_SET_PLURAL,
        name,
        body,
        _content_type="application/merge-patch+json",
    )


async def wait_condition(
    resources: Resources,
    set_name: str,
    type_: str,
    *,
    reason: str | None = None,
    status: str | None = None,
    limit_s: float = WAIT,
) -> dict[str, Any]:
    """Wait until the set shows condition `type_` (with this reason/status); return it."""

    def shown(obj: dict[str, Any]) -> bool:
        found = condition(obj, type_)
        return (
            found is not None
            and (reason is None or found.get("reason") == reason)
            and (status is None or found.get("status") == status)
        )

    obj = await resources.wait_set(
        f"condition {type_} reason={reason} status={status}", shown, limit_s, name=set_name
    )
    found = condition(obj, type_)
    assert found is not None
    return found


async def wait_event(
    resources: Resources, object_name: str, reason: str, limit_s: float = WAIT
) -> dict[str, Any]:
    """A Kubernetes Event about `object_name` with `reason` (what `kubectl describe` shows)."""
    core = k8s.CoreV1Api(resources.custom.api_client)

    async def found() -> dict[str, Any] | None:
        events = await core.list_namespaced_event(
            resources.namespace, field_selector=f"involvedObject.name={object_name}"
        )
        for event in events.items:
            if event.reason == reason:
                return {"reason": event.reason, "message": event.message, "type": event.type}
        return None

    return await wait_for(found, limit_s, f"event {reason} on {object_name}", interval=0.2)
