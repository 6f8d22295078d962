"""The part of the Pod API the agent reads, parsed from the API server's JSON.

Only fields the agent acts on are modelled; everything else is ignored, so newer API fields never
break parsing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class K8s(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="ignore", frozen=True)


class ObjectMeta(K8s):
    name: str
    namespace: str = "default"
    uid: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    deletion_timestamp: str | None = None
    deletion_grace_period_seconds: int | None = None
    resource_version: str | None = None


class ObjectFieldSelector(K8s):
    field_path: str


class KeySelector(K8s):
    name: str = ""
    key: str
    optional: bool | None = None


class ResourceFieldSelector(K8s):
    container_name: str | None = None
    resource: str
    divisor: str | int | None = None


class EnvVarSource(K8s):
    field_ref: ObjectFieldSelector | None = None
    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None


class EnvVar(K8s):
    name: str
    value: str | None = None
    value_from: EnvVarSource | None = None


class LocalRef(K8s):
    name: str = ""
    optional: bool | None = None


class EnvFromSource(K8s):
    prefix: str = ""
    config_map_ref: LocalRef | None = None
    secret_ref: LocalRef | None = None


class ContainerPort(K8s):
    name: str | None = None
    container_port: int


class HTTPHeader(K8s):
    name: str
    value: str


class HTTPGetAction(K8s):
    path: str = "/"
    port: int | str
    host: str | None = None
    scheme: str = "HTTP"
    http_headers: list[HTTPHeader] = Field(default_factory=list)


class TCPSocketAction(K8s):
    port: int | str
    host: str | None = None


class ExecAction(K8s):
    command: list[str] = Field(default_factory=list)


class Probe(K8s):
    http_get: HTTPGetAction | None = None
    tcp_socket: TCPSocketAction | None = None
    exec_: ExecAction | None = Field(default=None, alias="exec")
    initial_delay_seconds: int = 0
    period_seconds: int = 10
    timeout_seconds: int = 1
    success_threshold: int = 1
    failure_threshold: int = 3


class VolumeMount(K8s):
    name: str
    mount_path: str
    sub_path: str | None = None
    read_only: bool | None = None


class ResourceRequirements(K8s):
    limits: dict[str, str | int] = Field(default_factory=dict)
    requests: dict[str, str | int] = Field(default_factory=dict)


class Container(K8s):
    name: str
    image: str | None = None
    command: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list)
    working_dir: str | None = None
    env: list[EnvVar] = Field(default_factory=list)
    env_from: list[EnvFromSource] = Field(default_factory=list)
    ports: list[ContainerPort] = Field(default_factory=list)
    readiness_probe: Probe | None = None
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)


class HostPathVolumeSource(K8s):
    path: str
    type: str | None = None


class KeyToPath(K8s):
    key: str
    path: str


class SecretVolumeSource(K8s):
    secret_name: str
    optional: bool | None = None
    items: list[KeyToPath] | None = None


class Volume(K8s):
    model_config = ConfigDict(extra="allow")

    name: str
    host_path: HostPathVolumeSource | None = None
    projected: dict[str, Any] | None = None
    secret: SecretVolumeSource | None = None

    def kind(self) -> str:
        """The volume source's field name (`emptyDir`, `configMap`, ...), for error messages."""
        if self.host_path is not None:
            return "hostPath"
        if self.secret is not None:
            return "secret"
        if self.projected is not None:
            return "projected"
        return next(iter(self.model_extra or {}), "unknown")


class PodReadinessGate(K8s):
    condition_type: str


class PodSpec(K8s):
    containers: list[Container]
    init_containers: list[Container] = Field(default_factory=list)
    restart_policy: str = "Always"
    node_name: str | None = None
    volumes: list[Volume] = Field(default_factory=list)
    termination_grace_period_seconds: int = 30
    service_account_name: str | None = None
    readiness_gates: list[PodReadinessGate] = Field(default_factory=list)


class PodCondition(K8s):
    type: str
    status: str


class PodIP(K8s):
    ip: str


class PodStatus(K8s):
    phase: str | None = None
    pod_ip: str | None = Field(default=None, alias="podIP")
    start_time: str | None = None
    conditions: list[PodCondition] = Field(default_factory=list)


class Pod(K8s):
    metadata: ObjectMeta
    spec: PodSpec
    status: PodStatus = Field(default_factory=PodStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"
