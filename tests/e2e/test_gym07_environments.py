"""Four of nemo-gym 0.7.0's released environments under the operator, each from its own Gym
YAML: the sets of `examples/gym-0.7-environments/` as their comment says to apply them on
devcluster (docs/gym.md, "nemo-gym 0.7's environment servers").

The four sets run at once, one operator: the weather tool call (`example_single_tool_call`,
`simple_agent`), calendar (`simple_agent`; its server imports `utils` from its own folder, and
the manifest sets no path for it), the workplace assistant (`simple_agent`, 27 tools on a
per-session company state) and the stateful counter (`example_session_state_mgmt`, its
`simple_agent` and `legacy_agent` from the counter's own YAML). Each has the project's model
server and three pods of the nemo-gym 0.7 environment (`make gym-venv`, `.bin/gym-venv-0.7`): the
resources server, the stock agent and the `legacy_agent` environment server, all hosted by
`rollout-gym` from the environment's YAML. Nothing needs an API key or a GPU. The episodes are
rows sent by the project's client as `rollout-collect --gym --tasks-file` reads them: the
environment's shipped `data/example.jsonl`, and for the counter this checkout's counter rows
(`examples/gym-environment/tasks.jsonl`: the model server's arithmetic questions with the
counter's `increment_counter` tool). The project's model answers the shipped rows' prompts with
filler (reward 0.0), but plays the counter's rows with one increment per step: the counter's
own verify rewards 1.0 exactly when no increment was lost or doubled, so there the reward
itself says every tool call was counted once across the checkpoint and the loss.

Per set: one episode is held at the third token of its first model call (inside its agent's
call, so provably mid-episode); a RolloutCheckpoint is applied and becomes Ready, listing the
episodes inside their agent's call as restarts (the stock agent's loop cannot be continued);
the environment pod is SIGKILLed; the set is Ready under attempt 2 (InPlace: only the lost pod
replaced, the kept agent's call of the lost attempt retired) with the checkpoint restored and
`lastRecovery.episodesRestarted` equal to the checkpoint's restarts. Then every episode
finished exactly once (one result each, and in the attempt-2 environment's own step counters
one agent call started and completed for each episode finished there, none for the others,
and nothing of another attempt), with the reward, tool calls and answer of an uninterrupted
run of its row on the recovered set; every counter episode rewarded 1.0.

Not among them: blackjack (its server deals from an unseeded `random.Random()`, so no two runs of
a row compare), Wordle (its server needs word lists that `generate_data.py` downloads first),
and the environments whose servers need packages the nemo-gym wheel does not install (Gym's
`ng_run` installs each server's own `requirements.txt`) or a judge model.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from rollout_servers.client import (
    EpisodeFailed,
    EpisodeResult,
    EpisodeSpec,
    RolloutClient,
    row_episodes,
)
from rollout_servers.discovery import rollout_set_topology
from rollout_servers.taskfile import RowOptions, scan_rows
from testsupport.gym_processes import REPO, gym_python
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    Resources,
    checkpoint_ready,
    participants_by_role,
    recovered_under,
)

from devcluster.cluster import Cluster
from harness.objects import with_storage

pytestmark = pytest.mark.timeout(600)
"""Twelve nemo-gym 0.7 pods start at once (seconds each: its imports), then four again."""
RELEASE = "0.7"
EXAMPLES = REPO / "examples" / "gym-0.7-environments"
MANIFESTS = ("weather.yaml", "calendar.yaml", "workplace.yaml", "counter.yaml")
ROWS = {
    # set (its manifest's, in order): its rows, under the nemo-gym install (an absolute path
    # stays itself under `root / path`)
    "gym07-weather": Path("resources_servers/example_single_tool_call/data/example.jsonl"),
    "gym07-calendar": Path("environments/calendar/data/example.jsonl"),
    "gym07-workplace": Path("environments/workplace_assistant/data/example.jsonl"),
    "gym07-counter": REPO / "examples" / "gym-environment" / "tasks.jsonl",
}
REWARDS = {"gym07-counter": 1.0}
"""The reward of every episode of a set whose rows the project's model plays (the counter's
verify: every increment once); the others' rows it answers with filler (docs/servers.md)."""
HELD_AT_TOKEN = 2
READY_S = 240
"""Twelve Gym pods starting at once on a loaded machine: tens of seconds each."""


def gym_root() -> Path:
    """The nemo-gym install's root (where `environments/` lives), found without importing it."""
    done = subprocess.run(
        [
            str(gym_python(RELEASE)),
            "-c",
            "import importlib.util; print(importlib.util.find_spec('nemo_gym').origin)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return Path(done.stdout.strip()).parent.parent


def gym_sets(storage: Path) -> list[dict[str, Any]]:
    """The example's sets with the 0.7 environment's path put in, as its comment says, the
    storage moved to this test's folder and the models' pause points on."""
    venv = str(gym_python(RELEASE).parent.parent)
    sets = [
        with_storage(
            yaml.safe_load((EXAMPLES / name).read_text().replace("/opt/gym-venv-0.7", venv)),
            storage,
        )
        for name in MANIFESTS
    ]
    for rset in sets:
        for participant in rset["spec"]["participants"]:
            if participant["role"] == "model":
                container = participant["template"]["spec"]["containers"][0]
                container["args"] = [*container["args"], "--debug-hooks"]
    assert [s["metadata"]["name"] for s in sets] == list(ROWS)
    return sets


def shipped_episodes(root: Path, name: str, prefix: str) -> list[EpisodeSpec]:
    """The set's rows as `rollout-collect --gym --tasks-file` reads them."""
    rows = scan_rows(root / ROWS[name], RowOptions(gym=True, prefix=prefix))
    return list(row_episodes(rows))


@dataclass
class SetRun:
    """One set's run: what its checkpoint, recovery and episodes were."""

    name: str
    episodes: list[EpisodeSpec]
    outcomes: list[EpisodeResult | EpisodeFailed]
    checkpoint: dict[str, Any] | None = None
    recovered: dict[str, Any] | None = None
    reference: list[EpisodeResult | EpisodeFailed] | None = None
    env_stats: dict[str, Any] | None = None


async def checkpoint_kill_recover(
    cluster: Cluster, namespace: str, resources: Resources, run: SetRun
) -> None:
    """One set: an episode held mid-way, a checkpoint Ready, the environment pod SIGKILLed,
    Ready under attempt 2; then the reference run and the attempt-2 environment's counters."""
    ready = await resources.rollout_set(run.name)
    assert ready["status"]["attempt"] == 1
    a1 = participants_by_role(ready)
    held = run.episodes[0].rollout_id
    async with (
        httpx.AsyncClient(timeout=30) as http,
        rollout_set_topology(run.name, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        model = Debug(http, a1["model"][0]["address"])
        client = RolloutClient(
            topology, concurrency=len(run.episodes), restore_timeout_s=180, run_timeout_s=240
        )
        with anyio.fail_after(420):
            async with anyio.create_task_group() as group:

                async def run_episodes() -> None:
                    run.outcomes.extend(await client.run_all(run.episodes))

                await model.arm("token", held, index=HELD_AT_TOKEN)  # before it can reach it
                group.start_soon(run_episodes)
                await model.paused("token", held, limit_s=120)  # inside its agent's call

                name = f"{run.name}-mid-episode"
                run.checkpoint = await checkpoint_ready(cluster, resources, name, 90, run.name)
                assert await cluster.admin.kill_pod_async(namespace, a1["environment"][0]["pod"])
                # the model is kept (InPlace): let the held generation go on only now, so that
                # its episode is still unfinished at the loss (its agent's call then answers a
                # dead relay, and the episode is played again under attempt 2)
                await model.release("token", held)
                recovered = await recovered_under(resources, 2, 240, run.name)
                run.recovered = recovered

        # the same rows, uninterrupted, on the recovered set: the reference results
        reference = [EpisodeSpec(f"ref-{s.rollout_id}", s.task) for s in run.episodes]
        with anyio.fail_after(240):
            run.reference = await RolloutClient(topology, concurrency=len(reference)).run_all(
                reference
            )
        env_a2 = participants_by_role(recovered)["environment"][0]["address"]
        ids = [s.rollout_id for s in run.episodes]
        reply = await http.get(env_a2 + "/stats", params={"rollout_id": ids})
        assert reply.status_code == 200, reply.text
        run.env_stats = reply.json()


def check_set(run: SetRun) -> None:
    """Every episode exactly once, with its uninterrupted run's results; the lost work
    counted."""
    assert run.checkpoint is not None, run.name
    assert run.recovered is not None, run.name
    assert run.reference is not None, run.name
    assert run.env_stats is not None, run.name
    ckpt, recovered = run.checkpoint["status"], run.recovered["status"]
    # the held episode was inside its agent's one call: listed as a restart, nothing captured
    assert ckpt["attempt"] == 1, ckpt
    assert ckpt["restarts"] >= 1, ckpt
    assert ckpt["episodes"] == 0, ckpt
    assert recovered["restarts"] == 1, recovered
    assert recovered["latestCheckpoint"] == run.checkpoint["metadata"]["name"], recovered
    assert recovered["lastRecovery"]["episodesRestarted"] == ckpt["restarts"], recovered
    # restored from that checkpoint (not restarted without one), the lost attempt retired
    assert recovered["lastRecovery"]["checkpoint"] == run.checkpoint["metadata"]["name"]
    assert recovered["lastRecovery"]["restorePolicy"] == "InPlace", recovered
    assert (recovered["lastRecovery"]["kept"], recovered["lastRecovery"]["replaced"]) == (3, 1)
    pods = sorted(p["pod"] for p in recovered["participants"])
    assert pods == sorted(
        f"{run.name}-{role}-0-a{2 if role == 'environment' else 1}"
        for role in ("agent", "environment", "model", "resources")
    ), pods

    failures = [o for o in run.outcomes if isinstance(o, EpisodeFailed)]
    assert not failures, failures
    results = {o.rollout_id: o for o in run.outcomes if isinstance(o, EpisodeResult)}
    assert len(run.outcomes) == len(run.episodes), run.outcomes
    assert sorted(results) == sorted(s.rollout_id for s in run.episodes)
    held = run.episodes[0].rollout_id
    assert (results[held].attempt, results[held].continued_from) == (2, None), results[held]
    for rid, got in results.items():
        # exactly once: the attempt-2 environment started and completed one agent call for
        # each episode finished there and none for those finished under attempt 1 (before the
        # loss), and played nothing of another attempt
        attempts = run.env_stats["rollouts"].get(rid, {})
        assert set(attempts) <= {"2"}, (rid, got, attempts)
        steps = attempts.get("2", {})
        done = {step: int(events.get("completed", 0)) for step, events in steps.items()}
        assert done.get("agent", 0) == (1 if got.attempt == 2 else 0), (rid, got, done)
        assert done.get("run", 0) == (1 if got.attempt == 2 else 0), (rid, got, done)
        if got.attempt == 2:
            assert steps["agent"] == {"started": 1, "completed": 1}, (rid, got, steps)
        assert got.attempt in (1, 2), got

    refs = {r.rollout_id: r for r in run.reference if isinstance(r, EpisodeResult)}
    assert len(refs) == len(run.episodes), run.reference
    for spec in run.episodes:
        got, ref = results[spec.rollout_id], refs[f"ref-{spec.rollout_id}"]
        assert (got.reward, got.steps, got.answer) == (ref.reward, ref.steps, ref.answer), (
            got,
            ref,
        )
        if run.name in REWARDS:  # not a filler answer's 0.0: the tool calls counted once
            assert got.reward == REWARDS[run.name], (got, ref)
            assert got.steps >= 1, got


async def test_released_gym_07_environments_checkpoint_kill_recover(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """Weather, calendar, the workplace assistant and the counter from their own YAML, four
    sets at once: a checkpoint mid-episode, the environment pod SIGKILLed, Ready under attempt
    2, every episode once with its uninterrupted run's results, every counter episode rewarded
    1.0."""
    root = gym_root()
    sets = gym_sets(storage_dir)
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": sets,
            }
        ),
    )
    for rset in sets:
        cluster.kubectl(
            "wait",
            "--for=condition=Ready",
            f"rolloutset/{rset['metadata']['name']}",
            "-n",
            namespace,
            f"--timeout={READY_S}s",
        )
    runs = [
        SetRun(name, shipped_episodes(root, name, f"{name.removeprefix('gym07-')}-"), [])
        for name in ROWS
    ]
    async with anyio.create_task_group() as group:
        for run in runs:
            group.start_soon(checkpoint_kill_recover, cluster, namespace, resources, run)
    for run in runs:
        check_set(run)
    for run in runs:  # what the rows were answered with, for the test's log
        found = [
            (o.rollout_id, o.reward, o.steps) for o in run.outcomes if isinstance(o, EpisodeResult)
        ]
        print(run.name, sorted(found))
