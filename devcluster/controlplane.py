"""`up` and `down`: start the control plane and node agent as process groups, and stop them.

Order matters for speed and robustness: etcd, kube-apiserver and the node agent start at once (the
agent is Python and retries until the API answers, so its import time overlaps the apiserver's
boot); the controller-manager and scheduler start once `/readyz` passes, because they read
authentication config from the API at startup and would otherwise fail on their first try.
"""

from __future__ import annotations

import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from devcluster import containernode, kubeconfig, pki, s3
from devcluster.config import DEFAULT_NODES, AgentConfig, NodeSpec
from devcluster.errors import DevclusterError
from devcluster.ipranges import free_octet
from devcluster.paths import Layout, binary_dir, find_binaries
from devcluster.ports import ensure_free, pick_free
from devcluster.procs import (
    has_marker,
    is_alive,
    kill_marked,
    live_groups,
    spawn,
    stop_groups,
)
from devcluster.readiness import wait_cluster_ready
from devcluster.state import (
    MARKER_ENV,
    ClusterState,
    ContainerNodeState,
    NodeRuntime,
    Ports,
    ProcessRecord,
    read_state,
    write_state,
)

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[devcluster] {message}", file=sys.stderr, flush=True)


def running_pids(state: ClusterState) -> list[int]:
    """Recorded pids that are alive and still ours (the marker guards against pid reuse)."""
    return [
        record.pid
        for record in state.processes
        if is_alive(record.pid) and has_marker(record.pid, state.cluster_id)
    ]


def _check_dir(layout: Layout) -> None:
    root = layout.root
    if root.exists() and not root.is_dir():
        raise DevclusterError(f"--dir {root} exists and is not a directory")
    state = read_state(layout.state_file)
    if state is not None:
        alive = running_pids(state)
        if alive:
            raise DevclusterError(
                f"{root} is in use by a running devcluster (cluster {state.cluster_id}, "
                f"pids {alive}); stop it with `python -m devcluster down --dir {root}` "
                "or pick another --dir"
            )
        # Its control plane is gone, but an agent killed without `down` can leave pod processes,
        # and an interrupted container node its namespace, mounts and cgroups.
        kill_marked(state.cluster_id)
        containernode.teardown(layout, state, lambda _message: None)
        return
    if root.exists() and any(root.iterdir()):
        raise DevclusterError(
            f"--dir {root} is not empty and holds no devcluster state.json; refusing to use it "
            "(devcluster wipes its own folders on start). Pick an empty or new directory."
        )


@dataclass
class _Starter:
    """Starts processes and records each pid in the state file before doing anything else."""

    layout: Layout
    state: ClusterState
    progress: Progress
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: Sequence[str | Path], env: dict[str, str]) -> None:
        log = self.layout.log(name)
        child = spawn(argv, log, env, cwd=self.layout.root)
        self.children[name] = child
        record = ProcessRecord(name=name, pid=child.pid, log=log)
        self.state = self.state.model_copy(update={"processes": [*self.state.processes, record]})
        write_state(self.layout.state_file, self.state)
        self.progress(f"{name} started (pid {child.pid}, log {log})")

    def record_node(self, node: ContainerNodeState) -> None:
        self.state = self.state.model_copy(update={"container_node": node})
        write_state(self.layout.state_file, self.state)

    def check_alive(self) -> None:
        for name, child in self.children.items():
            code = child.poll()
            if code is not None:
                log = self.layout.log(name)
                raise DevclusterError(
                    f"{name} exited with code {code} during startup; last lines of {log}:\n"
                    + _tail(log, 25)
                )


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def up(
    root: Path,
    nodes: Sequence[NodeSpec] = DEFAULT_NODES,
    apiserver_port: int | None = None,
    timeout: float = 90.0,
    progress: Progress = _stderr,
    timings: dict[str, float] | None = None,
    node_runtime: NodeRuntime = "process",
    images: Sequence[Path] = (),
) -> ClusterState:
    """Starts a cluster in `root` and returns once it can run pods; see the module docstring.

    `timings`, when given, receives seconds since the call for "readyz" (the API server passed
    /readyz) and "ready" (everything, nodes included), for the startup benchmark.

    `node_runtime="containerd"` runs one real kubelet node (the first of `nodes`; by default
    `gpu-0` with 8 GPUs) with containerd and kube-proxy instead of the node agent, and imports
    `images` (OCI or Docker archives) into its containerd before the kubelet starts; see
    containernode.py.
    """
    timings = {} if timings is None else timings
    started = time.monotonic()
    binaries = find_binaries()
    containers = node_runtime == "containerd"
    if containers:
        binaries.update(containernode.find_node_binaries())
        nodes = [nodes[0] if tuple(nodes) != DEFAULT_NODES else DEFAULT_NODES[0]]
    elif images:
        raise DevclusterError("images can only be imported into a container node (containerd)")
    layout = Layout(root.resolve())
    _check_dir(layout)
    if len({node.name for node in nodes}) != len(nodes):
        raise DevclusterError("node names must be unique")
    taken: set[int] = set()
    if apiserver_port is not None:
        ensure_free(apiserver_port, "kube-apiserver")
        taken.add(apiserver_port)
    ports = Ports(
        etcd_client=pick_free(taken),
        etcd_peer=pick_free(taken),
        apiserver=apiserver_port if apiserver_port is not None else pick_free(taken),
        controller_manager=pick_free(taken),
        scheduler=pick_free(taken),
        agent=pick_free(taken),
    )

    layout.root.mkdir(parents=True, exist_ok=True)
    for folder in layout.owned_folders():
        shutil.rmtree(folder, ignore_errors=True)
    for folder in (layout.logs, layout.pod_logs, layout.pods, layout.pod_groups):
        folder.mkdir(parents=True, exist_ok=True)

    cluster_id = secrets.token_hex(6)
    state = ClusterState(
        cluster_id=cluster_id,
        dir=layout.root,
        phase="starting",
        ports=ports,
        pod_ip_octet=free_octet(2 + int(cluster_id, 16) % 252),
        nodes=list(nodes),
        bin_dir=binary_dir().resolve(),
        node_runtime=node_runtime,
    )
    write_state(layout.state_file, state)
    env = {**os.environ, MARKER_ENV: cluster_id}
    starter = _Starter(layout, state, progress)
    try:
        if containers:
            starter.record_node(
                containernode.create(layout, cluster_id, nodes[0], starter.record_node, progress)
            )
        node = starter.state.container_node
        certs = pki.generate(
            layout.pki,
            apiserver_ips=(node.host_ip,) if node else (),
            node=(node.name, node.node_ip) if node else None,
        )
        server = starter.state.apiserver_url
        kubeconfig.write(layout.kubeconfig, server, certs.ca.cert, certs.admin, "admin")
        cm_kubeconfig = layout.pki / "controller-manager.kubeconfig"
        kubeconfig.write(
            cm_kubeconfig,
            server,
            certs.ca.cert,
            certs.controller_manager,
            "system:kube-controller-manager",
        )
        scheduler_kubeconfig = layout.pki / "scheduler.kubeconfig"
        kubeconfig.write(
            scheduler_kubeconfig, server, certs.ca.cert, certs.scheduler, "system:kube-scheduler"
        )
        agent_kubeconfig = layout.pki / "agent.kubeconfig"
        kubeconfig.write(agent_kubeconfig, server, certs.ca.cert, certs.agent, pki.AGENT_USER)
        starter.start("etcd", _etcd_args(binaries["etcd"], layout, ports), env)
        starter.start(
            "kube-apiserver",
            _apiserver_args(
                binaries["kube-apiserver"], certs, ports, node.host_ip if node else None
            ),
            env,
        )
        if node is None:
            _start_agent(layout, starter, certs, agent_kubeconfig, env)
        else:
            _start_container_runtime(layout, starter, node, binaries, env, images)
        deadline = started + timeout
        anyio.run(_wait_readyz, server, certs, starter, deadline)
        timings["readyz"] = time.monotonic() - started
        progress(f"kube-apiserver ready after {timings['readyz']:.1f} s")
        starter.start(
            "kube-controller-manager",
            _controller_manager_args(
                binaries["kube-controller-manager"], certs, ports, cm_kubeconfig
            ),
            env,
        )
        starter.start(
            "kube-scheduler",
            _scheduler_args(binaries["kube-scheduler"], certs, ports, scheduler_kubeconfig),
            env,
        )
        if node is not None:
            _start_kubelet(layout, starter, node, nodes[0], certs, binaries, env)
        anyio.run(
            wait_cluster_ready,
            layout.kubeconfig,
            starter.state,
            certs.ca.cert,
            starter.check_alive,
            deadline,
            lambda message: progress(f"{message} ({time.monotonic() - started:.1f} s)"),
        )
        if node is not None:
            anyio.run(containernode.register_gpus, layout.kubeconfig, nodes[0], deadline)
            containernode.wait_service_proxy(node, deadline)
            elapsed = time.monotonic() - started
            progress(f"ready: GPUs advertised, kubernetes Service proxied ({elapsed:.1f} s)")
    except BaseException:
        progress("startup failed; stopping everything it started")
        _stop(layout, starter.state, progress)
        raise
    state = starter.state.model_copy(update={"phase": "ready"})
    write_state(layout.state_file, state)
    timings["ready"] = time.monotonic() - started
    progress(f"cluster ready after {timings['ready']:.1f} s")
    return state


def _start_agent(
    layout: Layout,
    starter: _Starter,
    certs: pki.Pki,
    agent_kubeconfig: Path,
    env: dict[str, str],
) -> None:
    state = starter.state
    venv_bin = str(Path(sys.executable).parent)
    agent_config = AgentConfig(
        dir=layout.root,
        kubeconfig=agent_kubeconfig,
        nodes=list(state.nodes),
        admin_port=state.ports.agent,
        cluster_id=state.cluster_id,
        pod_ip_octet=state.pod_ip_octet,
        tls_cert=certs.serving.cert,
        tls_key=certs.serving.key,
        path_prefix=[venv_bin],
    )
    layout.agent_config.write_text(agent_config.model_dump_json(indent=2))
    agent_env = {**env, "PATH": os.pathsep.join([venv_bin, env.get("PATH", "")])}
    starter.start(
        "node-agent",
        [sys.executable, "-m", "devcluster", "agent", "--config", layout.agent_config],
        agent_env,
    )


def _start_container_runtime(
    layout: Layout,
    starter: _Starter,
    node: ContainerNodeState,
    binaries: dict[str, Path],
    env: dict[str, str],
    images: Sequence[Path],
) -> None:
    """containerd in the node namespace, then the pause and test images and `images` imported
    (while the API server boots)."""
    paths = containernode.write_runtime_configs(layout, node, binaries)
    node_env = containernode.node_env(env, binaries)
    starter.start("containerd", containernode.containerd_argv(binaries, paths, node), node_env)
    containernode.record_netns_inode(node)
    archives = containernode.build_images(paths, binaries)
    containernode.wait_containerd(starter.state, time.monotonic() + 60.0, starter.check_alive)
    for archive in [*archives, *images]:
        containernode.import_image(starter.state, archive)
        starter.progress(f"image {archive.name} imported into containerd")


def _start_kubelet(
    layout: Layout,
    starter: _Starter,
    node: ContainerNodeState,
    spec: NodeSpec,
    certs: pki.Pki,
    binaries: dict[str, Path],
    env: dict[str, str],
) -> None:
    paths = containernode.write_configs(
        layout, node, spec, certs, starter.state.apiserver_url, binaries
    )
    node_env = containernode.node_env(env, binaries)
    starter.start("kubelet", containernode.kubelet_argv(binaries, paths, node, spec), node_env)
    starter.start("kube-proxy", containernode.kube_proxy_argv(binaries, paths, node), node_env)


def _client_context(certs: pki.Pki) -> ssl.SSLContext:
    """Trusts the cluster CA and presents the admin certificate."""
    context = pki.ca_context(certs.ca.cert)
    context.load_cert_chain(certs.admin.cert, certs.admin.key)
    return context


async def _wait_readyz(server: str, certs: pki.Pki, starter: _Starter, deadline: float) -> None:
    last = "no answer yet"
    async with httpx.AsyncClient(verify=_client_context(certs), timeout=2.0) as client:
        while True:
            starter.check_alive()
            try:
                response = await client.get(f"{server}/readyz")
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[-300:]}"
            except httpx.HTTPError as error:
                last = f"{type(error).__name__}: {error}"
            if time.monotonic() >= deadline:
                raise DevclusterError(
                    f"kube-apiserver did not pass /readyz before the deadline; last: {last}. "
                    f"See {starter.layout.log('kube-apiserver')} "
                    "(or raise --timeout on a slow machine)"
                )
            await anyio.sleep(0.2)


def restart(
    root: Path,
    name: str,
    timeout: float = 60.0,
    while_down: Callable[[], None] | None = None,
) -> int:
    """Stop one control-plane process (SIGTERM, as a rolling restart would) and start it again
    with the same command line and environment; returns the new pid once it serves again
    (`/readyz` for kube-apiserver, running for the others). `while_down` runs in between (an
    outage as long as it takes). For tests of outages."""
    layout = Layout(root.resolve())
    state = read_state(layout.state_file)
    if state is None:
        raise DevclusterError(f"no devcluster state in {layout.root}")
    record = next((p for p in state.processes if p.name == name and is_alive(p.pid)), None)
    if record is None:
        raise DevclusterError(f"{name} is not running in the devcluster in {layout.root}")
    proc = Path(f"/proc/{record.pid}")
    argv = [arg.decode() for arg in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
    env = dict(
        item.decode().split("=", 1)
        for item in (proc / "environ").read_bytes().split(b"\0")
        if b"=" in item
    )
    if state.container_node is not None and name in containernode.NODE_PROCESSES:
        # nsenter exec'd the binary: its command line no longer says which namespace it ran in.
        argv = [str(arg) for arg in containernode.in_netns(state.container_node, *argv)]
    stop_groups([record.pid], grace_seconds=10.0)
    if while_down is not None:
        while_down()
    child = spawn(argv, record.log, env, cwd=layout.root)
    fresh = ProcessRecord(name=name, pid=child.pid, log=record.log)
    processes = [fresh if p is record else p for p in state.processes]
    write_state(layout.state_file, state.model_copy(update={"processes": processes}))
    deadline = time.monotonic() + timeout
    if name == "kube-apiserver":
        anyio.run(_wait_serving, state.apiserver_url, layout.pki / "ca.crt", child, deadline)
    return child.pid


async def _wait_serving(
    server: str, ca: Path, child: subprocess.Popen[bytes], deadline: float
) -> None:
    async with httpx.AsyncClient(verify=pki.ca_context(ca), timeout=2.0) as client:
        while True:
            if child.poll() is not None:
                raise DevclusterError(f"kube-apiserver exited with code {child.returncode}")
            try:
                if (await client.get(f"{server}/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise DevclusterError("kube-apiserver did not pass /readyz after its restart")
            await anyio.sleep(0.2)


def _etcd_args(binary: Path, layout: Layout, ports: Ports) -> list[str | Path]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        binary,
        "--name=devcluster",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--listen-metrics-urls=",
        # A throwaway test cluster: durability buys nothing, fsync costs seconds on slow disks.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def _apiserver_args(
    binary: Path, certs: pki.Pki, ports: Ports, node_host_ip: str | None = None
) -> list[str | Path]:
    if node_host_ip is None:
        # The built-in `kubernetes` Endpoints may not point at loopback; nothing here needs it.
        address = ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
        address.append("--endpoint-reconciler-type=none")
    else:
        # The container node's pods reach it through the `kubernetes` Service at this address,
        # the machine's end of the node's veth (see containernode.py).
        address = [f"--bind-address={node_host_ip}", f"--advertise-address={node_host_ip}"]
        address.append("--endpoint-reconciler-type=lease")
    return [
        binary,
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        f"--secure-port={ports.apiserver}",
        *address,
        f"--tls-cert-file={certs.apiserver.cert}",
        f"--tls-private-key-file={certs.apiserver.key}",
        f"--client-ca-file={certs.ca.cert}",
        # Request-header settings, so the controller-manager and scheduler find the CA bundle
        # their delegated authentication looks for (no front proxy uses them).
        f"--requestheader-client-ca-file={certs.ca.cert}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={certs.service_account_pub}",
        f"--service-account-signing-key-file={certs.service_account_key}",
        "--service-cluster-ip-range=10.0.0.0/24",
        "--allow-privileged=true",
        # `kubectl logs` goes through the apiserver to the agent's kubelet-style endpoint.
        f"--kubelet-certificate-authority={certs.ca.cert}",
        f"--kubelet-client-certificate={certs.kubelet_client.cert}",
        f"--kubelet-client-key={certs.kubelet_client.key}",
        "--kubelet-preferred-address-types=InternalIP",
        "--profiling=false",
        "--v=1",
    ]


def _controller_manager_args(
    binary: Path, certs: pki.Pki, ports: Ports, config: Path
) -> list[str | Path]:
    return [
        binary,
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.controller_manager}",
        f"--tls-cert-file={certs.serving.cert}",
        f"--tls-private-key-file={certs.serving.key}",
        "--leader-elect=false",
        # One identity (in system:masters) for all controllers: per-controller service accounts,
        # as kubeadm sets up, add about 5 s to every start on two cores, and the controllers'
        # own RBAC is not what this cluster exists to test.
        "--use-service-account-credentials=false",
        f"--service-account-private-key-file={certs.service_account_key}",
        f"--root-ca-file={certs.ca.cert}",
        f"--cluster-signing-cert-file={certs.ca.cert}",
        f"--cluster-signing-key-file={certs.ca.key}",
        # All default controllers, node lifecycle included: it taints a NotReady node so that
        # replacement pods are not scheduled onto a lost node, and marks that node's pods not
        # Ready, as on a real cluster. Its evictions start only after the pods' 300 s
        # tolerations, longer than any test keeps a node lost.
        "--controllers=*",
        "--node-monitor-period=2s",
        "--profiling=false",
        "--v=1",
    ]


def _scheduler_args(binary: Path, certs: pki.Pki, ports: Ports, config: Path) -> list[str | Path]:
    return [
        binary,
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.scheduler}",
        f"--tls-cert-file={certs.serving.cert}",
        f"--tls-private-key-file={certs.serving.key}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


@dataclass(frozen=True)
class StopReport:
    stopped: list[int]
    stragglers: list[int]


def down(root: Path, grace_seconds: float = 10.0, progress: Progress = _stderr) -> StopReport:
    """Stops every process of the cluster in `root`; safe to repeat and after an interrupted up."""
    layout = Layout(root.resolve())
    state = read_state(layout.state_file)
    if state is None:
        raise DevclusterError(
            f"no devcluster state in {layout.root} (expected {layout.state_file}); nothing to stop"
        )
    report = _stop(layout, state, progress, grace_seconds)
    write_state(layout.state_file, state.model_copy(update={"phase": "stopped"}))
    return report


def _stop(
    layout: Layout, state: ClusterState, progress: Progress, grace_seconds: float = 10.0
) -> StopReport:
    ours = set(running_pids(state))
    records = [record for record in state.processes if record.pid in ours]
    # The agent first: it stops its pods' processes gracefully; then the control plane.
    agent = [record.pid for record in records if record.name == "node-agent"]
    agent += [pid for pid in [_hand_started_agent(layout)] if pid and pid not in agent]
    rest = [record.pid for record in reversed(records) if record.name != "node-agent"]
    if agent:
        stop_groups(agent, grace_seconds)
    pod_groups = _pod_groups(layout, state.cluster_id)
    if pod_groups:
        stop_groups(pod_groups, 2.0)
    # One at a time, newest first: stopped together, etcd exits before the API server, which then
    # spends its whole shutdown retrying etcd.
    for pid in rest:
        stop_groups([pid], grace_seconds)
    stragglers = kill_marked(state.cluster_id)
    if stragglers:
        progress(f"killed stragglers carrying {MARKER_ENV}={state.cluster_id}: {stragglers}")
    containernode.teardown(layout, state, progress)
    s3.remove_data(state)
    for file in layout.pod_groups.glob("*") if layout.pod_groups.exists() else []:
        file.unlink(missing_ok=True)
    progress(f"stopped {len(records)} processes of cluster {state.cluster_id} in {layout.root}")
    return StopReport(stopped=[record.pid for record in records], stragglers=stragglers)


def _hand_started_agent(layout: Layout) -> int | None:
    """An agent restarted by hand (`agent --config DIR/agent.json`) lacks the marker; it leaves
    its pid in the directory instead. The command line guards against a reused pid."""
    try:
        pid = int(layout.agent_pid.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    if b"devcluster" in cmdline and b"agent" in cmdline and is_alive(pid):
        return pid
    return None


def _pod_groups(layout: Layout, cluster_id: str) -> list[int]:
    """Pod process groups the agent recorded and that are still alive and ours."""
    if not layout.pod_groups.exists():
        return []
    groups = live_groups()
    found = []
    for file in layout.pod_groups.iterdir():
        if file.name.isdigit():
            pgid = int(file.name)
            members = groups.get(pgid, [])
            if any(has_marker(pid, cluster_id) for pid in members):
                found.append(pgid)
    return found
