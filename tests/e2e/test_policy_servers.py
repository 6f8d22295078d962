"""Eviction and suspend with the four reference servers and the trainer client, as a queueing
system or a node drain would do them: no committed step is lost and every episode in scope
continues under the next attempt.

As in test_operator_examples, one episode is held at its third token (the model's `token`
pause point, outside any step), so it is provably mid-generation when the pod goes; the shared
`check_recovered_run` then checks the invariants (docs/design.md#8-invariants) against an
uninterrupted run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
from policy_support import WAIT, patch_set, wait_condition, wait_ready, when
from rollout_operator.decide.policy.eviction import EVICTION_COMMIT_MARGIN_SECONDS
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    RecoveredRun,
    Resources,
    check_recovered_run,
    condition,
    example_set,
    is_true,
    kubectl_apply,
    participants_by_role,
    stats,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

SET = "math-rl"
EPISODES = 16
SEED = 5
HELD_AT_TOKEN = 2
GRACE_SECONDS = 20


def servers_set(storage: Path) -> dict[str, Any]:
    """The example set with a debuggable model that drains for GRACE_SECONDS after SIGTERM."""
    obj = example_set(storage, extra_args={"model": ["--debug-hooks"]})
    for participant in obj["spec"]["participants"]:
        if participant["role"] == "model":
            participant["template"]["spec"]["terminationGracePeriodSeconds"] = GRACE_SECONDS
    return obj


@dataclass
class Episodes:
    """Episodes running against the set through the trainer client."""

    http: httpx.AsyncClient
    topology: Any
    specs: list[Any]
    held: str
    """Held at its third token in the model, so it is mid-generation when the pod goes."""
    outcomes: list[EpisodeResult | EpisodeFailed] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)

    async def finished(self) -> list[EpisodeResult | EpisodeFailed]:
        with anyio.fail_after(240):
            await self.done.wait()
        return self.outcomes


@asynccontextmanager
async def episodes_running(
    cluster: Cluster, namespace: str, resources: Resources
) -> AsyncIterator[Episodes]:
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    model = participants_by_role(ready)["model"][0]
    specs = episode_specs(EPISODES, SEED)
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        running = Episodes(http, topology, specs, specs[0].rollout_id)
        await Debug(http, model["address"]).arm("token", running.held, index=HELD_AT_TOKEN)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        async with anyio.create_task_group() as group:

            async def run() -> None:
                running.outcomes.extend(await client.run_all(specs))
                running.done.set()

            group.start_soon(run)
            await Debug(http, model["address"]).paused("token", running.held)
            yield running


async def check_continued(
    running: Episodes, resources: Resources, storage: Path, checkpoint: dict[str, Any]
) -> None:
    """Every episode finished once with the uninterrupted result; the held one continued from
    the checkpoint's cut under attempt 2 (docs/design.md#8-invariants, via
    `check_recovered_run`)."""
    outcomes = await running.finished()
    recovered = await resources.rollout_set(SET)
    reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
    reference = await RolloutClient(running.topology, concurrency=EPISODES).run_all(reference_specs)
    a2 = participants_by_role(recovered)
    token = await resources.control_token(SET)
    new_stats = {
        role: await stats(running.http, a2[role][0]["address"], token)
        for role in ("environment", "agent", "model")
    }
    results = check_recovered_run(
        RecoveredRun(
            specs=running.specs,
            outcomes=outcomes,
            reference_specs=reference_specs,
            reference=reference,
            storage=storage,
            checkpoint=checkpoint,
            stats=new_stats,
        )
    )
    assert results[running.held].attempt == 2
    assert results[running.held].continued_from == 1


async def wait_attempt_2(resources: Resources) -> dict[str, Any]:
    """Ready under attempt 2, with `latestCheckpoint` shown: the set's pass writes it from the
    checkpoints right after the recovery that runs in the same loop (the recovery itself reads
    the checkpoints, not this field)."""
    return await resources.wait_set(
        "Ready under attempt 2, latest checkpoint shown",
        lambda o: (
            o["status"].get("attempt") == 2
            and is_true(o, "Ready")
            and bool(o["status"].get("latestCheckpoint"))
        ),
        90,
    )


async def test_evicted_model_pod_is_checkpointed_inside_its_grace_period(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    kubectl_apply(cluster, namespace, servers_set(storage_dir))
    async with episodes_running(cluster, namespace, resources) as running:
        ready = await resources.rollout_set(SET)
        model_pod = participants_by_role(ready)["model"][0]["pod"]
        # kubectl delete uses the pod's grace period, as a drain or a preemption does.
        cluster.kubectl("delete", "pod", model_pod, "-n", namespace, "--wait=false")
        pod = await resources.core.read_namespaced_pod(model_pod, namespace)
        killed_at: datetime = pod.metadata.deletion_timestamp
        assert pod.metadata.deletion_grace_period_seconds == GRACE_SECONDS

        ckpt = await wait_ready(resources, f"{SET}-evict-a1")
        recovered = await wait_attempt_2(resources)
        await check_continued(running, resources, storage_dir, ckpt)

    assert ckpt["spec"]["trigger"] == "Eviction"
    assert ckpt["status"]["attempt"] == 1
    assert when(ckpt["status"]["completedAt"]) <= killed_at, (ckpt["status"], killed_at)
    # The prepare was given the pod's remaining grace (less the commit's margin), not
    # prepareTimeoutSeconds (300 s, far past the kill).
    prepare_ends = killed_at - timedelta(seconds=EVICTION_COMMIT_MARGIN_SECONDS)
    assert when(ckpt["status"]["deadline"]) <= prepare_ends, (ckpt["status"], killed_at)
    assert recovered["status"]["latestCheckpoint"] == ckpt["metadata"]["name"]
    assert condition(recovered, "Recovering")["reason"] == "Restored"  # type: ignore[index]


async def test_suspend_then_resume_continues_every_episode_in_scope(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    kubectl_apply(cluster, namespace, servers_set(storage_dir))
    async with episodes_running(cluster, namespace, resources) as running:
        await patch_set(resources, SET, {"spec": {"suspend": True}})
        suspended = await wait_condition(resources, SET, "Suspended", status="True")
        assert suspended["reason"] == "Suspended"
        assert f"{SET}-suspend-a1 holds the state" in suspended["message"]
        ckpt = await resources.checkpoint(f"{SET}-suspend-a1")

        async def no_pods() -> bool | None:
            pods = await resources.core.list_namespaced_pod(namespace)
            return True if not pods.items else None

        await wait_for(no_pods, WAIT, "every participant pod released", interval=0.2)
        # Status follows the pods' deletion; the reconciler's next pass says Suspended.
        await wait_condition(resources, SET, "Ready", status="False", reason="Suspended")
        released = await resources.rollout_set(SET)
        assert not is_true(released, "Degraded")
        assert "recovery" not in released["status"]
        assert released["status"]["attempt"] == 1

        await patch_set(resources, SET, {"spec": {"suspend": False}})
        resumed = await wait_attempt_2(resources)
        await check_continued(running, resources, storage_dir, ckpt)

    assert ckpt["spec"]["trigger"] == "Suspend"
    assert is_true(ckpt, "Ready")
    assert condition(resumed, "Suspended")["reason"] == "Resumed"  # type: ignore[index]
    assert condition(resumed, "Recovering")["reason"] == "Restored"  # type: ignore[index]
    assert resumed["status"]["restarts"] == 0  # a resume is not a restart: nothing was lost
    assert resumed["status"]["latestCheckpoint"] == ckpt["metadata"]["name"]
