"""How torchao's 8-bit optimizer states (``AdamW8bit``) are checkpointed, and read back on any layout.

torchao quantizes a state (exp_avg, exp_avg_sq) as 8-bit codes with one float32 scale per block of 256
consecutive values, but only where the tensor it holds (a DTensor's local shard) has at least 4,096 values and
whole blocks; other shards keep plain states. Whether a shard is quantized therefore depends on the layout:
an 8B's 4,096-value norm weight is quantized on one rank and plain on each of two FSDP ranks, and a matrix of 31
rows of 256 sharded over two ranks is quantized on the first (16 rows) and plain on the second (15). A
checkpoint holds the same keys on every rank, so each state is saved in one of three forms chosen from its
global shape and sharding alone (every rank computes the same, no collective):

- ``codes``: every rank's shard is quantized in blocks within its rows: ``key::codes8`` (uint8, shaped and split
  like the parameter) + ``key::scales8`` (float32, ``(*shape[:-1], shape[-1] // 256)``, split the same way);
  bitwise on resume, and it reshards as any tensor;
- ``plain``: no rank's shard is quantized: the state under its own key, as torchao keeps it;
- ``values``: anything else: ``key::values8``, the float32 values (dequantized where quantized).

Reading back, the targets follow the form the checkpoint holds (``templates``), not the form this layout would
save, and each state is then copied into the live one: codes and scales bitwise where this rank's shard is
quantized in the same blocks, otherwise as values (quantized again by the live state's copy where it is 8-bit).
Saved codes whose blocks this layout cannot split (a last dimension sharded off 256-value boundaries) are read
whole and dequantized before this rank takes its part.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from ndparallel import _compat

CODES, SCALES, VALUES = "::codes8", "::scales8", "::values8"
PARTS = (CODES, SCALES, VALUES)
MIN_QUANTIZED = 4096  # torchao quantizes a (local) state of at least this many values that is whole blocks
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}  # torchao's code maps per state


def is_eight_bit(optimizer: torch.optim.Optimizer) -> bool:
    """torchao's 8-bit Adam and AdamW (states quantized in blocks of ``block_size`` values; not its 4-bit or FP8
    optimizers, whose states are laid out otherwise)."""
    try:
        from torchao.optim import Adam8bit, AdamW8bit
    except ImportError:  # torchao is optional: without it no optimizer is one of its
        return False
    return isinstance(optimizer, (Adam8bit, AdamW8bit))


def is_quantized(value: Any) -> bool:
    """A tensor subclass with codes and scales (a quantized state), itself or a DTensor's shard."""
    local = local_of(value)
    return isinstance(local, torch.Tensor) and type(local) is not torch.Tensor and hasattr(local, "codes")


def local_of(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def holds_parts(entry: dict) -> bool:
    return any(isinstance(k, str) and k.endswith(PARTS) for k in entry)


# --- saving ---------------------------------------------------------------------------------------------------


def saved_parts(key: str, value: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """The tensors one state is saved as (see the module's forms); the same keys on every rank."""
    form = _form(value, block)
    local = local_of(value)
    if form == "codes":
        if not is_quantized(local):  # cannot happen while torchao keeps its rule; quantized here to keep the form
            local = _quantize(local, SIGNED.get(key, True), block)
        scales = local.scale.view(*local.codes.shape[:-1], local.codes.shape[-1] // block)
        return {
            key + CODES: _like(value, local.codes, value.shape),
            key + SCALES: _like(value, scales, _scale_shape(value.shape, block)),
        }
    values = local.dequantize() if is_quantized(local) else local
    if form == "plain":
        return {key: value if values is local else _like(value, values, value.shape)}
    return {key + VALUES: _like(value, values.float(), value.shape)}


def _form(value: torch.Tensor, block: int) -> str:
    if value.dim() == 0:
        return "plain"
    shapes = _shard_shapes(value)
    quantized = [math.prod(s) >= MIN_QUANTIZED and math.prod(s) % block == 0 for s in shapes]
    if not any(quantized):
        return "plain"
    if all(quantized) and _blocks_follow_shards(value, block):
        return "codes"
    return "values"


def _shard_shapes(value: torch.Tensor) -> list[list[int]]:
    """Every rank's local shape: each Shard placement splits its dimension as torch.chunk does, as DTensor does."""
    shapes = [list(value.shape)]
    if isinstance(value, DTensor):
        for size, placement in zip(value.device_mesh.shape, value.placements):
            if isinstance(placement, Shard):
                d = placement.dim
                shapes = [s[:d] + [part] + s[d + 1 :] for s in shapes for part in _chunks(s[d], size)]
    return shapes


def _blocks_follow_shards(value: torch.Tensor, block: int) -> bool:
    """Every rank's rows are whole blocks, and splitting the scales as the codes are gives each rank its blocks'."""
    length = value.shape[-1]
    if length % block:
        return False
    widths, blocks = [length], [length // block]
    if isinstance(value, DTensor):
        for size, placement in zip(value.device_mesh.shape, value.placements):
            if isinstance(placement, Shard) and placement.dim in (-1, value.dim() - 1):
                widths = [part for w in widths for part in _chunks(w, size)]
                blocks = [part for b in blocks for part in _chunks(b, size)]
    return widths == [b * block for b in blocks]


def _chunks(length: int, parts: int) -> list[int]:
    step = -(-length // parts)
    return [max(0, min(step, length - i * step)) for i in range(parts)]


def _scale_shape(shape: torch.Size, block: int) -> torch.Size:
    return torch.Size((*shape[:-1], shape[-1] // block))


def _quantize(values: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    state = _compat.eight_bit_state(torch.zeros_like(values, dtype=torch.uint8), None, signed, block)
    state.copy_(values.float())
    return state


def _like(value: torch.Tensor, local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``local`` as a DTensor split as ``value`` is (global ``shape``), or as it is when ``value`` is plain."""
    if not isinstance(value, DTensor):
        return local
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=shape, stride=stride)


# --- reading back ---------------------------------------------------------------------------------------------


def templates(key: str, live: torch.Tensor, saved_keys: set[str], block: int) -> dict[str, torch.Tensor]:
    """Targets for what the checkpoint holds of one state, split as ``live`` is. Saved codes whose blocks this
    layout cannot split are left out: the loader reads them whole."""
    local = local_of(live)
    if key + CODES in saved_keys:
        if not _blocks_follow_shards(live, block):
            return {}
        codes = torch.empty(local.shape, dtype=torch.uint8, device=local.device)
        scales = torch.empty((*local.shape[:-1], local.shape[-1] // block), dtype=torch.float32, device=local.device)
        return {
            key + CODES: _like(live, codes, live.shape),
            key + SCALES: _like(live, scales, _scale_shape(live.shape, block)),
        }
    name = key + VALUES if key + VALUES in saved_keys else key
    return {name: _like(live, torch.empty(local.shape, dtype=torch.float32, device=local.device), live.shape)}


def restore(key: str, live: torch.Tensor, entry: dict[str, Any], block: int) -> None:
    """Copy the saved parts of one state (popped from ``entry``) into the live state."""
    target = local_of(live)
    if key + CODES in entry:
        codes, scales = entry.pop(key + CODES), entry.pop(key + SCALES)
        whole = isinstance(live, DTensor) and not isinstance(codes, DTensor)  # read whole: blocks not splittable
        codes, scales = local_of(codes), local_of(scales)
        if not whole and is_quantized(target) and target.block_size == block and target.codes.shape == codes.shape:
            target.codes.copy_(codes)
            target.scale.copy_(scales.reshape(-1))
            return
        values = _dequantize(codes, scales, SIGNED.get(key, True), block)
        values = _region(values, live) if whole else values
    else:
        saved = entry.pop(key + VALUES) if key + VALUES in entry else entry.pop(key)
        whole = isinstance(live, DTensor) and not isinstance(saved, DTensor)
        values = _region(saved, live) if whole else local_of(saved)
    target.copy_(values.to(target.device).contiguous())  # a quantized state's copy quantizes (rows of blocks)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    return _compat.eight_bit_state(codes, scales.reshape(-1).float(), signed, block).dequantize()


def _region(whole: torch.Tensor, live: DTensor) -> torch.Tensor:
    offsets, sizes = _compat.local_region(live)
    return whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
