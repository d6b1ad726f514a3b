"""Where a LoRA layer stack's step time goes, per base format and MLP path: timed steps and the top kernels.

    PYTHONPATH=src python benchmarks/diagnostics/lora_layer_profile_diag.py [--json FILE] [--bases bf16,nf4]

Why: on an H100 (2026-12-07, session 13) the 8B QLoRA step with ``fused_lora_mlp`` ran 13% slower than with the
modules' MLP (9,110 against 10,516 tok/s), while on a bf16 base the same switch cost 2%; both paths dequantize
the same weights the same number of times. This builds the stack of ``quantized_checkpoint_memory_diag.py``
(``lora_stack``: decoder layers of the 8B's width, 4,096 tokens, LoRA r16 on every linear, one rank, full checkpointing,
compiled), for each base and MLP path: milliseconds per forward + backward (median of CUDA-event timings after
the compiles), the host's milliseconds to issue one, and one profiled step's device time per kernel name and
host self time per operator, largest first, so the two paths' kernels (and launches) can be set side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from dequant_speed_diag import emit, timed  # siblings: the script's folder is on sys.path
from quantized_checkpoint_memory_diag import lora_stack
from torch.profiler import ProfilerActivity, profile

import ndparallel as ndp


def build(base: str, fused: bool, layers: int, seq: int, compiled: bool):
    """One forward + backward of the stack, as a function."""
    model, topo, batch, n = lora_stack(base, compiled, layers=layers, seq=seq, fused_lora_mlp=fused)

    def step() -> None:
        loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def host_ms(step, repeats: int) -> float:
    """Median milliseconds the host spends issuing one step (from a synchronized start until ``step`` returns,
    before the device has finished): near the step's wall time, the step is bound by the host's launches, not
    by the kernels (session 15: the FP8 base's 4-layer step took 46.6 ms of kernels and 57.4 of wall time), or
    something in it waits for the device (then ``top_host_ops_ms`` shows a synchronizing call, e.g. ``aten::item``)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure(base: str, fused: bool, args) -> dict:
    step = build(base, fused, args.layers, args.seq, args.compile)
    ms = timed(step, repeats=args.steps, back_to_back=1)  # after three steps: the compiles
    issued = host_ms(step, args.steps)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    by_kernel: Counter = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.name[:90]] += event.device_time_total / 1e3
    host_ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    row = {"base": base, "fused_lora_mlp": fused, "layers": args.layers, "seq": args.seq}
    row["ms_per_step"] = round(ms, 2)
    row["host_ms_per_step"] = round(issued, 2)
    row["device_ms_profiled"] = round(sum(by_kernel.values()), 2)
    row["top_kernels_ms"] = [[name, round(kernel_ms, 3)] for name, kernel_ms in by_kernel.most_common(args.top)]
    # host self time per operator (under the profiler, which adds its own cost to each call), and calls
    row["top_host_ops_ms"] = [[e.key[:90], round(e.self_cpu_time_total / 1e3, 3), e.count] for e in host_ops]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bases", default="bf16,nf4", help="comma list of bf16, int8, nf4, fp8")
    p.add_argument("--mlp", default="modules,fused", help="MLP paths: modules (per-linear), fused (fused_lora_mlp)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for base in args.bases.split(","):
        for fused in [path == "fused" for path in args.mlp.split(",")]:
            try:
                row = measure(base, fused, args)
            except Exception as exc:  # one row's failure is a result too
                row = {"base": base, "fused_lora_mlp": fused, "error": f"{type(exc).__name__}: {exc}"[:400]}
            emit(row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
