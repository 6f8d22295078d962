"""The relay in front of a real engine: tokens per second through it vs direct, and what a cut
costs the engine in extra prompt tokens.

Runs llama.cpp's llama-server (`make engine`) on the tiny generated test model, and a
`rollout-server model --backend openai` relay in front of it, both on loopback. Prints a table;
asserts nothing about time. Rows:

* direct / relay, greedy: one upstream stream per completion (the relay asks for a logprob per
  token to learn the ids); "vs direct" compares each relay row with the direct row of the same
  sampling;
* relay, seeded sampling: one upstream request per token (the per-position seed that makes a
  seeded generation continue exactly across a cut);
* a cut + continuation: the continuation re-sends prompt + generated ids; the engine reports
  how many of them it evaluated again (`timings.prompt_n`): with its prompt cache on (as
  llama-server defaults, and the engine still holds the uncut run's cache), and with
  `cache_prompt: false` (what a fresh engine after a crash, or one whose cache moved on, pays).

The tiny model generates thousands of tokens per second on one thread, so the relay's fixed
cost per token weighs far more here than in front of a real model; the ratios are a floor.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# The engine helpers of the protocol tests, and the test support package they import.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "protocol"))

from engine_support import LlamaServer, engine_binary, write_model
from rollout_protocol import Role
from testsupport.server_processes import ServerProcess

PROMPTS = ["the cat and the", "is it on the é", "an € for the", "日本 and the"]
MAX_TOKENS = 64
ROUNDS = 3
REPEATS = 5


async def rate(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], keyed: str | None
) -> tuple[int, float]:
    tokens, start = 0, time.perf_counter()
    for r in range(ROUNDS):
        for p, prompt in enumerate(PROMPTS):
            headers = {"X-Rollout-Request": f"{keyed}{r}x{p}/0"} if keyed else {}
            reply = await http.post(
                url + "/v1/completions",
                json=body | {"prompt": prompt, "max_tokens": MAX_TOKENS},
                headers=headers,
            )
            assert reply.status_code == 200, reply.text
            tokens += int(reply.json()["usage"]["completion_tokens"])
    return tokens, time.perf_counter() - start


async def main() -> None:
    binary = engine_binary()
    if binary is None:
        print("llama-server is not built: run `make engine` first")
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model(root / "tiny.gguf")
        engine = LlamaServer.start(binary, root / "tiny.gguf", root)
        relay = ServerProcess.start(
            root / "relay", Role.MODEL, "--backend", "openai", "--upstream-url", engine.url
        )
        try:
            async with httpx.AsyncClient(timeout=120) as http:
                greedy: dict[str, Any] = {"temperature": 0}
                seeded: dict[str, Any] = {"temperature": 0.9, "seed": 3}
                paths = [
                    ("direct, greedy", engine.url, greedy, False),
                    ("relay, greedy, keyed", relay.url, greedy, True),
                    ("direct, seeded sampling", engine.url, seeded, False),
                    ("relay, seeded sampling, keyed", relay.url, seeded, True),
                ]
                await rate(http, engine.url, greedy, None)  # warm-up (the engine runs --no-warmup)
                await rate(http, relay.url, greedy, "w")
                rates: dict[str, list[float]] = {name: [] for name, *_ in paths}
                tokens: dict[str, int] = {}
                for repeat in range(REPEATS):  # interleaved, so load changes hit every path
                    for name, url, body, keyed in paths:
                        key = f"{name[0]}{name[-1]}{repeat}-" if keyed else None
                        n, seconds = await rate(http, url, body, key)
                        rates[name].append(n / seconds)
                        tokens[name] = n
                cut = await cut_cost(http, engine)
        finally:
            relay.stop()
            engine.stop()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"{ROUNDS * len(PROMPTS)} completions of {MAX_TOKENS} tokens per run, {REPEATS} runs per"
        " path; tokens/s: median (min-max)"
    )
    print(f"{'path':32} {'tokens':>7} {'tokens/s':>9} {'(min-max)':>15} {'vs direct':>9}")
    for name, values in rates.items():
        base = medians["direct, " + name.split(", ")[1]]
        spread = f"{min(values):.0f}-{max(values):.0f}"
        print(f"{name:32} {tokens[name]:7d} {medians[name]:9.1f} {spread:>15} "
              f"{medians[name] / base:9.2f}")  # fmt: skip
    print()
    print("a cut after k tokens, continued from ids: prompt tokens the engine evaluates again")
    print(f"{'k':>4} {'prompt ids re-sent':>19} {'cache on':>9} {'cache off':>10}")
    for k, sent, cached, uncached in cut:
        print(f"{k:4d} {sent:19d} {cached:9d} {uncached:10d}")
    print(f"(load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")


async def cut_cost(http: httpx.AsyncClient, engine: LlamaServer) -> list[tuple[int, int, int, int]]:
    """Re-send prompt + k generated ids (a continuation) right after the uncut run, and read how
    many prompt tokens the engine evaluated (`timings.prompt_n`), with its cache and without."""
    rows = []
    prompt = PROMPTS[0]
    tokens = await http.post(
        engine.url + "/tokenize", json={"content": prompt, "add_special": True}
    )
    prompt_ids = [int(t) for t in tokens.json()["tokens"]]
    for k in (8, 32):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
        uncut = (await http.post(engine.url + "/v1/completions", json=body)).json()
        ids = [int(e["id"]) for e in uncut["choices"][0]["logprobs"]["content"]]
        continued = body | {"prompt": prompt_ids + ids[:k], "max_tokens": MAX_TOKENS - k}
        evaluated = []
        for cache in (True, False):
            reply = await http.post(
                engine.url + "/v1/completions", json=continued | {"cache_prompt": cache}
            )
            assert reply.status_code == 200, reply.text
            timings = reply.json().get("timings") or {}
            evaluated.append(int(timings.get("prompt_n", -1)))
        rows.append((k, len(prompt_ids) + k, evaluated[0], evaluated[1]))
    return rows


if __name__ == "__main__":
    asyncio.run(main())
