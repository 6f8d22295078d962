"""The model server's replies: the OpenAI-compatible bodies and event streams written from the
items a generation sends (completions, chat completions, and through `agent_api.py` tool chats
and the Responses API). The generation itself is in `model.py`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from fastapi.responses import JSONResponse, Response, StreamingResponse
from rollout_protocol import ErrorCode, ProtocolError

from . import agent_api
from .backends import TOKEN, wanted_logprobs
from .generation import Done, Failed, GenRequest, Item, Piece, TokenLogprob


class Replies:
    """Writes each reply of one model server, named by its model name."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    async def write(
        self, gen: GenRequest, receive: MemoryObjectReceiveStream[Item], gone: anyio.Event
    ) -> Response:
        """The reply to `gen` from the items its generation sends on `receive`: one JSON body,
        or an event stream (`gone` is set when its consumer goes away)."""
        created = int(time.time())
        if gen.templated is not None:
            return await self._respond_agent(gen, receive, created, gone)
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

    async def _respond_agent(
        self,
        gen: GenRequest,
        receive: MemoryObjectReceiveStream[Item],
        created: int,
        gone: anyio.Event,
    ) -> Response:
        """A tool chat or a Responses request: its calls parsed out of the generated text."""
        model = self.model_name
        responses = gen.kind == "responses"
        rid = f"resp_{gen.digest[:24]}" if responses else f"chatcmpl-{gen.digest[:24]}"
        if not gen.stream:
            async with receive:
                async for item in receive:
                    if isinstance(item, Failed):
                        raise item.error
                    if isinstance(item, Done):
                        if responses:
                            reply = agent_api.responses_reply(gen, item, rid, created, model)
                        else:
                            usage = self._usage(gen, item)
                            reply = agent_api.chat_reply(gen, item, rid, created, model, usage)
                        return JSONResponse(reply)
            raise ProtocolError(ErrorCode.INTERNAL, "generation ended without a result")
        first = await receive.receive()
        if isinstance(first, Failed):
            await receive.aclose()
            raise first.error

        async def lines() -> AsyncIterator[str]:
            out = agent_api.writer(gen, rid, created, model)
            with _setting(gone):
                async with receive:
                    for line in out.start():
                        yield line
                    item: Item = first
                    while True:
                        if isinstance(item, Failed):
                            written = out.failed(item.error)
                        elif isinstance(item, Done):
                            written = out.done(item)
                        else:
                            written = out.piece(item)
                        for line in written:
                            yield line
                        if not isinstance(item, Piece):
                            return
                        try:
                            item = await receive.receive()
                        except anyio.EndOfStream:
                            return

        return StreamingResponse(lines(), media_type="text/event-stream")

    @staticmethod
    def _usage(gen: GenRequest, done: Done) -> dict[str, int]:
        prompt = len(TOKEN.findall(gen.prompt_text))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done.tokens,
            "total_tokens": prompt + done.tokens,
        }

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
                if logprobs is not None and wanted_logprobs(gen) is not None
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
            "model": self.model_name,
            "choices": [choice],
        }

    def _full_reply(self, gen: GenRequest, done: Done, rid: str, created: int) -> dict[str, Any]:
        usage = {
            "prompt_tokens": len(TOKEN.findall(gen.prompt_text)),
            "completion_tokens": done.tokens,
            "total_tokens": len(TOKEN.findall(gen.prompt_text)) + done.tokens,
        }
        if gen.kind == "completion":
            choice: dict[str, Any] = {
                "index": 0,
                "text": done.text,
                "logprobs": _logprobs_json(done.logprobs)
                if done.logprobs is not None and wanted_logprobs(gen) is not None
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
            "model": self.model_name,
            "choices": [choice],
            "usage": usage,
        }


def _logprobs_json(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The completions API's (legacy) logprobs object."""
    return {
        "tokens": [t for t, _ in logprobs],
        "token_logprobs": [lp for _, lp in logprobs],
        "top_logprobs": None,
        "text_offset": None,
    }


@contextlib.contextmanager
def _setting(event: anyio.Event) -> Iterator[None]:
    """Set `event` however the block ends (the stream finished, failed or was cancelled)."""
    try:
        yield
    finally:
        event.set()
