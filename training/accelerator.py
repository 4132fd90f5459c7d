"""Device and process-group setup. Every HPU (Gaudi) and CUDA specific lives in this module.

DeepSpeed chooses the accelerator (`deepspeed.accelerator.get_accelerator()`): "hpu" with the
hccl backend on Gaudi, "cuda" with nccl on NVIDIA, "cpu" with gloo elsewhere. Only the CPU path
was run in this project; the HPU path follows Habana's documented PyTorch API:
- `import habana_frameworks.torch.core as htcore` registers the device;
- lazy mode (PT_HPU_LAZY_MODE=1) builds a graph that `htcore.mark_step()` executes, once after
  backward and once after the optimizer step;
- eager mode (PT_HPU_LAZY_MODE=0) gets its speed from `torch.compile(backend="hpu_backend")`;
- a process drives the one Gaudi the bridge assigned to it (module ID = local rank), addressed as
  `torch.device("hpu")`: the bridge takes no `hpu:<N>` index, so DeepSpeed's HPU accelerator names
  the device without one and its engine places the model there.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

SUPPORTED = {"hpu": "hccl", "cuda": "nccl", "cpu": "gloo"}  # accelerator -> expected backend


class AcceleratorError(RuntimeError):
    """DeepSpeed chose an accelerator this run does not take; the message says what to do."""


@dataclass
class Accelerator:
    name: str  # "hpu", "cuda" or "cpu"
    backend: str
    device: torch.device
    device_name: str  # marketing name used to look up peak FLOPs ("H100", "GAUDI2", "cpu")
    hpu_lazy: bool

    def mark_step(self) -> None:
        """Execute the accumulated lazy-mode graph (HPU lazy mode only; a no-op elsewhere)."""
        if self.hpu_lazy:
            import habana_frameworks.torch.core as htcore

            htcore.mark_step()

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and the device's (torch.manual_seed covers CUDA, not HPU)."""
        torch.manual_seed(seed)
        if self.name != "cpu":
            from deepspeed.accelerator import get_accelerator

            get_accelerator().manual_seed(seed)

    def compile_engine(self, engine) -> bool:
        """HPU eager mode runs the model through torch.compile with Habana's backend (DeepSpeed's
        `engine.compile` wraps the module in place). Returns whether it compiled."""
        if self.name == "hpu" and not self.hpu_lazy:
            engine.compile(backend="hpu_backend")
            return True
        return False

    def max_memory_bytes(self) -> int:
        """Peak device memory of this process (peak resident set size on CPU)."""
        if self.name == "cpu":
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        from deepspeed.accelerator import get_accelerator

        return int(get_accelerator().max_memory_allocated())


def leave(code: int) -> NoReturn:
    """End a distributed process with `code` once its process group is destroyed and its files are closed,
    skipping the interpreter's teardown (stdout and stderr are flushed first).

    Finished 2-rank CPU runs have aborted in that teardown, after their last collective and after every
    file was written ("terminate called without an active exception", exit -6: a C++ thread destroyed
    while joinable): about once in 15 full test runs, in run_pretraining.py on torchrun and in a
    benchmark's worker, never in 25 runs of the same worker alone. os._exit runs no C++ static
    destructors. Whether this is where it aborted is not proven: it never happened under observation."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def set_single_process_defaults() -> None:
    """Plain `python run_pretraining.py`, with neither RANK nor WORLD_SIZE set, is a one-rank job: give
    torch.distributed the variables a launcher would have set (otherwise DeepSpeed tries MPI discovery),
    with a free port, so that two such runs on one machine do not meet at a fixed one. A launch that set
    some of the variables must set them all: a missing RANK or LOCAL_RANK taken as 0 would make a second
    rank 0, or put a node's ranks on one device."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return
    missing = [name for name in RENDEZVOUS_VARIABLES if name not in os.environ]
    if missing:
        given = ", ".join(f"{name}={os.environ[name]}" for name in RENDEZVOUS_VARIABLES if name in os.environ)
        raise AcceleratorError(
            f"the launch set {given} but not {', '.join(missing)}; a launcher sets all of "
            f"{', '.join(RENDEZVOUS_VARIABLES)} (torchrun, deepspeed and scripts/launch.sh do). Set the missing "
            "ones, or unset RANK and WORLD_SIZE to train as one process")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the rendezvous of ranks started on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(local_rank: int | None = None) -> Accelerator:
    """Import the device runtime, set this rank's device and initialise the process group."""
    if local_rank is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank)
    set_single_process_defaults()
    hpu_lazy = False
    if _habana_installed():
        import habana_frameworks.torch.core  # noqa: F401  (registers the hpu device with torch)

        hpu_lazy = _hpu_lazy_mode()

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    name = acc.device_name()
    if name not in SUPPORTED:
        raise AcceleratorError(f"DeepSpeed selected accelerator {name!r}; this project supports "
                               f"{', '.join(SUPPORTED)}")
    # DeepSpeed falls back to the CPU wherever it finds neither Habana's bridge nor a working CUDA, with
    # one log line. A GPU or Gaudi node whose devices this process cannot see (a container started without
    # them, a driver mismatch, a CPU build of torch) would then train its 8 ranks on the host's cores.
    if name == "cpu" and os.environ.get("DS_ACCELERATOR") != "cpu":
        raise AcceleratorError(
            "DeepSpeed found no Gaudi or CUDA device and chose the CPU. To train on the CPU, set DS_ACCELERATOR=cpu. "
            "To train on Gaudi or NVIDIA GPUs, make the devices visible to this process (hl-smi or nvidia-smi in "
            "the same container; docker run --runtime=habana or --gpus all) and use the platform's torch build "
            "(python -c 'import torch; print(torch.__version__, torch.cuda.is_available())')")
    local = int(os.environ["LOCAL_RANK"])
    if name != "cpu":
        acc.set_device(local)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    # The device the DeepSpeed engine puts the model on (engine._set_distributed_vars): "cuda:<local>" on
    # NVIDIA, plain "hpu" on Gaudi, whose bridge rejects "hpu:<N>".
    device = torch.device(acc.device_name(local)) if name != "cpu" else torch.device("cpu")
    return Accelerator(name=name, backend=acc.communication_backend_name(), device=device,
                       device_name=_device_name(name, local), hpu_lazy=hpu_lazy and name == "hpu")


def _habana_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("habana_frameworks") is not None


def _hpu_lazy_mode() -> bool:
    """Whether Habana's bridge runs in lazy mode, asked of the bridge: `habana_frameworks.torch.utils.internal.
    is_lazy` is what the bridge's package import uses to pick its lazy or eager plugin, and what DeepSpeed's
    HPU FusedAdam asks (it is not in Habana's documented API). PT_HPU_LAZY_MODE's default differs between
    Gaudi releases (1 in the 1.19 runtime-flags table, 0 in the current one), so an unset variable does not
    tell. Without that function the variable is read as the 1.18 and 1.19 bridges read it (lazy unless "0");
    scripts/hpu_env.sh sets it (1 unless given), so that a launch never leaves it unset."""
    try:
        from habana_frameworks.torch.utils.internal import is_lazy
    except ImportError:
        return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"
    return bool(is_lazy())


def _device_name(name: str, local: int) -> str:
    if name == "cuda":
        return torch.cuda.get_device_name(local)
    if name == "hpu":
        return torch.hpu.get_device_name()  # this process's one Gaudi (no index on HPU, see above)
    return "cpu"
