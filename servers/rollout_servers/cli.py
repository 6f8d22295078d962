"""`rollout-server {environment|agent|model|resources} --host H --port P ...`

Each role is one process with its control plane mounted, or, with `--workers N` (default:
`$WEB_CONCURRENCY`, as uvicorn and gunicorn read it), N worker processes behind one port and one
control plane that coordinates them all (`rollout_protocol.workers`; not for the model role,
which stays one process per engine: docs/servers.md). The checkpoint identity comes from the
environment the operator sets in every pod (`ROLLOUT_SET`, `ROLLOUT_INDEX`, `ROLLOUT_ATTEMPT`,
`ROLLOUT_CHECKPOINT_ROOT`, `ROLLOUT_CONTROL_TOKEN`). Once listening, the process prints one JSON
line `{"event": "ready", "port": N}` on stdout, so a supervisor (or a test) knows the port
without polling, even with `--port 0`.

SIGTERM does not stop the server: it turns unready and keeps its control plane up (the operator
checkpoints inside the pod's grace period) until SIGKILL, a second SIGTERM, SIGINT, or
`--drain-seconds`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import resource
import sys
from collections.abc import Mapping, Sequence

from rollout_protocol import ControlConfigError, Role
from rollout_protocol.workers import WorkerApp, declared_workers, serve_workers

from .servers.common import RolloutServer, ServerOptions, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-server",
        description="Run one reference rollout server (a checkpoint participant).",
    )
    parser.add_argument("role", choices=[r.value for r in Role])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--index", type=int, default=None, help="default: $ROLLOUT_INDEX or 0")
    parser.add_argument("--agent-url", help="environment: the agent server")
    parser.add_argument("--model-url", help="agent: the model server")
    parser.add_argument("--resources-url", help="environment, agent: the resources server")
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="run the control plane without ROLLOUT_CONTROL_TOKEN (trusted networks only)",
    )
    parser.add_argument(
        "--debug-hooks",
        action="store_true",
        help="mount /debug/* (pause points for protocol tests); never in production",
    )
    parser.add_argument(
        "--episode-timeout",
        type=float,
        default=None,
        help="seconds an episode may take, parked checkpoint time not counted",
    )
    parser.add_argument("--call-timeout", type=float, default=600.0, help="per peer call, seconds")
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=None,
        help="after SIGTERM, exit after this long (default: wait for SIGKILL or a second signal)",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--backend", choices=["builtin", "openai"], default="builtin")
    model.add_argument("--upstream-url", help="openai backend: the upstream server's base URL")
    model.add_argument("--model-name", default="builtin", help="the model id served and sent")
    model.add_argument("--token-latency-ms", type=float, default=0.0, help="builtin backend")
    model.add_argument(
        "--mistake-rate",
        type=float,
        default=0.25,
        help="builtin backend: share of (seed, task) pairs answered off by one",
    )
    resources = parser.add_argument_group("resources")
    resources.add_argument(
        "--wait-tools",
        default="",
        help="comma-separated tools this server declares not idempotent: callers run their "
        "calls as wait steps, which a checkpoint waits for (default: none; every shipped tool "
        "is idempotent and replays)",
    )
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=0.0,
        help="stay unready this long after start, as loading model weights would "
        "(simulates a model pod's start cost for benches and demos)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes behind one port, all in every checkpoint (environment, agent, "
        "resources); default: $WEB_CONCURRENCY or 1",
    )
    parser.add_argument("--log-level", default="info")
    return parser


def make_server(args: argparse.Namespace) -> RolloutServer:
    from .servers.agent import AgentServer
    from .servers.environment import EnvironmentServer
    from .servers.model import ModelServer
    from .servers.resources import ResourcesServer

    role = Role(args.role)
    needs = {
        Role.ENVIRONMENT: ("agent_url", "resources_url"),
        Role.AGENT: ("model_url", "resources_url"),
        Role.MODEL: (),
        Role.RESOURCES: (),
    }[role]
    missing = [f"--{name.replace('_', '-')}" for name in needs if not getattr(args, name)]
    if missing:
        raise SystemExit(f"rollout-server {role.value}: missing {', '.join(missing)}")
    options = ServerOptions(
        role=role,
        index=args.index,
        agent_url=args.agent_url,
        model_url=args.model_url,
        resources_url=args.resources_url,
        allow_unauthenticated=args.allow_unauthenticated,
        debug_hooks=args.debug_hooks,
        episode_timeout_s=args.episode_timeout,
        call_timeout_s=args.call_timeout,
        backend=args.backend,
        upstream_url=args.upstream_url,
        model_name=args.model_name,
        token_latency_ms=args.token_latency_ms,
        mistake_rate=args.mistake_rate,
        load_seconds=args.load_seconds,
        wait_tools=tuple(t for t in (x.strip() for x in args.wait_tools.split(",")) if t),
    )
    classes: dict[Role, type[RolloutServer]] = {
        Role.ENVIRONMENT: EnvironmentServer,
        Role.AGENT: AgentServer,
        Role.MODEL: ModelServer,
        Role.RESOURCES: ResourcesServer,
    }
    return classes[role](options)


def _raise_open_files_limit() -> None:
    """A thousand live episodes need a few thousand sockets; take what the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def worker_count(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """`--workers`, else `$WEB_CONCURRENCY`, else 1; the model role refuses more than one."""
    env = os.environ if environ is None else environ
    workers: int | None = args.workers
    if workers is None:
        try:
            workers = declared_workers(env)
        except ControlConfigError as error:
            raise SystemExit(f"rollout-server {args.role}: {error}") from None
    if workers < 1:
        raise SystemExit(f"rollout-server {args.role}: --workers must be >= 1, got {workers}")
    if workers > 1 and Role(args.role) is Role.MODEL:
        raise SystemExit(
            f"rollout-server model: {workers} workers asked for; the model role runs one process "
            "per engine (its engine batches every episode's calls, and its records hold the "
            "engine's prefixes): run more model replicas instead"
        )
    return workers


def worker_app(argv: Sequence[str]) -> WorkerApp:
    """One worker of a `--workers N` server (called in the worker process)."""
    args = build_parser().parse_args(argv)
    _raise_open_files_limit()
    server = make_server(args)

    def drain() -> None:
        server.draining = True

    def stopping() -> None:
        server.draining = True
        server.hooks.release_all()

    return WorkerApp(server.build_app(), on_drain=drain, on_stop=stopping)


def _ready(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    workers = worker_count(args)
    if workers > 1:
        try:
            # the same start-up checks as one process, before any worker; the main process's
            # plane answers for the pod with the server's settings (its declared waits included)
            settings = make_server(args).settings
        except (ControlConfigError, ValueError) as error:
            raise SystemExit(f"rollout-server {args.role}: {error}") from None
        _raise_open_files_limit()
        try:
            serve_workers(
                functools.partial(worker_app, argv),
                role=Role(args.role),
                workers=workers,
                host=args.host,
                port=args.port,
                settings=settings,
                drain_seconds=args.drain_seconds,
                ready_line=_ready,
                log_level=args.log_level,
            )
        except KeyboardInterrupt:
            raise SystemExit(0) from None
        return
    try:
        server = make_server(args)
    except (ControlConfigError, ValueError) as error:
        raise SystemExit(f"rollout-server {args.role}: {error}") from None
    _raise_open_files_limit()
    try:
        serve(
            server, args.host, args.port, drain_seconds=args.drain_seconds, log_level=args.log_level
        )
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it shut down for; the stop was asked for, so it is clean
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
