"""Export a training checkpoint as a Hugging Face model directory, with its tokenizer files.

    python scripts/export_hf.py --checkpoint results/run --output results/run/hf

`--checkpoint` is a run's --output_dir (its `checkpoints/latest` is used unless --tag is given),
its `checkpoints/` directory, or one tag directory (`checkpoints/step00001000`, or a DeepSpeed
universal checkpoint `step00001000_universal`; a file in a tag stands for its tag). The weights come from:
  - ZeRO checkpoints (a partition file per rank): the fp32 master weights, merged from every rank's
    partition (bf16 runs: BF16_Optimizer's; fp32 ZeRO-1/2 and another DeepSpeed run's ZeRO-3: DeepSpeed's
    zero_to_fp32);
  - universal checkpoints: the fp32 weight of every parameter (`zero/<name>/fp32.pt`);
  - checkpoints without ZeRO partitions: the module weights in mp_rank_00_model_states.pt.
  - NVIDIA's and Habana's `ckpt_<step>.pt` (the file, or a directory of them: the highest step), and a
    DeepSpeed checkpoint folder of Habana's deepspeed-bert (the folder or one of its tags; their fp32
    masters), in their parameter names (training/reference_checkpoint.py, training/habana_deepspeed.py);
    --config_file (their bert_config.json with "layer_norm_eps": 1e-12) and --vocab_file are then
    required, as neither holds them.
The model config and vocab default to the run's `model_config.json` and `vocab.txt`. The tokenizer
lower-cases as the run's shards were made (their `lower_case` attribute, which the run keeps in
`tokenization.json`); for shards that do not record it (NVIDIA's, Habana's), as the vocab suggests,
unless --do_lower_case or --no_do_lower_case says.
The result loads with `transformers.AutoModelForPreTraining.from_pretrained` (a model trained without NSP:
AutoModelForMaskedLM, as it has no pooler or NSP head to load) and `AutoTokenizer.from_pretrained`.
--config_file and --vocab_file stand in for a run's model_config.json and vocab.txt where it lacks them;
beside the run's own they must agree with it, as must --do_lower_case/--no_do_lower_case with its record.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from data.cli import HelpFormatter
from modeling import (
    EXPORT_INFO,
    BertConfig,
    BertForPreTraining,
    ConfigError,
    check_export_dir,
    check_hf_exportable,
    check_vocab_size,
    config_differences,
    require_transformers_torch,
    save_hf,
    vocab_lower_cases,
    vocab_tokens,
)
from training.checkpoint import (
    CHECKPOINTS,
    RUN_STATE,
    UNIVERSAL_SUFFIX,
    CheckpointError,
    is_set_aside_incomplete,
    is_tag_name,
    pick_complete_tag,
    read_state,
    verify_files,
)
from training.habana_deepspeed import check_config, load_deepspeed_reference
from training.loader import TOKENIZATION
from training.reference_checkpoint import load_reference_checkpoint, reference_checkpoint
from training.weights import ARCHITECTURE, is_tag_dir, is_tag_file, read_fp32_weights, vocab_difference


class ExportError(RuntimeError):
    """A checkpoint that cannot be exported; the message names the path and what to pass instead."""


@dataclass(frozen=True)
class CheckpointLocation:
    run_dir: Path  # the training --output_dir (holds model_config.json and vocab.txt)
    checkpoints_dir: Path
    tag: str

    @property
    def tag_dir(self) -> Path:
        return self.checkpoints_dir / self.tag


def locate(path: Path, tag: str | None = None) -> CheckpointLocation:
    """Accept a run directory, its checkpoints/ directory, a tag directory or a file in a tag."""
    path = path.resolve()
    if path.is_file() and is_tag_file(path):
        path = path.parent
    if not path.is_dir():
        what = "a file, not a directory" if path.exists() else "no such directory"
        raise ExportError(f"{path}: {what}; pass a training --output_dir or a checkpoint tag directory (or "
                          "NVIDIA's or Habana's ckpt_<step>.pt)")
    if is_tag_dir(path):
        if tag is not None and tag != path.name:
            raise ExportError(f"{path} is the checkpoint tag '{path.name}'; --tag {tag} contradicts it")
        return CheckpointLocation(path.parent.parent, path.parent, path.name)
    if (path / CHECKPOINTS).is_dir():  # a run's --output_dir
        run_dir, checkpoints = path, path / CHECKPOINTS
    elif path.name == CHECKPOINTS or (path / "latest").is_file():  # its checkpoints/ directory
        run_dir, checkpoints = path.parent, path
    else:
        raise ExportError(f"{path}: no {CHECKPOINTS}/ directory in it; pass a training --output_dir that has "
                          "saved a checkpoint, its checkpoints/ directory or a checkpoint tag directory")
    if tag is None:
        latest = checkpoints / "latest"
        if not latest.is_file():
            raise ExportError(f"{checkpoints}: no 'latest' file, so no checkpoint was completed there; "
                              + pick_complete_tag(checkpoints, "pass --tag with", "the run saved none yet"))
        tag = latest.read_text().strip()
        if not tag:
            wrong = "is empty"
        elif not is_tag_name(tag):
            wrong = f"holds {tag!r}, not a tag name"
        elif not (checkpoints / tag).is_dir():
            wrong = f"names {tag!r}, but {checkpoints / tag} does not exist"
        else:
            wrong = None
        if wrong:
            raise ExportError(f"{latest} {wrong}; " + another_tag(checkpoints, "pass --tag with (or point 'latest' at)"))
    elif not is_tag_name(tag):
        raise ExportError(f"--tag {tag!r} is not a tag name; pass the name of a directory in {checkpoints}, or pass "
                          "the tag directory itself as the checkpoint")
    if not (checkpoints / tag).is_dir():
        raise ExportError(f"{checkpoints / tag}: no such checkpoint tag; {another_tag(checkpoints, 'pass --tag with')}")
    return CheckpointLocation(run_dir, checkpoints, tag)


def another_tag(checkpoints: Path, do: str) -> str:
    """`do` one of the complete tags of `checkpoints`, named; where none is complete (another DeepSpeed run's
    tags, which have no run_state.json, or a run that completed none), one of the tag directories it holds."""
    held = sorted(p.name for p in checkpoints.iterdir() if is_tag_dir(p))
    return pick_complete_tag(checkpoints, do, f"none has a {RUN_STATE}; {do} one of the tag directories there: "
                                              f"{', '.join(held)}" if held else "there is no checkpoint tag there yet")


def read_weights(loc: CheckpointLocation) -> tuple[dict[str, torch.Tensor], str]:
    """The fp32 weights of a checkpoint and a description of where they came from."""
    try:
        return read_fp32_weights(loc.tag_dir)
    except CheckpointError as e:
        raise ExportError(f"{e}; export another tag with --tag") from e


def check_complete(loc: CheckpointLocation) -> None:
    """A tag of our runs is complete once its run_state.json lists its files; they must all be there with
    their saved sizes and CRC-32s. Tags of other DeepSpeed runs (no tag of the directory has a
    run_state.json) and universal copies (complete once renamed into place) are read as they are."""
    tag_dir = loc.tag_dir
    if (tag_dir / RUN_STATE).is_file():
        try:
            state = read_state(tag_dir)
            verify_files(tag_dir, state, checksum=list(state.files))
        except CheckpointError as e:
            raise ExportError(f"{e}, or export another tag with --tag") from e
    elif not loc.tag.endswith(UNIVERSAL_SUFFIX):
        fix = pick_complete_tag(loc.checkpoints_dir, "pass --tag with", "")
        if is_set_aside_incomplete(loc.tag):
            raise ExportError(f"{tag_dir}: a start of the run set this tag aside, as it was committed but had lost its "
                              f"{RUN_STATE}; put that file back into it to export it" + (f", or {fix}" if fix else ""))
        if not fix and (loc.run_dir / "run_info.json").is_file():  # this project's run, which completed no tag
            fix = (f"the run completed no checkpoint; resume it (run_pretraining.py with --output_dir {loc.run_dir}) "
                   "until it saves one")
        if fix:
            raise ExportError(f"{tag_dir}: no {RUN_STATE}, so this tag was never completed (the run stopped while "
                              f"saving it); {fix}")


def check_overrides(run_dir: Path, config_file: Path | None, vocab_file: Path | None) -> None:
    """--config_file and --vocab_file stand in for a run's missing model_config.json and vocab.txt; where the
    run has its own, they must say the same: another architecture computes another function of the same
    weights, and another numbering of the tokens gives the model ids it was not trained on."""
    run_config, run_vocab = run_dir / "model_config.json", run_dir / "vocab.txt"
    if config_file is not None and run_config.is_file() and config_file.resolve() != run_config.resolve():
        then = _read_own(run_config, "--config_file", BertConfig.from_json_file)
        try:
            now = BertConfig.from_json_file(config_file)
        except ConfigError as e:
            raise ExportError(str(e)) from e
        differ = config_differences(then.to_dict(), now.to_dict(), ARCHITECTURE)
        if differ:
            raise ExportError(f"{config_file}: not the model the run trained ({run_config}: {'; '.join(differ)}); "
                              "drop --config_file, and the run's own is used")
    if vocab_file is not None and run_vocab.is_file() and vocab_file.is_file() \
            and vocab_file.resolve() != run_vocab.resolve():
        then = _read_own(run_vocab, "--vocab_file", vocab_tokens)
        try:
            now = vocab_tokens(vocab_file)
        except ValueError as e:
            raise ExportError(str(e)) from e
        differ = vocab_difference(then, now)
        if differ is not None:
            raise ExportError(f"{vocab_file}: not the vocabulary the run trained with ({run_vocab}, {differ[0]}: "
                              f"{differ[1]}); drop --vocab_file, and the run's own is used")


def _read_own(path: Path, flag: str, read):
    """`read(path)` of a run's own file, which an override is checked against; one that cannot be read is
    named with the way past it: restored, or moved aside so that the override stands in for it."""
    try:
        return read(path)
    except ValueError as e:  # ConfigError, and load_vocab's errors
        raise ExportError(f"{e}. Restore it, or move it out of the run directory so that {flag} stands in "
                          "for it") from e


def tokenizer_case(run_dir: Path | None, vocab_file: Path, lower_case: bool | None) -> tuple[bool, str]:
    """Whether the exported tokenizer lower-cases, and why: the run's record of its shards' lower_case
    attribute (which --do_lower_case/--no_do_lower_case may only repeat), else the command line's, else a
    guess from the vocab. `run_dir`: None for a checkpoint of another project's, which has no record."""
    record = run_dir / TOKENIZATION if run_dir is not None else None
    if record is not None and record.is_file():
        try:
            recorded = json.loads(record.read_text(encoding="utf-8"))["lower_case"]
        except (ValueError, KeyError, TypeError) as e:
            raise ExportError(f"{record}: not a tokenization record ({e}); restore it, or delete it and pass "
                              "--do_lower_case or --no_do_lower_case as the shards were made") from e
        if not isinstance(recorded, bool):
            raise ExportError(f"{record}: lower_case is {recorded!r}, not true or false; restore it, or delete it and "
                              "pass --do_lower_case or --no_do_lower_case as the shards were made")
        if lower_case is not None and lower_case != recorded:
            flag = "--do_lower_case" if lower_case else "--no_do_lower_case"
            raise ExportError(f"{flag} contradicts {record}: the run's shards were made "
                              f"{'lower-cased' if recorded else 'keeping case'}, and the model learned the ids that "
                              f"tokenization gives; drop {flag}")
        return recorded, f"as the run's shards were made ({record})"
    if lower_case is not None:
        return lower_case, "as --do_lower_case/--no_do_lower_case says"
    return vocab_lower_cases(vocab_file), (f"guessed from {vocab_file}: the shards do not record it; pass "
                                           "--do_lower_case or --no_do_lower_case if that is wrong")


@dataclass(frozen=True)
class Exported:
    path: Path
    weights: str  # where the weights came from
    tokenizer: str  # how the tokenizer's case was decided

    def lines(self) -> str:
        return f"exported {self.weights}\n  -> {self.path} (config.json, model.safetensors, tokenizer files, " \
               f"{EXPORT_INFO})\n" \
               f"  tokenizer: {self.tokenizer}"


def their_checkpoint(checkpoint: Path, tag: str | None) -> tuple[Path, str] | None:
    """NVIDIA's or Habana's ckpt_<step>.pt that `checkpoint` names (a file, or a directory of them that is
    none of our run's directories), and how it was chosen; None for our checkpoints."""
    path = checkpoint.resolve()
    if path.is_dir() and ((path / CHECKPOINTS).exists() or (path / "latest").exists() or is_tag_dir(path)):
        return None
    if path.is_file() and (path.suffix != ".pt" or is_tag_file(path)):  # locate takes a tag's file, and names
        return None                                                        # the mistake of a model_config.json
    found = reference_checkpoint(path)
    if found is not None and tag is not None:
        raise ExportError(f"--tag {tag} picks a tag of this project's checkpoints; {found[0]} is NVIDIA's or "
                          "Habana's ckpt_<step>.pt: pass the file itself as --checkpoint")
    return found


def vocab_fix(loc: CheckpointLocation | None) -> str:
    """What to pass when the vocab and the model config differ in size: either may be the wrong one (a
    --config_file of another architecture than the run's own is refused before, by check_overrides)."""
    vocab = "the vocab.txt the shards were made with as --vocab_file"
    if loc is None:  # NVIDIA's or Habana's ckpt_<step>.pt: both were given
        return f"pass their bert_config.json as --config_file, or {vocab}"
    return f"pass {vocab}, or the model config the run trained with as --config_file"


def export(checkpoint: Path, output: Path, tag: str | None = None, config_file: Path | None = None,
           vocab_file: Path | None = None, lower_case: bool | None = None) -> Exported:
    """Write the Hugging Face directory; `lower_case` overrides the run's record of its shards' case."""
    theirs = their_checkpoint(checkpoint, tag)
    loc = None if theirs is not None else locate(checkpoint, tag)
    try:
        check_export_dir(output)  # before the partitions are merged, which takes minutes for a large model
        require_transformers_torch()
    except ValueError as e:
        raise ExportError(str(e)) from e
    if theirs is not None:
        if config_file is None or vocab_file is None:
            raise ExportError(f"{theirs[0]} is NVIDIA's or Habana's ckpt_<step>.pt, which holds no model config and "
                              "no vocabulary: pass --config_file (their bert_config.json, with \"layer_norm_eps\": "
                              "1e-12 added) and --vocab_file (the vocab.txt their shards were made with)")
    else:
        check_overrides(loc.run_dir, config_file, vocab_file)
        config_file = config_file or loc.run_dir / "model_config.json"
        vocab_file = vocab_file or loc.run_dir / "vocab.txt"
    if not config_file.is_file():
        foreign = loc is not None and not (loc.tag_dir / RUN_STATE).is_file()  # a tag of another DeepSpeed run
        raise ExportError(f"{config_file}: no model config; pass the run's --config_file with --config_file" + (
            " (for a DeepSpeed checkpoint folder of Habana's deepspeed-bert: their bert_config.json, with "
            "\"layer_norm_eps\": 1e-12 added, and --vocab_file)" if foreign else ""))
    if not vocab_file.is_file():
        raise ExportError(f"{vocab_file}: no vocab.txt; pass the vocab the shards were made with (--vocab_file)")
    try:
        config = BertConfig.from_json_file(config_file)
    except ConfigError as e:
        raise ExportError(str(e)) from e
    try:
        check_hf_exportable(config, str(config_file))
    except ConfigError as e:
        raise ExportError(f"{e}. Nothing was exported; the checkpoint remains usable with this project (resume "
                          "its run, or start phase 2 from it with --phase2 --init_checkpoint)") from e
    try:
        check_vocab_size(vocab_file, config, config_file, vocab_fix(loc))  # before the weights are read
    except ValueError as e:
        raise ExportError(str(e)) from e
    lower, why = tokenizer_case(loc.run_dir if loc is not None else None, vocab_file, lower_case)
    tokenizer = f"{'lower-cases' if lower else 'keeps case'}, {why}"
    model = BertForPreTraining(config)
    if theirs is not None:
        try:
            source = load_reference_checkpoint(model, *theirs)
        except CheckpointError as e:
            raise ExportError(str(e)) from e
    else:
        check_complete(loc)
        weights, source = read_weights(loc)
        if any(".dense_act." in name for name in weights):  # their fused names: Habana deepspeed-bert's folder
            try:
                check_config(loc.tag_dir, config)
                source = load_deepspeed_reference(model, loc.tag_dir, weights, source)
            except CheckpointError as e:
                raise ExportError(str(e)) from e
        else:
            try:
                model.load_state_dict(weights, strict=True)
            except RuntimeError as e:
                raise ExportError(f"{loc.tag_dir}: the weights do not fit {config_file} ({e}); pass the model "
                                  "config the run trained with (--config_file)") from e
    try:
        save_hf(model.eval(), output, vocab_file=vocab_file, lower_case=lower,
                provenance={"weights": source, "config": str(config_file.resolve()),
                            "vocab": str(vocab_file.resolve()), "tokenizer": tokenizer})
    except ValueError as e:
        raise ExportError(str(e)) from e
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as a SafetensorError
        raise ExportError(f"could not write {output} ({type(e).__name__}: {e}); nothing was written under that "
                          "name and an earlier export there is kept. If the disk is full, free space there and "
                          "rerun the same command") from e
    return Exported(output, source, tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a run's --output_dir, its checkpoints/ directory, or a checkpoint tag directory; or "
                             "NVIDIA's/Habana's ckpt_<step>.pt (or a directory of them) or a DeepSpeed checkpoint "
                             "folder of Habana's deepspeed-bert, with --config_file and --vocab_file")
    parser.add_argument("--output", type=Path, required=True, help="the Hugging Face model directory to write")
    parser.add_argument("--tag", help="checkpoint tag (default: the one named by 'latest')")
    parser.add_argument("--config_file", type=Path, help="model config (default: <run>/model_config.json)")
    parser.add_argument("--vocab_file", type=Path, help="vocab.txt (default: <run>/vocab.txt)")
    case = parser.add_mutually_exclusive_group()
    case.add_argument("--do_lower_case", action="store_const", const=True,
                      help="the tokenizer lower-cases and strips accents (default: as the run's shards were made; "
                           "for shards that do not record it, guessed from the vocab)")
    case.add_argument("--no_do_lower_case", dest="do_lower_case", action="store_const", const=False,
                      help="the tokenizer keeps case and accents")
    args = parser.parse_args(argv)
    try:
        done = export(args.checkpoint, args.output, args.tag, args.config_file, args.vocab_file, args.do_lower_case)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(done.lines())
    return 0


if __name__ == "__main__":
    sys.exit(main())
