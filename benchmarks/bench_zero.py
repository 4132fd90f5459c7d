"""ZeRO-1 optimizer state per rank with 1 and 2 ranks: does it halve?

    DS_ACCELERATOR=cpu python benchmarks/bench_zero.py --config_file configs/models/bert-base.json \\
        --num_hidden_layers 2 --precision bf16

Real DeepSpeed runs: for each world size, this script starts that many worker processes (gloo on CPU,
OMP_NUM_THREADS=1 per rank, MASTER_PORT from a free port), each builds modeling.BertForPreTraining,
wraps it in a ZeRO-1 DeepSpeed engine with AdamW (in bf16 with fp32 gradient accumulation, as the
project's DeepSpeed config: BF16_Optimizer), takes one training step, and reports the bytes of
optimizer state it holds: Adam's two moments and the fp32 master partition. The parent prints the
bytes per rank, the 2-rank / 1-rank ratio, and the planner's figure for the same setup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _unique_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    from bench_train_step import make_batch

    from modeling import BertConfig, BertForPreTraining
    from training.planner import default_max_predictions

    deepspeed.init_distributed()
    config = BertConfig.from_json_file(args.config_file)
    if args.num_hidden_layers:
        config = dataclasses.replace(config, num_hidden_layers=args.num_hidden_layers)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": args.precision == "bf16"},
        # As configs/deepspeed/zero1-bf16.json: fp32 gradient accumulation, which makes DeepSpeed wrap
        # the optimizer in its BF16_Optimizer rather than the ZeRO optimizer.
        **({"data_types": {"grad_accum_dtype": "fp32"}} if args.precision == "bf16" else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    batch = make_batch(config, 2, args.seq_len, default_max_predictions(args.seq_len), engine.device)["ours"]
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()

    zero = engine.optimizer
    moments = _unique_bytes(t for state in zero.optimizer.state.values() for t in state.values()
                            if torch.is_tensor(t) and t.dim() > 0)
    master = _unique_bytes(zero.fp32_groups_flat_partition if args.precision == "bf16"
                           else zero.single_partition_of_fp32_groups)
    result = {"rank": engine.global_rank, "world_size": engine.world_size, "moments": moments, "master": master,
              "optimizer_class": type(zero).__name__, "parameters": sum(p.numel() for p in model.parameters())}
    Path(args.result_dir, f"rank{engine.global_rank}.json").write_text(json.dumps(result))
    # Leave together and close gloo before exit: a rank that exits while its peer's gloo threads still
    # talk to it can abort ('terminate called without an active exception'); then skip the interpreter's
    # teardown, where finished ranks have aborted too (training.accelerator.leave).
    from training.accelerator import leave

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    leave(0)


def launch(world_size: int, args: argparse.Namespace, result_dir: str) -> list[dict]:
    from training.accelerator import free_port

    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", "--result_dir", result_dir, "--config_file",
               str(args.config_file), "--precision", args.precision, "--seq_len", str(args.seq_len)]
        if args.num_hidden_layers:
            cmd += ["--num_hidden_layers", str(args.num_hidden_layers)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} of {world_size} failed (exit {proc.returncode}):\n{out[-4000:]}")
    return [json.loads(Path(result_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config_file", type=Path, default=ROOT / "configs/models/bert-base.json")
    p.add_argument("--num_hidden_layers", type=int, default=2, help="override the config's layer count (2)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for each run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result_dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from training.planner import model_state_bytes

    runs = {}
    for world_size in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            runs[world_size] = launch(world_size, args, tmp)
    params = runs[1][0]["parameters"]
    print(f"{args.config_file.name} with {args.num_hidden_layers} layers: {params:,} parameters, "
          f"ZeRO-1, {args.precision}, optimizer {runs[1][0]['optimizer_class']}")
    print(f"{'ranks':>5} {'rank':>4} {'moments MiB':>12} {'master MiB':>11} {'total MiB':>10} {'planner MiB':>12}")
    for world_size, results in runs.items():
        _, _, planned = model_state_bytes(params, args.precision, zero_stage=1, devices=world_size)
        if args.precision == "fp32":
            # The ZeRO optimizer's share without its fp32 gradient partition (a step-time buffer).
            planned = planned * 12 // 16
        for r in results:
            total = r["moments"] + r["master"]
            print(f"{world_size:5} {r['rank']:4} {r['moments'] / 2**20:12.2f} {r['master'] / 2**20:11.2f} "
                  f"{total / 2**20:10.2f} {planned / 2**20:12.2f}")
    one = runs[1][0]["moments"] + runs[1][0]["master"]
    two = max(r["moments"] + r["master"] for r in runs[2])
    ratio = two / one
    print(f"largest 2-rank share / 1-rank total = {ratio:.4f} ({'halves' if abs(ratio - 0.5) < 0.01 else 'DOES NOT halve'})")
    return 0 if abs(ratio - 0.5) < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
