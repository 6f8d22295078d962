"""The agent APIs relayed to a real engine (llama.cpp's llama-server serving a tiny model that
answers with a tool call), through the official `openai` client, streamed: chat completions
with tools and the Responses API with a function tool, each cut by a checkpoint in the middle
of the call's arguments and continued token-exactly (chat: across a crash of the relay and a
restore under attempt 1, named by the `/ng-rollout/<capture key>/` URL prefix; Responses:
after a resume). The relay has the engine render its chat template (`/apply-template`) and
generates a completion from token ids, so the uncut reference is the engine's completion of
the rendered prompt, and the call must be the one llama-server itself parses from the same
output. The model's call tokens are ones no merge builds: the prefix's text re-tokenises as
single bytes, after which the model ends the text, so a text-level continuation could not
give the same call (shown too)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import openai
import pytest
from engine_support import TOOL_CALL_TEXT, LlamaServer, ToolModel, write_tool_model
from rollout_protocol import Coordinator, EpisodeId, HttpParticipantClient, Role
from test_agent_apis import CALCULATOR, RESPONSES_CALCULATOR, generation_record
from test_engine_continuation import _binary, relay, stats
from testsupport.server_processes import TOKEN, Debug, ServerProcess, deadline

pytestmark = pytest.mark.protocol

QUESTION = "What is 12 times 7?"
MAX_TOKENS = 32
CALL = {"name": "calculator", "arguments": {"expression": "12*7"}}


@pytest.fixture(scope="module")
def tool_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LlamaServer, ToolModel]]:
    root = tmp_path_factory.mktemp("tool-engine")
    model = write_tool_model(root / "tool.gguf")
    server = LlamaServer.start(_binary(), root / "tool.gguf", root)
    try:
        yield server, model
    finally:
        server.stop()


async def uncut(http: httpx.AsyncClient, engine: LlamaServer) -> tuple[str, list[int], str]:
    """The engine's own answer: the rendered prompt, the completion's ids and text."""
    chat = {"messages": [{"role": "user", "content": QUESTION}], "tools": [CALCULATOR]}
    rendered = await http.post(engine.url + "/apply-template", json=chat)
    assert rendered.status_code == 200, rendered.text
    prompt = str(rendered.json()["prompt"])
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    reply = await http.post(engine.url + "/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return prompt, [int(e["id"]) for e in choice["logprobs"]["content"]], str(choice["text"])


async def engine_parsed_call(http: httpx.AsyncClient, engine: LlamaServer) -> dict[str, Any]:
    """The call llama-server itself parses from the model's output (its chat endpoint)."""
    reply = await http.post(
        engine.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [CALCULATOR],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    )
    assert reply.status_code == 200, reply.text
    function = reply.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    return {"name": function["name"], "arguments": json.loads(function["arguments"])}


def _client(base_url: str, headers: dict[str, str] | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", timeout=60, max_retries=0, default_headers=headers
    )


async def streamed_chat(base_url: str) -> tuple[str, list[dict[str, Any]], str]:
    """A streamed chat turn with the calculator: content, calls (accumulated deltas), reason."""
    content, calls, reason = "", [], ""
    async with _client(base_url) as client:
        chunks = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[CALCULATOR],
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        async for chunk in chunks:
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                assert delta.function is not None
                if delta.index == len(calls):
                    calls.append({"name": delta.function.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


async def test_chat_tool_call_cut_in_its_arguments_continues_after_a_crash(
    tool_engine: tuple[LlamaServer, ToolModel], tmp_path: Path
) -> None:
    engine, model = tool_engine
    k = 7  # the prefix ends `{"expression": "12`: inside the arguments
    async with httpx.AsyncClient(timeout=60) as http:
        prompt, ids, text = await uncut(http, engine)
        assert ids[: len(model.call)] == model.call
        assert text == TOOL_CALL_TEXT
        assert await engine_parsed_call(http, engine) == CALL
        prefix = TOOL_CALL_TEXT[: TOOL_CALL_TEXT.index("12") + 2]
        text_level = await http.post(
            engine.url + "/v1/completions",
            json={"prompt": prompt + prefix, "max_tokens": MAX_TOKENS, "temperature": 0},
        )
        assert prefix + text_level.json()["choices"][0]["text"] != TOOL_CALL_TEXT, (
            "from the prefix's text the model goes on otherwise: only the ids continue it"
        )

    root = tmp_path / "relay"
    first = await anyio.to_thread.run_sync(lambda: relay(root, engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            hooks = Debug(http, first.url)
            await hooks.arm("token", "eng-chat", index=k)
            async with HttpParticipantClient(Role.MODEL, first.url, token=TOKEN) as participant:
                coordinator = Coordinator([participant])

                async def doomed() -> None:
                    with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
                        await streamed_chat(first.url + "/ng-rollout/eng-chat/v1")

                async with anyio.create_task_group() as group:
                    group.start_soon(doomed)
                    await hooks.paused("token", "eng-chat")
                    prepared = await coordinator.prepare("eng-1", deadline(30), scope=["eng-chat"])
                    assert prepared.episodes == [EpisodeId(rollout_id="eng-chat", attempt=0)]
                    await hooks.release("token", "eng-chat")
                    commit = await coordinator.commit("eng-1", deadline(30), prepared.scope())
                    assert commit.ok, commit.failures
                    first.process.kill()
    finally:
        await anyio.to_thread.run_sync(first.stop)
    state = generation_record(root, "eng-1").data["state"]
    assert state["ids"] == ids[:k]
    assert state["text"] == prefix

    second = await anyio.to_thread.run_sync(lambda: relay(root, engine, attempt=1))
    try:
        async with aiohttp.ClientSession() as session, httpx.AsyncClient(timeout=60) as http:
            coordinator = Coordinator(
                [HttpParticipantClient(Role.MODEL, second.url, token=TOKEN, client=session)]
            )
            restored = await coordinator.restore("eng-1", 1, deadline(30))
            assert restored.ok, restored.failures
            assert not (await coordinator.resume("eng-1", deadline(30))).failures
            content, calls, reason = await streamed_chat(second.url + "/ng-rollout/eng-chat-a1/v1")
            relay_stats = await stats(http, second.url)
    finally:
        await anyio.to_thread.run_sync(second.stop)
    assert content == ""
    assert reason == "tool_calls"
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == [CALL]
    counters = relay_stats["counters"]["1"]
    assert counters["cuts_continued"] == 1
    assert counters["continued_token_ids"] == 1
    assert counters.get("continued_text", 0) == 0
    (generated,) = relay_stats["tokens"]["1"]["by_request"].values()
    assert generated == len(ids) - k, "only the rest was generated"


async def test_responses_function_call_cut_in_its_arguments_continues(
    tool_engine: tuple[LlamaServer, ToolModel], tmp_path: Path
) -> None:
    engine, _ = tool_engine
    k = 9  # the prefix ends `{"expression": "12*7`
    async with httpx.AsyncClient(timeout=60) as http:
        _, ids, _ = await uncut(http, engine)
    root = tmp_path / "relay"
    server: ServerProcess = await anyio.to_thread.run_sync(lambda: relay(root, engine))
    headers = {"X-Rollout-Request": "eng-resp/turn-0", "X-Rollout-Attempt": "0"}
    events: list[str] = []
    final: list[Any] = []
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            hooks = Debug(http, server.url)
            await hooks.arm("token", "eng-resp", index=k)

            async def generate() -> None:
                async with (
                    _client(server.url + "/v1", headers) as client,
                    client.responses.stream(
                        model="tiny",
                        input=QUESTION,
                        tools=[RESPONSES_CALCULATOR],
                        temperature=0,
                        max_output_tokens=MAX_TOKENS,
                    ) as stream,
                ):
                    events.extend([event.type async for event in stream])
                    final.append(await stream.get_final_response())

            async with HttpParticipantClient(Role.MODEL, server.url, token=TOKEN) as participant:
                coordinator = Coordinator([participant])
                async with anyio.create_task_group() as group:
                    group.start_soon(generate)
                    await hooks.paused("token", "eng-resp")
                    prepared = await coordinator.prepare("resp-1", deadline(30), scope=["eng-resp"])
                    await hooks.release("token", "eng-resp")
                    commit = await coordinator.commit("resp-1", deadline(30), prepared.scope())
                    assert commit.ok, commit.failures
                    assert not (await coordinator.resume("resp-1", deadline(30))).failures
            relay_stats = await stats(http, server.url)
    finally:
        await anyio.to_thread.run_sync(server.stop)
    assert generation_record(root, "resp-1").data["state"]["ids"] == ids[:k]
    assert events[0] == "response.created"
    assert events[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in events
    (response,) = final
    (call,) = response.output
    assert call.type == "function_call"
    assert {"name": call.name, "arguments": json.loads(call.arguments)} == CALL
    counters = relay_stats["counters"]["0"]
    assert counters["cuts"] == 1
    assert counters["continued_token_ids"] == 1
    assert relay_stats["tokens"]["0"]["by_request"]["eng-resp/turn-0"] == len(ids)


async def test_plain_tool_conversation_through_the_relay_matches_the_engine(
    tool_engine: tuple[LlamaServer, ToolModel], tmp_path: Path
) -> None:
    """A second turn (the model's call and the tool's result in the conversation), not
    streamed, through the relay as chat and as Responses input items: the relay renders it with
    the engine's template, and its reply's call is the one llama-server's own chat endpoint
    parses for the same conversation."""
    engine, _ = tool_engine
    arguments = json.dumps(CALL["arguments"])
    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "84"},
    ]
    items: list[Any] = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": "call-1",
            "name": "calculator",
            "arguments": arguments,
        },
        {"type": "function_call_output", "call_id": "call-1", "output": "84"},
    ]
    server = await anyio.to_thread.run_sync(lambda: relay(tmp_path / "relay", engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            own = await http.post(
                engine.url + "/v1/chat/completions",
                json={
                    "messages": messages,
                    "tools": [CALCULATOR],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                },
            )
            assert own.status_code == 200, own.text
            own_call = own.json()["choices"][0]["message"]["tool_calls"][0]["function"]
            async with _client(server.url + "/v1") as client:
                chat = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    tools=[CALCULATOR],
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                )
                response = await client.responses.create(
                    model="tiny",
                    input=items,
                    tools=[RESPONSES_CALCULATOR],
                    temperature=0,
                    max_output_tokens=MAX_TOKENS,
                )
    finally:
        await anyio.to_thread.run_sync(server.stop)
    expected = {"name": own_call["name"], "arguments": json.loads(own_call["arguments"])}
    assert expected == CALL
    assert chat.choices[0].finish_reason == "tool_calls"
    (chat_call,) = chat.choices[0].message.tool_calls or ()
    assert chat_call.type == "function"
    function = chat_call.function
    assert {"name": function.name, "arguments": json.loads(function.arguments)} == expected
    (item,) = response.output
    assert item.type == "function_call"
    assert {"name": item.name, "arguments": json.loads(item.arguments)} == expected
    assert response.status == "completed"
