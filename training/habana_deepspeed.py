"""Phase 2 from a phase-1 checkpoint of Habana's DeepSpeed BERT (Model-References
PyTorch/nlp/DeepSpeedExamples/deepspeed-bert, run_pretraining.py and modeling.py): a DeepSpeed checkpoint folder.

What such a folder holds (from their published code): `save_common_checkpoint` calls
`model.save_checkpoint(args.output_dir, tag, {"files": ..., "epoch": ...})` on the DeepSpeed engine wrapping their
`modeling.BertForPreTraining`, with the tag `str(global_step)` (phase 1's last step, e.g. "7038"), so the folder is
their --output_dir with `latest` (the tag's name), `<tag>/mp_rank_00_model_states.pt` (`module`: the model's
state_dict in the engine's dtype, bf16 with their deepspeed_config_bert_*.json) and, under ZeRO-1 (their configs'
stage 1), `<tag>/bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt` holding the fp32 master weights, beside their own
`<tag>/state_<rank>` files and, once their phase 2 has started there, `<tag>_phase2_adjusted` copies.

Their parameter names and vocabulary padding are those of their ckpt_<step>.pt (training/reference_checkpoint.py):
Hugging Face's except `dense_act`, the tied `cls.predictions.decoder.weight`, 30522 -> 30528 rows. Their pre-LN
switch (`layer_norm_large_model`, true in their bert_1.5b_config.json) keeps the same tensors but computes another
function: it normalizes the embeddings and keeps them out of the residual stream, and each LayerNorm normalizes the
residual stream after a sublayer is added. Our config field of the same name builds that block
(modeling.BertLayer.forward_split_residual); our `pre_layer_norm` is Megatron-BERT's pre-LN, which adds the raw
embeddings to the residual stream and has other tensors. Their tensors cannot tell their two layouts apart:
--config_file says which.
"""

from __future__ import annotations

from pathlib import Path

import torch

from modeling import BertConfig, BertForPreTraining
from training.checkpoint import LATEST, MODEL_STATES, RUN_STATE, CheckpointError, is_tag_name
from training.reference_checkpoint import load_their_weights, our_names, their_parameters

FIX = ("pass a --config_file describing their model: their config's sizes, the NSP head "
       "(next_sentence_prediction true) and their layer_norm_large_model (true for their pre-LN models, as in their "
       "bert_1.5b_config.json; false or absent for post-LN)")


def deepspeed_tag(init: Path) -> tuple[Path, str] | None:
    """The tag directory of a DeepSpeed checkpoint folder of Habana's deepspeed-bert that --init_checkpoint names,
    and how it was chosen: the folder (the tag its `latest` names), a tag directory in it, or the tag's model
    states file. None for none of them."""
    if init.name == MODEL_STATES and init.is_file():
        tag_dir, chosen = init.parent, ""
    elif (init / MODEL_STATES).is_file():
        tag_dir, chosen = init, ""
    elif (init / LATEST).is_file():
        latest = init / LATEST
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        tags = sorted(p.name for p in init.iterdir() if (p / MODEL_STATES).is_file())
        fix = (f"write one of its tags ({', '.join(tags)}) into {latest} or point --init_checkpoint at that tag's "
               "directory" if tags else "it holds no tag with model states; point --init_checkpoint at a complete "
               "checkpoint folder")
        if not is_tag_name(tag):
            raise CheckpointError(f"{latest}: {tag!r} is not a tag name; {fix}")
        tag_dir, chosen = init / tag, f"; tag {tag} named by {latest}"
        if not tag_dir.is_dir():
            raise CheckpointError(f"{latest} names the tag {tag!r} but {tag_dir} does not exist; {fix}")
        if not (tag_dir / MODEL_STATES).is_file():
            raise CheckpointError(f"{latest} names the tag {tag!r} but {tag_dir / MODEL_STATES} does not exist: the "
                                  f"checkpoint is incomplete; {fix}")
    else:
        return None
    if (tag_dir / RUN_STATE).is_file():
        raise CheckpointError(f"--init_checkpoint {init}: a checkpoint tag of a run of ours ({tag_dir / RUN_STATE}); "
                              f"pass that run's --output_dir ({tag_dir.parent.parent}) instead")
    return tag_dir, chosen


def check_config(tag_dir: Path, config: BertConfig) -> None:
    """Before anything is read: a Megatron pre-LN --config_file is refused for its reason (the strict load would
    only name the tensors)."""
    if config.pre_layer_norm:
        raise CheckpointError(f"{tag_dir}: --config_file is Megatron-BERT's pre-LN block (pre_layer_norm true), which "
                              "is not theirs; for their pre-LN model (layer_norm_large_model true in their config) "
                              "write \"layer_norm_large_model\": true and \"pre_layer_norm\": false, as in "
                              "configs/models/bert-1.5b-deepspeed-bert.json")


def load_deepspeed_reference(model: BertForPreTraining, tag_dir: Path, weights: dict[str, torch.Tensor],
                             source: str, chosen: str = "", vocab_tokens: int | None = None) -> str:
    """Fill `model` strictly from `weights` (the fp32 weights of `tag_dir` in their names, read as
    training.weights.read_fp32_weights reads them; `source` says which). Returns the run_info.json description."""
    load_their_weights(model, tag_dir, our_names(their_parameters(tag_dir, weights)), FIX, vocab_tokens)
    return f"{tag_dir} (Habana deepspeed-bert DeepSpeed checkpoint, {source}{chosen})"
