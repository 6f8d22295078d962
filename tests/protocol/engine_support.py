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
`/health` answers 200; `stop` ends it (SIGINT, then SIGKILL at the deadline).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from protocol_support import free_port

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
    import gguf  # the `engine` extra; imported here so collecting tests does not need it
    import numpy as np

    vocab = build_vocabulary()
    rng = np.random.default_rng(WEIGHT_SEED)
    n_vocab = len(vocab.tokens)

    def weights(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("rollout-tiny-test")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL if i == vocab.eos else gguf.TokenType.NORMAL
            for i in range(n_vocab)
        ]
    )
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.eos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)

    writer.add_tensor("token_embd.weight", weights(n_vocab, EMBED, scale=1.0))
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(EMBED, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(prefix + name + ".weight", weights(EMBED, EMBED, scale=0.2))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(EMBED, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_gate.weight", weights(FFN, EMBED, scale=0.2))
        writer.add_tensor(prefix + "ffn_up.weight", weights(FFN, EMBED, scale=0.2))
        writer.add_tensor(prefix + "ffn_down.weight", weights(EMBED, FFN, scale=0.2))
    writer.add_tensor("output_norm.weight", np.ones(EMBED, dtype=np.float32))
    output = weights(n_vocab, EMBED, scale=0.5)
    output[vocab.eos] = 0.0  # end of text stays rare: generations run to max_tokens
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab


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
