"""The examples, as a user runs them: apply, wait Ready, checkpoint while episodes run, lose the
model pod mid-generation, recover under attempt 2, and finish every episode as if nothing
happened.

One RolloutSet (the four reference servers of `examples/`) serves the whole story, because each
step needs the state the previous one left: the checkpoint that recovery restores is the one
taken while episodes ran. A second set whose model asks for 99 GPUs runs beside it and must end
Degraded with a reason while the operator keeps serving the first.

Determinism without sleeps: the model server runs with `--debug-hooks`, and one episode is held
at its third token (`token` pause point, outside any step, so a checkpoint parks it), so that
episode is provably mid-generation both when the checkpoint cuts it and when the pod is killed.
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
    RecoveredRun,
    Resources,
    check_manifests,
    check_recovered_run,
    condition,
    example_checkpoint,
    example_set,
    is_true,
    participants_by_role,
    phase_is,
    stats,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for
from harness.measures import checkpoint_records

EPISODES = 24
SEED = 11
HELD_AT_TOKEN = 2


def write_examples(folder: Path, storage: Path) -> None:
    """The two example manifests with the storage moved to this test's folder."""
    folder.mkdir()
    rset = example_set(storage, extra_args={"model": ["--debug-hooks"]})
    (folder / "rolloutset.yaml").write_text(yaml.safe_dump(rset))
    (folder / "rolloutcheckpoint.yaml").write_text(
        yaml.safe_dump(example_checkpoint("math-rl-manual-1"))
    )


async def test_examples_checkpoint_then_model_pod_killed_mid_generation(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    examples = tmp_path / "examples"
    write_examples(examples, storage_dir)
    no_gpus = example_set(storage_dir, name="no-gpus", spec={"progressDeadlineSeconds": 5})
    for participant in no_gpus["spec"]["participants"]:
        if participant["role"] == "model":
            container = participant["template"]["spec"]["containers"][0]
            container["resources"] = {"limits": {"nvidia.com/gpu": 99}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(no_gpus))

    # kubectl apply -f examples/ ; kubectl wait --for=condition=Ready rolloutset/math-rl
    cluster.kubectl("apply", "-n", namespace, "-f", str(examples))
    cluster.kubectl(
        "wait", "--for=condition=Ready", "rolloutset/math-rl", "-n", namespace, "--timeout=90s"
    )
    first = await resources.wait_checkpoint(
        "math-rl-manual-1", "Ready or Failed", phase_is("Ready", "Failed"), 60
    )
    assert is_true(first, "Ready"), first["status"]
    check_manifests(first, storage_dir)

    ready = await resources.rollout_set()
    token = await resources.control_token()
    assert ready["status"]["attempt"] == 1
    model = participants_by_role(ready)["model"][0]
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    outcomes: list[EpisodeResult | EpisodeFailed] = []
    seen_recovering: list[dict[str, Any]] = []

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        await Debug(http, model["address"]).arm("token", held, index=HELD_AT_TOKEN)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        async with anyio.create_task_group() as group:

            async def run_episodes() -> None:
                outcomes.extend(await client.run_all(specs))

            group.start_soon(run_episodes)
            await Debug(http, model["address"]).paused("token", held)
            # Every episode begun at the environment first: a `/run` that reaches it after its
            # prepare is parked at its first boundary and written, but not counted in the
            # checkpoint's episodes (docs/design.md section 10, "A checkpoint's episode count")
            environment = participants_by_role(ready)["environment"][0]["address"]

            async def all_begun() -> bool:
                begun = (await stats(http, environment, token)).get("rollouts") or {}
                return all(spec.rollout_id in begun for spec in specs)

            await wait_for(all_begun, 60, "every episode begun at the environment")

            # A checkpoint while episodes run (one of them held mid-generation).
            name = "math-rl-running"
            cluster.kubectl(
                "apply", "-n", namespace, "-f", "-", input=json.dumps(example_checkpoint(name))
            )
            ckpt = await resources.wait_checkpoint(
                name, "Ready or Failed", phase_is("Ready", "Failed"), 60
            )
            assert is_true(ckpt, "Ready"), ckpt["status"]
            status = ckpt["status"]
            assert status["attempt"] == 1
            assert status["episodes"] >= 1
            assert status["restarts"] == 0
            assert is_true(ckpt, "Committed")
            assert is_true(ckpt, "Prepared")
            assert status["durations"]["pauseSeconds"] >= 0
            check_manifests(ckpt, storage_dir)

            # SIGKILL the model while it generates (the held episode is mid-generation).
            killed = await cluster.admin.kill_pod_async(namespace, model["pod"])
            assert killed

            def recovering(obj: dict[str, Any]) -> bool:
                if is_true(obj, "Recovering"):
                    seen_recovering.append(obj)
                    return True
                return False

            await resources.wait_set("Recovering", recovering, 30)
            recovered = await resources.wait_set(
                "Ready under attempt 2",
                # latestCheckpoint: written by the set's pass right after the recovery
                lambda o: (
                    o["status"].get("attempt") == 2
                    and is_true(o, "Ready")
                    and bool(o["status"].get("latestCheckpoint"))
                ),
                90,
            )

        # The same tasks, uninterrupted, on the recovered set: the reference.
        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        a2 = participants_by_role(recovered)
        new_stats = {
            role: await stats(http, a2[role][0]["address"], token)
            for role in ("environment", "agent", "model")
        }

    # --- the recovery, as the API shows it
    during = seen_recovering[0]
    # The loss as the recovery recorded it (the Recovering condition's reason moves on to the
    # phase names within milliseconds; the record keeps the loss for the whole recovery).
    assert during["status"]["recovery"]["reason"] == "PodFailed"
    assert condition(during, "Ready")["status"] == "False"  # type: ignore[index]
    assert recovered["status"]["restarts"] == 1
    assert recovered["status"]["latestCheckpoint"] == name
    assert condition(recovered, "Recovering")["reason"] == "Restored"  # type: ignore[index]
    assert sorted(p["pod"] for p in recovered["status"]["participants"]) == [
        "math-rl-agent-0-a2",
        "math-rl-environment-0-a2",
        "math-rl-model-0-a2",
        "math-rl-resources-0-a2",
    ]

    # --- every episode finished once, with the reward of the uninterrupted run; none
    # completed twice; nothing completed before the checkpoint ran again
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
    # The held episode was cut at the checkpoint and was mid-generation at the kill: it
    # continued from its two recorded tokens.
    assert results[held].attempt == 2
    assert results[held].continued_from == 1
    cut = {
        f"{r.rollout_id}/{r.key}": r.data["state"]["tokens"]
        for r in checkpoint_records(storage_dir, "math-rl", name)["model-0"]
        if r.kind == "generation"
    }
    assert cut[f"{held}/0"] == HELD_AT_TOKEN
    tokens = new_stats["model"]["tokens"]["2"]["by_request"]
    assert tokens[f"{held}/0"] == tokens[f"{reference_specs[0].rollout_id}/0"] - HELD_AT_TOKEN

    # --- the other set never started; it is Degraded with the scheduler's reason
    stuck = await resources.wait_set(
        "Degraded", lambda o: is_true(o, "Degraded"), 30, name="no-gpus"
    )
    degraded = condition(stuck, "Degraded")
    assert degraded is not None
    assert degraded["reason"] == "PodsNotStarting"
    assert "no-gpus-model-0-a1" in degraded["message"]
    assert "Insufficient nvidia.com/gpu" in degraded["message"]
    assert condition(stuck, "Ready")["status"] == "False"  # type: ignore[index]
