"""The capacity planner against the real model, DeepSpeed's estimator and measured CPU memory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from modeling import ActivationCheckpointing, BertConfig, BertForPreTraining
from training import planner

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["bert-tiny", "bert-base", "bert-large", "bert-1.5b", "bert-5b"]


def _config(name: str) -> BertConfig:
    return BertConfig.from_json_file(ROOT / "configs" / "models" / f"{name}.json")


@pytest.mark.parametrize("name", MODELS)
def test_closed_form_parameter_count_equals_the_built_model(name):
    config = _config(name)
    assert planner.parameter_count_formula(config) == planner.count_parameters_exact(config)


def test_parameter_counts_of_the_shipped_configs():
    # BERT-Large's well-known 335M (HF's 336.2M counts the untied decoder bias and the 30522 vocab).
    assert planner.count_parameters_exact(_config("bert-large")) == 336_232_258
    assert planner.count_parameters_exact(_config("bert-1.5b")) == 1_530_388_930


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_model_states_equal_deepspeeds_zero2_estimate(nodes, capsys):
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    params = planner.count_parameters_exact(_config("bert-1.5b"))
    devices = 8 * nodes
    weights, grads, optimizer = planner.model_state_bytes(params, "bf16", zero_stage=2, devices=devices)
    _, ds_gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=8, num_nodes=nodes,
                                                      cpu_offload=False)
    assert abs((weights + grads + optimizer) - ds_gpu) <= 3 * devices  # per-term rounding up of the shares

    estimate_zero2_model_states_mem_needs_all_cold(params, num_gpus_per_node=8, num_nodes=nodes)
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if "offload_optimizer=none" in line)
    printed_gb = float(re.findall(r"([0-9.]+)GB", row)[1])  # columns: per CPU, per GPU
    assert (weights + grads + optimizer) / 2**30 == pytest.approx(printed_gb, abs=0.01)


def test_zero_stages_partition_what_they_should():
    p = 1_000_000
    assert planner.model_state_bytes(p, "bf16", 0, 8) == (2 * p, 2 * p, 16 * p)
    # bf16 ZeRO-1 is BF16_Optimizer: bf16 gradients + an unpartitioned fp32 gradient buffer; 12 bytes partitioned
    assert planner.model_state_bytes(p, "bf16", 1, 8) == (2 * p, 6 * p, 12 * p // 8)
    assert planner.model_state_bytes(p, "bf16", 2, 8) == (2 * p, p // 4, 2 * p)
    assert planner.model_state_bytes(p, "bf16", 3, 8) == (p // 4, p // 4, 2 * p)
    assert planner.model_state_bytes(p, "fp32", 0, 4) == (4 * p, 4 * p, 8 * p)  # plain PyTorch Adam
    assert planner.model_state_bytes(p, "fp32", 1, 4) == (4 * p, 4 * p, 4 * p)  # + DeepSpeed's fp32 partitions
    with pytest.raises(ValueError, match="zero_stage"):
        planner.model_state_bytes(p, "bf16", 4, 8)


@pytest.mark.parametrize("name", MODELS)
def test_decay_group_count_equals_the_optimizer_groups(name):
    from training.lamb import build_param_groups

    config = _config(name)
    with torch.device("meta"):
        decay, no_decay = build_param_groups(BertForPreTraining(config), 0.01)
    assert planner.decay_parameter_count(config) == sum(p.numel() for p in decay["params"])
    assert sum(p.numel() for p in no_decay["params"]) == planner.parameter_count_formula(config) - \
        planner.decay_parameter_count(config)


def test_bf16_allreduce_buckets_follow_deepspeeds_engine():
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    assert planner.BF16_ALLREDUCE_BUCKET_ELEMENTS == MEMORY_OPT_ALLREDUCE_SIZE
    # Below the bucket size both groups' buffers share one bucket: concatenated (fp32) and cast to bf16.
    large = _config("bert-large")
    large_params = planner.parameter_count_formula(large)
    assert planner.bf16_allreduce_bytes(large, large_params) == 6 * large_params
    # BERT-1.5B's weight-decay buffer fills a bucket alone: no copy, only its bf16 cast.
    big = _config("bert-1.5b")
    assert planner.bf16_allreduce_bytes(big, planner.parameter_count_formula(big)) == \
        2 * planner.decay_parameter_count(big)


BF16_ZERO1_RANKS = 2
BF16_ZERO1_BATCH, BF16_ZERO1_SEQ = 2, 128


def _bf16_zero1_worker(out_dir: str) -> None:
    """One rank of a real DeepSpeed engine as run_pretraining.py builds it (configs/deepspeed/zero1-bf16.json,
    training.lamb.Lamb bound to the engine) on bert-tiny, 2 micro batches per step: writes the bytes it holds."""
    import deepspeed
    import torch.distributed as dist

    from training.lamb import Lamb, bind_to_deepspeed, build_param_groups

    deepspeed.init_distributed(dist_backend="gloo")
    config = _config("bert-tiny")
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    ds_config = json.loads((ROOT / "configs/deepspeed/zero1-bf16.json").read_text())
    ds_config.update(train_micro_batch_size_per_gpu=BF16_ZERO1_BATCH, gradient_accumulation_steps=2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=Lamb(build_param_groups(model, 0.01), lr=1e-3),
                                      config=ds_config)
    bind_to_deepspeed(engine)
    data = _batch(config, BF16_ZERO1_BATCH, BF16_ZERO1_SEQ, planner.default_max_predictions(BF16_ZERO1_SEQ))

    def storage_bytes(tensors) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    lp_grads = []

    def step() -> None:
        for _ in range(2):
            engine.backward(engine(**data).loss)
            # between the micro batches of a step too: the bf16 gradients are zeroed, not freed
            lp_grads.append(storage_bytes(p.grad for p in model.parameters() if p.grad is not None))
            engine.step()

    step()  # creates the optimizer states
    wrapper = engine.optimizer
    fp32_grad_buffer = storage_bytes(wrapper.fp32_groups_gradients_flat)
    master = storage_bytes(wrapper.fp32_groups_flat_partition)
    moments = storage_bytes(t for state in wrapper.optimizer.state.values() for t in state.values()
                            if torch.is_tensor(t) and t.dim() > 0)
    weights = storage_bytes(model.parameters())
    above = planner.profile_peak_bytes(step)  # from a step's start, when the bf16 gradients were freed
    result = {"wrapper": type(wrapper).__name__, "parameters": sum(p.numel() for p in model.parameters()),
              "weights": weights, "bf16_grads": lp_grads, "fp32_grad_buffer": fp32_grad_buffer,
              "master": master, "moments": moments, "peak": weights + fp32_grad_buffer + master + moments + above}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


def test_bf16_zero1_memory_matches_a_real_deepspeed_engine(tmp_path: Path):
    from training.accelerator import free_port

    port, procs = str(free_port()), []
    for rank in range(BF16_ZERO1_RANKS):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(BF16_ZERO1_RANKS),
                   LOCAL_WORLD_SIZE=str(BF16_ZERO1_RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen([sys.executable, __file__, str(tmp_path)], env=env, cwd=ROOT, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        try:
            proc.wait(timeout=400)
        finally:
            proc.kill()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (tmp_path / f"rank{rank}.log").read_text()[-4000:]
    config = _config("bert-tiny")
    for rank in range(BF16_ZERO1_RANKS):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        params = real["parameters"]
        assert real["wrapper"] == "BF16_Optimizer" and params == planner.count_parameters_exact(config)
        plan = planner.plan_memory(config, device=CPU, devices=BF16_ZERO1_RANKS, zero_stage=1,
                                   micro_batch=BF16_ZERO1_BATCH, seq_len=BF16_ZERO1_SEQ, precision="bf16")
        # Per component, within DeepSpeed's alignment padding of the flat buffers.
        assert plan.weights == pytest.approx(real["weights"], rel=1e-3)
        assert real["bf16_grads"] == [2 * params] * 4
        assert plan.gradients == pytest.approx(real["bf16_grads"][0] + real["fp32_grad_buffer"], rel=1e-3)
        assert real["fp32_grad_buffer"] == pytest.approx(4 * params, rel=1e-3)  # the whole model on each rank
        assert plan.optimizer_states == pytest.approx(real["master"] + real["moments"], rel=1e-3)
        # Here the end-of-backward all-reduce sets the peak: both groups' buffers concatenated and cast to bf16.
        assert plan.peak == pytest.approx(real["peak"], rel=0.05)


def _batch(config: BertConfig, batch: int, seq: int, predictions: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    positions = torch.sort(torch.randperm(seq - 1, generator=g)[:predictions] + 1).values.repeat(batch, 1)
    return dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids),
                masked_lm_positions=positions,
                masked_lm_labels=torch.randint(0, config.vocab_size, (batch, predictions), generator=g),
                next_sentence_labels=torch.randint(0, 2, (batch,), generator=g))


def _measure_step(config, batch, seq, checkpointing, dtype):
    """(bytes of weights + optimizer states, peak bytes allocated above them during a training step)."""
    torch.manual_seed(0)
    model = BertForPreTraining(config, ActivationCheckpointing(enabled=checkpointing)).to(dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # fused: no foreach temporaries
    data = _batch(config, batch, seq, planner.default_max_predictions(seq))

    def step():
        model(**data).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # creates the optimizer states
    states = sum(p.untyped_storage().nbytes() for p in model.parameters())
    states += sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t))
    return states, planner.profile_peak_bytes(step)


CPU = planner.DEVICES["cpu"]


def config_params(config: BertConfig):
    with torch.device("meta"):
        return BertForPreTraining(config).parameters()


@pytest.mark.parametrize(("name", "layers", "batch", "seq", "checkpointing"), [
    ("bert-tiny", None, 8, 128, False), ("bert-tiny", None, 8, 128, True), ("bert-tiny", None, 32, 128, True),
    # base at 8 without checkpointing peaks at the start of backward (activations); with it, at the
    # end of backward (gradients), already at batch 2.
    ("bert-base", None, 8, 128, False), ("bert-base", None, 2, 128, True),
    # seq 512 with checkpointing peaks while the first layer is recomputed
    ("bert-base", 2, 2, 512, True),
])
def test_peak_memory_matches_cpu_measurement_fp32(name, layers, batch, seq, checkpointing):
    config = _config(name)
    if layers:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    states, above = _measure_step(config, batch, seq, checkpointing, torch.float32)
    plan = planner.plan_memory(config, device=CPU, zero_stage=0, micro_batch=batch, seq_len=seq,
                               precision="fp32", checkpoint_activations=checkpointing, bucket_elements=0)
    # The planner's fp32 states (4 B weights + 8 B Adam moments) are what torch holds, but for
    # AdamW's 4-byte step counter per tensor.
    assert states - (plan.weights + plan.optimizer_states) == 4 * len(list(config_params(config)))
    assert plan.peak == pytest.approx(states + above, rel=0.15)
    # Tighter, and on the part that depends on the formulas: everything above the states.
    assert plan.peak - states == pytest.approx(above, rel=0.15)


def test_activation_memory_in_bf16_matches_cpu_measurement():
    # torch's AdamW keeps bf16 moments for bf16 weights (DeepSpeed keeps fp32): compare above the states.
    config = _config("bert-tiny")
    states, above = _measure_step(config, 16, 128, False, torch.bfloat16)
    plan = planner.plan_memory(config, device=CPU, zero_stage=0, micro_batch=16, seq_len=128,
                               precision="bf16", checkpoint_activations=False, bucket_elements=0)
    assert plan.peak - plan.weights - plan.optimizer_states == pytest.approx(above, rel=0.15)


def _saved_bytes(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward, weights excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(saved.values())


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("attention", ["composed", "fused"])
def test_saved_activation_bytes_equal_what_autograd_saves(precision, dtype, attention):
    # base width with 2 layers: the count is per layer, plus embeddings and heads. Without attention
    # dropout, PyTorch's CPU SDPA runs its fused (flash) kernel, which checks the "fused" accounting
    # that Gaudi and NVIDIA devices use; with it, modeling.py's composed CPU path.
    config = dataclasses.replace(_config("bert-base"), num_hidden_layers=2)
    if attention == "fused":
        config = dataclasses.replace(config, attention_probs_dropout_prob=0.0)
    batch, seq = 2, 128
    predictions = planner.default_max_predictions(seq)
    model = BertForPreTraining(config).to(dtype).train()
    measured = _saved_bytes(model, _batch(config, batch, seq, predictions))
    device = dataclasses.replace(CPU, attention=attention)
    planned = planner.activation_bytes(config, batch, seq, predictions, precision, device, False).saved
    assert planned == pytest.approx(measured, rel=0.05)


def test_checkpointing_shrinks_activations_and_raises_the_largest_batch():
    config = _config("bert-large")
    gaudi = planner.get_device("gaudi")
    kwargs = dict(device=gaudi, devices=8, zero_stage=1, seq_len=128, precision="bf16")
    off = planner.plan_memory(config, micro_batch=64, **kwargs)
    on = planner.plan_memory(config, micro_batch=64, checkpoint_activations=True, **kwargs)
    assert on.activations < off.activations / 5
    assert on.activations_without_checkpointing == off.activations
    usable = 30 * 2**30
    best_off = planner.largest_micro_batch(config, usable, **kwargs)
    best_on = planner.largest_micro_batch(config, usable, checkpoint_activations=True, **kwargs)
    assert best_on > best_off > 0
    assert planner.plan_memory(config, micro_batch=best_off, **kwargs).peak <= usable
    assert planner.plan_memory(config, micro_batch=best_off + 1, **kwargs).peak > usable


def test_flops_per_sequence_of_bert_large():
    config = _config("bert-large")
    h, i, s, L = 1024, 4096, 128, 24
    forward = L * (2 * s * (4 * h * h + 2 * h * i) + 4 * s * s * h) + 2 * 20 * (h * h + h * 30528) + 2 * (h * h + 2 * h)
    assert planner.forward_flops_per_sequence(config, 128, 20) == forward
    assert planner.training_flops_per_sequence(config, 128, 20) == 3 * forward
    # the classic 6 * parameters * tokens estimate, within the embedding and head differences
    assert planner.training_flops_per_sequence(config, 128, 20) == pytest.approx(6 * 303e6 * 128, rel=0.1)


@pytest.mark.parametrize("name, seq, predictions, recompute", [
    ("bert-tiny", 128, 20, False), ("bert-tiny", 512, 80, True), ("bert-large", 128, 20, False),
    ("bert-large", 512, 80, False), ("bert-large", 128, 20, True), ("bert-1.5b", 128, 20, False),
])
def test_training_flops_equal_what_torchs_flop_counter_counts(name, seq, predictions, recompute):
    """One forward + backward of the real model (on the meta device: shapes only) under FlopCounterMode counts
    exactly the formula's FLOPs: the matmuls of both passes, the MLM head on the predictions' slots only, pooler
    and NSP, and with checkpointing the encoder forward once more."""
    from torch.utils.flop_counter import FlopCounterMode

    config, batch = _config(name), 2
    with torch.device("meta"):
        model = BertForPreTraining(config, ActivationCheckpointing(enabled=recompute))
        ids = torch.zeros(batch, seq, dtype=torch.long)
        positions = torch.arange(1, predictions + 1).expand(batch, -1)
        inputs = (ids, torch.zeros_like(ids), torch.ones_like(ids), positions, torch.ones_like(positions),
                  torch.zeros(batch, dtype=torch.long))
    counter = FlopCounterMode(display=False)
    with counter:
        model(*inputs).loss.backward()
    assert counter.get_total_flops() == batch * planner.training_flops_per_sequence(config, seq, predictions, recompute)


def test_time_and_mfu_are_consistent():
    config = _config("bert-1.5b")
    flops = planner.training_flops_per_sequence(config, 128, 20)
    seconds = planner.training_seconds(10**8, flops, devices=128, peak_tflops=60.0, mfu=0.4)
    per_device_rate = 10**8 / seconds / 128
    assert planner.implied_mfu(per_device_rate, flops, 60.0) == pytest.approx(0.4)
    # 1e8 sequences x 1153.7 GFLOP / (128 x 60 TFLOP/s x 0.4) = 37,556 s, about 10.4 hours
    assert seconds == pytest.approx(37_556, rel=1e-3)
    with pytest.raises(ValueError, match="mfu"):
        planner.training_seconds(1, flops, devices=1, peak_tflops=60.0, mfu=1.5)
    # MFU 1 (the peak itself) is a valid bound
    assert planner.training_seconds(10**8, flops, devices=128, peak_tflops=60.0, mfu=1.0) == \
        pytest.approx(seconds * 0.4)


def test_device_table():
    assert planner.device_peak_tflops("gaudi2", "bf16") == 432.0
    assert planner.device_peak_tflops("H100", "bfloat16") == 989.0
    assert planner.device_peak_tflops("gaudi", "fp32") is None
    assert planner.device_peak_tflops("cuda", "bf16") is None
    assert {"gaudi", "gaudi2", "gaudi3", "a100", "h100", "h200"} <= set(planner.DEVICES)
    # The datasheet figures (dense, no sparsity) and memory, as the comments above DEVICES cite them.
    table = {name: (d.memory_bytes, d.peak_tflops) for name, d in planner.DEVICES.items() if name != "cpu"}
    assert table == {
        "gaudi": (32 * 10**9, {"bf16": 60.0}), "gaudi2": (96 * 10**9, {"bf16": 432.0}),
        "gaudi3": (128 * 10**9, {"bf16": 1835.0}),
        "a100": (80 * 10**9, {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
        "h100": (80 * 10**9, {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
        "h100-pcie": (80 * 10**9, {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
        "h200": (141 * 10**9, {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    }
    assert planner.get_device("dl1") is planner.DEVICES["gaudi"]


def test_default_predictions_are_berts_20_and_80():
    assert [planner.default_max_predictions(s) for s in (128, 512, 8)] == [20, 80, 2]


def test_recomputation_adds_the_encoder_forward_only():
    config = _config("bert-large")
    h, i, s, L = 1024, 4096, 128, 24
    encoder_forward = L * (2 * s * (4 * h * h + 2 * h * i) + 4 * s * s * h)  # no head: it is not checkpointed
    assert planner.training_flops_per_sequence(config, 128, 20, recompute=True) - \
        planner.training_flops_per_sequence(config, 128, 20) == encoder_forward


def test_checkpoint_segments_round_up():
    """24 layers in segments of 5 are 5 segments (the last of 4 layers), each keeping its input."""
    config = _config("bert-large")
    gaudi = planner.get_device("gaudi")
    saved = {k: planner.activation_bytes(config, 8, 128, 20, "bf16", gaudi, True, checkpoint_interval=k).saved
             for k in (5, 24)}
    assert saved[5] - saved[24] == (5 - 1) * 8 * 128 * 1024 * 2


def test_layer_norm_large_model_segments_keep_two_inputs_and_the_same_flops():
    """Habana's pre-LN block: a checkpointed segment keeps the layer input and the residual stream; without
    checkpointing it saves what post-LN saves, and its FLOPs and parameters are post-LN's."""
    post = _config("bert-large")
    habana = dataclasses.replace(post, layer_norm_large_model=True)
    gaudi = planner.get_device("gaudi")

    def saved(config, checkpointing, interval=1):
        return planner.activation_bytes(config, 8, 128, 20, "bf16", gaudi, checkpointing, interval).saved

    assert saved(habana, False) == saved(post, False)
    for interval in (1, 5):
        segments = -(-24 // interval)
        assert saved(habana, True, interval) - saved(post, True, interval) == segments * 8 * 128 * 1024 * 2
    assert planner.training_flops_per_sequence(habana, 128, 20, recompute=True) == \
        planner.training_flops_per_sequence(post, 128, 20, recompute=True)
    assert planner.parameter_count_formula(habana) == planner.parameter_count_formula(post) \
        == planner.count_parameters_exact(habana)


def test_layer_norm_large_model_checkpointing_keeps_what_the_planner_says():
    """Measured: with checkpointing, the forward's peak is above post-LN's by one residual stream per segment
    (tokens x hidden, fp32), as activation_bytes counts."""
    post = dataclasses.replace(_config("bert-tiny"), num_hidden_layers=4, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
    batch, seq = 4, 64
    data = _batch(post, batch, seq, 10)
    kept = {}
    for config in (post, dataclasses.replace(post, layer_norm_large_model=True)):
        torch.manual_seed(0)
        model = BertForPreTraining(config, ActivationCheckpointing(enabled=True, interval=2)).train()
        kept[config.layer_norm_large_model] = planner.profile_peak_bytes(lambda m=model: m(**data))
    planned = {flag: planner.activation_bytes(dataclasses.replace(post, layer_norm_large_model=flag), batch, seq, 10,
                                              "fp32", CPU, True, 2).saved for flag in (False, True)}
    assert planned[True] - planned[False] == 2 * batch * seq * post.hidden_size * 4
    assert kept[True] - kept[False] == pytest.approx(planned[True] - planned[False], rel=0.05), kept


def test_zero2_partitions_the_later_layers_gradients_and_holds_a_reduce_bucket():
    config = _config("bert-large")
    kwargs = dict(device=planner.get_device("gaudi2"), zero_stage=2, micro_batch=8, seq_len=512,
                  checkpoint_activations=True)
    one, eight = (planner.plan_memory(config, devices=n, **kwargs) for n in (1, 8))
    assert one.buffers == eight.buffers == 500_000_000 * 2  # reduce_bucket_size elements in bf16
    h, i, L = 1024, 4096, 24
    later = (4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h) * (L - 1) * 2  # bf16 gradients of 23 layers
    assert one.transient - eight.transient == later - later // 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_zero2_reduce_bucket_is_part_of_the_peak(precision):
    """Without BF16_Optimizer, ZeRO-1/2 hold reduce_bucket_size elements for the reduction all through training."""
    config = _config("bert-large")
    kwargs = dict(device=planner.get_device("gaudi2"), zero_stage=2, micro_batch=8, seq_len=128,
                  precision=precision)
    full, none = (planner.plan_memory(config, bucket_elements=n, **kwargs) for n in (500_000_000, 0))
    g_bytes = 2 if precision == "bf16" else 4
    assert full.buffers == 500_000_000 * g_bytes and none.buffers == 0
    assert full.peak - none.peak == 500_000_000 * g_bytes


def test_a_longer_checkpoint_interval_recomputes_that_many_layers_and_holds_fewer_later_gradients():
    config = _config("bert-large")
    kwargs = dict(micro_batch=8, seq_len=128, max_predictions=20, precision="bf16", device=planner.get_device("gaudi2"),
                  checkpoint_activations=True)
    one, four = (planner.activation_bytes(config, **kwargs, checkpoint_interval=n) for n in (1, 4))
    assert four.recompute == 4 * one.recompute > 0
    plans = [planner.plan_memory(config, zero_stage=2, micro_batch=8, seq_len=128, precision="fp32",
                                 device=planner.get_device("gaudi2"), checkpoint_activations=True,
                                 checkpoint_interval=n) for n in (1, 4)]
    h, i = config.hidden_size, config.intermediate_size
    layer_params = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
    fp32 = [planner.activation_bytes(config, micro_batch=8, seq_len=128, max_predictions=20, precision="fp32",
                                     device=planner.get_device("gaudi2"), checkpoint_activations=True,
                                     checkpoint_interval=n) for n in (1, 4)]
    # the encoder backward's working memory: 3 fewer later layers' fp32 gradients, 3 more layers recomputed
    assert plans[1].transient - plans[0].transient == -3 * layer_params * 4 + fp32[1].recompute - fp32[0].recompute


def test_the_verdict_counts_the_headroom_and_the_mfu_the_model_flops(capsys):
    """A peak between the usable memory and the device's does not fit; with recomputation, time and MFU are
    still those of the model FLOPs (3x forward), as published MFUs are."""
    args = ["--config_file", str(ROOT / "configs/models/bert-large.json"), "--device", "gaudi2", "--micro_batch",
            "8", "--precision", "bf16", "--checkpoint_activations", "--throughput", "30", "--sequences", "1e6"]
    assert planner.main([*args, "--device_memory", "1000GiB"]) == 0
    out = capsys.readouterr().out
    peak = max(float(x) for x in re.findall(r"peak [a-z ]+?([0-9.]+) GiB", out))
    for headroom, verdict in (("0.5", "DOES NOT FIT"), ("0", "FITS")):
        assert planner.main([*args, "--device_memory", f"{peak * 1.5:.2f}GiB", "--headroom", headroom]) == 0
        assert f"verdict      {verdict};" in capsys.readouterr().out
    config, device = _config("bert-large"), planner.get_device("gaudi2")
    flops = planner.training_flops_per_sequence(config, 128, 20)
    assert flops < planner.training_flops_per_sequence(config, 128, 20, True)
    tflops = device.peak_tflops["bf16"]
    assert f"implies {planner.implied_mfu(30, flops, tflops):.1%} of {tflops:g} TFLOP/s" in out
    assert "MFU 40%: " in out and f"({tflops * 1e12 * 0.4 / flops:,.0f} seq/s in total)" in out  # 1 device


def test_largest_micro_batch_reaches_its_limit_and_seq_len_is_checked():
    config = _config("bert-tiny")
    kwargs = dict(device=planner.get_device("gaudi3"), seq_len=128)
    assert planner.largest_micro_batch(config, 10**15, limit=8, **kwargs) == 8
    assert planner.plan_memory(config, micro_batch=1, device=kwargs["device"], seq_len=512).peak > 0
    with pytest.raises(ValueError, match="seq_len 513 exceeds the model's max_position_embeddings 512"):
        planner.plan_memory(config, micro_batch=1, device=kwargs["device"], seq_len=513)


def test_cli_prints_breakdown_verdict_and_published_mfu(capsys):
    rc = planner.main(["--config_file", str(ROOT / "configs/models/bert-1.5b.json"), "--devices", "128",
                       "--device_memory", "32GiB", "--zero_stage", "1", "--micro_batch", "16", "--seq_len", "128",
                       "--checkpoint_activations", "--precision", "bf16", "--sequences", "4.6e8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "parameters   1,530,388,930" in out
    for label in ("weights", "gradients", "optimizer states", "activations, no checkpoint",
                  "activations, checkpointed", "verdict", "FLOPs/seq", "time "):
        assert label in out
    assert "FITS" in out
    # the BF16_Optimizer's all-reduce at the end of backward sets the peak (docs/PERFORMANCE.md)
    assert re.search(r"peak at end of backward +14\.38 GiB", out)
    mfu = re.search(r"bert-1\.5b\s+34\.58 seq/s.*MFU ([0-9.]+)%", out)
    assert mfu and 30 < float(mfu.group(1)) < 100


def test_cli_rejects_bad_sizes_and_says_what_fits(capsys):
    with pytest.raises(SystemExit):
        planner.main(["--config_file", str(ROOT / "configs/models/bert-base.json"), "--micro_batch", "8",
                      "--device_memory", "lots"])
    assert "32GiB" in capsys.readouterr().err
    rc = planner.main(["--config_file", str(ROOT / "configs/models/bert-5b.json"), "--device", "gaudi",
                       "--devices", "1", "--zero_stage", "0", "--micro_batch", "8"])
    assert rc == 0
    assert "DOES NOT FIT; largest micro batch that fits: 0" in capsys.readouterr().out



@pytest.mark.parametrize("flag, value", [("--micro_batch", "0"), ("--micro_batch", "-4"), ("--seq_len", "0"),
                                         ("--max_predictions", "0"), ("--checkpoint_interval", "0"),
                                         ("--sequences", "-5"), ("--throughput", "-3"), ("--throughput", "nan"),
                                         ("--reduce_bucket_size", "-500000000"), ("--reduce_bucket_size", "2.5"),
                                         ("--reduce_bucket_size", "inf")])
def test_cli_refuses_sizes_and_counts_that_are_not_positive(flag: str, value: str, capsys):
    """They printed a plan (negative activation memory for a micro batch of -4) or, for a checkpoint
    interval of 0, a ZeroDivisionError traceback."""
    args = ["--config_file", str(ROOT / "configs/models/bert-base.json"), "--micro_batch", "8",
            "--checkpoint_activations", flag, value]
    with pytest.raises(SystemExit) as exit_info:
        planner.main(args)
    assert exit_info.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_cli_refuses_more_predictions_than_a_sequence_holds(capsys):
    args = ["--config_file", str(ROOT / "configs/models/bert-base.json"), "--micro_batch", "8", "--seq_len", "128",
            "--max_predictions", "200"]
    assert planner.main(args) == 2
    assert capsys.readouterr().err == ("error: --max_predictions 200 is more than a sequence of 128 can hold "
                                       "(125 maskable tokens); lower it or raise --seq_len\n")
    assert planner.main([*args[:-1], "125"]) == 0


def test_cli_headroom_reduces_the_usable_memory(capsys):
    args = ["--config_file", str(ROOT / "configs/models/bert-large.json"), "--micro_batch", "8",
            "--device_memory", "10GiB", "--headroom", "0.5"]
    assert planner.main(args) == 0
    assert "of    10.00 GiB (5.00 GiB usable with 50% headroom)" in capsys.readouterr().out


def test_cli_refuses_a_checkpoint_interval_without_checkpointing(capsys):
    """It was ignored silently; run_pretraining.py refuses the same combination."""
    args = ["--config_file", str(ROOT / "configs/models/bert-base.json"), "--micro_batch", "8",
            "--checkpoint_interval", "4"]
    assert planner.main(args) == 2
    assert capsys.readouterr().err == ("error: --checkpoint_interval 4 applies to --checkpoint_activations; add "
                                       "--checkpoint_activations or drop --checkpoint_interval\n")
    assert planner.main([*args, "--checkpoint_activations"]) == 0
    assert planner.main([*args[:-1], "1"]) == 2  # the default value too


def test_cli_refuses_an_mfu_without_sequences(capsys):
    args = ["--config_file", str(ROOT / "configs/models/bert-large.json"), "--micro_batch", "64", "--mfu", "0.9"]
    assert planner.main(args) == 2
    assert capsys.readouterr().err == ("error: --mfu 0.9 applies to --sequences (the time to train them); add "
                                       "--sequences or drop --mfu\n")
    assert planner.main([*args, "--sequences", "4.6e8"]) == 0
    assert "MFU 90%" in capsys.readouterr().out


@pytest.mark.parametrize("mfu", ["0", "1.5", "7", "-0.4", "nan"])
def test_cli_refuses_an_mfu_outside_0_to_1_also_where_no_peak_is_known(mfu: str, capsys):
    """On a device without a peak figure (cpu) the time is not computed, and an --mfu of 7 passed unchecked."""
    for device in ("cpu", "h100"):
        args = ["--config_file", str(ROOT / "configs/models/bert-large.json"), "--micro_batch", "8", "--device",
                device, "--device_memory", "24GiB", "--sequences", "1e6", "--mfu", mfu]
        assert planner.main(args) == 2
        assert capsys.readouterr().err == (f"error: --mfu must be in (0, 1], a fraction of the device's peak (0.4 = "
                                           f"40%), got {float(mfu)}\n")


def test_cli_refuses_a_fraction_of_a_sequence(capsys):
    """--sequences 0.4 printed a training time of 0 s (the count was truncated)."""
    args = ["--config_file", str(ROOT / "configs/models/bert-large.json"), "--micro_batch", "8", "--device", "h100"]
    assert planner.main([*args, "--sequences", "0.4"]) == 2
    assert capsys.readouterr().err == "error: --sequences must be a whole number of sequences, got 0.4\n"
    assert planner.main([*args, "--sequences", "4.6e8"]) == 0
    assert "time         4.6e+08 sequences" in capsys.readouterr().out


@pytest.mark.parametrize("size", ["0", "0GiB", "0.5", "0.0001KB"])
def test_cli_refuses_a_device_memory_under_one_byte(size: str, capsys):
    """It read as 0, which the report took for "no figure given" and asked for --device_memory."""
    with pytest.raises(SystemExit) as exit_info:
        planner.main(["--config_file", str(ROOT / "configs/models/bert-large.json"), "--micro_batch", "8",
                      "--device_memory", size])
    assert exit_info.value.code == 2
    assert (f"argument --device_memory: {size!r} is less than one byte; write the device's memory, e.g. 32GiB"
            in capsys.readouterr().err)


def test_cli_refuses_a_reduce_bucket_size_the_optimizer_does_not_use(capsys):
    """It changed nothing under bf16 ZeRO-1 (BF16_Optimizer) and ZeRO-0/3, and was accepted silently."""
    args = ["--config_file", str(ROOT / "configs/models/bert-large.json"), "--micro_batch", "64",
            "--reduce_bucket_size", "100000000"]
    assert planner.main(args) == 2
    assert capsys.readouterr().err == ("error: --reduce_bucket_size 100000000 sizes the ZeRO optimizer's buffer, "
                                       "which ZeRO-1 with bf16 does not use; drop it, or plan ZeRO-1/2 with fp32 (ZeRO-2 "
                                       "with bf16 uses it too, but run_pretraining.py trains bf16 with ZeRO-1 only)\n")
    assert planner.main([*args, "--zero_stage", "3", "--precision", "fp32"]) == 2
    assert "which ZeRO-3 with fp32 does not use" in capsys.readouterr().err
    buckets = {}
    for elements in ("100000000", "200000000", "2e8"):  # also as DeepSpeed's JSON files write it
        assert planner.main([*args[:-1], elements, "--zero_stage", "2"]) == 0
        buckets[elements] = re.search(r"reduce bucket +([0-9.]+) GiB", capsys.readouterr().out).group(1)
    assert buckets == {"100000000": "0.19", "200000000": "0.37", "2e8": "0.37"}  # bf16: 2 bytes per element


if __name__ == "__main__":  # a rank of test_bf16_zero1_memory_matches_a_real_deepspeed_engine
    import torch.distributed

    _bf16_zero1_worker(sys.argv[1])
    # Leave together and close gloo: a rank exiting while its peer still talks to it can abort. Then skip
    # the interpreter's teardown, where finished ranks have aborted too (training.accelerator.leave).
    from training.accelerator import leave

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    leave(0)
