"""A wait step's external effect across a crash (docs/sdk.md, "Side effects across a crash"),
with the side-effects example (`examples/side-effects/checkout_env.py`): the charge step
completes after the last checkpoint, the environment is SIGKILLed, the checkpoint is restored
under attempt 1, and the restored episode runs the charge step again (at least once across a
crash) with the same idempotency key, so the shop applies one charge.

The environment runs as the process a pod would run (`python -m checkout_env`); the shop is
`checkout_env.shop_app()` served in this test's event loop on a loopback port, behind a gate
that holds the first call of chosen routes until the test lets it go: that is how the episode
is held in `quote@0` while the checkpoint is taken, and in `confirm@2` (after the charge) when
the process is killed, without debug hooks or sleeps.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import anyio
import httpx
from rollout_protocol import Coordinator, HttpParticipantClient, Role
from rollout_protocol.conformance import serve_app
from starlette.types import ASGIApp, Receive, Scope, Send
from testsupport.server_processes import TOKEN, free_port, server_env

from devcluster.waiting import wait_for_sync

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "side-effects"
WAIT_S = 30.0
"""Upper bound of every condition waited on; reaching it is a failure, not a delay."""
STOP_TIMEOUT_S = 15.0
ROLLOUT = "r-pay-1"
TASK = {"item": "teapot"}


class Gate:
    """ASGI middleware in front of the shop: the first call of each route in `hold`
    (`METHOD /path`) waits until `release()`; `arrived[route]` is set when it got there."""

    def __init__(self, app: ASGIApp, hold: set[str]) -> None:
        self.app, self.hold = app, hold
        self.arrived: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)
        self.released: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)

    def release(self, route: str) -> None:
        self.released[route].set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = f"{scope['method']} {scope['path']}"
            if route in self.hold:
                self.hold.discard(route)  # only the first call
                self.arrived[route].set()
                await self.released[route].wait()
        await self.app(scope, receive, send)


class Environment:
    """`python -m checkout_env` with the variables the operator gives a pod."""

    def __init__(self, root: Path, shop_url: str, attempt: int) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        env = server_env(root / "checkpoints", attempt)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE), env.get("PYTHONPATH")]))
        port = self.url.rsplit(":", 1)[1]
        with (root / f"environment-{attempt}.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "checkout_env", "--port", port, "--shop-url", shop_url],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        wait_for_sync(self._ready, WAIT_S, f"the environment at {self.url} to answer /healthz")

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"the environment exited ({self.process.returncode})"
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        return False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def environments() -> Iterator[list[Environment]]:
    """Every environment started in the block is killed at its end."""
    started: list[Environment] = []
    try:
        yield started
    finally:
        for env in started:
            env.kill()


def example() -> ModuleType:
    """The example's module, imported from its folder (examples are not packages here)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    return importlib.import_module("checkout_env")


def coordinator(session: aiohttp.ClientSession, env: Environment) -> Coordinator:
    return Coordinator(
        [HttpParticipantClient(Role.ENVIRONMENT, env.url, token=TOKEN, client=session)]
    )


async def ledger(http: httpx.AsyncClient, shop_url: str) -> dict[str, Any]:
    reply = await http.get(shop_url + "/ledger")
    reply.raise_for_status()
    body: dict[str, Any] = reply.json()
    return body


async def test_a_charge_rerun_after_a_restore_is_applied_once(tmp_path: Path) -> None:
    checkout = example()
    key: str = checkout.idempotency_key(ROLLOUT, "charge@1")
    gate = Gate(checkout.shop_app(), hold={"POST /quote", "GET /charges"})
    async with (
        serve_app(gate, role=Role.RESOURCES, token=TOKEN) as shop,
        httpx.AsyncClient(timeout=WAIT_S) as http,
        aiohttp.ClientSession() as session,
    ):
        shop_url = shop.target.base_url
        with environments() as started:
            first = Environment(tmp_path, shop_url, attempt=0)
            started.append(first)
            body = {"rollout_id": ROLLOUT, "attempt": 0, "task": TASK}
            async with anyio.create_task_group() as group:

                async def run_until_killed() -> None:
                    with contextlib.suppress(httpx.TransportError):
                        await http.post(first.url + "/run", json=body)

                group.start_soon(run_until_killed)
                with anyio.fail_after(WAIT_S):
                    await gate.arrived["POST /quote"].wait()
                # the episode is in quote@0 (replay): the checkpoint records it before charge@1
                checkpoint = await coordinator(session, first).checkpoint(
                    "ckpt-before-charge", prepare_timeout=20, commit_timeout=20
                )
                assert checkpoint.ok, checkpoint.message
                gate.release("POST /quote")
                with anyio.fail_after(WAIT_S):
                    await gate.arrived["GET /charges"].wait()
                # charge@1 completed after the checkpoint; the episode waits in confirm@2
                charged = await ledger(http, shop_url)
                assert sum(charged["presented"].values()) == 1
                assert len(charged["charges"]) == 1
                await anyio.to_thread.run_sync(first.kill)
                gate.release("GET /charges")

            second = Environment(tmp_path, shop_url, attempt=1)
            started.append(second)
            restoring = coordinator(session, second)
            restored = await restoring.restore("ckpt-before-charge", 1, time.time() + WAIT_S)
            assert restored.ok, restored.failures
            assert [e.rollout_id for e in restored.episodes] == [ROLLOUT]
            resumed = await restoring.resume("ckpt-before-charge", time.time() + WAIT_S)
            assert not resumed.failures

            reply = await http.post(second.url + "/run", json={**body, "attempt": 1})
            assert reply.status_code == 200, reply.text
            result = reply.json()
            stats = (await http.get(second.url + "/stats", params={"rollout_id": ROLLOUT})).json()
            after = await ledger(http, shop_url)

    # the restored episode ran charge@1 again (at least once across the crash) ...
    assert result["continued_from"] == 0
    assert stats["rollouts"][ROLLOUT]["1"]["charge@1"] == {"started": 1, "completed": 1}
    assert "quote@0" in stats["rollouts"][ROLLOUT]["1"]  # it continued from before the charge
    assert sum(after["presented"].values()) == 2
    # ... and the shop applied it once: the same charge, answered again by its key
    assert len(after["charges"]) == 1, after["charges"]
    assert result["charge_id"] == charged["charges"][0]["charge_id"]
    assert after["presented"] == {key: 2}  # one key: the rollout's and the step's
    assert result["reward"] == 1.0
