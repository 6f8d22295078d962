"""The kit's report: the rule ids (`RULES`), who can be at fault, and the errors a check raises
(`ConformanceError`) or a driver raises for a refused `/run` (`RunRefused`), with the reply
helpers both need. Every other module of the kit reports through these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import ValidationError

from .._wire import (
    ErrorBody,
)

CONTROL_MOUNTED = "control.mounted"
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
PERSIST_DURABLE = "persist.durable-unchanged"
PERSIST_DISCARD = "persist.discard"


RULES: Mapping[str, str] = {
    CONTROL_MOUNTED: "the participant serves the control routes of the dialect the kit speaks "
    "(ControlPlane.install(app)): its status route answers, not 404",
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
    PERSIST_DURABLE: "a participant that announces persist_after_resume answers a commit asking "
    "for the cut at once, not durable, with the manifest its persist will write; after the "
    "resume its persist answers durable with that same manifest, the records on storage verify "
    "against it (so they are the records as they were at the cut: nothing an episode did after "
    "the cut is in them), and a retried persist answers the same",
    PERSIST_DISCARD: "a discarded cut is released: a persist of it is refused with "
    "stale_checkpoint and no manifest of it exists",
}


"""Every rule id the kit checks, with the rule in one sentence."""


PARTICIPANT = "the participant"
DRIVER = "the driver (your EpisodeDriver, not the server)"
DRIVER_MISTAKE = "the kit's driver: your test's mistake, not the server's"
MODEL_CALLER = "the server that calls the model (the participant under test), not the driver"


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


def _describe(response: httpx.Response) -> str:
    return f"HTTP {response.status_code} {response.text[:300]}"


def _error_body(response: httpx.Response) -> ErrorBody | None:
    try:
        return ErrorBody.model_validate_json(response.content)
    except ValidationError:
        return None
