"""Servers with several worker processes on devcluster (docs/protocol.md, "Workers").

- A set whose environment and agent each run 3 worker processes (`rollout-server --workers 3`)
  is checkpointed while `rollout-collect --rollout-set` runs episodes against it, loses its
  environment pod (SIGKILL), recovers under attempt 2, and every episode finishes exactly once
  with nothing completed before the checkpoint run again (`check_recovered_run`, as for
  single-process servers).
- A set whose environment runs `uvicorn --workers 2` without the SDK's coordination says
  `multi_process: unmanaged`: the operator refuses its checkpoint (Ready=False,
  UnmanagedWorkers) and `kubectl describe` shows the Event naming the pod.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from rollout_servers.client import (
    EpisodeFailed,
    EpisodeResult,
    RolloutClient,
    episode_specs,
)
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    RecoveredRun,
    Resources,
    check_recovered_run,
    checkpoint_ready,
    example_checkpoint,
    example_set,
    is_true,
    participants_by_role,
    phase_is,
    stats,
)
from testsupport.podpath import give_import_path

from devcluster.cluster import Cluster
from harness.objects import condition, kubectl_apply

pytestmark = pytest.mark.e2e

EPISODES = 18
SEED = 29
HELD_AT_TOKEN = 2
WORKERS = ["--workers", "3"]


def with_this_checkout(obj: dict[str, Any]) -> dict[str, Any]:
    """Pods get the test's PYTHONPATH, if it has one (`give_import_path`)."""
    for participant in obj["spec"]["participants"]:
        for container in participant["template"]["spec"]["containers"]:
            give_import_path(container)
    return obj


def instance_files(storage: Path, checkpoint: str, instance: str) -> list[str]:
    """The files of one instance's records directory (`records-<sha>.jsonl` as `records`)."""
    found = list(storage.rglob(f"{checkpoint}/{instance}"))
    return [
        "records" if f.name.startswith("records-") else f.name
        for folder in found
        for f in folder.iterdir()
    ]


def start_collect(cluster: Cluster, namespace: str, folder: Path) -> subprocess.Popen[bytes]:
    """`rollout-collect --rollout-set math-rl`, as a user runs it, in the background."""
    with (folder / "collect.log").open("wb") as log:
        return subprocess.Popen(
            [
                str(Path(sys.executable).with_name("rollout-collect")),
                *("--rollout-set", "math-rl", "--namespace", namespace),
                *("--tasks", str(EPISODES), "--seed", str(SEED)),
                *("--out", str(folder / "results.jsonl")),
                *("--concurrency", str(EPISODES), "--restore-timeout", "180"),
            ],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def collected(code: int, folder: Path) -> list[EpisodeResult | EpisodeFailed]:
    """rollout-collect's results (it exited 0: every episode finished). Its lines say
    `continued` without the attempt continued from: in this test that can only be attempt 1's
    checkpoint (the one the recovery restored), so `continued_from` is 1 where `continued`."""
    assert code == 0, (folder / "collect.log").read_text()[-3000:]
    lines = (folder / "results.jsonl").read_text().splitlines()
    results = [EpisodeResult.model_validate_json(line) for line in lines]
    return [r.model_copy(update={"continued_from": 1 if r.continued else None}) for r in results]


async def control_status(http: httpx.AsyncClient, address: str, token: str) -> dict[str, Any]:
    reply = await http.get(
        address + "/checkpoint/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


async def test_three_worker_environment_and_agent_recover_exactly_once(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    obj = with_this_checkout(
        example_set(
            storage_dir,
            extra_args={"environment": WORKERS, "agent": WORKERS, "model": ["--debug-hooks"]},
        )
    )
    kubectl_apply(cluster, namespace, obj)
    try:
        before = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 120)
    except Exception:
        for pod in ("math-rl-environment-0-a1", "math-rl-agent-0-a1"):
            print(cluster.kubectl("logs", pod, "-n", namespace, "--tail", "40", check=False).stdout)
        raise
    token = await resources.control_token()
    by_role = participants_by_role(before)
    environment, model = by_role["environment"][0], by_role["model"][0]
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        for role in ("environment", "agent"):
            status = await control_status(http, by_role[role][0]["address"], token)
            assert (status["multi_process"], status["workers"]) == ("managed", 3), status
        debug = Debug(http, model["address"])
        await debug.arm("token", held, index=HELD_AT_TOKEN)
        # the trainer, as a user runs it: rollout-collect following the set through the API
        collect = start_collect(cluster, namespace, tmp_path)
        try:
            await debug.paused("token", held, limit_s=60)
            ckpt = await checkpoint_ready(cluster, resources, "workers-in-flight")
            assert ckpt["status"]["episodes"] >= 1
            assert await cluster.admin.kill_pod_async(namespace, environment["pod"])
            after = await resources.wait_set(
                "Ready under attempt 2",
                lambda o: o["status"].get("attempt") == 2 and is_true(o, "Ready"),
                180,
            )
            code = await anyio.to_thread.run_sync(lambda: collect.wait(timeout=240))
        finally:
            if collect.poll() is None:
                collect.kill()
                collect.wait()
        outcomes = collected(code, tmp_path)
        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        a2 = participants_by_role(after)
        new_stats = {
            role: await stats(http, a2[role][0]["address"], token)
            for role in ("environment", "agent", "model")
        }
    results = check_recovered_run(
        RecoveredRun(
            specs=specs,
            outcomes=outcomes,
            reference_specs=reference_specs,
            reference=reference,
            storage=storage_dir,
            checkpoint=ckpt,
            stats=new_stats,
        )
    )
    assert results[held].attempt == 2
    assert results[held].continued_from == 1
    # the environment's records: one records file and one manifest for the pod of 3 workers
    assert sorted(instance_files(storage_dir, "workers-in-flight", "environment-0")) == [
        "manifest.json",
        "records",
    ]


async def test_unmanaged_workers_are_refused_with_an_event_naming_the_pod(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    obj = with_this_checkout(example_set(storage_dir))
    for participant in obj["spec"]["participants"]:
        if participant["role"] == "environment":
            container = participant["template"]["spec"]["containers"][0]
            container["command"] = ["python", "-m", "uvicorn"]
            give_import_path(container, tests=True)  # the app is `testsupport.unmanaged_app`
            container["args"] = [
                "--factory",
                "testsupport.unmanaged_app:environment",
                "--workers",
                "2",
                "--host",
                "$(ROLLOUT_POD_IP)",
                "--port",
                "8000",
            ]
    kubectl_apply(cluster, namespace, obj)
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 120)
    pod = participants_by_role(ready)["environment"][0]["pod"]
    kubectl_apply(cluster, namespace, example_checkpoint("unmanaged"))
    ckpt = await resources.wait_checkpoint(
        "unmanaged", "Ready or Failed", phase_is("Ready", "Failed"), 60
    )
    ready_condition = condition(ckpt, "Ready")
    assert ready_condition is not None
    assert (ready_condition["status"], ready_condition["reason"]) == ("False", "UnmanagedWorkers")
    assert pod in ready_condition["message"]
    assert "unmanaged" in ready_condition["message"]
    # As a user sees it: the Event in kubectl describe names the pod.
    described = cluster.kubectl("describe", "rolloutcheckpoint", "unmanaged", "-n", namespace)
    events = described.stdout.split("Events:", 1)[-1]
    assert "UnmanagedWorkers" in events, described.stdout
    assert pod in events, described.stdout
    # Nothing was paused or written: no records directory for this checkpoint.
    assert instance_files(storage_dir, "unmanaged", "environment-0") == []
    assert not is_true(ckpt, "Prepared")
