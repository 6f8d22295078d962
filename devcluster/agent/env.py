"""A container's environment and command line, resolved the way the kubelet does it.

Two kinds of failure differ in what happens next: `ConfigError` (a Secret or ConfigMap that does
not exist yet) leaves the container waiting and is retried, as the kubelet's
CreateContainerConfigError is; `SpecError` (something devcluster can never run) fails the pod.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Protocol

from devcluster.agent.podmodel import Container, EnvVarSource, Pod

HOST_IP = "127.0.0.1"


class ConfigError(Exception):
    """A referenced object or key is missing; the kubelet retries these."""


class SpecError(Exception):
    """The pod asks for something devcluster cannot provide; it will never run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ObjectReader(Protocol):
    async def config_map(self, namespace: str, name: str) -> dict[str, str] | None: ...

    async def secret(self, namespace: str, name: str) -> dict[str, str] | None: ...


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` escapes, the rest stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


_SUFFIXES = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


def parse_quantity(value: str | int) -> Decimal:
    match = _QUANTITY.match(str(value).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise SpecError("InvalidQuantity", f"cannot parse quantity {value!r}")
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation as error:
        raise SpecError("InvalidQuantity", f"cannot parse quantity {value!r}") from error


def _field_value(pod: Pod, pod_ip: str, path: str) -> str:
    meta = pod.metadata
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
    if keyed:
        source = meta.labels if keyed.group(1) == "labels" else meta.annotations
        return source.get(keyed.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        source = meta.labels if path == "metadata.labels" else meta.annotations
        return "\n".join(f'{k}="{v}"' for k, v in sorted(source.items()))
    simple = {
        "metadata.name": meta.name,
        "metadata.namespace": meta.namespace,
        "metadata.uid": meta.uid,
        "spec.nodeName": pod.spec.node_name or "",
        "spec.serviceAccountName": pod.spec.service_account_name or "",
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": HOST_IP,
        "status.hostIPs": HOST_IP,
    }
    if path not in simple:
        raise SpecError("UnsupportedFieldRef", f"fieldRef {path!r} is not supported by devcluster")
    return simple[path]


def _resource_value(
    pod: Pod, container: Container, allocatable: dict[str, str], resource: str, divisor: str
) -> str:
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise SpecError("UnsupportedFieldRef", f"resourceFieldRef {resource!r} is not supported")
    values = container.resources.limits if kind == "limits" else container.resources.requests
    raw = values.get(name)
    if raw is None:
        raw = allocatable.get(name, "0") if kind == "limits" else "0"
    result = parse_quantity(raw) / parse_quantity(divisor or "1")
    return str(math.ceil(result))


async def _value_from(
    pod: Pod,
    container: Container,
    pod_ip: str,
    allocatable: dict[str, str],
    source: EnvVarSource,
    reader: ObjectReader,
) -> str | None:
    namespace = pod.metadata.namespace
    if source.field_ref is not None:
        return _field_value(pod, pod_ip, source.field_ref.field_path)
    if source.resource_field_ref is not None:
        ref = source.resource_field_ref
        target = container
        if ref.container_name:
            target = next(
                (c for c in pod.spec.containers if c.name == ref.container_name), container
            )
        return _resource_value(pod, target, allocatable, ref.resource, str(ref.divisor or "1"))
    for kind, key_ref, read in (
        ("Secret", source.secret_key_ref, reader.secret),
        ("ConfigMap", source.config_map_key_ref, reader.config_map),
    ):
        if key_ref is None:
            continue
        data = await read(namespace, key_ref.name)
        if data is None:
            if key_ref.optional:
                return None
            raise ConfigError(f'{kind} "{key_ref.name}" not found in namespace {namespace}')
        if key_ref.key not in data:
            if key_ref.optional:
                return None
            raise ConfigError(
                f"couldn't find key {key_ref.key} in {kind} {namespace}/{key_ref.name}"
            )
        return data[key_ref.key]
    raise SpecError("UnsupportedEnvSource", "env valueFrom names no source devcluster knows")


async def container_env(
    pod: Pod,
    container: Container,
    pod_ip: str,
    allocatable: dict[str, str],
    reader: ObjectReader,
) -> dict[str, str]:
    """The variables the pod spec defines, in the kubelet's order (envFrom, then env)."""
    env: dict[str, str] = {}
    namespace = pod.metadata.namespace
    for source in container.env_from:
        if source.config_map_ref is not None:
            ref, kind, data = source.config_map_ref, "ConfigMap", None
            data = await reader.config_map(namespace, ref.name)
        elif source.secret_ref is not None:
            ref, kind = source.secret_ref, "Secret"
            data = await reader.secret(namespace, ref.name)
        else:
            continue
        if data is None:
            if ref.optional:
                continue
            raise ConfigError(f'{kind} "{ref.name}" not found in namespace {namespace}')
        for key, value in data.items():
            env[source.prefix + key] = value
    for var in container.env:
        if var.value_from is None:
            env[var.name] = expand(var.value or "", env)
            continue
        resolved = await _value_from(pod, container, pod_ip, allocatable, var.value_from, reader)
        if resolved is not None:
            env[var.name] = resolved
    return env


def command_line(container: Container, env: dict[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; images are ignored, so a command is required."""
    if not container.command:
        raise SpecError(
            "NoCommand",
            f"container {container.name!r} has no command: devcluster runs the command and args "
            "of each container as a local process and ignores images, so set "
            "spec.containers[].command",
        )
    return [expand(part, env) for part in [*container.command, *container.args]]
