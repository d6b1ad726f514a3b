"""The training configuration: a typed schema with Axolotl's field names, loaded from YAML.

Every field has a docstring (``ndparallel validate --help-fields`` prints them). Unknown keys are errors
that suggest the nearest valid name; wrong types and ranges name the field. ``tp_size`` / ``cp_size``
(Accelerate's names) are accepted for ``tensor_parallel_size`` / ``context_parallel_size``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ndparallel.adapters.lora import MAX_LORA_R
from ndparallel.errors import ConfigError
from ndparallel.from_axolotl import not_used_line, read_axolotl
from ndparallel.mesh.parallelism_config import ParallelismConfig
from ndparallel.safe_io import bounded_yaml
from ndparallel.validation_errors import format_validation_error, warnings_for


class DatasetConfig(BaseModel):
    """One entry of ``datasets`` (Axolotl's layout and names)."""

    model_config = ConfigDict(extra="forbid")
    path: str
    """A local file, directory, glob or ``datasets.save_to_disk`` directory, or a Hugging Face Hub dataset id
    (org/name, read from the hub cache; downloaded once per node unless HF_HUB_OFFLINE is set). ``stdlib:``
    names this Python's standard library source directory (the embedded default corpus)."""
    type: str = "completion"
    """completion (a text field), alpaca (instruction/input/output), chat_template (messages), pretrain_files
    (plain text files, one document each)."""
    split: str | None = None
    """Split to read (default train), with an optional slice as in datasets: train[:10%], train[100:200]."""
    field: str | None = None
    """Name of the text field for completion datasets (default: text)."""
    name: str | None = None
    """Configuration of a hub dataset (its README's configs), as in datasets.load_dataset(path, name)."""
    data_files: str | list[str] | None = None
    """Files (or glob patterns) of the dataset to read instead of all of them."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub dataset."""
    trust_remote_code: bool = False
    """Accepted for Axolotl configs; dataset loading scripts are never run (only data files are read)."""
    ds_type: str | None = None
    """File format when the extension does not say it (json, parquet, arrow, text)."""
    field_messages: str | None = None
    """chat_template: the column holding the messages (default: messages, or conversations)."""
    message_property_mappings: dict[str, str] | None = None
    """chat_template: which keys of a message hold the role and the content, e.g. {role: from, content: value}."""
    message_field_role: str | None = None
    """chat_template: older spelling of message_property_mappings.role."""
    message_field_content: str | None = None
    """chat_template: older spelling of message_property_mappings.content."""
    roles: dict[str, list[str]] | None = None
    """chat_template: dataset role names for each template role, e.g. {user: [human], assistant: [gpt]}."""
    roles_to_train: list[str] | None = None
    """chat_template: roles whose turns are trained (default: assistant)."""
    train_on_eos: Literal["turn"] | None = None
    """chat_template: a trained turn ends with its end-of-turn tokens, which are trained (Axolotl's 'turn')."""
    drop_system_message: bool = False
    """chat_template: leave system messages out."""
    chat_template: str | None = None
    """Chat template for this dataset (a name, tokenizer_default or jinja); default: the top-level one."""
    chat_template_jinja: str | None = None
    """Jinja source of this dataset's chat template."""
    field_thinking: str | None = None
    """chat_template: the key of a message holding its reasoning trace (default: reasoning_content)."""
    template_thinking_key: str | None = None
    """chat_template: the key the chat template reads the reasoning trace from (default: reasoning_content)."""

    @property
    def role_key(self) -> str | None:
        return (self.message_property_mappings or {}).get("role") or self.message_field_role

    @property
    def content_key(self) -> str | None:
        return (self.message_property_mappings or {}).get("content") or self.message_field_content


class PretrainingDatasetConfig(BaseModel):
    """One entry of ``pretraining_dataset``: text documents read in order, tokenized and packed as they come."""

    model_config = ConfigDict(extra="forbid")
    path: str
    """Hub dataset id or local path, as for datasets."""
    name: str | None = None
    split: str = "train"
    text_column: str = "text"
    type: str = "pretrain"
    """pretrain or completion: every token of text_column is trained."""
    field: str | None = None
    """Axolotl's datasets-style spelling of text_column."""
    data_files: str | list[str] | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    skip: int | None = Field(None, ge=0)
    """Documents to skip at the start."""


class SpecialTokens(BaseModel):
    """Axolotl's special_tokens: set these tokens, adding them to the vocabulary when they are new."""

    model_config = ConfigDict(extra="forbid")
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] | None = None


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


EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit", "ao_adamw_8bit")


# Sane maxima of sizes (a typo such as sequence_len: 1000000000 is one line at validate, not a MemoryError).
MAX_SEQUENCE_LEN = 2**24
MAX_COUNT = 2**16


class TrainConfig(BaseModel):
    """Everything ``ndparallel train`` reads. Field names and meanings follow Axolotl where Axolotl has one."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    # --- model --------------------------------------------------------------------------------------
    base_model: str | None = None
    """Local Hugging Face model directory, or a hub id (org/name) read from the hub cache (downloaded once per
    node unless HF_HUB_OFFLINE is set; safetensors only). Each rank reads only its slices of the weights."""
    revision_of_model: str | None = None
    """Hub revision (branch, tag or commit) of base_model."""
    trust_remote_code: bool = False
    """Allow a model or tokenizer to run Python code from its repository. Off: nothing read runs code."""
    model_shape: str | None = None
    """Random-init pre-training from a preset shape instead of base_model: tiny, byte-tiny, 1b, 3b, 8b
    (Llama-shaped)."""
    model_config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the transformers config to set or override (an inline shape with model_type). Axolotl's
    overrides_of_model_config and rope_scaling land here."""
    tokenizer_config: str | None = None
    """Tokenizer directory or hub id, or 'byte' for the built-in byte-level tokenizer. Default: base_model's."""
    tokenizer_type: str | None = None
    """transformers tokenizer class to load it with (e.g. AutoTokenizer, PreTrainedTokenizerFast)."""
    special_tokens: SpecialTokens | None = None
    """bos/eos/pad/unk tokens and additional special tokens; new ones are added to the vocabulary and the
    embeddings grow (to a multiple of 64 and of tensor_parallel_size; new rows start at the mean row)."""
    tokens: list[str] | None = None
    """Plain tokens to add to the vocabulary (the embeddings grow as for special_tokens)."""
    chat_template: str | None = None
    """Chat template by name (chatml, llama3, qwen3, qwen_25, mistral_v1, gemma, phi_3, alpaca,
    tokenizer_default, tokenizer_default_fallback_<name>) or jinja (with chat_template_jinja)."""
    chat_template_jinja: str | None = None
    """Jinja source of the chat template (implies chat_template: jinja)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. enable_thinking: false)."""

    # --- data ---------------------------------------------------------------------------------------
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Training data sources."""
    pretraining_dataset: list[PretrainingDatasetConfig] | None = None
    """Text corpora read in order and packed (documents longer than sequence_len are split); needs max_steps."""
    dataset_prepared_path: str | None = None
    """Cache directory for tokenized data (default: output_dir/prepared)."""
    val_set_size: float = Field(0.0, ge=0)
    """Examples held out for evaluation: a fraction below 1, or a number of examples (0 disables eval)."""
    eval_sample_packing: bool | None = None
    """Pack the evaluation rows too (default: as sample_packing)."""
    sequence_len: int = Field(512, ge=8, le=MAX_SEQUENCE_LEN)
    """Tokens per row (at most 16,777,216)."""
    sample_packing: bool = False
    """Pack several documents into each row; positions restart per document and no token attends across a
    document boundary (exact, also under context parallelism)."""
    long_rows: Literal["drop", "truncate", "error", "split"] | None = None
    """Examples longer than sequence_len: drop (Axolotl's default), truncate, error, or split into pieces
    (pretraining_dataset's default). Axolotl's excess_length_strategy (raise = error) lands here."""
    min_sample_len: int = Field(2, ge=1)
    """Examples with fewer tokens are left out."""
    dataset_max_record_mb: float = Field(16.0, gt=0)
    """The largest record read, in MiB (a JSON line, a table row, a pretrain file): a larger one is an error
    naming it, as it would be read and tokenized whole before long_rows applies."""
    dataset_exact_deduplication: bool = False
    """Leave out every example whose tokens and labels repeat an earlier one (across all datasets), before the
    evaluation split: neither split repeats itself or the other."""
    train_on_inputs: bool = False
    """Also train on prompts (alpaca) and on every chat turn, not only on the answers."""
    curriculum_sampling: bool = False
    """Train on the rows in their dataset order every epoch (Axolotl's sequential sampler), instead of a
    seeded shuffle per epoch."""

    # --- batch and schedule ---------------------------------------------------------------------------
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

    # --- precision and memory -----------------------------------------------------------------------
    bf16: bool | Literal["auto"] = "auto"
    """bf16 compute with fp32 master weights and fp32 gradient reduction. auto: on for CUDA, off on CPU."""
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

    # --- parallel layout ----------------------------------------------------------------------------
    dp_replicate_size: int | None = Field(None, ge=1)
    """Full replicas (HSDP). Unset: 1, or, when dp_shard_size is fixed and fewer ranks are needed than started,
    as many replicas as fill the world (Axolotl's rule)."""
    dp_shard_size: int | Literal["auto"] = -1
    """FSDP shard size; -1 fills the ranks left by the other sizes; auto lets the planner pick the layout."""
    tensor_parallel_size: int = Field(1, ge=1, validation_alias=AliasChoices("tensor_parallel_size", "tp_size"))
    context_parallel_size: int = Field(1, ge=1, validation_alias=AliasChoices("context_parallel_size", "cp_size"))
    cp_comm_strategy: Literal["allgather", "ring", "alltoall"] = "allgather"
    """How context-parallel attention exchanges keys/values (ring_attn_func: varlen_llama3 means allgather,
    batch_ring / batch_zigzag / batch_stripe mean ring)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Mixture-of-experts models: split the experts over this many ranks, borrowed from dp_shard x cp x tp (it
    adds no ranks; it must divide their product and the number of experts)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: cuda (one GPU per process), cpu (gloo), or auto (cuda when available)."""
    process_group_timeout_s: float = Field(600.0, gt=0)
    """A collective that waits longer than this fails the job instead of hanging (Axolotl's ddp_timeout)."""

    # --- output -------------------------------------------------------------------------------------
    output_dir: str = "./outputs"
    logging_steps: int | None = Field(None, ge=1)
    """Log every N steps (default: 0.5% of the steps, between 1 and 10, as Axolotl)."""
    eval_steps: int | float | None = Field(None, gt=0)
    """Evaluate every N steps, or every fraction of the steps when below 1 (default: at the end)."""
    evals_per_epoch: int | None = Field(None, ge=1)
    """Evaluations per epoch (Axolotl's: every 1 / (evals_per_epoch x num_epochs) of the steps)."""
    eval_strategy: Literal["steps", "epoch", "no"] | None = None
    """no: never evaluate; epoch: at each epoch's end; steps: every eval_steps."""
    save_steps: int | float | None = Field(None, gt=0)
    """Save a sharded checkpoint every N steps, or every fraction of the steps when below 1 (and always at the
    end). Default: at each epoch's end, as Axolotl."""
    saves_per_epoch: int | None = Field(None, ge=1)
    """Checkpoints per epoch (Axolotl's: every 1 / (saves_per_epoch x num_epochs) of the steps)."""
    save_strategy: Literal["steps", "epoch", "no", "best"] | None = None
    """no: only the final checkpoint; epoch: at each epoch's end; steps: every save_steps."""
    save_total_limit: int | None = Field(4, ge=1)
    """Keep the K most recently saved checkpoints (Axolotl's default 4; never deleting the one just written or
    the one 'latest' names)."""
    async_save: bool = True
    """Write checkpoints in the background: training waits only while the state is copied to host memory
    (pinned, overlapped with the next step on CUDA); 'latest' moves once the files are written and flushed.
    Needs host memory for one copy of this rank's share of the model and optimizer state."""
    resume_from_checkpoint: str | None = None
    """'latest' or a checkpoint directory to resume from."""
    export_hf: bool = False
    """Also write a Hugging Face model directory (output_dir/hf) at the end. An output_dir/hf holding files
    ndparallel did not write is refused, never deleted."""
    overwrite_output_dir: bool = False
    """Allow a fresh run in an output_dir that already holds checkpoints (they are kept, not deleted: the new
    run's save_total_limit counts only its own) and replace an export ndparallel wrote in output_dir/hf."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop the run (keeping the last good checkpoint), or skip the step
    (costs a host sync per step)."""
    cuda_memory_snapshot: bool = False
    """On CUDA, record the allocator's history (a little overhead) and on out-of-memory write
    output_dir/logs/memory-snapshot-rank<R>.pickle (drag it into pytorch.org/memory_viz)."""

    # --- experiment tracking, rank 0 only (Axolotl's names) -----------------------------------------
    use_wandb: bool | None = None
    """Weights & Biases on (with wandb_project) or off (false wins over wandb_project)."""
    use_tensorboard: bool | None = None
    """TensorBoard events in output_dir/tensorboard: true, false, or null (when tensorboard is installed)."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (pip install 'ndparallel[wandb]')."""
    wandb_entity: str | None = None
    """W&B team or user the project belongs to (default: yours)."""
    wandb_name: str | None = None
    """Display name of the W&B run."""
    wandb_run_id: str | None = None
    """W&B run id; an existing id resumes that run (its charts continue)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (kept under output_dir/wandb for `wandb sync`) or disabled; default: W&B's own
    (WANDB_MODE)."""
    wandb_watch: str | bool | None = None
    """Accepted for Axolotl configs; per-parameter histograms are not logged (parameters are sharded over
    ranks): the global grad_norm is."""
    wandb_log_model: Literal["checkpoint", "end", "false"] | bool | None = None
    """checkpoint: each saved checkpoint directory as a W&B model artifact; end (or true): the final adapter,
    HF export or last checkpoint; false/null: none."""

    # --- fine-tuning adapters (Axolotl's names) -----------------------------------------------------
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

    # --- checks across fields -----------------------------------------------------------------------
    @property
    def quantized_base(self) -> str | None:
        """The base weights' format under the adapters: 'nf4' (load_in_4bit), 'int8' (load_in_8bit) or None."""
        return "nf4" if self.load_in_4bit else "int8" if self.load_in_8bit else None

    @field_validator("fsdp_wrap", mode="before")
    @classmethod
    def _wrap_positive(cls, value):
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("must be 'block', 'model' or a positive number of layers")
        return value

    @field_validator("dp_shard_size")
    @classmethod
    def _shard_size(cls, value):
        if value != "auto" and value != -1 and value < 1:
            raise ValueError("must be >= 1, -1 (fill the remaining ranks) or auto")
        return value

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, value):
        if value not in (None, "lora", "qlora"):
            raise ValueError(
                f"{value!r} is not supported: use lora, qlora (with load_in_4bit: true), or leave it unset for "
                f"a full fine-tune"
            )
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_name(cls, value):
        from ndparallel.data.templates import check_template_name

        check_template_name(value)
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
        from ndparallel.adapters.freeze import compile_patterns

        compile_patterns(value)
        return value

    @field_validator("val_set_size")
    @classmethod
    def _whole_count(cls, value):
        if value >= 1 and value != int(value):
            raise ValueError("must be a fraction below 1 or a whole number of examples")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        for problem in self._problems():
            raise ValueError(problem)
        return self

    @property
    def qat_spec(self):
        """The qat block as ``qat.QatSpec`` (None without one)."""
        from ndparallel.adapters.qat import QatSpec

        return QatSpec(**self.qat.model_dump()) if self.qat is not None else None

    def _problems(self):
        """Contradictions between settings (the first one is raised)."""
        from ndparallel.parallel.rules import option_problems
        from ndparallel.quantized.linears import FORMATS

        if self.fp16:
            yield "fp16 is not supported: set bf16: true (bf16 needs no loss scaling)"
        if self.base_model is None and self.model_shape is None and not self.model_config_overrides.get("model_type"):
            yield "no model: set base_model (a HF directory or hub id) or model_shape (tiny, 1b, 3b, 8b)"
        if self.base_model is not None and self.model_shape is not None:
            yield "base_model and model_shape are both set: keep one (model_shape means random init)"
        if self.adapter == "qlora" and not self.load_in_4bit:
            yield "adapter: qlora needs load_in_4bit: true (its base weights are 4-bit); or use adapter: lora"
        yield from option_problems(
            lora=self.adapter is not None,
            quantized_base=self.quantized_base,
            fp8=self.fp8,
            qat=self.qat_spec,
            unfrozen=self.unfrozen_parameters is not None,
            tp=self.tensor_parallel_size,
        )
        if self.load_in_4bit and self.load_in_8bit:
            yield "load_in_4bit and load_in_8bit are both true: keep one"
        quantized = FORMATS.get(self.quantized_base)  # the setting's name
        if quantized and self.export_hf:
            yield (
                f"export_hf with {quantized} is not supported: the run writes its PEFT adapter to "
                f"output_dir/adapter; load it on base_model with peft (or merge with peft's merge_and_unload)"
            )
        if self.adapter in ("lora", "qlora") and not (
            self.lora_target_modules or self.lora_target_linear or self.lora_target_parameters
        ):
            yield (
                "adapter: lora needs lora_target_modules (e.g. [q_proj, v_proj]), lora_target_linear: true or "
                "lora_target_parameters (MoE expert weights)"
            )
        if self.adapter is None and (
            self.lora_target_modules or self.lora_target_linear or self.lora_target_parameters
        ):
            yield (
                "lora_target_modules / lora_target_linear / lora_target_parameters are set but adapter is not: add "
                "adapter: lora"
            )
        if not self.datasets and not self.pretraining_dataset:
            yield "datasets is empty: add at least one entry with a path and a type (or a pretraining_dataset)"
        if self.pretraining_dataset and self.max_steps is None:
            yield "pretraining_dataset needs max_steps (the corpus is read only as far as the steps need)"
        both = [("warmup_steps", "warmup_ratio"), ("save_steps", "saves_per_epoch"), ("eval_steps", "evals_per_epoch")]
        for one, other in both:
            if getattr(self, one) is not None and getattr(self, other) is not None:
                yield f"{one} and {other} are both set: keep one"
        if self.save_strategy == "best":
            yield (
                "save_strategy: best (keep the checkpoint with the best eval metric) is not implemented: use steps "
                "or epoch"
            )
        if self.pretraining_dataset and any(p.type not in ("pretrain", "completion") for p in self.pretraining_dataset):
            yield "pretraining_dataset entries are read as text (type: pretrain or completion)"
        if self.cosine_constant_lr_ratio and not self.cosine_min_lr_ratio:
            yield "cosine_constant_lr_ratio needs cosine_min_lr_ratio (the rate it holds at the end)"
        if (self.cosine_min_lr_ratio or self.cosine_constant_lr_ratio) and self.lr_scheduler != "cosine":
            yield f"cosine_min_lr_ratio applies to lr_scheduler: cosine, not {self.lr_scheduler}"
        if self.activation_offloading == "disk":
            yield "activation_offloading: disk is not implemented: use true (pinned host memory)"
        if self.activation_offloading and self.ac_mode != "full":
            yield (
                "activation_offloading moves the layer inputs that full activation checkpointing keeps: set "
                "gradient_checkpointing: true (or activation_checkpointing: full)"
            )
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            yield "chat_template: jinja needs chat_template_jinja (the template's source)"

    # --- derived settings ---------------------------------------------------------------------------
    @property
    def ac_mode(self) -> str:
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "full" if self.gradient_checkpointing else "none"

    @property
    def clip_norm(self) -> float | None:
        """The clipping threshold: unset means 1.0, 0 means no clipping (transformers' meaning)."""
        if self.max_grad_norm is None:
            return 1.0
        return self.max_grad_norm or None

    @property
    def eval_packing(self) -> bool:
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing

    @property
    def long_rows_policy(self) -> str:
        return self.long_rows or ("split" if self.pretraining_dataset else "drop")

    @property
    def eight_bit_optimizer(self) -> bool:
        return self.optimizer in EIGHT_BIT_OPTIMIZERS

    def parallelism(self, *, dp_shard_override: int | None = None, world_size: int | None = None) -> ParallelismConfig:
        """The parallel sizes; with ``world_size``, an unset dp_replicate_size fills the ranks a fixed
        dp_shard_size leaves (Axolotl's rule: more replicas rather than an error)."""
        shard = dp_shard_override if dp_shard_override is not None else self.dp_shard_size
        if shard == "auto":
            shard = -1
        return ParallelismConfig(
            dp_replicate_size=self.replicas_for(world_size, shard),
            dp_shard_size=shard,
            tp_size=self.tensor_parallel_size,
            cp_size=self.context_parallel_size,
            cp_comm_strategy=self.cp_comm_strategy,
            expert_parallel_size=self.expert_parallel_size,
        )

    def replicas_for(self, world_size: int | None, shard: int) -> int | None:
        """dp_replicate_size for ``world_size``: as set, else the fill of a fixed shard size, else unset."""
        if self.dp_replicate_size is not None or world_size is None or shard == -1:
            return self.dp_replicate_size
        fixed = shard * self.tensor_parallel_size * self.context_parallel_size
        if world_size > fixed and world_size % fixed == 0:
            return world_size // fixed
        return None

    def fixed_world_size(self) -> int | None:
        """The world size the sizes imply, or None when dp_shard_size is -1 or auto."""
        if self.dp_shard_size in (-1, "auto"):
            return None
        replicas = self.dp_replicate_size or 1
        return replicas * self.dp_shard_size * self.tensor_parallel_size * self.context_parallel_size


def accepted_keys() -> set[str]:
    keys = set()
    for name, field in TrainConfig.model_fields.items():
        keys.add(name)
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            keys.update(a for a in alias.choices if isinstance(a, str))
    return keys


@dataclass
class ConfigReading:
    """A raw config read: the validated config (None when it has errors), every error, and the notes
    (the one "not used" line, translations that differ from Axolotl) to show the user once."""

    config: TrainConfig | None
    errors: list[str]
    notes: list[str]
    settings: dict[str, Any]


def read_config(raw: Any) -> ConfigReading:
    """Translate Axolotl's spellings, sort every other key (see ``from_axolotl``) and validate."""
    if not isinstance(raw, dict):
        return ConfigReading(None, [f"the config must be a mapping of settings, got {type(raw).__name__}"], [], {})
    reading = read_axolotl(raw, accepted_keys(), set(DatasetConfig.model_fields))
    errors = list(reading.errors)
    config = None
    try:
        config = TrainConfig.model_validate(reading.settings)
    except ValidationError as exc:
        errors += format_validation_error(exc)
    notes = [line for line in [not_used_line(reading.not_used)] if line] + reading.notes
    if config is not None and not errors:
        notes += warnings_for(config)
    return ConfigReading(None if errors else config, errors, notes, reading.settings)


def partial_config(settings: dict[str, Any]) -> TrainConfig | None:
    """The config without the settings that are invalid (their defaults instead), so that ``validate`` can go
    on to check the model, layout and data of a config that has errors; None when that is not possible."""
    settings = dict(settings)
    for _ in range(4):
        try:
            return TrainConfig.model_validate(settings)
        except ValidationError as exc:
            keys = {err["loc"][0] for err in exc.errors() if err["loc"]}
            if not keys & set(settings):
                return None
            for key in keys:
                settings.pop(key, None)
    return None


def config_errors(raw: dict) -> list[str]:
    """Every problem with a raw config mapping, one line each (empty when valid)."""
    return read_config(raw).errors


def parse_config(raw: dict) -> TrainConfig:
    reading = read_config(raw)
    if reading.errors:
        raise ConfigError("; ".join(reading.errors))
    return reading.config


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; give the path of a YAML file")
    try:
        data = bounded_yaml.load(path.read_text(encoding="utf-8"), source=f"config file {str(path)!r}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of settings, not a {type(data).__name__}")
    return data


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``--set key=value`` overrides (values parsed as YAML; ``a.b=1`` and ``datasets.0.path=x`` nest)."""
    raw = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value (e.g. --set learning_rate=1e-4)")
        key, _, text = item.partition("=")
        try:
            value = bounded_yaml.load(text, source=f"--set {key}") if text != "" else None
        except yaml.YAMLError:
            value = text
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string; users mean the number
            try:
                value = float(value) if any(c in value for c in "eE.") else value
            except ValueError:
                pass
        target: Any = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if isinstance(target, list):
                target = target[int(part)]
            else:
                target = target.setdefault(part, {})
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return raw


def field_docs() -> str:
    """Every setting with its type, default and description (for --help-fields)."""
    import ast
    import inspect

    source = inspect.getsource(TrainConfig)
    docs: dict[str, str] = {}
    tree = ast.parse(source).body[0]
    previous = None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            previous = node.target.id
        elif previous and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
            docs[previous] = " ".join(str(node.value.value).split())
            previous = None
        else:
            previous = None
    lines = []
    for name, field in TrainConfig.model_fields.items():
        default = field.default if field.default_factory is None else field.default_factory()
        lines.append(f"{name} (default {default!r}): {docs.get(name, '')}".rstrip(": "))
    return "\n".join(lines)
