"""Setting and merging `metav1.Condition` lists.

Conditions are the API's answer to "is it safe, and since when": `lastTransitionTime` must move
only when a condition's status flips, otherwise "since when" is a lie and alerts that fire on
"Degraded for more than 10 minutes" never fire. Every writer of a status (the set reconciler, the
recovery flow, the checkpoint flow) goes through `set_condition`, so the rule holds everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from .api import Condition, ConditionStatus


@dataclass(frozen=True)
class ConditionUpdate:
    """A computed condition before it is merged: no transition time of its own."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""

    @classmethod
    def of(cls, type_: str, status: bool, reason: str, message: str = "") -> ConditionUpdate:
        return cls(
            type_, ConditionStatus.TRUE if status else ConditionStatus.FALSE, reason, message
        )


MAX_MESSAGE_CHARS: Final = 32768
"""The most characters of a message the operator writes into a status (a condition's message:
Kubernetes' own bound on `metav1.Condition.message`, which the API server enforces too). Text a
participant sent (an error's detail) is untrusted and may be of any size: every message is cut
to this by `truncate` (docs/operations.md, "Failure modes")."""
MAX_FAILURE_CHARS: Final = 1024
"""The most characters of one participant's failure quoted in a message (several are listed)."""


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to at most `limit` characters, saying how much was left out, so a status or an
    Event never carries a message of unbounded size and a reader sees that it was cut."""
    if len(text) <= limit:
        return text
    marker = f"... (cut: {len(text)} characters in all)"
    if len(marker) >= limit:
        return text[:limit]
    return text[: limit - len(marker)] + marker


def utcnow() -> datetime:
    """Now, in UTC, truncated to whole seconds (`metav1.Time` has no sub-second part)."""
    return datetime.now(UTC).replace(microsecond=0)


def find_condition(conditions: Iterable[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: Iterable[Condition], type_: str) -> bool:
    found = find_condition(conditions, type_)
    return found is not None and found.status is ConditionStatus.TRUE


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus | bool,
    reason: str,
    message: str = "",
    *,
    observed_generation: int | None = None,
    now: datetime | None = None,
) -> list[Condition]:
    """A new list with condition `type_` set; the others are kept in their order.

    `lastTransitionTime` is carried over when the status does not change, and set to `now`
    when it does (or when the condition is new). Reason, message and observedGeneration are
    always updated: they describe the latest observation.
    """
    if isinstance(status, bool):
        status = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    previous = find_condition(conditions, type_)
    if previous is not None and previous.status is status:
        transition = previous.last_transition_time
    else:
        transition = now if now is not None else utcnow()
    updated = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=truncate(message),
        last_transition_time=transition,
        observed_generation=observed_generation,
    )
    result = [updated if c.type == type_ else c for c in conditions]
    if previous is None:
        result.append(updated)
    return result


def merge_conditions(
    current: Sequence[Condition],
    updates: Iterable[ConditionUpdate],
    *,
    observed_generation: int | None = None,
    now: datetime | None = None,
) -> list[Condition]:
    """Apply several computed conditions at once, each with `set_condition`'s rules."""
    result = list(current)
    for update in updates:
        result = set_condition(
            result,
            update.type,
            update.status,
            update.reason,
            update.message,
            observed_generation=observed_generation,
            now=now,
        )
    return result


def same_conditions(a: Sequence[Condition], b: Sequence[Condition]) -> bool:
    """Whether two lists say the same thing, so an unchanged status is not written again."""
    return [c.model_dump() for c in a] == [c.model_dump() for c in b]


def same_but_generation(a: Sequence[Condition], b: Sequence[Condition]) -> bool:
    """Whether two lists say the same thing but for their observedGeneration, so a spec change
    alone does not rewrite conditions that did not change (the policy's and the queue's)."""
    return same_conditions(
        [c.model_copy(update={"observed_generation": None}) for c in a],
        [c.model_copy(update={"observed_generation": None}) for c in b],
    )
