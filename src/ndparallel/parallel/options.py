"""How the model is parallelized beyond the four sizes: ``ParallelOptions``, every field with a safe default.

``parallelize`` (``apply.py``) reads them; the trainer makes them from its config (``train/model.py``), a user's
own loop writes them directly. Nothing here knows the config file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ndparallel.adapters.qat import QatSpec
from ndparallel.errors import ConfigError
from ndparallel.parallel.float8 import Fp8Spec

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def as_dtype(value: str | torch.dtype | None, *, setting: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[value]
    except KeyError:
        raise ConfigError(f"{setting}={value!r} is not a dtype; use one of {sorted(_DTYPES)} or null") from None


@dataclass(frozen=True)
class ParallelOptions:
    """How the model is parallelized beyond the four sizes. Every field has a safe default."""

    param_dtype: str | torch.dtype | None = "bfloat16"
    """Dtype parameters are gathered and computed in (mixed precision); trainable weights keep float32
    masters, frozen ones (LoRA's base, unfrozen_parameters' rest) are stored in this dtype. None computes in
    the parameters' own dtype."""
    master_dtype: str | torch.dtype | None = None
    """Dtype the trainable weights are stored and updated in. None: as the model holds them (float32 masters,
    computed in ``param_dtype`` copies). 'bfloat16' (the config's ``bf16: full``): the weights themselves are
    bf16, with no float32 copy, and so are their gradients (reduced in ``reduce_dtype``): 4 bytes a parameter
    less than float32 masters with bf16 gradients. The optimizer must round its update stochastically (a bf16
    weight rounds most small updates away to nearest): torchao's AdamW8bit does (``optim/adamw_8bit.py``).
    Full fine-tunes only (``rules.py``)."""
    reduce_dtype: str | torch.dtype | None = "float32"
    """Dtype gradients are reduced in across data-parallel ranks."""
    activation_checkpointing: str = "none"
    """'none', 'full' (recompute each layer) or 'selective' (save matmul/attention outputs, recompute the rest)."""
    compile: bool = False
    """Compile each decoder layer with torch.compile."""
    fused_lora_mlp: bool = False
    """Under LoRA, each SwiGLU MLP with adapters on its three linears runs as two operators whose backward holds
    ~2.5 (tokens x intermediate) tensors instead of seven (``adapters/lora_mlp.py``); same numbers. Off by
    default: an 8B LoRA step at 4,096 tokens (H100) 0.9 GiB less at 2% less speed on a bf16 base, 0.5 GiB
    less at 13% less on an NF4 base."""
    tiled_mlp: bool = False
    """Run each dense MLP over sequence tiles, one tile's intermediates at a time (``parallel/tiled_mlp.py``)."""
    tiled_mlp_num_shards: int | None = None
    """Tiles per MLP call; None: from the row length (one tile's intermediates <= one hidden-state tensor)."""
    embedding_offload: bool = False
    """Keep the frozen input embedding in pinned host memory and send each step only its tokens' rows
    (``parallel/host_embedding.py``): the table's memory (1 GiB for an 8B) leaves the GPU, the numbers stay the
    same. One process, adapters, an embedding not tied to lm_head (``rules.py``)."""
    activation_offload_layers: int = 0
    """With full activation checkpointing: the inputs of this many first decoder layers wait for their
    backward in pinned host memory (``parallel/offload.py``); at most all layers but the last."""
    fsdp_wrap: str | int = "block"
    """FSDP unit: 'block' (each layer), N (groups of N layers) or 'model' (one unit: least communication,
    most memory)."""
    reshard_after_forward: bool | int = True
    """Free gathered parameters after forward (True), keep them to backward (False), or keep a copy
    sharded over this many ranks (int; e.g. the GPUs of one node)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    fp8: Fp8Spec | bool | None = None
    """FP8 linears (torchao float8): True for the default ``Fp8Spec``, or a spec; None/False: bf16."""
    unfrozen_parameters: tuple[str, ...] | None = None
    """Train only the weights these patterns select (Axolotl's ``unfrozen_parameters``, ``adapters/freeze.py``);
    None: every weight trains (or, with LoRA, only the adapters)."""
    qat: QatSpec | None = None
    """Quantization-aware training (``adapters/qat.py``): torchao fake-quantized linear layers; not with lora, fp8,
    quantized_base or tp > 1."""
    quantized_base: str | None = None
    """Frozen quantized base weights under LoRA (``quantized/``): 'nf4' (QLoRA, 4-bit), 'int8' (8-bit, one scale
    per row) or 'fp8' (e4m3, one scale per row, FP8 products) for the decoder blocks' linear weights; needs
    ``lora``. None: unquantized."""
    fused_loss: bool = True
    """Give lm_head's input to the fused linear + cross-entropy loss (``loss/fused.py``) instead of computing
    the (tokens x vocabulary) logits, when the loss goes through ``step/token_loss.model_loss`` (the trainer's does).
    The head stays a plain linear layer for any other caller (``loss/head.py``)."""
    single_rank_fsdp: bool = False
    """Wrap with FSDP2 even when the world is one rank. By default one rank keeps its parameters in flat
    buffers instead (same numbers, less copying); this restores the FSDP path (for comparisons)."""
