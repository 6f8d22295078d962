"""The model role's OpenAI-compatible API, as every model participant of this project reads it
(docs/servers.md, "The model server"): the bounded JSON decoder every request body and every
JSON text held in a string field goes through, and the request bodies it accepts (completions;
chat with tools, tool calls, tool results and text content parts; the Responses API).

The reference model server (`rollout-server model`) and the conformance kit's `FakeModel` both
read their requests with `decode_body`, so a test double refuses a bad request as the real
model does: 422 `invalid_request` in the project's error body, naming the field.

The decoder is pydantic's JSON parser (the one behind every `model_validate_json`): linear in
its input, it stops at `JSON_MAX_DEPTH` levels of nesting and refuses invalid UTF-8 and lone
surrogates, so no decoded text makes Python recurse past its limit or fail to encode later.
A JSON text inside a string (a tool call's `arguments`, a tool's answer) is bounded in size as
well (`JSON_MAX_BYTES`); a body is bounded before it is read (`ROLLOUT_MAX_BODY_BYTES`).
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate
from typing import Any, Final, Literal, TypeVar

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._http import describe_validation
from ._settings import MAX_BODY_BYTES
from ._wire import ErrorCode, ProtocolError

JSON_MAX_DEPTH: Final = 200
"""Levels of nesting the decoder reads (the limit pydantic-core's parser keeps): far more than
any tool's arguments or answer needs, far fewer than would exhaust a stack here or in an
engine."""
JSON_MAX_BYTES: Final = MAX_BODY_BYTES
"""The largest JSON text the decoder reads from a string field (UTF-8 bytes)."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SIGNS = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")
"""Opening brackets to 1, closing ones to -1 (as signed bytes)."""


class JsonOutOfBounds(ValueError):
    """A JSON text larger than `JSON_MAX_BYTES` or nested deeper than `JSON_MAX_DEPTH`."""


def _nesting(data: bytes) -> int:
    """The deepest nesting of brackets outside strings: a linear count, for a text the parser
    refused (was it too deep, or not JSON?)."""
    brackets = _STRING.sub(b"", data).translate(_SIGNS, _NOT_BRACKETS)
    return max(accumulate(array("b", brackets)), default=0)


def decode_json(data: str | bytes, *, max_bytes: int | None = JSON_MAX_BYTES) -> Any:
    """The value of the JSON text `data`, or ValueError saying why there is none:
    `JsonOutOfBounds` when it is larger than `max_bytes` (None: not checked here, a body
    bounded before it was read) or nested deeper than `JSON_MAX_DEPTH`, a plain ValueError
    when it is not JSON (invalid UTF-8 and lone surrogates included)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if max_bytes is not None and len(raw) > max_bytes:
        raise JsonOutOfBounds(f"a JSON text of {len(raw)} bytes is over the limit of {max_bytes}")
    try:
        return pydantic_core.from_json(raw)
    except ValueError as error:
        if _nesting(raw) > JSON_MAX_DEPTH:
            raise JsonOutOfBounds(
                f"JSON nested deeper than {JSON_MAX_DEPTH} levels is refused"
            ) from None
        raise ValueError(f"not JSON: {error}") from None


def json_or_text(text: str) -> Any:
    """A string field that holds JSON or plain text (a tool's answer, arguments as a model
    wrote them, perhaps cut short): its JSON value, or `text` itself when it is not JSON.
    Raises `JsonOutOfBounds` for JSON past the decoder's bounds, which is never text."""
    try:
        return decode_json(text)
    except JsonOutOfBounds:
        raise
    except ValueError:
        return text


_Body = TypeVar("_Body", bound=BaseModel)


def decode_body(raw: bytes, model: type[_Body]) -> _Body:
    """A request body decoded (`decode_json`) and validated as `model`; refused with
    `invalid_request` (422) naming the field (`body` for one that is not a JSON object)."""
    try:
        value = decode_json(raw, max_bytes=None)
    except ValueError as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"body: {error}") from None
    if not isinstance(value, dict):
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"body: a JSON object is required, not {_kind(value)}"
        )
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, describe_validation(error)) from None


def _kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def _bounded(text: str) -> str:
    """A string field that may hold JSON (a call's arguments, a tool's answer): refused when it
    is JSON past the decoder's bounds; plain text (or JSON cut short) is taken as it is."""
    json_or_text(text)
    return text


def _one_choice(n: int | None) -> int | None:
    """`n`: one choice per request, as llama.cpp's server answers (docs/servers.md)."""
    if n is not None and n != 1:
        raise ValueError(
            f"only one choice per request is generated: n must be 1, not {n} (send n requests)"
        )
    return n


# --- the request bodies -----------------------------------------------------------------------


class _OpenAIModel(BaseModel):
    # OpenAI clients send many optional fields; unknown ones are kept and relayed upstream.
    model_config = ConfigDict(extra="allow")


class CompletionBody(_OpenAIModel):
    model: str | None = None
    prompt: str
    max_tokens: int = Field(default=256, ge=1, le=65536)
    seed: int | None = None
    stream: bool = False
    n: int | None = None

    _n = field_validator("n")(_one_choice)


TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
"""A function tool's name, as OpenAI's APIs take it."""


class ContentPart(_OpenAIModel):
    """One part of a message's content array: only text parts are generated from."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type not in ("text", "input_text", "output_text"):
            raise ValueError(f"only text content parts are supported, not {self.type!r}")
        if self.text is None:
            raise ValueError(f"a {self.type!r} part needs its 'text'")
        return self


class FunctionCall(_OpenAIModel):
    name: str = Field(pattern=TOOL_NAME)
    arguments: str
    """The arguments as a JSON text (as the model wrote them, so perhaps cut short)."""

    _arguments = field_validator("arguments")(_bounded)


class ToolCall(_OpenAIModel):
    id: str = Field(min_length=1, max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=200)
    """A `tool` message's answer to this call."""

    @field_validator("content")
    @classmethod
    def _tool_answer(
        cls, content: str | list[ContentPart] | None, info: ValidationInfo
    ) -> str | list[ContentPart] | None:
        """A tool's answer is often JSON, which the built-in backend reads."""
        if info.data.get("role") == "tool" and content is not None:
            _bounded(content if isinstance(content, str) else _joined(content))
        return content

    @model_validator(mode="after")
    def _consistent(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (it may be null only with tool_calls)")
        return self

    @property
    def text(self) -> str:
        """The content as text (parts joined; none: empty)."""
        if isinstance(self.content, list):
            return _joined(self.content)
        return self.content or ""


def _joined(parts: list[ContentPart]) -> str:
    return "".join(part.text or "" for part in parts)


class FunctionDef(_OpenAIModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_OpenAIModel):
    type: Literal["function"]
    function: FunctionDef


ToolChoice = Literal["none", "auto", "required"] | dict[str, Any]


def chosen_tool(choice: dict[str, Any]) -> str:
    """The function a named `tool_choice` forces: chat's `{"type": "function", "function":
    {"name": ...}}` or the Responses API's `{"type": "function", "name": ...}`."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("tool_choice must be none, auto, required or a named function")
    return name


def _check_tool_choice(choice: ToolChoice | None, names: list[str]) -> None:
    if isinstance(choice, dict):
        name = chosen_tool(choice)
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    elif choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")


class ChatBody(_OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=65536)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=65536)
    seed: int | None = None
    stream: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    n: int | None = None

    _n = field_validator("n")(_one_choice)

    @model_validator(mode="after")
    def _tools(self) -> ChatBody:
        _check_tool_choice(self.tool_choice, [t.function.name for t in self.tools or ()])
        return self

    @property
    def uses_tools(self) -> bool:
        """Tools offered, or a conversation with tool calls or results: the model server
        renders and parses these itself (docs/servers.md, "Tools and the Responses API")."""
        return bool(self.tools) or any(
            m.tool_calls is not None or m.role == "tool" for m in self.messages
        )


class ResponsesTool(_OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesBody(_OpenAIModel):
    """`POST /v1/responses`: stateless (the whole conversation is in `input`)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ToolChoice | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=65536)
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    """Refused: the server keeps no conversation (the input is the whole of it)."""

    @model_validator(mode="after")
    def _tools(self) -> ResponsesBody:
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id is not supported: this server keeps no conversation, "
                "send the whole of it as input"
            )
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        n = (self.model_extra or {}).get("n")
        if n is not None and n != 1:
            # not a field of the Responses API: refused rather than ignored, as on chat
            raise ValueError(f"n: the Responses API generates one response, n must be 1: {n!r}")
        _check_tool_choice(self.tool_choice, [t.name for t in self.tools or ()])
        return self
