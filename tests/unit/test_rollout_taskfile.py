"""The user's own tasks (`rollout-collect --tasks-file`): rows, ids, seeds and the errors.

Rows files are real files under `tmp_path`, FIFOs and pipes (read once, as streams; what a user
sees while `rollout-collect` waits for a FIFO's writer is checked on the CLI run as a process);
the client runs against a fake environment (an httpx transport, the layer below the client), as
in `test_rollout_client.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_protocol import ROLLOUT_ID_PATTERN, task_digest
from rollout_servers.client import (
    EpisodeFailed,
    EpisodeResult,
    EpisodeSpec,
    RolloutClient,
    build_parser,
    main,
    row_episodes,
)
from rollout_servers.servers.environment import RunRequest
from rollout_servers.taskfile import (
    DIGEST_ID_CHARS,
    RowError,
    RowFile,
    RowOptions,
    rollout_seed,
    scan_rows,
)
from rollout_servers.tasks import shipped_tasks
from rollout_servers.topology import StaticTopology

ROWS = [
    {"id": "cave-1", "prompt": "Find the lamp.", "meta": {"level": 1}},
    {"id": 7, "prompt": "Open the chest.", "tags": ["x", "y"]},
    {"id": "cave-3", "prompt": "Take the coin."},
]


def write_rows(path: Path, rows: list[Any], *, blank_after: int | None = None) -> Path:
    lines = [json.dumps(row) for row in rows]
    if blank_after is not None:
        lines.insert(blank_after, "   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def scan_error(path: Path, options: RowOptions | None = None) -> str:
    with pytest.raises(RowError) as raised:
        scan_rows(path, options or RowOptions(id_field="id"))
    return str(raised.value)


# --- ids and seeds ----------------------------------------------------------------------------


def test_ids_from_a_field_make_k_distinct_stable_rollouts_per_row(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS, blank_after=1)
    options = RowOptions(id_field="id", rollouts_per_row=3, seed=11, prefix="run2.")
    rows = scan_rows(path, options)
    specs = list(row_episodes(rows))

    # the blank line is skipped but counted: line numbers are the file's
    assert rows.ids == {1: "cave-1", 3: "7", 4: "cave-3"}
    assert rows.episodes_total == 9
    assert [s.rollout_id for s in specs[:4]] == [
        "run2.cave-1-0",
        "run2.cave-1-1",
        "run2.cave-1-2",
        "run2.7-0",
    ]
    assert len({s.rollout_id for s in specs}) == 9
    assert all(re.fullmatch(ROLLOUT_ID_PATTERN, s.rollout_id) for s in specs)
    assert [(s.row.line if s.row else None, s.sample) for s in specs[3:6]] == [
        (3, 0),
        (3, 1),
        (3, 2),
    ]
    # each rollout's task is its row with its own seed; the seeds are stable and distinct
    seeds = [s.wire_task()["seed"] for s in specs]
    assert len(set(seeds)) == 9
    assert all(0 <= seed < 2**31 for seed in seeds)
    assert seeds[4] == rollout_seed(11, "7", 1)
    assert specs[4].wire_task() == ROWS[1] | {"seed": seeds[4]}
    again = [s.wire_task()["seed"] for s in row_episodes(scan_rows(path, options))]
    assert again == seeds
    other_run = RowOptions(id_field="id", rollouts_per_row=3, seed=12, prefix="run2.")
    assert [s.wire_task()["seed"] for s in row_episodes(scan_rows(path, other_run))] != seeds


def test_without_an_id_field_the_id_is_the_rows_canonical_digest(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    reordered = write_rows(
        tmp_path / "reordered.jsonl", [dict(reversed(list(row.items()))) for row in ROWS]
    )
    ids = scan_rows(path, RowOptions()).ids
    assert ids[1] == task_digest(ROWS[0])[:DIGEST_ID_CHARS]
    assert len(set(ids.values())) == 3
    # canonical JSON: the order of a row's keys does not change its id
    assert scan_rows(reordered, RowOptions()).ids == ids


def test_without_a_seed_field_rows_are_sent_unchanged(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    specs = list(row_episodes(scan_rows(path, RowOptions(id_field="id", seed_field=None))))
    assert [s.wire_task() for s in specs] == ROWS


def test_shipped_rows_as_a_file_are_tasks_the_reference_environment_takes(tmp_path: Path) -> None:
    """The shipped task set written as a rows file drives the reference environment: its
    `/run` request model accepts every rollout's task (the row plus its seed)."""
    text = resources.files("rollout_servers").joinpath("data/tasks.jsonl").read_text("utf-8")
    path = tmp_path / "tasks.jsonl"
    path.write_text(text, encoding="utf-8")
    specs = list(row_episodes(scan_rows(path, RowOptions(id_field="id", rollouts_per_row=2))))
    assert len(specs) == 2 * len(shipped_tasks())
    for spec in specs:
        body = {"rollout_id": spec.rollout_id, "attempt": 1, "task": spec.wire_task()}
        request = RunRequest.model_validate_json(json.dumps(body))
        assert spec.row is not None
        assert request.task.id == spec.row.row_id
        assert request.task.seed == spec.wire_task()["seed"]


# --- errors -----------------------------------------------------------------------------------


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    assert "cannot read the rows file" in scan_error(tmp_path / "missing.jsonl")
    assert "missing.jsonl" in scan_error(tmp_path / "missing.jsonl")
    assert "cannot read the rows file" in scan_error(tmp_path)  # a directory


def test_an_empty_file_or_one_of_blank_lines_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert "no rows" in scan_error(empty)
    empty.write_text("\n  \n\n")
    assert "no rows" in scan_error(empty)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[1, 2]", "must be a JSON object, not an array"),
        ('"text"', "must be a JSON object, not a string"),
        ("42", "must be a JSON object, not a number"),
        ("null", "must be a JSON object, not null"),
        ('{"id": "a",', "not valid JSON"),
        ('{"id": "a", "x": NaN}', "NaN is not JSON"),
        ('{"id": "a", "id": "b"}', "repeated key 'id'"),
        ('{"prompt": "p"}', "no 'id' field"),
        ('{"id": true}', "must be a string or an integer, not a boolean"),
        ('{"id": 1.5}', "must be a string or an integer, not a number"),
        ('{"id": {"k": 1}}', "must be a string or an integer, not an object"),
        ('{"id": "has space"}', "does not make a valid rollout id"),
        ('{"id": "-leading"}', "does not make a valid rollout id"),
        ('{"id": "ok", "seed": 3}', "has a 'seed' field"),
    ],
)
def test_a_bad_line_is_named_before_any_episode(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + line + "\n" + json.dumps(ROWS[2]) + "\n")
    message = scan_error(path)
    assert f"{path} line 3: " in message
    assert why in message


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"id": "\xff"}\n')
    assert "line 2: not UTF-8" in scan_error(path)


def test_an_id_too_long_for_its_rollout_ids_is_refused(tmp_path: Path) -> None:
    fits = {"id": "a" * 126}  # "<id>-0" is 128 characters: the longest rollout id
    path = write_rows(tmp_path / "rows.jsonl", [fits])
    assert scan_rows(path, RowOptions(id_field="id")).ids == {1: "a" * 126}
    assert "line 1: row id" in scan_error(path, RowOptions(id_field="id", rollouts_per_row=11))
    assert "line 1: row id" in scan_error(path, RowOptions(id_field="id", prefix="p"))


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [ROWS[0], ROWS[1], {"id": "cave-1", "p": 2}])
    assert "line 3: row id 'cave-1' is also line 1's" in scan_error(path)
    # an integer id and the same digits as a string are the same rollout ids
    path = write_rows(tmp_path / "rows.jsonl", [{"id": 7}, {"id": "7"}])
    assert "line 2: row id '7' is also line 1's" in scan_error(path)
    # without an id field, two identical rows have one digest
    path = write_rows(tmp_path / "rows.jsonl", [ROWS[0], ROWS[1], ROWS[0]])
    assert "line 3" in scan_error(path, RowOptions())
    assert "identical" in scan_error(path, RowOptions())


def test_a_line_longer_than_the_bound_is_refused(tmp_path: Path) -> None:
    row = json.dumps({"id": "big", "text": "x" * 200})
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + row + "\n")
    assert scan_rows(path, RowOptions(id_field="id", max_row_bytes=len(row))).episodes_total == 2
    message = scan_error(path, RowOptions(id_field="id", max_row_bytes=len(row) - 1))
    assert f"line 2: longer than {len(row) - 1} bytes" in message
    # a last line without its newline is measured the same way
    path.write_text(json.dumps(ROWS[0]) + "\n" + row)
    assert scan_rows(path, RowOptions(id_field="id", max_row_bytes=len(row))).episodes_total == 2
    short = RowOptions(id_field="id", max_row_bytes=len(row) - 1)
    assert f"line 2: longer than {len(row) - 1} bytes" in scan_error(path, short)


def test_options_out_of_range_are_refused() -> None:
    with pytest.raises(RowError, match="at least 1"):
        RowOptions(rollouts_per_row=0)


def test_a_file_changed_after_the_scan_stops_the_run(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    rows = scan_rows(path, RowOptions(id_field="id"))
    write_rows(path, [ROWS[0], {"id": "other"}, ROWS[2]])
    with pytest.raises(RowError, match="line 2: the file changed"):
        list(row_episodes(rows))
    write_rows(path, ROWS[:2])
    with pytest.raises(RowError, match="the file changed"):
        list(row_episodes(rows))


# --- NeMo Gym's rows (--gym) ------------------------------------------------------------------

DEAL = {
    "responses_create_params": {"input": [{"role": "user", "content": "Deal me in."}]},
    "agent_ref": {"type": "responses_api_agents", "name": "blackjack_gymnasium_agent"},
}
"""A row of blackjack's example file in nemo-gym 0.7 (`environments/blackjack/data/
example.jsonl`): five identical rows, each a new game, told apart by position."""


def test_gym_rows_are_identified_as_gym_identifies_them(tmp_path: Path) -> None:
    """nemo-gym 0.7's `materialize_task`: a materialized row's own task id; a flat row's first
    of task_id, problem_id, instance_id that is not null; its `_ng_task_index`; its position."""
    rows = [
        {"task_id": {"taskset": "math", "task_id": "q-17"}, "task_input": {"question": "1+1"}},
        {"problem_id": 12, "question": "2+2"},
        {"task_id": None, "instance_id": "django__django-11099", "problem_id": None},
        {"task_id": "t.3", "problem_id": "ignored"},
        {"_ng_task_index": 40, "question": "3+3"},
        DEAL,
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows, blank_after=2)
    file = scan_rows(path, RowOptions(gym=True, rollouts_per_row=2, seed_field=None))
    # positions count rows, not lines: the blank line moves line numbers only
    expected = ["q-17", "12", "django__django-11099", "t.3", "40", "5"]
    assert list(file.ids.values()) == expected
    specs = list(row_episodes(file))
    assert [spec.rollout_id for spec in specs[:2]] == ["q-17-0", "q-17-1"]
    assert specs[0].task == rows[0]  # sent as the row is


def test_identical_gym_rows_are_told_apart_by_position(tmp_path: Path) -> None:
    """Blackjack's example file: refused by digest (one id), read with --gym as Gym reads it."""
    path = write_rows(tmp_path / "example.jsonl", [DEAL] * 5)
    assert "line 2: row id" in scan_error(path, RowOptions())
    file = scan_rows(path, RowOptions(gym=True, prefix="bj."))
    assert [spec.rollout_id for spec in row_episodes(file)] == [f"bj.{i}-0" for i in range(5)]
    assert file.episodes_total == 5


def test_gym_rows_with_one_explicit_id_name_both_lines(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [{"task_id": "a"}, DEAL, {"problem_id": "a"}])
    message = scan_error(path, RowOptions(gym=True))
    assert "line 3: row id 'a' is also line 1's" in message, message
    assert "--rollouts-per-row" in message, message
    # an explicit id that is another row's position is the same rollout ids too
    path = write_rows(tmp_path / "rows.jsonl", [{"task_id": "1"}, DEAL])
    assert "line 2: row id '1' is also line 1's" in scan_error(path, RowOptions(gym=True))


def test_a_rollout_id_gym_refuses_is_refused_up_front_with_the_rule(tmp_path: Path) -> None:
    """Ours allow `:` in rollout ids; nemo-gym 0.7's `EpisodeId` does not (nor an `-a<N>`
    ending, its capture keys'): a Gym dataset's ids are checked against Gym's rule."""
    row = {"instance_id": "astropy:12907", "question": "?"}
    path = write_rows(tmp_path / "rows.jsonl", [row])
    assert scan_rows(path, RowOptions(id_field="instance_id")).ids == {1: "astropy:12907"}
    path = write_rows(tmp_path / "rows.jsonl", [DEAL, row])
    message = scan_error(path, RowOptions(gym=True))
    assert "line 2: row id 'astropy:12907' makes a rollout id that NeMo Gym refuses" in message
    assert "no ':'" in message, message
    # the prefix is part of the rollout id
    path = write_rows(tmp_path / "rows.jsonl", [DEAL])
    assert "no ':'" in scan_error(path, RowOptions(gym=True, prefix="run:1."))


def test_a_gym_task_id_object_without_task_input_is_refused(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [{"task_id": {"taskset": "s", "task_id": "x"}}])
    assert "line 1: its task_id is an object but it has no task_input" in scan_error(
        path, RowOptions(gym=True)
    )
    path = write_rows(tmp_path / "rows.jsonl", [{"task_id": {"taskset": "s"}, "task_input": {}}])
    assert "task_id.task_id must be a non-empty string" in scan_error(path, RowOptions(gym=True))


def test_the_cli_takes_gym_rows_without_an_id_field(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [DEAL])
    out = str(tmp_path / "results.jsonl")
    argv = ["--tasks-file", str(path), "--gym", "--id-field", "id", "--out", out]
    with pytest.raises(SystemExit, match=r"rollout-collect: --gym takes .* no --id-field"):
        main(argv)
    with pytest.raises(SystemExit, match="--gym only apply with --tasks-file"):
        main(["--tasks", "3", "--gym", "--out", out])


# --- the CLI ----------------------------------------------------------------------------------


def test_the_cli_refuses_a_bad_file_before_contacting_anything(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[]\n")
    out = tmp_path / "out" / "results.jsonl"
    argv = ["--tasks-file", str(path), "--id-field", "id", "--out", str(out)]
    # no environment and no set named: the file is checked first
    with pytest.raises(SystemExit, match=r"rollout-collect: .*rows.jsonl line 2: a row must be"):
        main(argv)
    assert not out.parent.exists()


def test_the_cli_takes_the_shipped_tasks_or_a_file_not_both() -> None:
    parser = build_parser()
    args = parser.parse_args(["--tasks", "5", "--out", "x"])
    assert (args.tasks, args.tasks_file, args.prefix) == (5, None, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tasks", "5", "--tasks-file", "r.jsonl", "--out", "x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x"])


# --- running rows -----------------------------------------------------------------------------


def echo(request: httpx.Request) -> httpx.Response:
    """A fake environment that answers with something of the task it got."""
    body = json.loads(request.content)
    reply = {"rollout_id": body["rollout_id"], "attempt": body["attempt"], "reward": 0.5}
    return httpx.Response(200, json=reply | {"answer": body["task"]["prompt"], "steps": 2})


async def test_results_name_their_row_line_and_sample(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    rows = scan_rows(path, RowOptions(id_field="id", rollouts_per_row=2))
    seen: list[EpisodeResult | EpisodeFailed] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(echo)) as http:
        client = RolloutClient(StaticTopology(["http://env-0"], attempt=1), http=http)
        await client.run_each(row_episodes(rows), seen.append, total=rows.episodes_total)
    assert client.progress.done == 6
    lines = sorted(
        (json.loads(o.output_line()) for o in seen if isinstance(o, EpisodeResult)),
        key=lambda line: line["rollout_id"],
    )
    assert lines[0] == {
        "rollout_id": "7-0",
        "row_id": "7",
        "line": 2,
        "sample": 0,
        "attempt": 1,
        "answer": "Open the chest.",  # an environment's answer may be any JSON
        "reward": 0.5,
        "steps": 2,
        "continued": False,
    }
    assert [(line["row_id"], line["line"], line["sample"]) for line in lines] == [
        ("7", 2, 0),
        ("7", 2, 1),
        ("cave-1", 1, 0),
        ("cave-1", 1, 1),
        ("cave-3", 3, 0),
        ("cave-3", 3, 1),
    ]


async def test_a_shipped_tasks_result_line_is_unchanged() -> None:
    def ok(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        reply = {"rollout_id": body["rollout_id"], "attempt": 0, "answer": 57, "reward": 1.0}
        return httpx.Response(200, json=reply | {"steps": 1})

    async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as http:
        client = RolloutClient(StaticTopology(["http://env-0"]), http=http)
        [result] = await client.run_all([EpisodeSpec("r0-00000", shipped_tasks()[0])])
    assert isinstance(result, EpisodeResult)
    assert json.loads(result.output_line()) == {
        "rollout_id": "r0-00000",
        "attempt": 0,
        "answer": 57,
        "reward": 1.0,
        "steps": 1,
        "continued": False,
    }


async def test_an_unreadable_reply_fails_its_episode_not_the_batch() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        rid = json.loads(request.content)["rollout_id"]
        if rid == "bad":
            return httpx.Response(200, json={"rollout_id": rid, "reward": "lots"})
        return echo(request)

    specs = [EpisodeSpec(rid, {"prompt": rid}) for rid in ("a", "bad", "c")]
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = RolloutClient(StaticTopology(["http://env-0"]), http=http)
        outcomes = await client.run_all(specs)
    assert [type(o) for o in outcomes] == [EpisodeResult, EpisodeFailed, EpisodeResult]
    assert "unreadable /run reply" in str(outcomes[1])


async def test_run_each_holds_no_more_specs_than_its_concurrency(tmp_path: Path) -> None:
    """A large rows file is read as episodes start: the generator is never further ahead of
    the finished episodes than the concurrency."""
    rows = [{"id": f"row-{i}", "prompt": str(i)} for i in range(200)]
    file = scan_rows(write_rows(tmp_path / "rows.jsonl", rows), RowOptions(id_field="id"))
    drawn, finished, ahead = [0], [0], [0]

    def counted(source: RowFile) -> Iterator[EpisodeSpec]:
        for spec in row_episodes(source):
            drawn[0] += 1
            ahead[0] = max(ahead[0], drawn[0] - finished[0])
            yield spec

    def done(_: EpisodeResult | EpisodeFailed) -> None:
        finished[0] += 1

    async with httpx.AsyncClient(transport=httpx.MockTransport(echo)) as http:
        client = RolloutClient(StaticTopology(["http://env-0"]), concurrency=8, http=http)
        await client.run_each(counted(file), done, total=200)
    assert (drawn[0], finished[0], client.progress.done) == (200, 200, 200)
    assert ahead[0] <= 8


def test_row_options_without_a_rows_file_are_refused(tmp_path: Path) -> None:
    out = str(tmp_path / "results.jsonl")
    with pytest.raises(SystemExit, match="--id-field, --rollouts-per-row only apply with"):
        main(["--tasks", "3", "--id-field", "id", "--rollouts-per-row", "2", "--out", out])


async def test_a_file_changed_under_a_run_stops_it_with_the_error(tmp_path: Path) -> None:
    """The rows file is rewritten in place while its episodes run: the read of a changed line
    raises, the run stops, and the error (not a group of it) reaches the caller."""
    rows = [{"id": f"row-{i}", "pad": "x" * 1000} for i in range(30)]  # past a read's buffer
    path = write_rows(tmp_path / "rows.jsonl", rows)
    file = scan_rows(path, RowOptions(id_field="id"))
    started: list[str] = []

    def rewriting(request: httpx.Request) -> httpx.Response:
        started.append(json.loads(request.content)["rollout_id"])
        write_rows(path, [*rows[:-1], rows[-1] | {"id": "other"}])
        return httpx.Response(200, json={"attempt": 0, "reward": 1.0, "steps": 1})

    seen: list[EpisodeResult | EpisodeFailed] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(rewriting)) as http:
        client = RolloutClient(StaticTopology(["http://env-0"]), concurrency=1, http=http)
        with pytest.raises(RowError, match="line 30: the file changed"):
            await client.run_each(row_episodes(file), seen.append, total=30)
    assert started == [f"row-{i}-0" for i in range(29)]
    assert len(seen) == 29


def test_a_concurrency_below_one_is_refused(tmp_path: Path) -> None:
    """`run_each` admits episodes by it: zero would wait forever."""
    with pytest.raises(ValueError, match="at least 1"):
        RolloutClient(StaticTopology(["http://env-0"]), concurrency=0)
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(SystemExit, match="--concurrency must be at least 1"):
        main(["--tasks-file", str(path), "--concurrency", "0", "--out", str(tmp_path / "o")])


# --- pipes, FIFOs and process substitution: the file is read once, as a stream ----------------

STREAM_WAIT_S = 60.0
"""How long a test waits for a reader that should not block (it fails, never hangs, past it)."""


def _unblock_fifo(path: Path) -> None:
    """Give a reader blocked on opening the FIFO `path` a writer that closes at once (EOF)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _read_within_deadline(fifo: Path, read: Callable[[], list[EpisodeSpec]]) -> list[EpisodeSpec]:
    """`read()` in a thread; past the deadline the FIFO it is stuck opening gets a writer that
    closes at once (so no thread stays blocked after the test), and the test fails."""
    box: list[list[EpisodeSpec] | BaseException] = []

    def run() -> None:
        try:
            box.append(read())
        except BaseException as error:  # handed to the test's thread
            box.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(STREAM_WAIT_S)
    blocked = thread.is_alive()
    while thread.is_alive():
        _unblock_fifo(fifo)
        thread.join(0.1)
    assert not blocked, "the reader blocked opening the FIFO again"
    (outcome,) = box
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def test_a_fifo_written_once_is_read_once(tmp_path: Path) -> None:
    """The writer writes the rows and closes: the scan reads them, and the episodes come from
    what it read, without opening the FIFO a second time (there is no second writer)."""
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    text = "".join(json.dumps(row) + "\n" for row in ROWS)
    writer = threading.Thread(target=fifo.write_text, args=(text,), daemon=True)
    writer.start()

    def read() -> list[EpisodeSpec]:
        rows = scan_rows(fifo, RowOptions(id_field="id"))
        specs = list(row_episodes(rows))
        rows.close()
        return specs

    specs = _read_within_deadline(fifo, read)
    writer.join(STREAM_WAIT_S)
    assert [spec.rollout_id for spec in specs] == ["cave-1-0", "7-0", "cave-3-0"]
    assert [spec.row.line for spec in specs if spec.row] == [1, 2, 3]


def test_a_process_substitution_is_read_once(tmp_path: Path) -> None:
    """`--tasks-file <(cat rows.jsonl)` names a pipe as `/dev/fd/N`: its rows, read once, are
    the episodes (a second open finds the pipe drained: "no rows")."""
    reader, writer = os.pipe()
    try:
        os.write(writer, "".join(json.dumps(row) + "\n" for row in ROWS).encode())
        os.close(writer)
        rows = scan_rows(Path(f"/dev/fd/{reader}"), RowOptions(id_field="id"))
        specs = list(row_episodes(rows))
        rows.close()
    finally:
        os.close(reader)
    assert [spec.wire_task()["prompt"] for spec in specs] == [row["prompt"] for row in ROWS]
    assert rows.episodes_total == 3


def test_a_bad_row_in_a_pipe_is_refused_with_its_line(tmp_path: Path) -> None:
    """The bounds hold for a stream as for a file: the message names the pipe and the line."""
    reader, writer = os.pipe()
    try:
        os.write(writer, ('{"id": "a"}\n' + "x" * 100 + "\n").encode())
        os.close(writer)
        message = scan_error(Path(f"/dev/fd/{reader}"), RowOptions(id_field="id", max_row_bytes=64))
    finally:
        os.close(reader)
    assert message == f"/dev/fd/{reader} line 2: longer than 64 bytes"


def _collect_on(fifo: Path, out: Path) -> subprocess.Popen[str]:
    command = [str(Path(sys.executable).with_name("rollout-collect")), "--tasks-file", str(fifo)]
    return subprocess.Popen(
        [*command, "--environment", "http://127.0.0.1:9", "--out", str(out)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C is SIGINT's default action even where the test runner ignores it (a shell's
        # background job), which a child would inherit
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _first_stderr_line(process: subprocess.Popen[str]) -> str:
    """The process's first stderr line; past the deadline it is killed and the test fails."""
    stderr = process.stderr
    assert stderr is not None
    lines: list[str] = []
    thread = threading.Thread(target=lambda: lines.append(stderr.readline()))
    thread.start()
    thread.join(STREAM_WAIT_S)
    if thread.is_alive() or not lines or not lines[0]:
        process.kill()
        process.wait()
        thread.join()
        pytest.fail("rollout-collect said nothing while it waited for the FIFO's writer")
    return lines[0]


def test_the_cli_waits_for_a_fifos_writer_saying_so_then_reads_it(tmp_path: Path) -> None:
    """A FIFO without a writer: like `cat`, rollout-collect waits for one to open it, and says
    on stderr that it reads a pipe until its writer closes it; then it reads what is written
    (here a bad row, refused with its line, so no environment is needed)."""
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    process = _collect_on(fifo, tmp_path / "out.jsonl")
    first = _first_stderr_line(process)
    assert first == (
        f"rollout-collect: reading the rows from the pipe {fifo} until its writer closes it "
        "(a FIFO waits for a writer first); no episode starts before\n"
    )
    fifo.write_text("[]\n")
    _, rest = process.communicate(timeout=STREAM_WAIT_S)
    assert process.returncode == 1
    assert rest == f"rollout-collect: {fifo} line 1: a row must be a JSON object, not an array\n"


def test_the_cli_interrupted_while_waiting_for_a_writer_says_so(tmp_path: Path) -> None:
    """Ctrl-C while the FIFO has no writer: one line and exit status 130, no traceback."""
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    process = _collect_on(fifo, tmp_path / "out.jsonl")
    _first_stderr_line(process)
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=STREAM_WAIT_S)
    assert (process.returncode, rest) == (
        130,
        "rollout-collect: interrupted before the rows were read\n",
    )
