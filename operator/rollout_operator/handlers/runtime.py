"""Operator lifecycle: settings, the operator's state, the shared Kubernetes client, the leader
Lease, metrics.

`configure` runs first at startup (Kopf runs startup handlers before it starts watching), so
every watch and handler already sees our finalizer, annotation prefix and timeouts, and the
process's `OperatorState` (`flows/state.py`) is in Kopf's `memo`, which Kopf hands every
handler (a shallow copy per object: the state itself is shared; `state_of`). With
`--leader-lease` it also waits there until this process holds the Lease (`cluster/leader.py`),
so no handler runs while a previous operator is still stopping; `stop`, Kopf's cleanup after
every handler and daemon ended, releases it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any, Final, cast

import anyio
import kopf
from prometheus_client import start_http_server

from ..cluster.kube import Kube
from ..cluster.leader import LeaderLease, default_identity
from ..cluster.leases import CheckpointLeases
from ..cluster.rest import credentials
from ..flows.state import OperatorState
from ..model.settings import RunOptions, configure

logger = logging.getLogger(__name__)

MEMO_OPTIONS = "options"
MEMO_STATE = "state"
MEMO_KUBE = "kube"
MEMO_CHECKPOINT_SLOTS = "checkpoint_slots"
MEMO_LEASES = "checkpoint_leases"
MEMO_LEADER = "leader_lease"
MEMO_LEADING = "leading"
RELEASE_SECONDS: Final = 5.0
"""How long the stopping operator tries to release its leader Lease."""


def options_of(memo: kopf.Memo) -> RunOptions:
    """The runner's options (defaults when the handlers run without the runner, e.g. kopf run)."""
    options = memo.get(MEMO_OPTIONS)
    return options if isinstance(options, RunOptions) else RunOptions()


def state_of(memo: kopf.Memo) -> OperatorState:
    """The process's state (docs/design.md#611-the-operators-in-process-state), made by `start`.

    A memo without one (a handler called without the operator's startup, as the unit tests do)
    gets a fresh one, kept in that memo: such a handler then runs as in a process that has just
    started."""
    state = memo.get(MEMO_STATE)
    if not isinstance(state, OperatorState):
        state = memo[MEMO_STATE] = OperatorState()
    return state


def kube_of(memo: kopf.Memo, handler_kwargs: Mapping[str, Any] | None = None) -> Kube:
    """The process's Kubernetes client, created by `start`.

    Handlers pass their keyword arguments: Kopf hands its indexes (`handlers/indexes.py`) to
    every resource handler that way, and the first to pass them makes the client read from the
    watches from then on (`cache.ClusterCache`)."""
    kube = memo.get(MEMO_KUBE)
    if not isinstance(kube, Kube):
        raise kopf.TemporaryError("the Kubernetes client is not ready yet", delay=1)
    if handler_kwargs is not None:
        kube.cache.attach(handler_kwargs)
    return kube


def leases_of(memo: kopf.Memo) -> CheckpointLeases | None:
    """The per-set checkpoint Leases of this process, made by `start`."""
    leases = memo.get(MEMO_LEASES)
    return leases if isinstance(leases, CheckpointLeases) else None


def checkpoint_slots_of(memo: kopf.Memo) -> anyio.Semaphore | None:
    """The operator-wide checkpoint slots (`--max-concurrent-checkpoints`), made by `start`."""
    slots = memo.get(MEMO_CHECKPOINT_SLOTS)
    return slots if isinstance(slots, anyio.Semaphore) else None


@kopf.on.startup(id="configure")
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options = options_of(memo)
    configure(settings, options)
    memo[MEMO_STATE] = OperatorState()
    memo[MEMO_KUBE] = kube = Kube.connect(settings, max_concurrent_requests=options.api_concurrency)
    if (key := options.leader_lease_key) is not None:
        leader = LeaderLease(kube, *key, default_identity())
        await leader.acquire()
        memo[MEMO_LEADER] = leader
        memo[MEMO_LEADING] = asyncio.create_task(_lead(leader), name="leader lease")
    memo[MEMO_LEASES] = CheckpointLeases(kube)
    slots = options.max_concurrent_checkpoints
    memo[MEMO_CHECKPOINT_SLOTS] = anyio.Semaphore(slots, max_value=slots)
    if options.metrics_port is not None:
        start_http_server(options.metrics_port)
        logger.info("metrics on :%d/metrics", options.metrics_port)


@kopf.on.login(id="credentials")
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """Kopf's watches log in as our own client does (`rest.credentials`): the service account
    with the API server's address from the pod's environment (Kopf's built-in login would use
    `kubernetes.default.svc`, which needs cluster DNS), else the kubeconfig."""
    return credentials(settings)


async def _lead(leader: LeaderLease) -> None:
    """Renew the leader Lease; once it is lost (or renewing broke), stop as a pod deletion
    would (SIGTERM: Kopf stops every handler and hands the checkpoints over)."""
    try:
        await leader.keep()
    except Exception:
        logger.exception("leader Lease %s: renewing failed; this operator stops", leader.where)
    os.kill(os.getpid(), signal.SIGTERM)


@kopf.on.cleanup(id="close-client")
async def stop(memo: kopf.Memo, **_: Any) -> None:
    leading = cast("asyncio.Task[None] | None", memo.get(MEMO_LEADING))
    if leading is not None:
        leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
    leader = cast(LeaderLease | None, memo.get(MEMO_LEADER))
    if leader is not None:
        # Best effort and bounded: a Lease not released lapses for the successor anyway.
        with anyio.move_on_after(RELEASE_SECONDS):
            try:
                await leader.release()
            except Exception as error:
                logger.warning("leader Lease %s: not released: %s", leader.where, error)
    state = memo.get(MEMO_STATE)
    if isinstance(state, OperatorState):
        await state.checkpoints.close()  # records removals; the successor starts them again
    kube = cast(Kube | None, memo.get(MEMO_KUBE))
    if kube is not None:
        await kube.close()
