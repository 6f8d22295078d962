"""Scenario `restore.all-or-nothing`: damaged copies of a committed checkpoint (a flipped byte,
a wrong record count) are refused at restore and nothing is installed; the intact one then
restores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.to_thread

from .. import _storage as storage
from .._wire import (
    ErrorCode,
    Manifest,
    RestoreRequest,
)
from .calls import Target, _connect, _expect, _expect_idle, _named_for, _refused
from .report import RESTORE, ConformanceError

_DAMAGES = ("flipped-byte", "wrong-count")


def _damaged_copy(source: Path, target_dir: Path, checkpoint_id: str, damage: str) -> None:
    """Copy one participant's records into `target_dir` for `checkpoint_id`, damaged.

    flipped-byte: one byte of the last record changes (the manifest keeps the old digest);
    wrong-count: the last record is gone (digest and size match the shorter file, the count
    does not). Without records, both write a manifest that promises one record of an empty
    file.
    """
    manifest = storage.read_manifest(source)
    raw = (source / manifest.records_file).read_bytes()
    lines = raw.splitlines(keepends=True)
    count = manifest.record_count
    if not lines:
        content, count = b"", 1
    elif damage == "flipped-byte":
        last = bytearray(lines[-1])
        last[len(last) // 2] ^= 0x01
        content = b"".join(lines[:-1]) + bytes(last)
    else:
        content = b"".join(lines[:-1])
    digest = (
        manifest.records_sha256
        if damage == "flipped-byte" and lines
        else storage.records_digest(hashlib.sha256(line).digest() for line in content.splitlines())
    )
    damaged = Manifest(
        role=manifest.role,
        instance=manifest.instance,
        checkpoint_id=checkpoint_id,
        attempt=manifest.attempt,
        records_file=f"records-{digest}.jsonl",
        records_sha256=digest,
        record_count=count,
        bytes=len(content),
    )
    storage.make_dirs(target_dir)
    (target_dir / damaged.records_file).write_bytes(content)
    (target_dir / storage.MANIFEST_NAME).write_bytes(damaged.model_dump_json().encode())


async def check_restore_all_or_nothing(
    targets: Sequence[Target],
    *,
    checkpoint_root: Path,
    checkpoint_id: str,
    attempt: int,
    call_timeout_s: float = 10.0,
) -> None:
    """`restore.all-or-nothing`: from the committed checkpoint `checkpoint_id`, write damaged
    copies (`flipped-byte`, `wrong-count`) under new ids and restore each into every target
    under `attempt`: each restore must be refused with `records_invalid`, and the participant
    must stay idle, on its attempt, with as many restored episodes as before.

    The check is strongest with two or more records per participant: a participant that
    installs record by record and only then verifies shows restored episodes afterwards.
    """
    async with _connect(targets, call_timeout_s) as conns:
        for damage in _DAMAGES:
            damaged_id = f"{checkpoint_id[: 127 - len(damage)]}.{damage}"
            for conn in conns:
                before = await _expect_idle(conn, RESTORE, f"before the {damage} restore")
                if before.set_name is None:
                    raise ConformanceError(
                        RESTORE, f"/status of {conn.target.name} must name its set", "set_name null"
                    )
                set_dir = before.set_dir or before.set_name
                source = storage.checkpoint_dir(
                    checkpoint_root, set_dir, checkpoint_id, before.instance
                )
                destination = storage.checkpoint_dir(
                    checkpoint_root, set_dir, damaged_id, before.instance
                )
                try:
                    await anyio.to_thread.run_sync(
                        _damaged_copy, source, destination, damaged_id, damage
                    )
                except (storage.RecordsInvalid, OSError) as error:
                    raise ConformanceError(
                        RESTORE,
                        f"the committed records of {before.instance} must be readable under "
                        f"{checkpoint_root}",
                        str(error),
                    ) from error
                what = (
                    f"restore of {damaged_id} ({damage} copy of {checkpoint_id}) into "
                    f"{conn.target.name} under attempt {attempt}"
                )
                await _refused(
                    RESTORE,
                    what,
                    conn.participant.restore(
                        RestoreRequest(
                            checkpoint_id=damaged_id,
                            attempt=attempt,
                            rollout_ids=_named_for(conn),
                            deadline_ts=conn.deadline(),
                        )
                    ),
                    ErrorCode.RECORDS_INVALID,
                )
                after = await _expect_idle(conn, RESTORE, f"after a refused {what}")
                _expect(
                    RESTORE,
                    after.restored_episodes == before.restored_episodes
                    and after.attempt == before.attempt,
                    f"a refused {what} must install nothing",
                    f"restored episodes {before.restored_episodes} -> {after.restored_episodes}, "
                    f"attempt {before.attempt} -> {after.attempt}",
                )
