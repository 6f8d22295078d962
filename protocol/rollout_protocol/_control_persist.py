"""Persist after resume, the participant's side: the records a cut fixed are written by `persist`
after the episodes resumed, dropped by `discard`, or dropped by the participant itself when the
cut's lease lapses (docs/protocol.md, "Persist after resume").

Held apart from the checkpoint operations (`_control_checkpoint.py`), whose commit makes the cut
(`HeldCuts.hold`): a persist runs after the checkpoint closed, beside the episodes and beside
the next checkpoint's prepare, so it never takes the plane's lock. Its write runs in the plane's
background task group, not in the call: a persist call that reaches its deadline answers
`storage_failed` while the write goes on, a retried call waits for the same write, and a write
that ends after everyone gave up (a discard, the lease) removes what it wrote. Whatever ends a
cut releases its bytes (`HeldCuts.end`), and every file a failed or discarded persist wrote is
removed: the manifest is written last, so files without one are never a checkpoint, and none
stays behind.
"""

from __future__ import annotations

import anyio
import anyio.to_thread

from . import _storage as storage
from . import tracing
from ._control_core import PlaneCore, logger, storage_io
from ._control_state import HeldCut
from ._phases import refuse_passed
from ._wire import (
    CommitReply,
    DiscardReply,
    DiscardRequest,
    ErrorCode,
    PersistRequest,
    ProtocolError,
)

_REMOVE_SECONDS = 30.0
"""How long removing what a failed persist wrote may retry (a bucket) when no call waits."""


class PersistOperations:
    """`persist` and `discard` of one plane, and the watchdog of its cuts' leases."""

    def __init__(self, core: PlaneCore) -> None:
        self._core = core

    async def persist(self, request: PersistRequest) -> CommitReply:
        """Write the cut's records and manifest and fsync them; answer the durable reply (and
        replay it to a retried call). A checkpoint committed durably here answers its commit."""
        core, cid = self._core, request.checkpoint_id
        cut = core.cuts.cuts.get(cid)
        if cut is None:
            return _ended(core, cid)
        refuse_passed(request.deadline_ts, core.clock())
        cut.expires_ts = max(
            cut.expires_ts, request.deadline_ts + core.settings.lease_grace_seconds
        )
        core.cuts.changed.set()
        if not cut.writing:
            cut.writing = True
            if core.background is not None:
                core.background.start_soon(self._write, cut)
            else:  # a plane not running (no task group): the call writes itself
                await self._write(cut)
        with anyio.move_on_after(max(0.0, request.deadline_ts - core.clock())):
            await cut.done.wait()
        outcome = cut.outcome
        if outcome is None:
            raise ProtocolError(
                ErrorCode.STORAGE_FAILED,
                f"the records of checkpoint {cid!r} were still being written at the call's "
                "deadline; ask again with a later deadline, or discard the checkpoint",
            )
        if isinstance(outcome, ProtocolError):
            raise ProtocolError(outcome.code, outcome.detail)
        return outcome

    async def _write(self, cut: HeldCut) -> None:
        """The persist's write, in a worker thread; ends the cut whatever happens."""
        core, cid = self._core, cut.checkpoint_id
        encoded = cut.encoded
        assert encoded is not None, "a cut is written once, while it holds its records"
        manifest = cut.reply.manifest
        settings = core.settings
        outcome: CommitReply | ProtocolError = ProtocolError(
            ErrorCode.STALE_CHECKPOINT,
            f"the persist of checkpoint {cid!r} was stopped with its participant's control plane",
        )
        try:
            with tracing.span("write") as span:
                span.set_attribute("rollout.records", manifest.record_count)
                # a bucket retries until the cut's lease, past which it is discarded anyway
                store = core.require_store("persist", cut.expires_ts)
                written = await anyio.to_thread.run_sync(
                    lambda: store.write_records(
                        settings.storage_dir,
                        cid,
                        settings.instance,
                        role=manifest.role,
                        attempt=manifest.attempt,
                        encoded=encoded,
                    ),
                    abandon_on_cancel=True,
                )
            if written != manifest:  # the same records give the same manifest
                raise storage.RecordsInvalid(
                    f"the records written for {cid} have manifest {written.records_sha256}, "
                    f"not the {manifest.records_sha256} the cut answered"
                )
            outcome = cut.reply.model_copy(update={"durable": True})
        except ProtocolError as error:  # no storage for records
            outcome = error
        except (storage.StorageError, storage.UnsafePath, storage.RecordsInvalid) as error:
            logger.error("%s: persist of %s failed: %s", core.settings.instance, cid, error)
            outcome = ProtocolError(ErrorCode.STORAGE_FAILED, str(error))
        except Exception as error:  # a bug, not storage: the plane's other tasks go on
            logger.exception("%s: persist of %s failed", core.settings.instance, cid)
            outcome = ProtocolError(
                ErrorCode.INTERNAL, f"persist failed: {type(error).__name__}: {error}"
            )
        finally:
            if cut.abandoned:
                outcome = _discarded(cid)
            if not isinstance(outcome, CommitReply):
                with anyio.CancelScope(shield=True):
                    await self._remove_files(cut)
            core.cuts.end(cut, outcome)

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        """Release a cut's records and remove what a persist of it wrote here (waiting, until
        the call's deadline, for a write still running to end). A checkpoint whose cut ended
        already, or that this process never cut (it restarted), has its files here removed:
        the caller discards only checkpoints it will not publish."""
        core, cid = self._core, request.checkpoint_id
        refuse_passed(request.deadline_ts, core.clock())
        cut = core.cuts.cuts.get(cid)
        if cut is not None and cut.writing:
            cut.abandoned = True
            with anyio.move_on_after(max(0.0, request.deadline_ts - core.clock())):
                await cut.done.wait()
            if not cut.done.is_set():
                raise ProtocolError(
                    ErrorCode.STORAGE_FAILED,
                    f"the records of checkpoint {cid!r} are still being written; they are "
                    "released and removed when the write ends",
                )
            return DiscardReply(checkpoint_id=cid, discarded=True, removed=True)
        if cut is not None:
            core.cuts.end(cut, _discarded(cid))
        else:
            core.cuts.remember(cid, _discarded(cid))
        removed = await self._remove_instance_files(cid, request.deadline_ts)
        logger.info(
            "%s: discarded checkpoint %s (held: %s, files removed: %s)",
            core.settings.instance,
            cid,
            cut is not None,
            removed,
        )
        return DiscardReply(checkpoint_id=cid, discarded=cut is not None, removed=removed)

    async def watchdog(self) -> None:
        """Discard, by the participant itself, every cut whose lease lapsed: a coordinator that
        stopped never leaves records held (a write still running is abandoned: its files are
        removed when it ends)."""
        core = self._core
        while True:
            changed = core.cuts.changed = anyio.Event()
            waiting = [c for c in core.cuts.cuts.values() if not c.abandoned]
            if not waiting:
                await changed.wait()
                continue
            first = min(waiting, key=lambda cut: cut.expires_ts)
            with anyio.move_on_after(max(0.0, first.expires_ts - core.clock())):
                await changed.wait()
            if changed.is_set() or first.expires_ts > core.clock():
                continue
            logger.warning(
                "%s: the lease of checkpoint %s lapsed before its persist ended; its records "
                "are released (the coordinator stopped)",
                core.settings.instance,
                first.checkpoint_id,
            )
            if first.writing:
                first.abandoned = True
            else:
                core.cuts.end(first, _discarded(first.checkpoint_id, "its lease lapsed"))
                with anyio.CancelScope(shield=True):
                    await self._remove_files(first)

    async def _remove_files(self, cut: HeldCut) -> None:
        """Remove what a persist of `cut` wrote (its instance folder's own files), logging a
        failure: a failed removal leaves files without a manifest, which no restore reads."""
        try:
            await self._remove_instance_files(cut.checkpoint_id, None)
        except ProtocolError as error:
            logger.error(
                "%s: removing the files of checkpoint %s failed: %s",
                self._core.settings.instance,
                cut.checkpoint_id,
                error.detail,
            )

    async def _remove_instance_files(self, checkpoint_id: str, deadline_ts: float | None) -> bool:
        """Remove this instance's files of a checkpoint (bounded by `deadline_ts` when given):
        whether any were there. A restore of the checkpoint is refused meanwhile."""
        core = self._core
        store = core.settings.records_store(
            deadline_ts if deadline_ts is not None else core.clock() + _REMOVE_SECONDS
        )
        if store is None:
            return False
        set_dir, instance = core.settings.storage_dir, core.settings.instance
        claim = core.removals.claim([checkpoint_id], whole_set=False)

        def remove() -> bool:
            if not core.removals.begin(claim):
                return False
            try:
                return store.remove_instance(set_dir, checkpoint_id, instance)
            finally:
                core.removals.end(claim)

        try:
            if deadline_ts is None:
                return await anyio.to_thread.run_sync(remove)
            with core.storage_deadline("discard", deadline_ts, store):
                return await storage_io(remove)
        except (storage.StorageError, storage.UnsafePath) as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        finally:
            core.removals.abandon(claim)


def _ended(core: PlaneCore, checkpoint_id: str) -> CommitReply:
    """What a persist of a checkpoint no longer held answers: its durable reply, or its end."""
    ended = core.cuts.ended.get(checkpoint_id)
    if isinstance(ended, CommitReply):
        return ended
    if isinstance(ended, ProtocolError):
        raise ProtocolError(ended.code, ended.detail)
    raise ProtocolError(
        ErrorCode.UNKNOWN_CHECKPOINT,
        f"no records of checkpoint {checkpoint_id!r} are held here: it was not cut by this "
        "process (which may have restarted since), so it cannot be persisted",
    )


def _discarded(checkpoint_id: str, why: str = "it was discarded") -> ProtocolError:
    return ProtocolError(
        ErrorCode.STALE_CHECKPOINT,
        f"the records of checkpoint {checkpoint_id!r} were released before they were durable "
        f"({why}); it cannot be persisted",
    )
