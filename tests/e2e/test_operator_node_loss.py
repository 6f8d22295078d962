"""The GPU node under the model pod is lost for good; the set recovers onto another GPU node.

`lose_node` kills every process on the node and marks it NotReady (its heartbeat stops); pods
bound to it never report again and their deletion never completes, as on a machine that went
away. A replacement model pod needs a GPU, so this test runs its own devcluster with two GPU
nodes (`gpu-0`, `gpu-1`) and a CPU node, instead of the session's cluster with one GPU node:
the lost node stays lost until the cluster is stopped, and nothing else shares the cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    Debug,
    RecoveredRun,
    Resources,
    check_manifests,
    check_recovered_run,
    create_namespace_for_test,
    example_checkpoint,
    example_set,
    is_true,
    kubectl_apply,
    participants_by_role,
    phase_is,
    running_operator,
    stats,
)

from devcluster.cluster import Cluster
from devcluster.config import NodeSpec
from devcluster.kube import open_api

EPISODES = 16
SEED = 13


@pytest.fixture(scope="module")
def two_gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("node-loss") / "devcluster"
    nodes = (NodeSpec(name="gpu-0", gpus=8), NodeSpec(name="gpu-1", gpus=8), NodeSpec(name="cpu-0"))
    cluster = Cluster.start(root, nodes=nodes)
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.processes()
        assert not left, f"processes left after stopping the node-loss cluster: {left}"


async def test_losing_the_gpu_node_recovers_the_set_onto_another_gpu_node(
    two_gpu_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = two_gpu_cluster
    namespace = create_namespace_for_test(cluster, "node-loss")
    storage = tmp_path / "checkpoints"
    storage.mkdir()
    with running_operator(cluster, [namespace], tmp_path / "operator.log"):
        rset = example_set(storage, extra_args={"model": ["--debug-hooks"]})
        kubectl_apply(cluster, namespace, rset)
        async with open_api(cluster.kubeconfig) as api:
            await run_node_loss(cluster, Resources(api, namespace), storage)


async def run_node_loss(cluster: Cluster, resources: Resources, storage: Path) -> None:
    namespace = resources.namespace
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    token = await resources.control_token()
    model = participants_by_role(ready)["model"][0]
    pod = await resources.core.read_namespaced_pod(model["pod"], namespace)
    lost_node = pod.spec.node_name
    assert lost_node in ("gpu-0", "gpu-1")
    other_gpu_node = "gpu-1" if lost_node == "gpu-0" else "gpu-0"

    specs = episode_specs(EPISODES, SEED)
    outcomes: list[EpisodeResult | EpisodeFailed] = []
    seen: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        # One episode is held at its third token, so it is unfinished (and in the
        # checkpoint's scope) when the node goes, however fast the others run.
        hooks = Debug(http, model["address"])
        held = specs[0].rollout_id
        await hooks.arm("token", held, index=2)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        async with anyio.create_task_group() as group:

            async def run_episodes() -> None:
                outcomes.extend(await client.run_all(specs))

            group.start_soon(run_episodes)
            await hooks.paused("token", held)
            name = "before-node-loss"
            kubectl_apply(cluster, namespace, example_checkpoint(name))
            ckpt = await resources.wait_checkpoint(
                name, "Ready or Failed", phase_is("Ready", "Failed"), 60
            )
            assert is_true(ckpt, "Ready"), ckpt["status"]
            check_manifests(ckpt, storage)

            await cluster.admin.lose_node_async(lost_node)

            def recovering(obj: dict[str, Any]) -> bool:
                if is_true(obj, "Recovering"):
                    seen.append(obj)
                    return True
                return False

            await resources.wait_set("Recovering", recovering, 60)
            recovered = await resources.wait_set(
                "Ready under a new attempt",
                # latestCheckpoint: written by the set's pass right after the recovery
                lambda o: (
                    (o["status"].get("attempt") or 1) > 1
                    and is_true(o, "Ready")
                    and bool(o["status"].get("latestCheckpoint"))
                ),
                120,
            )

        attempt = recovered["status"]["attempt"]
        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        now = participants_by_role(recovered)
        new_stats = {
            role: await stats(http, now[role][0]["address"], token)
            for role in ("environment", "agent", "model")
        }

    # The loss as the recovery recorded it (the Recovering condition's reason follows the
    # recovery's phases, and the first look may come after StoppingAttempt already).
    loss = seen[0]["status"].get("recovery")
    assert loss is not None, seen[0]["status"]
    assert loss["reason"] == "NodeLost"
    assert lost_node in loss["message"]
    assert recovered["status"]["latestCheckpoint"] == name
    # A try whose pod the scheduler bound to the lost node (before it was tainted) is given up
    # at once, so the attempt may be 3; the model runs on the other GPU node either way.
    replacement = now["model"][0]["pod"]
    assert replacement == f"math-rl-model-0-a{attempt}"
    placed = await _node_of(cluster, namespace, replacement)
    assert placed == other_gpu_node
    results = check_recovered_run(
        RecoveredRun(
            specs=specs,
            outcomes=outcomes,
            reference_specs=reference_specs,
            reference=reference,
            storage=storage,
            checkpoint=ckpt,
            stats=new_stats,
            attempt=attempt,
        )
    )
    assert results[held].attempt == attempt
    assert results[held].continued_from == 1


async def _node_of(cluster: Cluster, namespace: str, pod_name: str) -> str:
    async with open_api(cluster.kubeconfig) as api:
        resources = Resources(api, namespace)
        pod = await resources.core.read_namespaced_pod(pod_name, namespace)
    node: str = pod.spec.node_name
    return node
