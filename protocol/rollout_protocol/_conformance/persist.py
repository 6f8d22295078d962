"""Scenarios `persist.durable-unchanged` and `persist.discard`: the capability
`persist_after_resume` seen from outside (docs/protocol.md, "Persist after resume"). A
participant that announces it answers a cut with the manifest its persist will write; after the
resume the persist makes exactly those records durable, and a discarded cut is gone.

The records a persist writes must verify against the manifest the cut answered before the
resume: that manifest fixes their digest (of every record's digest), count and size, so a file
that verifies against it holds the records as they were at the cut and nothing an episode did
after it.
"""

from __future__ import annotations

from pathlib import Path

import anyio.to_thread

from .. import _storage as storage
from .._wire import (
    Capability,
    CommitReply,
    CommitRequest,
    DiscardRequest,
    ErrorCode,
    PersistRequest,
    Phase,
)
from .calls import Target, _Conn, _connect, _expect, _expect_idle, _new_id, _ok, _prepared, _refused
from .calls import _resume as _resumed
from .report import PERSIST_DISCARD, PERSIST_DURABLE, ConformanceError


async def check_persist_after_resume(
    target: Target, *, checkpoint_root: Path, call_timeout_s: float = 10.0
) -> bool:
    """`persist.durable-unchanged` and `persist.discard`, on a participant that announces the
    capability in its status (`capabilities`); False, checking nothing, on one that does not
    (it is committed the old way, which the phases check covers)."""
    async with _connect([target], call_timeout_s) as (conn,):
        status = await _expect_idle(conn, PERSIST_DURABLE, "before the check")
        if Capability.PERSIST_AFTER_RESUME not in status.capabilities:
            return False
        cid = _new_id("persist")
        cut = await _cut(conn, cid)
        await _resumed(conn, PERSIST_DURABLE, cid)
        persist = PersistRequest(checkpoint_id=cid, deadline_ts=conn.deadline())
        durable = await _ok(PERSIST_DURABLE, f"persist of {cid}", conn.participant.persist(persist))
        _expect(
            PERSIST_DURABLE,
            durable.durable and durable.manifest == cut.manifest,
            f"persist of {cid} must answer durable with the manifest its cut answered",
            f"durable={durable.durable}, manifest {durable.manifest.model_dump_json()}",
        )
        await _verify_on_storage(checkpoint_root, cut)
        again = await _ok(
            PERSIST_DURABLE,
            f"a retried persist of {cid}",
            conn.participant.persist(persist.model_copy(update={"deadline_ts": conn.deadline()})),
        )
        _expect(
            PERSIST_DURABLE,
            again == durable,
            f"a retried persist of {cid} must answer the first reply again",
            again.model_dump_json(),
        )
        await _check_discard(conn, checkpoint_root)
        return True


async def _cut(conn: _Conn, cid: str) -> CommitReply:
    """Prepare and a commit asking for the cut: answered not durable, phase committed."""
    await _prepared(conn, PERSIST_DURABLE, cid, conn.deadline())
    commit = CommitRequest(
        checkpoint_id=cid, deadline_ts=conn.deadline(), persist_after_resume=True
    )
    cut = await _ok(PERSIST_DURABLE, f"the cut of {cid}", conn.participant.commit(commit))
    _expect(
        PERSIST_DURABLE,
        not cut.durable and cut.phase is Phase.COMMITTED,
        f"a commit of {cid} asking for the cut must answer durable false, phase committed "
        "(it announced persist_after_resume)",
        f"durable={cut.durable}, phase {cut.phase.value}",
    )
    return cut


async def _verify_on_storage(checkpoint_root: Path, cut: CommitReply) -> None:
    """The manifest and records at the cut's `manifest_path` verify, and are the cut's."""
    directory = (checkpoint_root / cut.manifest_path).parent
    try:
        manifest, _ = await anyio.to_thread.run_sync(
            lambda: storage.read_records(directory, expect_checkpoint_id=cut.checkpoint_id)
        )
    except (storage.RecordsInvalid, storage.StorageError) as error:
        raise _durable_failed(cut, f"its records do not verify: {error}") from error
    _expect(
        PERSIST_DURABLE,
        manifest == cut.manifest,
        f"the manifest at {cut.manifest_path} after the persist must be the one the cut "
        "answered (records as they were at the cut, nothing after it)",
        manifest.model_dump_json(),
    )


def _durable_failed(cut: CommitReply, observed: str) -> ConformanceError:
    return ConformanceError(
        PERSIST_DURABLE,
        f"after the persist of {cut.checkpoint_id} its records must be on storage at "
        f"{cut.manifest_path}",
        observed,
    )


async def _check_discard(conn: _Conn, checkpoint_root: Path) -> None:
    """A second cut, resumed and discarded: released (a persist is refused stale) and gone."""
    cid = _new_id("discard")
    cut = await _cut(conn, cid)
    await _resumed(conn, PERSIST_DISCARD, cid)
    discard = DiscardRequest(checkpoint_id=cid, deadline_ts=conn.deadline())
    reply = await _ok(PERSIST_DISCARD, f"discard of {cid}", conn.participant.discard(discard))
    _expect(
        PERSIST_DISCARD,
        reply.discarded,
        f"discard of {cid} must say the cut's records were held and are released",
        reply.model_dump_json(),
    )
    await _refused(
        PERSIST_DISCARD,
        f"a persist of discarded {cid}",
        conn.participant.persist(PersistRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
        ErrorCode.STALE_CHECKPOINT,
    )
    manifest = checkpoint_root / cut.manifest_path
    _expect(
        PERSIST_DISCARD,
        not manifest.exists(),
        f"after the discard of {cid} no manifest of it may exist",
        f"{manifest} exists",
    )
