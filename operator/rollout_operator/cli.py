"""`rollout-operator`: run the operator.

    rollout-operator run --namespace NS [--namespace NS2 ...] | --all-namespaces
                         [--liveness http://0.0.0.0:8080/healthz] [--metrics-port 9090]
                         [--standalone | --peering NAME [--priority N]] [--verbose | --debug]

It wraps `kopf.run` so a deployment needs no knowledge of Kopf's own CLI: the handlers are
imported here, and production settings are applied by the startup hook
(`handlers.runtime.start`, see `rollout_operator.model.settings`).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Final

import kopf
from pydantic import ValidationError
from rollout_protocol import tracing

from .model.api import MAX_REPLICAS
from .model.settings import (
    DEFAULT_API_CONCURRENCY,
    DEFAULT_MAX_CONCURRENT_CHECKPOINTS,
    DEFAULT_MAX_REPLICAS_PER_ROLE,
    DEFAULT_RESTORE_FLOOR_SECONDS,
    DEFAULT_RESYNC_SECONDS,
    DEFAULT_RETIRE_SECONDS,
    RunOptions,
)

_ROUTINE: frozenset[str] = frozenset(
    {
        "Handler 'pod-event' succeeded.",
        "Handler 'observe' succeeded.",
        "Handler 'status-check' succeeded.",
    }
)


class _QuietPodEvents(logging.Filter):
    """Drop Kopf's success lines of the event handlers that fire on every change of every
    participant pod and set; they would drown the lines that matter. Failures still log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in _ROUTINE


_RETRYING: Final = re.compile(
    r"^Request attempt (?P<attempt>\S+) failed; will retry: (?P<what>.*?) -> (?P<error>.*)$", re.S
)
_TOO_MANY: Final = re.compile(r"^APITooManyRequestsError\((?P<quoted>'(?:[^'\\]|\\.)*'|\"[^\"]*\")")


class RetriedRequests(logging.Filter):
    """Kopf's API client logs every failed try of a request it will retry at ERROR, with the
    API server's whole Status object. A try that will be retried is weather, not an error
    (docs/operations.md#failure-modes, class 11): a 429 TooManyRequests (the API server answers it
    while it (re)initialises the storage of freshly installed CRDs, asking to retry in a second)
    becomes one short INFO line, any other retried failure (connection refused while the API server
    restarts) a WARNING. The try that gives up ("escalating") stays an ERROR.

    Attached to the handlers of the root logger (Kopf logs through several loggers), so it
    changes the record after the loggers' level check: a WARNING or INFO line is still subject
    to the level the operator runs at."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not record.name.startswith("kopf"):
            return True
        retrying = _RETRYING.match(record.getMessage())
        if retrying is None:
            return True
        error, what, attempt = retrying["error"], retrying["what"], retrying["attempt"]
        too_many = _TOO_MANY.match(error)
        if too_many is not None:
            why = ast.literal_eval(too_many["quoted"])
            level = logging.INFO
            message = f"API server busy (429 TooManyRequests: {why}); try {attempt}: {what}"
        else:
            level = logging.WARNING
            message = f"API request failed, retrying (try {attempt}): {what} -> {error}"
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.msg, record.args = message, None
        return logging.getLogger(record.name).isEnabledFor(level)


def quiet_retried_requests() -> None:
    """Install `RetriedRequests` on the root logger's handlers (after `kopf.configure`)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RetriedRequests) for f in handler.filters):
            handler.addFilter(RetriedRequests())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-operator",
        description="The Rollout Checkpoint Operator: checkpoints RL rollout server pods and "
        "restores them under attempt + 1 after pod loss.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run the operator until interrupted")
    _add_scope(run)
    _add_serving(run)
    _add_api_limits(run)
    _add_work_limits(run)
    _add_logging(run)
    return parser


def _add_scope(run: argparse.ArgumentParser) -> None:
    """Which namespaces the operator serves."""
    scope = run.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="serve RolloutSets in this namespace (repeatable; globs like 'team-*' allowed)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")


def _add_serving(run: argparse.ArgumentParser) -> None:
    """The endpoints the operator serves, and how it shares the work with other replicas."""
    run.add_argument(
        "--liveness",
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    run.add_argument("--metrics-port", type=int, metavar="N", help="serve Prometheus metrics")
    peering = run.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone",
        action="store_true",
        help="run without peering (the default; run one replica)",
    )
    peering.add_argument(
        "--peering",
        metavar="NAME",
        help="coordinate with other replicas through the KopfPeering object NAME",
    )
    run.add_argument("--priority", type=int, default=0, help="peering priority (with --peering)")
    run.add_argument(
        "--leader-lease",
        metavar="NAMESPACE/NAME",
        help="work only while holding this Lease: a second operator started with the same "
        "Lease waits until the first stops (its pod replaced) or its Lease lapses; the chart's "
        "single replica runs with one",
    )


def _add_api_limits(run: argparse.ArgumentParser) -> None:
    """How the operator watches and calls the API server, and how often it looks again."""
    run.add_argument(
        "--watch-timeout-seconds",
        type=int,
        default=300,
        metavar="S",
        help="server-side timeout of watch requests (reconnects after it)",
    )
    run.add_argument("--worker-limit", type=int, metavar="N", help="at most N object workers")
    run.add_argument(
        "--api-concurrency",
        type=int,
        default=DEFAULT_API_CONCURRENCY,
        metavar="N",
        help=f"at most N of the operator's own API requests at once (default "
        f"{DEFAULT_API_CONCURRENCY}; more wait in the operator instead of in the API server)",
    )
    run.add_argument(
        "--resync-seconds",
        type=int,
        default=DEFAULT_RESYNC_SECONDS,
        metavar="S",
        help="each set's reconcile and policy loops look again this often without an event "
        f"(default {DEFAULT_RESYNC_SECONDS}; events and the loops' own deadlines wake them "
        "sooner)",
    )


def _add_work_limits(run: argparse.ArgumentParser) -> None:
    """Bounds on the checkpoints, recoveries and sets the operator runs."""
    run.add_argument(
        "--max-concurrent-checkpoints",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_CHECKPOINTS,
        metavar="N",
        help="at most N checkpoints run at once across every set; the others wait in phase "
        f"Queued (default {DEFAULT_MAX_CONCURRENT_CHECKPOINTS}; Eviction and Deadline "
        "checkpoints never wait)",
    )
    run.add_argument(
        "--inplace-retire-seconds",
        type=float,
        default=DEFAULT_RETIRE_SECONDS,
        metavar="S",
        help="an InPlace recovery falls back to Recreate when the pods it keeps have not "
        f"retired the lost attempt within S seconds (default {DEFAULT_RETIRE_SECONDS:g})",
    )
    run.add_argument(
        "--restore-floor-seconds",
        type=float,
        default=DEFAULT_RESTORE_FLOOR_SECONDS,
        metavar="S",
        help="a recovery's restore and resume calls get at least S seconds, even when "
        f"restoreTimeoutSeconds ends sooner (default {DEFAULT_RESTORE_FLOOR_SECONDS:g})",
    )
    run.add_argument(
        "--max-replicas-per-role",
        type=int,
        default=DEFAULT_MAX_REPLICAS_PER_ROLE,
        metavar="N",
        help="refuse sets with more than N replicas of a role (condition Degraded, reason "
        f"ReplicasOverLimit; default {DEFAULT_MAX_REPLICAS_PER_ROLE}, the API allows up to "
        f"{MAX_REPLICAS})",
    )


def _add_logging(run: argparse.ArgumentParser) -> None:
    """How much the operator logs, and in what format."""
    verbosity = run.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="log more")
    verbosity.add_argument("--debug", action="store_true", help="log everything, incl. Kopf")
    run.add_argument(
        "--log-format",
        choices=[f.name.lower() for f in kopf.LogFormat],
        default="full",
        help="log line format",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        options = RunOptions(
            namespaces=tuple(args.namespaces),
            all_namespaces=args.all_namespaces,
            liveness=args.liveness,
            metrics_port=args.metrics_port,
            peering=args.peering,
            priority=args.priority,
            watch_timeout_seconds=args.watch_timeout_seconds,
            resync_seconds=args.resync_seconds,
            api_concurrency=args.api_concurrency,
            worker_limit=args.worker_limit,
            max_replicas_per_role=args.max_replicas_per_role,
            max_concurrent_checkpoints=args.max_concurrent_checkpoints,
            inplace_retire_seconds=args.inplace_retire_seconds,
            restore_floor_seconds=args.restore_floor_seconds,
            leader_lease=args.leader_lease,
        )
    except ValidationError as error:
        print(f"rollout-operator: invalid options: {error}", file=sys.stderr)
        return 2
    if options.leader_lease is not None and options.peering is not None:
        print(
            "rollout-operator: invalid options: --leader-lease and --peering both choose which "
            "replica works; use one (peering for several replicas, the Lease for one)",
            file=sys.stderr,
        )
        return 2

    kopf.configure(
        debug=args.debug,
        verbose=args.verbose,
        log_format=kopf.LogFormat[args.log_format.upper()],
    )
    if not (args.verbose or args.debug):
        logging.getLogger("kopf.objects").addFilter(_QuietPodEvents())
        # One INFO line per participant call (48 for a checkpoint of 16 pods), which cost a
        # fifth of each call's CPU: the coordinator logs what the calls amount to instead.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    quiet_retried_requests()
    # OTLP/HTTP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; else the API's no-op tracer
    tracing.configure("rollout-operator")
    # Importing the package registers the handlers (including the configure hook).
    from . import handlers  # noqa: F401

    # uvloop where installed (Kopf's own CLI does the same): the checkpoint pause includes
    # this process's share of every control call, and its handlers share the loop meanwhile.
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        kopf.run(
            loop=runner.get_loop(),
            clusterwide=options.all_namespaces,
            namespaces=list(options.namespaces),
            standalone=options.standalone,
            peering_name=options.peering,
            priority=options.priority,
            liveness_endpoint=options.liveness,
            memo=kopf.Memo(options=options),
        )
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


if __name__ == "__main__":
    raise SystemExit(main())
