"""devcluster end to end: a real control plane, and pods run as local processes by the node agent.

The pods run POD_SCRIPT: it records its pid and environment (and a SIGTERM, when one arrives) in a
shared hostPath folder and serves HTTP on its pod IP, which the readiness probe hits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
from kubernetes_asyncio import client

from devcluster.cluster import Cluster
from devcluster.config import NodeSpec
from devcluster.procs import marked_processes
from devcluster.readiness import node_is_ready
from devcluster.state import read_state
from devcluster.testing import (
    condition,
    is_alive,
    is_ready,
    process_pod,
    terminated_state,
    wait_for,
    wait_for_pod,
    wait_for_pod_gone,
    wait_for_sync,
)

POD_SCRIPT = r"""
import http.server, json, os, pathlib, signal, time
out = pathlib.Path(os.environ["OUT_DIR"])
name = os.environ["POD_NAME"]

def on_term(signum, frame):
    (out / (name + ".sigterm")).write_text(repr(time.monotonic()))
    if not os.environ.get("IGNORE_TERM"):
        os._exit(0)

signal.signal(signal.SIGTERM, on_term)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"pod": name}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = http.server.HTTPServer((os.environ["POD_IP"], int(os.environ["PORT"])), Handler)
record = out / (name + ".json")
record.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid(), "env": dict(os.environ)}))
record.with_suffix(".tmp").rename(record)
print("serving", name, flush=True)
server.serve_forever()
"""


def script_pod(name: str, shared: Path, port: int = 8080, **kwargs: Any) -> dict[str, Any]:
    env = {"OUT_DIR": str(shared), "PORT": str(port), **kwargs.pop("env", {})}
    return process_pod(
        name,
        ["python", "-c", POD_SCRIPT],
        env=env,
        readiness_port=port,
        host_paths=[str(shared)],
        **kwargs,
    )


async def pod_record(shared: Path, name: str) -> dict[str, Any]:
    """What the pod's process wrote about itself once it was serving."""
    path = anyio.Path(shared / f"{name}.json")

    async def written() -> bool:
        return await path.exists()

    await wait_for(written, 30, f"pod {name} to write {path}")
    record: dict[str, Any] = json.loads(await path.read_text())
    return record


async def wait_process_gone(pid: int, timeout: float, what: str) -> None:  # noqa: ASYNC109
    async def gone() -> bool:
        return not is_alive(pid)

    await wait_for(gone, timeout, what)


async def test_gpu_pod_runs_on_the_gpu_node_with_env_pod_ip_and_readiness(
    cluster: Cluster, namespace: str, kube: Any, shared_dir: Path
) -> None:
    core: Any = client.CoreV1Api(kube)
    await core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}}
    )
    await core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "settings"}, "data": {"mode": "fast"}}
    )
    refs = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "TEAM", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['team']"}}},
        {"name": "GREETING", "value": "hi-$(POD_NAME)"},
    ]
    manifest = script_pod(
        "gpu-worker",
        shared_dir,
        gpus=1,
        extra_env=refs,
        labels={"app": "worker"},
        annotations={"team": "rl"},
    )
    await core.create_namespaced_pod(namespace, manifest)

    pod = await wait_for_pod(core, namespace, "gpu-worker", is_ready, "to become Ready")
    assert pod.spec.node_name == "gpu-0"
    ip = pod.status.pod_ip
    assert ip.startswith("127.")
    assert ip != "127.0.0.1"
    record = await pod_record(shared_dir, "gpu-worker")
    env = record["env"]
    assert env["POD_IP"] == ip
    assert env["POD_NAME"] == "gpu-worker"
    assert env["NS"] == namespace
    assert env["NODE"] == "gpu-0"
    assert env["APP"] == "worker"
    assert env["TEAM"] == "rl"
    assert env["TOKEN"] == "s3cret"
    assert env["MODE"] == "fast"
    assert env["GREETING"] == "hi-gpu-worker"
    assert is_alive(record["pid"])
    async with httpx.AsyncClient() as http:
        response = await http.get(f"http://{ip}:8080/")
    assert response.json() == {"pod": "gpu-worker"}
    # kubectl logs: API server -> the agent's kubelet-style endpoint -> the pod's log file
    logs = cluster.kubectl("logs", "-n", namespace, "gpu-worker").stdout
    assert "serving gpu-worker" in logs

    await core.create_namespaced_pod(
        namespace, process_pod("too-big", ["python", "-c", "pass"], gpus=9)
    )

    def unschedulable(p: Any) -> bool:
        scheduled = condition(p, "PodScheduled")
        return scheduled is not None and scheduled.reason == "Unschedulable"

    pod = await wait_for_pod(core, namespace, "too-big", unschedulable, "to be Unschedulable")
    scheduled = condition(pod, "PodScheduled")
    assert scheduled is not None
    assert scheduled.status == "False"
    assert "nvidia.com/gpu" in scheduled.message
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


async def test_delete_sends_sigterm_waits_out_the_grace_period_then_kills(
    namespace: str, kube: Any, shared_dir: Path
) -> None:
    core: Any = client.CoreV1Api(kube)
    grace = 3
    manifest = script_pod("stubborn", shared_dir, env={"IGNORE_TERM": "1"}, grace_seconds=grace)
    await core.create_namespaced_pod(namespace, manifest)
    await wait_for_pod(core, namespace, "stubborn", is_ready, "to become Ready")
    pid = (await pod_record(shared_dir, "stubborn"))["pid"]

    await core.delete_namespaced_pod("stubborn", namespace)
    sigterm = anyio.Path(shared_dir / "stubborn.sigterm")

    async def terminated() -> bool:
        return await sigterm.exists() and bool(await sigterm.read_text())

    await wait_for(terminated, 15, "SIGTERM to reach the pod's process")
    term_at = float(await sigterm.read_text())
    await wait_process_gone(pid, grace + 15, "the process to be killed after the grace period")
    # The process ignores SIGTERM, so it can only be gone once the agent gave up waiting.
    assert time.monotonic() - term_at >= grace - 0.5
    await wait_for_pod_gone(core, namespace, "stubborn")


async def test_sigkill_fails_the_pod_with_137_or_restarts_it(
    cluster: Cluster, namespace: str, kube: Any, shared_dir: Path
) -> None:
    core: Any = client.CoreV1Api(kube)
    await core.create_namespaced_pod(namespace, script_pod("once", shared_dir))
    await core.create_namespaced_pod(
        namespace, script_pod("again", shared_dir, port=8081, restart_policy="Always")
    )
    for name in ("once", "again"):
        await wait_for_pod(core, namespace, name, is_ready, "to become Ready")

    killed = await cluster.admin.kill_pod_async(namespace, "once")
    pod = await wait_for_pod(
        core, namespace, "once", lambda p: p.status.phase == "Failed", "to fail after SIGKILL"
    )
    state = terminated_state(pod)
    assert state is not None
    assert state.exit_code == 137
    assert state.reason == "Error"
    assert not any(is_alive(pid) for pid in killed)

    await cluster.admin.kill_pod_async(namespace, "again")

    def restarted(p: Any) -> bool:
        statuses = p.status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count == 1 and is_ready(p)

    pod = await wait_for_pod(core, namespace, "again", restarted, "to restart and be Ready")
    assert pod.status.phase == "Running"
    assert pod.status.container_statuses[0].last_state.terminated.exit_code == 137


async def test_deleting_the_owner_cascades_to_its_pods(
    namespace: str, kube: Any, shared_dir: Path
) -> None:
    core: Any = client.CoreV1Api(kube)
    owner = await core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    manifest = script_pod("owned", shared_dir)
    manifest["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    ]
    await core.create_namespaced_pod(namespace, manifest)
    await wait_for_pod(core, namespace, "owned", is_ready, "to become Ready")
    pid = (await pod_record(shared_dir, "owned"))["pid"]

    await core.delete_namespaced_config_map("owner", namespace)

    await wait_for_pod_gone(core, namespace, "owned", timeout=60)
    await wait_process_gone(pid, 15, "the owned pod's process to stop")


async def test_rbac_refuses_a_service_account_without_rights(
    cluster: Cluster, namespace: str, kube: Any
) -> None:
    core: Any = client.CoreV1Api(kube)
    await core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
    token = (
        await core.create_namespaced_service_account_token("reader", namespace, request)
    ).status.token
    url = f"{cluster.server}/api/v1/namespaces/{namespace}/pods"
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(verify=cluster.ssl_context()) as http:
        refused = await http.get(url, headers=headers)
        assert refused.status_code == 403
        assert f"system:serviceaccount:{namespace}:reader" in refused.json()["message"]

        rbac: Any = client.RbacAuthorizationV1Api(kube)
        await rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
        )
        await rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "reader-reads-pods"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "pod-reader",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
            },
        )

        async def allowed() -> bool:
            return (await http.get(url, headers=headers)).status_code == 200

        await wait_for(allowed, 15, "the RoleBinding to grant the token access")


async def test_pods_devcluster_cannot_run_fail_with_a_reason_and_the_agent_keeps_going(
    namespace: str, kube: Any, shared_dir: Path
) -> None:
    core: Any = client.CoreV1Api(kube)
    image_only = {
        "metadata": {"name": "image-only"},
        "spec": {"containers": [{"name": "main", "image": "nginx:1.27"}]},
    }
    empty_dir = process_pod("scratch", ["python", "-c", "pass"])
    empty_dir["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    empty_dir["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "scratch", "mountPath": "/scratch"}
    ]
    await core.create_namespaced_pod(namespace, image_only)
    await core.create_namespaced_pod(namespace, empty_dir)

    def failed(p: Any) -> bool:
        return bool(p.status.phase == "Failed")

    pod = await wait_for_pod(core, namespace, "image-only", failed, "to fail")
    assert pod.status.reason == "NoCommand"
    assert "has no command" in pod.status.message
    pod = await wait_for_pod(core, namespace, "scratch", failed, "to fail")
    assert pod.status.reason == "UnsupportedVolume"
    assert "emptyDir" in pod.status.message

    await core.create_namespaced_pod(namespace, script_pod("fine", shared_dir))
    await wait_for_pod(core, namespace, "fine", is_ready, "to become Ready after the failures")


SECRET_READER = r"""
import json, os, pathlib
folder = pathlib.Path(os.environ["CREDS_DIR"])
files = {p.name: p.read_text() for p in folder.iterdir()}
out = pathlib.Path(os.environ["OUT_DIR"]) / (os.environ["POD_NAME"] + ".json")
out.write_text(json.dumps({"dir": str(folder), "files": files, "below": os.environ["KEY_FILE"]}))
"""


async def test_a_secret_volume_is_found_through_the_env_that_names_its_mount_path(
    namespace: str, kube: Any, shared_dir: Path
) -> None:
    """A process has no mount namespace: the Secret's keys are written into the pod's own
    folder and env values naming the mount path name that folder; a missing Secret leaves the
    container waiting until it exists, as the kubelet does."""
    core: Any = client.CoreV1Api(kube)
    mount = "/var/run/secrets/example.dev/creds"
    manifest = process_pod(
        "reads-secret",
        ["python", "-c", SECRET_READER],
        env={"OUT_DIR": str(shared_dir), "CREDS_DIR": mount, "KEY_FILE": f"{mount}/accessKeyId"},
        host_paths=[str(shared_dir)],
    )
    manifest["spec"]["volumes"].append({"name": "creds", "secret": {"secretName": "bucket"}})
    manifest["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "creds", "mountPath": mount, "readOnly": True}
    )
    await core.create_namespaced_pod(namespace, manifest)

    def waiting_for_the_secret(p: Any) -> bool:
        statuses = p.status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting is not None and waiting.reason == "CreateContainerConfigError"

    pod = await wait_for_pod(
        core, namespace, "reads-secret", waiting_for_the_secret, "to wait for its Secret"
    )
    assert 'secret "bucket" not found' in pod.status.container_statuses[0].state.waiting.message
    await core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "bucket"},
            "stringData": {"accessKeyId": "AK", "secretAccessKey": "S"},
        },
    )

    def succeeded(p: Any) -> bool:
        return bool(p.status.phase == "Succeeded")

    await wait_for_pod(core, namespace, "reads-secret", succeeded, "to read its Secret and exit")
    record = await pod_record(shared_dir, "reads-secret")
    assert record["files"] == {"accessKeyId": "AK", "secretAccessKey": "S"}
    assert record["dir"] != mount
    assert record["below"] == f"{record['dir']}/accessKeyId"


async def test_lose_node_kills_its_processes_and_marks_it_not_ready(
    cluster: Cluster, namespace: str, kube: Any, shared_dir: Path
) -> None:
    core: Any = client.CoreV1Api(kube)
    manifest = script_pod(
        "on-cpu",
        shared_dir,
        restart_policy="Always",
        node_selector={"kubernetes.io/hostname": "cpu-0"},
    )
    await core.create_namespaced_pod(namespace, manifest)
    await wait_for_pod(core, namespace, "on-cpu", is_ready, "to become Ready")
    pid = (await pod_record(shared_dir, "on-cpu"))["pid"]

    async def node_ready(ready: bool) -> bool:
        return node_is_ready(await core.read_node("cpu-0")) is ready

    try:
        await cluster.admin.lose_node_async("cpu-0")
        await wait_process_gone(pid, 10, "the lost node's pod process to be killed")
        await wait_for(lambda: node_ready(False), 10, "node cpu-0 to be NotReady")
        # What the node lifecycle controller would do after its grace period, at once.
        await wait_for_pod(core, namespace, "on-cpu", lambda p: not is_ready(p), "to be unready")
    finally:
        await cluster.admin.restore_node_async("cpu-0")
    await wait_for(lambda: node_ready(True), 30, "node cpu-0 to be Ready and untainted again")

    def restarted(p: Any) -> bool:
        statuses = p.status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count >= 1 and is_ready(p)

    await wait_for_pod(core, namespace, "on-cpu", restarted, "to restart on the restored node")


def _devcluster(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_up_refuses_a_directory_in_use(cluster: Cluster) -> None:
    result = _devcluster("up", "--dir", str(cluster.dir))
    assert result.returncode == 1
    assert "is in use by a running devcluster" in result.stderr
    cluster.kubectl("get", "nodes")  # and the running cluster is untouched


def test_up_without_binaries_says_how_to_get_them(tmp_path: Path) -> None:
    result = _devcluster(
        "up", "--dir", str(tmp_path / "c"), env={"DEVCLUSTER_BIN": str(tmp_path / "none")}
    )
    assert result.returncode == 1
    assert "make cluster-binaries" in result.stderr
    assert "kube-apiserver" in result.stderr


def test_up_refuses_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _devcluster("up", "--dir", str(tmp_path / "c"), "--apiserver-port", str(port))
    assert result.returncode == 1
    assert f"port {port}" in result.stderr
    assert "already in use" in result.stderr


def test_down_leaves_no_process_behind(tmp_path: Path) -> None:
    second = Cluster.start(tmp_path / "second", nodes=[NodeSpec(name="solo")])
    recorded = [record.pid for record in second.state.processes]
    try:
        # A grandchild that leaves the pod's process group: only the marker sweep can find it.
        pod = process_pod("escapee", ["sh", "-c", "setsid sleep 600 & exec sleep 600"])
        second.kubectl("apply", "-f", "-", input=json.dumps(pod))
        wait_for_sync(
            lambda: (
                second.kubectl("get", "pod", "escapee", "-o", "jsonpath={.status.phase}").stdout
                == "Running"
            ),
            timeout=30,
            what="pod escapee to run",
            interval=0.2,
        )
        wait_for_sync(
            lambda: len(second.processes()) >= len(recorded) + 2,
            timeout=10,
            what="the pod's process and its escaped grandchild",
        )
        before = second.processes()
    finally:
        second.stop()
    assert second.processes() == []
    assert not any(is_alive(pid) for pid in [*recorded, *before])


def test_down_after_an_interrupted_up_stops_what_was_started(tmp_path: Path) -> None:
    root = tmp_path / "interrupted"
    up = subprocess.Popen(
        [sys.executable, "-m", "devcluster", "up", "--dir", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def apiserver_recorded() -> bool:
            state = read_state(root / "state.json") if (root / "state.json").exists() else None
            return state is not None and any(r.name == "kube-apiserver" for r in state.processes)

        wait_for_sync(apiserver_recorded, 30, "up to record kube-apiserver's pid")
    finally:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait(timeout=10)
    state = read_state(root / "state.json")
    assert state is not None
    assert marked_processes(state.cluster_id)  # the interrupted up left processes running

    result = _devcluster("down", "--dir", str(root))

    assert result.returncode == 0, result.stderr
    assert marked_processes(state.cluster_id) == []
