"""HDF5 pretraining data: lazy, split across ranks, in an order that resumes to the exact sample.

The sample stream is a pure function of (seed, position). Position p (0, 1, 2, ... over the
whole run, across epochs) maps to epoch p // N and, within that epoch, to a shard (shards are
shuffled per epoch) and a row (rows are shuffled per epoch and shard). Every micro step takes
the next `micro_batch * world_size` positions; rank r gets the r-th block of `micro_batch`.
So a run resumed at `consumed_samples` sees exactly the samples an uninterrupted run would
have seen, on any number of ranks. Each DataLoader worker opens the shards itself: an
uncompressed one is memory-mapped (rows are read as they are indexed, no rank loads it whole), a
compressed one is read whole and decompressed once; while the stream reads a shard, the next one, if
read whole, is read in a background thread, so that the stream finds it ready.

Shards are ours (data/prepare.py) or NVIDIA's / Habana's (same keys, any integer dtype, no
file attributes). Shards with `masked_lm_positions` / `masked_lm_ids` use those static masks;
shards without them are masked here, deterministically per position, by data.create's own
masking (BERT's rule, with the shards' `masked_lm_prob` and `whole_word_masking` attributes).
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import signal
import threading
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from data.create import MaskingVocab, mask_rows
from data.stage import PipelineError
from modeling import IGNORE_INDEX

REQUIRED_KEYS = ("input_ids", "input_mask", "segment_ids", "next_sentence_labels")
MASK_KEYS = ("masked_lm_positions", "masked_lm_ids")
BERT_MASKED_LM_PROB = 0.15  # dynamic masking of shards without our attributes (NVIDIA's, Habana's)
SPLITS = ("training", "test")
OPEN_FILES = 2  # shards held open (mapped or read) per process, the one being read ahead among them


class DataConfigError(ValueError):
    """Shards that do not match the run's configuration; the message names the file, field and fix."""


@dataclass(frozen=True)
class ShardInfo:
    path: str
    num_samples: int
    static_masks: bool
    # Dynamic masking's recipe, from our shards' attributes (BERT's defaults for others).
    masked_lm_prob: float = BERT_MASKED_LM_PROB
    whole_word_masking: bool = False
    lower_case: bool | None = None  # whether the text was lower-cased; None: the shard does not say
    vocab_size: int | None = None  # of the vocabulary the shard was made with; None: the shard does not say
    # Whether the loader reads a dataset of the shard whole (_read_shard), not through a map of the file: the
    # stream reads such a shard ahead. False in a ShardInfo made by hand, not by inspect_shard: none read ahead.
    read_whole: bool = False


def find_shards(input_dir: Path, split: str) -> list[Path]:
    """The split's `.hdf5` files under input_dir (recursively, into symlinked directories too), sorted by
    path: those inside a directory named after a split (`training/`, `test/`, input_dir itself included)
    belong to it; any other file belongs to the split whose name is a word of its file name
    (`wikicorpus_en_training_0.hdf5`), where words are separated by `_`, `-` or `.` (so "latest" or
    "pretraining" name no split)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(input_dir)
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise DataConfigError(f"--input_dir {root} {what}; pass the directory that holds the shards "
                              "(data.prepare's --output_dir, or its hdf5/ directory)")
    own = Path(os.path.abspath(root)).name  # as given: `--input_dir shards/training` holds training shards
    found = []
    for path in _hdf5_files(root):
        in_dirs = [d for d in (own, *path.relative_to(root).parts[:-1]) if d in SPLITS]
        if in_dirs:
            if in_dirs[-1] == split:
                found.append(path)
            continue
        named = set(re.split(r"[_.-]", path.stem)) & set(SPLITS)
        if len(named) > 1:
            raise DataConfigError(f"{path}: the file name names both splits ({' and '.join(sorted(named))}); "
                                  "rename it or move it into a training/ or test/ directory")
        if named == {split}:
            found.append(path)
    return sorted(found)


def _hdf5_files(root: Path) -> Iterator[Path]:
    """The `.hdf5` files under root. Path.rglob before Python 3.13 does not enter symlinked directories
    (a `training/more -> /data/shards` was skipped without a word); os.walk follows them, each directory
    once (two links to one place would list its files twice), none that holds root (a link back up would
    list root's files again, or those around it)."""
    top = os.path.realpath(root)
    seen: set[str] = set()
    for where, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(where)
        if real in seen or real != top and os.path.commonpath([real, top]) == real:
            dirs.clear()
            continue
        seen.add(real)
        dirs.sort()
        for name in files:
            if name.endswith(".hdf5"):
                path = Path(where, name)
                if path.is_symlink() and not path.exists():
                    raise DataConfigError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist; "
                                          "restore the shard there or remove the link")
                if path.is_file():
                    yield path


def inspect_shard(path: Path, max_seq_length: int, max_predictions: int, vocab_size: int) -> ShardInfo:
    """Check a shard's keys, shapes, dtypes and attributes against the run; read no samples."""
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataConfigError(f"{path}: not a readable HDF5 file ({e})") from e
    with f:
        missing = [k for k in REQUIRED_KEYS if k not in f]
        if missing:
            raise DataConfigError(f"{path}: missing dataset(s) {', '.join(missing)}; "
                                  f"a pretraining shard needs {', '.join(REQUIRED_KEYS)}")
        present = [k for k in MASK_KEYS if k in f]
        if len(present) == 1:
            raise DataConfigError(f"{path}: has '{present[0]}' but not its partner; static masks need both "
                                  f"{' and '.join(MASK_KEYS)}")
        static = len(present) == 2
        keys = REQUIRED_KEYS + tuple(present)  # those the loader reads
        for key in keys:
            if not isinstance(f[key], h5py.Dataset):
                raise DataConfigError(f"{path}: '{key}' is an HDF5 {type(f[key]).__name__.lower()}, not a dataset; "
                                      "a pretraining shard holds one dataset per key")
            if f[key].ndim == 0:
                raise DataConfigError(f"{path}: dataset '{key}' is a single value (shape ()); expected one row per "
                                      "sequence")
        n = f["input_ids"].shape[0]
        for key in keys:
            ds = f[key]
            if not np.issubdtype(ds.dtype, np.integer):
                raise DataConfigError(f"{path}: dataset '{key}' has dtype {ds.dtype}; expected an integer dtype")
            if ds.shape[0] != n:
                raise DataConfigError(f"{path}: dataset '{key}' has {ds.shape[0]} rows but input_ids has {n}")
        for key in ("input_ids", "input_mask", "segment_ids") + tuple(present):
            if f[key].ndim != 2:
                raise DataConfigError(f"{path}: dataset '{key}' has shape {f[key].shape}; expected [rows, positions]")
        labels = f["next_sentence_labels"]
        if labels.ndim > 2 or labels.ndim == 2 and labels.shape[1] != 1:
            raise DataConfigError(f"{path}: dataset 'next_sentence_labels' has shape {labels.shape}; expected [rows] "
                                  "(one label per sequence, 1 where B is a random sentence)")
        for key in ("input_ids", "input_mask", "segment_ids"):
            if f[key].shape[1] != max_seq_length:
                raise DataConfigError(
                    f"{path}: '{key}' has sequence length {f[key].shape[1]} but --max_seq_length is "
                    f"{max_seq_length}; pass --max_seq_length {f[key].shape[1]} or use shards made for {max_seq_length}")
        if static:
            for key in MASK_KEYS:
                if f[key].shape[1] != max_predictions:
                    raise DataConfigError(
                        f"{path}: '{key}' holds {f[key].shape[1]} predictions per sequence but "
                        f"--max_predictions_per_seq is {max_predictions}; pass --max_predictions_per_seq "
                        f"{f[key].shape[1]}")
        read_whole = any(contiguous_offset(f[key]) is None for key in keys)
        attrs = dict(f.attrs)
    _check_attrs(path, attrs, static, max_seq_length, max_predictions, vocab_size)
    prob = float(attrs.get("masked_lm_prob", BERT_MASKED_LM_PROB))
    if not 0.0 < prob < 1.0:
        raise DataConfigError(f"{path}: attribute masked_lm_prob={prob} is outside (0, 1); recreate the shards")
    return ShardInfo(path=str(path), num_samples=int(n), static_masks=static, masked_lm_prob=prob,
                     whole_word_masking=bool(attrs.get("whole_word_masking", 0)),
                     lower_case=bool(attrs["lower_case"]) if "lower_case" in attrs else None, read_whole=read_whole,
                     vocab_size=int(attrs["vocab_size"]) if "vocab_size" in attrs else None)


def _check_attrs(path: Path, attrs: dict, static: bool, seq: int, preds: int, vocab_size: int) -> None:
    """Our shards carry their parameters as attributes; reference shards carry none."""
    if "vocab_size" in attrs and int(attrs["vocab_size"]) != vocab_size:
        raise DataConfigError(
            f"{path}: shards were made with a vocabulary of {int(attrs['vocab_size'])} tokens but the model "
            f"config has vocab_size {vocab_size}; set vocab_size to {int(attrs['vocab_size'])} in --config_file")
    if "max_seq_length" in attrs and int(attrs["max_seq_length"]) != seq:
        raise DataConfigError(f"{path}: attribute max_seq_length={int(attrs['max_seq_length'])} but "
                              f"--max_seq_length is {seq}")
    # Dynamic shards too: they were made for a masking budget, as their masked_lm_prob attribute says.
    if "max_predictions_per_seq" in attrs and int(attrs["max_predictions_per_seq"]) != preds:
        raise DataConfigError(f"{path}: attribute max_predictions_per_seq={int(attrs['max_predictions_per_seq'])} "
                              f"but --max_predictions_per_seq is {preds}; pass --max_predictions_per_seq "
                              f"{int(attrs['max_predictions_per_seq'])} or recreate the shards")
    masking = attrs.get("masking")
    if isinstance(masking, bytes):
        masking = masking.decode()
    if masking is not None and (masking == "static") != static:
        raise DataConfigError(f"{path}: attribute masking={masking!r} but the mask datasets are "
                              f"{'present' if static else 'absent'}; the shard is inconsistent, recreate it")


def inspect_shards(paths: list[Path], max_seq_length: int, max_predictions: int, vocab_size: int) -> list[ShardInfo]:
    shards = [inspect_shard(p, max_seq_length, max_predictions, vocab_size) for p in paths]
    kinds = {s.static_masks for s in shards}
    if len(kinds) > 1:
        raise DataConfigError("the input mixes shards with static masks and shards without; "
                              "use one kind per --input_dir")
    recipes = {(s.masked_lm_prob, s.whole_word_masking) for s in shards}
    if not shards[0].static_masks and len(recipes) > 1:
        raise DataConfigError("the shards' masking attributes differ (masked_lm_prob, whole_word_masking: "
                              f"{sorted(recipes)}); use shards made with one setting per --input_dir")
    check_one_case(shards)
    empty = [s.path for s in shards if s.num_samples == 0]
    if empty:
        raise DataConfigError(f"{empty[0]}: the shard holds no samples; remove it")
    return shards


def check_one_case(shards: list[ShardInfo]) -> None:
    """Shards whose text was tokenized lower-cased and shards whose text kept its case hold different ids
    for the same words; no single tokenizer serves a model trained on both."""
    by_case = {s.lower_case: s.path for s in shards if s.lower_case is not None}
    if len(by_case) > 1:
        raise DataConfigError(f"{by_case[True]} was made from lower-cased text but {by_case[False]} from text that "
                              "kept its case (their lower_case attributes); train on shards made with one setting")


TOKENIZATION = "tokenization.json"  # a run's record of tokenization_case, beside its vocab.txt, for the export


def tokenization_case(*datasets: PretrainingDataset | None) -> bool | None:
    """Whether the shards' text was lower-cased, as their lower_case attributes say; None when no shard
    says (NVIDIA's and Habana's carry no attributes, nor do ours from before the attribute)."""
    shards = [s for d in datasets if d is not None for s in d.shards]
    check_one_case(shards)
    cases = {s.lower_case for s in shards} - {None}
    return cases.pop() if cases else None


class PretrainingDataset(Dataset):
    """Map-style dataset indexed by stream position (any non-negative integer, across epochs)."""

    def __init__(self, shards: list[ShardInfo], seed: int, max_predictions: int, vocab_size: int,
                 vocab: MaskingVocab | None, shuffle: bool = True, read_ahead: bool = True,
                 stream_end: int | None = None):
        if not shards:
            raise DataConfigError("no shards given")
        if not shards[0].static_masks and vocab is None:
            raise DataConfigError("shards without static masks are masked at load time, which needs the "
                                  "vocabulary: put vocab.txt in --input_dir")
        self.shards = shards
        self.seed = seed
        self.max_predictions = max_predictions
        self.vocab_size = vocab_size
        self.vocab = vocab
        self.shuffle = shuffle
        # Off where no shard is read whole (nothing to read ahead, no per-batch look-up of the next shard);
        # benchmarks/bench_loader.py --paced compares without it.
        self.read_ahead = read_ahead and any(s.read_whole for s in shards)
        # The position the stream stops before (evaluation's): no shard that begins there or later is read ahead.
        self.stream_end = stream_end
        self.sizes = np.array([s.num_samples for s in shards], dtype=np.int64)
        self.epoch_size = int(self.sizes.sum())
        self._order_cache: dict[int, tuple[list[int], list[int]]] = {}
        self._rows_cache: dict[tuple[int, int], np.ndarray] = {}
        self._files: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()  # open shards' arrays, by shard
        self._ahead: _ReadAhead | None = None  # the stream's next shard, being read by a thread of this process
        self._files_pid = -1

    def __len__(self) -> int:
        return self.epoch_size

    def _epoch_order(self, epoch: int) -> tuple[list[int], list[int]]:
        """(shard order, cumulative end offsets in that order) for an epoch, as lists: locate's scalar
        lookups in them are several times faster than in arrays."""
        if epoch not in self._order_cache:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            else:
                order = np.arange(len(self.shards))
            if len(self._order_cache) > 2:
                self._order_cache.clear()
            self._order_cache[epoch] = (order.tolist(), np.cumsum(self.sizes[order]).tolist())
        return self._order_cache[epoch]

    def _row_order(self, epoch: int, shard: int) -> np.ndarray:
        key = (epoch, shard)
        if key not in self._rows_cache:
            n = int(self.sizes[shard])
            rows = (np.random.default_rng([self.seed, epoch, shard, 1]).permutation(n) if self.shuffle
                    else np.arange(n))
            if len(self._rows_cache) > 4:
                self._rows_cache.clear()
            self._rows_cache[key] = rows
        return self._rows_cache[key]

    def locate(self, position: int) -> tuple[int, int]:
        """(shard index, row) of a stream position."""
        if position < 0:
            raise IndexError(f"stream position must be >= 0, got {position}")
        epoch, within = divmod(int(position), self.epoch_size)
        order, ends = self._epoch_order(epoch)
        k = bisect.bisect_right(ends, within)
        start = ends[k - 1] if k else 0
        shard = order[k]
        return shard, int(self._row_order(epoch, shard)[within - start])

    def _next_visit(self, position: int) -> tuple[int, int]:
        """(the position where the stream leaves the shard holding this position, the shard it enters there:
        the next in this epoch's order, or the next epoch's first after the epoch's last)."""
        epoch, within = divmod(int(position), self.epoch_size)
        order, ends = self._epoch_order(epoch)
        k = bisect.bisect_right(ends, within)
        if k + 1 < len(order):
            return epoch * self.epoch_size + ends[k], order[k + 1]
        return (epoch + 1) * self.epoch_size, self._epoch_order(epoch + 1)[0][0]

    def _shard_data(self, shard: int, position: int) -> dict[str, np.ndarray]:
        """The shard's datasets as arrays (_read_shard), for a stream position in it. At most OPEN_FILES
        shards per process, held or being read (the stream visits one shard after another): when the
        stream's next shard has a dataset read whole (ShardInfo.read_whole), is not held and begins before
        stream_end, it is read in a background thread (h5py releases the GIL while it reads), whatever the
        current shard's storage, so it is ready when the stream gets there; the least recently used shard
        is dropped to make room for it. The thread starts in the process that uses the shard, never before
        a DataLoader worker forks; a failed read ahead raises its error when the shard is used."""
        if self._files_pid != os.getpid():  # maps, arrays and threads are the process's own
            self._files, self._ahead, self._files_pid = OrderedDict(), None, os.getpid()
        data = self._files.get(shard)
        if data is not None:
            self._files.move_to_end(shard)
        else:
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead.shard != shard:
                ahead.wait()  # the stream jumped: the read is dropped when it ends, within the bound
                ahead = None
            self._make_room()
            if ahead is not None:
                data = ahead.result()
            else:
                data = _read_shard(self.shards[shard].path, self._keys(shard))
            self._files[shard] = data
        # Checked on every batch (a few list lookups): also on re-entering a shard still held (an epoch that
        # begins with the shard the last one ended with) and after a jump dropped a read ahead.
        if self.read_ahead and self._ahead is None:
            self._start_read_ahead(position)
        return data

    def _start_read_ahead(self, position: int) -> None:
        """Start reading the shard the stream enters after this position's, if it is read whole, not held,
        and the stream reaches it."""
        begins, following = self._next_visit(position)
        if (self.shards[following].read_whole and following not in self._files
                and (self.stream_end is None or begins < self.stream_end)):
            self._make_room()
            self._ahead = _ReadAhead(following, self.shards[following].path, self._keys(following))

    def _make_room(self) -> None:
        """Drop least recently used shards until one more fits in OPEN_FILES (a shard's maps are unmapped
        when its last array goes)."""
        while len(self._files) >= OPEN_FILES:
            self._files.popitem(last=False)

    def _keys(self, shard: int) -> tuple[str, ...]:
        return REQUIRED_KEYS + (MASK_KEYS if self.shards[shard].static_masks else ())

    def __getitem__(self, position: int) -> dict[str, np.ndarray]:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: list[int]) -> list[dict[str, np.ndarray]]:
        """The samples at these stream positions, as int64 arrays (a DataLoader asks for a batch's at
        once). The rows a shard holds among them are read with one indexing per dataset and checked
        together."""
        located = [self.locate(p) for p in positions]
        samples: list[dict[str, np.ndarray]] = [{} for _ in positions]
        for shard in dict.fromkeys(s for s, _ in located):  # each shard once, in order
            which = [i for i, (s, _) in enumerate(located) if s == shard]
            rows = np.array([located[i][1] for i in which], dtype=np.int64)
            block = self._read_rows(shard, rows, positions[which[0]])
            if not self.shards[shard].static_masks:
                block["masked_lm_positions"], ids = self._mask(block, shard, rows, [positions[i] for i in which])
                block["masked_lm_labels"] = np.where(ids == 0, IGNORE_INDEX, ids)
            for j, i in enumerate(which):
                sample = samples[i]
                for key, values in block.items():
                    sample[key] = values[j, ...]  # a 0-d array for next_sentence_labels
        return samples

    def _read_rows(self, shard: int, rows: np.ndarray, position: int) -> dict[str, np.ndarray]:
        """The rows of a shard as a block per sample key (int64, first axis: rows), checked: an id outside
        the vocabulary, a masked position outside the sequence, or a segment id or NSP label other than 0 and
        1 is an index error in the model (a device-side assert on a GPU), an input_mask value other than 0
        and 1 a wrong attention bias; hence an error here that names the file and row. position: one of the
        rows' stream positions."""
        data = self._shard_data(shard, position)
        # astype copies: no sample holds a view of a shard's map or array.
        block = {"input_ids": data["input_ids"][rows].astype(np.int64),
                 "token_type_ids": data["segment_ids"][rows].astype(np.int64),
                 "attention_mask": data["input_mask"][rows].astype(np.int64),
                 "next_sentence_labels": data["next_sentence_labels"][rows].astype(np.int64)}
        seq = block["input_ids"].shape[1]
        # Each bound is one comparison: a negative value viewed as unsigned is above any bound.
        checks = [(block["input_ids"], self.vocab_size, "token id"), (block["token_type_ids"], 2, "segment_ids"),
                  (block["attention_mask"], 2, "input_mask"), (block["next_sentence_labels"], 2, "next_sentence_labels")]
        if self.shards[shard].static_masks:
            block["masked_lm_positions"] = data["masked_lm_positions"][rows].astype(np.int64)
            ids = data["masked_lm_ids"][rows].astype(np.int64)
            checks += [(block["masked_lm_positions"], seq, "masked_lm_positions"), (ids, self.vocab_size, "masked_lm_ids")]
            block["masked_lm_labels"] = np.where(ids == 0, IGNORE_INDEX, ids)
        if any(values.view(np.uint64).max(initial=0) >= bound for values, bound, _ in checks):
            for j in range(len(rows)):  # the first bad row, as a row-by-row read would meet it
                for values, bound, what in checks:
                    if values[j].view(np.uint64).max(initial=0) >= bound:
                        self._bad_row(shard, int(rows[j]), what, values[j], seq)
        return block

    def _bad_row(self, shard: int, row: int, what: str, values: np.ndarray, seq: int) -> None:
        path = self.shards[shard].path
        if what == "masked_lm_positions":
            raise DataConfigError(f"{path}: row {row} holds masked_lm_positions {int(values.min())}...{int(values.max())}, "
                                  f"outside its {seq} positions; the shard is corrupt, recreate it")
        bad = int(values.min()) if values.min() < 0 else int(values.max())
        if what in ("segment_ids", "input_mask", "next_sentence_labels"):
            raise DataConfigError(f"{path}: row {row} holds {what} {bad}; they are 0 or 1 in a pretraining shard: the "
                                  "shard is corrupt or not one, recreate it")
        raise DataConfigError(
            f"{path}: row {row} holds {what} {bad}, outside the model's vocab_size {self.vocab_size}; the shards were "
            "made with another vocabulary, set vocab_size in --config_file to match it")

    def _mask(self, block: dict[str, np.ndarray], shard: int, rows: np.ndarray, stream_positions: list[int]
              ) -> tuple[np.ndarray, np.ndarray]:
        """Mask a shard's rows as data.create masks static shards, each row seeded by its stream position, so
        that a resumed run, or one that groups the rows in other batches, masks alike. Replaces
        block["input_ids"]; returns (positions, original ids)."""
        assert self.vocab is not None
        info, ids = self.shards[shard], block["input_ids"]
        path = info.path
        wrong_start = np.flatnonzero(ids[:, 0] != self.vocab.cls)
        if wrong_start.size:  # every sequence begins with [CLS]: another vocab.txt would mask specials
            j = int(wrong_start[0])
            raise DataConfigError(f"{path}: row {int(rows[j])} begins with id {int(ids[j, 0])}, but [CLS] is "
                                  f"{self.vocab.cls} in the vocab.txt beside the shards; it is not the vocabulary "
                                  "they were made with: put that one there")
        outside = np.flatnonzero(ids.max(axis=1) >= self.vocab.size)
        if outside.size:  # a smaller vocab.txt: whole-word masking would look such an id up in it
            j = int(outside[0])
            raise DataConfigError(f"{path}: row {int(rows[j])} holds token id {int(ids[j].max())}, but the vocab.txt "
                                  f"beside the shards has {self.vocab.size} tokens; it is not the vocabulary they were "
                                  "made with: put that one there")
        real = block["attention_mask"] == 1
        candidates = real & (ids != self.vocab.cls) & (ids != self.vocab.sep)
        positions, labels = mask_rows(ids, candidates, real.sum(axis=1), self.max_predictions, info.masked_lm_prob,
                                      info.whole_word_masking, self.vocab,
                                      [np.random.default_rng([self.seed, p, 2]) for p in stream_positions])
        return positions.astype(np.int64), labels.astype(np.int64)


def _read_shard(path: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """A shard's datasets as numpy arrays, 1-D next_sentence_labels. A dataset stored contiguously in the
    file (uncompressed: h5py's default without compression) is a read-only map of its bytes there: a row
    is read when indexed, through the page cache, which the processes reading the file share, and nothing
    else of the shard is loaded. Any other dataset (chunked, most often compressed: NVIDIA's and Habana's
    gzip shards) is read whole, each chunk decompressed once: rows come in random order, so every chunk
    is needed again and again (read a row at a time, each row decompressed its chunks anew: 34 rows/s on
    NVIDIA's layout). It costs the dataset's decompressed size in memory in each process that reads it,
    as in NVIDIA's loader. A file that cannot be read is an error naming it (the shards were readable
    when the run inspected them)."""
    try:
        return _shard_arrays(path, keys)
    except OSError as e:
        raise DataConfigError(f"{path}: cannot read the shard ({e}); it was readable when the run started, so it "
                              "was changed or damaged since: restore it, then resume the run") from e


def _shard_arrays(path: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    arrays, mapped = {}, {}
    with h5py.File(path, "r") as f:
        for key in keys:  # one dataset open at a time: reading them whole with all open took 40 MB more
            ds = f[key]
            offset = contiguous_offset(ds)
            if offset is None:
                arrays[key] = ds[:]
            else:
                mapped[key] = (offset, ds.shape, ds.dtype)  # the dtype as stored, big-endian too
    if mapped:
        with open(path, "rb") as raw:
            whole = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)
        for key, (offset, shape, dtype) in mapped.items():
            arrays[key] = np.ndarray(shape, dtype, buffer=whole, offset=offset)
    arrays["next_sentence_labels"] = arrays["next_sentence_labels"].reshape(-1)
    return arrays


def contiguous_offset(ds: h5py.Dataset) -> int | None:
    """Where the dataset's bytes start in the file, as one C-order array: _read_shard maps it there. HDF5
    answers None for any other storage (chunked, and so filtered; compact; in external files; never
    written), which _read_shard reads whole."""
    return ds.id.get_offset()


class _ReadAhead:
    """_read_shard of one shard in a thread of its own, started now. Not a daemon: the interpreter joins it at
    exit, which waits for one shard's read at most."""

    def __init__(self, shard: int, path: str, keys: tuple[str, ...]):
        self.shard = shard
        self._data: dict[str, np.ndarray] | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._read, args=(path, keys), name=f"read-ahead {path}")
        self._thread.start()

    def _read(self, path: str, keys: tuple[str, ...]) -> None:
        try:
            self._data = _read_shard(path, keys)
        except Exception as e:  # noqa: BLE001 (any error: kept, raised by result() where the shard is used)
            self._error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> dict[str, np.ndarray]:
        """The shard's arrays, or the read's error, raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return self._data


class RankSampler(Sampler[int]):
    """Stream positions for one rank, starting at `start` (the run's consumed sample count).

    Each micro step across all ranks takes `micro_batch * world_size` consecutive positions.
    With `limit`, stops before that position (evaluation); otherwise endless (training)."""

    def __init__(self, start: int, micro_batch: int, rank: int, world_size: int, limit: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.start, self.micro, self.rank, self.world, self.limit = start, micro_batch, rank, world_size, limit

    def __iter__(self) -> Iterator[int]:
        base = self.start
        while self.limit is None or base < self.limit:
            first = base + self.rank * self.micro
            stop = first + self.micro if self.limit is None else min(first + self.micro, self.limit)
            yield from range(first, stop)
            base += self.micro * self.world

    def __len__(self) -> int:
        if self.limit is None:
            raise TypeError("the training sampler is endless")
        return sum(1 for _ in iter(self))


def _worker_init(_: int) -> None:
    # Ctrl-C reaches the whole process group; the main process turns it into a checkpoint and a
    # clean exit, which needs its workers alive until then (they exit with their parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(dataset: PretrainingDataset, sampler: RankSampler, micro_batch: int, num_workers: int,
                pin_memory: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, num_workers=num_workers,
                      prefetch_factor=4 if num_workers else None, worker_init_fn=_worker_init if num_workers else None,
                      pin_memory=pin_memory)


def batches_of(loader: DataLoader) -> Iterator[dict]:
    """The loader's batches. A DataLoader worker's error is raised with the locals of torch's frames in its
    traceback cleared. torch raises it from a frame that holds it: a reference cycle through the traceback,
    which kept the loader's iterator alive until the cycle collector freed it. The collector closes the
    iterator's queues before the iterator tells its workers to stop, so they never stop, and as they ignore
    SIGTERM (_worker_init) the interpreter waited for them at exit for good. Cleared, the iterator goes at
    once and stops its workers, even while the caller keeps the error. With no workers, nothing is cleared:
    the frames are the dataset's own, worth keeping for a debugger."""
    try:
        yield from loader
    except Exception as e:
        if loader.num_workers:
            traceback.clear_frames(e.__traceback__)
        raise


def raised_message(error: Exception) -> str:
    """The message an error was raised with. torch raises an error from a DataLoader worker again in the
    main process, of the same type, with a message of its own: "Caught DataConfigError in DataLoader worker
    process 0.", then the worker's traceback, which ends with the error's type and message."""
    text, name = str(error), type(error).__name__
    if not text.startswith(f"Caught {name} in DataLoader worker process"):
        return text
    return text.rpartition(f"{name}: ")[2].rstrip("\n")


def shard_vocab(input_dir: Path) -> Path | None:
    """The vocab.txt the shards were made with: in `input_dir`, or in the directory above it when `input_dir` is
    data.prepare's hdf5/ directory (data.prepare writes the vocab beside hdf5/); None when there is none."""
    input_dir = Path(input_dir)
    places = [input_dir] + ([input_dir.parent] if input_dir.name == "hdf5" else [])
    return next((place / "vocab.txt" for place in places if (place / "vocab.txt").is_file()), None)


def open_split(input_dir: Path, split: str, max_seq_length: int, max_predictions: int, vocab_size: int,
               seed: int, shuffle: bool, eval_samples: int | None = None,
               read_ahead: bool = True) -> PretrainingDataset | None:
    """The dataset of one split ("training" or "test"), or None when the directory has no such shards.
    eval_samples: the stream stops after its first eval_samples positions, one epoch at most (evaluation
    reads those): its stream_end. read_ahead: False reads every shard when the stream enters it."""
    paths = find_shards(input_dir, split)
    if not paths:
        return None
    shards = inspect_shards(paths, max_seq_length, max_predictions, vocab_size)
    masking_vocab = None
    if not shards[0].static_masks:
        vocab = shard_vocab(input_dir)
        if vocab is None:
            raise DataConfigError(f"{input_dir}: the shards have no static masks and there is no vocab.txt beside "
                                  "them to find [CLS], [SEP], [MASK] and word pieces; copy the vocabulary there")
        try:
            masking_vocab = MaskingVocab.from_file(vocab)
        except PipelineError as e:
            raise DataConfigError(str(e)) from e
        made_with = shards[0].vocab_size
        if made_with is not None and masking_vocab.size != made_with:
            raise DataConfigError(f"{vocab}: holds {masking_vocab.size} tokens but {shards[0].path} was made with a "
                                  f"vocabulary of {made_with}; put the vocabulary the shards were made with there")
        if masking_vocab.size > vocab_size:  # a random replacement may be any of its tokens
            raise DataConfigError(f"{vocab}: holds {masking_vocab.size} tokens but the model config has vocab_size "
                                  f"{vocab_size}; dynamic masking would feed the model ids it has no embedding for: "
                                  f"set vocab_size to at least {masking_vocab.size} in --config_file, or put the "
                                  "vocabulary the shards were made with there")
    stream_end = None if eval_samples is None else min(eval_samples, sum(s.num_samples for s in shards))
    return PretrainingDataset(shards, seed=seed, max_predictions=max_predictions, vocab_size=vocab_size,
                              vocab=masking_vocab, shuffle=shuffle, read_ahead=read_ahead, stream_end=stream_end)
