"""The user's own tasks: a JSON-lines file of task rows, turned into episodes.

`rollout-collect --tasks-file rows.jsonl` (and `RolloutClient`, through `client.row_episodes`) runs
each row, any JSON object, as the task of `--rollouts-per-row` episodes. The row goes to the
environment's `/run` verbatim, except that the rollout's sampling seed is written into one named
field (`seed` by default, the field the reference environment and the SDK example read; see
docs/sdk.md "The payload"); with no seed field the row is sent exactly as it is.

A row's id is the value of a named field (`--id-field`) or, when none is named, a digest of its
canonical JSON (the one `task_digest` computes, so the same row gets the same id in any run).
With `--gym` the rows are a NeMo Gym dataset and their ids are Gym's (`gym_row_id`, as
nemo-gym 0.7's `materialize_task` derives them): a materialized row's `task_id.task_id`, else the
first of `task_id`, `problem_id`, `instance_id`, else `_ng_task_index`, else the row's position,
so identical rows (a Gym environment's example file) are told apart by position as Gym does;
and every rollout id must also be one Gym accepts (`gym_rollout_id`: no `:`, no `-a<N>` ending).
Rollout ids are `<prefix><row id>-<k>` for k in 0..K-1; each rollout's seed is derived from
(the run's seed, the row id, k), so ids and seeds are stable across runs and restarts.

The file is opened once and read once, as a stream, so a pipe, a FIFO or a process substitution
(`<(...)`, a `/dev/fd/N` path) works as well as a regular file: `scan_rows` validates every line
before any episode starts (JSON objects only, bounded size, ids that fit the protocol's rollout
id pattern, no duplicate ids, not empty) and keeps only the ids; `RowFile.rows` then yields the
rows again, lazily, while their episodes run, from a seekable source it holds open: a regular
file's own descriptor (each line checked to still have the id the scan saw), or else a private
unnamed temporary file the scan copied the stream's lines into. Memory grows with the number of
rows (their ids), never with the size of the file; only a stream costs disk, its own size.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from rollout_protocol import ROLLOUT_ID_PATTERN, gym_rollout_id, task_digest

from .tasks import stable_fraction

DEFAULT_MAX_ROW_BYTES = 1 << 20
"""The largest row (one line, in bytes) read: a row travels in every `/run` body and every
re-issue of it, and a line without an end must not be read into memory whole."""

DIGEST_ID_CHARS = 16
"""Hex characters of the row digest used as a row id when no id field is named (64 bits)."""

SEED_RANGE = 2**31
"""Derived seeds lie in [0, SEED_RANGE), like the shipped tasks' (`sample_tasks`)."""

GYM_ID_FIELDS = ("task_id", "problem_id", "instance_id")
"""The fields a flat Gym row's task id is read from, first present first (nemo-gym 0.7's
`materialize_task`)."""

GYM_TASK_INDEX_FIELD = "_ng_task_index"
"""The task index Gym's collector writes into a row; the id of a row without an id field."""


class RowError(ValueError):
    """The rows file cannot be used; the message names the file and, where one is at fault,
    the line."""


@dataclass(frozen=True)
class RowOptions:
    """How rows become episodes (the `rollout-collect` options of the same names)."""

    id_field: str | None = None
    rollouts_per_row: int = 1
    seed: int = 0
    seed_field: str | None = "seed"
    prefix: str = ""
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    gym: bool = False
    """The rows are a NeMo Gym dataset: Gym's row ids (`gym_row_id`) and rollout ids."""

    def __post_init__(self) -> None:
        if self.gym and self.id_field is not None:
            raise RowError("--gym takes a Gym dataset's row ids as Gym gives them: no --id-field")
        if self.rollouts_per_row < 1:
            raise RowError(f"rollouts per row must be at least 1, not {self.rollouts_per_row}")
        if self.max_row_bytes < 2:
            bound = self.max_row_bytes
            raise RowError(f"the row size bound must be at least 2 bytes ({{}}), not {bound}")


@dataclass(frozen=True)
class Row:
    """One valid row: where it is, its id, and the object itself."""

    line: int
    row_id: str
    data: dict[str, Any]


def rollout_id(options: RowOptions, row_id: str, sample: int) -> str:
    """The rollout id of the `sample`-th rollout of a row."""
    return f"{options.prefix}{row_id}-{sample}"


def rollout_seed(seed: int, row_id: str, sample: int) -> int:
    """The sampling seed of the `sample`-th rollout of a row: a function of its arguments only."""
    return int(stable_fraction("rollout-seed", seed, row_id, sample) * SEED_RANGE)


def read_rows(
    path: Path, stream: IO[bytes], options: RowOptions, copy: IO[bytes] | None = None
) -> Iterator[Row]:
    """Every row of `stream` (the file at `path`, which the messages name) in order, validated;
    raises `RowError` at the first bad line, a duplicate id, or a file without rows. Every line
    read is also written to `copy`, when given."""
    seen: dict[str, int] = {}
    try:
        for position, (line, data) in enumerate(
            _objects(path, stream, options.max_row_bytes, copy)
        ):
            row_id = _row_id(path, line, position, data, options)
            first = seen.setdefault(row_id, line)
            if first != line:
                how = (
                    " (the rows are identical)"
                    if options.id_field is None and not options.gym
                    else ""
                )
                raise RowError(
                    f"{path} line {line}: row id {row_id!r} is also line {first}'s{how}; rows "
                    "with one id would make the same rollout ids (repeats: --rollouts-per-row)"
                )
            yield Row(line, row_id, data)
    except OSError as error:
        raise RowError(f"cannot read the rows file: {error}") from error
    if not seen:
        raise RowError(f"{path}: no rows (the file is empty or has only blank lines)")


def is_stream(path: Path) -> bool:
    """Whether `path` is a pipe or FIFO (a process substitution's `/dev/fd/N` included): read
    until its writer closes it, and opening a FIFO waits for a writer, as `cat` does."""
    try:
        return stat.S_ISFIFO(path.stat().st_mode)
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class RowFile:
    """A rows file that `scan_rows` validated: its row ids by line, the options, and the open
    seekable source its rows are read again from (close it with `close` or a `with` block)."""

    path: Path
    options: RowOptions
    ids: dict[int, str]
    source: IO[bytes]

    @property
    def episodes_total(self) -> int:
        """How many episodes the file makes: rows times rollouts per row."""
        return len(self.ids) * self.options.rollouts_per_row

    def rows(self) -> Iterator[Row]:
        """The rows, read again from the source as they are needed (one pass at a time), each
        checked to have the id the scan saw on its line."""
        count = 0
        try:
            self.source.seek(0)
        except OSError as error:
            raise RowError(f"cannot read the rows file: {error}") from error
        for row in read_rows(self.path, self.source, self.options):
            if self.ids.get(row.line) != row.row_id:
                raise RowError(f"{self.path} line {row.line}: the file changed while running")
            count += 1
            yield row
        if count != len(self.ids):
            raise RowError(f"{self.path}: the file changed while running")

    def task(self, row: Row, sample: int) -> dict[str, Any]:
        """The `/run` task of a row's `sample`-th rollout: the row, with the rollout's seed in
        the seed field when there is one."""
        field = self.options.seed_field
        if not field:
            return row.data
        return row.data | {field: rollout_seed(self.options.seed, row.row_id, sample)}

    def close(self) -> None:
        """Close the source (a stream's copy is deleted with it)."""
        self.source.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def scan_rows(path: Path, options: RowOptions) -> RowFile:
    """Open the file once, validate all of it (see `read_rows`) and keep its row ids and a
    source to read the rows again from: the file itself when it is a regular file, else a copy
    of the stream's lines (a pipe, a FIFO or a character device can be read only once)."""
    try:
        stream = path.open("rb")
    except OSError as error:
        raise RowError(f"cannot read the rows file: {error}") from error
    try:
        regular = stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
        # the source outlives this call (the RowFile closes it); a regular file is its own
        # source, so nothing renamed over it later is read
        source = stream if regular else tempfile.TemporaryFile()  # noqa: SIM115
    except OSError as error:
        stream.close()
        raise RowError(f"cannot copy the rows of {path}: {error}") from error
    try:
        copy = None if regular else source
        ids = {row.line: row.row_id for row in read_rows(path, stream, options, copy)}
    except BaseException:
        source.close()
        raise
    finally:
        if not regular:
            stream.close()
    return RowFile(path, options, ids, source)


# --- one line ---------------------------------------------------------------------------------


def _objects(
    path: Path, stream: IO[bytes], limit: int, copy: IO[bytes] | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line, without reading a line past `limit`;
    each line read is written to `copy` too, when given."""
    line = 0
    while True:
        raw = stream.readline(limit + 1)
        if not raw:
            return
        line += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            raise RowError(f"{path} line {line}: longer than {limit} bytes")
        if copy is not None:
            copy.write(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise RowError(f"{path} line {line}: not UTF-8 ({error.reason})") from error
        if not text.strip():
            continue
        try:
            value = json.loads(text, object_pairs_hook=_no_repeated_keys, parse_constant=_no_nan)
        except (ValueError, RecursionError) as error:
            raise RowError(f"{path} line {line}: not valid JSON ({error})") from error
        if not isinstance(value, dict):
            raise RowError(
                f"{path} line {line}: a row must be a JSON object, not {_json_kind(value)}"
            )
        yield line, value


def gym_row_id(data: dict[str, Any], position: int) -> str:
    """The task id NeMo Gym 0.7 gives a row (`materialize_task`, `_trajectory_identity`): a
    materialized row's (`{"task_id": {"taskset", "task_id"}, "task_input": ...}`) own; a flat
    row's first `GYM_ID_FIELDS` value that is not null, as a string; else its `_ng_task_index`
    (a non-negative integer), else its position among the rows, from 0. Raises `ValueError` for
    a row Gym refuses: a `task_id` object outside a materialized row, or one without a task id."""
    task_id = data.get("task_id")
    if isinstance(task_id, dict):
        if "task_input" not in data:
            raise ValueError("its task_id is an object but it has no task_input (not a Gym row)")
        inner = task_id.get("task_id")
        if not isinstance(inner, str) or not inner:
            raise ValueError("a materialized row's task_id.task_id must be a non-empty string")
        return inner
    found = next((data[key] for key in GYM_ID_FIELDS if data.get(key) is not None), None)
    if found is not None:
        return str(found)
    index = data.get(GYM_TASK_INDEX_FIELD)
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
        return str(index)
    return str(position)


def _row_id(path: Path, line: int, position: int, data: dict[str, Any], options: RowOptions) -> str:
    """The row's id, checked so that every rollout id made from it fits the protocol (and,
    for a Gym dataset, Gym's rule)."""
    if options.gym:
        try:
            row_id = gym_row_id(data, position)
        except ValueError as error:
            raise RowError(f"{path} line {line}: {error}") from error
    elif options.id_field is None:
        row_id = task_digest(data)[:DIGEST_ID_CHARS]
    else:
        if options.id_field not in data:
            raise RowError(f"{path} line {line}: no {options.id_field!r} field (the id field)")
        value = data[options.id_field]
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise RowError(
                f"{path} line {line}: the id field {options.id_field!r} must be a string or an "
                f"integer, not {_json_kind(value)}"
            )
        row_id = str(value)
    if options.seed_field and options.seed_field in data:
        raise RowError(
            f"{path} line {line}: the row has a {options.seed_field!r} field, which "
            "rollout-collect sets to each rollout's seed; name another --seed-field, or pass "
            "--seed-field '' to send rows unchanged"
        )
    last = rollout_id(options, row_id, options.rollouts_per_row - 1)
    if re.fullmatch(ROLLOUT_ID_PATTERN, last) is None:
        raise RowError(
            f"{path} line {line}: row id {row_id!r} does not make a valid rollout id ({last!r} "
            f"must match {ROLLOUT_ID_PATTERN}: a letter or digit, then at most 127 of "
            "letters, digits and ._:-)"
        )
    if options.gym:
        try:
            gym_rollout_id(last)
        except ValueError as error:
            raise RowError(
                f"{path} line {line}: row id {row_id!r} makes a rollout id that NeMo Gym "
                f"refuses: {error}"
            ) from error
    return row_id


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"repeated key {repeated[0]!r}")
    return found


def _no_nan(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _json_kind(value: object) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return kinds.get(type(value), "a number")
