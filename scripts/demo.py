"""`make demo`: the whole product, end to end, on CPU in a few minutes, with no network.

1. generate a small MediaWiki dump (data/demo_dump.py: invented articles with real wiki markup);
2. run the data pipeline on it (data.prepare: extract, segment, train a WordPiece vocab, create, shard);
3. pretrain a 2-layer BERT with DeepSpeed ZeRO-1 + BF16 on 2 processes through scripts/launch.sh
   (the `demo` preset, DeepSpeed's launcher), writing TensorBoard logs, metrics.jsonl and checkpoints;
4. print the loss and MLM accuracy from metrics.jsonl and check that they improved;
5. export the checkpoint to a Hugging Face model (scripts/export_hf.py) and run a `transformers`
   fill-mask pipeline on it;
6. print where everything is.

Rerunning continues where it stopped (every stage skips finished work); `make clean` starts over. A rerun
with other --articles, --vocab_size, --max_steps or --seed needs another --output_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from data.cli import HelpFormatter, file_in_the_way, positive_int, usable_cores

if TYPE_CHECKING:
    from data.prepare import PrepareConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "configs" / "models" / "bert-demo.json"
PROBES = ("the city was founded in 1200 as a [MASK] on the river.",
          "it feeds mainly on insects and [MASK] eggs in bark.",
          "the river flows into the amber [MASK].")


# The settings the output directory's dump, data and run were made with, written on its first run: a rerun with
# others would overwrite the dump, then be refused by a finished stage or by the checkpoint's schedule.
SETTINGS_FILE = "demo_settings.json"
MADE_WITH = ("articles", "vocab_size", "max_steps", "seed")


class DemoError(RuntimeError):
    """A demo step that failed; the message says which and where its output is."""


@dataclass(frozen=True)
class DemoConfig:
    output_dir: Path = ROOT / "results" / "demo"
    articles: int = 1200
    vocab_size: int = 2048
    max_steps: int | None = None  # None: the preset's
    processes: int = 2
    seed: int = 12345
    log_freq: int = 10


@dataclass(frozen=True)
class DemoResult:
    dump: Path
    data_dir: Path
    run_dir: Path
    hf_dir: Path
    metrics: list[dict]
    predictions: dict[str, list[tuple[str, float]]]


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def prepare_config(cfg: DemoConfig) -> PrepareConfig:
    """The data pipeline's settings for the demo's dump."""
    from data.prepare import PrepareConfig

    return PrepareConfig(input=cfg.output_dir / "dump" / "demowiki-pages-articles-multistream.xml.bz2",
                         output_dir=cfg.output_dir / "data", vocab_file=None, vocab_size=cfg.vocab_size,
                         max_seq_length=128, max_predictions_per_seq=20, dupe_factor=5, num_shards=2,
                         num_test_shards=1, seed=cfg.seed, workers=min(2, usable_cores()), test_fraction=0.05,
                         articles_per_part=400)


def make_data(cfg: DemoConfig) -> tuple[Path, Path, Path]:
    """Steps 1-2: the dump and the shards; returns (dump, shards dir, model config for this vocab)."""
    from data.demo_dump import generate_demo_dump
    from data.prepare import prepare
    from data.vocab import load_vocab
    from modeling import BertConfig

    settings = prepare_config(cfg)
    dump = settings.input
    _banner(f"1/5 generating a MediaWiki dump with {cfg.articles} articles")
    stats = generate_demo_dump(dump, articles=cfg.articles, seed=cfg.seed)
    print(f"{dump}: {stats.articles} articles, {stats.redirects} redirects, "
          f"{stats.other_namespace} template/category pages ({stats.bytes_xml / 1e6:.1f} MB of XML)")
    _banner("2/5 data pipeline: extract, segment, train a WordPiece vocab, create instances, shard")
    data_dir = settings.output_dir
    result = prepare(settings)
    # The model's vocab is the vocab the pipeline trained (a small corpus may give fewer tokens than asked).
    model = BertConfig.from_json_file(DEMO_MODEL).to_dict()
    model["vocab_size"] = load_vocab(result.vocab_file).size
    model_config = cfg.output_dir / "bert-demo-model.json"
    BertConfig.from_dict(model, source=str(DEMO_MODEL)).to_json_file(model_config)
    return dump, data_dir, model_config


def micro_batch(processes: int) -> int | None:
    """The micro batch per process that keeps the demo preset's global batch on `processes` processes: the largest
    that fits, up to the preset's micro batch (the rest is accumulation); None where none fits (`processes`
    does not divide the global batch)."""
    from training.presets import fitting_micro_batches, load_preset

    preset = load_preset("demo")
    fits = fitting_micro_batches(preset.global_batch_size, preset.micro_batch_per_device["default"], processes)
    return fits[-1] if fits else None


def train(cfg: DemoConfig, data_dir: Path, model_config: Path) -> Path:
    """Step 3: 2 processes, ZeRO-1 + BF16, through launch.sh's default (DeepSpeed) launcher, as on a cluster."""
    from training.accelerator import free_port

    run_dir = cfg.output_dir / "run"
    _banner(f"3/5 pretraining with DeepSpeed ZeRO-1 + BF16 on {cfg.processes} processes (scripts/launch.sh)")
    cmd = ["bash", str(ROOT / "scripts" / "launch.sh"), "--preset", "demo", "--nodes", "1",
           "--devices_per_node", str(cfg.processes), "--master_port", str(free_port()),
           "--input_dir", str(data_dir), "--output_dir", str(run_dir), "--set", f"model_config={model_config}"]
    if cfg.max_steps is not None:
        cmd += ["--set", f"max_steps={cfg.max_steps}"]
    micro = micro_batch(cfg.processes)
    if micro is None:
        raise DemoError(f"{cfg.processes} processes do not divide the demo preset's global batch")
    cmd += ["--set", f"micro_batch_per_device={micro}"]
    cmd += ["--", "--log_freq", str(cfg.log_freq), "--eval_freq", str(cfg.log_freq * 10), "--seed", str(cfg.seed),
            "--num_workers", "1"]
    # One thread per rank: 2 ranks on 2 cores. CPU unless the caller chose an accelerator.
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    print("$ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, env=env, cwd=ROOT).returncode != 0:
        raise DemoError(f"training failed (see the output above); its files are in {run_dir}")
    return run_dir


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DemoError(f"{path} is missing: the training run logged nothing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def progress_table(records: list[dict], rows: int = 10) -> str:
    """A few evenly spaced logged steps: loss falls, MLM accuracy rises."""
    picks = sorted({round(i * (len(records) - 1) / max(rows - 1, 1)) for i in range(rows)}) if records else []
    lines = [f"{'step':>6} {'loss':>8} {'mlm loss':>9} {'nsp loss':>9} {'mlm acc':>8} {'lr':>9} {'seq/s':>7}"]
    for i in picks:
        r = records[i]
        lines.append(f"{r['step']:>6} {r['loss']:>8.3f} {r['mlm_loss']:>9.3f} {r['nsp_loss']:>9.3f} "
                     f"{r['mlm_accuracy']:>8.3f} {r['lr']:>9.2e} {r['seq_per_s'] or 0:>7.0f}")
    return "\n".join(lines)


def check_learning(records: list[dict]) -> tuple[float, float, float, float]:
    """Mean of the first and last quarter of the logged steps; an error if the model did not learn."""
    if len(records) < 4:
        raise DemoError(f"only {len(records)} logged steps; need at least 4 to see a trend (raise --max_steps)")
    k = max(1, len(records) // 4)

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    first, last = records[:k], records[-k:]
    loss0, loss1 = mean("loss", first), mean("loss", last)
    acc0, acc1 = mean("mlm_accuracy", first), mean("mlm_accuracy", last)
    if not loss1 < loss0:
        raise DemoError(f"the loss did not fall: {loss0:.3f} over the first {k} logged steps, {loss1:.3f} over the last")
    if not acc1 > acc0:
        raise DemoError(f"MLM accuracy did not rise: {acc0:.3f} over the first {k} logged steps, {acc1:.3f} over the last")
    return loss0, loss1, acc0, acc1


def export_and_predict(run_dir: Path, hf_dir: Path) -> dict[str, list[tuple[str, float]]]:
    """Step 5: the user's commands: scripts/export_hf.py, then transformers' fill-mask pipeline."""
    _banner("5/5 exporting a Hugging Face model and running fill-mask with transformers")
    cmd = [sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--checkpoint", str(run_dir), "--output", str(hf_dir)]
    print("$ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise DemoError(f"export failed (see above); the checkpoint is in {run_dir / 'checkpoints'}")
    from transformers import pipeline
    from transformers.utils import logging as hf_logging

    # A masked-LM pipeline does not use the pooler and NSP head of a pretraining export; transformers
    # would print them as "unexpected" weights, which reads like an error in a demo.
    hf_logging.set_verbosity_error()
    fill = pipeline("fill-mask", model=str(hf_dir), tokenizer=str(hf_dir), device="cpu")
    predictions = {}
    for probe in PROBES:
        top = [(p["token_str"], float(p["score"])) for p in fill(probe, top_k=3)]
        predictions[probe] = top
        print(f"  {probe}\n      -> " + ", ".join(f"{token!r} ({score:.2f})" for token, score in top))
    return predictions


def run_demo(cfg: DemoConfig) -> DemoResult:
    start = time.time()
    dump, data_dir, model_config = make_data(cfg)
    run_dir = train(cfg, data_dir, model_config)
    _banner("4/5 what the model learned (from metrics.jsonl)")
    records = read_metrics(run_dir)
    print(progress_table(records))
    loss0, loss1, acc0, acc1 = check_learning(records)
    print(f"loss {loss0:.3f} -> {loss1:.3f}, MLM accuracy {acc0:.3f} -> {acc1:.3f} "
          "(first and last quarter of the logged steps)")
    hf_dir = cfg.output_dir / "hf_model"
    predictions = export_and_predict(run_dir, hf_dir)
    checkpoints = run_dir / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    print(f"""
=== done in {time.time() - start:.0f} s. Everything is under {cfg.output_dir}: ===
  dump               {dump}
  extracted text     {data_dir / 'text'}
  vocab              {data_dir / 'vocab.txt'}
  HDF5 shards        {data_dir / 'hdf5'}
  training run       {run_dir}
    metrics          {run_dir / 'metrics.jsonl'} (eval: {run_dir / 'eval.jsonl'})
    TensorBoard      {run_dir / 'tensorboard'}   (view: tensorboard --logdir {run_dir / 'tensorboard'})
    checkpoint       {checkpoints / latest}
    DeepSpeed JSON   {run_dir / 'launch' / 'deepspeed_config.json'}
  Hugging Face model {hf_dir}   (transformers.AutoModelForMaskedLM.from_pretrained("{hf_dir}"))
""")
    return DemoResult(dump, data_dir, run_dir, hf_dir, records, predictions)


def settings_problem(output_dir: Path, settings: dict[str, int]) -> str | None:
    """Why `output_dir` cannot take a demo of `settings` (MADE_WITH's values), or None after recording them
    there for the next run."""
    from data.stage import write_json_atomic

    path = output_dir / SETTINGS_FILE
    if not path.is_file():
        output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, settings)
        return None
    try:
        made = json.loads(path.read_text())
        made = {key: made[key] for key in MADE_WITH}
    except (ValueError, KeyError, TypeError):
        return f"{path} is not a record this demo wrote; delete {output_dir} (make clean) to start over"
    changed = [f"--{key} {settings[key]} (made with {made[key]})" for key in MADE_WITH if settings[key] != made[key]]
    if not changed:
        return None
    return (f"{output_dir} holds a demo made with other settings: {', '.join(changed)}. Its finished stages and "
            "checkpoint would not take them: pass another --output_dir for these settings (make demo "
            f"DEMO_ARGS=\"... --output_dir results/demo-2\"), or delete {output_dir} (make clean) to start over")


def main(argv: list[str] | None = None) -> int:
    from training.presets import load_preset

    preset = load_preset("demo")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=DemoConfig.output_dir,
                        help="where the dump, data, run and export go")
    parser.add_argument("--articles", type=int, default=DemoConfig.articles, help="articles in the generated dump")
    parser.add_argument("--vocab_size", type=int, default=DemoConfig.vocab_size, help="WordPiece vocab to train")
    parser.add_argument("--max_steps", type=positive_int, help="training steps (default: the demo preset's)")
    parser.add_argument("--processes", type=positive_int, default=DemoConfig.processes,
                        help="training processes: a divisor of the demo preset's global batch of "
                             f"{preset.global_batch_size} (the micro batch per process follows)")
    parser.add_argument("--seed", type=int, default=DemoConfig.seed, help="dump, data and training seed")
    parser.add_argument("--log_freq", type=positive_int, default=DemoConfig.log_freq,
                        help="steps between logged records; evaluation every 10 records")
    args = parser.parse_args(argv)
    # Checked before the minutes of data pipeline that would come before the step that fails.
    if args.articles < 4:
        parser.error(f"--articles must be >= 4 (the dump has one article of each kind), got {args.articles}")
    if micro_batch(args.processes) is None:
        batch = preset.global_batch_size
        parser.error(f"--processes {args.processes} does not divide the demo preset's global batch of {batch} "
                     f"sequences; pass one of {', '.join(str(p) for p in range(1, batch + 1) if batch % p == 0)}")
    max_steps = args.max_steps or preset.max_steps
    if max_steps // args.log_freq < 4:
        parser.error(f"--max_steps {max_steps} with --log_freq {args.log_freq} logs {max_steps // args.log_freq} "
                     "steps; the demo needs at least 4 to see a trend: raise --max_steps or lower --log_freq")
    blocker = file_in_the_way(args.output_dir.resolve())
    if blocker is not None:
        parser.error(f"--output_dir {args.output_dir}: {blocker} is a file, not a directory; pass a directory")
    cfg = DemoConfig(output_dir=args.output_dir.resolve(), articles=args.articles, vocab_size=args.vocab_size,
                     max_steps=args.max_steps, processes=args.processes, seed=args.seed, log_freq=args.log_freq)
    from data.prepare import check_settings
    from data.stage import PipelineError

    try:  # before the settings are recorded: a refused --seed or --vocab_size would stay in the record
        check_settings(prepare_config(cfg))
    except PipelineError as e:
        parser.error(str(e))
    problem = settings_problem(cfg.output_dir, {"articles": args.articles, "vocab_size": args.vocab_size,
                                                "max_steps": max_steps, "seed": args.seed})
    if problem:
        parser.error(problem)
    try:
        run_demo(cfg)
    except (DemoError, PipelineError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
