"""What only several nodes show: the kind cluster of `make kind` (one control plane, two
workers, each worker with 4 `nvidia.com/gpu` a real kubelet allocates through the device
plugin), the operator installed by Helm, the example RolloutSet as containers of the image,
checkpoint records on a host folder every node mounts (docs/kind.md).

- A whole worker lost: the node container SIGKILLed (systemd, kubelet, containerd and every pod
  on it gone at once). The node controller marks it NotReady, the operator sees the set's pods
  on a NotReady node (NodeLost), the new attempt's pods are scheduled on the other worker,
  restored from the checkpoint's records on the shared folder, and the trainer finishes every
  episode exactly once.
- `kubectl drain` of the worker running the set: the participants' eviction turns them unready
  under SIGTERM, the eviction checkpoint is Ready before their grace period ends, the new
  attempt runs on the other worker (the drained one is cordoned) restored from it, and the
  trainer finishes every episode exactly once.
- GPUs a kubelet allocates: with one worker's 4 devices taken, the set's model lands on the
  other and holds that node's device ids in its environment; a set whose model asks for more
  devices than any node has is not Ready and says why (the scheduler's words, in its Ready
  condition).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.image import ProjectImage
from devcluster.waiting import wait_for_sync
from harness.helm import RELEASE, helm, helm_install_operator
from harness.objects import example_checkpoint, example_set
from harness.providers import PodmanKindProvider

pytestmark = pytest.mark.timeout(900)

SET = "math-rl"
EPISODES = 32
CONCURRENCY = 8
HOSTNAME = "kubernetes.io/hostname"


def get_json(cluster: PodmanKindProvider, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}


def collected(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def apply(cluster: PodmanKindProvider, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def preferring(obj: dict[str, Any], node: str) -> dict[str, Any]:
    """The set with every participant preferring `node` (only preferring: when it is lost, the
    scheduler places the next attempt elsewhere)."""
    for participant in obj["spec"]["participants"]:
        participant["template"]["spec"]["affinity"] = {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "preference": {
                            "matchExpressions": [
                                {"key": HOSTNAME, "operator": "In", "values": [node]}
                            ]
                        },
                    }
                ]
            }
        }
    return obj


def set_pods(cluster: PodmanKindProvider, namespace: str, attempt: int) -> dict[str, str]:
    """role -> node of the set's pods of `attempt`."""
    pods = get_json(
        cluster,
        "pods",
        "-n",
        namespace,
        "-l",
        f"checkpoint.rollout.dev/set={SET},checkpoint.rollout.dev/attempt={attempt}",
    )["items"]
    return {
        p["metadata"]["labels"]["checkpoint.rollout.dev/role"]: p["spec"].get("nodeName", "")
        for p in pods
    }


@pytest.fixture
def operator_on(
    kind_provider: PodmanKindProvider, kind_namespace: str, kind_image: ProjectImage
) -> Iterator[str]:
    """The operator installed by Helm into the test's namespace, pinned to the first worker
    (the chart's nodeSelector); yields that worker's name."""
    node = kind_provider.workers()[0]
    result = helm_install_operator(
        kind_provider, kind_namespace, kind_image, f"nodeSelector.kubernetes\\.io/hostname={node}"
    )
    assert result.returncode == 0, result.stderr
    try:
        yield node
    finally:
        diagnostics = kind_provider.kubectl(
            "logs",
            "-n",
            kind_namespace,
            "-l",
            "app.kubernetes.io/name=rollout-operator",
            "--tail=80",
            check=False,
        )
        print(diagnostics.stdout)
        kind_provider.kubectl(
            "delete",
            "rolloutset",
            "--all",
            "-n",
            kind_namespace,
            "--timeout=120s",
            check=False,
            timeout=150,
        )
        helm(kind_provider, "uninstall", RELEASE, "--namespace", kind_namespace)


@pytest.fixture
def lost_worker(kind_provider: PodmanKindProvider) -> Iterator[str]:
    """The second worker, started again after the test if it lost it (its routes set again,
    Ready before the next test) and uncordoned if it was drained."""
    node = kind_provider.workers()[1]
    yield node
    kind_provider.kubectl("uncordon", node)
    if node not in kind_provider.running_nodes():
        kind_provider.start_node(node)


def test_a_whole_worker_lost_moves_the_set_to_the_other_worker_from_shared_records(
    kind_provider: PodmanKindProvider,
    kind_namespace: str,
    operator_on: str,
    lost_worker: str,
    shared_storage: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    cluster, namespace = kind_provider, kind_namespace
    host_records, node_records = shared_storage
    apply(cluster, namespace, preferring(example_set(node_records), lost_worker))
    wait_for_sync(
        lambda: (
            condition(get_json(cluster, "rolloutset", SET, "-n", namespace), "Ready").get("status")
            == "True"
        ),
        300,
        "the RolloutSet Ready at attempt 1",
    )
    placed = set_pods(cluster, namespace, 1)
    assert sorted(placed) == ["agent", "environment", "model", "resources"]
    assert set(placed.values()) == {lost_worker}, placed

    out = tmp_path / "episodes.jsonl"
    collect = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rollout-collect"),
            "--rollout-set",
            SET,
            "--namespace",
            namespace,
            "--tasks",
            str(EPISODES),
            "--concurrency",
            str(CONCURRENCY),
            "--seed",
            "11",
            "--out",
            str(out),
            "--progress-interval",
            "2",
        ],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    recovering: list[dict[str, Any]] = []
    try:
        wait_for_sync(lambda: len(collected(out)) >= 1, 180, "the first finished episode")
        name = "before-worker-loss"
        apply(cluster, namespace, example_checkpoint(name))
        wait_for_sync(
            lambda: (
                condition(
                    get_json(cluster, "rolloutcheckpoint", name, "-n", namespace), "Ready"
                ).get("status")
                == "True"
            ),
            180,
            f"the RolloutCheckpoint {name} Ready",
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
        # The records are on the folder every node mounts, so on this machine too.
        assert any(host_records.rglob("*")), list(host_records.iterdir())
        assert len(collected(out)) < EPISODES, "every episode finished before the loss"

        cluster.kill_node(lost_worker)

        def recovered() -> bool:
            obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
            if condition(obj, "Recovering").get("status") == "True":
                recovering.append(obj)
            status = obj.get("status") or {}
            return (
                (status.get("attempt") or 1) > 1
                and condition(obj, "Ready").get("status") == "True"
                and status.get("latestCheckpoint") == name
            )

        wait_for_sync(recovered, 420, "the RolloutSet Ready under a new attempt from " + name)
        output, _ = collect.communicate(timeout=600)
        assert collect.returncode == 0, output[-4000:]
    finally:
        if collect.poll() is None:
            collect.kill()
            collect.wait()

    obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
    attempt = obj["status"]["attempt"]
    node = get_json(cluster, "node", lost_worker)
    assert condition(node, "Ready").get("status") != "True", "the lost worker is Ready"
    assert recovering, "the set was never seen Recovering"
    loss = recovering[0]["status"].get("recovery") or {}
    assert loss.get("reason") == "NodeLost", loss
    assert lost_worker in loss.get("message", ""), loss
    # Every participant of the new attempt runs on the surviving worker, the model with a GPU
    # the surviving kubelet allocated.
    now = set_pods(cluster, namespace, attempt)
    assert set(now.values()) == {operator_on}, now
    done = collected(out)
    ids = [item["rollout_id"] for item in done]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    if (ckpt["status"].get("episodes") or 0) > 0:  # episodes were in flight at the eviction
        assert any(item["continued"] for item in done), done
    assert {item["attempt"] for item in done} >= {attempt}, done


def start_collecting(
    cluster: PodmanKindProvider, namespace: str, out: Path
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rollout-collect"),
            "--rollout-set",
            SET,
            "--namespace",
            namespace,
            "--tasks",
            str(EPISODES),
            "--concurrency",
            str(CONCURRENCY),
            "--seed",
            "13",
            "--out",
            str(out),
            "--progress-interval",
            "2",
        ],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def set_ready(cluster: PodmanKindProvider, namespace: str) -> bool:
    obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
    return condition(obj, "Ready").get("status") == "True"


def test_a_drained_worker_checkpoints_its_set_before_the_pods_go_and_the_set_moves(
    kind_provider: PodmanKindProvider,
    kind_namespace: str,
    operator_on: str,
    lost_worker: str,
    shared_storage: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    cluster, namespace = kind_provider, kind_namespace
    _, node_records = shared_storage
    apply(cluster, namespace, preferring(example_set(node_records), lost_worker))
    wait_for_sync(lambda: set_ready(cluster, namespace), 300, "the RolloutSet Ready")
    assert set(set_pods(cluster, namespace, 1).values()) == {lost_worker}

    out = tmp_path / "episodes.jsonl"
    collect = start_collecting(cluster, namespace, out)
    drain: subprocess.Popen[str] | None = None
    try:
        wait_for_sync(lambda: len(collected(out)) >= 1, 180, "the first finished episode")
        drain = subprocess.Popen(
            [
                cluster.kubectl_binary,
                f"--kubeconfig={cluster.kubeconfig}",
                "drain",
                lost_worker,
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--timeout=240s",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        name = f"{SET}-evict-a1"
        wait_for_sync(
            lambda: (
                condition(
                    json.loads(
                        cluster.kubectl(
                            "get",
                            "rolloutcheckpoint",
                            name,
                            "-n",
                            namespace,
                            "-o",
                            "json",
                            check=False,
                        ).stdout
                        or "{}"
                    ),
                    "Ready",
                ).get("status")
                == "True"
            ),
            180,
            f"the eviction checkpoint {name} Ready",
        )
        ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)

        def moved() -> bool:
            obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
            status = obj.get("status") or {}
            return (
                (status.get("attempt") or 1) > 1
                and condition(obj, "Ready").get("status") == "True"
                and status.get("latestCheckpoint") == name
            )

        wait_for_sync(moved, 300, f"the RolloutSet Ready under a new attempt from {name}")
        drained, _ = drain.communicate(timeout=300)
        assert drain.returncode == 0, drained
        output, _ = collect.communicate(timeout=600)
        assert collect.returncode == 0, output[-4000:]
    finally:
        for process in (collect, drain):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    # The eviction checkpoint was taken from the drained pods while their grace period ran
    # (they were evicted, not lost: no NodeLost recovery), and the new attempt runs whole on
    # the other worker.
    assert ckpt["status"].get("phase") == "Ready", ckpt["status"]
    attempt = get_json(cluster, "rolloutset", SET, "-n", namespace)["status"]["attempt"]
    assert set(set_pods(cluster, namespace, attempt).values()) == {operator_on}
    done = collected(out)
    ids = [item["rollout_id"] for item in done]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    if (ckpt["status"].get("episodes") or 0) > 0:  # episodes were in flight at the eviction
        assert any(item["continued"] for item in done), done


def test_model_pods_land_where_devices_are_free_and_a_set_asking_too_many_says_so(
    kind_provider: PodmanKindProvider,
    kind_namespace: str,
    operator_on: str,
    lost_worker: str,
    shared_storage: tuple[Path, Path],
) -> None:
    cluster, namespace = kind_provider, kind_namespace
    _, node_records = shared_storage
    # Every device of the operator's worker taken by a pod of its own.
    holder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpu-holder"},
        "spec": {
            "nodeSelector": {HOSTNAME: operator_on},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "hold",
                    "image": "rollout-checkpoint-operator:dev",
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "3600"],
                    "resources": {"limits": {"nvidia.com/gpu": 4}},
                }
            ],
        },
    }
    apply(cluster, namespace, holder)
    cluster.kubectl(
        "wait",
        "--for=condition=Ready",
        "pod/gpu-holder",
        "-n",
        namespace,
        "--timeout=120s",
        timeout=150,
    )
    # The set prefers the full worker; its model can only go where devices are free.
    apply(cluster, namespace, preferring(example_set(node_records), operator_on))
    wait_for_sync(lambda: set_ready(cluster, namespace), 300, "the RolloutSet Ready")
    placed = set_pods(cluster, namespace, 1)
    assert placed["model"] == lost_worker, placed
    visible = cluster.kubectl(
        "exec", "-n", namespace, "math-rl-model-0-a1", "--", "printenv", "NVIDIA_VISIBLE_DEVICES"
    ).stdout.strip()
    assert visible.startswith(f"{lost_worker}-gpu"), visible
    assert "," not in visible, visible

    # A second set whose model asks for more devices than any node has.
    greedy = example_set(node_records, name="too-many-gpus")
    for participant in greedy["spec"]["participants"]:
        if participant["role"] == "model":
            limits = participant["template"]["spec"]["containers"][0]["resources"]["limits"]
            limits["nvidia.com/gpu"] = 5
    apply(cluster, namespace, greedy)

    def says_why() -> bool:
        obj = get_json(cluster, "rolloutset", "too-many-gpus", "-n", namespace)
        ready = condition(obj, "Ready")
        return ready.get("status") == "False" and "nvidia.com/gpu" in ready.get("message", "")

    wait_for_sync(says_why, 120, "the greedy set not Ready, naming nvidia.com/gpu")
    ready = condition(get_json(cluster, "rolloutset", "too-many-gpus", "-n", namespace), "Ready")
    assert "Insufficient nvidia.com/gpu" in ready["message"], ready
    assert "too-many-gpus-model-0-a1" in ready["message"], ready
