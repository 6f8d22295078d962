"""One worker per pod: runs its containers as process groups and reports status like a kubelet.

A worker is the single writer of its pod's status. Runners (one per container) change in-memory
state and mark the worker dirty; the report loop writes the status when it changed. While the
pod's node is lost, nothing is written and nothing restarts, as on a machine that went away.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
import anyio
import httpx
from anyio.abc import Process
from kubernetes_asyncio import client

from devcluster.agent.env import ConfigError, SpecError, command_line, container_env
from devcluster.agent.fleet import FleetContainer, FleetHost, FleetSpecError, fleet_kind
from devcluster.agent.ipam import LoopbackIpam
from devcluster.agent.nodes import NodeKeeper
from devcluster.agent.podmodel import Container, Pod
from devcluster.agent.probes import run_probe
from devcluster.agent.volumes import prepare_volumes, secret_volume_env
from devcluster.paths import Layout

log = logging.getLogger("devcluster.agent.pods")

REQUEST_TIMEOUT = 15
API_SLOTS = 32
"""Pod workers' API requests open at once. Starting 1,600 fleet pods, hundreds of status writes
queued in the client's pool timed out there (the pool wait counts against the request timeout)
and were retried, adding to the load they were waiting on."""
HOST_IP = "127.0.0.1"
_GONE = (404, 409, 422)  # deleted, or replaced by a pod with the same name and a new UID
_BACKOFF_START = 1.0
_BACKOFF_MAX = 30.0
_CONFIG_RETRY_SECONDS = 2.0
_BACKOFF_RESET_SECONDS = 60.0  # a container that ran this long starts its back-off over


def _is_dir(path: str) -> bool:
    return Path(path).is_dir()


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def signal_group(process: Process | FleetContainer, sig: int) -> None:
    """Signal a container: its process group, or the in-process fleet container."""
    if isinstance(process, FleetContainer):
        process.send_signal(sig)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def exit_code(returncode: int) -> int:
    """Signals become 128 + signal number, as container runtimes report them (SIGKILL: 137)."""
    return 128 - returncode if returncode < 0 else returncode


class ApiReader:
    """Secret and ConfigMap lookups for env resolution; a missing object reads as None.

    Found objects are kept for `CACHE_SECONDS`, and concurrent lookups of one object share a
    request, as the kubelet's secret and config map managers do: a set of 16 pods that all
    take their token from one Secret reads it once, not 16 times (1,600 reads when a fleet of
    100 sets starts). A missing object is looked up again on every retry."""

    CACHE_SECONDS: Final = 10.0

    def __init__(self, core: Any, slots: int = API_SLOTS) -> None:
        self._core = core
        self.slots = anyio.Semaphore(slots)
        """Open API requests of pod workers (status writes, these lookups): the rest wait here,
        not in the client's pool, where waiting counts against `REQUEST_TIMEOUT`."""
        self._found: dict[tuple[str, str, str], tuple[float, dict[str, str]]] = {}
        self._pending: dict[tuple[str, str, str], anyio.Event] = {}

    async def _cached(
        self, key: tuple[str, str, str], read: Callable[[], Awaitable[dict[str, str] | None]]
    ) -> dict[str, str] | None:
        while True:
            found = self._found.get(key)
            if found is not None and anyio.current_time() - found[0] < self.CACHE_SECONDS:
                return dict(found[1])
            pending = self._pending.get(key)
            if pending is None:
                break
            await pending.wait()
            if key not in self._found:  # that lookup failed or found nothing: look ourselves
                break
        done = self._pending[key] = anyio.Event()
        try:
            value = await read()
            if value is not None:
                self._found[key] = (anyio.current_time(), dict(value))
            return value
        finally:
            del self._pending[key]
            done.set()

    async def config_map(self, namespace: str, name: str) -> dict[str, str] | None:
        async def read() -> dict[str, str] | None:
            try:
                async with self.slots:
                    found = await self._core.read_namespaced_config_map(
                        name, namespace, _request_timeout=REQUEST_TIMEOUT
                    )
            except client.ApiException as error:
                if error.status == 404:
                    return None
                raise
            return dict(found.data or {})

        return await self._cached(("configmap", namespace, name), read)

    async def secret(self, namespace: str, name: str) -> dict[str, str] | None:
        async def read() -> dict[str, str] | None:
            try:
                async with self.slots:
                    found = await self._core.read_namespaced_secret(
                        name, namespace, _request_timeout=REQUEST_TIMEOUT
                    )
            except client.ApiException as error:
                if error.status == 404:
                    return None
                raise
            return {k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()}

        return await self._cached(("secret", namespace, name), read)


@dataclass
class Runtime:
    """What every worker shares: the API, addresses, files and the base process environment."""

    core: Any
    reader: ApiReader
    ipam: LoopbackIpam
    layout: Layout
    base_env: Mapping[str, str]
    nodes: Mapping[str, NodeKeeper]
    http: httpx.AsyncClient
    fleet: FleetHost = field(default_factory=FleetHost)
    """Serves the containers of fleet pods in this process (`devcluster.agent.fleet`)."""


@dataclass
class ContainerRun:
    spec: Container
    log_path: Path
    restart_count: int = 0
    state: Literal["waiting", "running", "terminated"] = "waiting"
    reason: str | None = "ContainerCreating"
    message: str | None = None
    code: int | None = None
    signal: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    last_terminated: dict[str, Any] | None = None
    ready: bool = False
    done: bool = False
    process: Process | FleetContainer | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def wait(self, reason: str, message: str | None = None) -> None:
        if self.state == "terminated":
            self.last_terminated = self._terminated()
        self.state, self.reason, self.message, self.ready = "waiting", reason, message, False

    def start(self, process: Process | FleetContainer) -> None:
        if self.state == "terminated":
            self.last_terminated = self._terminated()
        self.process = process
        self.state, self.reason, self.message = "running", None, None
        self.code = self.signal = None
        self.started_at, self.finished_at = now(), None

    def terminate(
        self, returncode: int, reason: str | None = None, message: str | None = None
    ) -> None:
        self.code = exit_code(returncode)
        self.signal = -returncode if returncode < 0 else None
        self.state = "terminated"
        self.reason = reason or ("Completed" if self.code == 0 else "Error")
        self.message = message
        self.finished_at = now()
        self.started_at = self.started_at or self.finished_at
        self.ready = False

    def _terminated(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "exitCode": self.code if self.code is not None else 0,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }
        if self.signal:
            body["signal"] = self.signal
        if self.message:
            body["message"] = self.message
        return body

    def status(self, uid: str) -> dict[str, Any]:
        if self.state == "running":
            state: dict[str, Any] = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {"terminated": self._terminated()}
        else:
            waiting: dict[str, Any] = {"reason": self.reason}
            if self.message:
                waiting["message"] = self.message
            state = {"waiting": waiting}
        body: dict[str, Any] = {
            "name": self.spec.name,
            "image": self.spec.image or "none",
            "imageID": "",
            "containerID": f"devcluster://{uid[:8]}-{self.spec.name}-{self.restart_count}",
            "ready": self.ready,
            "started": self.state == "running",
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        return body


class PodWorker:
    def __init__(self, runtime: Runtime, pod: Pod) -> None:
        self.rt = runtime
        self.pod = pod
        self.uid = pod.metadata.uid
        self.node: NodeKeeper = runtime.nodes[pod.spec.node_name or ""]
        meta = pod.metadata
        self.workdir = runtime.layout.pods / f"{meta.namespace}_{meta.name}_{self.uid[:8]}"
        self.init_runs = [
            ContainerRun(c, runtime.layout.pod_log(meta.namespace, meta.name, c.name))
            for c in pod.spec.init_containers
        ]
        self.runs = [
            ContainerRun(
                c,
                runtime.layout.pod_log(meta.namespace, meta.name, None if i == 0 else c.name),
            )
            for i, c in enumerate(pod.spec.containers)
        ]
        self.ip: str | None = None
        self.start_time: str | None = None
        self.initialized = not self.init_runs
        self.failure: tuple[str, str] | None = None
        self.stop_event = anyio.Event()
        self._halt = anyio.Event()  # deletion or pod failure: stop the containers
        self.removed = False
        self._dirty = anyio.Event()
        self._transitions: dict[str, tuple[bool, str]] = {}
        self._written: dict[str, Any] | None = None

    # ---- inputs from the informer and the admin endpoint -------------------------------------
    def update(self, pod: Pod) -> None:
        self.pod = pod
        if pod.metadata.deletion_timestamp is not None:
            self.stop_event.set()
            self._halt.set()

    def gone(self) -> None:
        """The object was removed without us (force deletion): stop the processes quickly."""
        self.removed = True
        self.stop_event.set()
        self._halt.set()

    def kill(self, container: str | None = None) -> list[int]:
        """SIGKILLs the process groups of running containers; the runners take it from there."""
        killed = []
        for run in [*self.init_runs, *self.runs]:
            if run.running and (container is None or run.spec.name == container):
                assert run.process is not None
                signal_group(run.process, signal.SIGKILL)
                killed.append(run.process.pid)
        return killed

    async def report_node_lost(self) -> None:
        """Marks the pod not Ready, as the node lifecycle controller would once the node's
        heartbeat grace period ran out; here it happens at once so tests need not wait 50 s.
        Nothing else is written until the node is back: a lost node reports nothing."""
        self._written = None  # after a restore, the next status is written in full
        reason, message = "NodeLost", f"node {self.node.name} was lost (devcluster lose-node)"
        conditions = [
            {
                "type": kind,
                "status": "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": now(),
                "lastProbeTime": None,
            }
            for kind in ("ContainersReady", "Ready")
        ]
        for run in [*self.init_runs, *self.runs]:
            run.ready = False
        meta = self.pod.metadata
        try:
            await self.rt.core.patch_namespaced_pod_status(
                meta.name,
                meta.namespace,
                self._patch({"conditions": conditions}),
                _request_timeout=REQUEST_TIMEOUT,
            )
        except client.ApiException as error:
            if error.status not in _GONE:
                log.warning("marking pod %s not ready failed: %s", self.pod.key, error)

    def pids(self) -> list[int]:
        """Process groups of running containers (fleet containers have none of their own)."""
        return [
            r.process.pid
            for r in [*self.init_runs, *self.runs]
            if r.running and r.process and not isinstance(r.process, FleetContainer)
        ]

    def mark_dirty(self) -> None:
        self._dirty.set()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._report_loop)
            try:
                await self._lifecycle()
            finally:
                self._kill_all_now()
            tg.cancel_scope.cancel()
        self._cleanup_files()

    async def _lifecycle(self) -> None:
        await self.node.wait_online()
        phase = self.pod.status.phase
        if phase in ("Succeeded", "Failed"):
            # Finished before this agent started: nothing to run, only the deletion to finish.
            await self._await_stop()
            await self._finish_deletion()
            return
        if self.pod.status.pod_ip and self.pod.status.pod_ip.startswith("127."):
            self.ip = self.pod.status.pod_ip
            self.rt.ipam.reserve(self.ip)
        else:
            self.ip = self.rt.ipam.allocate()
        self.start_time = self.pod.status.start_time or now()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.mark_dirty()
        try:
            containers = [*self.pod.spec.init_containers, *self.pod.spec.containers]
            for container in containers:
                command_line(container, {})  # no command: fail before anything starts
            prepare_volumes(self.pod, containers)
        except SpecError as error:
            self._fail(error.reason, str(error))
        if self.failure is None and not self.stop_event.is_set():
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._cancel_on_stop, scope)
                    await self._run_containers()
                    tg.cancel_scope.cancel()
        if self.stop_event.is_set() or self.failure is not None:
            await self.node.wait_online()
            grace = self._grace_seconds() if not self.removed else 2.0
            await self._terminate(grace if self.failure is None else 2.0)
        await self._flush()
        await self._await_stop()
        await self._finish_deletion()

    async def _cancel_on_stop(self, scope: anyio.CancelScope) -> None:
        await self._halt.wait()
        await self.node.wait_online()  # a lost node does not act on deletions until it is back
        scope.cancel()

    async def _await_stop(self) -> None:
        await self.stop_event.wait()
        await self.node.wait_online()

    def _grace_seconds(self) -> float:
        meta_grace = self.pod.metadata.deletion_grace_period_seconds
        grace = (
            meta_grace if meta_grace is not None else self.pod.spec.termination_grace_period_seconds
        )
        return float(max(grace, 0))

    async def _run_containers(self) -> None:
        for run in self.init_runs:
            if not await self._run_container(run, init=True):
                return
        self.initialized = True
        self.mark_dirty()
        async with anyio.create_task_group() as tg:
            for run in self.runs:
                tg.start_soon(self._run_container, run, False)

    async def _run_container(self, run: ContainerRun, init: bool) -> bool:
        """Runs one container until it is done for good; True when it finally exited 0."""
        policy = self.pod.spec.restart_policy
        backoff = _BACKOFF_START
        while True:
            await self.node.wait_online()
            try:
                argv, env = await self._prepare(run)
            except ConfigError as error:
                run.wait("CreateContainerConfigError", str(error))
                self.mark_dirty()
                await anyio.sleep(_CONFIG_RETRY_SECONDS)
                continue
            except (client.ApiException, aiohttp.ClientError, TimeoutError) as error:
                # Reading a Secret or ConfigMap failed (a busy or restarting API server): retry,
                # as the kubelet does, instead of giving the pod up.
                log.warning(
                    "pod %s: reading its env sources failed (%r); retrying", self.pod.key, error
                )
                await anyio.sleep(_CONFIG_RETRY_SECONDS)
                continue
            except SpecError as error:
                self._fail(error.reason, str(error))
                return False
            started = anyio.current_time()
            if fleet_kind(self.pod) is not None and not init:
                await self._run_in_process(run, env)
                if self.failure is not None:
                    return False
            else:
                await self._run_process(run, argv, env, init)
            self.mark_dirty()
            success = run.code == 0
            if init:
                if success:
                    run.done = True
                    return True
                if policy == "Never":
                    run.done = True
                    self._fail(
                        "InitContainerFailed",
                        f"init container {run.spec.name!r} exited with {run.code}",
                    )
                    return False
            elif policy == "Never" or (policy == "OnFailure" and success):
                run.done = True
                self.mark_dirty()
                return success
            if anyio.current_time() - started > _BACKOFF_RESET_SECONDS:
                backoff = _BACKOFF_START
            run.restart_count += 1
            run.wait("CrashLoopBackOff", f"back-off {backoff:g}s restarting failed container")
            self.mark_dirty()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)

    async def _run_process(
        self, run: ContainerRun, argv: list[str], env: dict[str, str], init: bool
    ) -> None:
        """Run the container as a process group until it exits; record how it ended."""
        try:
            with run.log_path.open("ab") as out:
                process = await anyio.open_process(
                    argv,
                    cwd=self._cwd(run),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as error:
            run.terminate(128, "StartError", f"failed to start {argv[0]!r}: {error}")
            return
        self._record_group(process.pid)
        run.env = env
        run.start(process)
        run.ready = run.spec.readiness_probe is None
        self.mark_dirty()
        async with anyio.create_task_group() as tg:
            if run.spec.readiness_probe is not None and not init:
                tg.start_soon(self._probe_loop, run, process)
            returncode = await process.wait()
            tg.cancel_scope.cancel()
        self._forget_group(process.pid)
        # The container is the whole process group: leave no descendant behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        run.terminate(returncode)

    async def _run_in_process(self, run: ContainerRun, env: dict[str, str]) -> None:
        """Serve a fleet pod's container in this process (`devcluster.agent.fleet`)."""
        assert self.ip is not None
        try:
            container = await self.rt.fleet.start(self.pod, run.spec, env, self.ip)
        except FleetSpecError as error:
            self._fail(error.reason, str(error))
            return
        except OSError as error:
            run.terminate(128, "StartError", f"fleet participant could not listen: {error}")
            return
        run.env = env
        run.start(container)
        run.ready = run.spec.readiness_probe is None
        self.mark_dirty()
        async with anyio.create_task_group() as tg:
            if run.spec.readiness_probe is not None:
                tg.start_soon(self._probe_loop, run, container)
            returncode = await container.wait()
            tg.cancel_scope.cancel()
        run.terminate(returncode)

    def _cwd(self, run: ContainerRun) -> Path:
        if run.spec.working_dir:
            return Path(run.spec.working_dir)
        return self.workdir

    async def _prepare(self, run: ContainerRun) -> tuple[list[str], dict[str, str]]:
        assert self.ip is not None
        allocatable = self.node.spec.capacity()
        pod_env = await container_env(self.pod, run.spec, self.ip, allocatable, self.rt.reader)
        env = {**self.rt.base_env, "HOSTNAME": self.pod.metadata.name, **pod_env}
        env = await secret_volume_env(self.pod, run.spec, env, self.rt.reader, self.workdir)
        argv = command_line(run.spec, env)
        if "/" not in argv[0] and fleet_kind(self.pod) is None:
            found = shutil.which(argv[0], path=env.get("PATH", ""))
            if found is None:
                raise SpecError(
                    "ExecutableNotFound",
                    f'container {run.spec.name!r}: exec: "{argv[0]}": executable file not found '
                    f"in $PATH ({env.get('PATH', '')})",
                )
            argv[0] = found
        if run.spec.working_dir and not _is_dir(run.spec.working_dir):
            raise SpecError(
                "WorkingDirMissing",
                f"container {run.spec.name!r}: workingDir {run.spec.working_dir} does not exist on "
                "this machine",
            )
        return argv, env

    async def _probe_loop(self, run: ContainerRun, process: Process | FleetContainer) -> None:
        probe = run.spec.readiness_probe
        assert probe is not None
        assert self.ip is not None
        await anyio.sleep(probe.initial_delay_seconds)
        successes = failures = 0
        while process.returncode is None:
            ok, what = await run_probe(
                probe, run.spec, self.ip, run.env, self._cwd(run), self.rt.http
            )
            if ok:
                successes, failures = successes + 1, 0
                if not run.ready and successes >= max(probe.success_threshold, 1):
                    run.ready = True
                    self.mark_dirty()
            else:
                successes, failures = 0, failures + 1
                if run.ready and failures >= max(probe.failure_threshold, 1):
                    run.ready = False
                    self.mark_dirty()
                log.debug("readiness probe of %s/%s: %s", self.pod.key, run.spec.name, what)
            await anyio.sleep(max(probe.period_seconds, 1))

    def _fail(self, reason: str, message: str) -> None:
        log.warning("pod %s failed: %s: %s", self.pod.key, reason, message)
        self.failure = (reason, message)
        self._halt.set()
        for run in [*self.init_runs, *self.runs]:
            if run.state == "waiting":
                run.wait(reason, message)
            run.done = True
        self.mark_dirty()

    async def _terminate(self, grace: float) -> None:
        """SIGTERM, wait up to `grace` seconds, SIGKILL: the kubelet's graceful stop."""
        # "running" by state, not by process: a runner cancelled just as its process exited has
        # not recorded the exit yet, and that is done here.
        running = [r for r in [*self.init_runs, *self.runs] if r.state == "running" and r.process]
        for run in running:
            assert run.process is not None
            if run.process.returncode is None:
                signal_group(run.process, signal.SIGTERM)
        with anyio.move_on_after(grace):
            for run in running:
                assert run.process is not None
                await run.process.wait()
        for run in running:
            assert run.process is not None
            signal_group(run.process, signal.SIGKILL)
            with anyio.fail_after(10):
                returncode = await run.process.wait()
            self._forget_group(run.process.pid)
            run.terminate(returncode)
        for run in [*self.init_runs, *self.runs]:
            run.done = True
        self.mark_dirty()

    def _kill_all_now(self) -> None:
        for run in [*self.init_runs, *self.runs]:
            if run.process is not None:
                signal_group(run.process, signal.SIGKILL)
                self._forget_group(run.process.pid)

    async def _finish_deletion(self) -> None:
        if self.removed:
            return
        meta = self.pod.metadata
        try:
            await self.rt.core.delete_namespaced_pod(
                meta.name,
                meta.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
                ),
                _request_timeout=REQUEST_TIMEOUT,
            )
        except client.ApiException as error:
            if error.status not in (404, 409):
                raise

    # ---- process-group bookkeeping for `down` ---------------------------------------------------
    def _record_group(self, pgid: int) -> None:  # process pods only: fleet ones have no group
        (self.rt.layout.pod_groups / str(pgid)).write_text(f"{self.pod.key}\n")

    def _forget_group(self, pgid: int) -> None:
        if pgid != os.getpid():  # a fleet container's "pid" is the agent's
            (self.rt.layout.pod_groups / str(pgid)).unlink(missing_ok=True)

    def _cleanup_files(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- status ---------------------------------------------------------------------------------
    def phase(self) -> str:
        if self.failure is not None:
            return "Failed"
        if not self.initialized:
            return "Pending"
        if any(r.state == "running" for r in self.runs):
            return "Running"
        if self.runs and all(r.done for r in self.runs):
            return "Succeeded" if all(r.code == 0 for r in self.runs) else "Failed"
        if any(r.restart_count or r.state == "terminated" for r in self.runs):
            return "Running"
        return "Pending"

    def _condition(
        self, kind: str, ok: bool, reason: str | None = None, message: str | None = None
    ) -> dict[str, Any]:
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != ok:
            self._transitions[kind] = (ok, now())
        body: dict[str, Any] = {
            "type": kind,
            "status": "True" if ok else "False",
            "lastProbeTime": None,
            "lastTransitionTime": self._transitions[kind][1],
        }
        # Explicit nulls: the status is a strategic merge patch, and a condition turning True must
        # lose the reason it had while False.
        body["reason"] = reason if not ok else None
        body["message"] = message if not ok else None
        return body

    def status(self) -> dict[str, Any]:
        phase = self.phase()
        terminal = phase in ("Succeeded", "Failed")
        unready = [r.spec.name for r in self.runs if not r.ready]
        containers_ready = not unready and not terminal
        not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
        not_ready_message = (
            None if terminal else f"containers with unready status: [{' '.join(unready)}]"
        )
        gates = {c.type: c.status for c in self.pod.status.conditions}
        gates_ok = all(gates.get(g.condition_type) == "True" for g in self.pod.spec.readiness_gates)
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", self.ip is not None and not terminal),
                self._condition(
                    "Initialized", self.initialized or terminal, "ContainersNotInitialized"
                ),
                self._condition(
                    "ContainersReady", containers_ready, not_ready_reason, not_ready_message
                ),
                self._condition(
                    "Ready",
                    containers_ready and gates_ok,
                    not_ready_reason,
                    not_ready_message if not containers_ready else "readiness gates are not met",
                ),
            ],
            "containerStatuses": [r.status(self.uid) for r in self.runs],
        }
        if self.init_runs:
            status["initContainerStatuses"] = [r.status(self.uid) for r in self.init_runs]
        if self.ip is not None:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        if self.failure is not None:
            status["reason"], status["message"] = self.failure
        return status

    async def _report_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            await self.node.wait_online()
            try:
                await self._write_status()
            except Exception as error:  # keep reporting: the next change retries
                log.warning("status update of %s failed: %s", self.pod.key, error)
                await anyio.sleep(1.0)
                self.mark_dirty()

    def _patch(self, status: dict[str, Any]) -> dict[str, Any]:
        """The UID makes the patch fail on a new pod that reuses this one's name (as the
        kubelet's status patches do), instead of overwriting that pod's status."""
        return {"metadata": {"uid": self.uid}, "status": status}

    async def _flush(self) -> None:
        with contextlib.suppress(Exception):
            await self._write_status()

    async def _write_status(self) -> None:
        if self.removed or not self.node.online:
            return
        status = self.status()
        if status == self._written:
            return
        meta = self.pod.metadata
        try:
            async with self.rt.reader.slots:
                await self.rt.core.patch_namespaced_pod_status(
                    meta.name,
                    meta.namespace,
                    self._patch(status),
                    _request_timeout=REQUEST_TIMEOUT,
                )
        except client.ApiException as error:
            if error.status in _GONE:
                return
            raise
        self._written = status
