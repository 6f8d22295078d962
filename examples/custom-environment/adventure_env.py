"""A text-adventure environment built only on the public `rollout_protocol` SDK.

Each episode is a small house (six rooms, a key somewhere, a locked chest in the vault) derived
from the task's digest. A turn is two steps with a boundary after each:

* `policy@<turn>` (replay): ask the set's model (`/v1/completions`) what to do; the generated text
  is mapped deterministically to one of the listed actions. A restore simply asks again (the
  model server keeps its own prefix or delivered response for `<rollout_id>/<turn>`).
* `world@<turn>` (wait): apply the action to the world; a checkpoint waits for it.

The world state is the boundary's JSON, so a restored episode continues at the turn it reached.
`POST /run {rollout_id, attempt, task}` plays the episode to its end and returns its reward, as
the reference environment does (`rollout-collect` drives it unchanged). `GET /stats` serves the
per-step counters. Run: `python -m adventure_env --host H --port P` (module on `PYTHONPATH`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from rollout_protocol import (
    Boundary,
    ControlPlane,
    ControlSettings,
    Episode,
    EpisodeRuntime,
    ErrorBody,
    ErrorCode,
    ProtocolError,
    Role,
    RolloutId,
    RunRoute,
    RuntimeParticipant,
    StepCounters,
    StepMode,
    task_digest,
)
from rollout_protocol.serving import DrainingServer

EXITS: dict[str, tuple[str, ...]] = {
    "hall": ("library", "kitchen"),
    "library": ("hall", "study"),
    "kitchen": ("hall", "garden"),
    "study": ("library", "vault"),
    "garden": ("kitchen", "vault"),
    "vault": ("study", "garden"),
}
MAX_TURNS = 16
MAX_TOKENS = 24  # per model call: a move is short


class RunRequest(BaseModel):
    """`POST /run`: the reference environment's request (the trainer client sends it)."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    task: dict[str, Any]


class RunResult(BaseModel):
    """`POST /run`'s reply: the fields `RolloutClient` reads."""

    rollout_id: str
    attempt: int
    answer: int | None = Field(description="The turn the chest was opened on, if it was.")
    reward: float
    steps: int = Field(description="Turns played (one model call each).")
    continued_from: int | None = None


def new_world(digest: str) -> dict[str, Any]:
    """The house of a task: the key lies in a room other than the hall and the vault."""
    rng = random.Random(digest)
    key_room = rng.choice(["library", "kitchen", "study", "garden"])
    items = {room: (["key"] if room == key_room else []) for room in EXITS}
    items["hall"].append(rng.choice(["lamp", "map", "coin"]))
    return {"turn": 0, "room": "hall", "items": items, "inventory": [], "log": []}


def actions(state: dict[str, Any]) -> list[str]:
    """What can be done in the current room, in a fixed order."""
    room = state["room"]
    found = [f"go {r}" for r in EXITS[room]] + [f"take {i}" for i in state["items"][room]]
    if room == "vault" and "key" in state["inventory"]:
        found.append("open chest")
    return found


def prompt(state: dict[str, Any], options: list[str]) -> str:
    """The policy's view of the world: the room, the inventory, recent moves, the choices."""
    carried, recent = ", ".join(state["inventory"]), "; ".join(state["log"][-3:])
    return (
        f"You are in the {state['room']}. You carry: {carried or 'nothing'}. So far: "
        f"{recent or 'nothing'}. Open the chest in the vault.\nActions: {', '.join(options)}\n>"
    )


def choose(text: str, options: list[str]) -> str:
    """The first action named in the text; else one picked by the text's hash (deterministic)."""
    lowered = text.lower()
    named = [a for a in options if a in lowered]
    if named:
        return min(named, key=lowered.index)
    return options[int(hashlib.sha256(text.encode()).hexdigest(), 16) % len(options)]


def apply(state: dict[str, Any], action: str) -> dict[str, Any]:
    """The world after `action`: a new JSON state (the boundary's), never a mutated one."""
    new: dict[str, Any] = json.loads(json.dumps(state))
    verb, _, thing = action.partition(" ")
    if verb == "go":
        new["room"] = thing
    elif verb == "take":
        new["items"][new["room"]].remove(thing)
        new["inventory"].append(thing)
    elif action == "open chest":
        new["won"] = True
    new["log"].append(action)
    new["turn"] += 1
    return new


class AdventureEnvironment:
    """The environment: an episode runtime, its participant, the control plane, the routes."""

    def __init__(self, model_url: str, model_name: str, environ: dict[str, str]) -> None:
        self.model_url, self.model_name = model_url.rstrip("/"), model_name
        self.counters = StepCounters(Role.ENVIRONMENT)
        self.runtime = EpisodeRuntime(observer=self.counters.observe)
        participant = RuntimeParticipant(Role.ENVIRONMENT, self.runtime)
        settings = ControlSettings.from_env(Role.ENVIRONMENT, environ=environ)
        self.plane = ControlPlane(participant, settings)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10))
        self.draining = False
        self.runs = RunRoute[RunResult](self.plane, self.runtime, draining=lambda: self.draining)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Close the model client when the app stops."""
        async with self.http:
            yield

    async def run(self, request: RunRequest) -> RunResult:
        """Play (or continue, from a restored boundary) the episode to its end; every `/run`
        duty (refusals, repeats, finished results, errors) is the `RunRoute`'s."""
        seed = request.task.get("seed")
        first = Boundary("policy", new_world(task_digest(request.task)))
        play = partial(self._play, seed=seed if isinstance(seed, int) else 0)
        return await self.runs.run(request, play, first=first)

    async def _play(self, ep: Episode, seed: int) -> RunResult:
        """Run the steps from the episode's boundary to `done`; the result of the last one."""
        while ep.boundary.step != "done":
            name = f"{ep.boundary.step}@{ep.boundary.state['turn']}"
            if ep.boundary.step == "policy":
                await self.runtime.step(ep, name, StepMode.REPLAY, partial(self._policy, ep, seed))
            else:
                await self.runtime.step(ep, name, StepMode.WAIT, partial(self._world, ep))
        state, won = ep.boundary.state, bool(ep.boundary.state.get("won"))
        return RunResult(
            rollout_id=ep.rollout_id,
            attempt=ep.attempt,
            answer=state["turn"] if won else None,
            reward=1.0 - 0.03 * state["turn"] if won else 0.2 * ("key" in state["inventory"]),
            steps=state["turn"],
            continued_from=ep.continued_from,
        )

    async def _policy(self, ep: Episode, seed: int) -> Boundary:
        """Ask the model; the boundary after it names the chosen action (replayable)."""
        state = dict(ep.boundary.state)
        options = actions(state)
        body = {"model": self.model_name, "prompt": prompt(state, options), "seed": seed}
        body["max_tokens"] = MAX_TOKENS
        headers = {  # the model server records its progress under this key
            "X-Rollout-Request": f"{ep.rollout_id}/{state['turn']}",
            "X-Rollout-Attempt": str(ep.attempt),
        }
        url = self.model_url + "/v1/completions"
        for retry in range(3):  # idempotent by its key: a dropped connection is retried
            try:
                reply = await self.http.post(url, json=body, headers=headers)
                break
            except httpx.TransportError as error:
                if retry == 2:
                    raise ProtocolError(ErrorCode.UNREACHABLE, f"{url}: {error!r}") from error
        if reply.status_code >= 400:
            try:
                refusal = ErrorBody.model_validate_json(reply.content).error
            except ValueError:
                raise ProtocolError(ErrorCode.INTERNAL, f"{url}: {reply.status_code}") from None
            raise ProtocolError(refusal.code, f"{url}: {refusal.detail}")
        text = str(reply.json()["choices"][0]["text"])
        return Boundary("world", state | {"action": choose(text, options)})

    async def _world(self, ep: Episode) -> Boundary:
        """Apply the chosen action (a wait step: a checkpoint never cuts it in half)."""
        state = dict(ep.boundary.state)
        new = apply({k: v for k, v in state.items() if k != "action"}, state["action"])
        return Boundary("done" if new.get("won") or new["turn"] >= MAX_TURNS else "policy", new)

    def app(self) -> FastAPI:
        """The FastAPI app: `/run`, `/healthz`, `/stats` and the control plane."""
        app = FastAPI(title="adventure environment", lifespan=self.lifespan, docs_url=None)
        app.post("/run")(self.run)

        @app.get("/healthz")
        async def healthz() -> JSONResponse:
            body = {"status": "draining" if self.draining else "ok", "attempt": self.plane.attempt}
            return JSONResponse(body, status_code=503 if self.draining else 200)

        unauthorized: dict[int | str, dict[str, Any]] = {
            401: {"model": ErrorBody, "description": "detail=true without the control token"}
        }

        @app.get("/stats", responses=unauthorized)
        async def stats(
            request: Request,
            rollout_id: list[str] | None = Query(default=None),  # noqa: B008
            detail: bool = False,
        ) -> dict[str, Any]:
            if detail:  # every rollout id seen: only for holders of the control token
                self.plane.authorize(request.headers.get("authorization"))
            return {"attempt": self.plane.attempt, **self.counters.snapshot(rollout_id, detail)}

        self.plane.install(app)
        return app


def main(argv: list[str] | None = None) -> None:
    """`python -m adventure_env`: serve until SIGINT, or SIGTERM and the drain period."""
    parser = argparse.ArgumentParser(prog="adventure_env", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("ROLLOUT_POD_IP", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-url", default=os.environ.get("ROLLOUT_PEER_MODEL_URL"))
    parser.add_argument("--model-name", default="builtin")
    parser.add_argument("--drain-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    if not args.model_url:
        parser.error("no model: set ROLLOUT_PEER_MODEL_URL or pass --model-url")
    env = AdventureEnvironment(args.model_url, args.model_name, dict(os.environ))
    config = uvicorn.Config(env.app(), host=args.host, port=args.port, access_log=False)

    def drain() -> None:  # SIGTERM: unready, no new episodes; the control plane keeps answering
        env.draining = True

    DrainingServer(config, on_drain=drain, drain_seconds=args.drain_seconds).run()


if __name__ == "__main__":
    main()
