"""Reruns over existing stage directories, on the real sample: what is reused, started afresh or refused, and
what the messages say. The settings are the `phase1_shards` fixture's, whose output the reruns must equal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from data.prepare import PrepareConfig, prepare
from data.prepare import main as prepare_main
from data.segment import main as segment_main
from data.stage import PipelineError

ROOT = Path(__file__).resolve().parents[1]
# The phase1_shards fixture's settings (tests/conftest.py), but the dump and the output directory.
SETTINGS = dict(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=2, num_shards=2, num_test_shards=1,
                seed=12345, workers=1, test_fraction=0.1, articles_per_part=40)


def settings(dump: Path, out: Path, vocab: Path | None, **changes) -> PrepareConfig:
    return PrepareConfig(input=dump, output_dir=out, vocab_file=vocab, **{**SETTINGS, **changes})


def copy_run(phase1_shards: Path, out: Path) -> Path:
    shutil.copytree(phase1_shards, out)
    return out


def tokens_dir(out: Path) -> Path:
    return next((out / "text").glob("tokens_*"))


def edit_record(path: Path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def error_line(exc: pytest.ExceptionInfo[SystemExit]) -> str:
    message = str(exc.value.code)
    assert message.startswith("error: ")
    return message


# --- 5: a refusal names the setting that differs and every directory to delete -------------------------------


def test_a_refusal_names_the_settings_that_differ_and_every_directory_to_delete(phase1_shards, sample_dump,
                                                                                bert_vocab, tmp_path):
    """It showed the two parameter records, with an upstream directory as an opaque hash, and named one
    directory: the next rerun was then refused at the next stage."""
    out = copy_run(phase1_shards, tmp_path / "out")
    instances, hdf5, text = out / "instances", out / "hdf5", out / "text"
    with pytest.raises(PipelineError) as exc:
        prepare(settings(sample_dump, out, bert_vocab, dupe_factor=3))
    assert str(exc.value) == (f"{instances} holds output made with other settings:\n  dupe_factor: made with 2, now 3\n"
                              f"Use another output directory, or delete {instances}, {hdf5} to redo them.")
    with pytest.raises(PipelineError) as exc:
        prepare(settings(sample_dump, out, bert_vocab, articles_per_part=50))
    assert str(exc.value) == (
        f"{text / 'extracted'} holds output made with other settings:\n  articles_per_part: made with 40, now 50\n"
        f"Use another output directory, or delete {text / 'extracted'}, {text / 'sentences'}, {tokens_dir(out)}, "
        f"{instances}, {hdf5} to redo them.")
    # The text made again with other settings: the instances made from the old text say which setting it was.
    shutil.rmtree(text)
    with pytest.raises(PipelineError) as exc:
        prepare(settings(sample_dump, out, bert_vocab, articles_per_part=50))
    assert str(exc.value) == (
        f"{instances} holds output made with other settings:\n  its input tokens > sentences > extracted was remade: "
        f"articles_per_part: made with 40, now 50\nUse another output directory, or delete {instances}, {hdf5} to "
        "redo them.")
    shutil.rmtree(instances)
    shutil.rmtree(hdf5)
    assert prepare(settings(sample_dump, out, bert_vocab, articles_per_part=50)).shards == {"training": 2, "test": 1}


# --- 6: an output directory that cannot be one is a one-line error ---------------------------------------------


def test_an_output_directory_that_cannot_be_one_is_a_one_line_error(sample_dump, bert_vocab, phase1_shards, tmp_path):
    """They were raw NotADirectoryError / PermissionError tracebacks."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    args = ["--input", str(sample_dump), "--vocab_file", str(bert_vocab), "--workers", "1"]
    cases = [(["--output_dir", str(a_file)], f"--output_dir {a_file}: {a_file} is a file, not a directory"),
             (["--output_dir", str(a_file / "out")], f"--output_dir {a_file / 'out'}: {a_file} is a file, not a directory"),
             (["--output_dir", str(tmp_path / "out"), "--text_dir", str(a_file)],
              f"--text_dir {a_file}: {a_file} is a file, not a directory")]
    if Path("/sys/kernel").is_dir():  # sysfs: no directory can be made there, not even by root
        cases.append((["--output_dir", "/sys/kernel/bert-out"], "--output_dir /sys/kernel/bert-out cannot be created ("))
    for flags, message in cases:
        with pytest.raises(SystemExit) as exc:
            prepare_main([*args, *flags])
        assert error_line(exc).startswith(f"error: {message}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exc:  # a stage alone
        segment_main(["--input_dir", str(phase1_shards / "text" / "extracted"), "--output_dir", str(a_file)])
    assert error_line(exc) == (f"error: {a_file}: {a_file} is a file, not a directory; pass a directory path (it is "
                               "created if missing)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_an_output_directory_without_write_permission_is_a_one_line_error(sample_dump, bert_vocab, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(SystemExit) as exc:
        prepare_main(["--input", str(sample_dump), "--vocab_file", str(bert_vocab), "--output_dir", str(locked)])
    assert error_line(exc) == f"error: --output_dir {locked} is not writable; pass a directory you can write to"


# --- 7: no more worker processes than tasks ---------------------------------------------------------------------


def test_no_more_workers_are_started_than_there_are_parts_or_shards(phase1_shards, bert_vocab, tmp_path):
    """--workers 8 forked 8 processes for each stage of the sample's 3 parts (and 3 shards); the output is the same."""
    script = f"""
import json, os, sys
from pathlib import Path
from data.create import CreateConfig, create
from data.segment import SegmentConfig, segment
from data.shard import ShardConfig, shard
from data.tokens import TokenizeConfig, tokenize
forks, me = [], os.getpid()
sys.addaudithook(lambda event, args: forks.append(1) if event == "os.fork" and os.getpid() == me else None)
out, text, vocab = Path({str(tmp_path)!r}), Path({str(phase1_shards / "text")!r}), Path({str(bert_vocab)!r})
counts = {{}}
for name, run in [
        ("segment", lambda: segment(SegmentConfig(text / "extracted", out / "sentences", 8))),
        ("tokens", lambda: tokenize(TokenizeConfig(out / "sentences", vocab, out / "tokens", True, 8))),
        ("create", lambda: create(CreateConfig(out / "tokens", vocab, out / "instances", dupe_factor=2,
                                               test_fraction=0.1, workers=8))),
        ("shard", lambda: shard(ShardConfig(out / "instances", out / "hdf5", 2, 1, workers=8)))]:
    forks.clear()
    run()
    counts[name] = len(forks)
print(json.dumps(counts))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"segment": 3, "tokens": 3, "create": 3, "shard": 3}
    for name in ("training/wikicorpus_en_training_0.hdf5", "training/wikicorpus_en_training_1.hdf5",
                 "test/wikicorpus_en_test_0.hdf5"):
        with h5py.File(tmp_path / "hdf5" / name) as f, h5py.File(phase1_shards / "hdf5" / name) as g:
            assert set(f) == set(g) and all(np.array_equal(f[key][:], g[key][:]) for key in f)
