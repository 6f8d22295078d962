"""The environment server: owns the episode protocol of each rollout (`POST /run`).

An episode runs explicit stages, recording a boundary after each:

    next: seed  ->  seed the resources session          (replay)
    next: invoke_agent  ->  run the agent's session     (replay: the agent parks its own turns)
    next: verify  ->  verify the answer                 (wait or replay, as the resources
                                                          session declared on its seed reply;
                                                          kept in the boundary, so a restored
                                                          episode still knows)
    next: return  ->  final cleanup, then reply

A restored boundary is continued by `/run` of the next attempt; the task digest must match the
recorded one (409 `task_mismatch` otherwise), and a `/run` for a retired attempt is refused (410).

Final cleanup closes the episode's agent and resources sessions before `/run` replies, on every
path (success, failure, retire, shutdown). It runs shielded and a checkpoint waits for it; a
retire cancels an episode only before cleanup starts and then waits for the episode to end, so
its reply means the sessions are closed. A result that is ready while a checkpoint is open is
held (the episode stays recorded at `return`, cleanup done) and delivered on resume: a crash in
between then still answers the next attempt's `/run` from the record, without running anything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import FastAPI
from pydantic import Field
from rollout_protocol import (
    Boundary,
    Episode,
    ErrorCode,
    ProtocolError,
    Role,
    RolloutId,
    RunRoute,
    StepMode,
)

from ..tasks import Task
from .common import RolloutServer, WireModel

log = logging.getLogger(__name__)


class RunRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    task: Task


class RunResult(WireModel):
    rollout_id: str
    attempt: int
    answer: int | None
    reward: float
    steps: int = Field(description="Agent turns (model calls) the episode took.")
    continued_from: int | None = Field(
        default=None, description="The attempt whose checkpoint this episode continued from."
    )


class EnvironmentServer(RolloutServer):
    role = Role.ENVIRONMENT
    waits_on = (Role.AGENT, Role.RESOURCES)  # the final cleanup closes both; verify: wait
    record_kind = "boundary"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runs = RunRoute[RunResult](
            self.plane, self.runtime, draining=lambda: self.draining, spawn=self.spawn
        )
        """The `/run` duties (docs/sdk.md, section 2); each episode runs in the server's task
        group, so it outlives the calls that wait for it."""

    def is_finished(self, rollout_id: str, attempt: int) -> bool:
        """An episode finished when `/run` returned its result (one that failed, or was retired,
        runs again under the next attempt)."""
        return self.runs.is_finished(rollout_id, attempt)

    def add_routes(self, app: FastAPI) -> None:
        server = self

        @app.post("/run")
        async def run(request: RunRequest) -> RunResult:
            return await server.run(request)

    async def run(self, request: RunRequest) -> RunResult:
        return await self.runs.run(
            request, partial(self._play, task=request.task), first=Boundary("seed", {})
        )

    # --- the episode --------------------------------------------------------------------------

    async def _play(self, ep: Episode, task: Task) -> RunResult:
        """The stages from the episode's boundary to `return`; final cleanup on every path."""
        if ep.continued_from is not None:
            self.stats.bump(ep.attempt, "continued")
        try:
            while ep.boundary.step != "return":
                await self._stage(ep, task)
        finally:
            await self._final_cleanup(ep)
        await self.hooks.point("return", ep.rollout_id)
        return _result(ep)

    async def _stage(self, ep: Episode, task: Task) -> None:
        step, state = ep.boundary.step, dict(ep.boundary.state)
        rid, attempt = ep.rollout_id, ep.attempt
        body = {"rollout_id": rid, "attempt": attempt}

        if step == "seed":

            async def seed() -> Boundary:
                await self.hooks.point("seed", rid)
                reply = await self.call_peer(
                    self.peer_url(Role.RESOURCES), "/sessions/seed", body | {"task": task.wire()}
                )
                return Boundary("invoke_agent", {"verify": str(reply["verify"])})

            await self._run_step(ep, "seed", StepMode.REPLAY, seed)
        elif step == "invoke_agent":

            async def invoke() -> Boundary:
                await self.hooks.point("invoke", rid)
                reply = await self.call_peer(
                    self.peer_url(Role.AGENT), "/sessions/run", body | {"task": task.wire()}
                )
                return Boundary(
                    "verify", state | {"answer": reply["answer"], "turns": int(reply["turns"])}
                )

            await self._run_step(ep, "invoke_agent", StepMode.REPLAY, invoke)
        elif step == "verify":

            async def verify() -> Boundary:
                await self.hooks.point("verify", rid)
                reply = await self.call_peer(
                    self.peer_url(Role.RESOURCES),
                    "/sessions/verify",
                    body | {"answer": state["answer"]},
                )
                return Boundary("return", state | {"reward": float(reply["reward"])})

            await self._run_step(ep, "verify", StepMode(state["verify"]), verify)
        else:
            raise ProtocolError(ErrorCode.INTERNAL, f"{ep.id}: unknown stage {step!r}")

    async def _run_step(
        self, ep: Episode, name: str, mode: StepMode, run: Callable[[], Awaitable[Boundary]]
    ) -> None:
        await self.runtime.step(ep, name, mode, run)

    async def _final_cleanup(self, ep: Episode) -> None:
        """Close the agent and resources sessions; shielded, waited for by checkpoints."""
        if ep.boundary.state.get("cleaned"):
            return  # restored after its cleanup had already run
        body = {"rollout_id": ep.rollout_id, "attempt": ep.attempt}
        async with self.runtime.cleanup(ep):
            await self.hooks.point("cleanup", ep.rollout_id)
            for url in (self.peer_url(Role.AGENT), self.peer_url(Role.RESOURCES)):
                try:
                    await self.call_peer(
                        url, "/sessions/close", body, timeout_s=self.options.cleanup_timeout_s
                    )
                except ProtocolError as error:
                    log.warning("cleanup of %s: %s", ep.id, error.detail)
        self.runtime.advance(ep, Boundary(ep.boundary.step, {**ep.boundary.state, "cleaned": True}))


def _result(ep: Episode) -> RunResult:
    state = ep.boundary.state
    answer = state.get("answer")
    return RunResult(
        rollout_id=ep.rollout_id,
        attempt=ep.attempt,
        answer=None if answer is None else int(answer),
        reward=float(state.get("reward", 0.0)),
        steps=int(state.get("turns", 0)),
        continued_from=ep.continued_from,
    )
