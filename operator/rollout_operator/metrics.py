"""Prometheus metrics (docs/design.md#67-observability-and-queues), and the set transitions worth an
Event.

The runner serves the default registry on `--metrics-port` (see `handlers.runtime`). Handlers
feed it with three calls, so the flows themselves stay free of metrics:

- `checkpoint_ended(kube, namespace, name)` (reads it, then `observe_checkpoint`) once a
  checkpoint ended (Ready or Failed): duration and pause
  histograms by set, trigger and outcome; bytes written, episodes continued and restarted;
- `observe_recovery(rset, reason)` from the recovery flow's transition callback: restores by
  outcome (`Restored`, `NoCheckpoint`, `SiblingRestart`, `RestoreFailed`) and the attempt;
  for a finished recovery what `status.lastRecovery` says it kept and lost (pods, episodes,
  model tokens, steps, checkpoint age, seconds per phase);
- `SetTransitions.observe(event_type, body)` for every watch event of a set: the current
  attempt (gauge), and the transitions the flows do not post an Event for themselves.

Labels are the namespace and the set (names are unique per namespace), plus the trigger and
outcome where they apply: all bounded by what users create, never per episode or per pod.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram

from .cluster.kube import Kube
from .model.api import CheckpointPhase, RolloutCheckpoint, RolloutSet, namespace_or_default

DURATION_BUCKETS: Final = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Seconds: a checkpoint takes from well under a second to a long prepare deadline."""
PAUSE_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Seconds with admission closed: what rollouts lose; usually well under a second."""

RESTORE_OUTCOMES: Final = frozenset({"Restored", "NoCheckpoint", "SiblingRestart", "RestoreFailed"})
"""The recovery reasons counted as restores (`model.reasons.Reason` values)."""
FINISHED_RECOVERIES: Final = frozenset({"Restored", "NoCheckpoint", "SiblingRestart"})
"""The reasons a recovery ends with (the set runs again): its costs are observed then."""

CHECKPOINT_DURATION = Histogram(
    "rollout_checkpoint_duration_seconds",
    "Time from the start of a checkpoint to its end (Ready after resume, or Failed).",
    ["namespace", "set", "trigger", "outcome"],
    buckets=DURATION_BUCKETS,
)
CHECKPOINT_PAUSE = Histogram(
    "rollout_checkpoint_pause_seconds",
    "Time the participants' admission was closed for a checkpoint (prepare start to resume).",
    ["namespace", "set", "trigger", "outcome"],
    buckets=PAUSE_BUCKETS,
)
CHECKPOINT_PERSIST = Histogram(
    "rollout_checkpoint_persist_seconds",
    "Time after the resume until every participant's records were durable (Ready checkpoints).",
    ["namespace", "set", "trigger", "outcome"],
    buckets=DURATION_BUCKETS,
)
CHECKPOINT_BYTES = Counter(
    "rollout_checkpoint_bytes",
    "Bytes of records written by Ready checkpoints.",
    ["namespace", "set"],
)
EPISODES_CONTINUED = Counter(
    "rollout_checkpoint_episodes_continued",
    "Episodes committed by Ready checkpoints: they continue from their boundary after a restore.",
    ["namespace", "set"],
)
EPISODES_RESTARTED = Counter(
    "rollout_checkpoint_episodes_restarted",
    "Episodes a Ready checkpoint could not capture: they restart from scratch after a restore.",
    ["namespace", "set"],
)
RESTORES = Counter(
    "rollout_restores",
    "Recoveries after pod loss by outcome: Restored, NoCheckpoint, SiblingRestart, RestoreFailed.",
    ["namespace", "set", "outcome"],
)
RECOVERY_PODS = Counter(
    "rollout_recovery_pods",
    "Participant pods per finished recovery: kept (InPlace) or replaced by fresh ones.",
    ["namespace", "set", "outcome"],
)
RECOVERY_EPISODES = Counter(
    "rollout_recovery_episodes",
    "Episodes per finished recovery: restored from a checkpoint (installed at their last "
    "boundary), or restarted from scratch.",
    ["namespace", "set", "outcome"],
)
RECOVERY_MODEL_TOKENS = Counter(
    "rollout_recovery_model_tokens",
    "Model tokens per finished recovery: kept (the restored checkpoint held them for "
    "generations in flight) or generated_again (the lost attempt generated them after the "
    "checkpoint, as counted by the model pods that outlived the loss).",
    ["namespace", "set", "outcome"],
)
RECOVERY_STEPS = Counter(
    "rollout_recovery_steps",
    "Episode steps per finished recovery: kept (completed in the restored records) or redone "
    "(completed after the checkpoint by unfinished episodes, as counted by the environment "
    "and agent pods that outlived the loss).",
    ["namespace", "set", "outcome"],
)
RECOVERY_WORK_UNCOUNTED = Counter(
    "rollout_recovery_work_uncounted_participants",
    "Participants per finished recovery whose work after the checkpoint nobody could count "
    "(lost pods): while it grows, generated_again and redone are lower bounds.",
    ["namespace", "set"],
)
RECOVERY_CHECKPOINT_AGE = Histogram(
    "rollout_recovery_checkpoint_age_seconds",
    "Time from the restored checkpoint's completion to the loss: the work done since is lost.",
    ["namespace", "set"],
    buckets=DURATION_BUCKETS,
)
RECOVERY_DURATION = Histogram(
    "rollout_recovery_duration_seconds",
    "Time a finished recovery spent in each phase (StoppingAttempt, StartingPods, Restoring, "
    "Resuming, BackingOff), and in all of them (phase Total).",
    ["namespace", "set", "phase"],
    buckets=DURATION_BUCKETS,
)
STANDBY_PODS = Counter(
    "rollout_standby_pods",
    "Standby pods by event: started (a new one: the first, or a replacement after an adoption, "
    "an idle standby's loss or a template change) and adopted (taken by a recovery for a lost "
    "instance).",
    ["namespace", "set", "event"],
)
ATTEMPT = Gauge(
    "rollout_set_attempt",
    "The attempt the set's participants run under (raised by one on every recovery).",
    ["namespace", "set"],
)


# --- checkpoints --------------------------------------------------------------------------------


def checkpoint_seconds(ckpt: RolloutCheckpoint) -> float | None:
    """The checkpoint's duration: as the flow measured it, else from its start to its end."""
    status = ckpt.status
    if status.durations is not None and status.durations.total_seconds is not None:
        return status.durations.total_seconds
    if status.started_at is not None and status.completed_at is not None:
        return max(0.0, (status.completed_at - status.started_at).total_seconds())
    return None


def observe_checkpoint(ckpt: RolloutCheckpoint) -> bool:
    """Record a checkpoint that ended; False (nothing recorded) while it still runs."""
    status = ckpt.status
    if status.phase not in (CheckpointPhase.READY, CheckpointPhase.FAILED):
        return False
    namespace = namespace_or_default(ckpt.metadata.namespace)
    set_name = ckpt.spec.rollout_set
    labels = {
        "namespace": namespace,
        "set": set_name,
        "trigger": ckpt.spec.trigger.value,
        "outcome": status.phase.value,
    }
    seconds = checkpoint_seconds(ckpt)
    if seconds is not None:
        CHECKPOINT_DURATION.labels(**labels).observe(seconds)
    if status.durations is not None and status.durations.pause_seconds is not None:
        CHECKPOINT_PAUSE.labels(**labels).observe(status.durations.pause_seconds)
    if status.durations is not None and status.durations.persist_seconds is not None:
        CHECKPOINT_PERSIST.labels(**labels).observe(status.durations.persist_seconds)
    if status.phase is CheckpointPhase.READY:
        written = sum(p.bytes or 0 for p in status.participants)
        CHECKPOINT_BYTES.labels(namespace=namespace, set=set_name).inc(written)
        EPISODES_CONTINUED.labels(namespace=namespace, set=set_name).inc(status.episodes or 0)
        EPISODES_RESTARTED.labels(namespace=namespace, set=set_name).inc(status.restarts or 0)
    return True


async def checkpoint_ended(kube: Kube, namespace: str, name: str) -> RolloutCheckpoint | None:
    """Read a checkpoint whose flow returned and record it; None when it is gone.

    The flow persists its final status (pause and total durations are known only after the
    resume) before it returns, so this read sees what `kubectl get rckpt` shows.
    """
    raw = await kube.get_checkpoint(namespace, name)
    if raw is None:
        return None
    ckpt = RolloutCheckpoint.model_validate(raw)
    observe_checkpoint(ckpt)
    return ckpt


def completion_message(ckpt: RolloutCheckpoint) -> str:
    """The Event text of a checkpoint that became Ready: what it holds and what it cost."""
    status = ckpt.status
    durations = status.durations
    pause = durations.pause_seconds if durations is not None else None
    persist = durations.persist_seconds if durations is not None else None
    total = checkpoint_seconds(ckpt)
    parts = [
        f"participants resumed; {status.episodes or 0} episode(s) continue from it, "
        f"{status.restarts or 0} restart",
        f"took {total:.3f}s" if total is not None else "",
        f"admission closed {pause:.3f}s" if pause is not None else "",
        f"durable {persist:.3f}s after the resume" if persist is not None else "",
    ]
    return "; ".join(part for part in parts if part)


# --- sets ---------------------------------------------------------------------------------------


def observe_recovery(rset: RolloutSet, reason: str) -> None:
    """A transition of the recovery flow: count finished restores and what they kept and lost;
    follow the attempt."""
    namespace = namespace_or_default(rset.metadata.namespace)
    if reason in RESTORE_OUTCOMES:
        RESTORES.labels(namespace=namespace, set=rset.metadata.name, outcome=reason).inc()
    last = rset.status.last_recovery
    if reason in FINISHED_RECOVERIES and last is not None:
        labels = {"namespace": namespace, "set": rset.metadata.name}
        RECOVERY_PODS.labels(outcome="kept", **labels).inc(last.kept)
        RECOVERY_PODS.labels(outcome="replaced", **labels).inc(last.replaced)
        RECOVERY_EPISODES.labels(outcome="restored", **labels).inc(last.episodes_restored)
        RECOVERY_EPISODES.labels(outcome="restarted", **labels).inc(last.episodes_restarted)
        RECOVERY_MODEL_TOKENS.labels(outcome="kept", **labels).inc(last.model_tokens_kept)
        RECOVERY_MODEL_TOKENS.labels(outcome="generated_again", **labels).inc(
            last.model_tokens_generated_again
        )
        RECOVERY_STEPS.labels(outcome="kept", **labels).inc(last.steps_kept)
        RECOVERY_STEPS.labels(outcome="redone", **labels).inc(last.steps_redone)
        RECOVERY_WORK_UNCOUNTED.labels(**labels).inc(len(last.work_uncounted))
        STANDBY_PODS.labels(event="adopted", **labels).inc(len(last.adopted))
        if last.checkpoint_age_seconds is not None:
            RECOVERY_CHECKPOINT_AGE.labels(**labels).observe(last.checkpoint_age_seconds)
        for phase, seconds in last.phase_seconds.items():
            RECOVERY_DURATION.labels(phase=phase, **labels).observe(seconds)
        RECOVERY_DURATION.labels(phase="Total", **labels).observe(last.duration_seconds)
    if rset.status.attempt is not None:
        ATTEMPT.labels(namespace=namespace, set=rset.metadata.name).set(rset.status.attempt)


def standby_started(name: str, namespace: str | None) -> None:
    STANDBY_PODS.labels(namespace=namespace_or_default(namespace), set=name, event="started").inc()


def forget_set(namespace: str | None, name: str) -> None:
    """A deleted set keeps no attempt series (its counters stay until the process restarts)."""
    with contextlib.suppress(KeyError):
        ATTEMPT.remove(namespace_or_default(namespace), name)


@dataclass(frozen=True)
class Transition:
    """One Kubernetes Event to post for a set."""

    reason: str
    message: str
    warning: bool


_CONDITION_ORDER: Final = ("Degraded", "Ready", "Suspended", "Progressing")
"""The condition whose reason names an Event when several change in one status update."""
_WARNING_PHASES: Final = frozenset({"BackingOff"})
_POSTED_BY_THE_RECOVERY: Final = frozenset({"RecoveryLimitReached"})
"""Condition reasons whose Event the recovery flow posts itself, with the loss named: a hold
writes Degraded and Ready once and the set's pass writes them again with its own message, and
each of those updates was one more identical Warning."""


def _conditions(status: Mapping[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {
        str(c.get("type")): (str(c.get("status")), str(c.get("reason")), str(c.get("message")))
        for c in status.get("conditions") or []
        if isinstance(c, Mapping)
    }


def _recovery_phase(status: Mapping[str, Any]) -> tuple[str, int] | None:
    recovery = status.get("recovery")
    if not isinstance(recovery, Mapping):
        return None
    return str(recovery.get("phase")), int(recovery.get("targetAttempt") or 0)


class SetTransitions:
    """Follows each set's status through its watch events and says which changes deserve an
    Event, so that every transition is visible in `kubectl describe` exactly once:

    - outside a recovery, the reconciler's condition changes (Ready, Degraded, Suspended,
      Progressing), one Event per status update, named by the most telling changed condition
      (except a recovery hold, `RecoveryLimitReached`, which the recovery posts once itself);
    - inside a recovery, each new phase (StoppingAttempt, StartingPods, Restoring, ...).
      The start and the end of a recovery are posted by the recovery flow itself.

    The first sight of a set (a new set, or every set after an operator restart) only primes
    the memory: nothing changed that this process could have seen.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], Mapping[str, Any]] = {}

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> list[Transition]:
        meta = body.get("metadata") or {}
        key = (namespace_or_default(meta.get("namespace")), str(meta.get("name")))
        status = body.get("status") or {}
        if event_type == "DELETED":
            self._seen.pop(key, None)
            forget_set(*key)
            return []
        attempt = status.get("attempt")
        if isinstance(attempt, int):
            ATTEMPT.labels(namespace=key[0], set=key[1]).set(attempt)
        previous = self._seen.get(key)
        self._seen[key] = status
        if previous is None:
            return []
        return _transitions(previous, status)


def _transitions(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Transition]:
    old_phase, new_phase = _recovery_phase(old), _recovery_phase(new)
    if old_phase is None and new_phase is None:
        before, after = _conditions(old), _conditions(new)
        changed = [t for t in _CONDITION_ORDER if t in after and before.get(t) != after[t]]
        if not changed:
            return []
        primary = after[changed[0]]
        if primary[1] in _POSTED_BY_THE_RECOVERY:
            return []
        summary = ", ".join(f"{t}={after[t][0]}" for t in changed)
        degraded = after.get("Degraded", ("", "", ""))[0] == "True"
        lost_ready = "Ready" in changed and after["Ready"][0] != "True"
        lost_ready = lost_ready and before.get("Ready", ("",))[0] == "True"
        return [Transition(primary[1], f"{summary}: {primary[2]}", degraded or lost_ready)]
    if old_phase is not None and new_phase is not None and old_phase != new_phase:
        recovering = _conditions(new).get("Recovering", ("", new_phase[0], ""))
        message = recovering[2] or f"recovery to attempt {new_phase[1]}: {new_phase[0]}"
        return [Transition(new_phase[0], message, new_phase[0] in _WARNING_PHASES)]
    return []
