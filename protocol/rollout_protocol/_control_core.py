"""The state that the control plane's concerns share, and the guarded calls they all make.

`ControlPlane` (`_control.py`) owns one `PlaneCore` and hands it to each of its parts: the
checkpoint operations (`_control_checkpoint.py`), restore and standby identity
(`_control_restore.py`), retire, forget and remove (`_control_retire.py`). One object holds who
this participant is (its settings and attempt), its phase machine and lease, the lock every
control operation takes, its retire marks, removal claims and held cuts: a standby's identity a
restore takes, or an attempt it installs, is then seen at once by every route and by `/status`.

Calls into the participant are guarded here (an exception becomes `internal`, the work
accounting never fails a call), and storage I/O under the lock is bounded by the request's
deadline (`storage_deadline`, `storage_io`): storage that hangs (a stale network mount) fails
that call at its deadline and frees the lock, instead of holding every later control call
behind it.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from . import _storage as storage
from ._control_state import CollectorHold, HeldCuts, RemovalClaims, RetireMarks
from ._objectstore import BucketError, BucketStore
from ._participant import Participant
from ._phases import PhaseMachine
from ._settings import S3_ENV_PREFIX, ControlSettings
from ._wire import ErrorCode, ProtocolError, Record

logger = logging.getLogger(f"{__package__}._control")
"""The plane's one logger (`rollout_protocol._control`), whichever of its parts logs."""

_T = TypeVar("_T")


class PlaneCore:
    """What every part of one control plane reads and changes, under `lock`."""

    def __init__(
        self,
        participant: Participant,
        settings: ControlSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.participant = participant
        self.settings = settings
        """This participant's settings; a restore that adopts a standby replaces them."""
        self.clock = clock
        self.attempt = settings.attempt
        self.machine = PhaseMachine()
        self.marks = RetireMarks(settings.max_retire_marks)
        self.marks.settle(self.attempt)
        self.work_since: str | None = None
        """The last checkpoint this process committed or restored: lost work counts from it."""
        self.lock = anyio.Lock()
        self.lease_changed = anyio.Event()
        self.background: TaskGroup | None = None
        """The plane's task group while it runs (`ControlPlane.running`)."""
        self.removals = RemovalClaims()
        self.collector = CollectorHold()
        self.cuts = HeldCuts(settings.max_held_bytes)
        """Records held by cuts until their persist (`_control_persist.py`)."""

    def extend_lease(self, deadline_ts: float) -> None:
        self.machine.extend_lease(deadline_ts + self.settings.lease_grace_seconds)
        self.lease_changed.set()

    def refuse_removing(self, checkpoint_id: str) -> None:
        """A checkpoint whose records a removal is deleting is not opened (see
        `ControlPlane.remove`)."""
        if self.removals.covers(checkpoint_id):
            raise ProtocolError(
                ErrorCode.CONFLICTING_CHECKPOINT,
                f"the records of checkpoint {checkpoint_id!r} are being removed here; it cannot "
                "be prepared or restored until that removal has ended",
            )

    async def call(self, what: str, call: Awaitable[None]) -> None:
        try:
            await call
        except Exception as error:
            logger.exception("%s: %s failed", self.settings.instance, what)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"{what} failed: {type(error).__name__}: {error}"
            ) from error

    def checkpointed(self, checkpoint_id: str, records: Sequence[Record]) -> None:
        """Lost work counts from this checkpoint on (the participant's accounting never fails
        a protocol call: an error is logged and counts nothing)."""
        self.work_since = checkpoint_id
        try:
            self.participant.checkpointed(checkpoint_id, records)
        except Exception:
            logger.exception("%s: work accounting (checkpointed) failed", self.settings.instance)

    def work(self, what: str, count: Callable[[], dict[str, int] | None]) -> dict[str, int] | None:
        """A participant's work counts, or None when it counts nothing or its counting failed."""
        try:
            counts = count()
        except Exception:
            logger.exception("%s: work accounting (%s) failed", self.settings.instance, what)
            return None
        if counts is None:
            return None
        return {name: max(0, int(amount)) for name, amount in counts.items()}

    def require_store(self, operation: str, deadline_ts: float) -> storage.RecordsStore:
        """Where records go for a call ending at `deadline_ts`: the set's bucket or volume."""
        store = self.settings.records_store(deadline_ts)
        if store is None:
            raise ProtocolError(
                ErrorCode.STORAGE_FAILED,
                f"{operation} needs storage for records: set ROLLOUT_CHECKPOINT_ROOT (a volume) "
                f"or the {S3_ENV_PREFIX}* variables (a bucket)",
            )
        return store

    @contextmanager
    def storage_deadline(
        self, operation: str, deadline_ts: float, store: storage.RecordsStore
    ) -> Iterator[None]:
        """Bound the storage I/O of a call holding the lock by the call's deadline: past it the
        call fails (`storage_failed`, saying what the bucket's tries met so far), the lock is
        freed, and the worker thread is left to finish on its own (its result is dropped)."""
        try:
            with anyio.fail_after(max(0.0, deadline_ts - self.clock())):
                yield
        except TimeoutError:
            logger.error(
                "%s: %s: storage did not answer by the deadline", self.settings.instance, operation
            )
            if isinstance(store, BucketStore):
                reason, seen = store.seen_so_far()
                outcome = "had no success" if seen else "did not answer"
                raise BucketError(
                    reason,
                    f"{operation}: bucket {store.where} {outcome} by the call's deadline{seen}",
                ) from None
            raise storage.StorageError(
                f"{operation}: storage did not answer by the call's deadline at",
                self.settings.checkpoint_root or Path("."),
                OSError(errno.ETIMEDOUT, "storage I/O still running at the deadline"),
            ) from None


async def storage_io(call: Callable[[], _T]) -> _T:
    """Run blocking storage I/O in a worker thread that a deadline can abandon."""
    return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)


def manifest_location(set_dir: str, checkpoint_id: str, instance: str) -> str:
    """Where an instance's manifest is below the store's root; a name that is not a plain
    name is the request's fault (`invalid_request`)."""
    try:
        return storage.manifest_path(set_dir, checkpoint_id, instance)
    except storage.UnsafePath as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(error)) from error
