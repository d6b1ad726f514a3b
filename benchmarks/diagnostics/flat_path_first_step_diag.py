"""Which tensor differs first between the one-rank flat path and FSDP2 on one rank (GPU, SDPA math kernel).

    PYTHONPATH=src python benchmarks/diagnostics/flat_path_first_step_diag.py

One step of the small Llama of ``gpu_perf_checks.py`` on each path, same data and seed; per tensor the
relative difference of the initial weights, the fp32 gradients after backward and the weights after the
optimizer step. Measured on the H200 (2026-12-01): initial weights and gradients identical bit for bit,
weights after the step 4.7e-8 (the two AdamW kernels round float32 in another order). This is what
explained ``gpu_perf_checks``' weights-after-2-steps failure (3e-4): drift from step 2 on, not the paths.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import ndparallel as ndp
from ndparallel.train.loop import forward_backward
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_perf_checks import SMALL  # noqa: E402

OVERRIDES = {**SMALL, "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024, "head_dim": 32}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def one_step(topo, ids: torch.Tensor, single_rank_fsdp: bool) -> dict:
    config = model_config_for(base_model=None, model_shape="tiny", overrides=OVERRIDES, max_position_embeddings=256)
    model = meta_model(config)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(single_rank_fsdp=single_rank_fsdp))
    materialize(model, topo.device, weights_dir=None, seed=0)
    model.train()
    opt = ndp.build_optimizer(model, lr=1e-3, weight_decay=0.1, eps=1e-5)
    init = {k: _full(v) for k, v in model.state_dict().items()}
    with sdpa_kernel([SDPBackend.MATH]):
        loss, _ = forward_backward(model, [ndp.prepare_batch(ids, topo)], topo)
    grads = {name: _full(p.grad) for name, p in model.named_parameters()}
    ndp.clip_grad_norm_(list(model.parameters()), 1.0, optimizer=opt)
    opt.step()
    after = {k: _full(v) for k, v in model.state_dict().items()}
    return {"loss": float(loss), "init": init, "grad": grads, "after": after}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main() -> int:
    ndp.init_distributed(device_type="cuda")
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1), device_type="cuda")
    ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(0))
    flat, fsdp = one_step(topo, ids, False), one_step(topo, ids, True)
    print(f"loss: flat {flat['loss']:.8f}, fsdp {fsdp['loss']:.8f}")
    for name, ref in fsdp["init"].items():
        grad = _rel(flat["grad"][name], fsdp["grad"][name]) if name in fsdp["grad"] else float("nan")
        print(
            f"{name:48s} init {_rel(flat['init'][name], ref):.1e}  grad {grad:.1e}  "
            f"after {_rel(flat['after'][name], fsdp['after'][name]):.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
