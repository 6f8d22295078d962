"""The runner's options and the Kopf settings it applies (no cluster, no kopf.run)."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from rollout_operator import cli
from rollout_operator.model.settings import RunOptions, configure


def test_configure_keeps_kopf_state_in_our_annotations_and_finalizer() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, RunOptions(namespaces=("ns",), watch_timeout_seconds=120))
    assert settings.persistence.finalizer == "checkpoint.rollout.dev/finalizer"
    progress = settings.persistence.progress_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert progress.prefix == "checkpoint.rollout.dev"
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert diffbase.prefix == "checkpoint.rollout.dev"
    assert settings.watching.server_timeout == 120
    assert settings.watching.client_timeout is not None
    assert settings.watching.client_timeout > settings.watching.server_timeout
    assert settings.networking.request_timeout == 60
    assert settings.posting.reporting_component == "rollout-operator"
    assert settings.peering.standalone is True


def test_configure_with_peering_makes_it_mandatory() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, RunOptions(all_namespaces=True, peering="rollout", priority=5))
    assert settings.peering.standalone is False
    assert settings.peering.mandatory is True
    assert (settings.peering.name, settings.peering.priority) == ("rollout", 5)


@pytest.fixture
def kopf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    return calls


def test_run_serves_the_given_namespaces(kopf_calls: list[dict[str, Any]]) -> None:
    code = cli.main(
        ["run", "-n", "a", "--namespace", "b", "--liveness", "http://0.0.0.0:8080/healthz"]
    )
    assert code == 0
    (call,) = kopf_calls
    assert call["namespaces"] == ["a", "b"]
    assert call["clusterwide"] is False
    assert call["standalone"] is True
    assert call["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    options = call["memo"]["options"]
    assert options == RunOptions(namespaces=("a", "b"), liveness="http://0.0.0.0:8080/healthz")


def test_run_all_namespaces_with_peering(kopf_calls: list[dict[str, Any]]) -> None:
    assert cli.main(["run", "-A", "--peering", "rollout", "--metrics-port", "9090"]) == 0
    (call,) = kopf_calls
    assert call["clusterwide"] is True
    assert call["namespaces"] == []
    assert call["standalone"] is False
    assert call["peering_name"] == "rollout"
    assert call["memo"]["options"].metrics_port == 9090


@pytest.mark.parametrize(
    "argv",
    [
        ["run"],
        ["run", "-n", "a", "-A"],
        ["run", "-A", "--standalone", "--peering", "x"],
    ],
    ids=["no-scope", "both-scopes", "standalone-and-peering"],
)
def test_contradictory_or_missing_scope_is_a_usage_error(
    argv: list[str], kopf_calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert kopf_calls == []
    assert "usage: rollout-operator run" in capsys.readouterr().err


def test_invalid_option_values_are_refused(
    kopf_calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", "-A", "--metrics-port", "70000"]) == 2
    assert kopf_calls == []
    assert "metrics_port" in capsys.readouterr().err
