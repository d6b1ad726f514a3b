"""The decoder blocks' linear weights quantized in place (``quantize_linears``), what was quantized and what
was kept (``QuantReport``), and which tensors are quantized base weights (``is_quantized``).

Only the linear layers of the decoder blocks are quantized (embeddings, norms, the head and stacked MoE
expert weights stay in the training dtype, as bitsandbytes leaves the head), and the same weights on
every layout. The adapters train as usual; the quantized weights have no gradient, and checkpoints leave
them out: they are rebuilt from base_model on resume (quantizing is deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ndparallel.quantized import fp8, int8, nf4
from ndparallel.quantized.nf4 import is_nf4

FORMATS = {"nf4": "load_in_4bit", "int8": "load_in_8bit", "fp8": "load_in_fp8"}
"""Format -> the config setting that asks for it."""
_DESCRIPTION = {
    "nf4": f"NF4 (4-bit, blocks of {nf4.BLOCK}, double-quantized scales)",
    "int8": "int8 (one absmax scale per output row)",
    "fp8": "float8 e4m3 (one absmax scale per output row; FP8 products)",
}


@dataclass
class QuantReport:
    """Which linear weights of the decoder blocks are quantized and which stayed as they were (and why)."""

    fmt: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    quantized_values: int = 0
    kept_values: int = 0

    def line(self) -> str:
        total = len(self.quantized) + len(self.kept)
        share = self.quantized_values / max(1, self.quantized_values + self.kept_values)
        text = (
            f"{FORMATS[self.fmt]}: {len(self.quantized)} of {total} linear weights of the decoder blocks in "
            f"{_DESCRIPTION[self.fmt]}, {share:.1%} of their values"
        )
        if self.kept:
            text += f"; unquantized: {len(self.kept)} ({'; '.join(sorted(set(self.kept.values())))})"
        return text


_KEPT_BECAUSE = {
    "nf4": f"not whole scale groups of {nf4.GROUP} values",
    "fp8": f"dimensions not multiples of {fp8.ALIGN}",
}


def is_quantized(tensor: torch.Tensor) -> bool:
    """A frozen quantized base weight (NF4 tensor, int8 or e4m3 codes): kept out of flat buffers and checkpoints."""
    return is_nf4(tensor) or int8.is_int8_codes(tensor) or fp8.is_fp8_codes(tensor)


def _base_linears(layers: nn.Module, prefix: str):
    for name, module in layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B"):
            yield f"{prefix}.{name}" if prefix else name, module


def quantize_linears(layers: nn.Module, fmt: str, *, shards: int, dtype: torch.dtype, prefix: str = "") -> QuantReport:
    """Quantize the decoder blocks' linear weights in place (before FSDP; int8 before tensor parallelism).
    ``shards``: FSDP's shard count (NF4 refuses one that cuts a scale group); ``dtype``: the compute dtype
    (int8 scales are rounded to it); ``prefix``: the blocks' path in the model (for messages)."""
    for name, module in _base_linears(layers, prefix):
        if fmt == "int8":
            int8.to_int8(module, scale_dtype=dtype)
        elif fmt == "fp8" and fp8.eligible(module.weight):
            fp8.to_fp8(module, scale_dtype=dtype)
        elif fmt == "nf4" and nf4.eligible(module.weight):
            nf4.to_nf4(module, name, shards=shards, dtype=dtype)
        # else unquantized on every layout, and listed with the reason (``describe``)
    return describe(layers, fmt, prefix=prefix)


def describe(layers: nn.Module, fmt: str | None = None, *, prefix: str = "") -> QuantReport:
    """``fmt`` None: whichever format the layers hold."""
    if fmt is None:
        kinds = {type(m) for m in layers.modules()}
        fmt = "fp8" if fp8.Fp8Linear in kinds else "int8" if int8.Int8Linear in kinds else "nf4"
    report = QuantReport(fmt)
    for name, module in _base_linears(layers, prefix):
        if is_quantized(module.weight):
            report.quantized.append(name)
            report.quantized_values += module.weight.numel()
        else:
            report.kept[name] = _KEPT_BECAUSE[fmt]
            report.kept_values += module.weight.numel()
    return report
