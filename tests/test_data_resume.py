"""Determinism across worker counts, and resuming a real `python -m data.prepare` killed mid-stage.

Both compare against the `phase1_shards` fixture (2 workers, uninterrupted, same settings).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from data.prepare import PrepareConfig, prepare

ROOT = Path(__file__).resolve().parents[1]
# The settings of the phase1_shards fixture (tests/conftest.py), as CLI flags.
FLAGS = ["--max_seq_length", "128", "--max_predictions_per_seq", "20", "--dupe_factor", "2", "--num_shards", "2",
         "--num_test_shards", "1", "--seed", "12345", "--test_fraction", "0.1", "--articles_per_part", "40"]


def assert_same_output(a: Path, b: Path) -> None:
    assert (a / "vocab.txt").read_bytes() == (b / "vocab.txt").read_bytes()
    files_a = sorted(p.relative_to(a) for p in (a / "hdf5").rglob("*.hdf5"))
    files_b = sorted(p.relative_to(b) for p in (b / "hdf5").rglob("*.hdf5"))
    assert files_a == files_b and len(files_a) == 3
    for rel in files_a:
        with h5py.File(a / rel, "r") as fa, h5py.File(b / rel, "r") as fb:
            assert dict(fa.attrs) == dict(fb.attrs)
            assert set(fa) == set(fb)
            for key in fa:
                assert fa[key].dtype == fb[key].dtype
                assert np.array_equal(fa[key][:], fb[key][:]), f"{rel}:{key}"
    assert not [p for p in a.rglob("*") if ".tmp-" in p.name], "temporary files left behind"


def test_output_is_identical_with_one_worker(phase1_shards, sample_dump, bert_vocab, tmp_path):
    prepare(PrepareConfig(input=sample_dump, output_dir=tmp_path, vocab_file=bert_vocab, max_seq_length=128,
                          max_predictions_per_seq=20, dupe_factor=2, num_shards=2, num_test_shards=1, seed=12345,
                          workers=1, test_fraction=0.1, articles_per_part=40))
    assert_same_output(tmp_path, phase1_shards)


def _run(args: list[str], kill_when: Callable[[], bool] | None = None) -> subprocess.CompletedProcess | None:
    """Run `python -m data.prepare`; with kill_when, SIGKILL its whole process group once it holds."""
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", *args], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_when is None:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        return subprocess.CompletedProcess(proc.args, 0, out, err)
    deadline = time.monotonic() + 300
    while not kill_when():
        if proc.poll() is not None:
            pytest.fail(f"data.prepare finished before the kill point: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started, workers included
    proc.communicate()
    return None


@pytest.mark.slow
def test_killed_mid_stage_then_rerun_gives_identical_output(phase1_shards, wiki_mirror, bert_vocab, tmp_path):
    base, site = wiki_mirror
    url = f"{base}/enwiki/20241201/enwiki-20241201-pages-articles.xml.bz2"
    site.cut_after, site.cuts = 500_000, 1  # the download itself is interrupted once and resumed
    out = tmp_path / "out"
    args = ["--input", url, "--output_dir", str(out), "--vocab_file", str(bert_vocab), "--workers", "2", *FLAGS]
    extracted, instances = out / "text" / "extracted", out / "instances"

    # 1: killed during extraction, after the first part is written and before the stage completes.
    _run(args, kill_when=lambda: (extracted / "part-00000.txt").is_file())
    assert not (extracted / "_COMPLETE.json").exists()
    # 2: killed during instance creation.
    _run(args, kill_when=lambda: (instances / "training" / "part-00000").is_dir())
    assert (extracted / "_COMPLETE.json").exists() and not (instances / "_COMPLETE.json").exists()
    # 3: finishes.
    done = _run(args)
    assert "prepare: 105 articles, 105 documents, 18587 sentences" in done.stdout
    assert_same_output(out, phase1_shards)
    assert [r for p, r in site.requests if p.endswith(".bz2")] == [None, "bytes=500000-"]

    # A rerun of a complete job rewrites nothing.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    _run(args)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps


@pytest.mark.slow
def test_killed_while_training_its_vocab_then_rerun_gives_identical_output(sample_dump, tmp_path):
    args = ["--input", str(sample_dump), "--vocab_size", "3000", "--workers", "2", *FLAGS]
    _run([*args, "--output_dir", str(tmp_path / "whole")])
    out = tmp_path / "out"
    training = out / "vocab_training"
    _run([*args, "--output_dir", str(out)], kill_when=lambda: (training / "_PARAMS.json").is_file())
    assert not (training / "_COMPLETE.json").exists() and not (out / "vocab.txt").exists()
    _run([*args, "--output_dir", str(out)])
    assert_same_output(out, tmp_path / "whole")
