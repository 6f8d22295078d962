"""A released NeMo Gym 0.7 environment server as the environment role of a RolloutSet,
checkpointed at its protocol's steps (docs/gym.md, "Environment servers").

nemo-gym 0.7 puts an environment server in front of every environment: `legacy_agent` relays
`/run` to a stock agent (`simple_agent`, `gymnasium_agent`), which plays the whole episode, its
tool loop included, inside that one call; `single_agent_turn` seeds a resources session and an
agent session, makes the agent call, closes the agent session, verifies and closes the
resources session, with cleanup callbacks that close both once per episode. Its `run()` is one
coroutine whose state is local, so a checkpoint of the server as it is keeps nothing.

`rollout-gym environment-server --config <Gym YAML> --name <instance>` hosts the released server
(its class, config and app, from the instance's YAML block; `rollout_gym.gym_config`) beside a
control plane, and plays each `/run` as SDK steps at the protocol's boundaries:

- `legacy_agent`: one step, `agent`, the released relay's `/run` (the agent's whole episode,
  its tool loop included), mode replay; at a checkpoint it is listed as a restart (the agent's
  loop cannot be continued: its work is lost, and counted as the `restart` strategy counts it).
- `single_agent_turn` (`rollout_gym.turn_steps`): `seed_resources`, `seed_agent` (wait; parked
  after each, a restore re-seeds under the same ids), `agent` (the agent's
  `/ng-rollout/<capture key>/v1/responses`, mode replay; listed as a restart, as is an episode
  between the agent call and its verify, whose session state lives in the resources server
  only), `close_agent`, `verify`, `close_resources` (wait; parked before the last, which a
  restore runs once).

Session ids are derived from the episode's capture key (`<capture key>.resources`,
`<capture key>.agent`), never random, so a process that restores an episode, or plays a
restarted one under the next attempt, reopens or closes the sessions an earlier process opened
without having their handles: a restarted episode first closes its earlier attempts' sessions
(Gym's close succeeds on a closed or unknown id), so every session is closed once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import Any, Final

import httpx
from fastapi import FastAPI, Query
from pydantic import BaseModel
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
    Role,
    RunRoute,
    RuntimeParticipant,
    StepCounters,
    StepMode,
)

from ._peers import GymReply, make_client, refused
from .environment import RunRequest
from .gym_config import ServerSpec
from .turn_steps import TurnSteps, capture_key

PROTOCOLS: Final = ("legacy_agent", "single_agent_turn")
"""The released environment servers (implementations) this module checkpoints."""
WAITS_ON: Final[Mapping[str, tuple[Role, ...]]] = MappingProxyType(
    {
        # one step, the relayed agent call, replayed (listed as a restart): no wait-mode step
        "legacy_agent": (),
        # the seeds, the closes and the verify are wait-mode calls to both
        "single_agent_turn": (Role.AGENT, Role.RESOURCES),
    }
)
"""Per environment server, the roles its wait-mode steps call (docs/design.md#44-order): a
prepare parks the environment before them, and together with the roles nobody waits on."""
CAPTURE_FIELD: Final = "_ng_rollout_id"
"""The legacy `/run` body's field that names the capture key (nemo-gym 0.7's
`BaseRunRequest.capture_rollout_id`)."""


class EpisodeResult(BaseModel):
    """`POST /run`'s reply: the reward of the released server's verify, and its reply."""

    rollout_id: str
    attempt: int
    reward: float
    steps: int
    """The tool calls in the agent's response (its `function_call` output items): the steps the
    episode took, as `rollout-collect` reports them (a reply without it is unreadable to it)."""
    answer: str | None = None
    """The text of the agent's last message (its `output_text` parts), null without one."""
    continued_from: int | None = None
    result: dict[str, Any]
    """What the released protocol answered: the agent's `/run` reply (`legacy_agent`), or the
    resources server's verify reply (`single_agent_turn`)."""


class EpisodeServerParticipant(RuntimeParticipant):
    """The runtime's participant, with the protocol's uncontinuable steps listed as restarts
    at prepare (the checkpoint's work-loss count) instead of captured."""

    def __init__(self, runtime: EpisodeRuntime, restart_at: frozenset[str], **kwargs: Any):
        super().__init__(Role.ENVIRONMENT, runtime, **kwargs)
        self._restart_at = restart_at

    async def park(self, deadline_ts: float) -> ParkState:
        state = await super().park(deadline_ts)
        keep: list[EpisodeId] = []
        lost = list(state.restarts)
        for episode_id in state.parked:
            live = self.runtime.find(episode_id.rollout_id)
            step = live.boundary.step if live is not None else None
            (lost if step in self._restart_at else keep).append(episode_id)
        if len(keep) == len(state.parked):
            return state
        return ParkState(parked=keep, blockers=state.blockers, restarts=lost)


class LegacySteps:
    """`legacy_agent`: one step, the released relay's `/run` (the agent's whole episode)."""

    first = "agent"
    restart_at: frozenset[str] = frozenset({"agent"})

    def __init__(self, spec: ServerSpec, gym: httpx.AsyncClient, runtime: EpisodeRuntime) -> None:
        self.spec, self.gym, self.runtime = spec, gym, runtime

    async def relay(self, episode: Episode) -> Boundary:
        """The released relay's `/run` with the row and the capture key; the agent plays the
        episode and verifies it."""
        task = episode.boundary.state["task"]
        body = {**task, CAPTURE_FIELD: capture_key(episode.rollout_id, episode.attempt)}
        reply = await self.gym.post("/run", json=body, timeout=None)
        if not reply.is_success:
            # the relay answers with the agent's status and body (an agent's 500 included,
            # which stays a status that may change: docs/gym.md, "Errors and failures")
            agent = self.spec.config["agent_server"]["name"]
            what = f"step agent: agent {agent} (relayed by {self.spec.name}): /run"
            raise refused(what, GymReply(reply.status_code, reply.text, {}))
        return Boundary("done", {**episode.boundary.state, "result": reply.json()})

    async def play(self, episode: Episode) -> dict[str, Any]:
        while episode.boundary.step != "done":
            await self.runtime.step(episode, "agent", StepMode.REPLAY, lambda: self.relay(episode))
        result: dict[str, Any] = episode.boundary.state["result"]
        return result


def _first_boundary(task: Mapping[str, Any], first: str) -> Boundary:
    return Boundary(first, {"task": dict(task)})


def _output(result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The output items of the response in a protocol's answer (none without one)."""
    response = result.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    return [i for i in output if isinstance(i, Mapping)] if isinstance(output, list) else []


def tool_calls(result: Mapping[str, Any]) -> int:
    """The `function_call` items of the response in a protocol's answer."""
    return sum(1 for item in _output(result) if item.get("type") == "function_call")


def answer(result: Mapping[str, Any]) -> str | None:
    """The text of the last `message` item of the response in a protocol's answer."""
    messages = [i for i in _output(result) if i.get("type") == "message"]
    if not messages:
        return None
    content = messages[-1].get("content")
    parts = content if isinstance(content, list) else []
    return "".join(
        str(part.get("text", ""))
        for part in parts
        if isinstance(part, Mapping) and part.get("type") == "output_text"
    )


def _result(episode: Episode, result: Mapping[str, Any]) -> EpisodeResult:
    return EpisodeResult(
        rollout_id=episode.rollout_id,
        attempt=episode.attempt,
        reward=float(result.get("reward", 0.0)),
        steps=tool_calls(result),
        answer=answer(result),
        continued_from=episode.continued_from,
        result=dict(result),
    )


def build_app(
    control: ControlSettings,
    spec: ServerSpec,
    gym_app: Any,
    peers: Mapping[str, str],
    step_timeout_s: float = 300.0,
) -> FastAPI:
    """The environment pod: control plane, `/run` as the protocol's steps, `/stats`,
    `/healthz`, and every other path of the released server's app (`/aggregate_metrics`)."""
    if spec.implementation not in PROTOCOLS:
        raise ValueError(
            f"{spec.name}: environment server {spec.implementation!r} is not one this adapter "
            f"checkpoints ({', '.join(PROTOCOLS)}; docs/gym.md)"
        )
    counters = StepCounters(Role.ENVIRONMENT)
    runtime = EpisodeRuntime(observer=counters.observe)
    http = make_client(step_timeout_s)
    # the released server's own app, called in process (its /run is shadowed by ours)
    gym = httpx.AsyncClient(transport=httpx.ASGITransport(app=gym_app), base_url="http://gym")
    steps: LegacySteps | TurnSteps
    if spec.implementation == "legacy_agent":
        steps = LegacySteps(spec, gym, runtime)
    else:
        steps = TurnSteps(spec, peers, http, runtime, step_timeout_s)
    participant = EpisodeServerParticipant(runtime, steps.restart_at)
    plane = ControlPlane(participant, control)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with http, gym:
            yield

    async def play(episode: Episode) -> EpisodeResult:
        return _result(episode, await steps.play(episode))

    app = FastAPI(lifespan=lifespan)
    app.state.draining = False
    runs = RunRoute[EpisodeResult](plane, runtime, draining=lambda: app.state.draining)

    @app.post("/run")
    async def run(request: RunRequest) -> EpisodeResult:
        """Every /run duty is the RunRoute's (docs/sdk.md, section 2)."""
        first = _first_boundary(request.task, steps.first)
        return await runs.run(request, play, first=first)

    @app.get("/stats")
    async def stats(rollout_id: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008
        return counters.snapshot(rollout_id, detail=False)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        if app.state.draining:
            raise ProtocolError(ErrorCode.ADMISSION_CLOSED, "draining")
        return {"status": "ok"}

    plane.install(app)
    app.mount("/", gym_app)
    return app


__all__: Sequence[str] = ["PROTOCOLS", "EpisodeResult", "build_app"]
