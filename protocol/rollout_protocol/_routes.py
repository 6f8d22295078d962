"""The route table of the control plane: one declaration per operation.

Both sides of the HTTP hop are built from this table: the control plane's router
(`ControlPlane.router`) mounts one endpoint per `Route`, and `HttpParticipantClient` sends each
call through the `Route` it names. A route's request model, reply model and error codes are
therefore written once, and an editor's "go to definition" on `PREPARE` leads from the client's
call to the server's handler.

The table is also the one declaration of the NeMo Gym dialect (`Dialect.GYM`, `_gym.py`): a
route says whether Gym has it (`Route.in_gym`), and its Gym path is derived from its name under
Gym's one prefix, so both dialects are mounted, and called, from the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from ._wire import (
    API_PREFIX,
    HTTP_STATUS,
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    ErrorBody,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    PersistRequest,
    PrepareReply,
    PrepareRequest,
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
    StatusReply,
)

GYM_PREFIX = "/ng-control/v1"
"""The NeMo Gym control prefix: its checkpoint routes live under `GYM_PREFIX/checkpoint`."""
GYM_CHECKPOINT_PREFIX = f"{GYM_PREFIX}/checkpoint"
GYM_CAPABILITIES_PATH = f"{GYM_PREFIX}/capabilities"
"""`GET`: what a Gym participant announces; a coordinator reads it to pick the dialect."""


class Dialect(StrEnum):
    """The wire dialects a participant can mount and a coordinator can speak."""

    ROLLOUT = "rollout"
    """This project's: one route per operation under `/checkpoint/v1` (`API_PREFIX`)."""
    GYM = "gym"
    """NeMo Gym's: the same operations under `/ng-control/v1/checkpoint`, with Gym's field
    names and error codes (docs/protocol.md, "The NeMo Gym dialect")."""


RequestT = TypeVar("RequestT", bound=BaseModel | None)
ReplyT = TypeVar("ReplyT", bound=BaseModel)

_EVERY_CALL = frozenset({ErrorCode.UNAUTHORIZED, ErrorCode.INTERNAL, ErrorCode.PAYLOAD_TOO_LARGE})
"""Codes any route may answer: a missing or wrong token, a participant's own failure, a body
over the size limit (refused before it is read)."""
_EVERY_BODY = _EVERY_CALL | {ErrorCode.INVALID_REQUEST, ErrorCode.DEADLINE_PASSED}
"""Codes any route with a body may answer: a body that fails validation (a `deadline_ts` beyond
the participant's horizon included), a passed deadline."""


@dataclass(frozen=True)
class Route(Generic[RequestT, ReplyT]):
    """One control operation: its HTTP method and path, its bodies, and the errors it answers."""

    name: str
    method: Literal["GET", "POST"]
    request: type[RequestT] | None
    reply: type[ReplyT]
    errors: frozenset[ErrorCode]
    summary: str
    in_gym: bool = True
    """Whether the NeMo Gym dialect has this operation (`remove` is ours only)."""

    @property
    def path(self) -> str:
        """The path below `API_PREFIX` (the router adds the prefix)."""
        return f"/{self.name}"

    @property
    def url_path(self) -> str:
        """The full path a client requests."""
        return f"{API_PREFIX}{self.path}"

    def path_in(self, dialect: Dialect) -> str | None:
        """The full path of this route in `dialect`; None when the dialect lacks it."""
        if dialect is Dialect.ROLLOUT:
            return self.url_path
        return f"{GYM_CHECKPOINT_PREFIX}{self.path}" if self.in_gym else None

    def error_statuses(self) -> dict[int | str, dict[str, Any]]:
        """OpenAPI `responses` entries for every error this route may answer."""
        return error_responses(self.errors)


def error_responses(codes: Iterable[ErrorCode]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries (FastAPI's form) for these error codes, one per status."""
    statuses: dict[int, list[str]] = {}
    for code in sorted(set(codes)):
        statuses.setdefault(HTTP_STATUS[code], []).append(code.value)
    return {
        status: {"model": ErrorBody, "description": "error codes: " + ", ".join(names)}
        for status, names in sorted(statuses.items())
    }


STATUS: Route[None, StatusReply] = Route(
    "status",
    "GET",
    None,
    StatusReply,
    _EVERY_CALL,
    "Phase, attempt, lease expiry and episode counts; answers during a prepare.",
)
PREPARE: Route[PrepareRequest, PrepareReply] = Route(
    "prepare",
    "POST",
    PrepareRequest,
    PrepareReply,
    _EVERY_BODY
    | {ErrorCode.STALE_CHECKPOINT, ErrorCode.CONFLICTING_CHECKPOINT, ErrorCode.WRONG_PHASE},
    "Close admission and park in-flight work at boundaries until ready or the deadline.",
)
RENEW: Route[RenewRequest, RenewReply] = Route(
    "renew",
    "POST",
    RenewRequest,
    RenewReply,
    _EVERY_BODY | {ErrorCode.UNKNOWN_CHECKPOINT, ErrorCode.STALE_CHECKPOINT, ErrorCode.WRONG_PHASE},
    "Extend the lease of the open checkpoint only.",
)
COMMIT: Route[CommitRequest, CommitReply] = Route(
    "commit",
    "POST",
    CommitRequest,
    CommitReply,
    _EVERY_BODY
    | {
        ErrorCode.UNKNOWN_CHECKPOINT,
        ErrorCode.STALE_CHECKPOINT,
        ErrorCode.CONFLICTING_CHECKPOINT,
        ErrorCode.WRONG_PHASE,
        ErrorCode.STORAGE_FAILED,
    },
    "Write the records of the scope, then the manifest (or, asked to persist after the resume, "
    "hold them in memory and answer with the manifest they will have).",
)
PERSIST: Route[PersistRequest, CommitReply] = Route(
    "persist",
    "POST",
    PersistRequest,
    CommitReply,
    _EVERY_BODY
    | {
        ErrorCode.UNKNOWN_CHECKPOINT,
        ErrorCode.STALE_CHECKPOINT,
        ErrorCode.STORAGE_FAILED,
    },
    "After the resume: write and fsync the records a cut holds, then the manifest; answer "
    "when durable. Replayed once durable.",
    in_gym=False,
)
DISCARD: Route[DiscardRequest, DiscardReply] = Route(
    "discard",
    "POST",
    DiscardRequest,
    DiscardReply,
    _EVERY_BODY | {ErrorCode.STORAGE_FAILED},
    "Drop the records a cut holds and remove what a persist of them wrote here.",
    in_gym=False,
)
RESTORE: Route[RestoreRequest, RestoreReply] = Route(
    "restore",
    "POST",
    RestoreRequest,
    RestoreReply,
    _EVERY_BODY
    | {
        ErrorCode.STALE_CHECKPOINT,
        ErrorCode.CONFLICTING_CHECKPOINT,
        ErrorCode.WRONG_PHASE,
        ErrorCode.STORAGE_FAILED,
        ErrorCode.RECORDS_INVALID,
        ErrorCode.RECORDS_UNREACHABLE,
        ErrorCode.ATTEMPT_MISMATCH,
        ErrorCode.ATTEMPT_RETIRED,
        ErrorCode.UNSUPPORTED,
    },
    "From idle: verify the published records and install them under their next attempt.",
)
RESUME: Route[ResumeRequest, ResumeReply] = Route(
    "resume",
    "POST",
    ResumeRequest,
    ResumeReply,
    _EVERY_BODY | {ErrorCode.CONFLICTING_CHECKPOINT},
    "Reopen admission; also the abort of any earlier phase.",
)
RETIRE: Route[RetireRequest, RetireReply] = Route(
    "retire",
    "POST",
    RetireRequest,
    RetireReply,
    _EVERY_BODY
    | {ErrorCode.WRONG_PHASE, ErrorCode.CONFLICTING_CHECKPOINT, ErrorCode.LIMIT_EXCEEDED},
    "Stop an attempt's work for the given episodes and refuse that attempt afterwards.",
)
FORGET: Route[ForgetRequest, ForgetReply] = Route(
    "forget",
    "POST",
    ForgetRequest,
    ForgetReply,
    _EVERY_BODY | {ErrorCode.CONFLICTING_CHECKPOINT},
    "Drop the retire marks of finished rollouts.",
)

REMOVE: Route[RemoveRequest, RemoveReply] = Route(
    "remove",
    "POST",
    RemoveRequest,
    RemoveReply,
    _EVERY_BODY | {ErrorCode.CONFLICTING_CHECKPOINT, ErrorCode.STORAGE_FAILED},
    "Remove named checkpoints' records (or the whole set's) from this participant's set "
    "directory; only the protocol's own files.",
    in_gym=False,
)

ROUTES: tuple[Route[Any, Any], ...] = (
    STATUS,
    PREPARE,
    RENEW,
    COMMIT,
    RESTORE,
    RESUME,
    RETIRE,
    FORGET,
    REMOVE,
)
"""The control operations of docs/protocol.md's route table, in its order (`remove` last: it is
the operator's, for retention, and touches no episode)."""

PERSIST_ROUTES: tuple[Route[Any, Any], ...] = (PERSIST, DISCARD)
"""The two calls of the capability `persist_after_resume` (docs/protocol.md, "Persist after
resume"), ours only: after a cut and the resume, write the held records, or drop them."""

CONTROL_ROUTES: tuple[Route[Any, Any], ...] = ROUTES + PERSIST_ROUTES
"""Every route a control plane mounts (each in the dialects that have it)."""
