"""Scenarios `phases.replay`, `phases.resume-idle`, `ids.stale` and `ids.conflicting`: the phase
machine seen from outside (prepare, commit, restore replayed byte for byte; resume from any
phase back to idle), a resumed id refused as stale, a second id while one is open refused as
conflicting.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread
from pydantic import BaseModel

from .._wire import (
    CommitReply,
    CommitRequest,
    ErrorCode,
    Phase,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
)
from .calls import (
    Target,
    _Conn,
    _connect,
    _expect,
    _expect_idle,
    _named_for,
    _new_id,
    _ok,
    _prepared,
    _refused,
    _resume,
)
from .report import CONFLICTING, PHASES_REPLAY, PHASES_RESUME, STALE


async def check_phases(target: Target, *, call_timeout_s: float = 10.0) -> tuple[str, int]:
    """`phases.replay`, `phases.resume-idle` (and the restore half of `ids.stale`).

    prepare -> prepared, a retried prepare is replayed; renew keeps the phase; commit ->
    committed, a retried commit and a late prepare are replayed; resume -> idle. Then the
    committed checkpoint is restored under the next attempt (replayed on retry), resumed, and a
    restore of the same (id, attempt) is stale. Returns (checkpoint id, attempt it captured).
    """
    async with _connect([target], call_timeout_s) as (conn,):
        before = await _expect_idle(conn, PHASES_REPLAY, "before the check")
        cid = _new_id("phases")
        committed = await _commit_replayed(conn, cid)
        await _resume(conn, PHASES_RESUME, cid)
        await _expect_idle(conn, PHASES_RESUME, f"after the resume of committed {cid}")
        attempt = max(before.attempt, committed.manifest.attempt) + 1
        await _restore_replayed(conn, cid, committed, attempt)
        await _resume(conn, PHASES_RESUME, cid)
        await _expect_idle(conn, PHASES_RESUME, f"after the resume of restored {cid}")
        await _refused(
            STALE,
            f"a restore of {cid} under attempt {attempt} after it was restored and resumed",
            conn.participant.restore(_restore_request(conn, cid, committed, attempt)),
            ErrorCode.STALE_CHECKPOINT,
        )
        return cid, committed.manifest.attempt


async def _commit_replayed(conn: _Conn, cid: str) -> CommitReply:
    """Prepare, a retried prepare, renew, commit, a retried commit and a late prepare: each
    retry answered as the first call was, the phase prepared then committed."""
    p = conn.participant
    first = await _prepared(conn, PHASES_REPLAY, cid, conn.deadline())
    await _phase_is(conn, PHASES_REPLAY, Phase.PREPARED, cid, "after a ready prepare")
    await _replayed(
        f"a retried prepare of {cid}",
        p.prepare(PrepareRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
        first,
    )
    renewed = await _ok(
        PHASES_REPLAY,
        f"renew of {cid}",
        p.renew(RenewRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
    )
    _expect(
        PHASES_REPLAY,
        renewed.phase is Phase.PREPARED,
        f"renew of {cid} must keep phase prepared",
        renewed.phase.value,
    )
    commit = CommitRequest(checkpoint_id=cid, deadline_ts=conn.deadline())
    committed = await _ok(PHASES_REPLAY, f"commit of {cid}", p.commit(commit))
    _expect(
        PHASES_REPLAY,
        committed.phase is Phase.COMMITTED,
        f"commit of {cid} must answer phase committed",
        committed.phase.value,
    )
    await _phase_is(conn, PHASES_REPLAY, Phase.COMMITTED, cid, "after a commit")
    await _replayed(
        f"a retried commit of {cid}",
        p.commit(CommitRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
        committed,
    )
    await _replayed(
        f"a late retried prepare of {cid} (after its commit)",
        p.prepare(PrepareRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
        first,
    )
    return committed


def _restore_request(conn: _Conn, cid: str, committed: CommitReply, attempt: int) -> RestoreRequest:
    """A restore of the committed checkpoint under `attempt`, naming the rollouts the commit
    listed (a Gym participant's restore names them; ours: None)."""
    return RestoreRequest(
        checkpoint_id=cid,
        attempt=attempt,
        rollout_ids=committed.rollout_ids,
        deadline_ts=conn.deadline(),
    )


async def _restore_replayed(conn: _Conn, cid: str, committed: CommitReply, attempt: int) -> None:
    """The committed checkpoint restored under `attempt` with all its records, phase restored,
    and a retried restore answered as the first."""
    p = conn.participant
    restore = _restore_request(conn, cid, committed, attempt)
    restored = await _ok(
        PHASES_REPLAY, f"restore of {cid} under attempt {attempt}", p.restore(restore)
    )
    _expect(
        PHASES_REPLAY,
        restored.phase is Phase.RESTORED
        and restored.record_count == committed.manifest.record_count,
        f"restore of {cid} must answer phase restored with the "
        f"{committed.manifest.record_count} committed records",
        f"phase {restored.phase.value}, {restored.record_count} records",
    )
    await _phase_is(conn, PHASES_REPLAY, Phase.RESTORED, cid, "after a restore")
    await _replayed(
        f"a retried restore of {cid}",
        p.restore(_restore_request(conn, cid, committed, attempt)),
        restored,
    )


async def _phase_is(conn: _Conn, rule: str, phase: Phase, cid: str, when: str) -> None:
    status = await conn.status(rule)
    _expect(
        rule,
        status.phase is phase and status.checkpoint_id == cid,
        f"/status must show phase {phase.value} of {cid} {when}",
        f"phase {status.phase.value}, checkpoint {status.checkpoint_id!r}",
    )


async def _replayed(what: str, call: Awaitable[BaseModel], first: BaseModel) -> None:
    again = await _ok(PHASES_REPLAY, what, call)
    _expect(
        PHASES_REPLAY,
        first == again,
        f"{what} must replay the first reply {first.model_dump_json()}",
        again.model_dump_json(),
    )


_Call = Callable[[], Awaitable[BaseModel]]


def _calls_with(
    conn: _Conn, checkpoint_id: str, names: Sequence[str], *, attempt: int = 0
) -> list[tuple[str, _Call]]:
    """Control calls naming `checkpoint_id` (made when called, each with a fresh deadline)."""
    p = conn.participant
    named = _named_for(conn)
    every: dict[str, _Call] = {
        "prepare": lambda: p.prepare(
            PrepareRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "renew": lambda: p.renew(
            RenewRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "commit": lambda: p.commit(
            CommitRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "resume": lambda: p.resume(
            ResumeRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "restore": lambda: p.restore(
            RestoreRequest(
                checkpoint_id=checkpoint_id,
                attempt=attempt,
                rollout_ids=named,
                deadline_ts=conn.deadline(),
            )
        ),
    }
    return [(name, every[name]) for name in names]


async def check_stale_ids(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`ids.stale`: after a resume, prepare, renew and commit of that id are stale; a resume of
    an id never prepared (an abort that overtook its prepare) makes a later prepare stale."""
    async with _connect([target], call_timeout_s) as (conn,):
        p = conn.participant
        await _expect_idle(conn, STALE, "before the check")
        cid = _new_id("stale")
        await _prepared(conn, STALE, cid, conn.deadline())
        await _resume(conn, PHASES_RESUME, cid)
        calls = _calls_with(conn, cid, ("prepare", "renew", "commit"))
        for name, call in calls:
            await _refused(STALE, f"{name} of resumed {cid}", call(), ErrorCode.STALE_CHECKPOINT)
        await _expect_idle(conn, STALE, f"after calls with stale {cid}")
        aborted = _new_id("aborted")
        await _resume(conn, STALE, aborted)
        await _refused(
            STALE,
            f"prepare of {aborted}, resumed before it was ever prepared",
            p.prepare(PrepareRequest(checkpoint_id=aborted, deadline_ts=conn.deadline())),
            ErrorCode.STALE_CHECKPOINT,
        )
        await _expect_idle(conn, STALE, f"after a prepare of stale {aborted}")


async def check_conflicting_ids(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`ids.conflicting`: while checkpoint A is open, prepare, resume and restore of B are
    refused with conflicting_checkpoint, and A stays open."""
    async with _connect([target], call_timeout_s) as (conn,):
        status = await _expect_idle(conn, CONFLICTING, "before the check")
        open_id, other = _new_id("open"), _new_id("other")
        await _prepared(conn, CONFLICTING, open_id, conn.deadline())
        calls = _calls_with(
            conn, other, ("prepare", "resume", "restore"), attempt=status.attempt + 1
        )
        try:
            for name, call in calls:
                await _refused(
                    CONFLICTING,
                    f"{name} of {other} while {open_id} is prepared",
                    call(),
                    ErrorCode.CONFLICTING_CHECKPOINT,
                )
                await _phase_is(
                    conn, CONFLICTING, Phase.PREPARED, open_id, f"after a {name} of {other}"
                )
        finally:
            with anyio.CancelScope(shield=True):
                await _resume(conn, PHASES_RESUME, open_id)
        await _expect_idle(conn, PHASES_RESUME, f"after the resume of {open_id}")
