"""Context-parallel attention equals full attention, forward and backward, for every method (and cp = 1).

Each rank holds its load-balanced part of q, k, v; the outputs and gradients, gathered back into row
order, are compared with plain attention over the whole row in one process (float64 reference). The
"sinks" kind adds a learned logit per head for a key with value 0 (gpt-oss), with its gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ndparallel as ndp
from ndparallel.parallel.attention.cp_methods import context_attention
from ndparallel.parallel.context import build_attention_context
from ndparallel.parallel.sequence import segment_ids_from
from ndparallel.testing.ranks import run_ranks

B, H, S, D = 2, 8, 64, 16
DATA_KINDS = ("causal", "padded", "packed", "gqa", "window", "sinks")


def _inputs(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hkv = 2 if kind in ("gqa", "packed") else H
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, hkv, S, D, generator=g)
    v = torch.randn(B, hkv, S, D, generator=g)
    grad = torch.randn(B, H, S, D, generator=g)
    pos = torch.arange(S).expand(B, S).clone()
    padding = None
    if kind == "padded":  # right padding of different lengths; row 1 pads its last 40 tokens
        padding = torch.zeros(B, S, dtype=torch.bool)
        padding[0, 50:] = True
        padding[1, 24:] = True
    if kind == "packed":  # documents of uneven lengths; boundaries fall inside chunks and on chunk edges
        for row, cuts in enumerate(([5, 16, 40], [31, 32, 33, 60])):
            start = 0
            for end in [*cuts, S]:
                pos[row, start:end] = torch.arange(end - start)
                start = end
    if kind == "sinks":  # packed rows with sinks
        pos[:, 20:] = torch.arange(S - 20)
    window = 12 if kind == "window" else None
    return q, k, v, grad, segment_ids_from(pos, padding), window


def _sinks(kind: str):
    return torch.linspace(-1.0, 2.0, H) if kind == "sinks" else None


def _reference(q, k, v, grad, segments, window, sinks=None):
    """Plain attention over the whole row, float64, with the same mask semantics (and sink logits)."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    rep = H // k.shape[1]
    kk, vv = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    i = torch.arange(S)
    allowed = (segments[:, :, None] == segments[:, None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    scores = (qd @ kk.transpose(-1, -2)) * D**-0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is None:
        out = torch.softmax(scores, -1) @ vv
        out.backward(grad.double())
        return out.detach(), qd.grad, kd.grad, vd.grad
    sd = sinks.double().requires_grad_()
    with_sink = torch.cat([scores, sd[None, :, None, None].expand(B, H, S, 1)], dim=-1)
    out = torch.softmax(with_sink, -1)[..., :-1] @ vv
    out.backward(grad.double())
    return out.detach(), qd.grad, kd.grad, vd.grad, sd.grad


def _run_cp(method: str, cp: int) -> dict:
    method = "allgather" if method == "local" else method
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1, cp_size=cp, cp_comm_strategy=method))
    results = {}
    for kind in DATA_KINDS:
        q, k, v, grad, segments, window = _inputs(kind)
        shard = dict(cp=cp, cp_rank=topo.cp_rank, dim=2)
        ql, kl, vl = (ndp.cp_shard(t, **shard).clone().requires_grad_() for t in (q, k, v))
        ctx = build_attention_context(segments, topo)
        sinks = _sinks(kind)
        if sinks is not None:
            sinks.requires_grad_()
        out = context_attention(ql, kl, vl, ctx, scale=D**-0.5, window=window, sinks=sinks).transpose(1, 2)
        out.backward(ndp.cp_shard(grad, **shard))  # out is (B, H, L, D) again
        results[kind] = [ndp.cp_gather(t.detach(), topo, dim=2) for t in (out, ql.grad, kl.grad, vl.grad)]
        if sinks is not None:  # each rank holds its rows' (or heads') share, summed as FSDP sums gradients
            if cp > 1:
                dist.all_reduce(sinks.grad, group=topo.cp.get_group())
            results[kind].append(sinks.grad)
    return results


@pytest.mark.parametrize(
    "method, cp", [("local", 1), *((m, c) for m in ("allgather", "ring", "alltoall") for c in (2, 4))]
)
def test_cp_attention_equals_full_attention(method, cp, parity_record):
    got = run_ranks(cp, _run_cp, method, cp)[0]
    worst = {}
    for kind in DATA_KINDS:
        q, k, v, grad, segments, window = _inputs(kind)
        want = _reference(q, k, v, grad, segments, window, _sinks(kind))
        for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got[kind], want):
            err = float((g.double() - w).norm() / w.norm())
            worst[f"{kind}:{name}"] = err
            assert err < 1e-5, f"{method} cp={cp} {kind}: {name} differs by {err:.2e}"
    top = max(worst, key=worst.get)
    parity_record({"attention": worst[top]})
