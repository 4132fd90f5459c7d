"""The HDF5 shards made from the real sample dump with the real BERT vocab: format and statistics."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from data.create import CreateConfig, create
from data.shard import ShardConfig, shard
from data.stage import COMPLETE_FILE

CLS, SEP, MASK = 101, 102, 103
# The shard format's dtypes (docs/ARCHITECTURE.md), which the training loader reads.
FORMAT_DTYPES = {"input_ids": np.int32, "input_mask": np.int8, "segment_ids": np.int8,
                 "masked_lm_positions": np.int32, "masked_lm_ids": np.int32, "next_sentence_labels": np.int8}


def _read(directory: Path, split: str = "training") -> dict[str, np.ndarray]:
    files = sorted((directory / "hdf5" / split).glob(f"*_{split}_*.hdf5"), key=lambda p: int(p.stem.split("_")[-1]))
    arrays: dict[str, list[np.ndarray]] = {}
    for path in files:
        with h5py.File(path, "r") as f:
            for key in f:
                arrays.setdefault(key, []).append(f[key][:])
    return {k: np.concatenate(v) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def static(phase1_shards):
    return _read(phase1_shards)


@pytest.fixture(scope="module")
def dynamic(dynamic_shards):
    return _read(dynamic_shards)


def test_layout_keys_dtypes_shapes_and_attributes(phase1_shards, dynamic_shards):
    assert (phase1_shards / "vocab.txt").read_text().splitlines()[CLS] == "[CLS]"
    for directory, masking in ((phase1_shards, "static"), (dynamic_shards, "dynamic")):
        training = sorted((directory / "hdf5" / "training").glob("*.hdf5"))
        test = sorted((directory / "hdf5" / "test").glob("*.hdf5"))
        assert [p.name for p in training] == ["wikicorpus_en_training_0.hdf5", "wikicorpus_en_training_1.hdf5"]
        assert [p.name for p in test] == ["wikicorpus_en_test_0.hdf5"]
        for path in training + test:
            with h5py.File(path, "r") as f:
                expected = set(FORMAT_DTYPES) if masking == "static" else (
                    set(FORMAT_DTYPES) - {"masked_lm_positions", "masked_lm_ids"})
                assert set(f) == expected
                n = len(f["next_sentence_labels"])
                assert n > 100
                for key in f:
                    assert f[key].dtype == FORMAT_DTYPES[key], key
                    width = {"next_sentence_labels": None, "masked_lm_positions": 20, "masked_lm_ids": 20}.get(key, 128)
                    assert f[key].shape == ((n,) if width is None else (n, width)), key
                assert dict(f.attrs) == {"max_seq_length": 128, "max_predictions_per_seq": 20, "vocab_size": 30522,
                                         "masking": masking, "masked_lm_prob": 0.15, "whole_word_masking": 0,
                                         "lower_case": 1}


def _rows(arrays: dict[str, np.ndarray]) -> list[bytes]:
    """Each instance as the bytes of all its fields, sorted: a split's instances as a multiset."""
    keys = sorted(FORMAT_DTYPES)
    n = len(arrays["input_ids"])
    return sorted(b"".join(arrays[k][i].astype(np.int64).tobytes() for k in keys) for i in range(n))


def test_each_split_holds_exactly_the_instances_made_for_it(phase1_shards):
    """The test shards are the held-out documents' instances, the training shards the others': no instance
    lost, repeated or moved across, which would leak training text into the evaluation."""
    for split in ("training", "test"):
        parts = sorted((phase1_shards / "instances" / split).glob("part-*"))
        made = {k: np.concatenate([np.load(d / f"{k}.npy") for d in parts]) for k in FORMAT_DTYPES}
        assert len(made["input_ids"]) > 300, split
        assert _rows(_read(phase1_shards, split)) == _rows(made), split


def test_training_shards_are_balanced_within_one_percent(phase1_shards):
    sizes = []
    for path in sorted((phase1_shards / "hdf5" / "training").glob("*.hdf5")):
        with h5py.File(path, "r") as f:
            sizes.append(len(f["input_ids"]))
    assert max(sizes) - min(sizes) <= 1  # the issue asks for 1%; the shard stage splits to within one instance


def test_sequence_structure_and_padding(static, dynamic):
    for d in (static, dynamic):
        ids, mask, seg = d["input_ids"], d["input_mask"].astype(bool), d["segment_ids"]
        length = mask.sum(1)
        # input_mask is a prefix of ones; everything after it is 0.
        assert np.array_equal(mask, np.arange(128)[None, :] < length[:, None])
        assert not ids[~mask].any() and not seg[~mask].any()
        assert (ids[:, 0] == CLS).all()
        assert (ids[np.arange(len(ids)), length - 1] == SEP).all()
    ids, seg = dynamic["input_ids"], dynamic["segment_ids"]
    # Exactly two [SEP]; segment 0 runs through the first, segment 1 through the second.
    assert ((ids == SEP).sum(1) == 2).all()
    first_sep = np.argmax(ids == SEP, axis=1)
    col = np.arange(128)[None, :]
    assert np.array_equal(seg.astype(bool), (col > first_sep[:, None]) & dynamic["input_mask"].astype(bool))
    # Both segments hold at least one token.
    assert (first_sep >= 2).all() and (dynamic["input_mask"].sum(1) - first_sep >= 3).all()


def test_short_seq_prob_makes_a_tenth_of_the_targets_shorter(static, dynamic):
    """With probability short_seq_prob (0.1) an instance is packed to a random shorter target. On the sample,
    6.5% of the instances then have fewer than 64 tokens; documents' ends alone give 1.1% (short_seq_prob 0),
    and 0.2 gives 15%."""
    for d in (static, dynamic):
        length = d["input_mask"].sum(1)
        assert 0.05 < np.mean(length < 64) < 0.08
        assert 0.78 < np.mean(length == 128) < 0.85


def test_masking_statistics(static, dynamic):
    pos, mlm_ids = static["masked_lm_positions"], static["masked_lm_ids"]
    real = mlm_ids != 0
    # Real predictions come first, then 0-padding in both arrays.
    assert np.array_equal(real, np.arange(20)[None, :] < real.sum(1)[:, None])
    assert not pos[~real].any()
    # Positions strictly increasing (sorted, unique) and never on [CLS], a [SEP] or padding.
    masked_pos = np.where(real, pos, 10_000)
    assert (np.diff(masked_pos, axis=1)[real[:, 1:]] > 0).all()
    assert (pos[real] > 0).all()
    original = np.take_along_axis(dynamic["input_ids"], pos, axis=1)
    assert not np.isin(original[real], [CLS, SEP, 0]).any()
    # The dynamic shards hold the same pairs unmasked (same seed): masked_lm_ids are the originals...
    assert np.array_equal(original[real], mlm_ids[real])
    # ...and only the masked positions differ.
    changed = static["input_ids"] != dynamic["input_ids"]
    rows = np.repeat(np.arange(len(pos)), real.sum(1))
    at_masked = np.zeros_like(changed)
    at_masked[rows, pos[real]] = True
    assert not (changed & ~at_masked).any()
    tokens = static["input_mask"].sum() - 3 * len(pos)
    assert 0.14 < real.sum() / tokens < 0.16
    now = static["input_ids"][rows, pos[real]]
    frac_mask = np.mean(now == MASK)
    frac_same = np.mean(now == mlm_ids[real])
    frac_random = 1 - frac_mask - frac_same
    assert abs(frac_mask - 0.8) < 0.02 and abs(frac_same - 0.1) < 0.015 and abs(frac_random - 0.1) < 0.015
    # round(0.15 * 128) = 19 predictions in a full row (the cap of 20 is not reached), and
    # round(0.15 * length) in a shorter one.
    length = static["input_mask"].sum(1)
    assert np.array_equal(real.sum(1), np.minimum(20, np.maximum(1, np.round(0.15 * length))))


def test_next_sentence_labels_and_true_pairs_are_contiguous_text(phase1_shards, dynamic):
    nsp = dynamic["next_sentence_labels"]
    assert set(np.unique(nsp)) == {0, 1}
    assert 0.45 < nsp.mean() < 0.6
    # A and B are each a contiguous span of the tokenized corpus. For an "is next" pair, B starts
    # at most the truncated tokens after A ends (truncation cuts at random ends); for a random
    # next, B comes from another document. Searched on token ids as bytes (4-aligned offsets);
    # Wikipedia repeats some passages, so every occurrence counts.
    corpus = b"".join(np.load(p)["ids"].astype("<i4").tobytes()
                      for p in sorted((phase1_shards / "text").glob("tokens_*/part-*.npz")))

    def occurrences(tokens: np.ndarray) -> list[int]:
        needle, found, start = tokens.astype("<i4").tobytes(), [], corpus.find(tokens.astype("<i4").tobytes())
        while start != -1:
            if start % 4 == 0:
                found.append(start // 4)
            start = corpus.find(needle, start + 1)
        return found

    def follows(row: np.ndarray) -> bool:
        """Whether some occurrence of B starts 0..125 tokens after an occurrence of A ends."""
        sep = np.flatnonzero(row == SEP)
        a, b = row[1:sep[0]], row[sep[0] + 1:sep[1]]
        a_ends = [p + len(a) for p in occurrences(a)]
        b_starts = occurrences(b)
        assert a_ends and b_starts, "every segment is a span of the corpus"
        return any(0 <= pb - pa <= 125 for pa in a_ends for pb in b_starts)

    ids = dynamic["input_ids"]
    assert all(follows(ids[i]) for i in np.flatnonzero(nsp == 0)[:200])
    assert sum(follows(ids[i]) for i in np.flatnonzero(nsp == 1)[:200]) < 10


def test_whole_word_masking_masks_whole_words(phase1_shards, tmp_path):
    tokens_dir = next((phase1_shards / "text").glob("tokens_*"))
    vocab_file = phase1_shards / "vocab.txt"
    out = tmp_path / "wwm"
    result = create(CreateConfig(tokens_dir, vocab_file, out, dupe_factor=1, whole_word_masking=True,
                                 masked_lm_prob=0.1, test_fraction=0.1, workers=1))
    assert (out / COMPLETE_FILE).is_file() and result.instances["training"] > 1000
    vocab = vocab_file.read_text().splitlines()
    is_piece = np.array([t.startswith("##") for t in vocab])
    directories = sorted((out / "training").glob("part-*"))
    pos = np.concatenate([np.load(d / "masked_lm_positions.npy") for d in directories])
    mlm_ids = np.concatenate([np.load(d / "masked_lm_ids.npy") for d in directories])
    ids = np.concatenate([np.load(d / "input_ids.npy") for d in directories])
    masked = np.zeros(ids.shape, dtype=bool)
    real = mlm_ids != 0
    masked[np.repeat(np.arange(len(ids)), real.sum(1)), pos[real]] = True
    original = ids.copy()
    original[masked] = mlm_ids[real]
    # (a piece right after [CLS]/[SEP] starts a word: words never span segments)
    piece = is_piece[original] & ~np.isin(np.roll(original, 1, axis=1), [CLS, SEP])
    # A masked "##" piece has its word's previous piece masked, and a masked piece whose next
    # piece continues the word has that one masked too.
    assert piece[masked].sum() > 100
    assert masked[:, :-1][piece[:, 1:] & masked[:, 1:]].all()
    assert masked[:, 1:][piece[:, 1:] & masked[:, :-1]].all()
    # round(10%) of the tokens, [CLS] and [SEP]s counted, less what whole words that do not fit leave out
    assert 0.09 < real.sum() / (ids != 0).sum() < 0.105
    # The shards say how their masks were drawn.
    shard(ShardConfig(out, tmp_path / "hdf5", num_shards=1, num_test_shards=1))
    with h5py.File(tmp_path / "hdf5" / "training" / "wikicorpus_en_training_0.hdf5", "r") as f:
        assert dict(f.attrs) == {"max_seq_length": 128, "max_predictions_per_seq": 20, "vocab_size": 30522,
                                 "masking": "static", "masked_lm_prob": 0.1, "whole_word_masking": 1,
                                 "lower_case": 1}
        assert len(f["input_ids"]) == result.instances["training"]
