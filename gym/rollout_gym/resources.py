"""A released NeMo Gym resources server, hosted as a pod of a RolloutSet without Ray or a head
server (docs/gym.md, "The resources pod").

Gym starts a server with `run_webserver()`, which starts or joins a Ray cluster and reads its
config (and every peer's address) from Gym's global config or head server. Here the server class
comes from the installed package and is constructed as `run_webserver` would, with its own
config (name, host, port) and a Gym global config built from the operator's peer addresses
(`ROLLOUT_PEER_<ROLE>_URL`), so a Gym server that calls another (a judge model) reaches it by
Gym's own `server_client`. Its app is Gym's, with Gym's session, liveness and exception
middleware and error handlers; nothing of its code changes. (A mounted app's lifespan does not
run: a Gym server that sets itself up in a lifespan is not hosted by this module yet.)

The pod also answers the operator's control calls: a participant with no episodes of its own
(the environment records each session's calls and rebuilds them; `rollout_gym.environment`),
which parks at once and records nothing, so checkpoints and restores include the pod.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from fastapi import FastAPI, Query, Request, Response
from rollout_protocol import (
    ControlPlane,
    ControlSettings,
    EpisodeRuntime,
    ErrorCode,
    ProtocolError,
    Role,
    RuntimeParticipant,
    StepCounters,
)

from .gym_config import ServerSpec, peer_config, server_class_of

WAITS_ON: Final[tuple[Role, ...]] = ()
"""A hosted server has no episodes of its own and parks at once: it waits on nobody
(docs/design.md#44-order), whatever its Gym code calls while it serves a request."""
INSTANCE_HEADER = "X-Rollout-Gym-Instance"
"""Names the hosting process on every answer (a new value after any restart)."""
GYM_CONFIG_VARIABLE = "NEMO_GYM_CONFIG_DICT"
"""Where Gym's head process puts the global config for the servers it spawns (nemo-gym 0.4 and
0.7 read it before any command-line parse)."""
OBSERVABILITY_KEY = "observability_enabled"
"""nemo-gym 0.7's global switch for the `/ng-rollout/<capture key>/` prefix on model calls."""
MODEL_SERVER_NAME = "policy_model"
"""The name Gym configs give the policy model (`model_server: {name: policy_model}`)."""


def server_class(entry: str) -> Any:
    """`module:Class` of an installed Gym server, e.g.
    `resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer`, or a
    module alone (`environment_servers.legacy_agent.app`): the one Gym server class it defines.

    Gym runs a server as a script in its own folder (`python app.py`), so a server may import
    the modules beside it by their bare names (calendar's `from utils import ...`): the
    module's folder goes first on `sys.path` before it is imported, as Python puts a script's."""
    module_name, colon, class_name = entry.partition(":")
    if colon and not class_name:
        raise ValueError(f"{entry!r}: expected module:Class")
    spec = importlib.util.find_spec(module_name)
    if spec is not None and spec.origin is not None and spec.has_location:
        folder = str(Path(spec.origin).parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
    if not class_name:
        return server_class_of(module_name)
    return getattr(importlib.import_module(module_name), class_name)


def _host_port(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {"host": parts.hostname or "127.0.0.1", "port": parts.port or 80}


def gym_global_config(
    name: str,
    host: str,
    port: int,
    peers: Mapping[str, str],
    model_name: str = MODEL_SERVER_NAME,
    spec: ServerSpec | None = None,
) -> dict[str, Any]:
    """Gym's global config as its `ServerClient` reads it (three levels: instance name, server
    type, implementation), from the operator's peer addresses instead of a head server: the
    hosted instance itself, the model as `model_name`, and every server `spec` (the instance's
    YAML block) names, at its role's peer (`gym_config.peer_config`)."""
    server_type = spec.server_type if spec is not None else "resources_servers"
    config: dict[str, Any] = {
        name: {server_type: {"hosted": {"host": host, "port": port, "entrypoint": "app.py"}}}
    }
    if "model" in peers:
        config[model_name] = {
            "responses_api_models": {"rollout_model": {**_host_port(peers["model"])}}
        }
    if spec is not None:
        config.update(peer_config(spec, peers))
        # nemo-gym 0.7 carries a run's capture key to the model (and resources) servers as
        # `/ng-rollout/<capture key>/...` only with this set: the model role names the episode
        # by it (docs/servers.md), so an agent's model calls are cut and held at a checkpoint
        config[OBSERVABILITY_KEY] = True
    return config


def build_gym_app(
    entry: str | None,
    name: str,
    host: str,
    port: int,
    peers: Mapping[str, str],
    spec: ServerSpec | None = None,
) -> Any:
    """The Gym server's own app, set up as `run_webserver` sets it up, less Ray: the class
    `entry` names (`module:Class`), else the one `spec`'s module defines, constructed with
    `spec`'s YAML block (docs/gym.md, "Servers from Gym's YAML") and its own name and address."""
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    if entry is not None:
        cls = server_class(entry)
    elif spec is not None:
        cls = server_class(spec.module)
    else:
        raise ValueError("a Gym server needs module:Class (--server) or its YAML (--config)")
    config_cls = cls.model_fields["config"].annotation
    block = dict(spec.config) if spec is not None else {"entrypoint": "app.py"}
    config = config_cls.model_validate({**block, "name": name, "host": host, "port": port})
    global_config = OmegaConf.create(gym_global_config(name, host, port, peers, spec=spec))
    # as Gym's head process hands a server it spawns its config: a server that calls others
    # (an environment server, an agent) reads it for its HTTP client instead of parsing argv
    os.environ[GYM_CONFIG_VARIABLE] = OmegaConf.to_yaml(global_config)
    client = ServerClient(
        head_server_config=BaseServerConfig(host=host, port=port),
        global_config_dict=global_config,
    )
    server = cls(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    return app


def build_app(settings: ControlSettings, gym_app: Any, role: Role = Role.RESOURCES) -> FastAPI:
    """The pod's app: the control plane, `/stats` and `/healthz` in an app of their own, and
    every other path handed to the Gym app, mounted at the root with its own middleware and
    error handlers (its 422 bodies are tool outputs a model reads: they stay Gym's)."""
    counters = StepCounters(role)
    runtime = EpisodeRuntime(observer=counters.observe)
    participant = RuntimeParticipant(role, runtime, work_counter=None)
    plane = ControlPlane(participant, settings)
    app = FastAPI()
    app.state.draining = False

    @app.get("/stats", include_in_schema=False)
    async def stats(rollout_id: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008
        return counters.snapshot(rollout_id, detail=False)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        if app.state.draining:
            raise ProtocolError(ErrorCode.ADMISSION_CLOSED, "draining")
        return {"status": "ok"}

    instance = uuid.uuid4().hex

    @app.middleware("http")
    async def name_instance(request: Request, call_next: Any) -> Response:
        # every answer, the Gym app's included, names this process: the environment tells a
        # restarted server (whose sessions are empty) from the one that opened a session
        response: Response = await call_next(request)
        response.headers[INSTANCE_HEADER] = instance
        return response

    plane.install(app)
    app.mount("/", gym_app)
    return app
