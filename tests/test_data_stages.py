"""Stages run alone through their CLIs, and a directory made with other settings is refused."""

from __future__ import annotations

import argparse
import bz2
import dataclasses
import errno
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

from data import shard as shard_stage
from data import stage
from data.cli import usable_cores
from data.create import DTYPES
from data.extract import ExtractConfig, extract
from data.prepare import PrepareConfig, duration, long_duration, prepare, preset_predictions_problem
from data.prepare import main as prepare_main
from data.stage import PipelineError
from tests.conftest import record_fsyncs

ROOT = Path(__file__).resolve().parents[1]


def test_shard_cli_reshards_the_same_instances(phase1_shards, tmp_path, capsys):
    shard_stage.main(["--instances_dir", str(phase1_shards / "instances"), "--output_dir", str(tmp_path / "hdf5"),
                      "--num_shards", "3", "--num_test_shards", "1", "--name", "wiki", "--workers", "1"])
    assert "shard:" in capsys.readouterr().out
    keys = ("input_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
    shards = []
    for i in range(3):
        with h5py.File(tmp_path / "hdf5" / "training" / f"wiki_training_{i}.hdf5", "r") as f:
            shards.append({key: f[key][:] for key in keys})
    sizes = [len(shard["input_ids"]) for shard in shards]
    assert max(sizes) - min(sizes) <= 1

    def rows(columns: list[dict]) -> list[bytes]:  # each instance as the bytes of its columns
        return sorted(b"".join(np.ascontiguousarray(c[key][i]).tobytes() for key in keys)
                      for c in columns for i in range(len(c["input_ids"])))

    # the instances the create stage wrote, each exactly once
    parts = sorted((phase1_shards / "instances" / "training").glob("part-*"))
    assert rows(shards) == rows([{key: np.load(part / f"{key}.npy") for key in keys} for part in parts])
    # and each shard takes a slice of every part
    source = {bytes(row): i for i, part in enumerate(parts) for row in np.load(part / "input_ids.npy")}
    assert all({source[bytes(row)] for row in shard["input_ids"]} == {0, 1, 2} for shard in shards)
    with pytest.raises(PipelineError, match="too few for 10000000 training shards; use fewer training shards"):
        shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", tmp_path / "other", 10**7, 1))
    # The boundary: as many test shards as test instances is one instance each; one more is refused.
    n_test = json.loads((phase1_shards / "instances" / stage.COMPLETE_FILE).read_text())["summary"]["instances"]["test"]
    with pytest.raises(PipelineError, match=f"has {n_test} test instances, too few for {n_test + 1} test shards; use "
                                            "fewer test shards or a larger --test_fraction"):
        shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", tmp_path / "one_more", 1, n_test + 1))
    assert not (tmp_path / "one_more").exists()
    one_each = shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", tmp_path / "one_each", 1, n_test))
    assert one_each.shards["test"] == one_each.instances["test"] == n_test
    test_shards = sorted((tmp_path / "one_each" / "test").glob("*.hdf5"))
    assert len(test_shards) == n_test
    for path in test_shards:
        with h5py.File(path, "r") as f:
            assert len(f["input_ids"]) == 1
    # a seed that held no document out: the advice is a larger --test_fraction, not "fewer shards"
    no_test = tmp_path / "instances_without_test"
    no_test.mkdir()
    created = json.loads((phase1_shards / "instances" / stage.COMPLETE_FILE).read_text())
    created["summary"]["instances"]["test"] = 0
    del created["files"]  # a record of no files: this directory holds none of the instances
    (no_test / stage.COMPLETE_FILE).write_text(json.dumps(created))
    with pytest.raises(PipelineError, match=r"0 test instances, too few for 1 test shard; no document was held "
                                            r"out; create the instances again with a larger --test_fraction"):
        shard_stage.shard(shard_stage.ShardConfig(no_test, tmp_path / "none", 3, 1))
    with pytest.raises(PipelineError, match="test instances .* which --num_test_shards 0 would write nowhere"):
        shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", tmp_path / "no_test", 3, 0))
    assert not (tmp_path / "no_test").exists()


@pytest.mark.parametrize("name, why", [("../escaped", "it holds a /"), ("", "it is empty")])
def test_a_shard_name_that_is_no_file_name_prefix_is_refused(phase1_shards, sample_dump, bert_vocab, tmp_path, name,
                                                             why):
    """'../escaped' wrote every shard beside the output directory, then failed with a KeyError traceback."""
    message = (f"error: --name {name!r} cannot start the shards' file names ({why}); pass a file name prefix "
               "without '/', such as wikicorpus_en")
    out = tmp_path / "run" / "hdf5"
    with pytest.raises(SystemExit) as exc:
        shard_stage.main(["--instances_dir", str(phase1_shards / "instances"), "--output_dir", str(out),
                          "--num_shards", "3", "--name", name, "--workers", "1"])
    assert str(exc.value.code) == message
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as exc:  # data.prepare refuses it before any stage runs
        prepare_main(["--input", str(sample_dump), "--output_dir", str(tmp_path / "prepared"), "--vocab_file",
                      str(bert_vocab), "--name", name])
    assert str(exc.value.code) == message
    assert not (tmp_path / "prepared").exists()


def test_a_shard_mixes_its_parts(phase1_shards, tmp_path):
    """Each shard takes a slice of every part; its rows are shuffled, not one part's slice after the other."""
    shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", tmp_path / "hdf5", 1, 1, workers=1))
    parts = sorted((phase1_shards / "instances" / "training").glob("part-*"))
    assert len(parts) == 3
    in_order = np.concatenate([np.load(part / "input_ids.npy") for part in parts])
    with h5py.File(tmp_path / "hdf5" / "training" / "wikicorpus_en_training_0.hdf5", "r") as f:
        rows = f["input_ids"][:]
    assert sorted(map(bytes, rows)) == sorted(map(bytes, in_order))  # the same instances...
    # ...with each part spread over the whole shard: the first third holds rows of all three parts.
    source = {bytes(row): i for i, part in enumerate(parts) for row in np.load(part / "input_ids.npy")}
    assert {source[bytes(row)] for row in rows[: len(rows) // 3]} == {0, 1, 2}


def test_a_shard_is_written_holding_one_shuffled_key_at_a_time(phase1_shards, tmp_path):
    """The arrays a worker allocates while writing a shard stay near its largest key, input_ids (55% of a row's
    929 bytes): reading every key's rows first and shuffling a copy of each took 1.56x the shard here, this 0.57x."""
    parts = sorted((phase1_shards / "instances" / "training").glob("part-*"))
    counts = [len(np.load(part / "next_sentence_labels.npy", mmap_mode="r")) for part in parts]
    task = shard_stage._ShardTask(tmp_path / "s.hdf5", parts, shard_stage.plan_slices(counts, 1)[0],
                                  tuple(DTYPES), {}, 7, None)
    tracemalloc.start()
    try:
        rows, size = shard_stage._write_shard(task)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == sum(counts) and size > rows * 929
    assert peak < 0.62 * size, f"{peak / size:.3f}x the shard"
    # The same rows in the same order as the shard stage's own shuffle of the concatenated parts.
    order = np.random.default_rng(7).permutation(rows)
    with h5py.File(task.path, "r") as f:
        for key in DTYPES:
            in_order = np.concatenate([np.load(part / f"{key}.npy") for part in parts])
            assert np.array_equal(f[key][:], in_order[order]), key


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


def test_a_test_fraction_that_holds_out_nothing_is_refused_before_create(phase1_shards, sample_dump, bert_vocab,
                                                                         tmp_path):
    """It failed in the shard stage, after create had recorded the fraction: the rerun with a larger
    one was then refused until instances/ was deleted."""
    cfg = dict(input=sample_dump, output_dir=tmp_path, vocab_file=bert_vocab, max_seq_length=128,
               max_predictions_per_seq=20, dupe_factor=1, num_shards=2, num_test_shards=1, seed=12345, workers=1,
               articles_per_part=40, text_dir=phase1_shards / "text")
    with pytest.raises(PipelineError, match=r"^--test_fraction 0.001 holds out no document of this corpus .*"
                                            r"--articles_per_part 40 .*pass a larger --test_fraction"):
        prepare(PrepareConfig(test_fraction=0.001, **cfg))
    assert not (tmp_path / "instances").exists()
    assert prepare(PrepareConfig(test_fraction=0.1, **cfg)).shards == {"training": 2, "test": 1}


def test_prepare_cli_downloads_a_pinned_dump_date_from_a_mirror(wiki_mirror, bert_vocab, tmp_path, capsys):
    base, site = wiki_mirror
    out = tmp_path / "out"
    prepare_main(["--dump_date", "20241201", "--mirror", base, "--output_dir", str(out), "--vocab_file",
                  str(bert_vocab), "--phase", "2", "--dupe_factor", "1", "--num_shards", "2", "--test_fraction", "0.1",
                  "--workers", "2"])
    printed = capsys.readouterr().out
    assert "prepare: 105 articles, 105 documents, 18587 sentences" in printed
    assert (out / "text" / "download" / "enwiki-20241201-pages-articles-multistream.xml.bz2").is_file()
    # The rate is over the text stages; the download's time is given beside it.
    assert re.search(r"^download: .*enwiki-20241201-pages-articles-multistream.xml.bz2 \(0.00 GB\), \d+\.\d s$", printed,
                     flags=re.M)
    assert re.search(r"^  this run: [\d.]+ MB/s \(2.6 MB of text in [\d.]+ s\); [\d.]+ s \(download [\d.]+ s, extract",
                     printed, flags=re.M)
    assert ("/enwiki/20241201/enwiki-20241201-sha1sums.txt", None) in site.requests
    with h5py.File(out / "hdf5" / "training" / "wikicorpus_en_training_0.hdf5", "r") as f:
        assert f.attrs["max_seq_length"] == 512 and f.attrs["max_predictions_per_seq"] == 80
        assert f["input_ids"].shape[1] == 512 and f["masked_lm_positions"].shape[1] == 80
    with pytest.raises(SystemExit):
        prepare_main(["--input", "x.xml.bz2", "--mirror", base, "--output_dir", str(out)])
    assert "--mirror applies to --dump_date" in capsys.readouterr().err


def test_prepare_cli_passes_its_masking_flags_and_a_phase_preset_with_an_override(phase1_shards, sample_dump,
                                                                                   bert_vocab, tmp_path):
    """--phase 2 gives the 80 predictions that --max_seq_length 256 leaves it; the masking flags reach the shards."""
    out = tmp_path / "out"
    prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(bert_vocab), "--text_dir",
                  str(phase1_shards / "text"), "--phase", "2", "--max_seq_length", "256", "--dynamic_masking",
                  "--whole_word_masking", "--masked_lm_prob", "0.2", "--dupe_factor", "1", "--num_shards", "1",
                  "--test_fraction", "0.1", "--articles_per_part", "40", "--workers", "1"])
    with h5py.File(out / "hdf5" / "training" / "wikicorpus_en_training_0.hdf5", "r") as f:
        assert dict(f.attrs) == {"max_seq_length": 256, "max_predictions_per_seq": 80, "vocab_size": 30522,
                                 "masking": "dynamic", "masked_lm_prob": 0.2, "whole_word_masking": 1,
                                 "lower_case": 1}
        assert f["input_ids"].shape[1] == 256 and "masked_lm_positions" not in f


@pytest.mark.parametrize("flags, message", [
    (["--max_seq_length", "512"], "--phase 1's --max_predictions_per_seq 20 would mask at most 20 of 512 tokens (3.9%), "
                                  "fewer than --masked_lm_prob 0.15 asks for (77)"),
    (["--masked_lm_prob", "0.2"], "--phase 1's --max_predictions_per_seq 20 would mask at most 20 of 128 tokens "
                                  "(15.6%), fewer than --masked_lm_prob 0.2 asks for (26)"),
])
def test_a_phase_preset_that_would_cap_the_masking_is_refused(flags, message, sample_dump, bert_vocab, tmp_path, capsys):
    """--max_seq_length 512 alone took phase 1's 20 predictions: shards masked 4.6% of their tokens while their
    masked_lm_prob attribute said 0.15."""
    out = tmp_path / "out"
    argv = ["--input", str(sample_dump), "--output_dir", str(out), "--vocab_file", str(bert_vocab), *flags]
    with pytest.raises(SystemExit) as exc:
        prepare_main(argv)
    assert exc.value.code == 2
    wanted = message.rsplit("(", 1)[1].rstrip(")")
    assert (f"error: {message}; pass --max_predictions_per_seq {wanted} or more (given explicitly, a smaller cap is "
            "kept)") in capsys.readouterr().err
    assert not out.exists()
    # an explicit cap is taken as given
    assert preset_predictions_problem(argparse.Namespace(phase=1, max_seq_length=512, max_predictions_per_seq=20,
                                                         masked_lm_prob=0.15)) is None


def test_gzip_shards_hold_the_same_arrays(phase1_shards, tmp_path):
    shard_stage.main(["--instances_dir", str(phase1_shards / "instances"), "--output_dir", str(tmp_path),
                      "--num_shards", "2", "--hdf5_compression", "gzip", "--workers", "2"])
    plain = gzip = 0
    for split, i in (("training", 0), ("training", 1), ("test", 0)):
        name = f"{split}/wikicorpus_en_{split}_{i}.hdf5"
        with h5py.File(tmp_path / name, "r") as fz, h5py.File(phase1_shards / "hdf5" / name, "r") as f:
            assert set(fz) == set(f)
            for key in f:
                assert fz[key].compression == "gzip" and f[key].compression is None
                assert (fz[key][:] == f[key][:]).all()
        gzip += (tmp_path / name).stat().st_size
        plain += (phase1_shards / "hdf5" / name).stat().st_size
    assert gzip < plain / 2
    print(f"gzip shards: {plain / gzip:.1f}x smaller")


def test_prepare_wikicorpus_script_makes_both_phases_from_relative_paths(sample_dump, bert_vocab, tmp_path):
    """The full-size script on the sample: relative paths are the caller's, and both phases share the text."""
    (tmp_path / "in").mkdir()
    shutil.copy(sample_dump, tmp_path / "in" / "dump.xml.bz2")
    shutil.copy(bert_vocab, tmp_path / "in" / "vocab.txt")
    env = dict(os.environ, DUMP="in/dump.xml.bz2", WORKERS="1", NUM_SHARDS="2", TEST_SHARDS="1",
               PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_wikicorpus.sh"), "out", "in/vocab.txt"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "text").iterdir()) == sorted(
        ["extracted", "sentences", next(p.name for p in (out / "text").glob("tokens_*"))])
    for phase, seq, predictions in ((1, 128, 20), (2, 512, 80)):
        assert (out / f"phase{phase}" / "vocab.txt").read_bytes() == bert_vocab.read_bytes()
        names = sorted(p.relative_to(out / f"phase{phase}" / "hdf5").as_posix()
                       for p in (out / f"phase{phase}" / "hdf5").rglob("*.hdf5"))
        assert names == ["test/wikicorpus_en_test_0.hdf5", "training/wikicorpus_en_training_0.hdf5",
                         "training/wikicorpus_en_training_1.hdf5"]
        with h5py.File(out / f"phase{phase}" / "hdf5" / names[1], "r") as f:
            assert f["input_ids"].shape[1] == seq and f["masked_lm_ids"].shape[1] == predictions
    # Phase 2 read the text phase 1 made: no second extraction.
    phase2 = proc.stdout.split("=== phase 2")[1]
    assert re.search(r"^extract: 105 articles .*, already complete$", phase2, flags=re.M)
    assert "; skipped as already complete: extract, segment, tokens (no MB/s figure" in phase2


@pytest.mark.parametrize("inside", ["instances", "hdf5/training", "vocab_training", "vocab.txt"])
def test_a_text_dir_inside_a_later_stages_directory_is_refused_before_any_stage(inside, sample_dump, bert_vocab,
                                                                                  tmp_path):
    """At vocab.txt, the copy of the vocab failed to replace the text directory after the text stages had run, with
    a traceback and a temporary file left (found by an audit)."""
    out = tmp_path / "out"
    with pytest.raises(PipelineError) as error:
        prepare(PrepareConfig(sample_dump, out, bert_vocab, text_dir=out / inside, workers=1))
    owner = inside.split("/")[0]
    writer = {"instances": "data.create", "hdf5": "data.shard",
              "vocab.txt": "data.vocab (the vocab the shards are made with)"}.get(owner, "data.vocab")
    assert str(error.value) == (f"--text_dir {out / inside} is in {out / owner}, which {writer} writes; pass a "
                                "--text_dir outside it (the default is <output_dir>/text)")
    assert not out.exists()


def test_a_directory_where_the_vocab_goes_is_refused_before_any_stage(sample_dump, bert_vocab, tmp_path):
    out = tmp_path / "out"
    (out / "vocab.txt").mkdir(parents=True)
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(out / 'vocab.txt'))} is a directory, where data.prepare "
                                            "writes the vocab the shards are made with; move it away, or pass another "
                                            "--output_dir$"):
        prepare(PrepareConfig(sample_dump, out, bert_vocab, workers=1))
    assert [p.name for p in out.iterdir()] == ["vocab.txt"]


@pytest.mark.parametrize("name, message", [
    ("missing.xml.bz2", "{dump}: no such file; pass a MediaWiki XML dump (.xml or .xml.bz2) with --input"),
    ("a directory", "{dump}: is a directory, not a file; pass a MediaWiki XML dump (.xml or .xml.bz2) with --input"),
    ("empty.xml.bz2", "{dump} is empty (0 bytes), not a dump. Download or copy it again"),
    ("notes.xml.bz2", "{dump} is not a MediaWiki XML dump: it is neither bz2-compressed nor XML"),
    ("compressed-notes.xml.bz2", "{dump} is not a MediaWiki XML dump: its text starts 'some notes, not a dump\\n', "
                                 "not with an XML tag"),
    ("page.xml", "{dump} is XML but not a MediaWiki dump: its root element is <html>, expected <mediawiki>"),
    ("blank.xml", "{dump} is empty: no XML element in it"),
    ("cut.xml.bz2", "{dump} is truncated: the bz2 stream ends before its end-of-stream marker. Download or copy it again"),
    ("damaged.xml.bz2", "{dump} is not a readable bz2 file (Invalid data stream). Download or copy it again")])
def test_a_refused_input_leaves_no_directory_behind(name, message, sample_dump, bert_vocab, tmp_path):
    """data.prepare --input /nonexistent.xml.bz2 (or a directory) made <output_dir>/text/ and then refused the
    dump, leaving it empty, where a missing --vocab_file made nothing: the dump is checked first. data.extract
    alone refused an empty or non-dump file only once it had begun its output directory. A bz2 file of something
    else, XML of another root or of no element, and a damaged or cut first bz2 block were found only once the
    stage had begun."""
    dump = tmp_path / name
    notes = b"some notes, not a dump\n"
    if name == "a directory":
        dump.mkdir()
    elif name != "missing.xml.bz2":
        dump.write_bytes({"empty.xml.bz2": b"", "compressed-notes.xml.bz2": bz2.compress(notes),
                          "page.xml": b"<html><body>a web page</body></html>\n",
                          "blank.xml": b'<?xml version="1.0"?>\n<!-- nothing yet -->\n',
                          "cut.xml.bz2": sample_dump.read_bytes()[:100_000],  # inside its first bz2 block
                          "damaged.xml.bz2": b"BZh9" + notes}.get(name, notes))
    for text_dir in ([], ["--text_dir", str(tmp_path / "text")]):
        with pytest.raises(SystemExit) as exc:
            prepare_main(["--input", str(dump), "--output_dir", str(tmp_path / "out"), "--vocab_file", str(bert_vocab),
                          *text_dir])
        assert str(exc.value.code).startswith(f"error: {message.format(dump=dump)}")
        assert not (tmp_path / "out").exists() and not (tmp_path / "text").exists()
    with pytest.raises(PipelineError, match=re.escape(message.format(dump=dump))):
        extract(ExtractConfig(dump, tmp_path / "extracted"))
    assert not (tmp_path / "extracted").exists()


def test_parts_too_small_for_nsp_negatives_are_refused_before_the_download(bert_vocab, tmp_path):
    """data.prepare --articles_per_part 1 ran to the end and wrote shards whose next_sentence_labels were all 0: a
    part's single document has no other to draw a random next from. It is refused before any stage, even the
    download of an http(s) --input (the URL here would fail)."""
    with pytest.raises(SystemExit) as exc:
        prepare_main(["--input", "http://127.0.0.1:9/dump.xml.bz2", "--output_dir", str(tmp_path / "out"),
                      "--vocab_file", str(bert_vocab), "--articles_per_part", "1"])
    assert str(exc.value.code).startswith("error: --articles_per_part 1 is below 10: the create stage draws each random "
                                          "next sentence (NSP) from the other documents of the same part")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module, flag, writer, made_as, more", [
    ("segment", "--input_dir", "data.extract", "<text_dir>/extracted", []),
    ("tokens", "--input_dir", "data.segment", "<text_dir>/sentences", ["--vocab_file", "{vocab}"]),
    ("create", "--input_dir", "data.tokens", "<text_dir>/tokens_*", ["--vocab_file", "{vocab}"]),
    ("shard", "--instances_dir", "data.create", "<output_dir>/instances", [])])
def test_a_stage_says_that_its_input_directory_does_not_exist(module, flag, writer, made_as, more, bert_vocab,
                                                              tmp_path):
    """python -m data.shard --instances_dir /nonexistent said "is not a complete data.create output; run data.create
    first", as if the directory held an unfinished run; so did the other stages for their --input_dir."""
    main = importlib.import_module(f"data.{module}").main
    more = [arg.format(vocab=bert_vocab) for arg in more]
    missing, a_file = tmp_path / "nonexistent", tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    for given, what in [(missing, "does not exist"), (a_file, "is a file, not a directory")]:
        with pytest.raises(SystemExit) as exc:
            main([flag, str(given), "--output_dir", str(tmp_path / "out"), *more])
        assert exc.value.code == (f"error: {flag} {given} {what}; pass the directory {writer} wrote ({made_as} of "
                                  "data.prepare)")
    assert not (tmp_path / "out").exists()
    missing.mkdir()  # a directory without a finished run is still said to be one
    with pytest.raises(SystemExit, match=re.escape(f"error: {missing} is not a complete ")):
        main([flag, str(missing), "--output_dir", str(tmp_path / "out"), *more])


def test_ctrl_c_in_a_stage_command_is_a_line_not_a_traceback(capsys):
    def interrupted(cfg):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exc:
        stage.cli_call(interrupted, None)
    assert exc.value.code == 130
    assert capsys.readouterr().err == "interrupted; rerun the same command to continue where it stopped\n"


@pytest.mark.parametrize("error, where, reason, fix", [
    # shutil.copyfile of the vocab: the path is the copy's destination, not the vocab given
    (OSError(errno.ENOSPC, "No space left on device", "vocab.txt", None, "out/.vocab.txt.tmp-1"),
     "out/.vocab.txt.tmp-1", "No space left on device", "free space there"),
    # h5py: errno's words, not its message of many lines
    (OSError(errno.ENOSPC, "Can't synchronously write data (file write failed: time = ...\n, errno = 28, ...)"),
     "out", "No space left on device", "free space there"),
    # a write past a file size limit (EFBIG), named by atomic_path
    (OSError(errno.EFBIG, "File too large", "out/instances/training/part-00000"),
     "out/instances/training/part-00000", "File too large", "free space there"),
    (PermissionError(errno.EACCES, "Permission denied", "out/part-00000.txt"), "out/part-00000.txt",
     "Permission denied", "make it writable (or pass another output directory)"),
    (OSError(errno.EROFS, "Read-only file system", "out/_LOCK"), "out/_LOCK", "Read-only file system",
     "make it writable (or pass another output directory)"),
])
def test_a_disk_error_in_a_stage_command_is_a_line_naming_the_path(error, where, reason, fix):
    """A full disk in any stage (python -m data.prepare on an 8 MB file system) ended in a traceback."""
    def fails(cfg):
        raise error

    with pytest.raises(SystemExit) as exc:
        stage.cli_call(fails, argparse.Namespace(output_dir=Path("out")))
    assert exc.value.code == f"error: {where}: {reason}; {fix} and rerun the same command to continue where it stopped"


def _raised_in_atomic_path(final: Path, error) -> OSError:
    """What `stage.atomic_path(final)` raises for `error`, raised in its block, where error(tmp) is the error."""
    with pytest.raises(OSError) as exc, stage.atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "input_ids.npy").write_bytes(b"\x93NUMPY")
        raise error(tmp)
    assert list(final.parent.iterdir()) == []
    return exc.value


def test_a_failed_write_in_atomic_path_names_the_final_file_and_keeps_its_type(tmp_path):
    """The write's error named no file (Path.write_bytes on a full disk) or the temporary, which is gone: the
    error names the final file instead, keeping its errno and type; an error that names another file (the source
    of a copy) is raised as it is."""
    final = tmp_path / "instances" / "part-00000"
    unnamed = _raised_in_atomic_path(final, lambda tmp: OSError(errno.ENOSPC, "No space left on device"))
    assert (type(unnamed), unnamed.errno, unnamed.strerror, unnamed.filename) == (
        OSError, errno.ENOSPC, "No space left on device", str(final))
    # a file inside a directory being written, and a copy's error, which names its source and the temporary
    for error in (lambda tmp: OSError(errno.ENOSPC, "No space left on device", str(tmp / "input_ids.npy")),
                  lambda tmp: OSError(errno.ENOSPC, "No space left on device", "vocab.txt", None, str(tmp)),
                  # a call on a file descriptor names it by its number (os.stat(fd), os.truncate(fd, n))
                  lambda tmp: OSError(errno.ENOSPC, "No space left on device", 7)):
        full = _raised_in_atomic_path(final, error)
        assert (type(full), full.errno, full.strerror, full.filename, full.filename2) == (
            OSError, errno.ENOSPC, "No space left on device", str(final), None)
        assert isinstance(full.__cause__, OSError)
    denied = _raised_in_atomic_path(final, lambda tmp: PermissionError(errno.EACCES, "Permission denied", str(tmp)))
    assert (type(denied), denied.filename) == (PermissionError, str(final))
    other = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "vocab.txt"))
    assert _raised_in_atomic_path(final, lambda tmp: other) is other


def test_atomic_path_flushes_what_it_renames_first_then_the_directory(tmp_path, monkeypatch):
    """After a power loss a part's name (and the size _COMPLETE.json records for it) must not stand for bytes
    that never reached the disk: every file and directory written at the temporary path is fsynced before the
    rename, and the directory holding the new name after it."""
    events = record_fsyncs(monkeypatch)
    part, record = tmp_path / "stage" / "part-00000", tmp_path / "stage" / "_COMPLETE.json"
    with stage.atomic_path(part) as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "ids.npy").write_bytes(b"ids")
        (tmp / "sub" / "mask.npy").write_bytes(b"mask")
    stage.write_json_atomic(record, {"done": True})
    written = str(tmp)
    assert sorted(events[:4]) == sorted([("fsync", f"{written}/ids.npy"), ("fsync", f"{written}/sub/mask.npy"),
                                         ("fsync", written), ("fsync", f"{written}/sub")])
    assert events[4:] == [("replace", str(part)), ("fsync", str(part.parent)),
                          ("fsync", str(record.parent / f".{record.name}.tmp-{os.getpid()}")),
                          ("replace", str(record)), ("fsync", str(record.parent))]
    assert (part / "sub" / "mask.npy").read_bytes() == b"mask" and json.loads(record.read_text()) == {"done": True}


def test_an_oserror_without_an_errno_keeps_its_message(tmp_path):
    """Given a path, it had become "[Errno None] None: <path>"."""
    from training.atomic import named

    error = OSError("the event file writer failed")
    assert named(error, tmp_path / "x") is error
    full = named(OSError(28, "No space left on device"), tmp_path / "x")
    assert (type(full), full.errno, full.filename) == (OSError, 28, str(tmp_path / "x"))


@pytest.mark.parametrize("error", [FileNotFoundError(errno.ENOENT, "No such file or directory", "out/x"),
                                   ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
                                   OSError("some other failure")])
def test_an_oserror_that_is_not_the_disks_state_keeps_its_traceback(error):
    """Only a full or unwritable disk becomes the one line that says to free space; any other OSError is a
    defect to report, and is not told to the user as a disk to clean up."""
    def fails(cfg):
        raise error

    with pytest.raises(type(error)) as exc:
        stage.cli_call(fails, argparse.Namespace(output_dir=Path("out")))
    assert exc.value is error


@pytest.mark.parametrize("arg, code", [("--help", 0), ("-h", 0), ("--output_dir", 2)])
def test_prepare_wikicorpus_script_takes_no_option_for_its_output_dir(arg, code, tmp_path):
    """`--help` prints the usage; it was taken for OUTPUT_DIR and started the 22 GB download into ./--help."""
    env = dict(os.environ, DUMP="/nonexistent/dump.xml.bz2", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_wikicorpus.sh"), arg, "x"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    usage = proc.stdout if code == 0 else proc.stderr
    assert "scripts/prepare_wikicorpus.sh OUTPUT_DIR [VOCAB_FILE]" in usage
    assert usage.rstrip("\n").endswith("is shared by both phases in OUTPUT_DIR/text.")  # the comment, whole
    if code:
        assert proc.stderr.startswith(f"error: unknown option {arg} ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("var, value, rule", [("WORKERS", "abc", "an integer >= 1"), ("NUM_SHARDS", "0", "an integer >= 1"),
                                              ("TEST_SHARDS", "x", "an integer >= 0"),
                                              ("TEST_FRACTION", "2", "a number in [0, 1)"),
                                              ("TEST_FRACTION", "1", "a number in [0, 1)"),
                                              ("TEST_FRACTION", "1.0", "a number in [0, 1)"),
                                              ("TEST_FRACTION", "-0.1", "a number in [0, 1)")])
def test_prepare_wikicorpus_script_names_the_environment_variable_that_is_wrong(var, value, rule, tmp_path):
    """The error named data.prepare's flag (--workers, --num_shards, ...), which the user never gave."""
    env = dict(os.environ, DUMP="/nonexistent/dump.xml.bz2", PYTHON=sys.executable, **{var: value})
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_wikicorpus.sh"), "out"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"error: environment variable {var} must be {rule}, got '{value}'\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("settings, message", [
    ({"TEST_SHARDS": "0"}, "TEST_SHARDS is 0 but TEST_FRACTION is 0.02: the held-out documents would be written "
                           "nowhere; set TEST_FRACTION=0 too, to train on every document"),
    ({"TEST_FRACTION": "0.0"}, "TEST_FRACTION is 0.0 but TEST_SHARDS is 8: no document is held out for the test "
                               "shards; set TEST_SHARDS=0 too, or a TEST_FRACTION above 0"),
    ({"TEST_FRACTION": ".0"}, "TEST_FRACTION is .0 but TEST_SHARDS is 8: no document is held out for the test "
                              "shards; set TEST_SHARDS=0 too, or a TEST_FRACTION above 0"),
    ({"TEST_FRACTION": "0"}, "TEST_FRACTION is 0 but TEST_SHARDS is 8: no document is held out for the test "
                             "shards; set TEST_SHARDS=0 too, or a TEST_FRACTION above 0"),
])
def test_prepare_wikicorpus_script_names_the_variable_that_disagrees_with_the_other(settings, message, tmp_path):
    """TEST_SHARDS=0 alone got data.prepare's error, which names --num_test_shards and --test_fraction."""
    env = {k: v for k, v in os.environ.items() if k not in ("TEST_SHARDS", "TEST_FRACTION")}
    env.update(DUMP="/nonexistent/dump.xml.bz2", PYTHON=sys.executable, **settings)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "prepare_wikicorpus.sh"), "out"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (2, f"error: environment variable {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_help_gives_the_defaults_that_say_something(capsys):
    """Each option's default is appended to its help, except a switch's on/off state, a default of None and a
    default the help names itself."""
    with pytest.raises(SystemExit) as exc:
        prepare_main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--no_lower_case keep case and accents --phase {1,2} 1: seq 128 / 20 predictions, 2: seq 512 / 80 " \
           "(explicit flags override) (default: 1) --max_seq_length" in text
    assert "--whole_word_masking mask all pieces of a word together --dynamic_masking write no static masks (no " \
           "masked_lm_* keys); the loader masks at load time --test_fraction" in text
    assert "--output_dir OUTPUT_DIR hdf5/{training,test}/, vocab.txt, instances/ --text_dir" in text
    assert f"--workers WORKERS worker processes (default: the cores this process may use, {usable_cores()} here); " \
           "the output does not depend on it" in text and text.count("(default: ") == 16


def test_the_default_workers_are_the_cores_this_process_may_use():
    """os.cpu_count() counts every CPU of the machine: in a job given 1 of them (cgroup, Slurm, taskset) each stage
    forked one worker per CPU of the node."""
    script = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
              "from data.prepare import PrepareConfig, main; from pathlib import Path; "
              "print(PrepareConfig(input=Path('d'), output_dir=Path('o')).workers); main(['--help'])")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "1"
    assert "(default: the cores this process may use, 1 here)" in " ".join(proc.stdout.split())


def test_another_dump_of_the_same_name_and_size_is_not_taken_for_the_extracted_one(tmp_path):
    def dump(directory: str, word: str) -> Path:
        page = (f"<page><title>{word}</title><ns>0</ns><id>1</id><revision><id>1</id><text>The {word} river "
                "flows north through the valley.</text></revision></page>")
        path = tmp_path / directory / "dump.xml"
        path.parent.mkdir()
        path.write_text(f"<mediawiki>\n{page}\n</mediawiki>\n", encoding="utf-8")
        return path

    first, second = dump("a", "alpha"), dump("b", "omega")
    assert first.stat().st_size == second.stat().st_size
    out = tmp_path / "extracted"
    extract(ExtractConfig(first, out))
    with pytest.raises(PipelineError, match="holds output made with other settings"):
        extract(ExtractConfig(second, out))
    assert "The alpha river" in (out / "part-00000.txt").read_text(encoding="utf-8")


# The settings of the phase1_shards fixture (tests/conftest.py), as CLI flags.
FIXTURE_FLAGS = ["--max_seq_length", "128", "--max_predictions_per_seq", "20", "--dupe_factor", "2", "--num_shards",
                 "2", "--num_test_shards", "1", "--seed", "12345", "--test_fraction", "0.1", "--articles_per_part", "40"]
STAGE_LINES = [
    "extract: 105 articles of 206 pages (not counted: 99 redirects, 1 page outside the article namespace, 1 article "
    "empty once cleaned), 3 parts, 2.6 MB of text, ",
    "segment: 105 documents, 18587 sentences, ",
    "vocab: 30522 tokens -> ",
    "tokens: 105 documents, 18587 sentences, 538619 tokens (0.002% [UNK]), ",
    "create: 10899 training + 378 test instances, ",
    "shard: 2 training + 1 test shards, 10899 + 378 instances, 10.5 MB, "]


def _stage_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.split(":")[0] in ("extract", "segment", "vocab", "tokens",
                                                                        "create", "shard")]


def test_the_summary_gives_time_and_mb_per_s_of_this_runs_work_only(sample_dump, bert_vocab, tmp_path, capsys):
    """MB/s was the whole text over the whole run, skipped stages included: a rerun that did nothing printed
    57 MB/s, partial reruns 13-35 MB/s."""
    args = ["--input", str(sample_dump), "--output_dir", str(tmp_path / "out"), "--vocab_file", str(bert_vocab),
            "--workers", "2", *FIXTURE_FLAGS]
    prepare_main(args)
    out = capsys.readouterr().out
    lines = _stage_lines(out)
    assert [line[:len(start)] for line, start in zip(lines, STAGE_LINES)] == STAGE_LINES and len(lines) == 6
    assert all(re.search(r", \d+\.\d s$", line) for line in lines)
    assert "  of the dump's 206 pages, not counted as articles: 99 redirects, 1 page outside the article namespace, " \
           "1 article empty once cleaned\n" in out
    run = re.search(r"^  this run: ([\d.]+) MB/s \(2\.6 MB of text in ([\d.]+) s\); [\d.]+ s \(extract [\d.]+ s, "
                    r"segment [\d.]+ s, vocab [\d.]+ s, tokens [\d.]+ s, create [\d.]+ s, shard [\d.]+ s\)$", out,
                    flags=re.M)
    assert run and abs(2.58 / float(run[2]) - float(run[1])) < 0.05 * float(run[1]) + 0.01
    assert "skipped" not in out and "warning" not in out
    # The summary's figures are the tokens stage's, the shard stage's and the shards' size on disk.
    hdf5 = tmp_path / "out" / "hdf5"
    megabytes = sum(p.stat().st_size for p in hdf5.rglob("*.hdf5")) / 1e6
    assert f"\nprepare: 105 articles, 105 documents, 18587 sentences, 538619 tokens (0.002% [UNK]) -> 10899 training " \
           f"+ 378 test instances in 2 + 1 shards ({megabytes:.1f} MB) under {hdf5}\n" in out and megabytes > 10

    prepare_main(args)  # nothing left to do
    out = capsys.readouterr().out
    assert all(line.endswith(", already complete") for line in _stage_lines(out)) and len(_stage_lines(out)) == 6
    assert re.search(r"^  this run: nothing to do: every stage was already complete \(extract, segment, vocab, tokens, "
                     r"create, shard\); \d+\.\d s of checks$", out, flags=re.M)
    assert "MB/s" not in out

    shutil.rmtree(tmp_path / "out" / "hdf5")  # only the shards to write again
    prepare_main(args)
    out = capsys.readouterr().out
    assert re.search(r"^  this run: [\d.]+ s \(shard [\d.]+ s\); skipped as already complete: extract, segment, "
                     r"vocab, tokens, create \(no MB/s figure: stages were skipped, so this run did not process the "
                     r"whole text\)$", out, flags=re.M)

    # Resumed: the extraction went on from the parts an earlier run wrote.
    extracted = tmp_path / "out" / "text" / "extracted"
    (extracted / "_COMPLETE.json").unlink()
    (extracted / "part-00002.txt").unlink()
    prepare_main(args)
    out = capsys.readouterr().out
    assert re.search(r"^extract: 105 articles .*, \d+\.\d s \(resumed\)$", out, flags=re.M)
    assert "this run did not process the whole text" in out and "extract went on from an earlier run" in out


def test_long_runs_give_hours_and_minutes_as_well_as_seconds(phase1_shards, sample_dump, bert_vocab, tmp_path):
    assert [duration(s) for s in (0.04, 12.34, 59.94, 125, 3725.4, 90061)] == [
        "0.0 s", "12.3 s", "59.9 s", "2 min 05 s", "1 h 02 min 05 s", "25 h 01 min 01 s"]
    assert long_duration(3725.0) == "3725.0 s = 1 h 02 min 05 s" and long_duration(12.3) == "12.3 s"
    assert long_duration(60.0) == "60.0 s = 1 min 00 s" and long_duration(59.9) == "59.9 s"
    # what rounds to 60.0 s is a minute
    assert (duration(59.96), long_duration(59.96), duration(59.949)) == ("1 min 00 s", "60.0 s = 1 min 00 s", "59.9 s")
    # A real run's summary with the stage times of a full-size one.
    out = tmp_path / "out"
    shutil.copytree(phase1_shards, out)
    result = prepare(PrepareConfig(input=sample_dump, output_dir=out, vocab_file=bert_vocab, dupe_factor=2,
                                   num_shards=2, seed=12345, workers=1, test_fraction=0.1, articles_per_part=40),
                     report=lambda line: None)
    assert [s.state for s in result.stages] == ["complete"] * 6
    hours = [dataclasses.replace(s, state="ran", seconds=t)
             for s, t in zip(result.stages, (420.0, 55.5, 0.1, 125.0, 60.0, 3000.0))]
    assert dataclasses.replace(result, stages=hours).run_line() == (
        "0.00 MB/s (2.6 MB of text in 3660.6 s = 1 h 01 min 01 s); 3660.6 s = 1 h 01 min 01 s (extract 7 min 00 s, "
        "segment 55.5 s, vocab 0.1 s, tokens 2 min 05 s, create 1 min 00 s, shard 50 min 00 s)")
    # The download is no text stage: its time is beside the rate, not in it, and a resumed download leaves the rate.
    download = dataclasses.replace(hours[0], name="download", state="resumed", seconds=1000.0)
    assert dataclasses.replace(result, stages=[download, *hours]).run_line() == (
        "0.00 MB/s (2.6 MB of text in 3660.6 s = 1 h 01 min 01 s); 4660.6 s = 1 h 17 min 41 s (download (resumed) "
        "16 min 40 s, extract 7 min 00 s, segment 55.5 s, vocab 0.1 s, tokens 2 min 05 s, create 1 min 00 s, "
        "shard 50 min 00 s)")


def test_a_failing_run_has_printed_what_its_stages_did(phase1_shards, sample_dump, bert_vocab, tmp_path, capsys):
    """Nothing was printed before the summary, so a run that failed showed no count of the stages it completed."""
    with pytest.raises(SystemExit, match="--test_fraction 0.001 holds out no document"):
        prepare_main(["--input", str(sample_dump), "--output_dir", str(tmp_path / "out"), "--vocab_file",
                      str(bert_vocab), "--workers", "1", "--text_dir", str(phase1_shards / "text"),
                      *FIXTURE_FLAGS, "--test_fraction", "0.001"])
    lines = _stage_lines(capsys.readouterr().out)
    assert [line[:len(start)] for line, start in zip(lines, STAGE_LINES)] == STAGE_LINES[:4] and len(lines) == 4


def test_a_vocab_that_leaves_many_unknown_tokens_is_warned_of(phase1_shards, sample_dump, tmp_path, capsys):
    """A vocab trained with too small an alphabet for the text (26 characters: no digits) leaves 6% [UNK];
    the summary gave the share without a word. BERT's uncased vocab leaves 0.002% (no warning, above)."""
    out = tmp_path / "out"
    # A copy of the fixture's text: this vocab's tokens would be a second tokens_* beside the fixture's own,
    # which the tests that copy the fixture's output (test_data_reruns.py) take for one of its stages.
    text = tmp_path / "text"
    shutil.copytree(phase1_shards / "text", text, ignore=shutil.ignore_patterns("tokens_*"))
    prepare_main(["--input", str(sample_dump), "--output_dir", str(out), "--text_dir", str(text),
                  "--vocab_size", "3000", "--limit_alphabet", "26", "--workers", "2", *FIXTURE_FLAGS])
    printed = capsys.readouterr().out
    warning = re.escape(f"warning: 6.06% of the tokens are [UNK] with the vocab {out / 'vocab.txt'} (a vocab that "
                        "fits the text leaves under 1%")
    assert len(re.findall(f"^{warning}", printed, flags=re.M)) == 2  # when the tokens stage ends, and in the summary
    assert printed.rstrip("\n").splitlines()[-1].startswith("warning: 6.06% of the tokens are [UNK]")


def test_the_unknown_warning_names_the_vocab_file_given(tmp_path, capsys):
    """With --vocab_file, the warning names that file (the one to replace), not its copy beside the shards."""
    pages = "".join(f"<page><title>{name}</title><ns>0</ns><id>{k}</id><revision><id>{k}</id><text>The {name} river "
                    f"flows north. It meets the sea at {k}0 old ports.\n\nA bridge crosses it near the town."
                    "</text></revision></page>" for k, name in enumerate(["alpha", "beta", "gamma"], 1))
    dump = tmp_path / "dump.xml"
    dump.write_text(f"<mediawiki>{pages}</mediawiki>\n", encoding="utf-8")
    digits = tmp_path / "digits-vocab.txt"  # no letters: every word but the numbers is [UNK]
    digits.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"0123456789", "."]) + "\n")
    out = tmp_path / "out"
    prepare_main(["--input", str(dump), "--output_dir", str(out), "--vocab_file", str(digits), "--num_shards", "1",
                  "--num_test_shards", "0", "--test_fraction", "0", "--workers", "1"])
    printed = capsys.readouterr().out
    # 23 tokens an article (20 words, each [UNK] since "10" needs "##0", and 3 full stops): 60 of 69 are [UNK]
    assert re.search(r"^prepare: 3 articles, 3 documents, 9 sentences, 69 tokens \(86\.957% \[UNK\]\)", printed,
                     flags=re.M)
    warning = f"warning: 86.96% of the tokens are [UNK] with the vocab {digits} (a vocab that fits the text leaves"
    assert [line[:len(warning)] for line in printed.splitlines() if line.startswith("warning")] == [warning] * 2


def test_sequences_longer_than_any_shipped_model_takes_are_warned_of_before_the_stages(bert_vocab, tmp_path, capsys):
    """--max_seq_length 100000 made 553 MB of instances from 2.6 MB of text, which the trainer then refused: the
    warning comes before the first stage, so that a typo costs nothing."""
    from data.create import BERT_POSITIONS
    from data.create import main as create_main

    shipped = {json.loads(p.read_text())["max_position_embeddings"] for p in (ROOT / "configs" / "models").glob("*.json")}
    assert max(shipped) == BERT_POSITIONS
    reported: list[str] = []
    missing = tmp_path / "no_dump.xml.bz2"
    with pytest.raises(PipelineError, match="no_dump.xml.bz2"):
        prepare(PrepareConfig(missing, tmp_path / "out", bert_vocab, max_seq_length=1000, max_predictions_per_seq=150,
                              workers=1), report=reported.append)
    assert reported == ["warning: --max_seq_length 1000 is above 512, the max_position_embeddings of BERT and the "
                        "most of any config in configs/models; run_pretraining.py refuses these shards unless its --config_file "
                        "has max_position_embeddings of at least 1000"]
    reported.clear()
    with pytest.raises(PipelineError):
        prepare(PrepareConfig(missing, tmp_path / "out", bert_vocab, max_seq_length=512, max_predictions_per_seq=80,
                              workers=1), report=reported.append)
    assert reported == []
    with pytest.raises(SystemExit):
        create_main(["--input_dir", str(tmp_path / "none"), "--vocab_file", str(bert_vocab), "--output_dir",
                     str(tmp_path / "instances"), "--max_seq_length", "600", "--max_predictions_per_seq", "90"])
    assert "warning: --max_seq_length 600 is above 512" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["data.prepare", "data.download", "data.extract", "data.segment", "data.vocab",
                                    "data.tokens", "data.create", "data.shard", "scripts.demo"])
def test_help_shows_the_default_of_every_option(module: str, monkeypatch):
    """data.cli.HelpFormatter appends each option's default to its help, but argparse prints nothing for an
    option without help: `data.extract --help` did not show --articles_per_part's 2000, nor `scripts/demo.py
    --help` the --output_dir, --seed and --log_freq defaults that the README states."""
    import importlib

    parsers = []

    def keep_parser(self, *args, **kwargs):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep_parser)
    with pytest.raises(SystemExit):
        importlib.import_module(module).main([])
    parser = parsers[0]
    shown = "".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            continue
        assert action.help, f"{module} {action.option_strings[0]} has no help, so its default is not shown"
        if "default" in action.help:  # the help names its default itself, as --workers does
            continue
        assert "".join(f"(default: {action.default})".split()) in shown, (module, action.option_strings[0])


class _ShortWrites:
    """A raw file whose write takes at most `most` bytes, and fails once `limit` bytes are written."""

    def __init__(self, most: int, limit: int | None = None) -> None:
        self.most, self.limit, self.data, self.calls = most, limit, bytearray(), []

    def write(self, piece) -> int:
        self.calls.append(len(piece))
        if self.limit is not None and len(self.data) >= self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        taken = bytes(piece[:self.most])
        self.data += taken
        return len(taken)


def test_files_are_written_in_pieces_whose_short_writes_are_continued():
    """One write(2) of several MiB took 7x longer than the same bytes in pieces of 1 MiB (docs/PERFORMANCE.md);
    a piece written short is continued, and a full disk raises its own error (ENOSPC), not a short count."""
    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8).tobytes()
    raw = _ShortWrites(most=1 << 21)
    assert stage.PieceWriter(raw).write(data) == len(data)
    assert bytes(raw.data) == data and raw.calls == [1 << 20] * 3 + [5]
    raw = _ShortWrites(most=300_000)
    stage.PieceWriter(raw).write(memoryview(data))
    assert bytes(raw.data) == data and raw.calls[:4] == [1 << 20, 748_576, 448_576, 148_576] and len(raw.calls) == 13
    full = _ShortWrites(most=300_000, limit=1_000_000)
    with pytest.raises(OSError) as exc:
        stage.PieceWriter(full).write(data)
    assert exc.value.errno == errno.ENOSPC and len(full.data) == 1 << 20


@pytest.mark.parametrize("array", [
    np.arange(3 * 700_000, dtype=np.int32).reshape(-1, 3),  # 8.4 MB: several pieces
    np.zeros((0, 128), dtype=np.int8),
    np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
    np.array(7, dtype=np.float32),
])
def test_save_array_writes_the_bytes_of_np_save(array, tmp_path):
    np.save(tmp_path / "numpy.npy", array)
    stage.save_array(tmp_path / "ours.npy", array)
    assert (tmp_path / "ours.npy").read_bytes() == (tmp_path / "numpy.npy").read_bytes()
    stage.write_file(tmp_path / "copy.bin", (tmp_path / "ours.npy").read_bytes())
    assert (tmp_path / "copy.bin").read_bytes() == (tmp_path / "numpy.npy").read_bytes()


class _InterruptedFile:
    """The shard's file, in which a Ctrl-C arrives once `after` bytes are written: Python runs the signal handler
    in the keeper's write, which HDF5 called, as nearly all of the shard stage's Python code runs there."""

    def __init__(self, path, after: int) -> None:
        self.raw, self.after = open(path, "w+b", buffering=0), after  # noqa: SIM115 (closed by __exit__)

    def write(self, piece) -> int:
        if self.raw.tell() + len(piece) > self.after:
            raise KeyboardInterrupt
        return self.raw.write(piece)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()


@pytest.mark.parametrize("after", [0, 100_000])
def test_ctrl_c_while_hdf5_writes_a_shard_is_a_keyboard_interrupt(after, phase1_shards, tmp_path, monkeypatch):
    """Raised inside HDF5's write callback, the KeyboardInterrupt reached h5py, which printed tracebacks and
    raised OSError("Can't close file"): the stage ended in a traceback, not the line saying how to go on."""
    monkeypatch.setattr(shard_stage, "open", lambda path, *a, **k: _InterruptedFile(path, after), raising=False)
    out = tmp_path / "hdf5"
    with pytest.raises(KeyboardInterrupt):
        shard_stage.shard(shard_stage.ShardConfig(phase1_shards / "instances", out, num_shards=2, workers=1,
                                                  compression="gzip"))
    assert [p.name for p in out.rglob("*.hdf5")] == [] and list(out.rglob(".*tmp-*")) == []


class _FailingRaw:
    """A raw file whose writes fail from the `fail_at`-th on, and whose truncate fails when told to."""

    def __init__(self, fail_at: int, truncate_fails: bool = False) -> None:
        self.fail_at, self.truncate_fails, self.writes = fail_at, truncate_fails, []

    def write(self, piece) -> int:
        self.writes.append(bytes(piece))
        if len(self.writes) >= self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(piece)

    def truncate(self, size: int) -> int:
        if self.truncate_fails:
            raise OSError(errno.EFBIG, "File too large")
        return size


def test_the_shard_writer_keeps_the_first_error_and_writes_nothing_after_it():
    raw = _FailingRaw(fail_at=2)
    keeper = shard_stage._WriteErrorKeeper(raw)
    assert [keeper.write(b"ab"), keeper.write(b"cde"), keeper.write(b"f")] == [2, 3, 1]
    assert raw.writes == [b"ab", b"cde"] and keeper.error.errno == errno.ENOSPC
    assert keeper.truncate(10) == 10  # skipped too
    truncated = shard_stage._WriteErrorKeeper(_FailingRaw(fail_at=99, truncate_fails=True))
    assert truncated.truncate(10) == 10 and truncated.error.errno == errno.EFBIG


def test_an_error_of_h5py_itself_leaves_no_shard(phase1_shards, tmp_path):
    """No write failed, so nothing was kept: h5py's own error is raised, and the temporary removed."""
    task = shard_stage._ShardTask(tmp_path / "s.hdf5", [phase1_shards / "instances" / "training" / "part-00000"],
                                  [(0, 0, 10)], ("next_sentence_labels",), {"unstorable": object()}, 0, None)
    with pytest.raises(TypeError):
        shard_stage._write_shard(task)
    assert list(tmp_path.iterdir()) == []


def test_save_array_refuses_what_only_a_pickle_can_save(tmp_path):
    with pytest.raises(ValueError, match="pickle"):
        stage.save_array(tmp_path / "objects.npy", np.array([{}, None], dtype=object))
