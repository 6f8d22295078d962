"""The state file: what `up` started, written as soon as each process exists.

`down` works from this file alone, so it can stop a cluster whose `up` was interrupted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from devcluster.config import NodeSpec
from devcluster.errors import DevclusterError

MARKER_ENV = "DEVCLUSTER_ID"
"""Every process a cluster starts carries `DEVCLUSTER_ID=<cluster id>` in its environment, and so do
their descendants: `down` uses it to find stragglers that were never recorded."""


class ProcessRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    pid: int
    log: Path


class Ports(BaseModel):
    model_config = ConfigDict(extra="forbid")

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    agent: int


NodeRuntime = Literal["process", "containerd"]
"""`process`: the node agent runs pods as local processes (the fast default). `containerd`: a real
kubelet, containerd and kube-proxy (devcluster/containernode.py)."""


class ContainerNodeState(BaseModel):
    """What a container node created on this machine, recorded before each thing is created so
    that `down` removes it also after an interrupted `up` (see containernode.teardown)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    index: int = Field(ge=1, le=254, description="the third octet of its addresses")
    netns: Path = Field(description="the node network namespace's bind mount (a file under DIR)")
    host_veth: str
    host_ip: str
    node_ip: str
    pod_cidr: str
    cgroup_root: str = Field(description="kubelet's cgroupRoot, created in every hierarchy")
    run_dir: Path = Field(
        description="/run/devcluster-<id>: unix sockets and the kubelet's root, whose socket "
        "paths must stay under 108 bytes (DIR may be long)"
    )
    created: list[str] = Field(
        default_factory=list, description="steps begun, in order: netns, veth, cgroups, run-dir"
    )
    created_host_dirs: list[Path] = Field(
        default_factory=list,
        description="machine-wide folders the kubelet and CNI hardcode (HOST_PATHS) that did not "
        "exist before this cluster: removed by down when empty",
    )

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"


class S3State(BaseModel):
    """The S3 server a cluster started (`up --s3`, devcluster/s3.py): where it listens, its
    bucket and the folder holding its data and credential files, removed by `down`."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    bucket: str
    region: str
    dir: Path = Field(description="data/ (the buckets), credentials/ (accessKeyId, ...)")

    @property
    def credentials_dir(self) -> Path:
        """The files a mounted credentials Secret holds: `accessKeyId`, `secretAccessKey`."""
        return self.dir / "credentials"


class ClusterState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    cluster_id: str
    dir: Path
    phase: Literal["starting", "ready", "stopped"]
    ports: Ports
    pod_ip_octet: int
    nodes: list[NodeSpec]
    bin_dir: Path
    processes: list[ProcessRecord] = Field(default_factory=list)
    node_runtime: NodeRuntime = "process"
    container_node: ContainerNodeState | None = None
    s3: S3State | None = None

    @property
    def apiserver_host(self) -> str:
        """Loopback on the process node; the veth's host address on the container node, where
        the API server also has to be reachable from the node's network namespace."""
        return self.container_node.host_ip if self.container_node else "127.0.0.1"

    @property
    def apiserver_url(self) -> str:
        return f"https://{self.apiserver_host}:{self.ports.apiserver}"

    @property
    def agent_url(self) -> str:
        return f"https://127.0.0.1:{self.ports.agent}"


def write_state(path: Path, state: ClusterState) -> None:
    """Atomic replace with fsync: a crash mid-write must never lose the pids already recorded."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(state.model_dump_json(indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_state(path: Path) -> ClusterState | None:
    if not path.exists():
        return None
    try:
        return ClusterState.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as error:
        raise DevclusterError(
            f"{path} is not a devcluster state file this version understands ({error.error_count()}"
            " problems); stop its processes by hand and remove the directory"
        ) from error
