"""What the policy model server (`model.py`) generates with: one generation's request,
identity and progress, the pieces a backend yields, and a rollout's last delivered response
(docs/servers.md, "The model server"). The OpenAI request bodies it accepts are the SDK's
(`rollout_protocol.model_api`, shared with the conformance kit's fake model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rollout_protocol import (
    EncodedRecord,
    ProtocolError,
    Record,
    encode_record,
    task_digest,
)

# named here too, where code written before their move to the SDK imports them
from rollout_protocol.model_api import ChatBody as ChatBody
from rollout_protocol.model_api import ResponsesBody as ResponsesBody

DELIVERED_KIND = "delivered"
"""The record kind of a rollout's last delivered response."""


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
