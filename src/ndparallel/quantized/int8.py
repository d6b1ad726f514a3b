"""LoRA on 8-bit base weights (``load_in_8bit: true``, ``adapter: lora``): int8 codes, one scale per row.

The format is LLM.int8()'s weight format (bitsandbytes' ``Linear8bitLt``): each output row of a linear
weight W (out, in) is scaled by its absolute maximum, ``scale[r] = max|W[r, :]| / 127``, and rounded to
int8 codes in [-127, 127]. The compute differs on purpose: a forward multiplies the input by the weight
dequantized to the compute dtype (``codes * scale``), where bitsandbytes also quantizes the activations
to int8 and keeps their outlier columns in fp16. Ours is closer to the unquantized model and needs no
outlier threshold.

Representation: the linear layer becomes an ``Int8Linear`` (an ``nn.Linear`` whose forward dequantizes)
with two frozen parameters, ``weight`` (int8 codes, (out, in)) and ``weight_scale`` (float32, (out,)).
Plain tensors, so every strategy handles them as it handles any weight:

* FSDP2 shards both by rows (the same rows of codes and scales land on each rank) and gathers the codes
  as int8: one byte a value on the wire and at rest. Mixed precision casts the scales to ``param_dtype``;
  the scales are rounded to that dtype before the codes are computed, so codes and scales agree.
* tensor parallelism: colwise layers split codes and scales by rows; rowwise layers split the codes by
  columns and replicate the scales (``replicate_rowwise_scales``).
* one rank without FSDP (``parallel/single_rank.py``): the codes stay as they are, the scales live in
  the flat buffers with the other frozen tensors.

The backward computes only the input's gradient (``grad @ dequantized W``): the base weight is frozen, so
no weight gradient is formed, and only the int8 codes and scales are kept for it.
"""

from __future__ import annotations

from typing import Optional  # a custom op's schema: the spelling every torch version reads

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ndparallel.quantized.fused import compiled_if

CODE_MAX = 127


def quantize_rowwise(
    weight: torch.Tensor, *, scale_dtype: torch.dtype, code_dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales) of a full (out, in) weight: int8 codes (``code_dtype`` int8), or float8 e4m3
    codes (``fp8.py``; rounded to nearest by the cast). The scales are rounded to ``scale_dtype`` (the dtype
    the forward multiplies in) first, so ``codes * scale`` is what the forward computes."""
    code_max = CODE_MAX if code_dtype == torch.int8 else float(torch.finfo(code_dtype).max)
    full = weight.detach().float()
    scale = (full.abs().amax(dim=1) / code_max).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(scale_dtype).float()
    scaled = full / scale[:, None]
    if code_dtype == torch.int8:
        scaled = torch.round(scaled)
    codes = scaled.clamp_(-code_max, code_max).to(code_dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 or e4m3 codes (both exact in bf16) times their row's scale, in ``dtype``."""
    return codes.to(dtype) * scale.to(dtype).unsqueeze(1)


# The input gradient as one opaque operator: written as plain tensor code, the backward's dequantization is
# the forward's again, and under torch.compile the graph partitioner computes it once in the forward and
# keeps the whole compute-dtype weight for the backward (measured on the H200: an 8B LoRA on int8 weights,
# compiled, peaked at 41.1 GiB, above the 34.6 of a bf16 base). As one node that reads the codes, the backward
# keeps only the codes and scales, which it holds anyway (the forward is an operator too: ``int8_linear``).
# ``fused``: called from a compiled backward; the dequantization runs compiled (``fused.py``).
@torch.library.custom_op("ndparallel::int8_input_grad", mutates_args=())
def int8_input_grad(grad: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fused: bool) -> torch.Tensor:
    """grad @ (codes * scale): the gradient of a frozen int8 linear's input."""
    return grad @ compiled_if(dequantize, fused)(codes, scale, grad.dtype)


@int8_input_grad.register_fake
def _(grad: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fused: bool) -> torch.Tensor:
    return grad.new_empty((*grad.shape[:-1], codes.shape[1]))


# The forward as one opaque operator too. Written as tensor code, the compiled layer's graph holds the
# dequantized weight as an intermediate, and under a checkpoint compiled whole the graph partitioner of the
# H200's torch (2.11) kept it from forward to backward rather than recompute it: an 8B LoRA on int8 weights
# with full checkpointing peaked at 19.8 GiB against ~10 (4 layers: 1,432 MiB saved against 256;
# ``benchmarks/diagnostics/quantized_checkpoint_memory_diag.py``). With no weight-shaped tensor in the graph,
# no partitioner can keep one; a recompute calls the operator again from the codes.
@torch.library.custom_op("ndparallel::int8_linear", mutates_args=())
def int8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], fused: bool
) -> torch.Tensor:
    """x @ (codes * scale)^T + bias."""
    return F.linear(x, compiled_if(dequantize, fused)(codes, scale, x.dtype), bias)


@int8_linear.register_fake
def _(x, codes, scale, bias, fused) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def codes_context(ctx, inputs, output) -> None:
    """The ``setup_context`` of a frozen linear operator on codes and row scales (int8's, ``fp8.fp8_linear``)."""
    x, codes, scale, bias, fused = inputs
    ctx.save_for_backward(codes, scale)
    ctx.has_bias = bias is not None
    # as the forward was called: AOTAutograd traces the backward, where torch.compiler.is_compiling() is False
    # (the dequantization then ran as eager kernels; with the LoRA MLP's pointwise backward, eager for the
    # same reason, an 8B int8 LoRA step was 35% slower on the H200)
    ctx.fused = fused


def codes_backward(input_grad):
    """The backward of such an operator: ``input_grad(grad, codes, scale, fused)`` for the input (int8's
    dequantizing product, or ``fp8.fp8_input_grad``), the bias's sum if it trains, nothing for the base."""

    def backward(ctx, grad):
        codes, scale = ctx.saved_tensors
        grad_x = input_grad(grad, codes, scale, ctx.fused) if ctx.needs_input_grad[0] else None
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias, None

    return backward


# The gradient formula of the operator itself (not an autograd.Function around it): inside an activation
# checkpoint that torch.compile traces whole, the nodes of an autograd.Function's forward were not recomputed on
# torch 2.11 (its outputs were saved instead: 1,432 MiB against 256 for 4 layers of the 8B at 4,096 tokens,
# ``benchmarks/diagnostics/quantized_checkpoint_memory_diag.py``), while an operator is recomputed as any other.
int8_linear.register_autograd(codes_backward(int8_input_grad), setup_context=codes_context)


class _FrozenInt8Linear(torch.autograd.Function):
    """Tensor parallelism (DTensor codes and scales): y = x @ (codes * scale)^T + bias through DTensor's own
    ops, with the gradient of x (and of a trainable bias) only."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias):
        ctx.save_for_backward(codes, scale)
        ctx.has_bias = bias is not None
        return F.linear(x, dequantize(codes, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        codes, scale = ctx.saved_tensors
        grad_x = grad @ dequantize(codes, scale, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias


class Int8Linear(nn.Linear):
    """A linear layer with frozen int8 codes (``weight``) and row scales (``weight_scale``)."""

    weight_scale: nn.Parameter
    scale_dtype: torch.dtype
    STORED_DTYPE = torch.int8
    """The dtype ``weight`` holds its codes in."""

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as stored, scales) of full rows of a float weight."""
        return quantize_rowwise(weight, scale_dtype=self.scale_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return _FrozenInt8Linear.apply(x, self.weight, self.weight_scale, self.bias)
        return int8_linear(x, self.weight, self.weight_scale, self.bias, torch.compiler.is_compiling())


def is_int8_codes(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.int8


def to_int8(module: nn.Linear, *, scale_dtype: torch.dtype, kind: type[Int8Linear] = Int8Linear) -> None:
    """Turn ``module`` into an ``Int8Linear`` (or the subclass ``kind``: ``fp8.Fp8Linear``) in place. A meta
    weight gets empty codes and scales (filled by ``fill``); a weight with storage is quantized now."""
    weight = module.weight
    module.__class__ = kind
    module.scale_dtype = scale_dtype
    if weight.device.type == "meta":
        codes = torch.empty(weight.shape, dtype=kind.STORED_DTYPE, device="meta")
        scale = torch.empty(weight.shape[0], dtype=torch.float32, device="meta")
    else:
        codes, scale = module.quantize(weight)
    module.weight = nn.Parameter(codes, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)


def fill(module: Int8Linear, full: torch.Tensor, copy_shard) -> None:
    """Quantize the full weight ``full`` and copy this rank's shards of codes and scales into ``module``
    (``copy_shard(target, full_tensor)`` slices a full tensor to the target's placement)."""
    codes, scale = module.quantize(full)
    copy_shard(module.weight, codes)
    copy_shard(module.weight_scale, scale)


def replicate_rowwise_scales(layers: nn.Module) -> None:
    """After tensor parallelism: a rowwise layer's codes are split by columns while torch's rowwise style
    left the scales alone; every rank needs all of its rows' scales, so they are replicated."""
    for module in layers.modules():
        if isinstance(module, Int8Linear) and isinstance(module.weight, DTensor):
            if not isinstance(module.weight_scale, DTensor):
                mesh = module.weight.device_mesh
                module.weight_scale = nn.Parameter(
                    distribute_tensor(module.weight_scale.data, mesh, [Replicate()] * mesh.ndim),
                    requires_grad=False,
                )
