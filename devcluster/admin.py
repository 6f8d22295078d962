"""Client of the agent's test hooks, for the CLI, the Python API and tests."""

from __future__ import annotations

from pathlib import Path

import httpx

from devcluster.errors import DevclusterError
from devcluster.pki import ca_context

_TIMEOUT = 15.0


class AgentAdmin:
    """Calls the agent endpoint over HTTPS, verified against the cluster CA."""

    def __init__(self, url: str, ca: Path) -> None:
        self.url = url
        self.ca = ca

    def _check(self, response: httpx.Response) -> dict[str, object]:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise DevclusterError(f"node agent: {detail}")
        body: dict[str, object] = response.json()
        return body

    def _post(self, path: str, params: dict[str, str] | None = None) -> dict[str, object]:
        try:
            with httpx.Client(verify=ca_context(self.ca), timeout=_TIMEOUT) as http:
                return self._check(http.post(self.url + path, params=params))
        except httpx.TransportError as error:
            raise DevclusterError(
                f"cannot reach the node agent at {self.url} ({error}); is the cluster up?"
            ) from error

    async def _apost(self, path: str, params: dict[str, str] | None = None) -> dict[str, object]:
        try:
            async with httpx.AsyncClient(verify=ca_context(self.ca), timeout=_TIMEOUT) as http:
                return self._check(await http.post(self.url + path, params=params))
        except httpx.TransportError as error:
            raise DevclusterError(
                f"cannot reach the node agent at {self.url} ({error}); is the cluster up?"
            ) from error

    def pods(self) -> list[dict[str, object]]:
        """The agent's pods: key, node, IP, phase, pids and whether it is served in process."""
        try:
            with httpx.Client(verify=ca_context(self.ca), timeout=_TIMEOUT) as http:
                response = http.get(self.url + "/devcluster/pods")
        except httpx.TransportError as error:
            raise DevclusterError(
                f"cannot reach the node agent at {self.url} ({error}); is the cluster up?"
            ) from error
        if response.status_code >= 400:
            raise DevclusterError(f"node agent: {response.text}")
        listed: list[dict[str, object]] = response.json()
        return listed

    @staticmethod
    def _kill_path(namespace: str, name: str) -> str:
        return f"/devcluster/pods/{namespace}/{name}/kill"

    def kill_pod(self, namespace: str, name: str, container: str | None = None) -> list[int]:
        """SIGKILLs the pod's process groups; returns the killed group leaders' pids."""
        params = {"container": container} if container else None
        pids = self._post(self._kill_path(namespace, name), params)["pids"]
        assert isinstance(pids, list)
        return [int(pid) for pid in pids]

    async def kill_pod_async(
        self, namespace: str, name: str, container: str | None = None
    ) -> list[int]:
        params = {"container": container} if container else None
        pids = (await self._apost(self._kill_path(namespace, name), params))["pids"]
        assert isinstance(pids, list)
        return [int(pid) for pid in pids]

    def lose_node(self, name: str) -> None:
        """Kills every process on the node and marks it NotReady; its heartbeat stops."""
        self._post(f"/devcluster/nodes/{name}/lose")

    async def lose_node_async(self, name: str) -> None:
        await self._apost(f"/devcluster/nodes/{name}/lose")

    def restore_node(self, name: str) -> None:
        """Brings a lost node back: Ready again, and its pods restart per restartPolicy."""
        self._post(f"/devcluster/nodes/{name}/restore")

    async def restore_node_async(self, name: str) -> None:
        await self._apost(f"/devcluster/nodes/{name}/restore")
