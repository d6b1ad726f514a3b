"""Accelerate's ``examples/torch_native_parallelism/nd_parallel.py``, ported to ndparallel.

docs/from-accelerate.md puts the two side by side and explains every changed line. The same flags:

    torchrun --nproc-per-node 8 examples/accelerate_nd_parallel.py --dp-shard-size 2 --cp-size 2 --tp-size 2 \\
        --model-name meta-llama/Llama-3.2-1B --data 'corpus/*.txt'
    torchrun --nproc-per-node 4 examples/accelerate_nd_parallel.py --dp-replicate-size 2 --tp-size 2 \\
        --model-name ./my-model --resume-from ./outputs/checkpoint-100     # any other layout resumes too

Runs on CPU processes (gloo) as well as GPUs. Data: text files, one document each, tokenized with the
model's tokenizer and packed into rows whose positions restart at every document.
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import ndparallel as ndp
from ndparallel.weights.pretrained import model_directory

MODEL_ID = "NousResearch/Hermes-3-Llama-3.1-8B"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=-1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--cp-comm-strategy", default="allgather", choices=["allgather", "ring", "alltoall"])
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=8, help="rows per step, over all data ranks")
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--resume-from", type=str, default=None)
    parser.add_argument("--model-name", type=str, default=MODEL_ID)
    parser.add_argument("--data", type=str, default=os.path.join(os.path.dirname(os.__file__), "json", "*.py"))
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 compute with fp32 master weights (default: on for CUDA)",
    )
    return parser.parse_args(argv)


def packed_batches(tokenizer, pattern: str, *, seq_len: int, rows: int, seed: int = 42):
    """Endless global batches (the same on every rank): documents packed into rows of ``seq_len`` tokens,
    ``position_ids`` restarting at 0 where a document starts (so no token attends across documents)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise SystemExit(f"--data {pattern!r} matches no file")
    stream = []
    for path in files:
        ids = tokenizer(Path(path).read_text(encoding="utf-8", errors="replace"))["input_ids"]
        stream.append(torch.tensor(ids + [tokenizer.eos_token_id], dtype=torch.long))
    generator = torch.Generator().manual_seed(seed)
    while True:
        ids, pos = torch.empty(rows, seq_len, dtype=torch.long), torch.empty(rows, seq_len, dtype=torch.long)
        for r in range(rows):
            filled = 0
            while filled < seq_len:  # random documents (or their beginnings) until the row is full
                doc = stream[int(torch.randint(len(stream), (1,), generator=generator))][: seq_len - filled]
                ids[r, filled : filled + len(doc)] = doc
                pos[r, filled : filled + len(doc)] = torch.arange(len(doc))
                filled += len(doc)
        yield ids, pos


def train_step(model, optimizer, ids, position_ids, topo, max_grad_norm):
    batch = ndp.prepare_batch(ids, topo, position_ids=position_ids)  # this rank's rows and sequence chunks
    num_tokens = ndp.count_tokens(batch.num_tokens, topo)  # target tokens over every data rank
    # the loss without the (tokens x vocabulary) logits: lm_head's input goes to the fused loss
    loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=num_tokens, topology=topo)
    loss.backward()
    grad_norm = ndp.clip_grad_norm_(model.parameters(), max_grad_norm)  # one norm over TP and FSDP meshes
    optimizer.step()
    optimizer.zero_grad()
    return ndp.reduce_loss(loss, topo), grad_norm  # the global token-mean loss


def train(args: argparse.Namespace) -> list[float]:
    parallelism_config = ndp.ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
        cp_comm_strategy=args.cp_comm_strategy,
    )
    topo = ndp.Topology.build(parallelism_config)
    bf16 = args.bf16 if args.bf16 is not None else topo.device.type == "cuda"
    options = ndp.ParallelOptions(param_dtype="bfloat16" if bf16 else None)
    model = ndp.load_pretrained(args.model_name, topo, options=options)  # TP, CP, FSDP: straight into the layout
    tokenizer = AutoTokenizer.from_pretrained(model_directory(args.model_name))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    batches = packed_batches(tokenizer, args.data, seq_len=args.sequence_length, rows=args.global_batch_size)

    # Sharded, reshardable, written in the background and published atomically; loading unpickles nothing
    # but an exact allow-list (the README's "what loading trusts").
    checkpoints = ndp.Checkpointer(f"{args.save_dir}/checkpoints", keep=2, async_save=True)
    state = {"model": model, "optimizer": optimizer}
    start = checkpoints.load(state, args.resume_from).step if args.resume_from else 0
    for _ in range(start):  # the data position: the batches the checkpoint had trained on
        next(batches)
    if topo.is_main:
        print(topo.describe(), flush=True)
    losses, tokens, began = [], 0, time.perf_counter()
    for step in range(start, args.num_steps):
        ids, position_ids = next(batches)
        loss, grad_norm = train_step(model, optimizer, ids, position_ids, topo, args.max_grad_norm)
        losses.append(loss.item())
        tokens += ids.numel()
        if topo.is_main and (step % 10 == 0 or step == args.num_steps - 1):
            rate = tokens / (time.perf_counter() - began) / topo.world_size
            print(
                f"Step {step}/{args.num_steps}, Loss: {losses[-1]:.4f}, grad norm {grad_norm.item():.3f}, "
                f"{rate:,.0f} tokens/s per device",
                flush=True,
            )
        if (step + 1) % args.checkpoint_frequency == 0:
            checkpoints.save(step + 1, state)  # returns once the state is copied; training goes on
    checkpoints.close()  # the last save is written before the export below reads nothing from it

    ndp.save_pretrained(model, f"{args.save_dir}/final", topo, tokenizer=tokenizer)
    if topo.is_main:
        print(f"Model saved to {args.save_dir}/final", flush=True)
    return losses


if __name__ == "__main__":
    train(parse_args())
    torch.distributed.destroy_process_group()
