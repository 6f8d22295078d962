"""A corrupt checkpoint must not take the set down (docs/operations.md#failure-modes, class 9).

Two Ready checkpoints are taken while an episode is held mid-generation; the newer one's model
records are then damaged on storage (one byte flipped). When the model pod is killed, the
restore of the newer checkpoint fails verification on the fresh model pod. That failure is
permanent for that checkpoint: it turns Ready=False (reason RecordsInvalid), the set's
`latestCheckpoint` moves to the older one, and the next try restores the older checkpoint.
Every episode then finishes exactly once, and the damaged checkpoint can be deleted (its
finalizer does not hang on a recovery that still names it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    Debug,
    OperatorProcess,
    Resources,
    checkpoint_ready,
    condition,
    episodes_running,
    example_set,
    is_true,
    participants_by_role,
)

from devcluster.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.adversarial]  # fault timings

EPISODES = 8
SEED = 31
HELD_AT_TOKEN = 2


def flip_a_byte(storage: Path, checkpoint: str, instance: str) -> Path:
    """Damage the records file of one participant of a checkpoint, wherever the layout puts it."""
    (records,) = [
        path
        for path in storage.rglob("records-*.jsonl")
        if path.parent.name == instance and path.parent.parent.name == checkpoint
    ]
    data = bytearray(records.read_bytes())
    assert data, f"{records} is empty"
    data[len(data) // 2] ^= 0x01
    records.write_bytes(bytes(data))
    return records


async def checkpoint(cluster: Cluster, namespace: str, resources: Resources, name: str) -> None:
    ckpt = await checkpoint_ready(cluster, resources, name)
    assert ckpt["status"]["episodes"] >= 1


async def corrupt_the_latest_and_kill_the_model(
    cluster: Cluster,
    namespace: str,
    resources: Resources,
    storage_dir: Path,
    checkpoints: Sequence[str],
    recovered: str,
    done: Callable[[dict[str, Any]], bool],
) -> tuple[list[EpisodeResult | EpisodeFailed], dict[str, Any], str]:
    """The example set runs `EPISODES` episodes, one held mid-generation; `checkpoints` are
    taken in order, the model records of the last one damaged, and the model pod killed.
    Returns every episode's outcome, the set once `done` (`recovered` says what that waits
    for), and the held rollout's id."""
    rset = example_set(
        storage_dir,
        extra_args={"model": ["--debug-hooks"]},
        spec={"recovery": {"maxRestarts": 1, "restoreTimeoutSeconds": 90}},
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rset))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    model = participants_by_role(ready)["model"][0]
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        debug = Debug(http, model["address"])
        await debug.arm("token", held, index=HELD_AT_TOKEN)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=180, run_timeout_s=240
        )
        async with episodes_running(client, specs) as outcomes:
            await debug.paused("token", held)
            for name in checkpoints:
                await checkpoint(cluster, namespace, resources, name)
            flip_a_byte(storage_dir, checkpoints[-1], "model-0")
            assert await cluster.admin.kill_pod_async(namespace, model["pod"])
            after = await resources.wait_set(recovered, done, 180)
    return list(outcomes), after, held


async def test_a_corrupt_latest_checkpoint_falls_back_to_the_older_one(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    outcomes, after, held = await corrupt_the_latest_and_kill_the_model(
        cluster,
        namespace,
        resources,
        storage_dir,
        ["older", "newer"],
        "Ready again, restored from the older checkpoint",
        lambda o: (
            (o["status"].get("attempt") or 0) >= 2
            and is_true(o, "Ready")
            and ((o["status"].get("lastRecovery") or {}).get("checkpoint") == "older")
            # the set's pass moves latestCheckpoint off the invalid one
            and o["status"].get("latestCheckpoint") == "older"
        ),
    )

    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failed, failed
    results = {o.rollout_id: o for o in outcomes if isinstance(o, EpisodeResult)}
    assert len(results) == EPISODES
    assert results[held].continued_from == 1, results[held]

    # The damaged checkpoint is marked, and no longer what a recovery restores.
    newer = await resources.checkpoint("newer")
    ready = condition(newer, "Ready")
    assert ready is not None
    assert ready["status"] == "False"
    assert ready["reason"] == "RecordsInvalid"
    assert "model-0" in ready["message"]
    assert newer["status"]["phase"] == "Failed"
    assert after["status"]["latestCheckpoint"] == "older"
    assert not after["status"].get("recovery"), "no recovery phase is left behind"
    recovering = condition(after, "Recovering")
    assert recovering is not None
    assert recovering["reason"] == "Restored"
    # The invalid checkpoint did not use up a try (maxRestarts 1 would have stopped at two).
    assert after["status"]["lastRecovery"]["checkpoint"] == "older"
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    assert any(e["reason"] == "CheckpointInvalid" for e in events["items"]), [
        e["reason"] for e in events["items"]
    ]

    # Deleting it completes: nothing holds its finalizer any more.
    cluster.kubectl("delete", "rckpt", "newer", "-n", namespace, "--timeout=30s")
    gone = cluster.kubectl("get", "rckpt", "newer", "-n", namespace, check=False)
    assert gone.returncode != 0


async def test_a_corrupt_only_checkpoint_falls_back_to_a_fresh_start(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """With no older Ready checkpoint to fall back to, the next try starts fresh: the recovery
    forgets the damaged checkpoint's name (it is not restored again), every episode of the lost
    attempt starts over, and each finishes exactly once."""
    outcomes, after, held = await corrupt_the_latest_and_kill_the_model(
        cluster,
        namespace,
        resources,
        storage_dir,
        ["only"],
        "Ready again, started fresh",
        lambda o: (
            (o["status"].get("attempt") or 0) >= 2
            and is_true(o, "Ready")
            and not o["status"].get("recovery")
            and bool(o["status"].get("lastRecovery"))
        ),
    )

    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failed, failed
    results = {o.rollout_id: o for o in outcomes if isinstance(o, EpisodeResult)}
    assert len(results) == EPISODES
    assert results[held].continued_from is None, results[held]
    assert "checkpoint" not in after["status"]["lastRecovery"], after["status"]["lastRecovery"]
    degraded = condition(after, "Degraded")
    assert degraded is None or degraded["status"] != "True", degraded
    invalid = condition(await resources.checkpoint("only"), "Ready")
    assert invalid is not None
    assert invalid["reason"] == "RecordsInvalid"
