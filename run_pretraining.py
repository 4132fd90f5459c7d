"""Pretrain BERT (MLM + NSP) with DeepSpeed ZeRO-1 + BF16 on HPU, CUDA or CPU.

    deepspeed run_pretraining.py --deepspeed --deepspeed_config configs/deepspeed/zero1-bf16.json \\
        --input_dir <shards> --output_dir <run> --config_file configs/models/bert-large.json ...

`torchrun` and plain `python` (one process) work the same way. Rerunning the same command
resumes from `<output_dir>/checkpoints/latest` at the exact sample. See docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import faulthandler
import functools
import json
import math
import os
import re
import signal
import socket
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data import lockfile
from data.cli import HelpFormatter, file_in_the_way, given_options, plural
from data.stage import disk_error
from modeling import (
    IGNORE_INDEX,
    ActivationCheckpointing,
    BertConfig,
    BertForPreTraining,
    ConfigError,
    config_differences,
    count_parameters,
)
from training import accelerator as accel
from training import checkpoint
from training.atomic import atomic_copy, atomic_write_text, remove_stale_temporaries
from training.checkpoint import CheckpointError
from training.loader import (
    TOKENIZATION,
    DataConfigError,
    PretrainingDataset,
    RankSampler,
    batches_of,
    make_loader,
    open_split,
    raised_message,
    shard_vocab,
    tokenization_case,
)
from training.metrics import MetricsWriter, Throughput, peak_tflops
from training.moments import open_phase1_moments, set_phase1_moments
from training.planner import training_flops_per_sequence
from training.schedule import DECAY_STYLES, ScheduleConfig, ScheduleMismatchError, WarmupConstantDecay
from training.weights import check_resumed_vocab, load_initial_weights, set_fp32_masters

ROOT = Path(__file__).resolve().parent
DEFAULT_DS_CONFIG = ROOT / "configs" / "deepspeed" / "zero1-bf16.json"
OPTIMIZERS = ("lamb", "lans", "adamw")


class RunConfigError(ValueError):
    """Flags or a DeepSpeed JSON that cannot run; the message names the flag/field and the fix."""


class DivergedError(RuntimeError):
    """Too many consecutive micro batches with a non-finite loss, or optimizer steps with non-finite gradients."""


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TrainArgs:
    """One phase's settings: what train() takes and what the command line parses into. Each field is the
    flag of the same name (its help: `python run_pretraining.py --help`); the defaults here are the flags'.
    A TrainArgs is checked when it is made, so train() never starts on settings that cannot run."""

    input_dir: Path
    output_dir: Path
    config_file: Path
    max_steps: int
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    num_workers: int = 2
    optimizer: str = "lamb"
    learning_rate: float = 6e-3
    weight_decay: float = 0.01
    warmup_proportion: float = 0.2843
    constant_proportion: float = 0.0
    poly_power: float = 1.0
    lr_decay_style: str = "habana"
    seed: int = 12439
    checkpoint_activations: bool = False
    checkpoint_activations_interval: int = 1
    max_nonfinite_steps: int = 10
    phase2: bool = False
    init_checkpoint: Path | None = None
    init_optimizer_moments: bool = False
    num_steps_per_checkpoint: int = 200
    keep_checkpoints: int = 3
    steps_this_run: int | None = None
    log_freq: int = 10
    eval_freq: int = 0
    num_eval_samples: int = 1024
    deepspeed_config: Path = DEFAULT_DS_CONFIG
    local_rank: int | None = None

    def __post_init__(self) -> None:
        for name in PATH_FIELDS:  # a caller's str (or other path-like) taken as the Path the flags give
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(os.fspath(value)))
        check_args(self)


PATH_FIELDS = ("input_dir", "output_dir", "config_file", "init_checkpoint", "deepspeed_config")


# ----------------------------------------------------------------------------- command line

_BF16 = 'fp16 is not supported; bf16 is "bf16": {"enabled": true} in --deepspeed_config (the default)'
_RESUME = "rerunning the same command resumes from <output_dir>/checkpoints/latest; drop it"
_ALLREDUCE = ("DeepSpeed's ZeRO decides when gradients are reduced (stage 1: once per optimizer step, after the "
              "accumulation); drop it")
# Flags of NVIDIA's and Habana's run_pretraining.py that this script covers otherwise: refused with what
# to do instead, rather than argparse's bare "unrecognized arguments".
REFERENCE_FLAGS = {
    "--train_batch_size": 'the global batch is "train_batch_size" in --deepspeed_config (NVIDIA\'s --train_batch_size '
                          "is per GPU: DeepSpeed's train_batch_size is it times the number of GPUs)",
    "--gradient_accumulation_steps": 'set "train_batch_size" in --deepspeed_config: the accumulation steps '
                                     "follow from it, the micro batch and the world size",
    "--fp16": _BF16, "--amp": _BF16,
    "--loss_scale": "bf16 needs no loss scaling; drop it", "--init_loss_scale": "bf16 needs no loss scaling; drop it",
    "--allreduce_post_accumulation": _ALLREDUCE, "--allreduce_post_accumulation_fp16": _ALLREDUCE,
    "--resume_from_checkpoint": _RESUME, "--resume_step": _RESUME,
    "--phase1_end_step": "phase 2 is a run of its own (--phase2 --init_checkpoint <phase-1 --output_dir>, "
                         "another --output_dir) whose steps count from 0; drop it",
    "--do_train": "this script always trains; drop it",
    "--json-summary": "metrics are written to <output_dir>/metrics.jsonl and eval.jsonl; drop it",
    "--use_env": "LOCAL_RANK is read from the environment whenever it is set; drop it",
    "--bert_model": "the model is --config_file, the vocabulary the shards' vocab.txt; drop it",
    "--disable_progress_bar": "set TQDM_DISABLE=1 in the environment instead",
    "--scheduler_degree": "the decay exponent is --poly_power",
    "--use_lr_scheduler": "the schedule is always on (--warmup_proportion, --constant_proportion, --poly_power); "
                          "drop it",
    "--num_train_epochs": "the length of a phase is --max_steps",
    "--skip_checkpoint": "checkpoints are always saved, at least at the last step (a --num_steps_per_checkpoint "
                         "above --max_steps saves only that one)",
}


def check_reference_flags(argv: list[str]) -> None:
    given = dict.fromkeys(a.split("=", 1)[0] for a in argv if a.startswith("--"))
    found = [flag for flag in given if flag in REFERENCE_FLAGS]
    if found:
        raise RunConfigError("flag(s) of NVIDIA's or Habana's run_pretraining.py that this script does not take:\n"
                             + "\n".join(f"  {flag}: {REFERENCE_FLAGS[flag]}" for flag in found))


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    argv = sys.argv[1:] if argv is None else argv
    check_reference_flags(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("data and model")
    g.add_argument("--input_dir", type=Path, required=True,
                   help="shards, searched recursively: .hdf5 files in training/ or with the word training in their name "
                        "(wiki_training_0.hdf5) train; in test/ or with the word test, evaluate")
    g.add_argument("--output_dir", type=Path, required=True, help="checkpoints, metrics, TensorBoard, model_config.json, vocab.txt and tokenization.json")
    g.add_argument("--config_file", type=Path, required=True, help="model config JSON (configs/models/*.json)")
    g.add_argument("--max_seq_length", type=int, help="must equal the shards' sequence length")
    g.add_argument("--max_predictions_per_seq", type=int,
                   help="masked positions per sequence; must equal the shards' (static or dynamic masks)")
    g.add_argument("--num_workers", type=int,
                   help="training DataLoader worker processes per rank (evaluation reads in the rank's own process)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=int, required=True, help="optimizer steps in this phase")
    g.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="lamb (BERT recipe), lans (Gaudi BERT-1.5B recipe) or adamw")
    g.add_argument("--learning_rate", type=float, help="peak learning rate, reached after warm-up")
    g.add_argument("--weight_decay", type=float, help="not applied to biases and LayerNorm")
    g.add_argument("--warmup_proportion", type=float,
                   help="fraction of --max_steps with linear warm-up")
    g.add_argument("--constant_proportion", type=float,
                   help="fraction of --max_steps that holds the peak learning rate after the warm-up, as Habana's "
                        "flag (Gaudi 1.5B: 0.25, so the decay starts at 30%%)")
    g.add_argument("--poly_power", type=float,
                   help="decay exponent after warm-up/constant: 1 = linear (Gaudi 1.5B), 0.5 = NVIDIA BERT")
    g.add_argument("--lr_decay_style", choices=DECAY_STYLES,
                   help="habana: decay from the peak to 0 over the steps after warm-up/constant; nvidia: NVIDIA's "
                        "PolyWarmUpScheduler, peak x (1 - step/max_steps)^power after warm-up (a drop where the "
                        "warm-up ends), no constant phase")
    g.add_argument("--seed", type=int, help="weights, data order, masks and dropout")
    g.add_argument("--checkpoint_activations", action="store_true", help="recompute encoder activations in backward")
    g.add_argument("--checkpoint_activations_interval", type=int,
                   help="encoder layers per checkpointed segment, whose input alone is kept (with --checkpoint_activations)")
    g.add_argument("--max_nonfinite_steps", type=int,
                   help="stop after this many consecutive micro batches with a non-finite loss, or this many "
                        "consecutive optimizer steps with non-finite gradients")
    g = p.add_argument_group("phases and checkpoints")
    g.add_argument("--phase2", action="store_true",
                   help="start from --init_checkpoint's weights with a fresh optimizer and schedule (NVIDIA's flag; "
                        "their phase 2 keeps phase 1's optimizer moments, as --init_optimizer_moments does; "
                        "required with --init_checkpoint)")
    g.add_argument("--init_checkpoint", type=Path,
                   help="--output_dir of the phase-1 run, a Hugging Face BERT directory, NVIDIA's/Habana's "
                        "ckpt_<step>.pt (or its directory: the highest step; --config_file must match their "
                        "bert_config.json), or a DeepSpeed checkpoint folder of Habana's deepspeed-bert (the tag "
                        "its 'latest' names, or one tag's directory; --config_file must describe their model) "
                        "(with --phase2)")
    g.add_argument("--init_optimizer_moments", action="store_true",
                   help="with --phase2 from a run of this project: start from its optimizer moments (Adam m and v of "
                        "lamb, lans or adamw, the same --optimizer), with the step count at 0 so that the bias "
                        "correction starts again, as NVIDIA's and Habana's phase 2 do; without it the moments start "
                        "at zero, as in Google's BERT")
    g.add_argument("--num_steps_per_checkpoint", type=int,
                   help="save a checkpoint every N steps (and at the last step, or on SIGTERM/SIGINT)")
    g.add_argument("--keep_checkpoints", type=int, help="how many newest checkpoints to keep")
    g.add_argument("--steps_this_run", type=int,
                   help="train at most this many steps in this run, save a checkpoint and exit 0; the same "
                        "command continues (for jobs with a time limit). NVIDIA's and Habana's flag stops at that "
                        "step of the phase instead; here the steps count from this run's start")
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log_freq", type=int, help="log every N steps")
    g.add_argument("--eval_freq", type=int,
                   help="evaluate on the test shards every N steps (0: only at the end of the run)")
    g.add_argument("--num_eval_samples", type=int, help="test samples per evaluation (0: no evaluation)")
    g = p.add_argument_group("DeepSpeed")
    g.add_argument("--deepspeed", action="store_true", required=True,
                   help="required: this script runs on DeepSpeed (kept so DeepSpeed-style commands work as is)")
    g.add_argument("--deepspeed_config", type=Path,
                   help="DeepSpeed JSON: batch sizes, ZeRO, bf16 (no optimizer or scheduler section)")
    g.add_argument("--local_rank", type=int,
                   help="set by the deepspeed launcher; LOCAL_RANK in the environment wins")
    p.set_defaults(**{f.name: f.default for f in dataclasses.fields(TrainArgs) if f.default is not dataclasses.MISSING})
    parsed = vars(p.parse_args(argv))
    del parsed["deepspeed"]  # the required marker, which changes nothing
    args = TrainArgs(**parsed)
    if "checkpoint_activations_interval" in given_options(p, argv):  # given as 1, the default, too
        check_interval(args)
    return args


def check_interval(args: TrainArgs) -> None:
    if not args.checkpoint_activations:
        raise RunConfigError(f"--checkpoint_activations_interval {args.checkpoint_activations_interval} does nothing "
                             "without --checkpoint_activations; add it or drop the interval")


def check_args(args: TrainArgs) -> None:
    """Values that cannot run, named by their flag (TrainArgs calls it as it is made)."""
    if args.optimizer not in OPTIMIZERS:
        raise RunConfigError(f"--optimizer {args.optimizer!r}: pick one of {', '.join(OPTIMIZERS)}")
    if args.phase2 != (args.init_checkpoint is not None):
        raise RunConfigError("--phase2 and --init_checkpoint go together: phase 2 starts from the phase-1 "
                             "run given by --init_checkpoint")
    if args.init_optimizer_moments and not args.phase2:
        raise RunConfigError("--init_optimizer_moments starts phase 2 from phase 1's optimizer moments; it needs "
                             "--phase2 --init_checkpoint <phase-1 --output_dir>")
    check_output_dir(args.output_dir)
    if args.init_checkpoint is not None and args.init_checkpoint.resolve() == args.output_dir.resolve():
        raise RunConfigError("--init_checkpoint must be the phase-1 run, not this run's --output_dir")
    for name in ("max_steps", "num_steps_per_checkpoint", "keep_checkpoints", "log_freq", "max_nonfinite_steps",
                 "max_seq_length", "max_predictions_per_seq", "checkpoint_activations_interval"):
        if getattr(args, name) < 1:
            raise RunConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.checkpoint_activations_interval != 1:
        check_interval(args)
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise RunConfigError(f"--weight_decay must be a finite number >= 0, got {args.weight_decay}")
    if args.steps_this_run is not None and args.steps_this_run < 1:
        raise RunConfigError(f"--steps_this_run must be >= 1, got {args.steps_this_run}" +
                             ("; omit it to train to --max_steps (what -1 meant in NVIDIA's and Habana's scripts)"
                              if args.steps_this_run < 0 else ""))
    for name in ("eval_freq", "num_eval_samples", "num_workers", "seed"):
        if getattr(args, name) < 0:
            raise RunConfigError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.eval_freq and not args.num_eval_samples:
        raise RunConfigError(f"--eval_freq {args.eval_freq} with --num_eval_samples 0 evaluates nothing; "
                             "drop one of them")
    try:
        schedule_config(args)
    except ValueError as e:  # ScheduleConfig names the flag
        raise RunConfigError(str(e)) from e


def check_output_dir(path: Path) -> None:
    """Refuse a file where the run's directory, or one above it, would be: mkdir would fail only
    after the model and engine were built."""
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise RunConfigError(f"--output_dir {path}: {blocker} is a file, not a directory; pass a directory")


def schedule_config(args: TrainArgs) -> ScheduleConfig:
    return ScheduleConfig(base_lr=args.learning_rate, total_steps=args.max_steps,
                          warmup_proportion=args.warmup_proportion, constant_proportion=args.constant_proportion,
                          power=args.poly_power, decay_style=args.lr_decay_style)


# ----------------------------------------------------------------------------- DeepSpeed JSON


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int  # sequences per optimizer step, all ranks
    micro_batch: int  # sequences per forward, per rank
    grad_accum: int


def resolve_batch_sizes(ds_config: dict, world_size: int, source: str) -> BatchSizes:
    """DeepSpeed's rule train_batch_size = micro x accumulation x world size, with the missing
    one derived; a clear error when the numbers do not divide."""
    t = ds_config.get("train_batch_size")
    m = ds_config.get("train_micro_batch_size_per_gpu")
    g = ds_config.get("gradient_accumulation_steps")
    for name, value in (("train_batch_size", t), ("train_micro_batch_size_per_gpu", m),
                        ("gradient_accumulation_steps", g)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RunConfigError(f"{source}: '{name}' must be a positive integer, got {value!r}")
    hint = (f"train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"world size ({world_size})")
    if t is None and m is None:
        raise RunConfigError(f"{source}: set train_batch_size or train_micro_batch_size_per_gpu")
    if t is None:
        g = g or 1
        t = m * g * world_size
    elif m is None:
        g = g or 1
        if t % (g * world_size):
            raise RunConfigError(f"{source}: train_batch_size {t} is not divisible by gradient_accumulation_steps "
                                 f"{g} x world size {world_size}; {hint}")
        m = t // (g * world_size)
    elif g is None:
        if t % (m * world_size):
            raise RunConfigError(f"{source}: train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu "
                                 f"{m} x world size {world_size}; {hint}")
        g = t // (m * world_size)
    elif t != m * g * world_size:
        raise RunConfigError(f"{source}: train_batch_size {t} != {m} x {g} x {world_size}; {hint}. "
                             f"For {world_size} ranks use e.g. gradient_accumulation_steps "
                             f"{max(1, t // (m * world_size))} with train_batch_size "
                             f"{m * max(1, t // (m * world_size)) * world_size}")
    return BatchSizes(train_batch_size=t, micro_batch=m, grad_accum=g)


_SECTION_EXAMPLES = {"fp16": '"fp16": {"enabled": false}', "bf16": '"bf16": {"enabled": true}',
                     "data_types": '"data_types": {"grad_accum_dtype": "fp32"}'}
# The top-level keys DeepSpeed 0.19.8 reads: those its DeepSpeedConfig consults, and the sections other parts
# read. DeepSpeed ignores a key it does not know, so a misspelt one ("gradient_cliping") would run with the
# default; a key this close to one of these is refused (a key close to none may be a newer DeepSpeed's).
DEEPSPEED_KEYS = (
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger",
    "communication_data_type", "compile", "compression_training", "csv_monitor", "curriculum_learning",
    "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt", "disable_allgather",
    "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel", "flops_profiler", "fp16",
    "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor",
    "graph_harvesting", "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown", "nebula",
    "optimizer", "pipeline", "prescale_gradients", "progressive_layer_drop", "quantize_training", "scheduler",
    "seq_parallel_communication_data_type", "sparse_attention", "sparse_gradients", "steps_per_print",
    "tensor_parallel", "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
)


def load_ds_config(path: Path, world_size: int, optimizer: str) -> tuple[dict, BatchSizes]:
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise RunConfigError(f"--deepspeed_config {path}: cannot read it ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise RunConfigError(f"--deepspeed_config {path}: not valid JSON (line {e.lineno}: {e.msg})") from e
    if not isinstance(config, dict):
        raise RunConfigError(f"--deepspeed_config {path}: a JSON {type(config).__name__}, not an object; start from "
                             f"{DEFAULT_DS_CONFIG.relative_to(ROOT)}")
    for key in [key for key in config if key not in DEEPSPEED_KEYS]:  # in the file's order: the first is named
        # A known key cut short ("train_micro_batch_size") is as likely a slip as a misspelling.
        near = difflib.get_close_matches(key, DEEPSPEED_KEYS, n=1, cutoff=0.85) or \
            [known for known in DEEPSPEED_KEYS if len(key) >= 8 and known.startswith(key)][:1]
        if near:
            raise RunConfigError(f"{path}: '{key}' is not a DeepSpeed key, which DeepSpeed would ignore; did you mean "
                                 f"'{near[0]}'?")
    if config.get("managed_gradient_accumulation", True) is not True:
        # Then DeepSpeed takes every engine.step() as a boundary: one update per micro batch, the schedule
        # stepped as often, and a checkpoint whose schedule is ahead of its step.
        raise RunConfigError(f"{path}: remove 'managed_gradient_accumulation' "
                             f"({json.dumps(config['managed_gradient_accumulation'])}); this script lets DeepSpeed "
                             "decide where a step's gradient accumulation ends, and would otherwise update the "
                             "weights and the learning rate after every micro batch")
    if str(config.get("gradient_allreduce_op", "mean")).lower() != "mean":
        raise RunConfigError(f"{path}: remove 'gradient_allreduce_op' "
                             f"({json.dumps(config['gradient_allreduce_op'])}); a step's gradient is the mean over "
                             "its global batch, so that gradient_clipping and a resume on another world size mean "
                             "the same on any number of devices, while a sum grows with the world size")
    if "bfloat16" in config:  # DeepSpeed's older name, which the checks below would not see
        raise RunConfigError(f"{path}: rename 'bfloat16' to 'bf16': DeepSpeed still reads its old name, which this "
                             "script's checks do not")
    for key in ("fp16", "bf16", "data_types"):
        if not isinstance(config.get(key, {}), dict):
            raise RunConfigError(f"{path}: '{key}' must be an object, got {config[key]!r}; write e.g. "
                                 f"{_SECTION_EXAMPLES[key]}")
    for key in ("fp16", "bf16"):
        # DeepSpeed takes "false" (or "auto", as Hugging Face's configs write) for a boolean; these checks and
        # the checkpoint's record of the precision would read the string as true.
        enabled = config.get(key, {}).get("enabled", False)
        if not isinstance(enabled, bool):
            raise RunConfigError(f"{path}: {key}.enabled must be true or false, got {json.dumps(enabled)}; write "
                                 f"e.g. {_SECTION_EXAMPLES[key]}")
    for key, fix in (("optimizer", "this script builds it from --optimizer/--learning_rate"),
                     ("scheduler", "this script builds it from --warmup_proportion etc."),
                     ("activation_checkpointing", "DeepSpeed applies it only to models that call deepspeed."
                      "checkpointing, and this one would ignore it; use --checkpoint_activations "
                      "[--checkpoint_activations_interval N]")):
        if key in config:
            raise RunConfigError(f"{path}: remove the '{key}' section; {fix}")
    section = config.get("checkpoint", {})
    section = section if isinstance(section, dict) else {}
    engines = [key for key in ("datastates_ckpt", "nebula") if key in config] + \
        (["checkpoint.writer"] if "writer" in section else [])
    if engines:  # they write after save_checkpoint returns, or on other ranks, which the save's checks would miss
        raise RunConfigError(f"{path}: remove '{engines[0]}'; checkpoints are written by torch.save, checked (each "
                             "file's size and CRC32) and committed when the save returns")
    if "load_universal" in section:
        raise RunConfigError(f"{path}: remove 'checkpoint.load_universal'; this script sets it when a run resumes on "
                             "another world size, and it would read any other checkpoint wrongly")
    if config.get("fp16", {}).get("enabled"):
        raise RunConfigError(f"{path}: fp16 is not supported; use \"bf16\": {{\"enabled\": true}}")
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    # (1.0 is 1 to DeepSpeed too; "1" and true, which it also takes, are refused rather than guessed at)
    if isinstance(stage, bool) or not (isinstance(stage, int) or (isinstance(stage, float) and stage.is_integer())):
        raise RunConfigError(f"{path}: zero_optimization.stage must be an integer, got {json.dumps(stage)}; use "
                             "\"zero_optimization\": {\"stage\": 1}")
    # Checkpoints (one optimizer partition per rank) and layer-wise LAMB are built on ZeRO-1/2's layout;
    # other stages would train and then fail at the first checkpoint.
    if stage not in (1, 2):
        raise RunConfigError(f"{path}: zero_optimization.stage {stage} is not supported; use \"zero_optimization\": "
                             "{\"stage\": 1} (bf16 or fp32) or stage 2 (fp32)")
    if isinstance(zero, dict) and zero.get("round_robin_gradients"):
        raise RunConfigError(f"{path}: remove zero_optimization.round_robin_gradients; DeepSpeed's record of where "
                             "each parameter lies in the partitions is wrong under it, and a resume on another "
                             "world size and --init_optimizer_moments read that record (docs/LAMB.md, Limits)")
    if isinstance(zero, dict) and zero.get("elastic_checkpoint"):
        raise RunConfigError(f"{path}: remove zero_optimization.elastic_checkpoint; under fp32 ZeRO-1/2 it saves the "
                             "optimizer state as a list per parameter group, which phase 2's --init_optimizer_moments "
                             "does not read (bf16 ZeRO-1 ignores it), and a resume on another world size goes through "
                             "universal checkpoints here")
    if isinstance(zero, dict) and zero.get("compute_grad_norm") is False:
        raise RunConfigError(f"{path}: zero_optimization.compute_grad_norm false turns off DeepSpeed's check for "
                             "non-finite gradients in fp32, which would then reach the weights, and the logged "
                             "grad_norm; remove it")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    # DeepSpeed refuses a client optimizer under offload only inside deepspeed.initialize, and its message
    # advises an optimizer section, which this script refuses.
    if isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme") and \
            config.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise RunConfigError(f"{path}: zero_optimization.offload_optimizer takes only DeepSpeed's CPU optimizers "
                             f"unless \"zero_force_ds_cpu_optimizer\": false, and this script passes its own "
                             f"(--optimizer {optimizer}); add that field, or remove offload_optimizer")
    bf16 = config.get("bf16", {}).get("enabled")
    if bf16 and stage != 1:
        raise RunConfigError(f"{path}: bf16 needs zero_optimization.stage 1, got {stage}: only there does "
                             "DeepSpeed's BF16_Optimizer accumulate gradients in fp32")
    if bf16 and config.get("data_types", {}).get("grad_accum_dtype") != "fp32":
        raise RunConfigError(f"{path}: bf16 needs \"data_types\": {{\"grad_accum_dtype\": \"fp32\"}} so that "
                             "gradients accumulate in fp32 (bf16 accumulation loses small gradients)")
    # DeepSpeed accepts only its own list of optimizers under ZeRO (torch's Adam/AdamW among them)
    # and asserts deep inside deepspeed.initialize otherwise.
    if optimizer in ("lamb", "lans") and config.get("zero_allow_untested_optimizer") is not True:
        raise RunConfigError(f"{path}: --optimizer {optimizer} is this project's layer-wise optimizer, which DeepSpeed "
                             "runs under ZeRO only with \"zero_allow_untested_optimizer\": true; add it")
    gradient_clipping = config.get("gradient_clipping", 0.0)
    if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) or gradient_clipping < 0:
        raise RunConfigError(f"{path}: gradient_clipping must be a number >= 0 (0: no clipping), got "
                             f"{gradient_clipping!r}")
    sizes = resolve_batch_sizes(config, world_size, str(path))
    config.update(train_batch_size=sizes.train_batch_size, train_micro_batch_size_per_gpu=sizes.micro_batch,
                  gradient_accumulation_steps=sizes.grad_accum)
    problem = deepspeed_refusal(config, sizes)
    if problem:
        raise RunConfigError(f"{path}: {problem}")
    return config, sizes


# DeepSpeed's models of its sections, by the name a validation error gives, and their keys in the JSON.
_DEEPSPEED_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
                       "DeepSpeedFP16Config": "fp16", "CommsLoggerConfig": "comms_logger"}


def deepspeed_refusal(config: dict, sizes: BatchSizes) -> str | None:
    """What DeepSpeed's own config parser refuses in `config` (a field unknown inside a section, a value of the
    wrong type), or None. deepspeed.initialize would refuse it too, but after the model is built (minutes at
    1.5B) and as a traceback that names no file. The batch, already resolved, is given without train_batch_size,
    which the parser derives for the world size it sees (1 before the process group starts)."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    trial = {key: value for key, value in config.items() if key != "train_batch_size"}
    trial.update(train_micro_batch_size_per_gpu=sizes.micro_batch, gradient_accumulation_steps=sizes.grad_accum)
    try:
        DeepSpeedConfig(trial)
    except (DeepSpeedConfigError, AssertionError, TypeError, ValueError) as e:
        errors = getattr(e, "errors", None)  # pydantic's ValidationError, a ValueError
        if not callable(errors) or not errors():
            return f"DeepSpeed refuses it: {e}"
        error = errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        model = getattr(e, "title", "")  # pydantic 2 (DeepSpeed >= 0.14); older forks' pydantic 1 has none
        section = _DEEPSPEED_SECTIONS.get(model)
        where = f"{section}.{field}" if section else f"{field} ({model})" if model else field
        got = f" (got {error['input']!r})" if "input" in error else ""
        return f"DeepSpeed refuses '{where}': {error['msg']}{got}; correct or remove it"
    return None


def check_fp32_accumulation(engine) -> str:
    """bf16 runs must accumulate gradients in fp32 (DeepSpeed's BF16_Optimizer buffers). Returns
    the accumulation dtype's name."""
    _, accum = engine.get_data_types()
    if engine.bfloat16_enabled():
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        buffers = getattr(engine.optimizer, "fp32_groups_gradients_flat", None)
        if not isinstance(engine.optimizer, BF16_Optimizer) or buffers is None or \
                any(b.dtype != torch.float32 for b in buffers):
            raise RuntimeError(f"bf16 run without fp32 gradient accumulation (optimizer wrapper "
                               f"{type(engine.optimizer).__name__}); use ZeRO stage 1 with "
                               "data_types.grad_accum_dtype fp32")
        return "float32"
    return str(accum).removeprefix("torch.")


# ----------------------------------------------------------------------------- pieces of the loop


def build_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.Optimizer:
    from training.lamb import Lamb, Lans, build_param_groups

    groups = build_param_groups(model, args.weight_decay)
    if args.optimizer in ("lamb", "lans"):
        layerwise = Lamb if args.optimizer == "lamb" else Lans
        return layerwise(groups, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-6, weight_decay=args.weight_decay)
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-6,
                             weight_decay=args.weight_decay)


# What a shard recipe is recorded by (training.loader.ShardInfo fields)
_RECIPE_FIELDS = ("static_masks", "masked_lm_prob", "whole_word_masking", "lower_case")


def run_identity(args: TrainArgs, train_set, sizes: BatchSizes, config: BertConfig, bf16: bool) -> dict:
    """What a resumed run must share with its checkpoint, or it would not continue the same run:
    the optimizer (its state is loaded as is), the weight decay (the checkpoint's param groups
    keep theirs), the global batch (the schedule and learning rate were set for it; the
    accumulation steps adapt to the world size), the training shards (consumed_samples indexes
    their sample stream), the model config (initializer_range aside: the weights are loaded) and
    the precision (bf16 and fp32 checkpoints hold other optimizer partitions) and the masking budget (shards
    without static masks or attributes, NVIDIA-style, are masked with up to --max_predictions_per_seq). The shards
    are known by their paths, sample counts and recipe (static or dynamic masks, masked_lm_prob, whole-word
    masking, lower-casing: shards remade with another recipe have the same counts)."""
    recipe = sorted({tuple(getattr(s, name) for name in _RECIPE_FIELDS) for s in train_set.shards}, key=repr)
    return {"optimizer": args.optimizer, "weight_decay": args.weight_decay, "train_batch_size": sizes.train_batch_size,
            "max_predictions_per_seq": args.max_predictions_per_seq,
            "training_shards": [[Path(s.path).relative_to(args.input_dir).as_posix(), s.num_samples]
                                for s in train_set.shards],
            "shard_recipe": [dict(zip(_RECIPE_FIELDS, r)) for r in recipe],
            "model": {k: v for k, v in config.to_dict().items() if k != "initializer_range"}, "bf16": bf16}


# Recorded since 2026-11-24 (max_predictions_per_seq) and 2026-11-25 (shard_recipe): checkpoints saved before lack
# them, and their resumes are not checked for them.
_RECORDED_LATER = {"max_predictions_per_seq", "shard_recipe"}
# Model config fields added later, with the value a record saved before them means (the model it trained).
_MODEL_FIELDS_ADDED_LATER = {"layer_norm_large_model": False}


def check_resume_identity(tag_dir: Path, saved: dict, now: dict, input_dir: Path) -> None:
    if (set(now) - set(saved) - _RECORDED_LATER) | (set(saved) - set(now)):
        # Not damage (its files passed their checks): the code that wrote it recorded other things.
        raise RunConfigError(f"{tag_dir} was saved by another version of run_pretraining.py, which recorded "
                             f"{', '.join(sorted(saved))} for a resume to check, where this one checks "
                             f"{', '.join(sorted(now))}. Resume the run with the version that wrote it, or start a "
                             "new phase from its weights in another --output_dir with --phase2 --init_checkpoint")
    if saved["train_batch_size"] != now["train_batch_size"]:
        raise RunConfigError(
            f"{tag_dir} was trained with a global batch (train_batch_size) of {saved['train_batch_size']} sequences; "
            f"this launch makes {now['train_batch_size']}. Set \"train_batch_size\": {saved['train_batch_size']} in "
            "the DeepSpeed JSON, without gradient_accumulation_steps: the accumulation steps then adapt to the "
            "number of ranks")
    for flag in ("optimizer", "weight_decay", "max_predictions_per_seq"):
        if flag in saved and saved[flag] != now[flag]:
            raise RunConfigError(f"{tag_dir} was trained with --{flag} {saved[flag]}; resuming with --{flag} "
                                 f"{now[flag]} would not continue that run. Pass --{flag} {saved[flag]}, or use a "
                                 "new --output_dir (--phase2 --init_checkpoint starts from this run's weights)")
    new_phase = "or start a new phase in another --output_dir with --phase2 --init_checkpoint"
    if saved["bf16"] != now["bf16"]:
        then, this = ("bf16", "fp32") if saved["bf16"] else ("fp32", "bf16")
        raise RunConfigError(f"{tag_dir} was trained in {then}; this DeepSpeed JSON trains in {this}, whose optimizer "
                             f"partitions are laid out otherwise. Resume with a {then} DeepSpeed JSON (bf16.enabled "
                             f"{str(saved['bf16']).lower()}), {new_phase}")
    then_model = _MODEL_FIELDS_ADDED_LATER | saved["model"]
    if then_model != now["model"]:
        differ = config_differences(then_model, now["model"], sorted(set(then_model) | set(now["model"])))
        raise RunConfigError(f"{tag_dir} was trained with another model config ({'; '.join(differ)}). Resume with "
                             f"the run's config ({tag_dir.parent.parent / 'model_config.json'}), {new_phase}")
    old, new = saved["training_shards"], now["training_shards"]
    if old != new:
        first = next((f"{a[0]} ({a[1]} samples) is now {b[0]} ({b[1]} samples)" for a, b in zip(old, new) if a != b),
                     f"{len(old)} shards then, {len(new)} now")
        below = _common_parent(old, new)
        fix = (f"these are the same shards under {below}/: pass --input_dir {input_dir / below}" if below else
               "resume on the original shards, or train on these in a new --output_dir (--phase2 --init_checkpoint "
               "starts from this run's weights)")
        raise RunConfigError(
            f"{tag_dir} was trained on {sum(n for _, n in old)} samples in {len(old)} shards; --input_dir {input_dir} "
            f"now holds {sum(n for _, n in new)} in {len(new)} ({first}). consumed_samples would index another "
            f"sample stream: {fix}")
    if "shard_recipe" in saved and saved["shard_recipe"] != now["shard_recipe"]:
        raise RunConfigError(
            f"{tag_dir} was trained on shards made with {_recipe_text(saved['shard_recipe'])}; the shards in "
            f"--input_dir {input_dir} have the same paths and sample counts but were made with "
            f"{_recipe_text(now['shard_recipe'])}, so the samples consumed_samples indexes are others: resume on "
            "the original shards, or train on these in a new --output_dir (--phase2 --init_checkpoint starts from "
            "this run's weights)")


def _common_parent(old: list, new: list) -> str | None:
    """The directory that, put before every recorded shard path, gives the new ones (with the same counts): an
    --input_dir given above the run's."""
    if len(old) != len(new) or not old:
        return None
    parents = set()
    for (old_path, old_count), (new_path, new_count) in zip(old, new):
        if old_count != new_count or not new_path.endswith("/" + old_path):
            return None
        parents.add(new_path[: -len(old_path) - 1])
    return parents.pop() if len(parents) == 1 else None


def _recipe_text(recipe: list[dict]) -> str:
    return "; ".join(f"{'static' if r['static_masks'] else 'dynamic'} masks, masked_lm_prob {r['masked_lm_prob']}, "
                     f"whole_word_masking {str(r['whole_word_masking']).lower()}, lower_case "
                     f"{'unrecorded' if r['lower_case'] is None else str(r['lower_case']).lower()}" for r in recipe)


def check_resume_clipping(tag_dir: Path, saved_config: dict, clipping: float, ds_path: Path) -> None:
    """The checkpoint's gradient clipping must be this launch's (`clipping`, DeepSpeed's reading of the JSON): on
    the same world size DeepSpeed takes the checkpoint's value from the optimizer partitions over the JSON's,
    without a word (after a change of world size, the universal checkpoint keeps the JSON's)."""
    if not saved_config:  # DeepSpeed keeps the config it saved with in the model states; nothing to compare
        return
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    then = float(saved_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
    if then != clipping:
        raise RunConfigError(
            f"{tag_dir} was trained with \"gradient_clipping\": {then}; --deepspeed_config {ds_path} gives "
            f"{clipping}, which DeepSpeed would silently replace by the checkpoint's on the same number of ranks "
            f"(and use on another). Set \"gradient_clipping\": {then} to resume, or start a new phase in another "
            "--output_dir with --phase2 --init_checkpoint")


def micro_step_seed(seed: int, position: int, rank: int) -> int:
    """Dropout randomness as a function of (seed, stream position, rank): a resumed run draws
    the same masks as an uninterrupted one without saving generator states."""
    # Shifted as a Python int: NumPy 1.x, which pyproject admits (a platform image may ship it), has no uint64 >> int.
    return int(np.random.SeedSequence([seed, position, rank]).generate_state(1, np.uint64)[0]) >> 1


class StopRequest:
    """SIGTERM/SIGINT set a flag; the loop checks it (all ranks agree) and saves, then exits 0."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.signal = signum


class NonFiniteGuard:
    """Counts what non-finite values cost the run: micro batches whose loss is non-finite (dropped
    before backward) and optimizer steps whose gradients are (DeepSpeed skips the update). `limit`
    of either in a row stops the run."""

    _advice = "Resume from an earlier checkpoint with a lower --learning_rate or a longer --warmup_proportion"

    def __init__(self, limit: int, skipped_batches: int = 0, skipped_steps: int = 0):
        self.limit, self.skipped_batches, self.skipped_steps = limit, skipped_batches, skipped_steps
        self.batches_in_a_row, self.steps_in_a_row = 0, 0

    def batch_loss(self, finite: bool, step: int) -> None:
        """A micro batch of the step after `step` computed its loss."""
        if finite:
            self.batches_in_a_row = 0
            return
        self.skipped_batches += 1
        self.batches_in_a_row += 1
        if self.batches_in_a_row >= self.limit:
            raise DivergedError(
                f"{self.batches_in_a_row} micro batches in a row had a non-finite loss at step {step} "
                f"({self.skipped_batches} in total); the run has diverged. {self._advice}")

    def counts(self) -> tuple[int, int]:
        """(skipped_batches, skipped_steps), as a checkpoint records them."""
        return self.skipped_batches, self.skipped_steps

    def step_update(self, applied: bool, step: int) -> None:
        """The accumulation window after step `step` reached DeepSpeed's optimizer step."""
        if applied:
            self.steps_in_a_row = 0
            return
        self.skipped_steps += 1
        self.steps_in_a_row += 1
        if self.steps_in_a_row >= self.limit:
            raise DivergedError(
                f"{self.steps_in_a_row} optimizer steps in a row had non-finite gradients after step {step} "
                f"({self.skipped_steps} in total); DeepSpeed skipped their updates and the run has diverged. "
                f"{self._advice}")


def _model_inputs(batch: dict, device: torch.device, nsp: bool) -> dict:
    """The batch on the device; without an NSP head (next_sentence_prediction false) the shards'
    next-sentence labels are not used."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if nsp or k != "next_sentence_labels"}


def _losses(out) -> torch.Tensor:
    """[loss, mlm_loss, nsp_loss, mlm_accuracy] as float32 (nsp_loss 0 without an NSP head)."""
    nsp = out.nsp_loss.detach() if out.nsp_loss is not None else torch.zeros_like(out.mlm_loss)
    return torch.stack([out.loss.detach(), out.mlm_loss.detach(), nsp, out.mlm_accuracy.detach()]).float()


@dataclass
class StepResult:
    complete: bool  # False when a stop request ended the accumulation window early
    applied: bool  # DeepSpeed applied the update: False for an incomplete window or non-finite gradients
    stopped: bool
    consumed: int  # stream position after the micro batches read
    totals: torch.Tensor  # [loss, mlm_loss, nsp_loss, mlm_accuracy] summed over micro batches and ranks


class MicroBatches:
    """This rank's micro batches, each read one micro step ahead of its use, so that the micro step's all-reduce
    carries whether every rank has its next one. A shard error on one rank (a bad row only its batch holds)
    then stops every rank with that error where the batch is taken. Raised on that rank alone, it left the
    others waiting in their next collective until the transport saw the peer gone, or for the process group's
    timeout. A batch read ahead past the run's last step is never taken: its error fails nothing."""

    def __init__(self, batches: Iterator[dict], device: torch.device):
        self._batches, self._device = batches, device
        self._next: dict | None = None
        self._error: str | None = None
        self._first = True  # the run's first batch: read by take, before any all-reduce
        self._any_failed = False

    def _read(self) -> None:
        try:
            self._next, self._error = next(self._batches), None
        except DataConfigError as e:  # from a worker: torch's message around it, which main takes off
            self._next, self._error = None, str(e)

    def read_ahead(self) -> float:
        """Read the next batch; 1.0 for the micro step's all-reduce if that failed, else 0.0."""
        self._read()
        return 1.0 if self._error else 0.0

    def shared(self, any_failed: bool) -> None:
        """What the all-reduce said: whether any rank failed to read its batch ahead."""
        self._any_failed = any_failed

    def take(self) -> dict:
        """The batch read ahead. Collective for the run's first batch, and where a rank failed to read its
        batch: every rank then raises the first such rank's error."""
        if self._first:
            self._first = False
            self._read()
            failed = torch.tensor([1.0 if self._error else 0.0], device=self._device)
            dist.all_reduce(failed)
            self._any_failed = failed.item() > 0
        if self._any_failed:
            raise_shard_error(self._error)
        batch, self._next = self._next, None
        return batch


def raise_shard_error(error: str | None) -> NoReturn:
    """Collective, once an all-reduce has said that a rank could not read its batch: every rank raises the
    error of the first such rank (`error`: this rank's, None if it read its own)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    raise DataConfigError(next(e for e in errors if e))


def train_step(engine, batches: MicroBatches, consumed: int, sizes: BatchSizes, seed: int, guard: NonFiniteGuard,
               stop: StopRequest, acc: accel.Accelerator, step: int) -> StepResult:
    """One optimizer step: `grad_accum` accepted micro batches, then DeepSpeed's update.

    One all-reduce per micro batch carries a non-finite flag, the stop request, whether a rank failed
    to read its next micro batch (MicroBatches) and the four metrics. A micro batch that is non-finite
    on any rank is dropped on every rank before backward. DeepSpeed itself skips the update when the
    gradients' global norm is non-finite (every rank sees the same all-reduced norm): weights, optimizer
    state and lr schedule stay as they were."""
    rank, world = dist.get_rank(), dist.get_world_size()
    totals = torch.zeros(4, dtype=torch.float64)
    accepted, stopped = 0, False
    while accepted < sizes.grad_accum and not stopped:
        batch = batches.take()
        acc.manual_seed(micro_step_seed(seed, consumed, rank))
        consumed += sizes.micro_batch * world
        out = engine(**_model_inputs(batch, acc.device, engine.module.config.next_sentence_prediction))
        metrics = _losses(out)
        finite = torch.isfinite(metrics).all()
        # float32 on the wire (HPUs have no float64); one device-to-host copy per micro batch
        flags = torch.cat([(~finite).float().reshape(1),
                           torch.tensor([1.0 if stop.signal else 0.0], device=metrics.device),
                           torch.tensor([batches.read_ahead()], device=metrics.device),
                           torch.where(finite, metrics, torch.zeros_like(metrics))])
        dist.all_reduce(flags)
        flags = flags.cpu().double()
        stopped = flags[1].item() > 0
        batches.shared(flags[2].item() > 0)
        if flags[0].item() > 0:
            guard.batch_loss(False, step)
            continue
        guard.batch_loss(True, step)
        engine.backward(out.loss)
        acc.mark_step()
        try:
            engine.step()  # DeepSpeed applies the update at the accumulation boundary
        except AssertionError as e:
            if _bf16_norm_assertion(e):
                raise DivergedError(_unskipped_message(step, "stops at it with a bare assertion "
                                                             "(BF16_Optimizer: all_groups_norm > 0); nothing was "
                                                             "applied")) from e
            raise
        acc.mark_step()
        totals += flags[3:]
        accepted += 1
    complete = accepted == sizes.grad_accum
    applied = complete and engine.was_step_applied()
    if applied and not deepspeed_skips_nonfinite():
        check_applied_norm(engine.get_global_grad_norm(), step)
    return StepResult(complete, applied, stopped, consumed, totals)


@functools.cache
def deepspeed_skips_nonfinite() -> bool:
    """DeepSpeed 0.19.8 skips an update whose gradient norm is not finite, in bf16 (BF16_Optimizer) and fp32
    ZeRO-1/2 alike; 0.16.1 to 0.19.7 do not (tests/test_train_run.py's non-finite tests, run against each,
    2026-11-25). Where it skips, an applied update had a finite norm, and reading the norm back after the
    step would only add a device sync to every step. Habana's forks report e.g. 0.16.1+hpu.synapse.v1.20.0."""
    import deepspeed

    found = re.match(r"(\d+)\.(\d+)\.(\d+)", deepspeed.__version__)
    return found is not None and tuple(int(n) for n in found.groups()) >= (0, 19, 8)


def _unskipped_message(step: int, what: str) -> str:
    import deepspeed

    return (f"step {step + 1}: the gradient norm is not finite, and DeepSpeed {deepspeed.__version__} {what}. "
            "DeepSpeed 0.19.8 skips such an update, and this script then takes the step again on the next samples "
            "(docs/TRAINING.md, Guards). This run stops before any checkpoint holds the step: resume "
            "from the last one, with DeepSpeed 0.19.8 or later where the platform allows, or start a new phase "
            "from it with a lower --learning_rate")


def _bf16_norm_assertion(e: AssertionError) -> bool:
    """Whether `e` is BF16_Optimizer's `assert all_groups_norm > 0.` of DeepSpeed before 0.19.8, which a
    non-finite gradient norm (NaN > 0 is false) trips before anything is applied."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and Path(frames[-1].filename).name == "bf16_optimizer.py"


def check_applied_norm(grad_norm: float | None, step: int) -> None:
    """After an update DeepSpeed applied: a non-finite gradient norm means its values reached the weights
    (DeepSpeed before 0.19.8 in fp32), so the run must stop before a checkpoint saves them. DeepSpeed's norm
    helpers report a non-finite norm as inf, NaN or, in some releases, -1."""
    if grad_norm is not None and not (math.isfinite(float(grad_norm)) and float(grad_norm) >= 0):
        raise DivergedError(_unskipped_message(step, "applied the update anyway: the weights now hold "
                                                     "non-finite or meaningless values"))


def eval_sums(out, inputs: dict) -> torch.Tensor:
    """A batch's [MLM loss summed over its masked tokens, MLM hits, masked tokens, NSP loss summed over its
    sequences, NSP hits, sequences], as float64 on the CPU (NSP terms 0 without an NSP head)."""
    labels = inputs["masked_lm_labels"].long().reshape(-1)
    logits = out.mlm_logits.float().reshape(-1, out.mlm_logits.shape[-1])
    valid = labels != IGNORE_INDEX
    n = inputs["input_ids"].shape[0]
    sums = [F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"),
            ((logits.argmax(-1) == labels) & valid).sum(), valid.sum()]
    if out.nsp_logits is None:
        sums += [torch.zeros((), device=logits.device)] * 2
    else:
        nsp_labels = inputs["next_sentence_labels"].long().reshape(-1)
        sums += [F.cross_entropy(out.nsp_logits.float(), nsp_labels, reduction="sum"),
                 (out.nsp_logits.argmax(-1) == nsp_labels).sum()]
    sums.append(torch.tensor(n, device=logits.device))
    return torch.stack([x.float() for x in sums]).cpu().double()


def eval_record(sums: torch.Tensor, nsp: bool) -> dict:
    """Per masked token (MLM) and per sequence (NSP) over the whole evaluation, as NVIDIA's BERT reports
    them; a mean of per-batch means would weigh a batch of few masked tokens like one of many."""
    mlm_loss_sum, mlm_hits, masked, nsp_loss_sum, nsp_hits, n = sums.tolist()
    record = {"mlm_loss": mlm_loss_sum / masked, "mlm_accuracy": mlm_hits / masked}
    if nsp:
        record |= {"nsp_loss": nsp_loss_sum / n, "nsp_accuracy": nsp_hits / n}
    loss = record["mlm_loss"] + record.get("nsp_loss", 0.0)
    return {"loss": loss, **record, "samples": int(n), "masked_tokens": int(masked)}


def evaluate(engine, dataset: PretrainingDataset, sizes: BatchSizes, acc: accel.Accelerator) -> dict:
    """Losses and accuracies over the first --num_eval_samples test samples, the test set at most: the
    positions before the set's stream_end (open_data). All ranks; `eval_record`."""
    assert dataset.stream_end is not None
    sampler = RankSampler(0, sizes.micro_batch, dist.get_rank(), dist.get_world_size(), limit=dataset.stream_end)
    nsp = engine.module.config.next_sentence_prediction
    sums = torch.zeros(6, dtype=torch.float64)
    error = None  # a shard error stops this rank's reading; the all-reduce tells the others (MicroBatches)
    engine.eval()
    with torch.no_grad():
        try:
            for batch in make_loader(dataset, sampler, sizes.micro_batch, num_workers=0):
                inputs = _model_inputs(batch, acc.device, nsp)
                sums += eval_sums(engine(**inputs), inputs)
                acc.mark_step()
        except DataConfigError as e:
            error = str(e)
    engine.train()
    # float32 on the wire: HPUs have no float64 (the counts stay exact below 2^24)
    sums = torch.cat([sums, torch.tensor([1.0 if error else 0.0], dtype=torch.float64)]).float().to(acc.device)
    dist.all_reduce(sums)
    sums = sums.cpu().double()
    if sums[6].item() > 0:
        raise_shard_error(error)
    return eval_record(sums[:6], nsp)


RUN_LOCK = ".run.lock"


@contextlib.contextmanager
def lock_output_dir(output_dir: Path) -> Iterator[None]:
    """Collective. Rank 0 holds an exclusive lock on <output_dir>/.run.lock while the run lasts: a second
    run on the same --output_dir (a job requeued while the first still runs) would save into the same
    checkpoints and logs, the two timelines interleaved. Released however the block ends, so a second
    train() in the same process (a notebook, a test) can take it again (see `data.lockfile`)."""
    lock, error = (_try_lock(output_dir / RUN_LOCK) if dist.get_rank() == 0 else (None, None))
    errors = [error]
    dist.broadcast_object_list(errors, src=0)
    if errors[0]:
        raise RunConfigError(errors[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release(remove=False)


def _try_lock(path: Path) -> tuple[lockfile.Held | None, str | None]:
    """The lock, or the error that another run holds it. Its file stays after the run (TRAINING.md lists it
    among the directory's files): only a lock on it counts, so a file a killed run left holds nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return lockfile.acquire(path), None
    except lockfile.Busy as exc:
        return None, (f"--output_dir {path.parent} is in use by another run ({exc.record or 'another process'}, "
                      f"holding {path}); wait for it to end, or pass another --output_dir")
    except lockfile.NoLocks as exc:  # Lustre mounted without -o flock, say
        print(f"warning: cannot lock {path} ({exc.strerror}); make sure no other run uses this --output_dir",
              file=sys.stderr)
        return None, None
    except OSError as exc:  # returned, not raised: the other ranks wait for it in lock_output_dir's broadcast
        return None, (f"cannot lock {exc.filename or path} ({exc.strerror}); make --output_dir {path.parent} writable "
                      "(or free space there), or pass another --output_dir")


def write_run_files(output_dir: Path, vocab: Path | None, config: BertConfig, lower_case: bool | None) -> None:
    """What export_hf needs beside the checkpoints: the model config, a copy of the shards' vocabulary (`vocab`,
    training.loader.shard_vocab) and, when the shards say it (`lower_case`), whether their text was lower-cased."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in ("model_config.json", "run_info.json", "starts.jsonl", "vocab.txt", TOKENIZATION):
        remove_stale_temporaries(output_dir / name)  # a killed run's
    config.to_json_file(output_dir / "model_config.json")
    if vocab is not None:
        atomic_copy(vocab, output_dir / "vocab.txt")
    if lower_case is None:  # shards that do not say: the export infers it from the vocab
        (output_dir / TOKENIZATION).unlink(missing_ok=True)
    else:
        atomic_write_text(output_dir / TOKENIZATION, json.dumps({"lower_case": lower_case}) + "\n")


def record_start(output_dir: Path, info: dict, ds_config: dict) -> None:
    """Append this start to <output_dir>/starts.jsonl: run_info.json and launch.sh's copy of the DeepSpeed
    config describe only the latest start, and a resume may run with another world size or config."""
    path = output_dir / "starts.jsonl"
    earlier = path.read_text(encoding="utf-8") if path.is_file() else ""
    if earlier and not earlier.endswith("\n"):
        earlier += "\n"
    record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
              "argv": sys.argv, **info, "deepspeed_config": ds_config}
    atomic_write_text(path, earlier + json.dumps(record) + "\n")


def shard_dirs(dataset, input_dir: Path) -> str:
    """The directories that hold a split's shards, relative to --input_dir: more than one when it lies above
    several datasets, which are then all read."""
    dirs = sorted({str(Path(s.path).parent.relative_to(input_dir)) for s in dataset.shards})
    shown = ", ".join(d if d != "." else str(input_dir) for d in dirs[:3])
    return shown + (f" and {len(dirs) - 3} more directories" if len(dirs) > 3 else "")


def start_lines(info: dict, args: TrainArgs, train_set, eval_set, vocab: Path | None) -> list[str]:
    """What this start runs, for the console: ranks, batch, model, data (`vocab`: the shards' vocabulary, if
    any), where it starts."""
    world = plural(info["world_size"], "rank")
    precision = (f"bf16 with fp32 master weights and {info['grad_accum_dtype']} gradient accumulation"
                 if info["bf16"] else "fp32")
    checkpointing = (f"every {plural(info['activation_checkpointing_interval'], 'layer')}"
                     if info["activation_checkpointing"] else "off")
    # NVIDIA's LAMB adapts only the groups that decay (build_param_groups): without weight decay it is Adam.
    as_adam = " (no group decays at --weight_decay 0, so no trust ratio: Adam's update)" if (
        info["optimizer"] == "lamb" and args.weight_decay == 0) else ""
    lines = [
        f"run: {world} on {info['accelerator']} ({info['backend']}), ZeRO-{info['zero_stage']}, {precision}, "
        f"optimizer {info['optimizer']}{as_adam}",
        f"batch: {info['train_batch_size']} sequences per step = {info['micro_batch']} per micro batch x "
        f"{plural(info['gradient_accumulation_steps'], 'accumulation step')} x {world}",
        f"model: {info['parameters'] / 1e6:.1f}M parameters ({args.config_file}), activation checkpointing "
        f"{checkpointing}",
        f"training data: {len(train_set):,} sequences of {args.max_seq_length} tokens in "
        f"{plural(len(train_set.shards), 'shard')} under {shard_dirs(train_set, args.input_dir)}, "
        f"{'static masks' if train_set.shards[0].static_masks else 'masked at load time'}",
    ]
    lines.append(f"vocabulary: {vocab}" if vocab is not None else
                 f"vocabulary: none in {args.input_dir}, so the run keeps none (scripts/export_hf.py will need "
                 "--vocab_file) and a phase 2 cannot compare it with its own")
    if eval_set is not None:
        when = f"every {plural(args.eval_freq, 'step')} and at the end" if args.eval_freq else "at the end"
        lines.append(f"test data: {len(eval_set):,} sequences in {plural(len(eval_set.shards), 'shard')} under "
                     f"{shard_dirs(eval_set, args.input_dir)}; the first "
                     f"{min(args.num_eval_samples, len(eval_set)):,} evaluated {when}")
    total = args.max_steps * info["train_batch_size"]
    epochs = total / len(train_set)
    start = (f"start: step {info['start_step']} of {args.max_steps} ({total:,} sequences, "
             f"{f'{epochs:.3g}' if epochs < 1000 else f'{epochs:,.0f}'} epochs of the training data)")
    if info["resumed_from"]:
        start += f", resumed from {info['resumed_from']} at sequence {info['start_consumed_samples']:,}"
        if info["resumed_world_size"] != info["world_size"]:
            start += f" of a {info['resumed_world_size']}-rank run"
    elif info["init_checkpoint"]:
        start += f", weights from {info['init_checkpoint']}"
        if info["init_optimizer_moments"]:
            start += " with its optimizer moments (step count 0)"
    return [*lines, start]


# ----------------------------------------------------------------------------- the run


def open_data(args: TrainArgs, vocab_size: int) -> tuple[PretrainingDataset, PretrainingDataset | None]:
    """The training set and, when the run evaluates, the test set of --input_dir."""
    train_set = open_split(args.input_dir, "training", args.max_seq_length, args.max_predictions_per_seq,
                           vocab_size, args.seed, shuffle=True)
    if train_set is None:
        raise DataConfigError(f"--input_dir {args.input_dir}: no training shards found under it (.hdf5 files in a "
                              "training/ directory or named like wikicorpus_en_training_0.hdf5)")
    eval_set = None
    if args.num_eval_samples:
        # Each evaluation reads the first --num_eval_samples positions, the test set once at most (`evaluate`):
        # no shard past them is read ahead.
        eval_set = open_split(args.input_dir, "test", args.max_seq_length, args.max_predictions_per_seq,
                              vocab_size, args.seed, shuffle=False, eval_samples=args.num_eval_samples)
    if args.num_eval_samples and eval_set is None:
        when = f"every {args.eval_freq} steps" if args.eval_freq else "at the end of the run"
        raise DataConfigError(f"--num_eval_samples {args.num_eval_samples} evaluates {when}, but there are no test "
                              f"shards under --input_dir {args.input_dir} (.hdf5 files in a test/ directory or "
                              "named like wikicorpus_en_test_0.hdf5); add them, or pass --num_eval_samples 0 "
                              "to train without evaluation")
    return train_set, eval_set


def train(args: TrainArgs) -> dict:
    """One phase of pretraining. Returns what the run started with (the `info` rank 0 writes to
    <output_dir>/run_info.json at the start) and how it ended: final step, stopped by a signal, paused, skips."""
    acc = accel.setup(args.local_rank)
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config, sizes = load_ds_config(args.deepspeed_config, world, args.optimizer)
    config = BertConfig.from_json_file(args.config_file)
    if args.max_seq_length > config.max_position_embeddings:
        raise RunConfigError(f"--max_seq_length {args.max_seq_length} exceeds max_position_embeddings "
                             f"{config.max_position_embeddings} of {args.config_file}")
    train_set, eval_set = open_data(args, config.vocab_size)
    lower_case = tokenization_case(train_set, eval_set)
    vocab = shard_vocab(args.input_dir)  # copied into the run, compared with a phase-2 start's, named at the start
    identity = run_identity(args, train_set, sizes, config, bool(ds_config.get("bf16", {}).get("enabled")))

    with lock_output_dir(args.output_dir):
        ckpt_dir = checkpoint.checkpoint_dir(args.output_dir)
        resume = checkpoint.resume_point(ckpt_dir)
        if resume is not None and resume[1].seed != args.seed:
            raise RunConfigError(f"{ckpt_dir / resume[0]} was trained with --seed {resume[1].seed}; resuming with "
                                 f"--seed {args.seed} would change the data order. Pass --seed {resume[1].seed}")
        if resume is not None:
            check_resume_identity(ckpt_dir / resume[0], resume[1].identity, identity, args.input_dir)
            check_resumed_vocab(args.output_dir / "vocab.txt", vocab)
        # A finished run's rerun trains nothing: on another world size it needs the weights (for a
        # missing final evaluation), not the optimizer partitions, so no universal conversion. (A
        # --max_steps below the checkpoint's step takes the full load, whose schedule check refuses it.)
        finished = resume is not None and resume[1].step == args.max_steps
        module_only = finished and resume[1].world_size != world
        if resume is not None and resume[1].world_size != world and not finished:
            ds_config.setdefault("checkpoint", {})["load_universal"] = True

        torch.manual_seed(args.seed)  # identical initial weights on every rank
        checkpointing = ActivationCheckpointing(args.checkpoint_activations, args.checkpoint_activations_interval)
        model = BertForPreTraining(config, checkpointing=checkpointing)
        init_from, moments = None, None
        if args.phase2 and resume is None:
            if args.init_optimizer_moments:  # refused here, before any weight is read, if it cannot be done
                moments = open_phase1_moments(args.init_checkpoint, args.optimizer)
            init_from = load_initial_weights(model, args.init_checkpoint, vocab, lower_case)
            if moments is not None and init_from != str(moments.tag_dir):
                raise CheckpointError(f"--init_checkpoint {args.init_checkpoint}: its latest checkpoint moved from "
                                      f"{moments.tag_dir.name} to {Path(init_from).name} as phase 2 started; is "
                                      "phase 1 still running? Start phase 2 once it has finished")
        # A bf16 engine replaces each parameter's data by a bf16 copy; these references keep the fp32
        # values (no copy is made) for the fp32 master weights of a run that does not resume.
        fp32_start = None if resume is not None else {name: p.data for name, p in model.named_parameters()}
        schedule_cfg = schedule_config(args)
        engine, _, _, scheduler = deepspeed.initialize(
            model=model, optimizer=build_optimizer(model, args), config=ds_config,
            lr_scheduler=lambda opt: WarmupConstantDecay(opt, schedule_cfg))
        if fp32_start is not None and engine.bfloat16_enabled():
            set_fp32_masters(engine, fp32_start)
        del fp32_start
        if args.optimizer in ("lamb", "lans"):
            from training.lamb import bind_to_deepspeed

            bind_to_deepspeed(engine)
        if moments is not None:
            set_phase1_moments(engine, moments)
            del moments  # its memory maps of phase 1's partitions
        accum_dtype = check_fp32_accumulation(engine)
        compiled = acc.compile_engine(engine)

        step, consumed, skipped_batches, skipped_steps = 0, 0, 0, 0
        if resume is not None:
            tag, state = resume
            checkpoint.verify_checksums(ckpt_dir, tag, state, module_only=module_only)
            if state.world_size != world and not module_only:
                tag = checkpoint.universal_tag(ckpt_dir, tag)
            saved_config = checkpoint.load(engine, ckpt_dir, tag, module_only=module_only)
            if not module_only:
                check_resume_clipping(ckpt_dir / resume[0], saved_config, float(engine.gradient_clipping()),
                                      args.deepspeed_config)
            step, consumed = state.step, state.consumed_samples
            skipped_batches, skipped_steps = state.skipped_batches, state.skipped_steps
            if not module_only and scheduler.step_count != step:
                raise CheckpointError(f"{ckpt_dir / tag}: lr schedule is at step {scheduler.step_count} but the run "
                                      f"state says {step}; the checkpoint is inconsistent")
        if rank == 0:
            write_run_files(args.output_dir, vocab, config, lower_case)

        info = {
            "world_size": world, "accelerator": acc.name, "backend": acc.backend, "device_name": acc.device_name,
            "train_batch_size": sizes.train_batch_size, "micro_batch": sizes.micro_batch,
            "gradient_accumulation_steps": sizes.grad_accum, "zero_stage": engine.zero_optimization_stage(),
            "bf16": engine.bfloat16_enabled(), "grad_accum_dtype": accum_dtype, "compiled": compiled,
            "activation_checkpointing": model.checkpointing.enabled,
            "activation_checkpointing_interval": model.checkpointing.interval if model.checkpointing.enabled else None,
            "optimizer": args.optimizer, "optimizer_wrapper": type(engine.optimizer).__name__,
            "parameters": count_parameters(model), "resumed_from": resume[0] if resume else None,
            "resumed_world_size": resume[1].world_size if resume else None, "init_checkpoint": init_from,
            "init_optimizer_moments": args.init_optimizer_moments and init_from is not None,
            "start_step": step, "start_consumed_samples": consumed,
        }
        if rank == 0:
            atomic_write_text(args.output_dir / "run_info.json", json.dumps(info, indent=1) + "\n")
            record_start(args.output_dir, info, ds_config)

        stop = StopRequest()
        guard = NonFiniteGuard(args.max_nonfinite_steps, skipped_batches, skipped_steps)
        flops_per_seq = training_flops_per_sequence(config, args.max_seq_length, args.max_predictions_per_seq)
        peak = peak_tflops(acc.device_name, "bf16" if engine.bfloat16_enabled() else "fp32")
        writer = MetricsWriter(args.output_dir, args.max_steps, step, enabled=rank == 0)
        for line in start_lines(info, args, train_set, eval_set, vocab):
            writer.note(line)
        meter = Throughput(warmup=2)
        last_saved = step
        consumed_at_step = consumed  # stream position at the end of the last complete window
        skipped_at_step = guard.counts()  # and the guard's counts up to it
        start_step = step
        stopped = paused = False

        loader = make_loader(train_set, RankSampler(consumed, sizes.micro_batch, rank, world), sizes.micro_batch,
                             args.num_workers, pin_memory=acc.name == "cuda")
        batches = MicroBatches(batches_of(loader), acc.device)
        engine.train()
        try:
            while step < args.max_steps:
                lr = scheduler.get_last_lr()[0]
                result = train_step(engine, batches, consumed, sizes, args.seed, guard, stop, acc, step)
                consumed, stopped = result.consumed, result.stopped
                if not result.complete:  # stopped mid-window: the partial gradients are never applied
                    break
                meter.update(sizes.train_batch_size)
                guard.step_update(result.applied, step)
                consumed_at_step, skipped_at_step = consumed, guard.counts()
                if not result.applied:
                    # Non-finite gradients: DeepSpeed left weights and schedule as they were, so the
                    # next window takes this step again; its samples stay consumed.
                    writer.note(f"step {step + 1}: the gradient norm is not finite, so DeepSpeed skipped the update "
                                f"on every rank; the next {sizes.train_batch_size} samples take the step again "
                                f"({guard.steps_in_a_row} in a row, {guard.skipped_steps} in total)")
                    if stopped:
                        break
                    continue
                step += 1
                writer.advance(step)
                if step % args.log_freq == 0 or step == args.max_steps:
                    mean = (result.totals / (sizes.grad_accum * world)).tolist()
                    seq_per_s = meter.take()
                    tflops = None if seq_per_s is None else flops_per_seq * seq_per_s / world / 1e12
                    grad_norm = engine.get_global_grad_norm()
                    writer.log({
                        "step": step, "loss": mean[0], "mlm_loss": mean[1], "nsp_loss": mean[2],
                        "mlm_accuracy": mean[3], "lr": lr,
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        "seq_per_s": seq_per_s,
                        "tokens_per_s": None if seq_per_s is None else seq_per_s * args.max_seq_length,
                        "tflops_per_device": tflops,
                        "mfu": None if tflops is None or peak is None else tflops / peak,
                        "peak_memory_bytes": acc.max_memory_bytes(),
                        "consumed_samples": consumed, "skipped_batches": guard.skipped_batches,
                        "skipped_steps": guard.skipped_steps,
                    })
                # Evaluation and checkpoints stay out of the throughput window: it measures training.
                if eval_set is not None and args.eval_freq and step % args.eval_freq == 0 and step < args.max_steps:
                    with meter.excluded():
                        writer.log({"step": step, **evaluate(engine, eval_set, sizes, acc)}, prefix="eval")
                if step % args.num_steps_per_checkpoint == 0 or step == args.max_steps:
                    with meter.excluded():
                        checkpoint.save(engine, ckpt_dir, step, consumed, args.seed, guard.counts(), identity,
                                        args.keep_checkpoints)
                    last_saved = step
                if stopped:
                    break
                if args.steps_this_run and step - start_step >= args.steps_this_run and step < args.max_steps:
                    paused = True
                    break
            if stopped or paused:
                # Preempted, or this run's steps done: keep everything up to the last complete step. The
                # samples of a partial window are read again on resume, as an uninterrupted run reads them.
                if step != last_saved:
                    checkpoint.save(engine, ckpt_dir, step, consumed_at_step, args.seed, skipped_at_step, identity,
                                    args.keep_checkpoints)
                saved = (f"checkpoint {checkpoint.tag_for(step)} is saved; rerun the command to resume" if step
                         else "no step had completed, so nothing was saved; rerun the command to start")
                # through the bar, which is still open: printed directly, the line was glued to its end
                why = (f"stop requested (signal {stop.signal or 'on another rank'})" if stopped
                       else f"--steps_this_run {args.steps_this_run} done")
                writer.note(f"{why} at step {step} of {args.max_steps}: {saved}", file=sys.stderr)
            elif eval_set is not None and (step > start_step or final_evaluation_missing(writer, step)):
                writer.log({"step": step, **evaluate(engine, eval_set, sizes, acc)}, prefix="eval")
        finally:
            writer.close()
        return {**info, "rank": rank, "final_step": step, "stopped_by_signal": stopped, "paused": paused,
                "skipped_batches": guard.skipped_batches, "skipped_steps": guard.skipped_steps}


def final_evaluation_missing(writer: MetricsWriter, step: int) -> bool:
    """Collective. A finished run's rerun trains and evaluates nothing, unless the run was stopped
    (killed, or by a signal) after its final checkpoint and before its final evaluation."""
    missing = [writer.enabled and not writer.evaluated(step)]
    dist.broadcast_object_list(missing, src=0)
    return bool(missing[0])


USER_ERRORS = (RunConfigError, DataConfigError, CheckpointError, ConfigError, ScheduleMismatchError,
               DivergedError, accel.AcceleratorError)


def main(argv: list[str] | None = None) -> int:
    output_dir = None
    try:
        args = parse_args(argv)
        output_dir = args.output_dir
        summary = train(args)
        # Every rank past its last collective before any of them tears gloo down: a rank whose peer
        # had already closed its connections once aborted at exit ("terminate called without an
        # active exception") after a finished run.
        dist.barrier()
    except USER_ERRORS as e:  # a shard's from a DataLoader worker too, whose traceback torch adds to it
        print(f"error: {raised_message(e)}", file=sys.stderr)
        return 1
    except OSError as e:  # metrics, run_info.json, starts.jsonl: rank 0's files (checkpoints: CheckpointError)
        print(f"{disk_error(e, output_dir)} (from its last checkpoint)", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary["rank"] == 0 and not (summary["stopped_by_signal"] or summary["paused"]):
        print(f"done: step {summary['final_step']} of {args.max_steps}", file=sys.stderr)
    return 0


def script() -> None:
    """The command: main(), then accel.leave, also after an unexpected error (its traceback printed, exit 1).
    Left to the interpreter, such an error hung the rank for good: multiprocessing's exit handler stops
    the DataLoader workers with SIGTERM, which they ignore (training.loader._worker_init: a Ctrl-C or
    a scheduler's SIGTERM to every process must leave them to the main process), then waits for them."""
    # A rank killed by a fatal signal (a segfault in a kernel, an abort in a C++ thread) prints the
    # Python stack of each of its threads, which its launcher's log otherwise lacks.
    faulthandler.enable()
    try:
        code = main()
    except Exception:  # noqa: BLE001 (any error: its traceback printed, then exit 1 past the workers)
        traceback.print_exc()
        code = 1
    accel.leave(code)


if __name__ == "__main__":
    script()
