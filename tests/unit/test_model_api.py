"""The model role's OpenAI-compatible requests (`rollout_protocol.model_api`): the bounded JSON
decoder, and hostile or careless requests refused with 422 `invalid_request` naming the field,
by the reference model server (in process, built-in backend) and by the conformance kit's
`FakeModel` alike: deep JSON in a body or in a string field that holds JSON (a tool call's
arguments, a tool's answer), streamed too; more than one choice (`n`); bodies of the wrong
shape; lone surrogates."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_protocol import ControlSettings, Role
from rollout_protocol.conformance import FakeModel
from rollout_protocol.model_api import JSON_MAX_DEPTH, JsonOutOfBounds, decode_json, json_or_text
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.model import ModelServer

pytestmark = pytest.mark.unit

DEEP = "[" * 100_000 + "]" * 100_000
"""A JSON text nested 100,000 deep: past any recursion limit."""
CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
ASKED = {"role": "user", "content": "What is 12*7?"}


def _called(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "calculator"}}
    call["function"]["arguments"] = arguments
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@asynccontextmanager
async def _model_server() -> AsyncIterator[httpx.AsyncClient]:
    server = ModelServer(
        ServerOptions(role=Role.MODEL, allow_unauthenticated=True, mistake_rate=0.0), environ={}
    )
    app = server.build_app()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://model") as http:
            yield http


@asynccontextmanager
async def _fake_model(root: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = ControlSettings(role=Role.MODEL, checkpoint_root=root, allow_unauthenticated=True)
    transport = httpx.ASGITransport(app=FakeModel().app(settings), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as http:
        yield http


def _refused(reply: httpx.Response, field: str) -> str:
    """The detail of a 422 `invalid_request` that names `field`."""
    assert reply.status_code == 422, reply.text[:500]
    error = reply.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["detail"].startswith(f"{field}: "), error["detail"]
    detail: str = error["detail"]
    return detail


# --- the decoder ------------------------------------------------------------------------------


def test_the_decoder_reads_what_is_within_its_bounds_and_refuses_the_rest() -> None:
    nested = "[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH
    assert decode_json(nested) is not None
    assert json_or_text('{"expression": "12*7"}') == {"expression": "12*7"}
    assert json_or_text('{"expression": "12*') == '{"expression": "12*', "cut short: text"
    assert json_or_text("RESULT: 84") == "RESULT: 84"
    quoted = '{"log": "' + "[" * 300 + '\\"", broken'  # brackets inside a string are text
    assert json_or_text(quoted) == quoted
    with pytest.raises(JsonOutOfBounds, match=f"deeper than {JSON_MAX_DEPTH}"):
        json_or_text(DEEP)
    with pytest.raises(JsonOutOfBounds, match="over the limit of 10"):
        decode_json("[1, 2, 3, 4]", max_bytes=10)
    with pytest.raises(ValueError, match="not JSON"):
        decode_json('"\\ud800"')  # a lone surrogate: no text that fails to encode later


def test_the_decoder_refuses_hostile_text_in_linear_time() -> None:
    """A megabyte of unclosed strings and brackets is decided at once (the count of brackets
    outside strings that tells deep JSON from text is linear); a generous bound, not a timing."""
    hostile = ('"\\"[' * 250_000) + "[" * 250_000
    started = time.monotonic()
    with pytest.raises(JsonOutOfBounds):
        json_or_text(hostile)
    assert time.monotonic() - started < 20


# --- deep JSON in the agent APIs' string fields -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        pytest.param(
            "/v1/chat/completions",
            {"messages": [ASKED, _called(DEEP)], "tools": [CALCULATOR]},
            "messages.1.tool_calls.0.function.arguments",
            id="chat-arguments",
        ),
        pytest.param(
            "/v1/chat/completions",
            {
                "messages": [
                    ASKED,
                    _called("{}"),
                    {"role": "tool", "tool_call_id": "c1", "content": DEEP},
                ]
            },
            "messages.2.content",
            id="chat-tool-answer",
        ),
        pytest.param(
            "/v1/chat/completions",
            {
                "messages": [
                    ASKED,
                    _called("{}"),
                    {
                        "role": "tool",
                        "tool_call_id": "c1",
                        "content": [{"type": "text", "text": DEEP}],
                    },
                ],
                "stream": True,
            },
            "messages.2.content",
            id="chat-tool-answer-streamed",
        ),
        pytest.param(
            "/v1/responses",
            {
                "input": [
                    {
                        "type": "function_call",
                        "call_id": "c1",
                        "name": "calculator",
                        "arguments": DEEP,
                    }
                ]
            },
            "input.0.arguments",
            id="responses-arguments",
        ),
        pytest.param(
            "/v1/responses",
            {
                "input": [ASKED, {"type": "function_call_output", "call_id": "c1", "output": DEEP}],
                "stream": True,
            },
            "input.1.output",
            id="responses-output-streamed",
        ),
    ],
)
async def test_deep_json_in_a_string_field_is_refused_naming_it(
    path: str, body: dict[str, Any], field: str
) -> None:
    async with _model_server() as http:
        detail = _refused(await http.post(path, json=body), field)
        # the same conversation with its JSON within bounds is answered
        within = await http.post(
            "/v1/chat/completions",
            json={"messages": [ASKED, _called('{"expression": "12*7"}')], "tools": [CALCULATOR]},
        )
    assert f"deeper than {JSON_MAX_DEPTH} levels" in detail
    assert within.status_code == 200, within.text


# --- n: one choice per request ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/chat/completions", {"messages": [ASKED], "n": 3}, id="chat"),
        pytest.param(
            "/v1/chat/completions", {"messages": [ASKED], "n": 3, "stream": True}, id="chat-stream"
        ),
        pytest.param("/v1/completions", {"prompt": "12*7=", "n": 2}, id="completions"),
        pytest.param("/v1/responses", {"input": "What is 12*7?", "n": 2}, id="responses"),
    ],
)
async def test_more_than_one_choice_is_refused_not_dropped(path: str, body: dict[str, Any]) -> None:
    """As llama.cpp's server refuses it: a client that asks for several choices is told, rather
    than answered with one (docs/servers.md)."""
    async with _model_server() as http:
        refused = await http.post(path, json=body)
        one = await http.post(path, json=body | {"n": 1})
    field = "body" if path == "/v1/responses" else "n"  # not a field of the Responses API
    assert "n must be 1" in _refused(refused, field)
    assert one.status_code == 200, one.text


# --- the kit's fake model refuses as the model server does ------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        pytest.param("/v1/chat/completions", b'{"messages": null}', "messages", id="messages-null"),
        pytest.param("/v1/chat/completions", b'{"messages": 5}', "messages", id="messages-5"),
        pytest.param(
            "/v1/completions", b'{"prompt": "2+2? \\ud800"}', "body", id="lone-surrogate-prompt"
        ),
        pytest.param(
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
            "body",
            id="lone-surrogate-message",
        ),
        pytest.param(
            "/v1/chat/completions",
            b'{"messages": ' + DEEP.encode() + b"}",
            "body",
            id="deep-body",
        ),
        pytest.param("/v1/completions", b'{"prompt": "2+2?", "n": 2}', "n", id="n-2"),
        pytest.param("/v1/completions", b"5", "body", id="not-an-object"),
    ],
)
async def test_the_fake_model_refuses_bad_requests_as_the_model_server_does(
    tmp_path: Path, path: str, raw: bytes, field: str
) -> None:
    headers = {"Content-Type": "application/json"}
    async with _fake_model(tmp_path) as fake:
        faked = await fake.post(path, content=raw, headers=headers)
        fine = await fake.post("/v1/completions", json={"prompt": "2+2?"})
    async with _model_server() as http:
        real = await http.post(path, content=raw, headers=headers)
    assert _refused(faked, field) == _refused(real, field)
    assert fine.status_code == 200
