"""`Kube.pass_snapshot`: a pass reads its set and pods once between its own writes.

A real `Kube` over a fake CoreV1Api/CustomObjectsApi that counts requests and answers the way
the generated client does with `_preload_content=False` (a raw response whose status the caller
checks).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from kube_fakes import RawResponse
from kubernetes_asyncio.client.exceptions import ApiException
from rollout_operator import kube as kube_module
from rollout_operator.kube import Kube, pass_snapshot

pytestmark = pytest.mark.unit


class CountingApi:
    """Answers every read with a fresh version of the object; counts the requests."""

    def __init__(self) -> None:
        self.reads = 0
        self.exists = True

    async def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> RawResponse:
        assert kwargs.get("_preload_content") is False
        self.reads += 1
        if not self.exists:
            return RawResponse(404, {"kind": "Status", "message": "not found"})
        return RawResponse(200, {"metadata": {"name": "rl", "resourceVersion": str(self.reads)}})

    async def list_namespaced_pod(self, *args: Any, **kwargs: Any) -> RawResponse:
        self.reads += 1
        return RawResponse(200, {"items": [{"metadata": {"name": f"p-{self.reads}"}}]})

    async def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> Any:
        return {"metadata": {"name": "rl"}}


def fake_kube(api: CountingApi) -> Kube:
    return Kube(api=cast(Any, None), core=cast(Any, api), custom=cast(Any, api))


async def test_reads_are_shared_within_a_pass_until_a_write() -> None:
    api = CountingApi()
    kube = fake_kube(api)
    with pass_snapshot():
        first = await kube.get_set("ns", "rl")
        again = await kube.get_set("ns", "rl")
        assert first == again
        assert api.reads == 1
        assert first is not again, "each read is parsed afresh: callers may change it"
        pods = await kube.list_pods("ns", "set=rl")
        assert await kube.list_pods("ns", "set=rl") == pods
        assert api.reads == 2
        await kube.patch_set_status("ns", "rl", {"attempt": 2}, resource_version=None)
        after_write = await kube.get_set("ns", "rl")
        assert api.reads == 3
        assert after_write is not None
        assert after_write["metadata"]["resourceVersion"] == "3"


async def test_without_a_pass_every_read_goes_to_the_api() -> None:
    api = CountingApi()
    kube = fake_kube(api)
    await kube.get_set("ns", "rl")
    await kube.get_set("ns", "rl")
    assert api.reads == 2


async def test_a_stored_read_expires_so_a_poll_inside_a_pass_sees_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr("rollout_operator.kube.time.monotonic", lambda: now[0])
    api = CountingApi()
    kube = fake_kube(api)
    with pass_snapshot():
        await kube.list_pods("ns", "set=rl")
        now[0] += kube_module.SNAPSHOT_MAX_AGE_SECONDS + 0.01
        await kube.list_pods("ns", "set=rl")
    assert api.reads == 2


async def test_an_error_status_raises_and_a_missing_set_reads_as_none() -> None:
    api = CountingApi()
    api.exists = False
    kube = fake_kube(api)
    with pass_snapshot():
        assert await kube.get_set("ns", "rl") is None
    with pytest.raises(ApiException) as raised:
        await Kube._raw(api.get_namespaced_custom_object(_preload_content=False))
    assert raised.value.status == 404


async def test_a_fresh_read_skips_the_snapshot_and_refreshes_it() -> None:
    """The recovery re-reads the set after listing its pods, to learn whether a deletion it saw
    was a suspend's; a stored read from before the pods would take the suspend for a loss."""
    api = CountingApi()
    kube = fake_kube(api)
    with pass_snapshot():
        before = await kube.get_set("ns", "rl")
        fresh = await kube.get_set("ns", "rl", fresh=True)
        assert api.reads == 2
        assert before is not None
        assert fresh is not None
        assert fresh["metadata"]["resourceVersion"] == "2"
        again = await kube.get_set("ns", "rl")
        assert api.reads == 2, "the fresh read is the one the snapshot keeps"
        assert again == fresh
