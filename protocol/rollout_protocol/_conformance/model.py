"""Checks on the kit's `FakeModel` log, for groups that serve it: every call named its episode
(`model.headers`), the restored episodes asked the prompts of uninterrupted runs
(`model.same-prompts`), and a hold the driver armed after the crash (`driver.holds`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._fake_model import FakeModel, UnnamedModelCall
from .report import (
    DRIVER_HOLDS,
    DRIVER_MISTAKE,
    MODEL_CALLER,
    MODEL_HEADERS,
    MODEL_PROMPTS,
    UNINTERRUPTED_SUFFIX,
    ConformanceError,
)

_HEADERS_FIX = (
    "send X-Rollout-Request: <rollout_id>/<turn> and X-Rollout-Attempt: <attempt> on every "
    "model call (docs/sdk.md, section 3)"
)


def _check_unnamed_wait(error: BaseException, rids: Sequence[str], attempt: int) -> None:
    """`model.headers` when the driver's wait for a held call gave up because the kit's
    `FakeModel` got a call without the episode headers (`UnnamedModelCall`, raised by
    `wait_held`, possibly wrapped by the driver): the server's fault, not the driver's."""
    seen: list[BaseException] = [error]
    while seen:
        current = seen.pop()
        if isinstance(current, UnnamedModelCall):
            raise ConformanceError(
                MODEL_HEADERS,
                f"every model call of the episodes {rids} must name its episode (under "
                f"attempt {attempt})",
                f"the kit's FakeModel got a call without X-Rollout-Request/X-Rollout-Attempt "
                f"while the driver waited for a held call: {current}",
                fault=MODEL_CALLER,
                fix=_HEADERS_FIX,
            ) from error
        if isinstance(current, BaseExceptionGroup):
            seen.extend(current.exceptions)
        seen.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _check_fake_model_headers(
    model: FakeModel, calls_from: int, rids: Sequence[str], attempt: int, each: bool = True
) -> None:
    """`model.headers` on the kit's `FakeModel`: no call since the check began lacked the
    headers and (with `each`: by the checkpoint) every episode named itself on a call under
    `attempt`."""
    unnamed = [call for call in model.log[calls_from:] if call.rollout_id is None]
    silent = [rid for rid in rids if each and not model.calls(rid, attempt)]
    if unnamed or silent:
        raise ConformanceError(
            MODEL_HEADERS,
            f"every model call of the episodes {rids} must name its episode (under attempt "
            f"{attempt})",
            f"{len(unnamed)} calls without X-Rollout-Request/X-Rollout-Attempt"
            + (f" (first prompt {unnamed[0].prompt[:120]!r})" if unnamed else "")
            + (f"; no named call of {silent}" if silent else ""),
            fault=MODEL_CALLER,
            fix=_HEADERS_FIX,
        )


def _check_driver_holds(model: FakeModel | None) -> None:
    """`driver.holds`: a hold the driver armed after the crash is reported at once, as the
    driver's mistake (the fake model did not arm it, so no episode waits on it)."""
    if model is None or not model.driver_mistakes:
        return
    raise ConformanceError(
        DRIVER_HOLDS,
        "holds on model calls of the first attempt only (armed before each episode reaches "
        "the call, and never after the crash)",
        "; ".join(model.driver_mistakes),
        fault=DRIVER_MISTAKE,
        fix="arm FakeModel.hold(...) in run_episode only for the first attempt's own rollout "
        "ids (attempt == the first one, base_rollout_id(rollout_id) == rollout_id), once per "
        "rollout, with attempt=attempt",
    )


def _check_prompts(model: FakeModel, rids: Sequence[str], attempt: int) -> None:
    """`model.same-prompts`: each model call a restored episode made under `attempt` carries
    the prompt of its uninterrupted twin's call of the same key (the twin's rollout id read as
    the restored one's, should a prompt name it)."""
    differ: list[str] = []
    compared = 0
    for rid in rids:
        twin_id = rid + UNINTERRUPTED_SUFFIX
        twin = {k: p.replace(twin_id, rid) for k, p in model.prompts(twin_id, attempt).items()}
        for key, prompt in sorted(model.prompts(rid, attempt).items()):
            compared += 1
            expected = twin.get(key)
            if expected is None:
                differ.append(f"{rid}/{key}: the uninterrupted run made no call {key}")
            elif expected != prompt:
                differ.append(
                    f"{rid}/{key}: restored prompt {_clip(prompt)}, uninterrupted {_clip(expected)}"
                )
    if differ:
        raise ConformanceError(
            MODEL_PROMPTS,
            f"the model calls of the restored episodes under attempt {attempt} must carry the "
            "prompts of an uninterrupted run's calls of the same keys",
            "; ".join(differ[:5]) + (f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""),
            fix="build every prompt from the episode's boundary state (the transcript in the "
            "Boundary's JSON), never from memory kept beside it: it is gone after a restore",
        )


def _clip(text: str, keep: int = 160) -> str:
    """`text` for a message: its end (where prompts differ most), quoted."""
    return repr(text if len(text) <= keep else "..." + text[-keep:])
