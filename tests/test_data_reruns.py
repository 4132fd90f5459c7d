"""Reruns over existing stage directories, on the real sample: what is reused, started afresh or refused, and
what the messages say. The settings are the `phase1_shards` fixture's, whose output the reruns must equal."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from data.prepare import PrepareConfig

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
