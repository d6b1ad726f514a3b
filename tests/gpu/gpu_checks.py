"""GPU correctness checks (CUDA + NCCL), run by hand on a GPU machine: not part of the CPU suite.

    python tests/gpu/gpu_checks.py                 # one GPU: kernels and world-1 training parity
    torchrun --nproc-per-node 8 tests/gpu/gpu_checks.py --layouts   # several GPUs: the layout matrix

Prints one line per check with the measured difference and PASS/FAIL; exits non-zero on any FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from support.scenarios import make_batches, make_model, max_rel_diff, train_parallel, train_reference  # noqa: E402

import ndparallel as ndp  # noqa: E402
from ndparallel import _compat  # noqa: E402
from ndparallel.parallel.attention.simulate import whole_rows  # noqa: E402
from ndparallel.parallel.sequence import segment_ids_from  # noqa: E402

FAILURES: list[str] = []


def report(name: str, value: float, bound: float) -> None:
    ok = value <= bound
    if not ok:
        FAILURES.append(name)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{'PASS' if ok else 'FAIL'}  {name:70s} {value:.2e} (bound {bound:.0e})", flush=True)


def _math(q, k, v, bias, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.double(), lse


def check_kernels(device: torch.device) -> None:
    """The private fused kernels in _compat against float64 math, forward (out, lse) and backward."""
    for dtype, bound in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-4)):
        for kind in ("full", "causal", "masked"):
            torch.manual_seed(0)
            b, h, lq, lk, d = 2, 4, 128, 128, 64
            q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for n in (lq, lk, lk))
            bias = None
            if kind == "masked":
                allowed = torch.rand(b, 1, lq, lk, device=device) > 0.3
                allowed[..., 0] = True
                bias = torch.zeros(b, 1, lq, lk, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))
            scale = d**-0.5
            out, lse = _compat.attention_forward_with_lse(q, k, v, bias=bias, is_causal=kind == "causal", scale=scale)
            ref_out, ref_lse = _math(q, k, v, bias, kind == "causal", scale)
            err = float((out.double() - ref_out).norm() / ref_out.norm())
            report(f"kernel fwd {dtype} {kind} out", err, bound)
            report(f"kernel fwd {dtype} {kind} lse", float((lse.double() - ref_lse).abs().max()), bound * 10)
            grad = torch.randn_like(out)
            dq, dk, dv = _compat.attention_backward(
                grad, q, k, v, out, lse, bias=bias, is_causal=kind == "causal", scale=scale
            )
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            o, _ = _math(qd, kd, vd, bias, kind == "causal", scale)
            o.backward(grad.double())
            for name, got, want in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
                report(f"kernel bwd {dtype} {kind} {name}", float((got.double() - want).norm() / want.norm()), bound)


def _document_rows(kind: str, batch: int, seq: int, g: torch.Generator):
    """Position ids and padding of rows for the document-attention checks."""
    pos = torch.empty(batch, seq, dtype=torch.long)
    padding = torch.zeros(batch, seq, dtype=torch.bool)
    for row in range(batch):
        if kind == "short-docs":  # many documents of 1-40 tokens, several of length 1
            lengths = torch.randint(1, 41, (seq,), generator=g).tolist()
        elif kind == "long-docs":  # documents longer than a CP chunk (seq / 8 at cp 4)
            lengths = [seq * 5 // 8 + 3 * row, seq]
        else:  # "padded" and "window": documents of 50-400 tokens
            lengths = torch.randint(50, 401, (seq,), generator=g).tolist()
        start = 0
        for n in lengths:
            end = min(seq, start + n)
            pos[row, start:end] = torch.arange(end - start)
            start = end
            if start == seq:
                break
        if kind == "padded":
            padding[row, seq - 77 - 100 * row :] = True
    return segment_ids_from(pos, padding)


def _reference_attention(q, k, v, grad, segments, window, scale):
    """float64 attention over whole rows (B, S, h, D) with the document / padding / window rule."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kk, vv = kd.repeat_interleave(rep, 2), vd.repeat_interleave(rep, 2)
    i = torch.arange(q.shape[1], device=q.device)
    seg = segments.to(q.device)
    allowed = (seg[:, :, None] == seg[:, None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kk) * scale
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1), vv)
    out.backward(grad.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def check_document_attention(device: torch.device) -> None:
    """The planned variable-length attention of every method (one process; each cp rank's share with its
    communication replaced by local tensors) against float64: packed rows with many short documents,
    documents longer than a chunk, padding, a sliding window; grouped heads; head dims 8 and 128."""
    batch, seq = 2, 1024
    for dtype, bound in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        for heads, kv_heads, head_dim in ((8, 2, 8), (8, 2, 128), (4, 4, 64)):
            for kind in ("short-docs", "long-docs", "padded", "window"):
                g = torch.Generator().manual_seed(0)
                segments = _document_rows(kind, batch, seq, g)
                window = 100 if kind == "window" else None
                q, grad = (torch.randn(batch, seq, heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
                k, v = (torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
                scale = head_dim**-0.5
                want = _reference_attention(q, k, v, grad, segments, window, scale)
                real = (segments != -1).to(device)[:, :, None, None]  # padding rows' outputs are never read
                for method, cps in (("allgather", (1, 2, 4)), ("ring", (2, 4)), ("alltoall", (2,))):
                    for cp in cps:
                        got = whole_rows(q, k, v, grad, segments, cp=cp, method=method, scale=scale, window=window)
                        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                            if name in ("out", "dq"):
                                a, b = a * real, b * real
                            err = float((a.double() - b).norm() / b.norm())
                            report(
                                f"doc attention {dtype} h{heads}/{kv_heads}x{head_dim} {kind} {method} cp{cp} {name}",
                                err,
                                bound,
                            )


def check_world1_parity() -> None:
    """ndparallel on one GPU (NCCL group of one) against plain PyTorch on the same GPU, fp32 and bf16."""
    for data in ("pad", "packed"):
        for family in ("llama", "qwen3", "mistral"):
            batches = make_batches(steps=5, micro=2, rows=4, seq=64, pad=data == "pad", packed=data == "packed")
            batches = [[{k: t.cuda() for k, t in mb.items()} for mb in step] for step in batches]
            ref = train_reference(make_model(family).cuda(), batches)
            got = train_parallel(family, {"dp_shard_size": 1}, batches)
            report(f"world-1 parity {family} {data} fp32 loss", max_rel_diff(got["losses"], ref["losses"]), 1e-5)
            report(
                f"world-1 parity {family} {data} fp32 grad norm",
                max_rel_diff(got["grad_norms"], ref["grad_norms"]),
                1e-5,
            )
            worst = max(float((got["weights"][n].cuda() - r).norm() / r.norm()) for n, r in ref["weights"].items())
            report(f"world-1 parity {family} {data} fp32 weights", worst, 1e-5)
            bf16 = train_parallel(family, {"dp_shard_size": 1}, batches, options={"param_dtype": "bfloat16"})
            report(f"world-1 bf16 vs fp32 {family} {data} loss", max_rel_diff(bf16["losses"], ref["losses"]), 1e-3)


def _layouts_for(world: int) -> list[dict]:
    """The CPU parity matrix's kinds of layout that fit ``world`` GPUs (FSDP, HSDP, TP, CP x 3 methods, mixes)."""
    candidates = [
        dict(dp_shard_size=world),
        dict(dp_replicate_size=2, dp_shard_size=world // 2),
        dict(dp_shard_size=world // 2, tp_size=2),
        dict(dp_replicate_size=2, dp_shard_size=1, tp_size=world // 2),
        *(dict(dp_shard_size=world // 2, cp_size=2, cp_comm_strategy=m) for m in ("allgather", "ring", "alltoall")),
        dict(dp_shard_size=world // 4, cp_size=2, tp_size=2, cp_comm_strategy="ring"),
        dict(dp_replicate_size=2, dp_shard_size=world // 8, cp_size=2, tp_size=2, cp_comm_strategy="allgather"),
        dict(cp_size=world, dp_shard_size=1, cp_comm_strategy="ring"),
    ]
    out = []
    for layout in candidates:
        sizes = [layout.get(k, 1) for k in ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")]
        if all(x >= 1 for x in sizes) and sizes[0] * sizes[1] * sizes[2] * sizes[3] == world and layout not in out:
            out.append(layout)
    return out


# bf16 unit roundoff (8 significand bits): the bounds of a bf16 run against the fp32 reference are set in
# units of it. The weight check compares the UPDATE (final - initial weights): a run that does not train
# has update error 1 and fails every bound below.
BF16_U = 2.0**-8
BOUNDS = {
    "float32": {"loss": 1e-5, "grad_norm": 1e-5, "update": 1e-4},
    "bfloat16": {"loss": 2 * BF16_U, "grad_norm": 5 * BF16_U, "update": 25 * BF16_U},
}


def _update_error(got: dict, ref: dict, init: dict) -> tuple[float, str]:
    """Largest over tensors of |(got - init) - (ref - init)| / |ref - init| (Frobenius)."""
    worst, where = 0.0, ""
    for name, r in ref.items():
        step = r.double() - init[name].double()
        err = float((got[name].to(r.device).double() - r.double()).norm() / step.norm().clamp(min=1e-30))
        if err > worst:
            worst, where = err, name
    return worst, where


def check_layouts(families=("llama", "qwen3", "mistral")) -> None:
    """Every layout that fits the GPUs against one GPU on the same data (each rank computes the reference):
    losses, gradient norms and the weight update, in fp32 and bf16, padded and packed rows."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for family in families:
        for data in ("pad", "packed"):
            batches = make_batches(steps=5, micro=1, rows=8, seq=128, pad=data == "pad", packed=data == "packed")
            batches = [[{k: t.cuda() for k, t in mb.items()} for mb in step] for step in batches]
            model = make_model(family).cuda()
            init = {k: v.detach().clone() for k, v in model.state_dict().items()}
            ref = train_reference(model, batches)  # one GPU, fp32, plain PyTorch
            for dtype, bound in BOUNDS.items():
                options = {"param_dtype": None if dtype == "float32" else "bfloat16"}
                for layout in _layouts_for(world):
                    got = train_parallel(family, layout, batches, options=options)
                    sizes = ",".join(f"{key.split('_')[0]}{value}" for key, value in layout.items())
                    name = f"{world} GPUs {sizes} {family} {data} {dtype}"
                    report(f"{name} loss", max_rel_diff(got["losses"], ref["losses"]), bound["loss"])
                    report(f"{name} grad norm", max_rel_diff(got["grad_norms"], ref["grad_norms"]), bound["grad_norm"])
                    if rank == 0:
                        err, where = _update_error(got["weights"], ref["weights"], init)
                        report(f"{name} update ({where})", err, bound["update"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--layouts", action="store_true", help="the multi-GPU parity matrix (under torchrun)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {torch.cuda.get_device_name()}", flush=True)
    import transformers

    print(f"transformers {transformers.__version__}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ndp.init_distributed(device_type="cuda")
    if args.layouts:
        check_layouts()
        print(f"{len(FAILURES)} failure(s)", flush=True)
        return 1 if FAILURES else 0
    if not args.skip_kernels:
        check_kernels(torch.device("cuda"))
        check_document_attention(torch.device("cuda"))
    check_world1_parity()
    print(f"{len(FAILURES)} failure(s)", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
