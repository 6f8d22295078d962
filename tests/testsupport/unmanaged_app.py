"""The reference environment as an ASGI app factory for `uvicorn --workers N --factory`: what a
user gets who runs a server with several workers without `rollout_protocol.workers`. Each
uvicorn worker is its own participant, so its status route says `multi_process: unmanaged`
(tests/e2e/test_multi_worker_sets.py shows the operator refusing to checkpoint it)."""

from __future__ import annotations

import os

from fastapi import FastAPI
from rollout_protocol import Role
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.environment import EnvironmentServer


def environment() -> FastAPI:
    options = ServerOptions(
        role=Role.ENVIRONMENT,
        agent_url=os.environ["ROLLOUT_PEER_AGENT_URL"],
        resources_url=os.environ["ROLLOUT_PEER_RESOURCES_URL"],
    )
    return EnvironmentServer(options).build_app()
