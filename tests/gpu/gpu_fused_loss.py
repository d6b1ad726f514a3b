"""GPU checks of the long-row memory features (run by hand on a CUDA machine; results as JSON lines).

    python tests/gpu/gpu_fused_loss.py --out results.jsonl

1. The fused lm_head + cross-entropy (Triton kernels, and the torch path with a soft cap) against F.linear +
   F.cross_entropy on float32 logits, at the 1B's head (8,192 tokens, 2,048 hidden, 128,256 vocabulary, bf16):
   relative differences of the loss and of the hidden and weight gradients, against the bf16 unfused loss's
   own differences from the same float32 reference; time and peak memory of each.
2. Activation offload on the GPU (side-stream copies): a 4-layer 1B-shaped model, 2 steps at 16,384 tokens
   with and without offload (and with the tiled MLP): losses and gradient norms.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import ndparallel as ndp
from ndparallel.loss.cross_entropy import cross_entropy_sum
from ndparallel.loss.fused import LogitTransform, linear_cross_entropy_sum


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _timed(fn, repeat: int = 5):
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / repeat * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30


def loss_check(emit) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 8192, 2048, 128256
    x = (torch.randn(n, h, device="cuda", generator=g) * 1.0).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::7] = -100
    for name, transform in (("plain", LogitTransform()), ("softcap", LogitTransform(softcap=30.0))):
        y = F.linear(x.float(), w.float()) * transform.scale
        if transform.softcap:
            y = torch.tanh(y / transform.softcap) * transform.softcap
        ref = F.cross_entropy(y, labels, reduction="sum", ignore_index=-100)
        ref_gx, ref_gw = torch.autograd.grad(ref, [x, w])
        del y

        def fused():
            loss = linear_cross_entropy_sum(x, w, labels, transform=transform, kernels=True)
            return (loss, *torch.autograd.grad(loss, [x, w]))

        def unfused():
            logits = F.linear(x, w)
            if transform.softcap:
                logits = torch.tanh(logits / transform.softcap) * transform.softcap
            loss = cross_entropy_sum(logits, labels, compiled=True)
            return (loss, *torch.autograd.grad(loss, [x, w]))

        for label, fn in (("fused", fused), ("unfused", unfused)):
            (loss, gx, gw), ms, gib = _timed(fn)
            emit(
                {
                    "check": "loss",
                    "transform": name,
                    "path": label,
                    "loss_rel": abs(float(loss) - float(ref)) / abs(float(ref)),
                    "grad_hidden_rel": _rel(gx, ref_gx),
                    "grad_weight_rel": _rel(gw, ref_gw),
                    "ms": round(ms, 2),
                    "extra_peak_gib": round(gib, 2),
                }
            )


def offload_check(emit) -> None:
    from ndparallel.train.loop import forward_backward
    from ndparallel.weights.materialize import materialize
    from ndparallel.weights.meta import meta_model, model_config_for

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    config = model_config_for(base_model=None, model_shape="1b", overrides={"num_hidden_layers": 4})
    length = 16384
    for name, extra in (
        ("full", {}),
        ("offload", {"activation_offload_layers": 3}),
        ("offload+tiled", {"activation_offload_layers": 3, "tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    ):
        model = meta_model(config)
        options = ndp.ParallelOptions(activation_checkpointing="full", compile=True, **extra)
        ndp.parallelize(model, topo, options=options)
        materialize(model, topo.device, weights_dir=None, seed=0)
        model.train()
        opt = ndp.build_optimizer(model, lr=1e-4, weight_decay=0.0, master_grads=False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        losses, norms = [], []
        for step in range(3):
            ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(step))
            batch = ndp.prepare_batch(topology=topo, input_ids=ids, position_ids=(torch.arange(length) % 4096)[None])
            loss, _ = forward_backward(model, [batch], topo, compiled_loss=True)
            norms.append(float(ndp.clip_grad_norm_(trainable, 1.0, optimizer=opt)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        emit({"check": "offload", "run": name, "losses": losses, "grad_norms": norms})
        del model, opt, trainable
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    loss_check(emit)
    offload_check(emit)


if __name__ == "__main__":
    main()
