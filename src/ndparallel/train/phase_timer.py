"""Where a training step's time goes: data wait, forward+backward, optimizer, checkpoint stall.

The loop marks each phase with ``with timer.phase(name):``. On CUDA the forward+backward and optimizer
phases are timed on the device with CUDA events (no host sync inside the step: the events are read at the
logging step, when the host waits for the device anyway); the data phase is host work, timed on the
host. On CPU every phase is host time (the ops run synchronously). FSDP's communication that compute had
to wait for is inside ``fwd_bwd`` (it runs on other CUDA streams and cannot be split off without the
profiler: ``benchmarks/peers/profile_step.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch

DEVICE_PHASES = ("fwd_bwd", "optimizer")


class PhaseTimer:
    """Seconds spent per phase since the last ``take``."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self._host: dict[str, float] = defaultdict(float)
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.on_cuda and name in DEVICE_PHASES:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] += time.perf_counter() - begin

    def add(self, name: str, seconds: float) -> None:
        """Time measured elsewhere (a checkpoint save the loop waited for)."""
        self._host[name] += seconds

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call (waits for the recorded CUDA events), and reset."""
        totals = dict(self._host)
        for name, pairs in self._events.items():
            if pairs:
                pairs[-1][1].synchronize()
                totals[name] = totals.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        self._host.clear()
        self._events.clear()
        return totals
