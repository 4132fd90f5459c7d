"""Training metrics: throughput, MFU, metrics.jsonl, TensorBoard and the console progress line."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from data.stage import PieceWriter
from training.atomic import atomic_write_text, named, remove_stale_temporaries, replace_dir
from training.planner import device_peak_tflops

# torch's device names ("NVIDIA H100 80GB HBM3", "GAUDI2"; first-generation Gaudi is "GAUDI") -> training.planner's
# device keys, first match wins: "GAUDI" comes after "GAUDI3" and "GAUDI2", which contain it, and "H100" after
# "H100 PCIE" (a lower peak than the SXM part's). The NVL cards ("NVIDIA H100 NVL", "NVIDIA H200 NVL") are neither
# SXM part and have no entry in the table: no peak, rather than the SXM one.
_PLANNER_KEYS = (("GAUDI3", "gaudi3"), ("GAUDI2", "gaudi2"), ("GAUDI", "gaudi"), ("NVL", None), ("H200", "h200"),
                 ("H100 PCIE", "h100-pcie"), ("H100", "h100"), ("A100", "a100"))


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Peak dense TFLOP/s of the device running this process (from training.planner's table),
    None where unknown, CPUs among them."""
    upper = device_name.upper()
    for marker, key in _PLANNER_KEYS:
        if marker in upper:
            return None if key is None else device_peak_tflops(key, dtype)
    return None


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Throughput:
    """Sequences per second over the steps since the last `take`, with the clock started at the
    end of step `warmup` (compilation, allocator growth and worker start-up distort the first steps)."""

    def __init__(self, warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 step, got {warmup}")
        self.warmup = warmup
        self.steps_seen = 0
        self._t0: float | None = None
        self._sequences = 0

    def update(self, sequences: int) -> None:
        self.steps_seen += 1
        if self.steps_seen == self.warmup:
            self._t0, self._sequences = time.perf_counter(), 0
        elif self.steps_seen > self.warmup:
            self._sequences += sequences

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside (evaluation, checkpoints) does not count against the window."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._t0 is not None:
                self._t0 += time.perf_counter() - start

    def take(self) -> float | None:
        """Sequences/s since the previous take (None until a step after warm-up); restarts the window."""
        if self._t0 is None or self._sequences == 0:
            return None
        now = time.perf_counter()
        rate = self._sequences / (now - self._t0)
        self._t0, self._sequences = now, 0
        return rate


def drop_records_after(path: Path, step: int, before_dropping=None) -> set[int]:
    """Keep the records of steps <= `step` in a JSON-lines log (and lines that are not records);
    a last line cut short by a kill is dropped. The dropped lines are appended to
    `<name>.dropped.jsonl` first (a rewound run's records are not lost), then the log is rewritten
    atomically, only when something goes; `before_dropping(n)` is called first then, with the number of
    records that move (0 when only a cut-short line goes). Returns the steps of the records kept."""
    if not path.is_file():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines()
    kept, dropped, steps = [], [], set()
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            record = None
        logged = record.get("step") if isinstance(record, dict) else None
        if isinstance(logged, int) and logged > step:
            dropped.append(line)
        else:
            kept.append(line)
            if isinstance(logged, int):
                steps.add(logged)
    if len(kept) != len(lines):
        if before_dropping is not None:
            before_dropping(len(dropped))
        side, text = path.with_name(f"{path.stem}.dropped.jsonl"), "".join(line + "\n" for line in dropped)
        # Already there when a rerun was killed between this append and the rewrite below.
        if text and not (side.is_file() and side.read_text(encoding="utf-8").endswith(text)):
            with open(side, "a", encoding="utf-8") as f:
                f.write(text)
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return steps


def append_line(sink, line: str) -> None:
    """Append `line` and a newline to the unbuffered binary file `sink`; an error names the file. A full
    disk may leave the line cut short, which the resume's `drop_records_after` drops."""
    try:
        PieceWriter(sink).write((line + "\n").encode("utf-8"))
    except OSError as e:
        raise named(e, Path(sink.name)) from e


def _add_scalars(tb, prefix: str, record: dict) -> None:
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            tb.add_scalar(f"{prefix}/{key}", value, record["step"])


def rebuild_tensorboard(tb_dir: Path, logs: dict[str, Path]) -> None:
    """Write `tb_dir` anew from the records of the JSON-lines logs (prefix -> path), which hold exactly
    the steps a resumed run keeps. Event files cannot drop the steps logged past the checkpoint:
    SummaryWriter's purge_step hides them only from TensorBoard's Python loader, not from its
    default (Rust) one. The files are written beside `tb_dir` and swapped in; a kill in between
    leaves leftovers that the next start removes, and it rebuilds from the logs again."""
    from torch.utils.tensorboard import SummaryWriter

    staging = tb_dir.with_name(f".{tb_dir.name}.tmp")
    if staging.exists():  # (a `.old` left by a kill in the swap is replace_dir's to remove)
        shutil.rmtree(staging)
    tb = SummaryWriter(log_dir=str(staging))
    for prefix, path in logs.items():
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # drop_records_after keeps such lines as they are
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                _add_scalars(tb, prefix, record)
    tb.close()
    replace_dir(staging, tb_dir)


class MetricsWriter:
    """Rank 0's sinks: `<output_dir>/metrics.jsonl` (one object per logged step), `eval.jsonl`,
    TensorBoard under `<output_dir>/tensorboard`, and a tqdm progress bar."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.first_step_done: tuple[int, float] | None = None  # (step, time) when this run's first step ended
        self.total_steps = total_steps
        self.eval_steps: set[int] = set()
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        # Both files live as long as the run; records are appended, so a resumed run continues them
        # after dropping what was logged past its checkpoint (that stretch is trained again).
        paths = [Path(output_dir) / name for name in ("metrics.jsonl", "eval.jsonl")]
        for path in paths:
            remove_stale_temporaries(path)
        # TensorBoard gets a step's events after its records, so its files hold steps past the
        # checkpoint only if the logs do. Its staging directory, made before any record is dropped,
        # marks a rebuild to do, also for a start killed before the rebuild was done.
        tb_dir = Path(output_dir) / "tensorboard"
        staging = tb_dir.with_name(f".{tb_dir.name}.tmp")
        dropped = []

        def before_dropping(path: Path, records: int) -> None:
            staging.mkdir(exist_ok=True)
            if records:
                dropped.append(path.name)

        _, self.eval_steps = (drop_records_after(path, start_step, functools.partial(before_dropping, path))
                              for path in paths)
        if start_step == 0 and dropped:
            # No checkpoint to resume from, yet an earlier run logged steps here: say so rather than start over
            # in silence (its checkpoints may have been deleted, or it was killed before its first one).
            print(f"warning: {output_dir} has no checkpoint to resume from, but an earlier run logged steps in "
                  f"{' and '.join(dropped)}; this run starts at step 0 and moves those records to "
                  f"{' and '.join(name.replace('.jsonl', '.dropped.jsonl') for name in dropped)}", file=sys.stderr)
        # Unbuffered: a record that a full disk cut short stays in no buffer to fail again at close.
        self.jsonl, self.eval_jsonl = (open(path, "ab", buffering=0) for path in paths)  # noqa: SIM115
        # (also a resumed run's directory without TensorBoard's: deleted, or not copied with the rest)
        if any(tb_dir.parent.glob(f".{tb_dir.name}.*")) or (start_step > 0 and not tb_dir.is_dir()):
            rebuild_tensorboard(tb_dir, {"train": paths[0], "eval": paths[1]})
        self.tb = SummaryWriter(log_dir=str(tb_dir))
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def evaluated(self, step: int) -> bool:
        """Whether eval.jsonl holds a record of `step` (from this run or the one it resumes)."""
        return step in self.eval_steps

    def advance(self, step: int) -> None:
        if self.first_step_done is None:
            self.first_step_done = (step, time.perf_counter())
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log(self, record: dict, prefix: str = "train") -> None:
        """`prefix` "train" goes to metrics.jsonl, "eval" to eval.jsonl; both to TensorBoard."""
        if not self.enabled:
            return
        append_line(self.jsonl if prefix == "train" else self.eval_jsonl, json.dumps(record))
        try:
            _add_scalars(self.tb, prefix, record)
            # Out of the writer's queue and buffer now, as the record is: a run killed after its next
            # checkpoint drops no record, so no rebuild would restore the events it had not yet written.
            self.tb.flush()
        except OSError as e:  # an earlier write of TensorBoard's writer thread, raised here
            raise named(e, Path(self.tb.get_logdir())) from e
        self.bar.write(self.progress_line(record, prefix))

    def note(self, message: str, file=None) -> None:
        """A line on the console (stdout, or `file`), above the progress bar."""
        if self.enabled:
            self.bar.write(message, file=file)

    def progress_line(self, record: dict, prefix: str) -> str:
        step = record["step"]
        parts = [f"{prefix} step {step}/{self.total_steps}", f"loss {record['loss']:.4f}"]
        if "lr" in record:
            parts.append(f"lr {record['lr']:.3e}")
        if prefix == "eval":
            parts += [f"{key.replace('_', ' ')} {record[key]:.4f}" for key in ("mlm_accuracy", "nsp_accuracy")
                      if key in record]
        if record.get("seq_per_s"):
            parts.append(f"{record['seq_per_s']:.1f} seq/s")
        done = step - self.start_step
        if prefix == "train" and done > 0:
            # Paced from the end of this run's first step: its start-up and compilation (minutes on an
            # HPU) would inflate every ETA of a long run's first hours. Until a second step, that step's time.
            since, start = self.first_step_done or (self.start_step, self.start_time)
            if step <= since:  # only the first step is done
                since, start = self.start_step, self.start_time
            eta = (time.perf_counter() - start) / (step - since) * (self.total_steps - step)
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.jsonl.close()
        self.eval_jsonl.close()
        try:
            self.tb.close()
        except OSError as e:
            raise named(e, Path(self.tb.get_logdir())) from e
