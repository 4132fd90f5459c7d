"""--phase2 --init_checkpoint <NVIDIA's or Habana's ckpt_<step>.pt>: their phase-1 checkpoints, continued here.

No checkpoint written by their scripts is available offline: these files are built from one of our models
in the layout their published run_pretraining.py and modeling.py give (see training/reference_checkpoint.py):
their parameter names (`dense_act`, the tied `cls.predictions.decoder.weight`), their vocab padded to a
multiple of 8, apex's fp32 'master params', and a pickled DataLoader of their `__main__` dataset class."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from torch.utils.data import DataLoader, Dataset, RandomSampler

import modeling
from training.checkpoint import CheckpointError
from training.weights import load_initial_weights

TINY = modeling.BertConfig.from_json_file(ROOT / "configs" / "models" / "bert-tiny.json")
_FUSED = ("intermediate.dense.", "pooler.dense.", "transform.dense.")  # their LinearActivation layers


def tiny_model(seed: int, **changes) -> modeling.BertForPreTraining:
    torch.manual_seed(seed)
    model = modeling.BertForPreTraining(modeling.BertConfig.from_dict(TINY.to_dict() | changes))
    with torch.no_grad():  # padding rows are not weights: a load leaves them zero, as load_hf does
        model.bert.embeddings.word_embeddings.weight[TINY.vocab_size:] = 0
        model.cls.predictions.bias[TINY.vocab_size:] = 0
    return model


def their_state_dict(model: modeling.BertForPreTraining, prefix: str = "") -> dict[str, torch.Tensor]:
    """`model` as their BertForPreTraining's state_dict: fused dense_act names, the tied decoder after the
    MLM transform, the vocab padded to a multiple of 8 (with values of their own in the padding rows)."""
    theirs = {}
    for name, value in model.state_dict().items():
        for fused in _FUSED:
            name = name.replace(fused, fused.replace(".dense.", ".dense_act."))
        value = value.clone()
        if name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
            value[TINY.vocab_size:] = 7.0  # their padding rows, trained against: never read here
        theirs[prefix + name] = value
        if name == "cls.predictions.transform.LayerNorm.bias":
            theirs[prefix + "cls.predictions.decoder.weight"] = theirs[prefix + "bert.embeddings.word_embeddings.weight"]
    return theirs


class pretraining_dataset(Dataset):  # noqa: N801 - their class name, pickled by reference from their __main__
    def __init__(self):
        self.inputs = [np.zeros((4, 128), dtype=np.int32)]

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return self.inputs[0][index]


def apex_masters(theirs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """amp.master_params(optimizer): their two parameter groups (weight-decayed first, then names with
    bias/gamma/beta/LayerNorm), each in named_parameters order (the tied decoder is not a second parameter)."""
    params = [k for k in theirs if not k.endswith("decoder.weight")]
    order = sorted(params, key=lambda n: any(nd in n for nd in ("bias", "gamma", "beta", "LayerNorm")))
    return [theirs[k].clone() for k in order]


def save_theirs(path, theirs: dict, masters: list | None = None, **extra):
    """torch.save as their run_pretraining.py does, the DataLoader's dataset class living in their __main__."""
    main = sys.modules["__main__"]
    pretraining_dataset.__module__ = "__main__"
    main.pretraining_dataset = pretraining_dataset
    try:
        data = pretraining_dataset()
        torch.save({"model": theirs, "optimizer": {"state": {}, "param_groups": [{"lr": 6e-3, "step": 7038}]},
                    "master params": apex_masters(theirs) if masters is None else masters,
                    "files": [3, "/data/training/shard_3.hdf5"], "epoch": 0,
                    "data_loader": DataLoader(data, sampler=RandomSampler(data), batch_size=2), **extra}, path)
    finally:
        del main.pretraining_dataset
        pretraining_dataset.__module__ = __name__
    return path


def state_equal(a: modeling.BertForPreTraining, b: modeling.BertForPreTraining) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_their_checkpoint_loads_exactly(tmp_path):
    source = tiny_model(1)
    path = save_theirs(tmp_path / "ckpt_7038.pt", their_state_dict(source))
    with pytest.raises(AttributeError):  # what a plain torch.load does with their pickled DataLoader
        torch.load(path, weights_only=False)
    model = tiny_model(2)
    assert load_initial_weights(model, path) == f"{path} (NVIDIA/Habana ckpt_<step>.pt, fp32 master weights)"
    state_equal(model, source)
    # Saved from a wrapped model (DDP's module., torch.compile's _orig_mod.): the same weights.
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        save_theirs(tmp_path / "wrapped.pt", their_state_dict(source, prefix))
        model = tiny_model(2)
        load_initial_weights(model, tmp_path / "wrapped.pt")
        state_equal(model, source)


def test_apex_fp16_master_weights_are_taken_when_they_are_the_masters(tmp_path):
    """apex O2: the state_dict holds the fp16 weights (cast to fp32), 'master params' the fp32 masters in
    their optimizer's order: weight-decayed parameters first, then biases and LayerNorms."""
    source = tiny_model(1)
    theirs = their_state_dict(source)
    masters = apex_masters(theirs)
    rounded = {k: v.half().float() for k, v in theirs.items()}
    rounded["cls.predictions.decoder.weight"] = rounded["bert.embeddings.word_embeddings.weight"]
    save_theirs(tmp_path / "ckpt_1234.pt", rounded, masters)
    model = tiny_model(2)
    assert load_initial_weights(model, tmp_path / "ckpt_1234.pt").endswith(", fp32 master weights)")
    state_equal(model, source)
    # Masters in another order are not these weights' masters: the model weights are read, and said so.
    save_theirs(tmp_path / "ckpt_1234.pt", rounded, masters[::-1])
    assert load_initial_weights(model, tmp_path / "ckpt_1234.pt").endswith(", float32 model weights)")
    assert torch.equal(model.bert.pooler.dense.weight, source.bert.pooler.dense.weight.half().float())
    # Two masters of one shape swapped (the query and key weights): every shape fits, the values do not.
    i, j = (next(n for n, m in enumerate(masters) if torch.equal(m, theirs[f"bert.encoder.layer.0.attention.self.{k}"]))
            for k in ("query.weight", "key.weight"))
    swapped = list(masters)
    swapped[i], swapped[j] = masters[j], masters[i]
    assert swapped[i].shape == swapped[j].shape and not torch.equal(swapped[i], swapped[j])
    save_theirs(tmp_path / "ckpt_1234.pt", rounded, swapped)
    assert load_initial_weights(model, tmp_path / "ckpt_1234.pt").endswith(", float32 model weights)")
    assert torch.equal(model.bert.encoder.layer[0].attention.self.key.weight,
                       source.bert.encoder.layer[0].attention.self.key.weight.half().float())
    # Habana's HPU checkpoints have no 'master params' at all.
    torch.save({"model": their_state_dict(source), "optimizer": {}, "files": [0], "epoch": 1, "data_loader": None},
               tmp_path / "habana.pt")
    assert load_initial_weights(model, tmp_path / "habana.pt").endswith(", float32 model weights)")
    state_equal(model, source)


def test_a_directory_of_their_checkpoints_gives_the_highest_step(tmp_path):
    save_theirs(tmp_path / "ckpt_100.pt", their_state_dict(tiny_model(1)))
    save_theirs(tmp_path / "ckpt_200.pt", their_state_dict(source := tiny_model(3)))
    (tmp_path / "dllogger.json").write_text("{}")
    model = tiny_model(2)
    assert load_initial_weights(model, tmp_path) == (
        f"{tmp_path / 'ckpt_200.pt'} (NVIDIA/Habana ckpt_<step>.pt, fp32 master weights; the highest step of 2 "
        f"ckpt_<step>.pt in {tmp_path})")
    state_equal(model, source)


def test_another_config_is_refused_naming_the_tensors(tmp_path):
    path = save_theirs(tmp_path / "ckpt_7038.pt", their_state_dict(tiny_model(1)))
    with pytest.raises(CheckpointError) as error:
        load_initial_weights(tiny_model(2, intermediate_size=256), path)
    assert str(error.value) == (
        f"{path}: the model of --config_file has other shapes (bert.encoder.layer.0.intermediate.dense.weight "
        "(512, 128) there, (256, 128) in --config_file; bert.encoder.layer.0.intermediate.dense.bias (512,) there, "
        "(256,) in --config_file; bert.encoder.layer.0.output.dense.weight (128, 512) there, (128, 256) in "
        "--config_file; bert.encoder.layer.1.intermediate.dense.weight (512, 128) there, (256, 128) in "
        "--config_file; bert.encoder.layer.1.intermediate.dense.bias (512,) there, (256,) in --config_file; "
        "bert.encoder.layer.1.output.dense.weight (128, 512) there, (128, 256) in --config_file); pass the "
        "--config_file matching their bert_config.json (their BertForPreTraining is post-LN with the NSP head: "
        "pre_layer_norm false, next_sentence_prediction true)")
    with pytest.raises(CheckpointError, match=r"ckpt_7038.pt: the model of --config_file has other shapes "
                                              r"\(bert.embeddings.word_embeddings.weight \(30528, 128\) there, "
                                              r"\(30000, 128\) in --config_file"):
        load_initial_weights(tiny_model(2, vocab_size=30000), path)
    with pytest.raises(CheckpointError, match=r"ckpt_7038.pt: its tensors are not this model's: unused "
                                              r"bert.encoder.layer.1.attention.output.LayerNorm.bias, .*\(16\); pass "
                                              r"the --config_file matching their bert_config.json"):
        load_initial_weights(tiny_model(2, num_hidden_layers=1), path)
    with pytest.raises(CheckpointError, match=r"its tensors are not this model's: missing there "
                                              r"bert.encoder.layer.0.attention.ln.bias, .*; unused "
                                              r"bert.embeddings.LayerNorm.bias, "):
        load_initial_weights(tiny_model(2, pre_layer_norm=True), path)
    # Habana deepspeed-bert's pre-LN block has these very names: refused for its reason, not loaded.
    with pytest.raises(CheckpointError, match=r"ckpt_7038.pt: --config_file has layer_norm_large_model true \(Habana "
                                              r"deepspeed-bert's pre-LN block\), but a ckpt_<step>.pt holds a post-LN "
                                              r"BERT; pass the --config_file matching their bert_config.json"):
        load_initial_weights(tiny_model(2, layer_norm_large_model=True), path)
    with pytest.raises(CheckpointError, match=r"its tensors are not this model's: unused bert.pooler.dense.bias, "
                                              r"bert.pooler.dense.weight, cls.seq_relationship.bias, "
                                              r"cls.seq_relationship.weight \(4\); pass"):
        load_initial_weights(tiny_model(2, next_sentence_prediction=False), path)


def test_a_missing_or_unknown_tensor_is_refused(tmp_path):
    theirs = their_state_dict(tiny_model(1))
    del theirs["cls.seq_relationship.bias"]
    path = save_theirs(tmp_path / "ckpt_1.pt", theirs)
    with pytest.raises(CheckpointError, match=r"^.*ckpt_1.pt: its tensors are not this model's: missing there "
                                              r"cls.seq_relationship.bias \(1\); pass the --config_file"):
        load_initial_weights(tiny_model(2), path)
    theirs = their_state_dict(tiny_model(1)) | {"bert.encoder.layer.0.attention.self.rotary.inv_freq": torch.ones(4)}
    save_theirs(path, theirs)
    with pytest.raises(CheckpointError, match=r"its tensors are not this model's: unused "
                                              r"bert.encoder.layer.0.attention.self.rotary.inv_freq \(1\)"):
        load_initial_weights(tiny_model(2), path)
    # transformers' position_ids buffer is not a parameter: known, and skipped.
    save_theirs(path, their_state_dict(source := tiny_model(1)) | {"bert.embeddings.position_ids": torch.arange(512)})
    model = tiny_model(2)
    load_initial_weights(model, path)
    state_equal(model, source)


def test_a_damaged_or_foreign_file_is_a_clear_error(tmp_path):
    path = save_theirs(tmp_path / "ckpt_7038.pt", their_state_dict(tiny_model(1)))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"ckpt_7038.pt: cannot read it as a torch checkpoint \(.*\); it is "
                                              r"damaged or not a ckpt_<step>.pt of NVIDIA's or Habana's"):
        load_initial_weights(tiny_model(2), path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"cannot read it as a torch checkpoint"):
        load_initial_weights(tiny_model(2), path)
    torch.save({"state_dict": {}}, path)
    with pytest.raises(CheckpointError, match=r"ckpt_7038.pt: no 'model' state_dict in it \(keys: state_dict\); not "
                                              r"a ckpt_<step>.pt of NVIDIA's or Habana's run_pretraining.py"):
        load_initial_weights(tiny_model(2), path)
    theirs = their_state_dict(tiny_model(1))
    theirs["cls.predictions.decoder.weight"] = theirs["cls.predictions.decoder.weight"] + 1
    save_theirs(path, theirs)
    with pytest.raises(CheckpointError, match=r"cls.predictions.decoder.weight is not the word embeddings"):
        load_initial_weights(tiny_model(2), path)


def test_the_shards_vocab_must_be_the_configs(tmp_path):
    """Their file holds no vocabulary: only its size can be checked, through --config_file's vocab_size."""
    path = save_theirs(tmp_path / "ckpt_7038.pt", their_state_dict(tiny_model(1)))
    vocab = tmp_path / "vocab.txt"
    specials = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"
    vocab.write_text(specials + "".join(f"t{i}\n" for i in range(30000 - 5)))
    with pytest.raises(CheckpointError, match=r"ckpt_7038.pt: --config_file's vocab_size 30522 \(the rows taken from "
                                              r"it\) is not the 30000 tokens of the shards' vocab.txt"):
        load_initial_weights(tiny_model(2), path, vocab)
    vocab.write_text(specials + "".join(f"t{i}\n" for i in range(30522 - 5)))
    load_initial_weights(tiny_model(2), path, vocab)


@pytest.mark.slow
def test_phase2_runs_from_their_checkpoint(phase1_shards, tmp_path):
    from tests.test_train_run import base_args, ds_config, ok, run

    (tmp_path / "results").mkdir()
    path = save_theirs(tmp_path / "results" / "ckpt_7038.pt", their_state_dict(tiny_model(1)))
    out = tmp_path / "phase2"
    ds = ds_config(tmp_path / "ds.json", bf16=False, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    ok(run(1, base_args(phase1_shards, out, ROOT / "configs" / "models" / "bert-tiny.json", ds, 2,
                        num_eval_samples=0, phase2=True, init_checkpoint=tmp_path / "results")))
    info = json.loads((out / "run_info.json").read_text())
    assert info["init_checkpoint"] == (f"{path} (NVIDIA/Habana ckpt_<step>.pt, fp32 master weights; the highest "
                                       f"step of 1 ckpt_<step>.pt in {tmp_path / 'results'})")
    assert info["start_step"] == 0


class _Planted:
    """What a crafted file could pickle: a call of os.mkdir, which leaves a trace when it runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.mkdir, (str(self.marker),)


def test_a_crafted_file_runs_no_code_in_either_torch_format(tmp_path):
    """Their pickles are read with tensor rebuilders only: any other global is a placeholder, never called,
    in the zip format and in the legacy format (torch.save(_use_new_zipfile_serialization=False), whose
    header pickles torch.load reads with the pickle module's `load`, not its Unpickler)."""
    marker = tmp_path / "ran"
    source = tiny_model(1)
    path = save_theirs(tmp_path / "ckpt_1.pt", their_state_dict(source), planted=_Planted(marker))
    model = tiny_model(2)
    load_initial_weights(model, path)
    state_equal(model, source)
    assert not marker.exists()
    # The legacy format: a genuine one still loads; a crafted header runs nothing.
    legacy = tmp_path / "ckpt_2.pt"
    torch.save({"model": their_state_dict(source), "planted": _Planted(marker)}, legacy,
               _use_new_zipfile_serialization=False)
    model = tiny_model(2)
    load_initial_weights(model, legacy)
    state_equal(model, source)
    assert not marker.exists()
    import pickle
    legacy.write_bytes(pickle.dumps(_Planted(marker), protocol=2))
    with pytest.raises(CheckpointError, match=r"ckpt_2.pt: cannot read it as a torch checkpoint"):
        load_initial_weights(tiny_model(2), legacy)
    assert not marker.exists()


class _Call:
    """A pickled call of `function(*args)`: what a crafted file can name besides os functions."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


@pytest.mark.parametrize("call", [
    _Call(torch.set_default_dtype, torch.float64),  # module torch, not a dtype nor Size
    _Call(torch._utils._import_dotted_name, "os.getcwd"),  # module torch._utils, not a _rebuild_ function
], ids=["torch", "torch._utils"])
def test_only_tensor_rebuilders_of_torch_are_called(tmp_path, call):
    from training.reference_checkpoint import _read

    source = tiny_model(1)
    path = save_theirs(tmp_path / "ckpt_1.pt", their_state_dict(source), planted=call)
    try:
        state = _read(path)
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)
    assert type(state["planted"]).__name__ == "_Foreign"  # a placeholder, not what the call returns


def test_masters_that_are_not_all_of_them_or_not_fp32_are_not_taken(tmp_path):
    source = tiny_model(1)
    theirs = their_state_dict(source)
    masters = apex_masters(theirs)
    save_theirs(tmp_path / "ckpt_1.pt", theirs, masters[:-1])  # one short: not the optimizer's masters
    model = tiny_model(2)
    assert load_initial_weights(model, tmp_path / "ckpt_1.pt").endswith(", float32 model weights)")
    state_equal(model, source)
    half = {k: v.half() for k, v in theirs.items()}
    save_theirs(tmp_path / "ckpt_1.pt", half, [m.half() for m in apex_masters(half)])  # fp16 copies: no masters
    assert load_initial_weights(tiny_model(2), tmp_path / "ckpt_1.pt").endswith(", float16 model weights)")


def test_a_directory_named_like_a_checkpoint_is_not_one(tmp_path):
    save_theirs(tmp_path / "ckpt_100.pt", their_state_dict(source := tiny_model(1)))
    (tmp_path / "ckpt_200.pt").mkdir()
    model = tiny_model(2)
    assert "the highest step of 1 ckpt_<step>.pt" in load_initial_weights(model, tmp_path)
    state_equal(model, source)


def test_a_file_of_another_layout_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt_1.pt"
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match=r"ckpt_1.pt: holds a list, not the dict NVIDIA's and Habana's"):
        load_initial_weights(tiny_model(2), path)
    torch.save({"model": {"bert.embeddings.word_embeddings.weight": [0.0]}}, path)
    with pytest.raises(CheckpointError, match=r"ckpt_1.pt: no 'model' state_dict in it \(keys: model\)"):
        load_initial_weights(tiny_model(2), path)


def test_their_checkpoint_exports_to_hugging_face(tmp_path, bert_vocab):
    """scripts/export_hf.py --checkpoint ckpt_<step>.pt: their model as a transformers BERT, weights exact."""
    import subprocess

    from safetensors.torch import load_file
    from transformers import AutoModelForPreTraining

    from scripts.export_hf import ExportError, export

    source = tiny_model(1)
    path = save_theirs(tmp_path / "ckpt_7038.pt", their_state_dict(source))
    config = ROOT / "configs" / "models" / "bert-tiny.json"
    with pytest.raises(ExportError, match=rf"{path} is NVIDIA's or Habana's ckpt_<step>.pt, which holds no model "
                                          r"config and no vocabulary: pass --config_file \(their bert_config.json"):
        export(path, tmp_path / "hf", vocab_file=bert_vocab)
    with pytest.raises(ExportError, match="--tag 7038 picks a tag of this project's checkpoints"):
        export(tmp_path, tmp_path / "hf", tag="7038", config_file=config, vocab_file=bert_vocab)
    one_layer = tmp_path / "one_layer.json"
    one_layer.write_text(json.dumps(TINY.to_dict() | {"num_hidden_layers": 1}))
    with pytest.raises(ExportError, match=r"its tensors are not this model's: unused bert.encoder.layer.1"):
        export(path, tmp_path / "hf", config_file=one_layer, vocab_file=bert_vocab)
    damaged = tmp_path / "damaged" / "ckpt_1.pt"
    damaged.parent.mkdir()
    damaged.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ExportError, match=r"bert-base-uncased-vocab.txt: 30522 tokens, but .*bert-demo.json says "
                                          r"vocab_size 2048; pass their bert_config.json as --config_file, or the "
                                          "vocab.txt the shards were made with as --vocab_file"):  # before any weight
        export(damaged, tmp_path / "hf", config_file=ROOT / "configs" / "models" / "bert-demo.json",
               vocab_file=bert_vocab)
    with pytest.raises(ExportError, match=r"ckpt_1.pt: cannot read it as a torch checkpoint"):
        export(damaged, tmp_path / "hf", config_file=config, vocab_file=bert_vocab)
    assert not (tmp_path / "hf").exists()
    # The command, on the directory that holds it (the highest step), as a user runs it.
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--checkpoint", str(tmp_path),
                             "--output", str(tmp_path / "hf"), "--config_file", str(config), "--vocab_file",
                             str(bert_vocab)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == (f"exported {path} (NVIDIA/Habana ckpt_<step>.pt, fp32 master weights; "
                                             f"the highest step of 1 ckpt_<step>.pt in {tmp_path})")
    assert result.stdout.splitlines()[-1] == (f"  tokenizer: lower-cases, guessed from {bert_vocab}: the shards do not "
                                              "record it; pass --do_lower_case or --no_do_lower_case if that is wrong")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    ours = source.state_dict()
    for name, value in exported.items():  # the vocabulary rows past the padding are cut
        assert torch.equal(value, ours[name][: len(value)]), name
    hf = AutoModelForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    expected = source.eval()(ids, torch.zeros_like(ids), torch.ones_like(ids))
    assert torch.allclose(hf(input_ids=ids).seq_relationship_logits, expected.nsp_logits, atol=1e-5)


def test_the_optimizer_state_beside_the_weights_is_not_read_into_memory(tmp_path):
    """Their file holds the LAMB moments and apex's masters beside the model (3x its size or more), and every
    rank reads it: torch's zip format is memory-mapped, so only the tensors used are read."""
    import subprocess

    path = tmp_path / "ckpt_1.pt"
    torch.save({"model": {"a": torch.ones(1000)}, "optimizer": {"exp_avg": torch.randn(50_000_000)}}, path)  # 200 MB
    probe = ("import re, sys; from pathlib import Path; from training.reference_checkpoint import _read\n"
             "def rss(): return int(re.search(r'VmRSS:\\s+(\\d+)', Path('/proc/self/status').read_text())[1])\n"
             "before = rss(); state = _read(Path(sys.argv[1])); assert state['model']['a'].sum() == 1000\n"
             "print((rss() - before) // 1024)")
    grown = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, check=True).stdout
    assert int(grown) < 50, f"{grown} MiB"  # about 190 MiB when read whole
