"""Fine-tuning adapters (Axolotl's names): LoRA and QLoRA, quantized base weights, unfrozen parameters."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

from ndparallel.adapters.freeze import compile_patterns
from ndparallel.adapters.lora import MAX_LORA_R


class AdapterSettings(BaseModel):
    """What a fine-tune trains beside or instead of the full weights."""

    adapter: str | None = None
    """lora: train low-rank adapters on frozen base weights; qlora: the same on 4-bit base weights (with
    load_in_4bit: true); null: full fine-tune."""
    load_in_4bit: bool = False
    """QLoRA: keep the decoder blocks' linear weights frozen in 4-bit NF4 (blocks of 64, double-quantized
    scales: QLoRA's format), dequantized to bf16 for each matmul; needs adapter: qlora (or lora) and
    tensor_parallel_size: 1. Needs torchao (``pip install 'ndparallel[qlora]'``)."""
    load_in_8bit: bool = False
    """LoRA on 8-bit base weights: the decoder blocks' linear weights frozen as int8 codes with one absmax
    scale per output row (LLM.int8()'s weight format), dequantized to bf16 for each matmul (activations are
    not quantized); needs adapter: lora. Any layout, tensor parallelism included."""
    load_in_fp8: bool = False
    """LoRA on FP8 base weights (Unsloth's name): the decoder blocks' linear weights frozen as float8 e4m3
    codes with one absmax scale per output row, and their products on FP8 tensor cores (the input quantized
    per token in the forward, the output gradient in the backward); needs adapter: lora, a GPU of compute
    capability 8.9+ (or a CPU) and tensor_parallel_size: 1. Half the weight memory of a bf16 base; an 8B LoRA
    on an H100 (4,096-token rows, full checkpointing): 10.7 against 17.2 GiB peak and 1.07x the bf16 base's
    tokens/s; the loss moves by the rounding (+0.4% after 50 steps there: check it on your data)."""
    lora_r: int = Field(8, ge=1, le=MAX_LORA_R)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | str | None = None
    """Module names to adapt (e.g. [q_proj, v_proj]), or one regular expression matched against the full
    module path (as PEFT does with a string)."""
    lora_target_linear: bool = False
    """Adapt every linear layer of the decoder blocks."""
    lora_modules_to_save: list[str] | None = None
    """Modules trained in full alongside the adapters (e.g. embed_tokens, lm_head)."""
    lora_target_parameters: list[str] | None = None
    """Mixture-of-experts weights to adapt, per expert (PEFT's target_parameters), e.g.
    [mlp.experts.gate_up_proj, mlp.experts.down_proj]."""
    unfrozen_parameters: list[str] | None = None
    """A full fine-tune of only these weights, everything else frozen (Axolotl's meaning: regular expressions
    matched at the start of each weight's name, periods literal; ``adapters/freeze.py``), e.g. [^lm_head.weight$,
    model.layers.2[0-9]+.mlp]."""

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, value):
        if value not in (None, "lora", "qlora"):
            raise ValueError(
                f"{value!r} is not supported: use lora, qlora (with load_in_4bit: true), or leave it unset for "
                f"a full fine-tune"
            )
        return value

    @field_validator("lora_target_modules")
    @classmethod
    def _target_regex(cls, value):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"{value!r} is not a valid regular expression ({exc})") from None
        return value

    @field_validator("unfrozen_parameters")
    @classmethod
    def _unfrozen(cls, value):
        if not value:
            return None  # an empty list sets nothing (Axolotl's reading): a full fine-tune
        compile_patterns(value)
        return value

    @property
    def quantized_base(self) -> str | None:
        """The base weights' format under the adapters: 'nf4' (load_in_4bit), 'int8' (load_in_8bit), 'fp8'
        (load_in_fp8) or None."""
        return "nf4" if self.load_in_4bit else "int8" if self.load_in_8bit else "fp8" if self.load_in_fp8 else None
