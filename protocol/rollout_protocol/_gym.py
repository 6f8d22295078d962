"""The NeMo Gym control dialect: Gym's wire models and the mapping to and from ours, per route.

NeMo Gym's checkpoint stack (experimental and unmerged upstream; docs/protocol.md pins the
version followed) gives its participants bearer-token routes under `/ng-control/v1/checkpoint/`
and `GET /ng-control/v1/capabilities`. Its operations are ours under other names, so this module
does not add a second control plane: each `Route` of the route table (`_routes.py`) gets a
`GymCodec` here, and the control plane's Gym router and `HttpParticipantClient` in the Gym
dialect both go through it, around the very handlers and calls of our dialect.

Written from the public description of the Gym stack (field names, reply shapes, error codes);
no upstream code. Where the description is silent (the error body's shape, a status reply's
fields, the request of retire and forget) the models below are our reading, marked as such in
docs/protocol.md. Gym replies are decoded leniently (unknown fields ignored: a newer Gym
participant may add some); Gym requests are parsed as strictly as ours.

A codec maps in four directions: on the participant side a Gym request to ours
(`to_ours_request`) and our reply to Gym's (`to_gym_reply`); on the coordinator side our request
to Gym's (`to_gym_request`) and Gym's reply to ours (`to_ours_reply`). What cannot be said in
the other dialect raises `Unmappable`, which each side answers with `unsupported` (or
`invalid_request` for a Gym request our participants cannot honour), never silently dropped.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
    Attempt,
    CheckpointId,
    CommitReply,
    CommitRequest,
    DeadlineTs,
    EpisodeId,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    Manifest,
    Phase,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
    RolloutId,
    StatusReply,
)

DEFAULT_GYM_LEASE_GRACE_SECONDS = 600.0
"""Gym's default lease grace; our participants keep their own (`ROLLOUT_LEASE_GRACE_SECONDS`)
and announce it in their capabilities."""


class Unmappable(ValueError):
    """A request or reply that one dialect can say and the other cannot. `code` is what a
    participant answers when a Gym request cannot be honoured (`invalid_request` unless the
    request asks for something our participants do not do: `unsupported`)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


# --- episode ids and capture keys -------------------------------------------------------------


def capture_key(episode: EpisodeId) -> str:
    """Gym's capture key of an episode: `<rollout_id>-a<attempt>` (`rid-aN`)."""
    return f"{episode.rollout_id}-a{episode.attempt}"


def parse_capture_key(key: str) -> EpisodeId:
    """The episode of a capture key. The attempt is after the last `-a`, so rollout ids that
    contain `-a` themselves (`task-a3-a0`) parse; anything else raises `Unmappable`."""
    rollout_id, separator, attempt = key.rpartition("-a")
    if not separator or not attempt.isdigit() or not rollout_id:
        raise Unmappable(f"{key!r} is not a capture key (<rollout_id>-a<attempt>)")
    try:
        return EpisodeId(rollout_id=rollout_id, attempt=int(attempt))
    except ValueError as error:
        raise Unmappable(f"{key!r}: {error}") from None


# --- Gym's wire models ------------------------------------------------------------------------


class GymRequestModel(BaseModel):
    """Requests are parsed strictly, as ours are: a typo in a field is a 422 naming it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class GymReplyModel(BaseModel):
    """Replies are read leniently: a Gym participant may add fields we do not know."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class GymEpisodeId(GymReplyModel):
    """`EpisodeId{rollout_id, attempt}`, the same two fields as ours."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: RolloutId
    attempt: Attempt


class GymControlRequest(GymRequestModel):
    """Every Gym control request names its checkpoint and an absolute deadline."""

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


class GymPrepareRequest(GymControlRequest):
    pass


class GymRenewRequest(GymControlRequest):
    pass


class GymCommitRequest(GymControlRequest):
    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    episode_ids: list[GymEpisodeId] | None = Field(
        default=None, description="The scope; None commits every parked episode."
    )
    stop: bool = False


class GymRestoreRequest(GymControlRequest):
    """Our reading: Gym names the checkpoint restored (`source_checkpoint_id`, echoed in the
    reply), its directory and the attempt the episodes continue under."""

    source_checkpoint_id: CheckpointId
    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    attempt: Attempt


class GymResumeRequest(GymControlRequest):
    pass


class GymRetireRequest(GymControlRequest):
    """Our reading: the attempt retired and, optionally, its episodes (all when absent)."""

    attempt: Attempt
    episode_ids: list[GymEpisodeId] | None = None


class GymForgetRequest(GymControlRequest):
    """Our reading: the finished rollouts whose retire marks go."""

    rollout_ids: list[RolloutId]


class GymReport(GymReplyModel):
    ready: bool
    blockers: list[GymEpisodeId] = Field(default_factory=list, max_length=MAX_BLOCKERS_REPORTED)
    blocker_count: int = Field(default=0, ge=0)
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[GymEpisodeId] = Field(default_factory=list)


class GymPrepareReply(GymReplyModel):
    phase: Phase
    report: GymReport


class GymRenewReply(GymReplyModel):
    phase: Phase
    lease_expires_ts: float


class GymManifest(GymReplyModel):
    """`manifest{record_count, ...}`. Our participants fill the rest with their own manifest's
    fields; a coordinator publishes a participant's part only with them (`to_ours_reply`)."""

    record_count: int = Field(ge=0)
    schema_version: int | None = None
    role: Role | None = None
    instance: str | None = None
    checkpoint_id: str | None = None
    attempt: int | None = None
    records_file: str | None = None
    records_sha256: str | None = None
    bytes: int | None = None
    manifest_path: str | None = None


class GymCommitReply(GymReplyModel):
    phase: Literal[Phase.COMMITTED]
    manifest: GymManifest
    episode_ids: list[GymEpisodeId] | None = None


class GymRestoreReply(GymReplyModel):
    phase: Literal[Phase.RESTORED]
    source_checkpoint_id: str
    restored: list[GymEpisodeId]


class GymResumeReply(GymReplyModel):
    phase: Phase


class GymRetireReply(GymReplyModel):
    retired: list[GymEpisodeId]


class GymForgetReply(GymReplyModel):
    forgotten: int


class GymStatusReply(GymReplyModel):
    """Our reading of Gym's status: phase, open checkpoint, attempt, lease and counts. The
    optional fields after them are our participants' (where the records of a checkpoint are,
    retired attempts); a Gym participant may leave them out."""

    phase: Phase
    checkpoint_id: str | None = None
    attempt: Attempt = 0
    lease_expires_ts: float | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    set_name: str | None = None
    set_dir: str | None = None
    standby: bool = False
    retired_attempts: list[Attempt] = Field(default_factory=list)


class GymCapabilities(GymReplyModel):
    """`GET /ng-control/v1/capabilities`. `dialects` is our extension: a participant built on
    this SDK lists every dialect it mounts, so a coordinator that can speak ours does."""

    checkpoint: bool = False
    operations: list[str] = Field(default_factory=list)
    lease_grace_seconds: float | None = None
    dialects: list[str] = Field(default_factory=list)


class GymErrorDetail(GymReplyModel):
    code: str
    message: str = ""


class GymErrorBody(GymReplyModel):
    """Our reading of Gym's error body: `{"error": {"code": ..., "message": ...}}`."""

    error: GymErrorDetail


# --- error codes ------------------------------------------------------------------------------

GYM_ERROR_CODES: dict[ErrorCode, str] = {
    ErrorCode.STALE_CHECKPOINT: "stale_checkpoint",
    ErrorCode.UNKNOWN_CHECKPOINT: "stale_checkpoint",
    ErrorCode.CONFLICTING_CHECKPOINT: "checkpoint_conflict",
    ErrorCode.WRONG_PHASE: "invalid_phase",
}
"""Our codes Gym names, with Gym's name (all answered 409). `unknown_checkpoint` (a commit or
renew of an id that is not open) is what Gym calls stale: the id is not the open one. Every other
code passes with our name and our status."""

OUR_ERROR_CODES: dict[str, ErrorCode] = {
    "stale_checkpoint": ErrorCode.STALE_CHECKPOINT,
    "checkpoint_conflict": ErrorCode.CONFLICTING_CHECKPOINT,
    "invalid_phase": ErrorCode.WRONG_PHASE,
}
GYM_CONFLICT_STATUS = 409


def gym_error(code: ErrorCode, detail: str) -> tuple[int, GymErrorBody]:
    """The status and Gym body that answer our error `code`."""
    name = GYM_ERROR_CODES.get(code)
    status = GYM_CONFLICT_STATUS if name is not None else HTTP_STATUS[code]
    return status, GymErrorBody(error=GymErrorDetail(code=name or code.value, message=detail))


def error_responses(codes: Iterable[ErrorCode]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries (FastAPI's form) of a Gym route that may answer `codes`."""
    statuses: dict[int, set[str]] = {}
    for code in codes:
        status, body = gym_error(code, "")
        statuses.setdefault(status, set()).add(body.error.code)
    return {
        status: {"model": GymErrorBody, "description": "error codes: " + ", ".join(sorted(names))}
        for status, names in sorted(statuses.items())
    }


def our_error(body: GymErrorBody) -> tuple[ErrorCode, str]:
    """Our code and detail for a Gym error body (an unknown code is `internal`, named)."""
    code = OUR_ERROR_CODES.get(body.error.code)
    if code is None:
        try:
            code = ErrorCode(body.error.code)
        except ValueError:
            return ErrorCode.INTERNAL, f"Gym error {body.error.code!r}: {body.error.message}"
    return code, body.error.message


# --- the two sides' context -------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSide:
    """What the participant side needs to map: where its checkpoints live."""

    instance: str
    storage_dir: str
    """The set's directory under the checkpoint root (`ControlSettings.storage_dir`)."""
    checkpoint_root: str | None


@dataclass(frozen=True)
class ClientSide:
    """What the coordinator side needs to map: who it talks to and, for a commit that names
    its scope, the participant's attempt (Gym scopes are episodes, ours rollouts)."""

    role: Role
    instance: str
    attempt: int | None = None


def checkpoint_id_of_dir(checkpoint_dir: str, checkpoint_id: str, side: ServerSide) -> None:
    """Check that a Gym `checkpoint_dir` is where this participant keeps `checkpoint_id`.

    Our participants derive the directory themselves (`<root>/<set dir>/<id>/<instance>`), so
    they accept it named relative to their set directory (the id: what our coordinator sends),
    relative to the checkpoint root, or absolute; any other directory is refused."""
    normal = posixpath.normpath(checkpoint_dir)
    accepted = {checkpoint_id, f"{side.storage_dir}/{checkpoint_id}"}
    if side.checkpoint_root is not None:
        accepted.add(str(PurePosixPath(side.checkpoint_root) / side.storage_dir / checkpoint_id))
    if normal not in accepted:
        raise Unmappable(
            f"checkpoint_dir: {checkpoint_dir!r} is not where {side.instance} keeps checkpoint "
            f"{checkpoint_id} (it writes under its own set directory {side.storage_dir!r}); "
            f"send one of {sorted(accepted)}"
        )


def _episodes(items: Sequence[EpisodeId | GymEpisodeId]) -> list[GymEpisodeId]:
    return [GymEpisodeId(rollout_id=e.rollout_id, attempt=e.attempt) for e in items]


def _ours(items: Sequence[GymEpisodeId]) -> list[EpisodeId]:
    return [EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt) for e in items]


# --- per-route mappings -----------------------------------------------------------------------


def _prepare_in(gym: GymPrepareRequest, side: ServerSide) -> PrepareRequest:
    return PrepareRequest(checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts)


def _prepare_out(reply: PrepareReply, request: PrepareRequest) -> GymPrepareReply:
    return GymPrepareReply(
        phase=reply.phase,
        report=GymReport(
            ready=reply.ready,
            blockers=_episodes(reply.blockers),
            blocker_count=reply.blocker_count,
            counts={"parked": reply.episode_count},
            restarts=_episodes(reply.restarts),
        ),
    )


def _prepare_send(request: PrepareRequest, side: ClientSide) -> GymPrepareRequest:
    # `rollout_ids` (list these parked episodes) has no Gym field: Gym's reply lists none, and
    # the coordinator's scope is the union of the listings, so an empty one takes nothing away
    return GymPrepareRequest(checkpoint_id=request.checkpoint_id, deadline_ts=request.deadline_ts)


def _prepare_read(gym: GymPrepareReply, request: PrepareRequest, side: ClientSide) -> PrepareReply:
    return PrepareReply(
        checkpoint_id=request.checkpoint_id,
        phase=gym.phase,
        ready=gym.report.ready,
        episode_count=max(gym.report.counts.get("parked", 0), 0),
        blockers=_ours(gym.report.blockers),
        blocker_count=gym.report.blocker_count,
        restarts=_ours(gym.report.restarts),
    )


def _renew_in(gym: GymRenewRequest, side: ServerSide) -> RenewRequest:
    return RenewRequest(checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts)


def _renew_out(reply: RenewReply, request: RenewRequest) -> GymRenewReply:
    return GymRenewReply(phase=reply.phase, lease_expires_ts=reply.lease_expires_ts)


def _renew_send(request: RenewRequest, side: ClientSide) -> GymRenewRequest:
    return GymRenewRequest(checkpoint_id=request.checkpoint_id, deadline_ts=request.deadline_ts)


def _renew_read(gym: GymRenewReply, request: RenewRequest, side: ClientSide) -> RenewReply:
    return RenewReply(
        checkpoint_id=request.checkpoint_id, phase=gym.phase, lease_expires_ts=gym.lease_expires_ts
    )


def _commit_in(gym: GymCommitRequest, side: ServerSide) -> CommitRequest:
    checkpoint_id_of_dir(gym.checkpoint_dir, gym.checkpoint_id, side)
    if gym.stop:
        raise Unmappable(
            "stop: this participant keeps its episodes parked after a commit until a resume; "
            "it cannot end them as part of the commit (commit, then retire them)",
            ErrorCode.UNSUPPORTED,
        )
    rollout_ids = None
    if gym.episode_ids is not None:
        rollout_ids = list(dict.fromkeys(e.rollout_id for e in gym.episode_ids))
    return CommitRequest(
        checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts, rollout_ids=rollout_ids
    )


def _commit_out(reply: CommitReply, request: CommitRequest) -> GymCommitReply:
    manifest = reply.manifest
    return GymCommitReply(
        phase=Phase.COMMITTED,
        manifest=GymManifest(**manifest.model_dump(), manifest_path=reply.manifest_path),
        # the scope as it was asked; a commit of every parked episode is not listed back (the
        # reply would grow with the set): None, as in the request
        episode_ids=None
        if request.rollout_ids is None
        else [
            GymEpisodeId(rollout_id=rid, attempt=manifest.attempt) for rid in request.rollout_ids
        ],
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
        episode_ids = [
            GymEpisodeId(rollout_id=rid, attempt=side.attempt)
            for rid in request.rollout_ids
            if rid not in excluded
        ]
    return GymCommitRequest(
        checkpoint_id=request.checkpoint_id,
        deadline_ts=request.deadline_ts,
        checkpoint_dir=request.checkpoint_id,
        episode_ids=episode_ids,
        stop=False,
    )


def _commit_read(gym: GymCommitReply, request: CommitRequest, side: ClientSide) -> CommitReply:
    m = gym.manifest
    missing = [
        name
        for name in ("records_file", "records_sha256", "bytes", "attempt", "manifest_path")
        if getattr(m, name) is None
    ]
    if missing:
        raise Unmappable(
            f"the Gym manifest of {side.instance} lacks {', '.join(missing)}: a checkpoint is "
            "published only with every participant's records digest, size and path"
        )
    fields = {name: value for name, value in m.model_dump().items() if value is not None}
    manifest_path = fields.pop("manifest_path")
    manifest = Manifest.model_validate(
        {
            **fields,
            "role": m.role or side.role,
            "instance": m.instance or side.instance,
            "checkpoint_id": m.checkpoint_id or request.checkpoint_id,
        }
    )
    return CommitReply(
        checkpoint_id=request.checkpoint_id,
        phase=Phase.COMMITTED,
        manifest=manifest,
        manifest_path=manifest_path,
    )


def _restore_in(gym: GymRestoreRequest, side: ServerSide) -> RestoreRequest:
    if gym.source_checkpoint_id != gym.checkpoint_id:
        raise Unmappable(
            f"source_checkpoint_id: {gym.source_checkpoint_id!r} differs from checkpoint_id "
            f"{gym.checkpoint_id!r}: this participant names a restore by the checkpoint it "
            "restores (send the same id in both)"
        )
    checkpoint_id_of_dir(gym.checkpoint_dir, gym.source_checkpoint_id, side)
    return RestoreRequest(
        checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts, attempt=gym.attempt
    )


def _restore_out(reply: RestoreReply, request: RestoreRequest) -> GymRestoreReply:
    return GymRestoreReply(
        phase=Phase.RESTORED,
        source_checkpoint_id=request.checkpoint_id,
        restored=_episodes(reply.restored),
    )


def _restore_send(request: RestoreRequest, side: ClientSide) -> GymRestoreRequest:
    cannot = [
        what
        for what, present in (
            (
                "records of another instance (source_instance)",
                request.source_instance not in (None, side.instance),
            ),
            ("a subset of rollouts (rollout_ids)", request.rollout_ids is not None),
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
        source_checkpoint_id=request.checkpoint_id,
        checkpoint_dir=request.checkpoint_id,
        attempt=request.attempt,
    )


def _restore_read(gym: GymRestoreReply, request: RestoreRequest, side: ClientSide) -> RestoreReply:
    if gym.source_checkpoint_id != request.checkpoint_id:
        raise Unmappable(
            f"{side.instance} restored {gym.source_checkpoint_id!r}, not {request.checkpoint_id!r}"
        )
    restored = _ours(gym.restored)
    return RestoreReply(
        checkpoint_id=request.checkpoint_id,
        phase=Phase.RESTORED,
        attempt=request.attempt,
        restored=restored,
        record_count=len(restored),
    )


def _resume_in(gym: GymResumeRequest, side: ServerSide) -> ResumeRequest:
    return ResumeRequest(checkpoint_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts)


def _resume_out(reply: ResumeReply, request: ResumeRequest) -> GymResumeReply:
    return GymResumeReply(phase=reply.phase)


def _resume_send(request: ResumeRequest, side: ClientSide) -> GymResumeRequest:
    return GymResumeRequest(checkpoint_id=request.checkpoint_id, deadline_ts=request.deadline_ts)


def _resume_read(gym: GymResumeReply, request: ResumeRequest, side: ClientSide) -> ResumeReply:
    return ResumeReply(checkpoint_id=request.checkpoint_id, phase=gym.phase)


def _retire_in(gym: GymRetireRequest, side: ServerSide) -> RetireRequest:
    rollout_ids = None
    if gym.episode_ids is not None:
        others = sorted({e.attempt for e in gym.episode_ids} - {gym.attempt})
        if others:
            raise Unmappable(
                f"episode_ids: episodes of attempts {others} in a retire of attempt "
                f"{gym.attempt} (retire one attempt per call)"
            )
        rollout_ids = list(dict.fromkeys(e.rollout_id for e in gym.episode_ids))
    return RetireRequest(
        operation_id=gym.checkpoint_id,
        deadline_ts=gym.deadline_ts,
        attempt=gym.attempt,
        rollout_ids=rollout_ids,
    )


def _retire_out(reply: RetireReply, request: RetireRequest) -> GymRetireReply:
    return GymRetireReply(retired=_episodes(reply.retired))


def _retire_send(request: RetireRequest, side: ClientSide) -> GymRetireRequest:
    # `finished` (rollouts another role saw finish) has no Gym field: left out, the
    # participant decides by itself, as `None` means in ours
    return GymRetireRequest(
        checkpoint_id=request.operation_id,
        deadline_ts=request.deadline_ts,
        attempt=request.attempt,
        episode_ids=None
        if request.rollout_ids is None
        else [GymEpisodeId(rollout_id=rid, attempt=request.attempt) for rid in request.rollout_ids],
    )


def _retire_read(gym: GymRetireReply, request: RetireRequest, side: ClientSide) -> RetireReply:
    return RetireReply(operation_id=request.operation_id, retired=_ours(gym.retired))


def _forget_in(gym: GymForgetRequest, side: ServerSide) -> ForgetRequest:
    return ForgetRequest(
        operation_id=gym.checkpoint_id, deadline_ts=gym.deadline_ts, rollout_ids=gym.rollout_ids
    )


def _forget_out(reply: ForgetReply, request: ForgetRequest) -> GymForgetReply:
    return GymForgetReply(forgotten=reply.forgotten)


def _forget_send(request: ForgetRequest, side: ClientSide) -> GymForgetRequest:
    return GymForgetRequest(
        checkpoint_id=request.operation_id,
        deadline_ts=request.deadline_ts,
        rollout_ids=request.rollout_ids,
    )


def _forget_read(gym: GymForgetReply, request: ForgetRequest, side: ClientSide) -> ForgetReply:
    return ForgetReply(operation_id=request.operation_id, forgotten=gym.forgotten)


def _status_in(gym: None, side: ServerSide) -> None:
    return None


def _status_out(reply: StatusReply, request: None) -> GymStatusReply:
    return GymStatusReply(
        phase=reply.phase,
        checkpoint_id=reply.checkpoint_id,
        attempt=reply.attempt,
        lease_expires_ts=reply.lease_expires_ts,
        counts={
            "live": reply.live_episodes,
            "parked": reply.parked_episodes,
            "restored": reply.restored_episodes,
        },
        set_name=reply.set_name,
        set_dir=reply.set_dir,
        standby=reply.standby,
        retired_attempts=reply.retired_attempts,
    )


def _status_send(request: None, side: ClientSide) -> None:
    return None


def _status_read(gym: GymStatusReply, request: None, side: ClientSide) -> StatusReply:
    return StatusReply(
        role=side.role,
        instance=side.instance,
        attempt=gym.attempt,
        phase=gym.phase,
        checkpoint_id=gym.checkpoint_id,
        lease_expires_ts=gym.lease_expires_ts,
        live_episodes=gym.counts.get("live", 0),
        parked_episodes=gym.counts.get("parked", 0),
        restored_episodes=gym.counts.get("restored", 0),
        set_name=gym.set_name,
        set_dir=gym.set_dir,
        standby=gym.standby,
        retired_attempts=gym.retired_attempts,
    )


@dataclass(frozen=True)
class GymCodec:
    """How one route of the table is said in Gym: its models and the four mappings."""

    request: type[GymRequestModel] | None
    reply: type[GymReplyModel]
    to_ours_request: Callable[[Any, ServerSide], Any]
    to_gym_reply: Callable[[Any, Any], GymReplyModel]
    to_gym_request: Callable[[Any, ClientSide], GymRequestModel | None]
    to_ours_reply: Callable[[Any, Any, ClientSide], BaseModel]


CODECS: dict[str, GymCodec] = {
    STATUS.name: GymCodec(
        None, GymStatusReply, _status_in, _status_out, _status_send, _status_read
    ),
    PREPARE.name: GymCodec(
        GymPrepareRequest, GymPrepareReply, _prepare_in, _prepare_out, _prepare_send, _prepare_read
    ),
    RENEW.name: GymCodec(
        GymRenewRequest, GymRenewReply, _renew_in, _renew_out, _renew_send, _renew_read
    ),
    COMMIT.name: GymCodec(
        GymCommitRequest, GymCommitReply, _commit_in, _commit_out, _commit_send, _commit_read
    ),
    RESTORE.name: GymCodec(
        GymRestoreRequest, GymRestoreReply, _restore_in, _restore_out, _restore_send, _restore_read
    ),
    RESUME.name: GymCodec(
        GymResumeRequest, GymResumeReply, _resume_in, _resume_out, _resume_send, _resume_read
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
