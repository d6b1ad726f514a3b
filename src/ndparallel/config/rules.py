"""The config's own rules: settings that contradict each other. Which strategies compose is
``parallel/rules.py`` (``option_problems``), asked from here with the config's values, so ``validate``,
``train`` and ``parallelize`` refuse the same things with the same words.

Each function yields one line per problem; ``TrainConfig`` raises the first (its model validator).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ndparallel.parallel.rules import embedding_offload_problems, option_problems
from ndparallel.quantized.linears import FORMATS


def config_problems(cfg: Any) -> Iterator[str]:
    """Every contradiction between the settings of ``cfg`` (a ``TrainConfig``), in the order they are told."""
    yield from _model_problems(cfg)
    yield from _adapter_problems(cfg)
    yield from _data_problems(cfg)
    yield from _schedule_problems(cfg)
    yield from _memory_problems(cfg)


def _model_problems(cfg: Any) -> Iterator[str]:
    if cfg.fp16:
        yield "fp16 is not supported: set bf16: true (bf16 needs no loss scaling)"
    if cfg.base_model is None and cfg.model_shape is None and not cfg.model_config_overrides.get("model_type"):
        yield "no model: set base_model (a HF directory or hub id) or model_shape (tiny, 1b, 3b, 8b)"
    if cfg.base_model is not None and cfg.model_shape is not None:
        yield "base_model and model_shape are both set: keep one (model_shape means random init)"
    if cfg.chat_template == "jinja" and not cfg.chat_template_jinja:
        yield "chat_template: jinja needs chat_template_jinja (the template's source)"


def _adapter_problems(cfg: Any) -> Iterator[str]:
    """Adapters and quantized base weights, then the strategies' own rules (``parallel/rules.py``)."""
    if cfg.adapter == "qlora" and not cfg.load_in_4bit:
        yield "adapter: qlora needs load_in_4bit: true (its base weights are 4-bit); or use adapter: lora"
    yield from option_problems(
        lora=cfg.adapter is not None,
        quantized_base=cfg.quantized_base,
        fp8=cfg.fp8,
        qat=cfg.qat_spec,
        unfrozen=cfg.unfrozen_parameters is not None,
        tp=cfg.tensor_parallel_size,
        bf16_weights=cfg.bf16 == "full",
    )
    chosen = [setting for setting in FORMATS.values() if getattr(cfg, setting)]
    if len(chosen) > 1:
        yield f"{' and '.join(chosen)} are {'all' if len(chosen) > 2 else 'both'} true: keep one"
    quantized = FORMATS.get(cfg.quantized_base)  # the setting's name
    if quantized and cfg.export_hf:
        yield (
            f"export_hf with {quantized} is not supported: the run writes its PEFT adapter to "
            f"output_dir/adapter; load it on base_model with peft (or merge with peft's merge_and_unload)"
        )
    targets = cfg.lora_target_modules or cfg.lora_target_linear or cfg.lora_target_parameters
    if cfg.adapter in ("lora", "qlora") and not targets:
        yield (
            "adapter: lora needs lora_target_modules (e.g. [q_proj, v_proj]), lora_target_linear: true or "
            "lora_target_parameters (MoE expert weights)"
        )
    if cfg.adapter is None and targets:
        yield (
            "lora_target_modules / lora_target_linear / lora_target_parameters are set but adapter is not: add "
            "adapter: lora"
        )


def _data_problems(cfg: Any) -> Iterator[str]:
    if not cfg.datasets and not cfg.pretraining_dataset:
        yield "datasets is empty: add at least one entry with a path and a type (or a pretraining_dataset)"
    if cfg.pretraining_dataset and cfg.max_steps is None:
        yield "pretraining_dataset needs max_steps (the corpus is read only as far as the steps need)"
    if cfg.pretraining_dataset and any(p.type not in ("pretrain", "completion") for p in cfg.pretraining_dataset):
        yield "pretraining_dataset entries are read as text (type: pretrain or completion)"


def _schedule_problems(cfg: Any) -> Iterator[str]:
    both = [("warmup_steps", "warmup_ratio"), ("save_steps", "saves_per_epoch"), ("eval_steps", "evals_per_epoch")]
    for one, other in both:
        if getattr(cfg, one) is not None and getattr(cfg, other) is not None:
            yield f"{one} and {other} are both set: keep one"
    if cfg.save_strategy == "best":
        yield (
            "save_strategy: best (keep the checkpoint with the best eval metric) is not implemented: use steps or epoch"
        )
    if cfg.cosine_constant_lr_ratio and not cfg.cosine_min_lr_ratio:
        yield "cosine_constant_lr_ratio needs cosine_min_lr_ratio (the rate it holds at the end)"
    if (cfg.cosine_min_lr_ratio or cfg.cosine_constant_lr_ratio) and cfg.lr_scheduler != "cosine":
        yield f"cosine_min_lr_ratio applies to lr_scheduler: cosine, not {cfg.lr_scheduler}"


def _memory_problems(cfg: Any) -> Iterator[str]:
    if cfg.bf16 == "full" and not cfg.eight_bit_optimizer:
        yield (
            f"bf16: full (bf16 weights, no fp32 copy) needs an update that rounds to bf16 stochastically, which "
            f"optimizer: adamw_8bit does; optimizer: {cfg.optimizer} would round most small updates away: set "
            f"optimizer: adamw_8bit, or bf16: true"
        )
    if cfg.fused_lora_mlp and cfg.adapter is None:
        yield "fused_lora_mlp runs LoRA-adapted MLPs as one operator: add adapter: lora, or remove fused_lora_mlp"
    elif cfg.fused_lora_mlp and cfg.lora_dropout:
        yield (
            f"fused_lora_mlp has no LoRA dropout (lora_dropout: {cfg.lora_dropout}): set lora_dropout: 0, or "
            "remove fused_lora_mlp"
        )
    elif cfg.fused_lora_mlp and cfg.tensor_parallel_size > 1:
        yield "fused_lora_mlp computes each MLP from whole weights: not with tensor_parallel_size > 1; remove one"
    if cfg.embedding_offload:
        yield from embedding_offload_problems(
            adapters=cfg.adapter is not None,
            embedding_trained=any("embed" in name for name in cfg.lora_modules_to_save or []),
            cpu_offload=cfg.cpu_offload,
        )
    if cfg.activation_offloading == "disk":
        yield "activation_offloading: disk is not implemented: use true (pinned host memory)"
    if cfg.activation_offloading and cfg.ac_mode != "full":
        yield (
            "activation_offloading moves the layer inputs that full activation checkpointing keeps: set "
            "gradient_checkpointing: true (or activation_checkpointing: full)"
        )
