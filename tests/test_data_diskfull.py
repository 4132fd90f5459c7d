"""A disk that fills up in a data stage, without mounting one: the command runs with RLIMIT_FSIZE, so that a
write past the limit fails with EFBIG, as one on a full disk fails with ENOSPC (Python ignores SIGXFSZ).

The audit of 2026-11-24 (docs/DATA.md) filled a real tmpfs in every stage; these tests keep what it found
fixed: each failure is one line naming the file being written (which may lie on --text_dir's disk, not on
--output_dir's), nothing is left under a temporary or, damaged, under a final name, and the rerun gives the
output of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from data.shard import ShardConfig, shard
from data.vocab import VocabConfig, build_vocab

ROOT = Path(__file__).resolve().parents[1]
# The settings of the phase1_shards fixture (tests/conftest.py), as CLI flags.
FLAGS = ["--max_seq_length", "128", "--max_predictions_per_seq", "20", "--dupe_factor", "2", "--num_shards", "2",
         "--num_test_shards", "1", "--seed", "12345", "--test_fraction", "0.1", "--articles_per_part", "40"]
RERUN = "rerun the same command to continue where it stopped"


def _run(module: str, args: list[str], file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=None if file_size_limit is None else limit)


def _digests(root: Path, pattern: str = "*") -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob(pattern)) if p.is_file()}


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def _assert_one_line(proc: subprocess.CompletedProcess, line: str, reason: str | None = None) -> None:
    """The error is the last line of stderr, with no traceback; `reason`: a pattern for the text at {reason}."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    if reason is None:
        assert last == line
    else:
        before, after = line.split("{reason}")
        assert re.fullmatch(re.escape(before) + reason + re.escape(after), last), last


@pytest.mark.parametrize("limit, written, reason", [
    # the first write of all: the extract stage's lock file
    (0, "text/extracted/_LOCK", "File too large"),
    # an extracted part (1.1 MB), written by the parent process
    (1_000_000, "text/extracted/part-00000.txt", "File too large"),
    # an instances array (2.4 MB), written by a worker in pieces (np.save's own short write carried no errno)
    (2_000_000, "instances/training/part-00000", "File too large"),
])
def test_a_full_disk_is_a_line_naming_the_file_on_its_disk_and_the_rerun_finishes(
        limit, written, reason, phase1_shards, sample_dump, bert_vocab, tmp_path):
    """The line named --output_dir whatever the file, so a full --text_dir disk was reported as the output
    directory's ("free space there": on the wrong disk), and numpy's short write did not say the disk was full
    (the instances are now written in pieces, whose error keeps its errno)."""
    out, text = tmp_path / "out", tmp_path / "text"
    args = ["--input", str(sample_dump), "--output_dir", str(out), "--text_dir", str(text),
            "--vocab_file", str(bert_vocab), *FLAGS, "--workers", "2"]
    failed = _run("data.prepare", args, limit)
    path = (text / written.removeprefix("text/")) if written.startswith("text/") else out / written
    _assert_one_line(failed, f"error: {path}: {{reason}}; free space there and {RERUN}", reason)
    assert _temporaries(tmp_path) == []

    rerun = _run("data.prepare", args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _digests(out / "hdf5", "*.hdf5") == _digests(phase1_shards / "hdf5", "*.hdf5")
    assert _temporaries(tmp_path) == [] and not list(tmp_path.rglob("_LOCK"))


@pytest.mark.parametrize("compression", ["none", "gzip"])
@pytest.mark.parametrize("workers, where", [(1, "as it closes"), (2, "as it closes"), (2, "midway")])
def test_a_disk_full_as_a_shard_is_written_is_a_line_and_leaves_no_damaged_shard(compression, workers, where,
                                                                                 phase1_shards, tmp_path):
    """HDF5 writes its metadata as the file closes. A full disk there raised h5py's RuntimeError (a traceback)
    or crashed the process (SIGSEGV); in a worker, an error HDF5 ignored let a damaged shard be renamed into
    place, which the rerun kept (seen on a full tmpfs with 2 workers). Midway through a compressed shard, h5py
    printed a traceback for each chunk HDF5 could not write (seen on a full tmpfs once HDF5 wrote through a
    Python file object that raised the error)."""
    instances = phase1_shards / "instances"
    reference = tmp_path / "reference"
    shard(ShardConfig(instances, reference, num_shards=2, num_test_shards=1, workers=1,
                      compression=None if compression == "none" else compression))
    first = Path("training/wikicorpus_en_training_0.hdf5")
    out = tmp_path / "hdf5"
    args = ["--instances_dir", str(instances), "--output_dir", str(out), "--num_shards", "2",
            "--hdf5_compression", compression, "--workers", str(workers)]
    size = (reference / first).stat().st_size
    failed = _run("data.shard", args, size - 1 if where == "as it closes" else size // 2)
    _assert_one_line(failed, f"error: {out / first}: File too large; free space there and {RERUN}")
    assert _temporaries(out) == []
    expected = _digests(reference, "*.hdf5")
    assert not (out / first).exists()
    assert {name: digest for name, digest in _digests(out, "*.hdf5").items() if expected[name] != digest} == {}

    rerun = _run("data.shard", args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _digests(out, "*.hdf5") == expected


def test_a_full_disk_as_a_trained_vocab_is_saved_is_a_line(phase1_shards, tmp_path):
    """tokenizers raises the failed write as a bare Exception ("File too large (os error 27)"): a traceback."""
    corpus = phase1_shards / "text" / "sentences"
    reference = build_vocab(VocabConfig(tmp_path / "reference", None, corpus, 8000, True, workers=1))
    out = tmp_path / "out"
    args = ["--corpus_dir", str(corpus), "--vocab_size", "8000", "--output_dir", str(out), "--workers", "1"]
    failed = _run("data.vocab", args, 20_000)  # the trained vocab.txt is about 54 kB
    trained = out / "vocab_training" / "model" / "vocab.txt"
    _assert_one_line(failed, f"error: {trained}: File too large; free space there and {RERUN}")
    assert not (out / "vocab.txt").exists() and not trained.exists() and _temporaries(out) == []

    rerun = _run("data.vocab", args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (out / "vocab.txt").read_bytes() == reference.path.read_bytes()
