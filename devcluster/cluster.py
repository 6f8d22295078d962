"""The Python API over a devcluster, for tests, the demo and benchmarks."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from devcluster import controlplane
from devcluster.admin import AgentAdmin
from devcluster.config import DEFAULT_NODES, NodeSpec
from devcluster.errors import DevclusterError
from devcluster.paths import Layout
from devcluster.pki import ca_context
from devcluster.procs import marked_processes
from devcluster.state import ClusterState, read_state


class Cluster:
    """A running cluster in a directory. `start` owns it; `attach` borrows one already up."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.layout = Layout(state.dir)
        self.admin = AgentAdmin(state.agent_url, self.layout.pki / "ca.crt")

    @classmethod
    def start(
        cls,
        root: Path,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        timeout: float = 90.0,
        apiserver_port: int | None = None,
        progress: controlplane.Progress | None = None,
        timings: dict[str, float] | None = None,
    ) -> Cluster:
        state = controlplane.up(
            root,
            nodes=nodes,
            apiserver_port=apiserver_port,
            timeout=timeout,
            progress=progress or (lambda _message: None),
            timings=timings,
        )
        return cls(state)

    @classmethod
    def attach(cls, root: Path) -> Cluster:
        layout = Layout(root.resolve())
        state = read_state(layout.state_file)
        if state is None or state.phase != "ready" or not controlplane.running_pids(state):
            raise DevclusterError(
                f"no running devcluster in {layout.root}; start one with "
                f"`python -m devcluster up --dir {layout.root}`"
            )
        return cls(state)

    def stop(self, grace_seconds: float = 10.0) -> controlplane.StopReport:
        return controlplane.down(self.dir, grace_seconds, progress=lambda _message: None)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def dir(self) -> Path:
        return self.state.dir

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def ca(self) -> Path:
        return self.layout.pki / "ca.crt"

    def ssl_context(self) -> ssl.SSLContext:
        """Trusts this cluster's CA: for httpx clients talking to the API server directly."""
        return ca_context(self.ca)

    @property
    def server(self) -> str:
        return self.state.apiserver_url

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Runs the pinned kubectl on this cluster; with `check`, a failure raises with stderr."""
        kubectl = self.state.bin_dir / "kubectl"
        argv = [str(kubectl), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise DevclusterError(
                f"kubectl {' '.join(args)} failed with {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def restart(
        self,
        component: str,
        timeout: float = 60.0,
        while_down: Callable[[], None] | None = None,
    ) -> int:
        """Restart one control-plane process (`kube-apiserver`, ...) as an outage would;
        returns once it serves again. See `controlplane.restart`."""
        pid = controlplane.restart(self.dir, component, timeout, while_down)
        fresh = read_state(self.layout.state_file)
        if fresh is not None:
            self.state = fresh
        return pid

    def kill_pod(self, namespace: str, name: str, container: str | None = None) -> list[int]:
        return self.admin.kill_pod(namespace, name, container)

    def lose_node(self, name: str) -> None:
        self.admin.lose_node(name)

    def restore_node(self, name: str) -> None:
        self.admin.restore_node(name)

    def pod_log_path(self, namespace: str, name: str, container: str | None = None) -> Path:
        return self.layout.pod_log(namespace, name, container)

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        path = self.pod_log_path(namespace, name, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def processes(self) -> list[int]:
        """Live processes carrying this cluster's marker (control plane, agent, pods)."""
        return marked_processes(self.state.cluster_id)
