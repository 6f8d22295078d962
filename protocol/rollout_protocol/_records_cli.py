"""`rollout-records`: remove a set's checkpoint records from a volume or a bucket, by
checkpoint name.

The operator runs it in a short-lived cleanup pod that mounts a set's volume when no participant
of the set runs to remove records itself (a suspended, deleted or crash-looping set,
docs/design.md#65-retention-and-records); a person can run it by hand on a node or a pod that mounts
the volume. It removes exactly what the `remove` control operation removes (`remove_records`: the
protocol's own files below the set's directory, never through a symlink) and prints the same reply,
as JSON, on stdout and into the container's termination message, where the operator reads it.

With `--root`, the records are on the volume mounted there; without it, in the S3-API bucket the
`ROLLOUT_STORAGE_S3_*` variables name (the participants' own variables, with the Secret's folder
mounted as in their pods): the same removal (`BucketStore.remove_records`), of the set's own keys
only.

Exit status: 0 when everything named is gone (removed or absent), 3 when entries were left in
place (named in the reply), 1 when the storage refused, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ._objectstore import BucketStore
from ._settings import S3_ENV_PREFIX, ControlConfigError, bucket_from_env
from ._storage import RecordsStore, StorageError, UnsafePath, VolumeStore

EXIT_KEPT = 3
"""Something was left in place (a file the protocol did not write): named in the reply."""
TERMINATION_LOG = "/dev/termination-log"
"""Where Kubernetes takes a container's termination message from (its default path)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-records",
        description="Remove a set's checkpoint records (only files the protocol writes).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    remove = sub.add_parser("remove", help="remove named checkpoints, or the whole set's records")
    remove.add_argument(
        "--root",
        type=Path,
        help=f"the volume's mount point (without it: the bucket of the {S3_ENV_PREFIX}* variables)",
    )
    remove.add_argument(
        "--set-dir", required=True, help="the set's directory below it (<namespace>/<set>/<uid>)"
    )
    scope = remove.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--checkpoint", action="append", default=[], help="a checkpoint to remove (repeatable)"
    )
    scope.add_argument(
        "--whole-set", action="store_true", help="every checkpoint and the set's directory"
    )
    remove.add_argument(
        "--termination-log",
        type=Path,
        default=None,
        help=f"also write the reply to this file (a cleanup pod passes {TERMINATION_LOG})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    store: RecordsStore
    if args.root is not None:
        if not args.root.is_dir():
            print(f"rollout-records: {args.root} is not a directory", file=sys.stderr)
            return 1
        store = VolumeStore(args.root)
    else:
        try:
            bucket = bucket_from_env()
        except ControlConfigError as error:
            print(f"rollout-records: {error}", file=sys.stderr)
            return 2
        if bucket is None:
            print(
                f"rollout-records: give --root (a volume) or set the {S3_ENV_PREFIX}* "
                "variables (a bucket)",
                file=sys.stderr,
            )
            return 2
        store = BucketStore(bucket)
    try:
        reply = store.remove_records(args.set_dir, args.checkpoint, whole_set=args.whole_set)
    except UnsafePath as error:
        print(f"rollout-records: {error}", file=sys.stderr)
        return 2
    except StorageError as error:
        print(f"rollout-records: {error}", file=sys.stderr)
        return 1
    text = reply.model_dump_json()
    print(text)
    log: Path | None = args.termination_log
    if log is not None:
        try:
            log.write_text(text)
        except OSError as error:  # the reply is on stdout still
            print(f"rollout-records: cannot write {log}: {error}", file=sys.stderr)
    return EXIT_KEPT if reply.kept_count else 0


if __name__ == "__main__":
    sys.exit(main())
