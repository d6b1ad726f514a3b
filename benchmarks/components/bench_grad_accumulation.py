"""Per-rank gradient memory held between micro-batches, for both gradient-accumulation modes.

    torchrun --nproc-per-node 4 benchmarks/components/bench_grad_accumulation.py --dp-replicate 2 --dp-shard 2
    torchrun --nproc-per-node 4 benchmarks/components/bench_grad_accumulation.py --dp-shard 4

``every_micro_batch`` (the default) reduce-scatters each micro-batch's gradients, so a rank holds its
1/shard of the fp32 gradients between micro-batches; ``last_micro_batch`` holds the full unsharded fp32
gradients of its TP shard until the last micro-batch (4 bytes x parameters / tp). Measured as the memory
a rank holds after the first micro-batch's backward (activations freed) minus before its forward:
``torch.cuda.memory_allocated`` on GPUs; on CPU the resident set size, with glibc told to return every
allocation above 64 KiB to the system when freed (``MALLOC_MMAP_THRESHOLD_``, set by re-executing), so
the resident set follows live tensors. Printed beside the bytes the two modes should hold.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

import ndparallel as ndp
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

MODES = ("every_micro_batch", "last_micro_batch")


def _memory(device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def _micro_batch(model, topo, ids):
    batch = ndp.prepare_batch(ids, topo)
    n = ndp.count_tokens(batch.num_tokens, topo)
    ndp.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=n, topology=topo).backward()


def measure(args, topo, mode: str) -> dict:
    config = model_config_for(
        base_model=None,
        model_shape=None,
        max_position_embeddings=args.seq,
        overrides={
            "model_type": "llama",
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "intermediate_size": 3 * args.hidden,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 8192,
        },
    )
    model = meta_model(config)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
    materialize(model, topo.device, weights_dir=None, seed=0)
    opt = ndp.build_optimizer(model, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 8192, (topo.layout.batch_size, args.seq), generator=g) for _ in range(2)]
    for step in range(2):  # step 0 creates the optimizer state; step 1 is measured
        opt.zero_grad(set_to_none=True)
        before = _memory(topo.device)
        ndp.set_gradient_sync(model, False, mode=mode)
        _micro_batch(model, topo, ids[0])
        held = _memory(topo.device) - before
        ndp.set_gradient_sync(model, True, mode=mode)
        _micro_batch(model, topo, ids[1])
        opt.step()
    shard = topo.fully_shard_mesh.size(topo.fully_shard_mesh.ndim - 1)
    unsharded = 4 * sum(p.numel() for p in model.parameters()) / topo.layout.tp  # fp32, this rank's TP shard
    expected = unsharded if mode == "last_micro_batch" else unsharded / shard
    del model, opt
    gc.collect()
    return {"mode": mode, "held_mib": held / 2**20, "expected_mib": expected / 2**20}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()
    if not torch.cuda.is_available() and os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    topo = ndp.Topology.build(
        ndp.ParallelismConfig(dp_replicate_size=args.dp_replicate, dp_shard_size=args.dp_shard, tp_size=args.tp)
    )
    rows = [measure(args, topo, mode) for mode in MODES]
    worst = [torch.tensor(r["held_mib"]) for r in rows]
    for value in worst:  # the largest over ranks
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    if topo.is_main:
        print(
            f"layout {topo.layout.shape} (dp_replicate, dp_shard, cp, tp); llama hidden {args.hidden}, "
            f"{args.layers} layers, fp32; gradient memory held between micro-batches, per rank:"
        )
        for r, value in zip(rows, worst):
            r["held_mib_max_over_ranks"] = float(value)
            print(f"  {r['mode']:18s} measured {float(value):9.1f} MiB   expected {r['expected_mib']:9.1f} MiB")
        print(json.dumps(rows))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
