"""The custom environment example (`examples/custom-environment/`, a text adventure written only
against the public `rollout_protocol` SDK) under the operator: checkpoint while episodes run,
SIGKILL the environment's pod mid-episode, recover under attempt 2, and finish every episode
exactly once, with no step that completed before the checkpoint completing again.

Determinism without sleeps: the reference model server runs with `--debug-hooks`, and one
episode is walked turn by turn through the model's `finish` and `token` pause points until it is
held at the third token of its turn `HELD_TURN` generation. Its environment boundary is then
provably at that turn (two turns behind it) both when the checkpoint records it and when the
pod is killed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    Resources,
    example_checkpoint,
    is_true,
    participants_by_role,
    phase_is,
    stats,
)

from devcluster.cluster import Cluster
from harness.measures import checkpoint_records
from harness.objects import with_storage

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom-environment"
SET = "adventure"
EPISODES = 12
SEED = 5
HELD_TURN = 2
HELD_AT_TOKEN = 2


def adventure_set(storage: Path) -> dict[str, Any]:
    """The example manifest as its README says to apply it on devcluster (PYTHONPATH = the
    example folder), with the storage moved to this test's folder and the model's pause
    points on."""
    rset = with_storage(yaml.safe_load((EXAMPLE / "rolloutset.yaml").read_text()), storage)
    for participant in rset["spec"]["participants"]:
        container = participant["template"]["spec"]["containers"][0]
        if participant["role"] == "model":
            container["args"] = [*container["args"], "--debug-hooks"]
        for var in container.get("env", []):
            if var["name"] == "PYTHONPATH":
                var["value"] = str(EXAMPLE)
    return rset


def completed(reply: dict[str, Any], rollout_id: str, attempt: int) -> dict[str, int]:
    """Completions per step name (`policy@3`, `world@3`, `run`) of one rollout and attempt;
    steps that only started are left out."""
    steps = ((reply.get("rollouts") or {}).get(rollout_id) or {}).get(str(attempt)) or {}
    counts = {name: int(events.get("completed", 0)) for name, events in steps.items()}
    return {name: count for name, count in counts.items() if count}


def done_before(record: Any) -> set[str]:
    """The steps an environment record says had completed: every step of the turns before its
    own, and the policy call of its own turn when it stands at the world update."""
    turn, step = int(record.data["state"]["turn"]), record.data["step"]
    names = {f"{kind}@{t}" for kind in ("policy", "world") for t in range(turn)}
    return names | ({f"policy@{turn}"} if step == "world" else set())


async def hold_at_turn(model: Debug, rollout_id: str) -> None:
    """Walk one episode to the generation of its turn `HELD_TURN` and hold it at a token.

    `finish` must be armed before the episode starts. While a generation is held at `finish`,
    the next pause (a token of the next generation) is armed before the release, and the other
    way round: no pause can be missed.
    """
    for turn in range(HELD_TURN):
        await model.paused("finish", rollout_id)  # turn `turn`'s generation is complete
        await model.arm("token", rollout_id, index=HELD_AT_TOKEN)
        assert await model.release("finish", rollout_id) == 1
        await model.paused("token", rollout_id)  # turn + 1's generation, at its third token
        if turn + 1 < HELD_TURN:
            await model.arm("finish", rollout_id)
            assert await model.release("token", rollout_id) == 1


async def test_custom_environment_checkpoint_kill_recover(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(adventure_set(storage_dir))
    )
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"rolloutset/{SET}", "-n", namespace, "--timeout=90s"
    )
    ready = await resources.rollout_set(SET)
    token = await resources.control_token(SET)
    assert ready["status"]["attempt"] == 1
    a1 = participants_by_role(ready)
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        model = Debug(http, a1["model"][0]["address"])
        env_a1 = a1["environment"][0]
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        with anyio.fail_after(240):
            async with anyio.create_task_group() as group:

                async def run_episodes() -> None:
                    outcomes.extend(await client.run_all(specs))

                await model.arm("finish", held)  # before the episode can reach it
                group.start_soon(run_episodes)
                await hold_at_turn(model, held)
                before = await stats(http, env_a1["address"], token)

                # A manual checkpoint while episodes run (one of them held at turn HELD_TURN).
                name = "adventure-running"
                checkpoint = json.dumps(example_checkpoint(name, set_name=SET))
                cluster.kubectl("apply", "-n", namespace, "-f", "-", input=checkpoint)
                ckpt = await resources.wait_checkpoint(
                    name, "Ready or Failed", phase_is("Ready", "Failed"), 60
                )
                assert is_true(ckpt, "Ready"), ckpt["status"]
                assert ckpt["status"]["attempt"] == 1
                assert ckpt["status"]["episodes"] >= 1

                # SIGKILL the environment mid-episode: the held episode is still at its turn.
                assert await cluster.admin.kill_pod_async(namespace, env_a1["pod"])
                recovered = await resources.wait_set(
                    "Ready under attempt 2",
                    # latestCheckpoint: written by the set's pass right after the recovery
                    lambda o: (
                        o["status"].get("attempt") == 2
                        and is_true(o, "Ready")
                        and bool(o["status"].get("latestCheckpoint"))
                    ),
                    90,
                    SET,
                )

        # The same tasks, uninterrupted, on the recovered set: the reference outcome.
        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        a2 = participants_by_role(recovered)
        env_stats = await stats(http, a2["environment"][0]["address"], token)
        model_stats = await stats(http, a2["model"][0]["address"], token)

    assert recovered["status"]["restarts"] == 1
    assert recovered["status"]["latestCheckpoint"] == name
    assert sorted(p["pod"] for p in recovered["status"]["participants"]) == [
        "adventure-environment-0-a2",
        "adventure-model-0-a2",
    ]

    # --- every episode finished exactly once, as the uninterrupted run of its task did
    failures = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failures, failures
    results = {o.rollout_id: o for o in outcomes if isinstance(o, EpisodeResult)}
    assert sorted(results) == sorted(s.rollout_id for s in specs)
    refs = [r for r in reference if isinstance(r, EpisodeResult)]
    assert len(refs) == EPISODES
    for spec, ref in zip(specs, refs, strict=True):
        got = results[spec.rollout_id]
        assert (got.answer, got.reward, got.steps) == (ref.answer, ref.reward, ref.steps), got
        assert got.attempt in (1, 2)
        runs = completed(env_stats, spec.rollout_id, 2).get("run", 0)
        assert runs == (1 if got.attempt == 2 else 0), (spec.rollout_id, got.attempt, runs)

    # --- the held episode continued at the turn the checkpoint recorded
    records = checkpoint_records(storage_dir, SET, name)
    env_records = {r.rollout_id: r for r in records["environment-0"]}
    assert env_records[held].data["step"] == "policy"
    assert env_records[held].data["state"]["turn"] == HELD_TURN
    assert (results[held].attempt, results[held].continued_from) == (2, 1)
    behind = {f"{kind}@{t}" for kind in ("policy", "world") for t in range(HELD_TURN)}
    assert completed(before, held, 1) == dict.fromkeys(behind, 1)
    after = completed(env_stats, held, 2)
    ahead = {f"{k}@{t}" for k in ("policy", "world") for t in range(HELD_TURN, results[held].steps)}
    assert after == dict.fromkeys(ahead, 1) | {"run": 1}, after
    # its model call was cut at the checkpoint and went on from the recorded prefix
    tokens = model_stats["tokens"]["2"]["by_request"]
    ref_held = reference_specs[0].rollout_id
    assert tokens[f"{held}/{HELD_TURN}"] == tokens[f"{ref_held}/{HELD_TURN}"] - HELD_AT_TOKEN

    # --- no step completed under attempt 1 before the checkpoint completed again under 2,
    # and no step completed twice under attempt 2
    continued = [rid for rid, r in results.items() if r.continued_from == 1]
    assert held in continued
    assert set(continued) <= set(env_records)
    for rid in results:
        now = completed(env_stats, rid, 2)
        assert all(count <= 1 for count in now.values()), (rid, now)
        if rid in continued:
            redone = done_before(env_records[rid]) & set(now)
            assert not redone, (rid, env_records[rid].data, redone)
