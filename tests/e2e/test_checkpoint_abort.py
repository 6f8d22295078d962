"""Aborting a checkpoint frees every participant at once (docs/operations.md#failure-modes, class
10).

- Deleting a RolloutCheckpoint while it prepares aborts it: every participant resumes (instead
  of staying paused until its lease lapses), the set's slot is free, and the next checkpoint
  becomes Ready (instead of failing with `conflicting_checkpoint`).
- A participant that hangs (SIGSTOP) during prepare does not hold the others' resume: they are
  idle while the abort still waits for the hung one, and the checkpoint fails as
  `ParticipantUnresponsive` (it was slow, not gone).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_servers.client import EpisodeFailed, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    HOLD_IN_TOOL_ARGS,
    Debug,
    OperatorProcess,
    Resources,
    condition,
    episodes_running,
    example_checkpoint,
    example_set,
    freeze,
    is_true,
    participants_by_role,
    phase_is,
    phases,
    pod_pids,
    thaw,
    wait_phase,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.adversarial]  # fault timings

LEASE_GRACE_S = 30
"""The participants' default lease grace: an abandoned prepare would pause them this long past
its deadline. Every wait below is far shorter."""


def abort_set(storage: Path, prepare_timeout: int) -> dict[str, Any]:
    rset = example_set(
        storage,
        extra_args=HOLD_IN_TOOL_ARGS,
        spec={"checkpointPolicy": {"prepareTimeoutSeconds": prepare_timeout}},
    )
    for participant in rset["spec"]["participants"]:
        probe = participant["template"]["spec"]["containers"][0]["readinessProbe"]
        probe["failureThreshold"] = 600  # a frozen pod stays Ready: it is slow, not gone
    return rset


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


async def test_deleting_a_preparing_checkpoint_resumes_every_participant(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    apply(cluster, namespace, abort_set(storage_dir, prepare_timeout=120))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    agent = participants_by_role(ready)["agent"][0]
    specs = episode_specs(4, 41)
    held = specs[0].rollout_id
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        hooks = Debug(http, agent["address"])
        # Inside the agent's tool call an episode cannot park: prepare waits at the agent.
        await hooks.arm("tool", held)
        client = RolloutClient(topology, concurrency=4, restore_timeout_s=120)
        async with episodes_running(client, specs) as outcomes:
            await hooks.paused("tool", held)
            apply(cluster, namespace, example_checkpoint("doomed"))
            await wait_phase(http, agent["address"], "preparing", "the agent to be preparing")
            paused = await phases(http, ready)
            assert paused["environment-0"] == "prepared", paused

            cluster.kubectl("delete", "rckpt", "doomed", "-n", namespace, "--wait=false")

            async def all_idle() -> bool:
                return set((await phases(http, ready)).values()) == {"idle"}

            await wait_for(
                all_idle,
                LEASE_GRACE_S / 2,
                "every participant to resume after the deletion",
                interval=0.1,
                ignore=(httpx.HTTPError,),
            )
            await resources.wait_set(
                "the checkpoint slot free",
                lambda o: not o["status"].get("activeCheckpoint"),
                LEASE_GRACE_S / 2,
            )
            assert await hooks.release("tool", held) == 1

            apply(cluster, namespace, example_checkpoint("after"))
            after = await resources.wait_checkpoint(
                "after", "Ready or Failed", phase_is("Ready", "Failed"), 60
            )
            assert is_true(after, "Ready"), after["status"]
    assert not [o for o in outcomes if isinstance(o, EpisodeFailed)], outcomes
    assert len(outcomes) == len(specs)

    async def deleted() -> bool:
        listed = cluster.kubectl("get", "rckpt", "doomed", "-n", namespace, check=False)
        return listed.returncode != 0

    await wait_for(deleted, 30, "the deleted checkpoint to be gone", interval=0.2)


async def test_a_hung_participant_does_not_hold_the_others_resume(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    apply(cluster, namespace, abort_set(storage_dir, prepare_timeout=3))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    others = [p for p in ready["status"]["participants"] if p["role"] != "resources"]
    resources_pod = participants_by_role(ready)["resources"][0]
    frozen = pod_pids(cluster, namespace, resources_pod["pod"])
    freeze(frozen)
    try:
        apply(cluster, namespace, example_checkpoint("hung"))
        async with httpx.AsyncClient() as http:
            # prepare reaches the resources stage (the others prepared) and times out there
            await resources.wait_checkpoint(
                "hung", "preparing", phase_is("Preparing", "Failed"), 30
            )
            await wait_phase(http, others[0]["address"], "prepared", "a prepared participant")

            async def others_idle() -> bool:
                for participant in others:
                    reply = await http.get(participant["address"] + "/healthz", timeout=2)
                    if reply.json()["phase"] != "idle":
                        return False
                return True

            await wait_for(
                others_idle,
                LEASE_GRACE_S / 2,
                "the responsive participants to resume",
                interval=0.05,
                ignore=(httpx.HTTPError,),
            )
            # The abort still waits for the frozen one: the checkpoint is not Failed yet, and
            # the others did not wait for it.
            during = await resources.checkpoint("hung")
            assert during["status"].get("phase") != "Failed", during["status"]
    finally:
        thaw(frozen)
    failed = await resources.wait_checkpoint("hung", "Failed", phase_is("Ready", "Failed"), 60)
    reason = condition(failed, "Failed")
    assert reason is not None
    assert reason["reason"] == "ParticipantUnresponsive", reason
    assert "resources-0" in reason["message"]
