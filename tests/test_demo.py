"""`make demo` in a reduced size (160 articles, 32 steps), through the same script, so it cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.demo import DemoError, check_learning, progress_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_end_to_end_reduced(tmp_path: Path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--output_dir", str(out),
                           "--articles", "160", "--max_steps", "32", "--log_freq", "4"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    # the dump, the pipeline's trained vocab and shards
    assert (out / "dump" / "demowiki-pages-articles-multistream.xml.bz2").is_file()
    vocab = (out / "data" / "vocab.txt").read_text().splitlines()
    assert vocab[0] == "[PAD]" and "[MASK]" in vocab
    assert json.loads((out / "bert-demo-model.json").read_text())["vocab_size"] == len(vocab)
    assert list((out / "data" / "hdf5" / "training").glob("*_training_*.hdf5"))
    # training: 2 ranks, ZeRO-1, BF16, metrics, TensorBoard, a checkpoint
    run = out / "run"
    info = json.loads((run / "run_info.json").read_text())
    assert (info["world_size"], info["zero_stage"], info["bf16"]) == (2, 1, True)
    assert "[launch] deepspeed: 1 node(s) x 2 device(s)" in proc.stderr  # launch.sh's default launcher
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(4, 33, 4))
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000032"
    # the printed table and trend come from metrics.jsonl
    assert "step     loss  mlm loss" in stdout and f"{records[-1]['loss']:>8.3f}" in stdout
    loss0, loss1, _, _ = check_learning(records)
    assert f"loss {loss0:.3f} -> {loss1:.3f}" in stdout
    # the Hugging Face export and the fill-mask predictions
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "hf_model")
    assert len(tokenizer) == len(vocab)
    assert "the city was founded in 1200 as a [MASK] on the river." in stdout
    assert stdout.count("      -> '") == 3
    summary = stdout.split("=== done in")[1].splitlines()[1:]
    for where in ("dump", "HDF5 shards", "TensorBoard", "checkpoint", "Hugging Face model"):
        assert any(line.strip().startswith(where) for line in summary), where
    assert len({line.index(" /") for line in summary if line.strip()}) == 1  # the paths start in one column
    assert f"    checkpoint       {run / 'checkpoints' / 'step00000032'}" in summary  # the tag `latest` names


def _records(losses: list[float], accuracies: list[float]) -> list[dict]:
    return [{"step": i + 1, "loss": loss, "mlm_loss": loss - 0.7, "nsp_loss": 0.7, "mlm_accuracy": acc, "lr": 1e-3,
             "seq_per_s": 10.0} for i, (loss, acc) in enumerate(zip(losses, accuracies))]


def test_check_learning_fails_loudly_when_nothing_is_learned():
    good = _records([8.0, 7.5, 7.0, 6.0], [0.01, 0.05, 0.08, 0.12])
    assert check_learning(good) == (8.0, 6.0, 0.01, 0.12)
    with pytest.raises(DemoError, match="the loss did not fall: 6.000 .* 8.000"):
        check_learning(_records([6.0, 7.0, 7.5, 8.0], [0.1] * 4))
    with pytest.raises(DemoError, match="MLM accuracy did not rise"):
        check_learning(_records([8.0, 7.5, 7.0, 6.0], [0.1, 0.1, 0.1, 0.1]))
    with pytest.raises(DemoError, match="only 3 logged steps; need at least 4"):
        check_learning(good[:3])
    # eight records: means over the first and the last two, not the end records alone
    eight = _records([8.0, 7.5, 7.4, 7.0, 6.9, 6.6, 6.5, 6.0], [0.0, 0.02, 0.03, 0.05, 0.06, 0.08, 0.09, 0.13])
    assert check_learning(eight) == pytest.approx((7.75, 6.25, 0.01, 0.11), abs=1e-12)
    with pytest.raises(DemoError, match=r"the loss did not fall: 7.000 over the first 2 logged steps, 7.000 over"):
        check_learning(_records([8.0, 6.0, 7.0, 7.0, 7.0, 7.0, 6.0, 8.0], [0.1] * 8))
    table = progress_table(good, rows=2).splitlines()
    assert len(table) == 3 and table[1].split()[:2] == ["1", "8.000"] and table[2].split()[:2] == ["4", "6.000"]
    # The first record has no throughput yet where a step is logged before any was timed (--log_freq 1 or 2)
    good[0]["seq_per_s"] = None
    assert progress_table(good, rows=2).splitlines()[1].split()[-1] == "0"


@pytest.mark.parametrize("args, message", [
    (["--max_steps", "0"], "argument --max_steps: must be >= 1, got 0"),
    (["--processes", "0"], "argument --processes: must be >= 1, got 0"),
    (["--log_freq", "0"], "argument --log_freq: must be >= 1, got 0"),
    (["--articles", "1"], "--articles must be >= 4 (the dump has one article of each kind), got 1"),
    (["--articles", "3"], "--articles must be >= 4 (the dump has one article of each kind), got 3"),
    # refused by the data pipeline's checks, before the settings are recorded: a refused value had stayed in
    # demo_settings.json, and the corrected rerun was refused as "made with other settings"
    (["--seed", "-1"], "seed must be >= 0"),
    (["--vocab_size", "5"], "--vocab_size 5 leaves no room for word pieces"),
    (["--processes", "3"], "--processes 3 does not divide the demo preset's global batch of 32 sequences; pass one "
                           "of 1, 2, 4, 8, 16, 32"),
    (["--output_dir", "{file}/demo"], "{file} is a file, not a directory; pass a directory"),
    (["--max_steps", "30"], "--max_steps 30 with --log_freq 10 logs 3 steps; the demo needs at least 4 to see a "
                            "trend: raise --max_steps or lower --log_freq"),
])
def test_bad_flags_are_refused_before_the_pipeline_runs(args: list[str], message: str, tmp_path: Path,
                                                        monkeypatch, capsys):
    """They failed after the data pipeline (--processes 0: launch.sh's '--devices_per_node must be a positive
    integer', a flag the user never gave) or with a traceback (--articles 1, an --output_dir under a file)."""
    import scripts.demo as demo

    file = tmp_path / "a_file"
    file.write_text("not a directory\n")

    def reached(cfg):
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "run_demo", reached)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--output_dir", str(tmp_path / "out")] + [a.format(file=file) for a in args])
    assert exit_info.value.code == 2
    assert message.format(file=file) in capsys.readouterr().err
    assert not (tmp_path / "out" / "demo_settings.json").exists()


def test_a_failed_demo_says_so_and_exits_1(tmp_path: Path, monkeypatch, capsys):
    """`make demo` must fail where the pipeline or a check of what was learned failed, with one line, no traceback."""
    import scripts.demo as demo
    from data.stage import PipelineError

    for error in (PipelineError("the dump is truncated"), DemoError("the loss did not fall")):
        def fail(cfg, error=error):
            raise error

        monkeypatch.setattr(demo, "run_demo", fail)
        assert demo.main(["--output_dir", str(tmp_path / "out")]) == 1
        assert capsys.readouterr().err == f"demo failed: {error}\n"


def test_every_process_count_the_demo_takes_keeps_its_global_batch():
    """--processes 4 ran the data pipeline, then launch.sh refused the preset's micro batch 16 on 4 processes."""
    from scripts.demo import micro_batch
    from training.presets import load_preset, resolve

    assert [micro_batch(p) for p in (1, 2, 3, 4, 8, 16, 32, 64)] == [16, 16, None, 8, 4, 2, 1, None]
    for processes in (1, 2, 4, 8, 16, 32):
        run = resolve(load_preset("demo", {"micro_batch_per_device": micro_batch(processes)}), 1, processes)
        assert run.micro_batch_per_device * run.gradient_accumulation_steps * processes == 32


def test_a_rerun_with_other_settings_is_refused_before_it_touches_the_output(tmp_path: Path, monkeypatch, capsys):
    """README's own `make demo DEMO_ARGS="--max_steps 600 --articles 2400"` after a `make demo` overwrote the dump,
    then was refused deep in the pipeline (another extraction) or by the checkpoint's schedule (found by an
    audit). The settings the directory was made with are recorded on its first run."""
    import scripts.demo as demo

    started = []
    monkeypatch.setattr(demo, "run_demo", started.append)
    out = tmp_path / "demo"
    assert demo.main(["--output_dir", str(out)]) == 0 and len(started) == 1
    assert json.loads((out / "demo_settings.json").read_text()) == {"articles": 1200, "vocab_size": 2048,
                                                                     "max_steps": 300, "seed": 12345}
    # The same settings, spelled out, and those that do not change what is made: a rerun that continues.
    assert demo.main(["--output_dir", str(out), "--max_steps", "300", "--processes", "4", "--log_freq", "5"]) == 0
    assert len(started) == 2
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--output_dir", str(out), "--max_steps", "600", "--articles", "2400"])
    assert exit_info.value.code == 2 and len(started) == 2
    assert (f"{out} holds a demo made with other settings: --articles 2400 (made with 1200), --max_steps 600 (made "
            "with 300). Its finished stages and checkpoint would not take them: pass another --output_dir for these "
            f"settings (make demo DEMO_ARGS=\"... --output_dir results/demo-2\"), or delete {out} (make clean) to "
            "start over") in capsys.readouterr().err
    assert demo.main(["--output_dir", str(tmp_path / "demo-2"), "--max_steps", "600", "--articles", "2400"]) == 0


@pytest.mark.parametrize("record", ['{"articles": 1200, "vocab_size": 2048, "max_steps": 300}', '[1200, 2048, 300, 1]',
                                    '{"articles": 1200,'])
def test_a_settings_record_this_demo_did_not_write_is_refused(record: str, tmp_path: Path, monkeypatch, capsys):
    """A record without a key, of another shape or cut short is neither taken as matching nor a traceback."""
    import scripts.demo as demo

    monkeypatch.setattr(demo, "run_demo", lambda cfg: pytest.fail("the demo started"))
    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo_settings.json").write_text(record)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--output_dir", str(out)])
    assert exit_info.value.code == 2
    assert (f"{out / 'demo_settings.json'} is not a record this demo wrote; delete {out} (make clean) to start "
            "over") in capsys.readouterr().err
    assert (out / "demo_settings.json").read_text() == record


def test_a_run_that_logged_nothing_is_a_demo_error(tmp_path: Path):
    from scripts.demo import read_metrics

    with pytest.raises(DemoError, match=re.escape(f"{tmp_path / 'metrics.jsonl'} is missing: the training run logged "
                                                  "nothing")):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 7.5}\n\n{"step": 20, "loss": 7.0}\n')
    assert read_metrics(tmp_path) == [{"step": 10, "loss": 7.5}, {"step": 20, "loss": 7.0}]


def test_training_is_launched_on_cpu_with_one_thread_per_rank_unless_told_otherwise(tmp_path: Path, monkeypatch):
    """What the demo hands launch.sh: this interpreter, one OpenMP thread per rank (2 ranks on 2 cores), DeepSpeed's
    CPU accelerator unless the caller chose one, and the micro batch that keeps the preset's global batch."""
    import scripts.demo as demo
    from scripts.demo import DemoConfig, train

    started = []

    def launched(cmd, env, cwd):
        started.append((cmd, env, cwd))
        return subprocess.CompletedProcess(cmd, returncode)

    monkeypatch.setattr(demo.subprocess, "run", launched)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    returncode = 0
    cfg = DemoConfig(output_dir=tmp_path, processes=4, seed=7, log_freq=5)
    assert train(cfg, tmp_path / "data", tmp_path / "model.json") == tmp_path / "run"
    cmd, env, cwd = started.pop()
    assert (env["PYTHON"], env["OMP_NUM_THREADS"], env["DS_ACCELERATOR"], cwd) == (sys.executable, "1", "cpu", ROOT)
    assert cmd[:2] == ["bash", str(ROOT / "scripts" / "launch.sh")]
    assert cmd[cmd.index("--devices_per_node") + 1] == "4" and cmd[cmd.index("--output_dir") + 1] == str(tmp_path / "run")
    sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    assert sets == [f"model_config={tmp_path / 'model.json'}", "micro_batch_per_device=8"]  # no max_steps: the preset's
    assert cmd[cmd.index("--") + 1:] == ["--log_freq", "5", "--eval_freq", "50", "--seed", "7", "--num_workers", "1"]

    monkeypatch.setenv("DS_ACCELERATOR", "hpu")
    train(DemoConfig(output_dir=tmp_path, max_steps=40), tmp_path / "data", tmp_path / "model.json")
    cmd, env, _ = started.pop()
    assert env["DS_ACCELERATOR"] == "hpu" and "max_steps=40" in cmd and "micro_batch_per_device=16" in cmd

    returncode = 1
    with pytest.raises(DemoError, match=f"training failed .*; its files are in {re.escape(str(tmp_path / 'run'))}$"):
        train(cfg, tmp_path / "data", tmp_path / "model.json")
    started.clear()
    with pytest.raises(DemoError, match="3 processes do not divide the demo preset's global batch"):
        train(DemoConfig(output_dir=tmp_path, processes=3), tmp_path / "data", tmp_path / "model.json")
    assert started == []
