"""Readiness probes (httpGet, tcpSocket, exec) with the kubelet's semantics for success."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import httpx

from devcluster.agent.podmodel import Container, Probe


def resolve_port(port: int | str, container: Container) -> int | None:
    """A probe port is a number or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    return next((p.container_port for p in container.ports if p.name == port), None)


async def run_probe(
    probe: Probe,
    container: Container,
    pod_ip: str,
    env: dict[str, str],
    cwd: Path,
    http: httpx.AsyncClient,
) -> tuple[bool, str]:
    """One probe attempt: (succeeded, what happened)."""
    timeout = max(probe.timeout_seconds, 1)
    if probe.http_get is not None:
        action = probe.http_get
        port = resolve_port(action.port, container)
        if port is None:
            return False, f"probe port {action.port!r} names no port of container {container.name}"
        host = action.host or pod_ip
        path = action.path if action.path.startswith("/") else f"/{action.path}"
        url = f"{action.scheme.lower()}://{host}:{port}{path}"
        headers = {h.name: h.value for h in action.http_headers}
        try:
            response = await http.get(url, headers=headers, timeout=timeout)
        except httpx.HTTPError as error:
            return False, f"GET {url}: {type(error).__name__}: {error}"
        ok = 200 <= response.status_code < 400
        return ok, f"GET {url}: HTTP {response.status_code}"
    if probe.tcp_socket is not None:
        action_tcp = probe.tcp_socket
        port = resolve_port(action_tcp.port, container)
        if port is None:
            return False, f"probe port {action_tcp.port!r} names no port"
        host = action_tcp.host or pod_ip
        try:
            with anyio.fail_after(timeout):
                stream = await anyio.connect_tcp(host, port)
            await stream.aclose()
        except (OSError, TimeoutError) as error:
            return False, f"connect {host}:{port}: {error}"
        return True, f"connect {host}:{port}: ok"
    if probe.exec_ is not None and probe.exec_.command:
        try:
            with anyio.fail_after(timeout):
                result = await anyio.run_process(
                    probe.exec_.command,
                    check=False,
                    env=env,
                    cwd=cwd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        except (OSError, TimeoutError) as error:
            return False, f"exec {probe.exec_.command}: {error}"
        return result.returncode == 0, f"exec exited with {result.returncode}"
    return False, "probe has no httpGet, tcpSocket or exec action"
