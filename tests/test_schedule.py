"""Learning-rate schedule: warm-up, constant phase, polynomial decay, and its checkpointed state."""

import dataclasses

import pytest
import torch

from training.schedule import (
    ScheduleConfig,
    ScheduleMismatchError,
    WarmupConstantDecay,
    lr_at,
    saved_schedule,
)


def test_gaudi_1p5b_shape_warmup_constant_linear_decay():
    cfg = ScheduleConfig(base_lr=1e-3, total_steps=1000, warmup_proportion=0.05, constant_proportion=0.25, power=1.0)
    assert cfg.warmup_steps == 50 and cfg.constant_end == 300
    assert lr_at(cfg, 0) == pytest.approx(1e-3 / 50)
    assert lr_at(cfg, 24) == pytest.approx(1e-3 * 25 / 50)
    assert lr_at(cfg, 49) == pytest.approx(1e-3)
    assert all(lr_at(cfg, s) == 1e-3 for s in range(50, 300))
    # linear from the peak at step 300 to zero at step 1000
    assert lr_at(cfg, 650) == pytest.approx(0.5e-3)
    assert lr_at(cfg, 999) == pytest.approx(1e-3 / 700)
    assert lr_at(cfg, 1000) == 0.0
    lrs = [lr_at(cfg, s) for s in range(300, 1001)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


def _nvidia_poly_warmup(base_lr: float, warmup: float, total_steps: int, degree: float, steps_done: int) -> float:
    """NVIDIA DeepLearningExamples' PolyWarmUpScheduler (BERT, schedulers.py), as their run_pretraining.py drives it:
    step() runs before each optimizer step with last_epoch = the optimizer's steps done + 1."""
    progress = (steps_done + 1) / total_steps
    if progress < warmup:
        return base_lr * progress / warmup
    return base_lr * ((1.0 - progress) ** degree)


def _preset_schedule(preset: str) -> ScheduleConfig:
    import json
    from pathlib import Path

    values = json.loads((Path(__file__).resolve().parents[1] / "configs" / "presets" / f"{preset}.json").read_text())
    return ScheduleConfig(base_lr=values["learning_rate"], total_steps=values["max_steps"],
                          warmup_proportion=values["warmup_proportion"], power=values["poly_power"],
                          constant_proportion=values["constant_proportion"],
                          decay_style=values.get("lr_decay_style", "habana"))


def _habana_poly_warmup(base_lr: float, warmup: float, constant: float, total_steps: int, degree: float,
                        last_epoch: int) -> float:
    """Habana deepspeed-bert's PolyWarmUpScheduler.get_lr (schedulers.py), which their run_pretraining.py builds
    from --warmup_proportion, --constant_proportion and --scheduler_degree; last_epoch is the optimizer's step
    count."""
    progress = last_epoch / total_steps
    if progress < warmup:
        return base_lr * progress / warmup
    if progress < warmup + constant:
        return base_lr
    return base_lr * ((1.0 - progress) / (1.0 - warmup - constant)) ** degree


@pytest.mark.parametrize("preset", ["bert-1.5b-phase1", "bert-5b-phase1"])
def test_habanas_constant_proportion_means_the_same_here(preset):
    """Habana's scripts pass --warmup_proportion=0.05 --constant_proportion=0.25: the constant phase is a length
    after the warm-up. Those flags here give Habana's rates once the warm-up is over (the warm-up is NVIDIA's,
    one step ahead of Habana's: the module docstring), and the peak until 30% of the steps."""
    cfg = _preset_schedule(preset)
    assert (cfg.warmup_proportion, cfg.constant_proportion, cfg.decay_style) == (0.05, 0.25, "habana")
    assert cfg.constant_end == round(0.30 * cfg.total_steps)
    habana = [_habana_poly_warmup(cfg.base_lr, 0.05, 0.25, cfg.total_steps, cfg.power, s)
              for s in range(cfg.warmup_steps, cfg.total_steps)]
    assert [lr_at(cfg, s) for s in range(cfg.warmup_steps, cfg.total_steps)] == pytest.approx(habana, rel=1e-9, abs=0)
    assert lr_at(cfg, cfg.constant_end - 1) == cfg.base_lr > lr_at(cfg, cfg.constant_end + 1)


@pytest.mark.parametrize("preset", ["bert-large-phase1", "bert-large-phase2"])
def test_the_nvidia_presets_follow_nvidias_scheduler_at_every_step(preset):
    cfg = _preset_schedule(preset)
    assert cfg.decay_style == "nvidia"
    nvidia = [_nvidia_poly_warmup(cfg.base_lr, cfg.warmup_proportion, cfg.total_steps, cfg.power, s)
              for s in range(cfg.total_steps)]
    assert [lr_at(cfg, s) for s in range(cfg.total_steps)] == pytest.approx(nvidia, rel=1e-12, abs=0)
    # their drop where the warm-up ends (phase 1: steps 0-1999 warm up, 2000.9 being the warm-up's end), and
    # a last step at 0
    if preset == "bert-large-phase1":
        assert lr_at(cfg, 1999) == pytest.approx(cfg.base_lr * 2000 / 2000.9034)
        assert lr_at(cfg, 2000) == pytest.approx(cfg.base_lr * (1 - 2001 / 7038) ** 0.5)  # 0.846 of the peak
    assert lr_at(cfg, cfg.total_steps - 1) == 0.0


@pytest.mark.parametrize("preset, ratio", [("bert-large-phase1", 1.18), ("bert-large-phase2", 1.07)])
def test_the_habana_decay_runs_above_nvidias_by_the_documented_ratio(preset, ratio):
    """TRAINING.md: with NVIDIA's values, the decay rescaled to start at the peak (habana) runs at a constant
    1 / (1 - warm-up)^power times NVIDIA's rate: 1.18x in phase 1 and 1.07x in phase 2."""
    cfg = dataclasses.replace(_preset_schedule(preset), decay_style="habana")
    # The same ratio to 1%, but for the decay's last tenth, where both rates near 0 and NVIDIA's counts one
    # step further on.
    ratios = [lr_at(cfg, s) / _nvidia_poly_warmup(cfg.base_lr, cfg.warmup_proportion, cfg.total_steps, cfg.power, s)
              for s in range(cfg.warmup_steps, int(0.9 * cfg.total_steps))]
    assert max(ratios) / min(ratios) < 1.01
    assert round(min(ratios), 2) == ratio


def test_the_nvidia_warmup_ends_before_the_step_whose_progress_is_the_warmup_proportion():
    """NVIDIA's scheduler warms up while (step + 1) / total < warm-up: the step at exactly the proportion decays
    (no preset lands on it); past the last step the rate stays 0, not a complex number (power 0.5)."""
    cfg = ScheduleConfig(base_lr=1.0, total_steps=100, warmup_proportion=0.1, power=0.5, decay_style="nvidia")
    assert lr_at(cfg, 8) == pytest.approx(0.9)  # progress 0.09: warm-up
    assert lr_at(cfg, 9) == pytest.approx(0.9 ** 0.5)  # progress 0.1: decay, (1 - 0.1) ** 0.5
    assert lr_at(cfg, 9) == pytest.approx(_nvidia_poly_warmup(1.0, 0.1, 100, 0.5, 9))
    assert lr_at(cfg, 100) == 0.0 and lr_at(cfg, 101) == 0.0


def test_the_nvidia_style_has_no_constant_phase():
    with pytest.raises(ValueError, match="--constant_proportion 0.3 with --lr_decay_style nvidia: NVIDIA's scheduler "
                                         "has no constant phase"):
        ScheduleConfig(base_lr=1.0, total_steps=10, warmup_proportion=0.1, constant_proportion=0.3,
                       decay_style="nvidia")
    with pytest.raises(ValueError, match="--lr_decay_style must be one of habana, nvidia, got 'google'"):
        ScheduleConfig(base_lr=1.0, total_steps=10, decay_style="google")


def test_warmup_steps_round_to_the_nearest_step():
    # NVIDIA's phase 1: 7,038 steps with warm-up 0.2843 is 2,000.9 steps: 2,001, not 2,000
    cfg = ScheduleConfig(base_lr=6e-3, total_steps=7038, warmup_proportion=0.2843)
    assert cfg.warmup_steps == 2001
    assert lr_at(cfg, 0) == pytest.approx(6e-3 / 2001)
    assert lr_at(cfg, 2000) == 6e-3
    assert ScheduleConfig(base_lr=1.0, total_steps=16, warmup_proportion=0.1).warmup_steps == 2  # 1.6
    assert ScheduleConfig(base_lr=1.0, total_steps=10, warmup_proportion=0.0, constant_proportion=0.36).constant_end == 4  # 3.6
    assert ScheduleConfig(base_lr=1.0, total_steps=10, warmup_proportion=0.1, constant_proportion=0.24).constant_end == 3


def test_polynomial_power_and_no_constant_phase():
    cfg = ScheduleConfig(base_lr=2.0, total_steps=100, warmup_proportion=0.0, constant_proportion=0.0, power=0.5)
    assert cfg.warmup_steps == 0 and cfg.constant_end == 0
    assert lr_at(cfg, 0) == 2.0
    assert lr_at(cfg, 75) == pytest.approx(2.0 * 0.25**0.5)


def test_constant_proportion_is_a_length_after_the_warmup():
    """Habana's meaning: a constant_proportion below the warm-up's is not swallowed by it (the meaning before
    2026-11-25 was where the constant phase ends)."""
    cfg = ScheduleConfig(base_lr=1.0, total_steps=100, warmup_proportion=0.2, constant_proportion=0.1)
    assert (cfg.warmup_steps, cfg.constant_end) == (20, 30)
    assert lr_at(cfg, 29) == 1.0
    assert lr_at(cfg, 65) == pytest.approx(0.5)
    full = ScheduleConfig(base_lr=1.0, total_steps=100, warmup_proportion=0.3, constant_proportion=0.7)
    assert full.constant_end == 100 and lr_at(full, 99) == 1.0
    with pytest.raises(ValueError, match=r"^--warmup_proportion 0.3 \+ --constant_proportion 0.75 is more than all "
                                         r"of --max_steps: the constant phase is its length after the warm-up"):
        ScheduleConfig(base_lr=1.0, total_steps=100, warmup_proportion=0.3, constant_proportion=0.75)


@pytest.mark.parametrize("kwargs, flag", [
    ({"base_lr": 0.0}, "--learning_rate"), ({"total_steps": 0}, "--max_steps"),
    ({"warmup_proportion": 1.5}, "--warmup_proportion"), ({"constant_proportion": -0.1}, "--constant_proportion"),
    ({"power": 0.0}, "--poly_power"),
])
def test_bad_values_name_the_flag(kwargs, flag):
    values = {"base_lr": 1e-3, "total_steps": 10} | kwargs
    with pytest.raises(ValueError, match=flag):
        ScheduleConfig(**values)


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0)


def test_scheduler_drives_the_optimizer_and_round_trips():
    cfg = ScheduleConfig(base_lr=1.0, total_steps=10, warmup_proportion=0.2, constant_proportion=0.3)
    opt = _optimizer()
    sched = WarmupConstantDecay(opt, cfg)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)  # step 0 of a 2-step warm-up
    for _ in range(6):
        sched.step()
    assert sched.get_last_lr() == [pytest.approx(lr_at(cfg, 6))]
    restored = WarmupConstantDecay(_optimizer(), cfg)
    restored.load_state_dict(sched.state_dict())
    assert restored.step_count == 6
    assert restored.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(cfg, 6))


def test_resuming_with_another_schedule_is_an_error():
    cfg = ScheduleConfig(base_lr=1.0, total_steps=10)
    state = WarmupConstantDecay(_optimizer(), cfg).state_dict()
    other = WarmupConstantDecay(_optimizer(), ScheduleConfig(base_lr=1.0, total_steps=20))
    with pytest.raises(ScheduleMismatchError) as exc:
        other.load_state_dict(state)
    assert str(exc.value) == ("this command line changes the checkpoint's learning-rate schedule: --max_steps 20 "
                              "(the checkpoint's: 10). The checkpoint is fine: resume with the checkpoint's values, "
                              "or start a new phase in another --output_dir with --phase2 --init_checkpoint.")


@pytest.mark.parametrize("field, flag", [("base_lr", "--learning_rate"), ("warmup_proportion", "--warmup_proportion"),
                                         ("constant_proportion", "--constant_proportion"), ("power", "--poly_power")])
def test_every_schedule_field_is_checked_on_resume(field, flag):
    cfg = ScheduleConfig(base_lr=1.0, total_steps=10, warmup_proportion=0.1, constant_proportion=0.2, power=1.0)
    state = WarmupConstantDecay(_optimizer(), cfg).state_dict()
    changed = dataclasses.replace(cfg, **{field: getattr(cfg, field) + 0.1})
    with pytest.raises(ScheduleMismatchError, match=f"schedule: {flag} [0-9.]+ \\(the checkpoint's: "):
        WarmupConstantDecay(_optimizer(), changed).load_state_dict(state)


def test_a_checkpoint_saved_before_the_decay_style_existed_resumes_as_habana_and_refuses_nvidia():
    cfg = ScheduleConfig(base_lr=1.0, total_steps=10, warmup_proportion=0.2, power=0.5)
    state = WarmupConstantDecay(_optimizer(), cfg).state_dict()
    del state["config"]["decay_style"]  # as schedules saved before 2026-11-24 are
    resumed = WarmupConstantDecay(_optimizer(), cfg)
    resumed.load_state_dict(state)
    with pytest.raises(ScheduleMismatchError, match=r"schedule: --lr_decay_style 'nvidia' \(the checkpoint's: 'habana'\)"):
        WarmupConstantDecay(_optimizer(), dataclasses.replace(cfg, decay_style="nvidia")).load_state_dict(state)


def test_a_checkpoint_saved_when_constant_proportion_was_the_end_resumes_on_the_same_steps():
    """Schedules saved before 2026-11-25 (no "format") held the fraction where the constant phase ends. Read
    in today's meaning they keep their steps: resuming needs today's number, and the refusal of the old one
    says why."""
    old = {"step_count": 7, "config": {"base_lr": 1.0, "total_steps": 1000, "warmup_proportion": 0.05,
                                       "constant_proportion": 0.3, "power": 1.0, "decay_style": "habana"}}
    converted, note = saved_schedule(old)
    assert converted.constant_proportion == 0.25 and converted.constant_end == 300
    assert "its 0.3 is 0.25 now" in note
    resumed = WarmupConstantDecay(_optimizer(), converted)
    resumed.load_state_dict(old)
    assert resumed.step_count == 7
    as_before = dataclasses.replace(converted, constant_proportion=0.3)
    with pytest.raises(ScheduleMismatchError, match=r"--constant_proportion 0.3 \(the checkpoint's: 0.25\)\. \(This "
                                                    r"checkpoint was saved when --constant_proportion was where the "
                                                    r"constant phase ends: its 0.3 is 0.25 now"):
        WarmupConstantDecay(_optimizer(), as_before).load_state_dict(old)
    # inside the warm-up it meant no constant phase, as 0 does now; and today's states are read as they are
    assert saved_schedule({"config": old["config"] | {"constant_proportion": 0.04}})[0].constant_proportion == 0.0
    state = resumed.state_dict()
    assert state["format"] == 2 and saved_schedule(state) == (converted, "")


def test_every_schedule_saved_with_the_old_meaning_keeps_its_decay_step():
    """The old meaning decayed from max(warm-up steps, round(end x steps)). Converted to today's, the warm-up and
    the length after it add up to the end again, but 0.1 + (0.3 - 0.1) is not 0.3 in binary: without the sum
    rounded back to its decimal, 250 of these settings (0.1 and 0.3 on 15 steps among them) decayed a step later."""
    grid = [k / 100 for k in range(0, 101, 5)] + [0.01, 0.03, 0.07, 0.1, 0.2, 0.3, 0.7, 0.9]
    for total in range(1, 121):
        for warmup in grid:
            for end in grid:
                old = {"step_count": 0, "config": {"base_lr": 1.0, "total_steps": total, "warmup_proportion": warmup,
                                                   "constant_proportion": end, "power": 1.0, "decay_style": "habana"}}
                converted, _ = saved_schedule(old)
                old_end = max(int(round(warmup * total)), int(round(end * total)))
                assert converted.constant_end == old_end, (total, warmup, end)
    cfg = saved_schedule({"config": {"base_lr": 1.0, "total_steps": 15, "warmup_proportion": 0.1,
                                     "constant_proportion": 0.3, "power": 1.0}})[0]
    # the length is the decimal the refusal tells the user to pass (not 0.19999999999999998), which then resumes
    assert cfg.constant_proportion == 0.2
    today = ScheduleConfig(base_lr=1.0, total_steps=15, warmup_proportion=0.1, constant_proportion=0.2, power=1.0)
    WarmupConstantDecay(_optimizer(), today).load_state_dict(
        {"step_count": 3, "config": {"base_lr": 1.0, "total_steps": 15, "warmup_proportion": 0.1,
                                     "constant_proportion": 0.3, "power": 1.0}})
    assert cfg.constant_end == 4  # the decay starts at step 4 (at the peak), as it did
    assert [round(lr_at(cfg, s), 4) for s in range(3, 7)] == [1.0, 1.0, 0.9091, 0.8182]
