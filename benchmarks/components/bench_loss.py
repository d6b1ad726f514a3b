"""The chunked cross-entropy (``ndparallel.loss.cross_entropy``) alone: time of forward + backward per kernel, and the
compiled loss against the eager one on the same logits.

    PYTHONPATH=src python3 benchmarks/components/bench_loss.py --tokens 8192 --vocab 128256

The logits of one 1B/3B step (8192 tokens, Llama 3's 128,256-token vocabulary) are 2.1 GB in bf16: the
loss's kernels are memory-bound, so the floor is reading them once in forward and once in backward and
writing the gradient once (6.3 GB; ~1.5 ms at the H200's ~4.3 TB/s).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from ndparallel.loss.cross_entropy import cross_entropy_sum


def _step(logits: torch.Tensor, labels: torch.Tensor, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().requires_grad_()
    loss = cross_entropy_sum(leaf, labels, compiled=compiled) / labels.numel()
    loss.backward()
    return loss.detach(), leaf.grad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, device="cuda", generator=gen) * 2).bfloat16()
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    labels[::7] = -100

    eager_loss, eager_grad = _step(logits, labels, compiled=False)
    for _ in range(2):  # compile, warm up
        loss, grad = _step(logits, labels, compiled=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.repeats):
        _step(logits, labels, compiled=True)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.repeats

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(logits, labels, compiled=True)
        torch.cuda.synchronize()
    kernels = sorted(
        ((e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0),
        key=lambda kv: -kv[1],
    )[:8]
    result = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "fwd_bwd_ms": ms,
        "loss_rel_diff_vs_eager": float((loss - eager_loss).abs() / eager_loss.abs()),
        "grad_max_abs_diff_vs_eager": float((grad.float() - eager_grad.float()).abs().max()),
        "grad_max_abs": float(eager_grad.float().abs().max()),
        "kernels_ms": {name[:90]: round(t, 3) for name, t in kernels},
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
