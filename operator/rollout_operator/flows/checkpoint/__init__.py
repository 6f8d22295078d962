"""The RolloutCheckpoint flow (docs/design.md#61-checkpoint): prepare, the cut, resume, persist,
publish, as a table of phase steps.

One module per group of phases, each step a function of the run (`context.CheckpointRun`) and
the checkpoint: `slot` (Pending and Queued: the operator's and the set's slots), `prepare`
(the deadline, then Preparing), `commit` (Committing: the cut), `resume` (Resuming),
`persist` (Persisting, ending in the publish: the commit point); `flow` holds the table (Ready
and Failed included, and how a failed step ends) and `CheckpointFlow`, which runs it with the
runner the recovery shares (`flows/phases.py`). This package's names are the flow's public
surface for the handlers and the tests.
"""

from __future__ import annotations

from .context import IN_FLIGHT, TERMINAL, CheckpointFailed, FlowSettings
from .flow import PHASES, CheckpointFlow

__all__ = [
    "IN_FLIGHT",
    "PHASES",
    "TERMINAL",
    "CheckpointFailed",
    "CheckpointFlow",
    "FlowSettings",
]
