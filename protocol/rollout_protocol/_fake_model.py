"""The conformance kit's fake model participant (`rollout_protocol.conformance.FakeModel`).

A server under test calls the set's model; the kit needs a model that (1) answers at once and
deterministically, its reply derived from the prompt only, so an episode continued after a
restore ends as an uninterrupted run of its task exactly when it sent the same prompts; (2) is
a participant of the checkpoint group (a control plane, counters at `GET /stats`), so the kit's
`model.headers` rule reaches it; (3) logs every call (its `X-Rollout-Request` and
`X-Rollout-Attempt`, the prompt) for the kit's `model.same-prompts` rule; and (4) holds chosen
calls on request, which is how a test keeps an episode mid-way without debug hooks
(docs/sdk.md, section 7).

The log and the holds live in the `FakeModel` object, which outlives the apps it builds: a
driver crashes the served app and builds a fresh one (`app(settings)`) under the next attempt,
as it restarts a process, and the kit still reads every call of both attempts. The model keeps
no episode state of its own (a pure function of the prompt has nothing to continue), so its
checkpoints hold no records.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Query, Request

from ._control import ControlPlane
from ._counters import StepCounters
from ._episodes import EpisodeRuntime, RuntimeParticipant
from ._settings import ControlSettings
from ._wire import Role
from .model_api import ChatBody, CompletionBody, decode_body

REQUEST_HEADER = "X-Rollout-Request"
ATTEMPT_HEADER = "X-Rollout-Attempt"


def echo_reply(prompt: str) -> str:
    """The default reply: a digest of the prompt (the same prompt, the same reply)."""
    return f" fake-{hashlib.sha256(prompt.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class ModelCall:
    """One call the fake model answered (or held): who it named and what it was asked.

    `rollout_id`, `key` and `attempt` come from `X-Rollout-Request: <rollout_id>/<key>` and
    `X-Rollout-Attempt`; all three are None for a call without them (served, never counted).
    """

    rollout_id: str | None
    key: str | None
    attempt: int | None
    prompt: str
    reply: str | None = None
    """None while the call is held (or was cut by a crash before it was answered)."""

    @property
    def request(self) -> str | None:
        """The `X-Rollout-Request` value, `<rollout_id>/<key>`."""
        return None if self.rollout_id is None else f"{self.rollout_id}/{self.key}"


class UnnamedModelCall(LookupError):
    """What `FakeModel.wait_held` raises as soon as a call without the episode headers arrives:
    the server under test does not name its episodes, so no hold can catch its calls."""


@dataclass
class _Hold:
    attempt: int | None
    released: anyio.Event = field(default_factory=anyio.Event)
    caught: bool = False


class FakeModel:
    """A model participant for the conformance kit: deterministic replies, header counting,
    holds on request.

    Serve `app(settings)` (settings of role model, the group's set name, checkpoint root and
    token, the attempt the group runs) with `start_app`/`serve_app` and list its target among
    the driver's `participants()`; after a crash, serve a fresh `app(...)` under the next
    attempt. It answers `POST /v1/completions {"prompt", ...}` with
    `{"choices": [{"text": reply(prompt), ...}]}` and `POST /v1/chat/completions {"messages"}`
    with the reply as the assistant's message (the prompt is then the messages' `role: content`
    lines). `reply` must be a pure function of the prompt (default `echo_reply`). It reads its
    requests as the reference model server does (`rollout_protocol.model_api`): a bad one is
    refused with 422 `invalid_request` naming the field, never answered.

    A call naming its episode (`X-Rollout-Request: <rollout_id>/<key>`, `X-Rollout-Attempt`)
    is counted at `GET /stats` as step `call@<key>` of that rollout and attempt (the shape of
    `StepCounters.snapshot`): `started`, then `completed` once answered; the same call again
    under the same attempt (a caller's retry) counts `delivered`, as a real model participant
    delivers its kept response without generating again. A call without the headers is
    answered and counted nowhere, as a real model participant would record nothing of it.

    Holds: `hold("<rollout_id>/<key>", attempt=...)` before the episode gets there makes the
    next such call wait until `release` (or the app is crashed); `wait_held` returns once it
    waits. Hold calls of the first attempt only: the kit calls `end_holds(attempt)` when it
    crashes the group, and a hold armed after that for a later attempt is the driver's mistake
    (`driver_mistakes`, which the kit reports at once, naming the driver) and is not armed.
    """

    def __init__(self, reply: Callable[[str], str] = echo_reply) -> None:
        self.reply = reply
        self.log: list[ModelCall] = []
        """Every call, in arrival order, across every app this object served."""
        self.driver_mistakes: list[str] = []
        self._holds: dict[str, _Hold] = {}
        """request -> the hold armed for it (caught or not)."""
        self._caught: list[tuple[str, _Hold]] = []
        """Every hold that caught a call, released or not (a request may be held again)."""
        self._arrived: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)
        """request -> set once a hold caught a call naming it."""
        self._answered: set[tuple[str, str, int]] = set()
        """(rollout, key, attempt) of every named call answered."""
        self._unnamed = anyio.Event()
        """Set at the first call without the episode headers."""
        self._holds_end: int | None = None

    # --- the app ----------------------------------------------------------------------------

    def app(self, settings: ControlSettings) -> FastAPI:
        """A fresh model participant (its own control plane and counters) sharing this
        object's log and holds: one per process start."""
        if settings.role is not Role.MODEL:
            raise ValueError(f"a FakeModel is a participant of role model, not {settings.role}")
        counters = StepCounters(Role.MODEL)
        participant = RuntimeParticipant(Role.MODEL, EpisodeRuntime(), work_counter=None)
        plane = ControlPlane(participant, settings)
        app = FastAPI()
        model = self

        @app.post("/v1/completions")
        async def completions(request: Request) -> dict[str, Any]:
            body = decode_body(await request.body(), CompletionBody)
            text = await model._answer(request, body.prompt, counters)
            return {
                "object": "text_completion",
                "model": body.model or "fake",
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            }

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            body = decode_body(await request.body(), ChatBody)
            prompt = "\n".join(f"{m.role}: {m.text}" for m in body.messages)
            text = await model._answer(request, prompt, counters)
            return {
                "object": "chat.completion",
                "model": body.model or "fake",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
            }

        @app.get("/stats")
        async def stats(
            rollout_id: list[str] = Query(default_factory=list),  # noqa: B008
        ) -> dict[str, Any]:
            return counters.snapshot(rollout_id, False)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        plane.install(app)
        return app

    async def _answer(self, request: Request, prompt: str, counters: StepCounters) -> str:
        named = _named(request.headers)
        if named is None:
            self._unnamed.set()
            self.log.append(ModelCall(None, None, None, prompt, self.reply(prompt)))
            return self.log[-1].reply or ""
        rollout_id, key, attempt = named
        step = f"call@{key}"
        if named in self._answered:
            # a repeated call (its caller lost the reply): delivered again, as a real model
            # participant delivers a kept response, without generating again
            text = self.reply(prompt)
            self.log.append(ModelCall(rollout_id, key, attempt, prompt, text))
            counters.count(attempt, rollout_id, step, "delivered")
            return text
        index = len(self.log)
        self.log.append(ModelCall(rollout_id, key, attempt, prompt))
        counters.count(attempt, rollout_id, step, "started")
        hold = self._holds.get(f"{rollout_id}/{key}")
        if hold is not None and not hold.caught and hold.attempt in (None, attempt):
            hold.caught = True
            self._caught.append((f"{rollout_id}/{key}", hold))
            self._arrived[f"{rollout_id}/{key}"].set()
            await hold.released.wait()
        text = self.reply(prompt)
        self.log[index] = ModelCall(rollout_id, key, attempt, prompt, text)
        self._answered.add(named)
        counters.count(attempt, rollout_id, step, "completed")
        return text

    # --- holds --------------------------------------------------------------------------------

    def hold(self, request: str, *, attempt: int | None = None) -> None:
        """Hold the next call naming `request` (`<rollout_id>/<key>`, as X-Rollout-Request)
        under `attempt` (any attempt when None) until `release`. Arm it before the episode can
        make that call; a hold catches one call."""
        if self._holds_end is not None and (attempt is None or attempt >= self._holds_end):
            self._mistake(
                f"hold({request!r}, attempt={attempt}) armed after the crash of attempt "
                f"{self._holds_end - 1}: it would block the restored episode (or an "
                "uninterrupted twin) forever"
            )
            return
        if self._holds_end is not None:
            return  # a hold for the crashed attempt: nothing will make that call again
        self._holds[request] = _Hold(attempt)

    async def wait_held(self, request: str, deadline_ts: float) -> None:
        """Return once a hold caught the call naming `request` (the call waits); raise
        TimeoutError at `deadline_ts` (unix seconds) saying which call never came and why, or
        `UnnamedModelCall` (a LookupError) as soon as a call without the episode headers
        arrives (no hold can catch such a call: the server under test does not name its
        episodes)."""
        arrived = self._arrived[request]
        with anyio.move_on_after(max(0.0, deadline_ts - time.time())):
            async with anyio.create_task_group() as group:

                async def unnamed() -> None:
                    await self._unnamed.wait()
                    group.cancel_scope.cancel()

                group.start_soon(unnamed)
                await arrived.wait()
                group.cancel_scope.cancel()
        if not arrived.is_set() and self._unnamed.is_set():
            raise UnnamedModelCall(
                f"waiting for the model call {request}, the model got a call without "
                "X-Rollout-Request/X-Rollout-Attempt: no hold can catch it"
            )
        if not arrived.is_set():
            seen = sorted({c.request or "(unnamed)" for c in self.log})
            armed = "" if request in self._holds else f"; no hold armed (hold({request!r}))"
            raise TimeoutError(
                f"the model call {request} never arrived{armed} (calls seen: {seen[-20:]}); did "
                "the episode name it with X-Rollout-Request: <rollout_id>/<key>?"
            )

    def release(self, request: str | None = None) -> None:
        """Let the held call naming `request` (every held call, when None) go on."""
        for name, hold in [*self._holds.items(), *self._caught]:
            if request is None or name == request:
                hold.released.set()

    def end_holds(self, crashed_attempt: int) -> None:
        """The kit calls this when it crashes the group running `crashed_attempt`: every held
        call is released, holds not caught yet are dropped, and a hold armed from now on for a
        later attempt is the driver's mistake."""
        self.release()
        self._holds.clear()
        self._holds_end = crashed_attempt + 1

    def _mistake(self, what: str) -> None:
        self.driver_mistakes.append(what)

    # --- what the kit reads --------------------------------------------------------------------

    def calls(self, rollout_id: str | None, attempt: int | None = None) -> list[ModelCall]:
        """The calls naming `rollout_id` (None: the calls without the headers), under
        `attempt` if given."""
        return [
            call
            for call in self.log
            if call.rollout_id == rollout_id and (attempt is None or call.attempt == attempt)
        ]

    def prompts(self, rollout_id: str, attempt: int) -> dict[str, str]:
        """key -> prompt of the answered calls naming `rollout_id` under `attempt` (the first
        call of each key)."""
        found: dict[str, str] = {}
        for call in self.calls(rollout_id, attempt):
            if call.key is not None and call.reply is not None:
                found.setdefault(call.key, call.prompt)
        return found


def _named(headers: Mapping[str, str]) -> tuple[str, str, int] | None:
    """(rollout_id, key, attempt) from the episode headers, or None without (valid) ones."""
    request, attempt = headers.get(REQUEST_HEADER), headers.get(ATTEMPT_HEADER)
    if request is None or attempt is None or "/" not in request:
        return None
    rollout_id, key = request.rsplit("/", 1)
    try:
        number = int(attempt)
    except ValueError:
        return None
    return (rollout_id, key, number) if rollout_id and number >= 0 else None
