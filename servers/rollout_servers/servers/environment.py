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
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import Field
from rollout_protocol import (
    Boundary,
    Episode,
    EpisodeError,
    ErrorCode,
    ProtocolError,
    Role,
    RolloutId,
    StepMode,
    task_digest,
)

from ..tasks import Task
from .common import Outcome, RolloutServer, WireModel, episode_error

log = logging.getLogger(__name__)

_FINISHED_KEPT = 10_000


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
    record_kind = "boundary"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: dict[str, Outcome[RunResult]] = {}
        self._finished: OrderedDict[tuple[str, int], tuple[str, RunResult]] = OrderedDict()

    def is_finished(self, rollout_id: str, attempt: int) -> bool:
        """An episode finished when `/run` returned its result (one that failed, or was retired,
        runs again under the next attempt)."""
        return (rollout_id, attempt) in self._finished

    def add_routes(self, app: FastAPI) -> None:
        server = self

        @app.post("/run")
        async def run(request: RunRequest) -> RunResult:
            return await server.run(request)

    async def run(self, request: RunRequest) -> RunResult:
        rid, attempt, task = request.rollout_id, request.attempt, request.task
        if self.draining:
            raise ProtocolError(ErrorCode.ADMISSION_CLOSED, "the server is shutting down")
        self.check_attempt(rid, attempt)
        digest = task_digest(task.wire())
        finished = self._finished.get((rid, attempt))
        if finished is not None and finished[0] == digest:
            # a re-issued /run of an episode that already completed: never complete it twice
            return finished[1]
        ep = self.runtime.find(rid)
        if ep is not None:
            if ep.attempt != attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH, f"{rid} is live here under attempt {ep.attempt}"
                )
            if ep.digest != digest:
                raise ProtocolError(ErrorCode.TASK_MISMATCH, f"{rid} is live with another task")
        else:
            try:
                ep = self.runtime.begin(rid, attempt, Boundary("seed", {}), digest=digest)
            except EpisodeError as error:
                raise episode_error(error) from error
            self.stats.count(attempt, rid, "run", "started")
            if ep.continued_from is not None:
                self.stats.bump(attempt, "continued")
        outcome = self._running.get(rid)
        if outcome is None:
            outcome = self._running[rid] = Outcome()
            self.spawn(self._drive, ep, task, outcome)
        return await outcome.wait()

    # --- the episode --------------------------------------------------------------------------

    async def _drive(self, ep: Episode, task: Task, outcome: Outcome[RunResult]) -> None:
        error: ProtocolError | None = None
        try:
            with self.runtime.driving(ep):
                try:
                    with self.runtime.guard(ep):
                        while ep.boundary.step != "return":
                            await self._stage(ep, task)
                except EpisodeError as failure:
                    error = episode_error(failure)
                except ProtocolError as failure:
                    error = failure
                except Exception as failure:
                    log.exception("episode %s failed", ep.id)
                    error = ProtocolError(
                        ErrorCode.INTERNAL, f"{type(failure).__name__}: {failure}"
                    )
                finally:
                    await self._final_cleanup(ep)
                if error is None:
                    await self.hooks.point("return", ep.rollout_id)
                    await self.runtime.hold(ep)
                    result = _result(ep)
                    self._finished[(ep.rollout_id, ep.attempt)] = (ep.digest or "", result)
                    while len(self._finished) > _FINISHED_KEPT:
                        self._finished.popitem(last=False)
                    self.stats.count(ep.attempt, ep.rollout_id, "run", "completed")
                    outcome.set(result)
                else:
                    self.stats.count(ep.attempt, ep.rollout_id, "run", "failed")
                    outcome.fail(error)
        finally:
            self.runtime.end(ep)
            if self._running.get(ep.rollout_id) is outcome:
                del self._running[ep.rollout_id]
            if not outcome.done:
                outcome.fail(ProtocolError(ErrorCode.INTERNAL, "the server is shutting down"))

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
