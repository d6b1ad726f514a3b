"""Does FlashAttention's variable-length kernel (the one packed rows run on CUDA) still compute right when a
row's query tensor holds more than 2^31 elements?

    PYTHONPATH=src python3 benchmarks/diagnostics/varlen_int32_diag.py --out $OUT     # one GPU, ~3-4 min

Why: the 1B (32 heads x 64) trained a 1,048,576-token packed row (2^31 query elements exactly) but died with a
C++ error, not out of memory, at 1,572,864 (3.2e9). FlashAttention 2 computes some offsets in 32-bit integers
(its maintainers say so for tensors past 2-4 GB), and PyTorch's varlen kernel is FlashAttention 2. This runs
the varlen forward and backward two ways, ``kernel`` (one raw call, ``_compat.varlen_attention_forward/backward``)
and ``ndparallel`` (the planned call through ``varlen.call_forward/backward``, which splits calls above
``varlen.MAX_KERNEL_ELEMENTS`` into kernel calls over groups of documents), at the 1B's head
shape over rows of 4,096-token documents of growing total length, each in a process of its own (a CUDA error
poisons the process), and compares the first and the last document's output and gradients with SDPA on that
document alone. One JSON line per length: ok, the worst relative error, or the exception's line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ndparallel.testing.child_errors import failure_line

H, KV, D, DOC = 32, 8, 64, 4096


def _reference(q, k, v, grad, doc: slice):
    """Output and (dq, dk, dv) of one document through SDPA, in float32."""
    leaves = [t[doc].float().transpose(0, 1).detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(grad[doc].float().transpose(0, 1))
    return out.transpose(0, 1), [t.grad.transpose(0, 1) for t in leaves]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp(min=1e-30))


def _last_rows_reference(q, k, v, grad, rows: int = 64):
    """Output and dq of the last ``rows`` queries of ONE causal document spanning the whole row, in float32,
    head by head (their keys are all the row's keys: no (L x L) tensor)."""
    outs, dqs = [], []
    for h in range(q.shape[1]):
        qh = q[-rows:, h].float().detach().requires_grad_()
        kh, vh = k[:, h // (H // KV)].float(), v[:, h // (H // KV)].float()
        scores = (qh @ kh.t()) * D**-0.5
        keys = torch.arange(k.shape[0], device=q.device)
        future = keys[None] > keys[-rows:, None]
        out = torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ vh
        out.backward(grad[-rows:, h].float())
        outs.append(out.detach())
        dqs.append(qh.grad)
    return torch.stack(outs, 1), torch.stack(dqs, 1)


def _run(q, k, v, grad, path: str, doc: int):
    """(out, (dq, dk, dv)) through one raw kernel call or ndparallel's planned call."""
    from ndparallel import _compat

    tokens, dev = q.shape[0], q.device
    if path.startswith("kernel"):  # one kernel call over the whole row
        cu = torch.arange(0, tokens + 1, doc, device=dev, dtype=torch.int32)
        common = dict(causal=True, window_left=-1, scale=D**-0.5)
        out, lse = _compat.varlen_attention_forward(q, k, v, cu, cu, doc, doc, **common)
        return out, _compat.varlen_attention_backward(grad, q, k, v, out, lse, cu, cu, doc, doc, **common)
    from ndparallel.parallel.attention import plan, varlen  # split into calls of <= MAX_KERNEL_ELEMENTS

    segments = (torch.arange(tokens) // doc)[None]
    side = plan.Side(0, tokens, tokens, 0)
    pieces = plan.block_pieces(plan.find_documents(segments), side, side, None)
    (call,) = plan.make_calls(pieces, causal=True, num_keys=tokens, device=dev)
    out, lse = varlen.call_forward(q, k, v, call, D**-0.5)
    return out, varlen.call_backward(grad, q, k, v, out, lse, call, D**-0.5)


def check(tokens: int, path: str) -> dict:
    """``path``: kernel / ndparallel over 4,096-token documents; kernel-1doc / ndparallel-1doc over one document."""
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the ndparallel paths only
    q = torch.randn(tokens, H, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, KV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(q)
    one_doc = path.endswith("-1doc")
    out, grads = _run(q, k, v, grad, path, tokens if one_doc else DOC)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    first = slice(0, DOC)  # the first DOC queries see only the first DOC keys either way: out and dq
    ref_out, ref_grads = _reference(q, k, v, grad, first)
    worst = max(_relative(out[first], ref_out), _relative(grads[0][first], ref_grads[0]))
    if one_doc:  # the last queries against every key
        ref_out, ref_dq = _last_rows_reference(q, k, v, grad)
        worst = max(worst, _relative(out[-64:], ref_out), _relative(grads[0][-64:], ref_dq))
    else:  # the last document alone, gradients of its keys too
        last = slice(tokens - DOC, tokens)
        ref_out, ref_grads = _reference(q, k, v, grad, last)
        worst = max(worst, _relative(out[last], ref_out))
        worst = max(worst, *(_relative(g[last], r) for g, r in zip(grads, ref_grads)))
    result = {"path": path, "tokens": tokens, "q_elements": tokens * H * D, "ok": worst < 2e-2}
    return result | {"worst_relative_error": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1048576,1572864,2097152")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--paths",
        default="kernel,ndparallel,kernel-1doc,ndparallel-1doc",
        help="kernel: one raw call; ndparallel: call_forward; -1doc: one document per row",
    )
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(check(int(args.one[0]), args.one[1])))
        return
    for tokens in (int(n) for n in args.lengths.split(",")):
        for path in args.paths.split(","):
            _one(tokens, path, args.out)


def _one(tokens: int, path: str, out: Path | None) -> None:
    """One (length, path) in a process of its own: a CUDA error poisons the process that meets it."""
    proc = subprocess.run([sys.executable, __file__, "--one", str(tokens), path], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        result = json.loads(lines[-1])
    else:
        result = {"path": path, "tokens": tokens, "ok": False, "error": failure_line(proc.stderr)}
    print(json.dumps(result), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "varlen_int32_diag.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
