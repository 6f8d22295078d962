"""The model server's agent APIs without a server: request mapping (chat tool bodies and
Responses input items), the parser of the model's tool calls (fed whole and in pieces, which
must agree), the response writers, and the built-in backend's tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_protocol import ProtocolError
from rollout_servers.servers.agent_api import (
    ArgsDelta,
    CallStart,
    ChatStream,
    ResponsesStream,
    TextDelta,
    ToolCallParser,
    builtin_prompt,
    chat_generation,
    chat_reply,
    responses_generation,
    responses_messages,
    responses_reply,
)
from rollout_servers.servers.backends import TOKEN, builtin_completion
from rollout_servers.servers.generation import (
    ChatBody,
    Done,
    GenRequest,
    Piece,
    ResponsesBody,
    ToolSpec,
)
from rollout_servers.servers.model import capture_identity
from rollout_servers.tasks import calculate, shipped_tasks

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CALL_TEXT = (
    'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}'
    "\n</tool_call>"
)


def _feed_in_pieces(text: str, size: int, *, enabled: bool = True) -> ToolCallParser:
    parser = ToolCallParser("p", enabled=enabled)
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert content == parser.content
    for index, call in enumerate(parser.calls):
        args = "".join(e.text for e in events if isinstance(e, ArgsDelta) and e.index == index)
        assert args == call.arguments, "the deltas add up to the call's arguments"
        starts = [e for e in events if isinstance(e, CallStart) and e.index == index]
        assert starts == [CallStart(index, call.call_id, call.name)]
    return parser


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_parser_gives_the_same_calls_however_the_text_is_cut(size: int) -> None:
    text = (
        CALL_TEXT
        + ' And another: <tool_call>{"arguments": {"x": [1, {"y": 2}]}, '
        + ('"name": "lookup"}</tool_call> done.')
    )
    parser = _feed_in_pieces(text, size)
    assert parser.content == "Let me compute.And another:done."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("calculator", {"expression": "12*7"}),
        ("lookup", {"x": [1, {"y": 2}]}),
    ]
    assert [c.call_id for c in parser.calls] == ["call_p_0", "call_p_1"]


def test_parser_streams_arguments_before_the_call_closes() -> None:
    parser = ToolCallParser("p")
    events = parser.feed('<tool_call>{"name": "calculator", "arguments": {"expression": "12')
    assert events[0] == CallStart(0, "call_p_0", "calculator")
    assert events[1:] == [ArgsDelta(0, '{"expression": "12')]
    assert parser.feed('*7"}') == [ArgsDelta(0, '*7"')], "a brace that may close the call waits"
    assert parser.feed("}") == [ArgsDelta(0, "}")]
    assert parser.feed("</tool_call>") == []
    assert parser.calls[0].arguments == '{"expression": "12*7"}'


def test_parser_without_tools_and_with_broken_calls_gives_text() -> None:
    assert _feed_in_pieces(CALL_TEXT, 4, enabled=False).content == CALL_TEXT
    broken = "a <tool_call>not json</tool_call> b"
    parsed = _feed_in_pieces(broken, 3)
    assert parsed.calls == []
    assert parsed.content == "a<tool_call>not json</tool_call> b"
    cut_short = '<tool_call>{"name": "calculator", "arguments": {"expression": "1'
    short = _feed_in_pieces(cut_short, 5)
    assert short.calls[0].arguments == '{"expression": "1', "a call cut by length stays partial"
    plain = "no tags here, a < b and c</tool"
    assert _feed_in_pieces(plain, 2).content == plain


def _chat(body: dict[str, Any]) -> GenRequest:
    return chat_generation(ChatBody.model_validate(body))


def test_chat_tool_request_mapping() -> None:
    gen = _chat(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is 12*7?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": '{"x":"12*7"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "84"},
            ],
            "tools": [CALCULATOR],
            "max_completion_tokens": 40,
        }
    )
    assert gen.kind == "chat"
    assert gen.max_tokens == 40
    assert gen.tools == (ToolSpec("calculator", "expression"),)
    assert gen.templated is not None
    messages = gen.templated["messages"]
    assert messages[0] == {"role": "user", "content": "What is 12*7?"}
    assert messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert messages[2] == {"role": "tool", "content": "84", "tool_call_id": "c1"}
    assert gen.templated["tools"] == [CALCULATOR]
    assert gen.prompt_text.splitlines()[-1] == "tool: RESULT: 84"
    assert '<tool_call> {"name": "calculator"' in gen.prompt_text
    none = _chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [CALCULATOR],
            "tool_choice": "none",
        }
    )
    assert none.tools == ()
    assert none.templated is not None
    assert "tools" not in none.templated


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ({"messages": [{"role": "tool", "content": "84"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "content is required"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [CALCULATOR],
                "tool_choice": {"type": "function", "function": {"name": "search"}},
            },
            "not among the tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "needs"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            "pattern",
        ),
    ],
)
def test_chat_refuses_bad_tool_bodies(body: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        ChatBody.model_validate(body)


def test_auto_tool_choice_without_tools_is_a_plain_chat() -> None:
    """As clients that always send `tool_choice: "auto"` do: no tools, nothing to parse."""
    body = ChatBody.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", "tools": []}
    )
    assert not body.uses_tools


def test_responses_input_items_become_chat_messages() -> None:
    body = ResponsesBody.model_validate(
        {
            "instructions": "Use the calculator.",
            "input": [
                {"role": "user", "content": "What is 12*7?"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "calculator",
                    "arguments": '{"expression": "12*7"}',
                },
                {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "84"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "0"}],
                },
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "Answer now."}],
                },
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "calculator",
                    "parameters": CALCULATOR["function"]["parameters"],
                }
            ],
            "max_output_tokens": 30,
        }
    )
    messages = responses_messages(body)
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "system"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[4]["content"] == "0"
    gen = responses_generation(body)
    assert gen.kind == "responses"
    assert gen.max_tokens == 30
    assert gen.tools == (ToolSpec("calculator", "expression"),)
    assert gen.templated is not None
    assert gen.templated["tools"][0]["function"]["name"] == "calculator"
    assert responses_messages(ResponsesBody(input="hi")) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"input": [{"type": "web_search_call"}]}, "input.0: item type 'web_search_call'"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0: role must be"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "only text"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "output"),
        ({"input": [{"role": "system", "content": "x"}]}, "no message to answer"),
    ],
)
def test_responses_refuse_bad_items(body: dict[str, Any], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        responses_messages(ResponsesBody.model_validate(body))


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "function"),
        ({"input": []}, "must not be empty"),
    ],
)
def test_responses_refuse_bad_bodies(body: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        ResponsesBody.model_validate(body)


def _events(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for block in lines:
        kind, data = block.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_streamed_and_plain_responses_say_the_same() -> None:
    gen = _chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALCULATOR]})
    done = Done(CALL_TEXT, "stop", 20)
    plain = chat_reply(gen, done, "id", 1, "m", {})
    message = plain["choices"][0]["message"]
    assert plain["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me compute."
    call = message["tool_calls"][0]
    assert (call["type"], call["function"]["name"]) == ("function", "calculator")
    assert json.loads(call["function"]["arguments"]) == {"expression": "12*7"}

    chat = ChatStream(gen, "id", 1, "m")
    lines = chat.start()
    for token in TOKEN.findall(CALL_TEXT):
        lines += chat.piece(Piece(token))
    lines += chat.done(done)
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me compute."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or ()]
    assert calls[0]["id"] == call["id"]
    assert calls[0]["function"]["name"] == "calculator"
    assert "".join(tc["function"]["arguments"] for tc in calls) == call["function"]["arguments"]
    assert len(calls) > 2, "the arguments stream in pieces"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    rgen = responses_generation(
        ResponsesBody.model_validate(
            {"input": "x", "tools": [{"type": "function", "name": "calculator"}]}
        )
    )
    response = responses_reply(rgen, done, "resp_1", 1, "m")
    assert response["status"] == "completed"
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["output"][0]["content"][0]["text"] == "Let me compute."
    assert response["output"][1]["arguments"] == call["function"]["arguments"]
    stream = ResponsesStream(rgen, "resp_1", 1, "m")
    lines = stream.start()
    for token in TOKEN.findall(CALL_TEXT):
        lines += stream.piece(Piece(token))
    lines += stream.done(done)
    events = _events(lines)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in (
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",
        "response.function_call_arguments.done",
    ):
        assert kind in kinds
    args = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert args == call["function"]["arguments"]
    assert events[-1]["response"]["output"] == response["output"]
    cut = ResponsesStream(rgen, "resp_1", 1, "m")
    cut.start()
    assert _events(cut.done(Done("abc", "length", 3)))[-1]["type"] == "response.incomplete"


def test_builtin_calls_the_calculator_when_tools_are_offered() -> None:
    task = next(t for t in shipped_tasks() if len(t.steps) == 2)
    tools = (ToolSpec("calculator", "expression"),)
    prompt = builtin_prompt([{"role": "user", "content": task.question}])
    tokens, reason = builtin_completion(prompt, 3, 256, 0.0, tools)
    plain, _ = builtin_completion(prompt, 3, 256, 0.0)
    assert reason == "stop"
    assert plain[-1].strip() == task.steps[0], "without tools: CALC: <step>"
    parser = ToolCallParser("p")
    parser.feed("".join(tokens))
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("calculator", {"expression": task.steps[0]})
    ]
    assert tokens[: len(plain) - 2] == plain[:-2], "the same words before the call"
    # the tool's answer is the calculator's RESULT: the next turn does the next step
    messages = [
        {"role": "user", "content": task.question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {
                        "name": "calculator",
                        "arguments": json.dumps({"expression": task.steps[0]}),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "52"},
    ]
    second, _ = builtin_completion(builtin_prompt(messages), 3, 256, 0.0, tools)
    assert json.dumps({"expression": task.steps[1]}) in "".join(second)
    messages.append({"role": "tool", "tool_call_id": "c", "content": str(task.answer)})
    last, _ = builtin_completion(builtin_prompt(messages), 3, 256, 0.0, tools)
    assert "".join(last).endswith(f"ANSWER: {task.answer}")
    named = (ToolSpec("calc2", "expr"),)
    other, _ = builtin_completion(prompt, 3, 256, 0.0, named)
    assert '{"name": "calc2", "arguments": {"expr":' in "".join(other)


def test_builtin_plays_a_tool_that_takes_a_number_and_answers_json() -> None:
    """NeMo Gym's stateful counter (`increment_counter(count: int)`, answering
    `{"success": true}`): the built-in backend sends each step's value, and reads the JSON
    acknowledgement as the number it sent, so it goes on to the next step."""
    task = next(t for t in shipped_tasks() if len(t.steps) == 2)
    tools = (ToolSpec("increment_counter", "count", integer=True),)
    prompt = builtin_prompt([{"role": "user", "content": task.question}])
    tokens, _ = builtin_completion(prompt, 3, 256, 0.0, tools)
    parser = ToolCallParser("p")
    parser.feed("".join(tokens))
    parser.finish()
    first = calculate(task.steps[0])
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("increment_counter", {"count": first})
    ]
    call = {"id": "c", "type": "function", "function": {"name": "increment_counter"}}
    call["function"]["arguments"] = json.dumps({"count": first})
    messages = [
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": '{"success":true}'},
    ]
    assert builtin_prompt(messages).endswith(f"tool: RESULT: {first}")
    second, _ = builtin_completion(builtin_prompt(messages), 3, 256, 0.0, tools)
    assert json.dumps({"count": calculate(task.steps[1])}) in "".join(second)
    # an answer with a number is read by its first integer; other text as it is
    answered = [*messages[:2], {"role": "tool", "tool_call_id": "c", "content": '{"count": 9}'}]
    assert builtin_prompt(answered).endswith("tool: RESULT: 9")
    text = [*messages[:2], {"role": "tool", "tool_call_id": "c", "content": "no number"}]
    assert builtin_prompt(text).endswith("tool: RESULT: no number")
    # the schema decides: a string parameter still gets the expression
    spec = responses_generation(
        ResponsesBody.model_validate(
            {
                "model": "m",
                "input": "x",
                "tools": [
                    {
                        "type": "function",
                        "name": "t",
                        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
                    }
                ],
            }
        )
    ).tools
    assert spec == (ToolSpec("t", "n", integer=True),)


@pytest.mark.parametrize(
    ("capture_key", "rollout_id", "attempt"),
    [
        ("task-7", "task-7", 0),
        ("task-7-a0", "task-7", 0),
        ("task-7-a12", "task-7", 12),
        ("task-a3-a1", "task-a3", 1),
    ],
)
def test_capture_keys_name_the_episode(capture_key: str, rollout_id: str, attempt: int) -> None:
    gen = _chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALCULATOR]})
    ident = capture_identity(capture_key, gen)
    assert (ident.rollout_id, ident.attempt) == (rollout_id, attempt)
    assert ident.key == f"c-{gen.digest[:32]}", "keyed by content: the same on a re-issue"
    other = _chat({"messages": [{"role": "user", "content": "y"}], "tools": [CALCULATOR]})
    assert capture_identity(capture_key, other).key != ident.key


@pytest.mark.parametrize("capture_key", ["", "bad key", "-a1", "x" * 300])
def test_bad_capture_keys_are_refused(capture_key: str) -> None:
    gen = _chat({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ProtocolError, match="capture key"):
        capture_identity(capture_key, gen)
