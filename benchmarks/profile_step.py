"""Where a training step's GPU time goes: torch.profiler over a few steps of the trainer path, by kernel class.

    python benchmarks/profile_step.py --shape 1b --seq 4096 --micro-batch 2 --compile
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import ndparallel as ndp
from ndparallel.models.build import materialize, meta_model, model_config_for
from ndparallel.train import forward_backward

CLASSES = [  # first match wins: substrings of kernel names
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "sm90", "cutlass", "nvjet", "matmul", "xmma")),
    ("optimizer", ("adam", "multi_tensor")),
    ("communication", ("nccl",)),
    ("copy/cast", ("copy", "memcpy", "cast", "to_copy")),
    ("fused elementwise (compiled)", ("triton",)),
    ("other elementwise/reduction", ("elementwise", "reduce", "vectorized", "index", "scatter", "gather")),
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", default="none")
    args = p.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29532")
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1), device_type="cuda")
    config = model_config_for(base_model=None, model_shape=args.shape, overrides={}, max_position_embeddings=args.seq)
    model = meta_model(config)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(compile=args.compile, activation_checkpointing=args.ac))
    materialize(model, topo.device, weights_dir=None, seed=0)
    opt = ndp.build_optimizer(model, lr=1e-4, weight_decay=0.1)

    def step(i):
        ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(i))
        forward_backward(model, [ndp.prepare_batch(ids, topo)], topo, compiled_loss=args.compile)
        ndp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(4):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step(10 + i)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    top = []
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if event.device_type != torch.autograd.DeviceType.CUDA or not cuda_us:
            continue
        name = event.key.lower()
        cls = next((c for c, keys in CLASSES if any(k in name for k in keys)), "other")
        totals[cls] += cuda_us
        top.append((cuda_us, event.key[:90]))
    busy = sum(totals.values())
    wall_ms = prof.profiler.self_cpu_time_total / 1000 if hasattr(prof, "profiler") else None
    print(f"GPU busy time over 3 steps: {busy / 1000:.1f} ms")
    for cls, us in sorted(totals.items(), key=lambda x: -x[1]):
        print(f"  {cls:32s} {us / 1000:8.1f} ms  {100 * us / busy:5.1f}%")
    print("top kernels:")
    for us, name in sorted(top, reverse=True)[:15]:
        print(f"  {us / 1000:8.1f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
