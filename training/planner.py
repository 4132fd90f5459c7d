"""Capacity planner: will a BERT pretraining run fit on a device, and how long will it take?

    python -m training.planner --config_file configs/models/bert-1.5b.json --device gaudi \\
        --devices 128 --zero_stage 1 --micro_batch 16 --seq_len 128 --checkpoint_activations --precision bf16

Everything is computed from the model config and the structure of `modeling.BertForPreTraining`:

- parameters: counted exactly on the meta device, and by a closed form (`parameter_count_formula`);
- model states per device by ZeRO stage, as DeepSpeed allocates them for mixed precision (bf16
  ZeRO-1: BF16_Optimizer's unpartitioned fp32 gradient buffer beside the bf16 gradients; ZeRO-2/3:
  the ZeRO optimizer's fp32 gradient partition), fp32 master weights and Adam moments;
- activations: the bytes each module saves for backward, per layer, with and without activation
  checkpointing, and the transient memory at the two peaks of a training step (start of backward,
  optimizer step);
- FLOPs per sequence (matrix multiplies; the sparse MLM head decodes only the masked positions),
  time to train N sequences at a given MFU, and the MFU a measured throughput implies.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from data.cli import HelpFormatter, positive_int
from modeling import BertConfig, BertForPreTraining, count_parameters

GiB = 1024**3


# ----------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Device:
    """Peak dense matrix throughput (TFLOP/s) by dtype and memory of one accelerator.

    `attention` is how `F.scaled_dot_product_attention` runs there: "fused" (flash-style kernels that
    keep only the output and a log-sum-exp for backward) or "composed" (modeling.py's CPU path with
    attention dropout: matmul, softmax, dropout, matmul, each saving its [batch, heads, seq, seq]
    tensor in the compute dtype). `mask_bytes` is the size of one saved dropout-mask element.
    """

    name: str
    memory_bytes: int
    peak_tflops: dict[str, float] = field(default_factory=dict)
    attention: str = "fused"
    mask_bytes: int = 1


# Memory is the datasheet's "GB" read as 10^9 bytes. Some of these cards have that many GiB (an A100 80GB
# has 80 GiB), so the verdict errs on the safe side by up to 7%; --device_memory gives the exact figure.
DEVICES: dict[str, Device] = {
    # Gaudi 1/2/3: Intel, "Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference",
    # Hot Chips 2024 (R. Kaplan), product table: peak BF16 60 / 432 / 1835 TFLOPs, HBM 32 / 96 / 128 GB.
    # The fp32 figures are not in that table and are left out rather than guessed.
    # On HPU, SDPA with dropout maps to Habana's fused SDPA kernel (no seq x seq tensor kept).
    "gaudi": Device("gaudi", 32 * 10**9, {"bf16": 60.0}),
    "gaudi2": Device("gaudi2", 96 * 10**9, {"bf16": 432.0}),
    "gaudi3": Device("gaudi3", 128 * 10**9, {"bf16": 1835.0}),
    # NVIDIA A100 SXM4 80GB datasheet: BF16 tensor core 312 TFLOPS dense (624 with sparsity),
    # TF32 156 dense, FP32 19.5; 80 GB HBM2e.
    "a100": Device("a100", 80 * 10**9, {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # NVIDIA H100 SXM5 datasheet: BF16 989 TFLOPS dense (1979 with sparsity), TF32 494.5 dense,
    # FP32 67; 80 GB HBM3.
    "h100": Device("h100", 80 * 10**9, {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA H100 PCIe datasheet: BF16 1,513 TFLOPS with sparsity (756 dense), TF32 756 with sparsity
    # (378 dense), FP32 51; 80 GB HBM2e. torch names it "NVIDIA H100 PCIe".
    "h100-pcie": Device("h100-pcie", 80 * 10**9, {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    # NVIDIA H200 SXM datasheet: same tensor cores as H100 SXM (BF16 989 dense), 141 GB HBM3e.
    "h200": Device("h200", 141 * 10**9, {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    # This machine class: no meaningful peak; memory comes from --device_memory. With attention
    # dropout, modeling.py composes attention from plain operators on CPU, and CPU dropout saves its
    # mask in the input dtype; mask_bytes=0 means "the compute dtype" (see activation_bytes).
    "cpu": Device("cpu", 0, {}, attention="composed", mask_bytes=0),
}

_ALIASES = {"gaudi1": "gaudi", "dl1": "gaudi", "hl-205": "gaudi", "a100-80gb": "a100", "h100-sxm": "h100"}


def get_device(name: str) -> Device:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]


def device_peak_tflops(device_name: str, dtype: str) -> float | None:
    """Peak dense TFLOP/s of one device model (a DEVICES key or alias, any case) for a dtype
    ("bf16"/"bfloat16", "fp32"/"float32", "tf32"); None for an unknown device model (e.g. a
    backend name such as "cuda" or "hpu") or a dtype without a published peak."""
    key = _ALIASES.get(device_name.lower(), device_name.lower())
    device = DEVICES.get(key)
    if device is None:
        return None
    dtype = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float32": "fp32", "torch.float32": "fp32"}.get(dtype, dtype)
    return device.peak_tflops.get(dtype)


# ----------------------------------------------------------------------------- parameters


def count_parameters_exact(config: BertConfig) -> int:
    """Build the real model on the meta device (no memory, no init cost) and count its parameters."""
    import torch

    with torch.device("meta"):
        model = BertForPreTraining(config)
    return count_parameters(model)


def parameter_count_formula(config: BertConfig) -> int:
    """The same count in closed form; tests check it equals `count_parameters_exact`."""
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    v = config.padded_vocab_size
    embeddings = (v + config.max_position_embeddings + config.type_vocab_size) * h
    embeddings += 0 if config.pre_layer_norm else 2 * h  # embedding LayerNorm (post-LN only)
    # q, k, v, attention output (4 h x h + bias), two FFN matrices with biases, two LayerNorms.
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    final_ln = 2 * h if config.pre_layer_norm else 0
    head = (h * h + h) + 2 * h + v  # transform dense + LayerNorm + decoder bias (decoder weight is tied)
    nsp = (h * h + h) + (2 * h + 2) if config.next_sentence_prediction else 0  # pooler + classifier
    return embeddings + L * layer + final_ln + head + nsp


# ----------------------------------------------------------------------------- memory

PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device. `peak` is the larger of the two high-water marks of a step."""

    parameters: int
    weights: int
    gradients: int
    optimizer_states: int
    activations: int  # saved for backward over the whole forward
    activations_without_checkpointing: int
    activations_with_checkpointing: int
    transient: int  # backward working memory on top of `activations` at the backward peak
    buffers: int  # gradient reduction: the ZeRO optimizer's bucket, or BF16_Optimizer's all-reduce transient
    backward_peak: int
    step_peak: int

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.optimizer_states

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.step_peak)


def default_max_predictions(seq_len: int) -> int:
    """BERT's recipe: 20 predictions at seq 128, 80 at seq 512 (15% masking, rounded up)."""
    return max(1, math.ceil(seq_len * 0.15625))


def decay_parameter_count(config: BertConfig) -> int:
    """Parameters of the weight-decay group of `training.lamb.build_param_groups` (every weight that is not
    a bias or a LayerNorm parameter: the embedding tables and the matrices), in closed form; the other
    group holds the rest. Tests check it against the groups built from the real model."""
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    embeddings = (config.padded_vocab_size + config.max_position_embeddings + config.type_vocab_size) * h
    nsp = h * h + 2 * h if config.next_sentence_prediction else 0  # pooler and classifier weights
    return embeddings + L * (4 * h * h + 2 * h * i) + h * h + nsp  # + the MLM head's transform


def uses_bf16_optimizer(precision: str, zero_stage: int) -> bool:
    """DeepSpeed wraps the optimizer in its BF16_Optimizer for bf16 weights with fp32 gradient accumulation
    under ZeRO-1 (`DeepSpeedEngine._do_optimizer_sanity_check`); run_pretraining.py requires fp32
    accumulation in bf16 (`data_types.grad_accum_dtype`), so every bf16 ZeRO-1 run here gets it."""
    return precision == "bf16" and zero_stage == 1


def model_state_bytes(parameters: int, precision: str, zero_stage: int, devices: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) per device for Adam-family optimizers under DeepSpeed.

    bf16 with ZeRO-1 is DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py): 2 bytes of bf16
    weights; 2 of bf16 gradients plus 4 of one fp32 gradient buffer over the whole model (allocated at
    start-up, not partitioned: every rank accumulates and all-reduces every gradient there); and 12
    partitioned bytes of optimizer state (fp32 master weights and two moments). Other bf16 stages follow
    DeepSpeed's `estimate_zero2_model_states_mem_needs`: 2 bytes of 16-bit weights, 2 of 16-bit
    gradients, and 4 (fp32 gradient partition) + 4 (fp32 master weights) + 8 (two Adam moments) of
    optimizer state. In fp32, DeepSpeed's ZeRO optimizer still keeps its own fp32 partition of the
    weights and of the gradients (measured by benchmarks/bench_zero.py), so stages 1-3 hold the same 16
    bytes of optimizer state; stage 0 means plain PyTorch (Adam's moments only).
    ZeRO-1 partitions the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if uses_bf16_optimizer(precision, zero_stage):
        w_bytes, g_bytes, opt_bytes = 2, 2 + 4, 4 + 8
    else:
        w_bytes, g_bytes, opt_bytes = (2, 2, 4 + 4 + 8) if precision == "bf16" else (4, 4, 8 if zero_stage == 0 else 16)

    def share(n_bytes: int, partitioned: bool) -> int:
        total = parameters * n_bytes
        return math.ceil(total / devices) if partitioned else total

    return share(w_bytes, zero_stage >= 3), share(g_bytes, zero_stage >= 2), share(opt_bytes, zero_stage >= 1)


# DeepSpeed's engine all-reduces BF16_Optimizer's fp32 gradient buffers in buckets of this many elements
# (`deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE`); zero_optimization.reduce_bucket_size does not apply.
BF16_ALLREDUCE_BUCKET_ELEMENTS = 500_000_000


def bf16_allreduce_bytes(config: BertConfig, parameters: int) -> int:
    """The transient of BF16_Optimizer's gradient all-reduce at the end of backward: the engine walks the
    fp32 buffers of the two parameter groups (weight decay first) and reduces a bucket once it holds more
    than BF16_ALLREDUCE_BUCKET_ELEMENTS; a bucket of two buffers is first concatenated (an fp32 copy), and
    every bucket is cast to bf16 (the default communication dtype) for the collective."""
    decay = decay_parameter_count(config)
    buckets, bucket = [], []
    for numel in (decay, parameters - decay):
        bucket.append(numel)
        if sum(bucket) > BF16_ALLREDUCE_BUCKET_ELEMENTS:
            buckets.append(bucket)
            bucket = []
    if bucket:
        buckets.append(bucket)
    return max((4 * sum(b) if len(b) > 1 else 0) + 2 * sum(b) for b in buckets)


@dataclass(frozen=True)
class Activations:
    """Bytes for one micro batch: what the forward saves for backward, and the working memory of the
    two backward phases that can set the peak."""

    saved: int  # everything saved for backward at the end of the forward
    head_saved: int  # the part of `saved` the MLM head holds (freed once the head's backward ran)
    loss_transient: int  # start of backward: gradients of the log-softmax output and input
    recompute: int  # activation checkpointing: one segment recomputed during backward (0 without)


def activation_bytes(
    config: BertConfig, micro_batch: int, seq_len: int, max_predictions: int, precision: str, device: Device,
    checkpoint_activations: bool, checkpoint_interval: int = 1,
) -> Activations:
    """Activation memory of one micro batch, counted tensor by tensor from what modeling.py's modules
    save for backward (checked against `torch.autograd.graph.saved_tensors_hooks` in the tests):

    per layer, [tokens, hidden] tensors: the layer input, q, k, v, the attention context, two LayerNorm
    inputs and one LayerNorm output (or the pre-LN equivalents), two dropout masks; two
    [tokens, intermediate] tensors (GELU input and output); LayerNorm mean/rstd. "Composed" attention
    keeps q, k, v, the probabilities, the dropout mask and the dropped probabilities
    (3 x [batch, heads, seq, seq]); "fused" keeps the output and a [batch, heads, seq] fp32 log-sum-exp.
    With checkpointing, each segment of `checkpoint_interval` layers keeps only its input (two with
    layer_norm_large_model: the layer input and the residual stream), and one segment is recomputed at a time
    during backward. Habana's pre-LN block (layer_norm_large_model) saves as much as post-LN without checkpointing.
    """
    e = 2 if precision == "bf16" else 4
    m = device.mask_bytes or e
    b, s, h, i = micro_batch, seq_len, config.hidden_size, config.intermediate_size
    a, L, v = config.num_attention_heads, config.num_hidden_layers, config.vocab_size
    tokens = b * s
    n = b * max_predictions  # rows decoded by the sparse MLM head
    stats = 4  # LayerNorm mean and rstd: fp32 on accelerators (bf16 on CPU: a negligible difference)

    # Without attention dropout, modeling.py runs SDPA on CPU too, whose flash kernel keeps no seq x seq tensor.
    composed = device.attention == "composed" and config.attention_probs_dropout_prob > 0
    if composed:
        attention = tokens * h * 3 * e + b * a * s * s * (2 * e + m)
    else:
        attention = tokens * h * 4 * e + b * a * s * 4
    layer = (tokens * h * (5 * e + 2 * m)  # input, context, LN in, LN out, 2nd LN in; two dropout masks
             + attention + tokens * i * 2 * e + 4 * tokens * stats)

    index_bytes = 8
    embeddings = tokens * h * m + (2 * tokens + s) * index_bytes  # dropout mask, token/position indices
    # post-LN: the embedding LayerNorm's input; pre-LN: the final encoder LayerNorm's input.
    embeddings += tokens * h * e + 2 * tokens * stats
    # MLM head on n rows: transform input, GELU input, LN input, decoder input; fp32 log-softmax output.
    head = n * h * 4 * e + 2 * n * stats + n * index_bytes + n * v * 4
    pooler = 2 * b * h * e if config.next_sentence_prediction else 0

    if checkpoint_activations:
        # layer_norm_large_model: a segment's inputs are the layer input and the residual stream.
        inputs = 2 if config.layer_norm_large_model else 1
        encoder = math.ceil(L / checkpoint_interval) * inputs * tokens * h * e
        recompute = min(checkpoint_interval, L) * layer
    else:
        encoder = L * layer
        recompute = 0
    return Activations(saved=embeddings + encoder + head + pooler, head_saved=head,
                       loss_transient=2 * n * v * 4, recompute=recompute)


def plan_memory(
    config: BertConfig, *, device: Device, devices: int = 1, zero_stage: int = 1, micro_batch: int,
    seq_len: int, max_predictions: int | None = None, precision: str = "bf16",
    checkpoint_activations: bool = False, checkpoint_interval: int = 1, bucket_elements: int = 500_000_000,
    parameters: int | None = None,
) -> MemoryPlan:
    """Memory per device for one training step.

    Three moments can set the peak: the start of backward (all activations plus the loss gradient),
    the start of the encoder's backward (the head's activations are gone, the tied embedding/decoder
    gradient exists; with checkpointing, the recomputation of the first segment, when the later
    layers' gradients exist too), and the end of backward (all gradients, plus the embedding
    backward's dense [vocab, hidden] gradient and its sum with the decoder's). `bucket_elements` is
    DeepSpeed's `reduce_bucket_size` (default 5e8), one contiguous gradient bucket the ZeRO optimizer
    holds under ZeRO-1/2; 0 for plain PyTorch.

    bf16 ZeRO-1 (BF16_Optimizer) differs: its fp32 gradient buffer exists from start-up, and the bf16
    gradients are zeroed, not freed, between the micro batches of an accumulation window, so both are
    counted through backward (the bf16 ones exist there from a step's second micro batch on; with one
    micro batch per step the backward peak is overstated by their size). It does not use
    `reduce_bucket_size`: `buffers` is the transient of its all-reduce at the end of backward
    (`bf16_allreduce_bytes`).
    """
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    max_predictions = default_max_predictions(seq_len) if max_predictions is None else max_predictions
    parameters = parameter_count_formula(config) if parameters is None else parameters
    weights, gradients, optimizer = model_state_bytes(parameters, precision, zero_stage, devices)
    g_bytes = 2 if precision == "bf16" else 4
    bf16_optimizer = uses_bf16_optimizer(precision, zero_stage)
    if bf16_optimizer:
        buffers = bf16_allreduce_bytes(config, parameters)
        base = weights + optimizer + gradients
    else:
        buffers = bucket_elements * g_bytes if zero_stage in (1, 2) else 0
        base = weights + optimizer + buffers
    kwargs = dict(config=config, micro_batch=micro_batch, seq_len=seq_len, max_predictions=max_predictions,
                  precision=precision, device=device)
    without = activation_bytes(**kwargs, checkpoint_activations=False)
    with_ckpt = activation_bytes(**kwargs, checkpoint_activations=True, checkpoint_interval=checkpoint_interval)
    act = with_ckpt if checkpoint_activations else without
    embedding_grad = config.padded_vocab_size * config.hidden_size * g_bytes
    loss_phase = act.saved + act.loss_transient
    # Encoder backward: the head's activations are freed, the tied embedding/decoder gradient and the
    # gradient flowing into the encoder exist. With checkpointing it peaks while the first segment
    # is recomputed, when the later segments' weight gradients (partitioned under ZeRO-2/3) exist too
    # (already in `base` under BF16_Optimizer).
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    encoder_phase = act.saved - act.head_saved + embedding_grad + micro_batch * seq_len * h * g_bytes
    if checkpoint_activations:
        layer_params = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        later_grads = 0 if bf16_optimizer else layer_params * max(L - checkpoint_interval, 0) * g_bytes
        if zero_stage >= 2:
            later_grads = math.ceil(later_grads / devices)
        encoder_phase += later_grads + act.recompute
    backward_peak = base + max(loss_phase, encoder_phase)
    if bf16_optimizer:
        step_peak = base + max(2 * embedding_grad, buffers)
    else:
        step_peak = base + gradients + 2 * embedding_grad
    return MemoryPlan(parameters, weights, gradients, optimizer, act.saved, without.saved, with_ckpt.saved,
                      backward_peak - base - act.saved, buffers, backward_peak, step_peak)


def largest_micro_batch(config: BertConfig, usable_bytes: int, limit: int = 65536, **kwargs) -> int:
    """The largest micro batch whose peak fits in `usable_bytes` (0 if even 1 does not)."""
    def fits(batch: int) -> bool:
        return plan_memory(config, micro_batch=batch, **kwargs).peak <= usable_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def profile_peak_bytes(fn) -> int:
    """Run `fn()` and return the peak of tensor bytes allocated above the level at its start, from
    torch.profiler's allocator events. This is the CPU counterpart of an accelerator's
    `max_memory_allocated()` (CPU has none); it counts tensors, not allocator slack or libraries."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def _layout(config: BertConfig) -> str:
    if config.layer_norm_large_model:
        return "pre-LN, Habana deepspeed-bert's"
    return "pre-LN" if config.pre_layer_norm else "post-LN"


# ----------------------------------------------------------------------------- FLOPs and time


def forward_flops_per_sequence(config: BertConfig, seq_len: int, max_predictions: int) -> int:
    """Matrix-multiply FLOPs (2 per multiply-add) of one forward pass over one sequence."""
    h, i, L, s = config.hidden_size, config.intermediate_size, config.num_hidden_layers, seq_len
    layer = 2 * s * (4 * h * h + 2 * h * i) + 2 * 2 * s * s * h  # projections + QK^T and PV
    head = 2 * max_predictions * (h * h + h * config.padded_vocab_size)
    nsp = 2 * (h * h + 2 * h) if config.next_sentence_prediction else 0
    return L * layer + head + nsp


def training_flops_per_sequence(config: BertConfig, seq_len: int, max_predictions: int,
                                recompute: bool = False) -> int:
    """Forward + backward (2x forward). `recompute` adds the encoder forward that activation
    checkpointing repeats: hardware FLOPs rather than model FLOPs (MFU uses model FLOPs)."""
    forward = forward_flops_per_sequence(config, seq_len, max_predictions)
    extra = 0
    if recompute:
        s, h, i = seq_len, config.hidden_size, config.intermediate_size
        extra = config.num_hidden_layers * (2 * s * (4 * h * h + 2 * h * i) + 4 * s * s * h)
    return 3 * forward + extra


def training_seconds(num_sequences: int, flops_per_sequence: int, devices: int, peak_tflops: float,
                     mfu: float) -> float:
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return num_sequences * flops_per_sequence / (devices * peak_tflops * 1e12 * mfu)


def implied_mfu(sequences_per_second_per_device: float, flops_per_sequence: int, peak_tflops: float) -> float:
    return sequences_per_second_per_device * flops_per_sequence / (peak_tflops * 1e12)


# Published Gaudi (first generation, AWS DL1) BERT pretraining throughput, phase 1 (seq 128), per device
# on one node of 8: Habana Model-References (PyTorch BERT-Large; DeepSpeed BERT-1.5B) performance tables
# and the Habana/AWS DL1 blog posts on BERT pretraining with DeepSpeed.
PUBLISHED_GAUDI_DL1 = (
    ("bert-large", "configs/models/bert-large.json", 172.47),
    ("bert-1.5b", "configs/models/bert-1.5b.json", 34.58),
)


# ----------------------------------------------------------------------------- CLI


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read a size from {text!r}; write e.g. 32GiB, 96GB or 1.5TiB")
    value, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(value * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte; write the device's memory, e.g. 32GiB")
    return size


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def element_count(text: str) -> int:
    """A whole number of elements >= 1, as DeepSpeed's JSON files write it too: 500000000 or 5e8."""
    value = positive_float(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number of elements, got {text}")
    return int(value)


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f} GiB"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.2f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} hours"
    return f"{seconds:.0f} s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.planner", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--config_file", type=Path, required=True, help="model config JSON (configs/models/*.json)")
    p.add_argument("--device", default="gaudi", help=f"device model: {', '.join(DEVICES)}")
    p.add_argument("--devices", type=positive_int, default=1, help="data-parallel devices in total")
    p.add_argument("--device_memory", type=parse_bytes, default=None,
                   help="memory of one device, e.g. 32GiB (default: the device table's figure)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of device memory kept free for the runtime and allocator fragmentation")
    p.add_argument("--zero_stage", type=int, default=1, choices=(0, 1, 2, 3),
                   help="ZeRO stage: which of optimizer states, gradients and weights are partitioned")
    p.add_argument("--micro_batch", type=positive_int, required=True, help="sequences per device per forward pass")
    p.add_argument("--seq_len", type=positive_int, default=128, help="sequence length")
    p.add_argument("--max_predictions", type=positive_int, default=None, help="masked positions per sequence (default: seq_len x 0.15625 rounded up: 20 at 128, 80 at 512)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="training precision of weights and activations")
    p.add_argument("--checkpoint_activations", action="store_true", help="recompute encoder activations in backward")
    p.add_argument("--checkpoint_interval", type=positive_int, default=None,
                   help="layers per checkpointed segment (with --checkpoint_activations; default 1)")
    p.add_argument("--reduce_bucket_size", type=element_count, default=None,
                   help="DeepSpeed zero_optimization.reduce_bucket_size in elements (default 5e8): the ZeRO "
                        "optimizer's buffer under ZeRO-1/2, refused elsewhere (bf16 ZeRO-1 runs BF16_Optimizer, "
                        "which does not use it)")
    p.add_argument("--sequences", type=positive_float, default=None,
                   help="sequences to train (e.g. 7038 steps x 65536 = 4.6e8); prints the time it takes")
    p.add_argument("--mfu", type=float, default=None,
                   help="model FLOPs utilisation assumed for --sequences (default 0.4)")
    p.add_argument("--throughput", type=positive_float, default=None,
                   help="measured sequences/s per device: prints the MFU it implies")
    return p


def report(args: argparse.Namespace) -> str:
    config = BertConfig.from_json_file(args.config_file)
    device = get_device(args.device)
    memory = args.device_memory if args.device_memory is not None else device.memory_bytes
    if memory <= 0:
        raise ValueError(f"device {device.name!r} has no memory figure; pass --device_memory (e.g. 24GiB)")
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom must be in [0, 1), got {args.headroom}")
    if args.mfu is not None and args.sequences is None:
        raise ValueError(f"--mfu {args.mfu} applies to --sequences (the time to train them); add --sequences or "
                         "drop --mfu")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], a fraction of the device's peak (0.4 = 40%), got {args.mfu}")
    if args.sequences is not None and not args.sequences.is_integer():
        raise ValueError(f"--sequences must be a whole number of sequences, got {args.sequences:g}")
    mfu = 0.4 if args.mfu is None else args.mfu
    if args.checkpoint_interval is not None and not args.checkpoint_activations:
        raise ValueError(f"--checkpoint_interval {args.checkpoint_interval} applies to --checkpoint_activations; "
                         "add --checkpoint_activations or drop --checkpoint_interval")
    if args.reduce_bucket_size is not None and (uses_bf16_optimizer(args.precision, args.zero_stage)
                                                or args.zero_stage not in (1, 2)):
        raise ValueError(f"--reduce_bucket_size {args.reduce_bucket_size} sizes the ZeRO optimizer's buffer, which "
                         f"ZeRO-{args.zero_stage} with {args.precision} does not use; drop it, or plan ZeRO-1/2 "
                         "with fp32 (ZeRO-2 with bf16 uses it too, but run_pretraining.py trains bf16 with ZeRO-1 "
                         "only)")
    bucket_elements = 500_000_000 if args.reduce_bucket_size is None else args.reduce_bucket_size
    max_predictions = args.max_predictions or default_max_predictions(args.seq_len)
    if max_predictions > args.seq_len - 3:  # [CLS] and two [SEP] are never masked
        raise ValueError(f"--max_predictions {max_predictions} is more than a sequence of {args.seq_len} can hold "
                         f"({max(args.seq_len - 3, 0)} maskable tokens); lower it or raise --seq_len")
    parameters = count_parameters_exact(config)
    kwargs = dict(device=device, devices=args.devices, zero_stage=args.zero_stage, seq_len=args.seq_len,
                  max_predictions=max_predictions, precision=args.precision,
                  checkpoint_activations=args.checkpoint_activations, checkpoint_interval=args.checkpoint_interval or 1,
                  bucket_elements=bucket_elements, parameters=parameters)
    plan = plan_memory(config, micro_batch=args.micro_batch, **kwargs)
    usable = int(memory * (1 - args.headroom))
    best = largest_micro_batch(config, usable, **kwargs)
    ckpt = "on" if args.checkpoint_activations else "off"
    bf16_optimizer = uses_bf16_optimizer(args.precision, args.zero_stage)
    lines = [
        f"model        {args.config_file}  ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{_layout(config)})",
        f"parameters   {parameters:,} (closed form: {parameter_count_formula(config):,})",
        f"setup        {args.devices} x {device.name}, ZeRO-{args.zero_stage}, {args.precision}, micro batch "
        f"{args.micro_batch}, seq {args.seq_len}, {max_predictions} predictions, checkpointing {ckpt}",
        "",
        "memory per device",
        f"  weights                     {_gib(plan.weights)}",
        f"  gradients                   {_gib(plan.gradients)}"
        + ("  (bf16, and BF16_Optimizer's fp32 buffer of the whole model)" if bf16_optimizer else ""),
        f"  optimizer states            {_gib(plan.optimizer_states)}",
        (f"  all-reduce, end of backward {_gib(plan.buffers)}" if bf16_optimizer else
         f"  reduce bucket               {_gib(plan.buffers)}"),
        f"  activations, no checkpoint  {_gib(plan.activations_without_checkpointing)}",
        f"  activations, checkpointed   {_gib(plan.activations_with_checkpointing)}",
        f"  backward transient          {_gib(plan.transient)}",
        f"  peak at start of backward   {_gib(plan.backward_peak)}",
        f"  peak at end of backward     {_gib(plan.step_peak)}",
        f"  peak                        {_gib(plan.peak)}  of {_gib(memory)} "
        f"({_gib(usable).strip()} usable with {args.headroom:.0%} headroom)",
        f"verdict      {'FITS' if plan.peak <= usable else 'DOES NOT FIT'}; largest micro batch that fits: {best}",
    ]
    model_flops = training_flops_per_sequence(config, args.seq_len, max_predictions)
    hw_flops = training_flops_per_sequence(config, args.seq_len, max_predictions, args.checkpoint_activations)
    lines += ["", f"FLOPs/seq    {model_flops / 1e9:,.1f} GFLOP training (model FLOPs, 3x forward)"
              + (f"; {hw_flops / 1e9:,.1f} GFLOP executed with recomputation" if hw_flops != model_flops else "")]
    peak = device.peak_tflops.get(args.precision)
    if peak is None:
        lines.append(f"time         no {args.precision} peak known for {device.name}; time and MFU not computed")
    else:
        if args.sequences is not None:
            seconds = training_seconds(int(args.sequences), model_flops, args.devices, peak, mfu)
            rate = args.devices * peak * 1e12 * mfu / model_flops
            lines.append(f"time         {args.sequences:.3g} sequences at {peak:g} TFLOP/s peak, MFU {mfu:.0%}: "
                         f"{_duration(seconds)} ({rate:,.0f} seq/s in total)")
        if args.throughput is not None:
            lines.append(f"MFU          {args.throughput:g} seq/s per device implies "
                         f"{implied_mfu(args.throughput, model_flops, peak):.1%} of {peak:g} TFLOP/s")
    if device.name == "gaudi" and args.precision == "bf16":
        lines.append("")
        lines.append("published Gaudi DL1 throughput (phase 1, seq 128, 1 node), MFU at 60 TFLOP/s bf16:")
        root = Path(__file__).resolve().parents[1]
        for name, path, rate in PUBLISHED_GAUDI_DL1:
            ref = BertConfig.from_json_file(root / path)
            flops = training_flops_per_sequence(ref, 128, 20)
            lines.append(f"  {name:10s} {rate:7.2f} seq/s  {flops / 1e9:7.1f} GFLOP/seq  "
                         f"MFU {implied_mfu(rate, flops, 60.0):.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(report(args))
    except ValueError as e:  # ConfigError is a ValueError: bad config, device or sizes
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
