"""A traced server's exit, `--wait-tools` names and a Gym route's 413, each on a real process.

- A server that exports traces stops promptly on SIGINT when its OTLP collector is dead (nobody
  listens) or silent (accepts and never answers): the exit's flush is bounded by
  `tracing.EXIT_FLUSH_TIMEOUT_S` (docs/operations.md, "Traces").
- `rollout-server resources --wait-tools NAME` refuses a tool it does not offer at start, naming
  it and the tools it has, so a misspelt name cannot leave a side-effect tool replayed
  (docs/servers.md).
- A body over `ROLLOUT_MAX_BODY_BYTES` sent to a route of the NeMo Gym dialect is refused in
  Gym's error body, whether refused before the app runs (a declared `Content-Length`) or while
  it is read (chunked); our routes keep ours (docs/protocol.md, "The NeMo Gym dialect").

Every server here is a `rollout-server` process on loopback, stopped at the end of its test.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_protocol import PREPARE, STATUS, Dialect, ErrorBody, ErrorCode, Role
from rollout_protocol.tracing import EXIT_FLUSH_TIMEOUT_S
from testsupport.gym_upstream import UpstreamErrorBody
from testsupport.server_processes import (
    AUTH,
    READY_TIMEOUT_S,
    SERVER,
    ServerProcess,
    free_port,
    server_env,
)

# --- a traced server's exit --------------------------------------------------------------------


class SilentCollector:
    """A loopback TCP server that accepts every connection and never answers (nor reads)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent-collector", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            self.accepted.append(connection)

    def close(self) -> None:
        """Stop accepting (shutdown wakes the blocked `accept`; close alone does not) and drop
        every connection."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        assert not self._thread.is_alive(), "the silent collector's accept loop did not stop"
        for connection in self.accepted:
            connection.close()


@pytest.fixture
def silent_collector() -> Iterator[SilentCollector]:
    collector = SilentCollector()
    try:
        yield collector
    finally:
        collector.close()


def _exit_seconds(root: Path, env: dict[str, str]) -> float:
    """Start a model server, make it record spans (control-plane calls), SIGINT it: the seconds
    from the signal to its exit, which must be clean (0)."""
    server = ServerProcess.start(root, Role.MODEL, env=env)
    try:
        for _ in range(5):
            reply = httpx.get(server.url + STATUS.url_path, headers=AUTH, timeout=10)
            assert reply.status_code == 200, reply.text
    finally:
        started = time.monotonic()
        code = server.stop()
        seconds = time.monotonic() - started
    assert code == 0, f"exit status {code}"
    return seconds


@pytest.mark.parametrize("collector", ["dead", "silent"])
def test_a_traced_server_exits_promptly_when_its_collector_is_dead_or_silent(
    tmp_path: Path, collector: str, silent_collector: SilentCollector
) -> None:
    # dead: a port bound and released, where nobody listens
    port = free_port() if collector == "dead" else silent_collector.port
    untraced = _exit_seconds(tmp_path / "untraced", {})
    traced = _exit_seconds(
        tmp_path / "traced",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            # the spans stay queued until the exit (no export before it), so the exit is what
            # has to deliver them, however long this test took to get there
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
        },
    )
    # The same server and the same requests, with and without tracing, so the difference is the
    # exit's flush: bounded by EXIT_FLUSH_TIMEOUT_S (plus a 0.2 s grace after the exporter is
    # stopped); twice that is left for a loaded machine. Unbounded, the SDK retries an export
    # for up to its exporter's timeout (10 s) and waits for it up to 30 s: well above this.
    bound = untraced + 2 * EXIT_FLUSH_TIMEOUT_S
    assert traced <= bound, (
        f"a traced server took {traced:.1f}s to exit against {untraced:.1f}s untraced "
        f"(collector {collector}; bound {bound:.1f}s)"
    )
    if collector == "silent":
        assert silent_collector.accepted, "the exit never tried to export: nothing was tested"


# --- --wait-tools ------------------------------------------------------------------------------


def _start_until_ready_or_exit(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `rollout-server ...`: its exit status and stderr, or fail once it prints `ready`
    (it started) or at the deadline."""
    process = subprocess.Popen(
        [*SERVER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while (remaining := deadline - time.monotonic()) > 0:
                if not selector.select(timeout=remaining):
                    continue
                line = process.stdout.readline()
                if not line:  # stdout closed: it exited
                    code = process.wait(timeout=READY_TIMEOUT_S)
                    return code, process.stderr.read().decode(errors="replace")
                assert b'"ready"' not in line, f"it started: {line!r}"
        raise AssertionError("neither ready nor exited in time")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=READY_TIMEOUT_S)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.parametrize(
    ("names", "unknown"),
    [("calculater", ["calculater"]), ("calculator, searh,rm", ["searh", "rm"])],
    ids=["typo", "typos-beside-a-known-tool"],
)
def test_wait_tools_refuses_tools_the_server_does_not_offer(
    tmp_path: Path, names: str, unknown: list[str]
) -> None:
    args = ["resources", "--port", str(free_port()), "--wait-tools", names]
    code, stderr = _start_until_ready_or_exit(args, server_env(tmp_path / "checkpoints", 0))
    assert code == 1, stderr  # the status of the CLI's other argument refusals (SystemExit)
    assert "--wait-tools" in stderr, stderr
    for name in unknown:
        assert repr(name) in stderr, stderr
    assert "this server's tools: calculator" in stderr, stderr
    assert "Traceback" not in stderr, stderr


def test_wait_tools_with_known_names_starts_and_declares_them(tmp_path: Path) -> None:
    """The contrast: a known name (spaces and empty items ignored) starts, declared a wait step."""
    server = ServerProcess.start(tmp_path, Role.RESOURCES, "--wait-tools", " calculator ,")
    try:
        listing = httpx.get(f"{server.url}/tools", timeout=10).json()
        assert listing == {"tools": [{"name": "calculator", "idempotent": False}]}
    finally:
        assert server.stop() == 0


# --- a 413 on a Gym route ----------------------------------------------------------------------

LIMIT = 64 * 1024
"""`ROLLOUT_MAX_BODY_BYTES` of the server below: small, so an over-limit body fits in the
loopback socket's buffers and is sent whole before the refusal is read."""


@pytest.fixture
def both_dialects(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess.start(
        tmp_path,
        Role.ENVIRONMENT,
        "--agent-url",
        "http://127.0.0.1:9",  # never called: only the control routes are used
        "--resources-url",
        "http://127.0.0.1:9",
        env={"ROLLOUT_CONTROL_DIALECTS": "rollout,gym", "ROLLOUT_MAX_BODY_BYTES": str(LIMIT)},
    )
    try:
        yield server
    finally:
        server.stop()


def _over_limit(chunked: bool) -> Any:
    body = b" " * (LIMIT + 1024)
    if not chunked:
        return body  # sent with its Content-Length: refused before the app runs

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: refused while read
        for start in range(0, len(body), 16 * 1024):
            yield body[start : start + 16 * 1024]

    return chunks()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_over_the_limit_is_refused_in_the_dialect_of_its_route(
    both_dialects: ServerProcess, chunked: bool
) -> None:
    headers = {**AUTH, "content-type": "application/json"}
    gym_prepare, gym_status = PREPARE.path_in(Dialect.GYM), STATUS.path_in(Dialect.GYM)
    assert gym_prepare is not None
    assert gym_status is not None
    async with httpx.AsyncClient(base_url=both_dialects.url, timeout=10) as http:
        gym = await http.post(gym_prepare, content=_over_limit(chunked), headers=headers)
        ours = await http.post(PREPARE.url_path, content=_over_limit(chunked), headers=headers)
        status = await http.get(gym_status, headers=AUTH)

    assert gym.status_code == 413, gym.text
    # Gym's error body as its pinned models have it (no field beyond code and detail)
    body = UpstreamErrorBody.model_validate_json(gym.content)
    assert body.error.code == ErrorCode.PAYLOAD_TOO_LARGE.value, body
    assert "ROLLOUT_MAX_BODY_BYTES" in body.error.detail, body

    assert ours.status_code == 413, ours.text
    native = ErrorBody.model_validate_json(ours.content)
    assert native.error.code is ErrorCode.PAYLOAD_TOO_LARGE, native
    assert "ROLLOUT_MAX_BODY_BYTES" in native.error.detail

    assert status.status_code == 200, status.text  # still serving, nothing prepared
    assert status.json()["phase"] == "idle", status.json()
