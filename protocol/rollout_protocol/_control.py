"""The checkpoint control plane every rollout server mounts under `/checkpoint/v1` (and, where
its settings say so, in NeMo Gym's dialect under `/ng-control/v1`, mapped by `_gym`).

It owns everything that must behave the same in every server: authentication, the phase
machine, reply replay, the lease and its watchdog, storage, and retire marks. A server only
supplies a `Participant` (how to park, what to record, how to install and stop work).

Control operations are serialized by one lock: they are rare, and a strict order is what makes
replayed replies and phase checks trustworthy. `/status` does not take the lock, so it answers
even while a prepare waits for episodes to park. Storage I/O under the lock is bounded by the
request's deadline (`_storage_io`): storage that hangs (a stale network mount) fails that call
at its deadline and frees the lock, instead of holding every later control call behind it.
"""

from __future__ import annotations

import errno
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from starlette.exceptions import HTTPException

from . import _storage as storage
from . import tracing
from ._control_state import CollectorHold, RemovalClaims, RetireMarks
from ._http import (
    BodyLimit,
    BodyTooLarge,
    declare_error_statuses,
    gym_error_response,
    http_error_handler,
    json_reply,
    parse_body,
    protocol_error_handler,
    request_body_schema,
    validation_error_handler,
)
from ._participant import ParkState, Participant, episodes_digest
from ._phases import REMEMBERED, PhaseMachine, RestoreShape, refuse_passed
from ._routes import (
    COMMIT,
    FORGET,
    GYM_CAPABILITIES_PATH,
    PREPARE,
    REMOVE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    ROUTES,
    STATUS,
    Dialect,
    Route,
)
from ._settings import ControlConfigError, ControlSettings
from ._wire import (
    MAX_BLOCKERS_REPORTED,
    MAX_FINISHED_LISTED,
    CommitReply,
    CommitRequest,
    EpisodeId,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
    Record,
    RemoveReply,
    RemoveRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
    StatusReply,
    instance_name,
)

if TYPE_CHECKING:
    from . import _gym as gym

logger = logging.getLogger(__name__)


_PARK_OVERRUN_SECONDS = 2.0
"""How long past its deadline a participant's `park` may run before the call is failed."""

_T = TypeVar("_T")


@dataclass
class _AheadDirectory:
    """A checkpoint directory being created ahead of its commit (see `_create_directory_ahead`)."""

    checkpoint_id: str
    done: anyio.Event
    path: Path | None = None
    """`<root>/<set_dir>/<checkpoint_id>/<instance>` once made; an abort removes it and its
    checkpoint level."""


class ControlPlane:
    """Mount with `install(app)`; the participant's server keeps running its own routes."""

    def __init__(
        self,
        participant: Participant,
        settings: ControlSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if Role(participant.role) is not settings.role:
            raise ControlConfigError(
                f"participant role {participant.role} does not match settings role {settings.role}"
            )
        if settings.token is None:
            logger.warning(
                "control plane of %s runs WITHOUT authentication (allow_unauthenticated); "
                "anyone who reaches it can pause, restore or retire rollouts",
                settings.instance,
            )
        self._participant = participant
        self._settings = settings
        self._clock = clock
        self._attempt = settings.attempt
        self._machine = PhaseMachine()
        self._marks = RetireMarks(settings.max_retire_marks)
        self._marks.settle(self._attempt)
        self._operations: OrderedDict[str, RetireReply | ForgetReply] = OrderedDict()
        self._work_since: str | None = None
        """The last checkpoint this process committed or restored: lost work counts from it."""
        self._lock = anyio.Lock()
        self._lease_changed = anyio.Event()
        self._watchdog_scope: anyio.CancelScope | None = None
        self._background: TaskGroup | None = None
        self._parking: tuple[str, anyio.CancelScope] | None = None
        self._directory: _AheadDirectory | None = None
        self._removals = RemovalClaims()
        self._collector = CollectorHold()
        self.router = self._build_router()

    # public API -------------------------------------------------------------------------------

    @property
    def settings(self) -> ControlSettings:
        return self._settings

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def phase(self) -> Phase:
        return self._machine.phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._machine.checkpoint_id

    def is_retired(self, attempt: int, rollout_id: str) -> bool:
        return self._marks.covers(attempt, rollout_id)

    def authorize(self, authorization: str | None) -> None:
        """Check an `Authorization` header against the control token (constant time); raise
        `ProtocolError(UNAUTHORIZED)` (401 once the plane is installed) when it does not match.

        For a server's own routes that reveal what only the operator may know, such as the
        rollout ids in `GET /stats?detail=true`. Without a token (allow_unauthenticated) every
        caller passes, as on the control routes."""
        self._authorize(authorization)

    def install(self, app: FastAPI) -> None:
        """Mount the routes and error handlers, and run the lease watchdog with the app.

        Create the app with its own lifespan (if any) before calling this; the watchdog wraps it.
        With `OTEL_EXPORTER_OTLP_ENDPOINT` set, the process exports traces from here on
        (`tracing.configure`, service `rollout-<role>`) unless it set up OpenTelemetry itself.
        """
        tracing.configure(
            f"rollout-{self._settings.role.value}",
            attributes={
                "rollout.instance": self._settings.instance,
                "rollout.set": self._settings.set_name,
            },
        )
        declare_error_statuses(app)
        if self._settings.worker is None:
            app.include_router(self.router)
        else:
            # A worker of a multi-worker pod: the pod's main process owns the control routes
            # and drives this process over the private worker channel (`_workers`).
            from ._workers import worker_router

            app.include_router(worker_router(self))
        app.add_exception_handler(ProtocolError, protocol_error_handler)
        app.add_exception_handler(RequestValidationError, validation_error_handler)
        app.add_exception_handler(HTTPException, http_error_handler)
        app.add_exception_handler(BodyTooLarge, protocol_error_handler)
        app.add_middleware(BodyLimit, max_bytes=self._settings.max_body_bytes)
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(application: Any) -> AsyncIterator[Any]:
            async with self.running(), inner(application) as state:
                yield state

        app.router.lifespan_context = lifespan

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ControlPlane]:
        """Run the lease watchdog for the duration of the block (the app lifespan uses this)."""
        async with anyio.create_task_group() as group:
            self._watchdog_scope = group.cancel_scope
            self._background = group
            group.start_soon(self._watchdog)
            try:
                yield self
            finally:
                group.cancel_scope.cancel()
                self._watchdog_scope = None
                self._background = None
                self._collector.release()

    def follow(self, attempt: int, index: int | None = None, standby: bool = False) -> None:
        """A worker's plane: the pod's plane runs `attempt` (its `/run` checks this one) as
        instance `index`, a standby or not (a standby pod adopted for a lost instance: the
        worker is that instance from then on, in its `settings` and whatever a server reports
        from them; back to the standby when the adoption failed). None: the identity stays."""
        self._attempt = attempt
        self._marks.settle(attempt)
        if index is not None and (index, standby) != (self._settings.index, self._settings.standby):
            self._settings = replace(self._settings, index=index, standby=standby)

    def mark_retired(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        """A worker's plane: the pod's plane retires this; refuse its work from now on."""
        self._marks.room(attempt, rollout_ids)
        self._marks.add(attempt, rollout_ids)

    @property
    def participant(self) -> Participant:
        return self._participant

    async def aclose(self) -> None:
        """Stop the watchdog; an open checkpoint is left as is (its coordinator will resume it).
        The garbage collector is given back: it is process-wide, and this plane no longer
        pauses anything."""
        if self._watchdog_scope is not None:
            self._watchdog_scope.cancel()
        self._collector.release()

    def status(self) -> StatusReply:
        counts = self._participant.counts()
        return StatusReply(
            role=self._settings.role,
            instance=self._settings.instance,
            set_name=self._settings.set_name,
            set_dir=self._settings.set_dir,
            standby=self._settings.standby,
            attempt=self._attempt,
            phase=self._machine.phase,
            checkpoint_id=self._machine.checkpoint_id,
            lease_expires_ts=self._machine.lease_expires_ts,
            live_episodes=counts.live,
            parked_episodes=counts.parked,
            restored_episodes=counts.restored,
            retired_attempts=self._marks.whole_attempts(),
            multi_process=self._settings.multi_process,
            workers=max(self._settings.workers, self._settings.unmanaged_workers),
        )

    # operations -------------------------------------------------------------------------------

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        async with self._lock:
            cid = request.checkpoint_id
            self._refuse_removing(cid)
            cached = self._machine.admit_prepare(cid, request.deadline_ts, self._clock())
            self._extend_lease(request.deadline_ts)
            if cached is not None:
                return cached
            if self._machine.begin_prepare(cid):
                with tracing.span("close admission"):
                    await self._call("close_admission", self._participant.close_admission())
            with tracing.span("park") as parking:
                state = await self._park(cid, request.deadline_ts)
                parking.set_attribute("rollout.parked", len(state.parked))
            listed = frozenset(request.rollout_ids or ())
            reply = PrepareReply(
                checkpoint_id=cid,
                phase=Phase.PREPARED if state.ready else Phase.PREPARING,
                ready=state.ready,
                episodes=[e for e in state.parked if e.rollout_id in listed] if listed else [],
                episode_count=len(state.parked),
                episodes_sha256=state.parked_sha256 or episodes_digest(state.parked),
                blockers=list(state.blockers[:MAX_BLOCKERS_REPORTED]),
                blocker_count=len(state.blockers),
                restarts=list(state.restarts),
            )
            self._machine.end_prepare(reply)
            if state.ready:
                self._collector.hold()
                self._create_directory_ahead(cid)
            else:
                logger.info(
                    "%s: prepare %s not ready at its deadline: %d blockers",
                    self._settings.instance,
                    cid,
                    len(state.blockers),
                )
            return reply

    async def renew(self, request: RenewRequest) -> RenewReply:
        async with self._lock:
            self._machine.admit_renew(request.checkpoint_id, request.deadline_ts, self._clock())
            self._extend_lease(request.deadline_ts)
            expires = self._machine.lease_expires_ts
            assert expires is not None
            return RenewReply(
                checkpoint_id=request.checkpoint_id,
                phase=self._machine.phase,
                lease_expires_ts=expires,
            )

    async def commit(self, request: CommitRequest) -> CommitReply:
        async with self._lock:
            cid = request.checkpoint_id
            cached = self._machine.admit_commit(cid, request.deadline_ts, self._clock())
            self._extend_lease(request.deadline_ts)
            if cached is not None:
                return cached
            root = self._require_root("commit")
            scope = None if request.rollout_ids is None else frozenset(request.rollout_ids)
            excluded = frozenset(request.excluded_rollout_ids or ())
            with tracing.span("encode") as encoding:
                encoded = self._in_scope(self._export(scope), scope)
                if excluded:
                    encoded = [item for item in encoded if item.record.rollout_id not in excluded]
                    if scope is None:
                        # released like state outside an explicit scope: the rollouts left in
                        scope = frozenset(item.record.rollout_id for item in encoded)
                encoding.set_attribute("rollout.records", len(encoded))
            try:
                with tracing.span("write"), self._storage_deadline("commit", request.deadline_ts):
                    directory = await self._commit_directory(root, cid)
                    manifest = await _storage_io(
                        lambda: storage.write_records(
                            directory,
                            role=self._settings.role,
                            instance=self._settings.instance,
                            checkpoint_id=cid,
                            attempt=self._attempt,
                            encoded=encoded,
                        )
                    )
            except storage.StorageError as error:
                logger.error("%s: commit %s failed: %s", self._settings.instance, cid, error)
                raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
            if scope is not None:
                self._participant.release_outside(scope)
            self._checkpointed(cid, [item.record for item in encoded])
            reply = CommitReply(
                checkpoint_id=cid,
                phase=Phase.COMMITTED,
                manifest=manifest,
                manifest_path=str((directory / storage.MANIFEST_NAME).relative_to(root).as_posix()),
                rollout_ids=sorted({item.record.rollout_id for item in encoded}),
            )
            self._machine.end_commit(reply)
            return reply

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        """Verify and install a checkpoint's records under a new attempt.

        A standby's identity is all or nothing (docs/protocol.md, "Restore and replay"): the
        index it is asked to become is checked first, its records are read and verified as that
        instance's without changing anything, and the instance is taken only then; a restore
        that fails after that (close admission, install) gives the old identity back, so a
        failed adoption leaves a standby with its own instance, free for the right restore.
        """
        async with self._lock:
            cid = request.checkpoint_id
            self._refuse_removing(cid)
            asked = self._settings.index if request.index is None else request.index
            shape = RestoreShape.of(request, instance_name(self._settings.role, asked))
            cached = self._machine.admit_restore(
                cid, request.attempt, request.deadline_ts, self._clock(), shape
            )
            if cached is not None:
                self._extend_lease(request.deadline_ts)
                return cached
            index = self._adopted_index(request.index)
            instance = shape.instance
            if request.attempt < self._attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH,
                    f"restore under attempt {request.attempt}, but this process already runs "
                    f"attempt {self._attempt}",
                )
            if self._marks.covers_attempt(request.attempt):
                raise ProtocolError(
                    ErrorCode.ATTEMPT_RETIRED,
                    f"attempt {request.attempt} was retired here; restore under a newer attempt",
                )
            with tracing.span("verify"):
                records = await self._verified_records(request, instance)
            was = self._settings
            self._take_identity(index)
            try:
                restored = await self._install(request, records, was)
            except BaseException:
                self._give_identity_back(was)
                raise
            self._attempt = request.attempt
            self._marks.settle(request.attempt)
            self._checkpointed(cid, records)
            reply = RestoreReply(
                checkpoint_id=cid,
                phase=Phase.RESTORED,
                attempt=request.attempt,
                restored=restored,
                record_count=len(records),
                kept=self._work("kept_work", lambda: self._participant.kept_work(records)),
            )
            self._machine.end_restore(request.attempt, reply, shape)
            return reply

    async def _install(
        self, request: RestoreRequest, records: list[Record], was: ControlSettings
    ) -> list[EpisodeId]:
        """Re-wire, close admission and install verified records (restore's effect). A failed
        install gives the identity back (`was`) before the participant reopens: a pod of
        several workers sends its identity with the reopen, and its workers follow it."""
        if request.peers is not None:
            self._rewire(request.peers)
        self._extend_lease(request.deadline_ts)
        await self._call("close_admission", self._participant.close_admission())
        try:
            with tracing.span("install", attributes={"rollout.records": len(records)}):
                return await self._participant.install(records, request.attempt)
        except Exception as error:
            logger.exception("%s: install failed", self._settings.instance)
            self._give_identity_back(was)
            await self._call("reopen", self._participant.reopen())
            self._machine.lease_expires_ts = None
            raise ProtocolError(
                ErrorCode.INTERNAL, f"install failed: {type(error).__name__}: {error}"
            ) from error

    def _adopted_index(self, index: int | None) -> int | None:
        """The index a restore gives this participant: None (it stays what it is), or the one
        it names, which only a standby may take. Changes nothing; a non-standby named another
        index is refused here, before any I/O."""
        if index is None or (index == self._settings.index and not self._settings.standby):
            return None
        if not self._settings.standby:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"{self._settings.instance} is not a standby: it cannot become "
                f"{instance_name(self._settings.role, index)}",
            )
        return index

    def _take_identity(self, index: int | None) -> None:
        """A standby becomes the instance a recovery adopts it for, once its records verified;
        anyone else keeps its own (`_adopted_index` returned None)."""
        if index is None:
            return
        was = self._settings.instance
        self._settings = replace(self._settings, index=index, standby=False)
        logger.info("%s: standby adopted as %s", was, self._settings.instance)

    def _give_identity_back(self, was: ControlSettings) -> None:
        """A restore that failed after taking the identity leaves the participant as it was."""
        if self._settings is not was:
            logger.warning(
                "%s: the restore failed; back to %s%s",
                self._settings.instance,
                was.instance,
                " (standby)" if was.standby else "",
            )
            self._settings = was

    def _rewire(self, peers: Mapping[Role, str]) -> None:
        """Point the participant at new peers before anything is installed (InPlace recovery)."""
        try:
            self._participant.rewire(peers)
        except NotImplementedError as error:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED,
                f"{self._settings.instance} cannot re-wire its peers ({error}); replace it instead",
            ) from None
        logger.info(
            "%s: peers re-wired: %s",
            self._settings.instance,
            ", ".join(f"{role.value}={url}" for role, url in sorted(peers.items())),
        )

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        """Resume (and abort) is accepted even past its deadline: it only ever frees work.

        A prepare of the same id that is still parking (holding the lock until its deadline) is
        interrupted first, so an abort takes effect at once rather than at the prepare deadline.
        """
        parking = self._parking
        if parking is not None and parking[0] == request.checkpoint_id:
            parking[1].cancel()
        async with self._lock:
            committed = self._machine.phase is Phase.COMMITTED
            if self._machine.resume(request.checkpoint_id):
                self._lease_changed.set()
                # Reopen first: the collector, back on, catches up on the garbage of the whole
                # pause at its next allocation, and that collection must not delay the reopen.
                try:
                    with tracing.span("reopen"):
                        await self._call("reopen", self._participant.reopen())
                finally:
                    self._closed(committed)
            return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def retire(self, request: RetireRequest) -> RetireReply:
        async with self._lock:
            cached = self._operations.get(request.operation_id)
            if isinstance(cached, RetireReply):
                return cached
            self._refuse_reused_operation(request.operation_id, cached)
            self._machine.check_retire()
            refuse_passed(request.deadline_ts, self._clock())
            scope = None if request.rollout_ids is None else frozenset(request.rollout_ids)
            self._marks.room(request.attempt, scope)
            # Marks first: work of this attempt that arrives while we wait is refused already.
            self._marks.add(request.attempt, scope)
            try:
                with anyio.fail_after(max(0.0, request.deadline_ts - self._clock())):
                    retired = await self._participant.retire(request.attempt, scope)
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
            lost = self._work(
                "lost_work", lambda: self._participant.lost_work(request.attempt, told)
            )
            reply = RetireReply(
                operation_id=request.operation_id,
                retired=retired,
                lost=lost,
                lost_since=self._work_since if lost is not None else None,
                finished=finished,
            )
            _remember_operation(self._operations, request.operation_id, reply)
            return reply

    def _checkpointed(self, checkpoint_id: str, records: Sequence[Record]) -> None:
        """Lost work counts from this checkpoint on (the participant's accounting never fails
        a protocol call: an error is logged and counts nothing)."""
        self._work_since = checkpoint_id
        try:
            self._participant.checkpointed(checkpoint_id, records)
        except Exception:
            logger.exception("%s: work accounting (checkpointed) failed", self._settings.instance)

    def _finished_rollouts(self, attempt: int) -> list[str] | None:
        try:
            finished = self._participant.finished_rollouts(attempt)
        except Exception:
            logger.exception("%s: work accounting (finished) failed", self._settings.instance)
            return None
        if finished is None or len(finished) > MAX_FINISHED_LISTED:
            return None
        return sorted(set(finished))

    def _work(self, what: str, count: Callable[[], dict[str, int] | None]) -> dict[str, int] | None:
        """A participant's work counts, or None when it counts nothing or its counting failed."""
        try:
            counts = count()
        except Exception:
            logger.exception("%s: work accounting (%s) failed", self._settings.instance, what)
            return None
        if counts is None:
            return None
        return {name: max(0, int(amount)) for name, amount in counts.items()}

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        async with self._lock:
            cached = self._operations.get(request.operation_id)
            if isinstance(cached, ForgetReply):
                return cached
            self._refuse_reused_operation(request.operation_id, cached)
            ids = frozenset(request.rollout_ids)
            dropped = self._marks.forget(ids)
            try:
                self._participant.forget(ids)
            except Exception as error:
                logger.exception("%s: forget failed", self._settings.instance)
                raise ProtocolError(
                    ErrorCode.INTERNAL, f"forget failed: {type(error).__name__}: {error}"
                ) from error
            reply = ForgetReply(operation_id=request.operation_id, forgotten=dropped)
            _remember_operation(self._operations, request.operation_id, reply)
            return reply

    async def remove(self, request: RemoveRequest) -> RemoveReply:
        """Remove checkpoints' records from this participant's own set directory (the operator's
        retention and finalizers, where the operator cannot mount the volume itself).

        Never the open checkpoint (or, for `whole_set`, while one is open): that would take
        records a commit is writing or a recovery may restore. The check is made under the lock,
        and in the same lock the removal claims its checkpoints (`RemovalClaims`): until its worker
        thread has ended, a prepare or restore of a claimed id (of any id, for `whole_set`) is
        refused with `conflicting_checkpoint`, so no prepare and commit of an id can run between
        the check and the deletion of that id's files (docs/protocol.md, "Remove").

        The removal itself runs outside the lock, in a worker thread bounded by the call's
        deadline, so a slow volume never holds up a prepare, as before: holding the lock for
        the whole removal, or for each checkpoint's deletion, would make every prepare of the
        set wait on the volume up to the removal's deadline. Refusing the ids being removed
        costs nothing to anyone else; a prepare of such an id is a conflict either way (its
        caller retries it, or takes a new id). Past the deadline the call fails
        (`storage_failed`) but the claim stays until the thread really ends: the files may
        still be going."""
        refuse_passed(request.deadline_ts, self._clock())
        root = self._require_root("remove")
        async with self._lock:
            open_id = self._machine.checkpoint_id if self._machine.phase is not Phase.IDLE else None
            if open_id is not None and (request.whole_set or open_id in request.checkpoint_ids):
                raise ProtocolError(
                    ErrorCode.CONFLICTING_CHECKPOINT,
                    f"checkpoint {open_id} is open ({self._machine.phase.value}); its records "
                    "cannot be removed until it closes",
                )
            claim = self._removals.claim(request.checkpoint_ids, whole_set=request.whole_set)
        set_dir = self._settings.storage_dir

        def remove_all() -> RemoveReply | None:
            if not self._removals.begin(claim):
                return None  # the call gave up before this thread began: delete nothing
            try:
                return storage.remove_records(
                    root, set_dir, request.checkpoint_ids, whole_set=request.whole_set
                )
            finally:
                self._removals.end(claim)

        try:
            with self._storage_deadline("remove", request.deadline_ts):
                reply = await _storage_io(remove_all)
        except storage.StorageError as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        except storage.UnsafePath as error:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(error)) from error
        finally:
            self._removals.abandon(claim)
        assert reply is not None, "the worker thread ran: it began before the call returned"
        logger.info(
            "%s: removed records of %s (absent: %s, kept: %d)",
            self._settings.instance,
            reply.removed or "nothing",
            reply.absent or "none",
            reply.kept_count,
        )
        return reply

    def _refuse_removing(self, checkpoint_id: str) -> None:
        """A checkpoint whose records a removal is deleting is not opened (see `remove`)."""
        if self._removals.covers(checkpoint_id):
            raise ProtocolError(
                ErrorCode.CONFLICTING_CHECKPOINT,
                f"the records of checkpoint {checkpoint_id!r} are being removed here; it cannot "
                "be prepared or restored until that removal has ended",
            )

    # internals --------------------------------------------------------------------------------

    def _extend_lease(self, deadline_ts: float) -> None:
        self._machine.extend_lease(deadline_ts + self._settings.lease_grace_seconds)
        self._lease_changed.set()

    @contextmanager
    def _storage_deadline(self, operation: str, deadline_ts: float) -> Iterator[None]:
        """Bound the storage I/O of a call holding the lock by the call's deadline: past it the
        call fails (`storage_failed`), the lock is freed, and the worker thread is left to
        finish on its own (its result is dropped)."""
        try:
            with anyio.fail_after(max(0.0, deadline_ts - self._clock())):
                yield
        except TimeoutError:
            logger.error(
                "%s: %s: storage did not answer by the deadline", self._settings.instance, operation
            )
            raise storage.StorageError(
                f"{operation}: storage did not answer by the call's deadline at",
                self._settings.checkpoint_root or Path("."),
                OSError(errno.ETIMEDOUT, "storage I/O still running at the deadline"),
            ) from None

    def _require_root(self, operation: str) -> Path:
        root = self._settings.checkpoint_root
        if root is None:
            raise ProtocolError(
                ErrorCode.STORAGE_FAILED,
                f"{operation} needs a checkpoint root; ROLLOUT_CHECKPOINT_ROOT is not set",
            )
        return root

    def _create_directory_ahead(self, checkpoint_id: str) -> None:
        """Create this instance's checkpoint directory in the background once prepared.

        Its directory fsyncs (and the symlink-resolving path check, a dozen syscalls) then run
        in a worker thread while the later stages park, instead of inside the prepare reply or
        the commit, where every episode of the set waits for them. Failures are left for the
        commit to meet again and report.
        """
        root = self._settings.checkpoint_root
        if root is None or self._background is None:
            return
        if self._directory is not None and self._directory.checkpoint_id == checkpoint_id:
            return
        ahead = _AheadDirectory(checkpoint_id, anyio.Event())
        self._directory = ahead
        set_name, instance = self._settings.storage_dir, self._settings.instance

        def make() -> Path:
            with tracing.span("create directory ahead"):  # after the prepare reply, off its path
                path = storage.checkpoint_dir(root, set_name, checkpoint_id, instance)
                storage.make_dirs(path)
                return path

        async def create() -> None:
            try:
                ahead.path = await anyio.to_thread.run_sync(make)
            except (storage.StorageError, storage.UnsafePath) as error:
                logger.info(
                    "%s: creating the checkpoint directory ahead failed: %s", instance, error
                )
            finally:
                ahead.done.set()

        self._background.start_soon(create)

    async def _commit_directory(self, root: Path, checkpoint_id: str) -> Path:
        """The directory this commit writes to, made ahead where the prepare could."""
        ahead = self._directory
        if ahead is not None and ahead.checkpoint_id == checkpoint_id:
            await ahead.done.wait()
            if ahead.path is not None:
                return ahead.path
        return _directory(root, self._settings.storage_dir, checkpoint_id, self._settings.instance)

    def _closed(self, committed: bool) -> None:
        """The open checkpoint closed (resume or lease lapse): collect garbage again, and forget
        the directory made ahead, removing it when nothing was committed into it."""
        self._collector.release()
        ahead, self._directory = self._directory, None
        if ahead is None or committed or self._background is None:
            return

        async def remove() -> None:
            await ahead.done.wait()
            path = ahead.path
            if path is not None:
                await anyio.to_thread.run_sync(
                    lambda: storage.remove_empty_dirs(path, below=path.parent.parent)
                )

        self._background.start_soon(remove)

    async def _park(self, checkpoint_id: str, deadline_ts: float) -> ParkState:
        budget = max(0.0, deadline_ts - self._clock()) + _PARK_OVERRUN_SECONDS
        state: ParkState | None = None
        try:
            with anyio.fail_after(budget), anyio.CancelScope() as interruptible:
                self._parking = (checkpoint_id, interruptible)
                state = await self._participant.park(deadline_ts)
        except TimeoutError:
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"participant did not report its park state within {_PARK_OVERRUN_SECONDS}s "
                "after the deadline",
            ) from None
        except ProtocolError:
            raise
        except Exception as error:
            logger.exception("%s: park failed", self._settings.instance)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"park failed: {type(error).__name__}: {error}"
            ) from error
        finally:
            self._parking = None
        if state is None:
            raise ProtocolError(
                ErrorCode.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} was resumed while this prepare was parking",
            )
        return state

    def _export(self, scope: frozenset[str] | None) -> list[storage.EncodedRecord]:
        """The participant's records with their lines, encoded ahead where it encodes ahead."""
        try:
            return list(self._participant.export_encoded(scope))
        except PydanticSerializationError as error:
            # a record whose data is not JSON: a bug in the participant, not in storage
            logger.exception("%s: records not serialisable", self._settings.instance)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"records are not serialisable: {error}"
            ) from error
        except Exception as error:
            logger.exception("%s: export failed", self._settings.instance)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"export failed: {type(error).__name__}: {error}"
            ) from error

    def _in_scope(
        self, records: list[storage.EncodedRecord], scope: frozenset[str] | None
    ) -> list[storage.EncodedRecord]:
        if scope is None:
            return records
        kept = [item for item in records if item.record.rollout_id in scope]
        if len(kept) != len(records):
            logger.warning(
                "%s: export returned %d records outside the commit scope; not written",
                self._settings.instance,
                len(records) - len(kept),
            )
        return kept

    async def _verified_records(self, request: RestoreRequest, instance: str) -> list[Record]:
        """Read, verify and filter the records of the restore as `instance` (the adopted one
        for a standby); raises before anything is installed or any identity is taken."""
        root = self._require_root("restore")
        source = request.source_instance or instance
        if not source.startswith(f"{self._settings.role.value}-"):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"source_instance {source!r} is not a {self._settings.role.value} instance",
            )
        directory = _directory(root, self._settings.storage_dir, request.checkpoint_id, source)
        try:
            with self._storage_deadline("restore", request.deadline_ts):
                manifest, records = await _storage_io(
                    lambda: storage.read_records(
                        directory, expect_checkpoint_id=request.checkpoint_id
                    )
                )
        except storage.RecordsMissing as error:
            raise ProtocolError(ErrorCode.RECORDS_UNREACHABLE, str(error)) from error
        except storage.RecordsInvalid as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, str(error)) from error
        except storage.StorageError as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        if manifest.role is not self._settings.role:
            raise ProtocolError(
                ErrorCode.RECORDS_INVALID,
                f"records in {directory} belong to role {manifest.role.value}, "
                f"not {self._settings.role.value}",
            )
        if request.rollout_ids is not None:
            scope = frozenset(request.rollout_ids)
            records = [record for record in records if record.rollout_id in scope]
        too_new = [record for record in records if record.attempt >= request.attempt]
        if too_new:
            raise ProtocolError(
                ErrorCode.RECORDS_INVALID,
                f"{len(too_new)} records were produced by attempt >= {request.attempt} "
                f"(first: {too_new[0].rollout_id}@{too_new[0].attempt}); "
                "restore under a newer attempt",
            )
        try:
            self._participant.validate(records)
        except ValueError as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, f"records refused: {error}") from error
        return records

    def _refuse_reused_operation(
        self, operation_id: str, cached: RetireReply | ForgetReply | None
    ) -> None:
        if cached is not None:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"operation_id {operation_id!r} was already used for another operation",
            )

    async def _call(self, what: str, call: Awaitable[None]) -> None:
        try:
            await call
        except Exception as error:
            logger.exception("%s: %s failed", self._settings.instance, what)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"{what} failed: {type(error).__name__}: {error}"
            ) from error

    async def _watchdog(self) -> None:
        """Resume by ourselves when a lease lapses, so a dead coordinator never freezes work."""
        while True:
            changed = self._lease_changed = anyio.Event()
            expires = self._machine.lease_expires_ts
            if expires is None or self._machine.phase is Phase.IDLE:
                await changed.wait()
                continue
            with anyio.move_on_after(max(0.0, expires - self._clock())):
                await changed.wait()
            if changed.is_set():
                continue
            with anyio.CancelScope(shield=True):
                await self._expire()

    async def _expire(self) -> None:
        async with self._lock:
            phase = self._machine.phase
            abandoned = self._machine.expire(self._clock())
            if abandoned is None:
                return
            logger.warning(
                "%s: lease of checkpoint %s lapsed in phase %s; resuming by ourselves "
                "(the coordinator stopped renewing)",
                self._settings.instance,
                abandoned,
                phase.value,
            )
            try:
                await self._participant.reopen()
            except Exception:
                logger.exception("%s: reopen after lease lapse failed", self._settings.instance)
            finally:
                self._closed(committed=phase is Phase.COMMITTED)  # after the reopen, as in resume

    def _handlers(self) -> dict[str, Callable[[Any], Awaitable[BaseModel]]]:
        """The operation behind each route of `ROUTES`, by route name."""

        async def status(_: None) -> StatusReply:
            return self.status()

        return {
            STATUS.name: status,
            PREPARE.name: self.prepare,
            RENEW.name: self.renew,
            COMMIT.name: self.commit,
            RESTORE.name: self.restore,
            RESUME.name: self.resume,
            RETIRE.name: self.retire,
            FORGET.name: self.forget,
            REMOVE.name: self.remove,
        }

    def _build_router(self) -> APIRouter:
        """One endpoint per route of the table and mounted dialect; bodies are parsed strictly
        after the token. Both dialects call the same handlers."""
        router = APIRouter()
        handlers = self._handlers()
        if Dialect.GYM in self._settings.dialects:
            # Imported only where Gym's dialect is mounted: its models cost every other server
            # start (docs/operations.md, "What a server start costs").
            from . import _gym as gym
        for dialect in self._settings.dialects:
            for route in ROUTES:
                path = route.path_in(dialect)
                if path is None:
                    continue
                handler = handlers[route.name]
                if dialect is Dialect.ROLLOUT:
                    endpoint = self._endpoint(route, handler)
                    reply_model: type[BaseModel] = route.reply
                    responses = route.error_statuses()
                    body_schema = request_body_schema(route.request)
                else:
                    codec = gym.codec(route)
                    endpoint = self._gym_endpoint(codec, handler)
                    reply_model = codec.reply
                    responses = gym.error_responses(route.errors)
                    body_schema = request_body_schema(codec.request)
                router.add_api_route(
                    path,
                    endpoint,
                    methods=[route.method],
                    response_model=reply_model,
                    responses=responses,
                    summary=route.summary,
                    name=route.name if dialect is Dialect.ROLLOUT else f"gym-{route.name}",
                    openapi_extra=body_schema,
                )
        if Dialect.GYM in self._settings.dialects:
            router.add_api_route(
                GYM_CAPABILITIES_PATH,
                self._capabilities_endpoint(),
                methods=["GET"],
                response_model=gym.GymCapabilities,
                summary="What this participant takes part in, and in which dialects.",
                name="gym-capabilities",
            )
        return router

    def _endpoint(
        self, route: Route[Any, Any], handler: Callable[[Any], Awaitable[BaseModel]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            self._authorize(request.headers.get("authorization"))
            body = None if route.request is None else await parse_body(request, route.request)
            deadline_ts = getattr(body, "deadline_ts", None)
            if deadline_ts is not None:
                self._refuse_far(deadline_ts)
            with tracing.server_span(
                route.name,
                request.headers,
                attributes={"rollout.instance": self._settings.instance},
            ):
                return json_reply(await handler(body))

        return endpoint

    def _gym_endpoint(
        self, codec: gym.GymCodec, handler: Callable[[Any], Awaitable[BaseModel]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """The Gym form of a route: Gym's body mapped to ours, the same handler, our reply
        mapped to Gym's; every refusal answered with Gym's error body and code."""
        from . import _gym as gym

        side = gym.ServerSide(
            instance=self._settings.instance,
            storage_dir=self._settings.storage_dir,
            checkpoint_root=None
            if self._settings.checkpoint_root is None
            else str(self._settings.checkpoint_root),
            dialects=tuple(dialect.value for dialect in self._settings.dialects),
            attempt=lambda: self._attempt,
            open_checkpoint=lambda: self._machine.checkpoint_id,
        )

        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request.headers.get("authorization"))
                body = None if codec.request is None else await parse_body(request, codec.request)
                deadline_ts = getattr(body, "deadline_ts", None)
                if deadline_ts is not None:
                    self._refuse_far(deadline_ts)
                try:
                    ours = codec.to_ours_request(body, side)
                except gym.Unmappable as error:
                    raise ProtocolError(error.code, str(error)) from None
                return json_reply(codec.to_gym_reply(await handler(ours), body, side))
            except ProtocolError as error:
                return gym_error_response(gym.participant_refusal(error, side))

        return endpoint

    def _capabilities_endpoint(self) -> Callable[[Request], Awaitable[Response]]:
        from . import _gym as gym

        capabilities = gym.GymCapabilities(
            checkpoint=True,
            operations=[route.name for route in ROUTES if route.in_gym],
            lease_grace_seconds=self._settings.lease_grace_seconds,
            dialects=[dialect.value for dialect in self._settings.dialects],
        )

        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request.headers.get("authorization"))
            except ProtocolError as error:
                return gym_error_response(error)
            return json_reply(capabilities)

        return endpoint

    def _refuse_far(self, deadline_ts: float) -> None:
        """A deadline beyond the horizon would open a lease that, in practice, never lapses."""
        horizon = self._settings.max_deadline_seconds
        if deadline_ts > self._clock() + horizon:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"deadline_ts: {deadline_ts:.6g} is more than {horizon:g}s ahead "
                "(ROLLOUT_MAX_DEADLINE_SECONDS); send a nearer deadline and renew",
            )

    def _authorize(self, header: str | None) -> None:
        expected = self._settings.token
        if expected is None:
            return
        if header is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing Authorization: Bearer <token>")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), expected.encode()
        ):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "wrong control token")


async def _storage_io(call: Callable[[], _T]) -> _T:
    """Run blocking storage I/O in a worker thread that a deadline can abandon."""
    return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)


def _directory(root: Path, set_name: str, checkpoint_id: str, instance: str) -> Path:
    try:
        return storage.checkpoint_dir(root, set_name, checkpoint_id, instance)
    except storage.UnsafePath as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(error)) from error


def _remember_operation(
    memory: OrderedDict[str, RetireReply | ForgetReply],
    operation_id: str,
    reply: RetireReply | ForgetReply,
) -> None:
    memory[operation_id] = reply
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)
