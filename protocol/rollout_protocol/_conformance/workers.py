"""Scenarios `workers.managed`, `workers.private-channel` and `workers.spread`: a participant of
several worker processes coordinates them (one control plane, the private channel closed to
other callers) and the kit's rollout ids land one per worker (`rollout_ids_per_worker`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx

from .._wire import (
    MultiProcess,
    StatusReply,
)
from .._workers import WORKER_PREFIX, owner
from .calls import Target, _Conn, _connect, _new_id
from .report import DRIVER, WORKERS_MANAGED, WORKERS_PRIVATE, WORKERS_SPREAD, ConformanceError


async def check_workers(
    target: Target, *, workers: int | None = None, call_timeout_s: float = 10.0
) -> None:
    """`workers.managed`: the status route does not say `multi_process: unmanaged`; with
    `workers`, a managed participant reports that many worker processes.
    `workers.private-channel`: a managed participant of several workers refuses a read of
    every worker's private channel that comes through its port."""
    async with _connect([target], call_timeout_s) as (conn,):
        status = await conn.status(WORKERS_MANAGED)
        if status.multi_process is MultiProcess.MANAGED and status.workers > 1:
            await _check_private_channel(conn, status.workers)
    if status.multi_process is MultiProcess.UNMANAGED:
        raise ConformanceError(
            WORKERS_MANAGED,
            "one control plane for every worker process of the server",
            f"multi_process: unmanaged ({status.workers} workers): a checkpoint would cover "
            "only the worker that answered, and the operator refuses to checkpoint the set",
            fix="serve the workers with rollout_protocol.workers.serve_workers (docs/sdk.md, "
            "section 10), or run one worker per pod",
        )
    if workers is not None and status.workers != workers:
        raise ConformanceError(
            WORKERS_MANAGED,
            f"{workers} worker processes reported",
            f"{status.workers} ({status.multi_process.value})",
        )


async def _check_private_channel(conn: _Conn, workers: int) -> None:
    """Read each worker's episode counts on its private channel from outside the pod (a read:
    a participant that answers it changes nothing), without a token and with the control token;
    the rollout ids make the pod route each read to another worker."""
    control = {"Authorization": f"Bearer {conn.target.token}"} if conn.target.token else {}
    for rollout_id in rollout_ids_per_worker(workers, _new_id("private")):
        url = conn.url(f"{WORKER_PREFIX}/counts?rollout_id={rollout_id}")
        for what, headers in (("without a token", {}), ("with the control token", control)):
            try:
                reply = await conn.http.get(url, headers=headers, timeout=conn.call_timeout_s)
            except httpx.HTTPError as error:
                raise ConformanceError(
                    WORKERS_PRIVATE,
                    f"GET {WORKER_PREFIX}/counts {what}: a 4xx refusal",
                    f"no reply ({type(error).__name__}: {error})",
                ) from None
            if not 400 <= reply.status_code < 500:
                raise ConformanceError(
                    WORKERS_PRIVATE,
                    f"GET {WORKER_PREFIX}/counts {what} (rollout {rollout_id}, worker "
                    f"{owner(rollout_id, workers)}): a 4xx refusal, the channel is the pod's own",
                    f"{reply.status_code}: {reply.text[:200]}",
                    fix="serve the workers with rollout_protocol.workers.serve_workers, and "
                    f"define no route of your own under {WORKER_PREFIX}",
                )


def _check_spread(statuses: Sequence[StatusReply], rollout_ids: Sequence[str]) -> None:
    """`workers.spread`: the kit's rollout ids reach every worker of each managed participant."""
    for status in statuses:
        if status.multi_process is MultiProcess.UNMANAGED:
            raise ConformanceError(
                WORKERS_MANAGED,
                f"{status.instance}: one control plane for every worker process",
                "multi_process: unmanaged",
                fix="serve the workers with rollout_protocol.workers.serve_workers",
            )
        if status.multi_process is not MultiProcess.MANAGED or status.workers < 2:
            continue
        reached = {owner(rid, status.workers) for rid in rollout_ids}
        missed = sorted(set(range(status.workers)) - reached)
        if missed:
            raise ConformanceError(
                WORKERS_SPREAD,
                f"rollout ids that reach all {status.workers} workers of {status.instance}",
                f"none for worker(s) {missed}",
                fault=DRIVER,
                fix="pass rollout_ids with one per worker: "
                "rollout_protocol.conformance.rollout_ids_per_worker(workers)",
            )


def rollout_ids_per_worker(workers: int, prefix: str = "kit-episode") -> list[str]:
    """`<prefix>-<n>` ids, one held by each of `workers` workers (`workers.owner`), for
    `check_crash_restore` against a multi-worker participant."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < workers:
        rid = f"{prefix}-{n}"
        found.setdefault(owner(rid, workers), rid)
        n += 1
    return [found[k] for k in range(workers)]


def _multi_worker(conns: Sequence[_Conn], statuses: Sequence[StatusReply]) -> dict[str, int]:
    """The group's participants with several managed workers: target name -> workers."""
    return {
        conn.target.name: status.workers
        for conn, status in zip(conns, statuses, strict=True)
        if status.multi_process is MultiProcess.MANAGED and status.workers > 1
    }


def _held_by(rid: str, workers: Mapping[str, int]) -> str:
    """` (held by worker k of <participant>, ...)`, or nothing for single-process groups."""
    held = [f"worker {owner(rid, n)} of {name}" for name, n in workers.items()]
    return f" (held by {', '.join(held)})" if held else ""
