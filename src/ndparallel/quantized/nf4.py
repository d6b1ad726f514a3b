"""QLoRA's frozen base weights in 4-bit NF4 (``load_in_4bit: true``, ``adapter: qlora``), sharded by FSDP2.

The linear layers of the decoder blocks keep their weights as torchao ``NF4Tensor``s: 4-bit NormalFloat
codes in blocks of 64 values, each block's scale quantized again to int8 in groups of 256 ("double
quantization"): the format of the QLoRA paper and of bitsandbytes' ``nf4`` with double quantization. A
forward dequantizes the (all-gathered) weight to the compute dtype and multiplies; no gradient is formed
for it. The LoRA adapters, norms, embeddings and head stay in the training dtype and train as usual.

How it fits the build (``parallelize`` then ``materialize``):

1. on the meta model, before FSDP: each eligible linear's weight becomes an empty NF4 tensor, so FSDP2
   shards it as NF4 (it all-gathers the packed codes and scales: 4.5 bits a value on the wire);
2. when the weights are filled: the full weight is read (or drawn), quantized on the device, split by
   rows into FSDP's shards and this rank's shard is assigned in place of the empty one (FSDP2 re-reads an
   assigned parameter before its first forward). The whole tensor is quantized before splitting because
   the second-level scales are centred on the mean over the whole tensor: quantizing each shard on its own
   would give another model on every layout.

Which weights: those made of whole scale groups (``numel`` a multiple of 64 x 256), true of every linear of
the published 1B-405B models; smaller ones (tiny test models) stay in the training dtype and are listed.
The rule does not depend on the layout, so every layout trains the same model; a layout whose FSDP shards
would cut a scale group is refused, naming the weight. Not supported: tensor parallelism (an NF4 weight
cannot be split by columns).
"""

from __future__ import annotations

from typing import Optional  # a custom op's schema: the spelling every torch version reads

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.kernels import nf4_dequantize as nf4_kernel
from ndparallel.quantized.fused import compiled_if

BLOCK = 64
"""Values sharing one scale (QLoRA's and bitsandbytes' block size)."""
SCALER_BLOCK = 256
"""Scales sharing one second-level (int8) quantization factor."""
GROUP = BLOCK * SCALER_BLOCK


def nf4_available() -> None:
    """torchao's NF4 tensor, or one line saying how to get it."""
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise ConfigError("load_in_4bit needs torchao (its NF4 tensor): pip install 'ndparallel[qlora]'") from None


def is_nf4(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def eligible(weight: torch.Tensor) -> bool:
    """Whole scale groups only: which weights are 4-bit must not depend on the layout."""
    return weight.numel() % GROUP == 0


def nf4_parts(weight: torch.Tensor) -> list[torch.Tensor]:
    """An NF4 tensor's inner tensors, in the order ``dequantize`` takes them."""
    return [weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean, weight.nf4]


def dequantize(parts: list[torch.Tensor], block_size: int, scaler_block_size: int, shape: list[int]) -> torch.Tensor:
    """An NF4 weight from its parts (``nf4_parts``), as ``NF4Tensor.get_original_weight`` computes it (the
    same operations in the same dtype, so the same bits eager and, on the CPU, compiled:
    ``tests/unit/quantized/test_quantized_compile.py``; compiled for CUDA it is not, which is one reason CUDA
    takes the Triton kernel, ``dequantize_for``)."""
    quantized_data, quantized_scalers, quantization_factor, scaler_mean, nf4 = parts
    first = nf4[(quantized_data >> 4).to(torch.long)]  # two 4-bit codes per byte
    second = nf4[(quantized_data & 0b1111).to(torch.long)]
    blocks = quantized_scalers.numel() // scaler_block_size
    scalers = (quantized_scalers.view(blocks, scaler_block_size) / quantization_factor.unsqueeze(-1)).flatten()
    scalers = scalers.to(nf4.dtype) + scaler_mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block_size // 2).flatten()
    first, second = (first * repeated).unsqueeze(-1).transpose(0, 1), (second * repeated).unsqueeze(-1).transpose(0, 1)
    return torch.stack([first, second], dim=-1).reshape(shape)


def dequantize_for(
    parts: list[torch.Tensor], block_size: int, scaler_block_size: int, shape: list[int], fused: bool
) -> torch.Tensor:
    """``dequantize`` as the operators run it: on CUDA one Triton kernel (``kernels/nf4_dequantize.py``, the same
    bits as torchao; 8B on an H100: 16.7 ms per pass over the weights against 49.2 compiled and 28.9 for
    bitsandbytes' kernel, and a QLoRA step 1.32x faster, RESULTS.md issue 35 session 13); elsewhere compiled
    when called from a compiled layer (``fused``), else eager."""
    if nf4_kernel.supported(parts):
        return nf4_kernel.dequantize(parts, block_size, scaler_block_size, shape)
    return compiled_if(dequantize, fused)(parts, block_size, scaler_block_size, shape)


# The input gradient as one opaque operator, for the reason int8.int8_input_grad gives (compiled, the NF4
# base's dequantized weights were kept from forward to backward: an 8B LoRA peaked at 37.9 GiB on the H200,
# above a bf16 base's 34.6). ``fused``: called from a compiled backward; the dequantization runs compiled.
@torch.library.custom_op("ndparallel::nf4_input_grad", mutates_args=())
def nf4_input_grad(
    grad: torch.Tensor,
    parts: list[torch.Tensor],
    block_size: int,
    scaler_block_size: int,
    shape: list[int],
    fused: bool,
) -> torch.Tensor:
    """grad @ W for the NF4 weight W given by its parts: the gradient of a frozen NF4 linear's input."""
    weight = dequantize_for(parts, block_size, scaler_block_size, shape, fused)
    return grad @ weight.to(grad.dtype)


@nf4_input_grad.register_fake
def _(grad, parts, block_size, scaler_block_size, shape, fused) -> torch.Tensor:
    return grad.new_empty((*grad.shape[:-1], shape[1]))


# The forward as one opaque operator, for the reason int8.int8_linear gives (on the H200, an 8B QLoRA with
# full checkpointing compiled whole kept every dequantized weight: 16.6 GiB against 7.1).
@torch.library.custom_op("ndparallel::nf4_linear", mutates_args=())
def nf4_linear(
    x: torch.Tensor,
    parts: list[torch.Tensor],
    block_size: int,
    scaler_block_size: int,
    shape: list[int],
    bias: Optional[torch.Tensor],
    fused: bool,
) -> torch.Tensor:
    """x @ W^T + bias for the NF4 weight W given by its parts."""
    weight = dequantize_for(parts, block_size, scaler_block_size, shape, fused)
    return F.linear(x, weight.to(x.dtype), bias)


@nf4_linear.register_fake
def _(x, parts, block_size, scaler_block_size, shape, bias, fused) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], shape[0]))


def _nf4_linear_context(ctx, inputs, output) -> None:
    x, parts, block_size, scaler_block_size, shape, bias, fused = inputs
    ctx.save_for_backward(*parts)
    ctx.layout = (block_size, scaler_block_size, shape)
    ctx.has_bias = bias is not None
    ctx.fused = fused  # as the forward was called (int8.py says why)


def _nf4_linear_backward(ctx, grad):
    parts = list(ctx.saved_tensors)
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = nf4_input_grad(grad, parts, *ctx.layout, ctx.fused)
    grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[5] else None
    return grad_x, [None] * len(parts), None, None, None, grad_bias, None


# The operator's own gradient formula, for the reason int8.py gives (an autograd.Function's forward was not
# recomputed inside a checkpoint compiled whole on torch 2.11: an 8B QLoRA with full checkpointing peaked at
# 16.6 GiB against 7.1).
nf4_linear.register_autograd(_nf4_linear_backward, setup_context=_nf4_linear_context)


class _FrozenNf4Linear(torch.autograd.Function):
    """A sharded (DTensor) or unquantized weight: y = x @ W^T + bias through the tensor's own ops, with the
    gradient of x (and of a trainable bias) only."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)  # the NF4 tensor (as torchao's own linear_nf4 keeps it)
        ctx.has_bias = bias is not None
        return F.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


class Nf4Linear(nn.Linear):
    """A linear layer whose frozen ``weight`` is an NF4 tensor (its forward dequantizes, its backward forms
    only the input's gradient, through ``nf4_input_grad``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not is_nf4(weight) or isinstance(weight, DTensor):
            return _FrozenNf4Linear.apply(x, weight, self.bias)
        layout = (weight.block_size, weight.scaler_block_size, list(weight.shape))
        return nf4_linear(x, nf4_parts(weight), *layout, self.bias, torch.compiler.is_compiling())


def to_nf4(module: nn.Linear, name: str, *, shards: int, dtype: torch.dtype) -> None:
    """Make ``module.weight`` NF4 (before FSDP). A meta weight becomes an empty NF4 tensor that
    ``assign_quantized`` fills; a weight with storage is quantized now. ``name``: for messages."""
    nf4_available()
    from torchao.quantization import to_nf4 as torchao_to_nf4

    weight = module.weight
    if (weight.numel() // GROUP) % shards or weight.shape[0] % shards:
        raise ConfigError(
            f"load_in_4bit: {name}.weight ({tuple(weight.shape)}: {weight.numel() // GROUP} scale group(s) of "
            f"{GROUP} values) does not split evenly over {shards} FSDP shard(s) (dp_shard_size x "
            f"context_parallel_size); choose sizes whose product divides {weight.numel() // GROUP}"
        )
    with torch.no_grad():
        source = weight.detach().to(dtype)
        if source.device.type == "meta":  # shapes only: the codes are filled by ``assign_quantized``
            source = torch.empty(weight.shape, dtype=dtype, device="meta")
        module.weight = nn.Parameter(torchao_to_nf4(source.contiguous(), BLOCK, SCALER_BLOCK), requires_grad=False)
    module.__class__ = Nf4Linear


def assign_quantized(module: nn.Module, param_name: str, full: torch.Tensor) -> None:
    """Quantize the full weight ``full`` on the parameter's device and put this rank's row shard of it in
    place of the empty NF4 parameter ``module.<param_name>``."""
    from torchao.quantization import to_nf4

    param = getattr(module, param_name)
    local = param.to_local() if isinstance(param, DTensor) else param
    with torch.no_grad():
        whole = to_nf4(full.to(device=local.device, dtype=param.dtype).contiguous(), BLOCK, SCALER_BLOCK)
        if not isinstance(param, DTensor):
            setattr(module, param_name, nn.Parameter(whole, requires_grad=False))
            return
        offsets, sizes = _compat.local_region(param)
        rows = sizes[0]
        if any(offsets[1:]) or tuple(sizes[1:]) != tuple(param.shape[1:]) or param.shape[0] % rows:
            raise ConfigError(f"{param_name}: a 4-bit weight must be split by whole rows, evenly")
        shard = torch.split(whole, rows, dim=0)[offsets[0] // rows]
        _contiguous_inner(shard)
        sharded = DTensor.from_local(
            shard, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
        setattr(module, param_name, nn.Parameter(sharded, requires_grad=False))


def _contiguous_inner(nf4: torch.Tensor) -> None:
    """A one-element slice of a strided tensor counts as contiguous with a stride other than 1, which FSDP's
    all-gather (a byte view of each tensor) refuses: give such pieces their own storage."""
    names, _ = nf4.__tensor_flatten__()
    for name in names:
        inner = getattr(nf4, name)
        if inner.dim() and inner.stride(-1) != 1:
            setattr(nf4, name, inner.new_empty(inner.shape).copy_(inner))
