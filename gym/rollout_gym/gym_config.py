"""A Gym server instance as Gym's own YAML gives it (docs/gym.md, "Servers from Gym's YAML").

NeMo Gym describes every server of an environment in YAML: a top-level key names the instance,
under it the server type (`resources_servers`, `responses_api_agents`, `environment_servers`,
`responses_api_models`), under that the implementation (its folder, e.g. `legacy_agent`), and
under that the instance's config, with references to the servers it calls
(`agent_server: {type: responses_api_agents, name: ...}`). `ng_run "+config_paths=[...]"` merges
the files, follows an environment's own `config_paths`, and starts every server from its block.

Here one instance is picked out of the same files (`rollout-gym resources --config ... --name
...`), so a released server whose config needs more than name, host and port (an environment
server's `agent_server`, an agent's `model_server`) is hosted with its block as Gym gives it. A
reference to another server becomes the address of the operator's peer of that role: the
instance's Gym global config maps the referenced name to `ROLLOUT_PEER_<ROLE>_URL`, so Gym's own
`server_client.post(server_name=...)` reaches the set's pod.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from rollout_protocol import Role

SERVER_TYPES: Final[Mapping[str, Role]] = {
    "resources_servers": Role.RESOURCES,
    "responses_api_agents": Role.AGENT,
    "environment_servers": Role.ENVIRONMENT,
    "responses_api_models": Role.MODEL,
}
"""Gym's server types and the role of the set whose pod serves one."""
MAX_CONFIG_BYTES: Final = 4 * 1024 * 1024
"""The most read of one YAML file."""
MAX_INCLUDES: Final = 64
"""Config files one `--config` may pull in through `config_paths`, at most."""


class GymConfigError(ValueError):
    """A Gym YAML that cannot give the asked instance; the message says what to change."""


@dataclass(frozen=True)
class ServerSpec:
    """One Gym server instance: where its code is and its config block."""

    name: str
    """The instance (the YAML's top-level key)."""
    server_type: str
    """`resources_servers`, `responses_api_agents`, `environment_servers` (or a model's)."""
    implementation: str
    """The implementation's folder, e.g. `legacy_agent`, `simple_agent`, `calendar`."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The instance's block as the YAML gives it (`entrypoint` and the server's fields)."""

    @property
    def module(self) -> str:
        entry = str(self.config.get("entrypoint") or "app.py")
        return f"{self.server_type}.{self.implementation}.{entry.removesuffix('.py')}"

    def references(self) -> dict[str, str]:
        """Every server this instance names (`{name: server type}`), from its `*_server`
        fields as Gym's `ServerRef`s give them."""
        found: dict[str, str] = {}
        for value in self.config.values():
            if (
                isinstance(value, Mapping)
                and value.get("type") in SERVER_TYPES
                and isinstance(value.get("name"), str)
            ):
                found[value["name"]] = str(value["type"])
        return found


def gym_root() -> Path:
    """Where the installed nemo-gym's folders (`resources_servers/`, `environments/`, ...) live:
    Gym resolves a relative config path against it, as against its repository's root."""
    import nemo_gym

    return Path(nemo_gym.__file__).resolve().parent.parent


def _resolve(path: str, root: Path) -> Path:
    given = Path(path)
    for candidate in (given, root / given):
        if candidate.is_file():
            return candidate
    raise GymConfigError(f"Gym config {path!r}: no such file here or under {root}")


def _read(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    with path.open("rb") as handle:
        text = handle.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise GymConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    loaded = OmegaConf.to_container(OmegaConf.create(text.decode()), resolve=False)
    if not isinstance(loaded, dict):
        raise GymConfigError(f"{path}: not a YAML mapping")
    return loaded


def load(paths: Sequence[str], root: Path | None = None) -> dict[str, Any]:
    """The files merged as `ng_run "+config_paths=[...]"` merges them: relative paths under
    Gym's root, each file's own `config_paths` followed first (an environment's `config.yaml`
    names its servers' files that way)."""
    from omegaconf import OmegaConf

    base = root or gym_root()
    merged = OmegaConf.create({})
    pending = [_resolve(p, base) for p in paths]
    seen: set[Path] = set()
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen.add(path)
        if len(seen) > MAX_INCLUDES:
            raise GymConfigError(f"more than {MAX_INCLUDES} Gym config files through config_paths")
        data = _read(path)
        included = data.pop("config_paths", None) or []
        pending[:0] = [_resolve(str(p), base) for p in included]
        merged = OmegaConf.merge(merged, OmegaConf.create(data))
    container = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(container, dict)
    return container


def server_spec(config: Mapping[str, Any], name: str) -> ServerSpec:
    """The instance `name` of a merged Gym config."""
    block = config.get(name)
    servers = [k for k in SERVER_TYPES if isinstance(block, Mapping) and k in block]
    if not servers:
        instances = sorted(
            k for k, v in config.items() if isinstance(v, Mapping) and SERVER_TYPES.keys() & v
        )
        known = ", ".join(instances) or "none"
        raise GymConfigError(f"no server instance {name!r} in the Gym config; it has {known}")
    assert isinstance(block, Mapping)
    implementations = block[servers[0]]
    if not isinstance(implementations, Mapping) or len(implementations) != 1:
        raise GymConfigError(f"{name}.{servers[0]}: expected exactly one implementation")
    implementation, body = next(iter(implementations.items()))
    return ServerSpec(name, servers[0], str(implementation), dict(body or {}))


def server_class_of(module_name: str) -> Any:
    """The Gym server class a server's `app.py` defines (the one `run_webserver` would start):
    the `SimpleServer` subclass defined in that module itself."""
    from nemo_gym.server_utils import SimpleServer

    module = importlib.import_module(module_name)
    defined = [
        value
        for value in vars(module).values()
        if inspect.isclass(value)
        and issubclass(value, SimpleServer)
        and value.__module__ == module.__name__
        and not inspect.isabstract(value)
    ]
    if len(defined) != 1:
        names = ", ".join(c.__name__ for c in defined) or "none"
        raise GymConfigError(
            f"{module_name}: expected one Gym server class, found {names}; name it with "
            "--server module:Class"
        )
    return defined[0]


def _host_port(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {"host": parts.hostname or "127.0.0.1", "port": parts.port or 80}


def peer_config(spec: ServerSpec, peers: Mapping[str, str]) -> dict[str, Any]:
    """Gym's global config entries for the servers `spec` names, each at the address of the
    operator's peer of its role (`peers`: role -> URL); a reference whose role has no peer is
    refused, so a missing wire fails at start, not at the first episode."""
    config: dict[str, Any] = {}
    for ref_name, ref_type in spec.references().items():
        role = SERVER_TYPES[ref_type]
        url = peers.get(role.value)
        if url is None:
            raise GymConfigError(
                f"{spec.name} calls {ref_name} ({ref_type}), and the pod has no {role.value} "
                f"peer: give the set a {role.value} role (ROLLOUT_PEER_{role.value.upper()}_URL)"
            )
        config[ref_name] = {ref_type: {"rollout_peer": _host_port(url)}}
    return config
