"""The Triton AdamW that reads bf16 gradients (``kernels/adamw.py``) against the eager update, on CUDA.

    PYTHONPATH=src python3 tests/gpu/gpu_bf16_grad_adamw.py --out $OUT

1. Per tensor size (odd sizes, a block boundary, a 3B model's embedding): the kernel's master and moments
   against ``optim.adamw_update_(param, grad.float(), ...)`` run eagerly, relative (Frobenius) difference
   at most 1e-7 (float32 rounding of a fused multiply-add; one ulp is 6e-8), and the compute copy must be
   the bf16 rounding of the kernel's own master, bit for bit.
2. Time per step over a 3B model's parameter list (Llama 3.2 3B shapes), for several block sizes and warp
   counts: the kernel per tensor (plus the Triton norm of the bf16 gradients) vs the upcast, the norm and the
   compiled flat update it replaces. Writes $OUT/bf16_grad_adamw.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ndparallel import _compat
from ndparallel.kernels.adamw import adamw_from_low_precision_grad_
from ndparallel.kernels.grad_norm import total_norm
from ndparallel.optim.flat_adamw import _compiled_update, _hyper, adamw_update_

GROUP = {"lr": 3e-4, "weight_decay": 0.1, "eps": 1e-8, "betas": (0.9, 0.95)}


def _tensors(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    param = torch.randn(n, device="cuda", generator=g)
    grad = (torch.randn(n, device="cuda", generator=g) * 1e-3).bfloat16()
    exp_avg = torch.randn(n, device="cuda", generator=g) * 1e-4
    exp_avg_sq = torch.rand(n, device="cuda", generator=g) * 1e-7
    return param, grad, exp_avg, exp_avg_sq


def check_sizes() -> list[dict]:
    rows = []
    hyper = _hyper(GROUP, 7.0, torch.device("cuda"))
    scale = torch.tensor(0.37, device="cuda")
    for n in (1, 3, 3072, 4095, 4096, 4097, 1024 * 3072 + 5, 128256 * 3072):
        param, grad, exp_avg, exp_avg_sq = _tensors(n, n % 1000)
        ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
        ref_compute = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        adamw_update_(ref[0], grad.float(), ref[1], ref[2], hyper, scale, ref_compute)
        compute = torch.empty_like(ref_compute)
        adamw_from_low_precision_grad_(param, grad, exp_avg, exp_avg_sq, hyper, scale, compute)

        def rel(a, b):
            return float((a - b).norm() / b.norm().clamp(min=1e-30))

        row = {
            "numel": n,
            "master_rel": rel(param, ref[0]),
            "exp_avg_rel": rel(exp_avg, ref[1]),
            "exp_avg_sq_rel": rel(exp_avg_sq, ref[2]),
            "compute_is_master_rounded": bool(torch.equal(compute, param.bfloat16())),
        }
        row["ok"] = (
            max(row["master_rel"], row["exp_avg_rel"], row["exp_avg_sq_rel"]) <= 1e-7
            and row["compute_is_master_rounded"]
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def llama_3b_sizes() -> list[int]:
    hidden, inter, kv, vocab, layers = 3072, 8192, 1024, 128256, 28
    per_layer = [
        hidden * hidden,
        kv * hidden,
        kv * hidden,
        hidden * hidden,
        inter * hidden,
        inter * hidden,
        hidden * inter,
        hidden,
        hidden,
    ]
    return [vocab * hidden] + per_layer * layers + [hidden]


def _time(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def time_3b() -> dict:
    sizes = llama_3b_sizes()
    total = sum(sizes)
    master = torch.zeros(total, device="cuda")
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    compute = torch.zeros(total, device="cuda", dtype=torch.bfloat16)
    grads = [torch.full((n,), 1e-3, device="cuda", dtype=torch.bfloat16) for n in sizes]
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    hyper = _hyper(GROUP, 7.0, torch.device("cuda"))
    scale = torch.ones((), device="cuda")

    def per_tensor(block: int, warps: int):
        total_norm(grads, 2.0)  # as clip_grad_norm_ measures them
        for off, grad in zip(offsets, grads):
            adamw_from_low_precision_grad_(
                master, grad, exp_avg, exp_avg_sq, hyper, scale, compute, offset=off, block=block, num_warps=warps
            )

    variants = {}
    for block, warps in ((1024, 4), (2048, 4), (4096, 8)):
        variants[f"{block}x{warps}"] = _time(lambda: per_tensor(block, warps))
    norm_ms = _time(lambda: torch.linalg.vector_norm(torch.stack(_compat.float32_norms(grads, 2.0))))
    torch.cuda.synchronize()
    began = time.perf_counter()
    per_tensor(1024, 4)  # the host's time to launch the norm and the 255 updates (the GPU runs behind it)
    host_launch_ms = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    triton_norm_ms = {
        f"{block}x{warps}": _time(lambda: total_norm(grads, 2.0, block=block, num_warps=warps))
        for block, warps in ((4096, 4), (8192, 8))
    }
    reference = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads[:20]]))
    norm_rel_diff = float((total_norm(grads[:20], 2.0) - reference).abs() / reference)
    grad_flat = torch.empty_like(master)
    views = [grad_flat[o : o + n] for o, n in zip(offsets, sizes)]
    update = _compiled_update()
    chunk = 2**30

    def flat():
        _compat.copy_tensors_(views, grads)
        torch.nn.utils.get_total_norm(views)
        for s in range(0, total, chunk):
            e = min(s + chunk, total)
            update(master[s:e], grad_flat[s:e], exp_avg[s:e], exp_avg_sq[s:e], hyper, scale, compute[s:e])

    flat_ms = _time(flat)
    result = {
        "params": total,
        "bf16_norm_ms": norm_ms,
        "triton_norm_ms_by_block_x_warps": triton_norm_ms,
        "triton_norm_rel_diff": norm_rel_diff,
        "host_launch_ms_norm_and_updates": host_launch_ms,
        "norm_and_per_tensor_update_ms_by_block_x_warps": variants,
        "upcast_norm_flat_update_ms": flat_ms,
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = check_sizes()
    timing = time_3b()
    ok = all(r["ok"] for r in rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bf16_grad_adamw.json").write_text(json.dumps({"sizes": rows, "timing": timing, "ok": ok}, indent=1))
    print("bf16-gradient AdamW kernel:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
