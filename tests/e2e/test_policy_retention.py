"""Retention on a real API server: `keepLatest` Ready checkpoints stay, older ones are deleted
with their records (finalizer), records a failed checkpoint left are removed, and a checkpoint a
person deletes takes its records along."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policy_support import (
    WAIT,
    checkpoints_of,
    counter_set,
    create_checkpoint,
    manual_checkpoint,
    wait_ready,
)
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    is_true,
    kubectl_apply,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

SET = "kept"


def set_folder(storage: Path) -> Path | None:
    """The set's own folder on its volume, `<namespace>/<set>/<uid>` (None before it exists)."""
    found = sorted(storage.glob(f"*/{SET}/*"))
    assert len(found) <= 1, found
    return found[0] if found else None


def on_storage(storage: Path) -> set[str]:
    folder = set_folder(storage)
    return {p.name for p in folder.iterdir()} if folder is not None else set()


async def test_retention_keeps_latest_ready_checkpoints_and_only_their_records(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
    tmp_path: Path,
) -> None:
    policy = {"keepLatest": 2, "prepareTimeoutSeconds": 2}
    kubectl_apply(cluster, namespace, counter_set(SET, storage_dir, tmp_path, policy=policy))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), WAIT, name=SET)
    for name in ("c1", "c2", "c3", "c4"):
        await create_checkpoint(resources, manual_checkpoint(name, SET))
        await wait_ready(resources, name)

    # A checkpoint that fails (its prepare is held past prepareTimeoutSeconds) after a
    # participant left a partial record behind.
    (tmp_path / "gate").touch()
    await create_checkpoint(resources, manual_checkpoint("broken", SET))
    await resources.wait_checkpoint(
        "broken", "Preparing", lambda o: (o.get("status") or {}).get("phase") == "Preparing", WAIT
    )
    folder = set_folder(storage_dir)
    assert folder is not None, "the Ready checkpoints are in the set's folder"
    leftover = folder / "broken" / "environment-0"
    leftover.mkdir(parents=True)
    (leftover / ".tmp-0123456789abcdef0123456789abcdef").write_text("{}\n")  # a commit's temp
    await resources.wait_checkpoint(
        "broken", "Failed", lambda o: (o.get("status") or {}).get("phase") == "Failed", WAIT
    )
    (tmp_path / "gate").unlink()

    async def retained() -> list[dict[str, Any]] | None:
        ready = [c for c in await checkpoints_of(resources, SET) if is_true(c, "Ready")]
        names = {c["metadata"]["name"] for c in ready}
        return ready if names == {"c3", "c4"} and on_storage(storage_dir) == names else None

    ready = await wait_for(retained, WAIT, "only c3 and c4, on storage too", interval=0.2)
    for ckpt in ready:
        for participant in ckpt["status"]["participants"]:
            assert (storage_dir / participant["manifest"]).is_file()
    failed = await resources.checkpoint("broken")
    assert failed["status"]["phase"] == "Failed"  # kept to show why; its records are gone
    # latestCheckpoint follows a checkpoint's Ready within a pass of the set (its one writer).
    await resources.wait_set(
        "latest c4", lambda o: o["status"].get("latestCheckpoint") == "c4", 10, SET
    )

    # A person deletes the latest checkpoint: its records go, the set points at the previous.
    cluster.kubectl("delete", "rckpt", "c4", "-n", namespace, "--timeout=60s")
    assert on_storage(storage_dir) == {"c3"}
    await resources.wait_set(
        "latest c3", lambda o: o["status"].get("latestCheckpoint") == "c3", 10, SET
    )
