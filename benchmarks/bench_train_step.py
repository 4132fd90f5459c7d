"""Training-step throughput and peak memory: modeling.BertForPreTraining against transformers.

    python benchmarks/bench_train_step.py --config_file configs/models/bert-base.json --num_hidden_layers 4 \\
        --micro_batch 8 --seq_len 128 --dtypes fp32 bf16

References, run side by side in one process with the same weights (copied by `modeling.to_hf_model`),
config, dtype, batch, sequence length and optimizer:
  post-LN: transformers.BertForPreTraining, eager attention (and its sdpa mode with --hf_sdpa);
  pre-LN:  transformers.MegatronBertForPreTraining against our model built with pre_layer_norm=true.
The models step in turn (A, B, A, B, ...) so that load from other processes hits them alike.
Each step is timed in three parts (forward, backward, optimizer) after warm-up steps; the table
prints tokens/s, the parts, the process CPU time of a step (all threads; on a machine shared with
other jobs it moves less than wall time), peak memory and the ratios to the reference. Peak memory is the tensor
high-water mark of one extra step above the weights and optimizer states: `max_memory_allocated()` on
an accelerator, torch.profiler allocator events on CPU (training.planner.profile_peak_bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling import BertConfig, BertForPreTraining, _composed_attention, to_hf_model  # noqa: E402
from training.planner import default_max_predictions, profile_peak_bytes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_batch(config: BertConfig, batch: int, seq: int, predictions: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, config.vocab_size, (batch, seq), generator=g)
    positions = torch.stack([torch.sort(torch.randperm(seq - 1, generator=g)[:predictions] + 1).values
                             for _ in range(batch)])
    labels = torch.randint(5, config.vocab_size, (batch, predictions), generator=g)
    dense = torch.full((batch, seq), -100, dtype=torch.long).scatter_(1, positions, labels)
    nsp = torch.randint(0, 2, (batch,), generator=g)
    ours = dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids),
                masked_lm_positions=positions, masked_lm_labels=labels, next_sentence_labels=nsp)
    hf = dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids),
              labels=dense, next_sentence_label=nsp)
    move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return {"ours": move(ours), "hf": move(hf)}


def setup(args: argparse.Namespace) -> tuple[torch.device, BertConfig]:
    """The device (the accelerator if there is one), torch's CPU threads, and the model config with
    `--num_hidden_layers` applied, from a benchmark's arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = torch.device(acc.type if acc is not None else "cpu")
    config = BertConfig.from_json_file(args.config_file)
    if args.num_hidden_layers:
        config = dataclasses.replace(config, num_hidden_layers=args.num_hidden_layers)
    return device, config


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


@dataclasses.dataclass
class Result:
    name: str
    forward: float
    backward: float
    optimizer: float
    peak_bytes: int
    cpu_seconds: float  # process CPU time of a step, all threads: less sensitive to other jobs than wall time

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.optimizer


class Stepper:
    """One model with its optimizer and inputs; `step()` runs and times forward, backward, optimizer."""

    def __init__(self, name: str, model: torch.nn.Module, inputs: dict, device: torch.device):
        self.name, self.model, self.inputs, self.device = name, model.train(), inputs, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
        self.cpu: list[float] = []

    def step(self, record: bool = True) -> None:
        _sync(self.device)
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = self.model(**self.inputs).loss
        _sync(self.device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(self.device)
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        t3 = time.perf_counter()
        c3 = time.process_time()
        if record:
            self.cpu.append(c3 - c0)
            for key, seconds in zip(self.parts, (t1 - t0, t2 - t1, t3 - t2)):
                self.parts[key].append(seconds)

    def peak_bytes(self) -> int:
        if self.device.type == "cpu":
            return profile_peak_bytes(lambda: self.step(record=False))
        torch.accelerator.synchronize()
        start = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        self.step(record=False)
        return torch.accelerator.max_memory_allocated() - start

    def op_profile(self, rows: int) -> str:
        """torch.profiler table of one step: where the time goes, operator by operator."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            self.step(record=False)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)

    def result(self) -> Result:
        medians = (statistics.median(self.parts[k]) for k in ("forward", "backward", "optimizer"))
        return Result(self.name, *medians, self.peak_bytes(), statistics.median(self.cpu))


def compare(steppers: list[Stepper], warmup: int, steps: int) -> list[Result]:
    """Alternate the models step by step, so that load from other processes hits them alike."""
    for _ in range(warmup):
        for s in steppers:
            s.step(record=False)
    for _ in range(steps):
        for s in steppers:
            s.step()
    return [s.result() for s in steppers]


def attention_variants(config: BertConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
                       repeats: int = 20) -> dict[str, float]:
    """Median process-CPU seconds of forward + backward of one layer's attention core, five ways:
    how much of the step the choice of attention kernel explains on this device."""
    import torch.nn.functional as F

    heads, head_dim = config.num_attention_heads, config.head_dim
    p = config.attention_probs_dropout_prob
    mask = torch.ones(batch, 1, 1, seq, dtype=torch.bool, device=device)
    additive = torch.zeros(batch, 1, 1, seq, dtype=dtype, device=device)

    def eager(q, k, v):
        probs = torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5 + additive, dim=-1)
        return F.dropout(probs, p, training=True) @ v

    variants = {
        "modeling.py's CPU path (composed, boolean mask, dropout)": lambda q, k, v: _composed_attention(
            q, k, v, mask, p),
        "SDPA, boolean mask, dropout (ours on accelerators)": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p),
        "SDPA, no mask, dropout": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p),
        "SDPA, boolean mask, no dropout": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "eager matmul-softmax-dropout-matmul (transformers)": eager,
    }
    results = {}
    for name, fn in variants.items():
        q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device)
        times = []
        for i in range(repeats + 3):
            _sync(device)
            c0 = time.process_time()
            fn(q, k, v).backward(grad)
            _sync(device)
            if i >= 3:
                times.append(time.process_time() - c0)
        results[name] = statistics.median(times)
    return results


def run(config: BertConfig, dtype: str, args: argparse.Namespace, device: torch.device) -> list[tuple[Result, Result]]:
    predictions = args.max_predictions or default_max_predictions(args.seq_len)
    inputs = make_batch(config, args.micro_batch, args.seq_len, predictions, device)
    pairs = []
    for pre_ln in (False, True):
        cfg = dataclasses.replace(config, pre_layer_norm=pre_ln)
        label = "post-LN" if not pre_ln else "pre-LN"
        torch.manual_seed(0)
        ours = BertForPreTraining(cfg)
        steppers = []
        attns = ["eager", "sdpa"] if args.hf_sdpa and not pre_ln else ["eager"]
        for attn in attns:
            hf = to_hf_model(ours)
            hf.set_attn_implementation(attn)
            name = f"transformers {'BERT' if not pre_ln else 'MegatronBERT'} {attn} ({label})"
            steppers.append(Stepper(name, hf.to(device=device, dtype=DTYPES[dtype]), inputs["hf"], device))
        steppers.append(Stepper(f"ours ({label})", ours.to(device=device, dtype=DTYPES[dtype]), inputs["ours"], device))
        results = compare(steppers, args.warmup, args.steps)
        if args.profile_ops:
            for stepper in steppers:
                print(f"\n{dtype} {stepper.name}: operators of one step\n{stepper.op_profile(args.profile_ops)}")
        pairs += [(results[-1], ref) for ref in results[:-1]]
        del steppers, ours
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config_file", type=Path, default=ROOT / "configs/models/bert-base.json")
    p.add_argument("--num_hidden_layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--max_predictions", type=int, default=None, help="default: 20 at seq 128, 80 at 512")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hf_sdpa", action="store_true", help="also time transformers' post-LN BERT with sdpa attention")
    p.add_argument("--profile_ops", type=int, default=0, metavar="ROWS",
                   help="also print a torch.profiler operator table (ROWS rows) of one step of each model")
    p.add_argument("--attention_variants", action="store_true",
                   help="also time one layer's attention core five ways (our CPU composition, SDPA with/without mask and "
                        "dropout, eager)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.max_predictions is not None and not 1 <= args.max_predictions <= args.seq_len - 1:
        p.error(f"--max_predictions must be between 1 and --seq_len - 1 ({args.seq_len - 1}: every position but "
                f"[CLS] may be masked), got {args.max_predictions}")

    device, config = setup(args)
    tokens = args.micro_batch * args.seq_len
    print(f"device {device}, threads {torch.get_num_threads()}, {args.config_file.name} with "
          f"{config.num_hidden_layers} layers, micro batch {args.micro_batch}, seq {args.seq_len}, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    header = (f"{'dtype':5} {'model':44} {'tokens/s':>9} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>7} "
              f"{'cpu s':>6} {'peak MiB':>9} {'speed-up':>9} {'cpu-time':>9} {'memory':>7}")
    print(header)
    for dtype in args.dtypes:
        for ours, ref in run(config, dtype, args, device):
            for r in (ref, ours):
                print(f"{dtype:5} {r.name:44} {tokens / r.step:9.0f} {r.forward * 1e3:8.1f} {r.backward * 1e3:8.1f} "
                      f"{r.optimizer * 1e3:7.1f} {r.cpu_seconds:6.2f} {r.peak_bytes / 2**20:9.1f}"
                      + (f" {ref.step / ours.step:8.2f}x {ref.cpu_seconds / ours.cpu_seconds:8.2f}x "
                         f"{ours.peak_bytes / ref.peak_bytes:6.2f}x" if r is ours else ""))
        if args.attention_variants:
            for name, seconds in attention_variants(config, args.micro_batch, args.seq_len, DTYPES[dtype],
                                                    device).items():
                print(f"{dtype:5} attention per layer, forward + backward, CPU time: {name:52} {seconds * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
