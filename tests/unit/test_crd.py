"""The CRDs in crds/ are generated from the models, structural, and carry the CEL rules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rollout_operator.model import api, crdgen

CRDS = Path(__file__).resolve().parents[2] / "crds"


def load(kind: crdgen.Kind) -> dict[str, Any]:
    doc = yaml.safe_load((CRDS / crdgen.file_name(kind)).read_text())
    assert isinstance(doc, dict)
    return doc


def root_schema(kind: crdgen.Kind) -> dict[str, Any]:
    schema = load(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crds_match_the_models() -> None:
    stale = crdgen.stale_files(CRDS)
    assert not stale, "crds/ is out of date; run `make crds`:\n" + "\n".join(stale.values())


def test_check_mode_fails_with_a_diff_when_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert crdgen.main(["--dir", str(tmp_path)]) == 0
    assert crdgen.main(["--dir", str(tmp_path), "--check"]) == 0
    target = tmp_path / crdgen.file_name(crdgen.ROLLOUT_SET)
    target.write_text(target.read_text().replace("shortNames", "shortnames"))
    capsys.readouterr()
    assert crdgen.main(["--dir", str(tmp_path), "--check"]) == 1
    out, err = capsys.readouterr()
    assert "-    shortnames:" in out
    assert "+    shortNames:" in out
    assert "out of date" in err
    assert "make crds" in err


@pytest.mark.parametrize("kind", crdgen.KINDS, ids=lambda k: k.kind)
def test_every_schema_node_is_structural(kind: crdgen.Kind) -> None:
    for path, node in walk(root_schema(kind)):
        assert "type" in node, f"{path} has no type"
        for key in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs", "uniqueItems"):
            assert key not in node, f"{path} has {key}"
        if "additionalProperties" in node:
            assert "properties" not in node, f"{path}: additionalProperties with properties"
            assert isinstance(node["additionalProperties"], dict), path


@pytest.mark.parametrize("kind", crdgen.KINDS, ids=lambda k: k.kind)
def test_every_spec_and_status_field_is_described(kind: crdgen.Kind) -> None:
    """Descriptions are the `kubectl explain` text."""
    root = root_schema(kind)
    for part in ("spec", "status"):
        for path, node in walk(root["properties"][part], part):
            if path.endswith("[]"):
                continue
            assert node.get("description"), f"{kind.kind} {path} has no description"


def test_optional_spec_fields_are_not_nullable_but_status_fields_are() -> None:
    spec = root_schema(crdgen.ROLLOUT_SET)["properties"]["spec"]
    policy = spec["properties"]["checkpointPolicy"]["properties"]
    assert "nullable" not in policy["intervalSeconds"]
    status = root_schema(crdgen.ROLLOUT_SET)["properties"]["status"]
    assert status["properties"]["latestCheckpoint"]["nullable"] is True


def test_names_categories_and_status_subresource() -> None:
    for kind, short in ((crdgen.ROLLOUT_SET, "rset"), (crdgen.ROLLOUT_CHECKPOINT, "rckpt")):
        doc = load(kind)
        assert doc["metadata"]["name"] == f"{kind.plural}.checkpoint.rollout.dev"
        assert doc["spec"]["group"] == api.GROUP
        assert doc["spec"]["scope"] == "Namespaced"
        assert doc["spec"]["names"]["shortNames"] == [short]
        assert doc["spec"]["names"]["categories"] == ["rollout"]
        version = doc["spec"]["versions"][0]
        assert version["name"] == api.VERSION
        assert version["served"]
        assert version["storage"]
        assert version["subresources"] == {"status": {}}


def test_printer_columns_answer_is_it_safe_and_since_when() -> None:
    def names(kind: crdgen.Kind) -> list[str]:
        columns = load(kind)["spec"]["versions"][0]["additionalPrinterColumns"]
        return [c["name"] for c in columns if not c.get("priority")]

    assert names(crdgen.ROLLOUT_SET) == [
        "Ready",
        "Attempt",
        "Latest-Checkpoint",
        "Queue",
        "Standby",
        "Kept",
        "Replaced",
        "Age",
    ]
    assert names(crdgen.ROLLOUT_CHECKPOINT) == [
        "Ready",
        "Set",
        "Trigger",
        "Episodes",
        "Pause",
        "Age",
    ]


def rules(node: dict[str, Any]) -> list[str]:
    return [r["rule"] for r in node.get("x-kubernetes-validations", [])]


def test_cel_rules_sit_where_their_fields_are() -> None:
    root = root_schema(crdgen.ROLLOUT_SET)
    spec = root["properties"]["spec"]
    participants = spec["properties"]["participants"]
    assert api.RULE_SET_NAME.cel in rules(root)
    assert api.RULE_NEVER_SAVES.cel in rules(spec)
    assert api.RULE_UNIQUE_ROLES.cel in rules(participants)
    assert participants["x-kubernetes-list-type"] == "map"
    assert participants["x-kubernetes-list-map-keys"] == ["role"]
    assert api.RULE_CONTROL_PORT.cel in rules(participants["items"])
    assert api.RULE_RESTART_NEVER.cel in rules(participants["items"])
    storage = spec["properties"]["storage"]
    assert "self == oldSelf" in rules(storage)
    assert api.RULE_STORAGE_PATH.cel in rules(storage)
    replicas = participants["items"]["properties"]["replicas"]
    assert replicas["minimum"] == 1
    keep = spec["properties"]["checkpointPolicy"]["properties"]["keepLatest"]
    assert keep["minimum"] == 1
    checkpoint = root_schema(crdgen.ROLLOUT_CHECKPOINT)
    assert api.RULE_CHECKPOINT_NAME.cel in rules(checkpoint)
    assert rules(checkpoint["properties"]["spec"]) == [
        api.RULE_CHECKPOINT_SPEC_IMMUTABLE.cel,
        api.RULE_TRAINER_STEP.cel,
    ]


def test_pod_template_keeps_unknown_fields() -> None:
    spec = root_schema(crdgen.ROLLOUT_SET)["properties"]["spec"]
    template = spec["properties"]["participants"]["items"]["properties"]["template"]
    assert template["x-kubernetes-preserve-unknown-fields"] is True
    assert template["properties"]["spec"]["x-kubernetes-preserve-unknown-fields"] is True
    volume = spec["properties"]["storage"]["properties"]["volume"]
    assert volume["x-kubernetes-preserve-unknown-fields"] is True


def test_object_defaults_let_the_api_server_fill_nested_defaults() -> None:
    spec = root_schema(crdgen.ROLLOUT_SET)["properties"]["spec"]
    assert spec["properties"]["checkpointPolicy"]["default"] == {}
    assert spec["properties"]["recovery"]["default"] == {}


def test_a_union_of_types_is_refused_by_the_generator() -> None:
    node = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    with pytest.raises(crdgen.SchemaError, match="union"):
        crdgen.structural(node, {}, nullable=False, path="x")


def test_a_node_without_type_is_refused_by_the_generator() -> None:
    with pytest.raises(crdgen.SchemaError, match="no type"):
        crdgen.structural({"description": "anything"}, {}, nullable=False, path="x")
