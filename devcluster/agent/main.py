"""The node agent process: registers nodes, follows their pods, serves logs and test hooks.

It runs until SIGTERM or SIGINT, then stops every pod process (SIGTERM, a short grace, SIGKILL)
without touching the API, which is usually going down at the same moment.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup
from kubernetes_asyncio import client

from devcluster.agent.fleet import fleet_kind
from devcluster.agent.ipam import LoopbackIpam
from devcluster.agent.nodes import NodeKeeper
from devcluster.agent.podmodel import Pod
from devcluster.agent.pods import REQUEST_TIMEOUT, ApiReader, PodWorker, Runtime
from devcluster.agent.server import AgentHooks, HookError, PodInfo, bind, build_app, serve
from devcluster.config import AgentConfig
from devcluster.ipranges import hold_octet
from devcluster.kube import open_api
from devcluster.paths import Layout
from devcluster.procs import has_marker, live_groups, stop_groups
from devcluster.state import MARKER_ENV
from devcluster.waiting import WaitTimeout, wait_for

log = logging.getLogger("devcluster.agent")

API_WAIT_SECONDS = 120.0
SHUTDOWN_GRACE_SECONDS = 3.0
_WATCH_SECONDS = 240
_PASSED_THROUGH = ("HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "USER")


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.layout = Layout(config.dir)
        self.workers: dict[str, PodWorker] = {}
        self._tg: TaskGroup | None = None
        self._range_lock: int | None = None
        """The fd holding this agent's pod IP range (see `devcluster.ipranges`)."""

    def _base_env(self) -> dict[str, str]:
        path = os.pathsep.join([*self.config.path_prefix, os.environ.get("PATH", "")])
        env = {name: os.environ[name] for name in _PASSED_THROUGH if name in os.environ}
        env["PATH"] = path
        env[MARKER_ENV] = self.config.cluster_id
        return env

    async def run(self) -> None:
        for folder in (self.layout.pods, self.layout.pod_logs, self.layout.pod_groups):
            folder.mkdir(parents=True, exist_ok=True)
        self._kill_stale_groups()
        self.layout.agent_pid.write_text(f"{os.getpid()}\n")
        self._range_lock = hold_octet(self.config.pod_ip_octet)
        sock = bind(self.config.admin_port)
        port = sock.getsockname()[1]
        async with (
            open_api(self.config.kubeconfig) as api,
            httpx.AsyncClient(verify=False) as http,  # probes: the kubelet skips TLS checks too
        ):
            core = client.CoreV1Api(api)
            coordination = client.CoordinationV1Api(api)
            await self._wait_for_api(core)
            nodes = {
                spec.name: NodeKeeper(spec, core, coordination, port, self.config.heartbeat_seconds)
                for spec in self.config.nodes
            }
            self.runtime = Runtime(
                core=core,
                reader=ApiReader(core),
                ipam=LoopbackIpam(self.config.pod_ip_octet),
                layout=self.layout,
                base_env=self._base_env(),
                nodes=nodes,
                http=http,
            )
            for keeper in nodes.values():
                await keeper.register()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(
                    serve, build_app(self._hooks()), sock, self.config.tls_cert, self.config.tls_key
                )
                for keeper in nodes.values():
                    tg.start_soon(keeper.heartbeat_loop)
                    tg.start_soon(self._follow_node, keeper.name)
                log.info(
                    "agent ready: nodes %s, endpoint https://127.0.0.1:%d", sorted(nodes), port
                )
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for received in signals:
                        log.info("received %s; stopping pod processes", received.name)
                        break
                await self._stop_processes()
                self.layout.agent_pid.unlink(missing_ok=True)
                tg.cancel_scope.cancel()

    def _kill_stale_groups(self) -> None:
        """Pod processes left by an agent of this cluster that died without stopping them: the
        pods they belong to are started again, so the old processes must not keep running."""
        groups = live_groups()
        for file in self.layout.pod_groups.iterdir():
            if file.name.isdigit():
                members = groups.get(int(file.name), [])
                if any(has_marker(pid, self.config.cluster_id) for pid in members):
                    log.warning(
                        "killing stale pod process group %s (%s)",
                        file.name,
                        file.read_text().strip(),
                    )
                    stop_groups([int(file.name)], SHUTDOWN_GRACE_SECONDS)
            file.unlink(missing_ok=True)

    async def _wait_for_api(self, core: Any) -> None:
        # Not just "answers": the API server creates kube-node-lease during its own bootstrap,
        # and registering before that would fail the first lease.
        async def answers() -> bool:
            await core.read_namespace("kube-node-lease", _request_timeout=5)
            return True

        try:
            await wait_for(
                answers, API_WAIT_SECONDS, "the API server", interval=0.3, ignore=(Exception,)
            )
        except WaitTimeout as error:
            raise SystemExit(
                f"devcluster agent: {error}; check --kubeconfig and the API server"
            ) from error

    async def _stop_processes(self) -> None:
        groups = [pid for worker in self.workers.values() for pid in worker.pids()]
        if groups:
            await anyio.to_thread.run_sync(stop_groups, groups, SHUTDOWN_GRACE_SECONDS)

    # ---- pods -----------------------------------------------------------------------------------
    def _observe(self, pod: Pod) -> None:
        worker = self.workers.get(pod.metadata.uid)
        if worker is not None:
            worker.update(pod)
            return
        worker = PodWorker(self.runtime, pod)
        self.workers[pod.metadata.uid] = worker
        if pod.metadata.deletion_timestamp is not None:
            worker.update(pod)
        assert self._tg is not None
        self._tg.start_soon(self._run_worker, worker)

    async def _run_worker(self, worker: PodWorker) -> None:
        try:
            await worker.run()
        except Exception:
            log.exception("worker of pod %s crashed; its processes were killed", worker.pod.key)
        finally:
            if worker.ip is not None:
                self.runtime.ipam.release(worker.ip)
            self.workers.pop(worker.uid, None)

    def _gone(self, uid: str) -> None:
        worker = self.workers.get(uid)
        if worker is not None:
            worker.gone()

    async def _follow_node(self, node: str) -> None:
        """List then watch this node's pods, relisting whenever the watch cannot resume."""
        selector = f"spec.nodeName={node}"
        core = self.runtime.core
        while True:
            try:
                response = await core.list_pod_for_all_namespaces(
                    field_selector=selector,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT,
                )
                listing = json.loads(await response.read())
                version = listing["metadata"]["resourceVersion"]
                seen = set()
                for item in listing["items"]:
                    pod = Pod.model_validate(item)
                    seen.add(pod.metadata.uid)
                    if pod.status.pod_ip:
                        self.runtime.ipam.reserve(pod.status.pod_ip)
                    self._observe(pod)
                for uid, worker in list(self.workers.items()):
                    if worker.pod.spec.node_name == node and uid not in seen:
                        worker.gone()
                await self._watch(selector, version)
            except Exception as error:
                log.warning("pod watch for node %s failed (%s); relisting", node, error)
                await anyio.sleep(1.0)

    async def _watch(self, selector: str, version: str) -> None:
        core = self.runtime.core
        while True:
            response = await core.list_pod_for_all_namespaces(
                field_selector=selector,
                watch=True,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=_WATCH_SECONDS,
                _preload_content=False,
                _request_timeout=(REQUEST_TIMEOUT, _WATCH_SECONDS + 60),
            )
            async with response:
                # Split lines by hand: aiohttp's line reader refuses lines over 64 KiB, and a pod
                # with a large annotation (kubectl's last-applied-configuration) can exceed that.
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip():
                            version = self._on_event(json.loads(line), version)

    def _on_event(self, event: dict[str, Any], version: str) -> str:
        """Applies one watch event and returns the resource version to resume from."""
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
        if kind == "BOOKMARK":
            return str(obj["metadata"]["resourceVersion"])
        pod = Pod.model_validate(obj)
        if kind == "DELETED":
            self._gone(pod.metadata.uid)
        else:
            self._observe(pod)
        return pod.metadata.resource_version or version

    # ---- hooks ----------------------------------------------------------------------------------
    def _find(self, namespace: str, name: str) -> PodWorker | None:
        for worker in self.workers.values():
            meta = worker.pod.metadata
            if meta.namespace == namespace and meta.name == name:
                return worker
        return None

    def _kill_pod(self, namespace: str, name: str, container: str | None) -> list[int]:
        worker = self._find(namespace, name)
        if worker is None:
            raise HookError(404, f"pod {namespace}/{name} is not on this agent's nodes")
        killed = worker.kill(container)
        if not killed:
            raise HookError(409, f"pod {namespace}/{name} has no running process to kill")
        return killed

    async def _set_node(self, name: str, online: bool) -> bool:
        keeper = self.runtime.nodes.get(name)
        if keeper is None:
            raise HookError(
                404,
                f"node {name!r} is not served by this agent "
                f"(it serves {sorted(self.runtime.nodes)})",
            )
        if online:
            await keeper.restore()
        else:
            await keeper.lose()
            lost = [worker for worker in self.workers.values() if worker.node is keeper]
            for worker in lost:
                worker.kill()
            for worker in lost:
                await worker.report_node_lost()
        return keeper.online

    def _pods(self) -> list[PodInfo]:
        return [
            PodInfo(
                pod=w.pod.key,
                node=w.node.name,
                ip=w.ip,
                phase=w.phase(),
                pids=w.pids(),
                in_process=fleet_kind(w.pod) is not None,
            )
            for w in self.workers.values()
        ]

    def _log_path(self, namespace: str, name: str, container: str) -> Path | None:
        worker = self._find(namespace, name)
        if worker is not None:
            for run in [*worker.init_runs, *worker.runs]:
                if run.spec.name == container:
                    return run.log_path
            return None
        # The pod may be gone from this agent (finished and deleted): fall back to the files.
        for candidate in (
            self.layout.pod_log(namespace, name, container),
            self.layout.pod_log(namespace, name),
        ):
            if candidate.exists():
                return candidate
        return None

    def _hooks(self) -> AgentHooks:
        return AgentHooks(self._kill_pod, self._set_node, self._pods, self._log_path)


def run(config: AgentConfig, verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    anyio.run(Agent(config).run)


def load_config(path: Path) -> AgentConfig:
    return AgentConfig.model_validate_json(path.read_text(encoding="utf-8"))
