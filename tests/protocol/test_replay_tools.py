"""Tools that can replay: a checkpoint does not wait for a call of an idempotent tool.

The reference resources server declares its tools in `GET /tools`; the reference agent runs a
call of a tool declared idempotent as a replay step (and the resources server runs it as one
too), so a prepare is ready while the call is in flight, and a restore simply calls it again. A
tool declared not idempotent (`--wait-tools`) is a wait step: the prepare waits for it.

Each test holds an episode inside its first calculator call (the resources server's `tool`
debug hook), with four real server processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
from fastapi import FastAPI
from rollout_protocol import Role, StepMode
from rollout_protocol.conformance import serve_app
from rollout_servers.servers.agent import AgentServer
from rollout_servers.servers.common import ServerOptions
from testsupport.server_processes import (
    Cluster,
    Debug,
    all_stats,
    completed_steps,
    control_status,
    deadline,
    run_ok,
    run_until_crash,
    started_steps,
    two_step_task,
)


async def tool_listing(http: httpx.AsyncClient, cluster: Cluster) -> dict[str, bool]:
    reply = await http.get(cluster.url(Role.RESOURCES) + "/tools")
    assert reply.status_code == 200, reply.text
    return {tool["name"]: tool["idempotent"] for tool in reply.json()["tools"]}


async def test_prepare_does_not_wait_for_an_idempotent_tool_call_and_restore_replays_it(
    make_cluster: Any,
) -> None:
    cluster: Cluster = make_cluster()
    cluster.start(0)
    task = two_step_task(0)
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        assert await tool_listing(http, cluster) == {"calculator": True}
        reference = await run_ok(http, cluster, "ref", 0, task)
        resources = Debug(http, cluster.url(Role.RESOURCES))
        await resources.arm("tool", "held", index=0)
        coordinator = cluster.coordinator(session)

        async with anyio.create_task_group() as group:
            group.start_soon(run_until_crash, http, cluster, "held", 0, task)
            await resources.paused("tool", "held")
            # the calculator call is in flight (held inside the resources server's step) ...
            prepared = await coordinator.prepare("ckpt-1", deadline(30))
            assert prepared.ready, prepared
            assert prepared.episode_count == 1, prepared
            # ... and the prepare was ready without it: the call is still held
            agent_before = (await all_stats(http, cluster))[Role.AGENT]
            assert "tool@0" in started_steps(agent_before, "held", 0)
            assert "tool@0" not in completed_steps(agent_before, "held", 0)
            commit = await coordinator.commit("ckpt-1", deadline(30), prepared.scope())
            assert commit.ok, commit.failures
            before = await all_stats(http, cluster)
            await anyio.to_thread.run_sync(cluster.kill)  # the held call dies with its server

        await anyio.to_thread.run_sync(cluster.start, 1)
        restored = await coordinator.restore("ckpt-1", 1, deadline(30))
        assert restored.ok, restored.failures
        resumed = await coordinator.resume("ckpt-1", deadline(30))
        assert not resumed.failures
        result = await run_ok(http, cluster, "held", 1, task)
        after = await all_stats(http, cluster)

    # the same result as an uninterrupted run, continued from the checkpoint ...
    for field in ("answer", "reward", "steps"):
        assert result[field] == reference[field], (field, result, reference)
    assert result["continued_from"] == 0, result
    # ... the call captured in flight ran again after the restore, on both sides ...
    assert "tool@0" not in completed_steps(before[Role.RESOURCES], "held", 0)
    assert "tool@0" in completed_steps(after[Role.RESOURCES], "held", 1)
    assert "tool@0" in completed_steps(after[Role.AGENT], "held", 1)
    # ... what had completed before the checkpoint did not, and the episode finished once
    for role in (Role.ENVIRONMENT, Role.AGENT, Role.RESOURCES):
        done_before = completed_steps(before[role], "held", 0)
        assert not started_steps(after[role], "held", 1) & done_before, role
    assert "model@0" in completed_steps(before[Role.AGENT], "held", 0)
    assert "run" not in completed_steps(before[Role.ENVIRONMENT], "held", 0)
    assert "run" in completed_steps(after[Role.ENVIRONMENT], "held", 1)


async def test_prepare_waits_for_a_tool_declared_not_idempotent(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(extra_args={Role.RESOURCES: ["--wait-tools", "calculator"]})
    cluster.start(0)
    task = two_step_task(1)
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        assert await tool_listing(http, cluster) == {"calculator": False}
        resources = Debug(http, cluster.url(Role.RESOURCES))
        agent = Debug(http, cluster.url(Role.AGENT))
        await resources.arm("tool", "held", index=0)
        coordinator = cluster.coordinator(session)
        results: list[dict[str, Any]] = []
        prepared: list[Any] = []
        prepare_done = anyio.Event()

        async def run() -> None:
            results.append(await run_ok(http, cluster, "held", 0, task))

        async def prepare() -> None:
            prepared.append(await coordinator.prepare("ckpt-1", deadline(30)))
            prepare_done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await resources.paused("tool", "held")
            group.start_soon(prepare)
            # the agent's prepare parks: its episode is inside the wait-mode tool call, which
            # is held, so the prepare cannot be ready until the call is released
            await agent.reached("park")
            status = await control_status(http, cluster, Role.AGENT)
            assert status["phase"] == "preparing", status
            assert not prepared
            await resources.release("tool", "held")
            with anyio.fail_after(40):  # the prepare's own 30 s deadline ends it first
                await prepare_done.wait()
            assert prepared[0].ready, prepared[0]
            resumed = await coordinator.resume("ckpt-1", deadline(30))
            assert not resumed.failures
        stats = await all_stats(http, cluster)

    assert len(results) == 1, results
    assert results[0]["attempt"] == 0, results
    assert "tool@0" in completed_steps(stats[Role.RESOURCES], "held", 0)


async def test_an_agent_steps_every_call_in_wait_mode_for_a_server_without_a_tool_listing(
    tmp_path: Path,
) -> None:
    """A resources server that answers `GET /tools` with 404 declares nothing: the reference
    agent runs every tool call as a wait step (and asks again after a rewire)."""
    token = "t"
    async with serve_app(FastAPI(), role=Role.RESOURCES, token=token) as bare:
        options = ServerOptions(
            role=Role.AGENT,
            model_url="http://127.0.0.1:9",
            resources_url=bare.target.base_url,
            allow_unauthenticated=True,
        )
        agent = AgentServer(options, environ={"ROLLOUT_CHECKPOINT_ROOT": str(tmp_path)})
        async with serve_app(agent.build_app(), role=Role.AGENT, token=token):
            assert await agent.tool_mode("calculator", "r-0") is StepMode.WAIT
            assert agent._tool_modes == {}
            agent.rewire({Role.RESOURCES: bare.target.base_url})
            assert agent._tool_modes is None
