"""Expert matmuls on one GPU: transformers' loop over experts against grouped matmuls, Qwen3-MoE shapes.

    PYTHONPATH=src python3 benchmarks/components/bench_moe.py --out $OUT  # one H200: Qwen3-30B-A3B shapes, ~2 min
    PYTHONPATH=src python3 benchmarks/components/bench_moe.py --tiny --device cpu   # smoke run (tiny shapes)

Part 1, one MoE block (Qwen3MoeSparseMoeBlock: hidden 2048, 128 experts of intermediate 768, top-8), forward +
backward of T tokens in bf16, through each experts implementation:

    eager        transformers' loop over the experts hit (the dense-loop baseline)
    grouped_mm   transformers' own grouped implementation
    ndparallel   ndparallel's experts function (what parallelize selects; ep = 1 here): tokens sorted by expert,
                 one ``_compat.grouped_mm`` per projection

Each is checked against the same block in float32 (eager): the relative error of the output and of the input
and weight gradients, which for bf16 should be of the order of 1e-2 and alike for all three.

Part 2, a training step of a 2-layer Qwen3-MoE-shaped model (same block, 32 heads, vocab 151,936) through
``ndparallel.parallelize`` on one GPU (bf16 compute, fp32 master weights, AdamW), seq 4096 x 2: tokens/s with
ndparallel's grouped experts and with transformers' eager loop (selected after parallelize).

Prints a table and writes ``bench_moe.json`` under --out (default $OUT, else the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import ndparallel as ndp

SHAPES = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        intermediate_size=6144,
    ),
    "tiny": dict(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        intermediate_size=128,
    ),
}
IMPLEMENTATIONS = ("eager", "grouped_mm", "ndparallel")


def _config(shape: str, layers: int, **overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **{**SHAPES[shape], **overrides}, num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=8192
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build(config, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs (a CPU init of 10^9 weights takes minutes)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _select(model, name: str) -> None:
    if name == "ndparallel":
        from ndparallel.models.moe_experts import ensure_ndparallel_experts

        ensure_ndparallel_experts(model)
    else:
        model.set_experts_implementation(name)


def _block_pass(block, x):
    """Forward + backward of one MoE block; returns (output, input grad, expert weight grads)."""
    x = x.detach().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    out = block(x)
    out.float().square().mean().backward()
    weight_grads = torch.cat([p.grad.float().flatten() for p in block.experts.parameters()])
    return out.detach().float(), x.grad.float(), weight_grads


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def bench_block(shape: str, tokens: int, device, iters: int) -> list[dict]:
    config = _config(shape, 1, vocab_size=1024)  # the block alone: the vocabulary does not matter
    x32 = torch.randn(1, tokens, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    ref_model = _build(config, device, torch.float32)
    ref_model.set_experts_implementation("eager")
    reference = _block_pass(ref_model.model.layers[0].mlp, x32)
    del ref_model
    rows = []
    for name in IMPLEMENTATIONS:
        model = _build(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        _select(model, name)
        block = model.model.layers[0].mlp
        x = x32.to(next(block.parameters()).dtype)
        got = _block_pass(block, x)
        errors = [_rel(g, r) for g, r in zip(got, reference)]
        for _ in range(2):
            _block_pass(block, x)
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            _block_pass(block, x)
        _sync(device)
        ms = (time.perf_counter() - start) / iters * 1e3
        rows.append(
            {
                "part": "block",
                "impl": name,
                "tokens": tokens,
                "ms_fwd_bwd": ms,
                "err_out": errors[0],
                "err_grad_in": errors[1],
                "err_grad_w": errors[2],
            }
        )
        del model, block
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_step(shape: str, layers: int, seq: int, micro: int, device, steps: int) -> list[dict]:
    config = _config(shape, layers)
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1), device_type=device.type)
    rows = []
    for name in ("ndparallel", "eager"):
        model = _build(config, device, torch.float32).train()
        bf16 = device.type == "cuda"
        ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype="bfloat16" if bf16 else None))
        if name == "eager":
            model.set_experts_implementation("eager")
        optimizer = ndp.build_optimizer(model, lr=1e-4)
        times = []
        for step in range(steps + 2):
            ids = torch.randint(0, config.vocab_size, (micro, seq), generator=torch.Generator().manual_seed(step))
            _sync(device)
            start = time.perf_counter()
            batch = ndp.prepare_batch(ids, topo)
            n = ndp.count_tokens(batch.num_tokens, topo)
            out = model(**batch.model_inputs())
            loss = ndp.token_loss(out.logits, batch.labels, num_tokens=n, topology=topo)
            loss.backward()
            ndp.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - start)
        step_s = sum(times[2:]) / steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        rows.append(
            {
                "part": "step",
                "impl": name,
                "tokens_per_s": micro * seq / step_s,
                "step_s": step_s,
                "loss": float(loss.detach()),
                "peak_gib": peak,
            }
        )
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="tokens through the block (default 16384; tiny 256)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = "tiny" if args.tiny else "qwen3-30b-a3b"
    tokens = args.tokens or (256 if args.tiny else 16384)
    seq, micro = (64, 2) if args.tiny else (4096, 2)
    rows = bench_block(shape, tokens, device, args.iters)
    rows += bench_step(shape, 2, seq, micro, device, args.steps)
    base = {r["part"]: r for r in rows if r["impl"] == "eager"}
    print(f"{'part':6s} {'impl':11s} {'time':>12s} {'vs eager':>9s} {'err out':>9s} {'err dx':>9s} {'err dW':>9s}")
    for r in rows:
        if r["part"] == "block":
            speed = base["block"]["ms_fwd_bwd"] / r["ms_fwd_bwd"]
            print(
                f"block  {r['impl']:11s} {r['ms_fwd_bwd']:9.2f} ms {speed:8.2f}x {r['err_out']:9.1e} "
                f"{r['err_grad_in']:9.1e} {r['err_grad_w']:9.1e}"
            )
        else:
            speed = r["tokens_per_s"] / base["step"]["tokens_per_s"]
            print(
                f"step   {r['impl']:11s} {r['tokens_per_s']:7.0f} tok/s {speed:8.2f}x   loss {r['loss']:.4f}"
                + (f"   peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "")
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_moe.json").write_text(json.dumps({"device": str(device), "shape": shape, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
