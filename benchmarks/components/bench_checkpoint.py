"""Training stall per checkpoint save, synchronous against asynchronous, and an exactness check.

    PYTHONPATH=src python3 benchmarks/components/bench_checkpoint.py --shape 1b --seq 4096 --out $OUT          # one GPU
    PYTHONPATH=src python3 benchmarks/components/bench_checkpoint.py --shape 3b --seq 4096 --out $OUT
    torchrun --nproc-per-node 2 benchmarks/components/bench_checkpoint.py --shape 1b --seq 4096 --out $OUT    # FSDP 2
    PYTHONPATH=src python3 benchmarks/components/bench_checkpoint.py --shape cpu-small --seq 128 --device cpu  # CPU

For each mode (sync, then async) the same model (Llama-shaped preset, random init, FSDP over the ranks,
AdamW, bf16 compute on CUDA) trains on synthetic tokens and saves ``--saves`` times through
``ndparallel.Checkpointer``. After a save, training goes on until the save is published on every rank,
then ``--gap`` more steps, then the next save: so each stall is the save's own, not a queue behind a slow
disk. Only one checkpoint is kept on disk (the previous one is deleted before the next save).

Stall per save (``stall_s``) = time inside ``save()`` + the time optimizer steps were held until the
state was copied to host memory (measured by the Checkpointer). ``step_excess_s`` adds everything else
the save cost the steps until it was published (on a CPU host the writer thread shares the cores; on a
GPU the copy shares PCIe), against the median step time without a save; every step ends with a device
synchronize. The first save of a mode includes allocating the (pinned) host buffers; later ones reuse them.

Exactness: at the last save the model and optimizer state are fingerprinted (float64 sums of every local
shard); after training has gone on, that checkpoint is loaded back and fingerprinted again: the two must
be equal (``exact``). Results: a JSON line per mode in ``$OUT/bench_checkpoint.jsonl`` (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ndparallel as ndp
from ndparallel.models.presets import PRESETS
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

SHAPES = {
    **PRESETS,
    "cpu-small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build(args, topo: ndp.Topology):
    overrides = SHAPES[args.shape] if args.shape not in PRESETS else {}
    config = model_config_for(
        base_model=None,
        model_shape=args.shape if args.shape in PRESETS else "tiny",
        overrides=overrides,
        max_position_embeddings=args.seq,
    )
    model = meta_model(config)
    bf16 = topo.device.type == "cuda"
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype="bfloat16" if bf16 else None))
    materialize(model, topo.device, weights_dir=None, seed=0)
    return model, ndp.build_optimizer(model, lr=1e-4, weight_decay=0.1), config.vocab_size


def _fingerprint(model, optimizer) -> list[float]:
    """float64 sums of this rank's shards of every parameter and optimizer tensor (cheap, order-fixed)."""
    sums = []
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        sums.append(float(local.detach().double().sum()))
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                value = value.to_local() if hasattr(value, "to_local") else value
                sums.append(float(value.detach().double().sum()))
    return sums


def _all_ranks(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _train_step(args, topo, model, optimizer, vocab: int, step: int) -> float:
    """One step on synthetic tokens; seconds, ending with a device synchronize."""
    start = time.perf_counter()
    rows = args.micro_batch * topo.layout.batch_size
    ids = torch.randint(0, vocab, (rows, args.seq), generator=torch.Generator().manual_seed(step))
    batch = ndp.prepare_batch(ids, topo)
    n = ndp.count_tokens(batch.num_tokens, topo)
    ndp.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=n, topology=topo).backward()
    optimizer.step()  # after an asynchronous save: waits until the state is copied to host memory
    optimizer.zero_grad(set_to_none=True)
    _sync(topo.device)
    return time.perf_counter() - start


def _saves(args, topo, model, optimizer, vocab: int, ckpt: ndp.Checkpointer, root: Path):
    """Train with ``--saves`` saves; per save: seconds in save(), step times after it; the last save's
    directory and the fingerprint of the state it holds."""
    states = {"model": model, "optimizer": optimizer}
    plain, calls, stalls, after, step = [], [], [], [], 0
    for _ in range(args.warmup + args.gap):
        seconds = _train_step(args, topo, model, optimizer, vocab, step)
        plain += [seconds] if step >= args.warmup else []
        step += 1
    for _ in range(args.saves):
        ckpt.wait()
        if topo.is_main:  # one checkpoint on disk at a time (a 3B one is ~38 GB)
            for old in root.glob("step-*"):
                shutil.rmtree(old)
        dist.barrier()
        fingerprint = _fingerprint(model, optimizer)
        start = time.perf_counter()
        path = ckpt.save(step, states)
        _sync(topo.device)
        calls.append(time.perf_counter() - start)
        extra, published_after = [], None
        while published_after is None or len(extra) < published_after + args.gap:
            extra.append(_train_step(args, topo, model, optimizer, vocab, step))
            step += 1
            if published_after is None and _all_ranks(not ckpt.in_flight, topo.device):
                published_after = len(extra)
        after.append(extra)
        stalls.append(ckpt.stall_s)  # save() plus optimizer steps held until the state was copied
    ckpt.wait()
    return plain, calls, stalls, after, path, fingerprint


def _run_mode(args, topo, mode: str, root: Path) -> dict:
    model, optimizer, vocab = _build(args, topo)
    ckpt = ndp.Checkpointer(root, async_save=mode == "async")
    plain, calls, stalls, after, path, fingerprint = _saves(args, topo, model, optimizer, vocab, ckpt, root)
    median = statistics.median(plain + [t for extra in after for t in extra[-args.gap :]])
    # Everything the save cost the steps around it (also sharing the host or PCIe with the writer).
    excess = [call + sum(max(0.0, t - median) for t in extra[: -args.gap]) for call, extra in zip(calls, after)]
    load_start = time.perf_counter()
    ckpt.load({"model": model, "optimizer": optimizer}, path)
    _sync(topo.device)
    load_s = time.perf_counter() - load_start
    exact = _all_ranks(_fingerprint(model, optimizer) == fingerprint, topo.device)
    ckpt.close()
    size_gb = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9
    dist.barrier()
    if topo.is_main:  # free the disk for the next mode
        shutil.rmtree(root, ignore_errors=True)
    return {
        "mode": mode,
        "shape": args.shape,
        "world": topo.world_size,
        "seq": args.seq,
        "median_step_s": round(median, 4),
        "save_call_s": [round(t, 3) for t in calls],
        "stall_s": [round(t, 3) for t in stalls],
        "step_excess_s": [round(t, 3) for t in excess],
        "steps_until_published": [len(e) - args.gap for e in after],
        "load_s": round(load_s, 2),
        "exact": exact,
        "checkpoint_gb": round(size_gb, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--gap", type=int, default=3, help="steps between the publication of a save and the next save")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dir", default="/tmp/ndp-bench-checkpoint", help="where checkpoints are written")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for bench_checkpoint.jsonl")
    args = p.parse_args()
    device_type = None if args.device == "auto" else args.device
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=-1), device_type=device_type)  # FSDP over all
    results = []
    for mode in args.modes.split(","):
        root = Path(args.dir) / mode
        if topo.is_main:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
        results.append(_run_mode(args, topo, mode, root))
        gc.collect()  # the mode's model and optimizer (FSDP keeps reference cycles) before the next one
        if topo.device.type == "cuda":
            torch.cuda.empty_cache()
        if topo.is_main:
            r = results[-1]
            print(
                f"{mode:5s} {args.shape} world {topo.world_size}: stall per save {r['stall_s']} s (save() "
                f"{r['save_call_s']} s; extra step time until published {r['step_excess_s']} s), median step "
                f"{r['median_step_s']} s, load {r['load_s']} s, "
                f"{r['checkpoint_gb']} GB, exact resume: {r['exact']}",
                flush=True,
            )
    if topo.is_main:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "bench_checkpoint.jsonl", "a", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
