"""The host time of an 8-bit AdamW step: torchao's ``AdamW8bit.step`` against ours (``_compat.adamw_8bit_class``).

    PYTHONPATH=src python benchmarks/diagnostics/adamw_8bit_host_diag.py [--tensors 291] [--device cuda]

Why: an 8B full fine-tune with ``bf16: full`` on an H100 (2026-12-08, RESULTS.md issue 35 session 17) spent 214 of
its 621 ms a step in the host's optimizer phase. torchao's step calls ``torch.compile(single_param_adam, ...)``
anew for every tensor of every step (an 8B has 291); ours builds that compiled function once. This runs both on
the same tensors, small enough (4,096 bf16 values each, the smallest torchao quantizes) that the kernels take
little of the time, and prints the median step time of each over 5 steps after 3 warm-up steps. On a GPU the
steps are synchronized, so the time is the host's launches plus the (small) kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def step_ms(cls, tensors: int, device: str) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 256, dtype=torch.bfloat16, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = cls(params, lr=torch.tensor(1e-5), bf16_stochastic_round=True)
    times = []
    for i in range(8):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # the first steps compile
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=291, help="tensors updated a step (an 8B has 291)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from torchao.optim import AdamW8bit

    from ndparallel import _compat

    for name, cls in (("torchao AdamW8bit.step", AdamW8bit), ("ndparallel (one compiled update)", None)):
        cls = cls or _compat.adamw_8bit_class()
        ms = step_ms(cls, args.tensors, args.device)
        print(f"{name:34s} {ms:8.1f} ms a step ({args.tensors} tensors of 4,096 bf16 values, {args.device})")


if __name__ == "__main__":
    main()
