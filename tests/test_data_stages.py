"""Stages run alone through their CLIs, and a directory made with other settings is refused."""

from __future__ import annotations

import shutil

import h5py
import pytest

from data import shard as shard_stage
from data.prepare import PrepareConfig, prepare
from data.stage import PipelineError


def test_shard_cli_reshards_the_same_instances(phase1_shards, tmp_path, capsys):
    shard_stage.main(["--instances_dir", str(phase1_shards / "instances"), "--output_dir", str(tmp_path / "hdf5"),
                      "--num_shards", "3", "--num_test_shards", "1", "--name", "wiki", "--workers", "1"])
    assert "shard:" in capsys.readouterr().out
    sizes, labels = [], []
    for i in range(3):
        with h5py.File(tmp_path / "hdf5" / "training" / f"wiki_training_{i}.hdf5", "r") as f:
            sizes.append(len(f["input_ids"]))
            labels.append(f["next_sentence_labels"][:].sum())
    original = 0
    for path in (phase1_shards / "hdf5" / "training").glob("*.hdf5"):
        with h5py.File(path, "r") as f:
            original += len(f["input_ids"])
    assert sum(sizes) == original and max(sizes) - min(sizes) <= 1
    with pytest.raises(PipelineError, match="too few for"):
        shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", tmp_path / "other", 10**7, 1))


def test_rerun_with_other_settings_is_refused(phase1_shards, sample_dump, bert_vocab, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(phase1_shards, out)
    cfg = dict(input=sample_dump, output_dir=out, vocab_file=bert_vocab, max_seq_length=128,
               max_predictions_per_seq=20, num_shards=2, num_test_shards=1, seed=12345, workers=1,
               test_fraction=0.1, articles_per_part=40)
    # Same settings: everything is complete, nothing to do.
    assert prepare(PrepareConfig(dupe_factor=2, **cfg)).instances["training"] > 0
    with pytest.raises(PipelineError, match=r"instances holds output made with other settings"):
        prepare(PrepareConfig(dupe_factor=3, **cfg))
