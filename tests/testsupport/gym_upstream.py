"""Mirrors of NeMo Gym's checkpoint control models, for the contract tests of our Gym dialect.

Written here by hand, field by field, from NVIDIA-NeMo/Gym at commit
05bf55ac50b5d95eb203ceb8f59145545c6def64 (`nemo_gym/_checkpoint/control.py`, `errors.py`,
`store.py`, `coordination.py`) and, for `EpisodeId`, `nemo_gym/episode_types.py` of the released
nemo-gym 0.7.0; docs/protocol.md ("The NeMo Gym dialect") pins that commit and says why. They
are mirrors, not a second implementation: each model is what Gym validates or writes at that
commit, so a body our dialect sends that Gym would refuse (an unknown field: Gym's requests are
`extra="forbid"`) fails validation here, and a reply our participants give that Gym's code would
not write (a field it does not have, a capture key where it has one) does too.

Gym's replies are plain dicts in its code; the reply mirrors below are `extra="forbid"` too,
except status and commit, which Gym extends with each participant's own fields
(`status_extra()`, `commit_reply()`): those two allow extra fields.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator

UPSTREAM_GYM_COMMIT = "05bf55ac50b5d95eb203ceb8f59145545c6def64"
CHECKPOINT_ROUTE_PREFIX = "/ng-control/v1/checkpoint"
_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
PHASES = Literal["idle", "preparing", "prepared", "committed", "restored"]
KINDS = Literal["environment", "model", "agent", "resources"]


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Extensible(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- requests (control.py: CheckpointRequest and its subclasses; episode_types.EpisodeId) -----


class UpstreamEpisodeId(_Forbid):
    """`EpisodeId`: the rollout id may not end with the capture-key suffix `-a<N>`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1, pattern=_ID_PATTERN)
    attempt: int = Field(default=0, ge=0)

    @field_validator("rollout_id")
    @classmethod
    def _reserved_suffix(cls, rollout_id: str) -> str:
        if re.search(r"-a[1-9][0-9]*$", rollout_id):
            raise ValueError("rollout_id must not end with the reserved attempt suffix '-a<N>'")
        return rollout_id

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"


class UpstreamCheckpointRequest(_Forbid):
    """The body of prepare, renew and resume."""

    checkpoint_id: str = Field(min_length=1, max_length=128, pattern=_ID_PATTERN)
    deadline_ts: FiniteFloat


class UpstreamCommitRequest(UpstreamCheckpointRequest):
    checkpoint_dir: str = Field(min_length=1)
    episode_ids: list[UpstreamEpisodeId] | None = None


class UpstreamRestoreRequest(UpstreamCheckpointRequest):
    checkpoint_dir: str = Field(min_length=1)
    episode_ids: list[UpstreamEpisodeId]


class UpstreamRetireRequest(UpstreamCheckpointRequest):
    episode_ids: list[UpstreamEpisodeId] = Field(min_length=1)


class UpstreamForgetRequest(UpstreamCheckpointRequest):
    rollout_ids: list[str] = Field(min_length=1)


# --- replies (control.py: ParticipantControlPlane's return values; store.py: the manifest) ----


class UpstreamPrepareReport(_Forbid):
    """`PrepareReport.model_dump()`: blockers and restarts are capture keys."""

    ready: bool
    blockers: list[str]
    blocker_count: int
    counts: dict[str, int]
    restarts: list[str]


class UpstreamStatusReply(_Extensible):
    kind: KINDS
    instance: str
    phase: PHASES
    checkpoint_id: str | None
    lease_expires_at: float | None
    retired_rollouts: int
    report: UpstreamPrepareReport


class UpstreamPrepareReply(_Forbid):
    phase: PHASES
    report: UpstreamPrepareReport


class UpstreamRenewReply(_Forbid):
    lease_expires_at: float


class UpstreamManifest(_Forbid):
    """What `store.write_participant_state` returns and writes as `manifest.json`."""

    schema_version: int
    kind: KINDS
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    record_count: int = Field(ge=0)


class UpstreamCommitReply(_Extensible):
    phase: Literal["committed"]
    manifest: UpstreamManifest
    episode_ids: list[str]


class UpstreamRestoreReply(_Forbid):
    phase: Literal["restored"]
    source_checkpoint_id: str
    restored: list[str]


class UpstreamResumeReply(_Forbid):
    phase: Literal["idle"]
    idempotent: bool


class UpstreamRetireReply(_Forbid):
    retired: list[str]


class UpstreamForgetReply(_Forbid):
    forgotten: list[str]


# --- errors (errors.py: ControlError.response(); FastAPI's request validation) ----------------

UPSTREAM_ERROR_STATUS: dict[str, int] = {
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "deadline_exceeded": 409,
    "stale_attempt": 409,
    "admission_closed": 409,
    "restart_in_scope": 409,
    "rollout_id_required": 400,
    "unauthorized": 401,
    "invalid_checkpoint_state": 422,
}
"""Every `ControlError` subclass's code and status at the pinned commit."""


class UpstreamErrorDetail(_Forbid):
    code: str
    detail: str


class UpstreamErrorBody(_Forbid):
    error: UpstreamErrorDetail


class UpstreamValidationItem(_Extensible):
    type: str
    loc: list[str | int]
    msg: str


class UpstreamValidationBody(_Forbid):
    """FastAPI's 422 body for a request a Gym model refuses."""

    detail: list[UpstreamValidationItem]


REQUESTS: dict[str, type[BaseModel] | None] = {
    "status": None,
    "prepare": UpstreamCheckpointRequest,
    "renew": UpstreamCheckpointRequest,
    "commit": UpstreamCommitRequest,
    "restore": UpstreamRestoreRequest,
    "resume": UpstreamCheckpointRequest,
    "retire": UpstreamRetireRequest,
    "forget": UpstreamForgetRequest,
}
"""`_OPERATION_REQUESTS` (and `GET status`, which has no body)."""

REPLIES: dict[str, type[BaseModel]] = {
    "status": UpstreamStatusReply,
    "prepare": UpstreamPrepareReply,
    "renew": UpstreamRenewReply,
    "commit": UpstreamCommitReply,
    "restore": UpstreamRestoreReply,
    "resume": UpstreamResumeReply,
    "retire": UpstreamRetireReply,
    "forget": UpstreamForgetReply,
}
