"""Where devcluster finds its binaries and where it puts a cluster's files.

Everything a cluster writes lives under one directory so that `down` can find every process and
a failed run can be inspected (logs, state, PKI) after the fact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from devcluster.errors import DevclusterError

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The checkout this package was installed from (editable install), home of `.bin/devcluster`."""

CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
)


def binary_dir() -> Path:
    """The control-plane binaries' folder: `$DEVCLUSTER_BIN` or `<repo>/.bin/devcluster`."""
    override = os.environ.get("DEVCLUSTER_BIN")
    if override:
        return Path(override)
    return REPO_ROOT / ".bin" / "devcluster"


def find_binaries(names: tuple[str, ...] = CONTROL_PLANE_BINARIES) -> dict[str, Path]:
    """Resolves each named binary, failing with one message that lists everything missing."""
    folder = binary_dir()
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        path = folder / name
        if path.is_file() and os.access(path, os.X_OK):
            found[name] = path
        else:
            missing.append(name)
    if missing:
        source = "$DEVCLUSTER_BIN" if os.environ.get("DEVCLUSTER_BIN") else "<repo>/.bin/devcluster"
        raise DevclusterError(
            f"devcluster binaries not found in {folder} (from {source}): {', '.join(missing)}. "
            "Run `make cluster-binaries` to build them (the first build takes several minutes), "
            "or point DEVCLUSTER_BIN at a folder that holds them."
        )
    return found


def kubectl_path() -> Path:
    return find_binaries(("kubectl",))["kubectl"]


@dataclass(frozen=True)
class Layout:
    """The files of one cluster directory."""

    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pod_logs(self) -> Path:
        return self.root / "logs" / "pods"

    @property
    def pods(self) -> Path:
        """Per-pod working directories of the processes the agent runs."""
        return self.root / "pods"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def pod_groups(self) -> Path:
        """One file per live pod process group, so `down` finds them even if the agent died."""
        return self.root / "run" / "pod-groups"

    @property
    def agent_pid(self) -> Path:
        """The running agent's pid, also when it was started by hand rather than by `up`."""
        return self.root / "run" / "agent.pid"

    @property
    def agent_config(self) -> Path:
        return self.root / "agent.json"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def pod_log(self, namespace: str, pod: str, container: str | None = None) -> Path:
        """The log of a pod's first container, or of a named other container."""
        if container is None:
            return self.pod_logs / f"{namespace}_{pod}.log"
        return self.pod_logs / f"{namespace}_{pod}.{container}.log"

    # Folders `up` owns and recreates on every start; anything else in the directory is left alone.
    def owned_folders(self) -> tuple[Path, ...]:
        return (
            self.pki,
            self.logs,
            self.pods,
            self.etcd_data,
            self.root / "run",
            self.root / "node",
            self.root / "s3",
        )
