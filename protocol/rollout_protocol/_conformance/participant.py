"""The whole single-participant kit, `check_participant`: every single-participant scenario in
order against one dedicated, idle participant.
"""

from __future__ import annotations

from pathlib import Path

from .calls import Target, _connect
from .lease import check_lease_auto_resume
from .persist import check_persist_after_resume
from .phases import check_conflicting_ids, check_phases, check_stale_ids
from .refusals import check_auth, check_strict_bodies
from .report import RESTORE
from .restore import check_restore_all_or_nothing
from .workers import check_workers


async def check_participant(
    target: Target,
    *,
    checkpoint_root: Path,
    lease_grace_seconds: float | None,
    lease_margin_s: float = 5.0,
    call_timeout_s: float = 10.0,
) -> None:
    """Every single-participant check, in an order that keeps each one's preconditions.

    The participant must be idle and dedicated to the kit: the phases check restores into it
    (moving it to the next attempt) and every check leaves stale ids behind.
    """
    await check_workers(target, call_timeout_s=call_timeout_s)
    await check_auth(target, call_timeout_s=call_timeout_s)
    await check_strict_bodies(target, call_timeout_s=call_timeout_s)
    cid, captured = await check_phases(target, call_timeout_s=call_timeout_s)
    await check_stale_ids(target, call_timeout_s=call_timeout_s)
    await check_conflicting_ids(target, call_timeout_s=call_timeout_s)
    await check_persist_after_resume(
        target, checkpoint_root=checkpoint_root, call_timeout_s=call_timeout_s
    )
    async with _connect([target], call_timeout_s) as (conn,):
        attempt = max((await conn.status(RESTORE)).attempt, captured) + 1
    await check_restore_all_or_nothing(
        [target],
        checkpoint_root=checkpoint_root,
        checkpoint_id=cid,
        attempt=attempt,
        call_timeout_s=call_timeout_s,
    )
    await check_lease_auto_resume(
        target,
        lease_grace_seconds=lease_grace_seconds,
        margin_s=lease_margin_s,
        call_timeout_s=call_timeout_s,
    )
