"""bf16 GEMM rates of decoder training shapes on this GPU, per product (run on the GPU).

    PYTHONPATH=src python3 benchmarks/planner/gemm_shapes.py --json "$OUT/gemm_shapes.jsonl"

Why: the planner charges every matmul at one fraction of the bf16 peak (``Efficiency.matmul``, 0.744 from
the profiled 1B step), where the kernels of a step run at different rates by shape: the profiled 3B step's
matmuls ran 6% slower than that charge and the 1B's at 32k tokens per micro-batch 4% faster. This times the
products the planner counts (``parts.linear_s``: each layer linear and lm_head, forward ``x @ W.T``, input
gradient ``dY @ W``, weight gradient ``dY.T @ x``) for preset shapes and tensor-parallel splits, at several
token counts M, so that efficiency can be modelled by shape from measurements.

Each product: inputs from randn (the power a GEMM draws depends on its data), 3 warm-up calls, then as
many calls as fit in ``--seconds`` (at least 3), CUDA-event timed. Prints TFLOP/s and the fraction of the
device's dense bf16 peak (989 for an H200 / H100 SXM unless ``--peak`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from ndparallel.planner.shapes import load_model_shape  # noqa: E402

ORIENTATIONS = ("forward", "input_grad", "weight_grad")


def layer_products(shape: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of each distinct linear of one tp rank, as ``parts._linear_shapes`` counts them."""
    m = load_model_shape(shape)
    h, q, kv, i = m.hidden, m.q_dim, m.kv_dim, m.intermediate
    linears = [("q", h, q // tp), ("kv", h, kv // tp), ("o", q // tp, h), ("gate_up", h, i // tp), ("down", i // tp, h)]
    return linears + [("lm_head", h, m.vocab // tp)]


def time_product(orientation: str, m: int, k: int, n: int, seconds: float) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    fn = {
        "forward": lambda: F.linear(x, w),
        "input_grad": lambda: dy @ w,
        "weight_grad": lambda: dy.t() @ x,
    }[orientation]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - start
    reps = max(3, int(seconds / max(once, 1e-6)))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="1b:1,3b:1,8b:1,8b:2,8b:4,8b:8,70b:2,70b:4,70b:8")
    p.add_argument("--tokens", default="2048,4096,8192,16384,32768,65536")
    p.add_argument("--seconds", type=float, default=0.02, help="timed calls per product fill about this long")
    p.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of the device")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    seen: set[tuple] = set()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(args.json, "a") as out:
        for spec in args.models.split(","):
            shape, tp = spec.split(":")
            for name, k, n in layer_products(shape, int(tp)):
                for m in (int(t) for t in args.tokens.split(",")):
                    for orientation in ORIENTATIONS:
                        # (M, N, K) of the product as cuBLAS sees it
                        dims = {"forward": (m, n, k), "input_grad": (m, k, n), "weight_grad": (n, k, m)}[orientation]
                        key = (orientation, *dims)
                        if key in seen:
                            continue
                        seen.add(key)
                        s = time_product(orientation, m, k, n, args.seconds)
                        tflops = 2 * m * n * k / s / 1e12
                        row = {
                            "model": shape,
                            "tp": int(tp),
                            "linear": name,
                            "orientation": orientation,
                            "M": dims[0],
                            "N": dims[1],
                            "K": dims[2],
                            "tokens": m,
                            "seconds": s,
                            "tflops": round(tflops, 1),
                            "fraction": round(tflops / args.peak, 4),
                            **meta,
                        }
                        out.write(json.dumps(row) + "\n")
                        print(
                            f"{shape:>4} tp{tp} {name:8s} {orientation:11s} "
                            f"M={dims[0]:6d} N={dims[1]:6d} K={dims[2]:6d} "
                            f"{tflops:6.1f} TF/s {tflops / args.peak:.3f}",
                            flush=True,
                        )
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
