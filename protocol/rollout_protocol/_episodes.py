"""The episode runtime every reference server is built on.

An *episode* is one rollout under one attempt, seen by one server. It is a sequence of *steps*;
after each completed step the owner records a *boundary*: the name of the next step and the JSON
state that step needs. A checkpoint captures boundaries, never the inside of a step, so the
runtime has to know at every moment whether an episode is at a boundary:

* a step in `wait` mode holds the episode inside the step: a checkpoint waits for it to finish
  (it is a *blocker* until then);
* a step in `replay` mode leaves the episode parked at the previous boundary: a checkpoint may
  capture it at once and a restore simply runs the step again. If the step finishes while the
  checkpoint is still open, its result is *held* (not applied) until admission reopens, so the
  boundary a participant has already reported and exported is the one that stays true for this
  checkpoint. Applying it early would let this participant's records run ahead of the records
  its peers write a moment later.

Admission is a gate in front of every step: while a checkpoint is open no step starts. Parked
time (a checkpoint open while the episode is parked) is not counted against the episode's time
budget, so a slow checkpoint never times episodes out.

Restored boundaries are installed under the next attempt and wait to be claimed by that attempt's
first call; until then a checkpoint exports them again (a second crash still continues them) and
a commit whose scope leaves them out releases them.

Records are encoded ahead: when an episode reaches a boundary (it begins, a step completes, a
restore installs it, `advance`), its record is built and encoded at once (`EncodedRecord`), so a
checkpoint's export only collects bytes that exist and its commit only writes them; an episode
whose boundary has not moved is never encoded again. A record therefore says what was true at
its boundary: `active_seconds` is the active time when the boundary was reached (a restore
reruns whatever ran after it, so that time is charged again there, not twice). Boundaries are
values: a server records a new `Boundary` rather than changing a recorded one's state in place
(which the encoded record would not see).

Retire cancels an episode only before its final cleanup starts and then waits until it has
ended; the cleanup itself runs shielded, so a retire reply means the episode's sessions are
closed.

`EpisodeRuntime` keeps two concerns in parts it owns: the restored boundaries waiting for their
attempt (`_RestoredBoundaries`) and the work done since the last checkpoint (`_WorkSince`, what a
retire may count as lost). `RuntimeParticipant` implements the control plane's `Participant`
contract over one runtime, so a server gets the whole protocol by describing its steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    ValuesView,
)
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ._participant import (
    DIGEST_MODULUS,
    EpisodeCounts,
    ParkState,
    Participant,
    episode_id_hash,
)
from ._storage import EncodedRecord, encode_record
from ._wire import EpisodeId, Record, Role

log = logging.getLogger(__name__)

__all__ = [
    "AttemptRetired",
    "Boundary",
    "Episode",
    "EpisodeCancelled",
    "EpisodeError",
    "EpisodeExists",
    "EpisodeRuntime",
    "EpisodeTimeout",
    "RuntimeParticipant",
    "StaleAttempt",
    "StepMode",
    "TaskMismatch",
]


class StepMode(StrEnum):
    """How a checkpoint treats an episode while one of its steps runs."""

    WAIT = "wait"
    """The checkpoint waits for the step; the episode is a blocker until it ends."""
    REPLAY = "replay"
    """The episode counts as parked at its previous boundary; a restore reruns the step."""


@dataclass(frozen=True)
class Boundary:
    """Where an episode can continue: the next step and the JSON state that step needs."""

    step: str
    state: Mapping[str, Any] = field(default_factory=dict)


# --- errors -----------------------------------------------------------------------------------


class EpisodeError(Exception):
    """Base of the runtime's errors; servers map each to a wire error code."""


class TaskMismatch(EpisodeError):
    """A restored boundary was claimed with a different task than the one it recorded."""


class AttemptRetired(EpisodeError):
    """The episode's attempt was retired here; its work is refused from now on."""


class StaleAttempt(EpisodeError):
    """A call names an attempt that does not match the episode state this server holds."""


class EpisodeExists(EpisodeError):
    """A live episode already exists for this rollout (and key)."""

    def __init__(self, episode: Episode) -> None:
        super().__init__(f"episode {episode.id} is already live")
        self.episode = episode


class EpisodeCancelled(EpisodeError):
    """The episode was cancelled (a retire, or its session closed) before its cleanup started."""


class EpisodeTimeout(EpisodeError):
    """The episode used up its time budget (parked time not counted)."""


# --- records ----------------------------------------------------------------------------------


class BoundaryData(BaseModel):
    """The `data` of a boundary record; validated strictly before anything is installed."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: str = Field(min_length=1, max_length=128)
    state: dict[str, Any]
    digest: str | None = None
    steps: int = Field(ge=0)
    active_seconds: float = Field(ge=0)


def _record(
    kind: str,
    rollout_id: str,
    attempt: int,
    key: str,
    boundary: Boundary,
    digest: str | None,
    steps: int,
    active_seconds: float,
) -> Record:
    """A boundary record (its `data` is what `BoundaryData` validates at restore).

    Built as a plain dict rather than through `BoundaryData`: a checkpoint exports thousands of
    records while every episode waits, and the reader validates each one strictly anyway.
    """
    return Record(
        kind=kind,
        rollout_id=rollout_id,
        attempt=attempt,
        key=key,
        data={
            "step": boundary.step,
            "state": dict(boundary.state),
            "digest": digest,
            "steps": steps,
            "active_seconds": active_seconds,
        },
    )


@dataclass
class Restored:
    """A boundary installed by a restore, waiting for the next attempt to claim it."""

    rollout_id: str
    key: str
    attempt: int
    """The attempt that continues it (the restore's attempt)."""
    produced_by: int
    """The attempt whose records it came from."""
    boundary: Boundary
    digest: str | None
    steps: int
    active_seconds: float
    encoded: EncodedRecord | None = None
    """Its record, encoded when it was installed (`EpisodeRuntime.install`)."""

    @classmethod
    def of(cls, record: Record, attempt: int) -> Restored:
        """A validated record's boundary, to be continued by `attempt`."""
        data = BoundaryData.model_validate(record.data)
        return cls(
            rollout_id=record.rollout_id,
            key=record.key,
            attempt=attempt,
            produced_by=record.attempt,
            boundary=Boundary(data.step, data.state),
            digest=data.digest,
            steps=data.steps,
            active_seconds=data.active_seconds,
        )

    @property
    def id(self) -> EpisodeId:
        return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt)

    def record(self, kind: str) -> Record:
        return self.encode(kind).record

    def encode(self, kind: str) -> EncodedRecord:
        """Its encoded record (made once: nothing of a restored boundary changes)."""
        if self.encoded is None or self.encoded.record.kind != kind:
            self.encoded = encode_record(
                _record(
                    kind,
                    self.rollout_id,
                    self.attempt,
                    self.key,
                    self.boundary,
                    self.digest,
                    self.steps,
                    self.active_seconds,
                )
            )
        return self.encoded


# --- the episode ------------------------------------------------------------------------------


class Episode:
    """One rollout under one attempt on this server. Create through `EpisodeRuntime.begin`."""

    def __init__(
        self,
        runtime: EpisodeRuntime,
        rollout_id: str,
        attempt: int,
        key: str,
        boundary: Boundary,
        digest: str | None,
        *,
        continued_from: int | None = None,
        steps: int = 0,
        active_seconds: float = 0.0,
    ) -> None:
        self.runtime = runtime
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.key = key
        self.boundary = boundary
        self.digest = digest
        self.continued_from = continued_from
        """The attempt whose checkpoint this episode continues from (None: started fresh)."""
        self.steps_completed = steps
        self.current_step: str | None = None
        self.holding = False
        """A replay step finished during an open checkpoint; its result waits for reopen."""
        self._wait_steps = 0
        self._replay_steps = 0
        self._cleaning = False
        self.cleanup_started = False
        self.cancelled = False
        self.ended = anyio.Event()
        """Set when the episode has ended: its cleanup finished, or it was closed."""
        self._guards: set[anyio.CancelScope] = set()
        self._timers: set[anyio.CancelScope] = set()
        now = runtime.clock()
        self._opened_at = now
        self._carried = active_seconds
        self._parked_total = 0.0
        self._parked_since: float | None = None
        self.closed = False
        self._id = EpisodeId(rollout_id=rollout_id, attempt=attempt)
        self._drivers = 0
        """Tasks driving this episode; a retire waits for them rather than ending it itself."""
        self._encoded: EncodedRecord | None = None
        """The record of its current boundary, encoded when the boundary was reached."""

    @property
    def id(self) -> EpisodeId:
        return self._id

    @property
    def parked(self) -> bool:
        """At a boundary or inside replay steps only: the boundary is capturable now."""
        return self._wait_steps == 0 and not self._cleaning

    @property
    def running(self) -> bool:
        return self._wait_steps + self._replay_steps > 0 or self._cleaning

    def active_seconds(self) -> float:
        """Time spent on this episode (across attempts), not counting parked checkpoint time."""
        now = self.runtime.clock()
        parked = self._parked_total
        if self._parked_since is not None:
            parked += now - self._parked_since
        return self._carried + max(0.0, now - self._opened_at - parked)

    def remaining(self) -> float | None:
        budget = self.runtime.episode_timeout_s
        if budget is None:
            return None
        return budget - self.active_seconds()

    def record(self, kind: str) -> Record:
        """The record of its current boundary (as encoded when the boundary was reached)."""
        return self.encode(kind).record

    def encode(self, kind: str) -> EncodedRecord:
        """The encoded record of its current boundary: made by `reached` (for the runtime's
        kind), or made now."""
        if kind != self.runtime.kind:
            return self._encode(kind)
        if self._encoded is None:
            self.reached(kind)
            assert self._encoded is not None
        return self._encoded

    def reached(self, kind: str) -> None:
        """Its boundary moved (or it began): encode the record now, outside any checkpoint."""
        self._encoded = self._encode(kind)

    def _encode(self, kind: str) -> EncodedRecord:
        return encode_record(
            _record(
                kind,
                self.rollout_id,
                self.attempt,
                self.key,
                self.boundary,
                self.digest,
                self.steps_completed,
                self.active_seconds(),
            )
        )

    def cancel(self) -> None:
        """Cancel every guarded region of this episode (steps, holds, its driver)."""
        self.cancelled = True
        for scope in list(self._guards):
            scope.cancel()

    # parked-time accounting; called by the runtime
    def _park_started(self, now: float) -> None:
        if self._parked_since is None:
            self._parked_since = now

    def _park_ended(self, now: float) -> None:
        if self._parked_since is None:
            return
        parked = now - self._parked_since
        self._parked_total += parked
        self._parked_since = None
        for timer in self._timers:
            # a replay step kept running while parked: its budget moves with the parked time
            timer.deadline += parked

    def __repr__(self) -> str:
        return f"Episode({self.id}, key={self.key!r}, at={self.boundary.step!r})"


StepObserver = Callable[[Episode, str, str], None]
"""Called with (episode, step name, event): `started`, `held` (a replay step's result waits for
reopen), then `completed` or `failed`."""


class EpisodeRuntime:
    """Live episodes, restored boundaries, the admission gate and retire marks of one server.

    All methods run on one event loop; nothing here is thread safe, and nothing needs to be.
    """

    def __init__(
        self,
        kind: str = "boundary",
        *,
        episode_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: StepObserver | None = None,
    ) -> None:
        self.kind = kind
        """The `Record.kind` of this runtime's records."""
        self.episode_timeout_s = episode_timeout_s
        self.clock = clock
        self.observer = observer
        self._live: dict[tuple[str, str], Episode] = {}
        self._ids = _IdSet()
        """The (rollout, attempt) ids of live and restored episodes with their set digest,
        kept as they come and go, so a prepare reads them instead of scanning."""
        self._restored = _RestoredBoundaries(self._ids)
        self._admission_open = True
        self._opened = anyio.Event()
        self._opened.set()
        self._changed = anyio.Event()
        self.epoch = 0
        """Incremented every time admission closes: lets a step tell a checkpoint happened."""
        self._blocking = 0
        """Episodes (live or already ended) inside a wait step or cleanup; 0: no live episode
        blocks a checkpoint, which `park` then knows without a scan."""
        self._retired_attempts: set[int] = set()
        self._retired: set[tuple[str, int]] = set()
        self._work = _WorkSince()

    # --- progress since the last checkpoint (work accounting) ------------------------------

    def progress(self, attempt: int) -> dict[tuple[str, str], int]:
        """Steps completed by the episodes of `attempt` that made progress since the last
        `forget_progress`, live or ended, by (rollout, key)."""
        return self._work.progress(attempt)

    def ended_since(self, attempt: int) -> set[str]:
        """Rollouts of `attempt` whose episodes ended since the last `forget_progress`, except
        those a retire cancelled (an episode in its final cleanup is not cancelled: it ends
        on its own while the retire waits, and counts as ended)."""
        return self._work.ended_since(attempt)

    def forget_progress(self) -> None:
        """A checkpoint now holds every episode's state: progress counts from here."""
        self._work.forget()

    # --- admission ------------------------------------------------------------------------

    @property
    def admission_open(self) -> bool:
        return self._admission_open

    def close_admission(self) -> None:
        """Stop starting steps. Episodes parked now start counting parked time."""
        if not self._admission_open:
            return
        self._admission_open = False
        self._opened = anyio.Event()
        self.epoch += 1
        now = self.clock()
        for episode in self._live.values():
            # `parked` and `_park_started` inline: this loop is inside every checkpoint's pause
            if not episode._wait_steps and not episode._cleaning and episode._parked_since is None:
                episode._parked_since = now
        self._notify()

    def reopen(self) -> None:
        """Let steps start again and release held results."""
        if self._admission_open:
            return
        self._admission_open = True
        now = self.clock()
        for episode in self._live.values():
            # `_park_ended` inline for the episodes without running timers: inside the pause
            since = episode._parked_since
            if since is None:
                continue
            if episode._timers:
                episode._park_ended(now)
            else:
                episode._parked_total += now - since
                episode._parked_since = None
        self._opened.set()
        self._notify()

    async def wait_admission(self) -> None:
        """Wait at the gate until admission is open."""
        while not self._admission_open:
            await self._opened.wait()

    # --- registry -------------------------------------------------------------------------

    def find(self, rollout_id: str, key: str = "") -> Episode | None:
        return self._live.get((rollout_id, key))

    def find_restored(self, rollout_id: str, key: str = "") -> Restored | None:
        return self._restored.get((rollout_id, key))

    def live(self) -> list[Episode]:
        return list(self._live.values())

    def restored(self) -> list[Restored]:
        return list(self._restored.values())

    def is_retired(self, attempt: int, rollout_id: str) -> bool:
        return attempt in self._retired_attempts or (rollout_id, attempt) in self._retired

    def begin(
        self,
        rollout_id: str,
        attempt: int,
        first: Boundary,
        *,
        key: str = "",
        digest: str | None = None,
    ) -> Episode:
        """Register an episode: claim a restored boundary of this attempt, or start at `first`.

        Raises `AttemptRetired`, `EpisodeExists` (a live episode of the same rollout and key),
        `TaskMismatch` (a restored boundary recorded another task) or `StaleAttempt` (a restored
        boundary belongs to a later attempt than the caller's).
        """
        if self.is_retired(attempt, rollout_id):
            raise AttemptRetired(f"attempt {attempt} of {rollout_id} is retired")
        existing = self._live.get((rollout_id, key))
        if existing is not None:
            raise EpisodeExists(existing)
        restored = self._restored.claim(rollout_id, key, attempt, digest)
        episode: Episode
        if restored is not None:
            episode = Episode(
                self,
                rollout_id,
                attempt,
                key,
                restored.boundary,
                restored.digest,
                continued_from=restored.produced_by,
                steps=restored.steps,
                active_seconds=restored.active_seconds,
            )
        else:
            episode = Episode(self, rollout_id, attempt, key, first, digest)
        episode.reached(self.kind)
        self._live[(rollout_id, key)] = episode
        self._ids.add(episode._id)
        if not self._admission_open:
            episode._park_started(self.clock())
        self._notify()
        return episode

    def advance(self, episode: Episode, boundary: Boundary) -> None:
        """Record a boundary outside a step (e.g. after final cleanup)."""
        episode.boundary = boundary
        episode.reached(self.kind)
        self._notify()

    def end(self, episode: Episode) -> None:
        """The episode is over here: forget it and wake whoever waits for it (retire)."""
        if self._live.get((episode.rollout_id, episode.key)) is episode:
            del self._live[(episode.rollout_id, episode.key)]
            self._ids.remove(episode._id)
            self._work.ended(episode.rollout_id, episode.attempt)
        episode.closed = True
        episode.ended.set()
        self._notify()

    def drop_restored(self, rollout_id: str, key: str = "") -> Restored | None:
        restored = self._restored.drop(rollout_id, key)
        if restored is not None:
            self._notify()
        return restored

    # --- steps ----------------------------------------------------------------------------

    @contextmanager
    def guard(self, episode: Episode) -> Iterator[None]:
        """A region a retire may cancel; the cancellation surfaces as `EpisodeCancelled`."""
        if episode.cancelled:
            raise EpisodeCancelled(f"{episode.id} was cancelled")
        with anyio.CancelScope() as scope:
            episode._guards.add(scope)
            try:
                yield
            finally:
                episode._guards.discard(scope)
        if scope.cancelled_caught:
            raise EpisodeCancelled(f"{episode.id} was cancelled")

    async def step(
        self,
        episode: Episode,
        name: str,
        mode: StepMode,
        run: Callable[[], Awaitable[Boundary]],
    ) -> Boundary:
        """Run one step: wait at the gate, run it in `mode`, record the boundary it returns."""
        with self.guard(episode):
            await self.wait_admission()
            remaining = episode.remaining()
            if remaining is not None and remaining <= 0:
                raise EpisodeTimeout(f"{episode.id} used its {self.episode_timeout_s}s budget")
            self._enter(episode, name, mode)
            completed = False
            try:
                deadline = math.inf if remaining is None else self.clock() + remaining
                with anyio.CancelScope(deadline=_loop_deadline(deadline, self.clock)) as timer:
                    episode._timers.add(timer)
                    try:
                        boundary = await run()
                    finally:
                        episode._timers.discard(timer)
                if timer.cancelled_caught:
                    raise EpisodeTimeout(f"{episode.id} ran out of time in step {name!r}")
                if mode is StepMode.REPLAY and not self._admission_open:
                    # The checkpoint already reported this episode at its previous boundary:
                    # hold the result until the checkpoint's outcome is known.
                    episode.holding = True
                    if self.observer is not None:
                        self.observer(episode, name, "held")
                    try:
                        await self.wait_admission()
                    finally:
                        episode.holding = False
                completed = True
            finally:
                self._leave(episode, name, mode, completed)
            episode.boundary = boundary
            episode.steps_completed += 1
            episode.reached(self.kind)
            self._work.progressed(
                episode.rollout_id, episode.key, episode.attempt, episode.steps_completed
            )
            self._notify()
            return boundary

    def _enter(self, episode: Episode, name: str, mode: StepMode) -> None:
        if mode is StepMode.WAIT:
            if not episode._wait_steps and not episode._cleaning:
                self._blocking += 1
            episode._wait_steps += 1
        else:
            episode._replay_steps += 1
        episode.current_step = name
        if self.observer is not None:
            self.observer(episode, name, "started")
        self._notify()

    def _leave(self, episode: Episode, name: str, mode: StepMode, completed: bool) -> None:
        if mode is StepMode.WAIT:
            episode._wait_steps -= 1
            if not episode._wait_steps and not episode._cleaning:
                self._blocking -= 1
            if not self._admission_open and episode.parked:
                episode._park_started(self.clock())
        else:
            episode._replay_steps -= 1
        if not episode.running:
            episode.current_step = None
        if self.observer is not None:
            self.observer(episode, name, "completed" if completed else "failed")
        self._notify()

    @asynccontextmanager
    async def cleanup(self, episode: Episode) -> AsyncIterator[None]:
        """Final cleanup: shielded from every cancellation, waited for by checkpoints.

        From here on a retire no longer cancels the episode; it waits for `ended` instead.
        """
        episode.cleanup_started = True
        if not episode._wait_steps and not episode._cleaning:
            self._blocking += 1
        episode._cleaning = True
        if self.observer is not None:
            self.observer(episode, "cleanup", "started")
        self._notify()
        completed = False
        try:
            with anyio.CancelScope(shield=True):
                yield
                completed = True
        finally:
            episode._cleaning = False
            if not episode._wait_steps:
                self._blocking -= 1
            if not self._admission_open:
                episode._park_started(self.clock())
            if self.observer is not None:
                self.observer(episode, "cleanup", "completed" if completed else "failed")
            episode.ended.set()
            self._notify()

    async def hold(self, episode: Episode) -> None:
        """Deliver only outside a checkpoint: the episode stays parked (and exported) meanwhile.

        Used before a server replies with an episode's final result, so a reply never leaves
        while the checkpoint that will be restored still thinks the episode is unfinished.
        """
        if not self._admission_open:
            episode.holding = True
            try:
                await self.wait_admission()
            finally:
                episode.holding = False

    # --- the participant side -------------------------------------------------------------

    async def park(self, deadline_ts: float) -> ParkState:
        """Wait until no live episode is inside a wait step or cleanup, or until the deadline.

        `deadline_ts` is wall-clock (unix seconds), as on the wire.
        """
        while True:
            changed = self._changed
            if not self._blocking:
                # nothing blocks: every live and restored episode is parked, and their ids and
                # digest are kept as they come and go (no pass over the episodes in the pause)
                return ParkState(parked=self._ids.ids(), parked_sha256=self._ids.digest())
            # one pass, `parked` inline, ids unique by (rollout, attempt) as `_unique` makes
            # them: this runs inside every checkpoint's pause, over every live episode
            parked: dict[tuple[str, int], EpisodeId] = {}
            blockers: dict[tuple[str, int], EpisodeId] = {}
            for ep in self._live.values():
                into = blockers if ep._wait_steps or ep._cleaning else parked
                into.setdefault((ep.rollout_id, ep.attempt), ep._id)
            if not blockers or time.time() >= deadline_ts:
                for r in self._restored.values():
                    parked.setdefault((r.rollout_id, r.attempt), r.id)
                return ParkState(parked=list(parked.values()), blockers=list(blockers.values()))
            with anyio.move_on_after(max(0.0, deadline_ts - time.time())):
                await changed.wait()

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        """Boundaries of parked episodes and unclaimed restored ones, limited to `scope`."""
        return [encoded.record for encoded in self.export_encoded(scope)]

    def export_encoded(self, scope: frozenset[str] | None) -> list[EncodedRecord]:
        """`export`, encoded: the records as they were encoded when each boundary was reached
        (a checkpoint collects them; nothing is built or serialised here)."""
        kind = self.kind
        # `parked` inline, and the record as `reached` encoded it: this runs inside the pause
        encoded = [
            ep._encoded or ep.encode(kind)
            for ep in self._live.values()
            if not ep._wait_steps and not ep._cleaning and (scope is None or ep.rollout_id in scope)
        ]
        encoded.extend(
            r.encode(kind)
            for r in self._restored.values()
            if scope is None or r.rollout_id in scope
        )
        return encoded

    def release_outside(self, scope: frozenset[str]) -> list[EpisodeId]:
        """Drop restored boundaries the commit scope does not continue."""
        ids = self._restored.release_outside(scope)
        if ids:
            self._notify()
        return ids

    def validate(self, records: Sequence[Record]) -> None:
        """Raise `ValueError` naming the first record this runtime cannot install."""
        _validate(records, self.kind)

    def install(self, records: Iterable[Record], attempt: int) -> list[EpisodeId]:
        """Install validated records under `attempt`; they wait for that attempt to claim them."""
        installed = self._restored.install(records, attempt, self.kind)
        self._notify()
        return installed

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        """Stop `attempt`'s episodes (None: all), wait until they have ended, refuse them after.

        An episode whose final cleanup has started is not cancelled; the retire waits for it.
        An episode without a driver (a session driven by requests) ends once its in-flight
        steps have unwound.
        """
        if rollout_ids is None:
            self._retired_attempts.add(attempt)
        else:
            self._retired.update((rid, attempt) for rid in rollout_ids)
        targets = [
            ep
            for ep in self._live.values()
            if ep.attempt == attempt and (rollout_ids is None or ep.rollout_id in rollout_ids)
        ]
        for episode in targets:
            if not episode.cleanup_started:
                self._work.cancelled(episode.rollout_id, episode.attempt)
                episode.cancel()
        for episode in targets:
            while not episode.ended.is_set():
                changed = self._changed
                if not episode.running and not episode.cleanup_started and not episode._drivers:
                    self.end(episode)
                    break
                await changed.wait()
        retired = [ep.id for ep in targets] + self._restored.retire(attempt, rollout_ids)
        self._notify()
        if rollout_ids is not None:
            retired.extend(EpisodeId(rollout_id=rid, attempt=attempt) for rid in rollout_ids)
        return _unique(retired)

    def forget(self, rollout_ids: frozenset[str]) -> int:
        """Drop the retire marks of finished rollouts; returns how many marks were dropped."""
        marks = {m for m in self._retired if m[0] in rollout_ids}
        self._retired -= marks
        return len(marks)

    def counts(self) -> EpisodeCounts:
        live = self._live.values()
        return EpisodeCounts(
            live=len({ep.rollout_id for ep in live}),
            parked=len({ep.rollout_id for ep in live if ep.parked}),
            restored=len({r.rollout_id for r in self._restored.values()}),
        )

    @contextmanager
    def driving(self, episode: Episode) -> Iterator[None]:
        """Mark `episode` as driven by a task: a retire waits for that task to end it."""
        episode._drivers += 1
        try:
            yield
        finally:
            episode._drivers -= 1
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class _WorkSince:
    """The work done since the last checkpoint (what a retire may count as lost), bounded."""

    def __init__(self) -> None:
        self._progress: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        """(rollout, key) -> (attempt, steps completed) of every episode that completed a step
        since `forget` (the last checkpoint): what a retire may count as lost."""
        self._ended: OrderedDict[tuple[str, int], None] = OrderedDict()
        """(rollout, attempt) of the episodes that ended since `forget`."""
        self._cancelled: set[tuple[str, int]] = set()
        """(rollout, attempt) of the episodes a retire cancelled: they ended without finishing."""

    def progress(self, attempt: int) -> dict[tuple[str, str], int]:
        return {ident: steps for ident, (a, steps) in self._progress.items() if a == attempt}

    def ended_since(self, attempt: int) -> set[str]:
        return {rid for rid, a in self._ended if a == attempt and (rid, a) not in self._cancelled}

    def forget(self) -> None:
        self._progress.clear()
        self._ended.clear()
        self._cancelled.clear()

    def progressed(self, rollout_id: str, key: str, attempt: int, steps: int) -> None:
        ident = (rollout_id, key)
        self._progress[ident] = (attempt, steps)
        self._progress.move_to_end(ident)
        while len(self._progress) > MAX_PROGRESS_KEPT:
            self._progress.popitem(last=False)

    def ended(self, rollout_id: str, attempt: int) -> None:
        self._ended[(rollout_id, attempt)] = None
        while len(self._ended) > MAX_PROGRESS_KEPT:
            self._ended.popitem(last=False)

    def cancelled(self, rollout_id: str, attempt: int) -> None:
        self._cancelled.add((rollout_id, attempt))


def _validate(records: Sequence[Record], kind: str) -> None:
    """Raise `ValueError` naming the first record a runtime of `kind` cannot install."""
    seen: set[tuple[str, str]] = set()
    for i, record in enumerate(records):
        if record.kind != kind:
            raise ValueError(f"record {i}: kind {record.kind!r}, expected {kind!r}")
        try:
            BoundaryData.model_validate(record.data)
        except ValidationError as exc:
            raise ValueError(f"record {i} ({record.rollout_id}): {exc}") from exc
        ident = (record.rollout_id, record.key)
        if ident in seen:
            raise ValueError(f"record {i}: duplicate boundary for {record.rollout_id}")
        seen.add(ident)


class _RestoredBoundaries:
    """The boundaries a restore installed, by (rollout, key), until their attempt claims them
    (`claim`), a commit scope or a retire drops them; their ids are kept in the runtime's id
    set (`_IdSet`) as they come and go."""

    def __init__(self, ids: _IdSet) -> None:
        self._by_key: dict[tuple[str, str], Restored] = {}
        self._ids = ids

    def get(self, ident: tuple[str, str]) -> Restored | None:
        return self._by_key.get(ident)

    def values(self) -> ValuesView[Restored]:
        return self._by_key.values()

    def claim(self, rollout_id: str, key: str, attempt: int, digest: str | None) -> Restored | None:
        """The boundary `attempt` continues, taken out; None when it starts afresh (an older
        attempt's leftover is dropped then). Raises `StaleAttempt` or `TaskMismatch` before
        anything changes."""
        restored = self._by_key.get((rollout_id, key))
        if restored is None:
            return None
        if restored.attempt > attempt:
            raise StaleAttempt(
                f"{rollout_id} was restored under attempt {restored.attempt}; "
                f"the call names attempt {attempt}"
            )
        if restored.attempt == attempt:
            if digest is not None and restored.digest is not None and digest != restored.digest:
                raise TaskMismatch(
                    f"{rollout_id}: the task does not match the one its checkpoint recorded"
                )
            self.drop(rollout_id, key)
            return restored
        # an older attempt's leftover (its attempt was never continued): superseded
        log.warning("dropping restored %s superseded by attempt %d", restored.id, attempt)
        self.drop(rollout_id, key)
        return None

    def drop(self, rollout_id: str, key: str) -> Restored | None:
        restored = self._by_key.pop((rollout_id, key), None)
        if restored is not None:
            self._ids.remove(restored.id)
        return restored

    def release_outside(self, scope: frozenset[str]) -> list[EpisodeId]:
        released = [k for k, r in self._by_key.items() if r.rollout_id not in scope]
        ids = _unique(self._by_key[k].id for k in released)
        for k in released:
            self._ids.remove(self._by_key.pop(k).id)
        return ids

    def install(self, records: Iterable[Record], attempt: int, kind: str) -> list[EpisodeId]:
        installed: list[EpisodeId] = []
        for record in records:
            restored = Restored.of(record, attempt)
            restored.encode(kind)
            replaced = self._by_key.get((record.rollout_id, record.key))
            if replaced is not None:
                self._ids.remove(replaced.id)
            self._by_key[(record.rollout_id, record.key)] = restored
            self._ids.add(restored.id)
            installed.append(restored.id)
        return _unique(installed)

    def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        """Drop the boundaries of `attempt` (of `rollout_ids`); their ids, in install order."""
        dropped = [
            k
            for k, r in self._by_key.items()
            if r.attempt == attempt and (rollout_ids is None or r.rollout_id in rollout_ids)
        ]
        retired = [self._by_key[k].id for k in dropped]
        for k in dropped:
            self._ids.remove(self._by_key.pop(k).id)
        return retired


class _IdSet:
    """Episode ids by (rollout, attempt), counted (a rollout may have several keys live or
    restored), with their set digest (`episodes_digest`) updated on every first add and last
    remove."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], EpisodeId] = {}
        self._refs: dict[tuple[str, int], int] = {}
        self._sum = 0

    def add(self, ident: EpisodeId) -> None:
        k = (ident.rollout_id, ident.attempt)
        refs = self._refs.get(k, 0)
        self._refs[k] = refs + 1
        if not refs:
            self._ids[k] = ident
            self._sum = (self._sum + episode_id_hash(*k)) % DIGEST_MODULUS

    def remove(self, ident: EpisodeId) -> None:
        k = (ident.rollout_id, ident.attempt)
        refs = self._refs.get(k, 0)
        if refs > 1:
            self._refs[k] = refs - 1
        elif refs == 1:
            del self._refs[k]
            del self._ids[k]
            self._sum = (self._sum - episode_id_hash(*k)) % DIGEST_MODULUS

    def ids(self) -> list[EpisodeId]:
        return list(self._ids.values())

    def digest(self) -> str:
        return f"{self._sum:064x}"


def _loop_deadline(deadline: float, clock: Callable[[], float]) -> float:
    """Translate a deadline on the runtime clock to the event loop's clock."""
    if math.isinf(deadline):
        return deadline
    return anyio.current_time() + (deadline - clock())


def _unique(ids: Iterable[EpisodeId]) -> list[EpisodeId]:
    seen: dict[tuple[str, int], EpisodeId] = {}
    for ident in ids:
        seen.setdefault((ident.rollout_id, ident.attempt), ident)
    return list(seen.values())


# --- the generic participant ------------------------------------------------------------------

MAX_PROGRESS_KEPT: Final = 200_000
"""Episodes whose progress since the last checkpoint a runtime remembers (oldest dropped)."""

STEPS_COUNTER: Final = "steps"
"""The work counter of completed episode steps (`RestoreReply.kept`, `RetireReply.lost`)."""


def _record_steps(record: Record) -> int:
    """The steps a boundary record's episode had completed (0 when the record says none)."""
    steps = record.data.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 0


class RuntimeParticipant(Participant):
    """The checkpoint participant of a server whose state is one `EpisodeRuntime`.

    Servers with extra state (the model server's delivered responses) subclass it and add their
    records in `export`/`install`; the phases, leases and storage stay in the control plane.
    """

    def __init__(
        self,
        role: Role,
        runtime: EpisodeRuntime,
        *,
        on_event: Callable[[str, str | None], None] | None = None,
        on_rewire: Callable[[Mapping[Role, str]], None] | None = None,
        work_counter: str | None = STEPS_COUNTER,
        is_finished: Callable[[str, int], bool] | None = None,
    ) -> None:
        self.role = role
        self.runtime = runtime
        self._on_event = on_event
        self._on_rewire = on_rewire
        self.work_counter = work_counter
        """The counter this participant reports its episodes' completed steps as (restore's
        `kept`, retire's `lost`); None: it reports no work of its own, as counted elsewhere
        (a server whose steps repeat its callers' steps, like the reference resources
        server): empty counts, so its silence is not mistaken for work nobody counted.

        `is_finished(rollout_id, attempt)`: whether an episode that ended had finished (its
        result was returned); default: every episode that ended before a retire counts as
        finished (an agent's session ends when its environment closes it)."""
        self._checkpointed_records: Sequence[Record] = ()
        """The records of the last checkpoint committed or restored (kept as they are: the
        steps they hold are only counted when a retire asks, not inside the pause)."""
        self._checkpointed_steps: dict[tuple[str, str], int] | None = {}
        """Steps each episode had completed in that checkpoint (None: not counted yet)."""
        self._finished: dict[int, set[str]] = {}
        """By attempt: the rollouts `finished_rollouts` said finished (read after the retire:
        episodes in their final cleanup finish while it waits; those it cancelled did not)."""
        self._is_finished = is_finished

    def _event(self, name: str, rollout_id: str | None = None) -> None:
        """Tell observers (the servers' debug hooks) how far a control call got."""
        if self._on_event is not None:
            self._on_event(name, rollout_id)

    async def close_admission(self) -> None:
        self.runtime.close_admission()
        self._event("close_admission")

    async def park(self, deadline_ts: float) -> ParkState:
        self._event("park")
        state = await self.runtime.park(deadline_ts)
        self._event("parked" if state.ready else "park_blocked")
        return state

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        return self.runtime.export(scope)

    def export_encoded(self, scope: frozenset[str] | None) -> list[EncodedRecord]:
        return self.runtime.export_encoded(scope)

    def committed_episodes(self, records: Sequence[EncodedRecord]) -> int | None:
        """The rollouts of the runtime's own records among them (a server may add records of
        another kind, such as the model's delivered responses, which are no episode)."""
        kind = self.runtime.kind
        return len({item.record.rollout_id for item in records if item.record.kind == kind})

    def release_outside(self, scope: frozenset[str]) -> None:
        self.runtime.release_outside(scope)

    def validate(self, records: Sequence[Record]) -> None:
        self.runtime.validate(records)

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        # Nothing may continue before the coordinator resumes: restored episodes claimed early
        # wait at the gate.
        self.runtime.close_admission()
        installed = self.runtime.install(records, attempt)
        self._event("installed")
        return installed

    async def reopen(self) -> None:
        self.runtime.reopen()
        self._event("reopen")

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        for rollout_id in rollout_ids or (None,):
            self._event("retiring", rollout_id)
        retired = await self.runtime.retire(attempt, rollout_ids)
        self._event("retired")
        return retired

    def checkpointed(self, checkpoint_id: str, records: Sequence[Record]) -> None:
        self._checkpointed_records = records
        self._checkpointed_steps = None
        self._finished.clear()
        self.runtime.forget_progress()

    def _steps_checkpointed(self) -> dict[tuple[str, str], int]:
        if self._checkpointed_steps is None:
            kind = self.runtime.kind
            self._checkpointed_steps = {
                (r.rollout_id, r.key): _record_steps(r)
                for r in self._checkpointed_records
                if r.kind == kind
            }
            self._checkpointed_records = ()
        return self._checkpointed_steps

    def kept_work(self, records: Sequence[Record]) -> dict[str, int] | None:
        if self.work_counter is None:
            return {}  # its work is counted elsewhere: nothing of its own to report
        kept = sum(_record_steps(r) for r in records if r.kind == self.runtime.kind)
        return {self.work_counter: kept}

    def finished_rollouts(self, attempt: int) -> list[str] | None:
        ended = self.runtime.ended_since(attempt)
        if self._is_finished is not None:
            ended = {rid for rid in ended if self._is_finished(rid, attempt)}
        self._finished[attempt] = ended
        return sorted(ended)

    def lost_work(self, attempt: int, finished: frozenset[str] | None) -> dict[str, int] | None:
        """Steps the episodes of `attempt` completed after the last checkpoint (all of an
        episode's steps when the checkpoint does not hold it: it starts over), except those
        of finished rollouts."""
        own = self._finished.pop(attempt, set())
        done = own if finished is None else finished
        if self.work_counter is None:
            return {}
        checkpointed = self._steps_checkpointed()
        lost = sum(
            max(0, steps - checkpointed.get(ident, 0))
            for ident, steps in self.runtime.progress(attempt).items()
            if ident[0] not in done
        )
        return {self.work_counter: lost}

    def forget(self, rollout_ids: frozenset[str]) -> int:
        return self.runtime.forget(rollout_ids)

    def counts(self) -> EpisodeCounts:
        return self.runtime.counts()

    def rewire(self, peers: Mapping[Role, str]) -> None:
        """Hand the new peer URLs to the server (`on_rewire`); refuse without one."""
        if self._on_rewire is None:
            super().rewire(peers)
            return
        self._on_rewire(peers)
