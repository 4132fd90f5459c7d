"""modeling.py: shapes, Hugging Face parity both ways, the sparse MLM head, checkpointing, configs."""

from __future__ import annotations

import json
import os
import re
import unittest.mock
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import modeling
from modeling import ActivationCheckpointing, BertConfig, BertForPreTraining, ConfigError

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = ROOT / "configs" / "models"


def small_config(**overrides) -> BertConfig:
    values = dict(
        vocab_size=1001,  # not a multiple of 8: exercises the padding
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, hidden_act="gelu",
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=64, type_vocab_size=2,
        initializer_range=0.02, layer_norm_eps=1e-12,
    )
    values.update(overrides)
    return BertConfig(**values)


def make_batch(config: BertConfig, batch=3, seq=24, preds=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch, seq), generator=g)
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq // 2:] = 1
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, seq - 6:] = 0  # padding in one row
    positions = torch.stack([torch.randperm(seq - 7, generator=g)[:preds].sort().values + 1 for _ in range(batch)])
    labels = torch.randint(5, config.vocab_size, (batch, preds), generator=g)
    labels[2, -2:] = modeling.IGNORE_INDEX  # unused prediction slots
    positions[2, -2:] = 0
    nsp = torch.tensor([0, 1, 0])[:batch]
    return input_ids, token_type_ids, attention_mask, positions, labels, nsp


def dense_labels(positions, labels, seq):
    full = torch.full((positions.shape[0], seq), modeling.IGNORE_INDEX)
    for b in range(positions.shape[0]):
        for p in range(positions.shape[1]):
            if labels[b, p] != modeling.IGNORE_INDEX:
                full[b, positions[b, p]] = labels[b, p]
    return full


def test_bert_1_5b_parameter_count_on_meta_device():
    config = BertConfig.from_json_file(MODEL_CONFIGS / "bert-1.5b.json")
    with torch.device("meta"):
        model = BertForPreTraining(config)
    n = modeling.count_parameters(model)
    # 48 layers x 30,740,800 + embeddings (30528 padded vocab, 512 positions, 2 types) + final LN + heads.
    assert n == 1_530_388_930
    assert 1.50e9 <= n <= 1.56e9
    assert config.pre_layer_norm and config.padded_vocab_size == 30528


def test_every_model_config_loads_and_bert_large_is_about_340m():
    sizes = {}
    for path in sorted(MODEL_CONFIGS.glob("*.json")):
        config = BertConfig.from_json_file(path)
        with torch.device("meta"):
            sizes[path.stem] = modeling.count_parameters(BertForPreTraining(config))
    assert {"bert-tiny", "bert-base", "bert-large", "bert-1.5b", "bert-5b"} <= set(sizes)
    assert 330e6 < sizes["bert-large"] < 345e6
    assert 108e6 < sizes["bert-base"] < 112e6
    assert 4.9e9 < sizes["bert-5b"] < 5.2e9


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post-ln-bert", "pre-ln-megatron"])
def test_hf_parity_fp32(pre_layer_norm):
    # Not HF's defaults (gelu, 1e-12), so that a field the export dropped would show in the outputs.
    config = small_config(pre_layer_norm=pre_layer_norm, hidden_act="gelu_new", layer_norm_eps=1e-3)
    torch.manual_seed(1)
    model = BertForPreTraining(config).eval()
    # LayerNorms and biases random too: at their init (1 and 0) a swapped pair would agree by accident
    _random_weights(model, seed=5)
    hf = modeling.to_hf_model(model)
    expected_cls = transformers.MegatronBertForPreTraining if pre_layer_norm else transformers.BertForPreTraining
    assert type(hf) is expected_cls
    ids, types, mask, positions, labels, nsp = make_batch(config)
    with torch.no_grad():
        ours = model(ids, types, mask, positions, labels, nsp)
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask,
                 labels=dense_labels(positions, labels, ids.shape[1]), next_sentence_label=nsp)
    ref_at_masks = torch.gather(ref.prediction_logits, 1,
                                positions.unsqueeze(-1).expand(-1, -1, config.vocab_size))
    assert ours.mlm_logits.shape == (3, 5, config.vocab_size)
    torch.testing.assert_close(ours.mlm_logits, ref_at_masks, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.nsp_logits, ref.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, ours.mlm_loss + ours.nsp_loss)


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post-ln-bert", "pre-ln-megatron"])
def test_save_hf_load_hf_round_trip(tmp_path, pre_layer_norm):
    config = small_config(pre_layer_norm=pre_layer_norm, hidden_act="relu", layer_norm_eps=1e-5, initializer_range=0.03)
    model = BertForPreTraining(config).eval()
    _random_weights(model, seed=6)
    batch = make_batch(config)
    modeling.save_hf(model, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["vocab_size"] == 1001  # the padding is stripped from exports
    assert saved["model_type"] == ("megatron-bert" if pre_layer_norm else "bert")
    assert (saved["hidden_act"], saved["layer_norm_eps"], saved["initializer_range"]) == ("relu", 1e-5, 0.03)

    # transformers itself loads it...
    hf = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "hf").eval()
    assert hf.bert.embeddings.word_embeddings.weight.shape[0] == 1001
    # ...and load_hf gives back a model with identical outputs.
    loaded = modeling.load_hf(tmp_path / "hf").eval()
    assert loaded.config == config
    # the padded vocab rows (not exported) come back as zeros, not as a fresh model's random rows
    assert loaded.bert.embeddings.word_embeddings.weight.shape[0] == 1008
    assert not loaded.bert.embeddings.word_embeddings.weight[1001:].any()
    assert not loaded.cls.predictions.bias[1001:].any()
    with torch.no_grad():
        a, b = model(*batch), loaded(*batch)
    assert torch.equal(a.mlm_logits, b.mlm_logits)
    assert torch.equal(a.nsp_logits, b.nsp_logits)
    assert torch.equal(a.loss, b.loss)


def test_save_hf_writes_a_working_tokenizer(tmp_path, bert_vocab):
    config = BertConfig.from_json_file(MODEL_CONFIGS / "bert-tiny.json")
    model = BertForPreTraining(config).eval()
    modeling.save_hf(model, tmp_path / "hf", vocab_file=bert_vocab)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert len(tokenizer) == 30522
    ids = tokenizer("The quick brown fox jumps.")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "the", "quick", "brown", "fox", "jumps", ".", "[SEP]"]
    ids = tokenizer("Don't stop: it's John's, isn't it?")["input_ids"]  # joined as BERT's tokenizer joined them
    assert tokenizer.decode(ids, skip_special_tokens=True) == "don't stop : it's john's, isn't it?"
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"))
    assert len(fill("paris is the [MASK] of france.")) == 5
    # Spelled special tokens: the special token here (fill-mask needs it), text in the shards (TRAINING.md).
    from data.tokens import WordPieceTokenizer

    spelled = "a [MASK] b [SEP] c"
    shards, _ = WordPieceTokenizer(bert_vocab, True).tokenize_sentences([spelled])
    assert tokenizer.convert_ids_to_tokens(shards.tolist()) == ["a", "[", "mask", "]", "b", "[", "sep", "]", "c"]
    special = tokenizer(spelled, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(special) == ["a", "[MASK]", "b", "[SEP]", "c"]
    assert tokenizer(spelled, add_special_tokens=False, split_special_tokens=True)["input_ids"] == shards.tolist()
    long = tokenizer("word " * 700, truncation=True)["input_ids"]  # cut to the model's positions
    assert len(long) == config.max_position_embeddings == 512
    with pytest.raises(ValueError, match="vocab_size is 1001"):
        modeling.save_hf(BertForPreTraining(small_config()), tmp_path / "bad", vocab_file=bert_vocab)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing half-written


def test_save_hf_replaces_only_an_earlier_export_and_honours_the_umask(tmp_path, bert_vocab):
    model = BertForPreTraining(BertConfig.from_json_file(MODEL_CONFIGS / "bert-tiny.json")).eval()
    run = tmp_path / "run"  # a training run's directory given as the output by mistake
    (run / "checkpoints" / "step00000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"run: holds checkpoints, metrics.jsonl, which no export writes"):
        modeling.save_hf(model, run, vocab_file=bert_vocab)
    assert (run / "checkpoints" / "step00000010").is_dir() and (run / "metrics.jsonl").is_file()
    torch.manual_seed(1)
    second = BertForPreTraining(BertConfig.from_json_file(MODEL_CONFIGS / "bert-tiny.json")).eval()
    umask = os.umask(0o022)
    try:
        for m in (model, second):  # the second export replaces the first
            out = modeling.save_hf(m, tmp_path / "hf", vocab_file=bert_vocab)
    finally:
        os.umask(umask)
    name = "bert.embeddings.word_embeddings.weight"
    exported = load_file(out / "model.safetensors")[name]
    assert torch.equal(exported, second.state_dict()[name][: len(exported)])
    assert not torch.equal(exported, model.state_dict()[name][: len(exported)])
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644, "tokenizer.json": 0o644, "tokenizer_config.json": 0o644,
        "vocab.txt": 0o644, "export_info.json": 0o644}
    assert json.loads((out / "export_info.json").read_text()) == {"written_by": "bert-pretraining (modeling.save_hf)"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


def test_save_hf_keeps_a_folder_that_only_shares_file_names_and_cleans_up_after_a_kill(tmp_path, bert_vocab):
    model = BertForPreTraining(BertConfig.from_json_file(MODEL_CONFIGS / "bert-tiny.json")).eval()
    mine = tmp_path / "mine"  # a user's folder: its vocab.txt is not an export's
    mine.mkdir()
    (mine / "vocab.txt").write_text("my words\n")
    with pytest.raises(ValueError, match=r"mine: holds vocab.txt but no export_info.json, so it is no export "):
        modeling.save_hf(model, mine, vocab_file=bert_vocab)
    assert (mine / "vocab.txt").read_text() == "my words\n"
    # A model that transformers saved (a fine-tuned one, say) has an export's file names, but is not one.
    tuned = tmp_path / "tuned"
    modeling.to_hf_model(model).save_pretrained(tuned)
    before = {p.name: p.read_bytes() for p in tuned.iterdir()}
    with pytest.raises(ValueError, match=r"tuned: holds config.json, model.safetensors but no export_info.json"):
        modeling.save_hf(model, tuned, vocab_file=bert_vocab)
    assert {p.name: p.read_bytes() for p in tuned.iterdir()} == before
    # Killed between the swap's two renames: the old export sits in .hf.old and hf is gone.
    modeling.save_hf(model, tmp_path / "hf", vocab_file=bert_vocab)
    os.replace(tmp_path / "hf", tmp_path / ".hf.old")
    modeling.save_hf(model, tmp_path / "hf", vocab_file=bert_vocab)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine", "tuned"]


def test_load_hf_from_a_transformers_model(tmp_path):
    """The other direction: a checkpoint written by transformers loads into our model."""
    hf_config = transformers.BertConfig(vocab_size=1001, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(3)
    hf = transformers.BertForPreTraining(hf_config).eval()
    hf.save_pretrained(tmp_path / "from_hf")
    ours = modeling.load_hf(tmp_path / "from_hf").eval()
    ids, types, mask, positions, labels, nsp = make_batch(ours.config, seq=20)
    with torch.no_grad():
        a = ours(ids, types, mask)
        b = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    torch.testing.assert_close(a.mlm_logits, b.prediction_logits, atol=1e-5, rtol=1e-5)


def test_an_untied_output_layer_is_refused(tmp_path):
    hf_config = transformers.BertConfig(vocab_size=1001, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.BertForPreTraining(hf_config)
    with torch.no_grad():
        hf.cls.predictions.decoder.weight.add_(1.0)
    hf.save_pretrained(tmp_path / "untied")
    with pytest.raises(ConfigError, match="decoder.weight\\) is not tied"):
        modeling.load_hf(tmp_path / "untied")


@pytest.mark.parametrize("changes", [{"is_decoder": True}, {"is_decoder": True, "add_cross_attention": True}],
                         ids=["decoder", "cross-attention"])
def test_a_decoder_bert_is_refused(tmp_path, changes):
    """transformers makes a BERT with is_decoder attend causally (and add_cross_attention adds weights for
    an encoder's states); this model is a bidirectional encoder, so loading one would change its outputs."""
    hf_config = transformers.BertConfig(vocab_size=1001, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=64, **changes)
    transformers.BertForPreTraining(hf_config).save_pretrained(tmp_path / "decoder")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'decoder' / 'config.json'))}: is_decoder is "
                                          "true"):
        modeling.load_hf(tmp_path / "decoder")


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "silu"}, r"hidden_act 'silu' is not one of \['gelu', 'gelu_new', 'gelu_pytorch_tanh', 'relu'\]"),
    ({"position_embedding_type": "relative_key"}, r"position_embedding_type 'relative_key' is not supported"),
], ids=["hidden_act", "position_embedding_type"])
def test_a_hugging_face_config_this_model_does_not_implement_is_refused_naming_its_file(tmp_path, changes, message):
    hf_config = transformers.BertConfig(vocab_size=1001, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=64, **changes)
    transformers.BertForPreTraining(hf_config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'hf' / 'config.json'))}: .*{message}"):
        modeling.load_hf(tmp_path / "hf")


def test_no_nsp_builds_no_head_and_exports_as_masked_lm(tmp_path):
    config = small_config(next_sentence_prediction=False)
    model = BertForPreTraining(config).eval()
    names = [n for n, _ in model.named_parameters()]
    assert not any("pooler" in n or "seq_relationship" in n for n in names)
    ids, types, mask, positions, labels, nsp = make_batch(config)
    out = model(ids, types, mask, positions, labels)
    assert out.nsp_loss is None and out.nsp_logits is None
    assert torch.equal(out.loss, out.mlm_loss)
    with pytest.raises(ValueError, match="next_sentence_prediction"):
        model(ids, types, mask, positions, labels, nsp)
    modeling.save_hf(model, tmp_path / "mlm")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm")
    assert type(hf) is transformers.BertForMaskedLM
    loaded = modeling.load_hf(tmp_path / "mlm").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids, types, mask, positions, labels).loss, model(ids, types, mask, positions, labels).loss)


def test_sparse_mlm_head_equals_dense_reference():
    config = small_config()
    model = BertForPreTraining(config).eval()
    ids, types, mask, positions, labels, nsp = make_batch(config)
    with torch.no_grad():
        sparse = model(ids, types, mask, positions, labels, nsp)
        dense = model(ids, types, mask)  # no positions: logits at every position
    assert dense.mlm_logits.shape == (3, ids.shape[1], config.vocab_size)
    reference = torch.nn.functional.cross_entropy(
        dense.mlm_logits.reshape(-1, config.vocab_size), dense_labels(positions, labels, ids.shape[1]).reshape(-1),
        ignore_index=modeling.IGNORE_INDEX)
    torch.testing.assert_close(sparse.mlm_loss, reference, atol=1e-6, rtol=1e-6)


def test_decoder_is_tied_to_word_embeddings_and_bias_is_separate():
    config = small_config()
    model = BertForPreTraining(config)
    params = dict(model.named_parameters())
    assert "cls.predictions.bias" in params
    assert not any("decoder" in n for n in params)  # one matrix, registered once
    assert params["bert.embeddings.word_embeddings.weight"].shape == (1008, 64)  # padded to a multiple of 8
    ids, types, mask, positions, labels, nsp = make_batch(config)
    model(ids, types, mask, positions, labels, nsp).mlm_loss.backward()
    emb_grad = params["bert.embeddings.word_embeddings.weight"].grad
    # Rows never used as input still get gradient through the tied decoder; padded rows get none.
    unused = sorted(set(range(config.vocab_size)) - set(ids.flatten().tolist()))
    assert emb_grad[unused].abs().sum() > 0
    assert emb_grad[config.vocab_size:].abs().sum() == 0


def test_initialisation():
    config = BertConfig.from_json_file(MODEL_CONFIGS / "bert-tiny.json")
    model = BertForPreTraining(config)
    w = model.bert.encoder.layer[0].intermediate.dense.weight
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    emb = model.bert.embeddings.word_embeddings.weight
    assert abs(emb.std().item() - 0.02) < 0.001
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0)
        if isinstance(module, torch.nn.Linear):
            assert torch.all(module.bias == 0)
    assert torch.all(model.cls.predictions.bias == 0)


def _loss_and_grads(config, checkpointing, batch, seed=7):
    torch.manual_seed(0)
    model = BertForPreTraining(config, checkpointing=checkpointing).train()  # dropout on
    torch.manual_seed(seed)
    out = model(*batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


LAYOUTS = {"post-ln": {}, "pre-ln-megatron": {"pre_layer_norm": True}, "pre-ln-habana": {"layer_norm_large_model": True}}


def _segments_run(config, checkpointing, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """_loss_and_grads, and how many times each checkpointed segment of layers ran (forward, then again in
    backward), through modeling's torch_checkpoint wrapped to count."""
    runs: list[int] = []
    real = modeling.torch_checkpoint

    def counting(fn, *args, **kwargs):
        segment = len(runs)
        runs.append(0)

        def counted(*inputs):
            runs[segment] += 1
            return fn(*inputs)
        return real(counted, *args, **kwargs)

    with unittest.mock.patch.object(modeling, "torch_checkpoint", counting):
        loss, grads = _loss_and_grads(config, checkpointing, batch)
    return loss, grads, runs


def assert_checkpointing_matches(interval: int, layout: str) -> None:
    config = small_config(**LAYOUTS[layout])
    batch = make_batch(config)
    loss_ref, grads_ref, runs = _segments_run(config, ActivationCheckpointing(enabled=False), batch)
    assert runs == []
    loss, grads, runs = _segments_run(config, ActivationCheckpointing(enabled=True, interval=interval), batch)
    # Checkpointing happened, in segments of `interval` layers, each recomputed once in backward: without this
    # the comparison below also held with checkpointing switched off, or the interval ignored (found by an audit).
    assert runs == [2] * -(-config.num_hidden_layers // interval), (config.num_hidden_layers, interval)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-7, rtol=1e-6, msg=name)


@pytest.mark.parametrize("interval,layout", [(1, "post-ln"), (2, "pre-ln-megatron"), (3, "post-ln"),
                                             (1, "pre-ln-habana"), (2, "pre-ln-habana")])
def test_torch_activation_checkpointing_gives_identical_loss_and_gradients(interval, layout):
    assert_checkpointing_matches(interval, layout)


def _habana_reference(state: dict[str, torch.Tensor], config: BertConfig, input_ids: torch.Tensor,
                      token_type_ids: torch.Tensor, attention_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Habana deepspeed-bert's forward with layer_norm_large_model true (Model-References
    PyTorch/nlp/DeepSpeedExamples/deepspeed-bert/modeling.py: BertEmbeddings, BertSelfOutput, BertOutput,
    BertEncoder), in eval mode, from plain torch ops on our state dict: (MLM logits at every position, NSP logits)."""
    def w(name: str) -> torch.Tensor:
        return state[name]

    def linear(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return x @ w(prefix + ".weight").T + w(prefix + ".bias")

    def layer_norm(x: torch.Tensor, prefix: str) -> torch.Tensor:  # their BertLayerNorm, written out
        u = x.mean(-1, keepdim=True)
        var = ((x - u) ** 2).mean(-1, keepdim=True)
        return (x - u) / torch.sqrt(var + config.layer_norm_eps) * w(prefix + ".weight") + w(prefix + ".bias")

    def gelu(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.erf(x / 2 ** 0.5))

    b, s = input_ids.shape
    n, d = config.num_attention_heads, config.head_dim
    e = "bert.embeddings."
    x = w(e + "word_embeddings.weight")[input_ids] + w(e + "position_embeddings.weight")[torch.arange(s)] \
        + w(e + "token_type_embeddings.weight")[token_type_ids]
    x = layer_norm(x, e + "LayerNorm")
    additive_mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
    r = 0  # their layer_norm_input: the embeddings never enter the residual stream
    for i in range(config.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        q, k, v = (linear(x, p + f"attention.self.{m}").reshape(b, s, n, d).permute(0, 2, 1, 3)
                   for m in ("query", "key", "value"))
        probs = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5 + additive_mask, dim=-1)
        context = (probs @ v).permute(0, 2, 1, 3).reshape(b, s, n * d)
        r = linear(context, p + "attention.output.dense") + r
        x = layer_norm(r, p + "attention.output.LayerNorm")
        r = linear(gelu(linear(x, p + "intermediate.dense")), p + "output.dense") + r
        x = layer_norm(r, p + "output.LayerNorm")
    t = layer_norm(gelu(linear(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    mlm = t @ w(e + "word_embeddings.weight").T + w("cls.predictions.bias")
    nsp = linear(torch.tanh(linear(x[:, 0], "bert.pooler.dense")), "cls.seq_relationship")
    return mlm[..., : config.vocab_size], nsp


def _random_weights(model: BertForPreTraining, seed: int) -> None:
    """Every parameter random (LayerNorms and biases too, which the init sets to 1 and 0): a block that skips or
    swaps one of them cannot agree with the reference by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if name.endswith(("LayerNorm.weight", "ln.weight")) else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + scale)


def test_habana_pre_ln_block_matches_their_forward_reimplemented_from_their_code():
    """Logits and the gradients of every parameter, against the reference on the same (random) values."""
    config = small_config(layer_norm_large_model=True, layer_norm_eps=1e-5)
    model = BertForPreTraining(config).eval()
    _random_weights(model, seed=3)
    input_ids, token_type_ids, attention_mask, *_ = make_batch(config)
    state = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    out = model(input_ids, token_type_ids, attention_mask)
    mlm, nsp = _habana_reference(state, config, input_ids, token_type_ids, attention_mask)
    torch.testing.assert_close(out.mlm_logits, mlm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.nsp_logits, nsp, atol=1e-5, rtol=1e-5)
    assert mlm.abs().max() > 1.0  # not a comparison of two near-zero outputs
    g = torch.Generator().manual_seed(5)
    probe_mlm, probe_nsp = torch.randn(mlm.shape, generator=g), torch.randn(nsp.shape, generator=g)
    ((out.mlm_logits * probe_mlm).sum() + (out.nsp_logits * probe_nsp).sum()).backward()
    ((mlm * probe_mlm).sum() + (nsp * probe_nsp).sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, state[name].grad, atol=1e-3, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_the_three_layouts_compute_different_functions_of_shared_tensors():
    """Habana's and Megatron's pre-LN blocks and post-LN, on the same values for the tensors they share: any
    silent fallback of one layout to another changes the logits."""
    habana = BertForPreTraining(small_config(layer_norm_large_model=True))
    _random_weights(habana, seed=3)
    shared = habana.state_dict()
    batch = make_batch(habana.config)
    logits = {}
    for layout, switch in LAYOUTS.items():
        model = BertForPreTraining(small_config(**switch)).eval()
        _random_weights(model, seed=4)  # Megatron's own LayerNorms
        model.load_state_dict({k: v for k, v in shared.items() if k in model.state_dict()}, strict=False)
        with torch.no_grad():
            logits[layout] = model(*batch[:3]).mlm_logits
    assert not torch.allclose(logits["pre-ln-habana"], logits["post-ln"], atol=1e-2)
    assert not torch.allclose(logits["pre-ln-habana"], logits["pre-ln-megatron"], atol=1e-2)


def test_habana_pre_ln_has_post_ln_parameters():
    shapes = {layout: {k: v.shape for k, v in BertForPreTraining(small_config(**switch)).named_parameters()}
              for layout, switch in LAYOUTS.items()}
    assert shapes["pre-ln-habana"] == shapes["post-ln"]
    assert shapes["pre-ln-habana"].keys() != shapes["pre-ln-megatron"].keys()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_autocast_keeps_the_residual_stream_in_fp32_in_every_layout(layout):
    """Under autocast the residual stream, which the encoder's last LayerNorm normalizes, is fp32 (post-LN:
    a LayerNorm output plus a bf16 sublayer; Megatron: from the embeddings; Habana: r, from a zero tensor of the
    embeddings' dtype); a bf16 model keeps it in bf16."""
    config = small_config(**LAYOUTS[layout])
    model = BertForPreTraining(config).eval()
    encoder = model.bert.encoder
    last_ln = encoder.ln if config.pre_layer_norm else encoder.layer[-1].output.LayerNorm
    seen: list[torch.dtype] = []
    hook = last_ln.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].dtype))
    batch = make_batch(config)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(*batch[:3])
    with torch.no_grad():
        model.to(torch.bfloat16)(*batch[:3])
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]


def test_activation_checkpointing_lowers_peak_memory():
    """Peak tensor memory of one forward+backward (8 layers, 8 x 512 tokens), from the allocator's events.

    Process RSS is not used: freed blocks stay in the C allocator's heap, which hides most of the saving.
    """
    from training.planner import profile_peak_bytes

    config = small_config(vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                          intermediate_size=1024, max_position_embeddings=512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (8, 512), generator=g)
    inputs = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.arange(20).repeat(8, 1),
              torch.randint(0, 1024, (8, 20), generator=g), torch.zeros(8, dtype=torch.long))
    peak = {}
    for setting in ("off", "on"):
        torch.manual_seed(0)
        model = BertForPreTraining(config, ActivationCheckpointing(enabled=setting == "on")).train()
        peak[setting] = profile_peak_bytes(lambda m=model: m(*inputs).loss.backward())
    # Without checkpointing every layer keeps ~15 activations of 8x512x256 floats, the 1024-wide FFN ones
    # and three 8x4x512x512 attention tensors (measured 1438 MB); with it, one layer's (measured 234 MB).
    assert peak["off"] > 1000e6, peak
    assert peak["on"] < 0.25 * peak["off"], peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_composed_cpu_attention_equals_sdpa(dtype):
    """The CPU training path (matmul, softmax, dropout, matmul) against SDPA, with a padding mask:
    equal without drops, and with dropout 0.5 it zeroes about half the probabilities (seen through v = identity)."""
    from modeling import _composed_attention

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 16, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 16, 8, generator=g, dtype=dtype, requires_grad=True)
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[1, ..., 10:] = False
    ours = _composed_attention(q, k, v, mask, dropout_p=1e-12)
    ref = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.detach(), ref, **tol)
    ours.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))

    eye = torch.eye(16, dtype=torch.float32).expand(2, 3, 16, 16)
    probs = _composed_attention(q.detach().float(), k.detach().float(), eye, mask, dropout_p=0.5)
    assert probs[1, ..., 10:].abs().max() == 0  # masked keys get no weight
    kept = (probs[0] > 0).float().mean().item()
    assert 0.4 < kept < 0.6
    assert torch.allclose(probs[0][probs[0] > 0], 2 * torch.softmax(
        q.detach().float()[0] @ k.detach().float()[0].transpose(-1, -2) / 8 ** 0.5, -1)[probs[0] > 0], atol=1e-5)


def test_bf16_weights_give_fp32_loss_close_to_fp32():
    config = small_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(config).eval()
    batch = make_batch(config)
    with torch.no_grad():
        ref = model(*batch)
        out = model.to(torch.bfloat16)(*batch)
    assert out.mlm_logits.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32 and out.mlm_loss.dtype == torch.float32
    assert torch.isfinite(out.loss)
    assert abs(out.loss.item() - ref.loss.item()) < 0.05 * ref.loss.item()


def test_mlm_accuracy_counts_only_real_predictions():
    config = small_config()
    model = BertForPreTraining(config).eval()
    ids, types, mask, positions, labels, nsp = make_batch(config)
    with torch.no_grad():
        logits = model(ids, types, mask, positions).mlm_logits
    perfect = logits.argmax(-1)
    perfect[2, -2:] = modeling.IGNORE_INDEX
    perfect[0, 0] = (perfect[0, 0] + 1) % config.vocab_size  # one wrong out of 13 real predictions
    with torch.no_grad():
        out = model(ids, types, mask, positions, perfect)
    assert out.mlm_accuracy.item() == pytest.approx(12 / 13)


# ----------------------------------------------------------------------------- config files


def write_config(tmp_path, **changes) -> Path:
    values = json.loads((MODEL_CONFIGS / "bert-tiny.json").read_text())
    for key, value in changes.items():
        if value is None:
            values.pop(key)
        else:
            values[key] = value
    path = tmp_path / "model.json"
    path.write_text(json.dumps(values))
    return path


def test_config_json_round_trip(tmp_path):
    config = BertConfig.from_json_file(MODEL_CONFIGS / "bert-1.5b.json")
    config.to_json_file(tmp_path / "out.json")
    assert BertConfig.from_json_file(tmp_path / "out.json") == config
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads((MODEL_CONFIGS / "bert-1.5b.json").read_text())


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": 129}, r"hidden_size 129 is not divisible by num_attention_heads 2; choose heads that divide "
                           r"it \(the nearest: 1 or 3\)$"),
    # the divisors nearest the heads given, not the largest ones up to 64 ("e.g. [8, 16, 32, 64]" for 3)
    ({"hidden_size": 128, "num_attention_heads": 3}, r"num_attention_heads 3; choose heads that divide it \(the "
                                                     r"nearest: 2 or 4\)$"),
    ({"hidden_size": 128, "num_attention_heads": 200}, r"num_attention_heads 200; choose heads that divide it \(the "
                                                       r"nearest: 128\)$"),
    ({"num_hidden_layers": None}, r"missing field\(s\) num_hidden_layers"),
    ({"hiden_size": 128}, r"unknown field\(s\) 'hiden_size' \(did you mean 'hidden_size'\?\); known fields: "),
    # a Hugging Face config.json: its own fields are named as such, not taken for misspelt ones of ours
    ({"model_type": "bert", "position_embedding_type": "absolute", "hiden_size": 128},
     r": Hugging Face field\(s\) model_type, position_embedding_type: for a Hugging Face config.json, keep only the "
     r"known fields .* --init_checkpoint <its directory>; unknown field\(s\) 'hiden_size' \(did you mean "
     r"'hidden_size'\?\); known fields: vocab_size, "),
    ({"hidden_act": "swish2"}, r"hidden_act 'swish2' is not one of"),
    ({"num_attention_heads": "2"}, r"field 'num_attention_heads' must be int"),
    ({"hidden_dropout_prob": 1.5}, r"hidden_dropout_prob' must be in \[0, 1\)"),
    ({"initializer_range": -0.02}, r"field 'initializer_range' must be positive, got -0.02"),
    ({"layer_norm_eps": -1e-12}, r"field 'layer_norm_eps' must be positive, got -1e-12"),
])
def test_bad_configs_give_clear_errors(tmp_path, changes, message):
    path = write_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as info:
        BertConfig.from_json_file(path)
    assert str(path) in str(info.value)


# NVIDIA DeepLearningExamples' bert_configs/large.json and Habana's scripts/bert_1.5b_config.json, as
# they are: BERT's field names, no layer_norm_eps (their code fixes 1e-12), Habana's pre-LN switch (ours too).
NVIDIA_LARGE = {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096,
                "max_position_embeddings": 512, "num_attention_heads": 16, "num_hidden_layers": 24,
                "type_vocab_size": 2, "vocab_size": 30522}
HABANA_1_5B = {"hidden_size": 1600, "hidden_act": "gelu", "initializer_range": 0.02, "vocab_size": 30522,
               "hidden_dropout_prob": 0.1, "num_attention_heads": 25, "type_vocab_size": 2,
               "max_position_embeddings": 512, "num_hidden_layers": 48, "intermediate_size": 6400,
               "attention_probs_dropout_prob": 0.1, "layer_norm_large_model": True}


def test_reference_configs_are_refused_with_the_field_to_add_and_then_load_as_the_shipped_configs(tmp_path):
    """The value of the field their JSONs omit; with it written, they load as the shipped configs: Habana's
    layer_norm_large_model is our field of the same name and meaning."""
    nvidia, habana = tmp_path / "large.json", tmp_path / "bert_1.5b_config.json"
    nvidia.write_text(json.dumps(NVIDIA_LARGE))
    habana.write_text(json.dumps(HABANA_1_5B))
    eps = ("missing field(s) layer_norm_eps; add them to the JSON, e.g. \"layer_norm_eps\": 1e-12 (BERT's; NVIDIA's "
           "and Habana's code fix it, their JSONs omit it)")
    for path in (nvidia, habana):
        with pytest.raises(ConfigError, match=f"^{re.escape(f'{path}: {eps}')}$"):
            BertConfig.from_json_file(path)
    fixed = BertConfig.from_dict(NVIDIA_LARGE | {"layer_norm_eps": 1e-12})
    assert fixed == BertConfig.from_json_file(MODEL_CONFIGS / "bert-large.json")
    fixed = BertConfig.from_dict(HABANA_1_5B | {"layer_norm_eps": 1e-12})
    assert fixed.layer_norm_large_model and not fixed.pre_layer_norm
    assert fixed == BertConfig.from_json_file(MODEL_CONFIGS / "bert-1.5b-deepspeed-bert.json")


def test_both_pre_ln_switches_are_refused_naming_each_block():
    with pytest.raises(ConfigError, match=r"^cfg.json: fields 'pre_layer_norm' and 'layer_norm_large_model' are both "
                                          r"true, but they are two different blocks: pre_layer_norm is Megatron-BERT's "
                                          r".*layer_norm_large_model is Habana deepspeed-bert's .*; set one of them "
                                          r"to false$"):
        BertConfig.from_dict(small_config().to_dict() | {"pre_layer_norm": True, "layer_norm_large_model": True},
                             source="cfg.json")


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read model config"):
        BertConfig.from_json_file(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"vocab_size": 10,')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(line 1"):
        BertConfig.from_json_file(bad)


@pytest.mark.parametrize("text, lower_case", [
    ("कुछ लोग यहाँ रहते हैं। वे हिंदी बोलते हैं और किताबें पढ़ते हैं।\n", False),  # no capitals, but marks
    ("Café owners in Zürich read Books. The NAÏVE reader smiles.\n", False),
    ("Café owners in Zürich read Books. The NAÏVE reader smiles.\n", True),
])
def test_the_exported_tokenizer_tokenizes_as_the_shards_were(tmp_path, text, lower_case):
    """The export infers lower-casing from the vocab alone; for vocabs data.vocab trains, with or
    without --no_lower_case, it must give the ids data.tokens gave the shards."""
    from transformers import AutoTokenizer

    from data import segment, stage
    from data.tokens import WordPieceTokenizer
    from data.vocab import VocabConfig, build_vocab

    corpus = tmp_path / "sentences"
    corpus.mkdir()
    (corpus / "part-00000.txt").write_text(text * 20, encoding="utf-8")
    stage.finish(corpus, {stage.VERSION_KEY: segment.FORMAT_VERSION}, {})
    vocab = build_vocab(VocabConfig(tmp_path / "vocab", corpus_dir=corpus, vocab_size=120, lower_case=lower_case,
                                    min_frequency=1))
    modeling.save_tokenizer(vocab.path, tmp_path / "hf", 128)
    ids, _ = WordPieceTokenizer(vocab.path, lower_case).tokenize_sentences([text.strip()])
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported(text.strip(), add_special_tokens=False)["input_ids"] == ids.tolist()
    assert exported.unk_token_id not in ids.tolist()
    # The export's vocab.txt is the run's, and a tool that reads only it (tokenizer.json gone, as for
    # transformers 4.x's slow BertTokenizer) with tokenizer_config.json's casing gets the same ids.
    assert (tmp_path / "hf" / "vocab.txt").read_text(encoding="utf-8") == vocab.path.read_text(encoding="utf-8")
    (tmp_path / "hf" / "tokenizer.json").unlink()
    from_vocab = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert from_vocab(text.strip(), add_special_tokens=False)["input_ids"] == ids.tolist()


def test_the_exported_tokenizer_lower_cases_as_a_run_with_a_few_stray_cased_tokens_did(tmp_path, bert_vocab):
    """data.prepare lower-cases with a given vocab that holds a few cased tokens (up to 1%); the export must
    too, or every capitalised word of a user's text becomes [UNK] or other pieces than in training."""
    from transformers import AutoTokenizer

    from data.tokens import WordPieceTokenizer
    from data.vocab import check_case, load_vocab

    lines = bert_vocab.read_text(encoding="utf-8").splitlines()
    lines[lines.index("gunners")] = "McDonald"  # one custom cased token
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    check_case(load_vocab(vocab), lower_case=True)  # a lower-cased run accepts it
    modeling.save_tokenizer(vocab, tmp_path / "hf", 512)
    text = "The Quick brown Fox in Zürich"
    ids, _ = WordPieceTokenizer(vocab, lower_case=True).tokenize_sentences([text])
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.convert_ids_to_tokens(exported(text, add_special_tokens=False)["input_ids"]) == [
        "the", "quick", "brown", "fox", "in", "zurich"] == exported.convert_ids_to_tokens(ids.tolist())
    # tokenizer.json itself, as the tokenizers library and other readers of the file take it (transformers 5
    # rebuilds the normalizer from tokenizer_config.json, which would hide a file that keeps accents)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids == ids.tolist()


def test_the_exported_tokenizer_keeps_case_when_told_whatever_the_vocab_suggests(tmp_path, bert_vocab):
    """A --no_lower_case run with that vocab: its shards say so (lower_case 0), the export is told, and its
    tokenizer gives the ids the shards were made with, though the vocab alone looks uncased."""
    from transformers import AutoTokenizer

    from data.tokens import WordPieceTokenizer

    lines = bert_vocab.read_text(encoding="utf-8").splitlines()
    lines[lines.index("gunners")] = "McDonald"
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert modeling.vocab_lower_cases(vocab)  # the guess for shards that do not say
    modeling.save_tokenizer(vocab, tmp_path / "hf", 512, lower_case=False)
    text = "McDonald and the Fox in zürich"
    ids, _ = WordPieceTokenizer(vocab, lower_case=False).tokenize_sentences([text])
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported(text, add_special_tokens=False)["input_ids"] == ids.tolist()
    assert exported.convert_ids_to_tokens(ids.tolist()) == ["McDonald", "and", "the", "[UNK]", "in", "[UNK]"]  # nor accents stripped
    (tmp_path / "hf" / "tokenizer.json").unlink()  # tools that read only vocab.txt and tokenizer_config.json
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text, add_special_tokens=False)["input_ids"] == ids.tolist()


def test_checkpointing_under_torch_compile_traces_into_one_graph_with_the_same_gradients():
    """HPU eager mode runs the model through torch.compile: the checkpointed encoder must trace into one graph
    (a graph break inside a checkpoint runs the model eager) and give the gradients of the model without it."""
    config = small_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=g)
    inputs = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.arange(5).repeat(2, 1),
              torch.randint(0, config.vocab_size, (2, 5), generator=g), torch.zeros(2, dtype=torch.long))
    torch.manual_seed(0)
    plain = BertForPreTraining(config).train()
    checkpointed = BertForPreTraining(config, ActivationCheckpointing(enabled=True)).train()
    checkpointed.load_state_dict(plain.state_dict())
    plain(*inputs).loss.backward()
    torch.compile(checkpointed, backend="aot_eager", fullgraph=True)(*inputs).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
