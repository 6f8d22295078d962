"""A control plane's operations that let go of work and records: retire (an attempt's rollouts
never run here again), forget (drop their retire marks) and remove (checkpoints' records from
this participant's own set directory).

Held apart from `ControlPlane` (`_control.py`), which owns one `RetireOperations` and
delegates its public `retire`, `forget` and `remove` to it. Retire and forget are replayed by
their `operation_id` (the last `REMEMBERED` replies are kept here); remove claims the
checkpoints it deletes (`RemovalClaims`) so that no prepare or restore opens them meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict

import anyio

from . import _storage as storage
from ._control_core import PlaneCore, logger, storage_io
from ._phases import REMEMBERED, refuse_passed
from ._wire import (
    MAX_FINISHED_LISTED,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    Phase,
    ProtocolError,
    RemoveReply,
    RemoveRequest,
    RetireReply,
    RetireRequest,
)


class RetireOperations:
    """Retire, forget and remove of one plane, and the replies kept for replay."""

    def __init__(self, core: PlaneCore) -> None:
        self._core = core
        self._operations: OrderedDict[str, RetireReply | ForgetReply] = OrderedDict()

    async def retire(self, request: RetireRequest) -> RetireReply:
        core = self._core
        async with core.lock:
            cached = self._operations.get(request.operation_id)
            if isinstance(cached, RetireReply):
                return cached
            self._refuse_reused_operation(request.operation_id, cached)
            core.machine.check_retire()
            refuse_passed(request.deadline_ts, core.clock())
            scope = None if request.rollout_ids is None else frozenset(request.rollout_ids)
            core.marks.room(request.attempt, scope)
            # Marks first: work of this attempt that arrives while we wait is refused already.
            core.marks.add(request.attempt, scope)
            try:
                with anyio.fail_after(max(0.0, request.deadline_ts - core.clock())):
                    retired = await core.participant.retire(request.attempt, scope)
            except TimeoutError:
                raise ProtocolError(
                    ErrorCode.DEADLINE_PASSED,
                    f"retire of attempt {request.attempt} did not finish by its deadline; "
                    "retry with the same operation_id",
                ) from None
            # After the retire: an episode in its final cleanup finishes while the retire waits
            # for it (its result reaches the trainer, whose work is not lost).
            finished = self._finished_rollouts(request.attempt)
            told = None if request.finished is None else frozenset(request.finished)
            lost = core.work("lost_work", lambda: core.participant.lost_work(request.attempt, told))
            reply = RetireReply(
                operation_id=request.operation_id,
                retired=retired,
                lost=lost,
                lost_since=core.work_since if lost is not None else None,
                finished=finished,
            )
            self._remember(request.operation_id, reply)
            return reply

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        core = self._core
        async with core.lock:
            cached = self._operations.get(request.operation_id)
            if isinstance(cached, ForgetReply):
                return cached
            self._refuse_reused_operation(request.operation_id, cached)
            ids = frozenset(request.rollout_ids)
            dropped = core.marks.forget(ids)
            try:
                core.participant.forget(ids)
            except Exception as error:
                logger.exception("%s: forget failed", core.settings.instance)
                raise ProtocolError(
                    ErrorCode.INTERNAL, f"forget failed: {type(error).__name__}: {error}"
                ) from error
            reply = ForgetReply(operation_id=request.operation_id, forgotten=dropped)
            self._remember(request.operation_id, reply)
            return reply

    async def remove(self, request: RemoveRequest) -> RemoveReply:
        """See `ControlPlane.remove`: checked and claimed under the lock, deleted outside it."""
        core = self._core
        refuse_passed(request.deadline_ts, core.clock())
        store = core.require_store("remove", request.deadline_ts)
        async with core.lock:
            machine = core.machine
            open_id = machine.checkpoint_id if machine.phase is not Phase.IDLE else None
            if open_id is not None and (request.whole_set or open_id in request.checkpoint_ids):
                raise ProtocolError(
                    ErrorCode.CONFLICTING_CHECKPOINT,
                    f"checkpoint {open_id} is open ({machine.phase.value}); its records "
                    "cannot be removed until it closes",
                )
            held = [
                cid for cid in core.cuts.cuts if request.whole_set or cid in request.checkpoint_ids
            ]
            if held:
                raise ProtocolError(
                    ErrorCode.CONFLICTING_CHECKPOINT,
                    f"the records of checkpoint {held[0]} are held for a persist here; discard "
                    "it (or let its persist end) before removing them",
                )
            claim = core.removals.claim(request.checkpoint_ids, whole_set=request.whole_set)
        set_dir = core.settings.storage_dir

        def remove_all() -> RemoveReply | None:
            if not core.removals.begin(claim):
                return None  # the call gave up before this thread began: delete nothing
            try:
                return store.remove_records(
                    set_dir, request.checkpoint_ids, whole_set=request.whole_set
                )
            finally:
                core.removals.end(claim)

        try:
            with core.storage_deadline("remove", request.deadline_ts, store):
                reply = await storage_io(remove_all)
        except storage.StorageError as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        except storage.UnsafePath as error:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(error)) from error
        finally:
            core.removals.abandon(claim)
        assert reply is not None, "the worker thread ran: it began before the call returned"
        logger.info(
            "%s: removed records of %s (absent: %s, kept: %d)",
            core.settings.instance,
            reply.removed or "nothing",
            reply.absent or "none",
            reply.kept_count,
        )
        return reply

    def _finished_rollouts(self, attempt: int) -> list[str] | None:
        core = self._core
        try:
            finished = core.participant.finished_rollouts(attempt)
        except Exception:
            logger.exception("%s: work accounting (finished) failed", core.settings.instance)
            return None
        if finished is None or len(finished) > MAX_FINISHED_LISTED:
            return None
        return sorted(set(finished))

    @staticmethod
    def _refuse_reused_operation(
        operation_id: str, cached: RetireReply | ForgetReply | None
    ) -> None:
        if cached is not None:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"operation_id {operation_id!r} was already used for another operation",
            )

    def _remember(self, operation_id: str, reply: RetireReply | ForgetReply) -> None:
        memory = self._operations
        memory[operation_id] = reply
        while len(memory) > REMEMBERED:
            memory.popitem(last=False)
