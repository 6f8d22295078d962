"""What speaking NeMo Gym's control dialect costs a checkpoint, against ours, in one run.

Four participants (one per role, each a control plane on the SDK over a participant holding
`--episodes` parked episodes) are served on loopback with uvicorn, in this process; a
`Coordinator` takes checkpoints of them (prepare, commit with records written and fsynced,
resume). Three sets, measured in rotation (each goes first, second and third in turn) so a
drifting machine, or one set's writeback, affects each alike:

  ours         every participant mounts our dialect
  gym-env      the environment mounts only Gym's (the e2e test's mix), the others ours
  gym-all      every participant mounts only Gym's

  pause        prepare start -> resume done, as the coordinator measures it (median)
  ratio        pause / ours' pause

Each set's clients read the participants' capabilities once, before the first measured
checkpoint (the operator does it once per pod address); the probe itself is timed apart
(`probe`, the median of one `GET /ng-control/v1/capabilities` per participant).

Prints a table; asserts nothing. Run: `.venv/bin/python bench/gym_dialect.py [--episodes N]
[--repeats N]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
from fastapi import FastAPI
from rollout_protocol import (
    ControlPlane,
    ControlSettings,
    Coordinator,
    Dialect,
    EpisodeCounts,
    EpisodeId,
    HttpParticipantClient,
    ParkState,
    Participant,
    Record,
    Role,
)
from rollout_protocol.conformance import serve_app

TOKEN = "bench-gym-dialect"
SETS: dict[str, frozenset[Role]] = {
    "ours": frozenset(),
    "gym-env": frozenset({Role.ENVIRONMENT}),
    "gym-all": frozenset(Role),
}
"""Each set by the roles that mount only Gym's dialect."""


class Parked(Participant):
    """A participant whose episodes are all parked at a boundary, each one small record."""

    def __init__(self, role: Role, episodes: int) -> None:
        self.role = role
        self.episodes = [EpisodeId(rollout_id=f"r{i}", attempt=0) for i in range(episodes)]

    async def close_admission(self) -> None:
        pass

    async def park(self, deadline_ts: float) -> ParkState:
        return ParkState(parked=list(self.episodes))

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        return [
            Record("boundary", e.rollout_id, e.attempt, data={"step": "s1", "turn": 3})
            for e in self.episodes
            if scope is None or e.rollout_id in scope
        ]

    def release_outside(self, scope: frozenset[str]) -> None:
        pass

    def validate(self, records: Sequence[Record]) -> None:
        pass

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        return [EpisodeId(rollout_id=r.rollout_id, attempt=attempt) for r in records]

    async def reopen(self) -> None:
        pass

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        return []

    def forget(self, rollout_ids: frozenset[str]) -> int:
        return 0

    def counts(self) -> EpisodeCounts:
        return EpisodeCounts(live=len(self.episodes), parked=len(self.episodes))


async def measure(episodes: int, repeats: int) -> None:
    pauses: dict[str, list[float]] = {name: [] for name in SETS}
    probes: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-gym-") as folder:
        root = Path(folder)
        async with AsyncExitStack() as stack:
            coordinators: dict[str, Coordinator] = {}
            for name, gym_roles in SETS.items():
                clients: list[HttpParticipantClient] = []
                for role in Role:
                    settings = ControlSettings(
                        role,
                        set_name=name,
                        checkpoint_root=root,
                        token=TOKEN,
                        dialects=(Dialect.GYM,) if role in gym_roles else (Dialect.ROLLOUT,),
                    )
                    app = FastAPI()
                    ControlPlane(Parked(role, episodes), settings).install(app)
                    served = await stack.enter_async_context(serve_app(app, role=role, token=TOKEN))
                    client = HttpParticipantClient(role, served.target.base_url, token=TOKEN)
                    await stack.enter_async_context(client)
                    started = time.perf_counter()
                    await client.status(time.time() + 10)  # reads the capabilities first
                    probes.append(time.perf_counter() - started)
                    clients.append(client)
                coordinators[name] = Coordinator(clients)
            names = list(coordinators)
            for repeat in range(repeats):
                shift = repeat % len(names)  # each set goes first, second, third in turn
                for name in names[shift:] + names[:shift]:
                    coordinator = coordinators[name]
                    result = await coordinator.checkpoint(
                        f"{name}-{repeat}", prepare_timeout=30, commit_timeout=30
                    )
                    if not result.ok:
                        raise SystemExit(f"{name}: checkpoint failed: {result.message}")
                    pauses[name].append(result.durations.pause_seconds)
    baseline = statistics.median(pauses["ours"])
    print(f"{episodes} parked episodes per participant, 4 participants, {repeats} checkpoints")
    print(f"{'set':<10} {'pause ms (median)':>18} {'ratio':>7}")
    for name, values in pauses.items():
        median = statistics.median(values)
        print(f"{name:<10} {median * 1000:>18.1f} {median / baseline:>7.2f}")
    probe_ms = statistics.median(probes) * 1000
    print(f"first status with the capabilities probe: median {probe_ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    anyio.run(measure, args.episodes, args.repeats, backend="asyncio")


if __name__ == "__main__":
    main()
