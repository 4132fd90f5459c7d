"""The cost of starting phase 2 from phase 1's optimizer moments (--init_optimizer_moments).

    DS_ACCELERATOR=cpu python benchmarks/bench_phase2_moments.py --config_file configs/models/bert-large.json

One rank (gloo on CPU). The script trains one bf16 ZeRO-1 LAMB step of the model and saves it as a run of
this project (training.checkpoint.save: its partitions, run_state.json, `latest`). It then builds a fresh
engine and measures, alternately, --repeats times each:
  ours       training.moments: open_phase1_moments + set_phase1_moments, the moments alone (phase 2 reads
             the weights before DeepSpeed wraps the model, with or without the flag);
  DeepSpeed  engine.load_checkpoint of the same tag, a resume's load: module, fp32 masters and moments.
It prints the median time of each, their ratio, the bytes each reads from the tag and the growth of the
process's peak resident memory in each (VmHWM, reset before each measure; memory-mapped pages that are
read count in it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(fn) -> tuple[float, int]:
    """Seconds and peak resident growth (bytes) of fn()."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, (_status_kib("VmHWM") - before) * 1024


def build_engine(config, lr: float):
    import deepspeed

    from modeling import BertForPreTraining
    from training.lamb import Lamb, bind_to_deepspeed, build_param_groups

    model = BertForPreTraining(config)
    ds_config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                 "data_types": {"grad_accum_dtype": "fp32"}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=Lamb(build_param_groups(model, 0.01), lr=lr),
                                           config=ds_config)
    bind_to_deepspeed(engine)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config_file", type=Path, default=ROOT / "configs/models/bert-large.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work_dir", type=Path, help="where the phase-1 run is written (default: a temporary "
                                                      "directory, removed at the end)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if "MASTER_PORT" not in os.environ:
        from training.accelerator import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed
    import torch

    from modeling import BertConfig
    from training import checkpoint
    from training.moments import open_phase1_moments, set_phase1_moments

    deepspeed.init_distributed("gloo")
    config = BertConfig.from_json_file(args.config_file)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        run = Path(tmp) / "phase1"
        ckpt_dir = checkpoint.checkpoint_dir(run)
        torch.manual_seed(0)
        engine = build_engine(config, lr=1e-3)
        ids = torch.randint(5, config.vocab_size, (1, 128))
        batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
                 "masked_lm_positions": torch.arange(1, 21).unsqueeze(0), "masked_lm_labels": ids[:, 1:21],
                 "next_sentence_labels": torch.zeros(1, dtype=torch.long)}
        engine.backward(engine(**batch).loss)
        engine.step()
        tag = checkpoint.save(engine, ckpt_dir, 1, 1, 0, (0, 0), {"optimizer": "lamb"}, keep=1)
        parameters = sum(p.numel() for p in engine.module.parameters())
        del engine
        tag_dir = ckpt_dir / tag
        partitions = sum(p.stat().st_size for p in tag_dir.glob("*optim_states.pt"))
        module_file = (tag_dir / checkpoint.MODEL_STATES).stat().st_size

        engine = build_engine(config, lr=1e-3)
        client = engine.optimizer.optimizer

        def ours() -> None:
            client.state.clear()
            set_phase1_moments(engine, open_phase1_moments(run, "lamb"))

        def deepspeeds() -> None:
            engine.load_checkpoint(str(ckpt_dir), tag=tag)

        times: dict[str, list[float]] = {"ours": [], "DeepSpeed": []}
        peaks: dict[str, list[int]] = {"ours": [], "DeepSpeed": []}
        for _ in range(args.repeats):
            for name, fn in (("ours", ours), ("DeepSpeed", deepspeeds)):
                seconds, peak = measured(fn)
                times[name].append(seconds)
                peaks[name].append(peak)
        moment_bytes = 2 * 4 * parameters
        print(f"{args.config_file.name}: {parameters / 1e6:.1f}M parameters; tag {module_file / 1e9:.2f} GB of "
              f"module states + {partitions / 1e9:.2f} GB of optimizer partitions (1 rank)")
        print("| load | reads | median s | peak RSS growth |")
        print("|---|---|---|---|")
        print(f"| ours: phase 1's moments into a fresh engine | the moments, {moment_bytes / 1e9:.2f} GB | "
              f"{statistics.median(times['ours']):.2f} | {max(peaks['ours']) / 1e9:.2f} GB |")
        print(f"| DeepSpeed load_checkpoint (a resume) | module + partitions, {(module_file + partitions) / 1e9:.2f} GB"
              f" | {statistics.median(times['DeepSpeed']):.2f} | {max(peaks['DeepSpeed']) / 1e9:.2f} GB |")
        print(f"ours / DeepSpeed time: {statistics.median(times['ours']) / statistics.median(times['DeepSpeed']):.2f}")


if __name__ == "__main__":
    main()
