"""What a ``TrainConfig`` names, made ready for ``train/setup.setup``: hub files fetched once per node, the
tokenizer with the config's tokens and chat template, the dataset specs, and the optimizer.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial

import torch

from ndparallel.config.schema import TrainConfig
from ndparallel.data.files import resolve_data_path
from ndparallel.data.hub_files import snapshot_patterns
from ndparallel.data.load_tokenizer import add_config_tokens, load_tokenizer
from ndparallel.data.spec import DatasetSpec
from ndparallel.data.templates import template_source
from ndparallel.mesh.topology import init_distributed
from ndparallel.optim.adamw_8bit import build_adamw_8bit
from ndparallel.optim.build import build_optimizer
from ndparallel.safe_io import hub

# Waiting for one rank's downloads can take far longer than a collective should: a separate gloo group.
DOWNLOAD_TIMEOUT = timedelta(hours=12)


def hub_fetches(cfg: TrainConfig) -> list:
    """One ``fetch(download: bool)`` per hub id the config names (models and datasets)."""
    jobs = []
    if hub.is_hub_id(cfg.base_model):
        jobs.append(partial(_model, cfg.base_model, cfg.revision_of_model, True, cfg.trust_remote_code, "base_model"))
    if hub.is_hub_id(cfg.tokenizer_config) and cfg.tokenizer_config != cfg.base_model:
        jobs.append(partial(_model, cfg.tokenizer_config, None, False, cfg.trust_remote_code, "tokenizer_config"))
    for spec in dataset_specs(cfg, template=None):
        if hub.is_hub_id(spec.path):
            jobs.append(partial(_dataset, spec))
    return jobs


def _model(name, revision, weights, trust_remote_code, setting, download: bool) -> None:
    hub.model_dir(
        name,
        revision=revision,
        weights=weights,
        trust_remote_code=trust_remote_code,
        download=download,
        setting=setting,
    )


def _dataset(spec: DatasetSpec, download: bool) -> None:
    hub.dataset_dir(
        spec.path,
        revision=spec.revision,
        patterns=snapshot_patterns(spec),
        download=download,
        setting=f"datasets path {spec.path}",
    )


def fetch_run_inputs(cfg: TrainConfig, device_type: str) -> None:
    """Download what the config names from the hub: local rank 0 of each node fetches while the other ranks
    wait (on a gloo group with a long timeout), then every rank finds the files in its node's cache. Starts the
    process group for that. Nothing happens (and no collective runs) when the config names no hub id."""
    jobs = hub_fetches(cfg)
    if not jobs:
        return
    import torch.distributed as dist

    init_distributed(device_type=device_type, timeout_s=cfg.process_group_timeout_s)

    group = dist.new_group(backend="gloo", timeout=DOWNLOAD_TIMEOUT)

    def first_error(problem: str | None) -> str | None:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem, group=group)
        return next((p for p in problems if p), None)

    def fetch(download: bool) -> None:
        for job in jobs:
            job(download)

    hub.on_each_node(
        fetch,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        barrier=lambda: dist.barrier(group=group),
        all_ok=first_error,
    )


def base_model_dir(cfg: TrainConfig) -> str | None:
    """The local directory of base_model (its hub snapshot for a hub id), or None for random init."""
    if cfg.base_model is None:
        return None
    return str(
        hub.model_dir(
            cfg.base_model, revision=cfg.revision_of_model, trust_remote_code=cfg.trust_remote_code, download=False
        )
    )


def load_run_tokenizer(cfg: TrainConfig):
    """(tokenizer, tokens the config added): tokenizer_config (or base_model), special_tokens, tokens, and the
    chat template the config names (kept on the tokenizer, so checkpoints and exports carry it)."""
    name = cfg.tokenizer_config or cfg.base_model
    revision = cfg.revision_of_model if name == cfg.base_model else None
    tokenizer = load_tokenizer(
        name, revision=revision, tokenizer_type=cfg.tokenizer_type, trust_remote_code=cfg.trust_remote_code
    )
    specials = cfg.special_tokens.model_dump() if cfg.special_tokens else None
    added = add_config_tokens(tokenizer, specials, cfg.tokens)
    template = template_source(cfg.chat_template, cfg.chat_template_jinja, tokenizer.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer, added


def dataset_specs(cfg: TrainConfig, *, template: str | None) -> list[DatasetSpec]:
    """The datasets as the data pipeline reads them; each chat dataset gets its template's source (its own
    chat_template, else ``template``, the run's)."""
    specs = []
    max_record_bytes = int(cfg.dataset_max_record_mb * 2**20)
    for d in cfg.datasets:
        own = (
            template_source(d.chat_template, d.chat_template_jinja, template)
            if (d.chat_template or d.chat_template_jinja)
            else template
        )
        specs.append(
            DatasetSpec(
                path=resolve_data_path(d.path),
                type=d.type,
                split=d.split,
                field=d.field_messages or d.field,
                name=d.name,
                data_files=_files(d.data_files),
                revision=d.revision,
                ds_type=d.ds_type,
                role_key=d.role_key,
                content_key=d.content_key,
                roles=d.roles,
                roles_to_train=tuple(d.roles_to_train or ("assistant",)),
                drop_system_message=d.drop_system_message,
                chat_template=own if d.type in ("chat_template", "chat") else None,
                template_kwargs=dict(cfg.chat_template_kwargs),
                train_on_inputs=cfg.train_on_inputs,
                max_record_bytes=max_record_bytes,
                thinking_key=d.field_thinking or "reasoning_content",
                template_thinking_key=d.template_thinking_key or "reasoning_content",
            )
        )
    for p in cfg.pretraining_dataset or []:
        specs.append(
            DatasetSpec(
                path=resolve_data_path(p.path),
                type="completion",
                split=p.split,
                field=p.field or p.text_column,
                name=p.name,
                data_files=_files(p.data_files),
                revision=p.revision,
                skip=p.skip or 0,
                max_record_bytes=max_record_bytes,
            )
        )
    return specs


def _files(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def token_budget(cfg: TrainConfig, global_rows: int) -> int | None:
    """pretraining_dataset is read only as far as max_steps need: rows x sequence_len tokens, and a tenth more
    for packing's padding. None: read everything."""
    if not cfg.pretraining_dataset or cfg.datasets:
        return None
    return int(cfg.max_steps * global_rows * cfg.sequence_len * 1.1) + cfg.sequence_len


def row_arguments(cfg: TrainConfig, tokenizer, *, global_rows: int, output_dir) -> tuple[list[DatasetSpec], dict]:
    """The datasets and the keyword arguments of ``data.build.build_rows`` for this config: the one place
    where the config's data settings become the rows' (the trainer and the benchmarks that must read the
    trainer's rows use it)."""
    specs = dataset_specs(cfg, template=tokenizer.chat_template)
    return specs, dict(
        seq_len=cfg.sequence_len,
        packing=cfg.sample_packing or bool(cfg.pretraining_dataset),
        cache_dir=cfg.dataset_prepared_path or str(output_dir / "prepared"),
        long_rows=cfg.long_rows_policy,
        eval_fraction=cfg.val_set_size,
        seed=cfg.seed,
        min_len=cfg.min_sample_len,
        eval_packing=cfg.eval_packing,
        deduplicate=cfg.dataset_exact_deduplication,
        token_budget=token_budget(cfg, global_rows),
    )


def build_run_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW as the config says; the 8-bit variants are torchao's AdamW8bit (``optim8bit``)."""
    betas, eps = (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon
    if cfg.eight_bit_optimizer:
        return build_adamw_8bit(
            model,
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            betas=betas,
            eps=eps,
            device_type=device_type,
            setting=cfg.optimizer,
        )
    return build_optimizer(
        model,
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        betas=betas,
        eps=eps,
        fused=None if cfg.optimizer != "adamw_torch" else False,
        master_grads=False,  # the step only clips (clip_grad_norm_ with optimizer=) and steps: no fp32 .grad needed
    )
