"""Resume needs no order: a call that reaches a participant not yet resumed waits at its gate.

The coordinator sends every resume at once (one round trip instead of one per role), so a
caller may reopen before its callees. This test makes that the worst case on purpose with real
server processes: after a committed checkpoint only the environment (the outermost caller) is
resumed, a new episode's first call reaches the still-closed resources server and is seen
waiting there; then the agent and model reopen, the resources last. Both the new episode and one
that was parked mid-conversation through the checkpoint finish with the results of uninterrupted
runs: nothing is refused, lost or run twice.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import httpx
from rollout_protocol import HttpParticipantClient, ResumeRequest, Role
from testsupport.server_processes import (
    TOKEN,
    Cluster,
    Debug,
    control_status,
    deadline,
    model_calls,
    run_ok,
    stats,
    two_step_task,
)

from devcluster.waiting import wait_for

CHECKPOINT = "ckpt-resume-order"


async def test_a_caller_resumed_before_its_callees_waits_at_their_gates(
    make_cluster: Any,
) -> None:
    cluster: Cluster = make_cluster()
    await anyio.to_thread.run_sync(cluster.start, 0)
    parked, fresh = "gate-parked", "gate-fresh"
    tasks = {parked: two_step_task(21), fresh: two_step_task(22)}
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = {
            rid: await run_ok(http, cluster, f"ref-{rid}", 0, task) for rid, task in tasks.items()
        }
        agent = Debug(http, cluster.url(Role.AGENT))
        await agent.arm("turn", parked, index=1)
        clients = {
            role: HttpParticipantClient(role, cluster.url(role), token=TOKEN, client=session)
            for role in Role
        }
        coordinator = cluster.coordinator(session)
        results: dict[str, dict[str, Any]] = {}

        async def episode(rid: str) -> None:
            results[rid] = await run_ok(http, cluster, rid, 0, tasks[rid])

        async def resume(*roles: Role) -> None:
            request = ResumeRequest(checkpoint_id=CHECKPOINT, deadline_ts=deadline(20))
            async with anyio.create_task_group() as group:
                for role in roles:
                    group.start_soon(clients[role].resume, request)

        async with anyio.create_task_group() as group:
            group.start_soon(episode, parked)
            await agent.paused("turn", parked)
            prepared = await coordinator.prepare(CHECKPOINT, deadline(20))
            assert prepared.ready, prepared
            committed = await coordinator.commit(CHECKPOINT, deadline(20), prepared.scope())
            assert committed.ok, committed.failures
            await agent.release("turn", parked)  # its next step now waits at the agent's gate

            # the outermost caller reopens first; its new episode's seed call reaches the
            # resources server, which is still committed, and waits at its gate
            sessions = (await control_status(http, cluster, Role.RESOURCES))["live_episodes"]
            await resume(Role.ENVIRONMENT)
            group.start_soon(episode, fresh)

            async def waiting_at_resources() -> dict[str, Any] | None:
                status = await control_status(http, cluster, Role.RESOURCES)
                return status if status["live_episodes"] == sessions + 1 else None

            status = await wait_for(
                waiting_at_resources, 20, "the new episode's seed call to reach the resources"
            )
            assert status["phase"] == "committed", "the resources server reopened early"
            assert not results, "an episode finished while its callees were closed"

            await resume(Role.AGENT, Role.MODEL)
            await resume(Role.RESOURCES)

        for role in Role:
            assert (await control_status(http, cluster, role))["phase"] == "idle"
        model_stats = await stats(http, cluster, Role.MODEL)

    for rid in tasks:
        got, want = results[rid], reference[rid]
        assert (got["answer"], got["reward"], got["steps"]) == (
            want["answer"],
            want["reward"],
            want["steps"],
        ), rid
        assert model_calls(model_stats, rid) == model_calls(model_stats, f"ref-{rid}"), (
            f"{rid}: a model call was repeated or lost"
        )
