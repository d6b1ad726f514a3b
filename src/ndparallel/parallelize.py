"""Apply every strategy to a Hugging Face decoder model, in the one order that composes.

0. QAT (optional, ``adapters/qat.py``) swaps every linear for torchao's fake-quantized one, before anything holds on
   to the modules. FP8 (optional) swaps the chosen linears for torchao's ``Float8Linear`` before anything
   splits them. A plain lm_head becomes a ``LossHead`` (same parameters), which can hand its input to the
   fused loss instead of computing the logits (``loss/head.py``). ``load_in_8bit`` turns the blocks'
   linears into int8 codes with row scales here too, so tensor parallelism splits codes and scales as it
   splits weights (``quantized/int8.py``).
1. Tensor parallel first: it replaces weights by DTensors split over ``tp`` and installs sequence
   parallelism. Everything after it sees the split model. Mixture-of-experts blocks are not split by tp
   (each tp rank runs them on its own tokens); expert parallelism then splits the experts over ``ep``.
   LoRA adapters (optional) come right after, placed to match the split of the weight each adapts; then
   ``load_in_4bit``'s NF4 weights (``quantized/nf4.py``), which FSDP shards as they are.
2. Context-parallel attention: switch the model's attention to ndparallel's CP implementation (through
   transformers' attention registry). It changes no weights. A family whose attention ndparallel's cannot
   reproduce (Gemma 2's soft-capping, Falcon's direct SDPA call) keeps its own, and cp must be 1.
3. Activation checkpointing wraps each decoder layer, so the wrapped unit is what recomputes (the MLPs
   first run over sequence tiles if asked, ``tiled_mlp``; offloaded inputs go to host memory, ``offload.py``).
4. ``torch.compile`` per layer, after checkpointing (the checkpoint is traced into the graph; with offloading
   the layer inside the wrapper is compiled) and before FSDP (whose hooks must stay outside the graphs).
5. FSDP2 last, on the (dp_replicate, dp_shard x cp) mesh: it shards whatever parameters the steps above
   produced, DTensors from TP included, and owns mixed precision and offload. On a world of one rank
   there is nothing to shard: flat fp32 masters with bf16 compute copies (``parallel/single_rank.py``)
   give the same numbers without FSDP's copies.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ndparallel.adapters.freeze import apply_trainable, select_trainable, store_frozen_in
from ndparallel.adapters.lora import LoraSpec, attach_lora
from ndparallel.adapters.qat import QatSpec, apply_qat
from ndparallel.errors import ConfigError
from ndparallel.loss.head import install_loss_head
from ndparallel.mesh.topology import Topology
from ndparallel.models.decoder import decoder_parts
from ndparallel.models.families import needs_eager_attention
from ndparallel.parallel.checkpointing import apply_activation_checkpointing
from ndparallel.parallel.compile import apply_compile
from ndparallel.parallel.context import apply_context_parallel
from ndparallel.parallel.expert import apply_expert_parallel, apply_moe_tensor_parallel, moe_fsdp_units
from ndparallel.parallel.float8 import Fp8Spec, check_fp8_supported, convert_to_fp8
from ndparallel.parallel.fsdp import apply_fsdp, wrap_units
from ndparallel.parallel.rules import check_model
from ndparallel.parallel.single_rank import apply_single_rank, eligible
from ndparallel.parallel.tensor import apply_tensor_parallel
from ndparallel.parallel.tiled_mlp import apply_tiled_mlp
from ndparallel.quantized.int8 import replicate_rowwise_scales
from ndparallel.quantized.linears import FORMATS, check_supported, quantize_linears
from ndparallel.quantized.nf4 import is_nf4

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
    reduce_dtype: str | torch.dtype | None = "float32"
    """Dtype gradients are reduced in across data-parallel ranks."""
    activation_checkpointing: str = "none"
    """'none', 'full' (recompute each layer) or 'selective' (save matmul/attention outputs, recompute the rest)."""
    compile: bool = False
    """Compile each decoder layer with torch.compile."""
    tiled_mlp: bool = False
    """Run each dense MLP over sequence tiles, one tile's intermediates at a time (``parallel/tiled_mlp.py``)."""
    tiled_mlp_num_shards: int | None = None
    """Tiles per MLP call; None: from the row length (one tile's intermediates <= one hidden-state tensor)."""
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
    """Frozen quantized base weights under LoRA (``quantized/``): 'nf4' (QLoRA, 4-bit) or 'int8' (8-bit,
    one scale per row) for the decoder blocks' linear weights; needs ``lora``. None: unquantized."""
    fused_loss: bool = True
    """Give lm_head's input to the fused linear + cross-entropy loss (``loss/fused.py``) instead of computing
    the (tokens x vocabulary) logits, when the loss goes through ``step.model_loss`` (the trainer's does).
    The head stays a plain linear layer for any other caller (``loss/head.py``)."""
    single_rank_fsdp: bool = False
    """Wrap with FSDP2 even when the world is one rank. By default one rank keeps its parameters in flat
    buffers instead (same numbers, less copying); this restores the FSDP path (for comparisons)."""


def parallelize(
    model: nn.Module, topology: Topology, *, options: ParallelOptions | None = None, lora: LoraSpec | None = None
) -> nn.Module:
    """Parallelize ``model`` in place over ``topology`` and return it.

    ``lora``: add LoRA adapters after tensor parallelism (so they take the split of the layer they adapt)
    and freeze every other weight. The optimizer must be built afterwards (on the sharded parameters).
    """
    options = options or ParallelOptions()
    if options.qat is not None:  # swaps modules: before anything holds on to them
        if lora is not None or options.fp8 or options.quantized_base or topology.layout.tp > 1:
            raise ConfigError("qat is not supported with LoRA, fp8, quantized base weights or tensor parallelism")
        apply_qat(model, options.qat)
    parts = decoder_parts(model)
    check_model(topology.layout, model.config)
    if options.unfrozen_parameters is not None and lora is not None:
        raise ConfigError("unfrozen_parameters with LoRA is not supported: LoRA already freezes the base weights")
    # chosen on the model as built (global shapes), applied once TP and EP have re-created the parameters
    trainable = select_trainable(model, options.unfrozen_parameters) if options.unfrozen_parameters else None
    fp8 = Fp8Spec() if options.fp8 is True else options.fp8 or None
    if fp8 is not None:
        check_fp8_supported(topology.device, fp8)
        if lora is not None:
            raise ConfigError(
                "fp8: true with adapter: lora is not supported (LoRA's adapters are far below FP8's "
                "useful size and its frozen-base path is not validated); set fp8: false"
            )
        convert_to_fp8(parts, fp8, fsdp_size=1 if options.cpu_offload else topology.layout.fsdp_size)
    if options.fused_loss and install_loss_head(model) is not None:
        parts = decoder_parts(model)  # the head is a LossHead now (same parameters, same names)
    quantized = options.quantized_base
    param_dtype = as_dtype(options.param_dtype, setting="param_dtype")
    reduce_dtype = as_dtype(options.reduce_dtype, setting="reduce_dtype")
    prefix = next(name for name, module in model.named_modules() if module is parts.layers)
    if quantized is not None:
        if quantized not in FORMATS:
            raise ConfigError(f"quantized_base={quantized!r} must be one of {sorted(FORMATS)} or None")
        check_supported(quantized, lora=lora is not None, tp=topology.layout.tp, fp8=fp8 is not None)
    if quantized == "int8":  # before tensor parallelism, which splits codes and scales like weights
        quantize_linears(parts.layers, "int8", shards=1, dtype=param_dtype or torch.float32, prefix=prefix)
    apply_tensor_parallel(parts, topology.tp)
    if quantized == "int8":
        replicate_rowwise_scales(parts.layers)
    apply_moe_tensor_parallel(parts, topology.tp)
    apply_expert_parallel(parts, topology)
    if trainable is not None:
        apply_trainable(model, trainable)
    if lora is not None:
        attach_lora(model, lora, tp_mesh=topology.tp, ep_mesh=topology.experts.ep if topology.layout.ep > 1 else None)
    ignored = None
    if quantized == "nf4":
        # NF4 codes dequantize to the compute dtype; FSDP shards them by rows (one shard with cpu_offload)
        shards = 1 if options.cpu_offload and topology.world_size == 1 else topology.layout.fsdp_size
        quantize_linears(parts.layers, "nf4", shards=shards, dtype=param_dtype or torch.float32, prefix=prefix)
        # FSDP2 gathers over a group of one rank with the first all-gather input only (torch 2.13), which
        # breaks a 4-bit weight (three inputs): with nothing to shard, FSDP leaves such weights alone.
        ignored = {p for p in model.parameters() if is_nf4(p)} if shards == 1 else None
    if param_dtype is not None:
        store_frozen_in(model, param_dtype)  # frozen weights are only read in the compute dtype
    if parts.own_attention is None:
        apply_context_parallel(model, topology)
    elif needs_eager_attention(model.config) and model.config._attn_implementation == "sdpa":
        warnings.warn(
            "attention-logit soft-capping needs transformers' eager attention (SDPA has no soft cap); "
            "switching this model from sdpa to eager",
            stacklevel=2,
        )
        model.set_attn_implementation("eager")
    # else the model keeps transformers' attention (cp is 1: check_model refused more), which takes packed
    # rows exactly through transformers' document masks built from the position ids.
    if options.tiled_mlp:
        apply_tiled_mlp(parts, num_tiles=options.tiled_mlp_num_shards)
    apply_activation_checkpointing(
        parts, options.activation_checkpointing, offload_layers=options.activation_offload_layers
    )
    if options.compile:
        # Inside the wrapper when it runs Python of its own (offload) or holds nested checkpoints (tiled MLP):
        # on the H200 at 131k tokens, compiling the wrapper around tiled MLPs ran at 35.2k tok/s, compiling
        # inside it (with offload) at 44.0k, against 40.5k untiled (RESULTS.md, issue 33)
        apply_compile(parts, inside_checkpoint=options.activation_offload_layers > 0 or options.tiled_mlp)
    wrap_units(list(parts.layers), options.fsdp_wrap)  # the same error on one rank as on many
    flat = not options.cpu_offload and not options.single_rank_fsdp
    if topology.world_size == 1 and flat and eligible(model):
        if next(model.parameters()).device.type != "meta":
            model.to(topology.device)  # as fully_shard would: the model computes where the topology does
        apply_single_rank(model, param_dtype=param_dtype)
        return model
    apply_fsdp(
        parts,
        topology.fully_shard_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        wrap=options.fsdp_wrap,
        reshard_after_forward=options.reshard_after_forward,
        cpu_offload=options.cpu_offload,
        inner_units=moe_fsdp_units(parts, topology),
        ignored_params=ignored,
    )
    return model
