"""The weights a run starts from, and fp32 master weights: read from a checkpoint (phase 2, export),
from a Hugging Face BERT (phase 2), and given to a bf16 engine that starts.

DeepSpeed's bf16 engine casts the module to bf16 inside `deepspeed.initialize` and builds the
optimizer's fp32 master weights from that bf16 copy. Left alone, a fresh bf16 run would train from
its initial weights rounded to bf16, and phase 2 from phase 1's bf16 weights instead of its fp32
masters. `set_fp32_masters` writes the fp32 values into the masters (each rank its own partition)
through DeepSpeed's documented `safe_set_full_fp32_param`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from modeling import (
    BertConfig,
    BertForPreTraining,
    ConfigError,
    check_hf_exportable,
    config_differences,
    load_hf,
    vocab_tokens,
)
from training.checkpoint import (
    LOAD_ERRORS,
    MODEL_STATES,
    CheckpointError,
    checkpoint_dir,
    find_resume,
    missing_partitions,
    verify_checksums,
)
from training.habana_deepspeed import check_config, deepspeed_tag, load_deepspeed_reference
from training.loader import TOKENIZATION
from training.reference_checkpoint import load_reference_checkpoint, reference_checkpoint

_PARTITION = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_ZERO3_MODEL_STATES = re.compile(r"zero_pp_rank_\d+_mp_rank_00_model_states\.pt$")  # ZeRO-3: one per rank
_BF16_PARTITION_PREFIX = "bf16_"  # BF16_Optimizer's files; the ZeRO optimizer's have no prefix


def is_tag_dir(path: Path) -> bool:
    """A DeepSpeed checkpoint tag: model states (one file, or one per rank under ZeRO-3) or a universal `zero/`."""
    return (path / MODEL_STATES).is_file() or (path / "zero").is_dir() or \
        (path.is_dir() and any(_ZERO3_MODEL_STATES.search(p.name) for p in path.iterdir()))


def is_tag_file(path: Path) -> bool:
    """A file DeepSpeed writes into a checkpoint tag (model states, a rank's partition): a path to it means its tag."""
    return path.name == MODEL_STATES or bool(_PARTITION.search(path.name) or _ZERO3_MODEL_STATES.search(path.name))


def rounds_to(fp32: torch.Tensor, low: torch.Tensor) -> bool:
    """Whether `low` is `fp32` cast to its dtype in some rounding mode: each value one of the master's two bf16
    neighbours (the host rounds to nearest, a device may truncate), or a zero of either sign for a zero or
    subnormal master (a device may flush those); equal where `low` is fp32 too."""
    if low.dtype == torch.float32:
        return torch.equal(fp32, low)
    if low.dtype != torch.bfloat16:
        return torch.equal(fp32.to(low.dtype), low)
    bits = fp32.float().contiguous().view(torch.int32)
    toward_zero = bits & ~0xFFFF  # a bf16 is the top 16 bits of an fp32
    away = torch.where(bits == toward_zero, bits, toward_zero + 0x10000)  # the next one out (an exact value: itself)
    got = low.float().contiguous().view(torch.int32)
    flushed = ((bits & 0x7F800000) == 0) & ((got & 0x7FFFFFFF) == 0)
    return bool(((got == toward_zero) | (got == away) | flushed).all())


def partition_files(tag_dir: Path) -> list[Path]:
    """Every rank's optimizer partition, in rank order; a gap is an incomplete checkpoint."""
    files = {int(m.group(1)): p for p in tag_dir.iterdir() if (m := _PARTITION.search(p.name))}
    if files and sorted(files) != list(range(len(files))):
        raise CheckpointError(f"{tag_dir}: partitions of ranks {sorted(files)} are present, not 0..{max(files)}; "
                              "the checkpoint is incomplete")
    return [files[r] for r in sorted(files)]


def load_partitions(files: list[Path]) -> list[tuple[Path, dict]]:
    """Each partition file with its optimizer_state_dict, memory-mapped: its tensors are read only where used."""
    return [(path, torch.load(path, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"])
            for path in files]


def partition_pieces(partitions: list[tuple[Path, dict]], flats: Callable[[Path, dict], Sequence[torch.Tensor]]
                     ) -> dict[str, list[torch.Tensor]]:
    """Parameter name -> its pieces in rank order, cut from flat per-group tensors of ZeRO-1/2 or BF16_Optimizer
    partitions (load_partitions; `flats(path, optimizer_state_dict)`: one per parameter group, in the layout of
    the rank's fp32 slice). Each file holds a map name -> (start, numel) of the fragments in its slice. The
    pieces are views of the memory-mapped files: only what a caller joins is read."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for path, state in partitions:
        for flat, mapping in zip(flats(path, state), state["param_slice_mappings"], strict=True):
            for name, fragment in mapping.items():
                pieces.setdefault(name, []).append(flat[fragment.start:fragment.start + fragment.numel])
    return pieces


def checked_pieces(tag_dir: Path, name: str, pieces: dict[str, list[torch.Tensor]], shape: torch.Size,
                   what: str) -> list[torch.Tensor]:
    """One parameter's pieces (partition_pieces), checked to hold exactly its elements."""
    if name not in pieces:
        raise CheckpointError(f"{tag_dir}: parameter {name} is in no rank's partition; the checkpoint is "
                              "incomplete")
    total = sum(piece.numel() for piece in pieces[name])
    if total != shape.numel():
        raise CheckpointError(f"{tag_dir}: parameter {name} has {total} {what} in the partitions but shape "
                              f"{tuple(shape)}; the checkpoint is inconsistent")
    return pieces[name]


def parameter_shapes(model_states: dict) -> dict[str, torch.Size]:
    """The optimizer's parameters (tied weights once) and their shapes, from a tag's model states."""
    return {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}


def _merge_bf16_partitions(files: list[Path], model_states: dict) -> dict[str, torch.Tensor]:
    """DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16, which zero_to_fp32 does not read): the fp32 master
    weights, from each rank's fp32 slice; the optimizer moments beside them are not read."""
    pieces = partition_pieces(load_partitions(files), lambda _, state: state["single_partition_of_fp32_groups"])
    tag_dir = files[0].parent
    return {name: torch.cat(checked_pieces(tag_dir, name, pieces, shape, "fp32 values")).view(shape)
            for name, shape in parameter_shapes(model_states).items()}


def read_fp32_weights(tag_dir: Path, fp32_module_suffices: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """The fp32 weights of a checkpoint tag (universal or not) and a description of where they came from:
    the fp32 masters where the tag has ZeRO partitions, else the module weights. With
    `fp32_module_suffices`, fp32 module weights are taken as they are: ZeRO-1/2 without bf16 keeps them
    equal to its masters, and zero_to_fp32 would read every partition whole, optimizer moments included."""
    try:
        return _read_fp32_weights(tag_dir, fp32_module_suffices)
    except CheckpointError:
        raise
    except LOAD_ERRORS as e:  # torch.load of a truncated or overwritten file
        raise CheckpointError(f"{tag_dir}: cannot read the checkpoint ({type(e).__name__}: {e}); it is "
                              "damaged") from e


def _read_fp32_weights(tag_dir: Path, fp32_module_suffices: bool) -> tuple[dict[str, torch.Tensor], str]:
    if (tag_dir / "zero").is_dir():  # universal checkpoint: zero/<param name>/fp32.pt
        weights = {}
        for param_dir in sorted(p for p in (tag_dir / "zero").iterdir() if (p / "fp32.pt").is_file()):
            state = torch.load(param_dir / "fp32.pt", map_location="cpu", weights_only=False)
            weights[param_dir.name] = (state["param"] if isinstance(state, dict) else state).float()
        if not weights:
            raise CheckpointError(f"{tag_dir / 'zero'}: no <param>/fp32.pt files; the universal checkpoint is "
                                  "incomplete")
        return weights, f"fp32 weights of the universal checkpoint {tag_dir}"
    if not (tag_dir / MODEL_STATES).is_file():
        if any(_ZERO3_MODEL_STATES.search(p.name) for p in tag_dir.iterdir()):
            # Another DeepSpeed run's ZeRO-3 tag (this project trains with ZeRO-1 or 2): its module weights are
            # empty placeholders, so the fp32 masters are all there is.
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            weights = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
            return ({k: v.float() for k, v in weights.items()},
                    f"fp32 master weights merged from {len(partition_files(tag_dir))} ZeRO-3 partition(s) of {tag_dir}")
        raise CheckpointError(f"{tag_dir}: no {MODEL_STATES}; this is not a DeepSpeed checkpoint tag")
    model_states = torch.load(tag_dir / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
    module = model_states.get("module") if isinstance(model_states, dict) else None
    if not isinstance(module, dict):
        raise CheckpointError(f"{tag_dir / MODEL_STATES}: no 'module' weights in it")
    files = partition_files(tag_dir)
    ranks = model_states.get("dp_world_size")
    if files and isinstance(ranks, int):  # the last ranks' files gone: partition_files sees no gap
        missing = missing_partitions(tag_dir, ranks)
        if missing or len(files) > ranks:
            detail = f"no {', '.join(missing)}" if missing else "files of another save are mixed in"
            raise CheckpointError(f"{tag_dir}: {len(files)} optimizer partition(s) for a run of {ranks} data-parallel "
                                  f"ranks ({detail}); the checkpoint is incomplete")
    if fp32_module_suffices and all(v.dtype == torch.float32 for v in module.values() if v.is_floating_point()):
        files = []
    if files and files[0].name.startswith(_BF16_PARTITION_PREFIX):
        weights = _merge_bf16_partitions(files, model_states)
        source = f"fp32 master weights merged from {len(files)} ZeRO partition(s) (bf16 optimizer)"
    elif files:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        source = f"fp32 master weights merged from {len(files)} ZeRO partition(s)"
    else:
        dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in module.values()})
        return {k: v.float() for k, v in module.items()}, f"module weights ({'/'.join(dtypes)}), no ZeRO partitions"
    # Tied weights and buffers are not optimizer parameters: take them from the module state.
    for name, value in module.items():
        if name not in weights:
            source_name = model_states.get("shared_params", {}).get(name)
            weights[name] = weights.get(source_name, value)
    for name, value in module.items():
        # The module holds the masters rounded to its dtype: anything else is a merge gone wrong.
        if value.is_floating_point() and not rounds_to(weights[name], value):
            raise CheckpointError(f"{tag_dir}: the fp32 master weights of {name} do not round to the module "
                                  "weights of the same tag; the checkpoint is inconsistent")
    return {k: v.float() for k, v in weights.items()}, f"{source} of {tag_dir}"


def set_fp32_masters(engine, weights: dict[str, torch.Tensor]) -> None:
    """Make the fp32 master weights of a bf16 engine `weights` (fp32, by parameter name), on every rank.

    The engine's bf16 parameters must already be `weights` rounded to bf16, as deepspeed.initialize
    made them: anything else means the values are not the ones the engine was built from. The check
    allows any rounding mode (`rounds_to`), as a device may cast otherwise than the host."""
    from deepspeed.utils import safe_set_full_fp32_param

    for name, param in engine.module.named_parameters():
        value = weights[name]
        if value.dtype != torch.float32 or value.shape != param.shape:
            raise ValueError(f"{name}: expected fp32 of shape {tuple(param.shape)}, got {value.dtype} "
                             f"{tuple(value.shape)}")
        if not rounds_to(value, param.detach().cpu()):  # compared on the host, as the bits are read there
            raise ValueError(f"{name}: the engine's {param.dtype} weights are not these fp32 weights rounded")
        safe_set_full_fp32_param(param, value.to(param.device))


_SUPPORTED = ("point it at the --output_dir of a finished phase-1 run, a Hugging Face BERT directory, a "
              "ckpt_<step>.pt of NVIDIA's or Habana's run_pretraining.py (or the directory holding them), or a "
              "DeepSpeed checkpoint folder of Habana's deepspeed-bert (or a tag directory in it)")
# Fields that make two BERTs the same function of their weights: every BertConfig field but dropout, init and the
# vocabulary's padding (a field added later is compared unless it is added here).
ARCHITECTURE = tuple(f.name for f in dataclasses.fields(BertConfig) if f.name not in (
    "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range", "pad_vocab_size_multiple"))


def load_initial_weights(model: BertForPreTraining, init_dir: Path, vocab_file: Path | None = None,
                         lower_case: bool | None = None) -> str:
    """Phase 2: the fp32 weights of `init_dir`'s latest checkpoint (its fp32 master weights, merged from
    its partitions after a bf16 run), read memory-mapped into `model` before DeepSpeed wraps it, or those of a Hugging
    Face BERT directory (config.json and weights: an export of ours, or a published BERT to continue
    pretraining from), or those of NVIDIA's or Habana's ckpt_<step>.pt (training/reference_checkpoint.py), or
    those of a DeepSpeed checkpoint folder of Habana's deepspeed-bert (training/habana_deepspeed.py: its fp32
    master weights where it has ZeRO partitions).
    Optimizer state and schedule are not touched. Collective for a checkpoint: the
    ranks share the CRC checks of its files. With `vocab_file` (the shards' vocab.txt), the vocabulary of
    `init_dir` (a run's copy, a Hugging Face directory's) must be that one: a vocab of the same size but
    other tokens would train every embedding on another token's text. With `lower_case` (the shards' case), the
    case `init_dir` was trained with, where it says (a run's tokenization.json, a Hugging Face tokenizer's
    do_lower_case), must be that one."""
    ckpt_dir = checkpoint_dir(init_dir)
    if not ckpt_dir.is_dir() and (init_dir / "config.json").is_file():
        _check_vocab(init_dir, vocab_file)
        _check_case(init_dir / "tokenizer_config.json", "do_lower_case", lower_case)
        return _load_hf(model, init_dir)
    if not ckpt_dir.is_dir() and (habana := deepspeed_tag(init_dir)):
        tag_dir, chosen = habana
        check_config(tag_dir, model.config)
        weights, source = read_fp32_weights(tag_dir)
        return load_deepspeed_reference(model, tag_dir, weights, source, chosen,
                                        vocab_tokens=_token_count(vocab_file))
    if not ckpt_dir.is_dir() and (reference := reference_checkpoint(init_dir)):
        return load_reference_checkpoint(model, *reference, vocab_tokens=_token_count(vocab_file))
    found = find_resume(ckpt_dir)
    if found is None:
        raise CheckpointError(f"--init_checkpoint {init_dir}: no checkpoint under {ckpt_dir}; {_SUPPORTED}")
    _check_phase1_config(init_dir / "model_config.json", model)
    _check_vocab(init_dir, vocab_file)
    _check_case(init_dir / TOKENIZATION, "lower_case", lower_case)
    tag, state = found
    verify_checksums(ckpt_dir, tag, state)
    weights, _ = read_fp32_weights(ckpt_dir / tag, fp32_module_suffices=True)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{ckpt_dir / tag}: the phase-1 weights do not fit --config_file ({e}). Use the "
                              "phase-1 model config") from e
    return f"{ckpt_dir / tag}"


def _check_phase1_config(config_file: Path, model: BertForPreTraining) -> None:
    """The phase-1 run's model config against --config_file, field by field, before its weights are read
    (otherwise the first sign is load_state_dict's line per mismatching tensor)."""
    if not config_file.is_file():
        return  # a run directory without it (copied checkpoints only): the weights are checked as they load
    try:
        then = BertConfig.from_json_file(config_file)
    except ConfigError as e:
        raise CheckpointError(f"--init_checkpoint: {e}") from e
    differ = config_differences(then.to_dict(), model.config.to_dict(), ARCHITECTURE)
    if differ:
        raise CheckpointError(f"{config_file}: the phase-1 run trained another model than --config_file "
                              f"({'; '.join(differ)}); pass that run's model config as --config_file")


def _check_vocab(init_dir: Path, vocab_file: Path | None) -> None:
    """The tokens of --init_checkpoint (its vocab.txt: a run's copy of its shards', a published BERT's, our
    export's; else the WordPiece vocab of its tokenizer.json, for directories that hold only that) against the
    shards' vocab.txt, id by id. A directory with neither, or shards without a vocab.txt, is not checked."""
    if vocab_file is None or not vocab_file.is_file():
        return
    if (init_dir / "vocab.txt").is_file():
        source = init_dir / "vocab.txt"
        theirs = _vocab_tokens(source)
    elif (init_dir / "tokenizer.json").is_file():
        source = init_dir / "tokenizer.json"
        try:
            tokenizer = json.loads(source.read_text(encoding="utf-8"))
        except ValueError as e:
            raise CheckpointError(f"{source}: not a tokenizer.json ({e}); restore it from where the model came from, "
                                  "or put the model's vocab.txt beside it") from e
        if not isinstance(tokenizer, dict):
            raise CheckpointError(f"{source}: not a tokenizer.json (a JSON object); restore it from where the model "
                                  "came from, or put the model's vocab.txt beside it")
        model = tokenizer.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if not isinstance(vocab, dict):
            return  # not a WordPiece tokenizer: no vocab to compare
        theirs = sorted(vocab, key=vocab.get)
    else:
        return
    ours = _vocab_tokens(vocab_file)
    if theirs == ours:
        return
    first, there, here = _first_difference(theirs, ours)
    raise CheckpointError(f"--init_checkpoint {init_dir}: its vocabulary ({source.name}, {len(theirs)} tokens) is not "
                          f"the shards' {vocab_file} ({len(ours)} tokens): token id {first} is {there} there, {here} "
                          "in the shards, so its embeddings would be trained on other tokens' text; make the shards "
                          "with that vocabulary (data.prepare --vocab_file)")


def vocab_difference(theirs: list[str], ours: list[str]) -> tuple[str, str] | None:
    """None where two vocabularies (vocab.txt tokens in id order) are the same; else their sizes ('<n> tokens,
    against <m>') and where they first differ ('token id <i> is <token> there, <token> here')."""
    if theirs == ours:
        return None
    first, there, here = _first_difference(theirs, ours)
    return f"{len(theirs)} tokens, against {len(ours)}", f"token id {first} is {there} there, {here} here"


def check_resumed_vocab(run_vocab: Path, vocab_file: Path | None) -> None:
    """A resumed run's copy of its shards' vocab.txt (`run_vocab`, written at its first start) against the shards'
    vocab.txt now: dynamic masking draws its special tokens and replacements from it, and the export ships the
    run's copy, which this start would replace."""
    if vocab_file is None or not run_vocab.is_file():
        return
    differ = vocab_difference(_vocab_tokens(run_vocab), _vocab_tokens(vocab_file))
    if differ is not None:
        raise CheckpointError(f"{vocab_file} is not the vocabulary this run trained with ({run_vocab}, {differ[0]}): "
                              f"{differ[1]}. Put the run's vocab.txt back beside the shards, or train on these "
                              "shards in another --output_dir")


def _first_difference(theirs: list[str], ours: list[str]) -> tuple[int, str, str]:
    """The first id where two token lists differ, and its token in each (repr, or "absent")."""
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    return (first, repr(theirs[first]) if first < len(theirs) else "absent",
            repr(ours[first]) if first < len(ours) else "absent")


def _check_case(record: Path, key: str, lower_case: bool | None) -> None:
    """The case --init_checkpoint was trained with (`key` of its JSON `record`, where it has one) against the
    shards': a model trained on lower-cased text has never seen the ids cased text gives, and back."""
    if lower_case is None or not record.is_file():
        return
    try:
        content = json.loads(record.read_text(encoding="utf-8"))
    except ValueError as e:  # (UnicodeDecodeError is one)
        content = e
    if not isinstance(content, dict):
        why = f"not JSON ({content})" if isinstance(content, ValueError) else "not a JSON object"
        raise CheckpointError(f"--init_checkpoint {record.parent}: {record.name} is {why}; it says whether the text "
                              "the checkpoint was trained on was lower-cased, which the shards are checked against. "
                              "Restore it from the run or the model it comes from")
    theirs = content.get(key)
    if isinstance(theirs, bool) and theirs != lower_case:
        text = {True: "lower-cased text", False: "text that kept its case"}
        raise CheckpointError(f"--init_checkpoint {record.parent} was trained on {text[theirs]} ({record.name}: {key} "
                              f"{str(theirs).lower()}) but the shards hold {text[lower_case]} (their lower_case "
                              f"attribute); make the shards {'without' if theirs else 'with'} data.prepare "
                              "--no_lower_case")


def _token_count(vocab_file: Path | None) -> int | None:
    """The size of the shards' vocab.txt, where there is one: all a file without a vocabulary can be checked by."""
    return len(_vocab_tokens(vocab_file)) if vocab_file is not None and vocab_file.is_file() else None


def _vocab_tokens(path: Path) -> list[str]:
    """A vocab.txt's tokens, numbered as the tokenizers number them (modeling.vocab_tokens)."""
    try:
        return vocab_tokens(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _load_hf(model: BertForPreTraining, hf_dir: Path) -> str:
    from safetensors import SafetensorError

    config_file = hf_dir / "config.json"
    try:
        check_hf_exportable(model.config, "--config_file")
    except ConfigError as e:
        raise CheckpointError(f"--init_checkpoint {hf_dir} is a Hugging Face model directory, but {e}. Start this "
                              "model from a run of ours or a checkpoint folder of Habana's deepspeed-bert, or start "
                              "from this directory with its own architecture (layer_norm_large_model false)") from e
    try:
        source = load_hf(hf_dir, model.config.pad_vocab_size_multiple)
    except (ConfigError, OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(f"--init_checkpoint {hf_dir}: cannot load it as a Hugging Face BERT "
                              f"({type(e).__name__}: {e})") from e
    differ = config_differences(source.config.to_dict(), model.config.to_dict(), ARCHITECTURE)
    if differ:
        raise CheckpointError(f"{config_file}: not the model of --config_file ({'; '.join(differ)}); pass a "
                              "--config_file with the same architecture")
    model.load_state_dict(source.state_dict(), strict=True)
    return f"{hf_dir} (Hugging Face)"
