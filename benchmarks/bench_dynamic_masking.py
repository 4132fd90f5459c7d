"""Masking at load time: a batch's rows masked at once against each row masked alone.

    .venv/bin/python benchmarks/bench_dynamic_masking.py [--dump ../shared/data/enwiki-sample-pages-articles.xml.bz2]
        [--vocab ../shared/data/bert-base-uncased-vocab.txt] [--work_dir DIR] [--repeats 3]

Makes shards without static masks from the sample dump with `data.prepare --dynamic_masking` (seq 128 with
BERT's masking and with `--whole_word_masking`, seq 512 with `--whole_word_masking`), then reads their
first 4,096 rows (seq 512: 4,096 rows of 16 a batch) in batches, in the training order, in this process:
- ours: `PretrainingDataset.__getitems__`, which reads a batch's rows of a shard together and masks them in one
  `data.create.mask_rows` call, each row with a generator seeded by its stream position;
- the reference: the loader before 2026-11-25, the same rows read together, then each row masked alone by
  `mask_rows` with that same generator (so whole-word masking ran its per-word loop once per row).
Both give the same samples (checked on every batch). Prints samples/s of each (medians of `--repeats`, the two
alternated) and ours / reference.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from data.create import mask_rows
from data.prepare import PrepareConfig, prepare
from modeling import IGNORE_INDEX
from training.loader import PretrainingDataset, open_split

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
ROWS = 4096
CASES = [("seq 128, BERT's masking", 1, False, 64), ("seq 128, whole words", 1, True, 64),
         ("seq 512, whole words", 2, True, 16)]


def rows_alone(ds: PretrainingDataset, batch: list[int]) -> list[dict[str, np.ndarray]]:
    """The reference: a shard's rows of the batch read together, then each row masked alone."""
    located = [ds.locate(position) for position in batch]
    samples: list[dict[str, np.ndarray]] = [{} for _ in batch]
    for shard in dict.fromkeys(s for s, _ in located):
        which = [i for i, (s, _) in enumerate(located) if s == shard]
        block = ds._read_rows(shard, np.array([located[i][1] for i in which]), batch[which[0]])
        info = ds.shards[shard]
        for j, i in enumerate(which):
            ids = block["input_ids"][j:j + 1]
            real = block["attention_mask"][j:j + 1] == 1
            candidates = real & (ids != ds.vocab.cls) & (ids != ds.vocab.sep)
            positions, labels = mask_rows(ids, candidates, real.sum(axis=1), ds.max_predictions, info.masked_lm_prob,
                                          info.whole_word_masking, ds.vocab,
                                          np.random.default_rng([ds.seed, batch[i], 2]))
            samples[i] = {key: values[j, ...] for key, values in block.items()}
            samples[i]["masked_lm_positions"] = positions[0].astype(np.int64)
            samples[i]["masked_lm_labels"] = np.where(labels[0] == 0, IGNORE_INDEX, labels[0].astype(np.int64))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", type=Path, default=SHARED / "enwiki-sample-pages-articles.xml.bz2")
    p.add_argument("--vocab", type=Path, default=SHARED / "bert-base-uncased-vocab.txt")
    p.add_argument("--work_dir", type=Path, help="where a fresh directory for the shards is made (and removed)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each reader (median)")
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    work = Path(tempfile.mkdtemp(prefix="bench_dynamic_masking_", dir=a.work_dir))
    try:
        print(f"{'case':<26} {'reference samples/s':>20} {'ours samples/s':>15} {'ours / reference':>17}")
        for name, phase, whole_words, batch_size in CASES:
            seq, preds = {1: (128, 20), 2: (512, 80)}[phase]
            out = work / f"{phase}{'-wwm' if whole_words else ''}"
            prepare(PrepareConfig(input=a.dump, output_dir=out, vocab_file=a.vocab, max_seq_length=seq,
                                  max_predictions_per_seq=preds, num_shards=2, num_test_shards=0, test_fraction=0.0,
                                  whole_word_masking=whole_words, static_masking=False, text_dir=work / "text",
                                  workers=2), report=lambda line: None)
            ds = open_split(out / "hdf5", "training", seq, preds, 30522, seed=7, shuffle=True)
            assert ds is not None
            batches = [list(range(s, s + batch_size)) for s in range(0, min(ROWS, len(ds)), batch_size)]
            for batch in batches:  # the same samples; also maps both shards before timing
                for x, y in zip(ds.__getitems__(batch), rows_alone(ds, batch), strict=True):
                    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), (name, batch[0])
            rates: dict[str, list[float]] = {"reference": [], "ours": []}
            for _ in range(a.repeats):
                for reader, fn in (("reference", functools.partial(rows_alone, ds)), ("ours", ds.__getitems__)):
                    start = time.perf_counter()
                    for batch in batches:
                        fn(batch)
                    rates[reader].append(len(batches) * batch_size / (time.perf_counter() - start))
            ref, ours = statistics.median(rates["reference"]), statistics.median(rates["ours"])
            print(f"{name:<26} {ref:>20,.0f} {ours:>15,.0f} {ours / ref:>16.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
