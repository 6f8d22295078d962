"""A released NeMo Gym agent loop as a checkpointed environment (docs/gym.md).

Gym's `simple_agent` (`responses_api_agents/simple_agent/app.py` in nemo-gym 0.4) plays one
episode in one coroutine: seed a session on the resources server, call the model's
`/v1/responses` with the conversation so far, run every function call it returns as
`POST /<tool name>` on the resources server (an error status is a valid tool output), repeat until
the model answers without calls (or `max_steps`), then `POST /verify`. The transcript lives in
local variables and the session in the resources server's memory, so nothing of it survives a
restore. Here the same loop is a sequence of SDK steps with the transcript in each boundary:

| step | mode | what |
|---|---|---|
| `seed` | wait | `POST /seed_session` with the task row: opens the Gym session (its cookie) |
| `model@<turn>` | replay | `POST /v1/responses` to the set's model, naming the episode |
| `tool@<n>` | wait | one function call on the resources server, recorded with its output |
| `verify` | wait | `POST /verify` with the task row and the whole response |

After a restore, a Gym resources server that was restarted has lost every session while still
accepting the old cookie (its signing key is derived from its name), so a continued episode
would silently run on an empty session. The adapter never lets that happen: the session is
rebuilt by the declared strategy (`Strategy`) while the restore installs the episode, and a
rebuild that fails fails the restore.

`/run` takes nemo-gym 0.4's request and 0.7's typed episode (`rollout_gym.episode`) on one
`RunRoute`. A peer's error answer to the loop's own calls is final unless it may change
(`refused`), so a missing route ends the episode at once instead of waiting for a restore.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final

from fastapi import FastAPI, Query
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from rollout_protocol import (
    Boundary,
    ControlPlane,
    ControlSettings,
    Episode,
    EpisodeId,
    EpisodeRuntime,
    ErrorCode,
    ParkState,
    ProtocolError,
    Record,
    Role,
    RunRoute,
    RuntimeParticipant,
    StepCounters,
    StepMode,
)

from ._peers import GymReply, PeerUnavailable, make_client, post, refused, shown, unreachable
from .episode import EpisodeRequest, EpisodeResponse, answer, legacy

log = logging.getLogger("rollout_gym.environment")

MAX_SESSIONS_KEPT: Final = 50_000
"""Finished rollouts whose Gym session `GET /gym/sessions` can still name."""


class Strategy(StrEnum):
    """How a Gym resources session is rebuilt after a restore (docs/gym.md, "Strategies")."""

    REPLAY = "replay"
    """A fresh session, the recorded tool calls made again in order, each output checked."""
    SNAPSHOT = "snapshot"
    """A fresh session, the state the server exported after the last call imported into it."""
    RESTART = "restart"
    """Nothing kept: the checkpoint lists the episodes as restarts; they start over."""


class RebuildFailed(Exception):
    """A restored episode's Gym session could not be rebuilt; the restore fails with it."""


@dataclass(frozen=True)
class GymSettings:
    """What the adapter needs besides the control settings: its peers and its strategy."""

    model_url: str
    """The set's model (`ROLLOUT_PEER_MODEL_URL`): its `/v1/responses` is called."""
    resources_url: str
    """The Gym resources server (`ROLLOUT_PEER_RESOURCES_URL`)."""
    strategy: Strategy = Strategy.REPLAY
    max_steps: int = 16
    """Model calls per episode at most (Gym's `max_steps`; Gym's default is unbounded)."""
    step_timeout_s: float = 300.0
    """Each step's deadline: Gym's retries of an unreachable peer stop there."""
    rebuild_timeout_s: float = 60.0
    """How long one restore may spend rebuilding sessions, all episodes together."""
    snapshot_export: str = "/export_session"
    snapshot_import: str = "/import_session"
    rebuild: bool = True
    """False only for the negative control of the tests: restored episodes keep their old
    cookie, which a restarted Gym server accepts with an empty session."""


class RunRequest(BaseModel):
    """`POST /run` in nemo-gym 0.4's shape: the task is one row of a Gym dataset
    (`responses_create_params` and the fields the resources server's verify reads), flat or
    materialized (`rollout_gym.episode.legacy`)."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    task: dict[str, Any]


def _shape(body: Any) -> str:
    typed = isinstance(body, EpisodeRequest) or (isinstance(body, dict) and "episode_id" in body)
    return "0.7" if typed else "0.4"


RunBody = Annotated[
    Annotated[RunRequest, Tag("0.4")] | Annotated[EpisodeRequest, Tag("0.7")],
    Discriminator(_shape),
]
"""`POST /run` in either release's shape: nemo-gym 0.7's typed episode when it names an
`episode_id`, else 0.4's `{rollout_id, attempt, task}`."""


class RunResult(BaseModel):
    """`POST /run`'s reply: the fields `rollout-collect` reads, the Gym verify's reward, and the
    session's cookies (for reading the resources server's own state of the episode)."""

    rollout_id: str
    attempt: int
    reward: float
    steps: int
    tool_calls: int
    answer: str | None
    continued_from: int | None = None
    session: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class Played:
    """One finished episode: the 0.4-shaped reply and the resources server's verify answer
    (the typed reply's `result`, docs/gym.md, "The typed episode")."""

    result: RunResult
    verified: bytes
    """The verify answer as compressed JSON: `RunRoute` keeps the replies of the last 10,000
    finished episodes, and a verify answer carries the episode's whole request and response."""

    @classmethod
    def of(cls, result: RunResult, verification: Any) -> Played:
        return cls(result, zlib.compress(json.dumps(verification).encode()))

    def verification(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(zlib.decompress(self.verified))
        return value


@dataclass(frozen=True)
class RebuiltSession:
    """A session a restore rebuilt, waiting for its episode's first move under the attempt."""

    cookies: dict[str, str]
    instance: str | None
    """The resources process it lives in (`X-Rollout-Gym-Instance`), when it says."""


def _messages(task: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    params = dict(task.get("responses_create_params") or {})
    given = params.get("input", [])
    if isinstance(given, str):  # as simple_agent does: a string is one user message
        given = [{"role": "user", "content": given, "type": "message"}]
    return params, list(given)


def _answer(outputs: Sequence[Mapping[str, Any]]) -> str | None:
    for item in reversed(outputs):
        if item.get("type") == "message" and item.get("role") == "assistant":
            parts = item.get("content") or []
            return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
    return None


def _added_usage(total: Any, more: Any) -> Any:
    """simple_agent's usage over the episode: the first response's, with every later one's
    input, output and total tokens added (and the detail counts zeroed, as it does)."""
    if not isinstance(more, dict):
        return total
    if not isinstance(total, dict):
        return dict(more)
    summed = dict(total)
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        summed[key] = int(total.get(key) or 0) + int(more.get(key) or 0)
    summed["input_tokens_details"] = {
        **(total.get("input_tokens_details") or {}),
        "cached_tokens": 0,
    }
    summed["output_tokens_details"] = {
        **(total.get("output_tokens_details") or {}),
        "reasoning_tokens": 0,
    }
    return summed


class GymParticipant(RuntimeParticipant):
    """The environment's participant: the runtime's, plus the session rebuild on restore and
    the `restart` strategy's report at prepare."""

    def __init__(
        self,
        runtime: EpisodeRuntime,
        settings: GymSettings,
        rebuild: Callable[[int], Awaitable[None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(Role.ENVIRONMENT, runtime, **kwargs)
        self.settings = settings
        self._rebuild = rebuild

    async def park(self, deadline_ts: float) -> ParkState:
        state = await super().park(deadline_ts)
        if self.settings.strategy is not Strategy.RESTART:
            return state
        # Nothing of a Gym session can be kept: every episode restarts, and the checkpoint (and
        # the set's work-loss counts) say so instead of recording a boundary that cannot be
        # continued. No episode holds the prepare: it will be played again anyway.
        everyone = [*state.parked, *state.blockers, *state.restarts]
        return ParkState(restarts=everyone)

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        installed = await super().install(records, attempt)
        if self.settings.rebuild and self.settings.strategy is not Strategy.RESTART:
            try:
                await self._rebuild(attempt)
            except RebuildFailed as exc:
                raise ProtocolError(ErrorCode.INTERNAL, f"session rebuild failed: {exc}") from exc
        return installed


class GymEpisodes:
    """Gym's agent loop as SDK steps, and the sessions it keeps: what the environment's `/run`
    plays, what a restore rebuilds, and which session served each rollout (`/gym/sessions`)."""

    def __init__(self, settings: GymSettings, runtime: EpisodeRuntime, http: Any) -> None:
        self.settings = settings
        self.runtime = runtime
        self.http = http
        self.peers = {"model": settings.model_url, "resources": settings.resources_url}
        self.rebuilt: dict[tuple[str, int], RebuiltSession] = {}
        """Sessions a restore rebuilt, by (rollout, attempt), until the episode's first move."""
        self.sessions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        """Which Gym session served each rollout's last attempt here (`GET /gym/sessions`)."""

    # -- peers ------------------------------------------------------------------------------

    def rewire(self, new: Mapping[Role, str]) -> None:
        """Re-wired by a restore (InPlace recovery): calls go to the replaced peers."""
        for role, url in new.items():
            if role in (Role.MODEL, Role.RESOURCES):
                self.peers[role.value] = url

    def deadline(self) -> float:
        return time.time() + self.settings.step_timeout_s

    async def _post(
        self, path: str, body: Any, cookies: Mapping[str, str], deadline_ts: float
    ) -> GymReply:
        """A call to the resources server (raises `PeerUnavailable` past Gym's retries)."""
        url = self.peers["resources"] + path
        return await post(self.http, url, body, deadline_ts=deadline_ts, cookies=cookies)

    async def resources(
        self, path: str, body: Any, cookies: Mapping[str, str], deadline_ts: float
    ) -> GymReply:
        """A step's call to the resources server; unreachable, it fails the step."""
        try:
            return await self._post(path, body, cookies, deadline_ts)
        except PeerUnavailable as exc:
            raise unreachable("resources server", exc) from exc

    async def snapshot_of(self, cookies: Mapping[str, str]) -> Any:
        export = self.settings.snapshot_export
        reply = await self.resources(export, {}, cookies, self.deadline())
        if not reply.ok:
            raise refused(f"resources server: {export} (the snapshot strategy needs it)", reply)
        return reply.json().get("snapshot")

    def same_server(self, episode: Episode, session: Mapping[str, Any], reply: GymReply) -> None:
        """Never go on with a session the resources server no longer holds: a server restarted
        since the session was opened (or rebuilt) would serve the old cookie an empty one."""
        opened = session.get("instance")
        if opened is None or reply.instance is None or reply.instance == opened:
            return
        if not self.settings.rebuild:
            return  # the tests' negative control: the empty session, on purpose
        raise ProtocolError(
            ErrorCode.INTERNAL,
            f"{episode.rollout_id}: the resources server restarted since its Gym session was "
            "opened (its sessions are empty); the set's recovery restores it from a checkpoint",
        )

    # -- the rebuild after a restore (docs/gym.md, "Strategies") -----------------------------

    async def rebuild_all(self, attempt: int) -> None:
        """Every episode restored under `attempt` gets a fresh session holding its old one's
        state, within the settings' rebuild deadline for all of them together."""
        deadline = time.time() + self.settings.rebuild_timeout_s
        for restored in self.runtime.restored():
            if restored.attempt != attempt:
                continue
            session = restored.boundary.state.get("session")
            if not isinstance(session, dict):
                continue  # not reached seed yet: the episode opens its session when it goes on
            done = await self.rebuild_session(restored.rollout_id, restored.boundary, deadline)
            self.rebuilt[(restored.rollout_id, attempt)] = done
            log.info(
                "rebuilt the Gym session of %s under attempt %d (%s, %d calls recorded)",
                restored.rollout_id,
                attempt,
                self.settings.strategy.value,
                len(session["calls"]),
            )

    async def rebuild_session(
        self, rollout_id: str, boundary: Boundary, deadline: float
    ) -> RebuiltSession:
        """A fresh Gym session holding what the recorded one held, by the strategy."""
        state = boundary.state
        seeded = await self._rebuild_call(rollout_id, "/seed_session", state["task"], {}, deadline)
        if not seeded.ok:
            raise RebuildFailed(f"{rollout_id}: seed_session answered {seeded.status}")
        cookies = dict(seeded.cookies)
        if self.settings.strategy is Strategy.SNAPSHOT:
            cookies.update(await self._import_snapshot(rollout_id, state, cookies, deadline))
        else:
            cookies.update(await self._replay_calls(rollout_id, state, cookies, deadline))
        return RebuiltSession(cookies, seeded.instance)

    async def _rebuild_call(
        self,
        where: str,
        path: str,
        body: Any,
        cookies: Mapping[str, str],
        deadline: float,
    ) -> GymReply:
        """One call of a rebuild; an unreachable server fails the rebuild, named by `where`."""
        try:
            return await self._post(path, body, cookies, deadline)
        except PeerUnavailable as exc:
            raise RebuildFailed(f"{where}: {exc}") from exc

    async def _import_snapshot(
        self, rollout_id: str, state: Mapping[str, Any], cookies: Mapping[str, str], deadline: float
    ) -> dict[str, str]:
        """The snapshot strategy: the recorded export imported into the fresh session."""
        snapshot = state["session"].get("snapshot")
        if snapshot is None:
            raise RebuildFailed(f"{rollout_id}: no snapshot was recorded")
        path = self.settings.snapshot_import
        done = await self._rebuild_call(rollout_id, path, {"snapshot": snapshot}, cookies, deadline)
        if not done.ok:
            raise RebuildFailed(f"{rollout_id}: {path} answered {done.status}: {shown(done.text)}")
        return dict(done.cookies)

    async def _replay_calls(
        self, rollout_id: str, state: Mapping[str, Any], cookies: Mapping[str, str], deadline: float
    ) -> dict[str, str]:
        """The replay strategy: the recorded tool calls made again in order, each output
        checked against the record."""
        gained: dict[str, str] = {}
        for index, call in enumerate(state["session"]["calls"]):
            where = f"{rollout_id}: replaying call {index}"
            again = await self._rebuild_call(
                where, call["path"], call["body"], {**cookies, **gained}, deadline
            )
            gained.update(again.cookies)
            if (again.status, again.text) != (call["status"], call["output"]):
                raise RebuildFailed(
                    f"{rollout_id}: replayed call {index} ({call['path']}) answered "
                    f"{again.status} {shown(again.text)!r}, the record says {call['status']} "
                    f"{shown(call['output'])!r}: the resources server does not reproduce the "
                    "session (not deterministic, or another server or version); declare the "
                    "snapshot or restart strategy for it (docs/gym.md)"
                )
        return gained

    # -- the steps (the table in this module's docstring) -----------------------------------

    async def seed(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        reply = await self.resources("/seed_session", state["task"], {}, self.deadline())
        if not reply.ok:  # simple_agent raises for status here
            raise refused("seed_session", reply)
        session: dict[str, Any] = {
            "cookies": dict(reply.cookies),
            "calls": [],
            "instance": reply.instance,
        }
        if self.settings.strategy is Strategy.SNAPSHOT:
            session["snapshot"] = await self.snapshot_of(session["cookies"])
        return Boundary("model", {**state, "session": session})

    async def model(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        params, given = _messages(state["task"])
        body = {**params, "input": given + state["outputs"]}
        headers = {
            "X-Rollout-Request": f"{episode.rollout_id}/{state['turn']}",
            "X-Rollout-Attempt": str(episode.attempt),
        }
        try:
            reply = await post(
                self.http,
                self.peers["model"] + "/v1/responses",
                body,
                deadline_ts=self.deadline(),
                headers=headers,
            )
        except PeerUnavailable as exc:
            raise unreachable("model", exc) from exc
        if not reply.ok:  # simple_agent: model calls are expected to work
            raise refused("model", reply)
        response = reply.json()
        output = list(response.get("output") or [])
        turn = state["turn"] + 1
        calls = [o for o in output if o.get("type") == "function_call"]
        return Boundary(
            self._after_model(response, output, calls, turn),
            {
                **state,
                "turn": turn,
                "outputs": state["outputs"] + output,
                "pending": calls,
                "response": {k: v for k, v in response.items() if k != "output"},
                "usage": _added_usage(state.get("usage"), response.get("usage")),
            },
        )

    def _after_model(
        self,
        response: Mapping[str, Any],
        output: Sequence[Mapping[str, Any]],
        calls: Sequence[Mapping[str, Any]],
        turn: int,
    ) -> str:
        """The step after a model call, as simple_agent decides it."""
        said = any(o.get("type") == "message" and o.get("role") == "assistant" for o in output)
        incomplete = response.get("incomplete_details") is not None
        if incomplete or (not calls and said):
            return "verify"  # as simple_agent: an answer without calls ends the loop
        if calls:
            return "tool"
        return "model" if turn < self.settings.max_steps else "verify"

    async def tool(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        call, pending = state["pending"][0], state["pending"][1:]
        session = dict(state["session"])
        try:
            arguments = json.loads(call["arguments"])
        except (json.JSONDecodeError, TypeError, RecursionError) as exc:
            # as simple_agent: fed back, no call; arguments nested past the parser's depth too
            output = json.dumps({"error": f"Invalid tool call arguments: {exc!r}"})
        else:
            path = f"/{call['name']}"
            reply = await self.resources(path, arguments, session["cookies"], self.deadline())
            self.same_server(episode, session, reply)
            output = reply.text
            cookies = {**session["cookies"], **reply.cookies}
            recorded = {"path": path, "body": arguments, "status": reply.status, "output": output}
            session = {**session, "cookies": cookies, "calls": [*session["calls"], recorded]}
            if self.settings.strategy is Strategy.SNAPSHOT:
                session["snapshot"] = await self.snapshot_of(cookies)
        item = {"type": "function_call_output", "call_id": call["call_id"], "output": output}
        more_turns = state["turn"] < self.settings.max_steps
        nxt = "tool" if pending else ("model" if more_turns else "verify")
        return Boundary(
            nxt,
            {
                **state,
                "outputs": [*state["outputs"], item],
                "pending": pending,
                "session": session,
                "tools": state["tools"] + 1,
            },
        )

    async def verify(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        # as simple_agent: the last model response, with every output and the usage summed
        response = {**state["response"], "output": state["outputs"], "usage": state.get("usage")}
        body = {**state["task"], "response": response}
        reply = await self.resources("/verify", body, state["session"]["cookies"], self.deadline())
        self.same_server(episode, state["session"], reply)
        if not reply.ok:
            raise refused("verify", reply)
        verification = reply.json()
        reward = float(verification.get("reward", 0.0))
        return Boundary("done", {**state, "reward": reward, "verification": verification})

    # -- one episode --------------------------------------------------------------------------

    def claim(self, episode: Episode) -> None:
        """A restored episode's first move under this attempt: its rebuilt session's cookies go
        into the boundary (so the next checkpoint records them); never the old cookie alone."""
        if episode.continued_from is None:
            return
        session = episode.boundary.state.get("session")
        if not isinstance(session, dict):
            return
        done = self.rebuilt.pop((episode.rollout_id, episode.attempt), None)
        if done is None:
            if self.settings.rebuild:
                raise ProtocolError(
                    ErrorCode.INTERNAL,
                    f"{episode.rollout_id}: restored without a rebuilt Gym session",
                )
            return  # the negative control: the old cookie, an empty session
        new_session = {**session, "cookies": done.cookies, "instance": done.instance}
        state = {**episode.boundary.state, "session": new_session}
        self.runtime.advance(episode, Boundary(episode.boundary.step, state))

    def served(self, episode: Episode) -> None:
        session = episode.boundary.state.get("session")
        if isinstance(session, dict):
            self.sessions[episode.rollout_id] = {
                "attempt": episode.attempt,
                "cookies": session["cookies"],
                "calls": len(session["calls"]),
            }
            self.sessions.move_to_end(episode.rollout_id)
            while len(self.sessions) > MAX_SESSIONS_KEPT:
                self.sessions.popitem(last=False)

    async def play(self, episode: Episode) -> Played:
        """One episode from its boundary to `done`, a step at a time."""
        self.claim(episode)
        runtime = self.runtime
        while episode.boundary.step != "done":
            step = episode.boundary.step
            state = episode.boundary.state
            if step == "seed":
                await runtime.step(episode, "seed", StepMode.WAIT, lambda: self.seed(episode))
            elif step == "model":
                name = f"model@{state['turn']}"
                await runtime.step(episode, name, StepMode.REPLAY, lambda: self.model(episode))
            elif step == "tool":
                name = f"tool@{state['tools']}"
                await runtime.step(episode, name, StepMode.WAIT, lambda: self.tool(episode))
            else:
                await runtime.step(episode, "verify", StepMode.WAIT, lambda: self.verify(episode))
        state = episode.boundary.state
        self.served(episode)
        result = RunResult(
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            reward=state["reward"],
            steps=state["turn"],
            tool_calls=state["tools"],
            answer=_answer(state["outputs"]),
            continued_from=episode.continued_from,
            session=state["session"]["cookies"],
        )
        return Played.of(result, state["verification"])


def _first_boundary(task: dict[str, Any]) -> Boundary:
    return Boundary("seed", {"task": task, "turn": 0, "tools": 0, "outputs": [], "pending": []})


WAITS_ON: Final[tuple[Role, ...]] = (Role.RESOURCES,)
"""The roles the episode's wait-mode steps call (docs/design.md#44-order): the seed, the tool
calls and the verify go to the resources server; the model calls are replayed."""


def build_app(control: ControlSettings, settings: GymSettings) -> FastAPI:
    """The adapter's environment: episode runtime, participant, control plane, `/run`."""
    counters = StepCounters(Role.ENVIRONMENT)
    runtime = EpisodeRuntime(observer=counters.observe)
    http = make_client(settings.step_timeout_s)
    episodes = GymEpisodes(settings, runtime, http)
    participant = GymParticipant(runtime, settings, episodes.rebuild_all, on_rewire=episodes.rewire)
    plane = ControlPlane(participant, control)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with http:
            yield

    app = FastAPI(lifespan=lifespan)
    app.state.draining = False
    runs = RunRoute[Played](plane, runtime, draining=lambda: app.state.draining)

    @app.post("/run", response_model=None)
    async def run(request: RunBody) -> RunResult | EpisodeResponse:
        """Every /run duty is the RunRoute's (docs/sdk.md, section 2), for both shapes."""
        if isinstance(request, EpisodeRequest):
            return await answer(
                runs,
                request,
                episodes.play,
                first=_first_boundary,
                result=Played.verification,
            )
        shaped = legacy(request.rollout_id, request.attempt, request.task)
        played = await runs.run(shaped, episodes.play, first=_first_boundary(shaped.row))
        return played.result

    @app.get("/stats")
    async def stats(rollout_id: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008
        return counters.snapshot(rollout_id, detail=False)

    @app.get("/gym/sessions")
    async def gym_sessions(rollout_id: list[str] = Query()) -> dict[str, Any]:  # noqa: B008
        """The Gym session (its cookies) each finished rollout's episode used here, to read the
        resources server's own state of it; unknown rollouts are left out."""
        known = episodes.sessions
        return {"sessions": {rid: known[rid] for rid in rollout_id if rid in known}}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        if app.state.draining:
            raise ProtocolError(ErrorCode.ADMISSION_CLOSED, "draining")
        return {"status": "ok"}

    plane.install(app)
    return app
