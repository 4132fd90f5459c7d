"""Metrics sinks and helpers: throughput window, MFU peaks, metrics.jsonl / eval.jsonl, progress line."""

import json
import math
import shutil
import time

import pytest
import torch

from training.metrics import MetricsWriter, Throughput, format_duration, peak_tflops


def test_throughput_skips_warmup_steps_and_restarts_each_window():
    meter = Throughput(warmup=2)
    meter.update(8)
    assert meter.take() is None
    meter.update(8)  # end of warm-up: the clock starts here
    assert meter.take() is None
    time.sleep(0.3)
    meter.update(8)
    meter.update(8)
    rate = meter.take()
    assert 16 / 1.0 < rate <= 16 / 0.3
    assert meter.take() is None  # nothing since the last take
    time.sleep(0.02)  # the next window starts at the take, not at the end of warm-up
    meter.update(8)
    assert meter.take() > 8 / 0.15  # about 8 / 0.02; 8 / 0.32 or less if the clock had not restarted
    with pytest.raises(ValueError):
        Throughput(warmup=0)


def test_time_spent_in_evaluation_or_checkpoints_is_not_training_time():
    meter = Throughput(warmup=1)
    meter.update(8)  # the clock starts
    with meter.excluded():  # an evaluation or a checkpoint
        time.sleep(0.3)
    time.sleep(0.02)
    meter.update(16)
    assert meter.take() > 16 / 0.2  # about 16 / 0.02; 16 / 0.32 if the pause counted


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("GAUDI2", "bf16", 432.0), ("GAUDI3", "bf16", 1835.0), ("NVIDIA H200", "fp32", 67.0),
    ("cpu", "bf16", None), ("Tesla T4", "bf16", None),
    # not the SXM part's 989 / 67: the PCIe card's own dense peak; the NVL cards have none in the table
    ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H100 PCIe", "fp32", 51.0),
    ("NVIDIA H100 NVL", "bf16", None), ("NVIDIA H200 NVL", "bf16", None),
])
def test_device_peaks_come_from_the_planner_table(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak


def test_first_generation_gaudi_has_an_mfu():
    from training.planner import device_peak_tflops

    # torch.hpu.get_device_name() says "GAUDI" on first-generation Gaudi (DL1); "GAUDI2"/"GAUDI3" keep theirs.
    assert peak_tflops("GAUDI", "bf16") == device_peak_tflops("gaudi1", "bf16") == 60.0
    assert peak_tflops("GAUDI", "torch.bfloat16") == 60.0
    assert (peak_tflops("GAUDI2", "bf16"), peak_tflops("GAUDI3", "bf16")) == (432.0, 1835.0)


def test_writer_appends_jsonl_and_prints_progress(tmp_path, capsys):
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=4, enabled=True)
    writer.log({"step": 5, "loss": 7.25, "lr": 1e-4, "seq_per_s": 12.5, "mfu": None})
    writer.log({"step": 5, "loss": 7.5, "samples": 32}, prefix="eval")
    writer.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 5, "loss": 7.25, "lr": 1e-4, "seq_per_s": 12.5, "mfu": None}]
    assert json.loads((tmp_path / "eval.jsonl").read_text())["samples"] == 32
    out = capsys.readouterr().out  # the bar is on stderr, the progress lines on stdout
    assert "train step 5/10 | loss 7.2500 | lr 1.000e-04 | 12.5 seq/s | ETA " in out
    assert "eval step 5/10 | loss 7.5000" in out
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    # a second writer (a resumed run) appends
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=5, enabled=True)
    writer.log({"step": 6, "loss": 7.0})
    writer.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def tensorboard_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event in every event file of `tb_dir`, as written: what any TensorBoard loader
    (the default Rust one included, which ignores purge_step) can show."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                number = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars


def test_eta_extrapolates_this_runs_pace_to_the_steps_left(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    writer = MetricsWriter(tmp_path, total_steps=100, start_step=40, enabled=True)  # resumed at step 40
    clock[0] += 50.0  # 10 steps in 50 s: 5 s per step, 50 steps left
    line = writer.progress_line({"step": 50, "loss": 1.0}, "train")
    writer.close()
    assert line == "train step 50/100 | loss 1.0000 | ETA 0:04:10"


def test_eta_leaves_out_the_first_steps_start_up(tmp_path, monkeypatch):
    """The first step of a run carries its compilation (minutes on an HPU) and the loader's start: averaged in,
    it inflated the ETA of a long run for hours. The pace counts from the end of that step."""
    clock = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    writer = MetricsWriter(tmp_path, total_steps=100, start_step=40, enabled=True)  # resumed at step 40
    clock[0] += 60.0  # step 41: 60 s of start-up and compilation
    writer.advance(41)
    assert writer.progress_line({"step": 41, "loss": 1.0}, "train").endswith("ETA 0:59:00")  # 60 s x 59: all it has
    for step in range(42, 51):  # then 5 s per step
        clock[0] += 5.0
        writer.advance(step)
    line = writer.progress_line({"step": 50, "loss": 1.0}, "train")
    writer.close()
    assert line == "train step 50/100 | loss 1.0000 | ETA 0:04:10"  # 5 s x 50, not 105 s / 10 x 50 = 0:08:45


def test_a_resumed_run_drops_what_was_logged_past_its_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=0, enabled=True)
    for step in range(1, 8):
        writer.log({"step": step, "loss": 10.0 - step})
    writer.log({"step": 5, "loss": 6.0}, prefix="eval")
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("a line that is no record\n")  # kept where it is
        f.write('{"step": 8, "lo')  # killed mid-write
    # killed after step 7; the checkpoint was at step 4: steps 5-7 are trained again
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=4, enabled=True)
    for step in range(5, 11):
        writer.log({"step": step, "loss": 20.0 - step})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[4] == "a line that is no record"  # after the kept records of steps 1-4
    steps = [json.loads(x)["step"] for x in lines[:4] + lines[5:]]
    assert steps == list(range(1, 11))
    assert (tmp_path / "eval.jsonl").read_text() == ""
    # what was dropped is kept aside (a rewound run's records are not lost); the cut-short line is not
    assert [json.loads(x) for x in (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()] == [
        {"step": step, "loss": 10.0 - step} for step in (5, 6, 7)]
    assert json.loads((tmp_path / "eval.dropped.jsonl").read_text()) == {"step": 5, "loss": 6.0}
    # TensorBoard holds each kept step once, with the rerun's values past the checkpoint, and not the
    # evaluation of step 5, made before the kill
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars == {"train/loss": [(step, 10.0 - step) for step in range(1, 5)] +
                                     [(step, 20.0 - step) for step in range(5, 11)]}
    assert not list(tmp_path.glob(".tensorboard.*"))
    # A start killed after it dropped records, before its rebuild: the staging directory, made before
    # the logs were touched, marks the rebuild for the next start (here: a stale event of step 12).
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(tmp_path / "tensorboard")) as stale:
        stale.add_scalar("train/loss", 1.0, 12)
    (tmp_path / ".tensorboard.tmp").mkdir()
    MetricsWriter(tmp_path, total_steps=10, start_step=10, enabled=True).close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == scalars
    # killed between the two renames of the swap: the next start rebuilds from the logs again
    (tmp_path / "tensorboard").rename(tmp_path / ".tensorboard.old")
    (tmp_path / ".tensorboard.tmp").mkdir()
    MetricsWriter(tmp_path, total_steps=10, start_step=10, enabled=True).close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == scalars
    assert not list(tmp_path.glob(".tensorboard.*"))
    # nothing dropped, no leftovers: the event files are kept, not rewritten
    before = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    MetricsWriter(tmp_path, total_steps=10, start_step=10, enabled=True).close()
    assert set(before) < {p.name for p in (tmp_path / "tensorboard").iterdir()}
    # a resume whose TensorBoard directory is gone (deleted, or not copied with the run) gets it back from the
    # logs; it had started an empty one (found by an audit)
    shutil.rmtree(tmp_path / "tensorboard")
    MetricsWriter(tmp_path, total_steps=10, start_step=10, enabled=True).close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == scalars


LOG_THEN_SIGKILL = """
import os, signal, sys, time
from pathlib import Path

from tensorboard.summary.writer.record_writer import RecordWriter

from training.metrics import MetricsWriter

write = RecordWriter.write
RecordWriter.write = lambda self, data: (time.sleep(0.02), write(self, data))  # a slow file system
writer = MetricsWriter(Path(sys.argv[1]), 100, 0, enabled=True)
for step in range(1, 9):
    writer.log({"step": step, "loss": 1.0 / step, "lr": 1e-4})
writer.log({"step": 8, "loss": 0.5}, prefix="eval")
os.kill(os.getpid(), signal.SIGKILL)  # right after the checkpoint of step 8, say
"""


def test_a_run_killed_after_its_checkpoint_keeps_every_logged_step_in_tensorboard(tmp_path):
    """SIGKILL after a checkpoint at the last logged step: the resume drops no record, so it does not rebuild
    TensorBoard from the logs. Before, the events SummaryWriter's thread had not yet written (it writes behind
    the records; slowed down here, as on a slow file system) were lost, and TensorBoard missed those steps for
    good."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", LOG_THEN_SIGKILL, str(tmp_path)], cwd=root, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    MetricsWriter(tmp_path, total_steps=100, start_step=8, enabled=True).close()  # the resume from step 8
    assert not (tmp_path / "metrics.dropped.jsonl").exists()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(step, pytest.approx(1.0 / step)) for step in range(1, 9)]
    assert scalars["eval/loss"] == [(8, 0.5)]


def test_a_rebuild_killed_midway_is_redone_from_the_logs_alone(tmp_path):
    """A start killed while it rebuilt TensorBoard left events in the staging directory; the next start's rebuild
    begins with an empty one, or those steps would appear twice once it is swapped in."""
    from torch.utils.tensorboard import SummaryWriter

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                    for s in range(1, 7)))
    with SummaryWriter(log_dir=str(tmp_path / ".tensorboard.tmp")) as partial:  # the killed rebuild's 2 steps
        for s in (1, 2):
            partial.add_scalar("train/loss", 1.0 / s, s)
    MetricsWriter(tmp_path, total_steps=10, start_step=4, enabled=True).close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {
        "train/loss": [(s, pytest.approx(1.0 / s)) for s in range(1, 5)]}
    assert not (tmp_path / ".tensorboard.tmp").exists()


def test_the_evaluated_steps_are_those_of_eval_jsonl_up_to_the_checkpoint(tmp_path):
    """What a resumed run reads to know whether its final evaluation is still to do."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 6)))
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=4, enabled=True)
    writer.close()
    assert [s for s in range(1, 8) if writer.evaluated(s)] == [2]  # not 1-4 (metrics.jsonl), not 6 (past step 4)


def test_a_start_from_scratch_over_an_earlier_runs_records_says_so(tmp_path, capsys):
    """Its checkpoints deleted, a run's rerun trained again from step 0 without a word."""
    MetricsWriter(tmp_path, total_steps=10, start_step=0, enabled=True).close()  # a first start: nothing to say
    assert "warning" not in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    MetricsWriter(tmp_path, total_steps=10, start_step=2, enabled=True).close()  # a resume drops step 3 quietly
    assert "warning" not in capsys.readouterr().err
    MetricsWriter(tmp_path, total_steps=10, start_step=0, enabled=True).close()
    assert (f"warning: {tmp_path} has no checkpoint to resume from, but an earlier run logged steps in "
            "metrics.jsonl; this run starts at step 0 and moves those records to metrics.dropped.jsonl") \
        in capsys.readouterr().err


def test_a_fresh_start_over_only_a_cut_short_line_drops_it_without_a_warning(tmp_path, capsys):
    """The warning said records moved to metrics.dropped.jsonl, which was never written: a run killed in its first
    record leaves only a cut line, which is dropped, not moved."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo')
    MetricsWriter(tmp_path, total_steps=10, start_step=0, enabled=True).close()
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / "metrics.dropped.jsonl").exists()


def test_a_rerun_killed_while_dropping_records_keeps_them_aside_once(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                    for s in range(1, 7)))
    (tmp_path / ".metrics.jsonl.4242.0123456789ab.tmp").write_text('{"step": 1')  # the killed rewrite
    (tmp_path / "metrics.dropped.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                            for s in (5, 6)))  # appended before the kill
    MetricsWriter(tmp_path, total_steps=10, start_step=4, enabled=True).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()] == [5, 6]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp"))


def test_other_ranks_write_nothing(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=10, start_step=0, enabled=False)
    writer.log({"step": 1, "loss": 1.0})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_duration_format_beyond_a_day():
    assert format_duration(3 * 86400 + 3661) == "73:01:01"


# run_pretraining's command on each rank with a Throughput that records what it is fed and reports a fixed rate,
# in a child process: DeepSpeed keeps its process group in module globals, which the test process must not hold.
COUNTED_RUN = """
import json, sys
import run_pretraining
from training.metrics import Throughput
counted = []
class Counting(Throughput):
    def update(self, sequences):
        counted.append(sequences)
        super().update(sequences)
    def take(self):
        return None if super().take() is None else 100.0  # a fixed rate: the derived figures are exact
run_pretraining.Throughput = Counting
loader_workers = []
make_loader = run_pretraining.make_loader
def recording_loader(dataset, sampler, micro_batch, num_workers, **kwargs):
    loader_workers.append(num_workers)
    return make_loader(dataset, sampler, micro_batch, num_workers, **kwargs)
run_pretraining.make_loader = recording_loader
seeds = []
micro_step_seed = run_pretraining.micro_step_seed
def recording_seed(*args):
    seeds.append(micro_step_seed(*args))
    return seeds[-1]
run_pretraining.micro_step_seed = recording_seed
main = run_pretraining.main
def main_then_print(argv=None):
    code = main(argv)
    print("COUNTED", json.dumps(counted))
    print("LOADER_WORKERS", json.dumps(loader_workers))
    print("SEEDS", json.dumps(seeds))
    return code
run_pretraining.main = main_then_print
# The command's own ending: an error in the run is a traceback and exit 1 past the DataLoader workers (left to
# the interpreter, the process waited for them for good)
run_pretraining.script()
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_run_counts_every_sequence_of_a_step_in_its_throughput(phase1_shards, tmp_path, ranks):
    """fp32, 2 micro batches of 2 per step on each rank: the throughput window gets the step's whole global batch
    (every rank's), and the logged rates follow from its sequences per second. The same short run shows that
    --num_workers reaches the training loader and --keep_checkpoints the checkpoints kept (both non-default here),
    which no other test outside the slow ones can see."""
    import os
    import subprocess
    import sys

    from modeling import BertConfig
    from tests.conftest import ROOT, communicate_all
    from training.accelerator import free_port
    from training.planner import training_flops_per_sequence

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
                              "steps_per_print": 10**6}))
    model = ROOT / "configs" / "models" / "bert-tiny.json"
    out = tmp_path / "run"
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-c", COUNTED_RUN, "--deepspeed", "--deepspeed_config", str(ds), "--input_dir",
         str(phase1_shards), "--output_dir", str(out), "--config_file", str(model), "--max_steps", "4",
         "--log_freq", "1", "--num_workers", "1", "--num_eval_samples", "0", "--optimizer", "adamw",
         "--learning_rate", "1e-4", "--num_steps_per_checkpoint", "1", "--keep_checkpoints", "2"], cwd=ROOT,
        env=os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DS_ACCELERATOR": "cpu"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    outputs = communicate_all(procs, timeout=600)
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]

    def printed(stdout: str, key: str) -> list:
        return json.loads(next(x for x in stdout.splitlines() if x.startswith(f"{key} ")).split(" ", 1)[1])

    batch = 2 * 2 * ranks  # 2 micro batches x 2 sequences x the ranks, per step
    for stdout, _ in outputs:
        assert printed(stdout, "COUNTED") == [batch] * 4
        assert printed(stdout, "LOADER_WORKERS") == [1]  # --num_workers 1, not the default 2
    # dropout masks: a seed of its own for every micro batch of every rank
    seeds = [printed(stdout, "SEEDS") for stdout, _ in outputs]
    assert all(len(s) == 2 * 4 for s in seeds) and len({x for s in seeds for x in s}) == 2 * 4 * ranks
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert [records[s]["seq_per_s"] for s in (1, 2, 3, 4)] == [None, None, 100.0, 100.0]  # warm-up: 2 steps
    flops = training_flops_per_sequence(BertConfig.from_json_file(model), 128, 20)
    assert records[3]["tokens_per_s"] == 100.0 * 128
    assert records[3]["tflops_per_device"] == flops * 100.0 / ranks / 1e12
    assert [records[s]["consumed_samples"] for s in (1, 2, 3, 4)] == [batch, 2 * batch, 3 * batch, 4 * batch]
    # a checkpoint every step, the newest 2 kept (the default keeps 3)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step00000003", "step00000004"]


def test_evaluation_is_per_masked_token_and_per_sequence_over_all_batches():
    """Two batches, one masked token in the first (a hit) and three in the second (one hit): the MLM accuracy is
    2/4, not the mean of the batches' 1/1 and 1/3 weighted by their one sequence each (0.667), as it was."""
    from modeling import PreTrainingOutput
    from run_pretraining import eval_record, eval_sums

    def batch(labels, logits, nsp_label, nsp_logits):
        inputs = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "masked_lm_labels": torch.tensor([labels]),
                  "next_sentence_labels": torch.tensor([nsp_label])}
        out = PreTrainingOutput(None, None, None, None, torch.tensor([logits]), torch.tensor([nsp_logits]))
        return eval_sums(out, inputs)

    def nll(logits, label):  # cross-entropy of one prediction, by hand
        return math.log(sum(math.exp(x) for x in logits)) - logits[label]

    a = [[0.0, 3.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0]]  # the last two slots are unused
    b = [[2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]
    sums = batch([1, -100, -100], a, 0, [2.0, 0.0]) + batch([2, 3, 0], b, 1, [0.5, 0.0])
    record = eval_record(sums, nsp=True)
    mlm_loss = (nll(a[0], 1) + nll(b[0], 2) + nll(b[1], 3) + nll(b[2], 0)) / 4
    nsp_loss = (nll([2.0, 0.0], 0) + nll([0.5, 0.0], 1)) / 2
    assert record == pytest.approx({"loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss, "mlm_accuracy": 0.5,
                                    "nsp_loss": nsp_loss, "nsp_accuracy": 0.5, "samples": 2, "masked_tokens": 4},
                                   rel=1e-6)
    assert list(record) == ["loss", "mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy", "samples", "masked_tokens"]
    without_nsp = eval_record(sums, nsp=False)  # a model without an NSP head: no NSP figures, loss = MLM loss
    assert without_nsp == pytest.approx({"loss": mlm_loss, "mlm_loss": mlm_loss, "mlm_accuracy": 0.5, "samples": 2,
                                         "masked_tokens": 4}, rel=1e-6)


def test_an_evaluation_line_shows_the_accuracies(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=100, start_step=0, enabled=True)
    line = writer.progress_line({"step": 50, "loss": 2.0, "mlm_accuracy": 0.41234, "nsp_accuracy": 0.875}, "eval")
    writer.close()
    assert line == "eval step 50/100 | loss 2.0000 | mlm accuracy 0.4123 | nsp accuracy 0.8750"


LOG_UNTIL_THE_DISK_IS_FULL = """
import sys
from pathlib import Path

from training.metrics import MetricsWriter

writer = MetricsWriter(Path(sys.argv[1]), 1000, 0, enabled=True)
try:
    for step in range(1, 1000):
        # a long text field (not a TensorBoard scalar): metrics.jsonl reaches the limit before the event file
        writer.log({"step": step, "loss": 1.0 / step, "lr": 1e-4, "note": "x" * 200})
except OSError as e:
    print(f"{e.errno} {e.filename}")
writer.close()  # nothing is left to write: it does not fail again
print("closed")
"""


def test_a_full_disk_names_metrics_jsonl_and_the_resume_drops_the_cut_record(tmp_path):
    """Writes past 1000 bytes fail with EFBIG (RLIMIT_FSIZE; Python ignores SIGXFSZ), as on a full disk.
    Before, the error was "[Errno 28] No space left on device" without a file, raised again by close()
    from the text buffer it kept."""
    import errno
    import resource
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", LOG_UNTIL_THE_DISK_IS_FULL, str(tmp_path)], cwd=root,
                            capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == [f"{errno.EFBIG} {tmp_path / 'metrics.jsonl'}", "closed"]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert len(text) == 1000 and not text.endswith("\n")  # the last record cut short
    whole = len(text.splitlines()) - 1
    writer = MetricsWriter(tmp_path, 1000, whole, enabled=True)  # a resume from step `whole`
    writer.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, whole + 1))


def test_a_short_write_is_continued_until_the_whole_line_is_written(tmp_path):
    """A write may take only part of the bytes (as at a full disk's or a size limit's edge): the rest is
    written by further calls, and the line is UTF-8."""
    from training.metrics import append_line

    class Short:  # takes at most 3 bytes per call
        name = str(tmp_path / "metrics.jsonl")

        def __init__(self):
            self.written = b""

        def write(self, data):
            self.written += bytes(data[:3])
            return min(3, len(data))

    sink = Short()
    append_line(sink, '{"step": 1, "note": "é"}')
    assert sink.written.decode("utf-8") == '{"step": 1, "note": "é"}\n'
