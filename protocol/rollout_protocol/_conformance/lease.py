"""Scenario `lease.auto-resume`: a participant left prepared by a coordinator that went away
resumes by itself once its lease lapses, and the abandoned id is stale.
"""

from __future__ import annotations

import math
import time

import anyio
import anyio.to_thread

from .._wire import (
    ErrorCode,
    Phase,
    PrepareRequest,
)
from .calls import Target, _Conn, _connect, _expect, _expect_idle, _new_id, _ok, _refused
from .report import LEASE, ConformanceError


async def check_lease_auto_resume(
    target: Target,
    *,
    lease_grace_seconds: float | None,
    prepare_deadline_s: float = 1.0,
    margin_s: float = 5.0,
    longest_wait_s: float = 120.0,
    poll_interval_s: float = 0.05,
    call_timeout_s: float = 10.0,
) -> None:
    """`lease.auto-resume`: prepare with a deadline `prepare_deadline_s` ahead, then call
    nothing but `/status` (polled every `poll_interval_s`): the participant must stay in its
    phase until `deadline_ts + lease_grace_seconds` and be idle within `margin_s` after it.

    `lease_grace_seconds` is the participant's `ROLLOUT_LEASE_GRACE_SECONDS`; with None the
    lease expiry the participant reports is trusted (it must come within `longest_wait_s`).
    """
    async with _connect([target], call_timeout_s) as (conn,):
        await _expect_idle(conn, LEASE, "before the check")
        cid = _new_id("lease")
        deadline_ts = time.time() + prepare_deadline_s
        await _ok(
            LEASE,
            f"prepare of {cid}",
            conn.participant.prepare(PrepareRequest(checkpoint_id=cid, deadline_ts=deadline_ts)),
        )
        expires = await _lease_expiry(conn, cid, deadline_ts, lease_grace_seconds, longest_wait_s)
        early = expires - min(0.5, lease_grace_seconds or 0.5)
        await _idle_once_lapsed(conn, cid, expires, early, margin_s, poll_interval_s)
        await _refused(
            LEASE,
            f"prepare of {cid} after its lease lapsed",
            conn.participant.prepare(
                PrepareRequest(checkpoint_id=cid, deadline_ts=conn.deadline())
            ),
            ErrorCode.STALE_CHECKPOINT,
        )


async def _lease_expiry(
    conn: _Conn,
    cid: str,
    deadline_ts: float,
    lease_grace_seconds: float | None,
    longest_wait_s: float,
) -> float:
    """When the lease of the just-prepared `cid` lapses: the one `/status` shows, which must be
    `deadline_ts + lease_grace_seconds` when that grace is known, and within `longest_wait_s`."""
    status = await conn.status(LEASE)
    _expect(
        LEASE,
        status.phase in (Phase.PREPARING, Phase.PREPARED) and status.lease_expires_ts is not None,
        f"right after the prepare of {cid}, /status must show its phase and lease expiry",
        f"phase {status.phase.value}, lease_expires_ts {status.lease_expires_ts}",
    )
    assert status.lease_expires_ts is not None
    if lease_grace_seconds is None:
        expires = status.lease_expires_ts
    else:
        expires = deadline_ts + lease_grace_seconds
        _expect(
            LEASE,
            math.isclose(status.lease_expires_ts, expires, abs_tol=0.5),
            f"the lease must expire at deadline_ts + {lease_grace_seconds}s = {expires:.3f}",
            f"lease_expires_ts {status.lease_expires_ts:.3f}",
        )
    _expect(
        LEASE,
        expires - time.time() <= longest_wait_s,
        f"the lease must lapse within {longest_wait_s}s to be checked (run the participant "
        "with a short ROLLOUT_LEASE_GRACE_SECONDS)",
        f"lease_expires_ts {status.lease_expires_ts:.3f}",
    )
    return expires


async def _idle_once_lapsed(
    conn: _Conn,
    cid: str,
    expires: float,
    early: float,
    margin_s: float,
    poll_interval_s: float,
) -> None:
    """Poll `/status` until the participant is idle: not before `early`, and by `expires +
    margin_s`."""
    give_up = expires + margin_s
    while True:
        status = await conn.status(LEASE)
        now = time.time()
        if status.phase is Phase.IDLE:
            _expect(
                LEASE,
                now >= early,
                f"the participant must keep {cid} open until its lease lapses at {expires:.3f}",
                f"idle {expires - now:.2f}s before the lapse",
            )
            return
        if now >= give_up:
            raise ConformanceError(
                LEASE,
                f"the participant must resume by itself once the lease of {cid} lapses "
                f"(deadline_ts + grace = {expires:.3f})",
                f"still {status.phase.value} {now - expires:.2f}s after the lapse",
            )
        await anyio.sleep(poll_interval_s)
