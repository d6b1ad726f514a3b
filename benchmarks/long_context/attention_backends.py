"""Causal attention rates of each SDPA backend and of the variable-length kernel, per row length (run on the GPU).

    PYTHONPATH=src python3 benchmarks/long_context/attention_backends.py --shape 8b --rows 8192,32768 --json
    "$OUT/attn.jsonl"

Why: the planner charges whole rows at cp 1 at SDPA's rate on this machine (cuDNN's kernel on Hopper with
torch 2.11) and every context-parallel block at FlashAttention's variable-length rate. Published runs made
with other releases may have run another backend (in late 2024 PyTorch's SDPA preferred FlashAttention 2
over cuDNN), so this measures each backend on the same inputs to size that difference, and the
variable-length kernel at the model's own head_dim (``plan --measure`` times only the shape it plans).

For each row length: one row per ``--tokens`` (batch = tokens // rows), the model's query heads and its
grouped key/value heads expanded to the query heads (what every backend accepts; the FLOPs are the same),
bf16. Timed: forward alone (no grad) and forward + backward; the backward's time is the difference.
FLOPs: 4 * head_dim * heads * rows * (rows + 1) / 2 per row forward (causal), twice that backward.
Rates are printed as TFLOP/s and as fractions of the device's dense bf16 peak (989 for an H200 / H100 SXM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from ndparallel.planner.probe import _seconds, time_blocks  # noqa: E402
from ndparallel.planner.shapes import load_model_shape  # noqa: E402

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_backend(model, rows: int, tokens: int, backend, device) -> tuple[float, float, float]:
    batch = max(1, tokens // rows)
    shape = (batch, model.heads, rows, model.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    flops = 4 * model.head_dim * model.heads * batch * rows * (rows + 1) / 2

    def forward():
        with torch.no_grad(), sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    fwd = _seconds(forward, device)
    return flops, fwd, _seconds(both, device) - fwd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b")
    p.add_argument("--rows", default="8192,32768", help="row lengths, comma-separated")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per call (batch = tokens // rows)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", help="append one JSON line per (rows, kernel) to this file")
    args = p.parse_args()
    device = torch.device("cuda")
    model = load_model_shape(args.shape)
    print(
        f"{model.name}: heads {model.heads}, kv heads {model.kv_heads}, head_dim {model.head_dim}; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(f"{'rows':>7s} {'kernel':10s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} fractions")
    for rows in (int(x) for x in args.rows.split(",")):
        tokens = max(args.tokens, rows)
        kernels = {name: (lambda b=b: time_backend(model, rows, tokens, b, device)) for name, b in BACKENDS.items()}
        kernels["varlen"] = lambda: time_blocks(model, rows, tokens, device, torch.bfloat16)
        for name, timer in kernels.items():
            try:
                flops, fwd, bwd = timer()
            except RuntimeError as exc:  # a backend that refuses the shape
                print(f"{rows:7d} {name:10s} not run: {str(exc).splitlines()[0][:100]}")
                continue
            fwd_tf, bwd_tf = flops / fwd / 1e12, 2 * flops / bwd / 1e12
            record = {
                "shape": model.name,
                "head_dim": model.head_dim,
                "rows": rows,
                "tokens": tokens,
                "kernel": name,
                "forward_ms": fwd * 1e3,
                "backward_ms": bwd * 1e3,
                "forward_fraction": fwd_tf / args.peak_tflops,
                "backward_fraction": bwd_tf / args.peak_tflops,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
            }
            print(
                f"{rows:7d} {name:10s} {fwd * 1e3:8.2f} {bwd * 1e3:8.2f} {fwd_tf:9.0f} {bwd_tf:9.0f} "
                f"{record['forward_fraction']:.3f} / {record['backward_fraction']:.3f}",
                flush=True,
            )
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
