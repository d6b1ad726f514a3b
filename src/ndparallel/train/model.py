"""The model of a run: its config, the options its config asks of ``parallelize`` (``parallel_options``: the one
function from a training config to ``ParallelOptions``), and the model built on the meta device, parallelized,
then filled shard by shard."""

from __future__ import annotations

import math
import os

import torch

from ndparallel.adapters.lora import LoraSpec
from ndparallel.config.schema import TrainConfig
from ndparallel.mesh.layout import Layout
from ndparallel.mesh.topology import Topology
from ndparallel.parallel import offload
from ndparallel.parallel.apply import parallelize
from ndparallel.parallel.float8 import Fp8Spec
from ndparallel.parallel.options import ParallelOptions
from ndparallel.train.run_inputs import base_model_dir
from ndparallel.train.setup_progress import SetupProgress, weights_phase
from ndparallel.weights.materialize import initialize_adapters, materialize
from ndparallel.weights.meta import meta_model, model_config_for


def run_model_config(cfg: TrainConfig):
    """The model's config as the run builds it (hub id, directory or preset, with the config's overrides)."""
    return model_config_for(
        base_model=cfg.base_model,
        model_shape=cfg.model_shape,
        overrides=cfg.model_config_overrides,
        max_position_embeddings=cfg.sequence_len,
        revision=cfg.revision_of_model,
        trust_remote_code=cfg.trust_remote_code,
    )


def parallel_options(cfg: TrainConfig, device: torch.device, *, offloaded: int = 0) -> ParallelOptions:
    """What ``cfg`` asks of ``parallelize`` on ``device``; ``offloaded``: the decoder layers whose inputs wait
    in host memory (``offload_layers``)."""
    bf16 = cfg.bf16 if cfg.bf16 != "auto" else device.type == "cuda"
    return ParallelOptions(
        param_dtype="bfloat16" if bf16 else None,
        master_dtype="bfloat16" if cfg.bf16 == "full" else None,
        reduce_dtype="float32",
        activation_checkpointing=cfg.ac_mode,
        compile=cfg.torch_compile,
        fused_loss=cfg.fused_cross_entropy,
        fused_lora_mlp=cfg.fused_lora_mlp,
        tiled_mlp=cfg.tiled_mlp,
        tiled_mlp_num_shards=cfg.tiled_mlp_num_shards,
        activation_offload_layers=offloaded,
        embedding_offload=cfg.embedding_offload,
        fsdp_wrap=cfg.fsdp_wrap,
        reshard_after_forward=cfg.reshard_after_forward,
        cpu_offload=cfg.cpu_offload,
        fp8=fp8_spec(cfg),
        unfrozen_parameters=tuple(cfg.unfrozen_parameters) if cfg.unfrozen_parameters else None,
        quantized_base=cfg.quantized_base,
        qat=cfg.qat_spec,
    )


def fp8_spec(cfg: TrainConfig) -> Fp8Spec | None:
    if not cfg.fp8:
        return None
    return Fp8Spec(
        recipe=cfg.fp8_recipe,
        keep_bf16_layers=tuple(cfg.fp8_keep_bf16_layers),
        keep_bf16_modules=tuple(cfg.fp8_keep_bf16_modules),
        min_features=cfg.fp8_min_features,
        fsdp_float8_all_gather=cfg.fp8_enable_fsdp_float8_all_gather,
    )


def offload_layers(cfg: TrainConfig, model_config, layout: Layout, *, ranks_on_node: int | None = None) -> int:
    """How many first decoder layers keep their inputs in host memory (0 without activation_offloading)."""
    if not cfg.activation_offloading:
        return 0
    tokens = cfg.micro_batch_size * math.ceil(math.ceil(cfg.sequence_len / layout.cp) / layout.tp)
    itemsize = 4 if cfg.bf16 is False or (cfg.bf16 == "auto" and cfg.device == "cpu") else 2
    ranks = ranks_on_node or int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    return offload.offload_layer_count(
        cfg.activation_offload_layers,
        num_layers=model_config.num_hidden_layers,
        layer_bytes=tokens * model_config.hidden_size * itemsize,
        ranks_on_node=ranks,
        host_bytes=offload.host_memory_available(),
    )


def build_model(
    cfg: TrainConfig,
    model_config,
    topo: Topology,
    *,
    vocab_from: int | None = None,
    offloaded: int = 0,
    progress: SetupProgress | None = None,
) -> tuple[torch.nn.Module, LoraSpec | None]:
    """The model built on the meta device, parallelized, then filled shard by shard (offloaded: on the CPU)."""
    options = parallel_options(cfg, topo.device, offloaded=offloaded)
    model = meta_model(model_config)
    lora = LoraSpec.from_config(cfg)
    progress = progress or SetupProgress(enabled=False)

    def place() -> None:
        with progress.phase("applying the layout to the model (built on the meta device: no memory yet)"):
            parallelize(model, topo, options=options, lora=lora)

    def fill(on_cpu: bool) -> None:
        with progress.phase(weights_phase(cfg)):
            weights = base_model_dir(cfg)
            materialize(
                model, topo.device, weights_dir=weights, seed=cfg.seed, offload_params=on_cpu, vocab_from=vocab_from
            )

    if cfg.cpu_offload and topo.world_size == 1:
        # FSDP2 takes over a one-rank unit's parameters when fully_shard runs (it re-reads them later only when
        # they are sharded), so offloaded parameters must have their CPU storage before it.
        fill(True)
        place()
        initialize_adapters(model, cfg.seed)
    else:
        place()
        fill(cfg.cpu_offload)
    model.train()
    return model, lora
