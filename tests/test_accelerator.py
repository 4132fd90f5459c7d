"""training/accelerator.py without a Gaudi: the HPU branches against a stand-in for Habana's module, and the
CPU figures against the operating system's."""

from __future__ import annotations

import re
import socket
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.conftest import clear_rendezvous
from training import accelerator
from training.accelerator import Accelerator, AcceleratorError


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


def test_manual_seed_seeds_the_device_generator_too(monkeypatch):
    """torch.manual_seed seeds CUDA's generators but not the HPU's: dropout on a Gaudi drew from an unseeded
    generator. The device's is seeded through DeepSpeed's accelerator wherever the device is not the CPU."""
    seeded = []
    ds_accelerator = types.ModuleType("deepspeed.accelerator")
    ds_accelerator.get_accelerator = lambda: types.SimpleNamespace(manual_seed=seeded.append)
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", ds_accelerator)
    with torch.random.fork_rng(devices=[]):
        for name, seed in (("hpu", 1234), ("cuda", 99), ("cpu", 77)):
            _acc(name, False).manual_seed(seed)
            assert torch.initial_seed() == seed, name
        assert seeded == [1234, 99]


def test_cpu_peak_memory_is_in_bytes():
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, written, so resident
    peak = _acc("cpu", False).max_memory_bytes()
    with open("/proc/self/status") as f:
        hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert peak >= held.numel() and peak == pytest.approx(hwm_kib * 1024, rel=0.05)


def _rendezvous() -> dict[str, str]:
    import os

    return {k: os.environ[k] for k in accelerator.RENDEZVOUS_VARIABLES if k in os.environ}


def test_single_process_defaults_fill_only_what_a_launcher_left_unset(monkeypatch):
    clear_rendezvous(monkeypatch)
    monkeypatch.setenv("MASTER_PORT", "31234")
    accelerator.set_single_process_defaults()
    assert _rendezvous() == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": "31234"}


def test_two_single_process_runs_get_free_ports_of_their_own(monkeypatch):
    """The default port had been 29500: a second plain `python run_pretraining.py` on the machine failed with
    torch's "address already in use"."""
    ports = []
    for _ in range(2):
        clear_rendezvous(monkeypatch)
        accelerator.set_single_process_defaults()
        ports.append(int(_rendezvous()["MASTER_PORT"]))
        with socket.socket() as s:
            s.bind(("127.0.0.1", ports[-1]))  # free
    assert _rendezvous()["RANK"] == "0" and len(set(ports)) == 2


@pytest.mark.parametrize("given", [{"WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
                                   {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}])
def test_a_launch_that_set_some_rendezvous_variables_must_set_them_all(monkeypatch, given):
    """A wrapper that forgot to map RANK (or LOCAL_RANK) had made this process rank 0 (or put it on device 0)."""
    clear_rendezvous(monkeypatch)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    missing = next(name for name in accelerator.RENDEZVOUS_VARIABLES if name not in given)
    shown = ", ".join(f"{name}={given[name]}" for name in accelerator.RENDEZVOUS_VARIABLES if name in given)
    with pytest.raises(AcceleratorError, match=re.escape(
            f"the launch set {shown} but not {missing}; a launcher sets all of RANK, LOCAL_RANK, WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT (torchrun, deepspeed and scripts/launch.sh do). Set the missing ones, or "
            "unset RANK and WORLD_SIZE to train as one process")):
        accelerator.set_single_process_defaults()
    assert _rendezvous() == given
    monkeypatch.setenv(missing, "0")
    accelerator.set_single_process_defaults()  # all five: left as they are
    assert _rendezvous() == given | {missing: "0"}


def _fake_habana(monkeypatch, is_lazy=None, device_name: str = "GAUDI2") -> list:
    """Stand-ins for the parts of Habana's bridge that setup() touches. is_lazy None: a bridge without
    habana_frameworks.torch.utils.internal.is_lazy. Returns the arguments get_device_name was called with."""
    names = []
    modules = {name: types.ModuleType(name) for name in ("habana_frameworks", "habana_frameworks.torch",
                                                         "habana_frameworks.torch.core",
                                                         "habana_frameworks.torch.utils")}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    if is_lazy is None:
        monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils.internal", None)  # import fails
    else:
        internal = types.ModuleType("habana_frameworks.torch.utils.internal")
        internal.is_lazy = lambda: is_lazy
        monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils.internal", internal)
    monkeypatch.setattr(accelerator, "_habana_installed", lambda: True)
    monkeypatch.setattr(torch, "hpu", types.SimpleNamespace(get_device_name=lambda *args: names.append(args)
                                                            or device_name), raising=False)
    return names


@pytest.mark.parametrize("is_lazy, variable, lazy", [
    (False, None, False),  # a release whose default is eager: the unset variable must not be read as lazy
    (True, None, True), (False, "0", False),
    # no is_lazy: the variable as the bridge reads it (lazy unless "0"), default 1 as in 1.18
    (None, None, True), (None, "1", True), (None, "0", False), (None, "true", True),
])
def test_hpu_lazy_mode_is_the_bridges(monkeypatch, is_lazy, variable, lazy):
    _fake_habana(monkeypatch, is_lazy)
    if variable is None:
        monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    else:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", variable)
    assert accelerator._hpu_lazy_mode() is lazy


def _setup_with(monkeypatch, accelerator_class, local_rank: int) -> tuple[Accelerator, list]:
    """accelerator.setup() on rank `local_rank` with DeepSpeed replaced by a stand-in whose accelerator is
    `accelerator_class`; returns the Accelerator and the calls made to the stand-in."""
    calls = []
    clear_rendezvous(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    ds_accelerator = types.ModuleType("deepspeed.accelerator")
    ds_accelerator.get_accelerator = lambda: accelerator_class(calls)
    ds = types.ModuleType("deepspeed")
    ds.accelerator = ds_accelerator
    ds.init_distributed = lambda dist_backend: calls.append(("init_distributed", dist_backend))
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", ds_accelerator)
    return accelerator.setup(), calls


def _fake_accelerator(real, backend: str):
    """A DeepSpeed accelerator stand-in whose device_name is DeepSpeed's own method of `real`."""

    class Fake:
        device_name = real.device_name

        def __init__(self, calls):
            self.calls = calls

        def set_device(self, index):
            self.calls.append(("set_device", index))

        def communication_backend_name(self):
            return backend

    return Fake


@pytest.mark.parametrize("local_rank", [0, 3])
def test_hpu_rank_uses_the_unindexed_device_deepspeed_uses(monkeypatch, local_rank):
    """On Gaudi a process owns one device, addressed as "hpu": the bridge rejects "hpu:<N>", and DeepSpeed's
    HPU accelerator (whose device_name is used here as is) names it without the index, so its engine puts the
    model on "hpu". The batches must go to the same device, on every local rank."""
    from deepspeed.accelerator.hpu_accelerator import HPU_Accelerator

    names = _fake_habana(monkeypatch, is_lazy=True)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    acc, calls = _setup_with(monkeypatch, _fake_accelerator(HPU_Accelerator, "hccl"), local_rank)
    assert acc.device == torch.device("hpu") and acc.device.index is None
    assert (acc.name, acc.backend, acc.device_name, acc.hpu_lazy) == ("hpu", "hccl", "GAUDI2", True)
    assert names == [()]  # the process's own device, not an index the bridge does not take
    assert calls == [("set_device", local_rank), ("init_distributed", "hccl")]


def test_cuda_rank_uses_its_local_gpu(monkeypatch):
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    monkeypatch.setattr(accelerator, "_habana_installed", lambda: False)
    names = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names.append(index) or "NVIDIA H100 80GB HBM3")
    acc, calls = _setup_with(monkeypatch, _fake_accelerator(CUDA_Accelerator, "nccl"), 3)
    assert acc.device == torch.device("cuda", 3)
    assert (acc.name, acc.backend, acc.device_name, acc.hpu_lazy) == ("cuda", "nccl", "NVIDIA H100 80GB HBM3", False)
    assert names == [3] and calls == [("set_device", 3), ("init_distributed", "nccl")]


def test_the_cpu_is_used_only_when_asked_for(monkeypatch):
    """DeepSpeed picks the CPU wherever it sees no Gaudi and no CUDA: a GPU node whose devices the process cannot
    see would train on the host's cores. Only DS_ACCELERATOR=cpu makes a CPU run."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(accelerator, "_habana_installed", lambda: False)
    for unset in (None, "cuda"):  # not set; set to another accelerator (a stand-in here that answers "cpu")
        if unset is None:
            monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        else:
            monkeypatch.setenv("DS_ACCELERATOR", unset)
        with pytest.raises(accelerator.AcceleratorError, match=r"^DeepSpeed found no Gaudi or CUDA device and chose "
                                                               r"the CPU\. To train on the CPU, set DS_ACCELERATOR=cpu\. "):
            _setup_with(monkeypatch, _fake_accelerator(CPU_Accelerator, "gloo"), 0)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    acc, calls = _setup_with(monkeypatch, _fake_accelerator(CPU_Accelerator, "gloo"), 0)
    assert (acc.name, acc.backend, acc.device) == ("cpu", "gloo", torch.device("cpu"))
    assert calls == [("init_distributed", "gloo")]


def test_leave_exits_with_the_code_after_flushing_and_runs_no_teardown(tmp_path):
    """leave() is how a distributed process ends (run_pretraining.py, the 2-rank workers): the code it is given,
    buffered output written, and no interpreter teardown (an atexit handler stands for it here)."""
    import subprocess

    script = ("import atexit, sys\n"
              "from training.accelerator import leave\n"
              "atexit.register(lambda: print('teardown ran'))\n"
              "print('to stdout', end='')\n"
              "sys.stderr.write('to stderr')\n"
              "leave(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "to stdout", "to stderr")
