"""Records are removed wherever a set's volume is
(docs/design.md#65-retention-and-records).

- The participants' `remove` control operation, over the real FastAPI app: only the named
  checkpoints of the participant's own set directory, never the open checkpoint, what it did
  not write left in place and named.
- `rollout-records remove`, the command a cleanup pod runs: the same removal and reply, its exit
  status and termination message.
- `RecordsRemover` against the in-memory API server (`FakeCluster`): through a participant served
  on a loopback port when one runs, else through a cleanup pod. No kubelet runs here, so the
  test plays the kubelet's part below the operator: it runs the pod's own command line against
  the folder the pod's volume names and writes the pod's status (exit code, termination
  message) as a kubelet would.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.resources import (
    LABEL_RECORDS_OF,
    TOKEN_KEY,
    cleanup_pod,
    secret_name,
    set_dir,
)
from rollout_operator.flows.records import (
    CLEANUP_GIVE_UP_SECONDS,
    RecordsRemover,
    RemovalPending,
)
from rollout_operator.model import api
from rollout_protocol import (
    ControlPlane,
    ControlSettings,
    ErrorBody,
    ErrorCode,
    RemoveReply,
    Role,
)
from rollout_protocol._records_cli import EXIT_KEPT
from rollout_protocol._records_cli import main as records_main
from rollout_protocol.conformance import serve_app
from testsupport.controlplane import call, served
from testsupport.fakecluster import FakeCluster
from testsupport.participants import FakeParticipant
from testsupport.policy import NS, T0, rollout_set, seeded

TOKEN = "records-token"
SET_DIR = f"{NS}/math/uid-1"


def _deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


def _plane(root: Path, rollouts: list[str] | None = None) -> ControlPlane:
    settings = ControlSettings(
        role=Role.ENVIRONMENT,
        set_name="math",
        set_dir=SET_DIR,
        checkpoint_root=root,
        token=TOKEN,
    )
    return ControlPlane(FakeParticipant(rollouts=rollouts or ["r1", "r2"]), settings)


@asynccontextmanager
async def _served(plane: ControlPlane) -> AsyncIterator[httpx.AsyncClient]:
    async with served(plane, TOKEN) as client:
        yield client


async def _call(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    return await call(client, route, **body)


async def _checkpoint(client: httpx.AsyncClient, cid: str) -> None:
    """A real, committed and resumed checkpoint of this participant."""
    for route in ("prepare", "commit", "resume"):
        response = await _call(client, route, checkpoint_id=cid, deadline_ts=_deadline())
        assert response.status_code == 200, response.text


def _code(response: httpx.Response) -> ErrorCode:
    return ErrorBody.model_validate_json(response.content).error.code


# --- the control operation --------------------------------------------------------------------


async def test_remove_takes_only_named_checkpoints_of_its_own_set_and_names_what_it_kept(
    tmp_path: Path,
) -> None:
    other_set = tmp_path / NS / "math" / "uid-0" / "a" / "environment-0"
    other_set.mkdir(parents=True)
    (other_set / "manifest.json").write_text("{}")
    async with _served(_plane(tmp_path)) as client:
        for cid in ("a", "b", "c"):
            await _checkpoint(client, cid)
        base = tmp_path / SET_DIR
        (base / "c" / "environment-0" / "notes.txt").write_text("a person's file\n")

        response = await _call(
            client, "remove", checkpoint_ids=["a", "nope", "c"], deadline_ts=_deadline()
        )
        assert response.status_code == 200, response.text
        reply = RemoveReply.model_validate_json(response.content)
        assert reply.removed == ["a", "c"]
        assert reply.absent == ["nope"]
        assert reply.kept == [f"{SET_DIR}/c/environment-0/notes.txt"]
        assert reply.kept_count == 1
        assert not (base / "a").exists()
        assert (base / "b" / "environment-0" / "manifest.json").is_file(), "b was not named"
        assert not (base / "c" / "environment-0" / "manifest.json").exists()
        assert (base / "c" / "environment-0" / "notes.txt").is_file()
        assert (other_set / "manifest.json").is_file(), "another set's records are never touched"

        again = await _call(client, "remove", checkpoint_ids=["a"], deadline_ts=_deadline())
        assert RemoveReply.model_validate_json(again.content).absent == ["a"], "idempotent"


async def test_remove_refuses_the_open_checkpoint_and_a_passed_deadline(tmp_path: Path) -> None:
    async with _served(_plane(tmp_path)) as client:
        await _checkpoint(client, "old")
        prepared = await _call(client, "prepare", checkpoint_id="open", deadline_ts=_deadline())
        assert prepared.status_code == 200, prepared.text
        for body in ({"checkpoint_ids": ["open"]}, {"whole_set": True}):
            refused = await _call(client, "remove", deadline_ts=_deadline(), **body)
            assert refused.status_code == 409, refused.text
            assert _code(refused) is ErrorCode.CONFLICTING_CHECKPOINT
            assert "open" in refused.text
        other = await _call(client, "remove", checkpoint_ids=["old"], deadline_ts=_deadline())
        assert RemoveReply.model_validate_json(other.content).removed == ["old"], (
            "another checkpoint may go while one is open"
        )
        late = await _call(client, "remove", checkpoint_ids=["x"], deadline_ts=time.time() - 1)
        assert _code(late) is ErrorCode.DEADLINE_PASSED
        both = await _call(
            client, "remove", checkpoint_ids=["x"], whole_set=True, deadline_ts=_deadline()
        )
        assert both.status_code == 422
        assert _code(both) is ErrorCode.INVALID_REQUEST
        path = await _call(client, "remove", checkpoint_ids=["../x"], deadline_ts=_deadline())
        assert path.status_code == 422, "a checkpoint id is a plain name, never a path"


async def test_remove_of_the_whole_set_takes_its_folder(tmp_path: Path) -> None:
    async with _served(_plane(tmp_path)) as client:
        await _checkpoint(client, "a")
        response = await _call(client, "remove", whole_set=True, deadline_ts=_deadline())
        reply = RemoveReply.model_validate_json(response.content)
        assert reply.removed == [SET_DIR]
        assert reply.kept_count == 0
        assert not (tmp_path / NS).exists(), "the set's folder and its empty parents go"


# --- the command a cleanup pod runs -----------------------------------------------------------


async def test_rollout_records_removes_and_reports_through_its_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _served(_plane(tmp_path)) as client:
        for cid in ("a", "b"):
            await _checkpoint(client, cid)
    log = tmp_path / "termination-log"
    common = ["remove", "--root", str(tmp_path), "--set-dir", SET_DIR]
    assert records_main([*common, "--checkpoint", "a", "--termination-log", str(log)]) == 0
    printed = RemoveReply.model_validate_json(capsys.readouterr().out)
    assert printed == RemoveReply.model_validate_json(log.read_text())
    assert printed.removed == ["a"]
    assert not (tmp_path / SET_DIR / "a").exists()

    (tmp_path / SET_DIR / "b" / "stray").write_text("not ours")
    assert records_main([*common, "--whole-set"]) == EXIT_KEPT
    kept = RemoveReply.model_validate_json(capsys.readouterr().out)
    assert kept.kept == [f"{SET_DIR}/b/stray"]
    assert (tmp_path / SET_DIR / "b" / "stray").is_file()
    assert records_main([*common.copy()[:3], "--set-dir", "../../etc", "--whole-set"]) == 2
    assert records_main(["remove", "--root", str(tmp_path / "none"), "--set-dir", SET_DIR,
                         "--whole-set"]) == 1  # fmt: skip


# --- the operator's remover -------------------------------------------------------------------


def _claim_set(tmp_path: Path) -> dict[str, Any]:
    """The set `math` on a claim the operator does not mount (its records are not visible here)."""
    body = rollout_set(tmp_path)
    body["spec"]["storage"] = {
        "path": "/ckpt",
        "volume": {"persistentVolumeClaim": {"claimName": "team-ckpt"}},
    }
    body["spec"]["participants"][0]["template"]["spec"]["securityContext"] = {"runAsUser": 4242}
    return body


def _token_secret(cluster: FakeCluster) -> None:
    cluster.put(
        {
            "kind": "Secret",
            "metadata": {"name": secret_name("math"), "namespace": NS},
            "data": {TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
        }
    )


async def test_the_remover_asks_the_running_participants_when_it_cannot_see_the_volume(
    tmp_path: Path,
) -> None:
    body = _claim_set(tmp_path)
    plane = _plane(tmp_path)
    async with _served(plane) as client:
        await _checkpoint(client, "a")
        await _checkpoint(client, "b")
    app = FastAPI()
    plane.install(app)
    async with plane.running(), serve_app(app, role=Role.ENVIRONMENT, token=TOKEN) as served:
        port = httpx.URL(served.target.base_url).port
        body["spec"]["participants"][0]["template"]["spec"]["containers"][0]["ports"] = [
            {"name": "control", "containerPort": port}
        ]
        cluster = seeded(body)
        _token_secret(cluster)
        cluster.put(
            {
                "kind": "Pod",
                "metadata": {
                    "name": "math-environment-0-a3",
                    "namespace": NS,
                    "labels": {
                        api.LABEL_SET: "math",
                        api.LABEL_ROLE: "environment",
                        api.LABEL_INDEX: "0",
                        api.LABEL_ATTEMPT: "3",
                    },
                },
                "status": {"phase": "Running", "podIP": "127.0.0.1"},
            }
        )
        remover = RecordsRemover(cluster.kube(), StorageLocator(None, cleanup_image="img:1"))
        rset = api.RolloutSet.model_validate(body)
        removal = await remover.remove(rset, ["a"])
    assert removal.not_removed is None, removal
    assert "a removed by 1 participant(s)" in removal.outcome
    assert not (tmp_path / SET_DIR / "a").exists()
    assert (tmp_path / SET_DIR / "b").is_dir()
    assert cluster.count("create", "pods") == 0, "no cleanup pod while a participant answers"


def _act_as_kubelet(cluster: FakeCluster, volume_root: Path) -> str:
    """Run the cleanup pod's own command with its volume at `volume_root`, then write the status
    a kubelet would (phase, exit code, termination message)."""
    [pod] = cluster.list_objects("pods", NS)
    container = pod["spec"]["containers"][0]
    [mount] = container["volumeMounts"]
    argv = [str(volume_root) if arg == mount["mountPath"] else arg for arg in container["command"]]
    assert argv[0] == "rollout-records"
    log = volume_root.parent / "termination-log"
    argv = [str(log) if arg == "/dev/termination-log" else arg for arg in argv]
    code = records_main(argv[1:])
    pod["status"] = {
        "phase": "Succeeded" if code == 0 else "Failed",
        "containerStatuses": [
            {
                "name": container["name"],
                "state": {"terminated": {"exitCode": code, "message": log.read_text()}},
            }
        ],
    }
    cluster.put(pod)
    return str(pod["metadata"]["name"])


async def test_without_participants_a_cleanup_pod_removes_the_records_and_is_deleted(
    tmp_path: Path,
) -> None:
    volume = tmp_path / "volume"
    async with _served(_plane(volume)) as client:
        for cid in ("a", "b"):
            await _checkpoint(client, cid)
    body = _claim_set(tmp_path)
    cluster = seeded(body)
    rset = api.RolloutSet.model_validate(body)
    soon = (T0 + timedelta(seconds=5)).timestamp()  # the API server's clock stands at T0
    remover = RecordsRemover(
        cluster.kube(), StorageLocator(None, cleanup_image="img:1"), clock=lambda: soon
    )
    with pytest.raises(RemovalPending, match="cleanup pod"):
        await remover.remove(rset, ["a"])
    [pod] = cluster.list_objects("pods", NS)
    assert pod["metadata"]["labels"] == {
        LABEL_RECORDS_OF: "math",
        "app.kubernetes.io/managed-by": "rollout-checkpoint-operator",
    }, "never the set's label: no loop, recovery or trainer takes it for a participant"
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "team-ckpt"}
    assert pod["spec"]["securityContext"] == {"runAsUser": 4242}, "runs as the participants"
    assert pod["spec"]["containers"][0]["image"] == "img:1"
    with pytest.raises(RemovalPending):
        await remover.remove(rset, ["a"])  # still running: no second pod
    assert cluster.count("create", "pods") == 1

    name = _act_as_kubelet(cluster, volume)
    removal = await remover.remove(rset, ["a"])
    assert removal.not_removed is None, removal
    assert f"a removed by cleanup pod {name}" in removal.outcome
    assert not (volume / SET_DIR / "a").exists()
    assert (volume / SET_DIR / "b").is_dir()
    assert cluster.list_objects("pods", NS) == [], "the finished cleanup pod is deleted"

    (volume / SET_DIR / "b" / "stray").write_text("not ours")
    with pytest.raises(RemovalPending):
        await remover.remove(rset, None)
    _act_as_kubelet(cluster, volume)
    whole = await remover.remove(rset, None)
    assert whole.not_removed is not None
    assert f"{SET_DIR}/b/stray" in whole.not_removed
    assert (volume / SET_DIR / "b" / "stray").is_file()
    assert not (volume / SET_DIR / "b" / "environment-0").exists()


async def test_a_cleanup_pod_that_never_runs_is_given_up_and_reported(tmp_path: Path) -> None:
    body = _claim_set(tmp_path)
    cluster = seeded(body)
    rset = api.RolloutSet.model_validate(body)
    late = (T0 + timedelta(seconds=CLEANUP_GIVE_UP_SECONDS + 1)).timestamp()
    remover = RecordsRemover(
        cluster.kube(), StorageLocator(None, cleanup_image="img:1"), clock=lambda: late
    )
    with pytest.raises(RemovalPending):
        await remover.remove(rset, ["a"])
    [pod] = cluster.list_objects("pods", NS)
    pod["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}
        ],
    }
    cluster.put(pod)
    removal = await remover.remove(rset, ["a"])
    assert removal.not_removed is not None
    assert "did not finish" in removal.not_removed
    assert "ImagePullBackOff" in removal.not_removed
    assert f"<volume>/{SET_DIR}/a" in removal.not_removed, "says what to delete by hand"
    assert cluster.list_objects("pods", NS) == []


async def test_without_participants_or_cleanup_image_the_records_are_reported(
    tmp_path: Path,
) -> None:
    body = _claim_set(tmp_path)
    cluster = seeded(body)
    removal = await RecordsRemover(cluster.kube(), StorageLocator(None)).remove(
        api.RolloutSet.model_validate(body), ["a"]
    )
    assert removal.not_removed is not None
    assert "ROLLOUT_CLEANUP_IMAGE" in removal.not_removed
    assert cluster.count("create", "pods") == 0


def test_the_cleanup_pod_command_names_the_sets_own_directory() -> None:
    rset = api.RolloutSet.model_validate(_claim_set(Path("/unused")))
    pod = cleanup_pod(rset, ("a", "b"), "img:1")
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--set-dir") + 1] == set_dir(rset) == SET_DIR
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--checkpoint"] == ["a", "b"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["activeDeadlineSeconds"] > 0
    assert json.dumps(pod).count("--whole-set") == 0
    assert "--whole-set" in cleanup_pod(rset, None, "img:1")["spec"]["containers"][0]["command"]
