"""The model role as a sidecar pod (`examples/model-sidecar/rolloutset.yaml`): an inference
server in one container (here `rollout-server model --backend builtin`, serving /v1 only) and
`rollout-server model --backend openai` beside it as the checkpoint participant.

The story: a checkpoint cuts a generation that streams through the sidecar from its upstream,
the whole model pod (both containers) is SIGKILLed, the operator recovers under attempt 2, and
the cut generation continues from its recorded prefix through the fresh pod's upstream (vLLM's
`continue_final_message`, which the builtin engine honours). Every episode finishes once, with
the answer of an uninterrupted run. Then only the inference container dies: the pod stays
Running (the sidecar still runs), and the operator must still see it as lost.

Determinism without sleeps: the sidecar runs with `--debug-hooks`, and one episode is held at
its third token (`token` pause point, outside any step), so it is provably mid-generation both
when the checkpoint cuts it and when the pod is killed.
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
    check_recovered_run,
    example_checkpoint,
    is_true,
    participants_by_role,
    phase_is,
    pod_pids,
    stats,
)

from devcluster.cluster import Cluster
from harness.measures import checkpoint_records
from harness.objects import with_storage

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model-sidecar"
SET = "math-rl"
EPISODES = 12
SEED = 23
HELD_AT_TOKEN = 2
UPSTREAM_PORT = 8001


def sidecar_set(storage: Path) -> dict[str, Any]:
    """The example with its storage moved to this test's folder and the sidecar's debug hooks."""
    obj = with_storage(yaml.safe_load((EXAMPLES / "rolloutset.yaml").read_text()), storage)
    (model,) = [p for p in obj["spec"]["participants"] if p["role"] == "model"]
    (sidecar,) = [c for c in model["template"]["spec"]["containers"] if c["name"] != "inference"]
    sidecar["args"] = [*sidecar["args"], "--debug-hooks"]
    return obj


def upstream_url(sidecar_address: str) -> str:
    """The inference container of the same pod: the pod IP, its own port."""
    host = httpx.URL(sidecar_address).host
    return f"http://{host}:{UPSTREAM_PORT}"


def tokens_of(reply: dict[str, Any], attempt: int) -> dict[str, int]:
    by: dict[str, int] = ((reply.get("tokens") or {}).get(str(attempt)) or {}).get(
        "by_request"
    ) or {}
    return by


async def test_sidecar_model_pod_cut_killed_and_continued(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    # The vLLM manifest is accepted by the API server as written (CRD schema and CEL rules).
    cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(EXAMPLES / "vllm.yaml"))

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(sidecar_set(storage_dir)))
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"rolloutset/{SET}", "-n", namespace, "--timeout=90s"
    )
    ready = await resources.rollout_set(SET)
    token = await resources.control_token(SET)
    assert ready["status"]["attempt"] == 1
    model = participants_by_role(ready)["model"][0]
    # devcluster runs both containers of the pod, each as its own process group
    assert len(pod_pids(cluster, namespace, model["pod"])) == 2

    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    outcomes: list[EpisodeResult | EpisodeFailed] = []
    seen_recovering: list[dict[str, Any]] = []
    name = "sidecar-running"

    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        hooks = Debug(http, model["address"])
        await hooks.arm("token", held, index=HELD_AT_TOKEN)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=120, run_timeout_s=180
        )
        async with anyio.create_task_group() as group:

            async def run_episodes() -> None:
                outcomes.extend(await client.run_all(specs))

            group.start_soon(run_episodes)
            await hooks.paused("token", held)

            # A checkpoint while episodes run, one of them held mid-generation in the sidecar.
            cluster.kubectl(
                "apply",
                "-n",
                namespace,
                "-f",
                "-",
                input=json.dumps(example_checkpoint(name, SET)),
            )
            ckpt = await resources.wait_checkpoint(
                name, "Ready or Failed", phase_is("Ready", "Failed"), 60
            )
            assert is_true(ckpt, "Ready"), ckpt["status"]
            assert ckpt["status"]["attempt"] == 1
            assert ckpt["status"]["restarts"] == 0
            # the tokens so far came from the upstream container, not from the sidecar
            first_upstream = await stats(http, upstream_url(model["address"]), token)
            assert sum(tokens_of(first_upstream, 1).values()) >= HELD_AT_TOKEN

            # SIGKILL the whole model pod: the sidecar and its inference server.
            killed = await cluster.admin.kill_pod_async(namespace, model["pod"])
            assert len(killed) == 2

            def recovering(obj: dict[str, Any]) -> bool:
                if is_true(obj, "Recovering"):
                    seen_recovering.append(obj)
                    return True
                return False

            await resources.wait_set("Recovering", recovering, 30, name=SET)
            recovered = await resources.wait_set(
                "Ready under attempt 2",
                # latestCheckpoint: written by the set's pass right after the recovery
                lambda o: (
                    o["status"].get("attempt") == 2
                    and is_true(o, "Ready")
                    and bool(o["status"].get("latestCheckpoint"))
                ),
                90,
                name=SET,
            )

        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        a2 = participants_by_role(recovered)
        new_stats = {
            role: await stats(http, a2[role][0]["address"], token)
            for role in ("environment", "agent", "model")
        }
        new_upstream = await stats(http, upstream_url(a2["model"][0]["address"]), token)

    # --- the recovery
    # The loss as the recovery recorded it (the Recovering condition's reason moves on to the
    # phase names within milliseconds; the record keeps the loss for the whole recovery).
    assert seen_recovering[0]["status"]["recovery"]["reason"] == "PodFailed"
    assert recovered["status"]["restarts"] == 1
    assert recovered["status"]["latestCheckpoint"] == name
    assert a2["model"][0]["pod"] == f"{SET}-model-0-a2"

    # --- every episode finished once, as uninterrupted; nothing completed twice
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

    # --- the cut generation: recorded with a non-empty prefix, continued from it
    cut = {
        f"{r.rollout_id}/{r.key}": r.data
        for r in checkpoint_records(storage_dir, SET, name)["model-0"]
        if r.kind == "generation"
    }
    held_cut = cut[f"{held}/0"]
    assert held_cut["step"] == "generate"
    assert held_cut["state"]["tokens"] == HELD_AT_TOKEN
    assert held_cut["state"]["text"].strip()
    assert results[held].attempt == 2
    assert results[held].continued_from == 1
    model_stats = new_stats["model"]
    assert model_stats["counters"]["2"]["cuts_continued"] >= 1
    sidecar_tokens = tokens_of(model_stats, 2)
    ref_key = f"{reference_specs[0].rollout_id}/0"
    assert sidecar_tokens[f"{held}/0"] == sidecar_tokens[ref_key] - HELD_AT_TOKEN
    # every token the new sidecar relayed was generated by the fresh pod's upstream
    assert sum(tokens_of(new_upstream, 2).values()) == sum(sidecar_tokens.values())

    # --- only the inference server dies: the pod stays Running (the sidecar runs on), and the
    # operator must still replace it
    killed = await cluster.admin.kill_pod_async(namespace, a2["model"][0]["pod"], "inference")
    assert len(killed) == 1
    seen_recovering.clear()
    await resources.wait_set("Recovering again", recovering, 30, name=SET)
    lost = seen_recovering[0]["status"]["recovery"]
    assert lost["reason"] == "PodFailed"
    assert "container inference exited with code 137" in lost["message"]
    third = await resources.wait_set(
        "Ready under attempt 3",
        lambda o: o["status"].get("attempt") == 3 and is_true(o, "Ready"),
        90,
        name=SET,
    )
    assert third["status"]["restarts"] == 2
