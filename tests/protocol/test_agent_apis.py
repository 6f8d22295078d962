"""The model server's agent APIs through the official `openai` client, against a real model
server process (built-in backend): chat completions with tools and the Responses API, streamed
and not, solving a shipped task with the calculator as a tool; identity from the
`/ng-rollout/<capture key>/` URL prefix; a checkpoint cut inside a tool call's arguments,
continued after a resume and, across a crash, after a restore under the next attempt; and bad
input refused with clear 4xx errors. The engine relay is in `test_engine_agent_apis.py`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import openai
import pytest
from rollout_protocol import (
    Coordinator,
    EpisodeId,
    HttpParticipantClient,
    Record,
    Role,
    checkpoint_base,
    read_records,
)
from rollout_servers.tasks import calculate, shipped_tasks
from testsupport.server_processes import SET_NAME, TOKEN, Debug, ServerProcess, deadline

pytestmark = pytest.mark.protocol

CALCULATOR: Any = {
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
RESPONSES_CALCULATOR: Any = {"type": "function", **CALCULATOR["function"]}
TASK = next(t for t in shipped_tasks() if len(t.steps) == 2)
SEED = 5


def _model(root: Path, *, attempt: int = 0) -> ServerProcess:
    return ServerProcess.start(
        root, Role.MODEL, "--mistake-rate", "0", "--debug-hooks", attempt=attempt
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _model(tmp_path_factory.mktemp("agent-model"))
    try:
        yield server
    finally:
        server.stop()


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)


async def chat_turn(
    client: openai.AsyncOpenAI, messages: list[Any], *, stream: bool, key: str | None = None
) -> tuple[str, list[dict[str, Any]], str]:
    """One chat turn with the calculator offered: (content, tool calls, finish reason)."""
    headers = {"X-Rollout-Request": key} if key else None
    if not stream:
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=[CALCULATOR], seed=SEED, extra_headers=headers
        )
        message = reply.choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or ()]
        return message.content or "", calls, reply.choices[0].finish_reason
    content, calls, reason = "", [], ""
    chunks = await client.chat.completions.create(
        model="m",
        messages=messages,
        tools=[CALCULATOR],
        seed=SEED,
        stream=True,
        extra_headers=headers,
    )
    async for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.index == len(calls):
                calls.append(
                    {
                        "id": delta.id,
                        "type": "function",
                        "function": {"name": delta.function.name, "arguments": ""},
                    }
                )
            calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_chat_with_tools_solves_a_task(model: ServerProcess, stream: bool) -> None:
    """The openai client runs the tool loop: the model calls the calculator for each step,
    the tool messages carry the results, and the last turn answers."""
    messages: list[Any] = [{"role": "user", "content": TASK.question}]
    steps = []
    async with _client(model.url + "/v1") as client:
        for _ in range(len(TASK.steps) + 1):
            content, calls, reason = await chat_turn(client, messages, stream=stream)
            if not calls:
                break
            assert reason == "tool_calls"
            assert [c["function"]["name"] for c in calls] == ["calculator"]
            expression = json.loads(calls[0]["function"]["arguments"])["expression"]
            steps.append(expression)
            messages.append({"role": "assistant", "content": content or None, "tool_calls": calls})
            result = [{"type": "text", "text": str(calculate(expression))}]
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": result})
    assert steps == TASK.steps
    assert reason == "stop"
    assert content.endswith(f"ANSWER: {TASK.answer}")


async def responses_turn(
    client: openai.AsyncOpenAI, items: list[Any], *, stream: bool
) -> tuple[list[dict[str, Any]], str]:
    """One Responses turn with the calculator offered: the output items and the status."""
    if not stream:
        response = await client.responses.create(
            model="m", input=items, tools=[RESPONSES_CALCULATOR], extra_body={"seed": SEED}
        )
        return [item.model_dump() for item in response.output], str(response.status)
    async with client.responses.stream(
        model="m", input=items, tools=[RESPONSES_CALCULATOR], extra_body={"seed": SEED}
    ) as events:
        kinds = [event.type async for event in events]
        final = await events.get_final_response()
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    return [item.model_dump() for item in final.output], str(final.status)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_responses_api_solves_a_task(model: ServerProcess, stream: bool) -> None:
    items: list[Any] = [{"role": "user", "content": TASK.question}]
    steps = []
    async with _client(model.url + "/v1") as client:
        for _ in range(len(TASK.steps) + 1):
            output, status = await responses_turn(client, items, stream=stream)
            assert status == "completed"
            calls = [item for item in output if item["type"] == "function_call"]
            if not calls:
                break
            expression = json.loads(calls[0]["arguments"])["expression"]
            steps.append(expression)
            items += [{k: calls[0][k] for k in ("type", "call_id", "name", "arguments")}]
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": calls[0]["call_id"],
                    "output": str(calculate(expression)),
                }
            )
    assert steps == TASK.steps
    text = output[-1]["content"][0]["text"]
    assert output[-1]["type"] == "message"
    assert text.endswith(f"ANSWER: {TASK.answer}")


async def test_streamed_responses_events(model: ServerProcess) -> None:
    """The raw event stream: function call arguments arrive as deltas that add up to the call
    in `response.completed`, every event in order (`sequence_number`)."""
    async with _client(model.url + "/v1") as client:
        stream = await client.responses.create(
            model="m",
            input=TASK.question,
            tools=[RESPONSES_CALCULATOR],
            stream=True,
            extra_body={"seed": SEED},
        )
        events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2
    completed = events[-1]
    assert completed.type == "response.completed"
    call = completed.response.output[-1]
    assert call.type == "function_call"
    assert "".join(d.delta for d in deltas) == call.arguments
    assert json.loads(call.arguments) == {"expression": TASK.steps[0]}
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(texts) == completed.response.output[0].content[0].text


def generation_record(root: Path, checkpoint_id: str) -> Record:
    """The one generation record a model server's checkpoint holds."""
    base = checkpoint_base(root / "checkpoints", SET_NAME, checkpoint_id)
    records = [
        record
        for directory in base.iterdir()
        if directory.is_dir()
        for record in read_records(directory, expect_checkpoint_id=checkpoint_id)[1]
        if record.kind == "generation"
    ]
    assert len(records) == 1, records
    return records[0]


async def _streamed_call(base_url: str, messages: list[Any]) -> tuple[str, str]:
    """A streamed chat turn through the client: (content, the call's arguments)."""
    async with _client(base_url) as client:
        content, calls, _ = await chat_turn(client, messages, stream=True)
    return content, calls[0]["function"]["arguments"]


async def _cut_in_arguments(
    http: httpx.AsyncClient, url: str, rollout_id: str, k: int, checkpoint_id: str
) -> tuple[str, str] | None:
    """Stream a chat turn of `rollout_id` (named by the URL prefix) and hold it before token k,
    checkpoint it there, SIGKILL-free resume; return what the client read."""
    hooks = Debug(http, url)
    await hooks.arm("token", rollout_id, index=k)
    got: list[tuple[str, str]] = []
    messages = [{"role": "user", "content": TASK.question}]
    async with HttpParticipantClient(Role.MODEL, url, token=TOKEN) as participant:
        coordinator = Coordinator([participant])

        async def generate() -> None:
            got.append(await _streamed_call(f"{url}/ng-rollout/{rollout_id}/v1", messages))

        async with anyio.create_task_group() as group:
            group.start_soon(generate)
            await hooks.paused("token", rollout_id)
            prepared = await coordinator.prepare(checkpoint_id, deadline(30), scope=[rollout_id])
            assert prepared.episodes == [EpisodeId(rollout_id=rollout_id, attempt=0)]
            await hooks.release("token", rollout_id)
            commit = await coordinator.commit(checkpoint_id, deadline(30), prepared.scope())
            assert commit.ok, commit.failures
            assert not (await coordinator.resume(checkpoint_id, deadline(30))).failures
    return got[0]


async def test_cut_inside_a_tool_call_continues(tmp_path: Path) -> None:
    """A checkpoint cuts a streamed chat turn (episode named by the URL prefix) inside the
    call's arguments; after the resume the client gets the uncut turn. Then a cut one is
    recorded, the server dies, and a fresh one restored under attempt 1 continues the
    re-issued request (`/ng-rollout/<rollout>-a1/`) to the same call."""
    messages = [{"role": "user", "content": TASK.question}]
    root = tmp_path / "model"
    server = await anyio.to_thread.run_sync(lambda: _model(root))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            uncut = await _streamed_call(server.url + "/v1", messages)
            reply = await http.post(
                server.url + "/v1/chat/completions",
                json={"messages": messages, "tools": [CALCULATOR], "seed": SEED},
            )
            tokens = reply.json()["usage"]["completion_tokens"]
            k = tokens - 2  # after `{"expression":`, before the expression and the close tag
            got = await _cut_in_arguments(http, server.url, "agent-cut", k, "agent-cut-1")
            assert got == uncut
            cut = generation_record(root, "agent-cut-1").data["state"]
            assert cut["tokens"] == k
            assert cut["text"].endswith(
                '<tool_call> {"name": "calculator", "arguments": {"expression":'
            )
            stats = (await http.get(server.url + "/stats")).json()
            assert stats["counters"]["0"]["cuts"] == 1
            # the cut recorded, then the crash
            hooks = Debug(http, server.url)
            await hooks.arm("token", "agent-crash", index=k)
            async with HttpParticipantClient(Role.MODEL, server.url, token=TOKEN) as participant:
                coordinator = Coordinator([participant])
                async with anyio.create_task_group() as group:

                    async def doomed() -> None:
                        with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
                            await _streamed_call(
                                server.url + "/ng-rollout/agent-crash/v1", messages
                            )

                    group.start_soon(doomed)
                    await hooks.paused("token", "agent-crash")
                    prepared = await coordinator.prepare(
                        "agent-crash-1", deadline(30), scope=["agent-crash"]
                    )
                    await hooks.release("token", "agent-crash")
                    commit = await coordinator.commit(
                        "agent-crash-1", deadline(30), prepared.scope()
                    )
                    assert commit.ok, commit.failures
                    server.process.kill()
    finally:
        await anyio.to_thread.run_sync(server.stop)
    second = await anyio.to_thread.run_sync(lambda: _model(root, attempt=1))
    try:
        async with aiohttp.ClientSession() as session, httpx.AsyncClient(timeout=60) as http:
            coordinator = Coordinator(
                [HttpParticipantClient(Role.MODEL, second.url, token=TOKEN, client=session)]
            )
            restored = await coordinator.restore("agent-crash-1", 1, deadline(30))
            assert restored.ok, restored.failures
            assert not (await coordinator.resume("agent-crash-1", deadline(30))).failures
            again = await _streamed_call(second.url + "/ng-rollout/agent-crash-a1/v1", messages)
            stats = (await http.get(second.url + "/stats")).json()
    finally:
        await anyio.to_thread.run_sync(second.stop)
    assert again == uncut
    assert stats["counters"]["1"]["cuts_continued"] == 1


async def _sse_lines(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[str]:
    async with http.stream("POST", url, json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            yield line


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        ("/v1/responses", {"input": "x", "previous_response_id": "r"}, "previous_response_id"),
        ("/v1/responses", {"input": [{"type": "computer_call"}]}, "item type 'computer_call'"),
        ("/v1/responses", {"input": "x", "tools": [{"type": "file_search"}]}, "tools.0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "only text content parts",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1"}]}, "tool_call_id"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [CALCULATOR],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "not among the tools",
        ),
        (
            "/ng-rollout/bad key!/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}]},
            "capture key",
        ),
    ],
)
async def test_bad_agent_requests_are_refused(
    model: ServerProcess, path: str, body: dict[str, Any], problem: str
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(model.url + path, json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["code"] == "invalid_request"
    assert problem in reply.json()["error"]["detail"]


async def test_client_sees_a_refusal_as_an_error(model: ServerProcess) -> None:
    """The client raises on a refusal; the project's error body (`code`, `detail`) is its
    `body` (docs/servers.md)."""
    async with _client(model.url + "/v1") as client:
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            await client.responses.create(model="m", input="x", previous_response_id="resp_1")
    body: Any = refused.value.body
    assert body["code"] == "invalid_request"
    assert "previous_response_id is not supported" in body["detail"]


async def test_plain_chat_is_unchanged(model: ServerProcess) -> None:
    """Without tools, chat and its stream are as before: no tool parsing, the same text."""
    body = {"messages": [{"role": "user", "content": TASK.question}], "seed": SEED}
    async with httpx.AsyncClient(timeout=30) as http:
        reply = (await http.post(model.url + "/v1/chat/completions", json=body)).json()
        streamed = ""
        async for line in _sse_lines(
            http, model.url + "/v1/chat/completions", body | {"stream": True}
        ):
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                assert delta["role"] == "assistant"
                streamed += delta["content"]
    text = reply["choices"][0]["message"]["content"]
    assert text.endswith(f"CALC: {TASK.steps[0]}")
    assert streamed == text
    assert "tool_calls" not in reply["choices"][0]["message"]


async def _responses_call(base_url: str) -> list[dict[str, Any]]:
    """A plain Responses turn with the calculator: its output items."""
    async with _client(base_url) as client:
        response = await client.responses.create(
            model="m", input=TASK.question, tools=[RESPONSES_CALCULATOR], extra_body={"seed": SEED}
        )
    return [item.model_dump() for item in response.output]


async def test_held_function_call_is_delivered_after_a_restore(tmp_path: Path) -> None:
    """A Responses turn whose function call finished while a checkpoint was open is held and
    recorded whole; after a crash and a restore under attempt 1 the re-issued request gets the
    same output items (the same call id) at once, generating nothing."""
    root = tmp_path / "model"
    server = await anyio.to_thread.run_sync(lambda: _model(root))
    try:
        uncut = await _responses_call(server.url + "/v1")
        assert uncut[-1]["type"] == "function_call"
        async with httpx.AsyncClient(timeout=60) as http:
            hooks = Debug(http, server.url)
            await hooks.arm("finish", "held")
            async with HttpParticipantClient(Role.MODEL, server.url, token=TOKEN) as participant:
                coordinator = Coordinator([participant])
                async with anyio.create_task_group() as group:

                    async def doomed() -> None:
                        with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
                            await _responses_call(server.url + "/ng-rollout/held/v1")

                    group.start_soon(doomed)
                    await hooks.paused("finish", "held")
                    prepared = await coordinator.prepare("held-1", deadline(30), scope=["held"])
                    await hooks.release("finish", "held")
                    await hooks.reached("held", "held")
                    commit = await coordinator.commit("held-1", deadline(30), prepared.scope())
                    assert commit.ok, commit.failures
                    server.process.kill()
    finally:
        await anyio.to_thread.run_sync(server.stop)
    held = generation_record(root, "held-1").data
    assert held["step"] == "deliver", "recorded whole, to deliver"
    assert held["state"]["text"].endswith("</tool_call>")
    second = await anyio.to_thread.run_sync(lambda: _model(root, attempt=1))
    try:
        async with aiohttp.ClientSession() as session, httpx.AsyncClient(timeout=60) as http:
            coordinator = Coordinator(
                [HttpParticipantClient(Role.MODEL, second.url, token=TOKEN, client=session)]
            )
            restored = await coordinator.restore("held-1", 1, deadline(30))
            assert restored.ok, restored.failures
            assert not (await coordinator.resume("held-1", deadline(30))).failures
            again = await _responses_call(second.url + "/ng-rollout/held-a1/v1")
            stats = (await http.get(second.url + "/stats")).json()
    finally:
        await anyio.to_thread.run_sync(second.stop)
    assert again == uncut
    assert stats["counters"]["1"]["held_restored"] == 1
    assert stats["tokens"].get("1", {}).get("total", 0) == 0, "nothing generated again"


async def test_relay_to_an_engine_without_a_chat_template_refuses_tools(
    model: ServerProcess, tmp_path: Path
) -> None:
    """The relay renders tool requests with the engine's `/apply-template`; an upstream without
    it (here the built-in model server) makes them 501 `unsupported`, saying why, while plain
    chat still relays."""
    relay = await anyio.to_thread.run_sync(
        lambda: ServerProcess.start(
            tmp_path / "relay", Role.MODEL, "--backend", "openai", "--upstream-url", model.url
        )
    )
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            messages = [{"role": "user", "content": TASK.question}]
            tools = await http.post(
                relay.url + "/v1/chat/completions",
                json={"messages": messages, "tools": [CALCULATOR]},
            )
            responses = await http.post(relay.url + "/v1/responses", json={"input": "hi"})
            plain = await http.post(relay.url + "/v1/chat/completions", json={"messages": messages})
    finally:
        await anyio.to_thread.run_sync(relay.stop)
    for refused in (tools, responses):
        assert refused.status_code == 501, refused.text
        assert refused.json()["error"]["code"] == "unsupported"
        assert "/apply-template" in refused.json()["error"]["detail"]
    assert plain.status_code == 200
