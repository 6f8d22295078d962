"""NeMo Gym 0.7.0's own rollout collector, as the other side of the adapter's typed `/run`
(docs/gym.md, "The typed episode"): run as a script by the nemo-gym 0.7 environment's
interpreter (`gym_python("0.7")`), never imported by the tests' own interpreter.

stdin: `{"rows": [collector rows], "replies": [/run reply bodies]}`; stdout: `{"requests": [the
body Gym's collector sends for each row (`_episode_request_body`)], "replies": [each reply
validated as 0.7.0's `SingleAgentTurnResponse` and dumped], "records": [the rollout record Gym's
collector stores for each reply (`_episode_record`)]}`. A reply 0.7.0 refuses ends the script
with its validation error on stderr.
"""

import json
import sys
from typing import Any

from nemo_gym.rollout_collection import _episode_record, _episode_request_body
from nemo_gym.single_agent_turn_types import SingleAgentTurnResponse


def main() -> None:
    given = json.load(sys.stdin)
    requests = [_episode_request_body(row) for row in given.get("rows", [])]
    replies: list[Any] = []
    records: list[Any] = []
    for reply in given.get("replies", []):
        parsed = SingleAgentTurnResponse.model_validate(reply)
        replies.append(parsed.model_dump(mode="json", exclude_none=True))
        records.append(_episode_record(reply))
    json.dump({"requests": requests, "replies": replies, "records": records}, sys.stdout)


if __name__ == "__main__":
    main()
