"""The checkpoint coordinator, independent of Kubernetes.

It drives the participants through prepare, commit, publish and resume (or, persisting after
the resume, prepare, the cut, resume, persist and publish), and through an all-or-nothing
restore, in the orders of docs/design.md#44-order (prepare and retire in stages,
callers before callees; commit, restore and resume to everyone at once). The steps are separate
methods because the operator persists its state between them (to survive its own restart);
`checkpoint()` composes them for callers without an operator (the CLI, Slurm jobs, tests).

The coordinator is the steps; its parts are modules of their own: the outcome models the steps
return (`_coordinator_outcomes.py`, importable from here as before), the fan-out of calls to
participants (`_coordinator_calls.py`), the cut's commit and the persist and discard that follow
it (`_coordinator_persist.py`), and the composed checkpoint (`_coordinator_checkpoint.py`).

Participants are reached through the small `ParticipantClient` protocol; `HttpParticipantClient`
is the real one. Every step returns an outcome model (pydantic, so it can be stored as JSON) that
names each participant's failure instead of raising half way: a coordinator that stops in the
middle would leave work parked until the leases lapse.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Final

import anyio
from anyio.abc import TaskGroup

from . import _storage as storage
from ._client import ParticipantClient, ParticipantError
from ._coordinator_calls import FanOut, split
from ._coordinator_checkpoint import ComposedCheckpoint
from ._coordinator_outcomes import (
    CheckpointDurations,
    CheckpointResult,
    CommitOutcome,
    DiscardOutcome,
    Failure,
    ForgetOutcome,
    LostWork,
    PrepareOutcome,
    RestoreOutcome,
    ResumeOutcome,
    RetireOutcome,
    StatusOutcome,
)
from ._coordinator_persist import commit_or_cut, commit_outcome, discard_cut, persist_cut
from ._stages import SEQUENTIAL_STAGES, PrepareStages, prepare_stages
from ._wire import (
    MAX_BLOCKERS_REPORTED,
    MAX_FINISHED_LISTED,
    PREPARE_ORDER,
    RETIRE_ORDER,
    CommitRequest,
    EpisodeId,
    ErrorCode,
    ForgetRequest,
    PrepareReply,
    PrepareRequest,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
    StatusReply,
)

__all__ = [
    "CheckpointDurations",
    "CheckpointResult",
    "CommitOutcome",
    "Coordinator",
    "DiscardOutcome",
    "Failure",
    "ForgetOutcome",
    "LostWork",
    "PrepareOutcome",
    "RestoreOutcome",
    "ResumeOutcome",
    "RetireOutcome",
    "StatusOutcome",
]

logger = logging.getLogger(__name__)

LOST_ON_RENEW: Final = frozenset(
    {
        ErrorCode.STALE_CHECKPOINT,
        ErrorCode.UNKNOWN_CHECKPOINT,
        ErrorCode.WRONG_PHASE,
        ErrorCode.CONFLICTING_CHECKPOINT,
    }
)
"""A prepared participant's refusals of a renew that say it no longer holds the checkpoint.
Ours says `stale_checkpoint` or `unknown_checkpoint`; one that speaks NeMo Gym's dialect says
`invalid_phase` (none open: a restarted process) or `checkpoint_conflict` (another one open),
read as `wrong_phase` and `conflicting_checkpoint` (docs/protocol.md, "The NeMo Gym dialect").
Our participants never refuse a renew of the open checkpoint with those two."""


# --- the coordinator ------------------------------------------------------------------------


class Coordinator:
    """Runs the protocol across participants; holds no state between steps."""

    def __init__(
        self,
        participants: Sequence[ParticipantClient],
        *,
        clock: Callable[[], float] = time.time,
        renew_interval: float = 2.0,
        call_timeout: float = 30.0,
        missed_call_seconds: float = 2.0,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        if not participants:
            raise ValueError("a coordinator needs at least one participant")
        instances = [participant.instance for participant in participants]
        duplicates = sorted({name for name in instances if instances.count(name) > 1})
        if duplicates:
            raise ValueError(f"participants listed twice: {', '.join(duplicates)}")
        self._participants = list(participants)
        self._clock = clock
        self._renew_interval = renew_interval
        self._call_timeout = call_timeout
        self._fan_out = FanOut(missed_call_seconds)
        self._on_progress = on_progress

    @property
    def participants(self) -> list[ParticipantClient]:
        return list(self._participants)

    def _progress(self, message: str) -> None:
        logger.info("%s", message)
        if self._on_progress is not None:
            self._on_progress(message)

    def _stage(self, roles: Collection[Role]) -> list[ParticipantClient]:
        return [p for p in self._participants if p.role in roles]

    # status -----------------------------------------------------------------------------------

    async def status(self, deadline_ts: float) -> StatusOutcome:
        results = await self._fan_out(self._participants, lambda p: p.status(deadline_ts))
        replies, failures = split(self._participants, results)
        return StatusOutcome(statuses=replies, failures=failures)

    # prepare ----------------------------------------------------------------------------------

    def stages(self, statuses: Collection[StatusReply]) -> PrepareStages:
        """The prepare's stages from the waits the participants declared in `statuses` (a
        participant without a status there declared nothing; `_stages.prepare_stages`)."""
        declared = {status.instance: status.waits_on for status in statuses}
        return prepare_stages((p.role, declared.get(p.instance)) for p in self._participants)

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        *,
        scope: Collection[str] | None = None,
        stages: PrepareStages = SEQUENTIAL_STAGES,
    ) -> PrepareOutcome:
        """Prepare stage by stage (`stages`: by default one role per stage in PREPARE_ORDER;
        `stages()` makes fewer from what the participants declared), stopping at the first
        stage not ready.

        The replies carry counts and digests; with `scope` (a requested commit scope) they
        also list the parked episodes among it, so `PrepareOutcome.scope` can intersect it.

        While a later stage parks, the leases of the stages already prepared are renewed; a
        renew that finds the checkpoint gone there (lease lapsed, process restarted) ends the
        prepare at once instead of waiting for a checkpoint that can no longer commit.
        """
        request = PrepareRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            rollout_ids=None if scope is None else sorted(set(scope)),
        )
        replies: dict[str, PrepareReply] = {}
        failures: list[Failure] = []
        lost: list[Failure] = []
        prepared: list[ParticipantClient] = []
        stopped_at: Role | None = None
        current: Role | None = None
        over = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(
                self._renew_while_preparing, checkpoint_id, deadline_ts, prepared, lost, over, group
            )
            for roles in stages:
                stage = self._stage(roles)
                if not stage:
                    continue
                current = stage[0].role
                self._progress(f"prepare {'+'.join(roles)}: {len(stage)} participant(s)")
                results = await self._fan_out(stage, lambda p: _prepare(p, request))
                stopped_at = _first_not_ready(stage, results, replies, failures)
                if stopped_at is not None:
                    break
                prepared.extend(stage)
            # the renew loop may already be runnable; the event stops it from renewing anyone
            # (the last stage included) after prepare has ended
            over.set()
            group.cancel_scope.cancel()
        if lost:
            failures.extend(lost)
            stopped_at = stopped_at or current
        outcome = _prepare_outcome(checkpoint_id, replies, prepared, stopped_at, failures)
        if outcome.ready:
            self._progress(
                f"prepared: {outcome.episode_count} episodes, {len(outcome.restarts)} restarts"
            )
        else:
            role_name = stopped_at.value if stopped_at is not None else "?"
            self._progress(
                f"prepare stopped at {role_name}: {outcome.blocker_count} blockers, "
                f"{len(outcome.failures)} failures"
            )
        return outcome

    async def _renew_while_preparing(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        prepared: list[ParticipantClient],
        lost: list[Failure],
        over: anyio.Event,
        group: TaskGroup,
    ) -> None:
        request = RenewRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        while True:
            with anyio.move_on_after(self._renew_interval):
                await over.wait()
            if over.is_set() or self._clock() >= deadline_ts:
                return
            targets = list(prepared)
            if not targets:
                continue
            results = await self._fan_out(targets, lambda p: p.renew(request))
            for instance, result in results.items():
                if isinstance(result, ParticipantError) and result.code in LOST_ON_RENEW:
                    lost.append(Failure.of(result))
                elif isinstance(result, ParticipantError):
                    logger.warning("renew of %s failed: %s", instance, result)
            if lost:
                self._progress(f"checkpoint lost by {', '.join(f.instance for f in lost)}")
                group.cancel_scope.cancel()
                return

    async def renew(
        self, checkpoint_id: str, deadline_ts: float, *, only: Collection[str] | None = None
    ) -> list[Failure]:
        """Extend the leases (of `only` these instances) to `deadline_ts` + grace."""
        request = RenewRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        targets = [p for p in self._participants if only is None or p.instance in only]
        results = await self._fan_out(targets, lambda p: p.renew(request))
        return [Failure.of(r) for r in results.values() if isinstance(r, ParticipantError)]

    # commit -----------------------------------------------------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        scope: Collection[str] | None,
        *,
        excluded: Collection[str] = (),
        persist_after_resume: bool = False,
    ) -> CommitOutcome:
        """Commit everywhere at once with the given scope (see `PrepareOutcome.scope`), leaving
        out `excluded` (`PrepareOutcome.excluded`).

        With `persist_after_resume`, the cut: each participant that can fixes its records in
        memory and answers at once with the manifest a `persist` will write (its instance is
        then in `CommitOutcome.held`); one that cannot (an older SDK, NeMo Gym's dialect)
        commits durably, as without it (docs/protocol.md, "Persist after resume").
        """
        rollout_ids = None if scope is None else sorted(set(scope))
        request = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            rollout_ids=rollout_ids,
            excluded_rollout_ids=sorted(set(excluded)) or None,
            persist_after_resume=True if persist_after_resume else None,
        )
        what = "cut" if persist_after_resume else "commit"
        self._progress(f"{what}: {len(self._participants)} participant(s)")
        results = await self._fan_out(self._participants, lambda p: commit_or_cut(p, request))
        replies, failures = split(self._participants, results)
        return commit_outcome(
            checkpoint_id,
            rollout_ids,
            request.excluded_rollout_ids or [],
            replies,
            failures,
            held=[reply.manifest.instance for reply in replies if not reply.durable],
        )

    async def persist(
        self, checkpoint_id: str, deadline_ts: float, *, cut: CommitOutcome | None = None
    ) -> CommitOutcome:
        """After the cut and the resume: every participant that holds the cut's records writes
        and fsyncs them and its manifest; the outcome is a durable commit's (`held` empty).

        With `cut` (the commit's outcome) only the instances it holds are asked, each
        persisted manifest is checked against the one its cut promised, and the instances
        that committed durably already keep their manifests from it (an older participant
        has no persist to ask). Without it every participant is asked; ours answer their
        durable commit again. Idempotent: a persist asked again replays its durable reply.
        """
        return await persist_cut(
            self._fan_out, self._participants, checkpoint_id, deadline_ts, cut, self._progress
        )

    async def discard(
        self, checkpoint_id: str, deadline_ts: float, *, cut: CommitOutcome | None = None
    ) -> DiscardOutcome:
        """A cut that will not be published: every participant that holds its records (those
        `cut` holds; without it, every participant) releases them and removes what a persist
        of them wrote. Best effort, like an abort."""
        return await discard_cut(
            self._fan_out, self._participants, checkpoint_id, deadline_ts, cut, self._progress
        )

    # resume -----------------------------------------------------------------------------------

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> ResumeOutcome:
        """Resume every participant at once, best effort: a dead one does not stop the others.

        No order is needed: a caller that reopens first and calls a callee that has not yet
        reopened waits at that callee's admission gate (every step waits there) until its
        resume arrives a moment later, and the records were written before any resume was
        sent. One round of calls instead of one per role (four with all roles) shortens the
        pause every live episode waits.
        """
        outcome = await self._resume_all(checkpoint_id, deadline_ts)
        self._progress(
            f"resumed {len(outcome.resumed)} participant(s), {len(outcome.failures)} failed"
        )
        return outcome

    async def abort(self, checkpoint_id: str, deadline_ts: float) -> ResumeOutcome:
        """Resume every participant at once: the abort of a checkpoint that will not be
        published (the same calls as `resume`; the progress line says it was an abort)."""
        outcome = await self._resume_all(checkpoint_id, deadline_ts)
        self._progress(
            f"aborted {checkpoint_id}: resumed {len(outcome.resumed)} participant(s), "
            f"{len(outcome.failures)} failed"
        )
        return outcome

    async def _resume_all(self, checkpoint_id: str, deadline_ts: float) -> ResumeOutcome:
        request = ResumeRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        results = await self._fan_out(self._participants, lambda p: p.resume(request))
        _, failures = split(self._participants, results)
        failed = {failure.instance for failure in failures}
        return ResumeOutcome(
            checkpoint_id=checkpoint_id,
            resumed=[p.instance for p in self._participants if p.instance not in failed],
            failures=failures,
        )

    # restore ----------------------------------------------------------------------------------

    async def restore(
        self,
        checkpoint_id: str,
        attempt: int,
        deadline_ts: float,
        scope: Collection[str] | None = None,
        *,
        peers: Mapping[str, Mapping[Role, str]] | None = None,
        adopted: Collection[str] = (),
        listed: Mapping[str, Collection[str]] | None = None,
    ) -> RestoreOutcome:
        """Restore everywhere at once, all or nothing.

        `peers` (by instance) re-wires the participants it names to new peer URLs (an InPlace
        recovery keeps them while it replaces a peer they call). `adopted` names the instances
        served by adopted standby participants: their restore carries the instance's index
        (`RestoreRequest.index`), so they take its identity and restore its records. `listed`
        (by instance) names the rollouts whose records a participant's commit listed
        (`CommitOutcome.listed`, kept with the checkpoint): its restore names them (within
        `scope`), since a NeMo Gym participant restores only the episodes named.

        On any failure the attempt is retired everywhere (so nothing restored under it can
        run) and everyone is resumed; the caller retries under a newer attempt. On success the
        participants stay `restored` until the caller resumes them.
        """
        rollout_ids = None if scope is None else sorted(set(scope))
        request = RestoreRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            attempt=attempt,
            rollout_ids=rollout_ids,
        )
        restore = _restore_each(request, peers or {}, frozenset(adopted), listed or {})
        self._progress(f"restore {checkpoint_id} under attempt {attempt}")
        results = await self._fan_out(self._participants, restore)
        restored, episodes, kept, failures = _restored(self._participants, results)
        if not failures:
            return RestoreOutcome(
                checkpoint_id=checkpoint_id,
                attempt=attempt,
                ok=True,
                restored=restored,
                episodes=episodes,
                kept=kept,
            )
        self._progress(
            f"restore failed on {', '.join(f.instance for f in failures)}; "
            f"retiring attempt {attempt} everywhere and resuming"
        )
        with anyio.CancelScope(shield=True):
            retired = await self.retire(attempt, None, self._clock() + self._call_timeout)
            resumed = await self.resume(checkpoint_id, self._clock() + self._call_timeout)
        return RestoreOutcome(
            checkpoint_id=checkpoint_id,
            attempt=attempt,
            ok=False,
            restored=restored,
            episodes=episodes,
            failures=failures,
            retired=retired,
            resumed=resumed,
        )

    # retire and forget ------------------------------------------------------------------------

    async def retire(
        self,
        attempt: int,
        rollout_ids: Collection[str] | None,
        deadline_ts: float,
        *,
        operation_id: str | None = None,
        finished_from: Collection[Role] = (),
    ) -> RetireOutcome:
        """Retire in RETIRE_ORDER (callers before callees), best effort across stages.

        Each participant that counts work reports what the attempt did after its last
        checkpoint (`RetireReply.lost`), except for rollouts that finished. `finished_from`:
        roles that can tell which rollouts finished (the environment: whose results it
        returned; else the agent: whose sessions its environment closed), in order. Once every
        participant of the first such role in this coordinator retired and said, the later
        stages are told (`RetireRequest.finished`), so a callee that cannot tell (the model: a
        generation ends long before its episode) counts no finished episode's work. Pass only
        roles this coordinator holds every instance of.
        """
        op = operation_id or f"retire-a{attempt}-{uuid.uuid4().hex[:12]}"
        request = RetireRequest(
            operation_id=op,
            deadline_ts=deadline_ts,
            attempt=attempt,
            rollout_ids=None if rollout_ids is None else sorted(set(rollout_ids)),
        )
        retired: list[EpisodeId] = []
        failures: list[Failure] = []
        lost: dict[str, LostWork] = {}
        finished: set[str] | None = None
        for roles in RETIRE_ORDER:
            stage = self._stage(roles)
            if not stage:
                continue

            async def retire_one(
                participant: ParticipantClient, asked: RetireRequest = request
            ) -> RetireReply:
                return await participant.retire(asked)

            results = await self._fan_out(stage, retire_one)
            replies, stage_failures = split(stage, results)
            retired.extend(episode for reply in replies for episode in reply.retired)
            failures.extend(stage_failures)
            for participant in stage:
                reply = results[participant.instance]
                if isinstance(reply, RetireReply) and reply.lost is not None:
                    lost[participant.instance] = LostWork(since=reply.lost_since, counts=reply.lost)
            if finished is None:
                finished = _finished(stage, results, finished_from)
                if finished is not None and len(finished) <= MAX_FINISHED_LISTED:
                    request = request.model_copy(update={"finished": sorted(finished)})
        return RetireOutcome(
            operation_id=op,
            attempt=attempt,
            retired=retired,
            failures=failures,
            lost=lost,
            finished_known=request.finished is not None,
        )

    async def forget(
        self, rollout_ids: Collection[str], deadline_ts: float, *, operation_id: str | None = None
    ) -> ForgetOutcome:
        op = operation_id or f"forget-{uuid.uuid4().hex[:12]}"
        request = ForgetRequest(
            operation_id=op, deadline_ts=deadline_ts, rollout_ids=sorted(set(rollout_ids))
        )
        results = await self._fan_out(self._participants, lambda p: p.forget(request))
        replies, failures = split(self._participants, results)
        return ForgetOutcome(
            operation_id=op, forgotten=sum(r.forgotten for r in replies), failures=failures
        )

    # the composed checkpoint ------------------------------------------------------------------

    async def checkpoint(
        self,
        checkpoint_id: str,
        *,
        prepare_timeout: float,
        commit_timeout: float,
        scope: Collection[str] | None = None,
        publish_dir: Path | storage.RecordsStore | None = None,
        set_name: str = "local",
        trainer_step: int | None = None,
        persist_after_resume: bool = False,
        stages: PrepareStages = SEQUENTIAL_STAGES,
    ) -> CheckpointResult:
        """prepare -> (not ready: resume, fail) -> commit -> publish -> resume; with
        `persist_after_resume`, prepare -> cut -> resume -> persist -> publish, so the pause
        holds no write (docs/protocol.md, "Persist after resume"). The prepare goes in
        `stages` (see `prepare`).

        With `publish_dir` (the checkpoint root as this process sees it, or the participants'
        records store: a `BucketStore`) the checkpoint manifest is written last, after every
        participant's manifest was found there; without it the caller publishes (the operator
        does, in one status patch). Participants are resumed on every path, also when this
        coroutine is cancelled, and a cut that is not published is discarded.
        """
        composed = ComposedCheckpoint(
            self,
            checkpoint_id,
            clock=self._clock,
            call_timeout=self._call_timeout,
            progress=self._progress,
        )
        return await composed.run(
            prepare_timeout=prepare_timeout,
            commit_timeout=commit_timeout,
            scope=scope,
            publish_to=(
                storage.VolumeStore(publish_dir) if isinstance(publish_dir, Path) else publish_dir
            ),
            set_name=set_name,
            trainer_step=trainer_step,
            persist_after_resume=persist_after_resume,
            stages=stages,
        )


def _first_not_ready(
    stage: Sequence[ParticipantClient],
    results: Mapping[str, PrepareReply | ParticipantError],
    replies: dict[str, PrepareReply],
    failures: list[Failure],
) -> Role | None:
    """A prepare stage's replies into `replies` and its failures into `failures`; the first role
    in prepare order with an instance that failed or is not ready, or None when all are."""
    not_ready: list[Role] = []
    for participant in stage:
        result = results[participant.instance]
        if isinstance(result, ParticipantError):
            failures.append(Failure.of(result))
            not_ready.append(participant.role)
        else:
            replies[participant.instance] = result
            if not result.ready:
                not_ready.append(participant.role)
    return min(not_ready, key=PREPARE_ORDER.index, default=None)


def _restore_each(
    request: RestoreRequest,
    rewired: Mapping[str, Mapping[Role, str]],
    adopting: frozenset[str],
    named: Mapping[str, Collection[str]],
) -> Callable[[ParticipantClient], Awaitable[RestoreReply]]:
    """Each participant's restore: `request`, narrowed to the rollouts its commit listed, with
    its new peers, and with its index where it is an adopted standby (see
    `Coordinator.restore`)."""
    rollout_ids = request.rollout_ids

    def restore(participant: ParticipantClient) -> Awaitable[RestoreReply]:
        update: dict[str, object] = {}
        records = named.get(participant.instance)
        if records is not None:
            in_scope = set(records) if rollout_ids is None else set(records) & set(rollout_ids)
            update["rollout_ids"] = sorted(in_scope)
        wiring = rewired.get(participant.instance)
        if wiring is not None:
            update["peers"] = dict(wiring)
        if participant.instance in adopting:
            update["index"] = int(participant.instance.rsplit("-", 1)[1])
        return participant.restore(request.model_copy(update=update) if update else request)

    return restore


def _restored(
    participants: Sequence[ParticipantClient],
    results: Mapping[str, RestoreReply | ParticipantError],
) -> tuple[dict[str, int], list[EpisodeId], dict[str, dict[str, int]], list[Failure]]:
    """Records installed and work kept per instance, the episodes restored, and the failures,
    in participant order."""
    restored: dict[str, int] = {}
    kept: dict[str, dict[str, int]] = {}
    episodes: dict[EpisodeId, None] = {}
    failures: list[Failure] = []
    for participant in participants:
        result = results[participant.instance]
        if isinstance(result, ParticipantError):
            failures.append(Failure.of(result))
        else:
            restored[participant.instance] = result.record_count
            episodes.update(dict.fromkeys(result.restored))
            if result.kept is not None:
                kept[participant.instance] = dict(result.kept)
    return restored, list(episodes), kept, failures


def _finished(
    stage: Sequence[ParticipantClient],
    results: Mapping[str, RetireReply | ParticipantError],
    roles: Collection[Role],
) -> set[str] | None:
    """The rollouts that finished, as said by every participant of the first role in `roles`
    present in this stage (see `Coordinator.retire`); None when no such role said in full."""
    for role in [r for r in roles if r in RETIRE_ORDER_ROLES]:
        of_role = [p for p in stage if p.role is role]
        if not of_role:
            continue
        replies = [results[p.instance] for p in of_role]
        said = [r.finished for r in replies if isinstance(r, RetireReply)]
        if len(said) == len(of_role) and all(f is not None for f in said):
            return {rid for f in said if f is not None for rid in f}
    return None


RETIRE_ORDER_ROLES: tuple[Role, ...] = tuple(role for stage in RETIRE_ORDER for role in stage)


async def _prepare(participant: ParticipantClient, request: PrepareRequest) -> PrepareReply:
    """One participant's prepare; one that predates `PrepareRequest.rollout_ids` (it refuses the
    field as unknown, before doing anything) is asked again without it, and lists every
    parked episode as participants did then."""
    try:
        return await participant.prepare(request)
    except ParticipantError as error:
        if (
            request.rollout_ids is None
            or error.code is not ErrorCode.INVALID_REQUEST
            or "rollout_ids" not in error.detail
        ):
            raise
    return await participant.prepare(request.model_copy(update={"rollout_ids": None}))


def _prepare_outcome(
    checkpoint_id: str,
    replies: dict[str, PrepareReply],
    prepared: list[ParticipantClient],
    stopped_at: Role | None,
    failures: list[Failure],
) -> PrepareOutcome:
    # Keyed by plain tuples: hashing thousands of models is a measurable part of the pause.
    episodes: dict[tuple[str, int], EpisodeId] = {}
    restarts: dict[tuple[str, int], EpisodeId] = {}
    blockers: list[EpisodeId] = []
    blocker_count = 0
    by_role: dict[str, int] = {}
    for instance, reply in replies.items():
        for episode in reply.episodes:
            episodes.setdefault((episode.rollout_id, episode.attempt), episode)
        for episode in reply.restarts:
            restarts.setdefault((episode.rollout_id, episode.attempt), episode)
        blockers.extend(reply.blockers)
        blocker_count += reply.blocker_count
        role = instance.rsplit("-", 1)[0]
        # a participant before counts (episode_count 0) lists every parked episode instead
        by_role[role] = by_role.get(role, 0) + max(reply.episode_count, len(reply.episodes))
    return PrepareOutcome(
        checkpoint_id=checkpoint_id,
        ready=stopped_at is None and not failures,
        prepared=[participant.instance for participant in prepared],
        stopped_at=stopped_at,
        episodes=list(episodes.values()),
        episode_count=max(by_role.values(), default=0),
        episodes_sha256={
            instance: reply.episodes_sha256
            for instance, reply in replies.items()
            if reply.episodes_sha256 is not None
        },
        blockers=blockers[:MAX_BLOCKERS_REPORTED],
        blocker_count=blocker_count,
        restarts=list(restarts.values()),
        failures=failures,
    )
