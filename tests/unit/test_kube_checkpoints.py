"""`Kube.list_checkpoints`: one set's checkpoints, filtered by the API server where it can.

A real `Kube` over a fake CustomObjectsApi that answers as the generated client does with
`_preload_content=False`, and, like an API server before Kubernetes 1.31, can refuse field
selectors (HTTP 400). The real API server's answer is in tests/e2e/test_crds.py.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from kube_fakes import RawResponse
from rollout_operator.cluster.kube import Kube

pytestmark = pytest.mark.unit

CHECKPOINTS = [
    {"metadata": {"name": "a-1"}, "spec": {"rolloutSet": "set-a"}},
    {"metadata": {"name": "b-1"}, "spec": {"rolloutSet": "set-b"}},
    {"metadata": {"name": "a-2"}, "spec": {"rolloutSet": "set-a"}},
]


class CheckpointsApi:
    """Lists CHECKPOINTS; filters on `spec.rolloutSet=NAME` unless it refuses selectors."""

    def __init__(self, *, selectors: bool) -> None:
        self.selectors = selectors
        self.asked: list[str | None] = []

    async def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> RawResponse:
        assert kwargs.get("_preload_content") is False
        selector = kwargs.get("field_selector")
        self.asked.append(selector)
        if selector is None:
            return RawResponse(200, {"items": CHECKPOINTS})
        if not self.selectors:
            message = f"field label not supported: {selector.partition('=')[0]}"
            return RawResponse(400, {"kind": "Status", "message": message})
        field, _, value = selector.partition("=")
        assert field == "spec.rolloutSet"
        return RawResponse(
            200, {"items": [c for c in CHECKPOINTS if c["spec"]["rolloutSet"] == value]}
        )


def kube_over(api: CheckpointsApi) -> Kube:
    return Kube(api=cast(Any, None), core=cast(Any, None), custom=cast(Any, api))


def names(items: list[dict[str, Any]]) -> list[str]:
    return [c["metadata"]["name"] for c in items]


async def test_the_api_server_filters_by_set() -> None:
    api = CheckpointsApi(selectors=True)
    kube = kube_over(api)
    assert names(await kube.list_checkpoints("ns", "set-a")) == ["a-1", "a-2"]
    assert names(await kube.list_checkpoints("ns", "set-b")) == ["b-1"]
    assert api.asked == ["spec.rolloutSet=set-a", "spec.rolloutSet=set-b"]


async def test_an_api_server_that_refuses_the_selector_is_asked_for_everything_from_then_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = CheckpointsApi(selectors=False)
    kube = kube_over(api)
    with caplog.at_level("INFO", logger="rollout_operator.cluster.kube"):
        assert names(await kube.list_checkpoints("ns", "set-a")) == ["a-1", "a-2"]
        assert names(await kube.list_checkpoints("ns", "set-b")) == ["b-1"]
    assert api.asked == ["spec.rolloutSet=set-a", None, None], "refused once, then not asked"
    assert not kube.field_selectors
    said = [r.getMessage() for r in caplog.records if "does not filter" in r.getMessage()]
    assert len(said) == 1, said
    assert "field label not supported" in said[0]
