"""Serving a participant with uvicorn: `DrainingServer`, which keeps the control plane up after
SIGTERM.

The operator checkpoints inside an evicted pod's grace period, so a participant must keep
answering control calls after SIGTERM instead of stopping at once (docs/sdk.md, "Deploying").
This module needs uvicorn (`pip install 'rollout-protocol[serve]'`); `import rollout_protocol`
does not import it.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

__all__ = ["DrainingServer"]


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM does not stop the server.

    On the first SIGTERM it calls `on_drain` (turn `/healthz` 503 and refuse new episodes there,
    answering `/run` with 503 `admission_closed`) and keeps serving, the control plane included,
    until SIGKILL, a second SIGTERM, SIGINT, or `drain_seconds` (None: no limit). Stopping then
    still waits for in-flight requests (control calls included). `ready_line`, if given, gets one
    JSON line `{"event": "ready", "port": ...}` once the server listens; `on_stop` is called when
    the server starts to shut down.

        config = uvicorn.Config(app, host=host, port=port)
        DrainingServer(config, on_drain=server.start_draining, drain_seconds=20).run()
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        on_drain: Callable[[], None],
        drain_seconds: float | None,
        ready_line: Callable[[str], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._on_drain = on_drain
        self._on_stop = on_stop
        self._drain_seconds = drain_seconds
        self._draining = False
        self._drain_deadline: float | None = None
        self._ready_line = ready_line

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._draining and not self.should_exit:
            self._draining = True
            if self._drain_seconds is not None:
                self._drain_deadline = time.monotonic() + self._drain_seconds
            self._on_drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        if self._on_stop is not None:
            self._on_stop()
        await super().shutdown(sockets=sockets)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._ready_line is not None:
            port = None
            for server in self.servers:
                for sock in server.sockets:
                    port = sock.getsockname()[1]
            self._ready_line(json.dumps({"event": "ready", "port": port}))
