"""training/accelerator.py without a Gaudi: the HPU branches against a stand-in for Habana's module, and the
CPU figures against the operating system's."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from training import accelerator
from training.accelerator import Accelerator


def _acc(name: str, hpu_lazy: bool) -> Accelerator:
    return Accelerator(name=name, backend=accelerator.SUPPORTED[name], device=torch.device("cpu"), device_name=name,
                       hpu_lazy=hpu_lazy)


class _Engine:
    def __init__(self):
        self.compiled = []

    def compile(self, **kwargs):
        self.compiled.append(kwargs)


def test_only_hpu_eager_mode_compiles_with_habanas_backend():
    for name, lazy, compiled in (("hpu", False, [{"backend": "hpu_backend"}]), ("hpu", True, []), ("cuda", False, []),
                                 ("cpu", False, [])):
        engine = _Engine()
        assert _acc(name, lazy).compile_engine(engine) == bool(compiled), (name, lazy)
        assert engine.compiled == compiled, (name, lazy)


def test_mark_step_runs_the_lazy_graph_only_in_lazy_mode(monkeypatch):
    calls = []
    core = types.ModuleType("habana_frameworks.torch.core")
    core.mark_step = lambda: calls.append("mark_step")
    for name in ("habana_frameworks", "habana_frameworks.torch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.core", core)
    sys.modules["habana_frameworks.torch"].core = core
    sys.modules["habana_frameworks"].torch = sys.modules["habana_frameworks.torch"]
    _acc("hpu", True).mark_step()
    assert calls == ["mark_step"]
    _acc("hpu", False).mark_step()
    _acc("cpu", False).mark_step()
    assert calls == ["mark_step"]


def test_cpu_peak_memory_is_in_bytes():
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, written, so resident
    peak = _acc("cpu", False).max_memory_bytes()
    with open("/proc/self/status") as f:
        hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert peak >= held.numel() and peak == pytest.approx(hwm_kib * 1024, rel=0.05)


def test_single_process_defaults_fill_only_what_a_launcher_left_unset(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # setenv first, so that monkeypatch removes what the function sets: delenv of an unset
        # variable records nothing to undo, and the values leaked into the rest of the session.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_PORT", "31234")
    accelerator.set_single_process_defaults()
    import os

    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "31234"}
