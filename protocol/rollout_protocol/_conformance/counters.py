"""The step counters a participant serves (`GET /stats?rollout_id=...`, the shape of
`StepCounters.snapshot`) and the rules checked on them: every participant but a model counts
its own steps, `steps.no-rerun`, `steps.indexed`,
`steps.once-per-attempt`, `run.repeat-one-episode`, `run.repeat-live` while held,
`model.headers` on a model's counts and `workers.restore-all`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import httpx
from pydantic import TypeAdapter, ValidationError

from .._wire import (
    Role,
)
from .._workers import owner
from .calls import _Conn, _expect
from .report import (
    DRIVER,
    MODEL_CALLER,
    MODEL_HEADERS,
    RUN_ONE,
    STEPS,
    STEPS_INDEXED,
    STEPS_ONCE,
    STEPS_RESTARTED,
    WORKERS_RESTORE,
    ConformanceError,
    _describe,
)
from .workers import _held_by

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
class _Repeat:
    """The outcome of the repeated `/run` of a held episode (`run.repeat-live`)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: str | None = None
    driver_error: bool = False


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
                fault=MODEL_CALLER,
                fix="send X-Rollout-Request: <rollout_id>/<turn> and X-Rollout-Attempt: "
                "<attempt> on every model call",
            )


def _check_own_steps(
    conns: Sequence[_Conn],
    before: Mapping[str, _Counts],
    rids: Sequence[str],
    attempt: int,
    records: Mapping[str, int],
) -> None:
    """The step rules (`steps.no-rerun`, `run.repeat-one-episode`, `steps.once-per-attempt`)
    read each participant's own steps, so by the checkpoint every participant that holds the
    mid-way episodes (`records`: target name -> records its commit wrote) must have counted
    steps of them, and so must at least one participant that is not a model. A model's
    counters hold the calls it served (the kit's `FakeModel` counts `call@<key>`), never an
    episode's own steps: they cannot stand in for a participant whose runtime has no observer.
    A participant that holds no episode of its own (a Gym resources server, whose sessions the
    environment rebuilds) has nothing to count."""

    def counted(conn: _Conn) -> bool:
        return any(_ran(before[conn.target.name], rid, attempt) for rid in rids)

    for conn in conns:
        held = records.get(conn.target.name, 0)
        if held > 0 and not counted(conn):
            raise _uncounted(conn, before, rids, attempt, f"its commit wrote {held} records")
    others = [conn for conn in conns if conn.target.role is not Role.MODEL]
    if others and not any(counted(conn) for conn in others):
        raise _uncounted(others[0], before, rids, attempt, "no participant but a model counted any")


def _uncounted(
    conn: _Conn, before: Mapping[str, _Counts], rids: Sequence[str], attempt: int, why: str
) -> ConformanceError:
    """The step rules cannot read `conn`'s own steps of the episodes (`_check_own_steps`)."""
    return ConformanceError(
        STEPS,
        f"{conn.target.name} must count its own steps of the mid-way episodes {rids} under "
        f"attempt {attempt} at GET {conn.target.stats_path} by the checkpoint: the step rules "
        "(steps.no-rerun, run.repeat-one-episode, steps.once-per-attempt) read them there, "
        "and a model's counted calls are not the episode's steps",
        f"its counters for them: {before[conn.target.name]} ({why}); the kit cannot count its "
        "steps (its episode runtime has no observer, or its stats route serves other counters)",
        fix="create the EpisodeRuntime with observer=counters.observe (counters = "
        "StepCounters(role)) and serve counters.snapshot(rollout_ids, False) at GET /stats "
        "(docs/sdk.md, section 4)",
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
