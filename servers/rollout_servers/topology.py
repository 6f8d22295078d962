"""Where a trainer finds a rollout set: the attempt it runs and its environment URLs.

`Topology` is the seam between the trainer client (`client`) and what knows the set's
whereabouts: fixed URLs for plain processes (`StaticTopology`), a JSON file rewritten by whoever
restores (`FileTopology`, e.g. a Slurm script), one set in-process (`MutableTopology`, tests and
embedding code), and the RolloutSet's status through the Kubernetes API (`discovery`). Both the
client and `discovery` import these types from here, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class TopologySnapshot(NamedTuple):
    attempt: int
    environments: tuple[str, ...]


@runtime_checkable
class Topology(Protocol):
    """Where the environments are and which attempt they run."""

    async def current(self) -> TopologySnapshot: ...


@runtime_checkable
class WatchableTopology(Topology, Protocol):
    async def wait_newer(self, attempt: int) -> TopologySnapshot:
        """Return once the attempt is greater than `attempt` (the caller applies a deadline)."""
        ...


@dataclass
class StaticTopology:
    """Fixed URLs and attempt: plain processes where nothing is ever restored."""

    environments: Sequence[str]
    attempt: int = 0

    async def current(self) -> TopologySnapshot:
        return TopologySnapshot(self.attempt, tuple(self.environments))


class MutableTopology:
    """Set by whoever restores the servers in the same process (tests, embedding code)."""

    def __init__(self, environments: Sequence[str], attempt: int = 0) -> None:
        self._snapshot = TopologySnapshot(attempt, tuple(environments))
        self._changed = anyio.Event()

    def set(self, attempt: int, environments: Sequence[str] | None = None) -> None:
        urls = self._snapshot.environments if environments is None else tuple(environments)
        self._snapshot = TopologySnapshot(attempt, urls)
        self._changed.set()
        self._changed = anyio.Event()

    async def current(self) -> TopologySnapshot:
        return self._snapshot

    async def wait_newer(self, attempt: int) -> TopologySnapshot:
        while self._snapshot.attempt <= attempt:
            await self._changed.wait()
        return self._snapshot


class TopologyFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    attempt: int = Field(ge=0)
    environments: list[str] = Field(min_length=1)


@dataclass
class FileTopology:
    """`{"attempt": N, "environments": [...]}` in a file, re-read on every look.

    Writers should replace the file atomically (write a temporary file, then rename).
    """

    path: Path

    async def current(self) -> TopologySnapshot:
        text = await anyio.Path(self.path).read_text()
        try:
            data = TopologyFile.model_validate_json(text)
        except ValidationError as error:
            raise ValueError(f"{self.path}: {error}") from error
        return TopologySnapshot(data.attempt, tuple(data.environments))
