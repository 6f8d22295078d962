"""The operator installed by Helm as a pod of the project's image, on a real kubelet (containerd).

`helm install charts/rollout-operator` with the image built here (loaded into the node's
containerd, `image.pullPolicy=Never`) must start the operator Deployment's pod under the chart's
ServiceAccount: in-cluster configuration from the projected token, the API server through the
`kubernetes` Service, the kubelet's liveness probe passing, the metrics Service answering inside
the cluster, and no admin credentials in the pod. `helm uninstall` must remove all of it,
containers on the node included.
"""

from __future__ import annotations

import pytest
from container_support import (
    FULLNAME,
    RELEASE,
    get_json,
    helm,
    helm_install_operator,
    node_containers,
)

from devcluster.image import ProjectImage
from devcluster.waiting import wait_for_sync
from harness.providers import ContainerClusterProvider

pytestmark = pytest.mark.timeout(900)


def test_helm_install_runs_the_operator_pod_from_the_image_under_the_charts_service_account(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    image_on_node: ProjectImage,
) -> None:
    namespace = operator_release
    [pod] = get_json(
        container_provider, "pods", "-n", namespace, "-l", "app.kubernetes.io/name=rollout-operator"
    )["items"]
    spec, status = pod["spec"], pod["status"]
    assert spec["serviceAccountName"] == FULLNAME
    [container] = spec["containers"]
    assert container["image"] == image_on_node.short_name
    [container_status] = status["containerStatuses"]
    assert container_status["ready"] is True
    assert container_status["restartCount"] == 0
    # The kubelet ran the image built here (containerd reports it by its config digest).
    assert container_status["imageID"].endswith(image_on_node.image_id.removeprefix("sha256:")) or (
        container_status["imageID"].endswith(image_on_node.digest)
    ), (container_status["imageID"], image_on_node)
    assert container_status["containerID"].startswith("containerd://")

    # No admin credentials: the only API credential is the projected ServiceAccount token.
    env_names = {item["name"] for item in container.get("env", [])}
    assert "KUBECONFIG" not in env_names
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    secrets = [name for name, volume in volumes.items() if "secret" in volume]
    assert secrets == [], secrets
    [token] = [v for v in volumes.values() if "projected" in v]
    sources = token["projected"]["sources"]
    assert any("serviceAccountToken" in source for source in sources)

    # The kubelet's liveness probe of /healthz (Kopf's, up once the operator logged in with the
    # in-cluster config through the kubernetes Service and started its watches) succeeds.
    node = spec["nodeName"]
    pod_name = pod["metadata"]["name"]

    def liveness_succeeded() -> bool:
        metrics = container_provider.kubectl(
            "get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/probes", check=False
        ).stdout
        return any(
            line.startswith("prober_probe_total{")
            and 'probe_type="Liveness"' in line
            and f'pod="{pod_name}"' in line
            and 'result="successful"' in line
            and float(line.rsplit(" ", 1)[1]) >= 1
            for line in metrics.splitlines()
        )

    wait_for_sync(liveness_succeeded, 90, "the kubelet's first successful liveness probe")
    events = get_json(
        container_provider,
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={pod_name}",
    )["items"]
    assert not [e for e in events if e["reason"] in {"Unhealthy", "BackOff", "Killing"}], events

    # The metrics Service answers inside the cluster (kube-proxy's ClusterIP to the pod), to a
    # client pod of the same image (present on every provider's node).
    service = get_json(container_provider, "service", f"{FULLNAME}-metrics", "-n", namespace)
    cluster_ip = service["spec"]["clusterIP"]
    container_provider.kubectl(
        "run",
        "metrics-client",
        "-n",
        namespace,
        "--image",
        image_on_node.short_name,
        "--image-pull-policy=Never",
        "--restart=Never",
        "--command",
        "--",
        "python",
        "-c",
        "import sys, urllib.request; "
        "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())",
        f"http://{cluster_ip}:9090/metrics",
    )

    def client_done() -> bool:
        phase = get_json(container_provider, "pod", "metrics-client", "-n", namespace)["status"]
        return phase.get("phase") in {"Succeeded", "Failed"}

    wait_for_sync(client_done, 120, "the metrics client pod to finish")
    scraped = container_provider.kubectl("logs", "metrics-client", "-n", namespace).stdout
    assert "rollout_checkpoint_duration_seconds" in scraped, scraped[-2000:]
    container_provider.kubectl("delete", "pod", "metrics-client", "-n", namespace, "--wait=true")


def test_helm_uninstall_removes_the_operator_and_its_containers(
    container_provider: ContainerClusterProvider,
    provider_namespace: str,
    image_on_node: ProjectImage,
) -> None:
    namespace = provider_namespace
    installed = helm_install_operator(container_provider, namespace, image_on_node)
    assert installed.returncode == 0, installed.stderr
    assert node_containers(container_provider, namespace)
    removed = helm(
        container_provider,
        "uninstall",
        RELEASE,
        "--namespace",
        namespace,
        "--wait",
        "--timeout",
        "120s",
    )
    assert removed.returncode == 0, removed.stderr

    def gone() -> bool:
        left = container_provider.kubectl(
            "get",
            "deployment,pods,serviceaccount,service",
            "-n",
            namespace,
            "-l",
            "app.kubernetes.io/instance=" + RELEASE,
            "-o",
            "name",
        ).stdout.split()
        roles = container_provider.kubectl(
            "get",
            "clusterrole,clusterrolebinding",
            "-o",
            "name",
            "-l",
            "app.kubernetes.io/instance=" + RELEASE,
        ).stdout.split()
        return not left and not roles and not node_containers(container_provider, namespace)

    wait_for_sync(gone, 120, "helm uninstall to remove the operator, its RBAC and containers")
