"""Reading a shard for training: our loader against NVIDIA's, on a shard in NVIDIA's layout.

    .venv/bin/python benchmarks/bench_loader.py [--rows 200000] [--batches 300] [--work_dir DIR]
    .venv/bin/python benchmarks/bench_loader.py --paced [--rows 50000] [--shards 4] [--rate 3000] [--workers 0]
        [--mixed]

Writes one synthetic seq-128 shard of `--rows` rows (random ids, 20 static masks, NVIDIA's keys and
dtypes) twice: gzip with h5py's automatic chunks, as NVIDIA's and Habana's `create_pretraining_data.py`
write it, and uncompressed, as ours are by default. Each reader then takes `--batches` batches of 64
in the training order, in a process of its own (0 DataLoader workers), timed from opening the file to
the last batch, with the process's peak resident memory:
- ours: `training.loader` (`open_split`, `RankSampler`, `make_loader`): uncompressed datasets memory-mapped,
  compressed ones read whole on the shard's first row; a batch's rows read with one indexing per dataset;
- the reference: NVIDIA's `pretraining_dataset` reads every key of the shard whole into memory, then
  indexes rows (its `__getitem__`); the same rows, through a DataLoader with the same batch size.
Prints samples/s (ours / nvidia: the speed-up, above 1 where ours is faster), the time to the first batch
and the peak memory for each (ours / nvidia: ratios of time and of memory, below 1 where ours is less).
Peak RSS counts the pages of a memory-mapped file the process touched, which are the page cache's,
shared by every process that maps the file; so the last column is the process's own memory at the end
(Linux's RssAnon: what it allocated, the shard's arrays among it).

--paced: the stall at shard switches. Writes `--shards` gzip shards of `--rows` rows (with `--mixed`, all
but the last uncompressed) and has our loader, through `make_loader` with `--workers` DataLoader workers
(prefetch_factor 4, as training), feed a consumer that spends 64 / `--rate` seconds on each batch of 64 (a
model taking `--rate` samples/s), through every shard into the first batch of the next epoch, once without
reading the next shard ahead and once with it. Prints the wait for the first batch (the first shard's read,
in both; with workers, their start too), the worst and the total wait over the batches that enter another
shard, the worst wait of any other batch, the waits over 10 ms after the first batch (stalls: a batch's own
reading and collating takes 1-3 ms), and each switch's wait in the stream's order, with the storage of the
shards it leaves and enters. With workers, batches go to the workers in turn, so each worker reads every shard;
the workers' reads take the CPU from each other and from the consumer's process, so a stall may show in
batches before or after the one entering the shard, hence the stalls' count and total.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from data.cli import given_options
from data.create import DTYPES

SEQ, PREDS, BATCH, VOCAB = 128, 20, 64, 30522
STALL = 0.010  # --paced: a wait longer than this is a stall (seconds)
# The shard format's dtypes (data.create.DTYPES), with each dataset's width per row
KEYS = {key: (dtype, {"masked_lm_positions": PREDS, "masked_lm_ids": PREDS, "next_sentence_labels": None}.get(key, SEQ))
        for key, dtype in DTYPES.items()}


def write_shard(path: Path, rows: int, compression: str | None, block: int = 50_000) -> None:
    """A shard of real shape: lengths 20..128, [CLS] ... [SEP], 15% (at most 20) masked positions, sorted."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        sets = {k: f.create_dataset(k, (rows,) + ((w,) if w else ()), dtype, compression=compression)
                for k, (dtype, w) in KEYS.items()}
        for start in range(0, rows, block):
            m = min(block, rows - start)
            lens = rng.integers(20, SEQ + 1, m)
            real = np.arange(SEQ)[None] < lens[:, None]
            ids = np.where(real, rng.integers(1000, VOCAB, (m, SEQ)), 0)
            ids[:, 0] = 101
            ids[np.arange(m), lens - 1] = 102
            # Masked positions: the k smallest random keys among positions 1..len-2, sorted.
            keys = np.where(real & (np.arange(SEQ)[None] > 0) & (np.arange(SEQ)[None] < lens[:, None] - 1),
                            rng.random((m, SEQ)), 2.0)
            k = np.minimum(PREDS, np.maximum(1, np.round(lens * 0.15).astype(int)))
            chosen = np.where(np.arange(PREDS)[None] < k[:, None], np.argsort(keys, axis=1)[:, :PREDS], SEQ)
            chosen = np.sort(chosen, axis=1)
            pos = np.where(chosen == SEQ, 0, chosen)  # padding slots: position 0, id 0
            sets["input_ids"][start:start + m] = ids
            sets["input_mask"][start:start + m] = real
            sets["segment_ids"][start:start + m] = real & (np.arange(SEQ)[None] > lens[:, None] // 2)
            sets["masked_lm_positions"][start:start + m] = pos
            sets["masked_lm_ids"][start:start + m] = np.where(pos > 0, np.take_along_axis(ids, pos, 1), 0)
            sets["next_sentence_labels"][start:start + m] = rng.integers(0, 2, m)


class NvidiaShard:
    """NVIDIA's `pretraining_dataset` (DeepLearningExamples, run_pretraining.py), reduced to what it does:
    every key read whole (`np.asarray(f[key][:])`), then rows indexed, masked_lm_labels built per row."""

    def __init__(self, path: Path, max_pred_length: int) -> None:
        with h5py.File(path, "r") as f:
            self.inputs = [np.asarray(f[key][:]) for key in KEYS]
        self.max_pred_length = max_pred_length

    def __len__(self) -> int:
        return len(self.inputs[0])

    def __getitem__(self, index: int):
        import torch

        input_ids, input_mask, segment_ids, positions, ids, nsp = (
            torch.from_numpy(np.asarray(x[index].astype(np.int64))) for x in self.inputs)
        labels = torch.full_like(input_ids, -1)
        padded = (positions == 0).nonzero()
        end = int(padded[0].item()) if len(padded) else self.max_pred_length
        labels[positions[:end]] = ids[:end]
        return [input_ids, segment_ids, input_mask, labels, nsp]


def run_case(reader: str, shard: Path, batches: int) -> dict:
    """One reader, in this process: seconds from opening the shard to the last batch, peak RSS, and
    the anonymous (not file-backed) part of the RSS at the end."""
    import itertools

    from torch.utils.data import DataLoader

    from training.loader import RankSampler, make_loader, open_split

    start = time.perf_counter()
    if reader == "ours":
        ds = open_split(shard.parent.parent, "training", SEQ, PREDS, VOCAB, seed=1, shuffle=True)
        loader = make_loader(ds, RankSampler(0, BATCH, 0, 1), BATCH, 0)
    else:
        ds = NvidiaShard(shard, PREDS)
        # NVIDIA's order: a RandomSampler over the shard (ours: the shard's seeded permutation).
        order = np.random.default_rng(1).permutation(len(ds)).tolist()
        loader = DataLoader(ds, batch_size=BATCH, sampler=order)
    first = None
    for _ in itertools.islice(iter(loader), batches):
        first = first or time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "first_batch_s": first,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "anon_rss_mb": anonymous_rss_mb()}


def run_paced(root: Path, rate: float, read_ahead: bool, workers: int) -> dict:
    """Waits for batches (seconds) of a consumer taking `rate` samples/s, by kind of batch; a switch's wait
    with the paths of the shards it leaves and enters."""
    from training.loader import RankSampler, make_loader, open_split

    ds = open_split(root, "training", SEQ, PREDS, VOCAB, seed=1, shuffle=True, read_ahead=read_ahead)
    loader = iter(make_loader(ds, RankSampler(0, BATCH, 0, 1), BATCH, workers))
    # The stream positions where a shard begins (paced() writes shards of equal size).
    starts = set(np.cumsum(ds.sizes)[:-1].tolist() + [len(ds)])
    first, switches, others = 0.0, [], [0.0]
    for index in range(-(-len(ds) // BATCH) + 1):
        t = time.perf_counter()
        next(loader)
        wait = time.perf_counter() - t
        # An epoch that begins with the shard the last one ended with has no switch there.
        entered = [(ds.locate(p - 1)[0], ds.locate(p)[0]) for p in range(index * BATCH, (index + 1) * BATCH)
                   if p in starts and ds.locate(p - 1)[0] != ds.locate(p)[0]]
        if index == 0:
            first = wait
        elif entered:
            left, shard = entered[0]
            switches.append((wait, ds.shards[left].path, ds.shards[shard].path))
        else:
            others.append(wait)
        time.sleep(BATCH / rate)
    stalls = [wait for wait in [w for w, _, _ in switches] + others if wait > STALL]
    return {"first": first, "switches": switches, "others_max": max(others), "stalls": stalls}


def write_paced_shards(training: Path, kinds: list[str], rows: int) -> None:
    """shard_training_{i:03d}.hdf5 stored as kinds[i] says ("gzip" or "uncompressed"): one written per kind,
    the others copies of it."""
    written: dict[str, Path] = {}
    for i, kind in enumerate(kinds):
        path = training / f"shard_training_{i:03d}.hdf5"
        if kind in written:
            path.write_bytes(written[kind].read_bytes())
        else:
            write_shard(path, rows, "gzip" if kind == "gzip" else None)
            written[kind] = path


def paced(a: argparse.Namespace) -> None:
    kinds = ["uncompressed"] * (a.shards - 1) + ["gzip"] if a.mixed else ["gzip"] * a.shards
    with tempfile.TemporaryDirectory(dir=a.work_dir) as tmp:
        root = Path(tmp)
        (root / "training").mkdir()
        t = time.perf_counter()
        write_paced_shards(root / "training", kinds, a.rows)
        kind_of = {str(root / "training" / f"shard_training_{i:03d}.hdf5"): kind for i, kind in enumerate(kinds)}
        stored = f"{a.shards - 1} uncompressed and 1 gzip" if a.mixed else f"{a.shards} gzip"
        print(f"wrote {stored} shards of {a.rows:,} rows, {time.perf_counter() - t:.0f} s", flush=True)
        print(f"\nconsumer: {a.rate:,.0f} samples/s in batches of {BATCH}, {a.workers} DataLoader workers, "
              f"{a.shards * a.rows:,} samples and one batch more\n")
        print("| shards | workers | next shard | first batch (s) | shard switches | worst switch wait (s) | "
              f"total switch wait (s) | worst other wait (s) | waits over {STALL * 1000:.0f} ms after the first batch: "
              "count, total (s) | "
              "each switch: from > to wait (s) |\n|---|---|---|---|---|---|---|---|---|---|")
        short = {"gzip": "gz", "uncompressed": "u"}
        for ahead in (False, True):
            out = subprocess.run([sys.executable, __file__, "--rate", str(a.rate), "--workers", str(a.workers),
                                  "--_paced", str(root), str(int(ahead))], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"the paced consumer failed:\n{out.stderr}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            waits = [wait for wait, _, _ in r["switches"]]
            each = ", ".join(f"{short[kind_of[left]]}>{short[kind_of[entered]]} {wait:.3f}"
                             for wait, left, entered in r["switches"])
            print(f"| {stored} | {a.workers} | {'read ahead' if ahead else 'read when entered'} | {r['first']:.3f} | "
                  f"{len(waits)} | {max(waits, default=0.0):.3f} | {sum(waits):.3f} | {r['others_max']:.3f} | "
                  f"{len(r['stalls'])}, {sum(r['stalls']):.3f} | {each} |", flush=True)


def anonymous_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help="rows of the synthetic shard (default 200,000; "
                   "50,000 with --paced)")
    p.add_argument("--batches", type=int, default=None, help="batches of 64 each reader takes (default 300; "
                   "not with --paced, which reads every shard once)")
    p.add_argument("--work_dir", type=Path, default=None, help="where the shards go (default: a temporary dir)")
    p.add_argument("--paced", action="store_true", help="the stall at shard switches, with and without read-ahead")
    p.add_argument("--shards", type=int, default=4, help="--paced: shards of --rows rows each (gzip; with --mixed, "
                   "all but the last uncompressed)")
    p.add_argument("--rate", type=float, default=3000.0, help="--paced: samples/s the consumer takes")
    p.add_argument("--workers", type=int, default=0, help="--paced: DataLoader workers (make_loader's num_workers)")
    p.add_argument("--mixed", action="store_true", help="--paced: all shards but the last uncompressed")
    p.add_argument("--_case", nargs=2, metavar=("READER", "SHARD"), help=argparse.SUPPRESS)
    p.add_argument("--_paced", nargs=2, metavar=("ROOT", "AHEAD"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if not a.paced and not a._paced:
        given = given_options(p, None) & {"shards", "rate", "workers", "mixed"}
        if given:
            p.error(f"--{', --'.join(sorted(given))} {'applies' if len(given) == 1 else 'apply'} to --paced; add "
                    "--paced or drop them")
    if a.paced and a.batches is not None:
        p.error("--batches applies to the readers' comparison; --paced reads every shard once")
    a.batches = 300 if a.batches is None else a.batches
    if a._paced:
        print(json.dumps(run_paced(Path(a._paced[0]), a.rate, bool(int(a._paced[1])), a.workers)))
        return
    if a.paced:
        a.rows = a.rows or 50_000
        paced(a)
        return
    if a._case:
        print(json.dumps(run_case(a._case[0], Path(a._case[1]), a.batches)))
        return
    a.rows = a.rows or 200_000
    with tempfile.TemporaryDirectory(dir=a.work_dir) as tmp:
        shards = {}
        for name, compression in (("gzip", "gzip"), ("uncompressed", None)):
            shards[name] = Path(tmp) / name / "training" / "shard_training_0.hdf5"
            shards[name].parent.mkdir(parents=True)
            t = time.perf_counter()
            write_shard(shards[name], a.rows, compression)
            print(f"wrote the {name} shard: {a.rows:,} rows, {shards[name].stat().st_size / 1e6:.0f} MB, "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
        samples = a.batches * BATCH
        print(f"\n{samples:,} samples ({a.batches} batches of {BATCH}) per reader, one process each, 0 workers; "
              "time from opening the shard to the last batch\n")
        print("| shard | reader | samples/s | first batch (s) | peak RSS (MB) | own memory at the end (MB) |\n"
              "|---|---|---|---|---|---|")
        for name, shard in shards.items():
            results = {}
            for reader in ("ours", "nvidia"):
                out = subprocess.run([sys.executable, __file__, "--batches", str(a.batches), "--_case", reader,
                                      str(shard)], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"the {reader} reader failed on {shard}:\n{out.stderr}")
                results[reader] = json.loads(out.stdout.strip().splitlines()[-1])
                r = results[reader]
                print(f"| {name} | {reader} | {samples / r['seconds']:,.0f} | {r['first_batch_s']:.3f} | "
                      f"{r['peak_rss_mb']:,.0f} | {r['anon_rss_mb']:,.0f} |", flush=True)
            ours, ref = results["ours"], results["nvidia"]
            print(f"| {name} | ours / nvidia | {ref['seconds'] / ours['seconds']:.2f}x | "
                  f"{ours['first_batch_s'] / ref['first_batch_s']:.2f}x | "
                  f"{ours['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x | {ours['anon_rss_mb'] / ref['anon_rss_mb']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
