"""Restored episodes whose replacement `/run` has not started yet.

Two episodes are checkpointed between agent turns and every process is killed. After the restore
under attempt 1 nobody claims them; a second checkpoint's commit scope keeps only one of them,
which releases the other everywhere. A second crash follows, and under attempt 2 the kept episode
still continues from the boundary recorded in attempt 0 (nothing it completed there runs again),
while the released one starts from scratch. Both finish with the answer of an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import httpx
from rollout_protocol import ErrorCode, Role
from testsupport.server_processes import (
    Cluster,
    Debug,
    all_stats,
    completed_steps,
    control_status,
    deadline,
    run,
    run_ok,
    run_until_crash,
    started_steps,
    two_step_task,
)


async def test_second_crash_continues_and_scope_releases(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster()
    cluster.start(0)
    kept, dropped = "kept", "dropped"
    tasks = {kept: two_step_task(7), dropped: two_step_task(8)}
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = {
            rid: await run_ok(http, cluster, f"ref-{rid}", 0, t) for rid, t in tasks.items()
        }
        agent = Debug(http, cluster.url(Role.AGENT))
        for rid in tasks:
            await agent.arm("turn", rid, index=1)

        async with anyio.create_task_group() as group:
            for rid, task in tasks.items():
                group.start_soon(run_until_crash, http, cluster, rid, 0, task)
            for rid in tasks:
                await agent.paused("turn", rid)
            coordinator = cluster.coordinator(session)
            first = await coordinator.checkpoint("ckpt-a", prepare_timeout=20, commit_timeout=20)
            assert first.ok, first.message
            before = await all_stats(http, cluster)
            await anyio.to_thread.run_sync(cluster.kill)

        await anyio.to_thread.run_sync(cluster.start, 1)
        restored = await coordinator.restore("ckpt-a", 1, deadline(30))
        assert restored.ok, restored.failures
        assert not (await coordinator.resume("ckpt-a", deadline(30))).failures

        # nobody claimed them; the next checkpoint exports them again, but its scope keeps one
        second = await coordinator.checkpoint(
            "ckpt-b", prepare_timeout=20, commit_timeout=20, scope=[kept]
        )
        assert second.ok, second.message
        assert second.commit is not None
        assert second.commit.scope == [kept]
        for role in Role:
            status = await control_status(http, cluster, role)
            assert status["restored_episodes"] == 1, f"{role.value} did not release {dropped}"
        await anyio.to_thread.run_sync(cluster.kill)

        await anyio.to_thread.run_sync(cluster.start, 2)
        restored = await coordinator.restore("ckpt-b", 2, deadline(30))
        assert restored.ok, restored.failures
        assert {e.rollout_id for e in restored.episodes} == {kept}
        assert not (await coordinator.resume("ckpt-b", deadline(30))).failures

        # a continuation must bring the task it recorded
        wrong = await run(http, cluster, kept, 2, tasks[dropped])
        assert wrong.status_code == 409, wrong.text
        assert wrong.json()["error"]["code"] == ErrorCode.TASK_MISMATCH
        # and the attempt the servers run now
        stale = await run(http, cluster, kept, 1, tasks[kept])
        assert stale.json()["error"]["code"] == ErrorCode.ATTEMPT_MISMATCH, stale.text

        results = {rid: await run_ok(http, cluster, rid, 2, task) for rid, task in tasks.items()}
        after = await all_stats(http, cluster)

    for rid in tasks:
        got, ref = results[rid], reference[rid]
        assert (got["answer"], got["reward"], got["steps"]) == (
            ref["answer"],
            ref["reward"],
            ref["steps"],
        ), rid
    assert results[kept]["continued_from"] == 1  # attempt 1 exported it again, unclaimed
    assert results[dropped]["continued_from"] is None
    done_in_0 = completed_steps(before[Role.AGENT], kept, 0)
    assert {"model@0", "tool@0"} <= done_in_0
    assert not started_steps(after[Role.AGENT], kept, 2) & done_in_0
    assert {"model@0", "tool@0"} <= started_steps(after[Role.AGENT], dropped, 2)
