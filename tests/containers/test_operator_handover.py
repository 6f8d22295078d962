"""The operator's pod replaced while a checkpoint runs: the new pod finishes it (issue 27).

- `helm upgrade` while a checkpoint prepares;
- the operator's pod deleted (as `kubectl delete pod` or a node drain would) while the
  checkpoint commits: the environment container answered prepare and is then frozen through
  containerd (SIGSTOP to its main process), so its commit call hangs in Committing until the
  new operator pod runs, and is thawed then;
- the operator's pod evicted (the Eviction API, as a drain does) while the eviction checkpoint
  of a participant pod evicted just before is preparing: the new operator pod finishes that
  checkpoint before the participant's grace period ends, and the recovery restores it.

The operator runs as the chart installs it (one replica, the `Recreate` strategy) and the four
reference servers as containers of the image. A checkpoint is held in Preparing by an episode
parked inside the agent's tool call (the agent's `tool` debug pause point, so it cannot park);
then `helm upgrade` changes the pod template, the kubelet sends the old operator pod SIGTERM,
and a new pod starts. Stopping is not aborting: the checkpoint is still Preparing when the new
pod runs, and once the tool call is let go it ends Ready under the new pod, every participant
resumed and every episode finished.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from container_support import CHART, RELEASE, condition, get_json, helm, kubectl_apply
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import Debug, participants_by_role, phases, wait_phase

from devcluster.waiting import wait_for_sync
from harness.objects import example_checkpoint, example_set
from harness.providers import ContainerClusterProvider

pytestmark = pytest.mark.timeout(900)

SET = "math-rl"
CHECKPOINT = "during-upgrade"
COMMITTING = "during-commit"
EPISODES = 4


def operator_pods(cluster: ContainerClusterProvider, namespace: str) -> list[dict[str, Any]]:
    listed = get_json(
        cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/name=rollout-operator"
    )
    return list(listed["items"])


def checkpoint_phase(
    cluster: ContainerClusterProvider, namespace: str, name: str = CHECKPOINT
) -> str | None:
    ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
    phase = (ckpt.get("status") or {}).get("phase")
    return phase if isinstance(phase, str) else None


async def test_helm_upgrade_while_a_checkpoint_prepares_hands_it_to_the_new_operator_pod(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    kubectl_apply(cluster, namespace, example_set(storage, extra_args={"agent": ["--debug-hooks"]}))

    def ready() -> bool:
        obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
        return condition(obj, "Ready").get("status") == "True"

    await anyio.to_thread.run_sync(lambda: wait_for_sync(ready, 300, "the set Ready"))
    rset = get_json(cluster, "rolloutset", SET, "-n", namespace)
    agent = participants_by_role(rset)["agent"][0]["address"]
    [before] = operator_pods(cluster, namespace)
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
        anyio.create_task_group() as group,
    ):
        hooks = Debug(http, agent)
        specs = episode_specs(EPISODES, 31, prefix="handover")
        held = specs[0].rollout_id
        await hooks.arm("tool", held)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=300
        )

        async def run() -> None:
            outcomes.extend(await client.run_all(specs))

        group.start_soon(run)
        await hooks.paused("tool", held)
        kubectl_apply(cluster, namespace, example_checkpoint(CHECKPOINT))
        await wait_phase(http, agent, "preparing", "the agent to be preparing")

        # A new pod template: the Deployment (Recreate) stops the old pod, then starts one.
        upgraded = await anyio.to_thread.run_sync(
            lambda: helm(
                cluster,
                "upgrade",
                RELEASE,
                str(CHART),
                "--namespace",
                namespace,
                "--reuse-values",
                "--set",
                "podAnnotations.rollout-test/upgrade=handover",
                "--wait",
                "--timeout",
                "300s",
            )
        )
        assert upgraded.returncode == 0, upgraded.stderr
        pods = operator_pods(cluster, namespace)
        assert [p["metadata"]["name"] for p in pods] != [before["metadata"]["name"]], pods
        assert checkpoint_phase(cluster, namespace) == "Preparing", "stopping is not aborting"

        assert await hooks.release("tool", held) == 1
        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(
                lambda: checkpoint_phase(cluster, namespace) in ("Ready", "Failed"),
                120,
                f"{CHECKPOINT} Ready or Failed under the new operator pod",
            )
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", CHECKPOINT, "-n", namespace)
        assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
        assert (ckpt["status"].get("episodes") or 0) >= 1, ckpt["status"]
        assert set((await phases(http, rset)).values()) == {"idle"}

    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failed, failed
    assert len(outcomes) == EPISODES


async def test_operator_pod_deleted_while_a_checkpoint_commits_hands_it_to_the_new_pod(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    kubectl_apply(cluster, namespace, example_set(storage, extra_args={"agent": ["--debug-hooks"]}))

    def ready() -> bool:
        obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
        return condition(obj, "Ready").get("status") == "True"

    await anyio.to_thread.run_sync(lambda: wait_for_sync(ready, 300, "the set Ready"))
    rset = get_json(cluster, "rolloutset", SET, "-n", namespace)
    by_role = participants_by_role(rset)
    agent, environment = by_role["agent"][0]["address"], by_role["environment"][0]["pod"]
    [before] = operator_pods(cluster, namespace)
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    def new_operator_ready() -> bool:
        pods = operator_pods(cluster, namespace)
        return any(
            p["metadata"]["name"] != before["metadata"]["name"]
            and condition(p, "Ready").get("status") == "True"
            for p in pods
        )

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
        anyio.create_task_group() as group,
    ):
        hooks = Debug(http, agent)
        specs = episode_specs(EPISODES, 37, prefix="committing")
        held = specs[0].rollout_id
        await hooks.arm("tool", held)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=300
        )

        async def run() -> None:
            outcomes.extend(await client.run_all(specs))

        group.start_soon(run)
        await hooks.paused("tool", held)
        kubectl_apply(cluster, namespace, example_checkpoint(COMMITTING))
        # The environment prepares first (DESIGN §4's order) and has answered once the agent,
        # later in the order, is preparing; frozen now, it cannot answer the commit.
        await wait_phase(http, agent, "preparing", "the agent to be preparing")
        cluster.kill_container(namespace, environment, sig="SIGSTOP")
        try:
            assert await hooks.release("tool", held) == 1
            await anyio.to_thread.run_sync(
                lambda: wait_for_sync(
                    lambda: checkpoint_phase(cluster, namespace, COMMITTING) == "Committing",
                    60,
                    f"{COMMITTING} Committing (the frozen environment holds its commit)",
                )
            )
            cluster.kubectl(
                "delete", "pod", before["metadata"]["name"], "-n", namespace, "--wait=false"
            )
            await anyio.to_thread.run_sync(
                lambda: wait_for_sync(new_operator_ready, 180, "a new operator pod Ready")
            )
            assert checkpoint_phase(cluster, namespace, COMMITTING) == "Committing", (
                "stopping is not aborting"
            )
        finally:
            cluster.kill_container(namespace, environment, sig="SIGCONT")
        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(
                lambda: checkpoint_phase(cluster, namespace, COMMITTING) in ("Ready", "Failed"),
                120,
                f"{COMMITTING} Ready or Failed under the new operator pod",
            )
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", COMMITTING, "-n", namespace)
        assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
        rset = get_json(cluster, "rolloutset", SET, "-n", namespace)
        assert set((await phases(http, rset)).values()) == {"idle"}

    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failed, failed
    assert len(outcomes) == EPISODES


def evict(cluster: ContainerClusterProvider, namespace: str, pod: str) -> None:
    """Evict a pod through the Eviction API, as `kubectl drain` does."""
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod, "namespace": namespace},
    }
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction"
    cluster.kubectl("create", "--raw", path, "-f", "-", input=json.dumps(eviction))


async def test_operator_evicted_while_an_eviction_checkpoint_prepares_finishes_it_in_the_grace(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    kubectl_apply(cluster, namespace, example_set(storage, extra_args={"agent": ["--debug-hooks"]}))

    def rset() -> dict[str, Any]:
        return get_json(cluster, "rolloutset", SET, "-n", namespace)

    await anyio.to_thread.run_sync(
        lambda: wait_for_sync(
            lambda: condition(rset(), "Ready").get("status") == "True", 300, "the set Ready"
        )
    )
    by_role = participants_by_role(rset())
    agent, environment = by_role["agent"][0]["address"], by_role["environment"][0]["pod"]
    [before] = operator_pods(cluster, namespace)
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    def eviction_checkpoint() -> dict[str, Any] | None:
        listed = get_json(cluster, "rolloutcheckpoints", "-n", namespace)["items"]
        found = [c for c in listed if c["spec"].get("trigger") == "Eviction"]
        return found[0] if found else None

    def new_operator_ready() -> bool:
        return any(
            p["metadata"]["name"] != before["metadata"]["name"]
            and condition(p, "Ready").get("status") == "True"
            for p in operator_pods(cluster, namespace)
        )

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
        anyio.create_task_group() as group,
    ):
        hooks = Debug(http, agent)
        specs = episode_specs(EPISODES, 41, prefix="evicted")
        held = specs[0].rollout_id
        await hooks.arm("tool", held)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=180, run_timeout_s=300
        )

        async def run() -> None:
            outcomes.extend(await client.run_all(specs))

        group.start_soon(run)
        await hooks.paused("tool", held)
        evict(cluster, namespace, environment)
        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(
                lambda: (
                    ((eviction_checkpoint() or {}).get("status") or {}).get("phase") == "Preparing"
                ),
                60,
                "the eviction checkpoint Preparing (the held tool call keeps the agent busy)",
            )
        )
        terminating = get_json(cluster, "pod", environment, "-n", namespace)
        grace_ends = terminating["metadata"]["deletionTimestamp"]
        evict(cluster, namespace, before["metadata"]["name"])
        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(new_operator_ready, 60, "a new operator pod Ready")
        )
        ckpt = eviction_checkpoint()
        assert ckpt is not None
        assert ckpt["status"]["phase"] == "Preparing", "stopping is not aborting"
        assert await hooks.release("tool", held) == 1
        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(
                lambda: (
                    ((eviction_checkpoint() or {}).get("status") or {}).get("phase")
                    in ("Ready", "Failed")
                ),
                60,
                "the eviction checkpoint Ready or Failed under the new operator pod",
            )
        )
        ckpt = eviction_checkpoint()
        assert ckpt is not None
        assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
        completed = datetime.fromisoformat(ckpt["status"]["completedAt"].replace("Z", "+00:00"))
        assert completed < datetime.fromisoformat(grace_ends.replace("Z", "+00:00")), (
            "Ready before the evicted participant's grace period ended",
            ckpt["status"]["completedAt"],
            grace_ends,
        )
        name = ckpt["metadata"]["name"]

        def recovered() -> bool:
            status = rset().get("status") or {}
            last = status.get("lastRecovery") or {}
            return (
                last.get("checkpoint") == name
                and condition(rset(), "Ready").get("status") == "True"
            )

        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(recovered, 180, f"the set recovered from {name}")
        )
        assert rset()["status"]["attempt"] == 2

    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failed, failed
    assert len(outcomes) == EPISODES
