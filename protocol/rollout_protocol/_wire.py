"""Wire models of the participant control plane (`/checkpoint/v1`).

Every request and reply that crosses a process boundary is one of these strict models, so a
typo in a field is a 422 naming the field instead of a silently ignored key. The operator
imports these models too; `rollout_servers` never imports the operator.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    model_validator,
)

API_PREFIX = "/checkpoint/v1"
SCHEMA_VERSION = 1
MAX_BLOCKERS_REPORTED = 100
MAX_FINISHED_LISTED = 100_000
MAX_REMOVED_CHECKPOINTS = 64
"""At most this many checkpoints in one `remove` call (retention removes one or two at a time)."""
MAX_KEPT_LISTED = 20
"""A `remove` reply names at most this many entries it left in place (and counts them all)."""
"""At most this many rollouts in `RetireRequest.finished` and `RetireReply.finished`."""

CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""Checkpoint ids name a directory on shared storage: no slashes, no leading dot, bounded length."""

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

MAX_INSTANCE_INDEX = 999_999
"""The largest instance index (six digits): an instance names a directory under a checkpoint,
so its length is bounded like a checkpoint id's, and an index past it is refused as invalid
input before any storage is touched (docs/protocol.md, "Limits")."""

INSTANCE_PATTERN = r"^[a-z]+-[0-9]{1,6}$"
"""`<role>-<index>`: also a directory name under a checkpoint (index at most
`MAX_INSTANCE_INDEX`)."""

CheckpointId = Annotated[str, StringConstraints(pattern=CHECKPOINT_ID_PATTERN)]
RolloutId = Annotated[str, StringConstraints(pattern=ROLLOUT_ID_PATTERN)]
Attempt = Annotated[int, Field(ge=0)]
DeadlineTs = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PeerUrl = Annotated[str, StringConstraints(pattern=r"^https?://[^\s/?#]+/?$", max_length=512)]
"""A peer's base URL: scheme and host[:port] only (`http://10.0.3.7:8000`)."""
"""Absolute unix seconds; finite, so a lease computed from it always ends."""

WorkCounter = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
"""The name of a work counter: `model_tokens` (tokens a model generated) and `steps` (episode
steps completed) are the ones the reference servers and the operator know."""
WorkCounts = Annotated[dict[WorkCounter, Annotated[int, Field(ge=0)]], Field(max_length=16)]
"""Amounts of work by counter (see `WorkCounter`), reported in restore and retire replies."""


class Role(StrEnum):
    """The four participant roles, in prepare order."""

    ENVIRONMENT = "environment"
    MODEL = "model"
    AGENT = "agent"
    RESOURCES = "resources"


PREPARE_ORDER: tuple[Role, ...] = (Role.ENVIRONMENT, Role.MODEL, Role.AGENT, Role.RESOURCES)
"""Callers are parked before their callees, so no callee sees new work while it parks."""

RESUME_ORDER: tuple[Role, ...] = tuple(reversed(PREPARE_ORDER))
"""Callees before callers. The coordinator no longer resumes in an order (it resumes everyone at
once: a call that reaches a participant not yet resumed waits at its admission gate); kept for
tools that resume one participant at a time and want the order that makes no call wait."""

RETIRE_ORDER: tuple[tuple[Role, ...], ...] = (
    (Role.ENVIRONMENT,),
    (Role.AGENT,),
    (Role.MODEL, Role.RESOURCES),
)
"""Retire stops callers before callees; model and resources are retired together."""


class Phase(StrEnum):
    """Where a participant is in the checkpoint protocol (docs/protocol.md, "Phases")."""

    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class Capability(StrEnum):
    """An optional part of the protocol a participant takes part in (`StatusReply.capabilities`).

    A coordinator never needs to ask before it uses one: a request that asks for a capability
    carries a field a participant without it refuses as unknown before doing anything
    (`invalid_request` naming the field), and the coordinator sends it again without the field
    (docs/protocol.md, "Persist after resume")."""

    PERSIST_AFTER_RESUME = "persist_after_resume"
    """A commit that asks for it (`CommitRequest.persist_after_resume`) fixes the records as
    bytes held in memory and answers at once (`CommitReply.durable` false); `persist` writes
    them after the resume, `discard` drops them."""

    DECLARED_WAITS = "declared_waits"
    """The status says which roles the participant waits on (`StatusReply.waits_on`), so a
    prepare may park the roles nobody waits on in one stage (docs/design.md#44-order). Shown by
    that field alone, never listed in `StatusReply.capabilities`: a coordinator that reads the
    list knows only the values of its own release."""

    COMMITTED_EPISODES = "committed_episodes"
    """A commit (or cut, or persist) reply says how many episodes its records hold
    (`CommitReply.committed_episodes`), so a checkpoint's count is what was written, not what the
    prepare counted (docs/protocol.md, "Commit scope"). Shown by that field alone, as
    `declared_waits`."""


CAPABILITIES_HEADER: Final = "Rollout-Capabilities"
"""The request header in which a coordinator names the capabilities whose reply fields it reads
(comma-separated `Capability` values). A participant leaves a capability's fields
(`CAPABILITY_REPLY_FIELDS`) out of its replies to a coordinator that does not name it: an older
coordinator reads replies strictly and refuses a field it does not know (docs/protocol.md,
"Persist after resume")."""

CAPABILITY_REPLY_FIELDS: Final[Mapping[Capability, frozenset[str]]] = {
    Capability.PERSIST_AFTER_RESUME: frozenset({"capabilities", "held_bytes", "durable"}),
    Capability.DECLARED_WAITS: frozenset({"waits_on"}),
    Capability.COMMITTED_EPISODES: frozenset({"committed_episodes"}),
}
"""The reply fields each capability added (`StatusReply.capabilities` and `held_bytes`,
`CommitReply.durable`; `StatusReply.waits_on`; `CommitReply.committed_episodes`).
A field's name is left out of every reply of the call it is unread by, so it is never the name
of a field an older coordinator reads in another reply (`PrepareReply.episode_count`)."""


def fields_unread_by(header: str | None, request: object = None) -> frozenset[str]:
    """The reply fields a coordinator does not read: those of the capabilities it names neither
    in `CAPABILITIES_HEADER` (`header`) nor by asking for them in `request` (a commit with
    `persist_after_resume` reads `durable`)."""
    named = {part.strip() for part in (header or "").split(",")}
    named |= {cap.value for cap in Capability if getattr(request, cap.value, None)}
    return frozenset().union(
        *(fields for cap, fields in CAPABILITY_REPLY_FIELDS.items() if cap.value not in named)
    )


class MultiProcess(StrEnum):
    """How a participant pod's server runs its worker processes (`StatusReply.multi_process`)."""

    SINGLE = "single"
    """One process: its control plane sees every episode."""
    MANAGED = "managed"
    """Several workers behind one control plane that coordinates them all
    (`rollout_protocol.workers`)."""
    UNMANAGED = "unmanaged"
    """Several workers nobody coordinates: a checkpoint would cover whichever worker answered.
    The operator refuses to checkpoint such a set."""


class ErrorCode(StrEnum):
    """Machine-readable error codes; each maps to one HTTP status (see `HTTP_STATUS`)."""

    UNAUTHORIZED = "unauthorized"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_CHECKPOINT = "unknown_checkpoint"
    STALE_CHECKPOINT = "stale_checkpoint"
    CONFLICTING_CHECKPOINT = "conflicting_checkpoint"
    WRONG_PHASE = "wrong_phase"
    DEADLINE_PASSED = "deadline_passed"
    STORAGE_FAILED = "storage_failed"
    RECORDS_INVALID = "records_invalid"
    RECORDS_UNREACHABLE = "records_unreachable"
    """Restore only: no manifest of the checkpoint on the storage this participant sees (its
    folder or manifest absent). The records may exist elsewhere (a lost node's own volume);
    nothing here says they are damaged."""
    ATTEMPT_MISMATCH = "attempt_mismatch"
    ATTEMPT_RETIRED = "attempt_retired"
    TASK_MISMATCH = "task_mismatch"
    ADMISSION_CLOSED = "admission_closed"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The request body is larger than the participant accepts (`ROLLOUT_MAX_BODY_BYTES`)."""
    LIMIT_EXCEEDED = "limit_exceeded"
    """A bounded table is full (retire marks): free entries first (`forget`), then retry."""
    PERSIST_BACKLOG = "persist_backlog"
    """Commit only: a cut would hold more than the participant's bound on records held for
    persists not yet finished (`ROLLOUT_MAX_HELD_BYTES`); persist or discard those first."""
    NOT_FOUND = "not_found"
    UNSUPPORTED = "unsupported"
    """The participant does not implement an optional capability the call needs (re-wiring)."""
    INTERNAL = "internal"
    UNREACHABLE = "unreachable"
    """Client side only: a participant or peer could not be reached (connection refused or
    reset until the call's deadline)."""
    UNRESPONSIVE = "unresponsive"
    """Client side only: a participant took the connection but did not answer by the call's
    deadline (hung, stopped, overloaded); it may still be alive."""


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.UNKNOWN_CHECKPOINT: 404,
    ErrorCode.STALE_CHECKPOINT: 410,
    ErrorCode.CONFLICTING_CHECKPOINT: 409,
    ErrorCode.WRONG_PHASE: 409,
    ErrorCode.DEADLINE_PASSED: 408,
    ErrorCode.STORAGE_FAILED: 507,
    ErrorCode.RECORDS_INVALID: 422,
    ErrorCode.RECORDS_UNREACHABLE: 422,
    ErrorCode.ATTEMPT_MISMATCH: 409,
    ErrorCode.ATTEMPT_RETIRED: 410,
    ErrorCode.TASK_MISMATCH: 409,
    ErrorCode.ADMISSION_CLOSED: 503,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.LIMIT_EXCEEDED: 429,
    ErrorCode.PERSIST_BACKLOG: 429,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNREACHABLE: 502,
    ErrorCode.UNRESPONSIVE: 504,
}

RESTORE_CODES: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.ATTEMPT_RETIRED,
        ErrorCode.ATTEMPT_MISMATCH,
        ErrorCode.ADMISSION_CLOSED,
        ErrorCode.UNREACHABLE,
        ErrorCode.INTERNAL,
    }
)
"""The `/run` answers that mean "this attempt's servers are gone, replaced or restored": the
rollout is played again under the set's next attempt (docs/sdk.md, section 2). A trainer client
waits for that attempt and re-issues the call; any other code ends the episode for good."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorDetail(StrictModel):
    """The code and a human-readable detail of a refused call."""

    code: ErrorCode
    detail: str


class ErrorBody(StrictModel):
    """`{"error": {"code": ..., "detail": ...}}`, the body of every non-2xx reply."""

    error: ErrorDetail


class ProtocolError(Exception):
    """Raised anywhere in a server to answer with an `ErrorBody` and the code's HTTP status.

    `ControlPlane.install` registers the handler, so rollout servers raise this for their own
    refusals (`task_mismatch`, `attempt_retired`, ...) and get the same error shape.
    """

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail

    @property
    def status_code(self) -> int:
        return HTTP_STATUS[self.code]

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(code=self.code, detail=self.detail))


class EpisodeId(StrictModel):
    """An episode is one rollout under one attempt; a restore moves it to `attempt + 1`."""

    rollout_id: RolloutId
    attempt: Attempt

    def __str__(self) -> str:
        return f"{self.rollout_id}@{self.attempt}"


# --- requests -------------------------------------------------------------------------------


class ControlRequest(StrictModel):
    """Every control call names its checkpoint and an absolute deadline (unix seconds).

    The participant extends its lease to `deadline_ts + lease_grace_seconds` on every call.
    """

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


class PrepareRequest(ControlRequest):
    """Close admission and park in-flight work at boundaries by `deadline_ts`."""

    rollout_ids: list[RolloutId] | None = Field(
        default=None,
        description="List the parked episodes of these rollouts in the reply (a requested "
        "commit scope, bounded by it); None lists none: the reply carries counts and a digest, "
        "so its size does not grow with the number of episodes.",
    )


class RenewRequest(ControlRequest):
    """Extend the lease of the open checkpoint without changing its phase."""


class CommitRequest(ControlRequest):
    """Write the records of the scope (`episode_ids`; all when absent), then the manifest."""

    rollout_ids: list[RolloutId] | None = Field(
        default=None,
        description="The commit scope. None commits every parked episode; restored state of "
        "episodes outside the scope is released.",
    )
    excluded_rollout_ids: list[RolloutId] | None = Field(
        default=None,
        description="Rollouts left out of the scope (the prepare's restarts): not written, "
        "their restored state released. Sent only when not empty.",
    )
    persist_after_resume: Literal[True] | None = Field(
        default=None,
        description="The cut: fix the records as bytes held in memory and answer at once with "
        "the manifest they will have (`CommitReply.durable` false); `persist` writes them after "
        "the resume. Sent only when asked (a participant without the capability refuses the "
        "field, and is committed again without it).",
    )


class PersistRequest(ControlRequest):
    """Write and fsync the records a cut holds, then the manifest; answer when durable."""


class DiscardRequest(ControlRequest):
    """Drop the records a cut holds and remove what a persist of them wrote (the checkpoint will
    not be published)."""


class RestoreRequest(ControlRequest):
    """Verify a published checkpoint's records and install them under `attempt`."""

    attempt: Attempt = Field(description="The attempt the records are installed under (N + 1).")
    source_instance: str | None = Field(
        default=None,
        pattern=INSTANCE_PATTERN,
        description="Read the records of this instance (`role-index`); default: this instance.",
    )
    rollout_ids: list[RolloutId] | None = Field(
        default=None, description="Restore only these rollouts; None restores every record."
    )
    peers: dict[Role, PeerUrl] | None = Field(
        default=None,
        description="The peers this participant calls from the restored attempt on, by role. "
        "An InPlace recovery sends it to a kept participant whose peer was replaced; None keeps "
        "the current wiring. A participant that cannot re-wire answers `unsupported`.",
    )
    index: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INSTANCE_INDEX,
        description="The instance index this participant is from the restored attempt on: a "
        "recovery that adopts a standby participant (started with ROLLOUT_STANDBY=1) gives it "
        "the lost instance's identity, whose records it then restores. A participant that is "
        "not a standby refuses an index other than its own (`invalid_request`).",
    )


class ResumeRequest(ControlRequest):
    """Reopen admission; aborts the checkpoint when it was not committed."""


class RetireRequest(StrictModel):
    """Stop an attempt's work for the given rollouts and free its state.

    Retire is used only while no checkpoint is open; `operation_id` makes a retried call
    idempotent.
    """

    operation_id: CheckpointId
    deadline_ts: DeadlineTs
    attempt: Attempt
    rollout_ids: list[RolloutId] | None = Field(
        default=None, description="None retires every episode of the attempt."
    )
    finished: list[RolloutId] | None = Field(
        default=None,
        max_length=MAX_FINISHED_LISTED,
        description="Rollouts whose episodes finished under the retired attempt (an "
        "environment that retired before this participant returned their results): their "
        "work is not counted as lost (`RetireReply.lost`). None: the participant decides by "
        "itself. Changes nothing about what is retired.",
    )


class ForgetRequest(StrictModel):
    """Drop the retire marks of these finished rollouts."""

    operation_id: CheckpointId
    deadline_ts: DeadlineTs
    rollout_ids: list[RolloutId]


class RemoveRequest(StrictModel):
    """Remove checkpoints' records from this participant's own set directory.

    Only the protocol's own files below the participant's set directory are removed, never
    through a symlink (see `remove_checkpoint_files`); the request names checkpoints, never a
    path, so a caller can never reach another set's records. Idempotent: an absent checkpoint
    is reported absent."""

    deadline_ts: DeadlineTs
    checkpoint_ids: list[CheckpointId] = Field(
        default_factory=list,
        max_length=MAX_REMOVED_CHECKPOINTS,
        description="The checkpoints whose records go.",
    )
    whole_set: bool = Field(
        default=False,
        description="Remove every checkpoint of the set and then the set's directory (the set "
        "was deleted). Refused with `checkpoint_ids`, and while a checkpoint is open.",
    )

    @model_validator(mode="after")
    def _one_scope(self) -> RemoveRequest:
        if self.whole_set == bool(self.checkpoint_ids):
            raise ValueError("name checkpoint_ids or set whole_set, exactly one of the two")
        return self


# --- replies --------------------------------------------------------------------------------


class StatusReply(StrictModel):
    """A participant's phase, attempt, lease and episode counts."""

    role: Role
    instance: str
    set_name: str | None = Field(
        default=None, description="The set whose directory this participant writes under."
    )
    set_dir: str | None = Field(
        default=None,
        description="That directory under the checkpoint root when it is not the set name "
        "(`<namespace>/<set>/<uid>` for a set the operator runs).",
    )
    standby: bool = Field(
        default=False,
        description="A standby participant: no instance of the set yet; a restore with an "
        "`index` adopts it.",
    )
    attempt: Attempt
    phase: Phase
    checkpoint_id: str | None = None
    lease_expires_ts: float | None = None
    live_episodes: int = 0
    parked_episodes: int = 0
    restored_episodes: int = 0
    retired_attempts: list[Attempt] = Field(default_factory=list)
    multi_process: MultiProcess = Field(
        default=MultiProcess.SINGLE,
        description="`single`, `managed` (several worker processes, all coordinated by this "
        "control plane) or `unmanaged` (several workers this plane does not coordinate: the "
        "operator refuses to checkpoint the set).",
    )
    workers: int = Field(default=1, ge=1, description="The server's worker processes.")
    capabilities: list[Capability] = Field(
        default_factory=list,
        description="Optional parts of the protocol this participant takes part in "
        "(`persist_after_resume`).",
    )
    held_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes of records held by cuts whose persist has not finished.",
    )
    waits_on: list[Role] | None = Field(
        default=None,
        max_length=len(Role),
        description="The roles this participant calls from wait-mode steps (its callees that "
        "must still admit calls while it parks); null: not declared, taken as every role after "
        "it in prepare order (docs/design.md#44-order).",
    )


class PrepareReply(StrictModel):
    """Whether every episode parked: their count and digest, the blockers (first 100) and the
    episodes that will restart. Bounded whatever the number of episodes (`PrepareRequest`)."""

    checkpoint_id: CheckpointId
    phase: Phase
    ready: bool
    episodes: list[EpisodeId] = Field(
        default_factory=list,
        description="Parked episodes of the rollouts `PrepareRequest.rollout_ids` names (none "
        "when it names none; participants before records format 2 list every one).",
    )
    episode_count: int = Field(
        default=0, ge=0, description="Episodes parked at a boundary (capturable), listed or not."
    )
    episodes_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="Set digest of the parked episodes: the sum mod 2**256 of sha256("
        "`rollout_id@attempt`) over the distinct ids, in hex; independent of order, so equal "
        "digests mean the same episodes.",
    )
    blockers: list[EpisodeId] = Field(
        default_factory=list,
        max_length=MAX_BLOCKERS_REPORTED,
        description="Episodes not yet parked (first 100).",
    )
    blocker_count: int = 0
    restarts: list[EpisodeId] = Field(
        default_factory=list, description="Episodes that cannot be captured and will restart."
    )


class Manifest(StrictModel):
    """Written last, next to the records file; its presence means the records are complete.

    `schema_version` is the records format: 2 names the records file by the sha256 of its
    lines' sha256 digests (records encoded ahead, see `_storage.records_digest`); 1, written
    before encode-ahead, by the sha256 of the whole file. Both are read."""

    schema_version: Literal[1, 2] = 2
    role: Role
    instance: str
    checkpoint_id: CheckpointId
    attempt: Attempt
    records_file: str
    records_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    record_count: int = Field(ge=0)
    bytes: int = Field(ge=0)


class RenewReply(StrictModel):
    """The lease's new expiry."""

    checkpoint_id: CheckpointId
    phase: Phase
    lease_expires_ts: float


class PublishedParticipant(StrictModel):
    """One participant's part of a published checkpoint (a summary of its `Manifest`)."""

    instance: str = Field(pattern=INSTANCE_PATTERN)
    role: Role
    manifest_path: str = Field(description="Relative to the checkpoint root.")
    records_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    record_count: int = Field(ge=0)
    bytes: int = Field(ge=0)
    rollout_ids: list[RolloutId] | None = Field(
        default=None,
        description="The rollouts whose records the participant wrote, where its restore must "
        "name them (a NeMo Gym participant: `CommitReply.rollout_ids`); None: a restore asks "
        "for every record.",
    )


class CheckpointManifest(StrictModel):
    """`<root>/<set>/<checkpoint_id>/checkpoint.json`, written last by a coordinator that runs
    without an operator: its presence is what makes the checkpoint restorable there (with the
    operator, the RolloutCheckpoint's Ready condition plays that part)."""

    schema_version: Literal[1] = 1
    set_name: CheckpointId
    checkpoint_id: CheckpointId
    attempt: Attempt = Field(description="The attempt whose state the checkpoint captured.")
    published_ts: float
    rollout_ids: list[RolloutId] = Field(
        default_factory=list, description="The commit scope: rollouts that continue."
    )
    restarts: int = Field(default=0, ge=0)
    participants: list[PublishedParticipant]
    trainer_step: int | None = None
    prepare_seconds: float = Field(default=0.0, ge=0)
    commit_seconds: float = Field(default=0.0, ge=0)


class CommitReply(StrictModel):
    """What a participant wrote: its manifest, the records' digest, count and size."""

    checkpoint_id: CheckpointId
    phase: Phase
    manifest: Manifest
    manifest_path: str = Field(description="Relative to the checkpoint root.")
    rollout_ids: list[RolloutId] | None = Field(
        default=None,
        exclude=True,
        description="The rollouts whose records were written. Not part of our dialect's reply "
        "(`exclude`: never serialized): our participants restore every record they wrote. A "
        "NeMo Gym participant's restore must name its episodes, so its commit reply lists them "
        "(Gym's `episode_ids`), the client reads them into this field, and the coordinator "
        'keeps them with the checkpoint for the restore (docs/protocol.md, "The NeMo Gym '
        'dialect").',
    )
    durable: bool = Field(
        default=True,
        description="True: the records and the manifest are on storage (fsynced). False: a cut "
        "(`CommitRequest.persist_after_resume`): the records are held in memory and `manifest` "
        "is the manifest a `persist` will write at `manifest_path`.",
    )
    committed_episodes: int | None = Field(
        default=None,
        ge=0,
        description="Episodes whose records this commit wrote (or this cut holds): the distinct "
        "rollouts of its records. It can exceed the prepare's count: a `/run` that reached the "
        "participant after its prepare replied is parked at its first boundary and written "
        "too. Sent only to a coordinator that names `committed_episodes` (capability); None: "
        "not said (an older participant).",
    )


class DiscardReply(StrictModel):
    """Whether a cut of the checkpoint was held here, and whether files of it were removed."""

    checkpoint_id: CheckpointId
    discarded: bool = Field(description="Records of a cut were held here and are released.")
    removed: bool = Field(description="Files a persist of it wrote here were removed.")


class RestoreReply(StrictModel):
    """How many episodes were installed under the new attempt."""

    checkpoint_id: CheckpointId
    phase: Phase
    attempt: Attempt
    restored: list[EpisodeId]
    record_count: int
    kept: WorkCounts | None = Field(
        default=None,
        description="The work the installed records hold, which the episodes continue from "
        "instead of doing it again (`model_tokens` of cut and held generations, `steps` "
        "completed). Optional: None when the participant does not count work.",
    )


class ResumeReply(StrictModel):
    """The phase the participant left (resume is also the abort of any earlier phase)."""

    checkpoint_id: CheckpointId
    phase: Phase


class RetireReply(StrictModel):
    """How many episodes of the retired attempt were stopped."""

    operation_id: CheckpointId
    retired: list[EpisodeId]
    lost: WorkCounts | None = Field(
        default=None,
        description="The work of the retired attempt this participant did after checkpoint "
        "`lost_since`, except for rollouts that finished (see `RetireRequest.finished`): a "
        "restore of that checkpoint has it done again. Optional: None when the participant "
        "does not count work.",
    )
    finished: list[RolloutId] | None = Field(
        default=None,
        max_length=MAX_FINISHED_LISTED,
        description="Rollouts this participant saw finish under the retired attempt after "
        "`lost_since` (an environment: whose results it returned; an episode runtime: whose "
        "episodes ended, those in final cleanup included, but none the retire stopped). "
        "Optional.",
    )
    lost_since: CheckpointId | None = Field(
        default=None,
        description="The checkpoint `lost` counts from: the last one this process committed or "
        "restored (None: none, `lost` is all the attempt's work).",
    )


class ForgetReply(StrictModel):
    """How many retire marks were dropped."""

    operation_id: CheckpointId
    forgotten: int


class RemoveReply(StrictModel):
    """What a `remove` found: checkpoints removed, absent, and entries it left in place."""

    removed: list[str] = Field(default_factory=list)
    absent: list[str] = Field(default_factory=list)
    kept: list[str] = Field(
        default_factory=list,
        max_length=MAX_KEPT_LISTED,
        description="Entries left in place (not written by the protocol: a file someone added, "
        "a symlink, a special file), relative to the checkpoint root; the first "
        f"{MAX_KEPT_LISTED}.",
    )
    kept_count: int = 0


# --- records --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One line of a records file: a participant's state for one episode (or one held item).

    `kind` is participant specific (`boundary`, `session`, `cut`, `held`, ...); `data` is the
    participant's own JSON. `attempt` is the attempt that produced the state; restore installs
    it under the restore request's attempt.

    A plain dataclass rather than a model: a checkpoint builds one per live episode while every
    episode waits, so building must cost nothing. Validation happens where records cross a
    boundary, when they are read back from storage (`RECORDS`, strict, extra keys refused).
    """

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)

    kind: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    rollout_id: RolloutId
    attempt: Attempt
    key: Annotated[str, StringConstraints(max_length=256)] = ""
    """Distinguishes several records of one rollout."""
    data: dict[str, Any] = field(default_factory=dict)


RECORD = TypeAdapter(Record)
"""Validates one records-file line into a `Record` and serialises one back."""


def task_digest(task: dict[str, Any]) -> str:
    """A stable digest of a task, so a restored episode is only continued with the same task."""
    canonical = json.dumps(task, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def instance_name(role: Role | str, index: int) -> str:
    return f"{Role(role).value}-{index}"
