"""The agent APIs of the policy model server (docs/servers.md, "Tools and the Responses API"):
chat completions with tools and the Responses API, mapped onto the same generation machinery
as plain completions.

A tool request is generated as *text*: the conversation (messages, tool calls, tool results)
and the tools are rendered with the engine's chat template (the relay) or as the built-in
backend's prompt, and the model writes its calls in the Hermes style most open models use
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). The generation's record holds
that text and its token ids, so a checkpoint cuts a call like any text, inside its arguments
too, and the continuation goes on from the ids. The calls are parsed out of the text only when
a response is written: `ToolCallParser` turns the text, piece by piece, into content deltas and
call deltas, the same way for a streamed and a plain response (so both say the same).

This module holds the request mapping (chat tool bodies and Responses input items to one
`GenRequest`), the parser, and the response writers (chat with tool calls, plain and SSE; the
Responses API's response object and its streaming events).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from rollout_protocol import ErrorCode, ProtocolError
from rollout_protocol.model_api import (
    ChatBody,
    ChatMessage,
    JsonOutOfBounds,
    ResponsesBody,
    chosen_tool,
    json_or_text,
)

from ..tasks import CalculatorError, calculate
from .generation import (
    Done,
    GenRequest,
    Piece,
    ToolSpec,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
"""The start of a call whose name comes first: its arguments then stream as they are written."""
DEFAULT_ARGUMENT = "expression"
_TOKEN = re.compile(r"\s*\S+")


# --- requests ---------------------------------------------------------------------------------


def _invalid(where: str, problem: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, f"{where}: {problem}")


def _spec(name: str, parameters: dict[str, Any] | None) -> ToolSpec:
    properties = (parameters or {}).get("properties")
    names = list(properties) if isinstance(properties, dict) else []
    if not names:
        return ToolSpec(name, DEFAULT_ARGUMENT)
    first = properties[names[0]] if isinstance(properties, dict) else None
    integer = isinstance(first, dict) and first.get("type") == "integer"
    return ToolSpec(name, str(names[0]), integer=integer)


def _offered(
    tools: Sequence[tuple[str, dict[str, Any] | None]], choice: str | dict[str, Any] | None
) -> tuple[ToolSpec, ...]:
    """The tools the model may call under `tool_choice`."""
    if choice == "none":
        return ()
    if isinstance(choice, dict):
        name = chosen_tool(choice)
        return tuple(_spec(n, p) for n, p in tools if n == name)
    return tuple(_spec(n, p) for n, p in tools)


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: content parts joined to text."""
    out: dict[str, Any] = {"role": message.role}
    out["content"] = None if message.content is None else message.text
    if message.tool_calls is not None:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def builtin_prompt(messages: Sequence[dict[str, Any]]) -> str:
    """The built-in backend's prompt for a conversation: `role: content` lines, as for a plain
    chat, with calls written as the model writes them and a tool's answer as the `RESULT:` the
    shipped tasks read."""
    lines = []
    sent: dict[str, Any] = {}  # call id -> the call's arguments, for the answers below
    for message in messages:
        text = str(message.get("content") or "")
        if message["role"] == "tool" and "RESULT:" not in text:
            text = f"RESULT: {_tool_result(text, sent.get(str(message.get('tool_call_id'))))}"
        for call in message.get("tool_calls") or ():
            sent[str(call.get("id"))] = json_or_text(call["function"]["arguments"])
        for call in message.get("tool_calls") or ():
            function = call["function"]
            text += f" {CALL_OPEN} " + json.dumps(
                {"name": function["name"], "arguments": json_or_text(function["arguments"])}
            )
            text += f" {CALL_CLOSE}"
        lines.append(f"{message['role']}: {text.strip()}")
    return "\n".join(lines)


def _tool_result(text: str, arguments: Any) -> str:
    """A tool's answer as the built-in backend reads it. Tools of agent frameworks answer JSON
    objects (NeMo Gym's resources servers do): the first integer field of one is the result,
    and an answer without a number (an acknowledgement such as `{"success": true}`) stands for
    the integer the call sent. Anything else is read as it is."""
    answer = json_or_text(text)
    if not isinstance(answer, dict):
        return text
    for value in (*answer.values(), *(arguments.values() if isinstance(arguments, dict) else ())):
        if type(value) is int:
            return str(value)
    return text


def chat_generation(body: ChatBody) -> GenRequest:
    """A chat request with tools, tool calls or tool results."""
    messages = [_message_dict(m) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    offered = _offered(
        [(t.function.name, t.function.parameters) for t in body.tools or ()], body.tool_choice
    )
    templated: dict[str, Any] = {"messages": messages}
    if tools and body.tool_choice != "none":
        templated["tools"] = tools
    return GenRequest(
        kind="chat",
        body=body.model_dump(exclude_none=True),
        prompt_text=builtin_prompt(messages),
        max_tokens=body.max_completion_tokens or body.max_tokens or 256,
        seed=body.seed or 0,
        stream=body.stream,
        tools=offered,
        templated=templated,
    )


def responses_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """The Responses API's input as chat messages: message items, `function_call` items (on an
    assistant message, consecutive calls on one) and `function_call_output` items (tool
    messages). Anything else is refused with the item's place in `input`."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _invalid(where, f"role must be user, assistant, system, developer: {role!r}")
            text = _item_text(item.get("content"), where + ".content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _bounded(_field(item, "arguments", where), where + ".arguments"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = _bounded(_item_text(output, where + ".output"), where + ".output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text}
            )
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing this server generates from
        else:
            raise _invalid(
                where,
                f"item type {kind!r} is not supported "
                "(message, function_call, function_call_output)",
            )
    for i, message in enumerate(messages):
        try:
            ChatMessage.model_validate(message)
        except ValidationError as error:
            raise _invalid(f"input (message {i})", error.errors()[0]["msg"]) from None
    if not any(m["role"] != "system" for m in messages):
        raise _invalid("input", "holds no message to answer")
    return messages


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and name != "arguments"):
        raise _invalid(f"{where}.{name}", "a non-empty string is required")
    return value


def _bounded(text: str, where: str) -> str:
    """A field that may hold JSON (a call's arguments, a tool's answer), refused when it holds
    JSON past the decoder's bounds (`rollout_protocol.model_api`)."""
    try:
        json_or_text(text)
    except JsonOutOfBounds as error:
        raise _invalid(where, str(error)) from None
    return text


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise _invalid(f"{where}.{j}", f"only text parts are supported, not {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid(where, "a string or a list of text parts is required")


def responses_generation(body: ResponsesBody) -> GenRequest:
    messages = responses_messages(body)
    tools = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
        for t in body.tools or ()
    ]
    templated: dict[str, Any] = {"messages": messages}
    if tools and body.tool_choice != "none":
        templated["tools"] = tools
    return GenRequest(
        kind="responses",
        body=body.model_dump(exclude_none=True),
        prompt_text=builtin_prompt(messages),
        max_tokens=body.max_output_tokens or 256,
        seed=body.seed or 0,
        stream=body.stream,
        tools=_offered([(t.name, t.parameters) for t in body.tools or ()], body.tool_choice),
        templated=templated,
    )


def builtin_call(tools: Sequence[ToolSpec], value: str) -> str:
    """How the built-in backend writes a call with `value` (the calculator's `calculator`,
    else the first tool offered), one whitespace-led word per token."""
    tool = next((t for t in tools if t.name == "calculator"), tools[0])
    argument: str | int = value
    if tool.integer:  # a tool that takes a number gets the step's value, not its expression
        with contextlib.suppress(CalculatorError):
            argument = calculate(value)
    call = json.dumps({"name": tool.name, "arguments": {tool.argument: argument}})
    return f"{CALL_OPEN} {call} {CALL_CLOSE}"


# --- parsing the model's calls ----------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


Event = TextDelta | CallStart | ArgsDelta


@dataclass
class Call:
    call_id: str
    name: str
    arguments: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag cut by a piece)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """Content and calls from generated text, fed in pieces: what is certain is given at once,
    what might still be a tag, a call's closing brace or whitespace around a call is held back.
    With `enabled` false (no tools offered) all of the text is content."""

    call_prefix: str
    enabled: bool = True
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    _buffer: str = ""
    _in_call: bool = False
    _args_start: int | None = None
    _sent: int = 0
    _after_call: bool = False

    def feed(self, text: str) -> list[Event]:
        if not self.enabled:
            return self._text(text)
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, CALL_OPEN)
                    head = self._buffer[: len(self._buffer) - keep]
                    certain = head.rstrip()
                    events += self._text(certain)
                    self._buffer = self._buffer[len(certain) :]
                    return events
                events += self._text(self._buffer[:at].rstrip())
                self._buffer = self._buffer[at + len(CALL_OPEN) :]
                self._in_call, self._args_start, self._sent = True, None, 0
                continue
            at = self._buffer.find(CALL_CLOSE)
            if at < 0:
                events += self._head()
                events += self._arguments(final=False)
                return events
            region, self._buffer = self._buffer[:at], self._buffer[at + len(CALL_CLOSE) :]
            events += self._close(region)

    def finish(self) -> list[Event]:
        """What is left at the end of the generation (a call cut short by `length` included)."""
        if not self.enabled:
            return []
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return self._text(rest.strip() if self._after_call else rest)
        self._in_call = False
        if self._args_start is None:
            return self._text(CALL_OPEN + rest)
        tail = rest[self._args_start + self._sent :]
        return self._args(tail)

    def _text(self, text: str) -> list[Event]:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return []
        self._after_call = False
        self.content += text
        return [TextDelta(text)]

    def _head(self) -> list[Event]:
        if self._args_start is not None:
            return []
        match = _CALL_HEAD.match(self._buffer)
        if match is None or match.end() == len(self._buffer):
            return []  # the arguments' first character shows where they start
        name = json.loads(f'"{match.group(1)}"')
        self._args_start = match.end()
        return self._start(name)

    def _start(self, name: str) -> list[Event]:
        call = Call(f"call_{self.call_prefix}_{len(self.calls)}", name)
        self.calls.append(call)
        return [CallStart(len(self.calls) - 1, call.call_id, name)]

    def _arguments(self, *, final: bool, region: str | None = None) -> list[Event]:
        """The arguments written so far, less what may yet be the call's own closing brace."""
        if self._args_start is None:
            return []
        text = (self._buffer if region is None else region)[self._args_start :]
        if not final:
            text = text[: len(text) - _partial_suffix(text, CALL_CLOSE)]
        text = text.rstrip()
        if text.endswith("}"):
            text = text[:-1]
        return self._args(text[self._sent :])

    def _args(self, text: str) -> list[Event]:
        if not text:
            return []
        self._sent += len(text)
        self.calls[-1].arguments += text
        return [ArgsDelta(len(self.calls) - 1, text)]

    def _close(self, region: str) -> list[Event]:
        self._in_call = False
        events: list[Event] = []
        if self._args_start is None:
            match = _CALL_HEAD.match(region)
            if match is not None:
                self._buffer, keep = region, self._buffer
                events += self._head()
                self._buffer = keep
            else:
                try:
                    parsed = json_or_text(region.strip())
                except JsonOutOfBounds:
                    parsed = None  # not a call the model wrote: its text, as it is
                name = parsed.get("name") if isinstance(parsed, dict) else None
                if not isinstance(name, str):
                    return self._text(CALL_OPEN + region + CALL_CLOSE)
                arguments = parsed.get("arguments", {})
                text = arguments if isinstance(arguments, str) else json.dumps(arguments)
                events += self._start(name)
                events += self._args(text)
                self._after_call = True
                return events
        events += self._arguments(final=True, region=region)
        self._after_call = True
        return events


def parse_all(text: str, gen: GenRequest, prefix: str) -> ToolCallParser:
    """A whole generation's content and calls (as a streamed one would give them)."""
    parser = ToolCallParser(prefix, enabled=bool(gen.tools))
    parser.feed(text)
    parser.finish()
    return parser


# --- chat completions with tools --------------------------------------------------------------


def chat_reply(
    gen: GenRequest, done: Done, rid: str, created: int, model: str, usage: dict[str, int]
) -> dict[str, Any]:
    parser = parse_all(done.text, gen, gen.digest[:16])
    message: dict[str, Any] = {"role": "assistant", "content": parser.content}
    if parser.calls:
        message["content"] = parser.content or None
        message["tool_calls"] = [_chat_call(c) for c in parser.calls]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(done, parser)}],
        "usage": usage,
    }


def _chat_call(call: Call) -> dict[str, Any]:
    return {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _finish(done: Done, parser: ToolCallParser) -> str:
    return "tool_calls" if parser.calls and done.finish_reason == "stop" else done.finish_reason


class ChatStream:
    """A chat completion's SSE chunks: content deltas and `tool_calls` deltas (the call's id,
    type and name first, then its arguments in pieces), as OpenAI streams them."""

    def __init__(self, gen: GenRequest, rid: str, created: int, model: str) -> None:
        self.parser = ToolCallParser(gen.digest[:16], enabled=bool(gen.tools))
        self._base = {"id": rid, "object": "chat.completion.chunk", "created": created}
        self._base["model"] = model

    def _chunk(self, delta: dict[str, Any], reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return f"data: {json.dumps(self._base | {'choices': [choice]})}\n\n"

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def piece(self, piece: Piece) -> list[str]:
        return [self._event(e) for e in self.parser.feed(piece.text)]

    def done(self, done: Done) -> list[str]:
        out = [self._event(e) for e in self.parser.finish()]
        out.append(self._chunk({}, _finish(done, self.parser)))
        out.append("data: [DONE]\n\n")
        return out

    def failed(self, error: ProtocolError) -> list[str]:
        return [f"data: {error.body().model_dump_json()}\n\n"]

    def _event(self, event: Event) -> str:
        if isinstance(event, TextDelta):
            return self._chunk({"content": event.text})
        if isinstance(event, CallStart):
            call = {"index": event.index, "id": event.call_id, "type": "function"}
            call["function"] = {"name": event.name, "arguments": ""}
            return self._chunk({"tool_calls": [call]})
        return self._chunk(
            {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        )


# --- the Responses API ------------------------------------------------------------------------


def _responses_usage(gen: GenRequest, tokens: int) -> dict[str, Any]:
    prompt = len(_TOKEN.findall(gen.prompt_text))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + tokens,
    }


def response_object(
    gen: GenRequest,
    rid: str,
    created: int,
    model: str,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    body = gen.body
    tools = [t | {"strict": t.get("strict", False)} for t in body.get("tools") or ()]
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "usage": usage,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def _call_item(item_id: str, call: Call, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def _status(done: Done) -> str:
    return "incomplete" if done.finish_reason == "length" else "completed"


def responses_reply(gen: GenRequest, done: Done, rid: str, created: int, model: str) -> Any:
    """The response object of a finished (plain) Responses request."""
    stream = ResponsesStream(gen, rid, created, model)
    for _ in stream.piece(Piece(done.text)):
        pass
    stream.done(done)
    return stream.final


class ResponsesStream:
    """The Responses API's streaming events, built from the parser's deltas: an output item
    per run of text (`message`) and per call (`function_call`), each added, filled by deltas
    and done in order, between `response.created` and `response.completed` (`incomplete` when
    the generation hit its token limit)."""

    def __init__(self, gen: GenRequest, rid: str, created: int, model: str) -> None:
        self.gen, self.rid, self.created, self.model = gen, rid, created, model
        self.parser = ToolCallParser(gen.digest[:16], enabled=bool(gen.tools))
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}
        self._sequence = 0
        self._open: dict[str, Any] | None = None
        """The item being written: a message (with its text so far) or a call."""
        self._text = ""

    def _event(self, kind: str, **data: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(
            self.gen,
            self.rid,
            self.created,
            self.model,
            status=status,
            output=self.output,
            usage=usage,
        )

    def start(self) -> list[str]:
        response = self._response("in_progress", None) | {"output": []}
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def piece(self, piece: Piece) -> list[str]:
        return self._events(self.parser.feed(piece.text))

    def done(self, done: Done) -> list[str]:
        out = self._events(self.parser.finish())
        out += self._close()
        self.final = self._response(_status(done), _responses_usage(self.gen, done.tokens))
        out.append(self._event(f"response.{_status(done)}", response=self.final))
        return out

    def failed(self, error: ProtocolError) -> list[str]:
        detail = error.body().error
        return [self._event("error", code=detail.code, message=detail.detail, param=None)]

    def _events(self, events: Iterable[Event]) -> list[str]:
        out: list[str] = []
        for event in events:
            if isinstance(event, TextDelta):
                if self._open is None or self._open["type"] != "message":
                    out += self._close()
                    out += self._add(_message_item(self._item_id("msg"), "", "in_progress"))
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    out.append(self._event("response.content_part.added", **self._at(), part=part))
                self._text += event.text
                out.append(
                    self._event(
                        "response.output_text.delta", **self._at(), delta=event.text, logprobs=[]
                    )
                )
            elif isinstance(event, CallStart):
                out += self._close()
                call = self.parser.calls[event.index]
                out += self._add(_call_item(self._item_id("fc"), call, "in_progress"))
            else:
                assert self._open is not None
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self.output),
                        delta=event.text,
                    )
                )
        return out

    def _item_id(self, kind: str) -> str:
        return f"{kind}_{self.gen.digest[:16]}_{len(self.output)}"

    def _at(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output), "content_index": 0}

    def _add(self, item: dict[str, Any]) -> list[str]:
        self._open, self._text = item, ""
        return [self._event("response.output_item.added", output_index=len(self.output), item=item)]

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output)
        out: list[str] = []
        if item["type"] == "message":
            done = _message_item(item["id"], self._text, "completed")
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self._event("response.output_text.done", **at, text=self._text, logprobs=[]))
            out.append(self._event("response.content_part.done", **at, part=done["content"][0]))
        else:
            call = next(c for c in self.parser.calls if c.call_id == item["call_id"])
            done = _call_item(item["id"], call, "completed")
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
        self.output.append(done)
        out.append(self._event("response.output_item.done", output_index=index, item=done))
        return out


Writer = ChatStream | ResponsesStream


def writer(gen: GenRequest, rid: str, created: int, model: str) -> Writer:
    if gen.kind == "responses":
        return ResponsesStream(gen, rid, created, model)
    return ChatStream(gen, rid, created, model)
