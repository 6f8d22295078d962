"""Node registration and heartbeats: the Node object, its Ready condition and its Lease.

The node lifecycle controller judges node health by the Lease in kube-node-lease; a lost node
(`lose-node`) stops renewing it and reports Ready=False at once, so the control plane reacts the
way it does to a real node failure, without waiting out the heartbeat grace period.
"""

from __future__ import annotations

import datetime
import logging
import platform
import uuid
from typing import Any

import anyio
from kubernetes_asyncio import client

from devcluster.config import NodeSpec

log = logging.getLogger("devcluster.agent.nodes")

REQUEST_TIMEOUT = 15
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_SECONDS = 40
KUBELET_VERSION = "v1.37.2"
_STATUS_EVERY_BEATS = 6


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeKeeper:
    def __init__(
        self, spec: NodeSpec, core: Any, coordination: Any, kubelet_port: int, interval: float
    ) -> None:
        self.spec = spec
        self._core = core
        self._coordination = coordination
        self._kubelet_port = kubelet_port
        self._interval = interval
        self.online = True
        self._back = anyio.Event()
        self._back.set()
        self._ready_since = _now()
        self._boot_id = str(uuid.uuid4())
        self._uid: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    async def wait_online(self) -> None:
        while not self.online:
            await self._back.wait()

    def _status(self, ready: bool, reason: str, message: str) -> dict[str, Any]:
        beat = _now()
        capacity = self.spec.capacity()

        def healthy(kind: str, reason: str, message: str) -> dict[str, Any]:
            return {
                "type": kind,
                "status": "False",
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": beat,
                "lastTransitionTime": self._ready_since,
            }

        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": beat,
                    "lastTransitionTime": self._ready_since,
                },
                healthy("MemoryPressure", "KubeletHasSufficientMemory", "declared capacity"),
                healthy("DiskPressure", "KubeletHasNoDiskPressure", "declared capacity"),
                healthy("PIDPressure", "KubeletHasSufficientPID", "declared capacity"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self._kubelet_port}},
            "nodeInfo": {
                "machineID": self.name,
                "systemUUID": self.name,
                "bootID": self._boot_id,
                "kernelVersion": platform.release(),
                "osImage": "devcluster (pods run as local processes)",
                "containerRuntimeVersion": "devcluster://0.1.0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _ready_status(self) -> dict[str, Any]:
        return self._status(True, "KubeletReady", "devcluster node agent is posting ready status")

    async def register(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.spec.all_labels()},
            "status": self._ready_status(),
        }
        try:
            created = await self._core.create_node(body, _request_timeout=REQUEST_TIMEOUT)
            self._uid = created.metadata.uid
        except client.ApiException as error:
            if error.status != 409:
                raise
            patched = await self._core.patch_node(
                self.name,
                {"metadata": {"labels": self.spec.all_labels()}},
                _request_timeout=REQUEST_TIMEOUT,
            )
            self._uid = patched.metadata.uid
            await self._post_status(self._ready_status())
        await self._renew_lease()
        log.info("node %s registered", self.name)

    async def _post_status(self, status: dict[str, Any]) -> None:
        await self._core.patch_node_status(
            self.name, {"status": status}, _request_timeout=REQUEST_TIMEOUT
        )

    async def _renew_lease(self) -> None:
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "renewTime": _micro_now(),
        }
        try:
            await self._coordination.patch_namespaced_lease(
                self.name, LEASE_NAMESPACE, {"spec": spec}, _request_timeout=REQUEST_TIMEOUT
            )
        except client.ApiException as error:
            if error.status != 404:
                raise
            metadata: dict[str, Any] = {"name": self.name, "namespace": LEASE_NAMESPACE}
            if self._uid:
                metadata["ownerReferences"] = [
                    {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self._uid}
                ]
            await self._coordination.create_namespaced_lease(
                LEASE_NAMESPACE,
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": metadata,
                    "spec": spec,
                },
                _request_timeout=REQUEST_TIMEOUT,
            )

    async def heartbeat_loop(self) -> None:
        beats = 0
        while True:
            await anyio.sleep(self._interval)
            if not self.online:
                continue
            beats += 1
            try:
                await self._renew_lease()
                if beats % _STATUS_EVERY_BEATS == 0:
                    await self._post_status(self._ready_status())
            except Exception as error:  # a missed beat is retried on the next one
                log.warning("heartbeat of node %s failed: %s", self.name, error)

    async def lose(self) -> None:
        """Stops heartbeats and reports NotReady; the caller kills the node's processes."""
        if not self.online:
            return
        self.online = False
        self._back = anyio.Event()
        self._ready_since = _now()
        await self._post_status(
            self._status(
                False,
                "NodeLost",
                "devcluster lose-node: the node's processes were killed and its heartbeat stopped",
            )
        )
        log.warning("node %s lost", self.name)

    async def restore(self) -> None:
        if self.online:
            return
        self._ready_since = _now()
        await self._post_status(self._ready_status())
        await self._renew_lease()
        self.online = True
        self._back.set()
        log.info("node %s restored", self.name)
