"""The checkpoint routes of a control plane: prepare, renew, commit (or the cut, whose records a
persist writes after the resume: `_control_persist.py`) and resume (abort), and the lease
watchdog that resumes by itself when the coordinator stops renewing.

Held apart from `ControlPlane` (`_control.py`), which owns one `CheckpointOperations` and
delegates its public `prepare`, `renew`, `commit` and `resume` to it: this is the part of the
plane that parks episodes, writes records and makes each checkpoint's directory ahead of its
commit. Every operation runs under the plane's lock (`PlaneCore.lock`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from pydantic_core import PydanticSerializationError

from . import _storage as storage
from . import tracing
from ._control_core import PlaneCore, logger, manifest_location, storage_io
from ._control_state import HeldCut
from ._participant import ParkState, episodes_digest
from ._routes import Dialect
from ._wire import (
    MAX_BLOCKERS_REPORTED,
    CommitReply,
    CommitRequest,
    ErrorCode,
    Manifest,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
    RenewReply,
    RenewRequest,
    ResumeReply,
    ResumeRequest,
)

_PARK_OVERRUN_SECONDS = 2.0
"""How long past its deadline a participant's `park` may run before the call is failed."""


@dataclass
class _AheadDirectory:
    """A checkpoint directory being created ahead of its commit (see `_create_directory_ahead`)."""

    checkpoint_id: str
    done: anyio.Event
    path: Path | None = None
    """`<root>/<set_dir>/<checkpoint_id>/<instance>` once made; an abort removes it and its
    checkpoint level."""


class CheckpointOperations:
    """Prepare, renew, commit and resume of one plane, and its lease watchdog."""

    def __init__(self, core: PlaneCore) -> None:
        self._core = core
        self._parking: tuple[str, anyio.CancelScope] | None = None
        self._directory: _AheadDirectory | None = None

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        core = self._core
        async with core.lock:
            cid = request.checkpoint_id
            core.refuse_removing(cid)
            cached = core.machine.admit_prepare(cid, request.deadline_ts, core.clock())
            core.extend_lease(request.deadline_ts)
            if cached is not None:
                return cached
            if core.machine.begin_prepare(cid):
                with tracing.span("close admission"):
                    await core.call("close_admission", core.participant.close_admission())
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
            core.machine.end_prepare(reply)
            if state.ready:
                core.collector.hold()
                self._create_directory_ahead(cid)
            else:
                logger.info(
                    "%s: prepare %s not ready at its deadline: %d blockers",
                    core.settings.instance,
                    cid,
                    len(state.blockers),
                )
            return reply

    async def renew(self, request: RenewRequest) -> RenewReply:
        core = self._core
        async with core.lock:
            core.machine.admit_renew(request.checkpoint_id, request.deadline_ts, core.clock())
            core.extend_lease(request.deadline_ts)
            expires = core.machine.lease_expires_ts
            assert expires is not None
            return RenewReply(
                checkpoint_id=request.checkpoint_id,
                phase=core.machine.phase,
                lease_expires_ts=expires,
            )

    async def commit(self, request: CommitRequest) -> CommitReply:
        """Write the scope's records durably, or, asked to persist after the resume, cut: fix
        them as bytes held in memory and answer with the manifest a persist will write
        (`_cut`, docs/protocol.md, "Persist after resume")."""
        core = self._core
        async with core.lock:
            cid = request.checkpoint_id
            cached = core.machine.admit_commit(cid, request.deadline_ts, core.clock())
            core.extend_lease(request.deadline_ts)
            if cached is not None:
                return cached
            store = core.require_store("commit", request.deadline_ts)
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
            rollout_ids = self._listed(encoded)
            # what the records hold, not what the prepare counted: a /run that arrived after
            # the prepare replied is parked at its first boundary and written too
            # (docs/protocol.md, "Commit scope")
            episodes = core.participant.committed_episodes(encoded)
            where = manifest_location(core.settings.storage_dir, cid, core.settings.instance)
            if request.persist_after_resume:
                reply = self._cut(where, request, encoded, rollout_ids, episodes)
            else:
                manifest = await self._write(store, request, encoded)
                reply = CommitReply(
                    checkpoint_id=cid,
                    phase=Phase.COMMITTED,
                    manifest=manifest,
                    manifest_path=where,
                    rollout_ids=rollout_ids,
                    committed_episodes=episodes,
                )
                core.cuts.remember(cid, reply)  # a persist of it answers this again
            if scope is not None:
                core.participant.release_outside(scope)
            core.checkpointed(cid, [item.record for item in encoded])
            core.machine.end_commit(reply)
            return reply

    def _listed(self, encoded: list[storage.EncodedRecord]) -> list[str] | None:
        """The rollouts a commit reply lists (`CommitReply.rollout_ids`), only where NeMo Gym's
        dialect is mounted: its reply is the one that carries them (ours never serializes the
        field), and listing thousands of ids is a pass over them inside the pause."""
        if Dialect.GYM not in self._core.settings.dialects:
            return None
        return sorted({item.record.rollout_id for item in encoded})

    def _cut(
        self,
        manifest_path: str,
        request: CommitRequest,
        encoded: list[storage.EncodedRecord],
        rollout_ids: list[str] | None,
        episodes: int | None,
    ) -> CommitReply:
        """Hold the records as encoded ahead (their lines and digests: immutable bytes) and
        answer with the manifest they will have; refused (`persist_backlog`) past the bound on
        held bytes."""
        core, cid = self._core, request.checkpoint_id
        settings = core.settings
        manifest = storage.records_manifest(
            role=settings.role,
            instance=settings.instance,
            checkpoint_id=cid,
            attempt=core.attempt,
            encoded=encoded,
        )
        core.cuts.room(cid, manifest.bytes)
        reply = CommitReply(
            checkpoint_id=cid,
            phase=Phase.COMMITTED,
            manifest=manifest,
            manifest_path=manifest_path,
            rollout_ids=rollout_ids,
            durable=False,
            committed_episodes=episodes,
        )
        expires = request.deadline_ts + settings.lease_grace_seconds
        core.cuts.hold(HeldCut(reply=reply, encoded=tuple(encoded), expires_ts=expires))
        return reply

    async def _write(
        self,
        store: storage.RecordsStore,
        request: CommitRequest,
        encoded: list[storage.EncodedRecord],
    ) -> Manifest:
        """Write a commit's records (bounded by its deadline); a storage error fails it."""
        core, cid = self._core, request.checkpoint_id
        settings = core.settings
        try:
            with tracing.span("write"), core.storage_deadline("commit", request.deadline_ts, store):
                await self._directory_made(cid)
                manifest = await storage_io(
                    lambda: store.write_records(
                        settings.storage_dir,
                        cid,
                        settings.instance,
                        role=settings.role,
                        attempt=core.attempt,
                        encoded=encoded,
                    )
                )
        except storage.StorageError as error:
            logger.error("%s: commit %s failed: %s", settings.instance, cid, error)
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        return manifest

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        core = self._core
        parking = self._parking
        if parking is not None and parking[0] == request.checkpoint_id:
            parking[1].cancel()
        async with core.lock:
            committed = core.machine.phase is Phase.COMMITTED
            if core.machine.resume(request.checkpoint_id):
                core.lease_changed.set()
                # Reopen first: the collector, back on, catches up on the garbage of the whole
                # pause at its next allocation, and that collection must not delay the reopen.
                try:
                    with tracing.span("reopen"):
                        await core.call("reopen", core.participant.reopen())
                finally:
                    self._closed(committed)
            return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def watchdog(self) -> None:
        """Resume by ourselves when a lease lapses, so a dead coordinator never freezes work."""
        core = self._core
        while True:
            changed = core.lease_changed = anyio.Event()
            expires = core.machine.lease_expires_ts
            if expires is None or core.machine.phase is Phase.IDLE:
                await changed.wait()
                continue
            with anyio.move_on_after(max(0.0, expires - core.clock())):
                await changed.wait()
            if changed.is_set():
                continue
            with anyio.CancelScope(shield=True):
                await self._expire()

    async def _expire(self) -> None:
        core = self._core
        async with core.lock:
            phase = core.machine.phase
            abandoned = core.machine.expire(core.clock())
            if abandoned is None:
                return
            logger.warning(
                "%s: lease of checkpoint %s lapsed in phase %s; resuming by ourselves "
                "(the coordinator stopped renewing)",
                core.settings.instance,
                abandoned,
                phase.value,
            )
            try:
                await core.participant.reopen()
            except Exception:
                logger.exception("%s: reopen after lease lapse failed", core.settings.instance)
            finally:
                self._closed(committed=phase is Phase.COMMITTED)  # after the reopen, as in resume

    # the directory made ahead -------------------------------------------------------------------

    def _create_directory_ahead(self, checkpoint_id: str) -> None:
        """Create this instance's checkpoint directory in the background once prepared.

        Its directory fsyncs (and the symlink-resolving path check, a dozen syscalls) then run
        in a worker thread while the later stages park, instead of inside the prepare reply or
        the commit, where every episode of the set waits for them. Failures are left for the
        commit to meet again and report.
        """
        core = self._core
        root = core.settings.checkpoint_root
        background = core.background
        if root is None or background is None:
            return  # no volume (a bucket has no directories), or no task group
        if self._directory is not None and self._directory.checkpoint_id == checkpoint_id:
            return
        ahead = _AheadDirectory(checkpoint_id, anyio.Event())
        self._directory = ahead
        set_name, instance = core.settings.storage_dir, core.settings.instance

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

        background.start_soon(create)

    async def _directory_made(self, checkpoint_id: str) -> None:
        """Wait for the directory made ahead for this commit, where the prepare made one."""
        ahead = self._directory
        if ahead is not None and ahead.checkpoint_id == checkpoint_id:
            await ahead.done.wait()

    def _closed(self, committed: bool) -> None:
        """The open checkpoint closed (resume or lease lapse): collect garbage again, and forget
        the directory made ahead, removing it when nothing was committed into it."""
        self._core.collector.release()
        ahead, self._directory = self._directory, None
        background = self._core.background
        if ahead is None or committed or background is None:
            return

        async def remove() -> None:
            await ahead.done.wait()
            path = ahead.path
            if path is not None:
                await anyio.to_thread.run_sync(
                    lambda: storage.remove_empty_dirs(path, below=path.parent.parent)
                )

        background.start_soon(remove)

    # the participant's side -------------------------------------------------------------------

    async def _park(self, checkpoint_id: str, deadline_ts: float) -> ParkState:
        core = self._core
        budget = max(0.0, deadline_ts - core.clock()) + _PARK_OVERRUN_SECONDS
        state: ParkState | None = None
        try:
            with anyio.fail_after(budget), anyio.CancelScope() as interruptible:
                self._parking = (checkpoint_id, interruptible)
                state = await core.participant.park(deadline_ts)
        except TimeoutError:
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"participant did not report its park state within {_PARK_OVERRUN_SECONDS}s "
                "after the deadline",
            ) from None
        except ProtocolError:
            raise
        except Exception as error:
            logger.exception("%s: park failed", core.settings.instance)
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
        core = self._core
        try:
            return list(core.participant.export_encoded(scope))
        except PydanticSerializationError as error:
            # a record whose data is not JSON: a bug in the participant, not in storage
            logger.exception("%s: records not serialisable", core.settings.instance)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"records are not serialisable: {error}"
            ) from error
        except Exception as error:
            logger.exception("%s: export failed", core.settings.instance)
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
                self._core.settings.instance,
                len(records) - len(kept),
            )
        return kept
