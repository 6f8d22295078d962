"""What only several nodes show: the kind cluster of `make kind` (one control plane, three
workers, each worker with 4 `nvidia.com/gpu` a real kubelet allocates through the device
plugin), the operator installed by Helm, the example RolloutSet as containers of the image,
checkpoint records on a host folder every node mounts, or in an S3-API bucket (docs/kind.md).

Each scenario runs on two workers (`worker_pair`: the one it loses, drains or fills, and the one
that stays); the set and the operator may run only on those two (a required node affinity), so
"the other worker" is one node whichever others are up. A worker a scenario killed stays down
for the next scenarios, which take the workers still up (docs/kind.md, "The multi-node suite").

- A whole worker lost: the node container SIGKILLed (systemd, kubelet, containerd and every pod
  on it gone at once). The node controller marks it NotReady, the operator sees the set's pods
  on a NotReady node (NodeLost), the new attempt's pods are scheduled on the other worker,
  restored from the checkpoint's records on the shared folder, and the trainer finishes every
  episode exactly once.
- `kubectl drain` of the worker running the set: the participants' eviction turns them unready
  under SIGTERM, the eviction checkpoint is Ready before their grace period ends, the new
  attempt runs on the other worker (the drained one is cordoned) restored from it, and the
  trainer finishes every episode exactly once.
- The operator's own worker lost while a checkpoint prepares (held there by an episode inside
  the agent's tool call) and the set runs on the other worker: the operator's pod is evicted
  from the NotReady node, its successor starts on the surviving worker, takes the leader Lease
  and carries the checkpoint on; once the tool call is let go the checkpoint ends (Ready) and
  every episode finishes exactly once.
- A whole worker lost with the set's records in a bucket only (versitygw inside the cluster's
  network namespace, no folder shared between nodes): the new attempt on the other worker is
  restored from the checkpoint the pods wrote to the bucket, and an episode held mid-run across
  the checkpoint and the loss continues from it there (not started fresh), every episode once.
- Records on storage only the lost worker had (a node-local hostPath): the recovery on the other
  worker finds the checkpoint's records missing there, marks the checkpoint Ready=False and
  starts the set fresh under a new attempt instead of waiting for the node, and the trainer
  still finishes every episode exactly once (the lost turns are run again).
- GPUs a kubelet allocates: with one worker's 4 devices taken, the set's model lands on the
  other and holds that node's device ids in its environment; a set whose model asks for more
  devices than any node has is not Ready and says why (the scheduler's words, in its Ready
  condition).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import httpx
import obstore
import pytest
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from rollout_servers.tasks import Task
from testsupport.operator_fixtures import (
    HOLD_IN_TOOL_ARGS,
    Debug,
    participants_by_role,
    phases,
    wait_phase,
)
from testsupport.s3_server import S3Bucket, requests_logged
from testsupport.trainer import collected, start_collecting, stop

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
HELD_EPISODES = 4
GPU = "nvidia.com/gpu"


class WorkerPair(NamedTuple):
    """The two workers of one scenario: the set or the operator moves from `loses` (the worker
    the scenario kills, drains or fills) to `stays`."""

    stays: str
    loses: str


def has_devices(provider: PodmanKindProvider, node: str) -> bool:
    """Whether the node's kubelet advertises `nvidia.com/gpu` as allocatable (none after a
    kubelet restart until the device plugin has registered again)."""
    found = json.loads(provider.kubectl("get", "node", node, "-o", "json").stdout)
    return int((found["status"].get("allocatable") or {}).get(GPU, "0")) > 0


def ready_since(provider: PodmanKindProvider) -> dict[str, str]:
    """node -> when it last turned Ready, for the nodes Ready now."""
    listed = json.loads(provider.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    found = {}
    for node in listed:
        for item in node["status"].get("conditions") or []:
            if item["type"] == "Ready" and item["status"] == "True":
                found[node["metadata"]["name"]] = item["lastTransitionTime"]
    return found


@pytest.fixture
def worker_pair(kind_provider: PodmanKindProvider) -> Iterator[WorkerPair]:
    """The first two workers that are up (in the API server's order), a lost one started again
    only when fewer than two are; both advertising their GPUs. Afterwards `loses` is uncordoned
    (a drain cordons it); a worker the scenario killed is left down for the next to skip.

    Afterwards, too: every node whose container ran throughout stayed Ready. The kubelets renew
    their Lease every 4 s and a node is lost after 12 s without one (docs/kind.md, "A lost node:
    heartbeats and grace"); a node that turned NotReady while it ran means that margin does not
    hold on this machine's load, and the scenario's placement assumptions with it."""
    running = set(kind_provider.running_nodes())
    workers = kind_provider.workers()
    up = [node for node in workers if node in running]
    for node in workers:
        if len(up) >= 2:
            break
        if node not in up:
            kind_provider.start_node(node)
            up.append(node)
    assert len(up) >= 2, f"the suite needs two workers, the cluster has {workers}"
    pair = WorkerPair(stays=up[0], loses=up[1])
    for node in pair:
        advertising = partial(has_devices, kind_provider, node)
        wait_for_sync(advertising, 120, f"{node} advertising its {GPU}")
    before = ready_since(kind_provider)
    yield pair
    kind_provider.kubectl("uncordon", pair.loses)
    still_running, after = set(kind_provider.running_nodes()), ready_since(kind_provider)
    flapped = [
        node for node, since in before.items() if node in still_running and after.get(node) != since
    ]
    assert not flapped, f"nodes that ran throughout turned NotReady during the scenario: {flapped}"


def get_json(cluster: PodmanKindProvider, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}


def apply(cluster: PodmanKindProvider, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def preferring(obj: dict[str, Any], node: str, pair: WorkerPair) -> dict[str, Any]:
    """The set with every participant preferring `node` of the scenario's two workers and allowed
    on those two only (required): when `node` is lost, drained or full, the scheduler places the
    pods on the other one, whichever other workers are up."""
    for participant in obj["spec"]["participants"]:
        participant["template"]["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": HOSTNAME, "operator": "In", "values": list(pair)}
                            ]
                        }
                    ]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "preference": {
                            "matchExpressions": [
                                {"key": HOSTNAME, "operator": "In", "values": [node]}
                            ]
                        },
                    }
                ],
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


class Scene(NamedTuple):
    """One scenario: the cluster, its namespace, its two workers and the shared folder for the
    set's records (on this machine, and where every node mounts it)."""

    cluster: PodmanKindProvider
    namespace: str
    workers: WorkerPair
    host_records: Path
    node_records: Path


@pytest.fixture
def scene(
    kind_provider: PodmanKindProvider,
    kind_namespace: str,
    worker_pair: WorkerPair,
    shared_storage: tuple[Path, Path],
) -> Scene:
    return Scene(kind_provider, kind_namespace, worker_pair, *shared_storage)


@pytest.fixture
def operator_scene(scene: Scene, kind_image: ProjectImage) -> Iterator[Scene]:
    """The scene with the operator installed by Helm into its namespace, pinned to the worker
    that stays (the chart's nodeSelector)."""
    node = scene.workers.stays
    result = helm_install_operator(
        scene.cluster, scene.namespace, kind_image, f"nodeSelector.kubernetes\\.io/hostname={node}"
    )
    assert result.returncode == 0, result.stderr
    try:
        yield scene
    finally:
        remove_operator(scene.cluster, scene.namespace, tail=80)


def remove_operator(cluster: PodmanKindProvider, namespace: str, *, tail: int) -> None:
    """The operator's last `tail` log lines printed (what it did, for a failure's report), the
    namespace's sets deleted while it still runs (their finalizers), then its release removed."""
    logs = cluster.kubectl(
        *("logs", "-n", namespace, "-l", "app.kubernetes.io/name=rollout-operator"),
        f"--tail={tail}",
        check=False,
    )
    print(logs.stdout)
    cluster.kubectl(
        *("delete", "rolloutset", "--all", "-n", namespace, "--timeout=120s"),
        check=False,
        timeout=150,
    )
    helm(cluster, "uninstall", RELEASE, "--namespace", namespace)


def recovered_from(
    cluster: PodmanKindProvider, namespace: str, name: str, recovering: list[dict[str, Any]]
) -> Callable[[], bool]:
    """Whether the set is Ready under a new attempt restored from checkpoint `name`; each look
    that finds it Recovering is kept in `recovering`."""

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

    return recovered


def set_running_on_the_lost_worker(scene: Scene, rollout_set: dict[str, Any]) -> None:
    """The set (the example set, its storage where the scenario puts its records) Ready at
    attempt 1, every participant on the worker the scenario will lose or drain."""
    cluster, namespace, lost_worker = scene.cluster, scene.namespace, scene.workers.loses
    apply(cluster, namespace, preferring(rollout_set, lost_worker, scene.workers))
    wait_for_sync(lambda: set_ready(cluster, namespace), 300, "the RolloutSet Ready at attempt 1")
    placed = set_pods(cluster, namespace, 1)
    assert sorted(placed) == ["agent", "environment", "model", "resources"]
    assert set(placed.values()) == {lost_worker}, placed


@contextmanager
def collecting(scene: Scene, out: Path, *, seed: int = 13) -> Iterator[subprocess.Popen[str]]:
    """A trainer's `rollout-collect` of EPISODES tasks from the set (results to `out`), yielded
    once its first episode has finished; killed on the way out if it still runs."""
    collect = start_collecting(
        scene.cluster.kubeconfig,
        SET,
        scene.namespace,
        out,
        tasks=EPISODES,
        concurrency=CONCURRENCY,
        seed=seed,
    )
    try:
        wait_for_sync(lambda: len(collected(out)) >= 1, 180, "the first finished episode")
        yield collect
    finally:
        stop(collect)


def checkpoint_taken(scene: Scene, name: str) -> None:
    """A manual RolloutCheckpoint `name` applied and Ready."""
    cluster, namespace = scene.cluster, scene.namespace
    apply(cluster, namespace, example_checkpoint(name))
    wait_for_sync(
        lambda: (
            condition(get_json(cluster, "rolloutcheckpoint", name, "-n", namespace), "Ready").get(
                "status"
            )
            == "True"
        ),
        180,
        f"the RolloutCheckpoint {name} Ready",
    )


def test_a_whole_worker_lost_moves_the_set_to_the_other_worker_from_shared_records(
    operator_scene: Scene, tmp_path: Path
) -> None:
    cluster, namespace = operator_scene.cluster, operator_scene.namespace
    operator_on, lost_worker = operator_scene.workers
    host_records = operator_scene.host_records
    set_running_on_the_lost_worker(operator_scene, example_set(operator_scene.node_records))

    out = tmp_path / "episodes.jsonl"
    recovering: list[dict[str, Any]] = []
    with collecting(operator_scene, out, seed=11) as collect:
        name = "before-worker-loss"
        checkpoint_taken(operator_scene, name)
        # The records are on the folder every node mounts, so on this machine too.
        assert any(host_records.rglob("*")), list(host_records.iterdir())
        assert len(collected(out)) < EPISODES, "every episode finished before the loss"

        cluster.kill_node(lost_worker)

        recovered = recovered_from(cluster, namespace, name, recovering)
        wait_for_sync(recovered, 420, "the RolloutSet Ready under a new attempt from " + name)
        output, _ = collect.communicate(timeout=600)
        assert collect.returncode == 0, output[-4000:]

    obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
    attempt = obj["status"]["attempt"]
    node = get_json(cluster, "node", lost_worker)
    # where the time went (docs/kind.md, "Measured"): when the node turned NotReady, and the
    # recovery's own phases
    print("lost worker Ready:", json.dumps(condition(node, "Ready")))
    print("lastRecovery:", json.dumps(obj["status"].get("lastRecovery")))
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
    # Restored from that checkpoint (whether any of its episodes is still unfinished at the kill,
    # and so continues under the new attempt, depends on timing: they resume after the commit).
    restored = condition(obj, "Recovering")
    assert restored.get("reason") == "Restored", restored
    assert f"restored checkpoint {name}" in restored.get("message", ""), restored
    assert {item["attempt"] for item in done} >= {attempt}, done


def set_ready(cluster: PodmanKindProvider, namespace: str) -> bool:
    obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
    return condition(obj, "Ready").get("status") == "True"


def test_a_drained_worker_checkpoints_its_set_before_the_pods_go_and_the_set_moves(
    operator_scene: Scene, tmp_path: Path
) -> None:
    cluster, namespace = operator_scene.cluster, operator_scene.namespace
    operator_on, lost_worker = operator_scene.workers
    set_running_on_the_lost_worker(operator_scene, example_set(operator_scene.node_records))

    out = tmp_path / "episodes.jsonl"
    with collecting(operator_scene, out) as collect:
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
        try:
            name = f"{SET}-evict-a1"
            killed_at: list[str] = []

            def evict_checkpoint_ready() -> bool:
                # When the evicted model pod is to be killed: its deletionTimestamp (the eviction's
                # time plus the grace period), read while it terminates.
                pod = cluster.kubectl(
                    "get", "pod", "math-rl-model-0-a1", "-n", namespace, "-o", "json", check=False
                )
                if pod.returncode == 0 and not killed_at:
                    stamp = json.loads(pod.stdout)["metadata"].get("deletionTimestamp")
                    killed_at.extend([stamp] if stamp else [])
                found = cluster.kubectl(
                    "get", "rolloutcheckpoint", name, "-n", namespace, "-o", "json", check=False
                )
                ready = condition(json.loads(found.stdout or "{}"), "Ready").get("status")
                return ready == "True" and bool(killed_at)

            wait_for_sync(evict_checkpoint_ready, 180, f"the eviction checkpoint {name} Ready")
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
            stop(drain)

    # The eviction checkpoint was taken from the drained pods while their grace period ran
    # (they were evicted, not lost: no NodeLost recovery), and the new attempt runs whole on
    # the other worker.
    assert ckpt["status"].get("phase") == "Ready", ckpt["status"]
    assert ckpt["spec"]["trigger"] == "Eviction", ckpt["spec"]
    ready_at = condition(ckpt, "Ready")["lastTransitionTime"]
    assert ready_at <= killed_at[0], (ready_at, killed_at)  # RFC 3339 UTC strings compare
    attempt = get_json(cluster, "rolloutset", SET, "-n", namespace)["status"]["attempt"]
    assert set(set_pods(cluster, namespace, attempt).values()) == {operator_on}
    done = collected(out)
    ids = [item["rollout_id"] for item in done]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    # (The eviction checkpoint's episodes may finish on the drained pods during their grace
    # period, so whether any continues under the new attempt depends on timing.)


def test_model_pods_land_where_devices_are_free_and_a_set_asking_too_many_says_so(
    operator_scene: Scene,
) -> None:
    cluster, namespace = operator_scene.cluster, operator_scene.namespace
    operator_on, lost_worker = operator_scene.workers
    node_records = operator_scene.node_records
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
    apply(
        cluster,
        namespace,
        preferring(example_set(node_records), operator_on, operator_scene.workers),
    )
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


def operator_pods(cluster: PodmanKindProvider, namespace: str) -> list[dict[str, Any]]:
    listed = get_json(
        cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/name=rollout-operator"
    )
    return list(listed["items"])


def preferring_values(node: str, pair: WorkerPair) -> list[str]:
    """Helm values: the operator prefers `node` of the scenario's two workers and may run on
    those two only (so its successor goes to the other one), and leaves a NotReady or
    unreachable node 5 s after it is tainted (the admission default is 300 s), so its successor
    starts soon."""
    term = "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
    values = [
        f"{term}.weight=100",
        f"{term}.preference.matchExpressions[0].key={HOSTNAME}",
        f"{term}.preference.matchExpressions[0].operator=In",
        f"{term}.preference.matchExpressions[0].values[0]={node}",
    ]
    required = "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    allowed = f"{required}.nodeSelectorTerms[0].matchExpressions[0]"
    values += [f"{allowed}.key={HOSTNAME}", f"{allowed}.operator=In"]
    values += [f"{allowed}.values[{index}]={worker}" for index, worker in enumerate(pair)]
    for index, key in enumerate(("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")):
        values += [
            f"tolerations[{index}].key={key}",
            f"tolerations[{index}].operator=Exists",
            f"tolerations[{index}].effect=NoExecute",
            f"tolerations[{index}].tolerationSeconds=5",
        ]
    return values


async def test_the_operators_worker_lost_while_a_checkpoint_prepares_its_successor_ends_it(
    scene: Scene, kind_image: ProjectImage
) -> None:
    cluster, namespace, node_records = scene.cluster, scene.namespace, scene.node_records
    set_worker, lost_worker = scene.workers
    installed = helm_install_operator(
        cluster, namespace, kind_image, *preferring_values(lost_worker, scene.workers)
    )
    assert installed.returncode == 0, installed.stderr
    try:
        [before] = operator_pods(cluster, namespace)
        assert before["spec"]["nodeName"] == lost_worker
        apply(
            cluster,
            namespace,
            preferring(
                example_set(node_records, extra_args=HOLD_IN_TOOL_ARGS), set_worker, scene.workers
            ),
        )
        await anyio.to_thread.run_sync(
            lambda: wait_for_sync(lambda: set_ready(cluster, namespace), 300, "the set Ready")
        )
        rset = get_json(cluster, "rolloutset", SET, "-n", namespace)
        assert set(set_pods(cluster, namespace, 1).values()) == {set_worker}
        agent = participants_by_role(rset)["agent"][0]["address"]
        specs = episode_specs(HELD_EPISODES, 41, prefix="opnode")
        outcomes: list[EpisodeResult | EpisodeFailed] = []
        async with (
            httpx.AsyncClient() as http,
            rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
            anyio.create_task_group() as group,
        ):
            hooks = Debug(http, agent)
            await hooks.arm("tool", specs[0].rollout_id)
            client = RolloutClient(
                topology, concurrency=HELD_EPISODES, restore_timeout_s=180, run_timeout_s=600
            )

            async def run() -> None:
                outcomes.extend(await client.run_all(specs))

            group.start_soon(run)
            await hooks.paused("tool", specs[0].rollout_id, limit_s=120)
            name = "during-operator-loss"
            apply(cluster, namespace, example_checkpoint(name))
            await wait_phase(http, agent, "preparing", "the agent to be preparing", limit_s=60)

            def preparing_written() -> bool:
                found = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
                return (found.get("status") or {}).get("phase") == "Preparing"

            # The operator writes Preparing once the phase has lasted a second (docs/design.md,
            # "Phases written late"); the worker is lost after the API shows it.
            await anyio.to_thread.run_sync(
                lambda: wait_for_sync(preparing_written, 60, f"{name} Preparing written")
            )
            cluster.kill_node(lost_worker)

            def successor_ready() -> bool:
                return any(
                    p["metadata"]["name"] != before["metadata"]["name"]
                    and p["spec"].get("nodeName") == set_worker
                    and condition(p, "Ready").get("status") == "True"
                    for p in operator_pods(cluster, namespace)
                )

            await anyio.to_thread.run_sync(
                lambda: wait_for_sync(
                    successor_ready, 240, f"a new operator pod Ready on {set_worker}"
                )
            )
            phase = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)["status"]
            assert phase.get("phase") == "Preparing", phase  # a lost operator is not an abort

            assert await hooks.release("tool", specs[0].rollout_id) == 1

            def ended() -> bool:
                status = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)["status"]
                return status.get("phase") in ("Ready", "Failed")

            await anyio.to_thread.run_sync(
                lambda: wait_for_sync(ended, 180, f"{name} Ready or Failed under the successor")
            )
            ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
            assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
            assert set((await phases(http, rset)).values()) == {"idle"}
        failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
        assert not failed, failed
        ids = [o.rollout_id for o in outcomes]
        assert sorted(ids) == sorted(s.rollout_id for s in specs), ids
    finally:
        remove_operator(cluster, namespace, tail=60)


def test_records_only_the_lost_worker_had_are_given_up_and_the_set_starts_fresh(
    operator_scene: Scene, tmp_path: Path
) -> None:
    cluster, namespace = operator_scene.cluster, operator_scene.namespace
    operator_on, lost_worker = operator_scene.workers
    # A folder of each node's own /var (the node container's volume): what one node writes
    # there, no other node sees.
    node_local = Path("/var/lib/rollout-node-records") / namespace
    cluster.make_writable_folder(node_local)
    set_running_on_the_lost_worker(operator_scene, example_set(node_local))

    out = tmp_path / "episodes.jsonl"
    name = "local-only"
    with collecting(operator_scene, out) as collect:
        checkpoint_taken(operator_scene, name)
        cluster.kill_node(lost_worker)

        def recovered() -> bool:
            obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
            status = obj.get("status") or {}
            return (status.get("attempt") or 1) > 1 and condition(obj, "Ready").get(
                "status"
            ) == "True"

        wait_for_sync(recovered, 420, "the RolloutSet Ready again under a new attempt")
        output, _ = collect.communicate(timeout=600)
        assert collect.returncode == 0, output[-4000:]

    events = get_json(cluster, "events", "-n", namespace)["items"]
    said = [(e.get("reason"), e.get("message", "")) for e in events]
    print("\n".join(f"{reason}: {message}" for reason, message in said))
    ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
    ready = condition(ckpt, "Ready")
    assert ready.get("status") == "False", (ckpt["status"], said)
    assert ready.get("reason") == "RecordsUnreachable", ready
    assert ckpt["status"].get("phase") == "Failed", ckpt["status"]
    unreachable = [m for reason, m in said if reason == "CheckpointUnreachable"]
    assert any(name in message and "unreachable" in message for message in unreachable), said
    obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
    attempt = obj["status"]["attempt"]
    print(
        "lost worker Ready:", json.dumps(condition(get_json(cluster, "node", lost_worker), "Ready"))
    )
    print("lastRecovery:", json.dumps(obj["status"].get("lastRecovery")))
    assert condition(obj, "Recovering").get("reason") == "NoCheckpoint", obj["status"]
    assert set(set_pods(cluster, namespace, attempt).values()) == {operator_on}
    done = collected(out)
    ids = [item["rollout_id"] for item in done]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    assert not any(item["continued"] for item in done if item["attempt"] == attempt), done


BUCKET_PREFIX = "kind/records"


def pod_ips(cluster: PodmanKindProvider, namespace: str, attempt: int) -> set[str]:
    """The addresses of the set's pods of `attempt`."""
    pods = get_json(
        cluster,
        "pods",
        "-n",
        namespace,
        "-l",
        f"checkpoint.rollout.dev/set={SET},checkpoint.rollout.dev/attempt={attempt}",
    )["items"]
    return {p["status"]["podIP"] for p in pods if p["status"].get("podIP")}


def bucket_keys(bucket: S3Bucket, below: str) -> list[str]:
    """Every key of the bucket below `below` (listed from this machine, through the link)."""
    return sorted(meta["path"] for batch in obstore.list(bucket.store(), below) for meta in batch)


def bucket_records(bucket: S3Bucket, below: str) -> dict[str, dict[str, Any]]:
    """rollout id -> its record (`data`: the session's step and state) in the one records file
    below `below` (one participant instance's folder of a checkpoint)."""
    [records] = [
        key for key in bucket_keys(bucket, below) if key.rsplit("/", 1)[-1].startswith("records-")
    ]
    lines = bytes(obstore.get(bucket.store(), records).bytes()).decode().splitlines()
    return {
        entry["rollout_id"]: entry["data"]
        for entry in (json.loads(line) for line in lines if line.strip())
    }


async def test_a_whole_worker_lost_restores_the_set_on_the_other_worker_from_a_bucket(
    kind_bucket: tuple[S3Bucket, str], operator_scene: Scene, tmp_path: Path
) -> None:
    # `kind_bucket` first: set up before the operator, so it is removed after it (the set is
    # deleted while the operator runs, and its keys removed from the bucket, before the bucket).
    cluster, namespace = operator_scene.cluster, operator_scene.namespace
    operator_on, lost_worker = operator_scene.workers
    bucket, secret = kind_bucket
    # The set's records only in the bucket: no volume, no folder any two nodes share. The agent
    # serves its debug hooks, so one episode can be held between two turns.
    rollout_set = example_set(operator_scene.node_records, extra_args={"agent": ["--debug-hooks"]})
    rollout_set["spec"]["storage"] = {
        "s3": {
            "endpoint": bucket.endpoint,
            "bucket": bucket.name,
            "prefix": BUCKET_PREFIX,
            "region": bucket.server.region,
            "addressingStyle": "path",
            "secretName": secret,
        }
    }
    await anyio.to_thread.run_sync(set_running_on_the_lost_worker, operator_scene, rollout_set)
    rset = get_json(cluster, "rolloutset", SET, "-n", namespace)
    set_keys = f"{BUCKET_PREFIX}/{namespace}/{SET}/{rset['metadata']['uid']}/"
    agent = participants_by_role(rset)["agent"][0]["address"]
    # The S3 server sees the pods' own addresses (kind/up.sh's pod network does not masquerade).
    first_pods = pod_ips(cluster, namespace, 1)

    # One episode of the trainer's first wave (rollout-collect's ids: `episode_specs`) whose
    # task takes the calculator, so it has a second turn: held at the boundary before that turn
    # (a boundary: it does not hold the checkpoint up), it is mid-run when the checkpoint is
    # taken and still unfinished when the worker is lost.
    seed = 17
    specs = episode_specs(EPISODES, seed)
    held = next(
        spec.rollout_id
        for spec in specs[:CONCURRENCY]
        if isinstance(spec.task, Task) and spec.task.steps
    )
    out = tmp_path / "episodes.jsonl"
    name = "before-worker-loss-bucket"
    recovering: list[dict[str, Any]] = []
    async with httpx.AsyncClient() as http:
        hooks = Debug(http, agent)
        await hooks.arm("turn", held, index=1)
        with collecting(operator_scene, out, seed=seed) as collect:
            await hooks.paused("turn", held, limit_s=120)
            await anyio.to_thread.run_sync(checkpoint_taken, operator_scene, name)
            assert held not in {item["rollout_id"] for item in collected(out)}
            assert len(collected(out)) < EPISODES, "every episode finished before the loss"

            # The checkpoint is in the bucket (the pods on the lost worker wrote it there), the
            # held session in it at its second turn.
            stored = bucket_keys(bucket, f"{set_keys}{name}/")
            for instance in ("agent-0", "environment-0", "model-0", "resources-0"):
                assert f"{set_keys}{name}/{instance}/manifest.json" in stored, stored
            at_checkpoint = bucket_records(bucket, f"{set_keys}{name}/agent-0/")[held]
            assert (at_checkpoint["step"], at_checkpoint["state"]["turn"]) == ("model", 1)

            cluster.kill_node(lost_worker)

            recovered = recovered_from(cluster, namespace, name, recovering)
            await anyio.to_thread.run_sync(
                lambda: wait_for_sync(
                    recovered, 420, f"the RolloutSet Ready under a new attempt from {name}"
                )
            )
            output, _ = await anyio.to_thread.run_sync(lambda: collect.communicate(timeout=600))
            assert collect.returncode == 0, output[-4000:]

    obj = get_json(cluster, "rolloutset", SET, "-n", namespace)
    attempt = obj["status"]["attempt"]
    restored = condition(obj, "Recovering")
    print(
        "lost worker Ready:", json.dumps(condition(get_json(cluster, "node", lost_worker), "Ready"))
    )
    print("lastRecovery:", json.dumps(obj["status"].get("lastRecovery")))
    print("Recovering:", json.dumps(restored))
    # The loss was seen as a lost node, and the new attempt runs whole on the surviving worker,
    # restored from the checkpoint in the bucket, which is still Ready (its records reachable
    # from there: contrast the records scenario, where they are not).
    assert recovering, "the set was never seen Recovering"
    loss = recovering[0]["status"].get("recovery") or {}
    assert loss.get("reason") == "NodeLost", loss
    assert lost_worker in loss.get("message", ""), loss
    assert set(set_pods(cluster, namespace, attempt).values()) == {operator_on}
    assert restored.get("reason") == "Restored", restored
    assert f"restored checkpoint {name}" in restored.get("message", ""), restored
    ckpt = get_json(cluster, "rolloutcheckpoint", name, "-n", namespace)
    assert ckpt["status"].get("phase") == "Ready", ckpt["status"]
    # Every episode exactly once; the held one (and any other the checkpoint had mid-run that
    # had not finished at the loss) continued under the new attempt from what the checkpoint
    # recorded, not started fresh.
    done = collected(out)
    ids = [item["rollout_id"] for item in done]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    [held_result] = [item for item in done if item["rollout_id"] == held]
    print("held episode:", json.dumps(held_result))
    assert held_result["attempt"] == attempt, held_result
    assert held_result["continued"], held_result
    continued = [item for item in done if item["continued"]]
    assert all(item["attempt"] == attempt for item in continued), continued

    # The pods reached the bucket themselves, through the cluster's network: the checkpoint was
    # written by the four pods on the lost worker, and read back, for the restore, by each of
    # the new attempt's four on the surviving one.
    assert bucket.server.access_log is not None
    logged = [
        r
        for r in requests_logged(bucket.server.access_log)
        if r.bucket == bucket.name and r.key.startswith(f"{set_keys}{name}/")
    ]
    seen: dict[str, dict[str, int]] = {}
    for r in logged:
        seen.setdefault(r.operation, {}).setdefault(r.remote, 0)
        seen[r.operation][r.remote] += 1
    print("bucket requests for the checkpoint (operation: caller: count):", json.dumps(seen))
    restoring_pods = pod_ips(cluster, namespace, attempt)
    puts = {r.remote for r in logged if r.operation == "s3_PutObject"}
    gets = {r.remote for r in logged if r.operation == "s3_GetObject" and r.status == 200}
    assert len(first_pods) == len(restoring_pods) == 4, (first_pods, restoring_pods)
    assert puts == first_pods, (puts, first_pods)
    assert restoring_pods <= gets, (gets, restoring_pods)
