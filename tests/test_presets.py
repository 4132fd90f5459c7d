"""Presets: every shipped preset loads and resolves on 1..16 nodes; the published figures come out;
bad presets fail with the file and the field named."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from training import presets
from training.presets import PresetError, gradient_accumulation, load_preset, resolve

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = presets.list_presets()


def test_the_issue_presets_exist():
    names = {p.stem for p in SHIPPED}
    assert {"bert-large-phase1", "bert-large-phase2", "bert-1.5b-phase1", "bert-1.5b-phase2",
            "bert-5b-phase1"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_preset_loads_and_resolves(path: Path, tmp_path: Path):
    preset = load_preset(path)
    assert preset.name == path.stem
    assert preset.source and preset.model_config.is_file() and preset.deepspeed_config.is_file()
    base_ds = json.loads(preset.deepspeed_config.read_text())
    for nodes in (1, 2, 4, 8, 16):
        for kind in preset.micro_batch_per_device:
            try:
                run = resolve(preset, nodes, device_kind=kind)
            except PresetError as e:  # a recipe may not divide on every shape, but it must say so clearly
                assert "not divisible" in str(e) and str(preset.path) in str(e)
                continue
            assert run.micro_batch_per_device * run.gradient_accumulation_steps * run.world_size \
                == preset.global_batch_size
            ds = run.deepspeed_config
            assert ds["train_batch_size"] == preset.global_batch_size
            assert ds["train_micro_batch_size_per_gpu"] == run.micro_batch_per_device
            assert ds["gradient_accumulation_steps"] == run.gradient_accumulation_steps
            for key, value in base_ds.items():  # everything else is the training engineer's config, untouched
                if key not in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
                    assert ds[key] == value
    init = str(tmp_path) if preset.phase == 2 else None
    args = resolve(preset, 1).run_args(tmp_path / "ds.json", init_checkpoint=init)
    assert args[args.index("--max_seq_length") + 1] == str(preset.max_seq_length)
    assert ("--phase2" in args) == (preset.phase == 2)


@pytest.mark.parametrize("phase2", [p for p in SHIPPED if load_preset(p).phase == 2], ids=lambda p: p.stem)
def test_a_phase_2_preset_continues_its_phase_1_presets_model_and_optimizer(phase2: Path):
    """bert-1.5b-phase2 said "continuing from bert-1.5b-phase1" but trained LAMB after phase 1's LANS, from zero
    moments: --set init_optimizer_moments=true was then refused (another optimizer's moments). Both references'
    phase 2 keep phase 1's optimizer state."""
    second = load_preset(phase2)
    first = load_preset(phase2.with_name(phase2.name.replace("phase2", "phase1")))
    assert (second.model_config, second.optimizer) == (first.model_config, first.optimizer)
    assert second.init_optimizer_moments and not first.init_optimizer_moments
    assert first.name in second.description


def test_gaudi_1_5b_recipe_figures():
    preset = load_preset("bert-1.5b-phase1")
    assert (preset.max_seq_length, preset.max_predictions_per_seq, preset.global_batch_size) == (128, 20, 12288)
    assert (preset.warmup_proportion, preset.constant_proportion) == (0.05, 0.25)  # Habana's flags
    # The blog's figure: 384 sequences per device per step = micro batch 16 x 24 accumulation steps,
    # on 32 first-generation Gaudi devices (4 nodes).
    blog = resolve(preset, 4, device_kind="gaudi1")
    assert (blog.micro_batch_per_device, blog.gradient_accumulation_steps) == (16, 24)
    assert blog.sequences_per_device_per_step == 384
    one_node = resolve(preset, 1)
    assert (one_node.micro_batch_per_device, one_node.gradient_accumulation_steps) == (32, 48)
    assert resolve(preset, 8).learning_rate == resolve(preset, 16).learning_rate == 0.0015
    assert resolve(preset, 16).gradient_accumulation_steps == 3


SCHEDULE_FLAGS = ("--learning_rate", "--warmup_proportion", "--constant_proportion", "--poly_power", "--max_steps",
                  "--lr_decay_style")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_preset_has_one_schedule_on_every_node_count(path: Path, tmp_path: Path):
    """The global batch is the recipe's on every node count, so the schedule must be too: a run saved on 16
    nodes resumes on 8 only if learning rate, warm-up, steps and global batch are equal (the schedule check
    refuses otherwise)."""
    preset = load_preset(path)
    init = str(tmp_path) if preset.phase == 2 else None
    schedules = {}
    for nodes in (1, 2, 4, 8, 16):
        for kind in preset.micro_batch_per_device:
            try:
                run = resolve(preset, nodes, device_kind=kind)
            except PresetError as e:  # a shape that does not divide is refused, never given another schedule
                assert "not divisible" in str(e)
                continue
            args = run.run_args(tmp_path / "ds.json", init_checkpoint=init)
            schedules[(nodes, kind)] = (tuple(args[args.index(flag) + 1] for flag in SCHEDULE_FLAGS),
                                        run.deepspeed_config["train_batch_size"])
    # every recipe divides on 1 to 16 nodes; the demo's 32-sequence batch only on its own node of 2 processes
    assert {nodes for nodes, _ in schedules} == ({1} if path.stem == "demo" else {1, 2, 4, 8, 16})
    assert len(set(schedules.values())) == 1, schedules
    (flags, global_batch), = set(schedules.values())
    assert global_batch == preset.global_batch_size
    assert tuple(float(f) for f in flags[:-1]) == (preset.learning_rate, preset.warmup_proportion,
                                                   preset.constant_proportion, preset.poly_power, preset.max_steps)
    assert flags[-1] == preset.lr_decay_style


def test_nvidia_bert_large_phase2_figures(tmp_path: Path):
    preset = load_preset("bert-large-phase2")
    run = resolve(preset, 1)  # NVIDIA's DGX: 8 GPUs x 4096 sequences per GPU in 256 accumulation steps
    assert (run.micro_batch_per_device, run.gradient_accumulation_steps, run.learning_rate) == (16, 256, 0.004)
    assert (preset.max_seq_length, preset.max_predictions_per_seq, preset.max_steps) == (512, 80, 1563)
    with pytest.raises(PresetError, match="phase-2 recipe; pass the phase-1 output"):
        run.run_args(tmp_path / "ds.json")
    # NVIDIA's phase 2 loads phase 1's optimizer state with its step set to 0: the moments carry over
    assert run.run_args(tmp_path / "ds.json", init_checkpoint="p1")[-4:] == \
        ["--phase2", "--init_checkpoint", "p1", "--init_optimizer_moments"]
    fresh = resolve(load_preset("bert-large-phase2", {"init_optimizer_moments": False}), 1)
    assert "--init_optimizer_moments" not in fresh.run_args(tmp_path / "ds.json", init_checkpoint="p1")
    phase1 = resolve(load_preset("bert-large-phase1"), 1)
    with pytest.raises(PresetError, match="is phase 1 and starts from scratch; --init_checkpoint is only for phase-2"):
        phase1.run_args(tmp_path / "ds.json", init_checkpoint=str(tmp_path))


def test_gradient_accumulation_that_cannot_divide():
    assert gradient_accumulation(12288, 32, 64) == 6
    with pytest.raises(PresetError, match=r"global batch 12288 is not divisible by micro batch 32 x 40 devices"):
        gradient_accumulation(12288, 32, 40, source="x.json")
    with pytest.raises(PresetError, match=r"not divisible") as err:
        resolve(load_preset("bert-1.5b-phase1"), 5)  # 5 nodes x 8 devices
    assert "bert-1.5b-phase1.json on 5 node(s) x 8 devices" in str(err.value)
    assert "no micro batch divides 12288 on 40 devices; change the node count" in str(err.value)
    with pytest.raises(PresetError, match=r"micro batches that divide on 8 devices: \[6, 8, 12, 16\]"):
        resolve(load_preset("bert-1.5b-phase1", {"micro_batch_per_device": 20}), 1)


def _write(tmp_path: Path, **changes) -> Path:
    values = json.loads((ROOT / "configs/presets/bert-large-phase1.json").read_text())
    for key, value in changes.items():
        if value is None:
            values.pop(key)
        else:
            values[key] = value
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(values))
    return path


@pytest.mark.parametrize("changes, field, message", [
    ({"global_batch_size": None}, "global_batch_size", "missing field"),
    ({"global_batch_size": "64k"}, "global_batch_size", "must be an integer"),
    ({"global_btach_size": 4}, "global_btach_size", "unknown field"),
    ({"model_config": "configs/models/nope.json"}, "model_config", "does not exist"),
    ({"deepspeed_config": "configs/deepspeed"}, "deepspeed_config", "which is a directory, not a JSON file; fix the path"),
    ({"max_predictions_per_seq": 200}, "max_predictions_per_seq", "more than a sequence of 128 can hold"),
    # [CLS] and two [SEP] are never masked: 126 of 128 is one too many
    ({"max_predictions_per_seq": 126}, "max_predictions_per_seq", "(125 maskable tokens)"),
    ({"global_batch_size": True}, "global_batch_size", "must be an integer >= 1, got True"),
    ({"poly_power": 0}, "poly_power", "must be a number > 0"),
    ({"lr_decay_style": "google"}, "lr_decay_style", "must be one of habana, nvidia, got 'google'"),
    ({"lr_decay_style": "nvidia", "warmup_proportion": 0.05, "constant_proportion": 0.3}, "lr_decay_style",
     "whose scheduler has no constant phase, but constant_proportion is 0.3"),
    ({"warmup_proportion": 1.5}, "warmup_proportion", "in [0, 1]"),
    ({"warmup_proportion": 0.1, "constant_proportion": 0.95}, "constant_proportion",
     "is 0.95, and with warmup_proportion 0.1 more than all of max_steps: it is the constant phase's length AFTER"),
    # the removed per-node-count form: the message says why and what to write instead
    ({"learning_rate": {"default": 0.0015, "16": 0.003}}, "learning_rate",
     "one learning rate per node count; the global batch is the same on every node count, so the learning rate "
     "must be too: replace the object with one number (its \"default\" entry is 0.0015)"),
    ({"learning_rate": {"16": 0.003}}, "learning_rate", "replace the object with one number"),
    ({"learning_rate": 0}, "learning_rate", "must be a positive number"),
    ({"micro_batch_per_device": {"gaudi1": 16}}, "micro_batch_per_device", "without a \"default\" entry"),
    ({"micro_batch_per_device": {"default": 0}}, "micro_batch_per_device.default", "positive integer"),
    ({"optimizer": "sgd"}, "optimizer", "must be one of lamb, lans, adamw"),
    ({"phase": 3}, "phase", "must be 1 or 2"),
    ({"init_optimizer_moments": "yes"}, "init_optimizer_moments", "must be true or false, got 'yes'"),
    ({"init_optimizer_moments": True}, "init_optimizer_moments",
     "is true in a phase-1 preset, which starts from scratch; it is for phase 2"),
    ({"source": []}, "source", "must name where the recipe comes from"),
    ({"max_seq_length": 1024}, "max_seq_length", "max_position_embeddings 512"),
])
def test_bad_presets_name_file_and_field(tmp_path: Path, changes: dict, field: str, message: str):
    path = _write(tmp_path, **changes)
    with pytest.raises(PresetError) as err:
        load_preset(path)
    text = str(err.value)
    assert str(path) in text and field in text and message in text


def test_boundary_values_that_are_valid(tmp_path: Path):
    """The limits themselves load: every maskable token predicted, a warm-up and constant phase that take
    every step."""
    preset = load_preset(_write(tmp_path, max_predictions_per_seq=125))
    assert (preset.max_seq_length, preset.max_predictions_per_seq) == (128, 125)
    preset = load_preset(_write(tmp_path, warmup_proportion=0.1, constant_proportion=0.9, lr_decay_style="habana"))
    assert (preset.warmup_proportion, preset.constant_proportion) == (0.1, 0.9)


def test_bad_json_and_unknown_names(tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",\n "phase": }')
    with pytest.raises(PresetError, match=r"broken.json: not valid JSON \(line 2"):
        load_preset(path)
    with pytest.raises(PresetError, match="unknown preset 'bert-huge'; known presets: .*bert-1.5b-phase1"):
        load_preset("bert-huge")
    with pytest.raises(PresetError, match="no entry for device kind 'tpu'"):
        resolve(load_preset("bert-1.5b-phase1"), 8, device_kind="tpu")
    with pytest.raises(PresetError, match="bert-1.5b-phase1.json: number of nodes must be >= 1, got 0"):
        resolve(load_preset("bert-1.5b-phase1"), 0)
    for devices in (0, -8):  # an explicit bad count is refused, not replaced by the preset's 8
        with pytest.raises(PresetError, match=f"bert-1.5b-phase1.json: devices per node must be >= 1, got {devices}"):
            resolve(load_preset("bert-1.5b-phase1"), 1, devices_per_node=devices)


def test_a_shipped_preset_is_named_as_its_file(tmp_path: Path, monkeypatch):
    path = _write(tmp_path)  # custom.json holding "name": "bert-large-phase1"
    assert load_preset(path).name == "bert-large-phase1"  # a file of the user's may have any name
    monkeypatch.setattr(presets, "PRESET_DIR", tmp_path)
    with pytest.raises(PresetError, match=r"field 'name' is 'bert-large-phase1' but the file is custom.json; make them"):
        load_preset("custom")


def test_overrides_are_validated_like_the_file():
    preset = load_preset("bert-large-phase1", {"max_steps": 10, "learning_rate": 0.001})
    assert (preset.max_steps, preset.learning_rate) == (10, 0.001)
    with pytest.raises(PresetError, match="field 'learning_rate' is an object .* one learning rate per node count"):
        load_preset("bert-large-phase1", {"learning_rate": {"default": 0.001, "16": 0.002}})
    with pytest.raises(PresetError, match="field 'max_steps' must be an integer >= 1, got 0"):
        load_preset("bert-large-phase1", {"max_steps": 0})
    with pytest.raises(PresetError, match="cannot override max_seq_length"):
        load_preset("bert-large-phase1", {"max_seq_length": 64})
    assert presets.parse_override("max_steps=7") == ("max_steps", 7)
    # every schedule field can be changed for a run, the constant phase included
    preset = load_preset("bert-1.5b-phase1", {"constant_proportion": 0.0, "warmup_proportion": 0.1, "poly_power": 0.5})
    assert (preset.warmup_proportion, preset.constant_proportion, preset.poly_power) == (0.1, 0.0, 0.5)
    assert presets.parse_override("model_config=configs/models/bert-tiny.json") == \
        ("model_config", "configs/models/bert-tiny.json")


def test_cli_writes_the_deepspeed_config_and_prints_the_flags(tmp_path: Path, capsys):
    out = tmp_path / "launch" / "ds.json"
    rc = presets.main(["resolve", "--preset", "bert-1.5b-phase1", "--num_nodes", "4", "--device_kind", "gaudi1",
                       "--deepspeed_config_out", str(out), "--set", "max_steps=1000", "--format", "shell"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "gradient accumulation 24 (384 sequences per device per step)" in captured.err
    lines = captured.out.splitlines()
    assert lines[0] == "DEVICES_PER_NODE=8"
    args = shlex.split(lines[1][len("RUN_ARGS=("):-1])
    assert args[args.index("--max_steps") + 1] == "1000"
    assert args[args.index("--deepspeed_config") + 1] == str(out.resolve())
    ds = json.loads(out.read_text())
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) \
        == (12288, 16, 24)
    assert presets.main(["resolve", "--preset", "bert-1.5b-phase1", "--num_nodes", "5",
                         "--deepspeed_config_out", str(out)]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_cli_names_a_deepspeed_config_out_that_cannot_be_a_file(tmp_path: Path, capsys):
    """A file where its directory would be was a FileExistsError traceback; a directory, an IsADirectoryError one."""
    (tmp_path / "a_file").write_text("mine\n")
    args = ["resolve", "--preset", "demo", "--num_nodes", "1", "--deepspeed_config_out"]
    assert presets.main([*args, str(tmp_path / "a_file" / "ds.json")]) == 2
    assert capsys.readouterr().err == (f"error: --deepspeed_config_out {tmp_path / 'a_file' / 'ds.json'}: "
                                       f"{tmp_path / 'a_file'} is a file, not a directory; pass a path in a directory\n")
    assert presets.main([*args, str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --deepspeed_config_out {tmp_path} is a directory; pass a file path in "
                                       "it (e.g. its deepspeed_config.json)\n")
    assert (tmp_path / "a_file").read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_resolving_with_habanas_block_for_the_1p5b_preset(tmp_path: Path):
    """The presets' notes: --set model_config picks Habana's own pre-LN block, the same sizes."""
    args = ["resolve", "--preset", "bert-1.5b-phase1", "--num_nodes", "4", "--deepspeed_config_out",
            str(tmp_path / "ds.json"), "--set", "model_config=configs/models/bert-1.5b-deepspeed-bert.json"]
    run = presets.resolve(presets.load_preset("bert-1.5b-phase1",
                                              {"model_config": "configs/models/bert-1.5b-deepspeed-bert.json"}), 4)
    flags = run.run_args(tmp_path / "ds.json", None)
    config = json.loads(Path(flags[flags.index("--config_file") + 1]).read_text())
    shipped = json.loads((ROOT / "configs/models/bert-1.5b.json").read_text())
    assert config["layer_norm_large_model"] and not config["pre_layer_norm"]
    assert {k: v for k, v in config.items() if k not in ("layer_norm_large_model", "pre_layer_norm")} == \
        {k: v for k, v in shipped.items() if k not in ("layer_norm_large_model", "pre_layer_norm")}
    assert presets.main(args) == 0


def test_cli_refuses_a_field_set_twice(tmp_path: Path, capsys):
    """The last --set won silently: `--set max_steps=1000 ... --set max_steps=100` ran 100 steps."""
    args = ["resolve", "--preset", "demo", "--num_nodes", "1", "--deepspeed_config_out", str(tmp_path / "ds.json"),
            "--set", "max_steps=1000", "--set", "learning_rate=0.001", "--set", "max_steps=100"]
    assert presets.main(args) == 2
    assert capsys.readouterr().err == "error: --set max_steps given more than once; give each field once\n"


def test_list_prints_a_table_of_every_preset(capsys):
    assert presets.main(["list"]) == 0
    table = capsys.readouterr().out
    for path in SHIPPED:
        assert f"| {path.stem} |" in table


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_run_pretraining_accepts_every_preset_flag(path: Path, tmp_path: Path):
    """The flags a preset resolves to are run_pretraining.py's own, with the preset's values."""
    import run_pretraining

    preset = load_preset(path)
    init = tmp_path / "phase1" if preset.phase == 2 else None
    args = resolve(preset, 1).run_args(tmp_path / "ds.json", init_checkpoint=str(init) if init else None)
    ns = run_pretraining.parse_args(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "run"), *args])
    assert ns.config_file == preset.model_config and ns.deepspeed_config == tmp_path / "ds.json"
    assert (ns.max_seq_length, ns.max_predictions_per_seq, ns.max_steps) == \
        (preset.max_seq_length, preset.max_predictions_per_seq, preset.max_steps)
    assert (ns.learning_rate, ns.warmup_proportion, ns.constant_proportion, ns.poly_power, ns.lr_decay_style) == \
        (preset.learning_rate, preset.warmup_proportion, preset.constant_proportion, preset.poly_power,
         preset.lr_decay_style)
    # NVIDIA's recipes take NVIDIA's decay form (test_schedule.py checks it step by step), the others Habana's
    assert preset.lr_decay_style == ("nvidia" if path.stem.startswith("bert-large") else "habana")
    assert (ns.optimizer, ns.num_steps_per_checkpoint, ns.checkpoint_activations, ns.phase2) == \
        (preset.optimizer, preset.num_steps_per_checkpoint, preset.checkpoint_activations, preset.phase == 2)
    assert ns.init_checkpoint == init and ns.init_optimizer_moments == preset.init_optimizer_moments


def test_a_deepspeed_json_that_does_not_fit_is_one_line_and_the_old_one_stays(tmp_path: Path):
    """Writes past 100 bytes fail with EFBIG (RLIMIT_FSIZE; Python ignores SIGXFSZ), as on a full disk: the
    launcher's resolve step ended with a traceback whose error named no file."""
    import resource
    import subprocess
    import sys

    out = tmp_path / "launch" / "deepspeed_config.json"
    out.parent.mkdir()
    out.write_text('{"old": true}\n')
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "training.presets", "resolve", "--preset", "demo", "--num_nodes",
                             "1", "--deepspeed_config_out", str(out)], cwd=root, capture_output=True, text=True,
                            timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100)))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"error: {out}: File too large; free space there and rerun the same command to continue "
                             "where it stopped\n")
    assert out.read_text() == '{"old": true}\n' and [p.name for p in out.parent.iterdir()] == [out.name]


def test_every_flag_a_launch_gives_has_its_fix_named_when_repeated(tmp_path: Path):
    """launch.sh refuses a flag after '--' that the launch already gives; the refusal names how to change each
    (tests/test_launch.py runs it), so every flag of every preset, both phases, has an entry."""
    for path in presets.list_presets():
        preset = load_preset(str(path), {"checkpoint_activations": True} | (
            {"init_optimizer_moments": True} if load_preset(str(path)).phase == 2 else {}))
        flags = resolve(preset, 1).run_args(tmp_path / "ds.json", str(tmp_path) if preset.phase == 2 else None)
        for flag in [f for f in flags if f.startswith("--")] + ["--input_dir", "--output_dir"]:
            assert flag in presets.REPEATED_FLAG_FIX, (path.name, flag)
            with pytest.raises(PresetError, match=f"^the launch already gives run_pretraining.py {flag} \\("):
                presets.refuse_repeated_flags(flags, [flag, "1"])
    presets.refuse_repeated_flags(flags, ["--log_freq", "5", "--seed=7", "--num_workers", "0"])  # not the launch's
