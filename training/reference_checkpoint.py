"""Phase 2 from a phase-1 checkpoint of NVIDIA's (DeepLearningExamples PyTorch/LanguageModeling/BERT) or
Habana's (Model-References PyTorch/nlp/bert) run_pretraining.py: a `ckpt_<step>.pt` file.

What such a file holds (from their published run_pretraining.py): `torch.save` of a dict with
- "model": their BertForPreTraining's state_dict, saved from the unwrapped model (`model.module` under DDP),
  in fp32 (apex O2's state-dict hook casts its fp16 weights to fp32);
- "optimizer": the LAMB state; "master params": apex's fp32 master weights, in optimizer order (NVIDIA on
  GPUs; Habana's HPU path writes none); "files", "epoch", and "data_loader" (a pickled DataLoader of their
  `__main__.pretraining_dataset`, absent from some versions, None in the last checkpoint of a run).

Their parameter names are Hugging Face's (ours) except the fused linear+activation layers, `dense_act` where
we have `dense` (intermediate, pooler, MLM transform), and the tied decoder, which their state_dict lists as
`cls.predictions.decoder.weight` beside the word embeddings. Their vocabulary is padded to a multiple of 8
(30522 -> 30528) in the word embeddings and the MLM bias. Their files hold no model config: --config_file
must describe their model (post-LN, with the NSP head) and every tensor must fit it.
"""

from __future__ import annotations

import math
import pickle
import re
import types
import zipfile
from pathlib import Path

import torch

from modeling import BertForPreTraining
from training.checkpoint import LOAD_ERRORS, CheckpointError

_CKPT = re.compile(r"ckpt_(\d+)\.pt")
_PREFIXES = ("module.", "_orig_mod.")  # a DDP- or torch.compile-wrapped model's state_dict
_TIED_DECODER = "cls.predictions.decoder.weight"
_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"
_VOCAB_ROWS = (_EMBEDDINGS, "cls.predictions.bias")
_THEIR_PADDING = 8
# Buffers, not parameters, that a BERT state_dict may carry (transformers' BertEmbeddings).
_NON_PARAMETERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
FIX = ("pass the --config_file matching their bert_config.json (their BertForPreTraining is post-LN with the NSP "
       "head: pre_layer_norm false, next_sentence_prediction true)")


def reference_checkpoint(init: Path) -> tuple[Path, str] | None:
    """The ckpt_<step>.pt that --init_checkpoint names, and how it was chosen: a file is taken as one; a
    directory holding ckpt_<step>.pt files (and no run or Hugging Face layout) gives its highest step."""
    if init.is_file():
        return init, ""
    if not init.is_dir():
        return None
    steps = {int(m.group(1)): p for p in init.iterdir() if (m := _CKPT.fullmatch(p.name)) and p.is_file()}
    if not steps:
        return None
    step = max(steps)
    return steps[step], f"; the highest step of {len(steps)} ckpt_<step>.pt in {init}"


def load_reference_checkpoint(model: BertForPreTraining, path: Path, chosen: str = "",
                              vocab_tokens: int | None = None) -> str:
    """Fill `model` from `path` (a ckpt_<step>.pt) strictly: every parameter of ours from one tensor of
    theirs, every tensor of theirs used. `vocab_tokens`: the size of the shards' vocab.txt, which their
    padded vocabulary must cover. Returns the description for run_info.json."""
    if model.config.layer_norm_large_model:
        # Their tensors have the names of Habana's pre-LN block too: the strict load would not notice.
        raise CheckpointError(f"{path}: --config_file has layer_norm_large_model true (Habana deepspeed-bert's pre-LN "
                              f"block), but a ckpt_<step>.pt holds a post-LN BERT; {FIX}")
    state = _read(path)
    weights, source = _our_names(path, state)
    load_their_weights(model, path, weights, FIX, vocab_tokens)
    return f"{path} (NVIDIA/Habana ckpt_<step>.pt, {source}{chosen})"


def load_their_weights(model: BertForPreTraining, path: Path, weights: dict[str, torch.Tensor], fix: str,
                       vocab_tokens: int | None) -> None:
    """Fill `model` with `weights` (their BertForPreTraining's, in our names: `our_names`) strictly: every
    parameter of ours from one of them, each of them used, shapes compared before anything is loaded, their
    vocabulary padding rows dropped and ours zeroed. `fix`: what to do when they do not fit --config_file."""
    ours = model.state_dict()
    missing, unused = sorted(set(ours) - set(weights)), sorted(set(weights) - set(ours))
    if missing or unused:
        raise CheckpointError(f"{path}: its tensors are not this model's: {_names('missing there', missing)}"
                              f"{'; ' if missing and unused else ''}{_names('unused', unused)}; {fix}")
    vocab = model.config.vocab_size
    differ = []
    for name, target in ours.items():
        value = weights[name]
        if name in _VOCAB_ROWS and value.shape[0] in (vocab, math.ceil(vocab / _THEIR_PADDING) * _THEIR_PADDING):
            value = weights[name] = value[:vocab]  # their padding rows; ours are zeroed as load_hf's are
        expected = (vocab, *target.shape[1:]) if name in _VOCAB_ROWS else tuple(target.shape)
        if tuple(value.shape) != expected:
            differ.append(f"{name} {tuple(value.shape)} there, {expected} in --config_file")
    if differ:
        raise CheckpointError(f"{path}: the model of --config_file has other shapes ({'; '.join(differ[:6])}"
                              f"{'; ...' if len(differ) > 6 else ''}); {fix}")
    if vocab_tokens is not None and vocab_tokens != vocab:
        raise CheckpointError(f"{path}: --config_file's vocab_size {vocab} (the rows taken from it) is not the "
                              f"{vocab_tokens} tokens of the shards' vocab.txt; make them agree")
    for name in _VOCAB_ROWS:
        padded = torch.zeros_like(ours[name])
        padded[:vocab] = weights[name]
        weights[name] = padded
    model.load_state_dict(weights, strict=True)


def _our_names(path: Path, state: dict) -> tuple[dict[str, torch.Tensor], str]:
    """Their state_dict (or, where they check out, their fp32 master weights) in our names, fp32."""
    theirs = state.get("model")
    if not isinstance(theirs, dict) or not all(isinstance(v, torch.Tensor) for v in theirs.values()):
        raise CheckpointError(f"{path}: no 'model' state_dict in it (keys: {', '.join(map(str, state)) or 'none'}); "
                              "not a ckpt_<step>.pt of NVIDIA's or Habana's run_pretraining.py")
    theirs = their_parameters(path, theirs)
    source = f"{'/'.join(sorted({str(v.dtype).removeprefix('torch.') for v in theirs.values()}))} model weights"
    masters = _master_weights(theirs, state.get("master params"))
    if masters is not None:
        theirs, source = masters, "fp32 master weights"
    return our_names(theirs), source


def their_parameters(path: Path, theirs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their BertForPreTraining's state_dict as its parameters, each once: a wrapper's prefix dropped, the
    tied decoder (which must be the word embeddings) and transformers' buffers left out."""
    for prefix in _PREFIXES:
        if theirs and all(k.startswith(prefix) for k in theirs):
            theirs = {k.removeprefix(prefix): v for k, v in theirs.items()}
    theirs = dict(theirs)
    decoder = theirs.pop(_TIED_DECODER, None)
    if decoder is not None and not torch.equal(decoder, theirs.get(_EMBEDDINGS, decoder)):
        raise CheckpointError(f"{path}: {_TIED_DECODER} is not the word embeddings; this model ties them, so one "
                              "would be lost")
    return {k: v for k, v in theirs.items() if k not in _NON_PARAMETERS}


def our_names(theirs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their parameters (`their_parameters`) in our names, fp32: their fused linear+activation layers are
    `dense_act` where ours are `dense`; every other name is the same."""
    return {k.replace(".dense_act.", ".dense."): v.float() for k, v in theirs.items()}


def _master_weights(theirs: dict[str, torch.Tensor], masters) -> dict[str, torch.Tensor] | None:
    """apex's fp32 masters by name, if they are that: their optimizer's two groups (decay, then no decay by
    their no_decay names) in state_dict order, each master equal to its model weight or to it rounded to
    fp16. Anything else (no masters, another order) leaves the model weights."""
    if not isinstance(masters, list) or len(masters) != len(theirs):
        return None
    no_decay = ("bias", "gamma", "beta", "LayerNorm")
    names = sorted(theirs, key=lambda n: any(nd in n for nd in no_decay))  # stable: state_dict order in a group
    for name, master in zip(names, masters):
        value = theirs[name]
        if not (isinstance(master, torch.Tensor) and master.dtype == torch.float32 and master.shape == value.shape
                and (torch.equal(master, value.float()) or torch.equal(master.half().float(), value.float()))):
            return None
    return {name: master.detach() for name, master in zip(names, masters)}


def _names(what: str, names: list[str]) -> str:
    if not names:
        return ""
    return f"{what} {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} ({len(names)})"


class _Foreign:
    """Whatever their pickle holds besides tensors (their DataLoader, dataset and worker-init classes live
    in their __main__): read as an inert placeholder, never built and never run."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _allowed(module: str, name: str) -> bool:
    if module == "torch._utils":
        return name.startswith("_rebuild_")
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {("collections", "OrderedDict"), ("_codecs", "encode"),
                              ("torch.nn.parameter", "Parameter")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return super().find_class(module, name) if _allowed(module, name) else _Foreign


def _load(file, **kwargs):
    """pickle.load through `_Unpickler`: torch.load reads the legacy format's header pickles (magic number,
    protocol, system info, storage keys) with the pickle module's `load`, not its Unpickler."""
    return _Unpickler(file, **kwargs).load()


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=_load, __name__="reference_pickle")


def _read(path: Path) -> dict:
    """torch.load of their file with tensors only: their other objects become placeholders (unpickling
    them would need their script's classes, and would run their code)."""
    try:
        # Memory-mapped where the format allows (torch's zip format, the default since torch 1.6): only the
        # model's tensors are read then, not the optimizer state beside them, on each rank.
        state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE,
                           mmap=zipfile.is_zipfile(path))
    except LOAD_ERRORS as e:
        raise CheckpointError(f"{path}: cannot read it as a torch checkpoint ({type(e).__name__}: {e}); it is "
                              "damaged or not a ckpt_<step>.pt of NVIDIA's or Habana's run_pretraining.py") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not the dict NVIDIA's and Habana's "
                              "run_pretraining.py save")
    return state
