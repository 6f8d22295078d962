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
import os
import random
import re
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol, TypeVar

import anyio
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
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
    encode_record,
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
_REQUESTS_KEPT = 200_000
"""Generations whose tokens `/stats` shows by request key, and whose progress since the last
checkpoint a retire can count, per attempt (oldest dropped; the totals count every token): a
server that runs for days never holds more than this."""
_KEY_MAX = 200
_ATTEMPT_VALUE = re.compile(r"[0-9]{1,18}")


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
    # added with token-id continuation; records written before them still validate
    ids: list[int] | None = None
    logprobs: list[tuple[str, float]] | None = None


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


TokenLogprob = tuple[str, float]
"""One generated token's text and log-probability."""


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None = None
    ids: tuple[int, ...] | None = None
    """The engine's ids of this piece's tokens; None when the engine reports none."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    continued: ContinuationMode | None = None
    """Set on the first piece after a cut: how the backend continued."""
    count: int | None = None
    """Tokens in this piece where the engine counts them apart from its ids (llama.cpp's
    `timings.predicted_n`): more than `len(ids)` when the engine held a token back."""


@dataclass(frozen=True)
class Progress:
    """Where a generation stands when the backend is asked for the rest."""

    text: str = ""
    tokens: int = 0
    ids: tuple[int, ...] | None = ()
    """The ids of every token so far, or None when some are unknown (text-level only)."""
    seed_key: str = ""
    """`<rollout>/<key>` (the request digest when unkeyed): seeds derive from it."""


@dataclass(frozen=True)
class Done:
    text: str
    finish_reason: str
    tokens: int
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Failed:
    error: ProtocolError


Item = Piece | Done | Failed
ContinuationMode = Literal["token_ids", "text"]
CONTINUATION_ENV = "ROLLOUT_RELAY_CONTINUATION"
"""`text` makes the openai backend continue from text even where the engine gives ids (tests)."""


@dataclass
class Delivered:
    key: str
    attempt: int
    data: DeliveredData
    restored: bool = False
    encoded: EncodedRecord | None = field(default=None, compare=False, repr=False)
    """Its record, encoded when it was delivered (a checkpoint only writes it)."""

    def encode(self, rollout_id: str) -> EncodedRecord:
        if self.encoded is None:
            self.encoded = encode_record(
                Record(
                    kind=DELIVERED_KIND,
                    rollout_id=rollout_id,
                    attempt=self.attempt,
                    key=self.key,
                    data=self.data.model_dump(),
                )
            )
        return self.encoded


# --- backends ---------------------------------------------------------------------------------


class Backend(Protocol):
    def stream(self, request: GenRequest, progress: Progress) -> AsyncGenerator[Piece, None]:
        """The pieces after `progress` (text and tokens so far); the last has a finish reason."""
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

    async def stream(self, request: GenRequest, progress: Progress) -> AsyncGenerator[Piece, None]:
        produced = progress.tokens
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
    """Relay to an upstream OpenAI-compatible server (cuts need chunks or single steps).

    Completions continue a cut generation from token ids where the engine allows it: the
    relay asks for each sampled token's id (`logprobs` entries with an `id`, as llama.cpp's
    server gives them, or vLLM's `token_ids` with `return_token_ids`), records them, and sends
    the continuation's prompt as ids (the prompt's ids from the engine's `/tokenize`, then the
    generated ids), so nothing is re-tokenised. An engine that gives no ids gets the prefix as
    text (`prompt + prefix`), which BPE may re-tokenise differently; the generation record and
    `/stats` say so. A seeded sampled completion (`seed` set, temperature not 0) runs one token
    per upstream request with a seed derived from (seed, rollout, key, position): the engine's
    random stream then depends only on the position, so a continuation samples the same tokens.
    Chat requests continue from text (vLLM's `continue_final_message`).
    """

    def __init__(self, upstream_url: str, timeout_s: float) -> None:
        self.base = upstream_url.rstrip("/")
        self._clients = ShardedClients(PEER_SHARDS, timeout_s)
        self.text_only = os.environ.get(CONTINUATION_ENV, "auto") == "text"
        self._prompt_ids: OrderedDict[str, list[int] | None] = OrderedDict()

    async def stream(self, request: GenRequest, progress: Progress) -> AsyncGenerator[Piece, None]:
        if request.kind == "chat":
            async for piece in self._chat(request, progress):
                yield piece
            return
        wanted = _wanted_logprobs(request)
        seeded = request.body.get("seed") is not None and _temperature(request) != 0
        continuing = progress.tokens > 0
        prompt_ids: list[int] | None = None
        if not self.text_only and progress.ids is not None and (continuing or seeded):
            prompt_ids = await self._tokenize(request)
        mode: ContinuationMode | None = None
        if continuing:
            mode = "token_ids" if prompt_ids is not None else "text"
        if seeded and prompt_ids is not None and progress.ids is not None:
            pieces = self._steps(request, progress, prompt_ids, wanted)
        else:
            body = dict(request.body)
            if prompt_ids is not None and progress.ids is not None:
                body["prompt"] = [*prompt_ids, *progress.ids]
            else:
                body["prompt"] = request.body["prompt"] + progress.text
            body["max_tokens"] = max(1, request.max_tokens - progress.tokens)
            pieces = self._streamed("/v1/completions", body, request, wanted)
        async for piece in pieces:
            if mode is not None:
                piece, mode = replace(piece, continued=mode), None
            yield piece

    async def _streamed(
        self, path: str, body: dict[str, Any], request: GenRequest, wanted: int | None
    ) -> AsyncGenerator[Piece, None]:
        body["stream"] = True
        if request.kind == "completion" and not self.text_only:
            # ask for what identifies the sampled tokens: a logprob entry per token (llama.cpp
            # puts the id in it) and vLLM's token ids; engines ignore what they do not know
            body["logprobs"] = max(wanted or 0, 1)
            body["return_token_ids"] = True
        if request.kind == "completion":
            # llama.cpp: every chunk says how many tokens the engine has generated so far
            # (`timings.predicted_n`), which shows a token it did not stream (below)
            body["timings_per_token"] = True
        decoded = 0
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
                chunk = json.loads(payload)
                piece = _piece_from_chunk(chunk, request.kind)
                engine_count = _predicted(chunk) if request.kind == "completion" else None
                if engine_count is not None and engine_count > decoded:
                    count, decoded = engine_count - decoded, engine_count
                    if piece is None:
                        piece = Piece("")
                    if piece.ids is not None and len(piece.ids) < count:
                        # llama.cpp holds back a token that ends inside a UTF-8 character and
                        # streams the character with the id of its last token only: the held
                        # token's id is lost, so this generation is text-level from here on
                        piece = replace(piece, ids=None)
                    piece = replace(piece, count=count)
                if piece is not None and self.text_only and piece.ids is not None:
                    # as for an engine that reports no ids: none are recorded, the cut
                    # continues from text, and tokens are counted one per chunk
                    piece = replace(piece, ids=None)
                if piece is not None:
                    yield piece

    async def _chat(self, request: GenRequest, progress: Progress) -> AsyncGenerator[Piece, None]:
        body = dict(request.body)
        if progress.text:
            body["messages"] = [
                *request.body["messages"],
                {"role": "assistant", "content": progress.text},
            ]
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = max(1, request.max_tokens - progress.tokens)
        mode: ContinuationMode | None = "text" if progress.tokens > 0 else None
        async for piece in self._streamed("/v1/chat/completions", body, request, None):
            if mode is not None:
                piece, mode = replace(piece, continued=mode), None
            yield piece

    async def _steps(
        self, request: GenRequest, progress: Progress, prompt_ids: list[int], wanted: int | None
    ) -> AsyncGenerator[Piece, None]:
        """One token per request, each seeded by its position: exact across cuts."""
        assert progress.ids is not None
        ids = list(progress.ids)
        position = progress.tokens
        seed = int(request.body["seed"])
        client = self._clients.for_key(request.digest)
        path = self.base + "/v1/completions"
        while True:
            body = dict(request.body)
            body.update(
                prompt=[*prompt_ids, *ids],
                max_tokens=1,
                stream=False,
                seed=derived_seed(seed, progress.seed_key, position),
                logprobs=max(wanted or 0, 1),
                return_token_ids=True,
            )
            response = await client.post(path, json=body)
            if response.status_code >= 400:
                raise peer_error(path, response)
            reply = response.json()
            choice = (reply.get("choices") or [{}])[0]
            text = str(choice.get("text") or "")
            step_ids, logprobs = _choice_tokens(choice, text)
            generated = (reply.get("usage") or {}).get("completion_tokens")
            hidden = isinstance(generated, int) and generated > len(step_ids or ())
            if choice.get("finish_reason") == "stop" and (hidden or step_ids is None):
                # the token completed a stop string: llama.cpp replies with the text before
                # it and no logprobs, so no id; the generation ends here
                yield Piece(text, "stop", ids=None if text else ())
                return
            if hidden:
                # llama.cpp reports no id (and no text) for a token that ends inside a UTF-8
                # character: the step cannot be continued from ids, nor silently dropped
                raise ProtocolError(
                    ErrorCode.INTERNAL,
                    f"{self.base} sampled a token it reports no id for (one that ends inside a "
                    "UTF-8 character), so a seeded generation cannot go on exactly",
                )
            if step_ids is None or len(step_ids) > 1:
                raise ProtocolError(
                    ErrorCode.INTERNAL,
                    f"{self.base} gave no single token id for a one-token step: {choice!r:.200}",
                )
            ids.extend(step_ids)
            position += len(step_ids)
            upstream_reason = choice.get("finish_reason")
            done = not step_ids or upstream_reason == "stop" or position >= request.max_tokens
            reason = (
                ("stop" if upstream_reason == "stop" or not step_ids else "length")
                if done
                else None
            )
            yield Piece(text, reason, ids=step_ids, logprobs=logprobs)
            if done:
                return

    async def _tokenize(self, request: GenRequest) -> list[int] | None:
        """The prompt's ids as the engine tokenises it for a completion; None if it cannot."""
        digest = task_digest({"prompt": request.body["prompt"], "model": request.body.get("model")})
        if digest in self._prompt_ids:
            return self._prompt_ids[digest]
        prompt = request.body["prompt"]
        body = {
            # llama.cpp's /tokenize reads content/add_special, vLLM's prompt/add_special_tokens
            "content": prompt,
            "prompt": prompt,
            "add_special": True,
            "add_special_tokens": True,
        }
        if request.body.get("model") is not None:
            body["model"] = request.body["model"]
        ids: list[int] | None = None
        client = self._clients.for_key(request.digest)
        try:
            response = await client.post(self.base + "/tokenize", json=body)
            tokens = response.json().get("tokens") if response.status_code == 200 else None
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                ids = [int(t) for t in tokens]
        except (httpx.HTTPError, ValueError):
            ids = None
        self._prompt_ids[digest] = ids
        while len(self._prompt_ids) > 1024:
            self._prompt_ids.popitem(last=False)
        return ids

    async def aclose(self) -> None:
        await self._clients.aclose()


def derived_seed(seed: int, seed_key: str, position: int) -> int:
    """The seed of the token at `position` of a generation (31 bits, as every engine takes)."""
    digest = hashlib.sha256(f"{seed}\x00{seed_key}\x00{position}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _temperature(request: GenRequest) -> float | None:
    value = request.body.get("temperature")
    return float(value) if isinstance(value, int | float) else None


def _wanted_logprobs(request: GenRequest) -> int | None:
    value = request.body.get("logprobs")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _choice_tokens(
    choice: dict[str, Any], text: str
) -> tuple[tuple[int, ...] | None, tuple[TokenLogprob, ...] | None]:
    """The ids and logprobs of the tokens in one choice (chunk), as the engine reports them."""
    ids: tuple[int, ...] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    raw_ids = choice.get("token_ids")  # vLLM, with return_token_ids
    if isinstance(raw_ids, list):
        ids = tuple(int(i) for i in raw_ids)
    raw = choice.get("logprobs")
    if isinstance(raw, dict):
        content = raw.get("content")  # llama.cpp: one entry per token, with its id
        if isinstance(content, list) and content:
            logprobs = tuple((str(e.get("token", "")), float(e["logprob"])) for e in content)
            if ids is None and all("id" in e for e in content):
                ids = tuple(int(e["id"]) for e in content)
        elif isinstance(raw.get("token_logprobs"), list):  # the legacy completions format
            logprobs = tuple(
                (str(t), float(lp))
                for t, lp in zip(raw.get("tokens") or [], raw["token_logprobs"], strict=False)
            )
    if ids is None and not text:
        ids = ()  # an empty chunk (a final one): no token, nothing unknown
    return ids, logprobs


def _predicted(chunk: dict[str, Any]) -> int | None:
    """llama.cpp's count of the tokens generated so far (with `timings_per_token`)."""
    timings = chunk.get("timings")
    value = timings.get("predicted_n") if isinstance(timings, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
    ids, logprobs = _choice_tokens(choice, text) if kind == "completion" else (None, None)
    if not text and reason is None and not ids:
        return None
    return Piece(text, reason, ids=ids, logprobs=logprobs)


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

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {"id": server.options.model_name, "object": "model", "owned_by": "rollout"}
                ],
            }

        @app.post("/v1/completions", openapi_extra=_openapi_extra(CompletionBody))
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

        @app.post("/v1/chat/completions", openapi_extra=_openapi_extra(ChatBody))
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
        gone = anyio.Event()
        """Set when a streaming consumer went away (a plain reply's caller waits to the end)."""
        self.spawn(self._produce, gen, ident, send, gone)
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
            self._sse(gen, first, receive, rid, created, gone), media_type="text/event-stream"
        )

    async def _sse(
        self,
        gen: GenRequest,
        first: Item,
        receive: MemoryObjectReceiveStream[Item],
        rid: str,
        created: int,
        gone: anyio.Event,
    ) -> AsyncIterator[str]:
        with _setting(gone):
            async for chunk in self._sse_chunks(gen, first, receive, rid, created):
                yield chunk

    async def _sse_chunks(
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
            logprobs = item.logprobs if isinstance(item, Piece) else None
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": _logprobs_json(logprobs)
                if logprobs is not None and _wanted_logprobs(gen) is not None
                else None,
            }
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
            choice: dict[str, Any] = {
                "index": 0,
                "text": done.text,
                "logprobs": _logprobs_json(done.logprobs)
                if done.logprobs is not None and _wanted_logprobs(gen) is not None
                else None,
            }
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
        logprobs: list[TokenLogprob] | None = [] if _wanted_logprobs(gen) is not None else None
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
    if _wanted_logprobs(gen) is not None:
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


def _logprobs_json(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The completions API's (legacy) logprobs object."""
    return {
        "tokens": [t for t, _ in logprobs],
        "token_logprobs": [lp for _, lp in logprobs],
        "top_logprobs": None,
        "text_offset": None,
    }


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


@contextlib.contextmanager
def _setting(event: anyio.Event) -> Iterator[None]:
    """Set `event` however the block ends (the stream finished, failed or was cancelled)."""
    try:
        yield
    finally:
        event.set()


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
    if _ATTEMPT_VALUE.fullmatch(raw_attempt) is None:
        # ASCII digits only: `str.isdigit` also takes '²' or '٣', which `int` then refuses
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"{ATTEMPT_HEADER} must be a non-negative integer of at most 18 ASCII digits",
        )
    return Identity(rollout_id, key, int(raw_attempt))


def _openapi_extra(body: type[BaseModel]) -> dict[str, Any]:
    """The request body and identity headers of a generation route, for `/openapi.json` (the
    route reads both itself: the body leniently, as OpenAI clients send extra fields)."""
    schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    if body is ChatBody:
        schema["properties"]["messages"]["items"] = ChatMessage.model_json_schema()
    return {
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


async def _json_body(request: Request, model: type[_M]) -> _M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in error.errors()[:5]
        )
        raise ProtocolError(ErrorCode.INVALID_REQUEST, problems) from None
