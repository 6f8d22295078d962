"""A set and one of its checkpoints on the unit tests' fake API server (`fakecluster`), for
the unit tests of the checkpoint flow (tests/unit/test_checkpoint_eviction.py and
test_checkpoint_slots.py): `set_cluster` (the set `math` of one model participant, its pods, its
token Secret and the checkpoint `CKPT`), `mark_ready`, `evicted_pod`, the checkpoint's status
and conditions, `kept_to_its_own` (the flow touched only its own objects), and `NotParking`, a
participant that journals each prepare's deadline and never parks; `served_participant`, the
set's model participant as a real control plane served on loopback."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from rollout_operator.decide.resources import TOKEN_KEY, secret_name
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL
from rollout_protocol import (
    ControlPlane,
    ControlSettings,
    EpisodeId,
    Phase,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
)
from rollout_protocol.conformance import serve_app

from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.participants import FakeParticipant

NS = "team"
SET = "math"
CKPT = "math-evict-a3"
PREPARE_TIMEOUT = 300
TOKEN = "token"
"""The set's control token in `set_cluster`'s Secret."""


def whole_seconds(ts: float) -> datetime:
    return datetime.fromtimestamp(int(ts), UTC)


def set_cluster(trigger: str, pods: list[dict[str, Any]]) -> FakeCluster:
    """An API server holding the set, its pods, its token Secret and one checkpoint."""
    cluster = FakeCluster()
    cluster.put(
        {
            "apiVersion": api.API_VERSION,
            "kind": "RolloutSet",
            "metadata": {"name": SET, "namespace": NS, "uid": "u", "generation": 1},
            "spec": {
                "participants": [
                    {
                        "role": "model",
                        "template": {
                            "spec": {
                                "containers": [
                                    {
                                        "name": "c",
                                        "ports": [{"name": "control", "containerPort": 8000}],
                                    }
                                ]
                            }
                        },
                    }
                ],
                "storage": {"path": "/ckpt", "volume": {"hostPath": {"path": "/ckpt"}}},
                "checkpointPolicy": {"prepareTimeoutSeconds": PREPARE_TIMEOUT},
            },
            "status": {
                "attempt": 3,
                "participants": [
                    {
                        "role": "model",
                        "index": 0,
                        "pod": "math-model-0-a3",
                        "ready": False,
                        "address": "http://10.0.0.1:8000",
                    }
                ],
            },
        }
    )
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret_name(SET), "namespace": NS},
            "data": {TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
        }
    )
    for pod in pods:
        cluster.put(pod)
    cluster.put(
        builders.checkpoint_body(
            CKPT, set_name=SET, namespace=NS, generation=1, trigger=trigger, status={}
        )
    )
    return cluster


def checkpoint_status(cluster: FakeCluster) -> dict[str, Any]:
    ckpt = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT)
    assert ckpt is not None, f"checkpoint {CKPT} is gone"
    status: dict[str, Any] = ckpt.get("status") or {}
    return status


def condition(cluster: FakeCluster, type_: str) -> dict[str, Any]:
    conditions = checkpoint_status(cluster)["conditions"]
    found: dict[str, Any] = next(c for c in conditions if c["type"] == type_)
    return found


def mark_ready(cluster: FakeCluster) -> None:
    """The set and its participant Ready, as the reconciler writes them."""

    def ready(obj: dict[str, Any]) -> None:
        obj["status"]["participants"][0]["ready"] = True
        obj["status"]["conditions"] = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllParticipantsReady",
                "lastTransitionTime": api.format_time(datetime.now(UTC)),
            }
        ]

    cluster.update(ROLLOUT_SET_PLURAL, NS, SET, ready)


def kept_to_its_own(cluster: FakeCluster) -> None:
    """The flow read only the set's token Secret and wrote only its own checkpoint's status."""
    assert {r.name for r in cluster.requests if r.plural == "secrets"} <= {secret_name(SET)}
    written = {
        r.name
        for r in cluster.requests
        if r.plural == ROLLOUT_CHECKPOINT_PLURAL and r.verb != "get"
    }
    assert written <= {CKPT}


class NotParking:
    """A model participant with one episode that never parks; journals prepare deadlines."""

    role = Role.MODEL
    instance = "model-0"

    def __init__(self) -> None:
        self.prepare_deadlines: list[float] = []
        self.resumed = 0

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self.prepare_deadlines.append(request.deadline_ts)
        return PrepareReply(
            checkpoint_id=request.checkpoint_id,
            phase=Phase.PREPARING,
            ready=False,
            blockers=[EpisodeId(rollout_id="r1", attempt=3)],
            blocker_count=1,
        )

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self.resumed += 1
        return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def aclose(self) -> None:
        pass


def evicted_pod(killed_at: datetime, grace: int = 30) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "math-model-0-a3",
            "namespace": NS,
            "labels": {api.LABEL_SET: SET, api.LABEL_ATTEMPT: "3"},
            "deletionTimestamp": api.format_time(killed_at),
            "deletionGracePeriodSeconds": grace,
        },
        "status": {"phase": "Running"},
    }


@asynccontextmanager
async def served_participant(root: Path) -> AsyncIterator[tuple[FakeParticipant, str]]:
    """The set's model participant (attempt 3, one episode) as a real control plane over a
    `FakeParticipant`, served on loopback, its records under `root`; yields it and its URL."""
    fake = FakeParticipant(Role.MODEL, rollouts=["r1"], attempt=3)
    plane = ControlPlane(
        fake,
        ControlSettings(
            role=Role.MODEL, set_name=SET, checkpoint_root=root, token=TOKEN, attempt=3
        ),
    )
    app = FastAPI()
    plane.install(app)
    async with serve_app(app, role=Role.MODEL, token=TOKEN) as served:
        yield fake, served.target.base_url
