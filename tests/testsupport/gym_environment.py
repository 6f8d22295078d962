"""A test participant that speaks ONLY the NeMo Gym control dialect.

`python -m testsupport.gym_environment --host H --port P --agent-url A --resources-url R` runs
an environment server whose episodes are the reference environment's (`EnvironmentServer`: the
same `/run`, `/stats` and `/healthz`, so the e2e helpers that check a recovered run read it as
they read ours), but whose control plane mounts the Gym dialect alone: bearer-token routes under
`/ng-control/v1/checkpoint/` (and our `GET /ng-control/v1/capabilities`), Gym's models and error
codes at the commit docs/protocol.md pins, nothing under `/checkpoint/v1`. Whatever
`ROLLOUT_CONTROL_DIALECTS` says, it is Gym only.

A coordinator reaches it only by asking its dialect and speaking Gym's, which is
what the e2e test of a mixed set (this environment, the other roles ours) shows.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

from rollout_protocol import ControlPlane, Dialect, Role
from rollout_servers.cli import build_parser, make_server
from rollout_servers.servers.common import RolloutServer, serve


def gym_only(server: RolloutServer) -> RolloutServer:
    """`server` with its control plane rebuilt to mount the Gym dialect only."""
    server.settings = replace(server.settings, dialects=(Dialect.GYM,))
    server.plane = ControlPlane(server.participant, server.settings)
    return server


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(
        [Role.ENVIRONMENT.value, *(sys.argv[1:] if argv is None else argv)]
    )
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s gym-environment %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    server = gym_only(make_server(args))
    serve(
        server,
        args.host,
        args.port,
        drain_seconds=args.drain_seconds,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
