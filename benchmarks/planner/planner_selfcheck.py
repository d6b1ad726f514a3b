"""Does ``ndparallel plan --measure`` reproduce this GPU's one-GPU training throughput? (run on the GPU)

    PYTHONPATH=src python3 benchmarks/planner/planner_selfcheck.py --out "$OUT"                # ~3-4 minutes on an H200
    PYTHONPATH=src python3 benchmarks/planner/planner_selfcheck.py --out "$OUT" --no-compile   # eager only, ~1 minute
    python3 benchmarks/planner/planner_selfcheck.py --device cpu --shapes tiny --seqs 128x2 --steps 2   # smoke run

For each model shape: the planner's probe times this GPU's kernels (``planner/probe.py``, not cached here),
then for each (sequence x micro-batch) and compile on/off the planner predicts one-GPU tokens/s twice
(with the H200 preset's efficiencies, and with the measured ones) and ndparallel's trainer step runs for
real (``bench_train.run_row``: parallelize, random init, AdamW, clipping; 3 warm-up steps, which
include compilation, then ``--steps`` timed). Prints a table; writes ``planner_selfcheck.jsonl`` (one row
per configuration) and ``planner_probe.json`` (the measured efficiencies per shape, for
``benchmarks/planner/planner_fit_h200.py`` and ``planner/rates.py``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))  # bench_train's rows

from bench_train import run_row  # noqa: E402

import ndparallel as ndp  # noqa: E402
from ndparallel.planner import probe  # noqa: E402
from ndparallel.planner.gpus import GPUS  # noqa: E402
from ndparallel.planner.hardware import GIB, Cluster  # noqa: E402
from ndparallel.planner.plan import plan  # noqa: E402
from ndparallel.planner.shapes import load_model_shape  # noqa: E402
from ndparallel.planner.workload import Workload  # noqa: E402
from ndparallel.weights.meta import model_config_for  # noqa: E402


def predict(model, cluster: Cluster, seq: int, b: int, compiled: bool) -> tuple[float, float]:
    work = Workload(  # the step it runs: the trainer's fused loss, no tiled MLP or offload
        seq_len=seq,
        global_batch_rows=b,
        micro_batch_sizes=(b,),
        activation_checkpointing="none",
        compile=compiled,
        tiled_mlp=False,
        activation_offload=False,
    )
    row = plan(model, cluster, work)[0]
    return row.tokens_per_s_per_gpu, row.memory.allocated / GIB


def run(model_key: str, seq: int, b: int, compiled: bool, topo, steps: int) -> dict:
    args = SimpleNamespace(
        fp32=topo.device.type == "cpu",
        ac="none",
        fsdp_wrap="block",
        micro_batch=b,
        seq=seq,
        steps=steps,
        warmup=3,
        profile=None,
        profile_rows="",
        shape=model_key,
    )
    config = model_config_for(base_model=None, model_shape=model_key, overrides={}, max_position_embeddings=seq)
    start = time.perf_counter()
    result = run_row("ndparallel" if compiled else "ndparallel-eager", args, topo, config)
    if "error" in result:
        raise RuntimeError(f"{model_key} seq {seq} x {b}: {result['error']}")
    result["wall_s"] = time.perf_counter() - start
    result["tokens_per_s"] = result["tokens_per_step"] / result["s_per_step"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default="1b,3b")
    p.add_argument("--seqs", default="4096x2,8192x1", help="sequence x micro-batch, comma-separated")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    ndp.init_distributed(device_type=args.device)
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1), device_type=args.device)
    seqs = [tuple(int(x) for x in item.split("x")) for item in args.seqs.split(",")]
    compiles = (False,) if args.no_compile else (False, True)
    rows, probes = [], {}
    started = time.perf_counter()
    for key in args.shapes.split(","):
        model = load_model_shape(key)
        t0 = time.perf_counter()
        spec, eff = probe.measure(model, tokens=max(s * b for s, b in seqs), device=args.device, use_cache=False)
        probe_s = time.perf_counter() - t0
        probes[model.name] = {"gpu": spec.__dict__, "efficiency": eff.to_dict(), "seconds": probe_s}
        print(f"{model.name}: probe {probe_s:.1f} s -> {json.dumps(eff.to_dict())}", flush=True)
        preset = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"])
        measured = Cluster(nodes=1, gpus_per_node=1, gpu=spec, efficiency=eff, measured=True)
        for compiled in compiles:
            for seq, b in seqs:
                got = run(key, seq, b, compiled, topo, args.steps)
                from_preset, _ = predict(model, preset, seq, b, compiled)
                from_probe, mem = predict(model, measured, seq, b, compiled)
                row = {
                    "model": model.name,
                    "seq": seq,
                    "micro_batch": b,
                    "compile": compiled,
                    "measured_tokens_per_s": got["tokens_per_s"],
                    "predicted_h200_preset": from_preset,
                    "predicted_measured": from_probe,
                    "error_measured": from_probe / got["tokens_per_s"] - 1,
                    "error_preset": from_preset / got["tokens_per_s"] - 1,
                    "peak_gib": got["peak_gib"],
                    "predicted_gib": mem,
                    "wall_s": got["wall_s"],
                    "device": spec.name,
                    "torch": torch.__version__,
                }
                rows.append(row)
                print(
                    f"  {model.name} {seq}x{b} compile={compiled}: measured {row['measured_tokens_per_s']:,.0f} "
                    f"tok/s, predicted {from_probe:,.0f} ({row['error_measured']:+.1%}) with --measure, "
                    f"{from_preset:,.0f} ({row['error_preset']:+.1%}) with the H200 preset; peak "
                    f"{row['peak_gib']:.2f} GiB vs {mem:.2f} predicted ({got['wall_s']:.0f} s)",
                    flush=True,
                )
    with open(os.path.join(args.out, "planner_selfcheck.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(args.out, "planner_probe.json"), "w") as f:
        json.dump(probes, f, indent=1)
    worst = max(abs(r["error_measured"]) for r in rows)
    print(
        f"\nworst error with --measure: {worst:.1%} over {len(rows)} configurations "
        f"({'within' if worst <= 0.10 else 'OUTSIDE'} 10%); total {time.perf_counter() - started:.0f} s"
    )
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
