"""The model server's two backends (docs/servers.md, "The model server"): `BuiltinBackend`, a
deterministic seeded policy for the shipped tasks whose output is a pure function of the
request, and `OpenAIBackend`, a streaming relay to an OpenAI-compatible engine (vLLM, SGLang,
llama.cpp's server) that continues a cut generation from its prefix. Tool requests and the
Responses API (`GenRequest.templated`) are text to both: the built-in backend writes a call of
the calculator tool where it would write `CALC:`, and the relay has the engine render the chat
template and generates a completion (docs/servers.md, "Tools and the Responses API").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any, Protocol

import anyio
import httpx
from rollout_protocol import (
    ErrorCode,
    ProtocolError,
    task_digest,
)

from ..tasks import stable_fraction, task_by_question
from .agent_api import builtin_call
from .common import (
    PEER_SHARDS,
    ShardedClients,
    peer_error,
)
from .generation import (
    CONTINUATION_ENV,
    ContinuationMode,
    GenRequest,
    Piece,
    Progress,
    TokenLogprob,
    ToolSpec,
)

log = logging.getLogger(__name__)


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
TOKEN = re.compile(r"\s*\S+")
"""One token of the built-in backend: a whitespace-led word (also how `usage` counts a prompt)."""


def builtin_completion(
    prompt: str,
    seed: int,
    max_tokens: int,
    mistake_rate: float,
    tools: tuple[ToolSpec, ...] = (),
) -> tuple[list[str], str]:
    """The deterministic completion for (prompt, seed): its tokens and finish reason.

    Tasks from the shipped set are solved by following their calculator steps: one `CALC:` per
    turn until every step's `RESULT:` is in the prompt, then `ANSWER:` with the last result,
    off by one with probability `mistake_rate` (decided per (seed, task), so a whole episode
    makes the same choice on every turn and in every attempt). Other prompts get fluent filler.
    With `tools` offered, the `CALC:` step is a call of the calculator tool (`builtin_call`).
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
            step = task.steps[len(results)]
            call = builtin_call(tools, step) if tools else f"CALC: {step}"
            text = " ".join(words) + f" {call}"
        else:
            value = results[-1] if results else task.answer
            if stable_fraction("mistake", seed, task.id) < mistake_rate:
                value += 1 if stable_fraction("sign", seed, task.id) < 0.5 else -1
            words.append(rng.choice(_CLOSINGS))
            text = " ".join(words) + f" ANSWER: {value}"
    tokens = TOKEN.findall(text)
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
            own = TOKEN.findall(cont.prefix)
            whole, _ = builtin_completion(
                cont.prompt_text, request.seed, len(own) + max_tokens, self.mistake_rate
            )
            if "".join(own) == cont.prefix and whole[: len(own)] == own:
                prompt, max_tokens, produced = (
                    cont.prompt_text,
                    len(own) + max_tokens,
                    produced + len(own),
                )
        tokens, reason = builtin_completion(
            prompt, request.seed, max_tokens, self.mistake_rate, request.tools
        )
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
        self._rendered: OrderedDict[str, str] = OrderedDict()

    async def stream(self, request: GenRequest, progress: Progress) -> AsyncGenerator[Piece, None]:
        if request.templated is not None:
            async for piece in self.stream(await self._as_completion(request), progress):
                yield piece
            return
        if request.kind == "chat":
            async for piece in self._chat(request, progress):
                yield piece
            return
        wanted = wanted_logprobs(request)
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

    async def _as_completion(self, request: GenRequest) -> GenRequest:
        """A tool request (or a Responses request) as the completion of its rendered prompt,
        with the request's sampling fields: it then continues from token ids as completions
        do, and the caller parses the calls out of the text."""
        assert request.templated is not None
        prompt = await self._render(request, request.templated)
        body = {k: v for k, v in request.body.items() if k in _SAMPLING}
        body.update(prompt=prompt, max_tokens=request.max_tokens)
        return GenRequest(
            kind="completion",
            body=body,
            prompt_text=prompt,
            max_tokens=request.max_tokens,
            seed=request.seed,
            stream=True,
        )

    async def _render(self, request: GenRequest, chat: dict[str, Any]) -> str:
        """The prompt the engine's chat template makes of `chat` (llama.cpp's
        `/apply-template`, which takes a chat body, tools included)."""
        digest = task_digest(chat | {"model": request.body.get("model")})
        if digest in self._rendered:
            self._rendered.move_to_end(digest)
            return self._rendered[digest]
        body = dict(chat)
        if request.body.get("model") is not None:
            body["model"] = request.body["model"]
        path = self.base + "/apply-template"
        response = await self._clients.for_key(request.digest).post(path, json=body)
        prompt = None
        if response.status_code == 200:
            with contextlib.suppress(ValueError):
                reply = response.json()
                prompt = reply.get("prompt") if isinstance(reply, dict) else None
        if not isinstance(prompt, str):
            error = peer_error(path, response)
            raise ProtocolError(
                ErrorCode.UNSUPPORTED if response.status_code == 404 else error.code,
                f"tool requests and the Responses API need the engine to render its chat "
                f"template (llama.cpp's /apply-template): {error}",
            )
        self._rendered[digest] = prompt
        while len(self._rendered) > 1024:
            self._rendered.popitem(last=False)
        return prompt

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


_SAMPLING = frozenset(
    {
        "model",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
    }
)
"""The fields of a tool request that its rendered completion keeps (the rest are chat's)."""


def derived_seed(seed: int, seed_key: str, position: int) -> int:
    """The seed of the token at `position` of a generation (31 bits, as every engine takes)."""
    digest = hashlib.sha256(f"{seed}\x00{seed_key}\x00{position}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _temperature(request: GenRequest) -> float | None:
    value = request.body.get("temperature")
    return float(value) if isinstance(value, int | float) else None


def wanted_logprobs(request: GenRequest) -> int | None:
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
