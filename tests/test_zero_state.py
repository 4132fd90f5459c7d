"""ZeRO-1 halves the optimizer state per rank: real DeepSpeed runs with 1 and 2 ranks (benchmarks/bench_zero.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero1_optimizer_state_per_rank_halves_with_two_ranks(precision):
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_zero.py", "--config_file", "configs/models/bert-tiny.json",
         "--num_hidden_layers", "2", "--precision", precision, "--timeout", "300"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    params = int(re.search(r"([\d,]+) parameters", proc.stdout).group(1).replace(",", ""))
    rows = [tuple(float(x) for x in m.groups()) for m in re.finditer(
        r"^\s+(\d)\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", proc.stdout, flags=re.M)]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 0), (2, 0), (2, 1)], proc.stdout
    one_rank_total = rows[0][4]
    # One rank holds Adam's two fp32 moments and an fp32 master copy: 12 bytes per parameter.
    assert one_rank_total == pytest.approx(12 * params / 2**20, rel=0.001)
    for _, _, moments, master, total, planned in rows[1:]:
        assert total == pytest.approx(one_rank_total / 2, rel=0.005)
        assert moments == pytest.approx(2 * master, rel=0.001)
        assert total == pytest.approx(planned, rel=0.005)
    assert "halves" in proc.stdout and "DOES NOT" not in proc.stdout
