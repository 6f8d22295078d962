"""NeMo Gym 0.7.0's own rollout collector, as the other side of the adapter's typed `/run`
(docs/gym.md, "The typed episode"): run as a script by the nemo-gym 0.7 environment's
interpreter (`gym_python("0.7")`), never imported by the tests' own interpreter.

stdin: `{"rows": [collector rows], "replies": [/run reply bodies], "ran": [[row index, reply
body or null for a call that got no reply], ...]}`; stdout: `{"requests": [the body Gym's
collector sends for each row (`_episode_request_body`)], "replies": [each reply validated as
0.7.0's `SingleAgentTurnResponse` and dumped], "records": [the rollout record Gym's collector
stores for each reply (`_episode_record`)], "resumed": [the requests a `--resume` of the rows
sends after the outcomes `ran` (`RolloutCollectionHelper._load_from_cache`, on the files Gym
writes: the materialized rows, the rollouts, the failures sidecar)]}`. A reply 0.7.0 refuses
ends the script with its validation error on stderr.
"""

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_gym.path_utils import failures_path_for, materialized_path_for
from nemo_gym.rollout_collection import (
    NG_FAILURE_CLASS_KEY,
    RolloutCollectionConfig,
    RolloutCollectionHelper,
    _agent_request_failure_row,
    _episode_record,
    _episode_request_body,
)
from nemo_gym.single_agent_turn_types import SingleAgentTurnResponse

IDENTITY = ("_ng_task_index", "_ng_rollout_index", "_ng_attempt_index", "_ng_rollout_id")
"""The row's keys Gym's collector copies into each record it stores."""


def resumed(rows: list[Any], ran: list[Any]) -> list[Any]:
    """The requests a `--resume` sends after `ran`: each outcome stored as Gym's collector
    stores it (a result in the rollouts file, a failure in the sidecar; a call without a reply
    is Gym's `agent_request_failed`), then Gym's own resume reads the files back."""
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "rollouts.jsonl"
        materialized_path_for(output).write_text("".join(json.dumps(r) + "\n" for r in rows))
        done: list[str] = []
        failed: list[str] = []
        for index, reply in ran:
            if reply is None:
                record = _agent_request_failure_row(ConnectionError("no reply"), None)
            else:
                record = _episode_record(reply)
            record.update({k: rows[index][k] for k in IDENTITY if k in rows[index]})
            (failed if NG_FAILURE_CLASS_KEY in record else done).append(json.dumps(record))
        output.write_text("".join(line + "\n" for line in done))
        failures_path_for(output).write_text("".join(line + "\n" for line in failed))
        config = RolloutCollectionConfig.model_construct(output_jsonl_fpath=str(output))
        with contextlib.redirect_stdout(sys.stderr):  # Gym prints its resume summary
            again = RolloutCollectionHelper()._load_from_cache(config)[0]
    return [_episode_request_body(row) for row in again]


def main() -> None:
    given = json.load(sys.stdin)
    requests = [_episode_request_body(row) for row in given.get("rows", [])]
    replies: list[Any] = []
    records: list[Any] = []
    for reply in given.get("replies", []):
        parsed = SingleAgentTurnResponse.model_validate(reply)
        replies.append(parsed.model_dump(mode="json", exclude_none=True))
        records.append(_episode_record(reply))
    again = resumed(given.get("rows", []), given["ran"]) if "ran" in given else []
    found = {"requests": requests, "replies": replies, "records": records, "resumed": again}
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main()
