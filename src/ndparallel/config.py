"""The training configuration: a typed schema with Axolotl's field names, loaded from YAML.

Every field has a docstring (``ndparallel validate --help-fields`` prints them). Unknown keys are errors
that suggest the nearest valid name; wrong types and ranges name the field. ``tp_size`` / ``cp_size``
(Accelerate's names) are accepted for ``tensor_parallel_size`` / ``context_parallel_size``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ndparallel.errors import ConfigError
from ndparallel.parallelism_config import ParallelismConfig


class DatasetConfig(BaseModel):
    """One entry of ``datasets`` (Axolotl's layout)."""

    model_config = ConfigDict(extra="forbid")
    path: str
    """A file, directory, glob, or a dataset saved with ``datasets.save_to_disk``. ``stdlib:`` names this
    Python's standard library source directory (the embedded default corpus)."""
    type: str = "completion"
    """completion (a text field), alpaca (instruction/input/output), chat_template (messages), pretrain_files
    (plain text files, one document each)."""
    split: str | None = None
    """Split of a saved DatasetDict (a sub-directory)."""
    field: str | None = None
    """Name of the text field for completion datasets (default: text)."""
    name: str | None = None
    """Optional label for logs."""


class TrainConfig(BaseModel):
    """Everything ``ndparallel train`` reads. Field names follow Axolotl where Axolotl has one."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    # --- model --------------------------------------------------------------------------------------
    base_model: str | None = None
    """Local Hugging Face model directory (config.json, safetensors weights, tokenizer). Weights are loaded
    shard by shard into the layout (no rank holds the whole model)."""
    model_shape: str | None = None
    """Random-init pre-training from a preset shape instead of base_model: tiny, byte-tiny, 1b, 3b, 8b
    (Llama-shaped)."""
    model_config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the transformers config to set or override (an inline shape with model_type)."""
    tokenizer_config: str | None = None
    """Tokenizer directory, or 'byte' for the built-in byte-level tokenizer. Default: base_model's."""

    # --- data ---------------------------------------------------------------------------------------
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Training data sources."""
    dataset_prepared_path: str | None = None
    """Cache directory for tokenized data (default: output_dir/prepared)."""
    val_set_size: float = 0.0
    """Fraction of examples held out for evaluation (0 disables eval)."""
    sequence_len: int = Field(2048, ge=8)
    """Tokens per row."""
    sample_packing: bool = False
    """Pack several documents into each row; positions restart per document and no token attends across a
    document boundary (exact, also under context parallelism)."""
    long_rows: Literal["error", "truncate", "drop"] = "error"
    """Without packing, what to do with examples longer than sequence_len."""

    # --- batch and schedule ---------------------------------------------------------------------------
    micro_batch_size: int = Field(1, ge=1)
    """Rows per data-parallel rank per micro-step."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-steps per optimizer step."""
    num_epochs: float = Field(1.0, gt=0)
    """Passes over the data (ignored when max_steps is set)."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run."""
    learning_rate: float = Field(2e-5, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up (to 0 for cosine/linear)."""
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay; never applied to norms and biases."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (null: no clipping, the norm is still reported)."""
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "adamw"] = "adamw_torch_fused"
    """AdamW; the fused kernel is used where the device supports it."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
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
    """none, full (recompute each layer) or selective (keep matmul/attention outputs, recompute the rest)."""
    torch_compile: bool = False
    """Compile each decoder layer with torch.compile."""
    fsdp_wrap: Literal["block", "model"] | int = "block"
    """FSDP unit: each layer, N layers, or the whole model."""
    reshard_after_forward: bool | int = True
    """Free gathered parameters after forward (true), keep them (false), or keep them sharded over N ranks."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
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

    # --- parallel layout ----------------------------------------------------------------------------
    dp_replicate_size: int = Field(1, ge=1)
    dp_shard_size: int | Literal["auto"] = -1
    """FSDP shard size; -1 fills the ranks left by the other sizes; auto lets the planner pick the layout."""
    tensor_parallel_size: int = Field(1, ge=1, validation_alias=AliasChoices("tensor_parallel_size", "tp_size"))
    context_parallel_size: int = Field(1, ge=1, validation_alias=AliasChoices("context_parallel_size", "cp_size"))
    cp_comm_strategy: Literal["allgather", "ring", "alltoall"] = "allgather"
    """How context-parallel attention exchanges keys/values."""
    expert_parallel_size: int = Field(1, ge=1)
    """Mixture-of-experts models: split the experts over this many ranks, borrowed from dp_shard x cp x tp (it
    adds no ranks; it must divide their product and the number of experts)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: cuda (one GPU per process), cpu (gloo), or auto (cuda when available)."""
    process_group_timeout_s: float = Field(600.0, gt=0)
    """A collective that waits longer than this fails the job instead of hanging."""

    # --- output -------------------------------------------------------------------------------------
    output_dir: str = "./outputs"
    logging_steps: int = Field(10, ge=1)
    eval_steps: int | None = Field(None, ge=1)
    """Evaluate every N steps (default: at logging steps when val_set_size > 0)."""
    save_steps: int | None = Field(None, ge=1)
    """Save a sharded checkpoint every N steps (and always at the end)."""
    save_total_limit: int | None = Field(3, ge=1)
    """Keep the K most recently saved checkpoints (never deleting the one just written or the one 'latest' names)."""
    async_save: bool = True
    """Write checkpoints in the background: training waits only while the state is copied to host memory
    (pinned, overlapped with the next step on CUDA); 'latest' moves once the files are written and flushed.
    Needs host memory for one copy of this rank's share of the model and optimizer state."""
    resume_from_checkpoint: str | None = None
    """'latest' or a checkpoint directory to resume from."""
    export_hf: bool = False
    """Also write a Hugging Face model directory (output_dir/hf) at the end."""
    overwrite_output_dir: bool = False
    """Allow a fresh run in an output_dir that already holds checkpoints (they are kept, not deleted)."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop the run (keeping the last good checkpoint), or skip the step
    (costs a host sync per step)."""

    cuda_memory_snapshot: bool = False
    """On CUDA, record the allocator's history (a little overhead) and on out-of-memory write
    output_dir/logs/memory-snapshot-rank<R>.pickle (drag it into pytorch.org/memory_viz)."""

    # --- experiment tracking, rank 0 only (Axolotl's names) -----------------------------------------
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
    adapter: Literal["lora"] | None = None
    """lora: train low-rank adapters on frozen base weights; null: full fine-tune."""
    lora_r: int = Field(8, ge=1)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | None = None
    """Module names to adapt (e.g. q_proj, v_proj)."""
    lora_target_linear: bool = False
    """Adapt every linear layer of the decoder blocks."""
    lora_modules_to_save: list[str] | None = None
    """Modules trained in full alongside the adapters (e.g. embed_tokens, lm_head)."""
    lora_target_parameters: list[str] | None = None
    """Mixture-of-experts weights to adapt, per expert (PEFT's target_parameters), e.g.
    [mlp.experts.gate_up_proj, mlp.experts.down_proj]."""

    # --- checks across fields -----------------------------------------------------------------------
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

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if self.fp16:
            raise ValueError("fp16 is not supported: set bf16: true (bf16 needs no loss scaling)")
        if self.base_model is None and self.model_shape is None and not self.model_config_overrides.get("model_type"):
            raise ValueError("no model: set base_model (a local HF directory) or model_shape (tiny, 1b, 3b, 8b)")
        if self.base_model is not None and self.model_shape is not None:
            raise ValueError("base_model and model_shape are both set: keep one (model_shape means random init)")
        if self.adapter == "lora" and not (self.lora_target_modules or self.lora_target_linear
                                           or self.lora_target_parameters):
            raise ValueError("adapter: lora needs lora_target_modules (e.g. [q_proj, v_proj]), lora_target_linear: true "
                             "or lora_target_parameters (MoE expert weights)")
        if self.adapter is None and (self.lora_target_modules or self.lora_target_linear or self.lora_target_parameters):
            raise ValueError("lora_target_modules / lora_target_linear / lora_target_parameters are set but adapter "
                             "is not: add adapter: lora")
        if not self.datasets:
            raise ValueError("datasets is empty: add at least one entry with a path and a type")
        return self

    # --- derived settings ---------------------------------------------------------------------------
    @property
    def ac_mode(self) -> str:
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "full" if self.gradient_checkpointing else "none"

    def parallelism(self, *, dp_shard_override: int | None = None) -> ParallelismConfig:
        shard = dp_shard_override if dp_shard_override is not None else self.dp_shard_size
        if shard == "auto":
            shard = -1
        return ParallelismConfig(dp_replicate_size=self.dp_replicate_size, dp_shard_size=shard,
                                 tp_size=self.tensor_parallel_size, cp_size=self.context_parallel_size,
                                 cp_comm_strategy=self.cp_comm_strategy, expert_parallel_size=self.expert_parallel_size)

    def fixed_world_size(self) -> int | None:
        """The world size the sizes imply, or None when dp_shard_size is -1 or auto."""
        if self.dp_shard_size in (-1, "auto"):
            return None
        return self.dp_replicate_size * self.dp_shard_size * self.tensor_parallel_size * self.context_parallel_size


def accepted_keys() -> set[str]:
    keys = set()
    for name, field in TrainConfig.model_fields.items():
        keys.add(name)
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            keys.update(a for a in alias.choices if isinstance(a, str))
    return keys


def _unknown_key_errors(raw: dict) -> list[str]:
    known = accepted_keys()
    errors = []
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else "; see `ndparallel validate --help-fields`"
            errors.append(f"unknown setting {key!r}{hint}")
    if "datasets" in raw and isinstance(raw["datasets"], list):
        ds_known = set(DatasetConfig.model_fields)
        for i, entry in enumerate(raw["datasets"]):
            if isinstance(entry, dict):
                for key in entry:
                    if key not in ds_known:
                        near = difflib.get_close_matches(str(key), sorted(ds_known), n=1, cutoff=0.6)
                        hint = f"; did you mean {near[0]!r}?" if near else f"; valid: {', '.join(sorted(ds_known))}"
                        errors.append(f"unknown setting datasets[{i}].{key}{hint}")
    return errors


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        where = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in err["loc"]).replace(".[", "[")
        msg = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"{where}: {msg}{shown}" if where else f"{msg}")
    return lines


def config_errors(raw: dict) -> list[str]:
    """Every problem with a raw config mapping, one line each (empty when valid)."""
    if not isinstance(raw, dict):
        return [f"the config must be a mapping of settings, got {type(raw).__name__}"]
    errors = _unknown_key_errors(raw)
    known = accepted_keys()
    rest = {k: v for k, v in raw.items() if k in known}
    if isinstance(rest.get("datasets"), list):  # unknown dataset keys were reported above
        rest["datasets"] = [{k: v for k, v in d.items() if k in DatasetConfig.model_fields} if isinstance(d, dict) else d
                            for d in rest["datasets"]]
    try:
        TrainConfig.model_validate(rest)
    except ValidationError as exc:
        errors += _format_validation_error(exc)
    return errors


def parse_config(raw: dict) -> TrainConfig:
    errors = config_errors(raw)
    if errors:
        raise ConfigError("; ".join(errors))
    return TrainConfig.model_validate(raw)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; give the path of a YAML file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
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
            value = yaml.safe_load(text) if text != "" else None
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
