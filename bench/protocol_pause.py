"""How long a checkpoint pauses N live episodes (`--episodes`, 1,000 by default), against what
it fundamentally has to do. (10,000 did not complete on the two-core development machine: see
docs/operations.md, Sizing.)

Four reference servers run on loopback (`rollout-server <role>`, builtin model), or `--replicas
R` of each, wired in lanes (environment i calls agent i and resources i; agent i calls model i
and resources i) with the episodes spread over the lanes: a held episode keeps an open connection
from the trainer to its environment and on to its agent, so one environment holds two sockets
per episode and 10,000 episodes in one lane would need more than the 20,000 open files a process
may have here (the default is one replica per 4,000 episodes). The episodes
are started by a trainer process of their own (one open `/run` each) and held live by debug hooks,
a third at each of three points: between agent turns, in the middle of a model generation (a
cut), and inside a replay-mode verification. The coordinator runs in this process. Then:

  pause      prepare start -> resume done, measured by the coordinator (median of several)
  floor      writing and fsyncing the same bytes (the participants' record files, in parallel,
             on the same disk), plus the round trips the protocol makes in sequence: six (prepare
             in four role stages, one commit fan-out, one resume fan-out)
  ratio      pause / floor, target <= 2.0
  floor, the protocol's calls
             the same bytes plus each sequential call as the fan-out it is: a prepare stage
             reaches every instance of its role (three of each at 10,000 episodes), the commit
             and the resume every participant; each measured as a status fan-out to the same
             processes next to every checkpoint

The prepare is broken down by stage (each stage's span: first call sent to last reply, as the
coordinator saw it), next to the fan-out to that role's instances.

The commit is broken down by part on the same bytes, in this process: encoding the records
(building and serialising each one, and its digest: inside the commit before records were encoded
ahead, at each episode's boundary since), collecting the encoded records of the largest participant,
and `_storage.write_records` of every participant's records in parallel (the records file, the
manifest and their fsyncs); the rest of the commit is HTTP, the control plane and scheduling. Where
pause / floor is above 2.0, the part furthest above its share of the floor is printed as what
dominates.

It also shows the older baseline (write+fsync + 4 round trips), the round trips resuming at once
saves against resuming stage by stage (three), and each call's median as the coordinator saw it.

and next to it the checkpoint bytes per episode against the participants' resident memory (what a
process-level snapshot, CRIU-style, would have to write instead).

Each round takes one checkpoint three ways, each going first in turn, so all see the same
episodes and machine: the old way (records written and fsynced inside the pause), the new way
(persist after resume: the cut inside the pause, then the resume, then the persist;
docs/protocol.md, "Persist after resume"), both in the four prepare stages, and the new way in
the stages the servers declare (docs/protocol.md, "Prepare stages"), as the operator takes it.
The new ways are printed against the floor of their sequential calls alone (no write is left in
their pause: their round trips, and the same calls as the fan-outs they are; target <= 1.5),
with the time from the cut to every record durable and the bytes the cut held.

`--storage compare` instead holds the episodes twice, on a volume and on a bucket of a local S3
server, and prints the pause on each, the old way and the operator's (`compare_storage`).

Prints tables; asserts nothing. Run: `.venv/bin/python bench/protocol_pause.py [--episodes N]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import anyio
import httpx

# The test support package's delegating participant client (as bench/engine_relay.py imports
# its server processes).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rollout_protocol import (
    PREPARE_ORDER,
    S3_ENV_PREFIX,
    SEQUENTIAL_STAGES,
    Boundary,
    CheckpointResult,
    CommitReply,
    CommitRequest,
    Coordinator,
    EpisodeRuntime,
    HttpParticipantClient,
    PersistRequest,
    PrepareReply,
    PrepareRequest,
    Record,
    ResumeReply,
    ResumeRequest,
    Role,
    encode_record,
)
from rollout_protocol import _storage as storage
from rollout_servers.tasks import sample_tasks
from testsupport.delegating import Delegating

from devcluster import s3

_Reply = TypeVar("_Reply")

TOKEN = "bench-token"
SEQUENTIAL_CALLS = 6
"""prepare (one per role stage: 4) + commit (one fan-out) + resume (one fan-out)."""
STAGED_RESUME_CALLS = 4
"""Resume stage by stage (resources, agent, model, environment), as before it fanned out."""
HOLD_SECONDS_PER_EPISODE = 0.15
"""Budget for starting episodes and reaching their hold points (on top of a minute): 1,000 took
96 s on a two-core machine other work kept at load 15; 10,000 scale about linearly."""
SERVER = str(Path(sys.executable).with_name("rollout-server"))
ROLES = (Role.ENVIRONMENT, Role.AGENT, Role.MODEL, Role.RESOURCES)
EPISODES_PER_REPLICA = 4000
"""The default replicas per role: a lane's environment holds two sockets per held episode."""
OLD, NEW, STAGED = "old", "new", "staged"
WAYS = (OLD, NEW, STAGED)
"""The old way commits (writes and fsyncs) inside the pause; the new way cuts inside it and
persists after the resume (docs/protocol.md, "Persist after resume"); both prepare in the four
stages of `PREPARE_ORDER`. The staged way is the new way with the prepare's stages from the
waits the servers declare (docs/protocol.md, "Prepare stages"): what the operator runs."""
Server = tuple[Role, int]
"""A server process: its role and its index among that role's replicas."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def servers(
    root: Path,
    extra: Mapping[Role, Sequence[str]] | None = None,
    replicas: int = 1,
    environment: Mapping[str, str] | None = None,
) -> Iterator[dict[Server, tuple[str, int]]]:
    """The servers as processes, `replicas` of each role wired in lanes (with `extra`
    arguments per role, `environment` added to theirs); yields (role, index) -> (url, pid);
    stops them on exit. bench/tracing.py starts its two groups with this too."""
    root.mkdir(parents=True, exist_ok=True)
    lanes = range(replicas)
    url = {(role, i): f"http://127.0.0.1:{free_port()}" for role in ROLES for i in lanes}

    def peers(role: Role, i: int) -> list[str]:
        resources = ["--resources-url", url[(Role.RESOURCES, i)]]
        if role is Role.ENVIRONMENT:
            return ["--agent-url", url[(Role.AGENT, i)], *resources]
        if role is Role.AGENT:
            return ["--model-url", url[(Role.MODEL, i)], *resources]
        return []

    env = dict(os.environ)
    env.update(
        ROLLOUT_SET="bench",
        ROLLOUT_ATTEMPT="0",
        ROLLOUT_CHECKPOINT_ROOT=str(root / "checkpoints"),
        ROLLOUT_CONTROL_TOKEN=TOKEN,
        ROLLOUT_LEASE_GRACE_SECONDS="120",
    )
    env.update(environment or {})
    if any(name.startswith(S3_ENV_PREFIX) for name in env):
        del env["ROLLOUT_CHECKPOINT_ROOT"]  # a set's storage is a volume or a bucket, not both
    processes: dict[Server, subprocess.Popen[bytes]] = {}
    try:
        for (role, i), address in url.items():
            port = address.rsplit(":", 1)[1]
            command = [SERVER, role.value, "--port", port, "--debug-hooks"]
            command += ["--log-level", "warning", *peers(role, i), *(extra or {}).get(role, ())]
            with (root / f"{role.value}-{i}.log").open("ab") as log:
                processes[(role, i)] = subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env={**env, "ROLLOUT_INDEX": str(i)},
                    start_new_session=True,
                )
        deadline = time.monotonic() + 60 + 5 * len(url)
        for (role, i), process in processes.items():
            try:
                _wait_ready(role, process, deadline)
            except RuntimeError as error:
                raise RuntimeError(f"{error}:\n{_tail(root / f'{role.value}-{i}.log')}") from None
        yield {server: (url[server], process.pid) for server, process in processes.items()}
    finally:
        for process in processes.values():
            with contextlib.suppress(ProcessLookupError):  # one that exited at its start
                os.killpg(process.pid, signal.SIGINT)
        for process in processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_ready(role: Role, process: subprocess.Popen[bytes], deadline: float) -> None:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b'"ready"' not in (
            process.stdout.readline()
            if selector.select(timeout=max(0.0, deadline - time.monotonic()))
            else b""
        ):
            if time.monotonic() >= deadline or process.poll() is not None:
                raise RuntimeError(f"{role.value} server did not start; see its log")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_and_fsync(directory: Path, sizes: list[int]) -> float:
    """Seconds to write and fsync files of these sizes in parallel (as the commit fan-out does),
    each followed by a directory fsync, like a records file renamed into place."""
    payloads = [os.urandom(size) for size in sizes]

    def one(i: int) -> None:
        path = directory / f"baseline-{i}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payloads[i])
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    with ThreadPoolExecutor(len(sizes)) as pool:
        started = time.perf_counter()
        list(pool.map(one, range(len(sizes))))
        return time.perf_counter() - started


def commit_parts(root: Path, manifest_paths: Mapping[str, str], repeats: int) -> dict[str, float]:
    """The commit's parts on the bytes it wrote (see the module docstring): seconds."""
    by_instance = {
        instance: storage.read_records(
            (root / path).parent, expect_checkpoint_id=path.split("/")[-3]
        )[1]
        for instance, path in manifest_paths.items()
    }
    fields = [
        (r.kind, r.rollout_id, r.attempt, r.key, r.data)
        for records in by_instance.values()
        for r in records
    ]
    started = time.perf_counter()
    for kind, rollout_id, attempt, key, data in fields:
        encode_record(Record(kind=kind, rollout_id=rollout_id, attempt=attempt, key=key, data=data))
    encode_s = time.perf_counter() - started
    largest = max(by_instance.values(), key=len)
    runtime = EpisodeRuntime("bench")
    for record in largest:
        runtime.begin(record.rollout_id + record.key, 0, Boundary("b", record.data))
    collects = []
    for _ in range(repeats):
        started = time.perf_counter()
        runtime.export_encoded(None)
        collects.append(time.perf_counter() - started)
    encoded = {i: [encode_record(r) for r in records] for i, records in by_instance.items()}

    def write(n: int, instance: str) -> None:
        storage.write_records(
            root / "parts" / f"{n}" / instance,
            role=Role(instance.rsplit("-", 1)[0]),
            instance=instance,
            checkpoint_id=f"parts-{n}",
            attempt=0,
            encoded=encoded[instance],
        )

    writes = []
    with ThreadPoolExecutor(len(encoded)) as pool:
        for n in range(repeats):
            started = time.perf_counter()
            list(pool.map(write, [n] * len(encoded), list(encoded)))
            writes.append(time.perf_counter() - started)
    return {
        "encode": encode_s,
        "collect": statistics.median(collects),
        "write": statistics.median(writes),
    }


async def round_trips(
    session: aiohttp.ClientSession, urls: Sequence[str], samples: int
) -> list[float]:
    """Seconds of authenticated control-plane calls (status) to every participant in `urls` at
    once (a fan-out, as the commit and the resume make), `samples` times one after another;
    through the session the coordinator's participant clients use (aiohttp, as theirs)."""

    async def status(url: str) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with session.get(url + "/checkpoint/v1/status", headers=headers) as reply:
            reply.raise_for_status()
            await reply.read()

    times = []
    for _ in range(samples):
        started = time.perf_counter()
        async with anyio.create_task_group() as fan_out:
            for url in urls:
                fan_out.start_soon(status, url)
        times.append(time.perf_counter() - started)
    return times


@contextmanager
def trainer(environment: str, ids: list[str], failures: Path, log: Path) -> Iterator[None]:
    """The trainer side as its own process: one open `/run` per episode until the block ends."""
    command = [sys.executable, __file__, "--trainer", environment, "--failures", str(failures)]
    with log.open("ab") as stderr:
        process = subprocess.Popen(
            [*command, *ids], stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def run_trainer(environment: str, ids: list[str], failures: Path) -> None:
    """Start every episode and keep its `/run` open; note any that ends (they should not)."""
    tasks = [t.model_copy(update={"verify": "replay"}) for t in sample_tasks(len(ids), 1)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # 1,000 open calls spread over several connection pools: one pool would cost O(n) per call
    shards = [httpx.AsyncClient(timeout=None, limits=limits) for _ in range(16)]

    async def run(http: httpx.AsyncClient, body: dict[str, object]) -> None:
        try:
            reply = await http.post(environment + "/run", json=body)
            line = f"{body['rollout_id']}: HTTP {reply.status_code} {reply.text[:200]}"
        except httpx.HTTPError as error:
            line = f"{body['rollout_id']}: {type(error).__name__}: {error}"
        with failures.open("a") as out:
            out.write(line + "\n")

    async with anyio.create_task_group() as runs:
        for i, (rid, task) in enumerate(zip(ids, tasks, strict=True)):
            body = {"rollout_id": rid, "attempt": 0, "task": task.wire()}
            runs.start_soon(run, shards[i % len(shards)], body)


@dataclass
class HeldEpisodes:
    """A group of servers with live episodes held at their hold points (`held_episodes`)."""

    urls: dict[Server, str]
    pids: dict[Server, int]
    live_after: float
    """Seconds from starting the episodes to every one held."""


@asynccontextmanager
async def held_episodes(
    root: Path, episodes: int, replicas: int, environment: Mapping[str, str] | None = None
) -> AsyncIterator[HeldEpisodes]:
    """The servers (`servers`, their files under `root`) with `episodes` live episodes started by
    a trainer process per lane and held until the block ends: a third of each lane's episodes at
    each hold point (between agent turns, mid-generation, inside a replay-mode verification)."""
    with servers(root, replicas=replicas, environment=environment) as procs:
        urls = {server: url for server, (url, _) in procs.items()}
        ids = [f"b{i:05d}" for i in range(episodes)]
        lanes = {lane: ids[lane::replicas] for lane in range(replicas)}
        holds = {
            Role.AGENT: ("turn", 1),  # between agent turns
            Role.MODEL: ("token", 3),  # mid-generation: a cut
            Role.RESOURCES: ("verify", None),  # replay-mode verification in flight
        }
        # (server, its episodes held there): a third of each lane's episodes per hold point
        groups = {
            (role, lane): members[i :: len(holds)]
            for lane, members in lanes.items()
            for i, role in enumerate(holds)
        }
        # The coordinator runs here, the trainer's open /run calls in a process of their own, as
        # in a deployment: 1,000 in-flight requests in this heap would make this process's
        # garbage collections (up to ~100 ms) part of every measured pause.
        failures = root / "failed-runs.txt"
        async with httpx.AsyncClient(timeout=130) as http:
            # armed 32 calls at a time: 10,000 one by one took minutes on a loaded machine
            limiter = anyio.CapacityLimiter(32)

            async def arm(url: str, body: dict[str, object]) -> None:
                async with limiter:
                    (await http.post(url + "/debug/arm", json=body)).raise_for_status()

            async with anyio.create_task_group() as arming:
                for (role, lane), members in groups.items():
                    point, index = holds[role]
                    for rid in members:
                        body: dict[str, object] = {
                            "point": point,
                            "rollout_id": rid,
                            "index": index,
                        }
                        arming.start_soon(arm, urls[(role, lane)], body)
            started = time.perf_counter()
            with ExitStack() as trainers:
                for lane, members in lanes.items():
                    environment_url = urls[(Role.ENVIRONMENT, lane)]
                    log = root / f"trainer-{lane}.log"
                    trainers.enter_context(trainer(environment_url, members, failures, log))
                budget = time.monotonic() + 60 + HOLD_SECONDS_PER_EPISODE * episodes
                for (role, lane), members in groups.items():
                    point, _ = holds[role]
                    reply = await _wait_held(http, urls[(role, lane)], point, len(members), budget)
                    if reply.status_code != 200:
                        names = [f"{r.value}-{i}.log" for r, i in procs]
                        names += [f"trainer-{lane}.log" for lane in lanes]
                        logs = "\n".join(f"--- {name}\n" + _tail(root / name) for name in names)
                        ended = _tail(failures, 3) if failures.exists() else "none"
                        raise SystemExit(
                            f"episodes did not reach their hold points: {reply.text}\n"
                            f"/run calls that ended early: {ended}\n{logs}"
                        )
                yield HeldEpisodes(
                    urls,
                    {server: pid for server, (_, pid) in procs.items()},
                    time.perf_counter() - started,
                )


async def bench(episodes: int, repeats: int, replicas: int, root: Path) -> None:
    calls: dict[tuple[str, Role], list[float]] = defaultdict(list)
    spans: Spans = defaultdict(list)
    current = [""]
    async with held_episodes(root, episodes, replicas) as held:
        urls, live_after = held.urls, held.live_after
        # no connection limit: every participant's prepare parks on its connection
        unlimited = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=unlimited, timeout=timeout) as control:
            participants = [
                TimedParticipant(
                    HttpParticipantClient(role, url, index=index, token=TOKEN, client=control),
                    calls,
                    spans,
                    current,
                )
                for (role, index), url in urls.items()
            ]
            coordinator = Coordinator(participants, call_timeout=120)
            declared = coordinator.stages((await coordinator.status(time.time() + 60)).statuses)
            trips, fan_outs = [], []
            results: dict[str, list[CheckpointResult]] = {way: [] for way in WAYS}
            stage_trips: dict[Role, list[float]] = defaultdict(list)
            declared_trips: dict[tuple[Role, ...], list[float]] = defaultdict(list)
            everyone = list(urls.values())
            by_role = {role: [u for (r, _), u in urls.items() if r is role] for role in ROLES}
            for n in range(repeats):
                for role, members in by_role.items():
                    stage_trips[role] += await round_trips(control, members, 5)
                for roles in declared:
                    members = [u for role in roles for u in by_role[role]]
                    declared_trips[roles] += await round_trips(control, members, 5)
                # round trips sampled next to every checkpoint, so the baseline sees
                # the same machine state as the pause it is compared with
                trips += await round_trips(control, [urls[(Role.RESOURCES, 0)]], 10)
                fan_outs += await round_trips(control, everyone, 10)
                # the ways take turns going first, so every way sees the same machine
                turn = n % len(WAYS)
                for way in WAYS[turn:] + WAYS[:turn]:
                    current[0] = f"{way}-{n}"
                    result = await coordinator.checkpoint(
                        f"bench-{way}-{n}",
                        prepare_timeout=60,
                        commit_timeout=60,
                        persist_after_resume=way != OLD,
                        stages=declared if way == STAGED else SEQUENTIAL_STAGES,
                    )
                    if not result.ok:
                        raise SystemExit(
                            f"{way} checkpoint failed: {result.reason}: {result.message}"
                        )
                    results[way].append(result)
            trips += await round_trips(control, [urls[(Role.RESOURCES, 0)]], 10)
            fan_outs += await round_trips(control, everyone, 10)
            rtt = statistics.median(trips)
            rtt_all = statistics.median(fan_outs)
        rss = {server: rss_bytes(pid) for server, pid in held.pids.items()}
        cpu = {server: cpu_seconds(pid) for server, pid in held.pids.items()}

        last = results[OLD][-1]
        assert last.commit is not None
        manifests = {m.instance: m for m in last.commit.manifests.values()}
        sizes = [m.bytes for m in manifests.values()]
        scratch = root / "checkpoints"
        writes = sorted(write_and_fsync(scratch, sizes) for _ in range(repeats))
        write_s = statistics.median(writes)
        baseline = write_s + 4 * rtt
        floor = write_s + SEQUENTIAL_CALLS * rtt
        # the commit and the resume reach every participant at once; with more processes than
        # cores a fan-out costs more than one participant's round trip
        floor_fan_out = write_s + (SEQUENTIAL_CALLS - 2) * rtt + 2 * rtt_all
        stage_rtt = {role: statistics.median(stage_trips[role]) for role in ROLES}
        floor_calls = write_s + sum(stage_rtt.values()) + 2 * rtt_all
        stages = {
            (op, role): statistics.median(
                max(end for _, end in spans[(f"{OLD}-{n}", op, role)])
                - min(start for start, _ in spans[(f"{OLD}-{n}", op, role)])
                for n in range(repeats)
            )
            for op in ("prepare",)
            for role in ROLES
        }
        pause = statistics.median(r.durations.pause_seconds for r in results[OLD])
        parts = commit_parts(root / "checkpoints", last.commit.manifest_paths, repeats)

    total = sum(sizes)
    print(
        f"\n{episodes} live episodes on {len(manifests)} participants ({replicas} per role, "
        f"loopback), {repeats} checkpoints"
    )
    print(f"(episodes reached their hold points {live_after:.1f}s after starting)\n")
    print("the old way (records written inside the pause); the new way is compared after it:\n")
    prepare = statistics.median(r.durations.prepare_seconds for r in results[OLD])
    commit = statistics.median(r.durations.commit_seconds for r in results[OLD])
    saved = (STAGED_RESUME_CALLS - 1) * rtt
    rows = [
        ("pause (prepare start -> resumed)", pause),
        ("  prepare, 4 stages in order", prepare),
        ("  commit, fanned out", commit),
        ("  resume, all at once", max(0.0, pause - prepare - commit)),
        ("write+fsync the same bytes", write_s),
        ("one control round trip", rtt),
        ("baseline: write+fsync + 4 RTT", baseline),
        (f"floor: write+fsync + {SEQUENTIAL_CALLS} RTT", floor),
        (f"one fan-out to all {len(manifests)}", rtt_all),
        ("floor, commit+resume as fan-outs", floor_fan_out),
        ("saved by resuming at once (3 RTT)", saved),
    ]
    print(f"{'':<36}{'seconds':>10}")
    for label, value in rows:
        print(f"{label:<36}{value:>10.4f}")
    print(f"{'ratio pause / baseline':<36}{pause / baseline:>10.2f}")
    print(
        f"{'ratio pause / floor':<36}{pause / floor:>10.2f}   "
        f"(target <= 2.0; {SEQUENTIAL_CALLS} sequential calls)"
    )
    print(f"{'ratio pause / floor with fan-outs':<36}{pause / floor_fan_out:>10.2f}")
    print(
        f"{'floor, the protocol calls as fan-outs':<36}{floor_calls:>10.4f}   "
        "(write+fsync + 4 stage fan-outs + 2 fan-outs to all)"
    )
    print(f"{'ratio pause / that floor':<36}{pause / floor_calls:>10.2f}\n")
    print("the prepare by stage, in order (seconds; the stage's fan-out measured alone):")
    for role in PREPARE_ORDER:
        print(
            f"  {role.value:<14}{stages[('prepare', role)]:>10.4f}"
            f"   fan-out to its {len(by_role[role])} instance(s) {stage_rtt[role]:.4f}"
        )
    print(
        f"  {'sum of stages':<14}{sum(stages.values()):>10.4f}"
        f"   (the prepare as timed: {prepare:.4f}; the rest is between stages)\n"
    )
    resume = max(0.0, pause - prepare - commit)
    rest = max(0.0, commit - parts["collect"] - parts["write"])
    print("the commit by part, on the same bytes in this process (seconds):")
    part_rows = [
        ("encode every record (one core)", parts["encode"], "at boundaries, not in the pause"),
        ("collect encoded records", parts["collect"], "largest participant"),
        ("write records + manifest, fsyncs", parts["write"], "all participants at once"),
        ("the rest: HTTP, control plane", rest, "commit - collect - write"),
    ]
    for label, value, note in part_rows:
        print(f"  {label:<34}{value:>10.4f}   {note}")
    # each part's excess over what the floor grants it
    excess = {
        "prepare (beyond its 4 stage fan-outs)": prepare - sum(stage_rtt.values()),
        "commit (beyond write + one fan-out)": commit - parts["write"] - rtt_all,
        "resume (beyond one fan-out)": resume - rtt_all,
    }
    if pause / floor > 2.0:
        worst = max(excess, key=lambda name: excess[name])
        print(
            "\npause / floor above 2.0; above the floor: "
            + ", ".join(f"{name} {value:.4f} s" for name, value in excess.items())
            + f"\ndominates: {worst}"
        )
    print()
    print("median seconds per call, as the coordinator saw it (one round trip included):")
    print(f"{'participant':<14}" + "".join(f"{op:>10}" for op in ("prepare", "commit", "resume")))
    for role in ROLES:
        cells = "".join(
            f"{statistics.median(calls[(f'{op}/{OLD}', role)]):>10.4f}"
            for op in ("prepare", "commit", "resume")
        )
        print(f"{role.value:<14}{cells}")
    print("\nthe same, the new way (commit: the cut; persist: after the resume):")
    new_ops = ("prepare", "commit", "resume", "persist")
    print(f"{'participant':<14}" + "".join(f"{op:>10}" for op in new_ops))
    for role in ROLES:
        cells = "".join(
            f"{statistics.median(calls[(f'{op}/{NEW}', role)]):>10.4f}" for op in new_ops
        )
        print(f"{role.value:<14}{cells}")
    print()
    header = f"{'participant':<14}{'records':>9}{'bytes':>12}{'B/episode':>11}{'RSS MiB':>10}"
    print(header + f"{'CPU s':>8}")
    for (role, index), server_rss in rss.items():
        m = manifests[f"{role.value}-{index}"]
        print(
            f"{m.instance:<14}{m.record_count:>9}{m.bytes:>12}"
            f"{m.bytes / m.record_count if m.record_count else 0:>11.0f}"
            f"{server_rss / 2**20:>10.1f}{cpu[(role, index)]:>8.1f}"
        )
    rss_total = sum(rss.values())
    print(
        f"{'total':<14}{sum(m.record_count for m in manifests.values()):>9}{total:>12}"
        f"{total / episodes:>11.0f}{rss_total / 2**20:>10.1f}"
    )
    print(
        f"\ncheckpoint bytes per episode {total / episodes:.0f} B vs resident memory per episode "
        f"{rss_total / episodes:.0f} B: a process snapshot writes {rss_total / total:.0f}x more"
    )
    new = _new_way(
        "the new way: cut inside the pause, resume, then persist (median seconds)",
        results[NEW],
        list(stage_rtt.values()),
        (rtt, rtt_all),
        pause,
        floor_calls,
    )
    staged = _new_way(
        "the same with the declared stages, "
        + ", ".join("+".join(r.value for r in roles) for roles in declared)
        + " (median seconds)",
        results[STAGED],
        [statistics.median(declared_trips[roles]) for roles in declared],
        (rtt, rtt_all),
        pause,
        floor_calls,
    )
    print(
        f"  the declared stages against the four, same run: pause {staged['pause_s']:.4f} / "
        f"{new['pause_s']:.4f} = {staged['pause_s'] / new['pause_s']:.2f}, prepare "
        f"{staged['prepare_s']:.4f} / {new['prepare_s']:.4f} = "
        f"{staged['prepare_s'] / new['prepare_s']:.2f}"
    )
    summary = {
        "new_way": new,
        "staged_way": staged,
        "episodes": episodes,
        "replicas": replicas,
        "pause_s": pause,
        "prepare_s": prepare,
        "commit_s": commit,
        "write_fsync_s": write_s,
        "rtt_s": rtt,
        "fan_out_rtt_s": rtt_all,
        "ratio_floor_fan_out": pause / floor_fan_out,
        "floor_calls_s": floor_calls,
        "ratio_floor_calls": pause / floor_calls,
        "prepare_stages_s": {role.value: stages[("prepare", role)] for role in ROLES},
        "floor_s": floor,
        "ratio_floor": pause / floor,
        "baseline_s": baseline,
        "ratio_baseline": pause / baseline,
        "resume_round_trips_saved": STAGED_RESUME_CALLS - 1,
    }
    print(json.dumps(summary))


STORAGES = ("volume", "bucket")
COMPARED = (OLD, STAGED)
"""The ways the storage comparison takes: records written inside the pause, and the way the
operator checkpoints (persisted after the resume, the declared stages)."""
BUCKET_TARGET = 1.1
"""The new way's pause on a bucket over its pause on a volume: the cut writes nothing, so the
storage behind it should not show in the pause."""


async def compare_storage(episodes: int, repeats: int, replicas: int, root: Path) -> None:
    """The pause and the time to durable on a bucket against a volume, in one run: two groups of
    servers with the same held episodes, one writing to a folder of this machine's disk, one to a
    bucket of the S3 server `make s3-server` builds (versitygw on loopback, devcluster/s3.py);
    each round takes one checkpoint of every storage and way, in an order turned every round so
    that none always goes first."""
    s3_root = root / "s3"
    server = s3.start(s3_root / "data", root / "s3-server.log")
    try:
        server.create_bucket("bench")
        credentials = server.credentials.write(s3_root / "credentials")
        bucket_env = server.participant_env("bench", credentials)
        results: dict[tuple[str, str], list[CheckpointResult]] = defaultdict(list)
        fan_outs: dict[str, list[float]] = defaultdict(list)
        async with (
            held_episodes(root / "volume", episodes, replicas) as volume,
            held_episodes(root / "bucket", episodes, replicas, bucket_env) as bucket,
        ):
            groups = {"volume": volume, "bucket": bucket}
            unlimited = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(connector=unlimited, timeout=timeout) as control:
                coordinators = {
                    storage: Coordinator(
                        [
                            HttpParticipantClient(role, url, index=i, token=TOKEN, client=control)
                            for (role, i), url in group.urls.items()
                        ],
                        call_timeout=120,
                    )
                    for storage, group in groups.items()
                }
                declared = {
                    storage: coordinator.stages(
                        (await coordinator.status(time.time() + 60)).statuses
                    )
                    for storage, coordinator in coordinators.items()
                }
                combos = [(storage, way) for storage in STORAGES for way in COMPARED]
                for n in range(repeats):
                    for storage, group in groups.items():
                        fan_outs[storage] += await round_trips(
                            control, list(group.urls.values()), 5
                        )
                    turn = n % len(combos)
                    for storage, way in combos[turn:] + combos[:turn]:
                        result = await coordinators[storage].checkpoint(
                            f"compare-{storage}-{way}-{n}",
                            prepare_timeout=60,
                            commit_timeout=60,
                            persist_after_resume=way != OLD,
                            stages=declared[storage] if way == STAGED else SEQUENTIAL_STAGES,
                        )
                        if not result.ok:
                            raise SystemExit(
                                f"{way} checkpoint on the {storage} failed: "
                                f"{result.reason}: {result.message}"
                            )
                        results[(storage, way)].append(result)
    finally:
        server.stop()
    _print_storage_comparison(episodes, replicas, repeats, results, fan_outs)


def _print_storage_comparison(
    episodes: int,
    replicas: int,
    repeats: int,
    results: Mapping[tuple[str, str], Sequence[CheckpointResult]],
    fan_outs: Mapping[str, Sequence[float]],
) -> None:
    def median(values: Iterable[float]) -> float:
        return statistics.median(list(values))

    pause = {key: median(r.durations.pause_seconds for r in rs) for key, rs in results.items()}
    commit = {key: median(r.durations.commit_seconds for r in rs) for key, rs in results.items()}
    durable = {
        key: median(
            r.durations.pause_seconds if key[1] == OLD else r.durations.persist_seconds for r in rs
        )
        for key, rs in results.items()
    }
    print(
        f"\n{episodes} live episodes per storage ({replicas} server(s) per role each, loopback), "
        f"{repeats} checkpoints of each storage and way, median seconds:\n"
    )
    print(f"{'':<12}{'':<8}{'pause':>10}{'commit/cut':>12}{'to durable':>12}{'fan-out':>10}")
    for where in STORAGES:
        for way in COMPARED:
            key = (where, way)
            print(
                f"{where:<12}{way:<8}{pause[key]:>10.4f}{commit[key]:>12.4f}"
                f"{durable[key]:>12.4f}{median(fan_outs[where]):>10.4f}"
            )
    ratios = {way: pause[("bucket", way)] / pause[("volume", way)] for way in COMPARED}
    print(
        "\n(to durable: the old way's records are durable when its pause ends; the new way's "
        "from the cut to every record durable, after the resume)"
    )
    print(
        f"pause on the bucket / on the volume: old way {ratios[OLD]:.2f}, new way "
        f"{ratios[STAGED]:.2f} (target for the new way <= {BUCKET_TARGET}; "
        f"{'met' if ratios[STAGED] <= BUCKET_TARGET else 'missed'})"
    )
    print(
        json.dumps(
            {
                "episodes": episodes,
                "pause_s": {f"{s}/{w}": pause[(s, w)] for s, w in pause},
                "to_durable_s": {f"{s}/{w}": durable[(s, w)] for s, w in durable},
                "ratio_bucket_volume": ratios,
            }
        )
    )


async def _wait_held(
    http: httpx.AsyncClient, url: str, point: str, count: int, budget: float
) -> httpx.Response:
    """Wait until `count` episodes are held at `point` (the hook's long poll is at most 120 s
    per call, so it is asked again until the budget, a monotonic time, is spent)."""
    while True:
        left = budget - time.monotonic()
        timeout_s = max(1.0, min(120.0, left))
        wait = {"point": point, "paused": True, "count": count, "timeout_s": timeout_s}
        try:
            reply = await http.post(url + "/debug/wait", json=wait, timeout=timeout_s + 60)
        except httpx.TimeoutException:
            # a server too busy starting episodes to answer its own long poll: ask again
            if budget - time.monotonic() <= 0:
                raise
            continue
        if reply.status_code != 408 or left <= 120:
            return reply


Spans = dict[tuple[str, str, Role], list[tuple[float, float]]]
"""(checkpoint, as `<way>-<number>`; operation; role) -> (sent, replied) of each instance's
call."""


def _new_way(
    title: str,
    results: Sequence[CheckpointResult],
    stage_fan_outs: Sequence[float],
    trips: tuple[float, float],
    old_pause: float,
    old_floor_calls: float,
) -> dict[str, float]:
    """Print a way that cuts, resumes, then persists against the old one and the floor of its
    sequential calls alone (no write: the persist is after the resume): a fan-out per prepare
    stage (`stage_fan_outs`), the cut and the resume; `trips`: one round trip and one fan-out
    to every participant. Returns its numbers."""
    rtt, rtt_all = trips
    calls = len(stage_fan_outs) + 2

    def median(values: Iterable[float]) -> float:
        return statistics.median(list(values))

    pause = median(r.durations.pause_seconds for r in results)
    prepare = median(r.durations.prepare_seconds for r in results)
    cut = median(r.durations.commit_seconds for r in results)
    durable = median(r.durations.persist_seconds for r in results)
    floor_rtt = calls * rtt
    floor_calls = sum(stage_fan_outs) + 2 * rtt_all
    held = [
        max(m.bytes for m in r.commit.manifests.values()) for r in results if r.commit is not None
    ]
    total = [r.commit.bytes for r in results if r.commit is not None]
    print(f"\n{title}:")
    rows = [
        ("pause (prepare start -> resumed)", pause),
        (f"  prepare, {len(stage_fan_outs)} stages in order", prepare),
        ("  the cut, fanned out", cut),
        ("  resume, all at once", max(0.0, pause - prepare - cut)),
        ("cut -> every record durable", durable),
        (f"floor: {calls} RTT, no write", floor_rtt),
        ("floor: the calls as fan-outs, no write", floor_calls),
    ]
    for label, value in rows:
        print(f"  {label:<40}{value:>10.4f}")
    print(f"  {f'ratio pause / {calls} RTT':<40}{pause / floor_rtt:>10.2f}")
    print(
        f"  {'ratio pause / the calls as fan-outs':<40}{pause / floor_calls:>10.2f}"
        "   (target <= 1.5)"
    )
    print(
        f"  {'the old way, same run: pause':<40}{old_pause:>10.4f}"
        f"   ({old_pause / old_floor_calls:.2f} x its floor with the write)"
    )
    print(
        f"  held at the cut: {max(held)} bytes in the largest participant, {max(total)} in all "
        "(released once durable)"
    )
    return {
        "pause_s": pause,
        "prepare_s": prepare,
        "cut_s": cut,
        "cut_to_durable_s": durable,
        "floor_rtt_s": floor_rtt,
        "floor_calls_s": floor_calls,
        "ratio_floor_rtt": pause / floor_rtt,
        "ratio_floor_calls": pause / floor_calls,
        "held_bytes_largest": max(held),
        "held_bytes_total": max(total),
    }


class TimedParticipant(Delegating[HttpParticipantClient]):
    """A participant client that records how long each prepare, commit and resume took, and
    when each was sent and answered (`spans`, under the checkpoint number in `current[0]`)."""

    def __init__(
        self,
        inner: HttpParticipantClient,
        calls: dict[tuple[str, Role], list[float]],
        spans: Spans,
        current: list[str],
    ) -> None:
        super().__init__(inner)
        self.calls = calls
        self.spans = spans
        self.current = current

    async def _timed(self, operation: str, call: Awaitable[_Reply]) -> _Reply:
        started = time.perf_counter()
        reply = await call
        ended = time.perf_counter()
        way = self.current[0].split("-", 1)[0]
        self.calls[(f"{operation}/{way}", self.role)].append(ended - started)
        self.spans[(self.current[0], operation, self.role)].append((started, ended))
        return reply

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        return await self._timed("prepare", self.inner.prepare(request))

    async def commit(self, request: CommitRequest) -> CommitReply:
        return await self._timed("commit", self.inner.commit(request))

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        return await self._timed("resume", self.inner.resume(request))

    async def persist(self, request: PersistRequest) -> CommitReply:
        return await self._timed("persist", self.inner.persist(request))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--replicas",
        type=int,
        help=f"servers per role (default: one per {EPISODES_PER_REPLICA:,} episodes)",
    )
    parser.add_argument(
        "--storage",
        choices=("volume", "compare"),
        default="volume",
        help="volume: the pause against its floor (the default); compare: on a bucket of a "
        "local S3 server against a volume, in one run",
    )
    parser.add_argument("--trainer", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--failures", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("ids", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer is not None:
        anyio.run(run_trainer, args.trainer, args.ids, args.failures)
        return
    with tempfile.TemporaryDirectory(prefix="protocol-pause-") as tmp:
        replicas = args.replicas or max(1, -(-args.episodes // EPISODES_PER_REPLICA))
        run = compare_storage if args.storage == "compare" else bench
        anyio.run(run, args.episodes, args.repeats, replicas, Path(tmp))


if __name__ == "__main__":
    main()
