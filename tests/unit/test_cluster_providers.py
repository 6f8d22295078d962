"""The container suite's cluster providers: which one the environment selects, and the commands
the kind provider issues (Docker and kind do not exist on this project's CI machines, so a named
fake command runner records them and answers as docker, kind and kubectl would)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from devcluster.errors import DevclusterError
from harness.providers import (
    IMAGE_NAME,
    KindProvider,
    PodmanKindProvider,
    container_id_of,
    kind_provider_from_environment,
    provider_name_from_environment,
)

KUBECTL = "/pinned/kubectl"


class FakeCommandRunner:
    """Records every argv and answers from `replies` (first matching argv prefix), else `ok`."""

    def __init__(self, replies: dict[tuple[str, ...], tuple[int, str]] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.inputs: list[str | None] = []
        self.replies = replies or {}

    def __call__(
        self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        self.inputs.append(input)
        for prefix, (code, out) in self.replies.items():
            if tuple(argv[: len(prefix)]) == prefix:
                return subprocess.CompletedProcess(list(argv), code, out, "" if code == 0 else out)
        return subprocess.CompletedProcess(list(argv), 0, "", "")


def kind_provider(tmp_path: Path, runner: FakeCommandRunner) -> KindProvider:
    return KindProvider("e2e", tmp_path, runner=runner, kubectl=KUBECTL)


def test_the_provider_is_devcluster_unless_the_environment_says_kind() -> None:
    assert provider_name_from_environment({}) == "devcluster"
    assert provider_name_from_environment({"ROLLOUT_E2E_PROVIDER": ""}) == "devcluster"
    assert provider_name_from_environment({"ROLLOUT_E2E_PROVIDER": "devcluster"}) == "devcluster"
    assert provider_name_from_environment({"ROLLOUT_E2E_PROVIDER": "kind"}) == "kind"
    with pytest.raises(DevclusterError, match=r"use devcluster .* or kind"):
        provider_name_from_environment({"ROLLOUT_E2E_PROVIDER": "minikube"})


def test_the_kind_provider_takes_the_cluster_named_by_kind_cluster(tmp_path: Path) -> None:
    runner = FakeCommandRunner({("kind", "get", "clusters"): (0, "other\nmine\n")})
    provider = kind_provider_from_environment(
        tmp_path, {"KIND_CLUSTER": "mine"}, runner=runner, kubectl=KUBECTL
    )
    assert provider.cluster_name == "mine"
    assert provider.node == "mine-control-plane"
    default = kind_provider_from_environment(
        tmp_path,
        {},
        runner=FakeCommandRunner({("kind", "get", "clusters"): (0, "rollout-e2e\n")}),
        kubectl=KUBECTL,
    )
    assert default.cluster_name == "rollout-e2e"


def test_a_missing_kind_cluster_fails_with_how_to_create_it(tmp_path: Path) -> None:
    runner = FakeCommandRunner({("kind", "get", "clusters"): (0, "other\n")})
    with pytest.raises(DevclusterError, match="make kind-e2e") as failure:
        kind_provider_from_environment(
            tmp_path, {"KIND_CLUSTER": "mine"}, runner=runner, kubectl=KUBECTL
        )
    assert "'mine'" in str(failure.value)


def test_kubectl_runs_the_pinned_kubectl_on_the_kind_clusters_own_kubeconfig(
    tmp_path: Path,
) -> None:
    runner = FakeCommandRunner({("kind", "get", "kubeconfig"): (0, "apiVersion: v1\n")})
    provider = kind_provider(tmp_path, runner)
    provider.kubectl("apply", "-f", "-", input="{}")
    provider.kubectl("get", "pods")
    kubeconfig = tmp_path / "kubeconfig"
    assert runner.calls == [
        ["kind", "get", "kubeconfig", "--name", "e2e"],
        [KUBECTL, f"--kubeconfig={kubeconfig}", "apply", "-f", "-"],
        [KUBECTL, f"--kubeconfig={kubeconfig}", "get", "pods"],
    ]
    assert runner.inputs[1] == "{}"
    assert kubeconfig.read_text() == "apiVersion: v1\n"
    assert kubeconfig.stat().st_mode & 0o777 == 0o600


def test_a_failing_kubectl_raises_with_its_stderr_when_checked(tmp_path: Path) -> None:
    runner = FakeCommandRunner({(KUBECTL,): (1, "forbidden")})
    provider = kind_provider(tmp_path, runner)
    provider._kubeconfig = tmp_path / "kubeconfig"
    assert provider.kubectl("get", "pods", check=False).returncode == 1
    with pytest.raises(DevclusterError, match="kubectl get pods failed with 1: forbidden"):
        provider.kubectl("get", "pods")


def test_the_kill_is_a_sigkill_through_the_nodes_containerd(tmp_path: Path) -> None:
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "main", "containerID": "containerd://abc123"},
                {"name": "side", "containerID": "containerd://def456"},
            ]
        }
    }
    runner = FakeCommandRunner({(KUBECTL,): (0, json.dumps(pod))})
    provider = kind_provider(tmp_path, runner)
    provider._kubeconfig = tmp_path / "kubeconfig"
    provider.kill_container("ns", "model-0", "side")
    assert runner.calls[0][2:] == ["get", "pod", "model-0", "-n", "ns", "-o", "json"]
    assert runner.calls[1] == [
        "docker",
        "exec",
        "e2e-control-plane",
        "ctr",
        "-n",
        "k8s.io",
        "tasks",
        "kill",
        "--signal",
        "SIGKILL",
        "def456",
    ]


def test_a_pod_without_a_started_container_cannot_be_killed() -> None:
    with pytest.raises(DevclusterError, match="no running container"):
        container_id_of({"status": {"containerStatuses": [{"name": "main"}]}}, None)


def test_the_writable_folder_is_made_inside_the_node_container(tmp_path: Path) -> None:
    runner = FakeCommandRunner()
    kind_provider(tmp_path, runner).make_writable_folder(Path("/tmp/rollout-containers-x"))
    assert runner.calls == [
        [
            "docker",
            "exec",
            "e2e-control-plane",
            "mkdir",
            "-p",
            "-m",
            "1777",
            "/tmp/rollout-containers-x",
        ],
        ["docker", "exec", "e2e-control-plane", "chmod", "1777", "/tmp/rollout-containers-x"],
    ]


def test_node_containers_and_leftovers_are_listed_by_pod_namespace_label(tmp_path: Path) -> None:
    runner = FakeCommandRunner({("docker", "exec"): (0, "c1\nc2\n")})
    provider = kind_provider(tmp_path, runner)
    assert provider.node_containers("e2e-a") == ["c1", "c2"]
    assert provider.leftovers("e2e-") == ["container c1", "container c2"]
    ctr = ["docker", "exec", "e2e-control-plane", "ctr", "-n", "k8s.io", "containers", "ls", "-q"]
    assert runner.calls == [
        [*ctr, "labels.io.kubernetes.pod.namespace==e2e-a"],
        [*ctr, 'labels."io.kubernetes.pod.namespace"~="^e2e-"'],
    ]


def test_the_image_is_built_by_docker_and_loaded_as_an_archive(tmp_path: Path) -> None:
    info = [{"Id": "sha256:" + "c" * 64, "RepoDigests": [], "Size": 123}]
    runner = FakeCommandRunner({("docker", "image", "inspect"): (0, json.dumps(info))})
    provider = kind_provider(tmp_path, runner)
    image = provider.load_project_image(Path("/inputs"))
    archive = tmp_path / "image" / "image.oci.tar"
    assert runner.calls == [
        ["docker", "build", "-t", IMAGE_NAME, "/inputs"],
        ["docker", "image", "inspect", IMAGE_NAME],
        ["docker", "save", "-o", str(archive), IMAGE_NAME],
        ["kind", "load", "image-archive", str(archive), "--name", "e2e"],
    ]
    assert image.name == IMAGE_NAME
    assert image.short_name == "rollout-checkpoint-operator:dev"
    assert image.image_id == image.digest == "sha256:" + "c" * 64
    assert image.size_bytes == 123


def test_a_failed_docker_build_stops_before_loading(tmp_path: Path) -> None:
    runner = FakeCommandRunner({("docker", "build"): (1, "no space left on device")})
    with pytest.raises(DevclusterError, match=r"docker build .* no space left on device"):
        kind_provider(tmp_path, runner).load_project_image(Path("/inputs"))
    assert len(runner.calls) == 1


def test_on_the_podman_kind_cluster_the_kill_runs_on_the_pods_own_node(tmp_path: Path) -> None:
    """Several nodes: the SIGKILL goes to the containerd of the node the pod runs on, through
    `podman exec` inside the cluster's network namespace on the cluster's own podman config."""
    pod = {
        "spec": {"nodeName": "rollout-worker2"},
        "status": {"containerStatuses": [{"name": "main", "containerID": "containerd://abc"}]},
    }
    runner = FakeCommandRunner({(KUBECTL,): (0, json.dumps(pod))})
    provider = PodmanKindProvider(
        "rollout", tmp_path, tmp_path / "kubeconfig", runner=runner, kubectl=KUBECTL
    )
    provider.kill_container("ns", "model-0")
    assert runner.calls[0] == [
        KUBECTL,
        f"--kubeconfig={tmp_path / 'kubeconfig'}",
        *["get", "pod", "model-0", "-n", "ns", "-o", "json"],
    ]
    argv = runner.calls[1]
    assert argv[:3] == ["nsenter", "--net=/run/netns/rollout-kind", "--"]
    assert "CONTAINERS_CONF=/run/rollout-kind/conf/containers.conf" in argv
    podman = argv.index("podman")
    assert argv[podman:] == [
        *["podman", "exec", "rollout-worker2"],
        *["ctr", "-n", "k8s.io", "tasks", "kill", "--signal", "SIGKILL", "abc"],
    ]


def test_a_lost_node_is_its_container_sigkilled(tmp_path: Path) -> None:
    runner = FakeCommandRunner()
    provider = PodmanKindProvider(
        "rollout", tmp_path, tmp_path / "kubeconfig", runner=runner, kubectl=KUBECTL
    )
    provider.kill_node("rollout-worker")
    argv = runner.calls[0]
    assert argv[argv.index("podman") :] == ["podman", "kill", "--signal", "KILL", "rollout-worker"]
