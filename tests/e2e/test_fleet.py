"""The fleet harness (devcluster's in-process participants) under the real operator.

Fleet pods are served by the node agent in its own process (`devcluster.agent.fleet`): the real
control plane over a participant with no episodes. These tests check that the double is what
the scale bench (`bench/fleet.py`) relies on:

- two fleet sets come Ready under the operator, with no process of their own per pod;
- their participants are real control planes on their own pod IPs: `/checkpoint/v1/status`
  answers with the set, role, instance and attempt, refuses a missing token with the
  protocol's error body, and refuses a malformed request the way the SDK's routes do;
- both sets checkpoint at once: the checkpoints turn Ready and every instance's manifest is
  on storage;
- a SIGKILLed fleet pod reads as exit code 137, and the set is recovered under attempt 2 from
  its checkpoint; the fresh participants report attempt 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_protocol import API_PREFIX, checkpoint_base, read_manifest, set_storage_dir
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    is_true,
    kubectl_apply,
)

from devcluster.cluster import Cluster
from devcluster.testing import terminated_state, wait_for
from harness.fleet import ROLES, fleet_checkpoint, fleet_set

pytestmark = pytest.mark.e2e

SETS = ("fleet-a", "fleet-b")
REPLICAS = 2


def _ready(obj: dict[str, Any]) -> bool:
    return is_true(obj, "Ready")


async def _status(http: httpx.AsyncClient, address: str, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return await http.get(f"{address}{API_PREFIX}/status", headers=headers, timeout=10)


async def test_fleet_sets_come_ready_checkpoint_and_recover(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    for name in SETS:
        kubectl_apply(cluster, namespace, fleet_set(name, storage_dir, replicas=REPLICAS))
    ready = {name: await resources.wait_set("is Ready", _ready, 90, name=name) for name in SETS}

    # Served in process: the agent runs no process for any of these pods.
    ours = [p for p in cluster.admin.pods() if str(p["pod"]).startswith(f"{namespace}/")]
    assert len(ours) == len(SETS) * len(ROLES) * REPLICAS
    assert all(p["in_process"] and not p["pids"] for p in ours), ours

    async with httpx.AsyncClient() as http:
        for name, obj in ready.items():
            token = await resources.control_token(name)
            participants = obj["status"]["participants"]
            assert len(participants) == len(ROLES) * REPLICAS
            assert len({p["address"] for p in participants}) == len(participants)
            for participant in participants:
                reply = await _status(http, participant["address"], token)
                assert reply.status_code == 200, reply.text
                body = reply.json()
                assert body["set_name"] == name
                assert body["role"] == participant["role"]
                assert body["instance"] == f"{participant['role']}-{participant['index']}"
                assert (body["attempt"], body["phase"]) == (1, "idle")
            first = participants[0]["address"]
            refused = await _status(http, first, None)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "unauthorized"
            malformed = await http.post(
                f"{first}{API_PREFIX}/prepare",
                json={"checkpoint_id": "x", "unknown": 1},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert malformed.status_code == 422
            assert "error" in malformed.json()

        # Both sets checkpoint at once.
        for name in SETS:
            kubectl_apply(cluster, namespace, fleet_checkpoint(f"{name}-c1", name))
        for name in SETS:
            done = await resources.wait_checkpoint(f"{name}-c1", "is Ready", _ready, 60)
            assert len(done["status"]["participants"]) == len(ROLES) * REPLICAS
            uid = ready[name]["metadata"]["uid"]
            base = checkpoint_base(storage_dir, set_storage_dir(namespace, name, uid), f"{name}-c1")
            for instance in done["status"]["participants"]:
                manifest = read_manifest(base / instance["instance"])
                assert manifest.record_count == 0

        # A SIGKILLed fleet pod is a lost participant: attempt 2, restored from the checkpoint.
        victim = ready[SETS[0]]["status"]["participants"][0]["pod"]
        cluster.kill_pod(namespace, victim)

        async def killed() -> Any:
            pod = await resources.core.read_namespaced_pod(victim, namespace)
            return terminated_state(pod)

        state = await wait_for(killed, 30, f"pod {victim} reported terminated")
        assert state.exit_code == 137

        def recovered(obj: dict[str, Any]) -> bool:
            last = obj["status"].get("lastRecovery") or {}
            return _ready(obj) and obj["status"].get("attempt") == 2 and last.get("attempt") == 2

        after = await resources.wait_set("recovered under attempt 2", recovered, 90, name=SETS[0])
        assert after["status"]["lastRecovery"]["checkpoint"] == f"{SETS[0]}-c1"
        token = await resources.control_token(SETS[0])
        for participant in after["status"]["participants"]:
            body = (await _status(http, participant["address"], token)).json()
            assert (body["attempt"], body["phase"]) == (2, "idle")
        untouched = await resources.rollout_set(SETS[1])
        assert untouched["status"]["attempt"] == 1
