"""`helm install --dry-run=server` of the chart against a real API server (devcluster).

Rendering (tests/unit/test_chart.py) says nothing about whether the API server accepts the
objects: a server-side dry run validates every manifest (Deployment, RBAC, NetworkPolicy, the
peering object against its CRD) as an install would, without running anything. It also renders
NOTES.txt, whose commands must name the objects the chart really creates.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from devcluster.cluster import Cluster
from devcluster.paths import find_binaries

CHART = Path(__file__).resolve().parents[2] / "charts" / "rollout-operator"


def helm_install_dry_run(
    cluster: Cluster, namespace: str, values: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    helm = find_binaries(("helm",))["helm"]
    argv = [str(helm), "install", "rel", str(CHART), "--namespace", namespace]
    argv += ["--dry-run=server", "--kubeconfig", str(cluster.kubeconfig)]
    for key, value in values.items():
        argv += ["--set", f"{key}={value}"]
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_the_default_install_is_accepted_and_its_notes_name_real_objects(
    cluster: Cluster, namespace: str
) -> None:
    result = helm_install_dry_run(cluster, namespace, {})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "STATUS: pending-install" in out
    assert f"kubectl -n {namespace} rollout status deployment/rel-rollout-operator" in out
    assert "kubectl wait --for=condition=Established crd/rolloutsets.checkpoint.rollout.dev" in out
    assert f"--as=system:serviceaccount:{namespace}:rel-rollout-operator" in out
    assert "port-forward service/rel-rollout-operator-metrics 9090" in out
    manifest = out.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    kinds = {doc["kind"] for doc in yaml.safe_load_all(manifest) if doc}
    assert kinds == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment"}


def test_namespaced_mode_with_peering_and_network_policy_is_accepted(
    cluster: Cluster, namespace: str
) -> None:
    # The peering CRDs come from the chart's crds/, which a dry run does not install.
    cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds" / "kopf.dev-peerings.yaml"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=30s", "crd/kopfpeerings.kopf.dev"
    )
    values = {
        "watch.mode": "namespaced",
        "watch.namespaces": "{" + namespace + "}",
        "replicas": "2",
        "networkPolicy.enabled": "true",
        "storage.claims": "{ckpt}",
    }
    try:
        result = helm_install_dry_run(cluster, namespace, values)
    finally:
        peerings = str(CHART / "crds" / "kopf.dev-peerings.yaml")
        cluster.kubectl("delete", "-f", peerings, "--wait=false", check=False)
    assert result.returncode == 0, result.stderr
    assert f"It serves RolloutSets in: {namespace}." in result.stdout
    assert "2 replicas run with Kopf peering (rollout-operator)" in result.stdout
    manifest = result.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(manifest) if doc)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Service",
            "Deployment",
            "NetworkPolicy",
            "KopfPeering",
        ]
    )
