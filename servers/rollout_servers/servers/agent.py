"""The agent server: a multi-turn tool-using loop per session, parked between turns.

`POST /sessions/run` runs (or continues) the session of one rollout: a model call through the
model server's OpenAI chat API, then, when the model asked for it (`CALC: <expression>`), a
calculator call on the resources server whose `RESULT:` goes into the next turn's prompt;
until the model answers (`ANSWER: <integer>`) or the session reaches its task's `max_turns`.

Steps and modes: the model call is a *replay* step (the model server records its own progress:
a cut prefix or a held response, keyed by `<rollout_id>/<turn>`, so re-issuing it after a restore
costs no completed tokens); the tool call is a *replay* step when the resources server declares
the tool idempotent (`GET /tools`, read once per resources URL), so a checkpoint never waits for
it and a restore calls it again, and a *wait* step otherwise (its resources server is prepared
after the agent, so it can always finish). The session's records hold the transcript and the
turn index; a restored session resumes at its next step.

A finished session keeps its result until the environment closes it in its final cleanup: the
environment may still replay its invocation after a restore and must get the same answer.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlencode

from fastapi import FastAPI
from pydantic import Field
from rollout_protocol import (
    Boundary,
    Episode,
    EpisodeCancelled,
    EpisodeError,
    ErrorCode,
    ProtocolError,
    Role,
    RolloutId,
    StepMode,
    task_digest,
)

from ..tasks import Task
from .common import Outcome, PeerError, RolloutServer, WireModel, episode_error
from .model import ATTEMPT_HEADER, REQUEST_HEADER

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You solve arithmetic word problems. To use the calculator, write `CALC: <expression>`; "
    "its result arrives as `RESULT: <number>`. When you know the answer, write "
    "`ANSWER: <integer>`."
)
NUDGE = "Reply with `CALC: <expression>` or `ANSWER: <integer>`."
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+)")
_CALC = re.compile(r"CALC:\s*([-+*/%() 0-9]+)")
MODEL_MAX_TOKENS = 128
TOOL = "calculator"
"""The one tool the agent calls (on the resources server)."""


class RunRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    task: Task


class RunReply(WireModel):
    rollout_id: str
    attempt: int
    answer: int | None
    turns: int
    status: Literal["answered", "max_turns"]
    continued_from: int | None = None


class CloseRequest(WireModel):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)


class CloseReply(WireModel):
    closed: bool


class AgentServer(RolloutServer):
    role = Role.AGENT
    waits_on = (Role.RESOURCES,)  # tools not declared idempotent (docs/servers.md)
    record_kind = "session"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: dict[str, Outcome[RunReply]] = {}
        self._tool_modes: dict[str, StepMode] | None = None
        """How each tool's calls are stepped, as the resources server declared (None: not
        read yet, or its URL changed)."""

    def add_routes(self, app: FastAPI) -> None:
        server = self

        @app.post("/sessions/run")
        async def run(request: RunRequest) -> RunReply:
            return await server.run(request)

        @app.post("/sessions/close")
        async def close(request: CloseRequest) -> CloseReply:
            return await server.close(request)

    async def run(self, request: RunRequest) -> RunReply:
        rid, attempt, task = request.rollout_id, request.attempt, request.task
        self.check_attempt(rid, attempt)
        digest = task_digest(task.wire())
        ep = self.runtime.find(rid)
        if ep is not None and (ep.attempt != attempt or ep.digest != digest):
            raise ProtocolError(
                ErrorCode.ATTEMPT_MISMATCH if ep.attempt != attempt else ErrorCode.TASK_MISMATCH,
                f"{rid} has a session of attempt {ep.attempt} with its own task",
            )
        if ep is None:
            first = Boundary(
                "model",
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": task.question},
                    ],
                    "turn": 0,
                },
            )
            try:
                ep = self.runtime.begin(rid, attempt, first, digest=digest)
            except EpisodeError as error:
                raise episode_error(error) from error
        if ep.boundary.step == "done":
            self.stats.bump(attempt, "results_replayed")
            return _reply(ep)
        outcome = self._running.get(rid)
        if outcome is None:
            outcome = self._running[rid] = Outcome()
            self.spawn(self._drive, ep, task, outcome)
        return await outcome.wait()

    def rewire(self, peers: Mapping[Role, str]) -> None:
        super().rewire(peers)
        if Role.RESOURCES in peers:
            self._tool_modes = None  # a new resources server: read its declaration again

    async def tool_mode(self, tool: str, rollout_id: str) -> StepMode:
        """Replay for a tool the resources server declares idempotent, wait otherwise (also
        for a tool it does not list, and for every tool of a server without `GET /tools`).

        The listing is read once, naming the episode that asks (`?rollout_id=`): a resources
        pod of several workers routes only requests that name a rollout (every worker declares
        the same tools)."""
        if self._tool_modes is None:
            try:
                listing = await self.call_peer(
                    self.peer_url(Role.RESOURCES),
                    f"/tools?{urlencode({'rollout_id': rollout_id})}",
                    {},
                    key="tools",
                    method="GET",
                )
            except PeerError as error:
                if error.http_status != 404:
                    raise
                listing = {}  # it declares nothing: every call is a wait step
            self._tool_modes = {
                str(t["name"]): StepMode.REPLAY if t.get("idempotent") is True else StepMode.WAIT
                for t in listing.get("tools", [])
            }
        return self._tool_modes.get(tool, StepMode.WAIT)

    async def close(self, request: CloseRequest) -> CloseReply:
        """Closing is cleanup: never gated by admission; cancels a running loop, then ends."""
        rid, attempt = request.rollout_id, request.attempt
        ep = self.runtime.find(rid)
        if ep is None or ep.attempt != attempt:
            restored = self.runtime.find_restored(rid)
            if restored is not None and restored.attempt == attempt:
                self.runtime.drop_restored(rid)
                return CloseReply(closed=True)
            return CloseReply(closed=False)
        self.stats.count(attempt, rid, "close", "started")
        outcome = self._running.get(rid)
        if outcome is not None and not outcome.done:
            ep.cancel()
            with contextlib.suppress(ProtocolError):
                await outcome.wait()
        self.runtime.end(ep)
        self.stats.count(attempt, rid, "close", "completed")
        return CloseReply(closed=True)

    async def _drive(self, ep: Episode, task: Task, outcome: Outcome[RunReply]) -> None:
        try:
            with self.runtime.driving(ep), self.runtime.guard(ep):
                while ep.boundary.step != "done":
                    turn = int(ep.boundary.state["turn"])
                    if ep.boundary.step == "model":
                        # at a boundary: between turns (a test can hold the session here)
                        await self.hooks.point("turn", ep.rollout_id, turn)
                        await self.runtime.step(
                            ep, f"model@{turn}", StepMode.REPLAY, self._model_call(ep, task)
                        )
                    else:
                        mode = await self.tool_mode(TOOL, ep.rollout_id)
                        await self.runtime.step(ep, f"tool@{turn}", mode, self._tool_call(ep))
            outcome.set(_reply(ep))
        except EpisodeCancelled as error:
            self.runtime.end(ep)
            outcome.fail(episode_error(error))
        except EpisodeError as error:
            outcome.fail(episode_error(error))
        except ProtocolError as error:
            outcome.fail(error)
        except Exception as error:
            log.exception("agent session %s failed", ep.id)
            outcome.fail(ProtocolError(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}"))
        except BaseException:
            outcome.fail(ProtocolError(ErrorCode.INTERNAL, "the agent server is shutting down"))
            raise
        finally:
            if self._running.get(ep.rollout_id) is outcome:
                del self._running[ep.rollout_id]

    def _model_call(self, ep: Episode, task: Task) -> Any:
        async def run() -> Boundary:
            state = ep.boundary.state
            messages: list[dict[str, str]] = list(state["messages"])
            turn = int(state["turn"])
            await self.hooks.point("model", ep.rollout_id, turn)
            reply = await self.call_peer(
                self.peer_url(Role.MODEL),
                "/v1/chat/completions",
                {
                    "model": self.options.model_name,
                    "messages": messages,
                    "seed": task.seed,
                    "max_tokens": MODEL_MAX_TOKENS,
                    "temperature": 0,
                },
                headers={
                    REQUEST_HEADER: f"{ep.rollout_id}/{turn}",
                    ATTEMPT_HEADER: str(ep.attempt),
                },
                key=ep.rollout_id,
            )
            content = str(reply["choices"][0]["message"]["content"])
            messages.append({"role": "assistant", "content": content})
            answer, calc = _ANSWER.search(content), _CALC.search(content)
            if answer is not None:
                return Boundary(
                    "done",
                    {"messages": messages, "turn": turn + 1, "answer": int(answer.group(1))}
                    | {"status": "answered"},
                )
            if turn + 1 >= task.max_turns:
                return Boundary(
                    "done",
                    {"messages": messages, "turn": turn + 1, "answer": None, "status": "max_turns"},
                )
            if calc is not None:
                return Boundary(
                    "tool",
                    {"messages": messages, "turn": turn, "expression": calc.group(1).strip()},
                )
            messages.append({"role": "user", "content": NUDGE})
            return Boundary("model", {"messages": messages, "turn": turn + 1})

        return run

    def _tool_call(self, ep: Episode) -> Any:
        async def run() -> Boundary:
            state = ep.boundary.state
            messages: list[dict[str, str]] = list(state["messages"])
            turn = int(state["turn"])
            await self.hooks.point("tool", ep.rollout_id, turn)
            reply = await self.call_peer(
                self.peer_url(Role.RESOURCES),
                "/sessions/tool",
                {
                    "rollout_id": ep.rollout_id,
                    "attempt": ep.attempt,
                    "call": turn,
                    "tool": TOOL,
                    "input": str(state["expression"]),
                },
            )
            output, error = reply.get("output"), reply.get("error")
            messages.append(
                {
                    "role": "user",
                    "content": f"RESULT: {output}" if error is None else f"ERROR: {error}",
                }
            )
            return Boundary("model", {"messages": messages, "turn": turn + 1})

        return run


def _reply(ep: Episode) -> RunReply:
    state = ep.boundary.state
    return RunReply(
        rollout_id=ep.rollout_id,
        attempt=ep.attempt,
        answer=state.get("answer"),
        turns=int(state["turn"]),
        status=state.get("status", "answered"),
        continued_from=ep.continued_from,
    )
