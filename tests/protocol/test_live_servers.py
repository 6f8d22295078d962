"""Protocol behaviour that needs no crash, on one shared set of server processes.

Retire during final cleanup, a blocker at the prepare deadline, results held while a checkpoint
is open, the trainer CLI, the model server's OpenAI front (streaming, relay, cuts) and SIGTERM.
Each test uses its own rollout ids, so the shared servers' state never couples two tests.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
from rollout_protocol import (
    API_PREFIX,
    CheckpointResult,
    Coordinator,
    EpisodeId,
    ErrorCode,
    HttpParticipantClient,
    PrepareRequest,
    RetireRequest,
    Role,
)
from rollout_protocol import _storage as storage
from rollout_servers.tasks import Task, shipped_tasks
from testsupport.server_processes import (
    AUTH,
    SERVER,
    TOKEN,
    Cluster,
    Debug,
    ServerProcess,
    control_status,
    deadline,
    model_calls,
    run,
    run_ok,
    stats,
    two_step_task,
)


def debug(http: httpx.AsyncClient, cluster: Cluster, role: Role) -> Debug:
    return Debug(http, cluster.url(role))


async def references(
    http: httpx.AsyncClient, cluster: Cluster, tasks: dict[str, Task]
) -> dict[str, Any]:
    """Each task run uninterrupted first (as `ref-<rollout id>`): what its episode must end as."""
    return {rid: await run_ok(http, cluster, f"ref-{rid}", 0, t) for rid, t in tasks.items()}


def assert_as_uninterrupted(results: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every episode ended with the answer, reward and steps of its uninterrupted run."""
    for rid, ref in reference.items():
        got = results[rid]
        assert (got["answer"], got["reward"], got["steps"]) == (
            ref["answer"],
            ref["reward"],
            ref["steps"],
        ), rid


async def test_retire_cancels_before_cleanup_and_never_interrupts_it(
    shared_cluster: Cluster,
) -> None:
    cluster = shared_cluster
    early, late = "retire-early", "retire-late"
    task = two_step_task(9)
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = await run_ok(http, cluster, "ref-retire", 0, task)
        env, agent = debug(http, cluster, Role.ENVIRONMENT), debug(http, cluster, Role.AGENT)
        await agent.arm("turn", early, index=1)
        await env.arm("cleanup", late)
        environment = HttpParticipantClient(
            Role.ENVIRONMENT, cluster.url(Role.ENVIRONMENT), token=TOKEN, client=session
        )
        replies: dict[str, httpx.Response] = {}
        retired: dict[str, Any] = {}
        events: list[str] = []

        async def episode(rid: str) -> None:
            replies[rid] = await run(http, cluster, rid, 0, task)
            events.append(f"run {rid} replied")

        async def retire(rid: str) -> None:
            retired[rid] = await environment.retire(
                RetireRequest(
                    operation_id=f"op-{rid}", deadline_ts=deadline(30), attempt=0, rollout_ids=[rid]
                )
            )
            events.append(f"retire {rid} replied")

        async with anyio.create_task_group() as group:
            group.start_soon(episode, early)
            group.start_soon(episode, late)
            await agent.paused("turn", early)
            await env.paused("cleanup", late)

            # before cleanup: the episode is cancelled, its cleanup still runs, then the reply
            await retire(early)
            resources = await stats(http, cluster, Role.RESOURCES)
            assert resources["rollouts"][early]["0"]["close"] == {"started": 1, "completed": 1}

            # during cleanup: the retire waits; the cleanup is not interrupted
            group.start_soon(retire, late)
            await env.reached("retiring", late)
            assert f"retire {late} replied" not in events
            await env.release("cleanup", late)

    assert replies[early].status_code == 410, replies[early].text
    assert replies[early].json()["error"]["code"] == ErrorCode.ATTEMPT_RETIRED
    assert replies[late].status_code == 200, replies[late].text
    late_result = replies[late].json()
    assert (late_result["answer"], late_result["reward"]) == (
        reference["answer"],
        reference["reward"],
    )
    assert retired[late].retired == [EpisodeId(rollout_id=late, attempt=0)]
    # the episode (cleanup included) ended before the retire replied
    async with httpx.AsyncClient(timeout=30) as http:
        env_stats = await stats(http, cluster, Role.ENVIRONMENT)
        assert env_stats["rollouts"][late]["0"]["cleanup"] == {"started": 1, "completed": 1}
        # a retired attempt is refused from now on
        again = await run(http, cluster, late, 0, task)
        assert again.status_code == 410, again.text


async def test_stuck_wait_step_blocks_prepare_and_resume_reopens(shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    stuck = "stuck-verify"
    task = two_step_task(10, verify="wait")
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = await run_ok(http, cluster, "ref-stuck", 0, task)
        resources = debug(http, cluster, Role.RESOURCES)
        await resources.arm("verify", stuck)
        results: dict[str, Any] = {}

        async def episode() -> None:
            results[stuck] = await run_ok(http, cluster, stuck, 0, task)

        async with anyio.create_task_group() as group:
            group.start_soon(episode)
            await resources.paused("verify", stuck)
            coordinator = cluster.coordinator(session)
            outcome = await coordinator.checkpoint(
                "ckpt-stuck", prepare_timeout=1.0, commit_timeout=10
            )
            assert not outcome.ok
            assert outcome.reason == "NotReady"
            assert outcome.prepare.stopped_at == Role.ENVIRONMENT
            assert outcome.prepare.blockers == [EpisodeId(rollout_id=stuck, attempt=0)]
            assert outcome.prepare.blocker_count == 1
            assert outcome.resume is not None
            assert not outcome.resume.failures
            status = await control_status(http, cluster, Role.ENVIRONMENT)
            assert status["phase"] == "idle"
            # admission reopened: a new episode runs to its end while the stuck one still waits
            assert (await run_ok(http, cluster, "after-stuck", 0, task))["answer"] is not None
            await resources.release("verify", stuck)
    assert results[stuck]["answer"] == reference["answer"]


async def test_declared_waits_park_the_environment_and_the_model_in_one_stage(
    shared_cluster: Cluster,
) -> None:
    """The reference servers declare whom they wait on (docs/design.md#44-order), so a prepare
    parks the environment and the model together, then the agent, then the resources; an
    episode mid-generation and one inside a wait-mode verification are still checkpointed, and
    both finish as they do without a checkpoint."""
    cluster = shared_cluster
    cut, verifying = "stages-cut", "stages-verify"
    tasks = {cut: two_step_task(13), verifying: two_step_task(14, verify="wait")}
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = await references(http, cluster, tasks)
        # a client that does not name the capability is not sent the field (docs/protocol.md)
        assert "waits_on" not in await control_status(http, cluster, Role.ENVIRONMENT)
        progress: list[str] = []
        first_stage = anyio.Event()

        def on_progress(message: str) -> None:
            progress.append(message)
            if message.startswith("prepare environment+model:"):
                first_stage.set()

        coordinator = cluster.coordinator(session, on_progress=on_progress)
        statuses = (await coordinator.status(deadline(20))).statuses
        assert {s.role: s.waits_on for s in statuses} == {
            Role.ENVIRONMENT: [Role.AGENT, Role.RESOURCES],
            Role.AGENT: [Role.RESOURCES],
            Role.MODEL: [],
            Role.RESOURCES: [],
        }
        stages = coordinator.stages(statuses)
        assert stages == ((Role.ENVIRONMENT, Role.MODEL), (Role.AGENT,), (Role.RESOURCES,))
        model, resources = debug(http, cluster, Role.MODEL), debug(http, cluster, Role.RESOURCES)
        await model.arm("token", cut, 2)
        await resources.arm("verify", verifying)
        results: dict[str, Any] = {}

        async def episode(rid: str) -> None:
            results[rid] = await run_ok(http, cluster, rid, 0, tasks[rid])

        checkpointed: list[CheckpointResult] = []
        done = anyio.Event()

        async def checkpoint() -> None:
            checkpointed.append(
                await coordinator.checkpoint(
                    "ckpt-stages",
                    prepare_timeout=30,
                    commit_timeout=30,
                    stages=stages,
                    persist_after_resume=True,
                )
            )
            done.set()

        async with anyio.create_task_group() as group:
            for rid in tasks:
                group.start_soon(episode, rid)
            await model.paused("token", cut)
            await resources.paused("verify", verifying)
            group.start_soon(checkpoint)
            # released while the first stage parks: the environment waits for it, the resources
            # still admit it
            with anyio.fail_after(20):
                await first_stage.wait()
            await resources.release("verify", verifying)
            with anyio.fail_after(40):
                await done.wait()
            await model.release("token", cut)
        [result] = checkpointed
        assert result.ok, (result.reason, result.message)
        stage_lines = [m.split(":")[0] for m in progress if m.startswith("prepare ")]
        assert stage_lines == [
            "prepare environment+model",
            "prepare agent",
            "prepare resources",
        ], progress
    assert_as_uninterrupted(results, reference)


async def test_open_checkpoint_holds_finished_work_until_resume(shared_cluster: Cluster) -> None:
    """A model response and a replay-mode verification that finish while the checkpoint is open
    are held: the records show the episodes before them, and resume delivers them unchanged."""
    cluster = shared_cluster
    response, verdict = "hold-response", "hold-verdict"
    tasks = {response: two_step_task(11), verdict: two_step_task(12, verify="replay")}
    async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
        reference = await references(http, cluster, tasks)
        env, model, resources = (
            debug(http, cluster, role) for role in (Role.ENVIRONMENT, Role.MODEL, Role.RESOURCES)
        )
        await model.arm("finish", response)
        await resources.arm("verify", verdict)
        results: dict[str, Any] = {}

        async def episode(rid: str) -> None:
            results[rid] = await run_ok(http, cluster, rid, 0, tasks[rid])

        coordinator = cluster.coordinator(session)
        environment = HttpParticipantClient(
            Role.ENVIRONMENT, cluster.url(Role.ENVIRONMENT), token=TOKEN, client=session
        )
        async with anyio.create_task_group() as group:
            for rid in tasks:
                group.start_soon(episode, rid)
            await model.paused("finish", response)
            await resources.paused("verify", verdict)
            # the environment is prepared first; its verification finishes after that: held
            ready = await environment.prepare(
                PrepareRequest(checkpoint_id="ckpt-hold", deadline_ts=deadline(20))
            )
            assert ready.ready
            await resources.release("verify", verdict)
            await env.reached("held", verdict)
            prepared = await coordinator.prepare("ckpt-hold", deadline(20))
            assert prepared.ready, prepared
            # the model is prepared too; its response finishes now: held
            await model.release("finish", response)
            await model.reached("held", response)
            commit = await coordinator.commit("ckpt-hold", deadline(20), prepared.scope())
            assert commit.ok, commit.failures
            assert not results, "a result left while the checkpoint was open"
            assert not (await coordinator.resume("ckpt-hold", deadline(20))).failures

    assert_as_uninterrupted(results, reference)
    records = _records(cluster, commit.manifest_paths)
    env_record = records[Role.ENVIRONMENT][verdict]
    assert env_record.data["step"] == "verify", "the held verification leaked into the records"
    [generation] = [r for r in records[Role.MODEL].values() if r.kind == "generation"]
    assert generation.rollout_id == response
    assert generation.data["step"] == "deliver"
    async with httpx.AsyncClient(timeout=30) as http:
        model_stats = await stats(http, cluster, Role.MODEL)
    assert model_calls(model_stats, response) == model_calls(model_stats, f"ref-{response}")


def _records(cluster: Cluster, manifest_paths: dict[str, str]) -> dict[Role, dict[str, Any]]:
    by_role: dict[Role, dict[str, Any]] = {}
    for instance, relative in manifest_paths.items():
        directory = (cluster.checkpoint_root / relative).parent
        manifest, records = storage.read_records(directory, expect_checkpoint_id="ckpt-hold")
        by_role[manifest.role] = {r.rollout_id: r for r in records if r.kind != "delivered"}
        assert instance == manifest.instance
    return by_role


async def test_rollout_collect_writes_results(shared_cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    command = [
        str(Path(SERVER[0]).with_name("rollout-collect")),
        "--environment",
        shared_cluster.url(Role.ENVIRONMENT),
        "--tasks",
        "6",
        "--seed",
        "3",
        "--out",
        str(out),
        "--concurrency",
        "3",
        "--prefix",
        "cli",
    ]
    done = await anyio.run_process(command, check=False)
    assert done.returncode == 0, done.stderr.decode()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["rollout_id"] for line in lines) == [f"cli3-{i:05d}" for i in range(6)]
    for line in lines:
        assert set(line) == {"rollout_id", "attempt", "answer", "reward", "steps", "continued"}
        assert line["reward"] in (0.0, 1.0)
        assert line["steps"] >= 2
        assert line["continued"] is False
    assert b"6/6 done" in done.stderr


async def test_rollout_collect_runs_a_rows_file_on_the_reference_servers(
    shared_cluster: Cluster, tmp_path: Path
) -> None:
    """`--tasks-file`: rows of the shipped shape (four shipped tasks, without a seed, as a user
    would write them) run on the reference environment, two rollouts each with seeds of their
    own; every result line names its row."""
    rows = [task.model_dump(exclude={"seed"}) for task in shipped_tasks()[:4]]
    tasks, out = tmp_path / "mine.jsonl", tmp_path / "results.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    command = [
        str(Path(SERVER[0]).with_name("rollout-collect")),
        *("--environment", shared_cluster.url(Role.ENVIRONMENT)),
        *("--tasks-file", str(tasks), "--id-field", "id", "--rollouts-per-row", "2"),
        *("--seed", "9", "--out", str(out), "--prefix", "mine."),
    ]
    done = await anyio.run_process(command, check=False)
    assert done.returncode == 0, done.stderr.decode()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    expected = {
        f"mine.{row['id']}-{k}": (row["id"], n, k) for n, row in enumerate(rows, 1) for k in (0, 1)
    }
    assert sorted(line["rollout_id"] for line in lines) == sorted(expected)
    for line in lines:
        assert (line["row_id"], line["line"], line["sample"]) == expected[line["rollout_id"]]
        # the verifier checked the answer against the row's own
        solved = line["answer"] == rows[line["line"] - 1]["answer"]
        assert line["reward"] == (1.0 if solved else 0.0), line
    assert b"8/8 done" in done.stderr


async def test_model_front_streams_relays_and_cuts(shared_cluster: Cluster, tmp_path: Path) -> None:
    """The OpenAI front: a streamed response carries the same text as a plain one; the relay
    backend passes both through; a relayed generation cut by a checkpoint continues upstream."""
    upstream = shared_cluster.url(Role.MODEL)
    messages = [{"role": "user", "content": two_step_task(13).question}]
    body = {"model": "builtin", "messages": messages, "seed": 5, "max_tokens": 64}
    relay = await anyio.to_thread.run_sync(
        lambda: ServerProcess.start(
            tmp_path / "relay",
            Role.MODEL,
            "--backend",
            "openai",
            "--upstream-url",
            upstream,
            "--debug-hooks",
        )
    )
    try:
        async with httpx.AsyncClient(timeout=30) as http, aiohttp.ClientSession() as session:
            plain = await _chat(http, upstream, body)
            assert "CALC:" in plain
            assert await _chat(http, upstream, body, stream=True) == plain
            assert await _chat(http, relay.url, body) == plain
            assert await _chat(http, relay.url, body, stream=True) == plain
            completion = await http.post(
                relay.url + "/v1/completions", json={"prompt": "hello", "seed": 1, "max_tokens": 3}
            )
            assert completion.json()["choices"][0]["finish_reason"] == "length"

            bad = await http.post(
                upstream + "/v1/chat/completions",
                json=body,
                headers={"X-Rollout-Request": "no-key-here"},
            )
            assert bad.status_code == 422
            assert bad.json()["error"]["code"] == ErrorCode.INVALID_REQUEST

            # a relayed generation, cut at its third token by a checkpoint, then resumed
            hooks = Debug(http, relay.url)
            await hooks.arm("token", "relay-cut", index=3)
            coordinator = Coordinator(
                [HttpParticipantClient(Role.MODEL, relay.url, token=TOKEN, client=session)]
            )
            texts: list[str] = []

            async def generate() -> None:
                texts.append(
                    await _chat(http, relay.url, body, headers={"X-Rollout-Request": "relay-cut/0"})
                )

            async with anyio.create_task_group() as group:
                group.start_soon(generate)
                await hooks.paused("token", "relay-cut")
                prepared = await coordinator.prepare(
                    "ckpt-relay", deadline(20), scope=["relay-cut"]
                )
                assert prepared.episodes == [EpisodeId(rollout_id="relay-cut", attempt=0)]
                await hooks.release("token", "relay-cut")
                commit = await coordinator.commit("ckpt-relay", deadline(20), prepared.scope())
                assert commit.ok, commit.failures
                assert not (await coordinator.resume("ckpt-relay", deadline(20))).failures
            relay_stats = (
                await http.get(relay.url + "/stats", params={"rollout_id": "relay-cut"})
            ).json()
    finally:
        await anyio.to_thread.run_sync(relay.stop)
    # the first three tokens came from the first upstream stream, the rest from a continuation
    first_three = "".join(_tokens(plain)[:3])
    assert texts[0].startswith(first_three)
    assert relay_stats["counters"]["0"]["cuts"] == 1
    assert relay_stats["tokens"]["0"]["by_request"]["relay-cut/0"] >= 4


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text)


async def _chat(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
) -> str:
    if not stream:
        reply = await http.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["message"]["content"])
    text = ""
    async with http.stream(
        "POST", url + "/v1/chat/completions", json=body | {"stream": True}, headers=headers
    ) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


async def test_sigterm_keeps_the_control_plane_up(tmp_path: Path) -> None:
    server = await anyio.to_thread.run_sync(
        lambda: ServerProcess.start(tmp_path / "drain", Role.RESOURCES)
    )
    try:
        server.process.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(server.wait_event, "draining")
        async with httpx.AsyncClient(timeout=10) as http:
            # the process turns unready ...
            assert (await http.get(server.url + "/healthz")).status_code == 503
            # ... but keeps serving the control plane for a checkpoint in the grace period
            status = await http.get(server.url + API_PREFIX + "/status", headers=AUTH)
            assert status.status_code == 200
            assert status.json()["phase"] == "idle"
            assert server.process.poll() is None
    finally:
        code = await anyio.to_thread.run_sync(server.stop)
    assert code == 0


def test_server_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "ROLLOUT_CHECKPOINT_ROOT": str(tmp_path)}
    done = subprocess.run(
        [*SERVER, "model", "--port", "0"], env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert b"ROLLOUT_CONTROL_TOKEN" in done.stderr
