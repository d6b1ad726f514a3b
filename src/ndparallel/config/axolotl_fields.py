"""Axolotl's settings that are not ndparallel's own: what each one means here, in one table.

An Axolotl config is read as its users wrote it. Every top-level setting is one of:

- an ndparallel setting (``TrainConfig``'s fields, most with Axolotl's own name and meaning);
- an Axolotl spelling translated into one (``translate``: ``fsdp_config``, ``fsdp_version``, ``fsdp``,
  ``ring_attn_func``, ``sequence_parallel_degree``, ``bfloat16``, ``excess_length_strategy``, ...);
- in ``POLICY`` below: accepted and **not used**, because it does not change the trained model (trackers,
  kernel and attention choices, memory tuning, process plumbing), reported once in one line; or
  **refused**, because it changes the result in a way ndparallel does not implement (preference and RL
  training, quantized weights, other adapters, ...), one error line each that says why;
- anything else is an unknown setting (an error with a "did you mean").

A null, false or empty value is Axolotl's "unset": ndparallel settings take their default, and Axolotl-only
settings are listed as left empty in the "not used" line. Nothing is dropped silently.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def is_placeholder(value: Any) -> bool:
    """Axolotl's unset values: null, false, or an empty string, list or mapping."""
    return value is None or value is False or (isinstance(value, (str, list, dict, tuple)) and len(value) == 0)


@dataclass(frozen=True)
class Rule:
    """What one Axolotl setting means here: ``why`` it is not used, and when it is refused instead."""

    why: str
    refuse_if: Callable[[Any], bool] | None = None
    """None: never refused (only reported as not used). Else: refused for the values it returns True for."""

    def refuses(self, value: Any) -> bool:
        return self.refuse_if is not None and self.refuse_if(value)


def _ignored(why: str) -> Rule:
    return Rule(why)


def _refused(why: str, *, unless: Callable[[Any], bool] = is_placeholder) -> Rule:
    return Rule(why, refuse_if=lambda value: not unless(value))


# Reasons, each said once. "Not used" reasons say why the result is the same without the setting;
# "refused" reasons say what would change and what to do instead.
TRACKER = "experiment tracker or upload: metrics go to output_dir/metrics.jsonl (and TensorBoard events)"
KERNEL = "kernel or attention implementation: ndparallel runs its own attention, loss and norm kernels; same result"
MEMORY = "memory or speed tuning: FSDP2, activation checkpointing and the chunked loss manage memory; same result"
PLUMBING = "process plumbing: ndparallel starts, connects and places its own processes"
EVAL_EXTRA = "extra evaluation output: ndparallel evaluates the held-out loss only"
CHECKPOINT_FORMAT = (
    "checkpoint format: checkpoints are sharded and always resumable; a Hugging Face directory "
    "comes from export_hf: true or `ndparallel export`"
)
DEEPSPEED = "DeepSpeed: ndparallel shards with FSDP2 instead (dp_shard_size); the trained model is the same"
PACKING_TUNING = "packing tuning: ndparallel packs documents first-fit in their order"
MODEL_CLASS = "model class: ndparallel trains the causal-LM class of the model's config.json"
RL = (
    "preference, reinforcement-learning and reward-model training are not supported: ndparallel trains "
    "causal language models on the next-token loss; remove this setting (and rl)"
)
QUANTIZED = (
    "quantized weights or quantized training change the numbers; ndparallel trains with bf16 compute and "
    "fp32 master weights: set it to false or remove it"
)
ADAPTER_VARIANT = "this adapter variant is not implemented: ndparallel trains plain LoRA (adapter: lora); remove it"
PARTIAL = (
    "this way of choosing the weights to train is not implemented: list them in unfrozen_parameters, or use "
    "adapter: lora"
)
OPTIMIZER_EXTRA = (
    "this optimizer or schedule option is not implemented (AdamW with one learning rate, "
    "lr_scheduler and warm-up only); remove it"
)
DATA_CHANGE = "this changes which data is trained or how, and is not implemented; remove it"
MULTIMODAL = "multimodal models are not supported: ndparallel trains text decoders"
ARCH_CHANGE = "this changes the model's architecture or weights in a way ndparallel does not implement; remove it"
LAUNCHER = "Ray is not used to launch: start with `ndparallel train` (or torchrun); remove use_ray"
MOE = "mixture-of-experts settings are not part of this config yet; remove them"


def _true(value: Any) -> bool:
    return value is True


# Names (fnmatch patterns allowed) -> rule. Read top to bottom: the first matching line decides.
POLICY: list[tuple[str, Rule]] = [
    # --- not used: the trained model is the same without them ---------------------------------------------
    (
        "use_mlflow mlflow_* hf_mlflow_log_artifacts use_comet comet_* use_trackio trackio_* use_otel_metrics otel_* "
        "use_swanlab swanlab_* use_tensorboard include_tkps include_tokens_per_second profiler_steps "
        "profiler_steps_start gradio_* hub_model_id hub_strategy hub_revision push_dataset_to_hub "
        "hf_use_auth_token",
        _ignored(TRACKER),
    ),
    (
        "attn_implementation flash_attention flash_attn_cross_entropy flash_attn_rms_norm flash_attn_fuse_mlp "
        "flash_attn_d512 flash_optimum sdp_attention xformers_attention flex_attention flex_attn_compile_kwargs "
        "eager_attention sage_attention sdpa_varlen chunked_cross_entropy chunked_cross_entropy_num_chunks "
        "use_kernels lora_mlp_kernel lora_qkv_kernel lora_o_kernel lora_embedding_kernel fused_attn_kernel "
        "experts_implementation use_scattermoe use_sonicmoe liger_* cut_cross_entropy torch_compile_backend "
        "torch_compile_mode torch_compile_options batch_flattening gemma4_hybrid_attn_impl large_head_attention "
        "embeddings_skip_upcast fp32_norms fp32_norm_classes heads_k_stride",
        _ignored(KERNEL),
    ),
    ("tf32", _ignored("float32 matmul precision: matmuls run in bf16 (or exact fp32 on CPU); torch's setting is kept")),
    (
        "tiled_mlp_use_original_mlp layer_offloading gc_steps "
        "gc_collect_steps torch_empty_cache_steps gpu_memory_limit max_memory device_map low_cpu_mem_usage "
        "dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor dataloader_drop_last "
        "dataset_num_proc dataset_processes dataset_keep_in_memory gradient_checkpointing_kwargs "
        "selective_checkpointing dynamic_checkpoint experimental_skip_move_to_device lora_on_cpu "
        "pad_to_sequence_len pad_to_multiple_of remove_unused_columns eval_batch_size skip_prepare_dataset "
        "is_preprocess num_dataset_shards_to_save total_num_tokens total_supervised_tokens deepcompile "
        "preprocess_shards streaming",
        _ignored(MEMORY),
    ),
    (
        "sample_packing_group_size sample_packing_bin_size sample_packing_eff_est sample_packing_mp_start_method "
        "sample_packing_sequentially multipack_real_batches pretrain_multipack_buffer_size "
        "streaming_multipack_buffer_size",
        _ignored(PACKING_TUNING),
    ),
    (
        "local_rank world_size ddp ddp_bucket_cap_mb ddp_broadcast_buffers ddp_find_unused_parameters "
        "accelerator_config axolotl_config_path strict debug is_falcon_derived_model is_llama_derived_model "
        "is_mistral_derived_model is_qwen_derived_model tokenizer_use_fast tokenizer_legacy "
        "tokenizer_save_jinja_files ray_num_workers ray_run_name resources_per_worker "
        "shuffle_before_merging_datasets peft_autocast_adapter_dtype peft_ensure_weight_tying "
        "bnb_config_kwargs",
        _ignored(PLUMBING),
    ),
    (
        "save_first_step",
        _ignored(
            "an extra checkpoint after the first step only checks saving; checkpoints follow "
            "save_steps / saves_per_epoch"
        ),
    ),
    ("deepspeed", _ignored(DEEPSPEED)),
    (
        "test_value",
        _ignored("not a setting of Axolotl either (its schema ignores keys it does not define); nothing reads it"),
    ),
    ("save_safetensors save_only_model fsdp_final_state_dict_type", _ignored(CHECKPOINT_FORMAT)),
    (
        "eval_table_size eval_max_new_tokens do_causal_lm_eval eval_causal_lm_metrics do_bench_eval bench_dataset "
        "bench_split generate_samples generation_* num_generation_samples lm_eval_* metric_for_best_model "
        "greater_is_better loss_watchdog_threshold loss_watchdog_patience",
        _ignored(EVAL_EXTRA),
    ),
    (
        "resize_token_embeddings_to_32x mean_resizing_embeddings",
        _ignored(
            "embedding resizing: when tokens are added the vocabulary grows to a multiple of 64 and new rows "
            "start at the mean of the existing rows"
        ),
    ),
    (
        "model_type type_of_model",
        _refused(
            MODEL_CLASS + "; only *ForCausalLM classes can be trained",
            unless=lambda v: is_placeholder(v) or str(v).endswith("ForCausalLM"),
        ),
    ),
    # --- refused: they change the result --------------------------------------------------------------------
    (
        "rl trl rl_beta dpo_* kto_* orpo_alpha cpo_alpha simpo_gamma rpo_alpha precompute_ref_log_probs "
        "max_prompt_len reward_model process_reward_model center_rewards_coefficient num_labels vllm ebft "
        "reward_funcs",
        _refused(RL),
    ),
    (
        "gptq quantization model_quantization_config model_quantization_config_kwargs "
        "quantize_moe_experts use_onebitllms nvfp4_merge_aware* "
        "qlora_sharded_model_loading nonexpert_quantization",
        _refused(QUANTIZED),
    ),
    (
        "peft peft_use_dora peft_use_rslora peft_layers_to_transform peft_layers_pattern peft_layer_replication "
        "peft_init_lora_weights peft_trainable_token_indices lora_target_parameters lora_fan_in_fan_out "
        "lora_alpha_pattern lora_rank_pattern loraplus_* lora_model_dir relora relora_* use_mora mora mora_type",
        _refused(ADAPTER_VARIANT),
    ),
    ("merge_lora merge_method", _refused("merging is a separate step here: `ndparallel export OUT DIR --merge-lora`")),
    ("lisa_* spectrum_* train_attn train_mlp train_unembed", _refused(PARTIAL)),
    (
        "embedding_lr embedding_lr_scale lr_groups lr_quadratic_warmup lr_div_factor lr_scheduler_kwargs optim_args "
        "optim_target_modules dion_* qgalore_* adam_beta3 adam_epsilon2 torchdistx_path jagged_restart_* "
        "neftune_noise_alpha noisy_embedding_alpha grokfast_*",
        _refused(OPTIMIZER_EXTRA),
    ),
    (
        "test_datasets",
        _refused(
            "separate evaluation datasets are not implemented: hold out a share of the training data with val_set_size"
        ),
    ),
    ("eval_sequence_len", _refused("evaluation rows have sequence_len tokens; remove eval_sequence_len")),
    ("early_stopping_patience", _refused("early stopping is not implemented: set max_steps or num_epochs")),
    ("load_best_model_at_end", _refused("the final model is the last step's; remove load_best_model_at_end")),
    ("auto_find_batch_size", _refused("the batch is what the config says; set micro_batch_size yourself")),
    (
        "batch_size",
        _refused(
            "set micro_batch_size and gradient_accumulation_steps instead (rows per step = "
            "micro_batch_size x data-parallel ranks x gradient_accumulation_steps)"
        ),
    ),
    ("auto_resume_from_checkpoints", _refused("set resume_from_checkpoint: latest to resume")),
    (
        "dataset_shard_num dataset_shard_idx group_by_length "
        "pretraining_sample_concatenation max_packed_sequence_len preprocess_iterable default_system_message "
        "eot_tokens use_pose pose_* added_tokens_overrides eaft_* use_eaft",
        _refused(DATA_CHANGE),
    ),
    (
        "shuffle_merged_datasets pretrain_multipack_attn",
        _refused(DATA_CHANGE + " (only the default, true, is implemented)", unless=lambda v: v is None or v is True),
    ),
    (
        "processor_type processor_kwargs image_size image_resize_algorithm freeze_mm_modules role_boundaries "
        "cls_model_config",
        _refused(MULTIMODAL),
    ),
    (
        "fix_untrained_tokens shrink_embeddings reinit_weights trainer_cls overrides_of_model_kwargs base_model_config "
        "llama4_linearized_experts scaling_softmax scaling_softmax_* s2_attention tokenizer_use_mistral_common "
        "diffusion noise_schedule num_diffusion_steps mask_token_id mask_token_str min_mask_ratio max_mask_ratio "
        "llmcompressor kd_* loss_fn loss_fn_config model_kwargs",
        _refused(ARCH_CHANGE),
    ),
    ("rope_scaling", _refused("rope_scaling belongs under model_config (Axolotl no longer reads it at the top)")),
    ("use_ray", _refused(LAUNCHER)),
    (
        "expert_parallel_* dense_mixer moe_* dsv4_* gemma4_fp8_nonexpert gemma4_nf4_nonexpert use_dsv4_kernels "
        "use_glm_dsa_kernels expert_backend",
        _refused(MOE),
    ),
]

# ndparallel settings that are accepted (so a config keeps them) but not acted on yet, and why.
OWN_NOT_USED: dict[str, str] = {}
"""Fields of ours that a config may set but this build does not act on (none now: the wandb_* fields are
read by train/tracking.py, and wandb_watch says itself why it logs nothing)."""

# Plugins that only swap kernels or add outputs (accepted, not used); any other plugin is refused.
KERNEL_PLUGINS = ("CutCrossEntropyPlugin", "LigerPlugin", "KernelsPlugin", "LMEvalPlugin", "SwanLabPlugin")

# Axolotl dataset-entry settings that ndparallel does not read.
DATASET_POLICY: list[tuple[str, Rule]] = [
    ("preprocess_shards input_format", _ignored(MEMORY)),
    (
        "shards shards_idx input_transform conversation field_human field_model field_tools "
        "message_field_training message_field_training_detail split_thinking logprobs_field "
        "temperature step_separator max_completion_length train_on_last_step_only",
        _refused(DATA_CHANGE),
    ),
    (
        "field_chosen field_rejected field_prompt field_system chosen rejected prompt chosen_key rejected_key",
        _refused(RL),
    ),
]


def _expand(table: list[tuple[str, Rule]]) -> list[tuple[str, Rule]]:
    return [(name, rule) for names, rule in table for name in names.split()]


_RULES = _expand(POLICY)
_DATASET_RULES = _expand(DATASET_POLICY)


def rule_for(key: str, *, dataset: bool = False) -> Rule | None:
    """The rule of an Axolotl setting, or None when the table does not know it."""
    for pattern, rule in _DATASET_RULES if dataset else _RULES:
        if fnmatch.fnmatchcase(key, pattern):
            return rule
    return None


def known_names() -> list[str]:
    """Every exact name in the table (for "did you mean" hints)."""
    return [name for name, _ in _RULES if not any(c in name for c in "*?[")]


def plugin_problem(plugin: Any) -> str | None:
    """Why a ``plugins`` entry is refused, or None when it only swaps kernels."""
    name = str(plugin).rsplit(".", 1)[-1]
    if name in KERNEL_PLUGINS:
        return None
    return (
        f"plugins: {plugin!r} — this plugin changes training in a way ndparallel does not implement (only the "
        f"kernel plugins {', '.join(KERNEL_PLUGINS)} are accepted, and not used); remove it"
    )
