"""Every flag of the command lines reaches what it sets. Each command is given every flag with a value other than
its default, and the settings it builds (its stage's config, the commands it starts) must hold those values: a
flag whose value a command dropped, taking the default instead, fails here. What each setting then does is
tested with its stage (test_data_*.py, test_train_*.py, test_launch.py, test_export_hf.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import clear_rendezvous

ROOT = Path(__file__).resolve().parents[1]
WORKERS = (os.cpu_count() or 1) + 3  # not --workers' default (the cores) on any machine


class Reached(Exception):
    """Raised by a stand-in for a stage, with the config the command line built for it."""


def stand_in(monkeypatch, module: types.ModuleType, name: str) -> None:
    def reached(cfg, *args, **kwargs):
        raise Reached(cfg)

    monkeypatch.setattr(module, name, reached)


def config_of(main, argv: list[str]):
    with pytest.raises(Reached) as exc:
        main(argv)
    return exc.value.args[0]


def changed(cfg, default) -> set[str]:
    return {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)}


def test_given_options_are_those_named_whatever_their_value():
    import argparse

    from data.cli import given_options

    p = argparse.ArgumentParser()
    p.add_argument("--vocab_size", type=int, default=30522)
    p.add_argument("--name", default="wikicorpus_en")
    p.add_argument("--no_lower_case", dest="lower_case", action="store_false")
    p.add_argument("--output_dir", type=Path, required=True)
    assert given_options(p, ["--output_dir", "o"]) == {"output_dir"}
    assert given_options(p, ["--output_dir", "o", "--vocab_size", "30522", "--name=wikicorpus_en"]) == \
        {"output_dir", "vocab_size", "name"}
    assert given_options(p, ["--output_dir", "o", "--vocab_s", "30522", "--no_lower_case"]) == \
        {"output_dir", "vocab_size", "lower_case"}  # an abbreviation counts too


# ----------------------------------------------------------------------------- data stages


def test_download_flags_reach_its_config(monkeypatch, tmp_path):
    from data import download

    stand_in(monkeypatch, download, "download")
    cfg = config_of(download.main, ["--url", "https://example.org/d.xml.bz2", "--output_dir", str(tmp_path),
                                    "--retries", "2"])
    assert cfg == download.DownloadConfig("https://example.org/d.xml.bz2", tmp_path, retries=2)
    cfg = config_of(download.main, ["--dump_date", "20240101", "--mirror", "https://mirror.example/", "--output_dir",
                                    str(tmp_path), "--no_verify"])
    assert cfg.url == "https://mirror.example/enwiki/20240101/enwiki-20240101-pages-articles-multistream.xml.bz2"
    assert not cfg.verify


def test_extract_segment_and_tokens_flags_reach_their_configs(monkeypatch):
    from data import extract, segment, tokens

    stand_in(monkeypatch, extract, "extract")
    cfg = config_of(extract.main, ["--input", "d.xml.bz2", "--output_dir", "out", "--workers", str(WORKERS),
                                   "--articles_per_part", "33"])
    assert cfg == extract.ExtractConfig(Path("d.xml.bz2"), Path("out"), WORKERS, 33)
    stand_in(monkeypatch, segment, "segment")
    cfg = config_of(segment.main, ["--input_dir", "ex", "--output_dir", "out", "--workers", str(WORKERS)])
    assert cfg == segment.SegmentConfig(Path("ex"), Path("out"), WORKERS)
    stand_in(monkeypatch, tokens, "tokenize_with_given_vocab")
    cfg = config_of(tokens.main, ["--input_dir", "se", "--vocab_file", "v.txt", "--output_dir", "out",
                                  "--no_lower_case", "--workers", str(WORKERS)])
    assert cfg == tokens.TokenizeConfig(Path("se"), Path("v.txt"), Path("out"), False, WORKERS)


def test_vocab_flags_reach_its_config(monkeypatch):
    from data import vocab

    stand_in(monkeypatch, vocab, "build_vocab")
    cfg = config_of(vocab.main, ["--output_dir", "out", "--corpus_dir", "se", "--vocab_size", "3000",
                                 "--min_frequency", "5", "--limit_alphabet", "50", "--no_lower_case", "--workers",
                                 str(WORKERS)])
    assert cfg == vocab.VocabConfig(Path("out"), None, Path("se"), 3000, False, 5, 50, WORKERS)
    cfg = config_of(vocab.main, ["--output_dir", "out", "--vocab_file", "v.txt"])
    assert (cfg.vocab_file, cfg.corpus_dir) == (Path("v.txt"), None)


def test_create_and_shard_flags_reach_their_configs(monkeypatch):
    from data import create, shard

    stand_in(monkeypatch, create, "create")
    cfg = config_of(create.main, ["--input_dir", "tok", "--vocab_file", "v.txt", "--output_dir", "inst",
                                  "--max_seq_length", "256", "--max_predictions_per_seq", "40", "--dupe_factor", "3",
                                  "--short_seq_prob", "0.3", "--masked_lm_prob", "0.12", "--whole_word_masking",
                                  "--dynamic_masking", "--test_fraction", "0.05", "--seed", "7", "--workers",
                                  str(WORKERS)])
    assert cfg == create.CreateConfig(Path("tok"), Path("v.txt"), Path("inst"), 256, 40, 3, 0.3, 0.12, True, False,
                                      0.05, 7, WORKERS)
    stand_in(monkeypatch, shard, "shard")
    cfg = config_of(shard.main, ["--instances_dir", "inst", "--output_dir", "h5", "--num_shards", "9",
                                 "--num_test_shards", "2", "--name", "wiki", "--hdf5_compression", "gzip",
                                 "--workers", str(WORKERS)])
    assert cfg == shard.ShardConfig(Path("inst"), Path("h5"), 9, 2, "wiki", WORKERS, "gzip")


def test_prepare_flags_reach_its_config(monkeypatch):
    from data import prepare
    from data.prepare import PrepareConfig

    stand_in(monkeypatch, prepare, "prepare")
    given = config_of(prepare.main, [
        "--input", "d.xml.bz2", "--output_dir", "out", "--text_dir", "text", "--vocab_file", "v.txt",
        "--max_seq_length", "256", "--max_predictions_per_seq", "40", "--dupe_factor", "3", "--short_seq_prob", "0.3",
        "--masked_lm_prob", "0.12", "--whole_word_masking", "--dynamic_masking", "--test_fraction", "0.05", "--seed",
        "7", "--num_shards", "9", "--num_test_shards", "2", "--articles_per_part", "33", "--name", "wiki",
        "--hdf5_compression", "lzf", "--workers", str(WORKERS)])
    assert given == PrepareConfig(
        Path("d.xml.bz2"), Path("out"), Path("v.txt"), max_seq_length=256, max_predictions_per_seq=40, dupe_factor=3,
        num_shards=9, num_test_shards=2, seed=7, workers=WORKERS, text_dir=Path("text"), short_seq_prob=0.3,
        masked_lm_prob=0.12, whole_word_masking=True, static_masking=False, test_fraction=0.05,
        articles_per_part=33, name="wiki", hdf5_compression="lzf")
    trained = config_of(prepare.main, ["--dump_date", "20240101", "--mirror", "https://mirror.example",
                                       "--output_dir", "out", "--vocab_size", "3000", "--min_frequency", "5",
                                       "--limit_alphabet", "50", "--no_lower_case", "--phase", "2", "--no_verify"])
    assert trained == PrepareConfig(
        "https://mirror.example/enwiki/20240101/enwiki-20240101-pages-articles-multistream.xml.bz2", Path("out"),
        max_seq_length=512, max_predictions_per_seq=80, lower_case=False, vocab_size=3000, min_frequency=5,
        limit_alphabet=50, verify_download=False)
    # between them, every setting was given a value other than its default
    default = PrepareConfig(Path("d.xml.bz2"), Path("out"))
    assert changed(given, default) | changed(trained, default) == {f.name for f in dataclasses.fields(PrepareConfig)
                                                                  if f.name != "output_dir"}


def _sentences(directory: Path, text: str) -> Path:
    from data import segment, stage

    directory.mkdir()
    (directory / "part-00000.txt").write_text(text, encoding="utf-8")
    stage.finish(directory, {stage.VERSION_KEY: segment.FORMAT_VERSION}, {})
    return directory


def test_min_frequency_and_workers_reach_the_vocab_trainer(tmp_path, monkeypatch):
    """--min_frequency 10 merges only the pairs of the frequent words, so the vocab comes out smaller than with
    the default 2, which merges those of the words seen 3 times too."""
    import random

    from data import vocab

    rnd = random.Random(0)
    word = lambda: "".join(rnd.choice("bcdfghklmnprstvz") + rnd.choice("aeiou") for _ in range(3))  # noqa: E731
    frequent, seen_thrice = [word() for _ in range(5)], [word() for _ in range(40)]
    corpus = _sentences(tmp_path / "sentences", " ".join(frequent * 20 + seen_thrice * 3) + "\n")
    counted = []
    bounded_map = vocab.bounded_map

    def recording(fn, items, workers):
        counted.append(workers)
        return bounded_map(fn, items, workers)

    monkeypatch.setattr(vocab, "bounded_map", recording)
    vocab.main(["--corpus_dir", str(corpus), "--output_dir", str(tmp_path / "ten"), "--vocab_size", "2000",
                "--min_frequency", "10", "--workers", str(WORKERS)])
    assert counted == [WORKERS]
    ten = vocab.load_vocab(tmp_path / "ten" / "vocab.txt")
    two = vocab.build_vocab(vocab.VocabConfig(tmp_path / "two", corpus_dir=corpus, vocab_size=2000))
    assert ten.size < two.size < 2000


def test_demo_dump_flags(tmp_path, capsys):
    from data.demo_dump import generate_demo_dump, main

    assert main(["--output", str(tmp_path / "seed3.xml.bz2"), "--articles", "5", "--seed", "3"]) == 0
    assert ": 5 articles, " in capsys.readouterr().out
    assert main(["--output", str(tmp_path / "default-seed.xml.bz2"), "--articles", "5"]) == 0
    assert (tmp_path / "seed3.xml.bz2").read_bytes() != (tmp_path / "default-seed.xml.bz2").read_bytes()
    capsys.readouterr()
    # The defaults are the documented 400 articles and seed 12345.
    assert main(["--output", str(tmp_path / "default.xml.bz2")]) == 0
    assert ": 400 articles, " in capsys.readouterr().out
    reference = generate_demo_dump(tmp_path / "reference.xml.bz2", articles=400, seed=12345).path
    assert (tmp_path / "default.xml.bz2").read_bytes() == reference.read_bytes()
    capsys.readouterr()
    assert main(["--output", str(tmp_path / "two.xml.bz2"), "--articles", "2"]) == 2
    assert capsys.readouterr().err == "error: articles must be >= 4 (one of each kind), got 2\n"
    assert not (tmp_path / "two.xml.bz2").exists()


# ----------------------------------------------------------------------------- scripts


def test_prepare_wikicorpus_script_passes_its_settings_to_both_phases(tmp_path):
    """The interpreter is a stand-in that records each data.prepare command."""
    record = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {record}\necho "---" >> {record}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "DUMP"}
    env |= {"PYTHON": str(stub), "DUMP_DATE": "20240101", "MIRROR": "https://mirror.example", "WORKERS": "5",
            "NUM_SHARDS": "9", "TEST_SHARDS": "3", "TEST_FRACTION": "0.05"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_wikicorpus.sh"), "out", "my-vocab.txt"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [call.strip("\n").split("\n") for call in record.read_text().split("---\n") if call]
    out = tmp_path / "out"
    assert calls == [["-m", "data.prepare", "--dump_date", "20240101", "--mirror", "https://mirror.example",
                      "--vocab_file", str(vocab), "--phase", str(phase), "--output_dir", str(out / f"phase{phase}"),
                      "--text_dir", str(out / "text"), "--num_shards", "9", "--num_test_shards", "3",
                      "--test_fraction", "0.05", "--workers", "5"]
                     for phase, vocab in ((1, tmp_path / "my-vocab.txt"), (2, out / "phase1" / "vocab.txt"))]


@pytest.mark.parametrize("dump, no_verify, passed", [
    ("file:///data/enwiki.xml.bz2", "", ["--input", "file:///data/enwiki.xml.bz2"]),  # was "$PWD/file:/data/..."
    ("HTTPS://mirror.example/enwiki.xml.bz2", "1", ["--input", "HTTPS://mirror.example/enwiki.xml.bz2", "--no_verify"]),
    ("", "1", ["--dump_date", "20261101", "--mirror", "https://dumps.wikimedia.org", "--no_verify"]),
    ("", "0", ["--dump_date", "20261101", "--mirror", "https://dumps.wikimedia.org"]),  # verified
    ("dump.xml.bz2", "1", "error: environment variable NO_VERIFY applies to a dump this script downloads, and "
                          "DUMP=dump.xml.bz2 is a local file; unset NO_VERIFY\n"),
    ("", "yes", "error: environment variable NO_VERIFY must be 1 or 0, got 'yes'\n"),
])
def test_prepare_wikicorpus_script_passes_dump_urls_as_they_are_and_no_verify(tmp_path, dump, no_verify, passed):
    record = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {record}\necho "---" >> {record}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DUMP", "DUMP_DATE", "MIRROR", "NO_VERIFY")}
    env |= {"PYTHON": str(stub), "DUMP": dump, "NO_VERIFY": no_verify}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_wikicorpus.sh"), "out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    if isinstance(passed, str):
        assert (proc.returncode, proc.stderr) == (2, passed) and not record.exists()
        return
    assert proc.returncode == 0, proc.stderr
    calls = [call.strip("\n").split("\n") for call in record.read_text().split("---\n") if call]
    assert len(calls) == 2 and all(call[2:2 + len(passed)] == passed for call in calls)
    assert all(("--no_verify" in call) == (no_verify == "1") for call in calls)


@pytest.mark.parametrize("var, value", [("DUMP_DATE", "20240101"), ("MIRROR", "https://mirror.example")])
def test_prepare_wikicorpus_script_refuses_download_settings_beside_a_given_dump(tmp_path, var, value):
    """They were dropped without a word (data.prepare refuses --mirror beside --input the same way)."""
    record = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {record}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DUMP_DATE", "MIRROR")}
    env |= {"PYTHON": str(stub), "DUMP": "dump.xml.bz2", var: value}
    script = ROOT / "scripts" / "prepare_wikicorpus.sh"
    proc = subprocess.run(["bash", str(script), "out"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stderr) == (2, f"error: environment variable {var} applies to the download, and "
                                                 f"DUMP=dump.xml.bz2 is given instead of one; unset {var}, or unset "
                                                 "DUMP to download\n")
    assert not record.exists()
    del env[var]
    assert subprocess.run(["bash", str(script), "out"], cwd=tmp_path, env=env, timeout=60).returncode == 0
    assert f"--input\n{tmp_path / 'dump.xml.bz2'}\n" in record.read_text()


def test_prepare_wikicorpus_script_defaults_absolute_paths_usage_and_a_failed_phase(tmp_path):
    """Absolute paths pass as given (a test of relative ones alone let '/data/out' become '$PWD//data/out'); the
    defaults are the documented ones, the workers every usable core (nproc alone gave OMP_NUM_THREADS, often 1);
    a wrong argument count prints the usage; a failed phase 1 stops the script."""
    record = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {record}\necho "---" >> {record}\n'
                    'exit "${STUB_EXIT:-0}"\n')
    stub.chmod(0o755)
    script = str(ROOT / "scripts" / "prepare_wikicorpus.sh")
    env = {k: v for k, v in os.environ.items()
           if k not in ("DUMP", "DUMP_DATE", "MIRROR", "NO_VERIFY", "WORKERS", "NUM_SHARDS", "TEST_SHARDS",
                        "TEST_FRACTION")} | {"PYTHON": str(stub), "OMP_NUM_THREADS": "1"}
    out, vocab = tmp_path / "abs out", tmp_path / "vocab.txt"
    proc = subprocess.run(["bash", script, str(out), str(vocab)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [call.strip("\n").split("\n") for call in record.read_text().split("---\n") if call]
    assert calls[0] == ["-m", "data.prepare", "--dump_date", "20261101", "--mirror", "https://dumps.wikimedia.org",
                        "--vocab_file", str(vocab), "--phase", "1", "--output_dir", str(out / "phase1"), "--text_dir",
                        str(out / "text"), "--num_shards", "256", "--num_test_shards", "8", "--test_fraction", "0.02",
                        "--workers", str(len(os.sched_getaffinity(0)))]
    assert len(calls) == 2
    record.unlink()
    failed = subprocess.run(["bash", script, str(out)], cwd=tmp_path, env=env | {"STUB_EXIT": "1"},
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and record.read_text().count("--phase\n") == 1  # phase 2 never started
    record.unlink()
    for args in ([], ["out", "vocab.txt", "extra"]):
        wrong = subprocess.run(["bash", script, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=60)
        assert wrong.returncode == 2 and "scripts/prepare_wikicorpus.sh OUTPUT_DIR [VOCAB_FILE]" in wrong.stderr, args
        assert not record.exists(), args
    leading_zero = subprocess.run(["bash", script, "out"], cwd=tmp_path, env=env | {"WORKERS": "08"},
                                  capture_output=True, text=True, timeout=60)
    assert (leading_zero.returncode, leading_zero.stderr) == (0, "")  # not bash's "value too great for base"


def test_prepare_wikicorpus_script_runs_the_checkouts_venv_else_python3(tmp_path):
    """Without PYTHON, the venv `make venv` made beside the script, not whatever python3 comes first on PATH (which
    need not have the pipeline's packages); python3 where there is no venv."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "prepare_wikicorpus.sh", project / "scripts")
    record = tmp_path / "calls.txt"
    stub = f'#!/usr/bin/env bash\necho "$0 $PWD" >> {record}\n'
    on_path = tmp_path / "bin" / "python3"
    venv = project / ".venv" / "bin" / "python"
    for interpreter in (on_path, venv):
        interpreter.parent.mkdir(parents=True)
        interpreter.write_text(stub)
        interpreter.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "DUMP_DATE", "MIRROR", "NO_VERIFY")}
    env |= {"DUMP": "dump.xml.bz2", "PATH": f"{on_path.parent}:{env['PATH']}"}
    script = ["bash", str(project / "scripts" / "prepare_wikicorpus.sh"), "out"]
    assert subprocess.run(script, cwd=tmp_path, env=env, timeout=60).returncode == 0
    assert record.read_text() == f"{venv} {project}\n" * 2  # both phases, in the project root
    record.unlink()
    shutil.rmtree(project / ".venv")
    assert subprocess.run(script, cwd=tmp_path, env=env, timeout=60).returncode == 0
    assert record.read_text() == f"{on_path} {project}\n" * 2


@pytest.mark.parametrize("nodes", [1, 2, 4, 8, 16])
def test_each_run_n_nodes_wrapper_passes_its_node_count(nodes):
    script = ROOT / "scripts" / ("run_1node.sh" if nodes == 1 else f"run_{nodes}nodes.sh")
    lines = script.read_text().splitlines()
    assert f"that sets --nodes {nodes}." in lines[1]
    assert lines[-1] == f'exec "$(dirname "${{BASH_SOURCE[0]}}")/launch.sh" --nodes {nodes} "$@"'
    assert len(list((ROOT / "scripts").glob("run_*node*.sh"))) == 5


def test_export_flags_reach_the_export(monkeypatch, capsys):
    import scripts.export_hf as export_hf

    calls = []

    def export(*args):
        calls.append(args)
        raise export_hf.ExportError("stopped")

    monkeypatch.setattr(export_hf, "export", export)
    base = ["--checkpoint", "run", "--output", "hf"]
    assert export_hf.main([*base, "--tag", "step00000008", "--config_file", "m.json", "--vocab_file", "v.txt",
                           "--do_lower_case"]) == 2
    assert export_hf.main([*base, "--no_do_lower_case"]) == 2
    assert export_hf.main(base) == 2
    assert calls == [(Path("run"), Path("hf"), "step00000008", Path("m.json"), Path("v.txt"), True),
                     (Path("run"), Path("hf"), None, None, None, False),
                     (Path("run"), Path("hf"), None, None, None, None)]


def test_demo_flags_reach_the_dump_the_pipeline_and_the_launch(monkeypatch, tmp_path, bert_vocab):
    """The dump, the data pipeline and launch.sh are stand-ins that record what they are given."""
    import data.demo_dump
    import data.prepare
    import scripts.demo as demo

    stand_in(monkeypatch, demo, "run_demo")
    out = tmp_path / "demo"
    cfg = config_of(demo.main, ["--output_dir", str(out), "--articles", "50", "--vocab_size", "900", "--max_steps",
                                "9", "--processes", "4", "--seed", "5", "--log_freq", "2"])
    assert cfg == demo.DemoConfig(out, 50, 900, 9, 4, 5, 2)
    assert changed(cfg, demo.DemoConfig()) == {f.name for f in dataclasses.fields(demo.DemoConfig)}

    dumps, prepared, launched = [], [], []

    def generate(path, articles, seed):
        dumps.append((path, articles, seed))
        return SimpleNamespace(articles=articles, redirects=0, other_namespace=0, bytes_xml=0)

    def prepare(prepare_cfg):
        prepared.append(prepare_cfg)
        return SimpleNamespace(vocab_file=bert_vocab)

    def run(cmd, **kwargs):
        launched.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(data.demo_dump, "generate_demo_dump", generate)
    monkeypatch.setattr(data.prepare, "prepare", prepare)
    monkeypatch.setattr(demo.subprocess, "run", run)
    out.mkdir(exist_ok=True)  # main() made it, recording the settings
    dump, data_dir, model_config = demo.make_data(cfg)
    assert dumps == [(dump, 50, 5)] and dump.is_relative_to(out)
    assert (prepared[0].input, prepared[0].vocab_size, prepared[0].seed) == (dump, 900, 5)
    demo.train(cfg, data_dir, model_config)
    cmd = launched[0]
    assert cmd[cmd.index("--devices_per_node") + 1] == "4" and "max_steps=9" in cmd
    assert "micro_batch_per_device=8" in cmd  # the demo preset's global batch of 32 on 4 processes
    assert cmd[cmd.index("--output_dir") + 1] == str(out / "run")
    extra = cmd[cmd.index("--") + 1:]
    assert extra[:6] == ["--log_freq", "2", "--eval_freq", "20", "--seed", "5"]


# ----------------------------------------------------------------------------- run_pretraining.py

REQUIRED = ["--deepspeed", "--input_dir", "in", "--output_dir", "out", "--config_file", "c.json", "--max_steps", "5"]


def test_schedule_flags_reach_the_schedule():
    from run_pretraining import parse_args, schedule_config
    from training.schedule import ScheduleConfig

    args = parse_args(REQUIRED + ["--learning_rate", "3e-3", "--warmup_proportion", "0.1", "--constant_proportion",
                                  "0.4", "--poly_power", "2", "--max_steps", "50"])
    assert schedule_config(args) == ScheduleConfig(base_lr=3e-3, total_steps=50, warmup_proportion=0.1,
                                                   constant_proportion=0.4, power=2.0)
    args = parse_args(REQUIRED + ["--warmup_proportion", "0.1", "--lr_decay_style", "nvidia"])
    assert schedule_config(args).decay_style == "nvidia"


def test_train_passes_local_rank_and_the_sequence_flags_on(phase1_shards, tmp_path, monkeypatch):
    """--max_seq_length and --max_predictions_per_seq the shards were not made with are refused by the loader,
    before anything is built; the accelerator set-up gets --local_rank. No process group: these are stand-ins."""
    import run_pretraining
    from training import accelerator
    from training.loader import DataConfigError

    ranks = []

    def setup(local_rank=None):
        ranks.append(local_rank)
        return accelerator.Accelerator("cpu", "gloo", torch.device("cpu"), "cpu", False)

    monkeypatch.setattr(run_pretraining.accel, "setup", setup)
    import deepspeed

    def initialize(*args, **kwargs):
        raise AssertionError("the engine was built")

    # DeepSpeed's config parser checks the config; its engine is never reached (a stub module for all of
    # DeepSpeed made this test pass only after another had imported deepspeed.runtime.config)
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(run_pretraining.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(run_pretraining.dist, "get_world_size", lambda: 1)
    base = ["--deepspeed", "--input_dir", str(phase1_shards), "--output_dir", str(tmp_path / "run"), "--config_file",
            str(ROOT / "configs" / "models" / "bert-tiny.json"), "--max_steps", "1", "--local_rank", "3", "--num_eval_samples", "0"]  # the training shards alone
    with pytest.raises(DataConfigError, match="_training_0.hdf5: .*--max_seq_length is 64"):
        run_pretraining.train(run_pretraining.parse_args([*base, "--max_seq_length", "64"]))
    with pytest.raises(DataConfigError, match="_training_0.hdf5: .*--max_predictions_per_seq is 30"):
        run_pretraining.train(run_pretraining.parse_args([*base, "--max_predictions_per_seq", "30"]))
    assert ranks == [3, 3] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("environment, expected", [(None, "3"), ("1", "1")])
def test_local_rank_flag_is_taken_unless_the_environment_sets_it(monkeypatch, environment, expected):
    """--local_rank (from DeepSpeed's launcher) when LOCAL_RANK is unset; LOCAL_RANK wins, as the help says."""
    from training import accelerator

    clear_rendezvous(monkeypatch)
    if environment is not None:
        monkeypatch.setenv("LOCAL_RANK", environment)
    ds_accelerator = types.ModuleType("deepspeed.accelerator")
    ds_accelerator.get_accelerator = lambda: SimpleNamespace(device_name=lambda: "cpu",
                                                             communication_backend_name=lambda: "gloo")
    ds = types.ModuleType("deepspeed")
    ds.accelerator, ds.init_distributed = ds_accelerator, lambda dist_backend: None
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", ds_accelerator)
    monkeypatch.setattr(accelerator, "_habana_installed", lambda: False)
    assert accelerator.setup(3).device == torch.device("cpu")
    assert os.environ["LOCAL_RANK"] == expected
