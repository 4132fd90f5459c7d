"""Learning rate: linear warm-up, an optional constant phase, then polynomial decay to zero.

The Gaudi BERT-1.5B recipe is warm-up 5%, then constant for 25% (to 30% of the steps), linear decay
(power 1.0). `constant_proportion` is the constant phase's length after the warm-up, as Habana's
`--constant_proportion` is ("Proportion of training to perform constant learning rate after the learning
rate warmup phase"): the decay starts at `warmup_proportion + constant_proportion` of the steps.
Two forms of the decay (`decay_style`), as the two reference implementations have them:
  habana  the decay is rescaled to run from the peak, where warm-up or constant phase ends, to 0 at
          step `total` (the last step, total - 1, runs at peak / decay steps):
          peak * ((total - step) / (total - decay start))^power, as Habana's BERT scheduler decays. Its
          warm-up is NVIDIA's, peak * (step + 1) / warm-up steps; Habana's scheduler reads the optimizer's
          step count, which gives peak * max(step, 1) / warm-up steps: the same rates one step later,
          its first one taken twice;
  nvidia  NVIDIA's PolyWarmUpScheduler exactly: with progress = (step + 1) / total, the peak *
          progress / warm-up, then the peak * (1 - progress)^power, so the rate drops at the end of
          warm-up to (1 - warm-up)^power of the peak and is 0 at the last step; no constant phase.
The schedule is a pure function of the optimizer step; its state (the step and the shape
parameters) is saved in every checkpoint through DeepSpeed's lr_scheduler hook.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch.optim import Optimizer

DECAY_STYLES = ("habana", "nvidia")


@dataclass(frozen=True)
class ScheduleConfig:
    base_lr: float
    total_steps: int
    warmup_proportion: float = 0.01
    constant_proportion: float = 0.0  # hold the peak for this fraction of total_steps after the warm-up
    power: float = 1.0  # 1.0 = linear decay; NVIDIA's phase-1 recipe uses 0.5
    decay_style: str = "habana"  # or "nvidia" (see the module docstring)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"--learning_rate must be > 0 and finite, got {self.base_lr}")
        if self.total_steps < 1:
            raise ValueError(f"--max_steps must be >= 1, got {self.total_steps}")
        if not 0.0 <= self.warmup_proportion <= 1.0:
            raise ValueError(f"--warmup_proportion must be in [0, 1], got {self.warmup_proportion}")
        if not 0.0 <= self.constant_proportion <= 1.0:
            raise ValueError(f"--constant_proportion must be in [0, 1], got {self.constant_proportion}")
        if self.warmup_proportion + self.constant_proportion > 1.0 + 1e-9:
            raise ValueError(f"--warmup_proportion {self.warmup_proportion} + --constant_proportion "
                             f"{self.constant_proportion} is more than all of --max_steps: the constant phase is "
                             "its length after the warm-up (Habana's meaning: 0.25 after a warm-up of 0.05 holds "
                             "the peak until 30% of the steps)")
        if not (math.isfinite(self.power) and self.power > 0):
            raise ValueError(f"--poly_power must be > 0 and finite, got {self.power}")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr_decay_style must be one of {', '.join(DECAY_STYLES)}, got {self.decay_style!r}")
        if self.decay_style == "nvidia" and self.constant_proportion > 0:
            raise ValueError(f"--constant_proportion {self.constant_proportion} with --lr_decay_style nvidia: NVIDIA's "
                             "scheduler has no constant phase; pass --constant_proportion 0, or --lr_decay_style habana")

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup_proportion * self.total_steps))

    @property
    def constant_end(self) -> int:
        """First step of the decay phase: at warm-up + constant of the steps, as Habana's scheduler decays
        from progress = warm-up + constant."""
        if self.constant_proportion == 0:
            return self.warmup_steps
        # The sum as the decimal it stands for: 0.1 + 0.2 is 0.30000000000000004 in binary, which would put a
        # half step (0.3 x 15 = 4.5) on the other side of the rounding than 0.3 itself does.
        end = round(self.warmup_proportion + self.constant_proportion, 12)
        return min(self.total_steps, int(round(end * self.total_steps)))


def lr_at(cfg: ScheduleConfig, step: int) -> float:
    """Learning rate used by optimizer step `step` (0-based)."""
    if cfg.decay_style == "nvidia":
        progress = (step + 1) / cfg.total_steps
        if progress < cfg.warmup_proportion:
            return cfg.base_lr * progress / cfg.warmup_proportion
        return cfg.base_lr * max(0.0, 1.0 - progress) ** cfg.power
    if step < cfg.warmup_steps:
        return cfg.base_lr * (step + 1) / cfg.warmup_steps
    if step < cfg.constant_end:
        return cfg.base_lr
    decay_steps = cfg.total_steps - cfg.constant_end
    if decay_steps <= 0:
        return cfg.base_lr
    remaining = max(0.0, 1.0 - (step - cfg.constant_end) / decay_steps)
    return cfg.base_lr * remaining**cfg.power


# The command-line flag behind each ScheduleConfig field (run_pretraining.schedule_config).
FLAGS = {"base_lr": "--learning_rate", "total_steps": "--max_steps", "warmup_proportion": "--warmup_proportion",
         "constant_proportion": "--constant_proportion", "power": "--poly_power", "decay_style": "--lr_decay_style"}


class ScheduleMismatchError(ValueError):
    """A resumed run whose command line asks for a different schedule than the checkpoint's."""


class WarmupConstantDecay:
    """DeepSpeed-compatible scheduler: DeepSpeed calls `step()` after every optimizer step and
    saves `state_dict()` in the checkpoint."""

    def __init__(self, optimizer: Optimizer, cfg: ScheduleConfig):
        self.optimizer = optimizer
        self.cfg = cfg
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.cfg, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, **_: object) -> None:  # DeepSpeed may pass lr_kwargs
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "config": asdict(self.cfg), "format": STATE_FORMAT}

    def load_state_dict(self, state: dict) -> None:
        saved, note = saved_schedule(state)
        if saved != self.cfg:
            diff = ", ".join(f"{FLAGS[k]} {getattr(self.cfg, k)!r} (the checkpoint's: {v!r})"
                             for k, v in asdict(saved).items() if getattr(self.cfg, k) != v)
            raise ScheduleMismatchError(
                f"this command line changes the checkpoint's learning-rate schedule: {diff}.{note} The checkpoint "
                "is fine: resume with the checkpoint's values, or start a new phase in another --output_dir "
                "with --phase2 --init_checkpoint."
            )
        self.step_count = int(state["step_count"])
        self._apply()


# 2: constant_proportion is the constant phase's length after the warm-up (Habana's meaning). States
# without a format (1) were saved when it was the fraction of the steps where the constant phase ends.
STATE_FORMAT = 2


def saved_schedule(state: dict) -> tuple[ScheduleConfig, str]:
    """The schedule a checkpoint's scheduler state was saved with, in today's meaning, and a note for an
    error message when it was converted from the older one (the same steps, other numbers)."""
    config = dict(state["config"])
    if state.get("format", 1) == 1 and config.get("constant_proportion", 0.0) > 0:
        end = config["constant_proportion"]
        config["constant_proportion"] = round(max(0.0, end - config["warmup_proportion"]), 12)
        return ScheduleConfig(**config), (
            f" (This checkpoint was saved when --constant_proportion was where the constant phase ends: its {end!r} "
            f"is {config['constant_proportion']!r} now, the length after the warm-up, as Habana's flag.)")
    return ScheduleConfig(**config), ""
