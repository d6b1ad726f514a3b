"""One script, any layout: a short training loop with the ndparallel library API.

    torchrun --nproc-per-node 8 examples/train_any_layout.py --dp-shard 2 --cp 2 --tp 2
    torchrun --nproc-per-node 4 examples/train_any_layout.py --dp-replicate 2 --tp 2 --cp-method ring
    python examples/train_any_layout.py                      # one process

It trains a small Llama-shaped model from scratch on the bytes of a local text file (by default the
Python standard library's ``os.py``), so nothing is downloaded. Change the sizes, not the code.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import ndparallel as ndp


def byte_batches(path: str, *, rows: int, seq: int, steps: int, seed: int):
    """Random windows of a file's bytes (vocabulary 256); the same on every rank."""
    data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq, (rows,), generator=g)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp-method", default="allgather", choices=["allgather", "ring", "alltoall"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rows", type=int, default=8, help="global batch rows")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--text", default=os.__file__)
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights (default on GPU)")
    args = p.parse_args()

    topo = ndp.Topology.build(
        ndp.ParallelismConfig(
            dp_replicate_size=args.dp_replicate,
            dp_shard_size=args.dp_shard,
            cp_size=args.cp,
            tp_size=args.tp,
            cp_comm_strategy=args.cp_method,
        )
    )
    if topo.is_main:
        print(topo.describe())

    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    model = AutoModelForCausalLM.from_config(config)
    bf16 = args.bf16 or topo.device.type == "cuda"
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype="bfloat16" if bf16 else None))
    optimizer = ndp.build_optimizer(model, lr=2e-3, weight_decay=0.1)

    for step, ids in enumerate(byte_batches(args.text, rows=args.rows, seq=args.seq, steps=args.steps, seed=1)):
        batch = ndp.prepare_batch(ids, topo)
        num_tokens = ndp.count_tokens(batch.num_tokens, topo)
        # the loss without the (tokens x vocabulary) logits: lm_head's input goes to the fused loss
        loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=num_tokens, topology=topo)
        loss.backward()
        grad_norm = ndp.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            total = ndp.reduce_loss(loss, topo)  # the step loss: the ranks' shares summed
            if topo.is_main:
                print(f"step {step:3d}  loss {total.item():.4f}  grad norm {grad_norm.item():.3f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
