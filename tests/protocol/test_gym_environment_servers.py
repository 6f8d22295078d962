"""nemo-gym 0.7's released environments, their servers hosted from their own YAML, checkpointed
through a crash (docs/gym.md, "Environment servers").

nemo-gym 0.7 (on Python 3.13, `make gym-venv`) ships each environment as a Gym YAML
(`environments/<name>/config.yaml`) with three servers: its resources server, a stock agent
(`simple_agent`, `gymnasium_agent`) and a `legacy_agent` environment server that relays `/run`
to the agent. Every one runs here as a process of the 0.7 environment, hosted by `rollout-gym`
from that YAML as released (`--config environments/<name>/config.yaml --name <instance>`): the
resources server and the agent as participants that record nothing (`rollout-gym resources`,
`--role agent` for the agent), the environment server as the set's environment
(`rollout-gym environment-server`), which plays each `/run` as the protocol's steps. The model
is the project's model server (`rollout-server model --debug-hooks`), which the stock agent
reaches as `/ng-rollout/<capture key>/v1/responses`. Nothing has an API key or a GPU.

The conformance kit's crash test, in its `restarting` mode, on each environment: every episode
is held at the third token of its agent's first model call (inside the agent's one call, which
cannot be continued), the checkpoint lists it as a restart (the work lost, counted), every
process is SIGKILLed, and under the next attempt every episode is played once from its start,
with the reward of its uninterrupted twin (the released resources server's own verify).

And the released `legacy_agent` relay in front of an agent that refuses a row or raised: the
environment server's `/run` error is the one its agent's status calls for (docs/gym.md, "Errors
and failures").
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from rollout_protocol import (
    RESTORE_CODES,
    Coordinator,
    ErrorCode,
    HttpParticipantClient,
    Role,
    StatusReply,
)
from rollout_protocol.conformance import RunRefused, Target, check_crash_restore, serve_app
from testsupport.gym_processes import (
    GymProcess,
    counter_row,
    free_port,
    gym_python,
    stop_together,
)
from testsupport.server_processes import (
    STOP_TIMEOUT_S,
    TOKEN,
    Debug,
    ServerProcess,
    two_step_task,
)

pytestmark = pytest.mark.timeout(600)
"""A test starts up to fourteen processes of nemo-gym 0.7, seconds each on a loaded machine."""
RELEASE = "0.7"
"""Environment servers are nemo-gym 0.7's (0.4 has none)."""
GYM_ROLES = (Role.RESOURCES, Role.AGENT, Role.ENVIRONMENT)
"""The roles of an environment's Gym pods (the model is the project's)."""
COUNTER_YAML = (
    "resources_servers/example_session_state_mgmt/configs/example_session_state_mgmt.yaml"
)
"""The released stateful counter's YAML: its resources server, `simple_agent` and a
`legacy_agent` environment server."""
COUNTER_SERVERS = (
    "example_session_state_mgmt_resources_server",
    "example_session_state_mgmt_simple_agent",
    "example_session_state_mgmt_environment_server",
)
"""Its instances: resources server, agent, environment server."""
TASK = two_step_task(1)
WEATHER_YAML = "environments/example_single_tool_call/config.yaml"
"""The released weather environment: its resources server (whose seed and close follow 0.7's
session contract), `simple_agent` and a `legacy_agent` environment server."""
TURN_SERVER = "weather_single_agent_turn"
TURN_YAML = f"""\
{TURN_SERVER}:
  environment_servers:
    single_agent_turn:
      entrypoint: app.py
      resources_server: {{type: resources_servers, name: example_single_tool_call}}
      agent_server: {{type: responses_api_agents, name: example_single_tool_call_simple_agent}}
      resources_tool_transports: [direct_http]
      cleanup_timeout_seconds: 180
"""
"""A `single_agent_turn` environment server for the weather environment, as Gym's own
`single_agent_turn.yaml` gives one (its `???` references filled in)."""


def first_row(environment: str) -> dict[str, Any]:
    """The first row of the environment's shipped example data, as the 0.7 install has it."""
    script = (
        "import json, sys\n"
        "from rollout_gym.gym_config import gym_root\n"
        "for folder in ('environments', 'resources_servers'):\n"
        f"    path = gym_root() / folder / {environment!r} / 'data' / 'example.jsonl'\n"
        "    if path.is_file():\n"
        "        sys.stdout.write(path.read_text().splitlines()[0])\n"
        "        break\n"
    )
    done = subprocess.run(
        [str(gym_python(RELEASE)), "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout, f"no example data for {environment}"
    row: dict[str, Any] = json.loads(done.stdout)
    return row


class EnvironmentDriver:
    """The kit's `EpisodeDriver` for one released environment's servers and the model."""

    def __init__(
        self,
        root: Path,
        http: httpx.AsyncClient,
        configs: Sequence[str],
        servers: tuple[str, str, str],
        row: dict[str, Any],
        *,
        hold_turn: int,
    ) -> None:
        self.root, self.http = root, http
        self.configs, self.servers, self.row = configs, servers, row
        self.hold_turn = hold_turn
        """The model call (0: the first) each episode is held in, at its third token."""
        self.model: ServerProcess | None = None
        self.gym: dict[Role, GymProcess] = {}
        self.first_attempt: int | None = None
        self.armed: set[str] = set()
        self.results: dict[tuple[str, int], dict[str, Any]] = {}

    def participants(self) -> Sequence[Target]:
        assert self.model is not None, "not started"
        found = [Target(self.model.url, Role.MODEL, TOKEN)]
        return found + [Target(p.url, role, TOKEN) for role, p in self.gym.items()]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        assert self.model is not None, "not started"
        if attempt == self.first_attempt and rollout_id not in self.armed:
            self.armed.add(rollout_id)  # armed once, before the episode can reach it
            if self.hold_turn == 0:
                await Debug(self.http, self.model.url).arm("token", rollout_id, index=2)
            else:
                await Debug(self.http, self.model.url).arm("finish", rollout_id)
        body = {"rollout_id": rollout_id, "attempt": attempt, "task": self.row}
        env = self.gym[Role.ENVIRONMENT]
        reply = await self.http.post(env.url + "/run", json=body, timeout=120)
        result = RunRefused.reply(reply)
        self.results[(rollout_id, attempt)] = result
        # what the twins share: the verify's reward and the answer (ids and cookies differ)
        output = result["result"].get("response", {}).get("output")
        return {"reward": result["reward"], "output": output}

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        """Each episode is inside its agent's call, held at the third token of its model call
        `hold_turn` (with `hold_turn` 1: after its first model call and tool call)."""
        assert self.model is not None, "not started"
        model = Debug(self.http, self.model.url)
        for rid in rollout_ids:
            if self.hold_turn == 0:
                await model.paused("token", rid)
                continue
            await model.paused("finish", rid)
            await model.arm("token", rid, index=2)
            await model.release("finish", rid)
            await model.paused("token", rid)

    async def crash(self) -> None:
        for process in self.gym.values():
            process.kill()
        assert self.model is not None, "not started"
        os.killpg(self.model.process.pid, signal.SIGKILL)
        self.model.process.wait(timeout=STOP_TIMEOUT_S)

    async def restart(self, attempt: int) -> None:
        self.stop()  # never leave an earlier group running behind the new one
        self.model = ServerProcess.start(
            self.root, Role.MODEL, "--debug-hooks", "--token-latency-ms", "0", attempt=attempt
        )
        resources, agent, environment = self.servers
        ports = {role: free_port() for role in GYM_ROLES}
        peers = {"ROLLOUT_PEER_MODEL_URL": self.model.url}
        peers.update(
            {
                f"ROLLOUT_PEER_{r.value.upper()}_URL": f"http://127.0.0.1:{p}"
                for r, p in ports.items()
            }
        )
        self.gym = {}

        def start(role: Role, kind: str, name: str, extra: Sequence[str]) -> None:
            self.gym[role] = GymProcess.start(
                self.root,
                kind,
                [*(f"--config={c}" for c in self.configs), "--name", name, *extra],
                attempt=attempt,
                env=peers,
                port=ports[role],
                release=RELEASE,
            )

        # the three at once (each waits for its own /healthz): nemo-gym 0.7's imports make a
        # start take seconds
        async with anyio.create_task_group() as starting:
            for role, kind, name, extra in (
                (Role.RESOURCES, "resources", resources, []),
                (Role.AGENT, "resources", agent, ["--role", "agent"]),
                (Role.ENVIRONMENT, "environment-server", environment, []),
            ):
                call = functools.partial(start, role, kind, name, extra)
                starting.start_soon(anyio.to_thread.run_sync, call)
        if self.first_attempt is None:
            self.first_attempt = attempt

    def stop(self) -> None:
        model = self.model if self.model is not None and self.model.process.poll() is None else None
        stop_together([*self.gym.values(), model])


async def test_single_agent_turn_is_checkpointed_at_its_protocol_steps(tmp_path: Path) -> None:
    """nemo-gym 0.7's `single_agent_turn` in front of the released weather environment (its
    resources server and `simple_agent` from the environment's own YAML): every episode is held
    inside its agent call after its two seeds, checkpointed (listed as a restart: the agent's
    call cannot be continued), SIGKILLed with every server; under the next attempt each is
    played once from its start (the kit's `restarting` mode: its seeds run again) with the
    reward of its uninterrupted twin (the weather server's own verify). The restarted episode
    closed the sessions the lost attempt opened: the weather server refuses to seed a closed
    id again, and the lost attempt's ids were opened on a server that died, so the close
    reached a fresh server and is checked on the restarted one directly."""
    turn_yaml = tmp_path / "single_agent_turn.yaml"
    turn_yaml.write_text(TURN_YAML)
    servers = ("example_single_tool_call", "example_single_tool_call_simple_agent", TURN_SERVER)
    async with httpx.AsyncClient() as http:
        driver = EnvironmentDriver(
            tmp_path,
            http,
            [WEATHER_YAML, str(turn_yaml)],
            servers,
            first_row("example_single_tool_call"),
            hold_turn=0,
        )
        try:
            await driver.restart(0)
            declared = await statuses(
                [
                    HttpParticipantClient(t.role, t.base_url, token=TOKEN)
                    for t in driver.participants()
                ]
            )
            # the environment's seeds, closes and verify wait on both; the rest on nobody: the
            # kit prepares in the stages that makes, environment and model first
            assert {status.role: status.waits_on for status in declared} == {
                Role.ENVIRONMENT: [Role.AGENT, Role.RESOURCES],
                Role.AGENT: [],
                Role.RESOURCES: [],
                Role.MODEL: [],
            }
            await check_crash_restore(
                driver, checkpoint_root=tmp_path / "checkpoints", restarting=True
            )
            restarted = sorted(
                key for key in driver.results if key[1] == 1 and "uninterrupted" not in key[0]
            )
            assert restarted, driver.results
            resources = driver.gym[Role.RESOURCES].url
            for rollout_id, _ in restarted:
                # the lost attempt's session was closed by the restarted episode: seeding it
                # again is refused; the restarted attempt's own session was closed at its end
                for attempt in (0, 1):
                    key = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
                    seed = {
                        "resources_session_id": f"{key}.resources",
                        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
                        "task_id": {"taskset": TURN_SERVER, "task_id": rollout_id},
                        "task_data": {},
                    }
                    again = await http.post(resources + "/seed_session", json=seed, timeout=30)
                    assert again.status_code >= 400, (attempt, again.status_code, again.text)
                    assert "already closed" in again.text, again.text
        finally:
            driver.stop()
    for played in restarted:
        result = driver.results[played]
        assert result["continued_from"] is None, result
        assert result["reward"] == driver.results[(f"{played[0]}-uninterrupted", 1)]["reward"]


LEGACY_STACKS = {
    # environment: (its YAML, its three instances, its row)
    "counter": (COUNTER_YAML, COUNTER_SERVERS),
    "example_single_tool_call": (
        WEATHER_YAML,
        (
            "example_single_tool_call",
            "example_single_tool_call_simple_agent",
            "example_single_tool_call_environment_server",
        ),
    ),
    "calendar": (
        "environments/calendar/config.yaml",
        ("calendar", "calendar_simple_agent", "calendar_environment_server"),
    ),
}
"""Released environments whose rewards are a function of the episode (blackjack's are not: its
server deals from an unseeded `random.Random()`, so no two runs compare)."""
LOST_ROLES = (Role.AGENT, Role.ENVIRONMENT)
"""The pods the crash SIGKILLs: those inside the episodes' uncontinuable call."""


async def statuses(clients: Sequence[HttpParticipantClient]) -> list[StatusReply]:
    """Each participant's status (with the roles it declared it waits on)."""
    return [await client.status(time.time() + 30) for client in clients]


async def run_body(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await http.post(url + "/run", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def stats_of(http: httpx.AsyncClient, url: str, rollout_id: str) -> dict[str, Any]:
    reply = await http.get(url + "/stats", params={"rollout_id": rollout_id}, timeout=30)
    assert reply.status_code == 200, reply.text
    counts: dict[str, Any] = reply.json()
    return counts


async def test_legacy_agent_environments_restart_their_agent_call_exactly_once(
    tmp_path: Path,
) -> None:
    """Three released environments, each from its own YAML with its `legacy_agent` environment
    server (counter, weather, calendar), one model: every episode held inside its agent's one
    call (which cannot be continued), a checkpoint through the Coordinator listing them as
    restarts, the environment and agent pods SIGKILLed and replaced under the next attempt
    (the model and resources pods kept, as an InPlace recovery keeps them), the lost attempt
    retired and the checkpoint restored, and each episode played there once from its start
    with the reward of an uninterrupted run."""
    rows = {
        "counter": counter_row(TASK),
        "example_single_tool_call": first_row("example_single_tool_call"),
        "calendar": first_row("calendar"),
    }
    processes: list[GymProcess] = []
    checkpoints = tmp_path / "checkpoints"
    model = ServerProcess.start(
        tmp_path, Role.MODEL, "--debug-hooks", "--token-latency-ms", "0", attempt=0
    )
    stacks: dict[str, dict[Role, GymProcess]] = {name: {} for name in LEGACY_STACKS}
    ports = {(name, role): free_port() for name in LEGACY_STACKS for role in GYM_ROLES}

    def start(name: str, role: Role, attempt: int) -> None:
        """One Gym pod of a stack, wired to the stack's other pods by their ports."""
        index = sorted(LEGACY_STACKS).index(name)
        config, servers = LEGACY_STACKS[name]
        env = {
            "ROLLOUT_PEER_MODEL_URL": model.url,
            "ROLLOUT_INDEX": str(index),
            "ROLLOUT_CHECKPOINT_ROOT": str(checkpoints),
        }
        for peer in (Role.RESOURCES, Role.AGENT):
            env[f"ROLLOUT_PEER_{peer.value.upper()}_URL"] = f"http://127.0.0.1:{ports[name, peer]}"
        kind, instance, extra = {
            Role.RESOURCES: ("resources", servers[0], []),
            Role.AGENT: ("resources", servers[1], ["--role", "agent"]),
            Role.ENVIRONMENT: ("environment-server", servers[2], []),
        }[role]
        stacks[name][role] = GymProcess.start(
            tmp_path / name,
            kind,
            ["--config", config, "--name", instance, *extra],
            attempt=attempt,
            env=env,
            port=ports[name, role],
            release=RELEASE,
        )
        processes.append(stacks[name][role])

    async def start_all(roles: Sequence[Role], attempt: int) -> None:
        """The pods at once (each waits for its own /healthz): nemo-gym 0.7's imports make a
        start take seconds."""
        async with anyio.create_task_group() as starting:
            for name in LEGACY_STACKS:
                for role in roles:
                    call = functools.partial(start, name, role, attempt)
                    starting.start_soon(anyio.to_thread.run_sync, call)

    def clients() -> list[HttpParticipantClient]:
        found = [HttpParticipantClient(Role.MODEL, model.url, token=TOKEN)]
        for index, name in enumerate(sorted(stacks)):
            found += [
                HttpParticipantClient(role, process.url, index=index, token=TOKEN)
                for role, process in stacks[name].items()
            ]
        return found

    def body(name: str, rollout_id: str, attempt: int) -> dict[str, Any]:
        return {"rollout_id": rollout_id, "attempt": attempt, "task": rows[name]}

    def env_url(name: str) -> str:
        return stacks[name][Role.ENVIRONMENT].url

    try:
        await start_all(GYM_ROLES, 0)
        async with httpx.AsyncClient() as http:
            hooks = Debug(http, model.url)
            # the uninterrupted runs first, then one episode each held in its agent's call
            twins = {
                name: await run_body(http, env_url(name), body(name, f"{name}-twin", 0))
                for name in stacks
            }
            async with anyio.create_task_group() as held:
                for name in stacks:
                    await hooks.arm("token", f"{name}-0", index=2)
                    lost = body(name, f"{name}-0", 0)

                    async def run_lost(url: str = env_url(name), lost: Any = lost) -> None:
                        with contextlib.suppress(httpx.HTTPError):
                            await http.post(url + "/run", json=lost, timeout=120)

                    held.start_soon(run_lost)
                for name in stacks:
                    await hooks.paused("token", f"{name}-0")
                participants = clients()
                coordinator = Coordinator(participants)
                # as the operator prepares them: in the stages the pods declared (a
                # `legacy_agent` environment waits on nobody: its agent call is replayed)
                stages = coordinator.stages(await statuses(participants))
                assert stages == ((Role.ENVIRONMENT, Role.MODEL, Role.AGENT, Role.RESOURCES),)
                checkpoint = await coordinator.checkpoint(
                    "c1",
                    prepare_timeout=20,
                    commit_timeout=20,
                    publish_dir=checkpoints,
                    stages=stages,
                )
                for client in participants:
                    await client.aclose()
                assert checkpoint.ok, checkpoint
                restarts = {e.rollout_id for e in checkpoint.prepare.restarts}
                assert restarts == {f"{name}-0" for name in stacks}, checkpoint.prepare
                for name in stacks:
                    for role in LOST_ROLES:
                        stacks[name][role].kill()
            ports.update({(name, role): free_port() for name in stacks for role in LOST_ROLES})
            await start_all(LOST_ROLES, 1)
            participants = clients()
            coordinator = Coordinator(participants)
            # as the operator's recovery does: the lost attempt retired everywhere first (the
            # kept model still holds its episodes' calls), then the restore under the next
            retired = await coordinator.retire(0, None, time.time() + 30)
            assert not retired.failures, retired
            restored = await coordinator.restore("c1", 1, time.time() + 30)
            assert restored.ok, restored
            resumed = await coordinator.resume("c1", time.time() + 30)
            assert not resumed.failures, resumed
            for client in participants:
                await client.aclose()
            for name in stacks:  # the kept model's hooks: the next attempt is not held
                await hooks.release("token", f"{name}-0")
            for name in stacks:
                again = await run_body(http, env_url(name), body(name, f"{name}-0", 1))
                assert again["reward"] == twins[name]["reward"], (name, again, twins[name])
                assert again["continued_from"] is None, again
                # exactly once: played once from its start under attempt 1 (the attempt-0
                # play was lost inside the agent's call, with the pod that ran it)
                counts = await stats_of(http, env_url(name), f"{name}-0")
                steps = counts["rollouts"][f"{name}-0"]
                assert set(steps) == {"1"}, counts
                assert steps["1"]["agent"] == {"started": 1, "completed": 1}, counts
    finally:
        stop_together([*processes, model if model.process.poll() is None else None])


async def test_legacy_agents_refusal_ends_the_episode_and_its_500_waits(tmp_path: Path) -> None:
    """The released `legacy_agent` relay in front of an agent that refuses the row (a 422, as
    FastAPI answers a body it cannot read) and one whose handler raised (Gym's 500): the
    environment server's `/run` answers the first with `invalid_request`, a code
    `rollout-collect` does not wait on, naming the step, the agent and its answer, and the
    second with `internal`, which it waits on (docs/gym.md, "Errors and failures")."""
    answers = {"refuse": (422, {"detail": "row refused"}), "raise": (500, "FileNotFoundError()")}
    agent = FastAPI()

    @agent.post("/run")
    async def run(request: Request) -> JSONResponse:
        status, body = answers[(await request.json())["kind"]]
        return JSONResponse(body, status_code=status)

    async with serve_app(agent, role=Role.AGENT, token=TOKEN) as served:
        env = {"ROLLOUT_PEER_AGENT_URL": served.target.base_url}
        start = functools.partial(
            GymProcess.start,
            tmp_path,
            "environment-server",
            ["--config", COUNTER_YAML, "--name", COUNTER_SERVERS[2]],
            attempt=0,
            env=env,
            release=RELEASE,
        )
        environment = await anyio.to_thread.run_sync(start)
        try:
            async with httpx.AsyncClient(base_url=environment.url, timeout=60) as http:
                found = {}
                for kind in answers:
                    body = {"rollout_id": kind, "attempt": 0, "task": {"kind": kind}}
                    reply = await http.post("/run", json=body)
                    found[kind] = (reply.status_code, reply.json()["error"])
        finally:
            stop_together([environment])
    refused, raised = found["refuse"], found["raise"]
    assert refused[1]["code"] == ErrorCode.INVALID_REQUEST.value, refused
    assert ErrorCode.INVALID_REQUEST not in RESTORE_CODES
    agent_name = COUNTER_SERVERS[1]
    assert (
        f"step agent: agent {agent_name} (relayed by {COUNTER_SERVERS[2]}): /run answered 422"
        in (refused[1]["detail"])
    ), refused
    assert "row refused" in refused[1]["detail"], refused
    assert raised[1]["code"] == ErrorCode.INTERNAL.value, raised
    assert ErrorCode.INTERNAL in RESTORE_CODES
