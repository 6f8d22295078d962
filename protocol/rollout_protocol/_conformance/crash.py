"""Scenario crash and restore, `check_crash_restore`: episodes checkpointed mid-way, the group
crashed and restarted under attempt + 1, the checkpoint restored (after damaged copies are
refused), the episodes finished and compared with uninterrupted runs, with every `/run` duty
on the way. The scenario runs in stages, each a function of `_CrashRun` (what the stages
share).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from .._coordinator import CommitOutcome, Coordinator
from .._fake_model import FakeModel
from .._routes import Dialect
from .._stages import SEQUENTIAL_STAGES, PrepareStages
from .._wire import (
    Capability,
    ErrorCode,
    Phase,
)
from .calls import Target, _Conn, _connect, _expect, _new_id
from .counters import (
    _check_model_counts,
    _check_once,
    _check_one_episode,
    _check_own_steps,
    _check_restarted,
    _check_restored_workers,
    _compare_counts,
    _counters,
    _Counts,
    _ran,
    _Repeat,
    _watch_repeats,
)
from .drivers import EpisodeDriver, _run_all, _run_refused
from .model import (
    _check_driver_holds,
    _check_fake_model_headers,
    _check_prompts,
    _check_unnamed_wait,
)
from .report import (
    DRIVER,
    PARTICIPANT,
    PERSIST_DURABLE,
    PHASES_RESUME,
    RESTORE,
    RUN_ATTEMPT,
    RUN_FINISHED,
    RUN_LIVE,
    RUN_RETIRED,
    STATE,
    STEPS,
    STEPS_RESTARTED,
    UNINTERRUPTED_SUFFIX,
    WORKERS_REPEAT,
    WORKERS_RESTORE,
    ConformanceError,
    RunRefused,
)
from .restore import check_restore_all_or_nothing
from .workers import _check_spread, _held_by, _multi_worker


@dataclass
class _FirstRuns:
    crashed: bool = False
    failures: dict[str, str] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    ended: anyio.Event = field(default_factory=anyio.Event)
    """Set when a first run ends (answered or failed) before the crash: nothing holds it."""


_VOLATILE_KEYS = ("rollout_id", "attempt", "continued_from", "continued")


def _strip(result: Any, volatile: Collection[str]) -> Any:
    if isinstance(result, dict):
        return {key: value for key, value in result.items() if key not in volatile}
    return result


@dataclass
class _CrashRun:
    """What the stages of one `check_crash_restore` share: its arguments, then the group's
    attempt before the crash and the checkpoint taken in it (with the step counters then)."""

    driver: EpisodeDriver
    rids: list[str]
    cid: str
    checkpoint_root: Path
    timeout_s: float
    call_timeout_s: float
    repeat_window_s: float
    driver_grace_s: float
    volatile_keys: Collection[str]
    model: FakeModel | None
    poll_interval_s: float
    restarting: bool
    """Every episode is a restart at prepare (`steps.restarted` instead of `steps.no-rerun`)."""
    attempt: int = 0
    before: dict[str, _Counts] = field(default_factory=dict)
    commit: CommitOutcome | None = None


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
    run = _CrashRun(
        driver=driver,
        rids=rids,
        cid=_new_id("crash"),
        checkpoint_root=checkpoint_root,
        timeout_s=timeout_s,
        call_timeout_s=call_timeout_s,
        repeat_window_s=repeat_window_s,
        driver_grace_s=driver_grace_s,
        volatile_keys=volatile_keys,
        model=model,
        poll_interval_s=poll_interval_s,
        restarting=restarting,
    )
    await _checkpoint_then_crash(run)  # 1-3
    await _restart_then_restore(run)  # 3-9


async def _restart_then_restore(run: _CrashRun) -> None:
    """Stages 3-9: the crashed group restarted under N + 1, the checkpoint restored, and the
    restored episodes run to their end, repeated, compared and retired."""
    await run.driver.restart(run.attempt + 1)
    _check_driver_holds(run.model)
    targets = list(run.driver.participants())
    async with _connect(targets, run.call_timeout_s) as conns:
        coordinator, workers = await _restore_after_crash(run, targets, conns)  # 4
        results, after = await _finish_restored(run, conns, workers)  # 5-6
        await _repeat_finished(run, conns, workers, results, after)  # 7
        await _compare_with_uninterrupted(run, conns, results)  # 8
        await _retire_first(run, coordinator)  # 9


async def _checkpoint_then_crash(run: _CrashRun) -> None:
    """Stages 1-3: episodes under the group's attempt held mid-way, checkpointed, their
    `/run` repeated while held, then the group crashed (`run.attempt`, `run.before`,
    `run.commit` are set on the way)."""
    driver, rids, model = run.driver, run.rids, run.model
    runs = _FirstRuns()
    model_calls_from = 0 if model is None else len(model.log)
    async with _connect(driver.participants(), run.call_timeout_s) as conns:
        statuses = [await conn.status(STEPS) for conn in conns]
        _check_spread(statuses, rids)
        workers = _multi_worker(conns, statuses)
        # with several workers, every worker's episode is repeated (`workers.repeat-run`)
        repeated = rids if workers else rids[:1]
        repeats = {rid: _Repeat() for rid in repeated}
        attempts = {status.attempt for status in statuses}
        _expect(STEPS, len(attempts) == 1, "the group must run one attempt", sorted(attempts))
        run.attempt = attempt = attempts.pop()

        coordinator = Coordinator(
            [conn.participant for conn in conns], call_timeout=run.call_timeout_s
        )
        broke: ConformanceError | None = None  # raised outside the task group, as itself
        async with anyio.create_task_group() as episodes:
            try:
                for rid in rids:
                    episodes.start_soon(_first_run, driver, runs, rid, attempt)
                await _wait_mid_episode(run, runs, model_calls_from)
                held_counts = {c.target.name: await _counters(c, repeated) for c in conns}
                # The repeated /run goes out before the checkpoint, whose round trips to the
                # same servers give it time to be refused (a window that grows with their load).
                for rid in repeated:
                    episodes.start_soon(_repeated_run, driver, runs, repeats[rid], rid, attempt)
                run.before, run.commit = await _checkpoint(
                    coordinator,
                    conns,
                    run.cid,
                    rids,
                    run.call_timeout_s,
                    run.restarting,
                    cut=all(Capability.PERSIST_AFTER_RESUME in s.capabilities for s in statuses),
                    stages=coordinator.stages(statuses),
                )
                before = run.before
                records = {
                    conn.target.name: run.commit.manifests[status.instance].record_count
                    for conn, status in zip(conns, statuses, strict=True)
                    if status.instance in run.commit.manifests
                }
                _check_own_steps(conns, before, rids, attempt, records)
                _check_one_episode(held_counts, before, repeated, attempt, workers)
                _check_model_counts(conns, before, rids, attempt)
                if model is not None:
                    _check_fake_model_headers(model, model_calls_from, rids, attempt)
                await _watch_repeats(
                    conns,
                    held_counts,
                    repeats,
                    attempt,
                    workers,
                    run.repeat_window_s,
                    run.poll_interval_s,
                )
                _check_once(before, rids)
                _check_repeats_attached(run, repeats, workers)
                runs.crashed = True
                await driver.crash()
                if model is not None:
                    model.end_holds(attempt)
            except ConformanceError as error:
                broke = error
            episodes.cancel_scope.cancel()
        if broke is not None:
            raise broke


async def _first_run(driver: EpisodeDriver, runs: _FirstRuns, rid: str, attempt: int) -> None:
    """Stage 1: the first `/run` of `rid`, its end before the crash noted in `runs`."""
    try:
        await driver.run_episode(rid, attempt)
    except Exception as error:
        if not runs.crashed:
            runs.failures[rid] = f"{type(error).__name__}: {error}"
            runs.ended.set()
    else:
        if not runs.crashed:
            runs.finished.append(rid)
            runs.ended.set()


async def _repeated_run(
    driver: EpisodeDriver, runs: _FirstRuns, repeat: _Repeat, rid: str, attempt: int
) -> None:
    """Stage 2: the repeated `/run` of held `rid`; how it ended is noted in `repeat`."""
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


async def _wait_mid_episode(run: _CrashRun, runs: _FirstRuns, model_calls_from: int) -> None:
    """Stage 1: the driver's `wait_mid_episode`, its own deadline first (its message is the
    diagnostic); once an episode ends (answered or failed: nothing can hold it any more) the
    wait is given up `driver_grace_s` later, unless the driver says first what it waited for.
    Then every episode must still be running."""
    rids, attempt, model = run.rids, run.attempt, run.model
    mid_deadline = time.time() + run.timeout_s
    raised: Exception | None = None
    returned = False
    with anyio.move_on_after(run.timeout_s + run.driver_grace_s):
        async with anyio.create_task_group() as watching:

            async def episode_ended() -> None:
                await runs.ended.wait()
                ended_by = anyio.current_time() + run.driver_grace_s
                watching.cancel_scope.deadline = min(watching.cancel_scope.deadline, ended_by)

            watching.start_soon(episode_ended)
            try:  # the driver's own deadline comes first: its message is the diagnostic
                await run.driver.wait_mid_episode(rids, mid_deadline)
            except Exception as error:
                raised = error
            else:
                returned = True
            watching.cancel_scope.cancel()
    if model is not None:  # a server that names no call cannot be held
        _check_fake_model_headers(model, model_calls_from, rids, attempt, False)
    if raised is not None:
        _check_unnamed_wait(raised, rids, attempt)
        raise ConformanceError(
            STEPS,
            f"episodes {rids} must reach the middle under attempt {attempt}",
            f"wait_mid_episode raised {type(raised).__name__}: {raised}; episode "
            f"failures: {runs.failures}",
            fault=f"{DRIVER}, or the participant if the episodes failed",
        ) from raised
    if not returned and runs.ended.is_set():
        _episode_ended_unheld(run, runs)
    if not returned:
        raise ConformanceError(
            STEPS,
            f"episodes {rids} must reach the middle under attempt {attempt}",
            f"wait_mid_episode neither returned nor raised within {run.driver_grace_s}s "
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


def _episode_ended_unheld(run: _CrashRun, runs: _FirstRuns) -> None:
    """Stage 1, given up: an episode ended while `wait_mid_episode` still waited for it to be
    held. A failed one is the participant's; one that finished had nothing the driver holds
    (an episode of one turn never makes the call `<rollout_id>/1`)."""
    expected = (
        f"episodes {run.rids} must stay mid-way under attempt {run.attempt} until the crash "
        f"(wait_mid_episode was given up {run.driver_grace_s}s after one ended: nothing can "
        "hold it any more)"
    )
    if runs.failures:
        raise ConformanceError(STEPS, expected, f"failed before they were held: {runs.failures}")
    raise ConformanceError(
        STEPS,
        expected,
        f"finished before they were held: {runs.finished}",
        fault=DRIVER,
        fix="hold a call every episode makes before its end: give the driver a task of at "
        "least two turns, or hold an earlier call (with the kit's FakeModel, hold "
        "'<rollout_id>/<key>' of a call the episode still makes)",
    )


def _check_repeats_attached(
    run: _CrashRun, repeats: Mapping[str, _Repeat], workers: Mapping[str, int]
) -> None:
    """Stage 2: a repeated `/run` of a held episode must still be attached to it, neither
    refused nor answered (`run.repeat-live`; `workers.repeat-run` in every other worker)."""
    for rid, repeat in repeats.items():
        if repeat.outcome is None:
            continue
        raise ConformanceError(
            RUN_LIVE if rid == run.rids[0] else WORKERS_REPEAT,
            f"a repeated /run of the live episode {rid}@{run.attempt}"
            f"{_held_by(rid, workers)} must attach to it",
            repeat.outcome,
            fault=DRIVER if repeat.driver_error else PARTICIPANT,
            fix="raise RunRefused for an error reply"
            if repeat.driver_error
            else "when runtime.find(rollout_id) is live under this attempt (and task), "
            "await episode.ended.wait() and answer the result it finished with",
        )


async def _restore_after_crash(
    run: _CrashRun, targets: Sequence[Target], conns: Sequence[_Conn]
) -> tuple[Coordinator, dict[str, int]]:
    """Stage 4: the restarted group idle under attempt + 1; damaged copies refused, then the
    checkpoint restored in full and resumed. The coordinator and the multi-worker targets."""
    attempt, cid = run.attempt, run.cid
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
        checkpoint_root=run.checkpoint_root,
        checkpoint_id=cid,
        attempt=attempt + 1,
        call_timeout_s=run.call_timeout_s,
    )
    coordinator = Coordinator([conn.participant for conn in conns], call_timeout=run.call_timeout_s)
    assert run.commit is not None, "the checkpoint was committed before the crash"
    # a Gym participant's restore names the rollouts its commit listed (`listed`)
    restored = await coordinator.restore(
        cid, attempt + 1, time.time() + run.call_timeout_s, run.rids, listed=run.commit.listed
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
    for instance, manifest in run.commit.manifests.items():
        _expect(
            WORKERS_RESTORE if instance in pooled else RESTORE,
            restored.restored.get(instance) == manifest.record_count,
            f"{instance} must install the {manifest.record_count} records it committed"
            + (" (in every worker)" if instance in pooled else ""),
            restored.restored.get(instance),
        )
    resumed = await coordinator.resume(cid, time.time() + run.call_timeout_s)
    _expect(
        PHASES_RESUME,
        not resumed.failures,
        f"resume of restored {cid} must succeed everywhere",
        "; ".join(str(failure) for failure in resumed.failures),
    )
    return coordinator, workers


async def _finish_restored(
    run: _CrashRun, conns: Sequence[_Conn], workers: Mapping[str, int]
) -> tuple[dict[str, Any], dict[str, _Counts]]:
    """Stages 5-6: `/run` under N + 2 and N refused, then every restored episode run to its
    end under N + 1 and the counters compared with those at the checkpoint. The results, and
    the counters after."""
    driver, rids, attempt, model = run.driver, run.rids, run.attempt, run.model
    mismatch = {ErrorCode.ATTEMPT_MISMATCH.value: 409}
    await _run_refused(
        driver, RUN_ATTEMPT, rids[0], attempt + 2, mismatch, "an attempt not running yet"
    )
    _check_driver_holds(model)
    old = {**mismatch, ErrorCode.ATTEMPT_RETIRED.value: 410}
    await _run_refused(driver, RUN_ATTEMPT, rids[0], attempt, old, "the crashed attempt")
    _check_driver_holds(model)
    results = await _run_all(driver, rids, attempt + 1, run.timeout_s, "restored episode", model)
    after = {conn.target.name: await _counters(conn, rids) for conn in conns}
    _check_restored_workers(workers, run.before, after, rids, attempt)
    if run.restarting:
        _check_restarted(run.before, after, rids, attempt)
    else:
        _compare_counts(run.before, after, rids, attempt)
    _check_once(after, rids)
    started = {name: _ran(counts, rids[0], attempt + 2) for name, counts in after.items()}
    _expect(
        RUN_ATTEMPT,
        not any(started.values()),
        f"the refused /run {rids[0]}@{attempt + 2} must start nothing",
        f"steps counted under attempt {attempt + 2}: {started}",
    )
    return results, after


async def _repeat_finished(
    run: _CrashRun,
    conns: Sequence[_Conn],
    workers: Mapping[str, int],
    results: Mapping[str, Any],
    after: Mapping[str, _Counts],
) -> None:
    """Stage 7: a repeated `/run` of a finished episode answers its result and runs no step
    (`run.repeat-finished`; `workers.repeat-run` in every other worker)."""
    rids, attempt = run.rids, run.attempt
    repeated = rids if workers else rids[:1]
    again = await _run_all(
        run.driver, repeated, attempt + 1, run.timeout_s, "repeated /run", run.model
    )
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


async def _compare_with_uninterrupted(
    run: _CrashRun, conns: Sequence[_Conn], results: Mapping[str, Any]
) -> None:
    """Stage 8: `<id>-uninterrupted` run under N + 1; the restored episodes must end as they
    did (`state.in-boundary`) and, with the kit's model, ask its prompts
    (`model.same-prompts`)."""
    rids, attempt, model, volatile_keys = run.rids, run.attempt, run.model, run.volatile_keys
    twin_ids = [rid + UNINTERRUPTED_SUFFIX for rid in rids]
    twins = await _run_all(
        run.driver, twin_ids, attempt + 1, run.timeout_s, "uninterrupted episode", model
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


async def _retire_first(run: _CrashRun, coordinator: Coordinator) -> None:
    """Stage 9: the first rollout retired under N + 1; its `/run` must be refused with 410
    (`run.retired`)."""
    rids, attempt = run.rids, run.attempt
    retired = await coordinator.retire(attempt + 1, rids[:1], time.time() + run.call_timeout_s)
    _expect(
        RUN_RETIRED,
        not retired.failures,
        f"the retire of {rids[0]}@{attempt + 1} must succeed",
        "; ".join(str(failure) for failure in retired.failures),
    )
    await _run_refused(
        run.driver,
        RUN_RETIRED,
        rids[0],
        attempt + 1,
        {ErrorCode.ATTEMPT_RETIRED.value: 410},
        "retired",
    )


async def _checkpoint(
    coordinator: Coordinator,
    conns: Sequence[_Conn],
    cid: str,
    rids: Sequence[str],
    call_timeout_s: float,
    restarting: bool = False,
    *,
    cut: bool = False,
    stages: PrepareStages = SEQUENTIAL_STAGES,
) -> tuple[dict[str, _Counts], CommitOutcome]:
    """prepare, commit (scope: the rollouts), read the counters while parked, resume. With
    `cut` (every participant announces `persist_after_resume`) the commit is the cut and its
    records are persisted after the resume (`persist.durable-unchanged`): the crash then
    restores what the persist wrote. The prepare runs in `stages`, the ones the participants'
    declared waits make (`Coordinator.stages`), as an operator prepares them: a server that
    leaves out a role it waits on from wait-mode steps may fail `steps` here with its episodes
    parked in the wrong order (docs/protocol.md, "Prepare stages").

    Participants that all speak NeMo Gym's dialect are checkpointed without a requested scope
    (Gym's prepare lists no episodes to agree one from): every parked episode, which must be
    exactly the rollouts, none restarting. With `restarting`, every rollout must be a restart
    and none captured (`check_crash_restore`)."""
    gym_only = all(conn.target.dialect is Dialect.GYM for conn in conns)
    try:
        prepared = await coordinator.prepare(
            cid, time.time() + call_timeout_s, scope=None if gym_only else rids, stages=stages
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
                f"scope {scope}, restarts {sorted(str(e) for e in prepared.restarts)}",
            )
        else:
            _expect(
                STEPS,
                captured and not prepared.restarts,
                f"every episode must be captured by {cid} (none restarting)",
                f"scope {scope}, {prepared.episode_count} parked, "
                f"restarts {sorted(str(e) for e in prepared.restarts)}",
            )
        commit = await coordinator.commit(
            cid, time.time() + call_timeout_s, scope, persist_after_resume=cut
        )
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
    if commit.held:
        commit = await _persisted(coordinator, cid, commit, call_timeout_s)
    return before, commit


async def _persisted(
    coordinator: Coordinator, cid: str, cut: CommitOutcome, call_timeout_s: float
) -> CommitOutcome:
    """The persist of a cut after the resume: durable, with the manifests the cut answered."""
    persisted = await coordinator.persist(cid, time.time() + call_timeout_s, cut=cut)
    _expect(
        PERSIST_DURABLE,
        persisted.ok and persisted.manifests == cut.manifests,
        f"the persist of {cid} after the resume must make durable the manifests its cut answered",
        "; ".join(str(f) for f in persisted.failures) or "other manifests",
    )
    return persisted
