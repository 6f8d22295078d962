"""The outcome models of the coordinator's steps (`_coordinator.py`): pydantic, so that the
operator can store each step's outcome as JSON between steps, and each names every
participant's failure (`Failure`) instead of raising half way.

Held apart from the `Coordinator` that returns them: they are data the operator, the CLI and
the conformance kit read, while the coordinator is the calls that make them. They are public
from `rollout_protocol` (and importable from `_coordinator` as before).
"""

from __future__ import annotations

from collections.abc import Collection

from pydantic import Field

from ._client import ParticipantError
from ._wire import (
    MAX_BLOCKERS_REPORTED,
    EpisodeId,
    ErrorCode,
    Manifest,
    Role,
    StatusReply,
    StrictModel,
    WorkCounts,
)


class Failure(StrictModel):
    """One participant's refusal or absence, as stored in outcomes and reported to users."""

    instance: str
    code: ErrorCode
    detail: str

    @classmethod
    def of(cls, error: ParticipantError) -> Failure:
        return cls(instance=error.instance, code=error.code, detail=error.detail)

    def __str__(self) -> str:
        return f"{self.instance}: {self.code.value}: {self.detail}"


class PrepareOutcome(StrictModel):
    """Whether every stage parked in time; blockers and restarts of those that did not."""

    checkpoint_id: str
    ready: bool
    prepared: list[str] = Field(description="Instances whose prepare was ready.")
    stopped_at: Role | None = Field(default=None, description="The first stage not ready.")
    episodes: list[EpisodeId] = Field(
        default_factory=list,
        description="Parked episodes the replies listed: those of the requested scope "
        "(`prepare(scope=)`); participants before records format 2 list all.",
    )
    episode_count: int = Field(
        default=0,
        description="Parked episodes: the largest of the roles' counts (each role's instances "
        "summed; every episode of a set passes through the role that sees most of them).",
    )
    episodes_sha256: dict[str, str] = Field(
        default_factory=dict, description="By instance: the digest of its parked episodes."
    )
    blockers: list[EpisodeId] = Field(default_factory=list, max_length=MAX_BLOCKERS_REPORTED)
    blocker_count: int = 0
    restarts: list[EpisodeId] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)

    def scope(self, requested: Collection[str] | None = None) -> list[str] | None:
        """The commit scope: None (every parked episode, less `excluded()`) when nothing is
        requested; else the requested rollouts the prepare listed as parked, minus restarts."""
        if requested is None:
            return None
        restarting = {episode.rollout_id for episode in self.restarts}
        live = {episode.rollout_id for episode in self.episodes} - restarting
        return sorted(live & set(requested))

    def excluded(self) -> list[str]:
        """Rollouts every participant leaves out of the commit: the restarts."""
        return sorted({episode.rollout_id for episode in self.restarts})

    def committed_count(self, scope: Collection[str] | None) -> int:
        """Episodes a commit of `scope` continues: the scope's size, or the parked count less
        the restarts."""
        if scope is not None:
            return len(scope)
        return max(0, self.episode_count - len(self.excluded()))


class CommitOutcome(StrictModel):
    """Every participant's commit reply, or its failure, for one checkpoint."""

    checkpoint_id: str
    ok: bool
    scope: list[str] | None
    excluded: list[str] = Field(
        default_factory=list, description="Rollouts left out of the scope (restarts)."
    )
    manifests: dict[str, Manifest] = Field(default_factory=dict)
    manifest_paths: dict[str, str] = Field(default_factory=dict)
    listed: dict[str, list[str]] = Field(
        default_factory=dict,
        description="By instance, the rollouts a participant's commit listed "
        "(`CommitReply.rollout_ids`: a NeMo Gym participant, whose restore must name them).",
    )
    record_count: int = 0
    bytes: int = 0
    committed_episodes: dict[str, int] = Field(
        default_factory=dict,
        description="By instance: the episodes its records hold (`CommitReply."
        "committed_episodes`); an instance that did not say (an older participant, one "
        "spoken to in NeMo Gym's dialect) is not here.",
    )
    failures: list[Failure] = Field(default_factory=list)
    held: list[str] = Field(
        default_factory=list,
        description="Instances whose records are held in memory by a cut (`commit(..., "
        "persist_after_resume=True)`), not yet durable: `manifests` holds the manifests a "
        "persist will write. Every other instance with a manifest is durable. Empty once "
        "persisted, and for a commit inside the pause.",
    )

    def episode_count(self, prepared: PrepareOutcome) -> int:
        """Episodes the records hold, the checkpoint's count: the largest role's (its
        instances summed), as `PrepareOutcome.episode_count` counts, when every participant
        said; else (an older participant, NeMo Gym's dialect) what the prepare counted less
        the restarts (`PrepareOutcome.committed_count`), which misses a `/run` that reached a
        participant after its prepare replied (docs/protocol.md, "Commit scope")."""
        if not self.manifests or set(self.manifests) - set(self.committed_episodes):
            return prepared.committed_count(self.scope)
        by_role: dict[str, int] = {}
        for instance, count in self.committed_episodes.items():
            role = instance.rsplit("-", 1)[0]
            by_role[role] = by_role.get(role, 0) + count
        return max(by_role.values())

    @property
    def durable(self) -> bool:
        """Every manifest here is on storage (nothing is held for a persist)."""
        return not self.held

    @property
    def attempt(self) -> int | None:
        attempts = {manifest.attempt for manifest in self.manifests.values()}
        return max(attempts) if attempts else None


class DiscardOutcome(StrictModel):
    """Which participants released a cut's records and removed what its persist wrote."""

    checkpoint_id: str
    discarded: list[str] = Field(
        default_factory=list, description="Instances that held records of the cut."
    )
    removed: list[str] = Field(
        default_factory=list, description="Instances that removed files of the checkpoint."
    )
    failures: list[Failure] = Field(default_factory=list)


class ResumeOutcome(StrictModel):
    """Which participants reopened admission, and which could not be reached."""

    checkpoint_id: str
    resumed: list[str] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)


class LostWork(StrictModel):
    """What one participant's retire said it had done after a checkpoint (`RetireReply.lost`)."""

    since: str | None = Field(description="The checkpoint the counts start from.")
    counts: WorkCounts


class RetireOutcome(StrictModel):
    """Which participants stopped the retired attempt's work, and which failed to."""

    operation_id: str
    attempt: int
    retired: list[EpisodeId] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)
    lost: dict[str, LostWork] = Field(
        default_factory=dict,
        description="By instance: the work each participant that counts work reported lost.",
    )
    finished_known: bool = Field(
        default=False,
        description="Whether later stages were told which rollouts finished (every "
        "participant of a role in `finished_from` retired and said).",
    )


class ForgetOutcome(StrictModel):
    """How many retire marks each participant dropped, or why it could not."""

    operation_id: str
    forgotten: int = 0
    failures: list[Failure] = Field(default_factory=list)


class RestoreOutcome(StrictModel):
    """Whether every participant installed the records under the new attempt (all or nothing)."""

    checkpoint_id: str
    attempt: int
    ok: bool
    restored: dict[str, int] = Field(
        default_factory=dict, description="Records installed per instance."
    )
    episodes: list[EpisodeId] = Field(default_factory=list)
    kept: dict[str, WorkCounts] = Field(
        default_factory=dict,
        description="By instance: the work the installed records hold (`RestoreReply.kept`).",
    )
    failures: list[Failure] = Field(default_factory=list)
    retired: RetireOutcome | None = Field(
        default=None, description="Set when the restore failed and the attempt was retired."
    )
    resumed: ResumeOutcome | None = None


class StatusOutcome(StrictModel):
    """Every participant's `/status` reply, or its failure."""

    statuses: list[StatusReply] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)


class CheckpointDurations(StrictModel):
    """How long each stage of one checkpoint took, and how long episodes were paused."""

    prepare_seconds: float = 0.0
    commit_seconds: float = Field(
        default=0.0,
        description="The commit inside the pause (with a persist after the resume: the cut).",
    )
    pause_seconds: float = Field(default=0.0, description="First prepare to resume done.")
    persist_seconds: float = Field(
        default=0.0,
        description="The cut's end to every record durable (the persist after the resume); 0 "
        "when the commit wrote them inside the pause.",
    )
    total_seconds: float = 0.0


class CheckpointResult(StrictModel):
    """The outcome of a whole `Coordinator.checkpoint()`: published or failed, with counts."""

    checkpoint_id: str
    ok: bool
    reason: str = Field(
        description="CamelCase: Published, Committed, NotReady, PrepareFailed, CommitFailed, "
        "PersistFailed, PublishFailed."
    )
    message: str
    attempt: int | None = None
    prepare: PrepareOutcome
    commit: CommitOutcome | None = Field(
        default=None,
        description="The durable commit: with a persist after the resume, the persist's outcome "
        "(the cut's when the persist was never reached).",
    )
    resume: ResumeOutcome | None = None
    discard: DiscardOutcome | None = Field(
        default=None, description="Set when a cut's records were discarded (a failed checkpoint)."
    )
    published: str | None = Field(default=None, description="Path of checkpoint.json.")
    durations: CheckpointDurations = Field(default_factory=CheckpointDurations)
