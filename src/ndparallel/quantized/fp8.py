"""LoRA on FP8 base weights (``load_in_fp8: true``, ``adapter: lora``): e4m3 codes, one scale per output row, and
the forward's products on the GPU's FP8 tensor cores.

Why: a LoRA step multiplies by every frozen weight two or three times (forward, a checkpoint's recompute, the
input gradient), and those products are most of its time. FP8 tensor cores run them at about twice the bf16
rate, and an 8-bit frozen weight takes half the memory of a bf16 one. The adapters stay in the compute dtype.

The format: each output row r of a linear weight W (out, in) is scaled by its absolute maximum,
``scale[r] = max|W[r, :]| / 448`` (448: e4m3's largest finite value), rounded to the compute dtype as int8's
scales are (``int8.quantize_rowwise`` says why), and ``W / scale`` is rounded to float8 e4m3 (4 significant bits).

The compute: the forward quantizes its input the same way per token (row of x: its own scale, max |x| / 448,
kept in float32) and multiplies codes by codes with the two scales applied to the float32 sums
(``_compat.scaled_mm``, rowwise scales): ``y[t, r] = sx[t] * scale[r] * sum_k qx[t, k] * codes[r, k]``. That is
torchao's "rowwise" float8 recipe, and the same arithmetic on every layout (each token's scale is its own, so
splitting tokens over ranks changes nothing). The backward forms only the input's gradient, in FP8 as well:
``grad_x[t, i] = sg[t] * sum_r qg[t, r] * codes[r, i]``, where ``qg`` is ``grad * scale`` (the output gradient
times the weight's row scales) quantized to e4m3 per token with scale ``sg`` (torchao's rowwise recipe also
quantizes output gradients to e4m3). The quantized input is a straight-through estimate: its gradient is taken
as the input's own.

Representation and layouts are int8's (``int8.py``): an ``Fp8Linear`` is an ``Int8Linear`` whose codes are
e4m3, kept as their bytes (uint8, viewed as e4m3 where they are multiplied): a float8 tensor is a floating-point
tensor, which ``Module.to(dtype)``, FSDP's mixed precision and ``store_frozen_in`` would convert to bf16
values. So FSDP2 shards and gathers them by rows as bytes and one rank keeps them out of the flat buffers.
Tensor parallelism is refused (``parallel/rules.py``): its split weights would take int8's dequantizing path,
whose products are bf16, so its run would not be the one-rank run.
"""

from __future__ import annotations

from typing import Optional  # a custom op's schema: the spelling every torch version reads

import torch
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.kernels import fp8_quantize, transpose
from ndparallel.quantized import int8
from ndparallel.quantized.fused import compiled_if

CODE_DTYPE = torch.float8_e4m3fn
CODE_MAX = float(torch.finfo(CODE_DTYPE).max)  # 448
INV_CODE_MAX = 1 / CODE_MAX
"""Scales are ``amax * (1 / 448)``: a product, as torch's CUDA division by a number computes it (by the
reciprocal), written so on every device, and so in the Triton kernel."""


def quantize_tokens(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scales (tokens, 1)) of a 2-D input, one scale per row: ``max |row| / 448``; with
    ``col_scale``, of ``x * col_scale`` (one float32 factor per column, multiplied in float32)."""
    full = x.float() if col_scale is None else x.float() * col_scale.float()
    amax = full.abs().amax(dim=-1, keepdim=True)
    scale = (amax * INV_CODE_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (full / scale).clamp(-CODE_MAX, CODE_MAX).to(CODE_DTYPE), scale


def quantize_tokens_for(
    x: torch.Tensor, fused: bool, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tokens`` as the operators run it: on CUDA one Triton kernel (``kernels/fp8_quantize.py``, the
    same bits); elsewhere compiled when called from a compiled layer (``fused``), else eager."""
    if fp8_quantize.supported(x):
        return fp8_quantize.quantize_rows(x, col_scale)
    return compiled_if(quantize_tokens, fused)(x, col_scale)


# The forward as one opaque operator, for the reason int8.int8_linear gives (no weight-shaped tensor in the
# compiled layer's graph for a partitioner to keep). ``fused``: called from a compiled layer (off CUDA the
# input's quantization then runs compiled).
@torch.library.custom_op("ndparallel::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], fused: bool
) -> torch.Tensor:
    """x @ (codes * scale)^T + bias, with x quantized to e4m3 per token and the product in FP8."""
    flat = x.reshape(-1, x.shape[-1])
    x_codes, x_scale = quantize_tokens_for(flat, fused)
    # b column-major (codes^T of a row-major weight), scales float32: (tokens, 1) and (1, out)
    y = _compat.scaled_mm(x_codes, codes.view(CODE_DTYPE).t(), x_scale, scale.float().unsqueeze(0), x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], codes.shape[0])


@fp8_linear.register_fake
def _(x, codes, scale, bias, fused) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


# The input gradient in FP8 too: grad_x = grad @ (scale * codes) = (grad * scale) @ codes, so the output gradient
# times the weight's row scales is quantized per token (e4m3, as the forward's input) and multiplied by the codes
# themselves. The product wants the reduced dimension (the weight's rows) contiguous in both operands, so the
# codes are transposed for it (a byte a value read and written: less traffic than a bf16 dequantization, which
# also writes two). One opaque operator, for the reason int8.int8_input_grad gives.
@torch.library.custom_op("ndparallel::fp8_input_grad", mutates_args=())
def fp8_input_grad(grad: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fused: bool) -> torch.Tensor:
    """grad @ (codes * scale) with (grad * scale) quantized to e4m3 per token: a frozen FP8 linear's input
    gradient (``codes``: the e4m3 bytes, (out, in))."""
    flat = grad.reshape(-1, grad.shape[-1])
    g_codes, g_scale = quantize_tokens_for(flat, fused, col_scale=scale)
    transposed = transpose.transposed(codes).view(CODE_DTYPE)  # (in, out); its .t() is column-major (out, in)
    ones = torch.ones((1, codes.shape[1]), dtype=torch.float32, device=grad.device)
    y = _compat.scaled_mm(g_codes, transposed.t(), g_scale, ones, grad.dtype)
    return y.reshape(*grad.shape[:-1], codes.shape[1])


@fp8_input_grad.register_fake
def _(grad, codes, scale, fused) -> torch.Tensor:
    return grad.new_empty((*grad.shape[:-1], codes.shape[1]))


# The operator's own gradient formula, for the reason int8.py gives (recomputed inside a compiled checkpoint);
# int8's context and backward, with the FP8 input gradient.
fp8_linear.register_autograd(int8.codes_backward(fp8_input_grad), setup_context=int8.codes_context)


class Fp8Linear(int8.Int8Linear):
    """A linear layer with frozen e4m3 codes (``weight``, their bytes) and row scales (``weight_scale``); FP8
    products."""

    STORED_DTYPE = torch.uint8

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = int8.quantize_rowwise(weight, scale_dtype=self.scale_dtype, code_dtype=CODE_DTYPE)
        return codes.view(torch.uint8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):  # not reached: tensor parallelism is refused (module docstring)
            raise ConfigError("load_in_fp8 with tensor parallelism is not supported; set tensor_parallel_size: 1")
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, torch.compiler.is_compiling())


ALIGN = 16
"""FP8 products need both dimensions of the weight to be multiples of 16 (the tensor cores' alignment)."""


def eligible(weight: torch.Tensor) -> bool:
    """Both dimensions multiples of 16 (a mixture-of-experts router with 8 outputs is not): the rest stay in the
    compute dtype, on every device, so that which weights are FP8 does not depend on where the run is."""
    return all(size % ALIGN == 0 for size in weight.shape)


def is_fp8_codes(tensor: torch.Tensor) -> bool:
    """e4m3 codes as stored (their bytes; no other parameter is uint8: NF4's are inside its own tensor type)."""
    return tensor.dtype == torch.uint8


def to_fp8(module: torch.nn.Linear, *, scale_dtype: torch.dtype) -> None:
    """Turn ``module`` into an ``Fp8Linear`` in place (``int8.to_int8`` with e4m3 codes)."""
    int8.to_int8(module, scale_dtype=scale_dtype, kind=Fp8Linear)


def check_device(device: torch.device) -> None:
    """FP8 products need a CPU (tests, slow) or a GPU of compute capability 8.9+ (Ada, Hopper, Blackwell)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"load_in_fp8 needs FP8 tensor cores (compute capability 8.9 or newer); {name} has none: "
            f"use load_in_8bit (int8 codes, bf16 products) instead"
        )
