"""The NeMo Gym control dialect: Gym's wire models and the mapping to and from ours, per route.

NeMo Gym's checkpoint stack (experimental, not in a Gym release) gives each participating server
bearer-token routes under `/ng-control/v1/checkpoint/`: `GET status` and `POST prepare`, `renew`,
`commit`, `restore`, `resume`, `retire`, `forget`. Its operations are ours under other names and
shapes, so this module adds no second control plane: each `Route` of the route table
(`_routes.py`) gets a `GymCodec` here, and the control plane's Gym router and
`HttpParticipantClient` in the Gym dialect both go through it, around the very handlers and calls
of our dialect.

The models below follow Gym's own code at the commit docs/protocol.md pins (`PINNED_GYM_COMMIT`;
the section "The NeMo Gym dialect" says why that one), field by field; they are written here,
not copied. Gym's request models refuse unknown fields (`extra="forbid"`), so ours do too: a
field we sent that Gym does not have would be a 422 there. Gym's replies are plain JSON objects
that two of them (status, commit) extend with participant-specific fields; the reply models
here ignore unknown fields when read and name the extensions our participants add.

A codec maps in four directions: on the participant side a Gym request to ours
(`to_ours_request`) and our reply to Gym's (`to_gym_reply`, which also reads the Gym request);
on the coordinator side our request to Gym's (`to_gym_request`) and Gym's reply to ours
(`to_ours_reply`). What cannot be said in the other dialect raises `Unmappable`, which each
side answers with `unsupported` (or `invalid_request` for a Gym request our participants cannot
honour), never silently dropped. Refusals map by code (`gym_error`, `our_error`), and on the
participant side by the participant's state where Gym's code depends on it
(`participant_refusal`).
docs/protocol.md lists every field both ways and what cannot map.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

from ._routes import (
    COMMIT,
    FORGET,
    PREPARE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    ROUTES,
    STATUS,
    Route,
)
from ._wire import (
    HTTP_STATUS,
    MAX_BLOCKERS_REPORTED,
    ROLLOUT_ID_PATTERN,
    CommitReply,
    CommitRequest,
    EpisodeId,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    Manifest,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
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

PINNED_GYM_COMMIT = "05bf55ac50b5d95eb203ceb8f59145545c6def64"
"""The NVIDIA-NeMo/Gym commit whose `nemo_gym/_checkpoint/control.py`, `coordination.py`,
`store.py` and `errors.py` this dialect follows (docs/protocol.md, "The NeMo Gym dialect")."""

DEFAULT_GYM_LEASE_GRACE_SECONDS = 600.0
"""Gym's default lease grace; our participants keep their own (`ROLLOUT_LEASE_GRACE_SECONDS`)
and announce it in their capabilities."""

GYM_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""Gym's pattern for checkpoint and rollout ids (ours also allows `:` in rollout ids)."""

_ATTEMPT_SUFFIX = re.compile(r"^(?P<rollout_id>.+)-a(?P<attempt>[1-9][0-9]*)$")
"""`<rollout_id>-a<N>`, N >= 1 without a leading zero: Gym's capture key of attempt N."""


class Unmappable(ValueError):
    """A request or reply that one dialect can say and the other cannot. `code` is what a
    participant answers when a Gym request cannot be honoured (`invalid_request` unless the
    request asks for something our participants do not do: `unsupported`)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


# --- episode ids and capture keys -------------------------------------------------------------


def gym_rollout_id(rollout_id: str) -> str:
    """`rollout_id` as Gym accepts it (`EpisodeId.rollout_id` in nemo-gym 0.7), or `Unmappable`
    (a `ValueError`): Gym's pattern has no `:`, and Gym reserves the suffix `-a<N>` for capture
    keys, so such a rollout id has no Gym episode."""
    if not re.match(GYM_ID_PATTERN, rollout_id):
        raise Unmappable(
            f"rollout id {rollout_id!r} does not match Gym's {GYM_ID_PATTERN} (a letter or digit, "
            "then letters, digits and ._-; no ':')"
        )
    if _ATTEMPT_SUFFIX.match(rollout_id):
        raise Unmappable(
            f"rollout id {rollout_id!r} ends with -a<N>, which Gym reserves for capture keys"
        )
    return rollout_id


def capture_key(rollout_id: str, attempt: int) -> str:
    """Gym's capture key of an episode: the rollout id at attempt 0, `<rollout_id>-a<N>` at
    attempt N >= 1 (`EpisodeId.capture_key` in Gym)."""
    gym_rollout_id(rollout_id)
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def episode_key(episode: EpisodeId) -> str:
    """`capture_key` of one of our episodes."""
    return capture_key(episode.rollout_id, episode.attempt)


def parse_capture_key(key: str) -> EpisodeId:
    """The episode of a capture key: `<id>-a<N>` is attempt N of `<id>`, any other key is
    attempt 0 of itself (Gym refuses rollout ids with that suffix, so the reading is unique)."""
    match = _ATTEMPT_SUFFIX.match(key)
    rollout_id, attempt = (
        (key, 0) if match is None else (match["rollout_id"], int(match["attempt"]))
    )
    try:
        return EpisodeId(rollout_id=rollout_id, attempt=attempt)
    except ValueError as error:
        raise Unmappable(f"{key!r} is not a capture key: {error}") from None


# --- Gym's wire models ------------------------------------------------------------------------


class GymRequestModel(BaseModel):
    """Gym's request models refuse unknown fields: so do these, on both sides."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class GymReplyModel(BaseModel):
    """Gym's replies are read leniently: a Gym participant may add fields (status and commit
    spread participant-specific ones into theirs)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class GymEpisodeId(GymRequestModel):
    """Gym's `EpisodeId{rollout_id, attempt}`: the rollout id has Gym's pattern and never ends
    with the capture-key suffix; the attempt defaults to 0."""

    rollout_id: str = Field(min_length=1, pattern=GYM_ID_PATTERN)
    attempt: int = Field(default=0, ge=0)


class GymCheckpointRequest(GymRequestModel):
    """Gym's `CheckpointRequest`: the body of prepare, renew and resume, and the base of the
    others."""

    checkpoint_id: str = Field(min_length=1, max_length=128, pattern=GYM_ID_PATTERN)
    deadline_ts: FiniteFloat


class GymCommitRequest(GymCheckpointRequest):
    """`checkpoint_dir` (required) and the scope `episode_ids` (None: every parked episode)."""

    checkpoint_dir: str = Field(min_length=1)
    episode_ids: list[GymEpisodeId] | None = None


class GymRestoreRequest(GymCheckpointRequest):
    """`checkpoint_dir` and the checkpointed attempts to continue, both required: each episode
    continues as its next attempt."""

    checkpoint_dir: str = Field(min_length=1)
    episode_ids: list[GymEpisodeId]


class GymRetireRequest(GymCheckpointRequest):
    """The episodes to retire (at least one); each retires its earlier attempts too."""

    episode_ids: list[GymEpisodeId] = Field(min_length=1)


class GymForgetRequest(GymCheckpointRequest):
    """The finished rollouts whose retire marks go (at least one)."""

    rollout_ids: list[str] = Field(min_length=1)


class GymReport(GymReplyModel):
    """Gym's `PrepareReport`: blockers and restarts are capture keys."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)
    blocker_count: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[str] = Field(default_factory=list)


class GymStatusReply(GymReplyModel):
    """`GET status`: Gym's coordinator discovers participants by it (their `kind`). The fields
    after `report` are our participants' extension (Gym spreads a participant's own status
    fields into this reply); a Gym participant leaves them out."""

    kind: Role
    instance: str
    phase: Phase
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    retired_rollouts: int = 0
    report: GymReport
    attempt: int = Field(default=0, ge=0)
    set_name: str | None = None
    set_dir: str | None = None
    standby: bool = False
    retired_attempts: list[int] = Field(default_factory=list)
    live_episodes: int | None = None
    parked_episodes: int | None = None
    restored_episodes: int | None = None
    dialects: list[str] = Field(default_factory=list)


class GymPrepareReply(GymReplyModel):
    phase: Phase
    report: GymReport


class GymRenewReply(GymReplyModel):
    lease_expires_at: float


class GymManifest(GymReplyModel):
    """The participant manifest Gym's store writes (`<dir>/gym/<kind>/<instance>/manifest.json`)."""

    schema_version: int
    kind: Role
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int = Field(ge=0)


class GymCommitReply(GymReplyModel):
    """`episode_ids` are the capture keys of the records written. `attempt`, `bytes` and
    `manifest_path` are our participants' extension (Gym spreads a participant's own commit
    fields into this reply); a checkpoint is published only with them."""

    phase: Literal[Phase.COMMITTED]
    manifest: GymManifest
    episode_ids: list[str]
    attempt: int | None = Field(default=None, ge=0)
    bytes: int | None = Field(default=None, ge=0)
    manifest_path: str | None = None


class GymRestoreReply(GymReplyModel):
    """`restored`: capture keys of the attempts that continue the restored episodes."""

    phase: Literal[Phase.RESTORED]
    source_checkpoint_id: str
    restored: list[str]


class GymResumeReply(GymReplyModel):
    phase: Phase
    idempotent: bool


class GymRetireReply(GymReplyModel):
    retired: list[str]


class GymForgetReply(GymReplyModel):
    forgotten: list[str]


class GymCapabilities(GymReplyModel):
    """`GET /ng-control/v1/capabilities`: our extension, not a route of Gym's checkpoint stack at
    the pinned commit (Gym discovers participants by `GET status`). Our participants serve it
    so a coordinator learns, in one call, that one also speaks our dialect (`dialects`)."""

    checkpoint: bool = False
    operations: list[str] = Field(default_factory=list)
    lease_grace_seconds: float | None = None
    dialects: list[str] = Field(default_factory=list)


class GymErrorDetail(GymReplyModel):
    code: str
    detail: str = ""


class GymErrorBody(GymReplyModel):
    """Gym's `ControlError` body: `{"error": {"code": ..., "detail": ...}}`."""

    error: GymErrorDetail


class GymValidationItem(GymReplyModel):
    """One item of the `{"detail": [...]}` body FastAPI answers a Gym request model refuses."""

    type: str = ""
    loc: list[str | int] = Field(default_factory=list)
    msg: str = ""


class GymValidationBody(GymReplyModel):
    detail: list[GymValidationItem]


# --- error codes ------------------------------------------------------------------------------

GYM_VALIDATION_STATUS = 422
"""FastAPI's status for a request body a Gym model refuses; its body is `{"detail": [...]}`."""

GYM_ERROR_CODES: dict[ErrorCode, tuple[str, int]] = {
    ErrorCode.STALE_CHECKPOINT: ("stale_checkpoint", 409),
    ErrorCode.UNKNOWN_CHECKPOINT: ("invalid_phase", 409),
    ErrorCode.CONFLICTING_CHECKPOINT: ("checkpoint_conflict", 409),
    ErrorCode.WRONG_PHASE: ("invalid_phase", 409),
    ErrorCode.DEADLINE_PASSED: ("deadline_exceeded", 409),
    ErrorCode.ATTEMPT_RETIRED: ("stale_attempt", 409),
    ErrorCode.ADMISSION_CLOSED: ("admission_closed", 409),
    ErrorCode.STORAGE_FAILED: ("invalid_checkpoint_state", 422),
    ErrorCode.RECORDS_INVALID: ("invalid_checkpoint_state", 422),
    ErrorCode.RECORDS_UNREACHABLE: ("invalid_checkpoint_state", 422),
    ErrorCode.UNAUTHORIZED: ("unauthorized", 401),
}
"""Our codes Gym has, with Gym's code and status (`errors.py` at the pinned commit). A renew or
commit of a checkpoint that is not open (`unknown_checkpoint`) is what Gym refuses as
`invalid_phase` while none is open, and as `checkpoint_conflict` while another one is, which
our participants say by their state (`participant_refusal`). `invalid_request` is answered in
FastAPI's validation form (`gym_error`); every other code has no Gym name and passes with ours
and our status, in Gym's body. A restore that finds no manifest (`records_unreachable`) is
Gym's `invalid_checkpoint_state` worded as Gym's store words it (`GYM_MISSING_MANIFEST`), so it
reads back as `records_unreachable`."""

GYM_MISSING_MANIFEST = "missing manifest"
"""How Gym's store begins its refusal of a restore that finds no manifest at the pinned commit
(`invalid_checkpoint_state`, "missing manifest <path>"): of Gym's `invalid_checkpoint_state`
refusals, the one that is our `records_unreachable` (the records are not on the storage this
participant sees, not damaged), which the operator's recovery handles apart."""

OUR_ERROR_CODES: dict[str, ErrorCode] = {
    "stale_checkpoint": ErrorCode.STALE_CHECKPOINT,
    "checkpoint_conflict": ErrorCode.CONFLICTING_CHECKPOINT,
    "invalid_phase": ErrorCode.WRONG_PHASE,
    "deadline_exceeded": ErrorCode.DEADLINE_PASSED,
    "stale_attempt": ErrorCode.ATTEMPT_RETIRED,
    "admission_closed": ErrorCode.ADMISSION_CLOSED,
    "checkpoint_parked": ErrorCode.ADMISSION_CLOSED,
    "restart_in_scope": ErrorCode.INVALID_REQUEST,
    "rollout_id_required": ErrorCode.INVALID_REQUEST,
    "invalid_checkpoint_state": ErrorCode.RECORDS_INVALID,
    "unauthorized": ErrorCode.UNAUTHORIZED,
}
"""Gym's codes read as ours. `checkpoint_parked` is the name later Gym commits give
`admission_closed`; `restart_in_scope` (a commit scope names an episode that restarts) and
`rollout_id_required` are requests this participant refuses as they stand."""


def gym_error(code: ErrorCode, detail: str) -> tuple[int, dict[str, Any]]:
    """The status and Gym body (as JSON-ready data) that answer our error `code`."""
    if code is ErrorCode.INVALID_REQUEST:
        item = GymValidationItem(type="value_error", loc=["body"], msg=detail)
        return GYM_VALIDATION_STATUS, {"detail": [item.model_dump()]}
    if code is ErrorCode.RECORDS_UNREACHABLE and not detail.startswith(GYM_MISSING_MANIFEST):
        detail = f"{GYM_MISSING_MANIFEST}: {detail}"
    name, status = GYM_ERROR_CODES.get(code, (code.value, HTTP_STATUS[code]))
    return status, GymErrorBody(error=GymErrorDetail(code=name, detail=detail)).model_dump()


def error_responses(codes: Iterable[ErrorCode]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries (FastAPI's form) of a Gym route that may answer `codes`."""
    statuses: dict[int, set[str]] = {}
    for code in codes:
        status, body = gym_error(code, "")
        statuses.setdefault(status, set()).add(
            "invalid_request" if "detail" in body else body["error"]["code"]
        )
    return {
        status: {
            "model": GymValidationBody if status == GYM_VALIDATION_STATUS else GymErrorBody,
            "description": "error codes: " + ", ".join(sorted(names)),
        }
        for status, names in sorted(statuses.items())
    }


def our_error(status: int, body: bytes) -> tuple[ErrorCode, str]:
    """Our code and detail for a Gym error reply; `ValueError` if the body is neither of Gym's
    two error forms. An unknown code is `internal`, named."""
    try:
        error = GymErrorBody.model_validate_json(body).error
    except ValueError:
        validation = GymValidationBody.model_validate_json(body)  # raises ValueError too
        detail = "; ".join(
            f"{'.'.join(str(part) for part in item.loc if part != 'body') or 'body'}: {item.msg}"
            for item in validation.detail
        )
        return ErrorCode.INVALID_REQUEST, detail or f"HTTP {status}"
    if error.code == "invalid_checkpoint_state" and error.detail.startswith(GYM_MISSING_MANIFEST):
        return ErrorCode.RECORDS_UNREACHABLE, error.detail
    code = OUR_ERROR_CODES.get(error.code)
    if code is None:
        try:
            code = ErrorCode(error.code)
        except ValueError:
            return ErrorCode.INTERNAL, f"Gym error {error.code!r}: {error.detail}"
    return code, error.detail


# --- the two sides' context -------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSide:
    """What the participant side needs to map: where its checkpoints live, what it speaks."""

    instance: str
    storage_dir: str
    """The set's directory under the checkpoint root (`ControlSettings.storage_dir`)."""
    checkpoint_root: str | None
    dialects: tuple[str, ...] = ()
    attempt: Callable[[], int] = lambda: 0
    """The participant's attempt now: what a Gym restore that names no episode restores under
    (Gym continues each named episode as its next attempt; naming none, no attempt moves)."""
    open_checkpoint: Callable[[], str | None] = lambda: None
    """The checkpoint open here now (prepared, committed or restored), if any: what decides
    Gym's code for a renew or commit of another id (`participant_refusal`)."""


def participant_refusal(error: ProtocolError, side: ServerSide) -> ProtocolError:
    """Our participant's refusal as Gym's participant gives it. Ours refuses a renew or commit
    of an id that is not open as `unknown_checkpoint` whether another checkpoint is open or none
    is; Gym's `_admit` says `checkpoint_conflict` when another is open, and `invalid_phase` when
    none is (what `gym_error` says of `unknown_checkpoint`)."""
    if error.code is ErrorCode.UNKNOWN_CHECKPOINT and side.open_checkpoint() is not None:
        return ProtocolError(ErrorCode.CONFLICTING_CHECKPOINT, error.detail)
    return error


@dataclass(frozen=True)
class ClientSide:
    """What the coordinator side needs to map: who it talks to and, for a commit that names
    its scope, the participant's attempt (Gym scopes are episodes, ours rollouts)."""

    role: Role
    instance: str
    attempt: int | None = None


def checkpoint_of_dir(checkpoint_dir: str, side: ServerSide) -> str:
    """The checkpoint id a Gym `checkpoint_dir` names for this participant.

    Our participants derive the directory themselves (`<root>/<set dir>/<id>/<instance>`), so
    they accept it named relative to their set directory (the id: what our coordinator sends),
    relative to the checkpoint root, or absolute; any other directory is refused."""
    normal = PurePosixPath(posixpath.normpath(checkpoint_dir))
    candidates = [PurePosixPath(), PurePosixPath(side.storage_dir)]
    if side.checkpoint_root is not None:
        candidates.append(PurePosixPath(side.checkpoint_root) / side.storage_dir)
    for base in candidates:
        if normal.parent == base and re.match(GYM_ID_PATTERN, normal.name):
            return normal.name
    raise Unmappable(
        f"checkpoint_dir: {checkpoint_dir!r} is not a checkpoint of {side.instance} (it writes "
        f"under its own set directory {side.storage_dir!r}); send <checkpoint id>, "
        f"{side.storage_dir}/<checkpoint id> or the absolute form under the checkpoint root"
    )


def checkpoint_id_of_dir(checkpoint_dir: str, checkpoint_id: str, side: ServerSide) -> None:
    """Check that a Gym `checkpoint_dir` is where this participant keeps `checkpoint_id`."""
    named = checkpoint_of_dir(checkpoint_dir, side)
    if named != checkpoint_id:
        raise Unmappable(
            f"checkpoint_dir: {checkpoint_dir!r} names checkpoint {named!r}, not {checkpoint_id!r}"
        )


def _keys(episodes: Sequence[EpisodeId]) -> list[str]:
    return [episode_key(e) for e in episodes]


def _parsed(keys: Sequence[str]) -> list[EpisodeId]:
    return [parse_capture_key(key) for key in keys]


def _one_attempt(episodes: Sequence[GymEpisodeId], what: str) -> int:
    attempts = sorted({e.attempt for e in episodes})
    if len(attempts) != 1:
        raise Unmappable(
            f"episode_ids: episodes of attempts {attempts} in one {what}; this participant "
            f"{what}s one attempt per call"
        )
    return attempts[0]


def _gym_episodes(rollout_ids: Iterable[str], attempt: int) -> list[GymEpisodeId]:
    return [GymEpisodeId(rollout_id=gym_rollout_id(r), attempt=attempt) for r in rollout_ids]


def _episodes_in(gym: Sequence[GymEpisodeId]) -> list[str]:
    """The rollout ids of Gym episodes, each checked against Gym's reserved suffix."""
    return list(dict.fromkeys(gym_rollout_id(e.rollout_id) for e in gym))


# --- per-route mappings -----------------------------------------------------------------------


def _status_in(gym: None, side: ServerSide) -> None:
    return None


def _status_out(reply: StatusReply, request: None, side: ServerSide) -> GymStatusReply:
    return GymStatusReply(
        kind=reply.role,
        instance=reply.instance,
        phase=reply.phase,
        checkpoint_id=reply.checkpoint_id,
        lease_expires_at=reply.lease_expires_ts,
        # our participants keep retire marks per attempt, not per rollout (retired_attempts)
        retired_rollouts=0,
        report=GymReport(
            ready=reply.live_episodes == 0,
            counts={
                "live": reply.live_episodes,
                "parked": reply.parked_episodes,
                "restored": reply.restored_episodes,
            },
        ),
        attempt=reply.attempt,
        set_name=reply.set_name,
        set_dir=reply.set_dir,
        standby=reply.standby,
        retired_attempts=reply.retired_attempts,
        live_episodes=reply.live_episodes,
        parked_episodes=reply.parked_episodes,
        restored_episodes=reply.restored_episodes,
        dialects=list(side.dialects),
    )


def _status_send(request: None, side: ClientSide) -> None:
    return None


def _status_read(gym: GymStatusReply, request: None, side: ClientSide) -> StatusReply:
    counts = gym.report.counts
    return StatusReply(
        role=side.role,
        instance=side.instance,
        attempt=gym.attempt,
        phase=gym.phase,
        checkpoint_id=gym.checkpoint_id,
        lease_expires_ts=gym.lease_expires_at,
        live_episodes=gym.live_episodes if gym.live_episodes is not None else counts.get("live", 0),
        parked_episodes=gym.parked_episodes
        if gym.parked_episodes is not None
        else counts.get("parked", 0),
        restored_episodes=gym.restored_episodes
        if gym.restored_episodes is not None
        else counts.get("restored", 0),
        set_name=gym.set_name,
        set_dir=gym.set_dir,
        standby=gym.standby,
        retired_attempts=gym.retired_attempts,
    )


def _prepare_in(gym: GymCheckpointRequest, side: ServerSide) -> PrepareRequest:
    return PrepareRequest(checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts)


def _prepare_out(
    reply: PrepareReply, request: GymCheckpointRequest, side: ServerSide
) -> GymPrepareReply:
    return GymPrepareReply(
        phase=reply.phase,
        report=GymReport(
            ready=reply.ready,
            blockers=_keys(reply.blockers),
            blocker_count=reply.blocker_count,
            counts={"parked": reply.episode_count},
            restarts=_keys(reply.restarts),
        ),
    )


def _prepare_send(request: PrepareRequest, side: ClientSide) -> GymCheckpointRequest:
    # `rollout_ids` (list these parked episodes) has no Gym field: Gym's reply lists none, and
    # the coordinator's scope is the union of the listings, so an empty one takes nothing away
    return GymCheckpointRequest(
        checkpoint_id=request.checkpoint_id, deadline_ts=request.deadline_ts
    )


def _prepare_read(gym: GymPrepareReply, request: PrepareRequest, side: ClientSide) -> PrepareReply:
    return PrepareReply(
        checkpoint_id=request.checkpoint_id,
        phase=gym.phase,
        ready=gym.report.ready,
        episode_count=max(gym.report.counts.get("parked", 0), 0),
        blockers=_parsed(gym.report.blockers[:MAX_BLOCKERS_REPORTED]),
        blocker_count=max(gym.report.blocker_count, len(gym.report.blockers)),
        restarts=_parsed(gym.report.restarts),
    )


def _renew_in(gym: GymCheckpointRequest, side: ServerSide) -> RenewRequest:
    return RenewRequest(checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts)


def _renew_out(reply: RenewReply, request: GymCheckpointRequest, side: ServerSide) -> GymRenewReply:
    return GymRenewReply(lease_expires_at=reply.lease_expires_ts)


def _renew_send(request: RenewRequest, side: ClientSide) -> GymCheckpointRequest:
    return GymCheckpointRequest(
        checkpoint_id=request.checkpoint_id, deadline_ts=request.deadline_ts
    )


def _renew_read(gym: GymRenewReply, request: RenewRequest, side: ClientSide) -> RenewReply:
    # Gym's renew does not say the phase; it renews only an open checkpoint (any phase but
    # idle), and nothing reads a renew's phase but a log
    return RenewReply(
        checkpoint_id=request.checkpoint_id,
        phase=Phase.PREPARED,
        lease_expires_ts=gym.lease_expires_at,
    )


def _commit_in(gym: GymCommitRequest, side: ServerSide) -> CommitRequest:
    checkpoint_id_of_dir(gym.checkpoint_dir, gym.checkpoint_id, side)
    rollout_ids = None if gym.episode_ids is None else _episodes_in(gym.episode_ids)
    return CommitRequest(
        checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts, rollout_ids=rollout_ids
    )


def _commit_out(reply: CommitReply, request: GymCommitRequest, side: ServerSide) -> GymCommitReply:
    manifest = reply.manifest
    return GymCommitReply(
        phase=Phase.COMMITTED,
        manifest=GymManifest(
            schema_version=manifest.schema_version,
            kind=manifest.role,
            instance=manifest.instance,
            checkpoint_id=manifest.checkpoint_id,
            records_file=manifest.records_file,
            records_sha256=manifest.records_sha256,
            record_count=manifest.record_count,
        ),
        # the records written (`CommitReply.rollout_ids`, which our own dialect leaves out)
        episode_ids=sorted(
            capture_key(rid, manifest.attempt) for rid in dict.fromkeys(reply.rollout_ids or [])
        ),
        attempt=manifest.attempt,
        bytes=manifest.bytes,
        manifest_path=reply.manifest_path,
    )


def _commit_send(request: CommitRequest, side: ClientSide) -> GymCommitRequest:
    episode_ids: list[GymEpisodeId] | None = None
    if request.excluded_rollout_ids and request.rollout_ids is None:
        raise Unmappable(
            "a commit of every parked episode but the restarting ones "
            f"({len(request.excluded_rollout_ids)}) cannot be said to a Gym participant (its "
            "scope is a list); the checkpoint is retried once the restarts are gone"
        )
    if request.rollout_ids is not None:
        if side.attempt is None:
            raise Unmappable("a Gym scope names episodes: the participant's attempt is needed")
        excluded = set(request.excluded_rollout_ids or ())
        episode_ids = _gym_episodes(
            (rid for rid in request.rollout_ids if rid not in excluded), side.attempt
        )
    return GymCommitRequest(
        checkpoint_id=request.checkpoint_id,
        deadline_ts=request.deadline_ts,
        checkpoint_dir=request.checkpoint_id,
        episode_ids=episode_ids,
    )


def _commit_read(gym: GymCommitReply, request: CommitRequest, side: ClientSide) -> CommitReply:
    missing = [name for name in ("attempt", "bytes", "manifest_path") if getattr(gym, name) is None]
    if missing:
        raise Unmappable(
            f"the Gym commit reply of {side.instance} lacks {', '.join(missing)}: a checkpoint "
            "is published only with every participant's attempt, records size and manifest path"
        )
    m = gym.manifest
    manifest = Manifest.model_validate(
        {
            "schema_version": m.schema_version,
            "role": m.kind,
            "instance": m.instance,
            "checkpoint_id": m.checkpoint_id,
            "attempt": gym.attempt,
            "records_file": m.records_file,
            "records_sha256": m.records_sha256,
            "record_count": m.record_count,
            "bytes": gym.bytes,
        }
    )
    return CommitReply(
        checkpoint_id=request.checkpoint_id,
        phase=Phase.COMMITTED,
        manifest=manifest,
        manifest_path=gym.manifest_path,
        # kept with the checkpoint: a Gym restore names the episodes to continue
        rollout_ids=sorted({parse_capture_key(key).rollout_id for key in gym.episode_ids}),
    )


def _restore_in(gym: GymRestoreRequest, side: ServerSide) -> RestoreRequest:
    source = checkpoint_of_dir(gym.checkpoint_dir, side)
    if source != gym.checkpoint_id:
        raise Unmappable(
            f"checkpoint_id: {gym.checkpoint_id!r} differs from the checkpoint its checkpoint_dir "
            f"names ({source!r}): this participant names a restore by the checkpoint it restores"
        )
    if not gym.episode_ids:  # a commit that wrote no record: restore nothing, stay as we are
        return RestoreRequest(
            checkpoint_id=gym.checkpoint_id,
            deadline_ts=gym.deadline_ts,
            attempt=side.attempt(),
            rollout_ids=[],
        )
    continued = _one_attempt(gym.episode_ids, "restore") + 1
    return RestoreRequest(
        checkpoint_id=gym.checkpoint_id,
        deadline_ts=gym.deadline_ts,
        attempt=continued,
        rollout_ids=_episodes_in(gym.episode_ids),
    )


def _restore_out(
    reply: RestoreReply, request: GymRestoreRequest, side: ServerSide
) -> GymRestoreReply:
    return GymRestoreReply(
        phase=Phase.RESTORED,
        source_checkpoint_id=request.checkpoint_id,
        restored=sorted(_keys(reply.restored)),
    )


def _restore_send(request: RestoreRequest, side: ClientSide) -> GymRestoreRequest:
    cannot = [
        what
        for what, present in (
            (
                "records of another instance (source_instance)",
                request.source_instance not in (None, side.instance),
            ),
            ("every record without naming the rollouts", request.rollout_ids is None),
            ("attempt 0 (a restored episode continues as attempt N + 1)", request.attempt == 0),
            ("re-wiring its peers (peers)", request.peers is not None),
            ("adopting a standby (index)", request.index is not None),
        )
        if present
    ]
    if cannot:
        raise Unmappable(f"a Gym restore cannot ask for {', '.join(cannot)}")
    return GymRestoreRequest(
        checkpoint_id=request.checkpoint_id,
        deadline_ts=request.deadline_ts,
        checkpoint_dir=request.checkpoint_id,
        episode_ids=_gym_episodes(request.rollout_ids or [], request.attempt - 1),
    )


def _restore_read(gym: GymRestoreReply, request: RestoreRequest, side: ClientSide) -> RestoreReply:
    if gym.source_checkpoint_id != request.checkpoint_id:
        raise Unmappable(
            f"{side.instance} restored {gym.source_checkpoint_id!r}, not {request.checkpoint_id!r}"
        )
    restored = _parsed(gym.restored)
    return RestoreReply(
        checkpoint_id=request.checkpoint_id,
        phase=Phase.RESTORED,
        attempt=request.attempt,
        restored=restored,
        record_count=len(restored),
    )


def _resume_in(gym: GymCheckpointRequest, side: ServerSide) -> ResumeRequest:
    return ResumeRequest(checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts)


def _resume_out(
    reply: ResumeReply, request: GymCheckpointRequest, side: ServerSide
) -> GymResumeReply:
    # our reply does not say whether the resume replayed an earlier one (Gym's `idempotent`)
    return GymResumeReply(phase=reply.phase, idempotent=False)


def _resume_send(request: ResumeRequest, side: ClientSide) -> GymCheckpointRequest:
    return GymCheckpointRequest(
        checkpoint_id=request.checkpoint_id, deadline_ts=request.deadline_ts
    )


def _resume_read(gym: GymResumeReply, request: ResumeRequest, side: ClientSide) -> ResumeReply:
    return ResumeReply(checkpoint_id=request.checkpoint_id, phase=gym.phase)


def _retire_in(gym: GymRetireRequest, side: ServerSide) -> RetireRequest:
    return RetireRequest(
        operation_id=gym.checkpoint_id,
        deadline_ts=gym.deadline_ts,
        attempt=_one_attempt(gym.episode_ids, "retire"),
        rollout_ids=_episodes_in(gym.episode_ids),
    )


def _retire_out(reply: RetireReply, request: GymRetireRequest, side: ServerSide) -> GymRetireReply:
    # Gym answers with the episodes asked, in the order asked
    return GymRetireReply(
        retired=[capture_key(e.rollout_id, e.attempt) for e in request.episode_ids]
    )


def _retire_send(request: RetireRequest, side: ClientSide) -> GymRetireRequest:
    # `finished` (rollouts another role saw finish) has no Gym field: left out, the
    # participant decides by itself, as `None` means in ours
    if not request.rollout_ids:
        raise Unmappable(
            "a Gym retire names its episodes: every episode of an attempt (rollout_ids None) "
            "cannot be said"
        )
    return GymRetireRequest(
        checkpoint_id=request.operation_id,
        deadline_ts=request.deadline_ts,
        episode_ids=_gym_episodes(request.rollout_ids, request.attempt),
    )


def _retire_read(gym: GymRetireReply, request: RetireRequest, side: ClientSide) -> RetireReply:
    return RetireReply(operation_id=request.operation_id, retired=_parsed(gym.retired))


def _forget_in(gym: GymForgetRequest, side: ServerSide) -> ForgetRequest:
    # Gym's forget takes any strings; one that is not a rollout id of ours was never retired
    # here, so there is nothing of it to forget (as in Gym, which forgets no mark it lacks)
    rollout_ids = [rid for rid in gym.rollout_ids if re.fullmatch(ROLLOUT_ID_PATTERN, rid)]
    return ForgetRequest(
        operation_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts, rollout_ids=rollout_ids
    )


def _forget_out(reply: ForgetReply, request: GymForgetRequest, side: ServerSide) -> GymForgetReply:
    # Gym answers with the rollouts asked, sorted
    return GymForgetReply(forgotten=sorted(request.rollout_ids))


def _forget_send(request: ForgetRequest, side: ClientSide) -> GymForgetRequest:
    if not request.rollout_ids:
        raise Unmappable("a Gym forget names at least one rollout")
    return GymForgetRequest(
        checkpoint_id=request.operation_id,
        deadline_ts=request.deadline_ts,
        rollout_ids=request.rollout_ids,
    )


def _forget_read(gym: GymForgetReply, request: ForgetRequest, side: ClientSide) -> ForgetReply:
    return ForgetReply(operation_id=request.operation_id, forgotten=len(gym.forgotten))


@dataclass(frozen=True)
class GymCodec:
    """How one route of the table is said in Gym: its models and the four mappings."""

    request: type[GymRequestModel] | None
    reply: type[GymReplyModel]
    to_ours_request: Callable[[Any, ServerSide], Any]
    to_gym_reply: Callable[[Any, Any, ServerSide], GymReplyModel]
    """(our reply, the Gym request it answers, side) -> Gym's reply."""
    to_gym_request: Callable[[Any, ClientSide], GymRequestModel | None]
    to_ours_reply: Callable[[Any, Any, ClientSide], BaseModel]


CODECS: dict[str, GymCodec] = {
    STATUS.name: GymCodec(
        None, GymStatusReply, _status_in, _status_out, _status_send, _status_read
    ),
    PREPARE.name: GymCodec(
        GymCheckpointRequest,
        GymPrepareReply,
        _prepare_in,
        _prepare_out,
        _prepare_send,
        _prepare_read,
    ),
    RENEW.name: GymCodec(
        GymCheckpointRequest, GymRenewReply, _renew_in, _renew_out, _renew_send, _renew_read
    ),
    COMMIT.name: GymCodec(
        GymCommitRequest, GymCommitReply, _commit_in, _commit_out, _commit_send, _commit_read
    ),
    RESTORE.name: GymCodec(
        GymRestoreRequest, GymRestoreReply, _restore_in, _restore_out, _restore_send, _restore_read
    ),
    RESUME.name: GymCodec(
        GymCheckpointRequest, GymResumeReply, _resume_in, _resume_out, _resume_send, _resume_read
    ),
    RETIRE.name: GymCodec(
        GymRetireRequest, GymRetireReply, _retire_in, _retire_out, _retire_send, _retire_read
    ),
    FORGET.name: GymCodec(
        GymForgetRequest, GymForgetReply, _forget_in, _forget_out, _forget_send, _forget_read
    ),
}
"""One codec per route the table marks `in_gym`; checked at import, so a route added to the table
without its Gym mapping (or a mapping without its route) fails at once."""

_declared = {route.name for route in ROUTES if route.in_gym}
if set(CODECS) != _declared:  # pragma: no cover - a programming error, caught by any import
    raise RuntimeError(f"Gym codecs {sorted(CODECS)} do not match the Gym routes {_declared}")


def codec(route: Route[Any, Any]) -> GymCodec:
    """The Gym codec of a route the table marks `in_gym`."""
    return CODECS[route.name]
