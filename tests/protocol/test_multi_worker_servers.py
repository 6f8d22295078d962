"""Reference servers with several worker processes (`rollout-server ... --workers 3`), as real
processes on loopback (docs/protocol.md, "Workers").

- The conformance kit passes against a 3-worker environment (the single-participant rules) and
  across a crash and restore of a set whose environment, agent and resources run 3 workers.
- The kit's workers' rules (`workers.park-all` by `check_workers_park_all`, with one episode
  inside the environment's wait step; `workers.restore-all` and `workers.repeat-run` inside
  `check_crash_restore`, with one rollout per worker), and the same behaviours step by step
  here: an episode parked in one worker while another worker's episode is inside a wait step
  is not ready; a restore reaches every worker (each one runs the restored attempt and
  continues its own share of the records); a repeated `/run` after the restore finds the
  worker that holds the episode.
- One worker process killed (the pod's main process still running) ends the pod: the main
  process stops the other workers and exits with `WORKER_LOST_EXIT`, and the set continues from
  its last checkpoint under the next attempt with every episode exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import httpx
import pytest
from rollout_protocol import HttpParticipantClient, PrepareRequest, Role
from rollout_protocol.conformance import (
    Target,
    check_crash_restore,
    check_participant,
    check_workers,
    check_workers_park_all,
    rollout_ids_per_worker,
)
from rollout_protocol.workers import WORKER_LOST_EXIT
from testsupport.server_processes import (
    TOKEN,
    Cluster,
    Debug,
    ReferenceDriver,
    alive,
    all_stats,
    completed_steps,
    control_status,
    deadline,
    run,
    run_ok,
    started_steps,
    two_step_task,
    worker_pids,
)

WORKERS = 3
GRACE = 1.0
SHORT_LEASE = {"ROLLOUT_LEASE_GRACE_SECONDS": str(GRACE)}
THREE = ["--workers", str(WORKERS)]
READY_S = 120.0
"""Each worker is a fresh interpreter: starting 3 x 3 of them on a loaded 2-core machine took
over the single-process servers' 30 s."""
ALL_THREE = {Role.ENVIRONMENT: THREE, Role.AGENT: THREE, Role.RESOURCES: THREE}


def one_per_worker(prefix: str) -> list[str]:
    """Rollout ids `<prefix>-<n>`, one held by each worker."""
    return rollout_ids_per_worker(WORKERS, prefix)


async def test_a_three_worker_environment_passes_the_participant_rules(
    make_cluster: Any,
) -> None:
    cluster: Cluster = make_cluster(
        env=SHORT_LEASE, extra_args={Role.ENVIRONMENT: THREE}, ready_timeout_s=READY_S
    )
    cluster.start(0)
    async with httpx.AsyncClient() as http:
        status = await control_status(http, cluster, Role.ENVIRONMENT)
        assert (status["multi_process"], status["workers"]) == ("managed", WORKERS)
        target = Target(cluster.url(Role.ENVIRONMENT), Role.ENVIRONMENT, TOKEN, client=http)
        await check_workers(target, workers=WORKERS)
        await check_participant(
            target, checkpoint_root=cluster.checkpoint_root, lease_grace_seconds=GRACE
        )


async def test_three_worker_servers_keep_steps_across_crash_and_restore(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(env=SHORT_LEASE, extra_args=ALL_THREE, ready_timeout_s=READY_S)
    cluster.start(0)
    async with httpx.AsyncClient(timeout=60) as http:
        await check_crash_restore(
            ReferenceDriver(cluster, http),
            checkpoint_root=cluster.checkpoint_root,
            rollout_ids=one_per_worker("kit"),
        )
    assert set(cluster.pids) == {0, 1}


async def test_the_kit_checks_that_every_worker_parks_before_the_pod_is_ready(
    make_cluster: Any,
) -> None:
    """`workers.park-all`: one episode inside the environment's wait step `verify` in one worker
    while the others are parked in the other two."""
    cluster: Cluster = make_cluster(extra_args={Role.ENVIRONMENT: THREE}, ready_timeout_s=READY_S)
    cluster.start(0)
    async with httpx.AsyncClient(timeout=60) as http:
        await check_workers_park_all(
            ReferenceDriver(cluster, http), rollout_ids=one_per_worker("park")
        )
        status = await control_status(http, cluster, Role.ENVIRONMENT)
    assert (status["phase"], status["attempt"], status["workers"]) == ("idle", 1, WORKERS)


async def test_every_worker_parks_restores_and_keeps_its_episodes(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(extra_args={Role.ENVIRONMENT: THREE}, ready_timeout_s=READY_S)
    cluster.start(0)
    held, busy, third = one_per_worker("w")
    tasks = {
        held: two_step_task(1),
        busy: two_step_task(2, verify="wait"),
        third: two_step_task(3),
    }
    answered: list[str] = []
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        agent, resources = (Debug(http, cluster.url(role)) for role in (Role.AGENT, Role.RESOURCES))
        environment = HttpParticipantClient(
            Role.ENVIRONMENT, cluster.url(Role.ENVIRONMENT), token=TOKEN, client=session
        )
        await agent.arm("turn", held, index=1)  # parked between the agent's turns
        await resources.arm("verify", busy)  # inside the environment's wait step `verify`
        await agent.arm("turn", third, index=1)

        async def episode(rid: str) -> None:
            with contextlib.suppress(httpx.TransportError):  # lost to the crash below
                reply = await run(http, cluster, rid, 0, tasks[rid])
                answered.append(f"{rid}: {reply.status_code} {reply.text}")

        async with anyio.create_task_group() as group:
            for rid in tasks:
                group.start_soon(episode, rid)
            await agent.paused("turn", held)
            await resources.paused("verify", busy)
            await agent.paused("turn", third)

            # [workers.park-all] parked in one worker, busy in another: not ready
            early = await environment.prepare(
                PrepareRequest(checkpoint_id="w-1", deadline_ts=deadline(1.0))
            )
            assert not early.ready
            assert [str(e) for e in early.blockers] == [f"{busy}@0"]
            assert early.episode_count == 2  # the two parked ones, in two other workers
            await resources.release("verify", busy)  # the wait step ends; now all park
            coordinator = cluster.coordinator(session)
            prepared = await coordinator.prepare("w-1", deadline(20))
            assert prepared.ready, prepared
            commit = await coordinator.commit("w-1", deadline(20), prepared.scope())
            assert commit.ok, commit.failures
            before = await all_stats(http, cluster)
            await anyio.to_thread.run_sync(cluster.kill)

        # [workers.restore-all] the records of three workers restore into three new workers
        await anyio.to_thread.run_sync(cluster.start, 1)
        coordinator = cluster.coordinator(session)
        restored = await coordinator.restore("w-1", 1, deadline(30))
        assert restored.ok, restored.failures
        status = await control_status(http, cluster, Role.ENVIRONMENT)
        assert status["restored_episodes"] == len(tasks)
        assert not (await coordinator.resume("w-1", deadline(20))).failures
        again = {rid: await run_ok(http, cluster, rid, 1, task) for rid, task in tasks.items()}
        # and a second /run of a finished episode finds its worker: the same result, no step
        for rid, task in tasks.items():
            assert await run_ok(http, cluster, rid, 1, task) == again[rid]
        after = await all_stats(http, cluster)

    for rid in tasks:
        assert again[rid]["continued_from"] == 0, rid
        done_before = completed_steps(before[Role.ENVIRONMENT], rid, 0) - {"run"}
        assert done_before, f"{rid}: the checkpoint captured no progress"
        rerun = started_steps(after[Role.ENVIRONMENT], rid, 1) & done_before
        assert not rerun, f"{rid} reran {sorted(rerun)} after the restore"
        assert completed_steps(after[Role.ENVIRONMENT], rid, 1) >= {"run"}
        assert after[Role.ENVIRONMENT]["rollouts"][rid]["1"]["run"]["completed"] == 1
    assert not answered, answered  # nothing left while the checkpoint was open


async def test_one_killed_worker_ends_the_pod_and_the_set_continues_from_its_checkpoint(
    make_cluster: Any,
) -> None:
    cluster: Cluster = make_cluster(extra_args={Role.ENVIRONMENT: THREE}, ready_timeout_s=READY_S)
    cluster.start(0)
    ids = one_per_worker("k")
    tasks = {rid: two_step_task(n) for n, rid in enumerate(ids)}
    lost: list[BaseException | httpx.Response] = []
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        agent = Debug(http, cluster.url(Role.AGENT))
        for rid in ids:
            await agent.arm("turn", rid, index=1)

        async def episode(rid: str) -> None:
            try:
                lost.append(await run(http, cluster, rid, 0, tasks[rid]))
            except httpx.TransportError as error:
                lost.append(error)

        async with anyio.create_task_group() as group:
            for rid in ids:
                group.start_soon(episode, rid)
            for rid in ids:
                await agent.paused("turn", rid)
            coordinator = cluster.coordinator(session)
            result = await coordinator.checkpoint("k-1", prepare_timeout=20, commit_timeout=20)
            assert result.ok, result
            before = await all_stats(http, cluster)

            # SIGKILL one worker process of the environment, not the pod's main process
            main = cluster.processes[Role.ENVIRONMENT]
            workers = worker_pids(main.pid)
            assert len(workers) == WORKERS
            os.kill(workers[1], signal.SIGKILL)
            code = await anyio.to_thread.run_sync(lambda: main.wait(timeout=30))
            assert code == WORKER_LOST_EXIT
            assert not [pid for pid in workers if alive(pid)], "workers outlived the pod"
            # the pod is gone: its control plane answers nothing (a checkpoint now fails)
            with pytest.raises(httpx.TransportError):
                await http.get(cluster.url(Role.ENVIRONMENT) + "/healthz")
            await anyio.to_thread.run_sync(cluster.kill)
        assert len(lost) == len(ids)
        assert all(not isinstance(o, httpx.Response) or o.status_code != 200 for o in lost)

        # the set's recovery: every participant replaced under attempt 1, the checkpoint restored
        await anyio.to_thread.run_sync(cluster.start, 1)
        coordinator = cluster.coordinator(session)
        restored = await coordinator.restore("k-1", 1, deadline(30))
        assert restored.ok, restored.failures
        assert not (await coordinator.resume("k-1", deadline(20))).failures
        again = {rid: await run_ok(http, cluster, rid, 1, task) for rid, task in tasks.items()}
        reference = {
            rid: await run_ok(http, cluster, f"ref-{rid}", 1, task) for rid, task in tasks.items()
        }
        after = await all_stats(http, cluster)
    for rid in ids:
        got, ref = again[rid], reference[rid]
        assert (got["answer"], got["reward"], got["steps"]) == (
            ref["answer"],
            ref["reward"],
            ref["steps"],
        )
        assert got["continued_from"] == 0
        for role in (Role.ENVIRONMENT, Role.AGENT):
            done_before = completed_steps(before[role], rid, 0) - {"run"}
            rerun = started_steps(after[role], rid, 1) & done_before
            assert not rerun, f"{role.value} reran {sorted(rerun)} of {rid}"
