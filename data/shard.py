"""Stage 7: instances -> balanced HDF5 shards in the NVIDIA/Habana format.

Every part's instances (already shuffled within the part) are cut into `num_shards` contiguous
slices whose sizes differ by at most one; the part that gets the extra rows rotates, so shard
sizes over the whole corpus differ by at most one instance. A shard is assembled from its slice
of every part (read through memory maps), shuffled with a seed of its own, and written to a
temporary name, then renamed. Memory per worker is about half a shard: one key's shuffled array
(`_gather`).

Files: `<output_dir>/{training,test}/<name>_{training,test}_<i>.hdf5`, keys and dtypes as in
docs/ARCHITECTURE.md, attributes max_seq_length, max_predictions_per_seq, vocab_size, masking
(static or dynamic), masked_lm_prob, whole_word_masking and lower_case.

    python -m data.shard --instances_dir out/instances --output_dir out/hdf5 --num_shards 256
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from data import create as create_stage
from data import stage
from data.cli import HelpFormatter, add_workers_argument
from data.create import DTYPES, SPLITS, derive_seed, load_instances
from data.parallel import bounded_map
from data.stage import PipelineError

# The version of the shards this stage writes. Bump it whenever its output for the same instances and
# settings changes (another slicing, shuffle, key, dtype or attribute): a finished shards directory of
# another version is then refused, and an unfinished one started afresh, instead of being reused.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardConfig:
    instances_dir: Path
    output_dir: Path
    num_shards: int = 256
    num_test_shards: int = 1
    name: str = "wikicorpus_en"
    workers: int = 1
    compression: str | None = None  # None, "gzip" or "lzf" (h5py filters; readers need nothing extra)


@dataclass(frozen=True)
class ShardResult:
    shards: dict[str, int]
    instances: dict[str, int]
    shard_sizes: dict[str, list[int]]
    bytes_written: int
    seconds: float

    def line(self) -> str:
        """What the stage did, in one line."""
        return (f"{self.shards['training']} training + {self.shards['test']} test shards, "
                f"{self.instances['training']} + {self.instances['test']} instances, {self.bytes_written / 1e6:.1f} MB")


def plan_slices(part_counts: list[int], num_shards: int) -> list[list[tuple[int, int, int]]]:
    """For each shard, the (part, start, stop) slices it takes. Shard totals differ by at most one."""
    plan: list[list[tuple[int, int, int]]] = [[] for _ in range(num_shards)]
    offset = 0
    for part, n in enumerate(part_counts):
        q, r = divmod(n, num_shards)
        extra = np.zeros(num_shards, dtype=np.int64)
        extra[(offset + np.arange(r)) % num_shards] = 1
        stops = np.cumsum(q + extra)
        starts = stops - (q + extra)
        for s in range(num_shards):
            if stops[s] > starts[s]:
                plan[s].append((part, int(starts[s]), int(stops[s])))
        offset = (offset + r) % num_shards
    return plan


@dataclass(frozen=True)
class _ShardTask:
    path: Path
    part_dirs: list[Path]
    slices: list[tuple[int, int, int]]
    keys: tuple[str, ...]
    attrs: dict
    seed: int
    compression: str | None


class _WriteErrorKeeper:
    """The file object h5py writes a shard through. Writes go in pieces (`stage.PieceWriter`); the first one that
    fails (or a truncate, which extends the file) is kept as `error`, every later one is skipped, and HDF5 is told
    they all succeeded. Told of a full disk, HDF5 raised a RuntimeError as it closed the file, crashed the process,
    or ignored it and let a damaged shard be renamed into place, and h5py printed a traceback for each compressed
    chunk it could not write. The caller raises the kept error once the file is closed. A Ctrl-C is kept too: its
    KeyboardInterrupt is raised in a write, where HDF5 spends the stage's time, and h5py made it an OSError."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self._pieces = stage.PieceWriter(raw)
        self.error: BaseException | None = None

    def write(self, data) -> int:
        self._unless_failed(self._pieces.write, data)
        return memoryview(data).nbytes

    def truncate(self, size: int) -> int:
        self._unless_failed(self._raw.truncate, size)
        return size

    def _unless_failed(self, operation, argument) -> None:
        if self.error is None:
            try:
                operation(argument)
            except BaseException as exc:  # noqa: BLE001 (kept, raised after close)
                self.error = exc

    def __getattr__(self, name: str):  # read, seek, tell, flush
        return getattr(self._raw, name)


def _gather(task: _ShardTask, key: str, destination: np.ndarray) -> np.ndarray:
    """One key's rows of the shard in its shuffled order, copied from the parts' memory maps straight to their
    places: the only array in memory is the one being written (at most `input_ids`, 55% of the shard)."""
    out = None
    start = 0
    for p, lo, hi in task.slices:
        piece = load_instances(task.part_dirs[p] / f"{key}.npy")[lo:hi]
        if out is None:
            out = np.empty((len(destination),) + piece.shape[1:], dtype=DTYPES[key])
        out[destination[start:start + hi - lo]] = piece
        start += hi - lo
    return out


def _write_shard(task: _ShardTask) -> tuple[int, int]:
    if not task.path.is_file():
        rows = sum(hi - lo for _, lo, hi in task.slices)
        order = np.random.default_rng(task.seed).permutation(rows)
        destination = np.empty_like(order)  # where each row of the parts' slices, in turn, goes in the shard
        destination[order] = np.arange(rows)
        # HDF5 writes through a file object that keeps a full disk's error from it (`_WriteErrorKeeper`). (Made in
        # memory and then written, which kept it from HDF5 too, the shard stage took 2.4x longer: PERFORMANCE.md.)
        with stage.atomic_path(task.path) as tmp, open(tmp, "w+b", buffering=0) as raw:
            target = _WriteErrorKeeper(raw)
            try:
                with h5py.File(target, "w") as f:
                    for key in task.keys:
                        if target.error is not None:  # the shard is lost: stop at once (a full disk, a Ctrl-C)
                            break
                        f.create_dataset(key, data=_gather(task, key, destination), dtype=DTYPES[key],
                                         compression=task.compression)
                    for k, v in task.attrs.items():
                        f.attrs[k] = v
            except Exception:
                if target.error is None:
                    raise
            if target.error is not None:  # what HDF5 read back after a skipped write may have failed too
                raise target.error
    try:
        with h5py.File(task.path, "r") as f:
            return len(f["next_sentence_labels"]), task.path.stat().st_size
    except (OSError, KeyError) as exc:
        raise PipelineError(f"{task.path} cannot be read as a shard ({exc}); it was damaged after this stage wrote "
                            "it: delete it and rerun to write it again") from exc


def check_shard_counts(num_shards: int, num_test_shards: int, test_fraction: float | None = None) -> None:
    """The shard counts, and with `test_fraction` (data.prepare's, before any stage) whether they fit it."""
    if num_shards < 1:
        raise PipelineError(f"--num_shards must be at least 1, got {num_shards}")
    if num_test_shards < 0:
        raise PipelineError(f"--num_test_shards must be 0 or more, got {num_test_shards}")
    if test_fraction is not None and (num_test_shards == 0) != (test_fraction == 0):
        raise PipelineError(
            f"--num_test_shards 0 with --test_fraction {test_fraction}: the held-out documents' instances would be "
            "written nowhere; pass --test_fraction 0 to train on every document, or --num_test_shards 1 or more"
            if num_test_shards == 0 else
            f"--num_test_shards {num_test_shards} with --test_fraction 0: no document is held out for the test "
            "shards; pass a --test_fraction above 0 (default 0.02), or --num_test_shards 0")


def check_name(name: str) -> None:
    """The shard file prefix: a '/' in it wrote the shards outside the shards directory, then failed."""
    if not name or "/" in name:
        why = "it is empty" if not name else "it holds a /"
        raise PipelineError(f"--name {name!r} cannot start the shards' file names ({why}); pass a file name prefix "
                            "without '/', such as wikicorpus_en")


def shard(cfg: ShardConfig) -> ShardResult:
    stage.require_input(cfg.instances_dir, "--instances_dir", "data.create",
                        f"{cfg.instances_dir} is not a complete data.create output; run data.create first")
    created = stage.finished_record(cfg.instances_dir)
    instances = stage.fingerprint(cfg.instances_dir, create_stage.FORMAT_VERSION, created, "data.create")
    cp, summary = created["params"], created["summary"]
    check_shard_counts(cfg.num_shards, cfg.num_test_shards)
    check_name(cfg.name)
    counts = {"training": cfg.num_shards, "test": cfg.num_test_shards}
    for split, n in counts.items():
        total = summary["instances"][split]
        if n > total:
            if split == "test" and total == 0:
                fix = ("no document was held out; create the instances again with a larger --test_fraction, "
                       "or with --test_fraction 0 and shard with --num_test_shards 0 to evaluate on nothing")
            elif n > 1:
                fix = f"use fewer {split} shards{' or a larger --test_fraction' if split == 'test' else ''}"
            else:
                fix = "the corpus is too small to make training data; give a larger dump"
            raise PipelineError(f"{cfg.instances_dir} has {total} {split} instances, too few for {n} {split} "
                                f"shard{'s' if n > 1 else ''}; {fix}")
    if cfg.num_test_shards == 0 and summary["instances"]["test"]:
        raise PipelineError(
            f"{cfg.instances_dir} holds {summary['instances']['test']} test instances (from held-out documents), "
            "which --num_test_shards 0 would write nowhere; pass --num_test_shards 1 or more, or create the "
            "instances again with --test_fraction 0 to train on every document")
    attrs = {"max_seq_length": cp["max_seq_length"], "max_predictions_per_seq": cp["max_predictions_per_seq"],
             "vocab_size": summary["vocab_size"],
             "masking": "static" if cp["static_masking"] else "dynamic",
             # How masks were (static) or are to be (dynamic, by the loader) drawn.
             "masked_lm_prob": cp["masked_lm_prob"], "whole_word_masking": int(cp["whole_word_masking"]),
             # How the text was tokenized, for the tokenizer a run exports: a vocab alone cannot tell it.
             "lower_case": int(cp["tokens"]["params"]["lower_case"])}
    keys = tuple(k for k in DTYPES if cp["static_masking"] or not k.startswith("masked_lm"))
    params = {stage.VERSION_KEY: FORMAT_VERSION, "instances": instances, "num_shards": cfg.num_shards,
              "num_test_shards": cfg.num_test_shards, "name": cfg.name, "compression": cfg.compression}
    done = stage.begin(cfg.output_dir, params)
    if done is not None:
        return ShardResult(**done)
    start = time.perf_counter()
    tasks = []
    for split_index, split in enumerate(SPLITS):
        if counts[split] == 0:
            continue
        part_dirs = sorted((cfg.instances_dir / split).glob("part-*"))
        part_dirs = [d for d in part_dirs if d.is_dir() and not d.name.startswith(".")]
        for s, slices in enumerate(plan_slices(summary["part_counts"][split], counts[split])):
            tasks.append(_ShardTask(cfg.output_dir / split / f"{cfg.name}_{split}_{s}.hdf5", part_dirs, slices,
                                    keys, attrs, derive_seed(cp["seed"], split_index, s, 3), cfg.compression))
    for split in SPLITS:
        (cfg.output_dir / split).mkdir(parents=True, exist_ok=True)
    sizes: dict[str, list[int]] = {split: [] for split in SPLITS}
    written = 0
    with tqdm(total=len(tasks), desc="shard", unit=" shards", dynamic_ncols=True) as bar:
        for task, (n, nbytes) in zip(tasks, bounded_map(_write_shard, tasks, cfg.workers)):
            sizes[task.path.parent.name].append(n)
            written += nbytes
            bar.update(1)
    summary_out = {"shards": {s: len(v) for s, v in sizes.items()},
                   "instances": {s: sum(v) for s, v in sizes.items()}, "shard_sizes": sizes,
                   "bytes_written": written, "seconds": round(time.perf_counter() - start, 3)}
    return ShardResult(**stage.finish(cfg.output_dir, params, summary_out))


def add_compression_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hdf5_compression", choices=["none", "gzip", "lzf"], default="none",
                   help="HDF5 filter for the shards (gzip: about 3x smaller for shards of thousands of rows, "
                        "slower to write)")


def compression_filter(name: str) -> str | None:
    return None if name == "none" else name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--instances_dir", type=Path, required=True, help="output of data.create")
    p.add_argument("--output_dir", type=Path, required=True, help="the hdf5 directory")
    p.add_argument("--num_shards", type=int, default=256, help="training shards")
    p.add_argument("--num_test_shards", type=int, default=1, help="test shards (0: no test split)")
    p.add_argument("--name", default="wikicorpus_en", help="file name prefix")
    add_compression_argument(p)
    add_workers_argument(p)
    a = p.parse_args(argv)
    r = stage.cli_call(shard, ShardConfig(a.instances_dir, a.output_dir, a.num_shards, a.num_test_shards, a.name,
                                          a.workers, compression_filter(a.hdf5_compression)))
    print(f"shard: {r.line()}, {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
