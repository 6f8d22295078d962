"""The policy model server: an OpenAI-compatible front that is a checkpoint participant.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (plain JSON or `stream: true` SSE;
with tools, tool calls and tool results too), `POST /v1/responses` (the Responses API),
`GET /v1/models`; each also under `/ng-rollout/<capture key>/`, which names the episode for
clients that cannot set headers (below). Tool requests and the Responses API are generated as
text in which the model writes its calls (`agent_api.py`). Two backends produce the tokens:

* `builtin`: deterministic and seeded by (prompt, seed). It solves the shipped arithmetic tasks
  the way a small tool-using policy would (`CALC: 12*7`, then `ANSWER: 84` once the calculator's
  `RESULT:` is in the prompt), with a seeded mistake rate so rewards vary, one whitespace-led
  word per token with a configurable per-token latency. Because the whole completion is a pure
  function of the request, a generation cut after k tokens and continued yields exactly the
  tokens of an uncut one. It also takes vLLM's `continue_final_message` in chat requests (going
  on with its own output in the final assistant message), so it can stand in for vLLM as the
  upstream of an `openai` relay (docs/servers.md, "Your inference server as a sidecar"). When
  tools are offered it writes its `CALC:` step as a call of the calculator tool instead.
* `openai`: relays to an upstream OpenAI-compatible server (vLLM, SGLang) over streaming; a cut
  closes the upstream stream and the continuation asks upstream to go on from the prefix
  (completions: prompt + prefix; chat: the prefix as a final assistant message with vLLM's
  `continue_final_message`). Tool requests and the Responses API are rendered with the engine's
  chat template (llama.cpp's `/apply-template`) and generated as completions, so they continue
  from token ids like completions do.

Checkpoint support. Requests that name their episode (`X-Rollout-Request: <rollout_id>/<key>`,
`X-Rollout-Attempt: N`; the agent sends them; or the URL prefix `/ng-rollout/<rollout id>` or
`/ng-rollout/<rollout id>-a<N>`, keyed by the request's content) are episodes of the runtime
with one *replay* step per token: a checkpoint never waits for a token, and a token that
finishes while the checkpoint is open is held. At prepare, a generation in flight is therefore
*cut*: its recorded boundary is the prefix so far. A generation that finished but was not
delivered is *held*: it is recorded whole and delivered only when admission reopens. After a
restore, the re-issued request with the same key continues from the recorded prefix, or gets
the held response at once. The last response delivered to each rollout is kept (and recorded)
too: it may have been on the wire while its caller parked, and the caller's replay must get it
without generating it again.

This module holds the participant (cuts, held and delivered responses), the generation and the
routes; the request bodies and generation types are in `generation.py`, the two backends in
`backends.py`, the reply bodies and event streams written from a generation in
`model_replies.py`, the agent APIs' request mapping and response writing in `agent_api.py`.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from rollout_protocol import (
    ROLLOUT_ID_PATTERN,
    Boundary,
    EncodedRecord,
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
)
from rollout_protocol.model_api import (
    ChatBody,
    ChatMessage,
    CompletionBody,
    ResponsesBody,
    decode_body,
)

from . import agent_api
from .backends import Backend, BuiltinBackend, OpenAIBackend, wanted_logprobs
from .common import (
    Outcome,
    RolloutServer,
    ServerOptions,
    episode_error,
)
from .generation import (
    DELIVERED_KIND,
    Continuation,
    Delivered,
    DeliveredData,
    Done,
    Failed,
    GenRequest,
    Identity,
    Item,
    Piece,
    Progress,
    TokenLogprob,
)
from .model_replies import Replies

log = logging.getLogger(__name__)

REQUEST_HEADER = "X-Rollout-Request"
ATTEMPT_HEADER = "X-Rollout-Attempt"
_DELIVERED_KEPT = 100_000
"""Rollouts whose last response is kept; far more than a set runs live at once."""
_REQUESTS_KEPT = 200_000
"""Generations whose tokens `/stats` shows by request key, and whose progress since the last
checkpoint a retire can count, per attempt (oldest dropped; the totals count every token): a
server that runs for days never holds more than this."""
_KEY_MAX = 200
_ATTEMPT_VALUE = re.compile(r"[0-9]{1,18}")
PREFIX = "/ng-rollout/{capture_key}"
"""Routes under this prefix take their episode from the path: the capture key is the rollout
id, or `<rollout id>-a<N>` for attempt N (as NeMo Gym writes it), for clients whose base URL
is all they can set."""
_CAPTURE_ATTEMPT = re.compile(r"(.+)-a([0-9]{1,18})")


# --- the participant --------------------------------------------------------------------------


class ModelParticipant(RuntimeParticipant):
    """Generations (cut prefixes, held responses) plus the last delivered response per rollout."""

    def __init__(self, server: ModelServer) -> None:
        super().__init__(
            Role.MODEL,
            server.runtime,
            on_event=server.hooks.notify,
            on_rewire=server.rewire,
            work_counter=None,
        )
        self.server = server
        self._checkpointed_records: Sequence[Record] = ()
        """The records of the last checkpoint committed or restored; their tokens are only
        counted when a retire asks (`_tokens_checkpointed`), not inside the commit's pause."""
        self._checkpointed_tokens: dict[tuple[str, str], int] | None = {}
        """Tokens of each generation the last checkpoint committed or restored holds."""

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        return [encoded.record for encoded in self.export_encoded(scope)]

    def export_encoded(self, scope: frozenset[str] | None) -> list[EncodedRecord]:
        encoded = self.runtime.export_encoded(scope)
        encoded.extend(
            d.encode(rid)
            for rid, d in self.server.delivered.items()
            if scope is None or rid in scope
        )
        return encoded

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
        # A test can hold a restore here (`--debug-hooks`): a recovery in phase Restoring.
        await self.server.hooks.point("install")
        installed = await super().install([r for r in records if r.kind != DELIVERED_KIND], attempt)
        for record in records:
            if record.kind == DELIVERED_KIND:
                delivered = Delivered(
                    key=record.key,
                    attempt=attempt,
                    data=DeliveredData.model_validate(record.data),
                    restored=True,
                )
                delivered.encode(record.rollout_id)
                self.server.delivered[record.rollout_id] = delivered
        return installed

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        retired = await super().retire(attempt, rollout_ids)
        for rid, delivered in list(self.server.delivered.items()):
            if delivered.attempt == attempt and (rollout_ids is None or rid in rollout_ids):
                del self.server.delivered[rid]
        return retired

    # --- work accounting: model tokens ---------------------------------------------------------

    def checkpointed(self, checkpoint_id: str, records: Sequence[Record]) -> None:
        """Progress counts from these records, except a generation's token that was being
        generated when the checkpoint closed admission: the step is held, not cut (its record
        holds the boundary before it), and that token is counted already, before the commit.
        Its progress stays, so a loss before the generation's next token still counts it."""
        self._checkpointed_records = records
        self._checkpointed_tokens = None
        progress = self.server.progress
        if progress:
            held_back = {
                (r.rollout_id, r.key): _record_tokens(r)
                for r in records
                if r.kind != DELIVERED_KIND
            }
            beyond = {
                ident: (attempt, tokens)
                for ident, (attempt, tokens) in progress.items()
                if ident in held_back and tokens > held_back[ident]
            }
            progress.clear()
            progress.update(beyond)
        self.runtime.forget_progress()

    def _tokens_checkpointed(self) -> dict[tuple[str, str], int]:
        if self._checkpointed_tokens is None:
            self._checkpointed_tokens = {
                (r.rollout_id, r.key): tokens
                for r in self._checkpointed_records
                if (tokens := _record_tokens(r))
            }
            self._checkpointed_records = ()
        return self._checkpointed_tokens

    def kept_work(self, records: Sequence[Record]) -> dict[str, int] | None:
        """Tokens of the generations the records hold (cut prefixes and held responses): what
        the episodes continue from instead of generating again. Delivered responses are not
        counted (their episodes' boundaries usually hold them already)."""
        kept = sum(_record_tokens(r) for r in records if r.kind != DELIVERED_KIND)
        return {MODEL_TOKENS_COUNTER: kept}

    def finished_rollouts(self, attempt: int) -> list[str] | None:
        """A generation ends long before its episode: the model cannot tell which finished."""
        return None

    def lost_work(self, attempt: int, finished: frozenset[str] | None) -> dict[str, int] | None:
        """Tokens `attempt` generated after the last checkpoint, per generation beyond what the
        checkpoint holds of it, except for the `finished` rollouts (None: none is known
        finished, every rollout counts)."""
        progress = self.server.progress
        counted = [
            (ident, tokens)
            for ident, (generated_under, tokens) in progress.items()
            if generated_under == attempt
        ]
        for ident, _ in counted:
            del progress[ident]
        checkpointed = self._tokens_checkpointed()
        lost = sum(
            max(0, tokens - checkpointed.get(ident, 0))
            for ident, tokens in counted
            if finished is None or ident[0] not in finished
        )
        return {MODEL_TOKENS_COUNTER: lost}

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
    waits_on = ()
    record_kind = "generation"

    def __init__(self, options: ServerOptions, **kwargs: Any) -> None:
        self._running: dict[tuple[str, str], Outcome[Done]] = {}
        self._audiences: dict[tuple[str, str], _Audience] = {}
        """Who reads each keyed generation (a retried request attaches to a running one)."""
        self._abandoned = 0
        self.delivered: OrderedDict[str, Delivered] = OrderedDict()
        """The last response delivered to each rollout (most recent last, bounded)."""
        self.tokens: dict[int, OrderedDict[str, int]] = {}
        """attempt -> request key -> tokens generated (the latest `_REQUESTS_KEPT` keys)."""
        self.token_totals: dict[int, int] = {}
        """attempt -> every token generated under it."""
        self.progress: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        """(rollout, request key) -> (attempt, tokens so far) of each generation that made
        progress since the last checkpoint: what a retire counts as lost (`lost_work`; the
        latest `_REQUESTS_KEPT`)."""
        super().__init__(options, **kwargs)
        self.replies = Replies(options.model_name)
        """Writes the OpenAI-compatible reply of each request from its generation's items."""
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

    def extra_stats(self, rollout_ids: list[str] | None, detail: bool) -> dict[str, Any]:
        """Token counts; per request key (`<rollout_id>/<key>`) only with `detail` (all) or for
        the rollouts named in `rollout_ids`, as for the step counters."""
        named = frozenset(rollout_ids or ())

        def shown(key: str) -> bool:
            return detail or key.partition("/")[0] in named

        return {
            "tokens": {
                str(a): {
                    "total": self.token_totals.get(a, 0),
                    "by_request": {key: n for key, n in by.items() if shown(key)},
                }
                for a, by in self.tokens.items()
            },
            "delivered_kept": len(self.delivered),
            "abandoned": self._abandoned,
        }

    def add_routes(self, app: FastAPI) -> None:
        server = self

        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {"id": server.options.model_name, "object": "model", "owned_by": "rollout"}
                ],
            }

        async def completions(request: Request) -> Response:
            body = decode_body(await request.body(), CompletionBody)
            gen = GenRequest(
                kind="completion",
                body=body.model_dump(exclude_none=True),
                prompt_text=body.prompt,
                max_tokens=body.max_tokens,
                seed=body.seed or 0,
                stream=body.stream,
            )
            return await server.respond(gen, _identity(request, server.attempt, gen))

        async def chat(request: Request) -> Response:
            body = decode_body(await request.body(), ChatBody)
            if body.uses_tools:
                gen = agent_api.chat_generation(body)
            else:
                gen = GenRequest(
                    kind="chat",
                    body=body.model_dump(exclude_none=True),
                    prompt_text=_chat_prompt(body.messages),
                    max_tokens=body.max_completion_tokens or body.max_tokens or 256,
                    seed=body.seed or 0,
                    stream=body.stream,
                    continuation=_continuation(body),
                )
            return await server.respond(gen, _identity(request, server.attempt, gen))

        async def responses(request: Request) -> Response:
            body = decode_body(await request.body(), ResponsesBody)
            gen = agent_api.responses_generation(body)
            return await server.respond(gen, _identity(request, server.attempt, gen))

        for prefix in ("", PREFIX):
            app.get(prefix + "/v1/models")(models)
            routes = (
                ("/v1/completions", completions, CompletionBody),
                ("/v1/chat/completions", chat, ChatBody),
                ("/v1/responses", responses, ResponsesBody),
            )
            for path, handler, body in routes:
                extra = _openapi_extra(body, prefixed=bool(prefix))
                app.post(prefix + path, openapi_extra=extra)(handler)

    async def respond(self, gen: GenRequest, ident: Identity | None) -> Response:
        if ident is not None:
            self.check_attempt(ident.rollout_id, ident.attempt)
        send, receive = anyio.create_memory_object_stream[Item](max_buffer_size=1024)
        gone = anyio.Event()
        """Set when a streaming consumer went away (a plain reply's caller waits to the end)."""
        self.spawn(self._produce, gen, ident, send, gone)
        return await self.replies.write(gen, receive, gone)

    # --- generation ---------------------------------------------------------------------------

    async def _produce(
        self,
        gen: GenRequest,
        ident: Identity | None,
        send: MemoryObjectSendStream[Item],
        gone: anyio.Event,
    ) -> None:
        key = None if ident is None else (ident.rollout_id, ident.key)
        audience = self._audiences.setdefault(key, _Audience()) if key else _Audience()
        audience.join()
        async with send, anyio.create_task_group() as group:
            group.start_soon(self._follow, gone, audience)
            group.start_soon(self._stop_when_abandoned, audience, group.cancel_scope, ident)
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
            finally:
                audience.leave(gone)
                if (
                    key is not None
                    and audience.present == 0
                    and self._audiences.get(key) is audience
                ):
                    del self._audiences[key]
                group.cancel_scope.cancel()

    async def _follow(self, gone: anyio.Event, audience: _Audience) -> None:
        await gone.wait()
        audience.leave(gone)

    async def _stop_when_abandoned(
        self, audience: _Audience, scope: anyio.CancelScope, ident: Identity | None
    ) -> None:
        """Stop the generation once every consumer of its stream has gone (a relay closes its
        upstream stream, so the engine stops too). While a checkpoint is open it is held:
        the checkpoint may record its cut, and it is stopped once admission reopens."""
        while True:
            await audience.abandoned()
            await self.runtime.wait_admission()
            if audience.present == 0:
                attempt = self.attempt if ident is None else ident.attempt
                self.stats.bump(attempt, "abandoned")
                self._abandoned += 1
                scope.cancel()
                return

    async def _generate_unkeyed(self, gen: GenRequest, send: MemoryObjectSendStream[Item]) -> Done:
        """Requests without an episode identity: paused by checkpoints, never recorded."""
        text, produced, reason = "", 0, "stop"
        logprobs: list[TokenLogprob] | None = [] if wanted_logprobs(gen) is not None else None
        attempt = self.attempt
        stream = self.backend.stream(gen, Progress(seed_key=gen.digest))
        try:
            while True:
                await self.runtime.wait_admission()
                try:
                    piece = await stream.__anext__()
                except StopAsyncIteration:
                    break
                count = _token_count(piece)
                if count:
                    text += piece.text
                    produced += count
                    self._count_token(attempt, "-", count)
                    if logprobs is not None:
                        logprobs = None if piece.logprobs is None else [*logprobs, *piece.logprobs]
                    await _offer(
                        send, Piece(piece.text, logprobs=piece.logprobs if logprobs else None)
                    )
                if piece.finish_reason is not None:
                    reason = piece.finish_reason
                    break
        finally:
            await stream.aclose()
        await self.runtime.wait_admission()
        return Done(text, reason, produced, logprobs)

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
            await _offer(send, Piece(kept.data.text, logprobs=_tuple(kept.data.logprobs)))
            return Done(
                kept.data.text, kept.data.finish_reason, kept.data.tokens, kept.data.logprobs
            )
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
            await _offer(send, Piece(done.text, logprobs=_tuple(done.logprobs)))
            return done
        try:
            ep = self.runtime.begin(
                rid,
                attempt,
                Boundary("generate", _initial_state(gen)),
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
                    await _offer(send, Piece(prefix, logprobs=_state_logprobs(ep.boundary.state)))
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
                ids=_state_ids(state),
                logprobs=list(_state_logprobs(state) or ()) or None,
            )
            self.delivered[rid] = delivered = Delivered(key=key, attempt=attempt, data=data)
            delivered.encode(rid)
            self.delivered.move_to_end(rid)
            while len(self.delivered) > _DELIVERED_KEPT:
                self.delivered.popitem(last=False)
            return Done(data.text, data.finish_reason, data.tokens, data.logprobs)
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
            state = dict(ep.boundary.state)
            produced = int(state["tokens"])
            if stream is None or epoch != self.runtime.epoch:
                if stream is not None:
                    self.stats.bump(ep.attempt, "cuts")
                    await stream.aclose()
                progress = Progress(
                    text=str(state["text"]),
                    tokens=produced,
                    ids=_tuple_ids(state),
                    seed_key=f"{ep.rollout_id}/{ep.key}",
                )
                stream = self.backend.stream(gen, progress)
                epoch = self.runtime.epoch
            try:
                piece = await stream.__anext__()
            except StopAsyncIteration:
                piece = Piece("", "stop")
            if piece.continued is not None:
                # how this generation went on after its cut: said in the record and in /stats
                state["continuation"] = piece.continued
                self.stats.bump(ep.attempt, f"continued_{piece.continued}")
            count = _token_count(piece)
            if count:
                self._count_token(ep.attempt, f"{ep.rollout_id}/{ep.key}", count)
                ident = (ep.rollout_id, ep.key)
                self.progress[ident] = (ep.attempt, produced + count)
                self.progress.move_to_end(ident)
                if len(self.progress) > _REQUESTS_KEPT:
                    self.progress.popitem(last=False)
                state["text"] = str(state["text"]) + piece.text
                state["tokens"] = produced + count
                if "ids" in state:
                    if piece.ids is None:
                        del state["ids"]  # the engine gave no ids: text-level from here on
                    else:
                        state["ids"] = [*state["ids"], *piece.ids]
                if "logprobs" in state:
                    if piece.logprobs is None:
                        del state["logprobs"]
                    else:
                        state["logprobs"] = [*state["logprobs"], *map(list, piece.logprobs)]
            if piece.finish_reason is not None:
                state["finish_reason"] = piece.finish_reason
                return Boundary("deliver", state)
            return Boundary("generate", state)

        try:
            while ep.boundary.step == "generate":
                before = ep.boundary.state
                await self.hooks.point("token", ep.rollout_id, int(before["tokens"]))
                boundary = await self.runtime.step(ep, "token", StepMode.REPLAY, next_piece)
                delta = str(boundary.state["text"])[len(str(before["text"])) :]
                logprobs = _state_logprobs(boundary.state)
                new = logprobs[len(_state_logprobs(before) or ()) :] if logprobs else None
                if delta or new:
                    await _offer(send, Piece(delta, logprobs=new))
        finally:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    def _count_token(self, attempt: int, request_key: str, count: int = 1) -> None:
        self.token_totals[attempt] = self.token_totals.get(attempt, 0) + count
        by = self.tokens.get(attempt)
        if by is None:
            by = self.tokens[attempt] = OrderedDict()
        if request_key in by:
            by[request_key] += count
            return
        by[request_key] = count
        if len(by) > _REQUESTS_KEPT:
            by.popitem(last=False)


MODEL_TOKENS_COUNTER: Final = "model_tokens"
"""The work counter of generated tokens (`RestoreReply.kept`, `RetireReply.lost`)."""


def _record_tokens(record: Record) -> int:
    """The tokens a generation record (its boundary state) or a delivered record holds."""
    data = record.data
    state = data.get("state")
    tokens = state.get("tokens") if isinstance(state, Mapping) else data.get("tokens")
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0


def _initial_state(gen: GenRequest) -> dict[str, Any]:
    """A generation's first boundary. `ids` (every token's id, while the engine reports them)
    and `logprobs` (while requested) were added to the record with token-id continuation: a
    record without them continues from text, as before."""
    state: dict[str, Any] = {"text": "", "tokens": 0, "ids": []}
    if wanted_logprobs(gen) is not None:
        state["logprobs"] = []
    return state


def _state_ids(state: Mapping[str, Any]) -> list[int] | None:
    ids = state.get("ids")
    return [int(i) for i in ids] if isinstance(ids, list) else None


def _tuple_ids(state: Mapping[str, Any]) -> tuple[int, ...] | None:
    ids = _state_ids(state)
    return None if ids is None else tuple(ids)


def _state_logprobs(state: Mapping[str, Any]) -> tuple[TokenLogprob, ...] | None:
    raw = state.get("logprobs")
    if not isinstance(raw, list):
        return None
    return tuple((str(t), float(lp)) for t, lp in raw)


def _tuple(logprobs: Sequence[TokenLogprob] | None) -> tuple[TokenLogprob, ...] | None:
    return tuple(logprobs) if logprobs else None


def _token_count(piece: Piece) -> int:
    """Tokens in a piece: the engine's own count, else its ids, else one per non-empty chunk."""
    if piece.count is not None:
        return piece.count
    if piece.ids is not None:
        return len(piece.ids)
    return 1 if piece.text else 0


def _chat_prompt(messages: Sequence[ChatMessage]) -> str:
    return "\n".join(f"{m.role}: {m.text}" for m in messages)


def _continuation(body: ChatBody) -> Continuation | None:
    """`continue_final_message: true` (an extra field, as vLLM takes it) with a final
    assistant message."""
    final = body.messages[-1]
    extra = body.model_extra or {}
    if extra.get("continue_final_message") is not True or final.role != "assistant":
        return None
    return Continuation(prompt_text=_chat_prompt(body.messages[:-1]), prefix=final.text)


class _Audience:
    """The consumers of one generation. A streaming consumer leaves when its connection goes
    away; a plain (non-streaming) one only when the generation ends."""

    def __init__(self) -> None:
        self.present = 0
        self._left: set[int] = set()
        self._changed = anyio.Event()

    def join(self) -> None:
        self.present += 1

    def leave(self, consumer: anyio.Event) -> None:
        """`consumer` (its `gone` event) leaves; a second call for it is a no-op."""
        if id(consumer) in self._left:
            return
        self._left.add(id(consumer))
        self.present -= 1
        self._changed.set()
        self._changed = anyio.Event()

    async def abandoned(self) -> None:
        while self.present > 0:
            await self._changed.wait()


async def _offer(send: MemoryObjectSendStream[Item], item: Item) -> None:
    """Send to the response stream; a caller that went away is not an error for generation."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await send.send(item)


def _identity(request: Request, attempt: int, gen: GenRequest) -> Identity | None:
    raw = request.headers.get(REQUEST_HEADER)
    capture = request.path_params.get("capture_key")
    if raw is None and isinstance(capture, str):
        return capture_identity(capture, gen)
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
    if _ATTEMPT_VALUE.fullmatch(raw_attempt) is None:
        # ASCII digits only: `str.isdigit` also takes '²' or '٣', which `int` then refuses
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"{ATTEMPT_HEADER} must be a non-negative integer of at most 18 ASCII digits",
        )
    return Identity(rollout_id, key, int(raw_attempt))


def capture_identity(capture_key: str, gen: GenRequest) -> Identity:
    """The episode a `/ng-rollout/<capture key>/` URL names; the request key is the request's
    content, so the re-issued request after a restore finds its generation again."""
    match = _CAPTURE_ATTEMPT.fullmatch(capture_key)
    if match is not None and re.fullmatch(ROLLOUT_ID_PATTERN, match.group(1)):
        rollout_id, attempt = match.group(1), int(match.group(2))
    elif re.fullmatch(ROLLOUT_ID_PATTERN, capture_key):
        rollout_id, attempt = capture_key, 0
    else:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"the capture key in /ng-rollout/<capture key>/ must be a rollout id or "
            f"'<rollout id>-a<attempt>': {capture_key[:80]!r}",
        )
    return Identity(rollout_id, f"c-{gen.digest[:32]}", attempt)


def _inline(schema: Any, defs: Mapping[str, Any]) -> Any:
    """`schema` with its `$ref`s to `$defs` replaced by the definitions (none is recursive)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def _openapi_extra(body: type[BaseModel], *, prefixed: bool = False) -> dict[str, Any]:
    """The request body and identity headers of a generation route, for `/openapi.json` (the
    route reads both itself: the body leniently, as OpenAI clients send extra fields)."""
    raw = body.model_json_schema()
    schema = _inline(raw, raw.get("$defs", {}))
    capture = {
        "name": "capture_key",
        "in": "path",
        "required": True,
        "description": "`<rollout_id>` or `<rollout_id>-a<attempt>`: the generation is an episode",
        "schema": {"type": "string", "maxLength": 330},
    }
    extra = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "parameters": [
            {
                "name": REQUEST_HEADER,
                "in": "header",
                "required": False,
                "description": "`<rollout_id>/<key>`: the generation is an episode step",
                "schema": {"type": "string", "maxLength": 330},
            },
            {
                "name": ATTEMPT_HEADER,
                "in": "header",
                "required": False,
                "description": "The caller's attempt (ASCII digits); default: this server's",
                "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"},
            },
        ],
    }
    if prefixed:
        extra["parameters"] = [capture, *extra["parameters"]]
    return extra
