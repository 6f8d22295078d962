"""The operator's pod replaced while a checkpoint runs: the new pod finishes it
(docs/design.md#68-the-operators-own-life).

- `helm upgrade` while a checkpoint prepares;
- the operator's pod deleted (as `kubectl delete pod` or a node drain would) while the
  checkpoint commits: the environment container answered prepare and is then frozen through
  containerd (SIGSTOP to its main process), so its commit call hangs in Committing until the
  new operator pod holds the leader Lease (the old operator has stopped), and is thawed then;
- the operator's pod evicted (the Eviction API, as a drain does) while the eviction checkpoint
  of a participant pod evicted just before is preparing: once the new operator pod holds the
  leader Lease the tool call is let go, the new pod finishes that checkpoint before the
  participant's grace period ends, and the recovery restores it.

The operator runs as the chart installs it (one replica, the `Recreate` strategy) and the four
reference servers as containers of the image. A checkpoint is held in Preparing by an episode
parked inside the agent's tool call (the agent's `tool` debug pause point, so it cannot park);
then `helm upgrade` changes the pod template, the kubelet sends the old operator pod SIGTERM,
and a new pod starts. Stopping is not aborting: the checkpoint is still Preparing when the new
pod runs, and once the tool call is let go it ends Ready under the new pod, every participant
resumed and every episode finished.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from container_support import CHART, RELEASE, condition, evict, get_json, helm, kubectl_apply
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    HOLD_IN_TOOL_ARGS,
    Debug,
    participants_by_role,
    phases,
    wait_phase,
)

from devcluster.waiting import wait_for_sync
from harness.objects import example_checkpoint, example_set
from harness.providers import ContainerClusterProvider

pytestmark = pytest.mark.timeout(900)

SET = "math-rl"
CHECKPOINT = "during-upgrade"
COMMITTING = "during-commit"
EPISODES = 4
HANDOVER_BOUND_S = 30 + 30
"""The longest the new operator pod may take to start working (docs/install.md, "Upgrade"): the
old pod's graceful stop (the chart's terminationGracePeriodSeconds, 30 s) and, were it killed
then without releasing the leader Lease, that Lease's lapse (30 s)."""
PREPARE_TIMEOUT_S = 60 + HANDOVER_BOUND_S
"""The set's prepareTimeoutSeconds: the example's 60 s and the handover bound. The participants
stay prepared until the prepare deadline plus their lease grace (docs/protocol.md, "Lease";
docs/install.md, "Upgrade"), and a participant frozen before the commit reached it holds only
that lease, so it outlasts a handover at its bound."""
TAKEOVER_WAIT_S = HANDOVER_BOUND_S + 30
"""How long a test waits for the new pod to hold the leader Lease: the bound, with room for a
loaded machine."""


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


async def wait(check: Any, limit_s: float, what: str) -> None:
    await anyio.to_thread.run_sync(lambda: wait_for_sync(check, limit_s, what))


async def ready_set(
    cluster: ContainerClusterProvider, namespace: str, storage: Path
) -> dict[str, Any]:
    """The example set, its agent with debug hooks, Ready; returns it."""
    policy = {"checkpointPolicy": {"prepareTimeoutSeconds": PREPARE_TIMEOUT_S}}
    kubectl_apply(
        cluster, namespace, example_set(storage, extra_args=HOLD_IN_TOOL_ARGS, spec=policy)
    )

    def ready() -> bool:
        obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
        return condition(obj, "Ready").get("status") == "True"

    await wait(ready, 300, "the set Ready")
    return get_json(cluster, "rolloutset", SET, "-n", namespace)


def replaced(cluster: ContainerClusterProvider, namespace: str, before: dict[str, Any]) -> bool:
    """A new operator pod (not `before`) is Ready."""
    return any(
        p["metadata"]["name"] != before["metadata"]["name"]
        and condition(p, "Ready").get("status") == "True"
        for p in operator_pods(cluster, namespace)
    )


def took_over(cluster: ContainerClusterProvider, namespace: str, before: dict[str, Any]) -> bool:
    """A new operator pod (not `before`) holds the leader Lease: the old operator has stopped,
    and only the new one works from now on (docs/install.md, "Upgrade").

    A deleted or evicted pod is replaced at once and the new pod is Ready while the old one
    still stops (docs/design.md#68-the-operators-own-life: its flows get 4 s to finish), so
    Ready alone does not say which operator finishes a checkpoint let go then."""
    args = before["spec"]["containers"][0].get("args") or []
    lease_namespace, lease = args[args.index("--leader-lease") + 1].split("/")
    holder = get_json(cluster, "lease", lease, "-n", lease_namespace)["spec"].get("holderIdentity")
    return bool(holder) and holder != before["metadata"]["name"]


@dataclass
class Held:
    """Episodes running, the first held inside the agent's calculator call."""

    hooks: Debug
    http: httpx.AsyncClient
    rollout_id: str
    outcomes: list[EpisodeResult | EpisodeFailed] = field(default_factory=list)

    def check(self) -> None:
        failed = [o for o in self.outcomes if isinstance(o, EpisodeFailed)]
        assert not failed, failed
        assert len(self.outcomes) == EPISODES


@asynccontextmanager
async def held_episodes(
    cluster: ContainerClusterProvider, namespace: str, rset: dict[str, Any], seed: int, prefix: str
) -> AsyncIterator[Held]:
    """Run EPISODES episodes through the set, the first held at the agent's `tool` pause point
    (so a checkpoint cannot park it); leaving the block waits for every episode."""
    agent = participants_by_role(rset)["agent"][0]["address"]
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
        anyio.create_task_group() as group,
    ):
        specs = episode_specs(EPISODES, seed, prefix=prefix)
        held = Held(Debug(http, agent), http, specs[0].rollout_id)
        await held.hooks.arm("tool", held.rollout_id)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=180, run_timeout_s=300
        )

        async def run() -> None:
            held.outcomes.extend(await client.run_all(specs))

        group.start_soon(run)
        await held.hooks.paused("tool", held.rollout_id)
        yield held


async def test_helm_upgrade_while_a_checkpoint_prepares_hands_it_to_the_new_operator_pod(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    rset = await ready_set(cluster, namespace, storage)
    agent = participants_by_role(rset)["agent"][0]["address"]
    [before] = operator_pods(cluster, namespace)
    async with held_episodes(cluster, namespace, rset, 31, "handover") as held:
        kubectl_apply(cluster, namespace, example_checkpoint(CHECKPOINT))
        await wait_phase(held.http, agent, "preparing", "the agent to be preparing")

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
        assert replaced(cluster, namespace, before)
        assert checkpoint_phase(cluster, namespace) == "Preparing", "stopping is not aborting"

        assert await held.hooks.release("tool", held.rollout_id) == 1
        await wait(
            lambda: checkpoint_phase(cluster, namespace) in ("Ready", "Failed"),
            120,
            f"{CHECKPOINT} Ready or Failed under the new operator pod",
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", CHECKPOINT, "-n", namespace)
        assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
        assert (ckpt["status"].get("episodes") or 0) >= 1, ckpt["status"]
        assert set((await phases(held.http, rset)).values()) == {"idle"}
    held.check()


async def test_operator_pod_deleted_while_a_checkpoint_commits_hands_it_to_the_new_pod(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    rset = await ready_set(cluster, namespace, storage)
    by_role = participants_by_role(rset)
    agent, environment = by_role["agent"][0]["address"], by_role["environment"][0]["pod"]
    [before] = operator_pods(cluster, namespace)
    async with held_episodes(cluster, namespace, rset, 37, "committing") as held:
        kubectl_apply(cluster, namespace, example_checkpoint(COMMITTING))
        # The environment prepares first (docs/design.md#44-order) and has answered once the agent,
        # later in the order, is preparing; frozen now, it cannot answer the commit.
        await wait_phase(held.http, agent, "preparing", "the agent to be preparing")
        cluster.kill_container(namespace, environment, sig="SIGSTOP")
        try:
            assert await held.hooks.release("tool", held.rollout_id) == 1
            await wait(
                lambda: checkpoint_phase(cluster, namespace, COMMITTING) == "Committing",
                60,
                f"{COMMITTING} Committing (the frozen environment holds its commit)",
            )
            cluster.kubectl(
                "delete", "pod", before["metadata"]["name"], "-n", namespace, "--wait=false"
            )
            await wait(lambda: replaced(cluster, namespace, before), 180, "a new operator pod")
            # Thawed only once the old operator has stopped, so the new pod finishes the commit.
            await wait(
                lambda: took_over(cluster, namespace, before),
                TAKEOVER_WAIT_S,
                "the new operator pod to hold the leader Lease",
            )
            assert checkpoint_phase(cluster, namespace, COMMITTING) == "Committing", (
                "stopping is not aborting"
            )
        finally:
            cluster.kill_container(namespace, environment, sig="SIGCONT")
        await wait(
            lambda: checkpoint_phase(cluster, namespace, COMMITTING) in ("Ready", "Failed"),
            120,
            f"{COMMITTING} Ready or Failed under the new operator pod",
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", COMMITTING, "-n", namespace)
        assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
        rset = get_json(cluster, "rolloutset", SET, "-n", namespace)
        assert set((await phases(held.http, rset)).values()) == {"idle"}
    held.check()


async def test_operator_evicted_while_an_eviction_checkpoint_prepares_finishes_it_in_the_grace(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    rset = await ready_set(cluster, namespace, storage)
    environment = participants_by_role(rset)["environment"][0]["pod"]
    [before] = operator_pods(cluster, namespace)

    def eviction_checkpoint() -> dict[str, Any]:
        listed = get_json(cluster, "rolloutcheckpoints", "-n", namespace)["items"]
        found = [c for c in listed if c["spec"].get("trigger") == "Eviction"]
        return found[0] if found else {}

    def eviction_phase() -> str | None:
        phase = (eviction_checkpoint().get("status") or {}).get("phase")
        return phase if isinstance(phase, str) else None

    async with held_episodes(cluster, namespace, rset, 41, "evicted") as held:
        evict(cluster, namespace, environment)
        await wait(
            lambda: eviction_phase() == "Preparing",
            60,
            "the eviction checkpoint Preparing (the held tool call keeps the agent busy)",
        )
        terminating = get_json(cluster, "pod", environment, "-n", namespace)
        grace_ends = terminating["metadata"]["deletionTimestamp"]
        evict(cluster, namespace, before["metadata"]["name"])
        await wait(lambda: replaced(cluster, namespace, before), 60, "a new operator pod Ready")
        # Let go only once the old operator has stopped, so the new pod finishes the checkpoint.
        await wait(
            lambda: took_over(cluster, namespace, before),
            TAKEOVER_WAIT_S,
            "the new operator pod to hold the leader Lease",
        )
        assert eviction_phase() == "Preparing", "stopping is not aborting"
        assert await held.hooks.release("tool", held.rollout_id) == 1
        await wait(
            lambda: eviction_phase() in ("Ready", "Failed"),
            60,
            "the eviction checkpoint Ready or Failed under the new operator pod",
        )
        ckpt = eviction_checkpoint()
        assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
        completed = datetime.fromisoformat(ckpt["status"]["completedAt"].replace("Z", "+00:00"))
        assert completed < datetime.fromisoformat(grace_ends.replace("Z", "+00:00")), (
            "Ready before the evicted participant's grace period ended",
            ckpt["status"]["completedAt"],
            grace_ends,
        )
        name = ckpt["metadata"]["name"]

        def recovered() -> bool:
            obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
            last = (obj.get("status") or {}).get("lastRecovery") or {}
            return (
                last.get("checkpoint") == name and condition(obj, "Ready").get("status") == "True"
            )

        await wait(recovered, 180, f"the set recovered from {name}")
        assert get_json(cluster, "rolloutset", SET, "-n", namespace)["status"]["attempt"] == 2
    held.check()
