"""The end of a run in a few lines: steady-state speed, and the wall time by where it went.

Throughput and MFU are the steady state: the log windows after the first (its first step compiles and warms
the allocator up) that held no checkpoint. The wall time is reported apart, split into setup, the first step
(compilation and warm-up), checkpoints, evaluation and the other steps, so a short run's summary shows what
its speed would be on a long run and what its own minutes went to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ndparallel.train.progress import human_count, human_seconds


@dataclass(frozen=True)
class WindowTotals:
    """One log window over all ranks: real tokens, training seconds (checkpoint stalls excluded), FLOPs."""

    first_step: int
    last_step: int
    tokens: float
    seconds: float
    flops: float
    saved: bool
    """A checkpoint was written during the window (its background copy slows the steps)."""


@dataclass
class RunClock:
    """Where a run's wall time goes; the trainer reports each part as it ends."""

    started: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    """The step the loop starts after (a resumed run's)."""
    setup_s: float = 0.0
    first_step_s: float | None = None
    checkpoints_s: float = 0.0
    evaluation_s: float = 0.0
    windows: list[WindowTotals] = field(default_factory=list)

    def setup_done(self) -> None:
        self.setup_s = time.perf_counter() - self.started

    def window(self, record: dict, *, tokens: float, seconds: float, flops: float) -> None:
        """A log window closed (``record``: its metrics record; a checkpoint stall means it saved)."""
        first = (self.windows[-1].last_step if self.windows else self.start_step) + 1
        saved = bool(record.get("checkpoint_stall_s"))
        self.windows.append(WindowTotals(first, record["step"], tokens, seconds, flops, saved))

    def steady(self) -> tuple[list[WindowTotals], str]:
        """The windows that show the steady state, and what they leave out (or why they could not)."""
        later = self.windows[1:]
        clean = [w for w in later if not w.saved]
        if clean:
            return clean, "without the first window (compilation, warm-up) and windows with checkpoints"
        if later:
            return later, "without the first window (compilation, warm-up); every later window held a checkpoint"
        return self.windows, "one log window: it includes the first step's compilation and warm-up"


def summary_lines(records: list[dict], clock: RunClock, *, devices: int, peak_flops: float | None) -> list[str]:
    """The run's closing lines (rank 0): totals, loss, steady speed, wall time by part."""
    if not records:
        return []
    first, last = records[0], records[-1]
    lines = [
        f"done: {last['step']} steps, {last['tokens']:,} tokens",
        f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
        + (f", eval loss {last['eval_loss']:.4f}" if last.get("eval_loss") is not None else ""),
    ]
    windows, left_out = clock.steady()
    seconds = sum(w.seconds for w in windows)
    if windows and seconds > 0:
        tps = sum(w.tokens for w in windows) / seconds
        speed = f"{human_count(tps)} tokens/s ({human_count(tps / devices)}/device)"
        if peak_flops:
            speed += f", MFU {sum(w.flops for w in windows) / (seconds * peak_flops * devices) * 100:.1f}%"
        first_step, last_step = windows[0].first_step, windows[-1].last_step
        steps = f"steps {first_step}-{last_step}" if last_step > first_step else f"step {last_step}"
        lines.append(f"steady state ({steps}, {left_out}): {speed}")
    lines.append(f"peak memory {max(r['peak_memory_gib'] for r in records):.2f} GiB per rank")
    lines.append(wall_line(clock))
    return lines


def wall_line(clock: RunClock) -> str:
    wall = time.perf_counter() - clock.started
    parts = [("setup", clock.setup_s)]
    if clock.first_step_s is not None:
        parts.append(("first step (compilation, warm-up)", clock.first_step_s))
    parts += [("checkpoints", clock.checkpoints_s), ("evaluation", clock.evaluation_s)]
    rest = wall - sum(seconds for _, seconds in parts)
    parts.append(("other steps and logging", max(rest, 0.0)))
    shown = ", ".join(f"{name} {human_seconds(s)}" for name, s in parts if s > 0 or name == "setup")
    return f"wall time {human_seconds(wall)}: {shown}"


def print_summary(records: list[dict], clock: RunClock, output_dir: Path, **kwargs) -> None:
    lines = summary_lines(records, clock, **kwargs)
    if lines:
        print("\n".join([*lines, f"outputs: {output_dir} (metrics.jsonl, checkpoints/)"]), flush=True)
