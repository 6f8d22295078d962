"""devcluster.ociarchive: the container node's local images are valid, reproducible OCI archives."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

from devcluster.ociarchive import ImageFile, ImageSpec, write


def _spec(tool: Path) -> ImageSpec:
    return ImageSpec(
        name="devcluster.local/test:1",
        files=[
            ImageFile("/bin/tool", source=tool),
            ImageFile("/etc/motd", data=b"hi\n", mode=0o644),
        ],
        symlinks={"/bin/alias": "/bin/tool"},
        directories=["tmp"],
        entrypoint=["/bin/tool"],
    )


def _blob(archive: tarfile.TarFile, digest: str) -> bytes:
    handle = archive.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
    assert handle is not None
    return handle.read()


def _json(archive: tarfile.TarFile, name: str) -> Any:
    handle = archive.extractfile(name)
    assert handle is not None
    return json.load(handle)


def test_archive_is_an_oci_layout_whose_digests_match(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_bytes(b"\x7fELF fake binary")
    digest = write(_spec(tool), tmp_path / "image.tar")
    with tarfile.open(tmp_path / "image.tar") as archive:
        assert _json(archive, "oci-layout") == {"imageLayoutVersion": "1.0.0"}
        index = _json(archive, "index.json")
        (entry,) = index["manifests"]
        assert entry["digest"] == digest
        assert entry["annotations"]["io.containerd.image.name"] == "devcluster.local/test:1"
        assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
        manifest_bytes = _blob(archive, digest)
        assert "sha256:" + hashlib.sha256(manifest_bytes).hexdigest() == digest
        manifest = json.loads(manifest_bytes)
        layer = _blob(archive, manifest["layers"][0]["digest"])
        config = json.loads(_blob(archive, manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert config["config"]["Entrypoint"] == ["/bin/tool"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as rootfs:
        members = {m.name: m for m in rootfs.getmembers()}
        tool_member = rootfs.extractfile("bin/tool")
        assert tool_member is not None
        assert tool_member.read() == b"\x7fELF fake binary"
    assert members["bin/tool"].mode == 0o755
    assert members["etc/motd"].mode == 0o644
    assert members["bin/alias"].issym()
    assert members["bin/alias"].linkname == "/bin/tool"
    assert members["tmp"].isdir()
    assert members["tmp"].mode == 0o1777
    assert all(m.uid == 0 and m.mtime == 0 for m in members.values())


def test_same_inputs_give_the_same_bytes(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_bytes(b"one")
    first = write(_spec(tool), tmp_path / "a.tar")
    second = write(_spec(tool), tmp_path / "b.tar")
    assert first == second
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    tool.write_bytes(b"two")
    assert write(_spec(tool), tmp_path / "c.tar") != first
