"""The user's own tasks (`rollout-collect --tasks-file`): rows, ids, seeds and the errors.

Rows files are real files under `tmp_path`; the client runs against a fake environment (an httpx
transport, the layer below the client), as in `test_rollout_client.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
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
