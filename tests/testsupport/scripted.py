"""A participant with canned replies, for the unit tests of single phase steps of the checkpoint
and the recovery flows (tests/unit/test_checkpoint_phases.py, test_recovery_phases.py).

`Scripted` answers every control call the operator's flows make from what the test set on it
(which episodes are parked, whether a commit, persist or restore fails, whether a cut is held
in memory until its persist) and journals each call, so a
test of one step can say which calls that step made and nothing else. It is handed to a real
`rollout_protocol.Coordinator`, which the steps drive.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rollout_protocol import (
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    EpisodeId,
    ErrorCode,
    Manifest,
    ParticipantError,
    PersistRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    StatusReply,
)

RECORDS_SHA256 = "ab" * 32
"""The records digest of every manifest a `Scripted` participant commits."""


class Scripted:
    """One participant (`role`-`index`) with canned replies; `calls` journals (operation, id)."""

    def __init__(
        self,
        role: Role = Role.MODEL,
        *,
        index: int = 0,
        attempt: int = 3,
        parked: tuple[str, ...] = ("r1",),
        blockers: tuple[str, ...] = (),
        commit_fails: ErrorCode | None = None,
        restore_fails: ErrorCode | None = None,
        holds: bool = False,
        persist_fails: ErrorCode | None = None,
        persisting: Callable[[], Awaitable[None]] | None = None,
        waits_on: tuple[Role, ...] | None = None,
        committed: int | None = None,
    ) -> None:
        """`holds`: a participant that can persist after the resume (a cut asked of it is held
        in memory until `persist`); else it commits durably, as an older SDK does.
        `persisting`: awaited inside each persist, before it answers (a test's storage that is
        slow, or a clock it advances). `waits_on`: the roles its status says it waits on
        (None: it says nothing, as an older SDK). `committed`: the episodes its commit replies
        say its records hold (`CommitReply.committed_episodes`; None: not said, as an older
        SDK)."""
        self.role = role
        self.instance = f"{role.value}-{index}"
        self.attempt = attempt
        self.parked = parked
        self.blockers = blockers
        self.commit_fails = commit_fails
        self.restore_fails = restore_fails
        self.holds = holds
        self.persist_fails = persist_fails
        self.persisting = persisting
        self.waits_on = waits_on
        self.committed = committed
        self.calls: list[tuple[str, str]] = []

    def called(self, operation: str) -> list[str]:
        """The ids of every `operation` call, in order."""
        return [cid for op, cid in self.calls if op == operation]

    async def status(self, deadline_ts: float) -> StatusReply:
        self.calls.append(("status", ""))
        return StatusReply(
            role=self.role,
            instance=self.instance,
            attempt=self.attempt,
            phase=Phase.IDLE,
            waits_on=None if self.waits_on is None else list(self.waits_on),
        )

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self.calls.append(("prepare", request.checkpoint_id))
        return PrepareReply(
            checkpoint_id=request.checkpoint_id,
            phase=Phase.PREPARED if not self.blockers else Phase.PREPARING,
            ready=not self.blockers,
            episodes=[EpisodeId(rollout_id=r, attempt=self.attempt) for r in self.parked],
            episode_count=len(self.parked),
            blockers=[EpisodeId(rollout_id=r, attempt=self.attempt) for r in self.blockers],
            blocker_count=len(self.blockers),
        )

    async def commit(self, request: CommitRequest) -> CommitReply:
        self.calls.append(("commit", request.checkpoint_id))
        if self.commit_fails is not None:
            raise ParticipantError(self.commit_fails, "the scripted commit fails", self.instance)
        return self._reply(
            request.checkpoint_id, durable=not (self.holds and request.persist_after_resume)
        )

    async def persist(self, request: PersistRequest) -> CommitReply:
        self.calls.append(("persist", request.checkpoint_id))
        if self.persisting is not None:
            await self.persisting()
        if self.persist_fails is not None:
            raise ParticipantError(self.persist_fails, "the scripted persist fails", self.instance)
        return self._reply(request.checkpoint_id, durable=True)

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        self.calls.append(("discard", request.checkpoint_id))
        return DiscardReply(checkpoint_id=request.checkpoint_id, discarded=True, removed=False)

    def _reply(self, checkpoint_id: str, *, durable: bool) -> CommitReply:
        records = f"records-{RECORDS_SHA256}.jsonl"
        return CommitReply(
            durable=durable,
            checkpoint_id=checkpoint_id,
            phase=Phase.COMMITTED,
            manifest=Manifest(
                role=self.role,
                instance=self.instance,
                checkpoint_id=checkpoint_id,
                attempt=self.attempt,
                records_file=records,
                records_sha256=RECORDS_SHA256,
                record_count=len(self.parked),
                bytes=100,
            ),
            manifest_path=f"{checkpoint_id}/{self.instance}/manifest.json",
            committed_episodes=self.committed,
        )

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        self.calls.append(("restore", request.checkpoint_id))
        if self.restore_fails is not None:
            raise ParticipantError(self.restore_fails, "the scripted restore fails", self.instance)
        return RestoreReply(
            checkpoint_id=request.checkpoint_id,
            phase=Phase.RESTORED,
            attempt=request.attempt,
            restored=[EpisodeId(rollout_id=r, attempt=request.attempt) for r in self.parked],
            record_count=len(self.parked),
        )

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self.calls.append(("resume", request.checkpoint_id))
        return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def aclose(self) -> None:
        pass
