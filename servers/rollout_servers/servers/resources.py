"""The resources server: per-episode sessions with a calculator tool and a verifier.

A session is an episode driven by requests: seed creates it, tool calls and verification are its
steps, close ends it. Each session declares on its seed reply whether verification *replays*
(stateless: a checkpoint may capture the episode before it and a restore reruns it) or must be
*waited* for (a checkpoint waits until it is done); the choice comes from the task (`verify`).

Every step is idempotent by key, so a caller that replays a step after a restore gets the
recorded result instead of the work running twice: a second seed returns the session, a tool
call with a recorded `call` index returns its recorded output, a second verification returns
the recorded verdict.

Tools declare whether a call can simply run again (`GET /tools`: `idempotent`). A call of an
idempotent tool is a *replay* step here and for its caller (the reference agent reads the
listing): a checkpoint captures the session at its previous boundary at once and a restore runs
the call again; a call of a tool declared otherwise (`--wait-tools`) is a *wait* step, which a
checkpoint waits for. The shipped calculator is a pure function of its input: idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

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

from ..tasks import CalculatorError, Task, calculate
from .common import RolloutServer, ServerOptions, WireModel, episode_error

log = logging.getLogger(__name__)


TOOLS: Final = ("calculator",)
"""The tools every session offers."""


def check_wait_tools(names: tuple[str, ...]) -> None:
    """Refuse tools declared not idempotent (`--wait-tools`) that this server does not offer.

    A misspelt name would otherwise be ignored and leave the tool it meant idempotent: its calls
    would replay after a restore instead of being waited for (docs/servers.md). ValueError names
    the unknown tools and the known ones.
    """
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise ValueError(
            f"--wait-tools: unknown tool{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(name) for name in unknown)} (this server's tools: "
            f"{', '.join(TOOLS)})"
        )


class ToolSpec(WireModel):
    """One tool of `GET /tools`."""

    name: str
    idempotent: bool
    """A call may run again after a restore with the same effect: callers run it as a replay
    step, so a checkpoint does not wait for it; false: a wait step, which it waits for."""


class ToolListing(WireModel):
    """`GET /tools`: the tools this server offers and how a caller steps their calls."""

    tools: list[ToolSpec]


class SeedRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    task: Task


class SeedReply(WireModel):
    rollout_id: str
    attempt: int
    verify: str
    tools: list[str]
    continued_from: int | None = None


class ToolRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    call: int = Field(ge=0, description="The caller's index for this call (its turn)")
    tool: str = "calculator"
    input: str = Field(max_length=1000)


class ToolReply(WireModel):
    output: str | None = None
    error: str | None = None
    replayed: bool = False


class VerifyRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    answer: int | None


class VerifyReply(WireModel):
    reward: float
    correct: bool
    replayed: bool = False


class CloseRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)


class CloseReply(WireModel):
    closed: bool


class ResourcesServer(RolloutServer):
    role = Role.RESOURCES
    waits_on = ()
    record_kind = "session"
    work_counter = None
    """Its seeds, tool calls and verifications are steps of the environment's and the agent's
    episodes too: counted there, not twice."""

    def __init__(self, options: ServerOptions, *, environ: Mapping[str, str] | None = None) -> None:
        check_wait_tools(options.wait_tools)  # before anything starts: a typo is fatal
        super().__init__(options, environ=environ)

    def add_routes(self, app: FastAPI) -> None:
        server = self

        @app.get("/tools")
        async def tools() -> ToolListing:
            return server.tool_listing()

        @app.post("/sessions/seed")
        async def seed(request: SeedRequest) -> SeedReply:
            return await server.seed(request)

        @app.post("/sessions/tool")
        async def tool(request: ToolRequest) -> ToolReply:
            return await server.tool(request)

        @app.post("/sessions/verify")
        async def verify(request: VerifyRequest) -> VerifyReply:
            return await server.verify(request)

        @app.post("/sessions/close")
        async def close(request: CloseRequest) -> CloseReply:
            return await server.close(request)

    # --- routes -------------------------------------------------------------------------------

    def tool_listing(self) -> ToolListing:
        wait = set(self.options.wait_tools)
        return ToolListing(tools=[ToolSpec(name=t, idempotent=t not in wait) for t in TOOLS])

    def tool_mode(self, tool: str) -> StepMode:
        """How a call of `tool` is stepped: replay when declared idempotent, else wait."""
        return StepMode.WAIT if tool in self.options.wait_tools else StepMode.REPLAY

    async def seed(self, request: SeedRequest) -> SeedReply:
        rid, attempt = request.rollout_id, request.attempt
        self.check_attempt(rid, attempt)
        task = request.task
        try:
            ep = self.runtime.find(rid)
            if ep is not None and ep.attempt != attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH, f"{rid} has a session of attempt {ep.attempt}"
                )
            if ep is None:
                ep = self.runtime.begin(
                    rid,
                    attempt,
                    Boundary("seed", {"task": task.wire()}),
                    digest=task_digest(task.wire()),
                )
            if ep.boundary.step == "seed":

                async def run() -> Boundary:
                    await self.hooks.point("seed", rid)
                    return Boundary(
                        "ready",
                        {"task": task.wire(), "verify": task.verify, "tools": {}, "verdict": None},
                    )

                with self.runtime.guard(ep):
                    await self.runtime.step(ep, "seed", StepMode.REPLAY, run)
            else:
                self.stats.bump(attempt, "seed_reused")
        except EpisodeError as error:
            raise episode_error(error) from error
        return SeedReply(
            rollout_id=rid,
            attempt=attempt,
            verify=str(ep.boundary.state["verify"]),
            tools=list(TOOLS),
            continued_from=ep.continued_from,
        )

    async def tool(self, request: ToolRequest) -> ToolReply:
        ep = self._session(request.rollout_id, request.attempt)
        if request.tool not in TOOLS:
            return ToolReply(error=f"unknown tool {request.tool!r} (available: {', '.join(TOOLS)})")
        recorded = ep.boundary.state["tools"].get(str(request.call))
        if recorded is not None:
            self.stats.bump(request.attempt, "tool_replayed")
            return ToolReply(**recorded, replayed=True)

        async def run() -> Boundary:
            await self.hooks.point("tool", request.rollout_id, request.call)
            try:
                result = {"output": str(calculate(request.input)), "error": None}
            except CalculatorError as error:
                result = {"output": None, "error": str(error)}
            state = dict(ep.boundary.state)
            state["tools"] = {**state["tools"], str(request.call): result}
            return Boundary("ready", state)

        mode = self.tool_mode(request.tool)
        boundary = await self._step(ep, f"tool@{request.call}", mode, run)
        return ToolReply(**boundary.state["tools"][str(request.call)])

    async def verify(self, request: VerifyRequest) -> VerifyReply:
        ep = self._session(request.rollout_id, request.attempt)
        verdict = ep.boundary.state.get("verdict")
        if verdict is not None:
            self.stats.bump(request.attempt, "verify_replayed")
            return VerifyReply(**verdict, replayed=True)
        task = Task.model_validate(ep.boundary.state["task"])
        mode = StepMode(ep.boundary.state["verify"])

        async def run() -> Boundary:
            await self.hooks.point("verify", request.rollout_id)
            correct = request.answer is not None and request.answer == task.answer
            state = dict(ep.boundary.state)
            state["verdict"] = {"reward": 1.0 if correct else 0.0, "correct": correct}
            return Boundary("ready", state)

        boundary = await self._step(ep, "verify", mode, run)
        return VerifyReply(**boundary.state["verdict"])

    async def close(self, request: CloseRequest) -> CloseReply:
        """Closing is cleanup: never gated by admission, and it always ends the session."""
        rid, attempt = request.rollout_id, request.attempt
        ep = self.runtime.find(rid)
        if ep is None or ep.attempt != attempt:
            restored = self.runtime.find_restored(rid)
            if restored is not None and restored.attempt == attempt:
                self.runtime.drop_restored(rid)
                self.stats.count(attempt, rid, "close", "completed")
                return CloseReply(closed=True)
            return CloseReply(closed=False)
        self.stats.count(attempt, rid, "close", "started")
        if ep.running:
            ep.cancel()
        self.runtime.end(ep)
        self.stats.count(attempt, rid, "close", "completed")
        return CloseReply(closed=True)

    # --- helpers ------------------------------------------------------------------------------

    def _session(self, rollout_id: str, attempt: int) -> Episode:
        """The live session of (rollout, attempt), claiming a restored one on first use."""
        self.check_attempt(rollout_id, attempt)
        ep = self.runtime.find(rollout_id)
        if ep is not None:
            if ep.attempt != attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH,
                    f"{rollout_id} has a session of attempt {ep.attempt}",
                )
            return ep
        if self.runtime.find_restored(rollout_id) is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no session for {rollout_id}; seed it first")
        try:
            return self.runtime.begin(rollout_id, attempt, Boundary("seed"))
        except EpisodeError as error:
            raise episode_error(error) from error

    async def _step(
        self, ep: Episode, name: str, mode: StepMode, run: Callable[[], Awaitable[Boundary]]
    ) -> Boundary:
        if ep.boundary.step != "ready":
            raise ProtocolError(ErrorCode.WRONG_PHASE, f"session {ep.rollout_id} is not seeded")
        try:
            with self.runtime.guard(ep):
                return await self.runtime.step(ep, name, mode, run)
        except EpisodeError as error:
            raise episode_error(error) from error
