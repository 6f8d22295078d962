"""The NeMo Gym adapter (docs/gym.md): a released Gym environment (its agent loop, its resources
servers, unmodified, from the `nemo-gym` package) as checkpointed participants of a RolloutSet.

- `rollout_gym.environment`: Gym's `simple_agent` loop as SDK steps, with the Gym session of each
  episode rebuilt after a restore by the declared `Strategy`;
- `rollout_gym.episode`: nemo-gym 0.7's typed episode (`EpisodeId`, a materialized task in;
  `result` or `EpisodeFailure` out) on the environment's `/run`, beside 0.4's request;
- `rollout_gym.resources`: a Gym resources server hosted without Ray, beside a control plane;
- `rollout-gym environment|resources` (`rollout_gym.cli`): the two pods' commands.

A distribution of its own, `rollout-gym` (gym/pyproject.toml): it needs Python >= 3.12 and
nemo-gym 0.4 or 0.7, which the SDK (`rollout-protocol`) must not require of its users.
"""

from .environment import GymSettings, RebuildFailed, Strategy, build_app

SUPPORTED_GYM_RELEASES = ("0.4", "0.7")
"""The nemo-gym releases (major.minor) the adapter is built and tested against (docs/gym.md,
"Gym releases"); gym/pyproject.toml's pin allows these only, and `rollout-gym` refuses to
start on any other."""

__all__ = ["SUPPORTED_GYM_RELEASES", "GymSettings", "RebuildFailed", "Strategy", "build_app"]
