"""A checkpoint participant whose cost the test controls, for the policy's end-to-end tests.

    python tests/e2e/policy_participant.py --control-dir DIR [--episodes N]

It runs the real control plane (`rollout_protocol.ControlPlane`: phases, leases, records
on storage, restore verification) over a participant whose episodes are counters that advance
every 50 ms while admission is open, so every checkpoint captures real, growing state and a
restore can be checked (`GET /state`). What the reference servers cannot give a test is a
checkpoint of a chosen cost, so parking reads two files in `--control-dir`, which the test
writes while the pod runs:

- `park-delay`: seconds every prepare takes (a participant made slow on purpose);
- `gate`: while this file exists, prepare waits (up to its deadline), so a test holds a
  checkpoint in Preparing and lets it go on a condition, without sleeping.

devcluster runs pods as host processes, so the folder is a plain host path here.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI
from rollout_protocol import (
    ControlPlane,
    ControlSettings,
    EpisodeCounts,
    EpisodeId,
    ParkState,
    Participant,
    Record,
    Role,
)

TICK_SECONDS = 0.05


class CounterParticipant(Participant):
    def __init__(self, role: Role, control_dir: Path, episodes: int, attempt: int) -> None:
        self.role = role
        self.control_dir = control_dir
        self.attempt = attempt
        self.steps = {f"ep-{i}": 0 for i in range(episodes)}
        self.restored_from: dict[str, int] = {}
        self.open = True

    async def tick(self) -> None:
        while True:
            await anyio.sleep(TICK_SECONDS)
            if self.open:
                for rollout in self.steps:
                    self.steps[rollout] += 1

    def _episodes(self) -> list[EpisodeId]:
        return [EpisodeId(rollout_id=r, attempt=self.attempt) for r in sorted(self.steps)]

    async def close_admission(self) -> None:
        self.open = False

    async def park(self, deadline_ts: float) -> ParkState:
        delay_file = self.control_dir / "park-delay"
        delay = float(delay_file.read_text()) if delay_file.exists() else 0.0
        with anyio.move_on_after(max(0.0, min(delay, deadline_ts - time.time()))):
            await anyio.sleep(delay)
        gate = self.control_dir / "gate"
        while gate.exists() and time.time() < deadline_ts:  # noqa: ASYNC110 - a file, no event
            await anyio.sleep(0.05)
        if gate.exists():
            return ParkState(blockers=self._episodes())
        return ParkState(parked=self._episodes())

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        return [
            Record(kind="counter", rollout_id=r, attempt=self.attempt, data={"step": step})
            for r, step in sorted(self.steps.items())
            if scope is None or r in scope
        ]

    def release_outside(self, scope: frozenset[str]) -> None:
        return None

    def validate(self, records: Sequence[Record]) -> None:
        for record in records:
            if record.kind != "counter" or not isinstance(record.data.get("step"), int):
                raise ValueError(f"not a counter record: {record}")

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        self.attempt = attempt
        for record in records:
            self.steps[record.rollout_id] = int(record.data["step"])
            self.restored_from[record.rollout_id] = int(record.data["step"])
        return [EpisodeId(rollout_id=r.rollout_id, attempt=attempt) for r in records]

    async def reopen(self) -> None:
        self.open = True

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        return []

    def forget(self, rollout_ids: frozenset[str]) -> int:
        return 0

    def counts(self) -> EpisodeCounts:
        live = len(self.steps)
        return EpisodeCounts(live=live, parked=0 if self.open else live)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--control-dir", type=Path, required=True)
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    role = Role(os.environ.get("ROLLOUT_ROLE", "environment"))
    settings = ControlSettings.from_env(role)
    participant = CounterParticipant(role, args.control_dir, args.episodes, settings.attempt)
    plane = ControlPlane(participant, settings)
    app = FastAPI()
    plane.install(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/state")
    async def state() -> dict[str, Any]:
        return {
            "attempt": participant.attempt,
            "steps": participant.steps,
            "restored_from": participant.restored_from,
        }

    async def serve() -> None:
        config = uvicorn.Config(
            app, host=os.environ["ROLLOUT_POD_IP"], port=args.port, log_level="warning"
        )
        async with anyio.create_task_group() as group:
            group.start_soon(participant.tick)
            await uvicorn.Server(config).serve()
            group.cancel_scope.cancel()

    anyio.run(serve)


if __name__ == "__main__":
    main()
