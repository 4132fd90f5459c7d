"""Activation checkpointing on and off: peak memory and step time, with the planner's prediction.

    python benchmarks/bench_activation_checkpointing.py --config_file configs/models/bert-base.json \\
        --num_hidden_layers 4 --micro_batch 4 --seq_len 512

Two copies of modeling.BertForPreTraining with the same weights, one with checkpointing (one layer
per segment) and one without, step in turn (A, B, A, B, ...) so that load from other processes hits
them alike. Peak memory is the tensor high-water mark of one extra step above the weights and
optimizer states (torch.profiler allocator events on CPU, `max_memory_allocated()` on an
accelerator). The planner's prediction for the same setup is printed beside it; on an accelerator
the planner assumes fused attention, on CPU the composed path modeling.py takes there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_train_step import DTYPES, Stepper, compare, make_batch, setup  # noqa: E402

from modeling import ActivationCheckpointing, BertForPreTraining  # noqa: E402
from training import planner  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config_file", type=Path, default=ROOT / "configs/models/bert-base.json")
    p.add_argument("--num_hidden_layers", type=int, default=4, help="override the config's layer count (4)")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    # Without checkpointing, the first steps on CPU fault in fresh pages for the activations: times
    # settle after a few steps.
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)

    device, config = setup(args)
    predictions = planner.default_max_predictions(args.seq_len)
    inputs = make_batch(config, args.micro_batch, args.seq_len, predictions, device)["ours"]

    torch.manual_seed(0)
    plain = BertForPreTraining(config)
    checkpointed = BertForPreTraining(config, ActivationCheckpointing(enabled=True))
    checkpointed.load_state_dict(plain.state_dict())
    dtype = DTYPES[args.dtype]
    steppers = [Stepper("checkpointing off", plain.to(device=device, dtype=dtype), inputs, device),
                Stepper("checkpointing on", checkpointed.to(device=device, dtype=dtype), inputs, device)]
    off, on = compare(steppers, args.warmup, args.steps)

    # The planner's device model: the CPU entry here, a fused-attention accelerator elsewhere.
    device_model = planner.DEVICES["cpu"] if device.type == "cpu" else planner.DEVICES["h100"]
    planned = {}
    for enabled in (False, True):
        plan = planner.plan_memory(config, device=device_model, zero_stage=0, micro_batch=args.micro_batch,
                                   seq_len=args.seq_len, precision=args.dtype, checkpoint_activations=enabled,
                                   bucket_elements=0)
        planned[enabled] = plan.peak - plan.weights - plan.optimizer_states
    print(f"device {device}, threads {torch.get_num_threads()}, {args.config_file.name} with "
          f"{config.num_hidden_layers} layers, micro batch {args.micro_batch}, seq {args.seq_len}, {args.dtype}, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'':18} {'step s':>8} {'fwd s':>7} {'bwd s':>7} {'peak MiB':>9} {'planned MiB':>12} {'planned/measured':>17}")
    for r, enabled in ((off, False), (on, True)):
        print(f"{r.name:18} {r.step:8.2f} {r.forward:7.2f} {r.backward:7.2f} {r.peak_bytes / 2**20:9.1f} "
              f"{planned[enabled] / 2**20:12.1f} {planned[enabled] / r.peak_bytes:17.3f}")
    print(f"checkpointing: peak memory x{on.peak_bytes / off.peak_bytes:.2f}, step time x{on.step / off.step:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
