"""Training presets: published recipes tied to a model config, a DeepSpeed config and run arguments.

A preset (configs/presets/*.json) fixes what a recipe fixes: the global batch, the sequence length,
the learning-rate schedule, the number of steps. These are the same on every cluster shape (so a run
resumes on another node count); what depends on the cluster, the number of nodes and the device, is
resolved at launch time:

    gradient_accumulation_steps = global_batch_size / (micro_batch_per_device * nodes * devices_per_node)

`resolve` returns the run flags for run_pretraining.py and the DeepSpeed JSON with the batch fields
filled in; `python -m training.presets resolve ...` is what scripts/launch.sh calls.

Relative paths inside a preset (model_config, deepspeed_config) are relative to the project root.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from data.cli import file_in_the_way
from data.stage import disk_error
from training.atomic import atomic_write_text
from training.schedule import DECAY_STYLES

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PRESET_DIR = PROJECT_ROOT / "configs" / "presets"
OPTIMIZERS = ("lamb", "lans", "adamw")
DEFAULT_KEY = "default"
# Fields a user may override at launch (--set name=value); the recipe's identity fields are not among them.
OVERRIDABLE = ("model_config", "deepspeed_config", "max_steps", "num_steps_per_checkpoint", "learning_rate", "micro_batch_per_device",
               "global_batch_size", "warmup_proportion", "constant_proportion", "poly_power", "lr_decay_style",
               "devices_per_node", "checkpoint_activations", "optimizer", "init_optimizer_moments")


class PresetError(ValueError):
    """A preset that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Preset:
    name: str
    path: Path
    description: str
    source: tuple[str, ...]
    model_config: Path
    deepspeed_config: Path
    phase: int
    max_seq_length: int
    max_predictions_per_seq: int
    global_batch_size: int
    devices_per_node: int
    micro_batch_per_device: dict[str, int]  # device kind -> micro batch; "default" always present
    learning_rate: float  # peak lr: one per recipe, as the global batch is (never per node count)
    warmup_proportion: float
    constant_proportion: float
    poly_power: float  # decay exponent after the constant phase: 1 = linear (Gaudi), 0.5 (NVIDIA)
    max_steps: int
    num_steps_per_checkpoint: int
    optimizer: str
    checkpoint_activations: bool = False
    init_optimizer_moments: bool = False  # phase 2: start from phase 1's Adam moments (NVIDIA's phase 2)
    lr_decay_style: str = "habana"  # "nvidia" for NVIDIA's recipes (training/schedule.py)
    notes: str = ""


@dataclass(frozen=True)
class ResolvedRun:
    """A preset resolved for one cluster shape."""

    preset: Preset
    num_nodes: int
    devices_per_node: int
    device_kind: str
    micro_batch_per_device: int
    gradient_accumulation_steps: int
    deepspeed_config: dict = field(repr=False)

    @property
    def learning_rate(self) -> float:
        return self.preset.learning_rate

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def sequences_per_device_per_step(self) -> int:
        return self.micro_batch_per_device * self.gradient_accumulation_steps

    def run_args(self, deepspeed_config_path: str | os.PathLike, init_checkpoint: str | None = None) -> list[str]:
        """Flags for run_pretraining.py (input and output directories come from the caller)."""
        p = self.preset
        args = [
            "--config_file", str(p.model_config),
            "--max_seq_length", str(p.max_seq_length),
            "--max_predictions_per_seq", str(p.max_predictions_per_seq),
            "--max_steps", str(p.max_steps),
            "--learning_rate", repr(self.learning_rate),
            "--warmup_proportion", repr(p.warmup_proportion),
            "--constant_proportion", repr(p.constant_proportion),
            "--poly_power", repr(p.poly_power),
            "--lr_decay_style", p.lr_decay_style,
            "--num_steps_per_checkpoint", str(p.num_steps_per_checkpoint),
            "--optimizer", p.optimizer,
            "--deepspeed", "--deepspeed_config", str(deepspeed_config_path),
        ]
        if p.checkpoint_activations:
            args.append("--checkpoint_activations")
        if p.phase == 2:
            if not init_checkpoint:
                raise PresetError(f"{p.path}: preset '{p.name}' is a phase-2 recipe; pass the phase-1 output "
                                  "directory as init_checkpoint (launch.sh: --init_checkpoint <dir>)")
            args += ["--phase2", "--init_checkpoint", str(init_checkpoint)]
            if p.init_optimizer_moments:
                args.append("--init_optimizer_moments")
        elif init_checkpoint:
            raise PresetError(f"{p.path}: preset '{p.name}' is phase 1 and starts from scratch; "
                              "--init_checkpoint is only for phase-2 presets")
        return args


# ----------------------------------------------------------------------------------------------------
# Loading and validation


def _fail(path: Path, name: str, message: str) -> PresetError:
    return PresetError(f"{path}: field '{name}' {message}")


def _int(values: dict, path: Path, name: str, minimum: int = 1) -> int:
    value = values[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, name, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _proportion(values: dict, path: Path, name: str) -> float:
    value = values[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise _fail(path, name, f"must be a number in [0, 1], got {value!r}")
    return float(value)


def _micro_batches(values: dict, path: Path) -> dict[str, int]:
    """micro_batch_per_device: an integer, or an object {"default": integer, "<device kind>": integer, ...}."""
    name = "micro_batch_per_device"
    value = values[name]

    def check(v, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _fail(path, where, f"must be a positive integer, got {v!r}")
        return v

    if not isinstance(value, dict):
        return {DEFAULT_KEY: check(value, name)}
    if DEFAULT_KEY not in value:
        raise _fail(path, name, f"is an object without a \"{DEFAULT_KEY}\" entry; add one "
                                f"(keys are device kinds, e.g. {{\"default\": 32, \"gaudi1\": 16}})")
    return {str(k): check(v, f"{name}.{k}") for k, v in value.items()}


def _learning_rate(values: dict, path: Path) -> float:
    """One positive number. A preset fixes the global batch, so its learning rate must not depend on the
    node count (an older form keyed it by node count; a run saved on one node count then could not
    resume on another)."""
    value = values["learning_rate"]
    if isinstance(value, dict):
        default = value.get(DEFAULT_KEY)
        fix = (f"replace the object with one number (its \"{DEFAULT_KEY}\" entry is {default!r})"
               if default is not None else "replace the object with one number")
        raise _fail(path, "learning_rate", f"is an object ({json.dumps(value)}), one learning rate per node count; "
                    "the global batch is the same on every node count, so the learning rate must be too: "
                    f"{fix}, or override it for a run with --set learning_rate=<number>")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _fail(path, "learning_rate", f"must be a positive number, got {value!r}")
    return float(value)


def _config_path(values: dict, path: Path, name: str) -> Path:
    value = values[name]
    if not isinstance(value, str) or not value:
        raise _fail(path, name, f"must be a path string, got {value!r}")
    resolved = Path(value) if Path(value).is_absolute() else PROJECT_ROOT / value
    if not resolved.is_file():
        what = "is a directory, not a JSON file" if resolved.is_dir() else "does not exist"
        raise _fail(path, name, f"points to {resolved}, which {what}; fix the path "
                                f"(relative paths are relative to {PROJECT_ROOT})")
    return resolved


REQUIRED = ("name", "description", "source", "model_config", "deepspeed_config", "phase", "max_seq_length",
            "max_predictions_per_seq", "global_batch_size", "devices_per_node", "micro_batch_per_device",
            "learning_rate", "warmup_proportion", "constant_proportion", "poly_power", "max_steps",
            "num_steps_per_checkpoint", "optimizer")
OPTIONAL = ("checkpoint_activations", "init_optimizer_moments", "lr_decay_style", "notes")


def preset_from_dict(values: dict, path: Path) -> Preset:
    """Validate every field of a preset; errors name the file and the field."""
    if not isinstance(values, dict):
        raise PresetError(f"{path}: expected a JSON object of preset fields")
    unknown = sorted(set(values) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise PresetError(f"{path}: unknown field(s) {', '.join(unknown)}; known fields: "
                          f"{', '.join(REQUIRED + OPTIONAL)}")
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise PresetError(f"{path}: missing field(s) {', '.join(missing)}; add them to the JSON")
    for name in ("name", "description"):
        if not isinstance(values[name], str) or not values[name].strip():
            raise _fail(path, name, "must be a non-empty string")
    source = values["source"]
    if isinstance(source, str):
        source = [source]
    if not isinstance(source, list) or not source or not all(isinstance(s, str) and s for s in source):
        raise _fail(path, "source", "must name where the recipe comes from (a string or a list of strings)")
    phase = values["phase"]
    if phase not in (1, 2) or isinstance(phase, bool):
        raise _fail(path, "phase", f"must be 1 or 2, got {phase!r}")
    seq = _int(values, path, "max_seq_length", minimum=8)
    preds = _int(values, path, "max_predictions_per_seq")
    if preds > seq - 3:  # [CLS] and two [SEP] are never masked
        raise _fail(path, "max_predictions_per_seq",
                    f"is {preds}, more than a sequence of {seq} can hold ({seq - 3} maskable tokens)")
    warmup = _proportion(values, path, "warmup_proportion")
    constant = _proportion(values, path, "constant_proportion")
    if warmup + constant > 1.0 + 1e-9:
        raise _fail(path, "constant_proportion",
                    f"is {constant}, and with warmup_proportion {warmup} more than all of max_steps: it is the "
                    "constant phase's length AFTER the warm-up, as Habana's --constant_proportion (0.25 after a "
                    "warm-up of 0.05 = the peak until 30% of the steps; see training/schedule.py)")
    poly_power = values["poly_power"]
    if isinstance(poly_power, bool) or not isinstance(poly_power, (int, float)) or poly_power <= 0:
        raise _fail(path, "poly_power", f"must be a number > 0 (1 = linear decay), got {poly_power!r}")
    decay_style = values.get("lr_decay_style", "habana")
    if decay_style not in DECAY_STYLES:
        raise _fail(path, "lr_decay_style", f"must be one of {', '.join(DECAY_STYLES)}, got {decay_style!r}")
    if decay_style == "nvidia" and constant > 0:
        raise _fail(path, "lr_decay_style", f"is 'nvidia', whose scheduler has no constant phase, but "
                                            f"constant_proportion is {constant}; set it to 0, or use 'habana'")
    optimizer = values["optimizer"]
    if optimizer not in OPTIMIZERS:
        raise _fail(path, "optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    checkpoint_activations = values.get("checkpoint_activations", False)
    if not isinstance(checkpoint_activations, bool):
        raise _fail(path, "checkpoint_activations", f"must be true or false, got {checkpoint_activations!r}")
    init_moments = values.get("init_optimizer_moments", False)
    if not isinstance(init_moments, bool):
        raise _fail(path, "init_optimizer_moments", f"must be true or false, got {init_moments!r}")
    if init_moments and phase == 1:
        raise _fail(path, "init_optimizer_moments", "is true in a phase-1 preset, which starts from scratch; it is "
                                                    "for phase 2 (phase 1's optimizer moments)")
    notes = values.get("notes", "")
    if not isinstance(notes, str):
        raise _fail(path, "notes", "must be a string")
    learning_rate = _learning_rate(values, path)
    preset = Preset(
        name=values["name"], path=path, description=values["description"], source=tuple(source),
        model_config=_config_path(values, path, "model_config"),
        deepspeed_config=_config_path(values, path, "deepspeed_config"),
        phase=phase, max_seq_length=seq, max_predictions_per_seq=preds,
        global_batch_size=_int(values, path, "global_batch_size"),
        devices_per_node=_int(values, path, "devices_per_node"),
        micro_batch_per_device=_micro_batches(values, path),
        learning_rate=learning_rate, warmup_proportion=warmup, constant_proportion=constant,
        poly_power=float(poly_power),
        max_steps=_int(values, path, "max_steps"),
        num_steps_per_checkpoint=_int(values, path, "num_steps_per_checkpoint"),
        optimizer=optimizer, checkpoint_activations=checkpoint_activations, init_optimizer_moments=init_moments,
        lr_decay_style=decay_style, notes=notes,
    )
    _check_model_fits(preset)
    return preset


def _check_model_fits(preset: Preset) -> None:
    from modeling import BertConfig, ConfigError

    try:
        model = BertConfig.from_json_file(preset.model_config)
    except ConfigError as e:
        raise PresetError(f"{preset.path}: field 'model_config': {e}") from e
    if preset.max_seq_length > model.max_position_embeddings:
        raise _fail(preset.path, "max_seq_length", f"is {preset.max_seq_length} but {preset.model_config} "
                    f"has max_position_embeddings {model.max_position_embeddings}")


def preset_path(name_or_path: str | os.PathLike) -> Path:
    """A preset name (configs/presets/<name>.json) or a path to a preset file."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" or candidate.exists():
        if not candidate.is_file():
            raise PresetError(f"{candidate}: preset file not found")
        return candidate
    path = PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(p.stem for p in list_presets())
        raise PresetError(f"unknown preset '{name_or_path}'; known presets: {known}")
    return path


def load_preset(name_or_path: str | os.PathLike, overrides: dict | None = None) -> Preset:
    """Load and validate a preset; `overrides` replace fields before validation (see OVERRIDABLE)."""
    path = preset_path(name_or_path)
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PresetError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    except OSError as e:
        raise PresetError(f"{path}: cannot read preset ({e.strerror})") from e
    if overrides:
        bad = sorted(set(overrides) - set(OVERRIDABLE))
        if bad:
            raise PresetError(f"{path}: cannot override {', '.join(bad)}; overridable fields: {', '.join(OVERRIDABLE)}")
        if isinstance(values, dict):
            values = {**values, **overrides}
    preset = preset_from_dict(values, path)
    expected = path.stem
    if path.parent.resolve() == PRESET_DIR.resolve() and preset.name != expected:
        raise _fail(path, "name", f"is '{preset.name}' but the file is {path.name}; make them equal")
    return preset


def list_presets(directory: Path = PRESET_DIR) -> list[Path]:
    return sorted(directory.glob("*.json"))


def parse_override(text: str) -> tuple[str, object]:
    """'max_steps=10' -> ('max_steps', 10). Values are read as JSON (numbers, true/false, objects);
    anything that is not JSON is a string (a path for model_config or deepspeed_config)."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise PresetError(f"override '{text}' must look like name=value (e.g. max_steps=100)")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


# ----------------------------------------------------------------------------------------------------
# Resolution for a cluster shape


def fitting_micro_batches(global_batch: int, largest: int, devices: int) -> list[int]:
    """The micro batches up to `largest` that split the global batch exactly on `devices` devices, ascending."""
    return [m for m in range(1, largest + 1) if global_batch % (m * devices) == 0]


def gradient_accumulation(global_batch: int, micro_batch: int, devices: int, source: str = "preset") -> int:
    """global = micro * devices * accumulation, exactly; anything else is an error with the fix."""
    per_step = micro_batch * devices
    if global_batch % per_step:
        divisors = fitting_micro_batches(global_batch, micro_batch, devices)
        hint = (f"micro batches that divide on {devices} devices: {divisors[-4:]}" if divisors else
                f"no micro batch divides {global_batch} on {devices} devices; change the node count or the global batch")
        raise PresetError(f"{source}: global batch {global_batch} is not divisible by micro batch {micro_batch} x "
                          f"{devices} devices = {per_step}; {hint}")
    return global_batch // per_step


def resolve(preset: Preset, num_nodes: int, devices_per_node: int | None = None,
            device_kind: str = DEFAULT_KEY) -> ResolvedRun:
    if num_nodes < 1:
        raise PresetError(f"{preset.path}: number of nodes must be >= 1, got {num_nodes}")
    if devices_per_node is None:
        devices_per_node = preset.devices_per_node
    elif devices_per_node < 1:
        raise PresetError(f"{preset.path}: devices per node must be >= 1, got {devices_per_node}")
    micro = preset.micro_batch_per_device.get(device_kind)
    if micro is None:
        raise PresetError(f"{preset.path}: field 'micro_batch_per_device' has no entry for device kind "
                          f"'{device_kind}'; known kinds: {', '.join(preset.micro_batch_per_device)}")
    accumulation = gradient_accumulation(preset.global_batch_size, micro, num_nodes * devices_per_node,
                                         source=f"{preset.path} on {num_nodes} node(s) x {devices_per_node} devices")
    ds_config = _read_json(preset.deepspeed_config)
    ds_config.update({
        "train_batch_size": preset.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
    })
    return ResolvedRun(preset=preset, num_nodes=num_nodes, devices_per_node=devices_per_node,
                       device_kind=device_kind, micro_batch_per_device=micro,
                       gradient_accumulation_steps=accumulation, deepspeed_config=ds_config)


def _read_json(path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PresetError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    if not isinstance(values, dict):
        raise PresetError(f"{path}: expected a JSON object (a DeepSpeed config)")
    return values


# ----------------------------------------------------------------------------------------------------
# CLI


def _table(paths: list[Path]) -> str:
    rows = ["| preset | model | phase | seq / preds | global batch | micro batch | lr | steps | source |",
            "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        p = load_preset(path)
        micro = ", ".join(f"{k}: {v}" for k, v in p.micro_batch_per_device.items())
        rows.append(f"| {p.name} | {p.model_config.name} | {p.phase} | {p.max_seq_length} / {p.max_predictions_per_seq}"
                    f" | {p.global_batch_size} | {micro} | {p.learning_rate:g} | {p.max_steps} | {p.source[0]} |")
    return "\n".join(rows)


# How to change what a run flag given after launch.sh's '--' would repeat: the preset's field, or launch.sh's
# own option. run_pretraining.py's argparse keeps the last of a repeated flag, so a repeat would replace the
# recipe's value without its checks, and the launch's summary line would show the preset's.
REPEATED_FLAG_FIX = {
    "--config_file": "change it with --set model_config=<file>",
    "--deepspeed_config": "change it with --set deepspeed_config=<file>",
    **{flag: f"change it with --set {flag[2:]}=<value>" for flag in (
        "--max_steps", "--learning_rate", "--warmup_proportion", "--constant_proportion", "--poly_power",
        "--lr_decay_style", "--num_steps_per_checkpoint", "--optimizer")},
    "--checkpoint_activations": "change it with --set checkpoint_activations=true|false",
    "--init_optimizer_moments": "change it with --set init_optimizer_moments=true|false",
    **dict.fromkeys(("--max_seq_length", "--max_predictions_per_seq"),
                    "the preset's phase sets it: pick a preset of the other phase, or write a preset file"),
    "--phase2": "the preset's phase sets it: pick a phase-2 preset",
    "--init_checkpoint": "give it as launch.sh's --init_checkpoint",
    "--input_dir": "give it as launch.sh's --input_dir", "--output_dir": "give it as launch.sh's --output_dir",
    "--deepspeed": "drop it: the launch always gives it",
}


class _FlagProbe(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PresetError(f"run_pretraining.py flags after '--': {message}")


def refuse_repeated_flags(run_flags: list[str], extra: list[str]) -> None:
    """Refuse a flag after launch.sh's '--' that the launch already gives run_pretraining.py (the preset's
    flags and launch.sh's --input_dir/--output_dir), abbreviated or not, naming what changes it instead."""
    given = [flag for flag in run_flags if flag.startswith("--")] + ["--input_dir", "--output_dir"]
    probe = _FlagProbe(add_help=False, prog="launch.sh")
    for flag in dict.fromkeys(given):
        probe.add_argument(flag, nargs="?", const=True, default=argparse.SUPPRESS)
    repeated = sorted(vars(probe.parse_known_args(extra)[0]))
    if repeated:
        raise PresetError("the launch already gives run_pretraining.py " + "; ".join(
            f"--{name} ({REPEATED_FLAG_FIX.get('--' + name, 'change it in the preset')})" for name in repeated)
            + ": after '--', pass only flags the preset does not set (--log_freq, --seed, ...)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.presets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print every preset as a Markdown table")
    res = sub.add_parser("resolve", help="resolve a preset for a cluster: write the DeepSpeed JSON, print the run flags")
    res.add_argument("--preset", required=True, help="preset name (configs/presets/<name>.json) or path")
    res.add_argument("--num_nodes", type=int, required=True)
    res.add_argument("--devices_per_node", type=int,
                     help="default: the preset's devices_per_node (which --set devices_per_node=D also sets)")
    res.add_argument("--device_kind", default=DEFAULT_KEY,
                     help="key into the preset's micro_batch_per_device (e.g. gaudi1 for 32 GB first-gen Gaudi)")
    res.add_argument("--deepspeed_config_out", type=Path, required=True, help="where to write the DeepSpeed JSON")
    res.add_argument("--init_checkpoint", help="phase-1 output directory, or NVIDIA's/Habana's ckpt_<step>.pt (phase-2 presets only)")
    res.add_argument("--format", choices=("args", "shell"), default="args",
                     help="args: the run flags on one line; shell: DEVICES_PER_NODE=... and RUN_ARGS=(...) for eval")
    res.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                     help=f"override a preset field; one of {', '.join(OVERRIDABLE)}")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: launch.sh's flags for run_pretraining.py
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]
    try:
        if args.command == "list":
            print(_table(list_presets()))
            return 0
        pairs = [parse_override(o) for o in args.overrides]
        names = [name for name, _ in pairs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise PresetError(f"--set {', '.join(repeated)} given more than once; give each field once")
        overrides = dict(pairs)
        if args.devices_per_node is not None and overrides.get("devices_per_node", args.devices_per_node) \
                != args.devices_per_node:
            raise PresetError(f"--devices_per_node {args.devices_per_node} and --set devices_per_node="
                              f"{overrides['devices_per_node']} disagree; give one of them")
        run = resolve(load_preset(args.preset, overrides), args.num_nodes, args.devices_per_node, args.device_kind)
        refuse_repeated_flags(run.run_args(args.deepspeed_config_out, args.init_checkpoint), extra)
        blocker = file_in_the_way(args.deepspeed_config_out.parent)
        if blocker is not None:
            raise PresetError(f"--deepspeed_config_out {args.deepspeed_config_out}: {blocker} is a file, not a "
                              "directory; pass a path in a directory")
        if args.deepspeed_config_out.is_dir():
            raise PresetError(f"--deepspeed_config_out {args.deepspeed_config_out} is a directory; pass a file path "
                              "in it (e.g. its deepspeed_config.json)")
        out = atomic_write_text(args.deepspeed_config_out, json.dumps(run.deepspeed_config, indent=2) + "\n")
        flags = run.run_args(out.resolve(), args.init_checkpoint)
    except PresetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing the DeepSpeed JSON: the old one is kept
        print(disk_error(e, None), file=sys.stderr)
        return 2
    print(f"[presets] {run.preset.name}: {run.num_nodes} node(s) x {run.devices_per_node} devices, micro batch "
          f"{run.micro_batch_per_device}, gradient accumulation {run.gradient_accumulation_steps} "
          f"({run.sequences_per_device_per_step} sequences per device per step), lr {run.learning_rate:g}",
          file=sys.stderr)
    if args.format == "shell":
        print(f"DEVICES_PER_NODE={run.devices_per_node}")
        print(f"RUN_ARGS=({shlex.join(flags)})")
    else:
        print(shlex.join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
