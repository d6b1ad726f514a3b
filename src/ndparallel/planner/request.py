"""A training config as the planner's request: the one place the trainer's settings become ``best_layout``'s
arguments (``train/setup.resolve_layout`` for ``dp_shard_size: auto``, ``train/oom.planner_advice`` after an
out-of-memory; issue #36: they used to build them apart, and the advice's copy dropped compile and
gradient_sync).
"""

from __future__ import annotations

from typing import Any

from ndparallel.parallel import offload

GIB = 2**30


def layout_request(cfg: Any, *, host_memory_gib: float | None = None) -> dict[str, Any]:
    """``best_layout``'s keyword arguments (all but the model, world size, GPU and its memory) for ``cfg``, a
    ``TrainConfig``: the run as it is configured, long-row features included.

    ``host_memory_gib``: the host memory a node has for offloaded activations; None reads what this machine
    has available now (``offload.host_memory_available``, the count ``train/model.offload_layers`` uses).
    """
    lora = bool(cfg.adapter)
    return {
        "seq_len": cfg.sequence_len,
        "micro_batch_size": cfg.micro_batch_size,
        "precision": "fp32" if cfg.bf16 is False else "bf16",
        "bf16_weights": cfg.bf16 == "full",
        "eight_bit_optimizer": cfg.eight_bit_optimizer,
        "activation_checkpointing": cfg.ac_mode,
        "compile": cfg.torch_compile,
        "gradient_sync": cfg.gradient_sync,
        "cp_comm_strategy": cfg.cp_comm_strategy,
        "lora_rank": cfg.lora_r if lora else None,
        "quantized_base": cfg.quantized_base if lora else None,
        "fused_loss": cfg.fused_cross_entropy,
        "tiled_mlp": cfg.tiled_mlp,
        "tiled_mlp_num_shards": cfg.tiled_mlp_num_shards,
        "activation_offload": bool(cfg.activation_offloading),
        "activation_offload_layers": cfg.activation_offload_layers,
        "embedding_offload": cfg.embedding_offload,
        "host_memory_gib": host_memory_gib if host_memory_gib is not None else offload.host_memory_available() / GIB,
    }
