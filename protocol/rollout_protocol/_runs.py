"""The duties of a server's `/run` route, kept once: `RunRoute`.

A `/run` call asks a server to play one rollout's episode under one attempt. The exactly-once
promise rests on what that route does before it plays anything, in a fixed order (docs/sdk.md,
"What your `/run` must do"): refuse new episodes while shutting down, refuse a retired attempt
and then another attempt than the one this process runs (both before any cached result: a retired
attempt is never answered from a cache), answer a finished episode's result again without a step,
attach a repeated call to the live episode instead of starting a second one, and only then begin
(or continue a restored) episode; the runtime's errors leave as the protocol's error replies. The
rollout id and attempt are checked first, where they enter: one the wire cannot carry (not the
rollout id pattern, a negative attempt) is a 422 `invalid_request` naming the field.
Every server used to write these lines itself, and one order mistake answers a retired attempt.
`RunRoute` does them; the server hands it the request and its episode function.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import anyio
from pydantic import BaseModel, ValidationError

from ._control import ControlPlane
from ._episodes import (
    AttemptRetired,
    Boundary,
    Episode,
    EpisodeCancelled,
    EpisodeError,
    EpisodeExists,
    EpisodeRuntime,
    EpisodeTimeout,
    StaleAttempt,
    TaskMismatch,
)
from ._http import describe_validation
from ._wire import EpisodeId, ErrorCode, ProtocolError, task_digest

__all__ = ["RunRoute"]

log = logging.getLogger(__name__)

R = TypeVar("R")

RUN_STEP = "run"
"""The name under which the runtime's observer sees an episode's run: `started` when it begins
here, then `completed` (its result is kept) or `failed`."""


class RunBody(Protocol):
    """What `RunRoute.run` reads of a `/run` request: any object with these attributes (the
    server's own pydantic model of the body, as docs/sdk.md's payload section describes it)."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def attempt(self) -> int: ...

    @property
    def task(self) -> Any:
        """The task: a JSON object, or a pydantic model of one (its `model_dump()` is digested)."""


class _Run(Generic[R]):
    """The result of one episode's run, awaited by its first caller and every attached one."""

    def __init__(self, episode: Episode, digest: str) -> None:
        self.episode = episode
        self.digest = digest
        self.done = anyio.Event()
        self.outcome: tuple[R] | ProtocolError | None = None

    def finish(self, outcome: tuple[R] | ProtocolError) -> None:
        if not self.done.is_set():
            self.outcome = outcome
            self.done.set()

    async def wait(self) -> R:
        await self.done.wait()
        if isinstance(self.outcome, ProtocolError):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome[0]


class RunRoute(Generic[R]):
    """The `/run` duties of one server (docs/sdk.md, "What your `/run` must do"), once.

        runs = RunRoute(plane, runtime, draining=lambda: app.state.draining)

        @app.post("/run")
        async def run(request: RunRequest) -> RunResult:
            return await runs.run(request, play, first=Boundary("ask", {"turn": 0}))

    `play(episode)` runs the episode's steps from its boundary (a fresh `first`, or the
    boundary a restore installed) to its end and returns the reply; it runs inside
    `runtime.driving` and `runtime.guard`, and the reply waits for `runtime.hold` before it
    leaves. Errors it raises leave as the protocol's replies: a `ProtocolError` as it is, the
    runtime's `EpisodeError`s as `wire_error` maps them, anything else as 500 `internal` (logged).

    Without `spawn` the episode runs in the task of the call that began it; with `spawn` (a
    task group's `start_soon`) it runs in a task of its own, so it outlives every caller. Either
    way a repeated call waits for the same reply (or the same error). Finished replies are kept
    by (rollout, attempt) for the last `keep` episodes. The runtime's observer, if any, sees
    each run as the step `run` (`started`, `completed`, `failed`).
    """

    def __init__(
        self,
        plane: ControlPlane,
        runtime: EpisodeRuntime,
        *,
        draining: Callable[[], bool] | None = None,
        spawn: Callable[[Callable[[], Awaitable[None]]], None] | None = None,
        keep: int = 10_000,
    ) -> None:
        self.plane = plane
        self.runtime = runtime
        self._draining = draining
        self._spawn = spawn
        self._keep = keep
        self._finished: OrderedDict[tuple[str, int], tuple[str, R]] = OrderedDict()
        """(rollout, attempt) -> (task digest, reply) of the episodes that finished here."""
        self._running: dict[str, _Run[R]] = {}

    def is_finished(self, rollout_id: str, attempt: int) -> bool:
        """Whether the episode of (rollout, attempt) finished here and its reply is kept (what
        `RuntimeParticipant(is_finished=...)` asks for its work accounting)."""
        return (rollout_id, attempt) in self._finished

    @staticmethod
    def wire_error(error: EpisodeError) -> ProtocolError:
        """The runtime's errors as the wire's (docs/sdk.md, "Runtime errors on the wire")."""
        if isinstance(error, TaskMismatch):
            return ProtocolError(ErrorCode.TASK_MISMATCH, str(error))
        if isinstance(error, AttemptRetired | EpisodeCancelled):
            return ProtocolError(ErrorCode.ATTEMPT_RETIRED, str(error))
        if isinstance(error, StaleAttempt | EpisodeExists):
            return ProtocolError(ErrorCode.ATTEMPT_MISMATCH, str(error))
        if isinstance(error, EpisodeTimeout):
            return ProtocolError(ErrorCode.DEADLINE_PASSED, str(error))
        return ProtocolError(ErrorCode.INTERNAL, str(error))

    def _check(self, rollout_id: str, attempt: int) -> None:
        """The duties that refuse a call before anything is looked up: 503 `admission_closed`
        while shutting down, 410 `attempt_retired` for a retired (attempt, rollout), 409
        `attempt_mismatch` for another attempt than this process runs."""
        if self._draining is not None and self._draining():
            raise ProtocolError(ErrorCode.ADMISSION_CLOSED, "the server is shutting down")
        if self.plane.is_retired(attempt, rollout_id) or self.runtime.is_retired(
            attempt, rollout_id
        ):
            raise ProtocolError(
                ErrorCode.ATTEMPT_RETIRED, f"attempt {attempt} of {rollout_id} was retired here"
            )
        if attempt != self.plane.attempt:
            raise ProtocolError(
                ErrorCode.ATTEMPT_MISMATCH,
                f"this server runs attempt {self.plane.attempt}, not {attempt}",
            )

    async def run(
        self, request: RunBody, play: Callable[[Episode], Awaitable[R]], *, first: Boundary
    ) -> R:
        """Answer one `/run`: refuse it, answer it from the finished reply, attach it to the
        live episode, or begin (or continue) the episode at `first` and `play` it."""
        rid, attempt = request.rollout_id, request.attempt
        _valid_episode_id(rid, attempt)
        self._check(rid, attempt)
        digest = task_digest(_task_json(request.task))
        finished = self._finished.get((rid, attempt))
        if finished is not None:
            if finished[0] != digest:
                raise ProtocolError(ErrorCode.TASK_MISMATCH, f"{rid} finished another task")
            return finished[1]  # never play a finished episode twice
        live = self.runtime.find(rid)
        if live is not None:  # a repeated /run (the caller's connection dropped): attach
            if live.attempt != attempt:
                raise ProtocolError(
                    ErrorCode.ATTEMPT_MISMATCH, f"{rid} is live here under attempt {live.attempt}"
                )
            if live.digest is not None and live.digest != digest:
                raise ProtocolError(ErrorCode.TASK_MISMATCH, f"{rid} is live with another task")
            running = self._running.get(rid)
            if running is not None and running.episode is live:
                return await running.wait()
            await live.ended.wait()  # begun by someone else: its reply is not ours to give
            finished = self._finished.get((rid, attempt))
            if finished is not None and finished[0] == digest:
                return finished[1]
            raise ProtocolError(ErrorCode.INTERNAL, f"{rid} ended without a result")
        try:
            episode = self.runtime.begin(rid, attempt, first, digest=digest)
        except EpisodeError as error:
            raise self.wire_error(error) from error
        running = self._running[rid] = _Run[R](episode, digest)
        if self._spawn is None:
            await self._drive(running, play)
        else:
            self._spawn(lambda: self._drive(running, play))
        return await running.wait()

    async def _drive(self, running: _Run[R], play: Callable[[Episode], Awaitable[R]]) -> None:
        episode, runtime = running.episode, self.runtime
        self._observe(episode, "started")
        outcome: tuple[R] | ProtocolError
        try:
            with runtime.driving(episode):
                try:
                    with runtime.guard(episode):
                        outcome = (await play(episode),)
                    await runtime.hold(episode)  # never reply while a checkpoint is open
                except EpisodeError as failure:
                    outcome = self.wire_error(failure)
                except ProtocolError as failure:
                    outcome = failure
                except Exception as failure:
                    log.exception("episode %s failed", episode.id)
                    outcome = ProtocolError(
                        ErrorCode.INTERNAL, f"{type(failure).__name__}: {failure}"
                    )
            if isinstance(outcome, ProtocolError):
                self._observe(episode, "failed")
            else:
                key = (episode.rollout_id, episode.attempt)
                self._finished[key] = (running.digest, outcome[0])
                while len(self._finished) > self._keep:
                    self._finished.popitem(last=False)
                self._observe(episode, "completed")
            running.finish(outcome)
        finally:
            runtime.end(episode)
            if self._running.get(episode.rollout_id) is running:
                del self._running[episode.rollout_id]
            # cancelled (the server stops): attached callers get an error they re-issue on
            running.finish(ProtocolError(ErrorCode.INTERNAL, f"{episode.id} was stopped"))

    def _observe(self, episode: Episode, event: str) -> None:
        if self.runtime.observer is not None:
            self.runtime.observer(episode, RUN_STEP, event)


def _valid_episode_id(rollout_id: str, attempt: int) -> None:
    """Refuse, as 422 `invalid_request` naming the field, an id the runtime could not record."""
    try:
        EpisodeId(rollout_id=rollout_id, attempt=attempt)
    except ValidationError as error:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, describe_validation(error)) from None


def _task_json(task: Any) -> dict[str, Any]:
    if isinstance(task, BaseModel):
        return task.model_dump()
    if isinstance(task, Mapping):
        return dict(task)
    raise TypeError(f"a /run task is a JSON object or a pydantic model, not {type(task).__name__}")
