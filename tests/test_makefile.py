"""The README's two commands, `make demo` and `make test`, run through make with stand-in tools in a scratch venv:
what each one runs, in which order, with which environment and which of the user's arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _venv(tmp_path: Path, ruff_exit: int = 0) -> tuple[Path, Path]:
    """A venv whose python and ruff record their arguments and the environment the Makefile exports."""
    venv, record = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    for tool, code in (("python", 0), ("ruff", ruff_exit)):
        stub = venv / "bin" / tool
        stub.write_text(f'#!/usr/bin/env bash\necho "{tool} $* | $PWD | DS_ACCELERATOR=$DS_ACCELERATOR '
                        f'TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR" >> {record}\nexit {code}\n')
        stub.chmod(0o755)
    return venv, record


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # Not what the make running this test (`make test`) exports or passes on.
    base = {k: v for k, v in os.environ.items()
            if k not in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=base | (env or {}),
                          capture_output=True, text=True, timeout=60)


def _make_installed(venv: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # -o: the venv counts as installed, whatever the times of pyproject.toml and the stamp.
    return _make("-o", f"{venv}/.installed", f"VENV={venv}", *args, env=env)


def test_make_test_lints_then_runs_pytest_with_the_users_arguments(tmp_path: Path):
    venv, record = _venv(tmp_path)
    proc = _make_installed(venv, "test", "PYTEST_ARGS=-k lamb -x")
    assert proc.returncode == 0, proc.stderr
    exported = f"DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR={venv}/torch_extensions"
    assert record.read_text().splitlines() == [f"ruff check . | {ROOT} | {exported}",
                                                f"python -m pytest -k lamb -x | {ROOT} | {exported}"]


def test_a_lint_error_stops_make_test_before_pytest(tmp_path: Path):
    venv, record = _venv(tmp_path, ruff_exit=1)
    proc = _make_installed(venv, "test")
    assert proc.returncode != 0
    assert [line.split(" | ")[0] for line in record.read_text().splitlines()] == ["ruff check ."]


def test_make_demo_runs_the_demo_with_the_users_arguments_and_keeps_a_chosen_accelerator(tmp_path: Path):
    venv, record = _venv(tmp_path)
    extensions = tmp_path / "extensions"
    proc = _make_installed(venv, "demo", "DEMO_ARGS=--articles 160 --max_steps 32",
                 env={"DS_ACCELERATOR": "hpu", "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert proc.returncode == 0, proc.stderr
    assert record.read_text() == (f"python scripts/demo.py --articles 160 --max_steps 32 | {ROOT} | "
                                  f"DS_ACCELERATOR=hpu TORCH_EXTENSIONS_DIR={extensions}\n")


def test_make_venv_installs_the_project_editable_with_the_cpu_and_dev_extras(tmp_path: Path):
    """A dry run (-n) of a venv that is not installed yet: the checks, then pip, then the stamp."""
    venv = tmp_path / "venv"
    proc = _make("-n", f"VENV={venv}", "PYTHON=python3.11", "venv")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-3:] == [f"test -x {venv}/bin/python || python3.11 -m venv {venv}",
                          f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev]'",
                          f"touch {venv}/.installed"]
    assert any("command -v python3.11" in line for line in lines[:-3])
    assert any("Python.h" in line for line in lines[:-3]) and any("C++ compiler" in line for line in lines[:-3])


def test_make_clean_removes_the_venv_the_caches_and_the_demo_only(tmp_path: Path):
    venv = tmp_path / "venv"
    assert _make("-n", f"VENV={venv}", "clean").stdout == f"rm -rf {venv} .pytest_cache .ruff_cache results/demo\n"
