"""Precision and memory: bf16, activation checkpointing and offload, compile, the fused loss, FSDP's unit and
resharding, FP8 and quantization-aware training."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ndparallel.adapters.qat import QatSpec

_QAT_DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}


class QatSettings(BaseModel):
    """Axolotl's qat: quantization-aware training of the full weights (``adapters/qat.py`` lists the schemes)."""

    model_config = ConfigDict(extra="forbid")
    weight_dtype: Literal["int4", "int8", "float8_e4m3fn", "mxfp4", "nvfp4"] = "int8"
    """How weights are fake-quantized (Axolotl's default int8 alone is not a torchao scheme: name one)."""
    activation_dtype: Literal["int4", "int8", "float8_e4m3fn", "mxfp4", "nvfp4"] | None = None
    """How each linear layer's input is fake-quantized; null: not."""
    group_size: int = Field(32, ge=1)
    """Weights per scale (int4 groups, mxfp4 blocks of 32)."""
    quantize_embedding: bool = False
    """Fake-quantize the input embeddings' weight too (weight scheme only)."""
    fake_quant_after_n_steps: int | None = Field(None, ge=0)
    """Train the first N steps without fake quantization."""

    @field_validator("weight_dtype", "activation_dtype", mode="before")
    @classmethod
    def _aliases(cls, value):
        return _QAT_DTYPE_ALIASES.get(value, value)


class MemorySettings(BaseModel):
    """What a step computes in, keeps and recomputes."""

    bf16: bool | Literal["auto", "full"] = "auto"
    """bf16 compute with fp32 master weights and fp32 gradient reduction. auto: on for CUDA, off on CPU.
    full (Axolotl's name): the weights themselves are bf16, with no fp32 copy, and so are their gradients
    (still reduced in fp32): a full fine-tune holds 6 bytes a parameter with 8-bit AdamW instead of 10. Needs
    optimizer: adamw_8bit, whose update rounds to bf16 stochastically (to nearest, most small updates would
    be lost); full fine-tunes only (not with adapter, fp8 or qat)."""
    fp16: bool = False
    """Not supported (bf16 is); kept so Axolotl configs give a clear message."""
    gradient_checkpointing: bool = False
    """Axolotl's switch: true means activation_checkpointing: full."""
    activation_checkpointing: Literal["none", "full", "selective"] | None = None
    """none, full (recompute each layer) or selective (keep matmul/attention outputs, recompute the rest).
    fsdp_config.activation_checkpointing: true lands here as full."""
    torch_compile: bool = False
    """Compile each decoder layer with torch.compile."""
    fused_cross_entropy: bool = True
    """lm_head and the cross-entropy fused over token chunks: the (tokens x vocabulary) logits and their gradient
    are never held (Axolotl's liger_fused_linear_cross_entropy and cut_cross_entropy mean this). false: the
    model's logits go to the chunked cross-entropy."""
    fused_lora_mlp: bool = False
    """LoRA on gate/up/down of a SwiGLU MLP (Llama, Mistral, Qwen2/3): run each MLP as one operator whose
    backward holds ~2.5 (tokens x intermediate) tensors instead of seven (same numbers). On one H200, an 8B at
    4,096 tokens, full checkpointing: 0.9 GiB less and ~9% slower; worth it where memory is what fails."""
    tiled_mlp: bool = False
    """Run each dense MLP over sequence tiles, so only one tile's (tokens x intermediate) tensors exist at a time
    (one more MLP forward per step; for rows of ~32k tokens and more)."""
    tiled_mlp_num_shards: int | None = Field(None, ge=1)
    """Tiles per MLP call; unset: from the row length (one tile's intermediates <= one hidden-state tensor)."""
    activation_offloading: bool | Literal["legacy", "disk"] = False
    """Keep the inputs that full activation checkpointing saves per layer in pinned host memory between forward
    and backward, copied on a side stream (needs gradient_checkpointing / activation_checkpointing: full).
    true (or Axolotl's legacy): as many layers as host memory holds, all but the last."""
    activation_offload_layers: int | None = Field(None, ge=0)
    """How many of the first decoder layers offload their inputs (default: as many as host memory holds)."""
    embedding_offload: bool = False
    """Keep the frozen input embedding in pinned host memory; each step sends only its tokens' rows to the GPU
    (an 8B's 1 GiB table leaves the GPU; same numbers). With adapter: lora / qlora on one GPU, a model whose
    embedding is not tied to lm_head (Llama 3 8B, Qwen3 8B, Mistral)."""
    fsdp_wrap: Literal["block", "model"] | int = "block"
    """FSDP unit: each layer, N layers, or the whole model."""
    reshard_after_forward: bool | int = True
    """Free gathered parameters after forward (true), keep them (false), or keep them sharded over N ranks.
    fsdp_config.reshard_after_forward lands here."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (fsdp_config.offload_params)."""
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"
    """With gradient_accumulation_steps > 1: every_micro_batch reduce-scatters each micro-batch's gradients
    into the sharded fp32 gradients (the dp_replicate all-reduce waits for the last); last_micro_batch keeps
    full unsharded fp32 gradients between micro-batches (4 bytes x parameters / tp more per GPU) for one
    reduce-scatter per step. The planner calls them 'every' and 'last'."""
    fp8: bool = False
    """FP8 linear layers (torchao float8; pip install 'ndparallel[fp8]'); needs a GPU of compute capability >= 8.9."""
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao recipe: one scale per tensor (fastest), per row, or per row with bf16 weight gradients."""
    fp8_enable_fsdp_float8_all_gather: bool | None = None
    """All-gather FSDP weights in float8 (tensorwise); default: whenever weights are sharded over > 1 rank."""
    fp8_keep_bf16_layers: list[int] = Field(default_factory=lambda: [0, -1])
    """Decoder layers (indices, negative from the end) whose linears stay bf16; default the first and last."""
    fp8_keep_bf16_modules: list[str] = Field(default_factory=lambda: ["lm_head"])
    """Module-name patterns (fnmatch) that stay bf16; default the output head."""
    fp8_min_features: int = Field(2048, ge=16)
    """Linears with fewer in or out features than this stay bf16 (casts cost more than FP8 saves)."""
    qat: QatSettings | None = None
    """Quantization-aware training (torchao fake quantization of every linear layer; Axolotl's block:
    weight_dtype, activation_dtype, group_size, quantize_embedding, fake_quant_after_n_steps)."""

    @field_validator("fsdp_wrap", mode="before")
    @classmethod
    def _wrap_positive(cls, value):
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("must be 'block', 'model' or a positive number of layers")
        return value

    @property
    def ac_mode(self) -> str:
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "full" if self.gradient_checkpointing else "none"

    @property
    def qat_spec(self):
        """The qat block as ``qat.QatSpec`` (None without one)."""
        return QatSpec(**self.qat.model_dump()) if self.qat is not None else None
