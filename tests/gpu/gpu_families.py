"""The dense families on GPU (CUDA kernels, NCCL), run by hand: not part of the CPU suite.

    python tests/gpu/gpu_families.py                                   # one GPU: every family, world 1
    torchrun --nproc-per-node 8 tests/gpu/gpu_families.py --layouts    # several GPUs: per-family layouts
    python tests/gpu/gpu_families.py --device cpu --families gemma2    # the same on CPU (a smoke test)

Each family (tests/family_configs.py) trains 5 steps on packed rows, against plain transformers on one
device in fp32 (TF32 off) with transformers' own document masks: fp32 within 1e-5, bf16 compute within
3e-3 of fp32 (the Gemma/Granite configs use larger inits than Llama's, so bf16 rounding shows more).
One line per check, PASS/FAIL; exits non-zero on any FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gpu_checks import FAILURES, _layouts_for, report  # noqa: E402
from support.scenarios import make_batches, make_model, max_rel_diff, model_config, train_parallel, train_reference  # noqa: E402

import ndparallel as ndp  # noqa: E402
from ndparallel.models.families import model_attention_reason  # noqa: E402

FAMILIES = ("gemma2", "gemma3", "phi3", "granite", "olmo2", "cohere", "glm", "glm4", "falcon", "qwen2")
EPS = 1e-4  # as tests/multirank/test_families.py (zero-initialized tensors)


def _check(family: str, layout: dict, batches, ref: dict, label: str) -> None:
    for dtype, bound in (("float32", 1e-5), ("bfloat16", 3e-3)):
        got = train_parallel(
            family, layout, batches, options={"param_dtype": None if dtype == "float32" else dtype}, eps=EPS
        )
        report(f"{family} {label} {dtype} loss", max_rel_diff(got["losses"], ref["losses"]), bound)
        if dtype == "float32":
            report(f"{family} {label} {dtype} grad norm", max_rel_diff(got["grad_norms"], ref["grad_norms"]), bound)
            if got["weights"] is not None:
                worst = max(
                    float((got["weights"][n].to(r.device) - r).norm() / r.norm().clamp(min=1e-12))
                    for n, r in ref["weights"].items()
                )
                report(f"{family} {label} {dtype} weights", worst, bound)


def _family_layouts(family: str, world: int) -> list[dict]:
    cp_ok = model_attention_reason(model_config(family)) is None
    return [layout for layout in _layouts_for(world) if cp_ok or layout.get("cp_size", 1) == 1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", action="store_true", help="every layout that fits the GPUs (under torchrun)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ndp.init_distributed(device_type=device.type)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for family in args.families.split(","):
        batches = make_batches(steps=5, micro=1, rows=8, seq=128, packed=True, seed=11)
        batches = [[{k: t.to(device) for k, t in mb.items()} for mb in step] for step in batches]
        ref = train_reference(make_model(family).to(device), batches, transformers_masks=True, eps=EPS)
        layouts = _family_layouts(family, world) if args.layouts else [{"dp_shard_size": 1}]
        for layout in layouts:
            sizes = [layout.get(f"{axis}_size", 1) for axis in ("dp_replicate", "dp_shard", "cp", "tp")]
            label = "r{}s{}c{}t{}".format(*sizes) + (f"-{layout['cp_comm_strategy']}" if sizes[2] > 1 else "")
            _check(family, layout, batches, ref, f"{world} dev {label}")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{len(FAILURES)} failure(s)", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
