"""Apply every strategy to a Hugging Face decoder model, in the one order that composes (``parallelize``: one
function per stage below, after the rules of ``rules.py`` have said the options and the model compose).

0. QAT (optional, ``adapters/qat.py``) swaps every linear for torchao's fake-quantized one, before anything holds on
   to the modules. FP8 (optional) swaps the chosen linears for torchao's ``Float8Linear`` before anything
   splits them. A plain lm_head becomes a ``LossHead`` (same parameters), which can hand its input to the
   fused loss instead of computing the logits (``loss/head.py``). ``load_in_8bit`` turns the blocks'
   linears into int8 codes with row scales here too, so tensor parallelism splits codes and scales as it
   splits weights (``quantized/int8.py``); ``load_in_fp8`` into e4m3 codes the same way (``quantized/fp8.py``).
1. Tensor parallel first: it replaces weights by DTensors split over ``tp`` and installs sequence
   parallelism. Everything after it sees the split model. Mixture-of-experts blocks are not split by tp
   (each tp rank runs them on its own tokens); expert parallelism then splits the experts over ``ep``.
   LoRA adapters (optional) come right after, placed to match the split of the weight each adapts; then
   ``load_in_4bit``'s NF4 weights (``quantized/nf4.py``), which FSDP shards as they are. Frozen weights are
   stored in the compute dtype; with ``master_dtype`` (``bf16: full``) the trainable ones too.
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

import torch
from torch import nn

from ndparallel.adapters.freeze import apply_trainable, select_trainable, store_frozen_in, store_weights_in
from ndparallel.adapters.lora import LoraSpec, attach_lora
from ndparallel.adapters.lora_mlp import apply_lora_mlp
from ndparallel.adapters.qat import apply_qat
from ndparallel.errors import ConfigError
from ndparallel.loss.head import install_loss_head
from ndparallel.mesh.topology import Topology
from ndparallel.models.decoder import DecoderParts, decoder_parts
from ndparallel.models.families import needs_eager_attention
from ndparallel.parallel.activation_checkpoint import apply_activation_checkpointing
from ndparallel.parallel.compile import apply_compile
from ndparallel.parallel.context import apply_context_parallel
from ndparallel.parallel.expert import apply_expert_parallel, apply_moe_tensor_parallel, moe_fsdp_units
from ndparallel.parallel.float8 import Fp8Spec, check_fp8_supported, convert_to_fp8
from ndparallel.parallel.fsdp import apply_fsdp, wrap_units
from ndparallel.parallel.host_embedding import offload_embedding
from ndparallel.parallel.options import ParallelOptions, as_dtype
from ndparallel.parallel.rules import check_model, check_options, embedding_offload_problems
from ndparallel.parallel.single_rank import apply_single_rank, eligible
from ndparallel.parallel.tensor import apply_tensor_parallel
from ndparallel.parallel.tiled_mlp import apply_tiled_mlp
from ndparallel.quantized.fp8 import check_device as check_fp8_base_device
from ndparallel.quantized.int8 import replicate_rowwise_scales
from ndparallel.quantized.linears import quantize_linears
from ndparallel.quantized.nf4 import is_nf4


def parallelize(
    model: nn.Module, topology: Topology, *, options: ParallelOptions | None = None, lora: LoraSpec | None = None
) -> nn.Module:
    """Parallelize ``model`` in place over ``topology`` and return it.

    ``lora``: add LoRA adapters after tensor parallelism (so they take the split of the layer they adapt)
    and freeze every other weight. The optimizer must be built afterwards (on the sharded parameters).
    """
    options = options or ParallelOptions()
    fp8 = Fp8Spec() if options.fp8 is True else options.fp8 or None
    master_dtype = as_dtype(options.master_dtype, setting="master_dtype")
    check_options(
        lora=lora is not None,
        quantized_base=options.quantized_base,
        fp8=fp8 is not None,
        qat=options.qat,
        unfrozen=options.unfrozen_parameters is not None,
        tp=topology.layout.tp,
        bf16_weights=master_dtype == torch.bfloat16,
    )
    if options.qat is not None:  # swaps modules: before anything holds on to them
        apply_qat(model, options.qat)
    parts = decoder_parts(model)
    check_model(topology.layout, model.config)
    # chosen on the model as built (global shapes), applied once TP and EP have re-created the parameters
    trainable = select_trainable(model, options.unfrozen_parameters) if options.unfrozen_parameters else None
    dtypes = (
        as_dtype(options.param_dtype, setting="param_dtype"),
        as_dtype(options.reduce_dtype, setting="reduce_dtype"),
    )
    parts = _swap_linears(parts, topology, options, fp8, param_dtype=dtypes[0])
    ignored = _split(parts, topology, options, lora=lora, trainable=trainable, param_dtype=dtypes[0])
    if master_dtype is not None:  # after TP and EP re-created the parameters, before FSDP shards them
        store_weights_in(model, master_dtype)
    _switch_attention(model, parts, topology)
    _recompute_and_compile(parts, options, lora)
    if options.embedding_offload:  # the frozen table, in its stored dtype, before anything moves the model
        ignored = (ignored or set()) | {_offload_embedding(model, topology, options, lora=lora is not None)}
    _shard(model, parts, topology, options, dtypes=dtypes, ignored=ignored)
    return model


def _offload_embedding(model: nn.Module, topology: Topology, options: ParallelOptions, *, lora: bool) -> nn.Parameter:
    """The input embedding into host memory (``host_embedding.py``), after its rules with the real model."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    table = embedding.weight
    for problem in embedding_offload_problems(
        adapters=lora or options.quantized_base is not None,
        embedding_trained=table.requires_grad,
        cpu_offload=options.cpu_offload,
        world_size=topology.world_size,
        tied=head is not None and head.weight is table,
        plain_lookup=type(embedding) is nn.Embedding and embedding.max_norm is None,
    ):
        raise ConfigError(problem)
    return offload_embedding(model, topology.device).weight


def _swap_linears(
    parts: DecoderParts, topology: Topology, options: ParallelOptions, fp8: Fp8Spec | None, *, param_dtype
) -> DecoderParts:
    """Stage 0: FP8 linears, the loss head, int8 base weights: modules swapped before anything splits them."""
    model = parts.model
    if fp8 is not None:
        check_fp8_supported(topology.device, fp8)
        convert_to_fp8(parts, fp8, fsdp_size=1 if options.cpu_offload else topology.layout.fsdp_size)
    if options.fused_loss and install_loss_head(model) is not None:
        parts = decoder_parts(model)  # the head is a LossHead now (same parameters, same names)
    if options.quantized_base in ("int8", "fp8"):  # before tensor parallelism, which splits codes and scales
        if options.quantized_base == "fp8":
            check_fp8_base_device(topology.device)
        fmt, dtype = options.quantized_base, param_dtype or torch.float32
        quantize_linears(parts.layers, fmt, shards=1, dtype=dtype, prefix=_layers_prefix(model, parts))
    return parts


def _split(
    parts: DecoderParts,
    topology: Topology,
    options: ParallelOptions,
    *,
    lora: LoraSpec | None,
    trainable: set[str] | None,
    param_dtype,
) -> set | None:
    """Stage 1: tensor and expert parallelism, then what trains (unfrozen weights or LoRA adapters placed like
    the split layers), then NF4 base weights. Returns the parameters FSDP must leave alone (None: none)."""
    model = parts.model
    apply_tensor_parallel(parts, topology.tp)
    if options.quantized_base == "int8":
        replicate_rowwise_scales(parts.layers)
    apply_moe_tensor_parallel(parts, topology.tp)
    apply_expert_parallel(parts, topology)
    if trainable is not None:
        apply_trainable(model, trainable)
    if lora is not None:
        attach_lora(model, lora, tp_mesh=topology.tp, ep_mesh=topology.experts.ep if topology.layout.ep > 1 else None)
    ignored = None
    if options.quantized_base == "nf4":
        # NF4 codes dequantize to the compute dtype; FSDP shards them by rows (one shard with cpu_offload)
        shards = 1 if options.cpu_offload and topology.world_size == 1 else topology.layout.fsdp_size
        dtype = param_dtype or torch.float32
        quantize_linears(parts.layers, "nf4", shards=shards, dtype=dtype, prefix=_layers_prefix(model, parts))
        # FSDP2 gathers over a group of one rank with the first all-gather input only (torch 2.13), which
        # breaks a 4-bit weight (three inputs): with nothing to shard, FSDP leaves such weights alone.
        ignored = {p for p in model.parameters() if is_nf4(p)} if shards == 1 else None
    if param_dtype is not None:
        store_frozen_in(model, param_dtype)  # frozen weights are only read in the compute dtype
    return ignored


def _switch_attention(model: nn.Module, parts: DecoderParts, topology: Topology) -> None:
    """Stage 2: ndparallel's attention (exact for packed rows, context-parallel when cp > 1)."""
    if parts.own_attention is None:
        apply_context_parallel(model, topology)
    elif needs_eager_attention(model.config) and model.config._attn_implementation == "sdpa":
        warnings.warn(
            "attention-logit soft-capping needs transformers' eager attention (SDPA has no soft cap); "
            "switching this model from sdpa to eager",
            stacklevel=3,
        )
        model.set_attn_implementation("eager")
    # else the model keeps transformers' attention (cp is 1: check_model refused more), which takes packed
    # rows exactly through transformers' document masks built from the position ids.


def _recompute_and_compile(parts: DecoderParts, options: ParallelOptions, lora: LoraSpec | None) -> None:
    """Stages 3 and 4: LoRA MLPs as one operator, tiled MLPs and activation checkpointing, then
    ``torch.compile`` per layer."""
    if lora is not None and options.fused_lora_mlp:
        if not apply_lora_mlp(parts, scaling=lora.scaling, dropout=lora.dropout):
            warnings.warn(
                "fused_lora_mlp: no MLP qualifies (it needs LoRA on gate_proj, up_proj and down_proj of a SwiGLU "
                "MLP, no lora_dropout); the MLPs run as modules",
                stacklevel=2,
            )
    if options.tiled_mlp:
        apply_tiled_mlp(parts, num_tiles=options.tiled_mlp_num_shards)
    apply_activation_checkpointing(
        parts, options.activation_checkpointing, offload_layers=options.activation_offload_layers
    )
    if options.compile:
        # Inside the wrapper when it holds nested checkpoints (tiled MLP): on the H200 at 131k tokens, compiling
        # the wrapper around tiled MLPs ran at 35.2k tok/s, compiling inside it at 44.0k, against 40.5k untiled
        # (RESULTS.md, issue 33). Offload's hooks stay outside the graph either way.
        apply_compile(parts, inside_checkpoint=options.tiled_mlp)


def _shard(
    model: nn.Module, parts: DecoderParts, topology: Topology, options: ParallelOptions, *, dtypes: tuple, ignored
) -> None:
    """Stage 5: FSDP2 over ``fully_shard_mesh`` (or, on one rank, flat buffers); ``dtypes``: (param, reduce)."""
    param_dtype, reduce_dtype = dtypes
    wrap_units(list(parts.layers), options.fsdp_wrap)  # the same error on one rank as on many
    flat = not options.cpu_offload and not options.single_rank_fsdp
    if topology.world_size == 1 and flat and eligible(model):
        if next(model.parameters()).device.type != "meta":
            model.to(topology.device)  # as fully_shard would: the model computes where the topology does
        apply_single_rank(model, param_dtype=param_dtype)
        return
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


def _layers_prefix(model: nn.Module, parts: DecoderParts) -> str:
    """The decoder blocks' path in the model (for messages)."""
    return next(name for name, module in model.named_modules() if module is parts.layers)
