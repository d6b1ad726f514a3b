"""Long rows on one GPU: single-document rows vs packed rows vs short rows, tokens/s and peak memory.

    python benchmarks/long_context/bench_long_rows.py --out long_rows.jsonl                     # 1B, full AC, 16k-128k
    python benchmarks/long_context/bench_long_rows.py --shape tiny --lengths 1024,4096 --device cpu --out x.jsonl
    torchrun --nproc-per-node 2 benchmarks/long_context/bench_long_rows.py --cp 2 --device cpu --shape tiny ...  # cp 2

For every row length L the same model trains (the trainer's ``forward_backward`` through
``prepare_batch``, then clip and AdamW) on four kinds of batch with the same number of tokens:
one row holding one document; one row packed with 4,096-token documents; one row packed with 512-token
documents; and L/4096 rows of 4,096 tokens. Packed rows do the attention work of short rows, so their
throughput should match the short rows' (the target: >= 90%) while a single document's work grows with
L squared; their peak memory should not exceed the single document's. ``--longest`` tries longer packed
rows until one does not fit. Under ``--cp N`` (torchrun with N processes) each rank reports its wall
and CPU (process) time: on a shared CPU the process time is the steadier measure of the work.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

import ndparallel as ndp
from ndparallel.train.loop import forward_backward
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for


def _rows(kind: str, length: int, vocab: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    if kind == "rows-4096":
        return {"input_ids": torch.randint(0, vocab, (max(1, length // 4096), min(length, 4096)), generator=g)}
    ids = torch.randint(0, vocab, (1, length), generator=g)
    if kind == "single":
        return {"input_ids": ids}
    doc = int(kind.split("-")[1])
    return {"input_ids": ids, "position_ids": (torch.arange(length) % doc)[None]}


def _measure(model, opt, topo, kind, length, vocab, steps, device) -> dict:
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    times, cpu_times = [], []
    for step in range(steps + 1):  # the first step warms up
        data = _rows(kind, length, vocab, step)
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        batch = ndp.prepare_batch(topology=topo, **data)
        forward_backward(model, [batch], topo)
        ndp.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    step_s = statistics.median(times[1:])
    tokens = data["input_ids"].numel()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "kind": kind,
        "length": length,
        "tokens": tokens,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "cpu_s": round(statistics.median(cpu_times[1:]), 4),
        "peak_gib": None if peak is None else round(peak, 2),
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b")
    p.add_argument("--lengths", default="16384,32768,65536,131072")
    p.add_argument("--kinds", default="rows-4096,packed-4096,packed-512,single")
    p.add_argument("--longest", default="", help="packed (4,096-token documents) lengths to try after the table")
    p.add_argument("--ac", default="full")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--cp-method", default="ring")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device_type = args.device
    if device_type == "cpu":
        torch.set_num_threads(1)
    ndp.init_distributed(device_type=device_type)
    topo = ndp.Topology.build(
        ndp.ParallelismConfig(dp_shard_size=1, cp_size=args.cp, cp_comm_strategy=args.cp_method),
        device_type=device_type,
    )
    device = topo.device
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = [int(x) for x in args.longest.split(",") if x]
    config = model_config_for(
        base_model=None, model_shape=args.shape, overrides={}, max_position_embeddings=max(lengths + longest)
    )
    model = meta_model(config)
    ndp.parallelize(
        model,
        topo,
        options=ndp.ParallelOptions(
            activation_checkpointing=args.ac, param_dtype="bfloat16" if device.type == "cuda" else None
        ),
    )
    materialize(model, device, weights_dir=None, seed=0)
    model.train()
    opt = ndp.build_optimizer(model, lr=1e-5, weight_decay=0.1)
    meta = {
        "shape": args.shape,
        "ac": args.ac,
        "cp": args.cp,
        "cp_method": args.cp_method if args.cp > 1 else None,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    cases = [(kind, length) for length in lengths for kind in args.kinds.split(",")]
    cases += [("packed-4096", length) for length in longest]
    for kind, length in cases:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            record = _measure(model, opt, topo, kind, length, config.vocab_size, args.steps, device)
            record["status"] = "ok"
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            record = {"kind": kind, "length": length, "status": "oom"}
        record.update(meta)
        if topo.rank == 0:
            print(json.dumps(record), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
        if record["status"] == "oom" and (kind, length) in cases[len(cases) - len(longest) :]:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
