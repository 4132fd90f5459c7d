"""Cost of rewriting TensorBoard on a resume that drops records, against logging the same records live.

    .venv/bin/python benchmarks/bench_tensorboard_rebuild.py --records 20000

A resumed run that drops the records logged past its checkpoint writes `tensorboard/` anew from the
records it keeps (training.metrics.rebuild_tensorboard). The benchmark writes `--records` step records
of the fields run_pretraining.py logs through MetricsWriter.log, as a run does (the reference: what
logging them cost the run), then times the rebuild of the same records, and prints both and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.metrics import MetricsWriter, rebuild_tensorboard  # noqa: E402

# The fields of one training record of run_pretraining.py, with typical values.
RECORD = {"loss": 3.2, "mlm_loss": 2.9, "nsp_loss": 0.3, "mlm_accuracy": 0.5, "lr": 1e-3, "grad_norm": 0.9,
          "seq_per_s": 100.0, "tokens_per_s": 12800.0, "tflops_per_device": 1.0, "mfu": None,
          "peak_memory_bytes": 10**9, "consumed_samples": 0, "skipped_batches": 0, "skipped_steps": 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=20000, help="step records in metrics.jsonl")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        writer = MetricsWriter(out, total_steps=a.records, start_step=0, enabled=True)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the progress lines a run prints per record
            for step in range(1, a.records + 1):
                writer.log({"step": step, **RECORD})
        live = time.perf_counter() - start
        writer.close()
        start = time.perf_counter()
        rebuild_tensorboard(out / "tensorboard", {"train": out / "metrics.jsonl", "eval": out / "eval.jsonl"})
        rebuild = time.perf_counter() - start
    print(f"{a.records} records of {len(RECORD)} fields")
    print(f"  logged live (MetricsWriter.log: metrics.jsonl, TensorBoard, console line): {live:.2f} s "
          f"= {1e3 * live / a.records:.2f} ms per record (the reference)")
    print(f"  rebuilt from metrics.jsonl (rebuild_tensorboard):                          {rebuild:.2f} s "
          f"= {1e3 * rebuild / a.records:.2f} ms per record")
    print(f"  ratio rebuild / live: {rebuild / live:.2f}x")


if __name__ == "__main__":
    main()
