"""The example RolloutSet as containers of the image, driven by the Helm-installed operator.

On the container node (real kubelet, containerd, runc) the operator runs as the chart installs it
and the four reference servers run as containers of the same image, checkpoint storage on a
hostPath that outlives every pod. The story a user runs: the set becomes Ready, a trainer's
`rollout-collect --rollout-set` runs episodes, a manual checkpoint is taken while they run, the
model container's process is SIGKILLed inside the container (containerd's shim delivers it, as a
crash or the OOM killer would), the kubelet reports the container dead, the operator recovers the
set under attempt 2 from that checkpoint, and the collector finishes every episode exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from container_support import (
    condition,
    describe_pods,
    evict,
    get_json,
    kubectl_apply,
)
from testsupport.trainer import collected, start_collecting

from devcluster.image import ProjectImage
from devcluster.waiting import wait_for_sync
from harness.objects import example_checkpoint, example_set
from harness.providers import ContainerClusterProvider

pytestmark = pytest.mark.timeout(1200)

SET = "math-rl"
EPISODES = 48
CONCURRENCY = 8


def rollout_set(cluster: ContainerClusterProvider, namespace: str) -> dict[str, Any]:
    return get_json(cluster, "rolloutset", SET, "-n", namespace)


def set_is_ready(
    cluster: ContainerClusterProvider, namespace: str, attempt: int, latest: str | None = None
) -> bool:
    """The set Ready at `attempt` (and, when given, pointing at the `latest` checkpoint).

    The set's pass writes latestCheckpoint right after the recovery that runs in the same
    loop, so a reader that wants both waits for both.
    """
    obj = rollout_set(cluster, namespace)
    status = obj.get("status") or {}
    if latest is not None and status.get("latestCheckpoint") != latest:
        return False
    return status.get("attempt") == attempt and condition(obj, "Ready").get("status") == "True"


def test_the_example_set_runs_as_containers_and_recovers_a_killed_model_and_an_eviction(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    image_on_node: ProjectImage,
    storage: Path,
    tmp_path: Path,
) -> None:
    namespace = operator_release
    cluster = container_provider
    kubectl_apply(cluster, namespace, example_set(storage))
    try:
        wait_for_sync(
            lambda: set_is_ready(cluster, namespace, 1), 300, "the RolloutSet Ready at attempt 1"
        )
    except Exception:
        print(describe_pods(cluster, namespace))
        raise

    # Four containers of the image built here, one per role, run by containerd.
    pods = get_json(cluster, "pods", "-n", namespace, "-l", f"checkpoint.rollout.dev/set={SET}")
    roles = {}
    for pod in pods["items"]:
        [status] = pod["status"]["containerStatuses"]
        assert status["ready"] is True
        assert status["containerID"].startswith("containerd://")
        assert status["image"].endswith(image_on_node.short_name), status["image"]
        roles[pod["metadata"]["labels"]["checkpoint.rollout.dev/role"]] = pod["metadata"]["name"]
    assert sorted(roles) == ["agent", "environment", "model", "resources"]

    # A trainer follows the set through the API server and runs episodes.
    out = tmp_path / "episodes.jsonl"
    collect = start_collecting(
        cluster.kubeconfig, SET, namespace, out, tasks=EPISODES, concurrency=CONCURRENCY, seed=7
    )
    try:
        wait_for_sync(lambda: len(collected(out)) >= 1, 180, "the first finished episode")

        # A manual checkpoint while episodes run.
        kubectl_apply(cluster, namespace, example_checkpoint("math-rl-manual-1"))
        wait_for_sync(
            lambda: (
                condition(
                    get_json(cluster, "rolloutcheckpoint", "math-rl-manual-1", "-n", namespace),
                    "Ready",
                ).get("status")
                == "True"
            ),
            180,
            "the manual RolloutCheckpoint Ready",
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", "math-rl-manual-1", "-n", namespace)
        finished_before_kill = len(collected(out))
        assert finished_before_kill < EPISODES, "every episode finished before the kill"

        # SIGKILL inside the model container; the kubelet reports it, the operator recovers.
        cluster.kill_container(namespace, roles["model"])
        wait_for_sync(
            lambda: set_is_ready(cluster, namespace, 2, latest="math-rl-manual-1"),
            300,
            "the RolloutSet Ready at attempt 2 on math-rl-manual-1",
        )

        output, _ = collect.communicate(timeout=600)
        assert collect.returncode == 0, output[-4000:]
    finally:
        if collect.poll() is None:
            collect.kill()
            collect.wait()

    done = collected(out)
    ids = [item["rollout_id"] for item in done]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    # Episodes in flight at the kill went on under attempt 2, some from the checkpoint.
    assert {item["attempt"] for item in done} >= {2}, done
    if (ckpt["status"].get("episodes") or 0) > 0:
        assert any(item["continued"] for item in done), done
    # The pods of attempt 1 are gone.
    left = get_json(
        cluster,
        "pods",
        "-n",
        namespace,
        "-l",
        f"checkpoint.rollout.dev/set={SET},checkpoint.rollout.dev/attempt=1",
    )["items"]
    assert left == [], [pod["metadata"]["name"] for pod in left]

    evict_and_recover(cluster, namespace, roles["agent"].replace("-a1", "-a2"))


def evict_and_recover(cluster: ContainerClusterProvider, namespace: str, pod: str) -> None:
    """An eviction through the Eviction API: the kubelet delivers SIGTERM (the server turns
    unready, its control plane stays up), the eviction checkpoint completes before the pod's
    grace period ends, and the set recovers under attempt 3 from it."""
    evict(cluster, namespace, pod)
    terminating = get_json(cluster, "pod", pod, "-n", namespace)
    killed_at = terminating["metadata"]["deletionTimestamp"]
    assert terminating["metadata"]["deletionGracePeriodSeconds"] >= 3

    def unready_after_sigterm() -> bool:
        found = cluster.kubectl("get", "pod", pod, "-n", namespace, "-o", "json", check=False)
        if found.returncode != 0:
            return True  # gone: the kubelet stopped it (after SIGTERM, within the grace period)
        return condition(json.loads(found.stdout), "Ready").get("status") == "False"

    wait_for_sync(unready_after_sigterm, 60, f"pod {pod} to turn unready after SIGTERM")

    name = f"{SET}-evict-a2"
    wait_for_sync(
        lambda: (
            condition(get_json(cluster, "rolloutcheckpoint", name, "-n", namespace), "Ready").get(
                "status"
            )
            == "True"
        ),
        120,
        f"the eviction checkpoint {name} Ready",
    )
    ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
    assert ckpt["spec"]["trigger"] == "Eviction"
    ready_at = condition(ckpt, "Ready")["lastTransitionTime"]
    # RFC 3339 UTC timestamps of one format compare as strings.
    assert ready_at <= killed_at, (ready_at, killed_at)

    wait_for_sync(
        lambda: set_is_ready(cluster, namespace, 3, latest=name),
        300,
        f"the set Ready at attempt 3 on {name}",
    )
