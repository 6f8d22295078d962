"""Helpers of the RBAC end-to-end tests (tests/e2e/test_rbac.py and test_sharding.py): the chart's
ServiceAccount and RBAC rendered with the real helm and applied (`render_rbac`, `apply_rbac`,
every verb the namespaced chart grants in `GRANTS`), a kubeconfig holding only a fresh token of
that ServiceAccount, the operator as a process under it (`operator_process`), namespaces and
objects through kubectl, and the one-pod probe set. The `crds` fixture both use is in
`tests/e2e/conftest.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devcluster.cluster import Cluster
from devcluster.paths import find_binaries
from devcluster.testing import wait_for_sync
from devcluster.waiting import WaitTimeout, wait_for
from harness.apiaccounting import service_account_kubeconfig
from harness.operatorprocess import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rollout-operator"
CRDS = ROOT / "crds"
KUBE_VERSION = "1.37.2"
GROUP = "checkpoint.rollout.dev"
CLUSTER_SCOPED = (
    "nodes",
    "namespaces",
    "customresourcedefinitions",
    "resourceflavors",
    "workloadpriorityclasses",
)


# --- the chart's RBAC, rendered and applied ------------------------------------------------------


def render_rbac(release: str, namespace: str, values: dict[str, str]) -> list[dict[str, Any]]:
    """The chart's ServiceAccount and RBAC objects, as `helm install -n <namespace>` would."""
    helm = find_binaries(("helm",))["helm"]
    argv = [str(helm), "template", release, str(CHART), "--namespace", namespace]
    argv += ["--kube-version", KUBE_VERSION]
    for key, value in values.items():
        argv += ["--set", f"{key}={value}"]
    argv += ["--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@dataclass(frozen=True)
class Grant:
    """One verb on one resource, and which probe step first needs it."""

    group: str
    resource: str
    verb: str
    step: str
    """start: Kopf's watches; set: a RolloutSet (with a trainer step: the policy creates a
    checkpoint); checkpoint: a RolloutCheckpoint; kill: a pod lost (recovery); delete: the set
    deleted (its finalizer deletes its checkpoints); queue: a set labelled for a Kueue queue,
    its Workload admitted and then evicted by the test playing Kueue."""

    @property
    def id(self) -> str:
        return f"{self.verb}-{self.resource.replace('/', '-')}"

    @property
    def denial(self) -> str:
        """What the API server says when it refuses this verb (quotes unescaped)."""
        return f'cannot {self.verb} resource "{self.resource}" in API group "{self.group}"'


def _g(group: str, resource: str, steps: dict[str, str]) -> list[Grant]:
    return [Grant(group, resource, verb, step) for verb, step in steps.items()]


GRANTS = [
    *_g(GROUP, "rolloutsets", {"get": "kill", "list": "start", "watch": "start", "patch": "set"}),
    *_g(GROUP, "rolloutsets/status", {"patch": "set"}),
    *_g(
        GROUP,
        "rolloutcheckpoints",
        {
            "list": "start",
            "watch": "start",
            "create": "set",
            "patch": "checkpoint",
            "delete": "delete",
        },
    ),
    *_g(GROUP, "rolloutcheckpoints/status", {"patch": "checkpoint"}),
    *_g(
        "",
        "pods",
        {
            "list": "start",
            "watch": "start",
            "create": "set",
            "delete": "kill",
            "patch": "checkpoint",
        },
    ),
    *_g("", "services", {"create": "set"}),
    *_g("", "secrets", {"get": "set", "create": "set"}),
    *_g("", "events", {"create": "set"}),
    *_g("", "nodes", {"list": "start", "watch": "start"}),
    *_g(
        "coordination.k8s.io",
        "leases",
        {"get": "checkpoint", "create": "checkpoint", "patch": "checkpoint"},
    ),
    *_g(
        "kueue.x-k8s.io",
        "workloads",
        {"list": "start", "watch": "start", "create": "queue"},
    ),
    *_g("kueue.x-k8s.io", "workloads/status", {"patch": "queue"}),
    *_g("kueue.x-k8s.io", "workloadpriorityclasses", {"get": "queue"}),
    *_g("kueue.x-k8s.io", "resourceflavors", {"get": "queue"}),
    *_g("apiextensions.k8s.io", "customresourcedefinitions", {"list": "start", "watch": "start"}),
    *_g("", "namespaces", {"list": "start", "watch": "start"}),
]
"""Every verb the namespaced-mode chart grants (test_the_cases_are_the_charts_grants checks)."""


def namespaced_values(namespace: str) -> dict[str, str]:
    return {"watch.mode": "namespaced", "watch.namespaces": "{" + namespace + "}"}


def service_account(docs: list[dict[str, Any]]) -> tuple[str, str]:
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    return account["metadata"]["namespace"], account["metadata"]["name"]


def apply_rbac(cluster: Cluster, docs: list[dict[str, Any]], probe: Grant) -> None:
    """Apply, then wait until the authorizer's cache grants `probe` (RBAC is eventually
    consistent: an operator started earlier would see 403s that the rules do not cause)."""
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    )
    namespace, name = service_account(docs)
    resource = probe.resource.split("/")[0] + (f".{probe.group}" if probe.group else "")
    argv = ["auth", "can-i", probe.verb, resource, f"--as=system:serviceaccount:{namespace}:{name}"]
    if "/" in probe.resource:
        argv.append(f"--subresource={probe.resource.split('/')[1]}")
    if probe.resource not in CLUSTER_SCOPED:
        argv += ["-n", namespace]
    wait_for_sync(
        lambda: cluster.kubectl(*argv, check=False).stdout.strip() == "yes",
        15,
        f"RBAC to grant {probe.verb} {probe.resource} to {name}",
        interval=0.1,
    )


def delete_rbac(cluster: Cluster, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            cluster.kubectl(
                "delete", doc["kind"], doc["metadata"]["name"], "--wait=false", check=False
            )


def token_kubeconfig(cluster: Cluster, docs: list[dict[str, Any]], path: Path) -> Path:
    """A kubeconfig that authenticates with a fresh ServiceAccount token and nothing else."""
    namespace, name = service_account(docs)
    return service_account_kubeconfig(cluster, namespace, name, path)


# --- the operator as a process under that token --------------------------------------------------


def log_text(op: OperatorProcess) -> str:
    return op.log.read_text(errors="replace") if op.log.exists() else ""


def rbac_denials(op: OperatorProcess, subject: str) -> list[str]:
    """Log lines with an RBAC denial of `subject` (other 403s, e.g. a namespace being
    terminated, are not about RBAC)."""
    marker = f'User "{subject}" cannot'
    return [line for line in log_text(op).replace("\\", "").splitlines() if marker in line]


@contextmanager
def operator_process(
    kubeconfig: Path,
    log: Path,
    namespaces: list[str],
    *,
    args: Sequence[str] = (),
    graceful: bool = True,
) -> Iterator[OperatorProcess]:
    """`rollout-operator run --standalone` with the token kubeconfig. Stopped with SIGTERM (Kopf
    stops its daemons, up to their cancellation timeouts), or SIGKILL when nothing it would
    finish matters (the probes)."""
    # Only the token kubeconfig: no admin credentials may leak in through the environment.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    running = OperatorProcess(
        kubeconfig, namespaces, log, args=[*args, "--standalone"], environment=environment
    )
    running.start()
    try:
        yield running
    finally:
        if graceful:
            running.stop()
        else:
            running.kill()


# --- namespaces and objects, through kubectl -----------------------------------------------------


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    loaded: dict[str, Any] = json.loads(result.stdout)
    return loaded


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            return dict(item)
    return {}


async def wait_obj(
    cluster: Cluster, kind: str, name: str, namespace: str, what: str, check: Any, limit_s: float
) -> dict[str, Any]:
    last: dict[str, Any] = {}

    async def shown() -> dict[str, Any] | None:
        nonlocal last
        last = get_json(cluster, kind, name, "-n", namespace)
        return last if last and check(last) else None

    try:
        return await wait_for(shown, limit_s, f"{kind}/{name} {what}", interval=0.3)
    except WaitTimeout:
        raise AssertionError(
            f"{kind}/{name} not {what} within {limit_s}s; status: {last.get('status')}"
        ) from None


# --- the probe: a set of one real model server ---------------------------------------------------


def probe_set(storage: Path) -> dict[str, Any]:
    """One real model server: enough for the set, its pods, Services, Secret, a recovery, and a
    policy checkpoint that completes (and then annotates the pod: its `podHints` asks for it)."""
    container = {
        "name": "probe",
        "image": "unused.invalid/probe",
        "command": [str(Path(sys.executable).parent / "rollout-server"), "model"],
        "args": ["--host", "$(POD_IP)", "--port", "8000"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "RolloutSet",
        # A trainer step: the checkpoint policy creates a RolloutCheckpoint for it.
        "metadata": {"name": "probe", "annotations": {f"{GROUP}/trainer-step": "1"}},
        "spec": {
            "participants": [
                {"role": "model", "replicas": 1, "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {
                "path": str(storage),
                "volume": {"hostPath": {"path": str(storage), "type": "DirectoryOrCreate"}},
            },
            # The pod hints (opt-in) are what needs `patch pods` once the checkpoint is Ready.
            "checkpointPolicy": {"podHints": True},
        },
    }
