"""A pod command whose worker 1 fails while it starts: `python -m testsupport.failing_worker
--port P`, the reference resources server's app in every other worker, served by
`serve_workers` as a pod's command serves it (tests/adversarial/test_worker_pods.py)."""

from __future__ import annotations

import argparse
import os
import sys

from rollout_protocol import ControlSettings, Role
from rollout_protocol.workers import WorkerApp, serve_workers
from rollout_servers.cli import worker_app

FAILING = 1
WORKERS = 3


def app() -> WorkerApp:
    """Worker `FAILING` exits before it serves (as a server whose start-up raises would)."""
    if os.environ["ROLLOUT_WORKER"].startswith(f"{FAILING}/"):
        sys.exit(3)
    return worker_app(["resources"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve_workers(
        app,
        role=Role.RESOURCES,
        workers=WORKERS,
        host="127.0.0.1",
        port=args.port,
        settings=ControlSettings.from_env(Role.RESOURCES),
        log_level="warning",
    )


if __name__ == "__main__":
    main()
