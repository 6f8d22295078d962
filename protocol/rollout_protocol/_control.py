"""The checkpoint control plane every rollout server mounts under `/checkpoint/v1` (and, where
its settings say so, in NeMo Gym's dialect under `/ng-control/v1`, mapped by `_gym`).

It owns everything that must behave the same in every server: authentication, the phase
machine, reply replay, the lease and its watchdog, storage, and retire marks. A server only
supplies a `Participant` (how to park, what to record, how to install and stop work).

Control operations are serialized by one lock: they are rare, and a strict order is what makes
replayed replies and phase checks trustworthy. `/status` does not take the lock, so it answers
even while a prepare waits for episodes to park. Storage I/O under the lock is bounded by the
request's deadline (`_control_core.storage_io`): storage that hangs (a stale network mount)
fails that call at its deadline and frees the lock, instead of holding every later control call
behind it.

`ControlPlane` is the public face and owner of its parts, each in a module of its own by
concern, all sharing one `PlaneCore` (`_control_core.py`: identity, phase machine, lease, lock,
marks): the checkpoint operations and the lease watchdog (`_control_checkpoint.py`), the persist
after the resume of a cut's records (`_control_persist.py`), restore and
standby identity (`_control_restore.py`), retire, forget and remove (`_control_retire.py`), and
the HTTP endpoints built from the route table (`_control_routes.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from . import tracing
from ._control_checkpoint import CheckpointOperations
from ._control_core import PlaneCore
from ._control_persist import PersistOperations
from ._control_restore import RestoreOperation
from ._control_retire import RetireOperations
from ._control_routes import ControlRouter, Handler, authorize
from ._http import (
    BodyLimit,
    BodyTooLarge,
    declare_error_statuses,
    http_error_handler,
    protocol_error_handler,
    validation_error_handler,
)
from ._participant import Participant
from ._routes import (
    COMMIT,
    DISCARD,
    FORGET,
    PERSIST,
    PREPARE,
    REMOVE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    STATUS,
)
from ._settings import ControlConfigError, ControlSettings
from ._wire import (
    Capability,
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    ForgetReply,
    ForgetRequest,
    PersistRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
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
)

logger = logging.getLogger(__name__)


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
        self._core = core = PlaneCore(participant, settings, clock)
        self._checkpoints = CheckpointOperations(core)
        self._persists = PersistOperations(core)
        self._restores = RestoreOperation(core)
        self._retires = RetireOperations(core)
        self._watchdog_scope: anyio.CancelScope | None = None
        self.router = ControlRouter(self, self._handlers(), clock).build()

    # public API -------------------------------------------------------------------------------

    @property
    def settings(self) -> ControlSettings:
        return self._core.settings

    @property
    def attempt(self) -> int:
        return self._core.attempt

    @property
    def phase(self) -> Phase:
        return self._core.machine.phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._core.machine.checkpoint_id

    def is_retired(self, attempt: int, rollout_id: str) -> bool:
        return self._core.marks.covers(attempt, rollout_id)

    def authorize(self, authorization: str | None) -> None:
        """Check an `Authorization` header against the control token (constant time); raise
        `ProtocolError(UNAUTHORIZED)` (401 once the plane is installed) when it does not match.

        For a server's own routes that reveal what only the operator may know, such as the
        rollout ids in `GET /stats?detail=true`. Without a token (allow_unauthenticated) every
        caller passes, as on the control routes."""
        authorize(self._core.settings, authorization)

    def install(self, app: FastAPI) -> None:
        """Mount the routes and error handlers, and run the lease watchdog with the app.

        Create the app with its own lifespan (if any) before calling this; the watchdog wraps it.
        With `OTEL_EXPORTER_OTLP_ENDPOINT` set, the process exports traces from here on
        (`tracing.configure`, service `rollout-<role>`) unless it set up OpenTelemetry itself.
        """
        settings = self._core.settings
        tracing.configure(
            f"rollout-{settings.role.value}",
            attributes={
                "rollout.instance": settings.instance,
                "rollout.set": settings.set_name,
            },
        )
        declare_error_statuses(app)
        if settings.worker is None:
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
        app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(application: Any) -> AsyncIterator[Any]:
            async with self.running(), inner(application) as state:
                yield state

        app.router.lifespan_context = lifespan

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ControlPlane]:
        """Run the lease watchdog for the duration of the block (the app lifespan uses this)."""
        core = self._core
        async with anyio.create_task_group() as group:
            self._watchdog_scope = group.cancel_scope
            core.background = group
            group.start_soon(self._checkpoints.watchdog)
            group.start_soon(self._persists.watchdog)
            try:
                yield self
            finally:
                group.cancel_scope.cancel()
                self._watchdog_scope = None
                core.background = None
                core.collector.release()

    def follow(self, attempt: int, index: int | None = None, standby: bool = False) -> None:
        """A worker's plane: the pod's plane runs `attempt` (its `/run` checks this one) as
        instance `index`, a standby or not (a standby pod adopted for a lost instance: the
        worker is that instance from then on, in its `settings` and whatever a server reports
        from them; back to the standby when the adoption failed). None: the identity stays."""
        core = self._core
        core.attempt = attempt
        core.marks.settle(attempt)
        if index is not None and (index, standby) != (core.settings.index, core.settings.standby):
            core.settings = replace(core.settings, index=index, standby=standby)

    def mark_retired(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        """A worker's plane: the pod's plane retires this; refuse its work from now on."""
        self._core.marks.room(attempt, rollout_ids)
        self._core.marks.add(attempt, rollout_ids)

    @property
    def participant(self) -> Participant:
        return self._core.participant

    async def aclose(self) -> None:
        """Stop the watchdog; an open checkpoint is left as is (its coordinator will resume it).
        The garbage collector is given back: it is process-wide, and this plane no longer
        pauses anything."""
        if self._watchdog_scope is not None:
            self._watchdog_scope.cancel()
        self._core.collector.release()

    def status(self) -> StatusReply:
        core = self._core
        settings, machine = core.settings, core.machine
        counts = core.participant.counts()
        return StatusReply(
            role=settings.role,
            instance=settings.instance,
            set_name=settings.set_name,
            set_dir=settings.set_dir,
            standby=settings.standby,
            attempt=core.attempt,
            phase=machine.phase,
            checkpoint_id=machine.checkpoint_id,
            lease_expires_ts=machine.lease_expires_ts,
            live_episodes=counts.live,
            parked_episodes=counts.parked,
            restored_episodes=counts.restored,
            retired_attempts=core.marks.whole_attempts(),
            multi_process=settings.multi_process,
            workers=max(settings.workers, settings.unmanaged_workers),
            capabilities=[Capability.PERSIST_AFTER_RESUME],
            held_bytes=core.cuts.held_bytes(),
            waits_on=None if settings.waits_on is None else list(settings.waits_on),
        )

    # operations (each held by the part of the plane that owns its concern) --------------------

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        return await self._checkpoints.prepare(request)

    async def renew(self, request: RenewRequest) -> RenewReply:
        return await self._checkpoints.renew(request)

    async def commit(self, request: CommitRequest) -> CommitReply:
        return await self._checkpoints.commit(request)

    async def persist(self, request: PersistRequest) -> CommitReply:
        """After a cut and the resume: write and fsync the held records, then the manifest
        (docs/protocol.md, "Persist after resume"). Takes no lock: episodes and the next
        checkpoint go on meanwhile."""
        return await self._persists.persist(request)

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        """Release a cut's records and remove what its persist wrote here."""
        return await self._persists.discard(request)

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        """Verify and install a checkpoint's records under a new attempt.

        A standby's identity is all or nothing (docs/protocol.md, "Restore and replay"): the
        index it is asked to become is checked first, its records are read and verified as that
        instance's without changing anything, and the instance is taken only then; a restore
        that fails after that (close admission, install) gives the old identity back, so a
        failed adoption leaves a standby with its own instance, free for the right restore.
        """
        return await self._restores.restore(request)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        """Resume (and abort) is accepted even past its deadline: it only ever frees work.

        A prepare of the same id that is still parking (holding the lock until its deadline) is
        interrupted first, so an abort takes effect at once rather than at the prepare deadline.
        """
        return await self._checkpoints.resume(request)

    async def retire(self, request: RetireRequest) -> RetireReply:
        return await self._retires.retire(request)

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        return await self._retires.forget(request)

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
        return await self._retires.remove(request)

    def _handlers(self) -> dict[str, Handler]:
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
            PERSIST.name: self.persist,
            DISCARD.name: self.discard,
        }
