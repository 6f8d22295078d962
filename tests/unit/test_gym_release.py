"""The NeMo Gym releases the adapter runs on (`rollout_gym.SUPPORTED_GYM_RELEASES`, docs/gym.md
"Gym releases"): `rollout-gym` refuses to start on any other, in one line.

The project's venv has no nemo-gym; each case puts a distribution's metadata (a
`nemo_gym-<version>.dist-info` folder, what pip leaves) first on the path, which is all the
check reads. That it starts on 0.4 and 0.7 is shown by the adapter's tests on both
(tests/protocol/test_gym_adapter.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_gym import SUPPORTED_GYM_RELEASES
from rollout_gym.cli import gym_release_refusal, main

ARGS = ["resources", "--server", "resources_servers.x.app:X", "--name", "x"]


def installed(monkeypatch: pytest.MonkeyPatch, root: Path, version: str) -> None:
    info = root / f"nemo_gym-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nemo-gym\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(root))


@pytest.mark.parametrize("version", ["0.5.1", "0.6.0", "0.8.0", "0.3.0", "1.0.0"])
def test_an_unsupported_release_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    installed(monkeypatch, tmp_path, version)
    with pytest.raises(SystemExit) as refused:
        main(ARGS)
    message = str(refused.value.code)
    assert message.startswith(f"rollout-gym: nemo-gym {version} is installed"), message
    assert "supports nemo-gym 0.4 and 0.7 only" in message, message
    assert "\n" not in message, message


@pytest.mark.parametrize("version", ["0.4.0", "0.7.0", "0.7.2rc1"])
def test_a_supported_release_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    installed(monkeypatch, tmp_path, version)
    assert gym_release_refusal() is None
    assert ".".join(version.split(".")[:2]) in SUPPORTED_GYM_RELEASES


def test_without_nemo_gym_the_adapter_says_so() -> None:
    with pytest.raises(SystemExit) as refused:
        main(ARGS)
    assert refused.value.code == (
        "rollout-gym: nemo-gym is not installed; install nemo-gym 0.4 or 0.7 (docs/gym.md)"
    )
