"""What setup is doing while no step has run yet, on rank 0: each phase as it starts and how long it took.

    setup 1/5: reading the model config, the tokenizer and the layout ...
    setup 1/5: done in 1.2 s
    setup 3/5: tokenizing and packing the data ...
    tokenizing data/alpaca.jsonl: 5,000 examples [00:03, 1.4k examples/s]      (a bar in a terminal)
    setup 3/5: done in 3.6 s: 1,240 rows of 2,048 tokens

A phase that fails prints nothing more: the error says why. Other ranks stay silent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from ndparallel.train.progress import human_seconds


class PhaseResult:
    """What a phase found, said on its closing line (set inside the ``with`` block)."""

    def __init__(self) -> None:
        self.detail: str | None = None


class SetupProgress:
    """Rank 0 prints each phase's start and its time; ``total`` phases are numbered (0: not numbered)."""

    def __init__(self, *, enabled: bool, total: int = 0, printer=None) -> None:
        self.enabled, self.total, self.done = enabled, total, 0
        self.print = printer or (lambda text: print(text, flush=True))
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, doing: str) -> Iterator[PhaseResult]:
        self.done += 1
        label = f"setup {self.done}/{self.total}" if self.total else "setup"
        self.message(f"{label}: {doing} ...")
        result, start = PhaseResult(), time.perf_counter()
        yield result
        seconds = time.perf_counter() - start
        self.times[doing] = seconds
        self.message(f"{label}: done in {human_seconds(seconds)}" + (f": {result.detail}" if result.detail else ""))

    def message(self, text: str) -> None:
        if self.enabled:
            self.print(text)


def run_summary(cfg, layout) -> str:
    """One line of what the run will do, before it does it: learning rate and warm-up, batch, length, saves."""
    rows = cfg.micro_batch_size * layout.batch_size * cfg.gradient_accumulation_steps
    lines = [
        f"run: lr {cfg.learning_rate:g} ({cfg.lr_scheduler}, warm-up {_warmup_text(cfg)})",
        f"batch {rows} rows x {cfg.sequence_len:,} tokens per step (micro-batch {cfg.micro_batch_size} x "
        f"accumulation {cfg.gradient_accumulation_steps} x {layout.batch_size} data-parallel rank(s))",
        f"{cfg.max_steps} steps" if cfg.max_steps else f"{cfg.num_epochs:g} epoch(s)",
        f"checkpoints {_save_text(cfg)}" + (f", the last {cfg.save_total_limit} kept" if cfg.save_total_limit else ""),
    ]
    return "; ".join(lines)


def _warmup_text(cfg) -> str:
    if cfg.lr_scheduler == "constant":
        return "none"
    if cfg.warmup_steps is not None:
        return (
            f"{cfg.warmup_steps:g} steps"
            if cfg.warmup_steps >= 1 or cfg.warmup_steps == 0
            else (f"{cfg.warmup_steps:.0%} of the steps")
        )
    if cfg.warmup_ratio is not None:
        return f"{cfg.warmup_ratio:.0%} of the steps"
    return "3% of the steps, at most 100"


def _save_text(cfg) -> str:
    if cfg.save_strategy == "no":
        return "at the end only"
    if cfg.save_steps is not None:
        every = f"{cfg.save_steps:g} steps" if cfg.save_steps >= 1 else f"{cfg.save_steps:.0%} of the steps"
        return f"every {every} and at the end"
    if cfg.saves_per_epoch is not None:
        return f"{cfg.saves_per_epoch} per epoch and at the end"
    return "at each epoch's end" if cfg.save_strategy in (None, "epoch") else "at the end"


def weights_phase(cfg) -> str:
    """The model phase's line: where the weights come from."""
    if cfg.base_model:
        return f"loading the weights of {cfg.base_model} (each rank reads its slices)"
    return f"initializing the weights at random (seed {cfg.seed}, the same on every layout)"
