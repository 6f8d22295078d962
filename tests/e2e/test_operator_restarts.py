"""The operator is stopped during prepare and during commit (SIGTERM, as a pod deletion or
`helm upgrade` stops it) and SIGKILLed during a restore, and a fresh operator process continues
from what the custom resources' status recorded. A stopped operator hands its checkpoints over
instead of aborting them (docs/design.md#68-the-operators-own-life): each is still in its phase, not
Failed, when the next one starts.

The three restarts share one RolloutSet, in order, because each needs what the previous left:
the restore restores the checkpoint whose commit survived a restart. Each phase is held
deterministically by a participant that cannot finish its part:

- prepare: an episode is held inside the agent's calculator call (the agent's `tool` pause
  point, inside a step a checkpoint must wait for), so the agent cannot park;
- commit: the environment already answered prepare, then is frozen (SIGSTOP), so its commit
  call hangs;
- restore: the replacement model pod is frozen once Ready, so its restore call hangs (the
  environment's readiness probe has an initial delay, so the operator cannot have restored
  before the freeze; frozen pods keep their Ready status through a high failure threshold).

After each restart the outcome is checked as a user would: the checkpoint is Ready with every
participant's manifest on storage (or the set Ready under the next attempt), every participant
resumed (`/healthz` phase idle), and the episodes that were running all finish.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_protocol import read_manifest
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import RolloutSetTopology, rollout_set_topology
from testsupport.operator_fixtures import (
    HOLD_IN_TOOL_ARGS,
    Debug,
    OperatorProcess,
    Resources,
    condition,
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
    wait_pod_ready,
)

from devcluster.cluster import Cluster

pytestmark = pytest.mark.adversarial  # operator loss in prepare, commit and restore

BATCH = 4


def restart_set(storage: Path) -> dict[str, Any]:
    rset = example_set(storage, extra_args=HOLD_IN_TOOL_ARGS)
    for participant in rset["spec"]["participants"]:
        probe = participant["template"]["spec"]["containers"][0]["readinessProbe"]
        probe["failureThreshold"] = 600  # a frozen pod stays Ready: it is slow, not gone
        if participant["role"] == "environment":
            probe["initialDelaySeconds"] = 3
    return rset


def check_ready_checkpoint(ckpt: dict[str, Any], storage: Path) -> None:
    assert is_true(ckpt, "Ready"), ckpt["status"]
    assert not is_true(ckpt, "Failed")
    listed = ckpt["status"]["participants"]
    assert len(listed) == 4
    for entry in listed:
        manifest = read_manifest((storage / entry["manifest"]).parent)
        assert manifest.records_sha256 == entry["recordsSha256"]
        assert manifest.record_count == entry["recordCount"]


class Batch:
    """Episodes running in the background against the set (followed through the API)."""

    def __init__(self, topology: RolloutSetTopology, prefix: str, seed: int) -> None:
        self.specs = episode_specs(BATCH, seed, prefix=prefix)
        self.client = RolloutClient(
            topology, concurrency=BATCH, restore_timeout_s=120, run_timeout_s=180
        )
        self.outcomes: list[EpisodeResult | EpisodeFailed] = []

    async def run(self) -> None:
        self.outcomes.extend(await self.client.run_all(self.specs))

    def check(self, attempt: int | None = None) -> None:
        failed = [o for o in self.outcomes if isinstance(o, EpisodeFailed)]
        assert not failed, failed
        assert len(self.outcomes) == BATCH
        if attempt is not None:
            assert {o.attempt for o in self.outcomes if isinstance(o, EpisodeResult)} == {attempt}


async def restart_in_phase(
    operator: OperatorProcess,
    cluster: Cluster,
    in_phase: Callable[[], Awaitable[Any]],
    *,
    graceful: bool = False,
) -> None:
    """Wait until the operator is in the phase, then stop it (SIGTERM when `graceful`, and it
    must exit by itself; else SIGKILL) and start a fresh one."""
    await in_phase()
    if graceful:
        exited = await anyio.to_thread.run_sync(operator.terminate)
        assert exited is not None, "the operator did not exit on SIGTERM: " + operator.tail()
    else:
        await anyio.to_thread.run_sync(operator.kill)
    await anyio.to_thread.run_sync(operator.start)


async def test_operator_restarts_during_prepare_commit_and_restore(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(restart_set(storage_dir)))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    roles = participants_by_role(ready)
    agent = roles["agent"][0]["address"]
    environment = roles["environment"][0]

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
        anyio.create_task_group() as group,
    ):
        hooks = Debug(http, agent)

        # --- during prepare: the agent cannot park while an episode is inside its tool call
        prepare_batch = Batch(topology, "prep", 21)
        held = prepare_batch.specs[0].rollout_id
        await hooks.arm("tool", held)
        group.start_soon(prepare_batch.run)
        await hooks.paused("tool", held)
        cluster.kubectl(
            "apply",
            "-n",
            namespace,
            "-f",
            "-",
            input=json.dumps(example_checkpoint("during-prepare")),
        )
        paused_since: list[float] = []

        async def agent_preparing() -> None:
            await wait_phase(http, agent, "preparing", "the agent to be preparing")
            paused_since.append(time.monotonic())

        await restart_in_phase(operator, cluster, agent_preparing, graceful=True)
        preparing = await resources.checkpoint("during-prepare")
        assert preparing["status"]["phase"] == "Preparing", "stopping is not aborting"
        assert await hooks.release("tool", held) == 1
        held_paused = time.monotonic() - paused_since[0]
        ckpt = await resources.wait_checkpoint(
            "during-prepare", "Ready or Failed", phase_is("Ready", "Failed"), 60
        )
        check_ready_checkpoint(ckpt, storage_dir)
        assert ckpt["status"]["episodes"] >= 1
        # The reported pause covers the whole time admission was closed, across the restart
        # (it once covered only the second operator's part).
        assert ckpt["status"]["durations"]["pauseSeconds"] >= held_paused
        assert set((await phases(http, ready)).values()) == {"idle"}

        # --- during commit: the environment prepared, then stopped answering
        commit_batch = Batch(topology, "commit", 22)
        held = commit_batch.specs[0].rollout_id
        await hooks.arm("tool", held)
        group.start_soon(commit_batch.run)
        await hooks.paused("tool", held)
        cluster.kubectl(
            "apply",
            "-n",
            namespace,
            "-f",
            "-",
            input=json.dumps(example_checkpoint("during-commit")),
        )
        await wait_phase(http, agent, "preparing", "the agent to be preparing")
        frozen = pod_pids(cluster, namespace, environment["pod"])
        freeze(frozen)
        try:
            assert await hooks.release("tool", held) == 1
            await restart_in_phase(
                operator,
                cluster,
                lambda: resources.wait_checkpoint(
                    "during-commit", "Committing", phase_is("Committing"), 30
                ),
                graceful=True,
            )
            committing = await resources.checkpoint("during-commit")
            assert committing["status"]["phase"] == "Committing", "stopping is not aborting"
        finally:
            thaw(frozen)
        ckpt = await resources.wait_checkpoint(
            "during-commit", "Ready or Failed", phase_is("Ready", "Failed"), 60
        )
        check_ready_checkpoint(ckpt, storage_dir)
        assert set((await phases(http, ready)).values()) == {"idle"}
        # latestCheckpoint follows the checkpoint's Ready within a pass of the set.
        await resources.wait_set(
            "latest during-commit, none active",
            lambda o: (
                o["status"].get("latestCheckpoint") == "during-commit"
                and not o["status"].get("activeCheckpoint")
            ),
            10,
        )

        # --- during restore: the replacement model is frozen once Ready
        model = roles["model"][0]
        await cluster.admin.kill_pod_async(namespace, model["pod"])
        replacement = "math-rl-model-0-a2"

        await wait_pod_ready(resources, replacement, 60)
        frozen = pod_pids(cluster, namespace, replacement)
        freeze(frozen)
        try:
            await restart_in_phase(
                operator,
                cluster,
                lambda: resources.wait_set(
                    "Restoring",
                    lambda o: (o["status"].get("recovery") or {}).get("phase") == "Restoring",
                    60,
                ),
            )
        finally:
            thaw(frozen)
        recovered = await resources.wait_set(
            "Ready under attempt 2",
            lambda o: o["status"].get("attempt") == 2 and is_true(o, "Ready"),
            90,
        )
        assert not recovered["status"].get("recovery")
        recovering = condition(recovered, "Recovering")
        assert recovering is not None
        assert recovering["reason"] == "Restored"
        assert "during-commit" in recovering["message"]
        assert set((await phases(http, recovered)).values()) == {"idle"}
        after_batch = Batch(topology, "after", 23)
        await after_batch.run()
        after_batch.check(attempt=2)

    prepare_batch.check()
    commit_batch.check()
    assert operator.starts == 4
