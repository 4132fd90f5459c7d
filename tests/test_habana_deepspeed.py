"""--phase2 --init_checkpoint <a DeepSpeed checkpoint folder of Habana's deepspeed-bert>.

No folder written by their scripts is available offline: these are written by DeepSpeed's own `save_checkpoint`
(one CPU rank, gloo) from an engine built as their run_pretraining.py builds it (their deepspeed_config_bert_1.5b.json:
bf16, ZeRO-1), around a module carrying their parameter names (tests/test_reference_checkpoint.py's
`their_state_dict` of one of our models), under their tag (the step) and client state. The fp32 master weights are
set to our model's fp32 values, so that they differ from the bf16 module weights beside them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from modeling import BertForPreTraining
from tests.test_reference_checkpoint import state_equal, their_state_dict, tiny_model
from training.accelerator import free_port
from training.checkpoint import MODEL_STATES, CheckpointError
from training.habana_deepspeed import FIX
from training.weights import load_initial_weights

_SAVE = r"""
import sys
import deepspeed
import torch
from torch import nn
from deepspeed.utils import safe_set_full_fp32_param

theirs = torch.load(sys.argv[1])
theirs_pre_ln = torch.load(sys.argv[3])
deepspeed.init_distributed(dist_backend="gloo")


def module_with(weights):
    # A module whose state_dict names are `weights`' (their BertForPreTraining's), the decoder tied as theirs is.
    root = nn.Module()
    for name, value in weights.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if name == "cls.predictions.decoder.weight":
            owner.weight = root.bert.embeddings.word_embeddings.weight
        else:
            owner.register_parameter(leaf, nn.Parameter(value.clone()))
    return root


# Their deepspeed_config_bert_1.5b.json (bf16, ZeRO-1 without contiguous gradients); "bf16_optimizer" as
# DeepSpeed versions before 0.15 (Habana's fork among them) ran it: BF16_Optimizer, not the ZeRO optimizer.
base = {"train_batch_size": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1, "contiguous_gradients": False}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9}
folders = {"zero": (base, theirs), "bf16_optimizer": (base | {"data_types": {"grad_accum_dtype": "fp32"}}, theirs)}
renamed = dict(theirs)
renamed["bert.encoder.layer.0.attention.self.qkv.weight"] = renamed.pop("bert.encoder.layer.0.attention.self.query.weight")
folders["renamed"] = (base, renamed)
folders["pre_ln"] = (base, theirs_pre_ln)
for folder, (config, weights) in folders.items():
    model = module_with(weights)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    for name, param in engine.module.named_parameters():
        safe_set_full_fp32_param(param, weights[name])
    engine.save_checkpoint(f"{sys.argv[2]}/{folder}", "7038", {"files": [3, "/data/shard_3.hdf5"], "epoch": 0})
    print(folder, type(engine.optimizer).__name__, flush=True)
"""


def pre_ln_source() -> BertForPreTraining:  # noqa: N802 (a constant model, built afresh)
    """Their pre-LN model (layer_norm_large_model), its LayerNorms random too: their 1 and 0 init would make the
    weights of post-LN and pre-LN folders alike in those tensors."""
    model = tiny_model(3, layer_norm_large_model=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.add_(torch.randn(param.shape, generator=g) * 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """Folders `zero`, `bf16_optimizer` (tiny_model(1), DeepSpeed's two optimizers for their config),
    `renamed` (one tensor under another name) and `pre_ln` (pre_ln_source()), each with `latest` naming the tag 7038."""
    out = tmp_path_factory.mktemp("habana")
    torch.save(their_state_dict(tiny_model(1)), out / "theirs.pt")
    torch.save(their_state_dict(pre_ln_source()), out / "theirs_pre_ln.pt")
    env = os.environ | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SAVE, str(out / "theirs.pt"), str(out), str(out / "theirs_pre_ln.pt")],
                          env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wrappers = dict(line.split() for line in done.stdout.splitlines()
                    if line.startswith(("zero ", "bf16_", "ren", "pre_ln ")))
    assert wrappers == {"zero": "DeepSpeedZeroOptimizer", "bf16_optimizer": "BF16_Optimizer",
                        "renamed": "DeepSpeedZeroOptimizer", "pre_ln": "DeepSpeedZeroOptimizer"}
    return out


@pytest.mark.parametrize("folder", ["zero", "bf16_optimizer"])
def test_their_folder_loads_its_fp32_master_weights(folders, folder):
    root = folders / folder
    tag = root / "7038"
    assert (root / "latest").read_text() == "7038"
    assert sorted(p.name for p in tag.iterdir()) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", MODEL_STATES]
    source = tiny_model(1)
    module = torch.load(tag / MODEL_STATES, weights_only=False)["module"]
    embeddings = module["bert.embeddings.word_embeddings.weight"]
    assert embeddings.dtype == torch.bfloat16
    assert not torch.equal(embeddings.float()[:30522], source.bert.embeddings.word_embeddings.weight[:30522])
    model = tiny_model(2)
    assert load_initial_weights(model, root) == (
        f"{tag} (Habana deepspeed-bert DeepSpeed checkpoint, fp32 master weights merged from 1 ZeRO partition(s) "
        f"(bf16 optimizer) of {tag}; tag 7038 named by {root / 'latest'})")
    state_equal(model, source)
    for named in (tag, tag / MODEL_STATES):  # the tag directory, or its model states file
        model = tiny_model(2)
        assert load_initial_weights(model, named).startswith(f"{tag} (Habana deepspeed-bert DeepSpeed checkpoint, "
                                                             "fp32 master weights")
        state_equal(model, source)


def test_their_pre_ln_folder_loads_into_layer_norm_large_model(folders):
    """Their pre-LN model has post-LN BERT's tensor names: with layer_norm_large_model it loads, equal to the
    fp32 masters (not the bf16 module weights beside them), and computes as the model it was saved from."""
    root = folders / "pre_ln"
    source = pre_ln_source()
    module = torch.load(root / "7038" / MODEL_STATES, weights_only=False)["module"]
    ln = module["bert.encoder.layer.0.attention.output.LayerNorm.weight"]
    assert ln.dtype == torch.bfloat16
    assert not torch.equal(ln.float(), source.bert.encoder.layer[0].attention.output.LayerNorm.weight)
    model = tiny_model(2, layer_norm_large_model=True)
    assert load_initial_weights(model, root).startswith(f"{root / '7038'} (Habana deepspeed-bert DeepSpeed "
                                                        "checkpoint, fp32 master weights merged")
    state_equal(model, source)
    ids = torch.randint(5, 30522, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).mlm_logits, source.eval()(ids).mlm_logits)


def test_without_partitions_the_bf16_module_weights_are_taken(folders, tmp_path):
    shutil.copytree(folders / "zero", tmp_path / "zero")
    tag = tmp_path / "zero" / "7038"
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    model = tiny_model(2)
    assert load_initial_weights(model, tag) == (f"{tag} (Habana deepspeed-bert DeepSpeed checkpoint, module weights "
                                                "(bfloat16), no ZeRO partitions)")
    rounded = tiny_model(1)
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.bfloat16().float())
    state_equal(model, rounded)


def test_a_missing_or_unused_tensor_is_named(folders):
    with pytest.raises(CheckpointError, match=re.escape(
            f"{folders / 'renamed' / '7038'}: its tensors are not this model's: missing there "
            "bert.encoder.layer.0.attention.self.query.weight (1); unused "
            f"bert.encoder.layer.0.attention.self.qkv.weight (1); {FIX}")):
        load_initial_weights(tiny_model(2), folders / "renamed")


def test_another_config_is_refused_naming_the_shapes_and_the_fix(folders, tmp_path):
    tag = folders / "zero" / "7038"
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tag}: the model of --config_file has other shapes (bert.encoder.layer.0.intermediate.dense.weight "
            "(512, 128) there, (256, 128) in --config_file; ")) as error:
        load_initial_weights(tiny_model(2, intermediate_size=256), folders / "zero")
    assert str(error.value).endswith(FIX)
    # Megatron's pre-LN is not theirs: refused for its reason, before anything is read.
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tag}: --config_file is Megatron-BERT's pre-LN block (pre_layer_norm true), which is not theirs; for "
            "their pre-LN model (layer_norm_large_model true in their config) write \"layer_norm_large_model\": "
            "true and \"pre_layer_norm\": false, as in configs/models/bert-1.5b-deepspeed-bert.json")):
        load_initial_weights(tiny_model(2, pre_layer_norm=True), folders / "zero")
    # The shards' vocabulary must be the one --config_file gives their rows.
    vocab = tmp_path / "vocab.txt"
    specials = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"
    vocab.write_text(specials + "".join(f"t{i}\n" for i in range(30528 - 5)))
    with pytest.raises(CheckpointError, match=re.escape(f"{tag}: --config_file's vocab_size 30522 (the rows taken "
                                                        "from it) is not the 30528 tokens of the shards' vocab.txt")):
        load_initial_weights(tiny_model(2), folders / "zero", vocab)
    vocab.write_text(specials + "".join(f"t{i}\n" for i in range(30522 - 5)))
    load_initial_weights(tiny_model(2), folders / "zero", vocab)


def test_a_latest_without_its_tag_is_a_clear_error(folders, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(folders / "zero", root)
    latest = root / "latest"
    fix = f"write one of its tags (7038) into {latest} or point --init_checkpoint at that tag's directory"
    latest.write_text("7100")
    with pytest.raises(CheckpointError, match=re.escape(f"{latest} names the tag '7100' but {root / '7100'} does "
                                                        f"not exist; {fix}")):
        load_initial_weights(tiny_model(2), root)
    (root / "7100").mkdir()
    (root / "7100" / "state_0").write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(f"{latest} names the tag '7100' but "
                                                        f"{root / '7100' / MODEL_STATES} does not exist: the "
                                                        f"checkpoint is incomplete; {fix}")):
        load_initial_weights(tiny_model(2), root)
    for tag in ("..", "../results/7038", ""):  # a path reaches a tag, here this folder's own, by another way
        latest.write_text(tag + "\n")
        with pytest.raises(CheckpointError, match=re.escape(f"{latest}: {tag!r} is not a tag name; {fix}")):
            load_initial_weights(tiny_model(2), root)
    shutil.rmtree(root / "7038")
    with pytest.raises(CheckpointError, match=re.escape(f"{latest}: '' is not a tag name; it holds no tag with "
                                                        "model states")):
        load_initial_weights(tiny_model(2), root)


def test_a_damaged_model_states_file_is_named(tmp_path):
    (tmp_path / "7038").mkdir()
    (tmp_path / "7038" / MODEL_STATES).write_bytes(b"")
    (tmp_path / "latest").write_text("7038")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / '7038'}: cannot read the checkpoint (")):
        load_initial_weights(tiny_model(2), tmp_path)


def test_a_checkpoints_directory_of_ours_is_not_taken_for_theirs(tmp_path):
    tag = tmp_path / "run" / "checkpoints" / "step00000010"
    tag.mkdir(parents=True)
    (tag / MODEL_STATES).write_bytes(b"")
    (tag / "run_state.json").write_text("{}")
    (tag.parent / "latest").write_text("step00000010")
    for named in (tag.parent, tag):
        with pytest.raises(CheckpointError, match=re.escape(f"--init_checkpoint {named}: a checkpoint tag of a run "
                                                            f"of ours ({tag / 'run_state.json'}); pass that run's "
                                                            f"--output_dir ({tmp_path / 'run'}) instead")):
            load_initial_weights(tiny_model(2), named)


@pytest.mark.slow
def test_phase2_runs_from_their_pre_ln_folder(folders, phase1_shards, tmp_path):
    """Their BERT-1.5B/5B layout end to end: layer_norm_large_model under DeepSpeed, bf16 with ZeRO-1 and
    checkpointed encoder layers, from the fp32 masters of their folder (the post-LN folders load alike above)."""
    from tests.test_train_run import base_args, ds_config, ok, records, run

    out = tmp_path / "phase2"
    config = tmp_path / "tiny-habana-pre-ln.json"
    config.write_text(json.dumps(json.loads((ROOT / "configs" / "models" / "bert-tiny.json").read_text())
                                 | {"layer_norm_large_model": True}))
    ds = ds_config(tmp_path / "ds.json", bf16=True, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    ok(run(1, base_args(phase1_shards, out, config, ds, 2, num_eval_samples=0, phase2=True,
                        init_checkpoint=folders / "pre_ln", checkpoint_activations=True)))
    info = json.loads((out / "run_info.json").read_text())
    tag = folders / "pre_ln" / "7038"
    assert info["init_checkpoint"] == (f"{tag} (Habana deepspeed-bert DeepSpeed checkpoint, fp32 master weights "
                                       f"merged from 1 ZeRO partition(s) (bf16 optimizer) of {tag}; tag 7038 named "
                                       f"by {folders / 'pre_ln' / 'latest'})")
    assert info["start_step"] == 0
    assert json.loads((out / "model_config.json").read_text())["layer_norm_large_model"] is True
    steps = records(out)
    assert sorted(steps) == [1, 2] and all(0 < steps[k]["loss"] < 20 for k in steps)


@pytest.mark.parametrize("folder", ["zero", "bf16_optimizer"])
def test_their_folder_exports_to_hugging_face(folders, folder, tmp_path, bert_vocab):
    """scripts/export_hf.py --checkpoint <their folder>: their fp32 masters (not the bf16 module weights) as a
    transformers BERT. It had read the weights, then asked for another --config_file, which none could satisfy."""
    from safetensors.torch import load_file
    from transformers import AutoModelForPreTraining

    from scripts.export_hf import ExportError, export

    root, tag = folders / folder, folders / folder / "7038"
    config = ROOT / "configs" / "models" / "bert-tiny.json"
    with pytest.raises(ExportError, match=re.escape("no model config; pass the run's --config_file with --config_file "
                                                    "(for a DeepSpeed checkpoint folder of Habana's deepspeed-bert: "
                                                    "their bert_config.json")):
        export(root, tmp_path / "hf", vocab_file=bert_vocab)
    megatron = tmp_path / "megatron.json"
    megatron.write_text(json.dumps(json.loads(config.read_text()) | {"pre_layer_norm": True}))
    with pytest.raises(ExportError, match=re.escape(f"{tag}: --config_file is Megatron-BERT's pre-LN block")):
        export(root, tmp_path / "hf", config_file=megatron, vocab_file=bert_vocab)
    assert not (tmp_path / "hf").exists()
    for named, hf in ((root, tmp_path / "hf"), (tag / MODEL_STATES, tmp_path / "hf_from_file")):
        done = export(named, hf, config_file=config, vocab_file=bert_vocab)
        assert done.weights == (f"{tag} (Habana deepspeed-bert DeepSpeed checkpoint, fp32 master weights merged from "
                                f"1 ZeRO partition(s) (bf16 optimizer) of {tag})")
        source = tiny_model(1).state_dict()
        exported = load_file(hf / "model.safetensors")
        assert set(exported) == set(source)
        for name, value in exported.items():  # the vocabulary rows past the padding are cut
            assert torch.equal(value, source[name][: len(value)]), name
    model = AutoModelForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    expected = tiny_model(1).eval()(ids, torch.zeros_like(ids), torch.ones_like(ids))
    with torch.no_grad():
        got = model(input_ids=ids)
    assert torch.allclose(got.prediction_logits[..., :30522], expected.mlm_logits[..., :30522], atol=1e-5)
    assert torch.allclose(got.seq_relationship_logits, expected.nsp_logits, atol=1e-5)
