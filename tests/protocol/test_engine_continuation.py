"""Generation cuts against a real inference engine (llama.cpp's llama-server, a tiny model).

The relay (`rollout-server model --backend openai`) sits in front of llama-server. A debug hook
holds a generation at token k, a checkpoint cuts it there, and the generation continues after
the resume (or, across a crash, in a fresh relay under attempt + 1). The uncut reference is the
engine itself, asked directly, or (seeded sampling, which the relay runs one seeded position at
a time) an uncut run through another relay. Cut points are chosen where it matters: after a
token that BPE would merge with its neighbour if the text were re-tokenised, and after a
multi-byte character.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from engine_support import (
    CHAIN_PROMPT,
    PARTIAL_CHAR,
    ChainModel,
    LlamaServer,
    engine_binary,
    write_chain_model,
    write_model,
)
from rollout_protocol import (
    Coordinator,
    EpisodeId,
    HttpParticipantClient,
    Record,
    Role,
    checkpoint_base,
    read_records,
)
from testsupport.server_processes import SET_NAME, TOKEN, Debug, ServerProcess, deadline

pytestmark = pytest.mark.protocol

PROMPTS = ["the cat and the", "is it on the é", "an € for the", "日本 and the"]
MAX_TOKENS = 20
LOGPROB_TOLERANCE = 1e-4
"""Batch and one-at-a-time evaluation of the same ids may differ in the last float bits."""


def _binary() -> Path:
    binary = engine_binary()
    if binary is None:
        message = "llama-server is not built: run `make engine` (engines/build-llama-server.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    binary = _binary()
    root = tmp_path_factory.mktemp("engine")
    model = root / "tiny.gguf"
    write_model(model)
    server = LlamaServer.start(binary, model, root)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chain_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LlamaServer, ChainModel]]:
    """llama-server serving the chain model: greedy output `cd€efgh...` after `ab`, the € as
    two tokens of which the first ends inside the character."""
    binary = _binary()
    root = tmp_path_factory.mktemp("chain-engine")
    model = root / "chain.gguf"
    chain = write_chain_model(model)
    server = LlamaServer.start(binary, model, root)
    try:
        yield server, chain
    finally:
        server.stop()


@dataclass
class Generation:
    text: str
    ids: list[int]
    logprobs: list[float]


async def direct(http: httpx.AsyncClient, engine: LlamaServer, body: dict[str, Any]) -> Generation:
    """The uncut generation, straight from the engine."""
    reply = await http.post(
        engine.url + "/v1/completions", json=body | {"logprobs": 1, "stream": False}
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    content = choice["logprobs"]["content"]
    return Generation(
        choice["text"], [int(e["id"]) for e in content], [float(e["logprob"]) for e in content]
    )


async def tokenize(http: httpx.AsyncClient, engine: LlamaServer, text: str) -> list[int]:
    reply = await http.post(engine.url + "/tokenize", json={"content": text, "add_special": True})
    assert reply.status_code == 200, reply.text
    return [int(t) for t in reply.json()["tokens"]]


async def detokenize(http: httpx.AsyncClient, engine: LlamaServer, ids: list[int]) -> str:
    reply = await http.post(engine.url + "/detokenize", json={"tokens": ids})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["content"])


async def remerging_cuts(
    http: httpx.AsyncClient, engine: LlamaServer, prompt: str, uncut: Generation
) -> list[int]:
    """Cut points k where re-tokenising prompt + text of the first k tokens gives other ids."""
    prompt_ids = await tokenize(http, engine, prompt)
    cuts = []
    for k in range(1, len(uncut.ids)):
        text = await detokenize(http, engine, uncut.ids[:k])
        if await tokenize(http, engine, prompt + text) != prompt_ids + uncut.ids[:k]:
            cuts.append(k)
    return cuts


async def multibyte_cuts(
    http: httpx.AsyncClient, engine: LlamaServer, uncut: Generation
) -> list[int]:
    """Cut points right after a token holding a multi-byte character."""
    cuts = []
    for k in range(1, len(uncut.ids)):
        piece = await detokenize(http, engine, [uncut.ids[k - 1]])
        if any(len(c.encode()) > 1 for c in piece):
            cuts.append(k)
    return cuts


def relay(root: Path, engine: LlamaServer, *, attempt: int = 0) -> ServerProcess:
    return ServerProcess.start(
        root,
        Role.MODEL,
        "--backend",
        "openai",
        "--upstream-url",
        engine.url,
        "--debug-hooks",
        attempt=attempt,
    )


async def completion(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], key: str, attempt: int = 0
) -> Generation:
    """A keyed completion through the relay, with logprobs (the relay reports no ids)."""
    reply = await http.post(
        url + "/v1/completions",
        json=body | {"logprobs": 1},
        headers={"X-Rollout-Request": key, "X-Rollout-Attempt": str(attempt)},
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    logprobs = choice["logprobs"]
    return Generation(choice["text"], [], [float(lp) for lp in logprobs["token_logprobs"]])


async def cut_at(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    key: str,
    k: int,
    checkpoint_id: str,
    *,
    then_kill: ServerProcess | None = None,
) -> Generation | None:
    """Generate `key` through the relay, cut at token k by a checkpoint; resume and return the
    response, or (then_kill) SIGKILL the relay right after the commit and return None."""
    rollout_id = key.partition("/")[0]
    hooks = Debug(http, url)
    await hooks.arm("token", rollout_id, index=k)
    results: list[Generation] = []
    async with HttpParticipantClient(Role.MODEL, url, token=TOKEN) as participant:
        coordinator = Coordinator([participant])

        async def generate() -> None:
            try:
                results.append(await completion(http, url, body, key))
            except httpx.TransportError:
                assert then_kill is not None

        async with anyio.create_task_group() as group:
            group.start_soon(generate)
            await hooks.paused("token", rollout_id)
            prepared = await coordinator.prepare(checkpoint_id, deadline(30), scope=[rollout_id])
            assert prepared.episodes == [EpisodeId(rollout_id=rollout_id, attempt=0)]
            await hooks.release("token", rollout_id)
            commit = await coordinator.commit(checkpoint_id, deadline(30), prepared.scope())
            assert commit.ok, commit.failures
            if then_kill is not None:
                then_kill.process.kill()
                await anyio.to_thread.run_sync(then_kill.stop)
                return None
            assert not (await coordinator.resume(checkpoint_id, deadline(30))).failures
    return results[0]


def generation_record(root: Path, checkpoint_id: str) -> Record:
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


async def stats(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The relay's `/stats` with its per-request counts (detail=true takes the control token)."""
    reply = await http.get(
        url + "/stats", params={"detail": "true"}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert reply.status_code == 200
    data: dict[str, Any] = reply.json()
    return data


def assert_same(got: Generation, uncut: Generation, what: str) -> None:
    assert got.text == uncut.text, what
    assert len(got.logprobs) == len(uncut.logprobs), f"{what}: logprobs cover every token"
    for i, (a, b) in enumerate(zip(got.logprobs, uncut.logprobs, strict=True)):
        assert abs(a - b) <= LOGPROB_TOLERANCE, f"{what}: token {i} logprob {a} != {b}"


async def test_greedy_cuts_continue_token_for_token(engine: LlamaServer, tmp_path: Path) -> None:
    """Every prompt, cut after a re-merging token and after a multi-byte character (where the
    generation has them) and at a plain point: the continued response is the uncut one, token
    for token (text, per-token logprobs), and the record holds the prefix's ids."""
    root = tmp_path / "relay"
    server = await anyio.to_thread.run_sync(lambda: relay(root, engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            covered = {"remerge": 0, "multibyte": 0}
            n = 0
            for p, prompt in enumerate(PROMPTS):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                uncut = await direct(http, engine, body)
                assert len(uncut.ids) == MAX_TOKENS
                remerge = await remerging_cuts(http, engine, prompt, uncut)
                multibyte = await multibyte_cuts(http, engine, uncut)
                cuts = sorted({3, *remerge[:1], *multibyte[:1]})
                covered["remerge"] += bool(remerge)
                covered["multibyte"] += bool(multibyte)
                for k in cuts:
                    n += 1
                    ckpt = f"greedy-{p}-{k}"
                    got = await cut_at(http, server.url, body, f"g{p}k{k}/0", k, ckpt)
                    assert got is not None
                    assert_same(got, uncut, f"prompt {prompt!r} cut at {k}")
                    state = generation_record(root, ckpt).data["state"]
                    assert state["ids"] == uncut.ids[:k]
                    assert state["tokens"] == k
            relay_stats = await stats(http, server.url)
    finally:
        await anyio.to_thread.run_sync(server.stop)
    assert covered["remerge"] >= 2, f"too few re-merging generations: {covered}"
    assert covered["multibyte"] >= 1, f"no multi-byte character generated: {covered}"
    counters = relay_stats["counters"]["0"]
    assert counters["continued_token_ids"] == n
    assert counters.get("continued_text", 0) == 0


SEEDED_PROMPTS = [PROMPTS[0], PROMPTS[2]]
SEEDED_CUTS = [3, 7, 12]


async def test_seeded_sampling_continues_identically(engine: LlamaServer, tmp_path: Path) -> None:
    """temperature > 0 with a seed: the relay samples each position with a seed derived from
    (seed, rollout, key, position), so a cut run equals an uncut run of the same request, for
    two prompts at three cut points each (a fresh relay per cut: the same key in the same relay
    would be a replay). At least one cut is a re-merging one (read from its record's ids)."""
    bodies = [
        {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 11}
        for prompt in SEEDED_PROMPTS
    ]
    reference = await anyio.to_thread.run_sync(lambda: relay(tmp_path / "ref", engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            uncut = [
                await completion(http, reference.url, body, f"seeded{p}/0")
                for p, body in enumerate(bodies)
            ]
            again = await completion(http, reference.url, bodies[0], "seeded-other/0")
    finally:
        await anyio.to_thread.run_sync(reference.stop)
    assert again.text != uncut[0].text, "another rollout samples otherwise (its own seeds)"
    greedy = {"prompt": SEEDED_PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        assert uncut[0].text != (await direct(http, engine, greedy)).text, "it samples"
    remerging: list[tuple[int, int]] = []
    for p, body in enumerate(bodies):
        for k in SEEDED_CUTS:
            root = tmp_path / f"cut-{p}-{k}"
            server = await anyio.to_thread.run_sync(functools.partial(relay, root, engine))
            try:
                async with httpx.AsyncClient(timeout=60) as http:
                    ckpt = f"seeded-{p}-{k}"
                    got = await cut_at(http, server.url, body, f"seeded{p}/0", k, ckpt)
                    relay_stats = await stats(http, server.url)
                    ids = generation_record(root, ckpt).data["state"]["ids"]
                    prompt = str(body["prompt"])
                    retokenised = await tokenize(
                        http, engine, prompt + await detokenize(http, engine, ids)
                    )
                    if retokenised != await tokenize(http, engine, prompt) + ids:
                        remerging.append((p, k))
            finally:
                await anyio.to_thread.run_sync(server.stop)
            assert got is not None
            assert_same(got, uncut[p], f"seeded, prompt {p}, cut at {k}")
            assert len(ids) == k
            assert relay_stats["counters"]["0"]["continued_token_ids"] == 1
    assert remerging, "no seeded cut fell where BPE re-merges"


async def test_seeded_stop_string_ends_the_generation(engine: LlamaServer, tmp_path: Path) -> None:
    """A stop string in a seeded generation (one token per upstream request): llama-server
    replies to the step whose token completes it with the text before it and no id; the relay
    ends the generation there, as an uncut run without the stop string shows it should. The
    stop strings are single characters: the engine sees one token per step, so a stop string
    spread over several tokens is not caught (docs/servers.md)."""
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 11}
    reference = await anyio.to_thread.run_sync(lambda: relay(tmp_path / "ref", engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            whole = await completion(http, reference.url, body, "stop/0")
    finally:
        await anyio.to_thread.run_sync(reference.stop)
    text = whole.text
    # the first two letters met (for this model 's', inside the token ' s', then 'b', a token)
    stops = [c for i, c in enumerate(text) if i >= 3 and c.isalpha() and c not in text[:i]]
    assert stops, text
    for n, stop in enumerate(stops[:2]):
        server = await anyio.to_thread.run_sync(
            functools.partial(relay, tmp_path / f"stop-{n}", engine)
        )
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                reply = await http.post(
                    server.url + "/v1/completions",
                    json=body | {"stop": [stop]},
                    headers={"X-Rollout-Request": "stop/0"},
                )
        finally:
            await anyio.to_thread.run_sync(server.stop)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["text"] == text[: text.index(stop)], f"stop {stop!r} in {text!r}"
        assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("engine_lost", [False, True], ids=["relay-lost", "engine-lost-too"])
async def test_cut_survives_a_crash_and_continues_under_the_next_attempt(
    engine: LlamaServer, tmp_path: Path, engine_lost: bool
) -> None:
    """The relay is SIGKILLed after a checkpoint that recorded a cut (engine_lost: the engine
    too, as when the whole pod goes, so the continuation runs on a fresh engine with nothing
    cached); a fresh relay restored under attempt 1 continues the re-issued request from the
    recorded ids, and the response is the uncut one."""
    prompt = PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    root = tmp_path / "relay"
    model = tmp_path / "tiny.gguf"
    if engine_lost:
        write_model(model)  # the same bytes as the module's engine serves
    first_engine = LlamaServer.start(_binary(), model, tmp_path / "a") if engine_lost else engine
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            uncut = await direct(http, first_engine, body)
            module_engine = await direct(http, engine, body)
            assert module_engine.ids == uncut.ids
            assert_same(module_engine, uncut, "the same model in another engine")
            remerge = await remerging_cuts(http, first_engine, prompt, uncut)
            assert remerge, "the cut should fall where the prefix's text re-tokenises otherwise"
            k = remerge[0]
            first = await anyio.to_thread.run_sync(lambda: relay(root, first_engine))
            try:
                await cut_at(http, first.url, body, "crash/0", k, "crash-1", then_kill=first)
            finally:
                await anyio.to_thread.run_sync(first.stop)
    finally:
        if engine_lost:
            first_engine.process.kill()
            first_engine.stop()
    assert generation_record(root, "crash-1").data["state"]["ids"] == uncut.ids[:k]

    second_engine = LlamaServer.start(_binary(), model, tmp_path / "b") if engine_lost else engine
    try:
        async with httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as session:
            second = await anyio.to_thread.run_sync(lambda: relay(root, second_engine, attempt=1))
            try:
                coordinator = Coordinator(
                    [HttpParticipantClient(Role.MODEL, second.url, token=TOKEN, client=session)]
                )
                restored = await coordinator.restore("crash-1", 1, deadline(30))
                assert restored.ok, restored.failures
                assert not (await coordinator.resume("crash-1", deadline(30))).failures
                got = await completion(http, second.url, body, "crash/0", attempt=1)
                relay_stats = await stats(http, second.url)
            finally:
                await anyio.to_thread.run_sync(second.stop)
    finally:
        if engine_lost:
            second_engine.stop()
    assert_same(got, uncut, f"after the crash, cut at {k}")
    assert relay_stats["counters"]["1"]["continued_token_ids"] == 1
    assert relay_stats["tokens"]["1"]["by_request"]["crash/0"] == MAX_TOKENS - k


async def test_text_fallback_diverges_where_bpe_remerges(
    engine: LlamaServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limitation, shown: continuing from text (what an engine without ids allows) gives
    the model another context at a re-merging cut, and the response differs from the uncut one;
    the record and /stats say the continuation was text-level."""
    async with httpx.AsyncClient(timeout=60) as http:
        found: tuple[str, Generation, int, str] | None = None
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            uncut = await direct(http, engine, body)
            for k in await remerging_cuts(http, engine, prompt, uncut):
                prefix = await detokenize(http, engine, uncut.ids[:k])
                rest = await direct(
                    http, engine, body | {"prompt": prompt + prefix, "max_tokens": MAX_TOKENS - k}
                )
                if prefix + rest.text != uncut.text:
                    found = (prompt, uncut, k, prefix + rest.text)
                    break
            if found:
                break
    assert found is not None, "no re-merging cut changed the continuation"
    prompt, uncut, k, diverged = found
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    monkeypatch.setenv("ROLLOUT_RELAY_CONTINUATION", "text")
    server = await anyio.to_thread.run_sync(lambda: relay(tmp_path / "text", engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            got = await cut_at(http, server.url, body, "text/0", k, "text-1")
            relay_stats = await stats(http, server.url)
    finally:
        await anyio.to_thread.run_sync(server.stop)
    assert got is not None
    assert got.text == diverged != uncut.text
    assert "ids" not in generation_record(tmp_path / "text", "text-1").data["state"]
    assert relay_stats["counters"]["0"]["continued_text"] == 1


CHAIN_TOKENS = 8


async def test_engine_reports_no_id_for_a_token_inside_a_character(
    chain_engine: tuple[LlamaServer, ChainModel],
) -> None:
    """The engine's limit, shown: llama-server holds back a token that ends inside a UTF-8
    character and reports neither its id nor its logprob, streamed or not; it streams the
    character with the id of its last token only. Its `timings.predicted_n` still counts it."""
    engine, chain = chain_engine
    body = {"prompt": CHAIN_PROMPT, "max_tokens": CHAIN_TOKENS, "temperature": 0, "logprobs": 1}
    expected = [4, 5, chain.lead, chain.last, 6, 7, 8, 9]  # c d <lead> <last> e f g h
    assert [chain.vocab.tokens[i] for i in (4, 5, 6)] == ["c", "d", "e"]
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(engine.url + "/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        content = data["choices"][0]["logprobs"]["content"]
        assert data["choices"][0]["text"] == f"cd{PARTIAL_CHAR}efgh"
        assert data["usage"]["completion_tokens"] == CHAIN_TOKENS
        assert [e["id"] for e in content] == [t for t in expected if t != chain.lead]

        chunks: list[tuple[str, list[int], int]] = []
        async with http.stream(
            "POST",
            engine.url + "/v1/completions",
            json=body | {"stream": True, "timings_per_token": True},
        ) as streamed:
            async for line in streamed.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    choice = chunk["choices"][0]
                    ids = [e["id"] for e in (choice["logprobs"] or {}).get("content", [])]
                    chunks.append((choice["text"], ids, chunk["timings"]["predicted_n"]))
    assert (PARTIAL_CHAR, [chain.last], 4) in chunks
    assert sum(len(ids) for _, ids, _ in chunks) == CHAIN_TOKENS - 1
    assert chunks[-1][2] == CHAIN_TOKENS


async def test_relay_goes_text_level_after_a_token_without_id(
    chain_engine: tuple[LlamaServer, ChainModel], tmp_path: Path
) -> None:
    """What the relay makes of it: it counts the held token (the engine's `predicted_n`),
    records no ids from there on, and a cut after the character continues from text, said in
    the record and /stats, and diverges (the text re-tokenises as the whole-character token).
    A cut before it is still exact. There is no cut inside the character: the relay's token
    steps are the engine's chunks (2 tokens, then 4). A seeded generation, which the relay
    samples one token per request, fails with a clear error instead of dropping the token."""
    engine, _ = chain_engine
    body = {"prompt": CHAIN_PROMPT, "max_tokens": CHAIN_TOKENS, "temperature": 0}
    root = tmp_path / "relay"
    server = await anyio.to_thread.run_sync(lambda: relay(root, engine))
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            uncut = await direct(http, engine, body)
            whole = await completion(http, server.url, body, "whole/0")
            before = await cut_at(http, server.url, body, "before/0", 2, "chain-2")
            after = await cut_at(http, server.url, body, "after/0", 4, "chain-4")
            prefix = f"cd{PARTIAL_CHAR}"
            text_rest = await direct(
                http,
                engine,
                body | {"prompt": CHAIN_PROMPT + prefix, "max_tokens": CHAIN_TOKENS - 4},
            )
            seeded = await http.post(
                server.url + "/v1/completions",
                json=body | {"temperature": 0.9, "seed": 5},
                headers={"X-Rollout-Request": "seeded/0"},
            )
            relay_stats = await stats(http, server.url)
    finally:
        await anyio.to_thread.run_sync(server.stop)
    assert whole.text == uncut.text == f"cd{PARTIAL_CHAR}efgh"
    assert len(whole.logprobs) == CHAIN_TOKENS - 1, "no logprob for the held token"
    assert relay_stats["tokens"]["0"]["by_request"]["whole/0"] == CHAIN_TOKENS

    assert before is not None
    assert before.text == uncut.text
    assert generation_record(root, "chain-2").data["state"]["ids"] == uncut.ids[:2]

    assert after is not None
    state = generation_record(root, "chain-4").data["state"]
    assert state["text"] == prefix
    assert state["tokens"] == 4
    assert "ids" not in state
    assert after.text == prefix + text_rest.text != uncut.text

    counters = relay_stats["counters"]["0"]
    assert counters["continued_token_ids"] == 1
    assert counters["continued_text"] == 1
    assert seeded.status_code == 500, seeded.text
    assert "inside a UTF-8 character" in seeded.text
