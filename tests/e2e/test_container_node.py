"""devcluster's container node end to end: a real kubelet, containerd, runc and kube-proxy.

Pods here are containers from the node's busybox test image (`devcluster.local/busybox:1`, built
locally: no registry is reachable). The tests check what the process node cannot: the kubelet
registers the node and runs containers, kube-proxy routes a ClusterIP Service and the
`kubernetes` Service, the kubelet reports a container killed by SIGKILL, a pod authenticates with
its projected ServiceAccount token, and `down` leaves nothing on the machine, also after an
interrupted `up`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
from kubernetes_asyncio import client

from devcluster.cluster import Cluster
from devcluster.containernode import TEST_IMAGE, cgroup_hierarchies
from devcluster.kube import open_api
from devcluster.procs import is_alive, marked_processes
from devcluster.readiness import node_is_ready
from devcluster.state import read_state
from devcluster.testing import is_ready, wait_for_pod, wait_for_sync

GPU = "nvidia.com/gpu"


def container_pod(
    name: str,
    command: list[str],
    *,
    restart_policy: str = "Never",
    labels: dict[str, str] | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    """A one-container pod from the node's busybox image (never pulled: it is imported)."""
    container: dict[str, Any] = {
        "name": "main",
        "image": TEST_IMAGE,
        "imagePullPolicy": "Never",
        "command": command,
    }
    if port is not None:
        container["ports"] = [{"name": "http", "containerPort": port}]
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "containers": [container],
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": 2,
            **({"activeDeadlineSeconds": 60} if restart_policy == "Never" else {}),
        },
    }


def apply(cluster: Cluster, namespace: str, *manifests: dict[str, Any]) -> None:
    text = "\n---\n".join(json.dumps(m) for m in manifests)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text)


def succeeded(pod: Any) -> bool:
    if pod.status.phase == "Failed":
        raise AssertionError(f"pod {pod.metadata.name} failed: {pod.status.container_statuses}")
    return bool(pod.status.phase == "Succeeded")


async def test_node_registers_ready_with_gpu_capacity(container_cluster: Cluster) -> None:
    async with open_api(container_cluster.kubeconfig) as api:
        node = await client.CoreV1Api(api).read_node("gpu-0")
    assert node_is_ready(node)
    info = node.status.node_info
    assert info.kubelet_version == "v1.37.2"
    assert info.container_runtime_version.startswith("containerd://2.")
    assert node.status.capacity[GPU] == "8"
    assert node.status.allocatable[GPU] == "8"
    assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
    internal = [a.address for a in node.status.addresses if a.type == "InternalIP"]
    assert internal == [container_cluster.state.container_node.node_ip]  # type: ignore[union-attr]


async def test_cluster_ip_service_routes_to_a_container(
    container_cluster: Cluster, container_namespace: str
) -> None:
    """A web server container behind a ClusterIP Service; a client container fetches through the
    Service's virtual IP (kube-proxy's DNAT in the node namespace) and `kubectl logs` (API server
    to kubelet) shows the page."""
    namespace = container_namespace
    serve = (
        "mkdir -p /www && echo served-by-$POD_NAME > /www/index.html"
        " && exec httpd -f -p 8080 -h /www"
    )
    web = container_pod("web", ["sh", "-c", serve], labels={"app": "web"}, port=8080)
    web["spec"]["containers"][0]["env"] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    apply(container_cluster, namespace, web, service)
    async with open_api(container_cluster.kubeconfig) as api:
        core = client.CoreV1Api(api)
        ready = await wait_for_pod(core, namespace, "web", is_ready, "to be Ready", timeout=60)
        pod_ip = ready.status.pod_ip
        node = container_cluster.state.container_node
        assert node is not None
        assert pod_ip.startswith(node.pod_cidr.rsplit(".", 2)[0] + ".")
        # The machine reaches pod IPs directly (its route to the pod network via the node's veth).
        async with httpx.AsyncClient(timeout=10) as http:
            direct = await http.get(f"http://{pod_ip}:8080/")
        assert direct.text.strip() == "served-by-web"
        cluster_ip = (await core.read_namespaced_service("web", namespace)).spec.cluster_ip
        # (busybox's `wget -T` segfaults; the pod's activeDeadlineSeconds bounds it instead)
        fetch = container_pod("fetch", ["wget", "-qO-", f"http://{cluster_ip}/"])
        apply(container_cluster, namespace, fetch)
        await wait_for_pod(core, namespace, "fetch", succeeded, "to succeed", timeout=60)
    logs = container_cluster.kubectl("logs", "-n", namespace, "fetch").stdout
    assert logs.strip() == "served-by-web"


async def test_sigkill_of_a_container_is_reported_by_the_kubelet(
    container_cluster: Cluster, container_namespace: str
) -> None:
    namespace = container_namespace
    apply(
        container_cluster,
        namespace,
        container_pod("victim", ["sleep", "3600"], restart_policy="Always"),
    )
    async with open_api(container_cluster.kubeconfig) as api:
        core = client.CoreV1Api(api)
        pod = await wait_for_pod(core, namespace, "victim", is_ready, "to be Ready", timeout=60)
        first_id = pod.status.container_statuses[0].container_id
        container_cluster.kill_pod(namespace, "victim")

        def restarted(pod: Any) -> bool:
            status = pod.status.container_statuses[0]
            return bool(status.restart_count >= 1 and status.state.running is not None)

        pod = await wait_for_pod(
            core, namespace, "victim", restarted, "restarted after SIGKILL", timeout=60
        )
    status = pod.status.container_statuses[0]
    assert status.restart_count == 1
    assert status.container_id != first_id
    terminated = status.last_state.terminated
    assert terminated.exit_code == 128 + signal.SIGKILL
    assert terminated.reason == "Error"


async def test_pod_reaches_the_api_server_with_its_service_account_token(
    container_cluster: Cluster, container_namespace: str
) -> None:
    """kube-whoami (in the test image) connects to $KUBERNETES_SERVICE_HOST (the `kubernetes`
    Service), verifies the API server with the projected CA and authenticates with the projected
    token: the API server names the pod's ServiceAccount and the pod."""
    namespace = container_namespace
    apply(container_cluster, namespace, container_pod("whoami", ["kube-whoami"]))
    async with open_api(container_cluster.kubeconfig) as api:
        core = client.CoreV1Api(api)
        await wait_for_pod(core, namespace, "whoami", succeeded, "to succeed", timeout=60)
    reply = json.loads(container_cluster.kubectl("logs", "-n", namespace, "whoami").stdout)
    user = reply["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:default"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["whoami"]
    assert user["extra"]["authentication.kubernetes.io/node-name"] == ["gpu-0"]


async def test_pod_traffic_has_no_route_off_the_machine(
    container_cluster: Cluster, container_namespace: str
) -> None:
    """The node namespace has no default route and nothing masquerades: a pod's connection to an
    address beyond the machine (TEST-NET-3, never a real host) is refused as unreachable inside
    the node namespace, while the API server's address is routed."""
    node = container_cluster.state.container_node
    assert node is not None
    attempt = "nc -w 2 203.0.113.1 80 </dev/null; echo exit=$?"
    apply(
        container_cluster,
        container_namespace,
        container_pod("outbound", ["sh", "-c", attempt]),
    )
    async with open_api(container_cluster.kubeconfig) as api:
        core = client.CoreV1Api(api)
        await wait_for_pod(
            core, container_namespace, "outbound", succeeded, "to finish", timeout=60
        )
    logs = container_cluster.kubectl("logs", "-n", container_namespace, "outbound").stdout
    assert "Network is unreachable" in logs
    assert "exit=1" in logs
    routes = [
        await anyio.run_process(
            ["nsenter", f"--net={node.netns}", "ip", "-4", "route", "get", address], check=False
        )
        for address in ("203.0.113.1", node.host_ip)
    ]
    assert routes[0].returncode != 0
    assert b"unreachable" in routes[0].stderr.lower()
    assert routes[1].returncode == 0


def _ours(cluster: Cluster) -> list[str]:
    return [f"process {pid}" for pid in cluster.processes()] + cluster.node_leftovers()


def test_down_removes_containers_mounts_cgroups_and_network(tmp_path: Path) -> None:
    """A cluster with a running container (a projected token volume mounted, a pod network
    namespace, cgroups) is stopped: nothing it created is left on the machine."""
    cluster = Cluster.start(tmp_path / "cluster", node_runtime="containerd", timeout=180)
    try:
        cluster.kubectl("create", "namespace", "work")
        wait_for_sync(
            lambda: (
                cluster.kubectl("get", "sa", "default", "-n", "work", check=False).returncode == 0
            ),
            30,
            "the default ServiceAccount",
        )
        apply(cluster, "work", container_pod("sleeper", ["sleep", "3600"]))
        cluster.kubectl(
            "wait", "--for=condition=Ready", "pod/sleeper", "-n", "work", "--timeout=60s",
            timeout=90,
        )  # fmt: skip
        before = cluster.node_leftovers()
        node = cluster.state.container_node
        assert node is not None
        # The check sees what the node made: rootfs and volume mounts, cgroups, its veth.
        assert any(item.startswith("mount ") and "rootfs" in item for item in before), before
        assert any(item.startswith("cgroup ") and "kubepods" in item for item in before), before
        assert f"veth {node.host_veth}" in before
        assert any(item.endswith("in the node network namespace") for item in before), before
        # ... and its files in machine-wide folders the kubelet and libcni hardcode.
        assert any(item.startswith("file /var/log/containers/sleeper_") for item in before)
        assert any(item.startswith("file /var/lib/cni/results/devcluster-") for item in before)
    finally:
        cluster.stop()
    assert _ours(cluster) == []
    assert not Path(f"/sys/class/net/{node.host_veth}").exists()
    assert not any((h / node.cgroup_root.lstrip("/")).exists() for h in cgroup_hierarchies())
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    assert node.pod_cidr not in routes


def test_down_after_an_interrupted_up_removes_what_it_had_created(tmp_path: Path) -> None:
    """`up` is killed (SIGKILL, no cleanup of its own) once containerd runs in the node
    namespace; `down` finds the rest from the state file and removes it."""
    root = tmp_path / "cluster"
    up = subprocess.Popen(
        [sys.executable, "-m", "devcluster", "up", "--dir", str(root), "--node-runtime",
         "containerd", "--timeout", "180"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def containerd_recorded() -> bool:
            state = read_state(root / "state.json") if (root / "state.json").exists() else None
            return state is not None and any(p.name == "containerd" for p in state.processes)

        wait_for_sync(containerd_recorded, 120, "up to start containerd", interval=0.05)
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    state = read_state(root / "state.json")
    assert state is not None
    assert state.container_node is not None
    assert "netns" in state.container_node.created
    cluster = Cluster(state)
    assert cluster.node_leftovers(), "the interrupted up left nothing to clean: the test is moot"
    result = subprocess.run(
        [sys.executable, "-m", "devcluster", "down", "--dir", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert _ours(cluster) == []
    assert not [pid for pid in marked_processes(state.cluster_id) if is_alive(pid)]
    stopped = read_state(root / "state.json")
    assert stopped is not None
    assert stopped.phase == "stopped"
