"""The conformance kit: checks the protocol rules every checkpoint participant must keep.

A server author runs it from their own tests against a running participant (a base URL and the
control token) or against their ASGI app in process. Each check is named by a rule id (`RULES`);
a broken rule raises `ConformanceError` (an `AssertionError`, so pytest shows it as a failure)
whose message names the rule, what was expected and what was observed.

Entry points (all async; run them on asyncio, e.g. `@pytest.mark.anyio` with the asyncio backend:
the participant client is aiohttp's):

* `check_participant(target, checkpoint_root=..., lease_grace_seconds=...)` runs every
  single-participant check in order: `auth.every-route`, `bodies.strict`, `phases.replay` and
  `phases.resume-idle`, `ids.stale`, `ids.conflicting`, `restore.all-or-nothing` (on the records
  the phases check committed) and `lease.auto-resume`. Each check is also a function of its own
  (`check_auth`, `check_strict_bodies`, `check_phases`, `check_stale_ids`,
  `check_conflicting_ids`, `check_lease_auto_resume`, `check_restore_all_or_nothing`).
  The participant must be idle, have a checkpoint root (`ROLLOUT_CHECKPOINT_ROOT`, the same
  directory as `checkpoint_root` here) and be dedicated to the kit: the phases check restores
  into it, which moves it to the next attempt.
* `check_crash_restore(driver, checkpoint_root=..., rollout_ids=..., model=...)` checks what
  keeps episodes exactly once across a crash: `steps.no-rerun`, `steps.indexed` and
  `steps.once-per-attempt` (with `restore.all-or-nothing` on the real records of running
  episodes), the `/run` duties (`run.attempt-mismatch`, `run.retired`, `run.repeat-live`,
  `run.repeat-one-episode`, `run.repeat-finished`), `model.headers`, `model.same-prompts` (with
  `model`, the kit's `FakeModel`) and `state.in-boundary`: start episodes, checkpoint them
  mid-way through the
  `Coordinator`, crash every participant, restart them under `attempt + 1`, refuse damaged
  copies of the checkpoint, restore it, finish the episodes, compare the step counters each
  participant serves at `GET /stats?rollout_id=...` (the shape of `StepCounters.snapshot`) and
  the results with uninterrupted runs of the same tasks. The `EpisodeDriver` protocol is what
  you implement: how to run an episode (raising `RunRefused` for a refused `/run`), hold it
  mid-way, crash and restart your processes. Against a participant of several managed workers
  (pass `rollout_ids_per_worker(n)`) it also checks `workers.restore-all` and
  `workers.repeat-run` in every worker.
* `check_park_all(driver, rollout_ids=...)` (`steps.wait-holds-prepare`; `workers.park-all`
  when a participant runs several workers; also named `check_workers_park_all`), through a
  `StepHoldingDriver`: an `EpisodeDriver` that can also hold an episode inside a step that
  cannot park. `check_workers(target, workers=n)` (`workers.managed`,
  `workers.private-channel`) for servers with several worker processes
  (`rollout_protocol.workers`).
* `FakeModel` (module `_fake_model`) is the model participant a driver serves beside the server
  under test: replies derived from the prompt only, every call counted and logged by the
  episode it names, calls held on request (how a driver keeps episodes mid-way). A hold armed
  after the crash is the driver's mistake, reported at once (`driver.holds`).
* `serve_app(app, role=..., token=...)` serves an ASGI app in process (its lifespan runs, so the
  lease watchdog does) on a loopback port and yields a `ServedApp` whose `target` the checks
  take; `start_app` does the same inside a task group you own, for drivers that crash and
  restart apps.

From a server author's pytest (docs/sdk.md has a complete one, with a driver):

    import pytest
    from rollout_protocol import ControlSettings, Role
    from rollout_protocol.conformance import Target, check_participant, serve_app

    @pytest.mark.anyio
    async def test_conformance(tmp_path):
        settings = ControlSettings(Role.ENVIRONMENT, checkpoint_root=tmp_path, token="t",
                                   lease_grace_seconds=0.5)
        async with serve_app(build_my_app(settings), role=Role.ENVIRONMENT, token="t") as served:
            await check_participant(served.target, checkpoint_root=tmp_path,
                                    lease_grace_seconds=0.5)

or, against a process: `Target("http://127.0.0.1:8080", Role.ENVIRONMENT, token="t")`. Start
the participant with a short `ROLLOUT_LEASE_GRACE_SECONDS` (one second) and pass the same value
as `lease_grace_seconds`: the lease check waits for the lapse (polling `/status` with a deadline).

Each `Target` names the control dialect the kit speaks to it (`dialect=`, ours by default, or
`Dialect.GYM` for a participant that mounts NeMo Gym's): every rule is checked through it.

Every failure is a `ConformanceError` naming the rule, who is at fault (the participant unless
it says the driver) and, where the kit knows, what to change. This module imports nothing beyond
the contract's own dependencies, uvicorn (which serves in-process apps) and aiohttp (the
coordinator's client): the `kit` extra; no pytest. `import rollout_protocol` does not import it.
"""

from __future__ import annotations

import hashlib
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import anyio
import anyio.to_thread
import httpx
import uvicorn
from anyio.abc import TaskGroup, TaskStatus
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _gym as gym
from . import _storage as storage
from ._client import HttpParticipantClient, ParticipantError, _default_session
from ._coordinator import CommitOutcome, Coordinator
from ._fake_model import FakeModel, ModelCall, echo_reply
from ._routes import GYM_CAPABILITIES_PATH, ROUTES, Dialect, Route
from ._wire import (
    CommitRequest,
    ErrorBody,
    ErrorCode,
    Manifest,
    MultiProcess,
    Phase,
    PrepareReply,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
    Role,
    StatusReply,
)
from ._workers import WORKER_PREFIX, owner

__all__ = [
    "AUTH",
    "BODIES",
    "CONFLICTING",
    "DRIVER_HOLDS",
    "LEASE",
    "MODEL_HEADERS",
    "MODEL_PROMPTS",
    "PHASES_REPLAY",
    "PHASES_RESUME",
    "RESTORE",
    "RULES",
    "RUN_ATTEMPT",
    "RUN_FINISHED",
    "RUN_LIVE",
    "RUN_ONE",
    "RUN_RETIRED",
    "STALE",
    "STATE",
    "STEPS",
    "STEPS_INDEXED",
    "STEPS_ONCE",
    "STEPS_WAIT",
    "UNINTERRUPTED_SUFFIX",
    "WORKERS_MANAGED",
    "WORKERS_PARK",
    "WORKERS_PRIVATE",
    "WORKERS_REPEAT",
    "WORKERS_RESTORE",
    "WORKERS_SPREAD",
    "ConformanceError",
    "EpisodeDriver",
    "FakeModel",
    "ModelCall",
    "RunRefused",
    "ServedApp",
    "StepHoldingDriver",
    "Target",
    "base_rollout_id",
    "check_auth",
    "check_conflicting_ids",
    "check_crash_restore",
    "check_lease_auto_resume",
    "check_park_all",
    "check_participant",
    "check_phases",
    "check_restore_all_or_nothing",
    "check_stale_ids",
    "check_strict_bodies",
    "check_workers",
    "check_workers_park_all",
    "echo_reply",
    "rollout_ids_per_worker",
    "serve_app",
    "start_app",
]

# --- rules ------------------------------------------------------------------------------------

PHASES_REPLAY = "phases.replay"
PHASES_RESUME = "phases.resume-idle"
STALE = "ids.stale"
CONFLICTING = "ids.conflicting"
LEASE = "lease.auto-resume"
AUTH = "auth.every-route"
BODIES = "bodies.strict"
RESTORE = "restore.all-or-nothing"
STEPS = "steps.no-rerun"
STEPS_INDEXED = "steps.indexed"
STEPS_RESTARTED = "steps.restarted"
STEPS_ONCE = "steps.once-per-attempt"
STEPS_WAIT = "steps.wait-holds-prepare"
RUN_ATTEMPT = "run.attempt-mismatch"
RUN_RETIRED = "run.retired"
RUN_LIVE = "run.repeat-live"
RUN_FINISHED = "run.repeat-finished"
RUN_ONE = "run.repeat-one-episode"
MODEL_HEADERS = "model.headers"
MODEL_PROMPTS = "model.same-prompts"
STATE = "state.in-boundary"
WORKERS_MANAGED = "workers.managed"
WORKERS_PRIVATE = "workers.private-channel"
WORKERS_SPREAD = "workers.spread"
WORKERS_PARK = "workers.park-all"
WORKERS_RESTORE = "workers.restore-all"
WORKERS_REPEAT = "workers.repeat-run"
DRIVER_HOLDS = "driver.holds"

RULES: Mapping[str, str] = {
    PHASES_REPLAY: "prepare -> prepared -> commit -> committed; a retried prepare, commit or "
    "restore of the same checkpoint id answers the first reply again",
    PHASES_RESUME: "resume returns to idle from every phase and closes the checkpoint",
    STALE: "a resumed (or lapsed, or aborted before its prepare) checkpoint id is refused with "
    "stale_checkpoint; so is a restore of (id, attempt) already restored and resumed",
    CONFLICTING: "while one checkpoint is open, another id is refused with "
    "conflicting_checkpoint and the open one is left as it was",
    LEASE: "after a prepare and no further calls the participant resumes by itself once "
    "deadline_ts + lease grace has passed, not before, and the id is stale afterwards",
    AUTH: "every route of ROUTES answers 401 (code unauthorized) without the token or with a "
    "wrong one, before its body is read or validated",
    BODIES: "request bodies are strict: an unknown field, a wrong type or a string for a number "
    "is a 422 (code invalid_request) whose detail names the field",
    RESTORE: "a restore from damaged records (a flipped byte, a wrong record count) is refused "
    "with records_invalid, installs nothing, and leaves the participant idle and usable",
    STEPS: "across a checkpoint, a crash and a restore under attempt + 1, no step completed "
    "before the checkpoint starts again, and every episode finishes",
    STEPS_INDEXED: "a step name is unique within its episode (name@index, e.g. ask@3): a step "
    "without @index that completed once before the checkpoint and runs again after the restore "
    "cannot be told from the next turn's step, and is refused as ambiguous",
    STEPS_RESTARTED: "with check_crash_restore(..., restarting=True): every episode is listed "
    "as a restart at prepare, none captured, and after the restore each is played again from "
    "its start (its steps completed before the checkpoint complete again under attempt + 1)",
    RUN_ATTEMPT: "/run under an attempt this participant does not run is refused with 409 "
    "attempt_mismatch and starts nothing",
    RUN_RETIRED: "/run of a retired (attempt, rollout) is refused with 410 attempt_retired, even "
    "when the episode had finished",
    RUN_LIVE: "a repeated /run of a live episode attaches to it (waits for its result); it is "
    "neither refused nor answered before the episode ends",
    RUN_FINISHED: "a repeated /run of a finished episode answers its result again and runs no step",
    RUN_ONE: "a repeated /run of a live episode never starts a second episode: while the first "
    "one is held, no step of that rollout starts or completes again (read from the step "
    "counters at GET /stats)",
    STEPS_ONCE: "no indexed step (name@index) completes twice under one attempt, in any "
    "participant's step counters: a second completion is a step run again (a retry around a "
    "completed step, a second episode of the rollout)",
    STEPS_WAIT: "an episode inside a step that cannot park (StepMode.WAIT: a side effect, a tool "
    "that writes) holds the prepare: not ready, that episode named among its blockers; once "
    "the step ends the prepare is ready (a side-effect step run as StepMode.REPLAY fails this)",
    MODEL_HEADERS: "calls to the set's model carry X-Rollout-Request: <rollout_id>/<key> and "
    "X-Rollout-Attempt: <attempt>, so the model records them and continues them after a restore",
    MODEL_PROMPTS: "the model calls of an episode continued after a crash and restore carry the "
    "same prompts as an uninterrupted run's calls of the same key (everything a prompt is "
    "built from lives in the episode's boundaries); checked with the kit's FakeModel",
    STATE: "everything an episode needs lives in its boundaries: an episode continued after a "
    "crash and restore ends with the result of an uninterrupted run of the same task",
    WORKERS_MANAGED: "a server with several worker processes is one participant whose control "
    "plane coordinates them all (status multi_process: managed), never unmanaged (the operator "
    "refuses to checkpoint that)",
    WORKERS_PRIVATE: "a server with several managed workers answers no request from outside "
    "the pod on its workers' private channel (/_worker/v1/*): without a token and with the "
    "control token alike it is refused with a 4xx, in every worker",
    WORKERS_SPREAD: "the crash and restore checks reach every worker of a multi-worker "
    "participant: its rollout ids cover every worker (rollout_protocol.workers.owner), so "
    "parking, restoring and repeated /run are checked in each one",
    WORKERS_PARK: "with several workers, an episode parked in one worker while another worker's "
    "episode is inside a step that cannot park leaves the pod's prepare not ready (that episode "
    "its blocker); once the step ends, every worker parks and the prepare is ready",
    WORKERS_RESTORE: "with several workers, a restore reaches every worker: each installs the "
    "restored episodes it holds (the pod installs every record it committed) and each episode "
    "continues from its records, running no step completed before the checkpoint",
    WORKERS_REPEAT: "with several workers, a repeated /run of an episode held by any worker "
    "reaches that worker: it attaches to the live episode, or answers the finished result "
    "and runs no step, never starting it again elsewhere",
    DRIVER_HOLDS: "the kit's driver (your test, not the server) holds model calls of the first "
    "attempt only: a hold armed after the crash would block a restored episode or an "
    "uninterrupted twin forever",
}
"""Every rule id the kit checks, with the rule in one sentence."""


PARTICIPANT = "the participant"
DRIVER = "the driver (your EpisodeDriver, not the server)"
DRIVER_MISTAKE = "the kit's driver: your test's mistake, not the server's"


class ConformanceError(AssertionError):
    """A rule broke: `rule` (a key of `RULES`), what was `expected`, what was `observed`, who is
    at `fault` (the participant under test unless said otherwise) and, where the kit knows, what
    to change (`fix`)."""

    def __init__(
        self,
        rule: str,
        expected: str,
        observed: str,
        *,
        fault: str = PARTICIPANT,
        fix: str | None = None,
    ) -> None:
        message = f"[{rule}] {expected}; observed: {observed}"
        if fault != PARTICIPANT or fix is not None:
            message += f" -- at fault: {fault}"
        if fix is not None:
            message += f"; to fix: {fix}"
        super().__init__(message)
        self.rule = rule
        self.expected = expected
        self.observed = observed
        self.fault = fault
        self.fix = fix


class RunRefused(Exception):
    """What an `EpisodeDriver.run_episode` raises when the server refused its `/run`: the HTTP
    status and the protocol's error code (empty when the reply had no `ErrorBody`).

    `RunRefused.reply(response)` turns an httpx response into the result (its JSON, on 2xx) or
    this error, so a driver's `run_episode` can end with `return RunRefused.reply(reply)`.
    """

    def __init__(self, status_code: int, code: str, detail: str) -> None:
        super().__init__(f"HTTP {status_code} {code or '(no error body)'}: {detail}")
        self.status_code = status_code
        self.code = code
        self.detail = detail

    @staticmethod
    def reply(response: httpx.Response) -> Any:
        """The JSON of a 2xx response; a `RunRefused` for any other."""
        if 200 <= response.status_code < 300:
            return response.json()
        body = _error_body(response)
        if body is None:
            raise RunRefused(response.status_code, "", response.text[:300])
        raise RunRefused(response.status_code, body.error.code.value, body.error.detail)


UNINTERRUPTED_SUFFIX = "-uninterrupted"
"""`check_crash_restore` runs `<rollout_id><suffix>` uninterrupted under attempt + 1 and compares
its result with the restored `<rollout_id>`'s (`state.in-boundary`): a driver gives both the same
task (pick the task by `base_rollout_id(rollout_id)`)."""


def base_rollout_id(rollout_id: str) -> str:
    """The rollout id whose task `rollout_id` runs: itself, or the restored episode an
    uninterrupted twin (`UNINTERRUPTED_SUFFIX`) is compared with."""
    return rollout_id.removesuffix(UNINTERRUPTED_SUFFIX)


# --- targets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One participant the kit talks to: its base URL, role, control token and counter path.

    `client` (optional) is the `httpx.AsyncClient` the kit sends its own raw requests with
    (refusals, counters); `session` (optional) the `aiohttp.ClientSession` its
    `HttpParticipantClient` sends the protocol's calls with. The kit makes what it is not given,
    and never closes a client or session it was given. `dialect` is the wire dialect the kit
    speaks to the participant (ours, or NeMo Gym's for a participant that mounts it): every
    rule is checked through it, the raw refusals on that dialect's paths and error bodies.
    """

    base_url: str
    role: Role
    token: str
    index: int = 0
    client: httpx.AsyncClient | None = None
    stats_path: str = "/stats"
    session: aiohttp.ClientSession | None = None
    dialect: Dialect = Dialect.ROLLOUT

    @property
    def name(self) -> str:
        return f"{Role(self.role).value}-{self.index}"


@dataclass
class _Conn:
    """A target with an open HTTP client for raw requests and the contract's client."""

    target: Target
    http: httpx.AsyncClient
    participant: HttpParticipantClient
    call_timeout_s: float

    def deadline(self, seconds: float | None = None) -> float:
        return time.time() + (self.call_timeout_s if seconds is None else seconds)

    def url(self, path: str) -> str:
        return self.target.base_url.rstrip("/") + path

    async def status(self, rule: str) -> StatusReply:
        return await _ok(rule, "GET /status", self.participant.status(self.deadline()))


@asynccontextmanager
async def _connect(targets: Sequence[Target], call_timeout_s: float) -> AsyncIterator[list[_Conn]]:
    async with AsyncExitStack() as stack:
        conns: list[_Conn] = []
        shared: aiohttp.ClientSession | None = None  # for every target without a session
        for target in targets:
            http = target.client
            if http is None:
                http = await stack.enter_async_context(httpx.AsyncClient())
            session = target.session
            if session is None:
                if shared is None:
                    shared = await stack.enter_async_context(_default_session())
                session = shared
            participant = HttpParticipantClient(
                target.role,
                target.base_url,
                index=target.index,
                token=target.token,
                client=session,
                dialect=target.dialect,
            )
            conns.append(_Conn(target, http, participant, call_timeout_s))
        yield conns


_T = TypeVar("_T")


async def _ok(rule: str, what: str, call: Awaitable[_T]) -> _T:
    try:
        return await call
    except ParticipantError as error:
        raise ConformanceError(
            rule,
            f"{what} must succeed",
            f"{error.code.value} (HTTP {error.status_code}): {error.detail}",
        ) from error


async def _refused(rule: str, what: str, call: Awaitable[BaseModel], code: ErrorCode) -> None:
    try:
        reply = await call
    except ParticipantError as error:
        if error.code is not code:
            raise ConformanceError(
                rule,
                f"{what} must be refused with {code.value}",
                f"{error.code.value} (HTTP {error.status_code}): {error.detail}",
            ) from error
        return
    raise ConformanceError(
        rule, f"{what} must be refused with {code.value}", f"success: {reply.model_dump_json()}"
    )


def _expect(rule: str, condition: bool, expected: str, observed: object) -> None:
    if not condition:
        raise ConformanceError(rule, expected, str(observed))


def _new_id(label: str) -> str:
    return f"kit-{label}-{uuid.uuid4().hex[:10]}"


async def _expect_idle(conn: _Conn, rule: str, when: str) -> StatusReply:
    status = await conn.status(rule)
    _expect(
        rule,
        status.phase is Phase.IDLE and status.checkpoint_id is None,
        f"{conn.target.name} must be idle with no open checkpoint {when}",
        f"phase {status.phase.value}, checkpoint {status.checkpoint_id!r}",
    )
    return status


async def _resume(conn: _Conn, rule: str, checkpoint_id: str) -> None:
    reply = await _ok(
        rule,
        f"resume of {checkpoint_id}",
        conn.participant.resume(
            ResumeRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
    )
    _expect(
        rule,
        reply.phase is Phase.IDLE,
        f"resume of {checkpoint_id} must answer phase idle",
        reply.phase.value,
    )


async def _prepared(conn: _Conn, rule: str, checkpoint_id: str, deadline_ts: float) -> PrepareReply:
    reply = await _ok(
        rule,
        f"prepare of {checkpoint_id}",
        conn.participant.prepare(
            PrepareRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        ),
    )
    _expect(
        rule,
        reply.ready and reply.phase is Phase.PREPARED,
        f"prepare of {checkpoint_id} on an idle participant must be ready (phase prepared)",
        f"ready={reply.ready}, phase {reply.phase.value}, {reply.blocker_count} blockers",
    )
    return reply


# --- auth and bodies --------------------------------------------------------------------------

_PAST_DEADLINE = 1.0
"""A valid `deadline_ts` that has passed: a body that gets through is refused without effect."""

_EXAMPLE_VALUES: Mapping[str, Any] = {
    "deadline_ts": _PAST_DEADLINE,
    "attempt": 0,
    "rollout_ids": ["kit-rollout"],
    "episode_ids": [{"rollout_id": "kit-rollout", "attempt": 0}],
}
_ID_FIELDS = ("checkpoint_id", "operation_id")
_GYM_ID_FIELDS = ("checkpoint_dir",)
"""Gym fields that name the checkpoint (the directory, relative to the set)."""
_UNKNOWN_FIELD = "kit_unknown_field"


def _request_model(route: Route[Any, Any], dialect: Dialect) -> type[BaseModel] | None:
    """The request body model of `route` in `dialect`."""
    return route.request if dialect is Dialect.ROLLOUT else gym.codec(route).request


def _dialect_routes(dialect: Dialect) -> list[Route[Any, Any]]:
    """The routes of the table that `dialect` has."""
    return [route for route in ROUTES if route.path_in(dialect) is not None]


def _example_body(
    route: Route[Any, Any], ident: str, dialect: Dialect = Dialect.ROLLOUT
) -> dict[str, Any]:
    """A well-formed request body for `route` (in `dialect`) whose deadline has passed."""
    model = _request_model(route, dialect)
    assert model is not None
    body: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if name in _GYM_ID_FIELDS or name in _ID_FIELDS:
            body[name] = ident
        elif name == "checkpoint_ids":
            body[name] = [ident]
        elif name in _EXAMPLE_VALUES:
            body[name] = _EXAMPLE_VALUES[name]
        elif info.is_required():
            raise RuntimeError(f"the kit has no example value for {model.__name__}.{name}")
    model.model_validate(body, strict=True)
    return body


def _describe(response: httpx.Response) -> str:
    return f"HTTP {response.status_code} {response.text[:300]}"


def _error_body(response: httpx.Response) -> ErrorBody | None:
    try:
        return ErrorBody.model_validate_json(response.content)
    except ValidationError:
        return None


def _refusal(response: httpx.Response, dialect: Dialect) -> tuple[str, str] | None:
    """The error code (as the dialect names it) and detail of a refusal; None without a body."""
    if dialect is Dialect.ROLLOUT:
        body = _error_body(response)
        return None if body is None else (body.error.code.value, body.error.detail)
    try:
        gym_body = gym.GymErrorBody.model_validate_json(response.content)
    except ValidationError:
        try:  # FastAPI's 422, Gym's answer to a body its models refuse
            validation = gym.GymValidationBody.model_validate_json(response.content)
        except ValidationError:
            return None
        return ErrorCode.INVALID_REQUEST.value, "; ".join(item.msg for item in validation.detail)
    return gym_body.error.code, gym_body.error.detail


async def _expect_refusal(
    conn: _Conn,
    rule: str,
    route: Route[Any, Any],
    what: str,
    *,
    headers: Mapping[str, str],
    content: bytes | None,
    status: int,
    code: ErrorCode,
    naming: str | None = None,
) -> None:
    """Send a raw request through `route` (in the target's dialect); it must be refused with
    `status` and `code` (as the dialect says them: `_gym.gym_error` for Gym's)."""
    dialect = conn.target.dialect
    path = route.path_in(dialect)
    assert path is not None
    if dialect is Dialect.GYM:
        status, gym_body = gym.gym_error(code, "")
        name = gym_body["error"]["code"] if "error" in gym_body else ErrorCode.INVALID_REQUEST.value
    else:
        name = code.value
    if content is not None:
        headers = {**headers, "Content-Type": "application/json"}
    response = await conn.http.request(
        route.method,
        conn.url(path),
        headers=headers,
        content=content,
        timeout=conn.call_timeout_s,
    )
    error = _refusal(response, dialect)
    named = "" if naming is None else f" naming {naming!r}"
    _expect(
        rule,
        response.status_code == status
        and error is not None
        and error[0] == name
        and (naming is None or naming in error[1]),
        f"{route.method} {path} {what} must answer {status} {name}{named}",
        _describe(response),
    )


async def check_auth(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`auth.every-route`: every route of `ROUTES` refuses a missing or wrong token with 401.

    Without a token the body is not even JSON, with a wrong token it is well-formed (with a
    passed deadline, so a route that lets it through does nothing): both must be 401 with code
    `unauthorized`, proving the token is checked before the body is read or validated.
    """
    async with _connect([target], call_timeout_s) as (conn,):
        await conn.status(AUTH)  # the right token works: the base URL and token are right
        wrong = {"Authorization": f"Bearer wrong-{target.token}"}
        dialect = target.dialect
        for route in _dialect_routes(dialect):
            has_body = _request_model(route, dialect) is not None
            well_formed = (
                json.dumps(_example_body(route, _new_id("auth"), dialect)).encode()
                if has_body
                else None
            )
            for what, headers, content in (
                (
                    "without a token (before reading its body)",
                    {},
                    b"{not json" if has_body else None,
                ),
                ("with a wrong token", wrong, well_formed),
            ):
                await _expect_refusal(
                    conn,
                    AUTH,
                    route,
                    what,
                    headers=headers,
                    content=content,
                    status=401,
                    code=ErrorCode.UNAUTHORIZED,
                )
        if dialect is Dialect.GYM:
            # Gym's capabilities say what the participant takes part in: behind the token too
            url = conn.url(GYM_CAPABILITIES_PATH)
            for what, headers in (("without a token", {}), ("with a wrong token", wrong)):
                response = await conn.http.get(url, headers=headers, timeout=call_timeout_s)
                refusal = _refusal(response, dialect)
                _expect(
                    AUTH,
                    response.status_code == 401
                    and refusal is not None
                    and refusal[0] == ErrorCode.UNAUTHORIZED.value,
                    f"GET {GYM_CAPABILITIES_PATH} {what} must answer 401 unauthorized",
                    _describe(response),
                )


async def check_strict_bodies(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`bodies.strict`: every route with a body refuses an unknown field, a wrong type and a
    string for a number with 422 `invalid_request`, naming the field."""
    async with _connect([target], call_timeout_s) as (conn,):
        headers = {"Authorization": f"Bearer {target.token}"}
        dialect = target.dialect
        for route in _dialect_routes(dialect):
            if _request_model(route, dialect) is None:
                continue
            body = _example_body(route, _new_id("body"), dialect)
            id_field = next(name for name in (*_ID_FIELDS, "checkpoint_ids") if name in body)
            cases = [
                ("an unknown field", _UNKNOWN_FIELD, {**body, _UNKNOWN_FIELD: 1}),
                ("a number for a string", id_field, {**body, id_field: 12345}),
                ("a string for a number", "deadline_ts", {**body, "deadline_ts": "1.0"}),
            ]
            for what, name, bad in cases:
                await _expect_refusal(
                    conn,
                    BODIES,
                    route,
                    f"with {what} ({name})",
                    headers=headers,
                    content=json.dumps(bad).encode(),
                    status=422,
                    code=ErrorCode.INVALID_REQUEST,
                    naming=name,
                )


# --- phases and ids ---------------------------------------------------------------------------


async def check_phases(target: Target, *, call_timeout_s: float = 10.0) -> tuple[str, int]:
    """`phases.replay`, `phases.resume-idle` (and the restore half of `ids.stale`).

    prepare -> prepared, a retried prepare is replayed; renew keeps the phase; commit ->
    committed, a retried commit and a late prepare are replayed; resume -> idle. Then the
    committed checkpoint is restored under the next attempt (replayed on retry), resumed, and a
    restore of the same (id, attempt) is stale. Returns (checkpoint id, attempt it captured).
    """
    async with _connect([target], call_timeout_s) as (conn,):
        p = conn.participant
        before = await _expect_idle(conn, PHASES_REPLAY, "before the check")
        cid = _new_id("phases")
        first = await _prepared(conn, PHASES_REPLAY, cid, conn.deadline())
        await _phase_is(conn, PHASES_REPLAY, Phase.PREPARED, cid, "after a ready prepare")
        await _replayed(
            f"a retried prepare of {cid}",
            p.prepare(PrepareRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
            first,
        )
        renewed = await _ok(
            PHASES_REPLAY,
            f"renew of {cid}",
            p.renew(RenewRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
        )
        _expect(
            PHASES_REPLAY,
            renewed.phase is Phase.PREPARED,
            f"renew of {cid} must keep phase prepared",
            renewed.phase.value,
        )
        commit = CommitRequest(checkpoint_id=cid, deadline_ts=conn.deadline())
        committed = await _ok(PHASES_REPLAY, f"commit of {cid}", p.commit(commit))
        _expect(
            PHASES_REPLAY,
            committed.phase is Phase.COMMITTED,
            f"commit of {cid} must answer phase committed",
            committed.phase.value,
        )
        await _phase_is(conn, PHASES_REPLAY, Phase.COMMITTED, cid, "after a commit")
        await _replayed(
            f"a retried commit of {cid}",
            p.commit(CommitRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
            committed,
        )
        await _replayed(
            f"a late retried prepare of {cid} (after its commit)",
            p.prepare(PrepareRequest(checkpoint_id=cid, deadline_ts=conn.deadline())),
            first,
        )
        await _resume(conn, PHASES_RESUME, cid)
        await _expect_idle(conn, PHASES_RESUME, f"after the resume of committed {cid}")

        attempt = max(before.attempt, committed.manifest.attempt) + 1
        # the rollouts the commit listed (a Gym participant's restore names them; ours: None)
        named = committed.rollout_ids
        restore = RestoreRequest(
            checkpoint_id=cid, attempt=attempt, rollout_ids=named, deadline_ts=conn.deadline()
        )
        restored = await _ok(
            PHASES_REPLAY, f"restore of {cid} under attempt {attempt}", p.restore(restore)
        )
        _expect(
            PHASES_REPLAY,
            restored.phase is Phase.RESTORED
            and restored.record_count == committed.manifest.record_count,
            f"restore of {cid} must answer phase restored with the "
            f"{committed.manifest.record_count} committed records",
            f"phase {restored.phase.value}, {restored.record_count} records",
        )
        await _phase_is(conn, PHASES_REPLAY, Phase.RESTORED, cid, "after a restore")
        await _replayed(
            f"a retried restore of {cid}",
            p.restore(
                RestoreRequest(
                    checkpoint_id=cid,
                    attempt=attempt,
                    rollout_ids=named,
                    deadline_ts=conn.deadline(),
                )
            ),
            restored,
        )
        await _resume(conn, PHASES_RESUME, cid)
        await _expect_idle(conn, PHASES_RESUME, f"after the resume of restored {cid}")
        await _refused(
            STALE,
            f"a restore of {cid} under attempt {attempt} after it was restored and resumed",
            p.restore(
                RestoreRequest(
                    checkpoint_id=cid,
                    attempt=attempt,
                    rollout_ids=named,
                    deadline_ts=conn.deadline(),
                )
            ),
            ErrorCode.STALE_CHECKPOINT,
        )
        return cid, committed.manifest.attempt


async def _phase_is(conn: _Conn, rule: str, phase: Phase, cid: str, when: str) -> None:
    status = await conn.status(rule)
    _expect(
        rule,
        status.phase is phase and status.checkpoint_id == cid,
        f"/status must show phase {phase.value} of {cid} {when}",
        f"phase {status.phase.value}, checkpoint {status.checkpoint_id!r}",
    )


async def _replayed(what: str, call: Awaitable[BaseModel], first: BaseModel) -> None:
    again = await _ok(PHASES_REPLAY, what, call)
    _expect(
        PHASES_REPLAY,
        first == again,
        f"{what} must replay the first reply {first.model_dump_json()}",
        again.model_dump_json(),
    )


_Call = Callable[[], Awaitable[BaseModel]]


def _named_for(conn: _Conn) -> list[str] | None:
    """The rollouts a refused restore names: none for a Gym target (its restore must name a
    list, and the refusal comes before any record is read), None (every record) for ours."""
    return [] if conn.target.dialect is Dialect.GYM else None


def _calls_with(
    conn: _Conn, checkpoint_id: str, names: Sequence[str], *, attempt: int = 0
) -> list[tuple[str, _Call]]:
    """Control calls naming `checkpoint_id` (made when called, each with a fresh deadline)."""
    p = conn.participant
    named = _named_for(conn)
    every: dict[str, _Call] = {
        "prepare": lambda: p.prepare(
            PrepareRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "renew": lambda: p.renew(
            RenewRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "commit": lambda: p.commit(
            CommitRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "resume": lambda: p.resume(
            ResumeRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
        "restore": lambda: p.restore(
            RestoreRequest(
                checkpoint_id=checkpoint_id,
                attempt=attempt,
                rollout_ids=named,
                deadline_ts=conn.deadline(),
            )
        ),
    }
    return [(name, every[name]) for name in names]


async def check_workers(
    target: Target, *, workers: int | None = None, call_timeout_s: float = 10.0
) -> None:
    """`workers.managed`: the status route does not say `multi_process: unmanaged`; with
    `workers`, a managed participant reports that many worker processes.
    `workers.private-channel`: a managed participant of several workers refuses a read of
    every worker's private channel that comes through its port."""
    async with _connect([target], call_timeout_s) as (conn,):
        status = await conn.status(WORKERS_MANAGED)
        if status.multi_process is MultiProcess.MANAGED and status.workers > 1:
            await _check_private_channel(conn, status.workers)
    if status.multi_process is MultiProcess.UNMANAGED:
        raise ConformanceError(
            WORKERS_MANAGED,
            "one control plane for every worker process of the server",
            f"multi_process: unmanaged ({status.workers} workers): a checkpoint would cover "
            "only the worker that answered, and the operator refuses to checkpoint the set",
            fix="serve the workers with rollout_protocol.workers.serve_workers (docs/sdk.md, "
            "section 10), or run one worker per pod",
        )
    if workers is not None and status.workers != workers:
        raise ConformanceError(
            WORKERS_MANAGED,
            f"{workers} worker processes reported",
            f"{status.workers} ({status.multi_process.value})",
        )


async def _check_private_channel(conn: _Conn, workers: int) -> None:
    """Read each worker's episode counts on its private channel from outside the pod (a read:
    a participant that answers it changes nothing), without a token and with the control token;
    the rollout ids make the pod route each read to another worker."""
    control = {"Authorization": f"Bearer {conn.target.token}"} if conn.target.token else {}
    for rollout_id in rollout_ids_per_worker(workers, _new_id("private")):
        url = conn.url(f"{WORKER_PREFIX}/counts?rollout_id={rollout_id}")
        for what, headers in (("without a token", {}), ("with the control token", control)):
            try:
                reply = await conn.http.get(url, headers=headers, timeout=conn.call_timeout_s)
            except httpx.HTTPError as error:
                raise ConformanceError(
                    WORKERS_PRIVATE,
                    f"GET {WORKER_PREFIX}/counts {what}: a 4xx refusal",
                    f"no reply ({type(error).__name__}: {error})",
                ) from None
            if not 400 <= reply.status_code < 500:
                raise ConformanceError(
                    WORKERS_PRIVATE,
                    f"GET {WORKER_PREFIX}/counts {what} (rollout {rollout_id}, worker "
                    f"{owner(rollout_id, workers)}): a 4xx refusal, the channel is the pod's own",
                    f"{reply.status_code}: {reply.text[:200]}",
                    fix="serve the workers with rollout_protocol.workers.serve_workers, and "
                    f"define no route of your own under {WORKER_PREFIX}",
                )


def _check_spread(statuses: Sequence[StatusReply], rollout_ids: Sequence[str]) -> None:
    """`workers.spread`: the kit's rollout ids reach every worker of each managed participant."""
    for status in statuses:
        if status.multi_process is MultiProcess.UNMANAGED:
            raise ConformanceError(
                WORKERS_MANAGED,
                f"{status.instance}: one control plane for every worker process",
                "multi_process: unmanaged",
                fix="serve the workers with rollout_protocol.workers.serve_workers",
            )
        if status.multi_process is not MultiProcess.MANAGED or status.workers < 2:
            continue
        reached = {owner(rid, status.workers) for rid in rollout_ids}
        missed = sorted(set(range(status.workers)) - reached)
        if missed:
            raise ConformanceError(
                WORKERS_SPREAD,
                f"rollout ids that reach all {status.workers} workers of {status.instance}",
                f"none for worker(s) {missed}",
                fault=DRIVER,
                fix="pass rollout_ids with one per worker: "
                "rollout_protocol.conformance.rollout_ids_per_worker(workers)",
            )


def rollout_ids_per_worker(workers: int, prefix: str = "kit-episode") -> list[str]:
    """`<prefix>-<n>` ids, one held by each of `workers` workers (`workers.owner`), for
    `check_crash_restore` against a multi-worker participant."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < workers:
        rid = f"{prefix}-{n}"
        found.setdefault(owner(rid, workers), rid)
        n += 1
    return [found[k] for k in range(workers)]


async def check_stale_ids(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`ids.stale`: after a resume, prepare, renew and commit of that id are stale; a resume of
    an id never prepared (an abort that overtook its prepare) makes a later prepare stale."""
    async with _connect([target], call_timeout_s) as (conn,):
        p = conn.participant
        await _expect_idle(conn, STALE, "before the check")
        cid = _new_id("stale")
        await _prepared(conn, STALE, cid, conn.deadline())
        await _resume(conn, PHASES_RESUME, cid)
        calls = _calls_with(conn, cid, ("prepare", "renew", "commit"))
        for name, call in calls:
            await _refused(STALE, f"{name} of resumed {cid}", call(), ErrorCode.STALE_CHECKPOINT)
        await _expect_idle(conn, STALE, f"after calls with stale {cid}")
        aborted = _new_id("aborted")
        await _resume(conn, STALE, aborted)
        await _refused(
            STALE,
            f"prepare of {aborted}, resumed before it was ever prepared",
            p.prepare(PrepareRequest(checkpoint_id=aborted, deadline_ts=conn.deadline())),
            ErrorCode.STALE_CHECKPOINT,
        )
        await _expect_idle(conn, STALE, f"after a prepare of stale {aborted}")


async def check_conflicting_ids(target: Target, *, call_timeout_s: float = 10.0) -> None:
    """`ids.conflicting`: while checkpoint A is open, prepare, resume and restore of B are
    refused with conflicting_checkpoint, and A stays open."""
    async with _connect([target], call_timeout_s) as (conn,):
        status = await _expect_idle(conn, CONFLICTING, "before the check")
        open_id, other = _new_id("open"), _new_id("other")
        await _prepared(conn, CONFLICTING, open_id, conn.deadline())
        calls = _calls_with(
            conn, other, ("prepare", "resume", "restore"), attempt=status.attempt + 1
        )
        try:
            for name, call in calls:
                await _refused(
                    CONFLICTING,
                    f"{name} of {other} while {open_id} is prepared",
                    call(),
                    ErrorCode.CONFLICTING_CHECKPOINT,
                )
                await _phase_is(
                    conn, CONFLICTING, Phase.PREPARED, open_id, f"after a {name} of {other}"
                )
        finally:
            with anyio.CancelScope(shield=True):
                await _resume(conn, PHASES_RESUME, open_id)
        await _expect_idle(conn, PHASES_RESUME, f"after the resume of {open_id}")


# --- lease --------------------------------------------------------------------------------------


async def check_lease_auto_resume(
    target: Target,
    *,
    lease_grace_seconds: float | None,
    prepare_deadline_s: float = 1.0,
    margin_s: float = 5.0,
    longest_wait_s: float = 120.0,
    poll_interval_s: float = 0.05,
    call_timeout_s: float = 10.0,
) -> None:
    """`lease.auto-resume`: prepare with a deadline `prepare_deadline_s` ahead, then call
    nothing but `/status` (polled every `poll_interval_s`): the participant must stay in its
    phase until `deadline_ts + lease_grace_seconds` and be idle within `margin_s` after it.

    `lease_grace_seconds` is the participant's `ROLLOUT_LEASE_GRACE_SECONDS`; with None the
    lease expiry the participant reports is trusted (it must come within `longest_wait_s`).
    """
    async with _connect([target], call_timeout_s) as (conn,):
        await _expect_idle(conn, LEASE, "before the check")
        cid = _new_id("lease")
        deadline_ts = time.time() + prepare_deadline_s
        await _ok(
            LEASE,
            f"prepare of {cid}",
            conn.participant.prepare(PrepareRequest(checkpoint_id=cid, deadline_ts=deadline_ts)),
        )
        status = await conn.status(LEASE)
        _expect(
            LEASE,
            status.phase in (Phase.PREPARING, Phase.PREPARED)
            and status.lease_expires_ts is not None,
            f"right after the prepare of {cid}, /status must show its phase and lease expiry",
            f"phase {status.phase.value}, lease_expires_ts {status.lease_expires_ts}",
        )
        assert status.lease_expires_ts is not None
        if lease_grace_seconds is None:
            expires = status.lease_expires_ts
        else:
            expires = deadline_ts + lease_grace_seconds
            _expect(
                LEASE,
                math.isclose(status.lease_expires_ts, expires, abs_tol=0.5),
                f"the lease must expire at deadline_ts + {lease_grace_seconds}s = {expires:.3f}",
                f"lease_expires_ts {status.lease_expires_ts:.3f}",
            )
        _expect(
            LEASE,
            expires - time.time() <= longest_wait_s,
            f"the lease must lapse within {longest_wait_s}s to be checked (run the participant "
            "with a short ROLLOUT_LEASE_GRACE_SECONDS)",
            f"lease_expires_ts {status.lease_expires_ts:.3f}",
        )
        give_up = expires + margin_s
        early = expires - min(0.5, lease_grace_seconds or 0.5)
        while True:
            status = await conn.status(LEASE)
            now = time.time()
            if status.phase is Phase.IDLE:
                _expect(
                    LEASE,
                    now >= early,
                    f"the participant must keep {cid} open until its lease lapses at {expires:.3f}",
                    f"idle {expires - now:.2f}s before the lapse",
                )
                break
            if now >= give_up:
                raise ConformanceError(
                    LEASE,
                    f"the participant must resume by itself once the lease of {cid} lapses "
                    f"(deadline_ts + grace = {expires:.3f})",
                    f"still {status.phase.value} {now - expires:.2f}s after the lapse",
                )
            await anyio.sleep(poll_interval_s)
        await _refused(
            LEASE,
            f"prepare of {cid} after its lease lapsed",
            conn.participant.prepare(
                PrepareRequest(checkpoint_id=cid, deadline_ts=conn.deadline())
            ),
            ErrorCode.STALE_CHECKPOINT,
        )


# --- all-or-nothing restore -------------------------------------------------------------------

_DAMAGES = ("flipped-byte", "wrong-count")


def _damaged_copy(source: Path, target_dir: Path, checkpoint_id: str, damage: str) -> None:
    """Copy one participant's records into `target_dir` for `checkpoint_id`, damaged.

    flipped-byte: one byte of the last record changes (the manifest keeps the old digest);
    wrong-count: the last record is gone (digest and size match the shorter file, the count
    does not). Without records, both write a manifest that promises one record of an empty
    file.
    """
    manifest = storage.read_manifest(source)
    raw = (source / manifest.records_file).read_bytes()
    lines = raw.splitlines(keepends=True)
    count = manifest.record_count
    if not lines:
        content, count = b"", 1
    elif damage == "flipped-byte":
        last = bytearray(lines[-1])
        last[len(last) // 2] ^= 0x01
        content = b"".join(lines[:-1]) + bytes(last)
    else:
        content = b"".join(lines[:-1])
    digest = (
        manifest.records_sha256
        if damage == "flipped-byte" and lines
        else storage.records_digest(hashlib.sha256(line).digest() for line in content.splitlines())
    )
    damaged = Manifest(
        role=manifest.role,
        instance=manifest.instance,
        checkpoint_id=checkpoint_id,
        attempt=manifest.attempt,
        records_file=f"records-{digest}.jsonl",
        records_sha256=digest,
        record_count=count,
        bytes=len(content),
    )
    storage.make_dirs(target_dir)
    (target_dir / damaged.records_file).write_bytes(content)
    (target_dir / storage.MANIFEST_NAME).write_bytes(damaged.model_dump_json().encode())


async def check_restore_all_or_nothing(
    targets: Sequence[Target],
    *,
    checkpoint_root: Path,
    checkpoint_id: str,
    attempt: int,
    call_timeout_s: float = 10.0,
) -> None:
    """`restore.all-or-nothing`: from the committed checkpoint `checkpoint_id`, write damaged
    copies (`flipped-byte`, `wrong-count`) under new ids and restore each into every target
    under `attempt`: each restore must be refused with `records_invalid`, and the participant
    must stay idle, on its attempt, with as many restored episodes as before.

    The check is strongest with two or more records per participant: a participant that
    installs record by record and only then verifies shows restored episodes afterwards.
    """
    async with _connect(targets, call_timeout_s) as conns:
        for damage in _DAMAGES:
            damaged_id = f"{checkpoint_id[: 127 - len(damage)]}.{damage}"
            for conn in conns:
                before = await _expect_idle(conn, RESTORE, f"before the {damage} restore")
                if before.set_name is None:
                    raise ConformanceError(
                        RESTORE, f"/status of {conn.target.name} must name its set", "set_name null"
                    )
                set_dir = before.set_dir or before.set_name
                source = storage.checkpoint_dir(
                    checkpoint_root, set_dir, checkpoint_id, before.instance
                )
                destination = storage.checkpoint_dir(
                    checkpoint_root, set_dir, damaged_id, before.instance
                )
                try:
                    await anyio.to_thread.run_sync(
                        _damaged_copy, source, destination, damaged_id, damage
                    )
                except (storage.RecordsInvalid, OSError) as error:
                    raise ConformanceError(
                        RESTORE,
                        f"the committed records of {before.instance} must be readable under "
                        f"{checkpoint_root}",
                        str(error),
                    ) from error
                what = (
                    f"restore of {damaged_id} ({damage} copy of {checkpoint_id}) into "
                    f"{conn.target.name} under attempt {attempt}"
                )
                await _refused(
                    RESTORE,
                    what,
                    conn.participant.restore(
                        RestoreRequest(
                            checkpoint_id=damaged_id,
                            attempt=attempt,
                            rollout_ids=_named_for(conn),
                            deadline_ts=conn.deadline(),
                        )
                    ),
                    ErrorCode.RECORDS_INVALID,
                )
                after = await _expect_idle(conn, RESTORE, f"after a refused {what}")
                _expect(
                    RESTORE,
                    after.restored_episodes == before.restored_episodes
                    and after.attempt == before.attempt,
                    f"a refused {what} must install nothing",
                    f"restored episodes {before.restored_episodes} -> {after.restored_episodes}, "
                    f"attempt {before.attempt} -> {after.attempt}",
                )


# --- the whole single-participant kit ---------------------------------------------------------


async def check_participant(
    target: Target,
    *,
    checkpoint_root: Path,
    lease_grace_seconds: float | None,
    lease_margin_s: float = 5.0,
    call_timeout_s: float = 10.0,
) -> None:
    """Every single-participant check, in an order that keeps each one's preconditions.

    The participant must be idle and dedicated to the kit: the phases check restores into it
    (moving it to the next attempt) and every check leaves stale ids behind.
    """
    await check_workers(target, call_timeout_s=call_timeout_s)
    await check_auth(target, call_timeout_s=call_timeout_s)
    await check_strict_bodies(target, call_timeout_s=call_timeout_s)
    cid, captured = await check_phases(target, call_timeout_s=call_timeout_s)
    await check_stale_ids(target, call_timeout_s=call_timeout_s)
    await check_conflicting_ids(target, call_timeout_s=call_timeout_s)
    async with _connect([target], call_timeout_s) as (conn,):
        attempt = max((await conn.status(RESTORE)).attempt, captured) + 1
    await check_restore_all_or_nothing(
        [target],
        checkpoint_root=checkpoint_root,
        checkpoint_id=cid,
        attempt=attempt,
        call_timeout_s=call_timeout_s,
    )
    await check_lease_auto_resume(
        target,
        lease_grace_seconds=lease_grace_seconds,
        margin_s=lease_margin_s,
        call_timeout_s=call_timeout_s,
    )


# --- crash + restore ----------------------------------------------------------------------------


class EpisodeDriver(Protocol):
    """What `check_crash_restore` needs from the environment under test (you implement it).

    A driver covers a group of participants that run episodes together (an environment with
    its agent, model and resources peers, or one participant alone). All methods run on the
    kit's event loop.
    """

    def participants(self) -> Sequence[Target]:
        """The group's participants as they are now (after a `restart`, the new ones)."""
        ...

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        """Send `/run` for `rollout_id` under `attempt`; return the server's result (its JSON)
        once the episode ended, or raise `RunRefused` when the server refused the call
        (`return RunRefused.reply(response)` does both). Any other exception is the driver's.

        Under the first attempt, episodes must stop mid-way (see `wait_mid_episode`) and stay
        there: the kit checkpoints them and crashes the group while this call is in flight
        (it then ignores how the call ends). The kit also repeats this call while an episode is
        held, and under attempt + 1 for a finished episode, an attempt the group does not run
        and a retired one: send the same `/run` each time. Give `<id>-uninterrupted`
        (`UNINTERRUPTED_SUFFIX`) the task of `<id>` (`base_rollout_id`).
        """
        ...

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        """Return once every episode has completed at least one step and is parked at a
        boundary where it stays (e.g. held by a test hook between two steps, or by a fake model
        that blocks); raise at `deadline_ts` (unix seconds) otherwise, saying what it waited
        for (the kit reports that message; it cancels the call only `driver_grace_s` later)."""
        ...

    async def crash(self) -> None:
        """Kill every participant of the group at once, without any shutdown (SIGKILL)."""
        ...

    async def restart(self, attempt: int) -> None:
        """Start fresh participants under `attempt` (`ROLLOUT_ATTEMPT`) with the same set name
        and checkpoint root, and return once they answer."""
        ...


class StepHoldingDriver(EpisodeDriver, Protocol):
    """An `EpisodeDriver` that can also hold one episode inside a step that cannot park (a
    `StepMode.WAIT` step, say one waiting on a tool), for `check_workers_park_all`."""

    async def hold_in_step(self, rollout_id: str) -> None:
        """Before its first `/run`: make `rollout_id` stop inside such a step and stay there
        until `release_step` (and not be held at a boundary by `wait_mid_episode`'s hold)."""
        ...

    async def wait_in_step(self, rollout_id: str, deadline_ts: float) -> None:
        """Return once `rollout_id` is inside the held step; raise at `deadline_ts` otherwise."""
        ...

    async def release_step(self, rollout_id: str) -> None:
        """Let the held step end (the episode then parks at its next boundary, or finishes)."""
        ...


async def check_park_all(
    driver: StepHoldingDriver,
    *,
    rollout_ids: Sequence[str],
    busy_wait_s: float = 1.0,
    timeout_s: float = 60.0,
    call_timeout_s: float = 30.0,
) -> None:
    """`steps.wait-holds-prepare` (`workers.park-all` when a participant of the group runs
    several managed workers): the last of `rollout_ids` is held inside a step that cannot park
    (`hold_in_step`), the others mid-way at a boundary (`wait_mid_episode`); with the ids one
    per worker (`rollout_ids_per_worker`), the parked episodes and the busy one live in
    different workers. A prepare whose deadline is `busy_wait_s` away must not be ready and
    must name the busy episode among its blockers; once the step is released, a prepare of a
    new id must be ready with the parked episodes in it. Both are resumed; the group is then
    crashed and restarted under attempt + 1 (its first-attempt episodes never end by
    themselves), so it is usable, idle, afterwards.
    """
    rids = list(rollout_ids)
    _expect(STEPS_WAIT, len(set(rids)) == len(rids) >= 2, "two or more distinct ids", rids)
    async with _connect(driver.participants(), call_timeout_s) as conns:
        statuses = [await conn.status(STEPS_WAIT) for conn in conns]
        _check_spread(statuses, rids)
        workers = _multi_worker(conns, statuses)
        attempts = {status.attempt for status in statuses}
        _expect(STEPS_WAIT, len(attempts) == 1, "the group must run one attempt", attempts)
        attempt = attempts.pop()
        coordinator = Coordinator([conn.participant for conn in conns], call_timeout=call_timeout_s)
        await driver.hold_in_step(rids[-1])
        failures: dict[str, str] = {}

        async def first_run(rid: str) -> None:
            try:
                await driver.run_episode(rid, attempt)
            except Exception as error:
                failures[rid] = f"{type(error).__name__}: {error}"

        broke: ConformanceError | None = None  # raised outside the task group, as itself
        first, second = _new_id("park-busy"), _new_id("park-all")
        async with anyio.create_task_group() as episodes:
            for rid in rids:
                episodes.start_soon(first_run, rid)
            try:
                await _park_all_steps(
                    driver,
                    coordinator,
                    (first, second),
                    rids,
                    workers,
                    failures,
                    busy_wait_s,
                    timeout_s,
                    call_timeout_s,
                )
            except ConformanceError as error:
                broke = error
            finally:
                with anyio.CancelScope(shield=True):
                    # a resume of an id already resumed (or never prepared) changes nothing
                    for cid in (first, second):
                        await coordinator.resume(cid, time.time() + call_timeout_s)
                    await driver.crash()
                episodes.cancel_scope.cancel()
    if broke is not None:
        raise broke
    await driver.restart(attempt + 1)


check_workers_park_all = check_park_all
"""`check_park_all` by its first name (it checks `workers.park-all` on multi-worker groups)."""


async def _park_all_steps(
    driver: StepHoldingDriver,
    coordinator: Coordinator,
    ids: tuple[str, str],
    rids: Sequence[str],
    workers: Mapping[str, int],
    failures: Mapping[str, str],
    busy_wait_s: float,
    timeout_s: float,
    call_timeout_s: float,
) -> None:
    """`check_workers_park_all` once its episodes run: the two prepares."""
    busy, parked = rids[-1], list(rids[:-1])
    first, second = ids
    rule = WORKERS_PARK if workers else STEPS_WAIT
    try:
        with anyio.fail_after(timeout_s):
            await driver.wait_mid_episode(parked, time.time() + timeout_s)
            await driver.wait_in_step(busy, time.time() + timeout_s)
    except Exception as error:
        raise ConformanceError(
            rule,
            f"{parked} must wait mid-way and {busy} inside its held step",
            f"the driver raised {type(error).__name__}: {error}; failures: {dict(failures)}",
            fault=f"{DRIVER}, or the participant if the episodes failed",
        ) from error
    early = await coordinator.prepare(first, time.time() + busy_wait_s, scope=rids)
    if early.ready or not any(e.rollout_id == busy for e in early.blockers):
        raise ConformanceError(
            rule,
            f"with {parked} parked and {busy}{_held_by(busy, workers)} inside a step that "
            "cannot park, the prepare must not be ready and name it as a blocker",
            f"ready={early.ready}, blockers {[str(e) for e in early.blockers]}, "
            f"{early.episode_count} parked",
            fix="run every step whose effect cannot be redone (a write, a tool that is not "
            "idempotent) as StepMode.WAIT"
            + ("; serve workers with rollout_protocol.workers.serve_workers" if workers else ""),
        )
    await coordinator.abort(first, time.time() + call_timeout_s)
    await driver.release_step(busy)
    ready = await coordinator.prepare(second, time.time() + call_timeout_s, scope=rids)
    _expect(
        rule,
        ready.ready and set(parked) <= set(ready.scope(rids) or ()),
        f"once {busy}'s step ended, every episode must park: the prepare must be ready with "
        f"{parked}",
        f"ready={ready.ready}, scope {ready.scope(rids)}, stopped at {ready.stopped_at}, "
        f"failures {[str(f) for f in ready.failures]}",
    )


_Counts = dict[str, dict[str, dict[str, dict[str, int]]]]
_COUNTS: TypeAdapter[_Counts] = TypeAdapter(_Counts)


async def _counters(conn: _Conn, rollout_ids: Sequence[str]) -> _Counts:
    """`{rollout: {attempt: {step: {event: n}}}}` from the participant's counter endpoint."""
    url = conn.url(conn.target.stats_path)
    try:
        response = await conn.http.get(
            url, params=[("rollout_id", rid) for rid in rollout_ids], timeout=conn.call_timeout_s
        )
    except httpx.HTTPError as error:
        raise ConformanceError(
            STEPS, f"GET {url} (the step counters) must answer", repr(error)
        ) from error
    try:
        if response.status_code != 200:
            raise ValueError(_describe(response))
        return _COUNTS.validate_python(response.json()["rollouts"])
    except (ValueError, KeyError, TypeError, ValidationError) as error:
        raise ConformanceError(
            STEPS,
            f"GET {url} must answer 200 with {{'rollouts': {{rollout: {{attempt: {{step: "
            "{'completed': n, ...}}}}}}} (StepCounters.snapshot)",
            str(error)[:300],
        ) from error


def _completed(counts: _Counts, rollout_id: str, attempt: int) -> dict[str, int]:
    steps = counts.get(rollout_id, {}).get(str(attempt), {})
    return {name: events.get("completed", 0) for name, events in steps.items()}


def _ran(counts: _Counts, rollout_id: str, attempt: int) -> set[str]:
    steps = counts.get(rollout_id, {}).get(str(attempt), {})
    return {
        name
        for name, events in steps.items()
        if events.get("started", 0) > 0 or events.get("completed", 0) > 0
    }


@dataclass
class _FirstRuns:
    crashed: bool = False
    failures: dict[str, str] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


@dataclass
class _Repeat:
    """The outcome of the repeated `/run` of a held episode (`run.repeat-live`)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: str | None = None
    driver_error: bool = False


_VOLATILE_KEYS = ("rollout_id", "attempt", "continued_from", "continued")


async def _run_refused(
    driver: EpisodeDriver, rule: str, rid: str, attempt: int, codes: Mapping[str, int], why: str
) -> None:
    """`/run rid@attempt` must be refused with one of `codes` (code -> HTTP status)."""
    expected = " or ".join(f"{status} {code}" for code, status in codes.items())
    try:
        result = await driver.run_episode(rid, attempt)
    except RunRefused as refusal:
        _expect(
            rule,
            codes.get(refusal.code) == refusal.status_code,
            f"/run {rid}@{attempt} ({why}) must be refused with {expected}",
            str(refusal),
        )
        return
    except Exception as error:
        raise ConformanceError(
            rule,
            f"/run {rid}@{attempt} ({why}) must be refused with {expected}",
            f"the driver raised {type(error).__name__}: {error}",
            fault=DRIVER,
            fix="raise RunRefused for an error reply (return RunRefused.reply(response))",
        ) from error
    raise ConformanceError(
        rule,
        f"/run {rid}@{attempt} ({why}) must be refused with {expected}",
        f"it was answered: {str(result)[:300]}",
        fix=_RUN_FIXES[rule],
    )


_RUN_FIXES: Mapping[str, str] = {
    RUN_ATTEMPT: "before starting an episode, refuse attempt != plane.attempt with "
    "ProtocolError(ErrorCode.ATTEMPT_MISMATCH, ...) (409)",
    RUN_RETIRED: "check plane.is_retired(attempt, rollout_id) first, before any cached result, "
    "and refuse with ProtocolError(ErrorCode.ATTEMPT_RETIRED, ...) (410)",
}


def _strip(result: Any, volatile: Collection[str]) -> Any:
    if isinstance(result, dict):
        return {key: value for key, value in result.items() if key not in volatile}
    return result


async def check_crash_restore(
    driver: EpisodeDriver,
    *,
    checkpoint_root: Path,
    rollout_ids: Sequence[str] = ("kit-episode-0", "kit-episode-1"),
    timeout_s: float = 60.0,
    call_timeout_s: float = 30.0,
    repeat_window_s: float = 1.0,
    driver_grace_s: float = 5.0,
    volatile_keys: Collection[str] = _VOLATILE_KEYS,
    model: FakeModel | None = None,
    poll_interval_s: float = 0.05,
    restarting: bool = False,
) -> None:
    """`steps.no-rerun` across a crash, with the `/run` duties that keep episodes exactly once.

    1. run an episode per rollout id under the group's attempt N; wait until all are mid-way;
       read the step counters, repeat the first one's `/run`;
    2. checkpoint them (prepare, commit with the rollout ids as scope) through the
       `Coordinator`, read every participant's step counters (`model.headers`: a model in the
       group must have counted the episodes' calls; `steps.once-per-attempt`), resume; until
       `repeat_window_s` later the counters are read every `poll_interval_s`: the repeated
       rollout starts no step (`run.repeat-one-episode`), and its `/run` must still be
       attached, neither refused nor answered (`run.repeat-live`);
    3. crash the group (the `model`'s holds end: one armed from now on is the driver's
       mistake, `driver.holds`), restart it under N + 1;
    4. restore damaged copies of the checkpoint (refused, nothing installed:
       `restore.all-or-nothing`), then the checkpoint itself, resume;
    5. `/run` under N + 2 and N must be refused (`run.attempt-mismatch`);
    6. run every episode under N + 1 to its end and read the counters again (`steps.no-rerun`,
       `steps.indexed`, `steps.once-per-attempt`);
    7. repeat the first `/run`: same result, no step (`run.repeat-finished`);
    8. run `<id>-uninterrupted` for every id under N + 1; with `model` (the kit's
       `FakeModel`, a participant of the group) the restored episodes' model calls under N + 1
       must carry the prompts of the uninterrupted runs' calls of the same keys
       (`model.same-prompts`); compare the results, less `volatile_keys` (`state.in-boundary`);
    9. retire the first rollout under N + 1 through the coordinator; its `/run` must be
       refused with 410 (`run.retired`).

    A step completed exactly once under N at the checkpoint must not start under N + 1. Step
    names completed more than once under N (a per-token step, say) cannot be told apart and
    are not compared. At least one step must have completed before the checkpoint, or the
    check would prove nothing.

    With `model`, its log is checked too: every episode's calls named it by the checkpoint and
    no call of the group lacked the headers (`model.headers`), and a driver mistake it records
    (`FakeModel.driver_mistakes`) fails the check at once, naming the driver.

    `restarting`: for a participant that keeps nothing of its episodes by design and says so,
    listing every one as a restart at prepare (a work-loss the checkpoint reports; the NeMo Gym
    adapter's `restart` strategy, docs/gym.md). Then the checkpoint must capture none of the
    rollouts and list all of them as restarts, and instead of `steps.no-rerun` each restarted
    episode must be played again from its start: every step it had completed once under N
    completes again under N + 1 (`steps.restarted`); every other rule holds as it is.
    """
    rids = list(rollout_ids)
    _expect(STEPS, len(set(rids)) == len(rids) > 0, "rollout ids must be distinct", rids)
    runs = _FirstRuns()
    cid = _new_id("crash")
    model_calls_from = 0 if model is None else len(model.log)
    async with _connect(driver.participants(), call_timeout_s) as conns:
        statuses = [await conn.status(STEPS) for conn in conns]
        _check_spread(statuses, rids)
        workers = _multi_worker(conns, statuses)
        # with several workers, every worker's episode is repeated (`workers.repeat-run`)
        repeated = rids if workers else rids[:1]
        repeats = {rid: _Repeat() for rid in repeated}
        attempts = {status.attempt for status in statuses}
        _expect(STEPS, len(attempts) == 1, "the group must run one attempt", sorted(attempts))
        attempt = attempts.pop()

        async def first_run(rid: str) -> None:
            try:
                await driver.run_episode(rid, attempt)
            except Exception as error:
                if not runs.crashed:
                    runs.failures[rid] = f"{type(error).__name__}: {error}"
            else:
                if not runs.crashed:
                    runs.finished.append(rid)

        async def repeated_run(rid: str) -> None:
            repeat = repeats[rid]
            try:
                result = await driver.run_episode(rid, attempt)
            except RunRefused as refusal:
                repeat.outcome = f"refused: {refusal}"
            except Exception as error:
                repeat.outcome = f"the driver raised {type(error).__name__}: {error}"
                repeat.driver_error = True
            else:
                repeat.outcome = f"answered before the episode ended: {str(result)[:300]}"
            if not runs.crashed:
                repeat.done.set()

        coordinator = Coordinator([conn.participant for conn in conns], call_timeout=call_timeout_s)
        broke: ConformanceError | None = None  # raised outside the task group, as itself
        async with anyio.create_task_group() as episodes:
            try:
                for rid in rids:
                    episodes.start_soon(first_run, rid)
                mid_deadline = time.time() + timeout_s
                try:  # the driver's own deadline comes first: its message is the diagnostic
                    with anyio.move_on_after(timeout_s + driver_grace_s) as waited:
                        await driver.wait_mid_episode(rids, mid_deadline)
                except Exception as error:
                    if model is not None:  # a server that names no call cannot be held
                        _check_fake_model_headers(model, model_calls_from, rids, attempt, False)
                    raise ConformanceError(
                        STEPS,
                        f"episodes {rids} must reach the middle under attempt {attempt}",
                        f"wait_mid_episode raised {type(error).__name__}: {error}; episode "
                        f"failures: {runs.failures}",
                        fault=f"{DRIVER}, or the participant if the episodes failed",
                    ) from error
                if waited.cancelled_caught:
                    raise ConformanceError(
                        STEPS,
                        f"episodes {rids} must reach the middle under attempt {attempt}",
                        f"wait_mid_episode neither returned nor raised within {driver_grace_s}s "
                        f"after its deadline; episode failures: {runs.failures}",
                        fault=DRIVER,
                        fix="raise at deadline_ts, saying what was awaited",
                    )
                _expect(
                    STEPS,
                    not runs.failures and not runs.finished,
                    "episodes must stay mid-way until the crash",
                    f"failed: {runs.failures}, finished: {runs.finished}",
                )
                held_counts = {c.target.name: await _counters(c, repeated) for c in conns}
                # The repeated /run goes out before the checkpoint, whose round trips to the
                # same servers give it time to be refused (a window that grows with their load).
                for rid in repeated:
                    episodes.start_soon(repeated_run, rid)
                before, commit = await _checkpoint(
                    coordinator, conns, cid, rids, call_timeout_s, restarting
                )
                _check_one_episode(held_counts, before, repeated, attempt, workers)
                _check_model_counts(conns, before, rids, attempt)
                if model is not None:
                    _check_fake_model_headers(model, model_calls_from, rids, attempt)
                await _watch_repeats(
                    conns, held_counts, repeats, attempt, workers, repeat_window_s, poll_interval_s
                )
                _check_once(before, rids)
                for rid, repeat in repeats.items():
                    if repeat.outcome is None:
                        continue
                    raise ConformanceError(
                        RUN_LIVE if rid == rids[0] else WORKERS_REPEAT,
                        f"a repeated /run of the live episode {rid}@{attempt}"
                        f"{_held_by(rid, workers)} must attach to it",
                        repeat.outcome,
                        fault=DRIVER if repeat.driver_error else PARTICIPANT,
                        fix="raise RunRefused for an error reply"
                        if repeat.driver_error
                        else "when runtime.find(rollout_id) is live under this attempt (and task), "
                        "await episode.ended.wait() and answer the result it finished with",
                    )
                runs.crashed = True
                await driver.crash()
                if model is not None:
                    model.end_holds(attempt)
            except ConformanceError as error:
                broke = error
            episodes.cancel_scope.cancel()
        if broke is not None:
            raise broke

    await driver.restart(attempt + 1)
    _check_driver_holds(model)
    targets = list(driver.participants())
    async with _connect(targets, call_timeout_s) as conns:
        statuses = []
        for conn in conns:
            status = await conn.status(STEPS)
            statuses.append(status)
            _expect(
                STEPS,
                status.attempt == attempt + 1 and status.phase is Phase.IDLE,
                f"after the restart {conn.target.name} must be idle under attempt {attempt + 1}",
                f"attempt {status.attempt}, phase {status.phase.value}",
            )
        await check_restore_all_or_nothing(
            targets,
            checkpoint_root=checkpoint_root,
            checkpoint_id=cid,
            attempt=attempt + 1,
            call_timeout_s=call_timeout_s,
        )
        coordinator = Coordinator([conn.participant for conn in conns], call_timeout=call_timeout_s)
        # a Gym participant's restore names the rollouts its commit listed (`listed`)
        restored = await coordinator.restore(
            cid, attempt + 1, time.time() + call_timeout_s, rids, listed=commit.listed
        )
        _expect(
            RESTORE,
            restored.ok,
            f"after the refused damaged copies, the intact {cid} must restore under "
            f"attempt {attempt + 1}",
            "; ".join(str(failure) for failure in restored.failures),
        )
        workers = _multi_worker(conns, statuses)
        pooled = {status.instance for status in statuses if status.workers > 1}
        for instance, manifest in commit.manifests.items():
            _expect(
                WORKERS_RESTORE if instance in pooled else RESTORE,
                restored.restored.get(instance) == manifest.record_count,
                f"{instance} must install the {manifest.record_count} records it committed"
                + (" (in every worker)" if instance in pooled else ""),
                restored.restored.get(instance),
            )
        resumed = await coordinator.resume(cid, time.time() + call_timeout_s)
        _expect(
            PHASES_RESUME,
            not resumed.failures,
            f"resume of restored {cid} must succeed everywhere",
            "; ".join(str(failure) for failure in resumed.failures),
        )
        mismatch = {ErrorCode.ATTEMPT_MISMATCH.value: 409}
        await _run_refused(
            driver, RUN_ATTEMPT, rids[0], attempt + 2, mismatch, "an attempt not running yet"
        )
        _check_driver_holds(model)
        old = {**mismatch, ErrorCode.ATTEMPT_RETIRED.value: 410}
        await _run_refused(driver, RUN_ATTEMPT, rids[0], attempt, old, "the crashed attempt")
        _check_driver_holds(model)
        results = await _run_all(driver, rids, attempt + 1, timeout_s, "restored episode", model)
        after = {conn.target.name: await _counters(conn, rids) for conn in conns}
        _check_restored_workers(workers, before, after, rids, attempt)
        if restarting:
            _check_restarted(before, after, rids, attempt)
        else:
            _compare_counts(before, after, rids, attempt)
        _check_once(after, rids)
        started = {name: _ran(counts, rids[0], attempt + 2) for name, counts in after.items()}
        _expect(
            RUN_ATTEMPT,
            not any(started.values()),
            f"the refused /run {rids[0]}@{attempt + 2} must start nothing",
            f"steps counted under attempt {attempt + 2}: {started}",
        )

        repeated = rids if workers else rids[:1]
        again = await _run_all(driver, repeated, attempt + 1, timeout_s, "repeated /run", model)
        for rid in repeated:
            rule = RUN_FINISHED if rid == rids[0] else WORKERS_REPEAT
            held = _held_by(rid, workers)
            _expect(
                rule,
                again[rid] == results[rid],
                f"a repeated /run of the finished {rid}@{attempt + 1}{held} must answer its result",
                f"first {str(results[rid])[:200]}, then {str(again[rid])[:200]}",
            )
            for conn in conns:
                now = await _counters(conn, [rid])
                _expect(
                    rule,
                    now.get(rid) == after[conn.target.name].get(rid),
                    f"a repeated /run of the finished {rid}@{attempt + 1}{held} must run no "
                    f"step on {conn.target.name} (keep finished results and answer them again)",
                    f"counters before {after[conn.target.name].get(rid)}, after {now.get(rid)}",
                )

        twin_ids = [rid + UNINTERRUPTED_SUFFIX for rid in rids]
        twins = await _run_all(
            driver, twin_ids, attempt + 1, timeout_s, "uninterrupted episode", model
        )
        _check_once({conn.target.name: await _counters(conn, twin_ids) for conn in conns}, twin_ids)
        if model is not None:
            _check_prompts(model, rids, attempt + 1)
        differ = {
            rid: (
                _strip(results[rid], volatile_keys),
                _strip(twins[rid + UNINTERRUPTED_SUFFIX], volatile_keys),
            )
            for rid in rids
            if _strip(results[rid], volatile_keys)
            != _strip(twins[rid + UNINTERRUPTED_SUFFIX], volatile_keys)
        }
        _expect(
            STATE,
            not differ,
            "an episode continued after the crash must end as an uninterrupted run of its task "
            "(state kept outside the boundaries is lost at a restore: put it in the Boundary's "
            "JSON)",
            "; ".join(f"{rid}: restored {r}, uninterrupted {u}" for rid, (r, u) in differ.items()),
        )

        retired = await coordinator.retire(attempt + 1, rids[:1], time.time() + call_timeout_s)
        _expect(
            RUN_RETIRED,
            not retired.failures,
            f"the retire of {rids[0]}@{attempt + 1} must succeed",
            "; ".join(str(failure) for failure in retired.failures),
        )
        await _run_refused(
            driver,
            RUN_RETIRED,
            rids[0],
            attempt + 1,
            {ErrorCode.ATTEMPT_RETIRED.value: 410},
            "retired",
        )


def _multi_worker(conns: Sequence[_Conn], statuses: Sequence[StatusReply]) -> dict[str, int]:
    """The group's participants with several managed workers: target name -> workers."""
    return {
        conn.target.name: status.workers
        for conn, status in zip(conns, statuses, strict=True)
        if status.multi_process is MultiProcess.MANAGED and status.workers > 1
    }


def _held_by(rid: str, workers: Mapping[str, int]) -> str:
    """` (held by worker k of <participant>, ...)`, or nothing for single-process groups."""
    held = [f"worker {owner(rid, n)} of {name}" for name, n in workers.items()]
    return f" (held by {', '.join(held)})" if held else ""


def _check_restored_workers(
    workers: Mapping[str, int],
    before: Mapping[str, _Counts],
    after: Mapping[str, _Counts],
    rids: Sequence[str],
    attempt: int,
) -> None:
    """`workers.restore-all`: in a multi-worker participant, every worker's restored episode
    continued from its records (a worker the restore missed starts its episodes again)."""
    for name, n in workers.items():
        for rid in rids:
            once = {s for s, k in _completed(before.get(name, {}), rid, attempt).items() if k == 1}
            again = sorted(once & _ran(after.get(name, {}), rid, attempt + 1))
            if again:
                raise ConformanceError(
                    WORKERS_RESTORE,
                    f"the restored {rid} (held by worker {owner(rid, n)} of {name}'s {n}) must "
                    f"continue from its records under attempt {attempt + 1}",
                    f"steps completed before the checkpoint ran again: {again}",
                    fix="restore through rollout_protocol.workers.serve_workers, whose control "
                    "plane installs each record in the worker that holds its rollout",
                )


async def _run_all(
    driver: EpisodeDriver,
    rids: Sequence[str],
    attempt: int,
    timeout_s: float,
    what: str,
    model: FakeModel | None = None,
) -> dict[str, Any]:
    """Run every episode to its end concurrently; each must finish with a result (a driver
    mistake the `model` recorded on the way is reported first, as the driver's)."""
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}

    async def one(rid: str) -> None:
        try:
            results[rid] = await driver.run_episode(rid, attempt)
        except Exception as error:
            failures[rid] = f"{type(error).__name__}: {error}"

    with anyio.move_on_after(timeout_s):
        async with anyio.create_task_group() as group:
            for rid in rids:
                group.start_soon(one, rid)
    unfinished = [rid for rid in rids if rid not in results and rid not in failures]
    _check_driver_holds(model)
    if unfinished:
        failures["(unfinished)"] = f"{unfinished} not finished within {timeout_s}s"
        raise ConformanceError(
            STEPS,
            f"every {what} must finish under attempt {attempt}",
            str(failures),
            fault=f"{PARTICIPANT}, or the driver if it still holds them",
            fix="if your driver holds episodes (a test hook, a fake that blocks), hold only "
            "the first attempt's own rollouts, armed once before the crash (the kit's "
            "FakeModel reports a later hold at once); otherwise find where the episode waits",
        )
    _expect(STEPS, not failures, f"every {what} must finish under attempt {attempt}", failures)
    return results


def _check_model_counts(
    conns: Sequence[_Conn], before: Mapping[str, _Counts], rids: Sequence[str], attempt: int
) -> None:
    """`model.headers`: a model participant of the group counted the mid-way episodes' calls."""
    for conn in conns:
        if conn.target.role is not Role.MODEL:
            continue
        counted = [rid for rid in rids if _ran(before[conn.target.name], rid, attempt)]
        if not counted:
            raise ConformanceError(
                MODEL_HEADERS,
                f"{conn.target.name} must have counted model calls of the episodes {rids} under "
                f"attempt {attempt} by the checkpoint (it records only calls that name their "
                "episode)",
                f"its counters for them: {before[conn.target.name]}",
                fault="the participant that calls the model",
                fix="send X-Rollout-Request: <rollout_id>/<turn> and X-Rollout-Attempt: "
                "<attempt> on every model call",
            )


def _check_fake_model_headers(
    model: FakeModel, calls_from: int, rids: Sequence[str], attempt: int, each: bool = True
) -> None:
    """`model.headers` on the kit's `FakeModel`: no call since the check began lacked the
    headers and (with `each`: by the checkpoint) every episode named itself on a call under
    `attempt`."""
    unnamed = [call for call in model.log[calls_from:] if call.rollout_id is None]
    silent = [rid for rid in rids if each and not model.calls(rid, attempt)]
    if unnamed or silent:
        raise ConformanceError(
            MODEL_HEADERS,
            f"every model call of the episodes {rids} must name its episode (under attempt "
            f"{attempt})",
            f"{len(unnamed)} calls without X-Rollout-Request/X-Rollout-Attempt"
            + (f" (first prompt {unnamed[0].prompt[:120]!r})" if unnamed else "")
            + (f"; no named call of {silent}" if silent else ""),
            fault="the participant that calls the model",
            fix="send X-Rollout-Request: <rollout_id>/<turn> and X-Rollout-Attempt: "
            "<attempt> on every model call (docs/sdk.md, section 3)",
        )


def _check_driver_holds(model: FakeModel | None) -> None:
    """`driver.holds`: a hold the driver armed after the crash is reported at once, as the
    driver's mistake (the fake model did not arm it, so no episode waits on it)."""
    if model is None or not model.driver_mistakes:
        return
    raise ConformanceError(
        DRIVER_HOLDS,
        "holds on model calls of the first attempt only (armed before each episode reaches "
        "the call, and never after the crash)",
        "; ".join(model.driver_mistakes),
        fault=DRIVER_MISTAKE,
        fix="arm FakeModel.hold(...) in run_episode only for the first attempt's own rollout "
        "ids (attempt == the first one, base_rollout_id(rollout_id) == rollout_id), once per "
        "rollout, with attempt=attempt",
    )


def _step_events(counts: _Counts, rollout_id: str, attempt: int) -> dict[str, tuple[int, int]]:
    """step -> (started, completed) of one rollout under one attempt."""
    steps = counts.get(rollout_id, {}).get(str(attempt), {})
    return {
        name: (events.get("started", 0), events.get("completed", 0))
        for name, events in steps.items()
    }


def _check_one_episode(
    held: Mapping[str, _Counts],
    now: Mapping[str, _Counts],
    rids: Sequence[str],
    attempt: int,
    workers: Mapping[str, int],
) -> None:
    """`run.repeat-one-episode`: since the episodes were held (`held`, read before the repeated
    `/run` went out), no step of a repeated rollout started or completed under `attempt`."""
    moved: list[str] = []
    for name, counts in now.items():
        for rid in rids:
            was = _step_events(held.get(name, {}), rid, attempt)
            for step, (started, completed) in sorted(_step_events(counts, rid, attempt).items()):
                before = was.get(step, (0, 0))
                if started > before[0] or completed > before[1]:
                    moved.append(
                        f"{name} {rid}{_held_by(rid, workers)} {step}: started "
                        f"{before[0]} -> {started}, completed {before[1]} -> {completed}"
                    )
    if moved:
        raise ConformanceError(
            RUN_ONE,
            f"a repeated /run of a held episode must start nothing under attempt {attempt} "
            "(it attaches to the live episode)",
            "steps ran after the repeated /run: " + "; ".join(moved),
            fix="look the rollout up with runtime.find(rollout_id) before anything else and, "
            "when it is live, await episode.ended.wait() and answer its result; never run a "
            "second episode loop for it",
        )


async def _watch_repeats(
    conns: Sequence[_Conn],
    held: Mapping[str, _Counts],
    repeats: Mapping[str, _Repeat],
    attempt: int,
    workers: Mapping[str, int],
    window_s: float,
    poll_interval_s: float,
) -> None:
    """For `window_s` (or until every repeated `/run` ended), read the repeated rollouts'
    counters every `poll_interval_s`: `run.repeat-one-episode` on each read."""
    rids = list(repeats)
    end = time.monotonic() + window_s

    async def all_done() -> None:
        for repeat in repeats.values():
            await repeat.done.wait()

    while True:
        now = {conn.target.name: await _counters(conn, rids) for conn in conns}
        _check_one_episode(held, now, rids, attempt, workers)
        left = end - time.monotonic()
        if left <= 0 or all(repeat.done.is_set() for repeat in repeats.values()):
            return
        with anyio.move_on_after(min(poll_interval_s, left)):
            await all_done()


def _check_once(counts: Mapping[str, _Counts], rids: Sequence[str]) -> None:
    """`steps.once-per-attempt`: no indexed step completed twice under one attempt (unindexed
    names, a per-token step say, may repeat by design and are not judged)."""
    twice: list[str] = []
    for name, per_rollout in counts.items():
        for rid in rids:
            for attempt, steps in sorted(per_rollout.get(rid, {}).items()):
                for step, events in sorted(steps.items()):
                    if "@" in step and events.get("completed", 0) > 1:
                        twice.append(
                            f"{name} {rid} {step} completed {events['completed']} times under "
                            f"attempt {attempt}"
                        )
    if twice:
        raise ConformanceError(
            STEPS_ONCE,
            "each indexed step completes at most once per attempt",
            "; ".join(twice),
            fix="never run a completed step again under the same attempt: continue from the "
            "episode's boundary (no retry loop around a step that completed, no second "
            "episode of a rollout), and keep step names unique within the episode",
        )


def _check_prompts(model: FakeModel, rids: Sequence[str], attempt: int) -> None:
    """`model.same-prompts`: each model call a restored episode made under `attempt` carries
    the prompt of its uninterrupted twin's call of the same key (the twin's rollout id read as
    the restored one's, should a prompt name it)."""
    differ: list[str] = []
    compared = 0
    for rid in rids:
        twin_id = rid + UNINTERRUPTED_SUFFIX
        twin = {k: p.replace(twin_id, rid) for k, p in model.prompts(twin_id, attempt).items()}
        for key, prompt in sorted(model.prompts(rid, attempt).items()):
            compared += 1
            expected = twin.get(key)
            if expected is None:
                differ.append(f"{rid}/{key}: the uninterrupted run made no call {key}")
            elif expected != prompt:
                differ.append(
                    f"{rid}/{key}: restored prompt {_clip(prompt)}, uninterrupted {_clip(expected)}"
                )
    if differ:
        raise ConformanceError(
            MODEL_PROMPTS,
            f"the model calls of the restored episodes under attempt {attempt} must carry the "
            "prompts of an uninterrupted run's calls of the same keys",
            "; ".join(differ[:5]) + (f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""),
            fix="build every prompt from the episode's boundary state (the transcript in the "
            "Boundary's JSON), never from memory kept beside it: it is gone after a restore",
        )


def _clip(text: str, keep: int = 160) -> str:
    """`text` for a message: its end (where prompts differ most), quoted."""
    return repr(text if len(text) <= keep else "..." + text[-keep:])


async def _checkpoint(
    coordinator: Coordinator,
    conns: Sequence[_Conn],
    cid: str,
    rids: Sequence[str],
    call_timeout_s: float,
    restarting: bool = False,
) -> tuple[dict[str, _Counts], CommitOutcome]:
    """prepare, commit (scope: the rollouts), read the counters while parked, resume.

    Participants that all speak NeMo Gym's dialect are checkpointed without a requested scope
    (Gym's prepare lists no episodes to agree one from): every parked episode, which must be
    exactly the rollouts, none restarting. With `restarting`, every rollout must be a restart
    and none captured (`check_crash_restore`)."""
    gym_only = all(conn.target.dialect is Dialect.GYM for conn in conns)
    try:
        prepared = await coordinator.prepare(
            cid, time.time() + call_timeout_s, scope=None if gym_only else rids
        )
        _expect(
            STEPS,
            prepared.ready,
            f"the checkpoint {cid} of the mid-way episodes must be ready",
            f"stopped at {prepared.stopped_at}, {prepared.blocker_count} blockers, "
            f"failures: {'; '.join(str(f) for f in prepared.failures)}",
        )
        if gym_only:
            scope = prepared.scope()
            captured = scope is None and prepared.episode_count == len(rids)
        else:
            scope = prepared.scope(rids)
            captured = scope is not None and sorted(scope) == sorted(rids)
        if restarting:
            restarts = sorted({e.rollout_id for e in prepared.restarts})
            _expect(
                STEPS_RESTARTED,
                not scope and restarts == sorted(rids),
                f"every episode must be listed as a restart by {cid}, none captured",
                f"scope {scope}, restarts {[str(e) for e in prepared.restarts]}",
            )
        else:
            _expect(
                STEPS,
                captured and not prepared.restarts,
                f"every episode must be captured by {cid} (none restarting)",
                f"scope {scope}, {prepared.episode_count} parked, "
                f"restarts {[str(e) for e in prepared.restarts]}",
            )
        commit = await coordinator.commit(cid, time.time() + call_timeout_s, scope)
        _expect(
            STEPS,
            commit.ok,
            f"the commit of {cid} must succeed",
            "; ".join(str(f) for f in commit.failures),
        )
        before = {conn.target.name: await _counters(conn, rids) for conn in conns}
    finally:
        with anyio.CancelScope(shield=True):
            resumed = await coordinator.resume(cid, time.time() + call_timeout_s)
    _expect(
        PHASES_RESUME,
        not resumed.failures,
        f"resume of {cid} must succeed everywhere",
        "; ".join(str(failure) for failure in resumed.failures),
    )
    return before, commit


def _check_restarted(
    before: Mapping[str, _Counts], after: Mapping[str, _Counts], rids: Sequence[str], attempt: int
) -> None:
    """Each restarted episode was played again from its start: every step completed once under
    `attempt` at the checkpoint completed again under `attempt + 1`."""
    compared = 0
    skipped: list[str] = []
    for name, counts in before.items():
        for rid in rids:
            once = {step for step, n in _completed(counts, rid, attempt).items() if n == 1}
            compared += len(once)
            again = set(_completed(after.get(name, {}), rid, attempt + 1))
            skipped.extend(f"{name} {rid} {step}" for step in sorted(once - again))
    _expect(
        STEPS_RESTARTED,
        compared > 0 and not skipped,
        f"every restarted episode must be played again from its start under attempt "
        f"{attempt + 1} (its steps completed before the checkpoint complete again)",
        f"not run again: {', '.join(skipped)}" if skipped else "no step completed before it",
    )


def _compare_counts(
    before: Mapping[str, _Counts], after: Mapping[str, _Counts], rids: Sequence[str], attempt: int
) -> None:
    compared = 0
    reruns: list[str] = []
    unindexed: list[str] = []
    for name, counts in before.items():
        for rid in rids:
            once = {step for step, n in _completed(counts, rid, attempt).items() if n == 1}
            compared += len(once)
            again = once & _ran(after.get(name, {}), rid, attempt + 1)
            for step in sorted(again):
                (reruns if "@" in step else unindexed).append(f"{name} {rid} {step}")
    _expect(
        STEPS,
        not reruns,
        f"no step completed under attempt {attempt} before the checkpoint may run again under "
        f"attempt {attempt + 1}",
        "ran again: " + ", ".join(reruns),
    )
    if unindexed:
        raise ConformanceError(
            STEPS_INDEXED,
            f"a step that completed under attempt {attempt} before the checkpoint and runs under "
            f"attempt {attempt + 1} must be told apart from a repeat",
            "completed once before, ran again after (the next turn's step, or a repeat: the "
            "name cannot say): " + ", ".join(unindexed),
            fix="name steps name@index, unique within the episode (f'ask@{turn}')",
        )
    if compared == 0:
        silent = [name for name, counts in before.items() if not any(counts.get(r) for r in rids)]
        if len(silent) == len(before):
            raise ConformanceError(
                STEPS,
                f"the counters must show steps of {rids} completed under attempt {attempt} at "
                "the checkpoint",
                f"no participant counted any step of them: {dict(before)}",
                fix="create the EpisodeRuntime with observer=counters.observe (a StepCounters) "
                "and serve counters.snapshot(rollout_ids, False) at GET /stats",
            )
        raise ConformanceError(
            STEPS,
            f"the counters must show steps completed under attempt {attempt} at the checkpoint",
            f"steps started but none completed: {dict(before)}",
            fault=DRIVER,
            fix="return from wait_mid_episode only after each episode completed a step",
        )


# --- in-process apps ------------------------------------------------------------------------


class _Loopback:
    """HTTP for an in-process app: uvicorn's protocol on a loopback port, in this event loop.

    Every client reaches the app as it would a process (the kit's httpx client and the aiohttp
    session of its participant client alike). `close` drops it as a killed process would: the
    port refuses connections, open connections are dropped, and requests in flight are cancelled
    without an answer. The app's lifespan is not run here (`ServedApp` runs it).
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only then (with
        # the default protocol 0 every reply on a kept-alive connection waits ~40 ms for an ACK)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        # idle connections are kept longer than any client keeps them (httpx 5 s), so a client
        # never sends on a connection this side is closing; `close` ends them all anyway
        config = uvicorn.Config(
            self._serve,
            interface="asgi3",
            lifespan="off",
            log_config=None,
            proxy_headers=False,
            timeout_keep_alive=60,
        )
        self._server = uvicorn.Server(config)
        self._requests: set[anyio.CancelScope] = set()
        self._closed = False

    async def start(self) -> None:
        config = self._server.config
        config.load()
        self._server.lifespan = config.lifespan_class(config)  # "off": nothing runs
        await self._server.startup(sockets=[self._socket])

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        # a request cancelled by `close` ends here, quietly: its connection is gone already
        with anyio.CancelScope() as request:
            if self._closed:
                return
            self._requests.add(request)
            try:
                await self._app(scope, receive, send)
            finally:
                self._requests.discard(request)

    def close(self) -> None:
        """Stop at once (idempotent): refuse connections, drop open ones, cancel requests."""
        self._closed = True
        for server in getattr(self._server, "servers", []):
            server.close()
        self._socket.close()
        for connection in list(self._server.server_state.connections):
            connection.transport.abort()  # before the cancellations: no answer goes out
        for request in list(self._requests):
            request.cancel()


class ServedApp:
    """An ASGI app served in process with its lifespan running; `target` reaches it.

    The app answers HTTP on a loopback port (127.0.0.1, a port the system picks) in this event
    loop; `client` is an httpx client with that base URL (the target's `client`).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        role: Role,
        token: str,
        index: int = 0,
        stats_path: str = "/stats",
    ) -> None:
        self.app = app
        self._http = _Loopback(app)
        self.client = httpx.AsyncClient(base_url=self._http.url)
        self.target = Target(self._http.url, role, token, index, self.client, stats_path)
        self._scope = anyio.CancelScope()
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._graceful = True

    async def _run(self, *, task_status: TaskStatus[None], timeout_s: float) -> None:
        to_app, app_inbox = anyio.create_memory_object_stream[Message](4)
        app_outbox, from_app = anyio.create_memory_object_stream[Message](4)
        try:
            with self._scope:
                async with anyio.create_task_group() as group:
                    scope: dict[str, Any] = {
                        "type": "lifespan",
                        "asgi": {"version": "3.0", "spec_version": "2.0"},
                        "state": {},
                    }

                    async def lifespan() -> None:
                        await self.app(scope, app_inbox.receive, app_outbox.send)

                    group.start_soon(lifespan)
                    await to_app.send({"type": "lifespan.startup"})
                    with anyio.fail_after(timeout_s):
                        message = await from_app.receive()
                    if message["type"] != "lifespan.startup.complete":
                        raise RuntimeError(f"the app did not start: {message}")
                    await self._http.start()
                    task_status.started()
                    await self._stop.wait()
                    self._http.close()
                    if self._graceful:
                        with anyio.move_on_after(timeout_s):
                            await to_app.send({"type": "lifespan.shutdown"})
                            await from_app.receive()
                    group.cancel_scope.cancel()
        finally:
            self._http.close()
            self._stopped.set()
            for stream in (to_app, app_inbox, app_outbox, from_app):
                stream.close()

    async def crash(self) -> None:
        """Stop the app as a SIGKILL would: no shutdown, its tasks and requests cancelled,
        connections dropped, calls refused."""
        self._http.close()
        self._graceful = False
        self._scope.cancel()
        await self._stopped.wait()
        await self.client.aclose()

    async def stop(self) -> None:
        """Stop serving HTTP (requests still in flight are cancelled), run the app's lifespan
        shutdown, then close the client."""
        self._stop.set()
        await self._stopped.wait()
        await self.client.aclose()


async def start_app(
    group: TaskGroup,
    app: ASGIApp,
    *,
    role: Role,
    token: str,
    index: int = 0,
    stats_path: str = "/stats",
    startup_timeout_s: float = 10.0,
) -> ServedApp:
    """Serve `app` in a task of `group` (lifespan started before this returns).

    Stop it with `ServedApp.stop()` or `ServedApp.crash()`; for drivers that crash and restart
    apps while the kit runs.
    """
    served = ServedApp(app, role=role, token=token, index=index, stats_path=stats_path)
    await group.start(_start_served, served, startup_timeout_s)
    return served


async def _start_served(
    served: ServedApp, timeout_s: float, *, task_status: TaskStatus[None]
) -> None:
    await served._run(task_status=task_status, timeout_s=timeout_s)


@asynccontextmanager
async def serve_app(
    app: ASGIApp,
    *,
    role: Role,
    token: str,
    index: int = 0,
    stats_path: str = "/stats",
    startup_timeout_s: float = 10.0,
) -> AsyncIterator[ServedApp]:
    """Serve `app` in process for the block (lifespan startup before, shutdown after).

    An error raised in the block comes out as itself (a `ConformanceError` stays one), not
    wrapped in the task group's exception group.
    """
    error: Exception | None = None
    async with anyio.create_task_group() as group:
        served = await start_app(
            group,
            app,
            role=role,
            token=token,
            index=index,
            stats_path=stats_path,
            startup_timeout_s=startup_timeout_s,
        )
        try:
            yield served
        except Exception as raised:
            error = raised
        finally:
            with anyio.CancelScope(shield=True):
                await served.stop()
    if error is not None:
        raise error
