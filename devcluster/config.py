"""Validated settings shared by `up`, the state file and the node agent."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from devcluster.errors import DevclusterError

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class NodeSpec(BaseModel):
    """One Node the agent registers. Capacities are declared, not measured: they only steer the
    scheduler; the processes share this machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: int = Field(default=110, ge=1)
    gpus: int = Field(default=0, ge=0)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if len(value) > 253 or not _NODE_NAME.match(value):
            raise ValueError(f"node name {value!r} is not a lowercase DNS name")
        return value

    def all_labels(self) -> dict[str, str]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "devcluster.rollout.dev/node": "true",
        }
        if self.gpus:
            labels[GPU_PRESENT_LABEL] = "true"
        labels.update(self.labels)
        return labels

    def capacity(self) -> dict[str, str]:
        capacity = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "ephemeral-storage": "100Gi",
        }
        if self.gpus:
            capacity[GPU_RESOURCE] = str(self.gpus)
        return capacity


DEFAULT_NODES = (NodeSpec(name="gpu-0", gpus=8), NodeSpec(name="cpu-0"))


def parse_node(text: str) -> NodeSpec:
    """Parses `NAME[:key=value,...]` with keys cpu, memory, pods, gpus and label.<key>.

    Example: `gpu-1:gpus=4,cpu=8,label.zone=a`.
    """
    name, _, rest = text.partition(":")
    fields: dict[str, object] = {"name": name}
    labels: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise DevclusterError(f"--node {text!r}: expected key=value, got {item!r}")
        if key.startswith("label."):
            labels[key.removeprefix("label.")] = value
        elif key in ("cpu", "memory"):
            fields[key] = value
        elif key in ("pods", "gpus"):
            if not value.isdigit():
                raise DevclusterError(f"--node {text!r}: {key} must be a whole number")
            fields[key] = int(value)
        else:
            raise DevclusterError(
                f"--node {text!r}: unknown key {key!r} (use cpu, memory, pods, gpus, label.<key>)"
            )
    fields["labels"] = labels
    try:
        return NodeSpec.model_validate(fields)
    except ValueError as error:
        raise DevclusterError(f"--node {text!r}: {error}") from error


class AgentConfig(BaseModel):
    """Everything the node agent needs; `up` writes it to DIR/agent.json."""

    model_config = ConfigDict(extra="forbid")

    dir: Path
    kubeconfig: Path
    nodes: list[NodeSpec]
    admin_port: int = Field(ge=0, le=65535)
    cluster_id: str
    pod_ip_octet: int = Field(ge=2, le=253, description="second octet of the pods' 127.x.y.z IPs")
    tls_cert: Path
    tls_key: Path
    path_prefix: list[str] = Field(
        default_factory=list, description="folders put first on the pods' PATH (the venv's bin)"
    )
    heartbeat_seconds: float = Field(default=10.0, gt=0)
