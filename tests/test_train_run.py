"""run_pretraining.py end to end, as real processes on CPU with gloo, a tiny model and the
project's own shards made from the real Wikipedia sample (fixtures phase1_shards / dynamic_shards).

One 2-rank bf16 ZeRO-1 run (module fixture) serves several tests: loss falls, fp32 gradient
accumulation, metrics, checkpoint layout, phase 2, resuming on 1 rank, a corrupt checkpoint.
The fp32 runs check bitwise-equal losses after SIGKILL and SIGTERM."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest
import torch
from conftest import ROOT, lock_held_elsewhere, to_reference_format

from modeling import BertConfig, BertForPreTraining
from training.accelerator import free_port
from training.checkpoint import read_latest
from training.planner import training_flops_per_sequence

TINY = json.loads((ROOT / "configs" / "models" / "bert-tiny.json").read_text())


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def ds_config(path: Path, bf16: bool, **batch) -> Path:
    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**6, **batch}
    if bf16:
        config |= {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    return write_json(path, config)


def command(nproc: int, args: list[str]) -> tuple[list[str], dict]:
    # One thread per rank: tests run beside other work, and oversubscribed OpenMP threads spin.
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions")),
               PYTHONUNBUFFERED="1")
    script = str(ROOT / "run_pretraining.py")
    if nproc == 1:
        env["MASTER_PORT"] = str(free_port())
        return [sys.executable, script, *args], env
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), script, *args], env


def run(nproc: int, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd, env = command(nproc, args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def base_args(shards: Path, out: Path, model: Path, ds: Path, steps: int, **extra) -> list[str]:
    args = ["--deepspeed", "--deepspeed_config", str(ds), "--input_dir", str(shards), "--output_dir", str(out),
            "--config_file", str(model), "--max_steps", str(steps), "--log_freq", "1", "--num_workers", "0",
            "--num_eval_samples", "32"]
    for key, value in extra.items():
        args += [f"--{key}"] + ([] if value is True else [str(value)])
    return args


def records(out: Path, name: str = "metrics.jsonl") -> dict[int, dict]:
    """The record of each step."""
    result = {}
    for line in (out / name).read_text().splitlines():
        record = json.loads(line)
        result[record["step"]] = record
    return result


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


# ----------------------------------------------------------------------------- 2 ranks, bf16, ZeRO-1

BF16_STEPS = 16


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory) -> Path:
    # Without dropout, a 2-rank and a 1-rank run of the same steps differ only by rounding.
    return write_json(tmp_path_factory.mktemp("model") / "tiny.json",
                      TINY | {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})


@pytest.fixture(scope="module")
def bf16_ds(tmp_path_factory) -> Path:
    # train_batch_size and micro batch fixed: DeepSpeed derives accumulation 2 on 2 ranks, 4 on 1 rank.
    return ds_config(tmp_path_factory.mktemp("ds") / "ds.json", bf16=True, train_batch_size=16,
                     train_micro_batch_size_per_gpu=4)


def bf16_args(shards: Path, out: Path, model: Path, ds: Path) -> list[str]:
    return base_args(shards, out, model, ds, BF16_STEPS, optimizer="lamb", learning_rate=2e-2,
                     warmup_proportion=0.1, num_steps_per_checkpoint=8, keep_checkpoints=2, eval_freq=8,
                     num_workers=1)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, phase1_shards, no_dropout_model, bf16_ds) -> Path:
    out = tmp_path_factory.mktemp("bf16") / "run"
    ok(run(2, bf16_args(phase1_shards, out, no_dropout_model, bf16_ds)))
    return out


@pytest.mark.slow
def test_bf16_zero1_two_ranks_trains(bf16_run):
    info = json.loads((bf16_run / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["backend"] == "gloo" and info["zero_stage"] == 1
    assert info["bf16"] and info["optimizer_wrapper"] == "BF16_Optimizer"
    assert info["grad_accum_dtype"] == "float32"  # checked on the engine's buffers, not read from the JSON
    assert info["micro_batch"] == 4 and info["gradient_accumulation_steps"] == 2
    recs = records(bf16_run)
    assert sorted(recs) == list(range(1, BF16_STEPS + 1))
    first = sum(recs[s]["loss"] for s in (1, 2, 3)) / 3
    last = sum(recs[s]["loss"] for s in (14, 15, 16)) / 3
    assert last < first - 0.5, (first, last)
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "lr", "grad_norm", "seq_per_s", "tokens_per_s",
                "tflops_per_device", "mfu", "peak_memory_bytes", "consumed_samples"):
        assert key in recs[16]
    assert recs[16]["consumed_samples"] == 16 * 16
    assert recs[16]["tokens_per_s"] == pytest.approx(recs[16]["seq_per_s"] * 128)
    # the model FLOPs of the run's sequences per second, shared by its 2 devices
    flops = training_flops_per_sequence(BertConfig.from_json_file(bf16_run / "model_config.json"), 128, 20)
    assert recs[16]["tflops_per_device"] == pytest.approx(flops * recs[16]["seq_per_s"] / 2 / 1e12, rel=1e-12)
    assert recs[16]["mfu"] is None  # no known peak for a CPU
    assert recs[1]["lr"] == pytest.approx(2e-2 * 1 / 2)  # warm-up: 10% of 16 steps = 2 steps
    evals = records(bf16_run, "eval.jsonl")
    assert sorted(evals) == [8, 16] and evals[16]["samples"] == 32
    assert evals[16]["loss"] < evals[8]["loss"]
    final = evals[16]
    assert final["loss"] == pytest.approx(final["mlm_loss"] + final["nsp_loss"], rel=1e-12)
    assert 32 < final["masked_tokens"] <= 32 * 20  # the MLM figures are per masked token of the 32 samples
    assert 0 <= final["mlm_accuracy"] <= 1 and 0 <= final["nsp_accuracy"] <= 1
    assert (bf16_run / "tensorboard").is_dir()


@pytest.mark.slow
def test_bf16_accumulation_counts_each_micro_batch_once(phase1_shards, no_dropout_model, tmp_path):
    """Micro batch 2 x accumulation 4 and micro batch 8 x accumulation 1 see the same 8 samples per
    step, so their fp32 gradients and logged norms agree to rounding. A bf16 gradient not zeroed
    between micro batches counts the first micro batch 4 times and the norm comes out ~2.5x."""
    norms = {}
    for micro, accum in ((2, 4), (8, 1)):
        ds = ds_config(tmp_path / f"ds{micro}.json", bf16=True, train_batch_size=8,
                       train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
        out = tmp_path / f"micro{micro}"
        ok(run(1, base_args(phase1_shards, out, no_dropout_model, ds, 3, optimizer="lamb", learning_rate=1e-3)))
        recs = records(out)
        assert [recs[s]["consumed_samples"] for s in (1, 2, 3)] == [8, 16, 24]
        norms[micro] = [recs[s]["grad_norm"] for s in (1, 2, 3)]
    assert norms[2] == pytest.approx(norms[8], rel=0.03), norms


@pytest.mark.slow
def test_checkpoint_layout_and_export_files(bf16_run, phase1_shards):
    ckpt = bf16_run / "checkpoints"
    assert read_latest(ckpt) == "step00000016"
    tags = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert tags == ["step00000008", "step00000016"]
    state = json.loads((ckpt / "step00000016" / "run_state.json").read_text())
    assert state["consumed_samples"] == 256 and state["world_size"] == 2
    assert {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "mp_rank_00_model_states.pt"} <= set(state["files"])
    assert json.loads((bf16_run / "model_config.json").read_text())["hidden_size"] == TINY["hidden_size"]
    assert (bf16_run / "vocab.txt").read_bytes() == (phase1_shards / "vocab.txt").read_bytes()


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank_at_the_same_sample(bf16_run, phase1_shards, no_dropout_model,
                                                                    bf16_ds, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(bf16_run, out)
    (out / "checkpoints" / "latest").write_text("step00000008\n")  # as if the 2-rank job stopped at step 8
    # A universal copy left by another timeline's step 8 must not be loaded: it is converted again.
    stale = out / "checkpoints" / "step00000008_universal"
    stale.mkdir()
    (stale / "mp_rank_00_model_states.pt").write_bytes(b"weights of another timeline")
    (stale / "source_run_state.json").write_text("{}")
    console = ok(run(1, bf16_args(phase1_shards, out, no_dropout_model, bf16_ds))).stdout.splitlines()
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 1 and info["resumed_world_size"] == 2 and info["resumed_from"] == "step00000008"
    # What the start runs, on the console before the first step.
    training = sum(len(h5py.File(f)["input_ids"]) for f in (phase1_shards / "hdf5" / "training").glob("*.hdf5"))
    first = next(k for k, line in enumerate(console) if line.startswith("run: "))
    assert console[first:first + 7] == [
        "run: 1 rank on cpu (gloo), ZeRO-1, bf16 with fp32 master weights and float32 gradient accumulation, "
        "optimizer lamb",
        "batch: 16 sequences per step = 4 per micro batch x 4 accumulation steps x 1 rank",
        f"model: {info['parameters'] / 1e6:.1f}M parameters ({no_dropout_model}), activation checkpointing off",
        f"training data: {training:,} sequences of 128 tokens in 2 shards under hdf5/training, static masks",
        f"vocabulary: {phase1_shards / 'vocab.txt'}",
        "test data: 378 sequences in 1 shard under hdf5/test; the first 32 evaluated every 8 steps and at the end",
        f"start: step 8 of 16 (256 sequences, {256 / training:.3g} epochs of the training data), resumed from "
        "step00000008 at sequence 128 of a 2-rank run"]
    assert info["gradient_accumulation_steps"] == 4 and info["start_consumed_samples"] == 8 * 16
    assert (stale / "zero").is_dir()
    assert (stale / "source_run_state.json").read_bytes() == \
        (out / "checkpoints" / "step00000008" / "run_state.json").read_bytes()
    two, one = records(bf16_run), records(out)
    for step in range(9, BF16_STEPS + 1):
        assert one[step]["consumed_samples"] == two[step]["consumed_samples"] == step * 16
        # same samples, same weights and optimizer state: only bf16 rounding and reduction order differ
        assert one[step]["loss"] == pytest.approx(two[step]["loss"], rel=0.02), step
        assert one[step]["lr"] == pytest.approx(two[step]["lr"], rel=1e-9)
    assert read_latest(out / "checkpoints") == "step00000016"
    state = json.loads((out / "checkpoints" / "step00000016" / "run_state.json").read_text())
    assert state["world_size"] == 1


@pytest.mark.slow
def test_phase2_starts_from_phase1_weights_with_fresh_optimizer(bf16_run, dynamic_shards, tmp_path):
    # Phase 2 reads the shards without static masks: the dynamic-masking path end to end.
    out = tmp_path / "phase2"
    ds = ds_config(tmp_path / "ds.json", bf16=True, train_micro_batch_size_per_gpu=4)
    phase1_files = {p: p.stat().st_mtime_ns for p in bf16_run.rglob("*") if p.is_file()}
    console = ok(run(1, base_args(dynamic_shards, out, bf16_run / "model_config.json", ds, 3, optimizer="lans",
                                  learning_rate=1e-3, warmup_proportion=0.5, phase2=True, init_checkpoint=bf16_run,
                                  checkpoint_activations=True, checkpoint_activations_interval=2))).stdout
    info = json.loads((out / "run_info.json").read_text())
    assert "activation checkpointing every 2 layers\n" in console
    assert "in 2 shards under hdf5/training, masked at load time\n" in console
    assert "(12 sequences, " in console and f"), weights from {info['init_checkpoint']}\n" in console
    assert info["activation_checkpointing"] and info["activation_checkpointing_interval"] == 2
    assert not info["compiled"]
    assert info["optimizer"] == "lans" and info["optimizer_wrapper"] == "BF16_Optimizer"
    assert info["init_checkpoint"].endswith("checkpoints/step00000016") and info["start_step"] == 0
    recs, phase1 = records(out), records(bf16_run)
    # fresh schedule: step 1 of a 2-step warm-up; phase-1 weights: the loss continues where phase 1 ended
    assert recs[1]["lr"] == pytest.approx(0.5e-3)
    assert recs[1]["loss"] < phase1[1]["loss"] - 0.5
    assert abs(recs[1]["loss"] - phase1[16]["loss"]) < 0.5
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step00000003"]
    assert {p: p.stat().st_mtime_ns for p in bf16_run.rglob("*") if p.is_file()} == phase1_files


def universal_moments(tag_dir: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's Adam moments and step count as DeepSpeed's own converter (ds_to_universal) writes
    them: a reader independent of training/moments.py."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    ok(subprocess.run(cmd, env=command(1, [])[1], capture_output=True, text=True, timeout=300))
    found = {}
    for param in sorted(p for p in (out / "zero").iterdir() if p.is_dir()):
        loaded = {key: torch.load(param / f"{key}.pt", weights_only=False) for key in ("exp_avg", "exp_avg_sq", "step")}
        found[param.name] = {key: value["param"] if isinstance(value, dict) else value for key, value in loaded.items()}
    return found


def phase2_with_and_without_moments(phase1: Path, nproc: int, tmp_path: Path, args) -> tuple[Path, Path]:
    """The same one-step phase 2 twice, from the same weights on the same samples: once with phase 1's
    optimizer moments (--init_optimizer_moments), once without."""
    outs = []
    for name, extra in (("fresh", {}), ("kept", {"init_optimizer_moments": True})):
        out = tmp_path / name
        console = ok(run(nproc, args(out, num_eval_samples=0, phase2=True, init_checkpoint=phase1, **extra))).stdout
        info = json.loads((out / "run_info.json").read_text())
        assert info["init_optimizer_moments"] == bool(extra)
        assert (f"weights from {info['init_checkpoint']} with its optimizer moments (step count 0)\n" in console) == \
            bool(extra)
        outs.append(out)
    return outs[0], outs[1]


def assert_moments_carried(phase1: Path, fresh: Path, kept: Path, tmp_path: Path) -> None:
    """One step takes the same gradient g in both runs (the loss is the same), so the kept run's moments,
    m = 0.9 m1 + 0.1 g and v = 0.999 v1 + 0.001 g^2, exceed the fresh run's 0.1 g and 0.001 g^2 by exactly
    0.9 m1 and 0.999 v1, phase 1's moments, for every parameter; and its step count restarted (bias
    correction as at a first step), as NVIDIA's phase 2 sets it to 0."""
    assert records(fresh)[1]["loss"] == records(kept)[1]["loss"]
    tags = [out / "checkpoints" / read_latest(out / "checkpoints") for out in (phase1, fresh, kept)]
    then, without, kept_moments = (universal_moments(tag, tmp_path / f"universal_{i}") for i, tag in enumerate(tags))
    assert set(then) == set(without) == set(kept_moments) and len(then) > 40
    for name in then:
        assert int(kept_moments[name]["step"]) == int(without[name]["step"]) == 1, name
        for key, beta in (("exp_avg", 0.9), ("exp_avg_sq", 0.999)):
            carried = beta * then[name][key].double()
            added = kept_moments[name][key].double() - without[name][key].double()
            scale = carried.abs().max().item()
            assert scale > 0, (name, key)  # phase 1 left moments to carry
            assert (added - carried).abs().max().item() < 1e-5 * scale, (name, key)


@pytest.mark.slow
def test_phase2_can_start_from_phase1_optimizer_moments(bf16_run, phase1_shards, tmp_path):
    """Phase 1 on 2 ranks (bf16, LAMB), phase 2 on 1: each moment is joined from both ranks' partitions."""
    ds = ds_config(tmp_path / "ds.json", bf16=True, train_batch_size=8, train_micro_batch_size_per_gpu=4)

    def args(out: Path, **extra) -> list[str]:
        return base_args(phase1_shards, out, bf16_run / "model_config.json", ds, 1, optimizer="lamb",
                         learning_rate=1e-3, **extra)

    fresh, kept = phase2_with_and_without_moments(bf16_run, 1, tmp_path, args)
    assert_moments_carried(bf16_run, fresh, kept, tmp_path)
    # LANS moments are of normalised gradients: refused before any weight is read
    refused = run(1, base_args(phase1_shards, tmp_path / "lans", bf16_run / "model_config.json", ds, 1,
                               optimizer="lans", phase2=True, init_checkpoint=bf16_run, init_optimizer_moments=True))
    assert refused.returncode == 1 and "was trained with --optimizer lamb, whose moments are not those of " \
        "--optimizer lans. Pass --optimizer lamb, or drop --init_optimizer_moments\n" in refused.stderr
    assert not (tmp_path / "lans" / "checkpoints").exists()


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


@pytest.mark.slow
def test_a_finished_run_rerun_on_another_world_size_is_not_converted(bf16_run, phase1_shards, no_dropout_model,
                                                                      bf16_ds, tmp_path):
    """It trains nothing, so it reads only the module weights (for a final evaluation that went missing):
    no universal copy of the last checkpoint, which would take minutes and a tag's size on disk."""
    out = tmp_path / "finished"
    shutil.copytree(bf16_run, out)
    evaluations = (out / "eval.jsonl").read_text().splitlines()
    final = json.loads(evaluations[-1])
    assert final["step"] == BF16_STEPS
    (out / "eval.jsonl").write_text("".join(line + "\n" for line in evaluations[:-1]))  # as if killed before it
    metrics = (out / "metrics.jsonl").read_bytes()
    result = ok(run(1, bf16_args(phase1_shards, out, no_dropout_model, bf16_ds)))
    assert f"done: step {BF16_STEPS} of {BF16_STEPS}" in result.stderr
    assert not list((out / "checkpoints").glob("*_universal"))
    assert (out / "metrics.jsonl").read_bytes() == metrics
    again = records(out, "eval.jsonl")[BF16_STEPS]
    # the same weights and samples on 1 rank instead of 2: only the order of the sums differs
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy"):
        assert again[key] == pytest.approx(final[key], rel=1e-3), key
    assert again["samples"] == final["samples"] == 32


@pytest.mark.slow
def test_bf16_runs_start_from_fp32_master_weights(bf16_run, phase1_shards, no_dropout_model, bf16_ds, tmp_path):
    """DeepSpeed builds a bf16 run's fp32 master weights from the module cast to bf16; the run puts the
    fp32 values back: a fresh run's initial weights, and phase 1's fp32 masters in phase 2. With a
    learning rate of 1e-30, one step leaves every nonzero weight unchanged in fp32 (zeros move by
    about 1e-30), so the masters saved after it are those the run started from."""
    from scripts.export_hf import locate, read_weights

    fresh = tmp_path / "fresh"
    ok(run(1, base_args(phase1_shards, fresh, no_dropout_model, bf16_ds, 1, optimizer="lamb", learning_rate=1e-30,
                        num_eval_samples=0, seed=7)))
    torch.manual_seed(7)
    init = BertForPreTraining(BertConfig.from_json_file(no_dropout_model)).state_dict()
    masters, source = read_weights(locate(fresh))
    assert "(bf16 optimizer)" in source
    assert _largest_difference(masters, init) < 1e-20
    rounded = {name: value.to(torch.bfloat16).float() for name, value in init.items()}
    assert _largest_difference(rounded, init) > 1e-5  # what the masters were before: the init rounded

    phase2 = tmp_path / "phase2"
    ok(run(1, base_args(phase1_shards, phase2, bf16_run / "model_config.json", bf16_ds, 1, optimizer="lamb",
                        learning_rate=1e-30, num_eval_samples=0, phase2=True, init_checkpoint=bf16_run)))
    phase1_masters, _ = read_weights(locate(bf16_run))
    phase2_masters, _ = read_weights(locate(phase2))
    assert _largest_difference(phase2_masters, phase1_masters) < 1e-20
    phase1_rounded = {name: value.to(torch.bfloat16).float() for name, value in phase1_masters.items()}
    assert _largest_difference(phase1_rounded, phase1_masters) > 1e-5


@pytest.mark.slow
def test_masters_that_do_not_round_to_the_module_weights_are_refused(bf16_run, tmp_path):
    from training.checkpoint import CheckpointError
    from training.weights import read_fp32_weights

    tag = tmp_path / "step00000016"
    shutil.copytree(bf16_run / "checkpoints" / "step00000016", tag)
    masters, source = read_fp32_weights(tag)
    assert source.startswith("fp32 master weights merged from 2 ZeRO partition(s) (bf16 optimizer)")
    states = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    name = "bert.encoder.layer.1.attention.output.dense.weight"
    assert torch.equal(masters[name].to(torch.bfloat16), states["module"][name])
    states["module"][name][3, 5] += 0.25  # as if the partitions were merged in the wrong order
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=rf"step00000016: the fp32 master weights of {name} do not round to "
                                              "the module weights of the same tag; the checkpoint is inconsistent"):
        read_fp32_weights(tag)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"overwritten")
    with pytest.raises(CheckpointError, match=r"step00000016: cannot read the checkpoint \(.*\); it is damaged"):
        read_fp32_weights(tag)


@pytest.mark.slow
def test_phase2_can_start_from_a_hugging_face_export(bf16_run, phase1_shards, tmp_path):
    """--init_checkpoint also takes a Hugging Face BERT directory: continued pretraining from it."""
    from scripts.export_hf import export

    hf = export(bf16_run, tmp_path / "hf").path
    out = tmp_path / "continued"
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    ok(run(1, base_args(phase1_shards, out, bf16_run / "model_config.json", ds, 2, learning_rate=1e-4,
                        phase2=True, init_checkpoint=hf)))
    info = json.loads((out / "run_info.json").read_text())
    assert info["init_checkpoint"] == f"{hf} (Hugging Face)" and info["start_step"] == 0
    # the trained weights, not a fresh model: the loss starts where phase 1 ended
    recs, phase1 = records(out), records(bf16_run)
    assert recs[1]["loss"] < phase1[1]["loss"] - 0.5
    assert abs(recs[1]["loss"] - phase1[16]["loss"]) < 0.5


@pytest.mark.slow
def test_truncated_checkpoint_fails_loudly(bf16_run, phase1_shards, no_dropout_model, bf16_ds, tmp_path):
    out = tmp_path / "corrupt"
    shutil.copytree(bf16_run, out)
    victim = out / "checkpoints" / "step00000016" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    before = (out / "metrics.jsonl").read_text()
    result = run(1, bf16_args(phase1_shards, out, no_dropout_model, bf16_ds))
    assert result.returncode == 1
    assert "corrupt" in result.stderr and str(victim) in result.stderr
    assert (out / "metrics.jsonl").read_text() == before
    assert read_latest(out / "checkpoints") == "step00000016"


# ----------------------------------------------------------------------------- fp32: exact resume

FP32_STEPS = 12


def fp32_run(model: Path, ds_dir: Path) -> Callable[[Path, Path], list[str]]:
    """The command line of the fp32 runs, args(shards, out): AdamW, FP32_STEPS steps, a checkpoint every 4."""
    ds = ds_config(ds_dir / "ds.json", bf16=False, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)

    def args(shards: Path, out: Path) -> list[str]:
        return base_args(shards, out, model, ds, FP32_STEPS, optimizer="adamw", learning_rate=1e-3,
                         warmup_proportion=0.2, num_steps_per_checkpoint=4, keep_checkpoints=5)
    return args


@pytest.fixture(scope="module")
def fp32_setup(tmp_path_factory, phase1_shards):
    tmp = tmp_path_factory.mktemp("fp32")
    args = fp32_run(write_json(tmp / "tiny.json", TINY), tmp)  # dropout on: its randomness must resume exactly too
    reference = tmp / "reference"
    ok(run(1, args(phase1_shards, reference)))
    return args, reference


def wait_for_step(out: Path, proc: subprocess.Popen, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        assert proc.poll() is None, f"run ended early: {proc.communicate()[1][-3000:]}"
        time.sleep(0.02)
    raise TimeoutError(f"no step {step} within {timeout} s")


def signalled(cmd_env: tuple[list[str], dict], out: Path, step: int, signum: int) -> subprocess.Popen:
    """A run started, sent `signum` once it has logged `step`; stderr is piped."""
    cmd, env = cmd_env
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, proc, step)
    proc.send_signal(signum)
    return proc


def losses(out: Path) -> list[float]:
    return [r["loss"] for _, r in sorted(records(out).items())]


@pytest.mark.slow
def test_sigkill_then_resume_gives_bitwise_equal_losses(fp32_setup, phase1_shards, tmp_path):
    args, reference = fp32_setup
    out = tmp_path / "killed"
    proc = signalled(command(1, args(phase1_shards, out)), out, 6, signal.SIGKILL)  # past the checkpoint at step 4
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert max(records(out)) < FP32_STEPS
    assert read_latest(out / "checkpoints") in ("step00000004", "step00000008")
    ok(run(1, args(phase1_shards, out)))
    info = json.loads((out / "run_info.json").read_text())
    assert info["start_step"] in (4, 8) and info["start_consumed_samples"] == info["start_step"] * 8
    assert len(losses(reference)) == FP32_STEPS
    assert losses(out) == losses(reference)  # bitwise: floats are written with repr
    # the steps logged after the checkpoint and before the kill were dropped, not logged twice
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, FP32_STEPS + 1))


@pytest.mark.slow
def test_a_rank_killed_by_a_fatal_signal_prints_its_python_stack(fp32_setup, phase1_shards, tmp_path):
    """A rank that aborts in C++ code (or segfaults in a kernel) says where its Python code was."""
    args, _ = fp32_setup
    out = tmp_path / "aborted"
    proc = signalled(command(1, args(phase1_shards, out)), out, 2, signal.SIGABRT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in stderr
    assert re.search(r'File ".*run_pretraining\.py", line \d+ in train', stderr), stderr[-3000:]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_0_and_resumes_exactly(fp32_setup, phase1_shards, tmp_path):
    args, reference = fp32_setup
    out = tmp_path / "terminated"
    proc = signalled(command(1, args(phase1_shards, out)), out, 5, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    # on a line of its own, not glued to the end of the progress bar's line
    assert any(line.startswith("stop requested (signal 15) at step ") for line in re.split(r"[\r\n]", stderr))
    stopped_at = max(records(out))
    assert 5 <= stopped_at < FP32_STEPS
    assert read_latest(out / "checkpoints") == f"step{stopped_at:08d}"
    ok(run(1, args(phase1_shards, out)))
    assert json.loads((out / "run_info.json").read_text())["start_step"] == stopped_at
    assert losses(out) == losses(reference)
    # run_info.json holds the latest start; starts.jsonl every start, with the DeepSpeed config each one used.
    starts = [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]
    assert [(s["start_step"], s["resumed_from"]) for s in starts] == [(0, None), (stopped_at, f"step{stopped_at:08d}")]
    given = json.loads((reference.parent / "ds.json").read_text())
    assert all({k: s["deepspeed_config"][k] for k in given} == given for s in starts)
    assert all(s["argv"][0].endswith("run_pretraining.py") and s["time"].endswith("+00:00") for s in starts)


@pytest.mark.slow
def test_steps_this_run_saves_exits_0_and_the_same_command_continues_exactly(fp32_setup, phase1_shards, tmp_path):
    """For jobs with a time limit: each run of the same command trains at most --steps_this_run steps, saves a
    checkpoint there (5 is not a multiple of --num_steps_per_checkpoint 4) and exits 0; the last one ends the
    phase with its evaluation. Together they log what one uninterrupted run logs."""
    args, reference = fp32_setup
    out = tmp_path / "in_pieces"
    for ends_at in (5, 10, FP32_STEPS):
        result = ok(run(1, [*args(phase1_shards, out), "--steps_this_run", "5"]))
        assert max(records(out)) == ends_at and read_latest(out / "checkpoints") == f"step{ends_at:08d}"
        if ends_at < FP32_STEPS:
            assert (f"--steps_this_run 5 done at step {ends_at} of {FP32_STEPS}: checkpoint step{ends_at:08d} is "
                    "saved; rerun the command to resume") in result.stderr
            assert "done: step" not in result.stderr and not (out / "eval.jsonl").read_text()
        else:
            assert f"done: step {FP32_STEPS} of {FP32_STEPS}" in result.stderr
    assert losses(out) == losses(reference)
    assert records(out, "eval.jsonl") == records(reference, "eval.jsonl")
    starts = [json.loads(line)["start_step"] for line in (out / "starts.jsonl").read_text().splitlines()]
    assert starts == [0, 5, 10]


@pytest.mark.slow
def test_overwritten_checkpoint_bytes_fail_loudly(fp32_setup, phase1_shards, tmp_path):
    args, reference = fp32_setup
    out = tmp_path / "garbled"
    shutil.copytree(reference, out)
    victim = out / "checkpoints" / "step00000012" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 3: len(data) // 3 + 4096] = b"\0" * 4096  # same size: only loading can tell
    victim.write_bytes(bytes(data))
    result = run(1, args(phase1_shards, out))
    assert result.returncode == 1
    assert "CRC-32 differs" in result.stderr and str(victim) in result.stderr


def file_size_limit(n: int):
    """A preexec_fn: writes past `n` bytes fail with EFBIG (Python ignores SIGXFSZ), as on a full disk."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))


@pytest.mark.slow
def test_a_full_disk_during_a_save_stops_with_one_line_and_the_rerun_resumes_exactly(fp32_setup, phase1_shards,
                                                                                     tmp_path):
    """torch.save reports a full disk as a RuntimeError without path or errno, which ended the run with a
    traceback and left the unfinished tag holding on to the space."""
    args, reference = fp32_setup
    out = tmp_path / "full"
    ok(run(1, [*args(phase1_shards, out), "--steps_this_run", "4"]))
    cmd, env = command(1, args(phase1_shards, out))
    # room for the model states (18 MB), not for the optimizer partition (53 MB)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            preexec_fn=file_size_limit(30 * 2**20))
    ckpt = out / "checkpoints"
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(f"error: rank 0 could not write checkpoint {ckpt / 'step00000008'} (")
    assert "free space there" in errors[0] and errors[0].endswith("rerun the same command: it resumes from step00000004")
    assert read_latest(ckpt) == "step00000004" and not (ckpt / "step00000008").exists()
    ok(run(1, args(phase1_shards, out)))
    assert json.loads((out / "run_info.json").read_text())["start_step"] == 4  # resumed, not started again
    assert losses(out) == losses(reference)
    assert records(out, "eval.jsonl") == records(reference, "eval.jsonl")


ONE_RANK_LIMITED = """import os, resource, runpy, sys
if os.environ["RANK"] == os.environ["LIMITED_RANK"]:
    n = int(os.environ["LIMITED_BYTES"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
sys.argv[0] = os.environ["SCRIPT"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_save_failing_on_one_rank_only_stops_every_rank_with_its_error(fp32_setup, phase1_shards, tmp_path):
    """Rank 1 cannot write its optimizer partition (27 MB) while rank 0 writes everything: every rank
    reports rank 1's error (before, rank 0 waited in DeepSpeed's barrier until gloo saw rank 1 gone and
    said only "Connection closed by peer"), and the unfinished tag goes."""
    args, _ = fp32_setup
    out = tmp_path / "rank1"
    cmd, env = command(2, args(phase1_shards, out))
    wrapper = tmp_path / "limited.py"
    wrapper.write_text(ONE_RANK_LIMITED)
    env |= {"LIMITED_RANK": "1", "LIMITED_BYTES": str(20 * 2**20), "SCRIPT": cmd[-len(args(phase1_shards, out)) - 1]}
    cmd[-len(args(phase1_shards, out)) - 1] = str(wrapper)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0
    ckpt = out / "checkpoints"
    errors = [line for line in result.stderr.splitlines()
              if line.startswith(f"error: rank 1 could not write checkpoint {ckpt / 'step00000004'} (")]
    # every rank raises it; torchrun may stop the slower one before it prints
    assert errors, result.stderr[-4000:]
    assert "Connection closed by peer" not in result.stderr
    assert all(line.endswith("it starts again, as there is no checkpoint yet") for line in errors)
    assert read_latest(ckpt) is None and not (ckpt / "step00000004").exists()


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


@pytest.mark.slow
def test_resume_refuses_what_would_not_continue_the_run(fp32_setup, phase1_shards, dynamic_shards, tmp_path):
    args, reference = fp32_setup
    out = tmp_path / "finished"
    shutil.copytree(reference, out)
    before = {name: (out / name).read_text() for name in ("metrics.jsonl", "eval.jsonl")}
    # The same command on a finished run: nothing to train, and no second final evaluation.
    ok(run(1, args(phase1_shards, out)))
    assert {name: (out / name).read_text() for name in before} == before
    result = run(1, with_flag(args(phase1_shards, out), "--optimizer", "lamb"))
    assert result.returncode == 1 and "trained with --optimizer adamw" in result.stderr
    fewer = tmp_path / "fewer_shards"
    shutil.copytree(phase1_shards / "hdf5", fewer)
    shutil.copy(phase1_shards / "vocab.txt", fewer)
    next((fewer / "training").glob("*_1.hdf5")).unlink()
    result = run(1, args(fewer, out))
    assert result.returncode == 1 and "consumed_samples would index another sample stream" in result.stderr
    # The same corpus made into shards without static masks: the same paths and sample counts (resumed in silence).
    result = run(1, args(dynamic_shards, out))
    assert result.returncode == 1
    assert ("trained on shards made with static masks, masked_lm_prob 0.15, whole_word_masking false, lower_case true; "
            f"the shards in --input_dir {dynamic_shards} have the same paths and sample counts but were made with "
            "dynamic masks") in result.stderr
    # Another vocab.txt beside the same shards: other dynamic masks, and the run's copy (the export's) replaced.
    revocab = tmp_path / "other_vocab"
    shutil.copytree(phase1_shards / "hdf5", revocab / "hdf5")
    tokens = (phase1_shards / "vocab.txt").read_text().splitlines()
    tokens[1000], tokens[1001] = tokens[1001], tokens[1000]
    (revocab / "vocab.txt").write_text("\n".join(tokens) + "\n")
    result = run(1, args(revocab, out))
    assert result.returncode == 1
    assert (f"{revocab / 'vocab.txt'} is not the vocabulary this run trained with ({out / 'vocab.txt'}, 30522 tokens, "
            f"against 30522): token id 1000 is {tokens[1001]!r} there, {tokens[1000]!r} here") in result.stderr
    assert (out / "vocab.txt").read_bytes() == (phase1_shards / "vocab.txt").read_bytes()
    relu = write_json(tmp_path / "relu.json", TINY | {"hidden_act": "relu"})
    result = run(1, with_flag(args(phase1_shards, out), "--config_file", str(relu)))
    assert result.returncode == 1
    assert "step00000012 was trained with another model config (hidden_act 'gelu' there, 'relu' in" in result.stderr
    bf16 = ds_config(tmp_path / "bf16.json", bf16=True, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    result = run(1, with_flag(args(phase1_shards, out), "--deepspeed_config", str(bf16)))
    assert result.returncode == 1 and "step00000012 was trained in fp32; this DeepSpeed JSON trains in bf16" in result.stderr
    assert json.loads((out / "model_config.json").read_text())["hidden_act"] == "gelu"  # not overwritten
    # DeepSpeed would take the checkpoint's gradient clipping over the JSON's without a word.
    clip = ds_config(tmp_path / "clip.json", bf16=False, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                     gradient_clipping=0.5)
    result = run(1, with_flag(args(phase1_shards, out), "--deepspeed_config", str(clip)))
    assert result.returncode == 1
    assert f'step00000012 was trained with "gradient_clipping": 1.0; --deepspeed_config {clip} gives 0.5' in result.stderr
    # Another --seed would change the data order, masks and dropout of the rest of the run.
    result = run(1, args(phase1_shards, out) + ["--seed", "7"])
    assert result.returncode == 1
    assert "step00000012 was trained with --seed 12439; resuming with --seed 7 would change the data order. " \
           "Pass --seed 12439" in result.stderr
    # A run state whose step disagrees with the checkpoint's lr schedule is inconsistent, not resumed from.
    edited = tmp_path / "inconsistent"
    shutil.copytree(reference, edited)
    run_state = edited / "checkpoints" / "step00000012" / "run_state.json"
    run_state.write_text(json.dumps(json.loads(run_state.read_text()) | {"step": 11}))
    result = run(1, args(phase1_shards, edited))
    assert result.returncode == 1
    assert "step00000012: lr schedule is at step 12 but the run state says 11; the checkpoint is inconsistent" \
        in result.stderr
    # A longer schedule is refused by the schedule, not reported as a corrupt checkpoint.
    result = run(1, with_flag(args(phase1_shards, out), "--max_steps", "16"))
    assert result.returncode == 1 and "corrupt" not in result.stderr
    assert "schedule: --max_steps 16 (the checkpoint's: 12). The checkpoint is fine" in result.stderr
    assert {name: (out / name).read_text() for name in before} == before
    assert read_latest(out / "checkpoints") == "step00000012"


@pytest.mark.slow
def test_a_run_killed_around_its_final_checkpoint_is_finished_by_the_rerun(fp32_setup, phase1_shards, tmp_path):
    """Killed after the final tag's run_state.json, before `latest` named it and before the final
    evaluation: the rerun commits the tag, trains nothing, evaluates once and clears the leftovers."""
    args, reference = fp32_setup
    out = tmp_path / "killed_at_the_end"
    shutil.copytree(reference, out)
    ckpt = out / "checkpoints"
    (ckpt / "latest").write_text("step00000008\n")
    (ckpt / "step00000012" / "commit_pending").touch()
    (ckpt / ".latest.4242.0123456789ab.tmp").write_text("step0000")
    (out / ".metrics.jsonl.4242.0123456789ab.tmp").write_text('{"step": 1')
    assert list(records(reference, "eval.jsonl")) == [FP32_STEPS]
    (out / "eval.jsonl").write_text("")
    result = ok(run(1, args(phase1_shards, out)))
    assert f"{ckpt / 'step00000012'} was saved whole but the run stopped before 'latest' named it" in result.stderr
    assert json.loads((out / "run_info.json").read_text())["start_step"] == FP32_STEPS
    assert read_latest(ckpt) == "step00000012" and not (ckpt / "step00000012" / "commit_pending").exists()
    assert (out / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()
    assert records(out, "eval.jsonl") == records(reference, "eval.jsonl")  # the same weights, evaluated again
    assert not list(out.rglob("*.tmp"))

    # Stopped by a signal in its last step: the final checkpoint is saved, the final evaluation is not.
    stopped = tmp_path / "stopped_in_the_last_step"
    shutil.copytree(reference, stopped)
    (stopped / "eval.jsonl").write_text("")
    ok(run(1, args(phase1_shards, stopped)))
    assert records(stopped, "eval.jsonl") == records(reference, "eval.jsonl")
    ok(run(1, args(phase1_shards, stopped)))  # and once only
    assert (stopped / "eval.jsonl").read_text() == (reference / "eval.jsonl").read_text()


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two_ranks(phase1_shards, no_dropout_model, tmp_path):
    """The other direction: rank 0 converts while rank 1 waits for it on the filesystem. Without dropout the
    1-rank and 2-rank steps differ only by rounding, so the losses after the resume show that rank 1 trained on
    from the converted weights, moments and sample: with dropout (masks differ with the rank) a resume that
    loaded nothing, or restarted the data at sample 0, was within the comparison's 10% (found by an audit)."""
    args = fp32_run(no_dropout_model, tmp_path)
    reference = tmp_path / "reference"
    ok(run(1, args(phase1_shards, reference)))
    out = tmp_path / "widened"
    shutil.copytree(reference, out)
    (out / "checkpoints" / "latest").write_text("step00000008\n")
    # The reference's JSON gives 2 ranks a global batch of 16 instead of 8: refused, nothing changed.
    result = run(2, args(phase1_shards, out))
    assert result.returncode != 0 and '"train_batch_size": 8' in result.stderr
    assert not (out / "checkpoints" / "step00000008_universal").exists()
    same_batch = ds_config(tmp_path / "same_batch.json", bf16=False, train_batch_size=8, train_micro_batch_size_per_gpu=4)
    ok(run(2, with_flag(args(phase1_shards, out), "--deepspeed_config", str(same_batch))))
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["resumed_world_size"] == 1 and info["gradient_accumulation_steps"] == 1
    universal = out / "checkpoints" / "step00000008_universal"
    assert (universal / "source_run_state.json").read_bytes() == \
        (out / "checkpoints" / "step00000008" / "run_state.json").read_bytes()
    # DeepSpeed's pointer names the copy, not the temporary directory it was converted into
    assert (out / "checkpoints" / "latest_universal").read_text() == universal.name
    ref, widened = records(reference), records(out)
    for step in range(9, FP32_STEPS + 1):
        assert widened[step]["consumed_samples"] == ref[step]["consumed_samples"] == step * 8
        # same samples, weights and moments, no dropout: only the reduction order differs
        assert widened[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-4), step


@pytest.mark.slow
def test_phase2_on_two_ranks_can_start_from_one_rank_phase1_moments(fp32_setup, phase1_shards, tmp_path):
    """Phase 1 on 1 rank (fp32, AdamW, ZeRO-1), phase 2 on 2 (ZeRO-2): each rank takes its slice of every
    moment, and AdamW's step count (a tensor) starts at 0."""
    _, reference = fp32_setup
    ds = write_json(tmp_path / "ds.json", {"gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                                            "steps_per_print": 10**6, "train_batch_size": 8,
                                            "train_micro_batch_size_per_gpu": 4})

    def args(out: Path, **extra) -> list[str]:
        return base_args(phase1_shards, out, reference / "model_config.json", ds, 1, optimizer="adamw",
                         learning_rate=1e-3, **extra)

    fresh, kept = phase2_with_and_without_moments(reference, 2, tmp_path, args)
    assert json.loads((kept / "run_info.json").read_text())["zero_stage"] == 2
    assert_moments_carried(reference, fresh, kept, tmp_path)


@pytest.mark.slow
def test_reference_format_shards_train_identically(fp32_setup, phase1_shards, tmp_path):
    args, reference = fp32_setup
    shards = tmp_path / "nvidia"
    shards.mkdir()
    for src in sorted((phase1_shards / "hdf5").rglob("*.hdf5")):
        to_reference_format(src, shards / src.name.replace("wikicorpus_en", "books_wiki_en_corpus"))
    out = tmp_path / "run"
    ok(run(1, args(shards, out)))
    assert losses(out) == losses(reference)  # same samples in the same order
    assert not (out / "vocab.txt").exists()


@pytest.mark.slow
def test_batch_sizes_that_do_not_divide_fail_clearly(phase1_shards, tmp_path):
    ds = ds_config(tmp_path / "ds.json", bf16=True, train_batch_size=12, train_micro_batch_size_per_gpu=4,
                   gradient_accumulation_steps=2)
    result = run(1, base_args(phase1_shards, tmp_path / "out", ROOT / "configs/models/bert-tiny.json", ds, 2))
    assert result.returncode == 1
    assert f"{ds}: train_batch_size 12 != 4 x 2 x 1" in result.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.slow
def test_evaluation_without_test_shards_is_refused_not_skipped(phase1_shards, tmp_path):
    shards = tmp_path / "training_only"
    shards.mkdir()
    for src in sorted((phase1_shards / "hdf5").rglob("*training*.hdf5")):
        shutil.copy(src, shards / src.name)
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_batch_size=4, train_micro_batch_size_per_gpu=4,
                   gradient_accumulation_steps=1)
    args = base_args(shards, tmp_path / "out", ROOT / "configs/models/bert-tiny.json", ds, 2)
    result = run(1, args)  # --num_eval_samples 32: evaluate at the end
    assert result.returncode == 1
    assert "--num_eval_samples 32 evaluates at the end of the run, but there are no test shards" in result.stderr
    assert "pass --num_eval_samples 0 to train without evaluation" in result.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.slow
def test_a_second_run_on_an_output_dir_in_use_is_refused(phase1_shards, tmp_path):
    """Two runs on one --output_dir (a job requeued while the first still runs) both trained and saved into the
    same checkpoints/ and metrics.jsonl, their timelines interleaved. A process holds the first run's lock."""
    out = tmp_path / "out"
    out.mkdir()
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_micro_batch_size_per_gpu=4)
    with lock_held_elsewhere(out / ".run.lock", "host h pid 1\n"):
        result = run(1, base_args(phase1_shards, out, ROOT / "configs/models/bert-tiny.json", ds, 1))
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"error: --output_dir {out} is in use by another run (host h pid 1, holding {out / '.run.lock'})" \
        in result.stderr
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    ok(run(1, base_args(phase1_shards, out, ROOT / "configs/models/bert-tiny.json", ds, 1)))  # once it is free


# train() twice in one process, as a notebook or a job wrapper would call it.
TRAIN_TWICE = """import sys
import run_pretraining
args = run_pretraining.parse_args(sys.argv[1:])
for attempt in (1, 2):
    try:
        run_pretraining.train(args)
    except run_pretraining.USER_ERRORS as e:
        print(f"attempt {attempt}: {type(e).__name__}: {e}")
"""


def test_a_run_that_fails_after_taking_the_lock_releases_it(phase1_shards, tmp_path):
    """An error after the output directory's lock was taken (here an --init_checkpoint that is not a checkpoint)
    left the lock held by the process, so a second train() in it was refused as "in use by another run"."""
    out = tmp_path / "out"
    damaged = tmp_path / "ckpt_100.pt"
    damaged.write_bytes(b"not a checkpoint")
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_micro_batch_size_per_gpu=4)
    args = base_args(phase1_shards, out, ROOT / "configs/models/bert-tiny.json", ds, 1, phase2=True,
                     init_checkpoint=damaged)
    cmd, env = command(1, args)
    result = subprocess.run([sys.executable, "-c", TRAIN_TWICE, *cmd[2:]], env=env, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("attempt ")]
    assert first.startswith("CheckpointError: ") and str(damaged) in first
    assert second == first


@pytest.mark.slow
def test_diverged_run_drops_nonfinite_batches_and_stops_clearly(fp32_setup, phase1_shards, tmp_path):
    args, _ = fp32_setup
    out = tmp_path / "diverged"
    cli = args(phase1_shards, out)
    cli[cli.index("--learning_rate") + 1] = "1e30"  # the first update overflows the weights
    result = run(1, cli + ["--max_nonfinite_steps", "3", "--num_steps_per_checkpoint", "100"])
    assert result.returncode == 1
    assert "error: 3 micro batches in a row had a non-finite loss at step 1 (3 in total)" in result.stderr
    recs = records(out)
    assert list(recs) == [1] and recs[1]["skipped_batches"] == 0
    assert not (out / "checkpoints").exists()  # nothing diverged is saved


# ----------------------------------------------------------------------------- non-finite gradients

OVERFLOW_BATCH = 4  # train_batch_size of the runs below: each optimizer step reads 4 stream positions
OVERFLOW_SEED = 7


def labels_per_step(shards: Path, steps: int) -> list[tuple[set[int], set[int]]]:
    """(masked-LM labels, input ids) of each of the first `steps` windows of OVERFLOW_BATCH stream
    positions, in the order a run with --seed OVERFLOW_SEED reads them."""
    from training.loader import open_split

    dataset = open_split(shards, "training", 128, 20, TINY["vocab_size"], OVERFLOW_SEED, shuffle=True)
    windows = []
    for k in range(steps):
        samples = [dataset[i] for i in range(k * OVERFLOW_BATCH, (k + 1) * OVERFLOW_BATCH)]
        labels = {int(t) for s in samples for t in s["masked_lm_labels"] if t > 0}
        windows.append((labels, {int(t) for s in samples for t in s["input_ids"]}))
    return windows


def overflow_on_label(directory: Path, token: int) -> Path:
    """A Hugging Face BERT (tiny) whose loss is finite on every batch and whose gradients overflow
    exactly in the steps where `token` is a masked-LM label.

    The MLM transform's dense layer is zero, so its LayerNorm sees a constant input and outputs its
    bias (1, -1, 0, ...), orthogonal to `token`'s embedding row (1e12, 1e12, 0, ...), which the decoder
    shares; a decoder bias of -1e4 keeps `token`'s probability at 0. A `token` label sends that row
    back through the LayerNorm (gain 1e6, 1/sigma = 1e6 at a constant input): gradients near 1e22,
    whose squared norm overflows. Other labels give gradients below 1e12. Trained at a learning rate
    of 1e-40, the weights stay as they are."""
    from modeling import save_hf

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**TINY))
    with torch.no_grad():
        head = model.cls.predictions
        head.transform.dense.weight.zero_()
        head.transform.dense.bias.zero_()
        head.transform.LayerNorm.weight.fill_(1e6)
        head.transform.LayerNorm.bias.zero_()
        head.transform.LayerNorm.bias[:2] = torch.tensor([1.0, -1.0])
        row = model.bert.embeddings.word_embeddings.weight[token]
        row.zero_()
        row[:2] = 1e12
        head.bias[token] = -1e4
    save_hf(model, directory)
    return directory


def overflow_args(shards: Path, out: Path, init: Path, ds: Path, steps: int, **extra) -> list[str]:
    return base_args(shards, out, ROOT / "configs/models/bert-tiny.json", ds, steps, learning_rate=1e-40,
                     num_eval_samples=0, phase2=True, init_checkpoint=init, seed=OVERFLOW_SEED, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, bf16", [(1, False), (2, True)], ids=["fp32-1rank", "bf16-2ranks"])
def test_a_step_with_nonfinite_gradients_is_skipped_and_taken_again(phase1_shards, tmp_path, ranks, bf16):
    """DeepSpeed skips an update whose gradient norm is not finite, and leaves the lr schedule where it
    was. The run takes that step again on the next window, keeps the schedule, counts the skip and
    stays resumable (a skip counted as a step made every later checkpoint fail the schedule check)."""
    windows = labels_per_step(phase1_shards, 5)
    # a label of the second window only, and no input elsewhere: steps 1, 2, 3, 4 read windows 0, 2, 3, 4
    token = next(t for t in sorted(windows[1][0]) if t > 999 and all(
        t not in labels and t not in inputs for k, (labels, inputs) in enumerate(windows) if k != 1))
    init = overflow_on_label(tmp_path / "init", token)
    ds = ds_config(tmp_path / "ds.json", bf16=bf16, train_batch_size=OVERFLOW_BATCH,
                   train_micro_batch_size_per_gpu=2)
    out = tmp_path / "run"
    cli = overflow_args(phase1_shards, out, init, ds, 4, num_steps_per_checkpoint=2)
    result = ok(run(ranks, cli))
    assert ("step 2: the gradient norm is not finite, so DeepSpeed skipped the update on every rank; the next 4 "
            "samples take the step again (1 in a row, 1 in total)") in result.stdout
    recs = records(out)
    assert [recs[s]["consumed_samples"] for s in (1, 2, 3, 4)] == [4, 12, 16, 20]
    assert [recs[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert all(math.isfinite(recs[s]["grad_norm"]) for s in (1, 2, 3, 4))
    # the schedule's values for steps 1-4 (warm-up of 1 step, then linear decay), not step 2's lr again
    assert [recs[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([1e-40, 1e-40, 2e-40 / 3, 1e-40 / 3],
                                                                  rel=1e-9, abs=0)
    state = json.loads((out / "checkpoints" / "step00000004" / "run_state.json").read_text())
    assert (state["consumed_samples"], state["skipped_steps"]) == (20, 1)
    rerun = ok(run(ranks, cli))  # loads the final checkpoint, schedule check included
    assert "done: step 4 of 4" in rerun.stderr
    # Resumed from step 2, past the skip: the stream continues at its 12th sample, not at 2 steps' 8.
    (out / "checkpoints" / "latest").write_text("step00000002")
    ok(run(ranks, cli))
    again = records(out)
    assert [again[s]["consumed_samples"] for s in (3, 4)] == [16, 20]
    assert [again[s]["loss"] for s in (3, 4)] == [recs[s]["loss"] for s in (3, 4)]


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_drops_that_micro_batch_on_every_rank(phase1_shards, tmp_path):
    """2 ranks, a micro batch of 2 each: the MLM loss is infinite where one token is a label (its output bias
    is -inf), which one sample holds, so the loss is non-finite on the one rank that reads it. Both ranks drop
    their micro batch of that micro step and take the next (each rank deciding alone, the ranks fall out of
    step in their collectives)."""
    from modeling import save_hf
    from training.loader import open_split

    steps = 4
    dataset = open_split(phase1_shards, "training", 128, 20, TINY["vocab_size"], OVERFLOW_SEED, shuffle=True)
    labels = [{int(t) for t in dataset[i]["masked_lm_labels"] if t > 0} for i in range((steps + 2) * OVERFLOW_BATCH)]
    # a label of one sample of the first two steps only, among every sample the run may read
    position, token = next((i, t) for i in range(2 * OVERFLOW_BATCH) for t in sorted(labels[i])
                           if sum(t in sample for sample in labels) == 1)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**TINY))
    with torch.no_grad():
        model.cls.predictions.bias[token] = float("-inf")
    init = save_hf(model, tmp_path / "init")
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_batch_size=OVERFLOW_BATCH,
                   train_micro_batch_size_per_gpu=2)
    out = tmp_path / "run"
    cli = overflow_args(phase1_shards, out, init, ds, steps, optimizer="adamw")
    ok(run(2, cli, timeout=180))
    recs = records(out)
    dropped = position // OVERFLOW_BATCH + 1  # the step whose window holds the sample
    assert [recs[s]["skipped_batches"] for s in range(1, steps + 1)] == [int(s >= dropped)
                                                                        for s in range(1, steps + 1)]
    assert [recs[s]["consumed_samples"] for s in range(1, steps + 1)] == [
        OVERFLOW_BATCH * (s + (s >= dropped)) for s in range(1, steps + 1)]
    assert all(math.isfinite(recs[s]["loss"]) for s in range(1, steps + 1))


@pytest.mark.slow
def test_steps_with_nonfinite_gradients_in_a_row_stop_the_run(phase1_shards, tmp_path):
    windows = labels_per_step(phase1_shards, 3)
    token = next(t for t in sorted(windows[0][0]) if t > 999 and all(t in labels for labels, _ in windows))
    init = overflow_on_label(tmp_path / "init", token)
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_batch_size=OVERFLOW_BATCH,
                   train_micro_batch_size_per_gpu=4)
    out = tmp_path / "run"
    result = run(1, overflow_args(phase1_shards, out, init, ds, 4, max_nonfinite_steps=3))
    assert result.returncode == 1
    assert ("error: 3 optimizer steps in a row had non-finite gradients after step 0 (3 in total); DeepSpeed "
            "skipped their updates and the run has diverged") in result.stderr
    assert records(out) == {} and not (out / "checkpoints").exists()


IN_PROCESS_MAIN = "import sys, run_pretraining; sys.exit(run_pretraining.main(sys.argv[1:]))"


@pytest.mark.slow
def test_a_program_calling_main_itself_exits_after_a_dataloader_workers_error(phase1_shards, tmp_path):
    """The command exits past its DataLoader workers (run_pretraining.script); a program of the user's own that
    calls main() did not: after a shard error from a worker, main returned 1 and the interpreter then waited
    at exit for workers that were never told to stop (they ignore SIGTERM). torch raises a worker's error from
    a frame that holds it, so the loader lived in a reference cycle until the cycle collector closed its
    queues first (training.loader.batches_of)."""
    shards = tmp_path / "reference"  # without our attributes: the vocabulary is checked as rows are read
    shards.mkdir()
    for src in sorted((phase1_shards / "hdf5").rglob("*.hdf5")):
        to_reference_format(src, shards / src.name)
    model = write_json(tmp_path / "small_vocab.json", TINY | {"vocab_size": 2000})
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_batch_size=4, train_micro_batch_size_per_gpu=4,
                   gradient_accumulation_steps=1)
    args = with_flag(base_args(shards, tmp_path / "out", model, ds, 4), "--num_workers", "2")
    _, env = command(1, args)
    proc = subprocess.Popen([sys.executable, "-c", IN_PROCESS_MAIN, *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers too: they ignore SIGTERM
        pytest.fail(f"the process did not exit in 120 s; its stderr ends:\n{proc.communicate()[1][-3000:]}")
    assert proc.returncode == 1, err[-3000:]
    assert re.search(r"^error: \S+\.hdf5: row \d+ holds token id \d+, outside the model's vocab_size 2000; ", err,
                     re.MULTILINE), err[-3000:]


def shards_with_a_bad_row(phase1_shards: Path, out: Path, args: list[str], split: str, position: int) -> str:
    """Reference-format copies of the shards (the vocabulary is checked as rows are read) where the row at
    `position` of the split's stream, as the run given by `args` orders it, holds token id 40000; returns
    the message the loader raises for it."""
    import run_pretraining

    out.mkdir()
    for src in sorted((phase1_shards / "hdf5").rglob("*.hdf5")):
        to_reference_format(src, out / src.name)
    parsed = run_pretraining.parse_args(args)
    train_set, eval_set = run_pretraining.open_data(parsed, TINY["vocab_size"])
    dataset = train_set if split == "training" else eval_set
    shard, row = dataset.locate(position)
    path = dataset.shards[shard].path
    with h5py.File(path, "r+") as f:
        ids = f["input_ids"][row]
        ids[1] = 40000
        f["input_ids"][row] = ids
    return f"{path}: row {row} holds token id 40000, outside the model's vocab_size "


def without_a_launcher(nproc: int, args: list[str], logs: Path) -> list[subprocess.CompletedProcess]:
    """The ranks as plain processes: no launcher stops the others when one fails, so each rank's own exit
    and stderr show (each rank's stderr goes to a file in `logs`: a full pipe would block it)."""
    cmd, env = command(1, args)
    logs.mkdir()
    procs = []
    for r in range(nproc):
        with open(logs / f"rank{r}.err", "w") as err:
            procs.append(subprocess.Popen(
                cmd, env=env | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1"},
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err))
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [subprocess.CompletedProcess(p.args, code, None, (logs / f"rank{r}.err").read_text())
            for r, (p, code) in enumerate(zip(procs, codes))]


@pytest.mark.slow
@pytest.mark.parametrize("split, position", [
    ("training", 4),  # rank 1's first micro batch (micro batch 4, 2 ranks), read before any all-reduce
    ("training", 4 + 2 * 8),  # rank 1's in the third step, read ahead at the second's all-reduce
    ("test", 4),  # rank 1's first evaluation batch
])
def test_a_bad_row_on_one_rank_stops_every_rank_with_its_error(phase1_shards, tmp_path, split, position):
    """Raised on the rank that read the row alone, the error ended that rank, and the other failed in its next
    collective with torch's "... typically caused by a remote worker crashing" once gloo saw the peer gone (a
    transport that does not notice would wait for the process group's timeout). Every rank now raises the
    error (run_pretraining.MicroBatches)."""
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_batch_size=8, train_micro_batch_size_per_gpu=4,
                   gradient_accumulation_steps=1)
    model = write_json(tmp_path / "tiny.json", TINY)
    args = base_args(tmp_path / "shards", tmp_path / "out", model, ds, 4)
    message = shards_with_a_bad_row(phase1_shards, tmp_path / "shards", args, split, position)
    for rank, result in enumerate(without_a_launcher(2, args, tmp_path / "logs")):
        assert result.returncode == 1, (rank, result.stderr[-3000:])
        assert f"error: {message}" in result.stderr, (rank, result.stderr[-3000:])
        assert "remote worker" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("steps, code", [(2, 0), (3, 1)])
def test_a_bad_row_read_ahead_past_the_last_step_fails_nothing(phase1_shards, tmp_path, steps, code):
    """The batch after the last step is read ahead (MicroBatches) but never taken: a bad row there does not
    fail a finished run; one step more takes it."""
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_batch_size=4, train_micro_batch_size_per_gpu=4,
                   gradient_accumulation_steps=1)
    model = write_json(tmp_path / "tiny.json", TINY)
    args = with_flag(base_args(tmp_path / "shards", tmp_path / "out", model, ds, steps), "--num_eval_samples", "0")
    message = shards_with_a_bad_row(phase1_shards, tmp_path / "shards", args, "training", 8)  # step 3's
    result = run(1, args)
    assert result.returncode == code, result.stderr[-3000:]
    assert (f"error: {message}" in result.stderr) == (code == 1), result.stderr[-3000:]
    assert len(records(tmp_path / "out")) == 2
