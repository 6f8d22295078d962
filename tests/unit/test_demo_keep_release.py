"""`harness.demo --keep --node-runtime containerd` leaves the operator's Helm release installed.

The scenario on a container node installs the operator with helm and, unless kept, uninstalls it
at the end. Helm and the scenario's drive are replaced by named fakes that record what happened
(below the layer under test: the demo's choice of what to tear down)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from harness import demo, helm


class FakeHelm:
    """Records install and uninstall calls instead of running helm."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def install(self, cluster: Any, namespace: str, image: Any) -> None:
        self.calls.append(f"install {namespace}")

    def uninstall(self, cluster: Any, namespace: str) -> None:
        self.calls.append(f"uninstall {namespace}")


class FakeImage:
    short_name = "rollout-checkpoint-operator:dev"
    digest = "sha256:" + "0" * 64


def run_helm_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, keep_release: bool
) -> list[str]:
    fake = FakeHelm()
    monkeypatch.setattr(helm, "install_operator", fake.install)
    monkeypatch.setattr(helm, "uninstall_operator", fake.uninstall)
    monkeypatch.setattr(demo, "_apply_example_set", lambda *args: None)

    async def drive(*args: Any) -> str:
        return "report"

    monkeypatch.setattr(demo, "_drive", drive)
    workdir = tmp_path / "demo"
    (workdir / "checkpoints").mkdir(parents=True)
    scenario = demo.Scenario(namespace="demo", workdir=workdir, keep_release=keep_release)
    image: Any = FakeImage()
    report = anyio.run(demo._run_with_helm_operator, None, scenario, image, lambda line: None)
    assert report == "report"
    return fake.calls


def test_keep_leaves_the_helm_release_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert run_helm_scenario(tmp_path, monkeypatch, keep_release=True) == ["install demo"]


def test_without_keep_the_release_is_uninstalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = run_helm_scenario(tmp_path, monkeypatch, keep_release=False)
    assert calls == ["install demo", "uninstall demo"]
