"""The custom environment example (`examples/custom-environment/`, a text adventure written only
against the public `rollout_protocol` SDK) under the operator: checkpoint while episodes run,
SIGKILL the environment's pod mid-episode, recover under attempt 2, and finish every episode
exactly once, with no step that completed before the checkpoint completing again. And the same
with the user's own tasks: `rollout-collect --tasks-file` (the CLI, as a process) running rows of
the example's own through that checkpoint and kill, each row's rollouts finished once and named.

Determinism without sleeps: the reference model server runs with `--debug-hooks`, and one
episode is walked turn by turn through the model's `finish` and `token` pause points until it is
held at the third token of its turn `HELD_TURN` generation. Its environment boundary is then
provably at that turn (two turns behind it) both when the checkpoint records it and when the
pod is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
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
    checkpoint_ready,
    participants_by_role,
    recovered_under,
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
QUESTS = [  # the user's own rows: any JSON objects; here each names its id in `quest`
    {"quest": "vault-run", "hero": "Ada", "notes": ["fast", "quiet"]},
    {"quest": "key-hunt", "hero": "Brin", "difficulty": 2},
    {"quest": "lamp-first", "hero": "Cato", "hints": {"lamp": "hall"}},
    {"quest": "long-way", "hero": "Dee", "difficulty": 5},
    {"quest": "coin-toss", "hero": "Eli", "difficulty": 1},
]
PER_ROW = 2


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
                # one episode is held at turn HELD_TURN through the checkpoint and the kill
                name = "adventure-running"
                recovered = await checkpoint_and_kill(
                    cluster, namespace, resources, env_a1["pod"], name
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


async def checkpoint_and_kill(
    cluster: Cluster, namespace: str, resources: Resources, environment_pod: str, name: str
) -> dict[str, Any]:
    """A manual checkpoint of attempt 1 while episodes run, then SIGKILL the environment's pod
    mid-episode; returns the set once it is Ready under attempt 2."""
    ckpt = await checkpoint_ready(cluster, resources, name, 60, SET)
    assert ckpt["status"]["attempt"] == 1
    assert ckpt["status"]["episodes"] >= 1
    assert await cluster.admin.kill_pod_async(namespace, environment_pod)
    return await recovered_under(resources, 2, 90, SET)


def start_collect(cluster: Cluster, command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`rollout-collect` as a user runs it (the cluster's kubeconfig), in the background; its
    stderr (progress, failures) goes to `log`."""
    with log.open("wb") as stderr:
        return subprocess.Popen(
            command,
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


async def test_collect_a_rows_file_through_a_pod_kill(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    """`rollout-collect --tasks-file` as a user runs it (docs/servers.md "Your own tasks"): the
    example's rows, two rollouts each, one held mid-episode while the environment's pod is
    checkpointed and killed; every rollout of every row finished exactly once, each result line
    naming its row."""
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(adventure_set(storage_dir))
    )
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"rolloutset/{SET}", "-n", namespace, "--timeout=90s"
    )
    ready = await resources.rollout_set(SET)
    token = await resources.control_token(SET)
    a1 = participants_by_role(ready)
    rows = tmp_path / "quests.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in QUESTS), encoding="utf-8")
    out, log = tmp_path / "results.jsonl", tmp_path / "collect.log"
    held = "vault-run-1"  # the second rollout of the first row
    command = [
        str(Path(sys.executable).with_name("rollout-collect")),
        *("--rollout-set", SET, "--namespace", namespace),
        *("--tasks-file", str(rows), "--id-field", "quest", "--rollouts-per-row", str(PER_ROW)),
        *("--seed", str(SEED), "--out", str(out), "--run-timeout", "240"),
    ]

    async with httpx.AsyncClient() as http:
        model = Debug(http, a1["model"][0]["address"])
        await model.arm("finish", held)  # before the episode can reach it
        collect = start_collect(cluster, command, log)
        try:
            with anyio.fail_after(120):
                await hold_at_turn(model, held)
            recovered = await checkpoint_and_kill(
                cluster, namespace, resources, a1["environment"][0]["pod"], "quests-running"
            )
            code = await anyio.to_thread.run_sync(lambda: collect.wait(timeout=240))
        finally:
            if collect.poll() is None:
                collect.kill()
                collect.wait()
        env_stats = await stats(
            http, participants_by_role(recovered)["environment"][0]["address"], token
        )

    total = len(QUESTS) * PER_ROW
    assert code == 0, log.read_text()[-3000:]
    assert f"{total}/{total} done, 0 failed" in log.read_text()
    lines = [json.loads(line) for line in out.read_text().splitlines()]

    # --- every rollout of every row exactly once, each line naming its row and sample
    assert Counter(line["rollout_id"] for line in lines) == Counter(
        f"{row['quest']}-{k}" for row in QUESTS for k in range(PER_ROW)
    )
    for line in lines:
        row = QUESTS[line["line"] - 1]  # the file's line number, 1-based
        assert line["row_id"] == row["quest"], line
        assert line["rollout_id"] == f"{row['quest']}-{line['sample']}", line
        assert line["attempt"] in (1, 2), line
        # an episode that finished under attempt 1 was not run again under attempt 2
        runs = completed(env_stats, line["rollout_id"], 2).get("run", 0)
        assert runs == (1 if line["attempt"] == 2 else 0), (line, runs)

    # --- the held rollout was cut by the kill and continued from the checkpoint
    by_id = {line["rollout_id"]: line for line in lines}
    assert (by_id[held]["attempt"], by_id[held]["continued"]) == (2, True)
    assert by_id[held]["steps"] > HELD_TURN
    records = checkpoint_records(storage_dir, SET, "quests-running")
    env_records = {r.rollout_id: r for r in records["environment-0"]}
    assert env_records[held].data["state"]["turn"] == HELD_TURN
    # only episodes the checkpoint recorded continued
    assert {rid for rid, line in by_id.items() if line["continued"]} <= set(env_records)
