"""The one way devcluster code and tests get a kubernetes_asyncio client for a kubeconfig."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config


async def load_configuration(kubeconfig: Path) -> Any:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return configuration


@asynccontextmanager
async def open_api(kubeconfig: Path) -> AsyncIterator[Any]:
    """An `ApiClient`, closed on exit (its aiohttp session would otherwise leak a warning)."""
    api = client.ApiClient(await load_configuration(kubeconfig))
    try:
        yield api
    finally:
        await api.close()


def is_not_found(error: BaseException) -> bool:
    return isinstance(error, client.ApiException) and error.status == 404
