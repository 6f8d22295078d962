"""The control plane's phase machine: which checkpoint operation is allowed in which phase, and
what a repeated or stale request gets. Pure: no I/O, no clock (the caller passes `now`), so that
every transition is tested without a server (docs/protocol.md, "Phases").
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ._wire import (
    CommitReply,
    ErrorCode,
    Phase,
    PrepareReply,
    ProtocolError,
    RestoreReply,
    RestoreRequest,
)

OPEN_PHASES = frozenset({Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED})
"""Phases in which a checkpoint is being taken; retire is refused in them."""

REMEMBERED = 4096
"""How many stale ids and idempotent operations are remembered (oldest forgotten first)."""


@dataclass(frozen=True)
class RestoreShape:
    """What a restore's reply and effect depend on besides its checkpoint id and attempt.

    The replay key of a restore (docs/protocol.md, "Restore and replay"): a repeated restore
    is answered from the cache only when its shape is the restored one, so a standby restored
    as one instance never answers a restore as another with that instance's reply.
    """

    instance: str
    """The instance the participant is once restored (a standby's adopted one)."""
    source: str
    """Whose records it read (`source_instance`, default the instance)."""
    scope_sha256: str | None
    """SHA-256 of the sorted `rollout_ids` (None: every record); a digest, so a large scope
    costs a few bytes in the cache."""
    peers: tuple[tuple[str, str], ...] | None
    """The peers it was re-wired to, by role (None: kept)."""

    @classmethod
    def of(cls, request: RestoreRequest, instance: str) -> RestoreShape:
        scope = None
        if request.rollout_ids is not None:
            joined = "\n".join(sorted(set(request.rollout_ids)))
            scope = hashlib.sha256(joined.encode()).hexdigest()
        peers = None
        if request.peers is not None:
            peers = tuple(sorted((role.value, url) for role, url in request.peers.items()))
        return cls(instance, request.source_instance or instance, scope, peers)


def _shape_differences(restored: RestoreShape | None, asked: RestoreShape | None) -> str:
    """What a repeated restore asks differently, for the refusal's detail."""
    if restored is None or asked is None:
        return "its request differs"
    names = {
        "instance": "restored as",
        "source": "records of",
        "scope_sha256": "rollout_ids (sha256)",
        "peers": "peers",
    }
    return ", ".join(
        f"{label} {getattr(restored, field)!r}, now {getattr(asked, field)!r}"
        for field, label in names.items()
        if getattr(restored, field) != getattr(asked, field)
    )


class PhaseMachine:
    """Which control call is allowed when, which reply to replay, and when the lease lapsed.

    `admit_*` methods either raise `ProtocolError`, return a cached reply to replay, or return
    None to let the caller do the work and report it with the matching `end_*` method. Keeping
    this free of I/O lets every rule be unit-tested without a server.

    Staleness: a checkpoint id that was resumed is stale for prepare, commit and renew. For
    restore it is the pair (id, attempt) that goes stale, so a survivor that took part in
    checkpoint X can still have X restored into it under a new attempt (in-place recovery).
    """

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.checkpoint_id: str | None = None
        self.restore_attempt: int | None = None
        self.lease_expires_ts: float | None = None
        self._prepared: dict[str, PrepareReply] = {}
        self._committed: dict[str, CommitReply] = {}
        self._restored: dict[tuple[str, int], tuple[RestoreShape | None, RestoreReply]] = {}
        self._stale: OrderedDict[str, None] = OrderedDict()
        self._stale_restores: OrderedDict[tuple[str, int], None] = OrderedDict()

    # prepare ----------------------------------------------------------------------------------

    def admit_prepare(
        self, checkpoint_id: str, deadline_ts: float, now: float
    ) -> PrepareReply | None:
        self._refuse_stale(checkpoint_id)
        if checkpoint_id == self.checkpoint_id and checkpoint_id in self._prepared:
            return self._prepared[checkpoint_id]
        self._refuse_other_open(checkpoint_id)
        if self.phase in (Phase.COMMITTED, Phase.RESTORED):
            raise self._wrong_phase("prepare")
        refuse_passed(deadline_ts, now)
        return None

    def begin_prepare(self, checkpoint_id: str) -> bool:
        """Enter `preparing`; True when admission must be closed (first prepare of this id)."""
        entering = self.phase is Phase.IDLE
        self.phase = Phase.PREPARING
        self.checkpoint_id = checkpoint_id
        return entering

    def end_prepare(self, reply: PrepareReply) -> None:
        """A ready reply moves to `prepared` and is replayed from now on; a not-ready one stays
        in `preparing` (still parked) until resume or a retried prepare."""
        if self.checkpoint_id != reply.checkpoint_id:
            return
        if reply.ready:
            self.phase = Phase.PREPARED
            self._prepared[reply.checkpoint_id] = reply

    # commit -----------------------------------------------------------------------------------

    def admit_commit(
        self, checkpoint_id: str, deadline_ts: float, now: float
    ) -> CommitReply | None:
        self._refuse_stale(checkpoint_id)
        if checkpoint_id == self.checkpoint_id and checkpoint_id in self._committed:
            return self._committed[checkpoint_id]
        self._refuse_unknown(checkpoint_id)
        if self.phase is not Phase.PREPARED:
            detail = " (prepare was not ready)" if self.phase is Phase.PREPARING else ""
            raise self._wrong_phase("commit", detail)
        refuse_passed(deadline_ts, now)
        return None

    def end_commit(self, reply: CommitReply) -> None:
        if self.checkpoint_id == reply.checkpoint_id:
            self.phase = Phase.COMMITTED
            self._committed[reply.checkpoint_id] = reply

    # restore ----------------------------------------------------------------------------------

    def admit_restore(
        self,
        checkpoint_id: str,
        attempt: int,
        deadline_ts: float,
        now: float,
        shape: RestoreShape | None = None,
    ) -> RestoreReply | None:
        """Refuse, replay or admit a restore. A restore of the restored checkpoint and attempt
        is replayed only when its `shape` (what the reply depends on besides the id and the
        attempt: the instance, the source, the scope, the peers) is the restored one; another
        shape is another restore, refused `conflicting_checkpoint` (docs/protocol.md,
        "Restore and replay")."""
        if (checkpoint_id, attempt) in self._stale_restores:
            raise ProtocolError(
                ErrorCode.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} was already restored under attempt {attempt} "
                "and resumed; restore it under a new attempt",
            )
        if self.phase is Phase.RESTORED and checkpoint_id == self.checkpoint_id:
            cached = self._restored.get((checkpoint_id, attempt))
            if cached is not None:
                restored_shape, reply = cached
                if restored_shape == shape:
                    return reply
                raise ProtocolError(
                    ErrorCode.CONFLICTING_CHECKPOINT,
                    f"checkpoint {checkpoint_id!r} is already restored under attempt {attempt} "
                    f"with another request: {_shape_differences(restored_shape, shape)}; "
                    "a replayed reply would not describe this one",
                )
            raise ProtocolError(
                ErrorCode.CONFLICTING_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} is already restored under attempt "
                f"{self.restore_attempt}, not {attempt}",
            )
        self._refuse_other_open(checkpoint_id)
        if self.phase is not Phase.IDLE:
            raise self._wrong_phase("restore")
        refuse_passed(deadline_ts, now)
        return None

    def end_restore(
        self, attempt: int, reply: RestoreReply, shape: RestoreShape | None = None
    ) -> None:
        self.phase = Phase.RESTORED
        self.checkpoint_id = reply.checkpoint_id
        self.restore_attempt = attempt
        self._restored[(reply.checkpoint_id, attempt)] = (shape, reply)

    # renew, resume, lease ---------------------------------------------------------------------

    def admit_renew(self, checkpoint_id: str, deadline_ts: float, now: float) -> None:
        self._refuse_stale(checkpoint_id)
        self._refuse_unknown(checkpoint_id)
        refuse_passed(deadline_ts, now)

    def resume(self, checkpoint_id: str) -> bool:
        """Apply a resume; True when the participant must reopen.

        Resume is the abort of every earlier phase and always succeeds for the open id, a stale
        id, or any id while idle (the id then goes stale, so a late prepare cannot reopen it).
        Only an unknown id while another checkpoint is open conflicts: it must not abort that one.
        """
        if self.phase is not Phase.IDLE and checkpoint_id == self.checkpoint_id:
            self._close()
            return True
        if self.phase is not Phase.IDLE:
            if checkpoint_id in self._stale:
                return False
            raise ProtocolError(
                ErrorCode.CONFLICTING_CHECKPOINT,
                f"checkpoint {self.checkpoint_id!r} is open ({self.phase.value}); "
                f"resume of {checkpoint_id!r} would abort it",
            )
        remember(self._stale, checkpoint_id)
        return True

    def extend_lease(self, until_ts: float) -> None:
        if self.lease_expires_ts is None or until_ts > self.lease_expires_ts:
            self.lease_expires_ts = until_ts

    def lapsed(self, now: float) -> bool:
        return (
            self.phase is not Phase.IDLE
            and self.lease_expires_ts is not None
            and self.lease_expires_ts <= now
        )

    def expire(self, now: float) -> str | None:
        """Resume by ourselves when the lease lapsed; returns the id that was abandoned."""
        if not self.lapsed(now):
            return None
        abandoned = self.checkpoint_id
        self._close()
        return abandoned

    def check_retire(self) -> None:
        if self.phase in OPEN_PHASES:
            raise self._wrong_phase("retire", " (resume the checkpoint first)")

    # helpers ----------------------------------------------------------------------------------

    def _close(self) -> None:
        checkpoint_id = self.checkpoint_id
        if checkpoint_id is not None:
            remember(self._stale, checkpoint_id)
            self._prepared.pop(checkpoint_id, None)
            self._committed.pop(checkpoint_id, None)
            if self.restore_attempt is not None:
                remember(self._stale_restores, (checkpoint_id, self.restore_attempt))
                self._restored.pop((checkpoint_id, self.restore_attempt), None)
        self.phase = Phase.IDLE
        self.checkpoint_id = None
        self.restore_attempt = None
        self.lease_expires_ts = None

    def _refuse_stale(self, checkpoint_id: str) -> None:
        if checkpoint_id in self._stale:
            raise ProtocolError(
                ErrorCode.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} was already resumed; start a new checkpoint id",
            )

    def _refuse_other_open(self, checkpoint_id: str) -> None:
        if self.phase is not Phase.IDLE and checkpoint_id != self.checkpoint_id:
            raise ProtocolError(
                ErrorCode.CONFLICTING_CHECKPOINT,
                f"checkpoint {self.checkpoint_id!r} is open ({self.phase.value}); resume it "
                f"before starting {checkpoint_id!r}",
            )

    def _refuse_unknown(self, checkpoint_id: str) -> None:
        if self.phase is Phase.IDLE or checkpoint_id != self.checkpoint_id:
            current = "none" if self.checkpoint_id is None else repr(self.checkpoint_id)
            raise ProtocolError(
                ErrorCode.UNKNOWN_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} is not open here (open: {current})",
            )

    def _wrong_phase(self, operation: str, detail: str = "") -> ProtocolError:
        return ProtocolError(
            ErrorCode.WRONG_PHASE,
            f"{operation} is not allowed in phase {self.phase.value}{detail}",
        )


def refuse_passed(deadline_ts: float, now: float) -> None:
    if deadline_ts <= now:
        raise ProtocolError(
            ErrorCode.DEADLINE_PASSED,
            f"deadline_ts {deadline_ts:.3f} is {now - deadline_ts:.3f}s in the past",
        )


def remember(memory: OrderedDict[Any, None], key: object) -> None:
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)
