"""NeMo Gym's servers and the Gym adapter as processes, run by a Gym virtual environment's
interpreter (nemo-gym 0.4 on Python >= 3.12, or 0.7 on Python 3.13, from PyPI; `make gym-venv`;
docs/gym.md).

The tests run on the project's own venv (Python 3.11), which has no nemo-gym: everything of Gym
runs in processes started with `gym_python(release)`, the interpreter of the environment
`gym/build-venv.sh <release>` builds or finds cached for this checkout's sources; the adapter's
tests run on each of `GYM_RELEASES`. A process is ready when
its `/healthz` answers 200 (polled with a deadline); `kill()` is SIGKILL to its process group.

Tasks are rows of a Gym dataset for the released stateful counter
(`resources_servers/example_session_state_mgmt`): a shipped arithmetic question with the counter's
`increment_counter` tool, `initial_count`, and `expected_count` the initial count plus every step's
value (the reference model's built-in backend increments by each step's value, docs/servers.md),
so the counter's own verify rewards 1.0 exactly when no increment was lost or doubled.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from rollout_gym import SUPPORTED_GYM_RELEASES
from rollout_servers.tasks import Task, calculate

from devcluster.waiting import wait_for_sync

from .server_processes import server_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gym-environment"
"""The example folder: the snapshot counter, the set's manifest."""
COUNTER = "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer"
"""NeMo Gym's stateful counter, as released."""
SNAPSHOT_COUNTER = "snapshot_counter:SnapshotCounter"
"""The released counter with the snapshot strategy's export and import routes (the example)."""
COUNTER_NAME = "counter"
INITIAL_COUNT = 3
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
BUILD_TIMEOUT_S = 1800.0

INCREMENT_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "increment_counter",
    "description": "",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"count": {"type": "integer", "description": ""}},
        "required": ["count"],
        "additionalProperties": False,
    },
}
"""The counter's tool as its released dataset (`data/example.jsonl`) declares it."""


GYM_RELEASES = SUPPORTED_GYM_RELEASES
"""The nemo-gym releases the adapter supports, each with its environment
(`gym/build-venv.sh <release>`)."""


@functools.cache
def gym_python(release: str = GYM_RELEASES[0]) -> Path:
    """The interpreter of the Gym environment of `release` for this checkout (built once per
    machine, cached)."""
    done = subprocess.run(
        [str(REPO / "gym" / "build-venv.sh"), release],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"gym/build-venv.sh failed:\n{done.stderr[-3000:]}"
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"


def counter_row(task: Task, initial: int = INITIAL_COUNT) -> dict[str, Any]:
    """One Gym dataset row for the counter: the task's question, the counter's tool, and the
    count the counter must reach."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": task.question}],
            "tools": [INCREMENT_TOOL],
        },
        "initial_count": initial,
        "expected_count": initial + sum(calculate(step) for step in task.steps),
    }


def free_port() -> int:
    from .server_processes import free_port as pick

    return pick()


@dataclass
class GymProcess:
    """`python -m rollout_gym.cli <kind> ...` on the Gym environment's interpreter."""

    kind: str
    url: str
    process: subprocess.Popen[bytes]

    @classmethod
    def start(
        cls,
        root: Path,
        kind: str,
        args: Sequence[str],
        *,
        attempt: int,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        release: str = GYM_RELEASES[0],
    ) -> GymProcess:
        """Started and answering `/healthz`, on the Gym environment of `release`; on `port` (a
        restart's) or a free one."""
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        root.mkdir(parents=True, exist_ok=True)
        full = server_env(root / "checkpoints", attempt)
        path = os.pathsep.join(filter(None, [str(EXAMPLE), full.get("PYTHONPATH")]))
        # the test venv's variables must not leak into the other interpreter
        full.pop("VIRTUAL_ENV", None)
        full.update(PYTHONPATH=path, ROLLOUT_LEASE_GRACE_SECONDS="1", **(env or {}))
        command = [str(gym_python(release)), "-m", "rollout_gym.cli", kind]
        command += ["--host", "127.0.0.1", "--port", str(port), "--drain-seconds", "1", *args]
        with (root / f"gym-{kind}-{attempt}-{port}.log").open("ab") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=log, env=full, start_new_session=True
            )
        started = cls(kind, url, process)
        try:
            wait_for_sync(
                started._ready, READY_TIMEOUT_S, f"gym {kind} at {url} to answer /healthz"
            )
        except BaseException:
            started.kill()
            raise
        return started

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"gym {self.kind} exited ({self.process.returncode})"
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        return False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM (drain, then exit), SIGKILL if it did not exit in time."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()


class Stoppable(Protocol):
    def stop(self) -> Any: ...


def stop_together(processes: Iterable[Stoppable | None]) -> None:
    """Stop each of `processes` (None: nothing to stop) at once: each one's graceful stop waits
    on its own drain, so one after another would add those waits up."""
    live = [process for process in processes if process is not None]
    with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
        for done in [pool.submit(process.stop) for process in live]:
            done.result()


def counter_value(resources_url: str, cookies: Mapping[str, str]) -> int:
    """The counter of one Gym session, read from the resources server's own state
    (`POST /get_counter_value` with the session's cookie)."""
    header = "; ".join(f"{k}={v}" for k, v in cookies.items())
    reply = httpx.post(
        resources_url + "/get_counter_value", json={}, headers={"Cookie": header}, timeout=10
    )
    assert reply.status_code == 200, reply.text
    return int(reply.json()["count"])
