"""The checkpoint coordinator, independent of Kubernetes.

It drives the participants through prepare, commit, publish and resume, and through an
all-or-nothing restore, in the orders of docs/design.md#44-order (prepare and retire in stages,
callers before callees; commit, restore and resume to everyone at once). The steps are separate
methods because the operator persists its state between them (to survive its own restart);
`checkpoint()` composes them for callers without an operator (the CLI, Slurm jobs, tests).

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
from typing import Final, TypeVar

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup
from pydantic import Field

from . import _storage as storage
from ._client import ParticipantClient, ParticipantError
from ._wire import (
    MAX_BLOCKERS_REPORTED,
    MAX_FINISHED_LISTED,
    PREPARE_ORDER,
    RETIRE_ORDER,
    CheckpointManifest,
    CommitRequest,
    EpisodeId,
    ErrorCode,
    ForgetRequest,
    Manifest,
    PrepareReply,
    PrepareRequest,
    PublishedParticipant,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
    StatusReply,
    StrictModel,
    WorkCounts,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_MISSED: Final = frozenset({ErrorCode.UNRESPONSIVE, ErrorCode.UNREACHABLE})
"""Failures that mean a call's deadline passed without an answer."""


# --- outcomes -------------------------------------------------------------------------------


class Failure(StrictModel):
    """One participant's refusal or absence, as stored in outcomes and reported to users."""

    instance: str
    code: ErrorCode
    detail: str

    @classmethod
    def of(cls, error: ParticipantError) -> Failure:
        return cls(instance=error.instance, code=error.code, detail=error.detail)

    def __str__(self) -> str:
        return f"{self.instance}: {self.code.value}: {self.detail}"


class PrepareOutcome(StrictModel):
    """Whether every stage parked in time; blockers and restarts of those that did not."""

    checkpoint_id: str
    ready: bool
    prepared: list[str] = Field(description="Instances whose prepare was ready.")
    stopped_at: Role | None = Field(default=None, description="The first stage not ready.")
    episodes: list[EpisodeId] = Field(
        default_factory=list,
        description="Parked episodes the replies listed: those of the requested scope "
        "(`prepare(scope=)`); participants before records format 2 list all.",
    )
    episode_count: int = Field(
        default=0,
        description="Parked episodes: the largest of the roles' counts (each role's instances "
        "summed; every episode of a set passes through the role that sees most of them).",
    )
    episodes_sha256: dict[str, str] = Field(
        default_factory=dict, description="By instance: the digest of its parked episodes."
    )
    blockers: list[EpisodeId] = Field(default_factory=list, max_length=MAX_BLOCKERS_REPORTED)
    blocker_count: int = 0
    restarts: list[EpisodeId] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)

    def scope(self, requested: Collection[str] | None = None) -> list[str] | None:
        """The commit scope: None (every parked episode, less `excluded()`) when nothing is
        requested; else the requested rollouts the prepare listed as parked, minus restarts."""
        if requested is None:
            return None
        restarting = {episode.rollout_id for episode in self.restarts}
        live = {episode.rollout_id for episode in self.episodes} - restarting
        return sorted(live & set(requested))

    def excluded(self) -> list[str]:
        """Rollouts every participant leaves out of the commit: the restarts."""
        return sorted({episode.rollout_id for episode in self.restarts})

    def committed_count(self, scope: Collection[str] | None) -> int:
        """Episodes a commit of `scope` continues: the scope's size, or the parked count less
        the restarts."""
        if scope is not None:
            return len(scope)
        return max(0, self.episode_count - len(self.excluded()))


class CommitOutcome(StrictModel):
    """Every participant's commit reply, or its failure, for one checkpoint."""

    checkpoint_id: str
    ok: bool
    scope: list[str] | None
    excluded: list[str] = Field(
        default_factory=list, description="Rollouts left out of the scope (restarts)."
    )
    manifests: dict[str, Manifest] = Field(default_factory=dict)
    manifest_paths: dict[str, str] = Field(default_factory=dict)
    listed: dict[str, list[str]] = Field(
        default_factory=dict,
        description="By instance, the rollouts a participant's commit listed "
        "(`CommitReply.rollout_ids`: a NeMo Gym participant, whose restore must name them).",
    )
    record_count: int = 0
    bytes: int = 0
    failures: list[Failure] = Field(default_factory=list)

    @property
    def attempt(self) -> int | None:
        attempts = {manifest.attempt for manifest in self.manifests.values()}
        return max(attempts) if attempts else None


class ResumeOutcome(StrictModel):
    """Which participants reopened admission, and which could not be reached."""

    checkpoint_id: str
    resumed: list[str] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)


class LostWork(StrictModel):
    """What one participant's retire said it had done after a checkpoint (`RetireReply.lost`)."""

    since: str | None = Field(description="The checkpoint the counts start from.")
    counts: WorkCounts


class RetireOutcome(StrictModel):
    """Which participants stopped the retired attempt's work, and which failed to."""

    operation_id: str
    attempt: int
    retired: list[EpisodeId] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)
    lost: dict[str, LostWork] = Field(
        default_factory=dict,
        description="By instance: the work each participant that counts work reported lost.",
    )
    finished_known: bool = Field(
        default=False,
        description="Whether later stages were told which rollouts finished (every "
        "participant of a role in `finished_from` retired and said).",
    )


class ForgetOutcome(StrictModel):
    """How many retire marks each participant dropped, or why it could not."""

    operation_id: str
    forgotten: int = 0
    failures: list[Failure] = Field(default_factory=list)


class RestoreOutcome(StrictModel):
    """Whether every participant installed the records under the new attempt (all or nothing)."""

    checkpoint_id: str
    attempt: int
    ok: bool
    restored: dict[str, int] = Field(
        default_factory=dict, description="Records installed per instance."
    )
    episodes: list[EpisodeId] = Field(default_factory=list)
    kept: dict[str, WorkCounts] = Field(
        default_factory=dict,
        description="By instance: the work the installed records hold (`RestoreReply.kept`).",
    )
    failures: list[Failure] = Field(default_factory=list)
    retired: RetireOutcome | None = Field(
        default=None, description="Set when the restore failed and the attempt was retired."
    )
    resumed: ResumeOutcome | None = None


class StatusOutcome(StrictModel):
    """Every participant's `/status` reply, or its failure."""

    statuses: list[StatusReply] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)


class CheckpointDurations(StrictModel):
    """How long each stage of one checkpoint took, and how long episodes were paused."""

    prepare_seconds: float = 0.0
    commit_seconds: float = 0.0
    pause_seconds: float = Field(default=0.0, description="First prepare to resume done.")
    total_seconds: float = 0.0


class CheckpointResult(StrictModel):
    """The outcome of a whole `Coordinator.checkpoint()`: published or failed, with counts."""

    checkpoint_id: str
    ok: bool
    reason: str = Field(
        description="CamelCase: Published, Committed, NotReady, PrepareFailed, CommitFailed, "
        "PublishFailed."
    )
    message: str
    attempt: int | None = None
    prepare: PrepareOutcome
    commit: CommitOutcome | None = None
    resume: ResumeOutcome | None = None
    published: str | None = Field(default=None, description="Path of checkpoint.json.")
    durations: CheckpointDurations = Field(default_factory=CheckpointDurations)


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
        self._missed_call_seconds = missed_call_seconds
        self._missed: set[str] = set()
        """Participants that did not answer by a call's deadline (hung, frozen, gone): every
        later call of this coordinator waits for them `missed_call_seconds` at most, so an
        abort or a cleanup after a failed restore never waits a whole call timeout again on
        the participant that caused it."""
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

    async def _fan_out(
        self,
        participants: Sequence[ParticipantClient],
        call: Callable[[ParticipantClient], Awaitable[_T]],
    ) -> dict[str, _T | ParticipantError]:
        """Call every participant at once; a failure is a value, so the others still finish."""
        results: dict[str, _T | ParticipantError] = {}

        async def one(participant: ParticipantClient) -> None:
            instance = participant.instance
            try:
                results[instance] = await self._call_bounded(participant, call)
            except ParticipantError as error:
                results[instance] = error
                if error.code in _MISSED:
                    self._missed.add(instance)
            except Exception as error:
                logger.exception("call to %s failed unexpectedly", instance)
                results[instance] = ParticipantError(
                    ErrorCode.INTERNAL, f"{type(error).__name__}: {error}", instance
                )

        async with anyio.create_task_group() as group:
            for participant in participants:
                group.start_soon(one, participant)
        return results

    async def _call_bounded(
        self, participant: ParticipantClient, call: Callable[[ParticipantClient], Awaitable[_T]]
    ) -> _T:
        """The call; for a participant that already missed a deadline here, cut at
        `missed_call_seconds`."""
        if participant.instance not in self._missed:
            return await call(participant)
        with anyio.move_on_after(self._missed_call_seconds):
            return await call(participant)
        raise ParticipantError(
            ErrorCode.UNRESPONSIVE,
            f"no answer within {self._missed_call_seconds:g}s (it already missed a deadline of "
            "this checkpoint or recovery, so it is not waited for in full again)",
            participant.instance,
        )

    # status -----------------------------------------------------------------------------------

    async def status(self, deadline_ts: float) -> StatusOutcome:
        results = await self._fan_out(self._participants, lambda p: p.status(deadline_ts))
        replies, failures = _split(self._participants, results)
        return StatusOutcome(statuses=replies, failures=failures)

    # prepare ----------------------------------------------------------------------------------

    async def prepare(
        self, checkpoint_id: str, deadline_ts: float, *, scope: Collection[str] | None = None
    ) -> PrepareOutcome:
        """Prepare stage by stage in PREPARE_ORDER, stopping at the first stage not ready.

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
            for role in PREPARE_ORDER:
                stage = self._stage((role,))
                if not stage:
                    continue
                current = role
                self._progress(f"prepare {role.value}: {len(stage)} participant(s)")
                results = await self._fan_out(stage, lambda p: _prepare(p, request))
                stage_ready = True
                for participant in stage:
                    result = results[participant.instance]
                    if isinstance(result, ParticipantError):
                        failures.append(Failure.of(result))
                        stage_ready = False
                    else:
                        replies[participant.instance] = result
                        stage_ready = stage_ready and result.ready
                if not stage_ready:
                    stopped_at = role
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
                if isinstance(result, ParticipantError) and result.code in (
                    ErrorCode.STALE_CHECKPOINT,
                    ErrorCode.UNKNOWN_CHECKPOINT,
                ):
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
    ) -> CommitOutcome:
        """Commit everywhere at once with the given scope (see `PrepareOutcome.scope`), leaving
        out `excluded` (`PrepareOutcome.excluded`)."""
        rollout_ids = None if scope is None else sorted(set(scope))
        request = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            rollout_ids=rollout_ids,
            excluded_rollout_ids=sorted(set(excluded)) or None,
        )
        self._progress(f"commit: {len(self._participants)} participant(s)")
        results = await self._fan_out(self._participants, lambda p: p.commit(request))
        replies, failures = _split(self._participants, results)
        manifests = {reply.manifest.instance: reply.manifest for reply in replies}
        return CommitOutcome(
            checkpoint_id=checkpoint_id,
            ok=not failures,
            scope=rollout_ids,
            excluded=request.excluded_rollout_ids or [],
            manifests=manifests,
            manifest_paths={reply.manifest.instance: reply.manifest_path for reply in replies},
            listed={
                reply.manifest.instance: reply.rollout_ids
                for reply in replies
                if reply.rollout_ids is not None
            },
            record_count=sum(m.record_count for m in manifests.values()),
            bytes=sum(m.bytes for m in manifests.values()),
            failures=failures,
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
        _, failures = _split(self._participants, results)
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
        rewired = peers or {}
        adopting = frozenset(adopted)
        named = listed or {}

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

        self._progress(f"restore {checkpoint_id} under attempt {attempt}")
        results = await self._fan_out(self._participants, restore)
        restored: dict[str, int] = {}
        kept: dict[str, dict[str, int]] = {}
        episodes: dict[EpisodeId, None] = {}
        failures: list[Failure] = []
        for participant in self._participants:
            result = results[participant.instance]
            if isinstance(result, ParticipantError):
                failures.append(Failure.of(result))
            else:
                restored[participant.instance] = result.record_count
                episodes.update(dict.fromkeys(result.restored))
                if result.kept is not None:
                    kept[participant.instance] = dict(result.kept)
        if not failures:
            return RestoreOutcome(
                checkpoint_id=checkpoint_id,
                attempt=attempt,
                ok=True,
                restored=restored,
                episodes=list(episodes),
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
            episodes=list(episodes),
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
            replies, stage_failures = _split(stage, results)
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
        replies, failures = _split(self._participants, results)
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
        publish_dir: Path | None = None,
        set_name: str = "local",
        trainer_step: int | None = None,
    ) -> CheckpointResult:
        """prepare -> (not ready: resume, fail) -> commit -> publish -> resume.

        With `publish_dir` (the checkpoint root as this process sees it) the checkpoint
        manifest is written last, after every participant's manifest was found there; without
        it the caller publishes (the operator does, in one status patch). Participants are
        resumed on every path, also when this coroutine is cancelled.
        """
        started = self._clock()
        resumed: ResumeOutcome | None = None
        try:
            prepare = await self.prepare(checkpoint_id, started + prepare_timeout, scope=scope)
            prepared_at = self._clock()
            if not prepare.ready:
                resumed = await self._resume_now(checkpoint_id)
                reason = "PrepareFailed" if prepare.failures else "NotReady"
                return self._result(
                    checkpoint_id,
                    reason,
                    _prepare_message(prepare),
                    prepare,
                    None,
                    resumed,
                    None,
                    (started, prepared_at, prepared_at),
                )
            commit = await self.commit(
                checkpoint_id,
                prepared_at + commit_timeout,
                prepare.scope(scope),
                excluded=prepare.excluded(),
            )
            committed_at = self._clock()
            times = (started, prepared_at, committed_at)
            if not commit.ok:
                resumed = await self._resume_now(checkpoint_id)
                message = "; ".join(str(f) for f in commit.failures)
                return self._result(
                    checkpoint_id, "CommitFailed", message, prepare, commit, resumed, None, times
                )
            published: str | None = None
            if publish_dir is not None:
                durations = (prepared_at - started, committed_at - prepared_at)
                try:
                    path = await anyio.to_thread.run_sync(
                        lambda: _publish(
                            publish_dir,
                            set_name,
                            checkpoint_id,
                            prepare,
                            commit,
                            durations,
                            trainer_step,
                            self._clock(),
                        )
                    )
                except (storage.StorageError, storage.RecordsInvalid, ValueError) as error:
                    resumed = await self._resume_now(checkpoint_id)
                    return self._result(
                        checkpoint_id,
                        "PublishFailed",
                        str(error),
                        prepare,
                        commit,
                        resumed,
                        None,
                        times,
                    )
                published = str(path)
                self._progress(f"published {path}")
            resumed = await self._resume_now(checkpoint_id, aborting=False)
            reason = "Published" if published is not None else "Committed"
            message = (
                f"{prepare.committed_count(commit.scope)} episodes in {commit.record_count} "
                f"records ({commit.bytes} bytes) from {len(commit.manifests)} participants"
            )
            return self._result(
                checkpoint_id, reason, message, prepare, commit, resumed, published, times
            )
        except BaseException:
            if resumed is None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self._call_timeout):
                    await self.resume(checkpoint_id, self._clock() + self._call_timeout)
            raise

    async def _resume_now(self, checkpoint_id: str, *, aborting: bool = True) -> ResumeOutcome:
        """Resume everyone at once, shielded from cancellation (`abort` when the checkpoint
        will not be published)."""
        deadline = self._clock() + self._call_timeout
        step = self.abort if aborting else self.resume
        with anyio.CancelScope(shield=True):
            outcome = await step(checkpoint_id, deadline)
        return outcome

    def _result(
        self,
        checkpoint_id: str,
        reason: str,
        message: str,
        prepare: PrepareOutcome,
        commit: CommitOutcome | None,
        resumed: ResumeOutcome | None,
        published: str | None,
        times: tuple[float, float, float],
    ) -> CheckpointResult:
        started, prepared_at, committed_at = times
        finished = self._clock()
        ok = reason in ("Published", "Committed")
        if resumed is not None and resumed.failures:
            message += "; resume failed on " + ", ".join(f.instance for f in resumed.failures)
        return CheckpointResult(
            checkpoint_id=checkpoint_id,
            ok=ok,
            reason=reason,
            message=message,
            attempt=commit.attempt if commit is not None else None,
            prepare=prepare,
            commit=commit,
            resume=resumed,
            published=published,
            durations=CheckpointDurations(
                prepare_seconds=prepared_at - started,
                commit_seconds=committed_at - prepared_at,
                pause_seconds=finished - started,
                total_seconds=finished - started,
            ),
        )


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


def _split(
    participants: Sequence[ParticipantClient], results: dict[str, _T | ParticipantError]
) -> tuple[list[_T], list[Failure]]:
    """Replies and failures in participant order (stable output for people and tests)."""
    replies: list[_T] = []
    failures: list[Failure] = []
    for participant in participants:
        result = results[participant.instance]
        if isinstance(result, ParticipantError):
            failures.append(Failure.of(result))
        else:
            replies.append(result)
    return replies, failures


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


def _prepare_message(prepare: PrepareOutcome) -> str:
    where = prepare.stopped_at.value if prepare.stopped_at is not None else "?"
    if prepare.failures:
        return f"prepare failed at {where}: " + "; ".join(str(f) for f in prepare.failures)
    shown = ", ".join(str(episode) for episode in prepare.blockers[:10])
    return (
        f"{prepare.blocker_count} episodes of {where} were not parked by the prepare "
        f"deadline (first: {shown})"
    )


def _publish(
    root: Path,
    set_name: str,
    checkpoint_id: str,
    prepare: PrepareOutcome,
    commit: CommitOutcome,
    durations: tuple[float, float],
    trainer_step: int | None,
    now: float,
) -> Path:
    """Check each participant's manifest is where we publish, then write checkpoint.json."""
    entries: list[PublishedParticipant] = []
    for instance, manifest in sorted(commit.manifests.items()):
        relative = commit.manifest_paths[instance]
        on_disk = storage.read_manifest((root / relative).parent)
        if on_disk != manifest:
            raise storage.RecordsInvalid(
                f"the manifest of {instance} at {root / relative} differs from its commit reply; "
                "is the publish directory the participants' ROLLOUT_CHECKPOINT_ROOT?"
            )
        entries.append(
            PublishedParticipant(
                instance=instance,
                role=manifest.role,
                manifest_path=relative,
                records_sha256=manifest.records_sha256,
                record_count=manifest.record_count,
                bytes=manifest.bytes,
                rollout_ids=commit.listed.get(instance),
            )
        )
    attempt = commit.attempt
    return storage.write_checkpoint_manifest(
        root,
        CheckpointManifest(
            set_name=set_name,
            checkpoint_id=checkpoint_id,
            attempt=attempt if attempt is not None else 0,
            published_ts=now,
            rollout_ids=commit.scope or [],
            restarts=len(prepare.restarts),
            participants=entries,
            trainer_step=trainer_step,
            prepare_seconds=max(durations[0], 0.0),
            commit_seconds=max(durations[1], 0.0),
        ),
    )
