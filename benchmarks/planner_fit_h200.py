"""Derive the planner's kernel efficiencies (``planner/rates.py: H200_EFFICIENCY``) from our H200 measurements.

    PYTHONPATH=src python benchmarks/planner_fit_h200.py          # prints the fitted values and every row

Only measurements made on our H200 are used (``benchmarks/results/``), never published numbers:

- fixed from kernel times of the profiled 1B step (``h200_profile_1b_compile.txt``, 3 steps of 4096 x 2
  tokens): matmul 247.5 ms for 3 x 6 x 1.236e9 x 8192 FLOPs -> 736 TFLOP/s = 0.744 of 989; flash forward
  17.2 ms and backward 49.9 ms for the causal attention of 16 layers, 32 heads of 64 -> 384 and 265 TFLOP/s
  at 4096 query rows; fused AdamW 29.5 ms for 28 bytes x 1.236e9 parameters x 3 -> 0.73 of 4.8 TB/s.
- fitted to the whole-step throughputs of ndparallel's own path (``h200_memory_sweep_final.jsonl``,
  ``h200_longseq.jsonl``: eager, three checkpointing modes, 2k-128k tokens, LoRA; ``h200_bench.jsonl``:
  compiled): attention_half_rows, pointwise_eager, compiled_pointwise, and the head_dim-128 attention as
  a multiple of the head_dim-64 one (the 3B's heads; no kernel time of it was recorded). The float8
  matmul fraction comes from the one float8 measurement (platform-facts: 3B, seq 8192, plain FSDP2 +
  compile, bf16 20,178 vs tensorwise float8 21,754 tokens/s), as the ratio of the two.

When ``results/h200_planner_probe.json`` exists (``planner_selfcheck.py``'s ``planner_probe.json``, the
kernels timed by ``ndparallel plan --measure`` on the H200), its attention rates are used as measured: the
head_dim-128 SDPA rates replace the inferred multiple, and the context-parallel block kernel gets its own
(``block_attention``; without the file it is assumed as fast as SDPA's).

Minimises the mean squared log error by a coordinate search (no SciPy on the machines).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from ndparallel.layout import Layout
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.rates import H200_EFFICIENCY, Efficiency
from ndparallel.planner.shapes import load_model_shape
from ndparallel.planner.workload import Workload

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PEAK = 989.0
PROFILE = {"matmul": 736.0 / PEAK, "fwd64": 384.0 / PEAK, "bwd64": 265.0 / PEAK, "rows": 4096, "stream": 0.73}
FP8_RATIO = 21754 / 20178  # 3B, seq 8192, compiled: float8 tensorwise over bf16
PROBE = os.path.join(RESULTS, "h200_planner_probe.json")


def probed() -> tuple[dict, dict]:
    """(SDPA, block kernel) long-row rates by head_dim from the H200 probe file, or two empty dicts."""
    if not os.path.isfile(PROBE):
        return {}, {}
    sdpa, blocks = {}, {}
    for entry in json.load(open(PROBE)).values():
        eff = Efficiency.from_dict(entry["efficiency"])
        sdpa.update(eff.attention)
        blocks.update(eff.block_attention or {})
    return sdpa, blocks


def h200_rows() -> list[dict]:
    """One row per measured configuration of ndparallel on the H200 (the latest measurement of each)."""
    rows: dict[tuple, dict] = {}
    for name in ("h200_memory_sweep_final.jsonl", "h200_longseq.jsonl"):
        for line in open(os.path.join(RESULTS, name)):
            r = json.loads(line)
            if r.get("status") != "ok":
                continue
            key = (r["shape"], r["seq"], r["micro_batch"], r["ac"], bool(r.get("compile")), bool(r.get("lora")))
            rows[key] = {"key": key, "tokens_per_s": r["tokens_per_s"], "source": name}
    for line in open(os.path.join(RESULTS, "h200_bench.jsonl")):
        r = json.loads(line)
        a = r["args"]
        if a["compare"] == "none":  # the earlier compiled runs, before the compiled loss (RESULTS.md uses the others)
            continue
        for res in r["results"]:
            if res["path"] == "ndparallel" and a["compile"]:
                key = (a["shape"], a["seq"], a["micro_batch"], a["ac"], True, False)
                rows[key] = {"key": key, "tokens_per_s": res["tokens_per_s"], "source": "h200_bench.jsonl"}
    return list(rows.values())


def predict(key: tuple, eff: Efficiency, *, fp8: bool = False) -> float:
    shape, seq, b, ac, compiled, lora = key
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"], efficiency=eff, measured=True)
    work = Workload(
        seq_len=seq,
        global_batch_rows=b,
        micro_batch_sizes=(b,),
        activation_checkpointing=ac,
        compile=compiled,
        lora_rank=16 if lora else None,
        fp8=fp8,
    )
    row = plan(
        load_model_shape(shape),
        cluster,
        work,
        constraints=dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), Layout().shape)),
    )[0]
    return row.tokens_per_s_per_gpu


def efficiency(params: dict[str, float]) -> Efficiency:
    k = (PROFILE["rows"] + params["half_rows"]) / PROFILE["rows"]  # long-row rate from the rate at 4096 rows
    fwd, bwd = PROFILE["fwd64"] * k, PROFILE["bwd64"] * k
    sdpa, blocks = probed()
    attention = {
        64: (round(fwd, 3), round(bwd, 3)),
        128: sdpa.get(128, (round(fwd * params["d128"], 3), round(bwd * params["d128"], 3))),
    }
    return dataclasses.replace(
        H200_EFFICIENCY,
        matmul=PROFILE["matmul"],
        stream=PROFILE["stream"],
        attention_half_rows=params["half_rows"],
        attention=attention,
        block_attention=blocks or None,
        pointwise_eager=params["pointwise"],
        compiled_pointwise=params["compiled"],
        matmul_fp8=params["fp8"],
    )


def loss(params: dict[str, float], rows: list[dict]) -> float:
    eff = efficiency(params)
    errors = [math.log(predict(r["key"], eff) / r["tokens_per_s"]) for r in rows]
    return sum(e * e for e in errors) / len(errors)


def fp8_loss(params: dict[str, float]) -> float:
    eff = efficiency(params)
    key = ("3b", 8192, 1, "none", True, False)
    return math.log(predict(key, eff, fp8=True) / predict(key, eff) / FP8_RATIO) ** 2


def coordinate_search(params: dict[str, float], objective, names: list[str], steps: int = 6) -> dict[str, float]:
    step = 0.2
    for _ in range(steps):
        for name in names:
            best = objective(params)
            for factor in (1 + step, 1 / (1 + step)):
                trial = {**params, name: params[name] * factor}
                value = objective(trial)
                if value < best:
                    params, best = trial, value
        step /= 2
    return params


def main() -> int:
    rows = h200_rows()
    params = {"half_rows": 600.0, "d128": 1.3, "pointwise": 0.37, "compiled": 0.43, "fp8": 0.5}
    free = ["half_rows", "pointwise", "compiled"] + ([] if 128 in probed()[0] else ["d128"])
    params = coordinate_search(params, lambda p: loss(p, rows), free)
    params = coordinate_search(params, fp8_loss, ["fp8"])
    eff = efficiency(params)
    print("fitted:", {k: round(v, 3) for k, v in params.items()})
    print("Efficiency:", json.dumps(eff.to_dict()))
    print(
        f"\n{'shape':5s} {'seq':>6s} {'b':>2s} {'AC':9s} {'compile':7s} {'lora':4s} {'measured':>9s} "
        f"{'predicted':>9s} {'error':>7s}"
    )
    worst = 0.0
    for r in sorted(rows, key=lambda r: r["key"]):
        shape, seq, b, ac, compiled, lora = r["key"]
        got = predict(r["key"], eff)
        err = got / r["tokens_per_s"] - 1
        worst = max(worst, abs(err))
        print(
            f"{shape:5s} {seq:6d} {b:2d} {ac:9s} {str(compiled):7s} {str(lora):4s} {r['tokens_per_s']:9,.0f} "
            f"{got:9,.0f} {err:+7.1%}"
        )
    print(f"worst {worst:.1%} over {len(rows)} rows; rms log error {math.sqrt(loss(params, rows)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
