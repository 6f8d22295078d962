"""What ships: the wheel holds the contract, the operator and the reference servers, nothing else,
and builds without warnings; the contract imports neither of the other two (nor Kopf, nor the test
harness, nor aiohttp and uvicorn, which only its `client`, `serve` and `kit` extras need), and
the operator's process imports no part of the serving side (FastAPI). The
contract's own distribution (`protocol/`) is tested installed alone in
tests/protocol/test_sdk_guide.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def test_the_wheel_ships_the_contract_the_operator_and_the_servers_only(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", str(ROOT), "-w", tmp_path],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not re.findall(r"\w+Warning\b.*", built.stdout + built.stderr)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"rollout_protocol", "rollout_operator", "rollout_servers"}
    assert not [name for name in names if "/demo.py" in name or "devcluster" in name]
    assert "rollout_servers/data/tasks.jsonl" in names or any(
        name.startswith("rollout_servers/data/") for name in names
    ), "the task set ships with the servers"


def test_importing_the_contract_imports_no_server_operator_or_kopf() -> None:
    probe = "import json, sys, rollout_protocol; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60
    )
    loaded = set(json.loads(done.stdout))
    forbidden = {"rollout_servers", "rollout_operator", "kopf", "kubernetes_asyncio", "uvicorn"}
    forbidden |= {"aiohttp"}  # the `client` extra: only HttpParticipantClient's first call
    forbidden |= {"devcluster", "harness"}
    assert not {name.split(".")[0] for name in loaded} & forbidden


def test_the_operator_imports_no_serving_side() -> None:
    """The operator is a coordinator: it never serves a control plane, so its process imports
    neither FastAPI nor Starlette (a fifth of its start), while the contract still offers
    `ControlPlane` and `RunRoute` to servers, imported at their first use."""
    probe = (
        "import json, sys; sys.modules['kubernetes_asyncio'] = None; "  # as its entry point
        "import rollout_operator.cli, rollout_operator.handlers; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60
    )
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert "kopf" in loaded, "the probe imported the operator"
    assert not loaded & {"fastapi", "starlette", "uvicorn"}
    import rollout_protocol
    from rollout_protocol._control import ControlPlane
    from rollout_protocol._runs import RunRoute

    assert rollout_protocol.ControlPlane is ControlPlane
    assert rollout_protocol.RunRoute is RunRoute


def test_the_contracts_public_names_are_documented_and_typed() -> None:
    import rollout_protocol

    for name in rollout_protocol.__all__:
        value = getattr(rollout_protocol, name)
        if isinstance(value, type) or callable(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    # Submodules imported elsewhere (`rollout_protocol.conformance`) are attributes too.
    private = [
        n
        for n in dir(rollout_protocol)
        if not n.startswith("_") and not isinstance(getattr(rollout_protocol, n), ModuleType)
    ]
    assert sorted(private) == sorted(rollout_protocol.__all__), "every public name is in __all__"


def test_every_private_module_of_the_contract_is_forbidden_to_the_operator() -> None:
    """The import-linter contract lists the contract's private modules by name: a new one must
    be listed too, or the operator could import it unnoticed."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["name"] == "the operator and the Gym adapter use the protocol's public surface only"
    ]
    contract_dir = ROOT / "protocol" / "rollout_protocol"
    private = {
        f"rollout_protocol.{path.stem}"
        for path in contract_dir.glob("_*.py")
        if path.stem != "__init__"
    }
    # private packages too (`_conformance/`): forbidding one forbids its modules
    private |= {
        f"rollout_protocol.{path.parent.name}" for path in contract_dir.glob("_*/__init__.py")
    }
    assert private - set(contract["forbidden_modules"]) == set()
