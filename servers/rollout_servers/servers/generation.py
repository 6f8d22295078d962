"""What the policy model server (`model.py`) generates with: the OpenAI request bodies it
accepts (completions; chat with tools, tool calls, tool results and text content parts; the
Responses API), one generation's request, identity and progress, the pieces a backend yields,
and a rollout's last delivered response (docs/servers.md, "The model server").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from rollout_protocol import (
    EncodedRecord,
    ProtocolError,
    Record,
    encode_record,
    task_digest,
)

DELIVERED_KIND = "delivered"
"""The record kind of a rollout's last delivered response."""


class _OpenAIModel(BaseModel):
    # OpenAI clients send many optional fields; unknown ones are kept and relayed upstream.
    model_config = ConfigDict(extra="allow")


class CompletionBody(_OpenAIModel):
    model: str | None = None
    prompt: str
    max_tokens: int = Field(default=256, ge=1, le=65536)
    seed: int | None = None
    stream: bool = False


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
    """The arguments as a JSON text (as the model wrote them)."""


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
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


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
        _check_tool_choice(self.tool_choice, [t.name for t in self.tools or ()])
        return self


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
class ToolSpec:
    """A function tool the model may call: its name and the argument the built-in backend
    fills with its calculation (the first parameter the schema names); `integer` when the
    schema declares that parameter an integer (the backend then writes the step's value, as a
    tool that takes a number needs: NeMo Gym's stateful counter, docs/servers.md)."""

    name: str
    argument: str
    integer: bool = False


@dataclass(frozen=True)
class GenRequest:
    """One generation request, normalised across the OpenAI routes."""

    kind: Literal["completion", "chat", "responses"]
    body: dict[str, Any]
    prompt_text: str
    max_tokens: int
    seed: int
    stream: bool
    continuation: Continuation | None = None
    tools: tuple[ToolSpec, ...] = ()
    """The tools the model may call here (`tool_choice` applied): its output's tool calls are
    parsed out of the text only when there are some."""
    templated: dict[str, Any] | None = None
    """A chat body (`messages`, `tools`) the model server renders with the engine's chat
    template and generates as a completion (tool requests and the Responses API); None: the
    plain routes, relayed as they come."""

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
