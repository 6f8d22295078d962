"""docs/sdk.md is enough on its own: its servers, extracted from the page, pass the conformance
kit, from this checkout and from the `rollout-protocol` wheel installed alone.

The page marks a file's block with `<!-- file: NAME -->` before a fenced python block; each file
is one block, printed whole, and the minimal server's is the page's first python block, so what
a reader copies is complete. `minimal_server.py` is the minimal server and
`test_minimal_server.py` its kit run (with the kit's fake model, no debug hooks);
`object_server.py` is the recipe for environments that live in a Python object and
`test_object_server.py` its kit run. The files are run as they stand on the page, as processes:
under pytest (`python -m pytest test_minimal_server.py test_object_server.py`, with nothing but
what the files declare: anyio's plugin and their `@pytest.mark.anyio`), and alone
(`python test_minimal_server.py`), so what the guide shows is what runs. The recipe's server is
also run with its snapshot hook taken out (the object kept beside the runtime only, the design
the recipe warns of), which the kit must fail. The fresh-environment test builds the SDK's
distribution (`protocol/`) alone, installs it with its `kit` extra and pytest into a new virtual
environment (from the package index; pip's cache makes it about 15 s) and runs the same files
there: nothing else of this project is importable in it. The minimal server as printed,
imported and served in process, refuses requests it cannot play (a rollout id the wire cannot
carry, a task without its question) as the protocol's 422 naming the field.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from rollout_protocol import ControlSettings, Role
from rollout_protocol.conformance import serve_app

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "sdk.md"
FILE_BLOCK = re.compile(r"<!-- file: (?P<name>[\w.]+) -->\n```python\n(?P<code>.*?)```", re.S)
PYTHON_BLOCK = re.compile(r"```python\n(?P<code>.*?)```", re.S)
PASSED = {
    "test_minimal_server.py": "the minimal server passes the conformance kit",
    "test_object_server.py": "the object server passes the conformance kit",
}
FILES = {"minimal_server.py", "test_minimal_server.py", "object_server.py", "test_object_server.py"}
SNAPSHOT_LOAD = 'return CalculatorSession.load(state["snapshot"])'
"""The line of `object_server.take_session` that rebuilds a session from its snapshot."""
RUN_TIMEOUT_S = 120
RUFF = (sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache")


def guide_blocks() -> dict[str, list[str]]:
    """The guide's marked blocks, by file name, in page order."""
    files: dict[str, list[str]] = {}
    for block in FILE_BLOCK.finditer(GUIDE.read_text()):
        files.setdefault(block["name"], []).append(block["code"])
    return files


def guide_files() -> dict[str, str]:
    """The files the guide's marked blocks make up, by name: each the one block printed."""
    return {name: "\n\n".join(parts) for name, parts in guide_blocks().items()}


def write_guide_files(directory: Path) -> None:
    for name, code in guide_files().items():
        (directory / name).write_text(code)


def run_in(python: str, directory: Path, env: dict[str, str], *args: str) -> Any:
    """`python *args` in `directory`; the finished process (`subprocess.CompletedProcess`)."""
    return subprocess.run(
        [python, *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def run_the_guides_tests_alone(python: str, directory: Path, env: dict[str, str]) -> None:
    for test_file, passed in PASSED.items():
        done = run_in(python, directory, env, test_file)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        assert passed in done.stdout


def run_the_guides_tests_under_pytest(python: str, directory: Path, env: dict[str, str]) -> None:
    done = run_in(python, directory, env, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PASSED)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert re.search(rf"\b{len(PASSED)} passed\b", done.stdout), done.stdout[-3000:]


def test_the_guide_holds_its_servers_and_their_tests() -> None:
    assert set(guide_files()) == FILES


def test_the_guides_first_snippet_is_the_whole_server() -> None:
    """Each file is printed as one block (nothing is stitched together from pieces), and the
    page's first python block is the server, so the first snippet a reader meets runs as is."""
    assert {name: len(parts) for name, parts in guide_blocks().items()} == dict.fromkeys(FILES, 1)
    first = PYTHON_BLOCK.search(GUIDE.read_text())
    assert first is not None
    assert first["code"] == guide_files()["minimal_server.py"]
    assert 'if __name__ == "__main__":\n    main()' in first["code"]


def test_every_snippet_of_the_guide_defines_what_it_uses(tmp_path: Path) -> None:
    """Pyflakes' checks (undefined names, unused imports) on every file and every python block
    that is not part of a file."""
    write_guide_files(tmp_path)
    loose = FILE_BLOCK.sub("", GUIDE.read_text())
    for index, block in enumerate(PYTHON_BLOCK.finditer(loose)):
        (tmp_path / f"snippet_{index}.py").write_text(block["code"])
    done = subprocess.run(
        [*RUFF, "--select", "F", "--target-version", "py311", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_guides_servers_pass_the_kit_under_pytest(tmp_path: Path) -> None:
    """The guide's test files as a reader runs them: pytest with anyio's plugin, no options
    (the directory has no configuration of its own, so nothing is run for them)."""
    write_guide_files(tmp_path)
    run_the_guides_tests_under_pytest(sys.executable, tmp_path, dict(os.environ))


def test_the_guides_servers_pass_the_kit_alone(tmp_path: Path) -> None:
    write_guide_files(tmp_path)
    run_the_guides_tests_alone(sys.executable, tmp_path, dict(os.environ))


def test_the_object_kept_beside_the_runtime_fails_the_kit(tmp_path: Path) -> None:
    """The recipe's server without its snapshot hook (a session the cache lost starts afresh):
    the restored episodes lose what their sessions computed, and the kit says so."""
    write_guide_files(tmp_path)
    server = tmp_path / "object_server.py"
    code = server.read_text()
    assert code.count(SNAPSHOT_LOAD) == 1
    fresh = 'return CalculatorSession(state["snapshot"]["question"])'
    server.write_text(code.replace(SNAPSHOT_LOAD, fresh))
    done = run_in(sys.executable, tmp_path, dict(os.environ), "test_object_server.py")
    assert done.returncode != 0, done.stdout[-3000:]
    assert "[state.in-boundary] an episode continued after the crash" in done.stderr, done.stderr[
        -6000:
    ]


def test_the_sdk_installs_alone_and_runs_the_guides_server(tmp_path: Path) -> None:
    """The `rollout-protocol` wheel, built alone without warnings, installs into a fresh
    virtual environment with only its own dependencies, and the guide's server passes the kit
    there."""
    source = tmp_path / "protocol"
    shutil.copytree(ROOT / "protocol", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", str(source), "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert not re.findall(r"\w+Warning\b.*", built.stdout + built.stderr)
    (wheel,) = wheels.glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"rollout_protocol"}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"{wheel}[kit]",
            "pytest",
        ],
        check=True,
        timeout=300,
    )
    clean = {key: os.environ[key] for key in ("PATH", "HOME", "TMPDIR") if key in os.environ}
    probe = (
        "import importlib.util as u, rollout_protocol, rollout_protocol.serving, "
        "rollout_protocol.conformance\n"
        "print(rollout_protocol.__file__)\n"
        "print([m for m in ('rollout_servers', 'rollout_operator', 'kopf', 'kubernetes_asyncio') "
        "if u.find_spec(m)])"
    )
    shown = subprocess.run(
        [python, "-c", probe], env=clean, capture_output=True, text=True, timeout=60, check=True
    )
    where, others = shown.stdout.splitlines()
    assert where.startswith(str(venv)), where
    assert others == "[]", others

    files = tmp_path / "guide"
    files.mkdir()
    write_guide_files(files)
    run_the_guides_tests_under_pytest(python, files, clean)
    run_the_guides_tests_alone(python, files, clean)


def import_guide_server(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The guide's `minimal_server.py`, as printed, imported as the module `minimal_server` (in
    `sys.modules` for the test: FastAPI resolves its annotations there)."""
    write_guide_files(directory)
    spec = importlib.util.spec_from_file_location("minimal_server", directory / "minimal_server.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "minimal_server", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("rollout_id", "task", "detail"),
    [
        ("../x", {"question": "1+1?"}, "rollout_id: "),
        ("r" * 10_000, {"question": "1+1?"}, "rollout_id: "),
        ("r\x00x", {"question": "1+1?"}, "rollout_id: "),
        ("r-1", {"prompt": "1+1?"}, "task.question: a string is required"),
        ("r-1", {"question": None}, "task.question: a string is required"),
    ],
    ids=["dot-dot-slash", "10000-chars", "nul", "no-question", "null-question"],
)
async def test_the_guides_server_refuses_what_it_cannot_play_as_a_422(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    rollout_id: str,
    task: dict[str, Any],
    detail: str,
) -> None:
    """A careless or hostile `/run` to the guide's server as printed: the protocol's error body,
    422 `invalid_request` naming the field, never a bare 500 (which rollout-collect would
    re-issue under the next attempt); the model (an unreachable address) is never called."""
    server = import_guide_server(tmp_path, monkeypatch)
    token = "guide-token"
    settings = ControlSettings(
        Role.ENVIRONMENT, set_name="guide", checkpoint_root=tmp_path / "ck", token=token
    )
    app = server.build_app(settings, "http://127.0.0.1:9")
    async with serve_app(app, role=Role.ENVIRONMENT, token=token) as served:
        body = {"rollout_id": rollout_id, "attempt": 0, "task": task}
        reply = await served.client.post("/run", json=body, timeout=RUN_TIMEOUT_S)
    assert reply.status_code == 422, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["detail"].startswith(detail), error["detail"]
