"""The composed checkpoint, for callers without an operator (the CLI, Slurm jobs, tests;
`Coordinator.checkpoint`): prepare -> (not ready: resume, fail) -> commit -> publish -> resume,
or, persisting after the resume, prepare -> cut -> resume -> persist -> publish (a failed cut or
persist discards the held records; docs/protocol.md, "Persist after resume").

Held apart from the `Coordinator` (`_coordinator.py`), whose steps it composes through their
public form (`CheckpointSteps`): the operator runs the same steps one by one, persisting its
state between them, and never this composition. One `ComposedCheckpoint` runs one checkpoint
and remembers whether it resumed the participants yet, so that every path, cancellation
included, resumes them exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import anyio
import anyio.to_thread

from . import _storage as storage
from ._coordinator_outcomes import (
    CheckpointDurations,
    CheckpointResult,
    CommitOutcome,
    DiscardOutcome,
    PrepareOutcome,
    ResumeOutcome,
)
from ._stages import SEQUENTIAL_STAGES, PrepareStages
from ._wire import CheckpointManifest, PublishedParticipant

_Times = tuple[float, float, float]
"""When the checkpoint started, its prepare ended and its commit (or cut) ended (clock
seconds)."""


class CheckpointSteps(Protocol):
    """The coordinator's steps a composed checkpoint runs."""

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        *,
        scope: Collection[str] | None = None,
        stages: PrepareStages = SEQUENTIAL_STAGES,
    ) -> PrepareOutcome: ...

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        scope: Collection[str] | None,
        *,
        excluded: Collection[str] = (),
        persist_after_resume: bool = False,
    ) -> CommitOutcome: ...

    async def persist(
        self, checkpoint_id: str, deadline_ts: float, *, cut: CommitOutcome | None = None
    ) -> CommitOutcome: ...

    async def discard(
        self, checkpoint_id: str, deadline_ts: float, *, cut: CommitOutcome | None = None
    ) -> DiscardOutcome: ...

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> ResumeOutcome: ...

    async def abort(self, checkpoint_id: str, deadline_ts: float) -> ResumeOutcome: ...


class ComposedCheckpoint:
    """One checkpoint of `steps`, from prepare to resume (`run`)."""

    def __init__(
        self,
        steps: CheckpointSteps,
        checkpoint_id: str,
        *,
        clock: Callable[[], float],
        call_timeout: float,
        progress: Callable[[str], None],
    ) -> None:
        self._steps = steps
        self._checkpoint_id = checkpoint_id
        self._clock = clock
        self._call_timeout = call_timeout
        self._progress = progress
        self._resumed: ResumeOutcome | None = None
        self._resumed_at: float | None = None
        self._cut: CommitOutcome | None = None
        """The cut whose records participants hold until persisted or discarded."""
        self._discarded: DiscardOutcome | None = None

    async def run(
        self,
        *,
        prepare_timeout: float,
        commit_timeout: float,
        scope: Collection[str] | None,
        publish_to: storage.RecordsStore | None,
        set_name: str,
        trainer_step: int | None,
        persist_after_resume: bool = False,
        stages: PrepareStages = SEQUENTIAL_STAGES,
    ) -> CheckpointResult:
        """See `Coordinator.checkpoint`."""
        cid = self._checkpoint_id
        started = self._clock()
        try:
            prepare = await self._steps.prepare(
                cid, started + prepare_timeout, scope=scope, stages=stages
            )
            prepared_at = self._clock()
            if not prepare.ready:
                reason = "PrepareFailed" if prepare.failures else "NotReady"
                times = (started, prepared_at, prepared_at)
                return await self._failed(reason, _prepare_message(prepare), prepare, None, times)
            commit = await self._steps.commit(
                cid,
                prepared_at + commit_timeout,
                prepare.scope(scope),
                excluded=prepare.excluded(),
                persist_after_resume=persist_after_resume,
            )
            times = (started, prepared_at, self._clock())
            if commit.held:
                self._cut = commit
            if not commit.ok:
                message = "; ".join(str(f) for f in commit.failures)
                return await self._failed("CommitFailed", message, prepare, commit, times)
            if commit.held:
                self._resumed = await self._resume_now(aborting=False)
                commit = await self._steps.persist(cid, self._clock() + commit_timeout, cut=commit)
                if not commit.ok:
                    message = "; ".join(str(f) for f in commit.failures)
                    return await self._failed("PersistFailed", message, prepare, commit, times)
            published: str | None = None
            if publish_to is not None:
                try:
                    published = await self._publish(
                        publish_to, set_name, trainer_step, prepare, commit, times
                    )
                except (storage.StorageError, storage.RecordsInvalid, ValueError) as error:
                    return await self._failed("PublishFailed", str(error), prepare, commit, times)
            return await self._succeeded(prepare, commit, published, times)
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._call_timeout):
                if self._resumed is None:
                    await self._steps.resume(cid, self._clock() + self._call_timeout)
                if self._cut is not None and self._discarded is None:
                    await self._steps.discard(
                        cid, self._clock() + self._call_timeout, cut=self._cut
                    )
            raise

    async def _publish(
        self,
        publish_to: storage.RecordsStore,
        set_name: str,
        trainer_step: int | None,
        prepare: PrepareOutcome,
        commit: CommitOutcome,
        times: _Times,
    ) -> str:
        """Write the checkpoint manifest last, once every participant's manifest is there."""
        started, prepared_at, committed_at = times
        durations = (prepared_at - started, committed_at - prepared_at)
        path = await anyio.to_thread.run_sync(
            lambda: _publish(
                publish_to,
                set_name,
                self._checkpoint_id,
                prepare,
                commit,
                durations,
                trainer_step,
                self._clock(),
            )
        )
        self._progress(f"published {path}")
        return path

    async def _succeeded(
        self,
        prepare: PrepareOutcome,
        commit: CommitOutcome,
        published: str | None,
        times: _Times,
    ) -> CheckpointResult:
        if self._resumed is None:
            self._resumed = await self._resume_now(aborting=False)
        reason = "Published" if published is not None else "Committed"
        message = (
            f"{commit.episode_count(prepare)} episodes in {commit.record_count} "
            f"records ({commit.bytes} bytes) from {len(commit.manifests)} participants"
        )
        return self._result(reason, message, prepare, commit, published, times)

    async def _failed(
        self,
        reason: str,
        message: str,
        prepare: PrepareOutcome,
        commit: CommitOutcome | None,
        times: _Times,
    ) -> CheckpointResult:
        """Abort: resume everyone (unless resumed after a cut already), discard a cut's held
        records, and say why the checkpoint will not be published."""
        if self._resumed is None:
            self._resumed = await self._resume_now(aborting=True)
        if self._cut is not None:
            with anyio.CancelScope(shield=True):
                self._discarded = await self._steps.discard(
                    self._checkpoint_id, self._clock() + self._call_timeout, cut=self._cut
                )
        return self._result(reason, message, prepare, commit, None, times)

    async def _resume_now(self, *, aborting: bool) -> ResumeOutcome:
        """Resume everyone at once, shielded from cancellation (`abort` when the checkpoint
        will not be published)."""
        deadline = self._clock() + self._call_timeout
        step = self._steps.abort if aborting else self._steps.resume
        with anyio.CancelScope(shield=True):
            outcome = await step(self._checkpoint_id, deadline)
        self._resumed_at = self._clock()
        return outcome

    def _result(
        self,
        reason: str,
        message: str,
        prepare: PrepareOutcome,
        commit: CommitOutcome | None,
        published: str | None,
        times: _Times,
    ) -> CheckpointResult:
        started, prepared_at, committed_at = times
        finished = self._clock()
        resumed_at = self._resumed_at if self._resumed_at is not None else finished
        ok = reason in ("Published", "Committed")
        resumed = self._resumed
        if resumed is not None and resumed.failures:
            message += "; resume failed on " + ", ".join(f.instance for f in resumed.failures)
        return CheckpointResult(
            checkpoint_id=self._checkpoint_id,
            ok=ok,
            reason=reason,
            message=message,
            attempt=commit.attempt if commit is not None else None,
            prepare=prepare,
            commit=commit,
            resume=resumed,
            discard=self._discarded,
            published=published,
            durations=CheckpointDurations(
                prepare_seconds=prepared_at - started,
                commit_seconds=committed_at - prepared_at,
                pause_seconds=resumed_at - started,
                persist_seconds=(finished - committed_at) if self._cut is not None else 0.0,
                total_seconds=finished - started,
            ),
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
    store: storage.RecordsStore,
    set_name: str,
    checkpoint_id: str,
    prepare: PrepareOutcome,
    commit: CommitOutcome,
    durations: tuple[float, float],
    trainer_step: int | None,
    now: float,
) -> str:
    """Check each participant's manifest is where we publish, then write checkpoint.json."""
    entries: list[PublishedParticipant] = []
    for instance, manifest in sorted(commit.manifests.items()):
        relative = commit.manifest_paths[instance]
        stored = store.read_manifest(relative)
        if stored != manifest:
            raise storage.RecordsInvalid(
                f"the manifest of {instance} at {relative} in {store.where} differs from its "
                "commit reply; is the publish store the participants' (their "
                "ROLLOUT_CHECKPOINT_ROOT or bucket)?"
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
    return store.write_checkpoint_manifest(
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
