"""Restored episodes whose replacement `/run` has not started yet, and an episode whose `/run`
reached the environment after its prepare replied.

Two episodes are checkpointed between agent turns and every process is killed. After the restore
under attempt 1 nobody claims them; a second checkpoint's commit scope keeps only one of them,
which releases the other everywhere. A second crash follows, and under attempt 2 the kept episode
still continues from the boundary recorded in attempt 0 (nothing it completed there runs again),
while the released one starts from scratch. Both finish with the answer of an uninterrupted run.

A `/run` that reaches the environment between its prepare and the commit is registered, parked at
its first boundary and written by the commit of the whole set: the checkpoint counts it (the
commit replies' count, not the prepare's), and a restore continues it.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import httpx
from rollout_protocol import ErrorCode, Role
from rollout_protocol import _storage as storage
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


def assert_as_uninterrupted(
    results: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]]
) -> None:
    """Every episode's answer, reward and steps are its uninterrupted run's."""
    for rid, ref in reference.items():
        got = results[rid]
        assert (got["answer"], got["reward"], got["steps"]) == (
            ref["answer"],
            ref["reward"],
            ref["steps"],
        ), rid


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

    assert_as_uninterrupted(results, reference)
    assert results[kept]["continued_from"] == 1  # attempt 1 exported it again, unclaimed
    assert results[dropped]["continued_from"] is None
    done_in_0 = completed_steps(before[Role.AGENT], kept, 0)
    assert {"model@0", "tool@0"} <= done_in_0
    assert not started_steps(after[Role.AGENT], kept, 2) & done_in_0
    assert {"model@0", "tool@0"} <= started_steps(after[Role.AGENT], dropped, 2)


async def test_a_run_after_the_prepare_is_counted_and_continued(make_cluster: Any) -> None:
    """docs/protocol.md, "Commit scope": the checkpoint's count is what its records hold."""
    cluster: Cluster = make_cluster()
    cluster.start(0)
    early, late = "count-early", "count-late"
    tasks = {early: two_step_task(15), late: two_step_task(16)}
    cid = "ckpt-late-run"
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = {
            rid: await run_ok(http, cluster, f"ref-{rid}", 0, t) for rid, t in tasks.items()
        }
        agent = Debug(http, cluster.url(Role.AGENT))
        env = Debug(http, cluster.url(Role.ENVIRONMENT))
        await agent.arm("turn", early, index=1)
        await env.arm("seed", late)  # after the resume it stays in its first step until the crash
        coordinator = cluster.coordinator(session)

        async with anyio.create_task_group() as group:
            group.start_soon(run_until_crash, http, cluster, early, 0, tasks[early])
            await agent.paused("turn", early)
            prepared = await coordinator.prepare(cid, deadline(20))
            assert prepared.ready, prepared
            assert prepared.episode_count == 1
            # the environment's admission is closed: the /run is registered, parked at `seed`
            group.start_soon(run_until_crash, http, cluster, late, 0, tasks[late])
            await env.reached("begun", late)
            cut = await coordinator.commit(
                cid,
                deadline(20),
                prepared.scope(),
                excluded=prepared.excluded(),
                persist_after_resume=True,
            )
            assert cut.ok, cut.failures
            assert not (await coordinator.resume(cid, deadline(20))).failures
            persisted = await coordinator.persist(cid, deadline(20), cut=cut)
            assert persisted.ok, persisted.failures
            await env.paused("seed", late)
            await anyio.to_thread.run_sync(cluster.kill)

        held: dict[Role, set[str]] = {}
        for relative in persisted.manifest_paths.values():
            directory = (cluster.checkpoint_root / relative).parent
            manifest, records = storage.read_records(directory, expect_checkpoint_id=cid)
            # the model's delivered responses are records of finished rollouts, no episode
            held[manifest.role] = {r.rollout_id for r in records if r.kind != "delivered"}
        assert held[Role.ENVIRONMENT] == {early, late}
        # the count the operator reports (status.episodes) and the CLI's message say so too
        assert cut.episode_count(prepared) == max(len(ids) for ids in held.values()) == 2
        assert persisted.episode_count(prepared) == 2

        await anyio.to_thread.run_sync(cluster.start, 1)
        restored = await coordinator.restore(cid, 1, deadline(30))
        assert restored.ok, restored.failures
        assert {e.rollout_id for e in restored.episodes} >= {early, late}
        assert not (await coordinator.resume(cid, deadline(30))).failures
        results = {rid: await run_ok(http, cluster, rid, 1, task) for rid, task in tasks.items()}

    assert_as_uninterrupted(results, reference)
    assert results[late]["continued_from"] == 0  # its record of attempt 0, not a fresh start
    assert results[early]["continued_from"] == 0
