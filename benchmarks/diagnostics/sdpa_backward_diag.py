"""Why does the planner probe's SDPA backward run slower than the same kernel inside a training step?

    PYTHONPATH=src python3 benchmarks/diagnostics/sdpa_backward_diag.py --out $OUT     # one GPU, ~20 s

At the 1B shape (32 heads, 8 key/value heads, head_dim 64, 2 rows of 4096), causal SDPA forward and
backward timed several ways: the probe's way (contiguous (B, H, L, D) leaves, gradients accumulating into
.grad), the model's way (q/k/v as transposed views of (B, L, H, D) projections, the gradient reaching SDPA
through the same transpose, no accumulation), and the model's way with each backend forced. For each:
milliseconds and the fraction of the bf16 peak, and the CUDA kernels that ran (from the profiler).
Prints a table, writes ``sdpa_backward_diag.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PEAK = 989e12
B, H, KV, L, D = 2, 32, 8, 4096, 64


def _time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key[:90] for e in prof.key_averages() if e.device_time_total > 0})


def probe_way():
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def both():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    return fwd, both


def model_way():
    """q/k/v as the model makes them: (B, L, H*D) projections viewed as (B, L, H, D), transposed."""
    qp = torch.randn(B, L, H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kp = torch.randn(B, L, KV * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    vp = torch.randn(B, L, KV * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, L, H * D, device="cuda", dtype=torch.bfloat16)

    def heads(t, n):
        return t.view(B, L, n, D).transpose(1, 2)

    def out():
        o = F.scaled_dot_product_attention(heads(qp, H), heads(kp, KV), heads(vp, KV), is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, L, H * D)

    def fwd():
        with torch.no_grad():
            out()

    def both():
        torch.autograd.grad(out(), (qp, kp, vp), grad)

    return fwd, both


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    flops = 4 * D * H * B * L * (L + 1) / 2
    rows = []
    cases = [("probe", probe_way, None), ("model", model_way, None)]
    cases += [(f"model/{b.name}", model_way, b) for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)]
    cases += [(f"probe/{b.name}", probe_way, b) for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)]
    for name, make, backend in cases:
        fwd, both = make()
        try:
            with sdpa_kernel([backend]) if backend is not None else torch.enable_grad():
                f = _time(fwd)
                fb = _time(both)
                kernels = _kernels(both)
        except RuntimeError as err:
            rows.append({"case": name, "error": str(err).splitlines()[0][:160]})
            print(rows[-1])
            continue
        row = {
            "case": name,
            "fwd_ms": round(f * 1e3, 3),
            "bwd_ms": round((fb - f) * 1e3, 3),
            "fwd_frac": round(flops / f / PEAK, 3),
            "bwd_frac": round(2.5 * flops / (fb - f) / PEAK, 3),
            "kernels": kernels,
        }
        rows.append(row)
        print(
            f"{name:24s} fwd {row['fwd_ms']:7.3f} ms ({row['fwd_frac']:.3f})  bwd {row['bwd_ms']:7.3f} ms "
            f"({row['bwd_frac']:.3f})"
        )
        for kernel in kernels:
            print("     ", kernel)
    Path(args.out, "sdpa_backward_diag.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
