"""The cluster providers the container suite (`tests/containers`) runs against, one seam for two.

The suite needs from a cluster with a real kubelet and containerd only what this module's
`ContainerClusterProvider` protocol names: kubectl and helm on a kubeconfig, the project's image
on the node, a SIGKILL to a container's main process inside the node, a hostPath folder writable
by the image's user, the containers the node holds for a namespace, and what a run left behind.
Two implementations:

- `DevclusterProvider`: devcluster's container node (`Cluster.start(node_runtime="containerd")`),
  the image built by `image/build.sh` (buildah) and imported into its containerd. What `make
  test` runs here.
- `KindProvider`: an existing kind cluster on a machine with Docker (`make kind-e2e` creates it):
  `docker build` of the Dockerfile, `kind load image-archive`, and `docker exec <node> ctr ...`
  for the kill and the node's containers. Docker and kind do not exist on the machines this
  project's CI runs on, so this path is only unit-tested there (the commands it issues, through a
  fake `CommandRunner`); see docs/containers.md.

- `PodmanKindProvider`: the kind cluster `make kind` starts on machines without Docker
  (`kind/up.sh`: podman inside a network namespace of its own, docs/kind.md), several nodes;
  the node commands go through `podman exec` in that namespace, and it can stop and start a
  whole node container (a worker lost, and back). `tests/kind` runs on it.

`provider_from_environment` picks one: `ROLLOUT_E2E_PROVIDER=devcluster` (the default) or `kind`
with `KIND_CLUSTER` (default `rollout-e2e`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Literal, Protocol

from devcluster.cluster import Cluster
from devcluster.errors import DevclusterError
from devcluster.image import ProjectImage, build_project_image
from devcluster.paths import find_binaries

ProviderName = Literal["devcluster", "kind"]
PROVIDER_ENV: Final = "ROLLOUT_E2E_PROVIDER"
KIND_CLUSTER_ENV: Final = "KIND_CLUSTER"
DEFAULT_KIND_CLUSTER: Final = "rollout-e2e"
IMAGE_NAME: Final = "docker.io/library/rollout-checkpoint-operator:dev"
POD_NAMESPACE_LABEL: Final = "io.kubernetes.pod.namespace"
CONTAINERD_NAMESPACE: Final = "k8s.io"


class ContainerClusterProvider(Protocol):
    """What the container suite uses of a cluster whose kubelet runs containers (containerd)."""

    @property
    def name(self) -> ProviderName: ...

    @property
    def dir(self) -> Path:
        """A folder of this run's own (helm's caches, the kind kubeconfig)."""
        ...

    @property
    def kubeconfig(self) -> Path:
        """A kubeconfig whose current context is the cluster (for kubectl, helm, clients)."""
        ...

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]: ...

    def load_project_image(self, inputs: Path) -> ProjectImage:
        """Builds the project's image from the build inputs in `inputs` and puts it on the node,
        so pods run it with `imagePullPolicy: Never`."""
        ...

    def kill_container(
        self, namespace: str, pod: str, container: str | None = None, *, sig: str = "SIGKILL"
    ) -> None:
        """SIGKILLs the main process of a pod's container (the first, or the named one) inside
        the node, through containerd, as a crash or the OOM killer would; `sig` sends another
        signal the same way (SIGSTOP freezes the process, its sockets open; SIGCONT thaws it)."""
        ...

    def make_writable_folder(self, path: Path) -> None:
        """Creates `path` on the node, world-writable with the sticky bit (mode 1777), for a
        hostPath volume written by the image's non-root user."""
        ...

    def node_containers(self, namespace: str) -> list[str]:
        """Containers (pod sandboxes included) the node's containerd holds for `namespace`."""
        ...

    def leftovers(self, namespace_prefix: str) -> list[str]:
        """Containers left on the node of namespaces starting with `namespace_prefix`; empty
        after a clean run."""
        ...


class CommandRunner(Protocol):
    """Runs one command and returns its result without raising on a non-zero exit."""

    def __call__(
        self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]: ...


def run_command(
    argv: Sequence[str], *, input: str | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """The real `CommandRunner`: `subprocess.run`, output captured as text."""
    return subprocess.run(
        list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False
    )


def _checked(result: subprocess.CompletedProcess[str], what: str) -> str:
    if result.returncode != 0:
        raise DevclusterError(f"{what} failed with {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def container_id_of(pod: Mapping[str, object], container: str | None) -> str:
    """The containerd id (no `containerd://`) of a pod's container: the first or `container`."""
    status = pod.get("status")
    statuses = status.get("containerStatuses") if isinstance(status, Mapping) else None
    for item in statuses if isinstance(statuses, list) else []:
        if container is None or item.get("name") == container:
            found = str(item.get("containerID") or "")
            if found:
                return found.removeprefix("containerd://")
    raise DevclusterError(f"pod has no running container {container or '(first)'} to kill")


class DevclusterProvider:
    """devcluster's container node: the suite's default, what `make test` runs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    @property
    def name(self) -> ProviderName:
        return "devcluster"

    @property
    def dir(self) -> Path:
        return self.cluster.dir

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, input=input, check=check, timeout=timeout)

    def load_project_image(self, inputs: Path) -> ProjectImage:
        image = build_project_image(inputs).image
        self.cluster.import_image(image.archive)
        listed = self.cluster.ctr("images", "ls", "-q").stdout.split()
        if image.name not in listed:
            raise DevclusterError(f"{image.name} not in the node's images after import: {listed}")
        return image

    def kill_container(
        self, namespace: str, pod: str, container: str | None = None, *, sig: str = "SIGKILL"
    ) -> None:
        self.cluster.kill_pod(namespace, pod, container, sig=sig)

    def make_writable_folder(self, path: Path) -> None:
        # The node is this machine: its hostPath is the folder itself.
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)

    def node_containers(self, namespace: str) -> list[str]:
        selector = f"labels.{POD_NAMESPACE_LABEL}=={namespace}"
        return self.cluster.ctr("containers", "ls", "-q", selector).stdout.split()

    def leftovers(self, namespace_prefix: str) -> list[str]:
        # The node's own leftovers (mounts, cgroups, veths, network namespaces) are checked when
        # the cluster stops (`devcluster.testing.e2e_cluster`).
        selector = f'labels."{POD_NAMESPACE_LABEL}"~="^{namespace_prefix}"'
        listed = self.cluster.ctr("containers", "ls", "-q", selector).stdout.split()
        return [f"container {item}" for item in listed]


class KindProvider:
    """An existing kind cluster (Docker): `kind`, `docker` and the pinned kubectl and helm.

    Not exercised on this project's CI machines (no Docker there); `runner` is the seam its unit
    tests replace with a recording fake."""

    def __init__(
        self,
        cluster_name: str,
        workdir: Path,
        *,
        runner: CommandRunner = run_command,
        kind: str = "kind",
        docker: str = "docker",
        kubectl: str | None = None,
    ) -> None:
        self.cluster_name = cluster_name
        self.workdir = workdir
        self.runner = runner
        self.kind = kind
        self.docker = docker
        self.kubectl_binary = kubectl or str(find_binaries(("kubectl",))["kubectl"])
        self.node = f"{cluster_name}-control-plane"
        self._kubeconfig: Path | None = None

    @property
    def name(self) -> ProviderName:
        return "kind"

    @property
    def dir(self) -> Path:
        return self.workdir

    @property
    def kubeconfig(self) -> Path:
        """`kind get kubeconfig --name CLUSTER`, written once into this run's folder."""
        if self._kubeconfig is None:
            argv = [self.kind, "get", "kubeconfig", "--name", self.cluster_name]
            text = _checked(self.runner(argv), " ".join(argv))
            path = self.workdir / "kubeconfig"
            self.workdir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(0o600)
            self._kubeconfig = path
        return self._kubeconfig

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.kubectl_binary, f"--kubeconfig={self.kubeconfig}", *args]
        result = self.runner(argv, input=input, timeout=timeout)
        if check:
            _checked(result, f"kubectl {' '.join(args)}")
        return result

    def _node_exec(self, *args: str, node: str | None = None, timeout: float = 60.0) -> str:
        argv = [self.docker, "exec", node or self.node, *args]
        return _checked(self.runner(argv, timeout=timeout), " ".join(argv))

    def load_project_image(self, inputs: Path) -> ProjectImage:
        """`docker build` of the Dockerfile in `inputs` (its default Python base), `docker save`
        to an archive, `kind load image-archive` onto the node."""
        started = time.monotonic()
        build = [self.docker, "build", "-t", IMAGE_NAME, str(inputs)]
        _checked(self.runner(build, timeout=1800), " ".join(build))
        seconds = int(time.monotonic() - started)
        inspect = [self.docker, "image", "inspect", IMAGE_NAME]
        [info] = json.loads(_checked(self.runner(inspect), " ".join(inspect)))
        directory = self.workdir / "image"
        directory.mkdir(parents=True, exist_ok=True)
        archive = directory / "image.oci.tar"
        save = [self.docker, "save", "-o", str(archive), IMAGE_NAME]
        _checked(self.runner(save, timeout=600), " ".join(save))
        load = [self.kind, "load", "image-archive", str(archive), "--name", self.cluster_name]
        _checked(self.runner(load, timeout=600), " ".join(load))
        image_id = str(info["Id"])
        repo_digests = [str(item) for item in info.get("RepoDigests") or []]
        return ProjectImage(
            directory=directory,
            name=IMAGE_NAME,
            # A local docker build has no manifest digest until pushed: the config digest then.
            digest=repo_digests[0].rsplit("@", 1)[1] if repo_digests else image_id,
            image_id=image_id,
            size_bytes=int(info.get("Size") or 0),
            archive_bytes=archive.stat().st_size if archive.exists() else 0,
            inputs=str(inputs),
            base="the Dockerfile's default PYTHON_IMAGE",
            build_seconds=seconds,
        )

    def kill_container(
        self, namespace: str, pod: str, container: str | None = None, *, sig: str = "SIGKILL"
    ) -> None:
        found = json.loads(self.kubectl("get", "pod", pod, "-n", namespace, "-o", "json").stdout)
        container_id = container_id_of(found, container)
        node = (found.get("spec") or {}).get("nodeName") or self.node  # the pod's own node
        self._node_exec(
            "ctr",
            "-n",
            CONTAINERD_NAMESPACE,
            "tasks",
            "kill",
            "--signal",
            sig,
            container_id,
            node=node,
        )

    def make_writable_folder(self, path: Path) -> None:
        # The hostPath lives inside the node container, not on this machine.
        self._node_exec("mkdir", "-p", "-m", "1777", str(path))
        self._node_exec("chmod", "1777", str(path))

    def node_containers(self, namespace: str) -> list[str]:
        selector = f"labels.{POD_NAMESPACE_LABEL}=={namespace}"
        listed = self._node_exec(
            "ctr", "-n", CONTAINERD_NAMESPACE, "containers", "ls", "-q", selector
        )
        return listed.split()

    def leftovers(self, namespace_prefix: str) -> list[str]:
        selector = f'labels."{POD_NAMESPACE_LABEL}"~="^{namespace_prefix}"'
        listed = self._node_exec(
            "ctr", "-n", CONTAINERD_NAMESPACE, "containers", "ls", "-q", selector
        )
        return [f"container {item}" for item in listed.split()]


class PodmanKindProvider(KindProvider):
    """The kind cluster of `make kind` without Docker (`kind/up.sh`, docs/kind.md): podman in
    the network namespace `netns`, the kubeconfig `kind/up.sh` wrote (the API server at the
    control-plane node's address, which this machine reaches through the namespace's link),
    the project's image built by `image/build.sh` and imported into the workers' containerd."""

    def __init__(
        self,
        cluster_name: str,
        workdir: Path,
        kubeconfig: Path,
        *,
        netns: str = "rollout-kind",
        runner: CommandRunner = run_command,
        kubectl: str | None = None,
    ) -> None:
        super().__init__(cluster_name, workdir, runner=runner, kubectl=kubectl)
        self._kubeconfig = kubeconfig
        # kind/env.sh: podman on the cluster's own configuration, never the machine's.
        conf = Path("/run/rollout-kind/conf")
        self.netns = netns
        self.podman = [
            "nsenter",
            f"--net=/run/netns/{netns}",
            "--",
            "env",
            f"CONTAINERS_CONF={conf / 'containers.conf'}",
            f"CONTAINERS_STORAGE_CONF={conf / 'storage.conf'}",
            f"CONTAINERS_REGISTRIES_CONF={conf / 'registries.conf'}",
            "podman",
        ]

    def _node_exec(self, *args: str, node: str | None = None, timeout: float = 60.0) -> str:
        argv = [*self.podman, "exec", node or self.node, *args]
        return _checked(self.runner(argv, timeout=timeout), " ".join(argv))

    def nodes(self) -> list[str]:
        """The cluster's nodes as the API server lists them (the node containers' names)."""
        listed = self.kubectl("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")
        return listed.stdout.split()

    def workers(self) -> list[str]:
        return [node for node in self.nodes() if node != self.node]

    def load_project_image(self, inputs: Path) -> ProjectImage:
        image = build_project_image(inputs).image
        for node in self.nodes():
            with image.archive.open("rb") as archive:
                argv = [*self.podman, "exec", "-i", node, "ctr", "-n", CONTAINERD_NAMESPACE]
                argv += ["images", "import", "--digests", "--snapshotter=overlayfs", "-"]
                result = subprocess.run(argv, stdin=archive, capture_output=True, timeout=600)
            if result.returncode != 0:
                raise DevclusterError(f"image import on {node} failed: {result.stderr.decode()}")
        return image

    def make_writable_folder(self, path: Path) -> None:
        """On every node that runs (a node container stopped, as `kill_node` leaves it, has no
        kubelet to run pods until `start_node`)."""
        for node in self.running_nodes():
            self._node_exec("mkdir", "-p", "-m", "1777", str(path), node=node)
            self._node_exec("chmod", "1777", str(path), node=node)

    def _listed(self, selector: str) -> list[str]:
        running = set(self.running_nodes())
        found = []
        for node in self.nodes():
            if node in running:
                argv = ("ctr", "-n", CONTAINERD_NAMESPACE, "containers", "ls", "-q", selector)
                found += self._node_exec(*argv, node=node).split()
        return found

    def node_containers(self, namespace: str) -> list[str]:
        return self._listed(f"labels.{POD_NAMESPACE_LABEL}=={namespace}")

    def leftovers(self, namespace_prefix: str) -> list[str]:
        listed = self._listed(f'labels."{POD_NAMESPACE_LABEL}"~="^{namespace_prefix}"')
        return [f"container {item}" for item in listed]

    def running_nodes(self) -> list[str]:
        """The node containers podman runs now."""
        argv = [*self.podman, "ps", "--format", "{{.Names}}"]
        argv += ["--filter", f"label=io.x-k8s.kind.cluster={self.cluster_name}"]
        return _checked(self.runner(argv), " ".join(argv)).split()

    def kill_node(self, node: str) -> None:
        """The whole node gone at once: SIGKILL to its container's init, so systemd, the
        kubelet, containerd and every pod on it die together (a hardware fault, a reclaimed
        spot machine); the API server hears nothing more from it."""
        argv = [*self.podman, "kill", "--signal", "KILL", node]
        _checked(self.runner(argv), " ".join(argv))

    def start_node(self, node: str, timeout: float = 180.0) -> None:
        """The node container started again (kind's entrypoint, systemd, containerd, kubelet)
        and Ready. Podman may give it another address: the routes to every node's pod network
        are then set again, in the nodes and in the cluster's namespace (what kind/up.sh set)."""
        argv = [*self.podman, "start", node]
        _checked(self.runner(argv), " ".join(argv))
        self.kubectl(
            "wait",
            "--for=condition=Ready",
            f"node/{node}",
            f"--timeout={int(timeout)}s",
            timeout=timeout + 30,
        )
        self.route_pod_networks()

    def route_pod_networks(self) -> None:
        """Each node's pod CIDR routed through its current address: in every other node, and in
        the cluster's network namespace (this machine's route to the pods goes through it)."""
        listed = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        routes = {}
        for item in listed:
            addresses = item["status"].get("addresses") or []
            internal = [a["address"] for a in addresses if a["type"] == "InternalIP"]
            routes[item["metadata"]["name"]] = (item["spec"]["podCIDR"], internal[0])
        for node in self.running_nodes():
            for other, (cidr, address) in routes.items():
                if other != node:
                    self._node_exec("ip", "route", "replace", cidr, "via", address, node=node)
        for cidr, address in routes.values():
            argv = ["ip", "-n", self.netns, "route", "replace", cidr, "via", address]
            _checked(self.runner(argv), " ".join(argv))


def provider_name_from_environment(environ: Mapping[str, str] | None = None) -> ProviderName:
    """`$ROLLOUT_E2E_PROVIDER` (devcluster when unset); anything else fails with the choices."""
    value = (os.environ if environ is None else environ).get(PROVIDER_ENV, "") or "devcluster"
    if value == "devcluster":
        return "devcluster"
    if value == "kind":
        return "kind"
    raise DevclusterError(f"{PROVIDER_ENV}={value!r}: use devcluster (the default) or kind")


def kind_provider_from_environment(
    workdir: Path,
    environ: Mapping[str, str] | None = None,
    runner: CommandRunner = run_command,
    kubectl: str | None = None,
) -> KindProvider:
    """The kind cluster `$KIND_CLUSTER` names (default `rollout-e2e`), which must exist."""
    env = os.environ if environ is None else environ
    name = env.get(KIND_CLUSTER_ENV, "") or DEFAULT_KIND_CLUSTER
    provider = KindProvider(name, workdir, runner=runner, kubectl=kubectl)
    listed = runner([provider.kind, "get", "clusters"])
    if listed.returncode != 0 or name not in listed.stdout.split():
        raise DevclusterError(
            f"{PROVIDER_ENV}=kind needs the kind cluster {name!r} ({KIND_CLUSTER_ENV}); "
            f"`kind get clusters` said: {(listed.stdout + listed.stderr).strip() or 'nothing'}. "
            "Create it with `make kind-e2e` or `kind create cluster --name NAME`."
        )
    return provider
