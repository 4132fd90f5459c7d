"""Phase 2 from phase 1's optimizer moments (--init_optimizer_moments), as NVIDIA's and Habana's phase 2 start.

By default phase 2 starts its optimizer afresh, as Google's BERT does: the Adam moments of LAMB, LANS or
AdamW start at zero. NVIDIA's run_pretraining.py instead loads phase 1's optimizer state with its step
count set to 0, so the moments carry over and the bias correction starts again. This module does the
same for a phase-1 run of this project: it reads the moments (`exp_avg`, `exp_avg_sq`) of the tag that
phase 2 takes its weights from, joined by parameter name from phase 1's ZeRO partitions, whatever the
world size and precision phase 1 ran with, and gives each rank's optimizer its own slice, at step 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from training.checkpoint import LOAD_ERRORS, MODEL_STATES, CheckpointError, checkpoint_dir, find_resume
from training.weights import (
    checked_pieces,
    load_partitions,
    parameter_shapes,
    partition_files,
    partition_pieces,
)

MOMENTS = ("exp_avg", "exp_avg_sq")  # the Adam moments of Lamb, Lans and torch's AdamW


@dataclass(frozen=True)
class Phase1Moments:
    tag_dir: Path  # the phase-1 tag they come from
    pieces: dict[str, dict[str, list[torch.Tensor]]]  # moment -> parameter name -> pieces (memory-mapped views)
    shapes: dict[str, torch.Size]

    def fragment(self, moment: str, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of one parameter's flattened moment, in fp32. Only the pieces that
        hold them are read: a rank reads its slice of phase 1's moments, not all of them."""
        taken, position = [], 0
        for piece in checked_pieces(self.tag_dir, name, self.pieces[moment], self.shapes[name], f"{moment} values"):
            low, high = max(start, position), min(start + numel, position + piece.numel())
            if low < high:
                taken.append(piece[low - position:high - position])
            position += piece.numel()
        return torch.cat(taken)


def open_phase1_moments(init_dir: Path, optimizer: str) -> Phase1Moments:
    """The moments of the tag `init_dir`'s `latest` names: a run of this project that trained with
    `optimizer`. Their files are memory-mapped, not read; the caller checks the tag's CRC-32s (as the
    phase-2 weights are read from the same tag)."""
    ckpt_dir = checkpoint_dir(init_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(
            f"--init_optimizer_moments reads phase 1's optimizer moments from a run of this project (its "
            f"--output_dir, with {ckpt_dir.name}/ in it); {init_dir} is not one. A Hugging Face directory holds no "
            "optimizer state, and that of NVIDIA's or Habana's ckpt_<step>.pt or Habana's DeepSpeed folder is not "
            "read. Drop --init_optimizer_moments (scripts/launch.sh: --set init_optimizer_moments=false): the "
            "moments then start at zero")
    found = find_resume(ckpt_dir)
    if found is None:
        raise CheckpointError(f"--init_optimizer_moments: no checkpoint under {ckpt_dir}")
    tag, state = found
    tag_dir = ckpt_dir / tag
    then = state.identity.get("optimizer")
    if then != optimizer:
        raise CheckpointError(
            f"--init_optimizer_moments: {tag_dir} was trained with --optimizer {then}, whose moments are not "
            f"those of --optimizer {optimizer}. Pass --optimizer {then}, or drop --init_optimizer_moments")
    files = partition_files(tag_dir)
    if not files:
        raise CheckpointError(f"{tag_dir}: no ZeRO optimizer partitions (*zero_pp_rank_*_optim_states.pt), so no "
                              "optimizer moments to start from; drop --init_optimizer_moments")
    try:
        shapes = parameter_shapes(torch.load(tag_dir / MODEL_STATES, map_location="cpu", mmap=True,
                                             weights_only=False))
        partitions = load_partitions(files)
        pieces = {moment: partition_pieces(partitions, lambda path, opt_state, m=moment: _flats(path, opt_state, m))
                  for moment in MOMENTS}
    except CheckpointError:
        raise
    except (*LOAD_ERRORS, TypeError) as e:
        raise CheckpointError(f"{tag_dir}: cannot read its optimizer moments ({type(e).__name__}: {e}); the "
                              "checkpoint is damaged or was not written by this project") from e
    return Phase1Moments(tag_dir, pieces, shapes)


def _flats(path: Path, optimizer_state: dict, moment: str) -> list[torch.Tensor]:
    """One flat tensor of `moment` per parameter group, laid out as the rank's fp32 slice. ZeRO-1/2 and
    BF16_Optimizer both keep their client optimizer's state_dict, whose state is indexed by group (one
    flat tensor each)."""
    base = optimizer_state["base_optimizer_state"]
    groups = len(optimizer_state["param_slice_mappings"])
    flats = []
    for index in range(groups):
        values = base["state"].get(index, {}).get(moment)
        if not isinstance(values, torch.Tensor):
            raise CheckpointError(f"{path}: parameter group {index} has no '{moment}' in its optimizer state; "
                                  "the run took no step, or its optimizer keeps no Adam moments")
        flats.append(values)
    return flats


def set_phase1_moments(engine, moments: Phase1Moments) -> None:
    """Give the engine's client optimizer phase 1's moments for this rank's slice of every parameter, with
    its step count at 0 (the bias correction starts again). Call right after deepspeed.initialize, before
    any step: the client's state is still empty, and its first step finds it filled."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if isinstance(wrapper, BF16_Optimizer):
        lp_groups = wrapper.bf16_groups
    elif isinstance(wrapper, DeepSpeedZeroOptimizer):
        lp_groups = wrapper.bit16_groups
    else:
        raise TypeError(f"--init_optimizer_moments: DeepSpeed wrapped the optimizer in {type(wrapper).__name__}, "
                        "whose partition layout this script does not know; use ZeRO stage 1 or 2")
    client = wrapper.optimizer
    if client.state:
        raise RuntimeError("set_phase1_moments: the optimizer has already stepped; call it before the first step")
    names = {id(p): name for name, p in engine.module.named_parameters()}
    for group, lp_params in zip(client.param_groups, lp_groups, strict=True):
        (flat,) = group["params"]  # a ZeRO partition is one flat fp32 tensor per group
        state = {moment: torch.zeros_like(flat) for moment in MOMENTS}  # alignment padding stays 0
        for lp in lp_params:
            # DeepSpeed's link from a model parameter to its fragment in this rank's slice, which its
            # universal checkpoints load through; None where the parameter lies in other ranks' slices.
            mapping = lp._hp_mapping
            if mapping is None:
                continue
            target, source = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
            if target.numel != source.numel:
                raise RuntimeError(f"{names[id(lp)]}: DeepSpeed links {source.numel} elements of the parameter to "
                                   f"{target.numel} of the partition")
            for moment in MOMENTS:
                state[moment].narrow(0, target.start, target.numel).copy_(
                    moments.fragment(moment, names[id(lp)], source.start, source.numel))
        client.state[flat] = {"step": _step_zero(client), **state}


def _step_zero(client: torch.optim.Optimizer) -> int | torch.Tensor:
    """A step count of 0 in the type the optimizer keeps: torch's AdamW a float32 scalar tensor (on the host
    without `capturable` or `fused`, which build_optimizer leaves off), Lamb and Lans an int."""
    if isinstance(client, torch.optim.AdamW):
        return torch.tensor(0.0, dtype=torch.float32)
    return 0
