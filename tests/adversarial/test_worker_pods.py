"""A pod of several worker processes attacked through its public port, and its start and end gone
wrong (docs/protocol.md, "Workers"; docs/operations.md, "Failure modes").

- The workers' private channel (`/_worker/v1/*`) answers nothing that came through the pod's
  port: no token, the control token, a guessed worker key. Afterwards every worker still serves
  attempt 0 and the pod's status is unchanged.
- A rollout id the wire cannot carry (a lone surrogate), a body nested past the JSON parser's
  depth and a JSON body that begins with whitespace are answered as one process would answer
  them: a 4xx naming the problem, or routed to the worker that holds the rollout; never a 500.
- `WEB_CONCURRENCY` that is not a whole number of ASCII digits is refused with one line.
- A worker that dies while it starts ends the pod with `WORKER_LOST_EXIT` (no traceback of the
  main process); a worker killed later ends it the same way; either way the pod's socket folder
  is gone, and the folder of a SIGKILLed pod is removed by the next pod that starts.

Real `rollout-server resources --workers 3` processes on loopback, each with a temporary
directory of its own (`TMPDIR`) so that its socket folder can be looked at; the worker that
fails at start is `testsupport.failing_worker`, served by `serve_workers` as a pod's command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_protocol import API_PREFIX, ErrorCode, Role
from rollout_protocol.conformance import rollout_ids_per_worker
from rollout_protocol.workers import WORKER_LOST_EXIT
from shared import refused
from testsupport.podpath import TESTS
from testsupport.server_processes import (
    SERVER,
    TOKEN,
    ServerProcess,
    free_port,
    server_env,
    two_step_task,
    worker_pids,
)

from devcluster.waiting import wait_for_sync

WORKERS = 3
READY_S = 120.0
"""Each worker is a fresh interpreter: three of them start slowly on a loaded 2-core machine."""
EXIT_S = 60.0
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CREDENTIALS: list[dict[str, str]] = [
    {},
    AUTH,
    {"X-Rollout-Worker-Key": "0" * 64},
]
"""What a caller outside the pod can present: nothing, the set's control token, a guess."""


@pytest.fixture
def tmpdir_of_pod() -> Iterator[Path]:
    """A short temporary directory for the pod (socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rw-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_pod(root: Path, tmpdir: Path, **env: str) -> ServerProcess:
    return ServerProcess.start(
        root,
        Role.RESOURCES,
        "--workers",
        str(WORKERS),
        env={"TMPDIR": str(tmpdir), **env},
        ready_timeout_s=READY_S,
    )


@pytest.fixture
def pod(tmp_path: Path, tmpdir_of_pod: Path) -> Iterator[ServerProcess]:
    server = start_pod(tmp_path, tmpdir_of_pod)
    try:
        yield server
    finally:
        server.stop()


def socket_folders(tmpdir: Path) -> list[Path]:
    return sorted(tmpdir.glob("rollout-workers-*"))


def seed(rollout_id: str) -> dict[str, Any]:
    task = two_step_task(0).model_dump(mode="json")
    return {"rollout_id": rollout_id, "attempt": 0, "task": task}


async def test_the_private_worker_channel_answers_nothing_from_the_pods_port(
    pod: ServerProcess,
) -> None:
    ids = rollout_ids_per_worker(WORKERS, "attack")
    attacks = [
        ("POST", "/_worker/v1/install?attempt=7&rollout_id={}", b""),
        ("POST", "/_worker/v1/retire?rollout_id={}", json.dumps({"attempt": 0}).encode()),
        ("POST", "/_worker/v1/retire", None),
        ("GET", "/_worker/v1/counts?rollout_id={}", b""),
    ]
    async with httpx.AsyncClient(base_url=pod.url, timeout=30) as http:
        for rid in ids:
            for method, path, body in attacks:
                content = json.dumps({"attempt": 0, "rollout_id": rid}).encode()
                for headers in CREDENTIALS:
                    reply = await http.request(
                        method,
                        path.format(rid),
                        content=content if body is None else body,
                        headers={"content-type": "application/json", **headers},
                    )
                    detail = refused(reply, ErrorCode.UNAUTHORIZED, 401)
                    assert "private worker channel" in detail
        # every worker still runs attempt 0, nothing retired or re-attempted
        for rid in ids:
            reply = await http.post("/sessions/seed", json=seed(rid))
            assert reply.status_code == 200, reply.text
            assert reply.json()["attempt"] == 0
        status = (await http.get(f"{API_PREFIX}/status", headers=AUTH)).json()
        assert (status["attempt"], status["phase"], status["retired_attempts"]) == (0, "idle", [])
        assert status["live_episodes"] == len(ids)


async def test_hostile_rollout_ids_and_bodies_get_a_4xx_never_a_500(pod: ServerProcess) -> None:
    (rid,) = rollout_ids_per_worker(1, "hostile")
    nested = b'{"rollout_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with httpx.AsyncClient(base_url=pod.url, timeout=30) as http:
        lone = json.dumps({**seed("x"), "rollout_id": "\ud800"})  # escaped: valid JSON text
        reply = await http.post(
            "/sessions/seed", content=lone, headers={"content-type": "application/json"}
        )
        assert "rollout_id" in refused(reply, ErrorCode.INVALID_REQUEST, 422)
        reply = await http.post("/sessions/seed?rollout_id=%ED%A0%80", content=b"")
        assert "rollout_id" in refused(reply, ErrorCode.INVALID_REQUEST, 422)
        reply = await http.post(
            "/sessions/seed", content=nested, headers={"content-type": "application/json"}
        )
        assert "must name its rollout" in refused(reply, ErrorCode.INVALID_REQUEST, 422)
        spaced = b" \r\n\t" + json.dumps(seed(rid)).encode()
        reply = await http.post(
            "/sessions/seed", content=spaced, headers={"content-type": "application/json"}
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["rollout_id"] == rid
        assert (await http.get("/healthz")).status_code == 200


def test_web_concurrency_that_is_no_whole_number_is_refused_in_one_line(tmp_path: Path) -> None:
    declared = "²"  # str.isdigit() takes it, int() refuses it; more forms: tests/unit
    env = {**server_env(tmp_path, 0), "WEB_CONCURRENCY": declared}
    done = subprocess.run(
        [*SERVER, "resources", "--port", str(free_port())],
        env=env,
        capture_output=True,
        timeout=EXIT_S,
        check=False,
    )
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode != 0
    assert "Traceback" not in stderr, stderr
    assert f"WEB_CONCURRENCY={declared!r} is not a whole number" in stderr, stderr


def test_a_worker_that_dies_while_it_starts_ends_the_pod_with_the_lost_worker_code(
    tmp_path: Path, tmpdir_of_pod: Path
) -> None:
    env = {
        **server_env(tmp_path, 0),
        "TMPDIR": str(tmpdir_of_pod),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "testsupport.failing_worker", "--port", str(free_port())],
        env=env,
        capture_output=True,
        timeout=READY_S,
        check=False,
    )
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == WORKER_LOST_EXIT, stderr
    assert "worker 1 did not start" in stderr, stderr
    assert "RuntimeError" not in stderr, stderr
    assert socket_folders(tmpdir_of_pod) == []


def test_a_lost_worker_and_a_killed_pod_leave_no_socket_folder_behind(
    tmp_path: Path, tmpdir_of_pod: Path
) -> None:
    first = start_pod(tmp_path / "first", tmpdir_of_pod)
    try:
        (left,) = socket_folders(tmpdir_of_pod)
        first.process.send_signal(signal.SIGKILL)  # the main process alone, as the OOM killer
        first.process.wait(timeout=EXIT_S)
        wait_for_sync(
            lambda: not group_members(first.process.pid),
            timeout=EXIT_S,
            what="the workers to die with their main process",
        )
        assert socket_folders(tmpdir_of_pod) == [left]  # nothing could remove it
    finally:
        first.stop()
    second = start_pod(tmp_path / "second", tmpdir_of_pod)
    try:
        (now,) = socket_folders(tmpdir_of_pod)
        assert now != left  # the next pod removed the SIGKILLed pod's folder
        victim = worker_pids(second.process.pid)[1]
        os.kill(victim, signal.SIGKILL)
        assert second.process.wait(timeout=EXIT_S) == WORKER_LOST_EXIT
        assert socket_folders(tmpdir_of_pod) == []
    finally:
        second.stop()


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a SIGKILLed pod's workers until they die)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not (entry.name.isascii() and entry.name.isdigit()):
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found
