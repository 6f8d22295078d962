"""The Python API over a devcluster, for tests, the demo and benchmarks."""

from __future__ import annotations

import json
import ssl
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from devcluster import containernode, controlplane, s3
from devcluster.admin import AgentAdmin
from devcluster.config import DEFAULT_NODES, NodeSpec
from devcluster.errors import DevclusterError
from devcluster.paths import Layout
from devcluster.pki import ca_context
from devcluster.procs import marked_processes
from devcluster.state import ClusterState, ContainerNodeState, NodeRuntime, S3State, read_state


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
        node_runtime: NodeRuntime = "process",
        images: Sequence[Path] = (),
        s3_bucket: str | None = None,
    ) -> Cluster:
        """`node_runtime="containerd"`: one real kubelet node (containerd, runc, kube-proxy, a
        CNI bridge in its own network namespace) instead of the process node agent; `images`
        (OCI/Docker archives) are imported into its containerd before the kubelet starts.
        `s3_bucket`: also an S3 server on loopback with that bucket (devcluster/s3.py; `stop`
        removes its data)."""
        state = controlplane.up(
            root,
            nodes=nodes,
            apiserver_port=apiserver_port,
            timeout=timeout,
            progress=progress or (lambda _message: None),
            timings=timings,
            node_runtime=node_runtime,
            images=images,
        )
        if s3_bucket is not None:
            try:
                s3.start_for_cluster(state.dir, s3_bucket)
            except BaseException:
                controlplane.down(state.dir, progress=lambda _message: None)
                raise
            state = read_state(Layout(state.dir).state_file) or state
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
    def s3(self) -> S3State | None:
        """The cluster's S3 server (endpoint, bucket, credential files), if it started one."""
        return self.state.s3

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

    def kill_pod(
        self, namespace: str, name: str, container: str | None = None, *, sig: str = "SIGKILL"
    ) -> list[int]:
        """SIGKILLs a pod's container (the first, or the named one): on the process node the
        agent kills its processes and returns their pids; on the container node containerd's
        shim signals the container's main process (returns [] : its pid is the shim's). On the
        container node `sig` may be another signal (SIGSTOP freezes the container's main
        process, SIGCONT thaws it)."""
        if self.state.container_node is None:
            if sig != "SIGKILL":
                raise DevclusterError(f"the process node only kills pods ({sig} asked)")
            return self.admin.kill_pod(namespace, name, container)
        result = self.kubectl("get", "pod", name, "-n", namespace, "-o", "json")
        containerd_id = _container_id(result.stdout, container)
        containernode.kill_container(self.state, containerd_id, sig)
        return []

    # --- the container node (node_runtime="containerd") ---------------------------------------

    @property
    def node_runtime(self) -> NodeRuntime:
        return self.state.node_runtime

    @property
    def containerd_socket(self) -> Path:
        """The node's containerd socket (CRI and containerd API); namespace `k8s.io`."""
        return self._container_node().containerd_socket

    containerd_namespace = containernode.CONTAINERD_NAMESPACE

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs the pinned `ctr` on the node's containerd in namespace `k8s.io`."""
        self._container_node()
        argv = containernode.ctr_argv(self.state, *args)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise DevclusterError(
                f"ctr {' '.join(args)} failed with {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def import_image(self, archive: Path, timeout: float = 300.0) -> None:
        """Imports an OCI or Docker image archive (e.g. `buildah push IMG oci-archive:FILE:NAME`)
        into the node's containerd, unpacked, so pods run it with `imagePullPolicy: Never` or
        `IfNotPresent`. Its name comes from the archive's annotations."""
        self._container_node()
        containernode.import_image(self.state, archive, timeout)

    def node_leftovers(self) -> list[str]:
        """What the container node still has on this machine (mounts, cgroups, veth, network
        namespace, socket link); empty after `stop`. Always empty on the process node."""
        return containernode.leftovers(self.layout, self.state)

    def _container_node(self) -> ContainerNodeState:
        node = self.state.container_node
        if node is None:
            raise DevclusterError(
                f"the devcluster in {self.dir} runs pods as processes; start it with "
                "node_runtime='containerd' (`up --node-runtime containerd`) for containers"
            )
        return node

    def lose_node(self, name: str) -> None:
        self._process_node("lose_node")
        self.admin.lose_node(name)

    def restore_node(self, name: str) -> None:
        self._process_node("restore_node")
        self.admin.restore_node(name)

    def _process_node(self, hook: str) -> None:
        if self.state.container_node is not None:
            raise DevclusterError(
                f"{hook} is a hook of the process node agent; this cluster runs a container node "
                "(a real kubelet): stop its processes or delete its pods instead"
            )

    def pod_log_path(self, namespace: str, name: str, container: str | None = None) -> Path:
        return self.layout.pod_log(namespace, name, container)

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        path = self.pod_log_path(namespace, name, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def processes(self) -> list[int]:
        """Live processes carrying this cluster's marker (control plane, agent, pods)."""
        return marked_processes(self.state.cluster_id)


def _container_id(pod_json: str, container: str | None) -> str:
    """The running container's containerd id from a pod's JSON (its first container, or the
    named one)."""
    pod = json.loads(pod_json)
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    names = [c["name"] for c in pod["spec"]["containers"]]
    wanted = container or names[0]
    for status in statuses:
        if status["name"] == wanted and status.get("containerID"):
            return str(status["containerID"])
    raise DevclusterError(
        f"pod {pod['metadata']['name']} has no running container {wanted!r} to kill"
    )
