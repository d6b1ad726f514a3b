"""When things happen in a run, with Axolotl's (transformers') meanings: the learning-rate schedule, warm-up,
and the logging, evaluation and checkpoint cadence.

Defaults a config leaves unset are Axolotl's: warm-up ``min(3% of the steps, 100)``; logging every
``0.5%`` of the steps (1 to 10); a checkpoint at each epoch's end, the last 4 kept; no evaluation cadence
means one evaluation at the end. ``saves_per_epoch`` / ``evals_per_epoch`` are Axolotl's fractions
``1 / (n x num_epochs)`` of all steps; a fraction ``f`` below 1 means every ``ceil(f x steps)`` steps.

One difference on purpose: warm-up reaches ``lr x (s + 1) / warmup`` at step ``s`` (0-based), so the first
step already learns; transformers starts at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    steps_per_epoch: int
    warmup_steps: int
    kind: str
    min_lr_ratio: float = 0.0
    constant_lr_ratio: float | None = None
    log_every: int = 1
    save_every: int | None = None
    """Checkpoint every N steps (None: only at the end)."""
    eval_every: int | None = None
    """Evaluate every N steps (None: only at the end, when there is evaluation data)."""

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
        warmup = self.warmup_steps if self.kind != "constant" else 0
        if warmup and step < warmup:
            return (step + 1) / warmup
        if self.kind in ("constant", "constant_with_warmup") or self.total_steps <= warmup:
            return 1.0
        end = self.total_steps
        if self.constant_lr_ratio is not None:  # reach the minimum early, then hold it
            end = max(warmup + 1, int(self.total_steps * self.constant_lr_ratio))
            step = min(step, end)
        progress = min(1.0, (step - warmup) / max(1, end - warmup))
        if self.kind == "linear":
            return 1.0 - progress
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def logging(self, step: int) -> bool:
        """Log after ``step`` optimizer steps (1-based)?"""
        return step % self.log_every == 0 or step == self.total_steps

    def saving(self, step: int) -> bool:
        return bool(self.save_every and step % self.save_every == 0) or step == self.total_steps

    def evaluating(self, step: int) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0) or step == self.total_steps


def schedule_for(cfg, *, steps_per_epoch: int) -> Schedule:
    """The run's schedule from a ``TrainConfig`` and the number of optimizer steps in one epoch."""
    total = cfg.max_steps or max(1, math.ceil(cfg.num_epochs * steps_per_epoch))
    if cfg.warmup_steps is not None:
        warmup = (
            int(cfg.warmup_steps) if cfg.warmup_steps >= 1 or cfg.warmup_steps == 0 else int(cfg.warmup_steps * total)
        )
    elif cfg.warmup_ratio is not None:
        warmup = int(cfg.warmup_ratio * total)
    else:
        warmup = min(int(0.03 * total), 100)
    save_every = _every(
        cfg.save_strategy, cfg.save_steps, cfg.saves_per_epoch, cfg.num_epochs, total, steps_per_epoch, default="epoch"
    )
    eval_every = _every(
        cfg.eval_strategy, cfg.eval_steps, cfg.evals_per_epoch, cfg.num_epochs, total, steps_per_epoch, default="no"
    )
    return Schedule(
        total_steps=total,
        steps_per_epoch=steps_per_epoch,
        warmup_steps=warmup,
        kind=cfg.lr_scheduler,
        min_lr_ratio=cfg.cosine_min_lr_ratio or 0.0,
        constant_lr_ratio=cfg.cosine_constant_lr_ratio or None,
        log_every=cfg.logging_steps or max(min(int(0.005 * total), 10), 1),
        save_every=save_every,
        eval_every=eval_every,
    )


def _every(
    strategy: str | None,
    steps: float | None,
    per_epoch: int | None,
    epochs: float,
    total: int,
    steps_per_epoch: int,
    *,
    default: str,
) -> int | None:
    """Steps between two saves (or evaluations); None when only the end counts."""
    if strategy == "no":
        return None
    if steps is not None:
        return int(steps) if steps >= 1 else max(1, math.ceil(steps * total))
    if per_epoch is not None:
        fraction = 1.0 / (per_epoch * epochs)
        return max(1, math.ceil(fraction * total)) if fraction < 1 else None
    if (strategy or default) == "epoch":
        return steps_per_epoch
    return None
