"""A checkout environment on the public `rollout_protocol` SDK: an episode with an effect outside
itself (a charge at a payment service), made safe across a crash by an idempotency key
(docs/sdk.md, "Side effects across a crash").

An episode is three steps, with a boundary after each:

* `quote@0` (replay): ask the shop for the item's price; a read, harmless to repeat;
* `charge@1` (wait): charge that price, with `Idempotency-Key: <rollout_id>/charge@1`;
* `confirm@2` (replay): read the charge back by its key.

`charge@1` runs exactly once per attempt (a checkpoint never cuts it in half, a repeated `/run`
attaches to the episode). Across a crash it runs at least once: when it completed after the last
checkpoint, the restored episode continues from that checkpoint's boundary under attempt + 1 and
runs it again. Its key is built from what a restore keeps, the rollout id and the step's name,
never from the attempt, so the second call carries the first call's key and the shop answers
with the first charge instead of charging twice.

`shop_app()` is the payment service's half of that contract, in memory: a charge is stored by
its key; a repeated key gets the stored charge back (409 if the body differs) and is counted, so
a test can tell a repeated call from a repeated effect (`GET /ledger`).

Run the environment: `python -m checkout_env --shop-url URL` (the `ROLLOUT_*` variables as the
operator sets them); the shop: `python -m checkout_env --shop`. Module on `PYTHONPATH`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from rollout_protocol import (
    Boundary,
    ControlPlane,
    ControlSettings,
    Episode,
    EpisodeRuntime,
    ErrorCode,
    ProtocolError,
    Role,
    RolloutId,
    RunRoute,
    RuntimeParticipant,
    StepCounters,
    StepMode,
)
from rollout_protocol.serving import DrainingServer

STEPS = ("quote", "charge", "confirm")
"""The episode's steps in order; a step's name is `<step>@<position>` (`charge@1`)."""
IDEMPOTENCY_HEADER = "Idempotency-Key"


def idempotency_key(rollout_id: str, step_name: str) -> str:
    """The key of a step's external effect: the same each time this step of this rollout runs,
    whatever the attempt (a restore runs the step again under attempt + 1, and that run must
    present the same key). Never put the attempt, a time or a random value in it."""
    return f"{rollout_id}/{step_name}"


class RunRequest(BaseModel):
    """`POST /run`: `{"rollout_id", "attempt", "task": {"item": ...}}`."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: RolloutId
    attempt: int = Field(ge=0)
    task: dict[str, Any]


class RunResult(BaseModel):
    """`POST /run`'s reply: the fields the trainer side reads, and the charge."""

    rollout_id: str
    attempt: int
    reward: float
    steps: int
    charge_id: str
    amount: int
    continued_from: int | None = None


def build_app(settings: ControlSettings, shop_url: str) -> FastAPI:
    """The environment: runtime, participant, control plane, `/run` and `/stats`."""
    counters = StepCounters(Role.ENVIRONMENT)
    runtime = EpisodeRuntime(observer=counters.observe)
    plane = ControlPlane(RuntimeParticipant(Role.ENVIRONMENT, runtime), settings)
    shop = httpx.AsyncClient(base_url=shop_url, timeout=60)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with shop:
            yield

    app = FastAPI(lifespan=lifespan, docs_url=None)
    app.state.draining = False
    runs = RunRoute[RunResult](plane, runtime, draining=lambda: app.state.draining)

    async def call(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        reply = await shop.request(method, path, **kwargs)
        if reply.status_code >= 400:
            raise ProtocolError(ErrorCode.INTERNAL, f"shop {path}: {reply.status_code}")
        body: dict[str, Any] = reply.json()
        return body

    async def quote(episode: Episode, task: dict[str, Any]) -> Boundary:
        reply = await call("POST", "/quote", json={"item": task["item"]})
        return Boundary("charge", {"price": int(reply["price"])})

    async def charge(episode: Episode, task: dict[str, Any]) -> Boundary:
        state = episode.boundary.state
        headers = {
            IDEMPOTENCY_HEADER: idempotency_key(episode.rollout_id, "charge@1"),
            "X-Rollout-Attempt": str(episode.attempt),  # for the shop's logs only, not the key
        }
        body = {"item": task["item"], "amount": state["price"]}
        reply = await call("POST", "/charges", json=body, headers=headers)
        return Boundary("confirm", {**state, "charge_id": str(reply["charge_id"])})

    async def confirm(episode: Episode, task: dict[str, Any]) -> Boundary:
        key = idempotency_key(episode.rollout_id, "charge@1")
        reply = await call("GET", "/charges", params={"key": key})
        return Boundary("done", {**episode.boundary.state, "status": reply["status"]})

    modes = {"quote": StepMode.REPLAY, "charge": StepMode.WAIT, "confirm": StepMode.REPLAY}
    runs_of = {"quote": quote, "charge": charge, "confirm": confirm}

    async def play(episode: Episode, task: dict[str, Any]) -> RunResult:
        while (step := episode.boundary.step) != "done":
            name = f"{step}@{STEPS.index(step)}"
            await runtime.step(episode, name, modes[step], partial(runs_of[step], episode, task))
        state = episode.boundary.state
        return RunResult(
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            reward=1.0 if state["status"] == "captured" else 0.0,
            steps=len(STEPS),
            charge_id=state["charge_id"],
            amount=state["price"],
            continued_from=episode.continued_from,
        )

    @app.post("/run")
    async def run(request: RunRequest) -> RunResult:
        return await runs.run(
            request, lambda episode: play(episode, request.task), first=Boundary("quote", {})
        )

    @app.get("/stats")
    async def stats(rollout_id: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008
        return {"attempt": plane.attempt, **counters.snapshot(rollout_id, detail=False)}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        if app.state.draining:
            raise ProtocolError(ErrorCode.ADMISSION_CLOSED, "draining")
        return {"status": "ok"}

    plane.install(app)
    return app


# --- the payment service's side ---------------------------------------------------------------


class QuoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: str = Field(min_length=1, max_length=128)


class ChargeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: str = Field(min_length=1, max_length=128)
    amount: int = Field(gt=0)


def price(item: str) -> int:
    """An item's price: a pure function of its name."""
    return 1 + hashlib.sha256(item.encode()).digest()[0] % 99


def shop_app() -> FastAPI:
    """A payment service that honours `Idempotency-Key`: one charge per key, however often the
    key is presented; `GET /ledger` shows the charges and how often each key was presented."""
    app = FastAPI(docs_url=None)
    charges: dict[str, dict[str, Any]] = {}
    presented: dict[str, int] = {}

    @app.post("/quote")
    async def quote(request: QuoteRequest) -> dict[str, int]:
        return {"price": price(request.item)}

    @app.post("/charges")
    async def charge(
        request: ChargeRequest, key: str = Header(alias=IDEMPOTENCY_HEADER, min_length=1)
    ) -> dict[str, Any]:
        presented[key] = presented.get(key, 0) + 1
        stored = charges.get(key)
        if stored is None:
            stored = charges[key] = {
                "charge_id": f"ch-{len(charges) + 1}",
                "item": request.item,
                "amount": request.amount,
                "status": "captured",
            }
        elif (stored["item"], stored["amount"]) != (request.item, request.amount):
            raise HTTPException(409, f"{key} was used for another charge")
        return stored

    @app.get("/charges")
    async def read(key: str) -> dict[str, Any]:
        stored = charges.get(key)
        if stored is None:
            raise HTTPException(404, f"no charge with key {key}")
        return stored

    @app.get("/ledger")
    async def ledger() -> dict[str, Any]:
        return {"charges": list(charges.values()), "presented": dict(presented)}

    return app


def main(argv: list[str] | None = None) -> None:
    """`python -m checkout_env`: serve the environment (or, with `--shop`, the shop)."""
    parser = argparse.ArgumentParser(prog="checkout_env", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("ROLLOUT_POD_IP", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--shop-url", default=os.environ.get("SHOP_URL"))
    parser.add_argument("--shop", action="store_true", help="serve the shop instead")
    parser.add_argument("--drain-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.shop:
        uvicorn.run(shop_app(), host=args.host, port=args.port, access_log=False)
        return
    if not args.shop_url:
        parser.error("no shop: set SHOP_URL or pass --shop-url")
    app = build_app(ControlSettings.from_env(Role.ENVIRONMENT), args.shop_url)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=False)

    def drain() -> None:  # SIGTERM: unready, no new episodes; the control plane keeps answering
        app.state.draining = True

    DrainingServer(config, on_drain=drain, drain_seconds=args.drain_seconds).run()


if __name__ == "__main__":
    main()
