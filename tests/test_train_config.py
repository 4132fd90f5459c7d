"""run_pretraining.py's checks that need no process group: batch sizes against the world size,
the DeepSpeed JSON, flag combinations, what a resume may not change, and the non-finite loss guard."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import h5py
import pytest
import torch

from run_pretraining import (
    DEFAULT_DS_CONFIG,
    BatchSizes,
    DivergedError,
    NonFiniteGuard,
    RunConfigError,
    TrainArgs,
    _bf16_norm_assertion,
    check_applied_norm,
    check_resume_identity,
    deepspeed_skips_nonfinite,
    load_ds_config,
    main,
    micro_step_seed,
    open_data,
    parse_args,
    resolve_batch_sizes,
    shard_dirs,
    start_lines,
    write_run_files,
)
from tests.conftest import clear_rendezvous, drain, no_workers_left, to_reference_format
from training.loader import ShardInfo, shard_vocab


@pytest.mark.parametrize("config, world, expected", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, BatchSizes(64, 4, 8)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 16, BatchSizes(64, 4, 1)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 4, BatchSizes(64, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 2, BatchSizes(48, 8, 3)),
    ({"train_micro_batch_size_per_gpu": 8}, 4, BatchSizes(32, 8, 1)),
    ({"train_batch_size": 32}, 4, BatchSizes(32, 8, 1)),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 2,
     BatchSizes(48, 8, 3)),
])
def test_batch_sizes_resolve_like_deepspeed(config, world, expected):
    assert resolve_batch_sizes(config, world, "ds.json") == expected


@pytest.mark.parametrize("config, world, message", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 3}, 2,
     "train_batch_size 64 is not divisible by train_micro_batch_size_per_gpu 3 x world size 2"),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 3}, 1,
     "train_batch_size 64 is not divisible by gradient_accumulation_steps 3 x world size 1"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 8,
     r"train_batch_size 64 != 4 x 4 x 8.*gradient_accumulation_steps 2 with train_batch_size 64"),
    ({"gradient_accumulation_steps": 4}, 1, "set train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": 0}, 1, "'train_micro_batch_size_per_gpu' must be a positive integer"),
    ({"train_batch_size": 6.5}, 1, "'train_batch_size' must be a positive integer"),
    # JSON true is a Python bool, an int subclass, and would count as 1
    ({"train_micro_batch_size_per_gpu": True}, 1,
     "'train_micro_batch_size_per_gpu' must be a positive integer, got True"),
])
def test_batch_sizes_that_do_not_divide_name_the_file_and_fields(config, world, message):
    with pytest.raises(RunConfigError, match=f"^ds.json: .*{message}"):
        resolve_batch_sizes(config, world, "ds.json")


def test_shipped_config_is_zero1_bf16_with_fp32_accumulation_and_clipping(tmp_path):
    config, sizes = load_ds_config(DEFAULT_DS_CONFIG, world_size=2, optimizer="lamb")
    assert config["zero_optimization"]["stage"] == 1 and config["bf16"]["enabled"]
    assert config["data_types"]["grad_accum_dtype"] == "fp32" and config["gradient_clipping"] == 1.0
    assert sizes == BatchSizes(16, 8, 1) and config["train_batch_size"] == 16
    # what TRAINING.md advises for a recipe's global batch: add train_batch_size, the accumulation follows
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(json.loads(DEFAULT_DS_CONFIG.read_text()) | {"train_batch_size": 256}))
    assert load_ds_config(recipe, world_size=8, optimizer="lamb")[1] == BatchSizes(256, 8, 4)


@pytest.mark.parametrize("change, message", [
    ({"data_types": {}}, r"bf16 needs \"data_types\": \{\"grad_accum_dtype\": \"fp32\"\}"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "gradients accumulate in fp32"),
    ({"fp16": {"enabled": True}}, "fp16 is not supported"),
    ({"bfloat16": {"enabled": True}}, "rename 'bfloat16' to 'bf16'"),  # read by DeepSpeed, missed by the checks
    ({"optimizer": {"type": "Adam"}}, "remove the 'optimizer' section"),
    ({"scheduler": {"type": "WarmupLR"}}, "remove the 'scheduler' section"),
    ({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}},
     r"remove the 'activation_checkpointing' section; DeepSpeed applies it only to models that call "
     r"deepspeed.checkpointing, and this one would ignore it; use --checkpoint_activations"),
    # DeepSpeed's other checkpoint engines write after save_checkpoint returns, which run_state.json's checks miss.
    ({"checkpoint": {"writer": {"type": "fast", "decoupled": True}}},
     r"remove 'checkpoint.writer'; checkpoints are written by torch.save, checked \(each file's size and CRC32\) "
     "and committed when the save returns"),
    ({"datastates_ckpt": {"host_cache_size": 16}}, r"remove 'datastates_ckpt'; checkpoints are written by torch.save"),
    ({"nebula": {"enabled": True}}, r"remove 'nebula'; checkpoints are written by torch.save"),
    ({"checkpoint": {"load_universal": True}}, r"remove 'checkpoint.load_universal'; this script sets it when a run "
                                               "resumes on another world size"),
    ({"zero_optimization": {"stage": 0}}, r"zero_optimization.stage 0 is not supported; use"),
    # DeepSpeed takes the strings for 1 and false: the message had said stage 1 is not supported, and a run of
    # "enabled": "false" trained in fp32 while its checkpoint recorded bf16 (found by an audit).
    ({"zero_optimization": {"stage": "1"}},
     r"zero_optimization.stage must be an integer, got \"1\"; use \"zero_optimization\": \{\"stage\": 1\}$"),
    ({"zero_optimization": {"stage": True}}, r"zero_optimization.stage must be an integer, got true"),
    ({"zero_optimization": {"stage": 1.5}}, r"zero_optimization.stage must be an integer, got 1.5"),
    ({"bf16": {"enabled": "false"}}, r"bf16.enabled must be true or false, got \"false\"; write e.g. \"bf16\": "
                                     r"\{\"enabled\": true\}$"),
    ({"fp16": {"enabled": "auto"}}, r"fp16.enabled must be true or false, got \"auto\""),
    ({"zero_optimization": {"stage": 3}}, r"zero_optimization.stage 3 is not supported"),
    ({"zero_optimization": {"stage": 2}}, "bf16 needs zero_optimization.stage 1, got 2"),
    # Its optimizer state, a list per group, made --init_optimizer_moments call phase 1 damaged (found by an audit).
    ({"zero_optimization": {"stage": 1, "elastic_checkpoint": True}},
     r"remove zero_optimization.elastic_checkpoint; under fp32 ZeRO-1/2 it saves the optimizer state as a list per "
     r"parameter group"),
    ({"zero_optimization": {"stage": 1, "compute_grad_norm": False}},
     "compute_grad_norm false turns off DeepSpeed's check for non-finite gradients"),
    # DeepSpeed's parameter mapping is wrong under it: a resume on 1 rank of a 2-rank run was 1.3 off (docs/LAMB.md)
    ({"bf16": {"enabled": False}, "zero_optimization": {"stage": 2, "round_robin_gradients": True}},
     r"remove zero_optimization.round_robin_gradients; DeepSpeed's record of where each parameter lies in the "
     r"partitions is wrong under it"),
    ({"zero_allow_untested_optimizer": False}, r"--optimizer lamb .*\"zero_allow_untested_optimizer\": true; add it"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     r"offload_optimizer takes only DeepSpeed's CPU optimizers unless \"zero_force_ds_cpu_optimizer\": false, "
     r"and this script passes its own \(--optimizer lamb\); add that field, or remove offload_optimizer"),
    # DeepSpeed's own parser, before the model is built: it refused these in deepspeed.initialize, minutes later at
    # 1.5B, with a traceback that named no file (found by an audit).
    ({"zero_optimization": {"stage": 1, "foo": 1}},
     r"DeepSpeed refuses 'zero_optimization.foo': Extra inputs are not permitted \(got 1\); correct or remove it$"),
    ({"bf16": {"enabled": True, "bogus": 1}}, r"DeepSpeed refuses 'bf16.bogus': Extra inputs are not permitted"),
    ({"tensorboard": {"enabled": True, "output_path": 3}},
     r"DeepSpeed refuses 'tensorboard.output_path \(DeepSpeedMonitorConfig\)': Input should be a valid string"),
    ({"checkpoint": {"tag_validation": "Sometimes"}},
     r"DeepSpeed refuses it: Checkpoint config contains invalid tag_validation value of SOMETIMES"),
    ({"gradient_clipping": "a"}, r"gradient_clipping must be a number >= 0 \(0: no clipping\), got 'a'$"),
    ({"gradient_clipping": -1}, r"gradient_clipping must be a number >= 0 \(0: no clipping\), got -1$"),
    # DeepSpeed then updates at every micro batch: the schedule ran 2x ahead and the checkpoint could not resume
    # (found by an audit). true, its default, is what the loop expects.
    ({"managed_gradient_accumulation": False}, r"remove 'managed_gradient_accumulation' \(false\); this script lets "
     r"DeepSpeed decide where a step's gradient accumulation ends, and would otherwise update the weights and the "
     r"learning rate after every micro batch$"),
    ({"gradient_allreduce_op": "SUM"}, r"remove 'gradient_allreduce_op' \(\"SUM\"\); a step's gradient is the mean "
     r"over its global batch"),
])
def test_deepspeed_json_errors(tmp_path, change, message):
    config = json.loads(DEFAULT_DS_CONFIG.read_text()) | change
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(RunConfigError, match=message):
        load_ds_config(path, world_size=1, optimizer="lamb")


def test_a_zero_stage_written_as_a_whole_float_is_taken(tmp_path):
    """1.0 is 1 to DeepSpeed as well: it had been refused as "not a number" for a while (found by a review)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(json.loads(DEFAULT_DS_CONFIG.read_text()) | {"zero_optimization": {"stage": 1.0}}))
    assert load_ds_config(path, world_size=1, optimizer="lamb")[0]["zero_optimization"]["stage"] == 1


@pytest.mark.parametrize("key, meant", [("gradient_cliping", "gradient_clipping"),
                                       ("train_micro_batch_sizeper_gpu", "train_micro_batch_size_per_gpu"),
                                       # ran with a micro batch of the whole global batch (found by an audit)
                                       ("train_micro_batch_size", "train_micro_batch_size_per_gpu"),
                                       ("bf_16", "bf16"), ("zero_optimisation", "zero_optimization")])
def test_a_misspelt_deepspeed_key_is_refused(tmp_path, key, meant):
    """DeepSpeed ignores a key it does not know: "gradient_cliping": 0.5 trained with the default clipping 1.0."""
    config = json.loads(DEFAULT_DS_CONFIG.read_text())
    config[key] = config.pop(meant, 0.5)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(RunConfigError, match=f"^{re.escape(str(path))}: '{key}' is not a DeepSpeed key, which "
                                             f"DeepSpeed would ignore; did you mean '{meant}'\\?$"):
        load_ds_config(path, world_size=1, optimizer="lamb")
    config = json.loads(DEFAULT_DS_CONFIG.read_text()) | {"my_notes": "run 7"}  # close to no key: DeepSpeed's concern
    path.write_text(json.dumps(config))
    assert load_ds_config(path, world_size=1, optimizer="lamb")[1] == BatchSizes(8, 8, 1)


def test_the_deepspeed_keys_are_every_key_deepspeed_reads():
    """A DeepSpeed that reads a key DEEPSPEED_KEYS lacks would have it refused when it is a near miss of another."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from run_pretraining import DEEPSPEED_KEYS

    class Recording(dict):
        def __init__(self, *args):
            super().__init__(*args)
            self.read = set()

        def get(self, key, default=None):
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self.read.add(key)
            return super().__contains__(key)

    for path in sorted(DEFAULT_DS_CONFIG.parent.glob("*.json")):
        config = Recording(json.loads(path.read_text()))
        DeepSpeedConfig(config)
        assert len(config.read) > 40 and config.read <= set(DEEPSPEED_KEYS), sorted(config.read - set(DEEPSPEED_KEYS))


def test_optimizer_offload_is_accepted_with_zero_force_ds_cpu_optimizer_false(tmp_path):
    """The form the offload error asks for (a 1-rank run with it resumes to bitwise equal losses)."""
    config = json.loads(DEFAULT_DS_CONFIG.read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config | {"zero_force_ds_cpu_optimizer": False}))
    assert load_ds_config(path, world_size=1, optimizer="lamb")[1] == BatchSizes(8, 8, 1)


@pytest.mark.parametrize("optimizer, refused", [("lamb", True), ("lans", True), ("adamw", False)])
def test_layerwise_optimizers_need_zero_allow_untested_optimizer(tmp_path, optimizer, refused):
    """DeepSpeed would assert only inside deepspeed.initialize, after the model is built; torch's
    AdamW is on its ZeRO list and needs nothing."""
    config = json.loads(DEFAULT_DS_CONFIG.read_text())
    del config["zero_allow_untested_optimizer"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    if refused:
        with pytest.raises(RunConfigError, match=f"^{re.escape(str(path))}: --optimizer {optimizer} .*"
                                                 "\"zero_allow_untested_optimizer\": true; add it"):
            load_ds_config(path, world_size=1, optimizer=optimizer)
    else:
        assert load_ds_config(path, world_size=1, optimizer=optimizer)[1] == BatchSizes(8, 8, 1)


def test_unreadable_deepspeed_json(tmp_path):
    with pytest.raises(RunConfigError, match="cannot read it"):
        load_ds_config(tmp_path / "missing.json", 1, "lamb")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(RunConfigError, match="not valid JSON"):
        load_ds_config(tmp_path / "bad.json", 1, "lamb")


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"train_micro_batch_size_per_gpu": 8, "fp16": true}', r"'fp16' must be an object, got True"),
    ('{"train_micro_batch_size_per_gpu": 8, "bf16": true}', r"'bf16' must be an object, got True"),
    ('{"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true}, "data_types": "fp32"}',
     r"'data_types' must be an object, got 'fp32'; write e.g. \"data_types\": \{\"grad_accum_dtype\": \"fp32\"\}"),
])
def test_deepspeed_json_of_the_wrong_shape_names_the_field(tmp_path, text, message):
    """Not an AttributeError traceback from config.get(...).get(...)."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(RunConfigError, match=message):
        load_ds_config(path, 1, "lamb")


REQUIRED = ["--deepspeed", "--input_dir", "in", "--output_dir", "out", "--config_file", "c.json", "--max_steps", "5"]


def test_flags_parse_with_reference_names():
    args = parse_args(REQUIRED + ["--local_rank", "3", "--phase2", "--init_checkpoint", "phase1",
                                  "--checkpoint_activations", "--constant_proportion", "0.3"])
    assert args.local_rank == 3 and args.phase2 and args.checkpoint_activations
    assert args.constant_proportion == 0.3 and args.poly_power == 1.0 and args.optimizer == "lamb"


def test_train_takes_typed_settings_whose_defaults_are_the_flags(capsys):
    """train() takes a TrainArgs, not argparse's namespace: the parser's options are its fields (but the
    --deepspeed marker), its defaults are the ones --help shows, and one made in code is checked as the
    command line is."""
    args = parse_args(REQUIRED)
    assert args == TrainArgs(input_dir=Path("in"), output_dir=Path("out"), config_file=Path("c.json"), max_steps=5)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    options = re.split(r"\n  (?=--)", capsys.readouterr().out.split("\noptions:", 1)[1])[1:]
    # the flag: its entry in one line, without the heading of the group that may follow it
    helps = {text.split()[0]: " ".join(text.split("\n\n")[0].split()) for text in options}
    assert set(helps) - {"--deepspeed"} == {f"--{field.name}" for field in dataclasses.fields(TrainArgs)}
    for field in dataclasses.fields(TrainArgs):
        if field.default not in (dataclasses.MISSING, None, False):
            assert helps[f"--{field.name}"].endswith(f"(default: {field.default})"), helps[f"--{field.name}"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_steps = 6  # type: ignore[misc]
    with pytest.raises(RunConfigError, match="^--log_freq must be >= 1, got 0$"):
        dataclasses.replace(args, log_freq=0)
    with pytest.raises(RunConfigError, match="^--optimizer 'sgd': pick one of lamb, lans, adamw$"):
        dataclasses.replace(args, optimizer="sgd")
    with pytest.raises(RunConfigError, match="--lr_decay_style must be one of habana, nvidia, got 'cosine'"):
        dataclasses.replace(args, lr_decay_style="cosine")
    with pytest.raises(RunConfigError, match="^--checkpoint_activations_interval 4 does nothing without "
                                             "--checkpoint_activations; add it or drop the interval$"):
        dataclasses.replace(args, checkpoint_activations_interval=4)
    # Paths given as str in code are the Paths the flags give (str had failed with an AttributeError).
    assert TrainArgs(input_dir="in", output_dir="out", config_file="c.json", max_steps=5, init_checkpoint="p1",
                     phase2=True, deepspeed_config=str(DEFAULT_DS_CONFIG)) == \
        dataclasses.replace(args, init_checkpoint=Path("p1"), phase2=True)


def test_init_checkpoint_help_names_every_kind_of_checkpoint_training_md_lists(capsys):
    """--help named three of the four sources TRAINING.md lists: not Habana deepspeed-bert's DeepSpeed folder."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    # the last mentions: the options' list, after the usage line
    flag = shown[shown.rindex("--init_checkpoint INIT_CHECKPOINT"):shown.rindex("--num_steps_per_checkpoint")]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--phase2` + `--init_checkpoint DIR`"))
    for kind in ("phase-1 run", "Hugging Face BERT directory", "ckpt_<step>.pt", "DeepSpeed checkpoint folder of "
                 "Habana's deepspeed-bert"):
        assert kind in flag and kind in row.replace("`", ""), kind


def test_reference_flags_are_refused_with_what_to_do_instead():
    """NVIDIA's phase-1 command (run_pretraining.sh) and Habana's (run_bert_1.5b_8x.sh) carried over: each
    flag this script covers otherwise is named with its equivalent, not argparse's "unrecognized arguments"."""
    nvidia = ["--train_batch_size=8192", "--max_seq_length=128", "--max_predictions_per_seq=20", "--fp16",
              "--gradient_accumulation_steps=128", "--allreduce_post_accumulation",
              "--allreduce_post_accumulation_fp16", "--do_train", "--json-summary", "results/dllogger.json"]
    with pytest.raises(RunConfigError) as info:
        parse_args(REQUIRED + nvidia)
    lines = str(info.value).splitlines()
    assert lines[0] == "flag(s) of NVIDIA's or Habana's run_pretraining.py that this script does not take:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "--train_batch_size", "--fp16", "--gradient_accumulation_steps", "--allreduce_post_accumulation",
        "--allreduce_post_accumulation_fp16", "--do_train", "--json-summary"]
    assert 'the global batch is "train_batch_size" in --deepspeed_config' in lines[1]
    habana = ["--disable_progress_bar", "--optimizer=lans", "--use_lr_scheduler", "--resume_from_checkpoint",
              "--bert_model=bert-base-uncased", "--scheduler_degree=1.0"]
    with pytest.raises(RunConfigError, match=r"\n  --scheduler_degree: the decay exponent is --poly_power$"):
        parse_args(REQUIRED + habana)
    with pytest.raises(RunConfigError, match=r"^--steps_this_run must be >= 1, got -1; omit it to train to "
                                             r"--max_steps \(what -1 meant in NVIDIA's and Habana's scripts\)$"):
        parse_args(REQUIRED + ["--steps_this_run=-1"])


@pytest.mark.parametrize("flag", ["--max_steps", "--num_steps_per_checkpoint", "--keep_checkpoints", "--log_freq",
                                  "--max_nonfinite_steps", "--max_seq_length", "--max_predictions_per_seq",
                                  "--steps_this_run"])
def test_counts_below_one_are_refused(flag):
    with pytest.raises(RunConfigError, match=f"^{flag} must be >= 1, got 0$"):
        parse_args(REQUIRED + [flag, "0"])  # a flag given twice: argparse takes the last value


@pytest.mark.parametrize("extra, message", [
    (["--phase2"], "--phase2 and --init_checkpoint go together"),
    (["--init_checkpoint", "x"], "--phase2 and --init_checkpoint go together"),
    (["--phase2", "--init_checkpoint", "out"], "must be the phase-1 run"),
    (["--init_optimizer_moments"], r"^--init_optimizer_moments starts phase 2 from phase 1's optimizer moments; it "
                                   r"needs --phase2 --init_checkpoint <phase-1 --output_dir>$"),
    (["--log_freq", "0"], "--log_freq must be >= 1"),
    (["--num_workers", "-1"], "--num_workers must be >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),  # numpy's seed sequences take no negative numbers
    (["--learning_rate", "0"], "--learning_rate must be > 0"),
    (["--learning_rate", "nan"], r"--learning_rate must be > 0 and finite, got nan"),
    (["--learning_rate", "inf"], r"--learning_rate must be > 0 and finite, got inf"),
    (["--poly_power", "nan"], r"--poly_power must be > 0 and finite, got nan"),
    (["--poly_power", "inf"], r"--poly_power must be > 0 and finite, got inf"),
    (["--weight_decay", "-0.5"], r"--weight_decay must be a finite number >= 0, got -0.5"),
    (["--weight_decay", "nan"], r"--weight_decay must be a finite number >= 0, got nan"),
    (["--warmup_proportion", "1.5"], r"--warmup_proportion must be in \[0, 1\]"),
    (["--eval_freq", "2", "--num_eval_samples", "0"], "evaluates nothing"),
    (["--checkpoint_activations_interval", "2"], "does nothing without --checkpoint_activations"),
    (["--checkpoint_activations_interval", "1"], "does nothing without --checkpoint_activations"),  # the default
    (["--warmup_proportion", "0.2", "--constant_proportion", "0.9"],
     r"^--warmup_proportion 0.2 \+ --constant_proportion 0.9 is more than all of --max_steps: the constant phase is "
     r"its length after the warm-up \(Habana's meaning: 0.25 after a warm-up of 0.05 holds the peak until 30% of the "
     r"steps\)$"),
    (["--checkpoint_activations", "--checkpoint_activations_interval", "0"], "must be >= 1, got 0"),
    (["--checkpoint_activations_interval", "0"], "must be >= 1, got 0"),  # not "add --checkpoint_activations"
])
def test_bad_flag_combinations(extra, message):
    with pytest.raises(RunConfigError, match=message):
        parse_args(REQUIRED + extra)


@pytest.mark.parametrize("below", ["", "run"])
def test_an_output_dir_that_is_a_file_is_refused_before_training(tmp_path, below):
    """Not a FileExistsError / NotADirectoryError traceback from mkdir after the engine is built."""
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" / below
    with pytest.raises(RunConfigError, match=f"^--output_dir {re.escape(str(out))}: {re.escape(str(tmp_path / 'f'))} "
                                             "is a file, not a directory; pass a directory$"):
        parse_args(REQUIRED + ["--output_dir", str(out)])


TINY_MODEL = json.loads(Path("configs/models/bert-tiny.json").read_text())


def _identity(optimizer="lamb", weight_decay=0.01, batch=64, shards=(("training/w_training_0.hdf5", 40),),
              bf16=True, predictions=20, recipe=(True, 0.15, False, True), **model):
    return {"optimizer": optimizer, "weight_decay": weight_decay, "train_batch_size": batch,
            "max_predictions_per_seq": predictions, "training_shards": [list(s) for s in shards],
            "shard_recipe": [dict(zip(("static_masks", "masked_lm_prob", "whole_word_masking", "lower_case"), recipe))],
            "model": TINY_MODEL | model, "bf16": bf16}


@pytest.mark.parametrize("now, message", [
    (_identity(optimizer="adamw"), "trained with --optimizer lamb; resuming with --optimizer adamw .* "
                                   "Pass --optimizer lamb"),
    (_identity(weight_decay=0.1), "trained with --weight_decay 0.01; .* Pass --weight_decay 0.01"),
    # Shards without static masks or attributes (NVIDIA-style) are masked with up to this many predictions.
    (_identity(predictions=80), "trained with --max_predictions_per_seq 20; resuming with --max_predictions_per_seq 80 "
                                ".* Pass --max_predictions_per_seq 20"),
    (_identity(batch=128), r"global batch \(train_batch_size\) of 64 sequences; this launch makes 128. "
                           "Set \"train_batch_size\": 64"),
    (_identity(shards=(("training/w_training_0.hdf5", 37),)),
     r"trained on 40 samples in 1 shards; --input_dir in now holds 37 in 1 \(training/w_training_0.hdf5 "
     r"\(40 samples\) is now training/w_training_0.hdf5 \(37 samples\)\)"),
    (_identity(shards=(("training/w_training_0.hdf5", 40), ("training/w_training_1.hdf5", 9))),
     r"now holds 49 in 2 \(1 shards then, 2 now\)\. consumed_samples would index another sample stream: resume on "
     r"the original shards"),
    # The same shards under a parent of the run's --input_dir: the message had told to resume on the original shards.
    (_identity(shards=(("hdf5/training/w_training_0.hdf5", 40),)),
     r"\(training/w_training_0.hdf5 \(40 samples\) is now hdf5/training/w_training_0.hdf5 \(40 samples\)\)\. "
     r"consumed_samples would index another sample stream: these are the same shards under hdf5/: pass --input_dir "
     r"in/hdf5$"),
    # Shards remade with another recipe have the same paths and counts (found by an audit: resumed in silence).
    (_identity(recipe=(False, 0.15, False, True)),
     r"step00000008 was trained on shards made with static masks, masked_lm_prob 0.15, whole_word_masking false, "
     r"lower_case true; the shards in --input_dir in have the same paths and sample counts but were made with dynamic "
     r"masks, masked_lm_prob 0.15, whole_word_masking false, lower_case true, so the samples consumed_samples indexes "
     r"are others: resume on the original shards"),
    (_identity(recipe=(True, 0.1, True, True)), r"made with static masks, masked_lm_prob 0.1, whole_word_masking true"),
    (_identity(recipe=(True, 0.15, False, None)), r"made with static masks, .*, lower_case unrecorded, so the"),
    (_identity(hidden_act="relu", hidden_dropout_prob=0.0),
     r"step00000008 was trained with another model config \(hidden_act 'gelu' there, 'relu' in --config_file; "
     r"hidden_dropout_prob 0.1 there, 0.0 in --config_file\). Resume with the run's config "
     r"\(out/model_config.json\), or start a new phase in another --output_dir with --phase2 --init_checkpoint"),
    (_identity(bf16=False), r"step00000008 was trained in bf16; this DeepSpeed JSON trains in fp32, whose optimizer "
                            r"partitions are laid out otherwise. Resume with a bf16 DeepSpeed JSON \(bf16.enabled "
                            r"true\), or start a new phase"),
])
def test_resume_refuses_another_optimizer_weight_decay_data_model_or_precision(now, message):
    check_resume_identity(Path("out/checkpoints/step00000008"), _identity(), _identity(), Path("in"))
    with pytest.raises(RunConfigError, match=message):
        check_resume_identity(Path("out/checkpoints/step00000008"), _identity(), now, Path("in"))


def test_run_identity_records_what_a_resume_checks(tmp_path):
    """The shards by their path under --input_dir (a moved --input_dir resumes), and the model config
    without initializer_range (the weights are loaded, not initialised)."""
    from types import SimpleNamespace

    from modeling import BertConfig
    from run_pretraining import run_identity
    from training.loader import ShardInfo

    config = BertConfig.from_dict(TINY_MODEL)
    train_set = SimpleNamespace(shards=[
        ShardInfo(str(tmp_path / "in" / "training" / "w_training_0.hdf5"), 40, True),
        ShardInfo(str(tmp_path / "in" / "w_training_1.hdf5"), 9, True)])
    args = parse_args(REQUIRED + ["--input_dir", str(tmp_path / "in"), "--optimizer", "lans", "--weight_decay", "0.02"])
    identity = run_identity(args, train_set, BatchSizes(64, 4, 8), config, bf16=False)
    assert identity == {"optimizer": "lans", "weight_decay": 0.02, "train_batch_size": 64, "max_predictions_per_seq": 20,
                        "training_shards": [["training/w_training_0.hdf5", 40], ["w_training_1.hdf5", 9]],
                        "shard_recipe": [{"static_masks": True, "masked_lm_prob": 0.15, "whole_word_masking": False,
                                          "lower_case": None}],
                        "model": {k: v for k, v in config.to_dict().items() if k != "initializer_range"},
                        "bf16": False}
    assert "hidden_size" in identity["model"] and "initializer_range" not in identity["model"]
    # the same run from a copy of the shards elsewhere, with another initializer_range: resumes
    moved = SimpleNamespace(shards=[ShardInfo(s.path.replace(str(tmp_path / "in"), str(tmp_path / "moved")),
                                              s.num_samples, True) for s in train_set.shards])
    args = dataclasses.replace(args, input_dir=tmp_path / "moved")
    again = run_identity(args, moved, BatchSizes(64, 8, 4), BertConfig.from_dict(TINY_MODEL | {"initializer_range": 0.05}),
                         bf16=False)
    check_resume_identity(Path("out/checkpoints/step00000008"), identity, again, args.input_dir)


def test_resume_refuses_a_checkpoint_that_recorded_other_checks():
    # Saved before the model config and precision were recorded: resuming it would check neither.
    old = {k: v for k, v in _identity(bf16=False, hidden_act="relu").items()
           if k not in ("model", "bf16", "shard_recipe")}
    with pytest.raises(RunConfigError, match=r"step00000008 was saved by another version of run_pretraining.py, which "
                                             r"recorded max_predictions_per_seq, optimizer, train_batch_size, "
                                             r"training_shards, weight_decay for a resume to check, where this one "
                                             r"checks bf16, max_predictions_per_seq, model, optimizer, shard_recipe, "
                                             r"train_batch_size, training_shards, weight_decay. Resume the run with the version that "
                                             r"wrote it, or start a new phase"):
        check_resume_identity(Path("out/checkpoints/step00000008"), old, _identity(), Path("in"))
    newer = _identity() | {"masking_recipe": "x"}
    with pytest.raises(RunConfigError, match="saved by another version"):
        check_resume_identity(Path("out/checkpoints/step00000008"), newer, _identity(), Path("in"))


def test_checkpoints_saved_before_the_masking_budget_was_recorded_still_resume():
    """Their record lacks max_predictions_per_seq (recorded since 2026-11-24) and shard_recipe (2026-11-25): the
    rest is still checked."""
    before = {k: v for k, v in _identity().items() if k not in ("max_predictions_per_seq", "shard_recipe")}
    check_resume_identity(Path("out/checkpoints/step00000008"), before,
                          _identity(predictions=80, recipe=(False, 0.1, True, None)), Path("in"))
    with pytest.raises(RunConfigError, match="trained with --optimizer lamb"):
        check_resume_identity(Path("out/checkpoints/step00000008"), before, _identity(optimizer="adamw"), Path("in"))


def test_checkpoints_saved_before_layer_norm_large_model_existed_still_resume():
    """Their record's model lacks layer_norm_large_model: it means false, the model they trained."""
    from modeling import BertConfig

    model = {k: v for k, v in BertConfig.from_dict(TINY_MODEL).to_dict().items() if k != "initializer_range"}
    assert model["layer_norm_large_model"] is False
    before = _identity() | {"model": {k: v for k, v in model.items() if k != "layer_norm_large_model"}}
    check_resume_identity(Path("out/checkpoints/step00000008"), before, _identity() | {"model": model}, Path("in"))
    habana = _identity() | {"model": model | {"layer_norm_large_model": True}}
    with pytest.raises(RunConfigError, match=r"step00000008 was trained with another model config "
                                             r"\(layer_norm_large_model False there, True in --config_file\)"):
        check_resume_identity(Path("out/checkpoints/step00000008"), before, habana, Path("in"))


def test_a_run_on_a_cpu_nobody_asked_for_is_one_error_line(monkeypatch, capsys):
    clear_rendezvous(monkeypatch)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert main(REQUIRED) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: DeepSpeed found no Gaudi or CUDA device and chose the CPU. To train on the CPU, "
                          "set DS_ACCELERATOR=cpu. ") and err.count("\n") == 1


def test_deepspeed_flag_is_required(capsys):
    with pytest.raises(SystemExit):
        parse_args(REQUIRED[1:])
    assert "the following arguments are required: --deepspeed" in capsys.readouterr().err


def test_nonfinite_guard_counts_batches_and_stops_after_n_in_a_row():
    guard = NonFiniteGuard(limit=3)
    for finite in (False, False, True, False, False):
        guard.batch_loss(finite, step=7)
    assert guard.skipped_batches == 4 and guard.batches_in_a_row == 2 and guard.skipped_steps == 0
    with pytest.raises(DivergedError, match="3 micro batches in a row had a non-finite loss at step 7 "
                                            r"\(5 in total\)"):
        guard.batch_loss(False, step=7)


def test_nonfinite_guard_counts_skipped_steps_apart_from_batches():
    guard = NonFiniteGuard(limit=3, skipped_batches=5, skipped_steps=1)  # counts resumed from a checkpoint
    for applied in (False, False, True, False, False):
        guard.step_update(applied, step=7)
        guard.batch_loss(True, step=7)  # finite losses do not reset the steps in a row
    assert guard.skipped_steps == 5 and guard.steps_in_a_row == 2 and guard.skipped_batches == 5
    with pytest.raises(DivergedError, match="3 optimizer steps in a row had non-finite gradients after step 7 "
                                            r"\(6 in total\); DeepSpeed skipped their updates"):
        guard.step_update(False, step=7)


def test_models_without_nsp_head_train_on_shards_with_nsp_labels():
    from modeling import BertConfig, BertForPreTraining
    from run_pretraining import _losses, _model_inputs

    values = json.loads((DEFAULT_DS_CONFIG.parents[1] / "models" / "bert-tiny.json").read_text())
    model = BertForPreTraining(BertConfig.from_dict(values | {"next_sentence_prediction": False}))
    batch = {"input_ids": torch.randint(5, 1000, (2, 16)), "token_type_ids": torch.zeros(2, 16, dtype=torch.long),
             "attention_mask": torch.ones(2, 16, dtype=torch.long), "masked_lm_positions": torch.tensor([[1, 2]] * 2),
             "masked_lm_labels": torch.tensor([[7, -100]] * 2), "next_sentence_labels": torch.tensor([0, 1])}
    inputs = _model_inputs(batch, torch.device("cpu"), nsp=model.config.next_sentence_prediction)
    assert "next_sentence_labels" not in inputs
    losses = _losses(model(**inputs))
    assert losses[2] == 0 and losses[0] == losses[1] > 0
    assert "next_sentence_labels" in _model_inputs(batch, torch.device("cpu"), nsp=True)


@pytest.mark.parametrize("flag, kind", [("lamb", "Lamb"), ("lans", "Lans"), ("adamw", "AdamW")])
def test_optimizer_flag_builds_that_optimizer_with_the_recipe_settings(flag, kind):
    from modeling import BertConfig, BertForPreTraining
    from run_pretraining import build_optimizer

    model = BertForPreTraining(BertConfig.from_json_file("configs/models/bert-tiny.json"))
    args = parse_args(REQUIRED + ["--optimizer", flag, "--learning_rate", "3e-3", "--weight_decay", "0.02"])
    optimizer = build_optimizer(model, args)
    assert type(optimizer).__name__ == kind
    assert [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in optimizer.param_groups] == [
        (3e-3, 0.02, (0.9, 0.999), 1e-6), (3e-3, 0.0, (0.9, 0.999), 1e-6)]


@pytest.mark.parametrize("error, line", [
    (OSError(28, "No space left on device", "/run/metrics.jsonl"),
     "error: /run/metrics.jsonl: No space left on device; free space there and rerun the same command to continue "
     "where it stopped (from its last checkpoint)"),
    (OSError(28, "No space left on device"),  # TensorBoard's writer thread names no file
     "error: {out}: No space left on device; free space there and rerun the same command to continue where it "
     "stopped (from its last checkpoint)"),
])
def test_a_full_disk_under_rank_0s_files_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys, error, line):
    """metrics.jsonl, eval.jsonl, TensorBoard, run_info.json, starts.jsonl: a full disk was a traceback."""
    import run_pretraining

    def full(args):
        raise error

    monkeypatch.setattr(run_pretraining, "train", full)
    out = tmp_path / "run"
    argv = ["--deepspeed", "--input_dir", str(tmp_path), "--output_dir", str(out), "--config_file", "m.json",
            "--max_steps", "10"]
    assert run_pretraining.main(argv) == 1
    assert capsys.readouterr().err.strip() == line.format(out=out)


def test_a_shard_error_from_a_dataloader_worker_is_one_line(phase1_shards, tmp_path, monkeypatch, capsys):
    """torch raises a worker's error again with the worker's traceback as its message; the run prints the
    error's own message, as with 0 workers."""
    import run_pretraining
    from training.loader import RankSampler, make_loader, open_split

    shards = tmp_path / "reference"  # without our attributes: the vocabulary is checked as rows are read
    shards.mkdir()
    src = sorted((phase1_shards / "hdf5" / "training").glob("*.hdf5"))[0]
    to_reference_format(src, shards / "ref_training_0.hdf5")
    with h5py.File(src) as f:
        largest = int(f["input_ids"][()].max())

    def train(args):
        dataset = open_split(shards, "training", 128, 20, largest, seed=1, shuffle=True)
        drain(make_loader(dataset, RankSampler(0, 8, 0, 1), 8, args.num_workers))

    monkeypatch.setattr(run_pretraining, "train", train)
    lines = []
    for workers in ("0", "2"):
        argv = ["--deepspeed", "--input_dir", str(shards), "--output_dir", str(tmp_path / workers),
                "--config_file", "m.json", "--max_steps", "10", "--num_workers", workers]
        assert run_pretraining.main(argv) == 1
        lines.append(capsys.readouterr().err)
        no_workers_left()
    assert re.fullmatch(r"error: \S+\.hdf5: row \d+ holds token id \d+, outside the model's vocab_size \d+; the "
                        r"shards were made with another vocabulary, set vocab_size in --config_file to match it\n",
                        lines[0])
    assert lines[1] == lines[0]


def test_the_evaluation_set_ends_where_each_evaluation_stops_reading(phase1_shards, tmp_path):
    """The test set's stream ends at --num_eval_samples, so no shard past the evaluated positions is read
    ahead (training.loader); the training stream never ends."""
    argv = ["--deepspeed", "--input_dir", str(phase1_shards), "--output_dir", str(tmp_path), "--config_file", "m.json",
            "--max_steps", "10", "--num_eval_samples", "48"]
    train_set, eval_set = open_data(parse_args(argv), 30522)
    assert (train_set.stream_end, eval_set.stream_end) == (None, 48)
    assert [Path(s.path).parent.name for s in train_set.shards + eval_set.shards] == ["training", "training", "test"]
    assert open_data(parse_args([*argv, "--num_eval_samples", "0"]), 30522)[1] is None


def test_an_oserror_that_is_not_the_disks_state_keeps_its_traceback(tmp_path, monkeypatch):
    import run_pretraining

    def reset(args):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(run_pretraining, "train", reset)
    argv = ["--deepspeed", "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"), "--config_file",
            "m.json", "--max_steps", "10"]
    with pytest.raises(ConnectionResetError):
        run_pretraining.main(argv)


def _dataset(root: Path, samples: int = 10, *dirs: str):
    """A stand-in for a split's dataset: two shards of `samples` sequences in each directory under `root`."""
    shards = [ShardInfo(str(root / d / f"part_{k}.hdf5"), samples, True) for d in (dirs or (".",)) for k in range(2)]
    return type("Dataset", (), {"shards": shards, "__len__": lambda self: samples * len(shards)})()


def _start(root: Path, **changes) -> tuple[dict, TrainArgs]:
    """The run_info fields and flags start_lines reads, for a 1-rank fp32 run on `root`."""
    info = dict(world_size=1, bf16=False, activation_checkpointing=False, accelerator="cpu", backend="gloo",
                zero_stage=1, optimizer="lamb", train_batch_size=8, micro_batch=8, gradient_accumulation_steps=1,
                parameters=1e6, start_step=0, resumed_from=None, resumed_world_size=None, start_consumed_samples=0,
                init_checkpoint=None)
    flags = {f.name for f in dataclasses.fields(TrainArgs)}
    args = TrainArgs(input_dir=root, output_dir=root / "run", config_file=Path("m.json"), max_steps=8,
                     **{"num_eval_samples": 4} | {k: v for k, v in changes.items() if k in flags})
    info.update({k: v for k, v in changes.items() if k not in flags})
    return info, args


def test_the_start_names_each_directory_its_shards_come_from(tmp_path: Path):
    """An --input_dir above several datasets reads them all (a corpus of several sources); the console says so."""
    assert shard_dirs(_dataset(tmp_path), tmp_path) == str(tmp_path)
    assert shard_dirs(_dataset(tmp_path, 10, "wiki/hdf5/training"), tmp_path) == "wiki/hdf5/training"
    assert shard_dirs(_dataset(tmp_path, 10, "wiki/hdf5/training", "books/hdf5/training"), tmp_path) == \
        "books/hdf5/training, wiki/hdf5/training"
    assert shard_dirs(_dataset(tmp_path, 10, *"edcba"), tmp_path) == "a, b, c and 2 more directories"


def test_the_start_says_how_often_it_evaluates_in_words(tmp_path: Path):
    """--eval_freq 1 read "every 1 steps"."""
    lines = start_lines(*_start(tmp_path, eval_freq=1), _dataset(tmp_path, 50), _dataset(tmp_path, 5), None)
    assert lines[5].endswith("the first 4 evaluated every 1 step and at the end"), lines[5]
    lines = start_lines(*_start(tmp_path, eval_freq=8), _dataset(tmp_path, 50), _dataset(tmp_path, 5), None)
    assert lines[5].endswith("evaluated every 8 steps and at the end"), lines[5]


def test_the_start_caps_the_evaluated_samples_and_names_another_world_size_only(tmp_path: Path):
    info, args = _start(tmp_path, world_size=2, micro_batch=4, start_step=4, resumed_from="step00000004",
                        resumed_world_size=2, start_consumed_samples=32, num_eval_samples=1024)
    lines = start_lines(info, args, _dataset(tmp_path, 50), _dataset(tmp_path, 2), None)
    assert "; the first 4 evaluated at the end" in lines[5], lines[5]
    assert lines[6].endswith(", resumed from step00000004 at sequence 32"), lines[6]
    info["resumed_world_size"] = 4
    assert start_lines(info, args, _dataset(tmp_path, 50), _dataset(tmp_path, 2), None)[6].endswith(
        " at sequence 32 of a 4-rank run")


def test_the_start_says_when_lamb_runs_as_adam(tmp_path: Path):
    """LAMB adapts the groups that decay, as NVIDIA's does: at --weight_decay 0 none does, and nothing said so."""
    for optimizer, weight_decay, said in [("lamb", 0.0, True), ("lamb", 0.01, False), ("lans", 0.0, False),
                                          ("adamw", 0.0, False)]:
        info, args = _start(tmp_path, optimizer=optimizer, weight_decay=weight_decay)
        info["optimizer"] = optimizer  # run_info's copy of the flag
        line = start_lines(info, args, _dataset(tmp_path, 50), None, None)[0]
        assert line.endswith(f"optimizer {optimizer}" + (" (no group decays at --weight_decay 0, so no trust ratio: "
                                                         "Adam's update)" if said else "")), line


def test_the_vocab_of_data_prepares_hdf5_directory_is_the_one_beside_it(tmp_path: Path, bert_vocab):
    """--input_dir <data.prepare output>/hdf5 (which the no-shards error suggests) found no vocab.txt: the run kept
    none and a phase 2 skipped its vocabulary check, without a word."""
    (tmp_path / "hdf5").mkdir()
    info, args = _start(tmp_path / "hdf5")
    assert shard_vocab(tmp_path / "hdf5") is None
    assert start_lines(info, args, _dataset(tmp_path / "hdf5", 50), None, shard_vocab(tmp_path / "hdf5"))[4] == (
        f"vocabulary: none in {tmp_path / 'hdf5'}, so the run keeps none (scripts/export_hf.py will need --vocab_file) "
        "and a phase 2 cannot compare it with its own")
    (tmp_path / "vocab.txt").write_bytes(bert_vocab.read_bytes())
    assert shard_vocab(tmp_path / "hdf5") == shard_vocab(tmp_path) == tmp_path / "vocab.txt"
    assert start_lines(info, args, _dataset(tmp_path / "hdf5", 50), None, shard_vocab(tmp_path / "hdf5"))[4] == f"vocabulary: {tmp_path / 'vocab.txt'}"
    (tmp_path / "hdf5" / "vocab.txt").write_text("[PAD]\n")  # the shards' own directory comes first
    assert shard_vocab(tmp_path / "hdf5") == tmp_path / "hdf5" / "vocab.txt"
    (tmp_path / "data").mkdir()
    assert shard_vocab(tmp_path / "data") is None  # only data.prepare's hdf5/ looks one level up


def test_the_run_keeps_its_shards_case_beside_its_vocab_and_drops_a_stale_record(tmp_path, bert_vocab):
    """export_hf reads <output_dir>/tokenization.json; a start on shards that do not record their case
    must not leave an earlier start's record there, which the export would trust over the vocab."""
    from modeling import BertConfig

    data = tmp_path / "data"
    data.mkdir()
    (data / "vocab.txt").write_bytes(bert_vocab.read_bytes())
    run = tmp_path / "run"
    config = BertConfig.from_dict(TINY_MODEL)
    write_run_files(run, shard_vocab(data), config, False)
    assert json.loads((run / "tokenization.json").read_text()) == {"lower_case": False}
    assert (run / "vocab.txt").read_bytes() == bert_vocab.read_bytes()
    write_run_files(run, shard_vocab(data), config, True)
    assert json.loads((run / "tokenization.json").read_text()) == {"lower_case": True}
    write_run_files(run, shard_vocab(data), config, None)
    assert not (run / "tokenization.json").exists()
    assert sorted(p.name for p in run.iterdir()) == ["model_config.json", "vocab.txt"]


def test_dropout_seeds_are_fixed_numbers_of_seed_position_and_rank():
    """A resumed run draws the dropout masks of an uninterrupted one only if these stay the same numbers, on
    NumPy 1.x too (its uint64 >> int raised a TypeError there at the first step)."""
    assert [micro_step_seed(s, p, r) for s, p, r in [(42, 0, 0), (42, 4096, 1), (12439, 10**9, 7)]] == [
        5732826375231505755, 7261701303596047865, 3210812356538674357]
    assert all(0 <= micro_step_seed(7, p, 0) < 2**63 for p in range(100))  # torch.manual_seed takes them


def test_an_update_deepspeed_applied_with_a_non_finite_norm_stops_the_run():
    """DeepSpeed before 0.19.8 applies an fp32 ZeRO update whose gradient norm is not finite (measured with
    0.16.1 to 0.19.7): the run must stop before a checkpoint saves the weights it left."""
    for norm in (1.5, 0.0, None):  # None: DeepSpeed computed no norm (no clipping configured)
        check_applied_norm(norm, 4)
    for norm in (math.inf, math.nan, torch.tensor(math.nan), -1.0):  # -1: the helpers' sentinel
        with pytest.raises(DivergedError, match=r"^step 5: the gradient norm is not finite, and DeepSpeed "
                                                r"[0-9.]+\S* applied the update anyway: .* This run stops before any "
                                                r"checkpoint holds the step: resume from the last one"):
            check_applied_norm(norm, 4)


def test_bf16_optimizers_bare_norm_assertion_is_told_apart_from_other_assertions():
    """DeepSpeed before 0.19.8 stops BF16_Optimizer.step at `assert all_groups_norm > 0.` for a non-finite
    norm; only that assertion becomes the explained stop."""
    def raised(filename: str) -> AssertionError:
        code = compile("def step(norm):\n    assert norm > 0.\n", filename, "exec")
        namespace: dict = {}
        exec(code, namespace)
        try:
            namespace["step"](math.nan)
        except AssertionError as e:
            return e
        raise AssertionError("not raised")

    assert _bf16_norm_assertion(raised("/site-packages/deepspeed/runtime/bf16_optimizer.py"))
    assert not _bf16_norm_assertion(raised("/site-packages/deepspeed/runtime/engine.py"))
    assert not _bf16_norm_assertion(AssertionError("no traceback"))


@pytest.mark.parametrize("version, skips", [("0.19.8", True), ("0.20.0", True), ("0.19.7", False),
                                            ("0.16.1+hpu.synapse.v1.20.0", False), ("1.0.0rc1", True)])
def test_the_norm_is_read_back_only_where_deepspeed_does_not_skip(monkeypatch, version, skips):
    """Only DeepSpeed 0.19.8 and later skip a non-finite update; on them the check after each step is left out."""
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", version)
    deepspeed_skips_nonfinite.cache_clear()
    try:
        assert deepspeed_skips_nonfinite() is skips
    finally:
        deepspeed_skips_nonfinite.cache_clear()
