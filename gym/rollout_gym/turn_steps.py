"""nemo-gym 0.7's `single_agent_turn` environment server's protocol as SDK steps (docs/gym.md,
"Environment servers"), with sessions named by the episode's capture key.

The released server (`environment_servers/single_agent_turn/app.py`) plays an episode in one
coroutine: seed a resources session and an agent session under random ids, call the agent's
`/ng-rollout/<capture key>/v1/responses`, close the agent session (its reply may carry the
resources cookies the agent ended with), verify on the resources server, close the resources
session; cleanup callbacks close both sessions once if anything fails. Here each of those calls
is a step with its results in the boundary, and the ids are derived from the capture key
(`session_ids`), so another process can reopen or close them:

- an episode restored before its agent call (at `seed_agent`) re-seeds its resources session
  under its recorded id and episode (Gym's seed is idempotent: the same session, or, on a
  restarted resources server, the same seeded state);
- an episode inside its agent call, or between the call and its verify, cannot be continued
  (the agent's tool loop, and the session's state, live in other processes): the checkpoint
  lists it as a restart, and under the next attempt it first closes the sessions its earlier
  attempts opened (`close_earlier`; Gym's close succeeds on a closed or unknown id), then plays
  from its start under new ids;
- an episode restored after its verify (at `close_resources`) closes its session once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import httpx
from rollout_protocol import Boundary, Episode, EpisodeRuntime, ErrorCode, ProtocolError, StepMode

from ._peers import GymReply, PeerUnavailable, post, refused, unreachable
from .gym_config import ServerSpec

STEPS: Final = (
    "close_earlier",
    "seed_resources",
    "seed_agent",
    "agent",
    "close_agent",
    "verify",
    "close_resources",
)
"""The protocol's steps, in order; `agent` is the one call that cannot be continued."""


def capture_key(rollout_id: str, attempt: int) -> str:
    """nemo-gym 0.7's `EpisodeId.capture_key`: the rollout id at attempt 0, `<id>-a<N>` after."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def session_ids(rollout_id: str, attempt: int) -> dict[str, str]:
    """The resources and agent session ids of one attempt, derived from its capture key."""
    key = capture_key(rollout_id, attempt)
    return {"resources": f"{key}.resources", "agent": f"{key}.agent"}


def task_parts(task: Mapping[str, Any], taskset: str, rollout_id: str) -> dict[str, Any]:
    """A row as the protocol's task: its id (a materialized row's `task_id`, else the
    rollout's within `taskset`), the responses request and the rest as `task_data` (nemo-gym
    0.7's `SingleAgentTurnTaskInput` takes a flat row the same way)."""
    task_id: Any = {"taskset": taskset, "task_id": rollout_id}
    given: Mapping[str, Any] = task
    if isinstance(task.get("task_id"), Mapping) and "task_input" in task:
        task_id, given = dict(task["task_id"]), dict(task["task_input"] or {})
    fields = dict(given)
    params = fields.pop("responses_create_params", None) or {}
    data = fields.pop("task_data", None) or {}
    return {"task_id": task_id, "params": params, "task_data": {**data, **fields}}


class TurnSteps:
    """The `single_agent_turn` protocol's steps (the module's docstring)."""

    first = "close_earlier"
    restart_at: frozenset[str] = frozenset({"agent", "close_agent", "verify"})
    """Boundaries from which an episode cannot be continued: the agent call, and after it until
    its verify is done (the resources session's state lives in its server only)."""

    def __init__(
        self,
        spec: ServerSpec,
        peers: Mapping[str, str],
        http: httpx.AsyncClient,
        runtime: EpisodeRuntime,
        step_timeout_s: float,
    ) -> None:
        transports = list(spec.config.get("resources_tool_transports") or [])
        if set(transports) - {"direct_http"}:
            raise ValueError(
                f"{spec.name}: resources_tool_transports {transports}: only direct_http is "
                "checkpointed (docs/gym.md)"
            )
        self.spec, self.http, self.runtime = spec, http, runtime
        self.step_timeout_s = step_timeout_s
        self.direct_http = "direct_http" in transports
        self.urls = {"resources": peers["resources"], "agent": peers["agent"]}
        self.names = {
            "resources": str(spec.config["resources_server"]["name"]),
            "agent": str(spec.config["agent_server"]["name"]),
        }

    async def _call(
        self,
        step: str,
        peer: str,
        path: str,
        body: Any,
        cookies: Mapping[str, str] | None = None,
    ) -> GymReply:
        """One protocol call of `step`; a peer unreachable until the step's deadline, or an
        error status, fails the step as the `simple_agent` loop's calls do (docs/gym.md,
        "Errors and failures"): a lost peer waits for the set's recovery, a refusal no restore
        changes ends the episode at once."""
        what = f"step {step}: {peer} {self.names[peer]}"
        try:
            reply = await post(
                self.http,
                self.urls[peer] + path,
                body,
                deadline_ts=time.time() + self.step_timeout_s,
                cookies=cookies,
            )
        except PeerUnavailable as exc:
            raise unreachable(what, exc) from exc
        if not reply.ok:
            raise refused(f"{what}: {path}", reply)
        return reply

    @staticmethod
    def _episode_id(state: Mapping[str, Any]) -> dict[str, Any]:
        return dict(state["episode_id"])

    # -- the steps ---------------------------------------------------------------------------

    async def close_earlier(self, episode: Episode) -> Boundary:
        """A restarted episode: close the sessions its earlier attempts opened (named by their
        capture keys), so each is closed once although the process that opened it is gone."""
        for attempt in range(episode.attempt):
            ids = session_ids(episode.rollout_id, attempt)
            gym_id = {"rollout_id": episode.rollout_id, "attempt": attempt}
            await self._call(
                "close_earlier",
                "agent",
                "/v1/agent_sessions/close",
                {"agent_session_id": ids["agent"], "episode_id": gym_id},
            )
            await self._call(
                "close_earlier",
                "resources",
                "/close_session",
                {"resources_session_id": ids["resources"], "episode_id": gym_id},
            )
        return Boundary("seed_resources", episode.boundary.state)

    def _seed_body(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "resources_session_id": state["ids"]["resources"],
            "episode_id": self._episode_id(state),
            "task_id": state["task"]["task_id"],
            "task_data": state["task"]["task_data"],
        }

    async def seed_resources(self, episode: Episode) -> Boundary:
        task = task_parts(episode.boundary.state["task"], self.spec.name, episode.rollout_id)
        state = {
            **episode.boundary.state,
            "task": {**task, "row": episode.boundary.state["task"]},
            "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
            "ids": session_ids(episode.rollout_id, episode.attempt),
        }
        reply = await self._call(
            "seed_resources", "resources", "/seed_session", self._seed_body(state)
        )
        # a seed outside 0.7's session contract fails every episode alike: final, as in Gym
        # (docs/gym.md, "Errors and failures")
        what = f"step seed_resources: resources {self.names['resources']}"
        if not reply.cookies:
            raise ProtocolError(ErrorCode.UNSUPPORTED, f"{what}: seed set no session cookie")
        seeded = reply.json()
        if seeded.get("resources_session_id") != state["ids"]["resources"]:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED, f"{what}: seed answered another resources_session_id"
            )
        return Boundary("seed_agent", {**state, "resources_cookies": reply.cookies})

    async def reseed_resources(self, episode: Episode) -> None:
        """A restored episode before its agent call: its resources session reopened under its
        recorded id and episode (the same session, or the same seeded state on a restarted
        server), and the cookies it answers recorded."""
        state = episode.boundary.state
        body = self._seed_body(state)
        reply = await self._call("seed_resources", "resources", "/seed_session", body)
        cookies = {**state["resources_cookies"], **reply.cookies}
        self.runtime.advance(
            episode, Boundary(episode.boundary.step, {**state, "resources_cookies": cookies})
        )

    async def seed_agent(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        accesses = []
        if self.direct_http:
            accesses.append(
                {
                    "kind": "direct_http",
                    "name": f"{self.names['resources']}.direct_http",
                    "required": True,
                    "base_url": self.urls["resources"],
                    "cookies": state["resources_cookies"],
                }
            )
        body = {
            "agent_session_id": state["ids"]["agent"],
            "episode_id": self._episode_id(state),
            "task_id": state["task"]["task_id"],
            "tool_accesses": accesses,
        }
        reply = await self._call("seed_agent", "agent", "/v1/agent_sessions", body)
        return Boundary("agent", {**state, "agent_cookies": reply.cookies})

    async def agent(self, episode: Episode) -> Boundary:
        """The agent's turn, its model calls named by the capture key (the model role holds
        and cuts them at a checkpoint)."""
        state = episode.boundary.state
        path = f"/ng-rollout/{capture_key(episode.rollout_id, episode.attempt)}/v1/responses"
        sent = state["agent_cookies"]
        reply = await self._call("agent", "agent", path, state["task"]["params"], sent)
        cookies = {**sent, **reply.cookies}
        answered = {**state, "agent_cookies": cookies, "response": reply.json()}
        return Boundary("close_agent", answered)

    async def close_agent(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        body = {"agent_session_id": state["ids"]["agent"], "episode_id": self._episode_id(state)}
        cookies = state["agent_cookies"]
        reply = await self._call("close_agent", "agent", "/v1/agent_sessions/close", body, cookies)
        closed = reply.json()
        cookies = closed.get("resources_cookies") or state["resources_cookies"]
        observations = closed.get("agent_observations")
        return Boundary(
            "verify", {**state, "resources_cookies": cookies, "observations": observations}
        )

    async def verify(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        body = {
            **state["task"]["task_data"],
            "responses_create_params": state["task"]["params"],
            "response": state["response"],
        }
        cookies = state["resources_cookies"]
        reply = await self._call("verify", "resources", "/verify", body, cookies)
        result = {**reply.json(), "ng_agent_observations": state.get("observations")}
        return Boundary("close_resources", {**state, "result": result})

    async def close_resources(self, episode: Episode) -> Boundary:
        state = episode.boundary.state
        body = {
            "resources_session_id": state["ids"]["resources"],
            "episode_id": self._episode_id(state),
        }
        cookies = state["resources_cookies"]
        await self._call("close_resources", "resources", "/close_session", body, cookies)
        return Boundary("done", state)

    # -- one episode -------------------------------------------------------------------------

    def _runner(self, step: str, episode: Episode) -> Callable[[], Awaitable[Boundary]]:
        method: Callable[[Episode], Awaitable[Boundary]] = getattr(self, step)
        return lambda: method(episode)

    async def play(self, episode: Episode) -> dict[str, Any]:
        if episode.continued_from is not None and episode.boundary.step == "seed_agent":
            await self.reseed_resources(episode)
        if episode.boundary.step == "close_earlier" and episode.attempt == 0:
            self.runtime.advance(episode, Boundary("seed_resources", episode.boundary.state))
        while (step := episode.boundary.step) != "done":
            if step not in STEPS:
                raise ProtocolError(ErrorCode.INTERNAL, f"unknown step {step!r}")
            mode = StepMode.REPLAY if step == "agent" else StepMode.WAIT
            await self.runtime.step(episode, step, mode, self._runner(step, episode))
        result: dict[str, Any] = episode.boundary.state["result"]
        return result
