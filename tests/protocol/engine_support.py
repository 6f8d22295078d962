"""A real inference engine for protocol tests: llama.cpp's `llama-server` and a tiny model.

The engine binary comes from `engines/build-llama-server.sh` (built once per machine, cached;
`make engine` runs it). The model is generated here with the `gguf` package: a llama
architecture with two layers, 64 dimensions and seeded random weights, and a real byte-level BPE
tokenizer (GPT-2 style byte-to-unicode symbols, ordered merges) built deterministically below.
Nothing is downloaded.

The vocabulary is shaped for the continuation tests:

* merges inside words (`t`+`h` -> `th`, `th`+`e` -> `the`, ...) and of a leading space
  (`Ġ`+`t` -> `Ġt`): a generation that samples `t` then `h` has a text whose re-tokenisation is
  `th`, one token, so continuing from the text gives the model another context than continuing
  from the sampled ids;
* multi-byte UTF-8 characters (`é`, `ü`, `€`, `日`, `本`) built by merges of their bytes, and merges
  across them (`é`+`t` -> `ét`). Their partial-byte symbols are *not* tokens, so every sampled
  token is whole characters: llama-server does not stream a token that ends inside a character
  (nor its id), see docs/servers.md.

`LlamaServer.start` runs the engine on a free loopback port and waits, with a deadline, until
`/health` answers 200; `stop` ends it (SIGINT, then SIGKILL at the deadline). Started from the
main thread, the engine is also SIGKILLed by the kernel when the test process dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from testsupport.server_processes import free_port

ENGINE_ENV = "ROLLOUT_LLAMA_SERVER"
"""Path of the llama-server binary (the Makefile's `engine` target links .bin/engines/)."""
DEFAULT_ENGINE = Path(__file__).resolve().parents[2] / ".bin" / "engines" / "llama-server"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0

EMBED = 64
LAYERS = 2
HEADS = 4
FFN = 128
CONTEXT = 1024
WEIGHT_SEED = 20240611

# The characters the vocabulary covers, and the merges, in rank order.
_ASCII = " abcdefghijklmnopqrstuvwxyz.,!?\n"
_WORD_MERGES = [
    "t h", "th e", "Ġ t", "Ġt he", "a n", "an d", "Ġ a", "Ġa nd", "e r", "i n", "o n", "r e",
    "a t", "Ġ s", "e n", "o u", "Ġ w", "h e", "Ġ o", "Ġo n", "i s", "Ġ is", "e s", "o r",
    "Ġ b", "Ġ c", "a r", "l e", "s t", "i t", "Ġ m", "Ġ f", "in g", "Ġ p", "a l", "Ġ d",
]  # fmt: skip
_MULTIBYTE = ["é", "ü", "€", "日", "本"]
_MULTIBYTE_WORDS = ["ét", "Ġé", "üb", "Ġ€", "日本"]


def _byte_symbols() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode symbol map (llama.cpp's BPE uses it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    symbols = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def _encode(text: str) -> str:
    symbols = _byte_symbols()
    return "".join(symbols[b] for b in text.encode())


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    merges: list[str]
    eos: int


def build_vocabulary() -> Vocabulary:
    """Tokens and merges, deterministic: whole characters only, partial bytes never tokens."""
    tokens: list[str] = ["<|endoftext|>"]
    tokens += [_encode(c) for c in _ASCII]
    merges: list[str] = []
    for merge in _WORD_MERGES:
        left, right = merge.split(" ")
        merges.append(merge)
        tokens.append(left + right)
    for char in _MULTIBYTE:
        symbols = [_byte_symbols()[b] for b in char.encode()]
        merged = symbols[0]
        for symbol in symbols[1:]:
            merges.append(f"{merged} {symbol}")
            merged += symbol
        tokens.append(merged)  # only the whole character: its partial merges are no tokens
    for word in _MULTIBYTE_WORDS:
        encoded = word.replace("Ġ", " ")
        pieces = ["Ġ" if c == " " else _encode(c) for c in encoded]
        merged = pieces[0]
        for piece in pieces[1:]:
            merges.append(f"{merged} {piece}")
            merged += piece
        tokens.append(merged)
    unique = list(dict.fromkeys(tokens))
    return Vocabulary(tokens=unique, merges=merges, eos=0)


def write_model(path: Path) -> Vocabulary:
    """Write the tiny llama model with seeded random weights to `path` (GGUF)."""
    import numpy as np

    vocab = build_vocabulary()
    rng = np.random.default_rng(WEIGHT_SEED)
    n_vocab = len(vocab.tokens)

    def weights(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors: dict[str, Any] = {"token_embd.weight": weights(n_vocab, EMBED, scale=1.0)}
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        tensors[prefix + "attn_norm.weight"] = np.ones(EMBED, dtype=np.float32)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors[prefix + name + ".weight"] = weights(EMBED, EMBED, scale=0.2)
        tensors[prefix + "ffn_norm.weight"] = np.ones(EMBED, dtype=np.float32)
        tensors[prefix + "ffn_gate.weight"] = weights(FFN, EMBED, scale=0.2)
        tensors[prefix + "ffn_up.weight"] = weights(FFN, EMBED, scale=0.2)
        tensors[prefix + "ffn_down.weight"] = weights(EMBED, FFN, scale=0.2)
    tensors["output_norm.weight"] = np.ones(EMBED, dtype=np.float32)
    output = weights(n_vocab, EMBED, scale=0.5)
    output[vocab.eos] = 0.0  # end of text stays rare: generations run to max_tokens
    tensors["output.weight"] = output
    _write_gguf(path, "rollout-tiny-test", vocab, EMBED, tensors)
    return vocab


PARTIAL_CHAR = "€"
"""The character the chain model writes as two tokens, the first ending inside it."""
CHAIN_EMBED = 128
CHAIN_PROMPT = "ab"
CHAIN_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class ChainModel:
    """A model whose greedy output is a fixed chain of tokens (see `write_chain_model`)."""

    vocab: Vocabulary
    lead: int
    """The token of `PARTIAL_CHAR`'s first two bytes: it ends inside the character."""
    last: int
    """The token of its last byte."""
    whole: int
    """The token of the whole character (what its text tokenises to)."""

    def next_token(self, token: int) -> int:
        """The token the model predicts after `token` (its logits depend on nothing else)."""
        tokens = self.vocab.tokens
        if token == self.lead:
            return self.last
        if token == self.last:
            return tokens.index("e")
        if tokens[token] == "d":
            return self.lead
        if tokens[token] in CHAIN_LETTERS:
            letter = CHAIN_LETTERS.index(tokens[token])
            return tokens.index(CHAIN_LETTERS[(letter + 1) % len(CHAIN_LETTERS)])
        return tokens.index("a")


def write_chain_model(path: Path) -> ChainModel:
    """A bigram model with a token that ends inside a UTF-8 character, to show what llama-server
    does with one. The vocabulary is `build_vocabulary()`'s plus two partial tokens of
    `PARTIAL_CHAR` (its first two bytes, its last byte). The embeddings are one-hot and every
    layer's output projection is zero, so the residual stream is the current token's embedding
    and the logits are one column of the output matrix: greedy decoding follows
    `ChainModel.next_token` (after `CHAIN_PROMPT`: c, d, lead, last, e, f, ...: the text
    `cd€ef...`, the € written as two tokens). Other logits are small seeded noise."""
    import numpy as np

    base = build_vocabulary()
    symbols = [_byte_symbols()[b] for b in PARTIAL_CHAR.encode()]
    lead_symbol, last_symbol = "".join(symbols[:-1]), symbols[-1]
    vocab = Vocabulary(tokens=[*base.tokens, lead_symbol, last_symbol], merges=base.merges, eos=0)
    n_vocab = len(vocab.tokens)
    assert n_vocab <= CHAIN_EMBED
    chain = ChainModel(vocab, n_vocab - 2, n_vocab - 1, vocab.tokens.index(_encode(PARTIAL_CHAR)))
    rng = np.random.default_rng(WEIGHT_SEED)
    zeros = np.zeros

    def noise(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.01).astype(np.float32)

    tensors: dict[str, Any] = {"token_embd.weight": np.eye(n_vocab, CHAIN_EMBED, dtype=np.float32)}
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        tensors[prefix + "attn_norm.weight"] = np.ones(CHAIN_EMBED, dtype=np.float32)
        for name in ("attn_q", "attn_k", "attn_v"):
            tensors[prefix + name + ".weight"] = noise(CHAIN_EMBED, CHAIN_EMBED)
        tensors[prefix + "attn_output.weight"] = zeros((CHAIN_EMBED, CHAIN_EMBED), np.float32)
        tensors[prefix + "ffn_norm.weight"] = np.ones(CHAIN_EMBED, dtype=np.float32)
        tensors[prefix + "ffn_gate.weight"] = noise(FFN, CHAIN_EMBED)
        tensors[prefix + "ffn_up.weight"] = noise(FFN, CHAIN_EMBED)
        tensors[prefix + "ffn_down.weight"] = zeros((CHAIN_EMBED, FFN), np.float32)
    tensors["output_norm.weight"] = np.ones(CHAIN_EMBED, dtype=np.float32)
    output = noise(n_vocab, CHAIN_EMBED)
    for token in range(n_vocab):
        output[chain.next_token(token), token] = 1.0
    output[vocab.eos] = 0.0
    tensors["output.weight"] = output
    _write_gguf(path, "rollout-chain-test", vocab, CHAIN_EMBED, tensors)
    return chain


TOOL_CALL_TOKENS = [
    "<tool_call>",
    '\n{"name": "',
    "calculator",
    '", "arguments": {"',
    "expression",
    '": "',
    "12",
    "*",
    "7",
    '"}}\n',
    "</tool_call>",
]
"""The tool model's greedy output after a prompt that ends in a newline, token by token: one
Hermes-style call of `calculator` with `{"expression": "12*7"}`, then end of text."""
TOOL_CALL_TEXT = "".join(TOOL_CALL_TOKENS)
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments if call.function.arguments is string \
else call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A ChatML chat template with Hermes-style tools (as Qwen's and Hermes' templates write them)."""


@dataclass(frozen=True)
class ToolModel:
    """A model whose greedy output after a newline is `TOOL_CALL_TOKENS` (`write_tool_model`)."""

    vocab: Vocabulary
    call: list[int]
    """The ids of `TOOL_CALL_TOKENS`."""


def write_tool_model(path: Path) -> ToolModel:
    """A bigram model (one-hot embeddings, zero layer outputs, as `write_chain_model`) that
    answers a chat prompt (which ends in a newline) with one tool call, then end of text. Its
    vocabulary is every printable ASCII byte and the newline, ChatML's control tokens, and the
    call's multi-character tokens, which no merge builds: the call's text re-tokenises as single
    bytes (`12` as `1`, `2`), after which the model ends the text, so only a continuation from
    the sampled ids goes on as the uncut generation did. The GGUF carries `TOOL_TEMPLATE`."""
    import numpy as np

    symbols = _byte_symbols()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [symbols[b] for b in [*range(0x20, 0x7F), ord("\n")]]
    call_symbols = [_encode(t) for t in TOOL_CALL_TOKENS]
    tokens += [t for t in call_symbols if t not in tokens]
    tokens.append("qz")  # llama.cpp wants merges: one that no test text meets
    vocab = Vocabulary(tokens=tokens, merges=["q z"], eos=0)
    n_vocab = len(tokens)
    assert n_vocab <= CHAIN_EMBED
    call = [tokens.index(t) for t in call_symbols]
    successor = {tokens.index(_encode("\n")): call[0]}
    successor.update(itertools.pairwise(call))
    rng = np.random.default_rng(WEIGHT_SEED)

    def noise(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.01).astype(np.float32)

    tensors: dict[str, Any] = {"token_embd.weight": np.eye(n_vocab, CHAIN_EMBED, dtype=np.float32)}
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        tensors[prefix + "attn_norm.weight"] = np.ones(CHAIN_EMBED, dtype=np.float32)
        for name in ("attn_q", "attn_k", "attn_v"):
            tensors[prefix + name + ".weight"] = noise(CHAIN_EMBED, CHAIN_EMBED)
        tensors[prefix + "attn_output.weight"] = np.zeros((CHAIN_EMBED, CHAIN_EMBED), np.float32)
        tensors[prefix + "ffn_norm.weight"] = np.ones(CHAIN_EMBED, dtype=np.float32)
        tensors[prefix + "ffn_gate.weight"] = noise(FFN, CHAIN_EMBED)
        tensors[prefix + "ffn_up.weight"] = noise(FFN, CHAIN_EMBED)
        tensors[prefix + "ffn_down.weight"] = np.zeros((CHAIN_EMBED, FFN), np.float32)
    tensors["output_norm.weight"] = np.ones(CHAIN_EMBED, dtype=np.float32)
    output = noise(n_vocab, CHAIN_EMBED)
    for token in range(n_vocab):
        output[successor.get(token, vocab.eos), token] = 1.0
    tensors["output.weight"] = output
    _write_gguf(
        path,
        "rollout-tool-test",
        vocab,
        CHAIN_EMBED,
        tensors,
        chat_template=TOOL_TEMPLATE,
        control=(tokens.index("<|im_start|>"), tokens.index("<|im_end|>")),
    )
    return ToolModel(vocab, call)


def _write_gguf(
    path: Path,
    name: str,
    vocab: Vocabulary,
    embed: int,
    tensors: dict[str, Any],
    *,
    chat_template: str | None = None,
    control: tuple[int, ...] = (),
) -> None:
    import gguf  # the `engine` extra; imported here so collecting tests does not need it

    n_vocab = len(vocab.tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(embed)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(embed // HEADS)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL if i == vocab.eos or i in control else gguf.TokenType.NORMAL
            for i in range(n_vocab)
        ]
    )
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.eos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for tensor_name, tensor in tensors.items():
        writer.add_tensor(tensor_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_PR_SET_PDEATHSIG = 1


def _die_with_starter() -> Callable[[], None] | None:
    """A pre-exec hook that has Linux SIGKILL the engine when the process that started it dies,
    so a test run killed outright leaves no engine behind. The signal follows the starting
    *thread*, so the hook is used only from the main thread (where fixtures and the bench run);
    elsewhere the engine relies on `stop`."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the starter died before the line above
            os._exit(1)

    return hook


def engine_binary() -> Path | None:
    """The llama-server binary, or None when it was not built on this machine."""
    path = Path(os.environ.get(ENGINE_ENV, DEFAULT_ENGINE))
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass
class LlamaServer:
    """One llama-server process serving the tiny model on loopback."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, binary: Path, model: Path, root: Path) -> LlamaServer:
        port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        log = root / f"llama-server-{port}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                [
                    str(binary),
                    "--model",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--ctx-size",
                    str(CONTEXT),
                    "--parallel",
                    "1",
                    "--threads",
                    "1",
                    "--no-warmup",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_starter(),  # a prctl call only
            )
        server = cls(port, process, log)
        try:
            server._wait_healthy(time.monotonic() + READY_TIMEOUT_S)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_healthy(self, deadline: float) -> None:
        """Poll `/health` (llama-server's readiness: 503 while loading) until 200 or deadline."""
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"llama-server exited ({self.process.returncode}): {self.tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if http.get(self.url + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not healthy in time: {self.tail()}")
                # a bounded wait for the process to exit doubles as the poll interval
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=0.1)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT_S)
