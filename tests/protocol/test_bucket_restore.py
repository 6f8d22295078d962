"""A set whose records are only in an S3-API bucket survives the loss of every process.

The four reference servers run as processes with the `ROLLOUT_STORAGE_S3_*` environment a pod of
such a set gets (no checkpoint volume at all) against the real S3 server of `make s3-server`.
An episode is checkpointed between its agent turns (cut, resume, then persisted to the bucket)
and published there (the no-operator path: `checkpoint.json` last), every process is killed,
and fresh processes under attempt 1 restore from the bucket alone; the episode then finishes with
the answer of an uninterrupted run, without repeating what it completed before the crash.
Finally `rollout-records remove`, as a cleanup pod runs it, removes the checkpoint's keys from
the bucket and only those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import obstore
from rollout_protocol import BucketStore, Role, bucket_from_env
from testsupport.s3_server import S3Bucket
from testsupport.server_processes import (
    SET_NAME,
    Cluster,
    Debug,
    all_stats,
    completed_steps,
    deadline,
    run_ok,
    run_until_crash,
    started_steps,
    two_step_task,
)

PREFIX = "records/prod"


def _keys(bucket: S3Bucket, below: str) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(bucket.store(), below) for meta in batch)


async def test_a_set_restores_from_the_bucket_after_every_process_is_killed(
    make_cluster: Any, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    env = {
        **s3_bucket.env(s3_bucket.write_credentials(tmp_path / "secret"), prefix=PREFIX),
        "ROLLOUT_CHECKPOINT_ROOT": "",  # no volume: the bucket is the set's only storage
    }
    config = bucket_from_env(env)
    assert config is not None
    cluster: Cluster = make_cluster(env=env)
    cluster.start(0)
    rid, task = "held", two_step_task(11)
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = await run_ok(http, cluster, "reference", 0, task)
        agent = Debug(http, cluster.url(Role.AGENT))
        await agent.arm("turn", rid, index=1)
        async with anyio.create_task_group() as group:
            group.start_soon(run_until_crash, http, cluster, rid, 0, task)
            await agent.paused("turn", rid)
            coordinator = cluster.coordinator(session)
            result = await coordinator.checkpoint(
                "ckpt-a",
                prepare_timeout=20,
                commit_timeout=20,
                publish_dir=BucketStore(config),
                set_name=SET_NAME,
                persist_after_resume=True,
            )
            assert result.ok, result.message
            before = await all_stats(http, cluster)
            await anyio.to_thread.run_sync(cluster.kill)

        base = f"{PREFIX}/{SET_NAME}/ckpt-a/"
        assert result.published == f"s3://{s3_bucket.name}/{base}checkpoint.json"
        stored = _keys(s3_bucket, base)
        for role in Role:
            assert f"{base}{role.value}-0/manifest.json" in stored, stored
        assert not cluster.checkpoint_root.exists(), "nothing went to a volume"

        await anyio.to_thread.run_sync(cluster.start, 1)
        restored = await coordinator.restore("ckpt-a", 1, deadline(30))
        assert restored.ok, restored.failures
        assert {episode.rollout_id for episode in restored.episodes} == {rid}
        assert not (await coordinator.resume("ckpt-a", deadline(30))).failures
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

    removed = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [
                *(sys.executable, "-m", "rollout_protocol._records_cli", "remove"),
                *("--set-dir", SET_NAME, "--checkpoint", "ckpt-a"),
            ],
            env={**os.environ, **env},
            capture_output=True,
            timeout=60,
            check=False,
        )
    )
    assert removed.returncode == 0, removed.stderr.decode()
    assert json.loads(removed.stdout)["removed"] == ["ckpt-a"]
    assert _keys(s3_bucket, base) == []
