"""Per-rank training memory of a full fine-tune against LoRA on the same model and layout, counted exactly.

    torchrun --nproc-per-node 4 benchmarks/components/bench_state_memory.py --dp-shard 2 --tp 2 --cp 1

Counts the bytes each rank holds for parameters (its shards), gradients, optimizer state and the
activations saved for backward (``saved_tensors_hooks``) over one step, for a full fine-tune and for
LoRA (r 16 on every linear). Device-independent, so it runs on CPU; on a GPU compare with
``benchmarks/planner/gpu_memory_sweep.py`` (peak allocated).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.distributed.tensor import DTensor

import ndparallel as ndp
from ndparallel.adapters.lora import LoraSpec
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def measure(args, topo, lora: LoraSpec | None) -> dict:
    config = model_config_for(
        base_model=None,
        model_shape=None,
        max_position_embeddings=args.seq,
        overrides={
            "model_type": "llama",
            "hidden_size": args.hidden,
            "num_hidden_layers": 4,
            "intermediate_size": 4 * args.hidden,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 4096,
        },
    )
    model = meta_model(config)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None), lora=lora)
    materialize(model, topo.device, weights_dir=None, seed=0)
    opt = ndp.build_optimizer(model, lr=1e-4)
    ids = torch.randint(0, 4096, (2 * topo.layout.batch_size, args.seq), generator=torch.Generator().manual_seed(0))
    batch = ndp.prepare_batch(ids, topo)
    seen: dict[int, int] = {}

    def pack(t):
        try:
            storage = _local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a storage-less tensor DTensor's dispatch saves (shape-only): nothing to count
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**batch.model_inputs()).logits
    n = ndp.count_tokens(batch.num_tokens, topo)
    ndp.token_loss(logits, batch.labels, num_tokens=n, topology=topo).backward()
    opt.step()
    params = sum(_local(p).nbytes for p in model.parameters())
    grads = sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    state = sum(_local(v).nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "mode": "LoRA r16 all linears" if lora else "full fine-tune",
        "params_mib": params / 2**20,
        "grads_mib": grads / 2**20,
        "optimizer_mib": state / 2**20,
        "activations_mib": sum(seen.values()) / 2**20,
        "trainable_params_global": trainable,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args()
    topo = ndp.Topology.build(
        ndp.ParallelismConfig(
            dp_replicate_size=args.dp_replicate, dp_shard_size=args.dp_shard, cp_size=args.cp, tp_size=args.tp
        )
    )
    rows = [measure(args, topo, None), measure(args, topo, LoraSpec(r=16, alpha=32, target_linear=True))]
    if topo.is_main:
        print(
            f"layout {topo.layout.shape} (dp_replicate, dp_shard, cp, tp), hidden {args.hidden}, 4 layers, "
            f"seq {args.seq}, fp32, per rank:"
        )
        print(f"{'mode':22s} {'params':>9s} {'grads':>9s} {'optimizer':>10s} {'activations':>12s} {'total MiB':>10s}")
        for r in rows:
            total = r["params_mib"] + r["grads_mib"] + r["optimizer_mib"] + r["activations_mib"]
            print(
                f"{r['mode']:22s} {r['params_mib']:9.2f} {r['grads_mib']:9.2f} {r['optimizer_mib']:10.2f} "
                f"{r['activations_mib']:12.2f} {total:10.2f}"
            )
        print(json.dumps(rows))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
