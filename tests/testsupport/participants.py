"""An in-process participant for control-plane and coordinator tests.

It sits below the layer those tests are about: its episodes are plain dictionaries, but it keeps
the contract honestly (admission, parking until a deadline, export by scope, install under an
attempt), and it journals every hook call so tests can assert order without timing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import anyio
from rollout_protocol import EpisodeCounts, EpisodeId, ParkState, Participant, Record, Role


class FakeParticipant(Participant):
    def __init__(
        self,
        role: Role = Role.ENVIRONMENT,
        *,
        index: int = 0,
        rollouts: Iterable[str] = (),
        attempt: int = 0,
        journal: list[tuple[str, str]] | None = None,
    ) -> None:
        self.role = role
        self.instance = f"{role.value}-{index}"
        self.live: dict[str, int] = {rollout: attempt for rollout in rollouts}
        self.steps: dict[str, int] = dict.fromkeys(self.live, 1)
        self.restored: set[str] = set()
        self.stuck: set[str] = set()
        """Rollouts inside a wait-mode step: blockers until `unblock()`."""
        self.restarts: set[str] = set()
        self.admission_open = True
        self.journal = journal if journal is not None else []
        self.park_calls = 0
        self.export_calls = 0
        self.install_calls = 0
        self.installed: list[Record] = []
        self.install_attempt: int | None = None
        self.released: set[str] = set()
        self.retired: list[tuple[int, frozenset[str] | None]] = []
        self.forgotten: list[frozenset[str]] = []
        self.refuse_records: str | None = None
        self.reopen_count = 0
        self.reopened = anyio.Event()
        self.park_gate: anyio.Event | None = None
        """When set, `park` first waits for this event (bounded by its deadline)."""
        self.on_park: Callable[[], Awaitable[None]] | None = None
        """Called when `park` starts: lets a test act exactly while this participant parks."""
        self._unblocked = anyio.Event()

    def unblock(self) -> None:
        self.stuck.clear()
        self._unblocked.set()

    def _log(self, operation: str) -> None:
        self.journal.append((self.instance, operation))

    async def close_admission(self) -> None:
        self._log("close_admission")
        self.admission_open = False

    async def park(self, deadline_ts: float) -> ParkState:
        self._log("park")
        self.park_calls += 1
        if self.on_park is not None:
            await self.on_park()
        if self.park_gate is not None:
            with anyio.move_on_after(max(0.0, deadline_ts - time.time())):
                await self.park_gate.wait()
        if self.stuck:
            with anyio.move_on_after(max(0.0, deadline_ts - time.time())):
                await self._unblocked.wait()
        return ParkState(
            parked=[self._episode(r) for r in sorted(self.live) if r not in self.stuck],
            blockers=[self._episode(r) for r in sorted(self.stuck)],
            restarts=[self._episode(r) for r in sorted(self.restarts)],
        )

    def _episode(self, rollout_id: str) -> EpisodeId:
        return EpisodeId(rollout_id=rollout_id, attempt=self.live.get(rollout_id, 0))

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        self._log("export")
        self.export_calls += 1
        return [
            Record(
                kind="boundary",
                rollout_id=rollout,
                attempt=attempt,
                data={"step": self.steps[rollout], "role": self.role.value},
            )
            for rollout, attempt in sorted(self.live.items())
            if (scope is None or rollout in scope) and rollout not in self.restarts
        ]

    def release_outside(self, scope: frozenset[str]) -> None:
        self._log("release_outside")
        for rollout in sorted(self.restored - scope):
            self.restored.discard(rollout)
            self.live.pop(rollout, None)
            self.released.add(rollout)

    def validate(self, records: Sequence[Record]) -> None:
        self._log("validate")
        if self.refuse_records is not None:
            raise ValueError(self.refuse_records)

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        self._log("install")
        self.install_calls += 1
        self.installed = list(records)
        self.install_attempt = attempt
        for record in records:
            self.live[record.rollout_id] = attempt
            self.steps[record.rollout_id] = int(record.data.get("step", 0))
            self.restored.add(record.rollout_id)
        return [EpisodeId(rollout_id=r.rollout_id, attempt=attempt) for r in records]

    async def reopen(self) -> None:
        self._log("reopen")
        self.admission_open = True
        self.reopen_count += 1
        self.reopened.set()

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        self._log("retire")
        self.retired.append((attempt, rollout_ids))
        gone = [
            rollout
            for rollout, live_attempt in sorted(self.live.items())
            if live_attempt == attempt and (rollout_ids is None or rollout in rollout_ids)
        ]
        for rollout in gone:
            self.live.pop(rollout)
            self.restored.discard(rollout)
        return [EpisodeId(rollout_id=rollout, attempt=attempt) for rollout in gone]

    def forget(self, rollout_ids: frozenset[str]) -> int:
        self._log("forget")
        self.forgotten.append(rollout_ids)
        return len(rollout_ids)

    def counts(self) -> EpisodeCounts:
        return EpisodeCounts(
            live=len(self.live),
            parked=0 if self.admission_open else len(self.live) - len(self.stuck),
            restored=len(self.restored),
        )
