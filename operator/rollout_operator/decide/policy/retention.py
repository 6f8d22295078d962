"""The retention policy (`checkpointPolicy.keepLatest`, docs/design.md#65-retention-and-records):
which finished checkpoints to delete."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .views import CheckpointView


def retention(
    checkpoints: Sequence[CheckpointView], keep_latest: int, protected: Iterable[str | None]
) -> list[str]:
    """The checkpoints to delete: Ready ones beyond the newest `keep_latest`, and Failed ones
    beyond the newest `keep_latest` (their records are removed at once; the objects stay a
    while to show why they failed). Never a protected one (the set's latest, the one a recovery
    restores) and never an unfinished one."""
    keep = {name for name in protected if name}

    def newest_first(items: Iterable[CheckpointView]) -> list[CheckpointView]:
        return sorted(items, key=lambda c: (c.completed or c.created, c.created), reverse=True)

    live = [c for c in checkpoints if not c.deleting]
    doomed: list[str] = []
    for group in (
        newest_first(c for c in live if c.ready),
        newest_first(c for c in live if c.failed),
    ):
        doomed.extend(c.name for c in group[keep_latest:] if c.name not in keep)
    return doomed
