"""Mixture-of-experts checks on CUDA + NCCL, run by hand on a GPU machine (not part of the CPU suite).

    PYTHONPATH=src python3 tests/gpu/gpu_moe_checks.py --out $OUT       # one GPU: grouped kernel, world-1 parity
    PYTHONPATH=src torchrun --nproc-per-node 4 tests/gpu/gpu_moe_checks.py --layouts --out $OUT   # expert parallel

One GPU: the grouped expert matmuls (``_compat.grouped_mm``, bf16) against the same experts in float64, forward
and backward; then ndparallel on one GPU against plain transformers on the same GPU (Qwen3-MoE and gpt-oss,
router loss included): fp32 (the per-expert loop) within 1e-5, bf16 (grouped matmuls) within 1e-3 of fp32.
Several GPUs: expert-parallel layouts (EP over dp_shard, over dp_shard x tp, HSDP x EP, CP x EP) against one
GPU, fp32 and bf16. One line per check, PASS/FAIL; ``moe_checks.json`` under --out; exit status 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from support.moe_scenarios import make_moe_model, train_parallel_moe, train_reference_moe  # noqa: E402
from support.scenarios import make_batches, max_rel_diff  # noqa: E402

import ndparallel as ndp  # noqa: E402
from ndparallel.models.moe_experts import run_experts  # noqa: E402

RESULTS: list[dict] = []
DEVICE = torch.device("cuda")


def report(name: str, value: float, bound: float) -> None:
    RESULTS.append({"check": name, "value": value, "bound": bound, "ok": value <= bound})
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{'PASS' if value <= bound else 'FAIL'}  {name:70s} {value:.2e} (bound {bound:.0e})", flush=True)


def check_grouped_kernel() -> None:
    """run_experts in bf16 (one grouped matmul per projection) against the same experts in float64."""
    model = make_moe_model("qwen3_moe").to(DEVICE)
    experts = model.model.layers[0].mlp.experts
    counts = torch.tensor([0, 37, 5, 64, 1, 0, 90, 59], device=DEVICE)  # uneven, with empty experts
    x = torch.randn(int(counts.sum()), experts.hidden_dim, device=DEVICE)
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        experts.to(dtype)
        xi = x.to(dtype).requires_grad_(True)
        out = run_experts(experts, xi, counts)
        out.float().square().sum().backward()
        results[dtype] = (out.double(), xi.grad.double(), experts.gate_up_proj.grad.double())
        experts.zero_grad()
    for what, got, ref in zip(("out", "grad x", "grad W"), results[torch.bfloat16], results[torch.float64]):
        report(f"grouped experts bf16 vs float64 {what}", float((got - ref).norm() / ref.norm()), 2e-2)


def _on_device(batches):
    return [[{k: t.to(DEVICE) for k, t in mb.items()} for mb in step] for step in batches]


def _compare(name: str, family: str, layout: dict, batches, ref: dict) -> None:
    got = train_parallel_moe(family, layout, batches)
    report(f"{name} fp32 loss", max_rel_diff(got["losses"], ref["losses"]), 1e-5)
    report(f"{name} fp32 grad norm", max_rel_diff(got["grad_norms"], ref["grad_norms"]), 1e-5)
    if got["weights"] is not None:
        worst = max(float((got["weights"][n].to(DEVICE) - r).norm() / r.norm()) for n, r in ref["weights"].items())
        report(f"{name} fp32 weights", worst, 1e-5)
    bf16 = train_parallel_moe(family, layout, batches, options={"param_dtype": "bfloat16"})
    report(f"{name} bf16 vs fp32 loss", max_rel_diff(bf16["losses"], ref["losses"]), 1e-3)


def check_world1() -> None:
    for family, data in (("qwen3_moe", "packed"), ("gpt_oss", "pad")):
        batches = _on_device(make_batches(steps=5, micro=2, rows=4, seq=64, pad=data == "pad", packed=data == "packed"))
        ref = train_reference_moe(make_moe_model(family).to(DEVICE), batches)
        _compare(f"world-1 {family} {data}", family, {"dp_shard_size": 1}, batches, ref)


def _layouts(world: int) -> list[dict]:
    candidates = [
        dict(dp_shard_size=world, expert_parallel_size=world),
        dict(dp_shard_size=world // 2, tp_size=2, expert_parallel_size=world),
        dict(dp_replicate_size=2, dp_shard_size=world // 2, expert_parallel_size=world // 2),
        dict(dp_shard_size=world // 2, cp_size=2, expert_parallel_size=2),
    ]
    return [
        c
        for c in candidates
        if all(v >= 1 for v in c.values())
        and c.get("dp_replicate_size", 1) * c["dp_shard_size"] * c.get("cp_size", 1) * c.get("tp_size", 1) == world
    ]


def check_layouts() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batches = _on_device(make_batches(steps=5, micro=1, rows=8, seq=128, packed=True))
    ref = train_reference_moe(make_moe_model("qwen3_moe").to(DEVICE), batches)
    for layout in _layouts(world):
        short = {
            "dp_replicate_size": "r",
            "dp_shard_size": "s",
            "cp_size": "c",
            "tp_size": "t",
            "expert_parallel_size": "ep",
        }
        name = ",".join(f"{short[k]}{v}" for k, v in layout.items())
        _compare(f"{world} GPUs qwen3_moe {name}", "qwen3_moe", layout, batches, ref)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", action="store_true", help="expert-parallel layouts (under torchrun)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the checks' logic (no grouped kernel)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    import transformers

    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ndp.init_distributed(device_type=DEVICE.type)
    if args.layouts:
        check_layouts()
    else:
        check_grouped_kernel()
        check_world1()
    failures = [r for r in RESULTS if not r["ok"]]
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{len(failures)} failure(s)", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"moe_checks{'_layouts' if args.layouts else ''}.json").write_text(
            json.dumps(RESULTS, indent=2)
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
