"""Checkpoint at every point of an episode, SIGKILL every server, restore, continue.

One checkpoint captures seven episodes, each held (by a debug hook) at a different point:

  seed          the resources session is being seeded (a replay step in flight)
  between-turns the agent is parked between its turns
  held          the model finished a response while the checkpoint was open: held, recorded
  mid-gen       the model is in the middle of a generation: cut, prefix recorded
  verify-replay verification (replay mode) is in flight
  verify-wait   verification (wait mode) is in flight: the prepare waits for it
  cleanup       final cleanup is in flight: the prepare waits for it

Then every process is killed, fresh ones start under attempt 1, the checkpoint is restored into
them, and the trainer-side client, which saw its `/run` calls fail, re-issues them under the new
attempt. Each episode must finish with the answer, reward and turn count of an uninterrupted run
of the same task and seed, and the server-side counters must show that no step completed
before the checkpoint ran again (and that the model generated no completed token twice).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import httpx
from rollout_protocol import Role
from rollout_servers.client import EpisodeResult, EpisodeSpec, RolloutClient
from rollout_servers.topology import MutableTopology
from testsupport.server_processes import (
    Cluster,
    Debug,
    all_stats,
    completed_steps,
    control_status,
    deadline,
    model_calls,
    run_ok,
    started_steps,
    two_step_task,
)

MID_GEN_TOKENS = 4


async def test_checkpoint_at_every_point_survives_a_crash(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster()
    cluster.start(0)
    points = {
        "seed": two_step_task(0),
        "between-turns": two_step_task(1),
        "held": two_step_task(2),
        "mid-gen": two_step_task(3),
        "verify-replay": two_step_task(4, verify="replay"),
        "verify-wait": two_step_task(5, verify="wait"),
        "cleanup": two_step_task(6),
    }
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        env, agent, model, resources = (
            Debug(http, cluster.url(role))
            for role in (Role.ENVIRONMENT, Role.AGENT, Role.MODEL, Role.RESOURCES)
        )

        # reference: the same tasks and seeds, uninterrupted
        reference: dict[str, dict[str, Any]] = {}
        async with anyio.create_task_group() as group:
            for point, task in points.items():

                async def one(point: str = point, task: Any = task) -> None:
                    reference[point] = await run_ok(http, cluster, f"ref-{point}", 0, task)

                group.start_soon(one)

        # hold each episode at its point
        await resources.arm("seed", "seed")
        await agent.arm("turn", "between-turns", index=1)
        await model.arm("finish", "held")
        await model.arm("token", "mid-gen", index=MID_GEN_TOKENS)
        await resources.arm("verify", "verify-replay")
        await resources.arm("verify", "verify-wait")
        await env.arm("cleanup", "cleanup")

        topology = MutableTopology([cluster.url(Role.ENVIRONMENT)], attempt=0)
        client = RolloutClient(topology, restore_timeout_s=60, run_timeout_s=120)
        specs = [EpisodeSpec(point, task) for point, task in points.items()]
        results: list[EpisodeResult | Exception] = []

        async with anyio.create_task_group() as trainer:

            async def collect() -> None:
                results.extend(await client.run_all(specs))

            trainer.start_soon(collect)
            await resources.paused("seed", "seed")
            await agent.paused("turn", "between-turns")
            await model.paused("finish", "held")
            await model.paused("token", "mid-gen")
            await resources.paused("verify", "verify-replay")
            await resources.paused("verify", "verify-wait")
            await env.paused("cleanup", "cleanup")

            coordinator = cluster.coordinator(session)
            prepared: list[Any] = []

            async def prepare() -> None:
                prepared.append(await coordinator.prepare("ckpt-1", deadline(30)))

            async with anyio.create_task_group() as group:
                group.start_soon(prepare)
                # the environment's prepare waits for the wait-mode verify and the cleanup ...
                await env.reached("park")
                await resources.release("verify", "verify-wait")
                await env.release("cleanup", "cleanup")
            prepare_outcome = prepared[0]
            assert prepare_outcome.ready, prepare_outcome
            # ... and a response that finishes now, with the checkpoint open, is held
            await model.release("finish", "held")
            await model.reached("held", "held")

            commit = await coordinator.commit("ckpt-1", deadline(30), prepare_outcome.scope())
            assert commit.ok, commit.failures
            before = await all_stats(http, cluster)
            first_pids = dict(cluster.pids[0])

            # the crash: every server process dies; the client's /run calls fail
            await anyio.to_thread.run_sync(cluster.kill)
            await anyio.to_thread.run_sync(cluster.start, 1)
            assert set(cluster.pids[1].values()).isdisjoint(first_pids.values())

            restored = await coordinator.restore("ckpt-1", 1, deadline(30))
            assert restored.ok, restored.failures
            env_status = await control_status(http, cluster, Role.ENVIRONMENT)
            assert env_status["restored_episodes"] == len(points)
            resumed = await coordinator.resume("ckpt-1", deadline(30))
            assert not resumed.failures
            topology.set(1)  # the client follows the attempt and re-issues every /run

        after = await all_stats(http, cluster)

    by_id = {r.rollout_id: r for r in results if isinstance(r, EpisodeResult)}
    failures = [r for r in results if not isinstance(r, EpisodeResult)]
    assert not failures, failures
    for point in points:
        result, ref = by_id[point], reference[point]
        assert (result.answer, result.reward, result.steps) == (
            ref["answer"],
            ref["reward"],
            ref["steps"],
        ), f"{point}: continued {result} differs from uninterrupted {ref}"
        assert result.attempt == 1, point
        assert result.continued_from == 0, f"{point} did not continue from the checkpoint"

    # the checkpoint captured real progress (so the checks below are not vacuous) ...
    assert {"model@0", "tool@0"} <= completed_steps(before[Role.AGENT], "between-turns", 0)
    assert {"seed", "invoke_agent", "verify", "cleanup"} <= completed_steps(
        before[Role.ENVIRONMENT], "verify-wait", 0
    )
    assert "seed" not in completed_steps(before[Role.RESOURCES], "seed", 0)
    # ... and no step completed before the checkpoint ran again in attempt 1
    for role in (Role.ENVIRONMENT, Role.AGENT, Role.RESOURCES):
        for point in points:
            done_before = completed_steps(before[role], point, 0) - {"run"}
            again = started_steps(after[role], point, 1) & done_before
            assert not again, f"{role.value} reran {sorted(again)} of {point} after the restore"
        assert not after[role]["steps"].get("0"), "attempt-1 processes counted attempt-0 steps"
    # no episode completed twice: none of them replied before the crash
    for point in points:
        assert "run" not in completed_steps(before[Role.ENVIRONMENT], point, 0), point

    # the model generated every completed token once: attempt 0 + attempt 1 = uninterrupted
    for point in points:
        calls = model_calls(before[Role.MODEL], point)
        for turn, count in model_calls(after[Role.MODEL], point).items():
            calls[turn] = calls.get(turn, 0) + count
        assert calls == model_calls(before[Role.MODEL], f"ref-{point}"), point
    mid = model_calls(before[Role.MODEL], "mid-gen")
    assert mid == {"0": MID_GEN_TOKENS}, "the cut was not at the hooked token"
    assert model_calls(after[Role.MODEL], "held").get("0", 0) == 0, "held response regenerated"
    counters = after[Role.MODEL]["counters"]["1"]
    assert counters.get("held_restored") == 1
    assert counters.get("cuts_continued") == 1

    # the held episodes were captured after their wait steps and replied from the record
    for point in ("verify-wait", "cleanup"):
        assert started_steps(after[Role.ENVIRONMENT], point, 1) == {"run"}, point
