"""The checkpoint control plane every rollout server mounts under `/checkpoint/v1` (and, where
its settings say so, in NeMo Gym's dialect under `/ng-control/v1`, mapped by `_gym`).

It owns everything that must behave the same in every server: authentication, the phase
machine, reply replay, the lease and its watchdog, storage, and retire marks. A server only
supplies a `Participant` (how to park, what to record, how to install and stop work).

Control operations are serialized by one lock: they are rare, and a strict order is what makes
replayed replies and phase checks trustworthy. `/status` does not take the lock, so it answers
even while a prepare waits for episodes to park. Storage I/O under the lock is bounded by the
request's deadline (`_storage_io`): storage that hangs (a stale network mount) fails that call
at its deadline and frees the lock, instead of holding every later control call behind it.
"""

from __future__ import annotations

import errno
import gc
import hmac
import json
import logging
import math
import multiprocessing
import os
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup
from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _gym as gym
from . import _storage as storage
from . import tracing
from ._participant import ParkState, Participant, episodes_digest
from ._routes import (
    COMMIT,
    FORGET,
    GYM_CAPABILITIES_PATH,
    GYM_PREFIX,
    PREPARE,
    REMOVE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    ROUTES,
    STATUS,
    Dialect,
    Route,
    error_responses,
)
from ._wire import (
    API_PREFIX,
    CHECKPOINT_ID_PATTERN,
    MAX_BLOCKERS_REPORTED,
    MAX_FINISHED_LISTED,
    CommitReply,
    CommitRequest,
    ErrorBody,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    MultiProcess,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
    Record,
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
    Role,
    StatusReply,
    instance_name,
)

logger = logging.getLogger(__name__)

OPEN_PHASES = frozenset({Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED})
"""Phases in which a checkpoint is being taken; retire is refused in them."""

_REMEMBERED = 4096
"""How many stale ids and idempotent operations are remembered (oldest forgotten first)."""

_PARK_OVERRUN_SECONDS = 2.0

MAX_BODY_BYTES = 16 * 1024 * 1024
"""Default largest request body a participant reads (`ROLLOUT_MAX_BODY_BYTES`), on every route."""
MAX_DEADLINE_SECONDS = 6 * 3600.0
"""Default horizon of `deadline_ts` (`ROLLOUT_MAX_DEADLINE_SECONDS`): a deadline further ahead
is refused, so every lease a call opens lapses within it plus the lease grace."""
MAX_RETIRE_MARKS = 100_000
"""Default bound of per-rollout retire marks of the running attempt (`ROLLOUT_MAX_RETIRE_MARKS`)."""
"""How long past its deadline a participant's `park` may run before the call is failed."""

_Model = TypeVar("_Model", bound=BaseModel)
_T = TypeVar("_T")


class ControlConfigError(ValueError):
    """The control plane cannot start with this configuration; the message says what to set."""


# --- settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlSettings:
    """How one participant's control plane is configured (`from_env` reads the pod's variables)."""

    role: Role
    index: int = 0
    set_name: str = "local"
    checkpoint_root: Path | None = None
    set_dir: str | None = None
    """The set's directory under the checkpoint root (`<namespace>/<set>/<uid>` from the
    operator, see `set_storage_dir`); None: the set name, as without an operator."""
    attempt: int = 0
    standby: bool = False
    """A standby (`ROLLOUT_STANDBY=1`): a warm spare in no attempt that a recovery adopts for a
    lost instance; the adopting restore gives it the instance's index (`RestoreRequest.index`)."""
    token: str | None = None
    allow_unauthenticated: bool = False
    lease_grace_seconds: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES
    max_deadline_seconds: float = MAX_DEADLINE_SECONDS
    max_retire_marks: int = MAX_RETIRE_MARKS
    dialects: tuple[Dialect, ...] = (Dialect.ROLLOUT,)
    """The wire dialects the control plane mounts (`ROLLOUT_CONTROL_DIALECTS`, comma separated:
    `rollout`, `gym` or both): ours under `/checkpoint/v1`, NeMo Gym's under `/ng-control/v1`."""
    workers: int = 1
    """Worker processes of this pod's server. Above 1 in the pod's main process of
    `rollout_protocol.workers.serve_workers`: this plane coordinates them all (`managed`)."""
    worker: int | None = None
    """This process's index among its pod's workers (`ROLLOUT_WORKER=<k>/<n>`, set by
    `serve_workers` in each worker): its plane serves the pod's private worker channel instead
    of the control routes. None: not a managed worker."""
    worker_key: str | None = field(default=None, repr=False)
    """A managed worker's key to its private channel (`ROLLOUT_WORKER_KEY`, made at random by
    `serve_workers` for each pod run and known only to the pod's processes): the channel's
    routes answer only a request that carries it, so nothing the pod's public port forwards
    can reach them (docs/protocol.md, "Workers")."""
    unmanaged_workers: int = 1
    """Worker processes this server's own process manager runs without `serve_workers`
    (`WEB_CONCURRENCY`, which uvicorn and gunicorn read for `--workers`): above 1 the status
    route says `multi_process: unmanaged` and the operator refuses to checkpoint the set."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        try:
            dialects = tuple(dict.fromkeys(Dialect(d) for d in self.dialects))
        except ValueError:
            raise ControlConfigError(
                f"dialects {list(self.dialects)!r}: each must be one of "
                f"{[d.value for d in Dialect]} (ROLLOUT_CONTROL_DIALECTS)"
            ) from None
        if not dialects:
            raise ControlConfigError("dialects: mount at least one (ROLLOUT_CONTROL_DIALECTS)")
        object.__setattr__(self, "dialects", dialects)
        if self.index < 0:
            raise ControlConfigError(f"index must be >= 0, got {self.index}")
        if self.attempt < 0:
            raise ControlConfigError(f"attempt must be >= 0, got {self.attempt}")
        if re.fullmatch(CHECKPOINT_ID_PATTERN, self.set_name) is None:
            raise ControlConfigError(
                f"set name {self.set_name!r} must match {CHECKPOINT_ID_PATTERN} "
                "(it names a directory under the checkpoint root)"
            )
        if self.set_dir is not None:
            try:
                storage.check_set_dir(self.set_dir)
            except storage.UnsafePath as error:
                raise ControlConfigError(f"ROLLOUT_SET_DIR: {error}") from None
        if not (math.isfinite(self.lease_grace_seconds) and self.lease_grace_seconds > 0):
            raise ControlConfigError(
                f"lease_grace_seconds must be a positive number, got {self.lease_grace_seconds}"
            )
        if self.max_body_bytes < 1024:
            raise ControlConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not (math.isfinite(self.max_deadline_seconds) and self.max_deadline_seconds > 0):
            raise ControlConfigError(
                f"max_deadline_seconds must be a positive number, got {self.max_deadline_seconds}"
            )
        if self.max_retire_marks < 1:
            raise ControlConfigError(f"max_retire_marks must be >= 1, got {self.max_retire_marks}")
        if self.workers < 1 or self.unmanaged_workers < 1:
            raise ControlConfigError("workers must be >= 1")
        if self.worker is not None and not 0 <= self.worker < self.workers:
            raise ControlConfigError(f"worker {self.worker} is not one of {self.workers} workers")
        if self.worker is not None and not self.worker_key:
            raise ControlConfigError(
                f"worker {self.worker} has no key to its private channel: {WORKER_KEY_ENV} is "
                f"set by serve_workers together with {WORKER_ENV}"
            )
        if self.token is not None and not self.token:
            raise ControlConfigError("the control token is empty; unset it or give a real one")
        if self.token is None and not self.allow_unauthenticated:
            raise ControlConfigError(
                "no control token: set ROLLOUT_CONTROL_TOKEN, or allow unauthenticated control "
                "explicitly (allow_unauthenticated=True) on a trusted network only"
            )

    @classmethod
    def from_env(
        cls,
        role: Role,
        *,
        index: int | None = None,
        allow_unauthenticated: bool = False,
        environ: Mapping[str, str] | None = None,
    ) -> ControlSettings:
        """Settings from the variables the operator puts into every participant pod.

        `ROLLOUT_SET_DIR` (set by the operator) is the set's directory under the checkpoint
        root; without it (a participant run by hand) records go under the set name."""
        env = os.environ if environ is None else environ
        root = env.get("ROLLOUT_CHECKPOINT_ROOT") or None
        grace = env.get("ROLLOUT_LEASE_GRACE_SECONDS")
        return cls(
            role=Role(role),
            index=index if index is not None else _int_from_env(env, "ROLLOUT_INDEX", 0),
            set_name=env.get("ROLLOUT_SET") or "local",
            checkpoint_root=Path(root) if root is not None else None,
            set_dir=env.get("ROLLOUT_SET_DIR") or None,
            attempt=_int_from_env(env, "ROLLOUT_ATTEMPT", 0),
            standby=env.get("ROLLOUT_STANDBY", "") in ("1", "true"),
            token=env.get("ROLLOUT_CONTROL_TOKEN") or None,
            allow_unauthenticated=allow_unauthenticated,
            lease_grace_seconds=_float_from_env(grace, 30.0),
            max_body_bytes=_int_from_env(env, "ROLLOUT_MAX_BODY_BYTES", MAX_BODY_BYTES),
            max_deadline_seconds=_float_from_env(
                env.get("ROLLOUT_MAX_DEADLINE_SECONDS"),
                MAX_DEADLINE_SECONDS,
                "ROLLOUT_MAX_DEADLINE_SECONDS",
            ),
            max_retire_marks=_int_from_env(env, "ROLLOUT_MAX_RETIRE_MARKS", MAX_RETIRE_MARKS),
            dialects=_dialects_from_env(env.get("ROLLOUT_CONTROL_DIALECTS")),
            **_workers_from_env(env),
        )

    @property
    def multi_process(self) -> MultiProcess:
        """`single`, `managed` (a pod of `serve_workers`: its main process or one of its
        workers) or `unmanaged` (several workers nobody here coordinates)."""
        if self.workers > 1 or self.worker is not None:
            return MultiProcess.MANAGED
        return MultiProcess.UNMANAGED if self.unmanaged_workers > 1 else MultiProcess.SINGLE

    @property
    def instance(self) -> str:
        return instance_name(self.role, self.index)

    @property
    def storage_dir(self) -> str:
        """Where this set's checkpoints go under the checkpoint root."""
        return self.set_dir if self.set_dir is not None else self.set_name


WORKER_ENV = "ROLLOUT_WORKER"
"""`<k>/<n>`: set by `serve_workers` in the environment of worker k of n."""
WORKER_KEY_ENV = "ROLLOUT_WORKER_KEY"
"""The pod's private worker channel key: set by `serve_workers` in each worker's environment."""


def _workers_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """`worker`, `workers` from `ROLLOUT_WORKER`; else `unmanaged_workers` from
    `WEB_CONCURRENCY` (uvicorn's and gunicorn's default for their `--workers`)."""
    slot = env.get(WORKER_ENV)
    if slot:
        try:
            k, n = (int(part) for part in slot.split("/", 1))
        except ValueError:
            raise ControlConfigError(f"{WORKER_ENV}={slot!r}: expected <k>/<n>") from None
        return {"worker": k, "workers": n, "worker_key": env.get(WORKER_KEY_ENV) or None}
    declared = declared_workers(env)
    # uvicorn --workers N starts each worker with multiprocessing (gunicorn forks): a server
    # process that is a multiprocessing child and no managed worker runs beside others.
    spawned = 2 if multiprocessing.parent_process() is not None else 1
    return {"unmanaged_workers": max(1, declared, spawned)}


def declared_workers(env: Mapping[str, str]) -> int:
    """The worker processes `WEB_CONCURRENCY` declares (1 when unset): the variable uvicorn and
    gunicorn read for `--workers`, parsed as strictly as every other count here."""
    return _int_from_env(env, "WEB_CONCURRENCY", 1)


def _int_from_env(env: Mapping[str, str], name: str, default: int) -> int:
    """A whole number of ASCII digits (`int()` alone would also take ` 3`, `3_0` or Arabic-Indic
    digits, and `str.isdigit()` takes `²`, which `int()` then refuses)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if re.fullmatch(r"[0-9]{1,18}", raw) is None:
        raise ControlConfigError(f"{name}={raw!r} is not a whole number (ASCII digits)")
    return int(raw)


def _dialects_from_env(raw: str | None) -> tuple[Dialect, ...]:
    if raw is None or not raw.strip():
        return (Dialect.ROLLOUT,)
    names = [name.strip() for name in raw.split(",") if name.strip()]
    try:
        return tuple(Dialect(name) for name in names)
    except ValueError:
        raise ControlConfigError(
            f"ROLLOUT_CONTROL_DIALECTS={raw!r}: name {[d.value for d in Dialect]}, comma separated"
        ) from None


def _float_from_env(
    raw: str | None, default: float, name: str = "ROLLOUT_LEASE_GRACE_SECONDS"
) -> float:
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ControlConfigError(f"{name}={raw!r} is not a number") from None


# --- the phase machine (pure: no I/O, no clock) ---------------------------------------------


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
        self._restored: dict[tuple[str, int], RestoreReply] = {}
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
        _refuse_passed(deadline_ts, now)
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
        _refuse_passed(deadline_ts, now)
        return None

    def end_commit(self, reply: CommitReply) -> None:
        if self.checkpoint_id == reply.checkpoint_id:
            self.phase = Phase.COMMITTED
            self._committed[reply.checkpoint_id] = reply

    # restore ----------------------------------------------------------------------------------

    def admit_restore(
        self, checkpoint_id: str, attempt: int, deadline_ts: float, now: float
    ) -> RestoreReply | None:
        if (checkpoint_id, attempt) in self._stale_restores:
            raise ProtocolError(
                ErrorCode.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} was already restored under attempt {attempt} "
                "and resumed; restore it under a new attempt",
            )
        if self.phase is Phase.RESTORED and checkpoint_id == self.checkpoint_id:
            cached = self._restored.get((checkpoint_id, attempt))
            if cached is not None:
                return cached
            raise ProtocolError(
                ErrorCode.CONFLICTING_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} is already restored under attempt "
                f"{self.restore_attempt}, not {attempt}",
            )
        self._refuse_other_open(checkpoint_id)
        if self.phase is not Phase.IDLE:
            raise self._wrong_phase("restore")
        _refuse_passed(deadline_ts, now)
        return None

    def end_restore(self, attempt: int, reply: RestoreReply) -> None:
        self.phase = Phase.RESTORED
        self.checkpoint_id = reply.checkpoint_id
        self.restore_attempt = attempt
        self._restored[(reply.checkpoint_id, attempt)] = reply

    # renew, resume, lease ---------------------------------------------------------------------

    def admit_renew(self, checkpoint_id: str, deadline_ts: float, now: float) -> None:
        self._refuse_stale(checkpoint_id)
        self._refuse_unknown(checkpoint_id)
        _refuse_passed(deadline_ts, now)

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
        _remember(self._stale, checkpoint_id)
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
            _remember(self._stale, checkpoint_id)
            self._prepared.pop(checkpoint_id, None)
            self._committed.pop(checkpoint_id, None)
            if self.restore_attempt is not None:
                _remember(self._stale_restores, (checkpoint_id, self.restore_attempt))
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


def _refuse_passed(deadline_ts: float, now: float) -> None:
    if deadline_ts <= now:
        raise ProtocolError(
            ErrorCode.DEADLINE_PASSED,
            f"deadline_ts {deadline_ts:.3f} is {now - deadline_ts:.3f}s in the past",
        )


def _remember(memory: OrderedDict[Any, None], key: object) -> None:
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > _REMEMBERED:
        memory.popitem(last=False)


# --- retire marks ---------------------------------------------------------------------------


class RetireMarks:
    """Which (attempt, rollout) pairs must never run again here, in bounded memory.

    A participant only ever runs its current attempt, so every rollout of an attempt below it
    is refused for good: once the attempt moves on (`settle`), the per-rollout marks of older
    attempts fold into one whole-attempt mark each, and whole-attempt marks beyond the newest
    `_WHOLE_KEPT` fold into `floor` (every attempt at or below it is retired). Per-rollout marks
    of the running (or a later) attempt are real state: they are bounded by `limit`, and a
    retire that would pass it is refused (`limit_exceeded`) until `forget` frees marks.
    """

    _WHOLE_KEPT = 64

    def __init__(self, limit: int = MAX_RETIRE_MARKS) -> None:
        self.limit = limit
        self.floor = -1
        self._whole: set[int] = set()
        self._rollouts: dict[int, set[str]] = {}

    def room(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        """Refuse a retire whose marks would not fit (before anything is marked)."""
        if self.covers_attempt(attempt):
            return
        if rollout_ids is None:
            if len(self._whole) >= self.limit:
                raise ProtocolError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"{len(self._whole)} attempts are retired here already (limit {self.limit})",
                )
            return
        marked = self._rollouts.get(attempt, set())
        new = len(rollout_ids - marked)
        if self.count() + new > self.limit:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"retiring {new} more rollouts would hold {self.count() + new} retire marks "
                f"(limit {self.limit}); forget finished rollouts first",
            )

    def add(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        if self.covers_attempt(attempt):
            return
        if rollout_ids is None:
            self._whole.add(attempt)
            self._rollouts.pop(attempt, None)  # the whole-attempt mark covers them
        else:
            self._rollouts.setdefault(attempt, set()).update(rollout_ids)

    def settle(self, current: int) -> None:
        """The participant runs `current` now: fold the marks of older attempts."""
        for attempt in [a for a in self._rollouts if a < current]:
            del self._rollouts[attempt]
            self._whole.add(attempt)
        older = sorted(a for a in self._whole if a < current)
        for attempt in older[: max(0, len(older) - self._WHOLE_KEPT)]:
            self._whole.discard(attempt)
            self.floor = max(self.floor, attempt)

    def count(self) -> int:
        """Per-rollout marks held (whole-attempt marks cost one integer each)."""
        return sum(len(marked) for marked in self._rollouts.values())

    def covers_attempt(self, attempt: int) -> bool:
        return attempt <= self.floor or attempt in self._whole

    def covers(self, attempt: int, rollout_id: str) -> bool:
        return self.covers_attempt(attempt) or rollout_id in self._rollouts.get(attempt, ())

    def whole_attempts(self) -> list[int]:
        return sorted(self._whole)

    def forget(self, rollout_ids: frozenset[str]) -> int:
        """Drop per-rollout marks; whole-attempt marks stay (they describe the attempt)."""
        dropped = 0
        for attempt in list(self._rollouts):
            marked = self._rollouts[attempt]
            gone = marked & rollout_ids
            dropped += len(gone)
            marked -= gone
            if not marked:
                del self._rollouts[attempt]
        return dropped


# --- the garbage collector during a checkpoint ----------------------------------------------


class CollectorHold:
    """Keeps Python's cyclic garbage collector off while a participant is prepared.

    Once prepared, every episode of the set is parked and waits for the commit and the resume.
    A collection then lengthens every episode's pause by its own length, and the commit itself
    allocates enough to trigger several: in a reference server holding 1,000 episodes a full
    collection took 60-150 ms, about the whole rest of the pause. Reference counting still frees
    nearly everything meanwhile, the window is bounded by the lease, and the collector runs
    again, catching up, as soon as the checkpoint closes.

    The collector is process-wide, so holds are counted (several control planes can share a
    process, as in tests), and a collector the application had switched off stays off.
    """

    _holds = 0
    _switched_off = False

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        if self.held:
            return
        self.held = True
        if CollectorHold._holds == 0 and gc.isenabled():
            gc.disable()
            CollectorHold._switched_off = True
        CollectorHold._holds += 1

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        CollectorHold._holds -= 1
        if CollectorHold._holds == 0 and CollectorHold._switched_off:
            CollectorHold._switched_off = False
            gc.enable()


# --- the control plane ----------------------------------------------------------------------


@dataclass
class _AheadDirectory:
    """A checkpoint directory being created ahead of its commit (see `_create_directory_ahead`)."""

    checkpoint_id: str
    done: anyio.Event
    path: Path | None = None
    """`<root>/<set_dir>/<checkpoint_id>/<instance>` once made; an abort removes it and its
    checkpoint level."""


class ControlPlane:
    """Mount with `install(app)`; the participant's server keeps running its own routes."""

    def __init__(
        self,
        participant: Participant,
        settings: ControlSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if Role(participant.role) is not settings.role:
            raise ControlConfigError(
                f"participant role {participant.role} does not match settings role {settings.role}"
            )
        if settings.token is None:
            logger.warning(
                "control plane of %s runs WITHOUT authentication (allow_unauthenticated); "
                "anyone who reaches it can pause, restore or retire rollouts",
                settings.instance,
            )
        self._participant = participant
        self._settings = settings
        self._clock = clock
        self._attempt = settings.attempt
        self._machine = PhaseMachine()
        self._marks = RetireMarks(settings.max_retire_marks)
        self._marks.settle(self._attempt)
        self._operations: OrderedDict[str, RetireReply | ForgetReply] = OrderedDict()
        self._work_since: str | None = None
        """The last checkpoint this process committed or restored: lost work counts from it."""
        self._lock = anyio.Lock()
        self._lease_changed = anyio.Event()
        self._watchdog_scope: anyio.CancelScope | None = None
        self._background: TaskGroup | None = None
        self._parking: tuple[str, anyio.CancelScope] | None = None
        self._directory: _AheadDirectory | None = None
        self._collector = CollectorHold()
        self.router = self._build_router()

    # public API -------------------------------------------------------------------------------

    @property
    def settings(self) -> ControlSettings:
        return self._settings

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def phase(self) -> Phase:
        return self._machine.phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._machine.checkpoint_id

    def is_retired(self, attempt: int, rollout_id: str) -> bool:
        return self._marks.covers(attempt, rollout_id)

    def authorize(self, authorization: str | None) -> None:
        """Check an `Authorization` header against the control token (constant time); raise
        `ProtocolError(UNAUTHORIZED)` (401 once the plane is installed) when it does not match.

        For a server's own routes that reveal what only the operator may know, such as the
        rollout ids in `GET /stats?detail=true`. Without a token (allow_unauthenticated) every
        caller passes, as on the control routes."""
        self._authorize(authorization)

    def install(self, app: FastAPI) -> None:
        """Mount the routes and error handlers, and run the lease watchdog with the app.

        Create the app with its own lifespan (if any) before calling this; the watchdog wraps it.
        With `OTEL_EXPORTER_OTLP_ENDPOINT` set, the process exports traces from here on
        (`tracing.configure`, service `rollout-<role>`) unless it set up OpenTelemetry itself.
        """
        tracing.configure(
            f"rollout-{self._settings.role.value}",
            attributes={
                "rollout.instance": self._settings.instance,
                "rollout.set": self._settings.set_name,
            },
        )
        declare_error_statuses(app)
        if self._settings.worker is None:
            app.include_router(self.router)
        else:
            # A worker of a multi-worker pod: the pod's main process owns the control routes
            # and drives this process over the private worker channel (`_workers`).
            from ._workers import worker_router

            app.include_router(worker_router(self))
        app.add_exception_handler(ProtocolError, _protocol_error_handler)
        app.add_exception_handler(RequestValidationError, _validation_error_handler)
        app.add_exception_handler(HTTPException, _http_error_handler)
        app.add_exception_handler(BodyTooLarge, _protocol_error_handler)
        app.add_middleware(BodyLimit, max_bytes=self._settings.max_body_bytes)
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(application: Any) -> AsyncIterator[Any]:
            async with self.running(), inner(application) as state:
                yield state

        app.router.lifespan_context = lifespan

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ControlPlane]:
        """Run the lease watchdog for the duration of the block (the app lifespan uses this)."""
        async with anyio.create_task_group() as group:
            self._watchdog_scope = group.cancel_scope
            self._background = group
            group.start_soon(self._watchdog)
            try:
                yield self
            finally:
                group.cancel_scope.cancel()
                self._watchdog_scope = None
                self._background = None
                self._collector.release()

    def follow(self, attempt: int, index: int | None = None) -> None:
        """A worker's plane: the pod's plane restored `attempt` (its `/run` checks this one)
        as instance `index` (a standby pod adopted for a lost instance: the worker is that
        instance from now on, in its `settings` and whatever a server reports from them)."""
        self._attempt = attempt
        self._marks.settle(attempt)
        if index is not None and (index != self._settings.index or self._settings.standby):
            self._settings = replace(self._settings, index=index, standby=False)

    def mark_retired(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        """A worker's plane: the pod's plane retires this; refuse its work from now on."""
        self._marks.room(attempt, rollout_ids)
        self._marks.add(attempt, rollout_ids)

    @property
    def participant(self) -> Participant:
        return self._participant

    async def aclose(self) -> None:
        """Stop the watchdog; an open checkpoint is left as is (its coordinator will resume it).
        The garbage collector is given back: it is process-wide, and this plane no longer
        pauses anything."""
        if self._watchdog_scope is not None:
            self._watchdog_scope.cancel()
        self._collector.release()

    def status(self) -> StatusReply:
        counts = self._participant.counts()
        return StatusReply(
            role=self._settings.role,
            instance=self._settings.instance,
            set_name=self._settings.set_name,
            set_dir=self._settings.set_dir,
            standby=self._settings.standby,
            attempt=self._attempt,
            phase=self._machine.phase,
            checkpoint_id=self._machine.checkpoint_id,
            lease_expires_ts=self._machine.lease_expires_ts,
            live_episodes=counts.live,
            parked_episodes=counts.parked,
            restored_episodes=counts.restored,
            retired_attempts=self._marks.whole_attempts(),
            multi_process=self._settings.multi_process,
            workers=max(self._settings.workers, self._settings.unmanaged_workers),
        )

    # operations -------------------------------------------------------------------------------

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        async with self._lock:
            cid = request.checkpoint_id
            cached = self._machine.admit_prepare(cid, request.deadline_ts, self._clock())
            self._extend_lease(request.deadline_ts)
            if cached is not None:
                return cached
            if self._machine.begin_prepare(cid):
                with tracing.span("close admission"):
                    await self._call("close_admission", self._participant.close_admission())
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
            self._machine.end_prepare(reply)
            if state.ready:
                self._collector.hold()
                self._create_directory_ahead(cid)
            else:
                logger.info(
                    "%s: prepare %s not ready at its deadline: %d blockers",
                    self._settings.instance,
                    cid,
                    len(state.blockers),
                )
            return reply

    async def renew(self, request: RenewRequest) -> RenewReply:
        async with self._lock:
            self._machine.admit_renew(request.checkpoint_id, request.deadline_ts, self._clock())
            self._extend_lease(request.deadline_ts)
            expires = self._machine.lease_expires_ts
            assert expires is not None
            return RenewReply(
                checkpoint_id=request.checkpoint_id,
                phase=self._machine.phase,
                lease_expires_ts=expires,
            )

    async def commit(self, request: CommitRequest) -> CommitReply:
        async with self._lock:
            cid = request.checkpoint_id
            cached = self._machine.admit_commit(cid, request.deadline_ts, self._clock())
            self._extend_lease(request.deadline_ts)
            if cached is not None:
                return cached
            root = self._require_root("commit")
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
            try:
                with tracing.span("write"), self._storage_deadline("commit", request.deadline_ts):
                    directory = await self._commit_directory(root, cid)
                    manifest = await _storage_io(
                        lambda: storage.write_records(
                            directory,
                            role=self._settings.role,
                            instance=self._settings.instance,
                            checkpoint_id=cid,
                            attempt=self._attempt,
                            encoded=encoded,
                        )
                    )
            except storage.StorageError as error:
                logger.error("%s: commit %s failed: %s", self._settings.instance, cid, error)
                raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
            if scope is not None:
                self._participant.release_outside(scope)
            self._checkpointed(cid, [item.record for item in encoded])
            reply = CommitReply(
                checkpoint_id=cid,
                phase=Phase.COMMITTED,
                manifest=manifest,
                manifest_path=str((directory / storage.MANIFEST_NAME).relative_to(root).as_posix()),
            )
            self._machine.end_commit(reply)
            return reply

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        async with self._lock:
            cid = request.checkpoint_id
            cached = self._machine.admit_restore(
                cid, request.attempt, request.deadline_ts, self._clock()
            )
            if cached is not None:
                self._extend_lease(request.deadline_ts)
                return cached
            if request.attempt < self._attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH,
                    f"restore under attempt {request.attempt}, but this process already runs "
                    f"attempt {self._attempt}",
                )
            if self._marks.covers_attempt(request.attempt):
                raise ProtocolError(
                    ErrorCode.ATTEMPT_RETIRED,
                    f"attempt {request.attempt} was retired here; restore under a newer attempt",
                )
            self._take_identity(request.index)
            with tracing.span("verify"):
                records = await self._verified_records(request)
            if request.peers is not None:
                self._rewire(request.peers)
            self._extend_lease(request.deadline_ts)
            await self._call("close_admission", self._participant.close_admission())
            try:
                with tracing.span("install", attributes={"rollout.records": len(records)}):
                    restored = await self._participant.install(records, request.attempt)
            except Exception as error:
                logger.exception("%s: install failed", self._settings.instance)
                await self._call("reopen", self._participant.reopen())
                self._machine.lease_expires_ts = None
                raise ProtocolError(
                    ErrorCode.INTERNAL, f"install failed: {type(error).__name__}: {error}"
                ) from error
            self._attempt = request.attempt
            self._marks.settle(request.attempt)
            self._checkpointed(cid, records)
            reply = RestoreReply(
                checkpoint_id=cid,
                phase=Phase.RESTORED,
                attempt=request.attempt,
                restored=restored,
                record_count=len(records),
                kept=self._work("kept_work", lambda: self._participant.kept_work(records)),
            )
            self._machine.end_restore(request.attempt, reply)
            return reply

    def _take_identity(self, index: int | None) -> None:
        """A standby becomes the instance a recovery adopts it for; anyone else keeps its own."""
        if index is None or (index == self._settings.index and not self._settings.standby):
            return
        if not self._settings.standby:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"{self._settings.instance} is not a standby: it cannot become "
                f"{instance_name(self._settings.role, index)}",
            )
        was = self._settings.instance
        self._settings = replace(self._settings, index=index, standby=False)
        logger.info("%s: standby adopted as %s", was, self._settings.instance)

    def _rewire(self, peers: Mapping[Role, str]) -> None:
        """Point the participant at new peers before anything is installed (InPlace recovery)."""
        try:
            self._participant.rewire(peers)
        except NotImplementedError as error:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED,
                f"{self._settings.instance} cannot re-wire its peers ({error}); replace it instead",
            ) from None
        logger.info(
            "%s: peers re-wired: %s",
            self._settings.instance,
            ", ".join(f"{role.value}={url}" for role, url in sorted(peers.items())),
        )

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        """Resume (and abort) is accepted even past its deadline: it only ever frees work.

        A prepare of the same id that is still parking (holding the lock until its deadline) is
        interrupted first, so an abort takes effect at once rather than at the prepare deadline.
        """
        parking = self._parking
        if parking is not None and parking[0] == request.checkpoint_id:
            parking[1].cancel()
        async with self._lock:
            committed = self._machine.phase is Phase.COMMITTED
            if self._machine.resume(request.checkpoint_id):
                self._lease_changed.set()
                # Reopen first: the collector, back on, catches up on the garbage of the whole
                # pause at its next allocation, and that collection must not delay the reopen.
                try:
                    with tracing.span("reopen"):
                        await self._call("reopen", self._participant.reopen())
                finally:
                    self._closed(committed)
            return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def retire(self, request: RetireRequest) -> RetireReply:
        async with self._lock:
            cached = self._operations.get(request.operation_id)
            if isinstance(cached, RetireReply):
                return cached
            self._refuse_reused_operation(request.operation_id, cached)
            self._machine.check_retire()
            _refuse_passed(request.deadline_ts, self._clock())
            scope = None if request.rollout_ids is None else frozenset(request.rollout_ids)
            self._marks.room(request.attempt, scope)
            # Marks first: work of this attempt that arrives while we wait is refused already.
            self._marks.add(request.attempt, scope)
            try:
                with anyio.fail_after(max(0.0, request.deadline_ts - self._clock())):
                    retired = await self._participant.retire(request.attempt, scope)
            except TimeoutError:
                raise ProtocolError(
                    ErrorCode.DEADLINE_PASSED,
                    f"retire of attempt {request.attempt} did not finish by its deadline; "
                    "retry with the same operation_id",
                ) from None
            # After the retire: an episode in its final cleanup finishes while the retire waits
            # for it (its result reaches the trainer, whose work is not lost).
            finished = self._finished_rollouts(request.attempt)
            told = None if request.finished is None else frozenset(request.finished)
            lost = self._work(
                "lost_work", lambda: self._participant.lost_work(request.attempt, told)
            )
            reply = RetireReply(
                operation_id=request.operation_id,
                retired=retired,
                lost=lost,
                lost_since=self._work_since if lost is not None else None,
                finished=finished,
            )
            _remember_operation(self._operations, request.operation_id, reply)
            return reply

    def _checkpointed(self, checkpoint_id: str, records: Sequence[Record]) -> None:
        """Lost work counts from this checkpoint on (the participant's accounting never fails
        a protocol call: an error is logged and counts nothing)."""
        self._work_since = checkpoint_id
        try:
            self._participant.checkpointed(checkpoint_id, records)
        except Exception:
            logger.exception("%s: work accounting (checkpointed) failed", self._settings.instance)

    def _finished_rollouts(self, attempt: int) -> list[str] | None:
        try:
            finished = self._participant.finished_rollouts(attempt)
        except Exception:
            logger.exception("%s: work accounting (finished) failed", self._settings.instance)
            return None
        if finished is None or len(finished) > MAX_FINISHED_LISTED:
            return None
        return sorted(set(finished))

    def _work(self, what: str, count: Callable[[], dict[str, int] | None]) -> dict[str, int] | None:
        """A participant's work counts, or None when it counts nothing or its counting failed."""
        try:
            counts = count()
        except Exception:
            logger.exception("%s: work accounting (%s) failed", self._settings.instance, what)
            return None
        if counts is None:
            return None
        return {name: max(0, int(amount)) for name, amount in counts.items()}

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        async with self._lock:
            cached = self._operations.get(request.operation_id)
            if isinstance(cached, ForgetReply):
                return cached
            self._refuse_reused_operation(request.operation_id, cached)
            ids = frozenset(request.rollout_ids)
            dropped = self._marks.forget(ids)
            try:
                self._participant.forget(ids)
            except Exception as error:
                logger.exception("%s: forget failed", self._settings.instance)
                raise ProtocolError(
                    ErrorCode.INTERNAL, f"forget failed: {type(error).__name__}: {error}"
                ) from error
            reply = ForgetReply(operation_id=request.operation_id, forgotten=dropped)
            _remember_operation(self._operations, request.operation_id, reply)
            return reply

    async def remove(self, request: RemoveRequest) -> RemoveReply:
        """Remove checkpoints' records from this participant's own set directory (the operator's
        retention and finalizers, where the operator cannot mount the volume itself).

        Never the open checkpoint (or, for `whole_set`, while one is open): that would take
        records a commit is writing or a recovery may restore. The check is made under the lock;
        the removal itself runs outside it, in a worker thread bounded by the call's deadline,
        so a slow volume never holds up a prepare."""
        _refuse_passed(request.deadline_ts, self._clock())
        root = self._require_root("remove")
        async with self._lock:
            open_id = self._machine.checkpoint_id if self._machine.phase is not Phase.IDLE else None
            if open_id is not None and (request.whole_set or open_id in request.checkpoint_ids):
                raise ProtocolError(
                    ErrorCode.CONFLICTING_CHECKPOINT,
                    f"checkpoint {open_id} is open ({self._machine.phase.value}); its records "
                    "cannot be removed until it closes",
                )
        set_dir = self._settings.storage_dir

        def remove_all() -> RemoveReply:
            return storage.remove_records(
                root, set_dir, request.checkpoint_ids, whole_set=request.whole_set
            )

        try:
            with self._storage_deadline("remove", request.deadline_ts):
                reply = await _storage_io(remove_all)
        except storage.StorageError as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        except storage.UnsafePath as error:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(error)) from error
        logger.info(
            "%s: removed records of %s (absent: %s, kept: %d)",
            self._settings.instance,
            reply.removed or "nothing",
            reply.absent or "none",
            reply.kept_count,
        )
        return reply

    # internals --------------------------------------------------------------------------------

    def _extend_lease(self, deadline_ts: float) -> None:
        self._machine.extend_lease(deadline_ts + self._settings.lease_grace_seconds)
        self._lease_changed.set()

    @contextmanager
    def _storage_deadline(self, operation: str, deadline_ts: float) -> Iterator[None]:
        """Bound the storage I/O of a call holding the lock by the call's deadline: past it the
        call fails (`storage_failed`), the lock is freed, and the worker thread is left to
        finish on its own (its result is dropped)."""
        try:
            with anyio.fail_after(max(0.0, deadline_ts - self._clock())):
                yield
        except TimeoutError:
            logger.error(
                "%s: %s: storage did not answer by the deadline", self._settings.instance, operation
            )
            raise storage.StorageError(
                f"{operation}: storage did not answer by the call's deadline at",
                self._settings.checkpoint_root or Path("."),
                OSError(errno.ETIMEDOUT, "storage I/O still running at the deadline"),
            ) from None

    def _require_root(self, operation: str) -> Path:
        root = self._settings.checkpoint_root
        if root is None:
            raise ProtocolError(
                ErrorCode.STORAGE_FAILED,
                f"{operation} needs a checkpoint root; ROLLOUT_CHECKPOINT_ROOT is not set",
            )
        return root

    def _create_directory_ahead(self, checkpoint_id: str) -> None:
        """Create this instance's checkpoint directory in the background once prepared.

        Its directory fsyncs (and the symlink-resolving path check, a dozen syscalls) then run
        in a worker thread while the later stages park, instead of inside the prepare reply or
        the commit, where every episode of the set waits for them. Failures are left for the
        commit to meet again and report.
        """
        root = self._settings.checkpoint_root
        if root is None or self._background is None:
            return
        if self._directory is not None and self._directory.checkpoint_id == checkpoint_id:
            return
        ahead = _AheadDirectory(checkpoint_id, anyio.Event())
        self._directory = ahead
        set_name, instance = self._settings.storage_dir, self._settings.instance

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

        self._background.start_soon(create)

    async def _commit_directory(self, root: Path, checkpoint_id: str) -> Path:
        """The directory this commit writes to, made ahead where the prepare could."""
        ahead = self._directory
        if ahead is not None and ahead.checkpoint_id == checkpoint_id:
            await ahead.done.wait()
            if ahead.path is not None:
                return ahead.path
        return _directory(root, self._settings.storage_dir, checkpoint_id, self._settings.instance)

    def _closed(self, committed: bool) -> None:
        """The open checkpoint closed (resume or lease lapse): collect garbage again, and forget
        the directory made ahead, removing it when nothing was committed into it."""
        self._collector.release()
        ahead, self._directory = self._directory, None
        if ahead is None or committed or self._background is None:
            return

        async def remove() -> None:
            await ahead.done.wait()
            path = ahead.path
            if path is not None:
                await anyio.to_thread.run_sync(
                    lambda: storage.remove_empty_dirs(path, below=path.parent.parent)
                )

        self._background.start_soon(remove)

    async def _park(self, checkpoint_id: str, deadline_ts: float) -> ParkState:
        budget = max(0.0, deadline_ts - self._clock()) + _PARK_OVERRUN_SECONDS
        state: ParkState | None = None
        try:
            with anyio.fail_after(budget), anyio.CancelScope() as interruptible:
                self._parking = (checkpoint_id, interruptible)
                state = await self._participant.park(deadline_ts)
        except TimeoutError:
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"participant did not report its park state within {_PARK_OVERRUN_SECONDS}s "
                "after the deadline",
            ) from None
        except ProtocolError:
            raise
        except Exception as error:
            logger.exception("%s: park failed", self._settings.instance)
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
        try:
            return list(self._participant.export_encoded(scope))
        except PydanticSerializationError as error:
            # a record whose data is not JSON: a bug in the participant, not in storage
            logger.exception("%s: records not serialisable", self._settings.instance)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"records are not serialisable: {error}"
            ) from error
        except Exception as error:
            logger.exception("%s: export failed", self._settings.instance)
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
                self._settings.instance,
                len(records) - len(kept),
            )
        return kept

    async def _verified_records(self, request: RestoreRequest) -> list[Record]:
        """Read, verify and filter the records; raises before anything is installed."""
        root = self._require_root("restore")
        source = request.source_instance or self._settings.instance
        if not source.startswith(f"{self._settings.role.value}-"):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"source_instance {source!r} is not a {self._settings.role.value} instance",
            )
        directory = _directory(root, self._settings.storage_dir, request.checkpoint_id, source)
        try:
            with self._storage_deadline("restore", request.deadline_ts):
                manifest, records = await _storage_io(
                    lambda: storage.read_records(
                        directory, expect_checkpoint_id=request.checkpoint_id
                    )
                )
        except storage.RecordsInvalid as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, str(error)) from error
        except storage.StorageError as error:
            raise ProtocolError(ErrorCode.STORAGE_FAILED, str(error)) from error
        if manifest.role is not self._settings.role:
            raise ProtocolError(
                ErrorCode.RECORDS_INVALID,
                f"records in {directory} belong to role {manifest.role.value}, "
                f"not {self._settings.role.value}",
            )
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
            self._participant.validate(records)
        except ValueError as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, f"records refused: {error}") from error
        return records

    def _refuse_reused_operation(
        self, operation_id: str, cached: RetireReply | ForgetReply | None
    ) -> None:
        if cached is not None:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"operation_id {operation_id!r} was already used for another operation",
            )

    async def _call(self, what: str, call: Awaitable[None]) -> None:
        try:
            await call
        except Exception as error:
            logger.exception("%s: %s failed", self._settings.instance, what)
            raise ProtocolError(
                ErrorCode.INTERNAL, f"{what} failed: {type(error).__name__}: {error}"
            ) from error

    async def _watchdog(self) -> None:
        """Resume by ourselves when a lease lapses, so a dead coordinator never freezes work."""
        while True:
            changed = self._lease_changed = anyio.Event()
            expires = self._machine.lease_expires_ts
            if expires is None or self._machine.phase is Phase.IDLE:
                await changed.wait()
                continue
            with anyio.move_on_after(max(0.0, expires - self._clock())):
                await changed.wait()
            if changed.is_set():
                continue
            with anyio.CancelScope(shield=True):
                await self._expire()

    async def _expire(self) -> None:
        async with self._lock:
            phase = self._machine.phase
            abandoned = self._machine.expire(self._clock())
            if abandoned is None:
                return
            logger.warning(
                "%s: lease of checkpoint %s lapsed in phase %s; resuming by ourselves "
                "(the coordinator stopped renewing)",
                self._settings.instance,
                abandoned,
                phase.value,
            )
            try:
                await self._participant.reopen()
            except Exception:
                logger.exception("%s: reopen after lease lapse failed", self._settings.instance)
            finally:
                self._closed(committed=phase is Phase.COMMITTED)  # after the reopen, as in resume

    def _handlers(self) -> dict[str, Callable[[Any], Awaitable[BaseModel]]]:
        """The operation behind each route of `ROUTES`, by route name."""

        async def status(_: None) -> StatusReply:
            return self.status()

        return {
            STATUS.name: status,
            PREPARE.name: self.prepare,
            RENEW.name: self.renew,
            COMMIT.name: self.commit,
            RESTORE.name: self.restore,
            RESUME.name: self.resume,
            RETIRE.name: self.retire,
            FORGET.name: self.forget,
            REMOVE.name: self.remove,
        }

    def _build_router(self) -> APIRouter:
        """One endpoint per route of the table and mounted dialect; bodies are parsed strictly
        after the token. Both dialects call the same handlers."""
        router = APIRouter()
        handlers = self._handlers()
        for dialect in self._settings.dialects:
            for route in ROUTES:
                path = route.path_in(dialect)
                if path is None:
                    continue
                handler = handlers[route.name]
                if dialect is Dialect.ROLLOUT:
                    endpoint = self._endpoint(route, handler)
                    reply_model: type[BaseModel] = route.reply
                    responses = route.error_statuses()
                    body_schema = _request_body_schema(route.request)
                else:
                    codec = gym.codec(route)
                    endpoint = self._gym_endpoint(codec, handler)
                    reply_model = codec.reply
                    responses = gym.error_responses(route.errors)
                    body_schema = _request_body_schema(codec.request)
                router.add_api_route(
                    path,
                    endpoint,
                    methods=[route.method],
                    response_model=reply_model,
                    responses=responses,
                    summary=route.summary,
                    name=route.name if dialect is Dialect.ROLLOUT else f"gym-{route.name}",
                    openapi_extra=body_schema,
                )
        if Dialect.GYM in self._settings.dialects:
            router.add_api_route(
                GYM_CAPABILITIES_PATH,
                self._capabilities_endpoint(),
                methods=["GET"],
                response_model=gym.GymCapabilities,
                summary="What this participant takes part in, and in which dialects.",
                name="gym-capabilities",
            )
        return router

    def _endpoint(
        self, route: Route[Any, Any], handler: Callable[[Any], Awaitable[BaseModel]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            self._authorize(request.headers.get("authorization"))
            body = None if route.request is None else await _body(request, route.request)
            deadline_ts = getattr(body, "deadline_ts", None)
            if deadline_ts is not None:
                self._refuse_far(deadline_ts)
            with tracing.server_span(
                route.name,
                request.headers,
                attributes={"rollout.instance": self._settings.instance},
            ):
                return _reply(await handler(body))

        return endpoint

    def _gym_endpoint(
        self, codec: gym.GymCodec, handler: Callable[[Any], Awaitable[BaseModel]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """The Gym form of a route: Gym's body mapped to ours, the same handler, our reply
        mapped to Gym's; every refusal answered with Gym's error body and code."""
        side = gym.ServerSide(
            instance=self._settings.instance,
            storage_dir=self._settings.storage_dir,
            checkpoint_root=None
            if self._settings.checkpoint_root is None
            else str(self._settings.checkpoint_root),
            dialects=tuple(dialect.value for dialect in self._settings.dialects),
        )

        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request.headers.get("authorization"))
                body = None if codec.request is None else await _body(request, codec.request)
                deadline_ts = getattr(body, "deadline_ts", None)
                if deadline_ts is not None:
                    self._refuse_far(deadline_ts)
                try:
                    ours = codec.to_ours_request(body, side)
                except gym.Unmappable as error:
                    raise ProtocolError(error.code, str(error)) from None
                return _reply(codec.to_gym_reply(await handler(ours), ours, side))
            except ProtocolError as error:
                return _gym_error_response(error)

        return endpoint

    def _capabilities_endpoint(self) -> Callable[[Request], Awaitable[Response]]:
        capabilities = gym.GymCapabilities(
            checkpoint=True,
            operations=[route.name for route in ROUTES if route.in_gym],
            lease_grace_seconds=self._settings.lease_grace_seconds,
            dialects=[dialect.value for dialect in self._settings.dialects],
        )

        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request.headers.get("authorization"))
            except ProtocolError as error:
                return _gym_error_response(error)
            return _reply(capabilities)

        return endpoint

    def _refuse_far(self, deadline_ts: float) -> None:
        """A deadline beyond the horizon would open a lease that, in practice, never lapses."""
        horizon = self._settings.max_deadline_seconds
        if deadline_ts > self._clock() + horizon:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"deadline_ts: {deadline_ts:.6g} is more than {horizon:g}s ahead "
                "(ROLLOUT_MAX_DEADLINE_SECONDS); send a nearer deadline and renew",
            )

    def _authorize(self, header: str | None) -> None:
        expected = self._settings.token
        if expected is None:
            return
        if header is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing Authorization: Bearer <token>")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), expected.encode()
        ):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "wrong control token")


async def _storage_io(call: Callable[[], _T]) -> _T:
    """Run blocking storage I/O in a worker thread that a deadline can abandon."""
    return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)


def _directory(root: Path, set_name: str, checkpoint_id: str, instance: str) -> Path:
    try:
        return storage.checkpoint_dir(root, set_name, checkpoint_id, instance)
    except storage.UnsafePath as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(error)) from error


def _remember_operation(
    memory: OrderedDict[str, RetireReply | ForgetReply],
    operation_id: str,
    reply: RetireReply | ForgetReply,
) -> None:
    memory[operation_id] = reply
    while len(memory) > _REMEMBERED:
        memory.popitem(last=False)


async def _body(request: Request, model: type[_Model]) -> _Model:
    """Parse the body strictly (no coercion of strings into numbers) with errors naming fields."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, describe_validation(error)) from None


def describe_validation(error: ValidationError | RequestValidationError) -> str:
    """`field: message` for each problem (at most five), so a client sees what to fix."""
    parts: list[str] = []
    for problem in error.errors()[:5]:
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        parts.append(f"{'.'.join(location) or 'body'}: {problem.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _request_body_schema(model: type[BaseModel] | None) -> dict[str, Any] | None:
    """The OpenAPI request body of a route (its endpoint reads the body itself, strictly)."""
    if model is None:
        return None
    schema = _inline_refs(model.model_json_schema())
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its `$defs` substituted, so it stands alone in OpenAPI."""
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(definitions[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


def _reply(model: BaseModel) -> Response:
    return Response(content=model.model_dump_json(), media_type="application/json")


def _gym_error_response(error: ProtocolError) -> Response:
    """A refusal in Gym's form (`_gym.gym_error`: Gym's codes and statuses, docs/protocol.md)."""
    status, body = gym.gym_error(error.code, error.detail)
    headers = {"WWW-Authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHORIZED else None
    return Response(
        content=json.dumps(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def _protocol_error_handler(request: Request, error: Exception) -> Response:
    if isinstance(error, BodyTooLarge):
        error = ProtocolError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"{error.detail} (ROLLOUT_MAX_BODY_BYTES)",
        )
    assert isinstance(error, ProtocolError)
    headers = {"WWW-Authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHORIZED else None
    return Response(
        content=error.body().model_dump_json(),
        status_code=error.status_code,
        media_type="application/json",
        headers=headers,
    )


async def _validation_error_handler(request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    return await _protocol_error_handler(
        request, ProtocolError(ErrorCode.INVALID_REQUEST, describe_validation(error))
    )


async def _http_error_handler(request: Request, error: Exception) -> Response:
    """Starlette's own refusals: a body it cannot decode (400) is the protocol's
    `invalid_request`, with its error body; the rest (404, 405, ...) stay as they are."""
    assert isinstance(error, HTTPException)
    if error.status_code == 400:
        return await _protocol_error_handler(
            request, ProtocolError(ErrorCode.INVALID_REQUEST, f"body: {error.detail}")
        )
    return await http_exception_handler(request, error)


# --- request bodies and the published document ----------------------------------------------


class BodyTooLarge(HTTPException):
    """Raised while a body is read past the limit; answered as `payload_too_large` (413).

    An `HTTPException` so that FastAPI's own body parsing lets it through unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")
        self.limit = limit


class BodyLimit:
    """ASGI middleware: no request body larger than `max_bytes` is read, on any route.

    A declared `Content-Length` over the limit is refused before the app runs, without reading
    a byte; a body sent without one (chunked) is counted as it is read and refused once it
    passes the limit, so at most `max_bytes` plus one chunk is ever held.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                error = ProtocolError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"Content-Length {int(value)} is over the limit of {limit} bytes "
                    "(ROLLOUT_MAX_BODY_BYTES)",
                )
                await _send_error(send, error)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


async def _send_error(send: Send, error: ProtocolError) -> None:
    body = error.body().model_dump_json().encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


SERVER_ROUTE_ERRORS = frozenset(ErrorCode)
"""What a participant's own POST route may answer: its own refusals, and any refusal of a peer
it calls on the caller's behalf, relayed with the peer's code (`unreachable` for a peer gone)."""


def declare_error_statuses(app: FastAPI) -> None:
    """Declare in the app's OpenAPI document the error statuses of its own routes.

    Every route may answer `payload_too_large` (the body limit) and `internal`; routes with a
    body or parameters `invalid_request` (422, with the protocol's error body rather than
    FastAPI's validation body); POST routes every status of `SERVER_ROUTE_ERRORS`. Statuses a
    route declares itself are kept. The control routes declare theirs from `ROUTES`.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        _declare_errors(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _declare_errors(document: dict[str, Any]) -> None:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    if "ErrorBody" not in components:
        schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components["ErrorBody"] = schema
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in document.get("paths", {}).items():
        if path.startswith((API_PREFIX, GYM_PREFIX)):
            continue
        for method, operation in operations.items():
            codes = {ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.INTERNAL}
            if operation.get("requestBody") or operation.get("parameters"):
                codes.add(ErrorCode.INVALID_REQUEST)
            if method == "post":
                codes |= SERVER_ROUTE_ERRORS
            responses = operation.setdefault("responses", {})
            validation = responses.get("422", {})
            if "HTTPValidationError" in json.dumps(validation):
                del responses["422"]  # answered with the protocol's error body instead
            for status, entry in error_responses(codes).items():
                responses.setdefault(
                    str(status), {"description": entry["description"], "content": error_body}
                )
