"""A set whose records are only in an S3-API bucket survives the loss of every process.

The four reference servers run as processes with the `ROLLOUT_STORAGE_S3_*` environment a pod of
such a set gets (no checkpoint volume at all) against the real S3 server of `make s3-server`.
An episode is checkpointed between its agent turns by `rollout-coordinate` (cut, resume, then
persisted to the bucket and published there: the no-operator path, `checkpoint.json` last),
every process is killed, and `rollout-coordinate restore` brings fresh processes under attempt 1
back from the bucket alone; the episode then finishes with
the answer of an uninterrupted run, without repeating what it completed before the crash.
Finally `rollout-records remove`, as a cleanup pod runs it, removes the checkpoint's keys from
the bucket and only those.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import obstore
from rollout_protocol import Role
from testsupport.s3_server import S3Bucket
from testsupport.server_processes import (
    SET_NAME,
    TOKEN,
    Cluster,
    Debug,
    all_stats,
    completed_steps,
    run_ok,
    run_until_crash,
    started_steps,
    two_step_task,
)

PREFIX = "records/prod"


def _keys(bucket: S3Bucket, below: str) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(bucket.store(), below) for meta in batch)


def _coordinate(command: str, cluster: Cluster, env: dict[str, str], *args: str) -> list[str]:
    """`rollout-coordinate <command>` for the cluster's participants, without `--dir`: the
    bucket of the `ROLLOUT_STORAGE_S3_*` variables in `env`."""
    participants = [f"--participant={role.value}={cluster.url(role)}" for role in Role]
    return [sys.executable, "-m", "rollout_protocol._cli", command, *participants, *args]


async def _run(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    done = await anyio.run_process(command, env={**os.environ, **env}, check=False)
    assert done.returncode == 0, done.stderr.decode()
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


async def test_a_set_restores_from_the_bucket_after_every_process_is_killed(
    make_cluster: Any, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    env = {
        **s3_bucket.env(s3_bucket.write_credentials(tmp_path / "secret"), prefix=PREFIX),
        "ROLLOUT_CHECKPOINT_ROOT": "",  # no volume: the bucket is the set's only storage
        "ROLLOUT_CONTROL_TOKEN": TOKEN,
    }
    cluster: Cluster = make_cluster(env=env)
    cluster.start(0)
    rid, task = "held", two_step_task(11)
    async with httpx.AsyncClient(timeout=60) as http:
        reference = await run_ok(http, cluster, "reference", 0, task)
        agent = Debug(http, cluster.url(Role.AGENT))
        await agent.arm("turn", rid, index=1)
        async with anyio.create_task_group() as group:
            group.start_soon(run_until_crash, http, cluster, rid, 0, task)
            await agent.paused("turn", rid)
            # cut, resume, persist to the bucket, then checkpoint.json there
            checkpoint = _coordinate("checkpoint", cluster, env, "--checkpoint-id", "ckpt-a")
            result = await _run(checkpoint, env)
            assert result["ok"] is True, result["message"]
            before = await all_stats(http, cluster)
            await anyio.to_thread.run_sync(cluster.kill)

        base = f"{PREFIX}/{SET_NAME}/ckpt-a/"
        assert result["published"] == f"s3://{s3_bucket.name}/{base}checkpoint.json"
        stored = _keys(s3_bucket, base)
        for role in Role:
            assert f"{base}{role.value}-0/manifest.json" in stored, stored
        assert not cluster.checkpoint_root.exists(), "nothing went to a volume"

        await anyio.to_thread.run_sync(cluster.start, 1)
        # the latest checkpoint published in the bucket, under attempt 1, then resumed
        restored = await _run(_coordinate("restore", cluster, env), env)
        assert restored["ok"] is True, restored
        assert restored["restore"]["attempt"] == 1
        finished = await run_ok(http, cluster, rid, 1, task)
        after = await all_stats(http, cluster)

    assert (finished["answer"], finished["reward"], finished["steps"]) == (
        reference["answer"],
        reference["reward"],
        reference["steps"],
    )
    assert finished["continued_from"] == 0
    done_before = completed_steps(before[Role.AGENT], rid, 0)
    assert {"model@0", "tool@0"} <= done_before
    assert not started_steps(after[Role.AGENT], rid, 1) & done_before

    remove = [sys.executable, "-m", "rollout_protocol._records_cli", "remove"]
    removed = await _run([*remove, "--set-dir", SET_NAME, "--checkpoint", "ckpt-a"], env)
    assert removed["removed"] == ["ckpt-a"]
    assert _keys(s3_bucket, base) == []
