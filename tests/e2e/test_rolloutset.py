"""RolloutSets on devcluster with the operator running as a process (`rollout-operator run`).

The participant pods run PEER_SCRIPT instead of the reference servers: it waits (with a deadline)
until every `ROLLOUT_PEER_<ROLE>_URL` it was given answers, then serves its own environment as
JSON on its pod IP. So a Ready set proves the peer wiring works from inside the pods, and the
test reads back exactly what each pod was started with.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client
from rollout_operator.model import api, crdgen

from devcluster.cluster import Cluster
from devcluster.testing import WaitTimeout, wait_for, wait_for_sync
from harness.objects import wait_established
from harness.operatorprocess import OperatorProcess

CRDS = Path(__file__).resolve().parents[2] / "crds"

PEER_SCRIPT = r"""
import http.server, json, os, sys, time, urllib.request
deadline = time.monotonic() + 30
peers = {k: v for k, v in os.environ.items() if k.startswith("ROLLOUT_PEER_")}
for key, url in sorted(peers.items()):
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"peer {key}={url} did not answer within 30 s")
            time.sleep(0.2)
seen = {k: v for k, v in os.environ.items() if k.startswith("ROLLOUT_")}
seen["ROLLOUT_CONTROL_TOKEN"] = len(seen.get("ROLLOUT_CONTROL_TOKEN", ""))
seen["checkpoint_root_mounted"] = os.path.isdir(os.environ["ROLLOUT_CHECKPOINT_ROOT"])
body = json.dumps(seen).encode()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer((os.environ["ROLLOUT_POD_IP"], 8000), Handler).serve_forever()
"""

TIMEOUT = 60.0


@pytest.fixture
def operator(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    names = [f"crd/{kind.crd_name}" for kind in crdgen.KINDS]
    wait_established(cluster, names)
    running = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log")
    running.start()
    try:
        yield running
    finally:
        # Delete the sets while the operator runs, so it releases its finalizer.
        if running.process is None:
            running.start()
        deleted = cluster.kubectl(
            "delete", "rset", "--all", "-n", namespace, "--timeout=60s", check=False
        )
        running.stop()
        if deleted.returncode != 0:
            for name in cluster.kubectl(
                "get", "rset", "-n", namespace, "-o", "name", check=False
            ).stdout.split():
                cluster.kubectl(
                    "patch",
                    name,
                    "-n",
                    namespace,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )


@pytest.fixture
def custom(kube: Any) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube)


def template(command: list[str] | None = None, gpus: int = 0) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "server",
        "image": "unused.invalid/rollout",
        "command": command or [sys.executable, "-c", PEER_SCRIPT],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "control"}, "periodSeconds": 1},
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {"metadata": {"labels": {"app": "e2e"}}, "spec": {"containers": [container]}}


def rollout_set(
    name: str,
    storage: Path,
    replicas: dict[str, int] | None = None,
    templates: dict[str, dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    replicas = replicas or {"model": 1, "resources": 1, "agent": 1, "environment": 2}
    templates = templates or {}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": name},
        "spec": {
            "participants": [
                {"role": role, "replicas": n, "template": templates.get(role, template())}
                for role, n in replicas.items()
            ],
            "storage": {
                "path": str(storage),
                "volume": {"hostPath": {"path": str(storage), "type": "DirectoryOrCreate"}},
            },
            **spec,
        },
    }


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            return dict(item)
    return None


async def wait_for_set(
    custom: client.CustomObjectsApi,
    operator: OperatorProcess,
    name: str,
    what: str,
    predicate: Any,
    timeout: float = TIMEOUT,  # noqa: ASYNC109 - a poll budget
) -> dict[str, Any]:
    """Poll the RolloutSet until `predicate(obj)`; a timeout shows the operator's log."""

    async def check() -> dict[str, Any] | None:
        obj: dict[str, Any] = await custom.get_namespaced_custom_object(
            api.GROUP, api.VERSION, operator.namespaces[0], api.ROLLOUT_SET_PLURAL, name
        )
        return obj if predicate(obj) else None

    try:
        result: dict[str, Any] = await wait_for(check, timeout, f"RolloutSet {name} {what}")
    except WaitTimeout as error:
        raise AssertionError(f"{error}\n--- operator log ---\n{operator.tail()}") from error
    return result


def require(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    found = condition(obj, type_)
    assert found is not None, f"no {type_} condition in {obj.get('status')}"
    return found


def has_condition(type_: str, status: str, reason: str | None = None) -> Any:
    def check(obj: dict[str, Any]) -> bool:
        found = condition(obj, type_)
        return (
            found is not None
            and found["status"] == status
            and (reason is None or found["reason"] == reason)
            and found.get("observedGeneration") == obj["metadata"]["generation"]
        )

    return check


def pods_of(cluster: Cluster, namespace: str, selector: str) -> dict[str, dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


async def test_a_set_becomes_ready_and_its_participants_reach_each_other(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    custom: client.CustomObjectsApi,
    tmp_path: Path,
) -> None:
    storage = tmp_path / "checkpoints"
    apply(cluster, namespace, rollout_set("math-rl", storage))
    ready = await wait_for_set(
        custom, operator, "math-rl", "Ready", has_condition("Ready", "True", "AllParticipantsReady")
    )
    cluster.kubectl(
        "wait", "--for=condition=Ready", "rolloutset/math-rl", "-n", namespace, "--timeout=10s"
    )
    status = ready["status"]
    assert status["attempt"] == 1
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert require(ready, "Degraded")["status"] == "False"
    assert require(ready, "Progressing")["reason"] == "AttemptReady"

    pods = pods_of(cluster, namespace, "checkpoint.rollout.dev/set=math-rl")
    assert sorted(pods) == [
        "math-rl-agent-0-a1",
        "math-rl-environment-0-a1",
        "math-rl-environment-1-a1",
        "math-rl-model-0-a1",
        "math-rl-resources-0-a1",
    ]
    addresses = {(p["role"], p["index"]): p["address"] for p in status["participants"]}
    assert len(addresses) == 5
    assert all(p["ready"] for p in status["participants"])
    for participant in status["participants"]:
        pod = pods[participant["pod"]]
        assert participant["address"] == f"http://{pod['status']['podIP']}:8000"
        assert pod["metadata"]["labels"]["app"] == "e2e"
        assert pod["metadata"]["labels"]["checkpoint.rollout.dev/attempt"] == "1"
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == (
            "RolloutSet",
            "math-rl",
            True,
        )
        assert pod["spec"]["restartPolicy"] == "Never"

    async with httpx.AsyncClient(timeout=5) as http:
        seen = {key: (await http.get(address)).json() for key, address in addresses.items()}
        live = await http.get(operator.liveness)
    assert live.status_code == 200
    environment = seen[("environment", 1)]
    assert environment["ROLLOUT_SET"] == "math-rl"
    assert environment["ROLLOUT_ROLE"] == "environment"
    assert environment["ROLLOUT_INDEX"] == "1"
    assert environment["ROLLOUT_ATTEMPT"] == "1"
    assert environment["ROLLOUT_CHECKPOINT_ROOT"] == str(storage)
    assert environment["ROLLOUT_CONTROL_TOKEN"] >= 40
    assert environment["checkpoint_root_mounted"] is True
    assert environment["ROLLOUT_PEER_AGENT_URL"] == addresses[("agent", 0)]
    assert environment["ROLLOUT_PEER_MODEL_URL"] == addresses[("model", 0)]
    assert environment["ROLLOUT_PEER_RESOURCES_URL"] == addresses[("resources", 0)]
    agent = seen[("agent", 0)]
    assert agent["ROLLOUT_PEER_MODEL_URL"] == addresses[("model", 0)]
    assert "ROLLOUT_PEER_ENVIRONMENT_URL" not in agent
    assert not [k for k in seen[("model", 0)] if k.startswith("ROLLOUT_PEER_")]

    services = json.loads(cluster.kubectl("get", "services", "-n", namespace, "-o", "json").stdout)[
        "items"
    ]
    assert sorted(s["metadata"]["name"] for s in services) == [
        "math-rl-agent",
        "math-rl-environment",
        "math-rl-model",
        "math-rl-resources",
    ]
    assert {s["spec"]["clusterIP"] for s in services} == {"None"}
    cluster.kubectl("get", "secret", "math-rl-control-token", "-n", namespace)


async def test_a_set_whose_pods_cannot_start_is_degraded_while_another_becomes_ready(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    custom: client.CustomObjectsApi,
    tmp_path: Path,
) -> None:
    storage = tmp_path / "checkpoints"
    two_roles = {"model": 1, "environment": 1}
    apply(
        cluster,
        namespace,
        rollout_set(
            "no-gpus",
            storage,
            two_roles,
            {"model": template(gpus=99)},
            progressDeadlineSeconds=3,
        ),
    )
    apply(
        cluster,
        namespace,
        rollout_set("crashing", storage, two_roles, {"model": template(["/bin/false"])}),
    )
    apply(cluster, namespace, rollout_set("healthy", storage, two_roles))

    await wait_for_set(
        custom, operator, "healthy", "Ready", has_condition("Ready", "True", "AllParticipantsReady")
    )
    stuck = await wait_for_set(
        custom,
        operator,
        "no-gpus",
        "Degraded",
        has_condition("Degraded", "True", "PodsNotStarting"),
    )
    message = require(stuck, "Degraded")["message"]
    assert "no-gpus-model-0-a1 Unschedulable" in message
    assert "Insufficient nvidia.com/gpu" in message
    assert "no-gpus-environment-0-a1 (not created: waiting for its peers' addresses)" in message
    assert require(stuck, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert require(stuck, "Ready")["status"] == "False"

    crashed = await wait_for_set(
        custom, operator, "crashing", "Degraded", has_condition("Degraded", "True", "PodsFailed")
    )
    message = require(crashed, "Degraded")["message"]
    assert "crashing-model-0-a1 Failed: container server exited with code 1" in message
    healthy = await wait_for_set(
        custom, operator, "healthy", "still Ready", has_condition("Ready", "True")
    )
    assert require(healthy, "Degraded")["status"] == "False"


async def test_a_spec_change_is_refused_also_after_an_operator_restart(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    custom: client.CustomObjectsApi,
    tmp_path: Path,
) -> None:
    storage = tmp_path / "checkpoints"
    two_roles = {"model": 1, "environment": 1}
    apply(cluster, namespace, rollout_set("math-rl", storage, two_roles))
    await wait_for_set(custom, operator, "math-rl", "Ready", has_condition("Ready", "True"))
    before = {
        name: pod["metadata"]["uid"]
        for name, pod in pods_of(cluster, namespace, "checkpoint.rollout.dev/set=math-rl").items()
    }

    operator.stop()
    apply(cluster, namespace, rollout_set("math-rl", storage, {"model": 1, "environment": 2}))
    operator.start()
    refused = await wait_for_set(
        custom,
        operator,
        "math-rl",
        "SpecChangeRefused",
        has_condition("Degraded", "True", "SpecChangeRefused"),
    )
    assert "environment: replicas 1 -> 2" in require(refused, "Degraded")["message"]
    assert require(refused, "Ready")["status"] == "True"
    after = {
        name: pod["metadata"]["uid"]
        for name, pod in pods_of(cluster, namespace, "checkpoint.rollout.dev/set=math-rl").items()
    }
    assert after == before  # no pod replaced, none added

    apply(cluster, namespace, rollout_set("math-rl", storage, two_roles))
    await wait_for_set(
        custom, operator, "math-rl", "reverted", has_condition("Degraded", "False", "AsExpected")
    )


async def test_deleting_a_set_removes_what_it_owns(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    custom: client.CustomObjectsApi,
    tmp_path: Path,
) -> None:
    apply(cluster, namespace, rollout_set("short-lived", tmp_path / "ckpt", {"model": 1}))
    await wait_for_set(custom, operator, "short-lived", "Ready", has_condition("Ready", "True"))
    cluster.kubectl("delete", "rset", "short-lived", "-n", namespace, "--timeout=60s")
    # The finalizer went only after the set's daemons ended: they returned by themselves when
    # stopped, so Kopf had nothing to cancel (it would log "cancelled. Will escalate.").
    log = operator.log.read_text(errors="replace")
    assert "short-lived" in log
    assert "Will escalate" not in log, operator.tail()
    assert "did not exit in time" not in log, operator.tail()

    def owned_left() -> str:
        return cluster.kubectl(
            "get",
            "pods,services,secrets",
            "-n",
            namespace,
            "-l",
            "checkpoint.rollout.dev/set=short-lived",
            "-o",
            "name",
        ).stdout.strip()

    wait_for_sync(lambda: owned_left() == "", TIMEOUT, "the set's pods, Services and Secret to go")
