"""`rollout-gym environment|resources|environment-server`: the pods of a Gym environment in a
RolloutSet (docs/gym.md). Settings come from the variables the operator sets (`ROLLOUT_*`, the
peers' URLs) and these arguments; all serve with the SDK's `DrainingServer` (SIGTERM: unready,
control plane kept up for `--drain-seconds`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import uvicorn
from rollout_protocol import ControlSettings, Role
from rollout_protocol.serving import DrainingServer

from . import SUPPORTED_GYM_RELEASES, environment, episode_server, gym_config, resources


def _peers() -> dict[str, str]:
    found = {}
    for role in Role:
        url = os.environ.get(f"ROLLOUT_PEER_{role.value.upper()}_URL")
        if url:
            found[role.value] = url.rstrip("/")
    return found


def gym_release_refusal() -> str | None:
    """Why this process cannot run the adapter, or None: the installed nemo-gym must be one of
    `SUPPORTED_GYM_RELEASES` (an environment installed without pip's resolver, or with the pin
    overridden, may hold another)."""
    try:
        installed = version("nemo-gym")
    except PackageNotFoundError:
        return "nemo-gym is not installed; install nemo-gym 0.4 or 0.7 (docs/gym.md)"
    release = ".".join(installed.split(".")[:2])
    if release in SUPPORTED_GYM_RELEASES:
        return None
    supported = " and ".join(SUPPORTED_GYM_RELEASES)
    return (
        f"nemo-gym {installed} is installed, and this adapter supports nemo-gym {supported} "
        'only (docs/gym.md, "Gym releases"): install one of them'
    )


def _hosted_app(args: argparse.Namespace, peers: dict[str, str]) -> Any:
    """`resources` and `environment-server`: a released Gym server, from `module:Class` or its
    instance in Gym's YAML (docs/gym.md, "Servers from Gym's YAML")."""
    spec = None
    try:
        if args.config:
            spec = gym_config.server_spec(gym_config.load(args.config), args.name)
        if args.command == "environment-server":
            if spec is None or spec.server_type != "environment_servers":
                sys.exit(
                    f"rollout-gym environment-server: --name {args.name} must be an instance "
                    "of environment_servers in the --config files"
                )
            gym_app = resources.build_gym_app(None, args.name, args.host, args.port, peers, spec)
            control = ControlSettings.from_env(
                Role.ENVIRONMENT, waits_on=episode_server.WAITS_ON.get(spec.implementation)
            )
            return episode_server.build_app(
                control, spec, gym_app, peers, args.step_timeout_seconds
            )
        if args.server is None and spec is None:
            sys.exit("rollout-gym resources: give --server module:Class or --config")
        gym_app = resources.build_gym_app(args.server, args.name, args.host, args.port, peers, spec)
    except gym_config.GymConfigError as exc:
        sys.exit(f"rollout-gym {args.command}: {exc}")
    role = Role(args.role)
    control = ControlSettings.from_env(role, waits_on=resources.WAITS_ON)
    return resources.build_app(control, gym_app, role)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollout-gym", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("environment", "resources", "environment-server"):
        p = sub.add_parser(name)
        p.add_argument("--host", default=os.environ.get("ROLLOUT_POD_IP", "127.0.0.1"))
        p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        p.add_argument("--drain-seconds", type=float, default=20.0)
    env = sub.choices["environment"]
    env.add_argument(
        "--strategy", choices=[s.value for s in environment.Strategy], default="replay"
    )
    env.add_argument("--max-steps", type=int, default=16)
    env.add_argument("--step-timeout-seconds", type=float, default=300.0)
    env.add_argument("--rebuild-timeout-seconds", type=float, default=60.0)
    env.add_argument("--snapshot-export", default="/export_session")
    env.add_argument("--snapshot-import", default="/import_session")
    env.add_argument("--model-url", help="default: ROLLOUT_PEER_MODEL_URL")
    env.add_argument("--resources-url", help="default: ROLLOUT_PEER_RESOURCES_URL")
    for name in ("resources", "environment-server"):
        hosted = sub.choices[name]
        hosted.add_argument(
            "--config",
            action="append",
            default=[],
            help="a Gym YAML (repeatable; Gym's config_paths, relative to the nemo-gym install "
            "or here): the instance --name is hosted with its block",
        )
        hosted.add_argument("--name", required=True, help="the server's Gym instance name")
    res = sub.choices["resources"]
    res.add_argument(
        "--server",
        help="module:Class of an installed Gym server, e.g. "
        "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer "
        "(default with --config: the class the instance's module defines)",
    )
    res.add_argument(
        "--role",
        choices=[Role.RESOURCES.value, Role.AGENT.value],
        default=Role.RESOURCES.value,
        help="the set's role this pod serves (a Gym agent server: agent)",
    )
    sub.choices["environment-server"].add_argument(
        "--step-timeout-seconds", type=float, default=300.0
    )
    args = parser.parse_args(argv)
    refusal = gym_release_refusal()
    if refusal is not None:
        sys.exit(f"rollout-gym: {refusal}")
    peers = _peers()

    if args.command == "environment":
        model_url = args.model_url or peers.get("model")
        resources_url = args.resources_url or peers.get("resources")
        if not model_url or not resources_url:
            sys.exit("rollout-gym environment: needs the model's and the resources server's URLs")
        settings = environment.GymSettings(
            model_url=model_url,
            resources_url=resources_url,
            strategy=environment.Strategy(args.strategy),
            max_steps=args.max_steps,
            step_timeout_s=args.step_timeout_seconds,
            rebuild_timeout_s=args.rebuild_timeout_seconds,
            snapshot_export=args.snapshot_export,
            snapshot_import=args.snapshot_import,
            # the tests' negative control only (docs/gym.md): never set it in a real set
            rebuild=os.environ.get("ROLLOUT_GYM_REBUILD", "on") != "off",
        )
        control = ControlSettings.from_env(Role.ENVIRONMENT, waits_on=environment.WAITS_ON)
        app = environment.build_app(control, settings)
    else:
        app = _hosted_app(args, peers)

    def drain() -> None:
        app.state.draining = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    DrainingServer(config, on_drain=drain, drain_seconds=args.drain_seconds).run()


if __name__ == "__main__":
    main()
