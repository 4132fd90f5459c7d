"""The HDF5 loader on the project's shards made from the real sample dump: rank split, order,
exact resume positions, static and dynamic masks, reference-format shards, mismatch errors."""

from __future__ import annotations

import io
import itertools
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from data.create import CreateConfig, create
from data.shard import ShardConfig, shard
from modeling import IGNORE_INDEX
from tests.conftest import drain, no_workers_left, to_reference_format
from training.loader import (
    OPEN_FILES,
    DataConfigError,
    RankSampler,
    find_shards,
    inspect_shard,
    make_loader,
    open_split,
    raised_message,
    tokenization_case,
)

VOCAB = 30522


def training_set(shards: Path, seed: int = 1, read_ahead: bool = True, **kwargs):
    values = {"max_seq_length": 128, "max_predictions": 20, "vocab_size": VOCAB} | kwargs
    return open_split(shards, "training", values["max_seq_length"], values["max_predictions"], values["vocab_size"],
                      seed=seed, shuffle=True, read_ahead=read_ahead)


def file_map(array: np.ndarray) -> mmap.mmap | None:
    """The file map an array views (the loader's memory-mapped datasets), if it views one."""
    while isinstance(array, np.ndarray):
        array = array.base
    return array if isinstance(array, mmap.mmap) else None


def positions(sampler: RankSampler, count: int) -> list[int]:
    return list(itertools.islice(iter(sampler), count))


def test_ranks_split_each_micro_step_without_duplication():
    micro, world, steps = 4, 2, 6
    per_rank = [positions(RankSampler(0, micro, r, world), micro * steps) for r in range(world)]
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(micro * world * steps))
    # micro step k of every rank together is the k-th block of micro * world positions
    for k in range(steps):
        block = {p for r in range(world) for p in per_rank[r][k * micro:(k + 1) * micro]}
        assert block == set(range(k * micro * world, (k + 1) * micro * world))


def test_resumed_sampler_continues_the_stream():
    full = positions(RankSampler(0, 4, 1, 2), 40)
    resumed = positions(RankSampler(48, 4, 1, 2), 16)  # 48 consumed = 6 micro steps of 8
    assert resumed == full[24:40]
    # on another world size the same global samples follow: 2 ranks x 4 == 1 rank x 8 per micro step
    one_rank = positions(RankSampler(48, 8, 0, 1), 8)
    two_ranks = positions(RankSampler(48, 4, 0, 2), 4) + positions(RankSampler(48, 4, 1, 2), 4)
    assert one_rank == two_ranks


def test_evaluation_sampler_stops_at_the_limit():
    got = [list(RankSampler(0, 4, r, 2, limit=10)) for r in range(2)]
    assert got == [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7]]
    assert len(RankSampler(0, 4, 0, 2, limit=10)) == 6


def test_shards_are_found_by_name_or_by_directory(tmp_path):
    # The split is a directory name, or a whole word of the file name: "latest" and "pretraining"
    # contain "test" and "training" but name no split.
    for rel in ("a/wiki_training_1.hdf5", "a/wiki_training_0.hdf5", "b/training/part-00000.hdf5",
                "b/test/part-00000.hdf5", "c/wiki_test_0.hdf5", "c/notes.txt", "d/other.hdf5",
                "e/training/enwiki_latest_training_0.hdf5", "e/test/enwiki_latest_test_0.hdf5",
                "f/bert-pretraining-test.0.hdf5", "g/latest.hdf5"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    assert [str(p.relative_to(tmp_path)) for p in find_shards(tmp_path, "training")] == [
        "a/wiki_training_0.hdf5", "a/wiki_training_1.hdf5", "b/training/part-00000.hdf5",
        "e/training/enwiki_latest_training_0.hdf5"]
    assert [str(p.relative_to(tmp_path)) for p in find_shards(tmp_path, "test")] == [
        "b/test/part-00000.hdf5", "c/wiki_test_0.hdf5", "e/test/enwiki_latest_test_0.hdf5",
        "f/bert-pretraining-test.0.hdf5"]
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "wiki_training_test_0.hdf5").touch()
    with pytest.raises(DataConfigError, match=r"wiki_training_test_0\.hdf5: the file name names both splits"):
        find_shards(tmp_path, "training")


def test_symlinked_directories_are_searched_once_and_the_input_dir_can_be_a_split(tmp_path):
    """rglob (Python < 3.13) skipped symlinked directories: `training/more -> elsewhere` trained on part of the
    data, a symlinked `training/` found none. `--input_dir shards/training` found none of its part-*.hdf5."""
    elsewhere = tmp_path / "elsewhere"
    for rel in ("root/training/a_0.hdf5", "root/test/part-0.hdf5", "elsewhere/b_0.hdf5", "elsewhere/b_1.hdf5",
                "tests/part-0.hdf5"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    root = tmp_path / "root"
    (root / "training" / "more").symlink_to(elsewhere)
    (root / "training" / "loop").symlink_to(root)  # a cycle: its shards are not listed again
    (root / "test2").symlink_to(tmp_path / "tests")
    assert [str(p.relative_to(root)) for p in find_shards(root, "training")] == [
        "training/a_0.hdf5", "training/more/b_0.hdf5", "training/more/b_1.hdf5"]
    assert [str(p.relative_to(root)) for p in find_shards(root, "test")] == ["test/part-0.hdf5"]
    (root / "test").rename(tmp_path / "t")
    (root / "test").symlink_to(tmp_path / "t")  # a symlinked split directory
    assert [str(p.relative_to(root)) for p in find_shards(root, "test")] == ["test/part-0.hdf5"]
    # the input_dir named after a split, symlinked or not
    assert [p.name for p in find_shards(root / "test", "test")] == ["part-0.hdf5"]
    assert find_shards(root / "test", "training") == []
    assert [str(p.relative_to(root / "training")) for p in find_shards(root / "training", "training")] == [
        "a_0.hdf5", "more/b_0.hdf5", "more/b_1.hdf5"]
    (root / "training" / "gone_0.hdf5").symlink_to(tmp_path / "nowhere.hdf5")
    with pytest.raises(DataConfigError, match=r"training/gone_0\.hdf5: a symbolic link to \S+nowhere\.hdf5, which "
                                              r"does not exist; restore the shard there or remove the link"):
        find_shards(root, "training")


def test_an_input_dir_that_is_missing_or_a_file_says_so(tmp_path):
    """Not "no training shards found under it", which sends one looking for misnamed shards."""
    with pytest.raises(DataConfigError, match=f"^--input_dir {re.escape(str(tmp_path / 'typo'))} does not exist; "
                                              "pass the directory that holds the shards"):
        find_shards(tmp_path / "typo", "training")
    (tmp_path / "shard.hdf5").touch()
    with pytest.raises(DataConfigError, match="shard.hdf5 is a file, not a directory; pass the directory"):
        find_shards(tmp_path / "shard.hdf5", "training")


def test_every_epoch_visits_every_row_once_in_a_seeded_order(phase1_shards):
    ds = training_set(phase1_shards)
    n = len(ds)
    assert n == sum(h5py.File(p, "r")["input_ids"].shape[0] for p in find_shards(phase1_shards, "training"))
    epoch0 = [ds.locate(p) for p in range(n)]
    epoch1 = [ds.locate(p) for p in range(n, 2 * n)]
    assert len(set(epoch0)) == n and set(epoch0) == set(epoch1)
    assert epoch0 != epoch1
    again = training_set(phase1_shards)
    assert [again.locate(p) for p in range(0, 2 * n, 7)] == [ds.locate(p) for p in range(0, 2 * n, 7)]
    other_seed = training_set(phase1_shards, seed=2)
    assert [other_seed.locate(p) for p in range(50)] != epoch0[:50]
    # the shards are shuffled anew each epoch too, not only the rows within them
    first_shards = [ds.locate(epoch * n)[0] for epoch in range(8)]
    assert first_shards == [int(np.random.default_rng([1, epoch]).permutation(2)[0]) for epoch in range(8)]
    assert set(first_shards) == {0, 1}


def test_static_masks_come_from_the_file(phase1_shards):
    ds = training_set(phase1_shards)
    for position in (0, 1, 123, len(ds) + 5):
        sample = ds[position]
        shard, row = ds.locate(position)
        with h5py.File(ds.shards[shard].path, "r") as f:
            assert np.array_equal(sample["input_ids"], f["input_ids"][row])
            assert np.array_equal(sample["token_type_ids"], f["segment_ids"][row])
            assert np.array_equal(sample["attention_mask"], f["input_mask"][row])
            assert np.array_equal(sample["masked_lm_positions"], f["masked_lm_positions"][row])
            ids = f["masked_lm_ids"][row]
            assert int(sample["next_sentence_labels"]) == int(f["next_sentence_labels"][row])
        assert np.array_equal(sample["masked_lm_labels"], np.where(ids == 0, IGNORE_INDEX, ids))
        assert (sample["masked_lm_labels"] != IGNORE_INDEX).sum() > 0


def test_reference_format_shards_read_the_same_samples(phase1_shards, tmp_path):
    for src in find_shards(phase1_shards, "training"):
        to_reference_format(src, tmp_path / src.name.replace("wikicorpus_en", "hdf5_lower_case_1_seq_len_128"))
    ours, reference = training_set(phase1_shards), training_set(tmp_path)
    assert len(ours) == len(reference)
    for position in range(0, 3 * len(ours), 97):
        a, b = ours[position], reference[position]
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_dynamic_masking_is_bert_style_and_seeded_by_position(dynamic_shards):
    ds = training_set(dynamic_shards)
    assert not ds.shards[0].static_masks
    vocab = (dynamic_shards / "vocab.txt").read_text().split("\n")
    cls_id, sep_id, mask_id = vocab.index("[CLS]"), vocab.index("[SEP]"), vocab.index("[MASK]")
    replaced_by_mask = unchanged = total = differs = 0
    again = training_set(dynamic_shards)
    next_epoch = {ds.locate(p): p for p in range(len(ds), 2 * len(ds))}
    for position in range(200):
        sample = ds[position]
        shard, row = ds.locate(position)
        with h5py.File(ds.shards[shard].path, "r") as f:
            original = f["input_ids"][row].astype(np.int64)
        labels = sample["masked_lm_labels"]
        count = int((labels != IGNORE_INDEX).sum())
        slots = sample["masked_lm_positions"][:count]
        # The reference's count: 15% of all tokens, [CLS] and [SEP]s included.
        assert count == min(20, max(1, round(int(sample["attention_mask"].sum()) * 0.15)))
        assert np.all(np.diff(slots) > 0) and np.all(sample["masked_lm_positions"][count:] == 0)
        assert np.array_equal(labels[:count], original[slots])
        assert not np.isin(original[slots], [cls_id, sep_id, 0]).any()
        unmasked = np.setdiff1d(np.arange(128), slots)
        assert np.array_equal(sample["input_ids"][unmasked], original[unmasked])
        replaced_by_mask += int((sample["input_ids"][slots] == mask_id).sum())
        unchanged += int((sample["input_ids"][slots] == original[slots]).sum())
        # A random replacement is never a special token, as in static masks.
        assert not np.isin(sample["input_ids"][slots], [0, 100, cls_id, sep_id]).any()
        total += count
        assert all(np.array_equal(sample[k], again[position][k]) for k in sample)
        # Seeded by the stream position, not the row: the same row in the next epoch is masked anew.
        later = ds[next_epoch[(shard, row)]]
        differs += not np.array_equal(later["masked_lm_positions"], sample["masked_lm_positions"])
    # 80% [MASK], 10% random, 10% unchanged (a random draw of the token itself counts as unchanged: 1 in 30k)
    assert total > 2000 and differs >= 195
    assert 0.75 < replaced_by_mask / total < 0.85
    assert 0.065 < unchanged / total < 0.135 and 0.065 < (total - replaced_by_mask - unchanged) / total < 0.135


def test_dynamic_masking_refuses_a_vocab_that_is_not_the_shards(dynamic_shards, tmp_path):
    """Dynamic masks take [CLS], [SEP], [MASK] and the random replacements from the vocab.txt beside the shards:
    one with more tokens than the model fed it ids without an embedding; one with fewer, a bare IndexError under
    whole-word masking (and nothing at all without); one with other special ids masked [CLS] and [SEP] (122 of
    300 rows, with [CLS]/[SEP] swapped with [unused0]/[unused1])."""
    (tmp_path / "hdf5").symlink_to(dynamic_shards / "hdf5")
    tokens = (dynamic_shards / "vocab.txt").read_text().splitlines()
    first = find_shards(tmp_path, "training")[0]
    for size in (VOCAB + 1, 29_000):
        (tmp_path / "vocab.txt").write_text("\n".join((tokens + ["[extra]"])[:size]) + "\n")
        with pytest.raises(DataConfigError, match=rf"vocab\.txt: holds {size} tokens but {re.escape(str(first))} was "
                                                  rf"made with a vocabulary of {VOCAB}; put the vocabulary the shards "
                                                  "were made with there"):
            training_set(tmp_path)
    # Reference-format shards do not say their vocabulary: one larger than the model's, or an id it lacks, is
    # found as rows are read.
    reference = tmp_path / "reference"
    reference.mkdir()
    for src in find_shards(dynamic_shards, "training"):
        to_reference_format(src, reference / src.name)
    (reference / "vocab.txt").write_text("\n".join(tokens + ["[extra]"]) + "\n")
    with pytest.raises(DataConfigError, match=rf"vocab\.txt: holds {VOCAB + 1} tokens but the model config has "
                                              rf"vocab_size {VOCAB}; dynamic masking would feed the model ids it has no "
                                              rf"embedding for: set vocab_size to at least {VOCAB + 1}"):
        training_set(reference)
    (reference / "vocab.txt").write_text("\n".join(tokens[:20_000]) + "\n")
    ds = training_set(reference)
    batch, shard = list(range(64)), ds.locate(0)[0]
    with h5py.File(ds.shards[shard].path, "r") as f:
        ids = f["input_ids"][()]
    row = next(r for s, r in map(ds.locate, batch) if s == shard and ids[r].max() >= 20_000)  # the first met
    with pytest.raises(DataConfigError, match=rf"_training_{shard}\.hdf5: row {row} holds token id "
                                              rf"{ids[row].max()}, but the vocab.txt beside the shards has 20000 "
                                              "tokens; it is not the vocabulary they were made with"):
        ds.__getitems__(batch)
    cls_id, unused = tokens.index("[CLS]"), tokens.index("[unused0]")
    tokens[cls_id], tokens[unused] = tokens[unused], tokens[cls_id]
    (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n")
    ds = training_set(tmp_path)
    shard, row = ds.locate(7)
    with pytest.raises(DataConfigError, match=rf"wikicorpus_en_training_{shard}\.hdf5: row {row} begins with id "
                                              rf"{cls_id}, but \[CLS\] is {unused} in the vocab\.txt beside the shards"):
        ds[7]


def test_dynamic_masks_of_a_row_differ_from_epoch_to_epoch(dynamic_shards):
    """What dynamic masking is for: a row seen again in a later epoch is masked anew."""
    ds = training_set(dynamic_shards)
    n = len(ds)
    where = {ds.locate(p): p for p in range(n)}
    changed = 0
    for position in range(n, n + 50):  # epoch 1: each row's epoch-0 position is where[...]
        first = ds[where[ds.locate(position)]]
        again = ds[position]
        changed += not np.array_equal(first["masked_lm_positions"], again["masked_lm_positions"])
    assert changed >= 48


def test_dynamic_masks_follow_the_seed(dynamic_shards):
    """Unshuffled, every seed puts the same rows at the same positions: only the seed can change their masks."""
    runs = [open_split(dynamic_shards, "training", 128, 20, VOCAB, seed=seed, shuffle=False) for seed in (1, 2, 1)]
    changed = 0
    for position in range(50):
        first, other, again = (ds[position] for ds in runs)
        assert np.array_equal(first["masked_lm_labels"] != IGNORE_INDEX, other["masked_lm_labels"] != IGNORE_INDEX)
        assert all(np.array_equal(first[k], again[k]) for k in first)
        changed += not np.array_equal(first["masked_lm_positions"], other["masked_lm_positions"])
    assert changed >= 48


def test_dynamic_masking_follows_the_shards_recipe(phase1_shards, tmp_path):
    """--masked_lm_prob and --whole_word_masking, recorded in dynamic shards, drive the loader's masks."""
    instances = tmp_path / "instances"
    create(CreateConfig(next((phase1_shards / "text").glob("tokens_*")), phase1_shards / "vocab.txt", instances,
                        max_predictions_per_seq=60, dupe_factor=1, masked_lm_prob=0.3, whole_word_masking=True,
                        static_masking=False, test_fraction=0.1))
    shard(ShardConfig(instances, tmp_path / "hdf5", num_shards=2))
    (tmp_path / "vocab.txt").write_bytes((phase1_shards / "vocab.txt").read_bytes())
    ds = training_set(tmp_path, max_predictions=60)
    assert (ds.shards[0].masked_lm_prob, ds.shards[0].whole_word_masking) == (0.3, True)
    vocab = (tmp_path / "vocab.txt").read_text().split("\n")
    is_piece = np.array([t.startswith("##") for t in vocab])
    masked_share, pieces_masked = [], 0
    for position in range(0, len(ds), max(1, len(ds) // 300)):
        sample, (shard_index, row) = ds[position], ds.locate(position)
        with h5py.File(ds.shards[shard_index].path, "r") as f:
            original = f["input_ids"][row].astype(np.int64)
        count = int((sample["masked_lm_labels"] != IGNORE_INDEX).sum())
        masked = np.zeros(128, dtype=bool)
        masked[sample["masked_lm_positions"][:count]] = True
        total = int(sample["attention_mask"].sum())
        assert 0 < count <= min(60, round(total * 0.3))  # whole words: a word that does not fit is skipped
        masked_share.append(count / total)
        # Whole words: a masked piece's neighbours within its word are masked too.
        piece = is_piece[original] & ~np.isin(np.roll(original, 1), [101, 102])
        assert masked[:-1][piece[1:] & masked[1:]].all() and masked[1:][piece[1:] & masked[:-1]].all()
        pieces_masked += int(piece[masked].sum())
    assert 0.27 < np.mean(masked_share) < 0.31 and pieces_masked > 50
    # A batch is masked at once, each row as it is alone (ds[p]): by its stream position, whatever its batch.
    batch = list(range(0, 3 * len(ds), 3 * len(ds) // 64))[:64]
    assert len({ds.locate(p)[0] for p in batch}) == 2
    for position, sample in zip(batch, ds.__getitems__(batch), strict=True):
        alone = ds[position]
        assert all(np.array_equal(sample[k], alone[k]) for k in alone)


def test_at_most_two_shards_are_open_per_process(phase1_shards, tmp_path):
    # four shards: the two of phase1_shards, twice (as copies under other names)
    for i, src in enumerate(find_shards(phase1_shards, "training") * 2):
        (tmp_path / f"x_training_{i}.hdf5").write_bytes(src.read_bytes())
    ds = training_set(tmp_path)
    seen = set()
    for position in range(0, len(ds), 37):
        ds[position]
        seen.add(ds.locate(position)[0])
        assert len(ds._files) <= 2
        assert ds._ahead is None  # a mapped shard reads nothing ahead
    assert len(seen) == 4


def _gzip_shards(phase1_shards: Path, dst: Path, copies: int) -> Path:
    """phase1_shards' training shards, `copies` times each, as gzip datasets (NVIDIA's layout)."""
    return _stored_shards(phase1_shards, dst, ["gzip"] * 2 * copies)


def _stored_shards(phase1_shards: Path, dst: Path, compressions: list[str | None]) -> Path:
    """x_training_{i}.hdf5 under dst: phase1_shards' training shards in turn, the i-th file's datasets stored
    with compressions[i] (None: uncompressed, as ours)."""
    dst.mkdir()
    sources = find_shards(phase1_shards, "training")
    for i, compression in enumerate(compressions):
        with h5py.File(sources[i % len(sources)], "r") as fin, h5py.File(dst / f"x_training_{i}.hdf5", "w") as fout:
            for key in fin:
                fout.create_dataset(key, data=fin[key][()], compression=compression)
            fout.attrs.update(fin.attrs)
    return dst


def test_the_next_compressed_shard_is_read_ahead_within_the_bound(phase1_shards, tmp_path):
    """When the stream opens a compressed shard, the shard it enters next (in this epoch's order or the
    next epoch's) is read in the background; the switch takes those arrays instead of reading the shard."""
    ds = training_set(_gzip_shards(phase1_shards, tmp_path / "gz", copies=2))
    starts = [p for p in range(1, 3 * len(ds)) if ds.locate(p)[0] != ds.locate(p - 1)[0]]
    ds[0]
    pending = ds._ahead
    assert pending is not None and pending.shard == ds.locate(starts[0])[0] != ds.locate(0)[0]
    pending.wait()  # not asked for by any position yet, but read
    with h5py.File(ds.shards[pending.shard].path, "r") as f:
        assert np.array_equal(pending._data["input_ids"], f["input_ids"][()])
    taken = 0
    for start in starts:
        shard, pending = ds.locate(start)[0], ds._ahead
        if shard in ds._files:  # an epoch ending with the shard the next begins with
            assert pending is None
        else:
            assert pending is not None and pending.shard == shard
            taken += 1
        batch = list(range(start - 3, start + 3))
        for position, sample in zip(batch, ds.__getitems__(batch), strict=True):
            expected = _h5py_sample(ds, position)
            assert all(np.array_equal(sample[k], expected[k]) for k in expected)
        if pending is not None:
            assert ds._files[shard] is pending.result()
        assert len(ds._files) + (ds._ahead is not None) <= OPEN_FILES
    # 12 shard visits in 3 epochs (orders 0123, 2013, 3102): no switch where epoch 2 begins with the shard
    # epoch 1 ends with, and two switches (3 to 2, 3 to 1) re-enter the shard they left, still held.
    assert (len(starts), taken) == (10, 8)


def test_the_next_shard_is_read_ahead_when_it_is_read_whole_whatever_the_current_one(phase1_shards, tmp_path):
    """The read ahead follows the next shard's storage, not the current one's: from a mapped shard into a gzip
    one (only a shard read whole read ahead before, so the switch into gzip stalled), and never into a mapped
    one (a thread that would only map it), from a gzip shard neither."""
    ds = training_set(_stored_shards(phase1_shards, tmp_path / "mixed", [None, None, "gzip", None]))
    assert [s.read_whole for s in ds.shards] == [False, False, True, False]
    starts = [0] + [p for p in range(1, 3 * len(ds)) if ds.locate(p)[0] != ds.locate(p - 1)[0]]
    visits = [(ds.locate(start)[0], start) for start in starts]
    # Epochs 0-2 visit 0 1 2 3 | 2 0 1 3 | 3 1 0 2 (the last shard of one epoch is the first of the next: one visit).
    assert [entered for entered, _ in visits] == [0, 1, 2, 3, 2, 0, 1, 3, 1, 0, 2]
    ahead = []
    for entered, start in visits:
        pending, batch = ds._ahead, list(range(start, start + 3))
        for position, sample in zip(batch, ds.__getitems__(batch), strict=True):
            expected = _h5py_sample(ds, position)
            assert all(np.array_equal(sample[k], expected[k]) for k in expected)
        if pending is not None:  # the switch took the arrays read ahead
            assert pending.shard == entered and ds._files[entered] is pending.result()
        ahead.append(None if ds._ahead is None else (entered, ds._ahead.shard))
        assert len(ds._files) + (ds._ahead is not None) <= OPEN_FILES
    # Shard 2 begins epoch 1 while still held from epoch 0's end: nothing to read ahead in shard 3.
    assert ahead == [None, (1, 2), None, None, None, None, None, None, None, (0, 2), None]


def test_a_stream_with_an_end_reads_no_shard_ahead_past_it(phase1_shards, tmp_path):
    """Evaluation reads positions [0, --num_eval_samples): a shard that begins at the end or after is not
    read ahead (it never would be used); one that begins before it is."""
    root = _gzip_shards(phase1_shards, tmp_path / "gz", copies=1)

    def evaluation_set(stream_end: int | None):
        return open_split(root, "training", 128, 20, VOCAB, seed=1, shuffle=False, eval_samples=stream_end)

    boundary = int(evaluation_set(None).sizes[0])  # not shuffled: shard 0, then shard 1
    for stream_end in (boundary, boundary - 5):
        ds = evaluation_set(stream_end)
        for start in range(0, stream_end, 8):
            ds.__getitems__(list(range(start, min(start + 8, stream_end))))
            assert ds._ahead is None, stream_end
        assert list(ds._files) == [0]
    for stream_end in (boundary + 1, None):
        ds = evaluation_set(stream_end)
        ds[0]
        pending = ds._ahead
        assert pending is not None and pending.shard == 1, stream_end
        assert np.array_equal(ds[boundary]["input_ids"], _h5py_sample(ds, boundary)["input_ids"])
        assert ds._files[1] is pending.result()
        assert list(ds._files) == [0, 1] and ds._ahead is None  # the next epoch begins with shard 0, held


def test_an_evaluation_past_the_test_set_reads_no_shard_of_a_next_epoch_ahead(phase1_shards, tmp_path):
    """--num_eval_samples above the test set's size evaluates the test set once (run_pretraining.evaluate):
    the stream ends with the epoch, so its last shard reads no shard of the next epoch ahead."""
    root = _gzip_shards(phase1_shards, tmp_path / "gz", copies=2)  # 4 shards: the first is not held at the last

    def last_shard_ahead(eval_samples: int | None) -> int | None:
        ds = open_split(root, "training", 128, 20, VOCAB, seed=1, shuffle=False, eval_samples=eval_samples)
        last = len(ds) - int(ds.sizes[-1])
        ds[last]
        return None if ds._ahead is None else ds._ahead.shard

    ds = open_split(root, "training", 128, 20, VOCAB, seed=1, shuffle=False, eval_samples=10**9)
    assert ds.stream_end == len(ds)
    assert last_shard_ahead(10**9) is None
    assert last_shard_ahead(None) == 0  # a training stream goes on into the next epoch


def test_a_corrupt_next_shard_fails_when_the_stream_enters_it(phase1_shards, tmp_path):
    """A read ahead that fails raises nothing until its shard is used, then the synchronous read's error."""
    root = _gzip_shards(phase1_shards, tmp_path / "gz", copies=1)
    ds, synchronous = training_set(root), training_set(root, read_ahead=False)
    assert ds.read_ahead and not synchronous.read_ahead
    boundary = int(ds.sizes[ds.locate(0)[0]])  # epoch 0 begins with the whole of one shard
    path = Path(ds.shards[ds.locate(boundary)[0]].path)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    first = list(range(boundary))
    for a, b in zip(ds.__getitems__(first), synchronous.__getitems__(first), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    ds._ahead.wait()
    assert isinstance(ds._ahead._error, DataConfigError)
    with pytest.raises(DataConfigError) as expected:
        synchronous[boundary]
    assert str(expected.value).startswith(f"{path}: cannot read the shard (")
    assert "truncated file" in str(expected.value) and str(expected.value).endswith("restore it, then resume the run")
    for _ in range(2):  # the read ahead's error, then the synchronous read's
        with pytest.raises(DataConfigError) as raised:
            ds[boundary]
        assert type(raised.value) is type(expected.value) and str(raised.value) == str(expected.value)
    assert np.array_equal(ds[boundary - 1]["input_ids"], synchronous[boundary - 1]["input_ids"])


def test_compressed_shards_read_the_same_samples(phase1_shards, tmp_path):
    for src in find_shards(phase1_shards, "training"):
        with h5py.File(src, "r") as fin, h5py.File(tmp_path / src.name, "w") as fout:
            for key in fin:
                fout.create_dataset(key, data=fin[key][()], compression="gzip")
            fout.attrs.update(fin.attrs)
    plain, packed = training_set(phase1_shards), training_set(tmp_path)
    for position in range(0, len(plain), 53):
        a, b = plain[position], packed[position]
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_compressed_shards_decompress_each_chunk_once(phase1_shards, tmp_path, monkeypatch):
    """NVIDIA's and Habana's shards are gzip datasets in h5py's automatic chunks: column strips (about
    rows / 64 by 4 positions), 32 of which hold a row of input_ids. Each row reopened its datasets,
    which dropped their chunk caches, and decompressed its strips anew: a 500,000-row NVIDIA-style
    shard read 34 rows/s. Every compressed byte is now read from the file once, however many rows need it
    (a compressed dataset is read whole when the shard's first row is)."""
    for src in find_shards(phase1_shards, "training"):
        with h5py.File(src, "r") as fin, h5py.File(tmp_path / src.name, "w") as fout:
            for key in fin:
                data = fin[key][()]
                strip = (-(-len(data) // 64),) + ((4,) if data.ndim == 2 else ())
                fout.create_dataset(key, data=data, compression="gzip", chunks=strip)
            fout.attrs.update(fin.attrs)
    plain, packed = training_set(phase1_shards), training_set(tmp_path)
    count = 300
    first = [p for p in range(len(plain)) if plain.locate(p)[0] == plain.locate(0)[0]][:count]
    expected = [plain[p] for p in first]
    real_file, read = h5py.File, {}  # bytes read, by file

    class CountingFile(io.FileIO):
        def readinto(self, buffer) -> int:
            n = super().readinto(buffer)
            read[self.name] = read.get(self.name, 0) + n
            return n

    monkeypatch.setattr(h5py, "File", lambda path, *args, **kwargs: real_file(CountingFile(path, "rb"), *args, **kwargs))
    for position, a in zip(first, expected, strict=True):
        b = packed[position]
        assert all(np.array_equal(a[k], b[k]) for k in a)
    packed._ahead.wait()  # the other shard, read ahead: once too
    assert len(first) == count < packed.shards[packed.locate(0)[0]].num_samples
    assert sorted(read) == sorted(s.path for s in packed.shards)
    for path, n in read.items():
        assert n <= Path(path).stat().st_size, f"read {n:,} bytes of {path} for {count} rows"


def _h5py_sample(ds, position: int) -> dict[str, np.ndarray]:
    """A sample as a straightforward h5py read of its row gives it (the loader's output before rows were
    memory-mapped or read whole)."""
    shard, row = ds.locate(position)
    with h5py.File(ds.shards[shard].path, "r") as f:
        sample = {"input_ids": f["input_ids"][row].astype(np.int64),
                  "token_type_ids": f["segment_ids"][row].astype(np.int64),
                  "attention_mask": f["input_mask"][row].astype(np.int64),
                  "next_sentence_labels": np.asarray(f["next_sentence_labels"][row], dtype=np.int64).reshape(())}
        if ds.shards[shard].static_masks:
            positions, ids = (f[key][row].astype(np.int64) for key in ("masked_lm_positions", "masked_lm_ids"))
    if not ds.shards[shard].static_masks:  # the row masked alone
        block = {key: values[None] for key, values in sample.items()}
        positions, ids = (masks[0] for masks in ds._mask(block, shard, np.array([row]), [position]))
        sample["input_ids"] = block["input_ids"][0]
    return sample | {"masked_lm_positions": positions, "masked_lm_labels": np.where(ids == 0, IGNORE_INDEX, ids)}


def _rewrite(src_dir: Path, dst_dir: Path, write, **file_kwargs) -> None:
    """The training shards of src_dir (and its vocab.txt) under dst_dir, each dataset written by
    write(file, key, data)."""
    dst_dir.mkdir()
    (dst_dir / "vocab.txt").write_bytes((src_dir / "vocab.txt").read_bytes())
    for src in find_shards(src_dir, "training"):
        with h5py.File(src, "r") as fin, h5py.File(dst_dir / src.name, "w", **file_kwargs) as fout:
            for key in fin:
                write(fout, key, fin[key][()])
            fout.attrs.update(fin.attrs)


FOREIGN_DTYPES = {"input_ids": ">i2", "input_mask": "<u2", "segment_ids": ">i8", "masked_lm_positions": ">u4",
                  "masked_lm_ids": "<i2", "next_sentence_labels": ">i1"}


def _mixed_layouts(fout: h5py.File, key: str, data: np.ndarray) -> None:
    """Each layout a shard may have: contiguous (mapped), chunked uncompressed, compact, in an external
    file, and contiguous but never written (no offset: all fill value, zeros)."""
    if key == "input_ids":
        fout[key] = data
    elif key == "input_mask":
        fout.create_dataset(key, data=data, chunks=(100, 128))
    elif key == "next_sentence_labels":
        create = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        create.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple(data.shape)
        h5py.h5d.create(fout.id, key.encode(), h5py.h5t.py_create(data.dtype), space, dcpl=create).write(
            h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))
    elif key == "masked_lm_positions":
        outside = Path(fout.filename).with_suffix(".positions")
        fout.create_dataset(key, data=data, external=[(str(outside), 0, h5py.h5f.UNLIMITED)])
    elif key == "segment_ids":
        fout.create_dataset(key, shape=data.shape, dtype=data.dtype)  # all segment A
    else:
        fout[key] = data


LAYOUTS = {
    # name: (how each dataset is written, h5py.File arguments, the datasets read through a map of the file)
    "ours, uncompressed": (lambda f, k, d: f.create_dataset(k, data=d), {}, "all"),
    "gzip in h5py's automatic chunks (NVIDIA's)": (lambda f, k, d: f.create_dataset(k, data=d, compression="gzip"),
                                                   {}, ()),
    "big-endian and 16-bit integers": (lambda f, k, d: f.create_dataset(k, data=d.astype(FOREIGN_DTYPES[k])),
                                       {}, "all"),
    "after a 4 KiB user block": (lambda f, k, d: f.create_dataset(k, data=d), {"userblock_size": 4096}, "all"),
    "mixed layouts": (_mixed_layouts, {}, ("input_ids", "masked_lm_ids")),
}


@pytest.mark.parametrize("masking", ["static", "dynamic"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_samples_are_the_rows_h5py_reads(phase1_shards, dynamic_shards, tmp_path, layout, masking):
    """Rows come from a map of the file where a dataset lies there contiguously, from the dataset read whole
    otherwise; either way a sample is what reading its row with h5py gives, in batches (__getitems__, as a
    DataLoader asks) and alone, across a shard and an epoch boundary."""
    write, file_kwargs, mapped = LAYOUTS[layout]
    _rewrite(phase1_shards if masking == "static" else dynamic_shards, tmp_path / "shards", write, **file_kwargs)
    ds = training_set(tmp_path / "shards")
    n = len(ds)
    boundary = next(p for p in range(1, n) if ds.locate(p)[0] != ds.locate(p - 1)[0])
    rng = np.random.default_rng(0)
    batches = [list(range(boundary - 30, boundary + 34)), list(range(n - 40, n + 24)),
               sorted(rng.integers(0, 3 * n, 64).tolist())]
    for batch in batches:
        for position, sample in zip(batch, ds.__getitems__(batch), strict=True):
            expected = _h5py_sample(ds, position)
            assert list(sample) == list(expected)
            for key, value in expected.items():
                assert sample[key].dtype == np.int64 and sample[key].shape == value.shape, (layout, key)
                assert np.array_equal(sample[key], value), (layout, position, key)
    for position in rng.integers(0, 3 * n, 20).tolist():
        sample, expected = ds[position], _h5py_sample(ds, position)
        assert all(np.array_equal(sample[k], expected[k]) and sample[k].dtype == np.int64 for k in expected)
    for arrays in ds._files.values():
        assert {k for k, a in arrays.items() if file_map(a)} == set(arrays if mapped == "all" else mapped) & set(arrays)
    assert [s.read_whole for s in ds.shards] == [mapped != "all"] * len(ds.shards)  # as inspect_shard found them


@pytest.mark.parametrize("masking", ["static", "dynamic"])
def test_workers_prefetch_the_same_batches(phase1_shards, dynamic_shards, masking):
    """Dynamic masks are drawn in the workers: seeded by the sample's position, not by the worker."""
    ds = training_set(phase1_shards if masking == "static" else dynamic_shards)
    serial = list(itertools.islice(make_loader(ds, RankSampler(16, 4, 1, 2), 4, num_workers=0), 3))
    parallel = list(itertools.islice(make_loader(ds, RankSampler(16, 4, 1, 2), 4, num_workers=2), 3))
    for a, b in zip(serial, parallel, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert serial[0]["input_ids"].shape == (4, 128) and serial[0]["input_ids"].dtype == torch.int64


def test_workers_reading_ahead_give_the_same_batches(phase1_shards, tmp_path):
    """Across a switch between compressed shards: the main process reading ahead, workers forked from it after
    that (holding its shards, which they drop: another pid) reading ahead themselves, and uncompressed shards
    read as they are entered, alike."""
    ds = training_set(_gzip_shards(phase1_shards, tmp_path / "gz", copies=1))
    boundary = int(ds.sizes[ds.locate(0)[0]])
    batches = {}
    for name, dataset, workers in (("main", ds, 0), ("workers", ds, 2), ("mapped", training_set(phase1_shards), 0)):
        loader = make_loader(dataset, RankSampler(boundary - 24, 4, 1, 2), 4, num_workers=workers)
        batches[name] = list(itertools.islice(loader, 6))
    assert batches["main"][2]["input_ids"].shape == (4, 128)
    for name in ("workers", "mapped"):
        for a, b in zip(batches["main"], batches[name], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_sequence_length_mismatch_names_file_and_flag(phase1_shards):
    # the lengths are numbers: the message said "has sequence length (128,)" and "holds (20,) predictions"
    with pytest.raises(DataConfigError, match=r"wikicorpus_en_training_0\.hdf5: 'input_ids' has sequence length 128 "
                                              r"but --max_seq_length is 512; pass --max_seq_length 128 or"):
        training_set(phase1_shards, max_seq_length=512)


def test_a_dataset_of_the_wrong_rank_is_named_with_its_shape(tmp_path):
    """A 1-D input_ids had shape[1:] == (), and the error told to pass --max_seq_length <row count>."""
    path = tmp_path / "x_training_0.hdf5"
    with h5py.File(path, "w") as f:
        for key in ("input_ids", "input_mask", "segment_ids", "next_sentence_labels"):
            f.create_dataset(key, data=np.zeros(6, dtype=np.int32))
    with pytest.raises(DataConfigError, match=r"x_training_0\.hdf5: dataset 'input_ids' has shape \(6,\); "
                                              r"expected \[rows, positions\]"):
        inspect_shard(path, 128, 20, 30522)


def test_next_sentence_labels_of_another_shape_are_named(phase1_shards, tmp_path):
    """[rows, 2] labels (one-hot, say) failed at the first sample with numpy's "cannot reshape array of size 2
    into shape ()", naming no file; [rows, 1] is one label per row and reads as such."""
    src = find_shards(phase1_shards, "training")[0]
    for columns in (2, 1):
        with h5py.File(src, "r") as fin, h5py.File(tmp_path / "x_training_0.hdf5", "w") as fout:
            for key in fin:
                data = fin[key][()]
                fout[key] = np.stack([data] * columns, axis=1) if key == "next_sentence_labels" else data
        if columns == 2:
            with pytest.raises(DataConfigError, match=r"x_training_0\.hdf5: dataset 'next_sentence_labels' has shape "
                                                      r"\(\d+, 2\); expected \[rows\]"):
                training_set(tmp_path)
    ds = training_set(tmp_path)
    with h5py.File(src, "r") as f:
        assert int(ds[0]["next_sentence_labels"]) == int(f["next_sentence_labels"][ds.locate(0)[1]])


def test_max_predictions_mismatch_names_file_and_flag(phase1_shards, dynamic_shards):
    with pytest.raises(DataConfigError, match=r"\.hdf5: 'masked_lm_positions' holds 20 predictions per sequence but "
                                              r"--max_predictions_per_seq is 80; pass --max_predictions_per_seq 20"):
        training_set(phase1_shards, max_predictions=80)
    # without static masks the attribute is checked the same way: the shards' --max_predictions_per_seq counts
    with pytest.raises(DataConfigError, match=r"attribute max_predictions_per_seq=20 but --max_predictions_per_seq "
                                              r"is 80; pass --max_predictions_per_seq 20 or recreate the shards"):
        training_set(dynamic_shards, max_predictions=80)


def test_vocab_size_mismatch_is_caught_from_attributes(phase1_shards):
    with pytest.raises(DataConfigError, match=r"vocabulary of 30522 tokens but the model config has vocab_size 1000"):
        training_set(phase1_shards, vocab_size=1000)


def test_vocab_size_mismatch_is_caught_in_reference_shards_without_attributes(phase1_shards, tmp_path):
    src = find_shards(phase1_shards, "training")[0]
    to_reference_format(src, tmp_path / "ref_training_0.hdf5")
    ds = training_set(tmp_path, vocab_size=2000)  # no attributes: found when a sample is read
    with pytest.raises(DataConfigError, match=r"ref_training_0\.hdf5: row \d+ holds token id \d+, outside"):
        for position in range(50):
            ds[position]
    # the boundary: an id equal to vocab_size is outside the embedding table already
    with h5py.File(tmp_path / "ref_training_0.hdf5", "r") as f:
        ids = f["input_ids"][()]
    largest = int(ids.max())
    row = int(np.nonzero((ids == largest).any(axis=1))[0][0])
    ds = training_set(tmp_path, vocab_size=largest)
    position = next(p for p in range(len(ds)) if ds.locate(p)[1] == row)
    with pytest.raises(DataConfigError, match=rf"row {row} holds token id {largest}, outside the model's vocab_size "
                                              rf"{largest}"):
        ds[position]
    assert training_set(tmp_path, vocab_size=largest + 1)[position]["input_ids"].max() == largest


def test_a_shard_error_in_a_dataloader_worker_keeps_its_message(phase1_shards, tmp_path):
    """torch raises a worker's error again in the main process with a message of its own (the worker's
    traceback); the run prints the message the error was raised with, as with 0 workers. The workers have
    stopped while the error is still held (training.loader.batches_of)."""
    src = find_shards(phase1_shards, "training")[0]
    to_reference_format(src, tmp_path / "ref_training_0.hdf5")
    errors = {}
    for workers in (0, 2):
        with pytest.raises(DataConfigError) as caught:
            drain(make_loader(training_set(tmp_path, vocab_size=2000), RankSampler(0, 4, 0, 1), 4, workers))
        errors[workers] = (str(caught.value), raised_message(caught.value))
        no_workers_left()
    assert errors[2][0].startswith("Caught DataConfigError in DataLoader worker process ")
    assert "Traceback (most recent call last)" in errors[2][0]
    assert re.fullmatch(r"\S+ref_training_0\.hdf5: row \d+ holds token id \d+, outside the model's vocab_size 2000; "
                        r"the shards were made with another vocabulary, set vocab_size in --config_file to match it",
                        errors[0][1])
    assert errors[2][1] == errors[0][1] == errors[0][0]


def test_static_masks_outside_the_sequence_or_vocabulary_name_the_row(phase1_shards, tmp_path):
    """A masked position past the sequence or a masked id past the vocabulary was an index error inside the
    model (a device-side assert on a GPU), naming no file; input_ids alone were checked."""
    shard, row = training_set(phase1_shards).locate(0)
    for key, value, message in (("masked_lm_positions", 128, r"holds masked_lm_positions \d+\.\.\.128, outside its 128 "
                                                              r"positions; the shard is corrupt"),
                                ("masked_lm_ids", VOCAB, rf"holds masked_lm_ids {VOCAB}, outside the model's vocab_size")):
        (tmp_path / key).mkdir()
        for i, path in enumerate(find_shards(phase1_shards, "training")):
            with h5py.File(path, "r") as fin, h5py.File(tmp_path / key / path.name, "w") as fout:
                for k in fin:
                    data = fin[k][()]
                    if k == key and i == shard:
                        data[row, -1] = value
                    fout[k] = data
                fout.attrs.update(fin.attrs)
        bad = training_set(tmp_path / key)
        bad[1]  # other rows read
        with pytest.raises(DataConfigError, match=rf"wikicorpus_en_training_{shard}\.hdf5: row {row} {message}"):
            bad[0]
        with pytest.raises(DataConfigError, match=rf"wikicorpus_en_training_{shard}\.hdf5: row {row} {message}"):
            bad.__getitems__([2, 1, 0, 3])  # within a batch, as a DataLoader reads


@pytest.mark.parametrize("key, value", [("segment_ids", 2), ("input_mask", 2), ("next_sentence_labels", 2),
                                        ("segment_ids", -1)])
def test_segment_ids_input_mask_and_labels_other_than_0_and_1_name_the_row(phase1_shards, tmp_path, key, value):
    """Only ids and masks were checked: a segment id or NSP label of 2 was an index error inside the model naming
    no file (an embedding lookup, the NSP loss), an input_mask of 2 a wrong attention bias without an error."""
    shard, row = training_set(phase1_shards).locate(0)
    for i, path in enumerate(find_shards(phase1_shards, "training")):
        with h5py.File(path, "r") as fin, h5py.File(tmp_path / path.name, "w") as fout:
            for k in fin:
                data = fin[k][()]
                if k == key and i == shard:
                    data[row, ...] = value
                fout[k] = data
            fout.attrs.update(fin.attrs)
    bad = training_set(tmp_path)
    bad[1]
    with pytest.raises(DataConfigError, match=rf"wikicorpus_en_training_{shard}\.hdf5: row {row} holds {key} {value}; "
                                              "they are 0 or 1 in a pretraining shard"):
        bad.__getitems__([2, 1, 0, 3])


def test_static_and_dynamic_shards_are_not_mixed(phase1_shards, dynamic_shards, tmp_path):
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "a_training_0.hdf5").write_bytes(find_shards(phase1_shards, "training")[0].read_bytes())
    (tmp_path / "training" / "b_training_0.hdf5").write_bytes(find_shards(dynamic_shards, "training")[0].read_bytes())
    (tmp_path / "vocab.txt").write_bytes((dynamic_shards / "vocab.txt").read_bytes())
    with pytest.raises(DataConfigError, match="the input mixes shards with static masks and shards without; "
                                              "use one kind per --input_dir"):
        training_set(tmp_path)


def test_the_shards_case_is_read_and_shards_of_both_cases_are_not_mixed(phase1_shards, tmp_path):
    """A run keeps its shards' lower_case attribute for the tokenizer it exports; shards tokenized with
    and without lower-casing hold different ids for the same words, so no export could serve both."""
    ours = training_set(phase1_shards)
    assert [s.lower_case for s in ours.shards] == [True, True] and tokenization_case(ours, None) is True
    reference = tmp_path / "reference"
    reference.mkdir()
    for src in find_shards(phase1_shards, "training"):
        to_reference_format(src, reference / src.name)  # no attributes, as NVIDIA's and Habana's
    assert tokenization_case(training_set(reference)) is None
    (tmp_path / "training").mkdir()
    first, second = find_shards(phase1_shards, "training")
    cased = tmp_path / "training" / "b_training_0.hdf5"
    (tmp_path / "training" / "a_training_0.hdf5").write_bytes(first.read_bytes())
    cased.write_bytes(second.read_bytes())
    with h5py.File(cased, "r+") as f:
        f.attrs["lower_case"] = 0
    with pytest.raises(DataConfigError, match=rf"a_training_0.hdf5 was made from lower-cased text but {cased} from "
                                              "text that kept its case .*; train on shards made with one setting"):
        training_set(tmp_path)
    # Across the splits too: the test shards are evaluated by the same model.
    with h5py.File(cased, "r+") as f:
        f.attrs["lower_case"] = 1
    cased_test = find_shards(phase1_shards, "test")[0]
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / cased_test.name).write_bytes(cased_test.read_bytes())
    with h5py.File(tmp_path / "test" / cased_test.name, "r+") as f:
        f.attrs["lower_case"] = 0
    test_set = open_split(tmp_path, "test", 128, 20, VOCAB, seed=1, shuffle=False)
    assert tokenization_case(test_set) is False
    with pytest.raises(DataConfigError, match="from text that kept its case"):
        tokenization_case(training_set(tmp_path), test_set)


def test_open_files_are_not_reused_across_a_fork(phase1_shards, monkeypatch):
    """A DataLoader worker forked after the main process read a sample maps (or reads) the shard itself."""
    import training.loader

    ds = training_set(phase1_shards)
    before = ds[0]
    parents = dict(ds._files)
    assert parents
    monkeypatch.setattr(training.loader.os, "getpid", lambda: -7)  # as in a forked worker
    after = ds[0]
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert list(ds._files) == list(parents) and all(ds._files[k] is not parents[k] for k in parents)
    for index, arrays in parents.items():  # a map of its own; the parent's are left to the parent, readable
        assert file_map(ds._files[index]["input_ids"]) is not file_map(arrays["input_ids"])
        assert np.array_equal(arrays["input_ids"][0], ds._files[index]["input_ids"][0])


def test_missing_dataset_and_non_integer_dtype_are_clear(tmp_path):
    with h5py.File(tmp_path / "a_training_0.hdf5", "w") as f:
        f["input_ids"] = np.zeros((2, 128), np.int32)
    with pytest.raises(DataConfigError, match=r"a_training_0\.hdf5: missing dataset\(s\) input_mask"):
        training_set(tmp_path)
    with h5py.File(tmp_path / "a_training_0.hdf5", "w") as f:
        for key in ("input_ids", "input_mask", "segment_ids"):
            f[key] = np.zeros((2, 128), np.float32)
        f["next_sentence_labels"] = np.zeros(2, np.int8)
    with pytest.raises(DataConfigError, match="'input_ids' has dtype float32; expected an integer dtype"):
        training_set(tmp_path)
    # a group where a dataset belongs, a single value: were an AttributeError and an IndexError naming no file
    with h5py.File(tmp_path / "a_training_0.hdf5", "w") as f:
        f.create_group("input_ids")
        for key in ("input_mask", "segment_ids", "next_sentence_labels"):
            f[key] = np.zeros((2, 128), np.int8)
    with pytest.raises(DataConfigError, match=r"a_training_0\.hdf5: 'input_ids' is an HDF5 group, not a dataset"):
        training_set(tmp_path)
    with h5py.File(tmp_path / "a_training_0.hdf5", "w") as f:
        for key in ("input_ids", "input_mask", "segment_ids"):
            f[key] = np.zeros((2, 128), np.int8)
        f["next_sentence_labels"] = np.int8(0)
    with pytest.raises(DataConfigError, match=r"a_training_0\.hdf5: dataset 'next_sentence_labels' is a single value"):
        training_set(tmp_path)


FAILING_RUN = """
import sys
import run_pretraining
from pathlib import Path
from training.loader import RankSampler, make_loader, open_split

def failing_main():
    ds = open_split(Path(sys.argv[1]), "training", 128, 20, 30522, seed=1, shuffle=True)
    batches = iter(make_loader(ds, RankSampler(0, 4, 0, 1), 4, num_workers=2))
    next(batches)
    raise RuntimeError("an unexpected error while training")

run_pretraining.main = failing_main
run_pretraining.{end}
"""


def test_an_unexpected_error_with_workers_running_exits_1(phase1_shards):
    """The workers ignore SIGTERM, which multiprocessing's exit handler sends them before it waits for
    them: an error that left the interpreter to exit hung the rank for good (killed after 30 s here)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", FAILING_RUN.format(end="script()"), str(phase1_shards)], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: an unexpected error while training" in proc.stderr
