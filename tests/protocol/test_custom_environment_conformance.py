"""The conformance kit (`rollout_protocol.conformance`) against the custom environment example
(`examples/custom-environment/adventure_env.py`), run as the process a pod would run:
`python -m adventure_env` with the example folder on `PYTHONPATH`.

- `check_participant`: the single-participant rules (auth, strict bodies, phases, stale and
  conflicting ids, all-or-nothing restore, the lease's automatic resume) on an idle server.
- `check_crash_restore`: `steps.no-rerun` across a SIGKILL of the environment and its model
  (the reference model server), restored under the next attempt. The driver holds each episode
  at its second turn through the model's pause points (`--debug-hooks`), so both are provably
  mid-way, one turn behind them, when the kit checkpoints and crashes the group.
- the same check with the kit's `FakeModel` (served in this process, a participant of the
  group) instead of the reference model: the environment process calls it over loopback HTTP,
  the fake holds each episode's second model call, and the kit also checks
  `model.same-prompts` and `model.headers` on every call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
from anyio.abc import TaskGroup
from rollout_protocol import ControlSettings, Role
from rollout_protocol.conformance import (
    FakeModel,
    RunRefused,
    ServedApp,
    Target,
    base_rollout_id,
    check_crash_restore,
    check_participant,
    start_app,
)
from testsupport.server_processes import (
    SET_NAME,
    TOKEN,
    Debug,
    ServerProcess,
    free_port,
    server_env,
    two_step_task,
)

from devcluster.waiting import wait_for_sync

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom-environment"
LEASE_GRACE_S = 1.0
STOP_TIMEOUT_S = 15.0


class Environment:
    """`python -m adventure_env` as a process with the variables the operator gives a pod."""

    def __init__(self, root: Path, model_url: str, attempt: int) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        env = server_env(root / "checkpoints", attempt)
        path = os.pathsep.join(filter(None, [str(EXAMPLE), env.get("PYTHONPATH")]))
        env.update(PYTHONPATH=path, ROLLOUT_LEASE_GRACE_SECONDS=str(LEASE_GRACE_S))
        port = self.url.rsplit(":", 1)[1]
        with (root / f"environment-{attempt}.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "adventure_env",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    port,
                    "--model-url",
                    model_url,
                    "--drain-seconds",
                    "1",
                ],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        wait_for_sync(self._ready, 30, f"the environment at {self.url} to answer /healthz")

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"the environment exited ({self.process.returncode})"
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        return False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> int:
        """SIGTERM (drain, then a clean exit), SIGKILL only if it did not exit in time."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise


@contextlib.contextmanager
def environment(root: Path, model_url: str, attempt: int = 0) -> Iterator[Environment]:
    env = Environment(root, model_url, attempt)
    try:
        yield env
    finally:
        if env.process.poll() is None:
            assert env.stop() == 0


async def test_custom_environment_keeps_the_participant_rules(tmp_path: Path) -> None:
    with environment(tmp_path, "http://127.0.0.1:9") as env:  # no episodes: no model needed
        await check_participant(
            Target(env.url, Role.ENVIRONMENT, TOKEN),
            checkpoint_root=tmp_path / "checkpoints",
            lease_grace_seconds=LEASE_GRACE_S,
        )


class AdventureDriver:
    """The kit's `EpisodeDriver` for the environment and the reference model server."""

    def __init__(self, root: Path, http: httpx.AsyncClient) -> None:
        self.root, self.http = root, http
        self.model: ServerProcess | None = None
        self.env: Environment | None = None
        self.first_attempt: int | None = None
        self.armed: set[str] = set()

    def _running(self) -> tuple[Environment, ServerProcess]:
        assert self.env is not None, "not started"
        assert self.model is not None, "not started"
        return self.env, self.model

    def participants(self) -> Sequence[Target]:
        env, model = self._running()
        return [Target(env.url, Role.ENVIRONMENT, TOKEN), Target(model.url, Role.MODEL, TOKEN)]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        env, model = self._running()
        if attempt == self.first_attempt and rollout_id not in self.armed:
            self.armed.add(rollout_id)  # armed once, before the episode can reach it
            await Debug(self.http, model.url).arm("finish", rollout_id)
        body = {"rollout_id": rollout_id, "attempt": attempt, "task": two_step_task(1).wire()}
        reply = await self.http.post(env.url + "/run", json=body, timeout=60)
        return RunRefused.reply(reply)

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        """Each episode finishes turn 0 and is held at the third token of turn 1's model call."""
        model = Debug(self.http, self._running()[1].url)
        for rid in rollout_ids:
            await model.paused("finish", rid)
            await model.arm("token", rid, index=2)
            await model.release("finish", rid)
            await model.paused("token", rid)

    async def crash(self) -> None:
        env, model = self._running()
        env.kill()
        os.killpg(model.process.pid, signal.SIGKILL)
        model.process.wait(timeout=STOP_TIMEOUT_S)

    async def restart(self, attempt: int) -> None:
        self.stop()  # never leave an earlier pair running behind the new one
        self.model = ServerProcess.start(self.root, Role.MODEL, "--debug-hooks", attempt=attempt)
        self.env = Environment(self.root, self.model.url, attempt)
        if self.first_attempt is None:
            self.first_attempt = attempt

    def stop(self) -> None:
        if self.env is not None and self.env.process.poll() is None:
            self.env.stop()
        if self.model is not None and self.model.process.poll() is None:
            self.model.stop()


async def test_custom_environment_reruns_no_completed_step(tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http:
        driver = AdventureDriver(tmp_path, http)
        try:
            await driver.restart(0)
            await check_crash_restore(driver, checkpoint_root=tmp_path / "checkpoints")
        finally:
            driver.stop()


class FakeModelDriver:
    """The kit's `EpisodeDriver` for the environment process and the kit's `FakeModel`, served
    in this process on loopback: each episode of the first attempt is held in its second model
    call (`<rollout_id>/1`), after its first turn completed. A crash kills the environment
    and drops the fake's app; a restart serves a fresh one (a new port) and starts the
    environment against it."""

    def __init__(self, root: Path, group: TaskGroup, http: httpx.AsyncClient) -> None:
        self.root, self.group, self.http = root, group, http
        self.model = FakeModel()
        self.served: ServedApp | None = None
        self.env: Environment | None = None
        self.first: int | None = None
        self.armed: set[str] = set()

    def _running(self) -> tuple[Environment, ServedApp]:
        assert self.env is not None, "not started"
        assert self.served is not None, "not started"
        return self.env, self.served

    def participants(self) -> Sequence[Target]:
        env, served = self._running()
        return [Target(env.url, Role.ENVIRONMENT, TOKEN), served.target]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        env, _ = self._running()
        own = attempt == self.first and base_rollout_id(rollout_id) == rollout_id
        if own and rollout_id not in self.armed:  # once: the kit repeats /run
            self.armed.add(rollout_id)
            self.model.hold(f"{rollout_id}/1", attempt=attempt)
        body = {"rollout_id": rollout_id, "attempt": attempt, "task": two_step_task(1).wire()}
        reply = await self.http.post(env.url + "/run", json=body, timeout=60)
        return RunRefused.reply(reply)

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        for rid in rollout_ids:
            await self.model.wait_held(f"{rid}/1", deadline_ts)

    async def crash(self) -> None:
        env, served = self._running()
        await anyio.to_thread.run_sync(env.kill)
        await served.crash()

    async def restart(self, attempt: int) -> None:
        await self.stop()  # never leave an earlier pair running behind the new one
        settings = ControlSettings(
            Role.MODEL,
            set_name=SET_NAME,
            checkpoint_root=self.root / "checkpoints",
            token=TOKEN,
            attempt=attempt,
            lease_grace_seconds=LEASE_GRACE_S,
        )
        self.served = await start_app(
            self.group, self.model.app(settings), role=Role.MODEL, token=TOKEN
        )
        url = self.served.target.base_url
        self.env = await anyio.to_thread.run_sync(Environment, self.root, url, attempt)
        if self.first is None:
            self.first = attempt

    async def stop(self) -> None:
        if self.env is not None and self.env.process.poll() is None:
            await anyio.to_thread.run_sync(self.env.stop)
        if self.served is not None:
            await self.served.stop()
            self.served = None


async def test_custom_environment_passes_the_kit_with_the_fake_model(tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http, anyio.create_task_group() as group:
        driver = FakeModelDriver(tmp_path, group, http)
        try:
            await driver.restart(0)
            await check_crash_restore(
                driver, checkpoint_root=tmp_path / "checkpoints", model=driver.model
            )
        finally:
            with anyio.CancelScope(shield=True):
                await driver.stop()
    # what the kit compared: the restored episodes' calls of attempt 1, and their twins'
    model = driver.model
    for rid in ("kit-episode-0", "kit-episode-1"):
        restored = model.prompts(rid, 1)
        assert "1" in restored, model.calls(rid)
        assert restored.items() <= model.prompts(rid + "-uninterrupted", 1).items()
