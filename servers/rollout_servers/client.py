"""The trainer side: run many episodes, survive pod loss, collect results.

`RolloutClient` runs episodes concurrently against the environment servers of a rollout set and
follows the set's *attempt*. When a `/run` fails because its servers died or were restored (a
dropped connection, `attempt_retired`, `attempt_mismatch`, a peer that became unreachable), the
client waits for the attempt to advance (with a deadline) and re-issues `/run` under the new
attempt; the restored environment continues the episode from its last recorded boundary. A
training loop thus survives pod loss without code of its own.

Where the attempt and the environment URLs come from is a seam, `Topology` (module `topology`):
a static one for plain processes, a JSON file one (written by whoever restores, e.g. a Slurm
script), a mutable in-process one (tests, embedding), and `discovery`'s, which watches the
RolloutSet's `status.attempt`. An implementation that can *wait* for a newer attempt (a watch)
also implements `wait_newer`; otherwise the client polls `current()`.

Each rollout sticks to one environment index (a stable hash of its id, kept for the client's
lifetime): its restored records live in that instance's records, so its continuation must go to
the same index.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import httpx
from pydantic import BaseModel, ConfigDict, JsonValue
from rollout_protocol import RESTORE_CODES, ErrorBody, ErrorCode, tracing

from .taskfile import (
    DEFAULT_MAX_ROW_BYTES,
    Row,
    RowError,
    RowFile,
    RowOptions,
    is_stream,
    scan_rows,
)
from .taskfile import rollout_id as row_rollout_id
from .tasks import Task, sample_tasks
from .topology import (
    FileTopology,
    StaticTopology,
    Topology,
    TopologySnapshot,
    WatchableTopology,
)

log = logging.getLogger(__name__)


DEFAULT_RESTORE_TIMEOUT_S = 600.0
"""How long an episode waits for a new attempt when nothing says how long a recovery takes."""
_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0


# --- results ----------------------------------------------------------------------------------


class EpisodeResult(BaseModel):
    """One JSON line of `rollout-collect`'s output.

    An episode of a rows file (`--tasks-file`) also names its row: `row_id`, the file's `line`
    and `sample` (which of the row's rollouts, 0-based); the shipped tasks' lines leave them out.
    """

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    attempt: int
    answer: JsonValue = None
    """Whatever the environment answered (the reference environments: an integer, or null)."""
    reward: float
    steps: int
    continued: bool
    continued_from: int | None = None
    row_id: str | None = None
    line: int | None = None
    sample: int | None = None

    def output_line(self) -> str:
        """The result as `rollout-collect` writes it."""
        left_out = {"continued_from"} | (
            {"row_id", "line", "sample"} if self.row_id is None else set()
        )
        return self.model_dump_json(exclude=left_out)


class EpisodeFailed(Exception):
    """An episode could not finish (a refusal that no restore fixes, or a deadline)."""

    def __init__(self, rollout_id: str, detail: str) -> None:
        super().__init__(f"{rollout_id}: {detail}")
        self.rollout_id = rollout_id
        self.detail = detail


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: its rollout id and the task its `/run` carries."""

    rollout_id: str
    task: Task | dict[str, Any]
    """A shipped `Task`, or any JSON object (a user's row), sent as it is."""
    row: Row | None = None
    """The row of a rows file the task came from, if it did."""
    sample: int = 0
    """Which of the row's rollouts this is."""

    def wire_task(self) -> dict[str, Any]:
        """The `task` of the `/run` body."""
        return self.task.wire() if isinstance(self.task, Task) else self.task


@dataclass
class Progress:
    total: int
    done: int = 0
    failed: int = 0
    continued: int = 0
    reissued: int = 0
    attempt: int = 0
    reward_sum: float = 0.0
    started_at: float = field(default_factory=time.monotonic)


# --- the client -------------------------------------------------------------------------------


class RolloutClient:
    def __init__(
        self,
        topology: Topology,
        *,
        concurrency: int = 64,
        restore_timeout_s: float = DEFAULT_RESTORE_TIMEOUT_S,
        run_timeout_s: float = 3600.0,
        poll_interval_s: float = 1.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        self.topology = topology
        self.concurrency = concurrency
        self.restore_timeout_s = restore_timeout_s
        self.run_timeout_s = run_timeout_s
        self.poll_interval_s = poll_interval_s
        self._http = http
        self._assignment: dict[str, int] = {}
        self.progress = Progress(total=0)

    def assign(self, rollout_id: str, environments: int) -> int:
        """The environment index of a rollout: stable, and kept once chosen."""
        index = self._assignment.get(rollout_id)
        if index is None:
            digest = hashlib.sha256(rollout_id.encode()).digest()
            index = self._assignment[rollout_id] = int.from_bytes(digest[:8], "big") % environments
        return index

    async def run_episode(self, spec: EpisodeSpec, http: httpx.AsyncClient) -> EpisodeResult:
        """Run one episode to its end, re-issuing it under each new attempt after a restore.

        A refusal that means "these servers are gone or replaced" waits for a newer attempt. A
        transport error (the server may be dead, or the network only hiccuped) waits for a newer
        attempt too, but also re-issues under the same attempt after a backoff: a live server
        attaches the call to the running episode (or returns its result), so that is safe.
        Either way the wait ends with a clear failure at the restore deadline. A call still
        waiting for its reply when the attempt is superseded is given up and re-issued under
        the newer attempt (`_post_run`).
        """
        with anyio.fail_after(self.run_timeout_s):
            snapshot = await self.topology.current()
            failing_since: float | None = None
            backoff = _FIRST_BACKOFF_S
            while True:
                index = self.assign(spec.rollout_id, len(snapshot.environments))
                if index >= len(snapshot.environments):
                    raise EpisodeFailed(
                        spec.rollout_id,
                        f"assigned environment {index} is gone ({len(snapshot.environments)} left)",
                    )
                url = snapshot.environments[index].rstrip("/") + "/run"
                issued = snapshot.attempt
                body = {
                    "rollout_id": spec.rollout_id,
                    "attempt": snapshot.attempt,
                    "task": spec.wire_task(),
                }
                retry_same: float | None = None
                try:
                    with tracing.span(
                        f"run {spec.rollout_id}",
                        kind=tracing.SpanKind.CLIENT,
                        attributes={"rollout.attempt": snapshot.attempt, "url.full": url},
                    ):
                        headers = tracing.headers()  # the span's traceparent when tracing is on
                        reply = await self._post_run(http, url, body, headers, issued)
                except httpx.TransportError as error:
                    why = f"{type(error).__name__} from {url}: {error}"
                    retry_same = backoff
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
                else:
                    if reply is None:
                        why = f"attempt {issued} was superseded before {url} answered"
                    elif reply.status_code == 200:
                        return self._result(spec, reply)
                    else:
                        code, detail = _error_of(reply)
                        if code not in RESTORE_CODES:
                            raise EpisodeFailed(spec.rollout_id, f"{code}: {detail}")
                        why = f"{code}: {detail}"
                log.info(
                    "%s: /run under attempt %d failed (%s)", spec.rollout_id, snapshot.attempt, why
                )
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                remaining = failing_since + self.restore_timeout_s - now
                snapshot = await self._newer(snapshot, spec.rollout_id, why, remaining, retry_same)
                if snapshot.attempt > issued:
                    failing_since, backoff = None, _FIRST_BACKOFF_S
                self.progress.reissued += 1

    async def _post_run(
        self, http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Any, attempt: int
    ) -> httpx.Response | None:
        """POST /run and its reply, or None once the topology shows an attempt newer than
        `attempt` first (a watchable topology only).

        An episode runs as long as it runs (no read timeout), so what bounds the wait is the
        attempt: a server on a node that was lost never answers and nothing closes the
        connection (no FIN, no RST: TCP alone would wait minutes, or forever on an idle
        connection), while the recovery moves the set to a newer attempt, under which the
        episode is re-issued. Giving up the call is safe: a live server's episode does not
        depend on the connection (a re-issued call attaches to it), and the superseded attempt
        is retired by the recovery (docs/servers.md)."""
        topology = self.topology
        if not isinstance(topology, WatchableTopology):
            return await http.post(url, json=body, timeout=None, headers=headers)
        outcome: list[httpx.Response | Exception] = []
        async with anyio.create_task_group() as group:

            async def run() -> None:
                try:
                    outcome.append(await http.post(url, json=body, timeout=None, headers=headers))
                except Exception as error:  # raised below, as it would be without the race
                    outcome.append(error)
                group.cancel_scope.cancel()

            async def superseded() -> None:
                try:
                    await topology.wait_newer(attempt)
                except Exception as error:  # no bound from the topology: the reply decides
                    log.debug("watching for an attempt after %d failed: %s", attempt, error)
                    return
                group.cancel_scope.cancel()

            group.start_soon(run)
            group.start_soon(superseded)
        if not outcome:
            return None
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    async def _newer(
        self,
        current: TopologySnapshot,
        rollout_id: str,
        why: str,
        remaining_s: float,
        retry_same_after_s: float | None,
    ) -> TopologySnapshot:
        """Wait for an attempt newer than `current`'s, until the restore deadline; with
        `retry_same_after_s`, return `current` again after that long (a retry)."""
        attempt = current.attempt
        limit = remaining_s if retry_same_after_s is None else min(remaining_s, retry_same_after_s)
        with anyio.move_on_after(max(0.0, limit)):
            if isinstance(self.topology, WatchableTopology):
                snapshot = await self.topology.wait_newer(attempt)
            else:
                while True:  # a source without change notification: poll it
                    snapshot = await self.topology.current()
                    if snapshot.attempt > attempt:
                        break
                    await anyio.sleep(self.poll_interval_s)
            self.progress.attempt = max(self.progress.attempt, snapshot.attempt)
            return snapshot
        if retry_same_after_s is not None and remaining_s > retry_same_after_s:
            # `current()` waits while the set is in transition (a recovery): within the
            # restore deadline too.
            with anyio.move_on_after(remaining_s - retry_same_after_s):
                return await self.topology.current()
        raise EpisodeFailed(
            rollout_id,
            f"its servers failed ({why}) and the attempt did not advance past {attempt} "
            f"within {self.restore_timeout_s}s",
        )

    def _result(self, spec: EpisodeSpec, reply: httpx.Response) -> EpisodeResult:
        try:
            data = reply.json()
            continued_from = data.get("continued_from")
            return EpisodeResult(
                rollout_id=spec.rollout_id,
                attempt=int(data["attempt"]),
                answer=data.get("answer"),
                reward=float(data["reward"]),
                steps=int(data["steps"]),
                continued=continued_from is not None,
                continued_from=continued_from,
                row_id=None if spec.row is None else spec.row.row_id,
                line=None if spec.row is None else spec.row.line,
                sample=None if spec.row is None else spec.sample,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            # an environment of the user's may answer anything: fail this episode, not the batch
            raise EpisodeFailed(
                spec.rollout_id, f"unreadable /run reply ({error}): {reply.text[:200]}"
            ) from error

    async def run_all(
        self,
        specs: Sequence[EpisodeSpec],
        on_result: Callable[[EpisodeResult | EpisodeFailed], Awaitable[None] | None] | None = None,
    ) -> list[EpisodeResult | EpisodeFailed]:
        """Run every episode (at most `concurrency` at once); failures are returned, not raised."""
        results: dict[str, EpisodeResult | EpisodeFailed] = {}

        async def keep(outcome: EpisodeResult | EpisodeFailed) -> None:
            results[outcome.rollout_id] = outcome
            if on_result is not None:
                maybe = on_result(outcome)
                if maybe is not None:
                    await maybe

        await self.run_each(specs, keep, total=len(specs))
        return [results[spec.rollout_id] for spec in specs]

    async def run_each(
        self,
        specs: Iterable[EpisodeSpec],
        on_result: Callable[[EpisodeResult | EpisodeFailed], Awaitable[None] | None],
        *,
        total: int,
    ) -> None:
        """Run every episode, at most `concurrency` at once, and hand each outcome to
        `on_result` as it comes; failures are handed over, not raised.

        `specs` is consumed only as episodes start, so it may be a generator over a large file:
        no more than `concurrency` specs are held at a time. `total` is for the progress count.
        An exception from `specs` itself (a rows file that changed under the run) cancels the
        running episodes and is raised as it is.
        """
        self.progress = Progress(total=total, attempt=(await self.topology.current()).attempt)
        slots = anyio.Semaphore(self.concurrency)
        source = iter(specs)
        broken: Exception | None = None
        async with (
            _clients(self._http, self.concurrency) as clients,
            anyio.create_task_group() as group,
        ):

            async def one(spec: EpisodeSpec) -> None:
                try:
                    http = clients[zlib.crc32(spec.rollout_id.encode()) % len(clients)]
                    outcome: EpisodeResult | EpisodeFailed
                    try:
                        outcome = await self.run_episode(spec, http)
                    except EpisodeFailed as error:
                        outcome = error
                    except TimeoutError:
                        outcome = EpisodeFailed(
                            spec.rollout_id, f"did not finish within {self.run_timeout_s}s"
                        )
                    self._count(outcome)
                    maybe = on_result(outcome)
                    if maybe is not None:
                        await maybe
                finally:
                    slots.release()

            while True:
                await slots.acquire()
                try:
                    spec = next(source)
                except StopIteration:
                    break
                except Exception as error:  # raised below, outside the task group's wrapping
                    broken = error
                    group.cancel_scope.cancel()
                    break
                group.start_soon(one, spec)
        if broken is not None:
            raise broken

    def _count(self, outcome: EpisodeResult | EpisodeFailed) -> None:
        progress = self.progress
        if isinstance(outcome, EpisodeFailed):
            progress.failed += 1
            return
        progress.done += 1
        progress.reward_sum += outcome.reward
        progress.continued += outcome.continued
        progress.attempt = max(progress.attempt, outcome.attempt)


class _clients:
    """The caller's HTTP client, or owned ones for the duration of a run.

    Owned clients are one per 64 concurrent episodes: httpcore scans its whole connection pool
    for every request, so one pool serving a thousand open `/run` calls costs O(n) per call.
    """

    def __init__(self, given: httpx.AsyncClient | None, concurrency: int) -> None:
        self._given = given
        self._concurrency = concurrency
        self._owned: list[httpx.AsyncClient] = []

    async def __aenter__(self) -> list[httpx.AsyncClient]:
        if self._given is not None:
            return [self._given]
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        shards = max(1, -(-self._concurrency // 64))
        self._owned = [
            httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0)) for _ in range(shards)
        ]
        return self._owned

    async def __aexit__(self, *exc_info: object) -> None:
        for client in self._owned:
            await client.aclose()


def _error_of(reply: httpx.Response) -> tuple[ErrorCode | str, str]:
    try:
        body = ErrorBody.model_validate_json(reply.content)
    except ValueError:
        return (ErrorCode.INTERNAL if reply.status_code >= 500 else f"http_{reply.status_code}"), (
            reply.text[:200]
        )
    return body.error.code, body.error.detail


def episode_specs(count: int, seed: int, prefix: str = "r") -> list[EpisodeSpec]:
    """`count` episodes over the shipped tasks; ids and tasks are a function of (count, seed)."""
    return [
        EpisodeSpec(rollout_id=f"{prefix}{seed}-{i:05d}", task=task)
        for i, task in enumerate(sample_tasks(count, seed))
    ]


def row_episodes(rows: RowFile) -> Iterator[EpisodeSpec]:
    """The episodes of a scanned rows file, `rollouts_per_row` per row, read as they are needed
    (see `rollout_servers.taskfile`)."""
    for row in rows.rows():
        for sample in range(rows.options.rollouts_per_row):
            rid = row_rollout_id(rows.options, row.row_id, sample)
            yield EpisodeSpec(rid, rows.task(row, sample), row, sample)


# --- the CLI ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-collect",
        description="Run episodes against environment servers; survive restores; write JSONL.",
    )
    parser.add_argument("--environment", nargs="+", action="extend", default=[], metavar="URL")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tasks", type=int, help="how many episodes over the shipped tasks")
    source.add_argument(
        "--tasks-file",
        type=Path,
        metavar="ROWS.jsonl",
        help="your own tasks: one JSON object per line, each sent to /run as the task",
    )
    parser.add_argument(
        "--id-field",
        metavar="NAME",
        help="with --tasks-file: the row field that holds the row's id (a string or integer); "
        "default: a digest of the row's canonical JSON",
    )
    parser.add_argument(
        "--gym",
        action="store_true",
        help="with --tasks-file: the rows are a NeMo Gym dataset (flat or materialized rows): "
        "row ids as Gym gives them (task_id, problem_id, instance_id, else the row's position) "
        "and rollout ids Gym accepts (no ':', no -a<N> ending)",
    )
    parser.add_argument(
        "--rollouts-per-row",
        type=int,
        default=1,
        metavar="K",
        help="with --tasks-file: episodes per row, rollout ids <prefix><row id>-<k>",
    )
    parser.add_argument(
        "--seed-field",
        default="seed",
        metavar="NAME",
        help="with --tasks-file: the task field that carries each rollout's sampling seed "
        "(derived from --seed, the row id and k); '' sends rows unchanged (default: seed)",
    )
    parser.add_argument(
        "--max-row-bytes",
        type=int,
        default=DEFAULT_MAX_ROW_BYTES,
        help="with --tasks-file: the longest line accepted (default: 1 MiB)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="results, one JSON line each")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--attempt", type=int, default=0, help="the attempt the servers run")
    parser.add_argument(
        "--topology-file",
        type=Path,
        help='JSON {"attempt": N, "environments": [...]} re-read to follow restores',
    )
    parser.add_argument(
        "--rollout-set",
        metavar="NAME",
        help="follow this RolloutSet through the Kubernetes API (its status.attempt and "
        "environment addresses; credentials: in-cluster, else $KUBECONFIG or ~/.kube/config)",
    )
    parser.add_argument(
        "--namespace", help="the RolloutSet's namespace (default: the kubeconfig context's)"
    )
    parser.add_argument(
        "--restore-timeout",
        type=float,
        default=None,
        help="how long an episode waits for its servers to be restored under a new attempt "
        "(default with --rollout-set: the set's recovery bound, maxRestarts + 1 tries of "
        f"restoreTimeoutSeconds plus backoffs; otherwise {DEFAULT_RESTORE_TIMEOUT_S:.0f}s)",
    )
    parser.add_argument("--run-timeout", type=float, default=3600.0)
    parser.add_argument("--progress-interval", type=float, default=10.0, help="non-TTY lines")
    parser.add_argument(
        "--prefix", help="rollout id prefix (default: r with --tasks, none with --tasks-file)"
    )
    return parser


def _progress_text(progress: Progress) -> str:
    finished = progress.done + progress.failed
    mean = progress.reward_sum / progress.done if progress.done else 0.0
    return (
        f"{finished}/{progress.total} done, {progress.failed} failed, "
        f"{progress.continued} continued, mean reward {mean:.3f}, attempt {progress.attempt}, "
        f"{time.monotonic() - progress.started_at:.0f}s"
    )


async def _report(client: RolloutClient, stream: IO[str], interval: float, tty: bool) -> None:
    while True:
        progress = client.progress
        if tty:
            finished = progress.done + progress.failed
            width = 30
            filled = width * finished // max(1, progress.total)
            bar = "#" * filled + "." * (width - filled)
            stream.write(f"\r[{bar}] {_progress_text(progress)}   ")
        else:
            stream.write(f"rollout-collect: {_progress_text(progress)}\n")
        stream.flush()
        await anyio.sleep(0.2 if tty else interval)


def row_options(args: argparse.Namespace) -> RowOptions:
    """The `--tasks-file` options of a parsed command line."""
    return RowOptions(
        id_field=args.id_field,
        rollouts_per_row=args.rollouts_per_row,
        seed=args.seed,
        seed_field=args.seed_field or None,
        prefix=args.prefix or "",
        max_row_bytes=args.max_row_bytes,
        gym=args.gym,
    )


def checked_rows(args: argparse.Namespace) -> RowFile | None:
    """Check a parsed command line before any server is asked for anything, and scan its rows
    file, when it names one (reading a pipe to its end; opening a FIFO waits for its writer)."""
    if args.concurrency < 1:
        raise SystemExit(
            f"rollout-collect: --concurrency must be at least 1, not {args.concurrency}"
        )
    if args.tasks_file is not None:
        if is_stream(args.tasks_file):
            sys.stderr.write(
                f"rollout-collect: reading the rows from the pipe {args.tasks_file} until its "
                "writer closes it (a FIFO waits for a writer first); no episode starts before\n"
            )
            sys.stderr.flush()
        try:
            return scan_rows(args.tasks_file, row_options(args))
        except RowError as error:
            raise SystemExit(f"rollout-collect: {error}") from error
    if args.tasks < 0:
        raise SystemExit(f"rollout-collect: --tasks must not be negative, not {args.tasks}")
    parser = build_parser()
    given = [
        option
        for option in ("id_field", "gym", "rollouts_per_row", "seed_field", "max_row_bytes")
        if getattr(args, option) != parser.get_default(option)
    ]
    if given:
        names = ", ".join("--" + option.replace("_", "-") for option in given)
        raise SystemExit(f"rollout-collect: {names} only apply with --tasks-file")
    return None


async def collect(args: argparse.Namespace, rows: RowFile | None) -> int:
    """Run the episodes of a command line that `checked_rows` accepted (`rows`, its rows file)."""
    if args.rollout_set is not None:
        from .discovery import rollout_set_topology

        async with rollout_set_topology(args.rollout_set, args.namespace) as followed:
            if args.restore_timeout is None:
                # Strictly longer than the operator's worst case for this set's recovery.
                args.restore_timeout = await followed.recovery_bound_s()
                log.info(
                    "waiting up to %.0fs for a recovery (the set's bound)", args.restore_timeout
                )
            return await _collect(args, followed, rows)
    if args.restore_timeout is None:
        args.restore_timeout = DEFAULT_RESTORE_TIMEOUT_S
    if args.topology_file is not None:
        topology: Topology = FileTopology(args.topology_file)
    elif args.environment:
        topology = StaticTopology(args.environment, args.attempt)
    else:
        raise SystemExit(
            "rollout-collect: give --rollout-set NAME, --environment URL ... or --topology-file"
        )
    return await _collect(args, topology, rows)


async def _collect(args: argparse.Namespace, topology: Topology, rows: RowFile | None) -> int:
    client = RolloutClient(
        topology,
        concurrency=args.concurrency,
        restore_timeout_s=args.restore_timeout,
        run_timeout_s=args.run_timeout,
    )
    specs: Iterable[EpisodeSpec]
    if rows is None:
        prefix = "r" if args.prefix is None else args.prefix
        specs = episode_specs(args.tasks, args.seed, prefix)
        total = len(specs)
    else:
        prefix = args.prefix or ""
        specs, total = row_episodes(rows), rows.episodes_total
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tty = sys.stderr.isatty()
    with args.out.open("w", encoding="utf-8") as out:

        def write(outcome: EpisodeResult | EpisodeFailed) -> None:
            if isinstance(outcome, EpisodeResult):
                out.write(outcome.output_line() + "\n")
                out.flush()
            else:
                log.error("episode failed: %s", outcome)

        # the batch is one trace (OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set): a span per
        # /run call under it, each call carrying its traceparent to the environment
        batch = {"rollout.episodes": total, "rollout.seed": args.seed}
        failed: list[EpisodeFailed] = []

        def record(outcome: EpisodeResult | EpisodeFailed) -> None:
            write(outcome)
            if isinstance(outcome, EpisodeFailed) and len(failed) < 10:
                failed.append(outcome)

        broken: RowError | None = None
        with tracing.root_span(f"collect {prefix}", attributes=batch) as root:
            async with anyio.create_task_group() as group:
                group.start_soon(_report, client, sys.stderr, args.progress_interval, tty)
                try:
                    await client.run_each(specs, record, total=total)
                except RowError as error:  # the rows file changed under the run
                    broken = error
                group.cancel_scope.cancel()
            root.set_attribute("rollout.failed", client.progress.failed)
    if broken is not None:
        raise SystemExit(f"rollout-collect: {broken}")
    sys.stderr.write(
        ("\n" if tty else "") + f"rollout-collect: {_progress_text(client.progress)}\n"
    )
    for failure in failed:
        sys.stderr.write(f"  failed: {failure}\n")
    return 1 if client.progress.failed else 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        rows = checked_rows(args)
    except KeyboardInterrupt:  # waiting on a FIFO without a writer, or reading a slow pipe
        sys.stderr.write("rollout-collect: interrupted before the rows were read\n")
        raise SystemExit(130) from None
    tracing.configure("rollout-collect")
    try:
        code = anyio.run(collect, args, rows)
    finally:
        if rows is not None:
            rows.close()
    raise SystemExit(code)
