"""The container node: a real kubelet, containerd and kube-proxy, and everything they create.

`up --node-runtime containerd` runs one node whose pods are containers (runc through
containerd's CRI) instead of the node agent's processes. What it creates on this machine, and
why it is shaped this way:

- a **network namespace** (the "node" namespace, bind-mounted at `DIR/node/netns`) that holds
  containerd, the kubelet, kube-proxy, the CNI bridge `cni0`, every pod's veth and every
  iptables chain kube-proxy and portmap write. Deleting it deletes all of those at once, and
  several clusters on one machine never see each other's chains or ports (each kubelet listens
  on 10250 in its own namespace).
- a **veth pair** between the machine and that namespace: `10.213.<n>.1/30` on the machine (the
  API server listens there, and it is the `kubernetes` Service's endpoint) and `10.213.<n>.2/30`
  in the namespace (the node's InternalIP, where the kubelet serves). Pods get `10.214.<n>.0/24`
  on the bridge; the machine routes that /24 to the namespace so the API server can answer
  pods. The namespace has no default route and nothing masquerades: pod traffic reaches the
  namespace, the API server and other pods, and nothing else (the machine does not forward).
- a **cgroup subtree** `/devcluster-<id>` in every hierarchy, the kubelet's `cgroupRoot`
  (cgroupfs driver; this machine has cgroup v1 hierarchies and no systemd).
- **mounts** under `DIR` and `/run/devcluster-<id>` only: container root filesystems
  (overlayfs), pod network namespaces (containerd's `netns_mounts_under_state_dir`), the
  kubelet's secret/projected volumes.
- a folder `/run/devcluster-<id>` for containerd's sockets and the kubelet's root directory
  (its plugin and pod-resources sockets, pod volumes), because unix socket paths are limited to
  108 bytes (containerd's shim sockets to 42 for their folder) and `DIR` may be long.

- **kernel tunables** the kubelet sets machine-wide when it starts (`KUBELET_TUNABLES`: it
  makes an oops panic the machine and reboot 10 s later). The first container node on the
  machine records their values in `TUNABLES_RECORD`; the last one to go puts them back.

Each of these is written to the state file before it is made, and `teardown` removes whatever the
state names, so `down` cleans up after an interrupted `up` too; `leftovers` reports anything
still there (the tests assert it is empty).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import yaml
from kubernetes_asyncio import client

from devcluster import kubeconfig, ociarchive, pki
from devcluster.config import GPU_RESOURCE, NodeSpec
from devcluster.errors import DevclusterError
from devcluster.kube import open_api
from devcluster.paths import REPO_ROOT, Layout
from devcluster.state import MARKER_ENV, ClusterState, ContainerNodeState
from devcluster.waiting import WaitTimeout, wait_for, wait_for_sync

CONTAINERD_NAMESPACE = "k8s.io"
"""The containerd namespace the CRI plugin (so the kubelet) uses: images for pods go there."""
PAUSE_IMAGE = "devcluster.local/pause:1"
TEST_IMAGE = "devcluster.local/busybox:1"
"""A busybox image every container node has: Debian's static busybox with every applet linked,
and `/bin/kube-whoami` (devcluster/go/whoami), an in-cluster client that verifies the API server
through the `kubernetes` Service with the pod's ServiceAccount token (busybox's TLS cannot)."""
NODE_BINARIES = (
    "kubelet",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "pause",
    "kube-whoami",
    "cni/bridge",
    "cni/host-local",
    "cni/loopback",
    "cni/portmap",
)
NODE_PROCESSES = ("containerd", "kubelet", "kube-proxy")
"""The processes `up` starts in the node network namespace."""
HOST_TOOLS = ("runc", "iptables", "nsenter", "unshare", "ip", "busybox")
"""From Debian (`make node-binaries` installs the missing ones)."""
CONTAINER_LOG_LINKS = Path("/var/log/containers")
CNI_RESULTS = Path("/var/lib/cni/results")
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
HOST_PATHS = (CONTAINER_LOG_LINKS, CNI_RESULTS, DEVICE_PLUGINS)
"""Machine-wide folders the kubelet (container log links, device-plugin socket) and libcni (result
cache) hardcode. `up` records which of them (and their parents) it creates; `down` removes this
cluster's files in them, and the folders it created once empty."""
LINK_NET = ipaddress.IPv4Network("10.213.0.0/16")
POD_NET = ipaddress.IPv4Network("10.214.0.0/16")
BRIDGE = "cni0"
_LOCK = Path(tempfile.gettempdir()) / "devcluster-node-networks.lock"
KUBELET_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
"""Under /proc/sys: what the kubelet's container manager sets when it starts (not namespaced)."""
TUNABLES_RECORD = Path("/run/devcluster-kernel-tunables.json")
"""The machine's own values of `KUBELET_TUNABLES`, from before any container node started."""
_MNT_DETACH = 2

Record = Callable[[ContainerNodeState], None]
Progress = Callable[[str], None]


def node_binary_dir() -> Path:
    """`$DEVCLUSTER_NODE_BIN` or `<repo>/.bin/devcluster-node` (linked by `make node-binaries`)."""
    override = os.environ.get("DEVCLUSTER_NODE_BIN")
    return Path(override) if override else REPO_ROOT / ".bin" / "devcluster-node"


def find_node_binaries() -> dict[str, Path]:
    """The node's binaries and Debian tools, failing with one message that names all missing."""
    folder = node_binary_dir()
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in NODE_BINARIES:
        path = folder / name
        if path.is_file() and os.access(path, os.X_OK):
            found[name] = path
        else:
            missing.append(str(path))
    for tool in HOST_TOOLS:
        located = shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        if located:
            found[tool] = Path(located)
        else:
            missing.append(tool)
    if missing:
        raise DevclusterError(
            f"the container node needs {', '.join(missing)}; run `make node-binaries` (builds "
            "kubelet, kube-proxy, containerd and the CNI plugins, installs runc, iptables, "
            "conntrack and busybox-static from Debian) or point DEVCLUSTER_NODE_BIN at a folder "
            "holding the built binaries"
        )
    if os.geteuid() != 0:
        raise DevclusterError("the container node needs root (namespaces, cgroups, mounts)")
    return found


# --- planning: names and addresses ---------------------------------------------------------


def _used_indexes(bases: Sequence[ipaddress.IPv4Network] = (LINK_NET, POD_NET)) -> set[int]:
    """Third octets taken by another cluster's link or pod network on this machine."""
    out = subprocess.run(
        ["ip", "-o", "-4", "route", "show"], capture_output=True, text=True, check=True
    ).stdout
    out += subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    used: set[int] = set()
    for word in out.split():
        try:
            network = ipaddress.ip_network(word, strict=False)
        except ValueError:
            continue
        for base in bases:
            if network.version == 4 and network.subnet_of(base):
                used.add(int(network.network_address.packed[2]))
    return used


def _used_link_nets() -> set[int]:
    """The container nodes on this machine now, by their veth's link network."""
    return _used_indexes((LINK_NET,))


def record_tunables(record: Path, proc_sys: Path = Path("/proc/sys")) -> None:
    """Write the current values of `KUBELET_TUNABLES` to `record`, unless it holds some already
    (a node that went without its `down` left them: those are still the machine's own)."""
    if record.exists():
        return
    values = {}
    for name in KUBELET_TUNABLES:
        with contextlib.suppress(OSError):
            values[name] = (proc_sys / name).read_text().strip()
    temporary = record.with_name(f".{record.name}.tmp")
    temporary.write_text(json.dumps(values))
    temporary.replace(record)


def restore_tunables(record: Path, proc_sys: Path = Path("/proc/sys")) -> None:
    """Write back the values in `record` that differ from the current ones, then remove it."""
    try:
        values = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    for name in KUBELET_TUNABLES:
        value = values.get(name)
        path = proc_sys / name
        with contextlib.suppress(OSError):
            if isinstance(value, str) and path.read_text().strip() != value:
                path.write_text(value)
    record.unlink(missing_ok=True)


@contextlib.contextmanager
def _network_lock() -> Iterator[None]:
    """Held while picking an index and creating its veth, so two `up`s never pick the same."""
    fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def plan(layout: Layout, cluster_id: str, node: NodeSpec, index: int) -> ContainerNodeState:
    link = ipaddress.ip_network(f"10.213.{index}.0/30")
    hosts = list(link.hosts())
    return ContainerNodeState(
        name=node.name,
        index=index,
        netns=layout.root / "node" / "netns",
        host_veth=f"dc{cluster_id[:10]}",
        host_ip=str(hosts[0]),
        node_ip=str(hosts[1]),
        pod_cidr=f"10.214.{index}.0/24",
        cgroup_root=f"/devcluster-{cluster_id}",
        run_dir=Path(f"/run/devcluster-{cluster_id}"),
    )


def _free_index(preferred: int) -> int:
    used = _used_indexes()
    for step in range(254):
        index = 1 + (preferred - 1 + step) % 254
        if index not in used:
            return index
    raise DevclusterError(
        "every container-node network 10.213.1-254.0/30 is in use on this machine; stop some "
        "clusters with `python -m devcluster down --dir DIR`"
    )


# --- creating -------------------------------------------------------------------------------


def _run(argv: Sequence[str | Path], what: str) -> str:
    result = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, check=False, timeout=60
    )
    if result.returncode != 0:
        raise DevclusterError(
            f"{what} failed: `{' '.join(str(a) for a in argv)}` exited {result.returncode}: "
            f"{result.stderr.strip() or result.stdout.strip()}"
        )
    return result.stdout


def in_netns(node: ContainerNodeState, *argv: str | Path) -> list[str | Path]:
    """Only the network namespace: the mount namespace stays the machine's, so the kubelet's
    volume mounts and containerd's root filesystems are seen by both (unlike `ip netns exec`)."""
    return ["nsenter", f"--net={node.netns}", "--", *argv]


def create(
    layout: Layout, cluster_id: str, spec: NodeSpec, record: Record, progress: Progress
) -> ContainerNodeState:
    """Creates the node's namespace, veth pair, route, cgroups and socket link; each is recorded
    (through `record`, which writes the state file) before it is made."""
    (layout.root / "node").mkdir(parents=True, exist_ok=True)
    with _network_lock():
        if not _used_link_nets():  # the first node here: the machine's tunables are its own
            record_tunables(TUNABLES_RECORD)
        index = _free_index(2 + int(cluster_id, 16) % 250)
        node = plan(layout, cluster_id, spec, index)
        node = _step(node, "netns", record)
        node.netns.touch()
        _run(["unshare", f"--net={node.netns}", "true"], "creating the node network namespace")
        node = _step(node, "veth", record)
        _run(
            in_netns(
                node, "ip", "link", "add", "eth0", "type", "veth", "peer", "name",
                node.host_veth, "netns", str(os.getpid()),
            ),
            "creating the node's veth pair",
        )  # fmt: skip
    host_ip = f"{node.host_ip}/30"
    _run(["ip", "addr", "add", host_ip, "dev", node.host_veth], "addressing the host veth")
    _run(["ip", "link", "set", node.host_veth, "up"], "bringing the host veth up")
    _run(
        ["ip", "route", "add", node.pod_cidr, "via", node.node_ip, "dev", node.host_veth],
        "routing the pod network to the node",
    )
    for argv in (
        ["ip", "addr", "add", f"{node.node_ip}/30", "dev", "eth0"],
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "set", "eth0", "up"],
        ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
        ["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"],
    ):
        _run(in_netns(node, *argv), "configuring the node network namespace")
    node = _step(node, "cgroups", record)
    for hierarchy in cgroup_hierarchies():
        path = hierarchy / node.cgroup_root.lstrip("/")
        path.mkdir(exist_ok=True)
        if (hierarchy / "cpuset.cpus").exists():
            for name in ("cpuset.cpus", "cpuset.mems"):
                (path / name).write_text((hierarchy / name).read_text())
    node = _step(node, "run-dir", record)
    node.run_dir.mkdir(mode=0o700, exist_ok=True)
    missing = sorted(
        {folder for path in HOST_PATHS for folder in (path, *path.parents) if not folder.exists()},
        key=lambda folder: len(folder.parts),
    )
    node = node.model_copy(update={"created_host_dirs": missing})
    record(node)
    progress(
        f"node network: namespace {node.netns}, veth {node.host_veth} {node.host_ip} <-> "
        f"{node.node_ip}, pods {node.pod_cidr}; cgroup root {node.cgroup_root}"
    )
    return node


def _step(node: ContainerNodeState, step: str, record: Record) -> ContainerNodeState:
    node = node.model_copy(update={"created": [*node.created, step]})
    record(node)
    return node


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named ones and the v2 one)."""
    found: list[Path] = []
    for mount in _mountinfo():
        if mount.fstype in ("cgroup", "cgroup2") and mount.point not in found:
            found.append(mount.point)
    return found


# --- configuration ----------------------------------------------------------------------------


class NodePaths:
    """The node's files under DIR/node (configs, state) and DIR/run/node (sockets)."""

    def __init__(self, layout: Layout) -> None:
        self.root = layout.root / "node"
        self.containerd = self.root / "containerd"
        self.kubelet = self.root / "kubelet"
        self.kube_proxy = self.root / "kube-proxy"
        self.cni_conf = self.root / "cni" / "net.d"
        self.cni_data = self.root / "cni" / "ipam"
        self.images = self.root / "images"
        self.pod_logs = self.root / "pod-logs"


def write_configs(
    layout: Layout,
    node: ContainerNodeState,
    spec: NodeSpec,
    certs: pki.Pki,
    server: str,
    binaries: dict[str, Path],
) -> NodePaths:
    paths = NodePaths(layout)
    for folder in (paths.containerd, paths.kubelet, paths.kube_proxy, paths.cni_conf,
                   paths.cni_data, paths.images, paths.pod_logs):  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
    if certs.node is None:
        raise DevclusterError("internal: the container node's certificates were not generated")
    kubeconfig.write(
        paths.kubelet / "kubeconfig",
        server,
        certs.ca.cert,
        certs.node.kubelet,
        f"system:node:{node.name}",
    )
    kubeconfig.write(
        paths.kube_proxy / "kubeconfig", server, certs.ca.cert, certs.node.kube_proxy, "kube-proxy"
    )
    (paths.root / "resolv.conf").write_text("# devcluster: pods have no DNS server\n")
    kubelet_config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # cgroup v1 hierarchies and no systemd on these machines (see docs/devcluster.md).
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "address": node.node_ip,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(certs.node.kubelet_serving.cert),
        "tlsPrivateKeyFile": str(certs.node.kubelet_serving.key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(certs.ca.cert)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": "cluster.local",
        "resolvConf": str(paths.root / "resolv.conf"),
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "podLogsDir": str(paths.pod_logs),
        # The machine's disks are shared and often fuller than a production node would run at:
        # evictions and image GC would only make tests flaky.
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "maxPods": spec.pods,
    }
    (paths.kubelet / "config.yaml").write_text(yaml.safe_dump(kubelet_config, sort_keys=False))
    proxy_config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(paths.kube_proxy / "kubeconfig")},
        "hostnameOverride": node.name,
        "mode": "iptables",
        "clusterCIDR": node.pod_cidr,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # 0 leaves the kernel's conntrack settings alone (most are not per namespace).
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"localhostNodePorts": False},
        "nodePortAddresses": ["primary"],
    }
    (paths.kube_proxy / "config.yaml").write_text(yaml.safe_dump(proxy_config, sort_keys=False))
    return paths


def write_runtime_configs(
    layout: Layout, node: ContainerNodeState, binaries: dict[str, Path]
) -> NodePaths:
    """containerd's config and the CNI network, written before containerd starts."""
    paths = NodePaths(layout)
    for folder in (paths.containerd, paths.cni_conf, paths.cni_data, paths.images):
        folder.mkdir(parents=True, exist_ok=True)
    (paths.containerd / "config.toml").write_text(containerd_config(paths, node, binaries))
    (paths.cni_conf / "10-devcluster.conflist").write_text(_cni_config(node, paths))
    return paths


def containerd_config(paths: NodePaths, node: ContainerNodeState, binaries: dict[str, Path]) -> str:
    state = paths.containerd / "state"
    return f"""\
# Written by devcluster (containernode.py): every path is under the cluster directory.
version = 3
root = "{paths.containerd / "root"}"
state = "{state}"
temp = "{paths.containerd / "tmp"}"
# Plugins that would write outside the cluster directory, or talk to things we do not run.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.nri.v1.nri",
  "io.containerd.image-verifier.v1.bindir",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{node.containerd_socket}"

[ttrpc]
  address = "{node.containerd_socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins.'io.containerd.shim.v1.manager']
  socket_dir = "{node.run_dir / "s"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = ""

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  netns_mounts_under_state_dir = true
  # The kubelet asks for oom_score_adj -998 for sandboxes; lowering it needs CAP_SYS_RESOURCE,
  # which root lacks on these machines (runc: "failed to update /proc/self/oom_score_adj:
  # Permission denied"). This clamps requests to containerd's own value instead.
  restrict_oom_score_adj = true
  cdi_spec_dirs = []
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{binaries["runc"]}"
        Root = "{state / "runc"}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{binaries["cni/bridge"].parent}"]
    conf_dir = "{paths.cni_conf}"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_network_name(node: ContainerNodeState) -> str:
    return f"devcluster-{node.cgroup_root.removeprefix('/devcluster-')}"


def _cni_config(node: ContainerNodeState, paths: NodePaths) -> str:
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            # Per cluster: libcni caches results under /var/lib/cni/results/<name>-<sandbox>-*
            # (not configurable through containerd); teardown removes this cluster's by name.
            "name": cni_network_name(node),
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    # No masquerade: pod traffic never leaves the node namespace and the machine.
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(paths.cni_data),
                        "ranges": [[{"subnet": node.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
            ],
        },
        indent=2,
    )


def containerd_argv(
    binaries: dict[str, Path], paths: NodePaths, node: ContainerNodeState
) -> list[str | Path]:
    return in_netns(node, binaries["containerd"], "--config", paths.containerd / "config.toml")


def kubelet_argv(
    binaries: dict[str, Path], paths: NodePaths, node: ContainerNodeState, spec: NodeSpec
) -> list[str | Path]:
    own = {"kubernetes.io/hostname", "kubernetes.io/os", "kubernetes.io/arch"}
    labels = ",".join(f"{k}={v}" for k, v in spec.all_labels().items() if k not in own)
    return in_netns(
        node,
        binaries["kubelet"],
        f"--config={paths.kubelet / 'config.yaml'}",
        f"--kubeconfig={paths.kubelet / 'kubeconfig'}",
        f"--root-dir={node.run_dir / 'kubelet'}",
        f"--cert-dir={paths.kubelet / 'pki'}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.node_ip}",
        f"--node-labels={labels}",
        "--v=1",
    )


def kube_proxy_argv(
    binaries: dict[str, Path], paths: NodePaths, node: ContainerNodeState
) -> list[str | Path]:
    return in_netns(
        node, binaries["kube-proxy"], f"--config={paths.kube_proxy / 'config.yaml'}", "--v=1"
    )


def node_env(env: dict[str, str], binaries: dict[str, Path]) -> dict[str, str]:
    """PATH with the node's binaries first (containerd finds its shim there) and the sbin dirs
    (iptables, runc)."""
    folders = [str(binaries["containerd"].parent), "/usr/sbin", "/sbin"]
    return {**env, "PATH": os.pathsep.join([*folders, env.get("PATH", "")])}


# --- images --------------------------------------------------------------------------------


def build_images(paths: NodePaths, binaries: dict[str, Path]) -> list[Path]:
    """The pause image and the busybox test image as OCI archives (cheap: a few MB each)."""
    pause = ociarchive.ImageSpec(
        name=PAUSE_IMAGE,
        files=[ociarchive.ImageFile("/pause", source=binaries["pause"])],
        entrypoint=["/pause"],
    )
    busybox = binaries["busybox"]
    applets = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    test = ociarchive.ImageSpec(
        name=TEST_IMAGE,
        files=[
            ociarchive.ImageFile("/bin/busybox", source=busybox),
            ociarchive.ImageFile("/bin/kube-whoami", source=binaries["kube-whoami"]),
        ],
        symlinks={f"/{applet}": "/bin/busybox" for applet in applets if applet != "bin/busybox"},
        directories=["tmp", "etc", "proc", "sys", "dev", "var", "root"],
        cmd=["sh"],
    )
    archives = []
    for image, stem in ((pause, "pause"), (test, "busybox")):
        archive = paths.images / f"{stem}.tar"
        ociarchive.write(image, archive)
        archives.append(archive)
    return archives


def ctr_argv(state: ClusterState, *args: str) -> list[str]:
    """`ctr` on this cluster's containerd, in the CRI namespace."""
    node = _node(state)
    ctr = node_binary_dir() / "ctr"
    return [
        str(ctr),
        f"--address={node.containerd_socket}",
        f"--namespace={CONTAINERD_NAMESPACE}",
        *args,
    ]


def _ctr_env(state: ClusterState) -> dict[str, str]:
    """ctr carries the cluster's marker, so `down` also stops one cut off by an interrupted up."""
    return {**os.environ, MARKER_ENV: state.cluster_id}


def import_image(state: ClusterState, archive: Path, timeout: float = 300.0) -> None:
    """Imports an OCI (or Docker) image archive into the node's containerd, unpacked for the
    overlayfs snapshotter, so pods can use it with `imagePullPolicy: Never`/`IfNotPresent`.
    The image's name comes from the archive (`io.containerd.image.name` or the ref annotation)."""
    argv = ctr_argv(state, "images", "import", "--snapshotter=overlayfs", str(archive))
    result = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=timeout, env=_ctr_env(state)
    )
    if result.returncode != 0:
        raise DevclusterError(
            f"importing {archive} into the node's containerd failed ({result.returncode}): "
            f"{result.stderr.strip()}"
        )


def wait_containerd(state: ClusterState, deadline: float, check_alive: Callable[[], None]) -> None:
    last = ""
    while True:
        check_alive()
        result = subprocess.run(
            ctr_argv(state, "version"),
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
            env=_ctr_env(state),
        )
        if result.returncode == 0:
            return
        last = result.stderr.strip()
        if time.monotonic() >= deadline:
            raise DevclusterError(
                f"containerd did not answer on {_node(state).containerd_socket} before the "
                f"deadline; last: {last}. See {state.dir / 'logs' / 'containerd.log'}"
            )
        time.sleep(0.2)


def _node(state: ClusterState) -> ContainerNodeState:
    if state.container_node is None:
        raise DevclusterError(
            f"the devcluster in {state.dir} runs a process node; start it with "
            "`--node-runtime containerd` for containers"
        )
    return state.container_node


async def register_gpus(kubeconfig_path: Path, spec: NodeSpec, deadline: float) -> None:
    """Extended resources without a device plugin, the documented way: a node-status patch of
    capacity and allocatable (the kubelet keeps extended resources it does not manage); returns
    once the node object shows them."""
    if not spec.gpus:
        return
    amount = str(spec.gpus)
    body = {"status": {"capacity": {GPU_RESOURCE: amount}, "allocatable": {GPU_RESOURCE: amount}}}
    async with open_api(kubeconfig_path) as api:
        core = client.CoreV1Api(api)

        async def advertised() -> bool:
            node = await core.read_node(spec.name)
            if (node.status.allocatable or {}).get(GPU_RESOURCE) == amount:
                return True
            await core.patch_node_status(spec.name, body)
            return False

        try:
            await wait_for(
                advertised,
                max(0.0, deadline - time.monotonic()),
                f"node {spec.name} to advertise {GPU_RESOURCE}: {amount}",
                interval=0.2,
                ignore=(client.ApiException,),
            )
        except WaitTimeout as error:
            raise DevclusterError(f"{error} (see the kubelet log)") from error


def wait_service_proxy(node: ContainerNodeState, deadline: float) -> None:
    """Returns once kube-proxy has programmed the `kubernetes` Service (its DNAT to the API
    server) in the node namespace: from then on pods reach the API server through it."""
    target = f"--to-destination {node.host_ip}:"

    def programmed() -> bool:
        result = subprocess.run(
            [str(a) for a in in_netns(node, "iptables-save", "-t", "nat")],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        return '"default/kubernetes:https"' in result.stdout and target in result.stdout

    try:
        wait_for_sync(
            programmed,
            max(0.0, deadline - time.monotonic()),
            "kube-proxy to program the kubernetes Service",
            interval=0.2,
        )
    except WaitTimeout as error:
        raise DevclusterError(f"{error}; see the kube-proxy log") from error


def kill_container(state: ClusterState, container_id: str, sig: str = "SIGKILL") -> None:
    """Signals a container's main process through containerd (the shim delivers it, as the
    OOM killer or a crash would hit it); `container_id` as in a pod's containerStatuses."""
    bare = container_id.removeprefix("containerd://")
    argv = ctr_argv(state, "tasks", "kill", "--signal", sig, bare)
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if result.returncode != 0:
        raise DevclusterError(f"killing container {bare} failed: {result.stderr.strip()}")


# --- teardown ------------------------------------------------------------------------------


class _Mount:
    def __init__(self, point: Path, fstype: str, root: str) -> None:
        self.point = point
        self.fstype = fstype
        self.root = root


def _unescape(text: str) -> str:
    return text.encode().decode("unicode_escape") if "\\" in text else text


def _mountinfo() -> list[_Mount]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        fstype = right.split()[0] if right else ""
        mounts.append(_Mount(Path(_unescape(fields[4])), fstype, _unescape(fields[3])))
    return mounts


def _owned_roots(layout: Layout, node: ContainerNodeState | None) -> list[Path]:
    roots = [layout.root.resolve() / "node", layout.root.resolve() / "run"]
    return roots if node is None else [*roots, node.run_dir]


def _mounts_under(layout: Layout, node: ContainerNodeState | None = None) -> list[Path]:
    roots = _owned_roots(layout, node)
    return [
        m.point for m in _mountinfo() if any(m.point == r or r in m.point.parents for r in roots)
    ]


def _cgroup_dirs(node: ContainerNodeState) -> list[Path]:
    found = []
    for hierarchy in cgroup_hierarchies():
        root = hierarchy / node.cgroup_root.lstrip("/")
        if root.is_dir():
            found += [Path(d) for d, _, _ in os.walk(root)]
    return found


def _cgroup_pids(node: ContainerNodeState) -> list[int]:
    pids: set[int] = set()
    for folder in _cgroup_dirs(node):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
    return sorted(pids)


def _netns_holders(inode: int) -> list[int]:
    """Processes whose network namespace is the node's."""
    target = f"net:[{inode}]"
    holders = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == target:
                    holders.append(int(entry))
    return holders


def _umount(point: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(str(point).encode(), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise DevclusterError(f"umount {point} failed: {os.strerror(code)}")


def teardown(layout: Layout, state: ClusterState, progress: Progress) -> None:
    """Removes what the container node created, per the state file; safe to repeat. Runs after
    `down` stopped the recorded processes (containerd, the kubelet, the shims)."""
    node = state.container_node
    if node is None:
        return
    netns_inode = _netns_inode(node)
    # Containers: their processes are in our cgroups (the shims died with the marker sweep).
    deadline = time.monotonic() + 15.0
    while pids := _cgroup_pids(node):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            raise DevclusterError(f"container processes {pids} survived SIGKILL for 15 s")
        time.sleep(0.05)
    if netns_inode is not None:
        for pid in _netns_holders(netns_inode):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # Mounts, deepest first (root filesystems, volumes, pod namespaces, the node namespace).
    for _attempt in range(5):
        points = _mounts_under(layout, node)
        if not points:
            break
        for point in sorted(points, key=lambda p: len(p.parts), reverse=True):
            _umount(point)
    for folder in sorted(_cgroup_dirs(node), key=lambda p: len(p.parts), reverse=True):
        for _attempt in range(50):
            try:
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as error:
                if error.errno != errno.EBUSY:
                    raise DevclusterError(f"removing cgroup {folder} failed: {error}") from error
                time.sleep(0.1)
    # The veth goes with the namespace; a namespace kept alive by something we missed still
    # loses its link to the machine here.
    with _network_lock():
        if _link_exists(node.host_veth):
            subprocess.run(["ip", "link", "del", node.host_veth], capture_output=True, check=False)
        if not _used_link_nets():  # the last node here: what its kubelets set goes back
            restore_tunables(TUNABLES_RECORD)
    if "run-dir" in node.created and node.run_dir.is_dir() and not _mounts_under(layout, node):
        shutil.rmtree(node.run_dir)
    for path in _host_files(layout, node):
        path.unlink(missing_ok=True)
    for folder in sorted(node.created_host_dirs, key=lambda f: len(f.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty: another cluster's, or the machine's
            folder.rmdir()
    progress(f"container node {node.name} removed (namespace, veth, cgroups, mounts)")


def _host_files(layout: Layout, node: ContainerNodeState) -> list[Path]:
    """This cluster's files in the machine-wide HOST_PATHS: container log links into DIR, libcni
    results of its network, and the device-plugin socket when no kubelet serves it any more."""
    root = layout.root.resolve()
    found: list[Path] = []
    if CONTAINER_LOG_LINKS.is_dir():
        for link in CONTAINER_LOG_LINKS.iterdir():
            if link.is_symlink() and Path(os.readlink(link)).is_relative_to(root):
                found.append(link)
    prefix = cni_network_name(node) + "-"
    if CNI_RESULTS.is_dir():
        for result in CNI_RESULTS.iterdir():
            if result.name.startswith(prefix):
                found.append(result)
                sandbox = result.name.removeprefix(prefix).rsplit("-", 1)[0]
                found.append(CNI_RESULTS / f"cni-loopback-{sandbox}-lo")
    # Every kubelet on the machine binds this one path; once none serves it, it is stale.
    socket_path = DEVICE_PLUGINS / "kubelet.sock"
    if socket_path.exists() and not _served(socket_path):
        found += [socket_path, DEVICE_PLUGINS / "kubelet_internal_checkpoint"]
    return [path for path in found if path.exists() or path.is_symlink()]


def _served(socket_path: Path) -> bool:
    """Whether a process (another cluster's kubelet) accepts connections on the socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(socket_path))
        except OSError:
            return False
    return True


def _netns_inode(node: ContainerNodeState) -> int | None:
    with contextlib.suppress(OSError):
        if any(m.point == node.netns.resolve() and m.fstype == "nsfs" for m in _mountinfo()):
            return os.stat(node.netns).st_ino
    return node_netns_inode_record(node)


def node_netns_inode_record(node: ContainerNodeState) -> int | None:
    """The inode recorded at `up` (DIR/node/netns.inode), for checks after the mount is gone."""
    with contextlib.suppress(OSError, ValueError):
        return int((node.netns.parent / "netns.inode").read_text())
    return None


def record_netns_inode(node: ContainerNodeState) -> None:
    (node.netns.parent / "netns.inode").write_text(str(os.stat(node.netns).st_ino))


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def leftovers(layout: Layout, state: ClusterState) -> list[str]:
    """Everything of the container node still on the machine, described; empty after `down`."""
    node = state.container_node
    if node is None:
        return []
    found = [f"mount {point}" for point in _mounts_under(layout, node)]
    found += [f"cgroup {folder}" for folder in _cgroup_dirs(node)]
    if _link_exists(node.host_veth):
        found.append(f"veth {node.host_veth}")
    inode = node_netns_inode_record(node)
    if inode is not None:
        found += [f"process {pid} in the node network namespace" for pid in _netns_holders(inode)]
        found += [f"nsfs mount {m.point}" for m in _mountinfo() if m.root == f"net:[{inode}]"]
    if node.run_dir.exists():
        found.append(f"folder {node.run_dir}")
    found += [f"file {path}" for path in _host_files(layout, node)]
    return found
