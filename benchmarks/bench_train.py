"""Training throughput: ndparallel's trainer path beside a plain PyTorch loop and Accelerate's FSDP2 path.

    torchrun --nproc-per-node 1 benchmarks/bench_train.py --shape 1b --seq 4096 --micro-batch 2 --steps 20
    torchrun --nproc-per-node 8 benchmarks/bench_train.py --shape 8b --seq 8192 --tp 2 --compare accelerate
    python benchmarks/bench_train.py --shape tiny --seq 128 --steps 3 --device cpu      # smoke run (CI)

Every path trains the same Llama-shaped model (random init, synthetic tokens, full rows) with AdamW and
bf16 compute (fp32 on CPU). Prints, per path: tokens/s, tokens/s per device, MFU and peak memory, then the
ratios to ndparallel. MFU = tokens/s x FLOPs/token / (devices x 989 TFLOP/s), FLOPs/token =
6 x (non-embedding params + lm_head) + 12 x layers x hidden x seq. Steps before --warmup are not timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ndparallel as ndp
from ndparallel.metrics import device_peak_flops, flops_per_token
from ndparallel.models.build import materialize, meta_model, model_config_for
from ndparallel.models.presets import PRESETS
from ndparallel.train import forward_backward


def _synthetic(rows: int, seq: int, vocab: int, step: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1000 + step))


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(run_step, *, steps: int, warmup: int, device: torch.device) -> float:
    """Seconds per step over the timed steps (host clock around a device synchronize)."""
    for i in range(warmup):
        run_step(i)
    _sync(device)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        run_step(i)
    _sync(device)
    return (time.perf_counter() - start) / steps


def bench_ndparallel(args, config, topo) -> dict:
    options = ndp.ParallelOptions(param_dtype=None if args.fp32 else "bfloat16", activation_checkpointing=args.ac,
                                  compile=args.compile, fsdp_wrap=args.fsdp_wrap)
    model = meta_model(config)
    ndp.parallelize(model, topo, options=options)
    materialize(model, topo.device, weights_dir=None, seed=0)
    model.train()
    opt = ndp.build_optimizer(model, lr=1e-4, weight_decay=0.1)
    rows = args.micro_batch * topo.layout.batch_size

    def step(i):
        batch = ndp.prepare_batch(_synthetic(rows, args.seq, config.vocab_size, i), topo)
        forward_backward(model, [batch], topo, compiled_loss=args.compile)
        ndp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _reset(topo.device)
    seconds = _timed(step, steps=args.steps, warmup=args.warmup, device=topo.device)
    result = {"path": "ndparallel", "s_per_step": seconds, "tokens_per_step": rows * args.seq,
              "devices": topo.world_size, "peak_gib": _peak_gib(topo.device)}
    del model, opt
    return result


def bench_plain(args, config, device) -> dict:
    """One device, no parallelism: transformers' model, bf16 autocast over fp32 weights, fused AdamW."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).to(device)
    model.train()
    if args.ac != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    dtype = torch.float32 if args.fp32 else torch.bfloat16

    def step(i):
        ids = _synthetic(args.micro_batch, args.seq, config.vocab_size, i).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=not args.fp32):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _reset(device)
    seconds = _timed(step, steps=args.steps, warmup=args.warmup, device=device)
    result = {"path": "plain PyTorch", "s_per_step": seconds, "tokens_per_step": args.micro_batch * args.seq,
              "devices": 1, "peak_gib": _peak_gib(device)}
    del model, opt
    return result


def bench_accelerate(args, config, topo) -> dict:
    """Accelerate's FSDP2 path (ParallelismConfig when tp > 1), the same model and batch."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    layer_cls = type(model.model.layers[0]).__name__
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[layer_cls],
        reshard_after_forward=True, activation_checkpointing=args.ac != "none",
        mixed_precision_policy=None if args.fp32 else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                           reduce_dtype=torch.float32))
    kwargs = {}
    if topo.layout.tp > 1 or topo.layout.dp_replicate > 1:
        kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=topo.layout.dp_replicate,
                                                         dp_shard_size=topo.layout.dp_shard, tp_size=topo.layout.tp)
    accelerator = Accelerator(mixed_precision="no" if args.fp32 else "bf16", fsdp_plugin=plugin, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=topo.device.type == "cuda")
    model, opt = accelerator.prepare(model, opt)
    model.train()
    per_rank = args.micro_batch

    def step(i):
        ids = _synthetic(per_rank * topo.layout.batch_size, args.seq, config.vocab_size, i)
        ids = ids[topo.batch_rank * per_rank:(topo.batch_rank + 1) * per_rank].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _reset(topo.device)
    seconds = _timed(step, steps=args.steps, warmup=args.warmup, device=topo.device)
    result = {"path": "Accelerate FSDP2", "s_per_step": seconds,
              "tokens_per_step": per_rank * topo.layout.batch_size * args.seq, "devices": topo.world_size,
              "peak_gib": _peak_gib(topo.device)}
    del model, opt
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="rows per data-parallel rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp-method", default="allgather")
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--fsdp-wrap", default="block")
    p.add_argument("--fp32", action="store_true", help="no mixed precision (CPU default)")
    p.add_argument("--compare", default="plain,accelerate", help="comma list of: plain, accelerate, none")
    p.add_argument("--json", help="append the results as one JSON line to this file")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    args = p.parse_args()
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":
        args.fp32 = True
    if "RANK" not in os.environ:  # a one-process run without torchrun: a local group of one (Accelerate needs env)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    ndp.init_distributed(device_type=device_type)
    topo = ndp.Topology.build(ndp.ParallelismConfig(
        dp_replicate_size=args.dp_replicate, dp_shard_size=args.dp_shard, cp_size=args.cp, tp_size=args.tp,
        cp_comm_strategy=args.cp_method), device_type=device_type)
    config = model_config_for(base_model=None, model_shape=args.shape, overrides={}, max_position_embeddings=args.seq)
    fpt = flops_per_token(config, args.seq)
    peak = device_peak_flops(topo.device)

    results = [bench_ndparallel(args, config, topo)]
    compare = [c for c in args.compare.split(",") if c and c != "none"]
    if "plain" in compare and topo.world_size == 1:
        results.append(bench_plain(args, config, topo.device))
    if "accelerate" in compare and topo.layout.cp == 1:
        try:
            results.append(bench_accelerate(args, config, topo))
        except Exception as exc:  # report, keep the other figures
            results.append({"path": "Accelerate FSDP2", "error": f"{type(exc).__name__}: {str(exc)[:200]}"})

    if topo.is_main:
        name = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
        print(f"\n{args.shape} seq {args.seq} x micro-batch {args.micro_batch}, layout {topo.layout.shape} "
              f"(dp_replicate, dp_shard, cp, tp), ac {args.ac}, compile {args.compile}, {name}, "
              f"torch {torch.__version__}")
        print(f"{'path':18s} {'tokens/s':>10s} {'/device':>10s} {'MFU':>7s} {'peak GiB':>9s} {'ndp÷this':>8s}")
        base = None
        for r in results:
            if "error" in r:
                print(f"{r['path']:18s} failed: {r['error']}")
                continue
            r["tokens_per_s"] = r["tokens_per_step"] / r["s_per_step"]
            r["tokens_per_s_per_device"] = r["tokens_per_s"] / r["devices"]
            r["mfu"] = r["tokens_per_s_per_device"] * fpt / peak if peak else None
            base = base or r["tokens_per_s_per_device"]
            mfu = f"{r['mfu'] * 100:6.1f}%" if r["mfu"] else "    n/a"
            print(f"{r['path']:18s} {r['tokens_per_s']:10.0f} {r['tokens_per_s_per_device']:10.0f} {mfu} "
                  f"{r['peak_gib']:9.2f} {base / r['tokens_per_s_per_device']:7.2f}x")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"args": vars(args), "device": name, "torch": torch.__version__,
                                    "results": results}) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
