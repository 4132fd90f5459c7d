"""Reruns over existing stage directories, on the real sample: what is reused, started afresh or refused, and
what the messages say. The settings are the `phase1_shards` fixture's, whose output the reruns must equal."""

from __future__ import annotations

import bz2
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_data_resume import assert_same_output

from data import stage
from data.create import main as create_main
from data.extract import ExtractConfig, extract
from data.parallel import bounded_map
from data.prepare import PrepareConfig, prepare
from data.prepare import main as prepare_main
from data.segment import SegmentConfig, segment
from data.segment import main as segment_main
from data.shard import ShardConfig, shard
from data.shard import main as shard_main
from data.stage import COMPLETE_FILE, PARAMS_FILE, PipelineError
from data.tokens import TokenizeConfig, tokenize
from data.tokens import main as tokens_main
from data.vocab import VocabConfig, build_vocab
from data.vocab import main as vocab_main

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


# --- 1: data.create alone checks the vocab against the tokens' own ---------------------------------------


def test_create_refuses_a_vocab_other_than_the_one_the_tokens_were_made_with(phase1_shards, bert_vocab, tmp_path):
    """It wrote shards whose ids index another vocab, silently."""
    lines = bert_vocab.read_text(encoding="utf-8").split("\n")
    lines[2000], lines[2001] = lines[2001], lines[2000]  # a real vocab of the same size: two ids swapped
    other = tmp_path / "other-vocab.txt"
    other.write_text("\n".join(lines), encoding="utf-8")
    tokens = tokens_dir(phase1_shards)
    with pytest.raises(SystemExit) as exc:
        create_main(["--input_dir", str(tokens), "--vocab_file", str(other), "--output_dir", str(tmp_path / "inst"),
                     "--workers", "1"])
    assert error_line(exc) == (
        f"error: {tokens} was tokenized with the vocab {phase1_shards / 'vocab.txt'} (sha1 "
        f"{stage.file_sha1(bert_vocab)[:10]}...), not with --vocab_file {other} (sha1 {stage.file_sha1(other)[:10]}...), "
        "so its ids would stand for other tokens. Pass the vocab it was made with, or tokenize the text again with "
        "this vocab into another directory (python -m data.tokens)")
    assert not (tmp_path / "inst").exists()


# --- 2: a failed stage does not refuse the fix its own error asked for ----------------------------------------


def test_a_dump_put_right_after_a_failed_extraction_is_extracted(phase1_shards, sample_dump, bert_vocab, tmp_path,
                                                                capsys):
    """The truncated dump's error says to download it again; the rerun on the good dump was refused ('holds output
    made with other settings')."""
    dump, out = tmp_path / "dump.xml.bz2", tmp_path / "out"
    dump.write_bytes(sample_dump.read_bytes()[:1_000_000])  # its first bz2 blocks are whole: the stage begins
    with pytest.raises(PipelineError, match=r"is truncated: .* Download or copy it again"):
        prepare(settings(dump, out, bert_vocab))
    assert (out / "text" / "extracted" / PARAMS_FILE).is_file()
    shutil.copyfile(sample_dump, dump)
    capsys.readouterr()
    prepare(settings(dump, out, bert_vocab))
    printed = capsys.readouterr().out
    assert (f"{out / 'text' / 'extracted'}: discarding the unfinished output of an earlier run with other settings "
            f"(input.bytes: made with 1000000, now {sample_dump.stat().st_size}; input.ends_sha1: made with ") in printed
    # Begun afresh, so its line does not say it went on from the earlier run.
    assert re.search(r"^extract: 105 articles .*\d s$", printed, flags=re.M)
    assert_same_output(out, phase1_shards)


def test_a_vocab_size_raised_after_a_refused_one_trains_the_vocab(phase1_shards, sample_dump, tmp_path, capsys):
    """'--vocab_size 100 ... raise --vocab_size', then --vocab_size 3000 was refused at vocab_training."""
    text = tmp_path / "text"
    shutil.copytree(phase1_shards / "text", text, ignore=shutil.ignore_patterns("tokens_*"))
    out = tmp_path / "out"
    with pytest.raises(PipelineError, match="raise --vocab_size"):
        prepare(settings(sample_dump, out, None, vocab_size=100, text_dir=text))
    result = prepare(settings(sample_dump, out, None, vocab_size=3000, text_dir=text))
    assert (f"{out / 'vocab_training'}: discarding the unfinished output of an earlier run with other settings "
            "(vocab_size: made with 100, now 3000); it cannot serve these, so this stage starts afresh\n") \
        in capsys.readouterr().out
    # the vocab and shards of a run that never failed
    whole = tmp_path / "whole"
    prepare(settings(sample_dump, whole, None, vocab_size=3000, text_dir=text))
    assert len(result.vocab_file.read_text(encoding="utf-8").splitlines()) == 3000
    assert_same_output(out, whole)


def test_a_run_into_a_directory_another_run_is_writing_is_refused_and_takes_nothing(phase1_shards, sample_dump,
                                                                                      tmp_path):
    """Starting unfinished output afresh deletes it: a run that is still writing it must be refused, not
    emptied. A real extraction is stopped (SIGSTOP) while it holds extracted/, then let go."""
    out = tmp_path / "extracted"
    proc = subprocess.Popen([sys.executable, "-m", "data.extract", "--input", str(sample_dump), "--output_dir",
                             str(out), "--workers", "1", "--articles_per_part", "40"], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / PARAMS_FILE).is_file():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGSTOP)  # the process group this test started
        assert not (out / COMPLETE_FILE).exists()
        before = sorted(p.name for p in out.iterdir())
        for articles_per_part in (50, 40):  # other settings, and the same ones
            with pytest.raises(PipelineError, match=rf"^{re.escape(str(out))} is being written by another run "
                                                    rf"\(process {proc.pid}\); wait for it to finish, or stop it"):
                extract(ExtractConfig(sample_dump, out, articles_per_part=articles_per_part))
        assert sorted(p.name for p in out.iterdir()) == before
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    expected = sorted((phase1_shards / "text" / "extracted").glob("part-*.txt"))
    assert [p.read_bytes() for p in sorted(out.glob("part-*.txt"))] == [p.read_bytes() for p in expected]
    assert not (out / stage.LOCK_FILE).exists()  # a finished stage keeps no lock file


# Run data.segment, SIGKILLed right after it writes its _COMPLETE.json, before it releases its lock.
_KILLED_AFTER_COMPLETE = """
import os, signal, sys
from data import segment, stage
write = stage.write_json_atomic
def write_then_die(path, obj, compact=False):
    write(path, obj, compact)
    if path.name == stage.COMPLETE_FILE:
        os.kill(os.getpid(), signal.SIGKILL)
stage.write_json_atomic = write_then_die
segment.main(sys.argv[1:])
"""


def test_a_run_killed_between_its_completion_record_and_its_unlock_leaves_no_lock_file(phase1_shards, tmp_path):
    """The rerun found the stage finished and returned, so the killed run's _LOCK stayed for good."""
    extracted, sentences = phase1_shards / "text" / "extracted", tmp_path / "sentences"
    proc = subprocess.run([sys.executable, "-c", _KILLED_AFTER_COMPLETE, "--input_dir", str(extracted),
                           "--output_dir", str(sentences), "--workers", "1"], cwd=ROOT, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (sentences / COMPLETE_FILE).is_file() and (sentences / stage.LOCK_FILE).is_file()
    segment(SegmentConfig(extracted, sentences))
    assert not (sentences / stage.LOCK_FILE).exists()
    assert _same_parts(sentences, phase1_shards / "text" / "sentences", "part-*.txt")


def _killed_before_part(whole: Path, copy: Path, part: str) -> dict:
    """A copy of the finished stage directory `whole` as a run killed before it wrote `part` left it; returns the
    summary the uninterrupted run recorded."""
    shutil.copytree(whole, copy)
    (copy / COMPLETE_FILE).unlink()
    (copy / part).unlink()
    return json.loads((whole / COMPLETE_FILE).read_text())["summary"]


def _same_parts(a: Path, b: Path, pattern: str) -> bool:
    return [p.read_bytes() for p in sorted(a.glob(pattern))] == [p.read_bytes() for p in sorted(b.glob(pattern))]


def test_a_resumed_segmentation_counts_the_parts_an_earlier_run_wrote(phase1_shards, tmp_path, monkeypatch):
    """Parts on disk are reused, not segmented again, and counted as the run that wrote them counted them."""
    import data.segment

    whole, sentences = phase1_shards / "text" / "sentences", tmp_path / "sentences"
    summary = _killed_before_part(whole, sentences, "part-00001.txt")  # killed before its second part
    segmented = []
    segment_text = data.segment.segment_text
    monkeypatch.setattr(data.segment, "segment_text", lambda text: segmented.append(text) or segment_text(text))
    result = segment(SegmentConfig(phase1_shards / "text" / "extracted", sentences, workers=1))  # calls seen here
    assert len(segmented) == 1  # part 1 alone, the one the killed run had not written
    assert (result.documents, result.sentences) == (summary["documents"], summary["sentences"]) == (105, 18587)
    assert result.text_bytes == summary["text_bytes"]
    assert _same_parts(sentences, whole, "part-*.txt")


def test_a_segmented_part_whose_write_fails_is_not_left_to_be_reused_cut_short(phase1_shards, tmp_path, monkeypatch):
    """A full disk (or a kill) while a part is written leaves no part under its name, which a rerun would take
    for a finished one."""
    import errno

    extracted, sentences = phase1_shards / "text" / "extracted", tmp_path / "sentences"
    write_file = stage.write_file

    def full_disk_in_part_1(path, data):
        if "part-00001" in path.name:
            write_file(path, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_file(path, data)

    monkeypatch.setattr(stage, "write_file", full_disk_in_part_1)
    with pytest.raises(OSError, match="No space left"):
        segment(SegmentConfig(extracted, sentences, workers=1))
    assert not (sentences / "part-00001.txt").exists()
    monkeypatch.undo()
    segment(SegmentConfig(extracted, sentences))
    assert _same_parts(sentences, phase1_shards / "text" / "sentences", "part-*.txt")


def test_a_resumed_tokenization_counts_the_parts_an_earlier_run_wrote(phase1_shards, tmp_path):
    """Parts on disk are reused, and their tokens and [UNK]s counted as the run that wrote them counted them."""
    whole, tokens = tokens_dir(phase1_shards), tmp_path / "tokens"
    summary = _killed_before_part(whole, tokens, "part-00002.npz")  # its last part; parts 0 and 1 hold 10 [UNK]s
    result = tokenize(TokenizeConfig(phase1_shards / "text" / "sentences", phase1_shards / "vocab.txt", tokens))
    assert (result.documents, result.sentences, result.tokens, result.unknown_tokens) == (
        summary["documents"], summary["sentences"], summary["tokens"], summary["unknown_tokens"]) == (
        105, 18587, 538619, 11)
    assert _same_parts(tokens, whole, "part-*.npz")


def test_a_directory_of_files_this_stage_did_not_make_is_refused(sample_dump, tmp_path):
    """Starting afresh deletes a stage directory's files: files without the stage's parameter record were not made
    by it (a directory given by mistake), so they are refused, not deleted."""
    out = tmp_path / "extracted"
    out.mkdir()
    for name in ("notes.txt", "part-00000.txt", "thesis.tex", "zeta"):
        (out / name).write_text(name)
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(out))} holds files \(notes.txt, part-00000.txt, "
                                            rf"thesis.tex, \.\.\.\) but no {PARAMS_FILE}, so this stage did not make "
                                            "them; pass a new or empty directory$"):
        extract(ExtractConfig(sample_dump, out, articles_per_part=40))
    # left exactly as it was: not even the lock file the refusal took stays behind
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        name: name for name in ("notes.txt", "part-00000.txt", "thesis.tex", "zeta")}


@pytest.mark.parametrize("command, given, made_by, wanted, where, flags", [
    # create and shard gave a KeyError traceback; tokens, segment and vocab read the text of the wrong stage
    (create_main, "sentences", "data.segment", "data.tokens", "<text_dir>/tokens_*", ["--vocab_file", "VOCAB"]),
    (shard_main, "tokens", "data.tokens", "data.create", "<output_dir>/instances", []),
    (tokens_main, "extracted", "data.extract", "data.segment", "<text_dir>/sentences", ["--vocab_file", "VOCAB"]),
    (segment_main, "sentences", "data.segment", "data.extract", "<text_dir>/extracted", []),
    (vocab_main, "extracted", "data.extract", "data.segment", "<text_dir>/sentences", ["--vocab_size", "2000"]),
], ids=["create", "shard", "tokens", "segment", "vocab"])
def test_a_stage_given_another_stages_directory_names_it_and_the_stage_that_made_it(
        phase1_shards, bert_vocab, tmp_path, command, given, made_by, wanted, where, flags):
    source = tokens_dir(phase1_shards) if given == "tokens" else phase1_shards / "text" / given
    flag = {shard_main: "--instances_dir", vocab_main: "--corpus_dir"}.get(command, "--input_dir")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        command([flag, str(source), "--output_dir", str(out),
                 *(str(bert_vocab) if f == "VOCAB" else f for f in flags)])
    assert error_line(exc) == (f"error: {source} was made by {made_by}, not by {wanted}; pass the directory "
                               f"{wanted} wrote ({where} of data.prepare)")
    assert not (out / COMPLETE_FILE).exists()


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != stage.LOCK_FILE}


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "unfinished"])
def test_a_stage_given_another_stages_directory_as_its_output_refuses_it_and_keeps_it(phase1_shards, tmp_path,
                                                                                      finished):
    """data.segment --output_dir <its --input_dir> was refused as 'made with other settings' with the advice to
    delete its input; data.shard --output_dir <an unfinished instances directory> emptied it to start afresh."""
    out = copy_run(phase1_shards, tmp_path / "out")
    if finished:
        command, target = segment_main, out / "text" / "extracted"
        argv = ["--input_dir", str(target)]
        message = (f"error: {target} holds the output of data.extract, not of data.segment; pass data.segment "
                   "another --output_dir (data.prepare writes it to <text_dir>/sentences)")
    else:
        command, target = shard_main, out / "instances"
        (target / COMPLETE_FILE).unlink()  # as a killed data.create leaves it
        argv = ["--instances_dir", str(phase1_shards / "instances"), "--num_shards", "2"]
        message = (f"error: {target} holds the output of data.create, not of data.shard; pass data.shard "
                   "another --output_dir (data.prepare writes it to <output_dir>/hdf5)")
    before = _files(target)
    with pytest.raises(SystemExit) as exc:
        command([*argv, "--output_dir", str(target), "--workers", "1"])
    assert error_line(exc) == message
    assert _files(target) == before


def test_a_write_that_fails_leaves_no_temporary_behind(phase1_shards, tmp_path):
    """A shard or part whose write fails (a full disk) must not keep its partial bytes on the disk until a rerun."""
    shard = tmp_path / "training" / "wikicorpus_en_training_0.hdf5"
    with pytest.raises(OSError, match="No space left"), stage.atomic_path(shard) as tmp:
        tmp.write_bytes((phase1_shards / "hdf5" / "training" / shard.name).read_bytes()[:100_000])
        raise OSError(28, "No space left on device")
    part = tmp_path / "training" / "part-00000"  # data.create writes a directory of arrays
    with pytest.raises(OSError, match="No space left"), stage.atomic_path(part) as tmp:
        tmp.mkdir()
        (tmp / "input_ids.npy").write_bytes(b"\x93NUMPY")
        raise OSError(28, "No space left on device")
    assert list((tmp_path / "training").iterdir()) == []


def test_a_dump_that_differs_only_in_its_last_bytes_is_another_input(sample_dump, tmp_path):
    """A dump is known by its name, size and the sha1 of its first and last MiB (not of all 22 GB of it)."""
    data = sample_dump.read_bytes()
    assert len(data) > 1 << 20
    other = tmp_path / sample_dump.name
    other.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    ours, theirs = stage.file_identity(sample_dump), stage.file_identity(other)
    assert (ours["name"], ours["bytes"]) == (theirs["name"], theirs["bytes"]) == (sample_dump.name, len(data))
    assert ours["ends_sha1"] != theirs["ends_sha1"]


# --- 3: output of another version of a stage is not reused ---------------------------------------------------


def test_finished_output_of_another_version_of_its_stage_is_refused(phase1_shards, sample_dump, bert_vocab,
                                                                      tmp_path):
    out = copy_run(phase1_shards, tmp_path / "out")
    sentences, tokens = out / "text" / "sentences", tokens_dir(out)
    # The sentences tokenized with a second vocab too: those tokens are made from them as well.
    other_vocab = tmp_path / "other-vocab.txt"
    other_vocab.write_text(bert_vocab.read_text(encoding="utf-8") + "zzyzx\n", encoding="utf-8")
    other = out / "text" / f"tokens_{stage.file_sha1(other_vocab)[:10]}_uncased"
    tokenize(TokenizeConfig(sentences, other_vocab, other))
    edit_record(sentences / COMPLETE_FILE, lambda r: r["params"].pop("format_version", None))  # as older code wrote it
    with pytest.raises(PipelineError) as exc:
        prepare(settings(sample_dump, out, bert_vocab))
    assert str(exc.value) == (
        f"{sentences} holds output made with other settings:\n  made by another version of this stage (output "
        "format from before format versions were recorded; this code writes format 1)\nUse another output "
        f"directory, or delete {sentences}, {', '.join(map(str, sorted([tokens, other])))}, {out / 'instances'}, "
        f"{out / 'hdf5'} to redo them.")
    # data.create alone refuses tokens of another version of data.tokens
    edit_record(tokens / COMPLETE_FILE, lambda r: r["params"].update(format_version=0))
    with pytest.raises(SystemExit) as exc:
        create_main(["--input_dir", str(tokens), "--vocab_file", str(bert_vocab), "--output_dir",
                     str(tmp_path / "instances")])
    assert error_line(exc).startswith(f"error: {tokens} was made by another version of the stage that writes it "
                                      "(output format 0; this code reads format 1)\n")


def test_extracted_text_of_another_version_of_extraction_is_refused(phase1_shards, sample_dump, bert_vocab, tmp_path):
    out = copy_run(phase1_shards, tmp_path / "out")
    extracted = out / "text" / "extracted"
    edit_record(extracted / COMPLETE_FILE, lambda r: r["params"].pop("format_version", None))
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(extracted))} holds output made with other settings:\n"
                                            r"  made by another version of this stage .*\nUse another output "
                                            rf"directory, or delete {re.escape(str(extracted))}, "):
        prepare(settings(sample_dump, out, bert_vocab))


def test_unfinished_output_of_another_version_of_its_stage_is_started_afresh(phase1_shards, sample_dump, bert_vocab,
                                                                             tmp_path, capsys):
    out = copy_run(phase1_shards, tmp_path / "out")
    shutil.rmtree(out / "hdf5")
    instances = out / "instances"
    (instances / COMPLETE_FILE).unlink()
    edit_record(instances / PARAMS_FILE, lambda r: r["params"].pop("format_version", None))
    # a part as older code might have written it: a rerun that kept it would shard it
    labels = instances / "training" / "part-00001" / "next_sentence_labels.npy"
    np.save(labels, 1 - np.load(labels))
    prepare(settings(sample_dump, out, bert_vocab))
    assert (f"{instances}: discarding the unfinished output of an earlier run with other settings (made by another "
            "version of this stage (output format from before format versions were recorded; this code writes "
            "format 1)); it cannot serve these, so this stage starts afresh\n") in capsys.readouterr().out
    assert_same_output(out, phase1_shards)


# --- 4: finished files are checked by their sizes; files that cannot be read are named -------------------------


@pytest.mark.parametrize("damaged, redo", [
    ("hdf5/training/wikicorpus_en_training_0.hdf5", ["hdf5"]),
    ("instances/training/part-00001/input_ids.npy", ["instances", "hdf5"]),
    ("text/tokens_*/part-00001.npz", ["text/tokens_*", "instances", "hdf5"]),
])
def test_a_finished_file_cut_short_is_named_with_what_to_delete(phase1_shards, sample_dump, bert_vocab, tmp_path,
                                                               damaged, redo):
    """A shard cut short after a finished run was reported as fine; a cut tokens part or instance array gave a
    raw traceback (zipfile.BadZipFile, 'mmap length is greater than file size') once a later stage read it."""
    out = copy_run(phase1_shards, tmp_path / "out")
    path = next(out.glob(damaged))
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(PipelineError) as exc:
        prepare(settings(sample_dump, out, bert_vocab))
    redo_dirs = [next(out.glob(name)) for name in redo]
    assert str(exc.value) == (
        f"{redo_dirs[0]} was finished, but its files changed since: {path} is 1000 bytes, not the {size} it had\n"
        f"Use another output directory, or delete {', '.join(map(str, redo_dirs))} to redo "
        f"{'it' if len(redo_dirs) == 1 else 'them'}.")


def test_a_finished_file_grown_since_is_named(phase1_shards, tmp_path):
    """Sizes are compared both ways: a shard replaced by a longer file (another run's) is not the one finished."""
    hdf5 = tmp_path / "hdf5"
    shutil.copytree(phase1_shards / "hdf5", hdf5)
    shard = hdf5 / "training" / "wikicorpus_en_training_0.hdf5"
    size = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(bytes(10))
    with pytest.raises(PipelineError, match=rf"^{re.escape(str(hdf5))} was finished, but its files changed since: "
                                            rf"{re.escape(str(shard))} is {size + 10} bytes, not the {size} it had\n"):
        stage.finished_record(hdf5)


def test_a_tokens_part_cut_short_is_named_by_data_create_alone(phase1_shards, bert_vocab, tmp_path):
    tokens = tmp_path / "tokens"
    shutil.copytree(tokens_dir(phase1_shards), tokens)
    part = tokens / "part-00002.npz"
    with part.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(SystemExit) as exc:
        create_main(["--input_dir", str(tokens), "--vocab_file", str(bert_vocab), "--output_dir",
                     str(tmp_path / "instances"), "--workers", "1"])
    assert error_line(exc).startswith(f"error: {tokens} was finished, but its files changed since: {part} is 1000 "
                                      "bytes")


def test_a_shard_cut_short_in_an_unfinished_shard_stage_is_named(phase1_shards, tmp_path):
    """It gave h5py's raw OSError ('truncated file')."""
    hdf5 = tmp_path / "hdf5"
    shutil.copytree(phase1_shards / "hdf5", hdf5)
    (hdf5 / COMPLETE_FILE).unlink()
    shard = hdf5 / "training" / "wikicorpus_en_training_1.hdf5"
    with shard.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(SystemExit) as exc:
        shard_main(["--instances_dir", str(phase1_shards / "instances"), "--output_dir", str(hdf5), "--num_shards",
                    "2", "--workers", "1"])
    assert re.fullmatch(rf"error: {re.escape(str(shard))} cannot be read as a shard \(.*truncated file.*\); it was "
                        "damaged after this stage wrote it: delete it and rerun to write it again", error_line(exc))


@pytest.mark.parametrize("damaged, kind", [("text/tokens_*/part-00001.npz", "a tokenized part"),
                                           ("instances/test/part-00000/input_ids.npy", "an array of instances")])
def test_a_finished_file_damaged_at_its_size_is_named_when_read(phase1_shards, tmp_path, damaged, kind):
    """Sizes are what is checked; a file damaged in place reaches the stage that reads it, which names it."""
    out = copy_run(phase1_shards, tmp_path / "out")
    path = next(out.glob(damaged))
    path.write_bytes(bytes(path.stat().st_size))
    if damaged.startswith("text"):
        args = ["--input_dir", str(path.parent), "--vocab_file", str(out / "vocab.txt"), "--output_dir",
                str(tmp_path / "instances"), "--workers", "1"]
        main, redo = create_main, f"delete {path.parent} and the directories made from it, and tokenize again"
    else:
        args = ["--instances_dir", str(out / "instances"), "--output_dir", str(tmp_path / "hdf5"), "--num_shards", "2",
                "--workers", "1"]
        main, redo = shard_main, (f"delete {out / 'instances'} and the directories made from it, and create the "
                                  "instances again")
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert re.fullmatch(rf"error: {re.escape(str(path))} cannot be read as {kind} \(.+\); it was damaged after "
                        rf"data\.\w+ wrote it: {re.escape(redo)}", error_line(exc))


@pytest.mark.parametrize("stage_main", ["tokens", "vocab"])
def test_sentences_damaged_at_their_size_are_named_by_the_stages_that_read_them(phase1_shards, bert_vocab, tmp_path,
                                                                                stage_main):
    """Text that is not UTF-8 any more: data.tokens and data.vocab ended in a UnicodeDecodeError traceback."""
    import importlib

    sentences = tmp_path / "sentences"
    shutil.copytree(phase1_shards / "text" / "sentences", sentences)
    part = sentences / "part-00001.txt"
    data = bytearray(part.read_bytes())
    data[100] = 0xFF
    part.write_bytes(bytes(data))
    main = importlib.import_module(f"data.{stage_main}").main
    args = (["--input_dir", str(sentences), "--vocab_file", str(bert_vocab)] if stage_main == "tokens"
            else ["--corpus_dir", str(sentences), "--vocab_size", "2000"])
    with pytest.raises(SystemExit) as exc:
        main([*args, "--output_dir", str(tmp_path / "out"), "--workers", "1"])
    assert re.fullmatch(rf"error: {re.escape(str(part))} is not UTF-8 text \(.*0xff in position 100.*\); it was "
                        rf"damaged after it was written: delete {re.escape(str(sentences))} and the directories made "
                        "from it, and segment again", error_line(exc))


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


@pytest.mark.parametrize(("change", "line"), [
    ({"name": "bookcorpus"}, 'name: made with "wikicorpus_en", now "bookcorpus"'),
    ({"compression": "gzip"}, 'compression: made with nothing, now "gzip"'),
])
def test_shards_asked_for_under_another_name_or_compression_are_refused(phase1_shards, tmp_path, change, line):
    """Each setting of the shard stage decides its files: a rerun that changes one was told its shards were
    complete and kept the old ones."""
    out = copy_run(phase1_shards, tmp_path / "out")
    same = ShardConfig(out / "instances", out / "hdf5", num_shards=2, num_test_shards=1)
    assert shard(same).shards == {"training": 2, "test": 1}  # the same settings: done already
    with pytest.raises(PipelineError, match=re.escape(f"{out / 'hdf5'} holds output made with other settings:\n"
                                                      f"  {line}")):
        shard(ShardConfig(**{**same.__dict__, **change}))


@pytest.mark.parametrize(("change", "line"), [({"min_frequency": 50}, "min_frequency: made with 2, now 50"),
                                              ({"limit_alphabet": 200}, "limit_alphabet: made with 1000, now 200")])
def test_a_trained_vocab_asked_for_with_other_training_settings_is_refused(phase1_shards, tmp_path, change, line):
    cfg = VocabConfig(tmp_path / "vocab", corpus_dir=phase1_shards / "text" / "sentences", vocab_size=1500)
    first = build_vocab(cfg)
    assert build_vocab(cfg).path.read_bytes() == first.path.read_bytes()
    with pytest.raises(PipelineError, match=re.escape(f"{tmp_path / 'vocab' / 'vocab_training'} holds output made with other "
                                                      f"settings:\n  {line}")):
        build_vocab(VocabConfig(**{**cfg.__dict__, **change}))


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


def test_an_output_directory_without_write_permission_is_a_one_line_error(sample_dump, bert_vocab, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    # Root may write into a directory of any mode, but not into an immutable one (as CI runs).
    lock, unlock = (["chattr", "+i", str(locked)], ["chattr", "-i", str(locked)]) if os.geteuid() == 0 else (
        ["chmod", "555", str(locked)], ["chmod", "755", str(locked)])
    subprocess.run(lock, check=True)
    try:
        with pytest.raises(SystemExit) as exc:
            prepare_main(["--input", str(sample_dump), "--vocab_file", str(bert_vocab), "--output_dir", str(locked)])
        assert error_line(exc) == f"error: --output_dir {locked} is not writable; pass a directory you can write to"
        assert list(locked.iterdir()) == []
    finally:
        subprocess.run(unlock, check=True)


@pytest.mark.parametrize("which", ["vocab", "dump", "xml"])
def test_an_input_file_that_cannot_be_read_is_named_with_its_flag(sample_dump, bert_vocab, which):
    """A vocab without read permission was "Permission denied; make it writable (or pass another output
    directory)", and a dump "not a readable bz2 file ...; download it again", a plain .xml one too. Run as a
    user without the permission: root reads any file, so as root the command runs as nobody (setpriv), in a
    directory that user may enter."""
    work = Path(tempfile.mkdtemp(prefix="unreadable-"))
    try:
        work.chmod(0o777)
        vocab, dump = work / "vocab.txt", work / ("dump.xml" if which == "xml" else "dump.xml.bz2")
        shutil.copyfile(bert_vocab, vocab)
        if which == "xml":
            dump.write_bytes(bz2.decompress(sample_dump.read_bytes()))
        else:
            shutil.copyfile(sample_dump, dump)
        unreadable = vocab if which == "vocab" else dump
        unreadable.chmod(0)
        for readable in {vocab, dump} - {unreadable}:
            readable.chmod(0o644)
        as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        proc = subprocess.run([*as_user, sys.executable, "-m", "data.prepare", "--input", str(dump), "--vocab_file",
                               str(vocab), "--output_dir", str(work / "out"), "--workers", "1"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        flag = "--vocab_file" if which == "vocab" else "--input"
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: {flag} {unreadable}: cannot read it (Permission denied); make it readable by the user running "
            "this (e.g. chmod a+r), or pass a copy that is")
        assert not (work / "out").exists()
    finally:
        shutil.rmtree(work)


# --- 7: no more worker processes than tasks ---------------------------------------------------------------------


def test_no_more_workers_are_started_than_there_are_parts_or_shards(phase1_shards, bert_vocab, sample_dump, tmp_path):
    """--workers 8 forked 8 processes for each stage of the sample's 3 parts (and 3 shards), and --workers 64 as
    many for the extraction of its 7 chunks; the output is the same."""
    script = f"""
import json, os, sys
from pathlib import Path
from data.create import CreateConfig, create
from data.extract import ExtractConfig, extract
from data.parallel import bounded_map
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
forks.clear()  # the extraction's chunks come from a generator, which bounded_map cannot count
extract(ExtractConfig(Path({str(sample_dump)!r}), out / "extracted", 64, 40))
counts["extract"] = len(forks)
counts["chunks"] = len(json.loads((out / "extracted" / "_chunk_articles.json").read_text())["articles"])
print(json.dumps(counts))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    assert counts == {"segment": 3, "tokens": 3, "create": 3, "shard": 3, "extract": 7, "chunks": 7}
    for name in ("training/wikicorpus_en_training_0.hdf5", "training/wikicorpus_en_training_1.hdf5",
                 "test/wikicorpus_en_test_0.hdf5"):
        with h5py.File(tmp_path / "hdf5" / name) as f, h5py.File(phase1_shards / "hdf5" / name) as g:
            assert set(f) == set(g) and all(np.array_equal(f[key][:], g[key][:]) for key in f)


def _square_late_if_even(x: int) -> int:
    """x * x, the even ones 50 ms late: the results of later items are ready before theirs."""
    time.sleep(0.05 if x % 2 == 0 else 0)
    return x * x


def test_bounded_map_yields_in_input_order_and_reads_at_most_twice_workers_ahead():
    """A generator over a 90 GB dump must not be read ahead of the workers: when the first result is taken,
    2 * workers items have been read, no more; and results come in input order, whichever finishes first."""
    read: list[int] = []

    def items():
        for i in range(12):
            read.append(i)
            yield i

    results = bounded_map(_square_late_if_even, items(), 2)
    assert next(results) == 0 and read == [0, 1, 2, 3]
    assert next(results) == 1 and read == [0, 1, 2, 3, 4]
    assert list(results) == [i * i for i in range(2, 12)] and len(read) == 12


def _killed_at_3(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a worker
    return x


@pytest.mark.parametrize("items", [range(8), iter(range(8))])
def test_a_worker_killed_by_a_signal_is_one_error_line(items):
    """A worker the out-of-memory killer ended was a BrokenProcessPool traceback, which the CLI does not turn into
    its one line (found by an audit); the rerun goes on from the parts written, as after a kill of the command."""
    with pytest.raises(PipelineError, match=r"^a worker process of this stage died \(killed by a signal: the "
                                            r"out-of-memory killer, or kill\); rerun the same command to continue "
                                            "where it stopped, with fewer --workers if memory ran out$"):
        list(bounded_map(_killed_at_3, items, 2))


# Two workers that print their pids and wait.
_TWO_WORKERS = """
import os, time
from data.parallel import bounded_map
def report_and_wait(_):
    os.write(1, b"%d\\n" % os.getpid())  # one write: print's two writes of two workers interleaved ("74157416")
    time.sleep(120)
list(bounded_map(report_and_wait, range(2), 2))
"""


def _pid(_) -> int:
    return os.getpid()


def test_bounded_map_with_one_worker_runs_in_this_process():
    """As its docstring says, and as the tests that patch a stage's functions in this process rely on."""
    assert set(bounded_map(_pid, range(3), 1)) == {os.getpid()}
    assert set(bounded_map(_pid, iter(range(3)), 1)) == {os.getpid()}


def test_bounded_map_starts_its_workers_before_it_reads_the_input():
    """A producer may start threads (the dump read-ahead does); a fork while one of them holds a lock can deadlock
    the child."""
    import multiprocessing

    others, seen = set(multiprocessing.active_children()), []

    def items():
        seen.append(len(set(multiprocessing.active_children()) - others))
        yield from range(4)

    assert len(list(bounded_map(_pid, items(), 2))) == 4 and seen == [2]


def _fail_0_else_sleep(x: int) -> int:
    if x == 0:
        time.sleep(0.2)  # the other tasks are submitted by then
        raise ValueError("task 0 failed")
    time.sleep(0.5)
    return x


def test_a_tasks_error_reaches_the_caller_once_the_running_tasks_have_ended():
    """They end first (one that fails removes its temporary files): none is left writing after the error."""
    import multiprocessing

    others = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="task 0 failed"):
        list(bounded_map(_fail_0_else_sleep, range(4), 2))
    assert set(multiprocessing.active_children()) - others == set()


# Ctrl-C while the pool waits for the running tasks after another task's error.
_INTERRUPTED_AFTER_AN_ERROR = """
import os, signal, time
from data.parallel import bounded_map
from data.stage import cli_call
signal.signal(signal.SIGINT, signal.default_int_handler)
def task(i):
    os.write(1, b"start %d\\n" % i)
    if i == 0:
        time.sleep(0.3)
        raise ValueError("task 0 failed")
    time.sleep(60)
    return i
cli_call(lambda _: list(bounded_map(task, range(4), 2)), None)
"""


def test_ctrl_c_while_the_running_tasks_end_after_an_error_stops_them_at_once(tmp_path):
    out = tmp_path / "out"
    with out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_AFTER_AN_ERROR], cwd=ROOT, stdout=stdout,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while out.read_text().count("start") < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(1)  # task 0 has failed: the parent waits in the pool's shutdown for the 60 s tasks
    os.killpg(proc.pid, signal.SIGINT)  # the process group this test started
    try:
        _, err = proc.communicate(timeout=20)  # not the tasks' 60 s
    finally:
        proc.kill()
    assert proc.returncode == 130, err


# Ctrl-C in a terminal: SIGINT to the whole process group, while two workers are in their first task.
_INTERRUPTED = """
import os, signal, time
from data.parallel import bounded_map
from data.stage import cli_call
# As at a terminal: a test run started in the background (nohup make test &) passes SIGINT on ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
BUSY_CALLER = bool(os.environ.get("BUSY_CALLER"))
def task(i):
    os.write(1, b"start %d %d\\n" % (i, os.getpid()))
    if not (BUSY_CALLER and i < 2):
        time.sleep(60)
        os.write(1, b"done %d\\n" % i)
    return i
# Busy callers: Ctrl-C lands in the caller's own work on task 0's result, not in a wait for one.
def drops_the_map(_):  # unwinding drops the generator
    for i in bounded_map(task, range(12), 2):
        time.sleep(60)
def holds_the_map(_):  # the traceback keeps the generator
    results = bounded_map(task, range(12), 2)
    for i in results:
        time.sleep(60)
callers = {"drops the map": drops_the_map, "holds the map": holds_the_map}
cli_call(callers[os.environ["BUSY_CALLER"]] if BUSY_CALLER else lambda _: list(bounded_map(task, range(12), 2)), None)
"""


@pytest.mark.parametrize("presses, busy_caller", [(1, None), (2, None), (1, "drops the map"), (1, "holds the map")])
def test_ctrl_c_stops_the_workers_at_once_with_one_line(tmp_path, presses, busy_caller):
    """The workers had taken the SIGINT too: one interrupted while sending its result left the pool's pipe
    half-written and the command hung for good (an audit, 2 in 230 tries); and waiting for the running tasks to
    end, a second Ctrl-C hung the pool's shutdown (a review). Now the parent alone takes it and stops the workers at
    once (their tasks write only temporaries, which the rerun removes), and the command ends with its one line."""
    out = tmp_path / "out"
    with out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED], cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                env=os.environ | ({"BUSY_CALLER": busy_caller} if busy_caller else {}))
    running = [2, 3] if busy_caller else [0, 1]  # the tasks the workers are in when Ctrl-C comes
    deadline = time.monotonic() + 60
    while out.read_text().count("start") < running[-1] + 1:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(presses):
        os.killpg(proc.pid, signal.SIGINT)  # the process group this test started
        time.sleep(0.3)
    try:
        _, err = proc.communicate(timeout=20)  # not the tasks' 60 s
    finally:
        proc.kill()
    started = [line.split() for line in out.read_text().splitlines()]
    assert proc.returncode == 130 and err == "interrupted; rerun the same command to continue where it stopped\n"
    assert sorted(int(i) for _, i, _ in started) == sorted({0, 1, *running})  # no task begun after, none finished
    workers = [int(pid) for _, _, pid in started]
    deadline = time.monotonic() + 10
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_running, workers))


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_parent_killed_alone(tmp_path):
    """A data command killed alone (SIGKILL to its pid, as the OOM killer does, not to its process group) left
    its workers blocked on their queues for good."""
    pids = tmp_path / "pids"
    with pids.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _TWO_WORKERS], cwd=ROOT, stdout=out)
    deadline = time.monotonic() + 60
    while len(pids.read_text().split()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()  # the parent alone
    proc.wait()
    workers = [int(pid) for pid in pids.read_text().split()]
    deadline = time.monotonic() + 10
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in workers if _running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)  # the workers this test started
    assert not alive
