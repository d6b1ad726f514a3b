"""Quantization-aware training (Axolotl's ``qat:`` block) with torchao's fake-quantized linear layers.

A full fine-tune whose linear layers see their weights (and inputs) rounded the way a quantized model
will round them: each ``nn.Linear`` of the model, the head included (as Axolotl applies it), becomes
torchao's fake-quantized linear for the chosen scheme. The weights stay in the training dtype and train
as usual; export gives plain weights, ready for post-training quantization with the same scheme.

Schemes (activation / weight, as Axolotl names them), each mapped onto torchao 0.18's fake-quantize configs:

| activation_dtype | weight_dtype | torchao configs |
|---|---|---|
| int8 | int4 | per-token asymmetric int8 inputs; int4 weights in groups of ``group_size`` (bf16 inputs) |
| (none) | int4 | int4 weights in groups (the scheme of torchao's int4 weight-only kernels) |
| mxfp4 | mxfp4 | MX FP4 (blocks of 32, emulated matmul) |

Refused: ``nvfp4`` (torchao's NVFP4 QAT runs only on Blackwell GPUs) and ``float8_e4m3fn`` (torchao 0.18's
float8 fake quantizer rounds the gradient to float8 as well: measured 11% relative error on gradients of
size ~1 and 108% on gradients of size 1e-3, so such a run would not train the model it claims to).
Not combined with LoRA, fp8 training, quantized base weights or tensor parallelism (the weight schemes
scale groups along each row, and the fake quantizers are not written for DTensors).

``fake_quant_after_n_steps``: the first N optimizer steps train without fake quantization (``set_enabled``).

Applied on the model as built (meta tensors), before any strategy: the modules are swapped by torchao's
``quantize_``, and a head tied to the embeddings is tied again afterwards (on meta tensors the swap gives
the new head its own weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ndparallel.errors import ConfigError


@dataclass(frozen=True)
class QatSpec:
    """Axolotl's ``qat:`` settings."""

    weight_dtype: str
    activation_dtype: str | None = None
    group_size: int = 32
    quantize_embedding: bool = False
    fake_quant_after_n_steps: int | None = None

    def describe(self) -> str:
        act = self.activation_dtype or "unquantized"
        return (
            f"qat: fake-quantized linear layers, weights {self.weight_dtype} (groups of {self.group_size}), "
            f"inputs {act}"
            + (", embeddings too" if self.quantize_embedding else "")
            + (f"; from step {self.fake_quant_after_n_steps + 1}" if self.fake_quant_after_n_steps else "")
        )


def check_spec(spec: QatSpec) -> None:
    """One line per scheme torchao cannot simulate here."""
    w, a = spec.weight_dtype, spec.activation_dtype
    if w == "nvfp4" or a == "nvfp4":
        raise ConfigError(
            "qat: nvfp4 needs a Blackwell GPU (torchao's NVFP4 QAT has no emulation); use mxfp4 or int8/int4"
        )
    if w == "mxfp4" or a == "mxfp4":
        if (w, a) != ("mxfp4", "mxfp4"):
            raise ConfigError("qat: mxfp4 needs activation_dtype: mxfp4 and weight_dtype: mxfp4 together")
        if spec.group_size != 32:
            raise ConfigError(f"qat: mxfp4 uses blocks of 32; set group_size: 32 (not {spec.group_size})")
        if spec.fake_quant_after_n_steps:
            raise ConfigError("qat: fake_quant_after_n_steps is not supported with mxfp4; remove it")
        return
    if "float8_e4m3fn" in (w, a):
        raise ConfigError(
            "qat: float8_e4m3fn is not supported: torchao's float8 fake quantizer rounds the gradients to "
            "float8 too (108% error on gradients of size 1e-3); use int8/int4 or mxfp4 (or fp8: true to train in FP8)"
        )
    if (a, w) not in {("int8", "int4"), (None, "int4")}:
        raise ConfigError(
            f"qat: activation_dtype {a} with weight_dtype {w} is not a torchao QAT scheme; use activation_dtype "
            f"int8 with weight_dtype int4, weight_dtype int4 alone, or mxfp4 for both"
        )
    if spec.group_size < 1:
        raise ConfigError(f"qat: group_size must be positive, not {spec.group_size}")


def _configs(spec: QatSpec):
    """(activation config, weight config) for torchao's QATConfig."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig

    if spec.weight_dtype == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=spec.group_size)
        return mx, mx
    # int4 weights in groups, with the numerics of torchao's int4 kernels for bf16 inputs
    weight = Int4WeightFakeQuantizeConfig(group_size=spec.group_size, activation_dtype=torch.bfloat16)
    if spec.activation_dtype == "int8":  # one asymmetric int8 scale per token
        return IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False), weight
    return None, weight


def apply_qat(model: nn.Module, spec: QatSpec) -> int:
    """Swap the model's linear layers (and embeddings, if asked) for fake-quantized ones; returns how many."""
    check_spec(spec)
    try:
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig
    except ImportError:
        raise ConfigError("qat needs torchao: pip install 'ndparallel[qat]'") from None
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embed.weight
    act, weight = _configs(spec)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in linears:
        linear = model.get_submodule(name)
        groups = spec.group_size if spec.weight_dtype in ("int4", "mxfp4") else 1
        if linear.in_features % groups:
            raise ConfigError(
                f"qat: {name} has {linear.in_features} input features, not a multiple of group_size "
                f"{spec.group_size}; choose a group_size that divides it"
            )
    quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"))
    if spec.quantize_embedding:
        quantize_(
            model,
            QATConfig(weight_config=weight, step="prepare"),
            filter_fn=lambda module, _: isinstance(module, nn.Embedding),
        )
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if spec.fake_quant_after_n_steps:
        set_enabled(model, False)
    return len(linears)


def _quantizers(model: nn.Module):
    for module in model.modules():
        for attr in ("activation_fake_quantizer", "weight_fake_quantizer"):
            quantizer = getattr(module, attr, None)
            if quantizer is not None:
                yield quantizer


def set_enabled(model: nn.Module, enabled: bool) -> None:
    for quantizer in _quantizers(model):
        quantizer.enabled = enabled


def at_step(model: nn.Module, spec: QatSpec | None, step: int) -> None:
    """Before optimizer step ``step`` (0-based, also after a resume): fake quantization is on once
    ``fake_quant_after_n_steps`` steps have passed."""
    if spec is None or not spec.fake_quant_after_n_steps:
        return
    wanted = step >= spec.fake_quant_after_n_steps
    first = next(_quantizers(model), None)
    if first is not None and first.enabled != wanted:
        set_enabled(model, wanted)
