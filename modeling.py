"""BERT for pretraining (MLM + NSP), post-LN (classic BERT), pre-LN (Megatron-style, `pre_layer_norm`) or
Habana deepspeed-bert's pre-LN (`layer_norm_large_model`).

Parameter names equal Hugging Face's: post-LN matches `transformers.BertForPreTraining`,
pre-LN matches `transformers.MegatronBertForPreTraining`, so weights map one to one
(`save_hf` / `load_hf` at the bottom of this file). Habana's pre-LN block has post-LN BERT's parameters
but no transformers counterpart, so it is not exported (`check_hf_exportable`).

Two departures from the reference implementations, both for speed:
- the MLM head gathers the masked positions first and only transforms and decodes those
  (20 of 128 positions in phase 1), instead of decoding every position;
- attention is `torch.nn.functional.scaled_dot_product_attention` (fused kernels on accelerators;
  on CPU with attention dropout, a plain composition that is faster there).
The vocabulary is padded to a multiple of `pad_vocab_size_multiple` inside the model
(30522 -> 30528); logits, losses and exports only ever see the real `vocab_size` rows. NVIDIA's and
Habana's MLM softmax runs over the padded rows too: theirs learn to score low, ours get no gradient
(weight decay alone), and the loss at a uniform start differs by ln(30528/30522), 2e-4.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from training.atomic import atomic_write_text, replace_dir

IGNORE_INDEX = -100  # masked_lm_labels value for "no prediction at this slot"

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class ConfigError(ValueError):
    """A model config that cannot build a model; the message names the file, field and fix."""


# Fields of a Hugging Face BERT config.json that are not ours: named as such rather than with a guess at a
# misspelt field of ours ("position_embedding_type": did you mean "max_position_embeddings"?).
_HF_ONLY_FIELDS = frozenset({"architectures", "model_type", "transformers_version", "position_embedding_type",
                             "pad_token_id", "use_cache", "gradient_checkpointing", "classifier_dropout",
                             "torch_dtype", "dtype", "is_decoder", "add_cross_attention"})
_MISSING_FIELD_HINTS = {
    "layer_norm_eps": "\"layer_norm_eps\": 1e-12 (BERT's; NVIDIA's and Habana's code fix it, their JSONs omit it)",
}
# What each of the two pre-LN switches builds, for the error when both are set.
_PRE_LN_LAYOUTS = ("pre_layer_norm is Megatron-BERT's pre-LN block (the raw embeddings start the residual stream, a "
                   "LayerNorm before each sublayer and a final one; exported as transformers' MegatronBert); "
                   "layer_norm_large_model is Habana deepspeed-bert's (their bert_1.5b_config.json: normalized "
                   "embeddings outside the residual stream, a LayerNorm of the stream after each sublayer; "
                   "post-LN parameter names)")


def _nearest_divisors(size: int, n: int) -> list[int]:
    """The divisors of `size` nearest to `n` (which does not divide it): the largest below and, where `n` is
    below `size`, the smallest above."""
    below = next(d for d in range(min(n, size), 0, -1) if size % d == 0)
    above = next((d for d in range(n + 1, size + 1) if size % d == 0), None)
    return [below] if above is None else [below, above]


@dataclass
class BertConfig:
    """Model shape. Field names are Hugging Face's BertConfig names, but for the last four: three of ours and
    Habana deepspeed-bert's layer_norm_large_model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    hidden_dropout_prob: float
    attention_probs_dropout_prob: float
    max_position_embeddings: int
    type_vocab_size: int
    initializer_range: float
    layer_norm_eps: float
    pre_layer_norm: bool = False  # pre-LN (Megatron) blocks: stable at 48+ layers
    next_sentence_prediction: bool = True  # False builds no pooler and no NSP head
    pad_vocab_size_multiple: int = 8
    # Habana deepspeed-bert's pre-LN block (their flag, their meaning): see BertLayer.forward_split_residual.
    layer_norm_large_model: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str = "BertConfig") -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = {"int": int, "float": (int, float), "str": str, "bool": bool}[str(f.type)]
            if isinstance(value, bool) and expected is not bool or not isinstance(value, expected):
                raise ConfigError(f"{source}: field '{f.name}' must be {f.type}, got {value!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size",
                     "pad_vocab_size_multiple", "initializer_range", "layer_norm_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{source}: field '{name}' must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{source}: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; choose heads that divide it (the nearest: "
                f"{' or '.join(map(str, _nearest_divisors(self.hidden_size, self.num_attention_heads)))})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act {self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{source}: field '{name}' must be in [0, 1), got {getattr(self, name)}")
        if self.pre_layer_norm and self.layer_norm_large_model:
            raise ConfigError(f"{source}: fields 'pre_layer_norm' and 'layer_norm_large_model' are both true, but they "
                              f"are two different blocks: {_PRE_LN_LAYOUTS}; set one of them to false")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> BertConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        problems = []  # all of them at once: a config may have a field to remove and one to add
        hf_only = [k for k in values if k in _HF_ONLY_FIELDS]
        if hf_only:
            problems.append(f"Hugging Face field(s) {', '.join(hf_only)}: for a Hugging Face config.json, keep only "
                            "the known fields (listed at the end; this model is a bidirectional BERT with absolute "
                            "positions), or start phase 2 from that model with --init_checkpoint <its directory>")
        unknown = [k for k in values if k not in names and k not in _HF_ONLY_FIELDS]
        if unknown:
            hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
            hint = "; ".join(f"'{k}'" + (f" (did you mean '{v[0]}'?)" if v else "") for k, v in hints.items())
            problems.append(f"unknown field(s) {hint}")
        if hf_only or unknown:
            problems.append(f"known fields: {', '.join(names)}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if k not in values]
        if missing:
            hints = [_MISSING_FIELD_HINTS[k] for k in missing if k in _MISSING_FIELD_HINTS]
            problems.append(f"missing field(s) {', '.join(missing)}; add them to the JSON"
                            + (f", e.g. {', '.join(hints)}" if hints else ""))
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        config = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            setattr(config, f.name, values.get(f.name, f.default))
        config.validate(source)
        return config

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> BertConfig:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read model config ({e.strerror})") from e
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a JSON object of config fields")
        return cls.from_dict(values, source=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json_file(self, path: str | os.PathLike) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class ActivationCheckpointing:
    """Recompute encoder activations in backward (torch.utils.checkpoint, reentrant). `interval` layers
    form one checkpointed segment, whose input alone is kept (with layer_norm_large_model, its two inputs:
    the layer input and the residual stream)."""

    enabled: bool = False
    interval: int = 1

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"activation checkpointing interval must be >= 1, got {self.interval}")


class PreTrainingOutput(NamedTuple):
    """A tuple, not a dataclass: DeepSpeed's engine runs its backward prologue (for BF16_Optimizer:
    zeroing the bf16 gradients of the previous micro batch) from hooks that it registers only on
    tensors it finds in tuples, lists and dicts of the forward's output."""

    loss: torch.Tensor | None
    mlm_loss: torch.Tensor | None
    nsp_loss: torch.Tensor | None
    mlm_accuracy: torch.Tensor | None
    mlm_logits: torch.Tensor  # [batch, predictions, vocab_size] (or [batch, seq, vocab] with no positions)
    nsp_logits: torch.Tensor | None  # [batch, 2]


# ----------------------------------------------------------------------------- modules
# Nesting mirrors transformers' modeling_bert / modeling_megatron_bert so names match.


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        # Megatron's pre-LN BERT has no LayerNorm on the embeddings.
        self.LayerNorm = None if config.pre_layer_norm else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)
        if self.LayerNorm is not None:
            x = self.LayerNorm(x)
        return self.dropout(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and x.device.type == "cpu":
            out = _composed_attention(q, k, v, attn_mask, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        return out.transpose(1, 2).reshape(b, s, h)


def _composed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                        dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) with dropout, times v, as four plain operators.

    Used on CPU with attention dropout only: PyTorch's CPU SDPA has no fused kernel with dropout and
    falls back to a math path that computes in fp32; this composition stays in the input dtype and
    took 0.66x SDPA's time in bf16 (docs/PERFORMANCE.md). Accelerators keep SDPA's fused kernels.
    """
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    if attn_mask is not None:
        scores.masked_fill_(~attn_mask, torch.finfo(scores.dtype).min)  # in place: matmul saves its inputs only
    probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p, training=True)
    return torch.matmul(probs, v)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = None if config.pre_layer_norm else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.dense(x)) + residual
        return x if self.LayerNorm is None else self.LayerNorm(x)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.pre_layer_norm else None
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        normed = x if self.ln is None else self.ln(x)
        return self.output(self.self(normed, attn_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.pre_layer_norm else None
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, attn_mask)
        normed = x if self.ln is None else self.ln(x)
        return self.output(self.intermediate(normed), x)

    def forward_split_residual(self, x: torch.Tensor, r: torch.Tensor, attn_mask: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Habana deepspeed-bert's pre-LN block (layer_norm_large_model), in post-LN BERT's modules: the
        sublayers read `x`, their outputs are added to the residual stream `r`, and each LayerNorm normalizes
        `r` into the next `x`."""
        attn, out = self.attention.output, self.output
        r = r + attn.dropout(attn.dense(self.attention.self(x, attn_mask)))
        x = attn.LayerNorm(r)
        r = r + out.dropout(out.dense(self.intermediate(x)))
        return out.LayerNorm(r), r


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, checkpointing: ActivationCheckpointing):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.pre_layer_norm else None
        self.split_residual = config.layer_norm_large_model
        self.checkpointing = checkpointing

    def _run_layers(self, start: int, end: int):
        def run(x: torch.Tensor, r: torch.Tensor | None, attn_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
            for layer in self.layer[start:end]:
                if r is None:
                    x = layer(x, attn_mask)
                else:
                    x, r = layer.forward_split_residual(x, r, attn_mask)
            return x, r
        return run

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        # Habana's block keeps the (normalized) embeddings out of the residual stream, which starts at zero.
        # zeros_like, not their integer 0: the stream then has the embeddings' dtype (fp32 under autocast) from
        # layer 0 on, as in the other layouts.
        r = torch.zeros_like(x) if self.split_residual else None
        ckpt = self.checkpointing
        if not (ckpt.enabled and self.training and torch.is_grad_enabled()):
            x, r = self._run_layers(0, len(self.layer))(x, r, attn_mask)
        else:
            for start in range(0, len(self.layer), ckpt.interval):
                # Reentrant: the segment's forward runs under no_grad. The non-reentrant form calls a Python
                # hook for every tensor an op saves, which doubled the forward's CPU time and, on a GPU fast
                # enough to wait for the CPU, the forward itself (BERT-1.5B on an H200, docs/PERFORMANCE.md).
                x, r = torch_checkpoint(self._run_layers(start, start + ckpt.interval), x, r, attn_mask,
                                        use_reentrant=True)
        return x if self.ln is None else self.ln(x)


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig, checkpointing: ActivationCheckpointing):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config, checkpointing)
        self.pooler = BertPooler(config) if config.next_sentence_prediction else None

    def forward(self, input_ids, token_type_ids, attention_mask) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        # Boolean SDPA mask, True = attend; broadcast over heads and query positions.
        attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        return self.encoder(x, attn_mask)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Transform + decoder. The decoder weight is the word embedding matrix (tied)."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.vocab_size = config.vocab_size
        # A plain attribute, not a submodule: the weight is registered once, under embeddings.
        self._decoder = [word_embeddings]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.transform(x), self._decoder[0].weight, self.bias)
        return logits[..., : self.vocab_size]  # padded vocab rows never reach a softmax


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.predictions = BertLMPredictionHead(config, word_embeddings)
        self.seq_relationship = nn.Linear(config.hidden_size, 2) if config.next_sentence_prediction else None


class BertForPreTraining(nn.Module):
    def __init__(self, config: BertConfig, checkpointing: ActivationCheckpointing | None = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, checkpointing or ActivationCheckpointing())
        self.cls = BertPreTrainingHeads(config, self.bert.embeddings.word_embeddings)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    @property
    def checkpointing(self) -> ActivationCheckpointing:
        return self.bert.encoder.checkpointing

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        masked_lm_positions: torch.Tensor | None = None,
        masked_lm_labels: torch.Tensor | None = None,
        next_sentence_labels: torch.Tensor | None = None,
    ) -> PreTrainingOutput:
        """`masked_lm_positions` / `masked_lm_labels`: [batch, max_predictions]; label -100 marks an
        unused slot. Without positions, logits are computed for every position (inference)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.bert(input_ids, token_type_ids, attention_mask)

        if masked_lm_positions is not None:
            index = masked_lm_positions.long().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            hidden_at_masks = torch.gather(hidden, 1, index)
        else:
            hidden_at_masks = hidden
        mlm_logits = self.cls.predictions(hidden_at_masks)
        nsp_logits = None
        if self.cls.seq_relationship is not None:
            nsp_logits = self.cls.seq_relationship(self.bert.pooler(hidden))

        mlm_loss = nsp_loss = accuracy = loss = None
        if masked_lm_labels is not None:
            labels = masked_lm_labels.long()
            flat_logits = mlm_logits.float().reshape(-1, mlm_logits.shape[-1])
            mlm_loss = F.cross_entropy(flat_logits, labels.reshape(-1), ignore_index=IGNORE_INDEX)
            with torch.no_grad():
                valid = labels.reshape(-1) != IGNORE_INDEX
                hits = (flat_logits.argmax(-1) == labels.reshape(-1)) & valid
                accuracy = hits.sum().float() / valid.sum().clamp(min=1).float()
            loss = mlm_loss
        if next_sentence_labels is not None:
            if nsp_logits is None:
                raise ValueError("next_sentence_labels given, but the config has next_sentence_prediction=false")
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_labels.long().reshape(-1))
            loss = nsp_loss if loss is None else loss + nsp_loss
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, accuracy, mlm_logits, nsp_logits)


# ----------------------------------------------------------------------------- Hugging Face interop


def check_hf_exportable(config: BertConfig, source: str = "the model config") -> None:
    """transformers has no model computing Habana's pre-LN block: refused rather than exported as a BertModel
    (post-LN) or a MegatronBert (Megatron's pre-LN), which would load the weights and compute something else."""
    if config.layer_norm_large_model:
        raise ConfigError(f"{source}: field 'layer_norm_large_model' is true (Habana deepspeed-bert's pre-LN block), "
                          "which no transformers model computes: BertModel is post-LN and MegatronBert adds the raw "
                          "embeddings to the residual stream, so a Hugging Face export or import of this model would "
                          "compute another function of the same weights")


def require_transformers_torch() -> None:
    """transformers 5 runs its models only with torch 2.6 or later: with an older torch (Habana's 1.18 container
    has 2.4) it imports, reports PyTorch as missing, and its model classes raise an ImportError when used."""
    import importlib.metadata

    import transformers
    from transformers.utils import is_torch_available

    if not is_torch_available():
        raise ConfigError(f"transformers {transformers.__version__} does not run its models with this torch "
                          f"{importlib.metadata.version('torch')} (it needs torch 2.6 or later), and the Hugging "
                          "Face export and import need them: use a torch it accepts (Intel Gaudi software 1.21 or later, NVIDIA's PyTorch "
                          "container 25.05 or later), or export on any machine with pip install '.[cpu]'")


def _hf_classes(config: BertConfig):
    """The transformers classes our config maps to: (config class, model class, model_type)."""
    import transformers

    check_hf_exportable(config)
    require_transformers_torch()
    if config.pre_layer_norm:
        cfg_cls, model_type = transformers.MegatronBertConfig, "megatron-bert"
        model_cls = (transformers.MegatronBertForPreTraining if config.next_sentence_prediction
                     else transformers.MegatronBertForMaskedLM)
    else:
        cfg_cls, model_type = transformers.BertConfig, "bert"
        model_cls = transformers.BertForPreTraining if config.next_sentence_prediction else transformers.BertForMaskedLM
    return cfg_cls, model_cls, model_type


_HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
              "type_vocab_size", "initializer_range", "layer_norm_eps")


def to_hf_state_dict(model: BertForPreTraining) -> dict[str, torch.Tensor]:
    """Our state dict with the vocab padding stripped and the tied decoder spelled out, as HF names it."""
    vocab = model.config.vocab_size
    state = {}
    for name, tensor in model.state_dict().items():
        if name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
            tensor = tensor[:vocab]
        state[name] = tensor
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    return state


def to_hf_model(model: BertForPreTraining):
    """A transformers model (BertForPreTraining / MegatronBertForPreTraining, or *ForMaskedLM
    without NSP) holding this model's weights."""
    config = model.config
    cfg_cls, model_cls, _ = _hf_classes(config)
    hf_config = cfg_cls(**{k: getattr(config, k) for k in _HF_FIELDS}, pad_token_id=0)
    hf_config.architectures = [model_cls.__name__]
    hf_model = model_cls(hf_config)
    state = {k: v.detach().to(torch.float32).clone() for k, v in to_hf_state_dict(model).items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids") and k != "bert.embeddings.token_type_ids"]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to {model_cls.__name__} failed: missing {missing}, unexpected {unexpected}")
    hf_model.tie_weights()
    return hf_model.eval()


# save_hf's record of what it exported, beside the model: the mark of a directory it may replace, since a model
# that transformers' save_pretrained wrote has the same file names.
EXPORT_INFO = "export_info.json"
# What save_hf writes (transformers may add generation_config.json): the only files it replaces.
HF_EXPORT_FILES = frozenset({"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                             "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", EXPORT_INFO})


def check_export_dir(directory: str | os.PathLike) -> Path:
    """The resolved export directory, if save_hf may write it: new, or an earlier export, which it replaces.
    Callers with a long way to the model (merging a checkpoint's partitions) check it first."""
    directory = Path(directory).resolve()
    if directory.exists():
        if not directory.is_dir():
            raise ValueError(f"{directory}: exists and is not a directory; pass a new directory as the output")
        names = sorted(p.name for p in directory.iterdir())
        foreign = [n for n in names if n not in HF_EXPORT_FILES]
        if foreign:
            raise ValueError(f"{directory}: holds {', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}, "
                             "which no export writes; an export replaces its directory whole, so pass a new "
                             "directory (or an earlier export) as the output")
        # Names alone do not make an export: a model saved by transformers, or a folder holding a vocab.txt.
        if names and EXPORT_INFO not in names:
            raise ValueError(f"{directory}: holds {', '.join(names)} but no {EXPORT_INFO}, so it is no export "
                             "of this project (a model saved by transformers has the same file names; exports "
                             "before 2026-11-25 had none); an export replaces its directory whole, so pass a new "
                             "directory, or delete this one if nothing in it is needed")
    return directory


def vocab_tokens(vocab_file: Path) -> list[str]:
    """A vocab.txt's tokens, numbered as the tokenizers number them (data.vocab.load_vocab, which refuses a file
    they would number differently, or one that is not UTF-8 text): a ValueError that names the file otherwise."""
    from data.stage import PipelineError
    from data.vocab import load_vocab

    try:
        return load_vocab(vocab_file).tokens
    except PipelineError as e:
        raise ValueError(str(e)) from e


def check_vocab_size(vocab_file: Path, config: BertConfig, config_file: Path | None = None,
                     fix: str = "pass the vocab.txt the shards were made with") -> None:
    """A vocab.txt of another size than the model's vocabulary is not the one it was trained with, or the config
    is not the model's: `config_file` (where the config was read) is named, and `fix` says what to pass."""
    n_lines = len(vocab_tokens(vocab_file))
    if n_lines != config.vocab_size:
        model = f"{config_file} says vocab_size {config.vocab_size}" if config_file is not None else \
            f"the model's vocab_size is {config.vocab_size}"
        raise ValueError(f"{vocab_file}: {n_lines} tokens, but {model}; {fix}")


def save_hf(model: BertForPreTraining, directory: str | os.PathLike, vocab_file: str | os.PathLike | None = None,
            lower_case: bool | None = None, provenance: dict[str, str] | None = None) -> Path:
    """Write a Hugging Face model directory (config.json + model.safetensors) that
    `transformers.AutoModelForPreTraining.from_pretrained` (or AutoModelForMaskedLM) loads.
    With `vocab_file` (a WordPiece vocab.txt), the tokenizer files are written too, lower-casing as
    `lower_case` says (None: as `vocab_lower_cases` infers from the vocab).
    `provenance` (where the weights came from, how the tokenizer was chosen) goes into EXPORT_INFO.
    The directory is staged beside its final name and swapped in whole; an existing directory is
    replaced only when it is an earlier export: EXPORT_INFO and nothing an export does not write."""
    if vocab_file is not None:
        check_vocab_size(Path(vocab_file), model.config)
    directory = check_export_dir(directory)
    staging = directory.with_name(f".{directory.name}.tmp")
    if staging.exists():
        shutil.rmtree(staging)
    try:
        to_hf_model(model).save_pretrained(staging)
        if vocab_file is not None:
            save_tokenizer(Path(vocab_file), staging, model.config.max_position_embeddings, lower_case)
        info = {"written_by": "bert-pretraining (modeling.save_hf)"} | (provenance or {})
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        # safetensors writes through a 0600 temporary file; give every file the mode config.json got
        # from the user's umask.
        mode = (staging / "config.json").stat().st_mode & 0o777
        for path in staging.iterdir():
            path.chmod(mode)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk's partial copy would hold on to the space
        raise
    replace_dir(staging, directory)
    return directory


def vocab_lower_cases(vocab_file: Path) -> bool:
    """Whether text tokenized with this vocab was lower-cased, guessed from the vocab alone (for shards
    that do not say): BERT's uncased normalisation changes at most 1% of its tokens, the stray cased
    tokens data.prepare accepts in the vocab of a lower-cased run."""
    return _lower_cases(vocab_tokens(vocab_file))


def _lower_cases(lines: list[str]) -> bool:
    from data.vocab import CASED_TOKENS_TOLERATED, cased_tokens

    words = [w for w in lines if w and not w.startswith("[")]
    return len(cased_tokens(words)) <= CASED_TOKENS_TOLERATED * len(lines)


def save_tokenizer(vocab_file: Path, directory: Path, model_max_length: int, lower_case: bool | None = None) -> None:
    """Hugging Face tokenizer files for a WordPiece vocab.txt, built from the `tokenizers` object:
    `BertTokenizerFast(vocab_file=...)` silently ignores the file in transformers 5.x (every token
    becomes [UNK]). `model_max_length` (the model's positions) is what `truncation=True` cuts to.
    `lower_case`: whether it lower-cases and strips accents (None: `vocab_lower_cases`).
    A vocab.txt, written from the tokenizer in id order, goes beside tokenizer.json for the tools
    that read only it (transformers 4.x's slow BertTokenizer, NVIDIA's and Google's scripts).
    Decoding joins "don ' t" back into "don't", as BERT's tokenizer did (transformers 5 no longer does by default)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    lines = vocab_tokens(vocab_file)
    lower = _lower_cases(lines) if lower_case is None else lower_case
    wordpiece = BertWordPieceTokenizer(str(vocab_file), lowercase=lower, strip_accents=lower)
    tokenizer = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=lower, unk_token="[UNK]",
                                  sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                                  model_max_length=model_max_length, clean_up_tokenization_spaces=True)
    if len(tokenizer) != len(lines):
        raise ValueError(f"{vocab_file}: the tokenizer built from it has {len(tokenizer)} tokens but the file has "
                         f"{len(lines)} lines; remove duplicate or blank lines")
    tokenizer.save_pretrained(directory)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    (directory / "vocab.txt").write_text("".join(f"{token}\n" for token in tokens), encoding="utf-8")


def config_from_hf(hf_config, pad_vocab_size_multiple: int = 8, next_sentence_prediction: bool | None = None,
                   source: str = "the Hugging Face config") -> BertConfig:
    """Our config for a transformers BERT config (`source`: its config.json, for the errors); without
    `next_sentence_prediction`, the NSP head is assumed from `architectures` (a *ForMaskedLM has none)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ("bert", "megatron-bert"):
        raise ConfigError(f"{source}: model_type {model_type!r} is not a BERT; expected 'bert' or 'megatron-bert'")
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{source}: position_embedding_type {hf_config.position_embedding_type!r} is not "
                          "supported; this model has absolute position embeddings only")
    # transformers makes such a BERT attend causally (and adds cross-attention weights): another function.
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(hf_config, name, False):
            raise ConfigError(f"{source}: {name} is true, a decoder BERT; this model is a bidirectional encoder")
    nsp = next_sentence_prediction
    if nsp is None:
        nsp = not any(a.endswith("ForMaskedLM") for a in getattr(hf_config, "architectures", None) or [])
    values = {k: getattr(hf_config, k) for k in _HF_FIELDS}
    return BertConfig.from_dict(values | {"pre_layer_norm": model_type == "megatron-bert",
                                          "next_sentence_prediction": nsp,
                                          "pad_vocab_size_multiple": pad_vocab_size_multiple}, source)


def from_hf_model(hf_model, pad_vocab_size_multiple: int = 8, source: str = "the Hugging Face config"
                  ) -> BertForPreTraining:
    nsp = hasattr(getattr(hf_model, "cls", None), "seq_relationship")  # *ForPreTraining, not *ForMaskedLM
    config = config_from_hf(hf_model.config, pad_vocab_size_multiple, next_sentence_prediction=nsp, source=source)
    model = BertForPreTraining(config)
    hf_state = hf_model.state_dict()
    decoder = hf_state.get("cls.predictions.decoder.weight")
    if decoder is not None and not torch.equal(decoder, hf_state["bert.embeddings.word_embeddings.weight"]):
        raise ConfigError("the Hugging Face model's output layer (cls.predictions.decoder.weight) is not tied to its "
                          "word embeddings (tie_word_embeddings false); this model ties them, so one would be lost")
    ours = model.state_dict()
    for name, target in ours.items():
        if name not in hf_state:
            raise KeyError(f"Hugging Face model lacks weight '{name}' (architecture {type(hf_model).__name__})")
        source = hf_state[name]
        if target.shape != source.shape:  # the padded vocab rows
            target.zero_()
            target[: source.shape[0]].copy_(source)
        else:
            target.copy_(source)
    return model


_NSP_WEIGHTS = ("bert.pooler.", "cls.seq_relationship.")


def load_hf(directory: str | os.PathLike, pad_vocab_size_multiple: int = 8) -> BertForPreTraining:
    """Load a Hugging Face BERT / MegatronBERT pretraining (or masked-LM) checkpoint directory.

    The NSP head is there when the weights are (bert-base-uncased says BertForMaskedLM but has
    them). transformers fills missing weights with random ones, so a checkpoint without its MLM head
    (a bare encoder, a fine-tuned classifier) is refused rather than loaded half random."""
    import transformers

    require_transformers_torch()
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no config.json; expected a Hugging Face model directory")
    hf_model, info = transformers.AutoModelForPreTraining.from_pretrained(directory, output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if missing and all(k.startswith(_NSP_WEIGHTS) for k in missing):
        hf_model, info = transformers.AutoModelForMaskedLM.from_pretrained(directory, output_loading_info=True)
        missing = sorted(info["missing_keys"])
    if missing:
        raise ConfigError(f"{directory}: the checkpoint has no weights for {', '.join(missing[:4])}"
                          f"{', ...' if len(missing) > 4 else ''}; a BERT pretraining checkpoint (with its MLM head) "
                          "is needed, not a bare encoder or a fine-tuned model")
    return from_hf_model(hf_model, pad_vocab_size_multiple, source=str(directory / "config.json"))


def config_differences(then: dict, now: dict, fields: Iterable[str]) -> list[str]:
    """'<field> <then's value> there, <now's value> in --config_file' for each of `fields` that differs."""
    return [f"{k} {then.get(k)!r} there, {now.get(k)!r} in --config_file" for k in fields if then.get(k) != now.get(k)]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
