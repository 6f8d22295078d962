"""A RolloutSet whose environment speaks only the NeMo Gym control dialect, the other roles ours.

The environment pod runs `python -m testsupport.gym_environment` (the test participant: the
reference environment's episodes behind a control plane that mounts Gym's routes alone), the
model, agent and resources pods the reference servers. The operator reads each pod's
capabilities and speaks the dialect it announces: a checkpoint while episodes run goes through
Gym's routes for the environment and ours for the rest; the environment pod is SIGKILLed; the
recovery restores it under attempt 2 through Gym's restore; every episode finishes exactly once
(`check_recovered_run`).

Determinism without sleeps: the model runs with `--debug-hooks` and one episode is held at its
third token, so it is provably mid-way both when the checkpoint records it and at the kill.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
from rollout_protocol import API_PREFIX, Dialect
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    RecoveredRun,
    Resources,
    check_manifests,
    check_recovered_run,
    checkpoint_ready,
    example_set,
    participants_by_role,
    recovered_under,
    stats,
)
from testsupport.podpath import give_import_path

from devcluster.cluster import Cluster

SET = "gym-mixed"
EPISODES = 12
SEED = 17
HELD_AT_TOKEN = 2
CAPABILITIES = "/ng-control/v1/capabilities"


def mixed_set(storage: Path) -> dict[str, Any]:
    """The example set with its environment replaced by the Gym-only test participant."""
    rset = example_set(storage, name=SET, extra_args={"model": ["--debug-hooks"]})
    for participant in rset["spec"]["participants"]:
        if participant["role"] == "environment":
            container = participant["template"]["spec"]["containers"][0]
            container["command"] = ["python", "-m", "testsupport.gym_environment"]
            give_import_path(container, tests=True)
    return rset


async def test_gym_dialect_environment_checkpoint_kill_restore(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(mixed_set(storage_dir)))
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"rolloutset/{SET}", "-n", namespace, "--timeout=90s"
    )
    ready = await resources.rollout_set(SET)
    token = await resources.control_token(SET)
    assert ready["status"]["attempt"] == 1
    a1 = participants_by_role(ready)
    env_a1, model = a1["environment"][0], a1["model"][0]
    auth = {"Authorization": f"Bearer {token}"}
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    async with (
        httpx.AsyncClient(timeout=30) as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        # The environment speaks Gym only; the model ours only.
        ours = await http.get(f"{env_a1['address']}{API_PREFIX}/status", headers=auth)
        assert ours.status_code == 404, ours.text
        announced = (await http.get(f"{env_a1['address']}{CAPABILITIES}", headers=auth)).json()
        assert announced["checkpoint"] is True
        assert announced["dialects"] == [Dialect.GYM.value]
        assert (
            await http.get(f"{model['address']}{CAPABILITIES}", headers=auth)
        ).status_code == 404

        await Debug(http, model["address"]).arm("token", held, index=HELD_AT_TOKEN)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        with anyio.fail_after(240):
            async with anyio.create_task_group() as group:

                async def run_episodes() -> None:
                    outcomes.extend(await client.run_all(specs))

                group.start_soon(run_episodes)
                await Debug(http, model["address"]).paused("token", held)

                name = "gym-mixed-running"
                ckpt = await checkpoint_ready(cluster, resources, name, 60, SET)
                assert ckpt["status"]["attempt"] == 1
                assert ckpt["status"]["episodes"] >= 1
                assert ckpt["status"]["restarts"] == 0
                check_manifests(ckpt, storage_dir)  # the Gym environment's manifest included
                # the Gym participant's commit listed its rollouts, kept for its restore (which
                # must name them: the client refuses a Gym restore of every record, so the
                # recovery below succeeds only by naming them); ours restore every record
                kept = {p["instance"]: p.get("rolloutIds") for p in ckpt["status"]["participants"]}
                assert held in (kept["environment-0"] or []), kept
                assert kept["environment-0"] == sorted(set(kept["environment-0"]))
                assert all(ids is None for i, ids in kept.items() if i != "environment-0"), kept

                # SIGKILL the Gym-dialect pod while episodes run (one held mid-generation).
                assert await cluster.admin.kill_pod_async(namespace, env_a1["pod"])
                recovered = await recovered_under(resources, 2, 120, SET)

        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        a2 = participants_by_role(recovered)
        new_stats = {
            role: await stats(http, a2[role][0]["address"], token)
            for role in ("environment", "agent", "model")
        }
        env_a2 = a2["environment"][0]
        restored = await http.get(
            f"{env_a2['address']}/ng-control/v1/checkpoint/status", headers=auth
        )
        assert restored.json()["attempt"] == 2, restored.text

    assert recovered["status"]["restarts"] == 1
    assert recovered["status"]["latestCheckpoint"] == name
    assert env_a2["pod"] == f"{SET}-environment-0-a2"

    # every episode finished exactly once, as the uninterrupted run of its task did; nothing
    # completed before the checkpoint ran again
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
    assert results[held].continued_from == 1
