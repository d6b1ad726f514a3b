"""One context-parallel rank's attention work at lengths that need many GPUs, measured on one GPU.

    python benchmarks/long_context/bench_cp_rank_share.py --out rank_share.jsonl
    python benchmarks/long_context/bench_cp_rank_share.py --device cpu --lengths 4096 --cps 2 --out x.jsonl   # smoke

For a row of S tokens (one document, or packed with 4,096-token documents), cp rank 0 runs exactly the
planned attention calls of the real method, forward and backward, for one layer
(``ndparallel/parallel/attention/simulate.py``:
the keys and values it would receive are local tensors, so only compute and memory are measured, no
communication). Heads: Llama-3-8B's (32 query heads, 8 key/value heads, head dim 128), bf16. Prints the
time and the peak memory above the inputs per (method, cp, S, data).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ndparallel.parallel.attention.simulate import rank_share


def _segments(kind: str, seq: int) -> torch.Tensor:
    pos = torch.arange(seq) if kind == "single" else torch.arange(seq) % 4096
    return torch.cumsum((pos == 0).long(), 0)[None]


def measure(method, cp, seq, kind, device, dtype, heads, kv_heads, head_dim) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q, grad = (torch.randn(1, seq, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    segments = _segments(kind, seq)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    rank_share(q, k, v, grad, segments, cp=cp, rank=0, method=method, scale=head_dim**-0.5)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    return {
        "method": method,
        "cp": cp,
        "seq": seq,
        "data": kind,
        "seconds": round(seconds, 4),
        "tokens_per_s_per_rank": round(seq / cp / seconds, 1),
        "peak_above_inputs_gib": peak and round(peak, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="131072,262144,1048576")
    p.add_argument("--cps", default="2,4,8")
    p.add_argument("--methods", default="allgather,ring,alltoall")
    p.add_argument("--data", default="packed,single")
    p.add_argument(
        "--max-single-work",
        type=float,
        default=1.4e11,
        help="skip single-document cases whose per-rank S^2/cp exceeds this (time budget)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--heads", default="32,8,128")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    measure("ring", 2, 8192, "packed", device, dtype, heads, kv_heads, head_dim)  # warm up the kernels
    for seq in (int(x) for x in args.lengths.split(",")):
        for cp in (int(x) for x in args.cps.split(",")):
            for kind in args.data.split(","):
                if kind == "single" and seq * seq / cp > args.max_single_work:
                    continue
                for method in args.methods.split(","):
                    record = measure(method, cp, seq, kind, device, dtype, heads, kv_heads, head_dim)
                    record.update(
                        date=time.strftime("%Y-%m-%d"),
                        torch=torch.__version__,
                        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    )
                    print(json.dumps(record), flush=True)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
