"""Real rollout server processes on loopback, and helpers to drive and inspect them.

A `Cluster` is the four reference servers of one rollout set, each its own process (group)
started as `rollout-server <role> ...`, with the `ROLLOUT_*` environment the operator would give
a pod and a temporary checkpoint root. `start(attempt)` launches all four at once and waits for
each one's `ready` line on stdout (no polling); `kill()` is the crash (SIGKILL to every process
group); `stop()` is the clean end (SIGINT, then SIGKILL for anything still there at the
deadline). Ports stay the same across restarts, as a Kubernetes Service address would.

Debug hooks (`--debug-hooks`) let a test hold an episode at an exact point and wait, server-side,
until it got there (`/debug/wait` long-polls), so no test needs to sleep.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import httpx
from rollout_protocol import API_PREFIX, Coordinator, HttpParticipantClient, Role
from rollout_protocol.conformance import RunRefused, Target, base_rollout_id
from rollout_servers.tasks import Task, shipped_tasks

TOKEN = "protocol-test-token"
SET_NAME = "ptest"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
SERVER = [str(Path(sys.executable).with_name("rollout-server"))]
"""The console script, as an operator's pod would run it."""


PORT_TRIES = 3
"""How many ports `ServerProcess.start` tries when the one it picked was taken before the bind."""
_PORT_TAKEN = "address already in use"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Cluster:
    """The four participants of one rollout set, as processes."""

    root: Path
    extra_args: Mapping[Role, list[str]] = field(default_factory=dict)
    ports: dict[Role, int] = field(default_factory=lambda: {role: free_port() for role in Role})
    attempt: int = 0
    processes: dict[Role, subprocess.Popen[bytes]] = field(default_factory=dict)
    pids: dict[int, dict[Role, int]] = field(default_factory=dict)
    """Process ids per attempt, so a test can show that a restart made fresh processes."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every process (e.g. a short `ROLLOUT_LEASE_GRACE_SECONDS`)."""
    ready_timeout_s: float = READY_TIMEOUT_S
    """How long `start` waits for every process's `ready` line (servers with several worker
    processes start each worker in a fresh interpreter: longer on a loaded machine)."""

    @property
    def checkpoint_root(self) -> Path:
        return self.root / "checkpoints"

    def url(self, role: Role) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def _args(self, role: Role) -> list[str]:
        resources = self.url(Role.RESOURCES)
        peers = {
            Role.ENVIRONMENT: ["--agent-url", self.url(Role.AGENT), "--resources-url", resources],
            Role.AGENT: ["--model-url", self.url(Role.MODEL), "--resources-url", resources],
            Role.MODEL: [],
            Role.RESOURCES: [],
        }[role]
        return [
            *SERVER,
            role.value,
            "--port",
            str(self.ports[role]),
            "--debug-hooks",
            "--log-level",
            "warning",
            *peers,
            *self.extra_args.get(role, []),
        ]

    def start(self, attempt: int) -> None:
        """Start fresh processes of every role under `attempt` and wait until all listen.

        A port picked free may be taken before its server binds it (another process of the run
        picked it too). On the first start every role gets a fresh port and all start again,
        `PORT_TRIES` times at most; a restart keeps its ports (the test holds their URLs)."""
        for tries_left in reversed(range(PORT_TRIES if not self.pids else 1)):
            try:
                self._start(attempt)
                return
            except RuntimeError as error:
                if not tries_left or _PORT_TAKEN not in str(error):
                    raise
                self.ports = {role: free_port() for role in Role}

    def _start(self, attempt: int) -> None:
        if self.processes:
            raise RuntimeError("stop or kill the running processes first")
        self.attempt = attempt
        env = {**server_env(self.checkpoint_root, attempt), **self.env}
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for role in Role:
            with (logs / f"{role.value}-a{attempt}.log").open("ab") as log:
                self.processes[role] = subprocess.Popen(
                    self._args(role),
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
        self.pids[attempt] = {role: p.pid for role, p in self.processes.items()}
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            for role, process in self.processes.items():
                _wait_ready(role, process, deadline, logs / f"{role.value}-a{attempt}.log")
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """The crash: SIGKILL every process group, reap them."""
        for process in self.processes.values():
            _signal_group(process, signal.SIGKILL)
        for process in self.processes.values():
            process.wait(timeout=STOP_TIMEOUT_S)
            _close(process)
        self.processes.clear()

    def stop(self) -> None:
        """The clean end: SIGINT (graceful), SIGKILL whatever is left at the deadline."""
        for process in self.processes.values():
            _signal_group(process, signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT_S)
            _close(process)
        self.processes.clear()

    def participants(self, session: aiohttp.ClientSession) -> list[HttpParticipantClient]:
        return [
            HttpParticipantClient(role, self.url(role), token=TOKEN, client=session)
            for role in Role
        ]

    def coordinator(self, session: aiohttp.ClientSession, **kwargs: Any) -> Coordinator:
        return Coordinator(self.participants(session), **kwargs)


def server_env(checkpoint_root: Path, attempt: int) -> dict[str, str]:
    """The environment the operator gives a participant pod."""
    env = dict(os.environ)
    env.update(
        ROLLOUT_SET=SET_NAME,
        ROLLOUT_INDEX="0",
        ROLLOUT_ATTEMPT=str(attempt),
        ROLLOUT_CHECKPOINT_ROOT=str(checkpoint_root),
        ROLLOUT_CONTROL_TOKEN=TOKEN,
    )
    return env


@dataclass
class ServerProcess:
    """One extra server process (outside a cluster), e.g. a relaying model server."""

    role: Role
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        root: Path,
        role: Role,
        *args: str,
        attempt: int = 0,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> ServerProcess:
        """Start `rollout-server <role> *args` with a pod's environment (and `env` over it).

        The port is free when picked but may be taken before the server binds it (another
        process of the run picked it too): a server that exits saying so is started again on
        another port, `PORT_TRIES` times at most."""
        root.mkdir(parents=True, exist_ok=True)
        for tries_left in reversed(range(PORT_TRIES)):
            port = free_port()
            log = root / f"{role.value}-{port}.log"
            with log.open("ab") as stderr:
                process = subprocess.Popen(
                    [*SERVER, role.value, "--port", str(port), "--log-level", "warning", *args],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env={**server_env(root / "checkpoints", attempt), **(env or {})},
                    start_new_session=True,
                )
            try:
                _wait_ready(role, process, time.monotonic() + ready_timeout_s, log)
            except BaseException as error:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT_S)
                if tries_left and isinstance(error, RuntimeError) and _PORT_TAKEN in str(error):
                    continue
                raise
            return cls(role, port, process)
        raise AssertionError("unreachable")  # pragma: no cover

    def wait_event(self, event: str, limit_s: float = 10.0) -> None:
        """Block until the process prints `{"event": <event>}` on stdout (or fail at the limit)."""
        _wait_ready(self.role, self.process, time.monotonic() + limit_s, None, event)

    def stop(self) -> int:
        """SIGINT, then SIGKILL at the deadline; returns the exit status."""
        _signal_group(self.process, signal.SIGINT)
        try:
            code = self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            code = self.process.wait(timeout=STOP_TIMEOUT_S)
        _close(self.process)
        return code


def worker_pids(pid: int) -> list[int]:
    """The worker processes of a pod's main process `pid` (its spawned children; not
    multiprocessing's resource tracker)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _wait_ready(
    role: Role,
    process: subprocess.Popen[bytes],
    deadline: float,
    log: Path | None,
    event: str = "ready",
) -> None:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{role.value} server: no {event!r} in time; log:\n{_tail(log)}")
            if selector.select(timeout=remaining):
                line = process.stdout.readline()
                if not line:
                    code = process.wait(timeout=5)
                    raise RuntimeError(
                        f"{role.value} server exited ({code}) before {event!r}; log:\n{_tail(log)}"
                    )
                if f'"{event}"'.encode() in line:
                    return


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None:
        return "(see the test's log)"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _close(process: subprocess.Popen[bytes]) -> None:
    if process.stdout is not None:
        process.stdout.close()


# --- helpers --------------------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def two_step_task(number: int, *, verify: str | None = None, seed: int = 7) -> Task:
    """A shipped task that needs two calculator calls (three model turns), with a given seed."""
    tasks = [t for t in shipped_tasks() if len(t.steps) == 2]
    task = tasks[number % len(tasks)]
    update: dict[str, Any] = {"seed": seed}
    if verify is not None:
        update["verify"] = verify
    return task.model_copy(update=update)


class Debug:
    """The `/debug/*` hooks of one server."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url

    async def _post(self, path: str, body: dict[str, Any], limit_s: float = 30.0) -> Any:
        reply = await self.http.post(self.url + path, json=body, timeout=limit_s)
        assert reply.status_code == 200, f"{self.url}{path} {body}: {reply.text}"
        return reply.json()

    async def arm(
        self, point: str, rollout_id: str | None = None, index: int | None = None
    ) -> None:
        await self._post("/debug/arm", {"point": point, "rollout_id": rollout_id, "index": index})

    async def release(self, point: str, rollout_id: str | None = None) -> None:
        await self._post("/debug/release", {"point": point, "rollout_id": rollout_id})

    async def paused(
        self, point: str, rollout_id: str | None = None, *, limit_s: float = 20.0
    ) -> None:
        """Return once an episode is held at `point` (server-side long poll, with a deadline)."""
        await self._post(
            "/debug/wait",
            {"point": point, "rollout_id": rollout_id, "paused": True, "timeout_s": limit_s},
            limit_s=limit_s + 5,
        )

    async def reached(
        self, point: str, rollout_id: str | None = None, *, count: int = 1, limit_s: float = 20.0
    ) -> None:
        await self._post(
            "/debug/wait",
            {"point": point, "rollout_id": rollout_id, "count": count, "timeout_s": limit_s},
            limit_s=limit_s + 5,
        )


async def stats(http: httpx.AsyncClient, cluster: Cluster, role: Role) -> dict[str, Any]:
    reply = await http.get(cluster.url(role) + "/stats", params={"detail": "true"}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


async def all_stats(http: httpx.AsyncClient, cluster: Cluster) -> dict[Role, dict[str, Any]]:
    return {role: await stats(http, cluster, role) for role in Role}


async def control_status(http: httpx.AsyncClient, cluster: Cluster, role: Role) -> dict[str, Any]:
    reply = await http.get(cluster.url(role) + API_PREFIX + "/status", headers=AUTH)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


async def run(
    http: httpx.AsyncClient, cluster: Cluster, rollout_id: str, attempt: int, task: Task
) -> httpx.Response:
    return await http.post(
        cluster.url(Role.ENVIRONMENT) + "/run",
        json={"rollout_id": rollout_id, "attempt": attempt, "task": task.wire()},
        timeout=60,
    )


async def run_until_crash(
    http: httpx.AsyncClient, cluster: Cluster, rollout_id: str, attempt: int, task: Task
) -> None:
    """A `/run` that the test expects to lose to a crash (the connection drops)."""
    try:
        reply = await run(http, cluster, rollout_id, attempt, task)
    except httpx.TransportError:
        return
    raise AssertionError(f"/run {rollout_id}@{attempt} answered before the crash: {reply.text}")


async def run_ok(
    http: httpx.AsyncClient, cluster: Cluster, rollout_id: str, attempt: int, task: Task
) -> dict[str, Any]:
    reply = await run(http, cluster, rollout_id, attempt, task)
    assert reply.status_code == 200, f"/run {rollout_id}@{attempt}: {reply.text}"
    data: dict[str, Any] = reply.json()
    return data


def completed_steps(server_stats: dict[str, Any], rollout_id: str, attempt: int) -> set[str]:
    steps = server_stats["rollouts"].get(rollout_id, {}).get(str(attempt), {})
    return {name for name, events in steps.items() if events.get("completed", 0) > 0}


def started_steps(server_stats: dict[str, Any], rollout_id: str, attempt: int) -> set[str]:
    steps = server_stats["rollouts"].get(rollout_id, {}).get(str(attempt), {})
    return {name for name, events in steps.items() if events.get("started", 0) > 0}


def tokens(model_stats: dict[str, Any], attempt: int, request_key: str) -> int:
    by_request = model_stats["tokens"].get(str(attempt), {}).get("by_request", {})
    return int(by_request.get(request_key, 0))


def model_calls(model_stats: dict[str, Any], rollout_id: str) -> dict[str, int]:
    """Tokens per model call of a rollout, summed over attempts, keyed by turn."""
    calls: dict[str, int] = {}
    for per_attempt in model_stats["tokens"].values():
        for key, count in per_attempt["by_request"].items():
            rid, _, turn = key.partition("/")
            if rid == rollout_id:
                calls[turn] = calls.get(turn, 0) + int(count)
    return calls


def deadline(seconds: float) -> float:
    return time.time() + seconds


class ReferenceDriver:
    """The conformance kit's `EpisodeDriver` over a `Cluster` of the four reference servers.

    Under the cluster's first attempt an episode is held by the agent's `turn` hook before its
    second turn (its first model call and tool call completed, the session parked between
    turns); the kit then checkpoints, crashes (`Cluster.kill`) and restarts the cluster, and the
    episode's `/run` under the next attempt continues it to its end.

    It is also the kit's `StepHoldingDriver`: `hold_in_step` gives the episode a task whose
    environment step `verify` waits on the resources server and holds it there (a wait step,
    which cannot park), instead of at the agent's turn.
    """

    def __init__(self, cluster: Cluster, http: httpx.AsyncClient) -> None:
        self.cluster = cluster
        self.http = http
        self.held_attempt = cluster.attempt
        self.agent = Debug(http, cluster.url(Role.AGENT))
        self.resources = Debug(http, cluster.url(Role.RESOURCES))
        self.armed: set[str] = set()
        self.in_step: set[str] = set()

    def task(self, rollout_id: str) -> Task:
        """One task per rollout id; the kit's uninterrupted twin of an id gets the same one."""
        base = base_rollout_id(rollout_id)
        return two_step_task(sum(base.encode()), verify="wait" if base in self.in_step else None)

    async def hold_in_step(self, rollout_id: str) -> None:
        self.in_step.add(rollout_id)
        self.armed.add(rollout_id)  # not held at the agent's turn
        await self.resources.arm("verify", rollout_id)

    async def wait_in_step(self, rollout_id: str, deadline_ts: float) -> None:
        await self.resources.paused(
            "verify", rollout_id, limit_s=max(1.0, deadline_ts - time.time())
        )

    async def release_step(self, rollout_id: str) -> None:
        await self.resources.release("verify", rollout_id)

    def participants(self) -> list[Target]:
        return [Target(self.cluster.url(role), role, TOKEN, client=self.http) for role in Role]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        if attempt == self.held_attempt and rollout_id not in self.armed:
            self.armed.add(rollout_id)  # the kit repeats a held /run: arm the hook once
            await self.agent.arm("turn", rollout_id, index=1)
        reply = await run(self.http, self.cluster, rollout_id, attempt, self.task(rollout_id))
        return RunRefused.reply(reply)

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        for rollout_id in rollout_ids:
            await self.agent.paused("turn", rollout_id, limit_s=max(1.0, deadline_ts - time.time()))

    async def crash(self) -> None:
        await anyio.to_thread.run_sync(self.cluster.kill)

    async def restart(self, attempt: int) -> None:
        await anyio.to_thread.run_sync(self.cluster.start, attempt)
