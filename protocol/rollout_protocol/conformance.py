"""The conformance kit: checks the protocol rules every checkpoint participant must keep.

A server author runs it from their own tests against a running participant (a base URL and the
control token) or against their ASGI app in process. Each check is named by a rule id (`RULES`);
a broken rule raises `ConformanceError` (an `AssertionError`, so pytest shows it as a failure)
whose message names the rule, what was expected and what was observed.

Entry points (all async; run them on asyncio, e.g. `@pytest.mark.anyio` with the asyncio backend:
the participant client is aiohttp's):

* `check_participant(target, checkpoint_root=..., lease_grace_seconds=...)` runs every
  single-participant check in order: `auth.every-route`, `bodies.strict`, `phases.replay` and
  `phases.resume-idle`, `ids.stale`, `ids.conflicting`, `persist.durable-unchanged` and
  `persist.discard` (a participant that announces `persist_after_resume`: a cut, the resume,
  the persist of exactly the cut's records; a discarded cut),
  `restore.all-or-nothing` (on the records
  the phases check committed) and `lease.auto-resume`. Each check is also a function of its own
  (`check_auth`, `check_strict_bodies`, `check_phases`, `check_stale_ids`,
  `check_conflicting_ids`, `check_persist_after_resume`, `check_lease_auto_resume`,
  `check_restore_all_or_nothing`).
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
it says the driver) and, where the kit knows, what to change. A participant whose control routes
answer 404 (no `plane.install(app)`) fails `control.mounted`, whichever check reached it first.
The step rules read every participant's own counters: each participant that holds the held
episodes (its commit wrote their records), and at least one that is not a model, must count
their steps (a model's counted calls do not stand in for them).

This module is the kit's public surface only; the kit itself is the private package
`rollout_protocol._conformance`, one module per concern: the report (`report`: rules and
errors), the connections (`calls`), the scenarios by group (`refusals`, `phases`, `persist`,
`workers`, `lease`, `restore`, `park`, `crash`, with `drivers`, `counters` and `model` for the crash
scenarios), the single-participant runner (`participant`) and in-process serving (`serving`).
The kit imports nothing beyond
the contract's own dependencies, uvicorn (which serves in-process apps) and aiohttp (the
coordinator's client): the `kit` extra; no pytest. `import rollout_protocol` does not import it.
"""

from __future__ import annotations

from ._conformance.calls import Target
from ._conformance.crash import check_crash_restore
from ._conformance.drivers import EpisodeDriver, StepHoldingDriver
from ._conformance.lease import check_lease_auto_resume
from ._conformance.park import check_park_all, check_workers_park_all
from ._conformance.participant import check_participant
from ._conformance.persist import check_persist_after_resume
from ._conformance.phases import check_conflicting_ids, check_phases, check_stale_ids
from ._conformance.refusals import check_auth, check_strict_bodies
from ._conformance.report import (
    AUTH,
    BODIES,
    CONFLICTING,
    CONTROL_MOUNTED,
    DRIVER_HOLDS,
    LEASE,
    MODEL_HEADERS,
    MODEL_PROMPTS,
    PERSIST_DISCARD,
    PERSIST_DURABLE,
    PHASES_REPLAY,
    PHASES_RESUME,
    RESTORE,
    RULES,
    RUN_ATTEMPT,
    RUN_FINISHED,
    RUN_LIVE,
    RUN_ONE,
    RUN_RETIRED,
    STALE,
    STATE,
    STEPS,
    STEPS_INDEXED,
    STEPS_ONCE,
    STEPS_WAIT,
    UNINTERRUPTED_SUFFIX,
    WORKERS_MANAGED,
    WORKERS_PARK,
    WORKERS_PRIVATE,
    WORKERS_REPEAT,
    WORKERS_RESTORE,
    WORKERS_SPREAD,
    ConformanceError,
    RunRefused,
    base_rollout_id,
)

# Public names outside `__all__`, as before: who a failure blames (`ConformanceError.fault`)
# and the rule of `check_crash_restore(..., restarting=True)`.
from ._conformance.report import DRIVER as DRIVER
from ._conformance.report import DRIVER_MISTAKE as DRIVER_MISTAKE
from ._conformance.report import MODEL_CALLER as MODEL_CALLER
from ._conformance.report import PARTICIPANT as PARTICIPANT
from ._conformance.report import STEPS_RESTARTED as STEPS_RESTARTED
from ._conformance.restore import check_restore_all_or_nothing
from ._conformance.serving import ServedApp, serve_app, start_app
from ._conformance.workers import check_workers, rollout_ids_per_worker
from ._fake_model import FakeModel, ModelCall, UnnamedModelCall, echo_reply

__all__ = [
    "AUTH",
    "BODIES",
    "CONFLICTING",
    "CONTROL_MOUNTED",
    "DRIVER_HOLDS",
    "LEASE",
    "MODEL_HEADERS",
    "MODEL_PROMPTS",
    "PERSIST_DISCARD",
    "PERSIST_DURABLE",
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
    "UnnamedModelCall",
    "base_rollout_id",
    "check_auth",
    "check_conflicting_ids",
    "check_crash_restore",
    "check_lease_auto_resume",
    "check_park_all",
    "check_participant",
    "check_persist_after_resume",
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
