"""The policy model server: an OpenAI-compatible front that is a checkpoint participant.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (plain JSON or `stream: true` SSE),
`GET /v1/models`. Two backends produce the tokens:

* `builtin`: deterministic and seeded by (prompt, seed). It solves the shipped arithmetic tasks
  the way a small tool-using policy would (`CALC: 12*7`, then `ANSWER: 84` once the calculator's
  `RESULT:` is in the prompt), with a seeded mistake rate so rewards vary, one whitespace-led
  word per token with a configurable per-token latency. Because the whole completion is a pure
  function of the request, a generation cut after k tokens and continued yields exactly the
  tokens of an uncut one. It also takes vLLM's `continue_final_message` in chat requests (going
  on with its own output in the final assistant message), so it can stand in for vLLM as the
  upstream of an `openai` relay (docs/servers.md, "Your inference server as a sidecar").
* `openai`: relays to an upstream OpenAI-compatible server (vLLM, SGLang) over streaming; a cut
  closes the upstream stream and the continuation asks upstream to go on from the prefix
  (completions: prompt + prefix; chat: the prefix as a final assistant message with vLLM's
  `continue_final_message`).

Checkpoint support. Requests that name their episode (`X-Rollout-Request: <rollout_id>/<key>`,
`X-Rollout-Attempt: N`; the agent sends them) are episodes of the runtime with one *replay* step
per token: a checkpoint never waits for a token, and a token that finishes while the checkpoint
is open is held. At prepare, a generation in flight is therefore *cut*: its recorded boundary is
the prefix so far. A generation that finished but was not delivered is *held*: it is recorded
whole and delivered only when admission reopens. After a restore, the re-issued request with the
same key continues from the recorded prefix, or gets the held response at once. The last
response delivered to each rollout is kept (and recorded) too: it may have been on the wire
while its caller parked, and the caller's replay must get it without generating it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import re
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rollout_protocol import (
    ROLLOUT_ID_PATTERN,
    Boundary,
    Episode,
    EpisodeCancelled,
    EpisodeCounts,
    EpisodeError,
    EpisodeId,
    ErrorCode,
    ProtocolError,
    Record,
    Role,
    RuntimeParticipant,
    StepMode,
    TaskMismatch,
    task_digest,
)

from ..tasks import stable_fraction, task_by_question
from .common import (
    PEER_SHARDS,
    Outcome,
    RolloutServer,
    ServerOptions,
    ShardedClients,
    episode_error,
    peer_error,
)

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)

REQUEST_HEADER = "X-Rollout-Request"
ATTEMPT_HEADER = "X-Rollout-Attempt"
DELIVERED_KIND = "delivered"
_DELIVERED_KEPT = 100_000
"""Rollouts whose last response is kept; far more than a set runs live at once."""
_KEY_MAX = 200


# --- wire models ------------------------------------------------------------------------------


class _OpenAIModel(BaseModel):
    # OpenAI clients send many optional fields; unknown ones are kept and relayed upstream.
    model_config = ConfigDict(extra="allow")


class CompletionBody(_OpenAIModel):
    model: str | None = None
    prompt: str
    max_tokens: int = Field(default=256, ge=1, le=65536)
    seed: int | None = None
    stream: bool = False


class ChatMessage(_OpenAIModel):
    role: str
    content: str


class ChatBody(_OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=65536)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=65536)
    seed: int | None = None
    stream: bool = False


class DeliveredData(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    digest: str
    text: str
    finish_reason: str
    tokens: int = Field(ge=0)


@dataclass(frozen=True)
class Continuation:
    """A chat request with `continue_final_message` (vLLM's name): the model goes on with the
    final assistant message instead of starting a new one."""

    prompt_text: str
    """The prompt without the final message."""
    prefix: str
    """The final message's content, which the output continues."""


@dataclass(frozen=True)
class GenRequest:
    """One generation request, normalised across the two OpenAI routes."""

    kind: Literal["completion", "chat"]
    body: dict[str, Any]
    prompt_text: str
    max_tokens: int
    seed: int
    stream: bool
    continuation: Continuation | None = None

    @property
    def digest(self) -> str:
        """Identifies the request's content: a re-issued request must match to continue."""
        return task_digest({k: v for k, v in self.body.items() if k != "stream"})


@dataclass(frozen=True)
class Identity:
    rollout_id: str
    key: str
    attempt: int


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True)
class Done:
    text: str
    finish_reason: str
    tokens: int


@dataclass(frozen=True)
class Failed:
    error: ProtocolError


Item = Piece | Done | Failed


@dataclass
class Delivered:
    key: str
    attempt: int
    data: DeliveredData
    restored: bool = False


# --- backends ---------------------------------------------------------------------------------


class Backend(Protocol):
    def stream(
        self, request: GenRequest, prefix: str, produced: int
    ) -> AsyncGenerator[Piece, None]:
        """The pieces after `prefix` (`produced` tokens); the last one has a finish reason."""
        ...

    async def aclose(self) -> None: ...


_RESULT = re.compile(r"RESULT:\s*(-?\d+)")
_OPENINGS = (
    "Let me read the problem carefully.",
    "I will work through this step by step.",
    "The numbers in the question are what matter here.",
    "I should not guess; the calculator is exact.",
    "Breaking the problem into parts helps.",
    "First I identify the quantities involved.",
)
_MIDDLES = (
    "The next quantity to compute is clear from the text.",
    "I need one calculation for this part.",
    "Using the calculator avoids arithmetic slips.",
    "This follows directly from the previous result.",
)
_CLOSINGS = (
    "All the parts are computed now.",
    "The calculator results give the final number.",
    "That completes the reasoning.",
    "Putting the pieces together gives the answer.",
)
_TOKEN = re.compile(r"\s*\S+")


def builtin_completion(
    prompt: str, seed: int, max_tokens: int, mistake_rate: float
) -> tuple[list[str], str]:
    """The deterministic completion for (prompt, seed): its tokens and finish reason.

    Tasks from the shipped set are solved by following their calculator steps: one `CALC:` per
    turn until every step's `RESULT:` is in the prompt, then `ANSWER:` with the last result,
    off by one with probability `mistake_rate` (decided per (seed, task), so a whole episode
    makes the same choice on every turn and in every attempt). Other prompts get fluent filler.
    """
    rng = random.Random(hashlib.sha256(f"{seed}\x00{prompt}".encode()).digest())
    task = task_by_question(prompt)
    words: list[str] = [rng.choice(_OPENINGS)]
    if task is None:
        words += [rng.choice(_MIDDLES) for _ in range(rng.randint(2, 5))]
        text = " ".join(words)
    else:
        results = [int(v) for v in _RESULT.findall(prompt)]
        if len(results) < len(task.steps):
            words.append(rng.choice(_MIDDLES))
            text = " ".join(words) + f" CALC: {task.steps[len(results)]}"
        else:
            value = results[-1] if results else task.answer
            if stable_fraction("mistake", seed, task.id) < mistake_rate:
                value += 1 if stable_fraction("sign", seed, task.id) < 0.5 else -1
            words.append(rng.choice(_CLOSINGS))
            text = " ".join(words) + f" ANSWER: {value}"
    tokens = _TOKEN.findall(text)
    if len(tokens) > max_tokens:
        return tokens[:max_tokens], "length"
    return tokens, "stop"


class BuiltinBackend:
    def __init__(self, token_latency_s: float, mistake_rate: float) -> None:
        self.token_latency_s = token_latency_s
        self.mistake_rate = mistake_rate

    async def stream(
        self, request: GenRequest, prefix: str, produced: int
    ) -> AsyncGenerator[Piece, None]:
        prompt, max_tokens = request.prompt_text, request.max_tokens
        cont = request.continuation
        if cont is not None:
            # Like an LLM server with continue_final_message: when the final message is this
            # engine's own output so far, go on with the same completion (so a relay in front,
            # which continues a cut generation this way, gets the tokens of an uncut one);
            # `max_tokens` counts only the new tokens.
            own = _TOKEN.findall(cont.prefix)
            whole, _ = builtin_completion(
                cont.prompt_text, request.seed, len(own) + max_tokens, self.mistake_rate
            )
            if "".join(own) == cont.prefix and whole[: len(own)] == own:
                prompt, max_tokens, produced = (
                    cont.prompt_text,
                    len(own) + max_tokens,
                    produced + len(own),
                )
        tokens, reason = builtin_completion(prompt, request.seed, max_tokens, self.mistake_rate)
        if produced >= len(tokens):
            yield Piece("", reason)
            return
        for i in range(produced, len(tokens)):
            await anyio.sleep(self.token_latency_s)
            yield Piece(tokens[i], reason if i == len(tokens) - 1 else None)

    async def aclose(self) -> None:
        return None


class OpenAIBackend:
    """Relay to an upstream OpenAI-compatible server, always streamed (cuts need chunks)."""

    def __init__(self, upstream_url: str, timeout_s: float) -> None:
        self.base = upstream_url.rstrip("/")
        self._clients = ShardedClients(PEER_SHARDS, timeout_s)

    async def stream(
        self, request: GenRequest, prefix: str, produced: int
    ) -> AsyncGenerator[Piece, None]:
        body = dict(request.body)
        body["stream"] = True
        remaining = max(1, request.max_tokens - produced)
        if request.kind == "completion":
            path = "/v1/completions"
            body["prompt"] = request.body["prompt"] + prefix
            body["max_tokens"] = remaining
        else:
            path = "/v1/chat/completions"
            if prefix:
                body["messages"] = [
                    *request.body["messages"],
                    {"role": "assistant", "content": prefix},
                ]
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = remaining
        client = self._clients.for_key(request.digest)
        async with client.stream("POST", self.base + path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                raise peer_error(self.base + path, response)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                piece = _piece_from_chunk(json.loads(payload), request.kind)
                if piece is not None:
                    yield piece

    async def aclose(self) -> None:
        await self._clients.aclose()


def _piece_from_chunk(chunk: dict[str, Any], kind: str) -> Piece | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if kind == "completion":
        text = choice.get("text") or ""
    else:
        text = (choice.get("delta") or {}).get("content") or ""
    reason = choice.get("finish_reason")
    if not text and reason is None:
        return None
    return Piece(text, reason)


# --- the participant --------------------------------------------------------------------------


class ModelParticipant(RuntimeParticipant):
    """Generations (cut prefixes, held responses) plus the last delivered response per rollout."""

    def __init__(self, server: ModelServer) -> None:
        super().__init__(
            Role.MODEL, server.runtime, on_event=server.hooks.notify, on_rewire=server.rewire
        )
        self.server = server

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        records = self.runtime.export(scope)
        records.extend(
            Record(
                kind=DELIVERED_KIND,
                rollout_id=rid,
                attempt=d.attempt,
                key=d.key,
                data=d.data.model_dump(),
            )
            for rid, d in self.server.delivered.items()
            if scope is None or rid in scope
        )
        return records

    def release_outside(self, scope: frozenset[str]) -> None:
        self.runtime.release_outside(scope)
        for rid in [r for r, d in self.server.delivered.items() if d.restored and r not in scope]:
            del self.server.delivered[rid]

    def validate(self, records: Sequence[Record]) -> None:
        generations = [r for r in records if r.kind != DELIVERED_KIND]
        self.runtime.validate(generations)
        for i, record in enumerate(r for r in records if r.kind == DELIVERED_KIND):
            try:
                DeliveredData.model_validate(record.data)
            except ValidationError as error:
                raise ValueError(f"delivered record {i} ({record.rollout_id}): {error}") from error

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        installed = await super().install([r for r in records if r.kind != DELIVERED_KIND], attempt)
        for record in records:
            if record.kind == DELIVERED_KIND:
                self.server.delivered[record.rollout_id] = Delivered(
                    key=record.key,
                    attempt=attempt,
                    data=DeliveredData.model_validate(record.data),
                    restored=True,
                )
        return installed

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        retired = await super().retire(attempt, rollout_ids)
        for rid, delivered in list(self.server.delivered.items()):
            if delivered.attempt == attempt and (rollout_ids is None or rid in rollout_ids):
                del self.server.delivered[rid]
        return retired

    def counts(self) -> EpisodeCounts:
        counts = super().counts()
        restored = {r.rollout_id for r in self.runtime.restored()}
        restored |= {rid for rid, d in self.server.delivered.items() if d.restored}
        return replace(counts, restored=len(restored))

    def forget(self, rollout_ids: frozenset[str]) -> int:
        for rid in rollout_ids:
            self.server.delivered.pop(rid, None)
        return super().forget(rollout_ids)


# --- the server -------------------------------------------------------------------------------


class ModelServer(RolloutServer):
    role = Role.MODEL
    record_kind = "generation"

    def __init__(self, options: ServerOptions, **kwargs: Any) -> None:
        self._running: dict[tuple[str, str], Outcome[Done]] = {}
        self.delivered: OrderedDict[str, Delivered] = OrderedDict()
        """The last response delivered to each rollout (most recent last, bounded)."""
        self.tokens: dict[int, dict[str, int]] = {}
        super().__init__(options, **kwargs)
        if options.backend == "builtin":
            self.backend: Backend = BuiltinBackend(
                options.token_latency_ms / 1000.0, options.mistake_rate
            )
        elif options.backend == "openai":
            if not options.upstream_url:
                raise ValueError("--backend openai needs --upstream-url")
            self.backend = OpenAIBackend(options.upstream_url, options.call_timeout_s)
        else:
            raise ValueError(f"unknown backend {options.backend!r} (builtin, openai)")

    def make_participant(self) -> RuntimeParticipant:
        return ModelParticipant(self)

    async def on_shutdown(self) -> None:
        await self.backend.aclose()

    def extra_stats(self) -> dict[str, Any]:
        return {
            "tokens": {
                str(a): {"total": sum(by.values()), "by_request": dict(by)}
                for a, by in self.tokens.items()
            },
            "delivered_kept": len(self.delivered),
        }

    def add_routes(self, app: FastAPI) -> None:
        server = self

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {"id": server.options.model_name, "object": "model", "owned_by": "rollout"}
                ],
            }

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await _json_body(request, CompletionBody)
            gen = GenRequest(
                kind="completion",
                body=body.model_dump(exclude_none=True),
                prompt_text=body.prompt,
                max_tokens=body.max_tokens,
                seed=body.seed or 0,
                stream=body.stream,
            )
            return await server.respond(gen, _identity(request, server.attempt))

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await _json_body(request, ChatBody)
            gen = GenRequest(
                kind="chat",
                body=body.model_dump(exclude_none=True),
                prompt_text=_chat_prompt(body.messages),
                max_tokens=body.max_completion_tokens or body.max_tokens or 256,
                seed=body.seed or 0,
                stream=body.stream,
                continuation=_continuation(body),
            )
            return await server.respond(gen, _identity(request, server.attempt))

    async def respond(self, gen: GenRequest, ident: Identity | None) -> Response:
        if ident is not None:
            self.check_attempt(ident.rollout_id, ident.attempt)
        send, receive = anyio.create_memory_object_stream[Item](max_buffer_size=1024)
        self.spawn(self._produce, gen, ident, send)
        created = int(time.time())
        rid = f"{'chatcmpl' if gen.kind == 'chat' else 'cmpl'}-{gen.digest[:24]}"
        if not gen.stream:
            async with receive:
                async for item in receive:
                    if isinstance(item, Failed):
                        raise item.error
                    if isinstance(item, Done):
                        return JSONResponse(self._full_reply(gen, item, rid, created))
            raise ProtocolError(ErrorCode.INTERNAL, "generation ended without a result")
        first = await receive.receive()
        if isinstance(first, Failed):
            await receive.aclose()
            raise first.error
        return StreamingResponse(
            self._sse(gen, first, receive, rid, created), media_type="text/event-stream"
        )

    async def _sse(
        self,
        gen: GenRequest,
        first: Item,
        receive: MemoryObjectReceiveStream[Item],
        rid: str,
        created: int,
    ) -> AsyncIterator[str]:
        async with receive:
            item: Item | None = first
            while item is not None:
                if isinstance(item, Failed):
                    yield f"data: {item.error.body().model_dump_json()}\n\n"
                    return
                yield f"data: {json.dumps(self._chunk(gen, item, rid, created))}\n\n"
                if isinstance(item, Done):
                    yield "data: [DONE]\n\n"
                    return
                try:
                    item = await receive.receive()
                except anyio.EndOfStream:
                    item = None

    def _chunk(self, gen: GenRequest, item: Piece | Done, rid: str, created: int) -> dict[str, Any]:
        text = item.text if isinstance(item, Piece) else ""
        reason = item.finish_reason if isinstance(item, Done) else None
        if gen.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
            obj = "text_completion"
        else:
            choice = {"index": 0, "delta": {"role": "assistant", "content": text}}
            obj = "chat.completion.chunk"
        choice["finish_reason"] = reason
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.options.model_name,
            "choices": [choice],
        }

    def _full_reply(self, gen: GenRequest, done: Done, rid: str, created: int) -> dict[str, Any]:
        usage = {
            "prompt_tokens": len(_TOKEN.findall(gen.prompt_text)),
            "completion_tokens": done.tokens,
            "total_tokens": len(_TOKEN.findall(gen.prompt_text)) + done.tokens,
        }
        if gen.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": done.text, "logprobs": None}
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text}}
            obj = "chat.completion"
        choice["finish_reason"] = done.finish_reason
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.options.model_name,
            "choices": [choice],
            "usage": usage,
        }

    # --- generation ---------------------------------------------------------------------------

    async def _produce(
        self, gen: GenRequest, ident: Identity | None, send: MemoryObjectSendStream[Item]
    ) -> None:
        async with send:
            try:
                if ident is None:
                    done = await self._generate_unkeyed(gen, send)
                else:
                    done = await self._generate(gen, ident, send)
                await _offer(send, done)
            except ProtocolError as error:
                await _offer(send, Failed(error))
            except EpisodeError as error:
                await _offer(send, Failed(episode_error(error)))
            except Exception as error:
                log.exception("generation failed")
                await _offer(
                    send,
                    Failed(ProtocolError(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}")),
                )

    async def _generate_unkeyed(self, gen: GenRequest, send: MemoryObjectSendStream[Item]) -> Done:
        """Requests without an episode identity: paused by checkpoints, never recorded."""
        text, produced, reason = "", 0, "stop"
        attempt = self.attempt
        stream = self.backend.stream(gen, "", 0)
        try:
            while True:
                await self.runtime.wait_admission()
                try:
                    piece = await stream.__anext__()
                except StopAsyncIteration:
                    break
                if piece.text:
                    text += piece.text
                    produced += 1
                    self._count_token(attempt, "-")
                    await _offer(send, Piece(piece.text))
                if piece.finish_reason is not None:
                    reason = piece.finish_reason
                    break
        finally:
            await stream.aclose()
        await self.runtime.wait_admission()
        return Done(text, reason, produced)

    async def _generate(
        self, gen: GenRequest, ident: Identity, send: MemoryObjectSendStream[Item]
    ) -> Done:
        rid, key, attempt = ident.rollout_id, ident.key, ident.attempt
        digest = gen.digest
        kept = self.delivered.get(rid)
        if kept is not None and kept.key == key and kept.data.digest == digest:
            # delivered (or held) before a restore: the caller replays its step; do not regenerate
            self.stats.bump(attempt, "responses_replayed")
            kept.attempt = attempt
            kept.restored = False
            await _offer(send, Piece(kept.data.text))
            return Done(kept.data.text, kept.data.finish_reason, kept.data.tokens)
        if kept is not None and kept.key != key:
            del self.delivered[rid]  # the caller moved on: the older response is no longer needed
        live = self.runtime.find(rid, key)
        running = self._running.get((rid, key))
        if (
            live is not None
            and running is not None
            and (live.attempt, live.digest)
            == (
                attempt,
                digest,
            )
        ):
            # the same request again while it generates (its caller retried after a dropped
            # connection): share the generation rather than refuse or repeat it
            self.stats.bump(attempt, "requests_attached")
            done = await running.wait()
            await _offer(send, Piece(done.text))
            return done
        try:
            ep = self.runtime.begin(
                rid,
                attempt,
                Boundary("generate", {"text": "", "tokens": 0}),
                key=key,
                digest=digest,
            )
        except TaskMismatch as error:
            raise ProtocolError(
                ErrorCode.TASK_MISMATCH,
                f"request {rid}/{key} differs from the one its checkpoint recorded: {error}",
            ) from error
        if ep.continued_from is not None:
            self.stats.bump(
                attempt, "held_restored" if ep.boundary.step == "deliver" else "cuts_continued"
            )
        outcome: Outcome[Done] = Outcome()
        self._running[(rid, key)] = outcome
        try:
            done = await self._generate_episode(ep, gen, send)
        except Exception as error:
            outcome.fail(error)
            raise
        except BaseException:
            outcome.fail(ProtocolError(ErrorCode.INTERNAL, f"generation {rid}/{key} stopped"))
            raise
        finally:
            if self._running.get((rid, key)) is outcome:
                del self._running[(rid, key)]
        outcome.set(done)
        return done

    async def _generate_episode(
        self, ep: Episode, gen: GenRequest, send: MemoryObjectSendStream[Item]
    ) -> Done:
        rid, key, attempt, digest = ep.rollout_id, ep.key, ep.attempt, gen.digest
        try:
            with self.runtime.driving(ep), self.runtime.guard(ep):
                prefix = str(ep.boundary.state.get("text", ""))
                if prefix:
                    await _offer(send, Piece(prefix))
                if ep.boundary.step == "generate":
                    await self._tokens(ep, gen, send)
                await self.hooks.point("finish", rid)
                held = not self.runtime.admission_open
                if held:
                    self.hooks.notify("held", rid)
                    self.stats.bump(attempt, "held")
            await self.runtime.hold(ep)
            if ep.cancelled:
                raise EpisodeCancelled(f"{ep.id} was retired")
            state = ep.boundary.state
            data = DeliveredData(
                digest=digest,
                text=str(state["text"]),
                finish_reason=str(state["finish_reason"]),
                tokens=int(state["tokens"]),
            )
            self.delivered[rid] = Delivered(key=key, attempt=attempt, data=data)
            self.delivered.move_to_end(rid)
            while len(self.delivered) > _DELIVERED_KEPT:
                self.delivered.popitem(last=False)
            return Done(data.text, data.finish_reason, data.tokens)
        finally:
            self.runtime.end(ep)

    async def _tokens(
        self, ep: Episode, gen: GenRequest, send: MemoryObjectSendStream[Item]
    ) -> None:
        """One replay step per token; a checkpoint in between cuts the backend stream."""
        stream: AsyncGenerator[Piece, None] | None = None
        epoch = -1

        async def next_piece() -> Boundary:
            nonlocal stream, epoch
            state = ep.boundary.state
            text, produced = str(state["text"]), int(state["tokens"])
            if stream is None or epoch != self.runtime.epoch:
                if stream is not None:
                    self.stats.bump(ep.attempt, "cuts")
                    await stream.aclose()
                stream = self.backend.stream(gen, text, produced)
                epoch = self.runtime.epoch
            try:
                piece = await stream.__anext__()
            except StopAsyncIteration:
                piece = Piece("", "stop")
            if piece.text:
                self._count_token(ep.attempt, f"{ep.rollout_id}/{ep.key}")
                text, produced = text + piece.text, produced + 1
            if piece.finish_reason is not None:
                return Boundary(
                    "deliver",
                    {"text": text, "tokens": produced, "finish_reason": piece.finish_reason},
                )
            return Boundary("generate", {"text": text, "tokens": produced})

        try:
            while ep.boundary.step == "generate":
                before = str(ep.boundary.state["text"])
                await self.hooks.point("token", ep.rollout_id, int(ep.boundary.state["tokens"]))
                boundary = await self.runtime.step(ep, "token", StepMode.REPLAY, next_piece)
                delta = str(boundary.state["text"])[len(before) :]
                if delta:
                    await _offer(send, Piece(delta))
        finally:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    def _count_token(self, attempt: int, request_key: str) -> None:
        by = self.tokens.setdefault(attempt, {})
        by[request_key] = by.get(request_key, 0) + 1


def _chat_prompt(messages: Sequence[ChatMessage]) -> str:
    return "\n".join(f"{m.role}: {m.content}" for m in messages)


def _continuation(body: ChatBody) -> Continuation | None:
    """`continue_final_message: true` (an extra field, as vLLM takes it) with a final
    assistant message."""
    final = body.messages[-1]
    extra = body.model_extra or {}
    if extra.get("continue_final_message") is not True or final.role != "assistant":
        return None
    return Continuation(prompt_text=_chat_prompt(body.messages[:-1]), prefix=final.content)


async def _offer(send: MemoryObjectSendStream[Item], item: Item) -> None:
    """Send to the response stream; a caller that went away is not an error for generation."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await send.send(item)


def _identity(request: Request, attempt: int) -> Identity | None:
    raw = request.headers.get(REQUEST_HEADER)
    if raw is None:
        return None
    rollout_id, sep, key = raw.partition("/")
    if not sep or not re.fullmatch(ROLLOUT_ID_PATTERN, rollout_id) or not 0 < len(key) <= _KEY_MAX:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"{REQUEST_HEADER} must be '<rollout_id>/<key>' (key 1-{_KEY_MAX} characters)",
        )
    raw_attempt = request.headers.get(ATTEMPT_HEADER)
    if raw_attempt is None:
        return Identity(rollout_id, key, attempt)
    if not raw_attempt.isdigit():
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{ATTEMPT_HEADER} must be an integer")
    return Identity(rollout_id, key, int(raw_attempt))


async def _json_body(request: Request, model: type[_M]) -> _M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in error.errors()[:5]
        )
        raise ProtocolError(ErrorCode.INVALID_REQUEST, problems) from None
