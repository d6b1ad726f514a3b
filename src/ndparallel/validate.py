"""``ndparallel validate``: resolve a config without starting processes and report every problem found."""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass, field
from pathlib import Path

from ndparallel.adapters.freeze import apply_trainable, describe_trainable, select_trainable
from ndparallel.adapters.qat import apply_qat
from ndparallel.config.schema import TrainConfig
from ndparallel.data.files import resolve_data_path
from ndparallel.errors import NdParallelError
from ndparallel.mesh.layout import Layout
from ndparallel.parallel.rules import embedding_offload_problems, model_problems
from ndparallel.quantized.nf4 import nf4_available
from ndparallel.safe_io import hub
from ndparallel.train.model import offload_layers, run_model_config
from ndparallel.train.preflight import Preflight, output_problems, preflight
from ndparallel.train.run_inputs import load_run_tokenizer
from ndparallel.train.setup import resolve_layout
from ndparallel.weights.meta import meta_model
from ndparallel.weights.vocab import fit_vocab


@dataclass
class RunPlan:
    layout: Layout
    world_size: int
    reason: str | None
    notes: list[str] = field(default_factory=list)


def run_errors(cfg: TrainConfig, *, world_size: int | None) -> tuple[list[str], RunPlan | None]:
    """Problems that would stop ``train`` (model, tokenizer, layout, data, output_dir, optimizer), all of them,
    collected rather than raised; hub ids are looked up in the hub cache (config and tokenizer files are fetched
    unless HF_HUB_OFFLINE is set, weights are not). The data is sampled, not read whole (``train/preflight.py``)."""
    problems: list[str] = []
    model_config = _attempt(problems, lambda: run_model_config(cfg))
    same_repository = (cfg.tokenizer_config or cfg.base_model) == cfg.base_model and cfg.base_model is not None
    # base_model's tokenizer comes from the same repository: one line when that repository cannot be read
    tokenizer = (
        None if model_config is None and same_repository else _attempt(problems, lambda: load_run_tokenizer(cfg))
    )
    plan = _plan(cfg, world_size, model_config, problems)
    if model_config is not None:
        notes = _model_checks(cfg, model_config, tokenizer, plan, problems)
        if plan is not None:
            plan.notes += notes
    data_problems = _data_problems(cfg)
    problems += data_problems
    checks = (
        preflight(cfg, tokenizer=tokenizer[0] if tokenizer else None)
        if not data_problems
        else Preflight(problems=output_problems(cfg))
    )
    problems += checks.problems
    if model_config is None:
        checks.not_checked.append("the model against the layout and the tokenizer (its config is not at hand)")
    if plan is not None:
        plan.notes += [*checks.notes, checks.not_checked_line()]
    if cfg.load_in_4bit:
        _attempt(problems, nf4_available)
    if cfg.eight_bit_optimizer and cfg.device == "cpu":
        problems.append(f"optimizer: {cfg.optimizer} (8-bit AdamW) needs a CUDA GPU; use adamw_torch with device: cpu")
    return problems, plan


def _plan(cfg: TrainConfig, world_size: int | None, model_config, problems: list[str]) -> RunPlan | None:
    """The layout train would use for ``world_size`` processes (None when it cannot be had)."""
    world = world_size or cfg.fixed_world_size() or 1
    if model_config is None and cfg.dp_shard_size == "auto":
        return None
    try:
        layout, reason = resolve_layout(cfg, world, model_config)
    except NdParallelError as exc:
        problems.append(str(exc))
        return None
    plan = RunPlan(layout=layout, world_size=world, reason=reason)
    if cfg.dp_replicate_size is None and layout.dp_replicate > 1:
        plan.notes.append(
            f"dp_replicate_size is unset: {layout.dp_replicate} replicas fill the {world} processes (Axolotl's rule)"
        )
    return plan


def _model_checks(cfg: TrainConfig, model_config, tokenizer, plan: RunPlan | None, problems: list[str]) -> list[str]:
    """The model against the tokenizer and the layout (when there is one), unfrozen_parameters and qat; the
    notes to show."""
    notes = []
    if plan is not None and tokenizer is not None:
        tp = plan.layout.tp
        notes.append(_attempt(problems, lambda: fit_vocab(model_config, len(tokenizer[0]), tokenizer[1], tp=tp)[1]))
    if plan is not None:
        problems += list(model_problems(plan.layout, model_config, seq_len=cfg.sequence_len))
        if cfg.embedding_offload:
            tied = bool(getattr(model_config, "tie_word_embeddings", False))
            problems += list(embedding_offload_problems(adapters=True, world_size=plan.world_size, tied=tied))
        notes.append(_attempt(problems, lambda: _offload_note(cfg, model_config, plan)))
    for wanted, check in ((cfg.unfrozen_parameters, _check_unfrozen), (cfg.qat is not None, _check_qat)):
        if wanted:
            notes.append(_attempt(problems, lambda check=check: check(cfg, model_config)))
    return [note for note in notes if note]


def _offload_note(cfg: TrainConfig, model_config, plan: RunPlan) -> str | None:
    """activation_offloading against this machine's host memory (checked again when the run starts)."""
    offloaded = offload_layers(cfg, model_config, plan.layout)
    if not offloaded:
        return None
    return (
        f"activation offloading: the inputs of {offloaded} of {model_config.num_hidden_layers} decoder layers wait "
        f"for backward in host memory (this machine's available memory; checked again at start)"
    )


def _check_unfrozen(cfg: TrainConfig, model_config) -> str:
    """unfrozen_parameters against the weights' names (the model built on the meta device: no memory); the
    line saying how much of the model trains."""
    model = meta_model(model_config)
    apply_trainable(model, select_trainable(model, cfg.unfrozen_parameters))
    return describe_trainable(model)


def _check_qat(cfg: TrainConfig, model_config) -> str:
    """The qat scheme against the model's layer shapes (group sizes must divide every input width)."""
    count = apply_qat(meta_model(model_config), cfg.qat_spec)
    return f"{cfg.qat_spec.describe()}: {count} linear layers"


def _attempt(problems: list[str], make):
    try:
        return make()
    except NdParallelError as exc:
        problems.append(str(exc))
        return None


def _data_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    entries = [("datasets", d.path, d.revision) for d in cfg.datasets]
    entries += [("pretraining_dataset", d.path, d.revision) for d in cfg.pretraining_dataset or []]
    for i, (setting, raw_path, revision) in enumerate(entries):
        path = resolve_data_path(raw_path)
        if hub.is_hub_id(path):
            problem = _hub_dataset_problem(path, revision, f"{setting}[{i}].path")
            if problem:
                problems.append(problem)
        elif not (Path(path).exists() or glob.glob(path)):
            problems.append(
                f"{setting}[{i}].path {raw_path!r} matches no file or directory (nor a hub dataset id org/name)"
            )
    return problems


def _hub_dataset_problem(name: str, revision: str | None, setting: str) -> str | None:
    """Why hub dataset ``name`` cannot be read: not cached while offline, or not on the hub."""
    try:
        hub.dataset_dir(name, revision=revision, download=False, setting=setting)
        return None
    except NdParallelError as exc:
        if hub.offline():
            return str(exc)
    from huggingface_hub import HfApi

    try:
        if not HfApi().repo_exists(name, repo_type="dataset"):
            return f"{setting} {name!r} is neither a local path nor a dataset on the Hugging Face Hub; check it"
    except Exception as exc:  # no network here: train on this machine could not download it either
        return hub.not_cached(setting, name, revision, "dataset", unreachable=hub.first_line(exc))
    return None  # on the Hub: train downloads it (local rank 0 of each node)


def differences(cfg: TrainConfig) -> str | None:
    """One line naming where this run means something other than Axolotl would, on purpose."""
    items = []
    if cfg.lr_scheduler != "constant":
        items.append("warm-up reaches lr x (s+1)/warmup at step s, so the first step learns (transformers: s/warmup)")
    if cfg.sample_packing or cfg.pretraining_dataset:
        items.append(
            "packing is first-fit in document order (Axolotl's multipack bins by length), so rows hold "
            "other document mixes"
        )
    if cfg.load_in_4bit:
        items.append(
            "4-bit weights are torchao's NF4 (QLoRA's blocks of 64; the scales' int8 second level is linear "
            "around their mean where bitsandbytes uses its dynamic map), so dequantized values differ by rounding; "
            "linears too small to split into whole scale groups and stacked MoE expert weights stay unquantized"
        )
    if cfg.load_in_8bit:
        items.append(
            "8-bit base weights are LLM.int8()'s row-wise absmax int8 codes, but each matmul runs in bf16 on the "
            "dequantized weight (bitsandbytes also quantizes the activations to int8 and keeps outlier features "
            "in fp16), so outputs are closer to the unquantized model's"
        )
    if cfg.val_set_size and cfg.eval_steps is None and cfg.evals_per_epoch is None and cfg.eval_strategy is None:
        items.append("with val_set_size and no evaluation cadence the held-out loss is computed once, at the end")
    return ("differs from Axolotl on purpose: " + "; ".join(items)) if items else None


def describe_run(cfg: TrainConfig, plan: RunPlan, *, ok: bool = True) -> str:
    layout = plan.layout
    rows_per_step = cfg.micro_batch_size * layout.batch_size * cfg.gradient_accumulation_steps
    tokens_per_step = rows_per_step * cfg.sequence_len
    tokens_per_rank = cfg.micro_batch_size * math.ceil(cfg.sequence_len / layout.cp)
    lines = [layout.describe(), *plan.notes]
    if plan.reason:
        lines.append(f"layout chosen by the planner: {plan.reason}")
    lines += [
        "batch:",
        f"  each data-parallel rank: {cfg.micro_batch_size} row(s) x {cfg.sequence_len} tokens per micro-step; "
        f"{tokens_per_rank} tokens per rank after the cp split",
        f"  per optimizer step: {rows_per_step} rows, {tokens_per_step:,} tokens "
        f"({cfg.gradient_accumulation_steps} micro-step(s) x {layout.batch_size} data-parallel rank(s))",
        f"config OK for {plan.world_size} process(es)" if ok else f"layout for {plan.world_size} process(es)",
    ]
    return "\n".join(lines)
