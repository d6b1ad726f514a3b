"""Where a training step's GPU time goes: per phase (synchronized wall clock) and per kernel class.

bench_train.py's ``--profile`` runs it on its rows (the module imports nothing of bench_train):

    python benchmarks/peers/bench_train.py --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel \
        --profile profiles.txt --profile-rows ndparallel        # ndparallel-fsdp: the FSDP2-on-one-rank path

Three views of the same steps:

* phases: forward+backward, gradient clipping, optimizer step (+ zero_grad), each timed between device
  synchronizations: ms per step;
* kernel classes: torch.profiler's device time per kernel, summed by class. Profiler *annotations*
  (``Optimizer.step#AdamW.step``, which spans the optimizer's kernels) are left out, so nothing is
  counted twice (the earlier version of this script counted the optimizer twice: 13% instead of ~8%);
* busy: the union of kernel intervals against the wall time of the profiled steps (idle = the GPU
  waiting for the host), and the idle gaps by the phase the host was running meanwhile, with the
  largest gaps and the kernels on either side (where launch overhead or a host sync stalls the GPU).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

CLASSES = [  # first match wins: substrings of lower-cased kernel names
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "sm90", "sm100", "cutlass", "nvjet", "matmul", "xmma", "scaled_mm")),
    ("optimizer (torch fused/foreach)", ("adam", "multi_tensor")),
    ("communication", ("nccl",)),
    ("copy/cast", ("copy", "memcpy", "cast", "to_copy", "chunk_cat", "split_with_sizes")),
    ("fused elementwise (compiled)", ("triton",)),
    (
        "other elementwise/reduction",
        ("elementwise", "reduce", "vectorized", "index", "scatter", "gather", "fill", "memset"),
    ),
]


def classify(name: str) -> str:
    lower = name.lower()
    return next((c for c, keys in CLASSES if any(k in lower for k in keys)), "other")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phase_times(phases: list, steps: int) -> dict[str, float]:
    """ms per step of each (name, fn) phase, timed between synchronizations."""
    totals: dict[str, float] = defaultdict(float)
    for _ in range(steps):
        for name, fn in phases:
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            totals[name] += (time.perf_counter() - start) * 1000
    return {name: ms / steps for name, ms in totals.items()}


def _busy_union_us(events) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def _gaps(kernels, min_us: float = 10.0) -> list[tuple[float, float, str, str]]:
    """(start, length, kernel before, kernel after) of every stretch of >= ``min_us`` with no kernel running."""
    spans = sorted(((e.time_range.start, e.time_range.end, e.name) for e in kernels), key=lambda x: x[0])
    gaps, end, last = [], None, ""
    for s, e, name in spans:
        if end is not None and s - end >= min_us:
            gaps.append((end, s - end, last, name))
        if end is None or e > end:
            end, last = e, name
    return gaps


def _phase_at(annotations, t: float) -> str:
    for name, s, e in annotations:
        if s <= t < e:
            return name
    return "between phases"


def idle_report(prof, kernels, phase_names: set[str], steps: int) -> list[str]:
    """Idle GPU time by the phase the host was in (host and device share the profiler's clock)."""
    annotations = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name in phase_names and e.device_type == torch.autograd.DeviceType.CPU
    ]
    gaps = _gaps(kernels)
    by_phase: dict[str, float] = defaultdict(float)
    for start, length, _, _ in gaps:
        by_phase[_phase_at(annotations, start)] += length
    lines = [f"idle gaps >= 10 us: {sum(g[1] for g in gaps) / 1000 / steps:.1f} ms/step, while the host ran:"]
    for name, us in sorted(by_phase.items(), key=lambda x: -x[1]):
        lines.append(f"  {name:32s} {us / 1000 / steps:8.2f} ms/step")
    lines.append("largest gaps (us: kernel before -> kernel after):")
    for start, length, before, after in sorted(gaps, key=lambda g: -g[1])[:8]:
        lines.append(f"  {length:8.0f}  [{_phase_at(annotations, start)}] {before[:50]} -> {after[:50]}")
    return lines


def _is_kernel(event) -> bool:
    return (
        event.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(event, "is_user_annotation", False)
        and "#" not in event.name
        and not event.name.startswith("ProfilerStep")
    )


def profile_steps(phases: list, *, steps: int = 3, title: str = "") -> str:
    """Profile ``steps`` steps made of ``phases`` [(name, fn), ...]; returns the report as text."""
    lines = [f"== {title}" if title else "=="]
    by_phase = phase_times(phases, steps)
    total_ms = sum(by_phase.values())
    lines.append(f"phases (synchronized, ms per step; total {total_ms:.1f} ms):")
    for name, ms in by_phase.items():
        lines.append(f"  {name:32s} {ms:8.1f} ms  {100 * ms / total_ms:5.1f}%")
    _sync()
    start = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            for name, fn in phases:
                with torch.profiler.record_function(name):
                    fn()
        _sync()
    wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events() if _is_kernel(e)]
    totals: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        totals[classify(e.name)] += us
        per_kernel[e.name[:90]] += us
    summed = sum(totals.values()) or 1.0
    busy = _busy_union_us(kernels)
    lines.append(
        f"GPU kernels over {steps} profiled steps: {summed / 1000:.1f} ms summed, busy {busy / 1000:.1f} ms of "
        f"{wall_us / 1000:.1f} ms wall ({100 * busy / wall_us:.1f}% busy; profiler overhead included)"
    )
    for cls, us in sorted(totals.items(), key=lambda x: -x[1]):
        lines.append(f"  {cls:32s} {us / 1000 / steps:8.1f} ms/step  {100 * us / summed:5.1f}%")
    lines.extend(idle_report(prof, kernels, {name for name, _ in phases}, steps))
    lines.append("top kernels (ms per step):")
    for name, us in sorted(per_kernel.items(), key=lambda x: -x[1])[:18]:
        lines.append(f"  {us / 1000 / steps:8.2f}  [{classify(name)[:10]:10s}] {name}")
    return "\n".join(lines)
