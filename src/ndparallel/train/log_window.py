"""The steps between two log lines: what one step hands the loop, and the window that sums those steps,
times them, applies the NaN policy and turns them into one metrics record.

Everything is kept on the device until ``close`` (the logging step), so the host never waits for the
device in between; ``raise_if_not_finite`` is the one other place that synchronizes (before a log or a save).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ndparallel.errors import NumericsError
from ndparallel.mesh.topology import Topology
from ndparallel.step.flops import AttentionFlops, mfu
from ndparallel.step.token_loss import reduce_loss
from ndparallel.train.phase_timer import PhaseTimer


@dataclass
class StepResult:
    """What one optimizer step hands the loop (device scalars: reading them waits for the device)."""

    loss: torch.Tensor
    """This rank's share of the step loss (the shares sum to the step loss over the loss group)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    tokens: torch.Tensor
    """Real (non-padding) input tokens on this rank."""
    skipped: bool
    """``nan_policy: skip`` dropped the update of this step."""


class LogWindow:
    """Sums the steps since the last record; owns the NaN policy ('stop' or 'skip') and the phase timer."""

    def __init__(
        self,
        topo: Topology,
        *,
        nan_policy: str,
        flops_per_token: float,
        peak_flops: float | None,
        attention: AttentionFlops | None = None,
    ) -> None:
        self.topo, self.nan_policy = topo, nan_policy
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.attention = attention
        """Counts each batch's attention FLOPs on the host (None: attention not counted)."""
        self.timer = PhaseTimer(topo.device)
        self.skipped_total = 0
        self.skipped_now = False
        # The first step any update was not finite at (-1: none), kept on the device: 'stop' looks at it
        # only before logging or saving.
        self.first_bad = torch.full((), -1, dtype=torch.long, device=topo.device)
        self.restart()

    def restart(self) -> None:
        self.loss = torch.zeros((), device=self.topo.device)
        self.tokens = torch.zeros((), device=self.topo.device)
        self.attention_flops = 0.0  # this rank's share, counted on the host from the batches' documents
        self.grad_norm = None
        self.steps = 0
        self.started = time.perf_counter()

    def add(self, step: int, result: StepResult, batches: list = ()) -> None:
        """Step ``step``'s result, and its micro-batches (whose documents say what attention computed)."""
        if self.attention is not None:
            layout, rank = self.topo.layout, self.topo.cp_rank
            self.attention_flops += sum(self.attention.of_batch(b, cp=layout.cp, cp_rank=rank) for b in batches)
        self.loss += result.loss
        self.tokens += result.tokens
        self.grad_norm = result.grad_norm
        self.steps += 1
        self.skipped_now = result.skipped
        if result.skipped:
            self.skipped_total += 1
        else:
            finite = torch.isfinite(result.loss) & torch.isfinite(result.grad_norm).to(result.loss.device)
            self.first_bad = torch.where(~finite & (self.first_bad < 0), step, self.first_bad)

    def raise_if_not_finite(self, last_good: Path | None) -> None:
        """nan_policy 'stop': raise on every rank if any rank saw a non-finite update (two tiny all-reduces)."""
        if self.nan_policy != "stop":
            return
        never = torch.iinfo(torch.long).max
        first = torch.where(self.first_bad < 0, never, self.first_bad).clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        bad = int(first.item())
        if bad == never:
            return
        kept = f"; the last good checkpoint is {last_good}" if last_good else "; no checkpoint was saved before it"
        raise NumericsError(
            f"step {bad}: the loss or the gradient norm is not finite; training stopped{kept}. "
            f"Lower learning_rate or set max_grad_norm, or set nan_policy: skip to skip such steps"
        )

    def tokens_so_far(self) -> int:
        """Tokens of this window's steps over all ranks (for a checkpoint saved between log lines; a collective)."""
        window = self.tokens.clone()
        dist.all_reduce(window, group=self.topo.loss.get_group())
        return int(window.item())

    def close(self, step: int, *, lr: float) -> dict:
        """The metrics record of the window ending at ``step`` (collectives; waits for the device).

        ``window_tokens``, ``window_s`` and ``window_flops`` are this window's tokens, training seconds and model
        FLOPs (the caller takes them out of the record for the run's totals)."""
        topo, steps = self.topo, max(1, self.steps)
        loss = reduce_loss(self.loss, topo).item() / steps
        # the attention FLOPs are counted on the host: the tensor is made where the token count lives
        attention = torch.tensor(self.attention_flops, dtype=torch.float64, device=self.tokens.device)
        totals = torch.stack([self.tokens.double(), attention]).to(self.topo.device)
        dist.all_reduce(totals, group=topo.loss.get_group())  # one collective for both
        tokens, attention_flops = totals.tolist()
        phases = self.timer.take()
        stall = phases.pop("checkpoint_stall", 0.0)
        elapsed = max(time.perf_counter() - self.started - stall, 1e-9)  # training time only
        tps = tokens / elapsed
        flops = tokens * self.flops_per_token + attention_flops
        peak = self.peak_flops * topo.world_size if self.peak_flops else None
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": self.grad_norm.item(),
            "lr": lr,
            "window_tokens": int(tokens),
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / topo.world_size,
            "mfu": mfu(flops=flops, seconds=elapsed, peak=peak) if peak else None,
            "peak_memory_gib": peak_memory_gib(topo.device),
            "step_time_s": elapsed / steps,
            "skipped_steps": self.skipped_total,
        }
        record.update({f"{name}_s": seconds / steps for name, seconds in phases.items()})
        record["checkpoint_stall_s"] = stall
        record.update(window_s=elapsed, window_flops=flops)
        return record


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GiB on a GPU; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
