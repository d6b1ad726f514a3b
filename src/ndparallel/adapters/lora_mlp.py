"""A LoRA-adapted SwiGLU MLP as two operators whose backward holds two of its wide tensors, not seven.

``down(silu(gate(x)) * up(x))`` with LoRA on all three linears (Llama, Mistral, Qwen2/3), written as modules,
keeps gate's and up's outputs, silu(gate) and the product (down's input, which down's adapter reads) for the
backward, and its backward then forms three gradients of the same width while they are alive: on the H200,
compiled, 7 tensors of (tokens x intermediate) at once (``planner/backward.py``), 784 MiB per 4,096 tokens
of an 8B, the largest transient of a LoRA step under full checkpointing. Here the forward keeps only gate's
and up's outputs (with LoRA added); the backward walks the rows in chunks, and per chunk forms down's input
gradient, then the product and the gradients of gate and up in one pointwise pass, and consumes them at once
(the adapters' gradients are summed over the chunks, in float32): two wide tensors plus one chunk's four.
The same GEMMs as the modules' path, no extra forward; a quantized base (``quantized/``) is dequantized
once per call, one weight at a time in forward, all three at once in backward.

The forward is two operators (gate/up, then the product and down), so that a checkpoint's recompute stops at
gate/up, as the modules' recompute does. As one operator (H200, 8B, 4,096 tokens, full checkpointing + offload,
compiled; RESULTS.md issue 35 session 12): 16.30 GiB and 10,454 tok/s against the modules' 17.17 GiB and 11,513,
the difference being down's GEMM in every recompute. Split (H100, same rows, session 13): bf16 base 10,749 tok/s
at 16.30 GiB against the modules' 10,977 at 17.17; NF4 base 9,110 at 6.98 against 10,516 at 7.53 (that gap is
not explained yet). Off by default (``ParallelOptions.fused_lora_mlp``, the config's ``fused_lora_mlp``).

Both directions are opaque operators (``torch.library``), so a compiled layer cannot rearrange what they hold;
their pointwise parts run through a ``torch.compile`` of their own when called from a compiled layer
(``quantized/fused.py``). Which MLPs qualify (``fusable_args``) is decided on every call: a sharded (DTensor) or
merged layer, another linear type (FP8, QAT), LoRA dropout or a bias take the modules' path.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.models.decoder import DecoderParts
from ndparallel.quantized import int8, nf4
from ndparallel.quantized.fused import compiled_if

SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
"""transformers MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
MIN_CHUNK_ROWS = 1024
"""Rows per backward chunk: at least this many (the GEMMs stay efficient), else an eighth of the rows (one
chunk's four wide tensors are half of one whole one)."""


def chunk_rows(rows: int) -> int:
    return max(MIN_CHUNK_ROWS, math.ceil(rows / 8))


def _silu_mul(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return F.silu(e) * g


def _silu_mul_backward(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor):
    """(h, de, dg) for h = silu(e) * g and h's gradient dh, in float32 inside, the inputs' dtype out."""
    ef = e.float()
    sig = torch.sigmoid(ef)
    silu = ef * sig
    dhf = dh.float()
    de = dhf * g.float() * sig * (1 + ef * (1 - sig))
    return (silu * g.float()).to(e.dtype), de.to(e.dtype), (dhf * silu).to(e.dtype)


def _weight(fmt: str, tensors: list[torch.Tensor], layout: list[int], shape: list[int], dtype, fused: bool):
    """The (out, in) weight in the compute dtype: the tensor itself, or dequantized."""
    if fmt == "int8":
        codes, scale = tensors
        return compiled_if(int8.dequantize, fused)(codes, scale, dtype)
    if fmt == "nf4":
        return nf4.dequantize_for(tensors, layout[0], layout[1], shape, fused).to(dtype)
    return tensors[0].to(dtype)


# The forward is two operators, so that a checkpoint's recompute runs only the first: the backward reads gate's
# and up's outputs, never down's, and the partitioner of a compiled checkpoint recomputes only what the backward
# reads. As one operator the recompute ran down's GEMM too: on the H200 (8B, session 12) 10,454 tok/s against
# the modules' 11,513. ``lora_gate_up`` computes (e, g) from detached inputs and has no gradient formula of its
# own: ``lora_swiglu_down`` takes x, the weights and all six adapters as well, and its backward returns the
# gradients of the whole MLP (x and the adapters) at once.
@torch.library.custom_op("ndparallel::lora_gate_up", mutates_args=())
def lora_gate_up(
    x: torch.Tensor,
    gate: list[torch.Tensor],
    up: list[torch.Tensor],
    fmt: str,
    layout: list[int],
    lora: list[torch.Tensor],
    scaling: float,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, g) = (gate(x), up(x)), each linear plus its adapter (``lora``: A, B of gate, then of up).
    ``layout``: [hidden, intermediate] (+ NF4's two block sizes)."""
    hidden, inter = layout[0], layout[1]
    x2 = x.reshape(-1, hidden)
    wide = []
    for tensors, (a, b) in ((gate, lora[0:2]), (up, lora[2:4])):
        w = _weight(fmt, tensors, layout[2:], [inter, hidden], x.dtype, fused)
        y = x2 @ w.t()
        del w
        wide.append(y.addmm_(x2 @ a.to(x.dtype).t(), b.to(x.dtype).t(), alpha=scaling).view(*x.shape[:-1], inter))
    return wide[0], wide[1]


@lora_gate_up.register_fake
def _(x, gate, up, fmt, layout, lora, scaling, fused):
    lead = x.shape[:-1]
    return x.new_empty((*lead, layout[1])), x.new_empty((*lead, layout[1]))


@torch.library.custom_op("ndparallel::lora_swiglu_down", mutates_args=())
def lora_swiglu_down(
    x: torch.Tensor,
    e: torch.Tensor,
    g: torch.Tensor,
    gate: list[torch.Tensor],
    up: list[torch.Tensor],
    down: list[torch.Tensor],
    fmt: str,
    layout: list[int],
    lora: list[torch.Tensor],
    scaling: float,
    fused: bool,
) -> torch.Tensor:
    """down(silu(e) * g) plus down's adapter (``lora``: A, B of gate, up, down), by row chunks. x, gate and up
    are read by the backward only (the gradient of the whole MLP)."""
    hidden, inter = layout[0], layout[1]
    e2, g2 = e.reshape(-1, inter), g.reshape(-1, inter)
    a_d, b_d = (t.to(e.dtype) for t in lora[4:6])
    w_d = _weight(fmt, down, layout[2:], [hidden, inter], e.dtype, fused)
    out = e2.new_empty(e2.shape[0], hidden)
    step = chunk_rows(e2.shape[0])
    for i in range(0, e2.shape[0], step):
        h = compiled_if(_silu_mul, fused)(e2[i : i + step], g2[i : i + step])
        torch.mm(h, w_d.t(), out=out[i : i + step])
        out[i : i + step].addmm_(h @ a_d.t(), b_d.t(), alpha=scaling)
    return out.view(*x.shape[:-1], hidden)


@lora_swiglu_down.register_fake
def _(x, e, g, gate, up, down, fmt, layout, lora, scaling, fused):
    return x.new_empty((*x.shape[:-1], layout[0]))


@torch.library.custom_op("ndparallel::lora_swiglu_mlp_backward", mutates_args=())
def lora_swiglu_mlp_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    e: torch.Tensor,
    g: torch.Tensor,
    gate: list[torch.Tensor],
    up: list[torch.Tensor],
    down: list[torch.Tensor],
    fmt: str,
    layout: list[int],
    lora: list[torch.Tensor],
    scaling: float,
    fused: bool,
) -> list[torch.Tensor]:
    """[x's gradient, then the gradients of the six adapter weights in ``lora``'s order]."""
    hidden, inter = layout[0], layout[1]
    dtype = x.dtype
    x2, e2, g2 = x.reshape(-1, hidden), e.reshape(-1, inter), g.reshape(-1, inter)
    dy = grad.reshape(-1, hidden).to(dtype)
    a_g, b_g, a_u, b_u, a_d, b_d = (t.to(dtype) for t in lora)
    w_g, w_u, w_d = (
        _weight(fmt, tensors, layout[2:], shape, dtype, fused)
        for tensors, shape in ((gate, [inter, hidden]), (up, [inter, hidden]), (down, [hidden, inter]))
    )
    rows, r = x2.shape[0], a_g.shape[0]
    dy_b = dy @ b_d  # (rows, r): down's adapter, B side, for every chunk
    low = {"g": x2 @ a_g.t(), "u": x2 @ a_u.t()}  # the adapters' A outputs (B's gradients read them)
    low["d"], low["de_b"], low["dg_b"] = (x2.new_empty(rows, r) for _ in range(3))
    sums = {
        name: torch.zeros(shape, dtype=torch.float32, device=x.device)
        for name, shape in (("a_d", (r, inter)), ("b_g", (inter, r)), ("b_u", (inter, r)))
    }
    dx = x2.new_empty(x2.shape)
    step = chunk_rows(rows)
    for i in range(0, rows, step):
        rs = slice(i, i + step)
        weights, adapters = (w_g, w_u, w_d), (a_d, b_g, b_u)
        _chunk_backward(dy[rs], e2[rs], g2[rs], dy_b[rs], rs, weights, adapters, scaling, low, sums, dx, fused)
    dx.addmm_(low["de_b"], a_g, alpha=scaling).addmm_(low["dg_b"], a_u, alpha=scaling)
    grads = [
        low["de_b"].t() @ x2,  # A of gate: (r, hidden)
        sums["b_g"],
        low["dg_b"].t() @ x2,
        sums["b_u"],
        sums["a_d"],
        dy.t() @ low["d"],  # B of down: (hidden, r)
    ]
    out = [dx.view(x.shape)]
    out += [(grad_sum.float() * scaling).to(param.dtype) for grad_sum, param in zip(grads, lora)]
    return out


def _chunk_backward(dy, e, g, dy_b, rs, weights, adapters, scaling: float, low, sums, dx, fused: bool) -> None:
    """One row chunk (``rs``) of the backward: down's input gradient, then the product h and the gradients of
    gate and up in one pointwise pass, consumed at once into the chunk's rows of ``dx`` and of the adapters' A
    outputs and gradient sums (``low``, ``sums``: written in place). At most four chunk-wide tensors live."""
    (w_g, w_u, w_d), (a_d, b_g, b_u) = weights, adapters
    dh = (dy @ w_d).addmm_(dy_b, a_d, alpha=scaling)
    h, de, dg = compiled_if(_silu_mul_backward, fused)(dh, e, g)
    del dh
    torch.mm(h, a_d.t(), out=low["d"][rs])
    sums["a_d"].add_(dy_b.t() @ h)
    del h
    torch.mm(de, b_g, out=low["de_b"][rs])
    torch.mm(dg, b_u, out=low["dg_b"][rs])
    sums["b_g"].add_(de.t() @ low["g"][rs])
    sums["b_u"].add_(dg.t() @ low["u"][rs])
    torch.mm(de, w_g, out=dx[rs])
    dx[rs].addmm_(dg, w_u)


@lora_swiglu_mlp_backward.register_fake
def _(grad, x, e, g, gate, up, down, fmt, layout, lora, scaling, fused):
    return [x.new_empty(x.shape)] + [t.new_empty(t.shape) for t in lora]


def _setup_context(ctx, inputs, output) -> None:
    x, e, g, gate, up, down, fmt, layout, lora, scaling, fused = inputs
    ctx.counts = (len(gate), len(up), len(down))
    ctx.save_for_backward(x, e, g, *gate, *up, *down, *lora)
    # ``fused`` as the forward was called: a backward is traced by AOTAutograd, not Dynamo, so
    # torch.compiler.is_compiling() reads False there (measured: the pointwise backward ran as a dozen eager
    # kernels, 23% off an 8B LoRA step on the H200)
    ctx.args = (fmt, layout, scaling, fused)


def _backward(ctx, grad):
    x, e, g, *rest = ctx.saved_tensors
    n_g, n_u, n_d = ctx.counts
    gate, up, down = rest[:n_g], rest[n_g : n_g + n_u], rest[n_g + n_u : n_g + n_u + n_d]
    lora = rest[n_g + n_u + n_d :]
    fmt, layout, scaling, fused = ctx.args
    dx, *d_lora = lora_swiglu_mlp_backward(
        grad, x, e, g, list(gate), list(up), list(down), fmt, layout, list(lora), scaling, fused
    )
    return dx, None, None, [None] * n_g, [None] * n_u, [None] * n_d, None, None, d_lora, None, None


lora_swiglu_down.register_autograd(_backward, setup_context=_setup_context)


def _base(linear: nn.Module) -> Optional[tuple[str, list[torch.Tensor], list[int]]]:
    """(format, tensors, NF4 block sizes) of a frozen base linear this operator can compute; None otherwise."""
    weight = linear.weight
    if linear.bias is not None or isinstance(weight, DTensor) or not hasattr(linear, "lora_A"):
        return None
    if type(linear) is nn.Linear:
        return "dense", [weight], []
    if type(linear) is int8.Int8Linear and not isinstance(linear.weight_scale, DTensor):
        return "int8", [weight, linear.weight_scale], []
    if type(linear) is nf4.Nf4Linear and nf4.is_nf4(weight):
        return "nf4", nf4.nf4_parts(weight), [weight.block_size, weight.scaler_block_size]
    return None


def fusable_args(mlp: nn.Module, x: torch.Tensor):
    """The operator's arguments after x for this MLP now, or None when it takes the modules' path."""
    if isinstance(x, DTensor):
        return None
    bases = [_base(getattr(mlp, name)) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(b is None for b in bases) or len({b[0] for b in bases}) != 1:
        return None
    lora = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(mlp, name)
        pair = (linear.lora_A.weight, linear.lora_B.weight)
        if any(isinstance(t, DTensor) for t in pair):
            return None
        lora += pair
    fmt = bases[0][0]
    layout = [x.shape[-1], mlp.gate_proj.weight.shape[0], *bases[0][2]]
    return [b[1] for b in bases], fmt, layout, lora


def _run(mlp: nn.Module, x: torch.Tensor, *, scaling: float) -> torch.Tensor:
    args = fusable_args(mlp, x)
    if args is None:
        return mlp(x)
    (gate, up, down), fmt, layout, lora = args
    fused = torch.compiler.is_compiling()
    plain = [t.detach() for t in lora[:4]]  # no gradient flows through (e, g): lora_swiglu_down's gives it all
    e, g = lora_gate_up(x.detach(), gate, up, fmt, layout, plain, scaling, fused)
    return lora_swiglu_down(x, e, g, gate, up, down, fmt, layout, lora, scaling, fused)


def _is_silu(mlp: nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def apply_lora_mlp(parts: DecoderParts, *, scaling: float, dropout: float) -> int:
    """Route each decoder layer's SwiGLU MLP through the operator (after LoRA, before checkpointing and
    compile); returns how many. Nothing with LoRA dropout (the operator has none)."""
    if dropout:
        return 0
    count = 0
    for layer in parts.layers:
        mlp = getattr(layer, "mlp", None)
        if type(mlp).__name__ not in SWIGLU_MLPS or not _is_silu(mlp):
            continue
        if not all(hasattr(getattr(mlp, n, None), "lora_A") for n in ("gate_proj", "up_proj", "down_proj")):
            continue
        # the wrapper's state_dict names stay mlp.* (as the tiled MLP's)
        layer.mlp = _compat.checkpoint_wrapper(mlp, checkpoint_fn=functools.partial(_run, scaling=scaling))
        count += 1
    return count
