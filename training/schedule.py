"""Learning rate: linear warm-up, an optional constant phase, then polynomial decay to zero.

The Gaudi BERT-1.5B recipe is warm-up 5%, constant to 30%, linear decay (power 1.0).
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
    constant_proportion: float = 0.0  # hold the peak until this fraction of total_steps
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
        if not (math.isfinite(self.power) and self.power > 0):
            raise ValueError(f"--poly_power must be > 0 and finite, got {self.power}")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr_decay_style must be one of {', '.join(DECAY_STYLES)}, got {self.decay_style!r}")
        if self.decay_style == "nvidia" and self.constant_proportion > self.warmup_proportion:
            raise ValueError(f"--constant_proportion {self.constant_proportion} with --lr_decay_style nvidia: NVIDIA's "
                             "scheduler has no constant phase; pass --constant_proportion 0, or --lr_decay_style habana")

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup_proportion * self.total_steps))

    @property
    def constant_end(self) -> int:
        """First step of the decay phase."""
        return max(self.warmup_steps, int(round(self.constant_proportion * self.total_steps)))


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
        return {"step_count": self.step_count, "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        saved = ScheduleConfig(**state["config"])
        if saved != self.cfg:
            diff = ", ".join(f"{FLAGS[k]} {getattr(self.cfg, k)!r} (the checkpoint's: {v!r})"
                             for k, v in asdict(saved).items() if getattr(self.cfg, k) != v)
            raise ScheduleMismatchError(
                f"this command line changes the checkpoint's learning-rate schedule: {diff}. The checkpoint "
                "is fine: resume with the checkpoint's values, or start a new phase in another --output_dir "
                "with --phase2 --init_checkpoint."
            )
        self.step_count = int(state["step_count"])
        self._apply()
