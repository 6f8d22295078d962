"""The conformance kit (`rollout_protocol.conformance`) against the NeMo Gym adapter
(`rollout-gym`, docs/gym.md) with each session strategy, and its negative control.

Every test runs once on each Gym release the adapter supports (`GYM_RELEASES`: nemo-gym 0.4.0 on
Python >= 3.12 and 0.7.0 on Python 3.13, from PyPI; the `release` fixture). Every Gym part is real
and runs as a process on that release's environment: the released stateful counter
(`example_session_state_mgmt`, whose sessions live in the server's memory behind a cookie)
hosted by `rollout-gym resources`, and the adapter, `rollout-gym environment`, playing Gym's
`simple_agent` loop against it. The model is the project's model server (`rollout-server model
--debug-hooks`), whose built-in backend calls `increment_counter` with each step's value. The
counter's own verify rewards 1.0 only when the session's count is the initial count plus every
increment: a tool call lost or doubled, or a session that silently started empty, shows in the
reward.

The driver holds each episode after its first model call and first tool call, at the third
token of its second model call, so the kit's checkpoint records a session with one increment in
it, and the crash (SIGKILL of the adapter, the counter and the model) loses that session with the
counter's memory. Then, under the next attempt:

- `replay`: the adapter replays the recorded increment into a fresh session, checking its output;
  the kit passes (`state.in-boundary`: the reward of the uninterrupted twin);
- `snapshot`: the counter subclass of `examples/gym-environment` exports the session after each
  call, the adapter imports it into a fresh session; the kit passes;
- `restart`: the checkpoint lists the episodes as restarts (its work-loss count); the kit passes
  in its `restarting` mode (each episode played again from its start), and fails without it
  (`steps.no-rerun`: a restarted episode runs its completed steps again);
- rebuild turned off (`ROLLOUT_GYM_REBUILD=off`, the negative control): the restored episode
  keeps its old cookie, which the restarted counter accepts with an empty session; the reward
  differs from the twin's and the kit fails with `state.in-boundary`;
- a replayed call that answers otherwise than the record (the counter replaced by another
  server) fails the restore with a message that names the call;
- the operator's peer addresses, in the Gym config of the hosted server, resolve through Gym's
  own lookup;
- a counter restarted under a live session (no restore) fails the episode instead of letting it
  go on with the empty session Gym would serve its old cookie;
- a released server that imports the modules beside it by bare name (calendar's `utils`) is
  hosted as Gym runs it, from its own folder;
- the adapter refuses to start on a nemo-gym release it does not support.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_protocol import Role
from rollout_protocol.conformance import (
    ConformanceError,
    RunRefused,
    Target,
    check_crash_restore,
    check_participant,
)
from testsupport.gym_processes import (
    COUNTER,
    COUNTER_NAME,
    GYM_RELEASES,
    SNAPSHOT_COUNTER,
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

LEASE_GRACE_S = 1.0
WEATHER = "resources_servers.example_single_tool_call.app:SimpleWeatherResourcesServer"
CALENDAR = "resources_servers.calendar.app:CalendarResourcesServer"
"""Gym's calendar, whose app imports the module beside it by bare name (`from utils import`)."""
TASK = two_step_task(1)


def row() -> dict[str, Any]:
    return counter_row(TASK)


@pytest.fixture(params=GYM_RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    """Each test, on each Gym release the adapter supports."""
    value: str = request.param
    return value


class GymDriver:
    """The kit's `EpisodeDriver` for the adapter, the Gym counter and the reference model."""

    def __init__(
        self,
        root: Path,
        http: httpx.AsyncClient,
        *,
        strategy: str,
        release: str,
        server: str = COUNTER,
        rebuild: bool = True,
        server_after_crash: str | None = None,
    ) -> None:
        self.root, self.http = root, http
        self.strategy, self.server, self.rebuild = strategy, server, rebuild
        self.release = release
        self.server_after_crash = server_after_crash or server
        self.model: ServerProcess | None = None
        self.resources: GymProcess | None = None
        self.env: GymProcess | None = None
        self.first_attempt: int | None = None
        self.armed: set[str] = set()
        self.results: dict[tuple[str, int], dict[str, Any]] = {}

    def _running(self) -> tuple[GymProcess, GymProcess, ServerProcess]:
        assert self.env is not None, "not started"
        assert self.resources is not None, "not started"
        assert self.model is not None, "not started"
        return self.env, self.resources, self.model

    def participants(self) -> Sequence[Target]:
        env, resources, model = self._running()
        return [
            Target(env.url, Role.ENVIRONMENT, TOKEN),
            Target(model.url, Role.MODEL, TOKEN),
            Target(resources.url, Role.RESOURCES, TOKEN),
        ]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        env, _, model = self._running()
        if attempt == self.first_attempt and rollout_id not in self.armed:
            self.armed.add(rollout_id)  # armed once, before the episode can reach it
            await Debug(self.http, model.url).arm("finish", rollout_id)
        body = {"rollout_id": rollout_id, "attempt": attempt, "task": row()}
        reply = await self.http.post(env.url + "/run", json=body, timeout=120)
        result = RunRefused.reply(reply)
        # the Gym session's cookie differs between an episode and its twin: kept aside
        self.results[(rollout_id, attempt)] = result
        return {k: v for k, v in result.items() if k != "session"}

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        """Each episode finishes turn 0 (a model call and one increment) and is held at the
        third token of turn 1's model call."""
        model = Debug(self.http, self._running()[2].url)
        for rid in rollout_ids:
            await model.paused("finish", rid)
            await model.arm("token", rid, index=2)
            await model.release("finish", rid)
            await model.paused("token", rid)

    async def crash(self) -> None:
        env, resources, model = self._running()
        env.kill()
        resources.kill()
        os.killpg(model.process.pid, signal.SIGKILL)
        model.process.wait(timeout=STOP_TIMEOUT_S)

    async def restart(self, attempt: int) -> None:
        self.stop()  # never leave an earlier group running behind the new one
        self.model = ServerProcess.start(
            self.root, Role.MODEL, "--debug-hooks", "--token-latency-ms", "0", attempt=attempt
        )
        first = self.first_attempt is None
        server = self.server if first else self.server_after_crash
        resources_port = free_port()

        def start_resources() -> None:
            self.resources = GymProcess.start(
                self.root,
                "resources",
                ["--server", server, "--name", COUNTER_NAME],
                attempt=attempt,
                port=resources_port,
                release=self.release,
            )

        def start_env(model_url: str) -> None:
            self.env = GymProcess.start(
                self.root,
                "environment",
                [
                    "--strategy",
                    self.strategy,
                    "--model-url",
                    model_url,
                    "--resources-url",
                    f"http://127.0.0.1:{resources_port}",
                    "--step-timeout-seconds",
                    "30",
                    "--rebuild-timeout-seconds",
                    "20",
                ],
                attempt=attempt,
                env={"ROLLOUT_GYM_REBUILD": "on" if self.rebuild else "off"},
                release=self.release,
            )

        # the two Gym servers at once (each waits for its own /healthz; the adapter reaches the
        # counter only per episode): a Gym start is seconds of imports
        async with anyio.create_task_group() as starting:
            starting.start_soon(anyio.to_thread.run_sync, start_resources)
            starting.start_soon(anyio.to_thread.run_sync, start_env, self.model.url)
        if self.first_attempt is None:
            self.first_attempt = attempt

    def stop(self) -> None:
        model = self.model if self.model is not None and self.model.process.poll() is None else None
        stop_together([self.env, self.resources, model])


async def run_kit(tmp_path: Path, *, restarting: bool = False, **kwargs: Any) -> GymDriver:
    async with httpx.AsyncClient() as http:
        driver = GymDriver(tmp_path, http, **kwargs)
        try:
            await driver.restart(0)
            await check_crash_restore(
                driver, checkpoint_root=tmp_path / "checkpoints", restarting=restarting
            )
        finally:
            driver.stop()
    return driver


async def test_gym_adapter_keeps_the_participant_rules(tmp_path: Path, release: str) -> None:
    """The single-participant rules on an idle adapter and an idle hosted Gym server."""
    for kind, args in (
        (
            "environment",
            ["--model-url", "http://127.0.0.1:9", "--resources-url", "http://127.0.0.1:9"],
        ),
        ("resources", ["--server", COUNTER, "--name", COUNTER_NAME]),
    ):
        process = GymProcess.start(tmp_path / kind, kind, args, attempt=0, release=release)
        role = Role.ENVIRONMENT if kind == "environment" else Role.RESOURCES
        try:
            await check_participant(
                Target(process.url, role, TOKEN),
                checkpoint_root=tmp_path / kind / "checkpoints",
                lease_grace_seconds=LEASE_GRACE_S,
            )
        finally:
            process.stop()


@pytest.mark.parametrize(
    ("strategy", "server"),
    [("replay", COUNTER), ("snapshot", SNAPSHOT_COUNTER)],
)
async def test_gym_adapter_passes_the_kit(
    tmp_path: Path, release: str, strategy: str, server: str
) -> None:
    driver = await run_kit(tmp_path, release=release, strategy=strategy, server=server)
    # what the kit compared, from the Gym counter's own verify: every episode rewarded 1.0
    rewards = {key: result["reward"] for key, result in driver.results.items()}
    restored = {k: v for k, v in rewards.items() if k[1] == 1 and "uninterrupted" not in k[0]}
    assert restored, rewards
    assert set(restored.values()) == {1.0}, rewards
    continued = [driver.results[key]["continued_from"] for key in restored]
    assert continued == [0] * len(restored), driver.results


async def test_gym_adapter_passes_the_kit_restarting(tmp_path: Path, release: str) -> None:
    """`restart` keeps nothing of a session and says so: its prepare lists every episode as a
    restart (the checkpoint's, and the set's, work-loss count), and the restored group plays
    each again from its start (the kit's `restarting` mode: `steps.restarted` for
    `steps.no-rerun`), with the reward of its uninterrupted twin."""
    driver = await run_kit(tmp_path, release=release, strategy="restart", restarting=True)
    rewards = {key: result["reward"] for key, result in driver.results.items()}
    restarted = {k: v for k, v in rewards.items() if k[1] == 1 and "uninterrupted" not in k[0]}
    assert restarted, rewards
    assert set(restarted.values()) == {1.0}, rewards
    assert {driver.results[key]["continued_from"] for key in restarted} == {None}, driver.results


async def test_restart_fails_the_kit_without_its_mode(tmp_path: Path, release: str) -> None:
    """The same restarts, checked as if they were captured: `steps.no-rerun` names them."""
    with pytest.raises(ConformanceError) as failed:
        await run_kit(tmp_path, release=release, strategy="restart")
    assert failed.value.rule == "steps.no-rerun", failed.value
    assert "restarts ['kit-episode-0@0', 'kit-episode-1@0']" in str(failed.value), failed.value


async def test_gym_adapter_without_the_rebuild_fails_the_kit(tmp_path: Path, release: str) -> None:
    """The negative control: the restored episodes run on the restarted counter's empty
    sessions (Gym accepts the old cookie), and the kit sees the reward differ from the twin's."""
    with pytest.raises(ConformanceError) as failed:
        await run_kit(tmp_path, release=release, strategy="replay", rebuild=False)
    assert failed.value.rule == "state.in-boundary", failed.value


async def test_a_replay_that_does_not_reproduce_the_session_fails_the_restore(
    tmp_path: Path, release: str
) -> None:
    """The restore replays the recorded increment into a server that answers it otherwise (the
    counter replaced after the crash by Gym's weather example, which has no `increment_counter`
    and answers 404): the restore fails and says which call differed and what to do."""
    with pytest.raises(ConformanceError) as failed:
        await run_kit(tmp_path, release=release, strategy="replay", server_after_crash=WEATHER)
    message = str(failed.value)
    assert "replayed call 0 (/increment_counter) answered 404" in message, message
    assert "declare the snapshot or restart strategy" in message, message


def test_peer_addresses_become_gyms_server_config(release: str) -> None:
    """The operator's peer address of the model, in the Gym config the hosted server's
    `ServerClient` gets, resolves through Gym's own lookup (nemo-gym's
    `get_first_server_config_dict`) to that address, and the server's own name to itself."""
    script = (
        "import json, sys\n"
        "from nemo_gym.global_config import get_first_server_config_dict\n"
        "from omegaconf import OmegaConf\n"
        "from rollout_gym.resources import gym_global_config\n"
        "config = OmegaConf.create(gym_global_config('counter', '127.9.0.2', 8000,"
        " {'model': 'http://127.9.0.3:8001'}))\n"
        "found = {n: dict(get_first_server_config_dict(config, n))"
        " for n in ('policy_model', 'counter')}\n"
        "json.dump(found, sys.stdout)\n"
    )
    done = subprocess.run(
        [str(gym_python(release)), "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["policy_model"] == {"host": "127.9.0.3", "port": 8001}, found
    assert (found["counter"]["host"], found["counter"]["port"]) == ("127.9.0.2", 8000), found


async def test_a_resources_server_restarted_under_a_session_fails_the_episode(
    tmp_path: Path, release: str
) -> None:
    """The counter restarted within the attempt (no checkpoint, no restore): Gym would serve the
    episode's old cookie an empty session. The episode's next call sees another process answer
    (`X-Rollout-Gym-Instance`) and the episode fails with a message that says so."""
    async with httpx.AsyncClient() as http:
        driver = GymDriver(tmp_path, http, strategy="replay", release=release)
        try:
            await driver.restart(0)
            env, counter, model = driver._running()
            debug = Debug(http, model.url)
            await debug.arm("finish", "lone")
            body = {"rollout_id": "lone", "attempt": 0, "task": row()}
            async with anyio.create_task_group() as group:
                replies: list[httpx.Response] = []

                async def run() -> None:
                    replies.append(await http.post(env.url + "/run", json=body, timeout=120))

                group.start_soon(run)
                await debug.paused("finish", "lone")  # turn 0's call: the increment is next
                port = int(counter.url.rsplit(":", 1)[1])
                counter.kill()
                driver.resources = GymProcess.start(
                    tmp_path,
                    "resources",
                    ["--server", COUNTER, "--name", COUNTER_NAME],
                    attempt=0,
                    port=port,
                    release=release,
                )
                await debug.release("finish", "lone")
        finally:
            driver.stop()
    [reply] = replies
    assert reply.status_code == 500, reply.text
    assert "the resources server restarted since its Gym session was opened" in reply.text


def test_a_server_that_imports_the_modules_beside_it_is_hosted(
    tmp_path: Path, release: str
) -> None:
    """Gym runs a server as a script in its folder; hosted by module, calendar's `app` still
    finds its `utils` (the adapter puts the server's folder on the path), with no path set by
    the user."""
    process = GymProcess.start(
        tmp_path,
        "resources",
        ["--server", CALENDAR, "--name", "calendar"],
        attempt=0,
        release=release,
    )
    try:
        assert httpx.get(process.url + "/healthz", timeout=10).status_code == 200
        # Gym's own route of the hosted server answers: a session opens
        reply = httpx.post(process.url + "/seed_session", json={}, timeout=10)
        assert reply.status_code == 200, reply.text
    finally:
        process.stop()
