"""`rollout-coordinate`: checkpoint and restore rollout servers without an operator.

For plain processes and batch schedulers (Slurm): the same coordinator the operator uses, with
publication by `checkpoint.json` on the shared directory instead of a custom resource. Progress
goes to stderr for people, one JSON summary to stdout for scripts; the exit status is 0 only
when the operation fully succeeded.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import anyio

from . import _storage as storage
from . import tracing
from ._client import HttpParticipantClient, _default_session
from ._coordinator import Coordinator, StatusOutcome
from ._objectstore import BucketStore
from ._settings import S3_ENV_PREFIX, ControlConfigError, bucket_from_env
from ._stages import PrepareStages
from ._wire import CHECKPOINT_ID_PATTERN, Role, StatusReply

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_ROLE_NAMES = "environment, model, agent, resources"


class UsageError(Exception):
    """Bad arguments or environment: nothing was changed on any participant."""


@dataclass(frozen=True)
class ParticipantSpec:
    role: Role
    index: int
    url: str

    @property
    def instance(self) -> str:
        return f"{self.role.value}-{self.index}"


def parse_participants(specs: Sequence[str]) -> list[ParticipantSpec]:
    """`ROLE=URL` (indexes counted per role in the order given) or `ROLE-INDEX=URL`."""
    parsed: list[ParticipantSpec] = []
    next_index: dict[Role, int] = {}
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or not url:
            raise UsageError(f"--participant {spec!r}: expected ROLE=URL or ROLE-INDEX=URL")
        match = re.fullmatch(r"([a-z]+)(?:-([0-9]+))?", name)
        if match is None or match.group(1) not in {role.value for role in Role}:
            raise UsageError(f"--participant {spec!r}: role must be one of {_ROLE_NAMES}")
        role = Role(match.group(1))
        index = int(match.group(2)) if match.group(2) is not None else next_index.get(role, 0)
        next_index[role] = index + 1
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--participant {spec!r}: URL must start with http:// or https://")
        parsed.append(ParticipantSpec(role=role, index=index, url=url))
    seen: set[str] = set()
    for item in parsed:
        if item.instance in seen:
            raise UsageError(f"participant {item.instance} is given twice")
        seen.add(item.instance)
    if not parsed:
        raise UsageError("give at least one --participant ROLE=URL")
    return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-coordinate",
        description="Checkpoint and restore rollout servers (no Kubernetes needed).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--participant",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="a participant's base URL; repeat for each (ROLE-INDEX=URL to name the index)",
    )
    common.add_argument(
        "--dir",
        type=Path,
        help="the checkpoint root the participants share (without it: the bucket of the "
        f"{S3_ENV_PREFIX}* variables, when set)",
    )
    common.add_argument("--set", dest="set_name", help="set name (default: the participants')")
    common.add_argument(
        "--token-env",
        default="ROLLOUT_CONTROL_TOKEN",
        metavar="VAR",
        help="environment variable holding the control token (default ROLLOUT_CONTROL_TOKEN)",
    )
    common.add_argument(
        "--no-token",
        action="store_true",
        help="send no token (participants started with unauthenticated control only)",
    )
    common.add_argument(
        "--timeout", type=float, default=60.0, help="seconds for status, restore and resume"
    )
    sub.add_parser("status", parents=[common], help="show every participant's phase")
    checkpoint = sub.add_parser("checkpoint", parents=[common], help="take and publish one")
    checkpoint.add_argument("--checkpoint-id", help="default: <set>-<UTC time>")
    checkpoint.add_argument("--prepare-timeout", type=float, default=60.0)
    checkpoint.add_argument("--commit-timeout", type=float, default=60.0)
    checkpoint.add_argument(
        "--episode", action="append", default=None, help="restrict the commit scope; repeatable"
    )
    checkpoint.add_argument("--trainer-step", type=int, default=None)
    checkpoint.add_argument(
        "--persist-before-resume",
        action="store_true",
        help="write the records inside the pause (the old way); by default participants that "
        "can cut, resume, then persist (docs/protocol.md, 'Persist after resume')",
    )
    restore = sub.add_parser("restore", parents=[common], help="restore a published checkpoint")
    restore.add_argument("--checkpoint-id", help="default: the latest published checkpoint")
    restore.add_argument("--attempt", type=int, help="default: the checkpoint's attempt + 1")
    restore.add_argument(
        "--episode", action="append", default=None, help="restore only these; repeatable"
    )
    return parser


class _Console:
    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err

    def progress(self, message: str) -> None:
        print(f"rollout-coordinate: {message}", file=self.err, flush=True)

    def summary(self, payload: Mapping[str, Any]) -> None:
        print(json.dumps(payload, indent=2, sort_keys=True), file=self.out, flush=True)


async def run(
    argv: Sequence[str],
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """The CLI as a coroutine (tests and embedding call this; `main` runs it)."""
    console = _Console(out or sys.stdout, err or sys.stderr)
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    env = os.environ if environ is None else environ
    try:
        specs = parse_participants(args.participant)
        token = _token(args, env)
        args.store = _records_store(args.dir, env)
        if args.command in ("checkpoint", "restore") and args.store is None:
            raise UsageError(
                f"{args.command} needs --dir (the participants' checkpoint root) or the "
                f"{S3_ENV_PREFIX}* variables (their bucket)"
            )
    except UsageError as error:
        console.progress(f"error: {error}")
        return EXIT_USAGE
    # one session for every participant: no connection limit, as each client's own (a parked
    # prepare holds its connection)
    async with _default_session() as client:
        participants = [
            HttpParticipantClient(spec.role, spec.url, index=spec.index, token=token, client=client)
            for spec in specs
        ]
        coordinator = Coordinator(participants, on_progress=console.progress)
        try:
            return await _command(args, coordinator, specs, console)
        except UsageError as error:
            console.progress(f"error: {error}")
            return EXIT_USAGE
        except (storage.StorageError, storage.RecordsInvalid, storage.UnsafePath) as error:
            console.progress(f"error: {error}")
            return EXIT_FAILED


def _token(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    if args.no_token:
        return None
    token = env.get(args.token_env)
    if not token:
        raise UsageError(
            f"{args.token_env} is not set: export the participants' control token there "
            "(or name another variable with --token-env; --no-token for unauthenticated servers)"
        )
    return token


async def _command(
    args: argparse.Namespace,
    coordinator: Coordinator,
    specs: Sequence[ParticipantSpec],
    console: _Console,
) -> int:
    statuses = await coordinator.status(time.time() + args.timeout)
    if args.command == "status":
        return _print_status(args, statuses, console)
    if statuses.failures:
        for failure in statuses.failures:
            console.progress(f"cannot reach {failure}")
        console.summary(
            {"ok": False, "failures": [f.model_dump(mode="json") for f in statuses.failures]}
        )
        return EXIT_FAILED
    set_name = _check_participants(args, statuses.statuses, specs)
    if args.command == "checkpoint":
        stages = coordinator.stages(statuses.statuses)
        return await _checkpoint(args, coordinator, set_name, stages, console)
    return await _restore(args, coordinator, set_name, statuses.statuses, console)


def _check_participants(
    args: argparse.Namespace, statuses: Sequence[StatusReply], specs: Sequence[ParticipantSpec]
) -> str:
    """The participants must be who we think they are, and agree on the set."""
    for spec, status in zip(specs, statuses, strict=True):
        if status.instance != spec.instance:
            raise UsageError(
                f"{spec.url} reports instance {status.instance}, expected {spec.instance}; "
                "list participants in index order or write ROLE-INDEX=URL"
            )
    names = {status.set_name for status in statuses if status.set_name is not None}
    if len(names) > 1:
        raise UsageError(f"participants belong to different sets: {', '.join(sorted(names))}")
    reported = names.pop() if names else None
    if args.set_name is not None and reported is not None and args.set_name != reported:
        raise UsageError(f"--set {args.set_name} but the participants write set {reported}")
    set_name: str = args.set_name or reported or "local"
    return set_name


def _print_status(args: argparse.Namespace, statuses: StatusOutcome, console: _Console) -> int:
    for status in statuses.statuses:
        console.progress(
            f"{status.instance}: {status.phase.value} attempt={status.attempt} "
            f"live={status.live_episodes} parked={status.parked_episodes} "
            f"restored={status.restored_episodes} checkpoint={status.checkpoint_id or '-'}"
        )
    for failure in statuses.failures:
        console.progress(f"cannot reach {failure}")
    payload: dict[str, Any] = {
        "ok": not statuses.failures,
        "participants": [s.model_dump(mode="json") for s in statuses.statuses],
        "failures": [f.model_dump(mode="json") for f in statuses.failures],
    }
    if args.store is not None:
        names = {s.set_name for s in statuses.statuses if s.set_name is not None}
        set_name = args.set_name or (names.pop() if len(names) == 1 else "local")
        published = args.store.published_checkpoints(set_name)
        payload["published"] = [m.checkpoint_id for m in published]
    console.summary(payload)
    return EXIT_OK if not statuses.failures else EXIT_FAILED


async def _checkpoint(
    args: argparse.Namespace,
    coordinator: Coordinator,
    set_name: str,
    stages: PrepareStages,
    console: _Console,
) -> int:
    checkpoint_id = args.checkpoint_id or time.strftime(f"{set_name}-%Y%m%d-%H%M%S", time.gmtime())
    if re.fullmatch(CHECKPOINT_ID_PATTERN, checkpoint_id) is None:
        raise UsageError(f"--checkpoint-id {checkpoint_id!r} must match {CHECKPOINT_ID_PATTERN}")
    console.progress(f"checkpoint {checkpoint_id} of set {set_name} into {args.store.where}")
    with tracing.root_span(
        f"checkpoint {set_name}/{checkpoint_id}",
        key=f"checkpoint/{set_name}/{checkpoint_id}",
        attributes={"rollout.set": set_name, "rollout.checkpoint": checkpoint_id},
    ):
        result = await coordinator.checkpoint(
            checkpoint_id,
            prepare_timeout=args.prepare_timeout,
            commit_timeout=args.commit_timeout,
            scope=args.episode,
            publish_dir=args.store,
            set_name=set_name,
            trainer_step=args.trainer_step,
            persist_after_resume=not args.persist_before_resume,
            stages=stages,
        )
        if not result.ok:
            tracing.failed(result.reason, result.message)
    console.summary(result.model_dump(mode="json"))
    if not result.ok:
        console.progress(f"checkpoint failed ({result.reason}): {result.message}")
        return EXIT_FAILED
    console.progress(
        f"checkpoint {checkpoint_id} {result.reason.lower()}: {result.message}; "
        f"paused {result.durations.pause_seconds:.3f}s"
        + (
            f", durable {result.durations.persist_seconds:.3f}s after the cut"
            if result.durations.persist_seconds
            else ""
        )
    )
    return EXIT_OK


async def _restore(
    args: argparse.Namespace,
    coordinator: Coordinator,
    set_name: str,
    statuses: Sequence[StatusReply],
    console: _Console,
) -> int:
    if args.checkpoint_id is not None:
        published = args.store.read_checkpoint_manifest(set_name, args.checkpoint_id)
    else:
        all_published = args.store.published_checkpoints(set_name)
        if not all_published:
            raise UsageError(f"no published checkpoint of set {set_name} in {args.store.where}")
        published = all_published[-1]
    recorded = {entry.instance for entry in published.participants}
    given = {status.instance for status in statuses}
    if recorded != given:
        raise UsageError(
            f"checkpoint {published.checkpoint_id} holds records of {sorted(recorded)}, "
            f"but the participants given are {sorted(given)}"
        )
    running = max(status.attempt for status in statuses)
    attempt = args.attempt if args.attempt is not None else max(published.attempt + 1, running)
    with tracing.root_span(
        f"restore {set_name}/{published.checkpoint_id}",
        key=f"restore/{set_name}/{published.checkpoint_id}/{attempt}",
        attributes={"rollout.set": set_name, "rollout.attempt": attempt},
    ):
        outcome = await coordinator.restore(
            published.checkpoint_id,
            attempt,
            time.time() + args.timeout,
            scope=args.episode,
            listed={
                entry.instance: entry.rollout_ids
                for entry in published.participants
                if entry.rollout_ids is not None
            },
        )
    payload: dict[str, Any] = {"restore": outcome.model_dump(mode="json")}
    if not outcome.ok:
        console.summary({"ok": False, **payload})
        reasons = "; ".join(str(failure) for failure in outcome.failures)
        console.progress(f"restore failed, attempt {attempt} retired everywhere: {reasons}")
        return EXIT_FAILED
    resumed = await coordinator.resume(published.checkpoint_id, time.time() + args.timeout)
    payload["resume"] = resumed.model_dump(mode="json")
    ok = not resumed.failures
    console.summary({"ok": ok, **payload})
    if not ok:
        console.progress("restored, but resume failed on some participants (see summary)")
        return EXIT_FAILED
    console.progress(
        f"restored {len(outcome.episodes)} episodes under attempt {attempt} and resumed"
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    tracing.configure("rollout-coordinate")  # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    # uvloop where installed: the pause includes this process's share of nine control calls
    uvloop = importlib.util.find_spec("uvloop") is not None
    return anyio.run(functools.partial(run, arguments), backend_options={"use_uvloop": uvloop})


def _records_store(root: Path | None, env: Mapping[str, str]) -> storage.RecordsStore | None:
    """The participants' records store: the volume at `--dir`, else the bucket the
    `ROLLOUT_STORAGE_S3_*` variables name; None when neither is given."""
    if root is not None:
        return storage.VolumeStore(root)
    try:
        bucket = bucket_from_env(env)
    except ControlConfigError as error:
        raise UsageError(str(error)) from None
    return BucketStore(bucket) if bucket is not None else None


if __name__ == "__main__":
    sys.exit(main())
