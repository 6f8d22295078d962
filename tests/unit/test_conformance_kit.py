"""The conformance kit against deliberately broken participants: each fails with its rule named.

Every participant here is a small FastAPI app built on the SDK (episode runtime, runtime
participant, control plane, step counters) and served in process by the kit's own `start_app`.
`Conforming` keeps every rule and passes the whole kit; each named fake below it breaks exactly
one rule by replacing one route (a route registered before the control plane's router answers
first) or by how it mounts the control plane, and the kit must fail on that rule.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from rollout_protocol import (
    API_PREFIX,
    Boundary,
    CommitReply,
    CommitRequest,
    ControlPlane,
    ControlSettings,
    Dialect,
    Episode,
    EpisodeError,
    EpisodeId,
    EpisodeRuntime,
    ErrorCode,
    ForgetRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
    Record,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    RuntimeParticipant,
    StepCounters,
    StepMode,
    checkpoint_base,
    read_manifest,
)
from rollout_protocol import conformance as kit
from rollout_protocol.conformance import ConformanceError, ServedApp, start_app
from rollout_protocol.workers import owner

TOKEN = "kit-unit-token"
GRACE = 0.3
"""The fakes' lease grace: the lease check waits about prepare deadline + this."""
STEP_NAMES = ("s0", "s1", "s2")
HOLD_BEFORE = "s1"
"""Episodes of a held app wait at the boundary before this step (after s0 completed)."""
WAIT = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rollout_id: str
    attempt: int


def _strict(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        detail = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
            for problem in error.errors()
        )
        raise ProtocolError(ErrorCode.INVALID_REQUEST, detail) from None


def _authorize(request: Request) -> None:
    if request.headers.get("authorization") != f"Bearer {TOKEN}":
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong token")


class Conforming:
    """A three-step participant on the SDK that keeps every rule.

    `POST /run {rollout_id, attempt}` runs (or continues) an episode of steps s0, s1, s2; with
    `hold` set, episodes wait at the boundary before s1 until the app is gone. It keeps the
    `/run` duties: 410 for a retired attempt, 409 for another attempt than the plane's, a
    repeated call attaches to the live episode or answers the finished result. `GET /stats` is
    the counter endpoint (`StepCounters.snapshot`).
    """

    workers = 1
    """Above 1: the app says it is the control plane of that many managed workers (status
    `multi_process: managed`), one process standing in for a pod of `serve_workers`, so the
    kit applies its workers' rules; its fakes below break one of them for some workers only."""

    def __init__(self, settings: ControlSettings, *, hold: bool = False) -> None:
        settings = replace(settings, workers=self.workers)
        self.settings = settings
        self.hold = hold
        self.counters = StepCounters(settings.role)
        self.runtime = EpisodeRuntime(observer=self.counters.observe)
        self.participant = RuntimeParticipant(settings.role, self.runtime)
        self.plane = ControlPlane(self.participant, settings)
        self.reached: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)
        self.finished: dict[tuple[str, int], dict[str, Any]] = {}
        self.model: Callable[[str, str, int, str], Awaitable[None]] | None = None
        """Set by `ModelDriver`: a call to the group's model (the kit's `FakeModel`) with
        (rollout id, key, attempt, prompt), made in every step, keyed by the step's index."""
        self._never = anyio.Event()
        self.in_step: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)
        self.step_held: dict[str, anyio.Event] = {}
        """Episodes held inside their first step (a wait step, which cannot park) until set."""

    def build(self) -> FastAPI:
        app = FastAPI()
        self.override(app)
        server = self

        @app.post("/run")
        async def run(body: RunBody) -> dict[str, Any]:
            return await server.run(body.rollout_id, body.attempt)

        @app.get("/stats")
        async def stats(
            rollout_id: list[str] = Query(default_factory=list),  # noqa: B008
        ) -> dict[str, Any]:
            return server.counters.snapshot(rollout_id, False)

        self.mount(app)
        return app

    def override(self, app: FastAPI) -> None:
        """Routes that replace the control plane's (none: this one conforms)."""

    def mount(self, app: FastAPI) -> None:
        self.plane.install(app)

    def claim(self, rollout_id: str) -> None:
        """Before an episode begins (a restored boundary is claimed by `begin`)."""

    def check_attempt(self, rollout_id: str, attempt: int) -> None:
        """410 for a retired attempt, 409 for another attempt than the plane runs."""
        if self.plane.is_retired(attempt, rollout_id):
            raise ProtocolError(ErrorCode.ATTEMPT_RETIRED, f"{rollout_id}@{attempt} retired")
        if attempt != self.plane.attempt:
            raise ProtocolError(ErrorCode.ATTEMPT_MISMATCH, f"this is {self.plane.attempt}")

    async def run(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        self.check_attempt(rollout_id, attempt)
        live = self.runtime.find(rollout_id)
        if live is not None:  # a repeated /run: attach to the live episode
            await live.ended.wait()
        finished = self.finished.get((rollout_id, attempt))
        if finished is not None:
            return finished
        self.claim(rollout_id)
        try:
            episode = self.runtime.begin(rollout_id, attempt, Boundary(STEP_NAMES[0]))
        except EpisodeError as error:
            raise ProtocolError(ErrorCode.ATTEMPT_MISMATCH, str(error)) from error
        try:
            while episode.boundary.step != "done":
                step = episode.boundary.step
                if step == HOLD_BEFORE and self.hold and rollout_id not in self.step_held:
                    self.reached[rollout_id].set()
                    await self._never.wait()
                index = STEP_NAMES.index(step)
                following = STEP_NAMES[index + 1] if index + 1 < len(STEP_NAMES) else "done"

                async def one(
                    following: str = following, step: str = step, index: int = index
                ) -> Boundary:
                    if self.model is not None:
                        prompt = self.prompt(episode)
                        await self.model(self.model_key(rollout_id), str(index), attempt, prompt)
                    self.on_step(rollout_id, step)
                    release = self.step_held.get(rollout_id)
                    if release is not None and step == STEP_NAMES[0]:
                        self.in_step[rollout_id].set()
                        await release.wait()
                    done = [*episode.boundary.state.get("steps", []), step]
                    return Boundary(following, {"steps": done})

                await self.run_step(episode, step, one)
        finally:
            self.runtime.end(episode)
        result = self.result(episode)
        self.finished[(rollout_id, attempt)] = result
        return result

    def step_name(self, step: str) -> str:
        """The name the counters count a step under: name@index, unique within the episode."""
        return f"step@{STEP_NAMES.index(step)}"

    async def run_step(
        self, episode: Episode, step: str, one: Callable[[], Awaitable[Boundary]]
    ) -> None:
        """Run one step of the episode through the runtime."""
        await self.runtime.step(episode, self.step_name(step), self.step_mode(step), one)

    def step_mode(self, step: str) -> StepMode:
        """Wait steps (a checkpoint waits for them); with a model, replay steps: the model call
        can run again, so an episode held inside one is parked at its previous boundary."""
        return StepMode.WAIT if self.model is None else StepMode.REPLAY

    def prompt(self, episode: Episode) -> str:
        """The model prompt: the episode and the steps its boundary says are done."""
        done = ",".join(episode.boundary.state.get("steps", []))
        return f"episode {episode.rollout_id}; done: {done}"

    def on_step(self, rollout_id: str, step: str) -> None:
        """A step ran (nothing to keep: its effect is in the boundary)."""

    def model_key(self, rollout_id: str) -> str:
        """The rollout a model call names (what X-Rollout-Request carries): the episode's."""
        return rollout_id

    def result(self, episode: Episode) -> dict[str, Any]:
        """The episode's result: what its boundary says (nothing kept beside it)."""
        return {
            "rollout_id": episode.rollout_id,
            "continued_from": episode.continued_from,
            "steps": episode.boundary.state.get("steps", []),
        }


Handler = Callable[[Any], Awaitable[BaseModel]]


def _replace_route(
    app: FastAPI,
    name: str,
    model: type[BaseModel],
    handler: Handler,
    *,
    authorize: bool = True,
    parse: Callable[[type[BaseModel], bytes], Any] = _strict,
) -> None:
    """Serve the control route `name` with `handler` ahead of the control plane's router."""

    async def endpoint(request: Request) -> Response:
        if authorize:
            _authorize(request)
        reply = await handler(parse(model, await request.body()))
        return Response(reply.model_dump_json(), media_type="application/json")

    app.add_api_route(f"{API_PREFIX}/{name}", endpoint, methods=["POST"])


def _lenient(model: type[BaseModel], raw: bytes) -> Any:
    """Parses as a careless server would: unknown keys dropped, strings coerced to numbers."""
    data = {key: value for key, value in json.loads(raw).items() if key in model.model_fields}
    return model.model_validate(data)


class UnauthenticatedForget(Conforming):
    """Breaks `auth.every-route`: its own `/forget` route never looks at the token."""

    def override(self, app: FastAPI) -> None:
        _replace_route(app, "forget", ForgetRequest, self.plane.forget, authorize=False)


class LenientPrepareBody(Conforming):
    """Breaks `bodies.strict`: `/prepare` ignores unknown fields and coerces strings."""

    def override(self, app: FastAPI) -> None:
        _replace_route(app, "prepare", PrepareRequest, self.plane.prepare, parse=_lenient)


class CommitNotReplayed(Conforming):
    """Breaks `phases.replay`: a retried commit is refused instead of answered again."""

    def override(self, app: FastAPI) -> None:
        async def commit(body: CommitRequest) -> CommitReply:
            if self.plane.phase is Phase.COMMITTED:
                raise ProtocolError(ErrorCode.WRONG_PHASE, "already committed")
            return await self.plane.commit(body)

        _replace_route(app, "commit", CommitRequest, commit)


class IdleResumeSkipped(Conforming):
    """Breaks `ids.stale`: a resume while idle is a no-op, so an abort that overtook its
    prepare does not stop that prepare later."""

    def override(self, app: FastAPI) -> None:
        async def resume(body: ResumeRequest) -> ResumeReply:
            if self.plane.phase is Phase.IDLE:
                return ResumeReply(checkpoint_id=body.checkpoint_id, phase=Phase.IDLE)
            return await self.plane.resume(body)

        _replace_route(app, "resume", ResumeRequest, resume)


class ConflictingPrepareAborts(Conforming):
    """Breaks `ids.conflicting`: a prepare of a new id resumes the open checkpoint first."""

    def override(self, app: FastAPI) -> None:
        async def prepare(body: PrepareRequest) -> PrepareReply:
            open_id = self.plane.checkpoint_id
            if open_id is not None and open_id != body.checkpoint_id:
                await self.plane.resume(
                    ResumeRequest(checkpoint_id=open_id, deadline_ts=body.deadline_ts)
                )
            return await self.plane.prepare(body)

        _replace_route(app, "prepare", PrepareRequest, prepare)


class NoLeaseWatchdog(Conforming):
    """Breaks `lease.auto-resume`: mounts the control plane's router by hand instead of with
    `install`, so its lease watchdog never runs."""

    def mount(self, app: FastAPI) -> None:
        app.include_router(self.plane.router)
        # No watchdog, but a clean stop: a plane left prepared would keep the process-wide
        # garbage collector off for every later test.
        app.router.on_shutdown.append(self.plane.aclose)

        async def refused(request: Request, error: Exception) -> Response:
            assert isinstance(error, ProtocolError)
            return JSONResponse(error.body().model_dump(mode="json"), error.status_code)

        app.add_exception_handler(ProtocolError, refused)


_RECORD: TypeAdapter[Record] = TypeAdapter(Record)


class PartialRestore(Conforming):
    """Breaks `restore.all-or-nothing`: installs each record as it reads it and checks the
    digest and count only afterwards."""

    def override(self, app: FastAPI) -> None:
        async def restore(body: RestoreRequest) -> RestoreReply:
            root = self.settings.checkpoint_root
            assert root is not None
            directory = (
                checkpoint_base(root, self.settings.set_name, body.checkpoint_id)
                / self.settings.instance
            )
            manifest = read_manifest(directory)
            raw = (directory / manifest.records_file).read_bytes()
            installed = []
            for line in raw.splitlines():
                try:
                    record = _RECORD.validate_json(line)
                except ValidationError:
                    continue
                installed.extend(self.runtime.install([record], body.attempt))
            if (
                hashlib.sha256(raw).hexdigest() != manifest.records_sha256
                or len(raw.splitlines()) != manifest.record_count
            ):
                raise ProtocolError(ErrorCode.RECORDS_INVALID, "records damaged")
            return RestoreReply(
                checkpoint_id=body.checkpoint_id,
                phase=Phase.RESTORED,
                attempt=body.attempt,
                restored=installed,
                record_count=len(installed),
            )

        _replace_route(app, "restore", RestoreRequest, restore)


class RestartsFromScratch(Conforming):
    """Breaks `steps.no-rerun`: drops the restored boundary and runs the episode from s0."""

    def claim(self, rollout_id: str) -> None:
        self.runtime.drop_restored(rollout_id)


class NoAttemptCheck(Conforming):
    """Breaks `run.attempt-mismatch`: `/run` never compares the attempt with the plane's, so a
    call under an attempt not running yet starts an episode."""

    def check_attempt(self, rollout_id: str, attempt: int) -> None:
        if self.plane.is_retired(attempt, rollout_id):
            raise ProtocolError(ErrorCode.ATTEMPT_RETIRED, f"{rollout_id}@{attempt} retired")


class RetiredAnsweredFromCache(Conforming):
    """Breaks `run.retired`: a finished result is answered before the retire check."""

    async def run(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        finished = self.finished.get((rollout_id, attempt))
        if finished is not None:
            return finished
        return await super().run(rollout_id, attempt)


class RepeatRefused(Conforming):
    """Breaks `run.repeat-live`: a repeated `/run` of a live episode is refused (the
    runtime's `EpisodeExists` passed on as 409) instead of attached to it."""

    async def run(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        if self.runtime.find(rollout_id) is not None:
            raise ProtocolError(ErrorCode.ATTEMPT_MISMATCH, f"{rollout_id} is running")
        return await super().run(rollout_id, attempt)


class RepeatRunsAgain(Conforming):
    """Breaks `run.repeat-finished`: keeps no finished results, so a repeated `/run` of a
    finished episode plays it again from the start."""

    async def run(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        self.finished.pop((rollout_id, attempt), None)
        return await super().run(rollout_id, attempt)


class StateOutsideBoundary(Conforming):
    """Breaks `state.in-boundary`: keeps each episode's step log in process memory beside the
    runtime and answers it, so the steps before a restore are missing from the result after."""

    def __init__(self, settings: ControlSettings, *, hold: bool = False) -> None:
        super().__init__(settings, hold=hold)
        self.log: defaultdict[str, list[str]] = defaultdict(list)

    def on_step(self, rollout_id: str, step: str) -> None:
        self.log[rollout_id].append(step)

    def result(self, episode: Episode) -> dict[str, Any]:
        return {"rollout_id": episode.rollout_id, "steps": self.log[episode.rollout_id]}


class UnindexedSteps(Conforming):
    """Breaks `steps.indexed`: every step is counted as `turn`, so the step after the restore
    cannot be told from a repeat of the one before it."""

    def step_name(self, step: str) -> str:
        return "turn"


class UnnamedModelCalls(Conforming):
    """Breaks `model.headers`: its model calls carry no X-Rollout-Request/X-Rollout-Attempt,
    so the model records them under no rollout of the group."""

    def model_key(self, rollout_id: str) -> str:
        return ""  # `ModelDriver.call_model` sends no headers for an empty rollout id


class RepeatStartsAnother(Conforming):
    """Breaks `run.repeat-one-episode`: a repeated `/run` of a live episode starts a second
    episode of the rollout in a runtime of its own (counted by the same counters), which runs
    the first step again and then waits on the first episode, so the call is neither refused
    nor answered early."""

    def __init__(self, settings: ControlSettings, *, hold: bool = False) -> None:
        super().__init__(settings, hold=hold)
        self.second = EpisodeRuntime(observer=self.counters.observe)

    async def run(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        live = self.runtime.find(rollout_id)
        if live is None:
            return await super().run(rollout_id, attempt)
        episode = self.second.begin(rollout_id, attempt, Boundary(STEP_NAMES[0]))

        async def first() -> Boundary:
            return Boundary(STEP_NAMES[1], {"steps": [STEP_NAMES[0]]})

        await self.second.step(episode, self.step_name(STEP_NAMES[0]), StepMode.WAIT, first)
        await live.ended.wait()
        return self.finished[(rollout_id, attempt)]


class StepRunTwice(Conforming):
    """Breaks `steps.once-per-attempt`: a retry around the first step runs it a second time
    after it completed, under the same attempt and name."""

    async def run_step(
        self, episode: Episode, step: str, one: Callable[[], Awaitable[Boundary]]
    ) -> None:
        await super().run_step(episode, step, one)
        if step == STEP_NAMES[0]:
            done = episode.boundary

            async def again() -> Boundary:
                return Boundary(done.step, dict(done.state))

            await self.runtime.step(episode, self.step_name(step), self.step_mode(step), again)


class HistoryOutsideBoundary(Conforming):
    """Breaks `model.same-prompts`: builds each prompt from a history kept in process memory
    beside the runtime, which a restore loses; its results come from the boundary, so they
    still equal the uninterrupted runs' (`state.in-boundary` cannot see it)."""

    def __init__(self, settings: ControlSettings, *, hold: bool = False) -> None:
        super().__init__(settings, hold=hold)
        self.history: defaultdict[str, list[str]] = defaultdict(list)

    def on_step(self, rollout_id: str, step: str) -> None:
        self.history[rollout_id].append(step)

    def prompt(self, episode: Episode) -> str:
        done = ",".join(self.history[episode.rollout_id])
        return f"episode {episode.rollout_id}; done: {done}"


class SideEffectReplayed(Conforming):
    """Breaks `steps.wait-holds-prepare`: runs its steps, side effects and all, as replay
    steps, so a prepare is ready while an episode is inside one."""

    def step_mode(self, step: str) -> StepMode:
        return StepMode.REPLAY


class Workers(Conforming):
    """Conforming, as the control plane of three managed workers."""

    workers = 3


class ReadyWhileAWorkerIsBusy(Workers):
    """Breaks `workers.park-all`: answers a prepare ready once the episodes that parked did,
    as a pod that asks only the workers that have parked (the busy one's blocker dropped)."""

    def override(self, app: FastAPI) -> None:
        async def prepare(body: PrepareRequest) -> PrepareReply:
            reply = await self.plane.prepare(body)
            if reply.ready:
                return reply
            return reply.model_copy(update={"ready": True, "blockers": [], "blocker_count": 0})

        _replace_route(app, "prepare", PrepareRequest, prepare)


class RestoreMissesAWorker(Workers):
    """Breaks `workers.restore-all`: its restore installs nothing for the rollouts worker 2
    holds (as a pod that sends the records to some workers only), so those start again."""

    def __init__(self, settings: ControlSettings, *, hold: bool = False) -> None:
        super().__init__(settings, hold=hold)
        runtime = self.runtime

        class Missing(RuntimeParticipant):
            async def install(self, records: Sequence[Record], attempt: int) -> list[Any]:
                kept = [r for r in records if owner(r.rollout_id, Workers.workers) != 2]
                await super().install(kept, attempt)
                return [EpisodeId(rollout_id=r.rollout_id, attempt=attempt) for r in records]

        self.participant = Missing(settings.role, runtime)
        self.plane = ControlPlane(self.participant, self.settings)


class RepeatElsewhere(Workers):
    """Breaks `workers.repeat-run`: a repeated `/run` of a finished episode of workers 1 and 2
    reaches a worker that does not hold it (as a router that sends it anywhere), where it
    starts again; worker 0's episodes are answered as they should."""

    async def run(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        if owner(rollout_id, self.workers) != 0:
            self.finished.pop((rollout_id, attempt), None)
        return await super().run(rollout_id, attempt)


class NoObserver(Conforming):
    """Breaks `steps.no-rerun` by omission: its runtime has no `observer=`, so its counters
    stay empty; the kit must blame the participant, not the driver."""

    def __init__(self, settings: ControlSettings, *, hold: bool = False) -> None:
        super().__init__(settings, hold=hold)
        self.runtime = EpisodeRuntime()
        self.participant = RuntimeParticipant(settings.role, self.runtime)
        self.plane = ControlPlane(self.participant, settings)


class NotMounted(Conforming):
    """Breaks `control.mounted`: never calls `plane.install(app)`, so no control route exists."""

    def mount(self, app: FastAPI) -> None:
        pass


class OneTurn(Conforming):
    """Conforming, with episodes of one step: each ends after its first model call, before the
    second one (`<rollout_id>/1`) that `ModelDriver` holds."""

    async def run_step(
        self, episode: Episode, step: str, one: Callable[[], Awaitable[Boundary]]
    ) -> None:
        async def only() -> Boundary:
            return Boundary("done", (await one()).state)

        await super().run_step(episode, step, only)


class InProcessDriver:
    """The kit's `EpisodeDriver` over one in-process fake: a crash drops the app (no shutdown),
    a restart builds a fresh one from the same settings under the new attempt."""

    def __init__(self, group: TaskGroup, fake: type[Conforming], settings: ControlSettings):
        self.group = group
        self.fake = fake
        self.settings = settings
        self.server: Conforming | None = None
        self.served: ServedApp | None = None

    async def restart(self, attempt: int) -> None:
        self.server = self.fake(replace(self.settings, attempt=attempt), hold=self.served is None)
        self.served = await start_app(
            self.group, self.server.build(), role=self.settings.role, token=TOKEN
        )

    def participants(self) -> list[kit.Target]:
        """The app as the kit reaches it, in the first dialect its control plane mounts."""
        assert self.served is not None
        return [replace(self.served.target, dialect=self.settings.dialects[0])]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        assert self.served is not None
        reply = await self.served.client.post(
            "/run", json={"rollout_id": rollout_id, "attempt": attempt}
        )
        return kit.RunRefused.reply(reply)

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        assert self.server is not None
        with anyio.fail_after(max(0.0, deadline_ts - time.time())):
            for rollout_id in rollout_ids:
                await self.server.reached[rollout_id].wait()

    async def crash(self) -> None:
        assert self.served is not None
        await self.served.crash()

    async def close(self) -> None:
        if self.served is not None:
            await self.served.stop()

    async def hold_in_step(self, rollout_id: str) -> None:
        assert self.server is not None
        self.server.step_held[rollout_id] = anyio.Event()

    async def wait_in_step(self, rollout_id: str, deadline_ts: float) -> None:
        assert self.server is not None
        with anyio.fail_after(max(0.0, deadline_ts - time.time())):
            await self.server.in_step[rollout_id].wait()

    async def release_step(self, rollout_id: str) -> None:
        assert self.server is not None
        self.server.step_held[rollout_id].set()


class ModelDriver(InProcessDriver):
    """The fake environment and the kit's `FakeModel` beside it, a participant of the group,
    which the environment calls in every step (replay steps) with X-Rollout-Request
    `<rollout_id>/<step index>`. Episodes of the first attempt are held in their second model
    call (`<rollout_id>/1`) by the fake model, not by the environment. Both crash and restart
    together; the fake model's log and holds outlive its apps."""

    def __init__(self, group: TaskGroup, fake: type[Conforming], settings: ControlSettings):
        super().__init__(group, fake, settings)
        self.fake_model = kit.FakeModel()
        self.model: ServedApp | None = None
        self.first: int | None = None
        self.armed: set[str] = set()

    async def restart(self, attempt: int) -> None:
        settings = replace(self.settings, role=Role.MODEL, attempt=attempt)
        self.model = await start_app(
            self.group, self.fake_model.app(settings), role=Role.MODEL, token=TOKEN
        )
        self.server = self.fake(replace(self.settings, attempt=attempt))
        self.server.model = self.call_model
        self.served = await start_app(
            self.group, self.server.build(), role=self.settings.role, token=TOKEN
        )
        self.first = attempt if self.first is None else self.first

    async def call_model(self, rollout_id: str, key: str, attempt: int, prompt: str) -> None:
        assert self.model is not None
        headers = (
            {"X-Rollout-Request": f"{rollout_id}/{key}", "X-Rollout-Attempt": str(attempt)}
            if rollout_id
            else {}
        )
        reply = await self.model.client.post(
            "/v1/completions", json={"model": "policy", "prompt": prompt}, headers=headers
        )
        reply.raise_for_status()

    def arm(self, rollout_id: str, attempt: int) -> None:
        """Hold the episode's second model call: once per rollout of the first attempt."""
        first = attempt == self.first and kit.base_rollout_id(rollout_id) == rollout_id
        if first and rollout_id not in self.armed:
            self.armed.add(rollout_id)
            self.fake_model.hold(f"{rollout_id}/1", attempt=attempt)

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        self.arm(rollout_id, attempt)
        return await super().run_episode(rollout_id, attempt)

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        for rid in rollout_ids:
            await self.fake_model.wait_held(f"{rid}/1", deadline_ts)

    def participants(self) -> list[kit.Target]:
        assert self.model is not None
        return [*super().participants(), self.model.target]

    async def crash(self) -> None:
        assert self.model is not None
        await super().crash()
        await self.model.crash()

    async def close(self) -> None:
        await super().close()
        if self.model is not None:
            await self.model.stop()


class BystanderDriver(ModelDriver):
    """`ModelDriver`'s group with a third participant that holds no episode of its own (a
    resources server whose sessions its caller rebuilds, as the Gym adapter's is): a control
    plane over an empty runtime, whose counters stay empty. It crashes and restarts with the
    others."""

    def __init__(self, group: TaskGroup, fake: type[Conforming], settings: ControlSettings):
        super().__init__(group, fake, settings)
        self.bystander: ServedApp | None = None

    async def restart(self, attempt: int) -> None:
        await super().restart(attempt)
        settings = replace(self.settings, role=Role.RESOURCES, attempt=attempt)
        counters = StepCounters(Role.RESOURCES)
        participant = RuntimeParticipant(Role.RESOURCES, EpisodeRuntime(), work_counter=None)
        app = FastAPI()

        @app.get("/stats")
        async def stats(
            rollout_id: list[str] = Query(default_factory=list),  # noqa: B008
        ) -> dict[str, Any]:
            return counters.snapshot(rollout_id, False)

        ControlPlane(participant, settings).install(app)
        self.bystander = await start_app(self.group, app, role=Role.RESOURCES, token=TOKEN)

    def participants(self) -> list[kit.Target]:
        assert self.bystander is not None
        return [*super().participants(), self.bystander.target]

    async def crash(self) -> None:
        assert self.bystander is not None
        await super().crash()
        await self.bystander.crash()

    async def close(self) -> None:
        await super().close()
        if self.bystander is not None:
            await self.bystander.stop()


class RearmingDriver(ModelDriver):
    """A driver mistake, not the server's: it arms the hold on every `/run` of a rollout,
    without an attempt, so after the crash it holds the restored episode's call too."""

    def arm(self, rollout_id: str, attempt: int) -> None:
        if kit.base_rollout_id(rollout_id) == rollout_id:
            self.fake_model.hold(f"{rollout_id}/1")


def _settings(root: Path, dialect: Dialect = Dialect.ROLLOUT) -> ControlSettings:
    return ControlSettings(
        Role.ENVIRONMENT,
        set_name="kit",
        checkpoint_root=root,
        token=TOKEN,
        lease_grace_seconds=GRACE,
        dialects=(dialect,),
    )


@asynccontextmanager
async def _driver(
    fake: type[Conforming],
    root: Path,
    driver_type: type[InProcessDriver] = InProcessDriver,
    dialect: Dialect = Dialect.ROLLOUT,
) -> AsyncIterator[InProcessDriver]:
    error: Exception | None = None
    async with anyio.create_task_group() as group:
        driver = driver_type(group, fake, _settings(root, dialect))
        await driver.restart(0)
        try:
            yield driver
        except Exception as raised:
            error = raised  # raised below, outside the task group, as itself
        finally:
            with anyio.CancelScope(shield=True):
                await driver.close()
    if error is not None:
        raise error


async def _whole_kit(
    fake: type[Conforming], root: Path, dialect: Dialect = Dialect.ROLLOUT
) -> None:
    async with _driver(fake, root, dialect=dialect) as driver:
        (target,) = driver.participants()
        await kit.check_participant(
            target, checkpoint_root=root, lease_grace_seconds=GRACE, lease_margin_s=2.0
        )


def _rollout_ids(fake: type[Conforming]) -> list[str]:
    """Three ids; one per worker of a multi-worker fake."""
    return kit.rollout_ids_per_worker(3, "r") if fake.workers > 1 else ["r-0", "r-1", "r-2"]


async def _crash_restore(
    fake: type[Conforming], root: Path, dialect: Dialect = Dialect.ROLLOUT
) -> None:
    async with _driver(fake, root, dialect=dialect) as driver:
        await kit.check_crash_restore(
            driver, checkpoint_root=root, rollout_ids=_rollout_ids(fake), timeout_s=WAIT
        )


async def _park_all(fake: type[Conforming], root: Path) -> None:
    """`check_park_all` (`workers.park-all` on a multi-worker fake, `steps.wait-holds-prepare`
    on a single-process one), then the crash + restore check on the group it restarted."""
    async with _driver(fake, root) as driver:
        rids = _rollout_ids(fake)
        await kit.check_workers_park_all(driver, rollout_ids=rids, busy_wait_s=0.3, timeout_s=WAIT)
        assert driver.server is not None  # the fresh one of the restart, idle under attempt 1
        status = driver.server.plane.status()
        assert (status.phase, status.attempt, status.workers) == (Phase.IDLE, 1, fake.workers)


async def _crash_restore_with_model(
    fake: type[Conforming], root: Path, driver_type: type[ModelDriver] = ModelDriver
) -> None:
    async with _driver(fake, root, driver_type) as driver:
        assert isinstance(driver, ModelDriver)
        await kit.check_crash_restore(
            driver,
            checkpoint_root=root,
            rollout_ids=["r-0", "r-1"],
            timeout_s=WAIT,
            model=driver.fake_model,
        )


@pytest.mark.anyio
@pytest.mark.parametrize("dialect", list(Dialect), ids=lambda dialect: dialect.value)
async def test_conforming_participant_passes_the_whole_kit(
    tmp_path: Path, dialect: Dialect
) -> None:
    """Every rule, in each dialect: the same participant mounting only ours, or only NeMo
    Gym's (the kit then speaks Gym's paths, bodies and error codes)."""
    with anyio.fail_after(30):
        await _whole_kit(Conforming, tmp_path / "single", dialect)
        await _crash_restore(Conforming, tmp_path / "crash", dialect)
        if dialect is Dialect.ROLLOUT:
            await _crash_restore_with_model(Conforming, tmp_path / "with-model")
            await _park_all(Conforming, tmp_path / "park")


@pytest.mark.anyio
async def test_a_multi_worker_participant_passes_the_workers_rules(tmp_path: Path) -> None:
    """`workers.park-all`, and the crash + restore check with one rollout per worker
    (`workers.restore-all`, `workers.repeat-run`), on the conforming fake as three workers'
    control plane."""
    with anyio.fail_after(30):
        await _park_all(Workers, tmp_path / "park")
        await _crash_restore(Workers, tmp_path / "crash")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fake", "rule", "run_kit"),
    [
        (UnauthenticatedForget, kit.AUTH, _whole_kit),
        (LenientPrepareBody, kit.BODIES, _whole_kit),
        (CommitNotReplayed, kit.PHASES_REPLAY, _whole_kit),
        (IdleResumeSkipped, kit.STALE, _whole_kit),
        (ConflictingPrepareAborts, kit.CONFLICTING, _whole_kit),
        (NoLeaseWatchdog, kit.LEASE, _whole_kit),
        (PartialRestore, kit.RESTORE, _crash_restore),
        (RestartsFromScratch, kit.STEPS, _crash_restore),
        (NoAttemptCheck, kit.RUN_ATTEMPT, _crash_restore),
        (RetiredAnsweredFromCache, kit.RUN_RETIRED, _crash_restore),
        (RepeatRefused, kit.RUN_LIVE, _crash_restore),
        (RepeatRunsAgain, kit.RUN_FINISHED, _crash_restore),
        (StateOutsideBoundary, kit.STATE, _crash_restore),
        (UnindexedSteps, kit.STEPS_INDEXED, _crash_restore),
        (UnnamedModelCalls, kit.MODEL_HEADERS, _crash_restore_with_model),
        (RepeatStartsAnother, kit.RUN_ONE, _crash_restore),
        (StepRunTwice, kit.STEPS_ONCE, _crash_restore),
        (HistoryOutsideBoundary, kit.MODEL_PROMPTS, _crash_restore_with_model),
        (SideEffectReplayed, kit.STEPS_WAIT, _park_all),
        (ReadyWhileAWorkerIsBusy, kit.WORKERS_PARK, _park_all),
        (RestoreMissesAWorker, kit.WORKERS_RESTORE, _crash_restore),
        (RepeatElsewhere, kit.WORKERS_REPEAT, _crash_restore),
    ],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
async def test_the_kit_fails_on_the_broken_rule(
    tmp_path: Path,
    fake: type[Conforming],
    rule: str,
    run_kit: Callable[[type[Conforming], Path], Awaitable[None]],
) -> None:
    """The whole kit (or the crash + restore check) stops at the one rule the fake breaks."""
    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await run_kit(fake, tmp_path)
    assert caught.value.rule == rule, caught.value
    assert str(caught.value).startswith(f"[{rule}] ")


def test_the_kit_is_separate_from_the_package_and_the_harness() -> None:
    """`import rollout_protocol` leaves the kit out; the kit imports no pytest, servers or
    operator."""
    script = (
        "import sys, rollout_protocol\n"
        "assert 'rollout_protocol.conformance' not in sys.modules\n"
        "import rollout_protocol.conformance\n"
        "banned = ('pytest', 'rollout_servers', 'rollout_operator', 'kopf', 'devcluster', "
        "'harness')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.anyio
async def test_a_hold_rearmed_after_the_crash_is_the_drivers_mistake(tmp_path: Path) -> None:
    """The driver arms the fake model's hold again after the crash: the kit says so at once,
    blaming the driver (the test), where the restored episode would otherwise wait on the hold
    until `timeout_s` (60 s here, beyond this test's 30 s limit) and fail as the server's."""

    async def crash_restore() -> None:
        async with _driver(Conforming, tmp_path, RearmingDriver) as driver:
            assert isinstance(driver, ModelDriver)
            await kit.check_crash_restore(
                driver, checkpoint_root=tmp_path, rollout_ids=["r-0"], model=driver.fake_model
            )

    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await crash_restore()
    assert caught.value.rule == kit.DRIVER_HOLDS, caught.value
    assert caught.value.fault == kit.DRIVER_MISTAKE
    assert "not the server's" in str(caught.value)
    assert "hold('r-0/1', attempt=None) armed after the crash of attempt 0" in str(caught.value)


class HoldsAfterTheCrash(InProcessDriver):
    """A driver mistake the kit cannot see directly: its restarted apps hold episodes too, so
    the restored ones never finish."""

    async def restart(self, attempt: int) -> None:
        self.server = self.fake(replace(self.settings, attempt=attempt), hold=True)
        self.served = await start_app(
            self.group, self.server.build(), role=self.settings.role, token=TOKEN
        )


@pytest.mark.anyio
async def test_unfinished_restored_episodes_name_a_holding_driver_as_a_suspect(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        async with _driver(Conforming, tmp_path, HoldsAfterTheCrash) as driver:
            await kit.check_crash_restore(
                driver, checkpoint_root=tmp_path, rollout_ids=["r-0"], timeout_s=0.5
            )
    assert caught.value.rule == kit.STEPS, caught.value
    assert caught.value.fault == f"{kit.PARTICIPANT}, or the driver if it still holds them"
    assert "['r-0'] not finished within 0.5s" in caught.value.observed
    assert caught.value.fix is not None
    assert "first attempt's own rollouts" in caught.value.fix


@pytest.mark.anyio
async def test_the_fake_model_answers_from_the_prompt_and_counts_named_calls(
    tmp_path: Path,
) -> None:
    """Same prompt, same reply (whoever asks); a named call is counted at /stats as
    `call@<key>` of its rollout and attempt, an unnamed one is answered and counted nowhere."""
    model = kit.FakeModel()
    settings = replace(_settings(tmp_path), role=Role.MODEL)
    with anyio.fail_after(30):
        async with kit.serve_app(model.app(settings), role=Role.MODEL, token=TOKEN) as served:
            named = {"X-Rollout-Request": "r-0/3", "X-Rollout-Attempt": "2"}
            replies = []
            for headers in (named, {}):
                reply = await served.client.post(
                    "/v1/completions", json={"prompt": "2+2?"}, headers=headers
                )
                replies.append(reply.json()["choices"][0]["text"])
            other = await served.client.post("/v1/completions", json={"prompt": "3+3?"})
            stats = (await served.client.get("/stats", params={"rollout_id": "r-0"})).json()
    assert replies[0] == replies[1] == kit.echo_reply("2+2?") != other.json()["choices"][0]["text"]
    assert stats["rollouts"] == {"r-0": {"2": {"call@3": {"started": 1, "completed": 1}}}}
    assert [(c.rollout_id, c.key, c.attempt) for c in model.log] == [
        ("r-0", "3", 2),
        (None, None, None),
        (None, None, None),
    ]
    assert model.prompts("r-0", 2) == {"3": "2+2?"}


@pytest.mark.anyio
async def test_a_fake_model_hold_catches_one_call_until_released(tmp_path: Path) -> None:
    """A hold keeps its call waiting (started, not completed) until `release`; it catches one
    call only, and `wait_held` on a call that never comes says so at its deadline."""
    model = kit.FakeModel()
    settings = replace(_settings(tmp_path), role=Role.MODEL)
    named = {"X-Rollout-Request": "r-0/1", "X-Rollout-Attempt": "0"}
    texts: list[str] = []
    with anyio.fail_after(30):
        async with kit.serve_app(model.app(settings), role=Role.MODEL, token=TOKEN) as served:

            async def call() -> None:
                reply = await served.client.post(
                    "/v1/completions", json={"prompt": "p"}, headers=named
                )
                texts.append(reply.json()["choices"][0]["text"])

            model.hold("r-0/1", attempt=0)
            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await model.wait_held("r-0/1", time.time() + WAIT)
                stats = (await served.client.get("/stats", params={"rollout_id": "r-0"})).json()
                assert stats["rollouts"]["r-0"]["0"]["call@1"] == {"started": 1}
                assert texts == []
                model.release("r-0/1")
            await call()  # the hold is spent: answered at once, delivered again
            stats = (await served.client.get("/stats", params={"rollout_id": "r-0"})).json()
            assert stats["rollouts"]["r-0"]["0"]["call@1"] == {
                "started": 1,
                "completed": 1,
                "delivered": 1,
            }
            with pytest.raises(TimeoutError, match="the model call r-0/9 never arrived"):
                await model.wait_held("r-0/9", time.time() + 0.1)
    assert texts == [kit.echo_reply("p")] * 2


@pytest.mark.anyio
async def test_a_runtime_without_observer_is_the_participants_fault(tmp_path: Path) -> None:
    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await _crash_restore(NoObserver, tmp_path)
    assert caught.value.rule == kit.STEPS
    assert caught.value.fault == kit.PARTICIPANT
    assert "observer=counters.observe" in str(caught.value)


@pytest.mark.anyio
async def test_a_runtime_without_observer_fails_with_the_fake_model_in_the_group(
    tmp_path: Path,
) -> None:
    """The fake model's counted calls are not the environment's steps: with it in the group,
    an environment whose runtime has no observer still fails the step rules, saying why (the
    same group with the conforming environment passes: `Conforming` above, with the model)."""
    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await _crash_restore_with_model(NoObserver, tmp_path)
    assert caught.value.rule == kit.STEPS, caught.value
    assert caught.value.fault == kit.PARTICIPANT
    assert str(caught.value).startswith(
        "[steps.no-rerun] environment-0 must count its own steps of the mid-way episodes"
    )
    assert "its episode runtime has no observer" in caught.value.observed
    assert caught.value.fix is not None
    assert "observer=counters.observe" in caught.value.fix


@pytest.mark.anyio
@pytest.mark.parametrize("dialect", list(Dialect), ids=lambda dialect: dialect.value)
async def test_a_control_plane_not_installed_is_named(tmp_path: Path, dialect: Dialect) -> None:
    """No `plane.install(app)`: the first call of the kit (the status route) says the control
    plane is not mounted and how to mount it, not that the workers are unmanaged."""
    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await _whole_kit(NotMounted, tmp_path, dialect)
    assert caught.value.rule == kit.CONTROL_MOUNTED, caught.value
    assert str(caught.value).startswith(
        f"[control.mounted] environment-0 must serve the control routes of the {dialect.value} "
        "dialect"
    )
    assert "HTTP 404" in caught.value.observed
    assert "the control plane is not mounted" in caught.value.observed
    assert caught.value.fix is not None
    assert caught.value.fix.startswith("call plane.install(app) on the app you serve")


@pytest.mark.anyio
async def test_a_participant_that_holds_no_episode_counts_nothing(tmp_path: Path) -> None:
    """The own-steps rule asks its steps of a participant that holds the episodes (it
    committed their records), not of one that holds none: that group passes."""
    with anyio.fail_after(30):
        await _crash_restore_with_model(Conforming, tmp_path, BystanderDriver)


@pytest.mark.anyio
async def test_unnamed_model_calls_are_the_servers_fault_without_model_given(
    tmp_path: Path,
) -> None:
    """The fake model is in the group but not passed as `model=`: the driver's wait for the
    held call gives up on a call without the episode headers, and the kit blames the server
    and names the headers, not the driver."""
    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        async with _driver(UnnamedModelCalls, tmp_path, ModelDriver) as driver:
            await kit.check_crash_restore(
                driver, checkpoint_root=tmp_path, rollout_ids=["r-0", "r-1"], timeout_s=WAIT
            )
    assert caught.value.rule == kit.MODEL_HEADERS, caught.value
    assert caught.value.fault == kit.MODEL_CALLER
    assert caught.value.fault.startswith("the server that calls the model")
    assert "without X-Rollout-Request/X-Rollout-Attempt" in caught.value.observed
    assert caught.value.fix is not None
    assert "X-Rollout-Request: <rollout_id>/<turn> and X-Rollout-Attempt" in caught.value.fix


@pytest.mark.anyio
async def test_an_episode_that_ends_before_its_hold_stops_the_wait(tmp_path: Path) -> None:
    """Episodes of one turn never make the held call `<rollout_id>/1`: the kit gives up the
    driver's wait as soon as they finish (not at its 60 s default deadline) and says why."""

    async def crash_restore() -> None:  # the kit's own timeout_s: 60 s
        async with _driver(OneTurn, tmp_path, ModelDriver) as driver:
            assert isinstance(driver, ModelDriver)
            await kit.check_crash_restore(
                driver, checkpoint_root=tmp_path, rollout_ids=["r-0"], model=driver.fake_model
            )

    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await crash_restore()
    assert caught.value.rule == kit.STEPS, caught.value
    assert caught.value.fault == kit.DRIVER
    assert caught.value.observed == "finished before they were held: ['r-0']"
    assert caught.value.fix is not None
    assert "a task of at least two turns" in caught.value.fix


class HoldsNothing(InProcessDriver):
    """A driver whose episodes are never held (the app holds nothing): its `wait_mid_episode`
    polls until its deadline and then says what it waited for."""

    async def restart(self, attempt: int) -> None:
        self.server = self.fake(replace(self.settings, attempt=attempt), hold=False)
        self.served = await start_app(
            self.group, self.server.build(), role=self.settings.role, token=TOKEN
        )

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        assert self.server is not None
        with anyio.move_on_after(max(0.0, deadline_ts - time.time())):
            await self.server.reached[rollout_ids[0]].wait()
        raise TimeoutError(f"{rollout_ids[0]} never paused before {HOLD_BEFORE}")


@pytest.mark.anyio
async def test_the_kit_reports_the_drivers_diagnostic_at_its_deadline(tmp_path: Path) -> None:
    """The kit's own deadline comes `driver_grace_s` after the driver's: the driver's message
    is what the failure says, not an empty TimeoutError."""

    async def crash_restore() -> None:
        failed: ConformanceError | None = None
        async with anyio.create_task_group() as group:
            driver = HoldsNothing(group, Conforming, _settings(tmp_path))
            await driver.restart(0)
            try:
                await kit.check_crash_restore(
                    driver, checkpoint_root=tmp_path, rollout_ids=["r-0"], timeout_s=0.5
                )
            except ConformanceError as error:
                failed = error  # raised below, outside the task group, as itself
            finally:
                with anyio.CancelScope(shield=True):
                    await driver.close()
        if failed is not None:
            raise failed

    with anyio.fail_after(30), pytest.raises(ConformanceError) as caught:
        await crash_restore()
    assert caught.value.rule == kit.STEPS
    assert "r-0 never paused before s1" in str(caught.value)
