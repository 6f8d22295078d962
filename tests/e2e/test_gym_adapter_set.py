"""A released NeMo Gym environment under the operator, through the Gym adapter (docs/gym.md):
`examples/gym-environment/rolloutset.yaml` as its comment says to apply it on devcluster.

The set: NeMo Gym's stateful counter (`example_session_state_mgmt` from nemo-gym 0.4.0 on PyPI,
unmodified) hosted by `rollout-gym resources` as the resources pod; Gym's `simple_agent` loop
run by `rollout-gym environment --strategy replay` as the environment pod; the project's model
server as the model. Both Gym pods run on the Gym environment's interpreter (Python >= 3.12,
`make gym-venv`): on devcluster's process node a pod's bare command is looked up on the
container's PATH (docs/devcluster.md, "Containers"), so the manifest puts the Gym environment's
`bin` first on it.

A checkpoint is taken while episodes run (one provably mid-way: held at the third token of its
second model call, after one increment of its counter), then the environment pod is SIGKILLed.
The recovery replaces every pod of attempt 1 (the counter's memory goes with its pod), restores
under attempt 2 (the adapter replays each restored episode's recorded increments into a fresh
counter session, checking every output), and the set is Ready under attempt 2. Then:

- every episode finished exactly once, with the reward of an uninterrupted run of its row;
- no tool call lost or doubled, counted from the Gym server's own state: every episode that
  finished under attempt 2 has, in the attempt-2 counter's memory (`/get_counter_value` with its
  session's cookie), exactly the initial count plus one increment per step of its task;
- the held episode continued from the checkpoint (`continued_from` 1) with one recorded call.

The same with `restorePolicy: InPlace` and the resources pod SIGKILLed instead: the environment
and the model are kept, the kept environment is re-wired to the new counter by the restore call
(the operator's new peer address) and replays the recorded increments there. And with
`--strategy restart`: the checkpoint captures nothing and counts the running episodes as
restarts, which the set's `lastRecovery.episodesRestarted` reports after the loss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml
from rollout_servers.client import EpisodeFailed, EpisodeResult, EpisodeSpec, RolloutClient
from rollout_servers.discovery import rollout_set_topology
from rollout_servers.tasks import shipped_tasks
from testsupport.gym_processes import EXAMPLE, counter_row, counter_value, gym_python
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    Resources,
    checkpoint_ready,
    participants_by_role,
    recovered_under,
)

from devcluster.cluster import Cluster
from harness.measures import checkpoint_records
from harness.objects import with_storage

SET = "gym-counter"
EPISODES = 10
HELD_AT_TOKEN = 2


def gym_set(storage: Path) -> dict[str, Any]:
    """The example manifest with the Gym environment's path put in, as its comment says, the
    storage moved to this test's folder and the model's pause points on."""
    venv = str(gym_python().parent.parent)
    text = (EXAMPLE / "rolloutset.yaml").read_text().replace("/opt/gym-venv", venv)
    rset = with_storage(yaml.safe_load(text), storage)
    for participant in rset["spec"]["participants"]:
        if participant["role"] == "model":
            container = participant["template"]["spec"]["containers"][0]
            container["args"] = [*container["args"], "--debug-hooks"]
    return rset


def specs() -> list[EpisodeSpec]:
    """Counter rows of shipped tasks of two steps (two increments each), one rollout each."""
    tasks = [t for t in shipped_tasks() if len(t.steps) == 2][:EPISODES]
    assert len(tasks) == EPISODES
    return [EpisodeSpec(f"gym-{i:02d}", counter_row(t)) for i, t in enumerate(tasks)]


async def test_gym_environment_checkpoint_kill_restore(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """Recreate: the environment pod SIGKILLed, every pod of attempt 1 replaced."""
    await checkpoint_kill_restore(
        cluster, namespace, resources, storage_dir, "Recreate", "environment"
    )


async def test_gym_resources_pod_lost_in_place(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """InPlace: the Gym resources pod SIGKILLed (the counter's memory with it), the environment
    and the model kept. The kept environment is re-wired to the new resources pod by the restore
    call and replays the recorded increments there."""
    await checkpoint_kill_restore(
        cluster, namespace, resources, storage_dir, "InPlace", "resources"
    )


async def test_gym_restart_strategy_counts_its_work_loss(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """`--strategy restart`: the checkpoint captures no episode and lists the running ones as
    restarts; after the environment pod's loss the set's `lastRecovery.episodesRestarted` says
    so, and the restarted episodes are played from their start on the new counter."""
    await checkpoint_kill_restore(
        cluster, namespace, resources, storage_dir, "Recreate", "environment", "restart"
    )


async def checkpoint_kill_restore(
    cluster: Cluster,
    namespace: str,
    resources: Resources,
    storage_dir: Path,
    restore_policy: str,
    killed: str,
    strategy: str = "replay",
) -> None:
    rset = gym_set(storage_dir)
    rset["spec"]["recovery"]["restorePolicy"] = restore_policy
    for participant in rset["spec"]["participants"]:
        if participant["role"] == "environment":
            args = participant["template"]["spec"]["containers"][0]["args"]
            args[args.index("--strategy") + 1] = strategy
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rset))
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"rolloutset/{SET}", "-n", namespace, "--timeout=120s"
    )
    ready = await resources.rollout_set(SET)
    assert ready["status"]["attempt"] == 1
    a1 = participants_by_role(ready)
    episodes = specs()
    held = episodes[0].rollout_id
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    async with (
        httpx.AsyncClient(timeout=30) as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        model = Debug(http, a1["model"][0]["address"])
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        with anyio.fail_after(300):
            async with anyio.create_task_group() as group:

                async def run_episodes() -> None:
                    outcomes.extend(await client.run_all(episodes))

                await model.arm("finish", held)  # before the episode can reach it
                group.start_soon(run_episodes)
                # turn 0's model call is complete; hold turn 1's at a token, after tool@0
                await model.paused("finish", held)
                await model.arm("token", held, index=HELD_AT_TOKEN)
                assert await model.release("finish", held) == 1
                await model.paused("token", held)

                name = "gym-running"
                ckpt = await checkpoint_ready(cluster, resources, name, 60, SET)
                assert ckpt["status"]["attempt"] == 1
                if strategy == "restart":  # nothing captured, the running episodes counted
                    assert ckpt["status"]["episodes"] == 0, ckpt["status"]
                    assert ckpt["status"]["restarts"] >= 1, ckpt["status"]
                else:
                    assert ckpt["status"]["episodes"] >= 1
                    assert ckpt["status"]["restarts"] == 0

                assert await cluster.admin.kill_pod_async(namespace, a1[killed][0]["pod"])
                if restore_policy == "InPlace" and killed != "model":
                    # the model is kept: let the held generation go on only now, so that the
                    # held episode is still unfinished at the loss (it then meets the lost
                    # counter, and is retired and continued under attempt 2 from the checkpoint)
                    await model.release("token", held)
                recovered = await recovered_under(resources, 2, 120, SET)

        # The same rows, uninterrupted, on the recovered set: the reference rewards.
        reference_specs = [EpisodeSpec(f"ref-{s.rollout_id}", s.task) for s in episodes]
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        a2 = participants_by_role(recovered)
        env_a2, counter_a2 = a2["environment"][0]["address"], a2["resources"][0]["address"]
        finished_a2 = [o.rollout_id for o in outcomes if getattr(o, "attempt", None) == 2]
        sessions = (
            await http.get(env_a2 + "/gym/sessions", params={"rollout_id": finished_a2})
        ).json()["sessions"]
        ids = [s.rollout_id for s in episodes]
        env_stats = (await http.get(env_a2 + "/stats", params={"rollout_id": ids})).json()

    assert recovered["status"]["restarts"] == 1
    assert recovered["status"]["latestCheckpoint"] == name
    pods = sorted(p["pod"] for p in recovered["status"]["participants"])
    # Recreate replaces every pod of attempt 1; InPlace only the lost one (the kept ones keep
    # the names of their first attempt)
    every = ["environment", "model", "resources"]
    replaced = every if restore_policy == "Recreate" else [killed]
    assert pods == sorted(
        f"{SET}-{role}-0-a{2 if role in replaced else 1}"
        for role in ("environment", "model", "resources")
    ), pods

    # --- every episode finished exactly once, rewarded as its uninterrupted run
    failures = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failures, failures
    results = {o.rollout_id: o for o in outcomes if isinstance(o, EpisodeResult)}
    assert len(outcomes) == EPISODES
    assert sorted(results) == sorted(s.rollout_id for s in episodes)
    # exactly once under attempt 2, from the environment's own step counters: a `/run` completed
    # once for each episode that finished there, none for those finished under attempt 1, and
    # no step of one completed twice
    for rid, got in results.items():
        steps = env_stats["rollouts"].get(rid, {}).get("2", {})
        done = {name: int(events.get("completed", 0)) for name, events in steps.items()}
        assert done.get("run", 0) == (1 if got.attempt == 2 else 0), (rid, got, done)
        assert all(n <= 1 for n in done.values()), (rid, done)
    refs = {r.rollout_id: r for r in reference if isinstance(r, EpisodeResult)}
    assert len(refs) == EPISODES, reference
    for spec in episodes:
        got, ref = results[spec.rollout_id], refs[f"ref-{spec.rollout_id}"]
        assert (got.reward, got.steps, got.answer) == (ref.reward, ref.steps, ref.answer), got
        assert got.reward == 1.0, got  # the counter's own verify: every increment once
        assert got.attempt in (1, 2)

    # --- counted from the Gym server's own state: each episode finished under attempt 2 has
    # exactly one increment per step in the attempt-2 counter (replayed ones included)
    assert held in finished_a2
    for rid in finished_a2:
        session = sessions[rid]
        assert session["attempt"] == 2, session
        row = next(s.task for s in episodes if s.rollout_id == rid)
        assert isinstance(row, dict)
        count = await anyio.to_thread.run_sync(counter_value, counter_a2, session["cookies"])
        assert count == row["expected_count"], (rid, count, row["expected_count"])
        assert session["calls"] == 2, session  # one increment per step, none lost or doubled

    if strategy == "restart":  # the held episode was played again from its start
        assert (results[held].attempt, results[held].continued_from) == (2, None)
        restarted = recovered["status"]["lastRecovery"]["episodesRestarted"]
        assert restarted == ckpt["status"]["restarts"] >= 1, recovered["status"]["lastRecovery"]
        return

    # --- the held episode continued from the checkpoint, one increment recorded
    assert (results[held].attempt, results[held].continued_from) == (2, 1)
    records = {r.rollout_id: r for r in checkpoint_records(storage_dir, SET, name)["environment-0"]}
    state = records[held].data["state"]
    assert records[held].data["step"] == "model", records[held].data
    assert [c["path"] for c in state["session"]["calls"]] == ["/increment_counter"]
