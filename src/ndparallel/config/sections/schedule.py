"""Batch and schedule: micro-batches, accumulation, steps, the learning rate and the optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit", "ao_adamw_8bit")

MAX_COUNT = 2**16
"""Sane maximum of the batch counts."""


class ScheduleSettings(BaseModel):
    """How much is trained per step, for how long, with which optimizer."""

    micro_batch_size: int = Field(1, ge=1, le=MAX_COUNT)
    """Rows per data-parallel rank per micro-step."""
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_COUNT)
    """Micro-steps per optimizer step."""
    num_epochs: float = Field(1.0, gt=0)
    """Passes over the data (ignored when max_steps is set)."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run."""
    learning_rate: float = Field(2e-5, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    """cosine or linear decay after warm-up, constant_with_warmup, or constant (no warm-up), as in transformers."""
    warmup_steps: int | float | None = Field(None, ge=0)
    """Warm-up steps, or a fraction of the steps when below 1 (default: warmup_ratio of the steps, else 3% of
    them and at most 100, as Axolotl)."""
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    """Warm-up as a fraction of the steps."""
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1)
    """cosine: decay to this fraction of learning_rate instead of 0."""
    cosine_constant_lr_ratio: float | None = Field(None, ge=0, le=1)
    """cosine with cosine_min_lr_ratio: reach the minimum at this fraction of the steps and stay there."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay; never applied to norms and biases."""
    max_grad_norm: float | None = Field(None, ge=0)
    """Clip the global gradient norm to this; unset means 1.0 and 0 turns clipping off (as in transformers).
    The norm is always reported."""
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "adamw", "paged_adamw_32bit", *EIGHT_BIT_OPTIMIZERS] = (
        "adamw_torch_fused"
    )
    """AdamW (fused where the device supports it; paged_adamw_32bit is AdamW too: bitsandbytes' paging only
    moves its state between GPU and host memory), or 8-bit AdamW (adamw_8bit, adamw_bnb_8bit,
    adamw_torch_8bit, paged_adamw_8bit, ao_adamw_8bit: all torchao's AdamW8bit, which takes sharded
    parameters; CUDA only)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    seed: int = 42

    @property
    def clip_norm(self) -> float | None:
        """The clipping threshold: unset means 1.0, 0 means no clipping (transformers' meaning)."""
        if self.max_grad_norm is None:
            return 1.0
        return self.max_grad_norm or None

    @property
    def eight_bit_optimizer(self) -> bool:
        return self.optimizer in EIGHT_BIT_OPTIMIZERS
