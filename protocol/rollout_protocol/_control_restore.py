"""A control plane's restore: verify a checkpoint's records, install them under a new attempt,
and take a standby's new identity all or nothing (docs/protocol.md, "Restore and replay").

Held apart from `ControlPlane` (`_control.py`), which owns one `RestoreOperation` and delegates
its public `restore` to it: this is the one part of the plane that changes who the participant
is (`PlaneCore.settings`, when a recovery adopts a standby) and which attempt it runs
(`PlaneCore.attempt`). It runs under the plane's lock (`PlaneCore.lock`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from . import _storage as storage
from . import tracing
from ._control_core import PlaneCore, logger, manifest_location, storage_io
from ._phases import RestoreShape
from ._settings import ControlSettings
from ._wire import (
    EpisodeId,
    ErrorCode,
    Phase,
    ProtocolError,
    Record,
    RestoreReply,
    RestoreRequest,
    Role,
    instance_name,
)


class RestoreOperation:
    """Restore and standby adoption of one plane."""

    def __init__(self, core: PlaneCore) -> None:
        self._core = core

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        core = self._core
        async with core.lock:
            cid = request.checkpoint_id
            core.refuse_removing(cid)
            asked = core.settings.index if request.index is None else request.index
            shape = RestoreShape.of(request, instance_name(core.settings.role, asked))
            cached = core.machine.admit_restore(
                cid, request.attempt, request.deadline_ts, core.clock(), shape
            )
            if cached is not None:
                core.extend_lease(request.deadline_ts)
                return cached
            index = self._adopted_index(request.index)
            instance = shape.instance
            if request.attempt < core.attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH,
                    f"restore under attempt {request.attempt}, but this process already runs "
                    f"attempt {core.attempt}",
                )
            if core.marks.covers_attempt(request.attempt):
                raise ProtocolError(
                    ErrorCode.ATTEMPT_RETIRED,
                    f"attempt {request.attempt} was retired here; restore under a newer attempt",
                )
            with tracing.span("verify"):
                records = await self._verified_records(request, instance)
            was = core.settings
            self._take_identity(index)
            try:
                restored = await self._install(request, records, was)
            except BaseException:
                self._give_identity_back(was)
                raise
            core.attempt = request.attempt
            core.marks.settle(request.attempt)
            core.checkpointed(cid, records)
            reply = RestoreReply(
                checkpoint_id=cid,
                phase=Phase.RESTORED,
                attempt=request.attempt,
                restored=restored,
                record_count=len(records),
                kept=core.work("kept_work", lambda: core.participant.kept_work(records)),
            )
            core.machine.end_restore(request.attempt, reply, shape)
            return reply

    async def _install(
        self, request: RestoreRequest, records: list[Record], was: ControlSettings
    ) -> list[EpisodeId]:
        """Re-wire, close admission and install verified records (restore's effect). A failed
        install gives the identity back (`was`) before the participant reopens: a pod of
        several workers sends its identity with the reopen, and its workers follow it."""
        core = self._core
        if request.peers is not None:
            self._rewire(request.peers)
        core.extend_lease(request.deadline_ts)
        await core.call("close_admission", core.participant.close_admission())
        try:
            with tracing.span("install", attributes={"rollout.records": len(records)}):
                return await core.participant.install(records, request.attempt)
        except Exception as error:
            logger.exception("%s: install failed", core.settings.instance)
            self._give_identity_back(was)
            await core.call("reopen", core.participant.reopen())
            core.machine.lease_expires_ts = None
            raise ProtocolError(
                ErrorCode.INTERNAL, f"install failed: {type(error).__name__}: {error}"
            ) from error

    def _adopted_index(self, index: int | None) -> int | None:
        """The index a restore gives this participant: None (it stays what it is), or the one
        it names, which only a standby may take. Changes nothing; a non-standby named another
        index is refused here, before any I/O."""
        settings = self._core.settings
        if index is None or (index == settings.index and not settings.standby):
            return None
        if not settings.standby:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"{settings.instance} is not a standby: it cannot become "
                f"{instance_name(settings.role, index)}",
            )
        return index

    def _take_identity(self, index: int | None) -> None:
        """A standby becomes the instance a recovery adopts it for, once its records verified;
        anyone else keeps its own (`_adopted_index` returned None)."""
        if index is None:
            return
        core = self._core
        was = core.settings.instance
        core.settings = replace(core.settings, index=index, standby=False)
        logger.info("%s: standby adopted as %s", was, core.settings.instance)

    def _give_identity_back(self, was: ControlSettings) -> None:
        """A restore that failed after taking the identity leaves the participant as it was."""
        core = self._core
        if core.settings is not was:
            logger.warning(
                "%s: the restore failed; back to %s%s",
                core.settings.instance,
                was.instance,
                " (standby)" if was.standby else "",
            )
            core.settings = was

    def _rewire(self, peers: Mapping[Role, str]) -> None:
        """Point the participant at new peers before anything is installed (InPlace recovery)."""
        core = self._core
        try:
            core.participant.rewire(peers)
        except NotImplementedError as error:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED,
                f"{core.settings.instance} cannot re-wire its peers ({error}); replace it instead",
            ) from None
        logger.info(
            "%s: peers re-wired: %s",
            core.settings.instance,
            ", ".join(f"{role.value}={url}" for role, url in sorted(peers.items())),
        )

    async def _verified_records(self, request: RestoreRequest, instance: str) -> list[Record]:
        """Read, verify and filter the records of the restore as `instance` (the adopted one
        for a standby); raises before anything is installed or any identity is taken."""
        records = await self._read_records(request, instance)
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
            self._core.participant.validate(records)
        except ValueError as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, f"records refused: {error}") from error
        return records

    async def _read_records(self, request: RestoreRequest, instance: str) -> list[Record]:
        """The records of `request.source_instance` (else `instance`), read within the call's
        deadline and checked to be this role's."""
        core = self._core
        store = core.require_store("restore", request.deadline_ts)
        role = core.settings.role
        source = request.source_instance or instance
        if not source.startswith(f"{role.value}-"):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"source_instance {source!r} is not a {role.value} instance",
            )
        set_dir, cid = core.settings.storage_dir, request.checkpoint_id
        where = manifest_location(set_dir, cid, source)
        try:
            with core.storage_deadline("restore", request.deadline_ts, store):
                manifest, records = await storage_io(
                    lambda: store.read_records(set_dir, cid, source)
                )
        except storage.RecordsMissing as error:
            raise ProtocolError(ErrorCode.RECORDS_UNREACHABLE, str(error)) from error
        except storage.RecordsInvalid as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, str(error)) from error
        except storage.StorageError as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        if manifest.role is not role:
            raise ProtocolError(
                ErrorCode.RECORDS_INVALID,
                f"records at {where} belong to role {manifest.role.value}, not {role.value}",
            )
        return records
