"""Derive the planner's kernel efficiencies (``planner/rates.py: H200_EFFICIENCY``) from our H200 measurements.

    PYTHONPATH=src python benchmarks/planner/planner_fit_h200.py          # prints the fitted values and every row

Only measurements made on our H200 are used (``benchmarks/results/``), never published numbers:

- fixed from kernel times of the profiled 1B step (``h200_profile_1b_compile.txt``, 3 steps of 4096 x 2
  tokens): matmul 247.5 ms for 3 x 6 x 1.236e9 x 8192 FLOPs -> 736 TFLOP/s = 0.744 of 989; flash forward
  17.2 ms and backward 49.9 ms for the causal attention of 16 layers, 32 heads of 64 -> 384 and 265 TFLOP/s
  at 4096 query rows; fused AdamW 29.5 ms for 28 bytes x 1.236e9 parameters x 3 -> 0.73 of 4.8 TB/s.
- head_dim 128 from the kernel times of the profiled 3B step (``h200_profiles_after.txt``: cuDNN's flash
  forward 20.17 ms and backward 62.08 ms per step of one 8192-token row, 28 layers of 24 heads of 128).
- fitted to the whole-step throughputs of ndparallel's own path (``h200_memory_sweep_final.jsonl``,
  ``h200_longseq.jsonl``: eager, three checkpointing modes, 2k-128k tokens, LoRA; ``h200_bench.jsonl``:
  compiled; ``h200_long_rows.jsonl``: 16k-196k-token rows of one document, of 512- and 4096-token packed
  documents and of 4096-token rows, full checkpointing): attention_half_rows, pointwise_eager,
  compiled_pointwise. The float8
  matmul fraction comes from the one float8 measurement (platform-facts: 3B, seq 8192, plain FSDP2 +
  compile, bf16 20,178 vs tensorwise float8 21,754 tokens/s), as the ratio of the two.

When ``results/h200_planner_probe.json`` exists (``planner_selfcheck.py``'s ``planner_probe.json``, the
kernels timed by ``ndparallel plan --measure`` on the H200), the kernel of packed rows and CP blocks gets
its rates from it (``block_attention``: FlashAttention 2, which SDPA does not pick on Hopper; without the
file it is assumed as fast as SDPA's). The probe's SDPA rates are not used: its backward (0.12 of the
peak at head_dim 64) is 2.4x slower than the same kernel in the profiled step (0.29), see RESULTS.md.

Minimises the mean squared log error by a coordinate search (no SciPy on the machines).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from ndparallel.mesh.layout import Layout
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.rates import H200_EFFICIENCY, Efficiency
from ndparallel.planner.shapes import load_model_shape
from ndparallel.planner.workload import Workload

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
PEAK = 989.0
PROFILE = {"matmul": 736.0 / PEAK, "fwd64": 384.0 / PEAK, "bwd64": 265.0 / PEAK, "rows": 4096, "stream": 0.73}
# The 3B step's attention kernels (h200_profiles_after.txt): causal forward FLOPs 4*d*heads*L*(L+1)/2*layers.
_FLOPS_3B = 4 * 128 * 24 * 8192 * 8193 / 2 * 28
PROFILE_128 = {"fwd": _FLOPS_3B / 20.17e-3 / 1e12 / PEAK, "bwd": 2 * _FLOPS_3B / 62.08e-3 / 1e12 / PEAK, "rows": 8192}
FP8_RATIO = 21754 / 20178  # 3B, seq 8192, compiled: float8 tensorwise over bf16
PROBE = os.path.join(RESULTS, "h200_planner_probe.json")


def probed_blocks() -> dict:
    """The block kernel's long-row rates by head_dim from the H200 probe file, or an empty dict."""
    if not os.path.isfile(PROBE):
        return {}
    blocks = {}
    for entry in json.load(open(PROBE)).values():
        blocks.update(Efficiency.from_dict(entry["efficiency"]).block_attention or {})
    return blocks


def h200_rows() -> list[dict]:
    """One row per measured configuration of ndparallel on the H200 (the latest measurement of each)."""
    rows: dict[tuple, dict] = {}
    for name in ("h200_memory_sweep_final.jsonl", "h200_longseq.jsonl"):
        for line in open(os.path.join(RESULTS, name)):
            r = json.loads(line)
            if r.get("status") != "ok":
                continue
            key = (r["shape"], r["seq"], r["micro_batch"], r["ac"], bool(r.get("compile")), bool(r.get("lora")), None)
            rows[key] = {"key": key, "tokens_per_s": r["tokens_per_s"], "source": name, "fsdp": True}
    for line in open(os.path.join(RESULTS, "h200_bench.jsonl")):
        r = json.loads(line)
        a = r["args"]
        if a["compare"] == "none":  # the earlier compiled runs, before the compiled loss (RESULTS.md uses the others)
            continue
        for res in r["results"]:
            if res["path"] == "ndparallel" and a["compile"]:
                key = (a["shape"], a["seq"], a["micro_batch"], a["ac"], True, False, None)
                rows[key] = {
                    "key": key,
                    "tokens_per_s": res["tokens_per_s"],
                    "source": "h200_bench.jsonl",
                    "fsdp": True,
                }
    for line in open(os.path.join(RESULTS, "h200_long_rows.jsonl")):  # eager, one row per step (bench_long_rows)
        r = json.loads(line)
        if r.get("status") != "ok":
            continue
        kind, length = r["kind"], r["length"]
        if kind.startswith("rows-"):  # length tokens as rows of 4096
            seq, batch, doc = int(kind[5:]), length // int(kind[5:]), None
        else:
            seq, batch, doc = length, 1, int(kind[7:]) if kind.startswith("packed-") else None
        key = (r["shape"], seq, batch, r["ac"], False, False, doc)
        # measured on the flat one-rank path (2026-12-01), the earlier files on FSDP over a mesh of one
        rows[key] = {"key": key, "tokens_per_s": r["tokens_per_s"], "source": "h200_long_rows.jsonl", "fsdp": False}
    return list(rows.values())


def predict(key: tuple, eff: Efficiency, *, fp8: bool = False, fsdp: bool = True) -> float:
    shape, seq, b, ac, compiled, lora, doc = key
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"], efficiency=eff, measured=True)
    work = Workload(
        seq_len=seq,
        global_batch_rows=b,
        micro_batch_sizes=(b,),
        activation_checkpointing=ac,
        compile=compiled,
        lora_rank=16 if lora else None,
        fp8=fp8,
        doc_len=doc,
        single_rank_fsdp=fsdp,
        master_grads=True,  # every fitted row ran before AdamW read bf16 gradients in place (2026-12-02)
        fused_loss=False,  # ... and before the fused loss, the tiled MLP and activation offload (2026-12-03)
        tiled_mlp=False,
        activation_offload=False,
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
    k128 = (PROFILE_128["rows"] + params["half_rows"]) / PROFILE_128["rows"]
    attention = {
        64: (round(PROFILE["fwd64"] * k, 3), round(PROFILE["bwd64"] * k, 3)),
        128: (round(PROFILE_128["fwd"] * k128, 3), round(PROFILE_128["bwd"] * k128, 3)),
    }
    blocks = probed_blocks()
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
    errors = [math.log(predict(r["key"], eff, fsdp=r["fsdp"]) / r["tokens_per_s"]) for r in rows]
    return sum(e * e for e in errors) / len(errors)


def fp8_loss(params: dict[str, float]) -> float:
    eff = efficiency(params)
    key = ("3b", 8192, 1, "none", True, False, None)
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
    params = {"half_rows": 600.0, "pointwise": 0.37, "compiled": 0.43, "fp8": 0.5}
    free = ["half_rows", "pointwise", "compiled"]
    params = coordinate_search(params, lambda p: loss(p, rows), free)
    params = coordinate_search(params, fp8_loss, ["fp8"])
    eff = efficiency(params)
    print("fitted:", {k: round(v, 3) for k, v in params.items()})
    print("Efficiency:", json.dumps(eff.to_dict()))
    print(
        f"\n{'shape':5s} {'seq':>6s} {'b':>2s} {'AC':9s} {'compile':7s} {'lora':4s} {'doc':>5s} {'measured':>9s} "
        f"{'predicted':>9s} {'error':>7s}"
    )
    worst = 0.0
    for r in sorted(rows, key=lambda r: tuple(str(x) for x in r["key"])):
        shape, seq, b, ac, compiled, lora, doc = r["key"]
        got = predict(r["key"], eff, fsdp=r["fsdp"])
        err = got / r["tokens_per_s"] - 1
        worst = max(worst, abs(err))
        print(
            f"{shape:5s} {seq:6d} {b:2d} {ac:9s} {str(compiled):7s} {str(lora):4s} {doc or '-':>5} "
            f"{r['tokens_per_s']:9,.0f} {got:9,.0f} {err:+7.1%}"
        )
    print(f"worst {worst:.1%} over {len(rows)} rows; rms log error {math.sqrt(loss(params, rows)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
