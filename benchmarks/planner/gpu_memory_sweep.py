"""Peak memory and step time of ndparallel's trainer path over shapes, sequence lengths and options (one GPU).

    python benchmarks/planner/gpu_memory_sweep.py --out sweep.jsonl                  # the default case list
    python benchmarks/planner/gpu_memory_sweep.py --cases "1b:4096:2:selective" --out x.jsonl

A case is SHAPE:SEQ:MICRO_BATCH:AC[:lora][:nf4|:int8][:cpK] (nf4 / int8: LoRA on a base whose decoder-block
linears are quantized, ``ParallelOptions.quantized_base``; needs lora); ``--overrides`` (JSON) sets config
fields of every case (another layer shape or depth).
Each builds the model straight into its layout, runs
--steps steps of synthetic full rows, and records peak allocated memory (torch.cuda.max_memory_allocated),
the median step time, tokens/s and MFU; an out-of-memory case is recorded as such. Feeds
benchmarks/results/RESULTS.md and the planner's measurements (results/planner_memory_measurements.json).
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
from ndparallel.adapters.lora import LoraSpec, adapter_weight_count
from ndparallel.step.flops import AttentionFlops, flops_per_token
from ndparallel.train.loop import forward_backward
from ndparallel.train.metrics import device_peak_flops
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

DEFAULT_CASES = [
    *(f"1b:{seq}:{mb}:{ac}" for seq, mb in ((2048, 4), (4096, 2), (8192, 1)) for ac in ("none", "selective", "full")),
    *(f"3b:{seq}:{mb}:{ac}" for seq, mb in ((4096, 2), (8192, 1)) for ac in ("none", "selective", "full")),
    "1b:4096:2:none:lora",
    "1b:4096:2:selective:lora",
]


def _flops_per_token(config, model, frozen_base: bool) -> float:
    """The trainer's count: a LoRA step's frozen base does no weight-gradient GEMMs."""
    return flops_per_token(config, frozen_base=frozen_base, adapter_params=adapter_weight_count(model))


def run_case(case: str, topo, steps: int, compile_: bool, overrides: dict | None = None) -> dict:
    parts = case.split(":")
    shape, seq, mb, ac = parts[0], int(parts[1]), int(parts[2]), parts[3]
    lora = LoraSpec(r=16, alpha=32, target_linear=True) if "lora" in parts[4:] else None
    quantized = next((q for q in ("nf4", "int8") if q in parts[4:]), None)
    record = {
        "case": case,
        "shape": shape,
        "seq": seq,
        "micro_batch": mb,
        "ac": ac,
        "lora": lora is not None,
        "quantized_base": quantized,
        "compile": compile_,
        "layout": list(topo.layout.shape),
        **({"overrides": overrides} if overrides else {}),
    }
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = opt = None
    try:
        config = model_config_for(
            base_model=None, model_shape=shape, overrides=overrides or {}, max_position_embeddings=seq
        )
        model = meta_model(config)
        ndp.parallelize(
            model,
            topo,
            options=ndp.ParallelOptions(activation_checkpointing=ac, compile=compile_, quantized_base=quantized),
            lora=lora,
        )
        materialize(model, topo.device, weights_dir=None, seed=0)
        model.train()
        opt = ndp.build_optimizer(model, lr=1e-4, weight_decay=0.1)
        after_init = torch.cuda.memory_allocated() / 2**30
        times = []
        for step in range(steps):
            ids = torch.randint(0, config.vocab_size, (mb, seq), generator=torch.Generator().manual_seed(step))
            torch.cuda.synchronize()
            start = time.perf_counter()
            batch = ndp.prepare_batch(ids, topo)
            forward_backward(model, [batch], topo, compiled_loss=compile_)  # as the trainer does
            ndp.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times[2:] if len(times) > 3 else times[-1:])
        tps = mb * seq / step_s
        record.update(
            status="ok",
            peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            after_init_gib=after_init,
            step_s=step_s,
            tokens_per_s=tps,
            mfu=tps
            * (_flops_per_token(config, model, lora is not None) + AttentionFlops(config).of_row(seq) / seq)
            / device_peak_flops(topo.device),
        )
    except torch.OutOfMemoryError:
        record.update(status="oom", peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    return record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(DEFAULT_CASES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--overrides", type=json.loads, default=None, help="config fields for every case, as JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1), device_type="cuda")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    for case in args.cases.split(","):
        record = {**run_case(case, topo, args.steps, args.compile, args.overrides), **meta}
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = {
            k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in record.items()
            if k in ("case", "status", "peak_allocated_gib", "step_s", "tokens_per_s", "mfu")
        }
        print(shown, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
